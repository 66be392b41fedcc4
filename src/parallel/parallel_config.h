// How the ranks of one worker divide a model: tensor (tp), expert (ep) and data (dp) parallelism.
//
// A worker runs tp x dp ranks. Attention is split across the tp ranks of a data-parallel group
// (heads divided; k/v replicated when tp exceeds the KV heads) and the dp groups each own their
// requests and KV cache. The MoE experts are either replicated in every rank's shard (ep = 1: split
// by width across the tp ranks, like a dense MLP) or divided across all ranks (ep = tp x dp). These
// are the two layouts Relay deploys (design.md): prefill TP+EP (tp = ep, dp = 1: every rank sees
// every token, experts split, one reduction after attention and one after the MoE) and decode DP
// attention
// + EP MoE (tp = 1, dp = ep: each rank has its own tokens, which an all-to-all sends to the ranks
// of their experts and back). Tensor parallelism inside a DP group of an EP MoE (tp > 1 and dp > 1)
// would dispatch every token tp times and is refused.
#pragma once

#include <string>

namespace relay::parallel {

struct ParallelConfig {
  int tp = 1;  // tensor-parallel ranks per data-parallel group
  int ep = 1;  // expert-parallel ranks: 1 (experts in every shard) or tp x dp
  int dp = 1;  // data-parallel attention groups

  int world_size() const { return tp * dp; }
  // Throws relay::Error naming the option (--tp, --ep, --dp) when the combination is not one Relay
  // runs.
  void validate() const;
  std::string describe() const;  // "tp=2 ep=2 dp=1"
};

// Where global rank r (0 <= r < world_size) sits: rank = dp_rank * tp + tp_rank; its EP rank is r.
struct RankPlace {
  int tp_rank = 0;
  int dp_rank = 0;
  int ep_rank = 0;
};
RankPlace place_rank(const ParallelConfig& config, int rank);

// How the ranks of one worker are spread over processes, possibly on several hosts (SGLang's
// --nnodes / --node-rank / --dist-init-addr): node n hosts the contiguous global ranks
// [n W / nnodes, (n + 1) W / nnodes) of the W = tp x dp ranks. Node 0 is the leader (it runs the
// scheduler and the server and sends every step to the others); every node is started with the same
// flags but its own --node-rank, and they meet at node 0's --dist-init address.
struct NodeConfig {
  int nnodes = 1;
  int node_rank = 0;
  std::string dist_init;  // "HOST:PORT" node 0 listens on; required when nnodes > 1

  // Throws relay::Error naming the flag when the nodes cannot split `parallel`'s ranks evenly.
  void validate(const ParallelConfig& parallel) const;
  int ranks_per_node(const ParallelConfig& parallel) const {
    return parallel.world_size() / nnodes;
  }
  int first_rank(const ParallelConfig& parallel) const {
    return node_rank * ranks_per_node(parallel);
  }
  bool is_leader() const { return node_rank == 0; }
};

}  // namespace relay::parallel

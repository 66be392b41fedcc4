// See parallel_config.h.
#include "parallel/parallel_config.h"

#include "core/error.h"

namespace relay::parallel {

void ParallelConfig::validate() const {
  RELAY_CHECK(tp >= 1, "--tp must be at least 1, got ", tp);
  RELAY_CHECK(ep >= 1, "--ep must be at least 1, got ", ep);
  RELAY_CHECK(dp >= 1, "--dp must be at least 1, got ", dp);
  RELAY_CHECK(ep == 1 || ep == world_size(), "--ep ", ep,
              " must be 1 (experts in every shard) or --tp x --dp = ", world_size(),
              " (experts divided across all ranks)");
  RELAY_CHECK(tp == 1 || dp == 1, "--tp ", tp, " with --dp ", dp,
              " is not supported: data-parallel attention runs one rank per DP group (use --tp 1 "
              "--dp N --ep N "
              "for DP attention with expert parallelism, or --tp N --ep N for tensor parallelism)");
}

std::string ParallelConfig::describe() const { return str("tp=", tp, " ep=", ep, " dp=", dp); }

RankPlace place_rank(const ParallelConfig& c, int rank) {
  RELAY_CHECK(rank >= 0 && rank < c.world_size(), "rank ", rank, " outside [0, ", c.world_size(),
              ")");
  return RankPlace{rank % c.tp, rank / c.tp, rank};
}

void NodeConfig::validate(const ParallelConfig& parallel) const {
  RELAY_CHECK(nnodes >= 1, "--nnodes must be at least 1, got ", nnodes);
  RELAY_CHECK(node_rank >= 0 && node_rank < nnodes, "--node-rank ", node_rank, " is not in 0..",
              nnodes - 1, " (--nnodes ", nnodes, ")");
  if (nnodes == 1) {
    RELAY_CHECK(dist_init.empty(),
                "--dist-init connects the nodes of a multi-node worker; it "
                "needs --nnodes 2 or more");
    return;
  }
  RELAY_CHECK(!dist_init.empty(), "--nnodes ", nnodes,
              " needs --dist-init HOST:PORT, the address node 0 listens on");
  const int world = parallel.world_size();
  RELAY_CHECK(world % nnodes == 0 && world >= nnodes, "--nnodes ", nnodes, " cannot split the ",
              world, " ranks of ", parallel.describe(),
              " evenly: every node hosts the same number "
              "of ranks");
}

}  // namespace relay::parallel

// The GPU ranks of one process: one thread per rank, each rank on a CUDA device, peers reached by
// plain device pointers. This is how a sharded CudaBackend connects its ranks.
//
// Every rank gets one all-reduce window (all_reduce.h) and, for DP attention + EP MoE, one MoE
// window (moe_all_to_all.h), allocated with cudaMalloc on the rank's device and zeroed. In one
// process every device allocation has one address valid on every device of the process (unified
// addressing), so once peer access is enabled between every pair of distinct devices the
// allocation pointers themselves are the peer pointers the kernels take; ranks that share a device
// (two ranks on one GPU, which is how the one-GPU tests run a sharded backend) need nothing at all.
// No NCCL is involved: NCCL refuses two ranks on one device, and across threads of one process it
// would only add a bootstrap. Devices that cannot reach each other (no NVLink or PCIe P2P) are an
// error at construction naming the pair.
//
// ThreadPeerCommunicator is rank r's DeviceCommunicator: the one-shot / two-shot kernels chosen by
// all_reduce_select.h (bit-identical, rank-order sums), capturable in CUDA graphs. Every rank
// launches its own kernels on its own stream; a rank's blocks spin until the peers' blocks arrive,
// so ranks sharing one GPU rely on those spinning blocks leaving room for the others' work: the
// kernels use at most max_blocks blocks per rank, far fewer than one GPU holds.
//
// A rank that fails must not hang the others (peer_abort.h): the group's abort record is passed to
// every collective kernel, so when a rank's step throws (abandon) or a peer wait times out, every
// waiter leaves at once and the step fails on every rank; reset_after_abort then readies the
// windows for the next step.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "parallel/cuda/all_reduce.h"
#include "parallel/cuda/device_communicator.h"
#include "parallel/cuda/moe_all_to_all.h"
#include "parallel/cuda/peer_abort.h"

namespace relay::parallel::cuda {

struct ThreadPeerGroupOptions {
  size_t all_reduce_capacity_bytes = size_t{1} << 20;  // largest all-reduce message
  int max_tokens_per_rank = 0;  // > 0: allocate MoE dispatch/combine windows for this many tokens
  int hidden = 0, top_k = 0;    // the MoE windows' rows (with max_tokens_per_rank)
  int max_blocks = 16;          // blocks per rank of every collective kernel
  uint64_t peer_timeout_ms = 10'000;  // a peer wait longer than this abandons the step
};

class ThreadPeerGroup {
 public:
  // devices[r]: the CUDA device of rank r (repeats allowed). Allocates and zeroes every window.
  ThreadPeerGroup(std::vector<int> devices, const ThreadPeerGroupOptions& options);
  ~ThreadPeerGroup();
  ThreadPeerGroup(const ThreadPeerGroup&) = delete;
  ThreadPeerGroup& operator=(const ThreadPeerGroup&) = delete;

  int size() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_.at(rank); }
  const ThreadPeerGroupOptions& options() const { return options_; }

  // Rank r's communicator (owned by the group).
  DeviceCommunicator& communicator(int rank);

  // DP + EP MoE exchange as rank `rank` (options.max_tokens_per_rank > 0): dispatch its tokens to
  // the ranks of their experts; afterwards recv_*() of this rank hold what every source sent (see
  // moe_all_to_all.h), and combine sends the received rows' weighted sums back and adds up this
  // rank's tokens' results in rank order.
  const MoeWindowLayout& moe_layout() const { return moe_layout_; }
  void moe_dispatch(int rank, const bf16* hidden, const int32_t* topk_ids, const float* topk_weights,
                    int num_tokens, int num_experts, cudaStream_t stream) const;
  void moe_combine(int rank, const bf16* expert_out, bf16* out, int num_tokens,
                   cudaStream_t stream) const;
  // Rank r's receive buffers: [size() * max_tokens_per_rank] rows each.
  const bf16* recv_hidden(int rank) const;
  const int32_t* recv_ids(int rank) const;
  const float* recv_weights(int rank) const;
  // Rank r's receive counts on its device, [size()]: how many tokens each source sent in the last
  // dispatch (MoeSignals::recv_count), valid on rank r's stream after its moe_dispatch. The expert
  // ops take them as a bound (kernels::LiveRows with region_rows = max_tokens_per_rank), so their
  // work follows the tokens received and the launches keep the buffer's fixed shape.
  const int32_t* recv_counts(int rank) const;

  // Abandons the running step as rank `rank`, whose host side failed: every peer wait of every
  // rank, running or still to come, returns at once. The first rank to abandon is the one reported.
  void abandon(int rank);
  // Whether the running (or last) step was abandoned, by a rank or a timed-out wait, and why.
  bool abandoned() const;
  std::string abandon_reason() const;
  // After an abandoned step, once no kernel of the group runs (every rank's stream synchronized):
  // zeroes every window's flags, epochs and counters and clears the record, so the next step meets
  // its peers as the first one did.
  void reset_after_abort();

 private:
  class Communicator;

  // A dispatch or combine launch as `rank` alone, its shared fields filled (the rank's view of
  // every window, the layout, blocks and timeout); the caller adds its buffers.
  template <typename Params>
  Params moe_params(int rank, int num_tokens) const {
    Params p;
    p.ranks[0].num_tokens = num_tokens;
    p.ranks[0].rank = rank;
    for (int q = 0; q < size(); ++q) p.ranks[0].windows[q] = moe_windows_[q];
    p.layout = moe_layout_;
    p.max_blocks = options_.max_blocks;
    p.timeout_ns = options_.peer_timeout_ms * 1'000'000;
    p.abort = abort_;
    return p;
  }

  std::vector<int> devices_;
  ThreadPeerGroupOptions options_;
  std::vector<char*> all_reduce_windows_, moe_windows_;
  MoeWindowLayout moe_layout_;
  PeerAbort* abort_ = nullptr;  // pinned host memory, mapped into every device
  std::atomic<int> first_abandoned_{-1};
  std::vector<std::unique_ptr<Communicator>> communicators_;
};

}  // namespace relay::parallel::cuda

// MoE dispatch and combine for DP attention + EP MoE decode, over peer memory.
//
// Each of the R ranks has its own T_r <= max_tokens tokens (hidden bf16 [T_r, H], top-k global
// expert ids and weights [T_r, k]); experts are split contiguously, rank d holding
// [d E/R, (d+1) E/R). The exchange is the one SparseMoe::dispatch_combine does on the CPU
// (model/layers.cpp), with the same conventions:
//   dispatch: token t of rank s goes once to every rank d holding any of its experts: its hidden
//             row, its k weights (0 for experts held elsewhere) and its k expert ids local to d
//             (the "absent" id E/R for experts elsewhere). Rank s writes straight into d's window,
//             in region s at the slot = how many earlier tokens of s went to d (token order kept).
//   combine:  rank d sends, for every slot it received, its weighted expert sum back into rank s's
//             window (region d, same slot); rank s adds, per token, the rows from every d that got
//             it, in rank order, in fp32 from 0, rounded once to bf16 — bit-identical to the CPU
//             reference (collectives_reference.h).
//
// Buffers have fixed sizes (max_tokens per source), so no count exchange precedes the data and
// every launch is capturable in a CUDA graph. Each rank's window (MoeWindowLayout, offsets in
// bytes):
//   MoeSignals                                   flags, counts, local counters
//   recv_hidden   bf16  [R][max_tokens][H]       dispatched rows, region = source rank
//   recv_weights  fp32  [R][max_tokens][k]
//   recv_ids      int32 [R][max_tokens][k]       local expert ids; absent beyond a region's count
//   combine_recv  bf16  [R][max_tokens][H]       partial sums, region = destination rank
//   token_slots   int32 [max_tokens][kMaxRanks]  local: the slot token t got at rank d, or -1
// The expert layers' launches keep the whole receive buffer's shape — R x max_tokens rows, fixed,
// so decode graphs replay — and their work follows what arrived: they take MoeSignals::recv_count
// (ThreadPeerGroup::recv_counts) as a device-side bound, kernels::LiveRows with region_rows =
// max_tokens, and touch only the slots below each region's count. Slots beyond a source's count
// still get absent ids and zero weights, so an op run without the bound is correct too (the permute
// sorts them last with the absent expert, as in run_local_experts, and they are never computed).
// The expert output for the combine is [R x max_tokens, H] in the same row order; the combine
// reads back only the slots below the counts, so the other rows need not be written.
//
// Ordering (why no extra barrier protects buffer reuse): s's next dispatch into d's receive buffer
// follows s's combine, which waited for d's combine signal, which d sends only after its experts
// consumed the receive buffer (stream order on d). Likewise d's next combine into s's combine_recv
// follows the next dispatch, which s sends only after reducing the previous combine. Every source
// signals every destination each call, with zero tokens too.
//
// Dispatch: warps per token; the last block to finish (a counter in the window) signals every
// destination — count, then flag — and waits for every source's flag, so when the kernel ends the
// receive buffer is complete. Combine: every block sends, the last one signals, then every block
// waits for all destinations' flags and reduces its tokens; its blocks wait on each other, so the
// grid is small enough to be resident at once (checked at launch). As in all_reduce.h, a launch may
// serve several emulated ranks at once (blockIdx.y).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "parallel/cuda/all_reduce.h"
#include "parallel/cuda/peer_abort.h"

namespace relay::parallel::cuda {

constexpr int kMoeThreads = 512;

struct MoeSignals {
  uint32_t dispatch_flag[kMaxRanks];  // [source]: the last dispatch epoch rank s completed to us
  uint32_t combine_flag[kMaxRanks];  // [destination]: the last combine epoch rank d completed to us
  int32_t recv_count[kMaxRanks];     // [source]: tokens rank s sent in the last dispatch
  // Local to this rank (peers never touch them):
  uint32_t dispatch_epoch;  // dispatches completed
  uint32_t combine_epoch;   // combines completed
  uint32_t blocks_done;     // blocks of the running kernel that finished sending; reset by the last
};

struct MoeWindowLayout {
  int num_ranks = 1;
  int max_tokens = 0;  // per source rank
  int hidden = 0;      // multiple of 8 (16-byte rows)
  int top_k = 0;
  size_t recv_hidden = 0, recv_weights = 0, recv_ids = 0, combine_recv = 0, token_slots = 0;
  size_t total_bytes = 0;

  // Offsets for a group; throws relay::Error for shapes the kernels do not take.
  static MoeWindowLayout make(int num_ranks, int max_tokens, int hidden, int top_k);

  __host__ __device__ size_t row(int region, int slot) const {
    return static_cast<size_t>(region) * max_tokens + slot;
  }
};

// What a kernel running as one rank sees.
struct MoeDispatchRankView {
  const __nv_bfloat16* hidden;  // [num_tokens, H]
  const int32_t* topk_ids;      // [num_tokens, k] global expert ids in [0, num_experts)
  const float* topk_weights;    // [num_tokens, k]
  int num_tokens;               // 0..max_tokens
  int rank;
  char* windows[kMaxRanks];  // [num_ranks] every rank's MoE window, as this rank addresses it
};

struct MoeDispatchParams {
  MoeDispatchRankView ranks[kMaxRanks];  // [num_local_ranks]
  int num_local_ranks = 1;
  MoeWindowLayout layout;
  int num_experts = 0;  // divisible by layout.num_ranks
  int max_blocks = 32;
  uint64_t timeout_ns = 10'000'000'000;
  PeerAbort* abort = nullptr;  // the group's record (peer_abort.h); null: a late peer traps
};

struct MoeCombineRankView {
  const __nv_bfloat16* expert_out;  // [R * max_tokens, H] weighted sums, rows as recv_hidden
  __nv_bfloat16* out;               // [num_tokens, H] this rank's MoE output
  int num_tokens;                   // as in the dispatch just before
  int rank;
  char* windows[kMaxRanks];
};

struct MoeCombineParams {
  MoeCombineRankView ranks[kMaxRanks];  // [num_local_ranks]
  int num_local_ranks = 1;
  MoeWindowLayout layout;
  int max_blocks = 32;  // every block of every local rank must be resident at once
  uint64_t timeout_ns = 10'000'000'000;
  PeerAbort* abort = nullptr;  // the group's record (peer_abort.h); null: a late peer traps
};

void launch_moe_dispatch(const MoeDispatchParams& p, cudaStream_t stream);
void launch_moe_combine(const MoeCombineParams& p, cudaStream_t stream);

}  // namespace relay::parallel::cuda

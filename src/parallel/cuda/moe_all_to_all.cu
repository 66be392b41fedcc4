// See moe_all_to_all.h for the exchange, the window layout and the ordering argument.
//
// A token's slot at destination d is the number of earlier tokens of this rank that go to d. Every
// block first writes each token's destination mask (bit d: some expert of the token lives on d)
// into shared memory; a warp then counts, for its token, the earlier tokens per destination 32 at a
// time with ballots. That is O(T k / blockDim + T / 32) per warp — a few microseconds at most for
// decode batches — and needs no second kernel and no scan buffer.
#include <cuda_bf16.h>

#include <algorithm>

#include "core/error.h"
#include "parallel/cuda/cuda_check.h"
#include "parallel/cuda/moe_all_to_all.h"
#include "parallel/cuda/peer_sync.cuh"

namespace relay::parallel::cuda {
namespace {

constexpr int kWarps = kMoeThreads / 32;

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

__device__ __forceinline__ MoeSignals* signals(char* w) { return reinterpret_cast<MoeSignals*>(w); }

template <typename T>
__device__ __forceinline__ T* at(char* w, size_t offset) {
  return reinterpret_cast<T*>(w + offset);
}

// Copies a row of `hidden` bf16 (16-byte aligned, hidden % 8 == 0) with the warp's lanes.
__device__ __forceinline__ void copy_row(const __nv_bfloat16* src, __nv_bfloat16* dst, int hidden,
                                         int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  for (int i = lane; i < hidden / 8; i += 32) d[i] = __ldcg(s + i);
}

// Block-wide: true on every thread of the block that arrived last at the window's counter. Its
// thread 0 has reset the counter. Every earlier write of every block is released before counting.
__device__ __forceinline__ bool last_block_done(MoeSignals* mine, int num_blocks) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(&mine->blocks_done, 1u) == static_cast<unsigned>(num_blocks - 1);
    if (last) {
      mine->blocks_done = 0;
      __threadfence_system();  // the other blocks' writes (seen through the counter) before ours
    }
  }
  __syncthreads();
  return last;
}

__global__ void __launch_bounds__(kMoeThreads) moe_dispatch_kernel(const __grid_constant__ MoeDispatchParams p) {
  const MoeDispatchRankView& v = p.ranks[blockIdx.y];
  const MoeWindowLayout& L = p.layout;
  const int num_ranks = L.num_ranks, k = L.top_k, per_rank = p.num_experts / num_ranks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  extern __shared__ uint8_t masks[];  // [num_tokens] destination bits per token
  __shared__ int totals[kMaxRanks];   // tokens going to each destination

  for (int t = threadIdx.x; t < v.num_tokens; t += blockDim.x) {
    uint32_t m = 0;
    for (int j = 0; j < k; ++j) {
      const int e = v.topk_ids[static_cast<size_t>(t) * k + j];
      if (e < 0 || e >= p.num_experts) {
        printf("relay moe dispatch: rank %d token %d has expert id %d, not in [0, %d)\n", v.rank, t,
               e, p.num_experts);
        __trap();
      }
      m |= 1u << (e / per_rank);
    }
    masks[t] = static_cast<uint8_t>(m);
  }
  __syncthreads();
  if (warp == 0) {
    int count[kMaxRanks] = {};
    for (int base = 0; base < v.num_tokens; base += 32) {
      const uint32_t m = base + lane < v.num_tokens ? masks[base + lane] : 0;
      for (int d = 0; d < num_ranks; ++d) count[d] += __popc(__ballot_sync(~0u, (m >> d) & 1));
    }
    if (lane == 0)  // ballots give every lane the same counts
      for (int d = 0; d < num_ranks; ++d) totals[d] = count[d];
  }
  __syncthreads();

  int32_t* token_slots = at<int32_t>(v.windows[v.rank], L.token_slots);
  for (int t = blockIdx.x * kWarps + warp; t < v.num_tokens; t += gridDim.x * kWarps) {
    int slot[kMaxRanks] = {};
    for (int base = 0; base < t; base += 32) {
      const uint32_t m = base + lane < t ? masks[base + lane] : 0;
      for (int d = 0; d < num_ranks; ++d) slot[d] += __popc(__ballot_sync(~0u, (m >> d) & 1));
    }
    const uint32_t m = masks[t];
    if (lane == 0)
      for (int d = 0; d < kMaxRanks; ++d)
        token_slots[static_cast<size_t>(t) * kMaxRanks + d] = (m >> d) & 1 ? slot[d] : -1;
    for (int d = 0; d < num_ranks; ++d) {
      if (!((m >> d) & 1)) continue;
      char* w = v.windows[d];
      const size_t row = L.row(v.rank, slot[d]);
      copy_row(v.hidden + static_cast<size_t>(t) * L.hidden,
               at<__nv_bfloat16>(w, L.recv_hidden) + row * L.hidden, L.hidden, lane);
      for (int j = lane; j < k; j += 32) {
        const int e = v.topk_ids[static_cast<size_t>(t) * k + j];
        const bool there = e / per_rank == d;
        at<float>(w, L.recv_weights)[row * k + j] = there ? v.topk_weights[t * k + j] : 0.0f;
        at<int32_t>(w, L.recv_ids)[row * k + j] = there ? e - d * per_rank : per_rank;
      }
    }
  }

  // Unused slots of our region at every destination: absent experts, weight 0.
  const size_t pad_total = static_cast<size_t>(num_ranks) * L.max_tokens * k;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pad_total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(i / (static_cast<size_t>(L.max_tokens) * k));
    const int slot = static_cast<int>(i / k % L.max_tokens);
    if (slot < totals[d]) continue;
    const size_t at_row = L.row(v.rank, slot) * k + i % k;
    at<float>(v.windows[d], L.recv_weights)[at_row] = 0.0f;
    at<int32_t>(v.windows[d], L.recv_ids)[at_row] = per_rank;
  }

  MoeSignals* mine = signals(v.windows[v.rank]);
  if (!last_block_done(mine, gridDim.x)) return;
  const uint32_t epoch = mine->dispatch_epoch + 1;
  const int d = threadIdx.x;
  if (d < num_ranks) {
    MoeSignals* theirs = signals(v.windows[d]);
    theirs->recv_count[v.rank] = totals[d];
    signal_flag(&theirs->dispatch_flag[v.rank], epoch);
    wait_flag(&mine->dispatch_flag[d], epoch, p.timeout_ns, p.abort, PeerOp::kMoeDispatch, v.rank,
              d);
  }
  __syncthreads();
  if (threadIdx.x == 0) mine->dispatch_epoch = epoch;
}

__global__ void __launch_bounds__(kMoeThreads) moe_combine_kernel(const __grid_constant__ MoeCombineParams p) {
  const MoeCombineRankView& v = p.ranks[blockIdx.y];
  const MoeWindowLayout& L = p.layout;
  const int num_ranks = L.num_ranks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  MoeSignals* mine = signals(v.windows[v.rank]);
  __shared__ uint32_t epoch;
  __shared__ int counts[kMaxRanks];
  if (threadIdx.x == 0) epoch = mine->combine_epoch + 1;  // read before counting: see last_block
  if (threadIdx.x < num_ranks)
    counts[threadIdx.x] = __ldcg(&mine->recv_count[threadIdx.x]);  // written by the sources
  __syncthreads();

  // Send: every received row back to its source, region = our rank, same slot.
  const int total_rows = num_ranks * L.max_tokens;
  for (int r = blockIdx.x * kWarps + warp; r < total_rows; r += gridDim.x * kWarps) {
    const int s = r / L.max_tokens, slot = r % L.max_tokens;
    if (slot >= counts[s]) continue;
    copy_row(v.expert_out + static_cast<size_t>(r) * L.hidden,
             at<__nv_bfloat16>(v.windows[s], L.combine_recv) + L.row(v.rank, slot) * L.hidden,
             L.hidden, lane);
  }

  if (last_block_done(mine, gridDim.x)) {
    if (threadIdx.x < num_ranks)
      signal_flag(&signals(v.windows[threadIdx.x])->combine_flag[v.rank], epoch);
    if (threadIdx.x == 0) mine->combine_epoch = epoch;
  }
  if (threadIdx.x < num_ranks)
    wait_flag(&mine->combine_flag[threadIdx.x], epoch, p.timeout_ns, p.abort, PeerOp::kMoeCombine,
              v.rank, threadIdx.x);
  __syncthreads();

  // Reduce: per token, the partial sums of the ranks that got it, in rank order.
  const int32_t* token_slots = at<int32_t>(v.windows[v.rank], L.token_slots);
  const __nv_bfloat16* recv = at<__nv_bfloat16>(v.windows[v.rank], L.combine_recv);
  for (int t = blockIdx.x * kWarps + warp; t < v.num_tokens; t += gridDim.x * kWarps) {
    int slot[kMaxRanks];
    for (int d = 0; d < num_ranks; ++d)
      slot[d] = token_slots[static_cast<size_t>(t) * kMaxRanks + d];
    for (int i = lane; i < L.hidden / 8; i += 32) {
      float acc[8] = {};
      for (int d = 0; d < num_ranks; ++d) {
        if (slot[d] < 0) continue;
        const int4 raw =
            __ldcg(reinterpret_cast<const int4*>(recv + L.row(d, slot[d]) * L.hidden) + i);
        const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += __bfloat162float(x[j]);
      }
      int4 packed;
      __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = __float2bfloat16_rn(acc[j]);
      reinterpret_cast<int4*>(v.out + static_cast<size_t>(t) * L.hidden)[i] = packed;
    }
  }
}

void check_views(const MoeWindowLayout& L, int num_local_ranks, const char* what) {
  RELAY_CHECK(num_local_ranks >= 1 && num_local_ranks <= L.num_ranks, what, ": ", num_local_ranks,
              " local ranks of ", L.num_ranks);
}

void check_rank(const MoeWindowLayout& L, int rank, int num_tokens, char* const* windows,
                const void* rows, const char* what) {
  RELAY_CHECK(rank >= 0 && rank < L.num_ranks, what, ": rank ", rank, " of ", L.num_ranks);
  RELAY_CHECK(num_tokens >= 0 && num_tokens <= L.max_tokens, what, ": rank ", rank, " has ",
              num_tokens, " tokens, the buffers hold ", L.max_tokens);
  RELAY_CHECK(reinterpret_cast<uintptr_t>(rows) % 16 == 0, what, ": rank ", rank,
              "'s token rows are not 16-byte aligned");
  for (int q = 0; q < L.num_ranks; ++q)
    RELAY_CHECK(windows[q] != nullptr && reinterpret_cast<uintptr_t>(windows[q]) % 16 == 0, what,
                ": rank ", rank, "'s window for rank ", q, " is null or not 16-byte aligned");
}

}  // namespace

MoeWindowLayout MoeWindowLayout::make(int num_ranks, int max_tokens, int hidden, int top_k) {
  RELAY_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "MoE all-to-all: ", num_ranks,
              " ranks, supported 1..", kMaxRanks);
  RELAY_CHECK(max_tokens >= 1 && max_tokens <= 32768, "MoE all-to-all: max_tokens ", max_tokens,
              " not in 1..32768 (the token masks live in shared memory)");
  RELAY_CHECK(hidden >= 8 && hidden % 8 == 0, "MoE all-to-all: hidden ", hidden,
              " must be a positive multiple of 8 (rows move in 16-byte units)");
  RELAY_CHECK(top_k >= 1 && top_k <= 32, "MoE all-to-all: top_k ", top_k, " not in 1..32");
  MoeWindowLayout L;
  L.num_ranks = num_ranks;
  L.max_tokens = max_tokens;
  L.hidden = hidden;
  L.top_k = top_k;
  const size_t rows = static_cast<size_t>(num_ranks) * max_tokens;
  size_t at = align_up(sizeof(MoeSignals), 256);
  L.recv_hidden = at;
  at = align_up(at + rows * hidden * sizeof(__nv_bfloat16), 256);
  L.recv_weights = at;
  at = align_up(at + rows * top_k * sizeof(float), 256);
  L.recv_ids = at;
  at = align_up(at + rows * top_k * sizeof(int32_t), 256);
  L.combine_recv = at;
  at = align_up(at + rows * hidden * sizeof(__nv_bfloat16), 256);
  L.token_slots = at;
  at = align_up(at + static_cast<size_t>(max_tokens) * kMaxRanks * sizeof(int32_t), 256);
  L.total_bytes = at;
  return L;
}

void launch_moe_dispatch(const MoeDispatchParams& p, cudaStream_t stream) {
  const MoeWindowLayout& L = p.layout;
  check_views(L, p.num_local_ranks, "MoE dispatch");
  RELAY_CHECK(p.num_experts >= L.num_ranks && p.num_experts % L.num_ranks == 0,
              "MoE dispatch: ", p.num_experts, " experts do not divide over ", L.num_ranks,
              " ranks");
  RELAY_CHECK(p.max_blocks >= 1, "MoE dispatch: max_blocks ", p.max_blocks);
  int max_tokens_here = 0;
  for (int l = 0; l < p.num_local_ranks; ++l) {
    const MoeDispatchRankView& v = p.ranks[l];
    check_rank(L, v.rank, v.num_tokens, v.windows, v.hidden, "MoE dispatch");
    max_tokens_here = std::max(max_tokens_here, v.num_tokens);
  }
  const int blocks = std::clamp((max_tokens_here + kWarps - 1) / kWarps, 1, p.max_blocks);
  const size_t smem = static_cast<size_t>(L.max_tokens);
  const dim3 grid(blocks, p.num_local_ranks);
  // Only the last block of each rank waits, so a grid that does not fit still completes; emulated
  // ranks are checked anyway, since their last blocks wait on each other.
  if (p.num_local_ranks > 1)
    ensure_co_resident(moe_dispatch_kernel, grid, kMoeThreads, smem, "moe_dispatch");
  moe_dispatch_kernel<<<grid, kMoeThreads, smem, stream>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("moe_dispatch");
}

void launch_moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  const MoeWindowLayout& L = p.layout;
  check_views(L, p.num_local_ranks, "MoE combine");
  RELAY_CHECK(p.max_blocks >= 1, "MoE combine: max_blocks ", p.max_blocks);
  for (int l = 0; l < p.num_local_ranks; ++l) {
    const MoeCombineRankView& v = p.ranks[l];
    check_rank(L, v.rank, v.num_tokens, v.windows, v.out, "MoE combine");
    RELAY_CHECK(reinterpret_cast<uintptr_t>(v.expert_out) % 16 == 0, "MoE combine: rank ", v.rank,
                "'s expert_out is not 16-byte aligned");
  }
  const int rows = L.num_ranks * L.max_tokens;
  const int blocks = std::clamp((rows + kWarps - 1) / kWarps, 1, p.max_blocks);
  const dim3 grid(blocks, p.num_local_ranks);
  ensure_co_resident(moe_combine_kernel, grid, kMoeThreads, 0, "moe_combine");
  moe_combine_kernel<<<grid, kMoeThreads, 0, stream>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("moe_combine");
}

}  // namespace relay::parallel::cuda

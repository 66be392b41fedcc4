// Weight-streaming GEMMs for the few-row regime (decode): out[r] = x[r] @ w^T (+ bias), dense
// (every linear layer at up to kMaxStreamingRows rows) and grouped over experts (the MoE layers
// at a few rows per active expert).
//
// With one to eight rows the weights are all the bytes, so the kernel is a bandwidth stream: a CTA
// owns kCols output columns (weight rows) and its 128 threads (64 for a short k) cover k
// together, 16-byte loads of all kCols weight rows at once, kInFlight per row and thread issued
// before any is used. Splitting k over the whole CTA rather than giving each warp its own columns
// keeps every CTA short (one or two rounds of loads), so a launch is thousands of small CTAs that
// fill the chip in one wave; the warps' partial dot products meet in shared memory. x is read through the read-only cache:
// every CTA reads the same few rows.
//
// The dense kernel is launched with programmatic dependent launch (common.cuh): its first round of
// weight loads is issued before it waits for the kernel that produces x, so the weight stream
// starts under that kernel's tail. The grouped kernel must wait first when which experts it
// streams comes from the permute just before it (gate_up); the down projection's offsets were
// settled a kernel earlier (offsets_settled), so it streams early too.
//
// Gathered (MoeGroupedMatmulParams::permuted_index): x is the unpermuted tokens and each CTA
// inverts the permute's index into shared memory, so decode skips the permute's row copy.
//
// Gated (the experts' gate_up with SwiGLU fused, MoeGroupedMatmulParams::swiglu): a CTA's kCols
// weight rows are half gate and half the matching up rows, so its epilogue writes
// silu(gate) * up straight into the down projection's input.
//
// Grouped: only *active* experts (with rows) are visited, so batch 1 reads 8 experts' weights, not
// 128; an expert with more rows than kRows is taken kRows at a time (the re-read weights come from
// L2).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

// Threads per CTA: 128, or 64 where k is short (k / 8 <= kNarrowMaxVecs vectors: an MoE down
// projection), whose 128 threads would find one vector each or none, so that half of them issued
// no load of their own while they held the registers of more CTAs.
constexpr int kWideThreads = 128, kNarrowThreads = 64, kNarrowMaxVecs = 128;
constexpr int kCols = 8;         // output columns per CTA

struct StreamingArgs {
  const bf16* x;                  // [num_rows, k]
  const bf16* w;                  // [num_experts, n, k] (dense: one expert)
  const bf16* bias;               // [n] or null (dense only)
  const int32_t* expert_offsets;  // [num_experts + 1], or null: dense over rows [0, num_rows)
  bf16* out;                      // [num_rows, n], gated: [num_rows, n / 2]
  int num_rows, num_experts, n, k;
  const int32_t* permuted_index;  // or null; set: x holds the unpermuted tokens (gathered rows)
  int top_k;
  bool offsets_settled;  // MoeGroupedMatmulParams::offsets_settled
};

// Output columns per unit: a gated unit's kCols weight rows are kCols / 2 gate rows and the up rows
// of the same columns, so its epilogue has both halves of each SwiGLU.
template <bool kGated>
constexpr int kOutCols = kGated ? kCols / 2 : kCols;

constexpr int kMaxExpertChunks = 16;  // experts in chunks of 32 (one ballot each)
constexpr int kMaxExperts = 32 * kMaxExpertChunks;

// One unit of work: a tile of output columns of one expert and that expert's rows.
struct StreamingUnit {
  const bf16* w;  // the expert's weight [n, k]
  int n0, begin, end;
};

// Unit u: for the grouped form, column tile u % tiles of the (u / tiles)-th active expert, found
// from the CTA's shared copy of the offsets and the per-chunk masks of active experts.
__device__ __forceinline__ StreamingUnit unit_of(const StreamingArgs& a, int u, int tiles, int out_cols, int chunks,
                                                 const int32_t* offsets, const unsigned* active_mask,
                                                 const int* active_before, bool grouped) {
  if (!grouped) return StreamingUnit{a.w, u * out_cols, 0, a.num_rows};
  const int index = u / tiles;
  int j = 0;
  while (j + 1 < chunks && active_before[j + 1] <= index) ++j;
  const int e = j * 32 + static_cast<int>(__fns(active_mask[j], 0, index - active_before[j] + 1));
  return StreamingUnit{a.w + static_cast<int64_t>(e) * a.n * a.k, (u % tiles) * out_cols, offsets[e], offsets[e + 1]};
}

// The weight vectors [v0, v0 + kInFlight * kThreads) of a unit's kCols weight rows; columns past
// the output re-read its last one and vectors past k the last vector (valid addresses, results
// unused).
template <int kThreads, int kInFlight, bool kGated>
__device__ __forceinline__ void load_unit(Bf16x8 (&raw)[kInFlight][kCols], const StreamingArgs& a,
                                          const StreamingUnit& un, int v0) {
  const int k_vecs = a.k / 8;
  const int width = kGated ? a.n / 2 : a.n;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int col = min(un.n0 + c % kOutCols<kGated>, width - 1);
    const int w_row = kGated && c >= kOutCols<kGated> ? width + col : col;
    const Bf16x8* row = reinterpret_cast<const Bf16x8*>(un.w + static_cast<int64_t>(w_row) * a.k);
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      load_streaming_16(reinterpret_cast<uint32_t(&)[4]>(raw[i][c]), row + min(v0 + i * kThreads, k_vecs - 1));
    }
  }
}

// The work is a list of units (active expert, column tile): one expert for the dense form, the
// experts with rows for the grouped one, counted on the device. CTAs (as many as are resident at
// once) take units in a stride, so all of them stay busy however the routing concentrates, and a
// unit's first weight loads are issued before the previous unit's sums are reduced and stored:
// every SM keeps loads in flight from its first unit to its last instead of draining at each end
// (one tile per CTA ran at a third of the copy bandwidth; a fixed share of CTAs per possible
// expert left most of the chip idle when a batch's tokens picked the same experts).
template <int kRows, int kInFlight, bool kGated, int kThreads>
__global__ void __launch_bounds__(kThreads) streaming_gemm_kernel(StreamingArgs a) {
  constexpr int kOut = kOutCols<kGated>;
  __shared__ float partial[kThreads / 32][kRows][kCols];
  __shared__ int32_t offsets[kMaxExperts + 1];
  __shared__ unsigned active_mask[kMaxExpertChunks];
  __shared__ int active_before[kMaxExpertChunks];  // active experts in the chunks before
  __shared__ int num_active;
  __shared__ int32_t token_of[kMaxGatheredRows];  // gathered rows: permuted row -> its token
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool grouped = a.expert_offsets != nullptr;
  const int width = kGated ? a.n / 2 : a.n;  // output columns
  const int tiles = (width + kOut - 1) / kOut;
  const int chunks = (a.num_experts + 31) / 32;
  int units = tiles;
  // Waiting on the kernel before: before the weights' first loads, unless the weights depend on
  // the offsets and those come from that kernel (the permute).
  const bool wait_first = grouped && !a.offsets_settled;
  if (wait_first) {
    wait_on_prior_grid();
    release_dependent_grid();
  }
  if (grouped) {
    // Through L2: settled offsets may be read while the kernel before still runs.
    for (int e = threadIdx.x; e <= a.num_experts; e += kThreads) offsets[e] = __ldcg(a.expert_offsets + e);
    if (a.permuted_index != nullptr) {
      for (int i = threadIdx.x; i < a.num_rows; i += kThreads) token_of[__ldcg(a.permuted_index + i)] = i / a.top_k;
    }
    __syncthreads();
    if (warp == 0) {
      int count = 0;
      for (int j = 0; j < chunks; ++j) {
        const int e = j * 32 + lane;
        const unsigned mask = __ballot_sync(0xffffffffu, e < a.num_experts && offsets[e + 1] > offsets[e]);
        if (lane == 0) {
          active_mask[j] = mask;
          active_before[j] = count;
        }
        count += __popc(mask);
      }
      if (lane == 0) num_active = count;
    }
    __syncthreads();
    units = num_active * tiles;
  }
  const int k_vecs = a.k / 8;
  Bf16x8 raw[kInFlight][kCols];
  int u = blockIdx.x;
  if (u >= units) {  // grouped only: the dense grid never exceeds its tiles
    if (!wait_first) wait_on_prior_grid();  // every thread waits before it exits (common.cuh)
    return;
  }
  StreamingUnit cur = unit_of(a, u, tiles, kOut, chunks, offsets, active_mask, active_before, grouped);
  load_unit<kThreads, kInFlight, kGated>(raw, a, cur, threadIdx.x);
  if (!wait_first) {
    wait_on_prior_grid();  // x comes from the kernel before; the weights did not
    release_dependent_grid();
  }
  bool loaded = true;  // raw holds the first step of cur's first pass
  const Bf16x8* x = reinterpret_cast<const Bf16x8*>(a.x);
  for (; u < units; u += gridDim.x) {
    StreamingUnit next = cur;
    for (int row0 = cur.begin; row0 < cur.end; row0 += kRows) {
      const int rows = min(kRows, cur.end - row0);
      float acc[kRows][kCols] = {};
      for (int v0 = threadIdx.x; v0 < k_vecs; v0 += kThreads * kInFlight) {
        if (!loaded) load_unit<kThreads, kInFlight, kGated>(raw, a, cur, v0);
        loaded = false;
#pragma unroll
        for (int i = 0; i < kInFlight; ++i) {
          const int v = v0 + i * kThreads;
          if (v >= k_vecs) break;
          float xf[kRows][8];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (r < rows) {
              const int64_t x_row = a.permuted_index != nullptr ? token_of[row0 + r] : row0 + r;
              // x: re-read by every CTA, so through the read-only cache (ld.global.nc).
              const uint4 q = __ldg(reinterpret_cast<const uint4*>(x + x_row * k_vecs + v));
              bf16x8_to_f32(reinterpret_cast<const Bf16x8&>(q), xf[r]);
            }
          }
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            float wf[8];
            bf16x8_to_f32(raw[i][c], wf);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              if (r < rows) {
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][c] += xf[r][e] * wf[e];
              }
            }
          }
        }
      }
      // The next unit's first loads go out before this one's reduction.
      if (row0 + kRows >= cur.end && u + static_cast<int>(gridDim.x) < units) {
        next = unit_of(a, u + gridDim.x, tiles, kOut, chunks, offsets, active_mask, active_before, grouped);
        load_unit<kThreads, kInFlight, kGated>(raw, a, next, threadIdx.x);
        loaded = true;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const float sum = warp_sum(acc[r][c]);
          if (lane == 0) partial[warp][r][c] = sum;
        }
      }
      __syncthreads();
      if (threadIdx.x < kRows * kOut) {
        const int r = threadIdx.x / kOut, c = threadIdx.x % kOut;
        if (r < rows && cur.n0 + c < width) {
          float sum = a.bias != nullptr ? __bfloat162float(a.bias[cur.n0 + c]) : 0.0f;
#pragma unroll
          for (int wp = 0; wp < kThreads / 32; ++wp) sum += partial[wp][r][c];
          if constexpr (kGated) {
            // Both products rounded to bf16 as the separate GEMM stores them, then swiglu_kernel's
            // expression.
            float up = 0.0f;
#pragma unroll
            for (int wp = 0; wp < kThreads / 32; ++wp) up += partial[wp][r][c + kOut];
            sum = silu_mul(__bfloat162float(__float2bfloat16(sum)), __bfloat162float(__float2bfloat16(up)));
          }
          a.out[static_cast<int64_t>(row0 + r) * width + cur.n0 + c] = __float2bfloat16(sum);
        }
      }
      __syncthreads();  // partial is rewritten by the next pass
    }
    cur = next;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The grid: the CTAs resident on the device at once, or fewer when there are fewer units (at most
// `experts` active experts x column tiles).
template <int kRows, int kInFlight, bool kGated = false, int kThreads = kWideThreads>
void run(const StreamingArgs& a, int experts, cudaStream_t s) {
  const int width = kGated ? a.n / 2 : a.n;
  const int64_t units = static_cast<int64_t>(experts) * ceil_div(width, kOutCols<kGated>);
  const auto kernel = streaming_gemm_kernel<kRows, kInFlight, kGated, kThreads>;
  static const int resident = resident_ctas(kernel, kThreads, 0);
  const int grid = static_cast<int>(std::min<int64_t>(resident, units));
  launch_dependent("streaming_gemm_kernel", kernel, dim3(grid), dim3(kThreads), 0, s, a);
}

}  // namespace

bool streaming_matmul_supported(const MatmulParams<bf16>& p) {
  return p.m > 0 && p.m <= kMaxStreamingRows && p.k % 8 == 0 && aligned16(p.x) && aligned16(p.w);
}

void launch_streaming_matmul(const MatmulParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(streaming_matmul_supported(p), "streaming matmul: m ", p.m, " (1 to ", kMaxStreamingRows,
              "), k ", p.k, " (a multiple of 8) and 16-byte aligned x and w");
  const StreamingArgs a{p.x, p.w, p.bias, nullptr, p.out, p.m, 1, p.n, p.k, nullptr, 0, false};
  // Rows past the first two make the accumulators and in-flight loads compete for registers, so
  // wide k takes twice the loads in flight only at one or two rows.
  const bool wide = p.k / 8 > kWideThreads * 2;
  if (p.m == 1) {
    wide ? run<1, 4>(a, 1, s) : run<1, 2>(a, 1, s);
  } else if (p.m == 2) {
    wide ? run<2, 4>(a, 1, s) : run<2, 2>(a, 1, s);
  } else if (p.m <= 4) {
    run<4, 2>(a, 1, s);
  } else {
    run<8, 2>(a, 1, s);
  }
}

void launch_streaming_grouped_matmul(const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.k % 8 == 0 && aligned16(p.x) && aligned16(p.w), "streaming grouped matmul: k ", p.k,
              " must be a multiple of 8 and x, w 16-byte aligned");
  RELAY_CHECK(p.num_experts <= kMaxExperts, "streaming grouped matmul: ", p.num_experts, " experts (at most ",
              kMaxExperts, ")");
  if (p.num_rows == 0) return;
  RELAY_CHECK(!p.swiglu || p.n % 2 == 0, "streaming grouped matmul: swiglu needs an even n (gate | up), got ", p.n);
  RELAY_CHECK(p.permuted_index == nullptr || (p.top_k > 0 && p.num_rows % p.top_k == 0 && p.num_rows <= kMaxGatheredRows),
              "streaming grouped matmul: gathered rows need top_k (", p.top_k, ") dividing num_rows (", p.num_rows,
              ") and at most ", kMaxGatheredRows, " rows");
  const StreamingArgs a{p.x,           p.w,   nullptr, p.expert_offsets, p.out,
                        p.num_rows,    p.num_experts, p.n, p.k, p.permuted_index,
                        p.top_k,       p.offsets_settled};
  const int experts = std::min(p.num_rows, p.num_experts);
  // Two rows per pass: Auto sends only batches of about one row per active expert here (experts
  // with more are re-streamed from L2, a pass per two rows).
  // The gated form takes the CTA size the plain one takes at this k: the same sums in the same
  // order, so the fused SwiGLU stays bit-identical to the GEMM + swiglu.
  const bool narrow = p.k / 8 <= kNarrowMaxVecs;
  if (p.swiglu) {
    narrow ? run<2, 2, true, kNarrowThreads>(a, experts, s) : run<2, 2, true>(a, experts, s);
  } else {
    narrow ? run<2, 2, false, kNarrowThreads>(a, experts, s) : run<2, 2>(a, experts, s);
  }
}

}  // namespace relay::kernels

// Dynamic activation quantisation for the FP8 GEMMs (see fp8_cuda.h): bf16 rows -> e4m3 codes and
// one scale per group along k (fp32 amax / 448 for the 128-groups of the block-scaled path, an E8M0
// power of two for the 32-groups of MXFP8).
//
// A group is owned by consecutive lanes, 8 elements (one 16-byte bf16 load) each: 16 lanes for a
// 128-group, 4 for a 32-group; the group's amax is a butterfly max over those lanes, so a warp
// quantises two (or eight) groups per pass with no shared memory. Every arithmetic step mirrors the
// CPU recipe in quant/weight_quant.cpp: IEEE division for the scale and for x / scale, exact
// power-of-two scaling for MX, and the hardware's saturating round-to-nearest-even e4m3 conversion,
// which equals f32_to_e4m3 after the CPU's clamp. So the codes and scales are bit-identical.
//
// With a kernels::LiveRows bound (the DP + EP receive buffer), the block-scaled quantiser and the
// permutation of quantised rows walk only the live rows: each CTA builds the bound's LiveRowMap in
// shared memory, and a capped grid strides over the live work instead of one thread per capacity
// element.
#include <cuda_fp8.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kQuantThreads = 256;
constexpr float kE4m3Max = 448.0f;
// Grids of bounded launches (the live row count is known only on the device): enough CTAs to fill
// an H200 several times over, striding over the live work.
constexpr int kMaxLiveGridCtas = 2048;

int live_grid(int ctas, bool bounded) { return bounded ? std::min(ctas, kMaxLiveGridCtas) : ctas; }

// Thread 0 builds the CTA's map of the live rows; every thread returns after the barrier.
__device__ __forceinline__ void load_live_map(LiveRowMap& map, const LiveRows& live, int num_rows) {
  if (threadIdx.x == 0) map = live_row_map(live, num_rows);
  __syncthreads();
}

// Eight floats -> eight e4m3 codes (little-endian in the result: element 0 in the lowest byte).
__device__ __forceinline__ uint2 f32x8_to_e4m3(const float* v) {
  uint32_t word[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(v[4 * h], v[4 * h + 1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[4 * h + 2], v[4 * h + 3]),
                                                 __NV_SATFINITE, __NV_E4M3);
    word[h] = lo | (hi << 16);
  }
  return make_uint2(word[0], word[1]);
}

// Max over the `kLanes` consecutive lanes that own one group (a butterfly that stays inside them).
template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Loads the 8 values at column c of row `row` as floats: the bf16 input itself, or for the fused
// SwiGLU form bf16(silu(gate) * up) with launch_swiglu's exact expression (silu_mul, then one
// rounding to bf16), so the quantiser sees the values launch_swiglu would have stored.
template <bool kSwiglu>
__device__ __forceinline__ void load_row_values(const bf16* x, int64_t row, int k, int c,
                                                float* v) {
  if constexpr (kSwiglu) {
    const bf16* gate = x + row * 2 * k;
    float g[8], u[8];
    bf16x8_to_f32(*reinterpret_cast<const Bf16x8*>(gate + c), g);
    bf16x8_to_f32(*reinterpret_cast<const Bf16x8*>(gate + k + c), u);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      v[e] = __bfloat162float(__float2bfloat16_rn(silu_mul(g[e], u[e])));
  } else {
    bf16x8_to_f32(*reinterpret_cast<const Bf16x8*>(x + row * k + c), v);
  }
}

// One 128-group per 16 lanes: scale = amax / 448 (1 for an all-zero group), q = e4m3(x / scale).
// A unit is one (live row, group); unbounded, the grid has a thread group per unit and the loop
// runs once.
template <bool kSwiglu>
__global__ void __launch_bounds__(kQuantThreads)
    fp8_act_quant_kernel(const bf16* x, uint8_t* q, float* scale, int num_rows, int k,
                         bool group_major_scales, LiveRows live_rows) {
  constexpr int kLanes = kFp8BlockSize / 8;
  constexpr int kUnitsPerCta = kQuantThreads / kLanes;
  __shared__ LiveRowMap live;
  load_live_map(live, live_rows, num_rows);
  const int groups = (k + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t num_units = int64_t{live.total()} * groups;
  const int part = threadIdx.x % kLanes;
  // NOTE: the loop bound is the CTA's, so every lane of a warp runs every iteration and lanes past
  // the end still take part in the shuffles (full-warp masks), with no data.
  for (int64_t first = int64_t{blockIdx.x} * kUnitsPerCta; first < num_units;
       first += int64_t{gridDim.x} * kUnitsPerCta) {
    const int64_t unit = first + threadIdx.x / kLanes;
    const int g = static_cast<int>(unit % groups);
    const int c = g * kFp8BlockSize + part * 8;
    const bool valid = unit < num_units && c < k;
    const int64_t row = valid ? live.row(static_cast<int>(unit / groups)) : 0;
    float v[8] = {};
    if (valid) load_row_values<kSwiglu>(x, row, k, c, v);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
    amax = group_max<kLanes>(amax);
    const float s = amax > 0.0f ? __fdiv_rn(amax, kE4m3Max) : 1.0f;
    if (!valid) continue;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = __fdiv_rn(v[e], s);
    *reinterpret_cast<uint2*>(q + row * k + c) = f32x8_to_e4m3(v);
    if (part == 0) scale[group_major_scales ? g * int64_t{num_rows} + row : row * groups + g] = s;
  }
}

// The E8M0 code of e8m0_scale_code_for_amax: the smallest e with amax <= 448 * 2^(e - 127).
__device__ __forceinline__ int e8m0_code_for_amax(float amax) {
  if (amax == 0.0f) return 0;
  int exponent = 0;
  const float fraction = frexpf(amax, &exponent);
  return max(exponent - 9 + (fraction > 0.875f ? 1 : 0) + 127, 0);
}

// 2^e for e in [-127, 127], exactly (2^-127 is an fp32 subnormal).
__device__ __forceinline__ float exact_pow2(int e) {
  return e >= -126 ? __int_as_float((e + 127) << 23) : __int_as_float(0x00400000);
}

// One 32-group per 4 lanes: q = e4m3(x * 2^(127 - code)), an exact scaling as the CPU's ldexp.
__global__ void __launch_bounds__(kQuantThreads)
    mxfp8_act_quant_kernel(Mxfp8ActQuantParams<bf16> p) {
  constexpr int kLanes = kMxGroupSize / 8;
  const int groups = (p.k + kMxGroupSize - 1) / kMxGroupSize;
  const int64_t unit = (blockIdx.x * static_cast<int64_t>(kQuantThreads) + threadIdx.x) / kLanes;
  const int part = threadIdx.x % kLanes;
  const int64_t row = unit / groups;
  const int g = static_cast<int>(unit % groups);
  const int c = g * kMxGroupSize + part * 8;
  const bool valid = row < p.num_tokens && c < p.k;
  float v[8] = {};
  if (valid) load_row_values<false>(p.x, row, p.k, c, v);
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
  amax = group_max<kLanes>(amax);
  const int code = e8m0_code_for_amax(amax);
  if (!valid) return;
  const float factor = exact_pow2(127 - code);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(v[e], factor);
  *reinterpret_cast<uint2*>(p.q + row * p.k + c) = f32x8_to_e4m3(v);
  if (part == 0) p.scale[row * groups + g] = static_cast<uint8_t>(code);
}

int quant_blocks(int64_t rows, int64_t groups, int lanes_per_group) {
  return ceil_div(rows * groups * lanes_per_group, kQuantThreads);
}

constexpr int kPermuteWarps = 8;

// One warp per token (unbounded) or, with live_tokens, warps striding over the live tokens; rows
// outside copied_rows are skipped by the whole warp.
__global__ void __launch_bounds__(kPermuteWarps * 32) fp8_permute_rows_kernel(Fp8PermuteRowsParams p) {
  __shared__ LiveRowMap live;
  load_live_map(live, p.live_tokens, p.num_tokens);
  const int lane = threadIdx.x & 31;
  const int vecs = p.k / 16, groups = (p.k + kFp8BlockSize - 1) / kFp8BlockSize;
  for (int v_tok = blockIdx.x * kPermuteWarps + (threadIdx.x >> 5); v_tok < live.total();
       v_tok += gridDim.x * kPermuteWarps) {
    const int64_t t = live.row(v_tok);
    const int dest = lane < p.top_k ? copy_destination(p.permuted_index, p.copied_rows, t, p.top_k, lane) : -1;
    const uint4* src = reinterpret_cast<const uint4*>(p.q + t * p.k);
    const float* src_scale = p.scale + t * groups;
    for (int base = 0; base < vecs; base += 64) {  // two 16-byte loads per lane before the stores
      const int i0 = base + lane, i1 = base + 32 + lane;
      const uint4 v0 = i0 < vecs ? src[i0] : uint4{}, v1 = i1 < vecs ? src[i1] : uint4{};
      for (int j = 0; j < p.top_k; ++j) {
        const int64_t row = __shfl_sync(0xffffffffu, dest, j);
        if (row < 0) continue;
        uint4* dst = reinterpret_cast<uint4*>(p.permuted_q + row * p.k);
        if (i0 < vecs) dst[i0] = v0;
        if (i1 < vecs) dst[i1] = v1;
      }
    }
    for (int j = 0; j < p.top_k; ++j) {
      const int64_t row = __shfl_sync(0xffffffffu, dest, j);
      if (row < 0) continue;
      for (int g = lane; g < groups; g += 32) p.permuted_scale[row * groups + g] = src_scale[g];
    }
  }
}

}  // namespace

void launch_fp8_permute_rows(const Fp8PermuteRowsParams& p, cudaStream_t s) {
  RELAY_CHECK(p.k % 16 == 0 && p.top_k >= 1 && p.top_k <= 32, "fp8_permute_rows: k ", p.k,
              " must be a multiple of 16 and top_k ", p.top_k, " in [1, 32]");
  RELAY_CHECK(live_rows_valid(p.live_tokens, p.num_tokens),
              "fp8_permute_rows: live_tokens.region_rows ", p.live_tokens.region_rows,
              " must be positive with at most ", kMaxLiveRegions, " regions over ", p.num_tokens,
              " tokens");
  RELAY_CHECK(live_rows_valid(p.copied_rows, int64_t{p.num_tokens} * p.top_k),
              "fp8_permute_rows: copied_rows.region_rows ", p.copied_rows.region_rows,
              " must be positive with at most ", kMaxLiveRegions, " regions over ",
              int64_t{p.num_tokens} * p.top_k, " rows");
  if (p.num_tokens == 0) return;
  const int blocks =
      live_grid(ceil_div(p.num_tokens, kPermuteWarps), p.live_tokens.counts != nullptr);
  fp8_permute_rows_kernel<<<blocks, kPermuteWarps * 32, 0, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("fp8_permute_rows_kernel");
}

void launch_fp8_act_quant(const Fp8ActQuantParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.k > 0 && p.k % 8 == 0 && p.num_tokens >= 0, "fp8_act_quant: k ", p.k,
              " must be a positive multiple of 8, num_tokens ", p.num_tokens, " non-negative");
  RELAY_CHECK(p.group_size == kFp8BlockSize, "fp8_act_quant: group_size ", p.group_size,
              " is not supported on the GPU (only ", kFp8BlockSize, ")");
  RELAY_CHECK(live_rows_valid(p.live_tokens, p.num_tokens),
              "fp8_act_quant: live_tokens.region_rows ", p.live_tokens.region_rows,
              " must be positive with at most ", kMaxLiveRegions, " regions over ", p.num_tokens,
              " tokens");
  if (p.num_tokens == 0) return;
  const int groups = ceil_div(p.k, kFp8BlockSize);
  const int blocks = live_grid(quant_blocks(p.num_tokens, groups, kFp8BlockSize / 8),
                               p.live_tokens.counts != nullptr);
  fp8_act_quant_kernel<false><<<blocks, kQuantThreads, 0, s>>>(p.x, p.q, p.scale, p.num_tokens, p.k,
                                                               p.group_major_scales, p.live_tokens);
  RELAY_CUDA_CHECK_LAUNCH("fp8_act_quant_kernel");
}

void launch_swiglu_fp8_quant(const SwigluFp8QuantParams& p, cudaStream_t s) {
  RELAY_CHECK(p.width > 0 && p.width % 8 == 0 && p.num_rows >= 0, "swiglu_fp8_quant: width ",
              p.width, " must be a positive multiple of 8, num_rows ", p.num_rows, " non-negative");
  RELAY_CHECK(live_rows_valid(p.live_rows, p.num_rows), "swiglu_fp8_quant: live_rows.region_rows ",
              p.live_rows.region_rows, " must be positive with at most ", kMaxLiveRegions,
              " regions over ", p.num_rows, " rows");
  if (p.num_rows == 0) return;
  const int groups = ceil_div(p.width, kFp8BlockSize);
  const int blocks = live_grid(quant_blocks(p.num_rows, groups, kFp8BlockSize / 8),
                               p.live_rows.counts != nullptr);
  fp8_act_quant_kernel<true><<<blocks, kQuantThreads, 0, s>>>(
      p.gate_up, p.q, p.scale, p.num_rows, p.width, p.group_major_scales, p.live_rows);
  RELAY_CUDA_CHECK_LAUNCH("fp8_act_quant_kernel<swiglu>");
}

void launch_mxfp8_act_quant(const Mxfp8ActQuantParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.k > 0 && p.k % 8 == 0 && p.num_tokens >= 0, "mxfp8_act_quant: k ", p.k,
              " must be a positive multiple of 8, num_tokens ", p.num_tokens, " non-negative");
  if (p.num_tokens == 0) return;
  const int groups = ceil_div(p.k, kMxGroupSize);
  mxfp8_act_quant_kernel<<<quant_blocks(p.num_tokens, groups, kMxGroupSize / 8),
                           kQuantThreads, 0, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("mxfp8_act_quant_kernel");
}

}  // namespace relay::kernels

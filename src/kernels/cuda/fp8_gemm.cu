// FP8 GEMMs on mma.sync m16n8k32 (e4m3 x e4m3 -> fp32): out[r] = dequant(x[r]) @ dequant(w[e])^T
// for the rows r of each expert e, or for all rows of a dense weight (the same kernels with the
// whole of m as one expert: expert_offsets null). The contract is kernels/fp8_ops.h's.
//
// Tiled (prefill; also the MXFP8 path): CTA tiles of kBm x 128 output and one 128-byte slice of k
// per cp.async stage, 8 warps of 2 (m) x 4 (n), XOR-swizzled shared memory. An e4m3 m16n8k32
// fragment has exactly the byte layout of a bf16 m16n8k16 one (16 bytes = 8 b16 per ldmatrix row),
// so ldmatrix.b16 loads both operands unchanged. Block-scaled: one stage is one 128-block of both
// operands; its four k32 steps accumulate into zeroed fp32 fragments, which are then multiplied by
// x_scale[row, b] * w_scale[e, n / 128, b] and added to the accumulators (DeepGEMM's promotion;
// the CTA's 128 columns share one weight-scale row). MXFP8: every k32 step is one MX group, so its
// product is scaled per element by sx[row, g] * sw[col, g] right away. CTAs find their (expert,
// m tile) by a warp scan of expert_offsets, so the host never reads the routing.
// Streaming (decode, block-scaled): the weights dominate the bytes. A CTA owns 16 weight rows
// (output columns) of one active expert and streams them over all of k with 16-byte non-allocating
// loads, its 4 warps taking alternate k-blocks; the expert's rows (up to 8 per pass) are the
// narrow n8 operand of the same mma, loaded straight from L2. The weight rows are the m16 operand:
// each lane's 16 contiguous bytes feed two MMAs, with the k order inside each 64-byte slice
// permuted identically for both operands, so no shuffle or shared-memory staging is needed and the
// ALUs stay idle. The warps' partial outputs are summed in a fixed order in shared memory.
// Grouped prefill (over 16 rows per expert on average) goes to CUTLASS's block-scaled FP8 grouped
// kernel (fp8_grouped_gemm_cutlass.cu) by default; the tiled kernel stays for 9-16 rows per expert.
#include <cuda_fp8.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kBn = 128, kBk = 128;  // output columns and k bytes per tile
constexpr int kThreads = 256;
constexpr int kTileBytesPerRow = kBk;  // 8 chunks of 16 bytes

enum class ScaleFormat { Block128, Mx32 };

// What the kernels need from either params struct. expert_offsets == nullptr: dense, one expert.
struct Fp8GemmArgs {
  const uint8_t* x;  // [num_rows, k] e4m3
  const void*
      x_scale;       // Block128: float [num_rows, ceil(k/128)]; Mx32: E8M0 [num_rows, ceil(k/32)]
  const uint8_t* w;  // [num_experts, n, k] e4m3
  const void*
      w_scale;  // Block128: float [E, ceil(n/128), ceil(k/128)]; Mx32: E8M0 [E, n, ceil(k/32)]
  const int32_t* expert_offsets;  // [num_experts + 1] or null
  bf16* out;                      // [num_rows, n]
  int num_rows, num_experts, n, k;
};

__device__ __forceinline__ int swizzle(int row, int chunk) {
  return (row * 8 + (chunk ^ (row & 7))) * 16;
}

// 8-byte global -> shared copy for rows that are only 8-byte aligned (k % 16 == 8); zeros if
// !valid.
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 8 : 0));
}

// d += a (16x32, row) * b (32x8, col), e4m3 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_e4m3_16832(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ float e8m0_to_float(uint8_t code) {
  if (code == 0xFF) return __int_as_float(0x7FC00000);
  return code == 0 ? __int_as_float(0x00400000) : __int_as_float(static_cast<int>(code) << 23);
}

// The rows [begin, end) of global tile `target` when expert e spans ceil(rows_e / rows_per_tile)
// tiles (active_only: one "tile" per non-empty expert, covering all its rows). Run by one full
// warp; returns the expert, or -1 past the last tile.
__device__ int locate_tile(const Fp8GemmArgs& p, int target, int rows_per_tile, bool active_only,
                           int* begin, int* end) {
  if (p.expert_offsets == nullptr) {
    *begin = active_only ? 0 : target * rows_per_tile;
    *end = p.num_rows;
    return (active_only ? target == 0 : *begin < p.num_rows) ? 0 : -1;
  }
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < p.num_experts; base += 32) {
    const int e = base + lane;
    int count = 0;
    if (e < p.num_experts) {
      const int rows = p.expert_offsets[e + 1] - p.expert_offsets[e];
      count = active_only ? (rows > 0) : (rows + rows_per_tile - 1) / rows_per_tile;
    }
    int inclusive = count;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += v;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, inclusive > target && e < p.num_experts);
    if (hit) {
      const int first = __ffs(hit) - 1;
      const int expert = base + first;
      const int tile = target - (__shfl_sync(0xffffffffu, inclusive, first) -
                                 __shfl_sync(0xffffffffu, count, first));
      *begin = p.expert_offsets[expert] + (active_only ? 0 : tile * rows_per_tile);
      *end = p.expert_offsets[expert + 1];
      return expert;
    }
    target -= __shfl_sync(0xffffffffu, inclusive, 31);
  }
  return -1;
}

// One tile's rows [row0, row0 + kRows) of a [*, k] e4m3 matrix, bytes [k0, k0 + 128), into the
// swizzled stage; rows >= valid_rows and bytes >= k become zeros (a zero times anything is zero,
// and no NaN code is read past the end).
template <int kRows, int kVecBytes>
__device__ __forceinline__ void load_tile(uint8_t* stage, const uint8_t* src, int valid_rows,
                                          int k0, int k) {
#pragma unroll
  for (int i = 0; i < (kRows * 8) / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int r = c >> 3, chunk = c & 7;
    const int kk = k0 + chunk * 16;
    uint8_t* dst = stage + swizzle(r, chunk);
    const uint8_t* g = src + static_cast<int64_t>(r) * k + kk;
    const bool row_ok = r < valid_rows;
    if constexpr (kVecBytes == 16) {
      cp_async_16(dst, g, row_ok && kk < k);
    } else {
      cp_async_8(dst, g, row_ok && kk < k);
      cp_async_8(dst + 8, g + 8, row_ok && kk + 8 < k);
    }
  }
}

constexpr int kStages = 4;
template <int kBm>
constexpr int tiled_smem_bytes() {
  return kStages * (kBm + kBn) * kTileBytesPerRow;
}

// kBm rows per CTA tile: 128 for prefill, 32 when experts hold few rows (a 128-row tile would spend
// its tensor-core time on padding). Warps are 2 (m) x 4 (n), each kBm/2 x 32.
// NOTE: the 128-row block-scaled tile keeps 64 fp32 accumulators and 64 fp32 k-block partials per
// thread (~170 registers), so it runs one CTA of 8 warps per SM with a 4-stage (128 KiB) pipeline;
// capping it at 128 registers for two CTAs per SM would spill the accumulators. The 32-row tile
// fits two CTAs per SM.
template <int kBm, ScaleFormat kFormat, int kVecBytes>
__global__ void __launch_bounds__(kThreads, kBm == 128 ? 1 : 2)
    fp8_gemm_tiled_kernel(Fp8GemmArgs p) {
  constexpr int kATileBytes = kBm * kTileBytesPerRow, kBTileBytes = kBn * kTileBytesPerRow;
  constexpr int kMt = kBm / 32;  // m16 tiles per warp
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int cta_expert, cta_begin, cta_end;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    int begin = 0, end = 0;
    const int e = locate_tile(p, blockIdx.y, kBm, false, &begin, &end);
    if (lane == 0) cta_expert = e, cta_begin = begin, cta_end = end;
  }
  __syncthreads();
  const int expert = cta_expert;
  if (expert < 0) return;
  const int row_begin = cta_begin;
  const int rows = min(kBm, cta_end - row_begin);
  const int n0 = blockIdx.x * kBn;
  const uint8_t* x = p.x + static_cast<int64_t>(row_begin) * p.k;
  const uint8_t* w = p.w + (static_cast<int64_t>(expert) * p.n + n0) * p.k;
  uint8_t* a_smem = smem;
  uint8_t* b_smem = smem + kStages * kATileBytes;
  const int num_k_tiles = (p.k + kBk - 1) / kBk;

  auto load_stage = [&](int k_tile, int stage) {
    load_tile<kBm, kVecBytes>(a_smem + stage * kATileBytes, x, rows, k_tile * kBk, p.k);
    load_tile<kBn, kVecBytes>(b_smem + stage * kBTileBytes, w, p.n - n0, k_tile * kBk, p.k);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  const int warp_m = warp >> 2, warp_n = warp & 3;
  // The rows and columns this thread's accumulator elements belong to (tile-relative).
  int frag_row[kMt][2], frag_col[4][2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
    for (int h = 0; h < 2; ++h)
      frag_row[mt][h] = warp_m * (kBm / 2) + mt * 16 + (lane >> 2) + h * 8;
  }
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    for (int h = 0; h < 2; ++h) frag_col[nt][h] = warp_n * 32 + nt * 8 + (lane & 3) * 2 + h;
  }
  float acc[kMt][4][4] = {};
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < num_k_tiles) load_stage(next, next % kStages);
    cp_async_commit();
    const uint8_t* as = a_smem + (kt % kStages) * kATileBytes;
    const uint8_t* bs = b_smem + (kt % kStages) * kBTileBytes;

    auto load_fragments = [&](int ks, uint32_t(&a)[kMt][4], uint32_t(&b)[2][4]) {
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        const int r = warp_m * (kBm / 2) + mt * 16 + (lane & 15);
        ldmatrix_x4(a[mt], as + swizzle(r, ks * 2 + (lane >> 4)));
      }
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        const int r = warp_n * 32 + nb * 16 + (lane & 7) + ((lane >> 4) << 3);
        ldmatrix_x4(b[nb], bs + swizzle(r, ks * 2 + ((lane >> 3) & 1)));
      }
    };

    if constexpr (kFormat == ScaleFormat::Block128) {
      // The scales are loaded before the MMAs so that their latency hides behind them.
      const int num_kb = num_k_tiles;
      const float* x_scale = static_cast<const float*>(p.x_scale);
      const float* w_scale = static_cast<const float*>(p.w_scale);
      const float sw =
          w_scale[(static_cast<int64_t>(expert) * ((p.n + kBn - 1) / kBn) + n0 / kBn) * num_kb +
                  kt];
      float sx[kMt][2];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        for (int h = 0; h < 2; ++h) {
          const int r = frag_row[mt][h];
          sx[mt][h] = r < rows ? x_scale[static_cast<int64_t>(row_begin + r) * num_kb + kt] : 0.0f;
        }
      }
      float part[kMt][4][4] = {};
#pragma unroll
      for (int ks = 0; ks < kBk / 32; ++ks) {
        uint32_t a[kMt][4], b[2][4];
        load_fragments(ks, a, b);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
            mma_e4m3_16832(part[mt][nt], a[mt], &b[nt >> 1][(nt & 1) * 2]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        const float s0 = sx[mt][0] * sw, s1 = sx[mt][1] * sw;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          acc[mt][nt][0] += part[mt][nt][0] * s0;
          acc[mt][nt][1] += part[mt][nt][1] * s0;
          acc[mt][nt][2] += part[mt][nt][2] * s1;
          acc[mt][nt][3] += part[mt][nt][3] * s1;
        }
      }
    } else {
      const int num_groups = (p.k + kMxGroupSize - 1) / kMxGroupSize;
      const uint8_t* x_scale = static_cast<const uint8_t*>(p.x_scale);
      const uint8_t* w_scale =
          static_cast<const uint8_t*>(p.w_scale) + static_cast<int64_t>(expert) * p.n * num_groups;
#pragma unroll
      for (int ks = 0; ks < kBk / 32; ++ks) {
        const int g = kt * (kBk / 32) + ks;
        if (g >= num_groups) break;  // the zero-filled tail of the last tile
        float sx[kMt][2], sw[4][2];
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          for (int h = 0; h < 2; ++h) {
            const int r = frag_row[mt][h];
            sx[mt][h] =
                r < rows
                    ? e8m0_to_float(x_scale[static_cast<int64_t>(row_begin + r) * num_groups + g])
                    : 0.0f;
          }
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          for (int h = 0; h < 2; ++h) {
            const int col = n0 + frag_col[nt][h];
            sw[nt][h] = col < p.n
                            ? e8m0_to_float(w_scale[static_cast<int64_t>(col) * num_groups + g])
                            : 0.0f;
          }
        }
        uint32_t a[kMt][4], b[2][4];
        load_fragments(ks, a, b);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            float part[4] = {};
            mma_e4m3_16832(part, a[mt], &b[nt >> 1][(nt & 1) * 2]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
              acc[mt][nt][i] += part[i] * (sx[mt][i >> 1] * sw[nt][i & 1]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row[mt][h];
      if (r >= rows) continue;
      bf16* out = p.out + static_cast<int64_t>(row_begin + r) * p.n;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = n0 + frag_col[nt][0];
        if (col < p.n) {
          *reinterpret_cast<__nv_bfloat162*>(out + col) =
              __floats2bfloat162_rn(acc[mt][nt][h * 2], acc[mt][nt][h * 2 + 1]);
        }
      }
    }
  }
}

constexpr int kStreamWarps = 4;   // warps of a CTA, splitting k by alternate 128-blocks
constexpr int kStreamCols = 16;   // weight rows (output columns) per CTA: the mma's m16
constexpr int kStreamTokens = 8;  // expert rows per pass: the mma's n8
constexpr int kStreamBlocksInFlight =
    2;  // k-blocks each warp loads before using (8 x 16 B per lane)

// 16 bytes of an e4m3 row at byte kk, zeros where the row or the bytes do not exist. Weights are
// read once per pass (no L1 allocation); activations are re-read by every CTA of the expert.
template <int kVecBytes, bool kWeights>
__device__ __forceinline__ void load_16(uint32_t (&r)[4], const uint8_t* src, bool row_ok, int kk,
                                        int k) {
  r[0] = r[1] = r[2] = r[3] = 0;
  if constexpr (kVecBytes == 16) {
    if (row_ok && kk < k) {
      if constexpr (kWeights) {
        load_streaming_16(r, src);
      } else {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
        r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row_ok && kk + 8 * h < k) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(src + 8 * h));
        r[2 * h] = v.x, r[2 * h + 1] = v.y;
      }
    }
  }
}

template <int kVecBytes>
__global__ void __launch_bounds__(kStreamWarps * 32) fp8_gemm_streaming_kernel(Fp8GemmArgs p) {
  __shared__ int cta_expert, cta_begin, cta_end;
  __shared__ float warp_acc[kStreamWarps][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    int begin = 0, end = 0;
    const int e = locate_tile(p, blockIdx.y, 1, true, &begin, &end);
    if (lane == 0) cta_expert = e, cta_begin = begin, cta_end = end;
  }
  __syncthreads();
  const int expert = cta_expert;
  if (expert < 0) return;
  const int group = lane >> 2, quad = lane & 3;
  const int n0 = blockIdx.x * kStreamCols;
  const int num_kb = (p.k + kBk - 1) / kBk;
  const float* x_scale = static_cast<const float*>(p.x_scale);
  const float* w_scale =
      static_cast<const float*>(p.w_scale) +
      (static_cast<int64_t>(expert) * ((p.n + kBn - 1) / kBn) + n0 / kBn) * num_kb;
  // This lane's two weight rows (the mma's rows group and group + 8).
  const int w_row0 = n0 + group, w_row1 = n0 + group + 8;
  const uint8_t* w0 = p.w + (static_cast<int64_t>(expert) * p.n + w_row0) * p.k;
  const uint8_t* w1 = w0 + 8 * static_cast<int64_t>(p.k);

  for (int row0 = cta_begin; row0 < cta_end; row0 += kStreamTokens) {
    const int tokens = min(kStreamTokens, cta_end - row0);
    // The n8 operand's column `group` is expert row row0 + group; accumulators hold rows 2 quad,
    // +1.
    const uint8_t* xr = p.x + static_cast<int64_t>(row0 + group) * p.k;
    const int t0 = 2 * quad, t1 = 2 * quad + 1;
    float acc[4] = {};
    for (int b0 = warp; b0 < num_kb; b0 += kStreamWarps * kStreamBlocksInFlight) {
      uint32_t wa[kStreamBlocksInFlight][2][2][4], xb[kStreamBlocksInFlight][2][4];
#pragma unroll
      for (int i = 0; i < kStreamBlocksInFlight; ++i) {
        const int b = b0 + i * kStreamWarps;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int kk = b * kBk + s * 64 + quad * 16;
          const bool block_ok = b < num_kb;
          load_16<kVecBytes, true>(wa[i][s][0], w0 + kk, block_ok && w_row0 < p.n, kk, p.k);
          load_16<kVecBytes, true>(wa[i][s][1], w1 + kk, block_ok && w_row1 < p.n, kk, p.k);
          load_16<kVecBytes, false>(xb[i][s], xr + kk, block_ok && group < tokens, kk, p.k);
        }
      }
#pragma unroll
      for (int i = 0; i < kStreamBlocksInFlight; ++i) {
        const int b = b0 + i * kStreamWarps;
        if (b >= num_kb) break;
        const float sw = w_scale[b];
        const float s0 =
            t0 < tokens ? x_scale[static_cast<int64_t>(row0 + t0) * num_kb + b] * sw : 0.0f;
        const float s1 =
            t1 < tokens ? x_scale[static_cast<int64_t>(row0 + t1) * num_kb + b] * sw : 0.0f;
        float part[4] = {};
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          // The lane's 16 bytes are k [16 quad, 16 quad + 16) of its slice; words 0-1 feed the
          // first MMA's k32 slots {4 quad.., 16 + 4 quad..}, words 2-3 the second's, for both
          // operands.
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t a[4] = {wa[i][s][0][2 * h], wa[i][s][1][2 * h], wa[i][s][0][2 * h + 1],
                                   wa[i][s][1][2 * h + 1]};
            const uint32_t bfrag[2] = {xb[i][s][2 * h], xb[i][s][2 * h + 1]};
            mma_e4m3_16832(part, a, bfrag);
          }
        }
        acc[0] += part[0] * s0;
        acc[1] += part[1] * s1;
        acc[2] += part[2] * s0;
        acc[3] += part[3] * s1;
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) warp_acc[warp][lane][i] = acc[i];
    __syncthreads();
    if (warp == 0) {
      float sum[4] = {};
#pragma unroll
      for (int w = 0; w < kStreamWarps; ++w) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sum[i] += warp_acc[w][lane][i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = i & 1 ? t1 : t0;
        const int col = i < 2 ? w_row0 : w_row1;
        if (t < tokens && col < p.n)
          p.out[static_cast<int64_t>(row0 + t) * p.n + col] = __float2bfloat16(sum[i]);
      }
    }
    __syncthreads();
  }
}

template <int kBm, ScaleFormat kFormat, int kVecBytes>
void run_tiled(const Fp8GemmArgs& a, int num_tiles, cudaStream_t s) {
  constexpr int kSmem = tiled_smem_bytes<kBm>();
  auto* kernel = fp8_gemm_tiled_kernel<kBm, kFormat, kVecBytes>;
  allow_dynamic_smem(kernel, kSmem);
  dim3 grid(ceil_div(a.n, kBn), num_tiles);
  kernel<<<grid, kThreads, kSmem, s>>>(a);
  RELAY_CUDA_CHECK_LAUNCH("fp8_gemm_tiled_kernel");
}

// The explicit switch from (rows per tile, aligned rows) to the compiled instantiations.
template <ScaleFormat kFormat>
void dispatch_tiled(const Fp8GemmArgs& a, bool small_tiles, cudaStream_t s) {
  const int rows_per_tile = small_tiles ? 32 : 128;
  // Dense: exactly the m tiles; grouped: every expert may end in a partial tile.
  const int num_tiles = ceil_div(a.num_rows, rows_per_tile) +
                        (a.expert_offsets == nullptr ? 0 : std::min(a.num_rows, a.num_experts));
  const bool aligned16 = a.k % 16 == 0;
  if (small_tiles) {
    aligned16 ? run_tiled<32, kFormat, 16>(a, num_tiles, s)
              : run_tiled<32, kFormat, 8>(a, num_tiles, s);
  } else {
    aligned16 ? run_tiled<128, kFormat, 16>(a, num_tiles, s)
              : run_tiled<128, kFormat, 8>(a, num_tiles, s);
  }
}

void run_streaming(const Fp8GemmArgs& a, cudaStream_t s) {
  dim3 grid(ceil_div(a.n, kStreamCols),
            a.expert_offsets == nullptr ? 1 : std::min(a.num_rows, a.num_experts));
  if (a.k % 16 == 0) {
    fp8_gemm_streaming_kernel<16><<<grid, kStreamWarps * 32, 0, s>>>(a);
  } else {
    fp8_gemm_streaming_kernel<8><<<grid, kStreamWarps * 32, 0, s>>>(a);
  }
  RELAY_CUDA_CHECK_LAUNCH("fp8_gemm_streaming_kernel");
}

// Auto -> the variant for the shape; explicit kinds pass through.
GroupedGemmKind resolve_block_scaled_kind(const Fp8GemmArgs& a, GroupedGemmKind kind) {
  if (kind != GroupedGemmKind::Auto) return kind;
  const int64_t experts = a.expert_offsets == nullptr ? 1 : a.num_experts;
  // NOTE: up to 8 rows per expert the streaming kernel reads each weight once per expert (8 rows
  // share one n8 operand), so it stays at the weight-bandwidth bound; beyond, tensor-core tiles
  // amortise the weights over more rows. Not yet tuned on the H200.
  if (a.num_rows <= kStreamTokens * experts) return GroupedGemmKind::Streaming;
  // Prefill (grouped, over 16 rows per expert): CUTLASS's cooperative kernel unless
  // RELAY_MOE_PREFILL_GEMM says tiled (the bf16-only wgmma kernel has no FP8 form, so that name
  // too means CUTLASS here); shapes CUTLASS cannot take stay on the tiled kernel.
  if (a.expert_offsets == nullptr || a.num_rows <= 16 * experts) return GroupedGemmKind::Tiled;
  const GroupedGemmKind prefill = prefill_grouped_gemm_kind();
  RELAY_CHECK(prefill != GroupedGemmKind::CutlassPingpong,
              "RELAY_MOE_PREFILL_GEMM=cutlass_pingpong: the FP8 block-scaled grouped GEMM has no "
              "ping-pong variant (tiled or cutlass_cooperative)");
  return prefill != GroupedGemmKind::Tiled && fp8_block_grouped_matmul_cutlass_supported(a.n, a.k)
             ? GroupedGemmKind::CutlassCooperative
             : GroupedGemmKind::Tiled;
}

// Relay's own kernels (the CUTLASS variant is launched from launch_fp8_block_grouped_matmul).
void run_block_scaled(const Fp8GemmArgs& a, GroupedGemmKind kind, cudaStream_t s) {
  RELAY_CHECK(kind == GroupedGemmKind::Streaming || kind == GroupedGemmKind::Tiled,
              "fp8 block GEMM: no ", grouped_gemm_kind_name(kind), " variant",
              a.expert_offsets == nullptr
                  ? " for the dense GEMM (CUTLASS runs the grouped one only)"
                  : " (CUTLASS: cutlass_cooperative only)");
  if (a.num_rows == 0) return;
  if (kind == GroupedGemmKind::Streaming) {
    run_streaming(a, s);
  } else {
    const int64_t experts = a.expert_offsets == nullptr ? 1 : a.num_experts;
    dispatch_tiled<ScaleFormat::Block128>(a, a.num_rows <= 16 * experts, s);
  }
}

void check_block_shape(const char* op, int n, int k, int block_n, int block_k) {
  RELAY_CHECK(n > 0 && k > 0 && n % 8 == 0 && k % 8 == 0, op, ": n ", n, " and k ", k,
              " must be positive multiples of 8");
  RELAY_CHECK(block_n == kFp8BlockSize && block_k == kFp8BlockSize, op, ": blocks ",
              block_n, "x", block_k, " are not supported on the GPU (only 128x128)");
}

}  // namespace

void launch_fp8_block_grouped_matmul(const Fp8BlockGroupedMatmulParams<bf16>& p,
                                     GroupedGemmKind kind, cudaStream_t s) {
  check_block_shape("fp8_block_grouped_matmul", p.n, p.k, p.block_n, p.block_k);
  RELAY_CHECK(p.num_rows >= 0 && p.num_experts > 0 && p.expert_offsets != nullptr,
              "fp8_block_grouped_matmul: rows ", p.num_rows, ", experts ", p.num_experts,
              " (expert_offsets must be set)");
  const Fp8GemmArgs a{p.x,   p.x_scale,  p.w,           p.w_scale, p.expert_offsets,
                      p.out, p.num_rows, p.num_experts, p.n,       p.k};
  kind = resolve_block_scaled_kind(a, kind);
  if (kind == GroupedGemmKind::CutlassCooperative) {
    launch_fp8_block_grouped_matmul_cutlass(p, s);
  } else {
    run_block_scaled(a, kind, s);
  }
}

void launch_fp8_block_grouped_matmul(const Fp8BlockGroupedMatmulParams<bf16>& p,
                                     cudaStream_t s) {
  launch_fp8_block_grouped_matmul(p, GroupedGemmKind::Auto, s);
}

void launch_fp8_block_matmul(const Fp8BlockMatmulParams<bf16>& p, GroupedGemmKind kind,
                             cudaStream_t s) {
  check_block_shape("fp8_block_matmul", p.n, p.k, p.block_n, p.block_k);
  RELAY_CHECK(p.m >= 0, "fp8_block_matmul: m ", p.m, " is negative");
  RELAY_CHECK(!p.x_scale_group_major,
              "fp8_block_matmul: Relay's kernels read token-major x scales; group-major ones are "
              "cuBLASLt's layout (launch_fp8_block_matmul_cublaslt)");
  const Fp8GemmArgs a{p.x, p.x_scale, p.w, p.w_scale, nullptr, p.out, p.m, 1, p.n, p.k};
  run_block_scaled(a, resolve_block_scaled_kind(a, kind), s);
}

void launch_fp8_block_matmul(const Fp8BlockMatmulParams<bf16>& p, cudaStream_t s) {
  launch_fp8_block_matmul(p, GroupedGemmKind::Auto, s);
}

bool mxfp8_sm100_available() {
#if RELAY_HAVE_SM100_KERNELS
  // sm_100a code runs on compute capability 10.0 only (not 10.3 or 12.x); asked once per device.
  static const bool available = [] {
    int device = 0;
    cudaDeviceProp prop{};
    RELAY_CUDA_CHECK(cudaGetDevice(&device));
    RELAY_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    return prop.major == 10 && prop.minor == 0;
  }();
  return available;
#else
  return false;
#endif
}

namespace {
void launch_mxfp8_sm100(const Mxfp8GroupedMatmulParams<bf16>& p, cudaStream_t s) {
#if RELAY_HAVE_SM100_KERNELS
  launch_mxfp8_grouped_matmul_sm100(p, s);
#else
  (void)p;
  (void)s;
  RELAY_CHECK(false, "mxfp8: this build has no sm_100a kernels (configure with -DRELAY_SM100=ON)");
#endif
}
}  // namespace

void launch_mxfp8_grouped_matmul(const Mxfp8GroupedMatmulParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.n > 0 && p.k > 0 && p.n % 8 == 0 && p.k % 8 == 0, "mxfp8_grouped_matmul: n ", p.n,
              " and k ", p.k, " must be positive multiples of 8");
  RELAY_CHECK(p.num_rows >= 0 && p.num_experts > 0 && p.expert_offsets != nullptr,
              "mxfp8_grouped_matmul: rows ", p.num_rows, ", experts ", p.num_experts,
              " (expert_offsets must be set)");
  if (p.num_rows == 0) return;
  if (mxfp8_sm100_available() && mxfp8_sm100_supported(p.n, p.k)) {
    launch_mxfp8_sm100(p, s);
    return;
  }
  dispatch_tiled<ScaleFormat::Mx32>({p.x, p.x_scale, p.w, p.w_scale, p.expert_offsets, p.out,
                                     p.num_rows, p.num_experts, p.n, p.k},
                                    p.num_rows <= 16 * p.num_experts, s);
}

void launch_mxfp8_matmul(const Mxfp8MatmulParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.n > 0 && p.k > 0 && p.n % 8 == 0 && p.k % 8 == 0 && p.m >= 0, "mxfp8_matmul: m ",
              p.m, ", n ", p.n, " and k ", p.k, " (n and k must be positive multiples of 8)");
  if (p.m == 0) return;
  if (mxfp8_sm100_available() && mxfp8_sm100_supported(p.n, p.k)) {
    launch_mxfp8_sm100({p.x, p.x_scale, p.w, p.w_scale, nullptr, p.out, p.m, 1, p.n, p.k}, s);
    return;
  }
  dispatch_tiled<ScaleFormat::Mx32>(
      {p.x, p.x_scale, p.w, p.w_scale, nullptr, p.out, p.m, 1, p.n, p.k}, p.m <= 16, s);
}

}  // namespace relay::kernels

// MoE grouped GEMM: out[r] = x[r] @ w[e]^T for the rows r of each expert e, in two regimes.
//
// Tiled (prefill, tens to hundreds of rows per expert): 128x128x64 CTA tiles (32x128x64 up to 16
// rows per expert on average) on mma.sync m16n8k16 (bf16 in, fp32 accumulate), 8 warps, a 3-stage
// cp.async pipeline and XOR-swizzled shared memory for conflict-free ldmatrix. The grid is (n tiles, an upper bound on the m tiles summed over
// experts); each CTA finds its expert and m tile with a warp scan over expert_offsets, so the
// host never reads the routing and CTAs past the real tile count exit at once. n tiles vary
// fastest so the CTAs resident together share one x tile in L2.
// Streaming (decode, a few rows per expert): the weights dominate the bytes, so each CTA streams a
// 32-column slice of one *active* expert's weight with 16-byte loads, several in flight per lane,
// and multiplies it with that expert's rows (staged in shared memory, 4 at a time). Only experts
// that received rows are visited, so batch 1 reads 8 experts' weights, not 128.
// Prefill (over 16 rows per expert on average) goes to CUTLASS's Hopper grouped kernel
// (grouped_gemm_cutlass.cu) by default; the tiled kernel stays for 3-16 rows per expert.
#include <cstdlib>
#include <string_view>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kBn = 128, kBk = 64, kStages = 3, kGemmThreads = 256;
constexpr int kBTileBytes = kBn * kBk * 2;  // one weight tile in one stage

__device__ __forceinline__ int gemm_swizzle(int row, int chunk) {  // 8 chunks of 16 bytes per row
  return (row * 8 + (chunk ^ (row & 7))) * 16;
}

// Finds the expert owning global tile `target` when expert e spans ceil(rows_e / rows_per_tile)
// tiles (active_only: one "tile" per non-empty expert). Run by one full warp; returns -1 past the end.
__device__ int find_expert_tile(const int32_t* offsets, int num_experts, int target, int rows_per_tile,
                                bool active_only, int* tile_in_expert) {
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < num_experts; base += 32) {
    const int e = base + lane;
    int count = 0;
    if (e < num_experts) {
      const int rows = offsets[e + 1] - offsets[e];
      count = active_only ? (rows > 0) : (rows + rows_per_tile - 1) / rows_per_tile;
    }
    int inclusive = count;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += v;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, inclusive > target && e < num_experts);
    if (hit) {
      const int first = __ffs(hit) - 1;
      *tile_in_expert = target - (__shfl_sync(0xffffffffu, inclusive, first) - __shfl_sync(0xffffffffu, count, first));
      return base + first;
    }
    target -= __shfl_sync(0xffffffffu, inclusive, 31);
  }
  return -1;
}

// kBm rows per CTA tile (128 for prefill; 32 when experts hold tens of rows, where a 128-row tile
// would spend most of its tensor-core time on padding). Warps are 2 (m) x 4 (n), each kBm/2 x 32.
// NOTE: the 2 in the launch bounds caps registers at 128 so two CTAs share an SM; uncapped the
// 128-row tile takes 160 registers, runs one CTA per SM and loses a third of its speed.
template <int kBm>
__global__ void __launch_bounds__(kGemmThreads, 2) grouped_gemm_tiled_kernel(MoeGroupedMatmulParams<bf16> p) {
  constexpr int kATileBytes = kBm * kBk * 2;
  constexpr int kMt = kBm / 32;  // m16 tiles per warp
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int cta_expert, cta_tile;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    int tile = 0;
    const int e = find_expert_tile(p.expert_offsets, p.num_experts, blockIdx.y, kBm, false, &tile);
    if (lane == 0) {
      cta_expert = e;
      cta_tile = tile;
    }
  }
  __syncthreads();
  const int expert = cta_expert;
  if (expert < 0) return;
  const int row_begin = p.expert_offsets[expert] + cta_tile * kBm;
  const int rows = min(kBm, p.expert_offsets[expert + 1] - row_begin);
  const int n0 = blockIdx.x * kBn;
  const bf16* x = p.x + static_cast<int64_t>(row_begin) * p.k;
  const bf16* w = p.w + (static_cast<int64_t>(expert) * p.n + n0) * p.k;
  uint8_t* a_smem = smem;
  uint8_t* b_smem = smem + kStages * kATileBytes;

  auto load_stage = [&](int k_tile, int stage) {
    const int k0 = k_tile * kBk;
    if constexpr (kBm == kBn) {
      // NOTE: one loop issuing both operands, as the first (faster, 283 vs 246 TFLOP/s) version did.
#pragma unroll
      for (int i = 0; i < (kBm * 8) / kGemmThreads; ++i) {
        const int c = threadIdx.x + i * kGemmThreads;
        const int r = c >> 3, chunk = c & 7;
        const int kk = k0 + chunk * 8;
        cp_async_16(a_smem + stage * kATileBytes + gemm_swizzle(r, chunk), x + static_cast<int64_t>(r) * p.k + kk,
                    kk < p.k && r < rows);
        cp_async_16(b_smem + stage * kBTileBytes + gemm_swizzle(r, chunk), w + static_cast<int64_t>(r) * p.k + kk,
                    kk < p.k && n0 + r < p.n);
      }
    } else {
#pragma unroll
      for (int i = 0; i < (kBm * 8) / kGemmThreads; ++i) {
        const int c = threadIdx.x + i * kGemmThreads;
        const int r = c >> 3, chunk = c & 7;
        const int kk = k0 + chunk * 8;
        cp_async_16(a_smem + stage * kATileBytes + gemm_swizzle(r, chunk), x + static_cast<int64_t>(r) * p.k + kk,
                    kk < p.k && r < rows);
      }
#pragma unroll
      for (int i = 0; i < (kBn * 8) / kGemmThreads; ++i) {
        const int c = threadIdx.x + i * kGemmThreads;
        const int r = c >> 3, chunk = c & 7;
        const int kk = k0 + chunk * 8;
        cp_async_16(b_smem + stage * kBTileBytes + gemm_swizzle(r, chunk), w + static_cast<int64_t>(r) * p.k + kk,
                    kk < p.k && n0 + r < p.n);
      }
    }
  };

  const int num_k_tiles = (p.k + kBk - 1) / kBk;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  const int warp_m = warp >> 2, warp_n = warp & 3;
  float acc[kMt][4][4] = {};
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < num_k_tiles) load_stage(next, next % kStages);
    cp_async_commit();
    const uint8_t* as = a_smem + (kt % kStages) * kATileBytes;
    const uint8_t* bs = b_smem + (kt % kStages) * kBTileBytes;
#pragma unroll
    for (int ks = 0; ks < kBk / 16; ++ks) {
      uint32_t a[kMt][4], b[2][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        const int r = warp_m * (kBm / 2) + mt * 16 + (lane & 15);
        ldmatrix_x4(a[mt], as + gemm_swizzle(r, ks * 2 + (lane >> 4)));
      }
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        const int r = warp_n * 32 + nb * 16 + (lane & 7) + ((lane >> 4) << 3);
        ldmatrix_x4(b[nb], bs + gemm_swizzle(r, ks * 2 + ((lane >> 3) & 1)));
      }
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma_bf16_16816(acc[mt][nt], a[mt], &b[nt >> 1][(nt & 1) * 2]);
      }
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * (kBm / 2) + mt * 16 + (lane >> 2) + half * 8;
      if (r >= rows) continue;
      bf16* out = p.out + static_cast<int64_t>(row_begin + r) * p.n;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = n0 + warp_n * 32 + nt * 8 + (lane & 3) * 2;
        if (col < p.n) {
          *reinterpret_cast<__nv_bfloat162*>(out + col) =
              __floats2bfloat162_rn(acc[mt][nt][half * 2], acc[mt][nt][half * 2 + 1]);
        }
      }
    }
  }
}

constexpr int kStreamRows = 4;   // rows of one expert multiplied per pass over its weights
constexpr int kStreamCols = 32;  // output columns per CTA (one step of each warp)
constexpr int kStreamWarps = 4;
constexpr int kColsPerStep = 8;  // weight rows each warp streams at once
constexpr int kStreamUnroll = 4;  // 16-byte loads of each weight row in flight per lane

// NOTE: batch-1 decode reads 8 experts x 1 row: each SM streams ~400 KB with every load a full
// memory latency away, so the bytes in flight per warp set the speed. All kStreamUnroll x
// kColsPerStep loads of a step are issued before any is used (32 x 16 bytes per lane).
__global__ void __launch_bounds__(kStreamWarps * 32) grouped_gemm_streaming_kernel(MoeGroupedMatmulParams<bf16> p) {
  extern __shared__ __align__(128) uint8_t stream_smem[];
  __shared__ int cta_expert;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    int unused = 0;
    const int e = find_expert_tile(p.expert_offsets, p.num_experts, blockIdx.y, 1, true, &unused);
    if (lane == 0) cta_expert = e;
  }
  __syncthreads();
  const int expert = cta_expert;
  if (expert < 0) return;
  const int begin = p.expert_offsets[expert], end = p.expert_offsets[expert + 1];
  const int n0 = blockIdx.x * kStreamCols;
  const int k_vecs = p.k / 8;
  Bf16x8* xs = reinterpret_cast<Bf16x8*>(stream_smem);  // [kStreamRows][k_vecs]
  const bf16* w = p.w + static_cast<int64_t>(expert) * p.n * p.k;

  for (int row0 = begin; row0 < end; row0 += kStreamRows) {
    const int rows = min(kStreamRows, end - row0);
    __syncthreads();
    for (int i = threadIdx.x; i < rows * k_vecs; i += blockDim.x) {
      xs[i] = reinterpret_cast<const Bf16x8*>(p.x + static_cast<int64_t>(row0) * p.k)[i];
    }
    __syncthreads();
    for (int c0 = n0 + warp * kColsPerStep; c0 < min(n0 + kStreamCols, p.n); c0 += kStreamWarps * kColsPerStep) {
      float acc[kStreamRows][kColsPerStep] = {};
      const Bf16x8* wrow[kColsPerStep];
#pragma unroll
      for (int c = 0; c < kColsPerStep; ++c) {
        wrow[c] = reinterpret_cast<const Bf16x8*>(w + static_cast<int64_t>(min(c0 + c, p.n - 1)) * p.k);
      }
      for (int v0 = lane; v0 < k_vecs; v0 += 32 * kStreamUnroll) {
        Bf16x8 raw[kStreamUnroll][kColsPerStep];
#pragma unroll
        for (int u = 0; u < kStreamUnroll; ++u) {
          const int v = min(v0 + 32 * u, k_vecs - 1);  // past the end: a valid address, result unused
#pragma unroll
          for (int c = 0; c < kColsPerStep; ++c) {
            uint32_t* r = reinterpret_cast<uint32_t*>(raw[u][c].v);
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                         : "l"(wrow[c] + v));
          }
        }
#pragma unroll
        for (int u = 0; u < kStreamUnroll; ++u) {
          const int v = v0 + 32 * u;
          if (v >= k_vecs) break;
          float xf[kStreamRows][8];
#pragma unroll
          for (int r = 0; r < kStreamRows; ++r) {
            if (r < rows) bf16x8_to_f32(xs[r * k_vecs + v], xf[r]);
          }
#pragma unroll
          for (int c = 0; c < kColsPerStep; ++c) {
            float wf[8];
            bf16x8_to_f32(raw[u][c], wf);
#pragma unroll
            for (int r = 0; r < kStreamRows; ++r) {
              if (r < rows) {
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][c] += xf[r][e] * wf[e];
              }
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kStreamRows; ++r) {
        if (r < rows) {
#pragma unroll
          for (int c = 0; c < kColsPerStep; ++c) {
            const float sum = warp_sum(acc[r][c]);
            if (lane == c && c0 + c < p.n) p.out[static_cast<int64_t>(row0 + r) * p.n + c0 + c] = __float2bfloat16(sum);
          }
        }
      }
    }
  }
}

template <int kBm>
void run_tiled(const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s) {
  constexpr int kSmem = kStages * (kBm + kBn) * kBk * 2;
  static bool configured = false;  // one attribute call per instantiation
  if (!configured) {
    RELAY_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_tiled_kernel<kBm>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    configured = true;
  }
  dim3 grid(ceil_div(p.n, kBn), ceil_div(p.num_rows, kBm) + std::min(p.num_rows, p.num_experts));
  grouped_gemm_tiled_kernel<kBm><<<grid, kGemmThreads, kSmem, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("grouped_gemm_tiled_kernel");
}

}  // namespace

GroupedGemmKind prefill_grouped_gemm_kind() {
  static const GroupedGemmKind kind = [] {
    const char* env = std::getenv("RELAY_MOE_PREFILL_GEMM");
    if (env == nullptr || *env == 0) return GroupedGemmKind::CutlassCooperative;
    for (GroupedGemmKind k :
         {GroupedGemmKind::Tiled, GroupedGemmKind::CutlassCooperative, GroupedGemmKind::CutlassPingpong}) {
      if (std::string_view(env) == grouped_gemm_kind_name(k)) return k;
    }
    throw Error(str("RELAY_MOE_PREFILL_GEMM='", env,
                    "' is not one of tiled, cutlass_cooperative, cutlass_pingpong"));
  }();
  return kind;
}

void launch_moe_grouped_matmul(const MoeGroupedMatmulParams<bf16>& p, GroupedGemmKind kind, cudaStream_t s) {
  RELAY_CHECK(p.k % 8 == 0 && p.n % 8 == 0, "moe_grouped_matmul: n ", p.n, " and k ", p.k,
              " must be multiples of 8");
  if (p.num_rows == 0) return;
  if (kind == GroupedGemmKind::Auto) {
    // NOTE: measured on H200 (bench kernel mode, 2026-12-02): streaming wins at 1 row per active
    // expert (30B gate_up, 8 experts: 1.94 vs 1.48 TB/s), the tensor-core tiles from 4 rows per
    // expert on (2.85 vs 2.53 TB/s), and by far at 16 (2.84 vs 0.96).
    if (p.num_rows <= 2 * p.num_experts) {
      kind = GroupedGemmKind::Streaming;
    } else if (p.num_rows > 16 * p.num_experts) {
      kind = prefill_grouped_gemm_kind();
    } else {
      kind = GroupedGemmKind::Tiled;
    }
  }
  if (kind == GroupedGemmKind::CutlassCooperative || kind == GroupedGemmKind::CutlassPingpong) {
    launch_moe_grouped_matmul_cutlass(p, kind == GroupedGemmKind::CutlassCooperative, s);
  } else if (kind == GroupedGemmKind::Tiled) {
    // 32-row tiles while weights dominate (decode, up to 16 rows per expert on average: 0.8 of copy
    // bandwidth vs 0.66 with 128-row tiles), 128-row tiles once the tensor cores do (prefill).
    if (p.num_rows > 16 * p.num_experts) {
      run_tiled<128>(p, s);
    } else {
      run_tiled<32>(p, s);
    }
  } else {
    const int smem = kStreamRows * p.k * 2;
    RELAY_CHECK(smem <= 200 * 1024, "moe_grouped_matmul: k ", p.k, " too large for the streaming kernel");
    static int configured_smem = 0;
    if (smem > configured_smem) {
      RELAY_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_streaming_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      configured_smem = smem;
    }
    dim3 grid(ceil_div(p.n, kStreamCols), std::min(p.num_rows, p.num_experts));
    grouped_gemm_streaming_kernel<<<grid, kStreamWarps * 32, smem, s>>>(p);
    RELAY_CUDA_CHECK_LAUNCH("grouped_gemm_streaming_kernel");
  }
}

void launch_moe_grouped_matmul(const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s) {
  launch_moe_grouped_matmul(p, GroupedGemmKind::Auto, s);
}

}  // namespace relay::kernels

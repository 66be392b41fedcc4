// MoE grouped GEMM: out[r] = x[r] @ w[e]^T for the rows r of each expert e, in two regimes.
//
// Tiled (prefill, tens to hundreds of rows per expert): 128x128x64 CTA tiles (32x128x64 up to 16
// rows per expert on average) on mma.sync m16n8k16 (bf16 in, fp32 accumulate), 8 warps, a 3-stage
// cp.async pipeline and XOR-swizzled shared memory for conflict-free ldmatrix. The grid is (n tiles, an upper bound on the m tiles summed over
// experts); each CTA finds its expert and m tile with a warp scan over expert_offsets, so the
// host never reads the routing and CTAs past the real tile count exit at once. n tiles vary
// fastest so the CTAs resident together share one x tile in L2.
// Streaming (decode, a few rows per expert): the weights dominate the bytes; the weight-streaming
// kernel of streaming_gemm.cu visits only the experts that received rows.
// Prefill (over 16 rows per expert on average) goes to Relay's warp-specialised wgmma kernel
// (grouped_gemm_wgmma.cu) up to 192 rows per expert and to CUTLASS's Hopper grouped kernel
// (grouped_gemm_cutlass.cu) above; the tiled kernel stays for 3-16 rows per expert.
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
// tiles. Run by one full warp; returns -1 past the end.
__device__ int find_expert_tile(const int32_t* offsets, int num_experts, int target, int rows_per_tile,
                                int* tile_in_expert) {
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < num_experts; base += 32) {
    const int e = base + lane;
    int count = 0;
    if (e < num_experts) {
      const int rows = offsets[e + 1] - offsets[e];
      count = (rows + rows_per_tile - 1) / rows_per_tile;
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
    const int e = find_expert_tile(p.expert_offsets, p.num_experts, blockIdx.y, kBm, &tile);
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

template <int kBm>
void run_tiled(const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s) {
  constexpr int kSmem = kStages * (kBm + kBn) * kBk * 2;
  allow_dynamic_smem(grouped_gemm_tiled_kernel<kBm>, kSmem);
  dim3 grid(ceil_div(p.n, kBn), ceil_div(p.num_rows, kBm) + std::min(p.num_rows, p.num_experts));
  grouped_gemm_tiled_kernel<kBm><<<grid, kGemmThreads, kSmem, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("grouped_gemm_tiled_kernel");
}

}  // namespace

GroupedGemmKind prefill_grouped_gemm_kind() {
  static const GroupedGemmKind kind = [] {
    const char* env = std::getenv("RELAY_MOE_PREFILL_GEMM");
    if (env == nullptr || *env == 0) return GroupedGemmKind::Auto;
    for (GroupedGemmKind k : {GroupedGemmKind::Tiled, GroupedGemmKind::CutlassCooperative,
                              GroupedGemmKind::CutlassPingpong, GroupedGemmKind::Wgmma}) {
      if (std::string_view(env) == grouped_gemm_kind_name(k)) return k;
    }
    throw Error(str("RELAY_MOE_PREFILL_GEMM='", env,
                    "' is not one of tiled, cutlass_cooperative, cutlass_pingpong, wgmma"));
  }();
  return kind;
}

GroupedGemmKind moe_grouped_matmul_auto_kind(const MoeGroupedMatmulParams<bf16>& p) {
  // NOTE: measured on H200 (bench kernel mode, 2026-12-04): streaming wins at 1 row per active
  // expert (30B gate_up, 8 experts: 22.0 vs 28.0 us; 235B, 16 experts 101 vs 103), the tensor-core
  // tiles as soon as experts share rows (30B, 128 x 4: 216 vs 392 us) — and in the model from batch
  // 8 (64 rows over 128 experts), whose tokens often pick the same experts: batch 8 decoded at
  // 2,971 tok/s through the streaming kernel against 3,485 through the tiles. So streaming up to
  // one row per four experts (batch 1-4 at top-8 of 128).
  if (p.num_rows * 4 <= p.num_experts) return GroupedGemmKind::Streaming;
  if (p.num_rows > 16 * p.num_experts) {
    const GroupedGemmKind forced = prefill_grouped_gemm_kind();
    if (forced != GroupedGemmKind::Auto) return forced;
    // NOTE: measured on H100 (bench kernel and model modes, 2026-12-07): the wgmma kernel's
    // 256-row tiles hold an expert's rows whole up to about 192 rows per expert on average, and it
    // wins there (Qwen3.5-35B-A3B at 4096 tokens, 128 rows an expert: gate_up 439 vs 479 us, down
    // 247 vs 281; the 30B-A3B shape at 512 tokens, 32 rows: 12-layer prefill 4.23 vs 4.59 ms).
    // From about 256 rows an expert needs a second m tile that reads its weights again, and
    // CUTLASS's cooperative kernel, whose 2-CTA clusters share them, wins (30B-A3B at 4096 tokens:
    // gate_up 563 vs 468 us).
    return p.num_rows <= 192 * int64_t{p.num_experts} && moe_grouped_matmul_wgmma_supported(p)
               ? GroupedGemmKind::Wgmma
               : GroupedGemmKind::CutlassCooperative;
  }
  return GroupedGemmKind::Tiled;
}

void launch_moe_grouped_matmul(const MoeGroupedMatmulParams<bf16>& p, GroupedGemmKind kind, cudaStream_t s) {
  RELAY_CHECK(p.k % 8 == 0 && p.n % 8 == 0, "moe_grouped_matmul: n ", p.n, " and k ", p.k,
              " must be multiples of 8");
  if (p.num_rows == 0) return;
  if (kind == GroupedGemmKind::Auto) kind = moe_grouped_matmul_auto_kind(p);
  RELAY_CHECK(
      p.permuted_index == nullptr || kind == GroupedGemmKind::Streaming, "moe_grouped_matmul: the ",
      grouped_gemm_kind_name(kind),
      " kernel does not gather rows (only streaming does; see moe_grouped_matmul_auto_kind)");
  RELAY_CHECK(!p.swiglu || kind == GroupedGemmKind::Streaming || kind == GroupedGemmKind::Wgmma,
              "moe_grouped_matmul: the ", grouped_gemm_kind_name(kind),
              " kernel does not fuse SwiGLU (streaming and wgmma do; see "
              "moe_grouped_matmul_auto_kind)");
  if (kind == GroupedGemmKind::CutlassCooperative || kind == GroupedGemmKind::CutlassPingpong) {
    launch_moe_grouped_matmul_cutlass(p, kind == GroupedGemmKind::CutlassCooperative, s);
  } else if (kind == GroupedGemmKind::Wgmma) {
    launch_moe_grouped_matmul_wgmma(p, s);
  } else if (kind == GroupedGemmKind::Tiled) {
    // 32-row tiles while weights dominate (decode, up to 16 rows per expert on average: 0.8 of copy
    // bandwidth vs 0.66 with 128-row tiles), 128-row tiles once the tensor cores do (prefill).
    if (p.num_rows > 16 * p.num_experts) {
      run_tiled<128>(p, s);
    } else {
      run_tiled<32>(p, s);
    }
  } else {
    launch_streaming_grouped_matmul(p, s);
  }
}

void launch_moe_grouped_matmul(const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s) {
  launch_moe_grouped_matmul(p, GroupedGemmKind::Auto, s);
}

}  // namespace relay::kernels

// MoE grouped GEMM on Hopper, Relay's own warp-specialised kernel: out[r] = x[r] @ w[e]^T for the
// rows r of each expert e (bf16 in, fp32 accumulate, bf16 out).
//
// Why not only CUTLASS's grouped kernel (grouped_gemm_cutlass.cu): its tiles are 128 rows in 2-CTA
// clusters (the pair shares the weight tile through TMA multicast), so an expert's rows are padded
// to 256, and a prefill's experts hold a binomial number of rows — Qwen3.5's 256 experts at 4096
// tokens top-8 about 128 +- 11 — so half of its tensor-core work is padding. Here a tile is 256
// rows x 128 columns as four 64-row slabs; a slab holding no row of the expert skips its MMAs and
// its operand load, so the padding costs at most 63 rows. A tile that covers all of an expert's
// rows reads each weight tile once, without a cluster: the weights then stream from DRAM once.
// (A first form, 128 x 256 tiles of 64-row halves, re-read weights: the CTAs sharing a weight tile
// drifted apart and the L2 hit rate fell to 42%, 1.8 GB read from DRAM where CUTLASS read 1.05.)
//
// Structure (one persistent CTA per SM, 3 warp groups):
// - Warp group 0 is the producer: one thread walks the CTA's tiles and, per 64-wide k step, waits
//   for a free stage of a 4-stage shared-memory ring, then TMA-loads the x rows (one 64-row box per
//   live slab) and the 128 weight rows into it; the TMA's byte count completes the stage's "full"
//   mbarrier. x is one 2-D tensor map over the permuted rows and w one over [experts * n, k], so
//   no per-expert descriptor is written (CUTLASS's ptr-array kernel rewrites descriptors per
//   group).
// - Warp groups 1 and 2 consume: each owns two slabs, 128 rows x 128 columns of fp32 accumulators
//   (an m64n128k16 wgmma per live slab and k16 step, both operands from the 128-byte-swizzled
//   stages), releases a stage through its "empty" mbarrier once the wgmma reading it has retired,
//   then stores its rows (masked to the expert's rows and to n) straight to global memory. With
//   the SwiGLU fused (the experts' gate_up, MoeGroupedMatmulParams::swiglu) a tile's two 64-row
//   weight boxes are the gate rows and the up rows of the same 64 output columns, so each thread
//   holds both operands of its outputs and stores silu(gate) * up: no [rows, n] intermediate.
// Tiles run expert by expert, m tiles fastest: the tiles sharing a weight tile are neighbours, and
// with one m tile (up to 256 rows an expert) consecutive tiles share the expert's x rows in L2.
// Each CTA reads expert_offsets into shared memory and builds the tile prefix itself, so the host
// never reads the routing and the launch can be captured in a CUDA graph.
#include <cuda.h>
#include <cudaTypedefs.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/wgmma.cuh"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kSlabRows = 64, kSlabs = 4, kBm = kSlabs * kSlabRows, kBn = 128, kBk = 64;
constexpr int kStages = 4;
constexpr int kThreads = 384;                         // producer + 2 consumer warp groups
constexpr uint32_t kSlabBytes = kSlabRows * kBk * 2;  // one slab of x rows in a stage
constexpr uint32_t kWeightBytes = kBn * kBk * 2;      // the weight rows in a stage
constexpr uint32_t kStageBytes = kSlabs * kSlabBytes + kWeightBytes;
constexpr int kMaxExperts = 4096;  // the tile prefix lives in shared memory

// ---- mbarrier and TMA (sm_90) ------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Arrives and announces `bytes` of asynchronous (TMA) writes the phase must also wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `parity` has completed (a fresh barrier is in phase 0, so
// waiting on parity 1 returns at once: the ring's stages start free).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
}
// One box of a 2-D tensor map at (inner, outer) into shared memory; completes bytes on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int inner, int outer,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(smem_addr(bar))
      : "memory");
}

// Where tile `t` of the launch lies: tiles are numbered expert by expert (prefix[e] is the first of
// expert e), m tiles fastest within an expert.
struct Tile {
  int row0 = 0;     // first permuted row
  int row_end = 0;  // one past the expert's last row
  int col0 = 0;     // first output column
  int w_row0 = 0;   // the weight rows in [experts * n, k] of the tile's two 64-column halves
  int w_row1 = 0;
};

// Output columns per tile: 128, or with the SwiGLU fused 64 (the halves are the gate rows and the
// up rows of the same 64 output columns).
__device__ __forceinline__ int tile_cols(bool swiglu) { return swiglu ? kBn / 2 : kBn; }

__device__ __forceinline__ Tile locate_tile(int t, const int* prefix, const int* offsets,
                                            int num_experts, int n, bool swiglu) {
  int lo = 0, hi = num_experts;  // the expert e with prefix[e] <= t < prefix[e + 1]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (prefix[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int e = lo;
  const int m_tiles = (offsets[e + 1] - offsets[e] + kBm - 1) / kBm;
  const int local = t - prefix[e];
  Tile tile;
  tile.row0 = offsets[e] + (local % m_tiles) * kBm;
  tile.row_end = offsets[e + 1];
  tile.col0 = (local / m_tiles) * tile_cols(swiglu);
  tile.w_row0 = e * n + tile.col0;
  tile.w_row1 = swiglu ? tile.w_row0 + n / 2 : tile.w_row0 + kBn / 2;
  return tile;
}

// A consumer warp group's k loop over one tile: kLive of its two slabs hold rows. Leaves every
// wgmma retired and the last stage released.
template <int kLive>
__device__ __forceinline__ void consume_tile(float (&acc)[2][64], uint8_t* stages, uint64_t* full,
                                             uint64_t* empty, int wg, int k_steps, bool signals,
                                             int& stage, uint32_t& phase) {
  int prev_stage = -1;
  for (int ks = 0; ks < k_steps; ++ks) {
    mbar_wait(&full[stage], phase);
    const uint32_t st = smem_addr(stages + stage * kStageBytes);
    const uint32_t a = st + 2 * wg * kSlabBytes, b = st + kSlabs * kSlabBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk) {
      const uint64_t db = gmma_desc_sw128(b + kk * 32, 16, 1024);
      const int accumulate = ks > 0 || kk > 0;
#pragma unroll
      for (int slab = 0; slab < kLive; ++slab) {
        wgmma_ss<128>(acc[slab], gmma_desc_sw128(a + slab * kSlabBytes + kk * 32, 16, 1024), db,
                      accumulate);
      }
    }
    wgmma_commit();
    // The group before this one has retired: its stage may be refilled.
    wgmma_wait<1>();
    if (prev_stage >= 0 && signals) mbar_arrive(&empty[prev_stage]);
    prev_stage = stage;
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
  wgmma_wait<0>();
  wgmma_fence_operands(acc);
  if (signals) mbar_arrive(&empty[prev_stage]);
}

__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_wgmma_kernel(const __grid_constant__ CUtensorMap x_map,
                              const __grid_constant__ CUtensorMap w_map,
                              MoeGroupedMatmulParams<bf16> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  // The 128-byte swizzle is anchored at 1024-byte boundaries; the host adds 1 KB for this alignment.
  uint8_t* stages = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  int* offsets = reinterpret_cast<int*>(empty + kStages);  // [num_experts + 1]
  int* prefix = offsets + p.num_experts + 1;               // [num_experts + 1]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int out_cols = p.swiglu ? p.n / 2 : p.n;
  const int n_tiles = (out_cols + tile_cols(p.swiglu) - 1) / tile_cols(p.swiglu);
  const int k_steps = (p.k + kBk - 1) / kBk;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);   // the producer's arrive; the TMA bytes complete it
      mbar_init(&empty[s], 2);  // one arrive per consumer warp group
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // The routing comes from the permute before this kernel.
  wait_on_prior_grid();
  if (warp == 0) {  // tile prefix: each lane sums a run of experts, then a warp scan
    const int per_lane = (p.num_experts + 31) / 32;
    const int e0 = min(lane * per_lane, p.num_experts), e1 = min(e0 + per_lane, p.num_experts);
    int sum = 0;
    for (int e = e0; e < e1; ++e) {
      const int row0 = p.expert_offsets[e], row1 = p.expert_offsets[e + 1];
      offsets[e] = row0;
      sum += (row1 - row0 + kBm - 1) / kBm * n_tiles;
    }
    int inclusive = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += v;
    }
    int run = inclusive - sum;
    for (int e = e0; e < e1; ++e) {
      prefix[e] = run;
      run += (p.expert_offsets[e + 1] - p.expert_offsets[e] + kBm - 1) / kBm * n_tiles;
    }
    if (lane == 31) {
      prefix[p.num_experts] = inclusive;
      offsets[p.num_experts] = p.expert_offsets[p.num_experts];
    }
  }
  __syncthreads();
  const int num_tiles = prefix[p.num_experts];

  if (warp < 4) {  // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x != 0) return;
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&x_map)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&w_map)) : "memory");
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const Tile tile = locate_tile(t, prefix, offsets, p.num_experts, p.n, p.swiglu);
      const int live_slabs = min(kSlabs, (tile.row_end - tile.row0 + kSlabRows - 1) / kSlabRows);
      const uint32_t bytes = live_slabs * kSlabBytes + kWeightBytes;
      for (int ks = 0; ks < k_steps; ++ks) {
        mbar_wait(&empty[stage], phase ^ 1);
        uint8_t* st = stages + stage * kStageBytes;
        mbar_arrive_expect_tx(&full[stage], bytes);
        for (int slab = 0; slab < live_slabs; ++slab) {
          tma_load_2d(st + slab * kSlabBytes, &x_map, ks * kBk, tile.row0 + slab * kSlabRows,
                      &full[stage]);
        }
        // The weight tile as two 64-row boxes: with the 128-byte swizzle's 8-row period, the second
        // lands exactly where a 128-row box would put its rows 64..127.
        tma_load_2d(st + kSlabs * kSlabBytes, &w_map, ks * kBk, tile.w_row0, &full[stage]);
        tma_load_2d(st + kSlabs * kSlabBytes + kWeightBytes / 2, &w_map, ks * kBk, tile.w_row1,
                    &full[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  // ---- consumers ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int wg = warp / 4 - 1;   // slabs 2 wg and 2 wg + 1 of the tile
  const int wg_warp = warp % 4;  // 16 rows of each slab
  const bool signals = threadIdx.x % 128 == 0;
  float acc[2][64];  // [slab][the thread's accumulators]
  int stage = 0;
  uint32_t phase = 0;
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const Tile tile = locate_tile(t, prefix, offsets, p.num_experts, p.n, p.swiglu);
    const int my_row0 = tile.row0 + 2 * wg * kSlabRows;
    if (my_row0 >= tile.row_end) {  // no row of this expert in our slabs: keep the ring's count
      for (int ks = 0; ks < k_steps; ++ks) {
        mbar_wait(&full[stage], phase);
        if (signals) mbar_arrive(&empty[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      continue;
    }
    // Both slabs, or only the first (the slab count a template argument: a wgmma under a runtime
    // branch would be serialised).
    if (my_row0 + kSlabRows < tile.row_end) {
      consume_tile<2>(acc, stages, full, empty, wg, k_steps, signals, stage, phase);
    } else {
      consume_tile<1>(acc, stages, full, empty, wg, k_steps, signals, stage, phase);
    }
    // Accumulator (mma.sync C order per 8 columns): acc[s][4 j + 2 i + c] is row
    // s * 64 + wg_warp * 16 + lane / 4 + 8 i of our slabs, column 8 j + 2 (lane % 4) + c. With
    // the SwiGLU fused, column 64 + x (up) sits in the same thread as column x (gate): both
    // rounded to bf16 as the unfused GEMM stores them, then silu_mul as the swiglu kernel.
#pragma unroll
    for (int slab = 0; slab < 2; ++slab) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = my_row0 + slab * kSlabRows + wg_warp * 16 + lane / 4 + 8 * i;
        if (row >= tile.row_end) continue;
        bf16* out = p.out + static_cast<int64_t>(row) * out_cols;
        if (p.swiglu) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int col = tile.col0 + 8 * j + 2 * (lane % 4);
            if (col < out_cols) {
              const __nv_bfloat162 g =
                  __floats2bfloat162_rn(acc[slab][4 * j + 2 * i], acc[slab][4 * j + 2 * i + 1]);
              const __nv_bfloat162 u = __floats2bfloat162_rn(acc[slab][4 * (j + 8) + 2 * i],
                                                             acc[slab][4 * (j + 8) + 2 * i + 1]);
              *reinterpret_cast<__nv_bfloat162*>(out + col) =
                  __floats2bfloat162_rn(silu_mul(__low2float(g), __low2float(u)),
                                        silu_mul(__high2float(g), __high2float(u)));
            }
          }
          continue;
        }
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int col = tile.col0 + 8 * j + 2 * (lane % 4);
          if (col < p.n) {
            *reinterpret_cast<__nv_bfloat162*>(out + col) =
                __floats2bfloat162_rn(acc[slab][4 * j + 2 * i], acc[slab][4 * j + 2 * i + 1]);
          }
        }
      }
    }
  }
#endif
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    RELAY_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                      cudaEnableDefault, &found));
    RELAY_CHECK(found == cudaDriverEntryPointSuccess && f != nullptr,
                "moe_grouped_matmul (wgmma): the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A row-major bf16 matrix [rows, cols] read in boxes of box_rows x 64 columns, 128-byte swizzled
// (the layout the wgmma descriptors of wgmma.cuh describe); reads past the edges fill zeros.
CUtensorMap bf16_tensor_map(const bf16* base, int64_t rows, int64_t cols, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * sizeof(bf16)};
  const cuuint32_t box[2] = {kBk, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  RELAY_CHECK(r == CUDA_SUCCESS, "moe_grouped_matmul (wgmma): cuTensorMapEncodeTiled failed (",
              static_cast<int>(r), ") for a [", rows, ", ", cols, "] matrix");
  return map;
}

}  // namespace

bool moe_grouped_matmul_wgmma_supported(const MoeGroupedMatmulParams<bf16>& p) {
  return p.num_experts > 0 && p.num_experts <= kMaxExperts;
}

void launch_moe_grouped_matmul_wgmma(const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.k % 8 == 0 && p.n % 8 == 0, "moe_grouped_matmul (wgmma): n ", p.n, " and k ", p.k,
              " must be multiples of 8 (16-byte TMA rows)");
  RELAY_CHECK(!p.swiglu || p.n % 16 == 0, "moe_grouped_matmul (wgmma): the fused SwiGLU needs n ",
              p.n, " a multiple of 16 (gate | up, each of 16-byte rows)");
  RELAY_CHECK(p.permuted_index == nullptr,
              "moe_grouped_matmul (wgmma): its TMA loads read permuted rows, not gathered ones");
  RELAY_CHECK(moe_grouped_matmul_wgmma_supported(p), "moe_grouped_matmul (wgmma): ",
              p.num_experts, " experts (at most ", kMaxExperts, ")");
  RELAY_CHECK(reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0,
              "moe_grouped_matmul (wgmma): x and w must be 16-byte aligned (TMA)");
  if (p.num_rows == 0) return;
  RELAY_CHECK(device_has_wgmma(), "moe_grouped_matmul (wgmma): needs a compute capability 9.0 GPU");
  const int smem = 1024 + kStages * kStageBytes + 2 * kStages * sizeof(uint64_t) +
                   2 * (p.num_experts + 1) * sizeof(int);
  allow_dynamic_smem(grouped_gemm_wgmma_kernel, smem);
  // Tiles at most: every expert may add one partial m tile. The stages hold one CTA per SM
  // (__launch_bounds__(kThreads, 1)), so the persistent grid is the SM count.
  const int64_t max_tiles = (ceil_div(p.num_rows, kBm) + std::min(p.num_rows, p.num_experts)) *
                            (p.swiglu ? ceil_div(p.n / 2, kBn / 2) : ceil_div(p.n, kBn));
  const int grid = static_cast<int>(std::min<int64_t>(max_tiles, device_sm_count()));
  launch_dependent("grouped_gemm_wgmma_kernel", grouped_gemm_wgmma_kernel, dim3(grid),
                   dim3(kThreads), smem, s, bf16_tensor_map(p.x, p.num_rows, p.k, kSlabRows),
                   bf16_tensor_map(p.w, static_cast<int64_t>(p.num_experts) * p.n, p.k, kBn / 2),
                   p);
}

}  // namespace relay::kernels

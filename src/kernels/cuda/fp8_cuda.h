// The CUDA FP8 ops: dynamic activation quantisation and the block-scaled (Hopper) and MXFP8 GEMMs
// of kernels/fp8_ops.h, on bf16 activations and outputs.
//
// Each launch takes the CPU reference's params struct instantiated on __nv_bfloat16 and a stream
// (the CPU launches in kernels/cpu/fp8_ops.cpp define the results). Like ops_cuda.h: asynchronous, no
// synchronisation, no allocation, expert_offsets read only on the device, so every launch can be
// captured into a CUDA graph. Shape checks at the boundary throw relay::Error naming the op.
//
// Requirements beyond the CPU contract (checked): k and n multiples of 8 (16-byte bf16 rows; 8-byte
// fp8 rows), block-scaled block sizes 128 x 128 (the Qwen3-FP8 / DeepSeek layout). The GEMMs round
// the fp32 result to bf16 once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/ops_cuda.h"
#include "kernels/fp8_ops.h"

namespace relay::kernels {

using bf16 = __nv_bfloat16;

// bf16 [num_tokens, k] -> e4m3 + one fp32 scale per (token, 128-group): bit-identical to the CPU
// recipe applied to the bf16 values as floats (scale = amax / 448, 1 for an all-zero group; a true
// division, the hardware's saturating round-to-nearest-even e4m3 conversion).
void launch_fp8_act_quant(const Fp8ActQuantParams<bf16>& p, cudaStream_t s);

// Fp8PermuteRowsParams on the GPU (k a multiple of 16): one warp per token reads its codes
// and scales once and writes them to its top_k permuted rows (with live_tokens, the warps of a
// capped grid stride over the live tokens, as launch_moe_permute's row copy).
void launch_fp8_permute_rows(const Fp8PermuteRowsParams& p, cudaStream_t s);

// The down projection's input in one pass: h = bf16(silu(gate) * up) exactly as launch_swiglu
// computes it, then quantised as launch_fp8_act_quant would quantise h. So the result equals
// launch_swiglu followed by launch_fp8_act_quant, bit for bit, without writing h (with live_rows:
// both given the same bound, the dead rows' codes and scales left unwritten).
struct SwigluFp8QuantParams {
  const bf16* gate_up = nullptr;  // [num_rows, 2 * width], gate then up (as SwigluParams)
  uint8_t* q = nullptr;           // [num_rows, width] e4m3 codes of h
  float* scale = nullptr;         // [num_rows, ceil(width / 128)] (or group-major, below)
  int num_rows = 0;
  int width = 0;
  bool group_major_scales = false;  // as Fp8ActQuantParams::group_major_scales
  LiveRows live_rows = {};          // as SwigluParams::live_rows; none: every row
};
void launch_swiglu_fp8_quant(const SwigluFp8QuantParams& p, cudaStream_t s);

// Block-scaled grouped GEMM over experts. Tiled: mma.sync m16n8k32 e4m3 tiles, one 128-block of k
// per pipeline stage, each k-block's fp32 partial promoted with both scales. Streaming: each CTA
// streams 16 weight rows of one active expert over all of k, split across its warps, on the same
// instruction with the expert's (up to 8 at a time) rows as the narrow operand (decode).
// CutlassCooperative: CUTLASS's Hopper block-scaled FP8 grouped kernel (TMA + wgmma, 128x128x128
// tiles, fp8_grouped_gemm_cutlass.cu). Auto picks streaming up to 8 rows per expert on average,
// the tiled kernel up to 16, and beyond that (prefill) CUTLASS unless prefill_grouped_gemm_kind()
// says tiled, and the tiled kernel for shapes CUTLASS cannot take (k not a multiple of 16).
void launch_fp8_block_grouped_matmul(const Fp8BlockGroupedMatmulParams<bf16>& p,
                                     cudaStream_t s);
void launch_fp8_block_grouped_matmul(const Fp8BlockGroupedMatmulParams<bf16>& p,
                                     GroupedGemmKind kind, cudaStream_t s);
// The CUTLASS variant itself (called through launch_fp8_block_grouped_matmul). TMA moves 16-byte
// rows, so it needs k a multiple of 16 (e4m3 x and w rows), n a multiple of 8 (bf16 out rows) and
// 16-byte aligned x, w and out.
void launch_fp8_block_grouped_matmul_cutlass(const Fp8BlockGroupedMatmulParams<bf16>& p,
                                             cudaStream_t s);
inline bool fp8_block_grouped_matmul_cutlass_supported(int n, int k) {
  return n > 0 && k > 0 && n % 8 == 0 && k % 16 == 0;
}

// The dense block-scaled GEMM: the tiled and streaming kernels with the whole of m as one expert
// (x scales token-major).
void launch_fp8_block_matmul(const Fp8BlockMatmulParams<bf16>& p, cudaStream_t s);
void launch_fp8_block_matmul(const Fp8BlockMatmulParams<bf16>& p, GroupedGemmKind kind,
                             cudaStream_t s);

// The dense block-scaled GEMM through cuBLASLt (CUDA >= 12.9 on Hopper: fp32 accumulation
// promoted per 128-block of k). x is scaled per 1 x 128 group (VEC128_32F) and must be quantised
// with group-major scales (x_scale_group_major). The weight is scaled per 128 x 128 block
// (BLK128x128_32F, p.w_scale) where cuBLASLt has an algorithm pairing the two, else per 1 x 128
// group with w_row_scale ([ceil(k / 128), n]: each block's scale repeated for its 128 rows, made by
// expand_fp8_row_scales) — the same product either way. Needs ceil(k / 128) a multiple of 4, n and
// k multiples of 16 and 16-byte aligned pointers. fp8_block_matmul_cublaslt_supported says whether
// cuBLASLt has an algorithm for the shape (asked once per shape and cached). The backend uses it
// for the dense projections wherever supported.
bool fp8_block_matmul_cublaslt_supported(int m, int n, int k);
void launch_fp8_block_matmul_cublaslt(const Fp8BlockMatmulParams<bf16>& p,
                                      const float* w_row_scale, cudaStream_t s);

// MXFP8 (the Blackwell format): activations -> e4m3 + E8M0 per (token, 32-group), bit-identical to
// the CPU quantiser. The GEMMs run the Blackwell-native kernel below where mxfp8_sm100_available()
// and the shape allows it; elsewhere (Hopper) a correctness path that applies sx[row, g] *
// sw[col, g] to every m16n8k32 product (one MX group along k).
void launch_mxfp8_act_quant(const Mxfp8ActQuantParams<bf16>& p, cudaStream_t s);
void launch_mxfp8_matmul(const Mxfp8MatmulParams<bf16>& p, cudaStream_t s);
void launch_mxfp8_grouped_matmul(const Mxfp8GroupedMatmulParams<bf16>& p, cudaStream_t s);

// The Blackwell-native MXFP8 grouped GEMM (sm100/mxfp8_grouped_gemm_sm100.cu): CUTLASS's sm100
// block-scaled tcgen05 kernel, the scales applied by the MMA per 32-group. expert_offsets may be
// null with num_experts 1 (a dense GEMM). Built with -DRELAY_SM100=ON (the default) for sm_100a
// only, so it runs on compute capability 10.0 GPUs; compiled in CI, not yet run on hardware here.
// mxfp8_sm100_available(): built in, and the current device is one it runs on.
bool mxfp8_sm100_available();
inline bool mxfp8_sm100_supported(int n, int k) {
  return n > 0 && k > 0 && n % 8 == 0 && k % 16 == 0;
}
void launch_mxfp8_grouped_matmul_sm100(const Mxfp8GroupedMatmulParams<bf16>& p,
                                       cudaStream_t s);

}  // namespace relay::kernels

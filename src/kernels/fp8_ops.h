// FP8 on every backend: the 8-bit number formats and the FP8 ops' params with their CPU
// references (kernels/cuda/fp8_cuda.h launches the same params on the GPU).
//
// The 8-bit number formats of Relay's FP8 paths: OCP FP8 E4M3 ("e4m3fn") elements and OCP MX E8M0
// scales.
//
// E4M3 (bias 7) has no infinities: 0x7F / 0xFF are NaN, the largest finite value is 448 (0x7E), the
// smallest subnormal 2^-9. Encoding rounds to nearest, ties to even, and saturates finite values
// beyond ±448 to ±448 — exactly what torch produces for `x.clamp(-448,
// 448).to(torch.float8_e4m3fn)` (torch itself turns values above ~464 into NaN, which is why every
// quantiser clamps first). E8M0 is a bare biased exponent: code e means 2^(e - 127), 0xFF is NaN;
// it has no sign, no zero.
//
// These are the scalar definitions every other quant file and the tests build on; the GPU kernels
// use the hardware conversions, which agree with them bit for bit (tests/fixtures/quant holds
// torch's answers for all 256 codes and for thousands of random and tie values).
//
// CPU references for the FP8 compute path: dynamic activation quantisation and scaled FP8 GEMMs.
//
// These define what the GPU FP8 kernels must compute (one params struct and one launch per op, in
// the style of kernels/ops.h: each struct is templated on the element type T of the activations and
// outputs; the CPU launches here take T = float, the CUDA launches in kernels/cuda/fp8_cuda.h the
// same structs on bf16 and a stream). Shapes are row-major, "[a, b]" means b is contiguous; e4m3
// tensors are uint8_t codes (above); scales are fp32 (block) or E8M0 codes (MX).
//
// Block-scaled FP8 (Hopper; the Qwen3-*-FP8 checkpoints):
//   activations x [m, k] are quantised per token per group of 128 along k: scale = amax / 448 in
//   fp32 (1 for an all-zero group), q = e4m3(clamp(x / scale, ±448)) — the weight recipe on 1 x 128
//   blocks. Weights are [n, k] with one scale per 128 x 128 block. The GEMM accumulates, for each
//   k-block b, the exact products q_x * q_w in fp32 (in k order), multiplies that partial sum by
//   x_scale[i, b] * w_scale[j / 128, b] (one fp32 product, then one fp32 multiply) and adds it to
//   an fp32 accumulator in b order — the "promote each k-block into fp32 with its scales" structure
//   of DeepGEMM-style kernels. A GPU kernel's sums within a block may be ordered differently; tests
//   compare with a relative tolerance of a few fp32 ulps x sqrt(k).
// MXFP8 (Blackwell-native, OCP MX): the same with groups of 32 along k and E8M0 (power-of-two)
//   scales for both operands: activations [m, k/32] and weights [n, k/32].
//
// k need not be a multiple of the group size: the last group is partial, exactly like the edge
// blocks of a checkpoint weight.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/ops.h"  // kernels::LiveRows

namespace relay {
class ThreadPool;
}

namespace relay::kernels {

inline constexpr int kFp8BlockSize = 128;  // Qwen / DeepSeek weight_block_size, both dimensions
inline constexpr int kMxGroupSize = 32;    // OCP MX: elements per E8M0 scale


inline constexpr float kE4m3Max = 448.0f;      // largest finite E4M3 value
inline constexpr uint8_t kE4m3MaxCode = 0x7E;  // its code
inline constexpr uint8_t kE4m3NanCode = 0x7F;  // canonical NaN (0xFF is NaN too)
inline constexpr int kE8m0Bias = 127;
inline constexpr uint8_t kE8m0NanCode = 0xFF;

// E4M3 code -> fp32 (exact: every E4M3 value is an fp32 value).
float e4m3_to_f32(uint8_t code);
// fp32 -> E4M3, round-to-nearest-even, saturating to ±448; NaN -> 0x7F with the input's sign.
uint8_t f32_to_e4m3(float x);

// E8M0 code -> 2^(code - 127) (code 0 is the fp32 subnormal 2^-127, still exact); 0xFF -> NaN.
float e8m0_to_f32(uint8_t code);
// The MX scale for a group whose largest magnitude is `amax`: the smallest power of two 2^(e-127)
// with amax / 2^(e-127) <= 448, so no element of the group saturates (every finite fp32 amax has
// one; amax 0 and anything below 448 * 2^-127 get code 0). An infinite or NaN amax is an error that
// names the value: such a group has no meaningful scale.
uint8_t e8m0_scale_code_for_amax(float amax);


// Per (token, 128-group) dynamic quantisation of activations for the block-scaled GEMMs.
template <typename T>
struct Fp8ActQuantParams {
  const T* x = nullptr;    // [num_tokens, k]
  uint8_t* q = nullptr;    // [num_tokens, k] e4m3 codes
  float* scale = nullptr;  // [num_tokens, ceil(k / group_size)]; x ~= q * scale
  int num_tokens = 0;
  int k = 0;
  int group_size = kFp8BlockSize;
  // false: scale[t * groups + g]; true: scale[g * num_tokens + t], the token-contiguous layout
  // cuBLASLt's 1 x 128 block scaling (VEC128_32F) reads.
  bool group_major_scales = false;
  // Only the live tokens are read and quantised; the dead ones' codes and scales are not written
  // (the DP + EP receive buffer's empty slots). None: every token.
  LiveRows live_tokens = {};  // over the num_tokens tokens
};
void launch_fp8_act_quant(const Fp8ActQuantParams<float>& p, ThreadPool& pool);

// The MoE permutation of quantised rows: row t * top_k + j of the tokens' e4m3 codes and scales
// (fp8_act_quant output, token-major scales) goes to permuted row permuted_index[t * top_k + j]
// (kernels::MoePermuteParams). Each row's 128-groups are its own, so quantising the tokens and then
// permuting equals permuting and then quantising, at 1 / top_k of the quantisation work and half
// the bytes of a bf16 permutation. The bounds are kernels::MoePermuteParams's: only live tokens
// are read, and permuted rows outside copied_rows are not written.
struct Fp8PermuteRowsParams {
  const uint8_t* q = nullptr;              // [num_tokens, k] e4m3 codes
  const float* scale = nullptr;            // [num_tokens, ceil(k / 128)]
  const int32_t* permuted_index = nullptr;  // [num_tokens * top_k]
  uint8_t* permuted_q = nullptr;           // [num_tokens * top_k, k]
  float* permuted_scale = nullptr;         // [num_tokens * top_k, ceil(k / 128)]
  int num_tokens = 0;
  int k = 0;
  int top_k = 0;
  LiveRows live_tokens = {};  // over the num_tokens tokens; none: every token
  kernels::LiveRows copied_rows = {};  // over the num_tokens * top_k permuted rows; none: all
};
void launch_fp8_permute_rows(const Fp8PermuteRowsParams& p, ThreadPool& pool);

// out = dequant(x) @ dequant(w)^T with block-scaled operands (see the file comment).
template <typename T>
struct Fp8BlockMatmulParams {
  const uint8_t* x = nullptr;      // [m, k] e4m3
  const float* x_scale = nullptr;  // [m, ceil(k / block_k)], or [ceil(k / block_k), m]
  const uint8_t* w = nullptr;      // [n, k] e4m3
  const float* w_scale =
      nullptr;       // [ceil(n / block_n), ceil(k / block_k)] (the checkpoint's weight_scale_inv)
  T* out = nullptr;  // [m, n]
  int m = 0;
  int n = 0;
  int k = 0;
  int block_n = kFp8BlockSize;  // weight block rows
  int block_k = kFp8BlockSize;  // weight block columns = activation group size
  bool x_scale_group_major = false;  // x_scale as Fp8ActQuantParams::group_major_scales wrote it
};
void launch_fp8_block_matmul(const Fp8BlockMatmulParams<float>& p, ThreadPool& pool);

// The 128 x 128 block scales of an [n, k] weight ([ceil(n / 128), ceil(k / 128)]) as one scale per
// row and 128-group of k, group-major ([ceil(k / 128), n]): the 1 x 128 layout cuBLASLt reads for
// the weight operand when it has no 128 x 128 algorithm (kernels/cuda/fp8_cuda.h).
std::vector<float> expand_fp8_row_scales(const float* block_scales, int64_t n, int64_t k);

// The MoE form: out[r] = x[r] @ w[e]^T for every permuted row r of expert e, block-scaled.
template <typename T>
struct Fp8BlockGroupedMatmulParams {
  const uint8_t* x = nullptr;      // [num_rows, k] e4m3
  const float* x_scale = nullptr;  // [num_rows, ceil(k / block_k)]
  const uint8_t* w = nullptr;      // [num_experts, n, k] e4m3
  const float* w_scale = nullptr;  // [num_experts, ceil(n / block_n), ceil(k / block_k)]
  const int32_t* expert_offsets =
      nullptr;       // [num_experts + 1], expert_offsets[num_experts] = num_rows
  T* out = nullptr;  // [num_rows, n]
  int num_rows = 0;
  int num_experts = 0;
  int n = 0;
  int k = 0;
  int block_n = kFp8BlockSize;
  int block_k = kFp8BlockSize;
};
void launch_fp8_block_grouped_matmul(const Fp8BlockGroupedMatmulParams<float>& p, ThreadPool& pool);

// Per (token, 32-group) MX quantisation of activations: E8M0 scale as for weights (kernels/fp8_ops.h).
template <typename T>
struct Mxfp8ActQuantParams {
  const T* x = nullptr;      // [num_tokens, k]
  uint8_t* q = nullptr;      // [num_tokens, k] e4m3 codes
  uint8_t* scale = nullptr;  // [num_tokens, ceil(k / 32)] E8M0 codes
  int num_tokens = 0;
  int k = 0;
};
void launch_mxfp8_act_quant(const Mxfp8ActQuantParams<float>& p, ThreadPool& pool);

// out = dequant(x) @ dequant(w)^T with MX operands.
template <typename T>
struct Mxfp8MatmulParams {
  const uint8_t* x = nullptr;        // [m, k] e4m3
  const uint8_t* x_scale = nullptr;  // [m, ceil(k / 32)] E8M0
  const uint8_t* w = nullptr;        // [n, k] e4m3
  const uint8_t* w_scale = nullptr;  // [n, ceil(k / 32)] E8M0 (the checkpoint's weight_scale)
  T* out = nullptr;                  // [m, n]
  int m = 0;
  int n = 0;
  int k = 0;
};
void launch_mxfp8_matmul(const Mxfp8MatmulParams<float>& p, ThreadPool& pool);

// The MoE form of the MX GEMM.
template <typename T>
struct Mxfp8GroupedMatmulParams {
  const uint8_t* x = nullptr;        // [num_rows, k] e4m3
  const uint8_t* x_scale = nullptr;  // [num_rows, ceil(k / 32)] E8M0
  const uint8_t* w = nullptr;        // [num_experts, n, k] e4m3
  const uint8_t* w_scale = nullptr;  // [num_experts, n, ceil(k / 32)] E8M0
  const int32_t* expert_offsets =
      nullptr;       // [num_experts + 1], expert_offsets[num_experts] = num_rows
  T* out = nullptr;  // [num_rows, n]
  int num_rows = 0;
  int num_experts = 0;
  int n = 0;
  int k = 0;
};
void launch_mxfp8_grouped_matmul(const Mxfp8GroupedMatmulParams<float>& p, ThreadPool& pool);

// ---- Weight recipes (the activation quantisers above reuse them on 1 x group blocks) ----


// w [rows, cols] -> q [rows, cols] (E4M3 codes), scale_inv [ceil(rows / block_rows), ceil(cols /
// block_cols)]. Streaming callers may pass a stripe of rows whose start is a multiple of
// block_rows.
void quantize_weight_fp8_block(const float* w, int64_t rows, int64_t cols, int block_rows,
                               int block_cols, uint8_t* q, float* scale_inv);
// q, scale_inv as above -> w [rows, cols].
void dequantize_weight_fp8_block(const uint8_t* q, const float* scale_inv, int64_t rows,
                                 int64_t cols, int block_rows, int block_cols, float* w);

// w [rows, cols] -> q [rows, cols] (E4M3 codes), scale [rows, ceil(cols / 32)] (E8M0 codes).
void quantize_weight_mxfp8(const float* w, int64_t rows, int64_t cols, uint8_t* q, uint8_t* scale);
// q, scale as above -> w [rows, cols].
void dequantize_weight_mxfp8(const uint8_t* q, const uint8_t* scale, int64_t rows, int64_t cols,
                             float* w);

}  // namespace relay::kernels

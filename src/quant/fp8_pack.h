// Block-FP8 weights laid out for the GPU's fused GEMMs: parts stacked along the output rows.
//
// The CUDA backend multiplies q|k|v and gate|up as one weight each. With 128 x 128 scale blocks a
// part may only start on a whole block of rows, or one scale would span two parts (and two
// checkpoint tensors with different scales). So every part starts at a row offset that is a
// multiple of 128; a part whose row count is not (a 192-wide expert, a 64-row k_proj of the test
// fixtures) is followed by zero rows up to the next block. Columns can be padded with zeros too
// (the down projection's input width follows gate|up's padded width). Zero codes contribute nothing
// to any product and leave every block maximum unchanged, so the padded GEMM computes exactly the
// unpadded one. Every real Qwen3 shape (head_dim 128, expert widths 768 / 1536) needs no padding.
//
// A part comes from an F8_E4M3 checkpoint tensor with its weight_scale_inv (codes and scales
// copied) or from a BF16/F16/F32 tensor, quantised here with the fp8-block128 recipe
// (weight_quant.h) —
// `--dtype fp8` on a bf16 checkpoint.
#pragma once

#include <cstdint>

#include "quant/quant_config.h"
#include "quant/weight_quant.h"

namespace relay {
class ThreadPool;
}

namespace relay::quant {

inline int64_t round_up_to_block(int64_t n) { return kernels::ceil_div(n, kernels::kFp8BlockSize) * kernels::kFp8BlockSize; }

// A packed weight's geometry: codes [rows, cols], scales [rows / 128, ceil(cols / 128)].
struct Fp8PackedShape {
  int64_t rows = 0;  // sum of the parts' rows, each rounded up to 128
  int64_t cols = 0;
  int64_t scale_rows() const { return kernels::ceil_div(rows, kernels::kFp8BlockSize); }
  int64_t scale_cols() const { return kernels::ceil_div(cols, kernels::kFp8BlockSize); }
  int64_t code_bytes() const { return rows * cols; }
  int64_t scale_count() const { return scale_rows() * scale_cols(); }
};

// Writes one part [r, c] (c <= shape.cols) at row `row_offset` (a multiple of 128) of the packed
// weight whose codes start at `q` and scales at `scale`; rows and columns it does not cover are
// left as they are (the caller zeroes the buffers once). An F8_E4M3 weight needs its scale tensor
// (`scale_tensor`, checked by read_fp8_block_scales against `config`, whose blocks must be 128 x
// 128); any other dtype is quantised and `scale_tensor` must be null. Rows are quantised in
// parallel stripes on `pool` when given.
void pack_fp8_block_part(const QuantConfig& config, const StoredTensor& weight,
                         const StoredTensor* scale_tensor, const Fp8PackedShape& shape,
                         int64_t row_offset, uint8_t* q, float* scale, ThreadPool* pool);

}  // namespace relay::quant

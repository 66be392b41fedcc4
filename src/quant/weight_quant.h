// Reading quantised weights from a checkpoint; the quantisation recipes themselves (kernels/fp8_ops.h:
// quantize_weight_fp8_block, quantize_weight_mxfp8 and their inverses) are shared with the
// activation quantisers.
//
// Recipes (docs/fp8.md has the full description):
//   - FP8 block (Qwen3-*-FP8 / DeepSeek-V3): a weight [rows, cols] is cut into block_rows x
//   block_cols
//     blocks (128 x 128), edge blocks partial. Per block, scale = amax / 448 in fp32 (1 for an
//     all-zero block), q = e4m3(clamp(w / scale, ±448)), and the checkpoint stores scale as
//     `weight_scale_inv` [ceil(rows / 128), ceil(cols / 128)]. Dequantised: w = q * scale_inv.
//   - MXFP8 (OCP MX): each run of 32 consecutive elements of a row (along the input dim) shares an
//     E8M0 scale 2^e, the smallest power of two that keeps the group within ±448 (kernels/fp8_ops.h);
//     q = e4m3(w / 2^e) (exact scaling, so only the e4m3 rounding loses information). Scales are
//     [rows, ceil(cols / 32)]. Dequantised: w = q * 2^e.
// Every dequantised value is computed as one fp32 product of two exact values, so Relay's numbers
// equal torch's `q.float() * scale` bit for bit (tests/fixtures/quant).
//
// This library sits below relay_model (the loader calls dequantize_stored_weight), so checkpoint
// tensors come in as StoredTensor: the fields of a safetensors TensorView, without the dependency.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "quant/quant_config.h"

namespace relay::quant {

// A checkpoint tensor as the loader sees it (the fields of relay::TensorView).
struct StoredTensor {
  std::string_view name;
  std::string_view file;  // the shard, for error messages
  DType dtype = DType::F32;
  std::span<const int64_t> shape;
  const uint8_t* data = nullptr;
};

// Element i of a floating-point tensor stored as F32, BF16 or F16, as fp32; other dtypes are an
// error naming the tensor.
float stored_float_at(const StoredTensor& t, int64_t i);

// The fp32 block scales of an F8_E4M3 weight [rows, cols] under an fp8 `config`, after checking the
// scale's dtype (F32, BF16 or F16) and shape ([ceil(rows / block_out), ceil(cols / block_in)]);
// errors name the file, the tensor and both shapes.
std::vector<float> read_fp8_block_scales(const QuantConfig& config, const StoredTensor& weight,
                                         const StoredTensor& scale);

// The name of the scale tensor that goes with quantised weight `weight_name` under `config`:
// "<weight_name>_scale_inv" (fp8) or "<weight_name>_scale" (mxfp8).
std::string scale_tensor_name(const QuantConfig& config, std::string_view weight_name);

// Dequantises an F8_E4M3 checkpoint weight [rows, cols] with its scale tensor into w (fp32), after
// checking everything against `config`: the method, both dtypes (fp8 scales: F32, BF16 or F16, read
// from the header; mxfp8 scales: U8 or F8_E8M0) and the scale shape. Errors name the file, the
// tensor and both shapes.
void dequantize_stored_weight(const QuantConfig& config, const StoredTensor& weight,
                              const StoredTensor& scale, float* w);
// The loader's form: checks that the checkpoint is quantised before asking `find_tensor` for the
// scale tensor (scale_tensor_name), so an F8 weight in an unquantised checkpoint is reported as
// such rather than as a missing scale.
void dequantize_stored_weight(const QuantConfig& config, const StoredTensor& weight,
                              const std::function<StoredTensor(const std::string&)>& find_tensor,
                              float* w);

}  // namespace relay::quant

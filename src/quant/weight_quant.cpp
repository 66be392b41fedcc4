// See weight_quant.h. Loops run block by block (fp8) or group by group (mxfp8) so that one pass
// finds the amax and the next quantises the same cache-resident values.
#include "quant/weight_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "kernels/fp8_ops.h"

namespace relay::quant {

namespace {

std::string shape_str(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

float stored_float_at(const StoredTensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::F32: {
      float v;
      std::memcpy(&v, t.data + 4 * i, 4);
      return v;
    }
    case DType::BF16: {
      uint16_t v;
      std::memcpy(&v, t.data + 2 * i, 2);
      return bf16_to_f32(v);
    }
    case DType::F16: {
      uint16_t v;
      std::memcpy(&v, t.data + 2 * i, 2);
      return f16_to_f32(v);
    }
    default:
      fail(str("tensor ", t.name, " in ", t.file, ": expected F32, BF16 or F16, got ",
               dtype_name(t.dtype)));
  }
}

std::string scale_tensor_name(const QuantConfig& config, std::string_view weight_name) {
  return std::string(weight_name) + (config.method == QuantMethod::Mxfp8 ? "_scale" : "_scale_inv");
}

std::vector<float> read_fp8_block_scales(const QuantConfig& config, const StoredTensor& weight,
                                         const StoredTensor& scale) {
  const int64_t rows = weight.shape[0], cols = weight.shape[1];
  const int64_t expected[2] = {kernels::ceil_div(rows, config.block_out), kernels::ceil_div(cols, config.block_in)};
  RELAY_CHECK(scale.dtype == DType::F32 || scale.dtype == DType::BF16 || scale.dtype == DType::F16,
              "scale tensor ", scale.name, " in ", scale.file, " has dtype ",
              dtype_name(scale.dtype), "; fp8 block scales are F32, BF16 or F16");
  RELAY_CHECK(std::ranges::equal(scale.shape, expected), "scale tensor ", scale.name, " in ",
              scale.file, " has shape ", shape_str(scale.shape), ", expected ", shape_str(expected),
              " for weight ", weight.name, " ", shape_str(weight.shape), " with ", config.block_out,
              "x", config.block_in, " blocks");
  std::vector<float> out(expected[0] * expected[1]);
  for (size_t i = 0; i < out.size(); ++i) out[i] = stored_float_at(scale, static_cast<int64_t>(i));
  return out;
}

void dequantize_stored_weight(const QuantConfig& config, const StoredTensor& weight,
                              const StoredTensor& scale, float* w) {
  RELAY_CHECK(config.quantized(), "tensor ", weight.name, " in ", weight.file, " is ",
              dtype_name(weight.dtype), " but config.json has no quantization_config");
  RELAY_CHECK(weight.dtype == DType::F8_E4M3, "tensor ", weight.name, " in ", weight.file,
              " has dtype ", dtype_name(weight.dtype), "; quantised weights are F8_E4M3");
  RELAY_CHECK(weight.shape.size() == 2, "quantised weight ", weight.name, " in ", weight.file,
              " has shape ", shape_str(weight.shape), "; expected 2 dimensions [out, in]");
  const int64_t rows = weight.shape[0], cols = weight.shape[1];
  if (config.method == QuantMethod::Fp8Block) {
    const std::vector<float> scale_f32 = read_fp8_block_scales(config, weight, scale);
    kernels::dequantize_weight_fp8_block(weight.data, scale_f32.data(), rows, cols, config.block_out,
                                config.block_in, w);
  } else {
    const int64_t expected[2] = {rows, kernels::ceil_div(cols, config.group_size)};
    RELAY_CHECK(scale.dtype == DType::U8 || scale.dtype == DType::F8_E8M0, "scale tensor ",
                scale.name, " in ", scale.file, " has dtype ", dtype_name(scale.dtype),
                "; mxfp8 scales are U8 or F8_E8M0 codes");
    RELAY_CHECK(std::ranges::equal(scale.shape, expected), "scale tensor ", scale.name, " in ",
                scale.file, " has shape ", shape_str(scale.shape), ", expected ",
                shape_str(expected), " for weight ", weight.name, " ", shape_str(weight.shape),
                " with groups of ", config.group_size);
    kernels::dequantize_weight_mxfp8(weight.data, scale.data, rows, cols, w);
  }
}

void dequantize_stored_weight(const QuantConfig& config, const StoredTensor& weight,
                              const std::function<StoredTensor(const std::string&)>& find_tensor,
                              float* w) {
  RELAY_CHECK(config.quantized(), "tensor ", weight.name, " in ", weight.file, " is ",
              dtype_name(weight.dtype), " but config.json has no quantization_config");
  dequantize_stored_weight(config, weight, find_tensor(scale_tensor_name(config, weight.name)), w);
}

}  // namespace relay::quant

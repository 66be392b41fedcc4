// See weight_quant.h. Loops run block by block (fp8) or group by group (mxfp8) so that one pass
// finds the amax and the next quantises the same cache-resident values.
#include "quant/weight_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "quant/fp8_format.h"

namespace relay::quant {

namespace {

float block_amax(const float* w, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
  }
  return amax;
}

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

void quantize_weight_fp8_block(const float* w, int64_t rows, int64_t cols, int block_rows,
                               int block_cols, uint8_t* q, float* scale_inv) {
  RELAY_CHECK(block_rows > 0 && block_cols > 0, "fp8 block size ", block_rows, "x", block_cols,
              " must be positive");
  const int64_t scale_cols = ceil_div(cols, block_cols);
  for (int64_t br = 0; br * block_rows < rows; ++br) {
    const int64_t r0 = br * block_rows, r1 = std::min(rows, r0 + block_rows);
    for (int64_t bc = 0; bc < scale_cols; ++bc) {
      const int64_t c0 = bc * block_cols, c1 = std::min(cols, c0 + block_cols);
      const float amax = block_amax(w, cols, r0, r1, c0, c1);
      RELAY_CHECK(std::isfinite(amax), "fp8 quantisation: block (", br, ", ", bc,
                  ") holds a non-finite value");
      // NOTE: scale = amax / 448 rounded once in fp32, and q = w / scale (a division, not a
      // multiply by 448 / amax): the recipe of the published FP8 checkpoints, reproduced bit for
      // bit by the fixture.
      const float scale = amax > 0.0f ? amax / kE4m3Max : 1.0f;
      scale_inv[br * scale_cols + bc] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float v = std::clamp(w[r * cols + c] / scale, -kE4m3Max, kE4m3Max);
          q[r * cols + c] = f32_to_e4m3(v);
        }
      }
    }
  }
}

void dequantize_weight_fp8_block(const uint8_t* q, const float* scale_inv, int64_t rows,
                                 int64_t cols, int block_rows, int block_cols, float* w) {
  const int64_t scale_cols = ceil_div(cols, block_cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = scale_inv + (r / block_rows) * scale_cols;
    for (int64_t c = 0; c < cols; ++c)
      w[r * cols + c] = e4m3_to_f32(q[r * cols + c]) * scale_row[c / block_cols];
  }
}

void quantize_weight_mxfp8(const float* w, int64_t rows, int64_t cols, uint8_t* q, uint8_t* scale) {
  const int64_t num_groups = ceil_div(cols, kMxGroupSize);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t c0 = g * kMxGroupSize, c1 = std::min(cols, c0 + kMxGroupSize);
      const float amax = block_amax(w, cols, r, r + 1, c0, c1);
      const uint8_t code = e8m0_scale_code_for_amax(amax);
      scale[r * num_groups + g] = code;
      // Division by a power of two is exact (ldexp), so the e4m3 rounding is the only loss.
      const int shift = kE8m0Bias - static_cast<int>(code);
      for (int64_t c = c0; c < c1; ++c)
        q[r * cols + c] = f32_to_e4m3(std::ldexp(w[r * cols + c], shift));
    }
  }
}

void dequantize_weight_mxfp8(const uint8_t* q, const uint8_t* scale, int64_t rows, int64_t cols,
                             float* w) {
  const int64_t num_groups = ceil_div(cols, kMxGroupSize);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      w[r * cols + c] =
          e4m3_to_f32(q[r * cols + c]) * e8m0_to_f32(scale[r * num_groups + c / kMxGroupSize]);
    }
  }
}

std::string scale_tensor_name(const QuantConfig& config, std::string_view weight_name) {
  return std::string(weight_name) + (config.method == QuantMethod::Mxfp8 ? "_scale" : "_scale_inv");
}

std::vector<float> read_fp8_block_scales(const QuantConfig& config, const StoredTensor& weight,
                                         const StoredTensor& scale) {
  const int64_t rows = weight.shape[0], cols = weight.shape[1];
  const int64_t expected[2] = {ceil_div(rows, config.block_out), ceil_div(cols, config.block_in)};
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
    dequantize_weight_fp8_block(weight.data, scale_f32.data(), rows, cols, config.block_out,
                                config.block_in, w);
  } else {
    const int64_t expected[2] = {rows, ceil_div(cols, config.group_size)};
    RELAY_CHECK(scale.dtype == DType::U8 || scale.dtype == DType::F8_E8M0, "scale tensor ",
                scale.name, " in ", scale.file, " has dtype ", dtype_name(scale.dtype),
                "; mxfp8 scales are U8 or F8_E8M0 codes");
    RELAY_CHECK(std::ranges::equal(scale.shape, expected), "scale tensor ", scale.name, " in ",
                scale.file, " has shape ", shape_str(scale.shape), ", expected ",
                shape_str(expected), " for weight ", weight.name, " ", shape_str(weight.shape),
                " with groups of ", config.group_size);
    dequantize_weight_mxfp8(weight.data, scale.data, rows, cols, w);
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

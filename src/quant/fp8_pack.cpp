// See fp8_pack.h.
#include "quant/fp8_pack.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace relay::quant {

void pack_fp8_block_part(const QuantConfig& config, const StoredTensor& weight,
                         const StoredTensor* scale_tensor, const Fp8PackedShape& shape,
                         int64_t row_offset, uint8_t* q, float* scale, ThreadPool* pool) {
  RELAY_CHECK(weight.shape.size() == 2, "weight ", weight.name, " in ", weight.file, " has ",
              weight.shape.size(), " dimensions; expected [out, in]");
  const int64_t rows = weight.shape[0], cols = weight.shape[1];
  RELAY_CHECK(
      row_offset % kernels::kFp8BlockSize == 0 && row_offset + rows <= shape.rows && cols <= shape.cols,
      "fp8 packing: part ", weight.name, " [", rows, ", ", cols, "] at row ", row_offset,
      " does not fit the packed weight [", shape.rows, ", ", shape.cols, "]");
  const int64_t scale_cols = shape.scale_cols(), block_row0 = row_offset / kernels::kFp8BlockSize;
  const int64_t part_scale_cols = kernels::ceil_div(cols, kernels::kFp8BlockSize);
  if (weight.dtype == DType::F8_E4M3) {
    RELAY_CHECK(scale_tensor != nullptr, "weight ", weight.name, " in ", weight.file,
                " is F8_E4M3 but has no scale tensor");
    RELAY_CHECK(
        config.method == QuantMethod::Fp8Block && config.block_out == kernels::kFp8BlockSize &&
            config.block_in == kernels::kFp8BlockSize,
        "weight ", weight.name, " in ", weight.file,
        ": the GPU's FP8 kernels take block-scaled FP8 with 128 x 128 blocks (config.json "
        "quantization_config weight_block_size); this checkpoint's method or blocks differ");
    const std::vector<float> s = read_fp8_block_scales(config, weight, *scale_tensor);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(q + (row_offset + r) * shape.cols, weight.data + r * cols, cols);
    }
    for (int64_t br = 0; br < kernels::ceil_div(rows, kernels::kFp8BlockSize); ++br) {
      std::copy_n(s.data() + br * part_scale_cols, part_scale_cols,
                  scale + (block_row0 + br) * scale_cols);
    }
    return;
  }
  RELAY_CHECK(scale_tensor == nullptr, "weight ", weight.name, " in ", weight.file, " is ",
              dtype_name(weight.dtype), " but came with a scale tensor");
  // Quantised in stripes of 128 rows (one row of scale blocks each), in parallel: the recipe is per
  // block, so stripes are independent.
  const int64_t stripes = kernels::ceil_div(rows, kernels::kFp8BlockSize);
  auto quantize_stripes = [&](int64_t b, int64_t e) {
    std::vector<float> w(static_cast<size_t>(kernels::kFp8BlockSize) * cols);
    std::vector<uint8_t> codes(w.size());
    std::vector<float> s(part_scale_cols);
    for (int64_t stripe = b; stripe < e; ++stripe) {
      const int64_t r0 = stripe * kernels::kFp8BlockSize, n = std::min<int64_t>(kernels::kFp8BlockSize, rows - r0);
      for (int64_t i = 0; i < n * cols; ++i) w[i] = stored_float_at(weight, r0 * cols + i);
      kernels::quantize_weight_fp8_block(w.data(), n, cols, kernels::kFp8BlockSize, kernels::kFp8BlockSize, codes.data(),
                                s.data());
      for (int64_t r = 0; r < n; ++r) {
        std::memcpy(q + (row_offset + r0 + r) * shape.cols, codes.data() + r * cols, cols);
      }
      std::copy(s.begin(), s.end(), scale + (block_row0 + stripe) * scale_cols);
    }
  };
  if (pool != nullptr) {
    pool->parallel_for(stripes, 1, quantize_stripes);
  } else {
    quantize_stripes(0, stripes);
  }
}

}  // namespace relay::quant

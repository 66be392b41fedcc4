// Packed block-FP8 weights (quant/fp8_pack.h): each part lands on whole 128-row blocks, padding is
// zero, and the packed codes and scales dequantise to exactly what each part's own quantisation
// gives — from a bf16 tensor (quantised while packing) and from an F8_E4M3 tensor with its scales.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "quant/fp8_pack.h"

namespace relay::quant {
namespace {

struct Part {
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
  StoredTensor view(DType dtype, const char* name) const {
    return {name, "test.safetensors", dtype, shape, data.data()};
  }
};

Part bf16_part(int64_t rows, int64_t cols, std::mt19937& rng, std::vector<float>& values) {
  std::normal_distribution<float> dist(0.0f, 0.05f);
  Part p{{rows, cols}, std::vector<uint8_t>(rows * cols * 2)};
  values.resize(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const uint16_t b = f32_to_bf16(dist(rng) * (i % 37 == 0 ? 20.0f : 1.0f));
    values[i] = bf16_to_f32(b);
    std::memcpy(p.data.data() + 2 * i, &b, 2);
  }
  return p;
}

TEST(Fp8Pack, PartsStartOnWholeBlocksAndDequantiseAsTheirOwnQuantisation) {
  std::mt19937 rng(5);
  const int64_t cols = 200, gate_rows = 192, up_rows = 64, dst_cols = 256;
  std::vector<float> gate_w, up_w;
  const Part gate = bf16_part(gate_rows, cols, rng, gate_w);
  const Part up_src = bf16_part(up_rows, cols, rng, up_w);
  // The second part arrives as an FP8 checkpoint tensor: quantised here with the same recipe.
  std::vector<uint8_t> up_q(up_rows * cols);
  std::vector<float> up_scale(kernels::ceil_div(up_rows, 128) * kernels::ceil_div(cols, 128));
  kernels::quantize_weight_fp8_block(up_w.data(), up_rows, cols, 128, 128, up_q.data(), up_scale.data());
  Part up{{up_rows, cols}, up_q};
  Part up_s{{kernels::ceil_div(up_rows, 128), kernels::ceil_div(cols, 128)},
            std::vector<uint8_t>(up_scale.size() * 4)};
  std::memcpy(up_s.data.data(), up_scale.data(), up_s.data.size());

  const Fp8PackedShape shape{round_up_to_block(gate_rows) + round_up_to_block(up_rows), dst_cols};
  ASSERT_EQ(shape.rows, 384);
  std::vector<uint8_t> q(shape.code_bytes(), 0);
  std::vector<float> scale(shape.scale_count(), 0.0f);
  QuantConfig config;
  config.method = QuantMethod::Fp8Block;
  ThreadPool pool(2);
  pack_fp8_block_part(QuantConfig{}, gate.view(DType::BF16, "gate_proj.weight"), nullptr, shape, 0,
                      q.data(), scale.data(), &pool);
  const StoredTensor up_scale_view = up_s.view(DType::F32, "up_proj.weight_scale_inv");
  pack_fp8_block_part(config, up.view(DType::F8_E4M3, "up_proj.weight"), &up_scale_view, shape, 256,
                      q.data(), scale.data(), nullptr);

  std::vector<float> packed(shape.rows * shape.cols);
  kernels::dequantize_weight_fp8_block(q.data(), scale.data(), shape.rows, shape.cols, 128, 128,
                              packed.data());
  std::vector<uint8_t> gate_q(gate_rows * cols);
  std::vector<float> gate_scale(kernels::ceil_div(gate_rows, 128) * kernels::ceil_div(cols, 128));
  kernels::quantize_weight_fp8_block(gate_w.data(), gate_rows, cols, 128, 128, gate_q.data(),
                            gate_scale.data());
  std::vector<float> gate_ref(gate_rows * cols), up_ref(up_rows * cols);
  kernels::dequantize_weight_fp8_block(gate_q.data(), gate_scale.data(), gate_rows, cols, 128, 128,
                              gate_ref.data());
  kernels::dequantize_weight_fp8_block(up_q.data(), up_scale.data(), up_rows, cols, 128, 128, up_ref.data());
  for (int64_t r = 0; r < shape.rows; ++r) {
    for (int64_t c = 0; c < shape.cols; ++c) {
      const float got = packed[r * shape.cols + c];
      float want = 0.0f;  // padding rows (192..255, 320..383) and columns (200..255)
      if (c < cols && r < gate_rows) want = gate_ref[r * cols + c];
      if (c < cols && r >= 256 && r < 256 + up_rows) want = up_ref[(r - 256) * cols + c];
      ASSERT_EQ(got, want) << "row " << r << " col " << c;
    }
  }
}

TEST(Fp8Pack, RefusesMisplacedPartsAndMissingScales) {
  std::mt19937 rng(1);
  std::vector<float> w;
  const Part p = bf16_part(64, 64, rng, w);
  const Fp8PackedShape shape{256, 64};
  std::vector<uint8_t> q(shape.code_bytes());
  std::vector<float> s(shape.scale_count());
  QuantConfig config;
  config.method = QuantMethod::Fp8Block;
  EXPECT_THROW(pack_fp8_block_part(config, p.view(DType::BF16, "w"), nullptr, shape, 64, q.data(),
                                   s.data(), nullptr),
               Error);
  EXPECT_THROW(pack_fp8_block_part(config, p.view(DType::F8_E4M3, "w"), nullptr, shape, 0, q.data(),
                                   s.data(), nullptr),
               Error);
  config.block_out = 64;
  const StoredTensor scale_view = p.view(DType::F32, "w_scale_inv");
  EXPECT_THROW(pack_fp8_block_part(config, p.view(DType::F8_E4M3, "w"), &scale_view, shape, 0,
                                   q.data(), s.data(), nullptr),
               Error);
}

}  // namespace
}  // namespace relay::quant

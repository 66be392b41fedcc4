// Weight quantisation against torch (the fixture's recipes, bit for bit), error bounds on random
// weights, the checkpoint-tensor dequantiser's validation, and quantization_config parsing.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/fp8_ops.h"
#include "quant/quant_config.h"
#include "quant/weight_quant.h"
#include "quant_test_util.h"

namespace relay::quant {
namespace {

using testing::bits_of;

QuantConfig fp8_config() {
  QuantConfig c;
  c.method = QuantMethod::Fp8Block;
  return c;
}

QuantConfig mx_config() {
  QuantConfig c;
  c.method = QuantMethod::Mxfp8;
  return c;
}

StoredTensor stored(const TensorView& t) { return {t.name, t.file, t.dtype, t.shape, t.data}; }

class WeightFixture : public ::testing::Test {
 protected:
  SafetensorsFile file{testing::fixture_path("weights.safetensors")};
  const TensorView& get(const std::string& name) { return file.tensors().at(name); }
  std::vector<float> w = testing::floats(get("w"));
  int64_t rows = get("w").shape[0], cols = get("w").shape[1];
};

void expect_bitwise_equal(const std::vector<float>& got, const std::vector<float>& expected,
                          const char* what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  int mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (bits_of(got[i]) != bits_of(expected[i]) && ++mismatches <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs torch " << expected[i];
    }
  }
  EXPECT_EQ(mismatches, 0) << what;
}

TEST_F(WeightFixture, Fp8BlockQuantisationMatchesTorchBitForBit) {
  ASSERT_EQ(rows, 136);
  ASSERT_EQ(cols, 200);
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> scale(2 * 2);
  kernels::quantize_weight_fp8_block(w.data(), rows, cols, 128, 128, q.data(), scale.data());
  EXPECT_EQ(q, testing::bytes(get("fp8_q")));
  expect_bitwise_equal(scale, testing::floats(get("fp8_scale_inv")), "scale_inv");
  EXPECT_EQ(scale[3], 1.0f);  // the all-zero edge block

  std::vector<float> deq(rows * cols);
  kernels::dequantize_weight_fp8_block(q.data(), scale.data(), rows, cols, 128, 128, deq.data());
  expect_bitwise_equal(deq, testing::floats(get("fp8_dequant")), "fp8 dequant");
}

TEST_F(WeightFixture, Mxfp8QuantisationMatchesTorchBitForBit) {
  const int64_t groups = kernels::ceil_div(cols, kernels::kMxGroupSize);
  std::vector<uint8_t> q(rows * cols), scale(rows * groups);
  kernels::quantize_weight_mxfp8(w.data(), rows, cols, q.data(), scale.data());
  EXPECT_EQ(q, testing::bytes(get("mx_q")));
  EXPECT_EQ(scale, testing::bytes(get("mx_scale")));
  std::vector<float> deq(rows * cols);
  kernels::dequantize_weight_mxfp8(q.data(), scale.data(), rows, cols, deq.data());
  expect_bitwise_equal(deq, testing::floats(get("mx_dequant")), "mx dequant");
}

TEST_F(WeightFixture, StoredWeightDequantisesLikeTorchForEveryScaleDtype) {
  const TensorView& q = get("fp8_q");
  StoredTensor weight = stored(q);
  weight.dtype = DType::F8_E4M3;
  expect_bitwise_equal(
      [&] {
        std::vector<float> out(rows * cols);
        dequantize_stored_weight(fp8_config(), weight, stored(get("fp8_scale_inv")), out.data());
        return out;
      }(),
      testing::floats(get("fp8_dequant")), "F32 scales");

  // BF16 scale_inv (read from the header's dtype): w = q * float(bf16(scale)).
  const std::vector<float> scale = testing::floats(get("fp8_scale_inv"));
  std::vector<uint16_t> scale_bf16(scale.size());
  std::vector<float> scale_rounded(scale.size());
  for (size_t i = 0; i < scale.size(); ++i) {
    scale_bf16[i] = f32_to_bf16(scale[i]);
    scale_rounded[i] = bf16_to_f32(scale_bf16[i]);
  }
  const std::vector<int64_t> scale_shape = {2, 2};
  const StoredTensor scale_tensor{"w_scale_inv", "mem", DType::BF16, scale_shape,
                                  reinterpret_cast<const uint8_t*>(scale_bf16.data())};
  std::vector<float> got(rows * cols), expected(rows * cols);
  dequantize_stored_weight(fp8_config(), weight, scale_tensor, got.data());
  kernels::dequantize_weight_fp8_block(q.data, scale_rounded.data(), rows, cols, 128, 128, expected.data());
  expect_bitwise_equal(got, expected, "BF16 scales");

  StoredTensor mx_weight = stored(get("mx_q"));
  mx_weight.dtype = DType::F8_E4M3;
  StoredTensor mx_scale = stored(get("mx_scale"));
  mx_scale.dtype = DType::F8_E8M0;
  std::vector<float> mx(rows * cols);
  dequantize_stored_weight(mx_config(), mx_weight, mx_scale, mx.data());
  expect_bitwise_equal(mx, testing::floats(get("mx_dequant")), "E8M0 scales");
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(StoredWeight, RejectsBadScalesNamingFileTensorAndBothShapes) {
  std::vector<uint8_t> q(300 * 200);
  std::vector<float> scale(3 * 2), out(300 * 200);
  const std::vector<int64_t> w_shape = {300, 200}, good = {3, 2}, bad = {2, 2}, mx_shape = {300, 7};
  const StoredTensor weight{"model.layers.0.mlp.down_proj.weight", "model-00001.safetensors",
                            DType::F8_E4M3, w_shape, q.data()};
  const auto scale_of = [&](DType d, const std::vector<int64_t>& s) {
    return StoredTensor{"model.layers.0.mlp.down_proj.weight_scale_inv", "model-00002.safetensors",
                        d, s, reinterpret_cast<const uint8_t*>(scale.data())};
  };
  dequantize_stored_weight(fp8_config(), weight, scale_of(DType::F32, good), out.data());

  const std::string shape_error = error_of([&] {
    dequantize_stored_weight(fp8_config(), weight, scale_of(DType::F32, bad), out.data());
  });
  for (const char* part : {"model.layers.0.mlp.down_proj.weight_scale_inv",
                           "model-00002.safetensors", "[2, 2]", "[3, 2]", "[300, 200]"}) {
    EXPECT_NE(shape_error.find(part), std::string::npos)
        << part << " missing from: " << shape_error;
  }
  EXPECT_NE(error_of([&] {
              dequantize_stored_weight(fp8_config(), weight, scale_of(DType::I32, good),
                                       out.data());
            }).find("has dtype I32"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              dequantize_stored_weight(QuantConfig{}, weight, scale_of(DType::F32, good),
                                       out.data());
            }).find("no quantization_config"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              dequantize_stored_weight(mx_config(), weight, scale_of(DType::F32, mx_shape),
                                       out.data());
            }).find("mxfp8 scales are U8 or F8_E8M0"),
            std::string::npos);
  // The loader's form asks for the scale by name, and only once the config says it is quantised.
  std::vector<std::string> asked;
  const auto find = [&](const std::string& name) {
    asked.push_back(name);
    return scale_of(DType::F32, good);
  };
  dequantize_stored_weight(fp8_config(), weight, find, out.data());
  EXPECT_EQ(asked, std::vector<std::string>{"model.layers.0.mlp.down_proj.weight_scale_inv"});
  EXPECT_NE(error_of([&] {
              dequantize_stored_weight(QuantConfig{}, weight, find, out.data());
            }).find("no quantization_config"),
            std::string::npos);
  EXPECT_EQ(asked.size(), 1u);
  EXPECT_EQ(scale_tensor_name(mx_config(), "a.weight"), "a.weight_scale");
  StoredTensor wrong = weight;
  wrong.dtype = DType::BF16;
  EXPECT_NE(error_of([&] {
              dequantize_stored_weight(fp8_config(), wrong, scale_of(DType::F32, good), out.data());
            }).find("quantised weights are F8_E4M3"),
            std::string::npos);
}

// |w - dequant(quant(w))| <= max(|w| * 2^-4, scale * 2^-10) * (1 + 2^-20): e4m3 keeps 3 mantissa
// bits (a relative half-step of 2^-4) down to its smallest normal, and the subnormal grid has step
// 2^-9 (half-step 2^-10) in units of the scale; the slack covers the one fp32 rounding of w /
// scale.
void expect_within_e4m3_bound(const std::vector<float>& w, const std::vector<float>& deq,
                              const std::function<float(int64_t)>& scale_of_index,
                              const char* what) {
  int failures = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    const double bound =
        std::max(std::fabs(w[i]) * 0x1p-4, scale_of_index(i) * 0x1p-10) * (1 + 0x1p-20);
    if (std::fabs(static_cast<double>(w[i]) - deq[i]) > bound && ++failures <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << w[i] << " -> " << deq[i] << ", bound " << bound;
    }
  }
  EXPECT_EQ(failures, 0) << what;
}

TEST(WeightQuant, QuantiseDequantiseErrorIsWithinTheE4m3Bound) {
  std::mt19937 rng(5);
  for (auto [rows, cols] : {std::pair{1, 1}, {128, 128}, {129, 257}, {300, 96}, {7, 1000}}) {
    std::vector<float> w(rows * cols);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (float& v : w) v = normal(rng) * (rng() % 50 == 0 ? 40.0f : 1.0f);  // heavy tails
    const int64_t sc = kernels::ceil_div(cols, 128);
    std::vector<uint8_t> q(w.size());
    std::vector<float> scale(kernels::ceil_div(rows, 128) * sc), deq(w.size());
    kernels::quantize_weight_fp8_block(w.data(), rows, cols, 128, 128, q.data(), scale.data());
    kernels::dequantize_weight_fp8_block(q.data(), scale.data(), rows, cols, 128, 128, deq.data());
    expect_within_e4m3_bound(
        w, deq, [&](int64_t i) { return scale[(i / cols / 128) * sc + (i % cols) / 128]; },
        "fp8 block");

    const int64_t groups = kernels::ceil_div(cols, 32);
    std::vector<uint8_t> mq(w.size()), ms(rows * groups);
    kernels::quantize_weight_mxfp8(w.data(), rows, cols, mq.data(), ms.data());
    kernels::dequantize_weight_mxfp8(mq.data(), ms.data(), rows, cols, deq.data());
    expect_within_e4m3_bound(
        w, deq, [&](int64_t i) { return kernels::e8m0_to_f32(ms[(i / cols) * groups + (i % cols) / 32]); },
        "mxfp8");
  }
}

TEST(WeightQuant, BlockMaximumIsRepresentedExactly) {
  // scale = amax / 448, so the largest element maps to 448 (code 0x7E) up to the division's
  // rounding.
  std::vector<float> w = {0.1f, -0.7f, 0.3f, 0.25f};
  std::vector<uint8_t> q(4);
  float scale = 0;
  kernels::quantize_weight_fp8_block(w.data(), 2, 2, 128, 128, q.data(), &scale);
  EXPECT_EQ(scale, 0.7f / 448.0f);
  EXPECT_EQ(q[1], 0xFE);
}

TEST(QuantConfig, ParsesTheQwenFp8Config) {
  const nlohmann::json j = nlohmann::json::parse(R"({
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.layers.0.input_layernorm", "model.layers.0.mlp.gate",
                               "model.norm"]})");
  const QuantConfig c = QuantConfig::from_json(j, "config.json");
  EXPECT_EQ(c.method, QuantMethod::Fp8Block);
  EXPECT_EQ(c.block_out, 128);
  EXPECT_EQ(c.block_in, 128);
  EXPECT_TRUE(c.keeps_unquantized("lm_head"));
  EXPECT_TRUE(c.keeps_unquantized("model.layers.0.mlp.gate"));
  EXPECT_FALSE(c.keeps_unquantized("model.layers.1.mlp.gate"));
  EXPECT_FALSE(c.keeps_unquantized("model.layers.0.mlp.gate_proj"));
  EXPECT_FALSE(c.keeps_unquantized("model.layers.0.mlp.experts.0.gate_proj"));
  EXPECT_EQ(QuantConfig::from_json(c.to_json(), "round trip").modules_to_not_convert,
            c.modules_to_not_convert);

  QuantConfig suffixes;
  suffixes.modules_to_not_convert = {"mlp.gate"};
  EXPECT_TRUE(suffixes.keeps_unquantized("model.layers.7.mlp.gate"));
  EXPECT_FALSE(suffixes.keeps_unquantized("model.layers.7.xmlp.gate"));
}

TEST(QuantConfig, RejectsWhatRelayCannotRunNamingTheField) {
  const auto reject = [](const char* text, const char* part) {
    const std::string e =
        error_of([&] { QuantConfig::from_json(nlohmann::json::parse(text), "cfg.json"); });
    EXPECT_NE(e.find(part), std::string::npos) << text << " -> " << e;
  };
  reject(R"({"quant_method": "fp8", "fmt": "e4m3"})", "weight_block_size");
  reject(R"({"quant_method": "fp8", "weight_block_size": [128]})", "weight_block_size");
  reject(R"({"quant_method": "fp8", "weight_block_size": [0, 128]})", "positive");
  reject(
      R"({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"})",
      "activation_scheme");
  reject(R"({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"})", "fmt");
  reject(R"({"quant_method": "awq"})", "quant_method 'awq'");
  reject(R"({"fmt": "e4m3"})", "quant_method");
  reject(R"({"quant_method": "mxfp8", "group_size": 16})", "group_size");
  reject(
      R"({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": [1]})",
      "modules_to_not_convert");
  const QuantConfig mx =
      QuantConfig::from_json(nlohmann::json::parse(R"({"quant_method": "mxfp8"})"), "x");
  EXPECT_EQ(mx.method, QuantMethod::Mxfp8);
  EXPECT_EQ(QuantConfig::from_json(mx.to_json(), "y").method, QuantMethod::Mxfp8);
}

}  // namespace
}  // namespace relay::quant

// FP8 E4M3 / E8M0 scalar formats against torch 2.9.1 (tests/fixtures/quant/formats.safetensors):
// every code decoded, thousands of values (ties, neighbours of ties, specials, log-uniform random)
// encoded, all bit for bit; plus the MX scale rule's defining inequalities.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "core/error.h"
#include "kernels/fp8_ops.h"
#include "quant_test_util.h"

namespace relay::quant {
namespace {

using testing::bits_of;

class FormatFixture : public ::testing::Test {
 protected:
  SafetensorsFile file{testing::fixture_path("formats.safetensors")};
  const TensorView& get(const std::string& name) { return file.tensors().at(name); }
};

TEST_F(FormatFixture, DecodesEveryE4m3CodeAsTorch) {
  const std::vector<float> expected = testing::floats(get("e4m3_decode"));
  ASSERT_EQ(expected.size(), 256u);
  int nan_codes = 0;
  for (int c = 0; c < 256; ++c) {
    const float got = kernels::e4m3_to_f32(static_cast<uint8_t>(c));
    if (std::isnan(expected[c])) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      ++nan_codes;
    } else {
      EXPECT_EQ(bits_of(got), bits_of(expected[c]))
          << "code " << c << ": " << got << " vs " << expected[c];
    }
  }
  EXPECT_EQ(nan_codes, 2);  // 0x7F and 0xFF
  EXPECT_EQ(kernels::e4m3_to_f32(kernels::kE4m3MaxCode), kernels::kE4m3Max);
}

TEST_F(FormatFixture, DecodesEveryE8m0CodeAsTorch) {
  const std::vector<float> expected = testing::floats(get("e8m0_decode"));
  ASSERT_EQ(expected.size(), 256u);
  for (int c = 0; c < 255; ++c) {
    EXPECT_EQ(bits_of(kernels::e8m0_to_f32(static_cast<uint8_t>(c))), bits_of(expected[c])) << "code " << c;
  }
  EXPECT_TRUE(std::isnan(expected[255]));
  EXPECT_TRUE(std::isnan(kernels::e8m0_to_f32(kernels::kE8m0NanCode)));
}

TEST_F(FormatFixture, EncodesLikeTorchClampThenCast) {
  const std::vector<float> inputs = testing::floats(get("encode_inputs"));
  const TensorView& codes = get("encode_codes");
  ASSERT_EQ(codes.nbytes, inputs.size());
  ASSERT_GT(inputs.size(), 9000u);
  int mismatches = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const uint8_t got = kernels::f32_to_e4m3(inputs[i]);
    if (got != codes.data[i] && ++mismatches <= 10) {
      ADD_FAILURE() << "input " << inputs[i] << " (bits 0x" << std::hex << bits_of(inputs[i])
                    << "): got 0x" << int(got) << ", torch 0x" << int(codes.data[i]);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Fp8Format, EncodeDecodeRoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    const float v = kernels::e4m3_to_f32(static_cast<uint8_t>(c));
    if (std::isnan(v)) continue;
    EXPECT_EQ(kernels::f32_to_e4m3(v), c) << "code " << c << " value " << v;
  }
}

TEST(Fp8Format, NanKeepsItsSignAndInfinitySaturates) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(kernels::f32_to_e4m3(nan), 0x7F);
  EXPECT_EQ(kernels::f32_to_e4m3(-nan), 0xFF);
  EXPECT_EQ(kernels::f32_to_e4m3(INFINITY), 0x7E);
  EXPECT_EQ(kernels::f32_to_e4m3(-INFINITY), 0xFE);
  EXPECT_EQ(kernels::f32_to_e4m3(1e30f), 0x7E);
}

TEST(Fp8Format, MxScaleIsTheSmallestPowerOfTwoThatAvoidsSaturation) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> log2_mag(-140.0, 127.9);
  for (int i = 0; i < 20000; ++i) {
    const float amax = static_cast<float>(std::exp2(log2_mag(rng)));
    const int code = kernels::e8m0_scale_code_for_amax(amax);
    // amax <= 448 * 2^(code - 127), and one step smaller would not hold (unless code is 0).
    EXPECT_LE(static_cast<double>(amax), 448.0 * std::exp2(code - 127)) << amax;
    if (code > 0) {
      EXPECT_GT(static_cast<double>(amax), 448.0 * std::exp2(code - 128)) << amax;
    }
  }
  EXPECT_EQ(kernels::e8m0_scale_code_for_amax(0.0f), 0);
  EXPECT_EQ(kernels::e8m0_scale_code_for_amax(448.0f), 127);
  EXPECT_EQ(kernels::e8m0_scale_code_for_amax(448.00003f), 128);
  EXPECT_EQ(kernels::e8m0_scale_code_for_amax(1.0f), 127 - 8);  // 1 <= 448 * 2^-8 = 1.75, not <= 0.875
  EXPECT_THROW(kernels::e8m0_scale_code_for_amax(INFINITY), Error);
  EXPECT_THROW(kernels::e8m0_scale_code_for_amax(std::numeric_limits<float>::quiet_NaN()), Error);
}

}  // namespace
}  // namespace relay::quant

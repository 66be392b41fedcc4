#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"
#include "core/error.h"

namespace relay {

TEST(DType, Bf16RoundTripsAndRoundsToNearestEven) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-3.5f)), -3.5f);
  // 1 + 2^-8 lies exactly between two bf16 values; ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(DType, F16MatchesIeeeHalf) {
  for (float v : {0.0f, 1.0f, -2.0f, 65504.0f, 0.5f, 6.103515625e-05f, 5.960464477539063e-08f}) {
    EXPECT_EQ(f16_to_f32(f32_to_f16(v)), v) << v;
  }
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
}

TEST(DType, ParseNamesTheField) {
  EXPECT_EQ(parse_dtype("BF16", "x"), DType::BF16);
  try {
    parse_dtype("Q4", "model.safetensors: tensor w");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor w"), std::string::npos);
  }
}

}  // namespace relay

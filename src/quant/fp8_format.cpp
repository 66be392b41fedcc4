// See fp8_format.h. The encoder works on the fp32 bit pattern so that rounding is decided by
// integer arithmetic, not by the current floating-point rounding mode.
#include "quant/fp8_format.h"

#include <cmath>
#include <cstring>

#include "core/error.h"

namespace relay::quant {

float e4m3_to_f32(uint8_t code) {
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m * 2^-9
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // 1.m * 2^(e-7)
  }
  return (code & 0x80) ? -magnitude : magnitude;
}

uint8_t f32_to_e4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return sign | kE4m3NanCode;
  // 448 = 0x43E00000; anything at or above it (infinity included) saturates.
  if (abs_bits >= 0x43E00000u) return sign | kE4m3MaxCode;
  // Below 2^-6 (E4M3's smallest normal, fp32 biased exponent 121) the grid is uniform with step
  // 2^-9: scaling by 2^9 is exact and rounding to an integer in [0, 8] is the code itself (8 is the
  // smallest normal, whose code is also 8).
  if (abs_bits < (121u << 23)) {
    float magnitude;
    std::memcpy(&magnitude, &abs_bits, sizeof magnitude);
    const float scaled = magnitude * 512.0f;
    const float floor_value = std::floor(scaled);
    const float fraction = scaled - floor_value;
    uint32_t q = static_cast<uint32_t>(floor_value);
    if (fraction > 0.5f || (fraction == 0.5f && (q & 1u))) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  // Normal range: keep 3 of the 23 mantissa bits, rounding the dropped 20 to nearest even; a carry
  // out of the mantissa correctly bumps the exponent. Rebias the exponent from 127 to 7.
  const uint32_t odd = (abs_bits >> 20) & 1u;
  const uint32_t rounded = (abs_bits + 0x7FFFFu + odd) >> 20;
  return sign | static_cast<uint8_t>(rounded - ((127u - 7u) << 3));
}

float e8m0_to_f32(uint8_t code) {
  if (code == kE8m0NanCode) return NAN;
  return std::ldexp(1.0f, static_cast<int>(code) - kE8m0Bias);
}

uint8_t e8m0_scale_code_for_amax(float amax) {
  RELAY_CHECK(std::isfinite(amax) && amax >= 0.0f, "MX scale: group amax ", amax,
              " is not a finite non-negative value");
  if (amax == 0.0f) return 0;
  // amax = f * 2^E with f in [0.5, 1); 448 = 0.875 * 2^9, so amax <= 448 * 2^k holds for
  // k >= E - 9 when f <= 0.875 and for k >= E - 8 otherwise. Both tests are exact.
  int exponent;
  const float fraction = std::frexp(amax, &exponent);
  const int k = exponent - 9 + (fraction > 0.875f ? 1 : 0);
  const int code = k + kE8m0Bias;
  if (code < 0) return 0;
  RELAY_CHECK(code < kE8m0NanCode, "MX scale: group amax ", amax, " needs scale 2^", k,
              ", beyond E8M0's range");
  return static_cast<uint8_t>(code);
}

}  // namespace relay::quant

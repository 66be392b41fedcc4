// The 8-bit number formats of Relay's FP8 paths: OCP FP8 E4M3 ("e4m3fn") elements and OCP MX E8M0
// scales.
//
// E4M3 (bias 7) has no infinities: 0x7F / 0xFF are NaN, the largest finite value is 448 (0x7E), the
// smallest subnormal 2^-9. Encoding rounds to nearest, ties to even, and saturates finite values
// beyond ±448 to ±448 — exactly what torch produces for `x.clamp(-448,
// 448).to(torch.float8_e4m3fn)` (torch itself turns values above ~464 into NaN, which is why every
// quantiser clamps first). E8M0 is a bare biased exponent: code e means 2^(e - 127), 0xFF is NaN;
// it has no sign, no zero.
//
// These are the scalar definitions every other quant file and the tests build on; the GPU kernels
// use the hardware conversions, which agree with them bit for bit (tests/fixtures/quant holds
// torch's answers for all 256 codes and for thousands of random and tie values).
#pragma once

#include <cstdint>

namespace relay::quant {

inline constexpr float kE4m3Max = 448.0f;      // largest finite E4M3 value
inline constexpr uint8_t kE4m3MaxCode = 0x7E;  // its code
inline constexpr uint8_t kE4m3NanCode = 0x7F;  // canonical NaN (0xFF is NaN too)
inline constexpr int kE8m0Bias = 127;
inline constexpr uint8_t kE8m0NanCode = 0xFF;

// E4M3 code -> fp32 (exact: every E4M3 value is an fp32 value).
float e4m3_to_f32(uint8_t code);
// fp32 -> E4M3, round-to-nearest-even, saturating to ±448; NaN -> 0x7F with the input's sign.
uint8_t f32_to_e4m3(float x);

// E8M0 code -> 2^(code - 127) (code 0 is the fp32 subnormal 2^-127, still exact); 0xFF -> NaN.
float e8m0_to_f32(uint8_t code);
// The MX scale for a group whose largest magnitude is `amax`: the smallest power of two 2^(e-127)
// with amax / 2^(e-127) <= 448, so no element of the group saturates (every finite fp32 amax has
// one; amax 0 and anything below 448 * 2^-127 get code 0). An infinite or NaN amax is an error that
// names the value: such a group has no meaningful scale.
uint8_t e8m0_scale_code_for_amax(float amax);

}  // namespace relay::quant

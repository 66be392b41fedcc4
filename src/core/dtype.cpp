#include "core/dtype.h"

#include <cmath>

#include "core/error.h"

namespace relay {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::F8_E4M3: case DType::F8_E8M0: case DType::U8: case DType::I8: case DType::BOOL: return 1;
  }
  fail("unknown dtype");
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::F8_E8M0: return "F8_E8M0";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::I8: return "I8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

DType parse_dtype(std::string_view name, const std::string& what) {
  static constexpr DType kAll[] = {DType::F64, DType::F32, DType::F16, DType::BF16, DType::F8_E4M3,
                                   DType::F8_E8M0, DType::I32, DType::I64, DType::U8, DType::I8,
                                   DType::BOOL};
  for (DType t : kAll) {
    if (dtype_name(t) == name) return t;
  }
  fail(str(what, ": unsupported dtype '", name, "'"));
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    mag = mant ? NAN : INFINITY;
  } else {
    mag = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -mag : mag;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal half: round |f| * 2^24 to nearest even
    float a;
    std::memcpy(&a, &abs, sizeof a);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  abs += 0xfffu + ((abs >> 13) & 1u) - (112u << 23);
  return static_cast<uint16_t>(sign | (abs >> 13));
}

}  // namespace relay

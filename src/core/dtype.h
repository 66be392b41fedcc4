// Element types of checkpoint tensors and their conversions to fp32.
//
// The CPU backend computes in fp32; bf16/f16 weights are widened on load (or on the fly). Conversions
// are exact (bf16/f16 -> f32) or round-to-nearest-even (f32 -> bf16/f16), as torch does.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace relay {

enum class DType : uint8_t { F32, F16, BF16, F8_E4M3, F8_E8M0, I32, I64, U8, I8, BOOL, F64 };

// Bytes per element.
size_t dtype_size(DType t);
// The safetensors spelling ("BF16", "F32", ...).
std::string_view dtype_name(DType t);
// Parses a safetensors dtype string; throws relay::Error naming `what` for unknown values.
DType parse_dtype(std::string_view name, const std::string& what);

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float f);

}  // namespace relay

// Helpers shared by the quant tests: reading the torch fixtures in tests/fixtures/quant.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/safetensors.h"

namespace relay::quant::testing {

inline std::string fixture_path(const std::string& file) {
  return std::string(RELAY_FIXTURES_DIR) + "/quant/" + file;
}

inline std::vector<float> floats(const TensorView& t) { return tensor_to_f32(t); }

inline std::vector<uint8_t> bytes(const TensorView& t) {
  return std::vector<uint8_t>(t.data, t.data + t.nbytes);
}

inline uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

}  // namespace relay::quant::testing

// libFuzzer target for the safetensors header parser, the first code to touch an untrusted file.
//
// The input is split as the file format splits it: the first byte picks the data-section size
// (0..255 bytes), the rest is the header text. The parser must either accept the header or throw
// relay::Error; any other exception, crash, leak or undefined behaviour (ASan/UBSan) is a bug. An
// accepted header is re-checked against the invariants the loader relies on, so a validation gap
// that would let a TensorView point outside the data section also shows up as a crash.
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size == 0) return 0;
  std::vector<uint8_t> data(bytes[0]);
  const std::string_view header(reinterpret_cast<const char*>(bytes + 1), size - 1);
  try {
    std::map<std::string, std::string> metadata;
    const auto tensors =
        relay::SafetensorsFile::parse_header(header, data.data(), data.size(), "fuzz", &metadata);
    for (const auto& [name, t] : tensors) {
      const bool inside = t.data >= data.data() && t.data + t.nbytes <= data.data() + data.size();
      const bool sized = static_cast<size_t>(t.numel()) * relay::dtype_size(t.dtype) == t.nbytes;
      if ((t.nbytes > 0 && !inside) || !sized) std::abort();
    }
  } catch (const relay::Error&) {
    // a rejected header is the expected outcome for most inputs
  }
  return 0;
}

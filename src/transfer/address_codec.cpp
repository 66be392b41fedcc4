// See address_codec.h.
#include "transfer/address_codec.h"

#include <charconv>
#include <cstdint>

namespace relay {

std::string to_hex(const void* data, size_t bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  const auto* p = static_cast<const uint8_t*>(data);
  std::string out(2 * bytes, '0');
  for (size_t i = 0; i < bytes; ++i) {
    out[2 * i] = kDigits[p[i] >> 4];
    out[2 * i + 1] = kDigits[p[i] & 15];
  }
  return out;
}

bool from_hex(std::string_view hex, std::string& out) {
  if (hex.empty() || hex.size() % 2 != 0) return false;
  out.resize(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    uint8_t byte = 0;
    const char* first = hex.data() + 2 * i;
    const auto [ptr, ec] = std::from_chars(first, first + 2, byte, 16);
    if (ec != std::errc{} || ptr != first + 2) return false;
    out[i] = static_cast<char>(byte);
  }
  return true;
}

std::vector<std::string_view> split_fields(std::string_view text) {
  std::vector<std::string_view> fields;
  for (size_t begin = 0;;) {
    const size_t colon = text.find(':', begin);
    fields.push_back(text.substr(begin, colon - begin));
    if (colon == std::string_view::npos) return fields;
    begin = colon + 1;
  }
}

}  // namespace relay

// See normalizer.h. ASCII is already in NFC, so pure-ASCII text (most prompts and code) is copied
// without calling utf8proc.
#include "tokenizer/normalizer.h"

#include <algorithm>
#include <cstdlib>
#include <memory>

#include <utf8proc.h>

#include "core/error.h"
#include "tokenizer/unicode_tables.h"
#include "tokenizer/utf8.h"

namespace relay::tokenizer_detail {
namespace {

void append_utf8proc_nfc(std::string_view text, std::string& out) {
  if (text.empty()) return;
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &mapped,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(mapped, &std::free);
  RELAY_CHECK(n >= 0, "NFC normalisation failed: ", utf8proc_errmsg(n));
  out.append(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
}

bool unknown_to_oracle(uint32_t cp) {
  const auto table = unicode_tables::nfc_unknown();
  return std::binary_search(table.begin(), table.end(), cp);
}

}  // namespace

void append_nfc(std::string_view text, std::string& out) {
  const bool ascii = std::all_of(text.begin(), text.end(),
                                 [](char c) { return static_cast<uint8_t>(c) < 0x80; });
  if (ascii) {
    out.append(text);
    return;
  }
  const uint32_t smallest_unknown = unicode_tables::nfc_unknown().front();
  size_t segment_begin = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t n = utf8::sequence_length(text, pos);
    if (n > 1) {
      const uint32_t cp = utf8::decode_at(text, pos, n);
      if (cp >= smallest_unknown && unknown_to_oracle(cp)) {
        append_utf8proc_nfc(text.substr(segment_begin, pos - segment_begin), out);
        out.append(text.substr(pos, n));
        segment_begin = pos + n;
      }
    }
    pos += std::max<size_t>(n, 1);
  }
  append_utf8proc_nfc(text.substr(segment_begin), out);
}

}  // namespace relay::tokenizer_detail

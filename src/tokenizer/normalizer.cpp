// See normalizer.h.
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

// NFC of a stretch that starts and ends at safe boundaries, cut further at the code points the
// oracle does not know.
void append_nfc_stretch(std::string_view text, std::string& out) {
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

}  // namespace

// NOTE: the position before an ASCII character is a safe place to cut text for NFC: ASCII is a
// starter that never decomposes and is never the second half of a composition, so nothing reorders
// or composes across it. ASCII runs are therefore copied as they are and only the stretches around
// non-ASCII characters (with the ASCII base just before them, which a mark may compose with) go
// through utf8proc; mostly-ASCII text such as source code costs almost nothing to normalise.
void append_nfc(std::string_view text, std::string& out) {
  const auto ascii = [&](size_t i) { return static_cast<uint8_t>(text[i]) < 0x80; };
  size_t pos = 0;
  while (pos < text.size()) {
    size_t first_non_ascii = pos;
    while (first_non_ascii < text.size() && ascii(first_non_ascii)) ++first_non_ascii;
    if (first_non_ascii == text.size()) {
      out.append(text.substr(pos));
      return;
    }
    const size_t begin = first_non_ascii > pos ? first_non_ascii - 1 : first_non_ascii;
    out.append(text.substr(pos, begin - pos));
    size_t end = first_non_ascii;
    while (end < text.size() && !(ascii(end) && (end + 1 == text.size() || ascii(end + 1)))) ++end;
    append_nfc_stretch(text.substr(begin, end - begin), out);
    pos = end;
  }
}

}  // namespace relay::tokenizer_detail

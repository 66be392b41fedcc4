// UTF-8 validation and repair following Unicode's table of well-formed byte sequences (Table 3-7):
// the second byte's allowed range depends on the lead (E0 needs A0..BF, ED needs 80..9F, F0 needs
// 90..BF, F4 needs 80..8F), which is what excludes overlong forms, surrogates and values past
// U+10FFFF. The same table drives validation, repair and the streaming decoder's hold-back rule.
#include "tokenizer/utf8.h"

namespace relay::utf8 {
namespace {

// Total length of the sequence a lead byte starts (0 for bytes that cannot start one).
size_t expected_length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// Whether `byte` may follow `lead` as the sequence's `index`-th byte (index >= 1).
bool valid_continuation(uint8_t lead, size_t index, uint8_t byte) {
  if (index == 1) {
    switch (lead) {
      case 0xE0:
        return byte >= 0xA0 && byte <= 0xBF;
      case 0xED:
        return byte >= 0x80 && byte <= 0x9F;
      case 0xF0:
        return byte >= 0x90 && byte <= 0xBF;
      case 0xF4:
        return byte >= 0x80 && byte <= 0x8F;
      default:
        break;
    }
  }
  return byte >= 0x80 && byte <= 0xBF;
}

// Number of bytes from `pos` that follow the table (lead included), stopping at the first that
// does not or at the end of `text`; never more than the lead's expected length.
size_t valid_run(std::string_view text, size_t pos, size_t need) {
  const auto lead = static_cast<uint8_t>(text[pos]);
  size_t n = 1;
  while (n < need && pos + n < text.size() &&
         valid_continuation(lead, n, static_cast<uint8_t>(text[pos + n]))) {
    ++n;
  }
  return n;
}

}  // namespace

size_t sequence_length(std::string_view text, size_t pos) {
  const size_t need = expected_length(static_cast<uint8_t>(text[pos]));
  if (need <= 1) return need;
  return valid_run(text, pos, need) == need ? need : 0;
}

size_t invalid_length(std::string_view text, size_t pos) {
  const size_t need = expected_length(static_cast<uint8_t>(text[pos]));
  if (need == 0) return 1;
  return valid_run(text, pos, need);
}

bool is_valid(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const size_t n = sequence_length(text, pos);
    if (n == 0) return false;
    pos += n;
  }
  return true;
}

std::string sanitize(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t n = sequence_length(text, pos);
    if (n > 0) {
      out.append(text.substr(pos, n));
      pos += n;
    } else {
      out.append(kReplacement);
      pos += invalid_length(text, pos);
    }
  }
  return out;
}

size_t incomplete_tail_length(std::string_view text) {
  for (size_t k = 1; k <= 3 && k <= text.size(); ++k) {
    const size_t pos = text.size() - k;
    const size_t need = expected_length(static_cast<uint8_t>(text[pos]));
    if (need > k && valid_run(text, pos, need) == k) return k;
  }
  return 0;
}

uint32_t decode_at(std::string_view text, size_t pos, size_t length) {
  const auto byte = [&](size_t i) {
    return static_cast<uint32_t>(static_cast<uint8_t>(text[pos + i]));
  };
  switch (length) {
    case 1:
      return byte(0);
    case 2:
      return ((byte(0) & 0x1F) << 6) | (byte(1) & 0x3F);
    case 3:
      return ((byte(0) & 0x0F) << 12) | ((byte(1) & 0x3F) << 6) | (byte(2) & 0x3F);
    default:
      return ((byte(0) & 0x07) << 18) | ((byte(1) & 0x3F) << 12) | ((byte(2) & 0x3F) << 6) |
             (byte(3) & 0x3F);
  }
}

}  // namespace relay::utf8

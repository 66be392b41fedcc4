// UTF-8 helpers shared by the tokenizer, the decoder and the incremental detokenizer.
//
// Invalid input is repaired the way Python's bytes.decode('utf-8', errors='replace') and Rust's
// String::from_utf8_lossy do (the Unicode "maximal subpart" practice): each maximal prefix of a
// well-formed sequence that is cut short, and each byte that cannot start one, becomes one U+FFFD.
// Relay's tokenizer therefore encodes invalid bytes exactly as Hugging Face encodes the string
// Python would decode them to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/utf8.h"  // append_utf8, used with these helpers

namespace relay::utf8 {

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Length of the well-formed sequence starting at text[pos], or 0 when the bytes there are not one
// (including a sequence cut short by the end of `text`).
size_t sequence_length(std::string_view text, size_t pos);

// Length of the maximal subpart at text[pos]: how many bytes one U+FFFD replaces (at least 1).
// Only meaningful where sequence_length() returned 0.
size_t invalid_length(std::string_view text, size_t pos);

// True when `text` is entirely well-formed UTF-8.
bool is_valid(std::string_view text);

// `text` with every ill-formed subsequence replaced by U+FFFD; valid text is returned unchanged.
std::string sanitize(std::string_view text);

// How many trailing bytes of `text` form an incomplete but so far valid sequence (0 to 3): more
// bytes could still complete it, so a streaming decoder holds them back.
size_t incomplete_tail_length(std::string_view text);

// Decodes the well-formed sequence at text[pos] (of `length` bytes from sequence_length()).
uint32_t decode_at(std::string_view text, size_t pos, size_t length);

}  // namespace relay::utf8

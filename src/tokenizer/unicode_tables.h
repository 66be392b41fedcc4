// Unicode data where the libraries Relay links (PCRE2, utf8proc) and the Hugging Face `tokenizers`
// oracle disagree, because each carries a different Unicode version. The data is generated from the
// oracle (tests/fixtures/tokenizer/make_unicode_tables.py) so that Relay's tokens match it on every
// code point, not only on the common ones.
#pragma once

#include <cstdint>
#include <span>

namespace relay::unicode_tables {

struct CodepointRange {
  uint32_t first;  // inclusive
  uint32_t last;   // inclusive
};

// Letters / numbers of the oracle's \p{L} / \p{N} that PCRE2's classes lack (newer assignments).
std::span<const CodepointRange> extra_letters();
std::span<const CodepointRange> extra_numbers();
// The oracle's \s: Unicode White_Space (PCRE2's \s differs: it also matches U+180E).
std::span<const CodepointRange> white_space();
// Word characters of the oracle's Rust regex \w (next to a single_word added token) that PCRE2's
// [\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}] lacks (newer assignments).
std::span<const CodepointRange> extra_word_characters();
// Sorted code points that utf8proc's NFC changes or reorders but the oracle's (Unicode 9) NFC
// treats as unassigned: starters that never compose.
std::span<const uint32_t> nfc_unknown();

}  // namespace relay::unicode_tables

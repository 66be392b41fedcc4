// See added_tokens.h. The oracle's word test is Rust regex's Unicode \w (Alphabetic, marks, decimal
// digits, connector punctuation, joiners), evaluated here with PCRE2's binary properties plus the
// newer assignments PCRE2 lacks (unicode_tables::extra_word_characters()); its white space is
// Unicode White_Space (unicode_tables::white_space()).
#include "tokenizer/added_tokens.h"

#include <algorithm>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"
#include "tokenizer/unicode_tables.h"
#include "tokenizer/utf8.h"

namespace relay::tokenizer_detail {
namespace {

bool in_ranges(std::span<const unicode_tables::CodepointRange> ranges, uint32_t cp) {
  for (const auto& r : ranges) {
    if (cp >= r.first && cp <= r.last) return true;
  }
  return false;
}

bool is_white_space(uint32_t cp) { return in_ranges(unicode_tables::white_space(), cp); }

bool is_word_character(std::string_view character) {
  static pcre2_code* const code = [] {
    int error = 0;
    PCRE2_SIZE offset = 0;
    // Keep equal to WORD_CLASS in tests/fixtures/tokenizer/make_unicode_tables.py.
    const std::string_view pattern = "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]";
    pcre2_code* c = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                  PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &error, &offset, nullptr);
    RELAY_CHECK(c != nullptr, "PCRE2 lacks Unicode binary properties (needs 10.40 or newer)");
    return c;
  }();
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(character.data()), character.size(),
                             0, PCRE2_NO_UTF_CHECK, data, nullptr);
  pcre2_match_data_free(data);
  return rc > 0 || in_ranges(unicode_tables::extra_word_characters(),
                             utf8::decode_at(character, 0, character.size()));
}

// The last / first character of valid UTF-8 text (empty text has none).
std::string_view last_character(std::string_view text) {
  size_t pos = text.size();
  while (pos > 0 && (static_cast<uint8_t>(text[pos - 1]) & 0xC0) == 0x80) --pos;
  return pos > 0 ? text.substr(pos - 1) : std::string_view{};
}
std::string_view first_character(std::string_view text) {
  return text.empty() ? text : text.substr(0, utf8::sequence_length(text, 0));
}

// Byte length of the white space run ending at `end` / starting at `begin`.
size_t white_space_before(std::string_view text, size_t end) {
  size_t pos = end;
  while (pos > 0) {
    size_t start = pos - 1;
    while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
    if (!is_white_space(utf8::decode_at(text, start, pos - start))) break;
    pos = start;
  }
  return end - pos;
}
size_t white_space_after(std::string_view text, size_t begin) {
  size_t pos = begin;
  while (pos < text.size()) {
    const size_t n = utf8::sequence_length(text, pos);
    if (!is_white_space(utf8::decode_at(text, pos, n))) break;
    pos += n;
  }
  return pos - begin;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens,
                                     const std::vector<std::string>& patterns)
    : tokens_(std::move(tokens)) {
  trie_.emplace_back();
  for (size_t t = 0; t < patterns.size(); ++t) {
    const std::string& pattern = patterns[t];
    if (pattern.empty()) continue;
    int32_t node = 0;
    for (const char c : pattern) {
      const auto byte = static_cast<uint8_t>(c);
      int32_t next = child(node, byte);
      if (next < 0) {
        next = int32_t(trie_.size());
        trie_.emplace_back();
        auto& children = trie_[size_t(node)].children;
        children.insert(std::lower_bound(children.begin(), children.end(),
                                         std::pair<uint8_t, int32_t>{byte, 0}),
                        {byte, next});
      }
      node = next;
    }
    // Equal strings (a token listed twice) keep the first, as the automaton reports the first
    // pattern.
    if (trie_[size_t(node)].token < 0) trie_[size_t(node)].token = int32_t(t);
    first_byte_[static_cast<uint8_t>(pattern[0])] = true;
  }
}

int32_t AddedTokenMatcher::child(int32_t node, uint8_t byte) const {
  const auto& children = trie_[size_t(node)].children;
  const auto it =
      std::lower_bound(children.begin(), children.end(), std::pair<uint8_t, int32_t>{byte, 0});
  return it != children.end() && it->first == byte ? it->second : -1;
}

void AddedTokenMatcher::split(std::string_view text, bool skip_special,
                              std::vector<Segment>& out) const {
  size_t done = 0;  // end of the last emitted segment
  size_t pos = 0;
  while (pos < text.size()) {
    if (!first_byte_[static_cast<uint8_t>(text[pos])]) {
      ++pos;
      continue;
    }
    // The longest pattern starting at `pos`.
    int32_t best = -1;
    size_t best_end = 0;
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      node = child(node, static_cast<uint8_t>(text[i]));
      if (node < 0) break;
      if (trie_[size_t(node)].token >= 0) {
        best = trie_[size_t(node)].token;
        best_end = i + 1;
      }
    }
    if (best < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens_[size_t(best)];
    size_t start = pos;
    size_t stop = best_end;
    pos = best_end;  // a discarded match still consumes its bytes, as in the oracle
    if (skip_special && token.special) continue;
    if (token.single_word) {
      const std::string_view before = last_character(text.substr(0, start));
      const std::string_view after = first_character(text.substr(stop));
      if ((!before.empty() && is_word_character(before)) ||
          (!after.empty() && is_word_character(after))) {
        continue;
      }
    }
    if (token.lstrip) start = std::max(start - white_space_before(text, start), done);
    if (token.rstrip) stop += white_space_after(text, stop);
    if (done < start) out.push_back({uint32_t(done), uint32_t(start), -1});
    out.push_back({uint32_t(start), uint32_t(stop), token.id});
    done = stop;
  }
  if (done < text.size()) out.push_back({uint32_t(done), uint32_t(text.size()), -1});
}

}  // namespace relay::tokenizer_detail

// The `Split` pre-tokenizer of Hugging Face `tokenizers`: cuts text where a regex (or a literal)
// matches and keeps, merges or drops the delimiters according to a behaviour.
//
// The oracle runs Oniguruma; Relay runs PCRE2 in UTF+UCP mode with JIT. Their dialects agree on the
// constructs tokenizer patterns use, but their Unicode data do not, so the pattern is rewritten
// before compiling: \s and \S become the oracle's White_Space set, and \p{L}, \p{N} gain the
// letters and numbers PCRE2's older tables lack (unicode_tables.h). Matching iterates like the
// oracle's: an empty match right after the previous match is skipped by one character.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace relay::tokenizer_detail {

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// Byte range [begin, end) of a piece inside the text that was split.
struct Span {
  uint32_t begin;
  uint32_t end;
};

class SplitRegex {
 public:
  // `pattern` is a regex, or a literal string when `literal`; `invert` swaps what counts as the
  // delimiter. Throws relay::Error (naming `what`) when PCRE2 rejects the pattern.
  SplitRegex(std::string_view pattern, bool literal, SplitBehavior behavior, bool invert,
             const std::string& what);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  // Appends the non-empty pieces of `text` (valid UTF-8) to `out`, offsets relative to `text`.
  void split(std::string_view text, std::vector<Span>& out) const;

  // The PCRE2 pattern actually compiled (after the Unicode rewrite), for error messages and tests.
  const std::string& compiled_pattern() const { return compiled_pattern_; }

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string compiled_pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

// Rewrites \s, \S, \p{L}, \p{N} (and \P{..} outside classes) of an Oniguruma-style pattern into
// PCRE2 syntax carrying the oracle's Unicode sets. Throws relay::Error naming `what` for a
// construct the rewrite cannot express (\S or \P{..} inside a character class).
std::string rewrite_pattern_for_pcre2(std::string_view pattern, const std::string& what);

}  // namespace relay::tokenizer_detail

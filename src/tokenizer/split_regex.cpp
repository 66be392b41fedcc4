// See split_regex.h. Matches are collected as (span, is_match) over the whole text, flipped when
// inverted, then folded by the behaviour exactly as the oracle folds them; empty pieces are
// dropped.
#include "tokenizer/split_regex.h"

#include <algorithm>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"
#include "tokenizer/unicode_tables.h"
#include "tokenizer/utf8.h"

namespace relay::tokenizer_detail {
namespace {

std::string class_items(std::span<const unicode_tables::CodepointRange> ranges) {
  std::string items;
  for (const auto& r : ranges) {
    items += str("\\x{", std::hex, r.first, "}");
    if (r.last != r.first) items += str("-\\x{", std::hex, r.last, "}");
  }
  return items;
}

const std::string& white_space_items() {
  static const std::string items = class_items(unicode_tables::white_space());
  return items;
}
const std::string& letter_items() {
  static const std::string items = "\\p{L}" + class_items(unicode_tables::extra_letters());
  return items;
}
const std::string& number_items() {
  static const std::string items = "\\p{N}" + class_items(unicode_tables::extra_numbers());
  return items;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

// A JIT stack per thread: the default 32 KiB on the machine stack is too small for long runs of
// one character class, and a pattern must never fail on long input.
struct JitContext {
  pcre2_jit_stack* stack = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  JitContext() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~JitContext() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
  }
};

struct MatchData {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  ~MatchData() { pcre2_match_data_free(data); }
};

}  // namespace

std::string rewrite_pattern_for_pcre2(std::string_view pattern, const std::string& what) {
  std::string out;
  bool in_class = false;
  size_t class_start = 0;  // index just after "[" or "[^", where a "]" is still a literal
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      if (e == 's' || e == 'S') {
        RELAY_CHECK(!(in_class && e == 'S'), what,
                    ": \\S inside a character class is not supported");
        if (in_class) {
          out += white_space_items();
        } else {
          out += (e == 's' ? "[" : "[^") + white_space_items() + "]";
        }
        ++i;
        continue;
      }
      if (e == 'p' || e == 'P') {
        size_t end = i + 2;
        std::string name;
        if (end < pattern.size() && pattern[end] == '{') {
          const size_t close = pattern.find('}', end);
          RELAY_CHECK(close != std::string_view::npos, what, ": unterminated \\p{ in the pattern");
          name = std::string(pattern.substr(end + 1, close - end - 1));
          end = close + 1;
        } else if (end < pattern.size()) {
          name = std::string(1, pattern[end]);
          end += 1;
        }
        bool negated = e == 'P';
        if (!name.empty() && name[0] == '^') {
          negated = !negated;
          name.erase(0, 1);
        }
        if (name == "L" || name == "N") {
          const std::string& items = name == "L" ? letter_items() : number_items();
          if (in_class) {
            RELAY_CHECK(!negated, what, ": a negated \\P{", name,
                        "} inside a character class is not supported");
            out += items;
          } else {
            out += (negated ? "[^" : "[") + items + "]";
          }
          i = end - 1;
          continue;
        }
      }
      out += c;
      out += e;
      ++i;
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
        const size_t close = pattern.find(":]", i + 2);
        RELAY_CHECK(close != std::string_view::npos, what,
                    ": unterminated POSIX class in the pattern");
        out.append(pattern.substr(i, close + 2 - i));
        i = close + 1;
        continue;
      }
      RELAY_CHECK(c != '[', what, ": nested character classes are not supported");
      if (c == ']' && i != class_start) in_class = false;
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      class_start = i + 1;
      continue;
    }
    out += c;
  }
  return out;
}

struct SplitRegex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

SplitRegex::SplitRegex(std::string_view pattern, bool literal, SplitBehavior behavior, bool invert,
                       const std::string& what)
    : code_(std::make_unique<Code>()), behavior_(behavior), invert_(invert) {
  compiled_pattern_ = literal ? std::string(pattern) : rewrite_pattern_for_pcre2(pattern, what);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  // PCRE2 refuses UCP together with LITERAL; a literal needs no character classes anyway.
  const uint32_t options = literal ? PCRE2_UTF | PCRE2_LITERAL : PCRE2_UTF | PCRE2_UCP;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled_pattern_.data()),
                              compiled_pattern_.size(), options, &error, &error_offset, nullptr);
  RELAY_CHECK(code_->code != nullptr, what, ": PCRE2 rejects the pattern at offset ", error_offset,
              ": ", pcre2_message(error));
  const int jit = pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE);
  RELAY_CHECK(jit == 0, what, ": PCRE2 JIT compilation failed: ", pcre2_message(jit));
}

SplitRegex::~SplitRegex() = default;

void SplitRegex::split(std::string_view text, std::vector<Span>& out) const {
  if (text.empty()) return;
  thread_local JitContext jit;
  thread_local MatchData match;
  struct Piece {
    Span span;
    bool is_match;
  };
  std::vector<Piece> pieces;
  const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t search_from = 0;
  size_t previous_end = 0;
  bool have_previous = false;
  while (search_from <= text.size()) {
    const int rc = pcre2_match(code_->code, subject, text.size(), search_from, PCRE2_NO_UTF_CHECK,
                               match.data, jit.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    // rc == 0 only says capture groups did not fit the one-pair match data; the match itself is
    // set.
    RELAY_CHECK(rc >= 0, "split regex failed on a ", text.size(),
                "-byte text: ", pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.data);
    const size_t begin = ovector[0];
    const size_t end = ovector[1];
    if (begin == end && have_previous && begin == previous_end) {
      // An empty match touching the previous one: step over one character, as the oracle does.
      if (begin >= text.size()) break;
      search_from = begin + std::max<size_t>(utf8::sequence_length(text, begin), 1);
      continue;
    }
    if (begin > previous_end) pieces.push_back({{uint32_t(previous_end), uint32_t(begin)}, false});
    pieces.push_back({{uint32_t(begin), uint32_t(end)}, true});
    previous_end = end;
    have_previous = true;
    search_from = end;
  }
  if (previous_end < text.size())
    pieces.push_back({{uint32_t(previous_end), uint32_t(text.size())}, false});
  if (invert_) {
    for (Piece& p : pieces) p.is_match = !p.is_match;
  }

  const size_t first_out = out.size();
  const auto push = [&](Span s) { out.push_back(s); };
  bool previous_match = false;
  switch (behavior_) {
    case SplitBehavior::Isolated:
      for (const Piece& p : pieces) push(p.span);
      break;
    case SplitBehavior::Removed:
      for (const Piece& p : pieces) {
        if (!p.is_match) push(p.span);
      }
      break;
    case SplitBehavior::Contiguous:
      for (const Piece& p : pieces) {
        if (p.is_match == previous_match && out.size() > first_out) {
          out.back().end = p.span.end;
        } else {
          push(p.span);
        }
        previous_match = p.is_match;
      }
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const Piece& p : pieces) {
        if (p.is_match && !previous_match && out.size() > first_out) {
          out.back().end = p.span.end;
        } else {
          push(p.span);
        }
        previous_match = p.is_match;
      }
      break;
    case SplitBehavior::MergedWithNext: {
      // The oracle folds from the end: a delimiter joins the piece after it unless that is one too.
      std::vector<Span> reversed;
      for (size_t k = pieces.size(); k-- > 0;) {
        const Piece& p = pieces[k];
        if (p.is_match && !previous_match && !reversed.empty()) {
          reversed.back().begin = p.span.begin;
        } else {
          reversed.push_back(p.span);
        }
        previous_match = p.is_match;
      }
      out.insert(out.end(), reversed.rbegin(), reversed.rend());
      break;
    }
  }
  // The oracle drops empty pieces (they only arise from empty matches).
  out.erase(std::remove_if(out.begin() + static_cast<std::ptrdiff_t>(first_out), out.end(),
                           [](const Span& s) { return s.begin == s.end; }),
            out.end());
}

}  // namespace relay::tokenizer_detail

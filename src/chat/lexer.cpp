// Jinja lexer (see lexer.h): a hand-written scanner that reproduces the decisions of jinja2.lexer's
// regular expressions, including the order in which its rules are tried.
#include "chat/lexer.h"

#include "core/utf8.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "chat/pystr.h"
#include "core/error.h"

namespace relay::chat::jinja {
namespace {

constexpr std::array<std::string_view, 25> kOperators = {
    "//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]", "(",
    ")",  "{",  "}",  ">",  "<",  "=",  ".", ":", "|", ","};

[[noreturn]] void syntax_error(int line, const std::string& message) {
  fail(str("chat template syntax error at line ", line, ": ", message));
}

// Python's `\s` at a byte offset: the length of the whitespace code point there, or 0.
size_t space_at(std::string_view s, size_t pos) {
  const auto c = static_cast<unsigned char>(s[pos]);
  if (c < 0x80) return pystr::is_space(c) ? 1 : 0;
  size_t n = 1;
  while (pos + n < s.size() && n < 4 && (static_cast<unsigned char>(s[pos + n]) & 0xC0) == 0x80) ++n;
  const std::u32string cps = pystr::decode(s.substr(pos, n));
  return cps.size() == 1 && pystr::is_space(cps[0]) ? n : 0;
}

// Python's str.rstrip() (all whitespace).
std::string_view rstrip_space(std::string_view s) {
  const std::string stripped = pystr::strip(s, std::nullopt, false, true);
  return s.substr(0, stripped.size());
}

bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_ident(char c) { return is_ident_start(c) || is_digit(c); }

// Decodes a string literal's body as jinja does: Python's unicode-escape over the text, with
// non-ASCII characters passed through unchanged.
std::string decode_string_literal(std::string_view body, int line) {
  std::string out;
  out.reserve(body.size());
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out += c;
      continue;
    }
    const char e = body[++i];
    auto hex_escape = [&](int digits) {
      if (i + static_cast<size_t>(digits) >= body.size()) {
        syntax_error(line, str("truncated \\", e, " escape in string literal"));
      }
      const std::string hex(body.substr(i + 1, static_cast<size_t>(digits)));
      if (!std::all_of(hex.begin(), hex.end(), [](char h) { return std::isxdigit(static_cast<unsigned char>(h)); })) {
        syntax_error(line, str("truncated \\", e, " escape in string literal"));
      }
      const unsigned long cp = std::strtoul(hex.c_str(), nullptr, 16);
      if (cp > 0x10FFFF) syntax_error(line, "illegal Unicode character in string literal");
      append_utf8(out, static_cast<char32_t>(cp));
      i += static_cast<size_t>(digits);
    };
    switch (e) {
      case '\n': break;  // line continuation
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x': hex_escape(2); break;
      case 'u': hex_escape(4); break;
      case 'U': hex_escape(8); break;
      default:
        if (e >= '0' && e <= '7') {
          unsigned cp = static_cast<unsigned>(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k) {
            cp = cp * 8 + static_cast<unsigned>(body[++i] - '0');
          }
          append_utf8(out, static_cast<char32_t>(cp));
        } else {
          // Unknown escapes keep their backslash, as Python's decoder does.
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      const size_t tag = find_tag(pos_);
      if (tag == std::string::npos) {
        emit_data(std::string_view(src_).substr(pos_), line_);
        advance_lines(pos_, src_.size());
        pos_ = src_.size();
        break;
      }
      lex_tag_start(tag);
    }
    tokens_.push_back(Token{TokenType::kEnd, "", line_});
    return std::move(tokens_);
  }

 private:
  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;  // jinja: did the previous match end with "\n"?
  std::vector<Token> tokens_;

  size_t find_tag(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    }
    return std::string::npos;
  }

  void advance_lines(size_t from, size_t to) {
    line_ += static_cast<int>(std::count(src_.begin() + static_cast<std::ptrdiff_t>(from),
                                         src_.begin() + static_cast<std::ptrdiff_t>(to), '\n'));
  }

  void emit_data(std::string_view text, int line) {
    if (!text.empty()) tokens_.push_back(Token{TokenType::kData, std::string(text), line});
  }

  // Applies `-` stripping or lstrip_blocks to the text before a tag.
  std::string_view control_text(std::string_view text, char sign, bool lstrip_allowed) const {
    if (sign == '-') return rstrip_space(text);
    if (sign == '+' || !lstrip_allowed) return text;
    const size_t line_pos = text.rfind('\n') == std::string_view::npos ? 0 : text.rfind('\n') + 1;
    if (line_pos == 0 && !line_starting_) return text;
    const std::string_view tail = text.substr(line_pos);
    if (tail.empty()) return text;
    for (size_t i = 0; i < tail.size();) {
      const size_t n = space_at(tail, i);
      if (n == 0) return text;
      i += n;
    }
    return text.substr(0, line_pos);
  }

  bool starts_with(size_t pos, std::string_view s) const {
    return src_.compare(pos, s.size(), s) == 0;
  }

  size_t skip_space(size_t pos) const {
    while (pos < src_.size()) {
      const size_t n = space_at(src_, pos);
      if (n == 0) break;
      pos += n;
    }
    return pos;
  }

  // Matches `{%(-|+|)\s*raw\s*(-%}\s*|%})` at pos; returns the end offset or npos.
  size_t match_raw_begin(size_t pos) const {
    size_t p = pos + 2;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
    p = skip_space(p);
    if (!starts_with(p, "raw")) return std::string::npos;
    p = skip_space(p + 3);
    if (starts_with(p, "-%}")) return skip_space(p + 3);
    if (starts_with(p, "%}")) return p + 2;
    return std::string::npos;
  }

  void lex_tag_start(size_t tag) {
    const char kind = src_[tag + 1];
    const char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
    const std::string_view text = std::string_view(src_).substr(pos_, tag - pos_);
    emit_data(control_text(text, sign, kind != '{'), line_);
    advance_lines(pos_, tag);
    if (kind == '%') {
      const size_t raw_end = match_raw_begin(tag);
      if (raw_end != std::string::npos) {
        lex_raw(tag, raw_end);
        return;
      }
    }
    pos_ = tag + 2 + (sign ? 1 : 0);
    if (kind == '#') {
      lex_comment();
    } else {
      const bool block = kind == '%';
      tokens_.push_back(Token{block ? TokenType::kBlockBegin : TokenType::kVariableBegin, "", line_});
      lex_inside_tag(block);
    }
  }

  void lex_comment() {
    for (size_t p = src_.find("#}", pos_); p != std::string::npos; p = src_.find("#}", p + 1)) {
      size_t end = p + 2;
      if (p > pos_ && src_[p - 1] == '-') {
        end = skip_space(end);
      } else if (!(p > pos_ && src_[p - 1] == '+') && end < src_.size() && src_[end] == '\n') {
        ++end;  // trim_blocks
      }
      advance_lines(pos_, end);
      line_starting_ = src_[end - 1] == '\n';
      pos_ = end;
      return;
    }
    syntax_error(line_, "missing end of comment tag");
  }

  void lex_raw(size_t tag, size_t body_start) {
    advance_lines(tag, body_start);
    // Find `{%(-|+|)\s*endraw\s*(+%}|-%}\s*|%}\n?)`.
    for (size_t p = src_.find("{%", body_start); p != std::string::npos; p = src_.find("{%", p + 1)) {
      size_t q = p + 2;
      const char sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
      if (sign) ++q;
      q = skip_space(q);
      if (!starts_with(q, "endraw")) continue;
      q = skip_space(q + 6);
      size_t end;
      if (starts_with(q, "+%}")) {
        end = q + 3;
      } else if (starts_with(q, "-%}")) {
        end = skip_space(q + 3);
      } else if (starts_with(q, "%}")) {
        end = q + 2 + (starts_with(q + 2, "\n") ? 1 : 0);
      } else {
        continue;
      }
      line_starting_ = false;  // the raw-begin match never ends with "\n"
      emit_data(control_text(std::string_view(src_).substr(body_start, p - body_start), sign, true), line_);
      advance_lines(body_start, end);
      line_starting_ = src_[end - 1] == '\n';
      pos_ = end;
      return;
    }
    syntax_error(line_, "missing end of raw directive");
  }

  void lex_inside_tag(bool block) {
    std::vector<char> balancing;
    while (true) {
      if (pos_ >= src_.size()) {
        syntax_error(line_, block ? "unexpected end of template, expected end of statement block '%}'"
                                  : "unexpected end of template, expected end of print statement '}}'");
      }
      if (balancing.empty() && try_tag_end(block)) return;
      const size_t ws = skip_space(pos_);
      if (ws != pos_) {
        advance_lines(pos_, ws);
        pos_ = ws;
        continue;
      }
      const char c = src_[pos_];
      if (is_digit(c) && (pos_ == 0 || src_[pos_ - 1] != '.') && lex_float()) continue;
      if (is_digit(c)) {
        lex_integer();
        continue;
      }
      if (is_ident_start(c)) {
        size_t end = pos_;
        while (end < src_.size() && is_ident(src_[end])) ++end;
        tokens_.push_back(Token{TokenType::kName, src_.substr(pos_, end - pos_), line_});
        pos_ = end;
        continue;
      }
      if (c == '\'' || c == '"') {
        lex_string(c);
        continue;
      }
      bool matched = false;
      for (std::string_view op : kOperators) {
        if (!starts_with(pos_, op)) continue;
        if (op == "(" || op == "[" || op == "{") {
          balancing.push_back(op[0] == '(' ? ')' : op[0] == '[' ? ']' : '}');
        } else if (op == ")" || op == "]" || op == "}") {
          if (balancing.empty()) syntax_error(line_, str("unexpected '", op, "'"));
          if (balancing.back() != op[0]) {
            syntax_error(line_, str("unexpected '", op, "', expected '", balancing.back(), "'"));
          }
          balancing.pop_back();
        }
        tokens_.push_back(Token{TokenType::kOperator, std::string(op), line_});
        pos_ += op.size();
        matched = true;
        break;
      }
      if (!matched) syntax_error(line_, str("unexpected char '", c, "'"));
    }
  }

  bool try_tag_end(bool block) {
    size_t end;
    if (block) {
      if (starts_with(pos_, "+%}")) {
        end = pos_ + 3;
      } else if (starts_with(pos_, "-%}")) {
        end = skip_space(pos_ + 3);
      } else if (starts_with(pos_, "%}")) {
        end = pos_ + 2 + (starts_with(pos_ + 2, "\n") ? 1 : 0);  // trim_blocks
      } else {
        return false;
      }
    } else {
      if (starts_with(pos_, "-}}")) {
        end = skip_space(pos_ + 3);
      } else if (starts_with(pos_, "}}")) {
        end = pos_ + 2;
      } else {
        return false;
      }
    }
    tokens_.push_back(Token{block ? TokenType::kBlockEnd : TokenType::kVariableEnd, "", line_});
    advance_lines(pos_, end);
    line_starting_ = src_[end - 1] == '\n';
    pos_ = end;
    return true;
  }

  // Digits with single underscores between them ("1_000"); returns the end offset or npos.
  size_t scan_digits(size_t p) const {
    if (p >= src_.size() || !is_digit(src_[p])) return std::string::npos;
    while (true) {
      while (p < src_.size() && is_digit(src_[p])) ++p;
      if (p + 1 < src_.size() && src_[p] == '_' && is_digit(src_[p + 1])) {
        ++p;
        continue;
      }
      return p;
    }
  }

  // jinja's float_re: digits, then (fraction? exponent) or fraction.
  bool lex_float() {
    size_t p = scan_digits(pos_);
    size_t end = std::string::npos;
    size_t after_fraction = p;
    if (p < src_.size() && src_[p] == '.') {
      const size_t f = scan_digits(p + 1);
      if (f != std::string::npos) {
        after_fraction = f;
        end = f;
      }
    }
    if (after_fraction < src_.size() && (src_[after_fraction] == 'e' || src_[after_fraction] == 'E')) {
      size_t q = after_fraction + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      const size_t e = scan_digits(q);
      if (e != std::string::npos) end = e;
    }
    if (end == std::string::npos) return false;
    std::string text = src_.substr(pos_, end - pos_);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    Token t{TokenType::kFloat, text, line_};
    t.float_value = std::strtod(text.c_str(), nullptr);
    tokens_.push_back(std::move(t));
    pos_ = end;
    return true;
  }

  void lex_integer() {
    int base = 10;
    size_t p = pos_;
    if (src_[p] == '0' && p + 1 < src_.size() && std::string_view("bBoOxX").find(src_[p + 1]) != std::string_view::npos) {
      const char b = static_cast<char>(std::tolower(static_cast<unsigned char>(src_[p + 1])));
      base = b == 'b' ? 2 : b == 'o' ? 8 : 16;
      p += 2;
    }
    const size_t digits_start = p;
    std::string digits;
    while (p < src_.size()) {
      const char c = src_[p];
      const bool valid = base == 16 ? std::isxdigit(static_cast<unsigned char>(c)) != 0
                                    : (c >= '0' && c < static_cast<char>('0' + std::min(base, 10)));
      if (valid) {
        digits += c;
        ++p;
      } else if (c == '_' && p + 1 < src_.size() && p > digits_start) {
        ++p;
      } else {
        break;
      }
    }
    if (digits.empty()) syntax_error(line_, "invalid integer literal");
    if (base == 10 && digits.size() > 1 && digits[0] == '0') {
      // jinja's decimal-zero rule: "0", "00", "0_0" only; "012" lexes as 0 then 12.
      size_t zeros = 0;
      while (zeros < digits.size() && digits[zeros] == '0') ++zeros;
      digits = digits.substr(0, zeros);
      p = pos_;
      for (size_t k = 0; k < zeros; ++k) p = src_[p] == '_' ? p + 2 : p + 1;
    }
    errno = 0;
    Token t{TokenType::kInteger, src_.substr(pos_, p - pos_), line_};
    t.int_value = static_cast<int64_t>(std::strtoull(digits.c_str(), nullptr, base));
    if (errno == ERANGE || std::strtoull(digits.c_str(), nullptr, base) > static_cast<unsigned long long>(INT64_MAX)) {
      syntax_error(line_, str("integer literal ", t.value, " does not fit in 64 bits"));
    }
    tokens_.push_back(std::move(t));
    pos_ = p;
  }

  void lex_string(char quote) {
    size_t p = pos_ + 1;
    while (p < src_.size() && src_[p] != quote) {
      p += src_[p] == '\\' ? 2 : 1;
    }
    if (p >= src_.size()) syntax_error(line_, "unterminated string literal");
    const int line = line_;
    tokens_.push_back(Token{TokenType::kString, decode_string_literal(std::string_view(src_).substr(pos_ + 1, p - pos_ - 1), line), line});
    advance_lines(pos_, p + 1);
    pos_ = p + 1;
  }
};

// jinja: newlines normalised to "\n", then one trailing newline dropped.
std::string normalize_source(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

std::vector<Token> tokenize(std::string_view source) { return Lexer(normalize_source(source)).run(); }

std::string describe(const Token& t) {
  switch (t.type) {
    case TokenType::kData: return "template data";
    case TokenType::kVariableBegin: return "begin of print statement";
    case TokenType::kVariableEnd: return "end of print statement";
    case TokenType::kBlockBegin: return "begin of statement block";
    case TokenType::kBlockEnd: return "end of statement block";
    case TokenType::kEnd: return "end of template";
    case TokenType::kString: return "string literal";
    case TokenType::kInteger:
    case TokenType::kFloat: return str("number ", t.value);
    default: return str("'", t.value, "'");
  }
}

}  // namespace relay::chat::jinja

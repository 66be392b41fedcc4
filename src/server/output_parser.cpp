// The reasoning / tool-call state machine and the qwen3_coder value typing (see output_parser.h).
//
// qwen3_coder calls are read by a scanner over the text from `<tool_call>` that answers complete (a
// call, and where it ends), malformed, or incomplete (more text could still make it either). Its
// answer on a prefix never changes as text is added, except from incomplete: that is what keeps a
// streamed response split as the whole text is. The values are typed as vLLM's qwen3_coder parser
// types them (restated here, not ported: docs/serving.md lists the rules and where they go beyond
// vLLM's), with Python's int(), float() and ast.literal_eval done by hand.
#include "server/output_parser.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/json.h"

namespace relay::server {

using ojson = nlohmann::ordered_json;

namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kToolOpen = "<tool_call>";
constexpr std::string_view kToolClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParameterOpen = "<parameter=";
constexpr std::string_view kParameterClose = "</parameter>";
constexpr std::string_view kWhitespace = " \t\r\n";

// Length of the longest suffix of `text` that is a proper prefix of `tag`: text that may still
// turn into the tag, and so must be held back.
size_t partial_tag_suffix(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; });
}

std::string_view trim(std::string_view s) {
  const size_t begin = s.find_first_not_of(kWhitespace);
  if (begin == std::string_view::npos) return {};
  return s.substr(begin, s.find_last_not_of(kWhitespace) - begin + 1);
}

std::string ascii_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

// Compact JSON text; invalid UTF-8 in model output becomes U+FFFD rather than an exception.
std::string dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

// {"name": "...", "arguments": {...}} -> a tool call; anything else -> false.
bool parse_hermes_call(std::string_view body, ParsedToolCall& call) {
  nlohmann::json j;
  try {
    j = parse_json(body, "a tool call");
  } catch (const JsonError&) {
    return false;  // malformed or nested too deep: the text stays content
  }
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const auto args = j.find("arguments");
  if (args != j.end() && !args->is_object()) return false;
  call.name = j["name"].get<std::string>();
  call.arguments = args == j.end() ? "{}" : args->dump();
  return true;
}

// ---- Typing parameter values --------------------------------------------------------------------

ParameterType::Kind kind_of_type_name(const std::string& name) {
  for (const char* s : {"string", "str", "text", "varchar", "char", "enum"}) {
    if (name == s) return ParameterType::kString;
  }
  for (const char* prefix : {"int", "uint", "long", "short", "unsigned"}) {
    if (name.starts_with(prefix)) return ParameterType::kInteger;
  }
  if (name.starts_with("num") || name.starts_with("float")) return ParameterType::kNumber;
  if (name == "boolean" || name == "bool" || name == "binary") return ParameterType::kBoolean;
  if (name == "object" || name == "array" || name == "arr" || name.starts_with("dict") ||
      name.starts_with("list")) {
    return ParameterType::kContainer;
  }
  return ParameterType::kOther;
}

// Schema keys that fix a string's text (ParameterType::trimmed).
constexpr const char* kFixedTextKeys[] = {"enum", "const", "pattern", "format"};

// The type a property's schema declares: its "type" (a name, or a list of names), else the types
// of its anyOf / oneOf options; the first that is not "null" counts, and "null" makes it nullable.
// No type at all is a string, as in vLLM.
ParameterType parameter_type(const ojson& schema) {
  ParameterType t;
  if (!schema.is_object()) return t;
  std::vector<std::string> names;
  if (const auto type = schema.find("type"); type != schema.end()) {
    if (type->is_string()) names.push_back(type->get<std::string>());
    if (type->is_array()) {
      for (const ojson& name : *type) {
        if (name.is_string()) names.push_back(name.get<std::string>());
      }
    }
  } else {
    for (const char* key : {"anyOf", "oneOf"}) {
      const auto options = schema.find(key);
      if (options == schema.end() || !options->is_array()) continue;
      for (const ojson& option : *options) {
        if (!option.is_object()) continue;
        const auto type = option.find("type");
        if (type != option.end() && type->is_string()) names.push_back(type->get<std::string>());
      }
    }
  }
  bool typed = false;
  for (const std::string& raw : names) {
    const std::string name = ascii_lower(trim(raw));
    if (name == "null") {
      t.nullable = true;
    } else if (!typed) {
      t.kind = kind_of_type_name(name);
      typed = true;
    }
  }
  if (!typed && t.nullable) t.kind = ParameterType::kOther;  // "null" alone is no string type
  t.trimmed = std::any_of(std::begin(kFixedTextKeys), std::end(kFixedTextKeys),
                          [&](const char* key) { return schema.contains(key); });
  return t;
}

std::optional<ojson> json_value(std::string_view text) {
  try {
    return parse_json<ojson>(text, "a parameter value");
  } catch (const JsonError&) {
    return std::nullopt;
  }
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD;  // a lone surrogate has no UTF-8 form
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// A Python literal as ast.literal_eval reads it, as the JSON json.dumps makes of it: None, True,
// False, numbers, quoted strings (with escapes), lists, tuples (arrays) and dicts (keys that are
// strings or numbers). Models trained on Python sometimes write {'path': 'a.txt', 'force': True}.
// Anything else (sets, bytes, complex numbers, integers past 64 bits) is not a value here.
class PythonLiteral {
 public:
  static std::optional<ojson> parse(std::string_view text) {
    PythonLiteral p(text);
    ojson out;
    if (!p.value(out, 0)) return std::nullopt;
    p.skip_space();
    if (p.pos_ != text.size()) return std::nullopt;
    return out;
  }

 private:
  explicit PythonLiteral(std::string_view s) : s_(s) {}

  void skip_space() {
    while (pos_ < s_.size() && kWhitespace.find(s_[pos_]) != std::string_view::npos) ++pos_;
  }
  bool eat(char c) {
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool word(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) return false;
    const size_t after = pos_ + w.size();
    if (after < s_.size() &&
        (std::isalnum(static_cast<unsigned char>(s_[after])) || s_[after] == '_'))
      return false;
    pos_ = after;
    return true;
  }

  bool value(ojson& out, int depth) {
    if (depth >= kMaxJsonDepth) return false;
    skip_space();
    if (pos_ >= s_.size()) return false;
    const char c = s_[pos_];
    if (c == '\'' || c == '"') {
      std::string text;
      if (!string(text)) return false;
      out = std::move(text);
      return true;
    }
    if (c == '[') return sequence(']', out, depth);
    if (c == '(') return sequence(')', out, depth);
    if (c == '{') return dict(out, depth);
    if (word("None")) {
      out = nullptr;
    } else if (word("True")) {
      out = true;
    } else if (word("False")) {
      out = false;
    } else {
      return number(out);
    }
    return true;
  }

  // [a, b], (a, b), (a,) and (): arrays; (a) is a.
  bool sequence(char close, ojson& out, int depth) {
    ++pos_;
    out = ojson::array();
    bool comma = false;
    while (!eat(close)) {
      if (!out.empty() && !comma) return false;
      ojson item;
      if (!value(item, depth + 1)) return false;
      out.push_back(std::move(item));
      comma = eat(',');
    }
    if (close == ')' && out.size() == 1 && !comma) out = ojson(out[0]);
    return true;
  }

  bool dict(ojson& out, int depth) {
    ++pos_;
    out = ojson::object();
    bool comma = false;
    while (!eat('}')) {
      if (!out.empty() && !comma) return false;
      ojson key, item;
      if (!value(key, depth + 1) || !eat(':') || !value(item, depth + 1)) return false;
      if (key.is_string()) {
        out[key.get<std::string>()] = std::move(item);
      } else if (key.is_primitive()) {
        out[dump(key)] = std::move(item);  // json.dumps: 1 -> "1", True -> "true", None -> "null"
      } else {
        return false;
      }
      comma = eat(',');
    }
    return true;
  }

  // Digits with single underscores between them ("1_000"), the underscores dropped.
  bool digits(std::string& out) {
    const size_t start = out.size();
    for (; pos_ < s_.size(); ++pos_) {
      const char c = s_[pos_];
      const bool underscore = c == '_' && out.size() > start && pos_ + 1 < s_.size() &&
                              s_[pos_ + 1] >= '0' && s_[pos_ + 1] <= '9';
      if (c >= '0' && c <= '9') {
        out += c;
      } else if (!underscore) {
        break;
      }
    }
    return out.size() > start;
  }

  bool number(ojson& out) {
    std::string text;
    if (pos_ < s_.size() && (s_[pos_] == '-' || s_[pos_] == '+')) {
      if (s_[pos_] == '-') text += '-';
      ++pos_;
      skip_space();
    }
    const bool whole = digits(text);
    bool is_float = false;
    if (pos_ < s_.size() && s_[pos_] == '.') {  // "1.5", "1." and ".5", written out as "0.5"
      ++pos_;
      is_float = true;
      text += whole ? "." : "0.";
      if (!digits(text)) {
        if (!whole) return false;
        text += '0';
      }
    } else if (!whole) {
      return false;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      text += 'e';
      is_float = true;
      if (pos_ < s_.size() && (s_[pos_] == '-' || s_[pos_] == '+')) text += s_[pos_++];
      if (!digits(text)) return false;
    }
    if (pos_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_'))
      return false;  // 1j, 0x1f, 12abc
    const char* begin = text.data();
    const char* end = text.data() + text.size();
    if (!is_float) {
      int64_t v = 0;
      const auto r = std::from_chars(begin, end, v);
      if (r.ec != std::errc() || r.ptr != end) return false;
      out = v;
      return true;
    }
    double v = 0;
    const auto r = std::from_chars(begin, end, v);
    if (r.ec != std::errc() || r.ptr != end || !std::isfinite(v)) return false;
    out = v;
    return true;
  }

  bool hex(size_t n, uint32_t& cp) {
    if (pos_ + n > s_.size()) return false;
    cp = 0;
    for (size_t i = 0; i < n; ++i) {
      const char c = s_[pos_++];
      const int d = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
      if (d < 0) return false;
      cp = cp * 16 + static_cast<uint32_t>(d);
    }
    return true;
  }

  bool string(std::string& out) {
    const char quote = s_[pos_++];
    while (pos_ < s_.size()) {
      const char c = s_[pos_++];
      if (c == quote) return true;
      if (c == '\n') return false;  // only triple-quoted strings span lines
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) return false;
      const char e = s_[pos_++];
      uint32_t cp = 0;
      switch (e) {
        case '\n':
          break;  // a line continuation
        case '\\':
        case '\'':
        case '"':
          out += e;
          break;
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case 'a':
          out += '\a';
          break;
        case 'x':
          if (!hex(2, cp)) return false;
          append_utf8(out, cp);
          break;
        case 'u':
          if (!hex(4, cp)) return false;
          append_utf8(out, cp);
          break;
        case 'U':
          if (!hex(8, cp) || cp > 0x10FFFF) return false;
          append_utf8(out, cp);
          break;
        default:
          if (e >= '0' && e <= '7') {  // up to three octal digits
            cp = static_cast<uint32_t>(e - '0');
            for (int i = 0; i < 2 && pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '7'; ++i)
              cp = cp * 8 + static_cast<uint32_t>(s_[pos_++] - '0');
            append_utf8(out, cp);
          } else {
            out += '\\';  // Python keeps an unknown escape as written
            out += e;
          }
      }
    }
    return false;
  }

  std::string_view s_;
  size_t pos_ = 0;
};

// Python's int() of the text: digits with single underscores between them, a sign before; past
// 64 bits (unsigned for a positive one) it stays text.
std::optional<ojson> integer_value(std::string_view text) {
  std::string digits;
  size_t i = 0;
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) {
    if (text[i] == '-') digits += '-';
    ++i;
  }
  const size_t start = digits.size();
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c >= '0' && c <= '9') {
      digits += c;
    } else if (c != '_' || digits.size() == start || i + 1 == text.size() || text[i + 1] < '0' ||
               text[i + 1] > '9') {
      return std::nullopt;
    }
  }
  if (digits.size() == start) return std::nullopt;
  const char* begin = digits.data();
  const char* end = digits.data() + digits.size();
  const auto parsed = [&](auto& v) {
    const auto r = std::from_chars(begin, end, v);
    return r.ec == std::errc() && r.ptr == end;
  };
  if (int64_t v = 0; parsed(v)) return ojson(v);
  if (uint64_t v = 0; parsed(v)) return ojson(v);  // a '-' is no uint64: never parsed
  return std::nullopt;
}

// Python's float() of the text (decimal forms; not inf or nan, which JSON lacks), as an integer
// when it is whole, as vLLM returns it.
std::optional<ojson> number_value(std::string_view text) {
  std::string s(text);
  if (!s.empty() && s[0] == '+') s.erase(0, 1);
  const size_t body = !s.empty() && s[0] == '-' ? 1 : 0;
  if (body >= s.size() || !(std::isdigit(static_cast<unsigned char>(s[body])) || s[body] == '.')) {
    return std::nullopt;
  }
  double v = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size() || !std::isfinite(v)) return std::nullopt;
  if (v == std::trunc(v) && std::fabs(v) < 9.0e18) return ojson(static_cast<int64_t>(v));
  return ojson(v);
}

// vLLM's second chance for a container given as a JSON string of a Python literal ("{'a': 1}").
ojson unwrap_python_string(ojson value) {
  if (!value.is_string()) return value;
  if (auto inner = PythonLiteral::parse(value.get<std::string>())) return std::move(*inner);
  return value;
}

// ---- Scanning a qwen3_coder call ----------------------------------------------------------------

enum class Scan { kComplete, kIncomplete, kMalformed };

// Whether `text` has `tag` at `pos` (then pos moves past it), may still get it (the text ends
// inside the tag), or cannot.
Scan expect_tag(std::string_view text, size_t& pos, std::string_view tag) {
  const std::string_view rest = text.substr(pos);
  if (rest.starts_with(tag)) {
    pos += tag.size();
    return Scan::kComplete;
  }
  return tag.starts_with(rest) ? Scan::kIncomplete : Scan::kMalformed;
}

// The name from `pos` up to '>' (pos moves past it). Names are never empty and hold none of the
// characters of `stops` but its first, '>'.
Scan scan_name(std::string_view text, size_t& pos, std::string_view stops, std::string& name) {
  const size_t end = text.find_first_of(stops, pos);
  if (end == std::string_view::npos) return Scan::kIncomplete;
  if (text[end] != '>' || end == pos) return Scan::kMalformed;
  name = std::string(text.substr(pos, end - pos));
  pos = end + 1;
  return Scan::kComplete;
}

void skip_whitespace(std::string_view text, size_t& pos) {
  pos = std::min(text.size(), text.find_first_not_of(kWhitespace, pos));
}

// Where the value starting at `begin` ends: the first `</parameter>` followed, after whitespace,
// by another parameter or the function's end.
Scan find_value_end(std::string_view text, size_t begin, size_t& end) {
  for (size_t from = begin;;) {
    const size_t close = text.find(kParameterClose, from);
    if (close == std::string_view::npos) return Scan::kIncomplete;
    size_t next = close + kParameterClose.size();
    skip_whitespace(text, next);
    const std::string_view rest = text.substr(next);
    if (rest.starts_with(kParameterOpen) || rest.starts_with(kFunctionClose)) {
      end = close;
      return Scan::kComplete;
    }
    if (kParameterOpen.starts_with(rest) || kFunctionClose.starts_with(rest)) {
      return Scan::kIncomplete;  // the text ends where it may still become one
    }
    from = close + 1;  // a literal </parameter> inside the value
  }
}

// The qwen3_coder call at the start of `text` (which starts with <tool_call>): on kComplete, the
// call and the offset just past its </tool_call>.
Scan scan_qwen3_coder_call(std::string_view text, const ToolParameterTypes* types,
                           ParsedToolCall& call, size_t& call_end) {
  size_t pos = kToolOpen.size();
  skip_whitespace(text, pos);
  if (const Scan s = expect_tag(text, pos, kFunctionOpen); s != Scan::kComplete) return s;
  std::string name;
  // vLLM's check: what is no function name (a template's `{{ name }}`, pseudo-XML, prose).
  if (const Scan s = scan_name(text, pos, "><{}\"' \t\r\n", name); s != Scan::kComplete) return s;
  ojson arguments = ojson::object();
  for (;;) {
    skip_whitespace(text, pos);
    if (pos == text.size()) return Scan::kIncomplete;
    if (text.substr(pos).starts_with(kFunctionClose)) {
      pos += kFunctionClose.size();
      skip_whitespace(text, pos);
      if (const Scan s = expect_tag(text, pos, kToolClose); s != Scan::kComplete) return s;
      call.name = std::move(name);
      call.arguments = dump(arguments);
      call_end = pos;
      return Scan::kComplete;
    }
    if (const Scan s = expect_tag(text, pos, kParameterOpen); s != Scan::kComplete) {
      // Neither tag: kMalformed, unless the text ends inside "</function>".
      return s == Scan::kIncomplete || kFunctionClose.starts_with(text.substr(pos))
                 ? Scan::kIncomplete
                 : Scan::kMalformed;
    }
    std::string parameter;
    if (const Scan s = scan_name(text, pos, "><\r\n", parameter); s != Scan::kComplete) return s;
    size_t value_end = 0;
    if (const Scan s = find_value_end(text, pos, value_end); s != Scan::kComplete) return s;
    std::string_view value = text.substr(pos, value_end - pos);
    if (value.starts_with('\n')) value.remove_prefix(1);
    if (value.ends_with('\n')) value.remove_suffix(1);
    const ParameterType type = types != nullptr ? types->find(name, parameter) : ParameterType{};
    arguments[parameter] = typed_parameter_value(value, type);
    pos = value_end + kParameterClose.size();
  }
}

}  // namespace

// ---- Parameter types ----------------------------------------------------------------------------

ToolParameterTypes::ToolParameterTypes(const ojson& tools) {
  if (!tools.is_array()) return;
  for (const ojson& tool : tools) {
    if (!tool.is_object()) continue;
    const auto function = tool.find("function");
    if (function == tool.end() || !function->is_object()) continue;
    const auto name = function->find("name");
    if (name == function->end() || !name->is_string()) continue;
    auto& types = types_[name->get<std::string>()];
    const auto parameters = function->find("parameters");
    if (parameters == function->end() || !parameters->is_object()) continue;
    const auto properties = parameters->find("properties");
    if (properties == parameters->end() || !properties->is_object()) continue;
    for (const auto& [parameter, schema] : properties->items()) {
      types[parameter] = parameter_type(schema);
    }
  }
}

ParameterType ToolParameterTypes::find(std::string_view function,
                                       std::string_view parameter) const {
  const auto f = types_.find(function);
  if (f == types_.end()) return {};
  const auto p = f->second.find(parameter);
  return p == f->second.end() ? ParameterType{} : p->second;
}

ojson typed_parameter_value(std::string_view text, ParameterType type) {
  const std::string_view trimmed = trim(text);
  const std::string lower = ascii_lower(trimmed);
  const bool null_word = lower == "null" || lower == "none";
  if (type.kind == ParameterType::kString) {
    if (type.nullable && null_word) return nullptr;
    return std::string(type.trimmed ? trimmed : text);
  }
  if (null_word) return nullptr;
  std::optional<ojson> value;
  switch (type.kind) {
    case ParameterType::kInteger:
      value = integer_value(trimmed);
      break;
    case ParameterType::kNumber:
      value = number_value(trimmed);
      break;
    case ParameterType::kBoolean:
      // NOTE: vLLM's rule: what is not "true" is false, never the text.
      return lower == "true";
    case ParameterType::kContainer:
      value = json_value(text);
      if (!value) value = PythonLiteral::parse(text);
      if (value) value = unwrap_python_string(std::move(*value));
      break;
    case ParameterType::kString:
    case ParameterType::kOther:
      value = PythonLiteral::parse(text);
      break;
  }
  return value ? std::move(*value) : ojson(std::string(text));
}

// ---- The parser ---------------------------------------------------------------------------------

ChatOutputParser::ChatOutputParser(bool parse_reasoning, bool starts_in_reasoning, bool parse_tools,
                                   chat::ToolCallFormat format,
                                   std::shared_ptr<const ToolParameterTypes> types)
    : parse_reasoning_(parse_reasoning),
      parse_tools_(parse_tools),
      format_(format),
      types_(std::move(types)),
      state_(parse_reasoning && starts_in_reasoning ? State::Reasoning : State::Start) {}

ParsedDelta ChatOutputParser::feed(std::string_view text) {
  pending_ += text;
  ParsedDelta out;
  run(out, /*final=*/false);
  return out;
}

ParsedDelta ChatOutputParser::finish() {
  ParsedDelta out;
  run(out, /*final=*/true);
  return out;
}

void ChatOutputParser::emit_content(ParsedDelta& out, std::string_view text) {
  if (num_tool_calls_ > 0 && is_blank(text)) return;
  out.content += text;
}

void ChatOutputParser::take_hermes_call(ParsedDelta& out, size_t close) {
  const size_t end = close + kToolClose.size();
  ParsedToolCall call;
  const std::string_view body =
      std::string_view(pending_).substr(kToolOpen.size(), close - kToolOpen.size());
  if (parse_hermes_call(body, call)) {
    out.tool_calls.push_back(std::move(call));
    ++num_tool_calls_;
  } else {
    emit_content(out, std::string_view(pending_).substr(0, end));
  }
  pending_ = pending_.substr(end);
}

bool ChatOutputParser::take_qwen3_coder_call(ParsedDelta& out, size_t close, bool final) {
  ParsedToolCall call;
  size_t call_end = 0;
  const Scan scan = scan_qwen3_coder_call(pending_, types_.get(), call, call_end);
  if (scan == Scan::kComplete) {
    out.tool_calls.push_back(std::move(call));
    ++num_tool_calls_;
    pending_ = pending_.substr(call_end);
    return true;
  }
  if (scan == Scan::kIncomplete && !final) return false;
  // No call (or one the response ended inside): the text up to the first </tool_call> is content.
  const size_t end = close + kToolClose.size();
  emit_content(out, std::string_view(pending_).substr(0, end));
  pending_ = pending_.substr(end);
  return true;
}

void ChatOutputParser::run(ParsedDelta& out, bool final) {
  for (;;) {
    switch (state_) {
      case State::Start: {
        if (!parse_reasoning_) {
          state_ = State::Content;
          break;
        }
        const size_t start = pending_.find_first_not_of(" \t\r\n");
        const std::string_view rest = start == std::string::npos
                                          ? std::string_view()
                                          : std::string_view(pending_).substr(start);
        if (rest.starts_with(kThinkOpen)) {
          pending_ = pending_.substr(start + kThinkOpen.size());
          state_ = State::Reasoning;
          break;
        }
        if (!final && kThinkOpen.starts_with(rest)) return;  // may still become <think>
        state_ = State::Content;
        break;
      }
      case State::Reasoning: {
        const size_t end = pending_.find(kThinkClose);
        if (end != std::string::npos) {
          out.reasoning += pending_.substr(0, end);
          pending_ = pending_.substr(end + kThinkClose.size());
          state_ = State::AfterReasoning;
          break;
        }
        const size_t keep = final ? 0 : partial_tag_suffix(pending_, kThinkClose);
        out.reasoning += pending_.substr(0, pending_.size() - keep);
        pending_ = pending_.substr(pending_.size() - keep);
        return;
      }
      case State::AfterReasoning: {
        const size_t start = pending_.find_first_not_of('\n');
        if (start == std::string::npos) {
          pending_.clear();
          if (!final) return;
        } else {
          pending_ = pending_.substr(start);
        }
        state_ = State::Content;
        break;
      }
      case State::Content: {
        if (!parse_tools_) {
          emit_content(out, pending_);
          pending_.clear();
          return;
        }
        const size_t open = pending_.find(kToolOpen);
        if (open != std::string::npos) {
          emit_content(out, std::string_view(pending_).substr(0, open));
          pending_ = pending_.substr(open);
          state_ = State::ToolCall;
          break;
        }
        const size_t keep = final ? 0 : partial_tag_suffix(pending_, kToolOpen);
        const std::string_view text = std::string_view(pending_).substr(0, pending_.size() - keep);
        // NOTE: whitespace after a call is dropped only if no other text follows it, which the
        // next delta tells: held until then, so that a stream splits as the whole text does.
        if (!final && num_tool_calls_ > 0 && is_blank(text)) return;
        emit_content(out, text);
        pending_ = pending_.substr(text.size());
        return;
      }
      case State::ToolCall: {
        // A call ends with </tool_call>, and what is no call is text up to the first one: nothing
        // is decided before one arrives.
        const size_t close = pending_.find(kToolClose);
        if (close == std::string::npos) {
          if (!final) return;
          emit_content(out, pending_);  // an unfinished call is plain text
          pending_.clear();
        } else if (format_ == chat::ToolCallFormat::kHermes) {
          take_hermes_call(out, close);
        } else if (!take_qwen3_coder_call(out, close, final)) {
          return;
        }
        state_ = State::Content;
        break;
      }
    }
  }
}

}  // namespace relay::server

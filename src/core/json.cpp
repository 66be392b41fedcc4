// See json.h.
#include "core/json.h"

#include <fstream>
#include <sstream>

namespace relay {

std::optional<JsonDepthExcess> find_json_depth_excess(std::string_view text, int max_depth) {
  int depth = 0;
  bool top_is_object = false;
  std::string_view last_string;  // the last string that closed at depth 1 (a key candidate)
  std::string_view key;          // the top-level member being read
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '"') {
      const size_t start = i + 1;
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\\') ++i;  // the escaped character cannot end the string
      }
      if (depth == 1) last_string = text.substr(start, std::min(i, text.size()) - start);
    } else if (c == ':') {
      if (depth == 1 && top_is_object) key = last_string;
    } else if (c == '[' || c == '{') {
      if (depth == 0) top_is_object = c == '{';
      if (++depth > max_depth) return JsonDepthExcess{i, std::string(key)};
    } else if (c == ']' || c == '}') {
      if (depth > 0) --depth;
      if (depth == 1 && top_is_object) key = {};
    }
  }
  return std::nullopt;
}

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(str(path.string(), ": cannot open"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(str(path.string(), ": cannot read"));
  return std::move(text).str();
}

}  // namespace relay

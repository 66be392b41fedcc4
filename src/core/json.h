// Bounded JSON parsing: every JSON text Relay reads from outside goes through parse_json.
//
// nlohmann's parser itself is iterative, but much of what reads its result is not: converting a
// request into chat-template values, tojson, dump(), the schema compilers. A body nested 20,000
// levels deep therefore crashed the server through stack overflow in whichever of those came
// first. parse_json refuses nesting deeper than kMaxJsonDepth with a plain scan of the text (no
// allocation, no recursion) before anything is built, so every recursive walk after it is bounded.
// The depth counts arrays and objects: `{"a": [1]}` is 2 deep. Request bodies, JSON strings inside
// them (tool-call arguments, JSON schemas), control-plane messages, multi-node messages, config
// files and checkpoint headers all use it; scripts/check-json-parse.sh (CI) fails on any other
// call to nlohmann's parse in src/.
#pragma once

#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace relay {

// Deep enough for any real request (tool schemas nest a dozen levels), shallow enough that every
// recursive walk over the result stays far from the stack's limit.
constexpr int kMaxJsonDepth = 128;

// Where a JSON text first nests deeper than the limit.
struct JsonDepthExcess {
  size_t offset = 0;          // byte offset of the bracket that went past the limit
  std::string top_level_key;  // the key of the top-level object member it is inside ("" if none)
};

// The first place `text` nests arrays/objects deeper than `max_depth`, or nothing. Brackets inside
// strings (escapes included) do not count; the text need not be valid JSON.
std::optional<JsonDepthExcess> find_json_depth_excess(std::string_view text, int max_depth);

// A JSON text that is malformed or nested too deep. `what` names the input ("the request body",
// "config.json"); `param` is the top-level key the excess nesting is under, for an API's error.
class JsonError : public Error {
 public:
  JsonError(const std::string& message, std::string param,
            std::source_location where = std::source_location::current())
      : Error(message, where), param_(std::move(param)) {}
  const std::string& param() const { return param_; }

 private:
  std::string param_;
};

// Parses `text` into Json (nlohmann::json or nlohmann::ordered_json). Throws JsonError
// "<what> is not valid JSON: ..." or "<what> nests JSON deeper than 128 levels (at byte N)".
template <typename Json = nlohmann::json>
Json parse_json(std::string_view text, std::string_view what, int max_depth = kMaxJsonDepth) {
  if (const auto excess = find_json_depth_excess(text, max_depth)) {
    throw JsonError(str(what, " nests JSON deeper than ", max_depth, " levels (at byte ",
                        excess->offset, ")"),
                    excess->top_level_key);
  }
  try {
    return Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw JsonError(str(what, " is not valid JSON: ", e.what()), "");
  }
}

// The whole file at `path`, read and parsed as parse_json does ("<path>: cannot open" when it cannot
// be read).
std::string read_text_file(const std::filesystem::path& path);
template <typename Json = nlohmann::json>
Json parse_json_file(const std::filesystem::path& path) {
  return parse_json<Json>(read_text_file(path), path.string());
}

}  // namespace relay

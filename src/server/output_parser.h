// Splitting a Qwen chat completion's text into reasoning, content and tool calls, as it streams.
//
// Qwen models think inside <think>…</think> (reasoning_content) and call tools in the format their
// chat template renders an assistant's tool_calls in (chat::ToolCallFormat):
//  - hermes (Qwen3): <tool_call>{"name": …, "arguments": {…}}</tool_call>
//  - qwen3_coder (Qwen3.5, Qwen3-Coder): one function per call, one tag per parameter, every value
//    as plain text between newlines:
//      <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n…</function>\n</tool_call>
//    The values are typed by the request's tool schemas (ToolParameterTypes, vLLM's rules) and the
//    arguments become a JSON object, in the order the parameters came.
// The parser is a small state machine fed text deltas; it holds back any tail that could still
// become a tag, so a streamed response is split exactly as the whole text would be: the
// non-streaming path feeds the full text once and calls finish(), through the same code.
//  - Reasoning is parsed only when the request lets the model think (enable_thinking, default
//    true). It begins when the output starts with <think> (after whitespace), or at once when the
//    prompt already ends with the opening tag; it ends at </think>, and the newlines after it are
//    dropped. A response cut off while thinking keeps what it thought as reasoning.
//  - Tool calls are parsed only when the request has tools (and tool_choice is not "none"). Text
//    before the first call is content; whitespace between and after calls is dropped. A call is
//    emitted whole once its closing tag arrives (its arguments in one delta). A call that is not
//    well formed stays in the content as text, unchanged: in hermes, JSON that is not
//    {"name": string, "arguments": object}; in qwen3_coder, anything but the tags above with
//    whitespace between them (the text up to the first </tool_call> is content then), or a
//    function name holding '<', '>', quotes, braces or whitespace (a template's `{{ name }}`).
//  - qwen3_coder: a value ends at the first `</parameter>` that whitespace and then `<parameter=`
//    or `</function>` follow, so a value may hold the closing tags as literal text elsewhere (code,
//    XML); a literal `</tool_call>` in a value only delays the call until its real closing tag.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "chat/chat_template.h"

namespace relay::server {

// How a qwen3_coder parameter's text becomes a JSON value: by the type its schema declares, with
// vLLM's aliases ("int", "uint64", "float", "bool", "dict", "list", ...). One leading and one
// trailing newline are not part of the value; the other rules trim whitespace where they parse.
struct ParameterType {
  enum Kind : uint8_t {
    kString,     // the text as it is (also a parameter the schema does not declare or type)
    kInteger,    // an integer (Python's int()), else the string
    kNumber,     // a number (Python's float(); an integer when it is whole), else the string
    kBoolean,    // "true" (any case) is true, anything else false
    kContainer,  // object or array: JSON, else a Python literal ({'a': True}), else the string
    kOther,      // another type name (or only "null"): a Python literal, else the string
  };
  Kind kind = kString;
  // The schema admits null too ("type": [T, "null"], anyOf with {"type": "null"}): "null" and
  // "None" (any case) are null even for a string. For the other kinds they always are.
  bool nullable = false;
  // A string whose text the schema fixes (enum, const, pattern, format) is read without the
  // whitespace around it, which a forced call's grammar allows there as around any JSON value.
  bool trimmed = false;
};

// The declared type of every parameter of a request's tools (its `tools` array, or null).
class ToolParameterTypes {
 public:
  ToolParameterTypes() = default;
  explicit ToolParameterTypes(const nlohmann::ordered_json& tools);
  ParameterType find(std::string_view function, std::string_view parameter) const;

 private:
  std::map<std::string, std::map<std::string, ParameterType, std::less<>>, std::less<>> types_;
};

// A parameter's text (its newlines around already stripped) as the JSON value `type` makes of it.
nlohmann::ordered_json typed_parameter_value(std::string_view text, ParameterType type);

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // JSON text of the arguments object
};

struct ParsedDelta {
  std::string reasoning;
  std::string content;
  std::vector<ParsedToolCall> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

class ChatOutputParser {
 public:
  // `types` types qwen3_coder values; null, or for hermes, is none.
  ChatOutputParser(bool parse_reasoning, bool starts_in_reasoning, bool parse_tools,
                   chat::ToolCallFormat format = chat::ToolCallFormat::kHermes,
                   std::shared_ptr<const ToolParameterTypes> types = nullptr);

  ParsedDelta feed(std::string_view text);
  // Flushes what was held back (an unfinished tag or tool call is plain text then).
  ParsedDelta finish();
  int num_tool_calls() const { return num_tool_calls_; }

 private:
  enum class State { Start, Reasoning, AfterReasoning, Content, ToolCall };
  void run(ParsedDelta& out, bool final);
  // The tool call at the start of pending_, whose first </tool_call> is at `close`: a call, or
  // text. qwen3_coder's may need more text to tell (false then).
  void take_hermes_call(ParsedDelta& out, size_t close);
  bool take_qwen3_coder_call(ParsedDelta& out, size_t close, bool final);
  void emit_content(ParsedDelta& out, std::string_view text);

  bool parse_reasoning_;
  bool parse_tools_;
  chat::ToolCallFormat format_;
  std::shared_ptr<const ToolParameterTypes> types_;
  State state_;
  std::string pending_;  // text not yet classified
  int num_tool_calls_ = 0;
};

}  // namespace relay::server

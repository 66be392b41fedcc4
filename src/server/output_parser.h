// Splitting a Qwen3 chat completion's text into reasoning, content and tool calls, as it streams.
//
// Qwen3 thinks inside <think>…</think> (reasoning_content) and calls tools with
// <tool_call>{"name": …, "arguments": {…}}</tool_call> (Hermes style). The parser is a small state
// machine fed text deltas; it holds back any tail that could still become a tag, so a streamed
// response is split exactly as the whole text would be: the non-streaming path feeds the full text
// once and calls finish(), through the same code.
//  - Reasoning is parsed only when the request lets the model think (enable_thinking, default
//    true). It begins when the output starts with <think> (after whitespace), or at once when the
//    prompt already ends with the opening tag; it ends at </think>, and the newlines after it are
//    dropped. A response cut off while thinking keeps what it thought as reasoning.
//  - Tool calls are parsed only when the request has tools (and tool_choice is not "none"). Text
//    before the first call is content; whitespace between and after calls is dropped. A call whose
//    JSON is not {"name": string, "arguments": object} stays in the content as text, unchanged.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace relay::server {

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
  ChatOutputParser(bool parse_reasoning, bool starts_in_reasoning, bool parse_tools);

  ParsedDelta feed(std::string_view text);
  // Flushes what was held back (an unfinished tag or tool call is plain text then).
  ParsedDelta finish();
  int num_tool_calls() const { return num_tool_calls_; }

 private:
  enum class State { Start, Reasoning, AfterReasoning, Content, ToolCall };
  void run(ParsedDelta& out, bool final);
  void emit_content(ParsedDelta& out, std::string_view text);

  bool parse_reasoning_;
  bool parse_tools_;
  State state_;
  std::string pending_;  // text not yet classified
  int num_tool_calls_ = 0;
};

}  // namespace relay::server

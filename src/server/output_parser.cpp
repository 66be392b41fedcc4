// The reasoning / tool-call state machine (see output_parser.h).
#include "server/output_parser.h"
#include "core/json.h"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace relay::server {

namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kToolOpen = "<tool_call>";
constexpr std::string_view kToolClose = "</tool_call>";

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

// {"name": "...", "arguments": {...}} -> a tool call; anything else -> false.
bool parse_tool_call(std::string_view body, ParsedToolCall& call) {
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

}  // namespace

ChatOutputParser::ChatOutputParser(bool parse_reasoning, bool starts_in_reasoning, bool parse_tools)
    : parse_reasoning_(parse_reasoning),
      parse_tools_(parse_tools),
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
        emit_content(out, std::string_view(pending_).substr(0, pending_.size() - keep));
        pending_ = pending_.substr(pending_.size() - keep);
        return;
      }
      case State::ToolCall: {
        const size_t close = pending_.find(kToolClose);
        if (close == std::string::npos) {
          if (!final) return;
          emit_content(out, pending_);  // an unfinished call is plain text
          pending_.clear();
          state_ = State::Content;
          return;
        }
        const size_t end = close + kToolClose.size();
        ParsedToolCall call;
        const std::string_view body =
            std::string_view(pending_).substr(kToolOpen.size(), close - kToolOpen.size());
        if (parse_tool_call(body, call)) {
          out.tool_calls.push_back(std::move(call));
          ++num_tool_calls_;
        } else {
          emit_content(out, std::string_view(pending_).substr(0, end));
        }
        pending_ = pending_.substr(end);
        state_ = State::Content;
        break;
      }
    }
  }
}

}  // namespace relay::server

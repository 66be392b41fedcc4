// Reasoning and tool-call parsing: whole-text results, and streaming in every split of the text
// (one character at a time, and at every single cut point) giving exactly the same result.
#include <gtest/gtest.h>

#include "server/metrics.h"
#include "server/output_parser.h"

namespace relay::server {
namespace {

struct Result {
  std::string reasoning, content;
  std::vector<std::string> calls;  // "name(arguments)"
  bool operator==(const Result&) const = default;
};

void add(Result& r, const ParsedDelta& d) {
  r.reasoning += d.reasoning;
  r.content += d.content;
  for (const auto& c : d.tool_calls) r.calls.push_back(c.name + "(" + c.arguments + ")");
}

Result parse_whole(std::string_view text, bool reasoning, bool in_reasoning, bool tools) {
  ChatOutputParser p(reasoning, in_reasoning, tools);
  Result r;
  add(r, p.feed(text));
  add(r, p.finish());
  return r;
}

// Whole text, char by char, and every two-piece split all agree.
Result parse_checked(std::string_view text, bool reasoning, bool in_reasoning, bool tools) {
  const Result whole = parse_whole(text, reasoning, in_reasoning, tools);
  {
    ChatOutputParser p(reasoning, in_reasoning, tools);
    Result r;
    for (char c : text) add(r, p.feed(std::string_view(&c, 1)));
    add(r, p.finish());
    EXPECT_EQ(r, whole) << "char-by-char differs for: " << text;
  }
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    ChatOutputParser p(reasoning, in_reasoning, tools);
    Result r;
    add(r, p.feed(text.substr(0, cut)));
    add(r, p.feed(text.substr(cut)));
    add(r, p.finish());
    EXPECT_EQ(r, whole) << "split at " << cut << " differs for: " << text;
  }
  return whole;
}

TEST(OutputParser, ThinkingThenAnswer) {
  const Result r =
      parse_checked("<think>\nLet me see.\n</think>\n\nThe answer is 4.", true, false, false);
  EXPECT_EQ(r.reasoning, "\nLet me see.\n");
  EXPECT_EQ(r.content, "The answer is 4.");
}

TEST(OutputParser, NoThinkTagMeansAllContent) {
  const Result r = parse_checked("def f(x):\n    return x < 3", true, false, false);
  EXPECT_EQ(r.reasoning, "");
  EXPECT_EQ(r.content, "def f(x):\n    return x < 3");
  // A lone "<" at the start is held only until it cannot be <think>.
  EXPECT_EQ(parse_checked("<thin", true, false, false).content, "<thin");
}

TEST(OutputParser, ReasoningDisabledLeavesTagsInContent) {
  const Result r = parse_checked("<think>x</think>y", false, false, false);
  EXPECT_EQ(r.content, "<think>x</think>y");
  EXPECT_EQ(r.reasoning, "");
}

TEST(OutputParser, PromptEndingInThinkStartsInReasoning) {
  const Result r = parse_checked("plan</think>\n\ndone", true, true, false);
  EXPECT_EQ(r.reasoning, "plan");
  EXPECT_EQ(r.content, "done");
}

TEST(OutputParser, TruncatedThinkingStaysReasoning) {
  const Result r = parse_checked("<think>still going </thi", true, false, false);
  EXPECT_EQ(r.reasoning, "still going </thi");
  EXPECT_EQ(r.content, "");
}

TEST(OutputParser, ToolCalls) {
  const std::string text =
      "I will check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\"}}\n"
      "</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n";
  const Result r = parse_checked(text, true, false, true);
  EXPECT_EQ(r.content, "I will check.\n");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0], "get_weather({\"city\":\"Paris\"})");
  EXPECT_EQ(r.calls[1], "now({})");
}

TEST(OutputParser, ThinkingThenToolCall) {
  const Result r = parse_checked(
      "<think>need weather</think>\n\n<tool_call>{\"name\": \"w\", \"arguments\": {\"a\": [1, "
      "2]}}</tool_call>",
      true, false, true);
  EXPECT_EQ(r.reasoning, "need weather");
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0], "w({\"a\":[1,2]})");
}

TEST(OutputParser, BadToolCallsStayText) {
  EXPECT_EQ(parse_checked("<tool_call>{not json}</tool_call>", true, false, true).content,
            "<tool_call>{not json}</tool_call>");
  EXPECT_EQ(parse_checked("<tool_call>{\"arguments\": {}}</tool_call>", true, false, true).content,
            "<tool_call>{\"arguments\": {}}</tool_call>");
  EXPECT_EQ(parse_checked("x <tool_call>{\"name\": \"f\"", true, false, true).content,
            "x <tool_call>{\"name\": \"f\"");
  // Without tools the tags are ordinary text.
  const Result r = parse_checked("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
                                 true, false, false);
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.content, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>");
}

TEST(Metrics, RendersPrometheusText) {
  Metrics m("demo");
  m.add_tokens(10, 3);
  m.observe_ttft(0.02);
  m.observe_itl(0.01);
  m.request_finished("stop", 0.4, 0.001);
  m.request_rejected(429);
  m.set_engine({.num_running = 2, .num_waiting = 1, .kv_cache_usage = 0.25});
  m.observe_step(
      true, 4, 0.01,
      {.schedule_s = 0.001, .forward_s = 0.008, .outputs_s = 0.0005, .handoff_s = 0.0005});
  m.observe_delivery(4, 0.002);
  const std::string text = m.render();
  for (const char* line :
       {"relay:num_requests_running{model_name=\"demo\"} 2\n",
        "relay:num_requests_waiting{model_name=\"demo\"} 1\n",
        "relay:kv_cache_usage_perc{model_name=\"demo\"} 0.25\n",
        "relay:prompt_tokens_total{model_name=\"demo\"} 10\n",
        "relay:generation_tokens_total{model_name=\"demo\"} 3\n",
        "relay:request_success_total{model_name=\"demo\",finished_reason=\"stop\"} 1\n",
        "relay:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"0.04\"} 1\n",
        "relay:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"0.01\"} 0\n",
        "relay:time_to_first_token_seconds_count{model_name=\"demo\"} 1\n",
        "relay:e2e_request_latency_seconds_bucket{model_name=\"demo\",le=\"+Inf\"} 1\n",
        "relay:request_rejected_total{model_name=\"demo\",status=\"429\"} 1\n",
        "relay:engine_steps_total{model_name=\"demo\",kind=\"decode\"} 1\n",
        "relay:engine_step_seconds_total{model_name=\"demo\",kind=\"decode\"} 0.01\n",
        "relay:engine_step_phase_seconds_total{model_name=\"demo\",kind=\"decode\",phase="
        "\"forward\"} "
        "0.008\n",
        "relay:engine_step_phase_seconds_total{model_name=\"demo\",kind=\"mixed\",phase="
        "\"handoff\"} "
        "0\n",
        "relay:output_deliveries_total{model_name=\"demo\"} 4\n",
        "relay:output_delivery_seconds_total{model_name=\"demo\"} 0.002\n",
        "# TYPE relay:inter_token_latency_seconds histogram\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << "missing: " << line;
  }
}

}  // namespace
}  // namespace relay::server

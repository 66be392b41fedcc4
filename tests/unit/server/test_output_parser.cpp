// Reasoning and tool-call parsing: whole-text results, and streaming in every split of the text
// (one character at a time, and at every single cut point) giving exactly the same result; the
// qwen3_coder format's value typing against vLLM's rules, and its calls as the Qwen3.5 template
// renders them read back into the same arguments.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "server/metrics.h"
#include "server/output_parser.h"

namespace relay::server {
namespace {

using ojson = nlohmann::ordered_json;
using chat::ToolCallFormat;

struct Result {
  std::string reasoning, content;
  std::vector<std::string> calls;  // "name(arguments)"
  bool operator==(const Result&) const = default;
};

struct ParserOptions {
  bool reasoning = true;
  bool in_reasoning = false;
  bool tools = true;
  ToolCallFormat format = ToolCallFormat::kHermes;
  std::shared_ptr<const ToolParameterTypes> types;
};

ChatOutputParser make_parser(const ParserOptions& o) {
  return ChatOutputParser(o.reasoning, o.in_reasoning, o.tools, o.format, o.types);
}

void add(Result& r, const ParsedDelta& d) {
  r.reasoning += d.reasoning;
  r.content += d.content;
  for (const auto& c : d.tool_calls) r.calls.push_back(c.name + "(" + c.arguments + ")");
}

Result parse_whole(std::string_view text, const ParserOptions& o) {
  ChatOutputParser p = make_parser(o);
  Result r;
  add(r, p.feed(text));
  add(r, p.finish());
  return r;
}

// Whole text, char by char, and every two-piece split all agree.
Result parse_checked(std::string_view text, const ParserOptions& o) {
  const Result whole = parse_whole(text, o);
  {
    ChatOutputParser p = make_parser(o);
    Result r;
    for (char c : text) add(r, p.feed(std::string_view(&c, 1)));
    add(r, p.finish());
    EXPECT_EQ(r, whole) << "char-by-char differs for: " << text;
  }
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    ChatOutputParser p = make_parser(o);
    Result r;
    add(r, p.feed(text.substr(0, cut)));
    add(r, p.feed(text.substr(cut)));
    add(r, p.finish());
    EXPECT_EQ(r, whole) << "split at " << cut << " differs for: " << text;
  }
  return whole;
}

Result parse_checked(std::string_view text, bool reasoning, bool in_reasoning, bool tools) {
  ParserOptions o;
  o.reasoning = reasoning;
  o.in_reasoning = in_reasoning;
  o.tools = tools;
  return parse_checked(text, o);
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

TEST(OutputParser, WhitespaceAfterACallIsDroppedOnlyWhenNothingFollows) {
  const std::string call = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
  EXPECT_EQ(parse_checked(call + "\n\nDone.", true, false, true).content, "\n\nDone.");
  EXPECT_EQ(parse_checked(call + "\n \n", true, false, true).content, "");
  EXPECT_EQ(parse_checked("Hi \n" + call + "\n" + call, true, false, true).content, "Hi \n");
}

// ---- qwen3_coder --------------------------------------------------------------------------------

const ojson kTools = ojson::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
   "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                  "metric": {"type": "boolean"}, "hours": {"type": "array"}},
   "required": ["city"]}}},
  {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object",
   "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}},
  {"type": "function", "function": {"name": "now"}}
])");

ParserOptions qwen3_coder(const ojson& tools = kTools) {
  ParserOptions o;
  o.format = ToolCallFormat::kQwen3Coder;
  o.types = std::make_shared<const ToolParameterTypes>(tools);
  return o;
}

TEST(Qwen3CoderCalls, OneCallAfterContent) {
  const Result r = parse_checked(
      "I will look it up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
      "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
      "<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>",
      qwen3_coder());
  EXPECT_EQ(r.reasoning, "");
  EXPECT_EQ(r.content, "I will look it up.\n\n");
  EXPECT_EQ(r.calls, std::vector<std::string>{
                         R"(get_weather({"city":"Paris","days":3,"metric":true,"hours":[9,12]}))"});
}

TEST(Qwen3CoderCalls, ThinkingThenParallelCalls) {
  // Qwen3.5's prompt ends inside <think>; calls are separated by a newline.
  ParserOptions o = qwen3_coder();
  o.in_reasoning = true;
  const Result r = parse_checked(
      "The user wants two things.\n</think>\n\n<tool_call>\n<function=now>\n</function>\n"
      "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n"
      "</parameter>\n</function>\n</tool_call>\n",
      o);
  EXPECT_EQ(r.reasoning, "The user wants two things.\n");
  EXPECT_EQ(r.content, "");
  EXPECT_EQ(r.calls, (std::vector<std::string>{"now({})", R"(get_weather({"city":"San Jose"}))"}));
}

TEST(Qwen3CoderCalls, ValuesSpanLinesAndHoldTheTagsAsText) {
  // Only a </parameter> that a tag follows ends a value; a literal </tool_call> in a value only
  // makes the parser wait for the real one.
  const std::string content =
      "print('</tool_call>')\n\nx = '</parameter>'\n</parameter> and </function> in prose\n";
  const Result r = parse_checked(
      "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
      "<parameter=content>\n" +
          content + "\n</parameter>\n</function>\n</tool_call>",
      qwen3_coder());
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0],
            "write_file(" + ojson({{"path", "a.py"}, {"content", content}}).dump() + ")");
}

TEST(Qwen3CoderCalls, WhitespaceBetweenTagsIsFree) {
  EXPECT_EQ(parse_checked("<tool_call><function=get_weather><parameter=city>Oslo</parameter>"
                          "</function></tool_call>",
                          qwen3_coder())
                .calls,
            std::vector<std::string>{R"(get_weather({"city":"Oslo"}))"});
  // Only one newline around a value is the format's: the rest is the value's.
  EXPECT_EQ(parse_checked("<tool_call>\n  <function=get_weather>\n\n<parameter=city>\n\n Oslo \n\n"
                          "</parameter>   </function>\n\n</tool_call>",
                          qwen3_coder())
                .calls,
            std::vector<std::string>{R"(get_weather({"city":"\n Oslo \n"}))"});
}

TEST(Qwen3CoderCalls, UndeclaredFunctionsAndParametersAreStrings) {
  EXPECT_EQ(parse_checked("<tool_call>\n<function=get_weather>\n<parameter=city>\n7\n</parameter>\n"
                          "<parameter=extra>\n{\"a\": 1}\n</parameter>\n</function>\n</tool_call>",
                          qwen3_coder())
                .calls,
            std::vector<std::string>{R"(get_weather({"city":"7","extra":"{\"a\": 1}"}))"});
  EXPECT_EQ(parse_checked("<tool_call>\n<function=other>\n<parameter=n>\n7\n</parameter>\n"
                          "</function>\n</tool_call>",
                          qwen3_coder())
                .calls,
            std::vector<std::string>{R"(other({"n":"7"}))"});
  // Without types (no tools given to the parser) every value is a string.
  ParserOptions untyped = qwen3_coder();
  untyped.types = nullptr;
  EXPECT_EQ(parse_checked("<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n</parameter>\n"
                          "</function>\n</tool_call>",
                          untyped)
                .calls,
            std::vector<std::string>{R"(get_weather({"days":"7"}))"});
}

TEST(Qwen3CoderCalls, MalformedCallsStayText) {
  for (const std::string& text : {
           // Hermes JSON is no qwen3_coder call.
           std::string("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"),
           // A template's placeholder, or a name with spaces, is no function name.
           std::string("<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>"),
           std::string("<tool_call>\n<function=get weather>\n</function>\n</tool_call>"),
           std::string("<tool_call>\n<function=>\n</function>\n</tool_call>"),
           // Text where only whitespace may be.
           std::string("<tool_call>\nCalling: <function=now>\n</function>\n</tool_call>"),
           std::string("<tool_call>\n<function=now>\nhello\n</function>\n</tool_call>"),
           std::string("<tool_call>\n<function=now>\n</function>\nbye\n</tool_call>"),
           // A value never closed, a function never closed.
           std::string("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</tool_call>"),
           std::string("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                       "</tool_call>"),
           std::string("<tool_call>\n<function=get_weather>\n<parameter=\ncity>\nRome\n"
                       "</parameter>\n</function>\n</tool_call>"),
           // Cut off.
           std::string("Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nRo"),
           std::string("<tool_call>\n<function=get_wea"),
           std::string("<tool_call>\n<function=now>\n</function>\n</tool_ca"),
       }) {
    const Result r = parse_checked(text, qwen3_coder());
    EXPECT_TRUE(r.calls.empty()) << text;
    EXPECT_EQ(r.content, text);
  }
}

TEST(Qwen3CoderCalls, TextUpToTheFirstCloseOfAMalformedCallIsContent) {
  const Result r = parse_checked(
      "<tool_call>\nnot a call\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n"
      "</tool_call>",
      qwen3_coder());
  EXPECT_EQ(r.content, "<tool_call>\nnot a call\n</tool_call>\n");
  EXPECT_EQ(r.calls, std::vector<std::string>{"now({})"});
  // A value whose </parameter> never comes swallows the rest up to the end: then the text up to
  // the first </tool_call> is content, and what follows is read again.
  const Result cut = parse_checked(
      "<tool_call>\n<function=write_file>\n<parameter=path>\na</tool_call>\n<tool_call>\n"
      "<function=now>\n</function>\n</tool_call>",
      qwen3_coder());
  EXPECT_EQ(cut.content, "<tool_call>\n<function=write_file>\n<parameter=path>\na</tool_call>\n");
  EXPECT_EQ(cut.calls, std::vector<std::string>{"now({})"});
}

TEST(Qwen3CoderCalls, HermesParserLeavesXmlAsTextAndNoToolsLeavesTags) {
  const std::string text = "<tool_call>\n<function=now>\n</function>\n</tool_call>";
  EXPECT_EQ(parse_checked(text, true, false, true).content, text);
  ParserOptions no_tools = qwen3_coder();
  no_tools.tools = false;
  EXPECT_EQ(parse_checked(text, no_tools).content, text);
}

TEST(Qwen3CoderCalls, InvalidUtf8InAValueIsReplaced) {
  const Result r = parse_checked(
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nR\xff"
      "me\n</parameter>\n"
      "</function>\n</tool_call>",
      qwen3_coder());
  EXPECT_EQ(r.calls, std::vector<std::string>{"get_weather({\"city\":\"R\xef\xbf\xbdme\"})"});
}

// The Qwen3.5 template's rendering of an assistant's tool calls reads back as the same arguments
// (strings, numbers and containers as the template writes them: `| string` or tojson).
TEST(Qwen3CoderCalls, TheQwen35TemplatesCallsReadBack) {
  const chat::ChatTemplate chat_template = chat::ChatTemplate::from_string(
      [] {
        std::ifstream in(RELAY_SOURCE_DIR "/models/templates/Qwen3.5-4B.jinja");
        std::stringstream ss;
        ss << in.rdbuf();
        return ss.str();
      }(),
      {{"eos_token", "<|im_end|>"}});
  const ojson tools = ojson::parse(R"([{"type": "function", "function": {"name": "edit",
      "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "options": {"type": "object"}, "note": {"type": ["string", "null"]}}}}}])");
  const std::vector<ojson> calls = {
      {{"path", "src/a.cpp"}, {"line", 42}, {"scale", 0.5}},
      {{"path", "multi\nline </parameter> text"},
       {"tags", {"x", "y z"}},
       {"options", {{"force", true}, {"depth", {1, 2}}}}},
      {{"note", "None of that"}, {"line", -3}},
  };
  ojson assistant = {{"role", "assistant"}, {"content", ""}, {"tool_calls", ojson::array()}};
  for (const ojson& arguments : calls) {
    assistant["tool_calls"].push_back(
        {{"type", "function"}, {"function", {{"name", "edit"}, {"arguments", arguments}}}});
  }
  const ojson messages = {{{"role", "user"}, {"content", "Edit it."}}, assistant};
  const std::string prompt = chat_template.render(messages, tools, false, nullptr);
  const size_t begin = prompt.find("<tool_call>", prompt.rfind("<|im_start|>assistant"));
  const std::string text = prompt.substr(begin, prompt.rfind("<|im_end|>") - begin);
  const Result r = parse_checked(text, qwen3_coder(tools));
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), calls.size()) << text;
  for (size_t i = 0; i < calls.size(); ++i) EXPECT_EQ(r.calls[i], "edit(" + calls[i].dump() + ")");
}

// ---- Value types (vLLM's qwen3_coder rules) -----------------------------------------------------

ojson typed(std::string_view text, const ojson& schema) {
  const ojson tools = {
      {{"type", "function"},
       {"function",
        {{"name", "f"}, {"parameters", {{"type", "object"}, {"properties", {{"p", schema}}}}}}}}};
  return typed_parameter_value(text, ToolParameterTypes(tools).find("f", "p"));
}

ojson typed(std::string_view text, const char* type) { return typed(text, ojson{{"type", type}}); }

TEST(ParameterTypes, Strings) {
  EXPECT_EQ(typed("  two  spaces ", "string"), "  two  spaces ");
  EXPECT_EQ(typed("null", "string"), "null");  // a string keeps the word
  EXPECT_EQ(typed("42", "str"), "42");
  EXPECT_EQ(typed("{\"a\": 1}", "text"), "{\"a\": 1}");
  EXPECT_EQ(typed("x", "enum"), "x");
  // A string the schema fixes, without the whitespace a forced call's grammar allows around it.
  EXPECT_EQ(typed(" celsius\t", ojson{{"type", "string"}, {"enum", {"celsius", "kelvin"}}}),
            "celsius");
  EXPECT_EQ(typed("\n x ", ojson{{"const", "x"}}), "x");
  EXPECT_EQ(typed(" 2024-01-01 ", ojson{{"type", "string"}, {"format", "date"}}), "2024-01-01");
  EXPECT_EQ(typed(" ab ", ojson{{"type", "string"}, {"pattern", "^[a-z]+$"}}), "ab");
  EXPECT_EQ(typed(" ab ", ojson{{"type", "string"}, {"maxLength", 9}}), " ab ");
  // No type, an unknown parameter: the text.
  EXPECT_EQ(typed("1", ojson{{"enum", {"1", "2"}}}), "1");
  EXPECT_EQ(typed_parameter_value("[1]", ToolParameterTypes(kTools).find("get_weather", "zzz")),
            "[1]");
}

TEST(ParameterTypes, Integers) {
  EXPECT_EQ(typed("42", "integer"), 42);
  EXPECT_EQ(typed(" -7 ", "int"), -7);
  EXPECT_EQ(typed("+5", "int32"), 5);
  EXPECT_EQ(typed("1_000", "long"), 1000);
  EXPECT_EQ(typed("007", "short"), 7);
  EXPECT_EQ(typed("18446744073709551615", "uint64"), 18446744073709551615ull);
  EXPECT_EQ(typed("-9223372036854775808", "integer"), INT64_MIN);
  for (const char* text : {"4.0", "0x10", "1__0", "_1", "1_", "abc", "", "99999999999999999999"}) {
    EXPECT_EQ(typed(text, "integer"), text) << "'" << text << "'";
  }
  EXPECT_TRUE(typed("null", "integer").is_null());
  EXPECT_TRUE(typed("None", "unsigned").is_null());
}

TEST(ParameterTypes, Numbers) {
  EXPECT_EQ(typed("3.5", "number"), 3.5);
  EXPECT_EQ(typed("2.0", "number"), 2);  // whole: an integer, as vLLM gives it
  EXPECT_TRUE(typed("2.0", "number").is_number_integer());
  EXPECT_EQ(typed(" 1e3 ", "float"), 1000);
  EXPECT_EQ(typed("-.25", "num"), -0.25);
  EXPECT_EQ(typed("+7", "number"), 7);
  for (const char* text : {"nan", "inf", "-Infinity", "1e999", "0x1p3", "1.5.2", "three"}) {
    EXPECT_EQ(typed(text, "number"), text) << "'" << text << "'";
  }
}

TEST(ParameterTypes, Booleans) {
  EXPECT_EQ(typed("true", "boolean"), true);
  EXPECT_EQ(typed("True", "bool"), true);
  EXPECT_EQ(typed(" TRUE\n", "boolean"), true);
  EXPECT_EQ(typed("False", "boolean"), false);
  EXPECT_EQ(typed("yes", "binary"), false);  // vLLM: anything but true is false
}

TEST(ParameterTypes, Containers) {
  EXPECT_EQ(typed("{\"a\": [1, 2.5, null]}", "object"), ojson::parse(R"({"a": [1, 2.5, null]})"));
  EXPECT_EQ(typed("[1, \"x\"]", "array"), ojson::parse(R"([1, "x"])"));
  // Python literals: a model trained on Python writes them; and a JSON string holding one.
  EXPECT_EQ(typed("{'path': 'a.txt', 'force': True, 'mode': None, 'n': -1_0, 'f': 1.}", "dict"),
            ojson::parse(R"({"path": "a.txt", "force": true, "mode": null, "n": -10, "f": 1.0})"));
  EXPECT_EQ(typed("\"{'a': 1}\"", "object"), ojson::parse(R"({"a": 1})"));
  EXPECT_EQ(typed("(1, 'two', (3,))", "list"), ojson::parse(R"([1, "two", [3]])"));
  EXPECT_EQ(typed("('a')", "arr"), "a");
  EXPECT_EQ(typed("{1: 'x', False: 'y', None: 'z', 2.5: 'w'}", "dict[int, str]"),
            ojson::parse(R"({"1": "x", "false": "y", "null": "z", "2.5": "w"})"));
  EXPECT_EQ(typed(R"(['\n\t\\', '\x41\u00e9\U0001F600', "it's", '\101'])", "list[str]"),
            ojson::parse(R"(["\n\t\\", "Aé😀", "it's", "A"])"));
  for (const char* text :
       {"{'a': }", "[1, 2", "{1, 2}", "b'x'", "1j", "[x]", "'unterminated", "{'a': 1} extra"}) {
    EXPECT_EQ(typed(text, "object"), text) << "'" << text << "'";
  }
  EXPECT_TRUE(typed("null", "array").is_null());
}

TEST(ParameterTypes, OtherTypesAreReadAsPythonLiterals) {
  EXPECT_EQ(typed("1.5", "double"), 1.5);
  EXPECT_EQ(typed("[1, None]", "tuple"), ojson::parse("[1, null]"));
  EXPECT_EQ(typed("true", "tuple"), "true");  // JSON's words are no Python literal
  EXPECT_EQ(typed("some text", "date"), "some text");
}

TEST(ParameterTypes, NullableSchemas) {
  EXPECT_TRUE(typed("None", ojson{{"type", {"string", "null"}}}).is_null());
  EXPECT_TRUE(
      typed("null", ojson{{"anyOf", {{{"type", "string"}}, {{"type", "null"}}}}}).is_null());
  EXPECT_EQ(typed("Nonesuch", ojson{{"anyOf", {{{"type", "string"}}, {{"type", "null"}}}}}),
            "Nonesuch");
  EXPECT_EQ(typed("5", ojson{{"anyOf", {{{"type", "null"}}, {{"type", "integer"}}}}}), 5);
  EXPECT_EQ(typed("5", ojson{{"oneOf", {{{"type", "integer"}}, {{"type", "string"}}}}}), 5);
  EXPECT_EQ(typed("5", ojson{{"type", {"null", "number"}}}), 5);
  EXPECT_TRUE(typed("NULL", ojson{{"type", "null"}}).is_null());
  EXPECT_EQ(typed("[1]", ojson{{"type", "null"}}), ojson::parse("[1]"));
  EXPECT_EQ(typed("7", ojson{{"type", " Integer "}}), 7);  // vLLM trims and lower-cases names
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

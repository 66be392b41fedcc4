// The HTTP server end to end with a scripted backend: the demo model never thinks or calls tools,
// so a backend that "generates" a Qwen3 reasoning block and a tool call proves that path through
// the real template, tokenizer, engine, parser and HTTP layer, streamed and not; the same for
// Qwen3.5's template and its qwen3_coder calls, found from the template or named by the options.
#include <gtest/gtest.h>
#include <httplib.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "../scheduler/fake_backend.h"
#include "chat/chat_template.h"
#include "engine/llm_engine.h"
#include "server/http_server.h"

namespace relay::server {
namespace {

using nlohmann::json;

const std::string kDemo = RELAY_SOURCE_DIR "/models/relay-demo-moe";
const std::string kOutput =
    "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
    "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

struct ScriptedServer {
  explicit ScriptedServer(
      const std::string& output,
      chat::ChatTemplate chat_template = chat::ChatTemplate::from_model_dir(kDemo),
      const ServerOptions& server_options = options())
      : tokenizer(Tokenizer::from_model_dir(kDemo)),
        engine(make_backend(tokenizer, output), tokenizer, {}),
        http(server_options) {
    http.start();
    http.attach(engine, std::move(chat_template));
  }
  ~ScriptedServer() {
    http.drain(5.0);
    http.stop();
  }
  static ServerOptions options() {
    ServerOptions o;
    o.port = 0;  // any free port
    o.served_model_name = "demo";
    o.model_path = kDemo;
    return o;
  }
  static std::unique_ptr<Backend> make_backend(const Tokenizer& t, const std::string& output) {
    std::vector<int32_t> script = t.encode(output);
    script.push_back(151645);  // <|im_end|>
    return std::make_unique<testing::ScriptedBackend>(script, 1024);
  }
  json post(const json& body) {
    httplib::Client client("127.0.0.1", http.port());
    const auto res = client.Post("/v1/chat/completions", body.dump(), "application/json");
    EXPECT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
    if (!body.value("stream", false)) return json::parse(res->body);
    json events = json::array();
    std::istringstream lines(res->body);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("data: ", 0) != 0) continue;
      if (line == "data: [DONE]") {
        events.push_back("[DONE]");
      } else {
        events.push_back(json::parse(line.substr(6)));
      }
    }
    return events;
  }

  Tokenizer tokenizer;
  LLMEngine engine;
  HttpServer http;
};

json request(bool stream, bool thinking = true) {
  json tools =
      json::array({{{"type", "function"},
                    {"function",
                     {{"name", "get_weather"},
                      {"parameters",
                       {{"type", "object"},
                        {"properties",
                         {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}}}}}}}});
  return {{"model", "demo"},  {"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
          {"tools", tools},   {"max_tokens", 200},
          {"stream", stream}, {"chat_template_kwargs", {{"enable_thinking", thinking}}}};
}

TEST(HttpServer, ReasoningAndToolCalls) {
  ScriptedServer s(kOutput);
  const json r = s.post(request(false));
  const json& choice = r["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["reasoning_content"], "\nThe user wants the weather.\n");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u);
  const json& call = choice["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()),
            json({{"city", "Paris"}}));
}

// What a stream's deltas add up to.
struct Streamed {
  std::string reasoning, content, finish;
  json calls = json::array();
};

Streamed collect(const json& events) {
  EXPECT_EQ(events.back(), "[DONE]");
  Streamed out;
  for (const json& e : events) {
    if (!e.is_object()) continue;
    for (const json& c : e["choices"]) {
      const json& d = c["delta"];
      if (d.contains("reasoning_content"))
        out.reasoning += d["reasoning_content"].get<std::string>();
      if (d.contains("content")) out.content += d["content"].get<std::string>();
      if (d.contains("tool_calls")) {
        for (const json& t : d["tool_calls"]) out.calls.push_back(t);
      }
      if (c["finish_reason"].is_string()) out.finish = c["finish_reason"];
    }
  }
  return out;
}

TEST(HttpServer, StreamedReasoningAndToolCalls) {
  ScriptedServer s(kOutput);
  const Streamed streamed = collect(s.post(request(true)));
  EXPECT_EQ(streamed.reasoning, "\nThe user wants the weather.\n");
  EXPECT_EQ(streamed.content, "");
  ASSERT_EQ(streamed.calls.size(), 1u);
  EXPECT_EQ(streamed.calls[0]["index"], 0);
  EXPECT_EQ(streamed.calls[0]["function"]["name"], "get_weather");
  EXPECT_EQ(streamed.finish, "tool_calls");
}

chat::ChatTemplate qwen35_template() {
  std::ifstream in(RELAY_SOURCE_DIR "/models/templates/Qwen3.5-4B.jinja");
  std::stringstream text;
  text << in.rdbuf();
  return chat::ChatTemplate::from_string(text.str(),
                                         chat::ChatTemplate::special_tokens_of_model_dir(kDemo));
}

// As Qwen3.5 answers: its prompt opens the think block, and it calls in qwen3_coder's format.
const std::string kQwen35Output =
    "The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
    "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    "</function>\n</tool_call>";

TEST(HttpServer, Qwen35TemplatesToolCallsAreFoundFromTheTemplate) {
  ScriptedServer s(kQwen35Output, qwen35_template());
  const json r = s.post(request(false));
  const json& choice = r["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["reasoning_content"], "The user wants the weather.\n");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  const json& calls = choice["message"]["tool_calls"];
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_NE(calls[0]["id"], calls[1]["id"]);
  for (const json& call : calls) {
    EXPECT_EQ(call["type"], "function");
    EXPECT_EQ(call["function"]["name"], "get_weather");
  }
  EXPECT_EQ(calls[0]["function"]["arguments"], R"({"city":"Paris","days":3})");
  EXPECT_EQ(calls[1]["function"]["arguments"], R"({"city":"Rome"})");

  const Streamed streamed = collect(s.post(request(true)));
  EXPECT_EQ(streamed.reasoning, "The user wants the weather.\n");
  EXPECT_EQ(streamed.content, "");
  EXPECT_EQ(streamed.finish, "tool_calls");
  ASSERT_EQ(streamed.calls.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(streamed.calls[i]["index"], i);
    EXPECT_EQ(streamed.calls[i]["type"], "function");
    EXPECT_EQ(streamed.calls[i]["id"].get<std::string>().rfind("call_", 0), 0u);
    EXPECT_EQ(streamed.calls[i]["function"], calls[i]["function"]);
  }
}

TEST(HttpServer, Qwen35ForcedCallIsSampledUnderTheQwen3CoderGrammar) {
  // The scripted backend fails the test if a mask forbids a scripted token: the forced call's
  // grammar allows Qwen3.5's own text for it, token by token.
  const std::string call =
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
  ScriptedServer s(call, qwen35_template());
  json body = request(false, /*thinking=*/false);
  body["tool_choice"] = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  const json choice = s.post(body)["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["arguments"],
            R"({"city":"Paris","days":3})");
  body["tool_choice"] = "required";
  body["stream"] = true;
  const Streamed streamed = collect(s.post(body));
  ASSERT_EQ(streamed.calls.size(), 1u);
  EXPECT_EQ(streamed.calls[0]["function"]["arguments"], R"({"city":"Paris","days":3})");
}

TEST(HttpServer, ToolCallFormatOptionOverridesTheTemplate) {
  // Qwen3's template with the qwen3_coder format named.
  ServerOptions o = ScriptedServer::options();
  o.tool_call_format = chat::ToolCallFormat::kQwen3Coder;
  const std::string call =
      "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n"
      "</tool_call>";
  {
    ScriptedServer s(call, chat::ChatTemplate::from_model_dir(kDemo), o);
    const json message = s.post(request(false, /*thinking=*/false))["choices"][0]["message"];
    ASSERT_EQ(message["tool_calls"].size(), 1u);
    EXPECT_EQ(message["tool_calls"][0]["function"]["arguments"], R"({"days":2})");
  }
  // Qwen3.5's template with hermes named: its calls are text then.
  o.tool_call_format = chat::ToolCallFormat::kHermes;
  ScriptedServer s(call, qwen35_template(), o);
  const json message = s.post(request(false, /*thinking=*/false))["choices"][0]["message"];
  EXPECT_TRUE(message["tool_calls"].empty());
  EXPECT_EQ(message["content"], call);
}

TEST(HttpServer, ThinkingDisabledLeavesTagsInContentAndWithoutToolsNoCalls) {
  ScriptedServer s("<think>x</think>plain");
  json body = request(false, /*thinking=*/false);
  body.erase("tools");
  const json r = s.post(body);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "<think>x</think>plain");
  EXPECT_TRUE(r["choices"][0]["message"]["reasoning_content"].is_null());
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
}

}  // namespace
}  // namespace relay::server

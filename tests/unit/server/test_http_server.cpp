// The HTTP server end to end with a scripted backend: the demo model never thinks or calls tools,
// so a backend that "generates" a Qwen3 reasoning block and a tool call proves that path through
// the real template, tokenizer, engine, parser and HTTP layer, streamed and not.
#include <gtest/gtest.h>
#include <httplib.h>

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
  explicit ScriptedServer(const std::string& output)
      : tokenizer(Tokenizer::from_model_dir(kDemo)),
        engine(make_backend(tokenizer, output), tokenizer, {}),
        http(options()) {
    http.start();
    http.attach(engine, chat::ChatTemplate::from_model_dir(kDemo));
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
                       {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}});
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

TEST(HttpServer, StreamedReasoningAndToolCalls) {
  ScriptedServer s(kOutput);
  const json events = s.post(request(true));
  ASSERT_EQ(events.back(), "[DONE]");
  std::string reasoning, content, finish;
  json calls = json::array();
  for (const json& e : events) {
    if (!e.is_object()) continue;
    for (const json& c : e["choices"]) {
      const json& d = c["delta"];
      if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
      if (d.contains("content")) content += d["content"].get<std::string>();
      if (d.contains("tool_calls")) {
        for (const json& t : d["tool_calls"]) calls.push_back(t);
      }
      if (c["finish_reason"].is_string()) finish = c["finish_reason"];
    }
  }
  EXPECT_EQ(reasoning, "\nThe user wants the weather.\n");
  EXPECT_EQ(content, "");
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
  EXPECT_EQ(finish, "tool_calls");
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

// Request validation: every accepted field, and every bad input answered with a 400 naming the
// parameter; plus a mutation fuzz that no body makes the parser do anything but parse or throw.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "server/openai_protocol.h"

namespace relay::server {
namespace {

using nlohmann::json;

ApiError chat_error(const json& body) {
  try {
    parse_chat_request(body.dump());
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted " << body.dump();
  return {};
}

ApiError completion_error(const json& body) {
  try {
    parse_completion_request(body.dump());
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted " << body.dump();
  return {};
}

json chat(json extra = json::object()) {
  json j = {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  j.update(extra);
  return j;
}

TEST(OpenAIProtocol, ParsesAFullChatRequest) {
  const ChatRequest r =
      parse_chat_request(chat({{"max_completion_tokens", 7},
                               {"temperature", 0.5},
                               {"top_p", 0.9},
                               {"top_k", 20},
                               {"min_p", 0.05},
                               {"seed", 42},
                               {"n", 2},
                               {"presence_penalty", 0.5},
                               {"frequency_penalty", -0.5},
                               {"logprobs", true},
                               {"top_logprobs", 3},
                               {"stop", {"\n\n", "END"}},
                               {"stop_token_ids", {5, 6}},
                               {"ignore_eos", true},
                               {"stream", true},
                               {"stream_options", {{"include_usage", true}}},
                               {"chat_template_kwargs", {{"enable_thinking", false}}},
                               {"user", "someone"}})
                             .dump());
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(*r.options.max_tokens, 7);
  EXPECT_DOUBLE_EQ(r.options.temperature, 0.5);
  EXPECT_EQ(r.options.top_k, 20);
  EXPECT_EQ(*r.options.seed, 42u);
  EXPECT_EQ(r.options.n, 2);
  EXPECT_TRUE(r.options.logprobs);
  EXPECT_EQ(r.options.top_logprobs, 3);
  EXPECT_EQ(r.options.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(r.options.stop_token_ids, (std::vector<int64_t>{5, 6}));
  EXPECT_TRUE(r.options.ignore_eos);
  EXPECT_TRUE(r.options.stream);
  EXPECT_TRUE(r.options.include_usage);
  EXPECT_EQ(r.chat_template_kwargs["enable_thinking"], false);
}

TEST(OpenAIProtocol, NormalizesContentPartsAndToolCallArguments) {
  const ChatRequest r = parse_chat_request(
      chat({{"messages",
             {{{"role", "user"},
               {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}},
              {{"role", "assistant"},
               {"content", nullptr},
               {"tool_calls",
                {{{"id", "c1"},
                  {"type", "function"},
                  {"function", {{"name", "f"}, {"arguments", "{\"x\": 1}"}}}}}}},
              {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "42"}}}},
            {"tools",
             {{{"type", "function"},
               {"function", {{"name", "f"}, {"parameters", json::object()}}}}}}})
          .dump());
  EXPECT_EQ(r.messages[0]["content"], "ab");
  EXPECT_EQ(r.messages[1]["tool_calls"][0]["function"]["arguments"]["x"], 1);
  EXPECT_TRUE(r.tools.is_array());
}

TEST(OpenAIProtocol, NullMeansDefault) {
  const ChatRequest r =
      parse_chat_request(chat({{"temperature", nullptr}, {"max_tokens", nullptr}}).dump());
  EXPECT_DOUBLE_EQ(r.options.temperature, 1.0);
  EXPECT_FALSE(r.options.max_tokens.has_value());
}

TEST(OpenAIProtocol, BadChatInputsNameTheParameter) {
  struct Case {
    json body;
    std::string param;
  };
  const std::vector<Case> cases = {
      {chat({{"messages", json::array()}}), "messages"},
      {chat({{"messages", "hi"}}), "messages"},
      {json{{"model", "m"}}, "messages"},
      {json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, "model"},
      {chat({{"messages", {{{"role", "wizard"}, {"content", "hi"}}}}}), "messages[0].role"},
      {chat({{"messages", {{{"role", "user"}}}}}), "messages[0].content"},
      {chat({{"messages", {{{"role", "user"}, {"content", 5}}}}}), "messages[0].content"},
      {chat({{"messages", {42}}}), "messages[0]"},
      {chat({{"temperature", "hot"}}), "temperature"},
      {chat({{"temperature", -1}}), "temperature"},
      {chat({{"temperature", 3}}), "temperature"},
      {chat({{"top_p", 0}}), "top_p"},
      {chat({{"top_p", 1.5}}), "top_p"},
      {chat({{"top_k", -2}}), "top_k"},
      {chat({{"top_k", 1.5}}), "top_k"},
      {chat({{"min_p", 2}}), "min_p"},
      {chat({{"max_tokens", 0}}), "max_tokens"},
      {chat({{"max_tokens", -5}}), "max_tokens"},
      {chat({{"max_tokens", "ten"}}), "max_tokens"},
      {chat({{"max_completion_tokens", 0}}), "max_completion_tokens"},
      {chat({{"n", 0}}), "n"},
      {chat({{"n", 1000}}), "n"},
      {chat({{"presence_penalty", 5}}), "presence_penalty"},
      {chat({{"frequency_penalty", -3}}), "frequency_penalty"},
      {chat({{"seed", "x"}}), "seed"},
      {chat({{"stop", 5}}), "stop"},
      {chat({{"stop", {""}}}), "stop"},
      {chat({{"stop", {1, 2}}}), "stop"},
      {chat({{"stop_token_ids", {"a"}}}), "stop_token_ids"},
      {chat({{"logprobs", 3}}), "logprobs"},
      {chat({{"top_logprobs", 3}}), "top_logprobs"},
      {chat({{"logprobs", true}, {"top_logprobs", 50}}), "top_logprobs"},
      {chat({{"stream", "yes"}}), "stream"},
      {chat({{"stream_options", {{"include_usage", true}}}}), "stream_options"},
      {chat({{"tools", "f"}}), "tools"},
      {chat({{"tools", {{{"type", "function"}}}}}), "tools[0]"},
      {chat({{"tool_choice", "sometimes"}}), "tool_choice"},
      {chat({{"tool_choice", "required"}}), "tool_choice"},
      {chat({{"chat_template_kwargs", 1}}), "chat_template_kwargs"},
      {chat({{"logit_bias", {{"five", 10}}}}), "logit_bias"},
      {chat({{"logit_bias", {{"5", 200}}}}), "logit_bias"},
      {chat({{"response_format", {{"type", "yaml"}}}}), "response_format"},
      {chat({{"guided_regex", "a"}, {"guided_choice", {"b"}}}), "guided_choice"},
  };
  for (const Case& c : cases) {
    const ApiError e = chat_error(c.body);
    EXPECT_EQ(e.status, 400) << c.body.dump();
    EXPECT_EQ(e.param, c.param) << c.body.dump() << " -> " << e.message;
    EXPECT_NE(e.message.find(c.param.substr(0, c.param.find_first_of(".["))), std::string::npos)
        << "message does not name the parameter: " << e.message;
    const auto body = e.body();
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
    EXPECT_EQ(body["error"]["param"], c.param);
    EXPECT_TRUE(body["error"]["code"].is_null());
  }
}

TEST(OpenAIProtocol, MalformedJsonAndNonObjects) {
  for (const char* body : {"", "{", "{\"model\": }", "[1, 2]", "\"hello\"", "null", "{\"a\":1}}"}) {
    try {
      parse_chat_request(body);
      ADD_FAILURE() << "accepted " << body;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_TRUE(e.param.empty());
    }
  }
}

TEST(OpenAIProtocol, CompletionPrompts) {
  CompletionRequest r = parse_completion_request(R"({"model": "m", "prompt": "def f():"})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(*r.prompts[0].text, "def f():");
  EXPECT_EQ(*r.options.max_tokens, 16);  // OpenAI's default
  r = parse_completion_request(
      R"({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(r.options.logprobs);
  EXPECT_EQ(r.options.top_logprobs, 2);
  r = parse_completion_request(R"({"model": "m", "prompt": ["x"]})");
  EXPECT_EQ(*r.prompts.at(0).text, "x");
  r = parse_completion_request(R"({"model": "m", "prompt": [[7, 8]], "echo": true})");
  EXPECT_EQ(r.prompts.at(0).ids, (std::vector<int64_t>{7, 8}));
  EXPECT_TRUE(r.echo);
  // Batches: strings, or lists of ids (lm-eval sends these), in order.
  r = parse_completion_request(R"({"model": "m", "prompt": ["a", "b", "c"]})");
  ASSERT_EQ(r.prompts.size(), 3u);
  EXPECT_EQ(*r.prompts[2].text, "c");
  r = parse_completion_request(
      R"({"model": "m", "prompt": [[1, 2], [3]], "echo": true, "max_tokens": 0, "logprobs": 1})");
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[1].ids, std::vector<int64_t>{3});
  EXPECT_EQ(*r.options.max_tokens, 0);
  r = parse_completion_request(R"({"model": "m", "prompt": "x", "prompt_logprobs": 3})");
  EXPECT_EQ(*r.options.prompt_logprobs, 3);

  EXPECT_EQ(completion_error({{"model", "m"}}).param, "prompt");
  EXPECT_EQ(completion_error({{"model", "m"}, {"prompt", ""}}).param, "prompt");
  EXPECT_EQ(completion_error({{"model", "m"}, {"prompt", json::array()}}).param, "prompt");
  EXPECT_EQ(completion_error({{"model", "m"}, {"prompt", {"a", ""}}}).param, "prompt");
  EXPECT_EQ(completion_error({{"model", "m"}, {"prompt", {"a", 1}}}).param, "prompt");
  EXPECT_EQ(completion_error({{"model", "m"}, {"prompt", {json::array({1}), "a", 5}}}).param,
            "prompt");
  EXPECT_EQ(completion_error({{"model", "m"}, {"prompt", 5}}).param, "prompt");
  EXPECT_EQ(completion_error({{"model", "m"}, {"prompt", "x"}, {"max_tokens", 0}}).param,
            "max_tokens");
  EXPECT_EQ(completion_error({{"model", "m"},
                              {"prompt", "x"},
                              {"stream", true},
                              {"prompt_logprobs", 1}})
                .param,
            "prompt_logprobs");
  EXPECT_EQ(
      completion_error({{"model", "m"}, {"prompt", "x"}, {"prompt_logprobs", 21}}).param,
      "prompt_logprobs");
  EXPECT_EQ(completion_error({{"model", "m"}, {"prompt", "x"}, {"logprobs", true}}).param,
            "logprobs");
  EXPECT_EQ(completion_error({{"model", "m"}, {"prompt", "x"}, {"suffix", "y"}}).param, "suffix");
  // A chat field on the completions route is ignored (and listed), as vLLM ignores it.
  EXPECT_EQ(parse_completion_request(
                json{{"model", "m"}, {"prompt", "x"}, {"messages", json::array()}}.dump())
                .ignored_fields,
            std::vector<std::string>{"messages"});
}

TEST(OpenAIProtocol, ContextLength) {
  GenerationOptions o;
  EXPECT_EQ(check_context_length(10, o, 100, "messages"), 90);
  o.max_tokens = 50;
  EXPECT_EQ(check_context_length(10, o, 100, "messages"), 50);
  o.max_tokens = 91;
  try {
    check_context_length(10, o, 100, "messages");
    ADD_FAILURE();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.code, "context_length_exceeded");
    EXPECT_EQ(e.param, "messages");
    EXPECT_NE(e.message.find("100"), std::string::npos);
  }
  o.max_tokens.reset();
  EXPECT_THROW(check_context_length(100, o, 100, "prompt"), ApiError);
  EXPECT_THROW(check_token_ids({1, 5, 10}, 10, "prompt"), ApiError);
  EXPECT_THROW(check_token_ids({-1}, 10, "prompt"), ApiError);
  EXPECT_NO_THROW(check_token_ids({0, 9}, 10, "prompt"));
}

// Byte-level mutations of valid bodies: the parser either accepts or throws ApiError, never
// anything else (a crash or another exception type fails the test).
TEST(OpenAIProtocol, MutationFuzz) {
  const std::vector<std::string> seeds = {
      chat({{"max_tokens", 5},
            {"stop", {"a"}},
            {"logprobs", true},
            {"top_logprobs", 2},
            {"stream", true},
            {"stream_options", {{"include_usage", true}}}})
          .dump(),
      R"({"model":"m","prompt":[1,2,3],"max_tokens":3,"logprobs":1,"echo":true})",
      chat({{"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}},
            {"tool_choice", "auto"}})
          .dump(),
  };
  std::mt19937 rng(7);
  const std::string alphabet = "{}[]\":,0123456789.-eE truefalsnl\\u";
  for (int i = 0; i < 20000; ++i) {
    std::string s = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits && !s.empty(); ++k) {
      const size_t pos = rng() % s.size();
      switch (rng() % 3) {
        case 0:
          s[pos] = alphabet[rng() % alphabet.size()];
          break;
        case 1:
          s.erase(pos, 1 + rng() % 3);
          break;
        default:
          s.insert(pos, 1, alphabet[rng() % alphabet.size()]);
          break;
      }
    }
    for (int which = 0; which < 2; ++which) {
      try {
        if (which == 0) {
          parse_chat_request(s);
        } else {
          parse_completion_request(s);
        }
      } catch (const ApiError& e) {
        EXPECT_GE(e.status, 400);
      }
    }
  }
}

}  // namespace
}  // namespace relay::server

namespace relay::server {
namespace {

TEST(OpenAiProtocol, UnknownFieldsAreIgnoredAndListedAsVllmDoes) {
  const nlohmann::ordered_json body = {
      {"model", "m"},
      {"messages", {{{"role", "user"}, {"content", "hi"}}}},
      {"reasoning_effort", "low"},
      {"modalities", {"text"}},
      {"prediction", {{"type", "content"}, {"content", "x"}}},
      {"verbosity", "low"},
      {"audio", nullptr},
      {"user", "u"},
      {"stream", true},
      {"stream_options", {{"include_usage", true}, {"later_option", 1}}}};
  ChatRequest r = parse_chat_request(body.dump());
  // audio is null (absent); user never changes the output and is not listed.
  std::sort(r.ignored_fields.begin(), r.ignored_fields.end());
  EXPECT_EQ(r.ignored_fields, (std::vector<std::string>{"modalities", "prediction",
                                                         "reasoning_effort",
                                                         "stream_options.later_option",
                                                         "verbosity"}));
  EXPECT_TRUE(r.options.include_usage);
  const CompletionRequest c =
      parse_completion_request(R"({"model": "m", "prompt": "x", "frobnicate": 1})");
  EXPECT_EQ(c.ignored_fields, std::vector<std::string>{"frobnicate"});
}

}  // namespace
}  // namespace relay::server

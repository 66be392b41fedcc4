// The router's worker registry (picks, heartbeat timeouts, re-joining, autoscaling signals) on an
// explicit clock, and the control plane's message codecs: round trips (prompt logprobs and token
// constraints included, the grammars compiled against the demo model's vocabulary) and refusals
// naming the field.
#include <gtest/gtest.h>

#include "core/error.h"
#include "disagg/protocol.h"
#include "disagg/registry.h"
#include "grammar/grammar.h"
#include "tokenizer/tokenizer.h"

namespace relay::disagg {
namespace {

using std::chrono::milliseconds;

// A worker's grammar compiler: the demo model's Qwen3 vocabulary.
GrammarCompiler& compiler() {
  static const Tokenizer tokenizer =
      Tokenizer::from_model_dir(RELAY_SOURCE_DIR "/models/relay-demo-moe");
  static GrammarCompiler compiler(tokenizer, GrammarCompilerOptions{151936, {151645}});
  return compiler;
}

std::shared_ptr<const CompiledGrammar> compile(const GrammarSpec& spec) {
  return compiler().compile(spec);
}

// The error request_from_json throws for `j`, or "" when it decodes.
std::string request_error(const nlohmann::json& j) {
  try {
    request_from_json(j, compile);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

WorkerLoad load(int running, int64_t queued_tokens = 0, int64_t done_tokens = 0) {
  WorkerLoad l;
  l.num_running = running;
  l.queued_prompt_tokens = queued_tokens;
  l.prefill_tokens_total = done_tokens;
  return l;
}

TEST(WorkerRegistry, PicksTheLeastLoadedWorkerOfEachRole) {
  WorkerRegistry r;
  const Clock::time_point t0 = Clock::now();
  r.heartbeat("http://p1", "prefill", load(0, 500), t0);
  r.heartbeat("http://p2", "prefill", load(0, 100), t0);
  r.heartbeat("http://d1", "decode", load(7), t0);
  r.heartbeat("http://d2", "decode", load(3), t0);
  EXPECT_EQ(r.pick("prefill", t0), "http://p2");
  EXPECT_EQ(r.pick("decode", t0), "http://d2");
  EXPECT_EQ(r.pick("decode", t0, {"http://d2"}), "http://d1");
  // What the router just sent counts until the next heartbeat, so a burst spreads out.
  r.assigned("http://p2", 1000);
  EXPECT_EQ(r.pick("prefill", t0), "http://p1");
  for (int i = 0; i < 5; ++i) r.assigned("http://d2", 10);
  EXPECT_EQ(r.pick("decode", t0), "http://d1");
  r.heartbeat("http://d2", "decode", load(3), t0 + milliseconds(10));
  EXPECT_EQ(r.pick("decode", t0), "http://d2");
}

TEST(WorkerRegistry, DecodePicksWeighTheBatchByCapacity) {
  WorkerRegistry r;
  const Clock::time_point t0 = Clock::now();
  WorkerLoad small = load(8), large = load(24);
  small.max_num_seqs = 16;   // half full
  large.max_num_seqs = 128;  // under a fifth
  r.heartbeat("http://small", "decode", small, t0);
  r.heartbeat("http://large", "decode", large, t0);
  EXPECT_EQ(r.pick("decode", t0), "http://large");
}

TEST(WorkerRegistry, MissedHeartbeatsAndFailuresMarkAWorkerDownUntilItBeatsAgain) {
  RegistryOptions o;
  o.heartbeat_timeout = milliseconds(300);
  WorkerRegistry r(o);
  const Clock::time_point t0 = Clock::now();
  r.heartbeat("http://d1", "decode", load(0), t0);
  r.heartbeat("http://d2", "decode", load(5), t0);
  EXPECT_EQ(r.pick("decode", t0 + milliseconds(200)), "http://d1");
  r.heartbeat("http://d2", "decode", load(5), t0 + milliseconds(250));
  EXPECT_EQ(r.pick("decode", t0 + milliseconds(400)), "http://d2");  // d1 missed its beats
  r.mark_down("http://d2");
  EXPECT_FALSE(r.pick("decode", t0 + milliseconds(400)).has_value());
  r.heartbeat("http://d1", "decode", load(0), t0 + milliseconds(500));  // re-joins
  EXPECT_EQ(r.pick("decode", t0 + milliseconds(500)), "http://d1");
  const auto ws = r.workers(t0 + milliseconds(500));
  ASSERT_EQ(ws.size(), 2u);
  EXPECT_TRUE(ws[0].up);
  EXPECT_FALSE(ws[1].up);
  EXPECT_THROW(r.heartbeat("http://x", "chef", load(0), t0), Error);
  EXPECT_THROW(r.heartbeat("", "decode", load(0), t0), Error);
}

TEST(WorkerRegistry, AutoscalingSignals) {
  RegistryOptions o;
  o.rate_window = milliseconds(10000);
  o.decode_target_batch = 8;
  WorkerRegistry r(o);
  const Clock::time_point t0 = Clock::now();
  r.heartbeat("http://p1", "prefill", load(0, 0, 0), t0);
  r.heartbeat("http://d1", "decode", load(20), t0);
  r.heartbeat("http://d2", "decode", load(5), t0);
  AutoscaleSignals s = r.signals(t0);
  EXPECT_EQ(s.prefill_workers_up, 1);
  EXPECT_EQ(s.decode_workers_up, 2);
  EXPECT_EQ(s.decode_sequences, 25);
  EXPECT_EQ(s.decode_replicas_needed, 4);   // ceil(25 / 8)
  EXPECT_EQ(s.prefill_replicas_needed, 1);  // no capacity measured yet: keep the current count
  // The prefill worker handed off 20,000 tokens in one second while still busy: 20k tok/s.
  r.heartbeat("http://p1", "prefill", load(0, 4000, 20000), t0 + milliseconds(1000));
  // Busy intervals only: an idle second does not lower the measured capacity.
  r.heartbeat("http://p1", "prefill", load(0, 0, 20100), t0 + milliseconds(2000));
  for (int i = 0; i < 10; ++i)
    r.record_prompt(50000, t0 + milliseconds(2000));  // 500k tokens in 10 s
  s = r.signals(t0 + milliseconds(2000));
  EXPECT_DOUBLE_EQ(s.prefill_capacity_tokens_per_s, 20000.0);
  EXPECT_DOUBLE_EQ(s.prompt_tokens_per_s, 50000.0);
  EXPECT_EQ(s.prefill_replicas_needed, 3);  // ceil(50k / 20k)
  // Arrivals leave the window.
  s = r.signals(t0 + milliseconds(13000));
  EXPECT_DOUBLE_EQ(s.prompt_tokens_per_s, 0.0);
}

TEST(Protocol, RequestsOutputsAndFirstTokensRoundTrip) {
  EngineRequest r;
  r.prompt = {1, 2, 3};
  r.sampling.temperature = 0.7f;
  r.sampling.top_k = 20;
  r.sampling.seed = 0xfedcba9876543210ull;
  r.sampling.num_logprobs = 3;
  r.stop.max_tokens = 99;
  r.stop.stop_strings = {"\n\n", "END"};
  r.stop.stop_token_ids = {7};
  r.stop.ignore_eos = true;
  const EngineRequest back =
      request_from_json(nlohmann::json::parse(request_to_json(r).dump()), compile);
  EXPECT_EQ(back.prompt, r.prompt);
  EXPECT_EQ(back.sampling.seed, r.sampling.seed);
  EXPECT_EQ(back.sampling.top_k, 20);
  EXPECT_FLOAT_EQ(back.sampling.temperature, 0.7f);
  EXPECT_EQ(back.stop.stop_strings, r.stop.stop_strings);
  EXPECT_EQ(back.stop.max_tokens, 99);
  EXPECT_TRUE(back.stop.ignore_eos);

  RequestOutput o;
  o.id = 5;
  o.new_tokens = {42};
  o.text = "héllo";
  o.logprobs = {{42, -0.5f, {{42, -0.5f}, {7, -1.5f}}}};
  o.finish = FinishReason::kLength;
  o.num_prompt_tokens = 3;
  o.num_output_tokens = 9;
  const RequestOutput ob = output_from_json(nlohmann::json::parse(output_to_json(o).dump()));
  EXPECT_EQ(ob.text, o.text);
  EXPECT_EQ(ob.finish, FinishReason::kLength);
  ASSERT_EQ(ob.logprobs.size(), 1u);
  EXPECT_EQ(ob.logprobs[0].top[1].first, 7);

  FirstToken f;
  f.token.token = 11;
  f.token.logprob = -0.25f;
  f.num_cached_tokens = 16;
  const FirstToken fb = first_token_from_json(first_token_to_json(f));
  EXPECT_EQ(fb.token.token, 11);
  EXPECT_EQ(fb.num_cached_tokens, 16);
}

TEST(Protocol, MalformedMessagesNameTheField) {
  EXPECT_NE(request_error({{"sampling", nlohmann::json::object()}}).find("\"prompt\""),
            std::string::npos);
  EngineRequest one;
  one.prompt = {1};
  nlohmann::json j = request_to_json(one);
  j["stop"]["max_tokens"] = "many";
  EXPECT_NE(request_error(j).find("\"max_tokens\" has the wrong type"), std::string::npos);
  nlohmann::json out = output_to_json(RequestOutput{});
  out["finish"] = "exploded";
  EXPECT_THROW(output_from_json(out), Error);
}

// Prompt logprobs and token constraints cross the control plane: the grammar as its spec, which
// the receiving worker compiles again; logit_bias, the reasoning tokens, and the prompt logprobs
// (ranks included) of the prefill worker's answer and of an output.
TEST(Protocol, ConstraintsAndPromptLogprobsRoundTrip) {
  const GrammarSpec schema = GrammarSpec::json_schema(
      R"({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})", true);
  for (const GrammarSpec& spec :
       {schema, GrammarSpec::choice(std::vector<std::string>{"yes", "no"}), GrammarSpec::json()}) {
    EngineRequest r;
    r.prompt = {1, 2, 3};
    r.num_prompt_logprobs = 4;
    r.logit_bias = {{5, 1.5f}, {151000, -100.0f}};
    r.reasoning = {151667, 151668, true};
    r.grammar = compiler().compile(spec);
    int num_compiled = 0;
    const EngineRequest back = request_from_json(nlohmann::json::parse(request_to_json(r).dump()),
                                                 [&](const GrammarSpec& s) {
                                                   ++num_compiled;
                                                   return compile(s);
                                                 });
    EXPECT_EQ(back.num_prompt_logprobs, 4);
    EXPECT_EQ(back.logit_bias, r.logit_bias);
    EXPECT_EQ(back.reasoning.open, 151667);
    EXPECT_EQ(back.reasoning.close, 151668);
    EXPECT_TRUE(back.reasoning.starts_inside);
    ASSERT_NE(back.grammar, nullptr);
    EXPECT_EQ(num_compiled, 1);
    EXPECT_EQ(grammar_spec(*back.grammar), spec);
  }
  // None of them: none come back, and a message without the fields (an older router's) means the
  // same.
  EngineRequest plain;
  plain.prompt = {1};
  nlohmann::json j = request_to_json(plain);
  EXPECT_FALSE(j.contains("grammar"));
  for (const char* key : {"num_prompt_logprobs", "logit_bias", "reasoning"}) {
    for (const nlohmann::json& message : {j, [&] {
                                            nlohmann::json old = j;
                                            old.erase(key);
                                            return old;
                                          }()}) {
      const EngineRequest back = request_from_json(message, compile);
      EXPECT_EQ(back.num_prompt_logprobs, -1);
      EXPECT_TRUE(back.logit_bias.empty());
      EXPECT_EQ(back.reasoning.open, -1);
      EXPECT_EQ(back.grammar, nullptr);
    }
  }

  const std::vector<std::optional<TokenLogprob>> rows = {
      std::nullopt, TokenLogprob{7, -2.5f, {{3, -0.5f}, {7, -2.5f}}, 2},
      TokenLogprob{9, -0.25f, {}, 1}};
  FirstToken f;
  f.token.token = 11;
  f.token.logprob = -0.75f;
  f.token.rank = 3;
  f.num_cached_tokens = 0;
  f.prompt_logprobs = rows;
  const FirstToken fb = first_token_from_json(nlohmann::json::parse(first_token_to_json(f).dump()));
  EXPECT_EQ(fb.token.rank, 3);
  ASSERT_EQ(fb.prompt_logprobs.size(), 3u);
  EXPECT_FALSE(fb.prompt_logprobs[0]);
  EXPECT_EQ(fb.prompt_logprobs[1]->token, 7);
  EXPECT_EQ(fb.prompt_logprobs[1]->rank, 2);
  EXPECT_EQ(fb.prompt_logprobs[1]->top, rows[1]->top);
  EXPECT_FLOAT_EQ(fb.prompt_logprobs[2]->logprob, -0.25f);
  EXPECT_FALSE(first_token_to_json(FirstToken{}).contains("prompt_logprobs"));

  RequestOutput o;
  o.finish = FinishReason::kLength;
  o.prompt_logprobs = rows;
  const RequestOutput ob = output_from_json(nlohmann::json::parse(output_to_json(o).dump()));
  ASSERT_EQ(ob.prompt_logprobs.size(), 3u);
  EXPECT_FALSE(ob.prompt_logprobs[0]);
  EXPECT_EQ(ob.prompt_logprobs[1]->rank, 2);
  EXPECT_TRUE(output_from_json(output_to_json(RequestOutput{})).prompt_logprobs.empty());
}

TEST(Protocol, MalformedConstraintsNameTheField) {
  EngineRequest r;
  r.prompt = {1};
  r.grammar = compiler().compile(GrammarSpec::regex("[0-9]+"));
  const nlohmann::json good = request_to_json(r);
  auto with = [&](const char* key, nlohmann::json value) {
    nlohmann::json j = good;
    j[key] = std::move(value);
    return request_error(j);
  };
  auto names = [](const std::string& message, const std::string& part) {
    return message.find(part) != std::string::npos ? ::testing::AssertionSuccess()
                                                   : ::testing::AssertionFailure() << message;
  };
  EXPECT_TRUE(
      names(with("grammar", {{"kind", "yaml"}, {"text", ""}}), "grammar: unknown kind \"yaml\""));
  EXPECT_TRUE(names(with("grammar", {{"kind", "regex"}}), "grammar: missing field \"text\""));
  EXPECT_TRUE(names(with("grammar", "[0-9]+"), "grammar: missing field \"kind\""));
  EXPECT_TRUE(names(with("grammar", {{"kind", "json_schema"}, {"text", "{\"type\": \"objekt\"}"}}),
                    "grammar: invalid JSON schema"));
  EXPECT_TRUE(names(with("logit_bias", nlohmann::json::parse("[[5]]")),
                    "\"logit_bias\": each entry must be [token, number]"));
  EXPECT_TRUE(names(with("logit_bias", nlohmann::json::parse(R"([["5", 1.0]])")),
                    "\"logit_bias\": each entry"));
  EXPECT_TRUE(names(with("logit_bias", nlohmann::json::parse("[[1099511627776, 1.0]]")),
                    "\"logit_bias\": each entry"));
  EXPECT_TRUE(names(with("logit_bias", "5"), "\"logit_bias\": must be a list"));
  EXPECT_TRUE(
      names(with("num_prompt_logprobs", "all"), "\"num_prompt_logprobs\" has the wrong type"));
  EXPECT_TRUE(names(with("reasoning", {{"open", 1}, {"close", 2}}),
                    "reasoning: missing field \"starts_inside\""));

  RequestOutput o;
  o.prompt_logprobs = {std::nullopt, TokenLogprob{7, -2.5f, {}, 1}};
  nlohmann::json out = output_to_json(o);
  out["prompt_logprobs"][1].erase("logprob");
  EXPECT_THROW(
      {
        try {
          output_from_json(out);
        } catch (const Error& e) {
          EXPECT_TRUE(names(e.what(), "prompt logprob: missing field \"logprob\""));
          throw;
        }
      },
      Error);
  out["prompt_logprobs"] = 5;
  EXPECT_THROW(output_from_json(out), Error);
  nlohmann::json first = first_token_to_json(FirstToken{});
  first["top"] = nlohmann::json::parse(R"([[1, "high"]])");
  EXPECT_THROW(first_token_from_json(first), Error);
}

}  // namespace
}  // namespace relay::disagg

// LLMEngine: stop conditions (max_tokens, EOS, ignore_eos, min_tokens, stop tokens, stop strings
// with hold-back), text assembly, logprobs, abort, and preemption through the engine, with backends
// that script their output (so the text is known) or read their KV cache
// (scheduler/fake_backend.h).
#include <gtest/gtest.h>

#include <map>

#include "../scheduler/fake_backend.h"
#include "core/error.h"
#include "engine/llm_engine.h"

namespace relay {
namespace {

Tokenizer demo_tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(RELAY_SOURCE_DIR "/models/relay-demo-moe");
  return t;
}

struct Collected {
  std::string text;
  std::vector<std::string> deltas;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;
  FinishReason finish = FinishReason::kNone;
  int num_outputs_after_finish = 0;
  int num_output_tokens = 0;
};

std::map<int64_t, Collected> run(LLMEngine& engine, int max_steps = 10000) {
  std::map<int64_t, Collected> all;
  for (int i = 0; i < max_steps && engine.has_work(); ++i) {
    for (const RequestOutput& out : engine.step()) {
      Collected& c = all[out.id];
      if (c.finish != FinishReason::kNone) ++c.num_outputs_after_finish;
      c.text += out.text;
      c.deltas.push_back(out.text);
      c.tokens.insert(c.tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
      c.logprobs.insert(c.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
      c.finish = out.finish;
      c.num_output_tokens = out.num_output_tokens;
    }
  }
  EXPECT_FALSE(engine.has_work());
  return all;
}

EngineRequest request(const std::string& prompt, int64_t max_tokens) {
  EngineRequest r;
  r.prompt = demo_tokenizer().encode(prompt);
  r.sampling.temperature = 0.0f;
  r.stop.max_tokens = max_tokens;
  return r;
}

// A request for FakeBackend, whose vocabulary is its first 1000 ids.
EngineRequest fake_request(const std::string& prompt, int64_t max_tokens) {
  EngineRequest r = request(prompt, max_tokens);
  for (int32_t& t : r.prompt) t %= testing::FakeBackend::kVocab;
  return r;
}

std::unique_ptr<Backend> scripted(const std::string& text, std::vector<int32_t> extra = {}) {
  std::vector<int32_t> ids = demo_tokenizer().encode(text);
  ids.insert(ids.end(), extra.begin(), extra.end());
  return std::make_unique<testing::ScriptedBackend>(ids);
}

TEST(LLMEngine, MaxTokensGivesLengthAndTheText) {
  const std::string text = "def add(a, b):\n    return a + b\n";
  const size_t n = demo_tokenizer().encode(text).size();
  LLMEngine engine(scripted(text), demo_tokenizer(), {});
  engine.add_request(1, request("x", static_cast<int64_t>(n)));
  const auto out = run(engine);
  EXPECT_EQ(out.at(1).text, text);
  EXPECT_EQ(out.at(1).finish, FinishReason::kLength);
  EXPECT_EQ(out.at(1).num_output_tokens, static_cast<int>(n));
  EXPECT_EQ(out.at(1).num_outputs_after_finish, 0);
}

TEST(LLMEngine, EosStopsUnlessIgnoredAndAddsNoText) {
  {
    LLMEngine engine(scripted("hello", {151645}), demo_tokenizer(), {});
    engine.add_request(1, request("x", 50));
    const auto out = run(engine);
    EXPECT_EQ(out.at(1).text, "hello");
    EXPECT_EQ(out.at(1).finish, FinishReason::kStop);
    EXPECT_EQ(out.at(1).tokens.back(), 151645);  // counted as generated
  }
  {
    LLMEngine engine(scripted("hello", {151645}), demo_tokenizer(), {});
    EngineRequest r = request("x", 5);
    r.stop.ignore_eos = true;
    engine.add_request(1, r);
    const auto out = run(engine);
    EXPECT_EQ(out.at(1).finish, FinishReason::kLength);
    EXPECT_EQ(out.at(1).num_output_tokens, 5);
  }
  {
    // min_tokens: EOS before the minimum does not stop.
    LLMEngine engine(std::make_unique<testing::ScriptedBackend>(std::vector<int32_t>{151645}),
                     demo_tokenizer(), {});
    EngineRequest r = request("x", 10);
    r.stop.min_tokens = 3;
    engine.add_request(1, r);
    const auto out = run(engine);
    EXPECT_EQ(out.at(1).finish, FinishReason::kStop);
    EXPECT_EQ(out.at(1).num_output_tokens, 4);
  }
}

TEST(LLMEngine, StopTokenIds) {
  const std::vector<int32_t> ids = demo_tokenizer().encode("a b c d e");
  LLMEngine engine(std::make_unique<testing::ScriptedBackend>(ids), demo_tokenizer(), {});
  EngineRequest r = request("x", 50);
  r.stop.stop_token_ids = {ids[2]};
  engine.add_request(1, r);
  const auto out = run(engine);
  EXPECT_EQ(out.at(1).finish, FinishReason::kStop);
  EXPECT_EQ(out.at(1).text, demo_tokenizer().decode(std::span(ids).first(2)));
  EXPECT_EQ(out.at(1).num_output_tokens, 3);
}

TEST(LLMEngine, StopStringsAreCutAndNeverLeak) {
  const std::string text = "alpha beta STOP gamma delta";
  for (bool include : {false, true}) {
    LLMEngine engine(scripted(text), demo_tokenizer(), {});
    EngineRequest r = request("x", 100);
    r.stop.stop_strings = {"STOP", "never-there"};
    r.stop.include_stop_str_in_output = include;
    engine.add_request(1, r);
    const auto out = run(engine);
    EXPECT_EQ(out.at(1).finish, FinishReason::kStop);
    EXPECT_EQ(out.at(1).text, include ? "alpha beta STOP" : "alpha beta ");
    // No delta before the last may end in a piece of "STOP" that was later cut.
    for (size_t i = 0; i + 1 < out.at(1).deltas.size(); ++i) {
      EXPECT_EQ(out.at(1).deltas[i].find("ST"), std::string::npos) << out.at(1).deltas[i];
    }
  }
}

TEST(LLMEngine, HeldBackTextIsReleasedWhenItCannotBeAStop) {
  // "be" could start "beta!", so it waits; "bet" then "x" proves it is not the stop string.
  LLMEngine engine(scripted("alpha betx done"), demo_tokenizer(), {});
  EngineRequest r =
      request("x", static_cast<int64_t>(demo_tokenizer().encode("alpha betx done").size()));
  r.stop.stop_strings = {"beta!"};
  engine.add_request(1, r);
  const auto out = run(engine);
  EXPECT_EQ(out.at(1).text, "alpha betx done");
  EXPECT_EQ(out.at(1).finish, FinishReason::kLength);
}

TEST(LLMEngine, StopStringSpanningTokens) {
  LLMEngine engine(scripted("x = 1\n\n\ny = 2"), demo_tokenizer(), {});
  EngineRequest r = request("x", 100);
  r.stop.stop_strings = {"\n\n"};
  engine.add_request(1, r);
  const auto out = run(engine);
  EXPECT_EQ(out.at(1).text, "x = 1");
}

TEST(LLMEngine, LogprobsOnePerToken) {
  LLMEngine engine(scripted("one two three"), demo_tokenizer(), {});
  EngineRequest r = request("x", 3);
  r.sampling.num_logprobs = 2;
  engine.add_request(1, r);
  const auto out = run(engine);
  ASSERT_EQ(out.at(1).logprobs.size(), 3u);
  EXPECT_EQ(out.at(1).logprobs[0].top.size(), 2u);
  EXPECT_EQ(out.at(1).logprobs[1].token, out.at(1).tokens[1]);
}

TEST(LLMEngine, AbortFreesAndReportsAbort) {
  LLMEngine engine(std::make_unique<testing::FakeBackend>(32, 4), demo_tokenizer(), {});
  engine.add_request(1, fake_request("def f(x):", 20));
  engine.add_request(2, fake_request("import os", 20));
  engine.step();
  EXPECT_GT(engine.stats().kv_cache_usage, 0.0);
  const auto a = engine.abort(1);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->finish, FinishReason::kAbort);
  EXPECT_FALSE(engine.abort(1).has_value());
  EXPECT_FALSE(engine.abort(99).has_value());
  run(engine);
  EXPECT_DOUBLE_EQ(engine.stats().kv_cache_usage, 0.0);
}

TEST(LLMEngine, RejectsRequestsThatCanNeverRun) {
  LLMEngine engine(std::make_unique<testing::FakeBackend>(8, 4), demo_tokenizer(), {});
  EXPECT_EQ(engine.max_model_len(), 32);  // capped by the pool: 8 blocks x 4 tokens
  EXPECT_THROW(engine.add_request(1, fake_request("x", 32)), Error);
  EngineRequest empty;
  EXPECT_THROW(engine.add_request(2, empty), Error);
  EngineRequest bad = fake_request("x", 2);
  bad.prompt = {5000};  // the fake's vocabulary is 1000
  EXPECT_THROW(engine.add_request(3, bad), Error);
  engine.add_request(4, fake_request("x", 2));
  EXPECT_THROW(engine.add_request(4, fake_request("x", 2)), Error);
}

// Through the engine, a tiny pool preempts and still gives every request its unconstrained output.
TEST(LLMEngine, PreemptionKeepsOutputs) {
  auto load = [](LLMEngine& e) {
    for (int id = 0; id < 8; ++id) {
      EngineRequest r = fake_request(
          "def f" + std::to_string(id) + "(x): return x * " + std::to_string(id), 12 + id);
      r.stop.ignore_eos = true;
      e.add_request(id, r);
    }
  };
  LLMEngine roomy(std::make_unique<testing::FakeBackend>(512, 4), demo_tokenizer(), {});
  load(roomy);
  const auto expected = run(roomy);
  LLMEngine tight(std::make_unique<testing::FakeBackend>(14, 4), demo_tokenizer(),
                  {.max_num_seqs = 8, .max_num_batched_tokens = 16});
  load(tight);
  const auto got = run(tight);
  EXPECT_GT(tight.stats().scheduler.num_preemptions, 0u);
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [id, c] : expected) {
    EXPECT_EQ(got.at(id).tokens, c.tokens) << "request " << id;
    EXPECT_EQ(got.at(id).text, c.text) << "request " << id;
  }
  EXPECT_DOUBLE_EQ(tight.stats().kv_cache_usage, 0.0);
}

}  // namespace
}  // namespace relay

// LLMEngine: stop conditions (max_tokens, EOS, ignore_eos, min_tokens, stop tokens, stop strings
// with hold-back), text assembly, logprobs, abort, and preemption through the engine, with backends
// that script their output (so the text is known) or read their KV cache
// (scheduler/fake_backend.h); and drafts, whose accepted tokens go through all of it token by
// token, giving exactly the outputs of a run without drafts.
#include <gtest/gtest.h>

#include <functional>
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

// Drafts for request `id` after its first `num_outputs` tokens (none when unset).
using Proposer = std::function<std::vector<int32_t>(int64_t id, size_t num_outputs)>;

std::map<int64_t, Collected> run(LLMEngine& engine, int max_steps = 10000,
                                 const Proposer& propose = {}, std::vector<int64_t> ids = {}) {
  std::map<int64_t, Collected> all;
  for (int i = 0; i < max_steps && engine.has_work(); ++i) {
    for (int64_t id : ids) {
      if (all[id].finish == FinishReason::kNone) {
        engine.set_drafts(id, propose(id, all[id].tokens.size()));
      }
    }
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

// ---- Drafts -------------------------------------------------------------------------------------

// Drafts of the scripted tokens that follow, `k` at a time, wrong from `right_for` on.
Proposer script_drafts(const std::vector<int32_t>& script, int k, int right_for) {
  return [script, k, right_for](int64_t, size_t num_outputs) {
    std::vector<int32_t> drafts;
    for (int j = 0; j < k; ++j) {
      const int32_t t = script[std::min(num_outputs + j, script.size() - 1)];
      drafts.push_back(j < right_for ? t : (t + 1) % 151936);
    }
    return drafts;
  };
}

// The committed tokens go through the stop checks one at a time: a stop string, an EOS, a stop
// token, min_tokens or max_tokens among the accepted drafts ends the request exactly where it ends
// without drafts, with the same text and logprobs, and the tokens after that are dropped.
TEST(LLMEngineDrafts, AcceptedTokensGoThroughTheStopChecksOneByOne) {
  struct Case {
    std::string text;
    std::vector<int32_t> extra;
    std::function<void(EngineRequest&)> configure;
  };
  const std::vector<int32_t> stop_ids = demo_tokenizer().encode(" gamma");
  const std::vector<Case> cases{
      {"alpha beta STOP gamma delta", {}, [](EngineRequest& r) { r.stop.stop_strings = {"STOP"}; }},
      {"alpha beta STOP gamma delta",
       {},
       [](EngineRequest& r) {
         r.stop.stop_strings = {"STOP"};
         r.stop.include_stop_str_in_output = true;
       }},
      {"hello", {151645, 11, 12, 13}, [](EngineRequest&) {}},
      {"hello", {151645, 151645, 151645, 11}, [](EngineRequest& r) { r.stop.min_tokens = 2; }},
      {"x = 1\n\n\ny = 2", {}, [](EngineRequest& r) { r.stop.stop_strings = {"\n\n"}; }},
      {"one two three four five six", {}, [](EngineRequest& r) { r.stop.max_tokens = 4; }},
      {"alpha beta gamma delta",
       {},
       [&](EngineRequest& r) { r.stop.stop_token_ids = {stop_ids.front()}; }},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    EngineRequest r = request("x", 50);
    r.sampling.num_logprobs = 1;
    c.configure(r);
    LLMEngine plain(scripted(c.text, c.extra), demo_tokenizer(), {});
    plain.add_request(1, r);
    const Collected want = run(plain).at(1);
    std::vector<int32_t> script = demo_tokenizer().encode(c.text);
    script.insert(script.end(), c.extra.begin(), c.extra.end());
    for (const auto& [k, right_for] : std::vector<std::pair<int, int>>{{4, 4}, {3, 1}, {6, 6}}) {
      SCOPED_TRACE(::testing::Message() << "case " << i << ", " << k << " drafts");
      LLMEngine engine(scripted(c.text, c.extra), demo_tokenizer(), {});
      engine.add_request(1, r);
      const Collected got = run(engine, 10000, script_drafts(script, k, right_for), {1}).at(1);
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.text, want.text);
      EXPECT_EQ(got.finish, want.finish);
      EXPECT_EQ(got.num_output_tokens, want.num_output_tokens);
      EXPECT_EQ(got.num_outputs_after_finish, 0);
      ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
      for (size_t j = 0; j < want.logprobs.size(); ++j) {
        EXPECT_EQ(got.logprobs[j].token, want.logprobs[j].token);
        EXPECT_EQ(got.logprobs[j].logprob, want.logprobs[j].logprob);
      }
      // Text held back for a stop string is never released early: no delta holds a cut piece.
      if (!r.stop.stop_strings.empty() && !r.stop.include_stop_str_in_output) {
        for (const std::string& d : got.deltas) EXPECT_EQ(d.find("ST"), std::string::npos) << d;
      }
    }
  }
}

// Drafts make fewer steps; a step of decodes with drafts still counts as decode-only.
TEST(LLMEngineDrafts, RightDraftsTakeFewerSteps) {
  const std::string text = "def add(a, b):\n    return a + b\n";
  const std::vector<int32_t> script = demo_tokenizer().encode(text);
  LLMEngine engine(scripted(text), demo_tokenizer(), {});
  engine.add_request(1, request("x", static_cast<int64_t>(script.size())));
  engine.step();  // the prompt and the first token
  engine.set_drafts(1, std::span(script).subspan(1, 4));
  const std::vector<RequestOutput> out = engine.step();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].new_tokens, std::vector<int32_t>(script.begin() + 1, script.begin() + 6));
  EXPECT_EQ(engine.last_step().num_draft_tokens, 4);
  EXPECT_EQ(engine.last_step().num_tokens, 5);
  EXPECT_TRUE(engine.last_step().decode_only());
  // Drafts past max_tokens are dropped: one step commits the remaining tokens and ends it.
  const size_t left = script.size() - 6;
  std::vector<int32_t> many(script.begin() + 6, script.end());
  many.resize(many.size() + 10, 7);
  engine.set_drafts(1, many);
  const std::vector<RequestOutput> last = engine.step();
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0].new_tokens.size(), left);
  EXPECT_EQ(last[0].finish, FinishReason::kLength);
  EXPECT_EQ(engine.last_step().num_draft_tokens, static_cast<int>(left) - 1);
  EXPECT_FALSE(engine.has_work());
}

// Through a tiny pool that preempts, drafts right, right for a while and wrong keep every output
// of the roomy run without drafts; the fake backend reads its context back from the cache, so a
// rejected draft's K/V read as a committed token would change them.
TEST(LLMEngineDrafts, PreemptionAndRollbackKeepOutputs) {
  auto load = [](LLMEngine& e) {
    for (int id = 0; id < 8; ++id) {
      EngineRequest r = fake_request(
          "def f" + std::to_string(id) + "(x): return x * " + std::to_string(id), 12 + id);
      r.stop.ignore_eos = true;
      r.sampling.temperature = id % 2 == 0 ? 0.0f : 0.9f;
      r.sampling.seed = static_cast<uint64_t>(id);
      e.add_request(id, r);
    }
  };
  LLMEngine roomy(std::make_unique<testing::FakeBackend>(512, 4), demo_tokenizer(), {});
  load(roomy);
  const auto expected = run(roomy);
  const std::vector<int64_t> ids{0, 1, 2, 3, 4, 5, 6, 7};
  const Proposer propose = [&](int64_t id, size_t num_outputs) {
    const std::vector<int32_t>& ref = expected.at(id).tokens;
    std::vector<int32_t> drafts;
    for (size_t j = 0; j < 5 && num_outputs + j < ref.size(); ++j) {
      const bool right = id % 3 == 0 || (id % 3 == 1 && j < 2);
      drafts.push_back(right ? ref[num_outputs + j] : (ref[num_outputs + j] + 1) % 1000);
    }
    return drafts;
  };
  LLMEngine tight(std::make_unique<testing::FakeBackend>(14, 4), demo_tokenizer(),
                  {.max_num_seqs = 8, .max_num_batched_tokens = 16});
  load(tight);
  const auto got = run(tight, 10000, propose, ids);
  EXPECT_GT(tight.stats().scheduler.num_preemptions, 0u);
  for (const auto& [id, c] : expected) {
    EXPECT_EQ(got.at(id).tokens, c.tokens) << "request " << id;
    EXPECT_EQ(got.at(id).text, c.text) << "request " << id;
  }
  EXPECT_DOUBLE_EQ(tight.stats().kv_cache_usage, 0.0);
}

// A backend that does not verify drafts would compute them as committed tokens: the engine refuses
// them, as it refuses drafts for unknown requests or outside the vocabulary.
TEST(LLMEngineDrafts, AreRefusedWhereTheyCannotBeVerified) {
  class NoDrafts : public testing::FakeBackend {
   public:
    using FakeBackend::FakeBackend;
    bool supports_draft_tokens() const override { return false; }
  };
  const std::vector<int32_t> drafts{1, 2};
  LLMEngine engine(std::make_unique<NoDrafts>(32, 4), demo_tokenizer(), {});
  EXPECT_FALSE(engine.supports_draft_tokens());
  engine.add_request(1, fake_request("def f(x):", 8));
  EXPECT_THROW(engine.set_drafts(1, drafts), Error);
  LLMEngine fake(std::make_unique<testing::FakeBackend>(32, 4), demo_tokenizer(), {});
  EXPECT_TRUE(fake.supports_draft_tokens());
  fake.add_request(1, fake_request("def f(x):", 8));
  fake.set_drafts(1, drafts);
  EXPECT_THROW(fake.set_drafts(2, drafts), Error);
  const std::vector<int32_t> outside{1, 1000};
  EXPECT_THROW(fake.set_drafts(1, outside), Error);
}

}  // namespace
}  // namespace relay

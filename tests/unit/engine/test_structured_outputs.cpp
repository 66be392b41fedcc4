// Token constraints through the engine: a grammar's bitmask reaches the backend before every
// sample and follows the sampled tokens; a reasoning model's <think> block is left free and the
// grammar applies after it; logit_bias reaches the sampler; backends without constraints refuse
// them; on the CPU backend a constrained request writes only what its grammar allows; and with
// drafts every verified row gets the mask a step without drafts would have given it, while drafts
// the grammar refuses are dropped when they are set; a disaggregated decode's grammar goes on after
// the first token its prefill worker sampled.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../scheduler/fake_backend.h"
#include "core/error.h"
#include "engine/cpu_backend.h"
#include "engine/llm_engine.h"
#include "engine/sampler.h"
#include "grammar/grammar.h"

namespace relay {
namespace {

const std::string kDemo = RELAY_SOURCE_DIR "/models/relay-demo-moe";
constexpr int32_t kImEnd = 151645;

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(kDemo);
  return t;
}

GrammarCompiler& compiler() {
  static GrammarCompiler c(tokenizer(), GrammarCompilerOptions{151936, {kImEnd}});
  return c;
}

int32_t id_of(const std::string& token) { return *tokenizer().token_to_id(token); }

bool allows(const std::vector<uint32_t>& mask, int32_t token) {
  return (mask.at(static_cast<size_t>(token) / 32) >> (token % 32)) & 1;
}

// Runs the engine until request 1 finishes; its text, finish and the number of steps.
RequestOutput run_one(LLMEngine& engine) {
  RequestOutput all;
  for (int step = 0; step < 1000; ++step) {
    for (RequestOutput& out : engine.step()) {
      all.text += out.text;
      all.new_tokens.insert(all.new_tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
      if (out.finish != FinishReason::kNone) {
        all.finish = out.finish;
        return all;
      }
    }
  }
  ADD_FAILURE() << "request 1 did not finish";
  return all;
}

EngineRequest constrained(const GrammarSpec& spec, int64_t max_tokens = 64) {
  EngineRequest r;
  r.prompt = tokenizer().encode("x");
  r.sampling.temperature = 0.0f;
  r.stop.max_tokens = max_tokens;
  r.grammar = compiler().compile(spec);
  return r;
}

const GrammarSpec kSchema = GrammarSpec::json_schema(
    R"({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": false})",
    true);

TEST(StructuredOutputs, TheGrammarsMaskPrecedesEverySampleAndFollowsTheTokens) {
  std::vector<int32_t> script = tokenizer().encode(R"({"a": 12})");
  script.push_back(kImEnd);
  auto backend = std::make_unique<testing::ScriptedBackend>(script);
  testing::ScriptedBackend& seen = *backend;
  LLMEngine engine(std::move(backend), tokenizer(), {});
  engine.add_request(1, constrained(kSchema));
  const RequestOutput out = run_one(engine);
  EXPECT_EQ(out.text, R"({"a": 12})");
  EXPECT_EQ(out.finish, FinishReason::kStop);
  ASSERT_EQ(seen.masks.size(), script.size());
  // The first token must open the object; once it is complete only the stop token may follow.
  EXPECT_TRUE(allows(seen.masks.front(), script.front()));
  EXPECT_FALSE(allows(seen.masks.front(), tokenizer().encode("hello").front()));
  EXPECT_FALSE(allows(seen.masks.front(), id_of("<think>")));  // no reasoning asked
  const std::vector<uint32_t>& last = seen.masks.back();
  for (int32_t t = 0; t < 151936; ++t) EXPECT_EQ(allows(last, t), t == kImEnd) << t;
}

TEST(StructuredOutputs, AReasoningModelThinksFreelyThenFollowsTheGrammar) {
  const int32_t open = id_of("<think>"), close = id_of("</think>");
  for (const bool starts_inside : {false, true}) {
    std::vector<int32_t> script;
    if (!starts_inside) script.push_back(open);
    for (int32_t t : tokenizer().encode("free text, not JSON")) script.push_back(t);
    script.push_back(close);
    const std::vector<int32_t> answer = tokenizer().encode(R"({"a": 3})");
    script.insert(script.end(), answer.begin(), answer.end());
    script.push_back(kImEnd);
    auto backend = std::make_unique<testing::ScriptedBackend>(script);
    testing::ScriptedBackend& seen = *backend;
    LLMEngine engine(std::move(backend), tokenizer(), {});
    EngineRequest r = constrained(kSchema);
    r.reasoning = {open, close, starts_inside};
    engine.add_request(1, r);
    const RequestOutput out = run_one(engine);
    EXPECT_EQ(out.finish, FinishReason::kStop) << starts_inside;
    ASSERT_EQ(seen.masks.size(), script.size());
    // The think block (and its end) is sampled unconstrained; then the grammar takes over.
    const size_t thinking = script.size() - answer.size() - 1;
    for (size_t i = 0; i < script.size(); ++i) {
      const bool free = i < thinking && (starts_inside || i > 0);
      EXPECT_EQ(seen.masks[i].empty(), free) << "sample " << i << " starts_inside " << starts_inside;
    }
    if (!starts_inside) {
      // Its first token may open the block, or start the answer.
      EXPECT_TRUE(allows(seen.masks.front(), open));
      EXPECT_TRUE(allows(seen.masks.front(), answer.front()));
    }
  }
}

// A row's mask with nothing constrained: no mask, or one allowing every token.
bool unconstrained(const std::vector<uint32_t>& mask) {
  return std::all_of(mask.begin(), mask.end(), [](uint32_t w) { return w == ~0u; });
}

// With drafts of the scripted tokens, k at a time, each verified row gets the mask the same token
// got without drafts, through the reasoning block, its end and the grammar's completion.
TEST(StructuredOutputs, EveryDraftRowGetsTheMaskOfItsPlace) {
  const int32_t open = id_of("<think>"), close = id_of("</think>");
  for (const bool reasoning : {false, true}) {
    std::vector<int32_t> script;
    if (reasoning) {
      script.push_back(open);
      for (int32_t t : tokenizer().encode("free text")) script.push_back(t);
      script.push_back(close);
    }
    for (int32_t t : tokenizer().encode(R"({"a": 123})")) script.push_back(t);
    script.push_back(kImEnd);
    auto run = [&](int k) {
      auto backend = std::make_unique<testing::ScriptedBackend>(script);
      testing::ScriptedBackend& seen = *backend;
      LLMEngine engine(std::move(backend), tokenizer(), {});
      EngineRequest r = constrained(kSchema);
      if (reasoning) r.reasoning = {open, close, false};
      engine.add_request(1, r);
      RequestOutput all;
      for (int step = 0; step < 100 && all.finish == FinishReason::kNone; ++step) {
        if (k > 0 && !all.new_tokens.empty()) {
          const size_t at = all.new_tokens.size();
          engine.set_drafts(1,
                            std::span(script).subspan(at, std::min<size_t>(k, script.size() - at)));
        }
        for (RequestOutput& out : engine.step()) {
          all.text += out.text;
          all.new_tokens.insert(all.new_tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
          all.finish = out.finish;
        }
      }
      return std::pair{all, seen.masks};
    };
    const auto [want, want_masks] = run(0);
    ASSERT_EQ(want.finish, FinishReason::kStop);
    for (int k : {2, 5}) {
      SCOPED_TRACE(::testing::Message() << "reasoning " << reasoning << ", " << k << " drafts");
      const auto [got, got_masks] = run(k);
      EXPECT_EQ(got.text, want.text);
      EXPECT_EQ(got.new_tokens, want.new_tokens);
      // The drafts are right, so rows are sampled in the order of the tokens; the stop token's
      // draft is followed by one more row, whose token the engine drops.
      ASSERT_GE(got_masks.size(), want_masks.size());
      EXPECT_LE(got_masks.size(), want_masks.size() + 1);
      for (size_t i = 0; i < want_masks.size(); ++i) {
        if (unconstrained(want_masks[i])) {
          EXPECT_TRUE(unconstrained(got_masks[i])) << "row " << i;
        } else {
          EXPECT_EQ(got_masks[i], want_masks[i]) << "row " << i;
        }
      }
    }
  }
}

// Drafts from the first one the grammar refuses on are dropped when they are set: the step
// verifies only the ones before it.
TEST(StructuredOutputs, DraftsTheGrammarRefusesAreDropped) {
  std::vector<int32_t> script = tokenizer().encode(R"({"a": 12})");
  script.push_back(kImEnd);
  LLMEngine engine(std::make_unique<testing::ScriptedBackend>(script), tokenizer(), {});
  engine.add_request(1, constrained(kSchema));
  ASSERT_EQ(engine.step().size(), 1u);  // the prompt, then "{"
  const std::vector<int32_t> drafts{script[1], tokenizer().encode("hello").front(), script[2]};
  engine.set_drafts(1, drafts);
  const std::vector<RequestOutput> out = engine.step();
  EXPECT_EQ(engine.last_step().num_draft_tokens, 1);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].new_tokens, (std::vector<int32_t>{script[1], script[2]}));
}

// Disaggregated decode: the prefill worker sampled the first token under the grammar, and the
// decode engine's grammar goes on after it, so each later sample gets the mask a local run gives it
// (and the logit_bias). A first token the grammar refuses is an error that leaves the reservation
// held; a first token that is a stop token completing the grammar finishes the request.
TEST(StructuredOutputs, APrefilledRequestsGrammarGoesOnAfterItsFirstToken) {
  std::vector<int32_t> script = tokenizer().encode(R"({"a": 12})");
  script.push_back(kImEnd);
  auto local = std::make_unique<testing::ScriptedBackend>(script);
  testing::ScriptedBackend& local_seen = *local;
  LLMEngine local_engine(std::move(local), tokenizer(), {});
  local_engine.add_request(1, constrained(kSchema));
  ASSERT_EQ(run_one(local_engine).text, R"({"a": 12})");

  auto backend = std::make_unique<testing::ScriptedBackend>(script);
  testing::ScriptedBackend& seen = *backend;
  LLMEngine engine(std::move(backend), tokenizer(), {});
  EngineRequest r = constrained(kSchema);
  r.logit_bias = {{7, 1.5f}};
  ASSERT_TRUE(engine.reserve_kv(1, r.prompt));
  SampledToken first;
  first.token = script.front();
  const RequestOutput head = engine.add_prefilled_request(1, r, first, 0);
  EXPECT_EQ(head.finish, FinishReason::kNone);
  const RequestOutput rest = run_one(engine);
  EXPECT_EQ(head.text + rest.text, R"({"a": 12})");
  EXPECT_EQ(rest.finish, FinishReason::kStop);
  ASSERT_EQ(seen.masks.size(), script.size() - 1);
  for (size_t i = 0; i < seen.masks.size(); ++i) {
    EXPECT_EQ(seen.masks[i], local_seen.masks[i + 1]) << "sample " << i + 1;
    EXPECT_EQ(seen.biases[i], r.logit_bias) << "sample " << i + 1;
  }

  ASSERT_TRUE(engine.reserve_kv(2, r.prompt));
  first.token = tokenizer().encode("hello").front();
  EXPECT_THROW(engine.add_prefilled_request(2, r, first, 0), Error);
  EXPECT_EQ(engine.num_held_kv(), 1);
  engine.release_kv(2);

  // "(ab)?" is complete before any token: the stop token may come first, and ends the request.
  EngineRequest optional = constrained(GrammarSpec::regex("(ab)?"));
  ASSERT_TRUE(engine.reserve_kv(3, optional.prompt));
  first.token = kImEnd;
  const RequestOutput stopped = engine.add_prefilled_request(3, optional, first, 0);
  EXPECT_EQ(stopped.finish, FinishReason::kStop);
  EXPECT_FALSE(engine.has_work());
}

TEST(StructuredOutputs, LogitBiasReachesTheSampler) {
  auto backend = std::make_unique<testing::ScriptedBackend>(std::vector<int32_t>{5, 6});
  testing::ScriptedBackend& seen = *backend;
  LLMEngine engine(std::move(backend), tokenizer(), {});
  EngineRequest r;
  r.prompt = {1, 2};
  r.stop.max_tokens = 2;
  r.logit_bias = {{7, 50.0f}, {9, -100.0f}};
  engine.add_request(1, r);
  run_one(engine);
  ASSERT_EQ(seen.biases.size(), 2u);
  EXPECT_EQ(seen.biases[0], r.logit_bias);
  EXPECT_TRUE(seen.masks[0].empty());
}

TEST(StructuredOutputs, BackendsWithoutConstraintsRefuseThem) {
  LLMEngine engine(std::make_unique<testing::FakeBackend>(64, 4), tokenizer(), {});
  EngineRequest r;
  r.prompt = {1, 2};
  r.logit_bias = {{7, 1.0f}};
  EXPECT_THROW(engine.add_request(1, r), Error);
  LLMEngine scripted(std::make_unique<testing::ScriptedBackend>(std::vector<int32_t>{5}),
                     tokenizer(), {});
  r.logit_bias = {{151936, 1.0f}};  // outside the vocabulary
  EXPECT_THROW(scripted.add_request(1, r), Error);
}

TEST(StructuredOutputs, TheSamplerAppliesBiasThenMask) {
  std::vector<float> logits = {0.0f, 5.0f, 1.0f, 2.0f};
  std::vector<uint32_t> mask = {0b1101};  // tokens 0, 2, 3
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.num_logprobs = 0;
  const std::vector<std::pair<int32_t, float>> bias = {{0, 10.0f}, {3, -10.0f}};
  std::vector<float> row = logits;
  const SampledToken t = sample_token(row, greedy, {}, {}, 0, {mask, bias});
  EXPECT_EQ(t.token, 0);  // 1 is masked, 0 is raised past 2
  // Logprobs are those of the raw logits (vLLM's default), not of the constrained ones.
  std::vector<float> raw(4);
  log_softmax(logits, raw);
  EXPECT_FLOAT_EQ(t.logprob, raw[0]);
  std::vector<float> none = logits;
  const std::vector<uint32_t> nothing = {0};
  EXPECT_THROW(apply_token_constraints(none, {nothing, {}}), Error);
  const std::vector<std::pair<int32_t, float>> outside = {{4, 1.0f}};
  EXPECT_THROW(apply_token_constraints(none, {{}, outside}), Error);
}

TEST(StructuredOutputs, OnTheCpuBackendTheModelWritesOnlyWhatTheGrammarAllows) {
  CpuBackendOptions o;
  o.num_blocks = 64;
  o.num_threads = 2;
  LLMEngine engine(std::make_unique<CpuBackend>(kDemo, o), tokenizer(), {});
  const std::vector<std::string> choices = {"yes", "no", "maybe later"};
  EngineRequest r = constrained(GrammarSpec::choice(choices));
  r.prompt = tokenizer().encode("def answer():\n    return ");
  engine.add_request(1, r);
  const RequestOutput out = run_one(engine);
  EXPECT_EQ(out.finish, FinishReason::kStop);
  EXPECT_NE(std::find(choices.begin(), choices.end(), out.text), choices.end()) << out.text;
}

}  // namespace
}  // namespace relay

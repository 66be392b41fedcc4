// The hybrid models (Qwen3.5 / Qwen3-Next) served end to end: LLMEngine + the CPU backend on the
// four fixtures of tests/fixtures/models/HYBRID.md, whose four prompts (1, 7, 64 and 70 tokens)
// must decode to transformers' 24 greedy tokens however the engine runs them:
//   - together, with chunked prefill (a budget of 16 tokens cuts the long prompts into chunks that
//     continue the carried recurrent state);
//   - in a KV pool so small that sequences are preempted and recomputed (a fresh state);
//   - with fewer state slots than requests (admission waits for a slot);
//   - with drafts that are right for a while and then wrong (the state after the last accepted
//     draft is restored from its snapshot), and with the n-gram proposer.
// The engine also refuses what a hybrid model cannot do yet: a disaggregated hand-over.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "../error_text.h"
#include "core/error.h"
#include "engine/cpu_backend.h"
#include "engine/llm_engine.h"
#include "fixtures.h"

namespace relay {
namespace {

const std::vector<std::string> kHybridFixtures = {"qwen3_5-moe", "qwen3_5-moe-text", "qwen3-next",
                                                  "qwen3_5-dense"};

// The fixtures carry no tokenizer; the engine detokenizes with the demo model's (every fixture id
// is below its vocabulary), which only the text output depends on.
const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(RELAY_SOURCE_DIR "/models/relay-demo-moe");
  return t;
}

struct RunConfig {
  int num_blocks = 128;  // of 4 tokens
  int num_state_slots = 64;
  int max_num_batched_tokens = 16;
  SpeculativeConfig speculative{};
  // Before each step, give every decoding request drafts from its reference continuation, right
  // for (step % 3) tokens and wrong after that (they take precedence over the proposer's).
  bool forced_drafts = false;
};

struct RunResult {
  std::map<int64_t, std::vector<int32_t>> tokens;
  EngineStats stats;
  uint64_t max_running = 0;
};

RunResult run(const std::string& name, const test::ModelFixture& fx, const RunConfig& rc) {
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = rc.num_blocks;
  o.num_threads = 2;
  o.num_state_slots = rc.num_state_slots;
  EngineConfig c;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = rc.max_num_batched_tokens;
  c.speculative = rc.speculative;
  LLMEngine engine(std::make_unique<CpuBackend>(test::fixture_models_dir() / name, o), tokenizer(),
                   c);
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    EngineRequest r;
    r.prompt = fx.prompts[i];
    r.sampling.temperature = 0.0f;
    r.stop.max_tokens = static_cast<int64_t>(fx.greedy[i].size());
    r.stop.ignore_eos = true;
    engine.add_request(static_cast<int64_t>(i), r);
  }
  RunResult out;
  for (int step = 0; engine.has_work(); ++step) {
    RELAY_CHECK(step < 2000, name, ": the requests did not finish");
    if (rc.forced_drafts) {
      for (const auto& [id, got] : out.tokens) {
        const std::vector<int32_t>& ref = fx.greedy[static_cast<size_t>(id)];
        std::vector<int32_t> drafts;
        for (size_t j = 0; j < 3 && got.size() + j < ref.size(); ++j) {
          const int32_t right = ref[got.size() + j];
          drafts.push_back(j < static_cast<size_t>(step % 3) ? right : (right + 1) % 512);
        }
        if (got.size() < ref.size()) engine.set_drafts(id, drafts);
      }
    }
    for (const RequestOutput& r : engine.step()) {
      auto& t = out.tokens[r.id];
      t.insert(t.end(), r.new_tokens.begin(), r.new_tokens.end());
    }
    out.max_running = std::max<uint64_t>(out.max_running, engine.stats().num_running);
  }
  out.stats = engine.stats();
  return out;
}

class HybridEngine : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    fx_ = test::ModelFixture::load(test::fixture_models_dir() / GetParam(),
                                   test::fixture_models_dir() / GetParam());
  }
  void expect_greedy(const RunResult& r) {
    ASSERT_EQ(r.tokens.size(), fx_.prompts.size());
    for (size_t i = 0; i < fx_.prompts.size(); ++i) {
      EXPECT_EQ(r.tokens.at(static_cast<int64_t>(i)), fx_.greedy[i]) << "prompt " << i;
    }
    EXPECT_EQ(r.stats.state_slot_usage, 0.0);  // every slot back
    EXPECT_EQ(r.stats.kv_cache_usage, 0.0);
  }
  test::ModelFixture fx_;
};

TEST_P(HybridEngine, ChunkedContinuousBatchingGivesTheReferenceTokens) {
  const RunResult r = run(GetParam(), fx_, {});
  expect_greedy(r);
  EXPECT_EQ(r.max_running, 4u);
  EXPECT_EQ(r.stats.scheduler.prefix_cache_hits, 0u);
}

TEST_P(HybridEngine, PreemptionRestartsTheStateFresh) {
  // 24 blocks of 4 tokens: the 70-token prompt and its 24 tokens take all of them.
  const RunResult r = run(GetParam(), fx_, {.num_blocks = 24, .max_num_batched_tokens = 64});
  expect_greedy(r);
  EXPECT_GT(r.stats.scheduler.num_preemptions, 0u);
}

TEST_P(HybridEngine, FewerStateSlotsThanRequestsMakeThemWait) {
  const RunResult r = run(GetParam(), fx_, {.num_state_slots = 2});
  expect_greedy(r);
  EXPECT_EQ(r.max_running, 2u);
}

TEST_P(HybridEngine, RejectedDraftsLeaveNoTraceInTheState) {
  // 3 drafts per decode: each sequence holds 4 slots (its state and 3 snapshots).
  SpeculativeConfig spec;
  spec.method = SpeculativeConfig::Method::kNgram;
  spec.num_speculative_tokens = 3;
  spec.prompt_lookup_min = 1;
  spec.prompt_lookup_max = 2;
  RunConfig rc{.num_state_slots = 16, .speculative = spec, .forced_drafts = true};
  const RunResult forced = run(GetParam(), fx_, rc);
  expect_greedy(forced);
  EXPECT_GT(forced.stats.spec_decode.num_accepted_tokens, 0u);
  EXPECT_LT(forced.stats.spec_decode.num_accepted_tokens,
            forced.stats.spec_decode.num_draft_tokens);
  rc.forced_drafts = false;  // the n-gram proposer's own drafts
  expect_greedy(run(GetParam(), fx_, rc));
}

TEST_P(HybridEngine, AHandOverIsRefused) {
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = 32;
  o.num_threads = 1;
  LLMEngine engine(std::make_unique<CpuBackend>(test::fixture_models_dir() / GetParam(), o),
                   tokenizer(), {});
  EXPECT_GT(engine.backend().num_state_slots(), 0);
  EXPECT_NE(test::error_text([&] { engine.reserve_kv(1, fx_.prompts[1]); }).find("recurrent layers"),
            std::string::npos);
  EngineRequest r;
  r.prompt = fx_.prompts[1];
  r.hold_kv = true;
  EXPECT_NE(test::error_text([&] { engine.add_request(2, r); }).find("recurrent layers"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HybridEngine, ::testing::ValuesIn(kHybridFixtures),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace relay

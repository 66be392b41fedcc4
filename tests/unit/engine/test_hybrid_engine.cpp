// The hybrid models (Qwen3.5 / Qwen3-Next) served end to end: LLMEngine + the CPU backend on the
// four fixtures of tests/fixtures/models/HYBRID.md, whose four prompts (1, 7, 64 and 70 tokens)
// must decode to transformers' 24 greedy tokens however the engine runs them:
//   - together, with chunked prefill (a budget of 16 tokens cuts the long prompts into chunks that
//     continue the carried recurrent state);
//   - in a KV pool so small that sequences are preempted and recomputed (a fresh state);
//   - with fewer state slots than requests (admission waits for a slot);
//   - with drafts that are right for a while and then wrong (the state after the last accepted
//     draft is restored from its snapshot), and with the n-gram proposer.
// Prefix caching (recurrent-state snapshots at block boundaries): a snapshot restored into another
// sequence's slot gives the logits of a prefill from position 0 bit for bit, and requests sharing
// prefixes that diverge mid-block, prefilled in odd chunk sizes, preempted and resumed, get the
// tokens and logprobs of the same requests without prefix caching, with the hits they should get.
// The engine also refuses what a hybrid model cannot do yet: a disaggregated hand-over.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
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

// The CPU backend's options for a fixture: blocks of 4 tokens, two threads.
CpuBackendOptions fixture_options(int num_blocks, int num_state_slots, int num_state_snapshots) {
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = num_blocks;
  o.num_threads = 2;
  o.num_state_slots = num_state_slots;
  o.num_state_snapshots = num_state_snapshots;
  return o;
}

// An engine over fixture `name` on the CPU backend with options `o`.
std::unique_ptr<LLMEngine> make_engine(const std::string& name, const CpuBackendOptions& o,
                                       const EngineConfig& c) {
  return std::make_unique<LLMEngine>(
      std::make_unique<CpuBackend>(test::fixture_models_dir() / name, o), tokenizer(), c);
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
  EngineConfig c;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = rc.max_num_batched_tokens;
  c.speculative = rc.speculative;
  const std::unique_ptr<LLMEngine> owned =
      make_engine(name, fixture_options(rc.num_blocks, rc.num_state_slots, 0), c);
  LLMEngine& engine = *owned;
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

// The backend's restore and save: the state after 8 and after 28 tokens of one sequence, saved
// while it computes 30, restored into another slot over the first sequence's KV blocks, gives the
// logits of the rest of the prompt exactly as one prefill of all of it.
TEST_P(HybridEngine, ARestoredSnapshotGivesTheLogitsOfAFullPrefill) {
  CpuBackend backend(test::fixture_models_dir() / GetParam(), fixture_options(64, 3, 2));
  EXPECT_EQ(backend.num_state_snapshots(), 2);
  const size_t vocab = static_cast<size_t>(backend.config().vocab_size);
  const std::span<const int32_t> prompt = fx_.prompts[3];
  ASSERT_EQ(prompt.size(), 70u);
  auto blocks = [](int32_t first, int n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    std::iota(t.begin(), t.end(), first);
    return t;
  };
  const std::vector<int32_t> slots = {0, 1, 2};
  const std::vector<int32_t> whole_blocks = blocks(0, 18);
  StepSequence whole;
  whole.seq_id = 1;
  whole.tokens = prompt;
  whole.block_table = whole_blocks;
  whole.state_slots = std::span(slots).subspan(0, 1);
  const std::vector<float> want =
      backend.forward_logits(std::span(&whole, 1), CpuBackend::LogitRows::kAllTokens);

  const std::vector<int32_t> first_blocks = blocks(18, 8);
  const std::vector<SnapshotSave> saves = {{7, 0}, {27, 1}};
  StepSequence first;
  first.seq_id = 2;
  first.tokens = prompt.first(30);
  first.block_table = first_blocks;
  first.state_slots = std::span(slots).subspan(1, 1);
  first.save_state_snapshots = saves;
  backend.forward_logits(std::span(&first, 1), CpuBackend::LogitRows::kLastTokens);

  for (const auto& [snapshot, cached] : std::vector<std::pair<int32_t, int>>{{1, 28}, {0, 8}}) {
    SCOPED_TRACE(::testing::Message() << "restored after " << cached << " tokens");
    std::vector<int32_t> table(first_blocks.begin(), first_blocks.begin() + cached / 4);
    const std::vector<int32_t> own = blocks(26, 18 - cached / 4);
    table.insert(table.end(), own.begin(), own.end());
    StepSequence rest;
    rest.seq_id = 3;
    rest.tokens = prompt.subspan(static_cast<size_t>(cached));
    rest.num_computed = cached;
    rest.block_table = table;
    rest.state_slots = std::span(slots).subspan(2, 1);
    rest.restore_state_snapshot = snapshot;
    const std::vector<float> got =
        backend.forward_logits(std::span(&rest, 1), CpuBackend::LogitRows::kAllTokens);
    ASSERT_EQ(got.size(), (prompt.size() - static_cast<size_t>(cached)) * vocab);
    size_t mismatches = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      mismatches += got[i] != want[static_cast<size_t>(cached) * vocab + i];
    }
    EXPECT_EQ(mismatches, 0u);
  }
}

// Requests sharing prefixes of the 70-token prompt P: P itself, P's first 30 tokens then others
// (diverging mid-block), its first 45 then others, P again, and its first 30 then yet others.
struct PrefixLoad {
  std::vector<std::vector<int32_t>> prompts;
  static PrefixLoad of(const test::ModelFixture& fx) {
    const std::vector<int32_t>& p = fx.prompts[3];
    const std::vector<int32_t>& q = fx.prompts[2];
    auto join = [&](size_t shared, size_t from, size_t n) {
      std::vector<int32_t> out(p.begin(), p.begin() + static_cast<ptrdiff_t>(shared));
      out.insert(out.end(), q.begin() + static_cast<ptrdiff_t>(from),
                 q.begin() + static_cast<ptrdiff_t>(from + n));
      return out;
    };
    return {{p, join(30, 0, 20), join(45, 3, 9), p, join(30, 5, 20)}};
  }
};

struct PrefixRunConfig {
  bool prefix_caching = true;
  bool one_at_a_time = true;  // each request runs to the end before the next arrives
  int num_blocks = 128;       // of 4 tokens
  int num_state_snapshots = 32;
  int max_num_batched_tokens = 7;
};

struct PrefixRunResult {
  std::map<int64_t, std::vector<TokenLogprob>> tokens;  // the sampled tokens with their logprobs
  std::map<int64_t, int> num_cached;
  EngineStats stats;
};

PrefixRunResult run_prefix_load(const std::string& name, const PrefixLoad& load,
                                const PrefixRunConfig& rc) {
  EngineConfig c;
  c.max_num_seqs = 5;
  c.max_num_batched_tokens = rc.max_num_batched_tokens;
  c.enable_prefix_caching = rc.prefix_caching;
  const std::unique_ptr<LLMEngine> owned = make_engine(
      name, fixture_options(rc.num_blocks, 8, rc.prefix_caching ? rc.num_state_snapshots : 0), c);
  LLMEngine& engine = *owned;
  PrefixRunResult out;
  auto drain = [&] {
    for (int step = 0; engine.has_work(); ++step) {
      RELAY_CHECK(step < 4000, name, ": the requests did not finish");
      for (RequestOutput& r : engine.step()) {
        auto& t = out.tokens[r.id];
        t.insert(t.end(), r.logprobs.begin(), r.logprobs.end());
        if (r.finish != FinishReason::kNone) out.num_cached[r.id] = r.num_cached_tokens;
      }
    }
  };
  for (size_t i = 0; i < load.prompts.size(); ++i) {
    EngineRequest r;
    r.prompt = load.prompts[i];
    r.sampling.temperature = 0.0f;
    r.sampling.num_logprobs = 3;
    r.stop.max_tokens = 9;
    r.stop.ignore_eos = true;
    engine.add_request(static_cast<int64_t>(i), r);
    if (rc.one_at_a_time) drain();
  }
  drain();
  out.stats = engine.stats();
  EXPECT_EQ(out.stats.kv_cache_usage, 0.0);
  EXPECT_EQ(out.stats.state_slot_usage, 0.0);
  return out;
}

// Bit for bit: the same tokens, logprobs and top logprobs.
void expect_same_outputs(const PrefixRunResult& got, const PrefixRunResult& want) {
  ASSERT_EQ(got.tokens.size(), want.tokens.size());
  for (const auto& [id, tokens] : want.tokens) {
    const std::vector<TokenLogprob>& g = got.tokens.at(id);
    ASSERT_EQ(g.size(), tokens.size()) << "request " << id;
    for (size_t j = 0; j < g.size(); ++j) {
      EXPECT_EQ(g[j].token, tokens[j].token) << "request " << id << " token " << j;
      EXPECT_EQ(g[j].logprob, tokens[j].logprob) << "request " << id << " token " << j;
      EXPECT_EQ(g[j].top, tokens[j].top) << "request " << id << " token " << j;
    }
  }
}

TEST_P(HybridEngine, PrefixHitsGiveTheTokensAndLogprobsOfNoCaching) {
  const PrefixLoad load = PrefixLoad::of(fx_);
  const PrefixRunResult off = run_prefix_load(GetParam(), load, {.prefix_caching = false});
  EXPECT_EQ(off.stats.scheduler.prefix_cache_hits, 0u);
  // Chunks of 7 end on the boundaries 4, 12, 20, 28, ...: the second request hits the first 28
  // tokens of the 30 it shares. Chunks of 13 end after 12, 24, 36, ...: it hits 24 and leaves a
  // snapshot at 28 (the end of the cached KV it shares), which the last request then hits.
  for (int budget : {7, 13}) {
    SCOPED_TRACE(::testing::Message() << "chunks of " << budget);
    const PrefixRunResult on =
        run_prefix_load(GetParam(), load, {.max_num_batched_tokens = budget});
    expect_same_outputs(on, off);
    EXPECT_EQ(on.num_cached.at(0), 0);
    EXPECT_EQ(on.num_cached.at(1), budget == 7 ? 28 : 24);
    EXPECT_GE(on.num_cached.at(2), 28);
    EXPECT_EQ(on.num_cached.at(3), 68);  // P's last boundary before its last token
    EXPECT_EQ(on.num_cached.at(4), 28);
    EXPECT_GT(on.stats.num_cached_state_snapshots, 0);
    uint64_t hits = 0;
    for (const auto& [id, n] : on.num_cached) hits += static_cast<uint64_t>(n);
    EXPECT_EQ(on.stats.scheduler.prefix_cache_hits, hits);
  }
}

// Decodes that verify drafts snapshot the block boundaries they accept: a request whose prompt is
// an earlier one's prompt and output hits into that output, as far as its last boundary, and gets
// the tokens and logprobs it gets without the cache.
TEST_P(HybridEngine, DecodesWithDraftsSnapshotTheBoundariesTheyAccept) {
  const std::vector<int32_t>& p = fx_.prompts[2];  // 64 tokens, then 24 greedy ones
  const std::vector<int32_t>& out = fx_.greedy[2];
  std::vector<int32_t> second = p;
  second.insert(second.end(), out.begin(), out.end());
  second.push_back(out.front());  // a token after it: the output's last block stays whole
  auto run_both = [&](bool caching) {
    EngineConfig c;
    c.max_num_seqs = 2;
    c.max_num_batched_tokens = 32;
    c.enable_prefix_caching = caching;
    c.speculative.method = SpeculativeConfig::Method::kNgram;
    c.speculative.num_speculative_tokens = 3;
    const std::unique_ptr<LLMEngine> owned =
        make_engine(GetParam(), fixture_options(128, 2 * 4, caching ? 32 : 0), c);
    LLMEngine& engine = *owned;
    PrefixRunResult res;
    for (int64_t id : {0, 1}) {
      EngineRequest r;
      r.prompt = id == 0 ? p : second;
      r.sampling.temperature = 0.0f;
      r.sampling.num_logprobs = 3;
      r.stop.max_tokens = id == 0 ? static_cast<int64_t>(out.size()) : 6;
      r.stop.ignore_eos = true;
      engine.add_request(id, r);
      std::vector<int32_t> got;
      for (int step = 0; engine.has_work(); ++step) {
        RELAY_CHECK(step < 400, "the request did not finish");
        // The first request decodes with three right drafts every step (its reference output).
        if (id == 0 && !got.empty() && got.size() < out.size()) {
          const size_t n = std::min<size_t>(3, out.size() - got.size());
          engine.set_drafts(0, std::span(out).subspan(got.size(), n));
        }
        for (RequestOutput& o : engine.step()) {
          got.insert(got.end(), o.new_tokens.begin(), o.new_tokens.end());
          auto& t = res.tokens[o.id];
          t.insert(t.end(), o.logprobs.begin(), o.logprobs.end());
          if (o.finish != FinishReason::kNone) res.num_cached[o.id] = o.num_cached_tokens;
        }
      }
      if (id == 0) EXPECT_EQ(got, out);
    }
    res.stats = engine.stats();
    return res;
  };
  const PrefixRunResult off = run_both(false), on = run_both(true);
  expect_same_outputs(on, off);
  EXPECT_GT(on.stats.spec_decode.num_accepted_tokens, 0u);
  // 64 + 24 tokens, of which 87 have K/V (the last sampled token's is never computed): the
  // output's boundaries 68 ... 84 were all decoded with drafts, and the hit reaches 84 (without
  // snapshots at drafted boundaries it would stop at the prompt's 64).
  EXPECT_EQ(on.num_cached.at(1), 84);
}

TEST_P(HybridEngine, PrefixHitsThroughPreemptionAndFewSnapshotsKeepTheOutputs) {
  const PrefixLoad load = PrefixLoad::of(fx_);
  const PrefixRunResult off = run_prefix_load(GetParam(), load, {.prefix_caching = false});
  // All at once in 24 blocks (the 70-token prompt and its 9 tokens take 20): sequences are
  // preempted and resume from a snapshot of their own prefix or another's.
  const PrefixRunResult squeezed = run_prefix_load(
      GetParam(), load, {.one_at_a_time = false, .num_blocks = 24, .max_num_batched_tokens = 11});
  expect_same_outputs(squeezed, off);
  EXPECT_GT(squeezed.stats.scheduler.num_preemptions, 0u);
  EXPECT_GT(squeezed.stats.scheduler.prefix_cache_hits, 0u);
  // Two snapshots for everything: most are evicted before use, the outputs never change.
  const PrefixRunResult few = run_prefix_load(GetParam(), load, {.num_state_snapshots = 2});
  expect_same_outputs(few, off);
  EXPECT_LE(few.stats.num_cached_state_snapshots, 2);
}

// A disaggregated hand-over holds the state slots with the KV (engine/test_disagg_engine.cpp moves
// them): a prefill's hold_kv request keeps its slot past its end, a decode's reservation takes one
// (and no prefix hit), and release_kv returns both.
TEST_P(HybridEngine, AHandOverHoldsStateSlotsWithTheBlocks) {
  const std::unique_ptr<LLMEngine> owned =
      make_engine(GetParam(), fixture_options(32, CpuBackendOptions{}.num_state_slots, 0), {});
  LLMEngine& engine = *owned;
  EXPECT_GT(engine.backend().num_state_slots(), 0);
  EngineRequest r;
  r.prompt = fx_.prompts[1];
  r.stop.max_tokens = 1;
  r.hold_kv = true;
  engine.add_request(2, r);
  RequestOutput done;
  while (engine.has_work()) {
    for (RequestOutput& o : engine.step()) done = o;
  }
  ASSERT_FALSE(done.kv_blocks.empty());
  EXPECT_GE(done.state_slot, 0);
  EXPECT_GT(engine.stats().state_slot_usage, 0.0);  // held past the request's end
  const auto reserved = engine.reserve_kv(1, fx_.prompts[1]);
  ASSERT_TRUE(reserved.has_value());
  EXPECT_GE(reserved->state_slot, 0);
  EXPECT_NE(reserved->state_slot, done.state_slot);
  EXPECT_EQ(reserved->num_cached_tokens, 0);  // the state after the whole prompt comes with it
  engine.release_kv(1);
  engine.release_kv(2);
  EXPECT_EQ(engine.stats().state_slot_usage, 0.0);
  EXPECT_EQ(engine.stats().kv_cache_usage, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HybridEngine, ::testing::ValuesIn(kHybridFixtures),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace relay

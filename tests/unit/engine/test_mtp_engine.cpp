// MTP speculative decoding end to end in the engine (issue 26): LLMEngine + the CPU backend with
// an MTP head (CpuBackendOptions::mtp) on three heads — the checkpoint's own mtp.* of the Qwen3.5
// MoE and dense fixtures, and the random head in qwen3-moe-mtp/ for the Qwen3-MoE fixture, which
// ships none ("model": DIR). Every head is random, so acceptance is near zero: the runs test that
// speculation never changes the output, whatever the drafts.
//
// Checked: greedy output with K = 1, 2, 3 is the output without speculation (and transformers'
// greedy tokens) with chunked prefill (a budget of 16 tokens), in a pool small enough to preempt,
// and with drafts given from outside between the head's (so the head catches up over accepted
// drafts); seeded sampling gives the same tokens as without; the first drafts verified after each
// prompt are the oracle's chained greedy drafts (mtp_expected.json); the spec-decode counters
// equal what the steps verified and accepted; after a step that accepted drafts the head proposes
// what it proposes from a cold start over the same tokens; a prefix hit (Qwen3-MoE, and the
// hybrids restoring a recurrent-state snapshot) leaves every proposal as without the hit; two TP
// ranks draft like one. The
// configurations the engine and backend cannot run are refused with errors naming what is wrong.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../error_text.h"
#include "core/error.h"
#include "engine/cpu_backend.h"
#include "engine/llm_engine.h"
#include "fixtures.h"

namespace relay {
namespace {

struct Head {
  std::string name;
  std::string target;
  std::string head_dir;  // empty: the checkpoint's own mtp.*

  std::filesystem::path target_path() const { return test::fixture_models_dir() / target; }
  std::string head_path() const {
    return head_dir.empty() ? "" : (test::fixture_models_dir() / head_dir).string();
  }
  std::filesystem::path expected_dir() const {
    return test::fixture_models_dir() / (head_dir.empty() ? target : head_dir);
  }
};

void PrintTo(const Head& h, std::ostream* os) { *os << h.name; }

const std::vector<Head> kHeads = {{"qwen3_5_moe", "qwen3_5-moe", ""},
                                  {"qwen3_5_dense", "qwen3_5-dense", ""},
                                  {"qwen3_moe_separate_head", "qwen3-moe", "qwen3-moe-mtp"}};

// The fixtures carry no tokenizer; the engine detokenizes with the demo model's (every fixture id
// is below its vocabulary), which only the text output depends on.
const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(RELAY_SOURCE_DIR "/models/relay-demo-moe");
  return t;
}

// The oracle's greedy drafts after each prompt (mtp_expected.json: 4 per prompt).
std::vector<std::vector<int32_t>> oracle_drafts(const Head& h) {
  std::ifstream in(h.expected_dir() / "mtp_expected.json");
  return nlohmann::json::parse(in).at("drafts").get<std::vector<std::vector<int32_t>>>();
}

SpeculativeConfig mtp_config(const Head& h, int k) {
  SpeculativeConfig c;
  c.method = SpeculativeConfig::Method::kMtp;
  c.num_speculative_tokens = k;
  c.model = h.head_path();
  return c;
}

// A CPU backend that records what each step verified and what the head proposed, per request.
class Recorder : public Backend {
 public:
  struct Verified {
    size_t num_outputs = 0;  // the request's outputs before the step
    std::vector<int32_t> drafts;
  };

  explicit Recorder(std::unique_ptr<CpuBackend> b) : b_(std::move(b)) {}
  const ModelConfig& config() const override { return b_->config(); }
  int block_size() const override { return b_->block_size(); }
  int num_kv_blocks() const override { return b_->num_kv_blocks(); }
  int num_state_slots() const override { return b_->num_state_slots(); }
  int num_state_snapshots() const override { return b_->num_state_snapshots(); }
  bool supports_draft_tokens() const override { return true; }
  int num_proposed_drafts() const override { return b_->num_proposed_drafts(); }
  std::vector<SampledToken> step(std::span<const StepSequence> batch) override {
    for (const StepSequence& s : batch) {
      if (s.num_draft_tokens == 0) continue;
      const auto d = s.tokens.last(static_cast<size_t>(s.num_draft_tokens));
      verified[s.seq_id].push_back({s.output_tokens.size(), {d.begin(), d.end()}});
    }
    std::vector<SampledToken> out = b_->step(batch);
    for (const StepSequence& s : batch) {
      if (s.proposed_drafts == nullptr) continue;
      proposed[s.seq_id].push_back(*s.proposed_drafts);
      // The head stops its chain at the engine's cap instead of computing rows nobody verifies.
      EXPECT_LE(s.proposed_drafts->size(), static_cast<size_t>(s.max_proposed_drafts));
      if (s.max_proposed_drafts < b_->num_proposed_drafts()) ++num_capped;
    }
    return out;
  }

  std::map<int64_t, std::vector<Verified>> verified;
  std::map<int64_t, std::vector<std::vector<int32_t>>> proposed;
  int num_capped = 0;  // proposals asked for fewer than K drafts

 private:
  std::unique_ptr<CpuBackend> b_;
};

struct RunConfig {
  int k = 0;             // 0: no speculation
  int num_blocks = 160;  // of 4 tokens
  int max_num_batched_tokens = 16;
  float temperature = 0.0f;
  // Before every other step, give each decoding request drafts from its reference continuation,
  // right for (step % 3) tokens and wrong after that (they replace the head's for that step).
  bool forced_drafts = false;
  parallel::ParallelConfig parallel{};
  bool enable_prefix_caching = true;
  int num_state_snapshots = 0;  // hybrid models: their prefix hits need some
  // Requests run in waves: wave w is added once wave w - 1 is done (prefix hits on a clean pool).
  std::vector<std::vector<std::vector<int32_t>>> waves;
  std::vector<std::vector<int32_t>> reference;  // for forced_drafts: each request's output
  int64_t max_tokens = 0;                       // 0: the reference's length
  double min_draft_acceptance = 0.0;
};

struct RunResult {
  std::map<int64_t, std::vector<int32_t>> tokens;
  EngineStats stats;
  std::map<int64_t, std::vector<Recorder::Verified>> verified;
  std::map<int64_t, std::vector<std::vector<int32_t>>> proposed;
  int num_capped = 0;
};

RunResult run(const Head& h, const RunConfig& rc) {
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = rc.num_blocks;
  o.num_threads = 2;
  o.parallel = rc.parallel;
  o.num_state_slots = 8 * (1 + rc.k);
  o.num_state_snapshots = rc.num_state_snapshots;
  EngineConfig c;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = rc.max_num_batched_tokens;
  c.enable_prefix_caching = rc.enable_prefix_caching;
  if (rc.k > 0) {
    c.speculative = mtp_config(h, rc.k);
    c.speculative.min_draft_acceptance = rc.min_draft_acceptance;
    o.mtp = {.enabled = true, .dir = c.speculative.model};
    o.num_mtp_drafts = rc.k;
  }
  auto recorder = std::make_unique<Recorder>(std::make_unique<CpuBackend>(h.target_path(), o));
  Recorder& rec = *recorder;
  LLMEngine engine(std::move(recorder), tokenizer(), c);
  RunResult out;
  int64_t id = 0;
  int step = 0;
  for (const auto& wave : rc.waves) {
    for (const std::vector<int32_t>& prompt : wave) {
      EngineRequest r;
      r.prompt = prompt;
      r.sampling.temperature = rc.temperature;
      r.sampling.seed = 100 + static_cast<uint64_t>(id);
      r.stop.max_tokens =
          rc.max_tokens > 0 ? rc.max_tokens : static_cast<int64_t>(rc.reference.at(id).size());
      r.stop.ignore_eos = true;
      engine.add_request(id++, r);
    }
    for (; engine.has_work(); ++step) {
      RELAY_CHECK(step < 3000, h.name, ": the requests did not finish");
      if (rc.forced_drafts && step % 2 == 0) {
        for (const auto& [rid, got] : out.tokens) {
          const std::vector<int32_t>& ref = rc.reference.at(static_cast<size_t>(rid));
          if (got.empty() || got.size() >= ref.size()) continue;
          std::vector<int32_t> drafts;
          for (size_t j = 0; j < 3 && got.size() + j < ref.size(); ++j) {
            const int32_t right = ref[got.size() + j];
            drafts.push_back(j < static_cast<size_t>(step % 3) ? right : (right + 1) % 512);
          }
          engine.set_drafts(rid, drafts);
        }
      }
      for (const RequestOutput& r : engine.step()) {
        auto& t = out.tokens[r.id];
        t.insert(t.end(), r.new_tokens.begin(), r.new_tokens.end());
      }
    }
  }
  out.stats = engine.stats();
  out.verified = rec.verified;
  out.proposed = rec.proposed;
  out.num_capped = rec.num_capped;
  return out;
}

class MtpEngine : public ::testing::TestWithParam<Head> {
 protected:
  void SetUp() override {
    fx_ = test::ModelFixture::load(GetParam().target_path(), GetParam().target_path());
    drafts_ = oracle_drafts(GetParam());
  }
  RunConfig config(int k) const {
    RunConfig rc;
    rc.k = k;
    rc.waves = {fx_.prompts};
    rc.reference = fx_.greedy;
    return rc;
  }
  void expect_greedy(const RunResult& r, const std::string& what) const {
    ASSERT_EQ(r.tokens.size(), fx_.prompts.size()) << what;
    for (size_t i = 0; i < fx_.prompts.size(); ++i) {
      EXPECT_EQ(r.tokens.at(static_cast<int64_t>(i)), fx_.greedy[i]) << what << ", prompt " << i;
    }
    EXPECT_EQ(r.stats.kv_cache_usage, 0.0) << what;
    EXPECT_EQ(r.stats.state_slot_usage, 0.0) << what;
  }
  // The spec-decode counters against what the recorder saw the steps verify: every verified step
  // counts once, with its drafts, and a draft is accepted while it equals the output there.
  static void expect_counters(const RunResult& r, int k, const std::string& what) {
    uint64_t num_drafts = 0, num_draft_tokens = 0, num_accepted = 0;
    std::vector<uint64_t> per_pos(static_cast<size_t>(k), 0);
    for (const auto& [id, steps] : r.verified) {
      const std::vector<int32_t>& out = r.tokens.at(id);
      for (const Recorder::Verified& v : steps) {
        ++num_drafts;
        num_draft_tokens += v.drafts.size();
        // drafts[j] guesses output num_outputs + j (the step's first row is output num_outputs -
        // 1).
        for (size_t j = 0; j < v.drafts.size() && v.num_outputs + j < out.size() &&
                           v.drafts[j] == out[v.num_outputs + j];
             ++j) {
          ++num_accepted;
          ++per_pos.at(j);
        }
      }
    }
    const SpecDecodeStats& s = r.stats.spec_decode;
    EXPECT_GT(s.num_drafts, 0u) << what;
    EXPECT_EQ(s.num_drafts, num_drafts) << what;
    EXPECT_EQ(s.num_draft_tokens, num_draft_tokens) << what;
    EXPECT_EQ(s.num_accepted_tokens, num_accepted) << what;
    EXPECT_EQ(s.num_accepted_tokens_per_pos, per_pos) << what;
    EXPECT_LE(s.num_draft_tokens, s.num_drafts * static_cast<uint64_t>(k)) << what;
  }

  test::ModelFixture fx_;
  std::vector<std::vector<int32_t>> drafts_;
};

TEST_P(MtpEngine, GreedyOutputIsTheOutputWithoutSpeculation) {
  const RunResult plain = run(GetParam(), config(0));
  expect_greedy(plain, "without speculation");
  EXPECT_EQ(plain.stats.spec_decode.num_drafts, 0u);
  for (int k = 1; k <= 3; ++k) {
    const std::string what = str("K=", k);
    const RunResult r = run(GetParam(), config(k));
    expect_greedy(r, what);
    EXPECT_EQ(r.tokens, plain.tokens) << what;
    expect_counters(r, k, what);
    // The first step after each prompt verifies the oracle's chained drafts.
    for (size_t i = 0; i < fx_.prompts.size(); ++i) {
      const auto& v = r.verified.at(static_cast<int64_t>(i));
      ASSERT_FALSE(v.empty()) << what << ", prompt " << i;
      EXPECT_EQ(v.front().num_outputs, 1u) << what << ", prompt " << i;
      EXPECT_EQ(v.front().drafts, std::vector<int32_t>(drafts_[i].begin(), drafts_[i].begin() + k))
          << what << ", prompt " << i;
    }
    // Chunked prefill changes no proposal: the head's K/V of a chunk's last row pairs it with the
    // next chunk's first token, as in one chunk.
    RunConfig whole = config(k);
    whole.max_num_batched_tokens = 512;
    EXPECT_EQ(run(GetParam(), whole).proposed, r.proposed) << what;
  }
}

// A random head's drafts are almost never accepted: with min_draft_acceptance each request drafts
// K at first, then stops (probing with one draft now and then), and the output stays the same.
TEST_P(MtpEngine, PoorAcceptanceStopsARequestsDraftsLosslessly) {
  const RunResult always = run(GetParam(), config(3));
  RunConfig rc = config(3);
  rc.min_draft_acceptance = 0.3;
  const RunResult adaptive = run(GetParam(), rc);
  expect_greedy(adaptive, "adaptive");
  EXPECT_EQ(adaptive.tokens, always.tokens);
  expect_counters(adaptive, 3, "adaptive");
  const SpecDecodeStats& a = adaptive.stats.spec_decode;
  const SpecDecodeStats& b = always.stats.spec_decode;
  ASSERT_LT(b.acceptance_rate(), 0.2);
  EXPECT_LT(a.num_draft_tokens * 3, b.num_draft_tokens);
  // The head proposed fewer (the recorder checks that it proposed at most the cap).
  EXPECT_GT(adaptive.num_capped, 0);
  for (const auto& [id, steps] : adaptive.verified) {
    EXPECT_EQ(steps.front().drafts.size(), 3u) << "request " << id;  // optimistic at first
  }
}

// The same under DP attention (two ranks, each drafting for its own requests and capping their
// chains) and, where the model has experts, EP: every rank still runs K head forwards, idle ones
// where its chains stopped early, so the head's MoE exchanges pair up.
TEST_P(MtpEngine, PoorAcceptanceUnderDpAndEpStaysLossless) {
  RunConfig rc = config(3);
  rc.min_draft_acceptance = 0.3;
  const bool moe = GetParam().name != "qwen3_5_dense";
  rc.parallel =
      moe ? parallel::ParallelConfig{.ep = 2, .dp = 2} : parallel::ParallelConfig{.dp = 2};
  const std::string what = rc.parallel.describe();
  const RunResult adaptive = run(GetParam(), rc);
  expect_greedy(adaptive, what);
  expect_counters(adaptive, 3, what);
  EXPECT_GT(adaptive.num_capped, 0) << what;
}

TEST_P(MtpEngine, SeededSamplingIsTheOutputWithoutSpeculation) {
  RunConfig rc = config(0);
  rc.temperature = 0.8f;
  const RunResult plain = run(GetParam(), rc);
  rc.k = 2;
  const RunResult r = run(GetParam(), rc);
  EXPECT_EQ(r.tokens, plain.tokens);
  expect_counters(r, 2, "sampled");
}

TEST_P(MtpEngine, PreemptionAndOutsideDraftsKeepTheOutput) {
  // A pool that holds the longest request alone (with its drafts' and the head's lookahead).
  size_t longest = 0;
  for (size_t i = 0; i < fx_.prompts.size(); ++i)
    longest = std::max(longest, fx_.prompts[i].size() + fx_.greedy[i].size());
  RunConfig rc = config(3);
  rc.num_blocks = static_cast<int>((longest + 3 + 3) / 4) + 1;
  rc.max_num_batched_tokens = 64;
  rc.forced_drafts = true;
  const RunResult r = run(GetParam(), rc);
  expect_greedy(r, "preempting");
  EXPECT_GT(r.stats.scheduler.num_preemptions, 0u);
  // The outside drafts are right for a while: the head catches up over accepted ones.
  EXPECT_GT(r.stats.spec_decode.num_accepted_tokens, 0u);
  expect_counters(r, 3, "preempting");
}

// After a step that accepted two of three drafts, the head's proposals (from its catch-up over the
// three committed rows and its chain) are those of a cold start that prefills the same tokens.
TEST_P(MtpEngine, DraftsAfterAcceptedDraftsAreThoseOfAColdStart) {
  const Head& h = GetParam();
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = 64;
  o.num_threads = 2;
  o.num_state_slots = 4 * 4;
  o.mtp = {.enabled = true, .dir = h.head_path()};
  o.num_mtp_drafts = 3;
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  for (size_t i = 0; i < fx_.prompts.size(); ++i) {
    const std::vector<int32_t>& prompt = fx_.prompts[i];
    const std::vector<int32_t>& g = fx_.greedy[i];
    std::vector<int32_t> table(32);
    for (int b = 0; b < 32; ++b) table[b] = 31 - b;
    std::vector<int32_t> slots = {0, 1, 2, 3};

    CpuBackend warm(h.target_path(), o);
    StepSequence s;
    s.seq_id = 1;
    s.tokens = prompt;
    s.block_table = table;
    s.sample = true;
    s.sampling = &greedy;
    s.prompt_tokens = prompt;
    s.state_slots =
        warm.num_state_slots() > 0 ? std::span<const int32_t>(slots) : std::span<const int32_t>();
    std::vector<int32_t> proposed;
    s.proposed_drafts = &proposed;
    ASSERT_EQ(warm.step(std::span(&s, 1)).front().token, g[0]);
    EXPECT_EQ(proposed, std::vector<int32_t>(drafts_[i].begin(), drafts_[i].begin() + 3))
        << "prompt " << i;
    // g0 and drafts g1, g2, wrong: the step commits g1, g2 and samples g3.
    const std::vector<int32_t> step_tokens = {g[0], g[1], g[2], (g[3] + 1) % 512};
    const std::vector<int32_t> outputs = {g[0]};
    s.tokens = step_tokens;
    s.num_computed = static_cast<int32_t>(prompt.size());
    s.num_draft_tokens = 3;
    s.output_tokens = outputs;
    s.sample_index = 1;
    const std::vector<SampledToken> got = warm.step(std::span(&s, 1));
    ASSERT_EQ(got.size(), 3u);
    EXPECT_EQ(got[2].token, g[3]);

    CpuBackend cold(h.target_path(), o);
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), g.begin(), g.begin() + 3);
    StepSequence c = s;
    c.tokens = all;
    c.num_computed = 0;
    c.num_draft_tokens = 0;
    c.output_tokens = {};
    c.sample_index = 0;
    c.prompt_tokens = all;
    std::vector<int32_t> cold_proposed;
    c.proposed_drafts = &cold_proposed;
    ASSERT_EQ(cold.step(std::span(&c, 1)).front().token, g[3]);
    EXPECT_EQ(proposed, cold_proposed) << "prompt " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, MtpEngine, ::testing::ValuesIn(kHeads),
                         [](const auto& info) { return info.param.name; });

const Head& separate_head() { return kHeads.back(); }

// A prompt that shares `shared` tokens with an earlier one and then differs: the head's K/V at the
// last shared block's end was computed with the earlier prompt's next token, so the hit must give
// its last block back. Every proposal of the later request equals a run without the prefix cache,
// and the tokens those without speculation.
void expect_a_hit_leaves_the_proposals(const Head& head, size_t shared, RunConfig rc,
                                       uint64_t num_hit_tokens) {
  const test::ModelFixture fx = test::ModelFixture::load(head.target_path(), head.target_path());
  const std::vector<int32_t>& base = fx.prompts[3];
  ASSERT_GT(base.size(), shared);
  std::vector<int32_t> second(base.begin(), base.begin() + static_cast<ptrdiff_t>(shared));
  for (int32_t t : {7, 300, 41}) second.push_back(t);
  ASSERT_NE(second[shared], base[shared]);
  rc.k = 2;
  rc.max_tokens = 12;
  rc.waves = {{base}, {second}};
  const RunResult hit = run(head, rc);
  EXPECT_EQ(hit.stats.scheduler.prefix_cache_hits, num_hit_tokens);
  rc.enable_prefix_caching = false;
  const RunResult cold = run(head, rc);
  EXPECT_EQ(cold.stats.scheduler.prefix_cache_hits, 0u);
  EXPECT_EQ(hit.tokens, cold.tokens);
  EXPECT_EQ(hit.proposed.at(1), cold.proposed.at(1));
  rc.k = 0;
  rc.enable_prefix_caching = true;
  EXPECT_EQ(run(head, rc).tokens, hit.tokens);
}

// 28 shared tokens: 7 cached blocks, the last given back.
TEST(MtpEngineQwen3, PrefixHitsLeaveTheProposalsAsWithout) {
  RunConfig rc;
  rc.max_num_batched_tokens = 64;
  expect_a_hit_leaves_the_proposals(separate_head(), 28, rc, 24);
}

// On a hybrid model the hit also restores the recurrent state: 30 shared tokens, 7 cached blocks,
// the last given back, and chunks of 12 leave a state snapshot at 24.
TEST(MtpEngineHybrid, PrefixHitsLeaveTheProposalsAsWithout) {
  RunConfig rc;
  rc.max_num_batched_tokens = 12;
  rc.num_state_snapshots = 16;
  expect_a_hit_leaves_the_proposals(kHeads.front(), 30, rc, 24);
}

// Sharded ranks draft what one does: two TP ranks (each with half the head's attention heads and
// experts' width; on the hybrids also half the Gated DeltaNet heads, the recurrent state and the
// shared expert), and DP ranks (each drafting for its own sequences; under EP the head's MoE
// exchanges rows between them, a rank without rows joining idle).
void expect_sharded_ranks_draft_like_one(const Head& head,
                                    const std::vector<parallel::ParallelConfig>& layouts) {
  const test::ModelFixture fx = test::ModelFixture::load(head.target_path(), head.target_path());
  const std::vector<std::vector<int32_t>> drafts = oracle_drafts(head);
  RunConfig rc;
  rc.k = 3;
  rc.waves = {fx.prompts};
  rc.reference = fx.greedy;
  for (const parallel::ParallelConfig& p : layouts) {
    rc.parallel = p;
    const RunResult r = run(head, rc);
    for (size_t i = 0; i < fx.prompts.size(); ++i) {
      EXPECT_EQ(r.tokens.at(static_cast<int64_t>(i)), fx.greedy[i]) << p.describe();
      EXPECT_EQ(r.verified.at(static_cast<int64_t>(i)).front().drafts,
                std::vector<int32_t>(drafts[i].begin(), drafts[i].begin() + 3))
          << p.describe() << ", prompt " << i;
    }
  }
}

const std::vector<parallel::ParallelConfig> kMoeLayouts = {
    {.tp = 2}, {.tp = 2, .ep = 2}, {.dp = 2}, {.ep = 2, .dp = 2}, {.ep = 4, .dp = 4}};

TEST(MtpEngineQwen3, ShardedRanksDraftLikeOne) {
  expect_sharded_ranks_draft_like_one(separate_head(), kMoeLayouts);
}

TEST(MtpEngineHybrid, ShardedRanksDraftLikeOne) {
  expect_sharded_ranks_draft_like_one(kHeads[0], kMoeLayouts);
  expect_sharded_ranks_draft_like_one(kHeads[1], {{.tp = 2}, {.dp = 2}});
}

CpuBackendOptions mtp_options(const std::string& head_dir, int k) {
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = 32;
  o.num_threads = 1;
  o.mtp = {.enabled = true, .dir = head_dir};
  o.num_mtp_drafts = k;
  return o;
}

TEST(MtpEngineErrors, ACheckpointWithoutAHeadNeedsTheModelDirectory) {
  const std::string e =
      test::error_text([&] { CpuBackend b(separate_head().target_path(), mtp_options("", 2)); });
  EXPECT_NE(e.find("has no tensor mtp.fc.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("\"model\": DIR"), std::string::npos) << e;
}

TEST(MtpEngineErrors, TheEngineAndTheBackendMustAgreeOnK) {
  auto backend = std::make_unique<CpuBackend>(separate_head().target_path(),
                                              mtp_options(separate_head().head_path(), 2));
  EngineConfig c;
  c.speculative = mtp_config(separate_head(), 3);
  const std::string e =
      test::error_text([&] { LLMEngine engine(std::move(backend), tokenizer(), c); });
  EXPECT_NE(e.find("the backend proposes 2 drafts per step"), std::string::npos) << e;
  // An n-gram engine over a backend that drafts itself is refused too.
  c.speculative.method = SpeculativeConfig::Method::kNgram;
  c.speculative.model.clear();
  const std::string ngram = test::error_text([&] {
    LLMEngine engine(std::make_unique<CpuBackend>(separate_head().target_path(),
                                                  mtp_options(separate_head().head_path(), 3)),
                     tokenizer(), c);
  });
  EXPECT_NE(ngram.find("an n-gram engine needs a backend without a draft head"), std::string::npos)
      << ngram;
}

TEST(MtpEngineErrors, KOutOfRangeIsRefusedWhenParsed) {
  for (const char* json : {R"({"method": "mtp", "num_speculative_tokens": 0})",
                           R"({"method": "mtp", "num_speculative_tokens": 17})"}) {
    EXPECT_NE(test::error_text([&] {
                SpeculativeConfig::parse(json);
              }).find("'num_speculative_tokens' must be between 1 and 16"),
              std::string::npos)
        << json;
  }
}

// A disaggregated decode worker's reservation takes no prefix hit with an MTP head: the head's
// K/V at a hit's last position depends on the token after it, which the prefill worker computed
// with the right one (engine/test_disagg_engine.cpp hands a prompt over).
TEST(MtpEngine, AReservationTakesNoPrefixHit) {
  EngineConfig c;
  c.speculative = mtp_config(separate_head(), 2);
  LLMEngine engine(std::make_unique<CpuBackend>(separate_head().target_path(),
                                                mtp_options(separate_head().head_path(), 2)),
                   tokenizer(), c);
  const std::vector<int32_t> prompt(21, 5);  // 5 full blocks of 4
  EngineRequest r;
  r.prompt = prompt;
  r.stop.max_tokens = 2;
  engine.add_request(1, r);
  while (engine.has_work()) engine.step();
  const auto reserved = engine.reserve_kv(2, prompt);
  ASSERT_TRUE(reserved.has_value());
  EXPECT_EQ(reserved->num_cached_tokens, 0);
  engine.release_kv(2);
}

}  // namespace
}  // namespace relay

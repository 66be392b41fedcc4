// Speculative decoding in the engine (EngineConfig::speculative): with the n-gram proposer the
// CPU backend writes exactly the tokens it writes without it, in fewer steps when drafts are
// accepted, and the spec-decode counters add up; at temperature > 0 the verified tokens follow the
// target's distribution (a chi-square test); configurations a backend cannot run are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "../error_text.h"
#include "../scheduler/fake_backend.h"
#include "engine/cpu_backend.h"
#include "engine/llm_engine.h"

namespace relay {
namespace {

const std::string kDemo = RELAY_SOURCE_DIR "/models/relay-demo-moe";

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(kDemo);
  return t;
}

struct Decoded {
  std::vector<int32_t> tokens;
  int steps = 0;
  SpecDecodeStats stats;
};

// Decodes three requests (a repetitive one among them) to completion.
Decoded run(const SpeculativeConfig& spec, float temperature) {
  CpuBackendOptions o;
  o.num_blocks = 96;
  o.num_threads = 2;
  EngineConfig config;
  config.max_num_batched_tokens = 64;  // chunked prefill for the longer prompt
  config.speculative = spec;
  LLMEngine engine(std::make_unique<CpuBackend>(kDemo, o), tokenizer(), config);
  const std::vector<std::string> prompts = {
      "def add(a, b):\n    return a + b\n\ndef add(a, b):",
      "import os\nimport sys\nimport os\nimport",
      "class Tree:\n    def __init__(self, left, right):\n        self.left = left\n        self.right = right\n"};
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r;
    r.prompt = tokenizer().encode(prompts[i]);
    r.sampling.temperature = temperature;
    r.sampling.seed = 11 + i;
    r.stop.max_tokens = 48;
    r.stop.ignore_eos = true;
    engine.add_request(static_cast<int64_t>(i), r);
  }
  Decoded out;
  std::vector<std::vector<int32_t>> tokens(prompts.size());
  while (engine.has_work()) {
    for (const RequestOutput& o : engine.step()) {
      tokens.at(static_cast<size_t>(o.id)).insert(tokens[o.id].end(), o.new_tokens.begin(),
                                                  o.new_tokens.end());
    }
    ++out.steps;
  }
  for (const auto& t : tokens) out.tokens.insert(out.tokens.end(), t.begin(), t.end());
  out.stats = engine.stats().spec_decode;
  return out;
}

// n-gram drafts, K = 4, suffixes of 1..4 tokens (the demo prompts repeat short runs).
SpeculativeConfig ngram_k4() {
  SpeculativeConfig ngram;
  ngram.method = SpeculativeConfig::Method::kNgram;
  ngram.num_speculative_tokens = 4;
  ngram.prompt_lookup_min = 1;
  ngram.prompt_lookup_max = 4;
  return ngram;
}

TEST(SpeculativeEngine, NgramDraftsAreLosslessAndSaveSteps) {
  SpeculativeConfig ngram = ngram_k4();
  for (const float temperature : {0.0f, 0.8f}) {
    const Decoded plain = run({}, temperature);
    const Decoded spec = run(ngram, temperature);
    EXPECT_EQ(spec.tokens, plain.tokens) << "temperature " << temperature;
    EXPECT_EQ(plain.stats.num_drafts, 0u);
    EXPECT_GT(spec.stats.num_drafts, 0u);
    EXPECT_GT(spec.stats.num_accepted_tokens, 0u);
    EXPECT_LE(spec.stats.num_accepted_tokens, spec.stats.num_draft_tokens);
    ASSERT_EQ(spec.stats.num_accepted_tokens_per_pos.size(), 4u);
    uint64_t per_pos = 0;
    for (size_t pos = 0; pos < 4; ++pos) {
      per_pos += spec.stats.num_accepted_tokens_per_pos[pos];
      // A draft is accepted only after the ones before it.
      if (pos > 0) {
        EXPECT_LE(spec.stats.num_accepted_tokens_per_pos[pos],
                  spec.stats.num_accepted_tokens_per_pos[pos - 1]);
      }
    }
    EXPECT_EQ(per_pos, spec.stats.num_accepted_tokens);
    if (temperature == 0.0f) {
      EXPECT_LT(spec.steps, plain.steps);
    }
  }
}

// min_draft_acceptance: each request drafts what its own acceptance says lands; greedy and seeded
// output stay the output without, and requests whose n-gram drafts miss draft fewer.
TEST(SpeculativeEngine, MinDraftAcceptanceKeepsTheOutputAndDraftsLess) {
  SpeculativeConfig ngram = ngram_k4();
  for (const float temperature : {0.0f, 0.8f}) {
    const Decoded plain = run({}, temperature);
    const Decoded all = run(ngram, temperature);
    SpeculativeConfig adaptive = ngram;
    adaptive.min_draft_acceptance = 0.5;
    const Decoded cut = run(adaptive, temperature);
    EXPECT_EQ(cut.tokens, plain.tokens) << "temperature " << temperature;
    EXPECT_GT(cut.stats.num_accepted_tokens, 0u);
    EXPECT_LT(cut.stats.num_draft_tokens, all.stats.num_draft_tokens);
  }
}

// vLLM's disable_by_batch_size: with three requests running no step carries drafts above a
// threshold of 2, and the output stays the output without speculation; once requests finish and
// the batch is within it again, drafting resumes (the run is longer than the shortest requests).
TEST(SpeculativeEngine, DraftsStopWhileTheBatchIsPastDisableByBatchSize) {
  SpeculativeConfig ngram = ngram_k4();
  const Decoded plain = run({}, 0.0f);
  const Decoded all = run(ngram, 0.0f);
  ngram.disable_by_batch_size = 2;
  const Decoded capped = run(ngram, 0.0f);
  EXPECT_EQ(capped.tokens, plain.tokens);
  // Every request decodes 48 tokens, so all three run side by side until the end: no drafts.
  EXPECT_EQ(capped.stats.num_drafts, 0u);
  EXPECT_GT(all.stats.num_drafts, 0u);
  ngram.disable_by_batch_size = 3;
  EXPECT_EQ(run(ngram, 0.0f).stats.num_drafts, all.stats.num_drafts);
}

TEST(SpeculativeEngine, ConfigurationsABackendCannotRunAreRefused) {
  SpeculativeConfig ngram;
  ngram.method = SpeculativeConfig::Method::kNgram;
  ngram.num_speculative_tokens = 2;
  EngineConfig config;
  config.speculative = ngram;
  struct NoDrafts : testing::ScriptedBackend {
    using ScriptedBackend::ScriptedBackend;
    bool supports_draft_tokens() const override { return false; }
  };
  EXPECT_NE(test::error_text([&] {
              LLMEngine e(std::make_unique<NoDrafts>(std::vector<int32_t>{1}), tokenizer(), config);
            }).find("does not verify drafts"),
            std::string::npos);
  config.speculative.method = SpeculativeConfig::Method::kMtp;
  EXPECT_NE(test::error_text([&] {
              LLMEngine e(std::make_unique<testing::ScriptedBackend>(std::vector<int32_t>{1}),
                          tokenizer(), config);
            }).find("the backend proposes 0 drafts per step"),
            std::string::npos);
}

// The distribution test of lossless verification at temperature > 0: 3000 seeded requests decode
// three tokens of the tiny Qwen3-MoE fixture (temperature 1, top-k 8; max_tokens 3 leaves room for
// one draft after the first token); each one's second step verifies a forced draft, the likeliest
// token after its first. Grouped by the first token, the histogram of the second must follow the
// target's probabilities (softmax of the top 8 logits after the prompt and that token): a Pearson
// chi-square over every group with 12 or more requests stays under the 0.001 critical value. A
// verifier that accepts drafts too often (or too rarely) shifts mass onto (off) the draft and
// fails this (one that also accepts a tenth of the rejected drafts scores 248 against 94.5); the
// seeds are fixed, so the test is deterministic.
TEST(SpeculativeEngine, SampledVerificationFollowsTheTargetDistribution) {
  const std::string model = RELAY_FIXTURES_DIR "/models/qwen3-moe";
  const std::vector<int32_t> prompt = {17, 301, 5, 88, 42};
  constexpr int kRequests = 3000, kTopK = 8;
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = 4 * 256;
  o.num_threads = 2;
  SpeculativeConfig ngram;  // drafts come from set_drafts; the n-gram lookup finds none here
  ngram.method = SpeculativeConfig::Method::kNgram;
  ngram.num_speculative_tokens = 1;
  ngram.prompt_lookup_min = 64;
  ngram.prompt_lookup_max = 64;
  EngineConfig config;
  config.max_num_seqs = 256;
  config.max_num_batched_tokens = 4096;
  config.enable_prefix_caching = false;
  config.speculative = ngram;
  LLMEngine engine(std::make_unique<CpuBackend>(model, o), tokenizer(), config);
  CpuBackend oracle(model, o);

  // The target's distribution after prompt + [first]: softmax over the top-k logits.
  std::map<int32_t, std::vector<std::pair<int32_t, double>>> target;
  auto distribution = [&](int32_t first) -> const std::vector<std::pair<int32_t, double>>& {
    auto [it, fresh] = target.try_emplace(first);
    if (!fresh) return it->second;
    std::vector<int32_t> tokens = prompt;
    tokens.push_back(first);
    std::vector<int32_t> table = {0, 1};
    StepSequence s;
    s.tokens = tokens;
    s.block_table = table;
    const std::vector<float> logits =
        oracle.forward_logits(std::span(&s, 1), CpuBackend::LogitRows::kLastTokens);
    std::vector<int32_t> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + kTopK, ids.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    double sum = 0.0;
    for (int j = 0; j < kTopK; ++j) sum += std::exp(double{logits[ids[j]]} - logits[ids[0]]);
    for (int j = 0; j < kTopK; ++j) {
      it->second.emplace_back(ids[j], std::exp(double{logits[ids[j]]} - logits[ids[0]]) / sum);
    }
    return it->second;
  };

  std::map<int64_t, std::vector<int32_t>> out;
  for (int i = 0; i < kRequests; ++i) {
    EngineRequest r;
    r.prompt = prompt;
    r.sampling.temperature = 1.0f;
    r.sampling.top_k = kTopK;
    r.sampling.seed = 1000 + static_cast<uint64_t>(i);
    r.stop.max_tokens = 3;
    r.stop.ignore_eos = true;
    engine.add_request(i, r);
  }
  while (engine.has_work()) {
    for (const auto& [id, tokens] : out) {
      if (tokens.size() == 1) {
        const int32_t draft = distribution(tokens[0]).front().first;
        engine.set_drafts(id, std::span(&draft, 1));
      }
    }
    for (const RequestOutput& r : engine.step()) {
      out[r.id].insert(out[r.id].end(), r.new_tokens.begin(), r.new_tokens.end());
    }
  }
  ASSERT_EQ(out.size(), static_cast<size_t>(kRequests));
  EXPECT_EQ(engine.stats().spec_decode.num_draft_tokens, static_cast<uint64_t>(kRequests));

  std::map<int32_t, std::map<int32_t, int>> counts;  // first token -> second token -> requests
  for (const auto& [id, tokens] : out) {
    ASSERT_EQ(tokens.size(), 3u);
    ++counts[tokens[0]][tokens[1]];
  }
  double chi2 = 0.0;
  int dof = 0, tested = 0;
  for (const auto& [first, seconds] : counts) {
    int n = 0;
    for (const auto& [second, c] : seconds) n += c;
    if (n < 12) continue;
    tested += n;
    const auto& p = distribution(first);
    for (const auto& [token, prob] : p) {
      const auto it = seconds.find(token);
      const double observed = it == seconds.end() ? 0.0 : it->second;
      chi2 += (observed - n * prob) * (observed - n * prob) / (n * prob);
    }
    for (const auto& [second, c] : seconds) {
      const bool in_top =
          std::any_of(p.begin(), p.end(), [&](auto& e) { return e.first == second; });
      EXPECT_TRUE(in_top) << "token " << second << " is outside the top " << kTopK;
    }
    dof += kTopK - 1;
  }
  ASSERT_GT(tested, kRequests * 9 / 10);
  // The 0.999 quantile of chi-square with `dof` degrees of freedom (Wilson-Hilferty).
  const double z = 3.0902;
  const double a = 2.0 / (9.0 * dof);
  const double critical = dof * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
  std::printf("chi-square %.1f, %d degrees of freedom (0.001 critical value %.1f), %d requests\n",
              chi2, dof, critical, tested);
  EXPECT_LT(chi2, critical) << dof << " degrees of freedom";
}

}  // namespace
}  // namespace relay

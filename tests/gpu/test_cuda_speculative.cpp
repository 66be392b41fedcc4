// Draft verification on the CUDA backend (CudaBackendOptions::max_draft_tokens): a step with k
// drafts samples k + 1 rows and returns the accepted drafts and the token after them.
//
// Backend level: greedy drafts that are the sequence's own continuation are all accepted, drafts
// made wrong are rejected at the first wrong one, and what comes back is that continuation; seeded
// sampling accepts drafts that are the rows' own draws; steps whose sequences bring drafts replay
// verify graphs equal to eager steps. Engine level: the n-gram proposer's drafts leave the greedy
// output as it is without them, on one rank and sharded (DP + EP, TP). The
// rows that verify drafts run through the prefill kernels, a single-token decode through the
// decode kernels, so their bf16 logits may differ in the last bits: where two runs part, the test
// asks that the two tokens were a near tie (the verification rule itself, shared with the CPU
// backend, is tested exactly there).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine/cuda_backend.h"
#include "engine/llm_engine.h"
#include "engine/sampler.h"
#include "tests/gpu/backend_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace relay::gpu_test {
namespace {

// Before main, so before any CUDA call of the test binary (as test_cuda_parallel.cpp: sharded
// backends need it).
const bool eager_modules = setenv("CUDA_MODULE_LOADING", "EAGER", 0) == 0;

const std::filesystem::path kDemo = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";

// Logits two bf16 runs may differ by and still be the "same" greedy choice (the sharded tests see
// up to about 1.2 between layouts on this model).
constexpr float kNearTie = 1.5f;

CudaBackendOptions drafting(int max_drafts) {
  CudaBackendOptions o = small_options(true);
  o.max_draft_tokens = max_drafts;
  return o;
}

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(kDemo);
  return t;
}


// Each step: k = step % 4 drafts, the reference continuation's next tokens, the last one made
// wrong every third step. Greedy: every right draft is accepted, the first wrong one rejected, and
// the tokens are the reference's (within a near tie, after which the runs part).
TEST(CudaDrafts, GreedyDraftsAreVerifiedAgainstTheContinuation) {
  CudaBackend plain(kDemo, small_options(true));
  CudaBackend spec(kDemo, drafting(3));
  const std::vector<int32_t> prompt = tokenizer().encode("def fib(n):\n    if n < 2:\n        return n\n");
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  const int n = 40;
  Decoding ref = start(prompt, n + 8);
  for (int i = 0; i < n; ++i) step_with(plain, ref, {}, greedy);

  Decoding d = start(prompt, n + 8);
  int accepted = 0, rejected = 0;
  for (int step = 0; d.output.size() < static_cast<size_t>(n - 4); ++step) {
    const size_t at = d.output.size();
    std::vector<int32_t> drafts(ref.output.begin() + at, ref.output.begin() + at + step % 4);
    const bool spoil = !drafts.empty() && step % 3 == 0;
    if (spoil) drafts.back() = (drafts.back() + 1) % 1000;
    const std::vector<SampledToken> out = step_with(spec, d, drafts, greedy);
    const size_t right = spoil ? drafts.size() - 1 : drafts.size();
    accepted += static_cast<int>(out.size()) - 1;
    if (spoil) rejected += out.size() - 1 == right;
    for (size_t j = 0; j < out.size(); ++j) {
      const int32_t want = ref.output[at + j];
      if (out[j].token == want) continue;
      std::vector<int32_t> context = prompt;
      context.insert(context.end(), ref.output.begin(), ref.output.begin() + at + j);
      EXPECT_TRUE(near_tie(plain, context, out[j].token, want, kNearTie))
          << "step " << step << " row " << j << ": " << out[j].token << " vs " << want;
      return;  // the runs part at a near tie; nothing after it is comparable
    }
    EXPECT_EQ(out.size(), right + 1) << "step " << step << ": right drafts " << right;
  }
  EXPECT_GT(accepted, 10);
  EXPECT_GT(rejected, 2);
}

// Steps where every sequence brings the same number of drafts replay verify graphs (keyed by the
// tokens per sequence too); their tokens are the eager backend's exactly, on one rank and DP + EP.
TEST(CudaDrafts, UniformDraftsReplayVerifyGraphsThatEqualEager) {
  const std::vector<std::vector<int32_t>> prompts = {
      tokenizer().encode("def fib(n):\n    if n < 2:\n        return n\n"),
      tokenizer().encode("The three primary colours are"),
      tokenizer().encode("import os\nimport sys\nimport")};
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  const int n = 24;
  for (const parallel::ParallelConfig layout :
       {parallel::ParallelConfig{1, 1, 1}, parallel::ParallelConfig{1, 2, 2}}) {
    std::vector<std::vector<std::vector<int32_t>>> outputs;
    for (const bool graphs : {false, true}) {
      CudaBackendOptions o = small_options(graphs);
      o.max_draft_tokens = 2;
      o.parallel = layout;
      o.devices.assign(static_cast<size_t>(layout.world_size()), 0);
      CudaBackend backend(kDemo, o);
      const int per_part = backend.num_kv_blocks() / layout.dp;
      std::vector<Decoding> ds;
      for (size_t i = 0; i < prompts.size(); ++i)
        ds.push_back(start(prompts[i], n + 8, static_cast<int>(i % layout.dp) * per_part + 1 + 16 * static_cast<int>(i)));
      std::vector<Decoding*> all;
      for (Decoding& d : ds) all.push_back(&d);
      step_all(backend, all, {{}, {}, {}}, greedy);  // the prompts
      for (int step = 0; step < 8; ++step) {
        // Two drafts each: the sequence's own last token repeated, right now and then.
        std::vector<std::vector<int32_t>> drafts;
        for (const Decoding& d : ds) drafts.push_back({d.tokens.back(), (d.tokens.back() + step) % 5000});
        step_all(backend, all, drafts, greedy);
      }
      std::vector<std::vector<int32_t>> out;
      for (const Decoding& d : ds) out.push_back(d.output);
      outputs.push_back(out);
    }
    EXPECT_EQ(outputs[1], outputs[0]) << layout.describe();
  }
}

// Seeded sampling: row j of a verify step draws with the uniform of sample index + j, as a run
// without drafts would. The drafts here are the tokens the rows draw: found by scoring the step's
// tokens with forward_logits (the step's shapes) and drawing each row on the host with
// sample_token, draft j + 1 being row j's draw, until they agree. The step then accepts nearly all
// of them — not every one: the MoE's fp32 sums are not bitwise repeatable from run to run (expert
// rows are gathered in arrival order), and at temperature 0.8 over a broad distribution a change
// in the last bits moves a draw across a token boundary now and then (a row drawing with another
// index's uniform would part from its draft most of the time).
TEST(CudaDrafts, SeededDraftsThatAreTheRowsDrawsAreAccepted) {
  // Eager steps: a graph pads the block table to a power of two, which may change the last bits.
  CudaBackendOptions o = drafting(3);
  o.cuda_graphs = false;
  CudaBackend spec(kDemo, o);
  const std::vector<int32_t> prompt = tokenizer().encode("The three primary colours are");
  SamplingParams sampled;
  sampled.temperature = 0.8f;
  sampled.top_p = 0.95f;
  sampled.seed = 1234;
  sampled.num_logprobs = 2;
  Decoding d = start(prompt, 64);
  step_with(spec, d, {}, sampled);  // the prompt, and the first token
  const int vocab = static_cast<int>(spec.config().vocab_size);
  int accepted = 0, bonus_equal = 0;
  for (int step = 0; step < 8; ++step) {
    std::vector<int32_t> drafts(3, d.tokens.back()), draws;
    for (int round = 0; round < 4; ++round) {
      std::vector<int32_t> tokens{d.tokens.back()};
      tokens.insert(tokens.end(), drafts.begin(), drafts.end());
      StepSequence s;
      s.seq_id = 5;
      s.tokens = tokens;
      s.num_computed = d.num_computed;
      s.block_table = d.blocks;
      const std::vector<StepSequence> batch{s};
      std::vector<float> logits = spec.forward_logits(batch, CudaBackend::LogitRows::kAllTokens);
      ASSERT_EQ(logits.size(), size_t(4) * vocab);
      draws.clear();
      std::vector<int32_t> history = d.output;
      for (int r = 0; r < 4; ++r) {
        const std::span<float> row(logits.data() + size_t(r) * vocab, vocab);
        draws.push_back(sample_token(row, sampled, prompt, history, d.output.size() + r).token);
        if (r < 3) history.push_back(drafts[r]);
      }
      const std::vector<int32_t> next(draws.begin(), draws.begin() + 3);
      if (next == drafts) break;
      drafts = next;
    }
    // (Normally a fixed point; when the last bits moved a draw between rounds, the drafts are the
    // last round's and the step accepts what still holds.)
    const std::vector<SampledToken> out = step_with(spec, d, drafts, sampled);
    accepted += static_cast<int>(out.size()) - 1;
    if (out.size() == 4) bonus_equal += out[3].token == draws[3];
    for (const SampledToken& t : out) EXPECT_EQ(t.top.size(), 2u);
  }
  EXPECT_GE(accepted, 24 * 8 / 10) << "drafts accepted of 24";
  EXPECT_GE(bonus_equal, 4);
}

// The engine with the n-gram proposer on the CUDA backend: the greedy output of the run without
// drafts, in fewer steps, one rank and sharded (DP + EP, TP).
TEST(CudaDrafts, NgramDecodingIsTheGreedyOutputOnOneRankAndSharded) {
  const std::vector<std::vector<int32_t>> prompts = {
      tokenizer().encode("def add(a, b):\n    return a + b\n\ndef add(a, b):"),
      tokenizer().encode("import os\nimport sys\nimport os\nimport"),
      tokenizer().encode("class Tree:\n    def __init__(self, left, right):\n        self.left = left\n")};
  SpeculativeConfig ngram;
  ngram.method = SpeculativeConfig::Method::kNgram;
  ngram.num_speculative_tokens = 3;
  ngram.prompt_lookup_min = 1;
  ngram.prompt_lookup_max = 4;
  CudaBackend one(kDemo, small_options(false));
  const EngineRun plain = run_engine(kDemo, tokenizer(), small_options(true), {}, prompts);
  for (const parallel::ParallelConfig layout :
       {parallel::ParallelConfig{1, 1, 1}, parallel::ParallelConfig{1, 2, 2},
        parallel::ParallelConfig{2, 1, 1}}) {
    CudaBackendOptions o = small_options(true);
    o.parallel = layout;
    o.devices.assign(static_cast<size_t>(layout.world_size()), 0);
    const EngineRun spec = run_engine(kDemo, tokenizer(), o, ngram, prompts);
    const std::string name = layout.describe();
    EXPECT_GT(spec.stats.num_drafts, 0u) << name;
    EXPECT_GT(spec.stats.num_accepted_tokens, 0u) << name;
    EXPECT_LT(spec.steps, plain.steps) << name;
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_EQ(spec.tokens[i].size(), plain.tokens[i].size()) << name << " request " << i;
      const auto [a, b] = std::mismatch(spec.tokens[i].begin(), spec.tokens[i].end(),
                                        plain.tokens[i].begin());
      if (a == spec.tokens[i].end()) continue;
      std::vector<int32_t> context = prompts[i];
      context.insert(context.end(), plain.tokens[i].begin(), b);
      EXPECT_TRUE(near_tie(one, context, *a, *b, kNearTie))
          << name << " request " << i << " parts at token " << (b - plain.tokens[i].begin())
          << ": " << *a << " vs " << *b;
    }
  }
}

}  // namespace
}  // namespace relay::gpu_test

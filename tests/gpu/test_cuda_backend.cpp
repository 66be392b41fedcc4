// CudaBackend end to end against the transformers fixtures (tests/fixtures/models, made by
// tests/fixtures/make_model_fixtures.py): prompt logits, batched greedy decoding through the paged
// cache (decode steps run through CUDA graphs), graphs == eager, and the demo model: its sampling,
// prompt logprobs and token constraints against the shared sampler on the same logits.
//
// The fixtures hold fp32 logits of bf16 checkpoints; the GPU computes in bf16 with fp32
// accumulation (activations rounded to bf16 between ops, as a bf16 transformers run would). The
// tiny random fixtures have near-ties (top-1/top-2 margins down to 1e-3), where bf16 rounding may
// pick the other token, and a greedy run diverges from there; so greedy continuations are checked
// teacher forced: at every continuation position the token transformers chose must be the GPU's
// arg-max or within the noise bound of it, where the bound is twice the largest logit error the
// same run measured on the prompt positions. Exact agreement is counted and printed.
#include <algorithm>
#include <iostream>
#include <map>
#include <numeric>
#include <random>

#include "engine/cuda_backend.h"
#include "engine/sampler.h"
#include "tests/gpu/backend_test_util.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/unit/engine/fixtures.h"

namespace relay::gpu_test {
namespace {

constexpr double kLogitTolerance = 5e-2;  // MoE routing flips under bf16 move a few rows further

class CudaBackendFixture : public ::testing::TestWithParam<std::string> {};

struct Agreement {
  int exact = 0, within_noise = 0, total = 0;
};

// Position p (of `logits`, rows of `vocab`) should predict `want`: exactly, or within `noise`.
void check_choice(const std::vector<float>& logits, int vocab, int p, int32_t want, float noise,
                  Agreement& a) {
  const float* row = logits.data() + static_cast<size_t>(p) * vocab;
  const int32_t best = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
  ++a.total;
  a.exact += best == want;
  a.within_noise += row[want] >= row[best] - noise;
}

float max_abs_error(const std::vector<float>& got, const std::vector<float>& want, size_t count) {
  float err = 0.0f;
  for (size_t i = 0; i < count; ++i) err = std::max(err, std::abs(got[i] - want[i]));
  return err;
}

TEST_P(CudaBackendFixture, PromptLogitsMatchTransformers) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CudaBackend backend(dir, small_options(false));
  const int vocab = static_cast<int>(backend.config().vocab_size);
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    std::vector<float> got = prefill_logits(backend, fx.prompts[i]);
    ASSERT_EQ(got.size(), fx.logits[i].size());
    EXPECT_LT(rel_error(got, fx.logits[i]), kLogitTolerance) << GetParam() << " prompt " << i;
    Agreement a;
    for (size_t t = 0; t < fx.prompts[i].size(); ++t) {
      const float* want = fx.logits[i].data() + t * vocab;
      check_choice(got, vocab, static_cast<int>(t),
                   static_cast<int32_t>(std::max_element(want, want + vocab) - want), 0.0f, a);
    }
    EXPECT_GE(a.exact, a.total * 9 / 10) << GetParam() << " prompt " << i << " top-1 agreement";
  }
}

TEST_P(CudaBackendFixture, GreedyContinuationsMatchTransformers) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CudaBackend backend(dir, small_options(false));
  const int vocab = static_cast<int>(backend.config().vocab_size);
  Agreement a;
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    std::vector<int32_t> seq = fx.prompts[i];
    seq.insert(seq.end(), fx.greedy[i].begin(), fx.greedy[i].end() - 1);
    std::vector<float> got = prefill_logits(backend, seq);
    const float noise =
        std::max(2.0f * max_abs_error(got, fx.logits[i], fx.logits[i].size()), 1e-3f);
    for (size_t j = 0; j < fx.greedy[i].size(); ++j) {
      check_choice(got, vocab, static_cast<int>(fx.prompts[i].size() + j - 1), fx.greedy[i][j],
                   noise, a);
    }
  }
  std::cout << GetParam() << ": greedy tokens exactly equal " << a.exact << "/" << a.total
            << ", within bf16 noise " << a.within_noise << "/" << a.total << "\n";
  EXPECT_EQ(a.within_noise, a.total) << GetParam();
  EXPECT_GE(a.exact, a.total * 9 / 10) << GetParam();
}

// Decoding through the paged cache with CUDA graphs computes what a prefill of the same tokens
// does.
TEST_P(CudaBackendFixture, GraphDecodeAgreesWithPrefill) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CudaBackend backend(dir, small_options(true));
  const int vocab = static_cast<int>(backend.config().vocab_size);
  const int steps = static_cast<int>(fx.greedy[0].size());
  auto decoded = greedy_batched(backend, fx.prompts, steps);
  Agreement a;
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    std::vector<int32_t> seq = fx.prompts[i];
    seq.insert(seq.end(), decoded[i].begin(), decoded[i].end() - 1);
    std::vector<float> got = prefill_logits(backend, seq);
    for (int j = 0; j < steps; ++j) {
      check_choice(got, vocab, static_cast<int>(fx.prompts[i].size()) + j - 1, decoded[i][j], 2e-2f,
                   a);
    }
  }
  EXPECT_EQ(a.within_noise, a.total) << GetParam();
  EXPECT_GE(a.exact, a.total * 95 / 100) << GetParam();
}

TEST_P(CudaBackendFixture, GraphsEqualEager) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CudaBackend eager(dir, small_options(false)), graphs(dir, small_options(true));
  EXPECT_EQ(greedy_batched(eager, fx.prompts, 12), greedy_batched(graphs, fx.prompts, 12))
      << GetParam();
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaBackendFixture, ::testing::ValuesIn(unshifted_fixtures()),
                         param_name);

TEST(CudaBackendDemo, GreedyAndLogitsMatchTransformers) {
  const auto model_dir = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  auto fx =
      test::ModelFixture::load(test::fixture_models_dir() / "relay-demo-moe-expected", model_dir);
  CudaBackend backend(model_dir, small_options(false));
  const int vocab = static_cast<int>(backend.config().vocab_size);
  // The fixture keeps the logits of the last prompt position of prompt 0 only.
  std::vector<float> first = prefill_logits(backend, fx.prompts[0]);
  std::vector<float> last(first.end() - vocab, first.end());
  EXPECT_LT(rel_error(last, fx.logits[0]), kLogitTolerance);
  const float noise = std::max(2.0f * max_abs_error(last, fx.logits[0], vocab), 1e-3f);
  Agreement a;
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    std::vector<int32_t> seq = fx.prompts[i];
    seq.insert(seq.end(), fx.greedy[i].begin(), fx.greedy[i].end() - 1);
    std::vector<float> got = prefill_logits(backend, seq);
    for (size_t j = 0; j < fx.greedy[i].size(); ++j) {
      check_choice(got, vocab, static_cast<int>(fx.prompts[i].size() + j - 1), fx.greedy[i][j],
                   noise, a);
    }
  }
  std::cout << "demo: greedy tokens exactly equal " << a.exact << "/" << a.total
            << ", within bf16 noise (" << noise << ") " << a.within_noise << "/" << a.total << "\n";
  EXPECT_EQ(a.within_noise, a.total);
  EXPECT_GE(a.exact, a.total * 9 / 10);
}

TEST(CudaBackendDemo, SamplingMatchesTheSharedSampler) {
  // Same logits, same (seed, index) -> the GPU draw equals sampler.h's on the host.
  const auto model_dir = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  CudaBackend backend(model_dir, small_options(false));
  std::vector<int32_t> prompt{9707, 11, 1879, 0, 576, 3974, 13};
  std::vector<int32_t> blocks{5};
  for (uint64_t seed : {1ull, 2ull, 3ull, 99ull}) {
    SamplingParams sp;
    sp.temperature = 0.8f;
    sp.top_p = 0.9f;
    sp.top_k = 40;
    sp.seed = seed;
    sp.num_logprobs = 3;
    StepSequence s;
    s.seq_id = 1;
    s.tokens = prompt;
    s.block_table = blocks;
    s.sample = true;
    s.sampling = &sp;
    std::vector<StepSequence> batch{s};
    std::vector<float> logits = backend.forward_logits(batch, CudaBackend::LogitRows::kLastTokens);
    SampledToken want = sample_token(logits, sp, {}, {}, 0);
    std::vector<SampledToken> got = backend.step(batch);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].token, want.token) << "seed " << seed;
    EXPECT_NEAR(got[0].logprob, want.logprob, 1e-3);
    ASSERT_EQ(got[0].top.size(), 3u);
    for (int k = 0; k < 3; ++k) EXPECT_EQ(got[0].top[k].first, want.top[k].first);
  }
}

// Prompt logprobs on the GPU equal token_logprob over the same logits: a 40-token prompt scored in
// chunks of the logits buffer (16 rows here), in one step and split over two, beside a sequence
// sampled on the host (penalties) whose logits the later chunks must not clobber first.
TEST(CudaBackendDemo, PromptLogprobsMatchTheLogitsInEveryChunk) {
  const auto model_dir = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  CudaBackend backend(model_dir, small_options(false));
  const int vocab = static_cast<int>(backend.config().vocab_size);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back((i * 7919 + 13) % 5000);
  const std::vector<float> logits = prefill_logits(backend, prompt);
  const std::vector<int32_t> other{9707, 11, 1879, 0, 576, 3974, 13};
  const std::vector<float> other_logits = prefill_logits(backend, other);
  SamplingParams greedy, penalized;
  penalized.repetition_penalty = 1.3f;
  std::vector<float> scratch;
  for (int split : {40, 17}) {
    std::vector<int32_t> blocks{10, 11, 12, 13, 14}, other_blocks{20};
    std::vector<TokenLogprob> got;
    for (int begin = 0; begin < 40; begin += split) {
      const int end = std::min(40, begin + split);
      StepSequence s;
      s.seq_id = 1;
      s.tokens = std::span<const int32_t>(prompt).subspan(begin, end - begin);
      s.num_computed = begin;
      s.block_table = blocks;
      s.sample = end == 40;
      s.sampling = &greedy;
      s.prompt_tokens = prompt;
      s.num_prompt_logprobs = 3;
      std::vector<TokenLogprob> part;
      s.prompt_logprobs = &part;
      std::vector<StepSequence> batch{s};
      if (end == 40) {
        batch.push_back(sampling_prompt(2, other, other_blocks, &penalized));
      }
      const std::vector<SampledToken> sampled = backend.step(batch);
      ASSERT_EQ(part.size(), s.num_prompt_logprob_rows());
      got.insert(got.end(), part.begin(), part.end());
      if (end == 40) {
        ASSERT_EQ(sampled.size(), 2u);
        std::vector<float> last(other_logits.end() - vocab, other_logits.end());
        EXPECT_EQ(sampled[1].token, sample_token(last, penalized, other, {}, 0).token);
      }
    }
    ASSERT_EQ(got.size(), 39u) << "split " << split;
    for (size_t j = 0; j < got.size(); ++j) {
      const TokenLogprob want = token_logprob(
          std::span<const float>(logits).subspan(j * vocab, vocab), prompt[j + 1], 3, scratch);
      EXPECT_EQ(got[j].token, want.token) << "row " << j;
      EXPECT_NEAR(got[j].logprob, want.logprob, 1e-3) << "row " << j;
      EXPECT_EQ(got[j].rank, want.rank) << "row " << j;
      ASSERT_EQ(got[j].top.size(), 3u);
      for (int k = 0; k < 3; ++k) {
        EXPECT_EQ(got[j].top[k].first, want.top[k].first) << "row " << j;
        EXPECT_NEAR(got[j].top[k].second, want.top[k].second, 1e-3) << "row " << j;
      }
    }
  }
}

// A token bitmask and a logit_bias on the GPU sampler draw what sampler.h draws with them, eager
// and through a decode graph, greedy and random, and on the host path (penalties).
TEST(CudaBackendDemo, TokenConstraintsMatchTheSharedSampler) {
  const auto model_dir = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  CudaBackend backend(model_dir, small_options(true));
  const int vocab = static_cast<int>(backend.config().vocab_size);
  const size_t words = (vocab + 31) / 32;
  std::mt19937 rng(5);
  std::vector<int32_t> prompt{9707, 11, 1879, 0, 576, 3974, 13};
  std::vector<int32_t> blocks{5, 6};
  int checked = 0;
  for (int round = 0; round < 6; ++round) {
    SamplingParams sp;
    sp.temperature = round % 3 == 0 ? 0.0f : 0.9f;
    sp.top_k = round % 2 ? 50 : 0;
    sp.repetition_penalty = round == 5 ? 1.2f : 1.0f;
    sp.seed = 40 + round;
    sp.num_logprobs = 2;
    std::vector<uint32_t> mask(words);
    for (uint32_t& w : mask) w = static_cast<uint32_t>(rng()) & static_cast<uint32_t>(rng());
    if (vocab % 32) mask.back() &= (1u << (vocab % 32)) - 1;
    const std::vector<std::pair<int32_t, float>> bias{{static_cast<int32_t>(rng() % vocab), 30.0f},
                                                      {static_cast<int32_t>(rng() % vocab), -3.0f}};
    // Prefill (eager), then two decode steps (a graph: captured, then replayed).
    std::vector<int32_t> tokens = prompt, output;
    for (int step = 0; step < 3; ++step) {
      StepSequence s;
      s.seq_id = 1;
      s.num_computed = step == 0 ? 0 : static_cast<int>(tokens.size()) - 1;
      s.tokens = std::span<const int32_t>(tokens).subspan(s.num_computed);
      s.block_table = blocks;
      s.sample = true;
      s.sampling = &sp;
      s.prompt_tokens = prompt;
      s.output_tokens = output;
      s.sample_index = output.size();
      s.allowed_tokens = mask;
      if (round % 2 == 0) s.logit_bias = bias;
      std::vector<StepSequence> batch{s};
      std::vector<float> logits = backend.forward_logits(batch, CudaBackend::LogitRows::kLastTokens);
      const SampledToken want =
          sample_token(logits, sp, prompt, output, s.sample_index, {s.allowed_tokens, s.logit_bias});
      const std::vector<SampledToken> got = backend.step(batch);
      ASSERT_EQ(got.size(), 1u);
      EXPECT_EQ(got[0].token, want.token) << "round " << round << " step " << step;
      EXPECT_NEAR(got[0].logprob, want.logprob, 1e-3) << "round " << round << " step " << step;
      EXPECT_TRUE((mask[got[0].token / 32] >> (got[0].token % 32)) & 1u);
      ++checked;
      tokens.push_back(got[0].token);
      output.push_back(got[0].token);
    }
  }
  EXPECT_EQ(checked, 18);
  // A bitmask that allows nothing, or of the wrong size, is refused before the step runs.
  SamplingParams sp;
  StepSequence s = sampling_prompt(1, prompt, blocks, &sp);
  std::vector<uint32_t> none(words, 0u), short_mask(words - 1, ~0u);
  s.allowed_tokens = none;
  EXPECT_THROW(backend.step(std::vector<StepSequence>{s}), Error);
  s.allowed_tokens = short_mask;
  EXPECT_THROW(backend.step(std::vector<StepSequence>{s}), Error);
}

TEST(CudaBackendDemo, ProfileNamesEveryOpOncePerLayerAndLeavesTheLogitsAlone) {
  // profile_forward runs the same forward as a step: every op appears with one call per layer
  // (embedding, final norm and lm_head once), device times are positive, and the logits of a
  // following forward are unchanged by the events it recorded.
  const auto model_dir = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  CudaBackend backend(model_dir, small_options(false));
  const int layers = static_cast<int>(backend.config().num_hidden_layers);
  const std::vector<int32_t> prompt{9707, 11, 1879, 0, 576, 3974, 13, 42, 7, 1000};
  const std::vector<float> before = prefill_logits(backend, prompt);
  std::vector<int32_t> blocks{3, 4};
  StepSequence s;
  s.seq_id = 1;
  s.tokens = prompt;
  s.block_table = blocks;
  std::vector<StepSequence> batch{s};
  const std::vector<OpTiming> ops = backend.profile_forward(batch);
  std::map<std::string, OpTiming> by_name;
  for (const OpTiming& op : ops) {
    EXPECT_GT(op.ms, 0.0) << op.op;
    EXPECT_TRUE(by_name.emplace(op.op, op).second) << op.op << " listed twice";
  }
  // The combine applies the next layer's input norm (the final norm after the last layer), so
  // input_norm runs for layer 0 only.
  for (const char* name : {"qkv_proj", "qk_norm_rope_kv_write", "attention", "o_proj",
                           "post_attention_norm", "router_gemm", "router_topk", "moe_permute",
                           "experts_gate_up", "swiglu", "experts_down", "moe_combine_norm"}) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_EQ(by_name[name].calls, layers) << name;
  }
  for (const char* name : {"embedding", "input_norm", "lm_head"}) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_EQ(by_name[name].calls, 1) << name;
  }
  for (const char* name : {"moe_combine", "final_norm"}) {
    EXPECT_FALSE(by_name.count(name)) << name;
  }
  EXPECT_EQ(prefill_logits(backend, prompt), before);
}

}  // namespace
}  // namespace relay::gpu_test

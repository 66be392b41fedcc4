// CudaBackend end to end against the transformers fixtures (tests/fixtures/models, made by
// tests/fixtures/make_model_fixtures.py): prompt logits, batched greedy decoding through the paged
// cache (decode steps run through CUDA graphs), graphs == eager, and the demo model.
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
  for (const char* name : {"input_norm", "qkv_proj", "qk_norm_rope_kv_write", "attention", "o_proj",
                           "post_attention_norm", "router_gemm", "router_topk", "moe_permute",
                           "experts_gate_up", "swiglu", "experts_down", "moe_combine"}) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_EQ(by_name[name].calls, layers) << name;
  }
  for (const char* name : {"embedding", "final_norm", "lm_head"}) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_EQ(by_name[name].calls, 1) << name;
  }
  EXPECT_EQ(prefill_logits(backend, prompt), before);
}

}  // namespace
}  // namespace relay::gpu_test

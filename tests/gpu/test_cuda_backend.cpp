// CudaBackend end to end against the transformers fixtures (tests/fixtures/models, made by
// tests/fixtures/make_model_fixtures.py): prompt logits, batched greedy decoding through the paged
// cache (decode steps run through CUDA graphs), graphs == eager, and the demo model.
//
// The fixtures hold fp32 logits of bf16 checkpoints; the GPU computes in bf16 with fp32 accumulation,
// so logits are compared by relative error (bf16 activations: a few 1e-3) and greedy continuations
// must be identical token for token.
#include <algorithm>
#include <numeric>

#include "engine/cuda_backend.h"
#include "engine/sampler.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/unit/engine/fixtures.h"

namespace relay::gpu_test {
namespace {

constexpr double kLogitTolerance = 3e-2;

struct Seq {
  int64_t id = 0;
  std::vector<int32_t> prompt, tokens, output, blocks;
  int num_computed = 0;
};

CudaBackendOptions small_options(bool graphs) {
  CudaBackendOptions o;
  o.block_size = 8;
  o.num_kv_blocks = 512;
  o.max_num_seqs = 16;
  o.max_num_tokens = 512;
  o.cuda_graphs = graphs;
  return o;
}

// Greedy-decodes all prompts together, `steps` tokens each, with blocks handed out in reverse order.
std::vector<std::vector<int32_t>> greedy_batched(CudaBackend& backend, const std::vector<std::vector<int32_t>>& prompts,
                                                 int steps) {
  const int bs = backend.block_size();
  int next_block = backend.num_kv_blocks() - 1;
  std::vector<Seq> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Seq s;
    s.id = static_cast<int64_t>(i) + 7;
    s.prompt = s.tokens = prompts[i];
    const int need = (static_cast<int>(prompts[i].size()) + steps + bs - 1) / bs;
    for (int b = 0; b < need; ++b) s.blocks.push_back(next_block--);
    seqs.push_back(std::move(s));
  }
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  for (int step = 0; step < steps; ++step) {
    std::vector<StepSequence> batch;
    for (const Seq& s : seqs) {
      StepSequence st;
      st.seq_id = s.id;
      st.tokens = std::span<const int32_t>(s.tokens).subspan(s.num_computed);
      st.num_computed = s.num_computed;
      st.block_table = s.blocks;
      st.sample = true;
      st.sampling = &greedy;
      st.prompt_tokens = s.prompt;
      st.output_tokens = s.output;
      st.sample_index = s.output.size();
      batch.push_back(st);
    }
    std::vector<SampledToken> out = backend.step(batch);
    EXPECT_EQ(out.size(), seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_EQ(out[i].seq_id, seqs[i].id);
      seqs[i].num_computed = static_cast<int>(seqs[i].tokens.size());
      seqs[i].tokens.push_back(out[i].token);
      seqs[i].output.push_back(out[i].token);
    }
  }
  std::vector<std::vector<int32_t>> result;
  for (const Seq& s : seqs) result.push_back(s.output);
  return result;
}

std::vector<std::string> unshifted_fixtures() {
  std::vector<std::string> names;
  for (const std::string& n : test::tiny_fixture_names()) {
    auto dir = test::fixture_models_dir() / n;
    if (test::ModelFixture::load(dir, dir).position_offset == 0) names.push_back(n);
  }
  return names;
}

class CudaBackendFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaBackendFixture, PromptLogitsMatchTransformers) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CudaBackend backend(dir, small_options(false));
  const int vocab = static_cast<int>(backend.config().vocab_size);
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    const auto& prompt = fx.prompts[i];
    std::vector<int32_t> blocks((prompt.size() + 7) / 8);
    std::iota(blocks.rbegin(), blocks.rend(), 3);
    StepSequence s;
    s.seq_id = 1;
    s.tokens = prompt;
    s.block_table = blocks;
    std::vector<StepSequence> batch{s};
    std::vector<float> got = backend.forward_logits(batch, CudaBackend::LogitRows::kAllTokens);
    ASSERT_EQ(got.size(), fx.logits[i].size());
    EXPECT_LT(rel_error(got, fx.logits[i]), kLogitTolerance) << GetParam() << " prompt " << i;
    int agree = 0;
    for (size_t t = 0; t < prompt.size(); ++t) {
      auto top = [&](const std::vector<float>& v) {
        return std::max_element(v.begin() + t * vocab, v.begin() + (t + 1) * vocab) - (v.begin() + t * vocab);
      };
      agree += top(got) == top(fx.logits[i]);
    }
    EXPECT_GE(agree, static_cast<int>(prompt.size()) - 1) << GetParam() << " prompt " << i << " top-1 agreement";
  }
}

TEST_P(CudaBackendFixture, BatchedGreedyMatchesTransformers) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  if (fx.position_offset != 0) GTEST_SKIP() << "shifted positions: covered by the logits test";
  CudaBackend backend(dir, small_options(true));
  auto got = greedy_batched(backend, fx.prompts, static_cast<int>(fx.greedy[0].size()));
  for (size_t i = 0; i < fx.prompts.size(); ++i) EXPECT_EQ(got[i], fx.greedy[i]) << GetParam() << " prompt " << i;
}

TEST_P(CudaBackendFixture, GraphsEqualEager) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CudaBackend eager(dir, small_options(false)), graphs(dir, small_options(true));
  EXPECT_EQ(greedy_batched(eager, fx.prompts, 12), greedy_batched(graphs, fx.prompts, 12)) << GetParam();
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaBackendFixture, ::testing::ValuesIn(unshifted_fixtures()), param_name);

TEST(CudaBackendDemo, GreedyAndLogitsMatchTransformers) {
  const auto model_dir = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  auto fx = test::ModelFixture::load(test::fixture_models_dir() / "relay-demo-moe-expected", model_dir);
  CudaBackend backend(model_dir, small_options(true));
  auto got = greedy_batched(backend, fx.prompts, static_cast<int>(fx.greedy[0].size()));
  for (size_t i = 0; i < fx.prompts.size(); ++i) EXPECT_EQ(got[i], fx.greedy[i]) << "demo prompt " << i;
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

}  // namespace
}  // namespace relay::gpu_test

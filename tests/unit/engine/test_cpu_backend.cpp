// CpuBackend end to end: step() decoding greedily through the paged cache against the HF fixtures
// (tiny models and the real demo model), batching and chunking invariance, and error paths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "engine/cpu_backend.h"
#include "fixtures.h"

namespace relay {
namespace {

// A sequence being driven through step(): its tokens, what is cached, and its pages.
struct Seq {
  int64_t id = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;  // prompt + generated
  std::vector<int32_t> output;
  std::vector<int32_t> blocks;
  int num_computed = 0;
};

// Hands out block ids in a scrambled order so sequences never get contiguous pages.
std::vector<int32_t> scrambled_blocks(int num_blocks) {
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  for (int i = 0; i < num_blocks; ++i) std::swap(ids[i], ids[(i * 7 + 3) % num_blocks]);
  return ids;
}

StepSequence make_step(const Seq& s, int num_new, bool sample, const SamplingParams* params) {
  StepSequence st;
  st.seq_id = s.id;
  st.tokens = std::span<const int32_t>(s.tokens).subspan(s.num_computed, num_new);
  st.num_computed = s.num_computed;
  st.block_table = s.blocks;
  st.sample = sample;
  st.sampling = params;
  st.output_tokens = s.output;
  st.prompt_tokens = s.prompt;
  st.sample_index = s.output.size();
  return st;
}

// Greedy-decodes every prompt of the fixture together in one batch, `steps` tokens each.
std::vector<std::vector<int32_t>> greedy_batched(CpuBackend& backend, const std::vector<std::vector<int32_t>>& prompts,
                                                 int steps) {
  const int bs = backend.block_size();
  std::vector<int32_t> free_blocks = scrambled_blocks(backend.num_kv_blocks());
  std::vector<Seq> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Seq s;
    s.id = static_cast<int64_t>(i) + 100;
    s.prompt = s.tokens = prompts[i];
    int need = (static_cast<int>(prompts[i].size()) + steps + bs - 1) / bs;
    for (int b = 0; b < need; ++b) {
      s.blocks.push_back(free_blocks.back());
      free_blocks.pop_back();
    }
    seqs.push_back(std::move(s));
  }
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  for (int step = 0; step < steps; ++step) {
    std::vector<StepSequence> batch;
    for (const Seq& s : seqs) {
      batch.push_back(make_step(s, static_cast<int>(s.tokens.size()) - s.num_computed, true, &greedy));
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

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

// The backend numbers positions from the cache, so fixtures with shifted positions (qwen3-yarn) are
// decoded by the model-level test instead.
std::vector<std::string> unshifted_fixture_names() {
  std::vector<std::string> names;
  for (const std::string& n : test::tiny_fixture_names()) {
    auto dir = test::fixture_models_dir() / n;
    if (test::ModelFixture::load(dir, dir).position_offset == 0) names.push_back(n);
  }
  return names;
}

class BackendGreedyTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BackendGreedyTest, BatchedGreedyStepsMatchTransformers) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  ASSERT_EQ(fx.position_offset, 0);
  CpuBackendOptions o;
  o.block_size = 8;
  o.num_blocks = 64;
  o.num_threads = 2;
  CpuBackend backend(dir, o);
  auto got = greedy_batched(backend, fx.prompts, static_cast<int>(fx.greedy[0].size()));
  for (size_t i = 0; i < fx.prompts.size(); ++i) EXPECT_EQ(got[i], fx.greedy[i]) << GetParam() << " prompt " << i;
}

class BackendFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BackendFixtureTest, BatchedLogitsEqualOneAtATime) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CpuBackendOptions o;
  o.block_size = 16;
  o.num_blocks = 32;
  o.num_threads = 2;
  CpuBackend backend(dir, o);
  const size_t vocab = backend.config().vocab_size;
  std::vector<Seq> seqs(fx.prompts.size());
  std::vector<int32_t> free_blocks = scrambled_blocks(o.num_blocks);
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i].id = static_cast<int64_t>(i);
    seqs[i].prompt = seqs[i].tokens = fx.prompts[i];
    seqs[i].blocks = {free_blocks[2 * i], free_blocks[2 * i + 1]};
  }
  std::vector<StepSequence> batch;
  for (const Seq& s : seqs) batch.push_back(make_step(s, static_cast<int>(s.tokens.size()), false, nullptr));
  std::vector<float> together = backend.forward_logits(batch, CpuBackend::LogitRows::kLastTokens);
  ASSERT_EQ(together.size(), seqs.size() * vocab);
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::vector<float> alone = backend.forward_logits(std::span(&batch[i], 1), CpuBackend::LogitRows::kLastTokens);
    // Every kernel computes a row's outputs in an order that does not depend on the other rows.
    for (size_t v = 0; v < vocab; ++v) ASSERT_EQ(alone[v], together[i * vocab + v]) << "prompt " << i << " token " << v;
  }
}

TEST_P(BackendFixtureTest, ChunkedPrefillGivesTheSameLogits) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = 16;
  o.num_threads = 2;
  CpuBackend backend(dir, o);
  const std::vector<int32_t>& prompt = fx.prompts.back();  // the longest
  const size_t vocab = backend.config().vocab_size;
  std::vector<std::vector<float>> last_logits;
  for (int chunks : {1, 2, 5}) {
    Seq s;
    s.prompt = s.tokens = prompt;
    s.blocks = scrambled_blocks(o.num_blocks);
    std::vector<float> logits;
    const int n = static_cast<int>(prompt.size());
    for (int c = 0; c < chunks; ++c) {
      int end = n * (c + 1) / chunks;
      StepSequence st = make_step(s, end - s.num_computed, false, nullptr);
      logits = backend.forward_logits(std::span(&st, 1), CpuBackend::LogitRows::kLastTokens);
      s.num_computed = end;
    }
    last_logits.push_back(logits);
  }
  for (size_t c = 1; c < last_logits.size(); ++c) {
    for (size_t v = 0; v < vocab; ++v) {
      // Only the attention's context split differs; it is exact per row, so allow just fp32 noise.
      ASSERT_NEAR(last_logits[c][v], last_logits[0][v], 1e-5f) << "chunking " << c << " token " << v;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, BackendGreedyTest, ::testing::ValuesIn(unshifted_fixture_names()), param_name);
INSTANTIATE_TEST_SUITE_P(Fixtures, BackendFixtureTest, ::testing::ValuesIn(test::tiny_fixture_names()), param_name);

TEST(CpuBackendDemoModel, GreedyAndLogitsMatchTransformers) {
  auto model_dir = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  auto fx = test::ModelFixture::load(test::fixture_models_dir() / "relay-demo-moe-expected", model_dir);
  CpuBackendOptions o;
  o.num_blocks = 64;
  CpuBackend backend(model_dir, o);
  // Logits of the last prompt position of prompt 0 (tolerance as in test_model_fixtures.cpp).
  Seq s;
  s.prompt = s.tokens = fx.prompts[0];
  s.blocks = {5, 9};
  StepSequence st = make_step(s, static_cast<int>(s.tokens.size()), false, nullptr);
  std::vector<float> logits = backend.forward_logits(std::span(&st, 1), CpuBackend::LogitRows::kLastTokens);
  ASSERT_EQ(logits.size(), fx.logits[0].size());
  float worst = 0.0f;
  for (size_t v = 0; v < logits.size(); ++v) {
    float err = std::fabs(logits[v] - fx.logits[0][v]);
    worst = std::max(worst, err);
    ASSERT_LE(err, 1e-4f + 1e-4f * std::fabs(fx.logits[0][v])) << "token " << v;
  }
  std::printf("[ relay-demo-moe ] max |logit error| = %.3g\n", worst);
  auto got = greedy_batched(backend, fx.prompts, static_cast<int>(fx.greedy[0].size()));
  for (size_t i = 0; i < fx.prompts.size(); ++i) EXPECT_EQ(got[i], fx.greedy[i]) << "prompt " << i;
}

// Seeded sampling depends only on (seed, sample_index) and the logits: the same request decoded
// alone, or next to another sequence, or recomputed from scratch after a "preemption", draws the
// same tokens; another seed draws different ones.
TEST(CpuBackend, SeededSamplingSurvivesBatchingAndRecompute) {
  auto dir = test::fixture_models_dir() / "qwen3-moe";
  auto fx = test::ModelFixture::load(dir, dir);
  CpuBackendOptions o;
  o.block_size = 8;
  o.num_blocks = 64;
  o.num_threads = 2;
  CpuBackend backend(dir, o);
  SamplingParams p;
  p.temperature = 1.3f;
  p.top_p = 0.9f;
  p.top_k = 50;
  p.seed = 1234;
  p.num_logprobs = 2;
  auto decode = [&](const SamplingParams& params, bool with_neighbour, int preempt_at) {
    Seq s, other;
    s.id = 1;
    s.prompt = s.tokens = fx.prompts[2];
    s.blocks = {3, 17, 40, 8, 22, 51};
    other.id = 2;
    other.prompt = other.tokens = fx.prompts[3];
    other.blocks = {0, 1, 2, 4, 5, 6, 7};
    std::vector<int32_t> out;
    for (int step = 0; step < 12; ++step) {
      if (step == preempt_at) s.num_computed = 0;  // KV dropped: recompute prompt + outputs
      std::vector<StepSequence> batch{make_step(s, static_cast<int>(s.tokens.size()) - s.num_computed, true, &params)};
      if (with_neighbour) {
        batch.insert(batch.begin(), make_step(other, static_cast<int>(other.tokens.size()) - other.num_computed, true,
                                              &params));
      }
      std::vector<SampledToken> got = backend.step(batch);
      const SampledToken& mine = got.back();
      EXPECT_EQ(mine.seq_id, 1);
      EXPECT_EQ(mine.top.size(), 2u);
      EXPECT_LE(mine.logprob, 0.0f);
      s.num_computed = static_cast<int>(s.tokens.size());
      s.tokens.push_back(mine.token);
      s.output.push_back(mine.token);
      if (with_neighbour) {
        other.num_computed = static_cast<int>(other.tokens.size());
        other.tokens.push_back(got.front().token);
        other.output.push_back(got.front().token);
      }
    }
    return s.output;
  };
  std::vector<int32_t> alone = decode(p, false, -1);
  EXPECT_EQ(decode(p, true, -1), alone);
  EXPECT_EQ(decode(p, false, 6), alone);
  SamplingParams q = p;
  q.seed = 4321;
  EXPECT_NE(decode(q, false, -1), alone);
}

TEST(CpuBackend, RejectsBlockTablesTooShortForTheContext) {
  auto dir = test::fixture_models_dir() / "qwen3-dense";
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = 8;
  o.num_threads = 1;
  CpuBackend backend(dir, o);
  std::vector<int32_t> tokens(9, 1), blocks{0, 1};
  StepSequence st;
  st.tokens = tokens;
  st.block_table = blocks;
  EXPECT_THROW(backend.forward_logits(std::span(&st, 1), CpuBackend::LogitRows::kLastTokens), Error);
  std::vector<int32_t> bad_block{0, 1, 99};
  st.block_table = bad_block;
  EXPECT_THROW(backend.forward_logits(std::span(&st, 1), CpuBackend::LogitRows::kLastTokens), Error);
}

TEST(CpuBackend, SizesThePoolFromAByteBudget) {
  auto dir = test::fixture_models_dir() / "qwen3-dense";
  CpuBackendOptions o;
  o.block_size = 16;
  o.kv_cache_bytes = 1 << 20;
  CpuBackend backend(dir, o);
  // 3 layers x (K + V) x 2 kv heads x 16 tokens x 32 dims x 4 bytes = 24 KiB per block.
  EXPECT_EQ(backend.num_kv_blocks(), (1 << 20) / (3 * 2 * 2 * 16 * 32 * 4));
  EXPECT_EQ(backend.block_size(), 16);
}

// The dummy load format runs through the ordinary loader, sharded too: random weights give finite
// logits, the same on every run, and a TP 2 split of them the one-rank logits (fp32 tolerance).
TEST(CpuBackend, RunsDummyWeightsFromTheConfigAlone) {
  const auto dir = test::fixture_models_dir() / "qwen3-moe";
  CpuBackendOptions o;
  o.block_size = 8;
  o.num_blocks = 8;
  o.num_threads = 1;
  o.load_format = LoadFormat::kDummy;
  std::vector<int32_t> tokens{3, 1, 4, 1, 5, 9, 2, 6}, blocks{0, 1};
  StepSequence st;
  st.tokens = tokens;
  st.block_table = blocks;
  auto logits = [&](const CpuBackendOptions& opt) {
    CpuBackend backend(dir, opt);
    return backend.forward_logits(std::span(&st, 1), CpuBackend::LogitRows::kAllTokens);
  };
  const std::vector<float> one = logits(o);
  for (float v : one) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(logits(o), one);
  CpuBackendOptions tp = o;
  tp.parallel = {2, 1, 1};
  tp.num_threads = 2;
  const std::vector<float> sharded = logits(tp);
  ASSERT_EQ(sharded.size(), one.size());
  for (size_t i = 0; i < one.size(); ++i)
    ASSERT_NEAR(sharded[i], one[i], 1e-4f + 1e-4f * std::fabs(one[i])) << i;
  // Not the checkpoint's weights.
  o.load_format = LoadFormat::kAuto;
  EXPECT_NE(logits(o), one);
}

}  // namespace
}  // namespace relay

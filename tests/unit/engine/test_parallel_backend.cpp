// Sharded CPU ranks against one rank: TP, TP+EP, DP and DP+EP runs of the fixture checkpoints and
// the demo model give the unsharded logits (within fp32 tolerance) and the transformers greedy
// tokens.
//
// Each run drives several sequences of different lengths through chunked prefill (two chunks, so
// the second attends to cached KV) and batched decode steps, where the DP configurations place the
// sequences on different ranks. Tolerance: sharding changes only the order of fp32 sums (the
// partial o_proj / MLP / expert outputs are added across ranks), a few ulps per op — the same
// budget the transformers fixtures use (1e-4 + 1e-4 |x|), far below the top-1/top-2 gaps along
// greedy paths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "core/error.h"
#include "engine/cpu_backend.h"
#include "fixtures.h"
#include "quant/convert/quantize_checkpoint.h"

namespace relay {
namespace {

struct Seq {
  int64_t id = 0;
  std::vector<int32_t> tokens;
  std::vector<int32_t> blocks;
  int num_computed = 0;
};

StepSequence make_step(const Seq& s, int num_new) {
  StepSequence st;
  st.seq_id = s.id;
  st.tokens = std::span<const int32_t>(s.tokens).subspan(s.num_computed, num_new);
  st.num_computed = s.num_computed;
  st.block_table = s.blocks;
  return st;
}

// Drives the prompts through `backend` and records every step's last-token logits.
class Driver {
 public:
  Driver(CpuBackend& backend, const std::vector<std::vector<int32_t>>& prompts, int decode_steps)
      : backend_(backend) {
    const int bs = backend.block_size();
    const int partitions = backend.num_kv_partitions();
    const int per_partition = backend.num_kv_blocks() / partitions;
    std::vector<int32_t> next(partitions);
    for (size_t i = 0; i < prompts.size(); ++i) {
      Seq s;
      s.id = static_cast<int64_t>(i) + 7;
      s.tokens = prompts[i];
      const int p = static_cast<int>(i) % partitions;  // spread sequences over the DP ranks
      const int need = (static_cast<int>(prompts[i].size()) + decode_steps + bs - 1) / bs;
      for (int b = 0; b < need; ++b) {
        // Pages in a scrambled order inside the partition.
        const int local = (next[p]++ * 5 + 3) % per_partition;
        s.blocks.push_back(p * per_partition + local);
      }
      seqs_.push_back(std::move(s));
    }
  }

  // Prefill in two chunks, then `decode_steps` greedy steps; returns the logits of every step.
  std::vector<std::vector<float>> run(int decode_steps) {
    std::vector<std::vector<float>> all;
    for (int chunk = 0; chunk < 2; ++chunk) {
      std::vector<StepSequence> batch;
      for (Seq& s : seqs_) {
        const int len = static_cast<int>(s.tokens.size());
        const int n = chunk == 0 ? std::max(1, len / 2) : len - s.num_computed;
        if (n > 0) batch.push_back(make_step(s, n));
      }
      all.push_back(forward(batch));
    }
    for (int step = 0; step < decode_steps; ++step) {
      std::vector<StepSequence> batch;
      for (Seq& s : seqs_)
        batch.push_back(make_step(s, static_cast<int>(s.tokens.size()) - s.num_computed));
      all.push_back(forward(batch));
    }
    return all;
  }

  // The tokens each sequence generated.
  std::vector<int32_t> generated(size_t i, size_t prompt_len) const {
    return {seqs_[i].tokens.begin() + static_cast<std::ptrdiff_t>(prompt_len),
            seqs_[i].tokens.end()};
  }

 private:
  // Runs one step, advances the sequences and appends each one's greedy token once its prompt is
  // done.
  std::vector<float> forward(const std::vector<StepSequence>& batch) {
    std::vector<float> logits = backend_.forward_logits(batch, CpuBackend::LogitRows::kLastTokens);
    const size_t vocab = backend_.config().vocab_size;
    size_t row = 0;
    for (Seq& s : seqs_) {
      const int left = static_cast<int>(s.tokens.size()) - s.num_computed;
      if (left == 0) continue;
      const int n = static_cast<int>(batch[row].tokens.size());
      s.num_computed += n;
      if (s.num_computed == static_cast<int>(s.tokens.size())) {
        const float* r = logits.data() + row * vocab;
        s.tokens.push_back(static_cast<int32_t>(std::max_element(r, r + vocab) - r));
      }
      ++row;
    }
    return logits;
  }

  CpuBackend& backend_;
  std::vector<Seq> seqs_;
};

struct Case {
  std::string model;  // fixture name, or "demo"
  parallel::ParallelConfig parallel;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.model << " " << c.parallel.describe(); }

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string n = info.param.model + "_tp" + std::to_string(info.param.parallel.tp) + "_ep" +
                  std::to_string(info.param.parallel.ep) + "_dp" +
                  std::to_string(info.param.parallel.dp);
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

class ShardedBackendTest : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedBackendTest, MatchesOneRankAndTransformers) {
  const Case& c = GetParam();
  const bool demo = c.model == "demo";
  const auto dir = demo ? std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe"
                        : test::fixture_models_dir() / c.model;
  const auto fx = test::ModelFixture::load(
      demo ? test::fixture_models_dir() / "relay-demo-moe-expected" : dir, dir);
  // The demo model's fixture prompts are long: two of them keep the test quick.
  std::vector<std::vector<int32_t>> prompts = fx.prompts;
  if (demo) prompts.resize(2);
  const int steps = demo ? 6 : static_cast<int>(fx.greedy[0].size());

  CpuBackendOptions one;
  one.block_size = 8;
  one.num_blocks = 64;
  one.num_threads = 1;
  CpuBackendOptions sharded = one;
  sharded.parallel = c.parallel;
  sharded.num_threads = c.parallel.world_size();
  CpuBackend reference(dir, one);
  CpuBackend backend(dir, sharded);
  ASSERT_EQ(backend.num_kv_partitions(), c.parallel.dp);
  ASSERT_EQ(backend.num_kv_blocks(), one.num_blocks * c.parallel.dp);

  Driver want(reference, prompts, steps), got(backend, prompts, steps);
  const auto want_logits = want.run(steps), got_logits = got.run(steps);
  ASSERT_EQ(want_logits.size(), got_logits.size());
  float worst = 0.0f;
  for (size_t s = 0; s < want_logits.size(); ++s) {
    ASSERT_EQ(want_logits[s].size(), got_logits[s].size()) << "step " << s;
    for (size_t i = 0; i < want_logits[s].size(); ++i) {
      const float err = std::fabs(got_logits[s][i] - want_logits[s][i]);
      worst = std::max(worst, err);
      ASSERT_LE(err, 1e-4f + 1e-4f * std::fabs(want_logits[s][i]))
          << "step " << s << " element " << i;
    }
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto tokens = got.generated(i, prompts[i].size());
    EXPECT_EQ(tokens, want.generated(i, prompts[i].size())) << "prompt " << i;
    if (fx.position_offset == 0) {
      std::vector<int32_t> expected(fx.greedy[i].begin(),
                                    fx.greedy[i].begin() + static_cast<std::ptrdiff_t>(steps));
      std::vector<int32_t> head(tokens.begin(),
                                tokens.begin() + static_cast<std::ptrdiff_t>(steps));
      EXPECT_EQ(head, expected) << "prompt " << i << " against transformers";
    }
  }
  RecordProperty("max_abs_logit_error", std::to_string(worst));
}

std::vector<Case> cases() {
  using P = parallel::ParallelConfig;
  std::vector<Case> out;
  // Every layout on the models that exercise it: TP 2 (KV heads split), TP 4 (the 2 KV heads
  // replicated), TP + EP, DP, DP + EP.
  for (const char* m : {"qwen3-dense", "qwen3-attention-bias"}) {
    out.push_back({m, P{2, 1, 1}});
    out.push_back({m, P{4, 1, 1}});
    out.push_back({m, P{1, 1, 2}});
  }
  for (const char* m : {"qwen3-moe", "qwen3-moe-no-norm-topk", "demo"}) {
    for (P p : {P{2, 1, 1}, P{4, 1, 1}, P{2, 2, 1}, P{4, 4, 1}, P{1, 2, 2}, P{1, 4, 4}})
      out.push_back({m, p});
  }
  // 6 experts and a dense layer (mlp_only_layers): EP 2 only.
  for (P p : {P{2, 2, 1}, P{1, 2, 2}, P{2, 1, 1}}) out.push_back({"qwen3-moe-sparse-step", p});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardedBackendTest, ::testing::ValuesIn(cases()), case_name);

// An FP8 checkpoint shards like a bf16 one. The demo model's experts are 192 wide, two weight-scale
// blocks (128 + 64 rows); TP 2 gives each rank 96 rows (inside the first block, or across the
// boundary) and TP 4 gives 48. Each rank dequantises a tensor with the checkpoint's 128 x 128
// blocks and then takes its slice, so no rank applies another block's scale.
TEST(ShardedBackend, Fp8CheckpointSplitsWidthsThatAreNotMultiplesOf128) {
  const auto demo = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  const auto dir = std::filesystem::path(::testing::TempDir()) / "relay_sharded_fp8_demo";
  std::filesystem::remove_all(dir);
  quant::quantize_checkpoint({demo, dir, quant::QuantMethod::Fp8Block, {}});
  const auto fx =
      test::ModelFixture::load(test::fixture_models_dir() / "relay-demo-moe-expected", dir);
  std::vector<std::vector<int32_t>> prompts = fx.prompts;
  prompts.resize(2);
  const int steps = 4;
  CpuBackendOptions one;
  one.block_size = 8;
  one.num_blocks = 64;
  one.num_threads = 1;
  CpuBackend reference(dir, one);
  Driver want(reference, prompts, steps);
  const auto want_logits = want.run(steps);
  for (parallel::ParallelConfig p :
       {parallel::ParallelConfig{2, 1, 1}, parallel::ParallelConfig{4, 1, 1}}) {
    CpuBackendOptions sharded = one;
    sharded.parallel = p;
    sharded.num_threads = p.world_size();
    CpuBackend backend(dir, sharded);
    Driver got(backend, prompts, steps);
    const auto got_logits = got.run(steps);
    ASSERT_EQ(want_logits.size(), got_logits.size());
    for (size_t st = 0; st < want_logits.size(); ++st) {
      for (size_t i = 0; i < want_logits[st].size(); ++i) {
        ASSERT_LE(std::fabs(got_logits[st][i] - want_logits[st][i]),
                  1e-4f + 1e-4f * std::fabs(want_logits[st][i]))
            << p.describe() << " step " << st << " element " << i;
      }
    }
    for (size_t i = 0; i < prompts.size(); ++i)
      EXPECT_EQ(got.generated(i, prompts[i].size()), want.generated(i, prompts[i].size()))
          << p.describe() << " prompt " << i;
  }
}

TEST(ShardedBackend, RefusesLayoutsTheModelDoesNotDivide) {
  const auto dir =
      test::fixture_models_dir() / "qwen3-moe-sparse-step";  // 4 q heads, 2 KV heads, 6 experts
  CpuBackendOptions o;
  o.num_blocks = 8;
  auto expect_error = [&](parallel::ParallelConfig p, const std::string& needle) {
    o.parallel = p;
    try {
      CpuBackend backend(dir, o);
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({3, 1, 1}, "num_attention_heads");
  expect_error({4, 4, 1}, "num_experts");
  expect_error({2, 3, 1}, "--ep");
  expect_error({2, 2, 2}, "--dp");
}

TEST(ShardedBackend, ABadSequenceFailsTheStepAndTheNextStepStillRuns) {
  const auto dir = test::fixture_models_dir() / "qwen3-moe";
  CpuBackendOptions o;
  o.block_size = 8;
  o.num_blocks = 16;
  o.parallel = {1, 2, 2};
  CpuBackend backend(dir, o);
  Seq good{1, {5, 6, 7}, {0}, 0};
  Seq bad{2, {8, 9, 10}, {16}, 0};  // rank 1's partition
  bad.tokens.push_back(
      1 << 30);  // out of the vocabulary: rank 1 fails while rank 0 waits in the MoE
  std::vector<StepSequence> batch{make_step(good, 3), make_step(bad, 4)};
  EXPECT_THROW(backend.forward_logits(batch, CpuBackend::LogitRows::kLastTokens), Error);
  std::vector<StepSequence> retry{make_step(good, 3)};
  EXPECT_EQ(backend.forward_logits(retry, CpuBackend::LogitRows::kLastTokens).size(),
            static_cast<size_t>(backend.config().vocab_size));
  Seq straddling{3, {1, 2, 3, 4, 5, 6, 7, 8, 9}, {3, 17}, 0};  // blocks on two ranks
  std::vector<StepSequence> wrong{make_step(straddling, 9)};
  EXPECT_THROW(backend.forward_logits(wrong, CpuBackend::LogitRows::kLastTokens), Error);
}

}  // namespace
}  // namespace relay

// Sharded CPU ranks against one rank: TP, TP+EP, DP and DP+EP runs of the fixture checkpoints (the
// hybrids' included) and the demo model give the unsharded logits (within fp32 tolerance) and the transformers greedy
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
#include <functional>
#include <numeric>
#include <thread>

#include "../error_text.h"
#include "core/error.h"
#include "engine/cpu_backend.h"
#include "fixtures.h"
#include "convert/quantize_checkpoint.h"
#include "../free_port.h"

namespace relay {
namespace {

struct Seq {
  int64_t id = 0;
  std::vector<int32_t> tokens;
  std::vector<int32_t> blocks;
  int num_computed = 0;
  std::vector<int32_t> state_slots;  // its recurrent-state slot (hybrid models), in its partition
};

StepSequence make_step(const Seq& s, int num_new) {
  StepSequence st;
  st.seq_id = s.id;
  st.tokens = std::span<const int32_t>(s.tokens).subspan(s.num_computed, num_new);
  st.num_computed = s.num_computed;
  st.block_table = s.blocks;
  st.state_slots = s.state_slots;
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
      if (backend.num_state_slots() > 0) {  // the last slots of the partition, one per sequence
        const int slots = backend.num_state_slots() / partitions;
        s.state_slots = {(p + 1) * slots - 1 - static_cast<int>(i) / partitions};
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

using Case = test::LayoutCase;

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
  // The hybrids (2 Gated DeltaNet key heads and 4 value heads, 2 KV heads, 8 experts with a shared
  // expert): TP 2 splits the DeltaNet heads, the recurrent state and the shared expert; EP and DP
  // as Qwen3-MoE (a DP rank holds its sequences' states). Qwen3.5's experts are fused 3-D tensors.
  for (const char* m : {"qwen3_5-moe", "qwen3-next"}) {
    for (P p : {P{2, 1, 1}, P{2, 2, 1}, P{1, 1, 2}, P{1, 2, 2}, P{1, 4, 4}}) out.push_back({m, p});
  }
  for (P p : {P{2, 1, 1}, P{1, 1, 2}}) out.push_back({"qwen3_5-dense", p});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardedBackendTest, ::testing::ValuesIn(cases()), test::layout_case_name);

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
  o.parallel = {4, 1, 1};  // 2 Gated DeltaNet key heads
  try {
    CpuBackend backend(test::fixture_models_dir() / "qwen3_5-moe", o);
    ADD_FAILURE() << "expected an error mentioning linear_num_key_heads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("linear_num_key_heads"), std::string::npos) << e.what();
  }
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

// ---- Several nodes: the ranks in several processes (here: threads, each with its own backend)
// ----

using test::free_port;

// The same sampled tokens, bit for bit: ids, logprobs and top logprobs.
void expect_same_tokens(const std::vector<SampledToken>& got, const std::vector<SampledToken>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].seq_id, want[i].seq_id) << i;
    EXPECT_EQ(got[i].token, want[i].token) << i;
    EXPECT_EQ(got[i].logprob, want[i].logprob) << i;
    EXPECT_EQ(got[i].top, want[i].top) << i;
  }
}

// Node 0's backend in the calling thread, nodes 1.. following it on their own threads until node 0
// is destroyed. `options(n)` gives node n's options (their .nodes is filled in here).
class MultiNode {
 public:
  MultiNode(const std::filesystem::path& dir, int nnodes,
            const std::function<CpuBackendOptions(int)>& options) {
    const std::string address = "127.0.0.1:" + std::to_string(free_port());
    auto with_node = [&](int n) {
      CpuBackendOptions o = options(n);
      o.nodes = {nnodes, n, address};
      return o;
    };
    errors_.resize(nnodes);
    for (int n = 1; n < nnodes; ++n) {
      followers_.emplace_back([this, dir, o = with_node(n), n] {
        try {
          CpuBackend follower(dir, o);
          follower.follow();
        } catch (const Error& e) {
          errors_[n] = e.what();
        }
      });
    }
    try {
      leader_ = std::make_unique<CpuBackend>(dir, with_node(0));
    } catch (const Error& e) {
      errors_[0] = e.what();
    }
  }
  ~MultiNode() { join(); }

  CpuBackend* leader() { return leader_.get(); }
  // Destroys node 0 (which shuts the followers down) and returns every node's error, if any.
  const std::vector<std::string>& join() {
    leader_.reset();
    for (auto& t : followers_) t.join();
    followers_.clear();
    return errors_;
  }

 private:
  std::unique_ptr<CpuBackend> leader_;
  std::vector<std::thread> followers_;
  std::vector<std::string> errors_;
};

struct NodeCase {
  parallel::ParallelConfig parallel;
  int nnodes;
};

class MultiNodeBackendTest : public ::testing::TestWithParam<NodeCase> {};

// The collectives across processes add in the same rank order as the threads of one process, so a
// multi-node worker's logits are bit-identical to the one-process worker's of the same layout.
TEST_P(MultiNodeBackendTest, EqualsOneProcessBitForBit) {
  const NodeCase& c = GetParam();
  const auto dir = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  const auto fx =
      test::ModelFixture::load(test::fixture_models_dir() / "relay-demo-moe-expected", dir);
  std::vector<std::vector<int32_t>> prompts = fx.prompts;
  prompts.resize(3);
  const int steps = 4;
  CpuBackendOptions o;
  o.block_size = 8;
  o.num_blocks = 32;
  o.parallel = c.parallel;
  o.num_threads = c.parallel.world_size();
  CpuBackend one_process(dir, o);
  Driver want(one_process, prompts, steps);
  const auto want_logits = want.run(steps);

  o.num_threads = c.parallel.world_size() / c.nnodes;
  MultiNode nodes(dir, c.nnodes, [&](int) { return o; });
  ASSERT_NE(nodes.leader(), nullptr) << nodes.join()[0];
  ASSERT_EQ(nodes.leader()->num_kv_blocks(), o.num_blocks * c.parallel.dp);
  Driver got(*nodes.leader(), prompts, steps);
  EXPECT_EQ(got.run(steps), want_logits);
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(got.generated(i, prompts[i].size()), want.generated(i, prompts[i].size()));
  for (const std::string& e : nodes.join()) EXPECT_EQ(e, "");
}

INSTANTIATE_TEST_SUITE_P(Layouts, MultiNodeBackendTest,
                         ::testing::Values(NodeCase{{2, 1, 1}, 2}, NodeCase{{2, 2, 1}, 2},
                                           NodeCase{{1, 2, 2}, 2}, NodeCase{{4, 4, 1}, 2},
                                           NodeCase{{1, 4, 4}, 4}),
                         [](const ::testing::TestParamInfo<NodeCase>& info) {
                           const NodeCase& c = info.param;
                           return "tp" + std::to_string(c.parallel.tp) + "_ep" +
                                  std::to_string(c.parallel.ep) + "_dp" +
                                  std::to_string(c.parallel.dp) + "_nodes" +
                                  std::to_string(c.nnodes);
                         });

// step() samples each sequence on the node holding its logits (under DP, the follower's rank for
// the sequences in its partition): the tokens, logprobs and top logprobs are the one-process
// worker's, with penalties that read the prompt and output tokens.
TEST(MultiNodeBackend, SamplesOnTheNodeHoldingTheLogits) {
  const auto dir = test::fixture_models_dir() / "qwen3-moe";
  CpuBackendOptions o;
  o.block_size = 8;
  o.num_blocks = 16;
  o.parallel = {1, 2, 2};
  CpuBackend one_process(dir, o);
  MultiNode nodes(dir, 2, [&](int) { return o; });
  ASSERT_NE(nodes.leader(), nullptr) << nodes.join()[0];

  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.num_logprobs = 3;
  SamplingParams sampled;
  sampled.temperature = 0.8f;
  sampled.top_p = 0.9f;
  sampled.seed = 1234;
  sampled.repetition_penalty = 1.3f;
  sampled.frequency_penalty = 0.5f;
  const std::vector<int32_t> history{5, 6, 7, 5};
  Seq a{1, {5, 6, 7}, {0}, 0};
  Seq b{2, {8, 9, 10, 11}, {16}, 0};  // node 1's partition
  Seq c{3, {12, 13}, {17}, 0};        // node 1's partition, not sampling
  std::vector<StepSequence> batch{make_step(a, 3), make_step(b, 4), make_step(c, 2)};
  batch[0].sample = true;
  batch[0].sampling = &greedy;
  batch[1].sample = true;
  batch[1].sampling = &sampled;
  batch[1].prompt_tokens = b.tokens;
  batch[1].output_tokens = history;
  batch[1].sample_index = 4;
  const std::vector<SampledToken> want = one_process.step(batch);
  const std::vector<SampledToken> got = nodes.leader()->step(batch);
  ASSERT_EQ(want.size(), 2u);
  expect_same_tokens(got, want);
  EXPECT_EQ(got[0].top.size(), 3u);
  for (const std::string& e : nodes.join()) EXPECT_EQ(e, "");
}

// Prompt logprobs come from the node holding each sequence's logits (node 1's rank for the DP
// partition it holds; node 0's TP rank 0 under TP), next to a sampled token, bit for bit the
// one-process worker's: a chunk in the middle of a prompt (every row scored) and a chunk that
// ends its prompt (every row but the sampled last).
TEST(MultiNodeBackend, PromptLogprobsComeFromTheNodeHoldingTheLogits) {
  const auto dir = test::fixture_models_dir() / "qwen3-moe";
  for (const parallel::ParallelConfig p :
       {parallel::ParallelConfig{1, 2, 2}, parallel::ParallelConfig{2, 1, 1}}) {
    SCOPED_TRACE(p.describe());
    CpuBackendOptions o;
    o.block_size = 8;
    o.num_blocks = 16;
    o.parallel = p;
    CpuBackend one_process(dir, o);
    MultiNode nodes(dir, 2, [&](int) { return o; });
    ASSERT_NE(nodes.leader(), nullptr) << nodes.join()[0];

    SamplingParams greedy;
    greedy.temperature = 0.0f;
    greedy.num_logprobs = 1;
    const std::vector<int32_t> prompt_a{5, 6, 7, 8, 9, 10}, prompt_b{8, 9, 10, 11, 12};
    Seq a{1, prompt_a, {0}, 0};
    Seq b{2, prompt_b, {p.dp > 1 ? 16 : 1}, 0};  // under DP, node 1's partition
    auto step = [&](CpuBackend& backend) {
      std::vector<std::vector<TokenLogprob>> rows(2);
      std::vector<StepSequence> batch{make_step(a, 4), make_step(b, 5)};
      batch[0].prompt_tokens = prompt_a;
      batch[0].num_prompt_logprobs = 3;
      batch[0].prompt_logprobs = &rows[0];
      batch[1].prompt_tokens = prompt_b;
      batch[1].num_prompt_logprobs = 2;
      batch[1].prompt_logprobs = &rows[1];
      batch[1].sample = true;
      batch[1].sampling = &greedy;
      const std::vector<SampledToken> sampled = backend.step(batch);
      EXPECT_EQ(sampled.size(), 1u);
      return std::pair{rows, sampled.empty() ? SampledToken{} : sampled[0]};
    };
    const auto [want_rows, want_token] = step(one_process);
    const auto [got_rows, got_token] = step(*nodes.leader());
    EXPECT_EQ(got_token.token, want_token.token);
    EXPECT_EQ(got_token.logprob, want_token.logprob);
    ASSERT_EQ(want_rows[0].size(), 4u);  // positions 1..4 of a
    ASSERT_EQ(want_rows[1].size(), 4u);  // positions 1..4 of b; its row 4 samples
    for (size_t i = 0; i < 2; ++i) {
      ASSERT_EQ(got_rows[i].size(), want_rows[i].size());
      for (size_t j = 0; j < want_rows[i].size(); ++j) {
        EXPECT_EQ(got_rows[i][j].token, (i == 0 ? prompt_a : prompt_b)[j + 1]);
        EXPECT_EQ(got_rows[i][j].token, want_rows[i][j].token);
        EXPECT_EQ(got_rows[i][j].logprob, want_rows[i][j].logprob);
        EXPECT_EQ(got_rows[i][j].top, want_rows[i][j].top);
        EXPECT_EQ(got_rows[i][j].top.size(), i == 0 ? 3u : 2u);
      }
    }
    for (const std::string& e : nodes.join()) EXPECT_EQ(e, "");
  }
}

// Drafts are verified on the node holding each sequence's logits: the tokens a step commits (the
// accepted drafts, then the token after them) and their logprobs are the one-process worker's, bit
// for bit, under DP + EP (the second sequence in node 1's partition) and TP: a greedy sequence
// whose first draft is right and second wrong, and a seeded one with penalties.
TEST(MultiNodeBackend, VerifiesDraftsOnTheNodeHoldingTheLogits) {
  const auto dir = test::fixture_models_dir() / "qwen3-moe";
  for (const parallel::ParallelConfig p :
       {parallel::ParallelConfig{1, 2, 2}, parallel::ParallelConfig{2, 1, 1}}) {
    SCOPED_TRACE(p.describe());
    CpuBackendOptions o;
    o.block_size = 8;
    o.num_blocks = 16;
    o.parallel = p;
    CpuBackend one_process(dir, o);
    MultiNode nodes(dir, 2, [&](int) { return o; });
    ASSERT_NE(nodes.leader(), nullptr) << nodes.join()[0];

    // The greedy token after 5 6 7, so that the first draft is accepted.
    Seq probe{9, {5, 6, 7}, {5}, 0};
    const std::vector<StepSequence> probe_batch{make_step(probe, 3)};
    const std::vector<float> logits =
        one_process.forward_logits(probe_batch, CpuBackend::LogitRows::kLastTokens);
    const auto next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    SamplingParams greedy;
    greedy.temperature = 0.0f;
    greedy.num_logprobs = 3;
    SamplingParams sampled;
    sampled.temperature = 0.8f;
    sampled.seed = 4321;
    sampled.presence_penalty = 0.5f;
    const std::vector<int32_t> history{10};
    Seq a{1, {5, 6, 7, next, (next + 1) % 512}, {0}, 0};
    Seq b{2, {8, 9, 10, 11, 12}, {p.dp > 1 ? 16 : 1}, 0};
    auto step = [&](CpuBackend& backend) {
      Seq a_run = a, b_run = b;
      std::vector<StepSequence> prefill{make_step(a_run, 2), make_step(b_run, 2)};
      EXPECT_TRUE(backend.step(prefill).empty());
      a_run.num_computed = b_run.num_computed = 2;
      std::vector<StepSequence> batch{make_step(a_run, 3), make_step(b_run, 3)};
      for (StepSequence& s : batch) {
        s.sample = true;
        s.num_draft_tokens = 2;
      }
      batch[0].sampling = &greedy;
      batch[1].sampling = &sampled;
      batch[1].prompt_tokens = std::span<const int32_t>(b.tokens).first(3);
      batch[1].output_tokens = history;
      batch[1].sample_index = 1;
      return backend.step(batch);
    };
    const std::vector<SampledToken> want = step(one_process);
    const std::vector<SampledToken> got = step(*nodes.leader());
    ASSERT_GE(want.size(), 3u);  // a: its first draft and the correction; b: 1 to 3 tokens
    EXPECT_EQ(want[0].seq_id, 1);
    EXPECT_EQ(want[0].token, next);
    EXPECT_EQ(want[1].seq_id, 1);
    EXPECT_NE(want[1].token, (next + 1) % 512);
    expect_same_tokens(got, want);
    for (const std::string& e : nodes.join()) EXPECT_EQ(e, "");
  }
}

// A hybrid model's drafts across nodes (DP 2 + EP 2 over 2 nodes: each node samples its DP group's
// sequence and rolls its recurrent state back there): six verify steps of two drafts each (both
// right, the second wrong, the first wrong, by turns, from the one-process greedy continuation)
// commit exactly the one-process worker's tokens and logprobs, which a follower keeping an unrolled
// state would not.
TEST(MultiNodeBackend, HybridStatesRollBackOnTheNodeThatSampled) {
  const auto dir = test::fixture_models_dir() / "qwen3_5-moe";
  CpuBackendOptions o;
  o.block_size = 8;
  o.num_blocks = 16;
  o.parallel = {1, 2, 2};
  o.num_state_slots = 6;  // per DP rank: a sequence's slot and two draft slots
  CpuBackend one_process(dir, o);
  MultiNode nodes(dir, 2, [&](int) { return o; });
  ASSERT_NE(nodes.leader(), nullptr) << nodes.join()[0];
  const std::vector<int32_t> prompt_a{5, 6, 7, 8, 9, 10, 11}, prompt_b{40, 41, 42, 43, 44};
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.num_logprobs = 2;
  // The sequences: a in partition 0, b in partition 1 (blocks 16.., slots 6..).
  auto start = [](int64_t id, const std::vector<int32_t>& prompt, int32_t block, int32_t slot) {
    Seq s{id, prompt, {block, block + 1, block + 2, block + 3}, 0, {slot, slot + 1, slot + 2}};
    return s;
  };
  // One step of both: their uncomputed tokens and then `drafts`; commits what comes back.
  auto step = [&](CpuBackend& backend, std::vector<Seq>& seqs,
                  const std::vector<std::vector<int32_t>>& drafts) {
    std::vector<std::vector<int32_t>> tokens(seqs.size());
    std::vector<StepSequence> batch;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = seqs[i];
      const size_t uncomputed = s.tokens.size() - static_cast<size_t>(s.num_computed);
      s.tokens.insert(s.tokens.end(), drafts[i].begin(), drafts[i].end());
      StepSequence st = make_step(s, static_cast<int>(uncomputed + drafts[i].size()));
      st.sample = true;
      st.sampling = &greedy;
      st.num_draft_tokens = static_cast<int32_t>(drafts[i].size());
      batch.push_back(st);
    }
    const std::vector<SampledToken> out = backend.step(batch);
    size_t at = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = seqs[i];
      s.tokens.resize(s.tokens.size() - drafts[i].size());
      s.num_computed = static_cast<int>(s.tokens.size());  // the last token's, then accepted drafts
      size_t n = 0;
      while (at + n < out.size() && out[at + n].seq_id == s.id) ++n;
      for (size_t j = 0; j < n; ++j) s.tokens.push_back(out[at + j].token);
      s.num_computed += static_cast<int>(n) - 1;
      at += n;
    }
    return out;
  };
  // The greedy continuations without drafts.
  std::vector<Seq> ref{start(1, prompt_a, 0, 0), start(2, prompt_b, 16, 6)};
  for (int i = 0; i < 20; ++i) step(one_process, ref, {{}, {}});
  auto run = [&](CpuBackend& backend) {
    std::vector<Seq> seqs{start(1, prompt_a, 0, 0), start(2, prompt_b, 16, 6)};
    std::vector<SampledToken> all = step(backend, seqs, {{}, {}});
    for (int k = 0; k < 6; ++k) {
      std::vector<std::vector<int32_t>> drafts;
      for (size_t i = 0; i < seqs.size(); ++i) {
        const size_t at = seqs[i].tokens.size();
        std::vector<int32_t> d{ref[i].tokens.at(at), ref[i].tokens.at(at + 1)};
        if (k % 3 == 1) d[1] = (d[1] + 1) % 512;
        if (k % 3 == 2) d[0] = (d[0] + 1) % 512;
        drafts.push_back(d);
      }
      const std::vector<SampledToken> out = step(backend, seqs, drafts);
      all.insert(all.end(), out.begin(), out.end());
    }
    return all;
  };
  const std::vector<SampledToken> want = run(one_process), got = run(*nodes.leader());
  EXPECT_GT(want.size(), 2u + 6 * 2);  // drafts were accepted
  expect_same_tokens(got, want);
  for (const std::string& e : nodes.join()) EXPECT_EQ(e, "");
}

// A rank of node 1 fails (a token outside the vocabulary) while node 0's rank waits for it in the
// MoE exchange: the step fails on node 0 naming the cause, every node re-arms its collectives, and
// the next step runs.
TEST(MultiNodeBackend, AFailedStepOnAFollowerFailsTheStepAndTheNextStepRuns) {
  const auto dir = test::fixture_models_dir() / "qwen3-moe";
  CpuBackendOptions o;
  o.block_size = 8;
  o.num_blocks = 16;
  o.parallel = {1, 2, 2};
  MultiNode nodes(dir, 2, [&](int) { return o; });
  ASSERT_NE(nodes.leader(), nullptr) << nodes.join()[0];
  Seq good{1, {5, 6, 7}, {0}, 0};
  Seq bad{2, {8, 9, 10, 1 << 30}, {16}, 0};  // node 1's partition
  std::vector<StepSequence> batch{make_step(good, 3), make_step(bad, 4)};
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      nodes.leader()->forward_logits(batch, CpuBackend::LogitRows::kLastTokens);
      ADD_FAILURE() << "the step with a token outside the vocabulary ran";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("node 1: "), std::string::npos) << what;
      EXPECT_NE(what.find("vocab"), std::string::npos) << what;
    }
    std::vector<StepSequence> retry{make_step(good, 3)};
    EXPECT_EQ(nodes.leader()->forward_logits(retry, CpuBackend::LogitRows::kLastTokens).size(),
              static_cast<size_t>(nodes.leader()->config().vocab_size));
  }
  for (const std::string& e : nodes.join()) EXPECT_EQ(e, "");
}

// Nodes started with different flags refuse to form a worker, each naming the difference.
TEST(MultiNodeBackend, NodesWithDifferentFlagsRefuseToJoin) {
  const auto dir = test::fixture_models_dir() / "qwen3-moe";
  MultiNode nodes(dir, 2, [&](int n) {
    CpuBackendOptions o;
    o.num_blocks = 8;
    o.parallel = {2, 1, 1};
    o.block_size = n == 0 ? 8 : 16;
    return o;
  });
  EXPECT_EQ(nodes.leader(), nullptr);
  for (const std::string& e : nodes.join()) {
    EXPECT_NE(e.find("node 1 was started for"), std::string::npos) << e;
    EXPECT_NE(e.find("--block-size 16"), std::string::npos) << e;
  }
}

// What runs after sampling (a hybrid model's draft rollback, an MTP head's drafts) runs on the
// node that samples a DP group, so a TP group split over nodes is refused before any node joins.
TEST(MultiNodeBackend, WorkAfterSamplingNeedsEachTpGroupOnOneNode) {
  CpuBackendOptions o;
  o.num_blocks = 8;
  o.parallel = {2, 1, 1};
  o.nodes = {2, 0, "127.0.0.1:1"};
  const std::string hybrid = test::error_text(
      [&] { CpuBackend b(test::fixture_models_dir() / "qwen3_5-moe", o); });
  EXPECT_NE(hybrid.find("(linear-attention layers) across nodes needs each TP group on one node"),
            std::string::npos)
      << hybrid;
  o.mtp = {.enabled = true, .dir = (test::fixture_models_dir() / "qwen3-moe-mtp").string()};
  o.num_mtp_drafts = 1;
  const std::string mtp =
      test::error_text([&] { CpuBackend b(test::fixture_models_dir() / "qwen3-moe", o); });
  EXPECT_NE(mtp.find("--speculative-config mtp across nodes needs each TP group on one node"),
            std::string::npos)
      << mtp;
  EXPECT_NE(mtp.find("--tp 2 must divide the 1 ranks"), std::string::npos) << mtp;
}

TEST(MultiNodeBackend, RefusesNodeCountsThatDoNotSplitTheRanks) {
  const auto dir = test::fixture_models_dir() / "qwen3-moe";
  CpuBackendOptions o;
  o.num_blocks = 8;
  o.parallel = {2, 1, 1};
  for (auto [nodes, needle] :
       {std::pair{parallel::NodeConfig{4, 0, "127.0.0.1:1"}, "evenly"},
        std::pair{parallel::NodeConfig{2, 2, "127.0.0.1:1"}, "--node-rank"},
        std::pair{parallel::NodeConfig{2, 0, ""}, "--dist-init"},
        std::pair{parallel::NodeConfig{1, 0, "127.0.0.1:1"}, "--nnodes 2"}}) {
    o.nodes = nodes;
    try {
      CpuBackend backend(dir, o);
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace relay

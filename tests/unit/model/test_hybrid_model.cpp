// The hybrid models (Qwen3.5 / Qwen3-Next: Gated DeltaNet + gated attention) on the CPU against
// transformers, through Model::forward with a KV pool for the attention layers and a
// recurrent-state pool for the linear-attention ones, on the four fixtures of
// tests/fixtures/models/HYBRID.md (VLM layout with fused experts, text-only, Qwen3-Next's
// interleaved projections, dense).
//
// Checked: every prompt position of a one-chunk prefill against logits_<i>; the same prompt in two
// chunks (37 + 33) against split_logits; decoding the greedy tokens one step at a time against
// decode_logits_<i> and the greedy tokens themselves; all four prompts in one batch, in their own
// slots, prefilled and then decoded together (no state crosses slots); a fresh flag restarting a
// slot that held another sequence's state; and the batch checks. Tolerance, as the fixtures'
// README argues: |ours - hf| <= 1e-4 + 1e-4 |hf| (transformers' own paths agree to ~5e-6; the
// greedy margins are >= 3.4e-3).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "../engine/fixtures.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/registry.h"

namespace relay {
namespace {

constexpr float kAbsTol = 1e-4f;
constexpr float kRelTol = 1e-4f;

std::filesystem::path fixture(const std::string& name) {
  return std::filesystem::path(RELAY_FIXTURES_DIR) / "models" / name;
}

// expected.json and expected.safetensors of one fixture.
struct Expected {
  std::vector<std::vector<int32_t>> prompts, greedy;
  std::vector<int> split;  // the two chunk lengths of split_logits
  int split_prompt = 0;
  std::vector<std::vector<float>> logits, decode_logits;  // per prompt, [rows, vocab]
  std::vector<float> split_logits;

  static Expected load(const std::filesystem::path& dir) {
    Expected e;
    std::ifstream in(dir / "expected.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    e.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
    e.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
    e.split = j.at("split").at("pieces").get<std::vector<int>>();
    e.split_prompt = j.at("split").at("prompt").get<int>();
    SafetensorsFile st(dir / "expected.safetensors");
    auto read = [&](const std::string& name) { return test::read_f32(st, name); };
    for (size_t i = 0; i < e.prompts.size(); ++i) {
      e.logits.push_back(read(str("logits_", i)));
      e.decode_logits.push_back(read(str("decode_logits_", i)));
    }
    e.split_logits = read("split_logits");
    return e;
  }
};

// One sequence of the runner: its KV blocks, its state slot, and how many tokens it has computed.
struct Seq {
  std::vector<int32_t> blocks;
  int32_t slot = 0;
  int num_computed = 0;
};

// Drives Model::forward over several sequences at once, each in its own (shuffled) KV blocks and
// state slot; a sequence's first step starts its state fresh.
class Runner {
 public:
  static constexpr int kBlockSize = 4, kBlocksPerSeq = 24, kMaxSeqs = 4;

  explicit Runner(const std::filesystem::path& dir, int num_slots = kMaxSeqs)
      : model_(load_model(dir)),
        kv_(model_->kv_layout(kBlockSize, kBlocksPerSeq * kMaxSeqs)),
        state_(model_->recurrent_state_layout(num_slots)),
        pool_(2) {
    free_blocks_.resize(kBlocksPerSeq * kMaxSeqs);
    std::iota(free_blocks_.begin(), free_blocks_.end(), 0);
    std::shuffle(free_blocks_.begin(), free_blocks_.end(), std::mt19937(11));
  }

  Seq new_seq(int32_t slot) {
    Seq s;
    s.slot = slot;
    s.blocks.assign(free_blocks_.end() - kBlocksPerSeq, free_blocks_.end());
    free_blocks_.resize(free_blocks_.size() - kBlocksPerSeq);
    return s;
  }

  // Appends tokens[k] to *seqs[k] in one forward; returns each sequence's logits, one row per new
  // token. `fresh` overrides the state flags (default: fresh on a sequence's first step);
  // `snapshots` are the batch's state_snapshot_slots (default: none).
  std::vector<std::vector<float>> step(const std::vector<Seq*>& seqs,
                                       const std::vector<std::vector<int32_t>>& tokens,
                                       std::vector<uint8_t> fresh = {},
                                       const std::vector<int32_t>& snapshots = {}) {
    std::vector<int32_t> ids, positions, starts{0}, context, tables, rows, slots;
    std::vector<int64_t> slot_mapping;
    for (size_t k = 0; k < seqs.size(); ++k) {
      Seq& s = *seqs[k];
      for (size_t j = 0; j < tokens[k].size(); ++j) {
        const int pos = s.num_computed + static_cast<int>(j);
        ids.push_back(tokens[k][j]);
        positions.push_back(pos);
        slot_mapping.push_back(static_cast<int64_t>(s.blocks[pos / kBlockSize]) * kBlockSize +
                               pos % kBlockSize);
        rows.push_back(static_cast<int32_t>(ids.size()) - 1);
      }
      starts.push_back(static_cast<int32_t>(ids.size()));
      context.push_back(s.num_computed + static_cast<int32_t>(tokens[k].size()));
      tables.insert(tables.end(), s.blocks.begin(), s.blocks.end());
      slots.push_back(s.slot);
      if (fresh.size() < seqs.size()) fresh.push_back(s.num_computed == 0);
    }
    ForwardBatch b{ids, positions, starts, context, tables, kBlocksPerSeq, slot_mapping, rows};
    b.recurrent_state = &state_;
    b.state_slots = slots;
    b.state_fresh = fresh;
    b.state_snapshot_slots = snapshots;
    std::vector<float> logits;
    model_->forward(b, kv_, pool_, logits);
    std::vector<std::vector<float>> out;
    const size_t v = vocab();
    for (size_t k = 0; k < seqs.size(); ++k) {
      out.emplace_back(logits.begin() + starts[k] * v, logits.begin() + starts[k + 1] * v);
      seqs[k]->num_computed += static_cast<int>(tokens[k].size());
    }
    return out;
  }

  std::vector<float> run(Seq& s, const std::vector<int32_t>& tokens) {
    return step({&s}, {tokens}).front();
  }

  const Model& model() const { return *model_; }
  size_t vocab() const { return static_cast<size_t>(model_->vocab_size()); }

 private:
  std::unique_ptr<Model> model_;
  KvPool kv_;
  RecurrentStatePool state_;
  ThreadPool pool_;
  std::vector<int32_t> free_blocks_;
};

int32_t argmax(const float* row, size_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

// Checks `ours` against `ref` (the same number of rows) element by element; returns the largest
// absolute error.
double expect_close(const float* ours, const float* ref, size_t n, const std::string& what) {
  double worst = 0;
  for (size_t e = 0; e < n; ++e) {
    const float err = std::fabs(ours[e] - ref[e]);
    worst = std::max(worst, static_cast<double>(err));
    if (!(err <= kAbsTol + kRelTol * std::fabs(ref[e]))) {
      ADD_FAILURE() << what << ": element " << e << " is " << ours[e] << ", transformers "
                    << ref[e];
      return worst;
    }
  }
  return worst;
}

void report(const std::string& name, const char* what, double worst) {
  std::printf("[ %s ] %s: max |logit error| = %.3g\n", name.c_str(), what, worst);
}

class HybridFixture : public ::testing::TestWithParam<std::string> {
 protected:
  std::filesystem::path dir() const { return fixture(GetParam()); }
};

TEST_P(HybridFixture, PromptLogitsInOneChunkMatchTransformers) {
  const Expected ex = Expected::load(dir());
  // Every prompt reuses slot 0 after the previous one: a fresh sequence must ignore what it holds.
  Runner r(dir(), 1);
  double worst = 0;
  for (size_t i = 0; i < ex.prompts.size(); ++i) {
    Seq s = r.new_seq(0);
    const std::vector<float> ours = r.run(s, ex.prompts[i]);
    ASSERT_EQ(ours.size(), ex.logits[i].size()) << "prompt " << i;
    worst = std::max(worst, expect_close(ours.data(), ex.logits[i].data(), ours.size(),
                                         str(GetParam(), " prompt ", i)));
  }
  report(GetParam(), "prefill", worst);
}

TEST_P(HybridFixture, PromptInTwoChunksCarriesTheState) {
  const Expected ex = Expected::load(dir());
  const std::vector<int32_t>& prompt = ex.prompts[ex.split_prompt];
  ASSERT_EQ(ex.split[0] + ex.split[1], static_cast<int>(prompt.size()));
  Runner r(dir());
  Seq s = r.new_seq(2);
  std::vector<float> ours =
      r.run(s, std::vector<int32_t>(prompt.begin(), prompt.begin() + ex.split[0]));
  const std::vector<float> second =
      r.run(s, std::vector<int32_t>(prompt.begin() + ex.split[0], prompt.end()));
  ours.insert(ours.end(), second.begin(), second.end());
  ASSERT_EQ(ours.size(), ex.split_logits.size());
  const double worst =
      expect_close(ours.data(), ex.split_logits.data(), ours.size(), GetParam() + " split");
  report(GetParam(), "prefill in two chunks", worst);
}

TEST_P(HybridFixture, GreedyDecodeOneTokenAtATimeMatchesTransformers) {
  const Expected ex = Expected::load(dir());
  Runner r(dir());
  const size_t v = r.vocab();
  double worst = 0;
  for (size_t i = 0; i < ex.prompts.size(); ++i) {
    Seq s = r.new_seq(1);
    std::vector<float> logits = r.run(s, ex.prompts[i]);
    const std::vector<float>& ref = ex.decode_logits[i];
    const float* row = logits.data() + logits.size() - v;  // the prompt's last row is row 0
    for (size_t step = 0; step < ex.greedy[i].size(); ++step) {
      const std::string what = str(GetParam(), " prompt ", i, " decode row ", step);
      worst = std::max(worst, expect_close(row, ref.data() + step * v, v, what));
      ASSERT_EQ(argmax(row, v), ex.greedy[i][step]) << what;
      if (step + 1 == ex.greedy[i].size()) break;
      logits = r.run(s, {ex.greedy[i][step]});
      row = logits.data();
    }
  }
  report(GetParam(), "decode", worst);
}

TEST_P(HybridFixture, SequencesOfOneBatchKeepTheirOwnState) {
  const Expected ex = Expected::load(dir());
  Runner r(dir());
  const size_t v = r.vocab(), n = ex.prompts.size();
  ASSERT_LE(n, static_cast<size_t>(Runner::kMaxSeqs));
  // Prompts of 1, 7, 64 and 70 tokens in one prefill, in slots 3, 1, 0, 2.
  std::vector<Seq> seqs;
  const int32_t slots[] = {3, 1, 0, 2};
  for (size_t i = 0; i < n; ++i) seqs.push_back(r.new_seq(slots[i]));
  std::vector<Seq*> all;
  for (Seq& s : seqs) all.push_back(&s);
  std::vector<std::vector<float>> out = r.step(all, ex.prompts);
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i].size(), ex.logits[i].size());
    worst = std::max(worst, expect_close(out[i].data(), ex.logits[i].data(), out[i].size(),
                                         str(GetParam(), " batched prompt ", i)));
  }
  // Then every sequence decodes its greedy path, all in each step.
  for (size_t step = 1; step < ex.greedy[0].size(); ++step) {
    std::vector<std::vector<int32_t>> next;
    for (size_t i = 0; i < n; ++i) next.push_back({ex.greedy[i][step - 1]});
    out = r.step(all, next);
    for (size_t i = 0; i < n; ++i) {
      const std::string what = str(GetParam(), " batched prompt ", i, " decode row ", step);
      worst = std::max(worst,
                       expect_close(out[i].data(), ex.decode_logits[i].data() + step * v, v, what));
      ASSERT_EQ(argmax(out[i].data(), v), ex.greedy[i][step]) << what;
    }
  }
  report(GetParam(), "batched prefill + decode", worst);
}

TEST_P(HybridFixture, FreshFlagRestartsASlotThatHeldAnotherSequence) {
  const Expected ex = Expected::load(dir());
  Runner r(dir(), 1);
  Seq first = r.new_seq(0);
  r.run(first, ex.prompts[2]);  // slot 0 now holds prompt 2's state
  Seq reused = r.new_seq(0);
  const std::vector<float> ours = r.run(reused, ex.prompts[1]);
  expect_close(ours.data(), ex.logits[1].data(), ours.size(), GetParam() + " fresh slot");

  // Continuing the slot's state instead is a different computation: the flag is what resets it.
  Runner stale(dir(), 1);
  Seq a = stale.new_seq(0), b = stale.new_seq(0);
  stale.run(a, ex.prompts[2]);
  const std::vector<float> wrong = stale.step({&b}, {ex.prompts[1]}, {0}).front();
  double diff = 0;
  for (size_t e = 0; e < wrong.size(); ++e) {
    diff = std::max(diff, static_cast<double>(std::fabs(wrong[e] - ex.logits[1][e])));
  }
  EXPECT_GT(diff, 100 * kAbsTol);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HybridFixture,
                         ::testing::Values("qwen3_5-moe", "qwen3_5-moe-text", "qwen3-next",
                                           "qwen3_5-dense"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(HybridModel, CachesOnlyTheAttentionLayersInTheKvPool) {
  auto model = load_model(fixture("qwen3_5-moe"));
  const ModelConfig& c = model->config();
  EXPECT_EQ(model->kv_layout(16, 8).num_layers, 2);  // layers 3 and 7
  const RecurrentStateLayout l = model->recurrent_state_layout(3);
  EXPECT_EQ(l.num_layers, 6);
  EXPECT_EQ(l.conv_dim, 128);
  EXPECT_EQ(l.conv_width, 3);
  // Per sequence: 6 layers x (conv 128 x 3 + SSM 4 heads x 16 x 16), fp32.
  EXPECT_EQ(l.bytes_per_slot(), size_t{6} * (128 * 3 + 4 * 16 * 16) * 4);
  EXPECT_EQ(recurrent_state_layout(c, model->shard(), 3).bytes_per_slot(), l.bytes_per_slot());
  // [slot][layer][conv | ssm]: a slot is one contiguous range.
  EXPECT_EQ(l.conv_offset(1, 2), l.slot_stride() + 2 * l.layer_stride());
  EXPECT_EQ(l.ssm_offset(1, 2), l.conv_offset(1, 2) + 128 * 3);
  EXPECT_EQ(l.total_bytes(), 3 * l.bytes_per_slot());
  // Qwen3 models keep one KV layer per layer and have no recurrent state.
  auto qwen3 = load_model(fixture("qwen3-moe"));
  EXPECT_EQ(qwen3->kv_layout(16, 8).num_layers, qwen3->config().num_hidden_layers);
  EXPECT_THROW(qwen3->recurrent_state_layout(1), Error);
}

// Expects `fn` to throw a relay::Error whose message contains `part`.
template <typename Fn>
void expect_error(Fn&& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << part;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(HybridModel, BatchChecksNameWhatIsWrong) {
  Runner r(fixture("qwen3_5-dense"), 2);
  Seq a = r.new_seq(0), b = r.new_seq(0);
  expect_error([&] { r.step({&a, &b}, {{1, 2}, {3}}); }, "given to two sequences");
  Seq c = r.new_seq(5);
  expect_error([&] { r.run(c, {1, 2}); }, "state slot 5");
  Seq d = r.new_seq(1);
  d.num_computed = 3;  // "fresh", yet with earlier tokens in the KV cache
  expect_error([&] { r.step({&d}, {{4}}, {1}); }, "fresh recurrent state");
  // Draft snapshots: one per row, never a sequence's own slot, inside the pool.
  // (a, in slot 0, has computed nothing: its step above was refused.)
  expect_error([&] { r.step({&a}, {{1, 2}}, {}, {1}); }, "2 tokens but 1 state snapshot slots");
  expect_error([&] { r.step({&a}, {{1, 2}}, {}, {0, -1}); }, "state snapshot slot 0 is a sequence");
  expect_error([&] { r.step({&a}, {{1, 2}}, {}, {1, 1}); }, "state snapshot slot 1 is a sequence");
  expect_error([&] { r.step({&a}, {{1, 2}}, {}, {7, -1}); }, "state snapshot slot 7, the pool");
  // Without a state pool.
  auto model = load_model(fixture("qwen3_5-dense"));
  KvPool kv(model->kv_layout(4, 4));
  ThreadPool pool(1);
  std::vector<int32_t> ids{1}, pos{0}, starts{0, 1}, ctx{1}, table{0, 1, 2, 3}, rows{0};
  std::vector<int64_t> slots{0};
  ForwardBatch batch{ids, pos, starts, ctx, table, 4, slots, rows};
  std::vector<float> logits;
  expect_error([&] { model->forward(batch, kv, pool, logits); }, "no recurrent-state pool");
}

// The shard plan of the hybrids' own parts (engine/test_parallel_backend.cpp runs the layouts).
TEST(HybridModel, ShardPlansSplitTheDeltaNetHeadsTheStateAndTheSharedExpert) {
  const ModelConfig c = ModelConfig::load(fixture("qwen3-next"));  // 2 key / 4 value heads
  const ShardSpec one = plan_shard(c, parallel::ParallelConfig{1, 1, 1}, 0);
  EXPECT_EQ(one.num_local_experts, 8);
  EXPECT_EQ(one.num_local_v_heads, 4);
  EXPECT_EQ(one.num_local_shared_width, 32);
  const ShardSpec r1 = plan_shard(c, parallel::ParallelConfig{2, 2, 1}, 1);
  EXPECT_EQ(r1.k_head_begin, 1);
  EXPECT_EQ(r1.num_local_k_heads, 1);
  EXPECT_EQ(r1.v_head_begin, 2);
  EXPECT_EQ(r1.num_local_v_heads, 2);
  EXPECT_EQ(r1.shared_width_begin, 16);
  EXPECT_EQ(r1.num_local_shared_width, 16);
  const RecurrentStateLayout whole = recurrent_state_layout(c, one, 1),
                             half = recurrent_state_layout(c, r1, 1);
  EXPECT_EQ(half.num_heads * 2, whole.num_heads);
  EXPECT_EQ(half.conv_dim * 2, whole.conv_dim);
  // DP attention + EP: every rank holds every head and the whole shared expert.
  const ShardSpec dp = plan_shard(c, parallel::ParallelConfig{1, 2, 2}, 1);
  EXPECT_EQ(dp.num_local_v_heads, 4);
  EXPECT_EQ(dp.num_local_shared_width, 32);
  EXPECT_EQ(dp.num_local_experts, 4);
  expect_error([&] { plan_shard(c, parallel::ParallelConfig{4, 1, 1}, 0); },
               "does not divide linear_num_key_heads 2");
}

}  // namespace
}  // namespace relay

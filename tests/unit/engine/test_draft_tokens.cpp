// Drafts (speculative decoding's multi-token step) on the CPU backend, on the tiny fixture
// checkpoints and the demo model, on one rank and on TP 2 and DP 2 + EP 2 thread ranks:
//   - a step that computes a sequence's last token and k drafts gives, row for row, the logits of
//     k + 1 single-token steps (bit for bit: each row's arithmetic does not depend on the others);
//   - decoding through LLMEngine with drafts that are right, right for a while, or wrong gives
//     exactly the tokens (and logprobs) of decoding without them, greedy and seeded, while right
//     drafts take fewer steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>

#include "core/error.h"
#include "engine/cpu_backend.h"
#include "engine/llm_engine.h"
#include "fixtures.h"

namespace relay {
namespace {

using Case = test::LayoutCase;

std::filesystem::path model_dir(const std::string& model) {
  return model == "demo" ? std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe"
                         : test::fixture_models_dir() / model;
}

// The fixture's prompts of 2 to 11 tokens.
std::vector<std::vector<int32_t>> prompts_of(const std::string& model) {
  const auto fx = model == "demo" ? test::ModelFixture::load(
                                        test::fixture_models_dir() / "relay-demo-moe-expected",
                                        model_dir(model))
                                  : test::ModelFixture::load(model_dir(model), model_dir(model));
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : fx.prompts) {
    if (p.size() >= 2) prompts.emplace_back(p.begin(), p.begin() + std::min<size_t>(p.size(), 11));
  }
  return prompts;
}

CpuBackendOptions options(parallel::ParallelConfig p) {
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = 64;
  o.parallel = p;
  o.num_threads = std::max(2, p.world_size());
  return o;
}

std::vector<Case> cases() {
  using P = parallel::ParallelConfig;
  std::vector<Case> out;
  for (const std::string& m : test::tiny_fixture_names()) out.push_back({m, P{}});
  out.push_back({"demo", P{}});
  for (const char* m : {"qwen3-moe", "demo"}) {
    out.push_back({m, P{2, 1, 1}});
    out.push_back({m, P{1, 2, 2}});
  }
  return out;
}

class DraftTest : public ::testing::TestWithParam<Case> {};

TEST_P(DraftTest, AStepWithDraftsGivesTheLogitsOfSingleTokenSteps) {
  const Case& c = GetParam();
  CpuBackend backend(model_dir(c.model), options(c.parallel));
  const size_t vocab = backend.config().vocab_size;
  const int bs = backend.block_size();
  const int partitions = backend.num_kv_partitions();
  const int per_partition = backend.num_kv_blocks() / partitions;
  constexpr int kDrafts = 3;
  const std::vector<std::vector<int32_t>> prompts = prompts_of(c.model);
  // Each prompt twice: sequence 2i steps one token at a time, 2i + 1 takes its drafts at once.
  struct Seq {
    std::vector<int32_t> tokens;  // the prompt, then its drafts
    std::vector<int32_t> blocks;
    int prompt_len;
  };
  std::vector<Seq> seqs;
  std::vector<int> next_block(partitions, 0);
  for (size_t i = 0; i < 2 * prompts.size(); ++i) {
    Seq s;
    s.tokens = prompts[i / 2];
    s.prompt_len = static_cast<int>(s.tokens.size());
    for (int j = 0; j < kDrafts; ++j) s.tokens.push_back(s.tokens[(j * 5 + 1) % s.prompt_len]);
    const int p = static_cast<int>(i / 2) % partitions;  // under DP, the prompts on both ranks
    for (int b = 0; b < (static_cast<int>(s.tokens.size()) + bs - 1) / bs; ++b)
      s.blocks.push_back(p * per_partition + next_block[p]++);
    seqs.push_back(std::move(s));
  }
  auto chunk = [&](size_t i, int from, int n) {
    const Seq& s = seqs[i];
    StepSequence st;
    st.seq_id = static_cast<int64_t>(i);
    st.tokens = std::span<const int32_t>(s.tokens).subspan(from, n);
    st.num_computed = from;
    st.block_table = s.blocks;
    return st;
  };
  // Every prompt but its last token.
  std::vector<StepSequence> prefill;
  for (size_t i = 0; i < seqs.size(); ++i) prefill.push_back(chunk(i, 0, seqs[i].prompt_len - 1));
  backend.forward_logits(prefill, CpuBackend::LogitRows::kLastTokens);
  // One token at a time: the last prompt token, then each draft.
  std::vector<std::vector<float>> single(seqs.size() / 2);
  for (int j = 0; j <= kDrafts; ++j) {
    std::vector<StepSequence> batch;
    for (size_t i = 0; i < seqs.size(); i += 2)
      batch.push_back(chunk(i, seqs[i].prompt_len - 1 + j, 1));
    const std::vector<float> rows =
        backend.forward_logits(batch, CpuBackend::LogitRows::kLastTokens);
    for (size_t i = 0; i < batch.size(); ++i)
      single[i].insert(single[i].end(), rows.begin() + i * vocab, rows.begin() + (i + 1) * vocab);
  }
  // All at once.
  std::vector<StepSequence> batch;
  for (size_t i = 1; i < seqs.size(); i += 2)
    batch.push_back(chunk(i, seqs[i].prompt_len - 1, kDrafts + 1));
  const std::vector<float> together =
      backend.forward_logits(batch, CpuBackend::LogitRows::kAllTokens);
  ASSERT_EQ(together.size(), batch.size() * (kDrafts + 1) * vocab);
  for (size_t i = 0; i < batch.size(); ++i) {
    for (size_t v = 0; v < single[i].size(); ++v) {
      ASSERT_EQ(together[i * (kDrafts + 1) * vocab + v], single[i][v])
          << "prompt " << i << " row " << v / vocab << " token " << v % vocab;
    }
  }
}

const Tokenizer& demo_tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(RELAY_SOURCE_DIR "/models/relay-demo-moe");
  return t;
}

// What each request received (its tokens, their logprobs, its text) and the step that finished
// it; the drafts the run verified.
struct Decoded {
  std::map<int64_t, std::vector<int32_t>> tokens;
  std::map<int64_t, std::vector<TokenLogprob>> logprobs;
  std::map<int64_t, std::string> text;
  std::map<int64_t, int> finish_step;
  int num_draft_tokens = 0;
};

// Drafts for request `id` after its first `num_outputs` tokens.
using Proposer = std::function<std::vector<int32_t>(int64_t id, size_t num_outputs)>;

// Three requests (two greedy, one seeded) through an engine on `c`'s backend; before each step the
// proposer (if any) gives every running request its drafts.
Decoded decode(const Case& c, const Proposer& propose) {
  LLMEngine engine(std::make_unique<CpuBackend>(model_dir(c.model), options(c.parallel)),
                   demo_tokenizer(), {});
  const std::vector<std::vector<int32_t>> prompts = prompts_of(c.model);
  Decoded run;
  for (int64_t id = 0; id < 3; ++id) {
    EngineRequest r;
    r.prompt = prompts[static_cast<size_t>(id) % prompts.size()];
    r.stop.max_tokens = 12;
    r.stop.ignore_eos = true;
    r.sampling.temperature = id == 2 ? 0.8f : 0.0f;
    r.sampling.top_p = 0.9f;
    r.sampling.seed = 77;
    r.sampling.num_logprobs = id == 1 ? 2 : -1;
    engine.add_request(id, r);
    run.tokens[id];
  }
  for (int step = 0; engine.has_work(); ++step) {
    if (propose) {
      for (const auto& [id, tokens] : run.tokens) {
        if (run.finish_step.count(id) == 0) engine.set_drafts(id, propose(id, tokens.size()));
      }
    }
    for (const RequestOutput& out : engine.step()) {
      auto& tokens = run.tokens[out.id];
      tokens.insert(tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
      auto& lp = run.logprobs[out.id];
      lp.insert(lp.end(), out.logprobs.begin(), out.logprobs.end());
      run.text[out.id] += out.text;
      if (out.finish != FinishReason::kNone) run.finish_step[out.id] = step;
    }
    run.num_draft_tokens += engine.last_step().num_draft_tokens;
  }
  return run;
}

TEST_P(DraftTest, DecodingWithDraftsGivesTheTokensOfDecodingWithout) {
  const Case& c = GetParam();
  const Decoded without = decode(c, {});
  for (const auto& [id, tokens] : without.tokens) ASSERT_EQ(tokens.size(), 12u) << id;
  // k drafts: the next reference tokens, wrong from `right_for` on (request 0 always right,
  // request 1 right for `right_for`, request 2 never).
  auto proposer = [&](int k, int right_for) -> Proposer {
    return [&, k, right_for](int64_t id, size_t num_outputs) {
      const std::vector<int32_t>& ref = without.tokens.at(id);
      const int right = id == 0 ? k : id == 1 ? right_for : 0;
      std::vector<int32_t> drafts;
      for (int j = 0; j < k && num_outputs + j < ref.size(); ++j) {
        const int32_t t = ref[num_outputs + j];
        drafts.push_back(j < right ? t : (t + 1) % 512);
      }
      return drafts;
    };
  };
  for (const auto& [k, right_for] : std::vector<std::pair<int, int>>{{1, 1}, {3, 2}, {5, 0}}) {
    SCOPED_TRACE(::testing::Message() << k << " drafts, request 1's right for " << right_for);
    const Decoded with = decode(c, proposer(k, right_for));
    EXPECT_GT(with.num_draft_tokens, 0);
    for (const auto& [id, tokens] : without.tokens) {
      EXPECT_EQ(with.tokens.at(id), tokens) << "request " << id;
      EXPECT_EQ(with.text.at(id), without.text.at(id)) << "request " << id;
    }
    const auto& want = without.logprobs.at(1);
    const auto& got = with.logprobs.at(1);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].token, want[i].token);
      EXPECT_EQ(got[i].logprob, want[i].logprob) << "token " << i;
      EXPECT_EQ(got[i].top, want[i].top) << "token " << i;
    }
    // Request 0's right drafts let it finish in fewer steps.
    EXPECT_LT(with.finish_step.at(0), without.finish_step.at(0));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, DraftTest, ::testing::ValuesIn(cases()), test::layout_case_name);

}  // namespace
}  // namespace relay

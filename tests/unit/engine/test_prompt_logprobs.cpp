// Prompt logprobs (vLLM's prompt_logprobs) through LLMEngine on the CPU backend: every prompt
// position's logprob and top k equal the log-softmax of CpuBackend::forward_logits(kAllTokens) rows
// of the whole prompt at the next prompt token (and a full sort of those rows), whether the prompt
// runs in one chunk, in several, next to a cached prefix it must not use, through preemptions that
// recompute it, with max_tokens 0, or on TP / DP + EP ranks; and they arrive once, in the first
// output. Where the forward pass differs from the reference's only in how the prompt is chunked,
// the rows agree within fp32 noise (the attention's context split); otherwise bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "../error_text.h"
#include "../scheduler/fake_backend.h"
#include "core/error.h"
#include "engine/cpu_backend.h"
#include "engine/llm_engine.h"
#include "engine/sampler.h"
#include "fixtures.h"

namespace relay {
namespace {

// A 512-token vocabulary, 8 experts (so EP 2 and DP 2 + EP 2 split it), 2 KV heads (TP 2).
std::filesystem::path model_dir() { return test::fixture_models_dir() / "qwen3-moe"; }

const Tokenizer& demo_tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(RELAY_SOURCE_DIR "/models/relay-demo-moe");
  return t;
}

std::vector<int32_t> prompt_of(int n, int32_t salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = (salt * 37 + i * 11 + i * i) % 512;
  return p;
}

CpuBackendOptions backend_options(parallel::ParallelConfig p = {}, int num_blocks = 64) {
  CpuBackendOptions o;
  o.block_size = 4;
  o.num_blocks = num_blocks;
  o.num_threads = std::max(2, p.world_size());
  o.parallel = p;
  return o;
}

// The log-softmax rows of every position of `prompt` but the last, from forward_logits over the
// whole prompt in one chunk on a backend of layout `p`.
std::vector<std::vector<float>> reference_rows(const std::vector<int32_t>& prompt,
                                               parallel::ParallelConfig p = {}) {
  CpuBackend backend(model_dir(), backend_options(p));
  std::vector<int32_t> blocks((prompt.size() + 3) / 4);
  std::iota(blocks.begin(), blocks.end(), 0);
  StepSequence s;
  s.tokens = prompt;
  s.block_table = blocks;
  const std::vector<float> logits =
      backend.forward_logits(std::span(&s, 1), CpuBackend::LogitRows::kAllTokens);
  const size_t vocab = backend.config().vocab_size;
  std::vector<std::vector<float>> rows;
  for (size_t j = 0; j + 1 < prompt.size(); ++j) {
    std::vector<float>& row = rows.emplace_back(vocab);
    log_softmax(std::span(logits).subspan(j * vocab, vocab), row);
  }
  return rows;
}

// Checks a request's prompt logprobs against the reference rows: the target's logprob, and the k
// best of a full sort of the row (by logprob, then id). tolerance 0: bit for bit; else within it,
// where a near-tie may order two ids either way, so each top entry is checked by its value.
void expect_prompt_logprobs(const std::vector<std::optional<TokenLogprob>>& got,
                            const std::vector<int32_t>& prompt,
                            const std::vector<std::vector<float>>& rows, int k, float tolerance) {
  ASSERT_EQ(got.size(), prompt.size());
  EXPECT_FALSE(got[0].has_value());
  for (size_t pos = 1; pos < prompt.size(); ++pos) {
    ASSERT_TRUE(got[pos].has_value()) << "position " << pos;
    const TokenLogprob& lp = *got[pos];
    const std::vector<float>& row = rows[pos - 1];
    std::vector<int32_t> ids(row.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::sort(ids.begin(), ids.end(),
              [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    EXPECT_EQ(lp.token, prompt[pos]);
    ASSERT_EQ(lp.top.size(), static_cast<size_t>(k)) << "position " << pos;
    if (tolerance == 0.0f) {
      EXPECT_EQ(lp.logprob, row[prompt[pos]]) << "position " << pos;
      for (int i = 0; i < k; ++i) {
        EXPECT_EQ(lp.top[i].first, ids[i]) << "position " << pos << " top " << i;
        EXPECT_EQ(lp.top[i].second, row[ids[i]]) << "position " << pos << " top " << i;
      }
      continue;
    }
    EXPECT_NEAR(lp.logprob, row[prompt[pos]], tolerance) << "position " << pos;
    for (int i = 0; i < k; ++i) {
      EXPECT_NEAR(lp.top[i].second, row[ids[i]], tolerance) << "position " << pos << " top " << i;
      EXPECT_NEAR(lp.top[i].second, row[lp.top[i].first], tolerance)
          << "position " << pos << " top " << i;
    }
  }
}

// What the engine delivered for each request.
struct Delivered {
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  int num_deliveries = 0;  // outputs carrying prompt logprobs
  int first_output_step = -1;
  bool first_output_had_them = false;
  std::vector<int32_t> tokens;
  int num_outputs = 0;
  int num_cached_tokens = 0;
  FinishReason finish = FinishReason::kNone;
};

std::map<int64_t, Delivered> run(LLMEngine& engine) {
  std::map<int64_t, Delivered> all;
  for (int step = 0; step < 10000 && engine.has_work(); ++step) {
    for (RequestOutput& out : engine.step()) {
      Delivered& d = all[out.id];
      if (d.num_outputs++ == 0) {
        d.first_output_step = step;
        d.first_output_had_them = !out.prompt_logprobs.empty();
      }
      if (!out.prompt_logprobs.empty()) {
        ++d.num_deliveries;
        d.prompt_logprobs = std::move(out.prompt_logprobs);
      }
      d.tokens.insert(d.tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
      d.num_cached_tokens = out.num_cached_tokens;
      d.finish = out.finish;
    }
  }
  EXPECT_FALSE(engine.has_work());
  return all;
}

EngineRequest scoring_request(std::vector<int32_t> prompt, int k, int64_t max_tokens) {
  EngineRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.stop.max_tokens = max_tokens;
  r.stop.ignore_eos = true;
  r.num_prompt_logprobs = k;
  return r;
}

std::unique_ptr<LLMEngine> make_engine(const CpuBackendOptions& o, EngineConfig config = {}) {
  return std::make_unique<LLMEngine>(std::make_unique<CpuBackend>(model_dir(), o), demo_tokenizer(),
                                     config);
}

TEST(PromptLogprobs, OneChunkEqualsForwardLogitsAndComesInTheFirstOutput) {
  const std::vector<int32_t> prompt = prompt_of(29, 1);
  const auto rows = reference_rows(prompt);
  auto engine = make_engine(backend_options());
  engine->add_request(1, scoring_request(prompt, 5, 4));
  EngineRequest plain = scoring_request(prompt, -1, 4);
  engine->add_request(2, plain);
  const auto got = run(*engine);
  const Delivered& d = got.at(1);
  EXPECT_EQ(d.num_deliveries, 1);
  EXPECT_TRUE(d.first_output_had_them);
  EXPECT_EQ(d.num_outputs, 4);
  expect_prompt_logprobs(d.prompt_logprobs, prompt, rows, 5, 0.0f);
  // Scoring the prompt changes nothing of what is generated.
  EXPECT_EQ(d.tokens, got.at(2).tokens);
  EXPECT_EQ(got.at(2).num_deliveries, 0);
}

TEST(PromptLogprobs, ChunkedPrefillSpreadsTheRowsOverSteps) {
  const std::vector<int32_t> prompt = prompt_of(37, 2);
  const auto rows = reference_rows(prompt);
  auto engine = make_engine(backend_options(), {.max_num_seqs = 4, .max_num_batched_tokens = 8});
  engine->add_request(1, scoring_request(prompt, 3, 2));
  const auto got = run(*engine);
  const Delivered& d = got.at(1);
  EXPECT_EQ(d.first_output_step, 4);  // chunks of 8, 8, 8, 8, 5: the fifth step samples
  EXPECT_EQ(d.num_deliveries, 1);
  EXPECT_TRUE(d.first_output_had_them);
  expect_prompt_logprobs(d.prompt_logprobs, prompt, rows, 3, 1e-5f);
}

// A cached prefix (here the same prompt, computed by an earlier request) is not used: every
// position is computed and scored. The scored request's own blocks still serve a later one.
TEST(PromptLogprobs, BypassThePrefixCacheAndStillFillIt) {
  const std::vector<int32_t> prompt = prompt_of(26, 3);
  const auto rows = reference_rows(prompt);
  auto engine = make_engine(backend_options());
  engine->add_request(1, scoring_request(prompt, -1, 2));
  run(*engine);
  const uint64_t hits = engine->stats().scheduler.prefix_cache_hits;
  engine->add_request(2, scoring_request(prompt, 4, 2));
  const Delivered scored = run(*engine).at(2);
  EXPECT_EQ(scored.num_cached_tokens, 0);
  EXPECT_EQ(engine->stats().scheduler.prefix_cache_hits, hits);
  expect_prompt_logprobs(scored.prompt_logprobs, prompt, rows, 4, 0.0f);

  auto fresh = make_engine(backend_options());
  fresh->add_request(1, scoring_request(prompt, 4, 2));
  run(*fresh);
  fresh->add_request(2, scoring_request(prompt, -1, 2));
  EXPECT_EQ(run(*fresh).at(2).num_cached_tokens, 24);  // 6 full blocks of 4
}

// A pool too small for both prompts: B, scored, is preempted mid-prompt (again and again) while the
// older A decodes, and recomputes its prompt from the start each time. Its prompt logprobs still
// arrive once, with every position, and both requests generate what a roomy pool generates.
TEST(PromptLogprobs, PreemptionMidPromptDeliversEveryPositionOnce) {
  const std::vector<int32_t> a = prompt_of(24, 4), b = prompt_of(24, 5);
  const auto rows_a = reference_rows(a), rows_b = reference_rows(b);
  const EngineConfig config{.max_num_seqs = 4, .max_num_batched_tokens = 8};
  auto load = [&](LLMEngine& e) {
    e.add_request(1, scoring_request(a, 2, 8));
    e.add_request(2, scoring_request(b, 2, 4));
  };
  auto roomy = make_engine(backend_options(), config);
  load(*roomy);
  const auto want = run(*roomy);
  auto tight = make_engine(backend_options({}, 10), config);
  load(*tight);
  const auto got = run(*tight);
  EXPECT_GT(tight->stats().scheduler.num_preemptions, 0u);
  for (int64_t id : {1, 2}) {
    EXPECT_EQ(got.at(id).num_deliveries, 1) << "request " << id;
    EXPECT_TRUE(got.at(id).first_output_had_them) << "request " << id;
    EXPECT_EQ(got.at(id).tokens, want.at(id).tokens) << "request " << id;
  }
  expect_prompt_logprobs(got.at(1).prompt_logprobs, a, rows_a, 2, 1e-5f);
  expect_prompt_logprobs(got.at(2).prompt_logprobs, b, rows_b, 2, 1e-5f);
  EXPECT_DOUBLE_EQ(tight->stats().kv_cache_usage, 0.0);
}

// max_tokens 0 (vLLM's echo scoring): one output, which scores the prompt, samples nothing and
// finishes with "length"; beside it a generating request runs as usual.
TEST(PromptLogprobs, MaxTokensZeroScoresThePromptAndSamplesNothing) {
  const std::vector<int32_t> prompt = prompt_of(21, 6);
  const auto rows = reference_rows(prompt);
  auto engine = make_engine(backend_options());
  engine->add_request(1, scoring_request(prompt, 0, 0));
  engine->add_request(2, scoring_request(prompt_of(9, 7), -1, 3));
  const auto got = run(*engine);
  const Delivered& d = got.at(1);
  EXPECT_EQ(d.num_outputs, 1);
  EXPECT_EQ(d.num_deliveries, 1);
  EXPECT_TRUE(d.tokens.empty());
  EXPECT_EQ(d.finish, FinishReason::kLength);
  expect_prompt_logprobs(d.prompt_logprobs, prompt, rows, 0, 0.0f);
  EXPECT_EQ(got.at(2).tokens.size(), 3u);
  EXPECT_DOUBLE_EQ(engine->stats().kv_cache_usage, 0.0);
  // A one-token prompt has nothing to score: its single position is empty.
  engine->add_request(3, scoring_request({42}, 2, 0));
  const Delivered one = run(*engine).at(3);
  ASSERT_EQ(one.prompt_logprobs.size(), 1u);
  EXPECT_FALSE(one.prompt_logprobs[0].has_value());
  EXPECT_EQ(one.finish, FinishReason::kLength);
}

TEST(PromptLogprobs, RequestsThatCannotBeServedAreRefused) {
  auto error_of = [](auto&& fn) { return test::error_text(fn); };
  auto engine = make_engine(backend_options());
  EXPECT_TRUE(engine->supports_prompt_logprobs());
  EXPECT_NE(error_of([&] {
              engine->add_request(1, scoring_request(prompt_of(5, 1), -1, 0));
            }).find("max_tokens"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              engine->add_request(2, scoring_request(prompt_of(5, 1), -2, 1));
            }).find("num_prompt_logprobs"),
            std::string::npos);
  LLMEngine fake(std::make_unique<testing::FakeBackend>(32, 4), demo_tokenizer(), {});
  EXPECT_FALSE(fake.supports_prompt_logprobs());
  EXPECT_NE(error_of([&] {
              fake.add_request(3, scoring_request(prompt_of(5, 1), 1, 1));
            }).find("prompt logprobs"),
            std::string::npos);
  EXPECT_FALSE(fake.has_work());
}

// Sharded ranks score the prompt as one rank of the same layout does, bit for bit: TP 2 (every
// rank runs every row, rank 0's logits are read), and DP 2 + EP 2, where the requests land on
// different DP ranks whose rows are read from the rank holding each.
class ShardedPromptLogprobsTest : public ::testing::TestWithParam<parallel::ParallelConfig> {};

TEST_P(ShardedPromptLogprobsTest, EqualForwardLogitsOfTheSameLayout) {
  const parallel::ParallelConfig p = GetParam();
  const std::vector<std::vector<int32_t>> prompts{prompt_of(23, 8), prompt_of(17, 9),
                                                  prompt_of(30, 10)};
  auto engine = make_engine(backend_options(p));
  for (size_t i = 0; i < prompts.size(); ++i) {
    engine->add_request(static_cast<int64_t>(i), scoring_request(prompts[i], 4, i == 1 ? 0 : 3));
  }
  const auto got = run(*engine);
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    EXPECT_EQ(got.at(static_cast<int64_t>(i)).num_deliveries, 1);
    expect_prompt_logprobs(got.at(static_cast<int64_t>(i)).prompt_logprobs, prompts[i],
                           reference_rows(prompts[i], p), 4, 0.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardedPromptLogprobsTest,
                         ::testing::Values(parallel::ParallelConfig{2, 1, 1},
                                           parallel::ParallelConfig{1, 2, 2}),
                         [](const ::testing::TestParamInfo<parallel::ParallelConfig>& info) {
                           return "tp" + std::to_string(info.param.tp) + "_ep" +
                                  std::to_string(info.param.ep) + "_dp" +
                                  std::to_string(info.param.dp);
                         });

}  // namespace
}  // namespace relay

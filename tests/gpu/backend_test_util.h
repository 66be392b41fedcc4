// Helpers shared by the CudaBackend tests: small backend options, batched greedy decoding through
// the paged cache, prefill logits, and the fixtures the backend can run.
#pragma once

#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/cuda_backend.h"
#include "engine/sampler.h"
#include "tests/unit/engine/fixtures.h"

namespace relay::gpu_test {

struct Seq {
  int64_t id = 0;
  std::vector<int32_t> prompt, tokens, output, blocks;
  int num_computed = 0;
};

inline CudaBackendOptions small_options(bool graphs) {
  CudaBackendOptions o;
  o.block_size = 8;
  o.num_kv_blocks = 512;
  o.max_num_seqs = 16;
  o.max_num_tokens = 512;
  o.cuda_graphs = graphs;
  return o;
}

// Greedy-decodes all prompts together, `steps` tokens each, with blocks handed out in reverse
// order; prompt i's blocks come from KV partition i % num_kv_partitions() (its DP rank).
inline std::vector<std::vector<int32_t>> greedy_batched(
    CudaBackend& backend, const std::vector<std::vector<int32_t>>& prompts, int steps) {
  const int bs = backend.block_size();
  const int parts = backend.num_kv_partitions();
  const int per_part = backend.num_kv_blocks() / parts;
  std::vector<int> next_block(parts);
  for (int g = 0; g < parts; ++g) next_block[g] = (g + 1) * per_part - 1;
  std::vector<Seq> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Seq s;
    s.id = static_cast<int64_t>(i) + 7;
    s.prompt = s.tokens = prompts[i];
    const int need = (static_cast<int>(prompts[i].size()) + steps + bs - 1) / bs;
    for (int b = 0; b < need; ++b) s.blocks.push_back(next_block[i % parts]--);
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

// The backend numbers positions from the cache, so the fixture with shifted positions (qwen3-yarn)
// is left to the CPU model-level test.
inline std::vector<std::string> unshifted_fixtures() {
  std::vector<std::string> names;
  for (const std::string& n : test::tiny_fixture_names()) {
    auto dir = test::fixture_models_dir() / n;
    if (test::ModelFixture::load(dir, dir).position_offset == 0) names.push_back(n);
  }
  return names;
}

// A whole prompt in one step from position 0 into `blocks`, sampling with `sp` after it (its
// penalties count `prompt`). The spans must outlive the step.
inline StepSequence sampling_prompt(int64_t id, std::span<const int32_t> prompt,
                                    std::span<const int32_t> blocks, const SamplingParams* sp) {
  StepSequence s;
  s.seq_id = id;
  s.tokens = prompt;
  s.block_table = blocks;
  s.sample = true;
  s.sampling = sp;
  s.prompt_tokens = prompt;
  return s;
}

// Logits of `tokens` as one prefill (every position).
inline std::vector<float> prefill_logits(CudaBackend& backend, const std::vector<int32_t>& tokens) {
  std::vector<int32_t> blocks((tokens.size() + 7) / 8);
  std::iota(blocks.rbegin(), blocks.rend(), 3);
  StepSequence s;
  s.seq_id = 1;
  s.tokens = tokens;
  s.block_table = blocks;
  std::vector<StepSequence> batch{s};
  return backend.forward_logits(batch, CudaBackend::LogitRows::kAllTokens);
}

}  // namespace relay::gpu_test

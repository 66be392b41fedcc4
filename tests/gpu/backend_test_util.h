// Helpers shared by the CudaBackend tests: small backend options, batched greedy decoding through
// the paged cache, prefill logits, sequences decoded by hand with drafts, engine runs, and the
// fixtures the backend can run. A hybrid model's sequences get recurrent-state slots (one, or one
// per draft position more) from their DP rank's range.
#pragma once

#include <cmath>
#include <filesystem>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/cuda_backend.h"
#include "engine/llm_engine.h"
#include "engine/sampler.h"
#include "tests/unit/engine/fixtures.h"

namespace relay::gpu_test {

struct Seq {
  int64_t id = 0;
  std::vector<int32_t> prompt, tokens, output, blocks, state_slots;
  int num_computed = 0;
};

// `count` recurrent-state slots for sequence `i` of partition `part` (none for a model without
// linear-attention layers): the i-th group of `count` in the partition's range.
inline std::vector<int32_t> state_slots_for(const Backend& backend, int part, int i, int count) {
  if (backend.num_state_slots() == 0) return {};
  const int per_part = backend.num_state_slots() / backend.num_kv_partitions();
  std::vector<int32_t> slots(static_cast<size_t>(count));
  std::iota(slots.begin(), slots.end(), part * per_part + i * count);
  EXPECT_LE(i * count + count, per_part) << "state slots";
  return slots;
}

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
    s.state_slots = state_slots_for(backend, static_cast<int>(i) % parts, static_cast<int>(i) / parts, 1);
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
      st.state_slots = s.state_slots;
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
  const std::vector<int32_t> slots = state_slots_for(backend, 0, 0, 1);
  StepSequence s;
  s.seq_id = 1;
  s.tokens = tokens;
  s.block_table = blocks;
  s.state_slots = slots;
  std::vector<StepSequence> batch{s};
  return backend.forward_logits(batch, CudaBackend::LogitRows::kAllTokens);
}

// A sequence decoded by hand through backend.step: prompt, then committed tokens.
struct Decoding {
  std::vector<int32_t> tokens, output, blocks, state_slots;
  int num_computed = 0;
};

// One step of every `ds[i]` with `drafts[i]` after its last token (sequence i has seq_id 5 + i);
// commits what comes back and returns it per sequence.
inline std::vector<std::vector<SampledToken>> step_all(CudaBackend& backend, std::vector<Decoding*> ds,
                                                const std::vector<std::vector<int32_t>>& drafts,
                                                const SamplingParams& sampling) {
  std::vector<std::vector<int32_t>> tokens(ds.size());
  std::vector<StepSequence> batch(ds.size());
  for (size_t i = 0; i < ds.size(); ++i) {
    const Decoding& d = *ds[i];
    tokens[i].assign(d.tokens.begin() + d.num_computed, d.tokens.end());
    tokens[i].insert(tokens[i].end(), drafts[i].begin(), drafts[i].end());
    StepSequence& s = batch[i];
    s.seq_id = 5 + static_cast<int64_t>(i);
    s.tokens = tokens[i];
    s.num_computed = d.num_computed;
    s.block_table = d.blocks;
    s.sample = true;
    s.num_draft_tokens = static_cast<int32_t>(drafts[i].size());
    s.sampling = &sampling;
    s.output_tokens = d.output;
    s.sample_index = d.output.size();
    s.state_slots = d.state_slots;
  }
  const std::vector<SampledToken> out = backend.step(batch);
  std::vector<std::vector<SampledToken>> per_seq(ds.size());
  size_t at = 0;
  for (size_t i = 0; i < ds.size(); ++i) {
    while (at < out.size() && out[at].seq_id == batch[i].seq_id) per_seq[i].push_back(out[at++]);
    const std::vector<SampledToken>& got = per_seq[i];
    EXPECT_GE(got.size(), 1u) << "sequence " << i;
    EXPECT_LE(got.size(), drafts[i].size() + 1) << "sequence " << i;
    for (size_t j = 0; j + 1 < got.size(); ++j) EXPECT_EQ(got[j].token, drafts[i][j]) << "accepted draft " << j;
    Decoding& d = *ds[i];
    d.num_computed = static_cast<int>(d.tokens.size());  // the last token; accepted drafts follow
    for (const SampledToken& t : got) {
      d.tokens.push_back(t.token);
      d.output.push_back(t.token);
    }
    d.num_computed += static_cast<int>(got.size()) - 1;
  }
  EXPECT_EQ(at, out.size());
  return per_seq;
}

inline std::vector<SampledToken> step_with(CudaBackend& backend, Decoding& d,
                                    const std::vector<int32_t>& drafts,
                                    const SamplingParams& sampling) {
  return step_all(backend, {&d}, {drafts}, sampling).front();
}

// `first_block`: where its blocks start (a DP backend's partition r starts at r x blocks / dp).
// A hybrid model's sequence also needs its d.state_slots (state_slots_for).
inline Decoding start(const std::vector<int32_t>& prompt, int room, int first_block = 10) {
  Decoding d;
  d.tokens = prompt;
  d.blocks.resize((prompt.size() + room + 7) / 8);
  std::iota(d.blocks.begin(), d.blocks.end(), first_block);
  return d;
}

// Whether greedy token `a` and `b` after `context` are within `tie` of each other in one
// backend's logits.
inline bool near_tie(CudaBackend& one, std::vector<int32_t> context, int32_t a, int32_t b, float tie) {
  const std::vector<float> logits = prefill_logits(one, context);
  const float* last = logits.data() + (context.size() - 1) * one.config().vocab_size;
  return std::abs(last[a] - last[b]) <= tie;
}

// The engine on the CUDA backend of `model`, greedy, `max_tokens` each, all prompts at once.
struct EngineRun {
  std::vector<std::vector<int32_t>> tokens;
  int steps = 0;
  SpecDecodeStats stats;
};

inline EngineRun run_engine(const std::filesystem::path& model, const Tokenizer& tokenizer,
                            CudaBackendOptions o, const SpeculativeConfig& spec,
                            const std::vector<std::vector<int32_t>>& prompts, int max_tokens = 40) {
  o.max_draft_tokens = spec.enabled() ? spec.num_speculative_tokens : 0;
  o.num_state_slots = o.max_num_seqs * (1 + o.max_draft_tokens);
  if (spec.method == SpeculativeConfig::Method::kMtp) {
    o.mtp = {.enabled = true, .dir = spec.model};
    o.num_mtp_drafts = spec.num_speculative_tokens;
  }
  EngineConfig config;
  config.max_num_seqs = o.max_num_seqs;
  config.max_num_batched_tokens = 64;  // chunked prefill for the longer prompts
  config.speculative = spec;
  LLMEngine engine(std::make_unique<CudaBackend>(model, o), tokenizer, config);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r;
    r.prompt = prompts[i];
    r.sampling.temperature = 0.0f;
    r.stop.max_tokens = max_tokens;
    r.stop.ignore_eos = true;
    engine.add_request(static_cast<int64_t>(i), r);
  }
  EngineRun out;
  out.tokens.resize(prompts.size());
  while (engine.has_work()) {
    for (const RequestOutput& ro : engine.step()) {
      auto& t = out.tokens.at(static_cast<size_t>(ro.id));
      t.insert(t.end(), ro.new_tokens.begin(), ro.new_tokens.end());
    }
    ++out.steps;
  }
  out.stats = engine.stats().spec_decode;
  return out;
}

}  // namespace relay::gpu_test

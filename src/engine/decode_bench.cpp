// See decode_bench.h.
#include "engine/decode_bench.h"

#include <algorithm>
#include <chrono>
#include <set>

#include "core/error.h"

namespace relay {
namespace {

constexpr int kPromptBlock = 16;  // ids repeated through each prompt

// Prompt `index` of a run: its own block of kPromptBlock ids, repeated to `length` tokens.
std::vector<int32_t> bench_prompt(int64_t index, int length, int64_t vocab) {
  const int64_t ids = std::min<int64_t>(vocab, 32000);
  uint64_t state = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(index + 1);
  std::vector<int32_t> block(kPromptBlock);
  for (int32_t& id : block) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int32_t>((state >> 33) % static_cast<uint64_t>(ids));
  }
  std::vector<int32_t> prompt(static_cast<size_t>(length));
  for (int t = 0; t < length; ++t) prompt[t] = block[t % kPromptBlock];
  return prompt;
}

}  // namespace

void run_decode_bench(LLMEngine& engine, const DecodeBenchOptions& o,
                      const std::function<void(const nlohmann::json&)>& emit) {
  using Clock = std::chrono::steady_clock;
  RELAY_CHECK(o.num_decode_tokens >= 1, "decode bench: tokens per sequence must be positive, got ",
              o.num_decode_tokens);
  RELAY_CHECK(o.warmup_runs >= 0, "decode bench: warmup_runs must not be negative, got ",
              o.warmup_runs);
  const SpeculativeConfig& spec = o.speculative;
  int64_t next_id = 0;
  // One run of a shape: its requests through the engine until all finish; returns its line.
  auto run_shape = [&](int batch, int context) {
    std::set<int64_t> waiting_first;
    for (int i = 0; i < batch; ++i) {
      EngineRequest r;
      r.prompt = o.prompt.empty()
                     ? bench_prompt(next_id, context, engine.model_config().vocab_size)
                     : o.prompt;
      r.sampling.temperature = 0.0f;
      r.stop.ignore_eos = true;
      r.stop.max_tokens = 1 + o.num_decode_tokens;
      waiting_first.insert(next_id);
      engine.add_request(next_id++, std::move(r));
    }
    // The prefill (and any decode beside it): timed apart, until every request has its first
    // token.
    const Clock::time_point prefill_start = Clock::now();
    while (!waiting_first.empty()) {
      RELAY_CHECK(engine.has_work(), "decode bench: the engine stopped before every prompt ran");
      for (const RequestOutput& out : engine.step()) {
        if (out.num_output_tokens > 0) waiting_first.erase(out.id);
      }
    }
    const double prefill_seconds =
        std::chrono::duration<double>(Clock::now() - prefill_start).count();
    const SpecDecodeStats before = engine.stats().spec_decode;
    int64_t tokens = 0, steps = 0;
    const Clock::time_point start = Clock::now();
    while (engine.has_work()) {
      for (const RequestOutput& out : engine.step()) {
        tokens += static_cast<int64_t>(out.new_tokens.size());
      }
      ++steps;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    nlohmann::json line{{"mode", "decode"},
                        {"batch", batch},
                        {"context", context},
                        {"tokens", tokens},
                        {"steps", steps},
                        {"seconds", seconds},
                        {"tok_per_s", tokens / std::max(seconds, 1e-9)},
                        {"ms_per_step", steps > 0 ? 1e3 * seconds / steps : 0.0},
                        {"prefill_seconds", prefill_seconds},
                        {"prefill_tok_per_s",
                         static_cast<double>(batch) * context / std::max(prefill_seconds, 1e-9)},
                        {"speculative", spec.describe()},
                        {"warmup_runs", o.warmup_runs}};
    if (spec.enabled()) {
      const SpecDecodeStats d = engine.stats().spec_decode.since(before);
      line["num_drafts"] = d.num_drafts;
      line["num_draft_tokens"] = d.num_draft_tokens;
      line["num_accepted_tokens"] = d.num_accepted_tokens;
      line["acceptance_rate"] = d.acceptance_rate();
      line["mean_acceptance_length"] = d.mean_acceptance_length();
      line["accepted_per_position"] = d.num_accepted_tokens_per_pos;
    }
    return line;
  };
  for (const int batch : o.batches) {
    RELAY_CHECK(batch >= 1 && batch <= engine.max_num_seqs(), "decode bench: batch ", batch,
                " must be in [1, ", engine.max_num_seqs(), "] (the engine's max_num_seqs)");
    for (const int context : o.contexts) {
      RELAY_CHECK(context >= 1, "decode bench: context must be positive, got ", context);
      for (int run = 0; run < o.warmup_runs; ++run) run_shape(batch, context);
      emit(run_shape(batch, context));
    }
  }
}

}  // namespace relay

// Decode throughput through the whole engine (scheduler, block manager, backend, speculative
// decoding), for `relay bench --mode model --device cpu`.
//
// Each shape (batch B, context C) adds B requests whose prompts are C tokens, each its own block of
// 16 pseudo-random ids repeated (so the n-gram proposer finds earlier occurrences, as in code
// editing; attention does the same work whatever the ids), or all of them the one given prompt
// (DecodeBenchOptions::prompt: real text, `relay bench --prompt-file`), greedy, ignoring EOS,
// generating 1 + num_decode_tokens tokens. The engine runs until every request has its first token
// (the prefill, timed on its own: prompt tokens per second); the steps after that are timed until
// all finish, and the line reports the tokens they committed per second, with, when the engine
// drafts, speculative decoding's counters over those steps: drafts, acceptance rate and mean
// acceptance length (SpecDecodeStats). Prefix caching is the engine's choice (EngineConfig); the
// synthetic prompts share no block; a given prompt shares all of its blocks, so past its first
// request (warm-up included) its prefill is a cache hit and only the decode figures measure the
// model. With warmup_runs, each shape first runs that many times untimed (other prompts, the same
// lengths), so the one-time costs a GPU backend pays at a shape's first steps (CUDA graph captures
// of each batch bucket and, with drafts, of each number of tokens per sequence; GEMM plans) stay
// out of the timed run.
#pragma once

#include <functional>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/llm_engine.h"

namespace relay {

struct DecodeBenchOptions {
  std::vector<int> batches;   // sequences decoded together, at most engine.max_num_seqs()
  std::vector<int> contexts;  // prompt tokens of each sequence
  // Every request's prompt instead of the synthetic ones (contexts then holds its length); the
  // requests share it, so a prefix cache shares its blocks.
  std::vector<int32_t> prompt;
  int num_decode_tokens = 64;  // tokens each sequence generates in the timed steps
  SpeculativeConfig speculative;  // the engine's (EngineConfig::speculative), for the report
  int warmup_runs = 0;            // untimed runs of each shape first
};

// Runs every (batch, context) shape on `engine` (idle, and left idle) and passes one JSON line per
// shape to `emit`: {"mode": "decode", "batch", "context", "tokens", "steps", "seconds",
// "tok_per_s", "ms_per_step", "prefill_seconds", "prefill_tok_per_s", "speculative",
// "warmup_runs"} and, with
// speculative decoding, "num_drafts",
// "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length",
// "accepted_per_position".
void run_decode_bench(LLMEngine& engine, const DecodeBenchOptions& options,
                      const std::function<void(const nlohmann::json&)>& emit);

}  // namespace relay

// A request's sequence as the scheduler and the engine see it: its tokens (prompt, then generated),
// how many of them are in the KV cache, what it asks of sampling, and the draft tokens proposed for
// its next step (speculative decoding). Drafts are not part of `tokens`: the step that runs the
// sequence computes them after its last token, and only the ones the model accepts join `tokens`
// (scheduler.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "sequence/sampling.h"

namespace relay {

struct Sequence {
  int64_t id = 0;
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int num_prompt_tokens = 0;
  int num_computed = 0;               // tokens whose K/V is in the cache
  int num_cached_prompt_tokens = -1;  // prefix-cache hit at first admission (-1: not admitted yet)
  int num_preemptions = 0;
  SamplingParams sampling;
  bool wants_prompt_logprobs = false;  // no prefix-cache hit until its prompt is done
  bool prompt_only = false;            // max_tokens 0: never samples; finished after its prompt
  // Proposed continuation after the last token, for the next step only (the step that runs the
  // sequence consumes them, verified or not).
  std::vector<int32_t> draft_tokens;

  int num_output_tokens() const { return static_cast<int>(tokens.size()) - num_prompt_tokens; }
  std::span<const int32_t> output_tokens() const {
    return std::span<const int32_t>(tokens).subspan(num_prompt_tokens);
  }
};

}  // namespace relay

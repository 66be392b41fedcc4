// The checks of a step's sequences that every backend makes before anything runs, so a bad batch
// fails the step on every rank (and node) alike instead of leaving peers waiting in a collective:
// a computed prefix, block tables that cover it, sampling parameters where the sequence samples,
// drafts, prompt logprobs, token constraints. What a backend checks besides stays with it: its
// pool's bounds, the sizes it was built for, and the token ids (the CPU model's embedding checks
// them on the rank that holds the sequence; the CUDA backend before it enqueues anything).
#pragma once

#include <cstdint>
#include <limits>

#include "engine/backend.h"

namespace relay {

struct StepLimits {
  int64_t vocab_size = 0;
  int block_size = 0;
  int max_draft_tokens = std::numeric_limits<int>::max();     // per sampling sequence
  int max_prompt_logprobs = std::numeric_limits<int>::max();  // top tokens per scored row
  const char* backend = "the backend";                        // for the messages
};

// relay::Error naming the sequence and what is wrong.
void check_step_sequence(const StepSequence& s, const StepLimits& limits);

}  // namespace relay

// What a request asks of sampling and what a sample gives back, shared by the scheduler, the
// engine and every backend: SamplingParams (vLLM's sampling options), TokenLogprob and
// SampledToken. They sit below the scheduler and the backends so that neither includes the other
// (the scheduler keeps a sequence's SamplingParams and takes the step's SampledTokens).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace relay {

struct SamplingParams {
  float temperature = 1.0f;  // 0 -> greedy (argmax)
  int top_k = 0;             // 0 -> off
  float top_p = 1.0f;        // 1 -> off
  float min_p = 0.0f;        // 0 -> off
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  // Sampling is a pure function of (seed, sample_index): a preempted and recomputed sequence draws
  // the same tokens again. The server picks a random seed when the request gives none.
  uint64_t seed = 0;
  int num_logprobs = -1;  // -1: none; 0: the chosen token's logprob; k: and the top k
};

// A token's logprob under the log-softmax of the raw logits (vLLM's default), with the most likely
// tokens of that row, best first (the lowest id first on ties).
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;
  int32_t rank = 0;  // 1 + the number of tokens more likely than `token` (vLLM's rank); 0: unknown
};

// A sampled token, with its logprob and top tokens when SamplingParams::num_logprobs asked.
struct SampledToken : TokenLogprob {
  int64_t seq_id = 0;
};

// When a request stops (vLLM's stop parameters); the engine applies them to the tokens it samples.
struct StopConditions {
  int64_t max_tokens = 16;  // >= 1; 0 only with prompt logprobs (score the prompt, sample nothing)
  int64_t min_tokens = 0;  // EOS and stop tokens are ignored before this many tokens
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop_strings;
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
};

}  // namespace relay

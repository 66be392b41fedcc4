// Token sampling over one row of fp32 logits, with vLLM's semantics; shared by every backend.
//
// sample_token applies, in vLLM's order: logprobs of the raw logits (before any processing, vLLM's
// default "raw_logprobs"), then repetition / frequency / presence penalties, then the request's
// token constraints (logit_bias, a structured-output grammar's bitmask), then greedy argmax
// when temperature is 0; otherwise logits / temperature, min-p, top-k, top-p, and a draw from the
// remaining distribution. The draw uses one uniform number that is a pure function of (seed,
// sample_index) — a splitmix64 hash — so a sequence recomputed after preemption, or run in another
// batch or on another backend, draws the same token from the same logits. The building blocks are
// exposed for tests and for backends that fuse some of them on the device; token_logprob scores a
// given token (prompt logprobs) with the same log-softmax and top-k as a sampled one.
//
// Drafts (speculative decoding, backend.h): sample_with_drafts verifies draft tokens against the
// target's rows of logits. Each draft is a point mass q = [d], for which rejection sampling accepts
// d with probability min(1, p(d) / q(d)) = p(d) and otherwise samples from max(p - q, 0)
// renormalised, that is from p with d removed. Here the acceptance test and the draw on rejection
// share the row's one uniform u = sample_uniform(seed, index): the row's token is the inverse CDF
// of its distribution p at u, which is d on an interval of u of length p(d) (accept), and
// otherwise distributed as p without d, renormalised (the correction). So the output distribution
// is exactly the target's, and a sequence draws the very tokens it draws without drafts, in any
// batch, on any backend: greedy rows accept drafts while they equal the argmax.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "engine/backend.h"

namespace relay {

// A uniform double in [0, 1), a pure function of (seed, index).
double sample_uniform(uint64_t seed, uint64_t index);

// out[i] = logits[i] - logsumexp(logits), accumulated in double.
void log_softmax(std::span<const float> logits, std::span<float> out);
// The k most likely (token, logprob) of a log-softmax row, best first, the lowest id first on ties;
// k is capped at the row's size.
std::vector<std::pair<int32_t, float>> top_logprobs(std::span<const float> logprobs, int k);
// 1 + the number of entries of `logprobs` larger than that of `token` (ties share a rank).
int32_t rank_of(std::span<const float> logprobs, int32_t token);
// vLLM's logprob of `token` at one row of raw logits: log_softmax(logits)[token], its rank and the
// num_top most likely tokens of the row (prompt logprobs; sample_token does the same for the
// sampled token). `scratch` receives the log-softmax row.
TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int num_top,
                           std::vector<float>& scratch);

// vLLM's penalties: repetition_penalty r divides positive logits by r and multiplies negative ones by
// r for every token seen in the prompt or the output; then logit -= frequency_penalty * count and
// logit -= presence_penalty * (count > 0), counting output tokens only.
void apply_penalties(std::span<float> logits, std::span<const int32_t> prompt_tokens,
                     std::span<const int32_t> output_tokens, const SamplingParams& params);

// Masks (sets to -inf) every token whose probability under softmax(logits) is below
// min_p * the largest probability. 0 disables.
void apply_min_p(std::span<float> logits, float min_p);
// Keeps the top_k largest logits (ties at the k-th value are kept, as vLLM); 0 disables.
void apply_top_k(std::span<float> logits, int top_k);
// Keeps the smallest set of most likely tokens whose probability mass reaches top_p (at least one
// token); 1 disables.
void apply_top_p(std::span<float> logits, float top_p);

// Index of the largest logit; the lowest index on ties (torch.argmax).
int32_t argmax(std::span<const float> logits);
// Draws from softmax(logits) by inverting its CDF (in token-id order) at u in [0, 1).
int32_t sample_categorical(std::span<const float> logits, double u);

// Constraints on the sampled token (StepSequence::allowed_tokens and logit_bias; empty: none).
struct TokenConstraints {
  std::span<const uint32_t> allowed_tokens;  // bitmask of the tokens that may be sampled
  std::span<const std::pair<int32_t, float>> logit_bias;
};

// Adds the biases, then sets every token the bitmask does not allow to -inf (throws relay::Error
// when it allows none, or a bias names a token outside the vocabulary).
void apply_token_constraints(std::span<float> logits, const TokenConstraints& c);

// The whole pipeline. `logits` is scratch: it is modified. seq_id of the result is left 0.
// logprob and top are filled only when params.num_logprobs >= 0 (they cost a pass over the vocabulary).
SampledToken sample_token(std::span<float> logits, const SamplingParams& params,
                          std::span<const int32_t> prompt_tokens, std::span<const int32_t> output_tokens,
                          uint64_t sample_index, const TokenConstraints& constraints = {});

// Verifies `drafts` (see the file comment). `logits` holds 1 + drafts.size() rows, row j the
// target's logits for the token after drafts[0, j); constraints.allowed_tokens is empty or one
// bitmask per row, logit_bias applies to every row. Row j is sampled by sample_token with the
// drafts before it counted as output (penalties) and sample index sample_index + j, and draft j
// is accepted while it equals row j's token. Returns the accepted drafts, then the token sampled at
// the row after them (1 + accepted tokens, with their logprobs); rows after a rejection are not
// sampled. Without drafts this is sample_token. `logits` is scratch.
// With `forced_acceptance` (relay bench's --spec-forced-acceptance, for models without a trained
// draft head; serve and generate never set it) the verification is NOT lossless: draft j is
// accepted with that probability whatever row j sampled (an accepted draft the row did not sample
// carries no logprob), so a benchmark sees a chosen acceptance rate with the real work per step.
// The verification walk itself, for a backend that samples the rows elsewhere (the CUDA backend's
// sampling kernel): `sample_row(j)` gives row j's token, sampled as sample_with_drafts samples it
// (drafts[0, j) counted as output, sample index sample_index + j); the walk asks for rows in order
// and stops after the first rejected draft, with sample_with_drafts' forced-acceptance rule
// (`seed`: the request's SamplingParams::seed).
std::vector<SampledToken> verify_drafts(std::span<const int32_t> drafts, uint64_t seed,
                                        uint64_t sample_index,
                                        std::optional<double> forced_acceptance,
                                        const std::function<SampledToken(size_t)>& sample_row);

std::vector<SampledToken> sample_with_drafts(
    std::span<float> logits, std::span<const int32_t> drafts, const SamplingParams& params,
    std::span<const int32_t> prompt_tokens, std::span<const int32_t> output_tokens,
    uint64_t sample_index, const TokenConstraints& constraints = {},
    std::optional<double> forced_acceptance = std::nullopt);

}  // namespace relay

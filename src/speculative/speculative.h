// Speculative decoding: the configuration (vLLM's --speculative-config) and the draft proposers.
//
// A proposer guesses the next k tokens of a decoding sequence; the target model then scores all
// 1 + k positions in one step and keeps the drafts it agrees with (the verification is the
// engine's and the backend's: engine/backend.h, Drafts; it is lossless, so a wrong guess costs
// only the wasted rows, never a different answer). The drafts reach the engine through
// LLMEngine::set_drafts.
//
// Proposers:
//   - "ngram" (prompt lookup, vLLM's NgramProposer): the longest suffix of the sequence, from
//     prompt_lookup_max tokens down to prompt_lookup_min, that occurred earlier in its prompt or
//     output; the drafts are the k tokens that followed its latest earlier occurrence. It costs no
//     model and pays where the output copies its input (code editing, quoting, extraction). The
//     engine runs it before each step.
//   - "mtp" (multi-token prediction): the model's own MTP layer (model/mtp.h: the checkpoint's
//     mtp.* tensors, or with "model": DIR a separate head with the same names, for Qwen3 targets
//     that ship none) drafts k tokens greedily, chaining the layer on its own output. The backend
//     runs it after each target forward (engine/cpu_backend.h), so it lives there, not here.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace relay {

struct SpeculativeConfig {
  enum class Method { kNone, kNgram, kMtp };
  Method method = Method::kNone;
  int num_speculative_tokens = 0;  // k: drafts per step and sequence
  int prompt_lookup_max = 5;       // ngram: the longest suffix looked up
  int prompt_lookup_min = 2;       // ngram: the shortest
  std::string model;               // mtp: a directory with the MTP head, when not in the checkpoint
  // vLLM's disable_by_batch_size: no drafts in a step that starts with more running requests than
  // this (verifying 1 + k rows per sequence stops paying once the batch is compute-bound); 0: off.
  int disable_by_batch_size = 0;
  // Relay's own: per request, draft only the tokens likely enough to be accepted (DraftLength
  // below: each of them lands with probability >= this); 0: always num_speculative_tokens.
  double min_draft_acceptance = 0.0;

  bool enabled() const { return method != Method::kNone; }
  // vLLM's JSON: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
  // "prompt_lookup_min": M} or {"method": "mtp", "num_speculative_tokens": K, "model": DIR}, either
  // with "disable_by_batch_size": B (at least 2, as vLLM) and "min_draft_acceptance": R
  // (0 < R < 1).
  // Throws relay::Error naming the field on anything else (unknown method or field, K outside
  // [1, kMaxSpeculativeTokens], min > max, ...).
  static SpeculativeConfig parse(std::string_view json_text);
  std::string describe() const;  // "ngram k=3 lookup 2..5", for logs
};

constexpr int kMaxSpeculativeTokens = 16;

// Speculative decoding's counters since start, with vLLM's meanings (its spec_decode_* metrics).
struct SpecDecodeStats {
  uint64_t num_drafts = 0;           // decodes that carried drafts into a step
  uint64_t num_draft_tokens = 0;     // drafts verified
  uint64_t num_accepted_tokens = 0;  // of them, accepted
  std::vector<uint64_t> num_accepted_tokens_per_pos;  // [k]: accepted at draft position i

  // Accepted drafts over drafts verified (0 when none were).
  double acceptance_rate() const;
  // vLLM's mean acceptance length: tokens a decode with drafts commits, 1 + accepted per decode
  // (0 when no decode carried drafts).
  double mean_acceptance_length() const;
  // The counts since `earlier` (the same counters read before).
  SpecDecodeStats since(const SpecDecodeStats& earlier) const;
};

// How many drafts one request's next step carries, from how its own drafts fared (the engine keeps
// one per request when min_draft_acceptance is set). A step verifies draft j only when drafts
// 0..j-1 were accepted, so with a per-token acceptance a draft j lands (is accepted) with
// probability a^(j+1). `a` is estimated from the request's recent steps: accepted drafts over
// accepted drafts plus rejections (a step that rejects one stops there), each step's counts
// weighted by kDecay per step since, starting from one accepted draft so that a request drafts
// from its first step. A request drafts the j that land with probability >= min_acceptance, up to
// max_drafts. When not even the first does, it stops drafting and probes with one draft after
// kFirstBackoff steps without, doubling the wait (up to kMaxBackoff) while probes fail: a draft
// the target rejects costs a verified row (and an MTP head's forwards) and saves nothing.
class DraftLength {
 public:
  static constexpr double kDecay = 0.8;
  static constexpr int kFirstBackoff = 4;
  static constexpr int kMaxBackoff = 64;

  DraftLength(int max_drafts, double min_acceptance);
  // The drafts for the next step; call once per step that could carry drafts (it counts the
  // steps without while the request is off).
  int next();
  // A verified step's outcome: num_accepted of its num_drafts drafts were accepted.
  void observe(int num_drafts, int num_accepted);
  double acceptance() const { return accepted_ / tries_; }

 private:
  int landing() const;  // the drafts that land with probability >= min_acceptance_

  int max_drafts_;
  double min_acceptance_;
  double accepted_ = 1.0, tries_ = 1.0;  // the decayed counts (the prior: one accepted draft)
  int steps_off_ = 0;
  int backoff_ = kFirstBackoff;
};

// The n-gram proposal for `tokens` (a sequence's prompt and output so far): the `k` tokens that
// followed the latest earlier occurrence of its longest suffix of min_n..max_n tokens (repeating
// them periodically where the context ends first), or none when no such suffix occurred earlier.
std::vector<int32_t> propose_ngram(std::span<const int32_t> tokens, int min_n, int max_n, int k);

}  // namespace relay

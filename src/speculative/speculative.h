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

  bool enabled() const { return method != Method::kNone; }
  // vLLM's JSON: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
  // "prompt_lookup_min": M} or {"method": "mtp", "num_speculative_tokens": K, "model": DIR}, either
  // with "disable_by_batch_size": B (at least 2, as vLLM).
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

// The n-gram proposal for `tokens` (a sequence's prompt and output so far): up to `k` tokens, or
// none when no suffix of min_n..max_n tokens occurred earlier.
std::vector<int32_t> propose_ngram(std::span<const int32_t> tokens, int min_n, int max_n, int k);

}  // namespace relay

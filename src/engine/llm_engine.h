// LLMEngine: requests in, tokens and text out, one step at a time.
//
// It owns a Backend (the compute and the KV memory), a BlockManager over the backend's pool and a
// Scheduler, and turns each request's generated ids into text with an IncrementalDetokenizer.
// step() runs one scheduler step and returns, per request that progressed, the new token ids, the
// text that became final, logprobs when asked, and a finish reason once it is done.
//
// Prompt logprobs (vLLM's prompt_logprobs, for echo and scoring): a request with
// num_prompt_logprobs >= 0 computes every prompt position (no prefix-cache hit; scheduler.h) and
// the backend scores each prompt token against the logits of the position before it, chunk by
// chunk (backend.h). The engine keeps the rows by prompt position until the prompt is done, so a
// request preempted mid-prompt and recomputed overwrites positions instead of repeating them, then
// delivers all of them once, in the request's first output. With max_tokens 0 the request stops
// there: that first output is also its last (finish "length"), and nothing is sampled.
//
// Structured outputs: a request may carry a compiled grammar (grammar/grammar.h) and a logit_bias.
// Before each token it samples, the engine fills the grammar matcher's bitmask of allowed tokens
// and hands it to the backend with the biases (StepSequence::allowed_tokens, logit_bias); the
// sampled token then advances the matcher. A model that reasons first (Qwen3's <think>…</think>,
// EngineRequest::reasoning) may open its block as its first token, or starts inside it when the
// prompt opened it; the grammar then waits for the block's end and constrains what follows (as
// vLLM's reasoning-aware structured outputs do). Once the grammar is complete only a stop token is
// allowed; after it (ignore_eos) nothing more is constrained.
//
// Speculative decoding: a proposer gives a request draft tokens for its next step (set_drafts):
// the engine's n-gram lookup at the start of a step, or the backend's MTP head, which runs after
// the target forward of each step and returns the next step's drafts (StepSequence::
// proposed_drafts; the scheduler leaves it lookahead blocks for the K/V of the drafts it chains,
// and a prefix hit gives back its last block, where the head's K/V depends on the token after
// the hit). The scheduler budgets 1 + k tokens for that decode and allocates their KV, the
// backend verifies the drafts in the step's forward pass (backend.h), and the step commits the
// accepted drafts and the token sampled after them; update() releases the KV of the rejected ones
// (scheduler.h). Each committed token then goes through everything a sampled token goes through
// (grammar, logprobs, detokenization, the stop checks below), in order, and the tokens after the
// one that finishes the request are dropped. Verification samples every row exactly as a step
// without drafts would (sampler.h): a request gets the same tokens with or without drafts, greedy
// or seeded, so a proposer changes only how many steps it takes. With a grammar, the backend gets
// the mask of each row by walking the matcher through the drafts and rolling it back; drafts the
// grammar refuses, or that max_tokens leaves no room for, are dropped when they are set. With an
// MTP head a KV reservation (disaggregated decode) is refused: the head's K/V of the prompt would
// have to come from the prefill worker too.
//
// Stopping: max_tokens and the context length give "length"; an EOS id (unless ignore_eos), a
// stop_token_id or a stop string gives "stop". Stop strings are matched on the decoded text; text
// that could still be the beginning of a stop string is held back until it cannot (so a stop string
// never leaks to the client in pieces), and the match is cut out of the text (kept with
// include_stop_str_in_output). Stop tokens are counted as generated but add no text.
//
// Hybrid models (linear-attention layers, backend num_state_slots() > 0): the engine gives every
// running sequence its recurrent-state slots through a StateSlotManager (1 + num_speculative_tokens
// each, the extra ones the backend's scratch for draft positions) that the scheduler takes at
// admission and returns at finish or preemption. Its prefix-cache hits need state snapshots at
// block boundaries (kvcache/state_snapshots.h, scheduler.h): with enable_prefix_caching and a
// backend that keeps them (Backend::num_state_snapshots() > 0) the engine owns the
// StateSnapshotPool and passes each chunk's restore and saves to the backend (StepSequence::
// restore_state_snapshot, save_state_snapshots); without them such a model takes no hit. It
// hands a prompt over between disaggregated workers with its state: a hold_kv request keeps its
// state slots with its blocks (RequestOutput::state_slot), a KV reservation takes slots with its
// blocks (KvReservation::state_slot, no prefix hit: the state after the whole prompt comes with
// the whole prompt's KV), and release_kv frees both.
//
// The engine is single-threaded: one thread calls add_request/abort/set_drafts/step (the server's
// engine loop). A request that could never fit in the KV pool is refused by add_request with an
// Error.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/backend.h"
#include "grammar/grammar.h"
#include "kvcache/block_manager.h"
#include "kvcache/state_slots.h"
#include "kvcache/state_snapshots.h"
#include "scheduler/scheduler.h"
#include "speculative/speculative.h"
#include "tokenizer/tokenizer.h"

namespace relay {

struct EngineConfig {
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int max_model_len = 0;  // 0: the model's max_position_embeddings (capped by the KV pool)
  bool enable_prefix_caching = true;
  // Speculative decoding (--speculative-config): drafts for every decode, from the engine's
  // n-gram lookup before each step or from the backend's MTP head after it
  // (speculative/speculative.h); needs a backend that verifies drafts, and for "mtp" one loaded
  // with the head and the same num_speculative_tokens (Backend::num_proposed_drafts).
  SpeculativeConfig speculative{};
};


// The tokens that open and close a reasoning block (Qwen3's <think> and </think>), for a grammar
// that applies after it; -1: the model does not reason (the grammar applies from the first token).
struct ReasoningTokens {
  int32_t open = -1;
  int32_t close = -1;
  bool starts_inside = false;  // the prompt opened the block (the model is reasoning already)
};

struct EngineRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  StopConditions stop;
  // Prompt logprobs, -1: none; k >= 0: the logprob of every prompt token given the tokens before it
  // (raw logits' log-softmax, as vLLM) and its k most likely alternatives. Needs a backend that
  // supports them (LLMEngine::supports_prompt_logprobs).
  int num_prompt_logprobs = -1;
  // Disaggregated prefill: when the request finishes, its KV blocks stay allocated (listed in the
  // final output's kv_blocks) until release_kv(id), so they can be sent to a decode worker.
  bool hold_kv = false;
  // Structured output (null: none) and OpenAI's logit_bias: both need a backend that applies
  // token constraints (Backend::supports_token_constraints).
  std::shared_ptr<const CompiledGrammar> grammar;
  std::vector<std::pair<int32_t, float>> logit_bias;
  ReasoningTokens reasoning;
};

enum class FinishReason { kNone, kStop, kLength, kAbort };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort" ("" for kNone)

struct RequestOutput {
  int64_t id = 0;
  std::vector<int32_t> new_tokens;
  std::string text;                    // text that became final this step
  std::vector<TokenLogprob> logprobs;  // one per new token, when the request asked for logprobs
  // The request's first output, when it asked for prompt logprobs: one per prompt position, the
  // first nullopt (no token precedes it), as vLLM's prompt_logprobs; empty in every other output.
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  FinishReason finish = FinishReason::kNone;
  // vLLM's stop_reason, with finish kStop: the stop_token_ids entry or the stop string that ended
  // the request (neither: the model's EOS).
  std::optional<int32_t> stop_token;
  std::optional<std::string> stop_string;
  int num_prompt_tokens = 0;
  int num_output_tokens = 0;       // generated so far
  int num_cached_tokens = 0;       // prompt tokens served from the prefix cache
  double queue_time_s = 0.0;       // arrival to first scheduled; set once finished
  std::vector<int32_t> kv_blocks;  // final output of a hold_kv request: its held block table
  int32_t state_slot = -1;         // and its held recurrent-state slot (hybrid models; -1: none)
};

struct EngineStats {
  int num_running = 0;
  int num_waiting = 0;
  double kv_cache_usage = 0.0;
  double state_slot_usage = 0.0;  // recurrent-state slots in use, 0..1 (0 without such layers)
  SchedulerStats scheduler;
  SpecDecodeStats spec_decode;
  int num_cached_state_snapshots = 0;  // hybrid prefix caching: snapshots findable now
};

// What the last step() computed and where its time went: the serving metrics time decode-only
// steps separately, because their rate is the one `relay bench` measures (a step that also carries
// prefill chunks is longer by design), and split each step into its phases to show what the host
// adds to the backend's compute.
struct StepComposition {
  int num_seqs = 0;          // sequences in the batch
  int num_tokens = 0;        // tokens computed
  int num_draft_tokens = 0;  // of num_tokens, drafts verified
  double schedule_s = 0.0;   // scheduling and building the flattened batch
  double forward_s = 0.0;    // Backend::step (the forward pass and sampling)
  double outputs_s = 0.0;    // scheduler update, detokenization, stop checks, finishing requests
  bool decode_only() const { return num_seqs > 0 && num_tokens - num_draft_tokens == num_seqs; }
};

class LLMEngine {
 public:
  LLMEngine(std::unique_ptr<Backend> backend, Tokenizer tokenizer, const EngineConfig& config);
  ~LLMEngine();

  // Queues a request under a caller-chosen id (unique among live requests). Throws relay::Error
  // when the prompt is empty, a token is out of the vocabulary, prompt + max_tokens exceeds
  // max_model_len(), or it asks for prompt logprobs the backend does not compute.
  void add_request(int64_t id, EngineRequest request);
  // Drops a request and frees its KV blocks now. Returns its final output (finish kAbort), or
  // nothing for an unknown id.
  std::optional<RequestOutput> abort(int64_t id);
  // Runs one step; returns an output for every request that produced a token or finished.
  std::vector<RequestOutput> step();
  // Speculative decoding: proposes `drafts` as the tokens following request `id`'s last one, for
  // its next step only, replacing any not used yet (an empty list withdraws them). The step that
  // runs the request verifies them and commits the accepted ones and one token more; a step that
  // runs it otherwise (a prompt chunk, or no budget or KV blocks to spare) drops them. Drafts that
  // max_tokens leaves no room for, those from the first one the request's grammar refuses, and for
  // a hybrid model those beyond its scratch state slots (num_speculative_tokens), are dropped now.
  // With an n-gram --speculative-config, the proposer runs at the start of each step for the
  // decodes that were given no drafts this way; with MTP, each step ends by setting the drafts
  // its head proposed, which a call before the next step replaces. Throws relay::Error when the
  // backend does not verify drafts (supports_draft_tokens), for an unknown request, or for a token
  // outside the vocabulary.
  void set_drafts(int64_t id, std::span<const int32_t> drafts);

  // Disaggregated decode. reserve_kv allocates blocks for `prompt` under a new request id, reusing
  // its leading full blocks from the prefix cache (nothing when the pool or max_num_seqs has no
  // room now); a prefill worker then writes the KV of the rest of the prompt into them, and
  // add_prefilled_request starts the request from the first token the prefill worker sampled,
  // returning that token's output (it may already finish the request). The prefill worker sampled
  // it under the request's grammar and logit_bias; here the grammar advances past it (a grammar
  // that refuses it is an error) and constrains the tokens after it, and a stop token that
  // completes the grammar finishes the request. Prompt logprobs come from the prefill worker.
  // release_kv frees a reservation that will not be used, or a finished hold_kv request's blocks.
  struct KvReservation {
    std::vector<int32_t> block_table;
    int num_cached_tokens = 0;  // leading prompt tokens whose KV is already in the reserved blocks
    int32_t state_slot = -1;    // hybrid models: the slot the prompt's state goes to (-1: none)
  };
  std::optional<KvReservation> reserve_kv(int64_t id, std::span<const int32_t> prompt);
  RequestOutput add_prefilled_request(int64_t id, EngineRequest request, const SampledToken& first,
                                      int num_cached_tokens);
  void release_kv(int64_t id);
  // The block manager's partition (DP rank) of a reservation or held request.
  int kv_partition(int64_t id) const { return blocks_.partition_of(id); }
  int num_held_kv() const { return static_cast<int>(held_kv_.size()); }
  // The first state slot (the one holding its state) of a sequence, reservation or held request
  // of a hybrid model; -1 otherwise.
  int32_t state_slot(int64_t id) const;

  bool has_work() const { return scheduler_.has_work(); }
  EngineStats stats() const;
  StepComposition last_step() const { return last_step_; }
  int max_model_len() const { return max_model_len_; }
  int max_num_seqs() const { return scheduler_.config().max_num_seqs; }
  bool supports_prompt_logprobs() const { return backend_->supports_prompt_logprobs(); }
  bool supports_token_constraints() const { return backend_->supports_token_constraints(); }
  bool supports_draft_tokens() const { return backend_->supports_draft_tokens(); }
  const ModelConfig& model_config() const { return backend_->config(); }
  const Tokenizer& tokenizer() const { return tokenizer_; }
  Backend& backend() { return *backend_; }

 private:
  struct Request;
  // The checks add_request and add_prefilled_request share.
  void validate(int64_t id, const EngineRequest& request) const;
  // The request's state both start with: its stop conditions, logprobs, held KV and token
  // constraints (the grammar's matcher at its start), moved out of `request`.
  std::unique_ptr<Request> make_request(int64_t id, EngineRequest& request) const;
  // Appends the text of new token `token` and decides whether the request stops. The sequence
  // already holds it and the `num_later` tokens committed after it in the same step.
  void on_token(Request& r, const SampledToken& sampled, RequestOutput& out, int num_later = 0);
  // Stores the prompt logprob rows the backend returned for `chunk` by prompt position.
  void keep_prompt_logprobs(Request& r, const StepSequence& chunk);
  // Moves the finished prompt logprobs into the request's first output.
  void deliver_prompt_logprobs(Request& r, RequestOutput& out);
  // Walks the request's grammar through `drafts` from its state now, and back: returns how many
  // of them it allows in a row, and, given `masks`, writes the bitmask of the tokens allowed after
  // its last token and after each allowed draft (one per row; empty when no row is constrained).
  size_t walk_grammar(Request& r, std::span<const int32_t> drafts, bool first_output,
                      std::vector<uint32_t>* masks);
  // Speculative decoding: asks the proposer for every running decode's drafts (before a step).
  void propose_drafts();
  // Whether the coming step may carry drafts (a proposer's or set_drafts'): the running batch is
  // within speculative decoding's disable_by_batch_size, when one is set.
  bool drafting() const;
  // How many drafts the request's next step may carry (num_speculative_tokens, or fewer with
  // min_draft_acceptance); call once per step that could give it drafts.
  int next_drafts(Request& r);
  // Records a verified step of `num_drafts` drafts, `num_accepted` of them accepted.
  void count_drafts(int num_drafts, int num_accepted);
  // Advances the request's grammar past a token; false (and no change) when the grammar refuses it.
  bool advance_grammar(Request& r, int32_t token, bool first_output);
  void finish(Request& r, FinishReason reason, RequestOutput& out);

  std::unique_ptr<Backend> backend_;
  Tokenizer tokenizer_;
  int max_model_len_;
  BlockManager blocks_;
  std::unique_ptr<StateSlotManager> states_;  // null for a model without recurrent layers
  std::unique_ptr<StateSnapshotPool> snapshots_;  // null: a hybrid model takes no prefix hit
  Scheduler scheduler_;
  StepComposition last_step_;
  std::unordered_map<int64_t, std::unique_ptr<Request>> requests_;
  std::unordered_set<int64_t> held_kv_;  // reservations and finished hold_kv requests
  SpeculativeConfig speculative_;
  SpecDecodeStats spec_stats_;
};

}  // namespace relay

// The interface between the scheduler and a compute backend (CPU now, CUDA next).
//
// The scheduler decides, each step, which sequences run and how many of their tokens (a prompt
// chunk, or the one token generated last); the block manager has already given each sequence the KV
// blocks it needs. The backend runs the model over that flattened batch, writes K/V into the paged
// cache, and samples a token for each sequence that asks for one. Backends own the KV pool; block
// ids are indices into it, shared by every layer (a block id names the same slot in each layer).
//
// Prompt logprobs (vLLM's prompt_logprobs) ride on the same step: a sequence that asks for them
// (num_prompt_logprobs >= 0) gets, in the same forward pass, the logprob of every prompt token that
// follows a row of its chunk, written to the vector its prompt_logprobs points at. They come back
// through that pointer rather than through step()'s result so that the result keeps one shape
// (sampled tokens only) for every backend, and a backend that does not compute them
// (supports_prompt_logprobs() false; the engine refuses such requests) needs no change at all.
//
// Drafts (speculative decoding): a decoding sequence may carry, after its last token, k draft
// tokens proposed to follow it (num_draft_tokens). The backend computes the logits of all 1 + k
// rows in the one forward pass and verifies the drafts in order (sampler.h, sample_with_drafts):
// row j samples the token after draft j - 1 exactly as a step without drafts would sample it at
// that point (its penalties counting the drafts before it, sample index sample_index + j, its own
// row of allowed_tokens), and draft j is accepted while it equals row j's token. The extra tokens
// come back in step()'s result, not through an output pointer as prompt logprobs do: they are
// sampled tokens like the one a step always returned, each with its logprobs, and what the
// scheduler commits. So the result holds, per sampling sequence, its accepted drafts and then the
// token sampled after them (1 + accepted entries, consecutive, all with its seq_id); a backend that
// never gets drafts (supports_draft_tokens() false; the engine refuses them) returns one token per
// sampling sequence as before, and needs no change at all.
//
// State snapshots (prefix caching of hybrid models, kvcache/state_snapshots.h): a backend with a
// recurrent-state pool may also keep num_state_snapshots() snapshot slots, each a copy of one
// sequence's whole state, and then takes two explicit operations per sequence with its step:
// restore (copy a snapshot over the sequence's state slot before computing its tokens: a prefix
// hit whose KV came from the cache and whose state comes from the snapshot) and save (copy the
// state after a row of the chunk into a snapshot: a block boundary). A decode with drafts saves
// only at rows it accepts (the last token's, or an accepted draft's), after verifying them. They ride on the step so
// that they happen in order with the forward on every rank that holds the state, and a backend
// without them (num_state_snapshots() 0; the engine then gives a hybrid model no prefix hit)
// never gets either.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/kv_cache.h"
#include "kvcache/recurrent_state.h"
#include "kvcache/state_snapshots.h"
#include "model/config.h"
#include "sequence/sampling.h"

namespace relay {

// One sequence's part of a step.
struct StepSequence {
  int64_t seq_id = 0;
  std::span<const int32_t> tokens;       // the tokens to compute now
  int32_t num_computed = 0;              // tokens already in the KV cache (position of tokens[0])
  std::span<const int32_t> block_table;  // KV blocks covering num_computed + tokens.size()
  bool sample = false;                   // sample after the last token of `tokens`
  // Of `tokens`, the trailing drafts (only with sample, fewer than tokens.size()): the backend
  // samples after each of the last 1 + num_draft_tokens tokens and verifies them (see above).
  int32_t num_draft_tokens = 0;
  const SamplingParams* sampling = nullptr;  // when sample
  std::span<const int32_t> output_tokens;    // generated so far (drafts excluded), for penalties
  uint64_t sample_index = 0;                 // how many tokens this sequence sampled before
  // The prompt: for repetition_penalty (vLLM counts both) and for prompt logprobs.
  std::span<const int32_t> prompt_tokens;
  // Prompt logprobs, -1: none; k >= 0: row j of `tokens` is scored against its next prompt token,
  // prompt_tokens[num_computed + j + 1], for every j where that index is inside the prompt (so the
  // last row of a chunk that ends the prompt is not: it is the row that samples). The backend
  // replaces *prompt_logprobs with one entry per such row, in order (num_prompt_logprob_rows()):
  // that token's logprob and the k most likely tokens of the row, from the raw logits.
  int num_prompt_logprobs = -1;
  std::vector<TokenLogprob>* prompt_logprobs = nullptr;  // output, when num_prompt_logprobs >= 0
  // Constraints on the sampled token (structured outputs, logit_bias), applied to the logits after
  // the penalties and before temperature and the truncations; logprobs stay those of the raw logits
  // (vLLM's default). `allowed_tokens`: a bitmask, bit i of word i / 32 set when token i may be
  // sampled (grammar/grammar.h's layout), empty for no mask — with drafts, one bitmask per sampled
  // row, back to back; `logit_bias`: (token, bias) added to the logits of every sampled row. A
  // backend without them (supports_token_constraints() false) must not get them.
  std::span<const uint32_t> allowed_tokens;
  std::span<const std::pair<int32_t, float>> logit_bias;
  // The sequence's recurrent-state slots (kvcache/state_slots.h) when the model has
  // linear-attention layers, empty otherwise. The step advances the state in state_slots[0] over
  // `tokens`, from a zero state when num_computed is 0. With drafts, state_slots[0] ends holding
  // the state after the last committed token (the last token and the accepted drafts); the other
  // slots, one per draft, are the backend's scratch space for the states after each draft and hold
  // nothing between steps.
  std::span<const int32_t> state_slots;
  // State snapshots (see the top of this file; no restore with drafts): restore_state_snapshot >= 0
  // copies that snapshot over state_slots[0] before the step (num_computed > 0: the state after
  // the first num_computed tokens); each save copies the state after row `row` of `tokens` into
  // its snapshot.
  int32_t restore_state_snapshot = -1;
  std::span<const SnapshotSave> save_state_snapshots;
  // When the backend drafts itself (num_proposed_drafts() > 0, an MTP head): the drafts for the
  // sequence's next step, replaced by a step that samples it (at most num_proposed_drafts() and
  // max_proposed_drafts; fewer when its KV blocks end first); null when none are wanted.
  std::vector<int32_t>* proposed_drafts = nullptr;
  // The engine's draft-length control (min_draft_acceptance) asks for fewer: the head's chain
  // stops there instead of computing rows nobody verifies.
  int32_t max_proposed_drafts = std::numeric_limits<int32_t>::max();

  // How many rows of `tokens` prompt logprobs score (0 unless asked).
  size_t num_prompt_logprob_rows() const {
    if (num_prompt_logprobs < 0) return 0;
    const int64_t rows = static_cast<int64_t>(prompt_tokens.size()) - num_computed - 1;
    return static_cast<size_t>(std::clamp<int64_t>(rows, 0, static_cast<int64_t>(tokens.size())));
  }
};


// One rank's recurrent-state pool as a transfer engine sees it (hybrid models): where its bytes are
// and which Gated DeltaNet heads they hold (model/shard.h: a TP rank keeps a contiguous range of
// key heads and the value heads that read them). Slot ids in `layout` are local to the rank
// (global id - dp_rank * slots per DP rank).
struct StatePoolExport {
  std::byte* base = nullptr;  // host memory, or device memory of CUDA device `device`
  RecurrentStateLayout layout;
  int first_k_head = 0, num_k_heads = 0;
  int first_v_head = 0, num_v_heads = 0;
  int dp_rank = 0;
  int device = -1;  // -1: host memory
};

// One rank's KV pool as a transfer engine sees it: where its bytes are and what they hold. Block
// ids in `layout` are local to the rank (global id - dp_rank * layout.num_blocks).
struct KvPoolExport {
  std::byte* base = nullptr;  // host memory, or device memory of CUDA device `device`
  KvCacheLayout layout;
  int first_kv_head = 0;
  int num_kv_heads = 0;
  int dp_rank = 0;
  int device = -1;  // -1: host memory
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const ModelConfig& config() const = 0;
  virtual int block_size() const = 0;     // tokens per KV block
  virtual int num_kv_blocks() const = 0;  // blocks in the pool
  // The pool is split into this many equal ranges of block ids, one per data-parallel rank; every
  // block of a sequence must come from one range (its KV lives on that rank).
  virtual int num_kv_partitions() const { return 1; }
  // The slots of the recurrent-state pool (one sequence's state of every linear-attention layer
  // each), 0 for a model without such layers. With DP attention they split into num_kv_partitions
  // equal ranges, one per rank, as the KV blocks do.
  virtual int num_state_slots() const { return 0; }
  // The state snapshots it keeps for prefix caching (StepSequence::restore_state_snapshot and
  // save_state_snapshots), ids [0, n) split over num_kv_partitions as the slots are; 0: none.
  virtual int num_state_snapshots() const { return 0; }
  // Bytes of one state slot (and of one snapshot) on one rank, 0 without a recurrent-state pool.
  virtual size_t state_slot_bytes() const { return 0; }
  // Every rank's KV pool, for disaggregated hand-offs; empty when this backend cannot export it.
  virtual std::vector<KvPoolExport> kv_pool_exports() { return {}; }
  // Every rank's recurrent-state pool (hybrid models), for the same hand-offs; empty without one.
  // Its slots are num_state_slots() / num_kv_partitions() per DP rank, the snapshots after them.
  virtual std::vector<StatePoolExport> state_pool_exports() { return {}; }
  // Runs one forward pass over `batch` and returns, per sequence with sample=true and in batch
  // order, its accepted drafts and the token sampled after them (one token without drafts); fills
  // the prompt logprobs of the sequences that ask for them.
  virtual std::vector<SampledToken> step(std::span<const StepSequence> batch) = 0;
  // Whether step() computes prompt logprobs (StepSequence::num_prompt_logprobs); a backend without
  // them ignores the field, so the engine refuses requests that ask.
  virtual bool supports_prompt_logprobs() const { return false; }
  // Whether step() applies StepSequence::allowed_tokens and logit_bias; the engine refuses requests
  // with a grammar or a logit_bias otherwise.
  virtual bool supports_token_constraints() const { return false; }
  // Whether step() verifies drafts (StepSequence::num_draft_tokens); the engine refuses drafts
  // otherwise, since a backend without them would take the drafts for committed tokens.
  virtual bool supports_draft_tokens() const { return false; }
  // The drafts per sequence a step proposes for the next one (StepSequence::proposed_drafts), from
  // a draft head the backend runs after its target forward (MTP); 0 when it proposes none. The
  // scheduler then gives sampling chunks num_proposed_drafts() - 1 lookahead positions, where the
  // head writes its own K/V for the drafts it chains.
  virtual int num_proposed_drafts() const { return 0; }
  // Why no later step can succeed (empty while steps can): a multi-node worker that lost a node.
  // Read on the thread that calls step.
  virtual std::string unusable_reason() const { return {}; }
};

}  // namespace relay

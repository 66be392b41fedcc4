// The flattened batch a model forward runs over: every scheduled token of every sequence in one
// list.
//
// Sequence s owns token rows [query_starts[s], query_starts[s+1]); its KV cache covers
// context_lens[s] tokens after this step (the new tokens included) through its block table row.
// slot_mapping says where each new token's K/V goes (block * block_size + offset; -1 = nowhere);
// positions are the RoPE positions (normally the cache positions, but tests may shift them). Only
// the rows in logit_rows get logits — the last token of each sequence that samples.
//
// A model with linear-attention layers (Qwen3.5, Qwen3-Next) also keeps a recurrent state per
// sequence (kvcache/recurrent_state.h): sequence s's is slot state_slots[s] of recurrent_state,
// which the forward reads and advances past the new tokens. state_fresh[s] = 1 says the sequence
// starts here (its first chunk: context_lens[s] equals its new tokens) and its state starts from
// zero, whatever the slot held before; 0 continues the slot's state, which must then be this
// sequence's state after its first context_lens[s] - (new tokens) tokens. Recurrent state cannot
// be rolled back, so every new token of such a sequence is committed (no drafts). Attention-only
// models ignore the three fields, and callers that build only the fields above keep compiling.
#pragma once

#include <cstdint>
#include <span>

namespace relay {

class RecurrentStatePool;

struct ForwardBatch {
  std::span<const int32_t> token_ids;     // [num_tokens]
  std::span<const int32_t> positions;     // [num_tokens]
  std::span<const int32_t> query_starts;  // [num_seqs + 1]
  std::span<const int32_t> context_lens;  // [num_seqs]
  std::span<const int32_t> block_tables;  // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  std::span<const int64_t> slot_mapping;  // [num_tokens]
  std::span<const int32_t> logit_rows;    // [num_logit_rows], indices into the token rows

  // Models with linear-attention layers only (see above).
  RecurrentStatePool* recurrent_state = nullptr;
  std::span<const int32_t> state_slots{};  // [num_seqs], distinct slots of recurrent_state
  std::span<const uint8_t> state_fresh{};  // [num_seqs], 1 = start from a zero state

  int num_tokens() const { return static_cast<int>(token_ids.size()); }
  int num_seqs() const { return static_cast<int>(context_lens.size()); }
};

}  // namespace relay

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
// sequence's state after its first context_lens[s] - (new tokens) tokens. A recurrent state cannot
// be rolled back, so a step verifying drafts keeps the states it may need to return to:
// state_snapshot_slots[t] >= 0 asks for a copy of the sequence's state after token row t in that
// slot (the backend then keeps the one after the last accepted draft); empty or -1: none.
// Attention-only models ignore these fields, and callers that build only the fields above keep
// compiling.
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
  // [num_tokens] or empty: the slot receiving the state after each row (-1: none); never one of
  // state_slots, each slot at most once
  std::span<const int32_t> state_snapshot_slots{};

  int num_tokens() const { return static_cast<int>(token_ids.size()); }
  int num_seqs() const { return static_cast<int>(context_lens.size()); }
};

}  // namespace relay

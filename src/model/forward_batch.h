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
#include <vector>

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

// The storage behind a ForwardBatch, filled sequence by sequence: the one step flattener of both
// backends (the CPU backend's rank and MTP batches, the CUDA backend's step metadata).
struct FlatBatch {
  std::vector<int32_t> token_ids, positions, query_starts{0}, context_lens, block_tables,
      logit_rows;
  std::vector<int64_t> slot_mapping;
  int width = 0;  // block-table columns

  // Empties it for a batch whose block tables are `width` columns wide.
  void reset(int width);
  // Appends a sequence: its new `tokens` at positions num_computed.., each token's K/V slot from
  // `table` (blocks of block_size), the table itself (at most `width` blocks); then `fillers` rows
  // after them that write no K/V (a CUDA graph step pads each sequence to its tokens per sequence;
  // causal attention keeps them out of the real rows). Returns the sequence's first row.
  int32_t append(std::span<const int32_t> tokens, int32_t num_computed,
                 std::span<const int32_t> table, int block_size, int fillers = 0);
  // Appends a padding sequence of `rows` rows at positions 0.. that writes nothing (a CUDA graph
  // step's batch bucket).
  void append_padding(int rows);
  // The flattened fields (the recurrent-state ones are the caller's).
  ForwardBatch view() const;
};

}  // namespace relay

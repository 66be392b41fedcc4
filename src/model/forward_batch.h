// The flattened batch a model forward runs over: every scheduled token of every sequence in one list.
//
// Sequence s owns token rows [query_starts[s], query_starts[s+1]); its KV cache covers
// context_lens[s] tokens after this step (the new tokens included) through its block table row.
// slot_mapping says where each new token's K/V goes (block * block_size + offset; -1 = nowhere);
// positions are the RoPE positions (normally the cache positions, but tests may shift them). Only the
// rows in logit_rows get logits — the last token of each sequence that samples.
#pragma once

#include <cstdint>
#include <span>

namespace relay {

struct ForwardBatch {
  std::span<const int32_t> token_ids;     // [num_tokens]
  std::span<const int32_t> positions;     // [num_tokens]
  std::span<const int32_t> query_starts;  // [num_seqs + 1]
  std::span<const int32_t> context_lens;  // [num_seqs]
  std::span<const int32_t> block_tables;  // [num_seqs, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  std::span<const int64_t> slot_mapping;  // [num_tokens]
  std::span<const int32_t> logit_rows;    // [num_logit_rows], indices into the token rows

  int num_tokens() const { return static_cast<int>(token_ids.size()); }
  int num_seqs() const { return static_cast<int>(context_lens.size()); }
};

}  // namespace relay

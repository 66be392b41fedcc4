// The layout mapper: which contiguous byte ranges move a request's KV from one sharding to another.
//
// This is the "what" of the transfer engine, separate from the "how" (transfer_engine.h): a pure
// function of the two sides' pool descriptors and block tables, with no I/O, so it is tested
// exhaustively on the CPU. A side is a set of ranks, each holding a contiguous range of the model's
// KV heads in an HND pool; ranges may overlap (heads replicated when TP > KV heads). A prefill side
// is typically TP ranks, a decode side one data-parallel rank holding every head, but any pair of
// shardings works: every destination rank receives every head it holds.
//
// Algorithm (docs/transfer.md has worked examples):
//  1. Replica choice: for destination rank d, head h and logical source block j, the sender is
//     replicas(h)[(j + d) % |replicas(h)|], where replicas(h) lists the source ranks holding h in
//     rank order. Each head's bytes are sent exactly once per destination rank, the load alternates
//     between replicas block by block, and heads with the same replica set pick the same sender, so
//     they can still merge.
//  2. Token runs: tokens [token_begin, token_end) are cut at source and at destination block
//     boundaries (the two block sizes may differ); within one run each head is one contiguous
//     range on both sides: run_tokens * head_dim * elem_bytes bytes.
//  3. Merging: copies are produced in the order (source rank, destination rank, layer, K/V, source
//     block, run, head) and each is appended to the previous one when both its source and
//     destination bytes directly follow it. So heads merge when a run covers a whole block on both
//     sides (equal block sizes: one copy per (layer, K/V, block, sending rank)), and consecutive
//     block ids merge too. A partial block never merges across heads: the bytes between them must
//     stay untouched.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "transfer/kv_pool.h"
#include "transfer/region.h"

namespace relay {

// One side of a transfer. Views: the caller keeps the descriptors and the block table alive.
struct KvTransferSide {
  int num_kv_heads = 0;                  // the model's KV heads (all ranks together)
  std::span<const KvPoolDesc> ranks;     // one pool per rank; all share block size and shapes
  std::span<const int32_t> block_table;  // the request's block ids, the same on every rank
};

// What to move: tokens [token_begin, token_end) of layers [layer_begin, layer_end). A whole prompt
// is {0, prompt_tokens}; a decode rank that already holds a cached prefix starts at token_begin; a
// prefill that streams chunk by chunk or layer by layer moves one chunk or layer range at a time.
// Each prefill rank can plan only its own share (src_rank): the replica choice is deterministic, so
// ranks planning separately agree on who sends what.
struct KvCopyScope {
  int64_t token_begin = 0;
  int64_t token_end = 0;
  int layer_begin = 0;
  int layer_end = -1;  // -1: through the last layer
  int src_rank = -1;   // only the copies this source rank executes; -1: every rank's
};

struct KvCopy {
  int src_rank = 0;  // index into the source side's ranks: the rank that executes the copy
  int dst_rank = 0;  // index into the destination side's ranks
  RegionId src_region = 0;
  uint64_t src_offset_bytes = 0;
  RegionId dst_region = 0;
  uint64_t dst_offset_bytes = 0;
  uint64_t bytes = 0;
};

// The copies that move `scope` of a request from `src` to `dst`, ordered by source rank. Throws
// relay::Error when the sides disagree (layers, head_dim, element size, head count), a destination
// head has no source, a block table is too short for the scope, or a block id is outside a pool.
std::vector<KvCopy> plan_kv_copies(const KvTransferSide& src, const KvTransferSide& dst,
                                   const KvCopyScope& scope);

// Appends `copy` to `copies`, or extends the last copy when `copy`'s bytes directly follow it on
// both sides (same ranks and regions): the planners' merging rule.
void append_merged_copy(std::vector<KvCopy>& copies, const KvCopy& copy);

// The copies source rank `src_rank` executes (every copy when src_rank is -1), for its engine.
std::vector<TransferCopy> transfer_copies(std::span<const KvCopy> copies, int src_rank = -1);

}  // namespace relay

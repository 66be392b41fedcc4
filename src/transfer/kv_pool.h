// KV pool descriptors: where each (layer, K or V, block, head, token) of one rank's paged KV cache
// lives inside registered memory regions, so a peer can address a pool it cannot see.
//
// Relay's KV cache is HND (kvcache/kv_cache.h): per layer, K and V are each
// [num_blocks][num_kv_heads][block_size][head_dim], so within one block the slice of heads [a, b)
// is one contiguous range — the unit the layout mapper moves. A descriptor generalises that layout
// just enough for every pool the transfer engine meets:
//  - a pool may hold a subset of the model's KV heads (a tensor-parallel rank: `heads`) or all of
//    them (a data-parallel decode rank);
//  - each layer's K and V tensor is placed independently (region id + byte offset of block 0),
//    so one allocation for the whole pool, one per layer, or K and V interleaved all fit;
//  - `block_stride_bytes` separates consecutive blocks of one tensor; it exceeds the heads' bytes
//    when another tensor is interleaved per block ([num_blocks][2][num_kv_heads][block_size][dim]).
// The head and token strides are fixed by HND: head_bytes() and token_bytes().
// Descriptors are plain data and travel as JSON in the control plane's worker announcements.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "transfer/region.h"

namespace relay {

enum class KvPart : uint8_t { K = 0, V = 1 };

// A contiguous range of the model's KV heads: [first, first + count).
struct KvHeadRange {
  int first = 0;
  int count = 0;

  int end() const { return first + count; }
  bool contains(int head) const { return head >= first && head < end(); }
};

// The KV heads tensor-parallel rank `tp_rank` of `tp_size` holds, as vLLM and Relay's loader shard
// them: with tp_size <= num_kv_heads each rank holds num_kv_heads / tp_size consecutive heads; with
// tp_size > num_kv_heads each head is replicated on tp_size / num_kv_heads consecutive ranks (TP 8
// with 4 heads: ranks 0-1 hold head 0, ranks 2-3 head 1, ...). Throws relay::Error when neither
// count divides the other.
KvHeadRange tp_kv_head_range(int num_kv_heads, int tp_size, int tp_rank);

// Where block 0 of one layer's K (or V) tensor starts.
struct KvTensorPlacement {
  RegionId region = 0;
  uint64_t offset_bytes = 0;
};

struct KvPoolDesc {
  int num_layers = 0;
  int num_blocks = 0;  // valid block ids are [0, num_blocks)
  int block_size = 0;  // tokens per block
  int head_dim = 0;
  int elem_bytes = 0;               // bytes per element (2 for bf16)
  KvHeadRange heads;                // the model's KV heads this pool holds, in this order
  uint64_t block_stride_bytes = 0;  // block b -> b + 1 in one tensor; >= heads.count * head_bytes()
  std::vector<KvTensorPlacement> k;  // [num_layers]
  std::vector<KvTensorPlacement> v;  // [num_layers]

  uint64_t token_bytes() const { return static_cast<uint64_t>(head_dim) * elem_bytes; }
  // One head's slice of one block.
  uint64_t head_bytes() const { return token_bytes() * block_size; }
  const KvTensorPlacement& tensor(int layer, KvPart part) const {
    return part == KvPart::K ? k[layer] : v[layer];
  }
  // Byte offset, inside tensor(layer, part).region, of (block, global head, token_in_block, dim 0).
  // Arguments are trusted: validate the descriptor and the block ids at the boundary.
  uint64_t offset_bytes(int layer, KvPart part, int32_t block, int head, int token_in_block) const {
    return tensor(layer, part).offset_bytes + static_cast<uint64_t>(block) * block_stride_bytes +
           (static_cast<uint64_t>(head - heads.first) * block_size + token_in_block) *
               token_bytes();
  }
};

// Checks every field (positive sizes, one placement per layer, a block stride that fits the heads,
// offsets that do not overflow 64 bits); throws relay::Error naming `what` and the field.
void validate_kv_pool(const KvPoolDesc& pool, std::string_view what);

// The pool as one allocation laid out [layer][K, V][block][head][token][dim] from
// `base_offset_bytes` of `region` — kvcache/kv_cache.h's KvCacheLayout for a pool of `heads`.
KvPoolDesc contiguous_kv_pool(int num_layers, int num_blocks, int block_size, int head_dim,
                              int elem_bytes, KvHeadRange heads, RegionId region,
                              uint64_t base_offset_bytes = 0);

// Bytes `region` must hold (counted from its start) for every tensor of `pool` placed in it; 0 when
// none is.
uint64_t kv_pool_region_bytes(const KvPoolDesc& pool, RegionId region);

// JSON form: {"num_layers", "num_blocks", "block_size", "head_dim", "elem_bytes", "first_kv_head",
// "num_kv_heads", "block_stride_bytes", "k": [{"region", "offset_bytes"}, ...], "v": [...]}.
void to_json(nlohmann::json& j, const KvPoolDesc& pool);
// Throws relay::Error naming the missing field; the result is validated.
void from_json(const nlohmann::json& j, KvPoolDesc& pool);

}  // namespace relay

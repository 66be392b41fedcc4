// The state planner: which contiguous byte ranges move one sequence's recurrent state from one
// sharding to another — the counterpart, for the hybrid models' (Qwen3.5, Qwen3-Next) Gated
// DeltaNet layers, of the layout mapper (layout_mapper.h), which moves the KV of their attention
// layers.
//
// A sequence's recurrent state is one slot of the state pool (kvcache/recurrent_state.h):
//   pool[slot][layer][conv state [conv_dim][conv_width] | ssm state [v heads][key_dim][value_dim]]
// Tensor parallelism splits the heads (model/shard.h): a rank holds a contiguous range of the
// model's key heads and the value heads that read them (value head v reads key head
// v / (value heads / key heads)), and its conv channels are, in order, the q rows of its key heads
// (key_dim each), their k rows (key_dim each) and the v rows of its value heads (value_dim each).
// So each layer is four parts in memory order — conv q, conv k, conv v, SSM — and each part is a
// run of equal per-head blocks ([head][rows][columns]), indexed by key heads (conv q, conv k) or
// value heads (conv v, SSM): the heads [a, b) of one part are one contiguous range on every rank
// that holds them, the unit the planner moves. StatePoolDesc describes one rank's pool so a peer
// can address it; like KvPoolDesc it is plain data and travels as JSON.
//
// Planning is a pure function of the two sides' descriptors and the sequence's slot on each (the
// destination reserves its own slot; every rank of one side uses the same slot id), with no I/O:
//  1. Sender: every destination rank receives each head it holds from the first source rank, in
//     rank order, that holds it. NOTE: the layout mapper alternates between replicas block by
//     block; here there is nothing to alternate over (one slot per sequence), and Relay's sharding
//     never replicates Gated DeltaNet heads (TP must divide the key heads), so the first is enough.
//  2. Merging: copies are produced in the order (source rank, destination rank, layer, part, head)
//     and each is appended to the previous one when both its source and destination bytes directly
//     follow it. Heads consecutive on both sides merge within a part; when a destination rank holds
//     the same heads as its source rank, parts and layers merge too: the whole slot is one copy.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "kvcache/recurrent_state.h"
#include "transfer/kv_pool.h"
#include "transfer/layout_mapper.h"
#include "transfer/region.h"

namespace relay {

// The parts of one layer's state, in memory order.
enum class StatePart : uint8_t { ConvQ = 0, ConvK = 1, ConvV = 2, Ssm = 3 };

// Whether `part`'s blocks are per key head (conv q and k) or per value head (conv v and SSM).
inline bool indexed_by_key_heads(StatePart part) {
  return part == StatePart::ConvQ || part == StatePart::ConvK;
}

struct StatePoolDesc {
  int num_layers = 0;         // linear-attention layers
  int num_slots = 0;          // valid slot ids are [0, num_slots)
  int conv_width = 0;         // columns per conv channel: kernel_size - 1
  int key_dim = 0;            // per key head
  int value_dim = 0;          // per value head
  int elem_bytes = 0;         // bytes per element (4: fp32)
  KvHeadRange k_heads;        // the model's Gated DeltaNet key heads this pool holds
  KvHeadRange v_heads;        // the value heads that read them
  RegionId region = 0;        // the whole pool is in this region
  uint64_t offset_bytes = 0;  // where slot 0 starts in `region`

  // Conv channels: q and k rows of the key heads, v rows of the value heads.
  int64_t conv_dim() const {
    return 2 * static_cast<int64_t>(k_heads.count) * key_dim +
           static_cast<int64_t>(v_heads.count) * value_dim;
  }
  uint64_t conv_row_bytes() const { return static_cast<uint64_t>(conv_width) * elem_bytes; }
  uint64_t conv_bytes() const { return static_cast<uint64_t>(conv_dim()) * conv_row_bytes(); }
  uint64_t ssm_bytes() const {
    return static_cast<uint64_t>(v_heads.count) * head_bytes(StatePart::Ssm);
  }
  uint64_t layer_stride_bytes() const { return conv_bytes() + ssm_bytes(); }
  uint64_t slot_stride_bytes() const { return layer_stride_bytes() * num_layers; }

  // The heads `part` is indexed by.
  KvHeadRange heads(StatePart part) const { return indexed_by_key_heads(part) ? k_heads : v_heads; }
  // One head's block of `part`: its conv rows times conv_width, or its key_dim x value_dim matrix.
  uint64_t head_bytes(StatePart part) const {
    if (part == StatePart::Ssm) return static_cast<uint64_t>(key_dim) * value_dim * elem_bytes;
    return static_cast<uint64_t>(part == StatePart::ConvV ? value_dim : key_dim) * conv_row_bytes();
  }
  // Where `part` starts within a layer: conv q, k and v follow each other (q and k are
  // k_heads.count blocks each), then the SSM state.
  uint64_t part_offset_bytes(StatePart part) const {
    if (part == StatePart::Ssm) return conv_bytes();
    return static_cast<uint64_t>(part) * k_heads.count * head_bytes(StatePart::ConvQ);
  }
  // Byte offset, inside `region`, of global head `head`'s block of `part` in (slot, layer): its
  // first conv row (row r of the head is r * conv_row_bytes() further) or its SSM matrix. Arguments
  // are trusted: validate the descriptor and the slot at the boundary.
  uint64_t head_offset_bytes(int32_t slot, int layer, StatePart part, int head) const {
    return offset_bytes + static_cast<uint64_t>(slot) * slot_stride_bytes() +
           static_cast<uint64_t>(layer) * layer_stride_bytes() + part_offset_bytes(part) +
           static_cast<uint64_t>(head - heads(part).first) * head_bytes(part);
  }
};

// Checks every field (positive sizes, non-empty head ranges, value heads that are exactly the
// readers of the key heads, a pool whose end does not overflow 64 bits); throws relay::Error naming
// `what` and the field.
void validate_state_pool(const StatePoolDesc& pool, std::string_view what);

// The descriptor of a rank's pool laid out as `layout` from `offset_bytes` of `region`, holding key
// heads `k_heads` and value heads `v_heads` of the model. Throws relay::Error when the layout's
// shape (num_heads, conv_dim) is not that of those heads.
StatePoolDesc state_pool_for(const RecurrentStateLayout& layout, KvHeadRange k_heads,
                             KvHeadRange v_heads, RegionId region, uint64_t offset_bytes);

// JSON form: {"num_layers", "num_slots", "conv_width", "key_dim", "value_dim", "elem_bytes",
// "first_k_head", "num_k_heads", "first_v_head", "num_v_heads", "region", "offset_bytes"}.
void to_json(nlohmann::json& j, const StatePoolDesc& pool);
// Throws relay::Error naming the missing field; the result is validated.
void from_json(const nlohmann::json& j, StatePoolDesc& pool);

// One side of a state transfer. A view: the caller keeps the descriptors alive.
struct StateTransferSide {
  int num_k_heads = 0;  // the model's Gated DeltaNet key heads (all ranks together)
  int num_v_heads = 0;  // the model's value heads
  std::span<const StatePoolDesc> ranks;  // one pool per rank; all share layers and shapes
  int32_t slot = -1;                     // the sequence's slot, the same id on every rank
};

// The copies that move every layer of the sequence's state from `src` to `dst`, ordered by source
// rank (src_rank >= 0: only the copies that source rank executes). Throws relay::Error when the
// sides disagree (layers, conv_width, key/value dims, element size, the model's head counts), a
// destination head has no source, or a slot is outside a pool.
std::vector<KvCopy> plan_state_copies(const StateTransferSide& src, const StateTransferSide& dst,
                                      int src_rank = -1);

}  // namespace relay

// State pool descriptors and the state planner (see state_pool.h for the layout and the algorithm).
#include "transfer/state_pool.h"

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace relay {

namespace {

constexpr std::string_view kJsonWhat = "state pool descriptor";
constexpr StatePart kParts[] = {StatePart::ConvQ, StatePart::ConvK, StatePart::ConvV,
                                StatePart::Ssm};

// The product of `factors`, or nothing when it overflows 64 bits.
std::optional<uint64_t> checked_product(std::initializer_list<uint64_t> factors) {
  uint64_t out = 1;
  for (uint64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return std::nullopt;
  }
  return out;
}

void validate_heads(KvHeadRange heads, const char* kind, std::string_view what) {
  RELAY_CHECK(heads.first >= 0 && heads.count > 0 &&
                  heads.count <= std::numeric_limits<int>::max() - heads.first,
              what, ": state pool ", kind, " heads (first ", heads.first, ", count ", heads.count,
              ") are empty, negative or past the largest int");
}

// Checks one side: a model head count, consistent ranks, heads inside the model, and the slot
// inside every rank's pool.
void validate_side(const StateTransferSide& side, const char* name) {
  RELAY_CHECK(
      side.num_k_heads > 0 && side.num_v_heads > 0 && side.num_v_heads % side.num_k_heads == 0,
      name, " side has ", side.num_k_heads, " key heads and ", side.num_v_heads,
      " value heads; the value heads must be a positive multiple of the key heads");
  RELAY_CHECK(!side.ranks.empty(), name, " side has no ranks");
  const StatePoolDesc& first = side.ranks[0];
  const int v_per_k = side.num_v_heads / side.num_k_heads;
  for (size_t r = 0; r < side.ranks.size(); ++r) {
    const StatePoolDesc& pool = side.ranks[r];
    validate_state_pool(pool, str(name, " rank ", r));
    RELAY_CHECK(pool.num_layers == first.num_layers && pool.conv_width == first.conv_width &&
                    pool.key_dim == first.key_dim && pool.value_dim == first.value_dim &&
                    pool.elem_bytes == first.elem_bytes,
                name, " rank ", r, " (layers ", pool.num_layers, ", conv_width ", pool.conv_width,
                ", key_dim ", pool.key_dim, ", value_dim ", pool.value_dim, ", elem_bytes ",
                pool.elem_bytes, ") differs from rank 0 (", first.num_layers, ", ",
                first.conv_width, ", ", first.key_dim, ", ", first.value_dim, ", ",
                first.elem_bytes, ")");
    RELAY_CHECK(pool.k_heads.end() <= side.num_k_heads && pool.v_heads.end() <= side.num_v_heads,
                name, " rank ", r, " holds key heads [", pool.k_heads.first, ", ",
                pool.k_heads.end(), ") and value heads [", pool.v_heads.first, ", ",
                pool.v_heads.end(), ") beyond the model's ", side.num_k_heads, " and ",
                side.num_v_heads);
    RELAY_CHECK(pool.v_heads.count == static_cast<int64_t>(pool.k_heads.count) * v_per_k, name,
                " rank ", r, " holds ", pool.v_heads.count, " value heads for its ",
                pool.k_heads.count, " key heads; the model has ", v_per_k,
                " value heads per key head");
    RELAY_CHECK(side.slot >= 0 && side.slot < pool.num_slots, name, " slot ", side.slot,
                " is outside rank ", r, "'s pool of ", pool.num_slots, " slots");
  }
}

// sender[h]: the first source rank holding head h of `part`'s kind (key or value heads), or -1.
std::vector<int> first_senders(std::span<const StatePoolDesc> ranks, StatePart part,
                               int num_heads) {
  std::vector<int> sender(num_heads, -1);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const KvHeadRange heads = ranks[r].heads(part);
    for (int h = heads.first; h < heads.end(); ++h) {
      if (sender[h] < 0) sender[h] = static_cast<int>(r);
    }
  }
  return sender;
}

}  // namespace

void validate_state_pool(const StatePoolDesc& pool, std::string_view what) {
  RELAY_CHECK(pool.num_layers > 0 && pool.num_slots > 0 && pool.conv_width > 0 &&
                  pool.key_dim > 0 && pool.value_dim > 0 && pool.elem_bytes > 0,
              what, ": state pool sizes must be positive (layers ", pool.num_layers, ", slots ",
              pool.num_slots, ", conv_width ", pool.conv_width, ", key_dim ", pool.key_dim,
              ", value_dim ", pool.value_dim, ", elem_bytes ", pool.elem_bytes, ")");
  validate_heads(pool.k_heads, "key", what);
  validate_heads(pool.v_heads, "value", what);
  RELAY_CHECK(pool.v_heads.count % pool.k_heads.count == 0, what, ": state pool's ",
              pool.v_heads.count, " value heads are not a multiple of its ", pool.k_heads.count,
              " key heads");
  const int v_per_k = pool.v_heads.count / pool.k_heads.count;
  RELAY_CHECK(pool.v_heads.first == static_cast<int64_t>(pool.k_heads.first) * v_per_k, what,
              ": state pool value heads [", pool.v_heads.first, ", ", pool.v_heads.end(),
              ") are not the readers of its key heads [", pool.k_heads.first, ", ",
              pool.k_heads.end(), ") at ", v_per_k, " value heads per key head");
  // NOTE: conv_dim() fits 64 bits (three int products below 2^63 + 2^62); the byte sizes may not.
  constexpr uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();
  const auto conv_bytes = checked_product({static_cast<uint64_t>(pool.conv_dim()),
                                           static_cast<uint64_t>(pool.conv_width),
                                           static_cast<uint64_t>(pool.elem_bytes)});
  const auto ssm_bytes = checked_product(
      {static_cast<uint64_t>(pool.v_heads.count), static_cast<uint64_t>(pool.key_dim),
       static_cast<uint64_t>(pool.value_dim), static_cast<uint64_t>(pool.elem_bytes)});
  std::optional<uint64_t> pool_bytes;
  if (conv_bytes && ssm_bytes && *conv_bytes <= kMaxU64 - *ssm_bytes) {
    pool_bytes = checked_product({*conv_bytes + *ssm_bytes, static_cast<uint64_t>(pool.num_layers),
                                  static_cast<uint64_t>(pool.num_slots)});
  }
  RELAY_CHECK(pool_bytes && *pool_bytes <= kMaxU64 - pool.offset_bytes, what, ": state pool of ",
              pool.num_slots, " slots at offset ", pool.offset_bytes, " of region ", pool.region,
              " overflows 64 bits");
}

StatePoolDesc state_pool_for(const RecurrentStateLayout& layout, KvHeadRange k_heads,
                             KvHeadRange v_heads, RegionId region, uint64_t offset_bytes) {
  RELAY_CHECK(layout.element_bytes <= static_cast<size_t>(std::numeric_limits<int>::max()),
              "recurrent-state layout element_bytes ", layout.element_bytes, " is too large");
  const StatePoolDesc pool{
      layout.num_layers, layout.num_slots, layout.conv_width,
      layout.key_dim,    layout.value_dim, static_cast<int>(layout.element_bytes),
      k_heads,           v_heads,          region,
      offset_bytes};
  validate_state_pool(pool, "state pool of a recurrent-state layout");
  RELAY_CHECK(layout.num_heads == v_heads.count, "recurrent-state layout num_heads ",
              layout.num_heads, " differs from the ", v_heads.count, " value heads [",
              v_heads.first, ", ", v_heads.end(), ") of its pool");
  RELAY_CHECK(layout.conv_dim == pool.conv_dim(), "recurrent-state layout conv_dim ",
              layout.conv_dim, " differs from the ", pool.conv_dim(), " channels of ",
              k_heads.count, " key heads (2 x key_dim ", layout.key_dim, ") and ", v_heads.count,
              " value heads (value_dim ", layout.value_dim, ")");
  return pool;
}

void to_json(nlohmann::json& j, const StatePoolDesc& pool) {
  j = nlohmann::json{{"num_layers", pool.num_layers},
                     {"num_slots", pool.num_slots},
                     {"conv_width", pool.conv_width},
                     {"key_dim", pool.key_dim},
                     {"value_dim", pool.value_dim},
                     {"elem_bytes", pool.elem_bytes},
                     {"first_k_head", pool.k_heads.first},
                     {"num_k_heads", pool.k_heads.count},
                     {"first_v_head", pool.v_heads.first},
                     {"num_v_heads", pool.v_heads.count},
                     {"region", pool.region},
                     {"offset_bytes", pool.offset_bytes}};
}

void from_json(const nlohmann::json& j, StatePoolDesc& pool) {
  RELAY_CHECK(j.is_object(), kJsonWhat, " must be a JSON object");
  StatePoolDesc out;
  out.num_layers = json_int_field(j, "num_layers", kJsonWhat);
  out.num_slots = json_int_field(j, "num_slots", kJsonWhat);
  out.conv_width = json_int_field(j, "conv_width", kJsonWhat);
  out.key_dim = json_int_field(j, "key_dim", kJsonWhat);
  out.value_dim = json_int_field(j, "value_dim", kJsonWhat);
  out.elem_bytes = json_int_field(j, "elem_bytes", kJsonWhat);
  out.k_heads = {json_int_field(j, "first_k_head", kJsonWhat),
                 json_int_field(j, "num_k_heads", kJsonWhat)};
  out.v_heads = {json_int_field(j, "first_v_head", kJsonWhat),
                 json_int_field(j, "num_v_heads", kJsonWhat)};
  out.region = json_u64_field(j, "region", kJsonWhat);
  out.offset_bytes = json_u64_field(j, "offset_bytes", kJsonWhat);
  validate_state_pool(out, "state pool descriptor from JSON");
  pool = out;
}

std::vector<KvCopy> plan_state_copies(const StateTransferSide& src, const StateTransferSide& dst,
                                      int src_rank) {
  validate_side(src, "source");
  validate_side(dst, "destination");
  const StatePoolDesc& src0 = src.ranks[0];
  const StatePoolDesc& dst0 = dst.ranks[0];
  RELAY_CHECK(src.num_k_heads == dst.num_k_heads && src.num_v_heads == dst.num_v_heads,
              "source has ", src.num_k_heads, " key and ", src.num_v_heads,
              " value heads, destination ", dst.num_k_heads, " and ", dst.num_v_heads);
  RELAY_CHECK(src0.num_layers == dst0.num_layers && src0.conv_width == dst0.conv_width &&
                  src0.key_dim == dst0.key_dim && src0.value_dim == dst0.value_dim &&
                  src0.elem_bytes == dst0.elem_bytes,
              "source state (layers ", src0.num_layers, ", conv_width ", src0.conv_width,
              ", key_dim ", src0.key_dim, ", value_dim ", src0.value_dim, ", elem_bytes ",
              src0.elem_bytes, ") does not match destination (", dst0.num_layers, ", ",
              dst0.conv_width, ", ", dst0.key_dim, ", ", dst0.value_dim, ", ", dst0.elem_bytes,
              ")");
  RELAY_CHECK(src_rank >= -1 && src_rank < static_cast<int>(src.ranks.size()),
              "state copy source rank ", src_rank, " is outside the source side's ",
              src.ranks.size(), " ranks");

  // The sender of each head: per key head for conv q and k, per value head for conv v and SSM.
  const std::vector<int> k_sender = first_senders(src.ranks, StatePart::ConvQ, src.num_k_heads);
  const std::vector<int> v_sender = first_senders(src.ranks, StatePart::Ssm, src.num_v_heads);
  auto senders = [&](StatePart part) -> const std::vector<int>& {
    return indexed_by_key_heads(part) ? k_sender : v_sender;
  };
  for (size_t d = 0; d < dst.ranks.size(); ++d) {
    for (StatePart part : {StatePart::ConvQ, StatePart::Ssm}) {
      const KvHeadRange heads = dst.ranks[d].heads(part);
      for (int h = heads.first; h < heads.end(); ++h) {
        RELAY_CHECK(senders(part)[h] >= 0, "destination rank ", d, " needs ",
                    indexed_by_key_heads(part) ? "key" : "value", " head ", h,
                    ", which no source rank holds");
      }
    }
  }

  std::vector<KvCopy> out;
  for (int s = 0; s < static_cast<int>(src.ranks.size()); ++s) {
    if (src_rank >= 0 && s != src_rank) continue;
    const StatePoolDesc& sp = src.ranks[s];
    for (int d = 0; d < static_cast<int>(dst.ranks.size()); ++d) {
      const StatePoolDesc& dp = dst.ranks[d];
      for (int layer = 0; layer < sp.num_layers; ++layer) {
        for (StatePart part : kParts) {
          const std::vector<int>& sender = senders(part);
          const int head_lo = std::max(sp.heads(part).first, dp.heads(part).first);
          const int head_hi = std::min(sp.heads(part).end(), dp.heads(part).end());
          for (int h = head_lo; h < head_hi; ++h) {
            if (sender[h] != s) continue;
            append_merged_copy(
                out,
                KvCopy{s, d, sp.region, sp.head_offset_bytes(src.slot, layer, part, h), dp.region,
                       dp.head_offset_bytes(dst.slot, layer, part, h), sp.head_bytes(part)});
          }
        }
      }
    }
  }
  return out;
}

}  // namespace relay

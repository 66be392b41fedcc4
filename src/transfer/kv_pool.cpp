// KV pool descriptors: validation, the contiguous layout, region sizes and JSON.
#include "transfer/kv_pool.h"

#include <algorithm>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace relay {

namespace {

constexpr uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();

// One past the last byte of a tensor, from the start of its region (descriptor already checked).
uint64_t tensor_end_bytes(const KvPoolDesc& pool, const KvTensorPlacement& t) {
  return t.offset_bytes + static_cast<uint64_t>(pool.num_blocks - 1) * pool.block_stride_bytes +
         static_cast<uint64_t>(pool.heads.count) * pool.head_bytes();
}

constexpr std::string_view kJsonWhat = "KV pool descriptor";

std::vector<KvTensorPlacement> json_placements(const nlohmann::json& j, const char* key) {
  RELAY_CHECK(j.contains(key) && j.at(key).is_array(), kJsonWhat, " field '", key,
              "' must be an array");
  std::vector<KvTensorPlacement> out;
  for (const auto& item : j.at(key)) {
    RELAY_CHECK(item.is_object(), kJsonWhat, " field '", key, "' must hold objects");
    out.push_back({json_u64_field(item, "region", kJsonWhat),
                   json_u64_field(item, "offset_bytes", kJsonWhat)});
  }
  return out;
}

}  // namespace

KvHeadRange tp_kv_head_range(int num_kv_heads, int tp_size, int tp_rank) {
  RELAY_CHECK(num_kv_heads > 0 && tp_size > 0, "KV head sharding needs positive counts, got ",
              num_kv_heads, " KV heads over TP ", tp_size);
  RELAY_CHECK(tp_rank >= 0 && tp_rank < tp_size, "TP rank ", tp_rank, " outside TP size ", tp_size);
  if (tp_size <= num_kv_heads) {
    RELAY_CHECK(num_kv_heads % tp_size == 0, num_kv_heads, " KV heads do not split evenly over TP ",
                tp_size);
    const int per_rank = num_kv_heads / tp_size;
    return {tp_rank * per_rank, per_rank};
  }
  RELAY_CHECK(tp_size % num_kv_heads == 0, "TP ", tp_size, " is not a multiple of the ",
              num_kv_heads, " KV heads it replicates");
  return {tp_rank / (tp_size / num_kv_heads), 1};
}

void validate_kv_pool(const KvPoolDesc& pool, std::string_view what) {
  RELAY_CHECK(pool.num_layers > 0 && pool.num_blocks > 0 && pool.block_size > 0 &&
                  pool.head_dim > 0 && pool.elem_bytes > 0,
              what, ": KV pool sizes must be positive (layers ", pool.num_layers, ", blocks ",
              pool.num_blocks, ", block_size ", pool.block_size, ", head_dim ", pool.head_dim,
              ", elem_bytes ", pool.elem_bytes, ")");
  RELAY_CHECK(pool.heads.first >= 0 && pool.heads.count > 0, what, ": KV pool head range [",
              pool.heads.first, ", ", pool.heads.end(), ") is empty or negative");
  RELAY_CHECK(pool.k.size() == static_cast<size_t>(pool.num_layers) &&
                  pool.v.size() == static_cast<size_t>(pool.num_layers),
              what, ": KV pool has ", pool.k.size(), " K and ", pool.v.size(), " V placements for ",
              pool.num_layers, " layers");
  // NOTE: sizes are ints, so these products fit in 64 bits; only the offsets need overflow checks.
  const uint64_t heads_bytes = static_cast<uint64_t>(pool.heads.count) * pool.head_bytes();
  RELAY_CHECK(pool.block_stride_bytes >= heads_bytes, what, ": KV pool block stride ",
              pool.block_stride_bytes, " bytes is smaller than its ", pool.heads.count, " heads' ",
              heads_bytes, " bytes");
  RELAY_CHECK(pool.block_stride_bytes <= kMaxU64 / static_cast<uint64_t>(pool.num_blocks), what,
              ": KV pool block stride ", pool.block_stride_bytes, " times ", pool.num_blocks,
              " blocks overflows 64 bits");
  const uint64_t tensor_bytes =
      static_cast<uint64_t>(pool.num_blocks - 1) * pool.block_stride_bytes + heads_bytes;
  for (int layer = 0; layer < pool.num_layers; ++layer) {
    for (const KvTensorPlacement* t : {&pool.k[layer], &pool.v[layer]}) {
      RELAY_CHECK(t->offset_bytes <= kMaxU64 - tensor_bytes, what, ": KV pool layer ", layer,
                  " tensor at offset ", t->offset_bytes, " of region ", t->region,
                  " overflows 64 bits");
    }
  }
}

KvPoolDesc contiguous_kv_pool(int num_layers, int num_blocks, int block_size, int head_dim,
                              int elem_bytes, KvHeadRange heads, RegionId region,
                              uint64_t base_offset_bytes) {
  KvPoolDesc pool;
  pool.num_layers = num_layers;
  pool.num_blocks = num_blocks;
  pool.block_size = block_size;
  pool.head_dim = head_dim;
  pool.elem_bytes = elem_bytes;
  pool.heads = heads;
  pool.block_stride_bytes = static_cast<uint64_t>(heads.count) * pool.head_bytes();
  const uint64_t tensor_bytes = static_cast<uint64_t>(num_blocks) * pool.block_stride_bytes;
  for (int layer = 0; layer < num_layers; ++layer) {
    pool.k.push_back(
        {region, base_offset_bytes + (2 * static_cast<uint64_t>(layer)) * tensor_bytes});
    pool.v.push_back(
        {region, base_offset_bytes + (2 * static_cast<uint64_t>(layer) + 1) * tensor_bytes});
  }
  validate_kv_pool(pool, "contiguous KV pool");
  return pool;
}

uint64_t kv_pool_region_bytes(const KvPoolDesc& pool, RegionId region) {
  uint64_t bytes = 0;
  for (int layer = 0; layer < pool.num_layers; ++layer) {
    for (const KvTensorPlacement* t : {&pool.k[layer], &pool.v[layer]}) {
      if (t->region == region) bytes = std::max(bytes, tensor_end_bytes(pool, *t));
    }
  }
  return bytes;
}

void to_json(nlohmann::json& j, const KvPoolDesc& pool) {
  auto placements = [](const std::vector<KvTensorPlacement>& ts) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& t : ts)
      out.push_back({{"region", t.region}, {"offset_bytes", t.offset_bytes}});
    return out;
  };
  j = nlohmann::json{
      {"num_layers", pool.num_layers},    {"num_blocks", pool.num_blocks},
      {"block_size", pool.block_size},    {"head_dim", pool.head_dim},
      {"elem_bytes", pool.elem_bytes},    {"first_kv_head", pool.heads.first},
      {"num_kv_heads", pool.heads.count}, {"block_stride_bytes", pool.block_stride_bytes},
      {"k", placements(pool.k)},          {"v", placements(pool.v)}};
}

void from_json(const nlohmann::json& j, KvPoolDesc& pool) {
  RELAY_CHECK(j.is_object(), "KV pool descriptor must be a JSON object");
  KvPoolDesc out;
  out.num_layers = json_int_field(j, "num_layers", kJsonWhat);
  out.num_blocks = json_int_field(j, "num_blocks", kJsonWhat);
  out.block_size = json_int_field(j, "block_size", kJsonWhat);
  out.head_dim = json_int_field(j, "head_dim", kJsonWhat);
  out.elem_bytes = json_int_field(j, "elem_bytes", kJsonWhat);
  out.heads = {json_int_field(j, "first_kv_head", kJsonWhat),
               json_int_field(j, "num_kv_heads", kJsonWhat)};
  out.block_stride_bytes = json_u64_field(j, "block_stride_bytes", kJsonWhat);
  out.k = json_placements(j, "k");
  out.v = json_placements(j, "v");
  validate_kv_pool(out, "KV pool descriptor from JSON");
  pool = std::move(out);
}

}  // namespace relay

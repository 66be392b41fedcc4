// See kv_cache.h for the layout.
#include "kvcache/kv_cache.h"

#include "core/error.h"

namespace relay {

namespace {
KvByteRange head_range(const KvCacheLayout& l, int layer, int kv, int block, int head_begin, int head_end) {
  RELAY_CHECK(layer >= 0 && layer < l.num_layers, "KV layer ", layer, " out of [0, ", l.num_layers, ")");
  RELAY_CHECK(block >= 0 && block < l.num_blocks, "KV block ", block, " out of [0, ", l.num_blocks, ")");
  RELAY_CHECK(head_begin >= 0 && head_begin <= head_end && head_end <= l.num_kv_heads, "KV head range [",
              head_begin, ", ", head_end, ") out of [0, ", l.num_kv_heads, "]");
  return {static_cast<size_t>(l.element_offset(layer, kv, block, head_begin)) * l.element_bytes,
          static_cast<size_t>((head_end - head_begin) * l.head_stride()) * l.element_bytes};
}
}  // namespace

KvByteRange KvCacheLayout::k_range(int layer, int block, int head_begin, int head_end) const {
  return head_range(*this, layer, 0, block, head_begin, head_end);
}

KvByteRange KvCacheLayout::v_range(int layer, int block, int head_begin, int head_end) const {
  return head_range(*this, layer, 1, block, head_begin, head_end);
}

KvCacheLayout KvCacheLayout::from_budget(int num_layers, int num_kv_heads, int head_dim, int block_size,
                                         size_t element_bytes, size_t budget_bytes) {
  KvCacheLayout l{num_layers, 1, num_kv_heads, block_size, head_dim, element_bytes};
  RELAY_CHECK(num_layers > 0 && num_kv_heads > 0 && head_dim > 0 && block_size > 0,
              "KV layout needs positive sizes (layers ", num_layers, ", kv heads ", num_kv_heads,
              ", head_dim ", head_dim, ", block_size ", block_size, ")");
  size_t blocks = budget_bytes / l.bytes_per_block();
  RELAY_CHECK(blocks >= 1, "KV budget of ", budget_bytes, " bytes holds no block (one block costs ",
              l.bytes_per_block(), " bytes)");
  RELAY_CHECK(blocks <= INT32_MAX, "KV budget of ", budget_bytes, " bytes gives too many blocks");
  l.num_blocks = static_cast<int>(blocks);
  return l;
}

KvPool::KvPool(const KvCacheLayout& layout) : layout_(layout) {
  RELAY_CHECK(layout.element_bytes == sizeof(float), "the CPU KV pool stores fp32, got element size ",
              layout.element_bytes);
  RELAY_CHECK(layout.num_layers > 0 && layout.num_blocks > 0 && layout.num_kv_heads > 0 &&
                  layout.block_size > 0 && layout.head_dim > 0,
              "KV pool needs positive sizes");
  data_.assign(static_cast<size_t>(layout.num_elements()), 0.0f);
}

}  // namespace relay

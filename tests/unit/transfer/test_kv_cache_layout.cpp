// The transfer descriptors against the KV pool the backends really allocate: contiguous_kv_pool
// must address exactly the bytes kvcache/kv_cache.h's KvCacheLayout puts each (layer, K/V, block,
// head) at, for a pool of all heads and for a tensor-parallel rank's subset. If either layout
// changes, this test says so before a transfer writes heads into the wrong place.
#include <gtest/gtest.h>

#include "kvcache/kv_cache.h"
#include "transfer/kv_pool.h"

namespace relay {
namespace {

void expect_same_layout(const KvCacheLayout& layout, KvHeadRange heads) {
  ASSERT_EQ(layout.num_kv_heads, heads.count);
  const KvPoolDesc pool =
      contiguous_kv_pool(layout.num_layers, layout.num_blocks, layout.block_size, layout.head_dim,
                         static_cast<int>(layout.element_bytes), heads, 3);
  EXPECT_EQ(kv_pool_region_bytes(pool, 3), layout.total_bytes());
  for (int layer = 0; layer < layout.num_layers; ++layer) {
    for (int block = 0; block < layout.num_blocks; ++block) {
      for (int h = 0; h < heads.count; ++h) {
        for (KvPart part : {KvPart::K, KvPart::V}) {
          const int64_t elements =
              layout.element_offset(layer, static_cast<int>(part), block, h) + 5 * layout.head_dim;
          EXPECT_EQ(pool.offset_bytes(layer, part, block, heads.first + h, 5),
                    static_cast<uint64_t>(elements) * layout.element_bytes)
              << "layer " << layer << " block " << block << " head " << h;
        }
        // A head slice [h, count) is one range in both descriptions.
        const KvByteRange k = layout.k_range(layer, block, h, heads.count);
        EXPECT_EQ(pool.offset_bytes(layer, KvPart::K, block, heads.first + h, 0), k.offset);
        EXPECT_EQ((heads.count - h) * pool.head_bytes(), k.bytes);
        const KvByteRange v = layout.v_range(layer, block, h, heads.count);
        EXPECT_EQ(pool.offset_bytes(layer, KvPart::V, block, heads.first + h, 0), v.offset);
      }
    }
  }
}

TEST(KvCacheLayoutAgreement, AllHeadsBf16) {
  expect_same_layout({.num_layers = 3,
                      .num_blocks = 7,
                      .num_kv_heads = 4,
                      .block_size = 16,
                      .head_dim = 8,
                      .element_bytes = 2},
                     {0, 4});
}

TEST(KvCacheLayoutAgreement, TensorParallelRankFp32) {
  // TP rank 1 of 2 over 4 KV heads holds heads [2, 4) in a pool of 2 heads (the CPU pool is fp32).
  expect_same_layout({.num_layers = 2,
                      .num_blocks = 5,
                      .num_kv_heads = 2,
                      .block_size = 8,
                      .head_dim = 16,
                      .element_bytes = 4},
                     tp_kv_head_range(4, 2, 1));
}

}  // namespace
}  // namespace relay

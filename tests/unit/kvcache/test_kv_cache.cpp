// The KV pool layout: HND strides, contiguous head ranges for the transfer engine, budget sizing.
#include <gtest/gtest.h>

#include "core/error.h"
#include "kvcache/kv_cache.h"

namespace relay {
namespace {

KvCacheLayout small_layout() { return KvCacheLayout{3, 5, 4, 16, 8, sizeof(float)}; }

TEST(KvCacheLayout, StridesAreHnd) {
  KvCacheLayout l = small_layout();
  EXPECT_EQ(l.head_stride(), 16 * 8);
  EXPECT_EQ(l.block_stride(), 4 * 16 * 8);
  EXPECT_EQ(l.kv_stride(), 5 * 4 * 16 * 8);
  EXPECT_EQ(l.layer_stride(), 2 * 5 * 4 * 16 * 8);
  EXPECT_EQ(l.total_bytes(), size_t{3} * 2 * 5 * 4 * 16 * 8 * 4);
  EXPECT_EQ(l.bytes_per_block(), size_t{3} * 2 * 4 * 16 * 8 * 4);
  // (layer 2, V, block 3, head 1): every coordinate contributes its stride.
  EXPECT_EQ(l.element_offset(2, 1, 3, 1), 2 * l.layer_stride() + l.kv_stride() + 3 * l.block_stride() + l.head_stride());
}

TEST(KvCacheLayout, HeadRangesAreContiguousByteRanges) {
  KvCacheLayout l = small_layout();
  KvByteRange k = l.k_range(1, 4, 1, 3);
  EXPECT_EQ(k.offset, static_cast<size_t>(l.element_offset(1, 0, 4, 1)) * 4);
  EXPECT_EQ(k.bytes, size_t{2} * 16 * 8 * 4);
  KvByteRange v = l.v_range(1, 4, 0, 4);
  EXPECT_EQ(v.offset, static_cast<size_t>(l.element_offset(1, 1, 4, 0)) * 4);
  EXPECT_EQ(v.bytes, static_cast<size_t>(l.block_stride()) * 4);
  // The halves of a head split tile the full range exactly.
  KvByteRange lo = l.k_range(0, 2, 0, 2), hi = l.k_range(0, 2, 2, 4), all = l.k_range(0, 2, 0, 4);
  EXPECT_EQ(lo.offset, all.offset);
  EXPECT_EQ(lo.offset + lo.bytes, hi.offset);
  EXPECT_EQ(lo.bytes + hi.bytes, all.bytes);
  EXPECT_THROW(l.k_range(3, 0, 0, 1), Error);
  EXPECT_THROW(l.k_range(0, 5, 0, 1), Error);
  EXPECT_THROW(l.v_range(0, 0, 2, 5), Error);
}

TEST(KvCacheLayout, FromBudget) {
  KvCacheLayout l = KvCacheLayout::from_budget(3, 4, 8, 16, 4, 10 * small_layout().bytes_per_block() + 7);
  EXPECT_EQ(l.num_blocks, 10);
  EXPECT_THROW(KvCacheLayout::from_budget(3, 4, 8, 16, 4, 100), Error);
}

TEST(KvPool, LayerPointersMatchTheLayout) {
  KvPool pool(small_layout());
  const KvCacheLayout& l = pool.layout();
  EXPECT_EQ(pool.k(2) - pool.data(), l.element_offset(2, 0, 0, 0));
  EXPECT_EQ(pool.v(0) - pool.data(), l.kv_stride());
  // A write through a byte range lands where the kernels' index formula says.
  KvByteRange r = l.v_range(1, 3, 2, 3);
  reinterpret_cast<float*>(reinterpret_cast<char*>(pool.data()) + r.offset)[5] = 7.0f;
  EXPECT_EQ(pool.v(1)[((3 * l.num_kv_heads + 2) * l.block_size + 0) * l.head_dim + 5], 7.0f);
}

}  // namespace
}  // namespace relay

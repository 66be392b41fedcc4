// Layout mapper tests: every copy plan is executed on real buffers and every destination byte is
// checked, so a wrong offset, a missed token, a stray byte or a duplicated head shows up.
//
// The sweep covers prefill TP 1/2/4/8 over 4 KV heads (TP 8 replicates each head on two ranks) into
// one data-parallel decode rank holding all heads, for equal and different block sizes, token
// counts that fill and do not fill the last block, and random block tables. Block ids are even
// numbers of a pool with an even block count, so no two table entries are adjacent in memory and
// the number of copies is exactly the per-block minimum computed independently below.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

#include "../error_text.h"
#include "core/error.h"
#include "kv_test_pools.h"
#include "transfer/layout_mapper.h"

namespace relay {
namespace {

using test::PoolMemory;

constexpr int kNumKvHeads = 4;
constexpr int kNumLayers = 2;
constexpr int kHeadDim = 8;
constexpr int kElemBytes = 2;
constexpr uint64_t kTokenBytes = kHeadDim * kElemBytes;

int64_t blocks_for(int64_t tokens, int block_size) {
  return (tokens + block_size - 1) / block_size;
}

// `num_entries` distinct even block ids of a pool of `num_blocks` (even), in random order.
std::vector<int32_t> random_block_table(int64_t num_entries, int num_blocks, std::mt19937& rng) {
  std::vector<int32_t> ids;
  for (int32_t b = 0; b < num_blocks - 1; b += 2) ids.push_back(b);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(num_entries);
  return ids;
}

// Pool block count for a table of `entries` ids: even, with room for the even-only ids.
int pool_blocks_for(int64_t entries) { return static_cast<int>(2 * entries + 2); }

// The destination after a correct transfer: zeros, plus the pattern for the scope's tokens and
// layers of every head the destination rank holds.
PoolMemory expected_destination(const KvPoolDesc& desc, std::span<const int32_t> table,
                                const KvCopyScope& scope) {
  PoolMemory expected(desc, std::byte{0});
  const int layer_end = scope.layer_end < 0 ? desc.num_layers : scope.layer_end;
  expected.write_pattern(table, scope.token_begin, scope.token_end, scope.layer_begin, layer_end);
  return expected;
}

// Counts bytes of `regions` that differ from `expected`, reporting the first few.
int64_t count_mismatches(const PoolMemory& actual, const PoolMemory& expected) {
  int64_t mismatches = 0;
  for (const auto& [id, mem] : actual.regions) {
    const std::vector<std::byte>& want = expected.regions.at(id);
    for (size_t i = 0; i < mem.size(); ++i) {
      if (mem[i] != want[i] && ++mismatches <= 3) {
        ADD_FAILURE() << "region " << id << " byte " << i << ": got " << static_cast<int>(mem[i])
                      << ", want " << static_cast<int>(want[i]);
      }
    }
  }
  return mismatches;
}

// Every destination byte is written by at most one copy, and the copies together write exactly
// `expected_bytes` (so with a correct result, each head's bytes arrive exactly once).
void expect_disjoint_destinations(std::span<const KvCopy> copies, uint64_t expected_bytes) {
  std::vector<std::tuple<int, RegionId, uint64_t, uint64_t>> ranges;
  uint64_t total = 0;
  for (const KvCopy& c : copies) {
    ranges.emplace_back(c.dst_rank, c.dst_region, c.dst_offset_bytes, c.bytes);
    total += c.bytes;
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    const auto& [rank0, region0, offset0, bytes0] = ranges[i - 1];
    const auto& [rank1, region1, offset1, bytes1] = ranges[i];
    if (rank0 == rank1 && region0 == region1) {
      ASSERT_LE(offset0 + bytes0, offset1)
          << "two copies write destination region " << region0 << " byte " << offset1;
    }
  }
  EXPECT_EQ(total, expected_bytes);
}

struct BlockSizes {
  int src;
  int dst;
};

// NOLINTNEXTLINE(readability-identifier-naming): GoogleTest looks this name up.
void PrintTo(const BlockSizes& sizes, std::ostream* os) {
  *os << "blocks " << sizes.src << " -> " << sizes.dst;
}

class MapperSweep : public ::testing::TestWithParam<std::tuple<int, BlockSizes>> {};

TEST_P(MapperSweep, PrefillTpToOneDecodeRank) {
  const auto [tp, sizes] = GetParam();
  const int src_bs = sizes.src;
  const int dst_bs = sizes.dst;
  const int lcm = std::lcm(src_bs, dst_bs);
  std::set<int64_t> token_counts = {1,           src_bs,      dst_bs,        2 * lcm,
                                    2 * lcm + 1, 3 * lcm - 1, 5 * src_bs + 3};
  if (src_bs > 1) token_counts.insert(src_bs - 1);

  for (int64_t n : token_counts) {
    for (uint32_t seed : {1u, 2u}) {
      SCOPED_TRACE(testing::Message() << "TP " << tp << ", blocks " << src_bs << " -> " << dst_bs
                                      << ", " << n << " tokens, seed " << seed);
      std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(n * 31 + tp));
      const int64_t src_entries = blocks_for(n, src_bs);
      const int64_t dst_entries = blocks_for(n, dst_bs);
      const std::vector<int32_t> src_table =
          random_block_table(src_entries, pool_blocks_for(src_entries), rng);
      const std::vector<int32_t> dst_table =
          random_block_table(dst_entries, pool_blocks_for(dst_entries), rng);

      std::vector<PoolMemory> src_pools;
      std::vector<KvPoolDesc> src_descs;
      for (int r = 0; r < tp; ++r) {
        src_descs.push_back(contiguous_kv_pool(kNumLayers, pool_blocks_for(src_entries), src_bs,
                                               kHeadDim, kElemBytes,
                                               tp_kv_head_range(kNumKvHeads, tp, r), 100 + r));
        src_pools.emplace_back(src_descs.back(), test::kSourceJunk);
        src_pools.back().write_pattern(src_table, 0, n, 0, kNumLayers);
      }
      const std::vector<KvPoolDesc> dst_descs = {
          contiguous_kv_pool(kNumLayers, pool_blocks_for(dst_entries), dst_bs, kHeadDim, kElemBytes,
                             {0, kNumKvHeads}, 200)};
      PoolMemory dst_pool(dst_descs[0], std::byte{0});

      const KvCopyScope scope{.token_begin = 0, .token_end = n};
      const std::vector<KvCopy> copies = plan_kv_copies({kNumKvHeads, src_descs, src_table},
                                                        {kNumKvHeads, dst_descs, dst_table}, scope);

      std::vector<PoolMemory*> all;
      for (auto& p : src_pools) all.push_back(&p);
      all.push_back(&dst_pool);
      ASSERT_EQ(test::run_copies(all, copies), "ok");
      EXPECT_EQ(count_mismatches(dst_pool, expected_destination(dst_descs[0], dst_table, scope)),
                0);
      expect_disjoint_destinations(
          copies, static_cast<uint64_t>(n) * kNumKvHeads * kNumLayers * 2 * kTokenBytes);

      // The minimum: a whole block (equal sizes) is one copy per sending rank, since its heads
      // are contiguous on both sides; anything else is one copy per head per run of tokens that
      // stays inside one source and one destination block.
      uint64_t expected_copies = 0;
      for (int64_t j = 0; j < src_entries; ++j) {
        const int64_t lo = j * src_bs;
        const int64_t hi = std::min<int64_t>((j + 1) * src_bs, n);
        const int64_t runs = (hi - 1) / dst_bs - lo / dst_bs + 1;
        if (src_bs == dst_bs && hi - lo == src_bs) {
          expected_copies += kNumLayers * 2 * std::min(tp, kNumKvHeads);
        } else {
          expected_copies += kNumLayers * 2 * kNumKvHeads * runs;
        }
      }
      EXPECT_EQ(copies.size(), expected_copies);

      // Replicas share the load: per head, the two ranks' bytes differ by at most one block.
      if (tp > kNumKvHeads) {
        std::vector<uint64_t> bytes_by_rank(tp, 0);
        for (const KvCopy& c : copies) bytes_by_rank[c.src_rank] += c.bytes;
        const uint64_t block_bytes = kNumLayers * 2 * src_bs * kTokenBytes;
        for (int r = 0; r < tp; r += 2) {
          const uint64_t a = bytes_by_rank[r];
          const uint64_t b = bytes_by_rank[r + 1];
          EXPECT_LE(std::max(a, b) - std::min(a, b), block_bytes) << "ranks " << r << ", " << r + 1;
          if (src_entries >= 2) {
            EXPECT_GT(std::min(a, b), 0u) << "ranks " << r << ", " << r + 1;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllShardings, MapperSweep,
    ::testing::Combine(::testing::Values(1, 2, 4, 8),
                       ::testing::Values(BlockSizes{16, 16}, BlockSizes{16, 32}, BlockSizes{32, 16},
                                         BlockSizes{16, 64}, BlockSizes{64, 16},
                                         BlockSizes{8, 24})),
    [](const auto& info) {
      const BlockSizes sizes = std::get<1>(info.param);
      return "tp" + std::to_string(std::get<0>(info.param)) + "_bs" + std::to_string(sizes.src) +
             "_to_" + std::to_string(sizes.dst);
    });

// Plans `scope` from `src` to `dst` (fresh buffers), executes it and checks every destination byte
// and that destination bytes are written once. Block tables are random (even ids).
void check_transfer(int num_kv_heads, const std::vector<KvPoolDesc>& src_descs,
                    const std::vector<KvPoolDesc>& dst_descs, const std::vector<int32_t>& src_table,
                    const std::vector<int32_t>& dst_table, const KvCopyScope& scope,
                    std::vector<KvCopy>* copies_out = nullptr) {
  std::vector<PoolMemory> src_pools;
  for (const KvPoolDesc& d : src_descs) {
    src_pools.emplace_back(d, test::kSourceJunk);
    src_pools.back().write_pattern(src_table, 0, scope.token_end, 0, d.num_layers);
  }
  std::vector<PoolMemory> dst_pools;
  for (const KvPoolDesc& d : dst_descs) dst_pools.emplace_back(d, std::byte{0});
  const std::vector<KvCopy> copies = plan_kv_copies({num_kv_heads, src_descs, src_table},
                                                    {num_kv_heads, dst_descs, dst_table}, scope);
  std::vector<PoolMemory*> all;
  for (auto& p : src_pools) all.push_back(&p);
  for (auto& p : dst_pools) all.push_back(&p);
  ASSERT_EQ(test::run_copies(all, copies), "ok");
  uint64_t expected_bytes = 0;
  const int layer_end = scope.layer_end < 0 ? dst_descs[0].num_layers : scope.layer_end;
  for (size_t d = 0; d < dst_descs.size(); ++d) {
    SCOPED_TRACE(testing::Message() << "destination rank " << d);
    EXPECT_EQ(count_mismatches(dst_pools[d], expected_destination(dst_descs[d], dst_table, scope)),
              0);
    expected_bytes += static_cast<uint64_t>(scope.token_end - scope.token_begin) *
                      dst_descs[d].heads.count * (layer_end - scope.layer_begin) * 2 *
                      dst_descs[d].token_bytes();
  }
  expect_disjoint_destinations(copies, expected_bytes);
  if (copies_out) *copies_out = copies;
}

std::vector<KvPoolDesc> tp_pools(int tp, int num_blocks, int block_size, RegionId first_region) {
  std::vector<KvPoolDesc> out;
  for (int r = 0; r < tp; ++r) {
    out.push_back(contiguous_kv_pool(kNumLayers, num_blocks, block_size, kHeadDim, kElemBytes,
                                     tp_kv_head_range(kNumKvHeads, tp, r), first_region + r));
  }
  return out;
}

TEST(LayoutMapper, ConsecutiveBlocksMergeIntoOneCopyPerTensor) {
  // Tables 0..7 on both sides of equal 8-block pools: every layer's K and V is one run on both
  // sides, and K of one layer directly precedes V, so the whole pool is a single copy.
  std::vector<int32_t> table(8);
  std::iota(table.begin(), table.end(), 0);
  std::vector<KvCopy> copies;
  check_transfer(kNumKvHeads, tp_pools(1, 8, 16, 100), tp_pools(1, 8, 16, 200), table, table,
                 {.token_begin = 0, .token_end = 8 * 16}, &copies);
  EXPECT_EQ(copies.size(), 1u);

  // A larger pool: the table's blocks are consecutive within each tensor but tensors do not touch.
  check_transfer(kNumKvHeads, tp_pools(1, 10, 16, 100), tp_pools(1, 10, 16, 200), table, table,
                 {.token_begin = 0, .token_end = 8 * 16}, &copies);
  EXPECT_EQ(copies.size(), static_cast<size_t>(kNumLayers * 2));
}

TEST(LayoutMapper, PartialLastBlockIsCopiedPerHead) {
  // TP 1, one block of 16 holding 5 tokens: heads are not contiguous (11 untouched tokens between
  // them at the destination), so one copy per (layer, K/V, head) of 5 tokens each.
  std::vector<KvCopy> copies;
  check_transfer(kNumKvHeads, tp_pools(1, 4, 16, 100), tp_pools(1, 4, 16, 200), {2}, {0},
                 {.token_begin = 0, .token_end = 5}, &copies);
  ASSERT_EQ(copies.size(), static_cast<size_t>(kNumLayers * 2 * kNumKvHeads));
  for (const KvCopy& c : copies) EXPECT_EQ(c.bytes, 5 * kTokenBytes);
}

TEST(LayoutMapper, TokenAndLayerSubrange) {
  // Only tokens [21, 70) of layer 1 move (a decode rank holding a cached prefix, one layer
  // streamed): everything else at the destination stays zero.
  std::mt19937 rng(5);
  const std::vector<int32_t> src_table = random_block_table(5, 12, rng);
  const std::vector<int32_t> dst_table = random_block_table(3, 8, rng);
  check_transfer(kNumKvHeads, tp_pools(2, 12, 16, 100), tp_pools(1, 8, 24, 200), src_table,
                 dst_table, {.token_begin = 21, .token_end = 70, .layer_begin = 1, .layer_end = 2});
  check_transfer(kNumKvHeads, tp_pools(8, 12, 16, 100), tp_pools(1, 8, 24, 200), src_table,
                 dst_table, {.token_begin = 48, .token_end = 64});
}

TEST(LayoutMapper, EmptyScopeHasNoCopies) {
  const std::vector<KvPoolDesc> src = tp_pools(2, 4, 16, 100);
  const std::vector<KvPoolDesc> dst = tp_pools(1, 4, 16, 200);
  const std::vector<int32_t> table = {1, 3};
  EXPECT_TRUE(plan_kv_copies({kNumKvHeads, src, table}, {kNumKvHeads, dst, table},
                             {.token_begin = 20, .token_end = 20})
                  .empty());
  EXPECT_TRUE(plan_kv_copies({kNumKvHeads, src, table}, {kNumKvHeads, dst, table},
                             {.token_begin = 0, .token_end = 20, .layer_begin = 1, .layer_end = 1})
                  .empty());
}

TEST(LayoutMapper, ArbitraryPoolPlacements) {
  // Destination: one region per layer, K and V interleaved per block, tensors at an odd offset.
  // Source: TP 2, each pool at a base offset with padding between blocks.
  constexpr int kBlocks = 10;
  KvPoolDesc dst;
  dst.num_layers = kNumLayers;
  dst.num_blocks = kBlocks;
  dst.block_size = 8;
  dst.head_dim = kHeadDim;
  dst.elem_bytes = kElemBytes;
  dst.heads = {0, kNumKvHeads};
  const uint64_t heads_bytes = kNumKvHeads * dst.head_bytes();
  dst.block_stride_bytes = 2 * heads_bytes;
  for (int layer = 0; layer < kNumLayers; ++layer) {
    dst.k.push_back({static_cast<RegionId>(300 + layer), 48});
    dst.v.push_back({static_cast<RegionId>(300 + layer), 48 + heads_bytes});
  }
  validate_kv_pool(dst, "interleaved destination");

  std::vector<KvPoolDesc> src;
  for (int r = 0; r < 2; ++r) {
    KvPoolDesc p;
    p.num_layers = kNumLayers;
    p.num_blocks = kBlocks;
    p.block_size = 16;
    p.head_dim = kHeadDim;
    p.elem_bytes = kElemBytes;
    p.heads = tp_kv_head_range(kNumKvHeads, 2, r);
    p.block_stride_bytes = 2 * p.head_bytes() + 64;
    const uint64_t tensor_bytes = kBlocks * p.block_stride_bytes;
    for (int layer = 0; layer < kNumLayers; ++layer) {
      p.k.push_back({static_cast<RegionId>(100 + r), 32 + 2 * layer * tensor_bytes});
      p.v.push_back({static_cast<RegionId>(100 + r), 32 + (2 * layer + 1) * tensor_bytes});
    }
    validate_kv_pool(p, "padded source");
    src.push_back(p);
  }
  std::mt19937 rng(11);
  check_transfer(kNumKvHeads, src, {dst}, random_block_table(3, kBlocks, rng),
                 random_block_table(5, kBlocks, rng), {.token_begin = 0, .token_end = 37});
  check_transfer(kNumKvHeads, src, {dst}, random_block_table(4, kBlocks, rng),
                 random_block_table(5, kBlocks, rng), {.token_begin = 0, .token_end = 40});
}

TEST(LayoutMapper, ShardedDestinations) {
  std::mt19937 rng(3);
  const std::vector<int32_t> src_table = random_block_table(4, 10, rng);
  const std::vector<int32_t> dst_table = random_block_table(2, 6, rng);
  // Prefill TP 8 (replicated heads) into a decode side of TP 2: each decode rank gets its 2 heads.
  check_transfer(kNumKvHeads, tp_pools(8, 10, 16, 100), tp_pools(2, 6, 32, 200), src_table,
                 dst_table, {.token_begin = 0, .token_end = 55});
  // Prefill TP 2 into a decode side of TP 8: every replica of a head receives it.
  std::vector<KvCopy> copies;
  check_transfer(kNumKvHeads, tp_pools(2, 10, 16, 100), tp_pools(8, 6, 32, 200), src_table,
                 dst_table, {.token_begin = 0, .token_end = 55}, &copies);
  std::set<int> receivers;
  for (const KvCopy& c : copies) receivers.insert(c.dst_rank);
  EXPECT_EQ(receivers.size(), 8u);
}

TEST(LayoutMapper, ReplicaChoiceIsDeterministic) {
  std::mt19937 rng(9);
  const std::vector<int32_t> table = random_block_table(6, 14, rng);
  const std::vector<KvPoolDesc> src = tp_pools(8, 14, 16, 100);
  const std::vector<KvPoolDesc> dst = tp_pools(1, 14, 16, 200);
  const KvCopyScope scope{.token_begin = 0, .token_end = 90};
  const std::vector<KvCopy> a =
      plan_kv_copies({kNumKvHeads, src, table}, {kNumKvHeads, dst, table}, scope);
  const std::vector<KvCopy> b =
      plan_kv_copies({kNumKvHeads, src, table}, {kNumKvHeads, dst, table}, scope);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].src_rank, b[i].src_rank);
    EXPECT_EQ(a[i].src_offset_bytes, b[i].src_offset_bytes);
    EXPECT_EQ(a[i].dst_offset_bytes, b[i].dst_offset_bytes);
  }
  // Copies come grouped by source rank, and transfer_copies picks one rank's share.
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end(), [](const KvCopy& x, const KvCopy& y) {
    return x.src_rank < y.src_rank;
  }));
  size_t total = 0;
  for (int r = 0; r < 8; ++r) total += transfer_copies(a, r).size();
  EXPECT_EQ(total, a.size());
  EXPECT_EQ(transfer_copies(a).size(), a.size());
  // Each rank planning only its own share gets exactly its part of the whole plan.
  std::vector<KvCopy> joined;
  for (int r = 0; r < 8; ++r) {
    KvCopyScope own = scope;
    own.src_rank = r;
    const std::vector<KvCopy> part =
        plan_kv_copies({kNumKvHeads, src, table}, {kNumKvHeads, dst, table}, own);
    for (const KvCopy& c : part) EXPECT_EQ(c.src_rank, r);
    joined.insert(joined.end(), part.begin(), part.end());
  }
  ASSERT_EQ(joined.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(joined[i].src_offset_bytes, a[i].src_offset_bytes);
    EXPECT_EQ(joined[i].dst_offset_bytes, a[i].dst_offset_bytes);
    EXPECT_EQ(joined[i].bytes, a[i].bytes);
  }
}

using test::expect_error;

TEST(LayoutMapper, RejectsInconsistentInputs) {
  const std::vector<int32_t> table = {0, 2};
  const std::vector<KvPoolDesc> dst = tp_pools(1, 4, 16, 200);
  const KvCopyScope scope{.token_begin = 0, .token_end = 20};
  // Ranks 0 and 1 of TP 4 hold heads 0 and 1 only.
  const std::vector<KvPoolDesc> missing = {tp_pools(4, 4, 16, 100)[0], tp_pools(4, 4, 16, 100)[1]};
  expect_error(
      [&] {
        plan_kv_copies({kNumKvHeads, missing, table}, {kNumKvHeads, dst, table}, scope);
      },
      "needs KV head 2");
  const std::vector<int32_t> short_table = {0};
  expect_error(
      [&] {
        plan_kv_copies({kNumKvHeads, tp_pools(2, 4, 16, 100), short_table},
                       {kNumKvHeads, dst, table}, scope);
      },
      "block table has 1 blocks");
  const std::vector<int32_t> bad_id = {0, 4};
  expect_error(
      [&] {
        plan_kv_copies({kNumKvHeads, tp_pools(2, 4, 16, 100), bad_id}, {kNumKvHeads, dst, table},
                       scope);
      },
      "is block 4, outside rank 0's pool of 4 blocks");
  std::vector<KvPoolDesc> wide = {contiguous_kv_pool(kNumLayers, 4, 16, 16, kElemBytes, {0, 4}, 1)};
  expect_error(
      [&] {
        plan_kv_copies({kNumKvHeads, wide, table}, {kNumKvHeads, dst, table}, scope);
      },
      "does not match destination");
  expect_error(
      [&] {
        plan_kv_copies({kNumKvHeads, tp_pools(2, 4, 16, 100), table}, {kNumKvHeads, dst, table},
                       {.token_begin = 5, .token_end = 3});
      },
      "token range");
  expect_error(
      [&] {
        plan_kv_copies({kNumKvHeads, tp_pools(2, 4, 16, 100), table}, {kNumKvHeads, dst, table},
                       {.token_begin = 0, .token_end = 3, .layer_begin = 0, .layer_end = 3});
      },
      "layer range");
  expect_error(
      [&] {
        plan_kv_copies({kNumKvHeads, tp_pools(2, 4, 16, 100), table}, {kNumKvHeads, dst, table},
                       {.token_begin = 0, .token_end = 3, .src_rank = 2});
      },
      "source rank 2 is outside the source side's 2 ranks");
  std::vector<KvPoolDesc> mixed = tp_pools(2, 4, 16, 100);
  mixed[1] = contiguous_kv_pool(kNumLayers, 4, 32, kHeadDim, kElemBytes, {2, 2}, 101);
  expect_error(
      [&] {
        plan_kv_copies({kNumKvHeads, mixed, table}, {kNumKvHeads, dst, table}, scope);
      },
      "source rank 1 (block_size 32");
}

TEST(KvPool, TpHeadRanges) {
  EXPECT_EQ(tp_kv_head_range(4, 1, 0).count, 4);
  EXPECT_EQ(tp_kv_head_range(4, 2, 1).first, 2);
  EXPECT_EQ(tp_kv_head_range(4, 2, 1).count, 2);
  EXPECT_EQ(tp_kv_head_range(4, 4, 3).first, 3);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(tp_kv_head_range(4, 8, r).first, r / 2);
    EXPECT_EQ(tp_kv_head_range(4, 8, r).count, 1);
  }
  EXPECT_EQ(tp_kv_head_range(4, 16, 15).first, 3);
  expect_error([] { tp_kv_head_range(4, 3, 0); }, "do not split evenly");
  expect_error([] { tp_kv_head_range(4, 6, 0); }, "not a multiple");
  expect_error([] { tp_kv_head_range(4, 2, 2); }, "outside TP size");
}

TEST(KvPool, ContiguousLayoutMatchesHnd) {
  // [layer][K, V][block][head][token][dim] with heads [2, 4) of the model.
  const KvPoolDesc p = contiguous_kv_pool(3, 5, 16, 8, 2, {2, 2}, 7, 64);
  const uint64_t head = 16 * 8 * 2;
  const uint64_t tensor = 5 * 2 * head;
  EXPECT_EQ(p.offset_bytes(0, KvPart::K, 0, 2, 0), 64u);
  EXPECT_EQ(p.offset_bytes(0, KvPart::K, 0, 3, 1), 64 + head + 16);
  EXPECT_EQ(p.offset_bytes(1, KvPart::V, 4, 2, 0), 64 + 3 * tensor + 4 * 2 * head);
  EXPECT_EQ(kv_pool_region_bytes(p, 7), 64 + 6 * tensor);
  EXPECT_EQ(kv_pool_region_bytes(p, 8), 0u);
}

TEST(KvPool, JsonRoundTripAndValidation) {
  KvPoolDesc p = contiguous_kv_pool(2, 6, 16, 128, 2, {1, 1}, 42, 4096);
  p.v[1].region = 43;
  const nlohmann::json j = p;
  const KvPoolDesc q = nlohmann::json::parse(j.dump()).get<KvPoolDesc>();
  EXPECT_EQ(q.num_layers, 2);
  EXPECT_EQ(q.num_blocks, 6);
  EXPECT_EQ(q.block_size, 16);
  EXPECT_EQ(q.head_dim, 128);
  EXPECT_EQ(q.elem_bytes, 2);
  EXPECT_EQ(q.heads.first, 1);
  EXPECT_EQ(q.heads.count, 1);
  EXPECT_EQ(q.block_stride_bytes, p.block_stride_bytes);
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(q.k[layer].region, p.k[layer].region);
    EXPECT_EQ(q.k[layer].offset_bytes, p.k[layer].offset_bytes);
    EXPECT_EQ(q.v[layer].region, p.v[layer].region);
    EXPECT_EQ(q.v[layer].offset_bytes, p.v[layer].offset_bytes);
  }
  nlohmann::json missing = j;
  missing.erase("head_dim");
  expect_error([&] { (void)missing.get<KvPoolDesc>(); }, "'head_dim'");
  nlohmann::json narrow = j;
  narrow["block_stride_bytes"] = 16;
  expect_error([&] { (void)narrow.get<KvPoolDesc>(); }, "block stride 16 bytes is smaller");
  nlohmann::json short_k = j;
  short_k["k"].erase(1);
  expect_error([&] { (void)short_k.get<KvPoolDesc>(); }, "1 K and 2 V placements for 2 layers");
}

}  // namespace
}  // namespace relay

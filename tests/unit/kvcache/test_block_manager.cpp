// Block manager: allocation, reference counts, prefix caching and LRU eviction, partitions (one per
// DP attention rank), truncation (a speculative step's rollback) with shared and cached blocks,
// plus randomized runs of operations checked against the invariants after every step.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "core/error.h"
#include "kvcache/block_manager.h"

namespace relay {
namespace {

std::vector<int32_t> iota_tokens(int n, int32_t start = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

TEST(BlockManager, AllocateGrowsAndFreeReturnsEverything) {
  BlockManager bm(8, 4);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  ASSERT_TRUE(bm.allocate(1, 5));  // 2 blocks
  EXPECT_EQ(bm.block_table(1).size(), 2u);
  ASSERT_TRUE(bm.allocate(1, 8));  // still 2
  EXPECT_EQ(bm.block_table(1).size(), 2u);
  ASSERT_TRUE(bm.allocate(1, 9));  // 3
  EXPECT_EQ(bm.block_table(1).size(), 3u);
  EXPECT_DOUBLE_EQ(bm.usage(), 3.0 / 8.0);
  bm.check_invariants();
  bm.free(1);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_DOUBLE_EQ(bm.usage(), 0.0);
  EXPECT_FALSE(bm.has_sequence(1));
  bm.free(1);  // unknown id: no-op
  bm.check_invariants();
}

TEST(BlockManager, AllocationIsAllOrNothing) {
  BlockManager bm(4, 4);
  ASSERT_TRUE(bm.allocate(1, 12));
  EXPECT_FALSE(bm.can_allocate(2, 8));
  EXPECT_FALSE(bm.allocate(2, 8));
  EXPECT_FALSE(bm.has_sequence(2));
  EXPECT_EQ(bm.num_free_blocks(), 1);
  EXPECT_FALSE(bm.allocate(1, 20));  // needs 2 more
  EXPECT_EQ(bm.block_table(1).size(), 3u);
  EXPECT_TRUE(bm.allocate(2, 4));
  EXPECT_EQ(bm.num_free_blocks(), 0);
  bm.check_invariants();
}

TEST(BlockManager, PrefixHitSharesFullBlocksOnly) {
  BlockManager bm(16, 4);
  const auto prompt = iota_tokens(10);  // 2 full blocks + 2 tokens
  ASSERT_TRUE(bm.allocate(1, 10));
  EXPECT_TRUE(bm.find_cached_prefix(prompt).blocks.empty());  // nothing computed yet
  bm.cache_full_blocks(1, prompt, 10);
  EXPECT_EQ(bm.num_cached_blocks(), 2);

  const PrefixHit hit = bm.find_cached_prefix(prompt);
  ASSERT_EQ(hit.blocks.size(), 2u);
  EXPECT_EQ(hit.num_tokens(4), 8);
  EXPECT_EQ(hit.blocks[0], bm.block_table(1)[0]);
  EXPECT_EQ(hit.blocks[1], bm.block_table(1)[1]);
  ASSERT_TRUE(bm.allocate(2, 10, &hit));
  EXPECT_EQ(bm.ref_count(hit.blocks[0]), 2);
  EXPECT_EQ(bm.ref_count(hit.blocks[1]), 2);
  EXPECT_NE(bm.block_table(2)[2], bm.block_table(1)[2]);  // the partial block is private
  bm.check_invariants();

  // A prompt that differs in the second block shares only the first.
  auto other = prompt;
  other[5] = 999;
  EXPECT_EQ(bm.find_cached_prefix(other).blocks.size(), 1u);
  // A prompt that differs in the first block shares nothing (the hash is chained).
  other = prompt;
  other[0] = 999;
  EXPECT_TRUE(bm.find_cached_prefix(other).blocks.empty());
}

TEST(BlockManager, LastTokenIsNeverAHit) {
  BlockManager bm(16, 4);
  const auto prompt = iota_tokens(8);  // exactly 2 blocks
  ASSERT_TRUE(bm.allocate(1, 8));
  bm.cache_full_blocks(1, prompt, 8);
  // The same 8 tokens: only the first block may be reused, the last token must be computed.
  EXPECT_EQ(bm.find_cached_prefix(prompt).blocks.size(), 1u);
  auto longer = iota_tokens(9);
  EXPECT_EQ(bm.find_cached_prefix(longer).blocks.size(), 2u);
}

// An MTP drafter's hit gives back its last block (scheduler.h): the rest is still a hit of the
// same partition, and giving back the only block leaves no hit at all.
TEST(BlockManager, AHitWithoutItsLastBlock) {
  BlockManager bm(16, 4, true, 2);
  const auto prompt = iota_tokens(13);  // 3 full blocks + 1 token
  ASSERT_TRUE(bm.allocate(1, 13));
  bm.cache_full_blocks(1, prompt, 13);
  const PrefixHit hit = bm.find_cached_prefix(prompt);
  ASSERT_EQ(hit.blocks.size(), 3u);
  const PrefixHit two = bm.without_last_block(hit);
  EXPECT_EQ(two.blocks, std::vector<int32_t>(hit.blocks.begin(), hit.blocks.begin() + 2));
  EXPECT_EQ(two.hashes, std::vector<uint64_t>(hit.hashes.begin(), hit.hashes.begin() + 2));
  EXPECT_EQ(two.last_hash, hit.hashes[1]);
  EXPECT_EQ(two.partition, hit.partition);
  // The same as the hit of a prompt that differs in its third block.
  auto other = prompt;
  other[9] = 999;
  const PrefixHit found = bm.find_cached_prefix(other);
  EXPECT_EQ(found.blocks, two.blocks);
  EXPECT_EQ(found.last_hash, two.last_hash);
  ASSERT_TRUE(bm.allocate(2, 13, &two));
  EXPECT_EQ(bm.ref_count(hit.blocks[2]), 1);  // sequence 2 computes the third block itself
  bm.check_invariants();

  const PrefixHit none = bm.without_last_block(bm.without_last_block(two));
  EXPECT_TRUE(none.blocks.empty());
  EXPECT_EQ(none.partition, -1);
  EXPECT_EQ(none.last_hash, bm.find_cached_prefix(iota_tokens(5, 500)).last_hash);
  EXPECT_TRUE(bm.without_last_block(none).blocks.empty());
}

TEST(BlockManager, CachedBlocksSurviveFreeAndAreReused) {
  BlockManager bm(4, 4);
  const auto prompt = iota_tokens(9);
  ASSERT_TRUE(bm.allocate(1, 9));
  bm.cache_full_blocks(1, prompt, 9);
  bm.free(1);
  EXPECT_EQ(bm.num_free_blocks(), 4);
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  const PrefixHit hit = bm.find_cached_prefix(prompt);
  ASSERT_EQ(hit.blocks.size(), 2u);
  // Taking 2 cached free blocks + 1 fresh = 3 of the 4 free blocks.
  ASSERT_TRUE(bm.allocate(2, 9, &hit));
  EXPECT_EQ(bm.num_free_blocks(), 1);
  EXPECT_EQ(bm.block_table(2)[0], hit.blocks[0]);
  bm.check_invariants();
}

TEST(BlockManager, HitBlocksInFreeListCountAgainstCapacity) {
  BlockManager bm(3, 4);
  const auto prompt = iota_tokens(9);
  ASSERT_TRUE(bm.allocate(1, 9));
  bm.cache_full_blocks(1, prompt, 9);
  bm.free(1);
  const PrefixHit hit = bm.find_cached_prefix(iota_tokens(13));
  ASSERT_EQ(hit.blocks.size(), 2u);
  // 13 tokens = 4 blocks: 2 hits + 2 fresh, but only 1 block is free besides the hits.
  EXPECT_FALSE(bm.can_allocate(2, 13, &hit));
  EXPECT_FALSE(bm.allocate(2, 13, &hit));
  EXPECT_EQ(bm.num_cached_blocks(), 2);  // the failed call evicted nothing
  EXPECT_TRUE(bm.allocate(2, 12, &hit));
  bm.check_invariants();
}

TEST(BlockManager, EvictionIsLeastRecentlyUsedAndTailFirst) {
  BlockManager bm(4, 2);
  const auto a = iota_tokens(5, 100);  // 2 full blocks
  ASSERT_TRUE(bm.allocate(1, 5));
  bm.cache_full_blocks(1, a, 5);
  const auto a_blocks = std::vector<int32_t>(bm.block_table(1).begin(), bm.block_table(1).end());
  bm.free(1);
  // The uncached third block went to the front; taking 2 blocks now takes it and then a's tail.
  ASSERT_TRUE(bm.allocate(2, 4));
  EXPECT_EQ(bm.num_cached_blocks(), 2);  // it took the uncached block and a never-used one
  ASSERT_TRUE(bm.allocate(3, 2));
  // Now one cached block had to go: the tail of `a`, so `a`'s first block is still a hit.
  const PrefixHit hit = bm.find_cached_prefix(a);
  ASSERT_EQ(hit.blocks.size(), 1u);
  EXPECT_EQ(hit.blocks[0], a_blocks[0]);
  bm.check_invariants();
}

TEST(BlockManager, DuplicateComputationKeepsFirstCopyCached) {
  BlockManager bm(8, 4);
  const auto p = iota_tokens(6);
  ASSERT_TRUE(bm.allocate(1, 6));
  ASSERT_TRUE(bm.allocate(2, 6));  // admitted in the same step: no hit yet
  bm.cache_full_blocks(1, p, 6);
  bm.cache_full_blocks(2, p, 6);
  EXPECT_EQ(bm.num_cached_blocks(), 1);
  EXPECT_EQ(bm.find_cached_prefix(p).blocks[0], bm.block_table(1)[0]);
  bm.free(1);
  bm.free(2);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  bm.check_invariants();
}

TEST(BlockManager, DecodeBlocksBecomeCachedAsTheyFill) {
  BlockManager bm(8, 4);
  std::vector<int32_t> tokens = iota_tokens(3);
  ASSERT_TRUE(bm.allocate(1, 3));
  bm.cache_full_blocks(1, tokens, 3);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  for (int32_t t = 50; t < 56; ++t) {
    tokens.push_back(t);
    ASSERT_TRUE(bm.allocate(1, static_cast<int64_t>(tokens.size())));
    bm.cache_full_blocks(1, tokens, static_cast<int64_t>(tokens.size()));
  }
  EXPECT_EQ(tokens.size(), 9u);
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  EXPECT_EQ(bm.find_cached_prefix(tokens).blocks.size(), 2u);
}

TEST(BlockManager, TruncateReleasesTheBlocksPastTheCut) {
  BlockManager bm(8, 4);
  ASSERT_TRUE(bm.allocate(1, 14));  // 4 blocks
  const std::vector<int32_t> table(bm.block_table(1).begin(), bm.block_table(1).end());
  EXPECT_EQ(bm.truncate(1, 6), 6);
  EXPECT_EQ(std::vector<int32_t>(bm.block_table(1).begin(), bm.block_table(1).end()),
            std::vector<int32_t>(table.begin(), table.begin() + 2));
  EXPECT_EQ(bm.num_free_blocks(), 6);
  bm.check_invariants();
  EXPECT_EQ(bm.truncate(1, 8), 8);  // past the cut already: nothing changes
  EXPECT_EQ(bm.truncate(1, 40), 40);
  EXPECT_EQ(bm.block_table(1).size(), 2u);
  EXPECT_EQ(bm.truncate(1, 0), 0);  // no block left, still bound to its partition
  EXPECT_TRUE(bm.block_table(1).empty());
  EXPECT_EQ(bm.partition_of(1), 0);
  ASSERT_TRUE(bm.allocate(1, 3));
  EXPECT_EQ(bm.block_table(1).size(), 1u);
  bm.check_invariants();
  EXPECT_THROW(bm.truncate(7, 0), Error);
  EXPECT_THROW(bm.truncate(1, -1), Error);
}

// A cached block the cut goes through would be rewritten, so it leaves the cache; blocks wholly
// past the cut still hold what their hash names and stay findable once free.
TEST(BlockManager, TruncationLeavesNoStaleHash) {
  BlockManager bm(8, 4);
  const auto tokens = iota_tokens(10);
  ASSERT_TRUE(bm.allocate(1, 10));
  bm.cache_full_blocks(1, tokens, 10);
  ASSERT_EQ(bm.num_cached_blocks(), 2);
  const int32_t second = bm.block_table(1)[1];
  EXPECT_EQ(bm.truncate(1, 6), 6);  // cuts the second (cached) block
  EXPECT_EQ(bm.num_cached_blocks(), 1);
  EXPECT_EQ(bm.find_cached_prefix(tokens).blocks.size(), 1u);
  bm.check_invariants();
  // The sequence writes other tokens there; the block is cached under their hash.
  std::vector<int32_t> rewritten(tokens.begin(), tokens.begin() + 6);
  rewritten.insert(rewritten.end(), {90, 91, 92});
  ASSERT_TRUE(bm.allocate(1, 9));
  EXPECT_EQ(bm.block_table(1)[1], second);
  bm.cache_full_blocks(1, rewritten, 9);
  EXPECT_EQ(bm.find_cached_prefix(rewritten).blocks.size(), 2u);
  EXPECT_EQ(bm.find_cached_prefix(tokens).blocks.size(), 1u);
  bm.check_invariants();
  // A cut on a block boundary keeps both hashes true: the released block stays a hit.
  EXPECT_EQ(bm.truncate(1, 4), 4);
  EXPECT_EQ(bm.ref_count(second), 0);
  EXPECT_EQ(bm.find_cached_prefix(rewritten).blocks.size(), 2u);
  bm.check_invariants();
  // Growing again chains from the first block, and the second block is a fresh one.
  ASSERT_TRUE(bm.allocate(1, 9));
  std::vector<int32_t> other(tokens.begin(), tokens.begin() + 4);
  other.insert(other.end(), {70, 71, 72, 73, 74});
  bm.cache_full_blocks(1, other, 9);
  EXPECT_EQ(bm.find_cached_prefix(other).blocks.size(), 2u);
  EXPECT_EQ(bm.find_cached_prefix(rewritten).blocks.size(), 2u);
  bm.check_invariants();
}

// A block shared with another sequence (a prefix hit) is that sequence's K/V: a cut through it
// releases it instead, and the truncated sequence keeps the blocks before it.
TEST(BlockManager, TruncatingIntoASharedBlockKeepsTheOtherSequencesKv) {
  BlockManager bm(8, 4);
  const auto prompt = iota_tokens(10);
  ASSERT_TRUE(bm.allocate(1, 10));
  bm.cache_full_blocks(1, prompt, 10);
  std::vector<int32_t> longer(prompt.begin(), prompt.begin() + 8);
  longer.insert(longer.end(), {7, 7, 7});
  const PrefixHit hit = bm.find_cached_prefix(longer);
  ASSERT_EQ(hit.blocks.size(), 2u);
  ASSERT_TRUE(bm.allocate(2, 11, &hit));
  EXPECT_EQ(bm.truncate(2, 6), 4);
  EXPECT_EQ(bm.block_table(2).size(), 1u);
  EXPECT_EQ(bm.ref_count(hit.blocks[0]), 2);
  EXPECT_EQ(bm.ref_count(hit.blocks[1]), 1);  // sequence 1's only
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  EXPECT_EQ(bm.find_cached_prefix(longer).blocks.size(), 2u);
  bm.check_invariants();
  bm.free(1);
  bm.free(2);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  bm.check_invariants();
}

TEST(BlockManager, PrefixCachingCanBeDisabled) {
  BlockManager bm(8, 4, /*enable_prefix_caching=*/false);
  const auto p = iota_tokens(9);
  ASSERT_TRUE(bm.allocate(1, 9));
  bm.cache_full_blocks(1, p, 9);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  EXPECT_TRUE(bm.find_cached_prefix(p).blocks.empty());
}

TEST(BlockManager, RejectsBadArguments) {
  EXPECT_THROW(BlockManager(0, 16), Error);
  EXPECT_THROW(BlockManager(4, 0), Error);
  BlockManager bm(4, 4);
  EXPECT_THROW(bm.block_table(7), Error);
  const std::vector<int32_t> t = iota_tokens(4);
  EXPECT_THROW(bm.cache_full_blocks(7, t, 4), Error);
}

TEST(BlockManager, PartitionsSplitTheIdSpace) {
  BlockManager bm(12, 4, true, 3);
  EXPECT_EQ(bm.num_partitions(), 3);
  EXPECT_EQ(bm.blocks_per_partition(), 4);
  for (int p = 0; p < 3; ++p) EXPECT_EQ(bm.num_free_blocks(p), 4);
  EXPECT_EQ(bm.partition_of_block(0), 0);
  EXPECT_EQ(bm.partition_of_block(3), 0);
  EXPECT_EQ(bm.partition_of_block(4), 1);
  EXPECT_EQ(bm.partition_of_block(11), 2);
  EXPECT_EQ(bm.partition_of(1), -1);
  EXPECT_TRUE(bm.find_cached_prefix(iota_tokens(9)).blocks.empty());
  EXPECT_EQ(bm.find_cached_prefix(iota_tokens(9)).partition, -1);
  EXPECT_THROW(BlockManager(10, 4, true, 3), Error);  // 10 blocks do not split into 3
  EXPECT_THROW(BlockManager(8, 4, true, 0), Error);
  EXPECT_THROW(bm.num_free_blocks(3), Error);
  bm.check_invariants();

  BlockManager one(8, 4);
  EXPECT_EQ(one.num_partitions(), 1);
  EXPECT_EQ(one.blocks_per_partition(), 8);
}

TEST(BlockManager, NewSequenceBindsToTheMostFreePartition) {
  BlockManager bm(8, 4, true, 2);
  ASSERT_TRUE(bm.allocate(1, 8));  // tie: the lowest index
  EXPECT_EQ(bm.partition_of(1), 0);
  ASSERT_TRUE(bm.allocate(2, 4));  // 4 free in partition 1, 2 in partition 0
  EXPECT_EQ(bm.partition_of(2), 1);
  ASSERT_TRUE(bm.allocate(3, 4));  // 3 against 2
  EXPECT_EQ(bm.partition_of(3), 1);
  ASSERT_TRUE(bm.allocate(4, 4));  // tie again
  EXPECT_EQ(bm.partition_of(4), 0);
  EXPECT_EQ(bm.num_free_blocks(0), 1);
  EXPECT_EQ(bm.num_free_blocks(1), 2);
  EXPECT_EQ(bm.num_free_blocks(), 3);
  for (int64_t id = 1; id <= 4; ++id) {
    for (int32_t b : bm.block_table(id)) EXPECT_EQ(bm.partition_of_block(b), bm.partition_of(id));
  }
  bm.check_invariants();
  bm.free(2);
  EXPECT_EQ(bm.partition_of(2), -1);
  EXPECT_EQ(bm.num_free_blocks(1), 3);
  bm.check_invariants();
}

TEST(BlockManager, GrowthStaysInItsPartitionAndAFullPartitionRefuses) {
  BlockManager bm(8, 4, true, 2);
  ASSERT_TRUE(bm.allocate(1, 4));  // partition 0
  ASSERT_TRUE(bm.allocate(2, 4));  // partition 1
  ASSERT_EQ(bm.partition_of(2), 1);
  ASSERT_TRUE(bm.allocate(1, 16));  // the whole of partition 0
  for (int32_t b : bm.block_table(1)) EXPECT_EQ(bm.partition_of_block(b), 0);
  EXPECT_EQ(bm.num_free_blocks(0), 0);
  EXPECT_EQ(bm.num_free_blocks(), 3);
  // Partition 1 has 3 free blocks, but sequence 1 cannot grow into them.
  EXPECT_FALSE(bm.can_allocate(1, 17));
  EXPECT_FALSE(bm.allocate(1, 17));
  EXPECT_EQ(bm.block_table(1).size(), 4u);
  // Sequence 2 grows in partition 1; a new sequence goes there too.
  ASSERT_TRUE(bm.allocate(2, 8));
  EXPECT_EQ(bm.partition_of_block(bm.block_table(2)[1]), 1);
  ASSERT_TRUE(bm.allocate(3, 8));
  EXPECT_EQ(bm.partition_of(3), 1);
  EXPECT_FALSE(bm.allocate(3, 9));  // partition 1 is full now as well
  EXPECT_EQ(bm.num_free_blocks(), 0);
  bm.check_invariants();
}

// bind() puts a new sequence in a chosen partition (where its recurrent-state slot is) even when
// another has more free blocks; free() undoes a binding that never got blocks.
TEST(BlockManager, BindChoosesThePartitionOfANewSequence) {
  BlockManager bm(8, 4, true, 2);
  ASSERT_TRUE(bm.allocate(1, 4));  // partition 0 (ties go to the lowest)
  bm.bind(2, 0);                   // although partition 1 has more free blocks
  EXPECT_EQ(bm.partition_of(2), 0);
  EXPECT_TRUE(bm.block_table(2).empty());
  ASSERT_TRUE(bm.allocate(2, 12));
  for (int32_t b : bm.block_table(2)) EXPECT_EQ(bm.partition_of_block(b), 0);
  EXPECT_FALSE(bm.allocate(2, 13));  // partition 0 is full; partition 1's blocks are not its
  bm.check_invariants();
  bm.bind(3, 0);
  EXPECT_FALSE(bm.allocate(3, 1));
  bm.free(3);
  EXPECT_FALSE(bm.has_sequence(3));
  EXPECT_THROW(bm.bind(2, 1), Error);   // already bound
  EXPECT_THROW(bm.bind(4, 2), Error);   // no such partition
  EXPECT_THROW(bm.bind(4, -1), Error);
  bm.check_invariants();
}

TEST(BlockManager, PrefixHitsArePerPartition) {
  BlockManager bm(8, 4, true, 2);
  const auto prompt = iota_tokens(9);  // 2 full blocks + 1 token
  ASSERT_TRUE(bm.allocate(1, 9));      // partition 0
  bm.cache_full_blocks(1, prompt, 9);
  const PrefixHit hit = bm.find_cached_prefix(prompt);
  ASSERT_EQ(hit.blocks.size(), 2u);
  EXPECT_EQ(hit.partition, 0);

  // Bound to partition 1 (the most free), sequence 2 cannot use partition 0's blocks: it gets its
  // own, and its copy of the prompt is cached there too (a separate chain, not a duplicate).
  ASSERT_TRUE(bm.allocate(2, 9));
  ASSERT_EQ(bm.partition_of(2), 1);
  EXPECT_EQ(bm.ref_count(hit.blocks[0]), 1);
  bm.cache_full_blocks(2, prompt, 9);
  EXPECT_EQ(bm.num_cached_blocks(), 4);
  // A hit naming another partition's blocks is refused.
  PrefixHit wrong = hit;
  wrong.partition = 1;
  EXPECT_THROW(bm.allocate(3, 9, &wrong), Error);
  EXPECT_FALSE(bm.has_sequence(3));
  bm.check_invariants();

  // Equal hits: the partition with more free blocks wins.
  bm.free(1);  // partition 0: 4 free, partition 1: 1
  PrefixHit again = bm.find_cached_prefix(prompt);
  EXPECT_EQ(again.partition, 0);
  EXPECT_EQ(again.blocks, hit.blocks);
  bm.free(2);
  ASSERT_TRUE(bm.allocate(4, 4));  // partition 0 (tie); takes the uncached block at its front
  EXPECT_EQ(bm.partition_of(4), 0);
  again = bm.find_cached_prefix(prompt);  // partition 0: 3 free, partition 1: 4
  ASSERT_EQ(again.blocks.size(), 2u);
  EXPECT_EQ(again.partition, 1);
  ASSERT_TRUE(bm.allocate(5, 9, &again));
  EXPECT_EQ(bm.partition_of(5), 1);
  EXPECT_EQ(bm.block_table(5)[0], again.blocks[0]);
  bm.check_invariants();
}

TEST(BlockManager, LongestHitWinsEvenInAFullPartition) {
  BlockManager bm(8, 4, true, 2);
  const auto prompt = iota_tokens(13);  // 3 full blocks + 1 token
  ASSERT_TRUE(bm.allocate(1, 13));      // all of partition 0
  ASSERT_TRUE(bm.allocate(2, 13));      // all of partition 1
  ASSERT_EQ(bm.partition_of(2), 1);
  bm.cache_full_blocks(1, prompt, 4);   // 1 block cached in partition 0
  bm.cache_full_blocks(2, prompt, 13);  // 3 in partition 1
  bm.free(1);
  const PrefixHit hit = bm.find_cached_prefix(prompt);
  ASSERT_EQ(hit.blocks.size(), 3u);
  EXPECT_EQ(hit.partition, 1);  // longer, though partition 0 has every block free
  // The 4th block would have to come from partition 1, which is full: refused although partition 0
  // has 4 free blocks.
  EXPECT_FALSE(bm.can_allocate(3, 13, &hit));
  EXPECT_FALSE(bm.allocate(3, 13, &hit));
  EXPECT_FALSE(bm.has_sequence(3));
  EXPECT_TRUE(bm.allocate(3, 12, &hit));  // the hit blocks alone fit
  EXPECT_EQ(bm.ref_count(hit.blocks[0]), 2);
  bm.check_invariants();
}

// Random allocate / grow / cache / truncate / free sequences over a small pool split into
// `num_partitions`, from several fixed seeds. A shadow model tracks what each sequence's tokens
// are (and what each block holds, rejected drafts included); after every
// operation the invariants hold, every hit block really holds the tokens it claims and lies in the
// hit's partition, a sequence is bound where allocate promises and never leaves its partition,
// can_allocate agrees with allocate, and freeing everything returns usage to 0.
void run_random_operations(int num_partitions) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(testing::Message() << num_partitions << " partitions, seed " << seed);
    std::mt19937 rng(seed);
    const int block_size = 1 + static_cast<int>(rng() % 4);
    BlockManager bm(24, block_size, true, num_partitions);
    auto most_free_partition = [&] {
      int best = 0;
      for (int p = 1; p < num_partitions; ++p) {
        if (bm.num_free_blocks(p) > bm.num_free_blocks(best)) best = p;
      }
      return best;
    };
    std::map<int64_t, std::vector<int32_t>> live;  // seq -> tokens (all computed)
    // The content each block holds, written when a sequence computes it.
    std::vector<std::vector<int32_t>> content(24);
    int64_t next_id = 0;
    auto random_tokens = [&](int n) {
      // A few shared prefixes so hits happen often.
      std::vector<int32_t> t;
      const int family = static_cast<int>(rng() % 3);
      for (int i = 0; i < n; ++i)
        t.push_back(i < 6 ? family * 100 + i : static_cast<int32_t>(rng() % 5));
      return t;
    };
    auto write_content = [&](int64_t id, const std::vector<int32_t>& tokens, size_t from) {
      const auto table = bm.block_table(id);
      for (size_t pos = from; pos < tokens.size(); ++pos) {
        auto& c = content[table[pos / block_size]];
        c.resize(block_size, -1);
        c[pos % block_size] = tokens[pos];
      }
    };
    for (int op = 0; op < 600; ++op) {
      const int kind = static_cast<int>(rng() % 5);
      if (kind == 0 || live.empty()) {  // new sequence, maybe with a prefix hit
        const auto tokens = random_tokens(1 + static_cast<int>(rng() % 12));
        const PrefixHit hit = bm.find_cached_prefix(tokens);
        EXPECT_EQ(hit.partition == -1, hit.blocks.empty());
        for (size_t i = 0; i < hit.blocks.size(); ++i) {
          EXPECT_EQ(bm.partition_of_block(hit.blocks[i]), hit.partition);
          for (int j = 0; j < block_size; ++j) {
            ASSERT_EQ(content[hit.blocks[i]][j], tokens[i * block_size + j]) << "seed " << seed;
          }
        }
        const int64_t id = next_id++;
        const int expected_partition = hit.blocks.empty() ? most_free_partition() : hit.partition;
        const bool fits = bm.can_allocate(id, static_cast<int64_t>(tokens.size()), &hit);
        const bool ok = bm.allocate(id, static_cast<int64_t>(tokens.size()), &hit);
        EXPECT_EQ(ok, fits);
        EXPECT_EQ(ok, bm.has_sequence(id));
        if (ok) {
          EXPECT_EQ(bm.partition_of(id), expected_partition);
          write_content(id, tokens, hit.blocks.size() * block_size);
          bm.cache_full_blocks(id, tokens, static_cast<int64_t>(tokens.size()));
          live[id] = tokens;
        }
      } else if (kind == 1) {  // grow (decode) a random sequence
        auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
        auto tokens = it->second;
        tokens.push_back(static_cast<int32_t>(rng() % 5));
        const int partition = bm.partition_of(it->first);
        const bool fits = bm.can_allocate(it->first, static_cast<int64_t>(tokens.size()));
        const bool ok = bm.allocate(it->first, static_cast<int64_t>(tokens.size()));
        EXPECT_EQ(ok, fits);
        EXPECT_EQ(bm.partition_of(it->first), partition);
        if (ok) {
          write_content(it->first, tokens, tokens.size() - 1);
          bm.cache_full_blocks(it->first, tokens, static_cast<int64_t>(tokens.size()));
          it->second = tokens;
        }
      } else if (kind == 2) {  // a speculative step's rollback, or a cut anywhere
        auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
        std::vector<int32_t>& tokens = it->second;
        const int64_t id = it->first;
        int64_t keep = static_cast<int64_t>(rng() % (tokens.size() + 1));
        std::vector<int32_t> drafted = tokens;
        const int k = 1 + static_cast<int>(rng() % 5);
        for (int i = 0; i < k; ++i) drafted.push_back(static_cast<int32_t>(rng() % 5));
        // Half the time k drafts are computed and the first `accepted` of them kept.
        if (rng() % 2 == 0 && bm.allocate(id, static_cast<int64_t>(drafted.size()))) {
          write_content(id, drafted, tokens.size());
          keep = static_cast<int64_t>(tokens.size()) + static_cast<int64_t>(rng() % (k + 1));
          tokens.assign(drafted.begin(), drafted.begin() + keep);
        }
        const int64_t kept = bm.truncate(id, keep);
        const int64_t block_start = keep / block_size * block_size;
        EXPECT_TRUE(kept == keep || kept == block_start) << kept << " of " << keep;
        tokens.resize(static_cast<size_t>(kept));
        bm.cache_full_blocks(id, tokens, kept);
      } else {  // free
        auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
        bm.free(it->first);
        live.erase(it);
      }
      ASSERT_NO_THROW(bm.check_invariants()) << "seed " << seed << " op " << op;
      int free_sum = 0;
      for (int p = 0; p < num_partitions; ++p) free_sum += bm.num_free_blocks(p);
      EXPECT_EQ(free_sum, bm.num_free_blocks());
      // A used block is never handed to two sequences unless it is a shared cached block.
      std::map<int32_t, int> owners;
      for (const auto& [id, tokens] : live) {
        for (int32_t b : bm.block_table(id)) ++owners[b];
      }
      for (const auto& [b, n] : owners) {
        if (n > 1) {
          EXPECT_EQ(bm.ref_count(b), n);
        }
      }
    }
    for (const auto& [id, tokens] : live) bm.free(id);
    EXPECT_DOUBLE_EQ(bm.usage(), 0.0) << "seed " << seed;
    EXPECT_EQ(bm.num_free_blocks(), 24);
    bm.check_invariants();
  }
}

// What hybrid prefix caching asks of the block manager: a hit cut to its first blocks, the cached
// block naming a sequence's prefix (also when the sequence computed its own copy of it), and the
// hashes that left the cache.
TEST(BlockManager, CachedPrefixBlocksAndUncachedHashes) {
  BlockManager bm(8, 4);
  bm.record_uncached();
  const auto prompt = iota_tokens(13);
  ASSERT_TRUE(bm.allocate(1, 13));
  EXPECT_FALSE(bm.cached_prefix_block(1, prompt, 0));  // not hashed yet
  bm.cache_full_blocks(1, prompt, 13);
  const PrefixHit hit = bm.find_cached_prefix(prompt);
  ASSERT_EQ(hit.blocks.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const auto c = bm.cached_prefix_block(1, prompt, i);
    ASSERT_TRUE(c);
    EXPECT_EQ(c->block, hit.blocks[static_cast<size_t>(i)]);
    EXPECT_EQ(c->hash, hit.hashes[static_cast<size_t>(i)]);
  }
  EXPECT_FALSE(bm.cached_prefix_block(1, prompt, 3));  // the partial fourth block
  const PrefixHit two = bm.first_blocks(hit, 2);
  EXPECT_EQ(two.blocks, std::vector<int32_t>(hit.blocks.begin(), hit.blocks.begin() + 2));
  EXPECT_EQ(two.last_hash, hit.hashes[1]);
  EXPECT_EQ(bm.first_blocks(hit, 5).blocks.size(), 3u);
  const PrefixHit none = bm.first_blocks(hit, 0);
  EXPECT_TRUE(none.blocks.empty());
  EXPECT_EQ(none.partition, -1);
  // Sequence 2 computes the same prefix in its own blocks: its prefix is named by 1's blocks.
  ASSERT_TRUE(bm.allocate(2, 5));
  bm.cache_full_blocks(2, prompt, 5);
  EXPECT_EQ(bm.cached_prefix_block(2, prompt, 0)->block, hit.blocks[0]);
  EXPECT_NE(bm.block_table(2)[0], hit.blocks[0]);
  // Another sequence's tokens under its own chain are not that prefix.
  auto other = prompt;
  other[1] = 99;
  ASSERT_TRUE(bm.allocate(3, 4));
  bm.cache_full_blocks(3, other, 4);
  EXPECT_EQ(bm.cached_prefix_block(3, other, 0)->block, bm.block_table(3)[0]);
  const uint64_t other_hash = bm.cached_prefix_block(3, other, 0)->hash;
  const int32_t other_block = bm.block_table(3)[0];
  EXPECT_TRUE(bm.take_uncached().empty());
  bm.free(1);
  bm.free(3);
  bm.free(2);
  ASSERT_TRUE(bm.allocate(4, 32));  // every block: the cached ones are evicted
  std::set<std::pair<uint64_t, int32_t>> gone;
  for (const CachedPrefixBlock& b : bm.take_uncached()) gone.emplace(b.hash, b.block);
  EXPECT_EQ(gone, (std::set<std::pair<uint64_t, int32_t>>{{hit.hashes[0], hit.blocks[0]},
                                                          {hit.hashes[1], hit.blocks[1]},
                                                          {hit.hashes[2], hit.blocks[2]},
                                                          {other_hash, other_block}}));
  EXPECT_TRUE(bm.take_uncached().empty());
  bm.free(4);
  // 5 caches the first block again and 6 computes its own copy, named by 5's until it is evicted.
  ASSERT_TRUE(bm.allocate(5, 4));
  bm.cache_full_blocks(5, prompt, 4);
  ASSERT_TRUE(bm.allocate(6, 4));
  bm.cache_full_blocks(6, prompt, 4);
  EXPECT_EQ(bm.cached_prefix_block(6, prompt, 0)->block, bm.block_table(5)[0]);
  bm.free(5);
  ASSERT_TRUE(bm.allocate(7, 28));  // every free block, 5's cached one among them
  EXPECT_FALSE(bm.cached_prefix_block(6, prompt, 0));  // 6's prefix is no longer cached
  bm.check_invariants();
}

TEST(BlockManager, RandomOperationsKeepInvariants) { run_random_operations(1); }

TEST(BlockManager, RandomOperationsKeepInvariantsWithPartitions) {
  run_random_operations(2);
  run_random_operations(4);
}

}  // namespace
}  // namespace relay

// StateSnapshotPool: snapshots found by (hash, block) only once committed, one per hash, LRU
// eviction that skips pending and pinned snapshots, drops with their blocks, partitions, and the
// invariants after a random walk of every operation.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "core/error.h"
#include "kvcache/state_snapshots.h"

namespace relay {
namespace {

TEST(StateSnapshotPool, APendingSnapshotIsFoundOnlyOnceCommitted) {
  StateSnapshotPool pool(4);
  const int32_t s = pool.allocate(0);
  ASSERT_EQ(s, 0);  // low ids first
  EXPECT_EQ(pool.find(11, 3), -1);
  pool.commit(s, 11, 3);
  EXPECT_EQ(pool.find(11, 3), s);
  EXPECT_EQ(pool.find(11, 4), -1);  // the hash under another block: not this prefix
  EXPECT_EQ(pool.find(12, 3), -1);
  EXPECT_EQ(pool.num_cached(), 1);
  const int32_t t = pool.allocate(0);
  pool.release(t);  // not kept
  EXPECT_EQ(pool.num_free(0), 3);
  pool.check_invariants();
}

TEST(StateSnapshotPool, OneSnapshotPerHash) {
  StateSnapshotPool pool(4);
  const int32_t a = pool.allocate(0);
  pool.commit(a, 7, 1);
  const int32_t b = pool.allocate(0);
  pool.commit(b, 7, 1);  // the same prefix again: the first stays
  EXPECT_EQ(pool.find(7, 1), a);
  EXPECT_EQ(pool.num_cached(), 1);
  EXPECT_EQ(pool.num_free(0), 3);
  const int32_t c = pool.allocate(0);
  pool.commit(c, 7, 2);  // under a new block: the old one's block has left the cache
  EXPECT_EQ(pool.find(7, 2), c);
  EXPECT_EQ(pool.find(7, 1), -1);
  EXPECT_EQ(pool.num_cached(), 1);
  pool.check_invariants();
}

TEST(StateSnapshotPool, EvictsTheLeastRecentlyUsedUnpinnedSnapshot) {
  StateSnapshotPool pool(3);
  for (uint64_t h = 1; h <= 3; ++h) pool.commit(pool.allocate(0), h, static_cast<int32_t>(h));
  pool.touch(pool.find(1, 1));  // 2 is now the least recently used
  const int32_t pinned = pool.find(2, 2);
  pool.pin(pinned);  // ... but pinned: 3 goes
  const int32_t s = pool.allocate(0);
  EXPECT_GE(s, 0);
  EXPECT_EQ(pool.find(3, 3), -1);
  EXPECT_EQ(pool.find(2, 2), pinned);
  EXPECT_GE(pool.find(1, 1), 0);
  pool.check_invariants();
  // Every other slot pending or pinned: nothing to take.
  const int32_t t = pool.allocate(0);
  EXPECT_GE(t, 0);  // 1 goes
  EXPECT_EQ(pool.find(1, 1), -1);
  EXPECT_EQ(pool.allocate(0), -1);
  EXPECT_THROW(pool.drop(2, 2), Error);  // a pinned snapshot is being restored
  pool.unpin(pinned);
  EXPECT_EQ(pool.allocate(0), pinned);
  pool.check_invariants();
}

TEST(StateSnapshotPool, ADemotedSnapshotIsEvictedFirst) {
  StateSnapshotPool pool(2);
  pool.commit(pool.allocate(0), 1, 1);
  pool.commit(pool.allocate(0), 2, 2);
  pool.demote(pool.find(2, 2));
  pool.allocate(0);
  EXPECT_GE(pool.find(1, 1), 0);
  EXPECT_EQ(pool.find(2, 2), -1);
  pool.check_invariants();
}

TEST(StateSnapshotPool, DropFreesTheSnapshotOfAnUncachedBlock) {
  StateSnapshotPool pool(2);
  pool.commit(pool.allocate(0), 5, 9);
  pool.drop(6, 9);  // no snapshot under it: nothing
  pool.drop(5, 8);  // the hash under another block: not this snapshot
  EXPECT_EQ(pool.num_cached(), 1);
  pool.drop(5, 9);
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_EQ(pool.num_free(0), 2);
  pool.check_invariants();
}

TEST(StateSnapshotPool, PartitionsKeepTheirOwnSlots) {
  StateSnapshotPool pool(4, 2);
  EXPECT_EQ(pool.snapshots_per_partition(), 2);
  const int32_t a = pool.allocate(1);
  const int32_t b = pool.allocate(1);
  EXPECT_EQ(pool.partition_of_snapshot(a), 1);
  EXPECT_EQ(pool.partition_of_snapshot(b), 1);
  EXPECT_EQ(pool.allocate(1), -1);  // partition 0's free slots are of no use to 1
  EXPECT_EQ(pool.num_free(0), 2);
  pool.commit(a, 1, 1);
  pool.commit(b, 2, 2);
  const int32_t c = pool.allocate(1);  // evicts within partition 1
  EXPECT_EQ(pool.partition_of_snapshot(c), 1);
  EXPECT_EQ(pool.num_cached(), 1);
  pool.check_invariants();
  EXPECT_THROW(StateSnapshotPool(3, 2), Error);
  EXPECT_THROW(StateSnapshotPool(0, 1), Error);
}

TEST(StateSnapshotPool, MisuseIsRefused) {
  StateSnapshotPool pool(2);
  const int32_t s = pool.allocate(0);
  EXPECT_THROW(pool.pin(s), Error);  // pending: nothing to restore yet
  EXPECT_THROW(pool.touch(s), Error);
  pool.commit(s, 1, 1);
  EXPECT_THROW(pool.commit(s, 2, 2), Error);  // not pending any more
  EXPECT_THROW(pool.release(s), Error);
  EXPECT_THROW(pool.unpin(s), Error);
  EXPECT_THROW(pool.allocate(1), Error);
  EXPECT_THROW(pool.pin(7), Error);
}

// A random walk through every operation keeps the invariants, and find() agrees with a model of
// what is cached.
TEST(StateSnapshotPool, RandomOperationsKeepTheInvariants) {
  std::mt19937 rng(5);
  StateSnapshotPool pool(8, 2);
  std::map<uint64_t, std::pair<int32_t, int32_t>> cached;  // hash -> (snapshot, block)
  std::set<int32_t> pending;
  std::map<int32_t, int> pins;
  for (int i = 0; i < 5000; ++i) {
    const uint64_t hash = rng() % 12;
    const int32_t block = static_cast<int32_t>(rng() % 3);
    switch (rng() % 6) {
      case 0: {
        const int32_t s = pool.allocate(static_cast<int>(rng() % 2));
        if (s >= 0) {
          for (auto it = cached.begin(); it != cached.end(); ++it) {
            if (it->second.first == s) {  // evicted for it
              EXPECT_EQ(pins[s], 0);
              cached.erase(it);
              break;
            }
          }
          pending.insert(s);
        }
        break;
      }
      case 1:
      case 2:
        if (!pending.empty()) {
          const int32_t s = *pending.begin();
          pending.erase(pending.begin());
          const auto it = cached.find(hash);
          if (it != cached.end() && it->second.second == block) {
            pool.commit(s, hash, block);  // the same prefix: s goes back
          } else if (it == cached.end() || pins[it->second.first] == 0) {
            pool.commit(s, hash, block);
            cached[hash] = {s, block};
          } else {
            pool.release(s);
          }
        }
        break;
      case 3:
        if (const auto it = cached.find(hash); it != cached.end() && pins[it->second.first] == 0) {
          pool.drop(hash, it->second.second);
          cached.erase(it);
        }
        break;
      case 4:
        if (const auto it = cached.find(hash); it != cached.end()) {
          pool.pin(it->second.first);
          ++pins[it->second.first];
        }
        break;
      case 5:
        for (auto& [s, n] : pins) {
          if (n > 0) {
            pool.unpin(s);
            --n;
            break;
          }
        }
        break;
    }
    pool.check_invariants();
    for (uint64_t h = 0; h < 12; ++h) {
      const auto it = cached.find(h);
      for (int32_t b = 0; b < 3; ++b) {
        const bool want = it != cached.end() && it->second.second == b;
        EXPECT_EQ(pool.find(h, b), want ? it->second.first : -1) << "hash " << h;
      }
    }
    ASSERT_FALSE(::testing::Test::HasFailure()) << "step " << i;
  }
  EXPECT_EQ(pool.num_cached(), static_cast<int>(cached.size()));
}

}  // namespace
}  // namespace relay

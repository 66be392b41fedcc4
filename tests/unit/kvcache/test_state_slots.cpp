// kvcache/state_slots.h: slots are handed out whole per sequence, within one partition, all or
// nothing, come back on free, and a random workload never breaks the invariants.
#include <gtest/gtest.h>

#include <random>

#include "core/error.h"
#include "kvcache/state_slots.h"

namespace relay {
namespace {

TEST(StateSlots, SequencesGetTheirSlotsWholeAndGiveThemBack) {
  StateSlotManager slots(6, /*slots_per_sequence=*/2);
  EXPECT_EQ(slots.num_free_sequences(0), 3);
  ASSERT_TRUE(slots.allocate(1, 0));
  ASSERT_TRUE(slots.allocate(2, 0));
  EXPECT_EQ(slots.slots(1).size(), 2u);
  EXPECT_TRUE(slots.allocate(1, 0));  // it has them already
  ASSERT_TRUE(slots.allocate(3, 0));
  EXPECT_FALSE(slots.allocate(4, 0));  // full: nothing changes
  EXPECT_FALSE(slots.has_sequence(4));
  EXPECT_EQ(slots.num_free_slots(), 0);
  EXPECT_DOUBLE_EQ(slots.usage(), 1.0);
  slots.free(2);
  slots.free(2);  // unknown now: a no-op
  EXPECT_EQ(slots.num_free_sequences(0), 1);
  EXPECT_TRUE(slots.allocate(4, 0));
  EXPECT_TRUE(slots.slots(99).empty());
  EXPECT_EQ(slots.partition_of(99), -1);
  slots.check_invariants();
}

TEST(StateSlots, PartitionsKeepTheirOwnSlots) {
  StateSlotManager slots(8, 1, /*num_partitions=*/2);
  for (int64_t s = 0; s < 4; ++s) ASSERT_TRUE(slots.allocate(s, 1));
  EXPECT_FALSE(slots.allocate(9, 1));  // partition 1 is full, partition 0 is not
  EXPECT_TRUE(slots.allocate(9, 0));
  EXPECT_EQ(slots.partition_of(9), 0);
  for (int64_t s = 0; s < 4; ++s) {
    EXPECT_EQ(slots.partition_of(s), 1);
    EXPECT_GE(slots.slots(s)[0], 4);
  }
  EXPECT_THROW(slots.allocate(9, 1), Error);  // its slots are in partition 0
  EXPECT_THROW(slots.allocate(10, 2), Error);
  slots.check_invariants();
}

TEST(StateSlots, BadSizesAreRefused) {
  EXPECT_THROW(StateSlotManager(0), Error);
  EXPECT_THROW(StateSlotManager(5, 1, 2), Error);  // not a multiple of the partitions
  EXPECT_THROW(StateSlotManager(4, 3, 2), Error);  // a partition cannot hold one sequence
  EXPECT_THROW(StateSlotManager(4, 0), Error);
}

TEST(StateSlots, RandomWorkKeepsTheInvariants) {
  std::mt19937 rng(7);
  StateSlotManager slots(24, 3, 2);
  std::vector<int64_t> live;
  for (int i = 0; i < 2000; ++i) {
    if (live.empty() || rng() % 2) {
      const int64_t id = i;
      if (slots.allocate(id, static_cast<int>(rng() % 2))) live.push_back(id);
    } else {
      const size_t k = rng() % live.size();
      slots.free(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
    slots.check_invariants();
  }
}

}  // namespace
}  // namespace relay

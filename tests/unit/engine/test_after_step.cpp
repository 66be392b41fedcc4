// engine/after_step.h: which sampled tokens are whose, and the recurrent-state copies that roll a
// drafted sequence back (the rule both backends apply).
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "engine/after_step.h"

namespace relay {
namespace {

TEST(AfterStep, TokensPerSequenceSplitsTheRunsAndSkipsOthers) {
  const std::vector<int32_t> tokens{1, 2, 3};
  std::vector<StepSequence> batch(4);
  for (int i = 0; i < 4; ++i) {
    batch[i].seq_id = 10 + i;
    batch[i].tokens = tokens;
    batch[i].sample = i != 1;
  }
  // Sequence 12 was sampled on another node: no run of its own.
  std::vector<SampledToken> sampled(4);
  sampled[0].seq_id = 10, sampled[1].seq_id = 10, sampled[2].seq_id = 13, sampled[3].seq_id = 13;
  const auto runs = tokens_per_sequence(batch, sampled);
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0].size(), 2u);
  EXPECT_TRUE(runs[1].empty());
  EXPECT_TRUE(runs[2].empty());
  ASSERT_EQ(runs[3].size(), 2u);
  EXPECT_EQ(runs[3].data(), sampled.data() + 2);
}

// Two drafts, saves after rows 0 and 2 (the last token's and the second draft's): the state after
// row j is in draft slot 1 + j for j < 2, after row 2 in slot 0 — or in draft slot 3 when padded.
TEST(AfterStep, DraftStateCopiesFollowTheAcceptedRow) {
  const std::vector<int32_t> tokens{7, 8, 9};
  const std::vector<SnapshotSave> saves{{0, 40}, {2, 41}};
  StepSequence s;
  s.seq_id = 1;
  s.tokens = tokens;
  s.num_draft_tokens = 2;
  s.save_state_snapshots = saves;
  using C = std::vector<StateCopy>;
  EXPECT_EQ(draft_state_copies(s, 0, false), (C{{1, -1, 40}, {1, 0, -1}}));
  EXPECT_EQ(draft_state_copies(s, 1, false), (C{{1, -1, 40}, {2, 0, -1}}));
  EXPECT_EQ(draft_state_copies(s, 2, false), (C{{1, -1, 40}, {0, -1, 41}}));  // slot 0 holds it
  EXPECT_EQ(draft_state_copies(s, 2, true), (C{{1, -1, 40}, {3, -1, 41}, {3, 0, -1}}));
  // No drafts, padded in a verify graph: its one row's state comes back from draft slot 1.
  s.num_draft_tokens = 0;
  s.save_state_snapshots = {};
  EXPECT_EQ(draft_state_copies(s, 0, true), (C{{1, 0, -1}}));
  EXPECT_TRUE(draft_state_copies(s, 0, false).empty());
  EXPECT_THROW(draft_state_copies(s, 1, false), Error);
}

}  // namespace
}  // namespace relay

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

// The MTP plan: catch-up rows up to the last accepted draft, then a chain of K drafts at most,
// fewer where the sequence asks for fewer (max_proposed_drafts) or its block table ends first.
TEST(AfterStep, MtpPlanStopsChainsAtTheCapAndTheBlockTable) {
  const std::vector<int32_t> tokens{5, 6, 7};  // the last token and two drafts
  const std::vector<int32_t> table{3, 4};      // 8 positions at block size 4
  std::vector<int32_t> proposals;
  std::vector<StepSequence> batch(3);
  for (int i = 0; i < 3; ++i) {
    batch[i].seq_id = i;
    batch[i].tokens = tokens;
    batch[i].num_draft_tokens = 2;
    batch[i].sample = true;
    batch[i].block_table = table;
    batch[i].proposed_drafts = &proposals;
  }
  batch[0].num_computed = 1;  // rows at positions 1..3
  batch[1].num_computed = 3;  // rows at 3..5
  batch[1].max_proposed_drafts = 2;
  batch[2].num_computed = 1;
  batch[2].proposed_drafts = nullptr;  // wants none
  // Sequence 0 accepted one draft (2 tokens sampled), 1 both (3), 2 none (1).
  std::vector<SampledToken> sampled;
  for (auto [id, n] : {std::pair{0, 2}, {1, 3}, {2, 1}}) {
    for (int j = 0; j < n; ++j) {
      SampledToken t;
      t.seq_id = id;
      t.token = 100 + j;
      sampled.push_back(t);
    }
  }
  const auto plan = plan_mtp_catch_up(batch, sampled, 4, 4);
  ASSERT_EQ(plan.size(), 3u);
  // 0: rows 0..1 (positions 1, 2) catch up; the chain's rows at 3, 4, 5 all fit: 4 drafts.
  EXPECT_EQ(plan[0].rows, 2);
  EXPECT_EQ(plan[0].next_token, 101);
  EXPECT_EQ(plan[0].drafts, 4);
  EXPECT_EQ(plan[0].chain_position(1), 3);
  EXPECT_EQ(plan[0].chain_position(3), 5);
  // 1: all 3 rows (positions 3..5); capped at 2 drafts (its chain row at 6 fits).
  EXPECT_EQ(plan[1].rows, 3);
  EXPECT_EQ(plan[1].drafts, 2);
  EXPECT_EQ(plan[1].chain_position(1), 6);
  // 2: catches up over its one row, proposes nothing.
  EXPECT_EQ(plan[2].rows, 1);
  EXPECT_EQ(plan[2].drafts, 0);
  // The table ends first: sequence 1 uncapped has chain rows at 6 and 7 inside, 8 outside.
  batch[1].max_proposed_drafts = 100;
  EXPECT_EQ(plan_mtp_catch_up(batch, sampled, 4, 4)[1].drafts, 3);
}

}  // namespace
}  // namespace relay

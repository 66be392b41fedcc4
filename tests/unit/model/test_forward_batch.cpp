// model/forward_batch.h's FlatBatch, the step flattener both backends share: positions from the
// computed prefix, K/V slots through the block table, tables padded to the batch's width, filler
// rows and padding sequences that write nothing (CUDA graph steps).
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "model/forward_batch.h"

namespace relay {
namespace {

TEST(FlatBatch, FlattensSequencesFillersAndPadding) {
  FlatBatch f;
  f.reset(3);
  const std::vector<int32_t> a{11, 12, 13}, table_a{7, 2}, b{21}, table_b{5, 6, 9};
  EXPECT_EQ(f.append(a, 2, table_a, 4), 0);        // positions 2..4: block 7 then block 2
  EXPECT_EQ(f.append(b, 8, table_b, 4, 2), 3);     // position 8 in block 9, then 2 fillers
  f.append_padding(3);
  EXPECT_EQ(f.token_ids, (std::vector<int32_t>{11, 12, 13, 21, 0, 0, 0, 0, 0}));
  EXPECT_EQ(f.positions, (std::vector<int32_t>{2, 3, 4, 8, 9, 10, 0, 1, 2}));
  EXPECT_EQ(f.slot_mapping, (std::vector<int64_t>{30, 31, 8, 36, -1, -1, -1, -1, -1}));
  EXPECT_EQ(f.query_starts, (std::vector<int32_t>{0, 3, 6, 9}));
  EXPECT_EQ(f.context_lens, (std::vector<int32_t>{5, 11, 3}));
  EXPECT_EQ(f.block_tables, (std::vector<int32_t>{7, 2, 0, 5, 6, 9, 0, 0, 0}));
  const ForwardBatch view = f.view();
  EXPECT_EQ(view.num_tokens(), 9);
  EXPECT_EQ(view.num_seqs(), 3);
  EXPECT_EQ(view.max_blocks_per_seq, 3);
  // A table wider than the batch is refused; reset empties everything.
  const std::vector<int32_t> wide{1, 2, 3, 4};
  EXPECT_THROW(f.append(b, 0, wide, 4), Error);
  f.reset(1);
  EXPECT_TRUE(f.token_ids.empty());
  EXPECT_EQ(f.query_starts, (std::vector<int32_t>{0}));
}

}  // namespace
}  // namespace relay

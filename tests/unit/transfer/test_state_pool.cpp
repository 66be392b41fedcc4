// State planner tests: every plan is executed with memcpy on host byte buffers standing in for the
// ranks' registered regions, and every destination byte is checked.
//
// Each element's value is a function of what it is — (layer, part, global head, row in the head,
// column), plus 100000 x the slot it sits in — computed through kvcache/recurrent_state.h's
// RecurrentStateLayout and the rank's head ranges, independently of the descriptors' arithmetic.
// Regions start filled with kJunk, so a copy that reads outside the sequence's slot (another slot,
// the bytes around a pool) or writes outside it shows up. The model: 4 key heads, 8 value heads,
// key_dim 3, value_dim 5, conv_width 3, 2 layers; source and destination use different slots and
// slot counts, every pool starts at a non-zero offset, and the destination ranks share one region.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "../error_text.h"
#include "core/error.h"
#include "core/json.h"
#include "kvcache/recurrent_state.h"
#include "transfer/state_pool.h"

namespace relay {
namespace {

constexpr int kNumKHeads = 4;
constexpr int kNumVHeads = 8;
constexpr int kKeyDim = 3;
constexpr int kValueDim = 5;
constexpr int kConvWidth = 3;
constexpr int kNumLayers = 2;
constexpr std::byte kJunk{0xEE};

// The layout of tensor-parallel rank `tp_rank` of `tp`'s pool, as model.cpp sizes it.
RecurrentStateLayout tp_layout(int tp, int num_slots) {
  RecurrentStateLayout l;
  l.num_layers = kNumLayers;
  l.num_slots = num_slots;
  l.conv_dim = 2 * (kNumKHeads / tp) * kKeyDim + (kNumVHeads / tp) * kValueDim;
  l.conv_width = kConvWidth;
  l.num_heads = kNumVHeads / tp;
  l.key_dim = kKeyDim;
  l.value_dim = kValueDim;
  l.element_bytes = sizeof(float);
  return l;
}

// The value of an element of the model's state in slot `slot`: distinct for every (slot, layer,
// part, global head, row, column) and exact in fp32. Parts: 0 conv q, 1 conv k, 2 conv v, 3 SSM.
float element_value(int slot, int layer, int part, int head, int row, int column) {
  return static_cast<float>(((((layer * 4 + part) * 8 + head) * 8 + row) * 8 + column) + 1 +
                            100000 * slot);
}

// One side: TP `tp` ranks, each pool of `num_slots` slots, and the memory of its regions.
struct TestSide {
  int32_t slot = 0;
  std::vector<RecurrentStateLayout> layouts;  // per rank
  std::vector<StatePoolDesc> pools;           // per rank
  std::map<RegionId, std::vector<std::byte>> regions;

  StateTransferSide side() const { return {kNumKHeads, kNumVHeads, pools, slot}; }
};

// Pools of TP `tp`: in regions first_region + rank, or all in first_region one after another when
// `one_region`; each pool starts at a non-zero offset and is followed by junk bytes.
TestSide make_side(int tp, int num_slots, int32_t slot, RegionId first_region, bool one_region) {
  TestSide s;
  s.slot = slot;
  uint64_t next_offset = 48;
  for (int r = 0; r < tp; ++r) {
    const RecurrentStateLayout layout = tp_layout(tp, num_slots);
    const KvHeadRange k{r * kNumKHeads / tp, kNumKHeads / tp};
    const KvHeadRange v{r * kNumVHeads / tp, kNumVHeads / tp};
    const RegionId region = one_region ? first_region : first_region + r;
    const uint64_t offset = one_region ? next_offset : 48 + 16 * r;
    next_offset = offset + layout.total_bytes() + 32;
    s.layouts.push_back(layout);
    s.pools.push_back(state_pool_for(layout, k, v, region, offset));
    std::vector<std::byte>& mem = s.regions[region];
    mem.resize(std::max<size_t>(mem.size(), offset + layout.total_bytes() + 32), kJunk);
  }
  return s;
}

// Calls fn(byte offset in the region, value) for every element of slot `slot` of `side`'s rank `r`,
// the value being that of the element's content in slot `value_slot`.
template <typename Fn>
void for_each_element(const TestSide& side, int r, int slot, int value_slot, Fn&& fn) {
  const RecurrentStateLayout& l = side.layouts[r];
  const KvHeadRange k = side.pools[r].k_heads;
  const KvHeadRange v = side.pools[r].v_heads;
  const uint64_t base = side.pools[r].offset_bytes;
  auto at = [&](int64_t element) { return base + static_cast<uint64_t>(element) * sizeof(float); };
  for (int layer = 0; layer < l.num_layers; ++layer) {
    for (int c = 0; c < l.conv_dim; ++c) {
      // Channels: q rows of the key heads, their k rows, v rows of the value heads.
      int part = 0, head = 0, row = 0;
      if (c < 2 * k.count * kKeyDim) {
        part = c / (k.count * kKeyDim);
        head = k.first + (c % (k.count * kKeyDim)) / kKeyDim;
        row = c % kKeyDim;
      } else {
        part = 2;
        head = v.first + (c - 2 * k.count * kKeyDim) / kValueDim;
        row = (c - 2 * k.count * kKeyDim) % kValueDim;
      }
      for (int col = 0; col < l.conv_width; ++col) {
        fn(at(l.conv_offset(slot, layer) + static_cast<int64_t>(c) * l.conv_width + col),
           element_value(value_slot, layer, part, head, row, col));
      }
    }
    for (int h = 0; h < l.num_heads; ++h) {
      for (int i = 0; i < l.key_dim; ++i) {
        for (int j = 0; j < l.value_dim; ++j) {
          fn(at(l.ssm_offset(slot, layer) +
                (static_cast<int64_t>(h) * l.key_dim + i) * l.value_dim + j),
             element_value(value_slot, layer, 3, v.first + h, i, j));
        }
      }
    }
  }
}

void write_float(std::vector<std::byte>& mem, uint64_t at, float value) {
  ASSERT_LE(at + sizeof(float), mem.size());
  std::memcpy(mem.data() + at, &value, sizeof(float));
}

// Fills every slot of every source pool with its content.
void fill_source(TestSide& src) {
  for (size_t r = 0; r < src.pools.size(); ++r) {
    std::vector<std::byte>& mem = src.regions.at(src.pools[r].region);
    for (int slot = 0; slot < src.pools[r].num_slots; ++slot) {
      for_each_element(src, static_cast<int>(r), slot, slot,
                       [&](uint64_t at, float value) { write_float(mem, at, value); });
    }
  }
}

// Runs `copies` with memcpy, checking each names its ranks' regions, stays inside them, and that no
// destination byte is written twice.
void apply(std::span<const KvCopy> copies, const TestSide& src, TestSide& dst) {
  std::map<RegionId, std::vector<int>> writes;
  for (const auto& [id, mem] : dst.regions) writes[id].assign(mem.size(), 0);
  for (const KvCopy& c : copies) {
    ASSERT_EQ(c.src_region, src.pools.at(c.src_rank).region);
    ASSERT_EQ(c.dst_region, dst.pools.at(c.dst_rank).region);
    const std::vector<std::byte>& from = src.regions.at(c.src_region);
    std::vector<std::byte>& to = dst.regions.at(c.dst_region);
    ASSERT_LE(c.src_offset_bytes + c.bytes, from.size());
    ASSERT_LE(c.dst_offset_bytes + c.bytes, to.size());
    std::memcpy(to.data() + c.dst_offset_bytes, from.data() + c.src_offset_bytes, c.bytes);
    for (uint64_t i = 0; i < c.bytes; ++i) {
      ASSERT_EQ(++writes[c.dst_region][c.dst_offset_bytes + i], 1)
          << "destination region " << c.dst_region << " byte " << c.dst_offset_bytes + i
          << " written twice";
    }
  }
}

// The destination after a correct transfer: junk everywhere but its slot of every rank, which holds
// the source slot's content.
std::map<RegionId, std::vector<std::byte>> expected_destination(const TestSide& dst,
                                                                int32_t src_slot) {
  std::map<RegionId, std::vector<std::byte>> expected = dst.regions;
  for (size_t r = 0; r < dst.pools.size(); ++r) {
    std::vector<std::byte>& mem = expected.at(dst.pools[r].region);
    for_each_element(dst, static_cast<int>(r), dst.slot, src_slot,
                     [&](uint64_t at, float value) { write_float(mem, at, value); });
  }
  return expected;
}

int64_t count_mismatches(const std::map<RegionId, std::vector<std::byte>>& actual,
                         const std::map<RegionId, std::vector<std::byte>>& expected) {
  int64_t mismatches = 0;
  for (const auto& [id, mem] : actual) {
    const std::vector<std::byte>& want = expected.at(id);
    for (size_t i = 0; i < mem.size(); ++i) {
      if (mem[i] != want[i] && ++mismatches <= 3) {
        ADD_FAILURE() << "region " << id << " byte " << i << ": got " << static_cast<int>(mem[i])
                      << ", want " << static_cast<int>(want[i]);
      }
    }
  }
  return mismatches;
}

// Source slot 2 of 3, destination slot 1 of 4.
TestSide source_side(int tp) {
  TestSide s = make_side(tp, 3, 2, 100, false);
  fill_source(s);
  return s;
}
TestSide destination_side(int tp) { return make_side(tp, 4, 1, 200, true); }

using test::expect_error;

class StatePlannerSweep : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(StatePlannerSweep, EveryDestinationElementArrives) {
  const auto [src_tp, dst_tp] = GetParam();
  const TestSide src = source_side(src_tp);
  TestSide dst = destination_side(dst_tp);
  const auto expected = expected_destination(dst, src.slot);
  const std::vector<KvCopy> copies = plan_state_copies(src.side(), dst.side());
  apply(copies, src, dst);
  EXPECT_EQ(count_mismatches(dst.regions, expected), 0);

  // Ordered by source rank; the per-rank plans, concatenated, are the whole plan.
  std::vector<KvCopy> joined;
  for (int r = 0; r < src_tp; ++r) {
    for (const KvCopy& c : plan_state_copies(src.side(), dst.side(), r)) {
      EXPECT_EQ(c.src_rank, r);
      joined.push_back(c);
    }
  }
  ASSERT_EQ(joined.size(), copies.size());
  for (size_t i = 0; i < copies.size(); ++i) {
    EXPECT_EQ(joined[i].src_rank, copies[i].src_rank);
    EXPECT_EQ(joined[i].dst_rank, copies[i].dst_rank);
    EXPECT_EQ(joined[i].src_offset_bytes, copies[i].src_offset_bytes);
    EXPECT_EQ(joined[i].dst_offset_bytes, copies[i].dst_offset_bytes);
    EXPECT_EQ(joined[i].bytes, copies[i].bytes);
  }

  // Merging: a rank pair holding the same heads moves the slot as one copy; otherwise each
  // overlapping pair moves one copy per (layer, part) — its heads of a part are one range.
  size_t want_copies = 0;
  for (const StatePoolDesc& s : src.pools) {
    for (const StatePoolDesc& d : dst.pools) {
      const int lo = std::max(s.k_heads.first, d.k_heads.first);
      const int hi = std::min(s.k_heads.end(), d.k_heads.end());
      if (lo >= hi) continue;
      const bool same = s.k_heads.first == d.k_heads.first && s.k_heads.count == d.k_heads.count;
      want_copies += same ? 1 : kNumLayers * 4;
    }
  }
  EXPECT_EQ(copies.size(), want_copies);
}

INSTANTIATE_TEST_SUITE_P(Shardings, StatePlannerSweep,
                         ::testing::Values(std::tuple{1, 1}, std::tuple{1, 2}, std::tuple{2, 1},
                                           std::tuple{2, 2}, std::tuple{4, 2}, std::tuple{2, 4},
                                           std::tuple{1, 4}, std::tuple{4, 1}, std::tuple{4, 4}),
                         [](const auto& info) {
                           return "Tp" + std::to_string(std::get<0>(info.param)) + "ToTp" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(StatePlanner, EqualShardingMovesEachSlotAsOneCopy) {
  const TestSide src = source_side(2);
  const TestSide dst = destination_side(2);
  const std::vector<KvCopy> copies = plan_state_copies(src.side(), dst.side());
  ASSERT_EQ(copies.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(copies[r].src_rank, r);
    EXPECT_EQ(copies[r].dst_rank, r);
    EXPECT_EQ(copies[r].bytes, src.layouts[r].bytes_per_slot());
    EXPECT_EQ(copies[r].src_offset_bytes,
              src.pools[r].offset_bytes + 2 * src.layouts[r].bytes_per_slot());
    EXPECT_EQ(copies[r].dst_offset_bytes,
              dst.pools[r].offset_bytes + 1 * dst.layouts[r].bytes_per_slot());
  }
}

TEST(StatePlanner, ReplicasSendFromTheFirstHolder) {
  // Two source ranks each hold the whole model: rank 0 sends everything, rank 1 nothing.
  TestSide src = source_side(1);
  src.pools.push_back(src.pools[0]);
  src.pools[1].region = 101;
  src.layouts.push_back(src.layouts[0]);
  src.regions[101] = src.regions.at(100);
  TestSide dst = destination_side(2);
  const auto expected = expected_destination(dst, src.slot);
  const std::vector<KvCopy> copies = plan_state_copies(src.side(), dst.side());
  for (const KvCopy& c : copies) EXPECT_EQ(c.src_rank, 0);
  EXPECT_TRUE(plan_state_copies(src.side(), dst.side(), 1).empty());
  apply(copies, src, dst);
  EXPECT_EQ(count_mismatches(dst.regions, expected), 0);
}

TEST(StatePool, OffsetsMatchRecurrentStateLayout) {
  // TP rank 1 of 2: key heads [2, 4), value heads [4, 8), at byte 64 of region 9.
  const RecurrentStateLayout l = tp_layout(2, 3);
  const StatePoolDesc p = state_pool_for(l, {2, 2}, {4, 4}, 9, 64);
  EXPECT_EQ(p.conv_dim(), l.conv_dim);
  EXPECT_EQ(p.layer_stride_bytes(), static_cast<uint64_t>(l.layer_stride()) * sizeof(float));
  EXPECT_EQ(p.slot_stride_bytes(), l.bytes_per_slot());
  auto bytes = [](int64_t elements) { return 64 + static_cast<uint64_t>(elements) * 4; };
  for (int slot = 0; slot < 3; ++slot) {
    for (int layer = 0; layer < kNumLayers; ++layer) {
      const int64_t conv = l.conv_offset(slot, layer);
      EXPECT_EQ(p.head_offset_bytes(slot, layer, StatePart::ConvQ, 3),
                bytes(conv + 1 * kKeyDim * kConvWidth));
      EXPECT_EQ(p.head_offset_bytes(slot, layer, StatePart::ConvK, 2),
                bytes(conv + 2 * kKeyDim * kConvWidth));
      EXPECT_EQ(p.head_offset_bytes(slot, layer, StatePart::ConvV, 5),
                bytes(conv + (4 * kKeyDim + kValueDim) * kConvWidth));
      EXPECT_EQ(p.head_offset_bytes(slot, layer, StatePart::Ssm, 6),
                bytes(l.ssm_offset(slot, layer) + 2 * kKeyDim * kValueDim));
    }
  }
  EXPECT_EQ(p.head_bytes(StatePart::ConvQ), uint64_t{kKeyDim * kConvWidth * 4});
  EXPECT_EQ(p.head_bytes(StatePart::ConvV), uint64_t{kValueDim * kConvWidth * 4});
  EXPECT_EQ(p.head_bytes(StatePart::Ssm), uint64_t{kKeyDim * kValueDim * 4});
}

TEST(StatePool, StatePoolForChecksTheLayout) {
  RecurrentStateLayout l = tp_layout(2, 3);
  expect_error([&] { state_pool_for(l, {0, 2}, {0, 2}, 1, 0); }, "num_heads 4 differs");
  l.conv_dim += 1;
  expect_error([&] { state_pool_for(l, {0, 2}, {0, 4}, 1, 0); }, "conv_dim 33 differs");
}

TEST(StatePool, JsonRoundTripAndValidation) {
  const StatePoolDesc p = state_pool_for(tp_layout(4, 5), {3, 1}, {6, 2}, 1ull << 40, 4096);
  const nlohmann::json j = p;
  const StatePoolDesc q = parse_json(j.dump(), "state pool").get<StatePoolDesc>();
  EXPECT_EQ(q.num_layers, kNumLayers);
  EXPECT_EQ(q.num_slots, 5);
  EXPECT_EQ(q.conv_width, kConvWidth);
  EXPECT_EQ(q.key_dim, kKeyDim);
  EXPECT_EQ(q.value_dim, kValueDim);
  EXPECT_EQ(q.elem_bytes, 4);
  EXPECT_EQ(q.k_heads.first, 3);
  EXPECT_EQ(q.k_heads.count, 1);
  EXPECT_EQ(q.v_heads.first, 6);
  EXPECT_EQ(q.v_heads.count, 2);
  EXPECT_EQ(q.region, 1ull << 40);
  EXPECT_EQ(q.offset_bytes, 4096u);

  for (const char* key :
       {"num_layers", "num_slots", "conv_width", "key_dim", "value_dim", "elem_bytes",
        "first_k_head", "num_k_heads", "first_v_head", "num_v_heads", "region", "offset_bytes"}) {
    nlohmann::json missing = j;
    missing.erase(key);
    expect_error([&] { (void)missing.get<StatePoolDesc>(); },
                 str("state pool descriptor field '", key, "'"));
  }
  nlohmann::json wide = j;
  wide["num_slots"] = int64_t{1} << 40;
  expect_error([&] { (void)wide.get<StatePoolDesc>(); }, "'num_slots' must be a 32-bit integer");
  nlohmann::json negative = j;
  negative["region"] = -1;
  expect_error([&] { (void)negative.get<StatePoolDesc>(); }, "'region' must be a non-negative");
  nlohmann::json zero = j;
  zero["conv_width"] = 0;
  expect_error([&] { (void)zero.get<StatePoolDesc>(); }, "conv_width 0");
  nlohmann::json empty = j;
  empty["num_k_heads"] = 0;
  expect_error([&] { (void)empty.get<StatePoolDesc>(); }, "key heads (first 3, count 0) are empty");
  nlohmann::json odd = j;
  odd["num_k_heads"] = 2;
  odd["num_v_heads"] = 3;
  expect_error([&] { (void)odd.get<StatePoolDesc>(); },
               "3 value heads are not a multiple of its 2");
  nlohmann::json shifted = j;
  shifted["first_v_head"] = 4;
  expect_error([&] { (void)shifted.get<StatePoolDesc>(); }, "are not the readers of its key heads");
  nlohmann::json huge = j;
  huge["offset_bytes"] = std::numeric_limits<uint64_t>::max() - 10;
  expect_error([&] { (void)huge.get<StatePoolDesc>(); }, "overflows 64 bits");
  nlohmann::json dims = j;
  dims["key_dim"] = 1 << 30;
  dims["value_dim"] = 1 << 30;
  dims["num_v_heads"] = 1 << 20;
  dims["num_k_heads"] = 1 << 19;
  dims["first_k_head"] = 0;
  dims["first_v_head"] = 0;
  expect_error([&] { (void)dims.get<StatePoolDesc>(); }, "overflows 64 bits");
  expect_error([] { (void)nlohmann::json::array().get<StatePoolDesc>(); }, "JSON object");
}

TEST(StatePlanner, RejectsInconsistentInputs) {
  const TestSide src = source_side(2);
  const TestSide dst = destination_side(1);
  // Only rank 0 of TP 2: key heads [0, 2).
  StateTransferSide half = src.side();
  half.ranks = half.ranks.subspan(0, 1);
  expect_error([&] { plan_state_copies(half, dst.side()); },
               "destination rank 0 needs key head 2, which no source rank holds");

  StateTransferSide bad_slot = src.side();
  bad_slot.slot = 3;
  expect_error([&] { plan_state_copies(bad_slot, dst.side()); },
               "source slot 3 is outside rank 0's pool of 3 slots");
  StateTransferSide no_slot = dst.side();
  no_slot.slot = -1;
  expect_error([&] { plan_state_copies(src.side(), no_slot); }, "destination slot -1 is outside");

  expect_error([&] { plan_state_copies(src.side(), dst.side(), 2); },
               "state copy source rank 2 is outside the source side's 2 ranks");

  // A destination model of 8 key and 16 value heads (its pools are still consistent with it).
  StateTransferSide bigger = dst.side();
  bigger.num_k_heads = 8;
  bigger.num_v_heads = 16;
  expect_error([&] { plan_state_copies(src.side(), bigger); },
               "source has 4 key and 8 value heads, destination 8 and 16");
  StateTransferSide ratio = dst.side();
  ratio.num_v_heads = 16;
  expect_error([&] { plan_state_copies(src.side(), ratio); },
               "destination rank 0 holds 8 value heads for its 4 key heads; the model has 4");
  StateTransferSide narrow = dst.side();
  narrow.num_k_heads = 2;
  narrow.num_v_heads = 4;
  expect_error([&] { plan_state_copies(src.side(), narrow); }, "beyond the model's 2 and 4");
  StateTransferSide odd = dst.side();
  odd.num_v_heads = 6;
  expect_error([&] { plan_state_copies(src.side(), odd); },
               "value heads must be a positive multiple of the key heads");

  for (int field = 0; field < 5; ++field) {
    std::vector<StatePoolDesc> other = dst.pools;
    int* value[] = {&other[0].num_layers, &other[0].conv_width, &other[0].key_dim,
                    &other[0].value_dim, &other[0].elem_bytes};
    *value[field] += 1;
    expect_error(
        [&] {
          plan_state_copies(src.side(), {kNumKHeads, kNumVHeads, other, 1});
        },
        "does not match destination");
  }
  std::vector<StatePoolDesc> mixed = src.pools;
  mixed[1].num_layers = 3;
  expect_error(
      [&] {
        plan_state_copies({kNumKHeads, kNumVHeads, mixed, 2}, dst.side());
      },
      "source rank 1 (layers 3");
  StateTransferSide none = dst.side();
  none.ranks = {};
  expect_error([&] { plan_state_copies(src.side(), none); }, "destination side has no ranks");
}

}  // namespace
}  // namespace relay

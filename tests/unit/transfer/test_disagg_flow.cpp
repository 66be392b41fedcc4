// The hand-off as the roles will run it, inside one process: one transfer engine per prefill TP
// rank and one for the decode rank. The decode side announces its pool descriptor and its region
// descriptor as JSON; each prefill rank imports the region, plans only its own share of the copies
// and submits it from its own thread; the decode pool must then hold exactly the prompt's KV.
// Also: a descriptor that claims more memory than was registered yields copies the engine rejects,
// leaving the destination untouched.
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "kv_test_pools.h"
#include "transfer/in_process_transport.h"
#include "transfer/layout_mapper.h"
#include "transfer/transfer_engine.h"

namespace relay {
namespace {

using test::PoolMemory;

constexpr int kLayers = 3;
constexpr int kKvHeads = 4;
constexpr int kHeadDim = 16;
constexpr int kElemBytes = 2;

std::vector<int32_t> even_ids(int entries, std::mt19937& rng) {
  std::vector<int32_t> ids(entries);
  for (int i = 0; i < entries; ++i) ids[i] = 2 * i;
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

TEST(DisaggFlow, EachPrefillRankPushesItsShareThroughItsOwnEngine) {
  for (int tp : {2, 8}) {
    SCOPED_TRACE(testing::Message() << "prefill TP " << tp);
    constexpr int kTokens = 77;
    constexpr int kSrcBlockSize = 16;
    constexpr int kDstBlockSize = 32;
    std::mt19937 rng(tp);
    const std::vector<int32_t> src_table = even_ids(5, rng);
    const std::vector<int32_t> dst_table = even_ids(3, rng);

    // Decode worker: registers its pool and announces both descriptors as JSON.
    const KvPoolDesc dst_desc =
        contiguous_kv_pool(kLayers, 8, kDstBlockSize, kHeadDim, kElemBytes, {0, kKvHeads}, 900);
    PoolMemory dst_pool(dst_desc, std::byte{0});
    TransferEngine decode_engine(make_in_process_transport());
    std::vector<std::byte>& dst_mem = dst_pool.regions.at(900);
    const nlohmann::json announcement = {
        {"kv_pool", dst_desc},
        {"regions", {decode_engine.register_region(900, dst_mem.data(), dst_mem.size())}}};
    const std::string wire = announcement.dump();

    // Prefill ranks: each parses the announcement, imports the region, plans its share, submits.
    std::vector<KvPoolDesc> src_descs;
    std::vector<PoolMemory> src_pools;
    for (int r = 0; r < tp; ++r) {
      src_descs.push_back(contiguous_kv_pool(kLayers, 10, kSrcBlockSize, kHeadDim, kElemBytes,
                                             tp_kv_head_range(kKvHeads, tp, r), 100 + r));
      src_pools.emplace_back(src_descs.back(), test::kSourceJunk);
      src_pools.back().write_pattern(src_table, 0, kTokens, 0, kLayers);
    }
    std::vector<TransferResult> results(tp);  // each rank thread writes its own entry
    std::vector<std::thread> ranks;
    ranks.reserve(tp);
    for (int r = 0; r < tp; ++r) {
      ranks.emplace_back([&, r] {
        const nlohmann::json received = nlohmann::json::parse(wire);
        const std::vector<KvPoolDesc> dst = {received.at("kv_pool").get<KvPoolDesc>()};
        TransferEngine engine(make_in_process_transport());
        std::vector<std::byte>& mem = src_pools[r].regions.at(100 + r);
        engine.register_region(100 + r, mem.data(), mem.size());
        for (const auto& region : received.at("regions")) {
          engine.import_region(region.get<RegionDescriptor>());
        }
        const std::vector<KvCopy> copies =
            plan_kv_copies({kKvHeads, src_descs, src_table}, {kKvHeads, dst, dst_table},
                           {.token_begin = 0, .token_end = kTokens, .src_rank = r});
        results[r] = engine.submit({r, transfer_copies(copies), {}}).get();
      });
    }
    for (auto& t : ranks) t.join();
    for (int r = 0; r < tp; ++r) {
      EXPECT_EQ(results[r].status, TransferStatus::Ok) << "rank " << r << ": " << results[r].reason;
    }
    PoolMemory expected(dst_desc, std::byte{0});
    expected.write_pattern(dst_table, 0, kTokens, 0, kLayers);
    EXPECT_TRUE(dst_pool.regions == expected.regions);
  }
}

TEST(DisaggFlow, DescriptorLargerThanRegisteredMemoryIsRejected) {
  // The decode pool claims 8 blocks but only 4 blocks' worth of bytes were registered: copies into
  // block 6 fall outside the region and the whole request fails before any byte moves.
  const KvPoolDesc src_desc =
      contiguous_kv_pool(kLayers, 8, 16, kHeadDim, kElemBytes, {0, kKvHeads}, 100);
  const KvPoolDesc dst_desc =
      contiguous_kv_pool(kLayers, 8, 16, kHeadDim, kElemBytes, {0, kKvHeads}, 900);
  PoolMemory src_pool(src_desc, test::kSourceJunk);
  PoolMemory dst_pool(dst_desc, std::byte{0});
  TransferEngine engine(make_in_process_transport());
  std::vector<std::byte>& src_mem = src_pool.regions.at(100);
  std::vector<std::byte>& dst_mem = dst_pool.regions.at(900);
  engine.register_region(100, src_mem.data(), src_mem.size());
  engine.register_region(900, dst_mem.data(), dst_mem.size() / 2);
  const std::vector<KvPoolDesc> src = {src_desc};
  const std::vector<KvPoolDesc> dst = {dst_desc};
  const std::vector<int32_t> src_table = {0, 1};
  const std::vector<int32_t> dst_table = {1, 6};
  const std::vector<KvCopy> copies = plan_kv_copies(
      {kKvHeads, src, src_table}, {kKvHeads, dst, dst_table}, {.token_begin = 0, .token_end = 32});
  const TransferResult r = engine.submit({1, transfer_copies(copies), {}}).get();
  EXPECT_EQ(r.status, TransferStatus::Failed);
  EXPECT_NE(r.reason.find("exceeds region 900"), std::string::npos) << r.reason;
  for (std::byte b : dst_mem) ASSERT_EQ(b, std::byte{0});
}

}  // namespace
}  // namespace relay

// The mapper and the in-process engine at a real model's shape: Qwen3-30B-A3B's KV (48 layers, 4 KV
// heads of 128 dims, bf16) from prefill TP 4 and TP 8 to one decode rank. Copy counts are checked
// exactly, the moved bytes fully, and the planning time and copy bandwidth are printed as
// "[ measure ]" lines (indicative only: CI shares two cores).
#include <gtest/gtest.h>

#include <time.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>

#include "kv_test_pools.h"
#include "transfer/in_process_transport.h"
#include "transfer/layout_mapper.h"
#include "transfer/transfer_engine.h"

namespace relay {
namespace {

using test::PoolMemory;
using Clock = std::chrono::steady_clock;

constexpr int kLayers = 48;
constexpr int kKvHeads = 4;
constexpr int kHeadDim = 128;
constexpr int kElemBytes = 2;
constexpr int kBlockSize = 16;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// CPU time of the calling thread: steadier than wall time on a machine shared with builds.
double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

std::vector<KvPoolDesc> tp_pools(int tp, int num_blocks, int block_size, RegionId first_region) {
  std::vector<KvPoolDesc> out;
  out.reserve(tp);
  for (int r = 0; r < tp; ++r) {
    out.push_back(contiguous_kv_pool(kLayers, num_blocks, block_size, kHeadDim, kElemBytes,
                                     tp_kv_head_range(kKvHeads, tp, r), first_region + r));
  }
  return out;
}

// Even block ids in random order: no two entries adjacent, so nothing merges across blocks.
std::vector<int32_t> spread_table(int entries, std::mt19937& rng) {
  std::vector<int32_t> ids(entries);
  for (int i = 0; i < entries; ++i) ids[i] = 2 * i;
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

TEST(Qwen3Shape, PlanFor6000TokenPrompt) {
  constexpr int kTokens = 6000;
  constexpr int kBlocks = kTokens / kBlockSize;  // 375, all full
  std::mt19937 rng(1);
  const std::vector<int32_t> src_table = spread_table(kBlocks, rng);
  const std::vector<int32_t> dst_table = spread_table(kBlocks, rng);
  const std::vector<KvPoolDesc> dst = tp_pools(1, 2 * kBlocks, kBlockSize, 900);
  for (int tp : {4, 8}) {
    const std::vector<KvPoolDesc> src = tp_pools(tp, 2 * kBlocks, kBlockSize, 100);
    const double start_ms = thread_cpu_ms();
    const std::vector<KvCopy> copies =
        plan_kv_copies({kKvHeads, src, src_table}, {kKvHeads, dst, dst_table},
                       {.token_begin = 0, .token_end = kTokens});
    const double plan_ms = thread_cpu_ms() - start_ms;
    // One copy per (layer, K/V, block, sending rank); 4 ranks send in both cases.
    EXPECT_EQ(copies.size(), static_cast<size_t>(kLayers * 2 * kBlocks * 4));
    uint64_t bytes = 0;
    for (const KvCopy& c : copies) bytes += c.bytes;
    EXPECT_EQ(bytes, uint64_t{kTokens} * kLayers * 2 * kKvHeads * kHeadDim * kElemBytes);
    std::printf(
        "[ measure  ] plan TP %d -> DP, %d tokens, 48 layers: %zu copies, %.1f MB, %.2f ms CPU\n",
        tp, kTokens, copies.size(), bytes / 1e6, plan_ms);
  }
  // A fresh pool hands out consecutive blocks: with TP 1 and consecutive tables on both sides, each
  // layer's K and each layer's V moves as one copy.
  std::vector<int32_t> identity(kBlocks);
  std::iota(identity.begin(), identity.end(), 0);
  const std::vector<KvPoolDesc> src1 = tp_pools(1, 2 * kBlocks, kBlockSize, 100);
  EXPECT_EQ(plan_kv_copies({kKvHeads, src1, identity}, {kKvHeads, dst, identity},
                           {.token_begin = 0, .token_end = kTokens})
                .size(),
            static_cast<size_t>(kLayers * 2));
}

TEST(Qwen3Shape, MoveAndVerify) {
  constexpr int kTokens = 250;  // 15 full blocks and a partial one
  constexpr int kSrcBlocks = (kTokens + kBlockSize - 1) / kBlockSize;
  constexpr int kDstBlockSize = 32;
  constexpr int kDstBlocks = (kTokens + kDstBlockSize - 1) / kDstBlockSize;
  std::mt19937 rng(2);
  const std::vector<int32_t> src_table = spread_table(kSrcBlocks, rng);
  const std::vector<int32_t> dst_table = spread_table(kDstBlocks, rng);
  const std::vector<KvPoolDesc> src = tp_pools(4, 2 * kSrcBlocks, kBlockSize, 100);
  const std::vector<KvPoolDesc> dst = tp_pools(1, 2 * kDstBlocks, kDstBlockSize, 900);
  std::vector<PoolMemory> src_pools;
  for (const KvPoolDesc& d : src) {
    src_pools.emplace_back(d, test::kSourceJunk);
    src_pools.back().write_pattern(src_table, 0, kTokens, 0, kLayers);
  }
  PoolMemory dst_pool(dst[0], std::byte{0});
  PoolMemory expected(dst[0], std::byte{0});
  expected.write_pattern(dst_table, 0, kTokens, 0, kLayers);

  const std::vector<KvCopy> copies =
      plan_kv_copies({kKvHeads, src, src_table}, {kKvHeads, dst, dst_table},
                     {.token_begin = 0, .token_end = kTokens});
  TransferEngine engine(make_in_process_transport());
  for (PoolMemory* pool : {&src_pools[0], &src_pools[1], &src_pools[2], &src_pools[3], &dst_pool}) {
    for (auto& [id, mem] : pool->regions) engine.register_region(id, mem.data(), mem.size());
  }
  const Clock::time_point start = Clock::now();
  const TransferResult r = engine.submit({1, transfer_copies(copies), {}}).get();
  const double copy_ms = ms_since(start);
  ASSERT_EQ(r.status, TransferStatus::Ok) << r.reason;
  EXPECT_EQ(r.bytes_copied, uint64_t{kTokens} * kLayers * 2 * kKvHeads * kHeadDim * kElemBytes);
  EXPECT_TRUE(dst_pool.regions == expected.regions);
  std::printf(
      "[ measure  ] in-process TP 4 -> DP, blocks 16 -> 32, %d tokens: %zu copies, %.1f MB "
      "in %.2f ms (%.2f GB/s)\n",
      kTokens, copies.size(), r.bytes_copied / 1e6, copy_ms, r.bytes_copied / copy_ms / 1e6);
}

}  // namespace
}  // namespace relay

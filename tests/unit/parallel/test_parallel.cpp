// The shared-memory communicator (every collective across thread ranks, abort and timeout) and the
// shard plans (which heads, KV heads, widths and experts each rank holds, and the refusals).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "core/error.h"
#include "model/shard.h"
#include "parallel/local_group.h"
#include "parallel/parallel_config.h"

namespace relay::parallel {
namespace {

// Runs fn(rank) on one thread per rank and returns how many threw relay::Error.
template <typename Fn>
int run_ranks(std::vector<std::unique_ptr<Communicator>>& comms, Fn fn) {
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (auto& c : comms) {
    threads.emplace_back([&, comm = c.get()] {
      try {
        fn(*comm);
      } catch (const Error&) {
        ++errors;
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(LocalGroup, AllReduceGivesEveryRankTheSameSumInRankOrder) {
  for (int size : {1, 2, 3, 4}) {
    auto comms = make_local_group(size);
    std::vector<std::vector<float>> results(size);
    EXPECT_EQ(run_ranks(comms,
                        [&](Communicator& c) {
                          for (int round = 0; round < 50;
                               ++round) {  // back-to-back calls reuse the buffers
                            std::vector<float> v(37);
                            for (size_t i = 0; i < v.size(); ++i)
                              v[i] = 0.1f * (c.rank() + 1) + 1e-3f * i + round;
                            c.all_reduce_sum(v.data(), v.size());
                            if (round == 49) results[c.rank()] = v;
                          }
                        }),
              0);
    for (size_t i = 0; i < 37; ++i) {
      float want = 0.0f;
      for (int r = 0; r < size; ++r) want += 0.1f * (r + 1) + 1e-3f * i + 49;
      for (int r = 0; r < size; ++r)
        EXPECT_EQ(results[r][i], want) << "size " << size << " rank " << r;
    }
  }
}

TEST(LocalGroup, AllToAllDeliversEachPairItsOwnSizedMessage) {
  const int size = 3;
  auto comms = make_local_group(size);
  std::vector<std::vector<std::vector<float>>> got(size);
  std::vector<std::vector<std::vector<int32_t>>> got_ids(size);
  EXPECT_EQ(run_ranks(comms,
                      [&](Communicator& c) {
                        std::vector<std::vector<float>> send(size);
                        std::vector<std::vector<int32_t>> ids(size);
                        for (int d = 0; d < size; ++d) {
                          for (int i = 0; i < c.rank() + d; ++i)
                            send[d].push_back(100.0f * c.rank() + d + 0.5f * i);
                          ids[d].assign(d, c.rank());
                        }
                        c.all_to_all(std::span<const std::vector<float>>(send), got[c.rank()]);
                        c.all_to_all(std::span<const std::vector<int32_t>>(ids), got_ids[c.rank()]);
                      }),
            0);
  for (int r = 0; r < size; ++r) {
    ASSERT_EQ(got[r].size(), static_cast<size_t>(size));
    for (int s = 0; s < size; ++s) {
      ASSERT_EQ(got[r][s].size(), static_cast<size_t>(s + r)) << "to " << r << " from " << s;
      for (int i = 0; i < s + r; ++i) EXPECT_EQ(got[r][s][i], 100.0f * s + r + 0.5f * i);
      EXPECT_EQ(got_ids[r][s], std::vector<int32_t>(r, s));
    }
  }
}

TEST(LocalGroup, AbortReleasesWaitingRanksAndResetRearms) {
  auto comms = make_local_group(3);
  // Rank 2 fails before the collective; the others must not wait for it forever.
  EXPECT_EQ(run_ranks(comms,
                      [&](Communicator& c) {
                        if (c.rank() == 2) {
                          c.abort();
                          fail("rank 2 failed");
                        }
                        float x = 1.0f;
                        c.all_reduce_sum(&x, 1);
                      }),
            3);
  comms[0]->reset();
  EXPECT_EQ(run_ranks(comms,
                      [&](Communicator& c) {
                        float x = 1.0f;
                        c.all_reduce_sum(&x, 1);
                        if (x != 3.0f) fail("wrong sum");
                      }),
            0);
}

TEST(LocalGroup, AMissingRankTimesOutWithAMessage) {
  auto comms = make_local_group(2, std::chrono::milliseconds(50));
  try {
    comms[0]->barrier();  // rank 1 never comes
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("did not reach the collective"), std::string::npos)
        << e.what();
  }
}

TEST(LocalGroup, MismatchedAllReduceCountsAreAnError) {
  auto comms = make_local_group(2);
  EXPECT_EQ(run_ranks(comms,
                      [&](Communicator& c) {
                        std::vector<float> v(c.rank() == 0 ? 4 : 5, 1.0f);
                        c.all_reduce_sum(v.data(), v.size());
                      }),
            2);
}

TEST(ParallelConfig, ValidatesTheSupportedLayouts) {
  EXPECT_NO_THROW((ParallelConfig{4, 4, 1}.validate()));
  EXPECT_NO_THROW((ParallelConfig{1, 8, 8}.validate()));
  EXPECT_NO_THROW((ParallelConfig{2, 1, 1}.validate()));
  EXPECT_NO_THROW((ParallelConfig{1, 1, 2}.validate()));
  EXPECT_THROW((ParallelConfig{0, 1, 1}.validate()), Error);
  EXPECT_THROW((ParallelConfig{2, 4, 1}.validate()), Error);  // ep must be 1 or tp x dp
  EXPECT_THROW((ParallelConfig{2, 4, 2}.validate()), Error);  // tp inside DP groups
  const RankPlace p = place_rank({1, 4, 4}, 3);
  EXPECT_EQ(p.dp_rank, 3);
  EXPECT_EQ(p.ep_rank, 3);
  EXPECT_EQ(p.tp_rank, 0);
}

ModelConfig moe_config(int q_heads, int kv_heads, int experts, int moe_width) {
  ModelConfig c;
  c.architecture = "Qwen3MoeForCausalLM";
  c.hidden_size = 256;
  c.num_hidden_layers = 2;
  c.num_attention_heads = q_heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 64;
  c.intermediate_size = 512;
  c.num_experts = experts;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = moe_width;
  return c;
}

TEST(ShardPlan, SplitsHeadsAndReplicatesKvHeadsPastTheirCount) {
  const ModelConfig c = moe_config(32, 4, 128, 768);  // Qwen3-30B-A3B's heads and experts
  for (int tp : {1, 2, 4, 8}) {
    auto comms = make_local_group(tp);
    for (int r = 0; r < tp; ++r) {
      const ShardSpec s =
          make_shard(c, ParallelConfig{tp, 1, 1}, r, tp > 1 ? comms[r].get() : nullptr);
      EXPECT_EQ(s.num_local_q_heads, 32 / tp);
      EXPECT_EQ(s.q_head_begin, r * 32 / tp);
      EXPECT_EQ(s.num_local_kv_heads, std::max(1, 4 / tp)) << "tp " << tp;
      // The KV head every local q head reads (q head h reads KV head h / 8).
      EXPECT_EQ(s.kv_head_begin, s.q_head_begin / 8) << "tp " << tp << " rank " << r;
      EXPECT_EQ(s.num_local_moe_width, 768 / tp);  // ep = 1: experts split by width
      EXPECT_EQ(s.num_local_experts, 128);
    }
  }
}

TEST(ShardPlan, DividesExpertsAcrossEpRanks) {
  const ModelConfig c = moe_config(64, 4, 128, 1536);
  auto comms = make_local_group(8);
  for (int r = 0; r < 8; ++r) {
    const ShardSpec dp = make_shard(c, ParallelConfig{1, 8, 8}, r, comms[r].get());
    EXPECT_EQ(dp.num_local_experts, 16);
    EXPECT_EQ(dp.expert_begin, 16 * r);
    EXPECT_TRUE(dp.dispatch_tokens);
    EXPECT_EQ(dp.num_local_q_heads, 64);  // DP attention: whole heads on every rank
    EXPECT_EQ(dp.tp_comm, nullptr);
    EXPECT_EQ(dp.num_local_moe_width, 1536);
  }
  auto four = make_local_group(4);
  const ShardSpec tp_ep = make_shard(c, ParallelConfig{4, 4, 1}, 1, four[1].get());
  EXPECT_FALSE(tp_ep.dispatch_tokens);
  EXPECT_EQ(tp_ep.expert_begin, 32);
  EXPECT_EQ(tp_ep.num_local_kv_heads, 1);
  EXPECT_EQ(tp_ep.kv_head_begin, 1);
}

TEST(ShardPlan, RefusalsNameTheField) {
  auto message = [&](const ModelConfig& c, ParallelConfig p) {
    try {
      auto comms = make_local_group(p.world_size());
      make_shard(c, p, 0, comms[0].get());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(moe_config(32, 4, 128, 768), {3, 1, 1}).find("num_attention_heads"),
            std::string::npos);
  EXPECT_NE(message(moe_config(24, 6, 128, 768), {4, 1, 1}).find("num_key_value_heads"),
            std::string::npos);
  EXPECT_NE(message(moe_config(32, 4, 100, 768), {1, 8, 8}).find("num_experts"), std::string::npos);
  EXPECT_NE(message(moe_config(32, 4, 128, 100), {8, 1, 1}).find("moe_intermediate_size"),
            std::string::npos);
}

}  // namespace
}  // namespace relay::parallel

// The cross-process communicator (parallel/tcp_group.h). Each "process" is a thread with its own
// TcpBootstrap on 127.0.0.1 and its own make_tcp_group; its ranks run on further threads. Checks:
// every collective against the thread group bit for bit, buffers large enough to deadlock a
// blocking implementation, the out-of-step and count errors, abort cascading across processes,
// reset, and the timeout.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "core/error.h"
#include "parallel/local_group.h"
#include "parallel/tcp_bootstrap.h"
#include "parallel/tcp_group.h"
#include "../free_port.h"

namespace relay::parallel {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Comms = std::vector<std::unique_ptr<Communicator>>;
using Layout = std::vector<int>;  // ranks hosted by each process

using test::free_port;

int world_of(const Layout& layout) { return std::accumulate(layout.begin(), layout.end(), 0); }

// Runs fn(comm) on one thread per communicator; returns the relay::Error messages by position.
template <typename Fn>
std::vector<std::string> run_ranks(Comms& comms, Fn fn) {
  std::vector<std::string> errors(comms.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < comms.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        fn(*comms[i]);
      } catch (const Error& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Runs body(process, comms) on one thread per process of `layout`, each with its own bootstrap and
// group; expects no process-level error.
template <typename Body>
void run_processes(const Layout& layout, std::chrono::milliseconds timeout, Body body) {
  const DistInitAddress addr{"127.0.0.1", free_port()};
  const int num_processes = static_cast<int>(layout.size());
  std::vector<std::string> errors(num_processes);
  std::vector<std::thread> threads;
  for (int p = 0; p < num_processes; ++p) {
    threads.emplace_back([&, p] {
      try {
        TcpBootstrap boot(addr, p, num_processes, 10s);
        const int first = std::accumulate(layout.begin(), layout.begin() + p, 0);
        Comms comms = make_tcp_group(boot, first, layout[p], world_of(layout), timeout);
        EXPECT_EQ(comms.size(), static_cast<size_t>(layout[p]));
        for (int i = 0; i < layout[p]; ++i) {
          EXPECT_EQ(comms[i]->rank(), first + i);
          EXPECT_EQ(comms[i]->size(), world_of(layout));
        }
        body(p, comms);
      } catch (const Error& e) {
        errors[p] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int p = 0; p < num_processes; ++p) EXPECT_EQ(errors[p], "") << "process " << p;
}

// fn(comm) on every rank of `layout`; returns the relay::Error messages by global rank.
template <typename Fn>
std::vector<std::string> run_tcp_group(const Layout& layout, Fn fn,
                                       std::chrono::milliseconds timeout = 10s) {
  std::vector<std::string> errors(world_of(layout));
  run_processes(layout, timeout, [&](int, Comms& comms) {
    const auto mine = run_ranks(comms, fn);
    for (size_t i = 0; i < comms.size(); ++i) errors[comms[i]->rank()] = mine[i];
  });
  return errors;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(TcpGroup, AllReduceIsBitIdenticalToTheLocalGroupOnEveryRank) {
  // Many calls in a row: empty, one value, odd sizes, sizes across the sum's 4096-value chunks.
  const std::vector<size_t> counts = {0, 1, 7, 1000, 4097, 12345, 1, 0, 33, 8191};
  for (const Layout& layout : {Layout{2, 2}, Layout{1, 1, 1}, Layout{3}, Layout{1}}) {
    const int world = world_of(layout);
    // inputs[call][rank]: values of mixed magnitudes, so the order of the additions shows.
    std::mt19937 rng(1234 + world);
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-20, 20);
    std::vector<std::vector<std::vector<float>>> inputs(counts.size());
    for (size_t c = 0; c < counts.size(); ++c) {
      inputs[c].resize(world);
      for (auto& v : inputs[c]) {
        v.resize(counts[c]);
        for (float& x : v) x = std::ldexp(mantissa(rng), exponent(rng));
      }
    }
    const auto run = [&](Communicator& comm, std::vector<std::vector<std::vector<float>>>& out) {
      for (size_t c = 0; c < counts.size(); ++c) {
        std::vector<float> v = inputs[c][comm.rank()];
        comm.all_reduce_sum(v.data(), v.size());
        out[c][comm.rank()] = std::move(v);
      }
    };
    std::vector<std::vector<std::vector<float>>> tcp(counts.size()), local(counts.size());
    for (size_t c = 0; c < counts.size(); ++c) tcp[c].resize(world), local[c].resize(world);
    const auto tcp_errors = run_tcp_group(layout, [&](Communicator& comm) { run(comm, tcp); });
    Comms thread_group = make_local_group(world);
    const auto local_errors =
        run_ranks(thread_group, [&](Communicator& comm) { run(comm, local); });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(tcp_errors[r], "") << "rank " << r;
      EXPECT_EQ(local_errors[r], "") << "rank " << r;
    }
    for (size_t c = 0; c < counts.size(); ++c)
      for (int r = 0; r < world; ++r)
        EXPECT_TRUE(same_bits(tcp[c][r], local[c][0]))
            << "layout of " << layout.size() << " processes, call " << c << ", rank " << r;
  }
}

TEST(TcpGroup, LargeAllReduceDoesNotDeadlock) {
  // 32 MiB per rank, sent to each of 3 peers at once: far beyond any socket buffer.
  constexpr size_t kCount = size_t{8} << 20;
  const Layout layout{2, 2};
  const int world = world_of(layout);
  const auto value = [](int rank, size_t i) {
    return static_cast<float>((i * 7 + rank * 13) % 1001) * 0.001f + static_cast<float>(rank);
  };
  std::vector<float> want(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    want[i] = value(0, i);
    for (int r = 1; r < world; ++r) want[i] += value(r, i);
  }
  std::atomic<int> correct{0};
  const auto errors = run_tcp_group(layout, [&](Communicator& comm) {
    std::vector<float> v(kCount);
    for (size_t i = 0; i < kCount; ++i) v[i] = value(comm.rank(), i);
    comm.all_reduce_sum(v.data(), v.size());
    if (same_bits(v, want)) ++correct;
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(correct.load(), world);
}

TEST(TcpGroup, AllToAllDeliversPerPairSizesIncludingZero) {
  for (const Layout& layout : {Layout{2, 2}, Layout{1, 1, 1}, Layout{3}}) {
    const int world = world_of(layout);
    // Rank s sends (s * 3 + d) % 4 values to rank d: zeros included, to itself too.
    const auto count = [](int s, int d) { return static_cast<size_t>((s * 3 + d) % 4); };
    const auto errors = run_tcp_group(layout, [&](Communicator& comm) {
      const int me = comm.rank();
      for (int round = 0; round < 3; ++round) {
        std::vector<std::vector<float>> send_f(world), recv_f;
        std::vector<std::vector<int32_t>> send_i(world), recv_i;
        for (int d = 0; d < world; ++d) {
          for (size_t i = 0; i < count(me, d); ++i) {
            send_f[d].push_back(1000.0f * me + 10.0f * d + i + 0.5f * round);
            send_i[d].push_back(-(1000 * me + 10 * d + static_cast<int32_t>(i) + round));
          }
        }
        comm.all_to_all(send_f, recv_f);
        comm.all_to_all(send_i, recv_i);
        ASSERT_EQ(recv_f.size(), static_cast<size_t>(world));
        ASSERT_EQ(recv_i.size(), static_cast<size_t>(world));
        for (int s = 0; s < world; ++s) {
          ASSERT_EQ(recv_f[s].size(), count(s, me)) << "from " << s << " to " << me;
          ASSERT_EQ(recv_i[s].size(), count(s, me)) << "from " << s << " to " << me;
          for (size_t i = 0; i < count(s, me); ++i) {
            EXPECT_EQ(recv_f[s][i], 1000.0f * s + 10.0f * me + i + 0.5f * round);
            EXPECT_EQ(recv_i[s][i], -(1000 * s + 10 * me + static_cast<int32_t>(i) + round));
          }
        }
      }
    });
    for (const auto& e : errors) EXPECT_EQ(e, "");
  }
}

TEST(TcpGroup, BarrierWaitsForEveryRank) {
  const Layout layout{2, 1};
  const int world = world_of(layout);
  std::vector<std::atomic<int>> arrived(3);
  const auto errors = run_tcp_group(layout, [&](Communicator& comm) {
    for (int round = 0; round < 3; ++round) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20 * ((comm.rank() + round) % world)));
      ++arrived[round];
      comm.barrier();
      EXPECT_EQ(arrived[round].load(), world) << "rank " << comm.rank() << " round " << round;
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(TcpGroup, MismatchedAllReduceCountsFailNamingBothRanksAndCounts) {
  const auto errors = run_tcp_group({1, 1}, [&](Communicator& comm) {
    std::vector<float> v(10 + comm.rank(), 1.0f);
    comm.all_reduce_sum(v.data(), v.size());
  });
  EXPECT_TRUE(contains(errors[0], "rank 0 reduces 10 values but rank 1 11")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "rank 1 reduces 11 values but rank 0 10")) << errors[1];
}

TEST(TcpGroup, DifferentCollectivesFailNamingBothRanksAndOps) {
  const auto errors = run_tcp_group({1, 1}, [&](Communicator& comm) {
    if (comm.rank() == 1) return comm.barrier();
    std::vector<float> v(4, 1.0f);
    comm.all_reduce_sum(v.data(), v.size());
  });
  EXPECT_TRUE(contains(errors[0],
                       "rank 0 of 2 is in all_reduce_sum (call 0) but rank 1 sent "
                       "barrier (call 0)"))
      << errors[0];
  EXPECT_TRUE(contains(errors[1],
                       "rank 1 of 2 is in barrier (call 0) but rank 0 sent "
                       "all_reduce_sum (call 0)"))
      << errors[1];
}

// After a failure: reset() on every process, then the group computes correct sums again.
void expect_group_works_after_reset(Comms& comms, int world) {
  comms[0]->reset();
  const auto errors = run_ranks(comms, [&](Communicator& comm) {
    for (int round = 0; round < 3; ++round) {
      std::vector<float> v(100, static_cast<float>(comm.rank() + round));
      comm.all_reduce_sum(v.data(), v.size());
      const float want = static_cast<float>(world * (world - 1) / 2 + world * round);
      for (float x : v) ASSERT_EQ(x, want) << "rank " << comm.rank();
      comm.barrier();
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(TcpGroup, AbortReachesEveryWaitingRankOfEveryProcessAndResetRearms) {
  const Layout layout{2, 2};
  const int world = world_of(layout);
  std::vector<std::string> errors(world), later(world);
  std::vector<double> waited_s(world, 0.0);
  run_processes(layout, 10s, [&](int, Comms& comms) {
    const auto mine = run_ranks(comms, [&](Communicator& comm) {
      std::vector<float> v(1000, 1.0f);
      if (comm.rank() == 3) {  // fails mid-step, as a backend rank does, while the others wait
        std::this_thread::sleep_for(100ms);
        comm.abort();
        try {
          comm.all_reduce_sum(v.data(), v.size());
        } catch (const Error& e) {
          later[3] = e.what();
        }
        return;
      }
      const auto start = Clock::now();
      try {
        comm.all_reduce_sum(v.data(), v.size());
      } catch (const Error&) {
        waited_s[comm.rank()] = std::chrono::duration<double>(Clock::now() - start).count();
        throw;
      }
    });
    for (size_t i = 0; i < comms.size(); ++i) errors[comms[i]->rank()] = mine[i];
    expect_group_works_after_reset(comms, world);
    expect_group_works_after_reset(comms, world);  // a reset without a failure before it
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(contains(errors[r], "closed its connection: it aborted or exited")) << errors[r];
    EXPECT_TRUE(contains(errors[r], "rank " + std::to_string(r) + " of 4")) << errors[r];
    EXPECT_LT(waited_s[r], 2.0) << "rank " << r << " (the timeout is 10 s)";
  }
  EXPECT_EQ(errors[3], "");
  EXPECT_TRUE(contains(later[3], "rank 3 of 4: the group was aborted")) << later[3];
}

TEST(TcpGroup, AbortFromAnotherThreadWakesACollectiveInProgress) {
  std::vector<std::string> errors(2);
  run_processes({1, 1}, 10s, [&](int p, Comms& comms) {
    Communicator& comm = *comms[0];
    std::vector<float> v(10, 1.0f);
    if (p == 0) {
      std::thread aborter([&] {
        std::this_thread::sleep_for(100ms);
        comm.abort();
      });
      const auto start = Clock::now();
      try {
        comm.all_reduce_sum(v.data(), v.size());  // rank 1 is not there yet
      } catch (const Error& e) {
        errors[0] = e.what();
      }
      aborter.join();
      EXPECT_LT(Clock::now() - start, 2s);
    } else {
      std::this_thread::sleep_for(300ms);
      try {
        // Rank 0's frame of this call was delivered before it aborted, so this one may complete;
        // the barrier, whose frame rank 0 never sent, cannot.
        comm.all_reduce_sum(v.data(), v.size());
        comm.barrier();
      } catch (const Error& e) {
        errors[1] = e.what();
      }
    }
    expect_group_works_after_reset(comms, 2);
  });
  EXPECT_TRUE(contains(errors[0], "rank 0 of 2: the group was aborted")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "rank 0 closed its connection: it aborted or exited"))
      << errors[1];
}

TEST(TcpGroup, AMissingRankTimesOutNamingItAndTheTimeout) {
  std::atomic<int> finished{0};
  std::vector<double> waited_s(3, 0.0);
  const auto errors = run_tcp_group(
      {1, 1, 1},
      [&](Communicator& comm) {
        if (comm.rank() == 2) {  // never calls, but keeps its process (and sockets) alive
          const auto give_up = Clock::now() + 3s;
          while (finished < 2 && Clock::now() < give_up) std::this_thread::sleep_for(5ms);
          return;
        }
        const auto start = Clock::now();
        std::vector<float> v(10, 1.0f);
        try {
          comm.all_reduce_sum(v.data(), v.size());
        } catch (const Error&) {
          waited_s[comm.rank()] = std::chrono::duration<double>(Clock::now() - start).count();
          ++finished;
          throw;
        }
      },
      300ms);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(errors[r], str("rank ", r,
                                        " of 3: all_reduce_sum timed out after 300 ms "
                                        "waiting for rank(s) 2")))
        << errors[r];
    EXPECT_GE(waited_s[r], 0.29) << "rank " << r;
    EXPECT_LT(waited_s[r], 1.5) << "rank " << r;
  }
  EXPECT_EQ(errors[2], "");
}

TEST(TcpGroup, RefusesRankRangesThatDoNotTileTheWorld) {
  struct Case {
    int first_1, num_1, world_1;  // process 1's arguments; process 0 hosts [0, 2) of 4
    const char* message;
  };
  for (const Case& c :
       {Case{3, 1, 4, "process 1 hosts ranks [3, 4) but the processes must host ascending"},
        Case{2, 1, 4, "the 2 processes host ranks [0, 3) but the world has 4"},
        Case{2, 2, 5, "process 1 was started for a world of 5 ranks but process 0 for 4"}}) {
    const DistInitAddress addr{"127.0.0.1", free_port()};
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int p = 0; p < 2; ++p) {
      threads.emplace_back([&, p] {
        try {
          TcpBootstrap boot(addr, p, 2, 10s);
          if (p == 0)
            make_tcp_group(boot, 0, 2, 4, 1s);
          else
            make_tcp_group(boot, c.first_1, c.num_1, c.world_1, 1s);
        } catch (const Error& e) {
          errors[p] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    // Every process checks every announcement, so both fail with the same message (but for the
    // world, which each compares with its own).
    EXPECT_TRUE(contains(errors[0], c.message)) << errors[0];
    if (c.world_1 == 4)
      EXPECT_TRUE(contains(errors[1], c.message)) << errors[1];
    else
      EXPECT_TRUE(contains(errors[1], "process 0 was started for a world of 4 ranks")) << errors[1];
  }
}

}  // namespace
}  // namespace relay::parallel

// The TCP rendezvous (parallel/tcp_bootstrap.h) between threads of one process: the blob exchanges
// the NCCL bootstrap relies on, and the failures that must name the host, port, rank and timeout.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "core/error.h"
#include "parallel/tcp_bootstrap.h"
#include "../free_port.h"

namespace relay::parallel {
namespace {

using namespace std::chrono_literals;

using test::free_port;

// Runs fn(rank) on one thread per rank; returns the messages of the relay::Errors thrown.
template <typename Fn>
std::vector<std::string> run_ranks(int size, Fn fn) {
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(DistInit, ParsesHostAndPort) {
  DistInitAddress a = parse_dist_init("10.1.2.3:29500");
  EXPECT_EQ(a.host, "10.1.2.3");
  EXPECT_EQ(a.port, 29500);
  a = parse_dist_init("[::1]:80");
  EXPECT_EQ(a.host, "::1");
  EXPECT_EQ(a.port, 80);
  a = parse_dist_init("node-7.cluster:1");
  EXPECT_EQ(a.host, "node-7.cluster");
  for (const char* bad :
       {"", "host", ":29500", "host:", "host:0", "host:65536", "host:12a", "[::1]29500"}) {
    EXPECT_THROW(parse_dist_init(bad), Error) << bad;
  }
}

TEST(TcpBootstrap, BroadcastAllGatherAndBarrierBetweenThreads) {
  for (int size : {1, 2, 5}) {
    const DistInitAddress addr{"127.0.0.1", free_port()};
    std::vector<std::vector<uint8_t>> got(size);
    std::vector<std::vector<std::vector<uint8_t>>> gathered(size);
    const auto errors = run_ranks(size, [&](int rank) {
      TcpBootstrap boot(addr, rank, size, 10s);
      EXPECT_EQ(boot.rank(), rank);
      EXPECT_EQ(boot.size(), size);
      // A 128-byte blob, as an ncclUniqueId is; only rank 0's counts.
      std::vector<uint8_t> id(128);
      for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(rank == 0 ? i * 7 : 0);
      got[rank] = boot.broadcast(id);
      boot.barrier();
      std::vector<uint8_t> mine(rank, static_cast<uint8_t>(rank + 1));  // rank 0 sends nothing
      gathered[rank] = boot.all_gather(mine);
      boot.barrier();
    });
    for (int r = 0; r < size; ++r) {
      EXPECT_EQ(errors[r], "") << "size " << size << " rank " << r;
      ASSERT_EQ(got[r].size(), 128u);
      for (size_t i = 0; i < 128; ++i) EXPECT_EQ(got[r][i], static_cast<uint8_t>(i * 7));
      ASSERT_EQ(gathered[r].size(), static_cast<size_t>(size));
      for (int s = 0; s < size; ++s)
        EXPECT_EQ(gathered[r][s], std::vector<uint8_t>(s, static_cast<uint8_t>(s + 1)));
    }
  }
}

TEST(TcpBootstrap, RanksThatStartBeforeRankZeroRetryUntilItListens) {
  const DistInitAddress addr{"127.0.0.1", free_port()};
  const auto errors = run_ranks(3, [&](int rank) {
    if (rank == 0) std::this_thread::sleep_for(300ms);
    TcpBootstrap boot(addr, rank, 3, 10s);
    boot.barrier();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(TcpBootstrap, MissingRankZeroTimesOutNamingHostPortRankAndTimeout) {
  const int port = free_port();
  try {
    TcpBootstrap boot({"127.0.0.1", port}, 2, 4, 200ms);
    FAIL() << "connected to nobody";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 2 of 4"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("127.0.0.1:") + std::to_string(port)), std::string::npos) << msg;
    EXPECT_NE(msg.find("200 ms"), std::string::npos) << msg;
  }
}

TEST(TcpBootstrap, RankZeroTimesOutWhenRanksAreMissing) {
  const DistInitAddress addr{"127.0.0.1", free_port()};
  const auto errors = run_ranks(2, [&](int rank) {
    if (rank == 1) return;  // never joins
    TcpBootstrap boot(addr, 0, 3, 300ms);
  });
  EXPECT_NE(errors[0].find("only 1 of 3 ranks joined within 300 ms"), std::string::npos)
      << errors[0];
}

TEST(TcpBootstrap, DisagreementOnGroupSizeFailsBothSides) {
  const DistInitAddress addr{"127.0.0.1", free_port()};
  const auto errors = run_ranks(2, [&](int rank) { TcpBootstrap boot(addr, rank, 2 + rank, 5s); });
  EXPECT_NE(errors[0].find("expects a group of 3"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("refused rank 1"), std::string::npos) << errors[1];
}

TEST(TcpBootstrap, PortProbesAreIgnored) {
  const DistInitAddress addr{"127.0.0.1", free_port()};
  std::atomic<bool> probed{false};
  const auto errors = run_ranks(2, [&](int rank) {
    if (rank == 1) {
      // A client that connects, says something that is not a hello, and leaves.
      std::this_thread::sleep_for(100ms);
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(addr.port));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
        const char junk[16] = "GET / HTTP/1.0\n";
        EXPECT_GT(::send(fd, junk, sizeof(junk), 0), 0);
        probed = true;
      }
      ::close(fd);
    }
    TcpBootstrap boot(addr, rank, 2, 5s);
    boot.barrier();
  });
  EXPECT_TRUE(probed.load());
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(TcpBootstrap, GatherGivesRankZeroEveryBlobAndTheOthersNothing) {
  for (int size : {1, 4}) {
    const DistInitAddress addr{"127.0.0.1", free_port()};
    std::vector<std::vector<std::vector<uint8_t>>> got(size);
    const auto errors = run_ranks(size, [&](int rank) {
      TcpBootstrap boot(addr, rank, size, 10s);
      // Ranks arrive out of order, and rank 1's blob is empty.
      std::this_thread::sleep_for(std::chrono::milliseconds(10 * (size - rank)));
      got[rank] = boot.gather(std::vector<uint8_t>(rank == 1 ? 0 : rank + 3, uint8_t(rank)), 5s);
    });
    for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
    ASSERT_EQ(got[0].size(), static_cast<size_t>(size));
    for (int s = 0; s < size; ++s)
      EXPECT_EQ(got[0][s], std::vector<uint8_t>(s == 1 ? 0 : s + 3, uint8_t(s))) << "from " << s;
    for (int r = 1; r < size; ++r) EXPECT_TRUE(got[r].empty()) << "rank " << r;
  }
}

TEST(TcpBootstrap, NoTimeoutWaitsPastTheConstructionTimeout) {
  const DistInitAddress addr{"127.0.0.1", free_port()};
  std::vector<std::vector<uint8_t>> got(3);
  std::vector<std::vector<std::vector<uint8_t>>> gathered(3);
  const auto errors = run_ranks(3, [&](int rank) {
    TcpBootstrap boot(addr, rank, 3, 300ms);
    // A leader that takes longer than the construction timeout to send its next step.
    if (rank == 0) std::this_thread::sleep_for(400ms);
    got[rank] = boot.broadcast(std::vector<uint8_t>{1, 2, 3}, TcpBootstrap::kNoTimeout);
    // Followers that take longer than it to answer.
    if (rank != 0) std::this_thread::sleep_for(400ms);
    gathered[rank] = boot.gather(std::vector<uint8_t>{uint8_t(rank)}, TcpBootstrap::kNoTimeout);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(got[r], (std::vector<uint8_t>{1, 2, 3})) << "rank " << r;
  }
  ASSERT_EQ(gathered[0].size(), 3u);
  for (int s = 0; s < 3; ++s) EXPECT_EQ(gathered[0][s], std::vector<uint8_t>{uint8_t(s)});
}

TEST(TcpBootstrap, APerCallTimeoutFailsNamingIt) {
  const DistInitAddress addr{"127.0.0.1", free_port()};
  std::atomic<bool> follower_done{false};
  const auto errors = run_ranks(2, [&](int rank) {
    TcpBootstrap boot(addr, rank, 2, 10s);
    if (rank == 0) {  // never broadcasts, but stays connected
      while (!follower_done) std::this_thread::sleep_for(5ms);
      return;
    }
    try {
      boot.broadcast({}, 100ms);
    } catch (const Error&) {
      follower_done = true;
      throw;
    }
    follower_done = true;
  });
  EXPECT_TRUE(errors[1].find("no data within 100 ms") != std::string::npos) << errors[1];
}

TEST(TcpBootstrap, AClosedConnectionFailsAtOnceWithoutATimeout) {
  // Followers waiting for a leader that exits.
  {
    const DistInitAddress addr{"127.0.0.1", free_port()};
    std::vector<double> waited_s(3, 0.0);
    const auto errors = run_ranks(3, [&](int rank) {
      TcpBootstrap boot(addr, rank, 3, 10s);
      if (rank == 0) {  // exits without broadcasting
        std::this_thread::sleep_for(100ms);
        return;
      }
      const auto start = std::chrono::steady_clock::now();
      try {
        boot.broadcast({}, TcpBootstrap::kNoTimeout);
      } catch (const Error&) {
        waited_s[rank] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        throw;
      }
    });
    for (int r = 1; r < 3; ++r) {
      EXPECT_NE(errors[r].find("the connection was closed"), std::string::npos) << errors[r];
      EXPECT_LT(waited_s[r], 2.0) << "rank " << r;
    }
  }
  // A leader gathering from a slow rank 1 while rank 2 exits: it fails on rank 2 at once.
  {
    const DistInitAddress addr{"127.0.0.1", free_port()};
    std::atomic<bool> leader_done{false};
    const auto errors = run_ranks(3, [&](int rank) {
      TcpBootstrap boot(addr, rank, 3, 10s);
      if (rank == 2) {  // exits without sending its blob
        std::this_thread::sleep_for(100ms);
        return;
      }
      if (rank == 1) {  // slow: sends nothing until the leader has failed
        while (!leader_done) std::this_thread::sleep_for(5ms);
        return;
      }
      try {
        boot.gather({}, TcpBootstrap::kNoTimeout);
      } catch (const Error&) {
        leader_done = true;
        throw;
      }
      leader_done = true;
    });
    EXPECT_NE(errors[0].find("talking to rank 2: the connection was closed"), std::string::npos)
        << errors[0];
  }
}

TEST(TcpBootstrap, LocalHostIsTheNumericAddressOfTheConnectionToRankZero) {
  EXPECT_EQ(TcpBootstrap({"127.0.0.1", free_port()}, 0, 1).local_host(), "127.0.0.1");
  for (const char* host : {"127.0.0.1", "localhost"}) {
    const DistInitAddress addr{host, free_port()};
    std::vector<std::string> local(3);
    const auto errors = run_ranks(3, [&](int rank) {
      TcpBootstrap boot(addr, rank, 3, 10s);
      local[rank] = boot.local_host();
      boot.barrier();
    });
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(errors[r], "") << host << " rank " << r;
      // "localhost" resolves to either loopback; every rank sees the one rank 0 listens on.
      EXPECT_TRUE(local[r] == "127.0.0.1" || local[r] == "::1")
          << host << " rank " << r << ": " << local[r];
      EXPECT_EQ(local[r], local[0]) << host << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace relay::parallel

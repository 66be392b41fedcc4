// ThreadPool: every index runs exactly once, chunks respect the grain, nesting and concurrent
// callers do not deadlock.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

namespace relay {
namespace {

TEST(ThreadPool, CoversTheRangeExactlyOnce) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      for (int64_t grain : {1, 3, 5000}) {
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int> chunks{0};
        pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
          ++chunks;
          EXPECT_LT(b, e);
          for (int64_t i = b; i < e; ++i) ++hits[i];
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " grain " << grain;
        EXPECT_LE(chunks.load(), 4 * threads);  // a few chunks per thread, claimed dynamically
        if (n > 0 && grain >= n) {
          EXPECT_EQ(chunks.load(), 1);
        }
      }
    }
  }
}

TEST(ThreadPool, NestedCallsRunInline) {
  ThreadPool pool(2);
  std::atomic<int> total{0};
  pool.parallel_for(4, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      pool.parallel_for(10, 1, [&](int64_t b2, int64_t e2) { total += static_cast<int>(e2 - b2); });
    }
  });
  EXPECT_EQ(total.load(), 40);
}

TEST(ThreadPool, ConcurrentCallersAreSerialised) {
  ThreadPool pool(2);
  std::atomic<int64_t> total{0};
  auto work = [&] {
    for (int r = 0; r < 200; ++r) {
      pool.parallel_for(100, 1, [&](int64_t b, int64_t e) { total += e - b; });
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  EXPECT_EQ(total.load(), 2 * 200 * 100);
}

}  // namespace
}  // namespace relay

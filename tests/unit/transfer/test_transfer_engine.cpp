// Transfer engine tests over the in-process transport: completion (callback and future), region
// export/import across engines, bounds checks, deadlines, cancellation, transport failures,
// shutdown and counters. A gated transport (the in-process one behind a gate the test opens)
// holds the worker inside a copy so that queued, running and timed-out states are reached
// deterministically rather than by racing the clock.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "transfer/in_process_transport.h"
#include "transfer/transfer_engine.h"

namespace relay {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// The in-process transport behind a gate: post() records itself, waits while the gate is closed,
// and throws on the post numbered fail_at.
struct Gate {
  std::mutex mutex;
  std::condition_variable cv;
  bool open = true;
  int num_posts = 0;
  int fail_at = -1;

  void set_open(bool value) {
    std::lock_guard lock(mutex);
    open = value;
    cv.notify_all();
  }
  // Waits until `n` posts have started; false after 10 s.
  bool wait_posts(int n) {
    std::unique_lock lock(mutex);
    return cv.wait_for(lock, 10s, [&] { return num_posts >= n; });
  }
};

class GatedTransport final : public Transport {
 public:
  explicit GatedTransport(std::shared_ptr<Gate> gate)
      : inner_(make_in_process_transport()), gate_(std::move(gate)) {}
  std::string_view name() const override { return inner_->name(); }
  std::string add_local_region(RegionId id, std::byte* base, uint64_t bytes) override {
    return inner_->add_local_region(id, base, bytes);
  }
  void add_remote_region(const RegionDescriptor& desc) override { inner_->add_remote_region(desc); }
  void remove_region(RegionId id) override { inner_->remove_region(id); }
  void post(const TransferCopy& copy) override {
    std::unique_lock lock(gate_->mutex);
    const int index = gate_->num_posts++;
    gate_->cv.notify_all();
    gate_->cv.wait(lock, [&] { return gate_->open; });
    RELAY_CHECK(index != gate_->fail_at, "injected failure at post ", index);
    lock.unlock();
    inner_->post(copy);
  }
  void wait_posted() override { inner_->wait_posted(); }

 private:
  std::unique_ptr<Transport> inner_;
  std::shared_ptr<Gate> gate_;
};

constexpr RegionId kSrc = 1;
constexpr RegionId kDst = 2;
constexpr size_t kBytes = 4096;

// An engine with a source region (bytes 0, 1, 2, ...) and a zeroed destination region.
struct Fixture {
  std::shared_ptr<Gate> gate = std::make_shared<Gate>();
  std::vector<std::byte> src = std::vector<std::byte>(kBytes);
  std::vector<std::byte> dst = std::vector<std::byte>(kBytes, std::byte{0});
  TransferEngine engine{std::make_unique<GatedTransport>(gate)};

  Fixture() {
    for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<std::byte>(i * 7 + 1);
    engine.register_region(kSrc, src.data(), src.size());
    engine.register_region(kDst, dst.data(), dst.size());
  }
  bool dst_untouched() const {
    for (std::byte b : dst) {
      if (b != std::byte{0}) return false;
    }
    return true;
  }
};

TransferRequest request(int64_t id, std::vector<TransferCopy> copies,
                        std::optional<Clock::time_point> deadline = std::nullopt) {
  return TransferRequest{id, std::move(copies), deadline};
}

// `n` copies of 256 bytes: src [256 i, +256) -> dst [256 i, +256).
std::vector<TransferCopy> chunks(int n) {
  std::vector<TransferCopy> out;
  for (int i = 0; i < n; ++i) out.push_back({kSrc, 256u * i, kDst, 256u * i, 256});
  return out;
}

TEST(TransferEngine, CopiesAndCounts) {
  Fixture f;
  std::vector<TransferCopy> copies = {
      {kSrc, 0, kDst, 1000, 100}, {kSrc, 100, kDst, 0, 900}, {kSrc, 4000, kDst, 4000, 96}};
  const TransferResult r = f.engine.submit(request(7, copies)).get();
  EXPECT_EQ(r.request_id, 7);
  EXPECT_EQ(r.status, TransferStatus::Ok);
  EXPECT_EQ(r.reason, "");
  EXPECT_EQ(r.num_copies_done, 3u);
  EXPECT_EQ(r.bytes_copied, 1096u);
  EXPECT_EQ(std::memcmp(f.dst.data() + 1000, f.src.data(), 100), 0);
  EXPECT_EQ(std::memcmp(f.dst.data(), f.src.data() + 100, 900), 0);
  EXPECT_EQ(std::memcmp(f.dst.data() + 4000, f.src.data() + 4000, 96), 0);
  EXPECT_EQ(f.dst[900], std::byte{0});
  EXPECT_EQ(f.dst[3999], std::byte{0});
  const TransferCounters c = f.engine.counters();
  EXPECT_EQ(c.requests_submitted, 1u);
  EXPECT_EQ(c.requests_ok, 1u);
  EXPECT_EQ(c.requests_failed + c.requests_cancelled + c.requests_deadline_exceeded, 0u);
  EXPECT_EQ(c.copies_done, 3u);
  EXPECT_EQ(c.bytes_copied, 1096u);
  EXPECT_EQ(f.engine.transport_name(), "in_process");
}

TEST(TransferEngine, EmptyRequestCompletesOk) {
  Fixture f;
  EXPECT_EQ(f.engine.submit(request(1, {})).get().status, TransferStatus::Ok);
}

TEST(TransferEngine, CallbacksRunOnTheWorkerThread) {
  Fixture f;
  std::promise<std::thread::id> ok_thread;
  std::promise<std::thread::id> rejected_thread;
  f.engine.submit(request(1, chunks(2)),
                  [&](const TransferResult&) { ok_thread.set_value(std::this_thread::get_id()); });
  f.engine.submit(request(2, {{kSrc, 0, kDst, kBytes, 1}}), [&](const TransferResult& r) {
    EXPECT_EQ(r.status, TransferStatus::Failed);
    rejected_thread.set_value(std::this_thread::get_id());
  });
  const std::thread::id a = ok_thread.get_future().get();
  const std::thread::id b = rejected_thread.get_future().get();
  EXPECT_NE(a, std::this_thread::get_id());
  EXPECT_EQ(a, b);
}

TEST(TransferEngine, CallbackMaySubmitAgain) {
  Fixture f;
  std::promise<TransferResult> second;
  f.engine.submit(request(1, chunks(1)), [&](const TransferResult&) {
    f.engine.submit(request(2, chunks(2)), [&](const TransferResult& r) { second.set_value(r); });
  });
  EXPECT_EQ(second.get_future().get().status, TransferStatus::Ok);
}

TEST(TransferEngine, ExportedDescriptorReachesAnotherEngine) {
  // Prefill and decode engines in one process: the decode side exports its region as JSON, the
  // prefill side imports it and pushes bytes into it.
  std::vector<std::byte> prefill_kv(kBytes, std::byte{0x5a});
  std::vector<std::byte> decode_kv(kBytes, std::byte{0});
  TransferEngine prefill(make_in_process_transport());
  TransferEngine decode(make_in_process_transport());
  prefill.register_region(10, prefill_kv.data(), prefill_kv.size());
  const RegionDescriptor exported = decode.register_region(20, decode_kv.data(), decode_kv.size());
  EXPECT_EQ(exported.id, 20u);
  EXPECT_EQ(exported.bytes, kBytes);
  EXPECT_EQ(exported.transport, "in_process");
  EXPECT_EQ(decode.descriptor(20).address, exported.address);

  const std::string wire = nlohmann::json(exported).dump();
  const RegionDescriptor imported = nlohmann::json::parse(wire).get<RegionDescriptor>();
  EXPECT_EQ(imported.id, exported.id);
  EXPECT_EQ(imported.bytes, exported.bytes);
  EXPECT_EQ(imported.transport, exported.transport);
  EXPECT_EQ(imported.address, exported.address);
  prefill.import_region(imported);

  const TransferResult r = prefill.submit(request(1, {{10, 0, 20, 512, 1024}})).get();
  ASSERT_EQ(r.status, TransferStatus::Ok) << r.reason;
  EXPECT_EQ(decode_kv[511], std::byte{0});
  EXPECT_EQ(decode_kv[512], std::byte{0x5a});
  EXPECT_EQ(decode_kv[1535], std::byte{0x5a});
  EXPECT_EQ(decode_kv[1536], std::byte{0});

  // Imported regions are destinations only, and bounds come from the descriptor.
  EXPECT_EQ(prefill.submit(request(2, {{20, 0, 10, 0, 8}})).get().reason,
            "copy 0 of transfer request 2: source region 20 is not local to this engine");
  EXPECT_NE(prefill.submit(request(3, {{10, 0, 20, kBytes - 8, 16}}))
                .get()
                .reason.find("exceeds region 20's 4096 bytes"),
            std::string::npos);
  EXPECT_THROW(prefill.descriptor(20), Error);
  prefill.unregister_region(20);
  EXPECT_NE(prefill.submit(request(4, {{10, 0, 20, 0, 8}}))
                .get()
                .reason.find("destination region 20 is unknown"),
            std::string::npos);
}

TEST(TransferEngine, InvalidCopiesFailOnlyTheirRequestAndTouchNothing) {
  Fixture f;
  constexpr uint64_t kHuge = std::numeric_limits<uint64_t>::max();
  struct Case {
    TransferCopy bad;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{kSrc, 0, kDst, kBytes - 10, 11},
       "copy 1 of transfer request 100: destination range [4086, +11) exceeds region 2's 4096 "
       "bytes"},
      {{kSrc, kBytes, kDst, 0, 1}, "source range [4096, +1) exceeds region 1's 4096 bytes"},
      {{kSrc, kHuge - 1, kDst, 0, 2}, "source range [18446744073709551614, +2) exceeds"},
      {{kSrc, 0, kDst, kHuge, 1}, "destination range [18446744073709551615, +1) exceeds"},
      {{kSrc, 0, 99, 0, 8}, "destination region 99 is unknown"},
      {{98, 0, kDst, 0, 8}, "source region 98 is not registered"},
      {{kSrc, 0, kDst, 0, 0}, "copies 0 bytes"},
      {{kSrc, 0, kSrc, 100, 200}, "overlap in region 1"},
  };
  int64_t id = 100;
  for (const Case& c : cases) {
    // A valid copy first: it must not run either, since the request is checked before any copy.
    const TransferResult r = f.engine.submit(request(id, {{kSrc, 0, kDst, 0, 64}, c.bad})).get();
    EXPECT_EQ(r.status, TransferStatus::Failed);
    EXPECT_NE(r.reason.find(c.message), std::string::npos) << r.reason;
    EXPECT_EQ(r.num_copies_done, 0u);
    EXPECT_TRUE(f.dst_untouched());
    ++id;
  }
  // Non-overlapping ranges of one region are fine, and the engine still serves requests.
  EXPECT_EQ(f.engine.submit(request(id++, {{kSrc, 0, kSrc, 200, 200}})).get().status,
            TransferStatus::Ok);
  EXPECT_EQ(f.engine.submit(request(id++, chunks(16))).get().status, TransferStatus::Ok);
  EXPECT_EQ(std::memcmp(f.dst.data(), f.src.data(), kBytes), 0);
  const TransferCounters counters = f.engine.counters();
  EXPECT_EQ(counters.requests_failed, cases.size());
  EXPECT_EQ(counters.requests_ok, 2u);
  EXPECT_EQ(counters.requests_submitted, cases.size() + 2);
}

TEST(TransferEngine, DeadlineExceededFailsOnlyThatRequest) {
  Fixture f;
  f.gate->set_open(false);
  // The deadline leaves the worker ample time to start request 1 even on a loaded machine.
  const Clock::time_point deadline = Clock::now() + 500ms;
  auto late = f.engine.submit(request(1, chunks(4), deadline));
  auto fine = f.engine.submit(request(2, chunks(4)));
  ASSERT_TRUE(f.gate->wait_posts(1));  // request 1 is inside its first copy
  std::this_thread::sleep_until(deadline + 20ms);
  f.gate->set_open(true);
  const TransferResult r1 = late.get();
  EXPECT_EQ(r1.status, TransferStatus::DeadlineExceeded);
  EXPECT_EQ(r1.reason, "deadline passed after 1 of 4 copies");
  EXPECT_EQ(r1.num_copies_done, 1u);
  EXPECT_EQ(r1.bytes_copied, 256u);
  const TransferResult r2 = fine.get();
  EXPECT_EQ(r2.status, TransferStatus::Ok);
  EXPECT_EQ(std::memcmp(f.dst.data(), f.src.data(), 1024), 0);

  // A deadline already past when the worker picks the request up: nothing is copied.
  std::fill(f.dst.begin(), f.dst.end(), std::byte{0});
  const TransferResult r3 = f.engine.submit(request(3, chunks(2), Clock::now() - 1ms)).get();
  EXPECT_EQ(r3.status, TransferStatus::DeadlineExceeded);
  EXPECT_EQ(r3.num_copies_done, 0u);
  EXPECT_TRUE(f.dst_untouched());

  const TransferCounters c = f.engine.counters();
  EXPECT_EQ(c.requests_deadline_exceeded, 2u);
  EXPECT_EQ(c.requests_ok, 1u);
  EXPECT_EQ(c.copies_done, 5u);
  EXPECT_EQ(c.bytes_copied, 5 * 256u);
}

TEST(TransferEngine, QueuedRequestExpiresWhileAnotherRuns) {
  Fixture f;
  std::mutex order_mutex;
  std::vector<int64_t> order;
  auto record = [&](const TransferResult& r) {
    std::lock_guard lock(order_mutex);
    order.push_back(r.request_id);
  };
  f.gate->set_open(false);
  std::promise<TransferResult> expired;
  f.engine.submit(request(1, chunks(3)), record);
  f.engine.submit(request(2, chunks(1), Clock::now() + 50ms), [&](const TransferResult& r) {
    record(r);
    expired.set_value(r);
  });
  ASSERT_TRUE(f.gate->wait_posts(1));
  std::this_thread::sleep_for(100ms);
  f.gate->set_open(true);
  const TransferResult r2 = expired.get_future().get();
  EXPECT_EQ(r2.status, TransferStatus::DeadlineExceeded);
  EXPECT_EQ(r2.reason, "deadline passed while queued");
  EXPECT_EQ(f.engine.submit(request(3, {})).get().status, TransferStatus::Ok);
  std::lock_guard lock(order_mutex);
  // Request 2 was reported between request 1's copies, before request 1 finished.
  ASSERT_EQ(order.size(), 2u);
  EXPECT_EQ(order[0], 2);
  EXPECT_EQ(order[1], 1);
}

TEST(TransferEngine, CancelRunningAndQueued) {
  Fixture f;
  f.gate->set_open(false);
  auto running = f.engine.submit(request(1, chunks(4)));
  auto queued = f.engine.submit(request(2, chunks(4)));
  ASSERT_TRUE(f.gate->wait_posts(1));
  EXPECT_TRUE(f.engine.cancel(2));
  EXPECT_TRUE(f.engine.cancel(1));
  EXPECT_FALSE(f.engine.cancel(3));
  f.gate->set_open(true);
  const TransferResult r1 = running.get();
  EXPECT_EQ(r1.status, TransferStatus::Cancelled);
  EXPECT_EQ(r1.reason, "cancelled after 1 of 4 copies");
  EXPECT_EQ(r1.num_copies_done, 1u);
  const TransferResult r2 = queued.get();
  EXPECT_EQ(r2.status, TransferStatus::Cancelled);
  EXPECT_EQ(r2.reason, "cancelled while queued");
  EXPECT_EQ(r2.num_copies_done, 0u);
  EXPECT_FALSE(f.engine.cancel(1));
  // Only request 1's first copy landed.
  EXPECT_EQ(std::memcmp(f.dst.data(), f.src.data(), 256), 0);
  EXPECT_TRUE(
      std::all_of(f.dst.begin() + 256, f.dst.end(), [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_EQ(f.engine.counters().requests_cancelled, 2u);
  // A cancelled id can be used again.
  EXPECT_EQ(f.engine.submit(request(1, chunks(1))).get().status, TransferStatus::Ok);
}

TEST(TransferEngine, DuplicateIdsAreRejected) {
  Fixture f;
  std::vector<std::byte> other(16);
  EXPECT_THROW(f.engine.register_region(kSrc, other.data(), other.size()), Error);
  EXPECT_THROW(f.engine.register_region(5, nullptr, 16), Error);
  EXPECT_THROW(f.engine.register_region(5, other.data(), 0), Error);
  EXPECT_THROW(f.engine.import_region(f.engine.descriptor(kDst)), Error);
  // Request 1 cannot finish while the gate is closed, so the second request 1 is a duplicate. Its
  // rejection is delivered by the worker, which may be inside request 1's first copy: open first.
  f.gate->set_open(false);
  auto first = f.engine.submit(request(1, chunks(1)));
  auto dup = f.engine.submit(request(1, chunks(1)));
  f.gate->set_open(true);
  const TransferResult r = dup.get();
  EXPECT_EQ(r.status, TransferStatus::Failed);
  EXPECT_EQ(r.reason, "transfer request 1 is already queued or running");
  EXPECT_EQ(first.get().status, TransferStatus::Ok);
}

TEST(TransferEngine, RegionsInUseCannotBeUnregistered) {
  Fixture f;
  f.gate->set_open(false);
  auto running = f.engine.submit(request(1, chunks(2)));
  ASSERT_TRUE(f.gate->wait_posts(1));
  try {
    f.engine.unregister_region(kDst);
    ADD_FAILURE() << "unregistered a region in use";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("region 2 is used by 1 queued or running"),
              std::string::npos)
        << e.what();
  }
  f.gate->set_open(true);
  EXPECT_EQ(running.get().status, TransferStatus::Ok);
  f.engine.unregister_region(kDst);
  EXPECT_THROW(f.engine.unregister_region(kDst), Error);
  EXPECT_THROW(f.engine.descriptor(kDst), Error);
}

TEST(TransferEngine, ImportRejectsUnreachableRegions) {
  TransferEngine engine(make_in_process_transport());
  EXPECT_THROW(engine.import_region({5, 64, "ucx", "whatever"}), Error);
  EXPECT_THROW(engine.import_region({5, 0, "in_process", "1:0x1000"}), Error);
  try {
    engine.import_region({5, 64, "in_process", "1:0x1000"});
    ADD_FAILURE() << "imported another process's region";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to process 1"), std::string::npos) << e.what();
  }
  for (const char* bad : {"", "0x1000", "12:", "12:0x", "12:0xzz", "x:0x10", "12:0x0"}) {
    EXPECT_THROW(engine.import_region({5, 64, "in_process", bad}), Error) << bad;
  }
  nlohmann::json missing = {{"id", 1}, {"bytes", 2}, {"transport", "in_process"}};
  EXPECT_THROW((void)missing.get<RegionDescriptor>(), Error);
  nlohmann::json negative = {
      {"id", -1}, {"bytes", 2}, {"transport", "in_process"}, {"address", ""}};
  EXPECT_THROW((void)negative.get<RegionDescriptor>(), Error);
}

TEST(TransferEngine, TransportFailureFailsThatRequest) {
  Fixture f;
  f.gate->fail_at = 1;
  const TransferResult r = f.engine.submit(request(1, chunks(3))).get();
  EXPECT_EQ(r.status, TransferStatus::Failed);
  EXPECT_NE(r.reason.find("copy 1 of 3 failed in the in_process transport: injected failure"),
            std::string::npos)
      << r.reason;
  EXPECT_EQ(r.num_copies_done, 1u);
  EXPECT_EQ(f.engine.submit(request(2, chunks(3))).get().status, TransferStatus::Ok);
  EXPECT_EQ(f.engine.counters().requests_failed, 1u);
}

TEST(TransferEngine, ShutdownCancelsPendingRequests) {
  std::vector<TransferResult> results;
  std::mutex results_mutex;
  auto record = [&](const TransferResult& r) {
    std::lock_guard lock(results_mutex);
    results.push_back(r);
  };
  std::thread opener;
  {
    Fixture f;
    f.gate->set_open(false);
    f.engine.submit(request(1, chunks(4)), record);
    f.engine.submit(request(2, chunks(4)), record);
    ASSERT_TRUE(f.gate->wait_posts(1));
    opener = std::thread([gate = f.gate] {
      std::this_thread::sleep_for(50ms);
      gate->set_open(true);
    });
  }  // ~TransferEngine waits for the running copy, then reports both requests
  opener.join();
  ASSERT_EQ(results.size(), 2u);
  for (const TransferResult& r : results) EXPECT_EQ(r.status, TransferStatus::Cancelled);
  const TransferResult& queued = results[0].request_id == 2 ? results[0] : results[1];
  EXPECT_EQ(queued.reason, "transfer engine shut down");
}

TEST(TransferEngine, ConcurrentSubmitAndCancel) {
  // Four threads submit 200 requests each and cancel some at random: every callback runs exactly
  // once and the counters add up.
  Fixture f;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 200;
  std::vector<std::atomic<int>> calls(kThreads * kPerThread);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < kPerThread; ++i) {
        const int64_t id = t * kPerThread + i;
        f.engine.submit(request(id, chunks(1 + static_cast<int>(rng() % 8))),
                        [&calls](const TransferResult& r) { ++calls[r.request_id]; });
        if (rng() % 3 == 0) f.engine.cancel(id - static_cast<int64_t>(rng() % 4));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(f.engine.submit(request(-1, {})).get().status, TransferStatus::Ok);  // drains the queue
  for (size_t i = 0; i < calls.size(); ++i) EXPECT_EQ(calls[i].load(), 1) << "request " << i;
  const TransferCounters c = f.engine.counters();
  EXPECT_EQ(c.requests_submitted, kThreads * kPerThread + 1u);
  EXPECT_EQ(c.requests_ok + c.requests_cancelled + c.requests_failed + c.requests_deadline_exceeded,
            c.requests_submitted);
  EXPECT_EQ(c.requests_failed, 0u);
}

}  // namespace
}  // namespace relay

// The transfer engine (see transfer_engine.h for the contract).
//
// One mutex guards the region table, the queue, the completions waiting for delivery and the
// counters; the worker holds it only between copies' bookkeeping, never while a transport moves
// bytes or a callback runs. Three atomics let the worker notice, between copies and without the
// lock, that the running request was cancelled, that completions wait for delivery, or that a
// queued request's deadline has passed.
#include "transfer/transfer_engine.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"

namespace relay {

namespace {

using Clock = std::chrono::steady_clock;

int64_t clock_ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

std::string_view transfer_status_name(TransferStatus status) {
  switch (status) {
    case TransferStatus::Ok:
      return "ok";
    case TransferStatus::Failed:
      return "failed";
    case TransferStatus::Cancelled:
      return "cancelled";
    case TransferStatus::DeadlineExceeded:
      return "deadline_exceeded";
  }
  return "unknown";
}

struct TransferEngine::Impl {
  struct Region {
    RegionDescriptor desc;
    bool local = false;
    int pins = 0;  // queued or running requests that use the region
  };
  struct Pending {
    TransferRequest request;
    TransferCallback on_done;
    std::vector<RegionId> pinned;  // distinct regions the request uses
    Clock::time_point deadline;    // request.deadline, or the far future when it has none
  };
  struct Finished {
    TransferCallback on_done;
    TransferResult result;
  };

  explicit Impl(std::unique_ptr<Transport> t) : transport(std::move(t)) {
    RELAY_CHECK(transport != nullptr, "transfer engine needs a transport");
    worker = std::thread([this] { worker_loop(); });
  }

  // The first problem with `request`'s copies (empty when none); fills `used` with its regions.
  // Called with the mutex held. Runs once per copy on the submit path, so messages are only built
  // for a failing copy and consecutive copies between the same regions reuse the lookups.
  std::string check_copies(const TransferRequest& request, std::vector<RegionId>& used) const {
    auto in_bounds = [](uint64_t offset, uint64_t bytes, uint64_t size) {
      return bytes <= size && offset <= size - bytes;
    };
    const Region* src = nullptr;
    const Region* dst = nullptr;
    for (size_t i = 0; i < request.copies.size(); ++i) {
      const TransferCopy& c = request.copies[i];
      auto where = [&] {
        return str("copy ", i, " of transfer request ", request.request_id, ": ");
      };
      if (src == nullptr || src->desc.id != c.src_region) {
        const auto it = regions.find(c.src_region);
        if (it == regions.end() || !it->second.local) {
          return str(where(), "source region ", c.src_region,
                     it == regions.end() ? " is not registered" : " is not local to this engine");
        }
        src = &it->second;
        if (std::find(used.begin(), used.end(), c.src_region) == used.end()) {
          used.push_back(c.src_region);
        }
      }
      if (dst == nullptr || dst->desc.id != c.dst_region) {
        const auto it = regions.find(c.dst_region);
        if (it == regions.end()) {
          return str(where(), "destination region ", c.dst_region, " is unknown");
        }
        dst = &it->second;
        if (std::find(used.begin(), used.end(), c.dst_region) == used.end()) {
          used.push_back(c.dst_region);
        }
      }
      if (c.bytes == 0) return str(where(), "copies 0 bytes");
      if (!in_bounds(c.src_offset_bytes, c.bytes, src->desc.bytes)) {
        return str(where(), "source range [", c.src_offset_bytes, ", +", c.bytes,
                   ") exceeds region ", c.src_region, "'s ", src->desc.bytes, " bytes");
      }
      if (!in_bounds(c.dst_offset_bytes, c.bytes, dst->desc.bytes)) {
        return str(where(), "destination range [", c.dst_offset_bytes, ", +", c.bytes,
                   ") exceeds region ", c.dst_region, "'s ", dst->desc.bytes, " bytes");
      }
      if (c.src_region == c.dst_region && c.src_offset_bytes < c.dst_offset_bytes + c.bytes &&
          c.dst_offset_bytes < c.src_offset_bytes + c.bytes) {
        return str(where(), "source [", c.src_offset_bytes, ", +", c.bytes, ") and destination [",
                   c.dst_offset_bytes, ", +", c.bytes, ") overlap in region ", c.src_region);
      }
    }
    return {};
  }

  // Counts `result` and queues its callback for the worker. Called with the mutex held.
  void finalize(TransferCallback on_done, TransferResult result) {
    switch (result.status) {
      case TransferStatus::Ok:
        ++counters.requests_ok;
        break;
      case TransferStatus::Failed:
        ++counters.requests_failed;
        break;
      case TransferStatus::Cancelled:
        ++counters.requests_cancelled;
        break;
      case TransferStatus::DeadlineExceeded:
        ++counters.requests_deadline_exceeded;
        break;
    }
    counters.copies_done += result.num_copies_done;
    counters.bytes_copied += result.bytes_copied;
    finished.push_back({std::move(on_done), std::move(result)});
    deliver_wanted.store(true, std::memory_order_release);
    wake.notify_one();
  }

  // Drops a request's claims on its regions and its id. Called with the mutex held.
  void release(const Pending& p) {
    for (RegionId id : p.pinned) --regions.at(id).pins;
    active_ids.erase(p.request.request_id);
  }

  // Called with the mutex held, after the queue changed.
  void update_earliest_deadline() {
    int64_t earliest = std::numeric_limits<int64_t>::max();
    for (const auto& p : queue) earliest = std::min(earliest, clock_ns(p->deadline));
    earliest_queued_deadline_ns.store(earliest, std::memory_order_release);
  }

  // Fails every queued request whose deadline has passed. Called with the mutex held.
  void expire_queued(Clock::time_point now) {
    for (auto it = queue.begin(); it != queue.end();) {
      if ((*it)->deadline < now) {
        release(**it);
        finalize(std::move((*it)->on_done),
                 {(*it)->request.request_id, TransferStatus::DeadlineExceeded,
                  "deadline passed while queued", 0, 0});
        it = queue.erase(it);
      } else {
        ++it;
      }
    }
    update_earliest_deadline();
  }

  // Runs the waiting callbacks without the lock. Called (and returns) with `lock` held.
  void deliver_finished(std::unique_lock<std::mutex>& lock) {
    std::vector<Finished> batch;
    batch.swap(finished);
    deliver_wanted.store(false, std::memory_order_release);
    lock.unlock();
    run_callbacks(batch);
    lock.lock();
  }

  // NOTE: noexcept: a callback that throws is a logic error and terminates the process rather than
  // killing the worker silently and hanging every later request.
  static void run_callbacks(std::vector<Finished>& batch) noexcept {
    for (Finished& f : batch) f.on_done(f.result);
  }

  // Between copies of the running request: delivers completions and expires queued requests.
  void service_queue(Clock::time_point now) {
    std::unique_lock lock(mutex);
    if (clock_ns(now) >= earliest_queued_deadline_ns.load(std::memory_order_acquire)) {
      expire_queued(now);
    }
    if (!finished.empty()) deliver_finished(lock);
  }

  TransferResult execute(const Pending& pending) {
    const TransferRequest& request = pending.request;
    TransferResult result{request.request_id, TransferStatus::Ok, {}, 0, 0};
    const size_t n = request.copies.size();
    uint64_t posted_copies = 0;
    uint64_t posted_bytes = 0;
    if (Clock::now() > pending.deadline) {
      result.status = TransferStatus::DeadlineExceeded;
      result.reason = "deadline passed before the transfer started";
      return result;
    }
    for (size_t i = 0; i < n; ++i) {
      if (cancel_running.load(std::memory_order_acquire)) {
        result.status = TransferStatus::Cancelled;
        result.reason = str("cancelled after ", i, " of ", n, " copies");
        break;
      }
      const Clock::time_point now = Clock::now();
      if (now > pending.deadline) {
        result.status = TransferStatus::DeadlineExceeded;
        result.reason = str("deadline passed after ", i, " of ", n, " copies");
        break;
      }
      if (deliver_wanted.load(std::memory_order_acquire) ||
          clock_ns(now) >= earliest_queued_deadline_ns.load(std::memory_order_acquire)) {
        service_queue(now);
      }
      try {
        transport->post(request.copies[i]);
      } catch (const std::exception& e) {
        result.status = TransferStatus::Failed;
        result.reason = str("copy ", i, " of ", n, " failed in the ", transport->name(),
                            " transport: ", e.what());
        break;
      }
      ++posted_copies;
      posted_bytes += request.copies[i].bytes;
    }
    // Posted copies must land (or fail) before the request ends: the caller frees its blocks next.
    try {
      transport->wait_posted();
      result.num_copies_done = posted_copies;
      result.bytes_copied = posted_bytes;
    } catch (const std::exception& e) {
      result.status = TransferStatus::Failed;
      result.reason = str("waiting for ", posted_copies, " posted copies failed in the ",
                          transport->name(), " transport: ", e.what());
    }
    return result;
  }

  void worker_loop() {
    std::unique_lock lock(mutex);
    for (;;) {
      wake.wait(lock, [this] { return stopping || !queue.empty() || !finished.empty(); });
      if (!finished.empty()) {
        deliver_finished(lock);
        continue;
      }
      if (queue.empty()) {
        if (stopping) return;
        continue;
      }
      std::unique_ptr<Pending> p = std::move(queue.front());
      queue.pop_front();
      update_earliest_deadline();
      running_id = p->request.request_id;
      running = true;
      cancel_running.store(stopping, std::memory_order_release);
      lock.unlock();
      TransferResult result = execute(*p);
      lock.lock();
      running = false;
      release(*p);
      finalize(std::move(p->on_done), std::move(result));
    }
  }

  std::unique_ptr<Transport> transport;
  mutable std::mutex mutex;
  std::condition_variable wake;
  std::unordered_map<RegionId, Region> regions;
  std::deque<std::unique_ptr<Pending>> queue;
  std::vector<Finished> finished;          // completions the worker has yet to deliver
  std::unordered_set<int64_t> active_ids;  // queued or running request ids
  bool running = false;
  int64_t running_id = 0;
  bool stopping = false;
  TransferCounters counters;
  std::atomic<bool> cancel_running{false};
  std::atomic<bool> deliver_wanted{false};
  std::atomic<int64_t> earliest_queued_deadline_ns{std::numeric_limits<int64_t>::max()};
  std::thread worker;  // last: starts after every member above exists
};

TransferEngine::TransferEngine(std::unique_ptr<Transport> transport)
    : impl_(std::make_unique<Impl>(std::move(transport))) {}

TransferEngine::~TransferEngine() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
    for (auto& p : impl_->queue) {
      impl_->release(*p);
      impl_->finalize(std::move(p->on_done), {p->request.request_id, TransferStatus::Cancelled,
                                              "transfer engine shut down", 0, 0});
    }
    impl_->queue.clear();
    impl_->cancel_running.store(true, std::memory_order_release);
    impl_->wake.notify_all();
  }
  impl_->worker.join();
}

std::string_view TransferEngine::transport_name() const { return impl_->transport->name(); }

RegionDescriptor TransferEngine::register_region(RegionId id, void* base, uint64_t bytes) {
  RELAY_CHECK(base != nullptr && bytes > 0, "region ", id, " is empty (base ", base, ", ", bytes,
              " bytes)");
  std::lock_guard lock(impl_->mutex);
  RELAY_CHECK(!impl_->regions.contains(id), "region id ", id, " is already registered");
  std::string address =
      impl_->transport->add_local_region(id, static_cast<std::byte*>(base), bytes);
  RegionDescriptor desc{id, bytes, std::string(impl_->transport->name()), std::move(address)};
  impl_->regions[id] = {desc, true, 0};
  return desc;
}

void TransferEngine::import_region(const RegionDescriptor& desc) {
  RELAY_CHECK(desc.transport == impl_->transport->name(), "region ", desc.id,
              " is reached by the '", desc.transport, "' transport; this engine uses '",
              impl_->transport->name(), "'");
  RELAY_CHECK(desc.bytes > 0, "imported region ", desc.id, " is empty");
  std::lock_guard lock(impl_->mutex);
  RELAY_CHECK(!impl_->regions.contains(desc.id), "region id ", desc.id, " is already registered");
  impl_->transport->add_remote_region(desc);
  impl_->regions[desc.id] = {desc, false, 0};
}

void TransferEngine::unregister_region(RegionId id) {
  std::lock_guard lock(impl_->mutex);
  const auto it = impl_->regions.find(id);
  RELAY_CHECK(it != impl_->regions.end(), "region ", id, " is not registered");
  RELAY_CHECK(it->second.pins == 0, "region ", id, " is used by ", it->second.pins,
              " queued or running transfer request(s)");
  impl_->transport->remove_region(id);
  impl_->regions.erase(it);
}

RegionDescriptor TransferEngine::descriptor(RegionId id) const {
  std::lock_guard lock(impl_->mutex);
  const auto it = impl_->regions.find(id);
  RELAY_CHECK(it != impl_->regions.end() && it->second.local, "region ", id,
              " is not a local region of this engine");
  return it->second.desc;
}

void TransferEngine::submit(TransferRequest request, TransferCallback on_done) {
  RELAY_CHECK(on_done != nullptr, "transfer request ", request.request_id,
              " has no completion callback");
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  ++m.counters.requests_submitted;
  std::vector<RegionId> used;
  std::string error;
  if (m.stopping) {
    error = "transfer engine is shutting down";
  } else if (m.active_ids.contains(request.request_id)) {
    error = str("transfer request ", request.request_id, " is already queued or running");
  } else {
    error = m.check_copies(request, used);
  }
  if (!error.empty()) {
    m.finalize(std::move(on_done),
               {request.request_id, TransferStatus::Failed, std::move(error), 0, 0});
    return;
  }
  for (RegionId id : used) ++m.regions.at(id).pins;
  m.active_ids.insert(request.request_id);
  const Clock::time_point deadline = request.deadline.value_or(Clock::time_point::max());
  m.queue.push_back(std::make_unique<Impl::Pending>(
      Impl::Pending{std::move(request), std::move(on_done), std::move(used), deadline}));
  m.update_earliest_deadline();
  m.wake.notify_one();
}

std::future<TransferResult> TransferEngine::submit(TransferRequest request) {
  auto promise = std::make_shared<std::promise<TransferResult>>();
  std::future<TransferResult> future = promise->get_future();
  submit(std::move(request), [promise](const TransferResult& r) { promise->set_value(r); });
  return future;
}

bool TransferEngine::cancel(int64_t request_id) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  if (m.running && m.running_id == request_id) {
    m.cancel_running.store(true, std::memory_order_release);
    return true;
  }
  const auto it = std::find_if(m.queue.begin(), m.queue.end(),
                               [&](const auto& p) { return p->request.request_id == request_id; });
  if (it == m.queue.end()) return false;
  m.release(**it);
  m.finalize(std::move((*it)->on_done),
             {request_id, TransferStatus::Cancelled, "cancelled while queued", 0, 0});
  m.queue.erase(it);
  m.update_earliest_deadline();
  return true;
}

TransferCounters TransferEngine::counters() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->counters;
}

}  // namespace relay

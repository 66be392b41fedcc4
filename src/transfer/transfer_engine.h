// The transfer engine: moves lists of contiguous copies between registered memory regions, one
// request at a time, with a completion per request, deadlines and cancellation.
//
// This is the "how" of KV transfer (the layout mapper is the "what"). The engine does the work
// every transport shares — region bookkeeping, bounds checks, a queue, deadlines, cancellation,
// counters — and a Transport does only the moving (in_process_transport.h; CUDA IPC and UCX
// transports plug in the same way, see docs/transfer.md). Writes are pushed: a copy's source is a
// region registered here, its destination a region registered here or imported from a peer's
// exported RegionDescriptor.
//
// Requests run in submission order on one worker thread. Before a request is queued every copy is
// checked against its regions, so an out-of-range copy fails its request (with a message naming the
// copy, the region and the bounds) before any byte moves, and never touches memory. Between copies
// the worker checks the request's cancel flag and deadline; a request stopped there reports what it
// had copied, and its destination blocks hold partial data the receiver must discard (a cancel that
// arrives after the last copy changes nothing: the request completes ok). A queued request that is
// cancelled or whose deadline passes completes at the worker's next gap between copies, without
// waiting for the running request to finish. Regions used by a queued or running request cannot be
// unregistered.
//
// Every completion callback runs on the worker thread — never inside submit() or cancel() — so a
// caller may hold its own locks around those calls. Callbacks must be short and must not throw (a
// throw terminates: it is a logic error). All methods are thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "transfer/region.h"

namespace relay {

// How a transport moves bytes. The engine calls add/remove from API threads and post/wait_posted
// only from its worker thread, with copies already bounds-checked against live regions;
// implementations synchronise their own region tables. Deadlines are checked between copies, so
// post and wait_posted must return (or throw) within a bounded time: a transport that can stall
// (a network peer) enforces its own timeout and fails instead of hanging the worker.
class Transport {
 public:
  virtual ~Transport() = default;
  // The name peers match against RegionDescriptor::transport ("in_process", "cuda_ipc", "ucx").
  virtual std::string_view name() const = 0;
  // Makes a local region a copy source and destination; returns its address for descriptors.
  virtual std::string add_local_region(RegionId id, std::byte* base, uint64_t bytes) = 0;
  // Makes a peer's exported region a copy destination; throws relay::Error when it is unreachable
  // from here (another process for the in-process transport, a malformed address, ...).
  virtual void add_remote_region(const RegionDescriptor& desc) = 0;
  virtual void remove_region(RegionId id) = 0;
  // Starts one copy; it may land asynchronously. Throws relay::Error when the transport fails.
  virtual void post(const TransferCopy& copy) = 0;
  // Returns once every posted copy has landed; throws relay::Error when one failed.
  virtual void wait_posted() = 0;
};

enum class TransferStatus : uint8_t { Ok, Failed, Cancelled, DeadlineExceeded };

// "ok", "failed", "cancelled", "deadline_exceeded".
std::string_view transfer_status_name(TransferStatus status);

struct TransferRequest {
  int64_t request_id = 0;  // unique among the engine's queued and running requests
  std::vector<TransferCopy> copies;
  // When the copies must have landed; none by default. (An optional rather than a far-future time
  // point, so that `{id, copies, {}}` means "no deadline", not "already expired".)
  std::optional<std::chrono::steady_clock::time_point> deadline;
};

struct TransferResult {
  int64_t request_id = 0;
  TransferStatus status = TransferStatus::Ok;
  std::string reason;            // why it did not succeed; empty when ok
  uint64_t num_copies_done = 0;  // copies that landed before the request ended
  uint64_t bytes_copied = 0;     // their bytes
};

using TransferCallback = std::function<void(const TransferResult&)>;

// Totals since the engine started; a request counts once, under its final status.
struct TransferCounters {
  uint64_t requests_submitted = 0;
  uint64_t requests_ok = 0;
  uint64_t requests_failed = 0;  // rejected at submit or failed in the transport
  uint64_t requests_cancelled = 0;
  uint64_t requests_deadline_exceeded = 0;
  uint64_t copies_done = 0;
  uint64_t bytes_copied = 0;
};

class TransferEngine {
 public:
  explicit TransferEngine(std::unique_ptr<Transport> transport);
  // Cancels queued and running requests (their callbacks run) and stops the worker.
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  std::string_view transport_name() const;

  // Registers `bytes` bytes at `base` under `id` and returns the descriptor peers import. Throws
  // relay::Error when the id is taken or the range is empty.
  RegionDescriptor register_region(RegionId id, void* base, uint64_t bytes);
  // Makes a peer's region a destination. Throws relay::Error when the id is taken, the descriptor
  // names another transport, or the transport cannot reach it.
  void import_region(const RegionDescriptor& desc);
  // Forgets a local or imported region. Throws relay::Error when a queued or running request uses
  // it, or the id is unknown.
  void unregister_region(RegionId id);
  // The descriptor of a local region (what register_region returned).
  RegionDescriptor descriptor(RegionId id) const;

  // Queues a request; `on_done` runs exactly once, on the worker thread, with its result.
  void submit(TransferRequest request, TransferCallback on_done);
  // Queues a request; the future becomes ready with its result.
  std::future<TransferResult> submit(TransferRequest request);
  // Cancels a queued or running request; false when no such request is pending.
  bool cancel(int64_t request_id);

  TransferCounters counters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace relay

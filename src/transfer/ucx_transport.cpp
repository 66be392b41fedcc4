// The UCX transport (see ucx_transport.h and docs/transfer.md, "UCX").
//
// NOTE: threading. A worker is a put *target* as well as an initiator: over TCP (and any transport
// without hardware RMA) the bytes a peer puts into this process's regions are received by this
// worker's progress, and so are endpoint wireup and close messages. A transport that only
// progressed inside its own wait_posted would stall every peer writing to it while its engine is
// idle. So each transport runs one background thread that progresses the worker and, when idle,
// sleeps on the worker's event fd (ucp_worker_arm; woken by incoming traffic, at least every
// kIdlePollMs as a safety net). The engine's worker thread also progresses while it waits for its
// own puts, so an initiator does not depend on that thread's wakeups. Every UCP call — progress,
// put, endpoint and key handling, memory mapping — runs under one mutex, and the worker is created
// UCS_THREAD_MODE_SERIALIZED (many threads, one at a time), which needs no multi-threaded UCX
// locking of its own.
//
// NOTE: failure. Endpoints use UCP_ERR_HANDLING_MODE_PEER, so a peer that dies fails its puts and
// flushes (the error handler records it) instead of leaving them pending; a peer that vanishes
// without UCX noticing runs into the timeout. Either way the endpoint is force-closed, which
// completes its outstanding puts as cancelled, so no put still reads the caller's memory when
// wait_posted throws. The peer's regions then refuse copies until they are imported again.
#include "transfer/ucx_transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "core/hash.h"
#include "transfer/address_codec.h"

namespace relay {

namespace {

using Clock = std::chrono::steady_clock;

// post() progresses until fewer puts than this are in flight, which bounds UCX's request memory
// and keeps data moving while a long copy list is posted.
constexpr size_t kMaxPutsInFlight = 256;
// The progress thread wakes at least this often, even without an event on the worker's fd.
constexpr int kIdlePollMs = 100;
// At most this long (or timeout_ms, if shorter) for closing endpoints, per call.
constexpr int kCloseWaitMs = 2000;

std::string hex_u64(uint64_t value) {
  char buf[16];
  const auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), value, 16);
  return std::string(16 - (ptr - buf), '0') + std::string(buf, ptr);
}

// "ucx:<worker address>:<base>:<rkey>:<check>", all lower-case hex; <base> and <check> 16 digits,
// <check> the FNV-1a hash of everything before its colon. UCX parses worker addresses and packed
// keys without a length, so a truncated or corrupted address must be caught here, not by UCX.
std::string make_address(const std::string& worker_hex, const std::byte* base, const void* rkey,
                         size_t rkey_bytes) {
  std::string a = str("ucx:", worker_hex, ":", hex_u64(reinterpret_cast<uintptr_t>(base)), ":",
                      to_hex(rkey, rkey_bytes));
  return a + ":" + hex_u64(fnv1a(a));
}

struct ParsedAddress {
  std::string worker;  // binary worker address
  uint64_t base = 0;
  std::string rkey;  // binary packed remote key
};

ParsedAddress parse_address(const RegionDescriptor& desc) {
  const std::string_view a = desc.address;
  auto bad = [&](std::string_view why) {
    fail(str("region ", desc.id, " has a malformed UCX address (", why, "): '", a.substr(0, 96),
             a.size() > 96 ? "...'" : "'"));
  };
  const std::vector<std::string_view> fields = split_fields(a);
  if (fields[0] != "ucx") bad("it does not start with 'ucx:'");
  if (fields.size() != 5) bad(str(fields.size(), " fields, expected 5"));
  uint64_t check = 0;
  ParsedAddress out;
  for (int i : {2, 4}) {
    uint64_t& value = i == 2 ? out.base : check;
    const std::string_view f = fields[i];
    const auto [ptr, ec] = std::from_chars(f.data(), f.data() + f.size(), value, 16);
    if (f.size() != 16 || ec != std::errc{} || ptr != f.data() + f.size()) {
      bad(i == 2 ? "the base is not 16 hex digits" : "the checksum is not 16 hex digits");
    }
  }
  if (fnv1a(a.substr(0, a.size() - 17)) != check) bad("checksum mismatch: truncated or corrupted");
  if (!from_hex(fields[1], out.worker)) bad("the worker address is not hex");
  if (!from_hex(fields[3], out.rkey)) bad("the remote key is not hex");
  if (out.base == 0) bad("null base");
  return out;
}

// An endpoint to one peer worker, shared by every region imported from it. Never freed before the
// transport (its address is the error handler's argument, which UCX may call until the endpoint
// is gone), so regions keep plain pointers.
struct Peer {
  std::string worker_address;  // binary, as ucp_ep_create reads it
  ucp_ep_h ep = nullptr;
  ucs_status_t status = UCS_OK;  // set by the error handler
  std::string failure;           // why the peer is no longer used; empty while healthy
  int num_regions = 0;
  bool used = false;  // puts since the last flush
};

struct Region {
  bool local = false;
  std::byte* base = nullptr;  // local regions
  ucp_mem_h memh = nullptr;   // local regions
  Peer* peer = nullptr;       // imported regions
  uint64_t remote_base = 0;   // imported regions
  ucp_rkey_h rkey = nullptr;  // imported regions; null once the peer failed
};

struct InFlight {
  void* request;
  Peer* peer;
  RegionId dst_region;
};

void on_peer_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  // Runs inside ucp_worker_progress, with the transport's mutex held by the progressing thread.
  Peer* peer = static_cast<Peer*>(arg);
  if (peer->status == UCS_OK) peer->status = status;
}

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(const UcxTransportOptions& options) : timeout_ms_(options.timeout_ms) {
    RELAY_CHECK(options.timeout_ms > 0, "UCX transport timeout must be positive, got ",
                options.timeout_ms, " ms");
    try {
      init(options);
    } catch (...) {
      shutdown();
      throw;
    }
  }

  ~UcxTransport() override { shutdown(); }

  std::string_view name() const override { return "ucx"; }

  std::string add_local_region(RegionId id, std::byte* base, uint64_t bytes) override {
    std::lock_guard lock(mutex_);
    RELAY_CHECK(!regions_.contains(id), "region ", id, " is already known to the UCX transport");
    ucp_mem_map_params_t params{};
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = base;
    params.length = bytes;
    ucp_mem_h memh = nullptr;
    ucs_status_t status = ucp_mem_map(context_, &params, &memh);
    RELAY_CHECK(status == UCS_OK, "region ", id, ": ucp_mem_map of ", bytes, " bytes at ",
                static_cast<void*>(base), " failed: ", ucs_status_string(status));
    void* rkey = nullptr;
    size_t rkey_bytes = 0;
    status = ucp_rkey_pack(context_, memh, &rkey, &rkey_bytes);
    if (status != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      fail(str("region ", id, ": ucp_rkey_pack failed: ", ucs_status_string(status)));
    }
    std::string address = make_address(worker_address_hex_, base, rkey, rkey_bytes);
    ucp_rkey_buffer_release(rkey);
    Region& r = regions_[id];
    r.local = true;
    r.base = base;
    r.memh = memh;
    return address;
  }

  void add_remote_region(const RegionDescriptor& desc) override {
    const ParsedAddress parsed = parse_address(desc);
    std::unique_lock lock(mutex_);
    RELAY_CHECK(!regions_.contains(desc.id), "region ", desc.id,
                " is already known to the UCX transport");
    Peer* peer = connect(parsed.worker, desc.id, lock);
    ucp_rkey_h rkey = nullptr;
    const ucs_status_t status = ucp_ep_rkey_unpack(peer->ep, parsed.rkey.data(), &rkey);
    if (status != UCS_OK) {
      if (peer->num_regions == 0) retire(peer, "unused", lock);
      fail(str("region ", desc.id, ": ucp_ep_rkey_unpack failed: ", ucs_status_string(status)));
    }
    ++peer->num_regions;
    Region& r = regions_[desc.id];
    r.peer = peer;
    r.remote_base = parsed.base;
    r.rkey = rkey;
  }

  void remove_region(RegionId id) override {
    // Best effort, never throws: the engine forgets the region whatever happens here.
    std::unique_lock lock(mutex_);
    const auto it = regions_.find(id);
    if (it == regions_.end()) return;
    Region r = it->second;
    regions_.erase(it);
    if (r.local) {
      ucp_mem_unmap(context_, r.memh);
      return;
    }
    if (r.rkey != nullptr) ucp_rkey_destroy(r.rkey);
    if (--r.peer->num_regions == 0) retire(r.peer, "no regions left", lock);
  }

  void post(const TransferCopy& copy) override {
    std::unique_lock lock(mutex_);
    const Region& src = regions_.at(copy.src_region);
    const Region& dst = regions_.at(copy.dst_region);
    const std::byte* from = src.base + copy.src_offset_bytes;
    if (dst.local) {
      // The engine pins both regions while the request runs, so the pointers stay valid unlocked.
      std::byte* to = dst.base + copy.dst_offset_bytes;
      lock.unlock();
      std::memcpy(to, from, copy.bytes);
      return;
    }
    Peer* peer = dst.peer;
    if (peer->failure.empty() && peer->status != UCS_OK) {
      retire(peer, str("the peer failed: ", ucs_status_string(peer->status)), lock);
    }
    if (!peer->failure.empty()) {
      fail(str("region ", copy.dst_region, " is unreachable (", peer->failure,
               "); unregister it and import it again"));
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    param.memh = src.memh;
    const ucs_status_ptr_t request = ucp_put_nbx(
        peer->ep, from, copy.bytes, dst.remote_base + copy.dst_offset_bytes, dst.rkey, &param);
    RELAY_CHECK(!UCS_PTR_IS_ERR(request), "ucp_put_nbx of ", copy.bytes, " bytes to region ",
                copy.dst_region, " failed: ", ucs_status_string(UCS_PTR_STATUS(request)));
    if (request != nullptr) in_flight_.push_back({request, peer, copy.dst_region});
    if (!peer->used) {
      peer->used = true;
      used_peers_.push_back(peer);
    }
    ucp_worker_progress(worker_);
    if (in_flight_.size() >= kMaxPutsInFlight) {
      const bool drained = progress_until(lock, deadline(), [&] {
        reap_puts();
        return in_flight_.size() < kMaxPutsInFlight / 2;
      });
      if (!drained) {
        abort_batch(
            str("timed out after ", timeout_ms_, " ms with ", in_flight_.size(), " puts in flight"),
            true, lock);
      }
    }
  }

  void wait_posted() override {
    std::unique_lock lock(mutex_);
    if (in_flight_.empty() && used_peers_.empty() && batch_error_.empty()) return;
    const Clock::time_point until = deadline();
    const size_t num_puts = in_flight_.size();
    if (!progress_until(lock, until, [&] {
          reap_puts();
          return in_flight_.empty();
        })) {
      abort_batch(str("timed out after ", timeout_ms_, " ms waiting for ", in_flight_.size(),
                      " of ", num_puts, " puts"),
                  true, lock);
    }
    // Puts complete locally once their source may be reused; a flush makes them land remotely.
    std::vector<std::pair<void*, Peer*>> flushes;
    for (Peer* peer : used_peers_) {
      if (!peer->failure.empty() || peer->status != UCS_OK) continue;
      ucp_request_param_t param{};
      const ucs_status_ptr_t request = ucp_ep_flush_nbx(peer->ep, &param);
      if (UCS_PTR_IS_PTR(request)) {
        flushes.emplace_back(request, peer);
      } else if (UCS_PTR_IS_ERR(request)) {
        note_error(
            str("flushing the endpoint failed: ", ucs_status_string(UCS_PTR_STATUS(request))),
            peer);
      }
    }
    const bool flushed = progress_until(lock, until, [&] {
      for (auto& [request, peer] : flushes) {
        if (request == nullptr) continue;
        const ucs_status_t status = ucp_request_check_status(request);
        if (status == UCS_INPROGRESS) return false;
        if (status != UCS_OK) {
          note_error(str("flushing the endpoint failed: ", ucs_status_string(status)), peer);
        }
        ucp_request_free(request);
        request = nullptr;
      }
      return true;
    });
    if (!flushed) {
      for (auto& [request, peer] : flushes) {
        if (request != nullptr) ucp_request_free(request);  // the force-close below completes it
      }
      abort_batch(
          str("timed out after ", timeout_ms_, " ms flushing ", flushes.size(), " endpoint(s)"),
          true, lock);
    }
    for (Peer* peer : used_peers_) {
      if (peer->failure.empty() && peer->status != UCS_OK) {
        note_error(str("the peer failed: ", ucs_status_string(peer->status)), peer);
      }
    }
    if (!batch_error_.empty()) abort_batch(batch_error_, false, lock);
    for (Peer* peer : used_peers_) peer->used = false;
    used_peers_.clear();
  }

 private:
  void init(const UcxTransportOptions& options) {
    ucp_config_t* config = nullptr;
    ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
    RELAY_CHECK(status == UCS_OK,
                "reading the UCX configuration failed: ", ucs_status_string(status));
    if (!options.transports.empty()) {
      status = ucp_config_modify(config, "TLS", options.transports.c_str());
      if (status != UCS_OK) {
        ucp_config_release(config);
        fail(str("UCX rejects transports '", options.transports, "': ", ucs_status_string(status)));
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    status = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    RELAY_CHECK(status == UCS_OK, "ucp_init failed",
                options.transports.empty() ? "" : str(" (transports '", options.transports, "')"),
                ": ", ucs_status_string(status));
    ucp_worker_params_t worker_params{};
    worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    status = ucp_worker_create(context_, &worker_params, &worker_);
    RELAY_CHECK(status == UCS_OK, "ucp_worker_create failed: ", ucs_status_string(status));
    ucp_address_t* address = nullptr;
    size_t address_bytes = 0;
    status = ucp_worker_get_address(worker_, &address, &address_bytes);
    RELAY_CHECK(status == UCS_OK, "ucp_worker_get_address failed: ", ucs_status_string(status));
    worker_address_hex_ = to_hex(address, address_bytes);
    ucp_worker_release_address(worker_, address);
    // Without an event fd (a transport that cannot signal) the progress thread polls every 1 ms.
    if (ucp_worker_get_efd(worker_, &worker_fd_) != UCS_OK) worker_fd_ = -1;
    stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    RELAY_CHECK(stop_fd_ >= 0, "eventfd failed: ", std::strerror(errno));
    progress_thread_ = std::thread([this] { progress_loop(); });
  }

  void progress_loop() {
    pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {worker_fd_, POLLIN, 0}};
    const nfds_t num_fds = worker_fd_ >= 0 ? 2 : 1;
    const int idle_ms = worker_fd_ >= 0 ? kIdlePollMs : 1;
    while (!stopping_.load(std::memory_order_acquire)) {
      ucs_status_t armed = UCS_ERR_BUSY;
      {
        std::lock_guard lock(mutex_);
        // A bounded batch, so a thread waiting for the mutex (the engine's) gets in under load.
        constexpr int kMaxRounds = 64;
        int rounds = 0;
        while (rounds < kMaxRounds && ucp_worker_progress(worker_) != 0) ++rounds;
        if (rounds < kMaxRounds) armed = worker_fd_ >= 0 ? ucp_worker_arm(worker_) : UCS_OK;
      }
      if (armed == UCS_ERR_BUSY) continue;  // more events arrived: progress again
      ::poll(fds, num_fds, idle_ms);
    }
  }

  Clock::time_point deadline() const {
    return Clock::now() + std::chrono::milliseconds(timeout_ms_);
  }

  // Progresses the worker until `done()` or `until`; false on timeout. Called and returns with
  // `lock` held; lets other threads in between rounds.
  template <typename Done>
  bool progress_until(std::unique_lock<std::mutex>& lock, Clock::time_point until, Done done) {
    for (int idle_rounds = 0;;) {
      bool progressed = false;
      while (ucp_worker_progress(worker_) != 0) progressed = true;
      if (done()) return true;
      if (Clock::now() >= until) return false;
      idle_rounds = progressed ? 0 : idle_rounds + 1;
      lock.unlock();
      // Spin while bytes move; back off once nothing has happened for a while (a stalled peer).
      if (idle_rounds < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      lock.lock();
    }
  }

  // Records a failure of the current batch (the first message wins) and the peer it concerns.
  void note_error(std::string message, Peer* peer) {
    if (batch_error_.empty()) batch_error_ = std::move(message);
    if (std::find(failed_peers_.begin(), failed_peers_.end(), peer) == failed_peers_.end()) {
      failed_peers_.push_back(peer);
    }
  }

  // Frees completed puts, noting the first failure. Called with the mutex held.
  void reap_puts() {
    size_t kept = 0;
    for (const InFlight& f : in_flight_) {
      const ucs_status_t status = ucp_request_check_status(f.request);
      if (status == UCS_INPROGRESS) {
        in_flight_[kept++] = f;
        continue;
      }
      if (status != UCS_OK) {
        note_error(str("a put to region ", f.dst_region, " failed: ", ucs_status_string(status)),
                   f.peer);
      }
      ucp_request_free(f.request);
    }
    in_flight_.resize(kept);
  }

  // Ends the current batch with an error and throws `reason`. Retires the peers that failed — after
  // a timeout, every peer the batch used, since any of them may be the one that stalled — whose
  // force-closed endpoints complete the puts still in flight, and waits for those.
  [[noreturn]] void abort_batch(std::string reason, bool timed_out,
                                std::unique_lock<std::mutex>& lock) {
    for (Peer* peer : used_peers_) {
      const bool failed =
          timed_out || peer->status != UCS_OK ||
          std::find(failed_peers_.begin(), failed_peers_.end(), peer) != failed_peers_.end();
      if (failed) retire(peer, reason, lock);
      peer->used = false;
    }
    used_peers_.clear();
    failed_peers_.clear();
    const Clock::time_point until = Clock::now() + close_wait();
    progress_until(lock, until, [&] {
      reap_puts();
      return in_flight_.empty();
    });
    // NOTE: a put UCX did not complete even after its endpoint was force-closed is abandoned; its
    // handle is released so the transport stays usable.
    for (const InFlight& f : in_flight_) ucp_request_free(f.request);
    in_flight_.clear();
    batch_error_.clear();
    fail(reason);
  }

  std::chrono::milliseconds close_wait() const {
    return std::chrono::milliseconds(std::min(timeout_ms_, kCloseWaitMs));
  }

  // The live endpoint to the worker at `address`, created on first use (and again after the
  // previous one failed). Called with the mutex held.
  Peer* connect(const std::string& address, RegionId id, std::unique_lock<std::mutex>& lock) {
    if (const auto it = peers_by_address_.find(address); it != peers_by_address_.end()) {
      Peer* peer = it->second;
      if (peer->status == UCS_OK) return peer;
      retire(peer, str("the peer failed: ", ucs_status_string(peer->status)), lock);
    }
    auto peer = std::make_unique<Peer>();
    peer->worker_address = address;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(peer->worker_address.data());
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler = {on_peer_error, peer.get()};
    const ucs_status_t status = ucp_ep_create(worker_, &params, &peer->ep);
    RELAY_CHECK(status == UCS_OK, "region ", id,
                ": ucp_ep_create to its owner failed: ", ucs_status_string(status));
    peers_by_address_[address] = peer.get();
    return peers_.emplace_back(std::move(peer)).get();
  }

  // Stops using `peer`: destroys its regions' keys and closes its endpoint (force-closed when it
  // failed or has puts in flight, and then waiting, bounded, for those puts). Called with the mutex
  // held.
  void retire(Peer* peer, std::string why, std::unique_lock<std::mutex>& lock) {
    if (!peer->failure.empty()) return;
    peer->failure = std::move(why);
    if (const auto it = peers_by_address_.find(peer->worker_address);
        it != peers_by_address_.end() && it->second == peer) {
      peers_by_address_.erase(it);
    }
    auto uses_peer = [&](const InFlight& f) { return f.peer == peer; };
    if (std::none_of(in_flight_.begin(), in_flight_.end(), uses_peer)) {
      // Keys go before their endpoint (UCX's rule). Nothing of ours still needs the endpoint, so
      // the close goes on inside UCX without a wait here.
      destroy_keys(peer);
      close_endpoints({peer}, peer->status != UCS_OK, false, lock);
      return;
    }
    // Puts still use the keys: the force-close completes them (cancelled) first. Wait for that, so
    // none reads the caller's memory once the batch fails.
    close_endpoints({peer}, true, false, lock);
    progress_until(lock, Clock::now() + close_wait(), [&] {
      reap_puts();
      return std::none_of(in_flight_.begin(), in_flight_.end(), uses_peer);
    });
    destroy_keys(peer);
  }

  void destroy_keys(Peer* peer) {
    for (auto& [id, r] : regions_) {
      if (r.peer == peer && r.rkey != nullptr) {
        ucp_rkey_destroy(r.rkey);
        r.rkey = nullptr;
      }
    }
  }

  // Closes the endpoints of `peers`; with `wait`, waits a bounded time for the closes to finish.
  // Called with the mutex held.
  void close_endpoints(const std::vector<Peer*>& peers, bool force, bool wait,
                       std::unique_lock<std::mutex>& lock) {
    std::vector<void*> requests;
    for (Peer* peer : peers) {
      if (peer->ep == nullptr) continue;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = force || peer->status != UCS_OK ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      const ucs_status_ptr_t request = ucp_ep_close_nbx(peer->ep, &param);
      peer->ep = nullptr;
      if (UCS_PTR_IS_PTR(request)) requests.push_back(request);
    }
    if (wait) {
      progress_until(lock, Clock::now() + close_wait(), [&] {
        return std::all_of(requests.begin(), requests.end(),
                           [](void* r) { return ucp_request_check_status(r) != UCS_INPROGRESS; });
      });
    }
    // A close that has not finished goes on inside UCX; its handle is released either way.
    for (void* r : requests) ucp_request_free(r);
  }

  void shutdown() {
    if (progress_thread_.joinable()) {
      stopping_.store(true, std::memory_order_release);
      const uint64_t one = 1;
      [[maybe_unused]] const ssize_t n = ::write(stop_fd_, &one, sizeof(one));
      progress_thread_.join();
    }
    if (worker_ != nullptr) {
      std::unique_lock lock(mutex_);
      for (const InFlight& f : in_flight_) ucp_request_free(f.request);
      in_flight_.clear();
      std::vector<Peer*> open;
      for (auto& peer : peers_) {
        destroy_keys(peer.get());
        if (peer->ep != nullptr) open.push_back(peer.get());
      }
      close_endpoints(open, false, true, lock);
      for (auto& [id, r] : regions_) {
        if (r.local) ucp_mem_unmap(context_, r.memh);
      }
      regions_.clear();
      ucp_worker_destroy(worker_);
      worker_ = nullptr;
    }
    if (context_ != nullptr) ucp_cleanup(context_);
    context_ = nullptr;
    if (stop_fd_ >= 0) ::close(stop_fd_);
    stop_fd_ = -1;
  }

  const int timeout_ms_;
  std::mutex mutex_;  // guards every member below and every UCP call
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string worker_address_hex_;
  int worker_fd_ = -1;  // the worker's event fd, owned by UCX; -1 when it has none
  int stop_fd_ = -1;    // wakes the progress thread for shutdown
  std::unordered_map<RegionId, Region> regions_;
  std::vector<std::unique_ptr<Peer>> peers_;                 // every peer ever connected
  std::unordered_map<std::string, Peer*> peers_by_address_;  // the live ones, by worker address
  std::vector<InFlight> in_flight_;                          // puts not yet complete
  std::vector<Peer*> used_peers_;                            // peers with puts since the last flush
  std::string batch_error_;          // the first failure since the last wait_posted
  std::vector<Peer*> failed_peers_;  // the peers that failed since then
  std::atomic<bool> stopping_{false};
  std::thread progress_thread_;
};

}  // namespace

std::unique_ptr<Transport> make_ucx_transport(const UcxTransportOptions& options) {
  return std::make_unique<UcxTransport>(options);
}

}  // namespace relay

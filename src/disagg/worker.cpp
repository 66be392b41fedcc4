// See worker.h.
#include "disagg/worker.h"

#include <httplib.h>

#include <algorithm>
#include <random>

#include "core/error.h"
#include "disagg/protocol.h"
#include "transfer/kv_pool.h"
#include "transfer/layout_mapper.h"
#include "transfer/ucx_transport.h"

namespace relay::disagg {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kEngineCallTimeout = std::chrono::seconds(30);
constexpr auto kPollInterval = std::chrono::milliseconds(50);
constexpr auto kStreamHeartbeat = std::chrono::milliseconds(500);

// Waits for a future of the engine thread, bounded: a wedged engine fails the control message.
template <typename T>
T wait_engine(std::future<T> f, const char* what) {
  if (f.wait_for(kEngineCallTimeout) != std::future_status::ready) fail(str(what, ": the engine did not answer in time"));
  return f.get();
}

CpuBackend& cpu_backend(LLMEngine& engine) {
  auto* cpu = dynamic_cast<CpuBackend*>(&engine.backend());
  RELAY_CHECK(cpu != nullptr, "disaggregated roles run on --device cpu so far (the CUDA backend cannot export "
                              "its KV pool yet)");
  return *cpu;
}

std::string error_json(const std::string& message) { return json{{"error", message}}.dump(); }

// The ranks of DP group `dp_rank` as one side of a transfer (pools and regions), block table empty.
json side_json(CpuBackend& backend, TransferEngine& transfer, RegionId base, int dp_rank) {
  json ranks = json::array(), regions = json::array();
  const parallel::ParallelConfig& p = backend.parallel();
  for (int r = 0; r < p.world_size(); ++r) {
    if (parallel::place_rank(p, r).dp_rank != dp_rank) continue;
    const KvCacheLayout& l = backend.kv_pool(r).layout();
    const ShardSpec& shard = backend.shard(r);
    ranks.push_back(contiguous_kv_pool(l.num_layers, l.num_blocks, l.block_size, l.head_dim, l.element_bytes,
                                       {shard.kv_head_begin, shard.num_local_kv_heads}, base + r));
    regions.push_back(transfer.descriptor(base + r));
  }
  return {{"num_kv_heads", backend.config().num_key_value_heads}, {"ranks", ranks}, {"regions", regions}};
}

}  // namespace

DisaggWorker::DisaggWorker(WorkerOptions options, LLMEngine& engine, server::EngineLoop& loop)
    : options_(std::move(options)), loop_(loop), backend_(cpu_backend(engine)) {
  RELAY_CHECK(options_.role == "prefill" || options_.role == "decode", "--role must be prefill or decode, got '",
              options_.role, "'");
  UcxTransportOptions uo;
  // UCX's own bound on one wait; the hand-off's deadline (transfer_timeout_s) is the engine's.
  uo.timeout_ms = std::max(1000, static_cast<int>(options_.transfer_timeout_s * 1000));
  uo.transports = options_.ucx_transports;
  transfer_ = std::make_unique<TransferEngine>(make_ucx_transport(uo));
  // NOTE: region ids must be unique across every worker that exchanges copies; a random 31-bit
  // worker tag in the high bits makes a collision between workers (or a restarted one) negligible.
  std::random_device rd;
  region_base_ = (static_cast<RegionId>(rd() & 0x7fffffffu) + 1) << 32;
  for (int r = 0; r < backend_.parallel().world_size(); ++r) {
    KvPool& pool = backend_.kv_pool(r);
    transfer_->register_region(region_base_ + r, pool.data(), pool.layout().total_bytes());
  }
}

DisaggWorker::~DisaggWorker() { stop(); }

void DisaggWorker::start() { heartbeat_thread_ = std::thread([this] { heartbeat_loop(); }); }

void DisaggWorker::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

void DisaggWorker::reserve(const std::string& body, std::string& reply, int& status) {
  const json j = json::parse(body);
  const int64_t num_tokens = field<int64_t>(j, "num_tokens", "reserve");
  const int64_t id = loop_.new_id();
  auto [table, partition] = wait_engine(loop_.call([id, num_tokens](LLMEngine& e) {
    auto t = e.reserve_kv(id, num_tokens);
    return std::make_pair(t, t ? e.kv_partition(id) : -1);
  }),
                                        "reserve");
  if (!table) {
    status = 503;
    reply = error_json("the decode worker has no free KV blocks or sequence slots now");
    return;
  }
  {
    std::lock_guard lock(mu_);
    reservations_[id] = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(options_.reservation_timeout_s));
  }
  const int per_rank = backend_.num_kv_blocks() / backend_.num_kv_partitions();
  for (int32_t& b : *table) b -= partition * per_rank;
  json side = side_json(backend_, *transfer_, region_base_, partition);
  side["block_table"] = *table;
  reply = json{{"id", id}, {"kv", side}}.dump();
}

void DisaggWorker::release(const std::string& body) {
  const int64_t id = field<int64_t>(json::parse(body), "id", "release");
  {
    std::lock_guard lock(mu_);
    reservations_.erase(id);
  }
  wait_engine(loop_.call([id](LLMEngine& e) { e.release_kv(id); }), "release");
}

void DisaggWorker::prefill(const std::string& body, std::string& reply, int& status) {
  const json j = json::parse(body);
  EngineRequest request = request_from_json(field<json>(j, "request", "prefill"));
  const json kv = field<json>(j, "kv", "prefill");
  const auto timeout = std::chrono::milliseconds(field<int64_t>(j, "timeout_ms", "prefill"));
  const Clock::time_point deadline = Clock::now() + timeout;
  const int64_t num_tokens = static_cast<int64_t>(request.prompt.size());
  std::vector<KvPoolDesc> dst_pools = field<std::vector<KvPoolDesc>>(kv, "ranks", "kv");
  const std::vector<RegionDescriptor> dst_regions = field<std::vector<RegionDescriptor>>(kv, "regions", "kv");
  const std::vector<int32_t> dst_table = field<std::vector<int32_t>>(kv, "block_table", "kv");
  const int dst_heads = field<int>(kv, "num_kv_heads", "kv");

  // The prompt only: one token sampled, the KV kept for the transfer.
  EngineRequest first_only = request;
  first_only.stop.max_tokens = 1;
  first_only.stop.min_tokens = 0;
  first_only.stop.stop_strings.clear();
  first_only.hold_kv = true;
  queued_prompt_tokens_ += num_tokens;
  struct Done {
    std::atomic<int64_t>& queued;
    int64_t n;
    ~Done() { queued -= n; }
  } done_guard{queued_prompt_tokens_, num_tokens};

  auto handle = loop_.submit(std::move(first_only));
  RequestOutput last;
  while (!handle->done()) {
    RELAY_CHECK(Clock::now() < deadline, "prefill did not finish within ", timeout.count(), " ms");
    for (RequestOutput& o : handle->next(kPollInterval)) last = std::move(o);
  }
  if (!handle->error().empty()) fail(str("prefill failed: ", handle->error()));
  RELAY_CHECK(last.finish != FinishReason::kNone && last.new_tokens.size() == 1 && !last.kv_blocks.empty(),
              "prefill produced no first token");
  const int64_t held_id = handle->id();
  // Whatever happens now, the held blocks go back.
  struct Release {
    server::EngineLoop& loop;
    int64_t id;
    ~Release() {
      loop.call([id = id](LLMEngine& e) { e.release_kv(id); });
    }
  } release_guard{loop_, held_id};

  {
    std::lock_guard lock(mu_);
    for (const RegionDescriptor& r : dst_regions) {
      if (imported_.insert(r.id).second) transfer_->import_region(r);
    }
  }
  const int per_rank = backend_.num_kv_blocks() / backend_.num_kv_partitions();
  const int partition = last.kv_blocks.front() / per_rank;
  std::vector<int32_t> src_table = last.kv_blocks;
  for (int32_t& b : src_table) b -= partition * per_rank;
  const json src_side = side_json(backend_, *transfer_, region_base_, partition);
  const std::vector<KvPoolDesc> src_pools = src_side.at("ranks").get<std::vector<KvPoolDesc>>();
  const KvTransferSide src{static_cast<int>(backend_.config().num_key_value_heads), src_pools, src_table};
  const KvTransferSide dst{dst_heads, dst_pools, dst_table};
  const std::vector<KvCopy> copies = plan_kv_copies(src, dst, {0, num_tokens});
  const Clock::time_point transfer_deadline =
      std::min(deadline, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(options_.transfer_timeout_s)));
  const TransferResult result =
      transfer_->submit({next_transfer_id_++, transfer_copies(copies), transfer_deadline}).get();
  if (result.status != TransferStatus::Ok) {
    status = result.status == TransferStatus::DeadlineExceeded ? 504 : 502;
    reply = error_json(str("KV transfer ", transfer_status_name(result.status), ": ", result.reason));
    return;
  }
  prefill_tokens_done_ += num_tokens;
  FirstToken first;
  first.token.token = last.new_tokens[0];
  if (!last.logprobs.empty()) {
    first.token.logprob = last.logprobs[0].logprob;
    first.token.top = last.logprobs[0].top;
  }
  first.num_cached_tokens = last.num_cached_tokens;
  reply = json{{"first", first_token_to_json(first)}, {"bytes", result.bytes_copied}}.dump();
}

void DisaggWorker::generate(const httplib::Request& req, httplib::Response& res) {
  std::shared_ptr<server::RequestHandle> handle;
  try {
    const json j = json::parse(req.body);
    const int64_t id = field<int64_t>(j, "id", "generate");
    EngineRequest request = request_from_json(field<json>(j, "request", "generate"));
    const FirstToken first = first_token_from_json(field<json>(j, "first", "generate"));
    {
      std::lock_guard lock(mu_);
      RELAY_CHECK(reservations_.erase(id) == 1, "no KV reservation ", id, " (unknown, used or expired)");
    }
    handle = loop_.submit_prefilled(id, std::move(request), first.token, first.num_cached_tokens);
  } catch (const std::exception& e) {
    res.status = 400;
    res.set_content(error_json(e.what()), "application/json");
    return;
  }
  res.set_chunked_content_provider(
      "application/x-ndjson",
      [handle](size_t, httplib::DataSink& sink) {
        Clock::time_point last_write = Clock::now();
        while (!handle->done()) {
          for (const RequestOutput& o : handle->next(kPollInterval)) {
            const std::string line = output_to_json(o).dump() + "\n";
            if (!sink.write(line.data(), line.size())) return false;
            last_write = Clock::now();
          }
          if (Clock::now() - last_write > kStreamHeartbeat) {
            if (!sink.write("\n", 1)) return false;
            last_write = Clock::now();
          }
        }
        if (!handle->error().empty()) {
          const std::string line = error_json(handle->error()) + "\n";
          sink.write(line.data(), line.size());
        }
        sink.done();
        return true;
      },
      [this, handle](bool success) {
        if (!success) loop_.abort(handle->id());  // the router went away
      });
}

void add_worker_routes(httplib::Server& svr, const std::string& role, std::function<DisaggWorker*()> worker) {
  // Runs a control message: 503 while loading, 400 for a malformed one, 500 for an engine failure.
  auto guarded = [worker](auto fn) {
    return [worker, fn](const httplib::Request& req, httplib::Response& res) {
      std::string reply = "{}";
      int status = 200;
      DisaggWorker* w = worker();
      try {
        if (w == nullptr) {
          status = 503;
          reply = error_json("the worker is still loading");
        } else {
          fn(*w, req, reply, status);
        }
      } catch (const json::exception& e) {
        status = 400;
        reply = error_json(str("malformed message: ", e.what()));
      } catch (const Error& e) {
        status = 500;
        reply = error_json(e.what());
      }
      res.status = status;
      res.set_content(reply, "application/json");
    };
  };
  using Req = const httplib::Request&;
  using Res = httplib::Response&;
  if (role == "decode") {
    svr.Post("/disagg/reserve", guarded([](DisaggWorker& w, Req q, std::string& r, int& s) { w.reserve(q.body, r, s); }));
    svr.Post("/disagg/release", guarded([](DisaggWorker& w, Req q, std::string&, int&) { w.release(q.body); }));
    // Streams, so it writes its own response.
    svr.Post("/disagg/generate", [worker](Req q, Res p) {
      if (DisaggWorker* w = worker()) {
        w->generate(q, p);
      } else {
        p.status = 503;
        p.set_content(error_json("the worker is still loading"), "application/json");
      }
    });
  } else {
    svr.Post("/disagg/prefill", guarded([](DisaggWorker& w, Req q, std::string& r, int& s) { w.prefill(q.body, r, s); }));
  }
}

void DisaggWorker::heartbeat_loop() {
  const auto colon = options_.router.rfind(':');
  std::unique_ptr<httplib::Client> router;
  if (!options_.router.empty() && colon != std::string::npos) {
    router = std::make_unique<httplib::Client>(options_.router.substr(0, colon),
                                               std::stoi(options_.router.substr(colon + 1)));
    router->set_connection_timeout(std::chrono::seconds(2));
    router->set_read_timeout(std::chrono::seconds(2));
  }
  const auto interval = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options_.heartbeat_interval_s));
  for (;;) {
    // Expired reservations go back to the pool.
    std::vector<int64_t> expired;
    {
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, interval, [&] { return stopping_; })) return;
      const Clock::time_point now = Clock::now();
      for (auto it = reservations_.begin(); it != reservations_.end();) {
        if (it->second < now) {
          expired.push_back(it->first);
          it = reservations_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (int64_t id : expired) loop_.call([id](LLMEngine& e) { e.release_kv(id); });
    if (!router) continue;
    auto stats = loop_.call([](LLMEngine& e) { return e.stats(); });
    if (stats.wait_for(interval) != std::future_status::ready) continue;
    EngineStats s;
    try {
      s = stats.get();
    } catch (const Error&) {
      return;  // the engine has stopped: so do the heartbeats
    }
    const json beat = {{"url", options_.url},
                       {"role", options_.role},
                       {"num_running", s.num_running},
                       {"num_waiting", s.num_waiting},
                       {"kv_cache_usage", s.kv_cache_usage},
                       {"queued_prompt_tokens", queued_prompt_tokens_.load()},
                       {"prefill_tokens_total", prefill_tokens_done_.load()}};
    // NOTE: a router that is down or restarting just misses beats; the next one re-registers.
    router->Post("/disagg/heartbeat", beat.dump(), "application/json");
  }
}

}  // namespace relay::disagg

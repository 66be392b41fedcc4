// See worker.h.
#include "disagg/worker.h"

#include <httplib.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>

#include "core/error.h"
#include "core/json.h"
#include "disagg/auth.h"
#include "disagg/control_client.h"
#include "disagg/protocol.h"
#include "http/server.h"
#include "transfer/kv_pool.h"
#include "transfer/layout_mapper.h"
#include "transfer/state_pool.h"
#include "transfer/ucx_transport.h"
#if RELAY_HAVE_CUDA
#include "transfer/cuda/cuda_ipc_transport.h"
#endif

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
  if (f.wait_for(kEngineCallTimeout) != std::future_status::ready)
    fail(str(what, ": the engine did not answer in time"));
  return f.get();
}

std::string error_json(const std::string& message) { return json{{"error", message}}.dump(); }

// Whatever happens to a prefill, its request's pages go back when this ends: a request that is
// still running is aborted, one that finished holding its pages for the hand-off releases them
// (release_kv is a no-op for a request that holds none). The abort is queued before the release,
// so a request that finishes in between still has its pages released.
struct ReleaseOnExit {
  server::EngineLoop& loop;
  int64_t id;
  ~ReleaseOnExit() {
    loop.abort(id);
    loop.call([id = id](LLMEngine& e) { e.release_kv(id); });
  }
};

// The outputs of a request run here until it finished, merged into its last one (the prompt
// logprobs come with the first), by `deadline`.
RequestOutput wait_finished(server::RequestHandle& handle, Clock::time_point deadline,
                            std::chrono::milliseconds timeout) {
  RequestOutput last;
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  while (!handle.done()) {
    RELAY_CHECK(Clock::now() < deadline, "prefill did not finish within ", timeout.count(), " ms");
    for (RequestOutput& o : handle.next(kPollInterval)) {
      if (!o.prompt_logprobs.empty()) prompt_logprobs = std::move(o.prompt_logprobs);
      last = std::move(o);
    }
  }
  if (!handle.error().empty()) fail(str("prefill failed: ", handle.error()));
  RELAY_CHECK(last.finish != FinishReason::kNone, "prefill did not finish its request");
  last.prompt_logprobs = std::move(prompt_logprobs);
  return last;
}

std::vector<KvPoolExport> exported_pools(LLMEngine& engine) {
  std::vector<KvPoolExport> pools = engine.backend().kv_pool_exports();
  RELAY_CHECK(!pools.empty(),
              "this backend cannot export its KV pool for a disaggregated hand-off");
  return pools;
}

std::unique_ptr<Transport> make_transport(const WorkerOptions& o,
                                          const std::vector<KvPoolExport>& pools) {
  std::string kind = o.kv_transport;
  const bool on_device = pools.front().device >= 0;
  if (kind == "auto") kind = on_device ? "cuda_ipc" : "ucx";
  // UCX's and CUDA's own bound on one wait; the hand-off's deadline (transfer_timeout_s) is the
  // engine's.
  const int wait_ms = std::max(1000, static_cast<int>(o.transfer_timeout_s * 1000));
  if (kind == "ucx") {
    RELAY_CHECK(!on_device,
                "--kv-transport ucx: Relay's UCX has no CUDA support; device pools need cuda_ipc");
    UcxTransportOptions uo;
    uo.timeout_ms = wait_ms;
    uo.transports = o.ucx_transports;
    return make_ucx_transport(uo);
  }
  if (kind == "cuda_ipc") {
    RELAY_CHECK(on_device, "--kv-transport cuda_ipc needs a device KV pool (--device cuda)");
#if RELAY_HAVE_CUDA
    CudaIpcTransportOptions co;
    co.device = pools.front().device;
    co.timeout_ms = wait_ms;
    return make_cuda_ipc_transport(co);
#endif
  }
  fail(str("--kv-transport must be auto, ucx or cuda_ipc (cuda_ipc in CUDA builds), got '", kind,
           "'"));
}

}  // namespace

DisaggWorker::DisaggWorker(WorkerOptions options, LLMEngine& engine, server::EngineLoop& loop,
                           CompileGrammar compile_grammar)
    : options_(std::move(options)),
      loop_(loop),
      compile_grammar_(std::move(compile_grammar)),
      pools_(exported_pools(engine)),
      num_kv_heads_(static_cast<int>(engine.model_config().num_key_value_heads)) {
  RELAY_CHECK(options_.role == "prefill" || options_.role == "decode",
              "--role must be prefill or decode, got '", options_.role, "'");
  transfer_ = std::make_unique<TransferEngine>(make_transport(options_, pools_));
  // NOTE: region ids must be unique across every worker that exchanges copies; a random 31-bit
  // worker tag in the high bits makes a collision between workers (or a restarted one) negligible.
  std::random_device rd;
  region_base_ = (static_cast<RegionId>(rd() & 0x7fffffffu) + 1) << 32;
  sides_.resize(engine.backend().num_kv_partitions());
  for (size_t r = 0; r < pools_.size(); ++r) {
    const KvPoolExport& p = pools_[r];
    const KvCacheLayout& l = p.layout;
    Side& side = sides_.at(p.dp_rank);
    side.pools.push_back(contiguous_kv_pool(l.num_layers, l.num_blocks, l.block_size, l.head_dim,
                                            static_cast<int>(l.element_bytes),
                                            {p.first_kv_head, p.num_kv_heads}, region_base_ + r));
    side.announcement["regions"].push_back(
        transfer_->register_region(region_base_ + r, p.base, l.total_bytes()));
  }
  // A hybrid model's recurrent-state pools travel beside the KV pools: the same sides, their own
  // regions (ids after the KV pools').
  const std::vector<StatePoolExport> states = engine.backend().state_pool_exports();
  for (size_t r = 0; r < states.size(); ++r) {
    const StatePoolExport& p = states[r];
    const RegionId id = region_base_ + kStateRegionOffset + r;
    Side& side = sides_.at(p.dp_rank);
    side.state_pools.push_back(state_pool_for(
        p.layout, {p.first_k_head, p.num_k_heads}, {p.first_v_head, p.num_v_heads}, id, 0));
    side.announcement["regions"].push_back(
        transfer_->register_region(id, p.base, p.layout.total_bytes()));
  }
  if (!states.empty()) {
    state_slots_per_rank_ = engine.backend().num_state_slots() / static_cast<int>(sides_.size());
    const ModelConfig& c = engine.model_config();
    num_k_heads_ = static_cast<int>(c.linear_num_key_heads);
    num_v_heads_ = static_cast<int>(c.linear_num_value_heads);
  }
  for (Side& side : sides_) {
    side.announcement["num_kv_heads"] = num_kv_heads_;
    side.announcement["ranks"] = side.pools;
    if (!side.state_pools.empty()) {
      side.announcement["state"] = {{"num_k_heads", num_k_heads_},
                                    {"num_v_heads", num_v_heads_},
                                    {"ranks", side.state_pools}};
    }
  }
  capacity_ = {{"max_num_seqs", engine.max_num_seqs()},
               {"num_kv_blocks", engine.backend().num_kv_blocks()},
               {"block_size", engine.backend().block_size()},
               {"layout", options_.layout},
               {"kv_transport", std::string(transfer_->transport_name())}};
}

DisaggWorker::~DisaggWorker() { stop(); }

void DisaggWorker::start() {
  heartbeat_thread_ = std::thread([this] { heartbeat_loop(); });
}

void DisaggWorker::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

void DisaggWorker::reserve(const std::string& body, std::string& reply, int& status) {
  const json j = parse_json(body, "a reserve message");
  const std::vector<int32_t> prompt = field<std::vector<int32_t>>(j, "prompt", "reserve");
  const int64_t id = loop_.new_id();
  auto [reservation, partition] = wait_engine(loop_.call([id, &prompt](LLMEngine& e) {
    auto r = e.reserve_kv(id, prompt);
    return std::make_pair(r, r ? e.kv_partition(id) : -1);
  }),
                                              "reserve");
  if (!reservation) {
    status = 503;
    reply = error_json("the decode worker has no free KV blocks or sequence slots now");
    return;
  }
  {
    std::lock_guard lock(mu_);
    reservations_[id] =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(options_.reservation_timeout_s));
  }
  const int per_rank = pools_.front().layout.num_blocks;
  for (int32_t& b : reservation->block_table) b -= partition * per_rank;
  json side = sides_.at(partition).announcement;
  side["block_table"] = reservation->block_table;
  // A hybrid model's state goes to the reservation's slot (local to its DP rank, as the blocks).
  if (reservation->state_slot >= 0)
    side["state"]["slot"] = reservation->state_slot - partition * state_slots_per_rank_;
  // The leading tokens whose KV this worker already holds (its prefix cache): not sent again.
  side["token_begin"] = reservation->num_cached_tokens;
  reply = json{{"id", id}, {"kv", side}}.dump();
}

void DisaggWorker::release(const std::string& body) {
  const int64_t id = field<int64_t>(parse_json(body, "a release message"), "id", "release");
  {
    std::lock_guard lock(mu_);
    reservations_.erase(id);
  }
  wait_engine(loop_.call([id](LLMEngine& e) { e.release_kv(id); }), "release");
}

void DisaggWorker::prefill(const std::string& body, std::string& reply, int& status) {
  const json j = parse_json(body, "a prefill message");
  EngineRequest request = request_from_json(field<json>(j, "request", "prefill"), compile_grammar_);
  const auto timeout = std::chrono::milliseconds(field<int64_t>(j, "timeout_ms", "prefill"));
  const Clock::time_point deadline = Clock::now() + timeout;
  const int64_t num_tokens = static_cast<int64_t>(request.prompt.size());
  queued_prompt_tokens_ += num_tokens;
  struct Done {
    std::atomic<int64_t>& queued;
    int64_t n;
    ~Done() { queued -= n; }
  } done_guard{queued_prompt_tokens_, num_tokens};

  // A prompt-only request (max_tokens 0: scoring the prompt) ends here, as on a local engine: its
  // one output, with the prompt logprobs, is the answer, and no KV moves.
  if (request.stop.max_tokens == 0) {
    RELAY_CHECK(!j.contains("kv"), "prefill: a prompt-only request (max_tokens 0) takes no \"kv\"");
    auto handle = loop_.submit(std::move(request));
    const ReleaseOnExit release_guard{loop_, handle->id()};
    const RequestOutput out = wait_finished(*handle, deadline, timeout);
    prefill_tokens_done_ += num_tokens;
    reply = json{{"output", output_to_json(out)}}.dump();
    return;
  }

  const json kv = field<json>(j, "kv", "prefill");
  std::vector<KvPoolDesc> dst_pools = field<std::vector<KvPoolDesc>>(kv, "ranks", "kv");
  const std::vector<RegionDescriptor> dst_regions =
      field<std::vector<RegionDescriptor>>(kv, "regions", "kv");
  const std::vector<int32_t> dst_table = field<std::vector<int32_t>>(kv, "block_table", "kv");
  const int dst_heads = field<int>(kv, "num_kv_heads", "kv");
  const int64_t token_begin = field<int64_t>(kv, "token_begin", "kv");
  RELAY_CHECK(token_begin >= 0 && token_begin < num_tokens, "kv: token_begin ", token_begin,
              " outside the ", num_tokens, "-token prompt");

  // The prompt only: one token sampled (under the request's grammar and logit_bias, its prompt
  // scored when it asks), the KV kept for the transfer.
  EngineRequest first_only = std::move(request);
  first_only.stop.max_tokens = 1;
  first_only.stop.min_tokens = 0;
  first_only.stop.stop_strings.clear();
  first_only.hold_kv = true;
  auto handle = loop_.submit(std::move(first_only));
  const ReleaseOnExit release_guard{loop_, handle->id()};
  RequestOutput last = wait_finished(*handle, deadline, timeout);
  RELAY_CHECK(last.new_tokens.size() == 1 && !last.kv_blocks.empty(),
              "prefill produced no first token");

  {
    std::lock_guard lock(mu_);
    for (const RegionDescriptor& r : dst_regions) {
      if (imported_.insert(r.id).second) transfer_->import_region(r);
    }
  }
  const int per_rank = pools_.front().layout.num_blocks;
  const int partition = last.kv_blocks.front() / per_rank;
  std::vector<int32_t> src_table = last.kv_blocks;
  for (int32_t& b : src_table) b -= partition * per_rank;
  const KvTransferSide src{num_kv_heads_, sides_.at(partition).pools, src_table};
  const KvTransferSide dst{dst_heads, dst_pools, dst_table};
  std::vector<KvCopy> copies = plan_kv_copies(src, dst, {token_begin, num_tokens});
  // A hybrid model's state after the prompt, from the request's held slot into the reservation's.
  const std::vector<StatePoolDesc>& src_states = sides_.at(partition).state_pools;
  RELAY_CHECK(src_states.empty() == !kv.contains("state"), "kv: ",
              src_states.empty() ? "the decode worker sends a recurrent-state destination, but this "
                                   "prefill worker's model has no linear-attention layers"
                                 : "no \"state\" destination, but this prefill worker's model has "
                                   "linear-attention layers (serve the same model on both roles)");
  if (!src_states.empty()) {
    const json& state = kv.at("state");
    const std::vector<StatePoolDesc> dst_states =
        field<std::vector<StatePoolDesc>>(state, "ranks", "kv.state");
    RELAY_CHECK(last.state_slot >= 0, "prefill kept no recurrent-state slot");
    const StateTransferSide from{num_k_heads_, num_v_heads_, src_states,
                                 last.state_slot - partition * state_slots_per_rank_};
    const StateTransferSide to{field<int>(state, "num_k_heads", "kv.state"),
                               field<int>(state, "num_v_heads", "kv.state"), dst_states,
                               field<int32_t>(state, "slot", "kv.state")};
    const std::vector<KvCopy> state_copies = plan_state_copies(from, to);
    copies.insert(copies.end(), state_copies.begin(), state_copies.end());
  }
  const Clock::time_point transfer_deadline = std::min(
      deadline, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(options_.transfer_timeout_s)));
  const Clock::time_point transfer_start = Clock::now();
  const TransferResult result =
      transfer_->submit({next_transfer_id_++, transfer_copies(copies), transfer_deadline}).get();
  const double transfer_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - transfer_start).count();
  if (result.status != TransferStatus::Ok) {
    status = result.status == TransferStatus::DeadlineExceeded ? 504 : 502;
    reply =
        error_json(str("KV transfer ", transfer_status_name(result.status), ": ", result.reason));
    return;
  }
  prefill_tokens_done_ += num_tokens;
  std::fprintf(stderr,
               "relay: KV hand-off: %lld tokens, %llu bytes in %llu copies, %.3f ms (%.2f GB/s)\n",
               static_cast<long long>(num_tokens - token_begin),
               static_cast<unsigned long long>(result.bytes_copied),
               static_cast<unsigned long long>(result.num_copies_done), transfer_ms,
               transfer_ms > 0 ? result.bytes_copied / transfer_ms / 1e6 : 0.0);
  FirstToken first;
  first.token.token = last.new_tokens[0];
  if (!last.logprobs.empty()) {
    first.token.logprob = last.logprobs[0].logprob;
    first.token.top = last.logprobs[0].top;
  }
  first.num_cached_tokens = last.num_cached_tokens;
  first.prompt_logprobs = std::move(last.prompt_logprobs);
  reply = json{{"first", first_token_to_json(first)},
               {"bytes", result.bytes_copied},
               {"copies", result.num_copies_done},
               {"transfer_ms", transfer_ms}}
              .dump();
}

void DisaggWorker::generate(http::Exchange& ex) {
  std::shared_ptr<server::RequestHandle> handle;
  try {
    const json j = parse_json(ex.request().body, "a generate message");
    const int64_t id = field<int64_t>(j, "id", "generate");
    EngineRequest request =
        request_from_json(field<json>(j, "request", "generate"), compile_grammar_);
    const FirstToken first = first_token_from_json(field<json>(j, "first", "generate"));
    {
      std::lock_guard lock(mu_);
      RELAY_CHECK(reservations_.erase(id) == 1, "no KV reservation ", id,
                  " (unknown, used or expired)");
    }
    handle = loop_.submit_prefilled(id, std::move(request), first.token, first.num_cached_tokens);
  } catch (const std::exception& e) {
    ex.respond(http::Response{400, "application/json", error_json(e.what()), {}});
    return;
  }
  // One output per line; a blank line when nothing happened for a while, so a router that went
  // away is noticed by a failed write and the request aborted.
  bool ok = ex.start_stream(200, "application/x-ndjson");
  Clock::time_point last_write = Clock::now();
  while (ok && !handle->done()) {
    for (const RequestOutput& o : handle->next(kPollInterval)) {
      ok = ok && ex.write(output_to_json(o).dump() + "\n");
      last_write = Clock::now();
    }
    if (ok && Clock::now() - last_write > kStreamHeartbeat) {
      ok = ex.write("\n");
      last_write = Clock::now();
    }
  }
  if (!ok) {
    loop_.abort(handle->id());
    return;
  }
  if (!handle->error().empty()) ex.write(error_json(handle->error()) + "\n");
}

void add_worker_routes(http::Server& svr, const std::string& role,
                       std::function<DisaggWorker*()> worker,
                       std::shared_ptr<ControlPlaneAuth> auth) {
  // Only the router's signed messages are obeyed (when the control plane is authenticated).
  auto refusal = [auth](const http::Request& req) -> std::optional<http::Response> {
    if (!auth) return std::nullopt;
    const std::optional<std::string> why = auth->verify(req);
    if (!why) return std::nullopt;
    return http::Response{401, "application/json", error_json("refused: " + *why), {}};
  };
  // Runs a control message: 503 while loading, 400 for a malformed one, 500 for an engine failure.
  auto guarded = [worker, refusal](auto fn) {
    return [worker, refusal, fn](const http::Request& req) {
      if (auto no = refusal(req)) return *no;
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
      } catch (const JsonError& e) {
        status = 400;
        reply = error_json(str("malformed message: ", e.what()));
      } catch (const json::exception& e) {
        status = 400;
        reply = error_json(str("malformed message: ", e.what()));
      } catch (const Error& e) {
        status = 500;
        reply = error_json(e.what());
      }
      return http::Response{status, "application/json", reply, {}};
    };
  };
  using Req = const http::Request&;
  if (role == "decode") {
    svr.route_blocking("POST", "/disagg/reserve",
                       guarded([](DisaggWorker& w, Req q, std::string& r, int& s) {
                         w.reserve(q.body, r, s);
                       }));
    svr.route_blocking(
        "POST", "/disagg/release",
        guarded([](DisaggWorker& w, Req q, std::string&, int&) { w.release(q.body); }));
    // Streams, so it writes its own response.
    svr.route("POST", "/disagg/generate", [worker, refusal](http::Exchange& ex) {
      if (auto no = refusal(ex.request())) {
        ex.respond(*no);
      } else if (DisaggWorker* w = worker()) {
        w->generate(ex);
      } else {
        ex.respond(http::Response{503, "application/json",
                                  error_json("the worker is still loading"), {}});
      }
    });
  } else {
    svr.route_blocking("POST", "/disagg/prefill",
                       guarded([](DisaggWorker& w, Req q, std::string& r, int& s) {
                         w.prefill(q.body, r, s);
                       }));
  }
}

void DisaggWorker::heartbeat_loop() {
  std::unique_ptr<httplib::Client> router;
  if (!options_.router.empty()) {
    router = control_client(options_.router, options_.tls, std::chrono::seconds(2));
  }
  const auto interval = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options_.heartbeat_interval_s));
  bool refused_logged = false;
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
    json beat = capacity_;
    beat.update({{"url", options_.url},
                 {"role", options_.role},
                 {"num_running", s.num_running},
                 {"num_waiting", s.num_waiting},
                 {"kv_cache_usage", s.kv_cache_usage},
                 {"queued_prompt_tokens", queued_prompt_tokens_.load()},
                 {"prefill_tokens_total", prefill_tokens_done_.load()}});
    // NOTE: a router that is down or restarting just misses beats; the next one re-registers.
    const std::string body = beat.dump();
    httplib::Headers headers;
    if (options_.auth) {
      for (auto& [name, value] : options_.auth->sign("POST", "/disagg/heartbeat", body))
        headers.emplace(name, value);
    }
    const auto r = router->Post("/disagg/heartbeat", headers, body, "application/json");
    if (r && r->status == 401 && !refused_logged) {
      // Once: a worker the router refuses keeps beating (the router may be restarted with the
      // right secret), but one line says why it never shows up.
      std::fprintf(stderr, "relay: the router refused this worker's heartbeat: %s\n",
                   r->body.c_str());
      refused_logged = true;
    }
  }
}

}  // namespace relay::disagg

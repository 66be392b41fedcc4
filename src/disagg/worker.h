// A prefill or decode worker of a disaggregated deployment (`relay serve --role prefill|decode`).
//
// The worker is an ordinary engine process (the OpenAI API keeps working on it) plus the internal
// routes the router drives, and a heartbeat to the router. The KV pools of the CPU backend's ranks
// are registered with a transfer engine; their descriptors travel in the control messages, so a
// prefill worker can write straight into a decode worker's pages:
//
//   decode  POST /disagg/reserve  {"prompt"}              -> {"id", "kv": side}  (503: full)
//   prefill POST /disagg/prefill  {"request", "kv": side, "timeout_ms"}
//                                 -> {"first"} after the KV landed; {"output"} without "kv"
//   decode  POST /disagg/generate {"id", "request", "first"} -> one RequestOutput per line
//   decode  POST /disagg/release  {"id"}                  -> {}  (a reservation not needed)
//
// "side" is the destination of a transfer: {"num_kv_heads", "ranks": [KvPoolDesc], "regions":
// [RegionDescriptor], "block_table"} for the DP rank holding the reservation (block ids local to
// it); a hybrid model's side adds "state": {"num_k_heads", "num_v_heads", "ranks":
// [StatePoolDesc], "slot"}, where the prompt's recurrent state goes (transfer/state_pool.h
// re-shards it as the layout mapper does the KV). The prefill worker runs the prompt with
// max_tokens 1 and hold_kv, plans the copies from its ranks into that side with the layout mapper
// (re-sharding heads, re-blocking pages), pushes them with a deadline, then frees its blocks; a
// failure frees them too and answers 502 / 504, so the router can release the reservation. A
// request's grammar and logit_bias constrain the first token there and the rest on the decode
// worker (each compiles the grammar's spec against its own vocabulary); its prompt logprobs are
// computed with the prompt and come back with the first token. A prompt-only request (max_tokens
// 0, scoring) comes without "kv": it runs to its end on the prefill worker, whose answer is its
// one output. A decode reservation that is never used expires. The generate stream sends a blank
// line while the request waits, so a router that went away is noticed by a failed write and the
// request is aborted.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "disagg/protocol.h"
#include "engine/backend.h"
#include "http/server.h"
#include "server/engine_loop.h"
#include "transfer/kv_pool.h"
#include "transfer/state_pool.h"
#include "transfer/transfer_engine.h"

#include <nlohmann/json.hpp>

namespace relay::disagg {

class ControlPlaneAuth;

struct WorkerOptions {
  std::string role;    // "prefill" or "decode"
  std::string router;  // the router's "host:port" or URL (https: TLS); empty: no heartbeats
  std::string url;     // how the router reaches this worker: "http(s)://host:port"
  std::string layout;  // its ranks, reported to the router ("tp=2 ep=1 dp=1")
  double heartbeat_interval_s = 1.0;
  double transfer_timeout_s = 30.0;     // prefill: the KV must land at the decode worker by then
  double reservation_timeout_s = 60.0;  // decode: an unused reservation is freed after this
  std::string ucx_transports;           // UCX_TLS-style transport list; empty: UCX chooses
  std::string kv_transport =
      "auto";  // "auto" (ucx for host pools, cuda_ipc for device), "ucx", "cuda_ipc"
  // Signs the heartbeats (disagg/auth.h); null: an unauthenticated control plane.
  std::shared_ptr<ControlPlaneAuth> auth;
  // The client side of TLS to an https router (disagg/control_client.h).
  http::TlsOptions tls;
};

class DisaggWorker {
 public:
  // `engine` runs on `loop`'s thread; its backend must export its KV pools
  // (Backend::kv_pool_exports): host pools travel over UCX, device pools over CUDA IPC.
  // `compile_grammar` compiles the grammars the router's requests carry against this worker's
  // vocabulary (the process's own GrammarCompiler, so its cache serves both APIs).
  DisaggWorker(WorkerOptions options, LLMEngine& engine, server::EngineLoop& loop,
               CompileGrammar compile_grammar);
  ~DisaggWorker();

  // Starts the heartbeats (and the reservation sweeper on a decode worker).
  void start();
  void stop();

  // The control messages (bodies and replies are JSON; see the routes above).
  void reserve(const std::string& body, std::string& reply, int& status);
  void release(const std::string& body);
  void prefill(const std::string& body, std::string& reply, int& status);
  void generate(http::Exchange& ex);

 private:
  void heartbeat_loop();

  // The ranks of one DP group as one side of a transfer, fixed once the regions are registered.
  struct Side {
    std::vector<KvPoolDesc> pools;  // for the layout mapper
    std::vector<StatePoolDesc> state_pools;  // hybrid models' recurrent state, else empty
    // {"num_kv_heads", "ranks", "regions"} and, for a hybrid model, "state": {"num_k_heads",
    // "num_v_heads", "ranks"}; sent with reservations (which add "block_table", "token_begin" and
    // state.slot)
    nlohmann::json announcement;
  };
  // State pool regions: region_base_ + kStateRegionOffset + rank (the KV pools' are
  // region_base_ + rank).
  static constexpr RegionId kStateRegionOffset = RegionId{1} << 16;

  WorkerOptions options_;
  server::EngineLoop& loop_;
  CompileGrammar compile_grammar_;
  std::vector<KvPoolExport> pools_;  // every rank's, in rank order
  int num_kv_heads_ = 0;             // the model's
  int num_k_heads_ = 0, num_v_heads_ = 0;  // its Gated DeltaNet heads (hybrid models)
  int state_slots_per_rank_ = 0;           // recurrent-state slots per DP rank (hybrid models)
  std::unique_ptr<TransferEngine> transfer_;
  RegionId region_base_ = 0;  // this worker's region ids: region_base_ + rank
  std::vector<Side> sides_;   // by DP rank
  nlohmann::json capacity_;   // what every heartbeat reports besides the load
  std::mutex mu_;
  std::unordered_set<RegionId> imported_;  // remote regions already imported
  std::unordered_map<int64_t, std::chrono::steady_clock::time_point>
      reservations_;                              // decode: id -> expiry
  std::atomic<int64_t> queued_prompt_tokens_{0};  // prefill: prompts in flight here
  std::atomic<int64_t> prefill_tokens_done_{0};
  std::atomic<int64_t> next_transfer_id_{1};
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread heartbeat_thread_;
};

// Adds the role's routes to `server` (before it starts listening); until `worker()` returns a
// worker (the model is still loading) they answer 503. With `auth`, a message without the
// router's valid signature gets 401 and does nothing.
void add_worker_routes(http::Server& server, const std::string& role,
                       std::function<DisaggWorker*()> worker,
                       std::shared_ptr<ControlPlaneAuth> auth);

}  // namespace relay::disagg

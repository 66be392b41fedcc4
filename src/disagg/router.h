// The router of a disaggregated deployment (`relay serve --role router`): the OpenAI front end of
// server/http_server.h in front of remote prefill and decode workers instead of a local engine.
//
// Each request runs on its own thread through three control messages (worker.h has the routes):
//   1. reserve KV pages on a decode worker (the smallest batch); a full one answers 503 and the
//      next one is tried; when none has room the request waits (bounded) and tries again, and
//      when none is up at all it fails at once (503);
//   2. send the prompt and that reservation to a prefill worker (the fewest queued prompt tokens),
//      which computes it, samples the first token and writes the KV straight into the reserved
//      pages; a prefill worker that cannot be reached is marked down and the request is re-sent to
//      another (the reservation is released and taken anew);
//   3. start the request on the decode worker and relay its stream of outputs into the request's
//      handle, which the front end formats exactly as for a local engine.
// A request's grammar and logit_bias apply on both workers (the first token's sample and the
// rest), its prompt logprobs come from the prefill worker with the first token and go into its
// first output here. A prompt-only request (max_tokens 0: scoring the prompt) takes step 2 alone,
// without a reservation: the prefill worker's answer is its one output.
// A decode worker that dies mid-stream ends its requests with an error (502: their tokens already
// went out, so they are not restarted) and is marked down; workers that beat again are used again.
// While no prefill or no decode worker is up, /health answers 503 with the reason.
// Nothing waits unbounded: every call has a timeout, and a client that goes away aborts the
// request, which closes the decode stream, which aborts it on the decode worker.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "disagg/registry.h"
#include "http/server.h"
#include "server/engine_loop.h"
#include "server/metrics.h"

namespace httplib {
class Result;
}

namespace relay::disagg {

class ControlPlaneAuth;

struct RouterOptions {
  double wait_for_workers_s = 30.0;  // how long a request waits for a worker with room (then 503)
  double prefill_timeout_s = 60.0;   // prompt computed and KV landed
  double stream_timeout_s = 30.0;    // silence on a decode stream (it beats every 0.5 s)
  int max_attempts = 3;              // prefill attempts per request
  // The shared secret's signatures (disagg/auth.h): heartbeats must carry one and calls to workers
  // are signed. Null: an unauthenticated control plane (loopback deployments, tests).
  std::shared_ptr<ControlPlaneAuth> auth;
  std::string api_key;  // --api-key: also lets a person read /disagg/workers
  // The client side of TLS to workers with https URLs (disagg/control_client.h).
  http::TlsOptions tls;
};

class DisaggRouter : public server::RequestSink {
 public:
  DisaggRouter(RouterOptions options, WorkerRegistry& registry, server::Metrics& metrics);
  ~DisaggRouter() override;

  // POST /disagg/heartbeat (workers, signed), GET /disagg/workers (for people and tests: signed,
  // or with the API key, when either is configured).
  void add_routes(http::Server& server);

  std::shared_ptr<server::RequestHandle> submit(EngineRequest request) override;
  void abort(int64_t id) override;
  int num_unfinished() const override { return num_unfinished_.load(); }
  void stop() override;
  // While no prefill or no decode worker is up, every request fails (503), and /health says why.
  std::string unusable_reason() const override;

 private:
  struct Live;
  void run(std::shared_ptr<Live> live, EngineRequest request);
  // One attempt: reserve, prefill, stream. Returns an error message to retry with, or "" when the
  // request ended (finished, failed for good, or aborted).
  std::string attempt(Live& live, const EngineRequest& request, bool& retry);
  // http_status: 503 when no worker can take the request, 502 when a worker failed it.
  void finish_failed(Live& live, const std::string& message, int http_status);
  void finish_aborted(Live& live);
  void publish_gauges();
  // POSTs a control message to a worker (signed when the control plane is authenticated).
  httplib::Result post(const std::string& url, const std::string& path, const std::string& body,
                       std::chrono::milliseconds read_timeout);

  RouterOptions options_;
  WorkerRegistry& registry_;
  server::Metrics& metrics_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<int64_t, std::shared_ptr<Live>> live_;
  int num_threads_ = 0;
  bool stopping_ = false;
  std::atomic<int64_t> next_id_{1};
  std::atomic<int> num_unfinished_{0};
};

}  // namespace relay::disagg

// The engine thread: one thread owns the LLMEngine and runs its steps; HTTP threads talk to it.
//
// HTTP threads submit requests and aborts into a mutex-guarded inbox and read their outputs from a
// per-request RequestHandle (a queue with a condition variable), so no HTTP thread ever touches the
// engine and a slow client never slows a step. The thread sleeps when there is nothing to do and
// wakes on a submission. An engine error fails the requests it concerns (with a message) and the
// loop carries on.
//
// Delivery runs on a second thread. Pushing a step's outputs into their handles (latency metrics,
// a lock and a wakeup per request, and the woken HTTP threads competing for cores) costs the
// engine thread about as much as the step's own host work at hundreds of streams, and the GPU
// would idle meanwhile. So the engine thread hands each step's outputs over as one batch and goes
// on to the next step while the delivery thread pushes them. Everything that reaches a handle the
// engine loop serves goes through that one FIFO (outputs, aborts, failures), so each request sees
// its outputs in engine order and its failure after them. At most one batch waits unstarted: an
// engine thread that gets ahead of delivery waits for it, so memory and latency stay bounded.
// The loop keeps the serving metrics: per-token latencies as outputs are delivered, per-request
// totals when requests finish, step times by phase, and the engine gauges after each step.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "engine/llm_engine.h"
#include "server/metrics.h"

namespace relay::server {

class RequestHandle {
 public:
  explicit RequestHandle(int64_t id) : id_(id) {}
  int64_t id() const { return id_; }

  // Outputs since the last call; waits up to `timeout` when there are none yet. After the final
  // output (or an error) it returns immediately with nothing.
  std::vector<RequestOutput> next(std::chrono::milliseconds timeout);
  bool done() const;
  // The engine's message when the request failed (empty otherwise); valid once done().
  std::string error() const;
  // The HTTP status the failure maps to: 500 (the engine failed), 503 (no capacity to serve it).
  int error_status() const;

  // For the sink that produces the outputs (the engine loop, or the disaggregated router).
  void push(RequestOutput out);
  void fail(const std::string& message, int http_status = 500);

 private:
  friend class EngineLoop;
  friend void record_output(Metrics& metrics, RequestHandle& handle, const RequestOutput& out);

  const int64_t id_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<RequestOutput> outputs_;
  bool finished_ = false;  // the final output (or an error) was pushed
  std::string error_;
  int error_status_ = 500;
  const std::chrono::steady_clock::time_point arrival_ = std::chrono::steady_clock::now();
  // Touched only by the thread that records this request's outputs (the engine loop's delivery
  // thread, or the router).
  std::chrono::steady_clock::time_point last_token_;
  bool has_token_ = false;
};

// Records an output's latency metrics (TTFT, inter-token latency, tokens, the finished request)
// against the handle's arrival and last token, as every sink does before pushing the output.
void record_output(Metrics& metrics, RequestHandle& handle, const RequestOutput& out);

// Where the HTTP front end sends requests: the local engine thread (EngineLoop) or, in a
// disaggregated deployment, the router that drives remote prefill and decode workers.
class RequestSink {
 public:
  virtual ~RequestSink() = default;
  // Queues a request; returns its handle at once (a failure is reported through the handle).
  virtual std::shared_ptr<RequestHandle> submit(EngineRequest request) = 0;
  // Cancels a request (a no-op once it finished) and frees what it holds.
  virtual void abort(int64_t id) = 0;
  // Requests submitted and not yet finished.
  virtual int num_unfinished() const = 0;
  // Fails whatever is still in flight and stops taking requests.
  virtual void stop() = 0;
  // Why every request will fail from now on (empty while requests can succeed): /health reports it.
  virtual std::string unusable_reason() const { return {}; }
};

class EngineLoop : public RequestSink {
 public:
  EngineLoop(LLMEngine& engine, Metrics& metrics);
  ~EngineLoop() override;
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  std::shared_ptr<RequestHandle> submit(EngineRequest request) override;
  // Its blocks are freed before the next step.
  void abort(int64_t id) override;
  int num_unfinished() const override { return num_unfinished_.load(); }
  // Stops the thread, failing whatever is still in flight.
  void stop() override;
  // The backend's reason, as of its last failed step.
  std::string unusable_reason() const override;

  // Runs fn(engine) on the engine thread before its next step and returns its result; for the
  // disaggregated worker's KV reservations and releases. The future holds fn's exception, or a
  // relay::Error when the loop has stopped.
  template <typename Fn>
  auto call(Fn fn) -> std::future<decltype(fn(std::declval<LLMEngine&>()))> {
    using Result = decltype(fn(std::declval<LLMEngine&>()));
    auto promise = std::make_shared<std::promise<Result>>();
    std::future<Result> result = promise->get_future();
    const bool queued = enqueue_task([promise, fn = std::move(fn)](LLMEngine& engine) mutable {
      try {
        if constexpr (std::is_void_v<Result>) {
          fn(engine);
          promise->set_value();
        } else {
          promise->set_value(fn(engine));
        }
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    });
    if (!queued) promise->set_exception(std::make_exception_ptr(Error("the engine has stopped")));
    return result;
  }
  // A fresh request id (for a KV reservation that submit_prefilled later turns into a request).
  int64_t new_id() { return next_id_++; }
  // Starts request `id`, whose prompt's KV is already in blocks reserved under `id`, from the first
  // token a prefill worker sampled; returns its handle (the first output is already in it). A
  // request the engine refuses fails its handle and frees the reservation.
  std::shared_ptr<RequestHandle> submit_prefilled(int64_t id, EngineRequest request,
                                                  SampledToken first, int num_cached_tokens);

 private:
  // One item for the delivery thread: an output to push, or a failure to report.
  struct Delivery {
    std::shared_ptr<RequestHandle> handle;
    RequestOutput out;
    std::string error;  // set: fail the handle with it instead of pushing `out`
    int http_status = 500;
  };

  void run();
  bool enqueue_task(std::function<void(LLMEngine&)> task);  // false once stopping
  // Engine thread: queues `out` for its request's handle (and forgets a finished request).
  void deliver(RequestOutput out);
  // Engine thread: passes what deliver() queued to the delivery thread.
  void hand_off();
  void delivery_loop();
  void fail_all(const std::string& message, int http_status = 500);

  mutable std::mutex unusable_mu_;
  std::string unusable_;  // guarded by unusable_mu_: written by the engine thread, read by /health
  LLMEngine& engine_;
  Metrics& metrics_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<std::shared_ptr<RequestHandle>, EngineRequest>> inbox_;
  std::vector<int64_t> aborts_;
  std::vector<std::function<void(LLMEngine&)>> tasks_;
  bool stopping_ = false;
  std::atomic<int64_t> next_id_{1};
  std::atomic<int> num_unfinished_{0};
  std::unordered_map<int64_t, std::shared_ptr<RequestHandle>> live_;  // engine thread only
  std::vector<Delivery> pending_;  // engine thread only: queued since the last hand_off()

  std::mutex delivery_mu_;
  std::condition_variable delivery_cv_;  // a batch was queued, or the queue has room again
  std::deque<std::vector<Delivery>> delivery_queue_;
  bool delivery_stopping_ = false;  // set by the engine thread as it exits, after its last batch
  std::thread delivery_thread_;
  std::thread thread_;  // last: started once every member above is ready
};

}  // namespace relay::server

// The engine thread: one thread owns the LLMEngine and runs its steps; HTTP threads talk to it.
//
// HTTP threads submit requests and aborts into a mutex-guarded inbox and read their outputs from a
// per-request RequestHandle (a queue with a condition variable), so no HTTP thread ever touches the
// engine and a slow client never slows a step. The thread sleeps when there is nothing to do and
// wakes on a submission. It also keeps the serving metrics: per-token latencies as outputs leave
// the step, per-request totals when requests finish, and the engine gauges after each step.
// An engine error fails the requests it concerns (with a message) and the loop carries on.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

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

 private:
  friend class EngineLoop;
  void push(RequestOutput out);
  void fail(const std::string& message);

  const int64_t id_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<RequestOutput> outputs_;
  bool finished_ = false;  // the final output (or an error) was pushed
  std::string error_;
  // Touched by the engine thread only.
  std::chrono::steady_clock::time_point arrival_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_token_;
  bool has_token_ = false;
};

class EngineLoop {
 public:
  EngineLoop(LLMEngine& engine, Metrics& metrics);
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues a request; returns its handle at once.
  std::shared_ptr<RequestHandle> submit(EngineRequest request);
  // Cancels a request (a no-op once it finished); its blocks are freed before the next step.
  void abort(int64_t id);
  // Requests submitted and not yet finished.
  int num_unfinished() const { return num_unfinished_.load(); }
  // Stops the thread, failing whatever is still in flight.
  void stop();

 private:
  void run();
  void deliver(const RequestOutput& out);
  void fail_all(const std::string& message);

  LLMEngine& engine_;
  Metrics& metrics_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<std::shared_ptr<RequestHandle>, EngineRequest>> inbox_;
  std::vector<int64_t> aborts_;
  bool stopping_ = false;
  std::atomic<int64_t> next_id_{1};
  std::atomic<int> num_unfinished_{0};
  std::unordered_map<int64_t, std::shared_ptr<RequestHandle>> live_;  // engine thread only
  std::thread thread_;
};

}  // namespace relay::server

// The engine thread and the per-request output queues (see engine_loop.h).
#include "server/engine_loop.h"

#include <chrono>

#include "core/error.h"

namespace relay::server {

using Clock = std::chrono::steady_clock;

std::vector<RequestOutput> RequestHandle::next(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (outputs_.empty() && !finished_)
    cv_.wait_for(lock, timeout, [&] { return !outputs_.empty() || finished_; });
  std::vector<RequestOutput> out(std::make_move_iterator(outputs_.begin()),
                                 std::make_move_iterator(outputs_.end()));
  outputs_.clear();
  return out;
}

bool RequestHandle::done() const {
  std::lock_guard lock(mu_);
  return finished_ && outputs_.empty();
}

std::string RequestHandle::error() const {
  std::lock_guard lock(mu_);
  return error_;
}

void RequestHandle::push(RequestOutput out) {
  const bool final = out.finish != FinishReason::kNone;
  {
    std::lock_guard lock(mu_);
    if (final) finished_ = true;
    outputs_.push_back(std::move(out));
  }
  // NOTE: a handle has one reader; whoever wakes takes every queued output, so a token needs only
  // one waiter woken. The final output wakes them all, since each must see done().
  if (final) {
    cv_.notify_all();
  } else {
    cv_.notify_one();
  }
}

int RequestHandle::error_status() const {
  std::lock_guard lock(mu_);
  return error_status_;
}

void RequestHandle::fail(const std::string& message, int http_status) {
  {
    std::lock_guard lock(mu_);
    finished_ = true;
    error_ = message;
    error_status_ = http_status;
  }
  cv_.notify_all();
}

EngineLoop::EngineLoop(LLMEngine& engine, Metrics& metrics)
    : engine_(engine),
      metrics_(metrics),
      delivery_thread_([this] { delivery_loop(); }),
      thread_([this] { run(); }) {}

EngineLoop::~EngineLoop() { stop(); }

std::shared_ptr<RequestHandle> EngineLoop::submit(EngineRequest request) {
  auto handle = std::make_shared<RequestHandle>(next_id_++);
  {
    std::lock_guard lock(mu_);
    // NOTE: a request that slipped past the server's drain check after the thread stopped would
    // wait forever; it fails at once instead.
    if (stopping_) {
      handle->fail("the server is shutting down");
      return handle;
    }
    ++num_unfinished_;
    inbox_.emplace_back(handle, std::move(request));
  }
  cv_.notify_one();
  return handle;
}

void EngineLoop::abort(int64_t id) {
  {
    std::lock_guard lock(mu_);
    aborts_.push_back(id);
  }
  cv_.notify_one();
}

void EngineLoop::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void record_output(Metrics& metrics, RequestHandle& h, const RequestOutput& out) {
  const Clock::time_point now = Clock::now();
  if (!out.new_tokens.empty()) {
    if (!h.has_token_) {
      metrics.observe_ttft(std::chrono::duration<double>(now - h.arrival_).count());
      metrics.add_tokens(static_cast<uint64_t>(out.num_prompt_tokens), 0);
      h.has_token_ = true;
    } else {
      metrics.observe_itl(std::chrono::duration<double>(now - h.last_token_).count());
    }
    h.last_token_ = now;
    metrics.add_tokens(0, out.new_tokens.size());
  }
  if (out.finish != FinishReason::kNone) {
    metrics.request_finished(finish_reason_name(out.finish),
                             std::chrono::duration<double>(now - h.arrival_).count(),
                             out.queue_time_s);
  }
}

void EngineLoop::deliver(RequestOutput out) {
  const auto it = live_.find(out.id);
  if (it == live_.end()) return;
  const bool final = out.finish != FinishReason::kNone;
  pending_.push_back({final ? std::move(it->second) : it->second, std::move(out), {}, 500});
  if (final) live_.erase(it);
}

void EngineLoop::hand_off() {
  if (pending_.empty()) return;
  {
    std::unique_lock lock(delivery_mu_);
    delivery_cv_.wait(lock, [&] { return delivery_queue_.empty(); });
    delivery_queue_.push_back(std::move(pending_));
  }
  delivery_cv_.notify_all();
  pending_ = {};
  pending_.reserve(static_cast<size_t>(engine_.max_num_seqs()));
}

void EngineLoop::delivery_loop() {
  for (;;) {
    std::vector<Delivery> batch;
    {
      std::unique_lock lock(delivery_mu_);
      delivery_cv_.wait(lock, [&] { return delivery_stopping_ || !delivery_queue_.empty(); });
      if (delivery_queue_.empty()) return;  // stopping, and everything was delivered
      batch = std::move(delivery_queue_.front());
      delivery_queue_.pop_front();
    }
    delivery_cv_.notify_all();  // the engine thread may be waiting for room
    const Clock::time_point start = Clock::now();
    int num_outputs = 0;
    for (Delivery& d : batch) {
      RequestHandle& h = *d.handle;
      // NOTE: counted as finished before the handle says so, as a reader that saw done() expects.
      if (!d.error.empty()) {
        --num_unfinished_;
        h.fail(d.error, d.http_status);
        continue;
      }
      record_output(metrics_, h, d.out);
      if (d.out.finish != FinishReason::kNone) --num_unfinished_;
      h.push(std::move(d.out));
      ++num_outputs;
    }
    metrics_.observe_delivery(num_outputs,
                              std::chrono::duration<double>(Clock::now() - start).count());
  }
}

bool EngineLoop::enqueue_task(std::function<void(LLMEngine&)> task) {
  {
    std::lock_guard lock(mu_);
    // A task queued after the thread stopped is dropped, which breaks its promise: the caller's
    // future throws instead of waiting forever.
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

std::shared_ptr<RequestHandle> EngineLoop::submit_prefilled(int64_t id, EngineRequest request,
                                                            SampledToken first,
                                                            int num_cached_tokens) {
  auto handle = std::make_shared<RequestHandle>(id);
  ++num_unfinished_;
  const bool queued =
      enqueue_task([this, handle, request = std::move(request), first = std::move(first),
                    num_cached_tokens](LLMEngine& engine) mutable {
        try {
          RequestOutput out = engine.add_prefilled_request(handle->id(), std::move(request), first,
                                                           num_cached_tokens);
          live_.emplace(handle->id(), handle);
          deliver(std::move(out));
        } catch (const Error& e) {
          // NOTE: the caller handed its reservation over with the request, so a request the engine
          // refuses (a first token its grammar does not allow, say) frees it here.
          engine.release_kv(handle->id());
          metrics_.request_finished("error", 0.0, 0.0);
          --num_unfinished_;
          handle->fail(e.what());
        }
      });
  if (!queued) {
    --num_unfinished_;
    handle->fail("the server is shutting down", 503);
  }
  return handle;
}

std::string EngineLoop::unusable_reason() const {
  std::lock_guard lock(unusable_mu_);
  return unusable_;
}

void EngineLoop::fail_all(const std::string& message, int http_status) {
  for (auto& [id, handle] : live_) {
    engine_.abort(id);
    metrics_.request_finished(
        "error", std::chrono::duration<double>(Clock::now() - handle->arrival_).count(), 0.0);
    // Through the delivery queue, so the failure reaches the handle after its earlier outputs.
    pending_.push_back({std::move(handle), {}, message, http_status});
  }
  live_.clear();
  hand_off();
}

void EngineLoop::run() {
  for (;;) {
    std::vector<std::pair<std::shared_ptr<RequestHandle>, EngineRequest>> inbox;
    std::vector<int64_t> aborts;
    std::vector<std::function<void(LLMEngine&)>> tasks;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] {
        return stopping_ || !inbox_.empty() || !aborts_.empty() || !tasks_.empty() ||
               engine_.has_work();
      });
      if (stopping_) break;
      inbox.swap(inbox_);
      aborts.swap(aborts_);
      tasks.swap(tasks_);
    }
    for (auto& task : tasks) task(engine_);
    for (auto& [handle, request] : inbox) {
      try {
        engine_.add_request(handle->id(), std::move(request));
        live_.emplace(handle->id(), handle);
      } catch (const Error& e) {
        metrics_.request_finished("error", 0.0, 0.0);
        --num_unfinished_;
        handle->fail(e.what());
      }
    }
    for (int64_t id : aborts) {
      if (auto out = engine_.abort(id)) deliver(std::move(*out));
    }
    hand_off();  // aborts and prefilled first tokens need not wait for the step
    try {
      const Clock::time_point t0 = Clock::now();
      std::vector<RequestOutput> outputs = engine_.step();
      const Clock::time_point t1 = Clock::now();
      for (RequestOutput& out : outputs) deliver(std::move(out));
      hand_off();
      const Clock::time_point t2 = Clock::now();
      const StepComposition ran = engine_.last_step();
      if (ran.num_seqs > 0) {
        metrics_.observe_step(ran.decode_only(), ran.num_seqs,
                              std::chrono::duration<double>(t2 - t0).count(),
                              {ran.schedule_s, ran.forward_s, ran.outputs_s,
                               std::chrono::duration<double>(t2 - t1).count()});
      }
    } catch (const std::exception& e) {
      // NOTE: a failed step leaves the batch half-applied; every live request is failed and freed
      // so the engine starts clean.
      fail_all(str("engine step failed: ", e.what()));
      std::string why = engine_.backend().unusable_reason();
      if (!why.empty()) {
        std::lock_guard lock(unusable_mu_);
        unusable_ = std::move(why);
      }
    }
    const EngineStats s = engine_.stats();
    metrics_.set_engine({s.num_running, s.num_waiting, s.kv_cache_usage, s.state_slot_usage,
                         s.num_cached_state_snapshots, s.scheduler.num_preemptions,
                         s.scheduler.prefix_cache_queries, s.scheduler.prefix_cache_hits,
                         s.spec_decode});
  }
  // Tasks queued before the stop still run (a prefilled request becomes live and is failed below).
  std::vector<std::function<void(LLMEngine&)>> tasks;
  {
    std::lock_guard lock(mu_);
    tasks.swap(tasks_);
  }
  for (auto& task : tasks) task(engine_);
  fail_all("the server is shutting down", 503);
  {
    std::lock_guard lock(delivery_mu_);
    delivery_stopping_ = true;
  }
  delivery_cv_.notify_all();
  delivery_thread_.join();  // so stop() returns with every handle done
  std::lock_guard lock(mu_);
  for (auto& [handle, request] : inbox_) {
    --num_unfinished_;
    handle->fail("the server is shutting down");
  }
  inbox_.clear();
}

}  // namespace relay::server

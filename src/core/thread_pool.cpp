// See thread_pool.h. Chunk c of a job with C chunks covers [n * c / C, n * (c + 1) / C).
#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>

namespace relay {

namespace {
// Set while a thread runs a task, so a nested parallel_for runs inline instead of deadlocking.
thread_local bool t_in_task = false;
// How long an idle worker polls before sleeping: long enough to bridge the gap between the ops of a
// decode step, short enough not to burn a core that another process needs.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);
// Chunks per thread: a few, so a late or preempted thread leaves little for the others to wait on.
constexpr int64_t kChunksPerThread = 4;
constexpr int64_t kMaxChunks = 0xffff;

uint32_t generation_of(uint64_t state) { return static_cast<uint32_t>(state >> 32); }
uint32_t chunks_of(uint64_t state) { return static_cast<uint32_t>(state >> 16) & 0xffff; }
uint32_t next_of(uint64_t state) { return static_cast<uint32_t>(state) & 0xffff; }
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  num_threads_ = num_threads;
  workers_.reserve(num_threads_ - 1);
  for (int i = 0; i + 1 < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    stop_.store(true, std::memory_order_release);
  }
  wake_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::work_on(uint32_t generation) {
  uint64_t state = state_.load(std::memory_order_acquire);
  for (;;) {
    if (generation_of(state) != generation || next_of(state) >= chunks_of(state)) return;
    if (!state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      continue;
    }
    const int64_t chunk = next_of(state), chunks = chunks_of(state);
    const int64_t begin = n_ * chunk / chunks, end = n_ * (chunk + 1) / chunks;
    if (begin < end) fn_(ctx_, begin, end);
    done_chunks_.fetch_add(1, std::memory_order_release);
    state = state_.load(std::memory_order_acquire);
  }
}

void ThreadPool::run(int64_t n, int64_t grain, TaskFn fn, void* ctx) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_chunks = (n + grain - 1) / grain;
  if (num_threads_ == 1 || max_chunks == 1 || t_in_task) {
    fn(ctx, 0, n);
    return;
  }
  const auto chunks = static_cast<uint32_t>(std::min({max_chunks, num_threads_ * kChunksPerThread, kMaxChunks}));
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  fn_ = fn;
  ctx_ = ctx;
  n_ = n;
  done_chunks_.store(0, std::memory_order_relaxed);
  const uint32_t generation = generation_of(state_.load(std::memory_order_relaxed)) + 1;
  state_.store((static_cast<uint64_t>(generation) << 32) | (static_cast<uint64_t>(chunks) << 16),
               std::memory_order_release);
  { std::lock_guard<std::mutex> lock(wake_mutex_); }  // a worker between its check and its wait sees the job
  wake_cv_.notify_all();

  t_in_task = true;
  work_on(generation);
  t_in_task = false;
  while (done_chunks_.load(std::memory_order_acquire) != static_cast<int>(chunks)) std::this_thread::yield();
}

void ThreadPool::worker_loop() {
  t_in_task = true;
  uint32_t seen = 0;
  for (;;) {
    const auto spin_until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
    uint32_t gen = generation_of(state_.load(std::memory_order_acquire));
    while (gen == seen && !stop_.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < spin_until) {
      gen = generation_of(state_.load(std::memory_order_acquire));
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(wake_mutex_);
      wake_cv_.wait(lock, [&] {
        return stop_.load(std::memory_order_acquire) || generation_of(state_.load(std::memory_order_acquire)) != seen;
      });
      gen = generation_of(state_.load(std::memory_order_acquire));
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = gen;
    work_on(gen);
  }
}

}  // namespace relay

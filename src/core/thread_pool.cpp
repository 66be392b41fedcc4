// See thread_pool.h. Chunk c of a job covers [n * c / chunks, n * (c + 1) / chunks); worker i runs
// chunk i + 1 and the caller runs chunk 0, so the split is a pure function of (n, chunks) and results
// that depend on it (none should) are reproducible.
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
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  num_threads_ = num_threads;
  workers_.reserve(num_threads_ - 1);
  for (int i = 0; i + 1 < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    stop_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::run_chunk(int chunk) {
  int64_t begin = n_ * chunk / num_chunks_;
  int64_t end = n_ * (chunk + 1) / num_chunks_;
  if (begin < end) fn_(ctx_, begin, end);
}

void ThreadPool::run(int64_t n, int64_t grain, TaskFn fn, void* ctx) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t max_chunks = (n + grain - 1) / grain;
  int chunks = static_cast<int>(std::min<int64_t>(num_threads_, max_chunks));
  if (chunks <= 1 || t_in_task) {
    fn(ctx, 0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  fn_ = fn;
  ctx_ = ctx;
  n_ = n;
  num_chunks_ = chunks;
  pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  { std::lock_guard<std::mutex> lock(wake_mutex_); }  // a worker between its check and its wait sees the new generation
  wake_cv_.notify_all();

  t_in_task = true;
  run_chunk(0);
  t_in_task = false;
  while (pending_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
}

void ThreadPool::worker_loop(int worker_index) {
  t_in_task = true;
  uint64_t seen = 0;
  for (;;) {
    auto spin_until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
    uint64_t gen = generation_.load(std::memory_order_acquire);
    while (gen == seen && std::chrono::steady_clock::now() < spin_until) {
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(wake_mutex_);
      wake_cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      gen = generation_.load(std::memory_order_acquire);
    }
    seen = gen;
    if (stop_.load(std::memory_order_acquire)) return;
    if (worker_index + 1 < num_chunks_) run_chunk(worker_index + 1);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace relay

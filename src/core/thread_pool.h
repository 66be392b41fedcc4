// A small persistent thread pool with one operation: parallel_for over an index range.
//
// The CPU backend calls parallel_for dozens of times per decode step, so workers are created once
// and woken per call (a short spin, then a condition variable: waking a sleeping thread costs tens of
// microseconds, which would dominate tiny decode ops). The calling thread takes the first chunk
// itself, so a pool of N threads starts N-1 workers and never runs more than N things at once; a
// server that runs several pools sizes them to share the machine's cores. Calls from inside a task
// (nesting) and calls while another thread is inside parallel_for on the same pool are serialised
// (nested ones run inline), so a pool is safe to share. Tasks must not throw: they are kernel loops
// over checked inputs.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace relay {

class ThreadPool {
 public:
  // num_threads counts the caller; 0 picks std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Splits [0, n) into at most num_threads() contiguous chunks of at least `grain` items each and runs
  // fn(begin, end) on every chunk; returns when all chunks are done.
  template <typename Fn>
  void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
    auto trampoline = [](void* ctx, int64_t begin, int64_t end) {
      (*static_cast<std::remove_reference_t<Fn>*>(ctx))(begin, end);
    };
    run(n, grain, trampoline, const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using TaskFn = void (*)(void* ctx, int64_t begin, int64_t end);
  void run(int64_t n, int64_t grain, TaskFn fn, void* ctx);
  void worker_loop(int worker_index);
  void run_chunk(int chunk);

  int num_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time

  // The current job, published by incrementing generation_.
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  int num_chunks_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex wake_mutex_;
  std::condition_variable wake_cv_;
};

}  // namespace relay

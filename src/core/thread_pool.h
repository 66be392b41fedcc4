// A small persistent thread pool with one operation: parallel_for over an index range.
//
// The CPU backend calls parallel_for dozens of times per decode step, so workers are created once
// and woken per call (a short spin, then a condition variable: waking a sleeping thread costs tens of
// microseconds, which would dominate tiny decode ops). The range is cut into a few chunks per thread
// and every participant — the caller included — claims chunks from a shared counter until none are
// left. So a worker that the OS has not scheduled (the machine is shared: the server, tests and
// builds all run on a few cores) never holds the call up: the caller simply runs its chunks. A pool of
// N threads starts N-1 workers and never runs more than N things at once. Calls from inside a task
// (nesting) run inline, and concurrent callers on one pool are serialised, so a pool is safe to
// share. Tasks must not throw: they are kernel loops over checked inputs. Which thread runs a chunk
// never changes what it computes, so results do not depend on scheduling.
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

  // Splits [0, n) into contiguous chunks of at least `grain` items and runs fn(begin, end) on every
  // chunk; returns when all chunks are done.
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
  void worker_loop();
  // Claims and runs chunks of job `generation` until none are left or a newer job replaced it.
  void work_on(uint32_t generation);

  int num_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time

  // The current job. `state_` packs (generation << 32 | num_chunks << 16 | next_chunk): claiming a
  // chunk is one compare-exchange that also proves the job is still the one the claimer woke for,
  // and the job's fields stay valid while any claimed chunk is unfinished.
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> done_chunks_{0};
  std::atomic<bool> stop_{false};
  std::mutex wake_mutex_;
  std::condition_variable wake_cv_;
};

}  // namespace relay

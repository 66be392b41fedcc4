// See local_group.h.
#include "parallel/local_group.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include "core/error.h"

namespace relay::parallel {
namespace {

struct GroupState {
  GroupState(int n, std::chrono::milliseconds t)
      : size(n), timeout(t), posted(n), posted_count(n) {}

  const int size;
  const std::chrono::milliseconds timeout;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;  // completed barriers
  int arrived = 0;          // ranks waiting in the current barrier
  bool aborted = false;
  // What each rank posted for the collective in progress (valid between its two barriers).
  std::vector<const void*> posted;
  std::vector<size_t> posted_count;
};

class LocalCommunicator : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<GroupState> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return state_->size; }

  void barrier() override {
    GroupState& g = *state_;
    std::unique_lock lock(g.mu);
    throw_if_aborted();
    const uint64_t gen = g.generation;
    if (++g.arrived == g.size) {
      g.arrived = 0;
      ++g.generation;
      g.cv.notify_all();
      return;
    }
    const bool done =
        g.cv.wait_for(lock, g.timeout, [&] { return g.generation != gen || g.aborted; });
    if (!done) {
      g.aborted = true;
      g.cv.notify_all();
      fail(str("rank ", rank_, " of ", g.size,
               ": the other ranks did not reach the collective within ", g.timeout.count(), " ms"));
    }
    throw_if_aborted();
  }

  void all_reduce_sum(float* data, size_t count) override {
    GroupState& g = *state_;
    post(data, count);
    barrier();
    for (int r = 0; r < g.size; ++r) {
      if (g.posted_count[r] != count) {
        abort();
        fail(str("all_reduce_sum: rank ", rank_, " reduces ", count, " values but rank ", r, " ",
                 g.posted_count[r]));
      }
    }
    // std::copy, not memcpy: a count of 0 may come with null buffers.
    scratch_.resize(count);
    const float* first = static_cast<const float*>(g.posted[0]);
    std::copy(first, first + count, scratch_.begin());
    for (int r = 1; r < g.size; ++r) {
      const float* src = static_cast<const float*>(g.posted[r]);
      for (size_t i = 0; i < count; ++i) scratch_[i] += src[i];
    }
    barrier();  // every rank has read every buffer: now each may overwrite its own
    std::copy(scratch_.begin(), scratch_.end(), data);
  }

  void all_to_all(std::span<const std::vector<float>> send,
                  std::vector<std::vector<float>>& recv) override {
    exchange(send, recv);
  }
  void all_to_all(std::span<const std::vector<int32_t>> send,
                  std::vector<std::vector<int32_t>>& recv) override {
    exchange(send, recv);
  }

  void abort() override {
    std::lock_guard lock(state_->mu);
    state_->aborted = true;
    state_->cv.notify_all();
  }

  void reset() override {
    std::lock_guard lock(state_->mu);
    state_->aborted = false;
    state_->arrived = 0;
  }

 private:
  void throw_if_aborted() const {
    if (state_->aborted)
      fail(str("rank ", rank_, " of ", state_->size, ": the group was aborted by a failed rank"));
  }

  void post(const void* data, size_t count) {
    std::lock_guard lock(state_->mu);
    state_->posted[rank_] = data;
    state_->posted_count[rank_] = count;
  }

  template <typename T>
  void exchange(std::span<const std::vector<T>> send, std::vector<std::vector<T>>& recv) {
    GroupState& g = *state_;
    RELAY_CHECK(static_cast<int>(send.size()) == g.size, "all_to_all: rank ", rank_, " passed ",
                send.size(), " send buffers for a group of ", g.size);
    post(send.data(), send.size());
    barrier();
    recv.resize(g.size);
    for (int s = 0; s < g.size; ++s) {
      const auto* theirs = static_cast<const std::vector<T>*>(g.posted[s]);
      recv[s].assign(theirs[rank_].begin(), theirs[rank_].end());
    }
    barrier();
  }

  std::shared_ptr<GroupState> state_;
  const int rank_;
  std::vector<float> scratch_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_local_group(int size,
                                                            std::chrono::milliseconds timeout) {
  RELAY_CHECK(size >= 1, "a communicator group needs at least one rank, got ", size);
  auto state = std::make_shared<GroupState>(size, timeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(std::make_unique<LocalCommunicator>(state, r));
  return comms;
}

}  // namespace relay::parallel

// Collectives between the ranks of one group: the interface every parallel layer talks to.
//
// A sharded model never knows how its ranks are connected. Attention and dense layers split across
// tensor-parallel ranks end with all_reduce_sum; an expert-parallel MoE whose ranks hold different
// tokens (DP attention) moves token rows to the ranks of their experts and back with all_to_all.
// The CPU implementation (local_group.h) connects threads of one process through shared memory, so
// CI runs every sharded configuration; a GPU implementation (NCCL, and Relay's own peer-memory
// kernels) provides the same calls over device buffers.
//
// Contract: every rank of a group makes the same sequence of calls with the same counts
// (all_reduce) — a collective is a rendezvous. Results are deterministic: all_reduce_sum adds the
// ranks' contributions in rank order, so every rank receives bit-identical sums and a sharded run
// is repeatable. A rank that fails inside a step aborts the group (abort()), which makes every
// other rank's pending and later collectives throw instead of waiting for a partner that will never
// come; reset() re-arms the group once all ranks have left the step. Every wait has a timeout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace relay::parallel {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data [count], the same count on every rank. On return every rank holds the element-wise sum
  // over ranks, added in rank order.
  virtual void all_reduce_sum(float* data, size_t count) = 0;
  // Rank r sends send[d] to rank d (send.size() == size()) and receives, in recv[s], what rank s
  // sent it. Sizes may differ per pair, and be zero.
  virtual void all_to_all(std::span<const std::vector<float>> send,
                          std::vector<std::vector<float>>& recv) = 0;
  virtual void all_to_all(std::span<const std::vector<int32_t>> send,
                          std::vector<std::vector<int32_t>>& recv) = 0;
  virtual void barrier() = 0;

  // Makes every pending and later collective of the group throw (one rank failed mid-step).
  virtual void abort() = 0;
  // Clears an abort; call when no rank is inside a collective.
  virtual void reset() = 0;
};

}  // namespace relay::parallel

// Which all-reduce a CustomAllReduce call runs: the heuristic, apart from the kernels.
//
// One-shot reads (N-1) x bytes per rank but has two barriers; two-shot reads 2 (N-1)/N x bytes and
// has three, so one-shot wins while the message is small enough that barrier latency dominates,
// and the crossover falls as N grows (each rank's one-shot traffic grows with N). The thresholds
// below are starting points taken from that model for H100/H200-class NVLink (~20 us per MB per
// peer read, ~3 us per barrier); `relay bench --mode collectives` measures the real crossover.
// NCCL takes over when the peers are not all load/store reachable (no NVLink path, another node
// outside the NVLink domain) or the message does not fit the staging buffer.
#pragma once

#include <cstddef>

namespace relay::parallel::cuda {

enum class AllReduceAlgorithm { kOneShot, kTwoShot, kNccl };

inline const char* all_reduce_algorithm_name(AllReduceAlgorithm a) {
  switch (a) {
    case AllReduceAlgorithm::kOneShot:
      return "one-shot";
    case AllReduceAlgorithm::kTwoShot:
      return "two-shot";
    case AllReduceAlgorithm::kNccl:
      return "nccl";
  }
  return "?";
}

// Largest message (bytes) one-shot serves for a group of num_ranks.
inline size_t one_shot_max_bytes(int num_ranks) {
  if (num_ranks <= 2) return size_t{1} << 20;
  if (num_ranks <= 4) return size_t{256} << 10;
  return size_t{128} << 10;
}

inline AllReduceAlgorithm choose_all_reduce_algorithm(size_t bytes, int num_ranks,
                                                      bool peers_reachable, size_t capacity_bytes) {
  if (!peers_reachable || bytes > capacity_bytes) return AllReduceAlgorithm::kNccl;
  return bytes <= one_shot_max_bytes(num_ranks) ? AllReduceAlgorithm::kOneShot
                                                : AllReduceAlgorithm::kTwoShot;
}

}  // namespace relay::parallel::cuda

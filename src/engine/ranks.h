// What the sharded backends (CpuBackend, CudaBackend) share about running a step on several ranks:
// which data-parallel rank runs each sequence, its block table in that rank's own block ids, and
// running one host thread per rank with the first failure reported.
//
// Data-parallel ranks partition the block ids: rank r holds [r B, (r + 1) B) of a pool of dp x B
// (Backend::num_kv_partitions). The block manager keeps every block of a sequence in one partition,
// so the first block names the rank; every other block is checked against it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/backend.h"

namespace relay {

// members[r]: the batch indices of the sequences DP rank r runs, in batch order. Throws
// relay::Error for a sequence whose first block lies outside the pool of dp x blocks_per_rank.
std::vector<std::vector<size_t>> split_by_kv_partition(std::span<const StepSequence> batch, int dp,
                                                       int blocks_per_rank);

// `s`'s block table in the ids of the rank whose partition starts at first_block. Throws naming
// the sequence and the block for a block of another partition.
void localize_block_table(const StepSequence& s, int32_t first_block, int blocks_per_rank,
                          std::vector<int32_t>& out);

// Runs fn(r) for every r in [0, n), each on its own thread (rank 0 on the caller's). When one
// throws, on_failure(r) runs on that thread (it aborts the group, so the other ranks leave their
// collectives) and the first exception is rethrown here once every thread has joined.
void run_on_rank_threads(size_t n, const std::function<void(size_t)>& fn,
                         const std::function<void(size_t)>& on_failure);

}  // namespace relay

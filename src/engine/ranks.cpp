// See ranks.h.
#include "engine/ranks.h"

#include <exception>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace relay {

std::vector<std::vector<size_t>> split_by_kv_partition(std::span<const StepSequence> batch, int dp,
                                                       int blocks_per_rank) {
  std::vector<std::vector<size_t>> members(dp);
  for (size_t i = 0; i < batch.size(); ++i) {
    RELAY_CHECK(!batch[i].block_table.empty(), "sequence ", batch[i].seq_id, " has no KV blocks");
    const int32_t first = batch[i].block_table[0];
    RELAY_CHECK(first >= 0 && first / blocks_per_rank < dp, "sequence ", batch[i].seq_id,
                " starts at block ", first, ", outside the pool of ",
                static_cast<int64_t>(dp) * blocks_per_rank);
    members[first / blocks_per_rank].push_back(i);
  }
  return members;
}

void localize_block_table(const StepSequence& s, int32_t first_block, int blocks_per_rank,
                          std::vector<int32_t>& out) {
  out.clear();
  for (size_t j = 0; j < s.block_table.size(); ++j) {
    const int32_t local = s.block_table[j] - first_block;
    RELAY_CHECK(local >= 0 && local < blocks_per_rank, "sequence ", s.seq_id, " block ", j, " is ",
                s.block_table[j], ", outside the blocks [", first_block, ", ",
                first_block + blocks_per_rank, ") of the rank that holds its KV");
    out.push_back(local);
  }
}

void run_on_rank_threads(size_t n, const std::function<void(size_t)>& fn,
                         const std::function<void(size_t)>& on_failure) {
  std::mutex mu;
  std::exception_ptr first_error;
  auto guarded = [&](size_t r) {
    try {
      fn(r);
    } catch (...) {
      {
        std::lock_guard lock(mu);
        if (!first_error) first_error = std::current_exception();
      }
      on_failure(r);
    }
  };
  std::vector<std::thread> threads;
  for (size_t r = 1; r < n; ++r) threads.emplace_back(guarded, r);
  if (n > 0) guarded(0);
  for (std::thread& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace relay

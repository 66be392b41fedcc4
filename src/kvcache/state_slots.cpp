// See state_slots.h.
#include "kvcache/state_slots.h"

#include <algorithm>

#include "core/error.h"

namespace relay {

StateSlotManager::StateSlotManager(int num_slots, int slots_per_sequence, int num_partitions)
    : num_slots_(num_slots), slots_per_sequence_(slots_per_sequence) {
  RELAY_CHECK(num_partitions >= 1, "state slots: num_partitions must be at least 1, got ",
              num_partitions);
  RELAY_CHECK(slots_per_sequence >= 1, "state slots: slots_per_sequence must be at least 1, got ",
              slots_per_sequence);
  RELAY_CHECK(num_slots > 0 && num_slots % num_partitions == 0, "state slots: ", num_slots,
              " slots do not split into ", num_partitions, " equal partitions");
  const int per = num_slots / num_partitions;
  RELAY_CHECK(per >= slots_per_sequence, "state slots: a partition of ", per,
              " slots cannot hold one sequence's ", slots_per_sequence);
  free_.resize(static_cast<size_t>(num_partitions));
  for (int p = 0; p < num_partitions; ++p) {
    // Highest first, so that allocation (from the back) hands out low ids first: easier to read.
    for (int32_t s = (p + 1) * per - 1; s >= p * per; --s) free_[p].push_back(s);
  }
}

int StateSlotManager::num_free_sequences(int partition) const {
  RELAY_CHECK(partition >= 0 && partition < num_partitions(), "state slots: partition ", partition,
              " outside [0, ", num_partitions(), ")");
  return static_cast<int>(free_[partition].size()) / slots_per_sequence_;
}

int StateSlotManager::num_free_slots() const {
  int n = 0;
  for (const auto& list : free_) n += static_cast<int>(list.size());
  return n;
}

bool StateSlotManager::allocate(int64_t seq_id, int partition) {
  RELAY_CHECK(partition >= 0 && partition < num_partitions(), "state slots: partition ", partition,
              " outside [0, ", num_partitions(), ")");
  if (const auto it = owned_.find(seq_id); it != owned_.end()) {
    RELAY_CHECK(partition_of_slot(it->second.front()) == partition, "state slots: sequence ",
                seq_id, " holds slots of partition ", partition_of_slot(it->second.front()),
                ", not ", partition);
    return true;
  }
  std::vector<int32_t>& list = free_[partition];
  if (static_cast<int>(list.size()) < slots_per_sequence_) return false;
  std::vector<int32_t> mine(list.end() - slots_per_sequence_, list.end());
  std::reverse(mine.begin(), mine.end());
  list.resize(list.size() - static_cast<size_t>(slots_per_sequence_));
  owned_.emplace(seq_id, std::move(mine));
  return true;
}

void StateSlotManager::free(int64_t seq_id) {
  const auto it = owned_.find(seq_id);
  if (it == owned_.end()) return;
  std::vector<int32_t>& list = free_[partition_of_slot(it->second.front())];
  list.insert(list.end(), it->second.rbegin(), it->second.rend());
  owned_.erase(it);
}

std::span<const int32_t> StateSlotManager::slots(int64_t seq_id) const {
  const auto it = owned_.find(seq_id);
  if (it == owned_.end()) return {};
  return it->second;
}

int StateSlotManager::partition_of(int64_t seq_id) const {
  const auto it = owned_.find(seq_id);
  return it == owned_.end() ? -1 : partition_of_slot(it->second.front());
}

void StateSlotManager::check_invariants() const {
  std::vector<int> seen(static_cast<size_t>(num_slots_), 0);
  for (int p = 0; p < num_partitions(); ++p) {
    for (int32_t s : free_[p]) {
      RELAY_CHECK(s >= 0 && s < num_slots_, "state slots: free slot ", s, " outside the pool");
      RELAY_CHECK(partition_of_slot(s) == p, "state slots: free list of partition ", p,
                  " holds slot ", s, " of partition ", partition_of_slot(s));
      ++seen[s];
    }
  }
  for (const auto& [seq, mine] : owned_) {
    RELAY_CHECK(static_cast<int>(mine.size()) == slots_per_sequence_, "state slots: sequence ", seq,
                " owns ", mine.size(), " slots, not ", slots_per_sequence_);
    for (int32_t s : mine) {
      RELAY_CHECK(s >= 0 && s < num_slots_, "state slots: sequence ", seq, " owns slot ", s,
                  " outside the pool");
      RELAY_CHECK(partition_of_slot(s) == partition_of_slot(mine.front()), "state slots: sequence ",
                  seq, " owns slots of two partitions");
      ++seen[s];
    }
  }
  for (int32_t s = 0; s < num_slots_; ++s) {
    RELAY_CHECK(seen[s] == 1, "state slots: slot ", s, " is ",
                seen[s] == 0 ? "neither free nor owned" : "free or owned more than once");
  }
}

}  // namespace relay

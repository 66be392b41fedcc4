// See state_snapshots.h.
#include "kvcache/state_snapshots.h"

#include <algorithm>

#include "core/error.h"

namespace relay {

StateSnapshotPool::StateSnapshotPool(int num_snapshots, int num_partitions)
    : num_snapshots_(num_snapshots) {
  RELAY_CHECK(num_partitions >= 1, "state snapshots: num_partitions must be at least 1, got ",
              num_partitions);
  RELAY_CHECK(num_snapshots > 0 && num_snapshots % num_partitions == 0,
              "state snapshots: ", num_snapshots, " snapshots do not split into ", num_partitions,
              " equal partitions");
  slots_.resize(static_cast<size_t>(num_snapshots));
  partitions_.resize(static_cast<size_t>(num_partitions));
  const int per = num_snapshots / num_partitions;
  for (int p = 0; p < num_partitions; ++p) {
    // Highest first, so that allocation (from the back) hands out low ids first.
    for (int32_t s = (p + 1) * per - 1; s >= p * per; --s) partitions_[p].free.push_back(s);
  }
}

StateSnapshotPool::Slot& StateSnapshotPool::slot(int32_t id) {
  RELAY_CHECK(id >= 0 && id < num_snapshots_, "state snapshot ", id, " outside [0, ",
              num_snapshots_, ")");
  return slots_[static_cast<size_t>(id)];
}

const StateSnapshotPool::Slot& StateSnapshotPool::slot(int32_t id) const {
  RELAY_CHECK(id >= 0 && id < num_snapshots_, "state snapshot ", id, " outside [0, ",
              num_snapshots_, ")");
  return slots_[static_cast<size_t>(id)];
}

int StateSnapshotPool::num_free(int partition) const {
  RELAY_CHECK(partition >= 0 && partition < num_partitions(), "state snapshots: partition ",
              partition, " outside [0, ", num_partitions(), ")");
  return static_cast<int>(partitions_[partition].free.size());
}

int32_t StateSnapshotPool::find(uint64_t hash, int32_t block) const {
  const auto it = by_hash_.find(hash);
  if (it == by_hash_.end() || slots_[static_cast<size_t>(it->second)].block != block) return -1;
  return it->second;
}

void StateSnapshotPool::touch(int32_t id) {
  Slot& s = slot(id);
  RELAY_CHECK(s.state == State::kCached, "state snapshot ", id, " touched but not cached");
  std::list<int32_t>& lru = partitions_[partition_of_snapshot(id)].lru;
  lru.splice(lru.end(), lru, s.lru);
}

void StateSnapshotPool::demote(int32_t id) {
  Slot& s = slot(id);
  RELAY_CHECK(s.state == State::kCached, "state snapshot ", id, " demoted but not cached");
  std::list<int32_t>& lru = partitions_[partition_of_snapshot(id)].lru;
  lru.splice(lru.begin(), lru, s.lru);
}

void StateSnapshotPool::pin(int32_t id) {
  Slot& s = slot(id);
  RELAY_CHECK(s.state == State::kCached, "state snapshot ", id, " pinned but not cached");
  ++s.pins;
}

void StateSnapshotPool::unpin(int32_t id) {
  Slot& s = slot(id);
  RELAY_CHECK(s.state == State::kCached && s.pins > 0, "state snapshot ", id,
              " unpinned but not pinned");
  --s.pins;
}

int32_t StateSnapshotPool::allocate(int partition) {
  RELAY_CHECK(partition >= 0 && partition < num_partitions(), "state snapshots: partition ",
              partition, " outside [0, ", num_partitions(), ")");
  Partition& p = partitions_[partition];
  int32_t id = -1;
  if (!p.free.empty()) {
    id = p.free.back();
    p.free.pop_back();
  } else {
    for (const int32_t victim : p.lru) {
      if (slots_[static_cast<size_t>(victim)].pins > 0) continue;
      drop(slots_[static_cast<size_t>(victim)].hash, slots_[static_cast<size_t>(victim)].block);
      id = p.free.back();  // drop returned the victim to the free list
      p.free.pop_back();
      break;
    }
    if (id < 0) return -1;
  }
  slots_[static_cast<size_t>(id)].state = State::kPending;
  return id;
}

void StateSnapshotPool::commit(int32_t id, uint64_t hash, int32_t block) {
  Slot& s = slot(id);
  RELAY_CHECK(s.state == State::kPending, "state snapshot ", id, " committed but not pending");
  if (const auto it = by_hash_.find(hash); it != by_hash_.end()) {
    if (slots_[static_cast<size_t>(it->second)].block == block) {
      // NOTE: the cached one was taken at the same prefix (the same cached block), so the two
      // states are equal; the older stays, already findable.
      touch(it->second);
      make_free(id);
      return;
    }
    drop(hash, slots_[static_cast<size_t>(it->second)].block);  // that block has left the cache
  }
  Partition& p = partitions_[partition_of_snapshot(id)];
  s.state = State::kCached;
  s.hash = hash;
  s.block = block;
  s.lru = p.lru.insert(p.lru.end(), id);
  by_hash_.emplace(hash, id);
}

void StateSnapshotPool::release(int32_t id) {
  RELAY_CHECK(slot(id).state == State::kPending, "state snapshot ", id,
              " released but not pending");
  make_free(id);
}

void StateSnapshotPool::drop(uint64_t hash, int32_t block) {
  const auto it = by_hash_.find(hash);
  if (it == by_hash_.end() || slots_[static_cast<size_t>(it->second)].block != block) return;
  const int32_t id = it->second;
  Slot& s = slots_[static_cast<size_t>(id)];
  RELAY_CHECK(s.pins == 0, "state snapshot ", id, " dropped while a sequence restores it");
  partitions_[partition_of_snapshot(id)].lru.erase(s.lru);
  by_hash_.erase(it);
  make_free(id);
}

void StateSnapshotPool::make_free(int32_t id) {
  Slot& s = slots_[static_cast<size_t>(id)];
  s = Slot{};
  partitions_[partition_of_snapshot(id)].free.push_back(id);
}

void StateSnapshotPool::check_invariants() const {
  std::vector<int> seen(slots_.size(), 0);
  for (int p = 0; p < num_partitions(); ++p) {
    for (const int32_t id : partitions_[p].free) {
      RELAY_CHECK(id >= 0 && id < num_snapshots_ && partition_of_snapshot(id) == p,
                  "state snapshots: free list of partition ", p, " holds snapshot ", id);
      RELAY_CHECK(slots_[static_cast<size_t>(id)].state == State::kFree, "state snapshot ", id,
                  " is in a free list but not free");
      ++seen[static_cast<size_t>(id)];
    }
    for (const int32_t id : partitions_[p].lru) {
      RELAY_CHECK(id >= 0 && id < num_snapshots_ && partition_of_snapshot(id) == p,
                  "state snapshots: LRU list of partition ", p, " holds snapshot ", id);
      const Slot& s = slots_[static_cast<size_t>(id)];
      RELAY_CHECK(s.state == State::kCached, "state snapshot ", id,
                  " is in an LRU list but not cached");
      const auto it = by_hash_.find(s.hash);
      RELAY_CHECK(it != by_hash_.end() && it->second == id, "cached state snapshot ", id,
                  " is missing from the hash index");
      ++seen[static_cast<size_t>(id)];
    }
  }
  RELAY_CHECK(static_cast<size_t>(std::count_if(
                  slots_.begin(), slots_.end(),
                  [](const Slot& s) { return s.state == State::kCached; })) == by_hash_.size(),
              "state snapshots: the hash index holds ", by_hash_.size(),
              " entries but not as many snapshots are cached");
  for (int32_t id = 0; id < num_snapshots_; ++id) {
    const Slot& s = slots_[static_cast<size_t>(id)];
    RELAY_CHECK(s.pins == 0 || s.state == State::kCached, "state snapshot ", id,
                " is pinned but not cached");
    const int want = s.state == State::kPending ? 0 : 1;
    RELAY_CHECK(seen[static_cast<size_t>(id)] == want, "state snapshot ", id, " is listed ",
                seen[static_cast<size_t>(id)], " times, expected ", want);
  }
}

}  // namespace relay

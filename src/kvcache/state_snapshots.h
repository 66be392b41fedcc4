// Recurrent-state snapshots: what lets a hybrid model (Qwen3.5, Qwen3-Next) take a prefix-cache
// hit.
//
// A cached prefix of KV blocks serves the attention layers, but a linear-attention layer's state
// after that prefix is not in the KV cache: it is one fixed-size state per sequence, advanced token
// by token and overwritten as it goes (recurrent_state.h). So the backend keeps, beside the
// sequences' state slots, `num_snapshots` snapshot slots, each a copy of one sequence's whole state
// (every recurrent layer) at a block boundary — vLLM's and SGLang's "align mode". This pool decides
// which snapshot slot holds which prefix; the backend writes and reads the bytes.
//
// Keying: a snapshot holds the state after the first (i + 1) * block_size tokens of some sequence,
// and is keyed by the chained hash of block i (block_manager.h), the hash that names that whole
// prefix. It also records the KV block id cached under that hash when it was taken, and lives only
// as long as that block stays cached under it (the scheduler drops it when the block manager
// uncaches the block: BlockManager::take_uncached), so a snapshot names exactly the prefix its
// block names, with the block manager's token check against hash collisions, and a hit uses it only
// when the hit's last block is that block.
//
// Life of a snapshot slot: *free*; *pending* (allocate: a step will write the state at a boundary
// into it; no hash yet, never evicted); *cached* (commit, once the step has run and the boundary's
// block is in the prefix cache: findable by hash, LRU ordered) or back to free (release: the state
// was not kept). A cached snapshot may be *pinned* by sequences that will restore it in the step
// being built (pin/unpin), and is evicted only when unpinned: allocate takes a free slot first,
// else the least recently used unpinned cached snapshot of the partition. A hit touches its
// snapshot (most recently used).
//
// Partitions: as state slots (state_slots.h), the ids split into `num_partitions` equal ranges,
// one per DP rank; a snapshot is taken and restored in the partition of the sequence's state.
//
// Invariants (check_invariants): every slot is exactly one of free (in its partition's free list),
// pending, or cached (in the hash index and its partition's LRU list); pins only on cached slots;
// one cached snapshot per hash.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace relay {

// A step's request to copy a sequence's state after token row `row` of its chunk (StepSequence::
// tokens) into snapshot `snapshot`.
struct SnapshotSave {
  int32_t row = 0;
  int32_t snapshot = -1;
};

class StateSnapshotPool {
 public:
  // `num_snapshots` must be a positive multiple of `num_partitions`.
  StateSnapshotPool(int num_snapshots, int num_partitions = 1);

  int num_snapshots() const { return num_snapshots_; }
  int num_partitions() const { return static_cast<int>(partitions_.size()); }
  int snapshots_per_partition() const { return num_snapshots_ / num_partitions(); }
  int partition_of_snapshot(int32_t id) const { return id / snapshots_per_partition(); }
  int num_cached() const { return static_cast<int>(by_hash_.size()); }
  int num_free(int partition) const;

  // The cached snapshot under `hash` whose KV block is `block`, -1 when there is none.
  int32_t find(uint64_t hash, int32_t block) const;
  // Marks a cached snapshot most recently used (a hit took it), or least recently used (demote:
  // the next to evict, as one its sequence has superseded).
  void touch(int32_t id);
  void demote(int32_t id);
  // Keeps a cached snapshot from eviction until as many unpin calls.
  void pin(int32_t id);
  void unpin(int32_t id);

  // A pending slot in `partition`: a free one, else the LRU unpinned cached snapshot's (evicted).
  // -1 when every slot of the partition is pending or pinned.
  int32_t allocate(int partition);
  // Caches pending snapshot `id` under `hash` and its KV `block`. When another snapshot already
  // holds `hash` with the same block, `id` goes back to free instead (the two hold the same
  // state); one with another block (which has left the cache since) is dropped.
  void commit(int32_t id, uint64_t hash, int32_t block);
  // Returns pending snapshot `id` to free (its state was not kept).
  void release(int32_t id);
  // Drops the cached snapshot under `hash` and `block`, if any (that block left the prefix cache;
  // one under the same hash and another block stays); a pinned one cannot be dropped (its block is
  // held by the sequence that pinned it).
  void drop(uint64_t hash, int32_t block);

  // Throws relay::Error naming the first broken invariant (see the top of this file).
  void check_invariants() const;

 private:
  enum class State : uint8_t { kFree, kPending, kCached };
  struct Slot {
    State state = State::kFree;
    uint64_t hash = 0;
    int32_t block = -1;
    int pins = 0;
    std::list<int32_t>::iterator lru;  // in its partition's lru while cached
  };
  struct Partition {
    std::vector<int32_t> free;  // taken from the back
    std::list<int32_t> lru;     // cached snapshots, least recently used first
  };
  Slot& slot(int32_t id);
  const Slot& slot(int32_t id) const;
  void make_free(int32_t id);

  int num_snapshots_;
  std::vector<Slot> slots_;
  std::vector<Partition> partitions_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
};

}  // namespace relay

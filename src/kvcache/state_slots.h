// Recurrent-state slots: the per-sequence memory of a model's linear-attention layers, beside the
// paged KV of its attention layers.
//
// A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) keeps no KV cache: each sequence carries a conv state
// and an fp32 [heads, dk, dv] state matrix per such layer, a fixed size however long the sequence
// (tens to hundreds of MiB per sequence at full size, shared/guide/hybrid-and-mtp.md §4.3). The
// backend owns that memory as `num_slots` equal slots, each holding one sequence's state for every
// recurrent layer; this manager decides which sequence owns which slots, as the block manager does
// for KV blocks. A sequence of a hybrid model therefore holds KV blocks (for its attention layers)
// and `slots_per_sequence` state slots: one, or 1 + k when speculative decoding keeps a scratch
// state per draft position so that rejected drafts roll back by choosing a slot instead of
// recomputing. All of a sequence's slots are taken and freed together.
//
// Partitions: with data-parallel attention each DP rank holds its own sequences' state, so the slot
// ids are split into `num_partitions` equal ranges as the block manager splits block ids, and a
// sequence's slots come from the partition its KV blocks are bound to.
//
// Prefix caching: a cached prefix of KV blocks is of no use to a recurrent layer unless the state
// after that prefix is kept too. Relay keeps state snapshots at block boundaries only ("align
// mode", what vLLM and SGLang settled on) in a pool keyed by the same chained block hash as the
// prefix cache (state_snapshots.h), filled as sequences' chunks reach block boundaries, and a
// prefix hit of a hybrid model is taken only up to the last boundary that has a snapshot, which
// the backend copies into the new sequence's state slot (scheduler.h). Without a snapshot pool
// (--num-state-snapshots 0, --no-prefix-caching) a model with recurrent layers takes no hit.
//
// Invariants (check_invariants): every slot is either free (in its partition's free list) or owned
// by exactly one sequence; a sequence owns exactly slots_per_sequence slots, all of one partition.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace relay {

class StateSlotManager {
 public:
  // `num_slots` must be a positive multiple of `num_partitions` and hold at least one sequence's
  // slots per partition.
  StateSlotManager(int num_slots, int slots_per_sequence = 1, int num_partitions = 1);

  int num_slots() const { return num_slots_; }
  int slots_per_sequence() const { return slots_per_sequence_; }
  int num_partitions() const { return static_cast<int>(free_.size()); }
  int slots_per_partition() const { return num_slots_ / num_partitions(); }
  int partition_of_slot(int32_t slot) const { return slot / slots_per_partition(); }
  // Sequences that could still get their slots in `partition`.
  int num_free_sequences(int partition) const;
  int num_free_slots() const;  // over all partitions
  double usage() const {
    return 1.0 - static_cast<double>(num_free_slots()) / num_slots_;
  }

  // Gives `seq_id` its slots in `partition`; false (and nothing changes) when the partition has too
  // few free ones. A sequence that already has its slots keeps them (it must ask in their
  // partition).
  bool allocate(int64_t seq_id, int partition);
  // Returns the slots of `seq_id` to their partition (nothing for an unknown sequence).
  void free(int64_t seq_id);
  bool has_sequence(int64_t seq_id) const { return owned_.count(seq_id) != 0; }
  // The slots of `seq_id` (empty for an unknown sequence): the first holds its state, the others
  // are its scratch states for draft positions.
  std::span<const int32_t> slots(int64_t seq_id) const;
  // The partition of `seq_id`'s slots, -1 for an unknown sequence.
  int partition_of(int64_t seq_id) const;

  // Throws relay::Error naming the first broken invariant (see the top of this file).
  void check_invariants() const;

 private:
  int num_slots_;
  int slots_per_sequence_;
  std::vector<std::vector<int32_t>> free_;  // per partition; slots are taken from the back
  std::unordered_map<int64_t, std::vector<int32_t>> owned_;
};

}  // namespace relay

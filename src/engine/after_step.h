// What a backend does after a step has sampled, the same for both backends (cpu_backend.cpp,
// engine/cuda/): which of `sampled` belong to which sequence, the recurrent-state copies that roll
// a hybrid model's drafted sequences back to their last accepted token, and the rows an MTP draft
// head computes.
//
// MTP: per sequence, its catch-up rows — the head's row j reads the token after row j of the
// step's chunk and the target's final hidden state at row j, for every row the step committed —
// and the token after the last of them. The head then chains: its last catch-up row's draft, at
// the next position, on the head's own output there, and so on for K drafts (model/mtp.h has the
// forward).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/backend.h"

namespace relay {

// Per batch index, the run of `sampled` (Backend::step's result shape: per sampling sequence, in
// batch order, its accepted drafts and the token after them) that belongs to it; empty for a
// sequence that does not sample, or that another node sampled (`sampled` holds only this node's).
std::vector<std::span<const SampledToken>> tokens_per_sequence(
    std::span<const StepSequence> batch, std::span<const SampledToken> sampled);

// One copy of a whole recurrent-state slot: from s.state_slots[from] to s.state_slots[to_slot],
// or to prefix-cache snapshot `to_snapshot` when that is >= 0.
struct StateCopy {
  int32_t from = 0;
  int32_t to_slot = -1;
  int32_t to_snapshot = -1;
  bool operator==(const StateCopy&) const = default;
};
// After a step verified `accepted` of s's drafts: the copies, in order, that fill each of s's
// prefix-cache saves at an accepted row with that row's state, and leave s.state_slots[0] holding
// the state after its last accepted token. The step left the state after row j of s.tokens in
// draft slot 1 + j for j < num_draft_tokens, and after its last row in slot 0 — unless `padded`
// (a CUDA verify graph ran filler rows after it, moving slot 0 on), when that row's state is in
// draft slot 1 + num_draft_tokens too.
std::vector<StateCopy> draft_state_copies(const StepSequence& s, size_t accepted, bool padded);

struct MtpCatchUp {
  int rows = 0;             // of the step's chunk (0: none)
  int32_t next_token = -1;  // the token after the last of them
  // The drafts the head proposes for the sequence (0: it wants none): the catch-up's last row
  // gives the first, chain row k (1 <= k < drafts) the next.
  int drafts = 0;
  int32_t first_position = 0;  // the catch-up's first row's position (the step's num_computed)
  // The position chain row k computes at: right after the catch-up's last row, then one further
  // per row.
  int32_t chain_position(int k) const { return first_position + rows + k - 1; }
};

// A sampling sequence catches up over its rows up to its last accepted draft's (none when another
// node sampled it: that node drafts for it); a prompt chunk over all its rows when the token after
// it is known (the prompt's next, or an output's in a recompute), else over all but its last.
// A sequence that wants drafts (proposed_drafts set, this node sampled it) gets at most
// max_drafts, at most its max_proposed_drafts, and only chain rows inside its block table
// (block_size positions a block; the scheduler's lookahead blocks make room for max_drafts - 1).
std::vector<MtpCatchUp> plan_mtp_catch_up(std::span<const StepSequence> batch,
                                          std::span<const SampledToken> sampled, int max_drafts,
                                          int block_size);

}  // namespace relay

// What an MTP draft head computes after a step, for both backends (cpu_backend.cpp,
// engine/cuda/mtp.cu): per sequence, its catch-up rows — the head's row j reads the token after
// row j of the step's chunk and the target's final hidden state at row j, for every row the step
// committed — and the token after the last of them. The head then chains: its last catch-up row's
// draft, at the next position, on the head's own output there, and so on for K drafts
// (model/mtp.h has the forward).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/backend.h"

namespace relay {

struct MtpCatchUp {
  int rows = 0;             // of the step's chunk (0: none)
  int32_t next_token = -1;  // the token after the last of them
};

// `sampled`: what the step returned for `batch` (per sampling sequence, its accepted drafts and
// the token after them, in batch order). A sampling sequence catches up over its rows up to its
// last accepted draft's; a prompt chunk over all its rows when the token after it is known (the
// prompt's next, or an output's in a recompute), else over all but its last.
std::vector<MtpCatchUp> plan_mtp_catch_up(std::span<const StepSequence> batch,
                                          std::span<const SampledToken> sampled);

}  // namespace relay

// The CPU communicator: the ranks are threads of one process and exchange data through shared
// memory (parallel/communicator.h has the contract).
//
// Each collective is a rendezvous on a generation-counted barrier: every rank posts a pointer to
// its buffer, waits for the others, reads what it needs straight from their buffers, and waits
// again before anyone may reuse a buffer. No copies through a staging area, and a sum is computed
// by every rank in rank order, so all ranks hold identical results. It exists for correctness (CI
// runs TP/EP/DP-sharded models on it), not speed: an all-reduce costs each rank size x count adds.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "parallel/communicator.h"

namespace relay::parallel {

// Makes the `size` communicators of one group; communicator r is rank r. They share state, so the
// group lives until the last one is destroyed. A collective that waits longer than `timeout` for
// the other ranks aborts the group and throws.
std::vector<std::unique_ptr<Communicator>> make_local_group(
    int size, std::chrono::milliseconds timeout = std::chrono::minutes(5));

}  // namespace relay::parallel

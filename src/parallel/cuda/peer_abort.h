// How a GPU rank group gives up on a collective instead of hanging: the group's abort record.
//
// Every peer wait of Relay's collective kernels (peer_sync.cuh) spins on a flag a peer rank sets.
// When that rank never gets there — its host thread threw before enqueuing the collective, or its
// kernel is stuck — the waiters must leave, and every later collective of the same step must not
// wait again (a step has two collectives per layer: 48 layers x a timeout each is a hang). So the
// group keeps one PeerAbort in pinned host memory mapped into every device. A wait that has spun
// for kAbortPollAfterNs starts reading `raised` too, and leaves as soon as it is set; a wait that
// reaches its timeout records itself in its rank's slot and sets `raised`, which releases every
// other waiter of the group at once. The host sets `raised` when a rank's step throws
// (ThreadPeerGroup::abandon). Abandoned kernels return without trapping — their outputs are
// garbage but every access stays in bounds — so the CUDA contexts survive: the host reads the
// record after the step, fails the step on every rank with the record's description, and resets
// the group's windows before the next one (ThreadPeerGroup::reset_after_abort).
//
// No device atomics touch this memory (PCIe hosts need not support them): `raised` only ever goes
// from 0 to 1, so racing writers agree, and each rank's slot is written by that rank's blocks only;
// two of its blocks timing out together may mix their fields, which only blurs the report.
#pragma once

#include <cstdint>
#include <string>

#include "parallel/cuda/all_reduce.h"

namespace relay::parallel::cuda {

enum class PeerOp : uint32_t { kNone = 0, kAllReduceBarrier, kMoeDispatch, kMoeCombine };

// Peer waits shorter than this never read the record: a collective that completes normally pays
// no PCIe read for it.
constexpr uint64_t kAbortPollAfterNs = 20'000;

struct PeerWaitRecord {
  uint32_t what;   // PeerOp, 0 while the slot is empty (written last)
  uint32_t block;  // the waiting block
  uint32_t peer;   // the rank waited for
  uint32_t seen, expected;
  uint32_t waited_ms;
};

struct PeerAbort {
  uint32_t raised;                     // 0 until a wait timed out or the host abandoned the step
  PeerWaitRecord waits[kMaxRanks];     // [rank]: that rank's wait that timed out, if any
};

#ifdef __CUDACC__
#define RELAY_PEER_HOST_DEVICE __host__ __device__
#else
#define RELAY_PEER_HOST_DEVICE
#endif
// The name a report gives a wait (host and device: a wait without a record prints it and traps).
RELAY_PEER_HOST_DEVICE inline const char* peer_op_name(PeerOp op) {
  switch (op) {
    case PeerOp::kAllReduceBarrier: return "all-reduce barrier";
    case PeerOp::kMoeDispatch: return "moe dispatch";
    case PeerOp::kMoeCombine: return "moe combine";
    default: return "peer wait";
  }
}
#undef RELAY_PEER_HOST_DEVICE

// The timed-out waits of `record`, one line each ("moe dispatch: rank 1 (block 0) waited 5000 ms
// for rank 0: flag 3, expected 4"); empty when none timed out.
std::string describe_timeouts(const PeerAbort& record, int num_ranks);

}  // namespace relay::parallel::cuda

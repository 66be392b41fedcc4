// Device-side signalling between ranks through peer-visible memory: the release/acquire flag
// operations and the timed spin-wait every Relay collective kernel uses.
//
// A flag is a uint32 that only ever grows (per-call epochs), so a waiter asks "has it reached v"
// with a wrap-safe comparison instead of "is it v": a fast peer may already have moved the flag on
// to its next call's value, which must count as reached. Stores and loads use the system scope
// because the other end is another GPU (over NVLink) — or, when peers are emulated on one GPU,
// another block of the same grid, for which system scope is merely stronger than needed.
//
// NOTES: a signal is published by one thread after a __syncthreads(); the __threadfence_system()
// before the release store makes the whole block's earlier writes (and reads: a barrier after
// reading tells the peer its buffer may be reused) visible before the flag, which the PTX model's
// cumulativity already implies, but the explicit fence keeps the argument local. Data that peers
// wrote is read with ld.global.cg (L2, not L1): an L1 line filled earlier in the same kernel may
// hold the value from before the peer's write.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "parallel/cuda/peer_abort.h"

namespace relay::parallel::cuda {

__device__ __forceinline__ void store_release_sys(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* flag) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Whether `flag` has reached `target`, for counters that may wrap around 2^32.
__device__ __forceinline__ bool flag_reached(uint32_t flag, uint32_t target) {
  return static_cast<int32_t>(flag - target) >= 0;
}

// Spins until *flag reaches target. A late peer (peer_abort.h): once the group's record says the
// step was abandoned the wait returns at once; at timeout_ns it records itself in its rank's slot
// and raises the record, releasing every other waiter. Without a record (abort null: a group that
// has none) it prints who waited for whom and traps, so a peer that never arrives cannot hang the
// GPU forever.
__device__ __forceinline__ void wait_flag(const uint32_t* flag, uint32_t target,
                                          uint64_t timeout_ns, PeerAbort* abort, PeerOp op,
                                          int rank, int peer) {
  if (flag_reached(load_acquire_sys(flag), target)) return;
  const uint64_t start = global_timer_ns();
  while (true) {
    const uint32_t seen = load_acquire_sys(flag);
    if (flag_reached(seen, target)) return;
    const uint64_t waited = global_timer_ns() - start;
    if (abort != nullptr && waited > kAbortPollAfterNs && load_acquire_sys(&abort->raised) != 0)
      return;
    if (waited > timeout_ns) {
      if (abort == nullptr) {
        printf("relay %s: rank %d (block %d) waited %llu ms for rank %d: flag %u, expected %u\n",
               peer_op_name(op), rank, blockIdx.x,
               static_cast<unsigned long long>(timeout_ns / 1000000), peer, seen, target);
        __trap();
      }
      PeerWaitRecord* w = &abort->waits[rank];
      w->block = blockIdx.x;
      w->peer = static_cast<uint32_t>(peer);
      w->seen = seen;
      w->expected = target;
      w->waited_ms = static_cast<uint32_t>(waited / 1000000);
      __threadfence_system();
      store_release_sys(&w->what, static_cast<uint32_t>(op));
      store_release_sys(&abort->raised, 1u);
      return;
    }
  }
}

// Releases the block's prior accesses to `flag` (in a peer's memory) with value v.
__device__ __forceinline__ void signal_flag(uint32_t* flag, uint32_t value) {
  __threadfence_system();
  store_release_sys(flag, value);
}

}  // namespace relay::parallel::cuda

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

// Spins until *flag reaches target; after timeout_ns prints who waited for whom and traps (a peer
// that never arrives must not hang the GPU forever).
__device__ __forceinline__ void wait_flag(const uint32_t* flag, uint32_t target,
                                          uint64_t timeout_ns, const char* what, int rank,
                                          int peer) {
  if (flag_reached(load_acquire_sys(flag), target)) return;
  const uint64_t start = global_timer_ns();
  while (true) {
    const uint32_t seen = load_acquire_sys(flag);
    if (flag_reached(seen, target)) return;
    if (global_timer_ns() - start > timeout_ns) {
      printf("relay %s: rank %d (block %d) waited %llu ms for rank %d: flag %u, expected %u\n",
             what, rank, blockIdx.x, static_cast<unsigned long long>(timeout_ns / 1000000), peer,
             seen, target);
      __trap();
    }
  }
}

// Releases the block's prior accesses to `flag` (in a peer's memory) with value v.
__device__ __forceinline__ void signal_flag(uint32_t* flag, uint32_t value) {
  __threadfence_system();
  store_release_sys(flag, value);
}

}  // namespace relay::parallel::cuda

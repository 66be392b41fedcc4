// Relay's all-reduce kernels over peer memory: one-shot (latency) and two-shot (bandwidth).
//
// Every rank owns one peer-visible window (an NCCL symmetric window on a real group; a plain device
// buffer per emulated rank on one GPU) laid out as AllReduceWindow: signal flags, then a staging
// area. A kernel copies the rank's input into its own staging area, meets the peers at a barrier,
// and reads the peers' staging areas directly (loads over NVLink):
//   one-shot: every rank sums all N staging areas, in rank order, into its output. Each rank reads
//             (N-1) x bytes remotely; two barriers; best for small messages.
//   two-shot: reduce-scatter — rank r sums slice r of all N staging areas in rank order and writes
//             it into its own staging slice — then all-gather: every rank copies slice q from rank
//             q's staging. Each rank reads 2 (N-1)/N x bytes remotely; three barriers.
// Sums are fp32 in rank order, rounded to the element type once, so both algorithms give every
// rank the same bits as the CPU reference (collectives_reference.h).
//
// Barriers are per block: block b of every rank meets only block b of the others, through
// flags[b][source] in each window. Both kernels partition the elements among blocks the same way in
// every phase (a grid-stride loop over 16-byte units within a slice), so block b only ever reads
// what the peers' blocks b wrote before the barrier. A barrier's value is the block's own epoch
// counter (kept in the window, advanced by each barrier), which lives on the device: nothing is
// passed from the host per call, so the launches are capturable in a CUDA graph and replayable. A
// barrier after the last read lets every rank overwrite its staging in the next call; the next call
// starts only after this kernel ended on this rank (stream order), so the blocks need no pairing
// across calls with different grids.
//
// Emulation: a launch serves `num_local_ranks` ranks at once (blockIdx.y = which rank), so a test
// runs N ranks on one GPU in a single launch. Every block of that grid must be resident at once
// (blocks spin on each other); the launch checks the grid fits the GPU and refuses otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace relay::parallel::cuda {

constexpr int kMaxRanks = 8;

struct PeerAbort;  // peer_abort.h
constexpr int kMaxAllReduceBlocks = 64;
constexpr int kAllReduceThreads = 512;

// The head of every rank's all-reduce window; the staging area follows at kStagingOffset.
struct AllReduceWindow {
  // flags[b][q]: the last barrier value block b of rank q signalled to this rank.
  uint32_t flags[kMaxAllReduceBlocks][kMaxRanks];
  // epochs[b]: barriers block b of this rank has passed. Only this rank touches it.
  uint32_t epochs[kMaxAllReduceBlocks];
  // Staging (16-byte aligned, page aligned in fact): [capacity bytes] this rank's copy of its
  // input; in two-shot, slice r is overwritten with the reduced slice.
  static constexpr size_t kStagingOffset = 4096;
};
static_assert(sizeof(AllReduceWindow) <= AllReduceWindow::kStagingOffset);

// Bytes of window needed for a staging area of `capacity_bytes`.
inline size_t all_reduce_window_bytes(size_t capacity_bytes) {
  return AllReduceWindow::kStagingOffset + capacity_bytes;
}

// What a kernel running as one rank sees of the group.
struct AllReduceRankView {
  void* data;                // [count] of dtype: this rank's input, overwritten with the sum
  int rank;                  // in [0, num_ranks)
  char* windows[kMaxRanks];  // [num_ranks] every rank's window as this rank addresses it
};

struct PeerAllReduceParams {
  AllReduceRankView ranks[kMaxRanks];  // [num_local_ranks]: 1 on a real group, N when emulating
  int num_local_ranks = 1;
  int num_ranks = 1;          // group size N, 1..kMaxRanks
  size_t count = 0;           // elements per rank
  DType dtype = DType::F32;   // F32 or BF16
  size_t capacity_bytes = 0;  // staging bytes of every window; count x element size must fit
  int max_blocks = 32;        // blocks per rank (<= kMaxAllReduceBlocks); the same on all ranks
  uint64_t timeout_ns = 10'000'000'000;  // peer wait before giving up
  PeerAbort* abort = nullptr;  // the group's record (peer_abort.h); null: a late peer traps
};

// The params of a launch as rank `rank` alone (a real group: num_local_ranks 1) over the group's
// `num_ranks` windows.
PeerAllReduceParams one_rank_params(int rank, const std::vector<char*>& windows, void* data,
                                    size_t count, DType dtype, size_t capacity_bytes,
                                    int max_blocks, uint64_t timeout_ms,
                                    PeerAbort* abort = nullptr);

// In place on every view's data. count 0 launches nothing (every rank skips alike).
void launch_one_shot_all_reduce(const PeerAllReduceParams& p, cudaStream_t stream);
void launch_two_shot_all_reduce(const PeerAllReduceParams& p, cudaStream_t stream);
// A barrier alone (one block, slot 0 of the flags); count, data, dtype are ignored.
void launch_peer_barrier(const PeerAllReduceParams& p, cudaStream_t stream);

}  // namespace relay::parallel::cuda

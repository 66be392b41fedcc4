// N ranks' peer windows on one GPU: what the GPU tests and the one-GPU benchmark run the collective
// kernels on. Each "rank" gets its own zeroed device buffer; every rank addresses every window by
// the same pointer (one GPU, one address space), so the views passed to a kernel list the same
// pointers for every rank. A launch with num_local_ranks = N then plays the whole group.
#pragma once

#include <cstddef>
#include <vector>

namespace relay::parallel::cuda {

class EmulatedPeerWindows {
 public:
  // num_ranks buffers of `bytes` each on the current device, zeroed.
  EmulatedPeerWindows(int num_ranks, size_t bytes);
  ~EmulatedPeerWindows();
  EmulatedPeerWindows(const EmulatedPeerWindows&) = delete;
  EmulatedPeerWindows& operator=(const EmulatedPeerWindows&) = delete;

  const std::vector<char*>& windows() const { return windows_; }  // [num_ranks]
  size_t bytes() const { return bytes_; }

 private:
  std::vector<char*> windows_;
  size_t bytes_ = 0;
};

}  // namespace relay::parallel::cuda

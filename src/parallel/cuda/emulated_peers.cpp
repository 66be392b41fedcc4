// See emulated_peers.h.
#include "parallel/cuda/emulated_peers.h"

#include "parallel/cuda/cuda_check.h"

namespace relay::parallel::cuda {

EmulatedPeerWindows::EmulatedPeerWindows(int num_ranks, size_t bytes) : bytes_(bytes) {
  RELAY_CHECK(num_ranks >= 1, "emulated peers: ", num_ranks, " ranks");
  for (int r = 0; r < num_ranks; ++r) {
    char* w = nullptr;
    const cudaError_t rc = cudaMalloc(&w, bytes);
    if (rc != cudaSuccess) {
      for (char* done : windows_) cudaFree(done);
      fail(str("emulated peers: cannot allocate ", num_ranks, " windows of ", bytes,
               " bytes: ", cudaGetErrorString(rc)));
    }
    windows_.push_back(w);
    RELAY_CUDA_CHECK(cudaMemset(w, 0, bytes));
  }
}

EmulatedPeerWindows::~EmulatedPeerWindows() {
  for (char* w : windows_) cudaFree(w);
}

}  // namespace relay::parallel::cuda

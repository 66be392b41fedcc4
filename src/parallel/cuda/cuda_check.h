// Host-side checks for the GPU collectives: CUDA and NCCL calls that throw relay::Error naming the
// call, and the co-residency check for grids whose blocks wait on each other.
//
// The CUDA macros are the same as kernels/cuda/common.cuh's (that header holds device code, so the
// .cpp files here cannot include it); the guard keeps one definition when a file includes both.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#ifndef RELAY_CUDA_CHECK
// Throws relay::Error naming the CUDA call and the error string.
#define RELAY_CUDA_CHECK(call)                                                                     \
  do {                                                                                             \
    cudaError_t relay_cuda_err_ = (call);                                                          \
    RELAY_CHECK(relay_cuda_err_ == cudaSuccess, #call, ": ", cudaGetErrorString(relay_cuda_err_)); \
  } while (0)
#endif

#ifndef RELAY_CUDA_CHECK_LAUNCH
// After a launch: throws naming the kernel when the launch failed (bad config, missing image).
#define RELAY_CUDA_CHECK_LAUNCH(kernel_name)                               \
  do {                                                                     \
    cudaError_t relay_cuda_err_ = cudaGetLastError();                      \
    RELAY_CHECK(relay_cuda_err_ == cudaSuccess, "launch of ", kernel_name, \
                " failed: ", cudaGetErrorString(relay_cuda_err_));         \
  } while (0)
#endif

namespace relay::parallel::cuda {

// Throws unless every block of `grid` can be resident on the current GPU at once. Kernels whose
// blocks spin on flags other blocks of the same grid set (peers emulated on one GPU, the MoE
// combine) would deadlock if some blocks had to wait for others to finish before being scheduled.
template <typename Kernel>
void ensure_co_resident(Kernel kernel, dim3 grid, int threads, size_t smem_bytes,
                        const char* name) {
  int device = 0, num_sms = 0, per_sm = 0;
  RELAY_CUDA_CHECK(cudaGetDevice(&device));
  RELAY_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  RELAY_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes));
  const long long blocks = static_cast<long long>(grid.x) * grid.y * grid.z;
  RELAY_CHECK(blocks <= static_cast<long long>(per_sm) * num_sms, name, ": a grid of ", blocks,
              " blocks of ", threads, " threads cannot be resident at once on this GPU (", num_sms,
              " SMs x ", per_sm, " blocks); its blocks wait on each other, so it would deadlock");
}

}  // namespace relay::parallel::cuda

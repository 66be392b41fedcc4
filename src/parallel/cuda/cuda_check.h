// Host-side checks for the GPU collectives: CUDA and NCCL calls that throw relay::Error naming the
// call, and the co-residency check for grids whose blocks wait on each other.
//
// The CUDA macros are the same as kernels/cuda/common.cuh's (that header holds device code, so the
// .cpp files here cannot include it); the guard keeps one definition when a file includes both.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>

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
// The capacity of each (kernel, device, block size, shared memory) is queried once: the check runs
// before every launch of the exchange kernels, an eager prefill step's included.
template <typename Kernel>
void ensure_co_resident(Kernel kernel, dim3 grid, int threads, size_t smem_bytes,
                        const char* name) {
  struct Capacity {
    int num_sms = 0, per_sm = 0;
  };
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, size_t>, Capacity> known;
  int device = 0;
  RELAY_CUDA_CHECK(cudaGetDevice(&device));
  Capacity c;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const std::tuple<const void*, int, int, size_t> key{reinterpret_cast<const void*>(kernel),
                                                        device, threads, smem_bytes};
    auto it = known.find(key);
    if (it == known.end()) {  // queried before it is kept: a failed query leaves no entry
      Capacity q;
      RELAY_CUDA_CHECK(cudaDeviceGetAttribute(&q.num_sms, cudaDevAttrMultiProcessorCount, device));
      RELAY_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&q.per_sm, kernel, threads, smem_bytes));
      it = known.emplace(key, q).first;
    }
    c = it->second;
  }
  const long long blocks = static_cast<long long>(grid.x) * grid.y * grid.z;
  RELAY_CHECK(blocks <= static_cast<long long>(c.per_sm) * c.num_sms, name, ": a grid of ", blocks,
              " blocks of ", threads, " threads cannot be resident at once on this GPU (",
              c.num_sms, " SMs x ", c.per_sm,
              " blocks); its blocks wait on each other, so it would deadlock");
}

}  // namespace relay::parallel::cuda

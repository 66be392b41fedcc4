// Collectives over device buffers: what a sharded model on GPUs talks to, the device-side twin of
// parallel/communicator.h.
//
// Contract: every rank of the group makes the same sequence of calls with the same counts, each
// enqueued on a CUDA stream of that rank's GPU; a call returns once the work is enqueued, and the
// result is ready when the stream reaches it. Calls are in place: `data` holds this rank's input
// and receives the element-wise sum over ranks. Implementations whose kernels are Relay's own
// (CustomAllReduce) add the ranks' contributions in rank order in fp32 and round once, so every
// rank receives bit-identical sums and a run is repeatable; NCCL (NcclCommunicator) promises
// neither the order nor the rounding. Calls are safe to capture in a CUDA graph when the
// implementation says so (both do, for sizes fixed at capture). A rank that never arrives makes the
// others fail loudly: NCCL by its own timeout handling; Relay's kernels, within one process
// (ThreadPeerGroup), by abandoning the step on every rank through the group's abort record
// (peer_abort.h), and across processes (CustomAllReduce, no shared record) by trapping after their
// peer-wait timeout, which takes the CUDA context down.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace relay::parallel::cuda {

using bf16 = __nv_bfloat16;

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data [count] on this rank's GPU; the same count on every rank; count 0 is a no-op.
  virtual void all_reduce_sum(float* data, size_t count, cudaStream_t stream) = 0;
  virtual void all_reduce_sum(bf16* data, size_t count, cudaStream_t stream) = 0;
  // Work enqueued on `stream` after the barrier starts only once every rank's stream reached it.
  virtual void barrier(cudaStream_t stream) = 0;
};

}  // namespace relay::parallel::cuda

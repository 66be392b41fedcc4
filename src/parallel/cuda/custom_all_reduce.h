// CustomAllReduce: Relay's own all-reduce (all_reduce.h) behind the DeviceCommunicator interface,
// with NCCL as the fallback, and the peer barrier.
//
// It allocates one symmetric window (signals + a staging area of `capacity_bytes`) on the NCCL
// communicator it is given, and picks per call (all_reduce_select.h): one-shot for small messages,
// two-shot above, NCCL when the peers are not all load/store reachable or the message exceeds the
// staging area. Custom calls sum in rank order (bit-identical on every rank and against the CPU
// reference); NCCL calls follow NCCL's order. Both are capturable in a CUDA graph. When the peers
// are not reachable nothing is allocated and every call goes to NCCL; fallback_reason() says why,
// so a caller (the benchmark, a startup log) can report it rather than silently run the slow path.
//
// Construction and destruction are collective (window registration); calls are enqueued on the
// caller's stream on this rank's device.
#pragma once

#include <memory>
#include <string>

#include "parallel/cuda/all_reduce.h"
#include "parallel/cuda/all_reduce_select.h"
#include "parallel/cuda/nccl_communicator.h"

namespace relay::parallel::cuda {

struct CustomAllReduceOptions {
  size_t capacity_bytes = size_t{64} << 20;  // largest message the custom kernels take
  int max_blocks = 32;                       // blocks per rank, <= kMaxAllReduceBlocks
  uint64_t peer_timeout_ms = 10'000;         // a peer wait longer than this traps
};

class CustomAllReduce : public DeviceCommunicator {
 public:
  CustomAllReduce(NcclCommunicator& nccl, CustomAllReduceOptions options = {});

  int rank() const override { return nccl_.rank(); }
  int size() const override { return nccl_.size(); }

  void all_reduce_sum(float* data, size_t count, cudaStream_t stream) override;
  void all_reduce_sum(bf16* data, size_t count, cudaStream_t stream) override;
  void barrier(cudaStream_t stream) override;

  // The algorithm all_reduce_sum uses for a message of `bytes`.
  AllReduceAlgorithm algorithm_for(size_t bytes) const;
  // Runs the given algorithm whatever the rule says (benchmarks, tests); one-shot / two-shot throw
  // when the peers are unreachable or the message exceeds the staging area.
  void all_reduce_sum(void* data, size_t count, DType dtype, AllReduceAlgorithm algorithm,
                      cudaStream_t stream);
  // Empty when the custom kernels are in use, else why every call goes to NCCL.
  const std::string& fallback_reason() const { return fallback_reason_; }

 private:
  PeerAllReduceParams params(void* data, size_t count, DType dtype) const;

  NcclCommunicator& nccl_;
  CustomAllReduceOptions options_;
  std::unique_ptr<SymmetricWindow> window_;
  std::string fallback_reason_;
};

}  // namespace relay::parallel::cuda

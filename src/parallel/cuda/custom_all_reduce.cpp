// See custom_all_reduce.h.
#include "parallel/cuda/custom_all_reduce.h"

#include "core/error.h"

namespace relay::parallel::cuda {

CustomAllReduce::CustomAllReduce(NcclCommunicator& nccl, CustomAllReduceOptions options)
    : nccl_(nccl), options_(options) {
  RELAY_CHECK(options_.max_blocks >= 1 && options_.max_blocks <= kMaxAllReduceBlocks,
              "custom all-reduce: max_blocks ", options_.max_blocks, " not in 1..",
              kMaxAllReduceBlocks);
  if (nccl.size() == 1) return;  // nothing to exchange: every call is a no-op
  if (nccl.size() > kMaxRanks)
    fallback_reason_ =
        str("the group has ", nccl.size(), " ranks; the custom kernels take up to ", kMaxRanks);
  else if (nccl.lsa_size() != nccl.size())
    fallback_reason_ = str("only ", nccl.lsa_size(), " of ", nccl.size(),
                           " ranks are load/store reachable (NVLink) from rank ", nccl.rank());
  if (!fallback_reason_.empty()) return;
  window_ =
      std::make_unique<SymmetricWindow>(nccl, all_reduce_window_bytes(options_.capacity_bytes));
}

AllReduceAlgorithm CustomAllReduce::algorithm_for(size_t bytes) const {
  return choose_all_reduce_algorithm(bytes, size(), window_ != nullptr, options_.capacity_bytes);
}

PeerAllReduceParams CustomAllReduce::params(void* data, size_t count, DType dtype) const {
  return one_rank_params(rank(), window_->peers(), data, count, dtype, options_.capacity_bytes,
                         options_.max_blocks, options_.peer_timeout_ms);
}

void CustomAllReduce::all_reduce_sum(void* data, size_t count, DType dtype,
                                     AllReduceAlgorithm algorithm, cudaStream_t stream) {
  if (size() == 1 || count == 0) return;
  switch (algorithm) {
    case AllReduceAlgorithm::kNccl:
      if (dtype == DType::BF16)
        nccl_.all_reduce_sum(static_cast<bf16*>(data), count, stream);
      else
        nccl_.all_reduce_sum(static_cast<float*>(data), count, stream);
      return;
    case AllReduceAlgorithm::kOneShot:
    case AllReduceAlgorithm::kTwoShot:
      RELAY_CHECK(window_ != nullptr, "custom all-reduce (", all_reduce_algorithm_name(algorithm),
                  ") is unavailable: ", fallback_reason_);
      if (algorithm == AllReduceAlgorithm::kOneShot)
        launch_one_shot_all_reduce(params(data, count, dtype), stream);
      else
        launch_two_shot_all_reduce(params(data, count, dtype), stream);
      return;
  }
}

void CustomAllReduce::all_reduce_sum(float* data, size_t count, cudaStream_t stream) {
  all_reduce_sum(data, count, DType::F32, algorithm_for(count * sizeof(float)), stream);
}

void CustomAllReduce::all_reduce_sum(bf16* data, size_t count, cudaStream_t stream) {
  all_reduce_sum(data, count, DType::BF16, algorithm_for(count * sizeof(bf16)), stream);
}

void CustomAllReduce::barrier(cudaStream_t stream) {
  if (size() == 1) return;
  if (window_ == nullptr) {
    nccl_.barrier(stream);
    return;
  }
  launch_peer_barrier(params(nullptr, 0, DType::F32), stream);
}

}  // namespace relay::parallel::cuda

// See thread_peer_group.h.
#include "parallel/cuda/thread_peer_group.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <new>

#include "core/error.h"
#include "parallel/cuda/all_reduce_select.h"
#include "parallel/cuda/cuda_check.h"

namespace relay::parallel::cuda {

namespace {

char* allocate_zeroed(int device, size_t bytes, const char* what) {
  RELAY_CUDA_CHECK(cudaSetDevice(device));
  char* p = nullptr;
  const cudaError_t rc = cudaMalloc(&p, bytes);
  RELAY_CHECK(rc == cudaSuccess, "cannot allocate the ", what, " window of ", bytes,
              " bytes on CUDA device ", device, ": ", cudaGetErrorString(rc));
  RELAY_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

}  // namespace

class ThreadPeerGroup::Communicator : public DeviceCommunicator {
 public:
  Communicator(const ThreadPeerGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }

  void all_reduce_sum(float* data, size_t count, cudaStream_t stream) override {
    run(data, count, DType::F32, stream);
  }
  void all_reduce_sum(bf16* data, size_t count, cudaStream_t stream) override {
    run(data, count, DType::BF16, stream);
  }
  void barrier(cudaStream_t stream) override {
    if (size() > 1) launch_peer_barrier(params(nullptr, 0, DType::F32), stream);
  }

 private:
  PeerAllReduceParams params(void* data, size_t count, DType dtype) const {
    const ThreadPeerGroupOptions& o = group_.options_;
    return one_rank_params(rank_, group_.all_reduce_windows_, data, count, dtype,
                           o.all_reduce_capacity_bytes, o.max_blocks, o.peer_timeout_ms,
                           group_.abort_);
  }
  void run(void* data, size_t count, DType dtype, cudaStream_t stream) {
    if (size() == 1 || count == 0) return;
    const size_t bytes = count * dtype_size(dtype);
    const size_t capacity = group_.options_.all_reduce_capacity_bytes;
    RELAY_CHECK(bytes <= capacity, "all-reduce of ", bytes, " bytes on rank ", rank_,
                " exceeds the group's staging capacity of ", capacity, " bytes");
    if (choose_all_reduce_algorithm(bytes, size(), true, capacity) == AllReduceAlgorithm::kOneShot)
      launch_one_shot_all_reduce(params(data, count, dtype), stream);
    else
      launch_two_shot_all_reduce(params(data, count, dtype), stream);
  }

  const ThreadPeerGroup& group_;
  int rank_;
};

ThreadPeerGroup::ThreadPeerGroup(std::vector<int> devices, const ThreadPeerGroupOptions& options)
    : devices_(std::move(devices)), options_(options) {
  const int n = size();
  RELAY_CHECK(n >= 1 && n <= kMaxRanks, "a GPU rank group has 1..", kMaxRanks, " ranks, not ", n);
  RELAY_CHECK(options_.max_blocks >= 1 && options_.max_blocks <= kMaxAllReduceBlocks,
              "GPU rank group: max_blocks ", options_.max_blocks, " not in 1..",
              kMaxAllReduceBlocks);
  int current = 0;
  RELAY_CUDA_CHECK(cudaGetDevice(&current));
  // Peer access between every pair of distinct devices: after this, every rank's windows are
  // addressable from every rank's kernels by their allocation pointers.
  for (int a : devices_) {
    for (int b : devices_) {
      if (a == b) continue;
      int can = 0;
      RELAY_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a, b));
      RELAY_CHECK(can == 1, "CUDA device ", a, " cannot access the memory of device ", b,
                  " (no NVLink or PCIe peer path): Relay's GPU ranks exchange activations "
                  "through peer memory");
      RELAY_CUDA_CHECK(cudaSetDevice(a));
      const cudaError_t rc = cudaDeviceEnablePeerAccess(b, 0);
      if (rc == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // reset the last error, or the next launch check reports it
      } else {
        RELAY_CHECK(rc == cudaSuccess, "cudaDeviceEnablePeerAccess(", b, ") on device ", a, ": ",
                    cudaGetErrorString(rc));
      }
    }
  }
  try {
    // Portable: every device of the process maps it; under unified addressing the host pointer is
    // the device pointer.
    void* record = nullptr;
    RELAY_CUDA_CHECK(
        cudaHostAlloc(&record, sizeof(PeerAbort), cudaHostAllocMapped | cudaHostAllocPortable));
    abort_ = new (record) PeerAbort{};
    if (n > 1) {
      for (int r = 0; r < n; ++r)
        all_reduce_windows_.push_back(allocate_zeroed(
            devices_[r], all_reduce_window_bytes(options_.all_reduce_capacity_bytes),
            "all-reduce"));
    }
    if (options_.max_tokens_per_rank > 0) {
      moe_layout_ =
          MoeWindowLayout::make(n, options_.max_tokens_per_rank, options_.hidden, options_.top_k);
      for (int r = 0; r < n; ++r)
        moe_windows_.push_back(allocate_zeroed(devices_[r], moe_layout_.total_bytes, "MoE"));
    }
  } catch (...) {
    for (char* w : all_reduce_windows_) cudaFree(w);
    for (char* w : moe_windows_) cudaFree(w);
    if (abort_ != nullptr) cudaFreeHost(abort_);
    cudaSetDevice(current);
    throw;
  }
  RELAY_CUDA_CHECK(cudaSetDevice(current));
  for (int r = 0; r < n; ++r) communicators_.push_back(std::make_unique<Communicator>(*this, r));
}

ThreadPeerGroup::~ThreadPeerGroup() {
  for (char* w : all_reduce_windows_) cudaFree(w);
  for (char* w : moe_windows_) cudaFree(w);
  cudaFreeHost(abort_);
}

void ThreadPeerGroup::abandon(int rank) {
  int none = -1;
  first_abandoned_.compare_exchange_strong(none, rank);
  std::atomic_ref<uint32_t>(abort_->raised).store(1, std::memory_order_release);
}

bool ThreadPeerGroup::abandoned() const {
  return std::atomic_ref<uint32_t>(abort_->raised).load(std::memory_order_acquire) != 0;
}

std::string ThreadPeerGroup::abandon_reason() const {
  const std::string timeouts = describe_timeouts(*abort_, size());
  const int failed = first_abandoned_.load();
  if (failed < 0) return timeouts.empty() ? "no peer wait was abandoned" : timeouts;
  return str("rank ", failed, " failed, so every rank abandoned the step",
             timeouts.empty() ? "" : " (", timeouts, timeouts.empty() ? "" : ")");
}

void ThreadPeerGroup::reset_after_abort() {
  int current = 0;
  RELAY_CUDA_CHECK(cudaGetDevice(&current));
  for (int r = 0; r < size(); ++r) {
    RELAY_CUDA_CHECK(cudaSetDevice(devices_[r]));
    if (!all_reduce_windows_.empty())
      RELAY_CUDA_CHECK(cudaMemset(all_reduce_windows_[r], 0, sizeof(AllReduceWindow)));
    if (!moe_windows_.empty())
      RELAY_CUDA_CHECK(cudaMemset(moe_windows_[r], 0, sizeof(MoeSignals)));
    RELAY_CUDA_CHECK(cudaDeviceSynchronize());
  }
  RELAY_CUDA_CHECK(cudaSetDevice(current));
  *abort_ = PeerAbort{};
  first_abandoned_.store(-1);
}

DeviceCommunicator& ThreadPeerGroup::communicator(int rank) { return *communicators_.at(rank); }

void ThreadPeerGroup::moe_dispatch(int rank, const bf16* hidden, const int32_t* topk_ids,
                                   const float* topk_weights, int num_tokens, int num_experts,
                                   cudaStream_t stream) const {
  RELAY_CHECK(!moe_windows_.empty(), "MoE dispatch on a GPU rank group built without MoE windows");
  RELAY_CHECK(num_tokens <= moe_layout_.max_tokens, "MoE dispatch: rank ", rank, " has ",
              num_tokens, " tokens; the exchange was sized for ", moe_layout_.max_tokens,
              " per rank (--max-num-batched-tokens)");
  MoeDispatchParams p = moe_params<MoeDispatchParams>(rank, num_tokens);
  p.ranks[0].hidden = hidden;
  p.ranks[0].topk_ids = topk_ids;
  p.ranks[0].topk_weights = topk_weights;
  p.num_experts = num_experts;
  launch_moe_dispatch(p, stream);
}

void ThreadPeerGroup::moe_combine(int rank, const bf16* expert_out, bf16* out, int num_tokens,
                                  cudaStream_t stream) const {
  MoeCombineParams p = moe_params<MoeCombineParams>(rank, num_tokens);
  p.ranks[0].expert_out = expert_out;
  p.ranks[0].out = out;
  launch_moe_combine(p, stream);
}

const bf16* ThreadPeerGroup::recv_hidden(int rank) const {
  return reinterpret_cast<const bf16*>(moe_windows_.at(rank) + moe_layout_.recv_hidden);
}
const int32_t* ThreadPeerGroup::recv_ids(int rank) const {
  return reinterpret_cast<const int32_t*>(moe_windows_.at(rank) + moe_layout_.recv_ids);
}
const float* ThreadPeerGroup::recv_weights(int rank) const {
  return reinterpret_cast<const float*>(moe_windows_.at(rank) + moe_layout_.recv_weights);
}
const int32_t* ThreadPeerGroup::recv_counts(int rank) const {
  return reinterpret_cast<const int32_t*>(moe_windows_.at(rank) + offsetof(MoeSignals, recv_count));
}

}  // namespace relay::parallel::cuda

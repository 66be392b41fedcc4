// See nccl_communicator.h.
#include "parallel/cuda/nccl_communicator.h"

#include <cstdlib>
#include <cstring>

#include "parallel/cuda/cuda_check.h"

// Throws relay::Error naming the NCCL call, its error string and NCCL's last message.
#define RELAY_NCCL_CHECK(call, comm)                                                            \
  do {                                                                                          \
    ncclResult_t relay_nccl_rc_ = (call);                                                       \
    RELAY_CHECK(relay_nccl_rc_ == ncclSuccess, #call, ": ", ncclGetErrorString(relay_nccl_rc_), \
                " (", ncclGetLastError(comm), ")");                                             \
  } while (0)

namespace relay::parallel::cuda {

ncclUniqueId make_nccl_unique_id(TcpBootstrap& bootstrap) {
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) RELAY_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  const std::vector<uint8_t> bytes =
      bootstrap.broadcast(std::span(reinterpret_cast<const uint8_t*>(&id), sizeof(id)));
  RELAY_CHECK(bytes.size() == sizeof(id), "dist-init: rank ", bootstrap.rank(), " received an ",
              bytes.size(), "-byte NCCL id, expected ", sizeof(id));
  std::memcpy(&id, bytes.data(), sizeof(id));
  return id;
}

NcclCommunicator::NcclCommunicator(const ncclUniqueId& id, int rank, int size, int device)
    : rank_(rank), size_(size), device_(device) {
  RELAY_CHECK(size >= 1 && rank >= 0 && rank < size, "NCCL: rank ", rank, " is not in a group of ",
              size);
  // See the header: never NVLS / multicast, unless the user asked for it explicitly.
  ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  RELAY_CUDA_CHECK(cudaSetDevice(device));
  RELAY_NCCL_CHECK(ncclCommInitRank(&comm_, size, id, rank), nullptr);
  lsa_size_ = lsa_team_size(comm_);
  RELAY_CUDA_CHECK(cudaMalloc(&barrier_word_, sizeof(int)));
  RELAY_CUDA_CHECK(cudaMemset(barrier_word_, 0, sizeof(int)));
}

NcclCommunicator::~NcclCommunicator() {
  cudaSetDevice(device_);
  if (barrier_word_) cudaFree(barrier_word_);
  if (comm_) ncclCommDestroy(comm_);
}

void NcclCommunicator::all_reduce_sum(float* data, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  RELAY_NCCL_CHECK(ncclAllReduce(data, data, count, ncclFloat32, ncclSum, comm_, stream), comm_);
}

void NcclCommunicator::all_reduce_sum(bf16* data, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  RELAY_NCCL_CHECK(ncclAllReduce(data, data, count, ncclBfloat16, ncclSum, comm_, stream), comm_);
}

void NcclCommunicator::barrier(cudaStream_t stream) {
  RELAY_NCCL_CHECK(
      ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, comm_, stream), comm_);
}

SymmetricWindow::SymmetricWindow(NcclCommunicator& comm, size_t bytes)
    : comm_(comm), bytes_(bytes) {
  RELAY_CHECK(comm.lsa_size() == comm.size(), "symmetric window: only ", comm.lsa_size(), " of ",
              comm.size(), " ranks are load/store reachable from rank ", comm.rank());
  RELAY_CUDA_CHECK(cudaSetDevice(comm.device()));
  // Registration wants whole 4 KiB pages on every rank.
  bytes_ = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
           NCCL_WIN_REQUIRED_ALIGNMENT;
  RELAY_NCCL_CHECK(ncclMemAlloc(&buffer_, bytes_), comm.comm());
  RELAY_NCCL_CHECK(
      ncclCommWindowRegister(comm.comm(), buffer_, bytes_, &window_, NCCL_WIN_COLL_SYMMETRIC),
      comm.comm());
  cudaStream_t stream = nullptr;
  RELAY_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // NOTE: a one-rank group has no peers to map, and reading its window's device descriptor
  // faulted (illegal address) on the H200 with NCCL 2.28: the local buffer is the whole list.
  peers_ = comm.size() == 1 ? std::vector<char*>{static_cast<char*>(buffer_)}
                            : lsa_peer_pointers(window_, comm.size(), stream);
  // Zero flags and counters everywhere before any peer may signal into this window.
  RELAY_CUDA_CHECK(cudaMemsetAsync(buffer_, 0, bytes_, stream));
  comm.barrier(stream);
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  RELAY_CUDA_CHECK(cudaStreamDestroy(stream));
}

SymmetricWindow::~SymmetricWindow() {
  cudaSetDevice(comm_.device());
  if (window_) ncclCommWindowDeregister(comm_.comm(), window_);
  if (buffer_) ncclMemFree(buffer_);
}

}  // namespace relay::parallel::cuda

// The NCCL communicator: the reference and fallback DeviceCommunicator, and the owner of the
// symmetric memory Relay's own kernels read their peers through.
//
// Bootstrap: rank 0 creates the ncclUniqueId and the TCP rendezvous (parallel/tcp_bootstrap.h)
// broadcasts it (make_nccl_unique_id); in one process with one thread per GPU the id is simply
// shared. Construction is collective (ncclCommInitRank), as is every SymmetricWindow.
//
// NOTE: NVLink SHARP (NVLS) is kept off: unless the user set NCCL_NVLS_ENABLE, the constructor sets
// it to 0 before NCCL initialises. NVLS builds multicast objects on the NVSwitch; on shared hosts a
// program that uses multicast can put every GPU of the host out of service for a long time, and
// Relay's kernels use unicast peer pointers only (no cuMulticastCreate, no multimem pointers).
//
// Symmetric memory (NCCL >= 2.28): SymmetricWindow allocates with ncclMemAlloc and registers the
// buffer as a window with NCCL_WIN_COLL_SYMMETRIC, then asks the device API (ncclGetLsaPointer, in
// a one-off kernel) for every peer's address of it. Those plain pointers are what the kernels of
// all_reduce.h and moe_all_to_all.h take. Peers must all be in this rank's LSA team (load/store
// reachable: NVLink or the same GPU); lsa_size() says how many are.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <vector>

#include "parallel/cuda/device_communicator.h"
#include "parallel/tcp_bootstrap.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 28, 0)
#error "Relay's GPU collectives need NCCL >= 2.28 (symmetric windows and the device API)"
#endif

namespace relay::parallel::cuda {

// Rank 0 makes a fresh id and broadcasts it; every rank returns the same id.
ncclUniqueId make_nccl_unique_id(TcpBootstrap& bootstrap);

class NcclCommunicator : public DeviceCommunicator {
 public:
  // Collective over the `size` ranks sharing `id`; binds `device` as the current device first.
  NcclCommunicator(const ncclUniqueId& id, int rank, int size, int device);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }
  ncclComm_t comm() const { return comm_; }
  // Ranks of this rank's load/store-accessible team; size() when every peer is reachable.
  int lsa_size() const { return lsa_size_; }

  void all_reduce_sum(float* data, size_t count, cudaStream_t stream) override;
  void all_reduce_sum(bf16* data, size_t count, cudaStream_t stream) override;
  void barrier(cudaStream_t stream) override;

 private:
  ncclComm_t comm_ = nullptr;
  int rank_ = 0, size_ = 1, device_ = 0, lsa_size_ = 1;
  int* barrier_word_ = nullptr;  // device scratch the barrier all-reduces
};

// A buffer of the same size on every rank, registered as an NCCL symmetric window, zeroed, with
// every peer's pointer to it. Construction and destruction are collective.
class SymmetricWindow {
 public:
  SymmetricWindow(NcclCommunicator& comm, size_t bytes);
  ~SymmetricWindow();
  SymmetricWindow(const SymmetricWindow&) = delete;
  SymmetricWindow& operator=(const SymmetricWindow&) = delete;

  char* local() const { return peers_[comm_.rank()]; }
  // [size()] every rank's window as this rank addresses it; peers()[rank()] == local().
  const std::vector<char*>& peers() const { return peers_; }
  size_t bytes() const { return bytes_; }

 private:
  NcclCommunicator& comm_;
  size_t bytes_ = 0;
  void* buffer_ = nullptr;
  ncclWindow_t window_ = nullptr;
  std::vector<char*> peers_;
};

// The parts that need NCCL's device-API headers (symmetric_window.cu): each peer's pointer to
// offset 0 of `window` (NCCL maps every rank's buffer, this rank's too, into one flat range, so
// peers()[rank()] is an alias of the allocation, not the same address), and the LSA team's size.
std::vector<char*> lsa_peer_pointers(ncclWindow_t window, int num_peers, cudaStream_t stream);
int lsa_team_size(ncclComm_t comm);

}  // namespace relay::parallel::cuda

// The one place Relay includes NCCL's device API: reading a symmetric window's LSA peer pointers.
// NCCL 2.28 exposes them only on the device (ncclGetLsaPointer reads the window's device-side
// descriptor), so a one-thread kernel collects them once per window and the host keeps plain
// pointers for the collective kernels, which then depend on nothing from NCCL.
#include <nccl.h>
#include <nccl_device.h>

#include "parallel/cuda/cuda_check.h"
#include "parallel/cuda/nccl_communicator.h"

namespace relay::parallel::cuda {
namespace {

__global__ void lsa_pointers_kernel(ncclWindow_t window, int num_peers, char** out) {
  for (int peer = 0; peer < num_peers; ++peer)
    out[peer] = static_cast<char*>(ncclGetLsaPointer(window, 0, peer));
}

}  // namespace

std::vector<char*> lsa_peer_pointers(ncclWindow_t window, int num_peers, cudaStream_t stream) {
  char** device_out = nullptr;
  RELAY_CUDA_CHECK(cudaMallocAsync(&device_out, sizeof(char*) * num_peers, stream));
  lsa_pointers_kernel<<<1, 1, 0, stream>>>(window, num_peers, device_out);
  RELAY_CUDA_CHECK_LAUNCH("lsa_pointers");
  std::vector<char*> peers(num_peers);
  RELAY_CUDA_CHECK(cudaMemcpyAsync(peers.data(), device_out, sizeof(char*) * num_peers,
                                   cudaMemcpyDeviceToHost, stream));
  RELAY_CUDA_CHECK(cudaFreeAsync(device_out, stream));
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  return peers;
}

int lsa_team_size(ncclComm_t comm) { return ncclTeamLsa(comm).nRanks; }

}  // namespace relay::parallel::cuda

// The CUDA IPC transport: copies between device memory of processes on one node, over NVLink or
// PCIe, as device-to-device cudaMemcpyAsync on the transport's own stream.
//
// add_local_region exports a cudaIpcMemHandle of the allocation that holds the region plus the
// region's offset inside it (an IPC handle names a whole cudaMalloc allocation); a peer process
// opens the handle once (cudaIpcOpenMemHandle, peer access enabled lazily) and writes straight into
// the mapped memory. Regions of this process are written directly. wait_posted records an event
// after the posted copies and polls it, bounded by CudaIpcTransportOptions::timeout_ms, so a copy
// that never completes fails the request instead of hanging the engine. Completion on the
// destination is known through the control plane: the sender answers only after wait_posted.
//
// The header has no CUDA types; the library behind it exists only in CUDA builds.
#pragma once

#include <memory>

#include "transfer/transfer_engine.h"

namespace relay {

struct CudaIpcTransportOptions {
  int device = 0;          // the device of the local regions and of the copy stream
  int timeout_ms = 10000;  // bound on wait_posted
};

// Throws relay::Error when the device cannot be used.
std::unique_ptr<Transport> make_cuda_ipc_transport(const CudaIpcTransportOptions& options = {});

}  // namespace relay

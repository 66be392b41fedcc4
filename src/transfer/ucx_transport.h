// The UCX transport: copies are one-sided puts over UCX's UCP API, between processes and nodes —
// RDMA verbs where the machine has them, TCP (loopback in CI) or shared memory otherwise.
//
// Each transport owns one UCP context (RMA and wakeup features), one worker and one background
// progress thread. add_local_region maps the memory (ucp_mem_map) and exports an address a peer in
// another process can use: this worker's address, the region's base pointer and its packed remote
// key, hex-encoded, with a checksum (docs/transfer.md, "UCX"). add_remote_region connects an
// endpoint to the owner's worker (one per peer worker, shared by its regions) and unpacks the key.
// post() issues ucp_put_nbx (a copy between two local regions is a memcpy); wait_posted() waits for
// the puts, then flushes every endpoint it used, so the bytes have landed at the peer when it
// returns. Every wait is bounded by UcxTransportOptions::timeout_ms and throws relay::Error when it
// runs out, as does any UCX error (a dead peer, a malformed address): the engine then fails the
// request instead of hanging. A peer that failed stays failed: its regions must be unregistered
// and imported again (a fresh endpoint is created then).
//
// The header does not include UCX, so users of the engine need no UCX include paths.
#pragma once

#include <memory>
#include <string>

#include "transfer/transfer_engine.h"

namespace relay {

struct UcxTransportOptions {
  // Bound on each wait: puts and flushes in wait_posted (and post, when too many puts are in
  // flight), endpoint close in remove_region and the destructor.
  int timeout_ms = 10000;
  // UCX transports to use, in UCX_TLS syntax ("tcp", "rc,sm,self", "^cma", ...); empty leaves the
  // choice to UCX (and to a UCX_TLS environment variable, if set). The value here wins over it.
  std::string transports;
};

// Throws relay::Error when UCX cannot be initialised (no usable transport, bad `transports`).
std::unique_ptr<Transport> make_ucx_transport(const UcxTransportOptions& options = {});

}  // namespace relay

// The cross-process CPU communicator: ranks in several processes (on one host or several) connected
// by TCP (parallel/communicator.h has the contract). It exists so the CPU backend's sharded layouts
// run across processes and hosts exactly as they run in one (`--nnodes`), for correctness, not
// speed: the GPU ranks of a multi-node deployment talk through NCCL.
//
// Mesh. Every pair of global ranks has its own socket, pairs inside one process too (over loopback:
// one uniform path). Each process opens one listener on an ephemeral port of the interface its
// bootstrap connection uses (TcpBootstrap::local_host) and the processes exchange "HOST:PORT" and
// their rank ranges through the bootstrap. For every pair the higher rank connects to the lower
// rank's process and sends a hello (magic, byte order, generation, from, to, world); the accepting
// process routes the socket to its rank's slot, drops connections without the magic or of another
// generation, and fails on a duplicate or out-of-range rank. A process makes all its connects
// before its accepts: a connect completes in the peer's listen backlog, so no process waits on
// another's accept and the processes need no ordering.
//
// Collectives. One frame per pair and call, in each direction: a header (op, the communicator's
// call number, payload bytes) and the payload, in native byte order (the hello checks the ranks
// agree). A frame of another op or call number means the ranks' calls diverged: a logic error that
// aborts the rank and throws naming both ranks and both ops. Each collective is one poll() loop
// over non-blocking sockets that sends to and receives from every peer at once, so no buffer size
// can deadlock it; the whole collective waits at most `timeout`. all_reduce_sum sends the whole
// buffer to every peer and each rank adds the contributions in rank order in fp32
// (local_group.cpp's order), so every rank, and the thread group, get the same bits. That costs
// each rank (size - 1) x count floats sent, received and held: fine for what it is for.
//
// Failure. abort() shuts this rank's sockets down: every peer waiting on it sees the connection
// close, aborts itself and throws naming the peer, so one failure reaches every rank of every
// process. (A peer that already holds the aborted rank's whole frame of the current call may
// finish that call; it fails at its next wait on the rank: sent bytes cannot be taken back.)
// reset() (once per process, on every process at the same point, with no rank inside a collective)
// closes all of the process's sockets and rebuilds its part of the mesh with the next generation
// over the same listener and endpoints; older connections are dropped.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/tcp_bootstrap.h"

namespace relay::parallel {

// Connects the ranks [first_rank, first_rank + num_local) that this process hosts to every other
// rank of a world of `world` ranks. The processes are the members of `bootstrap` (one per process,
// process p hosting a contiguous range; ranges ascend with p and cover [0, world)). Collective over
// the processes: each calls it once, at the same point. Communicator i of the result is global rank
// first_rank + i. `timeout` bounds every collective's wait.
std::vector<std::unique_ptr<Communicator>> make_tcp_group(
    TcpBootstrap& bootstrap, int first_rank, int num_local, int world,
    std::chrono::milliseconds timeout = std::chrono::minutes(5));

}  // namespace relay::parallel

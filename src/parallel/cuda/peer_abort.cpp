// See peer_abort.h.
#include "parallel/cuda/peer_abort.h"

#include "core/error.h"

namespace relay::parallel::cuda {

std::string describe_timeouts(const PeerAbort& record, int num_ranks) {
  std::string out;
  for (int r = 0; r < num_ranks && r < kMaxRanks; ++r) {
    const PeerWaitRecord& w = record.waits[r];
    if (w.what == 0) continue;
    if (!out.empty()) out += "; ";
    out += str(peer_op_name(static_cast<PeerOp>(w.what)), ": rank ", r, " (block ", w.block,
               ") waited ", w.waited_ms, " ms for rank ", w.peer, ": flag ", w.seen, ", expected ",
               w.expected);
  }
  return out;
}

}  // namespace relay::parallel::cuda

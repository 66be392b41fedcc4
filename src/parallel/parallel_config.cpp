// See parallel_config.h.
#include "parallel/parallel_config.h"

#include "core/error.h"

namespace relay::parallel {

void ParallelConfig::validate() const {
  RELAY_CHECK(tp >= 1, "--tp must be at least 1, got ", tp);
  RELAY_CHECK(ep >= 1, "--ep must be at least 1, got ", ep);
  RELAY_CHECK(dp >= 1, "--dp must be at least 1, got ", dp);
  RELAY_CHECK(ep == 1 || ep == world_size(), "--ep ", ep,
              " must be 1 (experts in every shard) or --tp x --dp = ", world_size(),
              " (experts divided across all ranks)");
  RELAY_CHECK(tp == 1 || dp == 1, "--tp ", tp, " with --dp ", dp,
              " is not supported: data-parallel attention runs one rank per DP group (use --tp 1 "
              "--dp N --ep N "
              "for DP attention with expert parallelism, or --tp N --ep N for tensor parallelism)");
}

std::string ParallelConfig::describe() const { return str("tp=", tp, " ep=", ep, " dp=", dp); }

RankPlace place_rank(const ParallelConfig& c, int rank) {
  RELAY_CHECK(rank >= 0 && rank < c.world_size(), "rank ", rank, " outside [0, ", c.world_size(),
              ")");
  return RankPlace{rank % c.tp, rank / c.tp, rank};
}

}  // namespace relay::parallel

// CPU references for Relay's GPU collectives, on host arrays: what every rank must end up with, so
// the GPU tests (and anyone changing a kernel) compare against one definition. No CUDA here.
//
// All-reduce: the rank-order fp32 sum of the ranks' inputs, rounded once to the element type — the
// same convention as the CPU communicator (parallel/local_group.h). MoE dispatch/combine: the DP +
// EP exchange of SparseMoe::dispatch_combine (model/layers.cpp) in the GPU kernels' buffer layout
// (moe_all_to_all.h): a token goes once to each rank holding any of its experts, with its weights
// zeroed and its ids made "absent" (= experts per rank) for experts elsewhere; the source adds the
// partial sums it gets back in rank order, starting from 0.
#pragma once

#include <cstdint>
#include <vector>

namespace relay::parallel::cuda {

// inputs[r]: rank r's values; returns the sum every rank must hold.
std::vector<float> reference_all_reduce(const std::vector<std::vector<float>>& inputs);
// bf16 as raw bits (uint16_t); fp32 accumulation, one rounding.
std::vector<uint16_t> reference_all_reduce_bf16(const std::vector<std::vector<uint16_t>>& inputs);

// One rank's tokens for the MoE exchange.
struct MoeRankTokens {
  int num_tokens = 0;
  std::vector<uint16_t> hidden;     // [num_tokens, hidden] bf16 bits
  std::vector<int32_t> topk_ids;    // [num_tokens, top_k] global expert ids
  std::vector<float> topk_weights;  // [num_tokens, top_k]
};

// What one destination rank receives from one source rank, in the source's token order.
struct MoeReceived {
  std::vector<int32_t> source_tokens;  // [n] the source's token index for each slot
  std::vector<uint16_t> hidden;        // [n, hidden]
  std::vector<float> weights;          // [n, top_k] 0 for experts held elsewhere
  std::vector<int32_t> local_ids;      // [n, top_k] id local to the destination, or absent
};

// received[d][s]: what rank d gets from rank s. experts per rank = num_experts / num_ranks.
std::vector<std::vector<MoeReceived>> reference_moe_dispatch(
    const std::vector<MoeRankTokens>& ranks, int num_experts, int hidden, int top_k);

// partials[d][s]: [received[d][s].n, hidden] bf16 bits, destination d's weighted expert sums for
// what s sent it. Returns out[s]: [num_tokens_s, hidden] bf16 bits, each token's sum over the
// destinations in rank order (fp32 from 0, rounded once).
std::vector<std::vector<uint16_t>> reference_moe_combine(
    const std::vector<std::vector<MoeReceived>>& received,
    const std::vector<std::vector<std::vector<uint16_t>>>& partials,
    const std::vector<int>& num_tokens, int hidden);

}  // namespace relay::parallel::cuda

// The cost model behind `relay bench`'s roofline fractions (engine/cuda_bench.cu): what one
// token's forward reads and computes, layer by layer as the decoder plan gives their kinds.
#pragma once

#include "model/config.h"

namespace relay {

struct ModelCosts {
  double attn_weight_bytes = 0;   // per step, all layers: every weight but the routed experts'
  double expert_bytes = 0;        // one expert, all MoE layers
  double lm_head_bytes = 0;
  double all_weight_bytes = 0;
  double kv_bytes_per_token = 0;  // all attention layers, K and V
  double state_bytes = 0;         // one sequence's recurrent state, all Gated DeltaNet layers
  double matmul_flops_per_token = 0;
  double attn_flops_per_token_pair = 0;  // per (query, key) pair, all attention layers
  double delta_rule_flops_per_token = 0;  // the Gated DeltaNet recurrence, all its layers
  int experts = 0, top_k = 0;
};

// `linear_bytes`: bytes per weight of the attention projections and experts (2 bf16, 1 FP8; the
// router, embeddings and lm_head stay bf16, and so do the hybrids' gated attention and Gated
// DeltaNet). The shared expert counts in the experts' format: on one GPU, the roofline's device,
// it is folded into them.
ModelCosts model_costs(const ModelConfig& c, double linear_bytes);

}  // namespace relay

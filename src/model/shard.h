// Which part of the model one rank holds, and whom it talks to (parallel/parallel_config.h has the
// layouts).
//
// Weights are sliced while loading, straight from the checkpoint: a tensor-parallel rank keeps its
// q heads and their KV heads (q|k|v rows), the matching o_proj columns and a slice of every dense
// MLP's width; an expert-parallel rank keeps experts [expert_begin, expert_begin +
// num_local_experts). Embedding, norms, router and lm_head are replicated. Every split is checked
// against the config here, with a message that names the field that does not divide.
//
// The hybrid models (Qwen3.5, Qwen3-Next): a tensor-parallel rank keeps a contiguous range of the
// Gated DeltaNet key heads and the value heads that read them (value head v reads key head
// v / (value heads / key heads), so both ranges are contiguous), the matching rows of in_proj and
// channels of the short convolution, and out_proj's matching columns; its recurrent state holds only
// those heads and channels. The shared expert's width is sliced as a dense MLP's whenever the MoE's
// outputs are summed across the ranks (TP, TP + EP); under DP attention + EP every rank runs it
// whole on its own tokens.
//
// KV heads when tp > num_key_value_heads: each rank holds the one KV head its q heads read
// (replicated on tp / num_kv_heads ranks), so the k/v projections are computed redundantly and each
// rank's KV cache holds one head. That is what makes TP = 8 work on a 4-KV-head model.
#pragma once

#include "model/config.h"
#include "parallel/communicator.h"
#include "parallel/parallel_config.h"

namespace relay {

struct ShardSpec {
  int tp_rank = 0, tp_size = 1;
  int ep_rank = 0, ep_size = 1;
  // The EP ranks hold different tokens (DP attention): the MoE dispatches token rows to the ranks
  // of their experts and combines the results back (all_to_all). Otherwise every EP rank sees the
  // same tokens and the partial MoE outputs are summed (all_reduce).
  bool dispatch_tokens = false;
  parallel::Communicator* tp_comm =
      nullptr;  // the tp ranks of this DP group (null when tp_size == 1)
  parallel::Communicator* ep_comm = nullptr;  // all ranks (null when ep_size == 1)

  // Derived from the config by make_shard (the unsharded values when tp_size == ep_size == 1).
  int q_head_begin = 0, num_local_q_heads = 0;
  int kv_head_begin = 0, num_local_kv_heads = 0;
  int mlp_width_begin = 0, num_local_mlp_width = 0;  // dense MLP columns (intermediate_size)
  int moe_width_begin = 0, num_local_moe_width = 0;  // expert columns (moe_intermediate_size)
  int expert_begin = 0, num_local_experts = 0;
  // Gated DeltaNet heads (linear_num_key_heads / linear_num_value_heads), hybrid models only.
  int k_head_begin = 0, num_local_k_heads = 0;
  int v_head_begin = 0, num_local_v_heads = 0;
  // The shared expert's columns (shared_expert_intermediate_size), hybrid MoE models only.
  int shared_width_begin = 0, num_local_shared_width = 0;
};

// The whole model on one rank.
ShardSpec unsharded(const ModelConfig& config);

// What rank `rank` of `parallel` holds (heads, widths, experts), without communicators: for
// backends that connect their ranks otherwise (the CUDA backend's device collectives). Throws
// relay::Error when the model does not divide.
ShardSpec plan_shard(const ModelConfig& config, const parallel::ParallelConfig& parallel, int rank);

// plan_shard with `world`, the CPU group of all ranks, as the TP and/or EP communicator (may be
// null when world_size() == 1).
ShardSpec make_shard(const ModelConfig& config, const parallel::ParallelConfig& parallel, int rank,
                     parallel::Communicator* world);

}  // namespace relay

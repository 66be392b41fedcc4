// See shard.h.
#include "model/shard.h"

#include "core/error.h"

namespace relay {

ShardSpec unsharded(const ModelConfig& c) {
  ShardSpec s;
  s.num_local_q_heads = static_cast<int>(c.num_attention_heads);
  s.num_local_kv_heads = static_cast<int>(c.num_key_value_heads);
  s.num_local_mlp_width = static_cast<int>(c.intermediate_size);
  s.num_local_moe_width = static_cast<int>(c.moe_intermediate_size);
  s.num_local_experts = static_cast<int>(c.num_experts);
  s.num_local_k_heads = static_cast<int>(c.linear_num_key_heads);
  s.num_local_v_heads = static_cast<int>(c.linear_num_value_heads);
  s.num_local_shared_width = static_cast<int>(c.shared_expert_intermediate_size);
  return s;
}

ShardSpec make_shard(const ModelConfig& c, const parallel::ParallelConfig& p, int rank,
                     parallel::Communicator* world) {
  ShardSpec s = plan_shard(c, p, rank);
  if (p.world_size() == 1) return s;
  RELAY_CHECK(world != nullptr && world->size() == p.world_size(), "rank ", rank, ": a group of ",
              p.world_size(), " ranks needs a communicator of that size");
  if (s.tp_size > 1) s.tp_comm = world;  // tp > 1 implies dp == 1: the TP group is every rank
  if (s.ep_size > 1) s.ep_comm = world;
  return s;
}

ShardSpec plan_shard(const ModelConfig& c, const parallel::ParallelConfig& p, int rank) {
  p.validate();
  ShardSpec s = unsharded(c);
  if (p.world_size() == 1) return s;
  RELAY_CHECK(rank >= 0 && rank < p.world_size(), "rank ", rank, " outside a group of ",
              p.world_size());
  const parallel::RankPlace at = parallel::place_rank(p, rank);
  const int tp = p.tp;
  s.tp_rank = at.tp_rank;
  s.tp_size = tp;

  const int q = static_cast<int>(c.num_attention_heads),
            kv = static_cast<int>(c.num_key_value_heads);
  RELAY_CHECK(q % tp == 0, "--tp ", tp, " does not divide num_attention_heads ", q,
              " (config.json)");
  s.num_local_q_heads = q / tp;
  s.q_head_begin = at.tp_rank * s.num_local_q_heads;
  if (tp <= kv) {
    RELAY_CHECK(kv % tp == 0, "--tp ", tp, " does not divide num_key_value_heads ", kv,
                " (config.json)");
    s.num_local_kv_heads = kv / tp;
    s.kv_head_begin = at.tp_rank * s.num_local_kv_heads;
  } else {
    RELAY_CHECK(
        tp % kv == 0, "--tp ", tp, " exceeds num_key_value_heads ", kv,
        " (config.json) and is not a multiple of it, so KV heads cannot be replicated evenly");
    s.num_local_kv_heads = 1;
    s.kv_head_begin = at.tp_rank / (tp / kv);
  }

  if (c.has_linear_attention() && tp > 1) {
    const int k = static_cast<int>(c.linear_num_key_heads),
              v = static_cast<int>(c.linear_num_value_heads);
    RELAY_CHECK(k % tp == 0, "--tp ", tp, " does not divide linear_num_key_heads ", k,
                " (config.json: the Gated DeltaNet heads)");
    s.num_local_k_heads = k / tp;
    s.k_head_begin = at.tp_rank * s.num_local_k_heads;
    s.num_local_v_heads = v / tp;  // value heads are a multiple of key heads (config.cpp checks)
    s.v_head_begin = at.tp_rank * s.num_local_v_heads;
  }

  bool has_dense_mlp = !c.is_moe();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    has_dense_mlp = has_dense_mlp || !c.layer_is_moe(l);
  if (has_dense_mlp && tp > 1) {
    RELAY_CHECK(c.intermediate_size % tp == 0, "--tp ", tp, " does not divide intermediate_size ",
                c.intermediate_size, " (config.json)");
    s.num_local_mlp_width = static_cast<int>(c.intermediate_size / tp);
    s.mlp_width_begin = at.tp_rank * s.num_local_mlp_width;
  }

  if (c.num_experts > 0) {
    if (p.ep > 1) {
      RELAY_CHECK(c.num_experts % p.ep == 0, "--ep ", p.ep, " does not divide num_experts ",
                  c.num_experts, " (config.json)");
      s.ep_rank = at.ep_rank;
      s.ep_size = p.ep;
      s.num_local_experts = static_cast<int>(c.num_experts / p.ep);
      s.expert_begin = at.ep_rank * s.num_local_experts;
      s.dispatch_tokens = p.dp > 1;
    } else if (tp > 1) {
      RELAY_CHECK(c.moe_intermediate_size % tp == 0, "--tp ", tp,
                  " does not divide moe_intermediate_size ", c.moe_intermediate_size,
                  " (config.json); use --ep ", tp, " to divide the experts instead");
      s.num_local_moe_width = static_cast<int>(c.moe_intermediate_size / tp);
      s.moe_width_begin = at.tp_rank * s.num_local_moe_width;
    }
  }
  // The shared expert: sliced over the TP ranks, whose partial MoE outputs are summed (tp > 1
  // implies dp == 1, so those are all the ranks); whole on every DP rank otherwise.
  if (c.shared_expert_intermediate_size > 0 && tp > 1) {
    RELAY_CHECK(c.shared_expert_intermediate_size % tp == 0, "--tp ", tp,
                " does not divide shared_expert_intermediate_size ",
                c.shared_expert_intermediate_size, " (config.json)");
    s.num_local_shared_width = static_cast<int>(c.shared_expert_intermediate_size / tp);
    s.shared_width_begin = at.tp_rank * s.num_local_shared_width;
  }
  return s;
}

}  // namespace relay

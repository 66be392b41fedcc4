// See roofline.h.
#include "engine/roofline.h"

#include "model/decoder_plan.h"
#include "model/model.h"

namespace relay {

ModelCosts model_costs(const ModelConfig& c, double linear_bytes) {
  ModelCosts m;
  const double H = c.hidden_size, hd = c.head_dim;
  const double nq = c.num_attention_heads, nkv = c.num_key_value_heads;
  const double W = c.moe_intermediate_size, E = c.num_experts;
  m.experts = static_cast<int>(c.num_experts);
  m.top_k = static_cast<int>(c.num_experts_per_tok);
  double params = 0;  // every weight a token's forward multiplies but the routed experts'
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const MixerKind mixer = mixer_kind(c, l);
    const FfnKind ffn = ffn_kind(c, l);
    if (mixer == MixerKind::kGatedDeltaNet) {
      const double hv = c.linear_num_value_heads, conv = c.linear_conv_dim();
      const double v = c.linear_value_dim();
      const double p = (conv + v + 2 * hv) * H + v * H;  // in_proj, out_proj
      params += p;
      m.attn_weight_bytes += (p + conv * c.linear_conv_kernel_dim) * 2;
      // Per token and value head: decay, S^T k, the rank-1 update and S^T q over dk x dv.
      m.delta_rule_flops_per_token += 8 * v * c.linear_key_head_dim;
    } else {
      const double gate = mixer == MixerKind::kGatedAttention ? nq * hd * H : 0;
      const double p = (nq + 2 * nkv) * hd * H + nq * hd * H;
      params += p + gate;
      m.attn_weight_bytes += p * (gate > 0 ? 2 : linear_bytes) + gate * 2;
      m.kv_bytes_per_token += 2 * nkv * hd * 2;
      m.attn_flops_per_token_pair += 4 * nq * hd;
    }
    if (ffn == FfnKind::kDenseMlp) {
      const double p = 3 * double(c.intermediate_size) * H;
      params += p;
      m.attn_weight_bytes += p * linear_bytes;
      continue;
    }
    params += E * H;  // the router
    m.attn_weight_bytes += E * H * 2;
    m.expert_bytes += 3 * W * H * linear_bytes;
    m.matmul_flops_per_token += 2 * m.top_k * 3 * W * H;
    if (ffn == FfnKind::kMoeWithSharedExpert) {
      const double p = 3 * double(c.shared_expert_intermediate_size) * H;
      params += p + H;  // and its gate
      m.attn_weight_bytes += p * linear_bytes + H * 2;
    }
  }
  m.matmul_flops_per_token += 2 * params;
  if (c.has_linear_attention()) {
    m.state_bytes = recurrent_state_layout(c, unsharded(c), 1).bytes_per_slot();
  }
  m.lm_head_bytes = double(c.vocab_size) * H * 2;
  m.all_weight_bytes = m.attn_weight_bytes + E * m.expert_bytes + m.lm_head_bytes +
                       double(c.vocab_size) * H * 2;  // and the embedding
  return m;
}

}  // namespace relay

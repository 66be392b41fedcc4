// What a Qwen-family decoder is made of, layer by layer, and where each part's tensors sit in the
// checkpoint: the one definition both backends build from. The CPU builders
// (model/architectures.h, through load_decoder) make a block per LayerPlan; the CUDA backend
// (engine/cuda/weights.cu) uploads the same tensors.
// Tensor names are spelled here and in the blocks that read their own parts (model/layers.h), never
// in a backend.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace relay {

enum class MixerKind {
  kAttention,       // softmax attention over the paged KV cache (Qwen3, Qwen3-MoE)
  kGatedAttention,  // the same with an output gate and partial rotary (Qwen3.5, Qwen3-Next)
  kGatedDeltaNet,   // linear attention over a per-sequence recurrent state
};
enum class FfnKind {
  kDenseMlp,             // SwiGLU
  kMoe,                  // routed experts
  kMoeWithSharedExpert,  // routed experts + a sigmoid-gated shared expert
};
const char* mixer_kind_name(MixerKind kind);
const char* ffn_kind_name(FfnKind kind);

// One decoder layer: its blocks and its tensors' names.
struct LayerPlan {
  int index = 0;
  MixerKind mixer = MixerKind::kAttention;
  FfnKind ffn = FfnKind::kDenseMlp;
  std::string prefix;  // "model.layers.N."

  std::string input_norm() const { return prefix + "input_layernorm.weight"; }
  std::string post_attention_norm() const { return prefix + "post_attention_layernorm.weight"; }
  // The blocks' prefixes: their tensors are `block`.q_proj.weight and so on (linear_weight).
  std::string attention() const { return prefix + "self_attn"; }
  std::string linear_attention() const { return prefix + "linear_attn"; }
  std::string mlp() const { return prefix + "mlp"; }
  std::string shared_expert() const { return mlp() + ".shared_expert"; }  // a dense MLP's tensors
};

struct DecoderPlan {
  std::string prefix;  // "model.", or "model.language_model." in a Qwen3.5 vision-language checkpoint
  bool tie_word_embeddings = false;
  std::vector<LayerPlan> layers;

  std::string embed_tokens() const { return prefix + "embed_tokens.weight"; }
  std::string final_norm() const { return prefix + "norm.weight"; }
  std::string lm_head() const { return tie_word_embeddings ? embed_tokens() : "lm_head.weight"; }
};

// Layer `layer`'s kinds under `config`'s rules (layer_types / full_attention_interval,
// attn_output_gate; mlp_only_layers, decoder_sparse_step, shared_expert_intermediate_size).
MixerKind mixer_kind(const ModelConfig& config, int layer);
FfnKind ffn_kind(const ModelConfig& config, int layer);

// The plan of `config`'s decoder: the kinds follow the config (layer_types / full_attention_interval,
// attn_output_gate, the MoE layer rule, shared_expert_intermediate_size); the checkpoint says where
// the language model's tensors start.
DecoderPlan plan_decoder(const ModelConfig& config, const Checkpoint& ckpt);

// The MTP head's decoder layer (mtp.layers.0., model/mtp.h): attention (gated as the model's
// attention is) and layer 0's feed-forward.
LayerPlan plan_mtp_layer(const ModelConfig& config);

// A Gated DeltaNet layer's input projection as one rank runs it: rows [q | k | v | z | b | a] (q
// and k over the rank's key heads, v and z over its value heads, b and a one per value head),
// gathered from the checkpoint's tensors. Qwen3.5 stores them split and contiguous (in_proj_qkv,
// in_proj_z, in_proj_b, in_proj_a); Qwen3-Next fused and interleaved per key-head group g
// (transformers' fix_query_key_value_ordering):
//   in_proj_qkvz rows: for each g, [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)],  r = Hv / Hk
//   in_proj_ba rows:   for each g, [b_g (r) | a_g (r)]
// Both are read the same way: the tensors stacked in order, then `rows` of the stack.
struct InProjPlan {
  std::vector<std::string> tensors;      // weight names, stacked in this order
  std::vector<int64_t> tensor_rows;      // rows of each
  std::vector<int64_t> rows;             // rows of the stack, in the block's order
};
// The layout is the checkpoint's (it has in_proj_qkvz or in_proj_qkv); the rows are the shard's.
InProjPlan plan_in_proj(const ModelConfig& config, const LayerPlan& layer, const Checkpoint& ckpt,
                        const ShardSpec& shard);
// The channels of the short convolution (q | k | v of the full layer) a rank keeps: its key heads'
// q and k, its value heads' v. Also the first rows of its plan_in_proj, in the unfused order.
std::vector<int64_t> linear_attention_channels(const ModelConfig& config, const ShardSpec& shard);

// `block`.`name`.weight: a linear (or norm) of a block ("model.layers.0.self_attn", "q_proj").
std::string linear_weight(const std::string& block, const char* name);
// `block`.`name`.bias (attention_bias checkpoints).
std::string linear_bias(const std::string& block, const char* name);
// Expert e's `name` (gate_proj, up_proj, down_proj) weight in an MoE block stored per expert.
std::string expert_weight(const std::string& mlp, int64_t expert, const char* name);
// An MoE block's experts stored fused 3-D (transformers' own layout): `name` gate_up_proj
// [E, 2I, H] (gate rows first) or down_proj [E, H, I]. A checkpoint has these or the per-expert
// tensors (expert_weight).
std::string fused_experts_weight(const std::string& mlp, const char* name);
// A block's parameter that is not a linear weight (Gated DeltaNet's A_log and dt_bias).
std::string block_tensor(const std::string& block, const char* name);

}  // namespace relay

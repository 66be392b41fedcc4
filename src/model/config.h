// The model configuration: every config.json field that changes the math of Qwen3 / Qwen3-MoE and
// of the hybrid Qwen3.5 / Qwen3-Next models (Gated DeltaNet + gated attention).
//
// Parsed once from a Hugging Face checkpoint directory and passed down by const reference. Fields
// not listed here do not change the forward pass (dropout, initializer_range, ...) and are ignored;
// a value Relay cannot run (an unknown architecture, sliding-window attention, an unknown
// rope_scaling type, hidden_act other than silu) is an error naming the field. A vision-language
// checkpoint (Qwen3_5*ForConditionalGeneration) is read for its language model: the fields under
// `text_config`; its vision tower is not run.
//
// Per-layer caches: layer_types says which token mixer each layer has, and with it which cache the
// layer keeps between steps. Attention layers own pages of the paged KV pool, numbered among the
// attention layers only (kv_cache_layer); linear-attention layers own a part of each sequence's
// recurrent-state slot (recurrent_layer; model.h's recurrent_state_layout gives its shape and
// bytes). An attention-only model's KV layer index is its layer index, as it always was.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace relay {

// RoPE scaling as transformers computes it. Parsing resolves every derived value, so for YaRN
// `attention_factor` is always set (> 0) and the rotary layer only applies the formulas.
struct RopeScaling {
  enum class Type { None, Yarn, Linear, Dynamic };
  Type type = Type::None;
  double factor = 1.0;  // context extension (positions / factor for Linear)
  int64_t original_max_position_embeddings = 0;  // context the model was trained on
  double beta_fast = 32.0;                       // YaRN: rotations where extrapolation starts
  double beta_slow = 1.0;                        // YaRN: rotations where interpolation ends
  double mscale = 0.0;                           // YaRN: as written in the config (0 = absent)
  double mscale_all_dim = 0.0;                   // YaRN: as written in the config (0 = absent)
  double attention_factor = 0.0;                 // YaRN: cos/sin multiplier, resolved at parse time
  bool truncate = true;                          // YaRN: floor/ceil the correction range
};

// The token mixer of a decoder layer, and so the cache it keeps: full (softmax) attention over the
// paged KV cache, or linear attention (Gated DeltaNet) with a per-sequence recurrent state.
enum class LayerType { kFullAttention, kLinearAttention };

struct ModelConfig {
  std::string architecture;  // a name of supported_architectures() (model/registry.h)
  std::string model_type;    // config.json's, e.g. "qwen3_moe", "qwen3_next", "qwen3_5_moe"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense MLP width (dense model, mlp_only_layers)
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  // absent: 128 for Qwen3 (transformers' default), hidden/heads for Qwen3-MoE, 256 for the hybrids
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;

  // Mixture of experts (num_experts == 0 for the dense model).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;

  // Hybrid models (Qwen3.5, Qwen3-Next). Layer l's token mixer: the config's layer_types, or when
  // absent every full_attention_interval-th layer is attention and the rest linear (transformers'
  // rule); every layer is full attention for Qwen3.
  // Empty (a config built by hand, not parsed) means every layer is full attention.
  std::vector<LayerType> layer_types;  // [num_hidden_layers]
  // Gated DeltaNet sizes (0 without linear-attention layers).
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;  // a multiple of linear_num_key_heads
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;
  // RoPE turns the first rotary_dim() dims of each head: 0.25 by default for the hybrids
  // (transformers' default for them), read from rope_parameters or the top level; 1 for Qwen3.
  double partial_rotary_factor = 1.0;
  // Gated attention: q_proj's rows are per head [query | gate], and the attention output is
  // multiplied by sigmoid(gate) before o_proj. Every hybrid model's attention is gated.
  bool attn_output_gate = false;
  // Zero-centred RMSNorm weights: every decoder RMSNorm (input, post-attention, final, q/k norms,
  // and the MTP norms) scales by (1 + w) instead of w. The Gated DeltaNet output norm
  // (linear_attn.norm) never does: its weight is plain. True for the hybrids.
  bool zero_centered_norms = false;
  // Each MoE layer's sigmoid-gated shared expert (a SwiGLU MLP of this width); 0: none (Qwen3-MoE).
  int64_t shared_expert_intermediate_size = 0;
  // Multi-token-prediction layers in the checkpoint (mtp_num_hidden_layers, or Qwen3-Next's
  // num_nextn_predict_layers; 0 for Qwen3). The head (mtp.*) is loaded only when asked for
  // (registry.h: MtpSource), which refuses more than one layer.
  int64_t mtp_num_hidden_layers = 0;

  // Tokens that end generation (config.json and generation_config.json, merged).
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;

  bool is_moe() const { return num_experts > 0; }
  // Whether layer `layer` uses the sparse MoE block (HF's rule: not in mlp_only_layers, experts
  // exist, and (layer + 1) % decoder_sparse_step == 0).
  bool layer_is_moe(int64_t layer) const;

  bool layer_is_linear_attention(int64_t layer) const;
  bool has_linear_attention() const { return num_recurrent_layers() > 0; }
  // Dims of each attention head that RoPE turns: int(head_dim * partial_rotary_factor), as
  // transformers computes it.
  int64_t rotary_dim() const;
  // Gated DeltaNet widths: all key heads, all value heads, and the conv channels q | k | v.
  int64_t linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int64_t linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int64_t linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }

  // The per-layer caches (see the top of this file). Attention layers: their count (the KV pool's
  // num_layers) and a layer's index in the pool, -1 for a linear-attention layer. Linear-attention
  // layers: their count (the recurrent state's num_layers) and a layer's index in a state slot, -1
  // for an attention layer. Both number their layers in layer order.
  int num_kv_cache_layers() const;
  int kv_cache_layer(int64_t layer) const;
  int num_recurrent_layers() const;
  int recurrent_layer(int64_t layer) const;

  // Parses a config.json object; `source` names the file in error messages.
  static ModelConfig from_json(const nlohmann::json& j, const std::string& source);
  // Reads DIR/config.json (and DIR/generation_config.json when present, for eos ids).
  static ModelConfig load(const std::filesystem::path& dir);
};

}  // namespace relay

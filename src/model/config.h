// The model configuration: every config.json field that changes the math of Qwen3 / Qwen3-MoE.
//
// Parsed once from a Hugging Face checkpoint directory and passed down by const reference. Fields
// not listed here do not change the forward pass (dropout, initializer_range, ...) and are ignored;
// a value Relay cannot run (an unknown architecture, sliding-window attention, an unknown
// rope_scaling type, hidden_act other than silu) is an error naming the field.
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

struct ModelConfig {
  std::string architecture;  // "Qwen3ForCausalLM" or "Qwen3MoeForCausalLM"
  std::string model_type;    // "qwen3" or "qwen3_moe"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense MLP width (dense model, mlp_only_layers)
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim =
      0;  // absent: 128 for Qwen3 (transformers' default), hidden/heads for Qwen3-MoE
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

  // Tokens that end generation (config.json and generation_config.json, merged).
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;

  bool is_moe() const { return num_experts > 0; }
  // Whether layer `layer` uses the sparse MoE block (HF's rule: not in mlp_only_layers, experts
  // exist, and (layer + 1) % decoder_sparse_step == 0).
  bool layer_is_moe(int64_t layer) const;

  // Parses a config.json object; `source` names the file in error messages.
  static ModelConfig from_json(const nlohmann::json& j, const std::string& source);
  // Reads DIR/config.json (and DIR/generation_config.json when present, for eos ids).
  static ModelConfig load(const std::filesystem::path& dir);
};

}  // namespace relay

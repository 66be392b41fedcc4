// Parsing config.json / generation_config.json into ModelConfig.
//
// The rules follow transformers' Qwen3Config / Qwen3MoeConfig / Qwen3NextConfig /
// Qwen3_5(Moe)TextConfig, because checkpoints are judged by what transformers computes from them: a
// field that is absent takes the transformers default (head_dim 128 for the dense model,
// hidden/heads for the MoE model, 256 for the hybrids; num_key_value_heads equal to the heads for
// the dense model; partial_rotary_factor 0.25 and full_attention_interval 4 for the hybrids),
// except the sizes that define the tensors, which must be present. Each architecture is one row of
// kArchitectureRules: its family, its model_type, and where its fields live (a vision-language
// checkpoint's text_config). Qwen3.5-MoE always renormalises its top-k and makes every layer MoE
// (transformers deletes norm_topk_prob, decoder_sparse_step and mlp_only_layers for it);
// Qwen3-Next reads them, with norm_topk_prob true by default.
// RoPE parameters may sit in the legacy "rope_scaling" object ("type" or "rope_type" key,
// rope_theta at the top level) or in transformers 5's "rope_parameters" object (rope_theta inside);
// both mean the same. Derived YaRN values (attention_factor, original_max_position_embeddings,
// factor) are resolved here so that the rotary layer never repeats transformers' defaulting logic.
// quantization_config is not read here: quant/quant_config.h owns it.
#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"

namespace relay {
namespace {

using nlohmann::json;

// Field readers: every error names the file and the field.
class Fields {
 public:
  Fields(const json& j, std::string source) : j_(j), source_(std::move(source)) {}

  const std::string& source() const { return source_; }
  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  [[noreturn]] void bad(const std::string& key, const std::string& why) const {
    fail(str(source_, ": field '", key, "' ", why));
  }

  int64_t integer(const char* key) const {
    if (!has(key)) bad(key, "is missing");
    return as_integer(j_.at(key), key);
  }
  int64_t integer(const char* key, int64_t fallback) const {
    return has(key) ? as_integer(j_.at(key), key) : fallback;
  }
  int64_t positive(const char* key) const {
    const int64_t v = integer(key);
    if (v <= 0) bad(key, str("must be positive, got ", v));
    return v;
  }
  int64_t positive(const char* key, int64_t fallback) const {
    const int64_t v = integer(key, fallback);
    if (v <= 0) bad(key, str("must be positive, got ", v));
    return v;
  }
  double number(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    if (!v.is_number()) bad(key, str("must be a number, got ", v.dump()));
    const double d = v.get<double>();
    if (!std::isfinite(d)) bad(key, "must be finite");
    return d;
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    if (!v.is_boolean()) bad(key, str("must be true or false, got ", v.dump()));
    return v.get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    if (!v.is_string()) bad(key, str("must be a string, got ", v.dump()));
    return v.get<std::string>();
  }
  // An int or a list of ints (eos_token_id may be either); empty when absent.
  std::vector<int32_t> token_ids(const char* key) const {
    std::vector<int32_t> ids;
    if (!has(key)) return ids;
    const json& v = j_.at(key);
    auto add = [&](const json& e) {
      const int64_t id = as_integer(e, key);
      if (id < 0 || id > INT32_MAX) bad(key, str("holds an invalid token id ", id));
      ids.push_back(static_cast<int32_t>(id));
    };
    if (v.is_array()) {
      for (const json& e : v) add(e);
    } else {
      add(v);
    }
    return ids;
  }
  const json& at(const char* key) const { return j_.at(key); }

 private:
  int64_t as_integer(const json& v, const std::string& key) const {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        bad(key, "is out of range");
      }
      return v.get<int64_t>();
    }
    // Some exporters write integral sizes as floats (4096.0); accept those, reject 4096.5.
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
        return static_cast<int64_t>(d);
      }
    }
    bad(key, str("must be an integer, got ", v.dump()));
  }

  const json& j_;
  std::string source_;
};

RopeScaling::Type parse_rope_type(const std::string& name, const Fields& f, const char* key) {
  if (name == "default" || name.empty()) return RopeScaling::Type::None;
  if (name == "yarn") return RopeScaling::Type::Yarn;
  if (name == "linear") return RopeScaling::Type::Linear;
  if (name == "dynamic") return RopeScaling::Type::Dynamic;
  f.bad(key,
        str("has unsupported rope type '", name, "' (supported: default, yarn, linear, dynamic)"));
}

// transformers' get_mscale: the YaRN attention temperature for a context extension `scale`.
double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// partial_rotary_factor, read by `f` (the top level or the rope object): transformers rotates
// int(head_dim * factor) dims. Qwen3 has no partial rotary; the hybrids do.
void check_partial_rotary(const Fields& f, const ModelConfig& c, bool partial_allowed) {
  const double factor = c.partial_rotary_factor;
  if (!partial_allowed) {
    if (factor != 1.0) {
      f.bad("partial_rotary_factor", str("is ", factor, "; it must be 1.0 for ", c.architecture,
                                         " (partial rotary embeddings are not supported)"));
    }
    return;
  }
  if (!(factor > 0.0 && factor <= 1.0)) {
    f.bad("partial_rotary_factor", str("must be in (0, 1], got ", factor));
  }
  const int64_t dims = c.rotary_dim();
  if (dims < 2 || dims % 2 != 0) {
    f.bad("partial_rotary_factor", str("turns ", dims, " of head_dim ", c.head_dim,
                                       " dims; RoPE needs a positive even number"));
  }
}

// Reads rope_theta, partial_rotary_factor and the scaling parameters from either spelling into
// `c`. transformers' priority: the rope object's value, then the top-level one, then the default.
void parse_rope(const Fields& top, ModelConfig& c, double partial_default, bool partial_allowed) {
  const bool has_params = top.has("rope_parameters");
  const bool has_scaling = top.has("rope_scaling");
  const char* key = has_params ? "rope_parameters" : "rope_scaling";
  c.rope_theta = top.number("rope_theta", 10000.0);
  c.partial_rotary_factor = top.number("partial_rotary_factor", partial_default);
  if (!has_params && !has_scaling) {
    if (c.rope_theta <= 0) top.bad("rope_theta", "must be positive");
    check_partial_rotary(top, c, partial_allowed);
    return;
  }
  const json& obj = top.at(key);
  if (!obj.is_object()) top.bad(key, str("must be an object, got ", obj.dump()));
  if (obj.contains("full_attention") || obj.contains("sliding_attention")) {
    top.bad(key, "is nested by layer type, which Qwen models do not use");
  }
  const Fields f(obj, str(top.source(), ": ", key));
  c.rope_theta = f.number("rope_theta", c.rope_theta);
  if (c.rope_theta <= 0) f.bad("rope_theta", "must be positive");
  c.partial_rotary_factor = f.number("partial_rotary_factor", c.partial_rotary_factor);
  check_partial_rotary(f.has("partial_rotary_factor") ? f : top, c, partial_allowed);
  // NOTE: Qwen3.5's mrope_section / mrope_interleaved are not read: for text, its three position
  // rows (temporal, height, width) are all the token position, and interleaved MRoPE is 1-D RoPE.
  std::string type_name = f.string("rope_type", f.string("type", "default"));
  RopeScaling& r = c.rope_scaling;
  r = RopeScaling{};
  r.type = parse_rope_type(type_name, f, f.has("rope_type") ? "rope_type" : "type");
  if (r.type == RopeScaling::Type::None) return;

  r.original_max_position_embeddings =
      top.has("original_max_position_embeddings")
          ? top.positive("original_max_position_embeddings")
          : f.positive("original_max_position_embeddings", c.max_position_embeddings);
  if (f.has("factor")) {
    r.factor = f.number("factor", 1.0);
  } else if (r.type == RopeScaling::Type::Yarn) {
    r.factor = static_cast<double>(c.max_position_embeddings) /
               static_cast<double>(r.original_max_position_embeddings);
  } else {
    f.bad("factor", "is missing");
  }
  if (!(r.factor >= 1.0)) f.bad("factor", str("must be >= 1, got ", r.factor));
  if (r.type != RopeScaling::Type::Yarn) return;

  // transformers treats 0 / missing beta values as the paper's defaults (`or 32`, `or 1`).
  r.beta_fast = f.number("beta_fast", 0.0);
  if (r.beta_fast == 0.0) r.beta_fast = 32.0;
  r.beta_slow = f.number("beta_slow", 0.0);
  if (r.beta_slow == 0.0) r.beta_slow = 1.0;
  if (r.beta_fast <= 0 || r.beta_slow <= 0) f.bad("beta_fast", "and beta_slow must be positive");
  r.truncate = f.boolean("truncate", true);
  r.mscale = f.number("mscale", 0.0);
  r.mscale_all_dim = f.number("mscale_all_dim", 0.0);
  if (f.has("attention_factor")) {
    r.attention_factor = f.number("attention_factor", 0.0);
    if (r.attention_factor <= 0) f.bad("attention_factor", "must be positive");
  } else if (r.mscale != 0.0 && r.mscale_all_dim != 0.0) {
    r.attention_factor = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim);
  } else {
    r.attention_factor = yarn_mscale(r.factor, 1.0);
  }
}

// layer_types, or for the hybrids full_attention_interval (transformers: layer l is attention iff
// (l + 1) % interval == 0). Sliding-window attention is refused in either spelling.
void parse_layer_types(const Fields& f, ModelConfig& c, bool hybrid) {
  if (f.boolean("use_sliding_window", false)) {
    f.bad("use_sliding_window", "is true; sliding-window attention is not supported");
  }
  c.layer_types.assign(c.num_hidden_layers, LayerType::kFullAttention);
  if (!f.has("layer_types")) {
    if (!hybrid) return;
    const int64_t interval = f.positive("full_attention_interval", 4);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      if ((l + 1) % interval != 0) c.layer_types[l] = LayerType::kLinearAttention;
    }
    return;
  }
  const json& types = f.at("layer_types");
  if (!types.is_array()) f.bad("layer_types", "must be a list");
  if (static_cast<int64_t>(types.size()) != c.num_hidden_layers) {
    f.bad("layer_types",
          str("has ", types.size(), " entries for ", c.num_hidden_layers, " layers"));
  }
  for (size_t l = 0; l < types.size(); ++l) {
    const json& t = types[l];
    const std::string name = t.is_string() ? t.get<std::string>() : "";
    if (name == "full_attention") continue;
    if (hybrid && name == "linear_attention") {
      c.layer_types[l] = LayerType::kLinearAttention;
      continue;
    }
    f.bad("layer_types",
          str("holds ", t.dump(), "; only full_attention ",
              hybrid ? "and linear_attention layers are" : "layers are", " supported"));
  }
}

// The Gated DeltaNet sizes and what every hybrid model shares.
void parse_hybrid(const Fields& f, ModelConfig& c) {
  c.linear_num_key_heads = f.positive("linear_num_key_heads");
  c.linear_num_value_heads = f.positive("linear_num_value_heads");
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0) {
    f.bad("linear_num_value_heads",
          str("(", c.linear_num_value_heads, ") must be a multiple of linear_num_key_heads (",
              c.linear_num_key_heads, ")"));
  }
  c.linear_key_head_dim = f.positive("linear_key_head_dim");
  c.linear_value_head_dim = f.positive("linear_value_head_dim");
  c.linear_conv_kernel_dim = f.positive("linear_conv_kernel_dim");
  // transformers ignores attn_output_gate and always gates: a checkpoint that says otherwise was
  // not made by these architectures.
  c.attn_output_gate = f.boolean("attn_output_gate", true);
  if (!c.attn_output_gate) {
    f.bad("attn_output_gate", str("is false; ", c.architecture, " attention is always gated"));
  }
  c.zero_centered_norms = true;
  c.mtp_num_hidden_layers = f.has("mtp_num_hidden_layers")
                                ? f.integer("mtp_num_hidden_layers")
                                : f.integer("num_nextn_predict_layers", 0);
  if (c.mtp_num_hidden_layers < 0) {
    f.bad(f.has("mtp_num_hidden_layers") ? "mtp_num_hidden_layers" : "num_nextn_predict_layers",
          str("must not be negative, got ", c.mtp_num_hidden_layers));
  }
}

void check_token_ids(const ModelConfig& c, const std::string& source) {
  for (int32_t id : c.eos_token_ids) {
    if (id >= c.vocab_size) {
      fail(str(source, ": eos_token_id ", id, " is outside the vocabulary (", c.vocab_size, ")"));
    }
  }
  if (c.bos_token_id >= c.vocab_size) {
    fail(str(source, ": bos_token_id ", c.bos_token_id, " is outside the vocabulary (",
             c.vocab_size, ")"));
  }
}

json read_json_file(const std::filesystem::path& path) {
  json j = parse_json_file(path);
  if (!j.is_object()) fail(str(path.string(), ": expected a JSON object"));
  return j;
}

enum class Family { kQwen3, kQwen3Moe, kQwen3Next, kQwen3_5, kQwen3_5Moe };

// How config.json reads for one architecture.
struct ArchitectureRule {
  const char* architecture;
  Family family;
  const char* model_type;       // config.json's model_type
  const char* text_model_type;  // the text_config's, for a vision-language checkpoint; else null
};

constexpr ArchitectureRule kArchitectureRules[] = {
    {"Qwen3ForCausalLM", Family::kQwen3, "qwen3", nullptr},
    {"Qwen3MoeForCausalLM", Family::kQwen3Moe, "qwen3_moe", nullptr},
    {"Qwen3NextForCausalLM", Family::kQwen3Next, "qwen3_next", nullptr},
    {"Qwen3_5ForConditionalGeneration", Family::kQwen3_5, "qwen3_5", "qwen3_5_text"},
    {"Qwen3_5ForCausalLM", Family::kQwen3_5, "qwen3_5_text", nullptr},
    {"Qwen3_5MoeForConditionalGeneration", Family::kQwen3_5Moe, "qwen3_5_moe", "qwen3_5_moe_text"},
    {"Qwen3_5MoeForCausalLM", Family::kQwen3_5Moe, "qwen3_5_moe_text", nullptr},
};

const ArchitectureRule& architecture_rule(const Fields& f, const std::string& name) {
  std::string supported;
  for (const ArchitectureRule& r : kArchitectureRules) {
    if (name == r.architecture) return r;
    supported += str(supported.empty() ? "" : ", ", r.architecture);
  }
  f.bad("architectures",
        str("names unsupported architecture '", name, "' (supported: ", supported, ")"));
}

void parse_experts(const Fields& f, ModelConfig& c, Family family) {
  // transformers 5 writes the expert count as num_local_experts; published checkpoints say
  // num_experts. Either names the same field.
  c.num_experts = f.has("num_experts") || !f.has("num_local_experts")
                      ? f.positive("num_experts")
                      : f.positive("num_local_experts");
  c.num_experts_per_tok = f.positive("num_experts_per_tok");
  if (c.num_experts_per_tok > c.num_experts) {
    f.bad("num_experts_per_tok",
          str("(", c.num_experts_per_tok, ") exceeds num_experts (", c.num_experts, ")"));
  }
  c.moe_intermediate_size = f.positive("moe_intermediate_size");
  if (family != Family::kQwen3Moe) {
    c.shared_expert_intermediate_size = f.positive("shared_expert_intermediate_size");
  }
  if (family == Family::kQwen3_5Moe) {
    c.norm_topk_prob = true;
    return;
  }
  c.norm_topk_prob = f.boolean("norm_topk_prob", family == Family::kQwen3Next);
  c.decoder_sparse_step = f.positive("decoder_sparse_step", 1);
  if (f.has("mlp_only_layers")) {
    const json& layers = f.at("mlp_only_layers");
    if (!layers.is_array()) f.bad("mlp_only_layers", "must be a list of layer indices");
    std::set<int64_t> seen;
    for (const json& l : layers) {
      if (!l.is_number_integer()) f.bad("mlp_only_layers", str("holds non-integer ", l.dump()));
      const int64_t layer = l.get<int64_t>();
      if (layer < 0 || layer >= c.num_hidden_layers) {
        f.bad("mlp_only_layers",
              str("holds layer ", layer, " outside [0, ", c.num_hidden_layers, ")"));
      }
      if (seen.insert(layer).second) c.mlp_only_layers.push_back(layer);
    }
  }
}

// Adds the ids of `more` that `ids` lacks, in order.
void merge_token_ids(std::vector<int32_t>& ids, const std::vector<int32_t>& more) {
  for (int32_t id : more) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  }
}

}  // namespace

bool ModelConfig::layer_is_moe(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::rotary_dim() const {
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
}

bool ModelConfig::layer_is_linear_attention(int64_t layer) const {
  return !layer_types.empty() && layer_types.at(layer) == LayerType::kLinearAttention;
}

int ModelConfig::num_recurrent_layers() const {
  return static_cast<int>(
      std::count(layer_types.begin(), layer_types.end(), LayerType::kLinearAttention));
}

int ModelConfig::num_kv_cache_layers() const {
  return static_cast<int>(num_hidden_layers) - num_recurrent_layers();
}

int ModelConfig::recurrent_layer(int64_t layer) const {
  if (!layer_is_linear_attention(layer)) return -1;
  return static_cast<int>(
      std::count(layer_types.begin(), layer_types.begin() + layer, LayerType::kLinearAttention));
}

int ModelConfig::kv_cache_layer(int64_t layer) const {
  if (layer_is_linear_attention(layer)) return -1;
  const int linear_before =
      layer_types.empty()
          ? 0
          : static_cast<int>(std::count(layer_types.begin(), layer_types.begin() + layer,
                                        LayerType::kLinearAttention));
  return static_cast<int>(layer) - linear_before;
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) fail(str(source, ": expected a JSON object"));
  const Fields top(j, source);
  ModelConfig c;

  if (!top.has("architectures")) top.bad("architectures", "is missing");
  const json& archs = top.at("architectures");
  if (!archs.is_array() || archs.size() != 1 || !archs[0].is_string()) {
    top.bad("architectures", str("must be a list of one name, got ", archs.dump()));
  }
  c.architecture = archs[0].get<std::string>();
  const ArchitectureRule& rule = architecture_rule(top, c.architecture);
  c.model_type = top.string("model_type", rule.model_type);
  if (c.model_type != rule.model_type) {
    top.bad("model_type", str("is '", c.model_type, "', which does not match ", c.architecture));
  }
  // A vision-language checkpoint keeps its language model's fields under text_config.
  if (rule.text_model_type != nullptr) {
    if (!top.has("text_config")) top.bad("text_config", "is missing");
    if (!top.at("text_config").is_object()) top.bad("text_config", "must be an object");
  }
  const Fields f = rule.text_model_type != nullptr
                       ? Fields(top.at("text_config"), str(source, ": text_config"))
                       : top;
  if (rule.text_model_type != nullptr &&
      f.string("model_type", rule.text_model_type) != rule.text_model_type) {
    f.bad("model_type", str("is '", f.string("model_type", ""), "', which does not match ",
                            c.architecture, " (expected '", rule.text_model_type, "')"));
  }
  const Family family = rule.family;
  const bool hybrid = family != Family::kQwen3 && family != Family::kQwen3Moe;
  const bool moe =
      family == Family::kQwen3Moe || family == Family::kQwen3Next || family == Family::kQwen3_5Moe;

  const std::string act = f.string("hidden_act", "silu");
  if (act != "silu") f.bad("hidden_act", str("is '", act, "'; only silu is supported"));

  c.vocab_size = f.positive("vocab_size");
  c.hidden_size = f.positive("hidden_size");
  c.num_hidden_layers = f.positive("num_hidden_layers");
  c.num_attention_heads = f.positive("num_attention_heads");
  c.num_key_value_heads = family != Family::kQwen3
                              ? f.positive("num_key_value_heads")
                              : f.positive("num_key_value_heads", c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    f.bad("num_key_value_heads",
          str("(", c.num_key_value_heads, ") must divide num_attention_heads (",
              c.num_attention_heads, ")"));
  }
  // NOTE: transformers' Qwen3Config declares head_dim = 128 as its default (the hybrids' configs
  // 256); Qwen3MoeConfig has no such field, so the attention layer falls back to
  // hidden_size / num_attention_heads.
  const bool head_dim_from_hidden = family == Family::kQwen3Moe;
  if (head_dim_from_hidden && !f.has("head_dim") && c.hidden_size % c.num_attention_heads != 0) {
    f.bad("head_dim",
          str("is missing and hidden_size (", c.hidden_size,
              ") is not divisible by num_attention_heads (", c.num_attention_heads, ")"));
  }
  c.head_dim = f.positive("head_dim", head_dim_from_hidden ? c.hidden_size / c.num_attention_heads
                                      : hybrid             ? 256
                                                           : 128);
  if (c.head_dim % 2 != 0)
    f.bad("head_dim", str("must be even for rotary embeddings, got ", c.head_dim));
  c.max_position_embeddings = f.positive("max_position_embeddings", 32768);
  c.rms_norm_eps = f.number("rms_norm_eps", 1e-6);
  if (!(c.rms_norm_eps > 0)) f.bad("rms_norm_eps", str("must be positive, got ", c.rms_norm_eps));
  c.tie_word_embeddings =
      f.boolean("tie_word_embeddings", top.boolean("tie_word_embeddings", false));
  c.attention_bias = f.boolean("attention_bias", false);
  parse_layer_types(f, c, hybrid);
  parse_rope(f, c, hybrid ? 0.25 : 1.0, hybrid);
  if (hybrid) parse_hybrid(f, c);
  if (moe) parse_experts(f, c, family);

  bool any_dense_layer = false;
  for (int64_t l = 0; l < c.num_hidden_layers && !any_dense_layer; ++l) {
    any_dense_layer = !c.layer_is_moe(l);
  }
  // The MoE model carries intermediate_size even when every layer is sparse; it only matters (and
  // must then be valid) when some layer uses the dense MLP.
  c.intermediate_size =
      any_dense_layer ? f.positive("intermediate_size") : f.integer("intermediate_size", 0);

  c.eos_token_ids = f.token_ids("eos_token_id");
  std::vector<int32_t> bos = f.token_ids("bos_token_id");
  if (rule.text_model_type != nullptr) {
    merge_token_ids(c.eos_token_ids, top.token_ids("eos_token_id"));
    if (bos.empty()) bos = top.token_ids("bos_token_id");
  }
  if (bos.size() > 1) f.bad("bos_token_id", "must be a single token id");
  c.bos_token_id = bos.empty() ? -1 : bos[0];
  check_token_ids(c, source);
  return c;
}

ModelConfig ModelConfig::load(const std::filesystem::path& dir) {
  const std::filesystem::path config_path = dir / "config.json";
  ModelConfig c = from_json(read_json_file(config_path), config_path.string());
  const std::filesystem::path gen_path = dir / "generation_config.json";
  if (std::filesystem::exists(gen_path)) {
    const json g = read_json_file(gen_path);
    const Fields f(g, gen_path.string());
    // generation_config.json is what transformers' generate() stops on; it may list more ids than
    // config.json (Qwen3 instruct models add <|endoftext|>), so the two are merged.
    merge_token_ids(c.eos_token_ids, f.token_ids("eos_token_id"));
    const std::vector<int32_t> bos = f.token_ids("bos_token_id");
    if (bos.size() > 1) f.bad("bos_token_id", "must be a single token id");
    if (c.bos_token_id < 0 && !bos.empty()) c.bos_token_id = bos[0];
    check_token_ids(c, gen_path.string());
  }
  return c;
}

}  // namespace relay

// Parsing config.json / generation_config.json into ModelConfig.
//
// The rules follow transformers' Qwen3Config / Qwen3MoeConfig, because checkpoints are judged by
// what transformers computes from them: a field that is absent takes the transformers default
// (head_dim 128 for the dense model, hidden/heads for the MoE model; num_key_value_heads equal to
// the heads for the dense model), except the sizes that define the tensors, which must be present.
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

// Reads rope_theta and the scaling parameters from either spelling into `c`.
void parse_rope(const Fields& top, ModelConfig& c) {
  const bool has_params = top.has("rope_parameters");
  const bool has_scaling = top.has("rope_scaling");
  const char* key = has_params ? "rope_parameters" : "rope_scaling";
  c.rope_theta = top.number("rope_theta", 10000.0);
  if (!has_params && !has_scaling) {
    if (c.rope_theta <= 0) top.bad("rope_theta", "must be positive");
    return;
  }
  const json& obj = top.at(key);
  if (!obj.is_object()) top.bad(key, str("must be an object, got ", obj.dump()));
  if (obj.contains("full_attention") || obj.contains("sliding_attention")) {
    top.bad(key, "is nested by layer type, which Qwen3 models do not use");
  }
  const Fields f(obj, str(top.source(), ": ", key));
  c.rope_theta = f.number("rope_theta", c.rope_theta);
  if (c.rope_theta <= 0) f.bad("rope_theta", "must be positive");
  if (f.has("partial_rotary_factor") && f.number("partial_rotary_factor", 1.0) != 1.0) {
    f.bad("partial_rotary_factor", "must be 1.0 (partial rotary embeddings are not supported)");
  }
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

void reject_sliding_window(const Fields& f, const ModelConfig& c) {
  if (f.boolean("use_sliding_window", false)) {
    f.bad("use_sliding_window", "is true; sliding-window attention is not supported");
  }
  if (!f.has("layer_types")) return;
  const json& types = f.at("layer_types");
  if (!types.is_array()) f.bad("layer_types", "must be a list");
  if (static_cast<int64_t>(types.size()) != c.num_hidden_layers) {
    f.bad("layer_types",
          str("has ", types.size(), " entries for ", c.num_hidden_layers, " layers"));
  }
  for (const json& t : types) {
    if (!t.is_string() || t.get<std::string>() != "full_attention") {
      f.bad("layer_types", str("holds ", t.dump(), "; only full_attention layers are supported"));
    }
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

}  // namespace

bool ModelConfig::layer_is_moe(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) fail(str(source, ": expected a JSON object"));
  const Fields f(j, source);
  ModelConfig c;

  if (!f.has("architectures")) f.bad("architectures", "is missing");
  const json& archs = f.at("architectures");
  if (!archs.is_array() || archs.size() != 1 || !archs[0].is_string()) {
    f.bad("architectures", str("must be a list of one name, got ", archs.dump()));
  }
  c.architecture = archs[0].get<std::string>();
  bool moe;
  if (c.architecture == "Qwen3ForCausalLM") {
    moe = false;
    c.model_type = f.string("model_type", "qwen3");
  } else if (c.architecture == "Qwen3MoeForCausalLM") {
    moe = true;
    c.model_type = f.string("model_type", "qwen3_moe");
  } else {
    f.bad("architectures", str("names unsupported architecture '", c.architecture,
                               "' (supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM)"));
  }
  if (c.model_type != (moe ? "qwen3_moe" : "qwen3")) {
    f.bad("model_type", str("is '", c.model_type, "', which does not match ", c.architecture));
  }

  const std::string act = f.string("hidden_act", "silu");
  if (act != "silu") f.bad("hidden_act", str("is '", act, "'; only silu is supported"));

  c.vocab_size = f.positive("vocab_size");
  c.hidden_size = f.positive("hidden_size");
  c.num_hidden_layers = f.positive("num_hidden_layers");
  c.num_attention_heads = f.positive("num_attention_heads");
  c.num_key_value_heads = moe ? f.positive("num_key_value_heads")
                              : f.positive("num_key_value_heads", c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    f.bad("num_key_value_heads",
          str("(", c.num_key_value_heads, ") must divide num_attention_heads (",
              c.num_attention_heads, ")"));
  }
  // NOTE: transformers' Qwen3Config declares head_dim = 128 as its default; Qwen3MoeConfig has no
  // such field, so the attention layer falls back to hidden_size / num_attention_heads.
  if (moe && !f.has("head_dim") && c.hidden_size % c.num_attention_heads != 0) {
    f.bad("head_dim",
          str("is missing and hidden_size (", c.hidden_size,
              ") is not divisible by num_attention_heads (", c.num_attention_heads, ")"));
  }
  c.head_dim = f.positive("head_dim", moe ? c.hidden_size / c.num_attention_heads : 128);
  if (c.head_dim % 2 != 0)
    f.bad("head_dim", str("must be even for rotary embeddings, got ", c.head_dim));
  c.max_position_embeddings = f.positive("max_position_embeddings", 32768);
  c.rms_norm_eps = f.number("rms_norm_eps", 1e-6);
  if (!(c.rms_norm_eps > 0)) f.bad("rms_norm_eps", str("must be positive, got ", c.rms_norm_eps));
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  c.attention_bias = f.boolean("attention_bias", false);
  reject_sliding_window(f, c);
  parse_rope(f, c);

  if (moe) {
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
    c.norm_topk_prob = f.boolean("norm_topk_prob", false);
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
  bool any_dense_layer = false;
  for (int64_t l = 0; l < c.num_hidden_layers && !any_dense_layer; ++l) {
    any_dense_layer = !c.layer_is_moe(l);
  }
  // The MoE model carries intermediate_size even when every layer is sparse; it only matters (and
  // must then be valid) when some layer uses the dense MLP.
  c.intermediate_size =
      any_dense_layer ? f.positive("intermediate_size") : f.integer("intermediate_size", 0);

  c.eos_token_ids = f.token_ids("eos_token_id");
  const std::vector<int32_t> bos = f.token_ids("bos_token_id");
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
    for (int32_t id : f.token_ids("eos_token_id")) {
      if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end()) {
        c.eos_token_ids.push_back(id);
      }
    }
    const std::vector<int32_t> bos = f.token_ids("bos_token_id");
    if (bos.size() > 1) f.bad("bos_token_id", "must be a single token id");
    if (c.bos_token_id < 0 && !bos.empty()) c.bos_token_id = bos[0];
    check_token_ids(c, gen_path.string());
  }
  return c;
}

}  // namespace relay

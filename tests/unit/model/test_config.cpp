// ModelConfig parsing: the embedded demo model, transformers' defaults, YaRN resolution in both
// spellings, and every rejection path (each message must name the file and the field).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

namespace relay {
namespace {

using nlohmann::json;

json moe_config() {
  return json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu", "tie_word_embeddings": false, "eos_token_id": 7, "bos_token_id": 5,
    "use_sliding_window": false, "sliding_window": null, "rope_scaling": null})");
}

json dense_config() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rope_theta": 1000000.0, "tie_word_embeddings": true})");
}

// Expects from_json to throw a relay::Error whose message contains every one of `parts`.
void expect_error(const json& j, std::initializer_list<std::string> parts) {
  try {
    ModelConfig::from_json(j, "dir/config.json");
    ADD_FAILURE() << "no error for " << j.dump();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("dir/config.json"), std::string::npos) << msg;
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << msg << " lacks " << p;
  }
}

TEST(ModelConfig, LoadsTheDemoModel) {
  const ModelConfig c =
      ModelConfig::load(std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe");
  EXPECT_EQ(c.architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 192);
  EXPECT_EQ(c.intermediate_size, 512);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::None);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  // config.json says 151645; generation_config.json adds 151643 (merged, no duplicates).
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{151645, 151643}));
  EXPECT_EQ(c.bos_token_id, 151643);
  for (int64_t l = 0; l < 4; ++l) EXPECT_TRUE(c.layer_is_moe(l));
}

TEST(ModelConfig, DenseModelAndTransformersDefaults) {
  json j = dense_config();
  ModelConfig c = ModelConfig::from_json(j, "x");
  EXPECT_FALSE(c.is_moe());
  EXPECT_FALSE(c.layer_is_moe(0));
  EXPECT_EQ(c.intermediate_size, 128);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.bos_token_id, -1);

  // Qwen3Config's head_dim default is 128, whatever hidden/heads is; kv heads default to heads.
  j.erase("head_dim");
  j.erase("num_key_value_heads");
  j.erase("max_position_embeddings");
  c = ModelConfig::from_json(j, "x");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.max_position_embeddings, 32768);

  // Qwen3-MoE's attention falls back to hidden_size / num_attention_heads.
  json m = moe_config();
  m.erase("head_dim");
  EXPECT_EQ(ModelConfig::from_json(m, "x").head_dim, 16);
}

TEST(ModelConfig, LayerIsMoeFollowsTransformersRule) {
  json j = moe_config();
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  const ModelConfig c = ModelConfig::from_json(j, "x");
  // (layer + 1) % 2 == 0 -> layers 1 and 3; layer 3 is forced dense.
  EXPECT_FALSE(c.layer_is_moe(0));
  EXPECT_TRUE(c.layer_is_moe(1));
  EXPECT_FALSE(c.layer_is_moe(2));
  EXPECT_FALSE(c.layer_is_moe(3));
  EXPECT_EQ(c.mlp_only_layers, (std::vector<int64_t>{3}));
}

TEST(ModelConfig, ExpertCountMayBeSpelledNumLocalExperts) {
  // transformers 5's save_pretrained writes num_local_experts instead of num_experts.
  json j = moe_config();
  j.erase("num_experts");
  j["num_local_experts"] = 8;
  EXPECT_EQ(ModelConfig::from_json(j, "dir/config.json").num_experts, 8);
  j.erase("num_local_experts");
  expect_error(j, {"num_experts", "missing"});
}

TEST(ModelConfig, EosMayBeAListAndIntegralFloatsAreAccepted) {
  json j = moe_config();
  j["eos_token_id"] = {7, 8};
  j["hidden_size"] = 64.0;
  const ModelConfig c = ModelConfig::from_json(j, "x");
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(c.hidden_size, 64);
}

TEST(ModelConfig, YarnInLegacyRopeScaling) {
  json j = moe_config();
  j["rope_scaling"] = {
      {"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  const ModelConfig c = ModelConfig::from_json(j, "x");
  const RopeScaling& r = c.rope_scaling;
  EXPECT_EQ(r.type, RopeScaling::Type::Yarn);
  EXPECT_DOUBLE_EQ(r.factor, 4.0);
  EXPECT_EQ(r.original_max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(r.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(r.beta_slow, 1.0);
  EXPECT_TRUE(r.truncate);
  EXPECT_DOUBLE_EQ(r.attention_factor, 0.1 * std::log(4.0) + 1.0);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
}

TEST(ModelConfig, YarnInRopeParametersWithMscaleAndDefaults) {
  json j = moe_config();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "yarn"},   {"rope_theta", 5e5}, {"mscale", 0.707},
                          {"mscale_all_dim", 1.0}, {"beta_fast", 16},   {"truncate", false},
                          {"factor", 2.0}};
  const ModelConfig c = ModelConfig::from_json(j, "x");
  const RopeScaling& r = c.rope_scaling;
  EXPECT_DOUBLE_EQ(c.rope_theta, 5e5);
  EXPECT_EQ(r.type, RopeScaling::Type::Yarn);
  // original_max_position_embeddings defaults to max_position_embeddings, as transformers does.
  EXPECT_EQ(r.original_max_position_embeddings, 2048);
  EXPECT_DOUBLE_EQ(r.beta_fast, 16.0);
  EXPECT_FALSE(r.truncate);
  const double expected = (0.1 * 0.707 * std::log(2.0) + 1.0) / (0.1 * 1.0 * std::log(2.0) + 1.0);
  EXPECT_DOUBLE_EQ(r.attention_factor, expected);

  // An explicit attention_factor wins; a missing factor is max/original.
  j["rope_parameters"] = {
      {"rope_type", "yarn"}, {"attention_factor", 1.5}, {"original_max_position_embeddings", 512}};
  const ModelConfig d = ModelConfig::from_json(j, "x");
  EXPECT_DOUBLE_EQ(d.rope_scaling.attention_factor, 1.5);
  EXPECT_DOUBLE_EQ(d.rope_scaling.factor, 4.0);
  EXPECT_DOUBLE_EQ(d.rope_theta, 1e4);  // transformers' default when no rope_theta is given

  // "default" in rope_parameters only carries rope_theta.
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 123.0}};
  const ModelConfig e = ModelConfig::from_json(j, "x");
  EXPECT_EQ(e.rope_scaling.type, RopeScaling::Type::None);
  EXPECT_DOUBLE_EQ(e.rope_theta, 123.0);
}

TEST(ModelConfig, LinearScaling) {
  json j = moe_config();
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  const ModelConfig c = ModelConfig::from_json(j, "x");
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::Linear);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 2.0);
}

TEST(ModelConfig, RejectsWhatRelayCannotRun) {
  auto with = [](const char* key, json v) {
    json j = moe_config();
    j[key] = std::move(v);
    return j;
  };
  auto without = [](const char* key) {
    json j = moe_config();
    j.erase(key);
    return j;
  };
  expect_error(with("architectures", {"LlamaForCausalLM"}), {"architectures", "LlamaForCausalLM"});
  expect_error(with("architectures", "Qwen3MoeForCausalLM"), {"architectures"});
  expect_error(without("architectures"), {"architectures", "missing"});
  expect_error(with("model_type", "qwen3"), {"model_type"});
  expect_error(with("hidden_act", "gelu"), {"hidden_act", "gelu"});
  expect_error(with("use_sliding_window", true), {"use_sliding_window"});
  expect_error(with("layer_types",
                    {"full_attention", "sliding_attention", "full_attention", "full_attention"}),
               {"layer_types", "sliding_attention"});
  expect_error(with("rope_scaling", {{"type", "longrope"}, {"factor", 2.0}}), {"type", "longrope"});
  expect_error(with("rope_scaling", {{"rope_type", "su"}}), {"rope_type", "su"});
  expect_error(with("rope_scaling", {{"rope_type", "linear"}}), {"factor", "missing"});
  expect_error(with("rope_scaling", {{"rope_type", "yarn"}, {"factor", 0.5}}), {"factor"});
  expect_error(with("rope_scaling", "yarn"), {"rope_scaling", "object"});
  expect_error(with("rope_parameters", {{"rope_type", "default"}, {"partial_rotary_factor", 0.5}}),
               {"partial_rotary_factor"});
  expect_error(with("rope_theta", -1.0), {"rope_theta"});
  expect_error(with("hidden_size", 0), {"hidden_size", "positive"});
  expect_error(with("hidden_size", 64.5), {"hidden_size", "integer"});
  expect_error(with("hidden_size", "64"), {"hidden_size", "integer"});
  expect_error(with("vocab_size", -3), {"vocab_size", "positive"});
  expect_error(without("vocab_size"), {"vocab_size", "missing"});
  expect_error(without("num_hidden_layers"), {"num_hidden_layers", "missing"});
  expect_error(with("num_key_value_heads", 3), {"num_key_value_heads", "divide"});
  expect_error(with("head_dim", 15), {"head_dim", "even"});
  expect_error(with("num_experts_per_tok", 9), {"num_experts_per_tok", "exceeds"});
  expect_error(with("num_experts", 0), {"num_experts"});
  expect_error(without("moe_intermediate_size"), {"moe_intermediate_size", "missing"});
  expect_error(with("decoder_sparse_step", 0), {"decoder_sparse_step"});
  expect_error(with("mlp_only_layers", {4}), {"mlp_only_layers", "4"});
  expect_error(with("mlp_only_layers", 1), {"mlp_only_layers"});
  expect_error(with("norm_topk_prob", "yes"), {"norm_topk_prob"});
  expect_error(with("rms_norm_eps", 0.0), {"rms_norm_eps"});
  expect_error(with("eos_token_id", 1000), {"eos_token_id", "1000"});
  expect_error(with("eos_token_id", {1, -2}), {"eos_token_id"});
  expect_error(with("bos_token_id", {1, 2}), {"bos_token_id"});
  // A dense layer needs intermediate_size.
  json j = with("mlp_only_layers", {0});
  j.erase("intermediate_size");
  expect_error(j, {"intermediate_size", "missing"});
  // Without head_dim, hidden must split evenly over the heads.
  j = with("hidden_size", 66);
  j.erase("head_dim");
  expect_error(j, {"head_dim"});
  expect_error(json::array(), {"object"});
}

std::filesystem::path fixture(const std::string& name) {
  return std::filesystem::path(RELAY_FIXTURES_DIR) / "models" / name;
}

std::vector<LayerType> pattern(const std::string& s) {  // 'L' linear, 'A' attention
  std::vector<LayerType> v;
  for (char ch : s) v.push_back(ch == 'L' ? LayerType::kLinearAttention : LayerType::kFullAttention);
  return v;
}

TEST(ModelConfig, Qwen3_5MoeVisionLanguageCheckpointReadsItsTextConfig) {
  const ModelConfig c = ModelConfig::load(fixture("qwen3_5-moe"));
  EXPECT_EQ(c.architecture, "Qwen3_5MoeForConditionalGeneration");
  EXPECT_EQ(c.model_type, "qwen3_5_moe");
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 48);
  EXPECT_EQ(c.layer_types, pattern("LLLALLLA"));
  EXPECT_EQ(c.num_kv_cache_layers(), 2);
  EXPECT_EQ(c.num_recurrent_layers(), 6);
  EXPECT_EQ(c.kv_cache_layer(3), 0);
  EXPECT_EQ(c.kv_cache_layer(7), 1);
  EXPECT_EQ(c.kv_cache_layer(4), -1);
  EXPECT_EQ(c.recurrent_layer(4), 3);
  EXPECT_EQ(c.recurrent_layer(7), -1);
  EXPECT_EQ(c.linear_num_key_heads, 2);
  EXPECT_EQ(c.linear_num_value_heads, 4);
  EXPECT_EQ(c.linear_conv_dim(), 2 * 2 * 16 + 4 * 16);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.rotary_dim(), 8);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_TRUE(c.zero_centered_norms);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.shared_expert_intermediate_size, 32);
  EXPECT_EQ(c.mtp_num_hidden_layers, 1);
  for (int l = 0; l < 8; ++l) EXPECT_TRUE(c.layer_is_moe(l));
}

TEST(ModelConfig, Qwen3NextDerivesItsLayersFromTheInterval) {
  // Released-4.57 spelling: top-level rope_theta and partial_rotary_factor, no layer_types.
  const ModelConfig c = ModelConfig::load(fixture("qwen3-next"));
  EXPECT_EQ(c.layer_types, pattern("LLALLA"));
  EXPECT_EQ(c.rotary_dim(), 8);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.linear_value_head_dim, 32);
  EXPECT_EQ(c.mlp_only_layers, std::vector<int64_t>{1});
  EXPECT_FALSE(c.layer_is_moe(1));
  EXPECT_TRUE(c.layer_is_moe(2));
  EXPECT_EQ(c.intermediate_size, 80);
  EXPECT_EQ(c.mtp_num_hidden_layers, 0);

  json j = json::parse(std::ifstream(fixture("qwen3-next") / "config.json"));
  j.erase("full_attention_interval");  // transformers' default interval is 4
  j.erase("partial_rotary_factor");    // and the hybrids' partial rotary 0.25
  j.erase("norm_topk_prob");           // Qwen3-Next renormalises by default
  const ModelConfig d = ModelConfig::from_json(j, "x");
  EXPECT_EQ(d.layer_types, pattern("LLLALL"));
  EXPECT_EQ(d.rotary_dim(), 8);
  EXPECT_TRUE(d.norm_topk_prob);
  // A rope_parameters value wins over the top-level one.
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e6}, {"partial_rotary_factor", 0.5}};
  j["partial_rotary_factor"] = 0.25;
  const ModelConfig e = ModelConfig::from_json(j, "x");
  EXPECT_EQ(e.rotary_dim(), 16);
  EXPECT_DOUBLE_EQ(e.rope_theta, 5e6);
}

TEST(ModelConfig, DenseAndTextOnlyQwen3_5) {
  const ModelConfig dense = ModelConfig::load(fixture("qwen3_5-dense"));
  EXPECT_EQ(dense.architecture, "Qwen3_5ForConditionalGeneration");
  EXPECT_FALSE(dense.is_moe());
  EXPECT_EQ(dense.intermediate_size, 96);
  EXPECT_EQ(dense.layer_types, pattern("LLLA"));
  const ModelConfig text = ModelConfig::load(fixture("qwen3_5-moe-text"));
  EXPECT_EQ(text.model_type, "qwen3_5_moe_text");
  EXPECT_EQ(text.layer_types, pattern("LLLALLLA"));
  EXPECT_EQ(text.mtp_num_hidden_layers, 0);
  // Qwen3 models: every layer attention, KV layer = layer, nothing recurrent.
  const ModelConfig q = ModelConfig::from_json(moe_config(), "x");
  EXPECT_FALSE(q.has_linear_attention());
  EXPECT_EQ(q.num_kv_cache_layers(), 4);
  EXPECT_EQ(q.kv_cache_layer(3), 3);
  EXPECT_EQ(q.rotary_dim(), q.head_dim);
  EXPECT_FALSE(q.zero_centered_norms);
  // A config built by hand (no layer_types) is attention-only too.
  ModelConfig by_hand;
  by_hand.num_hidden_layers = 3;
  EXPECT_EQ(by_hand.num_kv_cache_layers(), 3);
  EXPECT_EQ(by_hand.kv_cache_layer(2), 2);
  EXPECT_FALSE(by_hand.layer_is_linear_attention(2));
}

TEST(ModelConfig, RejectsHybridConfigsRelayCannotRun) {
  const json next = json::parse(std::ifstream(fixture("qwen3-next") / "config.json"));
  auto with = [&](const char* key, json v) {
    json j = next;
    j[key] = std::move(v);
    return j;
  };
  auto without = [&](const char* key) {
    json j = next;
    j.erase(key);
    return j;
  };
  expect_error(without("linear_num_key_heads"), {"linear_num_key_heads", "missing"});
  expect_error(without("linear_conv_kernel_dim"), {"linear_conv_kernel_dim", "missing"});
  expect_error(without("shared_expert_intermediate_size"),
               {"shared_expert_intermediate_size", "missing"});
  expect_error(with("linear_num_value_heads", 3), {"linear_num_value_heads", "multiple"});
  expect_error(with("layer_types", {"linear_attention", "full_attention"}), {"layer_types", "2"});
  expect_error(with("layer_types", json(6, "sliding_attention")),
               {"layer_types", "sliding_attention"});
  expect_error(with("full_attention_interval", 0), {"full_attention_interval"});
  expect_error(with("partial_rotary_factor", 1.5), {"partial_rotary_factor"});
  expect_error(with("partial_rotary_factor", 0.01), {"partial_rotary_factor", "even"});
  expect_error(with("attn_output_gate", false), {"attn_output_gate"});
  expect_error(with("model_type", "qwen3_moe"), {"model_type"});
  // Qwen3 keeps refusing linear attention and partial rotary.
  json q = moe_config();
  q["layer_types"] = {"linear_attention", "full_attention", "full_attention", "full_attention"};
  expect_error(q, {"layer_types", "linear_attention"});
  q = moe_config();
  q["partial_rotary_factor"] = 0.5;
  expect_error(q, {"partial_rotary_factor"});
  // A vision-language checkpoint needs its text_config, of the matching model_type.
  json vlm = json::parse(std::ifstream(fixture("qwen3_5-moe") / "config.json"));
  json no_text = vlm;
  no_text.erase("text_config");
  expect_error(no_text, {"text_config", "missing"});
  json wrong_text = vlm;
  wrong_text["text_config"]["model_type"] = "qwen3_5_text";
  expect_error(wrong_text, {"text_config", "model_type", "qwen3_5_moe_text"});
  json bad_field = vlm;
  bad_field["text_config"].erase("num_experts");
  expect_error(bad_field, {"text_config", "num_experts"});
}

TEST(ModelConfig, LoadNamesTheFile) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "relay_test_config";
  std::filesystem::create_directories(dir);
  auto write = [&](const char* name, const std::string& text) {
    std::ofstream(dir / name) << text;
  };
  std::filesystem::remove(dir / "config.json");
  EXPECT_THROW(ModelConfig::load(dir), Error);

  write("config.json", "{ not json");
  try {
    ModelConfig::load(dir);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
  }

  write("config.json", moe_config().dump());
  write("generation_config.json", R"({"eos_token_id": [7, 9], "bos_token_id": 5})");
  EXPECT_EQ(ModelConfig::load(dir).eos_token_ids, (std::vector<int32_t>{7, 9}));

  write("generation_config.json", R"({"eos_token_id": 5000})");
  try {
    ModelConfig::load(dir);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("generation_config.json"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace relay

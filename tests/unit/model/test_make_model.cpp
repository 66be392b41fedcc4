// make_model: the tiny presets load back through ModelConfig and Checkpoint with the HF names and
// shapes; values are a pure function of (seed, tensor name) whatever the sharding, dtype or thread
// count; the big presets have the published parameter counts of the real models.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/make_model.h"

namespace relay {
namespace {

namespace fs = std::filesystem;

class MakeModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            str("relay_test_mm_", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  MakeModelOptions options(const std::string& preset, const std::string& subdir) const {
    MakeModelOptions o;
    o.preset = preset;
    o.out_dir = root_ / subdir;
    o.tokenizer_dir = fs::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
    o.seed = 7;
    return o;
  }

  fs::path root_;
};

std::vector<uint8_t> bytes_of(const TensorView& t) { return {t.data, t.data + t.nbytes}; }

nlohmann::json json_of(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// Loads the checkpoint and checks it holds exactly the tensors the config calls for.
void expect_complete(const fs::path& dir, const ModelConfig& c, DType dtype) {
  const Checkpoint ck(dir);
  const std::vector<TensorSpec> specs =
      checkpoint_tensor_specs(c, dtype, ExpertStorage::kAsReleased);
  EXPECT_EQ(ck.names().size(), specs.size());
  for (const TensorSpec& s : specs) {
    const TensorView& t = ck.get(s.name, s.shape);
    EXPECT_EQ(t.dtype, s.dtype) << s.name;
    // Only the releases' F32 tensors differ from the checkpoint's dtype.
    if (s.dtype != dtype) EXPECT_EQ(s.dtype, DType::F32) << s.name;
  }
}

TEST_F(MakeModelTest, TinyMoeLoadsBackWithHfNamesAndShapes) {
  const MakeModelResult r = make_model(options("tiny-moe", "m"));
  const fs::path dir = root_ / "m";
  for (const char* f : {"config.json", "generation_config.json", "tokenizer.json",
                        "tokenizer_config.json", "model.safetensors"}) {
    EXPECT_TRUE(fs::exists(dir / f)) << f;
  }
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_EQ(r.num_shards, 1);
  const ModelConfig c = ModelConfig::load(dir);
  EXPECT_EQ(c.architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{151645, 151643}));
  expect_complete(dir, c, DType::BF16);

  const Checkpoint ck(dir);
  EXPECT_EQ(r.num_tensors, static_cast<int64_t>(ck.names().size()));
  // The HF layout, spelled out for one layer.
  ck.get("model.embed_tokens.weight", {151936, 64});
  ck.get("lm_head.weight", {151936, 64});
  ck.get("model.norm.weight", {64});
  ck.get("model.layers.1.input_layernorm.weight", {64});
  ck.get("model.layers.1.post_attention_layernorm.weight", {64});
  ck.get("model.layers.1.self_attn.q_proj.weight", {64, 64});
  ck.get("model.layers.1.self_attn.k_proj.weight", {32, 64});
  ck.get("model.layers.1.self_attn.v_proj.weight", {32, 64});
  ck.get("model.layers.1.self_attn.o_proj.weight", {64, 64});
  ck.get("model.layers.1.self_attn.q_norm.weight", {16});
  ck.get("model.layers.1.self_attn.k_norm.weight", {16});
  ck.get("model.layers.1.mlp.gate.weight", {8, 64});
  ck.get("model.layers.1.mlp.experts.7.gate_proj.weight", {32, 64});
  ck.get("model.layers.1.mlp.experts.7.up_proj.weight", {32, 64});
  ck.get("model.layers.1.mlp.experts.7.down_proj.weight", {64, 32});
  EXPECT_FALSE(ck.has("model.layers.0.self_attn.q_proj.bias"));
  EXPECT_FALSE(ck.has("model.layers.0.mlp.gate_proj.weight"));

  // Norm weights are 1; other weights look like normal(0, 0.02).
  for (float v : tensor_to_f32(ck.get("model.layers.0.self_attn.q_norm.weight")))
    EXPECT_EQ(v, 1.0f);
  const std::vector<float> w = tensor_to_f32(ck.get("model.embed_tokens.weight"));
  double sum = 0, sum_sq = 0;
  for (float v : w) {
    sum += v;
    sum_sq += static_cast<double>(v) * v;
  }
  const double mean = sum / w.size(), stddev = std::sqrt(sum_sq / w.size() - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-4);
  EXPECT_NEAR(stddev, 0.02, 2e-4);
}

TEST_F(MakeModelTest, TinyDenseIsTiedAndShardsWithAnIndex) {
  MakeModelOptions o = options("tiny-dense", "d");
  o.shard_size_mb = 5;  // the 19 MB embedding gets a shard of its own, the layers another
  const MakeModelResult r = make_model(o);
  const fs::path dir = root_ / "d";
  EXPECT_EQ(r.num_shards, 2);
  EXPECT_TRUE(fs::exists(dir / "model-00001-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "model-00002-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  const ModelConfig c = ModelConfig::load(dir);
  EXPECT_EQ(c.architecture, "Qwen3ForCausalLM");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_dim, 16);
  expect_complete(dir, c, DType::BF16);
  const Checkpoint ck(dir);
  EXPECT_FALSE(ck.has("lm_head.weight"));
  ck.get("model.layers.1.mlp.gate_proj.weight", {128, 64});
  ck.get("model.layers.1.mlp.down_proj.weight", {64, 128});
  EXPECT_EQ(r.total_bytes, 19596032u);

  // Re-running with one shard replaces the old shards and index rather than mixing with them.
  o.shard_size_mb = 5000;
  make_model(o);
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model-00001-of-00002.safetensors"));
  expect_complete(dir, c, DType::BF16);
}

TEST_F(MakeModelTest, ValuesDependOnlyOnSeedAndName) {
  MakeModelOptions a = options("tiny-moe", "a");
  a.num_threads = 1;
  make_model(a);
  MakeModelOptions b = options("tiny-moe", "b");
  b.num_threads = 3;
  b.shard_size_mb = 1;  // many shards
  make_model(b);
  MakeModelOptions f = options("tiny-moe", "f");
  f.dtype = DType::F32;
  make_model(f);
  MakeModelOptions s = options("tiny-moe", "s");
  s.seed = 8;
  make_model(s);

  const Checkpoint ca(root_ / "a"), cb(root_ / "b"), cf(root_ / "f"), cs(root_ / "s");
  ASSERT_EQ(ca.names(), cb.names());
  for (const std::string& name : ca.names()) {
    EXPECT_EQ(bytes_of(ca.get(name)), bytes_of(cb.get(name))) << name;
    // bf16 weights are the f32 weights rounded.
    const std::vector<float> f32 = tensor_to_f32(cf.get(name));
    const TensorView& bf = ca.get(name);
    for (size_t i = 0; i < f32.size(); i += 97) {
      uint16_t v;
      std::memcpy(&v, bf.data + 2 * i, 2);
      ASSERT_EQ(v, f32_to_bf16(f32[i])) << name << "[" << i << "]";
    }
  }
  // The sampler is a true normal, tails included (9.7M samples: the fractions are tight).
  const std::vector<float> head = tensor_to_f32(cf.get("lm_head.weight"));
  size_t within_1 = 0, beyond_2 = 0, beyond_3 = 0;
  for (float v : head) {
    const float z = std::fabs(v) / 0.02f;
    within_1 += z < 1.0f;
    beyond_2 += z > 2.0f;
    beyond_3 += z > 3.0f;
  }
  EXPECT_NEAR(static_cast<double>(within_1) / head.size(), 0.682689, 1e-3);
  EXPECT_NEAR(static_cast<double>(beyond_2) / head.size(), 0.045500, 5e-4);
  EXPECT_NEAR(static_cast<double>(beyond_3) / head.size(), 0.002700, 1e-4);
  EXPECT_NE(bytes_of(ca.get("lm_head.weight")), bytes_of(cs.get("lm_head.weight")));
  EXPECT_EQ(bytes_of(ca.get("model.norm.weight")), bytes_of(cs.get("model.norm.weight")));
  // Different tensors draw different values.
  EXPECT_NE(bytes_of(ca.get("model.layers.0.mlp.experts.0.up_proj.weight")),
            bytes_of(ca.get("model.layers.0.mlp.experts.0.gate_proj.weight")));
}

TEST_F(MakeModelTest, LayerOverride) {
  MakeModelOptions o = options("tiny-moe", "l");
  o.num_layers = 3;
  make_model(o);
  const ModelConfig c = ModelConfig::load(root_ / "l");
  EXPECT_EQ(c.num_hidden_layers, 3);
  expect_complete(root_ / "l", c, DType::BF16);
}

TEST_F(MakeModelTest, ConfigPatchMakesVariants) {
  MakeModelOptions o = options("tiny-moe", "v");
  o.config_patch = R"({"norm_topk_prob": false, "mlp_only_layers": [1], "attention_bias": true,
                       "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 10240}})";
  make_model(o);
  const ModelConfig c = ModelConfig::load(root_ / "v");
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_TRUE(c.layer_is_moe(0));
  EXPECT_FALSE(c.layer_is_moe(1));
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::Yarn);
  expect_complete(root_ / "v", c, DType::BF16);
  const Checkpoint ck(root_ / "v");
  ck.get("model.layers.1.mlp.gate_proj.weight", {128, 64});
  for (float v : tensor_to_f32(ck.get("model.layers.0.self_attn.q_proj.bias"))) EXPECT_EQ(v, 0.0f);

  o.config_patch = R"({"num_experts_per_tok": 9})";
  try {
    make_model(o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_experts_per_tok"), std::string::npos) << e.what();
  }
  o.config_patch = "[1]";
  EXPECT_THROW(make_model(o), Error);
}

TEST_F(MakeModelTest, BigPresetsHaveThePublishedParameterCounts) {
  auto count = [](const std::string& preset) {
    const ModelConfig c = ModelConfig::from_json(model_preset_config(preset), preset);
    uint64_t n = 0;
    for (const TensorSpec& s : checkpoint_tensor_specs(c, DType::BF16, ExpertStorage::kAsReleased))
      n += tensor_bytes(s) / 2;
    return std::make_pair(c, n);
  };
  const auto [c30, n30] = count("30b-a3b");
  EXPECT_EQ(n30, 30532122624u);  // Qwen3-30B-A3B
  EXPECT_EQ(c30.num_hidden_layers, 48);
  EXPECT_EQ(c30.num_experts, 128);
  EXPECT_EQ(c30.max_position_embeddings, 40960);
  EXPECT_TRUE(c30.norm_topk_prob);
  const auto [c235, n235] = count("235b-a22b");
  EXPECT_EQ(n235, 235093634560u);  // Qwen3-235B-A22B
  EXPECT_EQ(c235.num_hidden_layers, 94);
  EXPECT_EQ(c235.num_attention_heads, 64);
}

// The full-attention layers of `c`, by index.
std::vector<int64_t> attention_layers(const ModelConfig& c) {
  std::vector<int64_t> layers;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    if (!c.layer_is_linear_attention(l)) layers.push_back(l);
  return layers;
}

TEST_F(MakeModelTest, HybridPresetsHaveTheReleasedConfigs) {
  struct Expected {
    const char* preset;
    const char* architecture;
    int64_t hidden, layers, heads, linear_value_heads, experts, top_k, moe_width, vocab;
    // The language model and MTP head, as checkpoint_tensor_specs lists them (no vision tower):
    // 35.5 B, 124.6 B, 402.9 B, and 79.7 B for Qwen3-Next, whose config names no MTP layer.
    uint64_t parameters;
  };
  const Expected presets[] = {
      {"qwen3.5-35b-a3b", "Qwen3_5MoeForConditionalGeneration", 2048, 40, 16, 32, 256, 8, 512,
       248320, 35505251456u},
      {"qwen3.5-122b-a10b", "Qwen3_5MoeForConditionalGeneration", 3072, 48, 32, 64, 256, 8, 1024,
       248320, 124635206144u},
      {"qwen3.5-397b-a17b", "Qwen3_5MoeForConditionalGeneration", 4096, 60, 32, 64, 512, 10, 1024,
       248320, 402941918464u},
      {"qwen3-next-80b-a3b", "Qwen3NextForCausalLM", 2048, 48, 16, 32, 512, 10, 512, 151936,
       79674391296u},
  };
  for (const Expected& e : presets) {
    SCOPED_TRACE(e.preset);
    const nlohmann::json j = model_preset_config(e.preset);
    const ModelConfig c = ModelConfig::from_json(j, e.preset);
    EXPECT_EQ(c.architecture, e.architecture);
    EXPECT_EQ(c.hidden_size, e.hidden);
    EXPECT_EQ(c.num_hidden_layers, e.layers);
    EXPECT_EQ(c.num_attention_heads, e.heads);
    EXPECT_EQ(c.num_key_value_heads, 2);
    EXPECT_EQ(c.head_dim, 256);
    EXPECT_EQ(c.rotary_dim(), 64);  // partial_rotary_factor 0.25
    EXPECT_EQ(c.rope_theta, 1e7);
    EXPECT_EQ(c.linear_num_key_heads, 16);
    EXPECT_EQ(c.linear_num_value_heads, e.linear_value_heads);
    EXPECT_EQ(c.linear_key_head_dim, 128);
    EXPECT_EQ(c.linear_value_head_dim, 128);
    EXPECT_EQ(c.linear_conv_kernel_dim, 4);
    EXPECT_EQ(c.num_experts, e.experts);
    EXPECT_EQ(c.num_experts_per_tok, e.top_k);
    EXPECT_EQ(c.moe_intermediate_size, e.moe_width);
    EXPECT_EQ(c.shared_expert_intermediate_size, e.moe_width);
    EXPECT_TRUE(c.norm_topk_prob);
    EXPECT_TRUE(c.attn_output_gate);
    EXPECT_TRUE(c.zero_centered_norms);
    EXPECT_FALSE(c.tie_word_embeddings);
    EXPECT_EQ(c.vocab_size, e.vocab);
    EXPECT_EQ(c.max_position_embeddings, 262144);
    // Every fourth layer is full attention: 3 linear : 1 full.
    EXPECT_EQ(c.num_kv_cache_layers() * 4, e.layers);
    for (int64_t l : attention_layers(c)) EXPECT_EQ((l + 1) % 4, 0) << l;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) EXPECT_TRUE(c.layer_is_moe(l)) << l;
    const bool qwen3_5 = c.architecture != "Qwen3NextForCausalLM";
    // The release's layout: Qwen3.5 nests the language model under text_config beside a
    // vision_config and spells out layer_types; Qwen3-Next is flat, with the interval only.
    EXPECT_EQ(j.contains("text_config"), qwen3_5);
    EXPECT_EQ(j.contains("vision_config"), qwen3_5);
    if (qwen3_5) {
      EXPECT_EQ(j["model_type"], "qwen3_5_moe");
      EXPECT_EQ(j["text_config"]["model_type"], "qwen3_5_moe_text");
      EXPECT_EQ(j["text_config"]["layer_types"].size(), static_cast<size_t>(e.layers));
      EXPECT_EQ(j["text_config"]["rope_parameters"]["mrope_section"],
                nlohmann::json({11, 11, 10}));
      EXPECT_EQ(j["vision_config"]["out_hidden_size"], e.hidden);
      EXPECT_EQ(c.mtp_num_hidden_layers, 1);
      EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{248044}));
    } else {
      EXPECT_EQ(j["model_type"], "qwen3_next");
      EXPECT_FALSE(j.contains("layer_types"));
      EXPECT_EQ(j["full_attention_interval"], 4);
      EXPECT_EQ(j["intermediate_size"], 5120);
      EXPECT_EQ(c.mtp_num_hidden_layers, 0);
      EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{151645}));
    }
    uint64_t n = 0;
    for (const TensorSpec& s : checkpoint_tensor_specs(c, DType::BF16, ExpertStorage::kAsReleased))
      n += tensor_bytes(s) / dtype_size(s.dtype);
    EXPECT_EQ(n, e.parameters);
  }
}

TEST_F(MakeModelTest, LayersKeepTheHybridPattern) {
  for (const char* preset : {"qwen3.5-397b-a17b", "qwen3-next-80b-a3b", "tiny-qwen3.5-moe"}) {
    SCOPED_TRACE(preset);
    const nlohmann::json j = preset_config_with_layers(preset, 8, "");
    const ModelConfig c = ModelConfig::from_json(j, preset);
    EXPECT_EQ(c.num_hidden_layers, 8);
    EXPECT_EQ(attention_layers(c), (std::vector<int64_t>{3, 7}));
    if (j.contains("text_config")) {
      EXPECT_EQ(j["text_config"]["num_hidden_layers"], 8);
      EXPECT_FALSE(j.contains("num_hidden_layers"));
      EXPECT_EQ(j["text_config"]["layer_types"],
                nlohmann::json({"linear_attention", "linear_attention", "linear_attention",
                                "full_attention", "linear_attention", "linear_attention",
                                "linear_attention", "full_attention"}));
    }
    try {
      preset_config_with_layers(preset, 6, "");
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("give a multiple of 4"), std::string::npos) << e.what();
    }
  }
  // A patched interval sets the pattern --layers keeps.
  const ModelConfig c = ModelConfig::from_json(
      preset_config_with_layers("qwen3.5-35b-a3b", 6,
                                R"({"text_config": {"full_attention_interval": 3}})"),
      "patched");
  EXPECT_EQ(attention_layers(c), (std::vector<int64_t>{2, 5}));
  // Qwen3 presets take any count.
  const ModelConfig qwen3 =
      ModelConfig::from_json(preset_config_with_layers("30b-a3b", 3, ""), "x");
  EXPECT_EQ(qwen3.num_hidden_layers, 3);
}

TEST_F(MakeModelTest, TinyHybridCheckpointsHaveTheReleasedLayouts) {
  // Writes `preset`, checks its architecture and that it holds exactly its tensors.
  auto made = [&](const std::string& preset, const std::string& architecture) {
    make_model(options(preset, preset));
    const ModelConfig c = ModelConfig::load(root_ / preset);
    EXPECT_EQ(c.architecture, architecture);
    expect_complete(root_ / preset, c, DType::BF16);
    return root_ / preset;
  };
  const Checkpoint ck35(made("tiny-qwen3.5-moe", "Qwen3_5MoeForConditionalGeneration"));
  const std::string p = "model.language_model.layers.";
  ck35.get("model.language_model.embed_tokens.weight", {151936, 64});
  ck35.get("model.language_model.norm.weight", {64});
  ck35.get("lm_head.weight", {151936, 64});
  // Gated DeltaNet (layer 0): split projections; 2 key heads x 16, 4 value heads x 16.
  ck35.get(p + "0.linear_attn.in_proj_qkv.weight", {2 * 32 + 64, 64});
  ck35.get(p + "0.linear_attn.in_proj_z.weight", {64, 64});
  ck35.get(p + "0.linear_attn.in_proj_b.weight", {4, 64});
  ck35.get(p + "0.linear_attn.in_proj_a.weight", {4, 64});
  ck35.get(p + "0.linear_attn.conv1d.weight", {128, 1, 4});
  ck35.get(p + "0.linear_attn.out_proj.weight", {64, 64});
  EXPECT_EQ(ck35.get(p + "0.linear_attn.A_log", {4}).dtype, DType::F32);
  EXPECT_EQ(ck35.get(p + "0.linear_attn.norm.weight", {16}).dtype, DType::F32);
  EXPECT_EQ(ck35.get(p + "0.linear_attn.dt_bias", {4}).dtype, DType::BF16);
  EXPECT_FALSE(ck35.has(p + "0.self_attn.q_proj.weight"));
  // Gated attention (layer 3): q_proj doubled, [query | gate] per head.
  ck35.get(p + "3.self_attn.q_proj.weight", {2 * 4 * 32, 64});
  ck35.get(p + "3.self_attn.o_proj.weight", {64, 4 * 32});
  EXPECT_FALSE(ck35.has(p + "3.linear_attn.A_log"));
  // The decoder layers' experts fused, the MTP layer's per expert.
  ck35.get(p + "2.mlp.experts.gate_up_proj", {8, 64, 64});
  ck35.get(p + "2.mlp.experts.down_proj", {8, 64, 32});
  ck35.get(p + "2.mlp.shared_expert_gate.weight", {1, 64});
  EXPECT_FALSE(ck35.has(p + "2.mlp.experts.0.gate_proj.weight"));
  ck35.get("mtp.fc.weight", {64, 128});
  ck35.get("mtp.layers.0.self_attn.q_proj.weight", {256, 64});
  ck35.get("mtp.layers.0.mlp.experts.7.down_proj.weight", {64, 32});
  ck35.get("mtp.norm.weight", {64});
  // Zero-centred norms store w = 0, the gated norm 1.
  for (float v : tensor_to_f32(ck35.get(p + "1.input_layernorm.weight"))) EXPECT_EQ(v, 0.0f);
  for (float v : tensor_to_f32(ck35.get("mtp.pre_fc_norm_hidden.weight"))) EXPECT_EQ(v, 0.0f);
  for (float v : tensor_to_f32(ck35.get(p + "1.linear_attn.norm.weight"))) EXPECT_EQ(v, 1.0f);

  const fs::path next = made("tiny-qwen3-next", "Qwen3NextForCausalLM");
  const Checkpoint ckn(next);
  // Fused, per-key-head interleaved projections; per-expert tensors; no MTP head in the config.
  ckn.get("model.layers.0.linear_attn.in_proj_qkvz.weight", {2 * 32 + 2 * 64, 64});
  ckn.get("model.layers.0.linear_attn.in_proj_ba.weight", {8, 64});
  EXPECT_EQ(ckn.get("model.layers.0.linear_attn.A_log", {4}).dtype, DType::F32);
  EXPECT_EQ(ckn.get("model.layers.0.linear_attn.norm.weight", {16}).dtype, DType::BF16);
  ckn.get("model.layers.3.mlp.experts.7.up_proj.weight", {32, 64});
  EXPECT_FALSE(ckn.has("mtp.fc.weight"));
  EXPECT_EQ(json_of(next / "generation_config.json")["eos_token_id"],
            nlohmann::json({151645, 151643}));
}

TEST_F(MakeModelTest, AttentionBiasAndDenseLayersInSpecs) {
  nlohmann::json j = model_preset_config("tiny-moe");
  j["attention_bias"] = true;
  j["mlp_only_layers"] = {0};
  const ModelConfig c = ModelConfig::from_json(j, "x");
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const TensorSpec& s : checkpoint_tensor_specs(c, DType::BF16, ExpertStorage::kAsReleased))
    shapes[s.name] = s.shape;
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_proj.bias"), (std::vector<int64_t>{64}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.k_proj.bias"), (std::vector<int64_t>{32}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.o_proj.bias"), (std::vector<int64_t>{64}));
  EXPECT_EQ(shapes.at("model.layers.0.mlp.up_proj.weight"), (std::vector<int64_t>{128, 64}));
  EXPECT_FALSE(shapes.contains("model.layers.0.mlp.gate.weight"));
  EXPECT_TRUE(shapes.contains("model.layers.1.mlp.gate.weight"));
}

TEST_F(MakeModelTest, RejectsBadOptions) {
  EXPECT_THROW(make_model(options("tiny-llama", "x")), Error);
  MakeModelOptions o = options("tiny-moe", "x");
  o.dtype = DType::F16;
  EXPECT_THROW(make_model(o), Error);
  o = options("tiny-moe", "x");
  o.tokenizer_dir = root_ / "nowhere";
  try {
    make_model(o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer.json"), std::string::npos) << e.what();
  }
  try {
    model_preset_config("huge");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tiny-moe"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace relay

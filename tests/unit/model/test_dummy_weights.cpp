// The dummy load format (model/dummy_weights.h): every tensor of a real checkpoint, with its shape,
// make_model's initialisation rules and a pure function of (seed, name), from config.json alone.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "model/dummy_weights.h"
#include "model/make_model.h"
#include "model/registry.h"

namespace relay {
namespace {

std::filesystem::path fixture(const std::string& name) {
  return std::filesystem::path(RELAY_FIXTURES_DIR) / "models" / name;
}

float value(const TensorView& t, int64_t i) {
  uint16_t b = 0;
  std::memcpy(&b, t.data + i * 2, 2);
  return bf16_to_f32(b);
}

TEST(DummyWeights, HoldEveryTensorOfTheCheckpointWithItsShapeAndInit) {
  for (const char* model : {"qwen3-attention-bias", "qwen3-moe"}) {
    const ModelConfig c = ModelConfig::load(fixture(model));
    const Checkpoint real(fixture(model));
    const Checkpoint dummy = open_checkpoint(fixture(model), LoadFormat::kDummy);
    const std::vector<TensorSpec> specs =
        checkpoint_tensor_specs(c, DType::BF16, ExpertStorage::kPerExpert);
    EXPECT_EQ(dummy.names().size(), specs.size()) << model;
    for (const std::string& name : real.names()) {
      ASSERT_TRUE(dummy.has(name)) << model << " " << name;
      const TensorView& t = dummy.get(name, real.get(name).shape);
      EXPECT_EQ(t.dtype, DType::BF16);
      EXPECT_EQ(static_cast<int64_t>(t.nbytes), t.numel() * 2);
      const WeightInit init = weight_init_for(c, name);
      double sum = 0, sq = 0;
      for (int64_t i = 0; i < t.numel(); ++i) {
        const float v = value(t, i);
        if (init == WeightInit::kOnes) {
          ASSERT_EQ(v, 1.0f) << name;
        } else if (init == WeightInit::kZeros) {
          ASSERT_EQ(v, 0.0f) << name;
        }
        sum += v, sq += double(v) * v;
      }
      if (init == WeightInit::kNormal && t.numel() >= 1024) {
        const double mean = sum / t.numel(), stddev = std::sqrt(sq / t.numel() - mean * mean);
        EXPECT_NEAR(mean, 0.0, 0.005) << name;
        EXPECT_NEAR(stddev, 0.02, 0.004) << name;
      }
    }
  }
}

TEST(DummyWeights, TensorsDifferAndArePureFunctionsOfTheSeed) {
  const ModelConfig c = ModelConfig::load(fixture("qwen3-moe"));
  const Checkpoint a = make_dummy_checkpoint(c, "a", 7), b = make_dummy_checkpoint(c, "b", 7);
  const Checkpoint other = make_dummy_checkpoint(c, "c", 8);
  const TensorView& gate0 = a.get("model.layers.0.mlp.experts.0.gate_proj.weight");
  const TensorView& gate1 = a.get("model.layers.0.mlp.experts.1.gate_proj.weight");
  EXPECT_NE(std::memcmp(gate0.data, gate1.data, gate0.nbytes), 0);
  for (const std::string& name : a.names()) {
    const TensorView &x = a.get(name), &y = b.get(name);
    ASSERT_EQ(std::memcmp(x.data, y.data, x.nbytes), 0) << name;
  }
  EXPECT_NE(std::memcmp(gate0.data, other.get(gate0.name).data, gate0.nbytes), 0);
  EXPECT_NE(a.get(gate0.name).file.find("--load-format dummy"), std::string::npos);
}

// Every hybrid preset, cut to 4 layers by --layers' rule and to test widths by a config patch
// (the same layout: architecture, layer pattern, projections, experts, MTP head), loads from dummy
// weights through the model registry, its MTP head included.
TEST(DummyWeights, HybridPresetsLoadThroughTheRegistry) {
  const std::string widths = R"("hidden_size": 64, "num_attention_heads": 4, "head_dim": 32,
      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
      "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "vocab_size": 1024,
      "eos_token_id": 1)";
  for (const char* preset :
       {"qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b"}) {
    SCOPED_TRACE(preset);
    const bool nested = model_preset_config(preset).contains("text_config");
    const std::string patch = nested ? str(R"({"text_config": {)", widths, "}}")
                                     : str("{", widths, R"(, "bos_token_id": 0})");
    const ModelConfig c =
        ModelConfig::from_json(preset_config_with_layers(preset, 4, patch), preset);
    ASSERT_EQ(c.num_kv_cache_layers(), 1);
    const Checkpoint dummy = make_dummy_checkpoint(c, preset, 3);
    const std::vector<TensorSpec> specs =
        checkpoint_tensor_specs(c, DType::BF16, ExpertStorage::kPerExpert);
    ASSERT_EQ(dummy.names().size(), specs.size());
    for (const TensorSpec& s : specs) {
      const TensorView& t = dummy.get(s.name, s.shape);
      EXPECT_EQ(t.dtype, s.dtype) << s.name;
      if (s.dtype == DType::F32 && weight_init_for(c, s.name) == WeightInit::kOnes) {
        for (float v : tensor_to_f32(t)) ASSERT_EQ(v, 1.0f) << s.name;
      }
    }
    EXPECT_EQ(dummy.get(str(nested ? "model.language_model." : "model.",
                            "layers.0.linear_attn.A_log")).dtype,
              DType::F32);
    // Zero-centred norms hold w = 0, so they scale by 1.
    for (float v : tensor_to_f32(dummy.get(str(nested ? "model.language_model." : "model.",
                                               "layers.3.input_layernorm.weight"))))
      ASSERT_EQ(v, 0.0f);
    const std::unique_ptr<Model> model =
        build_model(c, dummy, unsharded(c), MtpSource{.enabled = c.mtp_num_hidden_layers > 0});
    EXPECT_EQ(model->config().num_hidden_layers, 4);
  }
}

TEST(DummyWeights, ParsesTheFormatName) {
  EXPECT_EQ(parse_load_format("auto"), LoadFormat::kAuto);
  EXPECT_EQ(parse_load_format("dummy"), LoadFormat::kDummy);
  EXPECT_THROW(parse_load_format("safetensors"), Error);
}

}  // namespace
}  // namespace relay

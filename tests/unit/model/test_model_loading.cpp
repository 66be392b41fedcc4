// Model construction: RoPE parameters bit-exact with transformers, the architecture registry, and
// load-time shape checks whose errors name the tensor, the file and both shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/registry.h"
#include "model/rope.h"

namespace relay {
namespace {

std::filesystem::path fixture(const std::string& name) {
  return std::filesystem::path(RELAY_FIXTURES_DIR) / "models" / name;
}

TEST(Rope, YarnMatchesTransformersBitForBit) {
  // transformers 5.24 _compute_yarn_parameters for the qwen3-yarn fixture's config (printed as hex).
  const float expected[] = {0x1.0000000000000p+0f, 0x1.0112000000000p-1f, 0x1.fcdb0e0000000p-3f, 0x1.ee42920000000p-4f,
                            0x1.d41d400000000p-5f, 0x1.abc3d40000000p-6f, 0x1.7213ac0000000p-7f, 0x1.235a720000000p-8f,
                            0x1.47ae140000000p-9f, 0x1.7089380000000p-10f, 0x1.9e7c700000000p-11f,
                            0x1.d22a500000000p-12f, 0x1.0624de0000000p-12f, 0x1.26d42c0000000p-13f,
                            0x1.4b96c00000000p-14f, 0x1.74eea60000000p-15f};
  RopeTables t = compute_rope(ModelConfig::load(fixture("qwen3-yarn")));
  ASSERT_EQ(t.inv_freq.size(), 16u);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(t.inv_freq[i], expected[i]) << "pair " << i;
  EXPECT_FLOAT_EQ(t.attention_scaling, static_cast<float>(1.138629436111989));
}

TEST(Rope, DefaultAndLinear) {
  ModelConfig c = ModelConfig::load(fixture("qwen3-dense"));
  RopeTables t = compute_rope(c);
  EXPECT_EQ(t.attention_scaling, 1.0f);
  EXPECT_EQ(t.inv_freq[0], 1.0f);
  EXPECT_NEAR(t.inv_freq[8], std::pow(10000.0, -0.5), 1e-7);
  c.rope_scaling.type = RopeScaling::Type::Linear;
  c.rope_scaling.factor = 4.0;
  EXPECT_NEAR(compute_rope(c).inv_freq[8], std::pow(10000.0, -0.5) / 4, 1e-7);
  c.rope_scaling.type = RopeScaling::Type::Dynamic;
  EXPECT_THROW(compute_rope(c), Error);
}

TEST(Registry, UnknownArchitectureListsTheSupportedOnes) {
  ModelConfig c = ModelConfig::load(fixture("qwen3-dense"));
  c.architecture = "LlamaForCausalLM";
  Checkpoint ckpt(fixture("qwen3-dense"));
  try {
    build_model(c, ckpt);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("LlamaForCausalLM"), std::string::npos) << m;
    EXPECT_NE(m.find("Qwen3ForCausalLM"), std::string::npos) << m;
    EXPECT_NE(m.find("Qwen3MoeForCausalLM"), std::string::npos) << m;
  }
  EXPECT_EQ(supported_architectures().size(), 7u);
}

TEST(Registry, ShapeMismatchNamesTensorFileAndShapes) {
  // A config that disagrees with the checkpoint: the wrong MLP width.
  ModelConfig c = ModelConfig::load(fixture("qwen3-dense"));
  c.intermediate_size += 1;
  Checkpoint ckpt(fixture("qwen3-dense"));
  try {
    build_model(c, ckpt);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("model.layers.0.mlp.gate_proj.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("model.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find("96"), std::string::npos) << m;
    EXPECT_NE(m.find("97"), std::string::npos) << m;
  }
}

TEST(Registry, TiedEmbeddingsNeedNoLmHead) {
  // qwen3-moe-no-norm-topk is saved with tie_word_embeddings: its checkpoint has no lm_head.weight.
  Checkpoint ckpt(fixture("qwen3-moe-no-norm-topk"));
  EXPECT_FALSE(ckpt.has("lm_head.weight"));
  auto model = load_model(fixture("qwen3-moe-no-norm-topk"));
  EXPECT_EQ(model->vocab_size(), 512);
}

}  // namespace
}  // namespace relay

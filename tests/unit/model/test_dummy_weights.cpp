// The dummy load format (model/dummy_weights.h): every tensor of a real checkpoint, with its shape,
// make_model's initialisation rules and a pure function of (seed, name), from config.json alone.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "model/dummy_weights.h"
#include "model/make_model.h"

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
    const std::vector<TensorSpec> specs = checkpoint_tensor_specs(c, DType::BF16);
    EXPECT_EQ(dummy.names().size(), specs.size()) << model;
    for (const std::string& name : real.names()) {
      ASSERT_TRUE(dummy.has(name)) << model << " " << name;
      const TensorView& t = dummy.get(name, real.get(name).shape);
      EXPECT_EQ(t.dtype, DType::BF16);
      EXPECT_EQ(static_cast<int64_t>(t.nbytes), t.numel() * 2);
      const WeightInit init = weight_init_for(name);
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

TEST(DummyWeights, ParsesTheFormatName) {
  EXPECT_EQ(parse_load_format("auto"), LoadFormat::kAuto);
  EXPECT_EQ(parse_load_format("dummy"), LoadFormat::kDummy);
  EXPECT_THROW(parse_load_format("safetensors"), Error);
}

}  // namespace
}  // namespace relay

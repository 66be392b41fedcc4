// model/decoder_plan.h on the tiny fixtures in the released layouts: the kinds follow each config's
// rules, and every name the plan gives is a tensor of the checkpoint (so a backend building from
// the plan finds its weights without spelling a name itself).
#include <gtest/gtest.h>

#include <algorithm>

#include "../engine/fixtures.h"
#include "model/decoder_plan.h"
#include "model/safetensors.h"

namespace relay {
namespace {

struct Loaded {
  ModelConfig config;
  Checkpoint ckpt;
  DecoderPlan plan;
};

Loaded load(const std::string& name) {
  const auto dir = test::fixture_models_dir() / name;
  ModelConfig config = ModelConfig::load(dir);
  Checkpoint ckpt(dir);
  DecoderPlan plan = plan_decoder(config, ckpt);
  return {std::move(config), std::move(ckpt), std::move(plan)};
}

// Every tensor a layer of `plan` names exists (per-expert MoE layouts).
void expect_names_exist(const Loaded& m) {
  const Checkpoint& ckpt = m.ckpt;
  EXPECT_TRUE(ckpt.has(m.plan.embed_tokens()));
  EXPECT_TRUE(ckpt.has(m.plan.final_norm()));
  EXPECT_TRUE(ckpt.has(m.plan.lm_head()));
  for (const LayerPlan& lp : m.plan.layers) {
    EXPECT_TRUE(ckpt.has(lp.input_norm())) << lp.input_norm();
    EXPECT_TRUE(ckpt.has(lp.post_attention_norm())) << lp.post_attention_norm();
    if (lp.mixer == MixerKind::kGatedDeltaNet) {
      EXPECT_TRUE(ckpt.has(linear_weight(lp.linear_attention(), "out_proj"))) << lp.index;
    } else {
      for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"})
        EXPECT_TRUE(ckpt.has(linear_weight(lp.attention(), proj))) << lp.index << " " << proj;
    }
    if (lp.ffn == FfnKind::kDenseMlp) {
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
        EXPECT_TRUE(ckpt.has(linear_weight(lp.mlp(), proj))) << lp.index << " " << proj;
    } else {
      EXPECT_TRUE(ckpt.has(linear_weight(lp.mlp(), "gate"))) << lp.index;
      if (!ckpt.has(lp.mlp() + ".experts.gate_up_proj")) {
        EXPECT_TRUE(ckpt.has(expert_weight(lp.mlp(), m.config.num_experts - 1, "down_proj")));
      }
      EXPECT_EQ(ckpt.has(linear_weight(lp.mlp() + ".shared_expert", "up_proj")),
                lp.ffn == FfnKind::kMoeWithSharedExpert)
          << lp.index;
    }
  }
}

TEST(DecoderPlan, Qwen3MoeFollowsTheSparseStepAndMlpOnlyLayers) {
  const Loaded m = load("qwen3-moe-sparse-step");  // decoder_sparse_step 2, mlp_only_layers [2]
  ASSERT_EQ(m.plan.layers.size(), 4u);
  EXPECT_EQ(m.plan.prefix, "model.");
  const FfnKind want[] = {FfnKind::kDenseMlp, FfnKind::kMoe, FfnKind::kDenseMlp, FfnKind::kMoe};
  for (const LayerPlan& lp : m.plan.layers) {
    EXPECT_EQ(lp.mixer, MixerKind::kAttention);
    EXPECT_EQ(lp.ffn, want[lp.index]) << lp.index;
    EXPECT_EQ(lp.prefix, "model.layers." + std::to_string(lp.index) + ".");
  }
  EXPECT_EQ(m.plan.layers[1].attention(), "model.layers.1.self_attn");
  EXPECT_EQ(linear_weight(m.plan.layers[1].attention(), "q_proj"),
            "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(expert_weight(m.plan.layers[1].mlp(), 3, "up_proj"),
            "model.layers.1.mlp.experts.3.up_proj.weight");
  expect_names_exist(m);
}

TEST(DecoderPlan, HybridsInterleaveGatedDeltaNetAndGatedAttention) {
  for (const char* name : {"qwen3_5-moe", "qwen3_5-moe-text", "qwen3_5-dense", "qwen3-next"}) {
    SCOPED_TRACE(name);
    const Loaded m = load(name);
    ASSERT_EQ(static_cast<int64_t>(m.plan.layers.size()), m.config.num_hidden_layers);
    for (const LayerPlan& lp : m.plan.layers) {
      EXPECT_EQ(lp.mixer, m.config.layer_is_linear_attention(lp.index) ? MixerKind::kGatedDeltaNet
                                                                       : MixerKind::kGatedAttention);
    }
    auto count = [&](MixerKind k) {
      return std::count_if(m.plan.layers.begin(), m.plan.layers.end(),
                           [&](const LayerPlan& lp) { return lp.mixer == k; });
    };
    EXPECT_GT(count(MixerKind::kGatedDeltaNet), 0);
    EXPECT_GT(count(MixerKind::kGatedAttention), 0);
    expect_names_exist(m);
  }
  // A vision-language checkpoint keeps the language model under model.language_model.
  EXPECT_EQ(load("qwen3_5-moe").plan.prefix, "model.language_model.");
  EXPECT_EQ(load("qwen3_5-moe-text").plan.prefix, "model.");
  EXPECT_EQ(load("qwen3_5-moe").plan.layers[0].ffn, FfnKind::kMoeWithSharedExpert);
  EXPECT_EQ(load("qwen3_5-dense").plan.layers[0].ffn, FfnKind::kDenseMlp);
}

TEST(DecoderPlan, TheMtpLayerIsAttentionWithLayerZerosFeedForward) {
  const Loaded m = load("qwen3_5-moe");
  const LayerPlan mtp = plan_mtp_layer(m.config);
  EXPECT_EQ(mtp.prefix, "mtp.layers.0.");
  EXPECT_EQ(mtp.mixer, MixerKind::kGatedAttention);
  EXPECT_EQ(mtp.ffn, m.plan.layers[0].ffn);
  EXPECT_TRUE(m.ckpt.has(mtp.input_norm()));
  EXPECT_TRUE(m.ckpt.has(linear_weight(mtp.attention(), "q_proj")));
}

}  // namespace
}  // namespace relay

// model/decoder_plan.h on the tiny fixtures in the released layouts: the kinds follow each config's
// rules, and every name the plan gives is a tensor of the checkpoint (so a backend building from
// the plan finds its weights without spelling a name itself).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

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
      const std::string la = lp.linear_attention();
      for (const char* w : {"out_proj", "conv1d", "norm"})
        EXPECT_TRUE(ckpt.has(linear_weight(la, w))) << lp.index << " " << w;
      for (const char* t : {"A_log", "dt_bias"})
        EXPECT_TRUE(ckpt.has(block_tensor(la, t))) << lp.index << " " << t;
      for (const std::string& t : plan_in_proj(m.config, lp, ckpt, unsharded(m.config)).tensors)
        EXPECT_TRUE(ckpt.has(t)) << t;
    } else {
      for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"})
        EXPECT_TRUE(ckpt.has(linear_weight(lp.attention(), proj))) << lp.index << " " << proj;
    }
    if (lp.ffn == FfnKind::kDenseMlp) {
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
        EXPECT_TRUE(ckpt.has(linear_weight(lp.mlp(), proj))) << lp.index << " " << proj;
    } else {
      EXPECT_TRUE(ckpt.has(linear_weight(lp.mlp(), "gate"))) << lp.index;
      if (ckpt.has(fused_experts_weight(lp.mlp(), "gate_up_proj"))) {
        EXPECT_TRUE(ckpt.has(fused_experts_weight(lp.mlp(), "down_proj")));
      } else {
        EXPECT_TRUE(ckpt.has(expert_weight(lp.mlp(), m.config.num_experts - 1, "down_proj")));
      }
      EXPECT_EQ(ckpt.has(linear_weight(lp.shared_expert(), "up_proj")),
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

// The Gated DeltaNet input projection, [q | k | v | z | b | a] of a rank's heads: Qwen3.5's split
// tensors in order; Qwen3-Next's fused ones un-interleaved per key-head group (q of group 1
// starts one group of rows, 2 dk + 2 r dv, after q of group 0; b and a come from in_proj_ba's
// groups of 2 r rows); a TP rank's rows are its heads'.
TEST(DecoderPlan, TheGatedDeltaNetInputProjectionIsReadInTheBlocksOrder) {
  const Loaded q35 = load("qwen3_5-moe-text"), next = load("qwen3-next");
  const LayerPlan& l35 = q35.plan.layers[0];
  const InProjPlan split = plan_in_proj(q35.config, l35, q35.ckpt, unsharded(q35.config));
  EXPECT_EQ(split.tensors,
            (std::vector<std::string>{linear_weight(l35.linear_attention(), "in_proj_qkv"),
                                      linear_weight(l35.linear_attention(), "in_proj_z"),
                                      linear_weight(l35.linear_attention(), "in_proj_b"),
                                      linear_weight(l35.linear_attention(), "in_proj_a")}));
  EXPECT_EQ(split.tensor_rows, (std::vector<int64_t>{128, 64, 4, 4}));
  std::vector<int64_t> all(200);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(split.rows, all);

  const LayerPlan& ln = next.plan.layers[0];
  const InProjPlan fused = plan_in_proj(next.config, ln, next.ckpt, unsharded(next.config));
  EXPECT_EQ(fused.tensor_rows, (std::vector<int64_t>{320, 8}));  // 2 groups of 16 + 16 + 64 + 64
  ASSERT_EQ(fused.rows.size(), 328u);
  std::vector<int64_t> sorted = fused.rows;
  std::sort(sorted.begin(), sorted.end());
  all.resize(328);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(sorted, all);  // a permutation of the stored rows
  EXPECT_EQ(fused.rows[0], 0);     // q of group 0
  EXPECT_EQ(fused.rows[16], 160);  // q of group 1
  EXPECT_EQ(fused.rows[32], 16);   // k of group 0
  EXPECT_EQ(fused.rows[64], 32);   // v of group 0 (value heads 0 and 1)
  EXPECT_EQ(fused.rows[128], 192);  // v of group 1
  EXPECT_EQ(fused.rows[192], 96);   // z of group 0
  EXPECT_EQ(fused.rows[320], 320);  // b of value head 0
  EXPECT_EQ(fused.rows[322], 324);  // b of value head 2 (group 1)
  EXPECT_EQ(fused.rows[324], 322);  // a of value head 0

  // TP rank 1 of 2: key head 1 and value heads 2, 3.
  const ShardSpec rank1 = plan_shard(q35.config, parallel::ParallelConfig{2, 1, 1}, 1);
  const InProjPlan half = plan_in_proj(q35.config, l35, q35.ckpt, rank1);
  ASSERT_EQ(half.rows.size(), 100u);
  EXPECT_EQ(half.rows[0], 16);    // q of key head 1
  EXPECT_EQ(half.rows[16], 48);   // k of key head 1
  EXPECT_EQ(half.rows[32], 96);   // v of value head 2
  EXPECT_EQ(half.rows[64], 160);  // z of value head 2
  EXPECT_EQ(half.rows[96], 194);  // b of value head 2
  EXPECT_EQ(linear_attention_channels(q35.config, rank1).size(), 64u);
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

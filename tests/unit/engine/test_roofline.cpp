// The roofline cost model (engine/roofline.h) on a tiny Qwen3.5-MoE: which weights its format
// (linear_bytes) scales, the KV bytes of the full-attention layers and the recurrent state of the
// Gated DeltaNet ones.
#include <gtest/gtest.h>

#include <filesystem>

#include "engine/roofline.h"
#include "model/config.h"

namespace relay {
namespace {

TEST(Roofline, HybridCostsCountEachPartInItsFormat) {
  const ModelConfig c = ModelConfig::load(std::filesystem::path(RELAY_FIXTURES_DIR) / "models" /
                                          "qwen3_5-moe-text");
  const ModelCosts bf16 = model_costs(c, 2.0), fp8 = model_costs(c, 1.0);
  const double H = c.hidden_size, layers = c.num_hidden_layers;
  ASSERT_EQ(layers, 8);  // 6 Gated DeltaNet and 2 gated-attention layers, every one MoE
  EXPECT_EQ(bf16.expert_bytes, layers * 3 * c.moe_intermediate_size * H * 2);
  EXPECT_EQ(fp8.expert_bytes, bf16.expert_bytes / 2);
  // Gated attention and Gated DeltaNet stay bf16; the shared expert takes the experts' format.
  EXPECT_EQ(bf16.attn_weight_bytes - fp8.attn_weight_bytes,
            layers * 3 * c.shared_expert_intermediate_size * H);
  EXPECT_EQ(bf16.kv_bytes_per_token, 2 * 2.0 * c.num_key_value_heads * c.head_dim * 2);
  const double conv_state = double(c.linear_conv_dim()) * (c.linear_conv_kernel_dim - 1);
  const double ssm_state =
      double(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim;
  EXPECT_EQ(bf16.state_bytes, 6 * (conv_state + ssm_state) * 4);
  EXPECT_EQ(bf16.experts, c.num_experts);
  EXPECT_EQ(bf16.top_k, c.num_experts_per_tok);
}

}  // namespace
}  // namespace relay

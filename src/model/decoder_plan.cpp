// See decoder_plan.h.
#include "model/decoder_plan.h"

#include "core/error.h"

namespace relay {

const char* mixer_kind_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::kAttention: return "attention";
    case MixerKind::kGatedAttention: return "gated attention";
    case MixerKind::kGatedDeltaNet: return "Gated DeltaNet";
  }
  fail("unknown MixerKind");
}

const char* ffn_kind_name(FfnKind kind) {
  switch (kind) {
    case FfnKind::kDenseMlp: return "dense MLP";
    case FfnKind::kMoe: return "MoE";
    case FfnKind::kMoeWithSharedExpert: return "MoE with a shared expert";
  }
  fail("unknown FfnKind");
}

namespace {

// The model's softmax attention: gated where the config says so (the hybrids).
MixerKind attention_kind(const ModelConfig& c) {
  return c.attn_output_gate ? MixerKind::kGatedAttention : MixerKind::kAttention;
}

}  // namespace

MixerKind mixer_kind(const ModelConfig& c, int layer) {
  return c.layer_is_linear_attention(layer) ? MixerKind::kGatedDeltaNet : attention_kind(c);
}

FfnKind ffn_kind(const ModelConfig& c, int layer) {
  if (!c.layer_is_moe(layer)) return FfnKind::kDenseMlp;
  return c.shared_expert_intermediate_size > 0 ? FfnKind::kMoeWithSharedExpert : FfnKind::kMoe;
}

DecoderPlan plan_decoder(const ModelConfig& c, const Checkpoint& ckpt) {
  DecoderPlan plan;
  // NOTE: transformers' text classes strip a vision-language checkpoint's model.language_model.
  plan.prefix =
      ckpt.has("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
  plan.tie_word_embeddings = c.tie_word_embeddings;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerPlan& layer = plan.layers.emplace_back();
    layer.index = l;
    layer.prefix = str(plan.prefix, "layers.", l, ".");
    layer.mixer = mixer_kind(c, l);
    layer.ffn = ffn_kind(c, l);
  }
  return plan;
}

LayerPlan plan_mtp_layer(const ModelConfig& c) {
  LayerPlan layer;
  layer.prefix = "mtp.layers.0.";
  layer.mixer = attention_kind(c);
  layer.ffn = ffn_kind(c, 0);
  return layer;
}

namespace {

void take_range(std::vector<int64_t>& to, int64_t begin, int64_t count) {
  for (int64_t i = 0; i < count; ++i) to.push_back(begin + i);
}

// The rows of Qwen3-Next's [in_proj_qkvz; in_proj_ba] (stacked) in the order [q | k | v | z | b | a].
std::vector<int64_t> uninterleaved_rows(const ModelConfig& c) {
  const int64_t key_heads = c.linear_num_key_heads, dk = c.linear_key_head_dim;
  const int64_t r = c.linear_num_value_heads / key_heads;
  const int64_t vg = r * c.linear_value_head_dim;  // v (and z) rows of one group
  const int64_t qkvz_group = 2 * dk + 2 * vg, ba_begin = key_heads * qkvz_group;
  std::vector<int64_t> rows;
  // `count` rows at `offset` within each group of `group_rows` rows starting at row `base`.
  auto gather = [&](int64_t base, int64_t group_rows, int64_t offset, int64_t count) {
    for (int64_t g = 0; g < key_heads; ++g) take_range(rows, base + g * group_rows + offset, count);
  };
  gather(0, qkvz_group, 0, dk);            // q
  gather(0, qkvz_group, dk, dk);           // k
  gather(0, qkvz_group, 2 * dk, vg);       // v
  gather(0, qkvz_group, 2 * dk + vg, vg);  // z
  gather(ba_begin, 2 * r, 0, r);           // b
  gather(ba_begin, 2 * r, r, r);           // a
  return rows;
}

}  // namespace

std::vector<int64_t> linear_attention_channels(const ModelConfig& c, const ShardSpec& shard) {
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t qk_dim = c.linear_num_key_heads * dk;
  std::vector<int64_t> channels;
  take_range(channels, shard.k_head_begin * dk, shard.num_local_k_heads * dk);
  take_range(channels, qk_dim + shard.k_head_begin * dk, shard.num_local_k_heads * dk);
  take_range(channels, 2 * qk_dim + shard.v_head_begin * dv, shard.num_local_v_heads * dv);
  return channels;
}

InProjPlan plan_in_proj(const ModelConfig& c, const LayerPlan& layer, const Checkpoint& ckpt,
                        const ShardSpec& shard) {
  const std::string la = layer.linear_attention();
  const int64_t conv = c.linear_conv_dim(), v_dim = c.linear_value_dim();
  const int64_t heads = c.linear_num_value_heads, vb = shard.v_head_begin;
  InProjPlan plan;
  const bool fused = ckpt.has(linear_weight(la, "in_proj_qkvz"));
  if (fused) {
    plan.tensors = {linear_weight(la, "in_proj_qkvz"), linear_weight(la, "in_proj_ba")};
    plan.tensor_rows = {conv + v_dim, 2 * heads};
  } else {
    plan.tensors = {linear_weight(la, "in_proj_qkv"), linear_weight(la, "in_proj_z"),
                    linear_weight(la, "in_proj_b"), linear_weight(la, "in_proj_a")};
    plan.tensor_rows = {conv, v_dim, heads, heads};
  }
  // The rank's rows in the unfused order [q | k | v | z | b | a], then where each is stored.
  std::vector<int64_t> rows = linear_attention_channels(c, shard);
  const int64_t dv = c.linear_value_head_dim, local_v = shard.num_local_v_heads;
  take_range(rows, conv + vb * dv, local_v * dv);
  take_range(rows, conv + v_dim + vb, local_v);
  take_range(rows, conv + v_dim + heads + vb, local_v);
  if (fused) {
    const std::vector<int64_t> stored = uninterleaved_rows(c);
    for (int64_t& r : rows) r = stored[static_cast<size_t>(r)];
  }
  plan.rows = std::move(rows);
  return plan;
}

std::string linear_weight(const std::string& block, const char* name) {
  return str(block, ".", name, ".weight");
}

std::string linear_bias(const std::string& block, const char* name) {
  return str(block, ".", name, ".bias");
}

std::string expert_weight(const std::string& mlp, int64_t expert, const char* name) {
  return str(mlp, ".experts.", expert, ".", name, ".weight");
}

std::string fused_experts_weight(const std::string& mlp, const char* name) {
  return str(mlp, ".experts.", name);
}

std::string block_tensor(const std::string& block, const char* name) {
  return str(block, ".", name);
}

}  // namespace relay

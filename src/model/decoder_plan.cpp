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

std::string linear_weight(const std::string& block, const char* name) {
  return str(block, ".", name, ".weight");
}

std::string linear_bias(const std::string& block, const char* name) {
  return str(block, ".", name, ".bias");
}

std::string expert_weight(const std::string& mlp, int64_t expert, const char* name) {
  return str(mlp, ".experts.", expert, ".", name, ".weight");
}

}  // namespace relay

// Qwen3.5: Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM, and the dense
// Qwen3_5ForConditionalGeneration / Qwen3_5ForCausalLM.
//
// A hybrid decoder: Gated DeltaNet in the layers config.layer_types marks linear_attention (three
// of every four in the releases), gated attention with partial rotary in the others, and the MoE
// with its sigmoid-gated shared expert (or, dense, a SwiGLU MLP) in every layer; every decoder norm
// is zero-centred. The Gated DeltaNet input projection is stored split and contiguous
// (in_proj_qkv = q | k | v over all heads, in_proj_z, in_proj_b, in_proj_a), so concatenated in
// that order it is the block's in_proj as is. A vision-language checkpoint keeps the language
// model under model.language_model. (transformers' text class strips that prefix); its vision
// tower (model.visual.*) is not loaded. The MTP head (mtp.*, at the top level) is loaded by the
// registry when asked for (model/mtp.h), skipped with a log line otherwise. Experts may be stored
// per expert or fused 3-D (SparseMoe reads both).
#include "core/error.h"
#include "model/architectures.h"
#include "model/rope.h"

namespace relay {

std::unique_ptr<Model> build_qwen3_5(const ModelConfig& c, const Checkpoint& ckpt,
                                     const ShardSpec& shard) {
  log_unloaded_tensors(ckpt, "model.visual.", "the vision encoder is not run");
  const RopeTables rope = compute_rope(c);
  DecoderBlocks blocks;
  blocks.mixer = [&](const LayerPlan& layer) -> std::unique_ptr<TokenMixer> {
    if (layer.mixer != MixerKind::kGatedDeltaNet) {
      return std::make_unique<FullAttention>(c, ckpt, layer.attention(),
                                             c.kv_cache_layer(layer.index), rope, shard);
    }
    const std::string la = layer.linear_attention() + ".";
    Linear in_proj = load_linear(
        ckpt, {la + "in_proj_qkv", la + "in_proj_z", la + "in_proj_b", la + "in_proj_a"},
        {c.linear_conv_dim(), c.linear_value_dim(), c.linear_num_value_heads,
         c.linear_num_value_heads},
        c.hidden_size, false);
    return std::make_unique<GatedDeltaNet>(c, ckpt, layer.linear_attention(),
                                           c.recurrent_layer(layer.index), in_proj, shard);
  };
  blocks.ffn = [&](const LayerPlan& layer) { return make_feed_forward(c, ckpt, layer, shard); };
  return load_decoder(c, ckpt, shard, blocks);
}

}  // namespace relay

// Qwen3.5: Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM, and the dense
// Qwen3_5ForConditionalGeneration / Qwen3_5ForCausalLM.
//
// A hybrid decoder: Gated DeltaNet in the layers config.layer_types marks linear_attention (three
// of every four in the releases), gated attention with partial rotary in the others, and the MoE
// with its sigmoid-gated shared expert (or, dense, a SwiGLU MLP) in every layer; every decoder norm
// is zero-centred. The Gated DeltaNet input projection is stored split and contiguous
// (in_proj_qkv = q | k | v over all heads, in_proj_z, in_proj_b, in_proj_a; decoder_plan.h reads
// it). A vision-language checkpoint keeps the language
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
  blocks.mixer = [&](const LayerPlan& layer) { return make_token_mixer(c, ckpt, layer, rope, shard); };
  blocks.ffn = [&](const LayerPlan& layer) { return make_feed_forward(c, ckpt, layer, shard); };
  return load_decoder(c, ckpt, shard, blocks);
}

}  // namespace relay

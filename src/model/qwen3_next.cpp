// Qwen3NextForCausalLM: the same hybrid decoder as Qwen3.5 (Gated DeltaNet + gated attention with
// partial rotary, zero-centred norms), with Qwen3-MoE's layer rule for its feed-forward: the MoE
// block with a sigmoid-gated shared expert where config.layer_is_moe says so (norm_topk_prob,
// decoder_sparse_step, mlp_only_layers), a dense SwiGLU MLP elsewhere.
//
// What differs is the checkpoint: the Gated DeltaNet input projection is two fused tensors
// interleaved per key-head group (in_proj_qkvz, in_proj_ba), which the decoder plan un-interleaves
// at load (decoder_plan.h, plan_in_proj); after that the math is Qwen3.5's. The MTP head
// (mtp.*), when a checkpoint has one, is loaded by the registry when asked for (model/mtp.h).
#include "core/error.h"
#include "model/architectures.h"
#include "model/rope.h"

namespace relay {

std::unique_ptr<Model> build_qwen3_next(const ModelConfig& c, const Checkpoint& ckpt,
                                        const ShardSpec& shard) {
  const RopeTables rope = compute_rope(c);
  DecoderBlocks blocks;
  blocks.mixer = [&](const LayerPlan& layer) { return make_token_mixer(c, ckpt, layer, rope, shard); };
  blocks.ffn = [&](const LayerPlan& layer) { return make_feed_forward(c, ckpt, layer, shard); };
  return load_decoder(c, ckpt, shard, blocks);
}

}  // namespace relay

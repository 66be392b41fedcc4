// Qwen3MoeForCausalLM: full attention in every layer; the feed-forward is the sparse MoE block
// where ModelConfig::layer_is_moe says so (mlp_only_layers, decoder_sparse_step) and a dense SwiGLU
// MLP of width intermediate_size elsewhere, exactly as HF's Qwen3MoeDecoderLayer decides.
#include "core/error.h"
#include "model/architectures.h"
#include "model/rope.h"

namespace relay {

std::unique_ptr<Model> build_qwen3_moe(const ModelConfig& c, const Checkpoint& ckpt,
                                       const ShardSpec& shard) {
  const RopeTables rope = compute_rope(c);
  DecoderBlocks blocks;
  blocks.mixer = [&](const LayerPlan& layer) { return make_token_mixer(c, ckpt, layer, rope, shard); };
  blocks.ffn = [&](const LayerPlan& layer) { return make_feed_forward(c, ckpt, layer, shard); };
  return load_decoder(c, ckpt, shard, blocks);
}

}  // namespace relay

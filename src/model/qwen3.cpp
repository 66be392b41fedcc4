// Qwen3ForCausalLM: every layer is full attention + a dense SwiGLU MLP of width intermediate_size.
#include "core/error.h"
#include "model/architectures.h"
#include "model/rope.h"

namespace relay {

std::unique_ptr<Model> build_qwen3(const ModelConfig& c, const Checkpoint& ckpt,
                                   const ShardSpec& shard) {
  const RopeTables rope = compute_rope(c);
  DecoderBlocks blocks;
  blocks.mixer = [&](const LayerPlan& layer) { return make_token_mixer(c, ckpt, layer, rope, shard); };
  blocks.ffn = [&](const LayerPlan& layer) { return make_feed_forward(c, ckpt, layer, shard); };
  return load_decoder(c, ckpt, shard, blocks);
}

}  // namespace relay

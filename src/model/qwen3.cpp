// Qwen3ForCausalLM: every layer is full attention + a dense SwiGLU MLP of width intermediate_size.
#include "core/error.h"
#include "model/architectures.h"
#include "model/rope.h"

namespace relay {

std::unique_ptr<Model> build_qwen3(const ModelConfig& c, const Checkpoint& ckpt,
                                   const ShardSpec& shard) {
  const RopeTables rope = compute_rope(c);
  DecoderBlocks blocks;
  blocks.mixer = [&](int layer, const std::string& p) -> std::unique_ptr<TokenMixer> {
    return std::make_unique<FullAttention>(c, ckpt, p + "self_attn", layer, rope, shard);
  };
  blocks.ffn = [&](int, const std::string& p) -> std::unique_ptr<FeedForward> {
    return std::make_unique<DenseMlp>(ckpt, p + "mlp", c.hidden_size, c.intermediate_size,
                                      dense_mlp_slice(shard), shard.tp_comm);
  };
  return load_decoder(c, ckpt, shard, blocks);
}

}  // namespace relay

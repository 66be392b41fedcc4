// Qwen3MoeForCausalLM: full attention in every layer; the feed-forward is the sparse MoE block
// where ModelConfig::layer_is_moe says so (mlp_only_layers, decoder_sparse_step) and a dense SwiGLU
// MLP of width intermediate_size elsewhere, exactly as HF's Qwen3MoeDecoderLayer decides.
#include "core/error.h"
#include "model/architectures.h"

namespace relay {

std::unique_ptr<Model> build_qwen3_moe(const ModelConfig& c, const Checkpoint& ckpt,
                                       const ShardSpec& shard) {
  return load_decoder(c, ckpt, shard, [&](int layer) -> std::unique_ptr<FeedForward> {
    const std::string prefix = str("model.layers.", layer, ".mlp");
    if (c.layer_is_moe(layer)) return std::make_unique<SparseMoe>(c, ckpt, prefix, shard);
    return std::make_unique<DenseMlp>(ckpt, prefix, c.hidden_size, c.intermediate_size, shard);
  });
}

}  // namespace relay

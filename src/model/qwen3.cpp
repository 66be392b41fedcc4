// Qwen3ForCausalLM: every layer is full attention + a dense SwiGLU MLP of width intermediate_size.
#include "core/error.h"
#include "model/architectures.h"

namespace relay {

std::unique_ptr<Model> build_qwen3(const ModelConfig& c, const Checkpoint& ckpt,
                                   const ShardSpec& shard) {
  return load_decoder(c, ckpt, shard, [&](int layer) -> std::unique_ptr<FeedForward> {
    return std::make_unique<DenseMlp>(ckpt, str("model.layers.", layer, ".mlp"), c.hidden_size,
                                      c.intermediate_size, shard);
  });
}

}  // namespace relay

// A Qwen-family decoder-only language model on the CPU: embedding, decoder layers, final norm, LM
// head.
//
// One Model type serves every architecture: the per-architecture files (qwen3.cpp, qwen3_moe.cpp)
// only decide which blocks each layer gets while loading, and registry.h maps the config's
// `architecture` string to them. forward() runs one flattened batch (forward_batch.h) through the
// stack, writing K/V into the caller's pool and returning logits only for the requested rows. The
// batch is validated once here, at the boundary; the kernels trust it. A Model is not reentrant:
// its layers keep scratch buffers between calls.
//
// A Model may be one rank's shard (model/shard.h): it then holds and caches only its KV heads, its
// layers talk to the other ranks inside forward(), and every rank of the group must run the same
// sequence of forwards. A data-parallel rank with no tokens in a step calls forward_idle() instead,
// which serves the other ranks' expert-parallel MoE exchanges.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "kernels/ops.h"
#include "kvcache/kv_cache.h"
#include "model/config.h"
#include "model/forward_batch.h"
#include "model/layers.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace relay {

class ThreadPool;

// The LM head's weight [vocab, hidden]: bf16 bits when the checkpoint stores it in bf16 (the kernel
// widens exactly, reading half the bytes: this is most of a small model's decode traffic), else
// fp32; both empty means tied to the fp32 embedding.
struct LmHeadWeights {
  std::vector<float> f32;
  std::vector<kernels::Bf16Bits> bf16;
};

class Model {
 public:
  Model(ModelConfig config, ShardSpec shard, std::vector<float> embedding,
        std::vector<DecoderLayer> layers, std::vector<float> final_norm, LmHeadWeights lm_head);

  const ModelConfig& config() const { return config_; }
  const ShardSpec& shard() const { return shard_; }
  int vocab_size() const { return static_cast<int>(config_.vocab_size); }

  // The KV layout (fp32, this shard's KV heads) a pool for this model needs.
  KvCacheLayout kv_layout(int block_size, int num_blocks) const;
  // The layout of as many blocks as fit in `bytes`.
  KvCacheLayout kv_layout_for_budget(int block_size, size_t bytes) const;

  // Runs the batch; logits is resized to [batch.logit_rows.size(), vocab_size].
  void forward(const ForwardBatch& batch, KvPool& kv, ThreadPool& pool, std::vector<float>& logits);
  // A step with no tokens on this rank: takes part in the MoE dispatch/combine of every MoE layer
  // (the only collectives a DP rank joins). Only for shards with shard().dispatch_tokens.
  void forward_idle(ThreadPool& pool);

 private:
  void check_batch(const ForwardBatch& b, const KvPool& kv) const;

  ModelConfig config_;
  ShardSpec shard_;
  std::vector<float> embedding_;  // [vocab, hidden]
  std::vector<DecoderLayer> layers_;
  std::vector<float> final_norm_;  // [hidden]
  LmHeadWeights lm_head_;
  std::vector<float> hidden_, residual_, normed_;  // scratch, [num_tokens, hidden]
};

// Loads what every Qwen-family decoder shares (embedding, attention, norms, LM head) for `shard`
// and asks `make_ffn(layer)` for each layer's feed-forward block.
std::unique_ptr<Model> load_decoder(
    const ModelConfig& config, const Checkpoint& ckpt, const ShardSpec& shard,
    const std::function<std::unique_ptr<FeedForward>(int layer)>& make_ffn);

}  // namespace relay

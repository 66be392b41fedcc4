// A Qwen-family decoder-only language model on the CPU: embedding, decoder layers, final norm, LM
// head.
//
// One Model type serves every architecture: the per-architecture files (qwen3.cpp, qwen3_moe.cpp,
// qwen3_5.cpp, qwen3_next.cpp) only decide which blocks each layer gets while loading, and
// registry.h maps the config's `architecture` string to them. forward() runs one flattened batch
// (forward_batch.h) through the stack, writing K/V into the caller's pool (and, for a hybrid
// model's linear-attention layers, advancing each sequence's recurrent state in the batch's state
// pool) and returning logits only for the requested rows. The batch is validated once here, at
// the boundary; the kernels trust it. A Model is not reentrant: its layers keep scratch buffers
// between calls.
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
#include "kvcache/recurrent_state.h"
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

  // The KV layout (fp32, this shard's KV heads, the attention layers only) a pool for this model
  // needs.
  KvCacheLayout kv_layout(int block_size, int num_blocks) const;
  // The layout of as many blocks as fit in `bytes`.
  KvCacheLayout kv_layout_for_budget(int block_size, size_t bytes) const;
  // The recurrent-state layout (fp32) of `num_slots` sequences, for a model with linear-attention
  // layers (ModelConfig::has_linear_attention; the batch's state pool must have it).
  RecurrentStateLayout recurrent_state_layout(int num_slots) const;

  // Runs the batch; logits is resized to [batch.logit_rows.size(), vocab_size].
  void forward(const ForwardBatch& batch, KvPool& kv, ThreadPool& pool, std::vector<float>& logits);
  // A step with no tokens on this rank: takes part in the MoE dispatch/combine of every MoE layer
  // (the only collectives a DP rank joins). Only for shards with shard().dispatch_tokens.
  void forward_idle(ThreadPool& pool);

 private:
  void check_batch(const ForwardBatch& b, const KvPool& kv) const;
  void check_recurrent_state(const ForwardBatch& b) const;

  ModelConfig config_;
  ShardSpec shard_;
  std::vector<float> embedding_;  // [vocab, hidden]
  std::vector<DecoderLayer> layers_;
  std::vector<float> final_norm_;  // [hidden]
  LmHeadWeights lm_head_;
  std::vector<float> hidden_, residual_, normed_;  // scratch, [num_tokens, hidden]
};

// The recurrent-state layout of `num_slots` sequences of a model with linear-attention layers, as
// `shard` holds it (a planner that has no Model yet: it sizes state memory from this). Its
// bytes_per_slot() is one sequence's state: per linear-attention layer, the conv state
// [conv_dim, kernel - 1] and the SSM state [value heads, key dim, value dim], fp32.
RecurrentStateLayout recurrent_state_layout(const ModelConfig& config, const ShardSpec& shard,
                                            int num_slots);

// What an architecture file decides for each layer; load_decoder loads the rest. Layer l's tensors
// are under prefix + "layers.<l>." (passed to the callbacks as layer_prefix); the embedding and the
// final norm under prefix too, and lm_head.weight at the top level.
struct DecoderBlocks {
  std::string prefix = "model.";  // "model.language_model." in a Qwen3.5 vision-language checkpoint
  std::function<std::unique_ptr<TokenMixer>(int layer, const std::string& layer_prefix)> mixer;
  std::function<std::unique_ptr<FeedForward>(int layer, const std::string& layer_prefix)> ffn;
};

// Logs (one stderr line) how many tensors under `prefix` the checkpoint holds that the model does
// not load, and why; nothing when there are none.
void log_unloaded_tensors(const Checkpoint& ckpt, const std::string& prefix,
                          const std::string& why);

// Loads what every Qwen-family decoder shares (embedding, norms, LM head) for `shard` and asks
// `blocks` for each layer's token mixer and feed-forward. Norms are zero-centred (1 + w) when the
// config says so.
std::unique_ptr<Model> load_decoder(const ModelConfig& config, const Checkpoint& ckpt,
                                    const ShardSpec& shard, const DecoderBlocks& blocks);

}  // namespace relay

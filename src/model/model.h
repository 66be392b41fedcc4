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
//
// With an MTP draft head (model/mtp.h; loaded when registry.h's MtpSource asks for it) the model
// also drafts: forward() leaves the final-normed hidden state of every row in last_hidden(), and
// forward_mtp() runs the head over (token t[p + 1], hidden[p]) rows, caching the head's K/V in the
// pool's layers after the target's attention layers, and leaves its own output y in last_hidden()
// for the next chained step.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kernels/ops.h"
#include "kvcache/kv_cache.h"
#include "kvcache/recurrent_state.h"
#include "model/config.h"
#include "model/decoder_plan.h"
#include "model/forward_batch.h"
#include "model/layers.h"
#include "model/mtp.h"
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
  // needs. With an MTP head its layers follow the target's: MTP layer i caches in KV layer
  // config().num_kv_cache_layers() + i, so num_layers is num_kv_cache_layers() + num_mtp_layers().
  KvCacheLayout kv_layout(int block_size, int num_blocks) const;
  // The layout of as many blocks as fit in `bytes`.
  KvCacheLayout kv_layout_for_budget(int block_size, size_t bytes) const;
  // The recurrent-state layout (fp32) of `num_slots` sequences, for a model with linear-attention
  // layers (ModelConfig::has_linear_attention; the batch's state pool must have it).
  RecurrentStateLayout recurrent_state_layout(int num_slots) const;

  // Runs the batch; logits is resized to [batch.logit_rows.size(), vocab_size]. Afterwards
  // last_hidden() holds the final-normed hidden state of every token row.
  void forward(const ForwardBatch& batch, KvPool& kv, ThreadPool& pool, std::vector<float>& logits);
  // A step with no tokens on this rank: takes part in the MoE dispatch/combine of every MoE layer
  // (the only collectives a DP rank joins). Only for shards with shard().dispatch_tokens.
  void forward_idle(ThreadPool& pool);
  // forward_idle for the MTP head's layer: a DP rank without MTP rows still serves the other
  // ranks' tokens in the head's MoE exchange.
  void forward_mtp_idle(ThreadPool& pool);

  // Whether the MTP draft head is loaded (registry.h: MtpSource), and its decoder layers (0 or 1:
  // every known checkpoint has one, and the loader refuses more).
  bool has_mtp() const { return mtp_.has_value(); }
  int num_mtp_layers() const { return has_mtp() ? 1 : 0; }
  // The output of the last forward() or forward_mtp() on this Model, [num_tokens, hidden] for
  // every token row of its batch: after forward() the target's hidden state after its final norm
  // (what its LM head reads), after forward_mtp() the head's y = mtp.norm output. A view of the
  // Model's scratch: valid until the next forward of any kind (forward_mtp may be given it as its
  // `hidden`: it reads that before writing anything).
  std::span<const float> last_hidden() const { return normed_; }
  // One MTP step (model/mtp.h has the math): row r pairs token batch.token_ids[r] (t[p + 1]) with
  // hidden row r (hidden[p]: the target's last_hidden() row of position p, or the previous chained
  // step's output row) at RoPE position batch.positions[r] = p. Sequences, block tables,
  // slot_mapping, context_lens and logit_rows mean what they mean for forward(): the head writes
  // its K/V to its own KV layer at those slots and attends causally over context_lens, so its
  // cache is filled as the target's is (a prompt may take several chunks, drafts are appended
  // after it). hidden: [num_tokens, hidden]. logits is resized to [logit_rows.size(), vocab_size];
  // last_hidden() then holds y of every row. The recurrent-state fields are ignored (the head is
  // attention only). Requires has_mtp(); the batch is checked like forward()'s.
  void forward_mtp(const ForwardBatch& batch, std::span<const float> hidden, KvPool& kv,
                   ThreadPool& pool, std::vector<float>& logits);

  // Attaches the MTP head; the registry does this while loading, before any KV pool is sized
  // from kv_layout().
  void set_mtp_head(MtpHead head);

 private:
  // The KV pool's layers: the target's attention layers, then the MTP layers.
  int num_kv_layers() const { return config_.num_kv_cache_layers() + num_mtp_layers(); }
  void check_batch(const ForwardBatch& b, const KvPool& kv, bool recurrent_state) const;
  void check_recurrent_state(const ForwardBatch& b) const;
  // hidden_ = the embeddings of the batch's tokens.
  void embed(const ForwardBatch& b, ThreadPool& pool);
  // The fused residual norm over the scratch: adds hidden_ into residual_, normalises it into
  // normed_ (the caller sets the weight).
  kernels::RmsNormParams<float> residual_norm(int num_tokens);
  // One decoder layer on the residual stream: norm, token mixer, norm, feed-forward; its output is
  // left in hidden_ for the next norm to add.
  void run_layer(DecoderLayer& layer, const ForwardBatch& b, KvPool& kv, ThreadPool& pool,
                 kernels::RmsNormParams<float>& norm);
  // logits = lm_head(normed_ rows `rows`), [rows.size(), vocab_size].
  void compute_logits(std::span<const int32_t> rows, ThreadPool& pool, std::vector<float>& logits);

  ModelConfig config_;
  ShardSpec shard_;
  std::vector<float> embedding_;  // [vocab, hidden]
  std::vector<DecoderLayer> layers_;
  std::vector<float> final_norm_;  // [hidden]
  LmHeadWeights lm_head_;
  std::optional<MtpHead> mtp_;
  std::vector<float> hidden_, residual_, normed_;  // scratch, [num_tokens, hidden]
  std::vector<float> mtp_input_;                   // scratch, [num_tokens, 2 * hidden]
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
  std::function<std::unique_ptr<TokenMixer>(const LayerPlan& layer)> mixer;
  std::function<std::unique_ptr<FeedForward>(const LayerPlan& layer)> ffn;
};

// Logs (one stderr line) how many tensors under `prefix` the checkpoint holds that the model does
// not load, and why; nothing when there are none.
void log_unloaded_tensors(const Checkpoint& ckpt, const std::string& prefix,
                          const std::string& why);

// Loads what every Qwen-family decoder shares (embedding, norms, LM head) for `shard` and asks
// `blocks` for each layer's token mixer and feed-forward, layer by layer of the decoder's plan
// (model/decoder_plan.h). Norms are zero-centred (1 + w) when the
// config says so.
std::unique_ptr<Model> load_decoder(const ModelConfig& config, const Checkpoint& ckpt,
                                    const ShardSpec& shard, const DecoderBlocks& blocks);

}  // namespace relay

// The shared building blocks of Qwen-family decoders, in fp32 for the CPU backend.
//
// A decoder layer is: input norm -> token mixer -> residual -> post-attention norm -> feed-forward
// -> residual. The token mixer and the feed-forward are interfaces because the family varies
// exactly there: the mixer is full (softmax) attention over the paged KV cache today, and Qwen3.5's
// linear attention later (with its own recurrent state); the feed-forward is a dense SwiGLU MLP or
// a sparse mixture of experts, chosen per layer by the config. Each block owns its weights (widened
// from the checkpoint to fp32 once, at load) and its scratch buffers, which grow to the largest
// batch seen and are reused, so a steady decode loop does not allocate.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvcache/kv_cache.h"
#include "model/config.h"
#include "model/forward_batch.h"
#include "model/rope.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace relay {

class ThreadPool;

// Reads tensor `name`, checking its shape (the error names the tensor, the file and both shapes),
// and widens F32/BF16/F16 to fp32.
std::vector<float> load_f32(const Checkpoint& ckpt, const std::string& name,
                            const std::vector<int64_t>& shape);

// y = x @ weight^T + bias; weight [out_features, in_features] as nn.Linear stores it.
struct Linear {
  std::vector<float> weight;  // [out_features, in_features]
  std::vector<float> bias;    // [out_features] or empty
  int out_features = 0;
  int in_features = 0;

  void forward(const float* x, int num_rows, float* out,
               ThreadPool& pool) const;  // x [num_rows, in], out [num_rows, out]
};

// A range of rows or columns of a checkpoint tensor; count -1 means "to the end".
struct IndexRange {
  int64_t begin = 0;
  int64_t count = -1;
};

// Loads `prefix`.weight (and `prefix`.bias when with_bias) into one Linear. Several prefixes are
// concatenated along the output dimension (q|k|v, gate|up), in order. A sharded rank keeps
// rows[i] of prefix i (all rows when `rows` is empty) and the input columns `cols` of every weight:
// tensor parallelism slices a column-parallel layer by rows and a row-parallel one by columns.
Linear load_linear(const Checkpoint& ckpt, const std::vector<std::string>& prefixes,
                   const std::vector<int64_t>& out_features, int64_t in_features, bool with_bias,
                   const std::vector<IndexRange>& rows = {}, IndexRange cols = {});

// Mixes information across the tokens of a sequence (attention of some kind).
class TokenMixer {
 public:
  virtual ~TokenMixer() = default;
  // x, out: [num_tokens, hidden]. Reads and writes this layer's cache state in `kv`.
  virtual void forward(const float* x, const ForwardBatch& batch, KvPool& kv, ThreadPool& pool,
                       float* out) = 0;
};

// Qwen3 attention: fused qkv projection (+ bias), per-head q/k RMSNorm, RoPE, paged GQA attention
// over the KV cache of layer `layer`, o projection (+ bias). Under tensor parallelism the rank
// holds the shard's q heads and KV heads (the pool holds only those) and o_proj's matching columns;
// the partial o outputs are summed across the TP group (the bias is added once, by TP rank 0).
class FullAttention : public TokenMixer {
 public:
  FullAttention(const ModelConfig& config, const Checkpoint& ckpt, int layer,
                const RopeTables& rope, const ShardSpec& shard);
  void forward(const float* x, const ForwardBatch& batch, KvPool& kv, ThreadPool& pool,
               float* out) override;

 private:
  int layer_;
  int num_q_heads_, num_kv_heads_, head_dim_;  // this rank's heads
  parallel::Communicator* tp_comm_;
  float eps_;
  Linear qkv_;                          // [(q_heads + 2 kv_heads) * head_dim, hidden]
  Linear o_;                            // [hidden, q_heads * head_dim]
  std::vector<float> q_norm_, k_norm_;  // [head_dim]
  RopeTables rope_;
  std::vector<float> qkv_out_, q_, attn_;  // scratch
};

// Position-wise feed-forward.
class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // x, out: [num_tokens, hidden].
  virtual void forward(const float* x, int num_tokens, ThreadPool& pool, float* out) = 0;
};

// down(silu(gate(x)) * up(x)), gate and up fused into one matmul. Under tensor parallelism the rank
// holds a slice of the width (gate/up rows, down columns) and the partial outputs are summed.
class DenseMlp : public FeedForward {
 public:
  // prefix: "model.layers.N.mlp"; the width is sliced as shard.mlp_width_begin /
  // num_local_mlp_width.
  DenseMlp(const Checkpoint& ckpt, const std::string& prefix, int64_t hidden, int64_t width,
           const ShardSpec& shard);
  void forward(const float* x, int num_tokens, ThreadPool& pool, float* out) override;

 private:
  Linear gate_up_;  // [2 * width, hidden]
  Linear down_;     // [hidden, width]
  int width_;       // this rank's slice
  parallel::Communicator* tp_comm_;
  std::vector<float> gate_up_out_, act_;  // scratch
};

// Qwen3-MoE sparse block: router softmax + top-k (+ renormalisation), experts as SwiGLU MLPs run as
// grouped matmuls over tokens permuted by expert, weighted combine. No shared expert.
//
// Sharded, the rank holds experts [expert_begin, expert_begin + num_local_experts) (EP) or a slice
// of every expert's width (TP with ep = 1), and computes each token's weighted sum over the experts
// it holds; the ranks' partial sums add up to the full output. Routes to experts held elsewhere are
// mapped to one extra "absent" local expert id that sorts last, gets weight 0 and is never
// computed, so the same permute / grouped matmul / combine kernels serve every layout. With
// replicated tokens (TP+EP prefill) the partial outputs are all-reduced; with per-rank tokens (DP
// attention) each rank sends every token to the ranks holding any of its experts (dispatch), they
// return partial sums, and the sender adds them up in rank order (combine). A rank with no tokens
// still takes part.
class SparseMoe : public FeedForward {
 public:
  SparseMoe(const ModelConfig& config, const Checkpoint& ckpt, const std::string& prefix,
            const ShardSpec& shard);
  // num_tokens may be 0 (a DP rank with no requests this step still serves the others' tokens).
  void forward(const float* x, int num_tokens, ThreadPool& pool, float* out) override;

 private:
  // The weighted sum over this rank's experts of tokens x [num_tokens, hidden] routed by
  // ids [num_tokens, top_k] (local expert ids; num_local_experts_ = absent) and weights -> out.
  void run_local_experts(const float* x, const int32_t* ids, const float* weights, int num_tokens,
                         ThreadPool& pool, float* out);
  // Router logits and top-k of x into topk_ids_ / topk_weights_.
  void route(const float* x, int num_tokens, ThreadPool& pool);
  // Dispatch to the ranks of the experts, compute, combine (DP attention + EP).
  void dispatch_combine(const float* x, int num_tokens, ThreadPool& pool, float* out);

  int hidden_, num_experts_, top_k_, width_;  // width_: this rank's slice of each expert
  bool renormalize_;
  int expert_begin_, num_local_experts_;
  bool dispatch_tokens_;
  parallel::Communicator*
      reduce_comm_;  // sums partial outputs (replicated tokens); null when unsharded
  parallel::Communicator* ep_comm_;  // dispatch / combine (per-rank tokens)
  Linear router_;                    // [num_experts, hidden]
  std::vector<float> gate_up_;       // [num_local_experts, 2 * width, hidden]
  std::vector<float> down_;          // [num_local_experts, hidden, width]
  // scratch
  std::vector<float> router_logits_, topk_weights_, permuted_x_, gate_up_out_, act_, expert_out_;
  std::vector<int32_t> topk_ids_, local_ids_, permuted_index_, expert_offsets_;
  std::vector<std::vector<float>> send_rows_, recv_rows_;
  std::vector<std::vector<int32_t>> send_ids_, recv_ids_;
  std::vector<float> recv_x_, recv_weights_, recv_out_;
};

struct DecoderLayer {
  std::vector<float> input_norm;           // [hidden]
  std::vector<float> post_attention_norm;  // [hidden]
  std::unique_ptr<TokenMixer> mixer;
  std::unique_ptr<FeedForward> ffn;
};

}  // namespace relay

// The shared building blocks of Qwen-family decoders, in fp32 for the CPU backend.
//
// A decoder layer is: input norm -> token mixer -> residual -> post-attention norm -> feed-forward ->
// residual. The token mixer and the feed-forward are interfaces because the family varies exactly
// there: the mixer is full (softmax) attention over the paged KV cache today, and Qwen3.5's linear
// attention later (with its own recurrent state); the feed-forward is a dense SwiGLU MLP or a sparse
// mixture of experts, chosen per layer by the config. Each block owns its weights (widened from the
// checkpoint to fp32 once, at load) and its scratch buffers, which grow to the largest batch seen and
// are reused, so a steady decode loop does not allocate.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvcache/kv_cache.h"
#include "model/config.h"
#include "model/forward_batch.h"
#include "model/rope.h"
#include "model/safetensors.h"

namespace relay {

class ThreadPool;

// Reads tensor `name`, checking its shape (the error names the tensor, the file and both shapes), and
// widens F32/BF16/F16 to fp32.
std::vector<float> load_f32(const Checkpoint& ckpt, const std::string& name, const std::vector<int64_t>& shape);

// y = x @ weight^T + bias; weight [out_features, in_features] as nn.Linear stores it.
struct Linear {
  std::vector<float> weight;  // [out_features, in_features]
  std::vector<float> bias;    // [out_features] or empty
  int out_features = 0;
  int in_features = 0;

  void forward(const float* x, int num_rows, float* out, ThreadPool& pool) const;  // x [num_rows, in], out [num_rows, out]
};

// Loads `prefix`.weight (and `prefix`.bias when with_bias) into one Linear. Several prefixes are
// concatenated along the output dimension (q|k|v, gate|up), in order.
Linear load_linear(const Checkpoint& ckpt, const std::vector<std::string>& prefixes,
                   const std::vector<int64_t>& out_features, int64_t in_features, bool with_bias);

// Mixes information across the tokens of a sequence (attention of some kind).
class TokenMixer {
 public:
  virtual ~TokenMixer() = default;
  // x, out: [num_tokens, hidden]. Reads and writes this layer's cache state in `kv`.
  virtual void forward(const float* x, const ForwardBatch& batch, KvPool& kv, ThreadPool& pool, float* out) = 0;
};

// Qwen3 attention: fused qkv projection (+ bias), per-head q/k RMSNorm, RoPE, paged GQA attention
// over the KV cache of layer `layer`, o projection (+ bias).
class FullAttention : public TokenMixer {
 public:
  FullAttention(const ModelConfig& config, const Checkpoint& ckpt, int layer, const RopeTables& rope);
  void forward(const float* x, const ForwardBatch& batch, KvPool& kv, ThreadPool& pool, float* out) override;

 private:
  int layer_;
  int num_q_heads_, num_kv_heads_, head_dim_;
  float eps_;
  Linear qkv_;  // [(q_heads + 2 kv_heads) * head_dim, hidden]
  Linear o_;    // [hidden, q_heads * head_dim]
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

// down(silu(gate(x)) * up(x)), gate and up fused into one matmul.
class DenseMlp : public FeedForward {
 public:
  // prefix: "model.layers.N.mlp"
  DenseMlp(const Checkpoint& ckpt, const std::string& prefix, int64_t hidden, int64_t width);
  void forward(const float* x, int num_tokens, ThreadPool& pool, float* out) override;

 private:
  Linear gate_up_;  // [2 * width, hidden]
  Linear down_;     // [hidden, width]
  int width_;
  std::vector<float> gate_up_out_, act_;  // scratch
};

// Qwen3-MoE sparse block: router softmax + top-k (+ renormalisation), experts as SwiGLU MLPs run as
// grouped matmuls over tokens permuted by expert, weighted combine. No shared expert.
class SparseMoe : public FeedForward {
 public:
  SparseMoe(const ModelConfig& config, const Checkpoint& ckpt, const std::string& prefix);
  void forward(const float* x, int num_tokens, ThreadPool& pool, float* out) override;

 private:
  int hidden_, num_experts_, top_k_, width_;
  bool renormalize_;
  Linear router_;                  // [num_experts, hidden]
  std::vector<float> gate_up_;     // [num_experts, 2 * width, hidden]
  std::vector<float> down_;        // [num_experts, hidden, width]
  // scratch
  std::vector<float> router_logits_, topk_weights_, permuted_x_, gate_up_out_, act_, expert_out_;
  std::vector<int32_t> topk_ids_, permuted_index_, expert_offsets_;
};

struct DecoderLayer {
  std::vector<float> input_norm;           // [hidden]
  std::vector<float> post_attention_norm;  // [hidden]
  std::unique_ptr<TokenMixer> mixer;
  std::unique_ptr<FeedForward> ffn;
};

}  // namespace relay

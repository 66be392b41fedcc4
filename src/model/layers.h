// The shared building blocks of Qwen-family decoders, in fp32 for the CPU backend.
//
// A decoder layer is: input norm -> token mixer -> residual -> post-attention norm -> feed-forward
// -> residual. The token mixer and the feed-forward are interfaces because the family varies
// exactly there: the mixer is full (softmax) attention over the paged KV cache (gated, with partial
// rotary, in Qwen3.5 / Qwen3-Next) or Gated DeltaNet linear attention over a per-sequence
// recurrent state; the feed-forward is a dense SwiGLU MLP or a sparse mixture of experts (with a
// sigmoid-gated shared expert in the hybrids), chosen per layer by the config. Each block owns its
// weights (widened from the checkpoint to fp32 once, at load; a zero-centred norm's 1 + w folded
// in) and its scratch buffers, which grow to the largest batch seen and are reused, so a steady
// decode loop does not allocate. Blocks take their tensors' prefix ("model.layers.N.self_attn",
// or under "model.language_model." for a Qwen3.5 vision-language checkpoint) from the
// architecture file that builds them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvcache/kv_cache.h"
#include "model/config.h"
#include "model/decoder_plan.h"
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

// An RMSNorm weight [size]. Zero-centred (ModelConfig::zero_centered_norms) it is stored as 1 + w:
// transformers also forms 1 + w in fp32 and multiplies the normalised row by it, so the result is
// bit for bit the same and the norm kernels need not know the convention.
std::vector<float> load_norm(const Checkpoint& ckpt, const std::string& name, int64_t size,
                             bool zero_centered);

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

// The rows `rows` of `src` (weight and bias), in that order: a fused checkpoint tensor taken apart
// at load (Qwen3-Next's interleaved in_proj_qkvz, gated attention's [query | gate] q_proj).
Linear take_rows(const Linear& src, const std::vector<int64_t>& rows);

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
  // x, out: [num_tokens, hidden]. Reads and writes this layer's cache state: its pages of `kv`
  // (attention) or its part of each sequence's slot of batch.recurrent_state (linear attention).
  virtual void forward(const float* x, const ForwardBatch& batch, KvPool& kv, ThreadPool& pool,
                       float* out) = 0;
};

// Qwen3 attention: fused qkv projection (+ bias), per-head q/k RMSNorm, RoPE, paged GQA attention
// over KV-pool layer `kv_layer`, o projection (+ bias). Qwen3.5 / Qwen3-Next's gated attention
// (config.attn_output_gate) adds the gate: q_proj's rows are per head [query | gate], split at load
// into the q of qkv_ and a gate projection, and the attention output is multiplied by
// sigmoid(gate) before o_proj; its q/k norms are zero-centred and RoPE turns only the first
// rotary_dim dims. Under tensor parallelism the rank holds the shard's q heads and KV heads (the
// pool holds only those) and o_proj's matching columns; the partial o outputs are summed across
// the TP group (the bias is added once, by TP rank 0).
class FullAttention : public TokenMixer {
 public:
  // prefix: "model.layers.N.self_attn".
  FullAttention(const ModelConfig& config, const Checkpoint& ckpt, const std::string& prefix,
                int kv_layer, const RopeTables& rope, const ShardSpec& shard);
  void forward(const float* x, const ForwardBatch& batch, KvPool& kv, ThreadPool& pool,
               float* out) override;

 private:
  int kv_layer_;
  int num_q_heads_, num_kv_heads_, head_dim_;  // this rank's heads
  int rotary_dim_;
  bool gated_;
  parallel::Communicator* tp_comm_;
  float eps_;
  Linear qkv_;                          // [(q_heads + 2 kv_heads) * head_dim, hidden]
  Linear gate_;                         // [q_heads * head_dim, hidden] when gated
  Linear o_;                            // [hidden, q_heads * head_dim]
  std::vector<float> q_norm_, k_norm_;  // [head_dim]
  RopeTables rope_;
  std::vector<float> qkv_out_, q_, attn_, gate_out_;  // scratch
};

// Gated DeltaNet, the linear attention of Qwen3.5 / Qwen3-Next (kernels/ops.h has the math):
// in_proj -> causal conv1d + SiLU over q | k | v -> gated delta rule -> gated RMSNorm with
// silu(z) -> out_proj. Each sequence's conv and SSM states live in its slot of the batch's
// recurrent-state pool, at layer `state_layer` of the slot; nothing goes to the KV pool. The two
// checkpoint layouts differ only in how the input projection is stored, which the decoder plan
// reads into rows [q | k | v | z | b | a] (decoder_plan.h, plan_in_proj). Under tensor parallelism
// the rank keeps its key heads and the value heads that read them (model/shard.h): their rows of
// in_proj, channels of the convolution, gates and out_proj columns; its slot of the state pool
// holds only those, and the partial out_proj outputs are summed across the TP group.
class GatedDeltaNet : public TokenMixer {
 public:
  GatedDeltaNet(const ModelConfig& config, const Checkpoint& ckpt, const LayerPlan& layer,
                int state_layer, const ShardSpec& shard);
  void forward(const float* x, const ForwardBatch& batch, KvPool& kv, ThreadPool& pool,
               float* out) override;

 private:
  int state_layer_;
  int num_k_heads_, num_v_heads_, key_dim_, value_dim_;  // per head dims
  int kernel_size_;
  float eps_;
  parallel::Communicator* tp_comm_;
  Linear in_proj_;                  // [conv_dim + v_heads * value_dim + 2 * v_heads, hidden]
  Linear out_proj_;                 // [hidden, v_heads * value_dim]
  std::vector<float> conv_weight_;  // [conv_dim, kernel_size]
  std::vector<float> a_log_;        // [v_heads], as stored (F32 in the releases)
  std::vector<float> dt_bias_;      // [v_heads]
  std::vector<float> norm_weight_;  // [value_dim], plain (not zero-centred)
  std::vector<float> proj_, core_;  // scratch
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
  // prefix: "model.layers.N.mlp"; the rank keeps the columns `slice` of the width (all of them when
  // its count is -1) and sums its partial output over `reduce` (none when null: the caller sums).
  DenseMlp(const Checkpoint& ckpt, const std::string& prefix, int64_t hidden, int64_t width,
           IndexRange slice, parallel::Communicator* reduce);
  void forward(const float* x, int num_tokens, ThreadPool& pool, float* out) override;

 private:
  Linear gate_up_;  // [2 * width, hidden]
  Linear down_;     // [hidden, width]
  int width_;       // this rank's slice
  parallel::Communicator* tp_comm_;
  std::vector<float> gate_up_out_, act_;  // scratch
};

// Qwen3-MoE sparse block: router softmax + top-k (+ renormalisation), experts as SwiGLU MLPs run as
// grouped matmuls over tokens permuted by expert, weighted combine. With
// config.shared_expert_intermediate_size (Qwen3.5 / Qwen3-Next) a shared expert runs on every
// token too, scaled by sigmoid(shared_expert_gate(x)), and is added to the routed sum. Experts are
// read per expert (experts.E.gate_proj, ...) or fused 3-D (experts.gate_up_proj [E, 2I, H], gate
// rows first, and experts.down_proj [E, H, I]: transformers' layout, which is this block's own).
//
// Sharded, the rank holds experts [expert_begin, expert_begin + num_local_experts) (EP) or a slice
// of every expert's width (TP with ep = 1), and computes each token's weighted sum over the experts
// it holds; the ranks' partial sums add up to the full output. Routes to experts held elsewhere are
// mapped to one extra "absent" local expert id that sorts last, gets weight 0 and is never
// computed, so the same permute / grouped matmul / combine kernels serve every layout. With
// replicated tokens (TP+EP prefill) the partial outputs are all-reduced; with per-rank tokens (DP
// attention) each rank sends every token to the ranks holding any of its experts (dispatch), they
// return partial sums, and the sender adds them up in rank order (combine). A rank with no tokens
// still takes part. The shared expert is sliced like a dense MLP under TP (its partial output
// joins the reduction) and whole on each DP rank (added to its own tokens after the combine).
// Fused expert tensors are read whole and sliced after.
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
  // out += sigmoid(shared_expert_gate(x)) * shared_expert(x).
  void add_shared_expert(const float* x, int num_tokens, ThreadPool& pool, float* out);
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
  std::unique_ptr<DenseMlp> shared_expert_;  // null without one
  bool shared_partial_ = false;  // it holds a slice of the width (TP): added before the reduction
  Linear shared_expert_gate_;                // [1, hidden]
  std::vector<float> shared_out_, shared_gate_out_;
  // scratch
  std::vector<float> router_logits_, topk_weights_, permuted_x_, gate_up_out_, act_, expert_out_;
  std::vector<int32_t> topk_ids_, local_ids_, permuted_index_, expert_offsets_;
  std::vector<std::vector<float>> send_rows_, recv_rows_;
  std::vector<std::vector<int32_t>> send_ids_, recv_ids_;
  std::vector<float> recv_x_, recv_weights_, recv_out_;
};

// A layer's token mixer as its plan says: (gated) attention over KV-pool layer
// config.kv_cache_layer(index), or Gated DeltaNet over recurrent-state layer
// config.recurrent_layer(index).
std::unique_ptr<TokenMixer> make_token_mixer(const ModelConfig& config, const Checkpoint& ckpt,
                                             const LayerPlan& layer, const RopeTables& rope,
                                             const ShardSpec& shard);

// A decoder MLP's slice of intermediate_size on this rank (DenseMlp's `slice`).
IndexRange dense_mlp_slice(const ShardSpec& shard);

// A layer's feed-forward as its plan says (model/decoder_plan.h): the sparse MoE block (with its
// shared expert when the config has one), or a dense SwiGLU MLP of width intermediate_size.
std::unique_ptr<FeedForward> make_feed_forward(const ModelConfig& config, const Checkpoint& ckpt,
                                               const LayerPlan& layer, const ShardSpec& shard);

struct DecoderLayer {
  std::vector<float> input_norm;           // [hidden]
  std::vector<float> post_attention_norm;  // [hidden]
  std::unique_ptr<TokenMixer> mixer;
  std::unique_ptr<FeedForward> ffn;
};

}  // namespace relay

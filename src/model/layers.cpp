// See layers.h. Weight names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj,
// model.layers.N.mlp.experts.E.gate_proj, ...); fused tensors are built at load by concatenating the
// checkpoint's rows, so the math is unchanged and each step runs one matmul instead of three.
#include "model/layers.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/ops.h"
#include "quant/quant_config.h"
#include "quant/weight_quant.h"

namespace relay {

namespace {

void widen_into(const Checkpoint& ckpt, const std::string& name, const std::vector<int64_t>& shape,
                float* out) {
  const TensorView& t = ckpt.get(name, shape);
  if (t.dtype == DType::F8_E4M3) {
    // An FP8 checkpoint (config.json quantization_config, see docs/fp8.md): dequantised to fp32 once,
    // here, with the weight's scale tensor.
    const auto stored = [](const TensorView& v) {
      return quant::StoredTensor{v.name, v.file, v.dtype, v.shape, v.data};
    };
    quant::dequantize_stored_weight(
        quant::QuantConfig::cached(ckpt.dir()), stored(t),
        [&](const std::string& scale_name) { return stored(ckpt.get(scale_name)); }, out);
    return;
  }
  tensor_to_f32(t, out);
}

}  // namespace

std::vector<float> load_f32(const Checkpoint& ckpt, const std::string& name, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> out(n);
  widen_into(ckpt, name, shape, out.data());
  return out;
}

void Linear::forward(const float* x, int num_rows, float* out, ThreadPool& pool) const {
  kernels::MatmulParams<float> p;
  p.x = x;
  p.w = weight.data();
  p.bias = bias.empty() ? nullptr : bias.data();
  p.out = out;
  p.m = num_rows;
  p.n = out_features;
  p.k = in_features;
  kernels::launch_matmul(p, pool);
}

Linear load_linear(const Checkpoint& ckpt, const std::vector<std::string>& prefixes,
                   const std::vector<int64_t>& out_features, int64_t in_features, bool with_bias) {
  Linear l;
  l.in_features = static_cast<int>(in_features);
  int64_t total = 0;
  for (int64_t o : out_features) total += o;
  l.out_features = static_cast<int>(total);
  l.weight.resize(total * in_features);
  if (with_bias) l.bias.resize(total);
  int64_t row = 0;
  for (size_t i = 0; i < prefixes.size(); ++i) {
    widen_into(ckpt, prefixes[i] + ".weight", {out_features[i], in_features}, l.weight.data() + row * in_features);
    if (with_bias) widen_into(ckpt, prefixes[i] + ".bias", {out_features[i]}, l.bias.data() + row);
    row += out_features[i];
  }
  return l;
}

FullAttention::FullAttention(const ModelConfig& c, const Checkpoint& ckpt, int layer, const RopeTables& rope)
    : layer_(layer),
      num_q_heads_(static_cast<int>(c.num_attention_heads)),
      num_kv_heads_(static_cast<int>(c.num_key_value_heads)),
      head_dim_(static_cast<int>(c.head_dim)),
      eps_(static_cast<float>(c.rms_norm_eps)),
      rope_(rope) {
  const std::string p = str("model.layers.", layer, ".self_attn.");
  const int64_t q_dim = c.num_attention_heads * c.head_dim, kv_dim = c.num_key_value_heads * c.head_dim;
  qkv_ = load_linear(ckpt, {p + "q_proj", p + "k_proj", p + "v_proj"}, {q_dim, kv_dim, kv_dim}, c.hidden_size,
                     c.attention_bias);
  o_ = load_linear(ckpt, {p + "o_proj"}, {c.hidden_size}, q_dim, c.attention_bias);
  q_norm_ = load_f32(ckpt, p + "q_norm.weight", {c.head_dim});
  k_norm_ = load_f32(ckpt, p + "k_norm.weight", {c.head_dim});
}

void FullAttention::forward(const float* x, const ForwardBatch& b, KvPool& kv, ThreadPool& pool, float* out) {
  const int t = b.num_tokens();
  const KvCacheLayout& layout = kv.layout();
  qkv_out_.resize(static_cast<size_t>(t) * qkv_.out_features);
  q_.resize(static_cast<size_t>(t) * num_q_heads_ * head_dim_);
  attn_.resize(q_.size());
  qkv_.forward(x, t, qkv_out_.data(), pool);

  kernels::QkNormRopeKvWriteParams<float> r;
  r.qkv = qkv_out_.data();
  r.q_norm_weight = q_norm_.data();
  r.k_norm_weight = k_norm_.data();
  r.positions = b.positions.data();
  r.inv_freq = rope_.inv_freq.data();
  r.attention_scaling = rope_.attention_scaling;
  r.slot_mapping = b.slot_mapping.data();
  r.q_out = q_.data();
  r.k_cache = kv.k(layer_);
  r.v_cache = kv.v(layer_);
  r.num_tokens = t;
  r.num_q_heads = num_q_heads_;
  r.num_kv_heads = num_kv_heads_;
  r.head_dim = head_dim_;
  r.block_size = layout.block_size;
  r.eps = eps_;
  kernels::launch_qk_norm_rope_kv_write(r, pool);

  kernels::PagedAttentionParams<float> a;
  a.q = q_.data();
  a.k_cache = kv.k(layer_);
  a.v_cache = kv.v(layer_);
  a.query_starts = b.query_starts.data();
  a.context_lens = b.context_lens.data();
  a.block_tables = b.block_tables.data();
  a.out = attn_.data();
  a.num_seqs = b.num_seqs();
  a.num_tokens = t;
  a.num_q_heads = num_q_heads_;
  a.num_kv_heads = num_kv_heads_;
  a.head_dim = head_dim_;
  a.block_size = layout.block_size;
  a.max_blocks_per_seq = b.max_blocks_per_seq;
  a.scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  kernels::launch_paged_attention(a, pool);

  o_.forward(attn_.data(), t, out, pool);
}

DenseMlp::DenseMlp(const Checkpoint& ckpt, const std::string& prefix, int64_t hidden, int64_t width)
    : gate_up_(load_linear(ckpt, {prefix + ".gate_proj", prefix + ".up_proj"}, {width, width}, hidden, false)),
      down_(load_linear(ckpt, {prefix + ".down_proj"}, {hidden}, width, false)),
      width_(static_cast<int>(width)) {}

void DenseMlp::forward(const float* x, int num_tokens, ThreadPool& pool, float* out) {
  gate_up_out_.resize(static_cast<size_t>(num_tokens) * 2 * width_);
  act_.resize(static_cast<size_t>(num_tokens) * width_);
  gate_up_.forward(x, num_tokens, gate_up_out_.data(), pool);
  kernels::SwigluParams<float> s;
  s.gate_up = gate_up_out_.data();
  s.out = act_.data();
  s.num_rows = num_tokens;
  s.width = width_;
  kernels::launch_swiglu(s, pool);
  down_.forward(act_.data(), num_tokens, out, pool);
}

SparseMoe::SparseMoe(const ModelConfig& c, const Checkpoint& ckpt, const std::string& prefix)
    : hidden_(static_cast<int>(c.hidden_size)),
      num_experts_(static_cast<int>(c.num_experts)),
      top_k_(static_cast<int>(c.num_experts_per_tok)),
      width_(static_cast<int>(c.moe_intermediate_size)),
      renormalize_(c.norm_topk_prob),
      router_(load_linear(ckpt, {prefix + ".gate"}, {c.num_experts}, c.hidden_size, false)) {
  RELAY_CHECK(top_k_ >= 1 && top_k_ <= num_experts_, "num_experts_per_tok ", top_k_, " must be in [1, num_experts ",
              num_experts_, "]");
  const int64_t h = hidden_, w = width_;
  gate_up_.resize(static_cast<size_t>(num_experts_) * 2 * w * h);
  down_.resize(static_cast<size_t>(num_experts_) * h * w);
  for (int e = 0; e < num_experts_; ++e) {
    const std::string ep = str(prefix, ".experts.", e, ".");
    float* gu = gate_up_.data() + static_cast<int64_t>(e) * 2 * w * h;
    widen_into(ckpt, ep + "gate_proj.weight", {w, h}, gu);
    widen_into(ckpt, ep + "up_proj.weight", {w, h}, gu + w * h);
    widen_into(ckpt, ep + "down_proj.weight", {h, w}, down_.data() + static_cast<int64_t>(e) * h * w);
  }
}

void SparseMoe::forward(const float* x, int num_tokens, ThreadPool& pool, float* out) {
  const size_t rows = static_cast<size_t>(num_tokens) * top_k_;
  router_logits_.resize(static_cast<size_t>(num_tokens) * num_experts_);
  topk_ids_.resize(rows);
  topk_weights_.resize(rows);
  permuted_x_.resize(rows * hidden_);
  permuted_index_.resize(rows);
  expert_offsets_.resize(num_experts_ + 1);
  gate_up_out_.resize(rows * 2 * width_);
  act_.resize(rows * width_);
  expert_out_.resize(rows * hidden_);

  router_.forward(x, num_tokens, router_logits_.data(), pool);

  kernels::MoeRouterTopkParams<float> r;
  r.logits = router_logits_.data();
  r.topk_ids = topk_ids_.data();
  r.topk_weights = topk_weights_.data();
  r.num_tokens = num_tokens;
  r.num_experts = num_experts_;
  r.top_k = top_k_;
  r.renormalize = renormalize_;
  kernels::launch_moe_router_topk(r, pool);

  kernels::MoePermuteParams<float> p;
  p.x = x;
  p.topk_ids = topk_ids_.data();
  p.permuted_x = permuted_x_.data();
  p.permuted_index = permuted_index_.data();
  p.expert_offsets = expert_offsets_.data();
  p.num_tokens = num_tokens;
  p.hidden = hidden_;
  p.num_experts = num_experts_;
  p.top_k = top_k_;
  kernels::launch_moe_permute(p, pool);

  kernels::MoeGroupedMatmulParams<float> g;
  g.x = permuted_x_.data();
  g.w = gate_up_.data();
  g.expert_offsets = expert_offsets_.data();
  g.out = gate_up_out_.data();
  g.num_rows = static_cast<int>(rows);
  g.num_experts = num_experts_;
  g.n = 2 * width_;
  g.k = hidden_;
  kernels::launch_moe_grouped_matmul(g, pool);

  kernels::SwigluParams<float> s;
  s.gate_up = gate_up_out_.data();
  s.out = act_.data();
  s.num_rows = static_cast<int>(rows);
  s.width = width_;
  kernels::launch_swiglu(s, pool);

  g.x = act_.data();
  g.w = down_.data();
  g.out = expert_out_.data();
  g.n = hidden_;
  g.k = width_;
  kernels::launch_moe_grouped_matmul(g, pool);

  kernels::MoeUnpermuteCombineParams<float> u;
  u.expert_out = expert_out_.data();
  u.permuted_index = permuted_index_.data();
  u.topk_weights = topk_weights_.data();
  u.out = out;
  u.num_tokens = num_tokens;
  u.hidden = hidden_;
  u.top_k = top_k_;
  kernels::launch_moe_unpermute_combine(u, pool);
}

}  // namespace relay

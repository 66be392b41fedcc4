// See layers.h. Weight names follow the Hugging Face checkpoints (model.layers.N.self_attn.q_proj,
// model.layers.N.mlp.experts.E.gate_proj, ...); fused tensors are built at load by concatenating
// the checkpoint's rows, so the math is unchanged and each step runs one matmul instead of three.
// Row reorderings at load (take_rows) are exact too: they only move whole output rows.
#include "model/layers.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/ops.h"
#include "kvcache/recurrent_state.h"
#include "quant/quant_config.h"
#include "quant/weight_quant.h"

namespace relay {

namespace {

void widen_into(const Checkpoint& ckpt, const std::string& name, const std::vector<int64_t>& shape,
                float* out) {
  const TensorView& t = ckpt.get(name, shape);
  if (t.dtype == DType::F8_E4M3) {
    // An FP8 checkpoint (config.json quantization_config, see docs/fp8.md): dequantised to fp32
    // once, here, with the weight's scale tensor.
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

std::vector<float> load_f32(const Checkpoint& ckpt, const std::string& name,
                            const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> out(n);
  widen_into(ckpt, name, shape, out.data());
  return out;
}

std::vector<float> load_norm(const Checkpoint& ckpt, const std::string& name, int64_t size,
                             bool zero_centered) {
  std::vector<float> w = load_f32(ckpt, name, {size});
  if (zero_centered) {
    for (float& v : w) v = 1.0f + v;
  }
  return w;
}

Linear take_rows(const Linear& src, const std::vector<int64_t>& rows) {
  Linear l;
  l.in_features = src.in_features;
  l.out_features = static_cast<int>(rows.size());
  l.weight.resize(rows.size() * static_cast<size_t>(src.in_features));
  if (!src.bias.empty()) l.bias.resize(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    RELAY_CHECK(rows[i] >= 0 && rows[i] < src.out_features, "take_rows: row ", rows[i],
                " outside [0, ", src.out_features, ")");
    std::copy_n(src.weight.data() + rows[i] * src.in_features, src.in_features,
                l.weight.data() + i * src.in_features);
    if (!src.bias.empty()) l.bias[i] = src.bias[rows[i]];
  }
  return l;
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

namespace {

// Widens rows [rows.begin, +rows.count) x columns [cols.begin, +cols.count) of tensor `name`, whose
// full shape is [num_rows, num_cols], into out (row-major, the slice's width). A full-width slice
// is read in place; a narrower one goes through the whole tensor once (load time only).
void widen_slice_into(const Checkpoint& ckpt, const std::string& name,
                      const std::vector<int64_t>& shape, IndexRange rows, IndexRange cols,
                      float* out) {
  // A 1-D tensor (a bias) is one row.
  const int64_t num_rows = shape.size() == 1 ? 1 : shape[0], num_cols = shape.back();
  if (rows.count < 0) rows.count = num_rows - rows.begin;
  if (cols.count < 0) cols.count = num_cols - cols.begin;
  RELAY_CHECK(rows.begin >= 0 && rows.begin + rows.count <= num_rows && cols.begin >= 0 &&
                  cols.begin + cols.count <= num_cols,
              "tensor ", name, ": shard slice rows [", rows.begin, ", +", rows.count, ") cols [",
              cols.begin, ", +", cols.count, ") outside its shape [", num_rows, ", ", num_cols,
              "]");
  const bool whole =
      rows.begin == 0 && rows.count == num_rows && cols.begin == 0 && cols.count == num_cols;
  if (whole) {
    widen_into(ckpt, name, shape, out);
    return;
  }
  std::vector<float> full(static_cast<size_t>(num_rows * num_cols));
  widen_into(ckpt, name, shape, full.data());
  for (int64_t r = 0; r < rows.count; ++r) {
    std::memcpy(out + r * cols.count, full.data() + (rows.begin + r) * num_cols + cols.begin,
                sizeof(float) * cols.count);
  }
}

}  // namespace

Linear load_linear(const Checkpoint& ckpt, const std::vector<std::string>& prefixes,
                   const std::vector<int64_t>& out_features, int64_t in_features, bool with_bias,
                   const std::vector<IndexRange>& rows, IndexRange cols) {
  RELAY_CHECK(rows.empty() || rows.size() == prefixes.size(), "load_linear: ", rows.size(),
              " row ranges for ", prefixes.size(), " tensors");
  auto rows_of = [&](size_t i) {
    IndexRange r = rows.empty() ? IndexRange{} : rows[i];
    if (r.count < 0) r.count = out_features[i] - r.begin;
    return r;
  };
  Linear l;
  const int64_t in_local = cols.count < 0 ? in_features - cols.begin : cols.count;
  l.in_features = static_cast<int>(in_local);
  int64_t total = 0;
  for (size_t i = 0; i < prefixes.size(); ++i) total += rows_of(i).count;
  l.out_features = static_cast<int>(total);
  l.weight.resize(total * in_local);
  if (with_bias) l.bias.resize(total);
  int64_t row = 0;
  for (size_t i = 0; i < prefixes.size(); ++i) {
    const IndexRange r = rows_of(i);
    widen_slice_into(ckpt, prefixes[i] + ".weight", {out_features[i], in_features}, r, cols,
                     l.weight.data() + row * in_local);
    if (with_bias)
      widen_slice_into(ckpt, prefixes[i] + ".bias", {out_features[i]}, {}, r, l.bias.data() + row);
    row += r.count;
  }
  return l;
}

FullAttention::FullAttention(const ModelConfig& c, const Checkpoint& ckpt,
                             const std::string& prefix, int kv_layer, const RopeTables& rope,
                             const ShardSpec& shard)
    : kv_layer_(kv_layer),
      num_q_heads_(shard.num_local_q_heads),
      num_kv_heads_(shard.num_local_kv_heads),
      head_dim_(static_cast<int>(c.head_dim)),
      rotary_dim_(static_cast<int>(c.rotary_dim())),
      gated_(c.attn_output_gate),
      tp_comm_(shard.tp_comm),
      eps_(static_cast<float>(c.rms_norm_eps)),
      rope_(rope) {
  const std::string p = prefix + ".";
  const int64_t hd = c.head_dim;
  const int64_t q_dim = c.num_attention_heads * hd, kv_dim = c.num_key_value_heads * hd;
  const IndexRange q_rows{shard.q_head_begin * hd, num_q_heads_ * hd};
  const IndexRange kv_rows{shard.kv_head_begin * hd, num_kv_heads_ * hd};
  if (!gated_) {
    qkv_ = load_linear(ckpt, {p + "q_proj", p + "k_proj", p + "v_proj"}, {q_dim, kv_dim, kv_dim},
                       c.hidden_size, c.attention_bias, {q_rows, kv_rows, kv_rows});
  } else {
    // q_proj holds 2 * head_dim rows per head, [query | gate]: load this rank's heads with k and
    // v, then keep the query rows (and k, v) as qkv_ and the gate rows as gate_.
    const Linear all =
        load_linear(ckpt, {p + "q_proj", p + "k_proj", p + "v_proj"}, {2 * q_dim, kv_dim, kv_dim},
                    c.hidden_size, c.attention_bias,
                    {IndexRange{2 * q_rows.begin, 2 * q_rows.count}, kv_rows, kv_rows});
    std::vector<int64_t> qkv_rows, gate_rows;
    for (int64_t h = 0; h < num_q_heads_; ++h) {
      for (int64_t i = 0; i < hd; ++i) {
        qkv_rows.push_back(2 * h * hd + i);
        gate_rows.push_back(2 * h * hd + hd + i);
      }
    }
    for (int64_t r = 2 * q_rows.count; r < all.out_features; ++r) qkv_rows.push_back(r);
    qkv_ = take_rows(all, qkv_rows);
    gate_ = take_rows(all, gate_rows);
  }
  // Row-parallel: this rank's q-head columns; the bias joins the sum once, from TP rank 0.
  o_ = load_linear(ckpt, {p + "o_proj"}, {c.hidden_size}, q_dim,
                   c.attention_bias && shard.tp_rank == 0, {}, q_rows);
  q_norm_ = load_norm(ckpt, p + "q_norm.weight", hd, c.zero_centered_norms);
  k_norm_ = load_norm(ckpt, p + "k_norm.weight", hd, c.zero_centered_norms);
}

void FullAttention::forward(const float* x, const ForwardBatch& b, KvPool& kv, ThreadPool& pool,
                            float* out) {
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
  r.k_cache = kv.k(kv_layer_);
  r.v_cache = kv.v(kv_layer_);
  r.num_tokens = t;
  r.num_q_heads = num_q_heads_;
  r.num_kv_heads = num_kv_heads_;
  r.head_dim = head_dim_;
  r.block_size = layout.block_size;
  r.eps = eps_;
  r.rotary_dim = rotary_dim_;
  kernels::launch_qk_norm_rope_kv_write(r, pool);

  kernels::PagedAttentionParams<float> a;
  a.q = q_.data();
  a.k_cache = kv.k(kv_layer_);
  a.v_cache = kv.v(kv_layer_);
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

  if (gated_) {
    gate_out_.resize(attn_.size());
    gate_.forward(x, t, gate_out_.data(), pool);
    const int width = num_q_heads_ * head_dim_;
    kernels::launch_sigmoid_gate({attn_.data(), gate_out_.data(), attn_.data(), t, width, width},
                                 pool);
  }
  o_.forward(attn_.data(), t, out, pool);
  if (tp_comm_ != nullptr) tp_comm_->all_reduce_sum(out, static_cast<size_t>(t) * o_.out_features);
}

namespace {

// The rank's input projection of a Gated DeltaNet layer (decoder_plan.h, InProjPlan): the stored
// tensors stacked, then its rows.
Linear load_in_proj(const ModelConfig& c, const Checkpoint& ckpt, const InProjPlan& plan) {
  Linear stack;
  stack.in_features = static_cast<int>(c.hidden_size);
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const std::vector<float> w = load_f32(ckpt, plan.tensors[i], {plan.tensor_rows[i], c.hidden_size});
    stack.weight.insert(stack.weight.end(), w.begin(), w.end());
    stack.out_features += static_cast<int>(plan.tensor_rows[i]);
  }
  return take_rows(stack, plan.rows);
}

}  // namespace

GatedDeltaNet::GatedDeltaNet(const ModelConfig& c, const Checkpoint& ckpt, const LayerPlan& layer,
                             int state_layer, const ShardSpec& shard)
    : state_layer_(state_layer),
      num_k_heads_(shard.num_local_k_heads),
      num_v_heads_(shard.num_local_v_heads),
      key_dim_(static_cast<int>(c.linear_key_head_dim)),
      value_dim_(static_cast<int>(c.linear_value_head_dim)),
      kernel_size_(static_cast<int>(c.linear_conv_kernel_dim)),
      eps_(static_cast<float>(c.rms_norm_eps)),
      tp_comm_(shard.tp_comm) {
  const std::string p = layer.linear_attention() + ".";
  const int64_t full_conv = c.linear_conv_dim(), full_v = c.linear_value_dim();
  const int64_t heads = c.linear_num_value_heads;
  // This rank's rows of [q | k | v | z | b | a] and channels of the convolution (q | k | v): its
  // key heads' q and k, its value heads' v, z, b and a (all of them on one rank).
  const int64_t dv = value_dim_, vb = shard.v_head_begin;
  in_proj_ = load_in_proj(c, ckpt, plan_in_proj(c, layer, ckpt, shard));
  const std::vector<int64_t> channels = linear_attention_channels(c, shard);
  // Row-parallel: this rank's value-head columns, summed over the TP group after.
  out_proj_ = load_linear(ckpt, {p + "out_proj"}, {c.hidden_size}, full_v, false, {},
                          IndexRange{vb * dv, num_v_heads_ * dv});
  const std::vector<float> conv =
      load_f32(ckpt, linear_weight(layer.linear_attention(), "conv1d"), {full_conv, 1, kernel_size_});
  for (int64_t ch : channels) {
    conv_weight_.insert(conv_weight_.end(), conv.begin() + ch * kernel_size_,
                        conv.begin() + (ch + 1) * kernel_size_);
  }
  const std::vector<float> a_log =
      load_f32(ckpt, block_tensor(layer.linear_attention(), "A_log"), {heads});
  const std::vector<float> dt_bias =
      load_f32(ckpt, block_tensor(layer.linear_attention(), "dt_bias"), {heads});
  a_log_.assign(a_log.begin() + vb, a_log.begin() + vb + num_v_heads_);
  dt_bias_.assign(dt_bias.begin() + vb, dt_bias.begin() + vb + num_v_heads_);
  norm_weight_ = load_f32(ckpt, p + "norm.weight", {c.linear_value_head_dim});
}

void GatedDeltaNet::forward(const float* x, const ForwardBatch& b, KvPool& /*kv*/, ThreadPool& pool,
                            float* out) {
  const int t = b.num_tokens();
  const int64_t width = in_proj_.out_features;
  const int v_dim = num_v_heads_ * value_dim_;
  proj_.resize(static_cast<size_t>(t) * width);
  core_.resize(static_cast<size_t>(t) * v_dim);
  in_proj_.forward(x, t, proj_.data(), pool);
  RecurrentStatePool& state = *b.recurrent_state;
  kernels::GatedDeltaNetStepParams<float> p;
  p.proj = proj_.data();
  p.proj_stride = width;
  p.conv_weight = conv_weight_.data();
  p.a_log = a_log_.data();
  p.dt_bias = dt_bias_.data();
  p.norm_weight = norm_weight_.data();
  p.conv_states = state.conv(state_layer_);
  p.states = state.ssm(state_layer_);
  p.state_stride = state.layout().slot_stride();
  p.query_starts = b.query_starts.data();
  p.state_slots = b.state_slots.data();
  p.state_fresh = b.state_fresh.data();
  p.snapshot_slots = b.state_snapshot_slots.empty() ? nullptr : b.state_snapshot_slots.data();
  p.out = core_.data();
  p.num_seqs = b.num_seqs();
  p.num_tokens = t;
  p.num_k_heads = num_k_heads_;
  p.num_v_heads = num_v_heads_;
  p.key_dim = key_dim_;
  p.value_dim = value_dim_;
  p.kernel_size = kernel_size_;
  p.eps = eps_;
  kernels::launch_gated_delta_net_step(p, pool);
  out_proj_.forward(core_.data(), t, out, pool);
  if (tp_comm_ != nullptr)
    tp_comm_->all_reduce_sum(out, static_cast<size_t>(t) * out_proj_.out_features);
}

DenseMlp::DenseMlp(const Checkpoint& ckpt, const std::string& prefix, int64_t hidden, int64_t width,
                   IndexRange slice, parallel::Communicator* reduce)
    : width_(static_cast<int>(slice.count < 0 ? width : slice.count)), tp_comm_(reduce) {
  gate_up_ = load_linear(ckpt, {prefix + ".gate_proj", prefix + ".up_proj"}, {width, width}, hidden,
                         false, {slice, slice});
  down_ = load_linear(ckpt, {prefix + ".down_proj"}, {hidden}, width, false, {}, slice);
}

void DenseMlp::forward(const float* x, int num_tokens, ThreadPool& pool, float* out) {
  if (num_tokens == 0) return;
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
  if (tp_comm_ != nullptr)
    tp_comm_->all_reduce_sum(out, static_cast<size_t>(num_tokens) * down_.out_features);
}

std::unique_ptr<TokenMixer> make_token_mixer(const ModelConfig& c, const Checkpoint& ckpt,
                                             const LayerPlan& layer, const RopeTables& rope,
                                             const ShardSpec& shard) {
  if (layer.mixer == MixerKind::kGatedDeltaNet) {
    return std::make_unique<GatedDeltaNet>(c, ckpt, layer, c.recurrent_layer(layer.index), shard);
  }
  return std::make_unique<FullAttention>(c, ckpt, layer.attention(), c.kv_cache_layer(layer.index),
                                         rope, shard);
}

IndexRange dense_mlp_slice(const ShardSpec& shard) {
  return shard.tp_size == 1 ? IndexRange{}
                            : IndexRange{shard.mlp_width_begin, shard.num_local_mlp_width};
}

std::unique_ptr<FeedForward> make_feed_forward(const ModelConfig& c, const Checkpoint& ckpt,
                                               const LayerPlan& layer, const ShardSpec& shard) {
  switch (layer.ffn) {
    case FfnKind::kMoe:
    case FfnKind::kMoeWithSharedExpert:  // SparseMoe loads the shared expert the config has
      return std::make_unique<SparseMoe>(c, ckpt, layer.mlp(), shard);
    case FfnKind::kDenseMlp:
      return std::make_unique<DenseMlp>(ckpt, layer.mlp(), c.hidden_size, c.intermediate_size,
                                        dense_mlp_slice(shard), shard.tp_comm);
  }
  fail(str("layer ", layer.index, " has an unknown feed-forward kind"));
}

SparseMoe::SparseMoe(const ModelConfig& c, const Checkpoint& ckpt, const std::string& prefix,
                     const ShardSpec& shard)
    : hidden_(static_cast<int>(c.hidden_size)),
      num_experts_(static_cast<int>(c.num_experts)),
      top_k_(static_cast<int>(c.num_experts_per_tok)),
      width_(shard.num_local_moe_width),
      renormalize_(c.norm_topk_prob),
      expert_begin_(shard.expert_begin),
      num_local_experts_(shard.num_local_experts),
      dispatch_tokens_(shard.dispatch_tokens),
      reduce_comm_(shard.dispatch_tokens ? nullptr
                                         : (shard.ep_size > 1 ? shard.ep_comm : shard.tp_comm)),
      ep_comm_(shard.ep_comm),
      router_(load_linear(ckpt, {prefix + ".gate"}, {c.num_experts}, c.hidden_size, false)) {
  RELAY_CHECK(top_k_ >= 1 && top_k_ <= num_experts_, "num_experts_per_tok ", top_k_,
              " must be in [1, num_experts ", num_experts_, "]");
  const int64_t h = hidden_, w = width_, full_w = c.moe_intermediate_size;
  const IndexRange slice{shard.moe_width_begin, w};
  const std::string fused_gate_up = fused_experts_weight(prefix, "gate_up_proj");
  if (ckpt.has(fused_gate_up)) {
    // Fused 3-D tensors: read whole, then keep this rank's experts and width slice (gate rows
    // [b, b + w) and up rows [full_w + b, ...) of gate_up; down's columns [b, b + w)).
    const std::vector<float> all_gate_up =
        load_f32(ckpt, fused_gate_up, {num_experts_, 2 * full_w, h});
    const std::vector<float> all_down =
        load_f32(ckpt, fused_experts_weight(prefix, "down_proj"), {num_experts_, h, full_w});
    gate_up_.resize(static_cast<size_t>(num_local_experts_) * 2 * w * h);
    down_.resize(static_cast<size_t>(num_local_experts_) * h * w);
    const int64_t b = shard.moe_width_begin;
    for (int64_t e = 0; e < num_local_experts_; ++e) {
      const float* gu = all_gate_up.data() + (expert_begin_ + e) * 2 * full_w * h;
      float* to = gate_up_.data() + e * 2 * w * h;
      std::copy(gu + b * h, gu + (b + w) * h, to);
      std::copy(gu + (full_w + b) * h, gu + (full_w + b + w) * h, to + w * h);
      const float* dn = all_down.data() + (expert_begin_ + e) * h * full_w;
      for (int64_t r = 0; r < h; ++r) {
        std::copy(dn + r * full_w + b, dn + r * full_w + b + w, down_.data() + (e * h + r) * w);
      }
    }
  } else {
    gate_up_.resize(static_cast<size_t>(num_local_experts_) * 2 * w * h);
    down_.resize(static_cast<size_t>(num_local_experts_) * h * w);
    for (int e = 0; e < num_local_experts_; ++e) {
      const std::string ep = str(prefix, ".experts.", expert_begin_ + e, ".");
      float* gu = gate_up_.data() + static_cast<int64_t>(e) * 2 * w * h;
      widen_slice_into(ckpt, ep + "gate_proj.weight", {full_w, h}, slice, {}, gu);
      widen_slice_into(ckpt, ep + "up_proj.weight", {full_w, h}, slice, {}, gu + w * h);
      widen_slice_into(ckpt, ep + "down_proj.weight", {h, full_w}, {}, slice,
                       down_.data() + static_cast<int64_t>(e) * h * w);
    }
  }
  if (c.shared_expert_intermediate_size > 0) {
    // Sliced (shard.h) its partial output joins the routed partial sums before they are reduced.
    const bool sliced = shard.num_local_shared_width != c.shared_expert_intermediate_size;
    RELAY_CHECK(!sliced || (reduce_comm_ != nullptr && !dispatch_tokens_), prefix,
                ".shared_expert: a slice of its width needs the MoE's partial sums reduced");
    shared_expert_ = std::make_unique<DenseMlp>(
        ckpt, prefix + ".shared_expert", c.hidden_size, c.shared_expert_intermediate_size,
        sliced ? IndexRange{shard.shared_width_begin, shard.num_local_shared_width} : IndexRange{},
        nullptr);
    shared_partial_ = sliced;
    shared_expert_gate_ =
        load_linear(ckpt, {prefix + ".shared_expert_gate"}, {1}, c.hidden_size, false);
  }
}

void SparseMoe::forward(const float* x, int num_tokens, ThreadPool& pool, float* out) {
  if (dispatch_tokens_) {
    dispatch_combine(x, num_tokens, pool, out);
    if (shared_expert_ != nullptr && num_tokens > 0) add_shared_expert(x, num_tokens, pool, out);
    return;
  }
  const size_t rows = static_cast<size_t>(num_tokens) * top_k_;
  router_logits_.resize(static_cast<size_t>(num_tokens) * num_experts_);
  topk_ids_.resize(rows);
  topk_weights_.resize(rows);
  route(x, num_tokens, pool);
  // Experts held elsewhere become the absent id (num_local_experts_): weight 0, never computed.
  kernels::launch_moe_localize_experts({topk_ids_.data(), topk_weights_.data(),
                                        static_cast<int>(rows), expert_begin_, num_local_experts_},
                                       pool);
  run_local_experts(x, topk_ids_.data(), topk_weights_.data(), num_tokens, pool, out);
  // A sliced shared expert adds its partial output before the reduction sums the ranks'; a whole
  // one adds after it, once.
  if (shared_expert_ != nullptr && shared_partial_ && num_tokens > 0)
    add_shared_expert(x, num_tokens, pool, out);
  if (reduce_comm_ != nullptr)
    reduce_comm_->all_reduce_sum(out, static_cast<size_t>(num_tokens) * hidden_);
  if (shared_expert_ != nullptr && !shared_partial_ && num_tokens > 0)
    add_shared_expert(x, num_tokens, pool, out);
}

void SparseMoe::add_shared_expert(const float* x, int num_tokens, ThreadPool& pool, float* out) {
  // out += sigmoid(shared_expert_gate(x)) * shared_expert(x): transformers adds the same two
  // terms (routed + gated shared), and a sum of two does not depend on their order.
  shared_out_.resize(static_cast<size_t>(num_tokens) * hidden_);
  shared_gate_out_.resize(num_tokens);
  shared_expert_->forward(x, num_tokens, pool, shared_out_.data());
  shared_expert_gate_.forward(x, num_tokens, shared_gate_out_.data(), pool);
  kernels::SigmoidGateParams<float> g;
  g.x = shared_out_.data();
  g.gate = shared_gate_out_.data();
  g.out = out;
  g.num_rows = num_tokens;
  g.width = hidden_;
  g.gate_width = 1;
  g.accumulate = true;
  kernels::launch_sigmoid_gate(g, pool);
}

void SparseMoe::route(const float* x, int num_tokens, ThreadPool& pool) {
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
}

void SparseMoe::run_local_experts(const float* x, const int32_t* ids, const float* weights,
                                  int num_tokens, ThreadPool& pool, float* out) {
  if (num_tokens == 0) return;
  const size_t rows = static_cast<size_t>(num_tokens) * top_k_;
  permuted_x_.resize(rows * hidden_);
  permuted_index_.resize(rows);
  expert_offsets_.resize(num_local_experts_ + 2);
  gate_up_out_.resize(rows * 2 * width_);
  act_.resize(rows * width_);
  expert_out_.resize(rows * hidden_);

  kernels::MoePermuteParams<float> p;
  p.x = x;
  p.topk_ids = ids;
  p.permuted_x = permuted_x_.data();
  p.permuted_index = permuted_index_.data();
  p.expert_offsets = expert_offsets_.data();
  p.num_tokens = num_tokens;
  p.hidden = hidden_;
  p.num_experts = num_local_experts_ + 1;  // + the absent expert, whose rows sort last
  p.top_k = top_k_;
  kernels::launch_moe_permute(p, pool);
  const int computed = expert_offsets_[num_local_experts_];  // rows of experts held here

  kernels::MoeGroupedMatmulParams<float> g;
  g.x = permuted_x_.data();
  g.w = gate_up_.data();
  g.expert_offsets = expert_offsets_.data();
  g.out = gate_up_out_.data();
  g.num_rows = computed;
  g.num_experts = num_local_experts_;
  g.n = 2 * width_;
  g.k = hidden_;
  kernels::launch_moe_grouped_matmul(g, pool);

  kernels::SwigluParams<float> s;
  s.gate_up = gate_up_out_.data();
  s.out = act_.data();
  s.num_rows = computed;
  s.width = width_;
  kernels::launch_swiglu(s, pool);

  g.x = act_.data();
  g.w = down_.data();
  g.out = expert_out_.data();
  g.n = hidden_;
  g.k = width_;
  kernels::launch_moe_grouped_matmul(g, pool);
  // The absent rows (past `computed`) are never written: the combine skips their weight-0 terms.

  kernels::MoeUnpermuteCombineParams<float> u;
  u.expert_out = expert_out_.data();
  u.permuted_index = permuted_index_.data();
  u.topk_weights = weights;
  u.out = out;
  u.num_tokens = num_tokens;
  u.hidden = hidden_;
  u.top_k = top_k_;
  kernels::launch_moe_unpermute_combine(u, pool);
}

void SparseMoe::dispatch_combine(const float* x, int num_tokens, ThreadPool& pool, float* out) {
  const int num_ranks = ep_comm_->size();
  const size_t rows = static_cast<size_t>(num_tokens) * top_k_;
  router_logits_.resize(static_cast<size_t>(num_tokens) * num_experts_);
  topk_ids_.resize(rows);
  topk_weights_.resize(rows);
  if (num_tokens > 0) route(x, num_tokens, pool);

  // Dispatch: token t goes to rank d when any of its experts lives there, as its hidden row
  // followed by its top_k weights (0 for experts elsewhere), with its top_k expert ids local to d
  // (absent = num_local_experts_). Every rank holds the same number of experts.
  send_rows_.assign(num_ranks, {});
  send_ids_.assign(num_ranks, {});
  std::vector<std::vector<int32_t>> sent_tokens(
      num_ranks);  // which of our tokens went to each rank
  for (int t = 0; t < num_tokens; ++t) {
    const int32_t* ids = topk_ids_.data() + static_cast<size_t>(t) * top_k_;
    const float* w = topk_weights_.data() + static_cast<size_t>(t) * top_k_;
    for (int d = 0; d < num_ranks; ++d) {
      const int first = d * num_local_experts_;
      bool any = false;
      for (int k = 0; k < top_k_; ++k)
        any = any || (ids[k] >= first && ids[k] < first + num_local_experts_);
      if (!any) continue;
      sent_tokens[d].push_back(t);
      std::vector<float>& row = send_rows_[d];
      row.insert(row.end(), x + static_cast<size_t>(t) * hidden_,
                 x + static_cast<size_t>(t + 1) * hidden_);
      for (int k = 0; k < top_k_; ++k) {
        const bool there = ids[k] >= first && ids[k] < first + num_local_experts_;
        row.push_back(there ? w[k] : 0.0f);
        send_ids_[d].push_back(there ? ids[k] - first : num_local_experts_);
      }
    }
  }
  ep_comm_->all_to_all(std::span<const std::vector<float>>(send_rows_), recv_rows_);
  ep_comm_->all_to_all(std::span<const std::vector<int32_t>>(send_ids_), recv_ids_);

  // Compute every received token's weighted sum over our experts, in one batch.
  const size_t stride = static_cast<size_t>(hidden_) + top_k_;
  size_t num_recv = 0;
  for (const auto& ids : recv_ids_) num_recv += ids.size() / top_k_;
  recv_x_.resize(num_recv * hidden_);
  recv_weights_.resize(num_recv * top_k_);
  local_ids_.resize(num_recv * top_k_);
  size_t at = 0;
  for (int s = 0; s < num_ranks; ++s) {
    const size_t n = recv_ids_[s].size() / top_k_;
    RELAY_CHECK(recv_rows_[s].size() == n * stride, "MoE dispatch: rank ", s, " sent ",
                recv_rows_[s].size(), " values for ", n, " tokens");
    for (size_t i = 0; i < n; ++i, ++at) {
      const float* src = recv_rows_[s].data() + i * stride;
      std::copy(src, src + hidden_, recv_x_.data() + at * hidden_);
      std::copy(src + hidden_, src + stride, recv_weights_.data() + at * top_k_);
    }
    std::copy(recv_ids_[s].begin(), recv_ids_[s].end(), local_ids_.begin() + (at - n) * top_k_);
  }
  recv_out_.resize(num_recv * hidden_);
  run_local_experts(recv_x_.data(), local_ids_.data(), recv_weights_.data(),
                    static_cast<int>(num_recv), pool, recv_out_.data());

  // Combine: send each source its tokens' partial sums, in the order they came; add them up in
  // rank order.
  at = 0;
  for (int s = 0; s < num_ranks; ++s) {
    const size_t n = recv_ids_[s].size() / top_k_;
    send_rows_[s].assign(recv_out_.begin() + at * hidden_, recv_out_.begin() + (at + n) * hidden_);
    send_ids_[s].clear();
    at += n;
  }
  ep_comm_->all_to_all(std::span<const std::vector<float>>(send_rows_), recv_rows_);
  std::fill(out, out + static_cast<size_t>(num_tokens) * hidden_, 0.0f);
  for (int d = 0; d < num_ranks; ++d) {
    RELAY_CHECK(recv_rows_[d].size() == sent_tokens[d].size() * hidden_, "MoE combine: rank ", d,
                " returned ", recv_rows_[d].size(), " values for ", sent_tokens[d].size(),
                " tokens");
    for (size_t i = 0; i < sent_tokens[d].size(); ++i) {
      const float* src = recv_rows_[d].data() + i * hidden_;
      float* dst = out + static_cast<size_t>(sent_tokens[d][i]) * hidden_;
      for (int j = 0; j < hidden_; ++j) dst[j] += src[j];
    }
  }
}

}  // namespace relay

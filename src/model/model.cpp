// See model.h. The residual stream follows vLLM's fused form: each norm first adds the previous
// block's output into the residual, then normalises it — the same sums HF computes as
// "h = residual + sublayer(x)", in the same order.
#include "model/model.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/ops.h"

namespace relay {

Model::Model(ModelConfig config, ShardSpec shard, std::vector<float> embedding,
             std::vector<DecoderLayer> layers, std::vector<float> final_norm, LmHeadWeights lm_head)
    : config_(std::move(config)),
      shard_(shard),
      embedding_(std::move(embedding)),
      layers_(std::move(layers)),
      final_norm_(std::move(final_norm)),
      lm_head_(std::move(lm_head)) {}

void Model::set_mtp_head(MtpHead head) { mtp_ = std::move(head); }

KvCacheLayout Model::kv_layout(int block_size, int num_blocks) const {
  return KvCacheLayout{.num_layers = num_kv_layers(),
                       .num_blocks = num_blocks,
                       .num_kv_heads = shard_.num_local_kv_heads,
                       .block_size = block_size,
                       .head_dim = static_cast<int>(config_.head_dim),
                       .element_bytes = sizeof(float)};
}

KvCacheLayout Model::kv_layout_for_budget(int block_size, size_t bytes) const {
  return KvCacheLayout::from_budget(num_kv_layers(), shard_.num_local_kv_heads,
                                    static_cast<int>(config_.head_dim), block_size, sizeof(float),
                                    bytes);
}

RecurrentStateLayout recurrent_state_layout(const ModelConfig& c, const ShardSpec& shard,
                                            int num_slots) {
  RELAY_CHECK(c.has_linear_attention(), c.architecture,
              " has no linear-attention layers, so no recurrent state");
  // A TP rank's slot holds its heads' states and channels only (model/shard.h).
  RecurrentStateLayout l;
  l.num_layers = c.num_recurrent_layers();
  l.num_slots = num_slots;
  l.conv_dim = static_cast<int>(2 * shard.num_local_k_heads * c.linear_key_head_dim +
                                shard.num_local_v_heads * c.linear_value_head_dim);
  l.conv_width = static_cast<int>(c.linear_conv_kernel_dim - 1);
  l.num_heads = shard.num_local_v_heads;
  l.key_dim = static_cast<int>(c.linear_key_head_dim);
  l.value_dim = static_cast<int>(c.linear_value_head_dim);
  l.element_bytes = sizeof(float);
  return l;
}

RecurrentStateLayout Model::recurrent_state_layout(int num_slots) const {
  return relay::recurrent_state_layout(config_, shard_, num_slots);
}

void Model::check_recurrent_state(const ForwardBatch& b) const {
  const int s = b.num_seqs();
  RELAY_CHECK(b.recurrent_state != nullptr, "forward batch: ", config_.architecture, " has ",
              config_.num_recurrent_layers(),
              " linear-attention layers but the batch carries no recurrent-state pool");
  const RecurrentStateLayout& l = b.recurrent_state->layout();
  const RecurrentStateLayout want = recurrent_state_layout(l.num_slots);
  RELAY_CHECK(l.num_layers == want.num_layers && l.conv_dim == want.conv_dim &&
                  l.conv_width == want.conv_width && l.num_heads == want.num_heads &&
                  l.key_dim == want.key_dim && l.value_dim == want.value_dim,
              "recurrent-state pool shape (layers ", l.num_layers, ", conv ", l.conv_dim, " x ",
              l.conv_width, ", heads ", l.num_heads, " x ", l.key_dim, " x ", l.value_dim,
              ") does not match the model (layers ", want.num_layers, ", conv ", want.conv_dim,
              " x ", want.conv_width, ", heads ", want.num_heads, " x ", want.key_dim, " x ",
              want.value_dim, ")");
  RELAY_CHECK(b.state_slots.size() == static_cast<size_t>(s) &&
                  b.state_fresh.size() == static_cast<size_t>(s),
              "forward batch: ", s, " sequences but ", b.state_slots.size(), " state slots and ",
              b.state_fresh.size(), " fresh flags");
  std::vector<bool> taken(l.num_slots, false);
  for (int i = 0; i < s; ++i) {
    const int32_t slot = b.state_slots[i];
    RELAY_CHECK(slot >= 0 && slot < l.num_slots, "forward batch: sequence ", i, " has state slot ",
                slot, ", the pool has ", l.num_slots);
    RELAY_CHECK(!taken[slot], "forward batch: state slot ", slot,
                " is given to two sequences of one batch");
    taken[slot] = true;
    // A recurrent state cannot be rebuilt from the KV cache: a sequence that starts from zero
    // must bring its whole context in this step.
    const int n = b.query_starts[i + 1] - b.query_starts[i];
    RELAY_CHECK(!b.state_fresh[i] || b.context_lens[i] == n, "forward batch: sequence ", i,
                " starts a fresh recurrent state but has ", b.context_lens[i] - n,
                " earlier tokens in the KV cache");
  }
  if (b.state_snapshot_slots.empty()) return;
  RELAY_CHECK(b.state_snapshot_slots.size() == static_cast<size_t>(b.num_tokens()),
              "forward batch: ", b.num_tokens(), " tokens but ", b.state_snapshot_slots.size(),
              " state snapshot slots");
  for (int t = 0; t < b.num_tokens(); ++t) {
    const int32_t slot = b.state_snapshot_slots[t];
    if (slot < 0) continue;
    RELAY_CHECK(slot < l.num_slots, "forward batch: row ", t, " has state snapshot slot ", slot,
                ", the pool has ", l.num_slots);
    RELAY_CHECK(!taken[slot], "forward batch: state snapshot slot ", slot,
                " is a sequence's state or another row's snapshot");
    taken[slot] = true;
  }
}

void Model::check_batch(const ForwardBatch& b, const KvPool& kv, bool recurrent_state) const {
  const KvCacheLayout& l = kv.layout();
  const int t = b.num_tokens(), s = b.num_seqs();
  RELAY_CHECK(l.num_layers == num_kv_layers() && l.num_kv_heads == shard_.num_local_kv_heads &&
                  l.head_dim == config_.head_dim,
              "KV pool shape (layers ", l.num_layers, ", kv heads ", l.num_kv_heads, ", head_dim ",
              l.head_dim, ") does not match the model");
  RELAY_CHECK(t > 0, "forward batch has no tokens");
  RELAY_CHECK(b.positions.size() == static_cast<size_t>(t) &&
                  b.slot_mapping.size() == static_cast<size_t>(t),
              "forward batch: ", t, " tokens but ", b.positions.size(), " positions and ",
              b.slot_mapping.size(), " slots");
  RELAY_CHECK(b.query_starts.size() == static_cast<size_t>(s) + 1 && b.query_starts[0] == 0 &&
                  b.query_starts[s] == t,
              "forward batch: query_starts must have num_seqs + 1 entries from 0 to num_tokens ",
              t);
  RELAY_CHECK(b.max_blocks_per_seq > 0 &&
                  b.block_tables.size() == static_cast<size_t>(s) * b.max_blocks_per_seq,
              "forward batch: block_tables has ", b.block_tables.size(), " entries, expected ", s,
              " x ", b.max_blocks_per_seq);
  for (int i = 0; i < s; ++i) {
    const int n = b.query_starts[i + 1] - b.query_starts[i];
    const int ctx = b.context_lens[i];
    RELAY_CHECK(n >= 1 && ctx >= n, "forward batch: sequence ", i, " has ", n,
                " new tokens and context length ", ctx);
    const int blocks = (ctx + l.block_size - 1) / l.block_size;
    RELAY_CHECK(blocks <= b.max_blocks_per_seq, "forward batch: sequence ", i, " needs ", blocks,
                " blocks, its table has ", b.max_blocks_per_seq);
    for (int j = 0; j < blocks; ++j) {
      const int32_t id = b.block_tables[static_cast<size_t>(i) * b.max_blocks_per_seq + j];
      RELAY_CHECK(id >= 0 && id < l.num_blocks, "forward batch: sequence ", i, " block ", j, " is ",
                  id, ", pool has ", l.num_blocks);
    }
  }
  const int64_t num_slots = static_cast<int64_t>(l.num_blocks) * l.block_size;
  for (int i = 0; i < t; ++i) {
    RELAY_CHECK(b.token_ids[i] >= 0 && b.token_ids[i] < config_.vocab_size, "token id ",
                b.token_ids[i], " out of the vocabulary [0, ", config_.vocab_size, ")");
    RELAY_CHECK(b.slot_mapping[i] >= -1 && b.slot_mapping[i] < num_slots, "slot ",
                b.slot_mapping[i], " of token ", i, " out of [-1, ", num_slots, ")");
    RELAY_CHECK(b.positions[i] >= 0, "negative position ", b.positions[i], " for token ", i);
  }
  for (int32_t r : b.logit_rows)
    RELAY_CHECK(r >= 0 && r < t, "logit row ", r, " out of [0, ", t, ")");
  if (recurrent_state && config_.has_linear_attention()) check_recurrent_state(b);
}

void Model::forward(const ForwardBatch& b, KvPool& kv, ThreadPool& pool,
                    std::vector<float>& logits) {
  check_batch(b, kv, true);
  const int t = b.num_tokens();
  const size_t n = static_cast<size_t>(t) * config_.hidden_size;
  hidden_.resize(n);
  normed_.resize(n);
  residual_.assign(n, 0.0f);
  embed(b, pool);
  kernels::RmsNormParams<float> norm = residual_norm(t);
  for (DecoderLayer& layer : layers_) run_layer(layer, b, kv, pool, norm);
  norm.weight = final_norm_.data();
  kernels::launch_rms_norm(norm, pool);
  compute_logits(b.logit_rows, pool, logits);
}

void Model::embed(const ForwardBatch& b, ThreadPool& pool) {
  kernels::EmbeddingParams<float> e;
  e.token_ids = b.token_ids.data();
  e.table = embedding_.data();
  e.out = hidden_.data();
  e.num_tokens = b.num_tokens();
  e.hidden = static_cast<int>(config_.hidden_size);
  e.vocab_size = vocab_size();
  kernels::launch_embedding(e, pool);
}

kernels::RmsNormParams<float> Model::residual_norm(int num_tokens) {
  kernels::RmsNormParams<float> norm;
  norm.x = hidden_.data();
  norm.residual = residual_.data();
  norm.out = normed_.data();
  norm.num_tokens = num_tokens;
  norm.hidden = static_cast<int>(config_.hidden_size);
  norm.eps = static_cast<float>(config_.rms_norm_eps);
  return norm;
}

void Model::run_layer(DecoderLayer& layer, const ForwardBatch& b, KvPool& kv, ThreadPool& pool,
                      kernels::RmsNormParams<float>& norm) {
  norm.weight = layer.input_norm.data();
  kernels::launch_rms_norm(norm, pool);
  layer.mixer->forward(normed_.data(), b, kv, pool, hidden_.data());
  norm.weight = layer.post_attention_norm.data();
  kernels::launch_rms_norm(norm, pool);
  layer.ffn->forward(normed_.data(), b.num_tokens(), pool, hidden_.data());
}

void Model::compute_logits(std::span<const int32_t> rows, ThreadPool& pool,
                           std::vector<float>& logits) {
  logits.resize(rows.size() * static_cast<size_t>(vocab_size()));
  if (rows.empty()) return;
  auto run_lm_head = [&](auto params, const auto* w) {
    params.x = normed_.data();
    params.rows = rows.data();
    params.w = w;
    params.logits = logits.data();
    params.num_rows = static_cast<int>(rows.size());
    params.hidden = static_cast<int>(config_.hidden_size);
    params.vocab_size = vocab_size();
    kernels::launch_lm_head(params, pool);
  };
  if (!lm_head_.bf16.empty()) {
    run_lm_head(kernels::LmHeadParams<float, kernels::Bf16Bits>{}, lm_head_.bf16.data());
  } else {
    run_lm_head(kernels::LmHeadParams<float>{},
                lm_head_.f32.empty() ? embedding_.data() : lm_head_.f32.data());
  }
}

void Model::forward_mtp(const ForwardBatch& b, std::span<const float> hidden, KvPool& kv,
                        ThreadPool& pool, std::vector<float>& logits) {
  RELAY_CHECK(has_mtp(), "forward_mtp: ", config_.architecture,
              " was loaded without an MTP head (registry.h: MtpSource)");
  check_batch(b, kv, false);
  const int t = b.num_tokens();
  const int h = static_cast<int>(config_.hidden_size);
  const size_t n = static_cast<size_t>(t) * h;
  RELAY_CHECK(hidden.size() == n, "forward_mtp: ", t, " tokens need ", n,
              " hidden values (num_tokens x hidden ", h, "), got ", hidden.size());
  MtpHead& head = *mtp_;

  // fc's input, row r = [pre_fc_norm_embedding(embed(t)) | pre_fc_norm_hidden(hidden)]. `hidden`
  // may be last_hidden() (normed_): it is read here, before normed_ is written.
  hidden_.resize(n);
  residual_.resize(n);
  mtp_input_.resize(2 * n);
  embed(b, pool);
  kernels::RmsNormParams<float> norm;
  norm.num_tokens = t;
  norm.hidden = h;
  norm.eps = static_cast<float>(config_.rms_norm_eps);
  norm.x = hidden_.data();
  norm.weight = head.pre_fc_norm_embedding.data();
  norm.out = hidden_.data();
  kernels::launch_rms_norm(norm, pool);
  norm.x = hidden.data();
  norm.weight = head.pre_fc_norm_hidden.data();
  norm.out = residual_.data();
  kernels::launch_rms_norm(norm, pool);
  for (int r = 0; r < t; ++r) {
    float* row = mtp_input_.data() + static_cast<size_t>(r) * 2 * h;
    std::copy_n(hidden_.data() + static_cast<size_t>(r) * h, h, row);
    std::copy_n(residual_.data() + static_cast<size_t>(r) * h, h, row + h);
  }
  head.fc.forward(mtp_input_.data(), t, hidden_.data(), pool);

  // The decoder layer and mtp.norm over a fresh residual stream, as forward() runs its layers.
  normed_.resize(n);
  std::fill(residual_.begin(), residual_.end(), 0.0f);
  norm = residual_norm(t);
  run_layer(head.layer, b, kv, pool, norm);
  norm.weight = head.norm.data();
  kernels::launch_rms_norm(norm, pool);
  compute_logits(b.logit_rows, pool, logits);
}

void Model::forward_idle(ThreadPool& pool) {
  RELAY_CHECK(shard_.dispatch_tokens,
              "forward_idle: only an expert-parallel DP rank runs a step without tokens");
  for (DecoderLayer& layer : layers_) layer.ffn->forward(nullptr, 0, pool, nullptr);
}

void Model::forward_mtp_idle(ThreadPool& pool) {
  RELAY_CHECK(has_mtp() && shard_.dispatch_tokens,
              "forward_mtp_idle: only an expert-parallel DP rank with an MTP head runs one without "
              "tokens");
  mtp_->layer.ffn->forward(nullptr, 0, pool, nullptr);
}

void log_unloaded_tensors(const Checkpoint& ckpt, const std::string& prefix,
                          const std::string& why) {
  const std::vector<std::string> names = ckpt.names();
  const auto count = std::count_if(names.begin(), names.end(),
                                   [&](const std::string& n) { return n.starts_with(prefix); });
  if (count == 0) return;
  std::fprintf(stderr, "relay: %s: %zu %s* tensors not loaded (%s)\n", ckpt.dir().c_str(),
               static_cast<size_t>(count), prefix.c_str(), why.c_str());
}

std::unique_ptr<Model> load_decoder(const ModelConfig& c, const Checkpoint& ckpt,
                                    const ShardSpec& shard, const DecoderBlocks& blocks) {
  RELAY_CHECK(c.num_key_value_heads > 0 && c.num_attention_heads % c.num_key_value_heads == 0,
              "num_attention_heads ", c.num_attention_heads,
              " must be a multiple of num_key_value_heads ", c.num_key_value_heads);
  const DecoderPlan plan = plan_decoder(c, ckpt);
  std::vector<float> embedding =
      load_f32(ckpt, plan.embed_tokens(), {c.vocab_size, c.hidden_size});
  std::vector<DecoderLayer> layers;
  layers.reserve(c.num_hidden_layers);
  for (const LayerPlan& lp : plan.layers) {
    DecoderLayer layer;
    layer.input_norm = load_norm(ckpt, lp.input_norm(), c.hidden_size, c.zero_centered_norms);
    layer.post_attention_norm =
        load_norm(ckpt, lp.post_attention_norm(), c.hidden_size, c.zero_centered_norms);
    layer.mixer = blocks.mixer(lp);
    layer.ffn = blocks.ffn(lp);
    layers.push_back(std::move(layer));
  }
  std::vector<float> final_norm =
      load_norm(ckpt, plan.final_norm(), c.hidden_size, c.zero_centered_norms);
  LmHeadWeights lm_head;
  const std::string lm_name = plan.lm_head();
  const TensorView& lm = ckpt.get(lm_name, {c.vocab_size, c.hidden_size});
  if (lm.dtype == DType::BF16) {
    lm_head.bf16.resize(lm.numel());
    std::memcpy(lm_head.bf16.data(), lm.data, lm.nbytes);
  } else if (!c.tie_word_embeddings) {
    lm_head.f32 = load_f32(ckpt, lm_name, {c.vocab_size, c.hidden_size});
  }
  return std::make_unique<Model>(c, shard, std::move(embedding), std::move(layers),
                                 std::move(final_norm), std::move(lm_head));
}

}  // namespace relay

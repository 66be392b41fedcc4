// Qwen3NextForCausalLM: the same hybrid decoder as Qwen3.5 (Gated DeltaNet + gated attention with
// partial rotary, zero-centred norms), with Qwen3-MoE's layer rule for its feed-forward: the MoE
// block with a sigmoid-gated shared expert where config.layer_is_moe says so (norm_topk_prob,
// decoder_sparse_step, mlp_only_layers), a dense SwiGLU MLP elsewhere.
//
// What differs is the checkpoint: the Gated DeltaNet input projection is two fused tensors
// interleaved per key head g (transformers' fix_query_key_value_ordering):
//   in_proj_qkvz rows: for each g, [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)],  r = Hv / Hk
//   in_proj_ba rows:   for each g, [b_g (r) | a_g (r)]
// where v_g, z_g, b_g, a_g cover value heads g r .. g r + r - 1. They are un-interleaved once, at
// load, into the block's [q | k | v | z | b | a]; after that the math is Qwen3.5's. The MTP head
// (mtp.*), when a checkpoint has one, is loaded by the registry when asked for (model/mtp.h).
#include "core/error.h"
#include "model/architectures.h"
#include "model/rope.h"

namespace relay {

namespace {

// The rows of [in_proj_qkvz; in_proj_ba] (stacked, as load_linear concatenates them) in the order
// [q | k | v | z | b | a].
std::vector<int64_t> uninterleaved_rows(const ModelConfig& c) {
  const int64_t key_heads = c.linear_num_key_heads, dk = c.linear_key_head_dim;
  const int64_t r = c.linear_num_value_heads / key_heads;
  const int64_t vg = r * c.linear_value_head_dim;  // v (and z) rows of one group
  const int64_t qkvz_group = 2 * dk + 2 * vg, ba_begin = key_heads * qkvz_group;
  std::vector<int64_t> rows;
  // `count` rows at `offset` within each group of `group_rows` rows starting at row `base`.
  auto gather = [&](int64_t base, int64_t group_rows, int64_t offset, int64_t count) {
    for (int64_t g = 0; g < key_heads; ++g) {
      for (int64_t i = 0; i < count; ++i) rows.push_back(base + g * group_rows + offset + i);
    }
  };
  gather(0, qkvz_group, 0, dk);            // q
  gather(0, qkvz_group, dk, dk);           // k
  gather(0, qkvz_group, 2 * dk, vg);       // v
  gather(0, qkvz_group, 2 * dk + vg, vg);  // z
  gather(ba_begin, 2 * r, 0, r);           // b
  gather(ba_begin, 2 * r, r, r);           // a
  return rows;
}

}  // namespace

std::unique_ptr<Model> build_qwen3_next(const ModelConfig& c, const Checkpoint& ckpt,
                                        const ShardSpec& shard) {
  const RopeTables rope = compute_rope(c);
  const std::vector<int64_t> in_proj_rows = uninterleaved_rows(c);
  DecoderBlocks blocks;
  blocks.mixer = [&](const LayerPlan& layer) -> std::unique_ptr<TokenMixer> {
    if (layer.mixer != MixerKind::kGatedDeltaNet) {
      return std::make_unique<FullAttention>(c, ckpt, layer.attention(),
                                             c.kv_cache_layer(layer.index), rope, shard);
    }
    const std::string la = layer.linear_attention() + ".";
    const Linear fused =
        load_linear(ckpt, {la + "in_proj_qkvz", la + "in_proj_ba"},
                    {c.linear_conv_dim() + c.linear_value_dim(), 2 * c.linear_num_value_heads},
                    c.hidden_size, false);
    return std::make_unique<GatedDeltaNet>(c, ckpt, layer.linear_attention(),
                                           c.recurrent_layer(layer.index),
                                           take_rows(fused, in_proj_rows), shard);
  };
  blocks.ffn = [&](const LayerPlan& layer) { return make_feed_forward(c, ckpt, layer, shard); };
  return load_decoder(c, ckpt, shard, blocks);
}

}  // namespace relay

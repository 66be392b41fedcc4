// RankEngine's forward pass, enqueued op by op on the rank's stream (graph-capturable).
#include "engine/cuda/rank_engine.h"

namespace relay::cuda_engine {

RankEngine::StepMeta RankEngine::step_meta(const Shape& sh, const uint8_t* base) const {
  const MetaLayout m = MetaLayout::make(sh.tokens, sh.seqs, sh.rows, sh.width);
  if (base == nullptr) base = meta_dev;
  auto at = [&](size_t off) { return base + off; };
  auto i32 = [&](size_t off) { return reinterpret_cast<const int32_t*>(at(off)); };
  return {i32(m.token_ids),    i32(m.positions),    i32(m.logit_rows),
          i32(m.query_starts), i32(m.context_lens), i32(m.block_tables),
          i32(m.state_slots),  i32(m.snapshot_slots),
          reinterpret_cast<const int64_t*>(at(m.slot_mapping)),
          reinterpret_cast<const uint8_t*>(at(m.state_fresh))};
}

void RankEngine::enqueue_forward(const Shape& sh) {
  const StepMeta meta = step_meta(sh);
  const int T = sh.tokens;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  mark("embedding");
  kernels::launch_embedding({meta.token_ids, embedding, residual, T, hidden, vocab}, stream);
  bool normed_ahead = false;  // the layer before applied this norm
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerWeights& w = layers[l];
    if (l == 0) {
      mark("input_norm");
      kernels::launch_rms_norm({residual, nullptr, w.input_norm, normed, T, hidden, eps}, stream);
    } else if (!normed_ahead) {
      mark("input_norm");
      kernels::launch_rms_norm({mix, residual, w.input_norm, normed, T, hidden, eps}, stream);
    }
    normed_ahead =
        enqueue_layer(w, sh, meta, l + 1 < layers.size() ? layers[l + 1].input_norm : final_norm);
  }
  if (!normed_ahead) {
    mark("final_norm");
    kernels::launch_rms_norm({mix, residual, final_norm, normed, T, hidden, eps}, stream);
  }
  mark("lm_head");
  kernels::launch_lm_head({normed, meta.logit_rows, lm_head, logits, sh.rows, hidden, vocab}, stream);
  mark("end");
}

bool RankEngine::enqueue_layer(const LayerWeights& w, const Shape& sh, const StepMeta& m,
                               const bf16* next_norm) {
  const int T = sh.tokens;
  if (w.mixer == MixerKind::kGatedDeltaNet) {
    enqueue_gated_delta_net(w, sh, m);
  } else {
    enqueue_attention(w, sh, m);
  }
  if (tp_reduce) {
    mark("attention_all_reduce");
    comm->all_reduce_sum(mix, static_cast<size_t>(T) * hidden, stream);
  }
  mark("post_attention_norm");
  kernels::launch_rms_norm({mix, residual, w.post_norm, normed, T, hidden,
                            static_cast<float>(cfg.rms_norm_eps)},
                           stream);
  if (w.moe) {
    // The shared expert as one more expert of the MoE where its weights are folded in
    // (LayerWeights::shared_parts) and the step is small; else apart, after it.
    const int shared_parts = T <= kSharedExpertFoldMaxTokens ? w.shared_parts : 0;
    const bool apart = w.shared_width > 0 && shared_parts == 0;
    // Apart, it runs first where the MoE's combine can add it in (its output final on the rank),
    // and the combine then takes the norm after the layer too; else it adds itself in after.
    const bool into_combine = apart && !dispatch && !moe_reduce;
    if (into_combine) enqueue_shared_expert(w, T, false);
    const bool normed_next = enqueue_moe(w, T, shared_parts, next_norm, into_combine);
    if (apart && !into_combine) enqueue_shared_expert(w, T, true);
    return normed_next;
  } else {
    linear("mlp_gate_up", normed, w.gate_up, w.gate_up8, nullptr, gate_up, T, 2 * w.width, hidden);
    swiglu(w, T);
    linear("mlp_down", act, w.down, w.down8, nullptr, mix, T, hidden, w.act_width,
           w.down8.present());
    if (tp_reduce) {
      mark("mlp_all_reduce");
      comm->all_reduce_sum(mix, static_cast<size_t>(T) * hidden, stream);
    }
  }
  return false;
}

void RankEngine::enqueue_attention(const LayerWeights& w, const Shape& sh, const StepMeta& m) {
  const int T = sh.tokens, q_dim = q_heads * head_dim;
  const bool gated = w.mixer == MixerKind::kGatedAttention;
  linear("qkv_proj", normed, w.qkv, w.qkv8, w.qkv_bias, qkv, T, qkv_dim, hidden);
  if (gated) linear("attn_gate_proj", normed, w.attn_gate, {}, nullptr, attn_gate_out, T, q_dim, hidden);
  bf16* k_cache = kv_pool + kv_layout.element_offset(w.kv_layer, 0, 0, 0);
  bf16* v_cache = kv_pool + kv_layout.element_offset(w.kv_layer, 1, 0, 0);
  mark("qk_norm_rope_kv_write");
  kernels::QkNormRopeKvWriteParams<bf16> rp{
      qkv, w.q_norm, w.k_norm, m.positions, inv_freq, attention_scaling, m.slots, q, k_cache,
      v_cache, T, q_heads, kv_heads, head_dim, opt.block_size,
      static_cast<float>(cfg.rms_norm_eps), w.qkv8.present() ? kernels::kFp8BlockSize : 0};
  rp.rotary_dim = rotary_dim;
  kernels::launch_qk_norm_rope_kv_write(rp, stream);
  mark("attention");
  kernels::launch_paged_attention(
      {q, k_cache, v_cache, m.query_starts, m.context_lens, m.tables, attn, sh.seqs, T, q_heads,
       kv_heads, head_dim, opt.block_size, sh.width,
       1.0f / std::sqrt(static_cast<float>(head_dim))},
      stream);
  if (gated) {
    mark("attn_output_gate");
    kernels::launch_sigmoid_gate({attn, attn_gate_out, attn, T, q_dim, q_dim}, stream);
  }
  linear("o_proj", attn, w.o, w.o8, w.o_bias, mix, T, hidden, q_dim);
}

void RankEngine::enqueue_gated_delta_net(const LayerWeights& w, const Shape& sh, const StepMeta& m) {
  const int T = sh.tokens, v_dim = gdn_heads_v * gdn_value_dim;
  linear("gdn_in_proj", normed, w.in_proj, {}, nullptr, gdn_proj, T, gdn_in_width, hidden);
  const int64_t slot_stride = state_layout.slot_stride();
  float* conv_states = state_pool + state_layout.conv_offset(0, w.state_layer);
  float* ssm_states = state_pool + state_layout.ssm_offset(0, w.state_layer);
  // in_proj's row: q | k | v (conv_dim) | z (v_dim) | b (v heads) | a (v heads).
  const bf16* z = gdn_proj + gdn_conv_dim;
  const bf16* b = z + v_dim;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  // A step of a few sequences of a few tokens each (decode, verifying drafts) takes the fused
  // kernel; a larger one the three ops (the walk for every sequence of a graph step), a prompt's
  // long sequences the conv's and the recurrence's prefill forms.
  const bool few_tokens = sh.per_seq != 0 || T - sh.seqs + 1 < kernels::kGatedDeltaChunkedMinTokens;
  if (few_tokens && sh.seqs <= kernels::kGatedDeltaNetStepFusedMaxSeqs &&
      kernels::gated_delta_net_step_fused(gdn_heads_k, gdn_heads_v, gdn_key_dim, gdn_value_dim)) {
    mark("gdn_step");
    kernels::launch_gated_delta_net_step(
        {gdn_proj, gdn_in_width, w.conv, w.a_log, w.dt_bias, w.gdn_norm, conv_states, ssm_states,
         slot_stride, m.query_starts, m.state_slots, m.state_fresh, m.snapshot_slots, gdn_core,
         sh.seqs, T, gdn_heads_k, gdn_heads_v, gdn_key_dim, gdn_value_dim, gdn_kernel, eps},
        stream);
  } else {
    mark("gdn_conv1d");
    kernels::launch_causal_conv1d({gdn_proj, gdn_in_width, w.conv, conv_states, slot_stride,
                                   m.query_starts, m.state_slots, m.state_fresh, m.snapshot_slots,
                                   gdn_conv_out, sh.seqs, T, gdn_conv_dim, gdn_kernel},
                                  stream);
    mark("gdn_delta_rule");
    kernels::launch_gated_delta_rule(
        {gdn_conv_out, b, b + gdn_heads_v, gdn_in_width, w.a_log, w.dt_bias, ssm_states,
         slot_stride, m.query_starts, m.state_slots, m.state_fresh, m.snapshot_slots, gdn_core,
         sh.seqs, T, gdn_heads_k, gdn_heads_v, gdn_key_dim, gdn_value_dim,
         sh.per_seq == 0 ? gdn_chunk_workspace : nullptr},
        stream);
    mark("gdn_gated_norm");
    kernels::launch_gated_rms_norm(
        {gdn_core, z, gdn_in_width, w.gdn_norm, gdn_core, T, gdn_heads_v, gdn_value_dim, eps},
        stream);
  }
  linear("gdn_out_proj", gdn_core, w.out_proj, {}, nullptr, mix, T, hidden, v_dim);
}

void RankEngine::enqueue_shared_expert(const LayerWeights& w, int T, bool add) {
  linear("shared_gate_up", normed, w.shared_gate_up, {}, nullptr, gate_up, T, 2 * w.shared_width,
         hidden);
  mark("shared_swiglu");
  kernels::launch_swiglu({gate_up, act, T, w.shared_width}, stream);
  linear("shared_down", act, w.shared_down, {}, nullptr, shared_out, T, hidden, w.shared_width);
  linear("shared_gate", normed, w.shared_gate, {}, nullptr, shared_logit, T, 1, hidden);
  if (!add) return;
  mark("shared_add");
  kernels::launch_sigmoid_gate({shared_out, shared_logit, mix, T, hidden, 1, true}, stream);
}

void RankEngine::enqueue_idle() {
  for (const LayerWeights& w : layers) {
    if (w.moe) enqueue_moe(w, 0);  // the shared expert has no tokens to run here
  }
}

bool RankEngine::fp8_on_cublaslt(const Fp8Weight& w8, int m, int k) const {
  return kernels::fp8_block_matmul_cublaslt_supported(m, static_cast<int>(w8.shape.rows), k);
}

void RankEngine::linear(const char* name, const bf16* x, const bf16* w16, const Fp8Weight& w8,
            const bf16* bias, bf16* out, int m, int n, int k, bool quantized) {
  if (!w8.present()) {
    mark(name);
    kernels::launch_matmul({x, w16, bias, out, m, n, k}, stream);
    return;
  }
  const bool lt = fp8_on_cublaslt(w8, m, k);
  if (!quantized) {
    mark(name, ".act_quant");
    kernels::launch_fp8_act_quant({x, act_q, act_scale, m, k, kernels::kFp8BlockSize, lt}, stream);
  }
  mark(name);
  // n is the bf16 width; an FP8 weight's packed rows add any padding between fused parts.
  const kernels::Fp8BlockMatmulParams<bf16> mp{act_q, act_scale, w8.q, w8.scale, out, m,
                                             static_cast<int>(w8.shape.rows), k,
                                             kernels::kFp8BlockSize, kernels::kFp8BlockSize, lt};
  if (lt) {
    kernels::launch_fp8_block_matmul_cublaslt(mp, w8.row_scale, stream);
  } else {
    kernels::launch_fp8_block_matmul(mp, stream);
  }
}

void RankEngine::grouped(const char* name, const bf16* x, const bf16* w16, const Fp8Weight& w8, bf16* out,
             int rows, int groups, int n, int k, bool quantized, bool offsets_settled) {
  if (!w8.present()) {
    mark(name);
    kernels::MoeGroupedMatmulParams<bf16> p{x, w16, expert_offsets, out, rows, groups, n, k};
    p.offsets_settled = offsets_settled;
    kernels::launch_moe_grouped_matmul(p, stream);
    return;
  }
  if (!quantized) {
    mark(name, ".act_quant");
    kernels::launch_fp8_act_quant({x, act_q, act_scale, rows, k}, stream);
  }
  mark(name);
  kernels::launch_fp8_block_grouped_matmul(
      {act_q, act_scale, w8.q, w8.scale, expert_offsets, out, rows, groups,
       static_cast<int>(w8.shape.rows), k},
      stream);
}

void RankEngine::swiglu(const LayerWeights& w, int rows, const kernels::LiveRows& live) {
  mark(w.down8.present() ? "swiglu_fp8_quant" : "swiglu");
  if (w.down8.present()) {
    const bool group_major = !w.moe && fp8_on_cublaslt(w.down8, rows, w.act_width);
    kernels::launch_swiglu_fp8_quant(
        {gate_up, act_q, act_scale, rows, w.act_width, group_major, live}, stream);
  } else {
    kernels::launch_swiglu({gate_up, act, rows, w.act_width, live}, stream);
  }
}

bool RankEngine::enqueue_moe(const LayerWeights& w, int T, int shared_parts,
                             const bf16* next_norm, bool add_shared) {
  // The shared expert folded in: one more router row (its gate), and its parts as more experts
  // and routes per token (all of them this rank's: folding needs one rank for the MoE).
  RELAY_CHECK(shared_parts == 0 || (!dispatch && !moe_reduce && shard.ep_size == 1),
              "moe: the shared expert folded into the experts needs the MoE on one rank");
  const int K = top_k + shared_parts, groups = local_experts + shared_parts;
  // Under DP + EP the live rows are the received tokens' routes, at most moe_bound_tokens x K
  // (see moe_step_tokens); the permute and combine keep the buffer's shape and their device bounds.
  const int tokens = dispatch ? moe_tokens : T;
  const int R = (dispatch ? std::min(tokens, moe_bound_tokens) : tokens) * K;
  // FP8 experts: each token is quantised once and its codes and scales are permuted (the same
  // bytes as quantising the permuted bf16 rows, 1 / top_k of the work).
  const bool fp8_experts = w.gate_up8.present();
  // bf16 experts at decode's few rows per expert (and no DP + EP bound): the streaming kernel
  // gathers the token rows itself and writes silu(gate) * up straight into the down projection's
  // input, so the permute builds only its index (the two fusions are bit-identical to the ops
  // they replace; two launches and two round trips fewer).
  kernels::MoeGroupedMatmulParams<bf16> gate_up_p{normed, w.gate_up, expert_offsets, act, R,
                                                 groups, 2 * w.width, hidden};
  const kernels::GroupedGemmKind gate_up_kind = kernels::moe_grouped_matmul_auto_kind(gate_up_p);
  const bool streamed = !fp8_experts && !w.down8.present() && !dispatch && R > 0 &&
                        R <= kernels::kMaxGatheredRows &&
                        gate_up_kind == kernels::GroupedGemmKind::Streaming;
  const bool copy_rows = !fp8_experts && !streamed;
  // bf16 experts at a prefill's many rows per expert on Relay's wgmma kernel: its tiles pair gate
  // and up columns, so it stores silu(gate) * up without the [R, 2 width] intermediate (the same
  // bits as its GEMM and the swiglu kernel after it).
  const bool tiles_swiglu = !fp8_experts && !w.down8.present() && R > 0 &&
                            (2 * w.width) % 16 == 0 &&
                            gate_up_kind == kernels::GroupedGemmKind::Wgmma;
  const int router_rows = experts + (shared_parts > 0 ? 1 : 0);
  mark("router_gemm");
  kernels::launch_matmul({normed, w.router, nullptr, router_logits, T, router_rows, hidden},
                         stream);
  mark("router_topk");
  kernels::launch_moe_router_topk({router_logits, topk_ids, topk_weights, T, experts, top_k,
                                   cfg.norm_topk_prob, shared_parts},
                                  stream);
  const bf16* x = normed;
  const int32_t* ids = topk_ids;
  const float* weights_in = topk_weights;
  bf16* out = mix;
  kernels::LiveRows live_tokens;  // every token, but under DP + EP the ones received
  if (dispatch) {
    mark("moe_dispatch");
    group->moe_dispatch(rank, normed, topk_ids, topk_weights, T, experts, stream);
    x = group->recv_hidden(rank);
    ids = group->recv_ids(rank);
    weights_in = group->recv_weights(rank);
    out = recv_sum;
    static_assert(kernels::kMaxLiveRegions >= parallel::cuda::kMaxRanks);
    live_tokens = {group->recv_counts(rank), group->moe_layout().max_tokens};
  } else if (shard.ep_size > 1) {
    mark("moe_localize");
    kernels::launch_moe_localize_experts(
        {topk_ids, topk_weights, T * K, shard.expert_begin, local_experts}, stream);
  }
  // The permuted rows of this rank's experts, [0, expert_offsets[local_experts]): under EP the
  // absent id sorts after them and its rows are never computed, so they need not be copied or
  // activated. (With all experts here the bound would be every row.) One region bounds a prefix,
  // so it must span the largest op it bounds: the permute's copy runs over all tokens x K
  // rows (under DP + EP the whole receive buffer, beyond R), the SwiGLU over R of them.
  kernels::LiveRows computed_rows;
  if (shard.ep_size > 1 && R > 0) computed_rows = {expert_offsets + local_experts, tokens * K};
  if (fp8_experts) {
    mark("experts_gate_up.act_quant");
    kernels::Fp8ActQuantParams<bf16> qp{x, token_q, token_scale, tokens, hidden};
    qp.live_tokens = live_tokens;
    kernels::launch_fp8_act_quant(qp, stream);
  }
  gate_up_p.x = x;
  mark("moe_permute");
  kernels::launch_moe_permute({x, ids, copy_rows ? permuted_x : nullptr, permuted_index,
                               expert_offsets, tokens, hidden, route_experts() + shared_parts, K,
                               live_tokens, computed_rows},
                              stream);
  if (fp8_experts) {
    kernels::launch_fp8_permute_rows({token_q, token_scale, permuted_index, act_q, act_scale,
                                      tokens, hidden, K, live_tokens, computed_rows},
                                     stream);
  }
  if (streamed) {
    mark("experts_gate_up_swiglu");
    gate_up_p.swiglu = true;
    gate_up_p.permuted_index = permuted_index;
    gate_up_p.top_k = K;
    kernels::launch_moe_grouped_matmul(gate_up_p, stream);
  } else if (tiles_swiglu) {
    mark("experts_gate_up_swiglu");
    gate_up_p.x = permuted_x;
    gate_up_p.swiglu = true;
    kernels::launch_moe_grouped_matmul(gate_up_p, stream);
  } else {
    grouped("experts_gate_up", permuted_x, w.gate_up, w.gate_up8, gate_up, R, groups,
            2 * w.width, hidden, fp8_experts);
    swiglu(w, R, computed_rows);
  }
  // The offsets came from the permute before gate_up: settled for the down.
  grouped("experts_down", act, w.down, w.down8, expert_out, R, groups, hidden, w.act_width,
          w.down8.present(), true);
  // The norm after the layer rides on the combine where the combine's output is final here.
  const bool fuse_norm = next_norm != nullptr && !dispatch && !moe_reduce && T > 0;
  mark(fuse_norm ? "moe_combine_norm" : "moe_combine");
  kernels::MoeUnpermuteCombineParams<bf16> cp{expert_out, permuted_index, weights_in, out,
                                              tokens, hidden, K, live_tokens};
  if (add_shared) {
    RELAY_CHECK(!dispatch && !moe_reduce, "moe: the shared expert joins the combine on one rank");
    cp.extra = shared_out;
    cp.extra_gate = shared_logit;
  }
  if (fuse_norm) {
    cp.residual = residual;
    cp.norm_weight = next_norm;
    cp.normed = normed;
    cp.eps = static_cast<float>(cfg.rms_norm_eps);
  }
  kernels::launch_moe_unpermute_combine(cp, stream);
  if (dispatch) {
    mark("moe_dispatch_combine");
    group->moe_combine(rank, recv_sum, mix, T, stream);
  } else if (moe_reduce) {
    mark("moe_all_reduce");
    comm->all_reduce_sum(mix, static_cast<size_t>(T) * hidden, stream);
  }
  return fuse_norm;
}

}  // namespace relay::cuda_engine

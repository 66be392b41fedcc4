// RankEngine's memory plan: activations sized for a full step, then the KV pool in what is left.
#include "engine/cuda/rank_engine.h"

namespace relay::cuda_engine {

void RankEngine::allocate_activations() {
  const size_t T = opt.max_num_tokens, S = opt.max_num_seqs;
  // Expert rows: every (token, k) pair of the token rows the experts run on, k counting the
  // shared expert's route where a layer folds it in.
  int shared_parts = mtp.present ? mtp.layer.shared_parts : 0;
  for (const LayerWeights& w : layers) shared_parts = std::max(shared_parts, w.shared_parts);
  const size_t routes_per_token = std::max(top_k, 1) + shared_parts;
  const size_t M = moe_tokens, routes = T * routes_per_token;
  const size_t rows = std::max(T, M * routes_per_token);
  const int64_t max_context =
      cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768;
  max_blocks = static_cast<int>((max_context + opt.block_size - 1) / opt.block_size);
  const MetaLayout meta =
      MetaLayout::make(static_cast<int>(T), static_cast<int>(S), static_cast<int>(T), max_blocks);
  meta_capacity = meta.bytes;
  const size_t W = max_ffn_width;
  size_t bytes = 0;
  auto add = [&](size_t n, size_t elem) { bytes += align_up(n * elem, 256); };
  const size_t fp8_k = std::max<size_t>({size_t(hidden), size_t(q_heads) * head_dim, W});
  const bool any_fp8 = stats.fp8_linears > 0;
  add(T * hidden, 2), add(T * hidden, 2), add(T * hidden, 2), add(T * max_qkv_width, 2);
  if (any_fp8) add(rows * fp8_k, 1), add(rows * ((fp8_k + 127) / 128), 4);
  if (any_fp8 && experts > 0) add(M * hidden, 1), add(M * ((hidden + 127) / 128), 4);
  if (dispatch) add(M * hidden, 2);
  add(T * q_heads * head_dim, 2), add(T * q_heads * head_dim, 2);
  add(T * (experts + 1), 2), add(rows * hidden, 2), add(rows * 2 * W, 2), add(rows * W, 2),
      add(rows * hidden, 2);
  add(routes, 4), add(rows, 4), add(local_experts + 2, 4), add(routes, 4);
  // The hybrids' layers (rank_engine.h): gated attention's gate, Gated DeltaNet's buffers, the
  // shared expert's output and gate logits.
  const bool gated = std::any_of(layers.begin(), layers.end(), [](const LayerWeights& w) {
    return w.mixer == MixerKind::kGatedAttention;
  });
  const bool shared = std::any_of(layers.begin(), layers.end(),
                                  [](const LayerWeights& w) { return w.shared_width > 0; }) ||
                      (mtp.present && mtp.layer.shared_width > 0);
  const size_t gdn_v = size_t(gdn_heads_v) * gdn_value_dim;
  if (gated) add(T * q_heads * head_dim, 2);
  if (gdn_in_width > 0) add(T * gdn_in_width, 2), add(T * gdn_conv_dim, 2), add(T * gdn_v, 2);
  const size_t gdn_chunk_bytes =
      gdn_in_width > 0 && kernels::gated_delta_rule_chunks(gdn_key_dim, gdn_value_dim)
          ? kernels::gated_delta_rule_workspace_bytes(static_cast<int>(T), gdn_heads_k, gdn_heads_v)
          : 0;
  add(gdn_chunk_bytes, 1);
  if (shared) add(T * hidden, 2), add(T, 2);
  // The MTP head (and, for its graphs, the chain metadata, greedy rows and drafts).
  const int K = std::max(opt.num_mtp_drafts, 1);
  const size_t chain_bytes = MtpChainMeta::make(static_cast<int>(S), max_blocks).bytes(K);
  if (mtp.present) {
    add(T * hidden, 2), add(T * hidden, 2), add(T + 2 * S, 4), add(chain_bytes, 1);
    add(S * sizeof(kernels::SampleRowParams), 1), add(K * S, 4);
  }
  const size_t R = logit_rows();
  add(R * size_t(vocab), 4);
  add(meta.bytes, 1);
  add(R * sizeof(kernels::SampleRowParams), 1), add(R, 4), add(R, 4), add(R, 4),
      add(R * kMaxLogprobs, 4), add(R * kMaxLogprobs, 4);
  acts.reserve(bytes + 4096);
  residual = acts.take<bf16>(T * hidden);
  normed = acts.take<bf16>(T * hidden);
  mix = acts.take<bf16>(T * hidden);
  qkv = acts.take<bf16>(T * max_qkv_width);
  if (any_fp8) {
    act_q = acts.take<uint8_t>(rows * fp8_k);
    act_scale = acts.take<float>(rows * ((fp8_k + 127) / 128));
  }
  if (any_fp8 && experts > 0) {
    token_q = acts.take<uint8_t>(M * hidden);
    token_scale = acts.take<float>(M * ((hidden + 127) / 128));
  }
  if (dispatch) recv_sum = acts.take<bf16>(M * hidden);
  q = acts.take<bf16>(T * q_heads * head_dim);
  attn = acts.take<bf16>(T * q_heads * head_dim);
  router_logits = acts.take<bf16>(T * (experts + 1));  // and the shared expert's gate
  permuted_x = acts.take<bf16>(rows * hidden);
  gate_up = acts.take<bf16>(rows * 2 * W);
  act = acts.take<bf16>(rows * W);
  expert_out = acts.take<bf16>(rows * hidden);
  topk_ids = acts.take<int32_t>(routes);
  permuted_index = acts.take<int32_t>(rows);
  expert_offsets = acts.take<int32_t>(local_experts + 2);
  topk_weights = acts.take<float>(routes);
  if (gated) attn_gate_out = acts.take<bf16>(T * q_heads * head_dim);
  if (gdn_in_width > 0) {
    gdn_proj = acts.take<bf16>(T * gdn_in_width);
    gdn_conv_out = acts.take<bf16>(T * gdn_conv_dim);
    gdn_core = acts.take<bf16>(T * gdn_v);
  }
  if (gdn_chunk_bytes > 0) gdn_chunk_workspace = acts.take<uint8_t>(gdn_chunk_bytes);
  if (shared) {
    shared_out = acts.take<bf16>(T * hidden);
    shared_logit = acts.take<bf16>(T);
  }
  if (mtp.present) {
    mtp_embed = acts.take<bf16>(T * hidden);
    mtp_hidden = acts.take<bf16>(T * hidden);
    mtp_rows_dev = acts.take<int32_t>(T + 2 * S);
    RELAY_CUDA_CHECK(cudaMallocHost(&mtp_rows_host, (T + 2 * S) * sizeof(int32_t)));
    mtp_meta_dev = acts.take<uint8_t>(chain_bytes);
    RELAY_CUDA_CHECK(cudaMallocHost(&mtp_meta_host, chain_bytes));
    greedy_rows_dev = acts.take<kernels::SampleRowParams>(S);
    const std::vector<kernels::SampleRowParams> greedy(S);  // temperature 0: arg-max
    RELAY_CUDA_CHECK(cudaMemcpy(greedy_rows_dev, greedy.data(), S * sizeof(greedy[0]),
                                cudaMemcpyHostToDevice));
    mtp_drafts_dev = acts.take<int32_t>(K * S);
    RELAY_CUDA_CHECK(cudaMallocHost(&mtp_drafts_host, K * S * sizeof(int32_t)));
  }
  logits = acts.take<float>(R * size_t(vocab));
  meta_dev = acts.take<uint8_t>(meta.bytes);
  sample_rows_dev = acts.take<kernels::SampleRowParams>(R);
  tokens_dev = acts.take<int32_t>(R);
  logprobs_dev = acts.take<float>(R);
  ranks_dev = acts.take<int32_t>(R);
  top_ids_dev = acts.take<int32_t>(R * kMaxLogprobs);
  top_lp_dev = acts.take<float>(R * kMaxLogprobs);
  RELAY_CUDA_CHECK(cudaMallocHost(&meta_host, meta.bytes));
  // One pinned block for the sampling mirrors.
  const size_t host_bytes = R * (sizeof(kernels::SampleRowParams) + 12 + 8 * kMaxLogprobs) + 1024;
  uint8_t* h = nullptr;
  RELAY_CUDA_CHECK(cudaMallocHost(&h, host_bytes));
  sample_rows_host = reinterpret_cast<kernels::SampleRowParams*>(h);
  h += align_up(R * sizeof(kernels::SampleRowParams), 16);
  tokens_host = reinterpret_cast<int32_t*>(h);
  h += align_up(R * 4, 16);
  logprobs_host = reinterpret_cast<float*>(h);
  h += align_up(R * 4, 16);
  ranks_host = reinterpret_cast<int32_t*>(h);
  h += align_up(R * 4, 16);
  top_ids_host = reinterpret_cast<int32_t*>(h);
  h += align_up(R * kMaxLogprobs * 4, 16);
  top_lp_host = reinterpret_cast<float*>(h);
}

KvCacheLayout RankEngine::kv_layout_for(int num_blocks) const {
  KvCacheLayout l;
  l.num_layers = cfg.num_kv_cache_layers() + (mtp.present ? 1 : 0);  // the head's after
  l.num_kv_heads = kv_heads;
  l.block_size = opt.block_size;
  l.head_dim = head_dim;
  l.element_bytes = 2;
  l.num_blocks = num_blocks;
  return l;
}

int RankEngine::blocks_that_fit(int sharing) {
  const size_t per_block = kv_layout_for(1).bytes_per_block();
  size_t free_bytes = 0, total_bytes = 0;
  RELAY_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  stats.free_bytes_before_kv = free_bytes / sharing;
  const size_t reserve = opt.memory_reserve_bytes * sharing;
  RELAY_CHECK(free_bytes > reserve + per_block * sharing, "only ", free_bytes,
              " bytes of device memory left for the KV cache of ", sharing, " rank(s) (reserve ",
              opt.memory_reserve_bytes, " per rank)");
  return static_cast<int>(
      std::min<size_t>((free_bytes - reserve) / sharing / per_block, size_t{INT32_MAX} / 2));
}

void RankEngine::allocate_states(int slots, int snapshots) {
  RELAY_CHECK(slots > 0 && snapshots >= 0, "CUDA backend options: ", cfg.architecture,
              " (linear-attention layers) needs recurrent-state slots, got ", slots, " slots and ",
              snapshots, " snapshots");
  state_layout = recurrent_state_layout(cfg, shard, slots + snapshots);
  state_slots = slots;
  state_snapshots = snapshots;
  size_t free_bytes = 0, total_bytes = 0;
  RELAY_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t need = state_layout.total_bytes();
  RELAY_CHECK(need + opt.memory_reserve_bytes < free_bytes, "the recurrent state of ", slots,
              " sequence slots (--max-num-seqs x (1 + num_speculative_tokens)) and ", snapshots,
              " prefix-cache snapshots (--num-state-snapshots) takes ", need, " bytes (",
              state_layout.bytes_per_slot(), " per slot), but only ", free_bytes,
              " bytes of device memory are free on rank ", rank,
              " after the weights; lower --max-num-seqs or --num-state-snapshots");
  RELAY_CUDA_CHECK(cudaMalloc(&state_pool, need));
  RELAY_CUDA_CHECK(cudaMemsetAsync(state_pool, 0, need, stream));
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void RankEngine::copy_state_slot(int dst, int src) {
  RELAY_CUDA_CHECK(cudaMemcpyAsync(state_slot_ptr(dst), state_slot_ptr(src),
                                   state_layout.bytes_per_slot(), cudaMemcpyDeviceToDevice, stream));
}

void RankEngine::allocate_kv(int num_blocks) {
  kv_layout = kv_layout_for(num_blocks);
  stats.kv_pool_bytes = kv_layout.total_bytes();
  RELAY_CUDA_CHECK(cudaMalloc(&kv_pool, kv_layout.total_bytes()));
  // NOTE: zeroed so a never-written page (a padded decode row) holds numbers, not NaN patterns.
  RELAY_CUDA_CHECK(cudaMemsetAsync(kv_pool, 0, kv_layout.total_bytes(), stream));
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace relay::cuda_engine

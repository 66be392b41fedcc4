// RankEngine's MTP draft head (model/mtp.h has the forward, engine/after_step.h which rows it
// computes): after a step, the catch-up rows of every sequence in one forward, then K - 1 chained
// forwards of one row per drafting sequence, each drafting greedily on the GPU sampler. After a
// graph step the whole head is one graph (propose_mtp_graphed), else it runs eagerly.
#include "engine/cuda/rank_engine.h"
#include "engine/after_step.h"

namespace relay::cuda_engine {

void RankEngine::enqueue_mtp(const Shape& sh, const StepMeta& m, const bf16* hidden_in,
                             int hidden_rows, const int32_t* gather) {
  const int T = sh.tokens;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  // The inputs first: the hidden rows may be `normed`, which the layer overwrites.
  mark("mtp_gather_hidden");
  kernels::launch_embedding({gather, hidden_in, mtp_hidden, T, hidden, hidden_rows}, stream);
  mark("mtp_embedding");
  kernels::launch_embedding({m.token_ids, embedding, mtp_embed, T, hidden, vocab}, stream);
  mark("mtp_pre_fc_norms");
  kernels::launch_rms_norm({mtp_embed, nullptr, mtp.norm_embed, mtp_embed, T, hidden, eps}, stream);
  kernels::launch_rms_norm({mtp_hidden, nullptr, mtp.norm_hidden, mtp_hidden, T, hidden, eps},
                           stream);
  // fc(cat([e, h])) as its two halves; the first norm of the layer adds them into the residual
  // stream (residual = fc_embed(e), x = fc_hidden(h): residual += x, then the input norm).
  linear("mtp_fc_embed", mtp_embed, mtp.fc_embed, {}, nullptr, residual, T, hidden, hidden);
  linear("mtp_fc_hidden", mtp_hidden, mtp.fc_hidden, {}, nullptr, mix, T, hidden, hidden);
  mark("input_norm");
  kernels::launch_rms_norm({mix, residual, mtp.layer.input_norm, normed, T, hidden, eps}, stream);
  if (!enqueue_layer(mtp.layer, sh, m, mtp.norm)) {
    mark("mtp_norm");
    kernels::launch_rms_norm({mix, residual, mtp.norm, normed, T, hidden, eps}, stream);
  }
  mark("lm_head");
  kernels::launch_lm_head({normed, m.logit_rows, lm_head, logits, sh.rows, hidden, vocab}, stream);
}

void RankEngine::enqueue_greedy_drafts(int n, int32_t* out) {
  mark("mtp_greedy");
  kernels::launch_sample({.logits = logits, .rows = greedy_rows_dev, .tokens = out,
                          .logprobs = logprobs_dev, .num_rows = n, .vocab_size = vocab},
                         stream);
}

void RankEngine::mtp_idle() {
  for (int step = 0; step < opt.num_mtp_drafts; ++step) {
    if (mtp.layer.moe) enqueue_moe(mtp.layer, 0);
  }
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void RankEngine::propose_mtp(std::span<const StepSequence> batch,
                             std::span<const SampledToken> sampled, bool lead) {
  if (mtp_graphable()) return propose_mtp_graphed(batch, sampled, lead);
  const std::vector<MtpCatchUp> catch_up =
      plan_mtp_catch_up(batch, sampled, opt.num_mtp_drafts, opt.block_size);
  // The step's token rows (a graph step's include its fillers): where each sequence's hidden rows
  // are in `normed`. upload_batch below replaces `flat`.
  const std::vector<int32_t> step_starts = flat.query_starts;
  const int step_rows = step_starts.back();
  std::vector<std::vector<int32_t>> drafts(batch.size()), tokens(batch.size());
  std::vector<StepSequence> rows;  // the head's batch
  std::vector<int32_t> logit_rows, hidden_rows;
  std::vector<size_t> logit_member;
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSequence& s = batch[i];
    const int n = catch_up[i].rows;
    if (n == 0) continue;
    // Row j of the head reads the token after row j of the target and row j's hidden state.
    tokens[i].assign(s.tokens.begin() + 1, s.tokens.begin() + n);
    tokens[i].push_back(catch_up[i].next_token);
    for (int j = 0; j < n; ++j) hidden_rows.push_back(step_starts[i] + j);
    StepSequence r;
    r.seq_id = s.seq_id;
    r.tokens = tokens[i];
    r.num_computed = s.num_computed;
    r.block_table = s.block_table;
    rows.push_back(r);
    if (catch_up[i].drafts > 0) {
      logit_rows.push_back(static_cast<int32_t>(hidden_rows.size()) - 1);
      logit_member.push_back(i);
    }
  }
  const bf16* hidden_in = normed;
  int hidden_count = step_rows;
  for (int step = 0; step < opt.num_mtp_drafts; ++step) {
    if (rows.empty()) {
      // NOTE: the ranks of one DP group build the same batches, so they stop together; under
      // DP + EP the others may still be exchanging MoE rows with this one (every head makes
      // num_mtp_drafts exchanges, mtp_graphable).
      if (!dispatch) break;
      if (mtp.layer.moe) enqueue_moe(mtp.layer, 0);
      continue;
    }
    std::copy(hidden_rows.begin(), hidden_rows.end(), mtp_rows_host);
    const Shape sh = upload_batch(rows, 0, width_of(rows, false), logit_rows);
    RELAY_CUDA_CHECK(cudaMemcpyAsync(mtp_rows_dev, mtp_rows_host, hidden_rows.size() * 4,
                                     cudaMemcpyHostToDevice, stream));
    moe_bound_tokens = moe_step_tokens;
    enqueue_mtp(sh, step_meta(sh), hidden_in, hidden_count, mtp_rows_dev);
    const int n = static_cast<int>(logit_rows.size());
    enqueue_greedy_drafts(n, tokens_dev);
    RELAY_CUDA_CHECK(cudaMemcpyAsync(tokens_host, tokens_dev, n * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream));
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int x = 0; x < n; ++x) drafts[logit_member[x]].push_back(tokens_host[x]);
    // The next chained row of each drafting sequence: its last draft at the next position, on
    // the head's output at its last row, until it has its plan's drafts.
    const std::vector<int32_t> prev_rows = logit_rows;
    const std::vector<size_t> prev_members = logit_member;
    rows.clear();
    logit_rows.clear();
    logit_member.clear();
    hidden_rows.clear();
    for (size_t x = 0; x < prev_members.size(); ++x) {
      const size_t i = prev_members[x];
      const StepSequence& s = batch[i];
      const int k = step + 1;  // the chain row this forward computes
      if (k >= catch_up[i].drafts) continue;
      tokens[i] = {drafts[i].back()};
      StepSequence r;
      r.seq_id = s.seq_id;
      r.tokens = tokens[i];
      r.num_computed = catch_up[i].chain_position(k);
      r.block_table = s.block_table;
      rows.push_back(r);
      hidden_rows.push_back(prev_rows[x]);
      logit_rows.push_back(static_cast<int32_t>(hidden_rows.size()) - 1);
      logit_member.push_back(i);
    }
    hidden_in = normed;
    hidden_count = sh.tokens;
  }
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (!lead) return;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].proposed_drafts != nullptr) *batch[i].proposed_drafts = drafts[i];
  }
}

bool RankEngine::mtp_graphable() const {
  // Under DP + EP the head's MoE exchanges meet the other DP groups' heads, graphed, eager or idle
  // (mtp_idle): each makes exactly num_mtp_drafts exchanges, and none sends more rows than its
  // step did, so the graph step's bound (moe_graph_tokens, which the step's moe_step_tokens is
  // within) bounds every exchange of the head too.
  return opt.cuda_graphs && last_shape.per_seq > 0 && opt.num_mtp_drafts >= 1;
}

void RankEngine::propose_mtp_graphed(std::span<const StepSequence> batch,
                                     std::span<const SampledToken> sampled, bool lead) {
  const Shape target = last_shape;
  const int P = target.seqs, q = target.per_seq, W = target.width, K = opt.num_mtp_drafts;
  const int bs = opt.block_size, B = static_cast<int>(batch.size());
  const std::vector<MtpCatchUp> catch_up = plan_mtp_catch_up(batch, sampled, K, bs);
  // The catch-up in the target step's shape. Row j of a sequence reads the token after row j:
  // the next of its tokens while they were accepted, the token sampled after its last accepted
  // one there, and past it (rows whose outputs nobody reads) its rejected drafts.
  std::vector<std::vector<int32_t>> tokens(batch.size());
  std::vector<StepSequence> rows(batch.size());
  std::vector<int32_t> draft_row(P), accepted(batch.size());
  for (int x = 0; x < P; ++x) draft_row[x] = x * q;  // the padding sequences' (ignored)
  for (int i = 0; i < B; ++i) {
    const StepSequence& s = batch[i];
    const int n = static_cast<int>(s.tokens.size());
    accepted[i] = catch_up[i].rows - 1;
    RELAY_CHECK(s.sample && accepted[i] >= 0 && accepted[i] < n, "sequence ", s.seq_id,
                ": MTP catch-up over ", catch_up[i].rows, " of its ", n, " rows in a graph step");
    tokens[i].assign(s.tokens.begin() + 1, s.tokens.end());
    tokens[i].push_back(catch_up[i].next_token);
    tokens[i][accepted[i]] = catch_up[i].next_token;
    rows[i].seq_id = s.seq_id;
    rows[i].tokens = tokens[i];
    rows[i].num_computed = s.num_computed;
    rows[i].block_table = s.block_table;
    draft_row[i] = i * q + accepted[i];
  }
  const Shape catch_shape = upload_batch(rows, P, W, {}, q, draft_row);
  moe_bound_tokens = moe_graph_tokens(q);  // as the target step's graph (mtp_graphable)
  RELAY_CHECK(catch_shape.tokens == target.tokens && catch_shape.seqs == P,
              "the MTP catch-up's shape differs from its graph step's");
  // The hidden rows each forward gathers: the target's rows as they are, then the catch-up's
  // drafting rows, then the chain's rows as they are.
  const int T = catch_shape.tokens;
  std::iota(mtp_rows_host, mtp_rows_host + T, 0);
  std::copy(draft_row.begin(), draft_row.end(), mtp_rows_host + T);
  std::iota(mtp_rows_host + T + P, mtp_rows_host + T + 2 * P, 0);
  RELAY_CUDA_CHECK(cudaMemcpyAsync(mtp_rows_dev, mtp_rows_host, (T + 2 * P) * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream));
  // The chain's metadata: every sequence computes all K - 1 chain rows (one graph), a row of its
  // plan's chain where it has one; past it, a row clamped into the table's width that writes
  // nothing, its draft dropped below.
  const MtpChainMeta c = MtpChainMeta::make(P, W);
  auto fill_rows = [&](int step, int64_t* slots, int32_t* positions, int32_t* contexts) {
    for (int x = 0; x < P; ++x) {
      int32_t pos = 0;
      int64_t slot = -1;
      if (x < B) {
        pos = std::min(catch_up[x].chain_position(step), W * bs - 1);
        if (step < catch_up[x].drafts) slot = int64_t{batch[x].block_table[pos / bs]} * bs + pos % bs;
      }
      slots[x] = slot;
      positions[x] = pos;
      contexts[x] = pos + 1;
    }
  };
  const MetaLayout& m = c.meta;
  auto upload_chain = [&] {
    uint8_t* h = mtp_meta_host;
    auto i32 = [&](size_t off) { return reinterpret_cast<int32_t*>(h + off); };
    std::memset(h, 0, m.bytes);
    fill_rows(1, reinterpret_cast<int64_t*>(h + m.slot_mapping), i32(m.positions),
              i32(m.context_lens));
    for (int x = 0; x < P; ++x) {
      i32(m.logit_rows)[x] = x;
      i32(m.query_starts)[x + 1] = x + 1;
      i32(m.state_slots)[x] = -1;
      i32(m.snapshot_slots)[x] = -1;
      h[m.state_fresh + x] = 1;
      if (x < B) {
        std::copy(batch[x].block_table.begin(), batch[x].block_table.end(),
                  i32(m.block_tables) + static_cast<size_t>(x) * W);
      }
    }
    for (int step = 2; step < K; ++step) {
      fill_rows(step, reinterpret_cast<int64_t*>(h + c.prefix_of(step) + m.slot_mapping),
                i32(c.prefix_of(step) + m.positions), i32(c.context_of(step)));
    }
    RELAY_CUDA_CHECK(cudaMemcpyAsync(mtp_meta_dev, mtp_meta_host, c.bytes(K),
                                     cudaMemcpyHostToDevice, stream));
  };
  if (K >= 2) upload_chain();
  // The head's K forwards and drafts; on device from the catch-up's upload on.
  const Shape chain{P, P, P, W, 1};
  auto enqueue = [&] {
    enqueue_mtp(catch_shape, step_meta(catch_shape), normed, T, mtp_rows_dev);
    enqueue_greedy_drafts(P, mtp_drafts_dev);
    const StepMeta cm = step_meta(chain, mtp_meta_dev);
    for (int step = 1; step < K; ++step) {
      auto d2d = [&](size_t to, const void* from, size_t bytes) {
        RELAY_CUDA_CHECK(cudaMemcpyAsync(mtp_meta_dev + to, from, bytes, cudaMemcpyDeviceToDevice,
                                         stream));
      };
      if (step >= 2) {
        d2d(0, mtp_meta_dev + c.prefix_of(step), c.prefix_bytes);
        d2d(m.context_lens, mtp_meta_dev + c.context_of(step), P * sizeof(int32_t));
      }
      d2d(m.token_ids, mtp_drafts_dev + (step - 1) * P, P * sizeof(int32_t));
      if (step == 1) {
        enqueue_mtp(chain, cm, normed, T, mtp_rows_dev + T);
      } else {
        enqueue_mtp(chain, cm, normed, P, mtp_rows_dev + T + P);
      }
      enqueue_greedy_drafts(P, mtp_drafts_dev + step * P);
    }
  };
  const auto key = std::make_tuple(P, W, q);
  if (auto it = mtp_graphs.find(key); it != mtp_graphs.end()) {
    RELAY_CUDA_CHECK(cudaGraphLaunch(it->second, stream));
  } else {
    mtp_graphs.emplace(key, run_then_capture(enqueue));
  }
  RELAY_CUDA_CHECK(cudaMemcpyAsync(mtp_drafts_host, mtp_drafts_dev, K * P * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream));
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (!lead) return;
  for (int i = 0; i < B; ++i) {
    if (batch[i].proposed_drafts == nullptr) continue;
    std::vector<int32_t>& d = *batch[i].proposed_drafts;
    d.clear();
    for (int step = 0; step < catch_up[i].drafts; ++step) d.push_back(mtp_drafts_host[step * P + i]);
  }
}

}  // namespace relay::cuda_engine

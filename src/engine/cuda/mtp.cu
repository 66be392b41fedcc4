// RankEngine's MTP draft head (model/mtp.h has the forward, engine/after_step.h which rows it
// computes): after a step, the catch-up rows of every sequence in one forward, then K - 1 chained
// forwards of one row per drafting sequence, each drafting greedily on the GPU sampler.
#include "engine/cuda/rank_engine.h"
#include "engine/after_step.h"

namespace relay::cuda_engine {

void RankEngine::enqueue_mtp(const Shape& sh, const bf16* hidden_in, int hidden_rows) {
  const StepMeta m = step_meta(sh);
  const int T = sh.tokens;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  // The inputs first: the hidden rows may be `normed`, which the layer overwrites.
  mark("mtp_gather_hidden");
  kernels::launch_embedding({mtp_rows_dev, hidden_in, mtp_hidden, T, hidden, hidden_rows}, stream);
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
  enqueue_layer(mtp.layer, sh, m);
  mark("mtp_norm");
  kernels::launch_rms_norm({mix, residual, mtp.norm, normed, T, hidden, eps}, stream);
  mark("lm_head");
  kernels::launch_lm_head({normed, m.logit_rows, lm_head, logits, sh.rows, hidden, vocab}, stream);
}

void RankEngine::mtp_idle() {
  for (int step = 0; step < opt.num_mtp_drafts; ++step) {
    if (mtp.layer.moe) enqueue_moe(mtp.layer, 0);
  }
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void RankEngine::propose_mtp(std::span<const StepSequence> batch,
                             std::span<const SampledToken> sampled, bool lead) {
  const std::vector<MtpCatchUp> catch_up = plan_mtp_catch_up(batch, sampled);
  // The step's token rows (a graph step's include its fillers): where each sequence's hidden rows
  // are in `normed`. upload_batch below replaces `flat`.
  const std::vector<int32_t> step_starts = flat.query_starts;
  const int step_rows = step_starts.back();
  const int bs = opt.block_size;
  std::vector<std::vector<int32_t>> drafts(batch.size()), tokens(batch.size());
  std::vector<int32_t> chain_at(batch.size(), -1);  // the position of each chain's next row
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
    if (s.sample && s.proposed_drafts != nullptr) {
      logit_rows.push_back(static_cast<int32_t>(hidden_rows.size()) - 1);
      logit_member.push_back(i);
      chain_at[i] = s.num_computed + n;
    }
  }
  const bf16* hidden_in = normed;
  int hidden_count = step_rows;
  for (int step = 0; step < opt.num_mtp_drafts; ++step) {
    if (rows.empty()) {
      // NOTE: the ranks of one DP group build the same batches, so they stop together; under
      // DP + EP the others may still be exchanging MoE rows with this one.
      if (!dispatch) break;
      if (mtp.layer.moe) enqueue_moe(mtp.layer, 0);
      continue;
    }
    std::copy(hidden_rows.begin(), hidden_rows.end(), mtp_rows_host);
    const Shape sh = upload_batch(rows, 0, width_of(rows, false), logit_rows);
    RELAY_CUDA_CHECK(cudaMemcpyAsync(mtp_rows_dev, mtp_rows_host, hidden_rows.size() * 4,
                                     cudaMemcpyHostToDevice, stream));
    moe_bound_tokens = moe_step_tokens;
    enqueue_mtp(sh, hidden_in, hidden_count);
    // Greedy drafts on the sampler (temperature 0: its arg-max).
    const int n = static_cast<int>(logit_rows.size());
    for (int x = 0; x < n; ++x) sample_rows_host[x] = kernels::SampleRowParams{};
    launch_sampling(n, 0, false, {}, {}, {});
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int x = 0; x < n; ++x) drafts[logit_member[x]].push_back(tokens_host[x]);
    // The next chained row of each drafting sequence: its last draft at the next position, on
    // the head's output at its last row; a chain stops where its blocks (with the scheduler's
    // lookahead) end.
    const std::vector<int32_t> prev_rows = logit_rows;
    const std::vector<size_t> prev_members = logit_member;
    rows.clear();
    logit_rows.clear();
    logit_member.clear();
    hidden_rows.clear();
    for (size_t x = 0; x < prev_members.size(); ++x) {
      const size_t i = prev_members[x];
      const StepSequence& s = batch[i];
      if (chain_at[i] >= static_cast<int64_t>(s.block_table.size()) * bs) continue;
      tokens[i] = {drafts[i].back()};
      StepSequence r;
      r.seq_id = s.seq_id;
      r.tokens = tokens[i];
      r.num_computed = chain_at[i];
      r.block_table = s.block_table;
      rows.push_back(r);
      hidden_rows.push_back(prev_rows[x]);
      logit_rows.push_back(static_cast<int32_t>(hidden_rows.size()) - 1);
      logit_member.push_back(i);
      chain_at[i] += 1;
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

}  // namespace relay::cuda_engine

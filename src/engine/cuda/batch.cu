// RankEngine's step plumbing: batch checks, the metadata upload, the decode graph cache, warm-up.
#include "engine/cuda/rank_engine.h"
#include "engine/after_step.h"
#include "engine/step_check.h"

namespace relay::cuda_engine {

void RankEngine::check_batch(std::span<const StepSequence> batch) const {
  int tokens = 0;
  const int bs = opt.block_size;
  const StepLimits limits{vocab, bs, opt.max_draft_tokens, kMaxLogprobs, "the CUDA backend"};
  for (const StepSequence& s : batch) {
    check_step_sequence(s, limits);
    for (int32_t id : s.tokens) {
      RELAY_CHECK(id >= 0 && id < vocab, "token ", id, " of sequence ", s.seq_id,
                  " is outside the vocabulary of ", vocab);
    }
    tokens += static_cast<int>(s.tokens.size());
    RELAY_CHECK(static_cast<int64_t>(s.block_table.size()) <= max_blocks, "sequence ", s.seq_id,
                " has ", s.block_table.size(), " blocks; max_position_embeddings allows ",
                max_blocks);
    for (int32_t b : s.block_table) {
      RELAY_CHECK(b >= 0 && b < kv_layout.num_blocks, "sequence ", s.seq_id, " uses block ", b,
                  " outside the pool of ", kv_layout.num_blocks);
    }
    if (state_pool == nullptr) continue;
    // The recurrent state: a slot per sequence and one per draft, on this DP rank.
    RELAY_CHECK(s.state_slots.size() >= 1 + static_cast<size_t>(s.num_draft_tokens), "sequence ",
                s.seq_id, " brings ", s.state_slots.size(), " recurrent-state slots for ",
                s.num_draft_tokens, " drafts; ", cfg.architecture,
                " needs one slot more than its drafts");
    for (size_t i = 0; i < s.state_slots.size(); ++i) local_state_slot(s, i);
    if (s.restore_state_snapshot >= 0) {
      RELAY_CHECK(s.num_computed > 0 && s.num_draft_tokens == 0, "sequence ", s.seq_id,
                  " restores a state snapshot at position ", s.num_computed, " with ",
                  s.num_draft_tokens, " drafts (a restore continues a prompt past a prefix hit)");
      snapshot_pool_slot(s, s.restore_state_snapshot);
    }
    for (const SnapshotSave& save : s.save_state_snapshots) {
      RELAY_CHECK(save.row >= 0 && static_cast<size_t>(save.row) < s.tokens.size(), "sequence ",
                  s.seq_id, ": state snapshot after row ", save.row, " of its ", s.tokens.size(),
                  " tokens");
      snapshot_pool_slot(s, save.snapshot);
    }
  }
  RELAY_CHECK(tokens <= opt.max_num_tokens, "step has ", tokens,
              " tokens; the CUDA backend was sized for ", opt.max_num_tokens);
  RELAY_CHECK(batch.size() <= static_cast<size_t>(opt.max_num_seqs), "step has ", batch.size(),
              " sequences; the CUDA backend was sized for ", opt.max_num_seqs);
}

RankEngine::Shape RankEngine::upload_batch(std::span<const StepSequence> batch, int pad_seqs, int width,
                   const std::vector<int32_t>& rows, int per_seq,
                   std::span<const int32_t> graph_rows) {
  const bool graph = pad_seqs > 0;
  int tokens = 0;
  for (const StepSequence& s : batch) tokens += static_cast<int>(s.tokens.size());
  const int seqs = std::max<int>(pad_seqs, static_cast<int>(batch.size()));
  if (graph) tokens = seqs * per_seq;
  const bool every_row = graph && graph_rows.empty();
  const int num_rows = every_row ? tokens
                       : graph   ? static_cast<int>(graph_rows.size())
                                 : static_cast<int>(rows.size());
  RELAY_CHECK(tokens <= opt.max_num_tokens && seqs <= opt.max_num_seqs &&
                  num_rows <= logit_rows(),
              "step of ", tokens, " tokens, ", seqs, " sequences and ", num_rows,
              " logit rows; the CUDA backend was sized for ", opt.max_num_tokens, ", ",
              opt.max_num_seqs, " and ", logit_rows());
  const MetaLayout m = MetaLayout::make(tokens, seqs, num_rows, width);
  RELAY_CHECK(m.bytes <= meta_capacity, "batch metadata of ", m.bytes, " bytes exceeds ",
              meta_capacity);
  const int bs = opt.block_size;
  flat.reset(width);
  for (const StepSequence& s : batch) {
    flat.append(s.tokens, s.num_computed, s.block_table, bs,
                graph ? per_seq - static_cast<int>(s.tokens.size()) : 0);
  }
  for (int i = static_cast<int>(batch.size()); i < seqs; ++i) flat.append_padding(per_seq);
  auto put = [&](size_t offset, const auto& v) {
    std::memcpy(meta_host + offset, v.data(), v.size() * sizeof(v[0]));
  };
  put(m.token_ids, flat.token_ids);
  put(m.positions, flat.positions);
  put(m.slot_mapping, flat.slot_mapping);
  put(m.query_starts, flat.query_starts);
  put(m.context_lens, flat.context_lens);
  put(m.block_tables, flat.block_tables);
  auto* logit_rows = reinterpret_cast<int32_t*>(meta_host + m.logit_rows);
  if (every_row) {
    for (int r = 0; r < num_rows; ++r) logit_rows[r] = r;
  } else if (graph) {
    std::copy(graph_rows.begin(), graph_rows.end(), logit_rows);
  } else {
    std::copy(rows.begin(), rows.end(), logit_rows);
  }
  // The step's device time starts here, after the host built the metadata.
  RELAY_CUDA_CHECK(cudaEventRecord(step_begin, stream));
  // The recurrent state (hybrid models): each sequence's slot, fresh at position 0; the rows
  // whose states a rollback or a prefix-cache save may want copied into slots as they pass; the
  // snapshots restored before the layers run. Padding and batches without slots (warm-up) get
  // slot -1: computed from a zero state, nothing kept.
  auto* state_slot = reinterpret_cast<int32_t*>(meta_host + m.state_slots);
  auto* snapshot = reinterpret_cast<int32_t*>(meta_host + m.snapshot_slots);
  auto* fresh = reinterpret_cast<uint8_t*>(meta_host + m.state_fresh);
  std::fill_n(state_slot, seqs, -1);
  std::fill_n(snapshot, tokens, -1);
  std::fill_n(fresh, seqs, uint8_t{1});
  for (size_t i = 0; i < batch.size() && state_pool != nullptr; ++i) {
    const StepSequence& s = batch[i];
    if (s.state_slots.empty()) continue;
    state_slot[i] = local_state_slot(s, 0);
    fresh[i] = s.num_computed == 0 ? 1 : 0;
    const int k = s.num_draft_tokens, n = static_cast<int>(s.tokens.size());
    const int last = flat.query_starts[i] + n - 1;  // its last real row
    for (int j = 0; j < k; ++j) snapshot[last - k + j] = local_state_slot(s, 1 + j);
    if (graph && per_seq > n) {
      // Its fillers move the state on past its last row: that row's state goes to a draft slot.
      RELAY_CHECK(s.state_slots.size() > static_cast<size_t>(k) + 1, "sequence ", s.seq_id,
                  " is padded from ", n, " to ", per_seq, " tokens in a verify graph with ",
                  s.state_slots.size(), " recurrent-state slots (needs 1 + num_speculative_tokens)");
      snapshot[last] = local_state_slot(s, 1 + k);
    } else if (k == 0) {
      for (const SnapshotSave& save : s.save_state_snapshots)
        snapshot[flat.query_starts[i] + save.row] = snapshot_pool_slot(s, save.snapshot);
    }
    if (s.restore_state_snapshot >= 0)
      copy_state_slot(state_slot[i], snapshot_pool_slot(s, s.restore_state_snapshot));
  }
  RELAY_CUDA_CHECK(cudaMemcpyAsync(meta_dev, meta_host, m.bytes, cudaMemcpyHostToDevice, stream));
  return Shape{tokens, seqs, num_rows, width, graph ? per_seq : 0};
}

int RankEngine::width_of(std::span<const StepSequence> batch, bool pow2, int min_width) const {
  int w = min_width;
  for (const StepSequence& s : batch) w = std::max(w, static_cast<int>(s.block_table.size()));
  if (!pow2) return w;
  int p = 16;
  while (p < w) p *= 2;
  return std::min(p, std::max(w, max_blocks));
}

int RankEngine::graph_tokens_per_seq(std::span<const StepSequence> batch) const {
  if (!opt.cuda_graphs || batch.empty() || static_cast<int>(batch.size()) > opt.max_num_seqs)
    return 0;
  int q = 1;
  for (const StepSequence& s : batch) {
    if (!s.sample || static_cast<int>(s.tokens.size()) != 1 + s.num_draft_tokens) return 0;
    q = std::max(q, 1 + s.num_draft_tokens);
  }
  for (const StepSequence& s : batch) {  // the fillers' positions stay within the tables' width
    if ((s.num_computed + q + opt.block_size - 1) / opt.block_size > max_blocks) return 0;
  }
  const int padded = std::min(bucket_of(static_cast<int>(batch.size())), opt.max_num_seqs);
  return padded * q <= opt.max_num_tokens ? q : 0;
}

int RankEngine::step_tokens(std::span<const StepSequence> batch) const {
  if (batch.empty()) return 0;
  if (const int q = graph_tokens_per_seq(batch); q > 0)
    return std::min(bucket_of(static_cast<int>(batch.size())), opt.max_num_seqs) * q;
  int tokens = 0;
  for (const StepSequence& s : batch) tokens += static_cast<int>(s.tokens.size());
  return tokens;
}

RankEngine::Shape RankEngine::run(std::span<const StepSequence> batch, const std::vector<int32_t>& rows) {
  const int q = graph_tokens_per_seq(batch);
  if (q == 0 || (dispatch && moe_step_tokens > moe_graph_tokens(q))) {
    const Shape sh = upload_batch(batch, 0, width_of(batch, false), rows);
    moe_bound_tokens = moe_step_tokens;
    enqueue_forward(sh);
    last_shape = sh;
    return sh;
  }
  moe_bound_tokens = moe_graph_tokens(q);  // what the captured graph keeps
  const int padded = std::min(bucket_of(static_cast<int>(batch.size())), opt.max_num_seqs);
  // The fillers' positions run up to q - 1 past a sequence's drafts: the table covers them too.
  int reach = 1;
  for (const StepSequence& s : batch) reach = std::max(reach, (s.num_computed + q + opt.block_size - 1) / opt.block_size);
  const int width = width_of(batch, true, reach);
  const Shape sh = upload_batch(batch, padded, width, rows, q);
  const auto key = std::make_tuple(padded, width, q);
  auto it = graphs.find(key);
  last_shape = sh;
  if (it != graphs.end()) {
    RELAY_CUDA_CHECK(cudaGraphLaunch(it->second, stream));
    return sh;
  }
  graphs.emplace(key, run_then_capture([&] { enqueue_forward(sh); }));
  return sh;
}

cudaGraphExec_t RankEngine::run_then_capture(const std::function<void()>& enqueue) {
  enqueue();
  cudaGraph_t graph = nullptr;
  RELAY_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  RELAY_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  RELAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  RELAY_CUDA_CHECK(cudaGraphDestroy(graph));
  return exec;
}

void RankEngine::finish_step() {
  RELAY_CUDA_CHECK(cudaEventRecord(step_end, stream));
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  float ms = 0.0f;
  RELAY_CUDA_CHECK(cudaEventElapsedTime(&ms, step_begin, step_end));
  last_step_device_ms = ms;
}

void RankEngine::warm_up_alone() {
  const bool tp = tp_reduce, moe = moe_reduce, disp = dispatch;
  tp_reduce = moe_reduce = dispatch = false;
  const int cap = std::min({opt.max_num_tokens, max_blocks * opt.block_size,
                            kv_layout.num_blocks * opt.block_size});
  std::vector<int32_t> tokens(cap, 0), table((cap + opt.block_size - 1) / opt.block_size);
  std::iota(table.begin(), table.end(), 0);
  std::vector<int> sizes;
  for (int n = 1; n < cap; n *= 2) sizes.push_back(n);
  sizes.push_back(cap);
  for (int n : sizes) {
    StepSequence s;
    s.tokens = std::span<const int32_t>(tokens).first(n);
    s.block_table = std::span<const int32_t>(table).first((n + opt.block_size - 1) / opt.block_size);
    const std::vector<StepSequence> batch{s};
    std::vector<int32_t> rows(std::min(n, logit_rows()));  // the LM head's row buckets too
    std::iota(rows.begin(), rows.end(), n - static_cast<int>(rows.size()));
    const Shape sh = upload_batch(batch, 0, width_of(batch, false), rows);
    enqueue_forward(sh);
    if (mtp.present) {  // the head's GEMMs (its fc halves are shapes of their own) on every row
      std::iota(mtp_rows_host, mtp_rows_host + n, 0);
      RELAY_CUDA_CHECK(cudaMemcpyAsync(mtp_rows_dev, mtp_rows_host, size_t(n) * 4,
                                       cudaMemcpyHostToDevice, stream));
      enqueue_mtp(sh, step_meta(sh), normed, n, mtp_rows_dev);
    }
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  RELAY_CUDA_CHECK(cudaMemsetAsync(kv_pool, 0, kv_layout.total_bytes(), stream));
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  tp_reduce = tp, moe_reduce = moe, dispatch = disp;
}

int RankEngine::local_state_slot(const StepSequence& s, size_t i) const {
  const int slot = s.state_slots[i] - dp_rank * state_slots;
  RELAY_CHECK(slot >= 0 && slot < state_slots, "sequence ", s.seq_id, ": recurrent-state slot ",
              s.state_slots[i], " is not on its DP rank ", dp_rank, " (", state_slots,
              " slots per rank)");
  return slot;
}

int RankEngine::snapshot_pool_slot(const StepSequence& s, int32_t id) const {
  const int local = id - dp_rank * state_snapshots;
  RELAY_CHECK(local >= 0 && local < state_snapshots, "sequence ", s.seq_id, ": state snapshot ",
              id, " is not on its DP rank ", dp_rank, " (", state_snapshots, " snapshots per rank)");
  return state_slots + local;  // the snapshots follow the slots in the pool
}

void RankEngine::settle_draft_states(std::span<const StepSequence> batch,
                                     std::span<const SampledToken> sampled) {
  if (state_pool == nullptr) return;
  const std::vector<std::span<const SampledToken>> runs = tokens_per_sequence(batch, sampled);
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSequence& s = batch[i];
    const bool padded = last_shape.per_seq > 1 + s.num_draft_tokens;
    if (runs[i].empty() || s.state_slots.empty() || (s.num_draft_tokens == 0 && !padded)) continue;
    for (const StateCopy& c : draft_state_copies(s, runs[i].size() - 1, padded)) {
      copy_state_slot(c.to_snapshot >= 0 ? snapshot_pool_slot(s, c.to_snapshot)
                                         : local_state_slot(s, static_cast<size_t>(c.to_slot)),
                      local_state_slot(s, static_cast<size_t>(c.from)));
    }
  }
}

void RankEngine::idle_step() {
  moe_bound_tokens = moe_step_tokens;
  enqueue_idle();
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace relay::cuda_engine

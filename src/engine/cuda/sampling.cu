// RankEngine's sampler driver: a step's sampled and scored rows, logits and op profiles.
#include "engine/cuda/rank_engine.h"

namespace relay::cuda_engine {

void RankEngine::stage_constraints(const StepSequence& s, int first, int rows,
                                   std::vector<uint32_t>& masks, std::vector<int32_t>& bias_tokens,
                                   std::vector<float>& bias_values) const {
  const size_t words = token_bitmask_words(vocab);
  for (int j = 0; j < rows; ++j) {
    kernels::SampleRowParams& row = sample_rows_host[first + j];
    if (!s.allowed_tokens.empty()) {
      row.mask_row = static_cast<int32_t>(masks.size() / words);
      const auto mask = s.allowed_tokens.subspan(size_t(j) * words, words);
      masks.insert(masks.end(), mask.begin(), mask.end());
    }
    row.bias_begin = static_cast<int32_t>(bias_tokens.size());
    row.bias_count = static_cast<int32_t>(s.logit_bias.size());
    for (const auto& [token, bias] : s.logit_bias) {
      bias_tokens.push_back(token);
      bias_values.push_back(bias);
    }
  }
}

void RankEngine::launch_sampling(int n, int max_logprobs, bool scored,
                                 const std::vector<uint32_t>& masks,
                                 const std::vector<int32_t>& bias_tokens,
                                 const std::vector<float>& bias_values) {
  kernels::SampleParams p{.logits = logits, .rows = sample_rows_dev, .tokens = tokens_dev,
                          .logprobs = logprobs_dev, .top_ids = top_ids_dev,
                          .top_logprobs = top_lp_dev, .ranks = ranks_dev,
                          .num_rows = n, .vocab_size = vocab, .max_logprobs = max_logprobs};
  if (!masks.empty() || !bias_tokens.empty()) {
    // NOTE: staged from pageable memory, which the copy reads before it returns.
    const size_t nb = bias_tokens.size(), mask_bytes = align_up(masks.size() * 4, 16);
    const size_t bias_bytes = align_up(nb * 4, 16);
    auto* base = static_cast<uint8_t*>(
        constraints_ws.get(mask_bytes + 3 * bias_bytes + 16, stream, "token constraints"));
    auto up = [&](void* dst, const void* src, size_t bytes) {
      if (bytes) RELAY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    };
    p.allowed = reinterpret_cast<const uint32_t*>(base);
    p.mask_words = masks.empty() ? 0 : static_cast<int>(token_bitmask_words(vocab));
    p.bias_tokens = reinterpret_cast<const int32_t*>(base + mask_bytes);
    p.bias_values = reinterpret_cast<const float*>(base + mask_bytes + bias_bytes);
    p.bias_raw = reinterpret_cast<float*>(base + mask_bytes + 2 * bias_bytes);
    up(base, masks.data(), masks.size() * 4);
    up(base + mask_bytes, bias_tokens.data(), nb * 4);
    up(base + mask_bytes + bias_bytes, bias_values.data(), nb * 4);
  }
  RELAY_CUDA_CHECK(cudaMemcpyAsync(sample_rows_dev, sample_rows_host,
                                   n * sizeof(kernels::SampleRowParams), cudaMemcpyHostToDevice,
                                   stream));
  kernels::launch_sample(p, stream);
  auto down = [&](void* dst, const void* src, size_t bytes) {
    RELAY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  };
  down(tokens_host, tokens_dev, n * 4);
  down(logprobs_host, logprobs_dev, n * 4);
  if (scored) down(ranks_host, ranks_dev, n * 4);
  if (max_logprobs > 0) {
    down(top_ids_host, top_ids_dev, size_t(n) * max_logprobs * 4);
    down(top_lp_host, top_lp_dev, size_t(n) * max_logprobs * 4);
  }
}

TokenLogprob RankEngine::sampled_row(int r, int max_logprobs, int top) const {
  TokenLogprob tok;
  tok.token = tokens_host[r];
  tok.logprob = logprobs_host[r];
  for (int m = 0; m < top; ++m) {
    tok.top.emplace_back(top_ids_host[r * max_logprobs + m], top_lp_host[r * max_logprobs + m]);
  }
  return tok;
}

std::vector<SampledToken> RankEngine::step(std::span<const StepSequence> batch, bool sample) {
  std::vector<int32_t> rows;
  std::vector<const StepSequence*> samplers;
  std::vector<int> first_row;  // samplers[i]'s rows start at rows[first_row[i]]
  struct Scored {
    const StepSequence* seq;
    size_t index;  // in *seq->prompt_logprobs
    int32_t row, target;
  };
  std::vector<Scored> scored;  // prompt logprob rows, by sequence then row
  int t = 0;
  for (const StepSequence& s : batch) {
    const size_t n = s.num_prompt_logprob_rows();
    if (sample && s.num_prompt_logprobs >= 0) s.prompt_logprobs->assign(n, TokenLogprob{});
    for (size_t j = 0; j < n && sample; ++j) {
      scored.push_back({&s, j, t + static_cast<int32_t>(j), s.prompt_tokens[s.num_computed + j + 1]});
    }
    t += static_cast<int>(s.tokens.size());
    if (!s.sample) continue;
    samplers.push_back(&s);
    first_row.push_back(static_cast<int>(rows.size()));
    for (int j = s.num_draft_tokens; j >= 0; --j) rows.push_back(t - 1 - j);
  }
  // The first chunk of scored rows rides on the step's LM head, after the sampled rows.
  const size_t chunk = static_cast<size_t>(logit_rows());
  const size_t scored_first = std::min(scored.size(), chunk - rows.size());
  for (size_t i = 0; i < scored_first; ++i) rows.push_back(scored[i].row);
  const Shape sh = run(batch, rows);
  // A TP rank that does not sample settles its drafted states later (settle_draft_states).
  if ((samplers.empty() && scored.empty()) || !sample) {
    finish_step();
    return {};
  }
  RELAY_CHECK(scored.empty() || sh.per_seq == 0, "prompt logprobs in a CUDA graph step");
  // Logits row r belongs to rows[r] in an eager step. A graph step computes every token row, each
  // sequence's per_seq of them (its last token's, its drafts', then fillers) one after another
  // and the padding's after the real ones; its sequences all sample, and the sampler draws every
  // row of theirs (the fillers' draws go unused).
  int rows_each = 0;  // a graph step's rows per sequence
  if (sh.per_seq > 0) {
    rows_each = sh.per_seq;
    for (size_t i = 0; i < samplers.size(); ++i) first_row[i] = static_cast<int>(i) * rows_each;
  }
  int max_logprobs = 0;
  std::vector<uint32_t> masks;
  std::vector<int32_t> bias_tokens;
  std::vector<float> bias_values;
  for (size_t i = 0; i < samplers.size(); ++i) {
    const StepSequence& s = *samplers[i];
    const SamplingParams& sp = *s.sampling;
    for (int j = 0; j < std::max(rows_each, 1 + s.num_draft_tokens); ++j) {
      sample_rows_host[first_row[i] + j] = {sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                            sample_uniform(sp.seed, s.sample_index + j)};
    }
    if (!needs_host_sampling(sp)) {
      stage_constraints(s, first_row[i], 1 + s.num_draft_tokens, masks, bias_tokens,
                        bias_values);
    }
    max_logprobs = std::max(max_logprobs, std::min(sp.num_logprobs, kMaxLogprobs));
  }
  for (const Scored& sc : scored) max_logprobs = std::max(max_logprobs, sc.seq->num_prompt_logprobs);
  const int sampled_rows = sh.per_seq > 0 ? static_cast<int>(samplers.size()) * rows_each
                                          : static_cast<int>(rows.size() - scored_first);
  auto score_rows = [&](size_t begin, size_t end, int at) {  // scored[begin, end) from row `at`
    for (size_t i = begin; i < end; ++i) {
      kernels::SampleRowParams& p = sample_rows_host[at + static_cast<int>(i - begin)];
      p = {};
      p.score_token = scored[i].target;
    }
  };
  auto collect_scores = [&](size_t begin, size_t end, int at) {
    for (size_t i = begin; i < end; ++i) {
      const StepSequence& s = *scored[i].seq;
      const int r = at + static_cast<int>(i - begin);
      TokenLogprob& lp = (*s.prompt_logprobs)[scored[i].index];
      lp = sampled_row(r, max_logprobs, s.num_prompt_logprobs);
      lp.rank = ranks_host[r];
    }
  };
  score_rows(0, scored_first, sampled_rows);
  launch_sampling(sampled_rows + static_cast<int>(scored_first), max_logprobs, scored_first > 0,
                  masks, bias_tokens, bias_values);
  finish_step();
  collect_scores(0, scored_first, sampled_rows);
  std::vector<SampledToken> out;
  std::vector<float> host_rows;
  for (size_t i = 0; i < samplers.size(); ++i) {
    const StepSequence& s = *samplers[i];
    const SamplingParams& sp = *s.sampling;
    const int r0 = first_row[i], k = s.num_draft_tokens;
    const std::span<const int32_t> drafts = s.tokens.last(static_cast<size_t>(k));
    std::vector<SampledToken> got;
    if (needs_host_sampling(sp)) {  // penalties: the shared sampler on this sequence's rows
      host_rows.resize(size_t(k + 1) * vocab);
      RELAY_CUDA_CHECK(cudaMemcpy(host_rows.data(), logits + size_t(r0) * vocab,
                                  host_rows.size() * 4, cudaMemcpyDeviceToHost));
      got = sample_with_drafts(host_rows, drafts, sp, s.prompt_tokens, s.output_tokens,
                               s.sample_index, {s.allowed_tokens, s.logit_bias},
                               opt.forced_draft_acceptance);
    } else {
      const int top = std::min(sp.num_logprobs, kMaxLogprobs);
      got = verify_drafts(drafts, sp.seed, s.sample_index, opt.forced_draft_acceptance,
                          [&](size_t j) {
                            SampledToken tok;
                            const int r = r0 + static_cast<int>(j);
                            if (sp.num_logprobs >= 0) {
                              static_cast<TokenLogprob&>(tok) = sampled_row(r, max_logprobs, top);
                            } else {
                              tok.token = tokens_host[r];
                            }
                            return tok;
                          });
    }
    for (SampledToken& tok : got) {
      tok.seq_id = s.seq_id;
      out.push_back(std::move(tok));
    }
  }
  // A hybrid model's states after the last accepted tokens (and the snapshots at accepted rows).
  settle_draft_states(batch, out);
  // The rest of the scored rows (the host samplers have read their logits): the LM head again
  // over each chunk of them.
  for (size_t begin = scored_first; begin < scored.size(); begin += chunk) {
    const size_t end = std::min(scored.size(), begin + chunk);
    const int n = static_cast<int>(end - begin);
    const MetaLayout m = MetaLayout::make(sh.tokens, sh.seqs, sh.rows, sh.width);
    auto* host_rows = reinterpret_cast<int32_t*>(meta_host + m.logit_rows);
    for (int i = 0; i < n; ++i) host_rows[i] = scored[begin + i].row;
    RELAY_CUDA_CHECK(cudaMemcpyAsync(meta_dev + m.logit_rows, host_rows, n * 4,
                                     cudaMemcpyHostToDevice, stream));
    kernels::launch_lm_head({normed, reinterpret_cast<const int32_t*>(meta_dev + m.logit_rows),
                             lm_head, logits, n, hidden, vocab},
                            stream);
    score_rows(begin, end, 0);
    launch_sampling(n, max_logprobs, true, {}, {}, {});
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    collect_scores(begin, end, 0);
  }
  return out;
}

std::vector<float> RankEngine::forward_logits(std::span<const StepSequence> batch, CudaBackend::LogitRows which) {
  std::vector<int32_t> all_rows;
  int t = 0;
  for (const StepSequence& s : batch) {
    const int n = static_cast<int>(s.tokens.size());
    if (which == CudaBackend::LogitRows::kLastTokens) {
      all_rows.push_back(t + n - 1);
    } else {
      for (int j = 0; j < n; ++j) all_rows.push_back(t + j);
    }
    t += n;
  }
  // The logits buffer holds logit_rows() rows: run the LM head in chunks over the final hidden.
  const int chunk = logit_rows();
  std::vector<int32_t> first(all_rows.begin(),
                             all_rows.begin() + std::min<size_t>(chunk, all_rows.size()));
  const Shape sh = upload_batch(batch, 0, width_of(batch, false), first);
  moe_bound_tokens = moe_step_tokens;
  enqueue_forward(sh);
  std::vector<float> out(all_rows.size() * size_t(vocab));
  for (size_t begin = 0; begin < all_rows.size(); begin += chunk) {
    const int n = static_cast<int>(std::min<size_t>(chunk, all_rows.size() - begin));
    if (begin > 0) {
      const MetaLayout m = MetaLayout::make(sh.tokens, sh.seqs, sh.rows, sh.width);
      RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));  // meta_host is reused
      std::copy_n(all_rows.begin() + begin, n,
                  reinterpret_cast<int32_t*>(meta_host + m.logit_rows));
      RELAY_CUDA_CHECK(cudaMemcpyAsync(meta_dev + m.logit_rows, meta_host + m.logit_rows, n * 4,
                                       cudaMemcpyHostToDevice, stream));
      kernels::launch_lm_head({normed, reinterpret_cast<const int32_t*>(meta_dev + m.logit_rows),
                               lm_head, logits, n, hidden, vocab},
                              stream);
    }
    RELAY_CUDA_CHECK(cudaMemcpyAsync(out.data() + begin * vocab, logits, size_t(n) * vocab * 4,
                                     cudaMemcpyDeviceToHost, stream));
  }
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

std::vector<OpTiming> RankEngine::profile_forward(std::span<const StepSequence> batch) {
  std::vector<int32_t> rows;
  int t = 0;
  for (const StepSequence& s : batch) {
    t += static_cast<int>(s.tokens.size());
    rows.push_back(t - 1);  // each sequence's last token, as a step samples it
  }
  const Shape sh = batch.empty() ? Shape{} : upload_batch(batch, 0, width_of(batch, false), rows);
  moe_bound_tokens = moe_step_tokens;
  auto enqueue = [&] { batch.empty() ? enqueue_idle() : enqueue_forward(sh); };
  enqueue();  // warm-up: workspaces, cuBLASLt plans, lazy module loads
  RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  OpMarks m;
  m.hold(stream);
  marks = &m;
  try {
    enqueue();
  } catch (...) {
    marks = nullptr;
    m.release();
    cudaStreamSynchronize(stream);
    throw;
  }
  marks = nullptr;
  m.finish(stream);
  std::vector<OpTiming> out;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < m.names.size(); ++i) {
    float ms = 0.0f;
    RELAY_CUDA_CHECK(cudaEventElapsedTime(&ms, m.starts[i], m.ends[i]));
    auto [it, fresh] = index.emplace(m.names[i], out.size());
    if (fresh) out.push_back({m.names[i], 0, 0.0});
    out[it->second].calls += 1;
    out[it->second].ms += ms;
  }
  return out;
}

}  // namespace relay::cuda_engine

// See cpu_backend.h.
#include "engine/cpu_backend.h"

#include <algorithm>

#include "core/error.h"
#include "engine/sampler.h"
#include "model/registry.h"

namespace relay {

namespace {

KvCacheLayout pool_layout(const Model& model, const CpuBackendOptions& o) {
  RELAY_CHECK(o.block_size > 0, "block_size must be positive, got ", o.block_size);
  if (o.num_blocks > 0) return model.kv_layout(o.block_size, o.num_blocks);
  const ModelConfig& c = model.config();
  return KvCacheLayout::from_budget(static_cast<int>(c.num_hidden_layers), static_cast<int>(c.num_key_value_heads),
                                    static_cast<int>(c.head_dim), o.block_size, sizeof(float), o.kv_cache_bytes);
}

}  // namespace

CpuBackend::CpuBackend(const std::filesystem::path& model_dir, const CpuBackendOptions& options)
    : model_(load_model(model_dir)), kv_(pool_layout(*model_, options)), pool_(options.num_threads) {}

void CpuBackend::build_batch(std::span<const StepSequence> batch, const LogitRows* rows) {
  RELAY_CHECK(!batch.empty(), "step with an empty batch");
  const int bs = block_size();
  size_t max_blocks = 1;
  for (const StepSequence& s : batch) max_blocks = std::max(max_blocks, s.block_table.size());
  token_ids_.clear();
  positions_.clear();
  slot_mapping_.clear();
  query_starts_.assign(1, 0);
  context_lens_.clear();
  block_tables_.assign(batch.size() * max_blocks, 0);
  logit_rows_.clear();
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSequence& s = batch[i];
    RELAY_CHECK(!s.tokens.empty(), "sequence ", s.seq_id, " has no tokens in this step");
    RELAY_CHECK(s.num_computed >= 0, "sequence ", s.seq_id, " has num_computed ", s.num_computed);
    const int64_t context = s.num_computed + static_cast<int64_t>(s.tokens.size());
    RELAY_CHECK(static_cast<int64_t>(s.block_table.size()) * bs >= context, "sequence ", s.seq_id, " needs ",
                context, " KV slots but its block table has ", s.block_table.size(), " blocks of ", bs);
    std::copy(s.block_table.begin(), s.block_table.end(), block_tables_.begin() + i * max_blocks);
    for (size_t j = 0; j < s.tokens.size(); ++j) {
      const int32_t pos = s.num_computed + static_cast<int32_t>(j);
      token_ids_.push_back(s.tokens[j]);
      positions_.push_back(pos);
      slot_mapping_.push_back(static_cast<int64_t>(s.block_table[pos / bs]) * bs + pos % bs);
    }
    query_starts_.push_back(static_cast<int32_t>(token_ids_.size()));
    context_lens_.push_back(static_cast<int32_t>(context));
    const int32_t last = query_starts_.back() - 1;
    if (rows == nullptr) {
      if (s.sample) logit_rows_.push_back(last);
    } else if (*rows == LogitRows::kLastTokens) {
      logit_rows_.push_back(last);
    } else {
      for (int32_t r = query_starts_[i]; r <= last; ++r) logit_rows_.push_back(r);
    }
  }
  forward_batch_ = ForwardBatch{token_ids_, positions_, query_starts_, context_lens_, block_tables_,
                                static_cast<int>(max_blocks), slot_mapping_, logit_rows_};
}

std::vector<SampledToken> CpuBackend::step(std::span<const StepSequence> batch) {
  build_batch(batch, nullptr);
  model_->forward(forward_batch_, kv_, pool_, logits_);
  std::vector<SampledToken> out;
  const size_t vocab = static_cast<size_t>(model_->vocab_size());
  size_t row = 0;
  for (const StepSequence& s : batch) {
    if (!s.sample) continue;
    RELAY_CHECK(s.sampling != nullptr, "sequence ", s.seq_id, " samples but has no SamplingParams");
    std::span<float> logits(logits_.data() + row * vocab, vocab);
    SampledToken t = sample_token(logits, *s.sampling, s.prompt_tokens, s.output_tokens, s.sample_index);
    t.seq_id = s.seq_id;
    out.push_back(std::move(t));
    ++row;
  }
  return out;
}

std::vector<float> CpuBackend::forward_logits(std::span<const StepSequence> batch, LogitRows rows) {
  build_batch(batch, &rows);
  std::vector<float> logits;
  model_->forward(forward_batch_, kv_, pool_, logits);
  return logits;
}

}  // namespace relay

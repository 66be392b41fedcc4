// See cpu_backend.h.
#include "engine/cpu_backend.h"

#include <algorithm>
#include <thread>

#include "core/error.h"
#include "engine/ranks.h"
#include "engine/sampler.h"
#include "model/registry.h"
#include "parallel/local_group.h"

namespace relay {

// One rank: its shard, KV pool, threads, and the flattened batch it runs this step.
struct CpuBackend::Rank {
  Rank(std::unique_ptr<Model> m, const KvCacheLayout& layout, int num_threads, int dp)
      : model(std::move(m)), kv(layout), pool(num_threads), dp_rank(dp) {}

  std::unique_ptr<Model> model;
  KvPool kv;
  ThreadPool pool;
  int dp_rank;
  std::vector<size_t> members;  // indices into the step's batch of the sequences this rank runs
  ForwardBatch batch;
  std::vector<int32_t> token_ids, positions, query_starts, context_lens, block_tables, logit_rows;
  std::vector<int64_t> slot_mapping;
  std::vector<float> logits;
};

namespace {

int threads_per_rank(int requested, int world) {
  const int total = requested > 0
                        ? requested
                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, total / world);
}

}  // namespace

CpuBackend::CpuBackend(const std::filesystem::path& model_dir, const CpuBackendOptions& o)
    : parallel_(o.parallel) {
  RELAY_CHECK(o.block_size > 0, "block_size must be positive, got ", o.block_size);
  parallel_.validate();
  const int world = parallel_.world_size();
  const ModelConfig config = ModelConfig::load(model_dir);
  const Checkpoint ckpt(model_dir);
  if (world > 1) comms_ = parallel::make_local_group(world);
  for (int r = 0; r < world; ++r) {
    const ShardSpec shard = make_shard(config, parallel_, r, world > 1 ? comms_[r].get() : nullptr);
    std::unique_ptr<Model> model = build_model(config, ckpt, shard);
    const KvCacheLayout layout = o.num_blocks > 0
                                     ? model->kv_layout(o.block_size, o.num_blocks)
                                     : model->kv_layout_for_budget(o.block_size, o.kv_cache_bytes);
    if (r == 0) blocks_per_rank_ = layout.num_blocks;
    // Every rank gets the same number of blocks (the ranks holding more KV heads set the count).
    const KvCacheLayout same = model->kv_layout(o.block_size, blocks_per_rank_);
    ranks_.push_back(std::make_unique<Rank>(std::move(model), same,
                                            threads_per_rank(o.num_threads, world),
                                            parallel::place_rank(parallel_, r).dp_rank));
  }
}

CpuBackend::~CpuBackend() = default;

const ModelConfig& CpuBackend::config() const { return ranks_.front()->model->config(); }
int CpuBackend::block_size() const { return ranks_.front()->kv.layout().block_size; }
KvPool& CpuBackend::kv_pool(int rank) { return ranks_.at(rank)->kv; }

std::vector<KvPoolExport> CpuBackend::kv_pool_exports() {
  std::vector<KvPoolExport> out;
  for (auto& r : ranks_) {
    const ShardSpec& s = r->model->shard();
    out.push_back({reinterpret_cast<std::byte*>(r->kv.data()), r->kv.layout(), s.kv_head_begin,
                   s.num_local_kv_heads, r->dp_rank, -1});
  }
  return out;
}
ThreadPool& CpuBackend::thread_pool(int rank) { return ranks_.at(rank)->pool; }

void CpuBackend::build_batch(Rank& r, std::span<const StepSequence> batch,
                             const std::vector<RowsOf>& rows_of) {
  const int bs = block_size();
  const int32_t first_block = r.dp_rank * blocks_per_rank_;
  size_t max_blocks = 1;
  for (size_t i : r.members) max_blocks = std::max(max_blocks, batch[i].block_table.size());
  r.token_ids.clear();
  r.positions.clear();
  r.slot_mapping.clear();
  r.query_starts.assign(1, 0);
  r.context_lens.clear();
  r.block_tables.assign(r.members.size() * max_blocks, 0);
  r.logit_rows.clear();
  std::vector<int32_t> local;
  for (size_t m = 0; m < r.members.size(); ++m) {
    const StepSequence& s = batch[r.members[m]];
    const int64_t context = s.num_computed + static_cast<int64_t>(s.tokens.size());
    RELAY_CHECK(static_cast<int64_t>(s.block_table.size()) * bs >= context, "sequence ", s.seq_id,
                " needs ", context, " KV slots but its block table has ", s.block_table.size(),
                " blocks of ", bs);
    localize_block_table(s, first_block, blocks_per_rank_, local);
    std::copy(local.begin(), local.end(), r.block_tables.begin() + m * max_blocks);
    const int32_t* table = r.block_tables.data() + m * max_blocks;
    for (size_t j = 0; j < s.tokens.size(); ++j) {
      const int32_t pos = s.num_computed + static_cast<int32_t>(j);
      r.token_ids.push_back(s.tokens[j]);
      r.positions.push_back(pos);
      r.slot_mapping.push_back(static_cast<int64_t>(table[pos / bs]) * bs + pos % bs);
    }
    r.query_starts.push_back(static_cast<int32_t>(r.token_ids.size()));
    r.context_lens.push_back(static_cast<int32_t>(context));
    const int32_t last = r.query_starts.back() - 1;
    if (rows_of[r.members[m]] == RowsOf::kLast) r.logit_rows.push_back(last);
    if (rows_of[r.members[m]] == RowsOf::kAll) {
      for (int32_t row = r.query_starts[m]; row <= last; ++row) r.logit_rows.push_back(row);
    }
  }
  r.batch = ForwardBatch{r.token_ids,    r.positions,    r.query_starts,
                         r.context_lens, r.block_tables, static_cast<int>(max_blocks),
                         r.slot_mapping, r.logit_rows};
}

std::vector<float> CpuBackend::run(std::span<const StepSequence> batch,
                                   const std::vector<RowsOf>& rows_of) {
  RELAY_CHECK(!batch.empty(), "step with an empty batch");
  for (const StepSequence& s : batch) {
    RELAY_CHECK(!s.tokens.empty(), "sequence ", s.seq_id, " has no tokens in this step");
    RELAY_CHECK(s.num_computed >= 0, "sequence ", s.seq_id, " has num_computed ", s.num_computed);
    RELAY_CHECK(!s.block_table.empty(), "sequence ", s.seq_id, " has no KV blocks");
  }
  // Each sequence runs on the DP rank whose partition holds its first block (build_batch checks the
  // rest); with dp = 1 every rank runs every sequence.
  const std::vector<std::vector<size_t>> members =
      split_by_kv_partition(batch, parallel_.dp, blocks_per_rank_);
  for (auto& r : ranks_) r->members = members[r->dp_rank];

  auto run_rank = [&](Rank& r) {
    if (r.members.empty()) {
      if (r.model->shard().dispatch_tokens) r.model->forward_idle(r.pool);
      r.logits.clear();
      return;
    }
    build_batch(r, batch, rows_of);
    r.model->forward(r.batch, r.kv, r.pool, r.logits);
  };
  if (ranks_.size() == 1) {
    run_rank(*ranks_.front());
  } else {
    // The first rank to fail aborts the group so the others leave their collectives; its error is
    // the one reported.
    try {
      run_on_rank_threads(
          ranks_.size(), [&](size_t i) { run_rank(*ranks_[i]); },
          [&](size_t i) { comms_[i]->abort(); });
    } catch (...) {
      comms_[0]->reset();
      throw;
    }
  }

  // Gather the logit rows in batch order: with dp = 1 from rank 0 (all ranks agree), else from the
  // rank that ran each sequence.
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  auto num_rows = [&](size_t i) -> size_t {
    return rows_of[i] == RowsOf::kNone   ? 0
           : rows_of[i] == RowsOf::kLast ? 1
                                         : batch[i].tokens.size();
  };
  std::vector<size_t> first_row(batch.size(), 0), owner(batch.size(), 0);
  for (size_t k = 0; k < ranks_.size(); ++k) {
    Rank& r = *ranks_[k];
    if (parallel::place_rank(parallel_, static_cast<int>(k)).tp_rank != 0) continue;
    size_t row = 0;
    for (size_t i : r.members) {
      owner[i] = k;
      first_row[i] = row;
      row += num_rows(i);
    }
  }
  std::vector<float> out;
  for (size_t i = 0; i < batch.size(); ++i) {
    const size_t n = num_rows(i);
    const float* src = ranks_[owner[i]]->logits.data() + first_row[i] * vocab;
    out.insert(out.end(), src, src + n * vocab);
  }
  return out;
}

std::vector<SampledToken> CpuBackend::step(std::span<const StepSequence> batch) {
  std::vector<RowsOf> rows_of;
  for (const StepSequence& s : batch) {
    RELAY_CHECK(!s.sample || s.sampling != nullptr, "sequence ", s.seq_id,
                " samples but has no SamplingParams");
    rows_of.push_back(s.sample ? RowsOf::kLast : RowsOf::kNone);
  }
  std::vector<float> logits = run(batch, rows_of);
  std::vector<SampledToken> out;
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  size_t row = 0;
  for (const StepSequence& s : batch) {
    if (!s.sample) continue;
    std::span<float> row_logits(logits.data() + row * vocab, vocab);
    SampledToken t =
        sample_token(row_logits, *s.sampling, s.prompt_tokens, s.output_tokens, s.sample_index);
    t.seq_id = s.seq_id;
    out.push_back(std::move(t));
    ++row;
  }
  return out;
}

std::vector<float> CpuBackend::forward_logits(std::span<const StepSequence> batch, LogitRows rows) {
  const std::vector<RowsOf> rows_of(batch.size(),
                                    rows == LogitRows::kLastTokens ? RowsOf::kLast : RowsOf::kAll);
  return run(batch, rows_of);
}

}  // namespace relay

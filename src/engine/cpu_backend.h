// The CPU backend: Relay's exact reference implementation of a step, in fp32 on the host.
//
// It loads the checkpoint through the model registry (weights widened to fp32), owns an fp32 paged
// KV pool (kvcache/kv_cache.h, HND) and a thread pool, and runs each step as one forward over the
// flattened batch followed by the shared sampler (sampler.h). It is slow next to a GPU but it is the
// oracle the CUDA backend is tested against, and it lets every other part of Relay run in CI.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "engine/backend.h"
#include "kvcache/kv_cache.h"
#include "model/model.h"

namespace relay {

struct CpuBackendOptions {
  int block_size = 16;                            // tokens per KV block
  int num_blocks = 0;                             // > 0: exactly this many blocks ...
  size_t kv_cache_bytes = size_t{256} << 20;      // ... else as many as fit in this budget
  int num_threads = 0;                            // 0: one per hardware thread
};

class CpuBackend : public Backend {
 public:
  CpuBackend(const std::filesystem::path& model_dir, const CpuBackendOptions& options);

  const ModelConfig& config() const override { return model_->config(); }
  int block_size() const override { return kv_.layout().block_size; }
  int num_kv_blocks() const override { return kv_.layout().num_blocks; }
  std::vector<SampledToken> step(std::span<const StepSequence> batch) override;

  enum class LogitRows {
    kLastTokens,  // the last token of every sequence (sampling or not): [num_seqs, vocab]
    kAllTokens,   // every token of the batch: [num_tokens, vocab]
  };
  // Runs the forward pass of `batch` (writing its K/V like step does) and returns fp32 logits
  // instead of sampling; for tests, benchmarks and tools that score text.
  std::vector<float> forward_logits(std::span<const StepSequence> batch, LogitRows rows);

  KvPool& kv_pool() { return kv_; }
  ThreadPool& thread_pool() { return pool_; }

 private:
  // Flattens `batch` into forward_batch_ (token ids, positions, slot mapping, padded block tables);
  // logit rows are the last token of each sequence with sample=true, or as `rows` says.
  void build_batch(std::span<const StepSequence> batch, const LogitRows* rows);

  std::unique_ptr<Model> model_;
  KvPool kv_;
  ThreadPool pool_;
  // The flattened batch and its storage, reused across steps.
  ForwardBatch forward_batch_;
  std::vector<int32_t> token_ids_, positions_, query_starts_, context_lens_, block_tables_, logit_rows_;
  std::vector<int64_t> slot_mapping_;
  std::vector<float> logits_;
};

}  // namespace relay

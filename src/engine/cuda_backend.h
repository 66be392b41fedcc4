// The CUDA backend: Qwen3 / Qwen3-MoE and the Qwen3.5 / Qwen3-Next hybrids (Gated DeltaNet layers
// over a recurrent-state pool of fp32 slots beside the KV pool, gated attention, the shared
// expert), bf16 weights and KV cache, fp32 accumulation.
//
// Weights are uploaded once from the safetensors mmap through pinned staging buffers (fused q|k|v
// and gate|up layouts, per-expert tensors stacked into [experts, n, k]); the paged HND KV pool
// takes the device memory left after weights, activations and workspaces (minus a small reserve),
// so nearly all free memory holds KV blocks. A step copies the batch metadata to the device in one
// transfer, runs the layers with the kernels of kernels/cuda/ops_cuda.h, computes logits only for
// the sampling rows and samples on the GPU (rows with penalties are sampled on the host by the
// shared sampler, with the same semantics). Decode steps (every sequence one token) and verify
// steps of speculative decoding where every sequence brings the same number of drafts are captured
// as CUDA graphs keyed by (padded batch size, padded block-table width, tokens per sequence) and
// replayed; a step with drafts samples a row per draft and verifies them (sampler.h,
// verify_drafts).
//
// Parallelism (options.parallel, parallel/parallel_config.h): the backend runs tp x dp ranks, one
// host thread and one stream each, on options.devices (a device may host several ranks: that is
// how the one-GPU tests run a sharded backend). Each rank loads its shard straight from the
// checkpoint (model/shard.h: heads, KV heads, widths, experts), owns its KV pool and talks to the
// others through a ThreadPeerGroup (parallel/cuda/thread_peer_group.h): Relay's one-shot /
// two-shot all-reduce after o_proj and after the MoE (or dense MLP) under TP / TP + EP, the MoE
// dispatch / combine kernels under DP + EP. All of it is captured in the decode graphs. As on the
// CPU backend, TP ranks run the whole batch and TP rank 0 samples; DP ranks own the block ids
// [r B, (r + 1) B) and run the sequences whose KV they hold; a DP rank without sequences still
// serves the others' expert exchanges.
//
// This header has no CUDA types, so CPU-only code (the CLI, the server) can include it; on a build
// without CUDA the library behind it is not built and nothing may call it.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "model/dummy_weights.h"
#include "model/registry.h"
#include "parallel/parallel_config.h"

namespace relay {

// How linear weights are held on the GPU.
enum class WeightFormat {
  kAuto,  // as the checkpoint stores them: FP8 tensors stay FP8, bf16/f16/f32 become bf16
  kBf16,  // everything bf16 (an FP8 checkpoint is dequantised at load)
  kFp8,   // block-scaled FP8 (a bf16 checkpoint is quantised at load, fp8-block128 recipe)
};

struct CudaBackendOptions {
  int device = 0;
  WeightFormat weights = WeightFormat::kAuto;
  int block_size = 16;         // tokens per KV block
  int max_num_seqs = 256;      // sequences per step (the largest decode graph)
  int max_num_tokens = 16384;  // tokens per step (prefill chunk budget)
  int num_kv_blocks = 0;       // > 0: exactly this many blocks, else all memory left
  size_t memory_reserve_bytes = size_t{1} << 30;  // per rank: left free for cuBLAS, workspaces, graphs
  bool cuda_graphs = true;
  LoadFormat load_format = LoadFormat::kAuto;  // kDummy: random weights (model/dummy_weights.h)
  parallel::ParallelConfig parallel;  // tp / ep / dp ranks (threads of this process)
  // devices[r] runs rank r (repeats allowed); empty: rank r on device + r.
  std::vector<int> devices;
  // Speculative decoding: the most drafts a sampling sequence brings to verify (its
  // num_speculative_tokens; 0: the backend takes none, supports_draft_tokens() is false). Sizes the
  // logit rows a step samples: max_num_seqs x (1 + max_draft_tokens).
  int max_draft_tokens = 0;
  // Hybrid models (Gated DeltaNet layers): recurrent-state slots per DP rank (the engine's
  // StateSlotManager hands them out: max_num_seqs x (1 + max_draft_tokens)) and prefix-cache
  // state snapshots per DP rank. Both live in device memory before the KV pool takes the rest.
  int num_state_slots = 0;
  int num_state_snapshots = 0;
  // MTP speculative decoding: the draft head (the checkpoint's mtp.* or a separate directory) and
  // the drafts it chains per sequence after each step (0: none proposed); max_draft_tokens must
  // hold them.
  MtpSource mtp;
  int num_mtp_drafts = 0;
  // relay bench's --spec-forced-acceptance only (make_backend never sets it): drafts are accepted
  // with this probability instead of verified (sampler.h, verify_drafts).
  std::optional<double> forced_draft_acceptance;
};

// One op's device time in profile_forward(), summed over the layers.
struct OpTiming {
  std::string op;  // "qkv_proj", "attention", "experts_gate_up", ... (".act_quant": FP8 input quantiser)
  int calls = 0;
  double ms = 0.0;
};

// What loading cost, for `relay bench` and logs.
struct CudaLoadStats {
  size_t weight_bytes = 0;    // bytes uploaded
  int fp8_linears = 0;        // linear weights (fused groups) held in block-scaled FP8
  double load_seconds = 0.0;  // checkpoint open to weights resident on the device
  size_t kv_pool_bytes = 0;
  size_t free_bytes_before_kv = 0;  // device memory free after weights, activations and workspaces
};

class CudaBackend : public Backend {
 public:
  CudaBackend(const std::filesystem::path& model_dir, const CudaBackendOptions& options);
  ~CudaBackend() override;

  const ModelConfig& config() const override;
  int block_size() const override;
  int num_kv_blocks() const override;  // per DP rank x dp
  int num_kv_partitions() const override;
  // Every rank's device pool (bf16), for a CUDA IPC hand-off.
  std::vector<KvPoolExport> kv_pool_exports() override;
  // Hybrid models: the recurrent-state pools (fp32 on the device, the CPU backend's layout).
  int num_state_slots() const override;
  int num_state_snapshots() const override;
  size_t state_slot_bytes() const override;
  std::vector<StatePoolExport> state_pool_exports() override;
  std::vector<SampledToken> step(std::span<const StepSequence> batch) override;
  // Drafts are verified (every row on the GPU sampler, penalties on the host) when the backend was
  // sized for them (CudaBackendOptions::max_draft_tokens).
  bool supports_draft_tokens() const override;
  // The MTP head's drafts per sequence (CudaBackendOptions::num_mtp_drafts).
  int num_proposed_drafts() const override;
  // Prompt logprobs and token constraints (structured outputs, logit_bias) ride on the sample
  // kernel (kernels/cuda/ops_cuda.h, SampleParams).
  bool supports_prompt_logprobs() const override { return true; }
  bool supports_token_constraints() const override { return true; }

  enum class LogitRows {
    kLastTokens,  // the last token of every sequence: [num_seqs, vocab]
    kAllTokens,   // every token of the batch: [num_tokens, vocab]
  };
  // Runs the forward pass (writing K/V like step) and returns fp32 logits instead of sampling.
  std::vector<float> forward_logits(std::span<const StepSequence> batch, LogitRows rows);

  // Runs the forward pass of `batch` (writing K/V, sampling nothing) once eagerly with a CUDA event
  // between every two ops, and returns each op's device time summed over the layers, in the order
  // the ops first ran. For `relay bench`'s per-op breakdown; the sum is close to an eager step's
  // device time (a graph replay skips the events and is a little faster).
  std::vector<OpTiming> profile_forward(std::span<const StepSequence> batch);

  const CudaLoadStats& load_stats() const;  // rank 0's
  // Device time of rank 0's last step() from its first copy to its last (CUDA events): wall time minus
  // this is the host's share of the step (building metadata, sampling bookkeeping, launch latency).
  double last_step_device_ms() const;
  // Device synchronisation of every rank, so a host timer around step() measures the GPU work too.
  void synchronize();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace relay

// The CPU backend: Relay's exact reference implementation of a step, in fp32 on the host.
//
// It loads the checkpoint through the model registry (weights widened to fp32), owns an fp32 paged
// KV pool (kvcache/kv_cache.h, HND) and a thread pool, and runs each step as one forward over the
// flattened batch followed by the shared sampler (sampler.h). It is slow next to a GPU but it is
// the oracle the CUDA backend is tested against, and it lets every other part of Relay run in CI.
//
// Logit rows: a step computes the LM head only for the rows it reads (RowsOf): the last row of a
// sequence that samples, or every row of a chunk with prompt logprobs (backend.h), which are
// scored against the next prompt token with the sampler's log_softmax and top-k (token_logprob),
// spread over the rank's threads, before the last row is sampled if the chunk ends the prompt, or
// every row of a decode with drafts: its last token and each draft are one query row of the same
// forward pass (attention sees each row's own causal context, as k + 1 single-token steps would),
// and the sampler verifies the drafts on the last 1 + k rows (sample_with_drafts).
//
// Hybrid models (Qwen3.5, Qwen3-Next): each rank also owns a recurrent-state pool
// (kvcache/recurrent_state.h) of options.num_state_slots slots, taken out of the KV budget. A
// sequence's StepSequence::state_slots[0] is its state, started fresh when it computes from
// position 0; a decode with k drafts snapshots the state after its last token and after each of
// its first k - 1 drafts into its k scratch slots (ForwardBatch::state_snapshot_slots) and, once
// the sampler has verified them, copies the snapshot after the last accepted draft back into its
// state slot, so rejected drafts leave no trace in the state, as they leave none in the KV.
// Prefix caching adds options.num_state_snapshots slots after those (also out of the KV budget):
// snapshot i is slot num_state_slots + i of its rank's pool, a restore is a slot copy before the
// forward and a save is the kernels' copy of the state after a row (the mechanism the draft
// snapshots use), so a snapshot is bit for bit the state a run without the cache carries there.
//
// MTP drafting (options.num_mtp_drafts = K > 0, with the checkpoint's or a separate MTP head,
// model/registry.h): after a step's target forward has been sampled, the backend runs the MTP layer
// over every row the step committed, pairing the target's final hidden state at position p with the
// token at p + 1 (the next prompt token, the accepted draft, or the token just sampled) and writing
// the layer's own K/V; the last row of a sampling sequence gives its first draft (greedy), and K -
// 1 chained MTP steps, each on the previous step's output, give the rest, in the lookahead blocks
// the scheduler left (a chain stops where the sequence's blocks end). The drafts go to
// StepSequence::proposed_drafts for the next step, which verifies them losslessly like any others.
// Every rank of a TP/EP group runs the same MTP forwards and takes the same argmax (their logits
// are equal); DP ranks and several nodes are not supported with MTP yet.
//
// Parallelism (options.parallel, parallel/parallel_config.h): the backend then runs tp x dp ranks
// as threads of this process, each with its own shard of the weights (model/shard.h), its own KV
// pool and its own slice of the threads, connected by the shared-memory communicator
// (parallel/local_group.h) — the same layer code and collectives a multi-GPU worker runs.
//   - Tensor / expert parallel (dp = 1): every rank runs the whole batch; all ranks end with the
//   same
//     logits (the reductions are bit-identical), and rank 0's are sampled. Every rank's pool has
//     the same block ids, holding its own KV heads.
//   - Data-parallel attention (dp > 1): block ids are partitioned, [r * B, (r + 1) * B) on DP rank
//   r
//     (num_kv_partitions() tells the block manager, which keeps each sequence in one partition), so
//     a sequence runs on the rank that holds its KV; a rank without sequences in a step still
//     serves the others' expert-parallel MoE exchanges.
//
// Several nodes (options.nodes, parallel::NodeConfig): the ranks may also be spread over processes,
// on one host or several. This process then builds only its node's ranks, their collectives cross
// processes over TCP (parallel/tcp_group.h), and the nodes other than 0 are followers: follow()
// runs every step node 0's backend sends them (engine/node_group.h) until node 0 shuts down. Node
// 0's step() sends the batch to the followers, runs its own ranks, and merges what each node's
// ranks sampled and scored (or, for forward_logits, their logit rows). A step that fails on any
// rank fails on node 0, after which every node re-arms its collectives; a node that disappears
// leaves node 0 failing every later step with the reason.
#pragma once

#include <cstddef>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "engine/backend.h"
#include "engine/node_group.h"
#include "kvcache/kv_cache.h"
#include "kvcache/recurrent_state.h"
#include "model/dummy_weights.h"
#include "model/model.h"
#include "model/registry.h"
#include "parallel/communicator.h"
#include "parallel/parallel_config.h"

namespace relay {

struct CpuBackendOptions {
  int block_size = 16;                        // tokens per KV block
  int num_blocks = 0;                         // > 0: exactly this many blocks per rank ...
  size_t kv_cache_bytes = size_t{256} << 20;  // ... else as many as fit in this budget per rank
  int num_threads = 0;                        // 0: one per hardware thread; divided among the ranks
  parallel::ParallelConfig parallel;          // tp / ep / dp ranks (threads of this process)
  parallel::NodeConfig nodes;                 // the processes the ranks are spread over
  LoadFormat load_format = LoadFormat::kAuto;  // kDummy: random weights (model/dummy_weights.h)
  // Speculative decoding's MTP head (the checkpoint's mtp.* or a separate directory) and the drafts
  // it proposes per step (num_speculative_tokens); no head when num_mtp_drafts is 0.
  MtpSource mtp;
  int num_mtp_drafts = 0;
  // Recurrent-state slots per rank, for a model with linear-attention layers (ignored otherwise):
  // a running sequence takes one plus one per draft it may verify. Their memory comes out of
  // kv_cache_bytes.
  int num_state_slots = 64;
  // State snapshots per rank for prefix caching of such a model (backend.h), 0: none. Each is one
  // sequence's whole state; their memory comes out of kv_cache_bytes too.
  int num_state_snapshots = 0;
  // relay bench's --spec-forced-acceptance only (make_backend never sets it): drafts are accepted
  // with this probability instead of verified (sampler.h, sample_with_drafts).
  std::optional<double> forced_draft_acceptance;
};

class CpuBackend : public Backend {
 public:
  CpuBackend(const std::filesystem::path& model_dir, const CpuBackendOptions& options);
  ~CpuBackend() override;

  const ModelConfig& config() const override;
  int block_size() const override;
  int num_kv_blocks() const override { return blocks_per_rank_ * parallel_.dp; }
  int num_kv_partitions() const override { return parallel_.dp; }
  int num_state_slots() const override { return state_slots_per_rank_ * parallel_.dp; }
  int num_state_snapshots() const override { return state_snapshots_per_rank_ * parallel_.dp; }
  size_t state_slot_bytes() const override;
  std::vector<KvPoolExport> kv_pool_exports() override;
  std::vector<StatePoolExport> state_pool_exports() override;
  std::vector<SampledToken> step(std::span<const StepSequence> batch) override;
  bool supports_prompt_logprobs() const override { return true; }
  bool supports_token_constraints() const override { return true; }
  bool supports_draft_tokens() const override { return true; }
  int num_proposed_drafts() const override { return num_mtp_drafts_; }
  std::string unusable_reason() const override { return lost_; }

  enum class LogitRows {
    kLastTokens,  // the last token of every sequence (sampling or not): [num_seqs, vocab]
    kAllTokens,   // every token of the batch: [num_tokens, vocab]
  };
  // Runs the forward pass of `batch` (writing its K/V like step does) and returns fp32 logits
  // instead of sampling; for tests, benchmarks and tools that score text.
  std::vector<float> forward_logits(std::span<const StepSequence> batch, LogitRows rows);

  // A follower node (nodes.node_rank > 0): runs node 0's steps until node 0 shuts the worker down
  // (it returns) or its connection is lost (it throws relay::Error).
  void follow();

  const parallel::ParallelConfig& parallel() const { return parallel_; }
  // This process's ranks: `rank` is an index among them (global rank = first local rank + rank).
  KvPool& kv_pool(int rank = 0);
  ThreadPool& thread_pool(int rank = 0);

 private:
  struct Rank;
  // Which logit rows a sequence contributes: none, its last token, or all its tokens.
  enum class RowsOf { kNone, kLast, kAll };

  // Node 0: sends `command` with `batch` to the followers, runs it on this process's ranks and
  // returns every node's result (index = node). When any rank failed, re-arms the collectives of
  // every node and throws the first failure.
  std::vector<NodeResult> run_step(NodeCommand command, std::span<const StepSequence> batch);
  // Runs `batch` on this process's ranks (each its own sequences). The result lists the sequences
  // whose logits this process holds (those of its TP-rank-0 ranks) with, for kStep, their sampled
  // tokens (accepted drafts included) and prompt logprobs, else their logit rows. A failure is
  // returned in `failure` (and its text in the result).
  NodeResult compute(NodeCommand command, std::span<const StepSequence> batch,
                     std::exception_ptr& failure);
  // Flattens the sequences `members` of `batch` into rank r's ForwardBatch, with block ids local to
  // r.
  void build_batch(Rank& r, std::span<const StepSequence> batch,
                   const std::vector<RowsOf>& rows_of);

  // After a step sampled `sampled` (this node's sequences' committed tokens, in batch order): runs
  // the MTP head on every local rank. Returns, per batch index, the drafts of each sequence that
  // wants them and that this node sampled (see the top of this file); step() hands them out.
  std::vector<std::vector<int32_t>> propose_mtp_drafts(std::span<const StepSequence> batch,
                                                       std::span<const SampledToken> sampled);
  // Rank r's MTP forward over the rows in r.mtp (one step of the chain, or the catch-up over the
  // committed rows); appends each logit row's greedy token to its member's drafts.
  void run_mtp_step(Rank& r);
  // Rank r's pool slot of state snapshot `id` (global id, of s's DP rank; relay::Error otherwise).
  int32_t local_snapshot_slot(const Rank& r, const StepSequence& s, int32_t id) const;
  // After a step verified drafts: fills the prefix-cache snapshots the step saves at accepted rows
  // (from the rows' draft slots) and restores, in every local rank that ran the sequence, the state
  // after its last accepted draft from its draft slot (see the top of this file). Each node runs it
  // in compute() with the tokens it sampled (its DP groups'; a TP group lies on one node).
  void roll_back_states(std::span<const StepSequence> batch,
                        std::span<const SampledToken> sampled);

  // Runs fn on every local rank, each on its own thread when there are several. The first rank to
  // fail aborts the group so the others (on every node) leave their collectives; its error is the
  // one rethrown.
  void on_ranks(const std::function<void(Rank&)>& fn);

  parallel::ParallelConfig parallel_;
  int blocks_per_rank_ = 0;
  int state_slots_per_rank_ = 0;  // 0: the model has no linear-attention layers
  int state_snapshots_per_rank_ = 0;  // after the state slots in each rank's pool
  int num_mtp_drafts_ = 0;
  std::optional<double> forced_draft_acceptance_;
  std::unique_ptr<NodeGroup> nodes_;  // only with several nodes
  std::string lost_;                  // node 0: why the multi-node worker can no longer run steps
  // One per local rank (empty with one rank in all).
  std::vector<std::unique_ptr<parallel::Communicator>> comms_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // this process's ranks, in global rank order
};

}  // namespace relay

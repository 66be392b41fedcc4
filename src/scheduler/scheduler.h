// The scheduler: continuous batching with chunked prefill, prefix-cache reuse and preemption.
//
// Every sequence is a list of tokens (prompt, then generated) of which the first `num_computed` are
// in the KV cache. A step computes some of the rest: a *decode* is a sequence with one token left
// (the one sampled last step), a *prefill chunk* is a run of prompt tokens. Uniformly, a sequence
// samples whenever a step computes up to its last token, so a preempted sequence's recompute is
// just a prefill over prompt + generated tokens.
//
// Each step (schedule()):
//  0. The budget beyond one token per running decode goes to the decodes' drafts (below), oldest
//     decode first, each taking all of its drafts or what is left of that budget.
//  1. Running sequences, oldest first, each take min(tokens left, budget) tokens of the
//     max_num_batched_tokens budget, with the tokens of every decode later in the list held back
//     (one, plus its drafts), so every running decode is in every step and prefills get what
//     remains. A sequence whose blocks cannot be allocated preempts the newest running sequence of
//     its own KV partition (frees its blocks, puts it at the front of the waiting queue to be
//     recomputed) until it fits, or preempts itself when it is that newest one.
//  2. If nothing was preempted, waiting sequences are admitted in FCFS order while there is budget,
//     a free slot under max_num_seqs, and KV blocks for their first chunk; the full blocks of their
//     prompt found in the prefix cache are taken as computed. Admission stops at the first sequence
//     that does not fit, so no request overtakes an older one.
// A sequence is never both waiting and running, and leaves only through finish() (done or aborted),
// which frees its blocks at once; the caller guarantees each sequence fits in one partition on its
// own, so the oldest running sequence of each partition always makes progress and every request
// completes.
//
// Prompt logprobs: a sequence that asks for them (wants_prompt_logprobs) needs the logits of every
// prompt position, so it takes no prefix-cache hit while its prompt is not done (it has sampled
// nothing yet, which covers a recompute after preemption mid-prompt); its computed blocks still
// enter the cache for later prompts. Once it has sampled, its prompt logprobs are delivered and a
// recompute may reuse cached blocks like any other. A prompt_only sequence (max_tokens 0) computes
// its prompt and samples nothing: the chunk that ends its prompt has sample = false, after which it
// has no token left to compute and the caller finishes it.
//
// Drafts (speculative decoding): a decode may carry Sequence::draft_tokens, tokens proposed to
// follow its last one. Its chunk then computes 1 + k tokens, its last token and its first k drafts
// (ScheduledChunk::num_draft_tokens), with KV blocks for all of them, and samples after each: the
// backend verifies the drafts in order. Drafts are opportunistic: they get only the budget beyond
// one token per decode (so they never cost a decode its place; prefill chunks get what decodes and
// drafts leave), and they never preempt — a decode whose drafts' blocks are not free runs without
// them. Prefill chunks and admissions carry none.
// update() commits, per sampling chunk, 1 + a tokens: the a accepted drafts (which must equal the
// first a drafts) and the token sampled after them; num_computed then counts the last token and
// the accepted drafts only, and the blocks holding nothing but rejected drafts are released
// (BlockManager::truncate), so the next step writes over the rejected K/V and no block holding it
// ever enters the prefix cache. A step consumes the drafts of every sequence it runs, verified or
// not, and a preempted sequence loses its drafts.
//
// Recurrent state (hybrid models: Qwen3.5, Qwen3-Next): when constructed with a StateSlotManager,
// every running sequence also owns its state slots (state_slots.h), taken at admission and
// returned at finish or preemption (a recompute starts from a zero state, as from no KV). A
// sequence is admitted only with its slots, in a partition that has them (among those, the one
// with the most free blocks) and its blocks come from that partition too; running sequences never
// need more slots, so slots bound admission alone. A prefilled hand-over (add_running) comes with
// its slots already taken (a disaggregated decode worker's reservation), its state sent into them
// with its KV.
//
// Prefix caching of hybrid models (with a StateSnapshotPool, kvcache/state_snapshots.h): a hit
// would skip the tokens that build the recurrent state, so it is taken only up to the last block
// boundary of the cached KV prefix that has a state snapshot — never below one block, and no hit
// when none has — and its chunk restores the state from that snapshot before computing the rest
// (ScheduledChunk::restore_snapshot, pinned until update()). Snapshots are taken as chunks reach
// block boundaries (ScheduledChunk::snapshot_saves, pending until update() keys them by the
// boundary block's hash once it is cached): at the last boundary each chunk reaches — so every
// prompt chunk ending on a boundary and every decode that fills a block leaves one — and at the
// end of the KV prefix a sequence found cached but could not take for want of a snapshot (a
// branch point: the next prompt sharing it then hits all of it). A decode verifying drafts takes
// none (its rows' state copies are its rollback scratch). A snapshot leaves the pool when its
// block leaves the prefix cache, or when the pool needs its slot (least recently used first); a
// sequence's snapshots past its prompt supersede each other (a later turn of a conversation
// extends its latest), so taking one makes the sequence's previous one the next to evict.
// Without a snapshot pool a hybrid model takes no hit.
//
// Lookahead (MTP drafting): a chunk that samples also gets blocks for num_lookahead_tokens more
// positions when its partition has them free, so the backend's drafter can write its own K/V for
// the drafts it chains after the sampled token; it never preempts for them, and the backend
// shortens its chain to the blocks it got. The drafter's K/V at a prompt's last cached position
// depends on the token after it, so with hit_drops_last_block a prefix hit leaves its last block
// to be recomputed.
//
// Partitions: with data-parallel attention one scheduler serves every DP rank, each rank's KV pool
// being one partition of the block manager (see block_manager.h), which binds each sequence to one.
// Preempting a sequence of another partition would free blocks on another rank, of no use to the
// sequence that needs them, so preemption stays within the partition; a sequence waits for blocks
// only in its own partition, while the other ranks carry on. One partition is today's single pool.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvcache/block_manager.h"
#include "kvcache/state_slots.h"
#include "kvcache/state_snapshots.h"
#include "sequence/sampling.h"
#include "sequence/sequence.h"

namespace relay {

struct SchedulerConfig {
  int max_num_seqs = 64;              // sequences running at once
  int max_num_batched_tokens = 2048;  // tokens computed per step (decodes + prefill chunks)
  // KV positions a sampling chunk also gets blocks for beyond its tokens, when free (never by
  // preemption): an MTP drafter chains its layer over the drafts it proposes, writing its K/V
  // there (num_speculative_tokens - 1). A rollback or the next step's chunk reuses them.
  int num_lookahead_tokens = 0;
  // A prefix hit gives back its last block, whose K/V the sequence then computes itself: an MTP
  // drafter's K/V at position p depends on the token at p + 1 too (model/mtp.h), and at the hit's
  // last position that token comes after the cached blocks, whose hashes do not cover it (vLLM
  // drops the last hit block for its EAGLE and MTP drafters alike).
  bool hit_drops_last_block = false;
};

// One sequence's share of a step.
struct ScheduledChunk {
  Sequence* seq = nullptr;
  // tokens[seq->num_computed, ...) and then the first num_draft_tokens of seq->draft_tokens
  int num_tokens = 0;
  bool sample = false;       // the chunk ends at the sequence's last token (never for prompt_only)
  int num_draft_tokens = 0;  // of num_tokens, the drafts (a decode that samples: num_tokens - 1)
  // Hybrid prefix caching: the snapshot the sequence's state is restored from before the chunk (a
  // prefix hit's; -1: none), and the snapshots to take after rows of the chunk.
  int32_t restore_snapshot = -1;
  std::vector<SnapshotSave> snapshot_saves{};
};

struct SchedulerOutput {
  std::vector<ScheduledChunk>
      chunks;  // decodes and prefill chunks of running sequences, then admissions
  int num_batched_tokens = 0;
  bool empty() const { return chunks.empty(); }
};

// Counters since start, with vLLM's meanings (prefix queries and hits count tokens).
struct SchedulerStats {
  uint64_t num_preemptions = 0;
  uint64_t prefix_cache_queries = 0;
  uint64_t prefix_cache_hits = 0;
};

class Scheduler {
 public:
  // `states`: the recurrent-state slots of a hybrid model (nullptr for attention-only models), with
  // as many partitions as `blocks`; `snapshots`: its state snapshots for prefix caching (nullptr:
  // no hit), as many partitions again. The scheduler makes `blocks` record uncached hashes.
  Scheduler(const SchedulerConfig& config, BlockManager& blocks, StateSlotManager* states = nullptr,
            StateSnapshotPool* snapshots = nullptr);

  // Queues a new sequence (tokens = its prompt, non-empty; id unused so far).
  void add(std::unique_ptr<Sequence> seq);
  // Starts a sequence whose first num_computed tokens already have K/V in the blocks the block
  // manager holds under its id (a decode worker receiving a prefilled prompt); it runs from the
  // next step, after the sequences already running.
  void add_running(std::unique_ptr<Sequence> seq);
  // Picks this step's work and allocates its KV blocks.
  SchedulerOutput schedule();
  // Records a computed step. `sampled` holds, per chunk with sample and in chunk order, the tokens
  // it commits: its accepted drafts (the first of its drafts, in order), then the token sampled
  // after them — one token for a chunk without drafts, 1 + a for one with a accepted. Each is
  // appended to its sequence, num_computed advances over the computed tokens that were not
  // rejected, the rejected drafts' blocks are released and newly full blocks registered in the
  // prefix cache (see Drafts above).
  void update(const SchedulerOutput& out, std::span<const SampledToken> sampled);
  // Instead of update(), for a step that failed: returns the state snapshots `out` was to take and
  // unpins those it was to restore (nothing else changes; the caller fails its sequences).
  void abandon(const SchedulerOutput& out) noexcept;
  // Removes a sequence (finished or aborted), freeing its blocks now. Returns false for unknown
  // ids.
  bool finish(int64_t id);
  // As finish(), but the blocks (and a hybrid model's state slots) stay allocated under the id (a
  // prefill worker keeps a finished prompt's KV and state until they have been sent);
  // BlockManager::free(id) and StateSlotManager::free(id) release them.
  bool finish_keeping_blocks(int64_t id);

  Sequence* find(int64_t id);
  // The running sequences, oldest admission first.
  std::span<Sequence* const> running() const { return running_; }
  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  const SchedulerStats& stats() const { return stats_; }
  const SchedulerConfig& config() const { return config_; }
  const BlockManager& blocks() const { return blocks_; }
  const StateSlotManager* states() const { return states_; }
  const StateSnapshotPool* snapshots() const { return snapshots_; }

 private:
  void preempt(Sequence* seq);
  // Takes blocks for the lookahead positions after a sampling chunk ending at `num_tokens`, if
  // free.
  void reserve_lookahead(const Sequence* seq, int64_t num_tokens);
  // Binds a waiting sequence of a hybrid model to the partition it can get state slots in (the
  // one with the most free blocks among those); false when no partition has slots.
  bool bind_state_partition(const Sequence* seq);
  // A hybrid model's prefix hit cut to the last block that has a state snapshot (none: no hit);
  // `snapshot` gets that snapshot (-1 without).
  PrefixHit cap_to_snapshot(PrefixHit hit, int32_t* snapshot) const;
  // Allocates the pending snapshots of the boundaries chunk `c` reaches (see the top of this file).
  void plan_snapshot_saves(ScheduledChunk& c);
  // Drops the snapshots whose blocks left the prefix cache.
  void drop_uncached_snapshots();

  SchedulerConfig config_;
  BlockManager& blocks_;
  StateSlotManager* states_;
  StateSnapshotPool* snapshots_;
  // Hybrid sequences whose cached KV prefix reached further than a snapshot: that prefix's tokens.
  std::unordered_map<int64_t, int64_t> branch_points_;
  // Each hybrid sequence's latest snapshot past its prompt (demoted when it takes the next one).
  std::unordered_map<int64_t, CachedPrefixBlock> output_snapshots_;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> seqs_;
  std::vector<Sequence*> running_;  // oldest admission first
  std::deque<Sequence*> waiting_;   // FCFS; preempted sequences go back to the front
  SchedulerStats stats_;
};

}  // namespace relay

// Continuous batching, chunked prefill and preemption by recompute (see scheduler.h).
#include "scheduler/scheduler.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "core/error.h"

namespace relay {

Scheduler::Scheduler(const SchedulerConfig& config, BlockManager& blocks, StateSlotManager* states,
                     StateSnapshotPool* snapshots)
    : config_(config), blocks_(blocks), states_(states), snapshots_(snapshots) {
  RELAY_CHECK(states == nullptr || states->num_partitions() == blocks.num_partitions(),
              "the state slots have ", states ? states->num_partitions() : 0,
              " partitions but the KV blocks ", blocks.num_partitions());
  RELAY_CHECK(snapshots == nullptr ||
                  (states != nullptr && snapshots->num_partitions() == blocks.num_partitions()),
              "state snapshots need state slots and as many partitions as the KV blocks");
  if (snapshots != nullptr) blocks.record_uncached();
  RELAY_CHECK(config.max_num_seqs > 0, "max_num_seqs must be positive, got ", config.max_num_seqs);
  // NOTE: each running decode needs one token of the budget, so the budget must cover a full batch.
  RELAY_CHECK(config.max_num_batched_tokens >= config.max_num_seqs, "max_num_batched_tokens (",
              config.max_num_batched_tokens, ") must be at least max_num_seqs (",
              config.max_num_seqs, ")");
  RELAY_CHECK(config.num_lookahead_tokens >= 0, "num_lookahead_tokens must not be negative, got ",
              config.num_lookahead_tokens);
}

void Scheduler::add(std::unique_ptr<Sequence> seq) {
  RELAY_CHECK(seq && !seq->tokens.empty(), "a sequence needs at least one prompt token");
  RELAY_CHECK(seqs_.count(seq->id) == 0, "sequence id ", seq->id, " is already scheduled");
  seq->num_prompt_tokens = static_cast<int>(seq->tokens.size());
  seq->num_computed = 0;
  waiting_.push_back(seq.get());
  seqs_.emplace(seq->id, std::move(seq));
}

void Scheduler::add_running(std::unique_ptr<Sequence> seq) {
  RELAY_CHECK(seq && seq->num_prompt_tokens > 0 && seq->num_computed > 0 &&
                  seq->num_computed < static_cast<int>(seq->tokens.size()),
              "a prefilled sequence needs computed prompt tokens and a token left to compute");
  RELAY_CHECK(seqs_.count(seq->id) == 0, "sequence id ", seq->id, " is already scheduled");
  RELAY_CHECK(
      blocks_.has_sequence(seq->id) &&
          static_cast<int64_t>(blocks_.block_table(seq->id).size()) * blocks_.block_size() >=
              seq->num_computed,
      "prefilled sequence ", seq->id, " has no KV blocks covering its ", seq->num_computed,
      " tokens");
  // A hybrid model's hand-over brings its state too, into the slots its reservation took with the
  // blocks (LLMEngine::reserve_kv), in the blocks' partition.
  RELAY_CHECK(states_ == nullptr ||
                  (states_->has_sequence(seq->id) &&
                   states_->partition_of(seq->id) == blocks_.partition_of(seq->id)),
              "prefilled sequence ", seq->id,
              " of a model with recurrent layers has no state slots in its blocks' partition");
  if (seq->num_cached_prompt_tokens < 0) seq->num_cached_prompt_tokens = 0;
  running_.push_back(seq.get());
  seqs_.emplace(seq->id, std::move(seq));
}

Sequence* Scheduler::find(int64_t id) {
  const auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

void Scheduler::preempt(Sequence* seq) {
  blocks_.free(seq->id);
  if (states_ != nullptr) states_->free(seq->id);
  branch_points_.erase(seq->id);
  output_snapshots_.erase(seq->id);
  seq->num_computed = 0;
  seq->draft_tokens.clear();
  ++seq->num_preemptions;
  ++stats_.num_preemptions;
  waiting_.push_front(seq);
}

void Scheduler::reserve_lookahead(const Sequence* seq, int64_t num_tokens) {
  // NOTE: allocate changes nothing when the partition lacks the blocks: the lookahead is optional.
  if (config_.num_lookahead_tokens > 0) {
    blocks_.allocate(seq->id, num_tokens + config_.num_lookahead_tokens);
  }
}

bool Scheduler::bind_state_partition(const Sequence* seq) {
  int best = -1;
  for (int p = 0; p < states_->num_partitions(); ++p) {
    if (states_->num_free_sequences(p) == 0) continue;
    if (best < 0 || blocks_.num_free_blocks(p) > blocks_.num_free_blocks(best)) best = p;
  }
  if (best < 0) return false;
  blocks_.bind(seq->id, best);
  return true;
}

PrefixHit Scheduler::cap_to_snapshot(PrefixHit hit, int32_t* snapshot) const {
  *snapshot = -1;
  size_t m = hit.blocks.size();
  for (; m > 0; --m) {
    *snapshot = snapshots_->find(hit.hashes[m - 1], hit.blocks[m - 1]);
    if (*snapshot >= 0) break;
  }
  RELAY_CHECK(*snapshot < 0 || snapshots_->partition_of_snapshot(*snapshot) == hit.partition,
              "state snapshot ", *snapshot, " is not in the partition of the prefix it restores");
  return blocks_.first_blocks(std::move(hit), m);
}

void Scheduler::plan_snapshot_saves(ScheduledChunk& c) {
  // NOTE: a decode's drafts count too: a boundary among them is kept only if the draft before it
  // is accepted (update() commits a save only within the committed tokens).
  if (snapshots_ == nullptr) return;
  const int64_t bs = blocks_.block_size();
  const int64_t begin = c.seq->num_computed;
  const int64_t end = begin + c.num_tokens;
  std::vector<int64_t> boundaries;  // token counts, ascending
  if (const auto it = branch_points_.find(c.seq->id); it != branch_points_.end()) {
    if (it->second > begin && it->second <= end) boundaries.push_back(it->second);
  }
  const int64_t last = end / bs * bs;
  if (last > begin && (boundaries.empty() || boundaries.back() != last)) boundaries.push_back(last);
  if (boundaries.empty()) return;
  const int partition = states_->partition_of(c.seq->id);
  if (const auto it = output_snapshots_.find(c.seq->id);
      it != output_snapshots_.end() && boundaries.back() > c.seq->num_prompt_tokens) {
    const int32_t previous = snapshots_->find(it->second.hash, it->second.block);
    if (previous >= 0) snapshots_->demote(previous);
  }
  for (const int64_t b : boundaries) {
    // NOTE: opportunistic: with every snapshot of the partition pending or pinned, none is taken.
    const int32_t id = snapshots_->allocate(partition);
    if (id < 0) break;
    c.snapshot_saves.push_back({static_cast<int32_t>(b - begin - 1), id});
  }
}

void Scheduler::drop_uncached_snapshots() {
  if (snapshots_ == nullptr) return;
  for (const CachedPrefixBlock& gone : blocks_.take_uncached()) {
    snapshots_->drop(gone.hash, gone.block);
  }
}

SchedulerOutput Scheduler::schedule() {
  drop_uncached_snapshots();
  SchedulerOutput out;
  int budget = config_.max_num_batched_tokens;
  auto is_decode = [](const Sequence* s) {
    return static_cast<int>(s->tokens.size()) - s->num_computed == 1;
  };
  // Whether a chunk of n tokens from s->num_computed samples.
  auto samples = [](const Sequence* s, int n) {
    return !s->prompt_only && s->num_computed + n == static_cast<int>(s->tokens.size());
  };
  // The drafts each decode verifies this step (absent: none), granted oldest first from the budget
  // beyond one token per decode.
  std::unordered_map<const Sequence*, int> drafts;
  int decode_tokens_after =
      static_cast<int>(std::count_if(running_.begin(), running_.end(), is_decode));
  int spare = budget - decode_tokens_after;
  for (const Sequence* s : running_) {
    if (spare <= 0) break;
    if (!is_decode(s) || s->prompt_only || s->draft_tokens.empty()) continue;
    const int k = std::min(static_cast<int>(s->draft_tokens.size()), spare);
    drafts.emplace(s, k);
    spare -= k;
    decode_tokens_after += k;
  }
  auto num_drafts = [&](const Sequence* s) {
    const auto it = drafts.find(s);
    return it == drafts.end() ? 0 : it->second;
  };
  bool preempted = false;

  // NOTE: i advances only past a sequence that stays running; one that preempts itself leaves
  // running_, and the next (of another partition, as it was the newest of its own) takes its index.
  for (size_t i = 0; i < running_.size();) {
    Sequence* seq = running_[i];
    const int left = static_cast<int>(seq->tokens.size()) - seq->num_computed;
    int k = num_drafts(seq);
    if (is_decode(seq)) decode_tokens_after -= 1 + k;
    // NOTE: a decode always gets its token (and drafts): the budget held them back until here.
    const int n = std::min(left, budget - decode_tokens_after - k);
    if (n <= 0) {
      ++i;
      continue;
    }
    const int partition = blocks_.partition_of(seq->id);
    bool self_preempted = false;
    while (!blocks_.allocate(seq->id, seq->num_computed + n + k)) {
      if (k > 0) {  // drafts never preempt: without them the decode may fit
        k = 0;
        continue;
      }
      // Only a sequence of the same partition frees blocks `seq` can use: the others' KV is on
      // other DP ranks. The newest such one is at index i or later, so it has no chunk yet.
      const auto newest = std::find_if(running_.rbegin(), running_.rend(), [&](const Sequence* s) {
        return blocks_.partition_of(s->id) == partition;
      });
      Sequence* victim = *newest;
      running_.erase(std::next(newest).base());
      preempt(victim);
      preempted = true;
      if (victim == seq) {
        self_preempted = true;
        break;
      }
      if (is_decode(victim)) decode_tokens_after -= 1 + num_drafts(victim);
    }
    if (self_preempted) continue;
    if (samples(seq, n)) reserve_lookahead(seq, seq->num_computed + n + k);
    out.chunks.push_back(
        {.seq = seq, .num_tokens = n + k, .sample = samples(seq, n), .num_draft_tokens = k});
    plan_snapshot_saves(out.chunks.back());
    budget -= n + k;
    ++i;
  }

  while (!preempted && !waiting_.empty() && budget > 0 &&
         static_cast<int>(running_.size()) < config_.max_num_seqs) {
    Sequence* seq = waiting_.front();
    // NOTE: prompt logprobs read every prompt position's logits, and a recurrent layer's state is
    // built from every token: a hit would skip them, unless a snapshot holds the state.
    const bool reads_cache = (states_ == nullptr || snapshots_ != nullptr) &&
                             !(seq->wants_prompt_logprobs && seq->num_output_tokens() == 0);
    PrefixHit hit = reads_cache ? blocks_.find_cached_prefix(seq->tokens) : PrefixHit{};
    if (config_.hit_drops_last_block) hit = blocks_.without_last_block(std::move(hit));
    int32_t restore = -1;
    int64_t branch_point = 0;
    if (snapshots_ != nullptr) {
      const int64_t kv_hit = hit.num_tokens(blocks_.block_size());
      hit = cap_to_snapshot(std::move(hit), &restore);
      // NOTE: the state must live in the hit's partition; without a slot free there the sequence
      // computes its prompt where a slot is.
      if (restore >= 0 && states_->num_free_sequences(hit.partition) == 0) {
        hit = blocks_.first_blocks(std::move(hit), 0);
        restore = -1;
      }
      if (kv_hit > hit.num_tokens(blocks_.block_size())) branch_point = kv_hit;
    }
    const int num_hit = static_cast<int>(hit.num_tokens(blocks_.block_size()));
    const int n = std::min(static_cast<int>(seq->tokens.size()) - num_hit, budget);
    if (states_ != nullptr && restore < 0 && !bind_state_partition(seq)) break;
    if (!blocks_.allocate(seq->id, num_hit + n, &hit)) {
      blocks_.free(seq->id);  // undoes bind_state_partition's binding
      break;
    }
    if (states_ != nullptr) {
      RELAY_CHECK(states_->allocate(seq->id, blocks_.partition_of(seq->id)), "sequence ", seq->id,
                  ": its partition has no state slot left");
    }
    if (restore >= 0) {
      snapshots_->pin(restore);  // until update(): the step restores it
      snapshots_->touch(restore);
    }
    if (branch_point > 0) branch_points_[seq->id] = branch_point;
    waiting_.pop_front();
    if (reads_cache) stats_.prefix_cache_queries += seq->tokens.size();
    stats_.prefix_cache_hits += num_hit;
    if (seq->num_cached_prompt_tokens < 0) seq->num_cached_prompt_tokens = num_hit;
    seq->num_computed = num_hit;
    running_.push_back(seq);
    if (samples(seq, n)) reserve_lookahead(seq, num_hit + n);
    out.chunks.push_back(
        {.seq = seq, .num_tokens = n, .sample = samples(seq, n), .restore_snapshot = restore});
    plan_snapshot_saves(out.chunks.back());
    budget -= n;
  }
  out.num_batched_tokens = config_.max_num_batched_tokens - budget;
  return out;
}

void Scheduler::update(const SchedulerOutput& out, std::span<const SampledToken> sampled) {
  drop_uncached_snapshots();
  size_t next = 0;
  for (const ScheduledChunk& c : out.chunks) {
    Sequence* seq = c.seq;
    // The chunk's tokens in `sampled`: its accepted drafts, then the token sampled after them.
    size_t n = 0;
    if (c.sample) {
      while (next + n < sampled.size() && sampled[next + n].seq_id == seq->id) ++n;
      RELAY_CHECK(n >= 1, "the backend returned no sampled token for sequence ", seq->id);
      RELAY_CHECK(n <= 1 + static_cast<size_t>(c.num_draft_tokens), "the backend returned ", n,
                  " tokens for sequence ", seq->id, ", which verified ", c.num_draft_tokens,
                  " drafts");
      for (size_t j = 0; j + 1 < n; ++j) {
        RELAY_CHECK(sampled[next + j].token == seq->draft_tokens[j], "sequence ", seq->id,
                    ": accepted token ", j, " is ", sampled[next + j].token, " but draft ", j,
                    " was ", seq->draft_tokens[j]);
      }
    }
    const int num_rejected = c.num_draft_tokens - static_cast<int>(n > 0 ? n - 1 : 0);
    const int64_t begin = seq->num_computed;
    seq->num_computed += c.num_tokens - num_rejected;
    for (size_t j = 0; j < n; ++j) seq->tokens.push_back(sampled[next + j].token);
    next += n;
    seq->draft_tokens.clear();
    if (num_rejected > 0) {
      // The blocks past the sequence's tokens hold only rejected drafts. Never shared: those
      // positions were computed this step, after any prefix hit and any cached block.
      const auto num_tokens = static_cast<int64_t>(seq->tokens.size());
      RELAY_CHECK(blocks_.truncate(seq->id, num_tokens) == num_tokens, "sequence ", seq->id,
                  ": the rollback of its rejected drafts reached a shared block");
    }
    blocks_.cache_full_blocks(seq->id, seq->tokens, seq->num_computed);
    for (const SnapshotSave& save : c.snapshot_saves) {
      // The state after `boundary` tokens is kept when that prefix's last block is cached.
      const int64_t boundary = begin + save.row + 1;
      const auto cached =
          boundary <= seq->num_computed
              ? blocks_.cached_prefix_block(seq->id, seq->tokens,
                                            static_cast<int>(boundary / blocks_.block_size()) - 1)
              : std::nullopt;
      if (cached) {
        snapshots_->commit(save.snapshot, cached->hash, cached->block);
        if (boundary > seq->num_prompt_tokens) output_snapshots_[seq->id] = *cached;
      } else {
        snapshots_->release(save.snapshot);
      }
    }
    if (c.restore_snapshot >= 0) snapshots_->unpin(c.restore_snapshot);
    if (const auto it = branch_points_.find(seq->id);
        it != branch_points_.end() && it->second <= seq->num_computed) {
      branch_points_.erase(it);
    }
  }
  drop_uncached_snapshots();
  RELAY_CHECK(next == sampled.size(), "the backend returned ", sampled.size(),
              " tokens, of which the sampling sequences committed ", next);
}

void Scheduler::abandon(const SchedulerOutput& out) noexcept {
  if (snapshots_ == nullptr) return;
  for (const ScheduledChunk& c : out.chunks) {
    for (const SnapshotSave& save : c.snapshot_saves) snapshots_->release(save.snapshot);
    if (c.restore_snapshot >= 0) snapshots_->unpin(c.restore_snapshot);
  }
}

bool Scheduler::finish(int64_t id) {
  if (!finish_keeping_blocks(id)) return false;
  blocks_.free(id);
  if (states_ != nullptr) states_->free(id);
  return true;
}

bool Scheduler::finish_keeping_blocks(int64_t id) {
  const auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  Sequence* seq = it->second.get();
  if (auto r = std::find(running_.begin(), running_.end(), seq); r != running_.end()) {
    running_.erase(r);
  } else if (auto w = std::find(waiting_.begin(), waiting_.end(), seq); w != waiting_.end()) {
    waiting_.erase(w);
  }
  branch_points_.erase(id);
  output_snapshots_.erase(id);
  seqs_.erase(it);
  return true;
}

}  // namespace relay

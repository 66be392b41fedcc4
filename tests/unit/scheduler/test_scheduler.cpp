// Scheduler: chunked prefill mixed with decodes, budgets and max_num_seqs, prefix hits, abort,
// preemption under tiny KV pools completing every request with the unconstrained run's output,
// preemption within a KV partition (DP attention ranks), the sequences of prompt-logprob
// requests (no prefix hit until the prompt is done, prompt-only sequences that never sample), and
// decodes with drafts (1 + k tokens budgeted and allocated, variable commits, rollback of rejected
// drafts) giving exactly the outputs of decoding without them, and the recurrent-state slots of
// hybrid models (admission bounded by slots, no prefix hits, a fresh state after preemption, the
// state after the accepted drafts kept, the partition chosen by slots) and their prefix hits
// (capped at the last block boundary with a state snapshot, branch points, snapshots evicted with
// their blocks, under pressure with drafts, and handed back by a failed step).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "core/error.h"
#include "fake_backend.h"
#include "scheduler/scheduler.h"

namespace relay {
namespace {

using testing::FakeBackend;

// Drives scheduler + fake backend the way LLMEngine does: give drafts (when a drafter is set, to
// every live sequence, at most what max_tokens leaves room for), schedule, build the batch, step,
// update, finish sequences that reached max_tokens (prompt-only ones once their prompt is
// computed).
struct Harness {
  // One chunk as scheduled (recorded before the step computes it).
  struct Chunk {
    int64_t id;
    int start, num_tokens, num_preemptions;
    bool sample;
    int num_draft_tokens;
  };

  // With num_state_slots, the sequences also hold recurrent-state slots (a hybrid model's), and
  // with num_snapshots the scheduler keeps state snapshots for their prefix hits.
  Harness(int num_blocks, int block_size, SchedulerConfig cfg, int num_partitions = 1,
          int num_state_slots = 0, int slots_per_sequence = 1, int num_snapshots = 0)
      : backend(num_blocks, block_size, num_state_slots, num_snapshots),
        blocks(num_blocks, block_size, true, num_partitions),
        states(num_state_slots > 0 ? std::make_unique<StateSlotManager>(
                                         num_state_slots, slots_per_sequence, num_partitions)
                                   : nullptr),
        snapshots(num_snapshots > 0
                      ? std::make_unique<StateSnapshotPool>(num_snapshots, num_partitions)
                      : nullptr),
        sched(cfg, blocks, states.get(), snapshots.get()) {}

  // The sequence stays valid until it finishes (tests may set its flags before it runs).
  Sequence* add(int64_t id, std::vector<int32_t> prompt, int max_tokens, float temperature = 0.0f) {
    auto seq = std::make_unique<Sequence>();
    seq->id = id;
    seq->tokens = std::move(prompt);
    seq->sampling.temperature = temperature;
    seq->sampling.seed = static_cast<uint64_t>(id) * 7919;
    max_tokens_[id] = max_tokens;
    Sequence* added = seq.get();
    sched.add(std::move(seq));
    return added;
  }

  // One engine step; returns the scheduler output's chunk count.
  SchedulerOutput step() {
    if (drafter) {
      for (const auto& [id, max_tokens] : max_tokens_) {
        Sequence* seq = outputs.count(id) ? nullptr : sched.find(id);
        if (seq == nullptr) continue;
        std::vector<int32_t> drafts = drafter(*seq);
        drafts.resize(std::min<size_t>(
            drafts.size(),
            static_cast<size_t>(std::max(0, max_tokens - seq->num_output_tokens() - 1))));
        seq->draft_tokens = drafts;
      }
    }
    SchedulerOutput out = sched.schedule();
    std::vector<StepSequence> batch;
    std::vector<std::vector<int32_t>> with_drafts(out.chunks.size());
    for (const ScheduledChunk& c : out.chunks) {
      StepSequence s;
      s.seq_id = c.seq->id;
      s.tokens = std::span<const int32_t>(c.seq->tokens).subspan(c.seq->num_computed, c.num_tokens);
      if (c.num_draft_tokens > 0) {
        std::vector<int32_t>& t = with_drafts[batch.size()];
        t.assign(1, c.seq->tokens.back());
        t.insert(t.end(), c.seq->draft_tokens.begin(),
                 c.seq->draft_tokens.begin() + c.num_draft_tokens);
        s.tokens = t;
        s.num_draft_tokens = c.num_draft_tokens;
      }
      s.num_computed = c.seq->num_computed;
      s.block_table = blocks.block_table(c.seq->id);
      if (states) s.state_slots = states->slots(c.seq->id);
      s.restore_state_snapshot = c.restore_snapshot;
      s.save_state_snapshots = c.snapshot_saves;
      s.sample = c.sample;
      s.sampling = &c.seq->sampling;
      s.output_tokens = c.seq->output_tokens();
      s.sample_index = static_cast<uint64_t>(c.seq->num_output_tokens());
      batch.push_back(s);
      chunks.push_back({c.seq->id, c.seq->num_computed, c.num_tokens, c.seq->num_preemptions,
                        c.sample, c.num_draft_tokens});
      EXPECT_GE(static_cast<int64_t>(s.block_table.size()) * blocks.block_size(),
                c.seq->num_computed + c.num_tokens)
          << "sequence " << c.seq->id << " has no KV slots for its drafts";
    }
    const auto sampled = backend.step(batch);
    sched.update(out, sampled);
    for (const ScheduledChunk& c : out.chunks) {
      const bool prompt_done =
          c.seq->prompt_only && c.seq->num_computed == c.seq->num_prompt_tokens;
      if (prompt_done || (c.sample && c.seq->num_output_tokens() >= max_tokens_[c.seq->id])) {
        const int64_t id = c.seq->id;
        EXPECT_EQ(outputs.count(id), 0u) << "sequence " << id << " finished twice";
        outputs[id] =
            std::vector<int32_t>(c.seq->output_tokens().begin(), c.seq->output_tokens().end());
        sched.finish(id);
      }
    }
    blocks.check_invariants();
    if (snapshots) snapshots->check_invariants();
    if (states) {
      states->check_invariants();
      // Exactly the running sequences own slots, in the partition of their blocks.
      EXPECT_EQ(states->num_free_slots(),
                states->num_slots() - sched.num_running() * states->slots_per_sequence());
      for (const Sequence* seq : sched.running()) {
        EXPECT_EQ(states->partition_of(seq->id), blocks.partition_of(seq->id))
            << "sequence " << seq->id;
      }
    }
    return out;
  }

  void run_to_completion(int max_steps = 100000) {
    for (int i = 0; i < max_steps && sched.has_work(); ++i) step();
    ASSERT_FALSE(sched.has_work()) << "requests still pending after " << max_steps << " steps";
  }

  FakeBackend backend;
  BlockManager blocks;
  std::unique_ptr<StateSlotManager> states;
  std::unique_ptr<StateSnapshotPool> snapshots;
  Scheduler sched;
  // The drafts a live sequence proposes before each step (none when unset).
  std::function<std::vector<int32_t>(const Sequence&)> drafter;
  std::map<int64_t, std::vector<int32_t>> outputs;
  std::map<int64_t, int> max_tokens_;
  std::vector<Chunk> chunks;
};

std::vector<int32_t> prompt_of(int n, int32_t salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = (salt * 31 + i * 7) % 900;
  return p;
}

TEST(Scheduler, ChunkedPrefillMixesWithDecodes) {
  Harness h(64, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 8});
  h.add(1, prompt_of(3, 1), 50);
  h.step();  // 1 prefills its 3 tokens and samples
  h.add(2, prompt_of(20, 2), 5);
  SchedulerOutput out = h.step();
  ASSERT_EQ(out.chunks.size(), 2u);
  EXPECT_EQ(out.chunks[0].seq->id, 1);
  EXPECT_EQ(out.chunks[0].num_tokens, 1);  // decode
  EXPECT_TRUE(out.chunks[0].sample);
  EXPECT_EQ(out.chunks[1].num_tokens, 7);  // the rest of the budget goes to the prefill chunk
  EXPECT_FALSE(out.chunks[1].sample);
  EXPECT_EQ(out.num_batched_tokens, 8);
  out = h.step();  // 1 decode + 7 more prompt tokens (14 of 20)
  EXPECT_EQ(out.chunks[1].num_tokens, 7);
  out = h.step();  // 6 left: the chunk finishes the prompt and samples
  EXPECT_EQ(out.chunks[1].num_tokens, 6);
  EXPECT_TRUE(out.chunks[1].sample);
  out = h.step();  // both decode now
  ASSERT_EQ(out.chunks.size(), 2u);
  EXPECT_EQ(out.num_batched_tokens, 2);
  h.run_to_completion();
  EXPECT_EQ(h.outputs.size(), 2u);
}

TEST(Scheduler, DecodesRunEveryStepWhileAPrefillFillsTheRest) {
  Harness h(256, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 10});
  for (int id = 2; id <= 5; ++id) h.add(id, prompt_of(1, id), 30);
  h.step();
  h.add(1, prompt_of(100, 1), 3);
  // 1 prefills 100 tokens in chunks of 6 while 2..5 decode in every step.
  for (int i = 0; i < 16; ++i) {
    const SchedulerOutput out = h.step();
    int decodes = 0, prefill = 0;
    for (const auto& c : out.chunks) (c.seq->id == 1 ? prefill : decodes) += c.num_tokens;
    EXPECT_EQ(decodes, 4);
    EXPECT_EQ(prefill, 6);
  }
  const SchedulerOutput out = h.step();  // the last 4 prompt tokens, then 1 samples
  EXPECT_EQ(out.chunks.back().num_tokens, 4);
  EXPECT_TRUE(out.chunks.back().sample);
  h.run_to_completion();
  EXPECT_EQ(h.outputs.size(), 5u);
}

TEST(Scheduler, RespectsMaxNumSeqsAndFcfs) {
  Harness h(256, 4, {.max_num_seqs = 2, .max_num_batched_tokens = 64});
  for (int id = 0; id < 5; ++id) h.add(id, prompt_of(5, id), 4);
  SchedulerOutput out = h.step();
  ASSERT_EQ(out.chunks.size(), 2u);
  EXPECT_EQ(out.chunks[0].seq->id, 0);
  EXPECT_EQ(out.chunks[1].seq->id, 1);
  EXPECT_EQ(h.sched.num_running(), 2);
  EXPECT_EQ(h.sched.num_waiting(), 3);
  while (h.sched.has_work()) {
    EXPECT_LE(h.sched.num_running(), 2);
    h.step();
  }
  EXPECT_EQ(h.outputs.size(), 5u);
}

TEST(Scheduler, PrefixHitSkipsComputation) {
  Harness h(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 64});
  auto system = prompt_of(16, 9);
  auto a = system, b = system;
  a.insert(a.end(), {1, 2, 3});
  b.insert(b.end(), {4, 5});
  h.add(1, a, 2);
  h.step();
  EXPECT_EQ(h.sched.stats().prefix_cache_hits, 0u);
  h.add(2, b, 2);
  const SchedulerOutput out = h.step();
  ASSERT_EQ(out.chunks.size(), 2u);
  EXPECT_EQ(out.chunks[1].seq->id, 2);
  EXPECT_EQ(out.chunks[1].num_tokens, 2);  // only the 2 tokens after the shared 16
  EXPECT_EQ(h.sched.find(2)->num_cached_prompt_tokens, 16);
  EXPECT_EQ(h.sched.stats().prefix_cache_hits, 16u);
  EXPECT_EQ(h.sched.stats().prefix_cache_queries, 19u + 18u);
  h.run_to_completion();

  // The same prompt without the cache gives the same tokens.
  Harness cold(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 64});
  cold.add(2, b, 2);
  cold.run_to_completion();
  EXPECT_EQ(h.outputs[2], cold.outputs[2]);
}

// With an MTP drafter (hit_drops_last_block) the same hit gives back its last block: the sequence
// computes 4 + 2 tokens, and its outputs are the ones without the cache.
TEST(Scheduler, ADrafterRecomputesTheLastHitBlock) {
  Harness h(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 64, .hit_drops_last_block = true});
  auto system = prompt_of(16, 9);
  auto a = system, b = system;
  a.insert(a.end(), {1, 2, 3});
  b.insert(b.end(), {4, 5});
  h.add(1, a, 2);
  h.step();
  h.add(2, b, 2);
  const SchedulerOutput out = h.step();
  ASSERT_EQ(out.chunks.size(), 2u);
  EXPECT_EQ(out.chunks[1].num_tokens, 6);
  EXPECT_EQ(h.sched.find(2)->num_cached_prompt_tokens, 12);
  EXPECT_EQ(h.sched.stats().prefix_cache_hits, 12u);
  h.run_to_completion();
  Harness cold(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 64});
  cold.add(2, b, 2);
  cold.run_to_completion();
  EXPECT_EQ(h.outputs[2], cold.outputs[2]);
  EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
}

// A sequence asking for prompt logprobs computes every prompt position even when its prefix is
// cached (no hit, no prefix query counted), and its own blocks still serve later prompts.
TEST(Scheduler, PromptLogprobsSkipPrefixHitsButFillTheCache) {
  auto prompt = prompt_of(16, 9);
  prompt.insert(prompt.end(), {1, 2, 3});
  Harness h(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 64});
  h.add(1, prompt, 2);
  h.run_to_completion();
  const SchedulerStats before = h.sched.stats();
  h.add(2, prompt, 2)->wants_prompt_logprobs = true;
  h.step();
  const Harness::Chunk& first = h.chunks.back();
  EXPECT_EQ(first.id, 2);
  EXPECT_EQ(first.start, 0);
  EXPECT_EQ(first.num_tokens, 19);  // 16 of them were cached
  EXPECT_EQ(h.sched.find(2)->num_cached_prompt_tokens, 0);
  EXPECT_EQ(h.sched.stats().prefix_cache_hits, before.prefix_cache_hits);
  EXPECT_EQ(h.sched.stats().prefix_cache_queries, before.prefix_cache_queries);
  h.run_to_completion();
  EXPECT_EQ(h.outputs[2], h.outputs[1]);

  Harness fresh(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 64});
  fresh.add(1, prompt, 2)->wants_prompt_logprobs = true;
  fresh.run_to_completion();
  fresh.add(2, prompt, 2);
  fresh.step();
  EXPECT_EQ(fresh.sched.find(2)->num_cached_prompt_tokens, 16);
  fresh.run_to_completion();
  EXPECT_EQ(fresh.outputs[2], fresh.outputs[1]);
}

// A pool too small for two prompts: B (asking for prompt logprobs) is preempted mid-prompt while
// the older A decodes, again and again until A finishes. Each re-admission recomputes B from
// position 0, although its first blocks are still in the prefix cache (without the flag it resumes
// from them), and B's output is the unconstrained run's.
TEST(Scheduler, PromptLogprobsRecomputeTheWholePromptAfterPreemption) {
  Harness roomy(256, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 8});
  roomy.add(1, prompt_of(24, 1), 8);
  roomy.add(2, prompt_of(24, 2), 4);
  roomy.run_to_completion();
  // Where B's chunks start after each (re)admission.
  auto restarts = [&](bool prompt_logprobs) {
    Harness h(10, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 8});
    h.add(1, prompt_of(24, 1), 8);
    h.add(2, prompt_of(24, 2), 4)->wants_prompt_logprobs = prompt_logprobs;
    h.run_to_completion();
    EXPECT_EQ(h.outputs.at(1), roomy.outputs.at(1));
    EXPECT_EQ(h.outputs.at(2), roomy.outputs.at(2));
    std::vector<int> starts;
    int preemptions = -1;
    for (const Harness::Chunk& c : h.chunks) {
      if (c.id != 2 || c.num_preemptions == preemptions) continue;
      preemptions = c.num_preemptions;
      starts.push_back(c.start);
    }
    return starts;
  };
  const std::vector<int> with = restarts(true), without = restarts(false);
  EXPECT_GT(with.size(), 1u);  // preempted at least once
  for (int start : with) EXPECT_EQ(start, 0);
  EXPECT_TRUE(std::any_of(without.begin(), without.end(), [](int start) { return start > 0; }));
}

// max_tokens 0: the sequence's chunks never sample; it is finished once its prompt is computed,
// while a neighbour decodes as usual.
TEST(Scheduler, APromptOnlySequenceSamplesNothing) {
  Harness h(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 8});
  h.add(1, prompt_of(3, 1), 5);
  Sequence* scored = h.add(2, prompt_of(20, 2), 0);
  scored->wants_prompt_logprobs = true;
  scored->prompt_only = true;
  h.run_to_completion();
  int computed = 0;
  for (const Harness::Chunk& c : h.chunks) {
    if (c.id != 2) continue;
    EXPECT_FALSE(c.sample);
    EXPECT_EQ(c.start, computed);
    computed += c.num_tokens;
  }
  EXPECT_EQ(computed, 20);
  EXPECT_TRUE(h.outputs.at(2).empty());
  EXPECT_EQ(h.outputs.at(1).size(), 5u);
  EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
}

TEST(Scheduler, AbortFreesBlocksAtOnce) {
  Harness h(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 16});
  h.add(1, prompt_of(30, 1), 100);  // running (mid-prefill)
  h.add(2, prompt_of(10, 2), 100);
  h.step();
  h.add(3, prompt_of(10, 3), 100);  // waiting or running
  h.step();
  EXPECT_GT(h.blocks.usage(), 0.0);
  EXPECT_TRUE(h.sched.finish(1));
  EXPECT_TRUE(h.sched.finish(3));
  EXPECT_FALSE(h.sched.finish(3));
  EXPECT_FALSE(h.sched.finish(42));
  EXPECT_FALSE(h.blocks.has_sequence(1));
  h.blocks.check_invariants();
  EXPECT_TRUE(h.sched.finish(2));
  EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
  EXPECT_FALSE(h.sched.has_work());
}

// Many requests through pools from roomy to barely-enough-for-one: every request completes exactly
// once, with the output of the unconstrained run, and small pools really preempt.
// Twelve requests of mixed lengths (some sampled) for the tiny-pool tests, in blocks of 4 tokens;
// the largest needs ceil((19 + 24) / 4) = 11 blocks.
constexpr int kTinyPoolBlock = 4;
void add_tiny_pool_load(Harness& h) {
  for (int id = 0; id < 12; ++id) {
    h.add(id, prompt_of(3 + (id * 5) % 17, id), 6 + (id * 7) % 19, id % 3 == 0 ? 0.8f : 0.0f);
  }
}

// The tiny-pool load in a roomy pool: the outputs every constrained run must reproduce.
std::map<int64_t, std::vector<int32_t>> tiny_pool_reference_outputs() {
  Harness reference(1024, kTinyPoolBlock, {.max_num_seqs = 64, .max_num_batched_tokens = 4096});
  add_tiny_pool_load(reference);
  reference.run_to_completion();
  EXPECT_EQ(reference.outputs.size(), 12u);
  EXPECT_EQ(reference.sched.stats().num_preemptions, 0u);
  return reference.outputs;
}

TEST(Scheduler, PreemptionUnderTinyPoolsKeepsEveryOutput) {
  constexpr int kBlock = kTinyPoolBlock;
  const auto load = add_tiny_pool_load;
  const auto reference_outputs = tiny_pool_reference_outputs();

  // The largest request needs ceil((19 + 24) / 4) = 11 blocks.
  for (int num_blocks : {11, 12, 16, 24, 40}) {
    for (int budget : {8, 16, 64}) {
      Harness h(num_blocks, kBlock, {.max_num_seqs = 8, .max_num_batched_tokens = budget});
      load(h);
      h.run_to_completion();
      ASSERT_EQ(h.outputs.size(), 12u) << num_blocks << " blocks";
      for (const auto& [id, out] : reference_outputs) {
        EXPECT_EQ(h.outputs[id], out) << "request " << id << " with " << num_blocks << " blocks";
      }
      EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
      if (num_blocks <= 16) {
        EXPECT_GT(h.sched.stats().num_preemptions, 0u) << num_blocks << " blocks";
      }
    }
  }
}

// Two partitions (DP ranks): A and C land in partition 0, B and D in partition 1, all decoding.
// When A runs out of blocks the victim is C, the newest of A's partition, not D, the newest running
// sequence overall, whose blocks would be of no use to A. Every request still completes with the
// unconstrained run's output.
TEST(Scheduler, PreemptionPicksAVictimInTheSamePartition) {
  auto load = [](Harness& h) {
    h.add(1, prompt_of(4, 1), 12);  // A: 4 + 12 tokens, all 4 blocks of a partition at the end
    h.add(2, prompt_of(1, 2), 10);  // B
    h.add(3, prompt_of(4, 3), 10);  // C
    h.add(4, prompt_of(1, 4), 10);  // D
  };
  Harness reference(256, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
  load(reference);
  reference.run_to_completion();

  Harness h(8, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64}, /*num_partitions=*/2);
  load(h);
  h.step();  // all four admitted, each bound to the most free partition at its turn
  EXPECT_EQ(h.blocks.partition_of(1), 0);
  EXPECT_EQ(h.blocks.partition_of(2), 1);
  EXPECT_EQ(h.blocks.partition_of(3), 0);
  EXPECT_EQ(h.blocks.partition_of(4), 1);
  while (h.sched.stats().num_preemptions == 0 && h.sched.has_work()) h.step();
  // A needed a third block while partition 0 was full; partition 1 still had room for B and D.
  EXPECT_EQ(h.sched.stats().num_preemptions, 1u);
  EXPECT_EQ(h.sched.find(3)->num_preemptions, 1);
  EXPECT_EQ(h.sched.find(4)->num_preemptions, 0);
  EXPECT_EQ(h.sched.find(1)->num_preemptions, 0);
  EXPECT_EQ(h.sched.num_running(), 3);
  EXPECT_EQ(h.sched.num_waiting(), 1);
  h.run_to_completion();
  ASSERT_EQ(h.outputs.size(), 4u);
  for (const auto& [id, out] : reference.outputs) EXPECT_EQ(h.outputs[id], out) << "request " << id;
  EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
}

// The tiny-pool load of PreemptionUnderTinyPoolsKeepsEveryOutput split over 2 and 4 partitions,
// each still large enough for the largest request: every request completes once, as unconstrained.
TEST(Scheduler, PreemptionWithPartitionsKeepsEveryOutput) {
  constexpr int kBlock = kTinyPoolBlock;
  const auto load = add_tiny_pool_load;
  const auto reference_outputs = tiny_pool_reference_outputs();

  // The largest request needs 11 blocks, so each partition has at least 11.
  for (const auto& [num_partitions, num_blocks] :
       std::vector<std::pair<int, int>>{{2, 22}, {2, 24}, {2, 40}, {4, 44}, {4, 64}}) {
    uint64_t num_preemptions = 0;
    for (int budget : {8, 16, 64}) {
      Harness h(num_blocks, kBlock, {.max_num_seqs = 8, .max_num_batched_tokens = budget},
                num_partitions);
      load(h);
      h.run_to_completion();
      ASSERT_EQ(h.outputs.size(), 12u) << num_partitions << " x " << num_blocks / num_partitions;
      for (const auto& [id, out] : reference_outputs) {
        EXPECT_EQ(h.outputs[id], out) << "request " << id << " with " << num_partitions << " x "
                                      << num_blocks / num_partitions << " blocks";
      }
      EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
      num_preemptions += h.sched.stats().num_preemptions;
    }
    if (num_blocks / num_partitions <= 12) {
      EXPECT_GT(num_preemptions, 0u) << num_partitions << " x " << num_blocks / num_partitions;
    }
  }
}

// ---- Drafts -------------------------------------------------------------------------------------

// Runs `h` until every sequence of `ids` decodes (its prompt is done).
void run_until_decoding(Harness& h, std::initializer_list<int64_t> ids) {
  for (int i = 0; i < 100; ++i) {
    if (std::all_of(ids.begin(), ids.end(),
                    [&](int64_t id) { return h.sched.find(id)->num_output_tokens() > 0; }))
      return;
    h.step();
  }
  FAIL() << "the prompts did not finish";
}

// A decode with k drafts takes 1 + k tokens of the budget and KV slots for all of them; the budget
// beyond one token per decode goes to drafts oldest first, and a running prefill gets what remains.
TEST(Scheduler, ADecodeWithDraftsTakesOnePlusKTokens) {
  Harness h(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 12});
  h.add(1, prompt_of(3, 1), 50);
  h.add(2, prompt_of(2, 2), 50);
  h.add(3, prompt_of(2, 3), 50);
  run_until_decoding(h, {1, 2, 3});
  h.add(4, prompt_of(40, 4), 5);  // a long prompt: the budget left goes to it
  h.sched.find(1)->draft_tokens = {1, 2, 3};
  h.sched.find(2)->draft_tokens = std::vector<int32_t>(10, 7);  // more than the budget holds
  const SchedulerOutput out = h.step();
  ASSERT_EQ(out.chunks.size(), 3u);  // 3 gets its one token; 4 is not admitted: no budget left
  EXPECT_EQ(out.chunks[0].num_tokens, 4);
  EXPECT_EQ(out.chunks[0].num_draft_tokens, 3);
  EXPECT_TRUE(out.chunks[0].sample);
  EXPECT_EQ(out.chunks[1].num_tokens, 1 + 12 - 3 - 3);  // what is left beyond 1's and 3's token
  EXPECT_EQ(out.chunks[1].num_draft_tokens, 12 - 3 - 3);
  EXPECT_EQ(out.chunks[2].num_tokens, 1);
  EXPECT_EQ(out.chunks[2].num_draft_tokens, 0);
  EXPECT_EQ(out.num_batched_tokens, 12);
  // The step consumed every draft, verified or not.
  for (int64_t id : {1, 2, 3}) EXPECT_TRUE(h.sched.find(id)->draft_tokens.empty());
  // Without drafts the prompt of 4 is admitted next to the decodes.
  const SchedulerOutput next = h.step();
  ASSERT_EQ(next.chunks.size(), 4u);
  EXPECT_EQ(next.chunks[3].seq->id, 4);
  EXPECT_EQ(next.chunks[3].num_tokens, 12 - 3);
}

// update() commits the accepted drafts and the token after them, counts them computed, and
// releases the blocks that held only rejected drafts; a backend answer that commits more tokens
// than it verified, or other tokens than the drafts, is refused.
TEST(Scheduler, UpdateCommitsTheAcceptedDraftsAndRollsBackTheRest) {
  BlockManager blocks(16, 4);
  Scheduler sched({.max_num_seqs = 4, .max_num_batched_tokens = 16}, blocks);
  auto seq = std::make_unique<Sequence>();
  seq->id = 1;
  seq->tokens = {10, 11, 12};
  Sequence& s = *seq;
  sched.add(std::move(seq));
  const auto sampled = [](std::vector<int32_t> tokens) {
    std::vector<SampledToken> out;
    for (int32_t t : tokens) {
      SampledToken s;
      s.token = t;
      s.seq_id = 1;
      out.push_back(s);
    }
    return out;
  };
  sched.update(sched.schedule(), sampled({13}));  // the prompt, then its first token
  ASSERT_EQ(s.num_computed, 3);
  s.draft_tokens = {20, 21, 22, 23, 24, 25, 26};
  SchedulerOutput out = sched.schedule();
  ASSERT_EQ(out.chunks[0].num_draft_tokens, 7);
  EXPECT_EQ(blocks.block_table(1).size(), 3u);  // 3 + 1 + 7 = 11 slots
  EXPECT_THROW(sched.update(out, sampled({20, 21, 22, 23, 24, 25, 26, 27, 28})), Error);
  EXPECT_THROW(sched.update(out, sampled({20, 99, 5})), Error);
  sched.update(out, sampled({20, 21, 5}));  // two accepted, then the correction
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{10, 11, 12, 13, 20, 21, 5}));
  EXPECT_EQ(s.num_computed, 6);
  EXPECT_TRUE(s.draft_tokens.empty());
  EXPECT_EQ(blocks.block_table(1).size(), 2u);  // slots for the 7 tokens
  blocks.check_invariants();
  // Every draft accepted: the bonus token follows and nothing is released.
  s.draft_tokens = {30, 31};
  out = sched.schedule();
  sched.update(out, sampled({30, 31, 32}));
  EXPECT_EQ(s.num_computed, 9);
  EXPECT_EQ(s.tokens.size(), 10u);
  EXPECT_EQ(blocks.block_table(1).size(), 3u);
  blocks.check_invariants();
}

// When the blocks for a decode's drafts are not free it runs without them: drafts never preempt.
TEST(Scheduler, DraftsNeverPreempt) {
  Harness h(4, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 16});
  h.add(1, prompt_of(3, 1), 12);
  h.add(2, prompt_of(7, 2), 12);
  run_until_decoding(h, {1, 2});  // 1 block for 1's 4 tokens, 2 blocks for 2's 8: 1 free
  h.sched.find(1)->draft_tokens = std::vector<int32_t>(8, 3);  // needs 2 more blocks
  const SchedulerOutput out = h.step();
  EXPECT_EQ(out.chunks[0].num_tokens, 1);
  EXPECT_EQ(out.chunks[0].num_draft_tokens, 0);
  EXPECT_EQ(h.sched.stats().num_preemptions, 0u);
}

// Lookahead (an MTP drafter's K/V room): a chunk that samples gets blocks for 3 positions past its
// tokens while they are free, one that does not sample gets none, and a full pool gives none
// without preempting anyone. Outputs are those of a run without lookahead.
TEST(Scheduler, LookaheadBlocksAreTakenOnlyWhenFree) {
  auto load = [](Harness& h) {
    h.add(1, prompt_of(4, 1), 6);
    h.step();
    h.add(2, prompt_of(20, 2), 4);
  };
  Harness reference(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 16});
  load(reference);
  reference.run_to_completion();

  Harness h(8, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 16, .num_lookahead_tokens = 3});
  load(h);
  EXPECT_EQ(h.blocks.block_table(1).size(), 2u);  // 4 prompt tokens + 3 ahead
  h.step();  // 1 decodes (5 + 3 ahead: still 2 blocks); 2 prefills 15 tokens, no sample
  EXPECT_EQ(h.blocks.block_table(1).size(), 2u);
  EXPECT_EQ(h.blocks.block_table(2).size(), 4u);
  h.step();  // 1: 6 + 3 ahead = 3 blocks; 2 ends its prompt in block 5 of 8, nothing ahead left
  EXPECT_EQ(h.blocks.block_table(1).size(), 3u);
  EXPECT_EQ(h.blocks.block_table(2).size(), 5u);
  EXPECT_EQ(h.blocks.num_free_blocks(), 0);
  EXPECT_EQ(h.sched.stats().num_preemptions, 0u);
  h.run_to_completion();
  EXPECT_EQ(h.outputs, reference.outputs);
  EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
}

// Drafts that are all right, right for a while, or wrong, for greedy and seeded sequences, through
// tiny pools that preempt and partitions: every request completes with exactly the outputs of the
// run without drafts, and the fake backend, which reads its context back from the cache, shows no
// rejected draft's K/V was read as a token. Right drafts take fewer steps.
// A drafter for the tiny-pool load: request id's drafts are its next k reference tokens, all right
// for ids 0 mod 3, wrong from draft `right_for` on for ids 1 mod 3, all wrong for ids 2 mod 3.
std::function<std::vector<int32_t>(const Sequence&)> reference_drafter(
    const std::map<int64_t, std::vector<int32_t>>& reference_outputs, int k, int right_for) {
  return [&reference_outputs, k, right_for](const Sequence& seq) {
    const std::vector<int32_t>& ref = reference_outputs.at(seq.id);
    std::vector<int32_t> drafts;
    for (int j = 0; j < k; ++j) {
      const size_t at = static_cast<size_t>(seq.num_output_tokens() + j);
      if (at >= ref.size()) break;
      const int right = (seq.id % 3 == 0) ? k : (seq.id % 3 == 1 ? right_for : 0);
      drafts.push_back(j < right ? ref[at] : (ref[at] + 1) % FakeBackend::kVocab);
    }
    return drafts;
  };
}

TEST(Scheduler, DraftsNeverChangeTheOutputs) {
  const auto reference_outputs = tiny_pool_reference_outputs();
  size_t steps_without = 0;
  {
    Harness h(1024, kTinyPoolBlock, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
    add_tiny_pool_load(h);
    h.run_to_completion();
    steps_without = h.backend.steps.size();
  }
  for (const auto& [num_partitions, num_blocks] :
       std::vector<std::pair<int, int>>{{1, 1024}, {1, 11}, {1, 16}, {2, 24}, {4, 64}}) {
    for (int budget : {8, 64}) {
      for (const auto& [k, right_for] : std::vector<std::pair<int, int>>{{1, 1}, {3, 2}, {6, 4}}) {
        SCOPED_TRACE(::testing::Message() << num_partitions << " x " << num_blocks / num_partitions
                                          << " blocks, budget " << budget << ", k " << k);
        Harness h(num_blocks, kTinyPoolBlock, {.max_num_seqs = 8, .max_num_batched_tokens = budget},
                  num_partitions);
        h.drafter = reference_drafter(reference_outputs, k, right_for);
        add_tiny_pool_load(h);
        h.run_to_completion();
        ASSERT_EQ(h.outputs.size(), 12u);
        for (const auto& [id, out] : reference_outputs) {
          EXPECT_EQ(h.outputs[id], out) << "request " << id;
        }
        EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
        const bool verified = std::any_of(h.chunks.begin(), h.chunks.end(),
                                          [](const auto& c) { return c.num_draft_tokens > 0; });
        EXPECT_TRUE(verified);
        if (num_blocks == 1024 && budget == 64) {
          EXPECT_LT(h.backend.steps.size(), steps_without);
        }
      }
    }
  }
}

// Random arrivals and aborts on a small pool; surviving requests match a roomy reference run. With
// even seeds the sequences also carry drafts of the reference tokens, right for a random while,
// through prefix hits, preemptions and aborts; with seeds 3 mod 4 sampling chunks take lookahead
// blocks.
TEST(Scheduler, RandomArrivalsAndAbortsMatchReference) {
  for (uint32_t seed = 1; seed <= 8; ++seed) {
    std::mt19937 rng(seed);
    struct Req {
      std::vector<int32_t> prompt;
      int max_tokens;
      int arrive_step;
      int abort_step;  // -1: never
    };
    std::vector<Req> reqs;
    for (int i = 0; i < 24; ++i) {
      // Half the requests share a 12-token prefix, so prefix hits mix with preemption.
      auto prompt = (rng() % 2) ? prompt_of(12, 77) : std::vector<int32_t>{};
      const auto tail = prompt_of(1 + static_cast<int>(rng() % 10), static_cast<int32_t>(i));
      prompt.insert(prompt.end(), tail.begin(), tail.end());
      reqs.push_back({prompt, 1 + static_cast<int>(rng() % 12), static_cast<int>(rng() % 30),
                      (rng() % 4 == 0) ? static_cast<int>(rng() % 40) : -1});
    }
    Harness ref(4096, 4, {.max_num_seqs = 64, .max_num_batched_tokens = 4096});
    for (size_t i = 0; i < reqs.size(); ++i)
      ref.add(static_cast<int64_t>(i), reqs[i].prompt, reqs[i].max_tokens);
    ref.run_to_completion();

    // Seeds 3 mod 4 also take lookahead blocks (an MTP drafter's), which must change nothing.
    Harness h(9, 4,
              {.max_num_seqs = 4,
               .max_num_batched_tokens = 6,
               .num_lookahead_tokens = seed % 4 == 3 ? 2 : 0});
    if (seed % 2 == 0) {
      h.drafter = [&](const Sequence& seq) {
        const std::vector<int32_t>& out = ref.outputs[seq.id];
        std::vector<int32_t> drafts;
        const int right = static_cast<int>(rng() % 4);
        for (int j = 0; j < 3; ++j) {
          const size_t at =
              std::min(out.size() - 1, static_cast<size_t>(seq.num_output_tokens()) + j);
          drafts.push_back(j < right ? out[at] : (out[at] + 1) % FakeBackend::kVocab);
        }
        return drafts;
      };
    }
    std::set<int64_t> aborted;
    for (int step = 0; step < 5000; ++step) {
      for (size_t i = 0; i < reqs.size(); ++i) {
        if (reqs[i].arrive_step == step)
          h.add(static_cast<int64_t>(i), reqs[i].prompt, reqs[i].max_tokens);
        if (reqs[i].abort_step == step && h.sched.finish(static_cast<int64_t>(i))) {
          aborted.insert(static_cast<int64_t>(i));
        }
      }
      if (step > 40 && !h.sched.has_work()) break;
      h.step();
    }
    EXPECT_FALSE(h.sched.has_work());
    if (h.drafter) {
      EXPECT_TRUE(std::any_of(h.chunks.begin(), h.chunks.end(),
                              [](const auto& c) { return c.num_draft_tokens > 0; }));
    }
    EXPECT_GT(h.sched.stats().prefix_cache_hits, 0u) << "seed " << seed;
    EXPECT_EQ(h.outputs.size() + aborted.size(), reqs.size()) << "seed " << seed;
    for (const auto& [id, out] : h.outputs) {
      EXPECT_EQ(out, ref.outputs[id]) << "seed " << seed << " request " << id;
    }
    EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
  }
}

// ---- Recurrent-state slots (hybrid models) ------------------------------------------------------

// Slots bound admission: with slots for three sequences no more than three run (max_num_seqs
// allows eight), the rest wait in FCFS order, and every request completes with the output it gets
// without state. A shared prefix gives no hit: the state is built from every token.
TEST(Scheduler, StateSlotsBoundAdmissionAndSkipThePrefixCache) {
  const auto system = prompt_of(16, 9);
  auto run = [&](Harness& h) {
    for (int id = 0; id < 6; ++id) {
      auto prompt = system;
      prompt.push_back(id);
      h.add(id, prompt, 5 + id);
      if (id == 0) h.step();  // the first fills the prefix cache before the others arrive
    }
    while (h.sched.has_work()) {
      EXPECT_LE(h.sched.num_running(), h.states ? 3 : 8);
      h.step();
    }
  };
  Harness reference(256, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
  run(reference);
  EXPECT_GT(reference.sched.stats().prefix_cache_hits, 0u);

  Harness h(256, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64}, 1, /*num_state_slots=*/3);
  run(h);
  EXPECT_EQ(h.outputs, reference.outputs);
  EXPECT_EQ(h.sched.stats().prefix_cache_hits, 0u);
  EXPECT_EQ(h.states->num_free_slots(), 3);
  EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
}

// Preemption returns a sequence's slots and its recompute starts from a fresh state (the fake
// backend checks every sampled row's state against its context): the tiny-pool load completes with
// the unconstrained outputs whether blocks or slots are what runs short.
TEST(Scheduler, StateSlotsThroughPreemptionKeepEveryOutput) {
  const auto reference_outputs = tiny_pool_reference_outputs();
  uint64_t num_preemptions = 0;
  for (int num_blocks : {11, 16, 40}) {
    for (int num_slots : {1, 3, 8}) {
      for (int budget : {8, 64}) {
        SCOPED_TRACE(::testing::Message() << num_blocks << " blocks, " << num_slots
                                          << " slots, budget " << budget);
        Harness h(num_blocks, kTinyPoolBlock,
                  {.max_num_seqs = 8, .max_num_batched_tokens = budget}, 1, num_slots);
        add_tiny_pool_load(h);
        h.run_to_completion();
        ASSERT_EQ(h.outputs.size(), 12u);
        for (const auto& [id, out] : reference_outputs) {
          EXPECT_EQ(h.outputs[id], out) << "request " << id;
        }
        EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
        EXPECT_EQ(h.states->num_free_slots(), num_slots);
        num_preemptions += h.sched.stats().num_preemptions;
      }
    }
  }
  EXPECT_GT(num_preemptions, 0u);
}

// With drafts each sequence holds 1 + k slots, the extra ones the backend's scratch states for the
// draft positions; the state kept is the one after the accepted drafts, so outputs never change.
TEST(Scheduler, StateSlotsWithDraftsKeepEveryOutput) {
  const auto reference_outputs = tiny_pool_reference_outputs();
  for (const auto& [num_partitions, num_blocks] :
       std::vector<std::pair<int, int>>{{1, 1024}, {1, 16}, {2, 24}}) {
    for (const auto& [k, right_for] : std::vector<std::pair<int, int>>{{1, 1}, {3, 2}}) {
      SCOPED_TRACE(::testing::Message() << num_partitions << " x " << num_blocks / num_partitions
                                        << " blocks, k " << k);
      const int per_sequence = 1 + k;
      Harness h(num_blocks, kTinyPoolBlock, {.max_num_seqs = 8, .max_num_batched_tokens = 64},
                num_partitions, num_partitions * 3 * per_sequence, per_sequence);
      h.drafter = reference_drafter(reference_outputs, k, right_for);
      add_tiny_pool_load(h);
      h.run_to_completion();
      ASSERT_EQ(h.outputs.size(), 12u);
      for (const auto& [id, out] : reference_outputs) {
        EXPECT_EQ(h.outputs[id], out) << "request " << id;
      }
      EXPECT_TRUE(std::any_of(h.chunks.begin(), h.chunks.end(),
                              [](const auto& c) { return c.num_draft_tokens > 0; }));
      EXPECT_EQ(h.states->num_free_slots(), h.states->num_slots());
    }
  }
}

// With DP partitions a sequence goes where it can get its slots, even when another partition has
// more free blocks, and its blocks follow it there. Two partitions of 8 blocks, two slots each: A
// and C land in partition 0, B (six blocks) in 1; D then goes to partition 1 although partition 0
// has more free blocks, and E waits for a slot while blocks are free.
TEST(Scheduler, StateSlotsChooseAPartitionWithRoom) {
  auto load = [](Harness& h) {
    h.add(1, prompt_of(2, 1), 2);   // A
    h.add(2, prompt_of(22, 2), 2);  // B
    h.add(3, prompt_of(2, 3), 2);   // C
    h.add(4, prompt_of(2, 4), 2);   // D
    h.add(5, prompt_of(2, 5), 2);   // E
  };
  Harness reference(256, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
  load(reference);
  reference.run_to_completion();

  Harness h(16, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64}, /*num_partitions=*/2,
            /*num_state_slots=*/4);
  load(h);
  h.step();
  EXPECT_EQ(h.blocks.partition_of(1), 0);
  EXPECT_EQ(h.blocks.partition_of(2), 1);
  EXPECT_EQ(h.blocks.partition_of(3), 0);
  EXPECT_EQ(h.blocks.partition_of(4), 1);
  EXPECT_EQ(h.sched.num_running(), 4);
  EXPECT_EQ(h.sched.num_waiting(), 1);
  EXPECT_FALSE(h.blocks.has_sequence(5));
  EXPECT_GT(h.blocks.num_free_blocks(0), 0);
  h.run_to_completion();
  EXPECT_EQ(h.outputs, reference.outputs);
}

// Hybrid prefix caching: the start of each request's first chunk is its hit.
int first_chunk_start(const Harness& h, int64_t id) {
  for (const auto& c : h.chunks) {
    if (c.id == id) return c.start;
  }
  ADD_FAILURE() << "sequence " << id << " never ran";
  return -1;
}

// Every snapshot can be taken again: none is left pending or pinned.
void expect_all_snapshots_free(StateSnapshotPool& pool) {
  for (int i = 0; i < pool.num_snapshots(); ++i) {
    EXPECT_GE(pool.allocate(pool.partition_of_snapshot(i)), 0) << "snapshot " << i;
  }
}

// A hybrid model's hit reaches only the last block boundary of its cached KV prefix that has a
// state snapshot, never below one block; a KV prefix found without one becomes a snapshot (the
// branch point) for the next prompt. The fake backend checks every sampled row's state against
// its context, so a hit restoring the wrong state fails; the outputs are the attention-only run's.
TEST(Scheduler, HybridHitStopsAtTheLastSnapshottedBoundary) {
  const auto a = prompt_of(18, 1);
  auto shared_with_a = [&](size_t shared, int32_t salt, int tail) {
    std::vector<int32_t> p(a.begin(), a.begin() + static_cast<ptrdiff_t>(shared));
    const auto t = prompt_of(tail, salt);
    EXPECT_NE(t.front(), a[shared]);
    p.insert(p.end(), t.begin(), t.end());
    return p;
  };
  auto run = [&](Harness& h) {
    h.add(1, a, 2);  // one chunk [0, 18): a snapshot at 16, its last boundary
    h.run_to_completion();
    h.add(2, shared_with_a(10, 2, 10), 1);  // KV hit 8, no snapshot there: none
    h.run_to_completion();
    h.add(3, shared_with_a(11, 3, 6), 1);  // B left one at its branch point, 8
    h.run_to_completion();
    h.add(4, shared_with_a(17, 4, 3), 1);  // KV hit 16, A's snapshot
    h.run_to_completion();
    h.add(5, shared_with_a(14, 5, 3), 1);  // KV hit 12, no snapshot at 12: back to 8
    h.run_to_completion();
    h.add(6, shared_with_a(3, 6, 9), 1);  // less than a block shared: no hit
    h.run_to_completion();
  };
  Harness reference(256, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
  run(reference);
  Harness h(256, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64}, 1, 4, 1, 16);
  run(h);
  EXPECT_EQ(h.outputs, reference.outputs);
  EXPECT_EQ(first_chunk_start(h, 1), 0);
  EXPECT_EQ(first_chunk_start(h, 2), 0);
  EXPECT_EQ(first_chunk_start(h, 3), 8);
  EXPECT_EQ(first_chunk_start(h, 4), 16);
  EXPECT_EQ(first_chunk_start(h, 5), 8);
  EXPECT_EQ(first_chunk_start(h, 6), 0);
  EXPECT_EQ(h.backend.num_restores, 3);
  EXPECT_EQ(h.sched.stats().prefix_cache_hits, 8u + 16u + 8u);
  EXPECT_EQ(first_chunk_start(reference, 2), 8);  // attention-only: every cached block
  expect_all_snapshots_free(*h.snapshots);
}

// A snapshot goes with its block: once the prefix cache evicts the block, the snapshot is dropped
// (its slot free again) and the prefix is recomputed from position 0.
TEST(Scheduler, HybridSnapshotsLeaveWithTheirBlocks) {
  Harness h(8, 4, {.max_num_seqs = 2, .max_num_batched_tokens = 64}, 1, 2, 1, 4);
  h.add(1, prompt_of(9, 1), 1);
  h.run_to_completion();
  EXPECT_EQ(h.snapshots->num_cached(), 1);  // at 8
  h.add(2, prompt_of(30, 2), 1);            // needs all 8 blocks: A's cached ones are evicted
  h.run_to_completion();
  EXPECT_EQ(h.snapshots->num_cached(), 1);  // B's, at 28; A's went with its blocks
  h.add(3, prompt_of(9, 1), 1);
  h.run_to_completion();
  EXPECT_EQ(first_chunk_start(h, 3), 0);
  EXPECT_EQ(h.backend.num_restores, 0);
}

// Shared prefixes under pressure: pools from roomy to barely enough for one request, one to three
// state slots, one to eight snapshots, odd chunk budgets, with and without drafts. Every request
// gets the attention-only run's output (the fake backend checks every sampled row's state), hits
// happen, and no snapshot is left pending or pinned.
TEST(Scheduler, HybridPrefixCachingUnderPressureKeepsEveryOutput) {
  const auto system = prompt_of(13, 77);
  auto load = [&](Harness& h) {
    for (int id = 0; id < 10; ++id) {
      std::vector<int32_t> p(system.begin(), system.begin() + 5 + (id * 3) % 9);
      const auto tail = prompt_of(1 + (id * 5) % 7, id);
      p.insert(p.end(), tail.begin(), tail.end());
      h.add(id, p, 4 + (id * 7) % 11, id % 3 == 0 ? 0.8f : 0.0f);
    }
  };
  Harness reference(1024, 4, {.max_num_seqs = 64, .max_num_batched_tokens = 4096});
  load(reference);
  reference.run_to_completion();
  uint64_t hits = 0, preemptions = 0;
  for (int num_blocks : {7, 12, 64}) {
    for (int num_slots : {1, 3}) {
      for (int num_snapshots : {1, 8}) {
        for (int budget : {5, 64}) {
          for (int k : {0, 2}) {
            SCOPED_TRACE(::testing::Message()
                         << num_blocks << " blocks, " << num_slots << " slots, " << num_snapshots
                         << " snapshots, budget " << budget << ", drafts " << k);
            Harness h(num_blocks, 4, {.max_num_seqs = 4, .max_num_batched_tokens = budget}, 1,
                      num_slots * (1 + k), 1 + k, num_snapshots);
            if (k > 0) h.drafter = reference_drafter(reference.outputs, k, 1);
            load(h);
            h.run_to_completion();
            EXPECT_EQ(h.outputs, reference.outputs);
            EXPECT_DOUBLE_EQ(h.blocks.usage(), 0.0);
            expect_all_snapshots_free(*h.snapshots);
            hits += h.sched.stats().prefix_cache_hits;
            preemptions += h.sched.stats().num_preemptions;
          }
        }
      }
    }
  }
  EXPECT_GT(hits, 0u);
  EXPECT_GT(preemptions, 0u);
}

// A sequence's snapshots past its prompt supersede each other: with two snapshots, the one at the
// end of its prompt outlives the three its decode takes, so a prompt sharing it still hits.
TEST(Scheduler, HybridDecodeSnapshotsSupersedeEachOther) {
  Harness h(64, 4, {.max_num_seqs = 2, .max_num_batched_tokens = 64}, 1, 2, 1, 2);
  h.add(1, prompt_of(9, 1), 12);  // a snapshot at 8, then decodes reaching 12, 16 and 20
  h.run_to_completion();
  h.add(2, prompt_of(11, 1), 1);
  h.run_to_completion();
  EXPECT_EQ(first_chunk_start(h, 2), 8);
}

// A step that fails hands its plan's snapshots back: the pending saves and the hit's pin.
TEST(Scheduler, AbandonReturnsThePlansSnapshots) {
  Harness h(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 64}, 1, 2, 1, 2);
  h.add(1, prompt_of(9, 1), 1);
  h.run_to_completion();
  auto seq = std::make_unique<Sequence>();
  seq->id = 2;
  seq->tokens = prompt_of(13, 1);
  h.sched.add(std::move(seq));
  const SchedulerOutput out = h.sched.schedule();
  ASSERT_EQ(out.chunks.size(), 1u);
  EXPECT_GE(out.chunks[0].restore_snapshot, 0);
  EXPECT_EQ(out.chunks[0].snapshot_saves.size(), 1u);  // at 12
  h.sched.abandon(out);
  h.snapshots->check_invariants();
  h.sched.finish(2);
  expect_all_snapshots_free(*h.snapshots);
}

// A hand-over needs the slots its reservation took, in its blocks' partition.
TEST(Scheduler, StateSlotsRefuseAHandOverWithoutSlotsAndMismatchedPartitions) {
  BlockManager bm(8, 4, true, 2);
  StateSlotManager one_partition(4, 1, 1);
  EXPECT_THROW((Scheduler({.max_num_seqs = 2, .max_num_batched_tokens = 8}, bm, &one_partition)),
               Error);
  StateSlotManager states(4, 1, 2);
  Scheduler s({.max_num_seqs = 2, .max_num_batched_tokens = 8}, bm, &states);
  ASSERT_TRUE(bm.allocate(7, 4));
  auto seq = std::make_unique<Sequence>();
  seq->id = 7;
  seq->tokens = {1, 2, 3, 4, 5};
  seq->num_prompt_tokens = 4;
  seq->num_computed = 4;
  auto again = std::make_unique<Sequence>(*seq);
  EXPECT_THROW(s.add_running(std::move(seq)), Error);  // no slots
  ASSERT_TRUE(states.allocate(7, 1 - bm.partition_of(7)));
  EXPECT_THROW(s.add_running(std::make_unique<Sequence>(*again)), Error);  // the other partition
  states.free(7);
  ASSERT_TRUE(states.allocate(7, bm.partition_of(7)));
  s.add_running(std::move(again));
  EXPECT_EQ(s.num_running(), 1);
  // Finishing frees both.
  EXPECT_TRUE(s.finish(7));
  EXPECT_FALSE(states.has_sequence(7));
  EXPECT_FALSE(bm.has_sequence(7));
}

TEST(Scheduler, RejectsBadConfigAndDuplicates) {
  BlockManager bm(8, 4);
  EXPECT_THROW((Scheduler({.max_num_seqs = 8, .max_num_batched_tokens = 4}, bm)), Error);
  EXPECT_THROW((Scheduler({.max_num_seqs = 0, .max_num_batched_tokens = 4}, bm)), Error);
  Scheduler s({.max_num_seqs = 2, .max_num_batched_tokens = 8}, bm);
  auto a = std::make_unique<Sequence>();
  a->id = 1;
  a->tokens = {1, 2};
  s.add(std::move(a));
  auto b = std::make_unique<Sequence>();
  b->id = 1;
  b->tokens = {1};
  EXPECT_THROW(s.add(std::move(b)), Error);
  auto empty = std::make_unique<Sequence>();
  empty->id = 2;
  EXPECT_THROW(s.add(std::move(empty)), Error);
}

}  // namespace
}  // namespace relay

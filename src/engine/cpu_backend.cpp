// See cpu_backend.h.
#include "engine/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "engine/after_step.h"
#include "engine/ranks.h"
#include "engine/sampler.h"
#include "engine/step_check.h"
#include "model/registry.h"
#include "parallel/local_group.h"
#include "parallel/tcp_group.h"

namespace relay {

// One rank: its shard, KV pool, threads, and the flattened batch it runs this step.
struct CpuBackend::Rank {
  Rank(std::unique_ptr<Model> m, const KvCacheLayout& layout, int num_threads,
       parallel::RankPlace where)
      : model(std::move(m)), kv(layout), pool(num_threads), place(where) {}

  std::unique_ptr<Model> model;
  KvPool kv;
  std::unique_ptr<RecurrentStatePool> state;  // hybrid models only
  ThreadPool pool;
  parallel::RankPlace place;    // its TP / DP rank in the whole worker
  std::vector<size_t> members;  // indices into the step's batch of the sequences this rank runs
  ForwardBatch batch;
  FlatBatch flat;  // behind `batch`
  std::vector<int32_t> state_slots, snapshot_slots;  // local slot ids
  std::vector<uint8_t> state_fresh;
  // One MTP forward (the catch-up over a step's committed rows, or one step of the chain).
  struct MtpBatch {
    FlatBatch flat;
    // Per logit row: the member (index into members) it drafts for.
    std::vector<size_t> logit_member;
    std::vector<float> hidden, logits;
    void reset(int width) {
      flat.reset(width);
      logit_member.clear();
      hidden.clear();
    }
  } mtp;
  std::vector<std::vector<int32_t>> drafts;  // per member: the MTP head's proposals this step
  std::vector<float> logits;
};

namespace {

using namespace std::chrono_literals;

// NOTE: nodes are started by hand or by a launcher, in any order: the leader waits this long for
// the others to join. A step's answers may take as long as the slowest node's forward pass.
constexpr std::chrono::milliseconds kNodeSetupTimeout = 5min;
constexpr std::chrono::milliseconds kNodeStepTimeout = 30min;

int threads_per_rank(int requested, int num_local_ranks) {
  const int total = requested > 0
                        ? requested
                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, total / num_local_ranks);
}

// What every node must agree on to be one worker; compared before anything loads.
std::string worker_fingerprint(const ModelConfig& c, const CpuBackendOptions& o) {
  return str(c.architecture, " (", c.num_hidden_layers, " layers, hidden ", c.hidden_size,
             ", vocab ", c.vocab_size, ", ", c.num_experts, " experts), ", o.parallel.describe(),
             ", --nnodes ", o.nodes.nnodes, ", --block-size ", o.block_size,
             o.num_blocks > 0 ? str(", ", o.num_blocks, " KV blocks per rank")
                              : str(", ", o.kv_cache_bytes, " KV cache bytes"),
             c.has_linear_attention() ? str(", ", o.num_state_slots, " state slots and ",
                                            o.num_state_snapshots, " snapshots per DP rank")
                                      : "",
             o.load_format == LoadFormat::kDummy ? ", --load-format dummy" : "",
             // Every node runs the head's forwards (their MoE exchanges cross nodes).
             o.num_mtp_drafts > 0 ? str(", MTP with ", o.num_mtp_drafts, " drafts") : "");
}

void check_same_worker(parallel::TcpBootstrap& nodes, const std::string& mine) {
  const std::vector<std::vector<uint8_t>> all =
      nodes.all_gather(std::span(reinterpret_cast<const uint8_t*>(mine.data()), mine.size()));
  const std::string leader(all[0].begin(), all[0].end());
  for (size_t n = 1; n < all.size(); ++n) {
    const std::string theirs(all[n].begin(), all[n].end());
    RELAY_CHECK(theirs == leader, "--nnodes: node ", n, " was started for ", theirs,
                " but node 0 for ", leader,
                ": start every node with the same model and flags (only --node-rank differs)");
  }
}

bool any_failed(std::span<const NodeResult> results) {
  return std::any_of(results.begin(), results.end(),
                     [](const NodeResult& r) { return !r.error.empty(); });
}

}  // namespace

CpuBackend::CpuBackend(const std::filesystem::path& model_dir, const CpuBackendOptions& o)
    : parallel_(o.parallel) {
  RELAY_CHECK(o.block_size > 0, "block_size must be positive, got ", o.block_size);
  parallel_.validate();
  o.nodes.validate(parallel_);
  const int world = parallel_.world_size();
  const int num_local = o.nodes.ranks_per_node(parallel_);
  const int first_rank = o.nodes.first_rank(parallel_);
  const ModelConfig config = ModelConfig::load(model_dir);
  const Checkpoint ckpt = open_checkpoint(model_dir, o.load_format);
  // NOTE: what follows sampling runs where the sampled tokens are, on the node holding each DP
  // group's sampling rank (TP rank 0): a hybrid model's draft rollback (roll_back_states) and the
  // MTP head's drafts (propose_mtp_drafts), both in compute(). Their TP groups must not span nodes.
  if (o.nodes.nnodes > 1 && (config.has_linear_attention() || o.num_mtp_drafts > 0)) {
    RELAY_CHECK(o.nodes.ranks_per_node(parallel_) % parallel_.tp == 0,
                config.has_linear_attention() ? str(config.architecture, " (linear-attention layers)")
                                              : std::string("--speculative-config mtp"),
                " across nodes needs each TP group on one node (it runs after sampling, where the "
                "group samples): --tp ", parallel_.tp, " must divide the ",
                o.nodes.ranks_per_node(parallel_), " ranks of each of the --nnodes ",
                o.nodes.nnodes, " nodes");
  }
  if (o.nodes.nnodes > 1) {
    nodes_ = std::make_unique<NodeGroup>(o.nodes, kNodeSetupTimeout, kNodeStepTimeout);
    check_same_worker(nodes_->bootstrap(), worker_fingerprint(config, o));
    comms_ = parallel::make_tcp_group(nodes_->bootstrap(), first_rank, num_local, world);
  } else if (world > 1) {
    comms_ = parallel::make_local_group(world);
  }
  if (o.num_mtp_drafts > 0) {
    RELAY_CHECK(o.mtp.enabled, "num_mtp_drafts ", o.num_mtp_drafts, " needs the MTP head");
    num_mtp_drafts_ = o.num_mtp_drafts;
  }
  forced_draft_acceptance_ = o.forced_draft_acceptance;
  std::vector<std::unique_ptr<Model>> models;
  for (int i = 0; i < num_local; ++i) {
    const ShardSpec shard =
        make_shard(config, parallel_, first_rank + i, comms_.empty() ? nullptr : comms_[i].get());
    models.push_back(build_model(config, ckpt, shard, o.mtp));
  }
  // The recurrent-state pool comes out of the KV budget.
  size_t kv_bytes = o.kv_cache_bytes;
  if (config.has_linear_attention()) {
    RELAY_CHECK(o.num_state_slots > 0, "a model with linear-attention layers needs recurrent-state "
                "slots, got ", o.num_state_slots);
    RELAY_CHECK(o.num_state_snapshots >= 0, "num_state_snapshots must not be negative, got ",
                o.num_state_snapshots);
    state_slots_per_rank_ = o.num_state_slots;
    state_snapshots_per_rank_ = o.num_state_snapshots;
    const size_t state_bytes =
        models[0]->recurrent_state_layout(o.num_state_slots + o.num_state_snapshots).total_bytes();
    RELAY_CHECK(o.num_blocks > 0 || state_bytes < kv_bytes, "--kv-cache-memory ", kv_bytes,
                " bytes cannot hold the recurrent state of ", o.num_state_slots, " slots and ",
                o.num_state_snapshots, " snapshots (", state_bytes,
                " bytes: one per running sequence and draft position, and one per prefix-cache "
                "snapshot) and any KV");
    if (o.num_blocks == 0) kv_bytes -= state_bytes;
  }
  // Every rank gets the same number of blocks; global rank 0 (node 0's first) sets the count.
  if (o.nodes.is_leader()) {
    const KvCacheLayout layout = o.num_blocks > 0
                                     ? models[0]->kv_layout(o.block_size, o.num_blocks)
                                     : models[0]->kv_layout_for_budget(o.block_size, kv_bytes);
    blocks_per_rank_ = layout.num_blocks;
  }
  if (nodes_) {
    auto count = static_cast<uint32_t>(blocks_per_rank_);
    const std::vector<uint8_t> bytes = nodes_->bootstrap().broadcast(
        std::span(reinterpret_cast<const uint8_t*>(&count), sizeof(count)));
    RELAY_CHECK(bytes.size() == sizeof(count), "node 0 sent a KV block count of ", bytes.size(),
                " bytes");
    std::memcpy(&count, bytes.data(), sizeof(count));
    blocks_per_rank_ = static_cast<int>(count);
  }
  for (int i = 0; i < num_local; ++i) {
    const KvCacheLayout layout = models[i]->kv_layout(o.block_size, blocks_per_rank_);
    ranks_.push_back(std::make_unique<Rank>(std::move(models[i]), layout,
                                            threads_per_rank(o.num_threads, num_local),
                                            parallel::place_rank(parallel_, first_rank + i)));
    if (state_slots_per_rank_ > 0) {
      ranks_.back()->state =
          std::make_unique<RecurrentStatePool>(ranks_.back()->model->recurrent_state_layout(
              state_slots_per_rank_ + state_snapshots_per_rank_));
    }
  }
}

CpuBackend::~CpuBackend() {
  if (!nodes_ || !nodes_->config().is_leader() || !lost_.empty()) return;
  try {
    nodes_->send(NodeCommand::kShutdown);
  } catch (const Error&) {
    // NOTE: a follower that is already gone needs no goodbye; the destructor must not throw.
  }
}

const ModelConfig& CpuBackend::config() const { return ranks_.front()->model->config(); }
int CpuBackend::block_size() const { return ranks_.front()->kv.layout().block_size; }
KvPool& CpuBackend::kv_pool(int rank) { return ranks_.at(rank)->kv; }
size_t CpuBackend::state_slot_bytes() const {
  const auto& state = ranks_.front()->state;
  return state == nullptr ? 0 : state->layout().bytes_per_slot();
}

std::vector<KvPoolExport> CpuBackend::kv_pool_exports() {
  std::vector<KvPoolExport> out;
  for (auto& r : ranks_) {
    const ShardSpec& s = r->model->shard();
    out.push_back({reinterpret_cast<std::byte*>(r->kv.data()), r->kv.layout(), s.kv_head_begin,
                   s.num_local_kv_heads, r->place.dp_rank, -1});
  }
  return out;
}
std::vector<StatePoolExport> CpuBackend::state_pool_exports() {
  std::vector<StatePoolExport> out;
  for (auto& r : ranks_) {
    if (r->state == nullptr) continue;
    const ShardSpec& s = r->model->shard();
    out.push_back({reinterpret_cast<std::byte*>(r->state->data()), r->state->layout(),
                   s.k_head_begin, s.num_local_k_heads, s.v_head_begin, s.num_local_v_heads,
                   r->place.dp_rank, -1});
  }
  return out;
}
ThreadPool& CpuBackend::thread_pool(int rank) { return ranks_.at(rank)->pool; }

void CpuBackend::on_ranks(const std::function<void(Rank&)>& fn) {
  if (comms_.empty()) {
    fn(*ranks_.front());
    return;
  }
  run_on_rank_threads(
      ranks_.size(), [&](size_t i) { fn(*ranks_[i]); }, [&](size_t i) { comms_[i]->abort(); });
}

void CpuBackend::build_batch(Rank& r, std::span<const StepSequence> batch,
                             const std::vector<RowsOf>& rows_of) {
  const int bs = block_size();
  const int32_t first_block = r.place.dp_rank * blocks_per_rank_;
  size_t max_blocks = 1;
  for (size_t i : r.members) max_blocks = std::max(max_blocks, batch[i].block_table.size());
  FlatBatch& f = r.flat;
  f.reset(static_cast<int>(max_blocks));
  std::vector<int32_t> local;
  for (size_t m = 0; m < r.members.size(); ++m) {
    const StepSequence& s = batch[r.members[m]];
    localize_block_table(s, first_block, blocks_per_rank_, local);
    f.append(s.tokens, s.num_computed, local, bs);
    const int32_t last = f.query_starts.back() - 1;
    if (rows_of[r.members[m]] == RowsOf::kLast) f.logit_rows.push_back(last);
    if (rows_of[r.members[m]] == RowsOf::kAll) {
      for (int32_t row = f.query_starts[m]; row <= last; ++row) f.logit_rows.push_back(row);
    }
  }
  r.batch = f.view();
  if (r.state == nullptr) return;
  // The recurrent state: each sequence's slot, fresh from position 0, and with drafts the
  // snapshots of the rows a rollback may return to (the last token's and each draft's but the
  // last, whose state is the one the slot ends with).
  const int32_t first_slot = r.place.dp_rank * state_slots_per_rank_;
  auto local_slot = [&](const StepSequence& s, size_t i) {
    RELAY_CHECK(i < s.state_slots.size(), "sequence ", s.seq_id, " verifies ", s.num_draft_tokens,
                " drafts with ", s.state_slots.size(),
                " recurrent-state slots; it needs one more than its drafts");
    const int32_t slot = s.state_slots[i] - first_slot;
    RELAY_CHECK(slot >= 0 && slot < state_slots_per_rank_, "sequence ", s.seq_id,
                ": recurrent-state slot ", s.state_slots[i], " is not on its DP rank ",
                r.place.dp_rank);
    return slot;
  };
  r.state_slots.clear();
  r.state_fresh.clear();
  r.snapshot_slots.assign(r.flat.token_ids.size(), -1);
  bool snapshots = false;
  for (size_t m = 0; m < r.members.size(); ++m) {
    const StepSequence& s = batch[r.members[m]];
    r.state_slots.push_back(local_slot(s, 0));
    r.state_fresh.push_back(s.num_computed == 0 ? 1 : 0);
    const int32_t first_row = r.flat.query_starts[m + 1] - 1 - s.num_draft_tokens;
    for (int32_t j = 0; j < s.num_draft_tokens; ++j) {
      r.snapshot_slots[first_row + j] = local_slot(s, 1 + static_cast<size_t>(j));
      snapshots = true;
    }
    RELAY_CHECK(s.num_draft_tokens == 0 || s.restore_state_snapshot < 0, "sequence ", s.seq_id,
                ": a state snapshot restored under drafts (a decode restores none)");
    if (s.restore_state_snapshot >= 0) {
      RELAY_CHECK(s.num_computed > 0, "sequence ", s.seq_id,
                  " restores a state snapshot but computes from position 0");
      r.state->copy_slot(r.state_slots.back(), local_snapshot_slot(r, s, s.restore_state_snapshot));
    }
    for (const SnapshotSave& save : s.save_state_snapshots) {
      RELAY_CHECK(save.row >= 0 && static_cast<size_t>(save.row) < s.tokens.size(), "sequence ",
                  s.seq_id, ": state snapshot after row ", save.row, " of its ", s.tokens.size(),
                  " tokens");
      const int32_t slot = local_snapshot_slot(r, s, save.snapshot);
      // With drafts the copy comes after verification, from the row's draft slot
      // (roll_back_states).
      if (s.num_draft_tokens > 0) continue;
      r.snapshot_slots[r.flat.query_starts[m] + save.row] = slot;
      snapshots = true;
    }
  }
  r.batch.recurrent_state = r.state.get();
  r.batch.state_slots = r.state_slots;
  r.batch.state_fresh = r.state_fresh;
  if (snapshots) r.batch.state_snapshot_slots = r.snapshot_slots;
}

int32_t CpuBackend::local_snapshot_slot(const Rank& r, const StepSequence& s, int32_t id) const {
  // Prefix-cache snapshots follow the state slots in each rank's pool.
  const int32_t local = id - r.place.dp_rank * state_snapshots_per_rank_;
  RELAY_CHECK(local >= 0 && local < state_snapshots_per_rank_, "sequence ", s.seq_id,
              ": state snapshot ", id, " is not on its DP rank ", r.place.dp_rank, " (",
              state_snapshots_per_rank_, " snapshots per rank)");
  return state_slots_per_rank_ + local;
}

std::vector<std::vector<int32_t>> CpuBackend::propose_mtp_drafts(
    std::span<const StepSequence> batch, std::span<const SampledToken> sampled) {
  // Per sequence: its catch-up rows and the token after them (engine/after_step.h).
  const int bs = block_size();
  const std::vector<MtpCatchUp> catch_up = plan_mtp_catch_up(batch, sampled, num_mtp_drafts_, bs);
  const size_t hidden = static_cast<size_t>(config().hidden_size);
  // Under DP attention + EP the head's MoE exchanges every rank's rows: each rank runs all
  // num_mtp_drafts_ forwards, idle ones (forward_mtp_idle) where it has no rows left.
  // Member mi's block table in the rank's step (its own block ids, the batch's width).
  auto member_table = [](const Rank& r, size_t mi) {
    return std::span<const int32_t>(r.flat.block_tables).subspan(mi * r.flat.width, r.flat.width);
  };
  auto run_rank = [&](Rank& r) {
    Rank::MtpBatch& m = r.mtp;
    const bool exchange = r.model->shard().dispatch_tokens;
    r.drafts.assign(r.members.size(), {});
    m.reset(r.batch.max_blocks_per_seq);
    FlatBatch& f = m.flat;
    const std::span<const float> target_hidden = r.model->last_hidden();
    for (size_t mi = 0; mi < r.members.size(); ++mi) {
      const size_t i = r.members[mi];
      const StepSequence& s = batch[i];
      const int rows = catch_up[i].rows;
      if (rows == 0) continue;
      // Row j of the head reads the token after row j of the target and row j's hidden state.
      const int32_t first = r.flat.query_starts[mi];
      std::vector<int32_t> next(s.tokens.begin() + 1, s.tokens.begin() + rows);
      next.push_back(catch_up[i].next_token);
      f.append(next, s.num_computed, member_table(r, mi), bs);
      const auto rows_begin = target_hidden.begin() + static_cast<ptrdiff_t>(first * hidden);
      m.hidden.insert(m.hidden.end(), rows_begin, rows_begin + static_cast<ptrdiff_t>(rows * hidden));
      if (catch_up[i].drafts > 0) {
        f.logit_rows.push_back(static_cast<int32_t>(f.token_ids.size()) - 1);
        m.logit_member.push_back(mi);
      }
    }
    // NOTE: the ranks of one DP group build the same batches, so they stop together.
    if (f.token_ids.empty()) {
      if (exchange) {
        for (int step = 0; step < num_mtp_drafts_; ++step) r.model->forward_mtp_idle(r.pool);
      }
      return;
    }
    run_mtp_step(r);
    for (int step = 1; step < num_mtp_drafts_; ++step) {
      // Each chaining member's next row: its last draft at the next position, on the MTP
      // output of its previous row, until it has its plan's drafts.
      const std::vector<int32_t> prev_rows = f.logit_rows;
      const std::vector<size_t> prev_members = m.logit_member;
      const std::span<const float> prev_hidden = r.model->last_hidden();
      std::vector<float> chained_hidden;
      m.reset(r.batch.max_blocks_per_seq);
      for (size_t x = 0; x < prev_members.size(); ++x) {
        const size_t mi = prev_members[x];
        const MtpCatchUp& plan = catch_up[r.members[mi]];
        if (step >= plan.drafts) continue;
        f.append(std::span<const int32_t>(&r.drafts[mi].back(), 1), plan.chain_position(step),
                 member_table(r, mi), bs);
        const auto row = prev_hidden.begin() + static_cast<ptrdiff_t>(prev_rows[x] * hidden);
        chained_hidden.insert(chained_hidden.end(), row, row + static_cast<ptrdiff_t>(hidden));
        f.logit_rows.push_back(static_cast<int32_t>(f.token_ids.size()) - 1);
        m.logit_member.push_back(mi);
      }
      if (f.token_ids.empty()) {
        if (!exchange) break;
        r.model->forward_mtp_idle(r.pool);
        continue;
      }
      m.hidden = std::move(chained_hidden);
      run_mtp_step(r);
    }
  };
  on_ranks(run_rank);
  std::vector<std::vector<int32_t>> out(batch.size());
  for (auto& r : ranks_) {
    if (r->place.tp_rank != 0) continue;
    for (size_t mi = 0; mi < r->members.size(); ++mi) out[r->members[mi]] = std::move(r->drafts[mi]);
  }
  return out;
}

void CpuBackend::run_mtp_step(Rank& r) {
  Rank::MtpBatch& m = r.mtp;
  const ForwardBatch b = m.flat.view();
  r.model->forward_mtp(b, m.hidden, r.kv, r.pool, m.logits);
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  for (size_t x = 0; x < m.flat.logit_rows.size(); ++x) {
    const auto row = m.logits.begin() + static_cast<ptrdiff_t>(x * vocab);
    const auto best = std::max_element(row, row + static_cast<ptrdiff_t>(vocab));
    r.drafts[m.logit_member[x]].push_back(static_cast<int32_t>(best - row));
  }
}

void CpuBackend::roll_back_states(std::span<const StepSequence> batch,
                                  std::span<const SampledToken> sampled) {
  if (state_slots_per_rank_ == 0) return;
  const std::vector<std::span<const SampledToken>> runs = tokens_per_sequence(batch, sampled);
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSequence& s = batch[i];
    if (runs[i].empty() || s.num_draft_tokens == 0) continue;  // (empty: sampled on another node)
    // The scheduler commits the snapshots at accepted rows and drops the others.
    const std::vector<StateCopy> copies = draft_state_copies(s, runs[i].size() - 1, false);
    for (auto& r : ranks_) {
      if (std::find(r->members.begin(), r->members.end(), i) == r->members.end()) continue;
      const int32_t first_slot = r->place.dp_rank * state_slots_per_rank_;
      for (const StateCopy& c : copies) {
        r->state->copy_slot(c.to_snapshot >= 0 ? local_snapshot_slot(*r, s, c.to_snapshot)
                                               : s.state_slots[c.to_slot] - first_slot,
                            s.state_slots[c.from] - first_slot);
      }
    }
  }
}

NodeResult CpuBackend::compute(NodeCommand command, std::span<const StepSequence> batch,
                               std::exception_ptr& failure) {
  NodeResult result;
  try {
    // A step's sequence with prompt logprob rows or drafts needs every row's logits; the ones
    // that sample are its last 1 + num_draft_tokens. Every node derives the same rows from the
    // batch, as the LM head's collectives require.
    std::vector<RowsOf> rows_of;
    for (const StepSequence& s : batch) {
      const bool all_rows = s.num_prompt_logprob_rows() > 0 || s.num_draft_tokens > 0;
      rows_of.push_back(command == NodeCommand::kLogitsAll    ? RowsOf::kAll
                        : command == NodeCommand::kLogitsLast ? RowsOf::kLast
                        : all_rows                            ? RowsOf::kAll
                        : s.sample                            ? RowsOf::kLast
                                                              : RowsOf::kNone);
    }
    // Each sequence runs on the DP rank whose partition holds its first block (build_batch checks
    // the rest); with dp = 1 every rank runs every sequence.
    const std::vector<std::vector<size_t>> members =
        split_by_kv_partition(batch, parallel_.dp, blocks_per_rank_);
    for (auto& r : ranks_) r->members = members[r->place.dp_rank];

    auto run_rank = [&](Rank& r) {
      if (r.members.empty()) {
        if (r.model->shard().dispatch_tokens) r.model->forward_idle(r.pool);
        r.logits.clear();
        return;
      }
      build_batch(r, batch, rows_of);
      r.model->forward(r.batch, r.kv, r.pool, r.logits);
    };
    on_ranks(run_rank);

    // The logits of a sequence are on the TP-rank-0 rank of its DP group (with dp = 1, global rank
    // 0; all TP ranks agree). List this process's, in batch order.
    const size_t vocab = static_cast<size_t>(config().vocab_size);
    auto num_rows = [&](size_t i) -> size_t {
      return rows_of[i] == RowsOf::kNone   ? 0
             : rows_of[i] == RowsOf::kLast ? 1
                                           : batch[i].tokens.size();
    };
    struct Held {
      size_t seq;
      float* rows;  // into the rank's logits, which nothing reads after this step
      ThreadPool* pool;
    };
    std::vector<Held> held;
    for (auto& r : ranks_) {
      if (r->place.tp_rank != 0) continue;
      size_t row = 0;
      for (size_t i : r->members) {
        held.push_back({i, r->logits.data() + row * vocab, &r->pool});
        row += num_rows(i);
      }
    }
    std::sort(held.begin(), held.end(), [](const Held& a, const Held& b) { return a.seq < b.seq; });
    for (const Held& h : held) {
      const StepSequence& s = batch[h.seq];
      result.seqs.push_back(static_cast<uint32_t>(h.seq));
      if (command != NodeCommand::kStep) {
        result.logits.insert(result.logits.end(), h.rows, h.rows + num_rows(h.seq) * vocab);
        continue;
      }
      // Prompt logprobs before sampling, which changes its rows in place (never a scored row: the
      // first row that samples is the prompt's last, which has no next prompt token).
      if (const size_t scored = s.num_prompt_logprob_rows(); scored > 0) {
        const std::span<const int32_t> targets =
            s.prompt_tokens.subspan(s.num_computed + 1, scored);
        for (int32_t t : targets) {
          RELAY_CHECK(t >= 0 && static_cast<size_t>(t) < vocab, "sequence ", s.seq_id,
                      ": prompt token ", t, " is outside the vocabulary [0, ", vocab, ")");
        }
        std::vector<TokenLogprob>& rows = result.prompt_logprobs.emplace_back(scored);
        h.pool->parallel_for(static_cast<int64_t>(scored), 1, [&](int64_t begin, int64_t end) {
          std::vector<float> scratch;
          for (int64_t j = begin; j < end; ++j) {
            rows[j] = token_logprob(std::span<const float>(h.rows + j * vocab, vocab), targets[j],
                                    s.num_prompt_logprobs, scratch);
          }
        });
      }
      if (s.sample) {
        // In place: the sampler's penalties and temperature change only this step's rows. The last
        // row samples, and with drafts the one before each draft: they verify it. (The MTP head
        // reads the ranks' hidden states, not these logits.)
        const size_t first = num_rows(h.seq) - 1 - static_cast<size_t>(s.num_draft_tokens);
        const std::span<float> rows(h.rows + first * vocab, (num_rows(h.seq) - first) * vocab);
        for (SampledToken& t :
             sample_with_drafts(rows, s.tokens.last(s.num_draft_tokens), *s.sampling,
                                s.prompt_tokens, s.output_tokens, s.sample_index,
                                {s.allowed_tokens, s.logit_bias}, forced_draft_acceptance_)) {
          t.seq_id = s.seq_id;
          result.sampled.push_back(std::move(t));
        }
      }
    }
    // This node's DP groups sampled here (a TP group lies on one node for a hybrid model): their
    // recurrent states roll back to their last accepted tokens.
    if (command == NodeCommand::kStep) roll_back_states(batch, result.sampled);
    // The head drafts for the sequences sampled here (a TP group lies on one node with MTP).
    if (command == NodeCommand::kStep && num_mtp_drafts_ > 0) {
      std::vector<std::vector<int32_t>> drafts = propose_mtp_drafts(batch, result.sampled);
      for (const Held& h : held) {
        const StepSequence& s = batch[h.seq];
        if (s.sample && s.proposed_drafts != nullptr) result.drafts.push_back(std::move(drafts[h.seq]));
      }
    }
  } catch (const std::exception& e) {
    failure = std::current_exception();
    result = NodeResult{};
    result.error = e.what();
  }
  return result;
}

std::vector<NodeResult> CpuBackend::run_step(NodeCommand command,
                                             std::span<const StepSequence> batch) {
  RELAY_CHECK(
      !nodes_ || nodes_->config().is_leader(), "node ", nodes_->config().node_rank,
      " of a multi-node worker follows node 0 (CpuBackend::follow); it does not take steps");
  if (!lost_.empty()) fail(lost_);
  RELAY_CHECK(!batch.empty(), "step with an empty batch");
  // Checked here, before any node starts, so that a bad batch fails the step on every rank alike.
  StepLimits limits;
  limits.vocab_size = config().vocab_size;
  limits.block_size = block_size();
  limits.backend = "the CPU backend";
  for (const StepSequence& s : batch) check_step_sequence(s, limits);
  // A lost node ends the worker: its ranks' shards and KV are gone.
  const auto lose = [&](const Error& e) {
    lost_ = str("the multi-node worker lost a node and cannot run steps: ", e.what());
    fail(lost_);
  };
  if (nodes_) {
    try {
      nodes_->send(command, batch, num_mtp_drafts_ > 0);
    } catch (const Error& e) {
      lose(e);
    }
  }
  std::exception_ptr failure;
  NodeResult mine = compute(command, batch, failure);
  std::vector<NodeResult> all;
  if (nodes_) {
    try {
      all = nodes_->gather(std::move(mine));
    } catch (const Error& e) {
      lose(e);
    }
  } else {
    all.push_back(std::move(mine));
  }
  if (!failure && !any_failed(all)) return all;
  // Every node re-arms its collectives (a collective reset meets the other nodes' resets).
  if (nodes_) {
    try {
      nodes_->send(NodeCommand::kReset);
    } catch (const Error& e) {
      lose(e);
    }
  }
  if (!comms_.empty()) comms_.front()->reset();
  if (!nodes_) std::rethrow_exception(failure);
  // NOTE: every node's error is reported: the first to arrive is often a consequence (a rank that
  // saw its peer abort), the cause is on another node.
  std::string errors;
  for (size_t n = 0; n < all.size(); ++n) {
    if (!all[n].error.empty())
      errors += str(errors.empty() ? "" : "; ", "node ", n, ": ", all[n].error);
  }
  fail(str("the step failed on ", errors));
}

void CpuBackend::follow() {
  RELAY_CHECK(nodes_ && !nodes_->config().is_leader(),
              "follow() runs on nodes 1.. of a multi-node worker");
  for (;;) {
    const NodeStep step = nodes_->receive();
    if (step.command == NodeCommand::kShutdown) return;
    if (step.command == NodeCommand::kReset) {
      if (!comms_.empty()) comms_.front()->reset();
      continue;
    }
    std::exception_ptr failure;
    nodes_->reply(compute(step.command, step.batch, failure));
  }
}

std::vector<SampledToken> CpuBackend::step(std::span<const StepSequence> batch) {
  std::vector<NodeResult> all = run_step(NodeCommand::kStep, batch);
  // Each sampling sequence's tokens (its accepted drafts, then the token after them, consecutive
  // under its id), its MTP drafts for the next step, and each scored sequence's prompt logprobs,
  // come from the one node holding its logits.
  std::vector<std::span<const SampledToken>> tokens(batch.size());
  std::vector<std::vector<TokenLogprob>*> scored(batch.size(), nullptr);
  for (NodeResult& r : all) {
    size_t k = 0, p = 0, d = 0;
    for (uint32_t i : r.seqs) {
      RELAY_CHECK(i < batch.size(), "a node answered for sequence index ", i, " of ", batch.size());
      if (batch[i].sample) {
        size_t n = 0;
        while (k + n < r.sampled.size() && r.sampled[k + n].seq_id == batch[i].seq_id) ++n;
        RELAY_CHECK(n >= 1 && n <= 1 + static_cast<size_t>(batch[i].num_draft_tokens),
                    "a node returned ", n, " tokens for sequence ", batch[i].seq_id,
                    ", which verified ", batch[i].num_draft_tokens, " drafts");
        tokens[i] = std::span<const SampledToken>(r.sampled).subspan(k, n);
        k += n;
        if (num_mtp_drafts_ > 0 && batch[i].proposed_drafts != nullptr) {
          RELAY_CHECK(d < r.drafts.size(), "a node returned no MTP drafts for sequence ",
                      batch[i].seq_id);
          *batch[i].proposed_drafts = std::move(r.drafts[d++]);
        }
      }
      const size_t rows = batch[i].num_prompt_logprob_rows();
      if (rows == 0) continue;
      scored[i] = &r.prompt_logprobs.at(p++);
      RELAY_CHECK(scored[i]->size() == rows, "a node returned ", scored[i]->size(),
                  " prompt logprob rows for sequence ", batch[i].seq_id, ", expected ", rows);
    }
  }
  std::vector<SampledToken> out;
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSequence& s = batch[i];
    if (s.num_prompt_logprob_rows() > 0) {
      RELAY_CHECK(scored[i] != nullptr, "no node returned the prompt logprobs of sequence ",
                  s.seq_id);
      *s.prompt_logprobs = std::move(*scored[i]);
    } else if (s.num_prompt_logprobs >= 0) {
      s.prompt_logprobs->clear();
    }
    if (!s.sample) continue;
    RELAY_CHECK(!tokens[i].empty(), "no node sampled sequence ", s.seq_id);
    out.insert(out.end(), tokens[i].begin(), tokens[i].end());
  }
  return out;
}

std::vector<float> CpuBackend::forward_logits(std::span<const StepSequence> batch, LogitRows rows) {
  const std::vector<NodeResult> all = run_step(
      rows == LogitRows::kLastTokens ? NodeCommand::kLogitsLast : NodeCommand::kLogitsAll, batch);
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  const auto rows_of = [&](size_t i) {
    return rows == LogitRows::kLastTokens ? size_t{1} : batch[i].tokens.size();
  };
  std::vector<const float*> first(batch.size(), nullptr);
  for (const NodeResult& r : all) {
    size_t at = 0;
    for (uint32_t i : r.seqs) {
      first.at(i) = r.logits.data() + at;
      at += rows_of(i) * vocab;
    }
    RELAY_CHECK(at == r.logits.size(), "a node returned ", r.logits.size(), " logits for ", at,
                " expected");
  }
  std::vector<float> out;
  for (size_t i = 0; i < batch.size(); ++i) {
    RELAY_CHECK(first[i] != nullptr, "no node returned the logits of sequence ", batch[i].seq_id);
    out.insert(out.end(), first[i], first[i] + rows_of(i) * vocab);
  }
  return out;
}

}  // namespace relay

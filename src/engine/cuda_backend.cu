// See cuda_backend.h. The rank executor: the ranks (engine/cuda/rank_engine.h), each step split
// among them and their results merged back in batch order.
#include "engine/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "engine/cuda/rank_engine.h"
#include "engine/ranks.h"

namespace relay {

using cuda_engine::RankEngine;
using kernels::bf16;


// A rank's part of a step: the sequences it runs, with block tables in its own block ids.
struct RankPart {
  std::vector<size_t> members;  // batch indices, in batch order
  std::vector<StepSequence> seqs;
  std::vector<std::vector<int32_t>> tables;
};

struct CudaBackend::Impl {
  parallel::ParallelConfig parallel;
  std::unique_ptr<parallel::cuda::ThreadPeerGroup> group;  // null with one rank
  std::vector<std::unique_ptr<RankEngine>> ranks;
  int blocks_per_rank = 0;

  Impl(const std::filesystem::path& model_dir, const CudaBackendOptions& o) : parallel(o.parallel) {
    parallel.validate();
    const int world = parallel.world_size();
    const char* loading = std::getenv("CUDA_MODULE_LOADING");
    RELAY_CHECK(world == 1 || (loading != nullptr && std::string(loading) == "EAGER"),
                "sharded CUDA ranks (", parallel.describe(),
                ") need CUDA_MODULE_LOADING=EAGER set before CUDA starts (relay sets it): with lazy "
                "loading, a kernel loaded on first launch can wait forever behind a peer's kernel "
                "that waits for this rank");
    RELAY_CHECK(o.devices.empty() || static_cast<int>(o.devices.size()) == world, "--gpus lists ",
                o.devices.size(), " devices for ", world, " ranks (", parallel.describe(), ")");
    int visible = 0;
    RELAY_CUDA_CHECK(cudaGetDeviceCount(&visible));
    std::vector<int> devices;
    for (int r = 0; r < world; ++r) {
      const int d = o.devices.empty() ? o.device + r : o.devices[r];
      RELAY_CHECK(d >= 0 && d < visible, "rank ", r, " (", parallel.describe(), ") is on CUDA device ",
                  d, ", but ", visible, " device(s) are visible; pass --gpus with one device per rank "
                  "(a device may repeat)");
      devices.push_back(d);
    }
    // Before any launch (see the NOTE at disable_pdl: sharded ranks run without programmatic
    // dependent launch).
    if (world > 1) kernels::cuda::disable_pdl();
    const ModelConfig cfg = ModelConfig::load(model_dir);
    const bool dispatch = parallel.dp > 1 && parallel.ep > 1 && cfg.num_experts > 0;
    for (int r = 0; r < world; ++r) {
      auto e = std::make_unique<RankEngine>();
      e->opt = o;
      e->opt.device = devices[r];
      e->rank = r;
      e->dp_rank = parallel::place_rank(parallel, r).dp_rank;
      e->shard = plan_shard(cfg, parallel, r);
      e->tp_reduce = e->shard.tp_size > 1;
      e->moe_reduce = !dispatch && (e->shard.ep_size > 1 || e->shard.tp_size > 1);
      e->dispatch = dispatch;
      e->moe_tokens = dispatch ? world * o.max_num_tokens : o.max_num_tokens;
      e->moe_sources = dispatch ? world : 1;
      e->moe_step_tokens = e->moe_bound_tokens = e->moe_tokens;
      e->bind();
      RELAY_CUDA_CHECK(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking));
      RELAY_CUDA_CHECK(cudaEventCreate(&e->step_begin));
      RELAY_CUDA_CHECK(cudaEventCreate(&e->step_end));
      kernels::prepare_blas_stream(e->stream);
      e->load(model_dir);
      e->allocate_activations();
      if (cfg.has_linear_attention()) e->allocate_states(o.num_state_slots, o.num_state_snapshots);
      ranks.push_back(std::move(e));
    }
    if (world > 1) {
      parallel::cuda::ThreadPeerGroupOptions g;
      const RankEngine& r0 = *ranks.front();
      g.all_reduce_capacity_bytes = static_cast<size_t>(o.max_num_tokens) * r0.hidden * sizeof(bf16);
      if (dispatch) {
        g.max_tokens_per_rank = o.max_num_tokens;
        g.hidden = r0.hidden;
        g.top_k = r0.top_k;
      }
      group = std::make_unique<parallel::cuda::ThreadPeerGroup>(devices, g);
      for (int r = 0; r < world; ++r) {
        ranks[r]->group = group.get();
        ranks[r]->comm = &group->communicator(r);
      }
    }
    // Every rank gets the same number of blocks (block ids are shared across TP ranks, and DP
    // partitions are equal): the fewest that every device's share of its free memory holds.
    blocks_per_rank = o.num_kv_blocks;
    if (blocks_per_rank <= 0) {
      blocks_per_rank = INT32_MAX;
      for (auto& e : ranks) {
        const int sharing = static_cast<int>(std::count(devices.begin(), devices.end(), e->opt.device));
        e->bind();
        blocks_per_rank = std::min(blocks_per_rank, e->blocks_that_fit(sharing));
      }
    }
    for (auto& e : ranks) {
      e->bind();
      e->allocate_kv(blocks_per_rank);
      if (world > 1) e->warm_up_alone();
    }
    RELAY_CUDA_CHECK(cudaSetDevice(devices.front()));
  }

  size_t size() const { return ranks.size(); }
  parallel::RankPlace place(size_t r) const {
    return parallel::place_rank(parallel, static_cast<int>(r));
  }

  // Splits the batch among the DP groups, checks every rank's part before anything runs and sets
  // each rank's moe_step_tokens.
  std::vector<RankPart> split(std::span<const StepSequence> batch) {
    RELAY_CHECK(!batch.empty(), "step with an empty batch");
    std::vector<std::vector<size_t>> members =
        split_by_kv_partition(batch, parallel.dp, blocks_per_rank);
    std::vector<RankPart> parts(parallel.dp);
    for (int g = 0; g < parallel.dp; ++g) {
      RankPart& p = parts[g];
      p.members = std::move(members[g]);
      p.tables.resize(p.members.size());
      for (size_t j = 0; j < p.members.size(); ++j) {
        StepSequence s = batch[p.members[j]];
        localize_block_table(s, g * blocks_per_rank, blocks_per_rank, p.tables[j]);
        s.block_table = p.tables[j];
        p.seqs.push_back(s);
      }
    }
    // Once per DP group: its TP ranks share the block ids, the limits and the vocabulary.
    for (int g = 0; g < parallel.dp; ++g) ranks[g * parallel.tp]->check_batch(parts[g].seqs);
    // What every rank may receive in this step under DP + EP (moe_step_tokens): all the DP
    // groups' tokens.
    int total = 0;
    for (int g = 0; g < parallel.dp; ++g) total += ranks[g * parallel.tp]->step_tokens(parts[g].seqs);
    for (auto& e : ranks) e->moe_step_tokens = std::min(total, e->moe_tokens);
    return parts;
  }

  // Runs fn(rank, its part) on every rank's thread, each bound to its device. A rank that throws
  // abandons the step on every rank (thread_peer_group.h): the peers' collective kernels return
  // at once instead of waiting for it, each rank fails with the reason once its stream is idle,
  // and the group's windows are reset, so the next step runs as if this one never started.
  void on_ranks(const std::vector<RankPart>& parts,
                const std::function<void(RankEngine&, const RankPart&, bool tp_lead)>& fn) {
    try {
      run_on_rank_threads(
          size(),
          [&](size_t r) {
            RankEngine& e = *ranks[r];
            e.bind();
            try {
              fn(e, parts[place(r).dp_rank], place(r).tp_rank == 0);
              if (group) {
                RELAY_CUDA_CHECK(cudaStreamSynchronize(e.stream));
                RELAY_CHECK(!group->abandoned(), "CUDA rank ", r,
                            " abandoned the step: ", group->abandon_reason());
              }
            } catch (const std::exception& ex) {
              // Said at once: the rethrown error only surfaces after every rank has joined.
              std::fprintf(stderr, "relay: CUDA rank %zu failed: %s\n", r, ex.what());
              throw;
            }
          },
          [&](size_t r) {
            if (group) group->abandon(static_cast<int>(r));
          });
    } catch (...) {
      if (group && group->abandoned()) recover_group();
      throw;
    }
  }

  // After an abandoned step: waits for every rank's stream, then resets the group. A rank whose
  // stream reports an error has a broken CUDA context (a fault, not a late peer): nothing can be
  // reset then, and the step's own error stands.
  void recover_group() {
    for (auto& e : ranks) {
      e->bind();
      if (cudaStreamSynchronize(e->stream) != cudaSuccess) return;
    }
    group->reset_after_abort();
  }

  // Runs fn(rank, part, tp_lead) on every rank with sequences (a DP + EP rank without any idles
  // through the MoE exchanges) and returns, per DP group, what its TP-lead rank's fn returned.
  template <typename R>
  std::vector<R> run_groups(const std::vector<RankPart>& parts,
                            const std::function<R(RankEngine&, const RankPart&, bool)>& fn) {
    std::vector<R> out(parallel.dp);
    on_ranks(parts, [&](RankEngine& e, const RankPart& p, bool lead) {
      if (p.seqs.empty()) {
        if (e.dispatch) e.idle_step();
        return;
      }
      R r = fn(e, p, lead);
      if (lead) out[place(e.rank).dp_rank] = std::move(r);
    });
    return out;
  }

  std::vector<SampledToken> step(std::span<const StepSequence> batch) {
    const bool drafting = ranks.front()->mtp.present && ranks.front()->opt.num_mtp_drafts > 0;
    if (size() == 1) {
      RELAY_CHECK(!batch.empty(), "step with an empty batch");
      ranks[0]->check_batch(batch);
      std::vector<SampledToken> out = ranks[0]->step(batch, true);
      if (drafting) ranks[0]->propose_mtp(batch, out, true);
      return out;
    }
    const std::vector<RankPart> parts = split(batch);
    const std::vector<std::vector<SampledToken>> sampled = run_groups<std::vector<SampledToken>>(
        parts, [](RankEngine& e, const RankPart& p, bool lead) { return e.step(p.seqs, lead); });
    // Hybrid models under TP: the ranks that did not sample roll their heads' states back too.
    if (parallel.tp > 1) {
      for (size_t r = 0; r < size(); ++r) {
        if (place(r).tp_rank == 0) continue;
        const int g = place(r).dp_rank;
        ranks[r]->bind();
        ranks[r]->settle_draft_states(parts[g].seqs, sampled[g]);
      }
      RELAY_CUDA_CHECK(cudaSetDevice(ranks.front()->opt.device));
    }
    // The MTP head's drafts: every rank of a DP group runs it on the group's sampled tokens.
    if (drafting) {
      on_ranks(parts, [&](RankEngine& e, const RankPart& p, bool lead) {
        if (p.seqs.empty()) {
          if (e.dispatch) e.mtp_idle();
          return;
        }
        e.propose_mtp(p.seqs, sampled[place(e.rank).dp_rank], lead);
      });
    }
    // Back in batch order: each DP group's tokens follow its members' order, a sampling member's
    // consecutive (its accepted drafts, then the token after them).
    std::vector<std::span<const SampledToken>> by_index(batch.size());
    for (int g = 0; g < parallel.dp; ++g) {
      size_t next = 0;
      for (size_t i : parts[g].members) {
        if (!batch[i].sample) continue;
        size_t end = next;
        const size_t most = next + 1 + static_cast<size_t>(batch[i].num_draft_tokens);
        while (end < std::min(most, sampled[g].size()) && sampled[g][end].seq_id == batch[i].seq_id)
          ++end;
        RELAY_CHECK(end > next, "DP rank ", g, " returned no token for sequence ", batch[i].seq_id);
        by_index[i] = std::span<const SampledToken>(sampled[g]).subspan(next, end - next);
        next = end;
      }
    }
    std::vector<SampledToken> out;
    for (const std::span<const SampledToken>& tokens : by_index)
      out.insert(out.end(), tokens.begin(), tokens.end());
    return out;
  }

  std::vector<float> forward_logits(std::span<const StepSequence> batch, LogitRows rows) {
    if (size() == 1) {
      RELAY_CHECK(!batch.empty(), "forward_logits with an empty batch");
      ranks[0]->check_batch(batch);
      return ranks[0]->forward_logits(batch, rows);
    }
    const std::vector<RankPart> parts = split(batch);
    const std::vector<std::vector<float>> logits = run_groups<std::vector<float>>(
        parts, [&](RankEngine& e, const RankPart& p, bool) { return e.forward_logits(p.seqs, rows); });
    const size_t vocab = static_cast<size_t>(config().vocab_size);
    auto num_rows = [&](size_t i) -> size_t {
      return rows == LogitRows::kLastTokens ? 1 : batch[i].tokens.size();
    };
    std::vector<const float*> first(batch.size(), nullptr);
    for (int g = 0; g < parallel.dp; ++g) {
      size_t row = 0;
      for (size_t i : parts[g].members) {
        first[i] = logits[g].data() + row * vocab;
        row += num_rows(i);
      }
    }
    std::vector<float> out;
    for (size_t i = 0; i < batch.size(); ++i)
      out.insert(out.end(), first[i], first[i] + num_rows(i) * vocab);
    return out;
  }

  std::vector<OpTiming> profile_forward(std::span<const StepSequence> batch) {
    if (size() == 1) {
      RELAY_CHECK(!batch.empty(), "profile_forward with an empty batch");
      ranks[0]->check_batch(batch);
      return ranks[0]->profile_forward(batch);
    }
    const std::vector<RankPart> parts = split(batch);
    std::vector<OpTiming> rank0;
    on_ranks(parts, [&](RankEngine& e, const RankPart& p, bool) {
      if (p.seqs.empty() && !e.dispatch) return;
      std::vector<OpTiming> t = e.profile_forward(p.seqs);
      if (e.rank == 0) rank0 = std::move(t);
    });
    return rank0;
  }

  const ModelConfig& config() const { return ranks.front()->cfg; }
};

CudaBackend::CudaBackend(const std::filesystem::path& model_dir, const CudaBackendOptions& options) {
  RELAY_CHECK(options.max_draft_tokens >= 0 && options.max_draft_tokens <= 16,
              "CUDA backend options: max_draft_tokens ", options.max_draft_tokens,
              " (0 to 16 drafts per sequence)");
  RELAY_CHECK(options.num_mtp_drafts >= 0 && options.num_mtp_drafts <= options.max_draft_tokens &&
                  (options.num_mtp_drafts == 0 || options.mtp.enabled),
              "CUDA backend options: num_mtp_drafts ", options.num_mtp_drafts,
              " needs the MTP head and at most max_draft_tokens (", options.max_draft_tokens, ")");
  RELAY_CHECK(options.block_size > 0 && options.max_num_seqs > 0 &&
                  options.max_num_tokens >= options.max_num_seqs,
              "CUDA backend options: block_size ", options.block_size, ", max_num_seqs ",
              options.max_num_seqs, ", max_num_tokens ", options.max_num_tokens);
  impl_ = std::make_unique<Impl>(model_dir, options);
}

CudaBackend::~CudaBackend() = default;
const ModelConfig& CudaBackend::config() const { return impl_->config(); }
int CudaBackend::block_size() const { return impl_->ranks.front()->opt.block_size; }
int CudaBackend::num_kv_blocks() const { return impl_->blocks_per_rank * impl_->parallel.dp; }
int CudaBackend::num_kv_partitions() const { return impl_->parallel.dp; }

std::vector<KvPoolExport> CudaBackend::kv_pool_exports() {
  std::vector<KvPoolExport> out;
  for (size_t r = 0; r < impl_->size(); ++r) {
    const RankEngine& e = *impl_->ranks[r];
    out.push_back({reinterpret_cast<std::byte*>(e.kv_pool), e.kv_layout, e.shard.kv_head_begin,
                   e.kv_layout.num_kv_heads, impl_->place(r).dp_rank, e.opt.device});
  }
  return out;
}
int CudaBackend::num_state_slots() const {
  return impl_->ranks.front()->state_slots * impl_->parallel.dp;
}
int CudaBackend::num_state_snapshots() const {
  return impl_->ranks.front()->state_snapshots * impl_->parallel.dp;
}
size_t CudaBackend::state_slot_bytes() const {
  const RankEngine& e = *impl_->ranks.front();
  return e.state_pool == nullptr ? 0 : e.state_layout.bytes_per_slot();
}

std::vector<StatePoolExport> CudaBackend::state_pool_exports() {
  std::vector<StatePoolExport> out;
  for (size_t r = 0; r < impl_->size(); ++r) {
    const RankEngine& e = *impl_->ranks[r];
    if (e.state_pool == nullptr) continue;
    out.push_back({reinterpret_cast<std::byte*>(e.state_pool), e.state_layout,
                   e.shard.k_head_begin, e.shard.num_local_k_heads, e.shard.v_head_begin,
                   e.shard.num_local_v_heads, impl_->place(r).dp_rank, e.opt.device});
  }
  return out;
}

std::vector<SampledToken> CudaBackend::step(std::span<const StepSequence> batch) {
  return impl_->step(batch);
}
bool CudaBackend::supports_draft_tokens() const {
  return impl_->ranks.front()->opt.max_draft_tokens > 0;
}
int CudaBackend::num_proposed_drafts() const { return impl_->ranks.front()->opt.num_mtp_drafts; }
std::vector<float> CudaBackend::forward_logits(std::span<const StepSequence> batch,
                                               LogitRows rows) {
  return impl_->forward_logits(batch, rows);
}
std::vector<OpTiming> CudaBackend::profile_forward(std::span<const StepSequence> batch) {
  return impl_->profile_forward(batch);
}
const CudaLoadStats& CudaBackend::load_stats() const { return impl_->ranks.front()->stats; }
double CudaBackend::last_step_device_ms() const {
  return impl_->ranks.front()->last_step_device_ms;
}
void CudaBackend::synchronize() {
  for (auto& e : impl_->ranks) {
    e->bind();
    RELAY_CUDA_CHECK(cudaStreamSynchronize(e->stream));
  }
}

}  // namespace relay

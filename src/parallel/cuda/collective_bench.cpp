// See collective_bench.h. Inputs are random (their values do not change the timing); each case runs
// `warmup` calls, then `iterations` back-to-back calls between two CUDA events on the rank's
// stream, and reports elapsed / iterations.
#include "parallel/cuda/collective_bench.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>

#include "parallel/cuda/all_reduce.h"
#include "parallel/cuda/cuda_check.h"
#include "parallel/cuda/custom_all_reduce.h"
#include "parallel/cuda/emulated_peers.h"
#include "parallel/cuda/moe_all_to_all.h"
#include "parallel/cuda/nccl_communicator.h"

namespace relay::parallel::cuda {
namespace {

using nlohmann::json;

class Stream {
 public:
  Stream() { RELAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s_); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

template <typename Fn>
double time_us(cudaStream_t stream, int warmup, int iterations, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  RELAY_CUDA_CHECK(cudaEventCreate(&start));
  RELAY_CUDA_CHECK(cudaEventCreate(&stop));
  RELAY_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < iterations; ++i) fn();
  RELAY_CUDA_CHECK(cudaEventRecord(stop, stream));
  RELAY_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  RELAY_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 1000.0 * ms / iterations;
}

template <typename T>
T* device_alloc(size_t count) {
  T* p = nullptr;
  RELAY_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return p;
}

// Random bf16 payloads for `count` elements.
void fill_random_bf16(__nv_bfloat16* device, size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<__nv_bfloat16> host(count);
  for (auto& v : host) v = __float2bfloat16(dist(rng));
  RELAY_CUDA_CHECK(
      cudaMemcpy(device, host.data(), count * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
}

// One rank's MoE inputs on its device: distinct random experts per token.
struct MoeInputs {
  __nv_bfloat16* hidden = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  __nv_bfloat16* expert_out = nullptr;
  __nv_bfloat16* out = nullptr;

  MoeInputs(const CollectiveBenchOptions& opt, const MoeWindowLayout& L, int tokens,
            uint32_t seed) {
    hidden = device_alloc<__nv_bfloat16>(static_cast<size_t>(tokens) * opt.hidden);
    fill_random_bf16(hidden, static_cast<size_t>(tokens) * opt.hidden, seed);
    std::mt19937 rng(seed + 1);
    std::vector<int32_t> h_ids;
    std::vector<float> h_w;
    std::vector<int32_t> experts(opt.num_experts);
    for (int t = 0; t < tokens; ++t) {
      std::iota(experts.begin(), experts.end(), 0);
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int j = 0; j < opt.top_k; ++j) {
        h_ids.push_back(experts[j]);
        h_w.push_back(1.0f / opt.top_k);
      }
    }
    ids = device_alloc<int32_t>(h_ids.size());
    weights = device_alloc<float>(h_w.size());
    RELAY_CUDA_CHECK(cudaMemcpy(ids, h_ids.data(), h_ids.size() * 4, cudaMemcpyHostToDevice));
    RELAY_CUDA_CHECK(cudaMemcpy(weights, h_w.data(), h_w.size() * 4, cudaMemcpyHostToDevice));
    const size_t rows = static_cast<size_t>(L.num_ranks) * L.max_tokens;
    expert_out = device_alloc<__nv_bfloat16>(rows * opt.hidden);
    fill_random_bf16(expert_out, rows * opt.hidden, seed + 2);
    out = device_alloc<__nv_bfloat16>(static_cast<size_t>(tokens) * opt.hidden);
  }
  ~MoeInputs() {
    for (void* p :
         {static_cast<void*>(hidden), static_cast<void*>(ids), static_cast<void*>(weights),
          static_cast<void*>(expert_out), static_cast<void*>(out)})
      cudaFree(p);
  }
  MoeInputs(const MoeInputs&) = delete;
  MoeInputs& operator=(const MoeInputs&) = delete;
};

// Fills the dispatch / combine views of one rank.
void set_moe_views(MoeDispatchRankView& d, MoeCombineRankView& c, const MoeInputs& in, int rank,
                   int tokens, const std::vector<char*>& windows) {
  d.hidden = in.hidden;
  d.topk_ids = in.ids;
  d.topk_weights = in.weights;
  d.num_tokens = tokens;
  d.rank = rank;
  c.expert_out = in.expert_out;
  c.out = in.out;
  c.num_tokens = tokens;
  c.rank = rank;
  for (size_t q = 0; q < windows.size(); ++q) d.windows[q] = c.windows[q] = windows[q];
}

json all_reduce_record(const char* algorithm, int ranks, bool emulated, size_t bytes, double us) {
  const double bus = 2.0 * (ranks - 1) / ranks * static_cast<double>(bytes) / (us * 1e3);
  return {{"kind", "all_reduce"}, {"algorithm", algorithm},   {"ranks", ranks},
          {"emulated", emulated}, {"dtype", "bf16"},          {"bytes", bytes},
          {"latency_us", us},     {"bus_bandwidth_gbps", bus}};
}

json moe_record(const CollectiveBenchOptions& opt, int ranks, bool emulated, int tokens,
                double dispatch_us, double both_us) {
  return {{"kind", "moe_dispatch_combine"}, {"ranks", ranks},
          {"emulated", emulated},           {"tokens_per_rank", tokens},
          {"hidden", opt.hidden},           {"top_k", opt.top_k},
          {"num_experts", opt.num_experts}, {"dispatch_us", dispatch_us},
          {"dispatch_combine_us", both_us}};
}

int emulated_blocks(int ranks) {
  int device = 0, sms = 0;
  RELAY_CUDA_CHECK(cudaGetDevice(&device));
  RELAY_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::clamp(sms / ranks, 1, 32);
}

void run_emulated(const CollectiveBenchOptions& opt, const std::function<void(const json&)>& emit) {
  RELAY_CUDA_CHECK(cudaSetDevice(0));
  emit({{"kind", "note"},
        {"message", "one GPU: peers emulated on GPU 0 (kernel cost, not NVLink); NCCL skipped"}});
  Stream stream;
  const size_t max_bytes = *std::max_element(opt.sizes_bytes.begin(), opt.sizes_bytes.end());
  for (int ranks : opt.emulated_ranks) {
    RELAY_CHECK(ranks >= 2 && ranks <= kMaxRanks, "collective bench: emulated group of ", ranks,
                " ranks, supported 2..", kMaxRanks);
    const int blocks = emulated_blocks(ranks);
    {
      EmulatedPeerWindows windows(ranks, all_reduce_window_bytes(max_bytes));
      std::vector<__nv_bfloat16*> data(ranks);
      for (int r = 0; r < ranks; ++r) {
        data[r] = device_alloc<__nv_bfloat16>(max_bytes / 2);
        fill_random_bf16(data[r], max_bytes / 2, 100 + r);
      }
      for (size_t bytes : opt.sizes_bytes) {
        PeerAllReduceParams p;
        p.num_local_ranks = p.num_ranks = ranks;
        p.count = bytes / 2;
        p.dtype = DType::BF16;
        p.capacity_bytes = max_bytes;
        p.max_blocks = blocks;
        for (int r = 0; r < ranks; ++r) {
          p.ranks[r].data = data[r];
          p.ranks[r].rank = r;
          for (int q = 0; q < ranks; ++q) p.ranks[r].windows[q] = windows.windows()[q];
        }
        const double one = time_us(stream.get(), opt.warmup, opt.iterations,
                                   [&] { launch_one_shot_all_reduce(p, stream.get()); });
        emit(all_reduce_record("one-shot", ranks, true, bytes, one));
        const double two = time_us(stream.get(), opt.warmup, opt.iterations,
                                   [&] { launch_two_shot_all_reduce(p, stream.get()); });
        emit(all_reduce_record("two-shot", ranks, true, bytes, two));
      }
      for (auto* d : data) cudaFree(d);
    }
    if (opt.num_experts % ranks != 0) {
      emit({{"kind", "note"},
            {"message",
             str(opt.num_experts, " experts do not divide over ", ranks, " ranks: MoE skipped")}});
      continue;
    }
    for (int tokens : opt.tokens_per_rank) {
      const MoeWindowLayout L = MoeWindowLayout::make(ranks, tokens, opt.hidden, opt.top_k);
      EmulatedPeerWindows windows(ranks, L.total_bytes);
      std::vector<std::unique_ptr<MoeInputs>> inputs;
      MoeDispatchParams dp;
      MoeCombineParams cp;
      dp.num_local_ranks = cp.num_local_ranks = ranks;
      dp.layout = cp.layout = L;
      dp.num_experts = opt.num_experts;
      dp.max_blocks = cp.max_blocks = blocks;
      for (int r = 0; r < ranks; ++r) {
        inputs.push_back(std::make_unique<MoeInputs>(opt, L, tokens, 200 + r));
        set_moe_views(dp.ranks[r], cp.ranks[r], *inputs[r], r, tokens, windows.windows());
      }
      const double dispatch = time_us(stream.get(), opt.warmup, opt.iterations,
                                      [&] { launch_moe_dispatch(dp, stream.get()); });
      const double both = time_us(stream.get(), opt.warmup, opt.iterations, [&] {
        launch_moe_dispatch(dp, stream.get());
        launch_moe_combine(cp, stream.get());
      });
      emit(moe_record(opt, ranks, true, tokens, dispatch, both));
    }
  }
}

// What one rank measured, in the order every rank runs the cases.
struct RankResults {
  std::vector<double> all_reduce_us;  // [size][algorithm], -1 when not run
  std::vector<double> moe_dispatch_us, moe_both_us;
  std::string error;
  std::string fallback_reason;
};

constexpr AllReduceAlgorithm kAlgorithms[] = {
    AllReduceAlgorithm::kOneShot, AllReduceAlgorithm::kTwoShot, AllReduceAlgorithm::kNccl};

void run_rank(const CollectiveBenchOptions& opt, const ncclUniqueId& id, int rank,
              RankResults& res) {
  const int n = opt.num_ranks;
  NcclCommunicator nccl(id, rank, n, rank);
  const size_t max_bytes = *std::max_element(opt.sizes_bytes.begin(), opt.sizes_bytes.end());
  CustomAllReduceOptions co;
  co.capacity_bytes = max_bytes;
  CustomAllReduce custom(nccl, co);
  res.fallback_reason = custom.fallback_reason();
  Stream stream;
  __nv_bfloat16* data = device_alloc<__nv_bfloat16>(max_bytes / 2);
  fill_random_bf16(data, max_bytes / 2, 100 + rank);
  for (size_t bytes : opt.sizes_bytes) {
    for (AllReduceAlgorithm a : kAlgorithms) {
      // Every rank knows the same fallback_reason, so every rank skips alike.
      if (a != AllReduceAlgorithm::kNccl && !custom.fallback_reason().empty()) {
        res.all_reduce_us.push_back(-1);
        continue;
      }
      custom.barrier(stream.get());
      res.all_reduce_us.push_back(time_us(stream.get(), opt.warmup, opt.iterations, [&] {
        custom.all_reduce_sum(data, bytes / 2, DType::BF16, a, stream.get());
      }));
    }
  }
  cudaFree(data);
  if (!custom.fallback_reason().empty() || opt.num_experts % n != 0) return;
  for (int tokens : opt.tokens_per_rank) {
    const MoeWindowLayout L = MoeWindowLayout::make(n, tokens, opt.hidden, opt.top_k);
    SymmetricWindow window(nccl, L.total_bytes);
    MoeInputs in(opt, L, tokens, 200 + rank);
    MoeDispatchParams dp;
    MoeCombineParams cp;
    dp.layout = cp.layout = L;
    dp.num_experts = opt.num_experts;
    set_moe_views(dp.ranks[0], cp.ranks[0], in, rank, tokens, window.peers());
    nccl.barrier(stream.get());
    res.moe_dispatch_us.push_back(time_us(stream.get(), opt.warmup, opt.iterations,
                                          [&] { launch_moe_dispatch(dp, stream.get()); }));
    nccl.barrier(stream.get());
    res.moe_both_us.push_back(time_us(stream.get(), opt.warmup, opt.iterations, [&] {
      launch_moe_dispatch(dp, stream.get());
      launch_moe_combine(cp, stream.get());
    }));
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  }
}

void run_multi_gpu(const CollectiveBenchOptions& opt,
                   const std::function<void(const json&)>& emit) {
  const int n = opt.num_ranks;
  int devices = 0;
  RELAY_CUDA_CHECK(cudaGetDeviceCount(&devices));
  RELAY_CHECK(n <= devices, "collective bench: --ranks ", n, " but this machine has ", devices,
              " GPUs");
  ncclUniqueId id{};
  RELAY_CHECK(ncclGetUniqueId(&id) == ncclSuccess, "collective bench: ncclGetUniqueId failed");
  std::vector<RankResults> results(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        run_rank(opt, id, r, results[r]);
      } catch (const Error& e) {
        results[r].error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r)
    RELAY_CHECK(results[r].error.empty(), "collective bench: rank ", r, ": ", results[r].error);
  if (!results[0].fallback_reason.empty())
    emit({{"kind", "note"}, {"message", "custom kernels skipped: " + results[0].fallback_reason}});
  const auto slowest = [&](auto member, size_t i) {
    double worst = -1;
    for (const RankResults& res : results) worst = std::max(worst, (res.*member)[i]);
    return worst;
  };
  size_t i = 0;
  for (size_t bytes : opt.sizes_bytes) {
    for (AllReduceAlgorithm a : kAlgorithms) {
      const double us = slowest(&RankResults::all_reduce_us, i++);
      if (us >= 0) emit(all_reduce_record(all_reduce_algorithm_name(a), n, false, bytes, us));
    }
  }
  for (size_t t = 0; t < results[0].moe_dispatch_us.size(); ++t)
    emit(moe_record(opt, n, false, opt.tokens_per_rank[t],
                    slowest(&RankResults::moe_dispatch_us, t),
                    slowest(&RankResults::moe_both_us, t)));
}

}  // namespace

void run_collective_bench(const CollectiveBenchOptions& opt,
                          const std::function<void(const json&)>& emit) {
  RELAY_CHECK(opt.num_ranks >= 1 && opt.num_ranks <= kMaxRanks, "collective bench: --ranks ",
              opt.num_ranks, " not in 1..", kMaxRanks);
  RELAY_CHECK(!opt.sizes_bytes.empty() && opt.iterations >= 1 && opt.warmup >= 0,
              "collective bench: need sizes and at least one iteration");
  for (size_t b : opt.sizes_bytes)
    RELAY_CHECK(b >= 2 && b % 2 == 0, "collective bench: size ", b,
                " is not a whole number of bf16");
  if (opt.num_ranks == 1)
    run_emulated(opt, emit);
  else
    run_multi_gpu(opt, emit);
}

}  // namespace relay::parallel::cuda

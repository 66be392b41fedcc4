// Relay's GPU collectives (src/parallel/cuda) on one GPU: the one-shot / two-shot all-reduce and
// the MoE dispatch/combine with 2, 4 and 8 ranks emulated in one launch (emulated_peers.h), checked
// bit for bit against the CPU references (collectives_reference.h); CUDA graph capture and replay;
// a ThreadPeerGroup abandoning a step whose rank never arrives, or whose peer wait timed out, and
// meeting again after its reset; and NCCL (a one-rank communicator, its symmetric window and
// CustomAllReduce on it). What needs
// two GPUs — NVLink peers, NCCL across ranks — is left to `relay bench --mode collectives --ranks
// N`.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "parallel/cuda/all_reduce.h"
#include "parallel/cuda/all_reduce_select.h"
#include "parallel/cuda/collectives_reference.h"
#include "parallel/cuda/custom_all_reduce.h"
#include "parallel/cuda/emulated_peers.h"
#include "parallel/cuda/moe_all_to_all.h"
#include "parallel/cuda/nccl_communicator.h"
#include "parallel/cuda/thread_peer_group.h"
#include "parallel/tcp_bootstrap.h"
#include "tests/gpu/gpu_test_util.h"

namespace relay::gpu_test {
namespace {

using namespace relay::parallel::cuda;
using bf16 = __nv_bfloat16;

int sm_count() {
  int device = 0, sms = 0;
  GPU_TEST_CUDA(cudaGetDevice(&device));
  GPU_TEST_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// Blocks per emulated rank: all ranks' blocks must be resident together.
int emulated_blocks(int ranks) { return std::clamp(sm_count() / ranks, 1, 16); }

uint16_t bits_of(bf16 v) { return static_cast<__nv_bfloat16_raw>(v).x; }
bf16 bf16_of(uint16_t bits) {
  __nv_bfloat16_raw raw;
  raw.x = bits;
  return raw;
}

// ---------------------------------------------------------------------------------------------
// All-reduce

enum class Algo { kOneShot, kTwoShot };

void launch(Algo a, const PeerAllReduceParams& p, cudaStream_t s) {
  if (a == Algo::kOneShot)
    launch_one_shot_all_reduce(p, s);
  else
    launch_two_shot_all_reduce(p, s);
}

const char* name(Algo a) { return a == Algo::kOneShot ? "one-shot" : "two-shot"; }

// N emulated ranks with data buffers of `count` elements (+1, so a view may start one element in).
struct AllReduceGroup {
  AllReduceGroup(int ranks, size_t capacity_bytes, size_t count, size_t elem_bytes)
      : windows(ranks, all_reduce_window_bytes(capacity_bytes)) {
    for (int r = 0; r < ranks; ++r) data.emplace_back((count + 1) * elem_bytes);
    p.num_local_ranks = p.num_ranks = ranks;
    p.capacity_bytes = capacity_bytes;
    p.max_blocks = emulated_blocks(ranks);
    for (int r = 0; r < ranks; ++r) {
      p.ranks[r].rank = r;
      for (int q = 0; q < ranks; ++q) p.ranks[r].windows[q] = windows.windows()[q];
    }
  }
  // Views of `count` elements starting `offset` elements into each rank's buffer.
  PeerAllReduceParams params(size_t count, DType dtype, size_t offset) {
    PeerAllReduceParams q = p;
    q.count = count;
    q.dtype = dtype;
    for (int r = 0; r < p.num_ranks; ++r)
      q.ranks[r].data = data[r].get() + offset * dtype_size(dtype);
    return q;
  }

  EmulatedPeerWindows windows;
  std::vector<DeviceBuffer<uint8_t>> data;
  PeerAllReduceParams p;
};

// Uploads random inputs for every rank, runs `algo`, and compares every rank with the reference.
void check_all_reduce_f32(AllReduceGroup& g, Algo algo, size_t count, size_t offset,
                          std::mt19937& rng, cudaStream_t stream) {
  const int ranks = g.p.num_ranks;
  std::normal_distribution<float> dist;
  std::vector<std::vector<float>> in(ranks, std::vector<float>(count));
  for (int r = 0; r < ranks; ++r) {
    for (float& v : in[r]) v = dist(rng);
    GPU_TEST_CUDA(
        cudaMemcpy(g.data[r].get() + offset * 4, in[r].data(), count * 4, cudaMemcpyHostToDevice));
  }
  launch(algo, g.params(count, DType::F32, offset), stream);
  GPU_TEST_CUDA(cudaStreamSynchronize(stream));
  const std::vector<float> want = reference_all_reduce(in);
  for (int r = 0; r < ranks; ++r) {
    std::vector<float> got(count);
    GPU_TEST_CUDA(
        cudaMemcpy(got.data(), g.data[r].get() + offset * 4, count * 4, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += !(got[i] == want[i]);
    ASSERT_EQ(bad, 0u) << name(algo) << " f32 ranks " << ranks << " count " << count << " offset "
                       << offset << " rank " << r << " first " << got[0] << " vs " << want[0];
  }
}

void check_all_reduce_bf16(AllReduceGroup& g, Algo algo, size_t count, size_t offset,
                           std::mt19937& rng, cudaStream_t stream) {
  const int ranks = g.p.num_ranks;
  std::normal_distribution<float> dist;
  std::vector<std::vector<uint16_t>> in(ranks, std::vector<uint16_t>(count));
  for (int r = 0; r < ranks; ++r) {
    for (uint16_t& v : in[r]) v = f32_to_bf16(dist(rng));
    GPU_TEST_CUDA(
        cudaMemcpy(g.data[r].get() + offset * 2, in[r].data(), count * 2, cudaMemcpyHostToDevice));
  }
  launch(algo, g.params(count, DType::BF16, offset), stream);
  GPU_TEST_CUDA(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> want = reference_all_reduce_bf16(in);
  for (int r = 0; r < ranks; ++r) {
    std::vector<uint16_t> got(count);
    GPU_TEST_CUDA(
        cudaMemcpy(got.data(), g.data[r].get() + offset * 2, count * 2, cudaMemcpyDeviceToHost));
    ASSERT_EQ(std::memcmp(got.data(), want.data(), count * 2), 0)
        << name(algo) << " bf16 ranks " << ranks << " count " << count << " offset " << offset
        << " rank " << r;
  }
}

TEST(GpuCollectives, AllReduceMatchesRankOrderReferenceBitForBit) {
  std::mt19937 rng(11);
  cudaStream_t stream;
  GPU_TEST_CUDA(cudaStreamCreate(&stream));
  for (int ranks : {2, 4, 8}) {
    // Odd sizes, one unit, partial units, sizes around slice boundaries, a few MB.
    const std::vector<size_t> counts = {1, 3, 4, 7, 8, 9, 127, 1000, 4097, 65537, (1u << 20) + 5};
    const size_t max_count = counts.back();
    AllReduceGroup g(ranks, max_count * 4, max_count, 4);
    for (Algo algo : {Algo::kOneShot, Algo::kTwoShot}) {
      for (size_t count : counts) {
        check_all_reduce_f32(g, algo, count, 0, rng, stream);
        check_all_reduce_bf16(g, algo, count, 0, rng, stream);
      }
      // A buffer that is not 16-byte aligned goes element by element.
      check_all_reduce_f32(g, algo, 1001, 1, rng, stream);
      check_all_reduce_bf16(g, algo, 1001, 1, rng, stream);
    }
  }
  GPU_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(GpuCollectives, AllReduceAt64MiB) {
  std::mt19937 rng(12);
  cudaStream_t stream;
  GPU_TEST_CUDA(cudaStreamCreate(&stream));
  const size_t bytes = size_t{64} << 20;
  for (int ranks : {2, 8}) {
    AllReduceGroup g(ranks, bytes, bytes / 2, 2);
    for (Algo algo : {Algo::kOneShot, Algo::kTwoShot}) {
      check_all_reduce_f32(g, algo, bytes / 4, 0, rng, stream);
      check_all_reduce_bf16(g, algo, bytes / 2, 0, rng, stream);
    }
  }
  GPU_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(GpuCollectives, AllReduceBarriersSurviveManyCallsOfMixedShapes) {
  // The per-block epochs advance differently for different grids; every rank must stay in step.
  std::mt19937 rng(13);
  cudaStream_t stream;
  GPU_TEST_CUDA(cudaStreamCreate(&stream));
  const int ranks = 4;
  AllReduceGroup g(ranks, 1 << 20, 1 << 18, 4);
  for (int round = 0; round < 40; ++round) {
    const size_t count = 1 + rng() % (1 << 18);
    const Algo algo = round % 3 == 0 ? Algo::kTwoShot : Algo::kOneShot;
    check_all_reduce_f32(g, algo, count, 0, rng, stream);
    launch_peer_barrier(g.params(0, DType::F32, 0), stream);
  }
  GPU_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(GpuCollectives, AllReduceReplaysFromACudaGraph) {
  std::mt19937 rng(14);
  cudaStream_t stream;
  GPU_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int ranks = 4;
  const size_t count = 50'000;
  AllReduceGroup g(ranks, count * 4, count, 4);
  for (Algo algo : {Algo::kOneShot, Algo::kTwoShot}) {
    cudaGraph_t graph;
    GPU_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    launch(algo, g.params(count, DType::F32, 0), stream);
    launch(algo, g.params(count, DType::F32, 0), stream);  // two calls: epochs advance in-graph
    GPU_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    GPU_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      std::normal_distribution<float> dist;
      std::vector<std::vector<float>> in(ranks, std::vector<float>(count));
      for (int r = 0; r < ranks; ++r) {
        for (float& v : in[r]) v = dist(rng);
        GPU_TEST_CUDA(cudaMemcpy(g.data[r].get(), in[r].data(), count * 4, cudaMemcpyHostToDevice));
      }
      GPU_TEST_CUDA(cudaGraphLaunch(exec, stream));
      GPU_TEST_CUDA(cudaStreamSynchronize(stream));
      // Twice reduced: every rank held the sum S after the first call, so the second gives N * S.
      std::vector<float> want = reference_all_reduce(in);
      want = reference_all_reduce(std::vector<std::vector<float>>(ranks, want));
      for (int r = 0; r < ranks; ++r) {
        std::vector<float> got(count);
        GPU_TEST_CUDA(cudaMemcpy(got.data(), g.data[r].get(), count * 4, cudaMemcpyDeviceToHost));
        ASSERT_EQ(std::memcmp(got.data(), want.data(), count * 4), 0)
            << name(algo) << " replay " << replay << " rank " << r;
      }
    }
    GPU_TEST_CUDA(cudaGraphExecDestroy(exec));
    GPU_TEST_CUDA(cudaGraphDestroy(graph));
  }
  GPU_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(GpuCollectives, AllReduceRefusesWhatItCannotRun) {
  AllReduceGroup g(2, 1024, 512, 4);
  EXPECT_THROW(launch_one_shot_all_reduce(g.params(257, DType::F32, 0), nullptr), Error);
  EXPECT_THROW(launch_two_shot_all_reduce(g.params(8, DType::I32, 0), nullptr), Error);
  PeerAllReduceParams p = g.params(8, DType::F32, 0);
  p.max_blocks = kMaxAllReduceBlocks + 1;
  EXPECT_THROW(launch_one_shot_all_reduce(p, nullptr), Error);
}

TEST(GpuCollectives, SelectionRule) {
  const size_t cap = size_t{64} << 20;
  EXPECT_EQ(choose_all_reduce_algorithm(4096, 8, true, cap), AllReduceAlgorithm::kOneShot);
  EXPECT_EQ(choose_all_reduce_algorithm(size_t{1} << 20, 8, true, cap),
            AllReduceAlgorithm::kTwoShot);
  EXPECT_EQ(choose_all_reduce_algorithm(size_t{1} << 20, 2, true, cap),
            AllReduceAlgorithm::kOneShot);
  EXPECT_EQ(choose_all_reduce_algorithm(cap + 2, 4, true, cap), AllReduceAlgorithm::kNccl);
  EXPECT_EQ(choose_all_reduce_algorithm(4096, 4, false, cap), AllReduceAlgorithm::kNccl);
}

// ---------------------------------------------------------------------------------------------
// MoE dispatch / combine

enum class Routing { kRandom, kAllOnOneRank, kSpanEveryRank };

// top_k distinct experts per token, routed as asked.
std::vector<int32_t> route(int tokens, int num_experts, int ranks, int top_k, Routing routing,
                           int rank, std::mt19937& rng) {
  const int per_rank = num_experts / ranks;
  std::vector<int32_t> ids;
  std::vector<int32_t> pool;
  for (int t = 0; t < tokens; ++t) {
    pool.clear();
    if (routing == Routing::kRandom) {
      pool.resize(num_experts);
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);
    } else if (routing == Routing::kAllOnOneRank) {
      const int d = (t + rank) % ranks;
      for (int e = 0; e < per_rank; ++e) pool.push_back(d * per_rank + e);
      std::shuffle(pool.begin(), pool.end(), rng);
    } else {
      // Slot j on rank j % ranks (top_k >= ranks), a random expert of that rank, all distinct.
      for (int j = 0; j < top_k; ++j) pool.push_back((j % ranks) * per_rank + j / ranks);
      std::shuffle(pool.begin(), pool.end(), rng);
    }
    ids.insert(ids.end(), pool.begin(), pool.begin() + top_k);
  }
  return ids;
}

struct MoeCase {
  int ranks, tokens, hidden, top_k, num_experts;
  Routing routing;
  bool rank1_idle;  // rank 1 has no tokens this step
};

void run_moe_case(const MoeCase& c, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "ranks " << c.ranks << " tokens " << c.tokens << " routing "
                                    << static_cast<int>(c.routing) << " idle " << c.rank1_idle);
  const int R = c.ranks, H = c.hidden, k = c.top_k;
  const int max_tokens = c.tokens + 3;  // slots beyond every count must be padded
  const MoeWindowLayout L = MoeWindowLayout::make(R, max_tokens, H, k);
  EmulatedPeerWindows windows(R, L.total_bytes);
  const int blocks = emulated_blocks(R);
  cudaStream_t stream;
  GPU_TEST_CUDA(cudaStreamCreate(&stream));

  for (int round = 0; round < 2; ++round) {  // the second round reuses the buffers and flags
    std::vector<MoeRankTokens> tokens(R);
    std::vector<DeviceBuffer<bf16>> d_hidden, d_out, d_expert_out;
    std::vector<DeviceBuffer<int32_t>> d_ids;
    std::vector<DeviceBuffer<float>> d_weights;
    MoeDispatchParams dp;
    dp.num_local_ranks = R;
    dp.layout = L;
    dp.num_experts = c.num_experts;
    dp.max_blocks = blocks;
    std::uniform_real_distribution<float> wdist(0.1f, 1.0f);
    for (int r = 0; r < R; ++r) {
      MoeRankTokens& t = tokens[r];
      t.num_tokens = c.rank1_idle && r == 1 ? 0 : c.tokens;
      auto hidden = random_bf16(static_cast<size_t>(t.num_tokens) * H, rng);
      for (bf16 v : hidden.bits) t.hidden.push_back(bits_of(v));
      t.topk_ids = route(t.num_tokens, c.num_experts, R, k, c.routing, r, rng);
      for (int i = 0; i < t.num_tokens * k; ++i) t.topk_weights.push_back(wdist(rng));
      d_hidden.emplace_back(hidden.bits);
      d_ids.emplace_back(t.topk_ids);
      d_weights.emplace_back(t.topk_weights);
      MoeDispatchRankView& v = dp.ranks[r];
      v.hidden = d_hidden[r].get();
      v.topk_ids = d_ids[r].get();
      v.topk_weights = d_weights[r].get();
      v.num_tokens = t.num_tokens;
      v.rank = r;
      for (int q = 0; q < R; ++q) v.windows[q] = windows.windows()[q];
    }
    launch_moe_dispatch(dp, stream);
    GPU_TEST_CUDA(cudaStreamSynchronize(stream));

    const auto received = reference_moe_dispatch(tokens, c.num_experts, H, k);
    std::vector<std::vector<std::vector<uint16_t>>> partials(R,
                                                             std::vector<std::vector<uint16_t>>(R));
    MoeCombineParams cp;
    cp.num_local_ranks = R;
    cp.layout = L;
    cp.max_blocks = blocks;
    for (int d = 0; d < R; ++d) {
      std::vector<uint8_t> w(L.total_bytes);
      GPU_TEST_CUDA(cudaMemcpy(w.data(), windows.windows()[d], w.size(), cudaMemcpyDeviceToHost));
      const auto* sig = reinterpret_cast<const MoeSignals*>(w.data());
      const auto* rh = reinterpret_cast<const uint16_t*>(w.data() + L.recv_hidden);
      const auto* rw = reinterpret_cast<const float*>(w.data() + L.recv_weights);
      const auto* ri = reinterpret_cast<const int32_t*>(w.data() + L.recv_ids);
      // Expert output: random rows for the received slots, NaN elsewhere (must never be read).
      std::vector<uint16_t> expert_out(static_cast<size_t>(R) * max_tokens * H, 0xFFFF);
      for (int s = 0; s < R; ++s) {
        const MoeReceived& want = received[d][s];
        const int n = static_cast<int>(want.source_tokens.size());
        ASSERT_EQ(sig->recv_count[s], n) << "rank " << d << " from " << s;
        for (int slot = 0; slot < max_tokens; ++slot) {
          const size_t row = L.row(s, slot);
          for (int j = 0; j < k; ++j) {
            if (slot < n) {
              ASSERT_EQ(rw[row * k + j], want.weights[slot * k + j]) << d << "<-" << s;
              ASSERT_EQ(ri[row * k + j], want.local_ids[slot * k + j]) << d << "<-" << s;
            } else {
              ASSERT_EQ(rw[row * k + j], 0.0f) << "padding " << d << "<-" << s << " slot " << slot;
              ASSERT_EQ(ri[row * k + j], c.num_experts / R) << "padding " << d << "<-" << s;
            }
          }
          if (slot < n) {
            ASSERT_EQ(std::memcmp(rh + row * H, want.hidden.data() + static_cast<size_t>(slot) * H,
                                  H * 2),
                      0)
                << "hidden " << d << "<-" << s << " slot " << slot;
          }
        }
        auto part = random_bf16(static_cast<size_t>(n) * H, rng);
        for (bf16 v : part.bits) partials[d][s].push_back(bits_of(v));
        std::copy(partials[d][s].begin(), partials[d][s].end(),
                  expert_out.begin() + L.row(s, 0) * H);
      }
      std::vector<bf16> eo(expert_out.size());
      for (size_t i = 0; i < eo.size(); ++i) eo[i] = bf16_of(expert_out[i]);
      d_expert_out.emplace_back(eo);
      d_out.emplace_back(std::max<size_t>(static_cast<size_t>(tokens[d].num_tokens) * H, 8));
      MoeCombineRankView& v = cp.ranks[d];
      v.expert_out = d_expert_out[d].get();
      v.out = d_out[d].get();
      v.num_tokens = tokens[d].num_tokens;
      v.rank = d;
      for (int q = 0; q < R; ++q) v.windows[q] = windows.windows()[q];
    }
    launch_moe_combine(cp, stream);
    GPU_TEST_CUDA(cudaStreamSynchronize(stream));

    std::vector<int> num_tokens(R);
    for (int r = 0; r < R; ++r) num_tokens[r] = tokens[r].num_tokens;
    const auto want = reference_moe_combine(received, partials, num_tokens, H);
    for (int s = 0; s < R; ++s) {
      const std::vector<bf16> got = d_out[s].download();
      for (size_t i = 0; i < want[s].size(); ++i)
        ASSERT_EQ(bits_of(got[i]), want[s][i]) << "combine rank " << s << " element " << i;
    }
  }
  GPU_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(GpuCollectives, MoeDispatchCombineMatchesCpuReference) {
  std::mt19937 rng(21);
  for (int ranks : {2, 4, 8}) {
    for (int tokens : {1, 128}) {
      for (Routing routing : {Routing::kRandom, Routing::kAllOnOneRank, Routing::kSpanEveryRank}) {
        run_moe_case({ranks, tokens, 256, 8, 64, routing, false}, rng);
      }
      run_moe_case({ranks, tokens, 256, 8, 64, Routing::kRandom, true}, rng);
    }
  }
  // Qwen3-235B's shape: hidden 4096, 128 experts, top-8.
  run_moe_case({8, 128, 4096, 8, 128, Routing::kRandom, false}, rng);
}

TEST(GpuCollectives, MoeRefusesShapesItCannotRun) {
  EXPECT_THROW(MoeWindowLayout::make(2, 16, 100, 8), Error);  // hidden not a multiple of 8
  EXPECT_THROW(MoeWindowLayout::make(9, 16, 128, 8), Error);
  const MoeWindowLayout L = MoeWindowLayout::make(2, 4, 128, 2);
  EmulatedPeerWindows windows(2, L.total_bytes);
  DeviceBuffer<bf16> hidden(8 * 128);
  MoeDispatchParams p;
  p.num_local_ranks = 2;
  p.layout = L;
  p.num_experts = 6;
  for (int r = 0; r < 2; ++r) {
    p.ranks[r].hidden = hidden.get();
    p.ranks[r].num_tokens = 5;  // more than max_tokens
    p.ranks[r].rank = r;
    for (int q = 0; q < 2; ++q) p.ranks[r].windows[q] = windows.windows()[q];
  }
  EXPECT_THROW(launch_moe_dispatch(p, nullptr), Error);
  p.num_experts = 5;  // does not divide over 2 ranks
  EXPECT_THROW(launch_moe_dispatch(p, nullptr), Error);
}

// ---------------------------------------------------------------------------------------------
// A GPU rank group whose rank fails: two ranks on this GPU, each on its own non-blocking stream
// (launched from this thread: every allocation comes first, since cudaMalloc / cudaFree may wait
// for the spinning kernels).

struct TwoRankGroup {
  explicit TwoRankGroup(uint64_t timeout_ms) : group({0, 0}, options(timeout_ms)) {
    for (cudaStream_t& s : streams) GPU_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<bf16> rows(kTokens * kHidden, __float2bfloat16(0.5f));
    std::vector<int32_t> ids(kTokens * kTopK);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % kExperts);
    std::vector<float> weights(kTokens * kTopK, 0.5f);
    for (int r = 0; r < 2; ++r) {
      data[r] = DeviceBuffer<float>(std::vector<float>(kCount, 1.0f));
      hidden[r] = DeviceBuffer<bf16>(rows);
      topk_ids[r] = DeviceBuffer<int32_t>(ids);
      topk_weights[r] = DeviceBuffer<float>(weights);
      expert_out[r] = DeviceBuffer<bf16>(std::vector<bf16>(2 * kTokens * kHidden, __float2bfloat16(1.0f)));
      out[r] = DeviceBuffer<bf16>(kTokens * kHidden);
    }
  }
  ~TwoRankGroup() {
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  }
  static ThreadPeerGroupOptions options(uint64_t timeout_ms) {
    ThreadPeerGroupOptions o;
    o.all_reduce_capacity_bytes = kCount * sizeof(float);
    o.max_tokens_per_rank = kTokens;
    o.hidden = kHidden;
    o.top_k = kTopK;
    o.peer_timeout_ms = timeout_ms;
    return o;
  }
  void all_reduce(int r) { group.communicator(r).all_reduce_sum(data[r].get(), kCount, streams[r]); }
  void dispatch(int r) {
    group.moe_dispatch(r, hidden[r].get(), topk_ids[r].get(), topk_weights[r].get(), kTokens, kExperts,
                       streams[r]);
  }
  void combine(int r) { group.moe_combine(r, expert_out[r].get(), out[r].get(), kTokens, streams[r]); }
  // Waits for rank r's stream; the seconds it took.
  double finish(int r) {
    const auto t0 = std::chrono::steady_clock::now();
    GPU_TEST_CUDA(cudaStreamSynchronize(streams[r]));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // Both ranks run an all-reduce, a dispatch and a combine: the group works as when new.
  void expect_both_ranks_meet() {
    for (int r = 0; r < 2; ++r) data[r].upload(std::vector<float>(kCount, 1.0f));
    for (int r = 0; r < 2; ++r) all_reduce(r), dispatch(r);
    for (int r = 0; r < 2; ++r) combine(r);
    for (int r = 0; r < 2; ++r) finish(r);
    EXPECT_FALSE(group.abandoned()) << group.abandon_reason();
    for (int r = 0; r < 2; ++r) EXPECT_EQ(data[r].download(), std::vector<float>(kCount, 2.0f));
  }

  static constexpr int kCount = 4096, kTokens = 4, kHidden = 64, kTopK = 2, kExperts = 4;
  ThreadPeerGroup group;
  cudaStream_t streams[2] = {};
  DeviceBuffer<float> data[2], topk_weights[2];
  DeviceBuffer<bf16> hidden[2], expert_out[2], out[2];
  DeviceBuffer<int32_t> topk_ids[2];
};

TEST(GpuCollectives, PeerGroupAbandonReleasesTheWaitersAndResets) {
  TwoRankGroup g(60'000);  // only abandon() can release the waiters in time
  g.all_reduce(0);  // rank 1 never arrives: its host side failed
  g.dispatch(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(cudaStreamQuery(g.streams[0]), cudaErrorNotReady);
  g.group.abandon(1);
  EXPECT_LT(g.finish(0), 1.0);
  ASSERT_TRUE(g.group.abandoned());
  EXPECT_NE(g.group.abandon_reason().find("rank 1 failed"), std::string::npos) << g.group.abandon_reason();
  g.group.reset_after_abort();
  EXPECT_FALSE(g.group.abandoned());
  g.expect_both_ranks_meet();
}

TEST(GpuCollectives, PeerGroupTimeoutNamesTheRankAndBlockThatWaited) {
  TwoRankGroup g(300);
  g.dispatch(1);  // rank 0 never arrives
  g.all_reduce(1);
  g.combine(1);
  // The dispatch times out; the waits after it see the record and leave at once.
  EXPECT_LT(g.finish(1), 3.0);
  ASSERT_TRUE(g.group.abandoned());
  const std::string why = g.group.abandon_reason();
  EXPECT_NE(why.find("moe dispatch: rank 1 (block 0) waited 3"), std::string::npos) << why;
  EXPECT_NE(why.find("ms for rank 0: flag 0, expected 1"), std::string::npos) << why;
  g.group.reset_after_abort();
  g.expect_both_ranks_meet();
}

// ---------------------------------------------------------------------------------------------
// NCCL

TEST(GpuCollectives, NcclOneRankCommunicatorRoundTrips) {
  parallel::TcpBootstrap boot({"127.0.0.1", 1}, 0, 1);  // one rank: no socket is opened
  const ncclUniqueId id = make_nccl_unique_id(boot);
  NcclCommunicator nccl(id, 0, 1, 0);
  EXPECT_EQ(nccl.size(), 1);
  EXPECT_EQ(nccl.lsa_size(), 1);
  cudaStream_t stream;
  GPU_TEST_CUDA(cudaStreamCreate(&stream));
  std::mt19937 rng(31);
  auto x = random_bf16(1001, rng);
  DeviceBuffer<bf16> d(x.bits);
  nccl.all_reduce_sum(d.get(), x.bits.size(), stream);
  std::vector<float> f(777);
  for (size_t i = 0; i < f.size(); ++i) f[i] = 0.5f * static_cast<float>(i) - 3.0f;
  DeviceBuffer<float> df(f);
  nccl.all_reduce_sum(df.get(), f.size(), stream);
  nccl.barrier(stream);
  GPU_TEST_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(to_f32(d.download()), x.f32);
  EXPECT_EQ(df.download(), f);

  // Its symmetric window: NCCL's peer pointer for rank 0 addresses the same memory.
  SymmetricWindow window(nccl, 10'000);
  ASSERT_EQ(window.peers().size(), 1u);
  EXPECT_GE(window.bytes(), 10'000u);
  std::vector<uint8_t> pattern(window.bytes(), 0xAB), back(window.bytes());
  GPU_TEST_CUDA(cudaMemcpy(back.data(), window.local(), back.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::count(back.begin(), back.end(), 0), static_cast<long>(back.size()));
  GPU_TEST_CUDA(cudaMemcpy(window.local(), pattern.data(), pattern.size(), cudaMemcpyHostToDevice));
  GPU_TEST_CUDA(cudaMemcpy(back.data(), window.local(), back.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(back, pattern);

  // CustomAllReduce on one rank: every call is a no-op that leaves the data as it was.
  CustomAllReduce custom(nccl);
  EXPECT_EQ(custom.fallback_reason(), "");
  custom.all_reduce_sum(df.get(), f.size(), stream);
  custom.barrier(stream);
  GPU_TEST_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(df.download(), f);
  GPU_TEST_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace relay::gpu_test

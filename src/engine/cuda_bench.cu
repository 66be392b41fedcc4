// See cuda_bench.h. Definitions (shared/guide/targets.md):
//   decode roofline  = (weights touched by the step + KV bytes read) / copy bandwidth, where the
//                      experts touched are the expected union of the batch's routing,
//                      128 * (1 - (1 - 8/128)^batch) for uniform routing;
//   prefill roofline = max(matmul + attention FLOPs / bf16 GEMM peak, all weight bytes / copy bw);
//   roofline_fraction = roofline time / measured time.
// Kernel timings are medians of CUDA-event-timed repetitions after a warm-up; inputs are random
// (never zeros) and rotate where the data would otherwise sit in L2.
//
// Sharded model mode (options.parallel, options.devices: tp x dp ranks on `gpus` distinct devices).
// Every model-mode record carries tp, ep, dp, ranks and gpus; prefill and decode records also
// tok_per_s_per_gpu = tok_per_s / gpus. The rooflines above stay the one-GPU model's (the whole
// batch's bytes and FLOPs, ceilings measured on device 0, as if every GPU were alike) and are
// divided by gpus: roofline_basis "one_gpu_div_gpus" (one rank: "one_gpu", the same number), i.e.
// the fraction is of perfect scaling of one GPU's roofline over the GPUs used. Ranks sharing one
// GPU (`--gpus 0,0`) are therefore held to the one-GPU roofline: their fraction shows what the
// sharded path costs there, not a speed-up. DP places decode sequence i in DP partition i % dp
// (block ids [g B, (g + 1) B), B = num_kv_blocks / dp), and each prefill prompt in partition 0, so
// under DP only one DP rank's attention works on a prefill (on dp GPUs, a fraction of about 1 / dp
// at most).
// Load figures and device_ms_per_step are rank 0's; "profile" records are rank 0's ops (its part of
// the batch; its collectives include waiting for the peers), "profile_rank": 0 when sharded.
#include "engine/cuda_bench.h"

#include <cuda_runtime.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "engine/cuda_backend.h"
#include "engine/fp8_kernel_bench.h"
#include "engine/roofline.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "model/decoder_plan.h"
#include "model/model.h"
#include "parallel/cuda/collective_bench.h"

namespace relay {

using kernels::bf16;

namespace {

__global__ void fill_random_kernel(bf16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    p[i] = __float2bfloat16((static_cast<float>(x >> 40) / 16777216.0f * 2.0f - 1.0f) * scale);
  }
}

// The read-bandwidth ceiling's kernel: every 16 bytes of `src` read once (four loads in flight per
// thread per pass), XOR-folded into one word per thread so the loads cannot be dropped.
__global__ void read_stream_kernel(const uint4* src, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint32_t r[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) kernels::cuda::load_streaming_16(r[u], src + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= r[u][0] ^ r[u][1] ^ r[u][2] ^ r[u][3];
  }
  for (; i < n; i += stride) {
    uint32_t r[4];
    kernels::cuda::load_streaming_16(r, src + i);
    acc ^= r[0] ^ r[1] ^ r[2] ^ r[3];
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // practically never; the compiler cannot know
}

template <typename T>
struct DevBuf {
  T* p = nullptr;
  explicit DevBuf(size_t n) { RELAY_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

void fill_random(bf16* p, size_t n, uint64_t seed, float scale = 1.0f) {
  fill_random_kernel<<<1024, 256>>>(p, n, seed, scale);
  RELAY_CUDA_CHECK_LAUNCH("fill_random_kernel");
}

template <typename T>
T* upload(DevBuf<T>& buf, const std::vector<T>& v) {
  RELAY_CUDA_CHECK(cudaMemcpy(buf.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return buf.p;
}

// Median milliseconds of `reps` event-timed runs of fn(rep) after `warmup` runs.
double time_ms(const std::function<void(int)>& fn, int reps, int warmup = 2) {
  for (int i = 0; i < warmup; ++i) fn(i);
  cudaEvent_t a, b;
  RELAY_CUDA_CHECK(cudaEventCreate(&a));
  RELAY_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    RELAY_CUDA_CHECK(cudaEventRecord(a));
    fn(i);
    RELAY_CUDA_CHECK(cudaEventRecord(b));
    RELAY_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    RELAY_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Ceilings {
  double copy_gbps = 0, gemm_tflops = 0;
  // A streaming read over a buffer far larger than L2: what a decode step's weight reads can reach
  // (a copy's figure counts its reads and writes, and writes cost more than reads).
  double read_gbps = 0;
  double fp8_gemm_tflops = 0;  // measured only when an FP8 figure needs it (kernels mode, --dtype fp8)
  std::string device;
};

class Reporter {
 public:
  Reporter(const CudaBenchOptions& o, const Ceilings& c) : ceilings_(c) {
    if (!o.out_path.empty()) file_.open(o.out_path, std::ios::app);
  }
  void emit(nlohmann::json j) {
    j["device"] = ceilings_.device;
    j["ceiling_copy_gbps"] = ceilings_.copy_gbps;
    j["ceiling_read_gbps"] = ceilings_.read_gbps;
    j["ceiling_gemm_tflops"] = ceilings_.gemm_tflops;
    if (ceilings_.fp8_gemm_tflops > 0) j["ceiling_fp8_gemm_tflops"] = ceilings_.fp8_gemm_tflops;
    const std::string line = j.dump();
    std::cout << line << std::endl;
    if (file_) file_ << line << "\n" << std::flush;
  }

 private:
  Ceilings ceilings_;
  std::ofstream file_;
};

Ceilings measure_ceilings(bool quick) {
  Ceilings c;
  cudaDeviceProp prop{};
  RELAY_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  c.device = prop.name;
  const size_t copy_bytes = size_t{4} << 30;
  {
    DevBuf<uint8_t> src(copy_bytes), dst(copy_bytes);
    RELAY_CUDA_CHECK(cudaMemset(src.p, 1, copy_bytes));
    const double ms = time_ms([&](int) { RELAY_CUDA_CHECK(cudaMemcpyAsync(dst.p, src.p, copy_bytes, cudaMemcpyDeviceToDevice)); },
                              quick ? 5 : 10);
    c.copy_gbps = 2.0 * copy_bytes / (ms * 1e6);  // read + written
    DevBuf<uint32_t> sink(1);
    const double read_ms = time_ms(
        [&](int) {
          read_stream_kernel<<<prop.multiProcessorCount * 8, 256>>>(reinterpret_cast<const uint4*>(src.p),
                                                                    copy_bytes / 16, sink.p);
        },
        quick ? 5 : 10);
    RELAY_CUDA_CHECK_LAUNCH("read_stream_kernel");
    c.read_gbps = copy_bytes / (read_ms * 1e6);
  }
  {
    const int n = 8192;
    DevBuf<bf16> a(size_t{n} * n), b(size_t{n} * n), out(size_t{n} * n);
    fill_random(a.p, size_t{n} * n, 1), fill_random(b.p, size_t{n} * n, 2);
    const double ms = time_ms([&](int) { kernels::launch_matmul({a.p, b.p, nullptr, out.p, n, n, n}, nullptr); }, quick ? 5 : 10);
    c.gemm_tflops = 2.0 * n * double(n) * n / (ms * 1e9);
  }
  return c;
}

// Uniform random routing of `tokens` tokens to top_k distinct experts -> expert_offsets.
std::vector<int32_t> random_offsets(int tokens, int experts, int top_k, std::mt19937& rng) {
  std::vector<int32_t> counts(experts + 1, 0);
  std::vector<int> ids(experts);
  for (int t = 0; t < tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int k = 0; k < top_k; ++k) {
      std::uniform_int_distribution<int> d(k, experts - 1);
      std::swap(ids[k], ids[d(rng)]);
      ++counts[ids[k] + 1];
    }
  }
  for (int e = 0; e < experts; ++e) counts[e + 1] += counts[e];
  return counts;
}

void bench_grouped_gemm(Reporter& rep, const Ceilings& c, bool quick) {
  std::mt19937 rng(5);
  struct Shape { const char* name; int experts, n, k; };
  // Prefill: 4096 tokens routed top-8, vs dense at equal FLOPs: Qwen3-30B-A3B's experts (128, about
  // 256 rows each) and Qwen3.5-35B-A3B's (256, about 128 rows each).
  for (Shape s : {Shape{"gate_up", 128, 1536, 2048}, Shape{"down", 128, 2048, 768},
                  Shape{"q35_gate_up", 256, 1024, 2048}, Shape{"q35_down", 256, 2048, 512}}) {
    const int tokens = 4096, rows = tokens * 8, experts = s.experts;
    auto offsets = random_offsets(tokens, experts, 8, rng);
    DevBuf<bf16> x(size_t(rows) * s.k), w(size_t(experts) * s.n * s.k), out(size_t(rows) * s.n), dense_w(size_t(s.n) * s.k);
    DevBuf<int32_t> off(offsets.size());
    fill_random(x.p, size_t(rows) * s.k, 3), fill_random(w.p, size_t(experts) * s.n * s.k, 4, 0.05f);
    fill_random(dense_w.p, size_t(s.n) * s.k, 5, 0.05f);
    upload(off, offsets);
    kernels::MoeGroupedMatmulParams<bf16> p{x.p, w.p, off.p, out.p, rows, experts, s.n, s.k};
    const double dense_ms =
        time_ms([&](int) { kernels::launch_matmul({x.p, dense_w.p, nullptr, out.p, rows, s.n, s.k}, nullptr); }, quick ? 5 : 20);
    const double flops = 2.0 * rows * double(s.n) * s.k;
    for (auto kind : {kernels::GroupedGemmKind::Auto, kernels::GroupedGemmKind::Tiled,
                      kernels::GroupedGemmKind::CutlassCooperative, kernels::GroupedGemmKind::CutlassPingpong,
                      kernels::GroupedGemmKind::Wgmma}) {
      const double ms = time_ms([&](int) { kernels::launch_moe_grouped_matmul(p, kind, nullptr); }, quick ? 5 : 20);
      rep.emit({{"mode", "kernel"}, {"kernel", "moe_grouped_gemm_prefill"}, {"shape", s.name},
                {"variant", kernels::grouped_gemm_kind_name(kind)}, {"tokens", tokens}, {"experts", experts},
                {"rows", rows}, {"n", s.n}, {"k", s.k},
                {"ms", ms}, {"tflops", flops / (ms * 1e9)}, {"dense_cublas_tflops", flops / (dense_ms * 1e9)},
                {"fraction_of_dense", dense_ms / ms}, {"fraction_of_peak", flops / (ms * 1e9) / c.gemm_tflops}});
    }
  }
  const int experts = 128;
  // Decode: a few rows per expert; bytes are the active experts' weights.
  struct Decode { const char* name; int n, k, active, rows_per_expert; };
  for (Decode d : {Decode{"235b_gate_up_128x1", 3072, 4096, 128, 1}, Decode{"235b_gate_up_16x1", 3072, 4096, 16, 1},
                   Decode{"235b_gate_up_8x1", 3072, 4096, 8, 1}, Decode{"30b_gate_up_8x1", 1536, 2048, 8, 1},
                   Decode{"30b_down_8x1", 2048, 768, 8, 1}, Decode{"30b_gate_up_56x1", 1536, 2048, 56, 1},
                   Decode{"30b_gate_up_128x4", 1536, 2048, 128, 4}, Decode{"30b_gate_up_128x16", 1536, 2048, 128, 16},
                   Decode{"30b_down_128x16", 2048, 768, 128, 16}, Decode{"q35_gate_up_8x1", 1024, 2048, 8, 1},
                   Decode{"q35_down_8x1", 2048, 512, 8, 1}}) {
    std::vector<int32_t> offsets(experts + 1, 0);
    // The active experts spread evenly over the ids.
    for (int i = 0; i < d.active; ++i) offsets[i * (experts / d.active) + 1] = d.rows_per_expert;
    for (int e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
    const int rows = offsets[experts];
    // Several weight copies rotate so the 8-16 expert cases do not run from L2.
    const int copies = d.active <= 16 ? 4 : 1;
    const size_t wn = size_t(experts) * d.n * d.k;
    DevBuf<bf16> x(size_t(rows) * d.k), w(wn * copies), out(size_t(rows) * d.n);
    DevBuf<int32_t> off(offsets.size());
    fill_random(x.p, size_t(rows) * d.k, 6), fill_random(w.p, wn * copies, 7, 0.05f);
    upload(off, offsets);
    for (auto kind : {kernels::GroupedGemmKind::Streaming, kernels::GroupedGemmKind::Tiled,
                      kernels::GroupedGemmKind::CutlassPingpong, kernels::GroupedGemmKind::Wgmma}) {
      const double ms = time_ms(
          [&](int i) {
            kernels::launch_moe_grouped_matmul({x.p, w.p + (i % copies) * wn, off.p, out.p, rows, experts, d.n, d.k}, kind,
                                               nullptr);
          },
          quick ? 10 : 50);
      const double bytes = double(d.active) * d.n * d.k * 2;
      rep.emit({{"mode", "kernel"}, {"kernel", "moe_grouped_gemm_decode"}, {"shape", d.name},
                {"variant", kernels::grouped_gemm_kind_name(kind)}, {"rows", rows},
                {"n", d.n}, {"k", d.k}, {"active_experts", d.active}, {"ms", ms}, {"gbps", bytes / (ms * 1e6)},
                {"fraction_of_copy", bytes / (ms * 1e6) / c.copy_gbps}});
    }
  }
}

// Decode-sized dense projections (1 and 8 rows): the weight-streaming kernel against cuBLASLt, as
// bytes of weights per second. Weight copies rotate past L2 (about 50 MB) so each run reads HBM.
void bench_dense_decode(Reporter& rep, const Ceilings& c, bool quick) {
  struct Shape { const char* name; int n, k; };
  for (Shape s : {Shape{"30b_qkv", 5120, 2048}, Shape{"30b_o_proj", 2048, 4096}, Shape{"30b_router", 128, 2048},
                  Shape{"235b_qkv", 9216, 4096}, Shape{"235b_o_proj", 4096, 8192}}) {
    const size_t wn = size_t(s.n) * s.k;
    const int copies = static_cast<int>(std::max<size_t>(2, (size_t{256} << 20) / (wn * 2)));
    DevBuf<bf16> w(wn * copies), x(size_t(kernels::kMaxStreamingRows) * s.k), out(size_t(kernels::kMaxStreamingRows) * s.n);
    fill_random(w.p, wn * copies, 8, 0.05f), fill_random(x.p, size_t(kernels::kMaxStreamingRows) * s.k, 9);
    for (int m : {1, 2, 4, kernels::kMaxStreamingRows}) {
      for (auto kind : {kernels::DenseGemmKind::Streaming, kernels::DenseGemmKind::Cublas}) {
        const double ms = time_ms(
            [&](int i) { kernels::launch_matmul({x.p, w.p + (i % copies) * wn, nullptr, out.p, m, s.n, s.k}, kind, nullptr); },
            quick ? 10 : 50);
        const double bytes = double(wn) * 2;
        rep.emit({{"mode", "kernel"}, {"kernel", "dense_gemm_decode"}, {"shape", s.name},
                  {"variant", kernels::dense_gemm_kind_name(kind)}, {"rows", m}, {"n", s.n}, {"k", s.k}, {"ms", ms},
                  {"gbps", bytes / (ms * 1e6)}, {"fraction_of_copy", bytes / (ms * 1e6) / c.copy_gbps}});
      }
    }
  }
}

struct AttnSetup {
  DevBuf<bf16> q, k, v, out;
  DevBuf<int32_t> qs, cl, bt;
  kernels::PagedAttentionParams<bf16> p{};
  AttnSetup(const std::vector<std::pair<int, int>>& seqs, int nq, int nkv, int hd, int bs, std::mt19937& rng)
      : q(count_tokens(seqs) * size_t(nq) * hd),
        k(blocks(seqs, bs) * size_t(nkv) * bs * hd),
        v(blocks(seqs, bs) * size_t(nkv) * bs * hd),
        out(count_tokens(seqs) * size_t(nq) * hd),
        qs(seqs.size() + 1),
        cl(seqs.size()),
        bt(table_size(seqs, bs)) {
    std::vector<int32_t> query_starts{0}, context_lens, tables;
    int max_blocks = 0;
    for (auto [n, c] : seqs) max_blocks = std::max(max_blocks, (c + bs - 1) / bs);
    const int total_blocks = static_cast<int>(blocks(seqs, bs));
    std::vector<int32_t> ids(total_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    int next = 0;
    tables.assign(seqs.size() * size_t(max_blocks), 0);
    for (size_t i = 0; i < seqs.size(); ++i) {
      query_starts.push_back(query_starts.back() + seqs[i].first);
      context_lens.push_back(seqs[i].second);
      for (int b = 0; b < (seqs[i].second + bs - 1) / bs; ++b) tables[i * max_blocks + b] = ids[next++];
    }
    fill_random(q.p, count_tokens(seqs) * size_t(nq) * hd, 8);
    fill_random(k.p, blocks(seqs, bs) * size_t(nkv) * bs * hd, 9);
    fill_random(v.p, blocks(seqs, bs) * size_t(nkv) * bs * hd, 10);
    upload(qs, query_starts), upload(cl, context_lens), upload(bt, tables);
    p = {q.p, k.p, v.p, qs.p, cl.p, bt.p, out.p, static_cast<int>(seqs.size()), static_cast<int>(count_tokens(seqs)), nq, nkv,
         hd, bs, max_blocks, 1.0f / std::sqrt(float(hd))};
  }
  static size_t count_tokens(const std::vector<std::pair<int, int>>& s) {
    size_t n = 0;
    for (auto [t, c] : s) n += t;
    return n;
  }
  static size_t table_size(const std::vector<std::pair<int, int>>& s, int bs) {
    size_t w = 0;
    for (auto [t, c] : s) w = std::max<size_t>(w, (c + bs - 1) / bs);
    return s.size() * w;
  }
  static size_t blocks(const std::vector<std::pair<int, int>>& s, int bs) {
    size_t n = 0;
    for (auto [t, c] : s) n += (c + bs - 1) / bs;
    return n;
  }
};

// The floor of an event-timed launch: a one-row RMSNorm moves 8 KB, so its time is all launch,
// scheduling and event overhead. Every small kernel's figure in this mode includes the same floor.
void bench_launch_floor(Reporter& rep, bool quick) {
  DevBuf<bf16> x(2048), w(2048), y(2048);
  fill_random(x.p, 2048, 10), fill_random(w.p, 2048, 11);
  const double ms =
      time_ms([&](int) { kernels::launch_rms_norm({x.p, nullptr, w.p, y.p, 1, 2048, 1e-6f}, nullptr); }, quick ? 20 : 50);
  rep.emit({{"mode", "kernel"}, {"kernel", "launch_floor"}, {"ms", ms}});
}

void bench_attention(Reporter& rep, const Ceilings& c, bool quick) {
  std::mt19937 rng(6);
  // Causal prefill at Qwen3-30B-A3B's attention shape (32 q heads, 4 KV heads, head_dim 128) and
  // Qwen3.5-35B-A3B's gated attention (16, 2, 256), on both kernels.
  struct Shape {
    int q_heads, kv_heads, head_dim;
    std::vector<int> lengths;
  };
  const std::vector<Shape> shapes{{32, 4, 128, quick ? std::vector<int>{8192} : std::vector<int>{4096, 8192, 16384}},
                                  {16, 2, 256, quick ? std::vector<int>{4096} : std::vector<int>{4096, 16384}}};
  for (const Shape& sh : shapes) {
    for (int len : sh.lengths) {
      AttnSetup a({{len, len}}, sh.q_heads, sh.kv_heads, sh.head_dim, 16, rng);
      const double flops = 4.0 * sh.q_heads * sh.head_dim * (double(len) * len / 2);  // causal: half the square
      for (auto kind : {kernels::PrefillAttentionKind::Wgmma, kernels::PrefillAttentionKind::MmaSync}) {
        const double ms =
            time_ms([&](int) { kernels::launch_paged_attention(a.p, kind, nullptr); }, quick ? 3 : 10);
        rep.emit({{"mode", "kernel"}, {"kernel", "prefill_attention"}, {"variant", kernels::prefill_attention_kind_name(kind)},
                  {"tokens", len}, {"q_heads", sh.q_heads}, {"kv_heads", sh.kv_heads}, {"head_dim", sh.head_dim},
                  {"ms", ms}, {"tflops", flops / (ms * 1e9)}, {"fraction_of_peak", flops / (ms * 1e9) / c.gemm_tflops}});
      }
    }
  }
  // Batch 1 at three contexts separates the kernel's fixed cost from its streaming rate.
  for (auto [batch, ctx] : quick ? std::vector<std::pair<int, int>>{{1, 512}, {1, 4096}, {1, 32768}, {64, 4096}}
                                 : std::vector<std::pair<int, int>>{{1, 512}, {1, 4096}, {1, 32768}, {64, 4096},
                                                                    {256, 4096}, {64, 16384}}) {
    std::vector<std::pair<int, int>> seqs(batch, {1, ctx});
    AttnSetup a(seqs, 32, 4, 128, 16, rng);
    const double ms = time_ms([&](int) { kernels::launch_paged_attention(a.p, nullptr); }, quick ? 5 : 20);
    const double bytes = double(batch) * ctx * 4 * 128 * 2 * 2;
    rep.emit({{"mode", "kernel"}, {"kernel", "decode_attention"}, {"batch", batch}, {"context", ctx}, {"q_heads", 32},
              {"kv_heads", 4}, {"head_dim", 128}, {"ms", ms}, {"gbps", bytes / (ms * 1e6)},
              {"fraction_of_copy", bytes / (ms * 1e6) / c.copy_gbps}});
  }
}

// Batch-1 decode attention at each split count (0: the cost model's pick): where the fixed cost of a
// split (partials, the last CTA's merge) outweighs the shorter walk per warp.
void bench_decode_splits(Reporter& rep, const Ceilings& c, bool quick) {
  std::mt19937 rng(13);
  for (int ctx : {512, 4096}) {
    AttnSetup a({{1, ctx}}, 32, 4, 128, 16, rng);
    const double bytes = double(ctx) * 4 * 128 * 2 * 2;
    for (int splits : {0, 1, 2, 4, 8, 16, 24, 32, 48, 64}) {
      const double ms = time_ms([&](int) { kernels::launch_decode_attention(a.p, splits, nullptr); }, quick ? 10 : 30);
      rep.emit({{"mode", "kernel"}, {"kernel", "decode_attention_splits"}, {"batch", 1}, {"context", ctx},
                {"splits", splits}, {"ms", ms}, {"gbps", bytes / (ms * 1e6)},
                {"fraction_of_copy", bytes / (ms * 1e6) / c.copy_gbps}});
    }
  }
}

// MoE routing at the prefill shape (4096 tokens, top-8 of 128 experts, hidden 2048): the permute
// once with the real hidden size and once with hidden 8, which leaves only its index kernel (the
// per-expert stable ranking), so the two figures split the op's time; then the weighted combine.
void bench_moe_routing(Reporter& rep, const Ceilings& c, bool quick) {
  const int tokens = 4096, experts = 128, top_k = 8, hidden = 2048, rows = tokens * top_k;
  DevBuf<bf16> logits(size_t(tokens) * experts), x(size_t(tokens) * hidden), permuted(size_t(rows) * hidden),
      out(size_t(tokens) * hidden);
  DevBuf<int32_t> ids(rows), index(rows), offsets(experts + 1);
  DevBuf<float> weights(rows);
  fill_random(logits.p, size_t(tokens) * experts, 21, 2.0f);
  fill_random(x.p, size_t(tokens) * hidden, 22);
  kernels::launch_moe_router_topk({logits.p, ids.p, weights.p, tokens, experts, top_k, true}, nullptr);
  const int reps = quick ? 5 : 20;
  for (int h : {hidden, 8}) {
    const double ms = time_ms(
        [&](int) { kernels::launch_moe_permute({x.p, ids.p, permuted.p, index.p, offsets.p, tokens, h, experts, top_k}, nullptr); },
        reps);
    const double bytes = double(rows) * h * 2 * 2;  // each routed row read and written once
    rep.emit({{"mode", "kernel"}, {"kernel", "moe_permute"}, {"tokens", tokens}, {"top_k", top_k}, {"experts", experts},
              {"hidden", h}, {"ms", ms}, {"gbps", bytes / (ms * 1e6)}, {"fraction_of_copy", bytes / (ms * 1e6) / c.copy_gbps}});
  }
  const double ms = time_ms(
      [&](int) { kernels::launch_moe_unpermute_combine({permuted.p, index.p, weights.p, out.p, tokens, hidden, top_k}, nullptr); },
      reps);
  const double bytes = double(rows) * hidden * 2 + double(tokens) * hidden * 2;
  rep.emit({{"mode", "kernel"}, {"kernel", "moe_unpermute_combine"}, {"tokens", tokens}, {"top_k", top_k},
            {"hidden", hidden}, {"ms", ms}, {"gbps", bytes / (ms * 1e6)}, {"fraction_of_copy", bytes / (ms * 1e6) / c.copy_gbps}});
}

// Gated DeltaNet's recurrence at Qwen3.5-35B-A3B's heads (16 key, 32 value heads of 128), one
// layer: prompts in the chunked and the decode (token-walk) form, with the FLOPs of the chunked
// form's products (bench/gdn_peer.py times flash-linear-attention's chunk_gated_delta_rule on the
// same shapes); then decode steps, whose floor is reading and writing each sequence's fp32 state.
void bench_gated_delta_rule(Reporter& rep, const Ceilings& c, bool quick) {
  constexpr int hk = 16, hv = 32, dim = 128, gate_stride = 2 * hv;
  const int64_t row = (2 * hk + hv) * dim, state_elems = int64_t{hv} * dim * dim;
  struct Case {
    int seqs, len;
    bool chunked;
  };
  std::vector<Case> cases;
  for (auto [seqs, len] : quick ? std::vector<std::pair<int, int>>{{1, 4096}}
                                : std::vector<std::pair<int, int>>{{1, 4096}, {1, 16384}, {8, 512}}) {
    cases.push_back({seqs, len, true});
    if (len <= 4096) cases.push_back({seqs, len, false});
  }
  for (int batch : {1, 64, 256}) cases.push_back({batch, 1, false});
  std::vector<float> a_log(hv);
  for (int h = 0; h < hv; ++h) a_log[h] = std::log(1.0f + 0.25f * h);  // decays as the released models'
  DevBuf<float> a_log_d(hv);
  DevBuf<bf16> dt_bias(hv);
  upload(a_log_d, a_log);
  fill_random(dt_bias.p, hv, 31);
  for (const Case& k : cases) {
    const int T = k.seqs * k.len;
    DevBuf<bf16> qkv(size_t(T) * row), gates(size_t(T) * gate_stride), out(size_t(T) * hv * dim);
    DevBuf<float> states(size_t(k.seqs) * state_elems);
    DevBuf<uint8_t> ws(k.chunked ? kernels::gated_delta_rule_workspace_bytes(T, hk, hv) : 1);
    std::vector<int32_t> starts(k.seqs + 1), slots(k.seqs);
    for (int i = 0; i <= k.seqs; ++i) starts[i] = i * k.len;
    std::iota(slots.begin(), slots.end(), 0);
    DevBuf<int32_t> starts_d(k.seqs + 1), slots_d(k.seqs);
    DevBuf<uint8_t> fresh_d(k.seqs);
    upload(starts_d, starts);
    upload(slots_d, slots);
    RELAY_CUDA_CHECK(cudaMemset(fresh_d.p, 0, k.seqs));
    RELAY_CUDA_CHECK(cudaMemset(states.p, 0, size_t(k.seqs) * state_elems * 4));
    fill_random(qkv.p, size_t(T) * row, 32);
    fill_random(gates.p, size_t(T) * gate_stride, 33, 2.0f);
    const kernels::GatedDeltaRuleParams<bf16> p{qkv.p, gates.p, gates.p + hv, gate_stride, a_log_d.p, dt_bias.p,
                                                states.p, state_elems, starts_d.p, slots_d.p, fresh_d.p, nullptr,
                                                out.p, k.seqs, T, hk, hv, dim, dim,
                                                k.chunked ? ws.p : nullptr};
    const double ms = time_ms([&](int) { kernels::launch_gated_delta_rule(p, nullptr); }, quick ? 3 : 10);
    nlohmann::json j{{"mode", "kernel"}, {"kernel", "gated_delta_rule"}, {"form", k.chunked ? "chunked" : "decode"},
                     {"seqs", k.seqs}, {"tokens_per_seq", k.len}, {"k_heads", hk}, {"v_heads", hv},
                     {"head_dim", dim}, {"ms", ms}, {"tok_per_s", T / (ms * 1e-3)}};
    if (k.len > 1) {
      // Per 64-token chunk and value head: q.k and k.k (2 x 64x64x128), W and U (2 x 64x128x64),
      // W S and Q S (2 x 64x128x128), P D (64x128x64) and the state update (128x128x64).
      const double chunk_flops = 2.0 * (2 * 64 * 64 * 128 + 2 * 64 * 128 * 64 + 2 * 64 * 128 * 128 +
                                        64 * 128 * 64 + 128 * 128 * 64);
      const double flops = chunk_flops * hv * k.seqs * std::ceil(k.len / 64.0);
      j["tflops"] = flops / (ms * 1e9);
      j["fraction_of_peak"] = flops / (ms * 1e9) / c.gemm_tflops;
    } else {
      const double bytes = 2.0 * k.seqs * state_elems * 4;  // each state read and written
      j["gbps"] = bytes / (ms * 1e6);
      j["fraction_of_copy"] = bytes / (ms * 1e6) / c.copy_gbps;
    }
    rep.emit(std::move(j));
  }
}

// Gated DeltaNet's decode step at Qwen3.5-35B-A3B's heads, one layer: the fused kernel (conv,
// recurrence and gated norm) against the three ops it replaces, at batch 1, 64 and 256. The floor
// is reading and writing each sequence's fp32 states, recurrent and conv.
void bench_gated_delta_net_step(Reporter& rep, const Ceilings& c, bool quick) {
  constexpr int hk = 16, hv = 32, dim = 128, kernel = 4;
  constexpr int conv_dim = (2 * hk + hv) * dim, v_dim = hv * dim, proj_stride = conv_dim + v_dim + 2 * hv;
  constexpr int64_t conv_elems = int64_t{conv_dim} * (kernel - 1), state_stride = conv_elems + int64_t{hv} * dim * dim;
  std::vector<float> a_log(hv);
  for (int h = 0; h < hv; ++h) a_log[h] = std::log(1.0f + 0.25f * h);
  DevBuf<float> a_log_d(hv);
  DevBuf<bf16> dt_bias(hv), conv_w(size_t(conv_dim) * kernel), norm_w(dim);
  upload(a_log_d, a_log);
  fill_random(dt_bias.p, hv, 41);
  fill_random(conv_w.p, size_t(conv_dim) * kernel, 42, 0.5f);
  fill_random(norm_w.p, dim, 43);
  for (const int batch : {1, 64, 256}) {
    DevBuf<bf16> proj(size_t(batch) * proj_stride), conv_out(size_t(batch) * conv_dim), out(size_t(batch) * v_dim);
    DevBuf<float> states(size_t(batch) * state_stride);
    std::vector<int32_t> starts(batch + 1), slots(batch);
    std::iota(starts.begin(), starts.end(), 0);
    std::iota(slots.begin(), slots.end(), 0);
    DevBuf<int32_t> starts_d(batch + 1), slots_d(batch);
    DevBuf<uint8_t> fresh_d(batch);
    upload(starts_d, starts);
    upload(slots_d, slots);
    RELAY_CUDA_CHECK(cudaMemset(fresh_d.p, 0, batch));
    RELAY_CUDA_CHECK(cudaMemset(states.p, 0, size_t(batch) * state_stride * 4));
    fill_random(proj.p, size_t(batch) * proj_stride, 44);
    float* ssm = states.p + conv_elems;
    const bf16* b = proj.p + conv_dim + v_dim;
    auto fused = [&](int) {
      kernels::launch_gated_delta_net_step({proj.p, proj_stride, conv_w.p, a_log_d.p, dt_bias.p, norm_w.p, states.p,
                                            ssm, state_stride, starts_d.p, slots_d.p, fresh_d.p, nullptr, out.p,
                                            batch, batch, hk, hv, dim, dim, kernel, 1e-6f},
                                           nullptr);
    };
    auto split = [&](int) {
      kernels::launch_causal_conv1d({proj.p, proj_stride, conv_w.p, states.p, state_stride, starts_d.p, slots_d.p,
                                     fresh_d.p, nullptr, conv_out.p, batch, batch, conv_dim, kernel},
                                    nullptr);
      kernels::launch_gated_delta_rule({conv_out.p, b, b + hv, proj_stride, a_log_d.p, dt_bias.p, ssm, state_stride,
                                        starts_d.p, slots_d.p, fresh_d.p, nullptr, out.p, batch, batch, hk, hv,
                                        dim, dim, nullptr},
                                       nullptr);
      kernels::launch_gated_rms_norm({out.p, proj.p + conv_dim, proj_stride, norm_w.p, out.p, batch, hv, dim, 1e-6f},
                                     nullptr);
    };
    const double bytes = 2.0 * batch * state_stride * 4;  // each state read and written
    for (const bool one_kernel : {true, false}) {
      const double ms = one_kernel ? time_ms(fused, quick ? 5 : 20) : time_ms(split, quick ? 5 : 20);
      rep.emit({{"mode", "kernel"}, {"kernel", "gated_delta_net_step"},
                {"form", one_kernel ? "fused" : "conv + recurrence + norm"}, {"seqs", batch},
                {"k_heads", hk}, {"v_heads", hv}, {"head_dim", dim}, {"us", ms * 1e3},
                {"gbps", bytes / (ms * 1e6)}, {"fraction_of_copy", bytes / (ms * 1e6) / c.copy_gbps}});
    }
  }
}

// ---------------------------------------------------------------- end to end
// The sharding of a model-mode run, merged into each of its records.
struct BenchLayout {
  parallel::ParallelConfig parallel;
  int ranks = 1;
  int gpus = 1;  // distinct devices among the ranks'
  nlohmann::json fields() const {
    return {{"tp", parallel.tp}, {"ep", parallel.ep}, {"dp", parallel.dp}, {"ranks", ranks}, {"gpus", gpus}};
  }
  const char* roofline_basis() const { return ranks == 1 ? "one_gpu" : "one_gpu_div_gpus"; }
};

// One "profile" record per shape: each op's device time in one eager forward (CudaBackend::
// profile_forward), summed over the layers — where a step's time goes. Sharded: rank 0's ops.
void emit_profile(Reporter& rep, const BenchLayout& layout, CudaBackend& backend, std::span<const StepSequence> batch,
                  const char* phase, int batch_size, int tokens, int context) {
  const std::vector<OpTiming> ops = backend.profile_forward(batch);
  nlohmann::json j{{"mode", "profile"}, {"phase", phase}, {"batch", batch_size}, {"tokens", tokens}, {"context", context}};
  j.update(layout.fields());
  if (layout.ranks > 1) j["profile_rank"] = 0;
  if (ops.empty()) {  // a rank 0 without sequences (the bench always gives it some)
    j["skipped"] = "rank 0 ran no op of this batch";
    rep.emit(std::move(j));
    return;
  }
  double total = 0.0;
  for (const OpTiming& op : ops) total += op.ms;
  nlohmann::json per_op = nlohmann::json::object();
  for (const OpTiming& op : ops) per_op[op.op] = {{"ms", op.ms}, {"calls", op.calls}, {"share", op.ms / total}};
  j["total_ms"] = total;
  j["ops"] = std::move(per_op);
  rep.emit(std::move(j));
}

// Untimed verify steps before the timed ones (their first steps meet new GEMM shapes).
constexpr int kSpecWarmup = 3;

void bench_model(Reporter& rep, const Ceilings& c, const CudaBenchOptions& o) {
  CudaBackendOptions bo;
  bo.max_draft_tokens = o.spec_tokens;
  bo.forced_draft_acceptance = o.forced_acceptance;
  bo.weights = o.dtype == "fp8" ? WeightFormat::kFp8 : o.dtype == "bf16" ? WeightFormat::kBf16 : WeightFormat::kAuto;
  bo.load_format = parse_load_format(o.load_format);
  bo.max_num_seqs = 256;
  for (int b : o.decode_batches) bo.max_num_seqs = std::max(bo.max_num_seqs, b);
  bo.max_num_tokens = 16384;
  for (int len : o.prefill_lengths) bo.max_num_tokens = std::max(bo.max_num_tokens, len);
  if (o.max_num_tokens > 0) bo.max_num_tokens = o.max_num_tokens;  // the CLI checked it fits the shapes
  bo.max_num_seqs = std::min(bo.max_num_seqs, bo.max_num_tokens);  // a sequence takes a token a step
  bo.parallel = o.parallel;
  bo.devices = o.devices;
  // Hybrid models: a state slot per sequence and draft position on each DP rank (the prefill's
  // sequence takes partition 0's first).
  bo.num_state_slots = bo.max_num_seqs * (1 + o.spec_tokens);
  BenchLayout layout;
  layout.parallel = o.parallel;
  layout.ranks = o.parallel.world_size();
  std::vector<int> devices = o.devices;
  for (int r = static_cast<int>(devices.size()); r < layout.ranks; ++r) devices.push_back(bo.device + r);
  std::sort(devices.begin(), devices.end());
  layout.gpus = static_cast<int>(std::unique(devices.begin(), devices.end()) - devices.begin());
  auto emit = [&](nlohmann::json j) {
    j.update(layout.fields());
    rep.emit(std::move(j));
  };

  CudaBackend backend(o.model_dir, bo);
  const ModelConfig& cfg = backend.config();
  RELAY_CHECK(cfg.is_moe(), "relay bench's model mode expects an MoE checkpoint (Qwen3-MoE, "
              "Qwen3.5-MoE, Qwen3-Next), got ", cfg.architecture);
  const CudaLoadStats& ls = backend.load_stats();
  const int dp = backend.num_kv_partitions();
  const int blocks_per_partition = backend.num_kv_blocks() / dp;
  const int slots_per_partition = backend.num_state_slots() / dp;  // 0 without linear attention
  // Sequence i's state slots: the (i / dp)-th group of 1 + K in its partition i % dp.
  auto state_slots_of = [&](int i) {
    std::vector<int32_t> slots;
    if (slots_per_partition == 0) return slots;
    const int first = (i % dp) * slots_per_partition + (i / dp) * (1 + o.spec_tokens);
    for (int k = 0; k <= o.spec_tokens; ++k) slots.push_back(first + k);
    return slots;
  };
  emit({{"mode", "load"}, {"load_format", o.load_format}, {"fp8_linears", ls.fp8_linears}, {"weight_bytes", ls.weight_bytes}, {"seconds", ls.load_seconds},
        {"gbps", ls.weight_bytes / ls.load_seconds / 1e9}, {"kv_pool_bytes", ls.kv_pool_bytes},
        {"free_bytes_before_kv", ls.free_bytes_before_kv},
        {"kv_fraction_of_free", double(ls.kv_pool_bytes) / ls.free_bytes_before_kv}, {"kv_blocks", backend.num_kv_blocks()},
        {"kv_blocks_per_dp_rank", blocks_per_partition}});
  const ModelCosts mc = model_costs(cfg, ls.fp8_linears > 0 ? 1.0 : 2.0);
  const int bs = backend.block_size();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token_dist(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  SamplingParams greedy;
  greedy.temperature = 0.0f;

  // The shapes asked for, else the defaults; `capped` defaults (prompt lengths, decode batches: a
  // step's tokens) only up to the step capacity, so a smaller --max-num-batched-tokens drops them.
  auto pick = [&](const std::vector<int>& given, std::vector<int> quick, std::vector<int> full,
                  bool capped = true) {
    if (!given.empty()) return given;
    std::vector<int> shapes = o.quick ? quick : full;
    if (capped) std::erase_if(shapes, [&](int v) { return v > bo.max_num_tokens; });
    return shapes;
  };
  for (int len : pick(o.prefill_lengths, {512, 4096}, {512, 4096, 16384})) {
    // Block ids from 0: DP partition 0 (its TP ranks, or under DP one rank, run the prompt).
    std::vector<int32_t> tokens(len), blocks((len + bs - 1) / bs);
    RELAY_CHECK(static_cast<int>(blocks.size()) <= blocks_per_partition, "KV pool too small for a prefill of ", len,
                " tokens: ", blocks.size(), " blocks, ", blocks_per_partition, " per DP rank");
    for (auto& t : tokens) t = token_dist(rng);
    std::iota(blocks.begin(), blocks.end(), 0);
    const std::vector<int32_t> prefill_slots = state_slots_of(0);
    StepSequence s;
    s.seq_id = 1;
    s.tokens = tokens;
    s.block_table = blocks;
    s.sample = true;
    s.sampling = &greedy;
    s.state_slots = prefill_slots;
    std::vector<StepSequence> batch{s};
    // Warm-up (plans, workspaces). Its greedy token is reported: every layout of one model gets
    // the same prompt, so sharded runs are checked against one rank's token.
    const int32_t greedy_token = backend.step(batch).at(0).token;
    std::vector<double> ms;
    for (int r = 0; r < (o.quick ? 2 : 3); ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      backend.step(batch);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double t = ms[ms.size() / 2];
    const double flops = (mc.matmul_flops_per_token + mc.delta_rule_flops_per_token) * len +
                         mc.attn_flops_per_token_pair * (double(len) * (len + 1) / 2);
    const double one_gpu_roof_ms = std::max(flops / (c.gemm_tflops * 1e9), mc.all_weight_bytes / (c.copy_gbps * 1e6));
    const double roof_ms = one_gpu_roof_ms / layout.gpus;
    nlohmann::json j{{"mode", "prefill"}, {"batch", 1}, {"tokens", len}, {"context", len},
                     {"greedy_token", greedy_token}, {"ms_per_step", t},
                     {"tok_per_s", len / (t / 1e3)}, {"tok_per_s_per_gpu", len / (t / 1e3) / layout.gpus},
                     {"tflops", flops / (t * 1e9)}, {"roofline_ms", roof_ms}, {"roofline_fraction", roof_ms / t},
                     {"roofline_basis", layout.roofline_basis()}};
    // FP8's target is a fraction of the FP8 GEMM peak (the bf16 roofline above stays for comparison);
    // per GPU when sharded.
    if (ls.fp8_linears > 0 && c.fp8_gemm_tflops > 0)
      j["fp8_peak_fraction"] = flops / (t * 1e9) / layout.gpus / c.fp8_gemm_tflops;
    emit(std::move(j));
    emit_profile(rep, layout, backend, batch, "prefill", 1, len, len);
  }

  for (int ctx : pick(o.decode_contexts, {512, 4096}, {512, 4096}, /*capped=*/false)) {
    for (int batch_size : pick(o.decode_batches, {1, 64}, {1, 8, 64, 256})) {
      const int warmup = 3, steps = o.quick ? 10 : 30;
      // With drafts (o.spec_tokens), the verify steps below follow, each taking up to 1 + K slots.
      const int spec_slots = o.spec_tokens > 0 ? (kSpecWarmup + steps) * (1 + o.spec_tokens) : 0;
      const int blocks_per_seq = (ctx + warmup + steps + spec_slots + bs) / bs;
      // Sequence i runs in DP partition i % dp, as the (i / dp)-th of its sequences there, so the DP
      // ranks' batches differ by at most one sequence and rank 0 always has one.
      const int seqs_per_partition = (batch_size + dp - 1) / dp;
      RELAY_CHECK(seqs_per_partition * blocks_per_seq <= blocks_per_partition, "KV pool too small for decode batch ",
                  batch_size, " at context ", ctx, ": ", seqs_per_partition, " sequences of ", blocks_per_seq,
                  " blocks in each DP partition of ", blocks_per_partition, " blocks");
      std::vector<std::vector<int32_t>> tables(batch_size), toks(batch_size), slots(batch_size);
      std::vector<int> computed(batch_size, ctx - 1);
      std::vector<int> dp_rank_seqs(dp, 0);
      for (int i = 0; i < batch_size; ++i) {
        const int g = i % dp;
        tables[i].resize(blocks_per_seq);
        std::iota(tables[i].begin(), tables[i].end(), g * blocks_per_partition + (i / dp) * blocks_per_seq);
        toks[i] = {token_dist(rng)};
        slots[i] = state_slots_of(i);
        ++dp_rank_seqs[g];
      }
      // The batch views toks / tables, so it is rebuilt for every step.
      auto make_batch = [&](bool sample) {
        std::vector<StepSequence> batch(batch_size);
        for (int i = 0; i < batch_size; ++i) {
          batch[i].seq_id = i;
          batch[i].tokens = toks[i];
          batch[i].num_computed = computed[i];
          batch[i].block_table = tables[i];
          batch[i].sample = sample;
          batch[i].sampling = sample ? &greedy : nullptr;
          batch[i].state_slots = slots[i];
        }
        return batch;
      };
      auto one_step = [&] {
        auto out = backend.step(make_batch(true));
        for (int i = 0; i < batch_size; ++i) {
          toks[i] = {out[i].token};
          ++computed[i];
        }
      };
      std::vector<int32_t> first_tokens;
      for (int i = 0; i < warmup; ++i) {
        one_step();
        if (i == 0) {
          for (int q = 0; q < std::min(batch_size, 8); ++q) first_tokens.push_back(toks[q][0]);
        }
      }
      emit_profile(rep, layout, backend, make_batch(false), "decode", batch_size, batch_size, ctx);
      const int ctx_start = computed[0] + 1;
      double device_ms = 0.0;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) {
        one_step();
        device_ms += backend.last_step_device_ms();
      }
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
      device_ms /= steps;
      const double active = mc.experts * (1.0 - std::pow(1.0 - double(mc.top_k) / mc.experts, batch_size));
      const double avg_ctx = ctx_start + (steps - 1) / 2.0;
      // A hybrid's recurrent state is read and written once per sequence and step.
      const double bytes = mc.attn_weight_bytes + active * mc.expert_bytes + mc.lm_head_bytes +
                           batch_size * (avg_ctx * mc.kv_bytes_per_token + 2 * mc.state_bytes);
      const double roof_ms = bytes / (c.copy_gbps * 1e6) / layout.gpus;
      const double read_roof_ms = bytes / (c.read_gbps * 1e6) / layout.gpus;
      nlohmann::json j{{"mode", "decode"}, {"batch", batch_size}, {"tokens", batch_size}, {"context", ctx},
                       {"ms_per_step", t}, {"tok_per_s", batch_size / (t / 1e3)},
                       {"tok_per_s_per_gpu", batch_size / (t / 1e3) / layout.gpus}, {"bytes_per_step", bytes},
                       {"experts_touched", active}, {"roofline_ms", roof_ms}, {"roofline_fraction", roof_ms / t},
                       {"read_roofline_ms", read_roof_ms}, {"read_roofline_fraction", read_roof_ms / t},
                       {"roofline_basis", layout.roofline_basis()}, {"device_ms_per_step", device_ms},
                       {"host_overhead_fraction", 1.0 - device_ms / t}};
      if (dp > 1) j["dp_rank_seqs"] = dp_rank_seqs;
      // The greedy tokens of the first sequences after the first and the last step, to check
      // layouts against one rank (the first: one step's bf16 noise; the last compounds it over
      // every step, and sequences other than the first decode over never-written KV pages, whose
      // dummy-weight logits are close to ties).
      j["first_greedy_tokens"] = first_tokens;
      j["greedy_tokens"] = std::vector<int32_t>();
      for (int i = 0; i < std::min(batch_size, 8); ++i) j["greedy_tokens"].push_back(toks[i][0]);
      const double plain_tok_per_s = batch_size / (t / 1e3);
      emit(std::move(j));
      if (o.spec_tokens == 0) continue;

      // Verify steps: each sequence brings K random drafts after its last token (what the n-gram
      // proposer or an MTP head would bring), the backend samples 1 + K rows and commits the
      // accepted drafts and the token after them. Random drafts are accepted only by
      // o.forced_acceptance (the backend's forced_draft_acceptance), which sets the rate.
      const int K = o.spec_tokens;
      std::vector<std::vector<int32_t>> with_drafts(batch_size);
      uint64_t committed = 0, accepted = 0;
      auto spec_step = [&] {
        std::vector<StepSequence> batch(batch_size);
        for (int i = 0; i < batch_size; ++i) {
          with_drafts[i] = toks[i];
          for (int k = 0; k < K; ++k) with_drafts[i].push_back(token_dist(rng));
          batch[i].seq_id = i;
          batch[i].tokens = with_drafts[i];
          batch[i].num_computed = computed[i];
          batch[i].block_table = tables[i];
          batch[i].sample = true;
          batch[i].sampling = &greedy;
          batch[i].num_draft_tokens = K;
          batch[i].sample_index = static_cast<uint64_t>(computed[i]);
          batch[i].state_slots = slots[i];
        }
        const std::vector<SampledToken> out = backend.step(batch);
        size_t at = 0;
        for (int i = 0; i < batch_size; ++i) {
          size_t n = 0;
          while (at + n < out.size() && out[at + n].seq_id == i) ++n;
          RELAY_CHECK(n >= 1 && n <= static_cast<size_t>(K) + 1, "verify step returned ", n,
                      " tokens for sequence ", i);
          computed[i] += static_cast<int>(n);  // the last token and the accepted drafts
          toks[i] = {out[at + n - 1].token};
          committed += n;
          accepted += n - 1;
          at += n;
        }
      };
      for (int i = 0; i < kSpecWarmup; ++i) spec_step();
      committed = accepted = 0;
      double spec_device_ms = 0.0;
      const auto s0 = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) {
        spec_step();
        spec_device_ms += backend.last_step_device_ms();
      }
      const double st = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count() / steps;
      const double spec_tok_per_s = committed / (st * steps / 1e3);
      nlohmann::json sj{{"mode", "decode_spec"}, {"batch", batch_size}, {"context", ctx},
                        {"num_speculative_tokens", K},
                        {"forced_acceptance", o.forced_acceptance ? nlohmann::json(*o.forced_acceptance) : nullptr},
                        {"acceptance_rate", double(accepted) / (double(steps) * batch_size * K)},
                        {"mean_acceptance_length", double(committed) / (double(steps) * batch_size)},
                        {"ms_per_step", st}, {"device_ms_per_step", spec_device_ms / steps},
                        {"host_overhead_fraction", 1.0 - spec_device_ms / steps / st},
                        {"tok_per_s", spec_tok_per_s}, {"tok_per_s_per_gpu", spec_tok_per_s / layout.gpus},
                        {"speedup_vs_decode", spec_tok_per_s / plain_tok_per_s}};
      if (dp > 1) sj["dp_rank_seqs"] = dp_rank_seqs;
      emit(std::move(sj));
    }
  }
}

// FP8 against bf16 on the same checkpoint: next-token distributions at every position of a few
// random-token prompts (teacher-forced), top-1 agreement and KL(p_bf16 || p_fp8) in nats. The two
// backends are loaded one after the other with a small KV pool, so both fit beside nothing else.
void bench_accuracy(Reporter& rep, const CudaBenchOptions& o) {
  constexpr int kPrompts = 4, kLen = 128;
  std::vector<std::vector<float>> logits[2];
  int vocab = 0;
  for (int pass = 0; pass < 2; ++pass) {
    CudaBackendOptions bo;
    bo.weights = pass == 0 ? WeightFormat::kBf16 : WeightFormat::kFp8;
    bo.max_num_seqs = kLen;  // forward_logits computes the lm_head max_num_seqs rows at a time
    bo.max_num_tokens = kLen;
    bo.num_kv_blocks = 64;
    CudaBackend backend(o.model_dir, bo);
    vocab = static_cast<int>(backend.config().vocab_size);
    std::mt19937 rng(11);
    std::uniform_int_distribution<int32_t> token_dist(0, vocab - 1);
    for (int p = 0; p < kPrompts; ++p) {
      std::vector<int32_t> tokens(kLen), blocks((kLen + backend.block_size() - 1) / backend.block_size());
      for (auto& t : tokens) t = token_dist(rng);
      std::iota(blocks.begin(), blocks.end(), 0);
      StepSequence s;
      s.seq_id = p;
      s.tokens = tokens;
      s.block_table = blocks;
      std::vector<StepSequence> batch{s};
      logits[pass].push_back(backend.forward_logits(batch, CudaBackend::LogitRows::kAllTokens));
    }
  }
  int agree = 0, rows = 0;
  double kl_sum = 0.0, kl_max = 0.0;
  auto log_softmax = [&](const float* z, std::vector<double>& out) {
    const double mx = *std::max_element(z, z + vocab);
    double sum = 0.0;
    for (int v = 0; v < vocab; ++v) sum += std::exp(z[v] - mx);
    const double lse = mx + std::log(sum);
    for (int v = 0; v < vocab; ++v) out[v] = z[v] - lse;
  };
  std::vector<double> lp(vocab), lq(vocab);
  for (int p = 0; p < kPrompts; ++p) {
    for (int r = 0; r < kLen; ++r) {
      const float* zp = logits[0][p].data() + size_t(r) * vocab;
      const float* zq = logits[1][p].data() + size_t(r) * vocab;
      log_softmax(zp, lp);
      log_softmax(zq, lq);
      double kl = 0.0;
      for (int v = 0; v < vocab; ++v) kl += std::exp(lp[v]) * (lp[v] - lq[v]);
      kl_sum += kl;
      kl_max = std::max(kl_max, kl);
      agree += std::max_element(zp, zp + vocab) - zp == std::max_element(zq, zq + vocab) - zq;
      ++rows;
    }
  }
  rep.emit({{"mode", "accuracy"}, {"reference", "bf16"}, {"dtype", "fp8"}, {"positions", rows},
            {"top1_agreement", double(agree) / rows}, {"mean_kl", kl_sum / rows}, {"max_kl", kl_max}});
}

}  // namespace

int run_cuda_bench(const CudaBenchOptions& o) {
  RELAY_CHECK(o.mode == "all" || o.mode == "ceilings" || o.mode == "kernels" || o.mode == "model" ||
                  o.mode == "collectives" || o.mode == "accuracy",
              "bench mode '", o.mode, "' is not one of all, ceilings, kernels, model, collectives, accuracy");
  RELAY_CHECK(o.mode != "accuracy" || !o.model_dir.empty(), "bench --mode accuracy needs --model DIR");
  RELAY_CHECK(o.mode == "model" || (o.parallel.world_size() == 1 && o.parallel.ep == 1 && o.devices.empty()),
              "bench: --tp, --ep, --dp and --gpus (", o.parallel.describe(), ") apply to --mode model only, not --mode ",
              o.mode);
  Ceilings c = measure_ceilings(o.quick);
  const bool kernels = o.mode == "all" || o.mode == "kernels";
  if (kernels || o.dtype == "fp8") c.fp8_gemm_tflops = measure_fp8_gemm_peak_tflops();
  Reporter rep(o, c);
  rep.emit({{"mode", "ceilings"}});
  if (kernels) {
    bench_launch_floor(rep, o.quick);
    bench_grouped_gemm(rep, c, o.quick);
    bench_dense_decode(rep, c, o.quick);
    bench_attention(rep, c, o.quick);
    bench_decode_splits(rep, c, o.quick);
    bench_moe_routing(rep, c, o.quick);
    bench_gated_delta_rule(rep, c, o.quick);
    bench_gated_delta_net_step(rep, c, o.quick);
    for (auto& j : run_fp8_kernel_bench(c.copy_gbps, c.fp8_gemm_tflops, o.quick)) rep.emit(std::move(j));
  }
  if (o.mode == "accuracy") bench_accuracy(rep, o);
  if (o.mode == "collectives") {
    parallel::cuda::CollectiveBenchOptions co;
    co.num_ranks = o.ranks;
    if (o.quick) co.iterations = 20;
    parallel::cuda::run_collective_bench(co, [&](const nlohmann::json& j) {
      nlohmann::json r = j;
      r["mode"] = "collective";
      rep.emit(std::move(r));
    });
  }
  if (o.mode == "all" || o.mode == "model") {
    if (o.model_dir.empty()) {
      RELAY_CHECK(o.mode != "model", "bench --mode model needs --model DIR");
      std::cerr << "relay bench: no --model given; skipping prefill/decode\n";
    } else {
      bench_model(rep, c, o);
    }
  }
  return 0;
}

}  // namespace relay

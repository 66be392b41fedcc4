// See fp8_kernel_bench.h. Timings are medians of CUDA-event-timed repetitions after a warm-up, as
// in cuda_bench.cu; operands are random e4m3 codes (never NaN) with random positive scales, and
// weight copies rotate where the active experts would otherwise sit in L2 (50 MB). Bytes for the
// decode figures are the weights read (1 byte per element; scales and activations are < 1% of
// them).
#include "engine/fp8_kernel_bench.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_cuda.h"

namespace relay {

using kernels::bf16;
using kernels::GroupedGemmKind;

namespace {

#define FP8_BENCH_CUBLAS(call)                                                   \
  do {                                                                           \
    cublasStatus_t status_ = (call);                                             \
    RELAY_CHECK(status_ == CUBLAS_STATUS_SUCCESS, #call, " failed with status ", \
                static_cast<int>(status_));                                      \
  } while (0)

__device__ uint64_t mix(uint64_t i, uint64_t seed) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Random e4m3 codes; the two NaN codes become ±448.
__global__ void fill_e4m3_kernel(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint8_t c = static_cast<uint8_t>(mix(i, seed) >> 32);
    if ((c & 0x7F) == 0x7F) c ^= 1;
    p[i] = c;
  }
}

// Random values in [lo, hi).
template <typename T>
__global__ void fill_uniform_kernel(T* p, size_t n, uint64_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    p[i] = static_cast<T>(lo + (hi - lo) * static_cast<float>(mix(i, seed) >> 40) / 16777216.0f);
  }
}

template <typename T>
struct DevBuf {
  T* p = nullptr;
  explicit DevBuf(size_t n) {
    RELAY_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(DevBuf&& o) noexcept : p(o.p) { o.p = nullptr; }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

DevBuf<uint8_t> random_e4m3(size_t n, uint64_t seed) {
  DevBuf<uint8_t> b(n);
  fill_e4m3_kernel<<<1024, 256>>>(b.p, n, seed);
  RELAY_CUDA_CHECK_LAUNCH("fill_e4m3_kernel");
  return b;
}

template <typename T>
DevBuf<T> random_uniform(size_t n, uint64_t seed, float lo, float hi) {
  DevBuf<T> b(n);
  fill_uniform_kernel<T><<<1024, 256>>>(b.p, n, seed, lo, hi);
  RELAY_CUDA_CHECK_LAUNCH("fill_uniform_kernel");
  return b;
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

DevBuf<int32_t> upload_offsets(const std::vector<int32_t>& v) {
  DevBuf<int32_t> b(v.size());
  RELAY_CUDA_CHECK(cudaMemcpy(b.p, v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  return b;
}


int blocks128(int v) { return (v + 127) / 128; }

// A block-scaled operand set: x [rows, k] with its scales, `copies` rotations of w [E, n, k].
struct Fp8Problem {
  int rows, experts, n, k, copies;
  size_t w_elems, ws_elems;
  DevBuf<uint8_t> x, w;
  DevBuf<float> xs, ws;
  DevBuf<bf16> out;
  Fp8Problem(int rows_, int experts_, int n_, int k_, int copies_)
      : rows(rows_),
        experts(experts_),
        n(n_),
        k(k_),
        copies(copies_),
        w_elems(size_t(experts_) * n_ * k_),
        ws_elems(size_t(experts_) * blocks128(n_) * blocks128(k_)),
        x(random_e4m3(size_t(rows_) * k_, 11)),
        w(random_e4m3(w_elems * copies_, 12)),
        xs(random_uniform<float>(size_t(rows_) * blocks128(k_), 13, 0.5e-2f, 1.5e-2f)),
        ws(random_uniform<float>(ws_elems * copies_, 14, 0.5e-3f, 1.5e-3f)),
        out(size_t(rows_) * n_) {}
  kernels::Fp8BlockGroupedMatmulParams<bf16> grouped(const int32_t* offsets, int rep) const {
    const int c = rep % copies;
    return {x.p, xs.p, w.p + c * w_elems, ws.p + c * ws_elems, offsets, out.p, rows, experts, n, k};
  }
  kernels::Fp8BlockMatmulParams<bf16> dense(int rep) const {
    const int c = rep % copies;
    return {x.p, xs.p, w.p + c * w_elems, ws.p + c * ws_elems, out.p, rows, n, k};
  }
};

void bench_prefill(std::vector<nlohmann::json>& out, double peak, bool quick) {
  std::mt19937 rng(5);
  const int experts = 128, tokens = 4096, top_k = 8, rows = tokens * top_k;
  struct Shape {
    const char* name;
    int n, k;
  };
  for (Shape s : {Shape{"gate_up", 1536, 2048}, Shape{"down", 2048, 768}}) {
    Fp8Problem prob(rows, experts, s.n, s.k, 1);
    const DevBuf<int32_t> off = upload_offsets(random_offsets(tokens, experts, top_k, rng));
    const double flops = 2.0 * rows * double(s.n) * s.k;
    for (auto kind :
         {GroupedGemmKind::Tiled, GroupedGemmKind::CutlassCooperative, GroupedGemmKind::Auto}) {
      const double ms = time_ms(
          [&](int i) {
            kernels::launch_fp8_block_grouped_matmul(prob.grouped(off.p, i), kind, nullptr);
          },
          quick ? 5 : 20);
      out.push_back({{"mode", "kernel"},
                     {"kernel", "fp8_grouped_gemm_prefill"},
                     {"shape", s.name},
                     {"variant", kernels::grouped_gemm_kind_name(kind)},
                     {"tokens", tokens},
                     {"rows", rows},
                     {"n", s.n},
                     {"k", s.k},
                     {"ms", ms},
                     {"tflops", flops / (ms * 1e9)},
                     {"fp8_peak_tflops", peak},
                     {"fraction_of_peak", flops / (ms * 1e9) / peak}});
    }
  }
}

void bench_decode(std::vector<nlohmann::json>& out, double copy_gbps, bool quick) {
  const int experts = 128;
  struct Decode {
    const char* name;
    int n, k, active, rows_per_expert;
  };
  std::vector<Decode> shapes = {
      {"235b_gate_up_128x1", 3072, 4096, 128, 1}, {"235b_gate_up_16x1", 3072, 4096, 16, 1},
      {"235b_gate_up_8x1", 3072, 4096, 8, 1},     {"30b_gate_up_8x1", 1536, 2048, 8, 1},
      {"30b_down_8x1", 2048, 768, 8, 1},          {"30b_gate_up_128x4", 1536, 2048, 128, 4},
      {"30b_gate_up_128x16", 1536, 2048, 128, 16}};
  if (quick) shapes.resize(3);
  for (const Decode& d : shapes) {
    std::vector<int32_t> offsets(experts + 1, 0);
    // The active experts spread evenly over the ids.
    for (int i = 0; i < d.active; ++i) offsets[i * (experts / d.active) + 1] = d.rows_per_expert;
    for (int e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
    // Several weight copies rotate so the 8-16 expert cases do not run from L2.
    Fp8Problem prob(offsets[experts], experts, d.n, d.k, d.active <= 16 ? 4 : 1);
    const DevBuf<int32_t> off = upload_offsets(offsets);
    const double bytes = double(d.active) * d.n * d.k;
    for (auto kind : {GroupedGemmKind::Streaming, GroupedGemmKind::Tiled,
                      GroupedGemmKind::CutlassCooperative, GroupedGemmKind::Auto}) {
      const double ms = time_ms(
          [&](int i) {
            kernels::launch_fp8_block_grouped_matmul(prob.grouped(off.p, i), kind, nullptr);
          },
          quick ? 10 : 50);
      out.push_back({{"mode", "kernel"},
                     {"kernel", "fp8_grouped_gemm_decode"},
                     {"shape", d.name},
                     {"variant", kernels::grouped_gemm_kind_name(kind)},
                     {"rows", prob.rows},
                     {"n", d.n},
                     {"k", d.k},
                     {"active_experts", d.active},
                     {"ms", ms},
                     {"gbps", bytes / (ms * 1e6)},
                     {"fraction_of_copy", bytes / (ms * 1e6) / copy_gbps}});
    }
  }
}

void bench_dense(std::vector<nlohmann::json>& out, double copy_gbps, double peak, bool quick) {
  const int n = 4096, k = 2048;
  for (int m : {4096, 64, 1}) {
    for (bool lt : {false, true}) {
      if (lt && !kernels::fp8_block_matmul_cublaslt_supported(m, n, k)) continue;
      Fp8Problem prob(m, 1, n, k, m <= 64 ? 8 : 1);
      // Values do not matter for timing: any [ceil(k / 128), n] buffer serves as row scales.
      DevBuf<float> row_scales(size_t(blocks128(k)) * n);
      // The scale values are random either way; only their layout flag differs.
      const double ms = time_ms(
          [&](int i) {
            kernels::Fp8BlockMatmulParams<bf16> p = prob.dense(i);
            p.x_scale_group_major = lt;
            if (lt) {
              kernels::launch_fp8_block_matmul_cublaslt(p, row_scales.p, nullptr);
            } else {
              kernels::launch_fp8_block_matmul(p, nullptr);
            }
          },
          quick ? 10 : 50);
      const double flops = 2.0 * m * double(n) * k, bytes = double(n) * k;
      nlohmann::json j = {{"mode", "kernel"}, {"kernel", "fp8_dense_gemm"},
                          {"m", m},           {"n", n},
                          {"k", k},           {"variant", lt ? "cublaslt" : "relay"},
                          {"ms", ms},         {"tflops", flops / (ms * 1e9)}};
      if (m <= 64) {
        j["gbps"] = bytes / (ms * 1e6);
        j["fraction_of_copy"] = bytes / (ms * 1e6) / copy_gbps;
      } else {
        j["fp8_peak_tflops"] = peak;
        j["fraction_of_peak"] = flops / (ms * 1e9) / peak;
      }
      out.push_back(j);
    }
  }
}

// The activation quantisers at the prefill shapes: bytes read (bf16) + written (e4m3 + scales).
void bench_quant(std::vector<nlohmann::json>& out, double copy_gbps, bool quick) {
  const int rows = 4096 * 8, k = 2048, width = 768;
  DevBuf<bf16> x = random_uniform<bf16>(size_t(rows) * 2 * k, 15, -2.0f, 2.0f);
  DevBuf<uint8_t> q(size_t(rows) * k);
  DevBuf<float> s(size_t(rows) * blocks128(k));
  const int reps = quick ? 5 : 20;
  const double act_ms = time_ms(
      [&](int) {
        kernels::launch_fp8_act_quant({x.p, q.p, s.p, rows, k, 128}, nullptr);
      },
      reps);
  const double act_bytes = double(rows) * k * 3 + double(rows) * blocks128(k) * 4;
  const double swiglu_ms = time_ms(
      [&](int) {
        kernels::launch_swiglu_fp8_quant({x.p, q.p, s.p, rows, width}, nullptr);
      },
      reps);
  const double swiglu_bytes = double(rows) * width * 5 + double(rows) * blocks128(width) * 4;
  out.push_back({{"mode", "kernel"},
                 {"kernel", "fp8_act_quant"},
                 {"rows", rows},
                 {"k", k},
                 {"ms", act_ms},
                 {"gbps", act_bytes / (act_ms * 1e6)},
                 {"fraction_of_copy", act_bytes / (act_ms * 1e6) / copy_gbps}});
  out.push_back({{"mode", "kernel"},
                 {"kernel", "swiglu_fp8_quant"},
                 {"rows", rows},
                 {"width", width},
                 {"ms", swiglu_ms},
                 {"gbps", swiglu_bytes / (swiglu_ms * 1e6)},
                 {"fraction_of_copy", swiglu_bytes / (swiglu_ms * 1e6) / copy_gbps}});
}

}  // namespace

double measure_fp8_gemm_peak_tflops() {
  const int n = 8192;
  DevBuf<uint8_t> a = random_e4m3(size_t(n) * n, 1), b = random_e4m3(size_t(n) * n, 2);
  DevBuf<bf16> d(size_t(n) * n);
  DevBuf<float> one = random_uniform<float>(1, 3, 1.0f, 1.0f);
  const size_t workspace_bytes = size_t{32} << 20;
  DevBuf<uint8_t> workspace(workspace_bytes);
  cublasLtHandle_t handle;
  FP8_BENCH_CUBLAS(cublasLtCreate(&handle));
  cublasLtMatmulDesc_t desc;
  FP8_BENCH_CUBLAS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // NOTE: cuBLASLt's FP8 kernels need the "TN" form: A transposed, B not (both k-contiguous).
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  FP8_BENCH_CUBLAS(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  FP8_BENCH_CUBLAS(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  const float* scale = one.p;
  FP8_BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                  &scale, sizeof(scale)));
  FP8_BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                  &scale, sizeof(scale)));
  cublasLtMatrixLayout_t la, lb, lc;
  FP8_BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, n, n, n));
  FP8_BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, n, n, n));
  FP8_BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, n, n));
  cublasLtMatmulPreference_t pref;
  FP8_BENCH_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  FP8_BENCH_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  FP8_BENCH_CUBLAS(
      cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, 1, &result, &found));
  RELAY_CHECK(found > 0, "cuBLASLt has no FP8 e4m3 algorithm for an ", n, "^3 GEMM");
  const float alpha = 1.0f, beta = 0.0f;
  const double ms = time_ms(
      [&](int) {
        FP8_BENCH_CUBLAS(cublasLtMatmul(handle, desc, &alpha, a.p, la, b.p, lb, &beta, d.p, lc, d.p,
                                        lc, &result.algo, workspace.p, workspace_bytes, nullptr));
      },
      10);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(handle);
  return 2.0 * n * double(n) * n / (ms * 1e9);
}

std::vector<nlohmann::json> run_fp8_kernel_bench(double copy_gbps, double fp8_peak_tflops,
                                                 bool quick) {
  std::vector<nlohmann::json> out;
  bench_prefill(out, fp8_peak_tflops, quick);
  bench_decode(out, copy_gbps, quick);
  bench_dense(out, copy_gbps, fp8_peak_tflops, quick);
  bench_quant(out, copy_gbps, quick);
  return out;
}

}  // namespace relay

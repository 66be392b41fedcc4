// Dense GEMMs through cuBLASLt: every bf16 linear layer over more rows than the weight-streaming
// kernel takes (streaming_gemm.cu; launch_matmul picks), the block-scaled FP8 dense projections
// (fp8_cuda.h) and the LM head (fp32 logits).
//
// Row-major out[m, n] = x[m, k] @ w[n, k]^T is, in cuBLAS's column-major terms, out^T = w x^T with
// w transposed: A = w (k x n, transposed), B = x (k x m), C = out (n x m). A plan (descriptors plus
// an algorithm) is built once per (m, n, k, output type, bias) and cached; the 32 MiB workspace is
// allocated once, so launches are capturable in CUDA graphs. The LM head first gathers the rows
// that sample into a contiguous buffer (a no-op copy in decode, where every row samples).
//
// The algorithm for m rows is the heuristic's choice for bucket_rows(m), the next power of two, so
// the cuBLASLt kernels a process can launch are one per (bucket, n, k, ...). The first launch of a
// cuBLASLt kernel loads it, and that load waits for the whole device: under DP + EP a rank's peer
// may then be spinning in a collective for this rank, which never comes (issue 23: a 512-token
// prefill hung while warm-up had run 1, 16, 256 and 2048 rows). The sharded backend's warm-up
// runs every bucket up to its step capacity, so a step never meets an unloaded kernel.
#include <cublasLt.h>

#include <cstdio>

#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_cuda.h"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

#define RELAY_CUBLAS_CHECK(call)                                                               \
  do {                                                                                         \
    cublasStatus_t relay_cublas_status_ = (call);                                              \
    RELAY_CHECK(relay_cublas_status_ == CUBLAS_STATUS_SUCCESS, #call, " failed with status ", \
                static_cast<int>(relay_cublas_status_));                                       \
  } while (0)

constexpr size_t kWorkspaceBytes = 32u << 20;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// A cuBLASLt handle and workspace per stream (per_stream): GEMMs on one stream are ordered and
// share them; the ranks of a sharded backend, on their own streams, each have their own.
struct LtContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  LtContext() { RELAY_CUBLAS_CHECK(cublasLtCreate(&handle)); }
  // The workspace is allocated in stream order on first use (see DeviceWorkspace).
  static LtContext& get(cudaStream_t s) {
    LtContext& c = per_stream<LtContext>(s);
    if (c.workspace == nullptr) RELAY_CUDA_CHECK(cudaMallocAsync(&c.workspace, kWorkspaceBytes, s));
    return c;
  }
};

// A descriptor for out^T = w x^T (A = w transposed, B = x; see the file comment), fp32 compute.
cublasLtMatmulDesc_t tn_desc() {
  cublasLtMatmulDesc_t desc = nullptr;
  RELAY_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  return desc;
}

int bucket_rows(int m) {
  int b = 1;
  while (b < m) b *= 2;
  return b;
}

// Picks plan's algorithm for m rows (B and C of plan laid out for m; `in` and `out` their types):
// the heuristic's best for bucket_rows(m) rows that cublasLtMatmulAlgoCheck accepts at m within the
// workspace. Only if none does, the heuristic's best for m itself (a kernel the warm-up may not have
// loaded; no shape Relay runs has needed it). NOT_SUPPORTED when there is no algorithm at all.
cublasStatus_t choose_algo(Plan& plan, cudaDataType_t in, cudaDataType_t out, int m, int n, int k) {
  // Heuristics and checks depend on the device, not the stream: the current device's default-stream context.
  const cublasLtHandle_t handle = LtContext::get(nullptr).handle;
  cublasLtMatmulPreference_t pref;
  RELAY_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  RELAY_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &kWorkspaceBytes, sizeof(kWorkspaceBytes)));
  const auto best_for = [&](cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, int wanted,
                            cublasLtMatmulHeuristicResult_t* results, int* found) {
    return cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.a, b, c, c, pref, wanted, results, found);
  };
  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  const int bucket = bucket_rows(m);
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  bool chosen = false;
  if (bucket == m) {
    st = best_for(plan.b, plan.c, 1, results, &found);
    if (st == CUBLAS_STATUS_SUCCESS && found > 0) plan.algo = results[0].algo, chosen = true;
  } else {
    cublasLtMatrixLayout_t b = nullptr, c = nullptr;
    RELAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, in, k, bucket, k));
    RELAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, out, n, bucket, n));
    st = best_for(b, c, kCandidates, results, &found);
    for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < found && !chosen; ++i) {
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(handle, plan.desc, plan.a, plan.b, plan.c, plan.c, &results[i].algo, &check) ==
              CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= kWorkspaceBytes) {
        plan.algo = results[i].algo, chosen = true;
      }
    }
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    if (!chosen) {
      st = best_for(plan.b, plan.c, 1, results, &found);
      if (st == CUBLAS_STATUS_SUCCESS && found > 0) plan.algo = results[0].algo, chosen = true;
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  return chosen ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
}

class Blas {
 public:
  static Blas& get() {
    static Blas blas;
    return blas;
  }

  void gemm(const bf16* x, const bf16* w, const bf16* bias, void* out, bool out_f32, int m, int n, int k,
            cudaStream_t s) {
    const Plan& plan = plan_for(m, n, k, out_f32, bias != nullptr);
    // The cached descriptor takes this call's bias pointer: set and enqueue under the lock, as
    // ranks on other threads use the same plan.
    std::lock_guard<std::mutex> lock(mutex_);
    if (bias) {
      RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                        sizeof(bias)));
    }
    const float alpha = 1.0f, beta = 0.0f;
    const LtContext& lt = LtContext::get(s);
    RELAY_CUBLAS_CHECK(cublasLtMatmul(lt.handle, plan.desc, &alpha, w, plan.a, x, plan.b, &beta, out, plan.c, out,
                                      plan.c, &plan.algo, lt.workspace, kWorkspaceBytes, s));
  }

 private:
  const Plan& plan_for(int m, int n, int k, bool out_f32, bool bias) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto key = std::make_tuple(m, n, k, out_f32, bias);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    Plan plan;
    plan.desc = tn_desc();
    if (bias) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                        sizeof(epilogue)));
      const cudaDataType_t bias_type = CUDA_R_16BF;
      RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                        sizeof(bias_type)));
    }
    RELAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_16BF, k, n, k));
    RELAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_16BF, k, m, k));
    const cudaDataType_t out = out_f32 ? CUDA_R_32F : CUDA_R_16BF;
    RELAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, out, n, m, n));
    const cublasStatus_t st = choose_algo(plan, CUDA_R_16BF, out, m, n, k);
    RELAY_CHECK(st == CUBLAS_STATUS_SUCCESS, "cuBLASLt has no algorithm for a bf16 GEMM of m ", m, " n ", n, " k ",
                k, " (status ", static_cast<int>(st), ")");
    return plans_.emplace(key, plan).first->second;
  }

  std::mutex mutex_;
  std::map<std::tuple<int, int, int, bool, bool>, Plan> plans_;
};

// Block-scaled FP8 (DeepSeek recipe) through cuBLASLt: A = w (e4m3, k x n transposed), B = x
// (e4m3, k x m, one fp32 scale per 1 x 128 group, token-contiguous), D bf16. A's scales are the
// checkpoint's 128 x 128 blocks (BLK128x128_32F, row pitch ceil(k / 128)) where cuBLASLt has an
// algorithm for that pairing, else the same values repeated for each of a block's 128 rows
// (VEC128_32F, [ceil(k / 128), n]) — an identical product. The plan records which. The scale
// pointers are per call, set on the cached descriptor before each launch as the bias is above.
struct Fp8Plan {
  Plan plan;
  bool row_scales = false;  // A scaled 1 x 128 (VEC128) rather than 128 x 128
};

class Fp8Blas {
 public:
  static Fp8Blas& get() {
    static Fp8Blas blas;
    return blas;
  }

  // The plan for (m, n, k), or null when cuBLASLt has no algorithm for it (cached either way).
  const Fp8Plan* plan_for(int m, int n, int k) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto key = std::make_tuple(m, n, k);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second.plan.desc ? &it->second : nullptr;
    cublasStatus_t status[2] = {CUBLAS_STATUS_SUCCESS, CUBLAS_STATUS_SUCCESS};
    for (bool row_scales : {false, true}) {
      if (std::optional<Plan> plan = try_plan(m, n, k, row_scales, &status[row_scales])) {
        if (!reported_supported_) {  // once per process: which weight-scale form cuBLASLt takes
          std::fprintf(stderr, "relay: cuBLASLt block-scaled FP8 GEMMs take %s weight scales (first at m %d n %d k %d)\n",
                       row_scales ? "per-row 1x128" : "128x128 block", m, n, k);
          reported_supported_ = true;
        }
        return &plans_.emplace(key, Fp8Plan{*plan, row_scales}).first->second;
      }
    }
    if (!reported_unsupported_) {  // once per process: decode batch sizes would repeat it
      std::fprintf(stderr,
                   "relay: cuBLASLt has no block-scaled FP8 GEMM for m %d n %d k %d (heuristic status %d / %d "
                   "for 128x128 / 1x128 weight scales); Relay's own kernel runs such shapes\n",
                   m, n, k, static_cast<int>(status[0]), static_cast<int>(status[1]));
      reported_unsupported_ = true;
    }
    plans_.emplace(key, Fp8Plan{});  // remembered as unsupported
    return nullptr;
  }

  void gemm(const Fp8BlockMatmulParams<bf16>& p, const float* w_row_scale, cudaStream_t s) {
    const Fp8Plan* fp = plan_for(p.m, p.n, p.k);
    RELAY_CHECK(fp != nullptr, "cuBLASLt has no block-scaled FP8 algorithm for m ", p.m, " n ", p.n, " k ", p.k,
                " (ask fp8_block_matmul_cublaslt_supported first)");
    RELAY_CHECK(!fp->row_scales || w_row_scale != nullptr, "fp8_block_matmul_cublaslt: cuBLASLt takes the weight ",
                "scales per row (1 x 128) for m ", p.m, " n ", p.n, " k ", p.k, ", and none were given");
    const Plan& plan = fp->plan;
    std::lock_guard<std::mutex> lock(mutex_);  // the descriptor takes this call's scale pointers
    const void* a_scale = fp->row_scales ? w_row_scale : p.w_scale;
    const void* b_scale = p.x_scale;
    RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale,
                                                      sizeof(a_scale)));
    RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale,
                                                      sizeof(b_scale)));
    const float alpha = 1.0f, beta = 0.0f;
    const LtContext& lt = LtContext::get(s);
    RELAY_CUBLAS_CHECK(cublasLtMatmul(lt.handle, plan.desc, &alpha, p.w, plan.a, p.x, plan.b, &beta, p.out, plan.c,
                                      p.out, plan.c, &plan.algo, lt.workspace, kWorkspaceBytes, s));
  }

 private:
  // `status`: choose_algo's answer.
  std::optional<Plan> try_plan(int m, int n, int k, bool row_scales, cublasStatus_t* status) {
    Plan plan;
    plan.desc = tn_desc();
    const cublasLtMatmulMatrixScale_t a_mode =
                                          row_scales ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                                     : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                      b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
    RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
    // NOTE: set before the heuristic too (the real pointers replace them per call): a null scale
    // pointer can make cuBLASLt treat the operand as unscaled when it picks algorithms.
    const void* placeholder = LtContext::get(nullptr).workspace;
    RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &placeholder,
                                                      sizeof(placeholder)));
    RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &placeholder,
                                                      sizeof(placeholder)));
    RELAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_8F_E4M3, k, n, k));
    RELAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_8F_E4M3, k, m, k));
    RELAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, CUDA_R_16BF, n, m, n));
    *status = choose_algo(plan, CUDA_R_8F_E4M3, CUDA_R_16BF, m, n, k);
    if (*status != CUBLAS_STATUS_SUCCESS) {
      cublasLtMatrixLayoutDestroy(plan.a);
      cublasLtMatrixLayoutDestroy(plan.b);
      cublasLtMatrixLayoutDestroy(plan.c);
      cublasLtMatmulDescDestroy(plan.desc);
      return std::nullopt;
    }
    return plan;
  }

  std::mutex mutex_;
  std::map<std::tuple<int, int, int>, Fp8Plan> plans_;
  bool reported_unsupported_ = false, reported_supported_ = false;
};

bool fp8_cublaslt_shape_ok(int n, int k) {
  return n > 0 && k > 0 && n % 16 == 0 && k % 16 == 0 && ceil_div(k, kFp8BlockSize) % 4 == 0;
}

__global__ void gather_rows_kernel(const bf16* x, const int32_t* rows, bf16* out, int hidden) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const Bf16x8* src = reinterpret_cast<const Bf16x8*>(x + static_cast<int64_t>(rows[blockIdx.x]) * hidden);
  Bf16x8* dst = reinterpret_cast<Bf16x8*>(out + static_cast<int64_t>(blockIdx.x) * hidden);
  for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) dst[i] = src[i];
}

struct GatherTag;

}  // namespace

void prepare_blas_stream(cudaStream_t s) {
  LtContext::get(nullptr);
  LtContext::get(s);
}

void launch_matmul(const MatmulParams<bf16>& p, cudaStream_t s) { launch_matmul(p, DenseGemmKind::Auto, s); }

void launch_matmul(const MatmulParams<bf16>& p, DenseGemmKind kind, cudaStream_t s) {
  if (p.m == 0) return;
  if (kind == DenseGemmKind::Auto) {
    // NOTE: measured on H200 (bench kernel mode, 2026-12-04): streaming beats cuBLASLt at 1 and 2
    // rows (30B qkv 14.0 vs 17.4 us, o_proj 12.6 vs 17.4, router 8.9 vs 15.1) and loses from 4 on
    // (qkv 18.9 vs 17.1 us at 4, 26.5 vs 17.2 at 8), where its accumulators crowd the registers.
    kind = p.m <= 2 && streaming_matmul_supported(p) ? DenseGemmKind::Streaming : DenseGemmKind::Cublas;
  }
  if (kind == DenseGemmKind::Streaming) {
    launch_streaming_matmul(p, s);
  } else {
    Blas::get().gemm(p.x, p.w, p.bias, p.out, false, p.m, p.n, p.k, s);
  }
}

bool fp8_block_matmul_cublaslt_supported(int m, int n, int k) {
  return m > 0 && fp8_cublaslt_shape_ok(n, k) && Fp8Blas::get().plan_for(m, n, k) != nullptr;
}

void launch_fp8_block_matmul_cublaslt(const Fp8BlockMatmulParams<bf16>& p, const float* w_row_scale,
                                      cudaStream_t s) {
  RELAY_CHECK(fp8_cublaslt_shape_ok(p.n, p.k) && p.m >= 0, "fp8_block_matmul_cublaslt: m ", p.m, " n ", p.n, " k ",
              p.k, " (n and k multiples of 16, ceil(k / 128) a multiple of 4)");
  RELAY_CHECK(p.block_n == kFp8BlockSize && p.block_k == kFp8BlockSize,
              "fp8_block_matmul_cublaslt: blocks ", p.block_n, "x", p.block_k, " (only 128 x 128)");
  RELAY_CHECK(p.x_scale_group_major, "fp8_block_matmul_cublaslt: x scales must be group-major (cuBLASLt's VEC128 layout)");
  for (const void* ptr : {static_cast<const void*>(p.x), static_cast<const void*>(p.w), static_cast<const void*>(p.out),
                          static_cast<const void*>(p.x_scale), static_cast<const void*>(p.w_scale)}) {
    RELAY_CHECK(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, "fp8_block_matmul_cublaslt: pointers must be 16-byte aligned");
  }
  if (p.m == 0) return;
  Fp8Blas::get().gemm(p, w_row_scale, s);
}

void launch_lm_head(const LmHeadParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.hidden % 8 == 0, "lm_head: hidden ", p.hidden, " must be a multiple of 8");
  if (p.num_rows == 0) return;
  auto* gathered = static_cast<bf16*>(
      per_stream<DeviceWorkspace, GatherTag>(s).get(static_cast<size_t>(p.num_rows) * p.hidden * sizeof(bf16), s, "lm_head gather"));
  launch_dependent("gather_rows_kernel", gather_rows_kernel, dim3(p.num_rows), dim3(128), 0, s, p.x, p.rows, gathered,
                   p.hidden);
  Blas::get().gemm(gathered, p.w, nullptr, p.logits, true, p.num_rows, p.vocab_size, p.hidden, s);
}

}  // namespace relay::kernels

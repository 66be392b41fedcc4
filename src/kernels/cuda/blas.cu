// Dense GEMMs through cuBLASLt: every linear layer (bf16 out) and the LM head (fp32 logits).
//
// Row-major out[m, n] = x[m, k] @ w[n, k]^T is, in cuBLAS's column-major terms, out^T = w x^T with
// w transposed: A = w (k x n, transposed), B = x (k x m), C = out (n x m). A plan (descriptors plus
// the heuristic's algorithm) is built once per (m, n, k, output type, bias) and cached; the 32 MiB
// workspace is allocated once, so launches are capturable in CUDA graphs. The LM head first gathers
// the rows that sample into a contiguous buffer (a no-op copy in decode, where every row samples).
#include <cublasLt.h>

#include <map>
#include <mutex>
#include <tuple>

#include "kernels/cuda/common.cuh"
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

class Blas {
 public:
  static Blas& get() {
    static Blas blas;
    return blas;
  }

  void gemm(const bf16* x, const bf16* w, const bf16* bias, void* out, bool out_f32, int m, int n, int k,
            cudaStream_t s) {
    const Plan& plan = plan_for(m, n, k, out_f32, bias != nullptr);
    if (bias) {
      RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                        sizeof(bias)));
    }
    const float alpha = 1.0f, beta = 0.0f;
    RELAY_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, w, plan.a, x, plan.b, &beta, out, plan.c, out,
                                      plan.c, &plan.algo, workspace_, kWorkspaceBytes, s));
  }

 private:
  Blas() {
    RELAY_CUBLAS_CHECK(cublasLtCreate(&handle_));
    RELAY_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  }

  const Plan& plan_for(int m, int n, int k, bool out_f32, bool bias) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto key = std::make_tuple(m, n, k, out_f32, bias);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    Plan plan;
    RELAY_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
    RELAY_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
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
    RELAY_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, out_f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, n));
    cublasLtMatmulPreference_t pref;
    RELAY_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    RELAY_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &kWorkspaceBytes, sizeof(kWorkspaceBytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    RELAY_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, 1,
                                                      &result, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    RELAY_CHECK(found > 0, "cuBLASLt has no algorithm for a bf16 GEMM of m ", m, " n ", n, " k ", k);
    plan.algo = result.algo;
    return plans_.emplace(key, plan).first->second;
  }

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::mutex mutex_;
  std::map<std::tuple<int, int, int, bool, bool>, Plan> plans_;
};

__global__ void gather_rows_kernel(const bf16* x, const int32_t* rows, bf16* out, int hidden) {
  const Bf16x8* src = reinterpret_cast<const Bf16x8*>(x + static_cast<int64_t>(rows[blockIdx.x]) * hidden);
  Bf16x8* dst = reinterpret_cast<Bf16x8*>(out + static_cast<int64_t>(blockIdx.x) * hidden);
  for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) dst[i] = src[i];
}

DeviceWorkspace& gather_workspace() {
  static DeviceWorkspace ws;
  return ws;
}

}  // namespace

void launch_matmul(const MatmulParams<bf16>& p, cudaStream_t s) {
  if (p.m == 0) return;
  Blas::get().gemm(p.x, p.w, p.bias, p.out, false, p.m, p.n, p.k, s);
}

void launch_lm_head(const LmHeadParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.hidden % 8 == 0, "lm_head: hidden ", p.hidden, " must be a multiple of 8");
  if (p.num_rows == 0) return;
  auto* gathered = static_cast<bf16*>(
      gather_workspace().get(static_cast<size_t>(p.num_rows) * p.hidden * sizeof(bf16), s, "lm_head gather"));
  gather_rows_kernel<<<p.num_rows, 128, 0, s>>>(p.x, p.rows, gathered, p.hidden);
  RELAY_CUDA_CHECK_LAUNCH("gather_rows_kernel");
  Blas::get().gemm(gathered, p.w, nullptr, p.logits, true, p.num_rows, p.vocab_size, p.hidden, s);
}

}  // namespace relay::kernels

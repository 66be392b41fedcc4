// Row-wise memory-bound ops: embedding gather, RMSNorm (+ fused residual add), SwiGLU and the
// sigmoid gate (gated attention's per-element gate, the shared expert's per-row one; launched
// dependent, PDL, as the decode kernels around them are).
//
// Each moves its bytes once with 16-byte accesses (the sigmoid gate where its rows allow). RMSNorm
// runs one CTA per token and keeps the row in registers between the sum of squares and the scaling
// (hidden <= kMaxHidden), so the row is read once and written once (twice with the residual:
// residual out and normed out).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kNormThreads = 256;
constexpr int kNormVecsPerThread = 4;
constexpr int kMaxHidden = kNormThreads * kNormVecsPerThread * 8;  // 8192

__global__ void embedding_kernel(EmbeddingParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int t = blockIdx.x;
  const int64_t id = p.token_ids[t];
  const Bf16x8* src = reinterpret_cast<const Bf16x8*>(p.table + id * p.hidden);
  Bf16x8* dst = reinterpret_cast<Bf16x8*>(p.out + static_cast<int64_t>(t) * p.hidden);
  for (int i = threadIdx.x; i < p.hidden / 8; i += blockDim.x) dst[i] = src[i];
}

__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(RmsNormParams<bf16> p) {
  __shared__ float scratch[32];
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * p.hidden;
  const int num_vecs = p.hidden / 8;
  float v[kNormVecsPerThread][8];
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormVecsPerThread; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < num_vecs) {
      bf16x8_to_f32(reinterpret_cast<const Bf16x8*>(p.x + row)[i], v[j]);
      if (p.residual) {
        Bf16x8* residual = reinterpret_cast<Bf16x8*>(p.residual + row) + i;
        add_to_residual(v[j], *residual, residual);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) sum_sq += v[j][e] * v[j][e];
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / p.hidden + p.eps);
#pragma unroll
  for (int j = 0; j < kNormVecsPerThread; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < num_vecs) {
      reinterpret_cast<Bf16x8*>(p.out + row)[i] =
          rms_scaled(v[j], reinterpret_cast<const Bf16x8*>(p.weight)[i], inv_rms);
    }
  }
}

// Grid-stride over the live rows' 16-byte vectors (every row without a bound).
__global__ void swiglu_kernel(SwigluParams<bf16> p) {
  __shared__ LiveRowMap live;
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  if (threadIdx.x == 0) live = live_row_map(p.live_rows, p.num_rows);
  __syncthreads();
  const int64_t vecs_per_row = p.width / 8;
  const int64_t total = vecs_per_row * live.total();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = live.row(static_cast<int>(i / vecs_per_row)), c = i % vecs_per_row;
    const Bf16x8* row = reinterpret_cast<const Bf16x8*>(p.gate_up + r * 2 * p.width);
    float g[8], u[8];
    bf16x8_to_f32(row[c], g);
    bf16x8_to_f32(row[c + vecs_per_row], u);
#pragma unroll
    for (int e = 0; e < 8; ++e) g[e] = silu_mul(g[e], u[e]);
    reinterpret_cast<Bf16x8*>(p.out + r * p.width)[c] = f32_to_bf16x8(g);
  }
}

__global__ void sigmoid_gate_kernel(SigmoidGateParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int64_t n = static_cast<int64_t>(p.num_rows) * p.width;
  const int per_gate = p.width / p.gate_width;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / p.width, c = e % p.width;
    const float s = sigmoid_of(__bfloat162float(p.gate[r * p.gate_width + c / per_gate]));
    const float x = __bfloat162float(p.x[e]);
    p.out[e] = __float2bfloat16(p.accumulate ? add_gated(__bfloat162float(p.out[e]), x, s) : x * s);
  }
}

// The same over 16-byte vectors, where each vector of 8 columns is under one gate or each of its
// columns under its own (attention's output gate): the same expression per element.
__global__ void sigmoid_gate_vec_kernel(SigmoidGateParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int row_vecs = p.width / 8, per_gate = p.width / p.gate_width;
  const int64_t n = static_cast<int64_t>(p.num_rows) * row_vecs;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / row_vecs;
    const int c = static_cast<int>(v % row_vecs) * 8;
    const bf16* gate = p.gate + r * p.gate_width;
    float x[8], g[8], o[8];
    bf16x8_to_f32(reinterpret_cast<const Bf16x8*>(p.x)[v], x);
    if (per_gate == 1) {
      bf16x8_to_f32(reinterpret_cast<const Bf16x8*>(gate)[c / 8], g);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) g[e] = __bfloat162float(gate[c / per_gate]);
    }
    if (p.accumulate) bf16x8_to_f32(reinterpret_cast<const Bf16x8*>(p.out)[v], o);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float s = sigmoid_of(g[e]);
      o[e] = p.accumulate ? add_gated(o[e], x[e], s) : x[e] * s;
    }
    reinterpret_cast<Bf16x8*>(p.out)[v] = f32_to_bf16x8(o);
  }
}

}  // namespace

void launch_embedding(const EmbeddingParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.hidden % 8 == 0, "embedding: hidden ", p.hidden, " must be a multiple of 8");
  if (p.num_tokens == 0) return;
  launch_dependent("embedding_kernel", embedding_kernel, dim3(p.num_tokens), dim3(128), 0, s, p);
}

void launch_rms_norm(const RmsNormParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.hidden % 8 == 0 && p.hidden <= kMaxHidden, "rms_norm: hidden ", p.hidden,
              " must be a multiple of 8 and at most ", kMaxHidden);
  if (p.num_tokens == 0) return;
  launch_dependent("rms_norm_kernel", rms_norm_kernel, dim3(p.num_tokens), dim3(kNormThreads), 0,
                   s, p);
}

void launch_swiglu(const SwigluParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.width % 8 == 0, "swiglu: width ", p.width, " must be a multiple of 8");
  RELAY_CHECK(live_rows_valid(p.live_rows, p.num_rows), "swiglu: live_rows.region_rows ",
              p.live_rows.region_rows, " must be positive with at most ", kMaxLiveRegions,
              " regions over ", p.num_rows, " rows");
  if (p.num_rows == 0) return;
  const int64_t total = static_cast<int64_t>(p.num_rows) * p.width / 8;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(total, 256), 132 * 16));
  launch_dependent("swiglu_kernel", swiglu_kernel, dim3(blocks), dim3(256), 0, s, p);
}

void launch_sigmoid_gate(const SigmoidGateParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.gate_width > 0 && p.width % p.gate_width == 0, "sigmoid_gate: gate_width ",
              p.gate_width, " must divide width ", p.width);
  const int64_t n = static_cast<int64_t>(p.num_rows) * p.width;
  if (n == 0) return;
  constexpr int kThreads = 256;
  // 16-byte vectors where every vector lies under one gate or under its own 8 (and the rows are
  // 16-byte aligned): a third of the instructions of the per-element form.
  const int per_gate = p.width / p.gate_width;
  const bool aligned = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.gate) % 16 == 0;
  const bool vec = aligned && p.width % 8 == 0 &&
                   (per_gate % 8 == 0 || (per_gate == 1 && p.gate_width % 8 == 0));
  const int64_t items = vec ? n / 8 : n;  // a thread a 16-byte vector or an element
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(ceil_div(items, kThreads), 4096)));
  if (vec) {
    launch_dependent("sigmoid_gate_vec_kernel", sigmoid_gate_vec_kernel, grid, dim3(kThreads), 0,
                     s, p);
  } else {
    launch_dependent("sigmoid_gate_kernel", sigmoid_gate_kernel, grid, dim3(kThreads), 0, s, p);
  }
}

}  // namespace relay::kernels

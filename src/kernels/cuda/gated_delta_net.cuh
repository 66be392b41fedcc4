// Gated DeltaNet's per-token device math, shared by the recurrence's decode form
// (linear_attention.cu) and the fused decode step (gated_delta_net_step.cu): the conv's window
// step, the state column a thread holds (kParts threads per column of a value head's fp32 state
// S [key_dim, value_dim], each a strided quarter of its rows), the gates, q / k normalisation,
// one token's update of a column and the gated norm. Semantics in kernels/ops.h.
#pragma once

#include "kernels/cuda/common.cuh"
#include "kernels/ops.h"

namespace relay::kernels::gdn {

using cuda::bf16;
using cuda::block_sum;

constexpr int kMaxConvWidth = 7;  // kernel_size <= 8 (the released models use 4)

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// torch.nn.functional.softplus with its defaults (beta 1, threshold 20).
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }


// Token t's output: silu of the taps against the window of the `width` inputs before it, then x.
template <int N>
__device__ __forceinline__ float conv_step(const float (&taps)[N + 1], float (&w)[N], int width, float x) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (j < width) acc += taps[j] * w[j];
  }
  acc += taps[width] * x;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (j + 1 < width) w[j] = w[j + 1];
    else if (j + 1 == width) w[j] = x;
  }
  return silu(acc);
}

// Channel c's kernel_size taps (zeros after them).
__device__ __forceinline__ void load_conv_taps(const bf16* weight, int c, int kernel_size,
                                               float (&taps)[kMaxConvWidth + 1]) {
#pragma unroll
  for (int j = 0; j <= kMaxConvWidth; ++j) {
    taps[j] = j < kernel_size ? __bfloat162float(weight[static_cast<int64_t>(c) * kernel_size + j]) : 0.0f;
  }
}


// Value head h of the state in pool slot `slot` of `states`: [dk, dv].
__device__ __forceinline__ float* head_state(float* states, int64_t stride, int slot, int h, int dk, int dv) {
  return states + slot * stride + static_cast<int64_t>(h) * dk * dv;
}

// The decode form's threads per state column.
constexpr int kParts = 4;

// This thread's rows (part + kParts r, r < MaxDk / kParts) of column j of the value-head state
// [dk, dv] at `head` (zeros when it starts fresh, and past dv or dk).
template <int MaxDk>
__device__ __forceinline__ void load_state_column(const float* head, bool fresh, int dk, int dv, int j,
                                                  int part, float (&col)[MaxDk / kParts]) {
  // One pointer stepped row by row: the addresses of all rows held at once would take 2 registers
  // each.
  const float* at = head + static_cast<int64_t>(part) * dv + j;
  const int64_t step = static_cast<int64_t>(kParts) * dv;
#pragma unroll
  for (int r = 0; r < MaxDk / kParts; ++r, at += step) {
    col[r] = j < dv && part + kParts * r < dk && !fresh ? *at : 0.0f;
  }
}

// This thread's rows of column j into a head's state (its sequence's, or a snapshot's).
template <int MaxDk>
__device__ __forceinline__ void store_state_column(float* head, int dk, int dv, int j, int part,
                                                   const float (&col)[MaxDk / kParts]) {
  float* at = head + static_cast<int64_t>(part) * dv + j;
  const int64_t step = static_cast<int64_t>(kParts) * dv;
#pragma unroll
  for (int r = 0; r < MaxDk / kParts; ++r, at += step) {
    if (part + kParts * r < dk) *at = col[r];
  }
}


// The sum of v over the kParts consecutive lanes that share a column.
__device__ __forceinline__ float column_sum(float v) {
#pragma unroll
  for (int o = kParts / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// beta = sigmoid(b) and the decay exp(g), g = -exp(a_log) softplus(a + dt_bias), of one token and
// value head (a_rate = exp(a_log)).
__device__ __forceinline__ float2 delta_rule_gates(float b, float a, float a_rate, float dt_bias) {
  return {1.0f / (1.0f + expf(-b)), expf(-a_rate * softplus(a + dt_bias))};
}

// Thread e's q and k elements (zeros past key_dim), l2-normalised (q also divided by
// sqrt(key_dim)) into q[e] and k[e] for the whole CTA; MaxDk <= blockDim.x.
template <int MaxDk>
__device__ __forceinline__ void normalise_qk(float qi, float ki, int dk, float (&q)[MaxDk], float (&k)[MaxDk],
                                             float* scratch) {
  // NOTE: transformers divides by the Python float dk ** 0.5, which torch rounds to fp32.
  const float q_scale = sqrtf(static_cast<float>(dk));
  const float q_inv = rsqrtf(block_sum(qi * qi, scratch) + 1e-6f);
  const float k_inv = rsqrtf(block_sum(ki * ki, scratch) + 1e-6f);
  const int e = threadIdx.x;
  if (e < MaxDk) {  // zeros past key_dim
    q[e] = e < dk ? (qi * q_inv) / q_scale : 0.0f;
    k[e] = e < dk ? ki * k_inv : 0.0f;
  }
  __syncthreads();
}

// One token of a state column (this thread's rows part + kParts r; rows past key_dim hold zeros):
// decay, delta = beta (v - S^T k), S += k delta, and the column's entry of S^T q, which every lane
// of the column gets. Every lane takes part in the column sums.
template <int MaxDk>
__device__ __forceinline__ float delta_rule_column_step(float (&col)[MaxDk / kParts], const float (&q)[MaxDk],
                                                        const float (&k)[MaxDk], int part, float v, float2 gates) {
  constexpr int kRows = MaxDk / kParts;
  float kv = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    col[r] *= gates.y;
    kv += col[r] * k[part + kParts * r];
  }
  const float delta = (v - column_sum(kv)) * gates.x;
  float o = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    col[r] += k[part + kParts * r] * delta;
    o += col[r] * q[part + kParts * r];
  }
  return column_sum(o);
}


// The gated norm's output for x of a row whose inverse rms is inv_rms.
__device__ __forceinline__ float gated_norm(float weight, float x, float inv_rms, float gate) {
  return (weight * (x * inv_rms)) * silu(gate);
}

}  // namespace relay::kernels::gdn

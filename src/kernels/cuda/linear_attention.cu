// The Gated DeltaNet ops (Qwen3.5 / Qwen3-Next linear attention) and the sigmoid gate of gated
// attention and the shared expert, on the GPU (semantics in kernels/ops.h; CPU references in
// kernels/cpu/linear_attention.cpp and norm_embed.cpp).
//
// The stateful ops keep the CPU reference's order: each sequence's new tokens one at a time, so
// any chunking of a prompt gives the same state. The conv runs a thread per (sequence, channel)
// with its window in registers. The recurrence runs a CTA per (sequence, value head) with thread j
// holding column j of the head's fp32 state S [key_dim, value_dim] in registers for the whole
// chunk: per token, the CTA normalises q and k into shared memory, then each thread decays its
// column, forms its entry of S^T k, adds k delta_j and its entry of S^T q — the state touches
// memory only at the chunk's ends (and at snapshot rows). That is the decode form; a long prefill
// walks its tokens serially. (The chunked WY form in plain fp32 arithmetic, pairwise k.k and q.k
// products in shared memory and a forward substitution per column, was measured slower than this
// on H100, 258 against 138 ms for a 4096-token prompt of Qwen3.5-35B-A3B's first 8 layers: it does
// as many multiply-adds per thread as the walk and only saves its per-token reductions. It pays
// with its pairwise products and state updates on tensor cores, the step that follows.)
#include <cfloat>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kMaxConvWidth = 7;  // kernel_size <= 8 (the released models use 4)

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// torch.nn.functional.softplus with its defaults (beta 1, threshold 20).
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }

__global__ void causal_conv1d_kernel(CausalConv1dParams<bf16> p) {
  const int s = blockIdx.y;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.conv_dim) return;
  const int width = p.kernel_size - 1;
  const bool keeps = p.state_slots[s] >= 0;  // -1: padding, no state
  float* state = keeps ? p.conv_states + p.state_slots[s] * p.state_stride + static_cast<int64_t>(c) * width
                       : nullptr;
  float w[kMaxConvWidth];  // the channel's last `width` inputs, oldest first
  float taps[kMaxConvWidth + 1];
#pragma unroll
  for (int j = 0; j < kMaxConvWidth; ++j) {
    w[j] = j < width && keeps && !p.state_fresh[s] ? state[j] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j <= kMaxConvWidth; ++j) {
    taps[j] = j <= width ? __bfloat162float(p.weight[static_cast<int64_t>(c) * p.kernel_size + j]) : 0.0f;
  }
  for (int t = p.query_starts[s]; t < p.query_starts[s + 1]; ++t) {
    const float x = __bfloat162float(p.x[t * p.x_stride + c]);
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxConvWidth; ++j) {
      if (j < width) acc += taps[j] * w[j];
    }
    acc += taps[width] * x;
#pragma unroll
    for (int j = 0; j < kMaxConvWidth; ++j) {
      if (j + 1 < width) w[j] = w[j + 1];
      else if (j + 1 == width) w[j] = x;
    }
    p.out[static_cast<int64_t>(t) * p.conv_dim + c] = __float2bfloat16(silu(acc));
    if (p.snapshot_slots != nullptr && p.snapshot_slots[t] >= 0) {
      float* snap =
          p.conv_states + p.snapshot_slots[t] * p.state_stride + static_cast<int64_t>(c) * width;
#pragma unroll
      for (int j = 0; j < kMaxConvWidth; ++j) {
        if (j < width) snap[j] = w[j];
      }
    }
  }
  if (!keeps) return;
#pragma unroll
  for (int j = 0; j < kMaxConvWidth; ++j) {
    if (j < width) state[j] = w[j];
  }
}

// Value head h of the state in pool slot `slot`: [key_dim, value_dim].
__device__ __forceinline__ float* head_state(const GatedDeltaRuleParams<bf16>& p, int slot, int h) {
  return p.states + slot * p.state_stride + static_cast<int64_t>(h) * p.key_dim * p.value_dim;
}

// Thread j's column of sequence s's value-head-h state (zeros when it starts fresh or has no slot,
// and for threads past value_dim), and where it is kept (null without a slot: graph padding).
template <int MaxDk>
__device__ __forceinline__ float* load_state_column(const GatedDeltaRuleParams<bf16>& p, int s,
                                                    int h, int j, float (&col)[MaxDk]) {
  const bool keeps = p.state_slots[s] >= 0;
  float* state = keeps ? head_state(p, p.state_slots[s], h) : nullptr;
  const bool fresh = !keeps || p.state_fresh[s];
#pragma unroll
  for (int i = 0; i < MaxDk; ++i) {
    col[i] = j < p.value_dim && i < p.key_dim && !fresh ? state[static_cast<int64_t>(i) * p.value_dim + j]
                                                        : 0.0f;
  }
  return state;
}

// Thread j's column into a head's state (its sequence's, or a snapshot's).
template <int MaxDk>
__device__ __forceinline__ void store_state_column(const GatedDeltaRuleParams<bf16>& p, float* at,
                                                   int j, const float (&col)[MaxDk]) {
#pragma unroll
  for (int i = 0; i < MaxDk; ++i) {
    if (i < p.key_dim) at[static_cast<int64_t>(i) * p.value_dim + j] = col[i];
  }
}

// One CTA per (sequence, value head); blockDim.x >= max(key_dim, value_dim), a multiple of 32.
template <int MaxDk>
__global__ void gated_delta_rule_kernel(GatedDeltaRuleParams<bf16> p) {
  __shared__ float q[MaxDk], k[MaxDk];
  __shared__ float scratch[32];
  const int s = blockIdx.x / p.num_v_heads, h = blockIdx.x % p.num_v_heads;
  const int dk = p.key_dim, dv = p.value_dim;
  const int kh = h / (p.num_v_heads / p.num_k_heads);
  const int j = threadIdx.x;
  const bool owns = j < dv;
  float col[MaxDk];  // S[:, j]
  float* state = load_state_column(p, s, h, j, col);
  const int64_t row = 2 * static_cast<int64_t>(p.num_k_heads) * dk + static_cast<int64_t>(p.num_v_heads) * dv;
  // NOTE: transformers divides by the Python float dk ** 0.5, which torch rounds to fp32.
  const float q_scale = sqrtf(static_cast<float>(dk));
  const float a_rate = expf(p.a_log[h]);
  const float dt_bias = __bfloat162float(p.dt_bias[h]);
  for (int t = p.query_starts[s]; t < p.query_starts[s + 1]; ++t) {
    const bf16* in = p.qkv + t * row;
    const float qi = j < dk ? __bfloat162float(in[static_cast<int64_t>(kh) * dk + j]) : 0.0f;
    const float ki =
        j < dk ? __bfloat162float(in[static_cast<int64_t>(p.num_k_heads + kh) * dk + j]) : 0.0f;
    const float q_inv = rsqrtf(block_sum(qi * qi, scratch) + 1e-6f);
    const float k_inv = rsqrtf(block_sum(ki * ki, scratch) + 1e-6f);
    if (j < dk) {
      q[j] = (qi * q_inv) / q_scale;
      k[j] = ki * k_inv;
    }
    __syncthreads();
    const float beta = 1.0f / (1.0f + expf(-__bfloat162float(p.b[t * p.gate_stride + h])));
    const float g = -a_rate * softplus(__bfloat162float(p.a[t * p.gate_stride + h]) + dt_bias);
    const float decay = expf(g);
    if (owns) {
      float kv = 0.0f;
#pragma unroll
      for (int i = 0; i < MaxDk; ++i) {
        if (i < dk) {
          col[i] *= decay;
          kv += col[i] * k[i];
        }
      }
      const float v = __bfloat162float(in[2 * static_cast<int64_t>(p.num_k_heads) * dk +
                                          static_cast<int64_t>(h) * dv + j]);
      const float delta = (v - kv) * beta;
      float o = 0.0f;
#pragma unroll
      for (int i = 0; i < MaxDk; ++i) {
        if (i < dk) {
          col[i] += k[i] * delta;
          o += col[i] * q[i];
        }
      }
      p.out[(static_cast<int64_t>(t) * p.num_v_heads + h) * dv + j] = __float2bfloat16(o);
      if (p.snapshot_slots != nullptr && p.snapshot_slots[t] >= 0) {
        store_state_column(p, head_state(p, p.snapshot_slots[t], h), j, col);
      }
    }
    __syncthreads();  // q and k are rewritten for the next token
  }
  if (owns && state != nullptr) store_state_column(p, state, j, col);
}

// One warp per (token, head) row.
__global__ void gated_rms_norm_kernel(GatedRmsNormParams<bf16> p) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= static_cast<int64_t>(p.num_tokens) * p.num_heads) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = r / p.num_heads, h = r % p.num_heads;
  const bf16* x = p.x + r * p.head_dim;
  const bf16* gate = p.gate + t * p.gate_stride + h * p.head_dim;
  float ss = 0.0f;
  for (int i = lane; i < p.head_dim; i += 32) {
    const float v = __bfloat162float(x[i]);
    ss += v * v;
  }
  const float inv_rms = rsqrtf(warp_sum(ss) / static_cast<float>(p.head_dim) + p.eps);
  for (int i = lane; i < p.head_dim; i += 32) {
    const float y = (__bfloat162float(p.weight[i]) * (__bfloat162float(x[i]) * inv_rms)) *
                    silu(__bfloat162float(gate[i]));
    p.out[r * p.head_dim + i] = __float2bfloat16(y);
  }
}

__global__ void sigmoid_gate_kernel(SigmoidGateParams<bf16> p) {
  const int64_t n = static_cast<int64_t>(p.num_rows) * p.width;
  const int per_gate = p.width / p.gate_width;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / p.width, c = e % p.width;
    const float g = __bfloat162float(p.gate[r * p.gate_width + c / per_gate]);
    const float y = __bfloat162float(p.x[e]) * (1.0f / (1.0f + expf(-g)));
    p.out[e] = __float2bfloat16(p.accumulate ? __bfloat162float(p.out[e]) + y : y);
  }
}

}  // namespace

void launch_causal_conv1d(const CausalConv1dParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.kernel_size >= 1 && p.kernel_size - 1 <= kMaxConvWidth && p.conv_dim > 0,
              "causal_conv1d: kernel_size ", p.kernel_size, " (1 to ", kMaxConvWidth + 1,
              ") and conv_dim ", p.conv_dim, " (positive)");
  if (p.num_seqs == 0 || p.num_tokens == 0) return;
  constexpr int kThreads = 128;
  causal_conv1d_kernel<<<dim3(ceil_div(p.conv_dim, kThreads), p.num_seqs), kThreads, 0, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("causal_conv1d_kernel");
}

void launch_gated_delta_rule(const GatedDeltaRuleParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.num_k_heads > 0 && p.num_v_heads % p.num_k_heads == 0,
              "gated_delta_rule: num_v_heads ", p.num_v_heads,
              " must be a multiple of num_k_heads ", p.num_k_heads);
  RELAY_CHECK(p.key_dim > 0 && p.key_dim <= 128 && p.value_dim > 0 && p.value_dim <= 1024,
              "gated_delta_rule: key_dim ", p.key_dim, " (1 to 128) and value_dim ", p.value_dim,
              " (1 to 1024)");
  if (p.num_seqs == 0 || p.num_tokens == 0) return;
  const int ctas = p.num_seqs * p.num_v_heads;
  const int threads = static_cast<int>(ceil_div(std::max(p.key_dim, p.value_dim), 32)) * 32;
  if (p.key_dim <= 32) {
    gated_delta_rule_kernel<32><<<ctas, threads, 0, s>>>(p);
  } else if (p.key_dim <= 64) {
    gated_delta_rule_kernel<64><<<ctas, threads, 0, s>>>(p);
  } else {
    gated_delta_rule_kernel<128><<<ctas, threads, 0, s>>>(p);
  }
  RELAY_CUDA_CHECK_LAUNCH("gated_delta_rule_kernel");
}

void launch_gated_rms_norm(const GatedRmsNormParams<bf16>& p, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  if (rows == 0) return;
  constexpr int kWarps = 8;
  gated_rms_norm_kernel<<<ceil_div(rows, kWarps), kWarps * 32, 0, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("gated_rms_norm_kernel");
}

void launch_sigmoid_gate(const SigmoidGateParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.gate_width > 0 && p.width % p.gate_width == 0, "sigmoid_gate: gate_width ",
              p.gate_width, " must divide width ", p.width);
  const int64_t n = static_cast<int64_t>(p.num_rows) * p.width;
  if (n == 0) return;
  constexpr int kThreads = 256;
  sigmoid_gate_kernel<<<std::min<int64_t>(ceil_div(n, kThreads), 4096), kThreads, 0, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("sigmoid_gate_kernel");
}

}  // namespace relay::kernels

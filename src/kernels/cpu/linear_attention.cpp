// CPU reference for Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): the causal conv1d with
// its carried state, the gated delta rule, and the gated output RMSNorm.
//
// Both stateful ops walk each sequence's new tokens in order, one token at a time, exactly as
// transformers' single-token decode path does (causal_conv1d_update,
// torch_recurrent_gated_delta_rule): a prefill chunk is its tokens' decode steps in turn, so the
// state a sequence ends with does not depend on how its tokens were cut into chunks, and no
// separate prefill algorithm exists to drift from the decode one. transformers' chunked prefill
// (chunk 64, WY form) is a reordering of the same sums and agrees with this to fp32 rounding
// (tests/fixtures/models/HYBRID.md: ~5e-6 on logits). Work is split over (sequence, channel block)
// for the conv and (sequence, value head) for the recurrence: the tasks of one sequence touch
// disjoint parts of its slot, and the batch's slots differ, so no two tasks share state.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/simd.h"
#include "kernels/ops.h"

namespace relay::kernels {

using cpu::dot;

namespace {

float silu(float x) { return x / (1.0f + std::exp(-x)); }

// torch.nn.functional.softplus with its defaults (beta 1, threshold 20).
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// x * rsqrt(sum(x^2) + 1e-6), transformers' l2norm for q and k.
void l2_normalize(float* x, int n) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) + 1e-6f);
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

// Channels per conv task: enough work per task, and a window buffer that stays in L1.
constexpr int kConvChannelBlock = 64;

}  // namespace

void launch_causal_conv1d(const CausalConv1dParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(p.kernel_size >= 1 && p.conv_dim > 0, "causal_conv1d: kernel_size ", p.kernel_size,
              " and conv_dim ", p.conv_dim, " must be positive");
  const int width = p.kernel_size - 1;  // state columns
  const int blocks = (p.conv_dim + kConvChannelBlock - 1) / kConvChannelBlock;
  pool.parallel_for(static_cast<int64_t>(p.num_seqs) * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> window(static_cast<size_t>(kConvChannelBlock) * width);
    for (int64_t task = begin; task < end; ++task) {
      const int s = static_cast<int>(task / blocks);
      const int c0 = static_cast<int>(task % blocks) * kConvChannelBlock;
      const int c1 = std::min(p.conv_dim, c0 + kConvChannelBlock);
      const bool keeps = p.state_slots[s] >= 0;  // -1: padding, no state
      float* state = keeps ? p.conv_states + p.state_slots[s] * p.state_stride : nullptr;
      // window[c - c0] holds channel c's last `width` inputs, oldest first.
      for (int c = c0; c < c1; ++c) {
        float* w = window.data() + static_cast<size_t>(c - c0) * width;
        if (!keeps || p.state_fresh[s]) {
          std::fill(w, w + width, 0.0f);
        } else {
          std::copy_n(state + static_cast<int64_t>(c) * width, width, w);
        }
      }
      for (int t = p.query_starts[s]; t < p.query_starts[s + 1]; ++t) {
        const float* x = p.x + t * p.x_stride;
        float* out = p.out + static_cast<int64_t>(t) * p.conv_dim;
        for (int c = c0; c < c1; ++c) {
          float* w = window.data() + static_cast<size_t>(c - c0) * width;
          const float* taps = p.weight + static_cast<int64_t>(c) * p.kernel_size;
          float acc = 0.0f;
          for (int j = 0; j < width; ++j) acc += taps[j] * w[j];
          acc += taps[width] * x[c];
          if (width > 0) {
            std::copy(w + 1, w + width, w);
            w[width - 1] = x[c];
          }
          out[c] = silu(acc);
        }
        if (p.snapshot_slots != nullptr && p.snapshot_slots[t] >= 0) {
          float* snap = p.conv_states + p.snapshot_slots[t] * p.state_stride;
          for (int c = c0; c < c1; ++c) {
            std::copy_n(window.data() + static_cast<size_t>(c - c0) * width, width,
                        snap + static_cast<int64_t>(c) * width);
          }
        }
      }
      for (int c = c0; c < c1 && keeps; ++c) {
        std::copy_n(window.data() + static_cast<size_t>(c - c0) * width, width,
                    state + static_cast<int64_t>(c) * width);
      }
    }
  });
}

void launch_gated_delta_rule(const GatedDeltaRuleParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(p.num_k_heads > 0 && p.num_v_heads % p.num_k_heads == 0,
              "gated_delta_rule: num_v_heads ", p.num_v_heads,
              " must be a multiple of num_k_heads ", p.num_k_heads);
  const int dk = p.key_dim, dv = p.value_dim;
  const int group = p.num_v_heads / p.num_k_heads;
  const int64_t row =
      2 * static_cast<int64_t>(p.num_k_heads) * dk + static_cast<int64_t>(p.num_v_heads) * dv;
  // transformers divides by the Python float dk ** 0.5, which torch rounds to fp32.
  const float q_scale = static_cast<float>(std::sqrt(static_cast<double>(dk)));
  pool.parallel_for(
      static_cast<int64_t>(p.num_seqs) * p.num_v_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> q(dk), k(dk), kv_mem(dv), delta(dv), o(dv);
        std::vector<float> unkept;  // the state of a sequence without a slot (padding)
        for (int64_t task = begin; task < end; ++task) {
          const int s = static_cast<int>(task / p.num_v_heads);
          const int h = static_cast<int>(task % p.num_v_heads);
          const int kh = h / group;
          const bool keeps = p.state_slots[s] >= 0;
          if (!keeps) unkept.resize(static_cast<size_t>(dk) * dv);
          float* state = keeps ? p.states + p.state_slots[s] * p.state_stride +
                                     static_cast<int64_t>(h) * dk * dv
                               : unkept.data();  // [dk, dv]
          if (!keeps || p.state_fresh[s]) {
            std::fill(state, state + static_cast<int64_t>(dk) * dv, 0.0f);
          }
          const float a_rate = std::exp(p.a_log[h]);
          for (int t = p.query_starts[s]; t < p.query_starts[s + 1]; ++t) {
            const float* in = p.qkv + t * row;
            std::copy_n(in + static_cast<int64_t>(kh) * dk, dk, q.data());
            std::copy_n(in + static_cast<int64_t>(p.num_k_heads + kh) * dk, dk, k.data());
            const float* v =
                in + 2 * static_cast<int64_t>(p.num_k_heads) * dk + static_cast<int64_t>(h) * dv;
            l2_normalize(q.data(), dk);
            l2_normalize(k.data(), dk);
            for (float& x : q) x /= q_scale;
            const float beta = 1.0f / (1.0f + std::exp(-p.b[t * p.gate_stride + h]));
            const float g = -a_rate * softplus(p.a[t * p.gate_stride + h] + p.dt_bias[h]);
            const float decay = std::exp(g);

            // S <- decay * S, and what the decayed state predicts for k: kv_mem = S^T k.
            std::fill(kv_mem.begin(), kv_mem.end(), 0.0f);
            for (int i = 0; i < dk; ++i) {
              float* s_row = state + static_cast<int64_t>(i) * dv;
              for (int j = 0; j < dv; ++j) {
                s_row[j] *= decay;
                kv_mem[j] += s_row[j] * k[i];
              }
            }
            for (int j = 0; j < dv; ++j) delta[j] = (v[j] - kv_mem[j]) * beta;
            // S <- S + k delta^T, and the output o = S^T q of the updated state.
            std::fill(o.begin(), o.end(), 0.0f);
            for (int i = 0; i < dk; ++i) {
              float* s_row = state + static_cast<int64_t>(i) * dv;
              for (int j = 0; j < dv; ++j) {
                s_row[j] += k[i] * delta[j];
                o[j] += s_row[j] * q[i];
              }
            }
            std::copy(o.begin(), o.end(),
                      p.out + (static_cast<int64_t>(t) * p.num_v_heads + h) * dv);
            if (p.snapshot_slots != nullptr && p.snapshot_slots[t] >= 0) {
              std::copy_n(state, static_cast<int64_t>(dk) * dv,
                          p.states + p.snapshot_slots[t] * p.state_stride +
                              static_cast<int64_t>(h) * dk * dv);
            }
          }
        }
      });
}

void launch_gated_rms_norm(const GatedRmsNormParams<float>& p, ThreadPool& pool) {
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int hd = p.head_dim;
  pool.parallel_for(
      rows, std::max<int64_t>(1, 4096 / std::max(1, hd)), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t t = r / p.num_heads, h = r % p.num_heads;
          const float* x = p.x + r * hd;
          const float* gate = p.gate + t * p.gate_stride + h * hd;
          float* y = p.out + r * hd;
          const float inv_rms = 1.0f / std::sqrt(dot(x, x, hd) / static_cast<float>(hd) + p.eps);
          for (int i = 0; i < hd; ++i) y[i] = (p.weight[i] * (x[i] * inv_rms)) * silu(gate[i]);
        }
      });
}

void launch_gated_delta_net_step(const GatedDeltaNetStepParams<float>& p, ThreadPool& pool) {
  const int conv_dim = p.conv_dim(), v_dim = p.num_v_heads * p.value_dim;
  // The conv's output, kept between calls on the calling thread (a rank's forward runs on one
  // thread; a prompt's buffer is large). The recurrence writes `out`, which the norm then gates
  // in place.
  thread_local std::vector<float> conv_out;
  conv_out.resize(static_cast<size_t>(p.num_tokens) * conv_dim);
  launch_causal_conv1d({p.proj, p.proj_stride, p.conv_weight, p.conv_states, p.state_stride,
                        p.query_starts, p.state_slots, p.state_fresh, p.snapshot_slots,
                        conv_out.data(), p.num_seqs, p.num_tokens, conv_dim, p.kernel_size},
                       pool);
  const float* z = p.proj + conv_dim;
  const float* b = z + v_dim;
  launch_gated_delta_rule({conv_out.data(), b, b + p.num_v_heads, p.proj_stride, p.a_log,
                           p.dt_bias, p.states, p.state_stride, p.query_starts, p.state_slots,
                           p.state_fresh, p.snapshot_slots, p.out, p.num_seqs, p.num_tokens,
                           p.num_k_heads, p.num_v_heads, p.key_dim, p.value_dim},
                          pool);
  launch_gated_rms_norm({p.out, z, p.proj_stride, p.norm_weight, p.out, p.num_tokens,
                         p.num_v_heads, p.value_dim, p.eps},
                        pool);
}

}  // namespace relay::kernels

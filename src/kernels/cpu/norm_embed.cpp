// CPU reference for the row-wise ops: embedding lookup, RMSNorm (+ residual), SwiGLU, and the
// sigmoid gate (Qwen3.5's gated attention and shared expert).
//
// All are memory-bound and independent per row, so they split rows over the pool (SwiGLU only
// its live rows, LiveRows in kernels/ops.h). RMSNorm follows HF's Qwen3RMSNorm exactly in fp32:
// variance = mean(x^2), x * rsqrt(variance + eps), then times weight. A zero-centred (1 + w) norm
// runs here too: its loader stores 1 + w, which is what HF multiplies by (in fp32).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/simd.h"
#include "kernels/ops.h"

namespace relay::kernels {

using cpu::dot;

namespace {
// Rows per task: enough work to cover the cost of waking a worker.
int64_t row_grain(int row_elements) { return std::max<int64_t>(1, 16384 / std::max(1, row_elements)); }
}  // namespace

void launch_embedding(const EmbeddingParams<float>& p, ThreadPool& pool) {
  pool.parallel_for(p.num_tokens, row_grain(p.hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(p.out + t * p.hidden, p.table + static_cast<int64_t>(p.token_ids[t]) * p.hidden,
                  sizeof(float) * p.hidden);
    }
  });
}

void launch_rms_norm(const RmsNormParams<float>& p, ThreadPool& pool) {
  pool.parallel_for(p.num_tokens, row_grain(p.hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* x = p.x + t * p.hidden;
      float* y = p.out + t * p.hidden;
      const float* src = x;
      if (p.residual != nullptr) {
        float* r = p.residual + t * p.hidden;
        for (int i = 0; i < p.hidden; ++i) r[i] += x[i];
        src = r;
      }
      float variance = dot(src, src, p.hidden) / static_cast<float>(p.hidden);
      float inv_rms = 1.0f / std::sqrt(variance + p.eps);
      for (int i = 0; i < p.hidden; ++i) y[i] = p.weight[i] * (src[i] * inv_rms);
    }
  });
}

void launch_swiglu(const SwigluParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(live_rows_valid(p.live_rows, p.num_rows), "swiglu: live_rows.region_rows ",
              p.live_rows.region_rows, " must be positive with at most ", kMaxLiveRegions,
              " regions over ", p.num_rows, " rows");
  const LiveRowMap live = live_row_map(p.live_rows, p.num_rows);
  pool.parallel_for(live.total(), row_grain(2 * p.width), [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int64_t r = live.row(static_cast<int>(v));
      const float* gate = p.gate_up + r * 2 * p.width;
      const float* up = gate + p.width;
      float* y = p.out + r * p.width;
      for (int i = 0; i < p.width; ++i) {
        float g = gate[i];
        y[i] = (g / (1.0f + std::exp(-g))) * up[i];
      }
    }
  });
}

void launch_sigmoid_gate(const SigmoidGateParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(p.gate_width > 0 && p.width % p.gate_width == 0, "sigmoid_gate: gate_width ",
              p.gate_width, " must divide width ", p.width);
  const int group = p.width / p.gate_width;
  pool.parallel_for(p.num_rows, row_grain(p.width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = p.x + r * p.width;
      const float* gate = p.gate + r * p.gate_width;
      float* y = p.out + r * p.width;
      for (int g = 0; g < p.gate_width; ++g) {
        const float s = 1.0f / (1.0f + std::exp(-gate[g]));
        for (int i = g * group; i < (g + 1) * group; ++i) {
          y[i] = p.accumulate ? y[i] + x[i] * s : x[i] * s;
        }
      }
    }
  });
}

}  // namespace relay::kernels

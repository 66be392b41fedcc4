// See kernels/fp8_ops.h. The E4M3 encoder works on the fp32 bit pattern so that rounding is decided
// by integer arithmetic, not by the current floating-point rounding mode.
#include "kernels/fp8_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace relay::kernels {

namespace {

float block_amax(const float* w, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
  }
  return amax;
}

}  // namespace


float e4m3_to_f32(uint8_t code) {
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m * 2^-9
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // 1.m * 2^(e-7)
  }
  return (code & 0x80) ? -magnitude : magnitude;
}

uint8_t f32_to_e4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return sign | kE4m3NanCode;
  // 448 = 0x43E00000; anything at or above it (infinity included) saturates.
  if (abs_bits >= 0x43E00000u) return sign | kE4m3MaxCode;
  // Below 2^-6 (E4M3's smallest normal, fp32 biased exponent 121) the grid is uniform with step
  // 2^-9: scaling by 2^9 is exact and rounding to an integer in [0, 8] is the code itself (8 is the
  // smallest normal, whose code is also 8).
  if (abs_bits < (121u << 23)) {
    float magnitude;
    std::memcpy(&magnitude, &abs_bits, sizeof magnitude);
    const float scaled = magnitude * 512.0f;
    const float floor_value = std::floor(scaled);
    const float fraction = scaled - floor_value;
    uint32_t q = static_cast<uint32_t>(floor_value);
    if (fraction > 0.5f || (fraction == 0.5f && (q & 1u))) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  // Normal range: keep 3 of the 23 mantissa bits, rounding the dropped 20 to nearest even; a carry
  // out of the mantissa correctly bumps the exponent. Rebias the exponent from 127 to 7.
  const uint32_t odd = (abs_bits >> 20) & 1u;
  const uint32_t rounded = (abs_bits + 0x7FFFFu + odd) >> 20;
  return sign | static_cast<uint8_t>(rounded - ((127u - 7u) << 3));
}

float e8m0_to_f32(uint8_t code) {
  if (code == kE8m0NanCode) return NAN;
  return std::ldexp(1.0f, static_cast<int>(code) - kE8m0Bias);
}

uint8_t e8m0_scale_code_for_amax(float amax) {
  RELAY_CHECK(std::isfinite(amax) && amax >= 0.0f, "MX scale: group amax ", amax,
              " is not a finite non-negative value");
  if (amax == 0.0f) return 0;
  // amax = f * 2^E with f in [0.5, 1); 448 = 0.875 * 2^9, so amax <= 448 * 2^k holds for
  // k >= E - 9 when f <= 0.875 and for k >= E - 8 otherwise. Both tests are exact.
  int exponent;
  const float fraction = std::frexp(amax, &exponent);
  const int k = exponent - 9 + (fraction > 0.875f ? 1 : 0);
  const int code = k + kE8m0Bias;
  if (code < 0) return 0;
  RELAY_CHECK(code < kE8m0NanCode, "MX scale: group amax ", amax, " needs scale 2^", k,
              ", beyond E8M0's range");
  return static_cast<uint8_t>(code);
}


namespace {

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = e4m3_to_f32(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// out[r, j] for r in [row_begin, row_end): sum over k-groups g of
//   (sum_{c in g} dec(x[r, c]) * dec(w_rows(r)[j, c])) * (x_scale(r, g) * w_scale(r, j, g)).
template <typename WRows, typename XScale, typename WScale>
void scaled_rows(const uint8_t* x, float* out, int64_t row_begin, int64_t row_end, int n, int k,
                 int group, WRows w_rows, XScale x_scale, WScale w_scale) {
  const std::array<float, 256>& dec = e4m3_table();
  const int num_groups = static_cast<int>(ceil_div(k, group));
  std::vector<float> x_row(k);
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int c = 0; c < k; ++c) x_row[c] = dec[x[r * k + c]];
    const uint8_t* w = w_rows(r);
    for (int j = 0; j < n; ++j) {
      const uint8_t* w_row = w + static_cast<int64_t>(j) * k;
      float acc = 0.0f;
      for (int g = 0; g < num_groups; ++g) {
        const int c0 = g * group, c1 = std::min(k, c0 + group);
        float partial = 0.0f;
        for (int c = c0; c < c1; ++c) partial += x_row[c] * dec[w_row[c]];
        acc += partial * (x_scale(r, g) * w_scale(r, j, g));
      }
      out[r * n + j] = acc;
    }
  }
}

// The expert that owns permuted row r.
int expert_of_row(const int32_t* expert_offsets, int num_experts, int64_t r) {
  return static_cast<int>(std::upper_bound(expert_offsets, expert_offsets + num_experts + 1, r) -
                          expert_offsets) -
         1;
}

void check_offsets(const int32_t* offsets, int num_experts, int num_rows, const char* op) {
  RELAY_CHECK(offsets[0] == 0 && offsets[num_experts] == num_rows, op,
              ": expert_offsets must run from 0 to ", num_rows, ", got ", offsets[0], " .. ",
              offsets[num_experts]);
  for (int e = 0; e < num_experts; ++e) {
    RELAY_CHECK(offsets[e] <= offsets[e + 1], op, ": expert_offsets decrease at expert ", e);
  }
}

void quantize_rows_fp8(const Fp8ActQuantParams<float>& p, int64_t r0, int64_t r1) {
  const int num_groups = static_cast<int>(ceil_div(p.k, p.group_size));
  std::vector<float> row_scales(num_groups);
  for (int64_t r = r0; r < r1; ++r) {
    // A 1 x group_size block of the weight recipe, so weights and activations share one definition.
    float* scales = p.group_major_scales ? row_scales.data() : p.scale + r * num_groups;
    quantize_weight_fp8_block(p.x + r * p.k, 1, p.k, 1, p.group_size, p.q + r * p.k, scales);
    if (p.group_major_scales) {
      for (int g = 0; g < num_groups; ++g) p.scale[g * int64_t{p.num_tokens} + r] = scales[g];
    }
  }
}

}  // namespace

void launch_fp8_act_quant(const Fp8ActQuantParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(p.num_tokens >= 0 && p.k > 0 && p.group_size > 0,
              "fp8_act_quant: bad shape num_tokens ", p.num_tokens, ", k ", p.k, ", group_size ",
              p.group_size);
  RELAY_CHECK(kernels::live_rows_valid(p.live_tokens, p.num_tokens),
              "fp8_act_quant: live_tokens.region_rows ", p.live_tokens.region_rows,
              " must be positive with at most ", kernels::kMaxLiveRegions, " regions over ",
              p.num_tokens, " tokens");
  const kernels::LiveRowMap live = kernels::live_row_map(p.live_tokens, p.num_tokens);
  pool.parallel_for(live.total(), 16, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t r = live.row(static_cast<int>(v));
      quantize_rows_fp8(p, r, r + 1);
    }
  });
}

void launch_fp8_permute_rows(const Fp8PermuteRowsParams& p, ThreadPool& pool) {
  RELAY_CHECK(p.num_tokens >= 0 && p.k > 0 && p.top_k > 0, "fp8_permute_rows: bad shape num_tokens ",
              p.num_tokens, ", k ", p.k, ", top_k ", p.top_k);
  const int64_t groups = ceil_div(p.k, kFp8BlockSize);
  RELAY_CHECK(kernels::live_rows_valid(p.live_tokens, p.num_tokens),
              "fp8_permute_rows: live_tokens.region_rows ", p.live_tokens.region_rows,
              " must be positive with at most ", kernels::kMaxLiveRegions, " regions over ",
              p.num_tokens, " tokens");
  RELAY_CHECK(kernels::live_rows_valid(p.copied_rows, int64_t{p.num_tokens} * p.top_k),
              "fp8_permute_rows: copied_rows.region_rows ", p.copied_rows.region_rows,
              " must be positive with at most ", kernels::kMaxLiveRegions, " regions over ",
              int64_t{p.num_tokens} * p.top_k, " rows");
  const kernels::LiveRowMap live = kernels::live_row_map(p.live_tokens, p.num_tokens);
  pool.parallel_for(int64_t{live.total()} * p.top_k, 64, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t t = live.row(static_cast<int>(v / p.top_k));
      const int64_t dst = p.permuted_index[t * p.top_k + v % p.top_k];
      if (!kernels::is_live_row(p.copied_rows, dst)) continue;
      std::memcpy(p.permuted_q + dst * p.k, p.q + t * p.k, static_cast<size_t>(p.k));
      std::memcpy(p.permuted_scale + dst * groups, p.scale + t * groups, sizeof(float) * groups);
    }
  });
}

void launch_fp8_block_matmul(const Fp8BlockMatmulParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(p.m >= 0 && p.n > 0 && p.k > 0 && p.block_n > 0 && p.block_k > 0,
              "fp8_block_matmul: bad shape m ", p.m, ", n ", p.n, ", k ", p.k, ", blocks ",
              p.block_n, "x", p.block_k);
  const int64_t num_groups = ceil_div(p.k, p.block_k);
  pool.parallel_for(p.m, 1, [&](int64_t r0, int64_t r1) {
    scaled_rows(
        p.x, p.out, r0, r1, p.n, p.k, p.block_k, [&](int64_t) { return p.w; },
        [&](int64_t r, int g) {
          return p.x_scale_group_major ? p.x_scale[g * int64_t{p.m} + r] : p.x_scale[r * num_groups + g];
        },
        [&](int64_t, int j, int g) { return p.w_scale[(j / p.block_n) * num_groups + g]; });
  });
}

std::vector<float> expand_fp8_row_scales(const float* block_scales, int64_t n, int64_t k) {
  const int64_t groups = ceil_div(k, kFp8BlockSize);
  std::vector<float> rows(static_cast<size_t>(groups * n));
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < n; ++r) rows[g * n + r] = block_scales[(r / kFp8BlockSize) * groups + g];
  }
  return rows;
}

void launch_fp8_block_grouped_matmul(const Fp8BlockGroupedMatmulParams<float>& p,
                                     ThreadPool& pool) {
  RELAY_CHECK(
      p.num_rows >= 0 && p.num_experts > 0 && p.n > 0 && p.k > 0 && p.block_n > 0 && p.block_k > 0,
      "fp8_block_grouped_matmul: bad shape rows ", p.num_rows, ", experts ", p.num_experts, ", n ",
      p.n, ", k ", p.k);
  check_offsets(p.expert_offsets, p.num_experts, p.num_rows, "fp8_block_grouped_matmul");
  const int64_t num_groups = ceil_div(p.k, p.block_k);
  const int64_t scales_per_expert = ceil_div(p.n, p.block_n) * num_groups;
  const int64_t weights_per_expert = static_cast<int64_t>(p.n) * p.k;
  pool.parallel_for(p.num_rows, 1, [&](int64_t r0, int64_t r1) {
    scaled_rows(
        p.x, p.out, r0, r1, p.n, p.k, p.block_k,
        [&](int64_t r) {
          return p.w + expert_of_row(p.expert_offsets, p.num_experts, r) * weights_per_expert;
        },
        [&](int64_t r, int g) { return p.x_scale[r * num_groups + g]; },
        [&](int64_t r, int j, int g) {
          const int64_t e = expert_of_row(p.expert_offsets, p.num_experts, r);
          return p.w_scale[e * scales_per_expert + (j / p.block_n) * num_groups + g];
        });
  });
}

void launch_mxfp8_act_quant(const Mxfp8ActQuantParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(p.num_tokens >= 0 && p.k > 0, "mxfp8_act_quant: bad shape num_tokens ", p.num_tokens,
              ", k ", p.k);
  const int64_t num_groups = ceil_div(p.k, kMxGroupSize);
  pool.parallel_for(p.num_tokens, 16, [&](int64_t r0, int64_t r1) {
    quantize_weight_mxfp8(p.x + r0 * p.k, r1 - r0, p.k, p.q + r0 * p.k, p.scale + r0 * num_groups);
  });
}

void launch_mxfp8_matmul(const Mxfp8MatmulParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(p.m >= 0 && p.n > 0 && p.k > 0, "mxfp8_matmul: bad shape m ", p.m, ", n ", p.n,
              ", k ", p.k);
  const int64_t num_groups = ceil_div(p.k, kMxGroupSize);
  pool.parallel_for(p.m, 1, [&](int64_t r0, int64_t r1) {
    scaled_rows(
        p.x, p.out, r0, r1, p.n, p.k, kMxGroupSize, [&](int64_t) { return p.w; },
        [&](int64_t r, int g) { return e8m0_to_f32(p.x_scale[r * num_groups + g]); },
        [&](int64_t, int j, int g) { return e8m0_to_f32(p.w_scale[j * num_groups + g]); });
  });
}

void launch_mxfp8_grouped_matmul(const Mxfp8GroupedMatmulParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(p.num_rows >= 0 && p.num_experts > 0 && p.n > 0 && p.k > 0,
              "mxfp8_grouped_matmul: bad shape rows ", p.num_rows, ", experts ", p.num_experts,
              ", n ", p.n, ", k ", p.k);
  check_offsets(p.expert_offsets, p.num_experts, p.num_rows, "mxfp8_grouped_matmul");
  const int64_t num_groups = ceil_div(p.k, kMxGroupSize);
  const int64_t weights_per_expert = static_cast<int64_t>(p.n) * p.k;
  const int64_t scales_per_expert = static_cast<int64_t>(p.n) * num_groups;
  pool.parallel_for(p.num_rows, 1, [&](int64_t r0, int64_t r1) {
    scaled_rows(
        p.x, p.out, r0, r1, p.n, p.k, kMxGroupSize,
        [&](int64_t r) {
          return p.w + expert_of_row(p.expert_offsets, p.num_experts, r) * weights_per_expert;
        },
        [&](int64_t r, int g) { return e8m0_to_f32(p.x_scale[r * num_groups + g]); },
        [&](int64_t r, int j, int g) {
          const int64_t e = expert_of_row(p.expert_offsets, p.num_experts, r);
          return e8m0_to_f32(p.w_scale[e * scales_per_expert + j * num_groups + g]);
        });
  });
}

void quantize_weight_fp8_block(const float* w, int64_t rows, int64_t cols, int block_rows,
                               int block_cols, uint8_t* q, float* scale_inv) {
  RELAY_CHECK(block_rows > 0 && block_cols > 0, "fp8 block size ", block_rows, "x", block_cols,
              " must be positive");
  const int64_t scale_cols = ceil_div(cols, block_cols);
  for (int64_t br = 0; br * block_rows < rows; ++br) {
    const int64_t r0 = br * block_rows, r1 = std::min(rows, r0 + block_rows);
    for (int64_t bc = 0; bc < scale_cols; ++bc) {
      const int64_t c0 = bc * block_cols, c1 = std::min(cols, c0 + block_cols);
      const float amax = block_amax(w, cols, r0, r1, c0, c1);
      RELAY_CHECK(std::isfinite(amax), "fp8 quantisation: block (", br, ", ", bc,
                  ") holds a non-finite value");
      // NOTE: scale = amax / 448 rounded once in fp32, and q = w / scale (a division, not a
      // multiply by 448 / amax): the recipe of the published FP8 checkpoints, reproduced bit for
      // bit by the fixture.
      const float scale = amax > 0.0f ? amax / kE4m3Max : 1.0f;
      scale_inv[br * scale_cols + bc] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float v = std::clamp(w[r * cols + c] / scale, -kE4m3Max, kE4m3Max);
          q[r * cols + c] = f32_to_e4m3(v);
        }
      }
    }
  }
}

void dequantize_weight_fp8_block(const uint8_t* q, const float* scale_inv, int64_t rows,
                                 int64_t cols, int block_rows, int block_cols, float* w) {
  const int64_t scale_cols = ceil_div(cols, block_cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = scale_inv + (r / block_rows) * scale_cols;
    for (int64_t c = 0; c < cols; ++c)
      w[r * cols + c] = e4m3_to_f32(q[r * cols + c]) * scale_row[c / block_cols];
  }
}

void quantize_weight_mxfp8(const float* w, int64_t rows, int64_t cols, uint8_t* q, uint8_t* scale) {
  const int64_t num_groups = ceil_div(cols, kMxGroupSize);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t c0 = g * kMxGroupSize, c1 = std::min(cols, c0 + kMxGroupSize);
      const float amax = block_amax(w, cols, r, r + 1, c0, c1);
      const uint8_t code = e8m0_scale_code_for_amax(amax);
      scale[r * num_groups + g] = code;
      // Division by a power of two is exact (ldexp), so the e4m3 rounding is the only loss.
      const int shift = kE8m0Bias - static_cast<int>(code);
      for (int64_t c = c0; c < c1; ++c)
        q[r * cols + c] = f32_to_e4m3(std::ldexp(w[r * cols + c], shift));
    }
  }
}

void dequantize_weight_mxfp8(const uint8_t* q, const uint8_t* scale, int64_t rows, int64_t cols,
                             float* w) {
  const int64_t num_groups = ceil_div(cols, kMxGroupSize);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      w[r * cols + c] =
          e4m3_to_f32(q[r * cols + c]) * e8m0_to_f32(scale[r * num_groups + c / kMxGroupSize]);
    }
  }
}

}  // namespace relay::kernels

// See fp8_gemm.h. One generic row loop serves all four GEMMs: they differ only in the group size
// along k and in where a (row, group) pair finds its two scales.
#include "quant/fp8_gemm.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "quant/fp8_format.h"
#include "quant/weight_quant.h"

namespace relay::quant {

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

}  // namespace relay::quant

// The CPU reference FP8 GEMMs against a naive double-precision product of the dequantised operands,
// over odd shapes (partial groups and blocks, one row, empty experts); and the dynamic activation
// quantisers against the weight recipe they are defined by.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <random>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/ops.h"
#include "kernels/fp8_ops.h"
#include "quant/weight_quant.h"

namespace relay::quant {
namespace {

std::vector<float> random_matrix(int rows, int cols, std::mt19937& rng, float std_dev) {
  std::normal_distribution<float> normal(0.0f, std_dev);
  std::vector<float> m(static_cast<size_t>(rows) * cols);
  for (float& v : m) v = normal(rng) * (rng() % 64 == 0 ? 20.0f : 1.0f);
  return m;
}

// A double-precision reference of sum_c a[r, c] * b[j, c] and the sum of |terms| (for the bound).
struct Reference {
  double value;
  double abs_sum;
};
Reference dot(const float* a, const float* b, int k) {
  Reference r{0.0, 0.0};
  for (int c = 0; c < k; ++c) {
    r.value += static_cast<double>(a[c]) * b[c];
    r.abs_sum += std::fabs(static_cast<double>(a[c]) * b[c]);
  }
  return r;
}

// fp32 accumulation of k exact products in groups, each group scaled once: the error is at most
// (k + 3 * num_groups) roundings of the running magnitude, bounded by the sum of |terms|.
void expect_close(float got, const Reference& ref, int k, int group, const std::string& where) {
  const double bound = (k + 3.0 * kernels::ceil_div(k, group) + 2) * 0x1p-24 * ref.abs_sum + 1e-30;
  EXPECT_LE(std::fabs(got - ref.value), bound) << where << ": " << got << " vs " << ref.value;
}

struct Shape {
  int m, n, k;
};
const Shape kShapes[] = {{1, 1, 1},    {1, 130, 300}, {3, 128, 128},
                         {17, 256, 7}, {5, 200, 129}, {2, 64, 384}};

TEST(Fp8ActQuant, IsTheWeightRecipeOnOneByGroupBlocks) {
  ThreadPool pool(2);
  std::mt19937 rng(1);
  for (const Shape& s : kShapes) {
    const std::vector<float> x = random_matrix(s.m, s.k, rng, 1.0f);
    const int groups = static_cast<int>(kernels::ceil_div(s.k, 128));
    std::vector<uint8_t> q(x.size()), q_ref(x.size());
    std::vector<float> scale(s.m * groups), scale_ref(s.m * groups);
    kernels::launch_fp8_act_quant({x.data(), q.data(), scale.data(), s.m, s.k, 128}, pool);
    for (int r = 0; r < s.m; ++r) {
      kernels::quantize_weight_fp8_block(x.data() + r * s.k, 1, s.k, 1, 128, q_ref.data() + r * s.k,
                                scale_ref.data() + r * groups);
      for (int g = 0; g < groups; ++g) {
        float amax = 0;
        for (int c = g * 128; c < std::min(s.k, (g + 1) * 128); ++c)
          amax = std::max(amax, std::fabs(x[r * s.k + c]));
        EXPECT_EQ(scale[r * groups + g], amax / 448.0f) << "row " << r << " group " << g;
      }
    }
    EXPECT_EQ(q, q_ref);
    EXPECT_EQ(scale, scale_ref);
  }
}

// The FP8 MoE path quantises each token once and permutes the codes and scales: the same bytes as
// permuting the bf16 rows and quantising every permuted row.
TEST(Fp8PermuteRows, QuantiseThenPermuteEqualsPermuteThenQuantise) {
  ThreadPool pool(2);
  std::mt19937 rng(5);
  for (auto [tokens, k, experts, top_k] : {std::array{1, 128, 4, 2}, std::array{37, 300, 16, 4}, std::array{64, 2048, 128, 8}}) {
    const std::vector<float> x = random_matrix(tokens, k, rng, 1.0f);
    std::vector<int32_t> ids(static_cast<size_t>(tokens) * top_k);
    for (int t = 0; t < tokens; ++t) {
      for (int j = 0; j < top_k; ++j) ids[t * top_k + j] = static_cast<int32_t>((t * 7 + j * 3 + rng() % 2) % experts);
    }
    const size_t rows = ids.size();
    const int groups = static_cast<int>(kernels::ceil_div(k, 128));
    std::vector<float> permuted(rows * k);
    std::vector<int32_t> index(rows), offsets(experts + 1);
    kernels::launch_moe_permute({x.data(), ids.data(), permuted.data(), index.data(), offsets.data(), tokens, k, experts, top_k},
                                pool);
    std::vector<uint8_t> q_ref(rows * k), q_tok(x.size()), q(rows * k);
    std::vector<float> s_ref(rows * groups), s_tok(tokens * groups), s(rows * groups);
    kernels::launch_fp8_act_quant({permuted.data(), q_ref.data(), s_ref.data(), static_cast<int>(rows), k}, pool);
    kernels::launch_fp8_act_quant({x.data(), q_tok.data(), s_tok.data(), tokens, k}, pool);
    std::vector<int32_t> index_only(rows), offsets_only(experts + 1);
    kernels::launch_moe_permute({x.data(), ids.data(), nullptr, index_only.data(), offsets_only.data(), tokens, k, experts, top_k},
                                pool);
    EXPECT_EQ(index_only, index);
    EXPECT_EQ(offsets_only, offsets);
    kernels::launch_fp8_permute_rows({q_tok.data(), s_tok.data(), index.data(), q.data(), s.data(), tokens, k, top_k}, pool);
    EXPECT_EQ(q, q_ref) << tokens << " tokens, k " << k;
    EXPECT_EQ(s, s_ref) << tokens << " tokens, k " << k;
  }
}

TEST(Fp8BlockMatmul, MatchesDoubleProductOfDequantisedOperands) {
  ThreadPool pool(2);
  std::mt19937 rng(2);
  for (const Shape& s : kShapes) {
    const std::vector<float> x = random_matrix(s.m, s.k, rng, 1.0f),
                             w = random_matrix(s.n, s.k, rng, 0.02f);
    const int kg = static_cast<int>(kernels::ceil_div(s.k, 128)), ng = static_cast<int>(kernels::ceil_div(s.n, 128));
    std::vector<uint8_t> xq(x.size()), wq(w.size());
    std::vector<float> xs(s.m * kg), ws(ng * kg), out(s.m * s.n);
    kernels::launch_fp8_act_quant({x.data(), xq.data(), xs.data(), s.m, s.k, 128}, pool);
    kernels::quantize_weight_fp8_block(w.data(), s.n, s.k, 128, 128, wq.data(), ws.data());
    kernels::launch_fp8_block_matmul({xq.data(), xs.data(), wq.data(), ws.data(), out.data(), s.m, s.n, s.k},
                            pool);

    std::vector<float> xd(x.size()), wd(w.size());
    kernels::dequantize_weight_fp8_block(xq.data(), xs.data(), s.m, s.k, 1, 128, xd.data());
    kernels::dequantize_weight_fp8_block(wq.data(), ws.data(), s.n, s.k, 128, 128, wd.data());
    double err2 = 0, ref2 = 0;
    for (int r = 0; r < s.m; ++r) {
      for (int j = 0; j < s.n; ++j) {
        expect_close(
            out[r * s.n + j], dot(&xd[r * s.k], &wd[j * s.k], s.k), s.k, 128,
            "m" + std::to_string(s.m) + " n" + std::to_string(s.n) + " k" + std::to_string(s.k));
        const double exact = dot(&x[r * s.k], &w[j * s.k], s.k).value;
        err2 += (out[r * s.n + j] - exact) * (out[r * s.n + j] - exact);
        ref2 += exact * exact;
      }
    }
    // Against the unquantised product the error is quantisation noise: a few percent, not more.
    EXPECT_LT(std::sqrt(err2 / std::max(ref2, 1e-30)), 0.08) << "k " << s.k;
  }
}

// cuBLASLt's layouts: group-major activation scales, and weight scales repeated per row. The GEMM
// with group-major x scales gives the same bits as with token-major ones.
TEST(Fp8BlockMatmul, GroupMajorScalesAndRowScalesAreTheSameNumbers) {
  ThreadPool pool(2);
  std::mt19937 rng(7);
  for (const Shape& s : kShapes) {
    const std::vector<float> x = random_matrix(s.m, s.k, rng, 1.0f),
                             w = random_matrix(s.n, s.k, rng, 0.02f);
    const int kg = static_cast<int>(kernels::ceil_div(s.k, 128)), ng = static_cast<int>(kernels::ceil_div(s.n, 128));
    std::vector<uint8_t> xq(x.size()), xq_g(x.size()), wq(w.size());
    std::vector<float> xs(s.m * kg), xs_g(s.m * kg), ws(ng * kg), out(s.m * s.n), out_g(s.m * s.n);
    kernels::launch_fp8_act_quant({x.data(), xq.data(), xs.data(), s.m, s.k, 128}, pool);
    kernels::launch_fp8_act_quant({x.data(), xq_g.data(), xs_g.data(), s.m, s.k, 128, true}, pool);
    EXPECT_EQ(xq, xq_g);
    for (int r = 0; r < s.m; ++r)
      for (int g = 0; g < kg; ++g) ASSERT_EQ(xs_g[g * s.m + r], xs[r * kg + g]);
    kernels::quantize_weight_fp8_block(w.data(), s.n, s.k, 128, 128, wq.data(), ws.data());
    kernels::launch_fp8_block_matmul({xq.data(), xs.data(), wq.data(), ws.data(), out.data(), s.m, s.n, s.k},
                            pool);
    kernels::launch_fp8_block_matmul({xq.data(), xs_g.data(), wq.data(), ws.data(), out_g.data(), s.m, s.n,
                             s.k, 128, 128, true},
                            pool);
    EXPECT_EQ(out, out_g);
    const std::vector<float> rows = kernels::expand_fp8_row_scales(ws.data(), s.n, s.k);
    ASSERT_EQ(rows.size(), static_cast<size_t>(kg) * s.n);
    for (int g = 0; g < kg; ++g)
      for (int j = 0; j < s.n; ++j) ASSERT_EQ(rows[g * s.n + j], ws[(j / 128) * kg + g]);
  }
}

// Offsets with an empty first expert, an empty middle one, and uneven groups.
std::vector<int32_t> offsets_for(int num_rows, int num_experts, std::mt19937& rng) {
  std::vector<int32_t> offsets(num_experts + 1, 0);
  for (int r = 0; r < num_rows; ++r) ++offsets[1 + (1 + rng() % (num_experts - 1)) % num_experts];
  offsets[2] += offsets[3];
  offsets[3] = 0;
  offsets[1] = 0;
  for (int e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  return offsets;
}

TEST(Fp8BlockGroupedMatmul, EachRowUsesItsExpertsWeightsAndScales) {
  ThreadPool pool(2);
  std::mt19937 rng(3);
  const int num_experts = 5, n = 136, k = 200;
  for (int num_rows : {1, 9, 40}) {
    const std::vector<int32_t> offsets = offsets_for(num_rows, num_experts, rng);
    ASSERT_EQ(offsets.back(), num_rows);
    const std::vector<float> x = random_matrix(num_rows, k, rng, 1.0f),
                             w = random_matrix(num_experts * n, k, rng, 0.02f);
    const int kg = static_cast<int>(kernels::ceil_div(k, 128)), ng = static_cast<int>(kernels::ceil_div(n, 128));
    std::vector<uint8_t> xq(x.size()), wq(w.size());
    std::vector<float> xs(num_rows * kg), ws(num_experts * ng * kg), out(num_rows * n);
    kernels::launch_fp8_act_quant({x.data(), xq.data(), xs.data(), num_rows, k, 128}, pool);
    for (int e = 0; e < num_experts; ++e) {
      kernels::quantize_weight_fp8_block(&w[e * n * k], n, k, 128, 128, &wq[e * n * k], &ws[e * ng * kg]);
    }
    kernels::launch_fp8_block_grouped_matmul({xq.data(), xs.data(), wq.data(), ws.data(), offsets.data(),
                                     out.data(), num_rows, num_experts, n, k},
                                    pool);
    std::vector<float> xd(x.size()), wd(w.size());
    kernels::dequantize_weight_fp8_block(xq.data(), xs.data(), num_rows, k, 1, 128, xd.data());
    for (int e = 0; e < num_experts; ++e) {
      kernels::dequantize_weight_fp8_block(&wq[e * n * k], &ws[e * ng * kg], n, k, 128, 128, &wd[e * n * k]);
      for (int r = offsets[e]; r < offsets[e + 1]; ++r) {
        for (int j = 0; j < n; ++j) {
          expect_close(out[r * n + j], dot(&xd[r * k], &wd[(e * n + j) * k], k), k, 128,
                       "expert " + std::to_string(e) + " row " + std::to_string(r));
        }
      }
    }
  }
}

TEST(Mxfp8Matmul, MatchesDoubleProductOfDequantisedOperands) {
  ThreadPool pool(2);
  std::mt19937 rng(4);
  for (const Shape& s : kShapes) {
    const std::vector<float> x = random_matrix(s.m, s.k, rng, 1.0f),
                             w = random_matrix(s.n, s.k, rng, 0.02f);
    const int kg = static_cast<int>(kernels::ceil_div(s.k, 32));
    std::vector<uint8_t> xq(x.size()), wq(w.size()), xs(s.m * kg), ws(s.n * kg);
    std::vector<float> out(s.m * s.n), xd(x.size()), wd(w.size());
    kernels::launch_mxfp8_act_quant({x.data(), xq.data(), xs.data(), s.m, s.k}, pool);
    kernels::quantize_weight_mxfp8(w.data(), s.n, s.k, wq.data(), ws.data());
    kernels::launch_mxfp8_matmul({xq.data(), xs.data(), wq.data(), ws.data(), out.data(), s.m, s.n, s.k},
                        pool);
    kernels::dequantize_weight_mxfp8(xq.data(), xs.data(), s.m, s.k, xd.data());
    kernels::dequantize_weight_mxfp8(wq.data(), ws.data(), s.n, s.k, wd.data());
    for (int r = 0; r < s.m; ++r) {
      for (int j = 0; j < s.n; ++j) {
        expect_close(out[r * s.n + j], dot(&xd[r * s.k], &wd[j * s.k], s.k), s.k, 32,
                     "mx k" + std::to_string(s.k));
      }
    }
  }
}

TEST(Mxfp8GroupedMatmul, EachRowUsesItsExpertsWeightsAndScales) {
  ThreadPool pool(2);
  std::mt19937 rng(6);
  const int num_experts = 4, n = 72, k = 100, num_rows = 23;
  const std::vector<int32_t> offsets = offsets_for(num_rows, num_experts, rng);
  const std::vector<float> x = random_matrix(num_rows, k, rng, 1.0f),
                           w = random_matrix(num_experts * n, k, rng, 0.02f);
  const int kg = static_cast<int>(kernels::ceil_div(k, 32));
  std::vector<uint8_t> xq(x.size()), wq(w.size()), xs(num_rows * kg), ws(num_experts * n * kg);
  std::vector<float> out(num_rows * n), xd(x.size()), wd(w.size());
  kernels::launch_mxfp8_act_quant({x.data(), xq.data(), xs.data(), num_rows, k}, pool);
  kernels::quantize_weight_mxfp8(w.data(), num_experts * n, k, wq.data(), ws.data());
  kernels::launch_mxfp8_grouped_matmul({xq.data(), xs.data(), wq.data(), ws.data(), offsets.data(),
                               out.data(), num_rows, num_experts, n, k},
                              pool);
  kernels::dequantize_weight_mxfp8(xq.data(), xs.data(), num_rows, k, xd.data());
  kernels::dequantize_weight_mxfp8(wq.data(), ws.data(), num_experts * n, k, wd.data());
  for (int e = 0; e < num_experts; ++e) {
    for (int r = offsets[e]; r < offsets[e + 1]; ++r) {
      for (int j = 0; j < n; ++j) {
        expect_close(out[r * n + j], dot(&xd[r * k], &wd[(e * n + j) * k], k), k, 32,
                     "mx expert " + std::to_string(e));
      }
    }
  }
}

TEST(Fp8GroupedMatmul, RejectsOffsetsThatDoNotCoverTheRows) {
  ThreadPool pool(1);
  std::vector<uint8_t> q(4 * 8);
  std::vector<float> s(4 * 8, 1.0f), out(4 * 8);
  const std::vector<int32_t> short_offsets = {0, 1, 3}, decreasing = {0, 3, 2};
  EXPECT_THROW(kernels::launch_fp8_block_grouped_matmul({q.data(), s.data(), q.data(), s.data(),
                                                short_offsets.data(), out.data(), 4, 2, 4, 8},
                                               pool),
               Error);
  EXPECT_THROW(kernels::launch_fp8_block_grouped_matmul({q.data(), s.data(), q.data(), s.data(),
                                                decreasing.data(), out.data(), 2, 2, 4, 8},
                                               pool),
               Error);
}

}  // namespace
}  // namespace relay::quant

// Every CPU kernel against a straightforward reference computed in double precision on random
// inputs: odd sizes, single tokens, experts that receive no tokens, shuffled block tables.
//
// Tolerances: a kernel's fp32 result may differ from the exact (double) value by its rounding
// errors, which grow with the length of the sums: |err| <= n * 2^-24 * sum|terms| in the worst case.
// We bound each dot product by 1e-5 * sum_i |a_i b_i| + 1e-6 — above the worst case for the lengths
// used (<= 300 terms) and far below any indexing or formula mistake, which shows up as O(1) errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/ops.h"
#include "random_vec.h"

namespace relay::kernels {
namespace {

class CpuOps : public ::testing::Test {
 protected:
  ThreadPool pool{2};
  std::mt19937 rng{1234};
};

TEST_F(CpuOps, EmbeddingCopiesRows) {
  const int vocab = 11, hidden = 13;
  auto table = random_vec(vocab * hidden, rng);
  std::vector<int32_t> ids{10, 0, 3, 3, 7};
  std::vector<float> out(ids.size() * hidden);
  launch_embedding({ids.data(), table.data(), out.data(), static_cast<int>(ids.size()), hidden, vocab}, pool);
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int i = 0; i < hidden; ++i) EXPECT_EQ(out[t * hidden + i], table[ids[t] * hidden + i]);
  }
}

TEST_F(CpuOps, RmsNormWithAndWithoutResidual) {
  for (int hidden : {1, 37, 128, 129}) {
    for (int tokens : {1, 5}) {
      auto x = random_vec(tokens * hidden, rng, 3.0f);
      auto residual = random_vec(tokens * hidden, rng);
      auto weight = random_vec(hidden, rng);
      for (bool with_residual : {false, true}) {
        std::vector<float> res = residual, out(x.size());
        RmsNormParams<float> p{x.data(), with_residual ? res.data() : nullptr, weight.data(), out.data(), tokens, hidden,
                               1e-6f};
        launch_rms_norm(p, pool);
        for (int t = 0; t < tokens; ++t) {
          std::vector<double> src(hidden);
          double ss = 0;
          for (int i = 0; i < hidden; ++i) {
            src[i] = x[t * hidden + i] + (with_residual ? residual[t * hidden + i] : 0.0);
            ss += src[i] * src[i];
            if (with_residual) {
              ASSERT_NEAR(res[t * hidden + i], src[i], 1e-6 * (1 + std::fabs(src[i])));
            }
          }
          double inv = 1.0 / std::sqrt(ss / hidden + 1e-6);
          for (int i = 0; i < hidden; ++i) {
            double want = weight[i] * src[i] * inv;
            ASSERT_NEAR(out[t * hidden + i], want, 1e-5 * (1 + std::fabs(want))) << "hidden " << hidden;
          }
        }
      }
    }
  }
}

void expect_matmul(const std::vector<float>& x, const std::vector<float>& w, const float* bias, const float* out, int m,
                   int n, int k) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double s = bias ? bias[j] : 0.0, mag = bias ? std::fabs(bias[j]) : 0.0;
      for (int t = 0; t < k; ++t) {
        s += static_cast<double>(x[i * k + t]) * w[j * k + t];
        mag += std::fabs(static_cast<double>(x[i * k + t]) * w[j * k + t]);
      }
      ASSERT_NEAR(out[i * n + j], s, 1e-5 * mag + 1e-6) << "m " << m << " n " << n << " k " << k << " at " << i << "," << j;
    }
  }
}

TEST_F(CpuOps, MatmulOddShapesWithAndWithoutBias) {
  const int shapes[][3] = {{1, 1, 1}, {1, 7, 13}, {3, 5, 8}, {5, 97, 129}, {67, 50, 33}, {130, 49, 257}, {1, 1000, 64}};
  for (auto [m, n, k] : shapes) {
    auto x = random_vec(m * k, rng), w = random_vec(n * k, rng), bias = random_vec(n, rng);
    std::vector<float> out(m * n);
    for (bool with_bias : {false, true}) {
      launch_matmul({x.data(), w.data(), with_bias ? bias.data() : nullptr, out.data(), m, n, k}, pool);
      expect_matmul(x, w, with_bias ? bias.data() : nullptr, out.data(), m, n, k);
    }
  }
}

TEST_F(CpuOps, LmHeadComputesOnlyTheRequestedRows) {
  const int tokens = 9, hidden = 37, vocab = 301;
  auto x = random_vec(tokens * hidden, rng), w = random_vec(vocab * hidden, rng);
  std::vector<int32_t> rows{8, 2, 2};
  std::vector<float> logits(rows.size() * vocab);
  launch_lm_head({x.data(), rows.data(), w.data(), logits.data(), static_cast<int>(rows.size()), hidden, vocab}, pool);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<float> xr(x.begin() + rows[r] * hidden, x.begin() + (rows[r] + 1) * hidden);
    expect_matmul(xr, w, nullptr, logits.data() + r * vocab, 1, vocab, hidden);
  }
}

TEST_F(CpuOps, LmHeadOnBf16WeightsEqualsFp32OnTheWidenedWeights) {
  const int tokens = 3, hidden = 45, vocab = 157;
  auto x = random_vec(tokens * hidden, rng);
  auto w = random_vec(vocab * hidden, rng);
  std::vector<Bf16Bits> w16(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &w[i], 4);
    w16[i].bits = static_cast<uint16_t>(bits >> 16);  // truncate: any bf16 value will do
    bits &= 0xffff0000u;
    std::memcpy(&w[i], &bits, 4);  // w now holds exactly the widened bf16 weights
  }
  std::vector<int32_t> rows{0, 2};
  std::vector<float> a(rows.size() * vocab), b(a.size());
  launch_lm_head({x.data(), rows.data(), w.data(), a.data(), 2, hidden, vocab}, pool);
  launch_lm_head(LmHeadParams<float, Bf16Bits>{x.data(), rows.data(), w16.data(), b.data(), 2, hidden, vocab}, pool);
  EXPECT_EQ(a, b);  // widening is exact and the arithmetic is the same
}

TEST_F(CpuOps, Swiglu) {
  const int rows = 3, width = 19;
  auto gu = random_vec(rows * 2 * width, rng, 4.0f);
  std::vector<float> out(rows * width);
  launch_swiglu({gu.data(), out.data(), rows, width}, pool);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < width; ++i) {
      double g = gu[r * 2 * width + i], u = gu[r * 2 * width + width + i];
      double want = g / (1 + std::exp(-g)) * u;
      ASSERT_NEAR(out[r * width + i], want, 1e-5 * (1 + std::fabs(want)));
    }
  }
}

// Reference q/k norm + rotate-half RoPE of one head's first rd dims (all by default), in double
// from the fp32 angle.
std::vector<double> ref_norm_rope(const float* v, const std::vector<float>& w, const std::vector<float>& inv_freq,
                                  int pos, float scaling, int hd, int rd = 0) {
  if (rd == 0) rd = hd;
  double ss = 0;
  for (int i = 0; i < hd; ++i) ss += static_cast<double>(v[i]) * v[i];
  double inv = 1.0 / std::sqrt(ss / hd + 1e-6);
  std::vector<double> n(hd), out(hd);
  for (int i = 0; i < hd; ++i) n[i] = out[i] = w[i] * v[i] * inv;
  for (int i = 0; i < rd / 2; ++i) {
    double angle = static_cast<float>(pos) * inv_freq[i];  // HF forms the angle in fp32
    double c = std::cos(angle) * scaling, s = std::sin(angle) * scaling;
    out[i] = n[i] * c - n[i + rd / 2] * s;
    out[i + rd / 2] = n[i + rd / 2] * c + n[i] * s;
  }
  return out;
}

TEST_F(CpuOps, QkNormRopeWritesQAndThePagedCache) {
  const int tokens = 5, qh = 4, kvh = 2, hd = 16, bs = 3, blocks = 6;
  auto qkv = random_vec(tokens * (qh + 2 * kvh) * hd, rng);
  auto qw = random_vec(hd, rng), kw = random_vec(hd, rng);
  std::vector<float> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / hd);
  std::vector<int32_t> positions{0, 1, 17, 700, 4095};
  std::vector<int64_t> slots{4, -1, 0, 17, 9};  // token 1 is not stored
  const float scaling = 1.13f;
  std::vector<float> q(tokens * qh * hd), kc(blocks * kvh * bs * hd, -99.0f), vc(kc.size(), -99.0f);
  QkNormRopeKvWriteParams<float> p{qkv.data(), qw.data(), kw.data(), positions.data(), inv_freq.data(), scaling,
                                   slots.data(), q.data(), kc.data(), vc.data(), tokens, qh, kvh, hd, bs, 1e-6f};
  launch_qk_norm_rope_kv_write(p, pool);
  const int row = (qh + 2 * kvh) * hd;
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < qh; ++h) {
      auto want = ref_norm_rope(&qkv[t * row + h * hd], qw, inv_freq, positions[t], scaling, hd);
      for (int i = 0; i < hd; ++i) ASSERT_NEAR(q[(t * qh + h) * hd + i], want[i], 2e-5 * (1 + std::fabs(want[i])));
    }
    if (slots[t] < 0) continue;
    int64_t block = slots[t] / bs, off = slots[t] % bs;
    for (int h = 0; h < kvh; ++h) {
      auto want = ref_norm_rope(&qkv[t * row + (qh + h) * hd], kw, inv_freq, positions[t], scaling, hd);
      const float* kslot = &kc[((block * kvh + h) * bs + off) * hd];
      const float* vslot = &vc[((block * kvh + h) * bs + off) * hd];
      for (int i = 0; i < hd; ++i) {
        ASSERT_NEAR(kslot[i], want[i], 2e-5 * (1 + std::fabs(want[i])));
        ASSERT_EQ(vslot[i], qkv[t * row + (qh + kvh + h) * hd + i]);
      }
    }
  }
  // Exactly 4 tokens x 2 heads x hd elements were written to each cache.
  EXPECT_EQ(std::count_if(kc.begin(), kc.end(), [](float v) { return v != -99.0f; }), 4 * kvh * hd);
}

TEST_F(CpuOps, QkNormRopeWithPartialRotaryTurnsOnlyTheFirstDims) {
  // Qwen3.5's shape in small: 8 of 32 dims rotate (pairs i, i + 4), the other 24 pass through.
  const int tokens = 3, qh = 2, kvh = 1, hd = 32, rd = 8, bs = 4, blocks = 2;
  auto qkv = random_vec(tokens * (qh + 2 * kvh) * hd, rng);
  auto qw = random_vec(hd, rng), kw = random_vec(hd, rng);
  std::vector<float> inv_freq(rd / 2);
  for (int i = 0; i < rd / 2; ++i) inv_freq[i] = std::pow(1e7f, -2.0f * i / rd);
  std::vector<int32_t> positions{0, 5, 300};
  std::vector<int64_t> slots{0, 1, 6};
  std::vector<float> q(tokens * qh * hd), kc(blocks * kvh * bs * hd), vc(kc.size());
  QkNormRopeKvWriteParams<float> p{qkv.data(), qw.data(), kw.data(), positions.data(), inv_freq.data(), 1.0f,
                                   slots.data(), q.data(), kc.data(), vc.data(), tokens, qh, kvh, hd, bs, 1e-6f};
  p.rotary_dim = rd;
  launch_qk_norm_rope_kv_write(p, pool);
  const int row = (qh + 2 * kvh) * hd;
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < qh; ++h) {
      auto want = ref_norm_rope(&qkv[t * row + h * hd], qw, inv_freq, positions[t], 1.0f, hd, rd);
      for (int i = 0; i < hd; ++i) ASSERT_NEAR(q[(t * qh + h) * hd + i], want[i], 2e-5 * (1 + std::fabs(want[i])));
    }
    auto want = ref_norm_rope(&qkv[t * row + qh * hd], kw, inv_freq, positions[t], 1.0f, hd, rd);
    const float* kslot = &kc[((slots[t] / bs * kvh) * bs + slots[t] % bs) * hd];
    for (int i = 0; i < hd; ++i) ASSERT_NEAR(kslot[i], want[i], 2e-5 * (1 + std::fabs(want[i])));
  }
  p.rotary_dim = 7;  // not a whole number of pairs
  EXPECT_THROW(launch_qk_norm_rope_kv_write(p, pool), Error);
}

// Paged attention for a mixed batch, against attention over the logical (unpaged) sequences.
void check_paged_attention(int block_size, std::mt19937& rng, ThreadPool& pool) {
  const int qh = 6, kvh = 2, hd = 12;
  struct SeqSpec { int num_new, context; };
  const std::vector<SeqSpec> specs{{1, 20}, {7, 7}, {5, 12}, {1, 1}, {3, 40}};
  const int max_ctx = 40;
  const int max_blocks = (max_ctx + block_size - 1) / block_size;
  const int num_blocks = max_blocks * static_cast<int>(specs.size());
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<float> kc = random_vec(static_cast<size_t>(num_blocks) * kvh * block_size * hd, rng);
  std::vector<float> vc = random_vec(kc.size(), rng);
  std::vector<int32_t> starts{0}, ctx, tables(specs.size() * max_blocks, 0);
  for (size_t s = 0; s < specs.size(); ++s) {
    starts.push_back(starts.back() + specs[s].num_new);
    ctx.push_back(specs[s].context);
    for (int b = 0; b < max_blocks; ++b) tables[s * max_blocks + b] = ids[s * max_blocks + b];
  }
  const int tokens = starts.back();
  auto q = random_vec(tokens * qh * hd, rng);
  std::vector<float> out(q.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  PagedAttentionParams<float> p{q.data(), kc.data(), vc.data(), starts.data(), ctx.data(), tables.data(), out.data(),
                                static_cast<int>(specs.size()), tokens, qh, kvh, hd, block_size, max_blocks, scale};
  launch_paged_attention(p, pool);
  for (size_t s = 0; s < specs.size(); ++s) {
    auto at = [&](const std::vector<float>& cache, int pos, int h) {
      int block = tables[s * max_blocks + pos / block_size];
      return &cache[((static_cast<int64_t>(block) * kvh + h) * block_size + pos % block_size) * hd];
    };
    for (int j = 0; j < specs[s].num_new; ++j) {
      const int t = starts[s] + j, visible = specs[s].context - specs[s].num_new + j + 1;
      for (int h = 0; h < qh; ++h) {
        const int kv = h / (qh / kvh);
        std::vector<double> scores(visible);
        double mx = -1e300;
        for (int pos = 0; pos < visible; ++pos) {
          double d = 0;
          for (int i = 0; i < hd; ++i) d += static_cast<double>(q[(t * qh + h) * hd + i]) * at(kc, pos, kv)[i];
          scores[pos] = d * scale;
          mx = std::max(mx, scores[pos]);
        }
        double sum = 0;
        for (double& sc : scores) sum += (sc = std::exp(sc - mx));
        for (int i = 0; i < hd; ++i) {
          double want = 0;
          for (int pos = 0; pos < visible; ++pos) want += scores[pos] / sum * at(vc, pos, kv)[i];
          ASSERT_NEAR(out[(t * qh + h) * hd + i], want, 2e-5) << "block_size " << block_size << " seq " << s
                                                             << " token " << j << " head " << h;
        }
      }
    }
  }
}

TEST_F(CpuOps, PagedAttentionAcrossBlockSizesAndShuffledTables) {
  for (int bs : {1, 3, 4, 16, 64}) check_paged_attention(bs, rng, pool);
}

TEST_F(CpuOps, RouterTopkSoftmaxAndRenormalisation) {
  const int tokens = 4, experts = 9, k = 3;
  auto logits = random_vec(tokens * experts, rng, 2.0f);
  for (int e = 0; e < experts; ++e) logits[3 * experts + e] = 0.5f;  // all tied: lowest ids win
  for (bool renorm : {false, true}) {
    std::vector<int32_t> ids(tokens * k);
    std::vector<float> w(tokens * k);
    launch_moe_router_topk({logits.data(), ids.data(), w.data(), tokens, experts, k, renorm}, pool);
    for (int t = 0; t < tokens; ++t) {
      std::vector<double> prob(experts);
      double mx = *std::max_element(&logits[t * experts], &logits[t * experts] + experts), sum = 0;
      for (int e = 0; e < experts; ++e) sum += (prob[e] = std::exp(logits[t * experts + e] - mx));
      for (double& pr : prob) pr /= sum;
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return prob[a] > prob[b]; });
      double top = 0;
      for (int j = 0; j < k; ++j) top += prob[order[j]];
      for (int j = 0; j < k; ++j) {
        ASSERT_EQ(ids[t * k + j], order[j]) << "token " << t;
        ASSERT_NEAR(w[t * k + j], renorm ? prob[order[j]] / top : prob[order[j]], 1e-6);
      }
    }
  }
}

// The shared expert as more experts: its gate logit in one more column, left out of the softmax,
// and one route per part (ids num_experts and up, weight sigmoid(logit)) after the top_k the plain
// router picks from the other columns.
TEST_F(CpuOps, RouterTopkSharedExpertRoutes) {
  const int tokens = 5, experts = 9, k = 3;
  auto logits = random_vec(tokens * (experts + 1), rng, 2.0f);
  for (int parts : {1, 2}) {
    for (bool renorm : {false, true}) {
      const int routes = k + parts;
      std::vector<float> plain_logits;
      for (int t = 0; t < tokens; ++t) {
        const float* row = &logits[t * (experts + 1)];
        plain_logits.insert(plain_logits.end(), row, row + experts);
      }
      std::vector<int32_t> plain_ids(tokens * k), ids(tokens * routes);
      std::vector<float> plain_w(tokens * k), w(tokens * routes);
      launch_moe_router_topk(
          {plain_logits.data(), plain_ids.data(), plain_w.data(), tokens, experts, k, renorm}, pool);
      launch_moe_router_topk(
          {logits.data(), ids.data(), w.data(), tokens, experts, k, renorm, parts}, pool);
      for (int t = 0; t < tokens; ++t) {
        for (int j = 0; j < k; ++j) {
          EXPECT_EQ(ids[t * routes + j], plain_ids[t * k + j]);
          EXPECT_EQ(w[t * routes + j], plain_w[t * k + j]);
        }
        for (int i = 0; i < parts; ++i) {
          EXPECT_EQ(ids[t * routes + k + i], experts + i);
          const double gate = logits[t * (experts + 1) + experts];
          EXPECT_NEAR(w[t * routes + k + i], 1.0 / (1.0 + std::exp(-gate)), 1e-6);
        }
      }
    }
  }
}

// The combine with the gated extra term and the next norm fused: the combine, the sigmoid gate's
// accumulate, then RMSNorm with the residual.
TEST_F(CpuOps, MoeCombineWithNormIsCombineThenNorm) {
  const int tokens = 3, hidden = 8, k = 2;
  auto expert_out = random_vec(tokens * k * hidden, rng), weights = random_vec(tokens * k, rng);
  auto residual = random_vec(tokens * hidden, rng), norm = random_vec(hidden, rng);
  auto extra = random_vec(tokens * hidden, rng), extra_gate = random_vec(tokens, rng);
  std::vector<int32_t> index{5, 0, 1, 4, 3, 2};
  std::vector<float> out(tokens * hidden), normed(out.size()), fused_residual = residual;
  MoeUnpermuteCombineParams<float> c{expert_out.data(), index.data(), weights.data(), out.data(),
                                     tokens, hidden, k};
  c.extra = extra.data();
  c.extra_gate = extra_gate.data();
  c.residual = fused_residual.data();
  c.norm_weight = norm.data();
  c.normed = normed.data();
  launch_moe_unpermute_combine(c, pool);
  std::vector<float> out_ref(out.size()), normed_ref(out.size());
  launch_moe_unpermute_combine({expert_out.data(), index.data(), weights.data(), out_ref.data(),
                                tokens, hidden, k},
                               pool);
  launch_sigmoid_gate({extra.data(), extra_gate.data(), out_ref.data(), tokens, hidden, 1, true},
                      pool);
  launch_rms_norm({out_ref.data(), residual.data(), norm.data(), normed_ref.data(), tokens, hidden,
                   1e-6f},
                  pool);
  EXPECT_EQ(out, out_ref);
  EXPECT_EQ(fused_residual, residual);
  EXPECT_EQ(normed, normed_ref);
}

TEST_F(CpuOps, MoePermuteGroupedMatmulCombineWithEmptyExperts) {
  const int tokens = 5, hidden = 13, experts = 7, k = 2, n = 11;
  // Experts 0, 4 and 6 get nothing; expert 2 gets a row from every token.
  std::vector<int32_t> topk{2, 5, 1, 2, 2, 3, 5, 2, 2, 1};
  auto x = random_vec(tokens * hidden, rng);
  auto weights = random_vec(tokens * k, rng);
  std::vector<float> px(tokens * k * hidden);
  std::vector<int32_t> pidx(tokens * k), offsets(experts + 1);
  launch_moe_permute({x.data(), topk.data(), px.data(), pidx.data(), offsets.data(), tokens, hidden, experts, k}, pool);
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 0, 2, 7, 8, 8, 10, 10}));
  for (int r = 0; r < tokens * k; ++r) {
    const int e = topk[r];
    ASSERT_GE(pidx[r], offsets[e]);
    ASSERT_LT(pidx[r], offsets[e + 1]);
    for (int prev = 0; prev < r; ++prev) {
      if (topk[prev] == e) {
        ASSERT_LT(pidx[prev], pidx[r]) << "rows of one expert must stay in (token, k) order";
      }
    }
    for (int i = 0; i < hidden; ++i) ASSERT_EQ(px[pidx[r] * hidden + i], x[(r / k) * hidden + i]);
  }
  std::vector<int32_t> sorted = pidx;
  std::sort(sorted.begin(), sorted.end());
  for (int r = 0; r < tokens * k; ++r) ASSERT_EQ(sorted[r], r) << "permutation is not a bijection";

  auto w = random_vec(experts * n * hidden, rng);
  std::vector<float> y(tokens * k * n);
  launch_moe_grouped_matmul({px.data(), w.data(), offsets.data(), y.data(), tokens * k, experts, n, hidden}, pool);
  for (int e = 0; e < experts; ++e) {
    for (int r = offsets[e]; r < offsets[e + 1]; ++r) {
      std::vector<float> xr(px.begin() + r * hidden, px.begin() + (r + 1) * hidden);
      std::vector<float> we(w.begin() + e * n * hidden, w.begin() + (e + 1) * n * hidden);
      expect_matmul(xr, we, nullptr, y.data() + r * n, 1, n, hidden);
    }
  }

  std::vector<float> out(tokens * n);
  launch_moe_unpermute_combine({y.data(), pidx.data(), weights.data(), out.data(), tokens, n, k}, pool);
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < n; ++i) {
      double want = 0;
      for (int j = 0; j < k; ++j) want += static_cast<double>(weights[t * k + j]) * y[pidx[t * k + j] * n + i];
      ASSERT_NEAR(out[t * n + i], want, 1e-5 * (1 + std::fabs(want)));
    }
  }
}

TEST_F(CpuOps, LocalizeExpertsKeepsThisRanksExpertsAndMakesTheRestAbsent) {
  // Rank 1 of 4 over 8 experts holds experts 2 and 3; absent id = 2.
  std::vector<int32_t> ids{2, 5, 3, 0, 7, 1};
  std::vector<float> w{0.5f, 0.25f, 0.125f, 0.75f, 0.5f, 0.5f};
  launch_moe_localize_experts({ids.data(), w.data(), 6, 2, 2}, pool);
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 2, 1, 2, 2, 2}));
  EXPECT_EQ(w, (std::vector<float>{0.5f, 0.0f, 0.125f, 0.0f, 0.0f, 0.0f}));
}

TEST_F(CpuOps, CombineSkipsWeightZeroRowsEvenWhenTheyHoldNaN) {
  // Two tokens, top 2; row 3 (an absent expert's, never computed) holds NaN with weight 0.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> expert_out{1, 2, 3, 4, 5, 6, nan, nan};
  std::vector<int32_t> pidx{0, 3, 1, 2};
  std::vector<float> weights{0.5f, 0.0f, 1.0f, 2.0f};
  std::vector<float> out(4);
  launch_moe_unpermute_combine({expert_out.data(), pidx.data(), weights.data(), out.data(), 2, 2, 2},
                               pool);
  EXPECT_EQ(out, (std::vector<float>{0.5f, 1.0f, 13.0f, 16.0f}));
}

TEST_F(CpuOps, GroupedMatmulWithNoRowsIsANoOp) {
  std::vector<int32_t> offsets(5, 0);
  float sentinel = 42.0f;
  launch_moe_grouped_matmul({nullptr, nullptr, offsets.data(), &sentinel, 0, 4, 3, 2}, pool);
  EXPECT_EQ(sentinel, 42.0f);
}

// ---- LiveRows bounds (ops.h): ops over a fixed-capacity buffer touch only its live rows ----

TEST_F(CpuOps, LiveRowMapWalksTheLiveRowsInRowOrder) {
  // 10 rows in regions of 4 (the last holds 2): counts above a region's size mean all of it, and
  // negative counts none.
  const std::vector<int32_t> counts{2, 0, 5};
  const LiveRows live{counts.data(), 4};
  const LiveRowMap map = live_row_map(live, 10);
  ASSERT_EQ(map.total(), 4);
  std::vector<int64_t> rows;
  for (int v = 0; v < map.total(); ++v) rows.push_back(map.row(v));
  EXPECT_EQ(rows, (std::vector<int64_t>{0, 1, 8, 9}));
  for (int64_t r = 0; r < 10; ++r)
    EXPECT_EQ(is_live_row(live, r), std::find(rows.begin(), rows.end(), r) != rows.end()) << r;

  const std::vector<int32_t> none{-3, 0};
  EXPECT_EQ(live_row_map({none.data(), 5}, 10).total(), 0);
  EXPECT_FALSE(is_live_row({none.data(), 5}, 0));
  // One region bounds a prefix; no bound is every row.
  const int32_t n = 3;
  EXPECT_EQ(live_row_map({&n, 7}, 7).total(), 3);
  EXPECT_EQ(live_row_map({&n, 7}, 7).row(2), 2);
  EXPECT_FALSE(is_live_row({&n, 7}, 3));
  EXPECT_EQ(live_row_map({}, 7).total(), 7);
  EXPECT_EQ(live_row_map({}, 7).row(6), 6);
  EXPECT_TRUE(is_live_row({}, 6));

  EXPECT_TRUE(live_rows_valid({counts.data(), 2}, 16));
  EXPECT_FALSE(live_rows_valid({counts.data(), 2}, 17));  // 9 regions
  EXPECT_FALSE(live_rows_valid({counts.data(), 0}, 4));
}

// Tokens of a DP + EP receive buffer: `regions` regions of `slots` tokens, region g filled up to
// counts[g]. Dead tokens hold garbage the bounded ops must not read: ids out of range, NaN rows.
struct ReceiveBuffer {
  int slots, tokens;
  std::vector<int32_t> counts, ids, live;  // live: the live tokens, in order
  std::vector<float> x;
};

ReceiveBuffer receive_buffer(std::vector<int32_t> counts, int slots, int experts, int k, int hidden,
                             std::mt19937& rng) {
  ReceiveBuffer b{slots, static_cast<int>(counts.size()) * slots, std::move(counts), {}, {}, {}};
  b.ids.assign(static_cast<size_t>(b.tokens) * k, 1 << 20);
  b.x.assign(static_cast<size_t>(b.tokens) * hidden, std::numeric_limits<float>::quiet_NaN());
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int t = 0; t < b.tokens; ++t) {
    if (!is_live_row({b.counts.data(), slots}, t)) continue;
    b.live.push_back(t);
    std::vector<int32_t> pick(experts);
    std::iota(pick.begin(), pick.end(), 0);
    std::shuffle(pick.begin(), pick.end(), rng);
    std::copy_n(pick.begin(), k, b.ids.begin() + static_cast<size_t>(t) * k);
    for (int i = 0; i < hidden; ++i) b.x[static_cast<size_t>(t) * hidden + i] = d(rng);
  }
  return b;
}

TEST_F(CpuOps, BoundedPermuteIsThePermuteOfTheLiveTokensAlone) {
  const int experts = 5, k = 2, hidden = 6, slots = 4;
  for (const std::vector<int32_t>& counts :
       {std::vector<int32_t>{2, 0, 3}, std::vector<int32_t>{4, 9, -1},
        std::vector<int32_t>{0, 0}}) {
    for (bool skip_last_expert : {false, true}) {
      ReceiveBuffer b = receive_buffer(counts, slots, experts, k, hidden, rng);
      const int live = static_cast<int>(b.live.size());
      // The reference: the unbounded op on the live tokens packed together.
      std::vector<int32_t> ids_c;
      std::vector<float> x_c;
      for (int t : b.live) {
        ids_c.insert(ids_c.end(), b.ids.begin() + t * k, b.ids.begin() + (t + 1) * k);
        x_c.insert(x_c.end(), b.x.begin() + t * hidden, b.x.begin() + (t + 1) * hidden);
      }
      std::vector<float> px_c(static_cast<size_t>(live) * k * hidden);
      std::vector<int32_t> pidx_c(static_cast<size_t>(live) * k), off_c(experts + 1);
      launch_moe_permute({x_c.data(), ids_c.data(), px_c.data(), pidx_c.data(), off_c.data(), live,
                          hidden, experts, k},
                         pool);

      const float sentinel = 42.0f;
      std::vector<float> px(static_cast<size_t>(b.tokens) * k * hidden, sentinel);
      std::vector<int32_t> pidx(static_cast<size_t>(b.tokens) * k, -7), off(experts + 1, -7);
      MoePermuteParams<float> p{b.x.data(),  b.ids.data(), px.data(),
                                pidx.data(), off.data(),   b.tokens,
                                hidden,      experts,      k};
      p.live_tokens = {b.counts.data(), slots};
      // The last expert as an EP rank's absent one: its rows are placed but not copied.
      if (skip_last_expert) p.copied_rows = {&off[experts - 1], b.tokens * k};
      launch_moe_permute(p, pool);
      EXPECT_EQ(off, off_c);
      for (int c = 0; c < live; ++c)
        for (int j = 0; j < k; ++j) EXPECT_EQ(pidx[b.live[c] * k + j], pidx_c[c * k + j]);
      for (int t = 0; t < b.tokens; ++t) {
        if (std::find(b.live.begin(), b.live.end(), t) != b.live.end()) continue;
        for (int j = 0; j < k; ++j) EXPECT_EQ(pidx[t * k + j], -7) << "dead token " << t;
      }
      const int copied = skip_last_expert ? off_c[experts - 1] : live * k;
      for (size_t i = 0; i < px.size(); ++i) {
        if (i < static_cast<size_t>(copied) * hidden)
          ASSERT_EQ(px[i], px_c[i]) << "permuted element " << i;
        else
          ASSERT_EQ(px[i], sentinel) << "permuted element " << i << " was written";
      }
    }
  }
}

TEST_F(CpuOps, BoundedCombineWritesOnlyTheLiveTokens) {
  const int k = 3, hidden = 5, slots = 3;
  const std::vector<int32_t> counts{1, 3, 0, 2};
  const int tokens = static_cast<int>(counts.size()) * slots, rows = tokens * k;
  auto expert_out = random_vec(static_cast<size_t>(rows) * hidden, rng);
  auto weights = random_vec(static_cast<size_t>(rows), rng);
  std::vector<int32_t> pidx(rows);
  std::iota(pidx.begin(), pidx.end(), 0);
  std::shuffle(pidx.begin(), pidx.end(), rng);
  std::vector<float> want(static_cast<size_t>(tokens) * hidden);
  launch_moe_unpermute_combine(
      {expert_out.data(), pidx.data(), weights.data(), want.data(), tokens, hidden, k}, pool);
  // Dead tokens' index and weights are garbage the bounded op must not follow.
  const LiveRows live{counts.data(), slots};
  for (int t = 0; t < tokens; ++t) {
    if (is_live_row(live, t)) continue;
    for (int j = 0; j < k; ++j) {
      pidx[t * k + j] = 1 << 28;
      weights[t * k + j] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  std::vector<float> out(want.size(), 42.0f);
  MoeUnpermuteCombineParams<float> p{
      expert_out.data(), pidx.data(), weights.data(), out.data(), tokens, hidden, k};
  p.live_tokens = live;
  launch_moe_unpermute_combine(p, pool);
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < hidden; ++i) {
      const size_t at = static_cast<size_t>(t) * hidden + i;
      EXPECT_EQ(out[at], is_live_row(live, t) ? want[at] : 42.0f) << "token " << t;
    }
  }
}

TEST_F(CpuOps, BoundedSwigluComputesOnlyTheLiveRows) {
  const int rows = 9, width = 7;
  auto gu = random_vec(static_cast<size_t>(rows) * 2 * width, rng, 4.0f);
  std::vector<float> want(static_cast<size_t>(rows) * width);
  launch_swiglu({gu.data(), want.data(), rows, width}, pool);
  const int32_t prefix = 4;                    // the rows of an EP rank's own experts
  const std::vector<int32_t> counts{2, 0, 1};  // regions of 3 rows
  for (const LiveRows& live : {LiveRows{&prefix, rows}, LiveRows{counts.data(), 3}}) {
    std::vector<float> in = gu;
    for (int r = 0; r < rows; ++r) {
      if (is_live_row(live, r)) continue;
      std::fill_n(in.begin() + static_cast<size_t>(r) * 2 * width, 2 * width,
                  std::numeric_limits<float>::quiet_NaN());
    }
    std::vector<float> out(want.size(), 42.0f);
    SwigluParams<float> p{in.data(), out.data(), rows, width};
    p.live_rows = live;
    launch_swiglu(p, pool);
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < width; ++i) {
        const size_t at = static_cast<size_t>(r) * width + i;
        EXPECT_EQ(out[at], is_live_row(live, r) ? want[at] : 42.0f) << "row " << r;
      }
    }
  }
}

// The fused gate_up + SwiGLU form is the grouped matmul then swiglu, over the experts' rows only:
// rows past expert_offsets[num_experts] (an EP rank's absent experts) stay untouched.
TEST_F(CpuOps, GroupedMatmulWithSwigluIsTheTwoOpsInTurn) {
  const int experts = 3, n = 10, k = 16, rows = 7;
  const std::vector<int32_t> offsets{0, 2, 2, 5};  // rows 5 and 6 belong to no expert here
  auto x = random_vec(static_cast<size_t>(rows) * k, rng, 1.0f);
  auto w = random_vec(static_cast<size_t>(experts) * n * k, rng, 0.3f);
  std::vector<float> gate_up(static_cast<size_t>(rows) * n, 0.0f), want(static_cast<size_t>(rows) * n / 2, 42.0f);
  launch_moe_grouped_matmul({x.data(), w.data(), offsets.data(), gate_up.data(), rows, experts, n, k}, pool);
  launch_swiglu({gate_up.data(), want.data(), offsets.back(), n / 2}, pool);
  std::vector<float> out(want.size(), 42.0f);
  MoeGroupedMatmulParams<float> p{x.data(), w.data(), offsets.data(), out.data(), rows, experts, n, k};
  p.swiglu = true;
  launch_moe_grouped_matmul(p, pool);
  EXPECT_EQ(out, want);
  p.n = 9;
  EXPECT_THROW(launch_moe_grouped_matmul(p, pool), relay::Error);
}

// The gathered form reads the unpermuted tokens through the permute's index: the same products as
// the permute's row copy followed by the grouped matmul.
TEST_F(CpuOps, GroupedMatmulOnGatheredRowsEqualsThePermutedCopy) {
  const int tokens = 5, k_top = 2, experts = 4, n = 6, k = 8, rows = tokens * k_top;
  const std::vector<int32_t> ids{3, 0, 1, 3, 0, 2, 3, 1, 2, 0};
  auto x = random_vec(static_cast<size_t>(tokens) * k, rng, 1.0f);
  auto w = random_vec(static_cast<size_t>(experts) * n * k, rng, 0.3f);
  std::vector<float> px(static_cast<size_t>(rows) * k);
  std::vector<int32_t> pidx(rows), offsets(experts + 1);
  launch_moe_permute({x.data(), ids.data(), px.data(), pidx.data(), offsets.data(), tokens, k, experts, k_top}, pool);
  std::vector<float> want(static_cast<size_t>(rows) * n), out(want.size(), 42.0f);
  launch_moe_grouped_matmul({px.data(), w.data(), offsets.data(), want.data(), rows, experts, n, k}, pool);
  MoeGroupedMatmulParams<float> p{x.data(), w.data(), offsets.data(), out.data(), rows, experts, n, k};
  p.permuted_index = pidx.data();
  p.top_k = k_top;
  launch_moe_grouped_matmul(p, pool);
  EXPECT_EQ(out, want);
  pidx[3] = rows;  // not a permuted row
  EXPECT_THROW(launch_moe_grouped_matmul(p, pool), relay::Error);
}

}  // namespace
}  // namespace relay::kernels

// The CPU kernels of the hybrid models (Qwen3.5 / Qwen3-Next) against straightforward double
// references: the sigmoid gate, the causal conv1d and the gated delta rule with per-sequence state
// slots (fresh and continued, sequences of 1 to 9 tokens in one batch), and the gated RMSNorm.
// The stateful ops must also give the same outputs and states, bit for bit, however a sequence's
// tokens are cut into steps: a prefill in one call equals its tokens fed one call at a time.
//
// Tolerances as test_cpu_ops.cpp: fp32 rounding over short sums is far below 1e-5 relative; an
// indexing or formula mistake is O(1).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/ops.h"
#include "random_vec.h"

namespace relay::kernels {
namespace {

double silu(double x) { return x / (1.0 + std::exp(-x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

class HybridOps : public ::testing::Test {
 protected:
  ThreadPool pool{2};
  std::mt19937 rng{2025};
};

TEST_F(HybridOps, SigmoidGatePerColumnAndPerRowAccumulated) {
  const int rows = 5, width = 24;
  auto x = random_vec(rows * width, rng, 2.0f);
  for (int gate_width : {24, 6, 1}) {
    auto gate = random_vec(rows * gate_width, rng, 3.0f);
    auto base = random_vec(rows * width, rng);
    for (bool accumulate : {false, true}) {
      std::vector<float> out = base;
      launch_sigmoid_gate({x.data(), gate.data(), out.data(), rows, width, gate_width, accumulate},
                          pool);
      for (int r = 0; r < rows; ++r) {
        for (int i = 0; i < width; ++i) {
          const double g = sigmoid(gate[r * gate_width + i / (width / gate_width)]);
          const double want = (accumulate ? base[r * width + i] : 0.0) + x[r * width + i] * g;
          ASSERT_NEAR(out[r * width + i], want, 1e-5 * (1 + std::fabs(want)))
              << "gate_width " << gate_width << " accumulate " << accumulate;
        }
      }
    }
  }
  // In place, as gated attention runs it.
  auto gate = random_vec(rows * width, rng);
  std::vector<float> y = x;
  launch_sigmoid_gate({y.data(), gate.data(), y.data(), rows, width, width}, pool);
  for (int i = 0; i < rows * width; ++i) ASSERT_NEAR(y[i], x[i] * sigmoid(gate[i]), 1e-5);
}

// A batch of sequences over state slots: sequence s has lengths[s] new tokens, slot slots[s],
// and starts fresh when fresh[s]; snapshots (when not empty) names, per token, the slot that gets a
// copy of the state after it (-1: none).
struct Batch {
  std::vector<int32_t> starts{0}, slots, snapshots;
  std::vector<uint8_t> fresh;
  int num_tokens() const { return starts.back(); }
  int num_seqs() const { return static_cast<int>(slots.size()); }
  static Batch of(const std::vector<int>& lengths, const std::vector<int32_t>& slots,
                  const std::vector<uint8_t>& fresh) {
    Batch b;
    for (int n : lengths) b.starts.push_back(b.starts.back() + n);
    b.slots = slots;
    b.fresh = fresh;
    return b;
  }
};

// Conv: channels as the model has them (x is the wider in_proj output, read with a stride).
struct ConvCase {
  int conv_dim = 37, kernel = 4, x_stride = 45;
  std::vector<float> weight;
};

void run_conv(const ConvCase& cc, const Batch& b, const float* x, float* states, int64_t stride,
              float* out, ThreadPool& pool) {
  CausalConv1dParams<float> p;
  p.x = x;
  p.x_stride = cc.x_stride;
  p.weight = cc.weight.data();
  p.conv_states = states;
  p.state_stride = stride;
  p.query_starts = b.starts.data();
  p.state_slots = b.slots.data();
  p.state_fresh = b.fresh.data();
  p.snapshot_slots = b.snapshots.empty() ? nullptr : b.snapshots.data();
  p.out = out;
  p.num_seqs = b.num_seqs();
  p.num_tokens = b.num_tokens();
  p.conv_dim = cc.conv_dim;
  p.kernel_size = cc.kernel;
  launch_causal_conv1d(p, pool);
}

TEST_F(HybridOps, CausalConv1dContinuesEachSlotsStateAndRestartsFreshOnes) {
  for (int kernel : {4, 2, 1}) {
    ConvCase cc;
    cc.kernel = kernel;
    cc.weight = random_vec(cc.conv_dim * kernel, rng, 0.5f);
    const int width = kernel - 1, num_slots = 5;
    const int64_t stride = static_cast<int64_t>(cc.conv_dim) * width + 3;  // slots need not pack
    const Batch b = Batch::of({1, 9, 2, 5}, {3, 0, 4, 1}, {0, 1, 0, 1});
    std::vector<float> states = random_vec(num_slots * stride, rng);
    const std::vector<float> before = states;
    const auto x = random_vec(b.num_tokens() * cc.x_stride, rng);
    std::vector<float> out(b.num_tokens() * cc.conv_dim);
    run_conv(cc, b, x.data(), states.data(), stride, out.data(), pool);
    for (int s = 0; s < b.num_seqs(); ++s) {
      const float* old = before.data() + b.slots[s] * stride;
      for (int c = 0; c < cc.conv_dim; ++c) {
        // The sequence's input history for channel c: the state (or zeros), then its tokens.
        std::vector<double> in;
        for (int j = 0; j < width; ++j) in.push_back(b.fresh[s] ? 0.0 : old[c * width + j]);
        for (int t = b.starts[s]; t < b.starts[s + 1]; ++t) in.push_back(x[t * cc.x_stride + c]);
        for (int t = b.starts[s]; t < b.starts[s + 1]; ++t) {
          const int at = t - b.starts[s];  // in[at .. at + width] is the window of token t
          double acc = 0;
          for (int j = 0; j < kernel; ++j) acc += cc.weight[c * kernel + j] * in[at + j];
          ASSERT_NEAR(out[t * cc.conv_dim + c], silu(acc), 1e-5 * (1 + std::fabs(acc)))
              << "kernel " << kernel << " seq " << s << " channel " << c;
        }
        const float* now = states.data() + b.slots[s] * stride;
        for (int j = 0; j < width; ++j) {
          ASSERT_EQ(now[c * width + j], static_cast<float>(in[in.size() - width + j]))
              << "kernel " << kernel << " seq " << s << " channel " << c << " column " << j;
        }
      }
    }
    // Slot 2 belongs to no sequence: untouched, as are the gaps between slots.
    for (int64_t i = 2 * stride; i < 3 * stride; ++i) ASSERT_EQ(states[i], before[i]);
    for (int slot = 0; slot < num_slots; ++slot) {
      for (int64_t i = static_cast<int64_t>(cc.conv_dim) * width; i < stride; ++i) {
        ASSERT_EQ(states[slot * stride + i], before[slot * stride + i]);
      }
    }
  }
}

// Gated delta rule, with value heads sharing key heads (group 2) and odd head dims.
struct DeltaCase {
  int k_heads = 2, v_heads = 4, dk = 5, dv = 7, gate_stride = 11;
  std::vector<float> a_log, dt_bias;
  int row() const { return 2 * k_heads * dk + v_heads * dv; }
  int64_t state_elements() const { return static_cast<int64_t>(v_heads) * dk * dv; }
};

void run_delta(const DeltaCase& dc, const Batch& b, const float* qkv, const float* gates,
               float* states, int64_t stride, float* out, ThreadPool& pool) {
  GatedDeltaRuleParams<float> p;
  p.qkv = qkv;
  p.b = gates;
  p.a = gates + dc.v_heads;
  p.gate_stride = dc.gate_stride;
  p.a_log = dc.a_log.data();
  p.dt_bias = dc.dt_bias.data();
  p.states = states;
  p.state_stride = stride;
  p.query_starts = b.starts.data();
  p.state_slots = b.slots.data();
  p.state_fresh = b.fresh.data();
  p.snapshot_slots = b.snapshots.empty() ? nullptr : b.snapshots.data();
  p.out = out;
  p.num_seqs = b.num_seqs();
  p.num_tokens = b.num_tokens();
  p.num_k_heads = dc.k_heads;
  p.num_v_heads = dc.v_heads;
  p.key_dim = dc.dk;
  p.value_dim = dc.dv;
  launch_gated_delta_rule(p, pool);
}

TEST_F(HybridOps, GatedDeltaRuleMatchesTheRecurrenceInDouble) {
  DeltaCase dc;
  dc.a_log = random_vec(dc.v_heads, rng);
  dc.dt_bias = random_vec(dc.v_heads, rng);
  const Batch b = Batch::of({1, 9, 3}, {2, 0, 1}, {0, 1, 0});
  const int64_t stride = dc.state_elements();
  std::vector<float> states = random_vec(3 * stride, rng, 0.3f);
  const std::vector<float> before = states;
  const auto qkv = random_vec(b.num_tokens() * dc.row(), rng);
  auto gates = random_vec(b.num_tokens() * dc.gate_stride, rng, 2.0f);
  gates[dc.v_heads] = 25.0f;  // softplus above its threshold of 20: the identity
  std::vector<float> out(b.num_tokens() * dc.v_heads * dc.dv);
  run_delta(dc, b, qkv.data(), gates.data(), states.data(), stride, out.data(), pool);

  const int group = dc.v_heads / dc.k_heads;
  for (int s = 0; s < b.num_seqs(); ++s) {
    for (int h = 0; h < dc.v_heads; ++h) {
      const int kh = h / group;
      std::vector<double> S(dc.dk * dc.dv, 0.0);
      if (!b.fresh[s]) {
        const float* old = before.data() + b.slots[s] * stride + h * dc.dk * dc.dv;
        for (int i = 0; i < dc.dk * dc.dv; ++i) S[i] = old[i];
      }
      for (int t = b.starts[s]; t < b.starts[s + 1]; ++t) {
        const float* row = qkv.data() + t * dc.row();
        std::vector<double> q(dc.dk), k(dc.dk);
        double qq = 0, kk = 0;
        for (int i = 0; i < dc.dk; ++i) {
          q[i] = row[kh * dc.dk + i];
          k[i] = row[(dc.k_heads + kh) * dc.dk + i];
          qq += q[i] * q[i];
          kk += k[i] * k[i];
        }
        for (int i = 0; i < dc.dk; ++i) {
          q[i] /= std::sqrt(qq + 1e-6) * std::sqrt(static_cast<double>(dc.dk));
          k[i] /= std::sqrt(kk + 1e-6);
        }
        const float* v = row + 2 * dc.k_heads * dc.dk + h * dc.dv;
        const double beta = sigmoid(gates[t * dc.gate_stride + h]);
        const double a = gates[t * dc.gate_stride + dc.v_heads + h] + dc.dt_bias[h];
        const double g =
            -std::exp(static_cast<double>(dc.a_log[h])) * (a > 20 ? a : std::log1p(std::exp(a)));
        for (double& x : S) x *= std::exp(g);
        for (int j = 0; j < dc.dv; ++j) {
          double pred = 0;
          for (int i = 0; i < dc.dk; ++i) pred += S[i * dc.dv + j] * k[i];
          const double delta = (v[j] - pred) * beta;
          for (int i = 0; i < dc.dk; ++i) S[i * dc.dv + j] += k[i] * delta;
        }
        for (int j = 0; j < dc.dv; ++j) {
          double o = 0;
          for (int i = 0; i < dc.dk; ++i) o += S[i * dc.dv + j] * q[i];
          ASSERT_NEAR(out[(t * dc.v_heads + h) * dc.dv + j], o, 2e-5 * (1 + std::fabs(o)))
              << "seq " << s << " head " << h << " token " << t << " dim " << j;
        }
      }
      const float* now = states.data() + b.slots[s] * stride + h * dc.dk * dc.dv;
      for (int i = 0; i < dc.dk * dc.dv; ++i) {
        ASSERT_NEAR(now[i], S[i], 2e-5 * (1 + std::fabs(S[i]))) << "seq " << s << " head " << h;
      }
    }
  }
}

// Both stateful ops (conv, then the rule) over n random tokens: each call runs the batch over the
// tokens from row `at` of the inputs, states in slots of `conv` / `ssm` (conv_stride / ssm_stride
// apart), outputs from row `at` of conv_out / out.
struct StatefulOps {
  ConvCase cc;
  DeltaCase dc;
  int64_t conv_stride = 0, ssm_stride = 0;
  std::vector<float> x, qkv, gates;
  StatefulOps(std::mt19937& rng, int n) {
    cc.weight = random_vec(cc.conv_dim * cc.kernel, rng, 0.5f);
    dc.a_log = random_vec(dc.v_heads, rng);
    dc.dt_bias = random_vec(dc.v_heads, rng);
    conv_stride = static_cast<int64_t>(cc.conv_dim) * (cc.kernel - 1);
    ssm_stride = dc.state_elements();
    x = random_vec(n * cc.x_stride, rng);
    qkv = random_vec(n * dc.row(), rng);
    gates = random_vec(n * dc.gate_stride, rng);
  }
  void run(const Batch& b, int at, float* conv, float* ssm, float* conv_out, float* out,
           ThreadPool& pool) const {
    run_conv(cc, b, x.data() + at * cc.x_stride, conv, conv_stride, conv_out + at * cc.conv_dim, pool);
    run_delta(dc, b, qkv.data() + at * dc.row(), gates.data() + at * dc.gate_stride, ssm,
              ssm_stride, out + at * dc.v_heads * dc.dv, pool);
  }
};

TEST_F(HybridOps, StatefulOpsGiveTheSameBitsInOneCallAndTokenByToken) {
  const int n = 11;
  const StatefulOps ops(rng, n);
  const int64_t conv_stride = ops.conv_stride, ssm_stride = ops.ssm_stride;
  const ConvCase& cc = ops.cc;
  const DeltaCase& dc = ops.dc;

  // One call over all n tokens, fresh, in slot 1 of 2.
  std::vector<float> conv_a(2 * conv_stride, 7.0f), ssm_a(2 * ssm_stride, 7.0f);
  std::vector<float> conv_out_a(n * cc.conv_dim), out_a(n * dc.v_heads * dc.dv);
  ops.run(Batch::of({n}, {1}, {1}), 0, conv_a.data(), ssm_a.data(), conv_out_a.data(), out_a.data(), pool);

  // The same tokens as 1 + 3 + 1 + 6, continuing the state of the first (fresh) call.
  std::vector<float> conv_b(2 * conv_stride, -3.0f), ssm_b(2 * ssm_stride, -3.0f);
  std::vector<float> conv_out_b(n * cc.conv_dim), out_b(n * dc.v_heads * dc.dv);
  int at = 0;
  for (int len : {1, 3, 1, 6}) {
    const Batch piece = Batch::of({len}, {1}, {static_cast<uint8_t>(at == 0)});
    ops.run(piece, at, conv_b.data(), ssm_b.data(), conv_out_b.data(), out_b.data(), pool);
    at += len;
  }
  EXPECT_EQ(conv_out_a, conv_out_b);
  EXPECT_EQ(out_a, out_b);
  EXPECT_TRUE(std::equal(conv_a.begin() + conv_stride, conv_a.end(), conv_b.begin() + conv_stride));
  EXPECT_TRUE(std::equal(ssm_a.begin() + ssm_stride, ssm_a.end(), ssm_b.begin() + ssm_stride));
}

// Graph padding: a sequence with slot -1 is computed from a zero state (as a fresh one) and
// leaves every slot of the pool as it was.
TEST_F(HybridOps, ASequenceWithoutASlotStartsFromZerosAndKeepsNothing) {
  const int n = 5;
  const StatefulOps ops(rng, n);
  const size_t conv_rows = n * ops.cc.conv_dim, rows = n * ops.dc.v_heads * ops.dc.dv;
  std::vector<float> conv_out(conv_rows), out(rows), conv_want(conv_rows), out_want(rows);
  std::vector<float> conv(2 * ops.conv_stride, 5.0f), ssm(2 * ops.ssm_stride, 5.0f);
  const std::vector<float> conv_before = conv, ssm_before = ssm;
  ops.run(Batch::of({n}, {-1}, {0}), 0, conv.data(), ssm.data(), conv_out.data(), out.data(), pool);
  EXPECT_EQ(conv, conv_before);
  EXPECT_EQ(ssm, ssm_before);
  ops.run(Batch::of({n}, {1}, {1}), 0, conv.data(), ssm.data(), conv_want.data(), out_want.data(), pool);
  EXPECT_EQ(conv_out, conv_want);
  EXPECT_EQ(out, out_want);
}

// Drafts' snapshots: one call over 8 tokens in slot 0, with rows 2, 5 and 7 copying their state
// into slots 1, 2 and 3, leaves in each exactly the state a call over the tokens up to that row
// leaves (so a rollback to a snapshot is as if the later tokens never ran); slot 4 is untouched.
TEST_F(HybridOps, SnapshotsHoldTheStateAfterTheirRow) {
  const int n = 8, num_slots = 5;
  const StatefulOps ops(rng, n);
  const int64_t conv_stride = ops.conv_stride, ssm_stride = ops.ssm_stride;
  std::vector<float> conv_out(n * ops.cc.conv_dim), out(n * ops.dc.v_heads * ops.dc.dv);

  std::vector<float> conv(num_slots * conv_stride, 5.0f), ssm(num_slots * ssm_stride, 5.0f);
  Batch whole = Batch::of({n}, {0}, {1});
  whole.snapshots.assign(n, -1);
  const std::vector<std::pair<int, int32_t>> snapshots{{2, 1}, {5, 2}, {7, 3}};
  for (const auto& [row, slot] : snapshots) whole.snapshots[row] = slot;
  ops.run(whole, 0, conv.data(), ssm.data(), conv_out.data(), out.data(), pool);

  for (const auto& [row, slot] : snapshots) {
    SCOPED_TRACE(::testing::Message() << "row " << row);
    std::vector<float> conv_p(conv_stride), ssm_p(ssm_stride);
    ops.run(Batch::of({row + 1}, {0}, {1}), 0, conv_p.data(), ssm_p.data(), conv_out.data(),
            out.data(), pool);
    EXPECT_TRUE(std::equal(conv_p.begin(), conv_p.end(), conv.begin() + slot * conv_stride));
    EXPECT_TRUE(std::equal(ssm_p.begin(), ssm_p.end(), ssm.begin() + slot * ssm_stride));
  }
  EXPECT_TRUE(std::equal(conv.begin(), conv.begin() + conv_stride, conv.begin() + 3 * conv_stride));
  EXPECT_TRUE(std::all_of(conv.begin() + 4 * conv_stride, conv.end(),
                          [](float v) { return v == 5.0f; }));
  EXPECT_TRUE(std::all_of(ssm.begin() + 4 * ssm_stride, ssm.end(),
                          [](float v) { return v == 5.0f; }));
}

TEST_F(HybridOps, GatedRmsNormNormalisesEachHeadThenGates) {
  const int tokens = 3, heads = 4, hd = 13, gate_stride = heads * hd + 5;
  const auto x = random_vec(tokens * heads * hd, rng, 3.0f);
  const auto gate = random_vec(tokens * gate_stride, rng, 2.0f);
  const auto weight = random_vec(hd, rng);
  for (bool in_place : {false, true}) {
    std::vector<float> y = in_place ? x : std::vector<float>(x.size());
    launch_gated_rms_norm({in_place ? y.data() : x.data(), gate.data(), gate_stride, weight.data(),
                           y.data(), tokens, heads, hd, 1e-6f},
                          pool);
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < heads; ++h) {
        const float* v = x.data() + (t * heads + h) * hd;
        double ss = 0;
        for (int i = 0; i < hd; ++i) ss += static_cast<double>(v[i]) * v[i];
        const double inv = 1.0 / std::sqrt(ss / hd + 1e-6);
        for (int i = 0; i < hd; ++i) {
          const double want = weight[i] * v[i] * inv * silu(gate[t * gate_stride + h * hd + i]);
          ASSERT_NEAR(y[(t * heads + h) * hd + i], want, 1e-5 * (1 + std::fabs(want)));
        }
      }
    }
  }
}

}  // namespace
}  // namespace relay::kernels

// The CUDA FP8 kernels (kernels/cuda/fp8_cuda.h) against the CPU references of kernels/fp8_ops.h.
//
// Both sides get identical inputs: bf16-rounded activations for the quantisers, and for the GEMMs
// the same e4m3 codes and scales (made by the CPU quantisers). Quantisers must match bit for bit;
// a GEMM element may differ from the fp32 reference by the bf16 rounding of the output and by the
// GPU's different summation order inside a k-block: |gpu - ref| <= 1e-2 |ref| + 1e-4 rms(ref).
// The wgmma kernels (cuBLASLt, CUTLASS) are held to a bound on the sum of |terms| instead
// (expect_wgmma_gemm_close). Outputs are poisoned with NaN first (gpu_test_util.h), so an unwritten
// element fails.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>

#include "kernels/cuda/fp8_cuda.h"
#include "kernels/ops.h"
#include "kernels/fp8_ops.h"
#include "quant/weight_quant.h"
#include "tests/gpu/gpu_test_util.h"

namespace relay::gpu_test {
namespace {

using kernels::bf16;
using kernels::GroupedGemmKind;

int groups_of(int k, int g) { return (k + g - 1) / g; }

// bf16-rounded random activations with occasional outliers, an all-zero group and a negative zero,
// so the quantisers see every branch.
Bf16Data activations(int rows, int k, std::mt19937& rng) {
  Bf16Data d = random_bf16(static_cast<size_t>(rows) * k, rng);
  for (size_t i = 0; i < d.f32.size(); ++i) {
    if (rng() % 97 == 0) d.f32[i] *= 30.0f;
  }
  if (k >= 128) std::fill(d.f32.begin(), d.f32.begin() + 128, 0.0f);
  if (d.f32.size() > 130) d.f32[130] = -0.0f;
  for (size_t i = 0; i < d.f32.size(); ++i) {
    __nv_bfloat16_raw raw;
    raw.x = f32_to_bf16(d.f32[i]);
    d.bits[i] = raw;
    d.f32[i] = bf16_to_f32(raw.x);
  }
  return d;
}

std::vector<float> random_weights(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> w(n);
  for (float& v : w) v = dist(rng) * (rng() % 64 == 0 ? 10.0f : 1.0f);
  return w;
}

// Element-wise check of a bf16 GPU output against the fp32 reference (see the file comment).
void expect_gemm_close(const std::vector<bf16>& gpu_bits, const std::vector<float>& ref,
                       const std::string& where) {
  const std::vector<float> gpu = to_f32(gpu_bits);
  ASSERT_EQ(gpu.size(), ref.size()) << where;
  double sq = 0.0;
  for (float r : ref) sq += static_cast<double>(r) * r;
  const double rms = ref.empty() ? 0.0 : std::sqrt(sq / ref.size());
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool ok = std::fabs(gpu[i] - ref[i]) <= 1e-2 * std::fabs(ref[i]) + 1e-4 * rms;
    if (!ok && bad++ == 0) first_bad = i;
  }
  EXPECT_EQ(bad, 0u) << where << ": " << bad << " of " << ref.size() << " elements off; first at "
                     << first_bad << ": " << (bad ? gpu[first_bad] : 0.0f) << " vs "
                     << (bad ? ref[first_bad] : 0.0f);
}

// e4m3 codes with the sign bit cleared: the reference GEMM on them (scales are positive) is the sum
// of |terms| of every output element.
std::vector<uint8_t> magnitudes(std::vector<uint8_t> codes) {
  for (uint8_t& v : codes) v &= 0x7F;
  return codes;
}

// NOTE: Hopper's FP8 tensor cores (wgmma) accumulate inside a 128-block of k with reduced precision
// (DeepSeek-V3, section 3.3.2), so the error of a wgmma kernel scales with the sum of |terms|, not
// with |result|, where Relay's mma.sync kernels meet the fp32 bound above. Measured on the H200
// with cuBLASLt (2026-12-03): worst |error| / sum|terms| 1.2e-3 to 3.1e-3, all within 2^-11 of the
// sum plus 2^-7 of |result| (bf16 output rounding included): the bound here. Prints the worst.
void expect_wgmma_gemm_close(const std::vector<bf16>& gpu_bits, const std::vector<float>& ref,
                             const std::vector<float>& abs_sum, const std::string& where) {
  const std::vector<float> got = to_f32(gpu_bits);
  ASSERT_EQ(got.size(), ref.size()) << where;
  ASSERT_EQ(abs_sum.size(), ref.size()) << where;
  size_t bad = 0, first_bad = 0;
  double worst = 0.0;  // the largest |error| / sum of |terms|
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(double(got[i]) - ref[i]);
    worst = std::max(worst, err / std::max(double(abs_sum[i]), 1e-30));
    // Written as !(err <= bound) so that a NaN (an unwritten element) fails.
    if (!(err <= 0x1p-11 * abs_sum[i] + 0x1p-7 * std::fabs(ref[i])) && bad++ == 0) first_bad = i;
  }
  std::cout << where << ": worst |error| / sum|terms| = " << worst << "\n";
  EXPECT_EQ(bad, 0u) << where << ": " << bad << " of " << ref.size() << " elements off; first at "
                     << first_bad << ": " << (bad ? got[first_bad] : 0.0f) << " vs "
                     << (bad ? ref[first_bad] : 0.0f) << " (sum of |terms| "
                     << (bad ? abs_sum[first_bad] : 0.0f) << ")";
}

// Activations quantised on the CPU: what both GEMM implementations are fed.
struct QuantisedActs {
  std::vector<uint8_t> q;
  std::vector<float> scale;
};
QuantisedActs quantise_acts(int rows, int k, std::mt19937& rng) {
  const Bf16Data x = activations(rows, k, rng);
  QuantisedActs a{std::vector<uint8_t>(x.f32.size()),
                  std::vector<float>(static_cast<size_t>(rows) * groups_of(k, 128))};
  kernels::launch_fp8_act_quant({x.f32.data(), a.q.data(), a.scale.data(), rows, k, 128}, pool());
  return a;
}

// Block-scaled expert weights [experts, n, k] with scales [experts, ceil(n/128), ceil(k/128)].
struct QuantisedWeights {
  std::vector<uint8_t> q;
  std::vector<float> scale;
};
QuantisedWeights quantise_weights(int experts, int n, int k, std::mt19937& rng) {
  const size_t per_expert = static_cast<size_t>(n) * k;
  const size_t scales_per_expert = static_cast<size_t>(groups_of(n, 128)) * groups_of(k, 128);
  QuantisedWeights w{std::vector<uint8_t>(per_expert * experts),
                     std::vector<float>(scales_per_expert * experts)};
  for (int e = 0; e < experts; ++e) {
    const std::vector<float> f = random_weights(per_expert, rng);
    kernels::quantize_weight_fp8_block(f.data(), n, k, 128, 128, w.q.data() + e * per_expert,
                                     w.scale.data() + e * scales_per_expert);
  }
  return w;
}

// Random expert sizes in [0, max_rows], with some experts empty.
std::vector<int32_t> random_offsets(int experts, int max_rows, double empty_fraction,
                                    std::mt19937& rng) {
  std::vector<int32_t> offsets(experts + 1, 0);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int e = 0; e < experts; ++e) {
    const int rows = u(rng) < empty_fraction ? 0 : static_cast<int>(rng() % (max_rows + 1));
    offsets[e + 1] = offsets[e] + rows;
  }
  return offsets;
}

// Uniform top-k routing of `tokens` tokens over `experts` (distinct experts per token).
std::vector<int32_t> routed_offsets(int tokens, int experts, int top_k, std::mt19937& rng) {
  std::vector<int32_t> offsets(experts + 1, 0);
  std::vector<int> ids(experts);
  for (int t = 0; t < tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int j = 0; j < top_k; ++j) {
      std::swap(ids[j], ids[j + rng() % (experts - j)]);
      ++offsets[ids[j] + 1];
    }
  }
  for (int e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  return offsets;
}


TEST(GpuFp8Kernels, ActQuantIsBitIdenticalToTheCpu) {
  std::mt19937 rng(21);
  for (auto [rows, k] : {std::pair{1, 128}, std::pair{1, 8}, std::pair{7, 136},
                         std::pair{300, 2056}, std::pair{1000, 200}, std::pair{33, 4096}}) {
    const Bf16Data x = activations(rows, k, rng);
    const size_t num_scales = static_cast<size_t>(rows) * groups_of(k, 128);
    std::vector<uint8_t> q_ref(x.f32.size());
    std::vector<float> s_ref(num_scales);
    kernels::launch_fp8_act_quant({x.f32.data(), q_ref.data(), s_ref.data(), rows, k, 128}, pool());
    DeviceBuffer<bf16> d_x(x.bits);
    DeviceBuffer<uint8_t> d_q(q_ref.size());
    DeviceBuffer<float> d_s(num_scales);
    kernels::launch_fp8_act_quant({d_x.get(), d_q.get(), d_s.get(), rows, k, 128}, nullptr);
    EXPECT_EQ(d_q.download(), q_ref) << "rows " << rows << " k " << k;
    EXPECT_EQ(d_s.download(), s_ref) << "rows " << rows << " k " << k;
  }
}

TEST(GpuFp8Kernels, PermuteRowsIsBitIdenticalToTheCpu) {
  std::mt19937 rng(22);
  for (auto [tokens, k, top_k] : {std::array{1, 2048, 8}, std::array{5, 16, 1}, std::array{300, 2064, 8},
                                  std::array{1000, 4096, 4}}) {
    const size_t rows = static_cast<size_t>(tokens) * top_k;
    const int groups = groups_of(k, 128);
    std::vector<uint8_t> q(static_cast<size_t>(tokens) * k);
    for (auto& b : q) b = static_cast<uint8_t>(rng());
    std::vector<float> scale(static_cast<size_t>(tokens) * groups);
    for (auto& v : scale) v = static_cast<float>(rng() % 1000) / 7.0f;
    std::vector<int32_t> index(rows);
    std::iota(index.begin(), index.end(), 0);
    std::shuffle(index.begin(), index.end(), rng);
    std::vector<uint8_t> pq_ref(rows * k);
    std::vector<float> ps_ref(rows * groups);
    kernels::launch_fp8_permute_rows({q.data(), scale.data(), index.data(), pq_ref.data(), ps_ref.data(), tokens, k, top_k},
                                   pool());
    DeviceBuffer<uint8_t> d_q(q), d_pq(pq_ref.size());
    DeviceBuffer<float> d_s(scale), d_ps(ps_ref.size());
    DeviceBuffer<int32_t> d_i(index);
    kernels::launch_fp8_permute_rows({d_q.get(), d_s.get(), d_i.get(), d_pq.get(), d_ps.get(), tokens, k, top_k},
                                     nullptr);
    EXPECT_EQ(d_pq.download(), pq_ref) << "tokens " << tokens << " k " << k;
    EXPECT_EQ(d_ps.download(), ps_ref) << "tokens " << tokens << " k " << k;
  }
}

TEST(GpuFp8Kernels, GroupMajorActQuantIsBitIdenticalToTheCpu) {
  std::mt19937 rng(26);
  for (auto [rows, k] : {std::pair{1, 2048}, std::pair{7, 136}, std::pair{300, 4096}}) {
    const Bf16Data x = activations(rows, k, rng);
    const size_t num_scales = static_cast<size_t>(rows) * groups_of(k, 128);
    std::vector<uint8_t> q_ref(x.f32.size());
    std::vector<float> s_ref(num_scales), s_row(num_scales);
    kernels::launch_fp8_act_quant({x.f32.data(), q_ref.data(), s_ref.data(), rows, k, 128, true},
                                pool());
    // The same scales as the token-major layout, transposed.
    std::vector<uint8_t> q_row(x.f32.size());
    kernels::launch_fp8_act_quant({x.f32.data(), q_row.data(), s_row.data(), rows, k, 128}, pool());
    const int groups = groups_of(k, 128);
    for (int r = 0; r < rows; ++r)
      for (int g = 0; g < groups; ++g)
        ASSERT_EQ(s_ref[static_cast<size_t>(g) * rows + r], s_row[static_cast<size_t>(r) * groups + g]);
    DeviceBuffer<bf16> d_x(x.bits);
    DeviceBuffer<uint8_t> d_q(q_ref.size());
    DeviceBuffer<float> d_s(num_scales);
    kernels::launch_fp8_act_quant({d_x.get(), d_q.get(), d_s.get(), rows, k, 128, true}, nullptr);
    EXPECT_EQ(d_q.download(), q_ref) << "rows " << rows << " k " << k;
    EXPECT_EQ(d_s.download(), s_ref) << "rows " << rows << " k " << k;
  }
}

TEST(GpuFp8Kernels, CublasLtBlockMatmulMatchesTheCpu) {
  std::mt19937 rng(27);
  struct Case {
    int m, n, k;
  };
  // Prefill and decode shapes of Qwen3-30B-A3B's projections (k / 128 a multiple of 4). cuBLASLt
  // 13.0 has algorithms for the prefill shape (checked); for small m it may have none (m = 1 on the
  // H200), and the backend then runs Relay's kernel, so those shapes run where supported.
  ASSERT_TRUE(kernels::fp8_block_matmul_cublaslt_supported(4096, 5120, 2048));
  for (Case c : {Case{4096, 5120, 2048}, Case{300, 1024, 512}, Case{64, 2048, 4096},
                 Case{7, 2048, 4096}, Case{1, 5120, 2048}}) {
    if (!kernels::fp8_block_matmul_cublaslt_supported(c.m, c.n, c.k)) {
      std::cout << "cuBLASLt: no block-scaled FP8 algorithm for m " << c.m << " n " << c.n << " k "
                << c.k << " (Relay's kernel covers it)\n";
      continue;
    }
    const Bf16Data xf = activations(c.m, c.k, rng);
    std::vector<uint8_t> xq(xf.f32.size());
    std::vector<float> xs(static_cast<size_t>(c.m) * groups_of(c.k, 128));
    kernels::launch_fp8_act_quant({xf.f32.data(), xq.data(), xs.data(), c.m, c.k, 128, true}, pool());
    const QuantisedWeights w = quantise_weights(1, c.n, c.k, rng);
    std::vector<float> ref(static_cast<size_t>(c.m) * c.n);
    kernels::launch_fp8_block_matmul({xq.data(), xs.data(), w.q.data(), w.scale.data(), ref.data(), c.m,
                                    c.n, c.k, 128, 128, true},
                                   pool());
    DeviceBuffer<uint8_t> d_xq(xq), d_wq(w.q);
    DeviceBuffer<float> d_xs(xs), d_ws(w.scale);
    DeviceBuffer<float> d_wr(kernels::expand_fp8_row_scales(w.scale.data(), c.n, c.k));
    DeviceBuffer<bf16> d_out(ref.size());
    kernels::launch_fp8_block_matmul_cublaslt({d_xq.get(), d_xs.get(), d_wq.get(), d_ws.get(),
                                               d_out.get(), c.m, c.n, c.k, 128, 128, true},
                                              d_wr.get(), nullptr);
    std::vector<float> abs_sum(ref.size());
    kernels::launch_fp8_block_matmul({magnitudes(xq).data(), xs.data(), magnitudes(w.q).data(),
                                    w.scale.data(), abs_sum.data(), c.m, c.n, c.k, 128, 128, true},
                                   pool());
    expect_wgmma_gemm_close(d_out.download(), ref, abs_sum,
                            "cuBLASLt m " + std::to_string(c.m) + " n " + std::to_string(c.n) +
                                " k " + std::to_string(c.k));
  }
  // What it cannot run is refused with a message, not run wrongly.
  EXPECT_FALSE(kernels::fp8_block_matmul_cublaslt_supported(4, 256, 384));  // 3 k-blocks
}

TEST(GpuFp8Kernels, SwigluQuantEqualsSwigluThenQuant) {
  std::mt19937 rng(22);
  for (auto [rows, width] : {std::pair{1, 768}, std::pair{5, 136}, std::pair{1031, 1536}}) {
    const Bf16Data gate_up = random_bf16(static_cast<size_t>(rows) * 2 * width, rng, 2.0f);
    const size_t n = static_cast<size_t>(rows) * width;
    const size_t num_scales = static_cast<size_t>(rows) * groups_of(width, 128);
    DeviceBuffer<bf16> d_gate_up(gate_up.bits), d_h(n);
    DeviceBuffer<uint8_t> d_q(n), d_q2(n);
    DeviceBuffer<float> d_s(num_scales), d_s2(num_scales);
    kernels::launch_swiglu_fp8_quant({d_gate_up.get(), d_q.get(), d_s.get(), rows, width}, nullptr);
    // The unfused GPU pair: the fused kernel must reproduce it bit for bit.
    kernels::launch_swiglu({d_gate_up.get(), d_h.get(), rows, width}, nullptr);
    kernels::launch_fp8_act_quant({d_h.get(), d_q2.get(), d_s2.get(), rows, width, 128}, nullptr);
    const std::vector<uint8_t> q = d_q.download();
    const std::vector<float> s = d_s.download();
    EXPECT_EQ(q, d_q2.download()) << "rows " << rows << " width " << width;
    EXPECT_EQ(s, d_s2.download()) << "rows " << rows << " width " << width;
    // The CPU composition (swiglu in fp32 with std::exp, rounded to bf16, then quantised): __expf
    // may move an element by one bf16 ulp, so compare dequantised values, not codes.
    std::vector<float> h(n);
    kernels::launch_swiglu({gate_up.f32.data(), h.data(), rows, width}, pool());
    for (float& v : h) v = bf16_to_f32(f32_to_bf16(v));
    std::vector<uint8_t> q_ref(n);
    std::vector<float> s_ref(num_scales);
    kernels::launch_fp8_act_quant({h.data(), q_ref.data(), s_ref.data(), rows, width, 128}, pool());
    const int groups = groups_of(width, 128);
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      const size_t si = (i / width) * groups + (i % width) / 128;
      const float got = kernels::e4m3_to_f32(q[i]) * s[si];
      const float want = kernels::e4m3_to_f32(q_ref[i]) * s_ref[si];
      if (std::fabs(got - want) > 0.13f * std::fabs(want) + s_ref[si] * 0x1p-8f) ++bad;
    }
    EXPECT_EQ(bad, 0u) << "rows " << rows << " width " << width;
  }
}

TEST(GpuFp8Kernels, MxActQuantIsBitIdenticalToTheCpu) {
  std::mt19937 rng(23);
  for (auto [rows, k] : {std::pair{1, 32}, std::pair{1, 8}, std::pair{7, 136}, std::pair{300, 2056},
                         std::pair{1000, 200}}) {
    const Bf16Data x = activations(rows, k, rng);
    const size_t num_scales = static_cast<size_t>(rows) * groups_of(k, 32);
    std::vector<uint8_t> q_ref(x.f32.size()), s_ref(num_scales);
    kernels::launch_mxfp8_act_quant({x.f32.data(), q_ref.data(), s_ref.data(), rows, k}, pool());
    DeviceBuffer<bf16> d_x(x.bits);
    DeviceBuffer<uint8_t> d_q(q_ref.size()), d_s(num_scales);
    kernels::launch_mxfp8_act_quant({d_x.get(), d_q.get(), d_s.get(), rows, k}, nullptr);
    EXPECT_EQ(d_q.download(), q_ref) << "rows " << rows << " k " << k;
    EXPECT_EQ(d_s.download(), s_ref) << "rows " << rows << " k " << k;
  }
}

struct GroupedCase {
  const char* name;
  int experts, n, k;
  std::vector<int32_t> offsets;
};

std::vector<GroupedCase> grouped_cases(std::mt19937& rng) {
  std::vector<GroupedCase> cases;
  cases.push_back({"one row", 4, 264, 136, {0, 0, 0, 1, 1}});
  cases.push_back({"odd sizes, empty experts", 8, 192, 2056, random_offsets(8, 12, 0.3, rng)});
  cases.push_back({"1000+ rows", 6, 264, 200, random_offsets(6, 400, 0.2, rng)});
  cases.push_back({"prefill tiles", 4, 384, 512, random_offsets(4, 700, 0.0, rng)});
  cases.push_back({"128 experts top-8", 128, 256, 384, routed_offsets(97, 128, 8, rng)});
  // Decode: 1-4 rows on 16 of 128 experts, and one row on each of 8.
  std::vector<int32_t> decode(129, 0), single(129, 0);
  for (int e = 0; e < 128; ++e) {
    decode[e + 1] = decode[e] + (e % 8 == 3 ? 1 + static_cast<int>(rng() % 4) : 0);
    single[e + 1] = single[e] + (e % 16 == 5 ? 1 : 0);
  }
  cases.push_back({"decode 1-4 rows", 128, 512, 1024, decode});
  cases.push_back({"decode 8 x 1 row", 128, 264, 136, single});
  cases.push_back({"more than 8 rows per streamed expert", 3, 128, 256, {0, 19, 19, 30}});
  return cases;
}

// Whether launch_fp8_block_grouped_matmul's Auto runs the CUTLASS (wgmma) kernel for the shape:
// prefill (over 16 rows per expert) that CUTLASS can take, unless RELAY_MOE_PREFILL_GEMM says
// otherwise (then the looser wgmma bound is merely applied to the tiled kernel).
bool auto_runs_cutlass(int rows, int experts, int n, int k) {
  return rows > 16 * experts && kernels::fp8_block_grouped_matmul_cutlass_supported(n, k);
}

// Runs every block-scaled grouped variant on the case's operands against the CPU reference.
void check_block_grouped_kinds(const GroupedCase& c, std::initializer_list<GroupedGemmKind> kinds,
                               std::mt19937& rng) {
  const int rows = c.offsets.back();
  const QuantisedActs x = quantise_acts(rows, c.k, rng);
  const QuantisedWeights w = quantise_weights(c.experts, c.n, c.k, rng);
  std::vector<float> ref(static_cast<size_t>(rows) * c.n), abs_sum;
  kernels::launch_fp8_block_grouped_matmul({x.q.data(), x.scale.data(), w.q.data(), w.scale.data(),
                                          c.offsets.data(), ref.data(), rows, c.experts, c.n, c.k},
                                         pool());
  DeviceBuffer<uint8_t> d_xq(x.q), d_wq(w.q);
  DeviceBuffer<float> d_xs(x.scale), d_ws(w.scale);
  DeviceBuffer<int32_t> d_off(c.offsets);
  for (GroupedGemmKind kind : kinds) {
    const std::string where = std::string(c.name) + " (" + kernels::grouped_gemm_kind_name(kind) +
                              ", rows " + std::to_string(rows) + ", n " + std::to_string(c.n) +
                              ", k " + std::to_string(c.k) + ")";
    DeviceBuffer<bf16> d_out(ref.size());
    const kernels::Fp8BlockGroupedMatmulParams<bf16> p{
        d_xq.get(),  d_xs.get(), d_wq.get(), d_ws.get(), d_off.get(),
        d_out.get(), rows,       c.experts,  c.n,        c.k};
    const bool cutlass = kind == GroupedGemmKind::CutlassCooperative;
    if (cutlass && !kernels::fp8_block_grouped_matmul_cutlass_supported(c.n, c.k)) {
      // A shape CUTLASS cannot take is refused, not run wrongly (Auto runs the tiled kernel).
      EXPECT_THROW(kernels::launch_fp8_block_grouped_matmul(p, kind, nullptr), Error) << where;
      continue;
    }
    kernels::launch_fp8_block_grouped_matmul(p, kind, nullptr);
    if (cutlass ||
        (kind == GroupedGemmKind::Auto && auto_runs_cutlass(rows, c.experts, c.n, c.k))) {
      if (abs_sum.empty()) {
        abs_sum.resize(ref.size());
        kernels::launch_fp8_block_grouped_matmul(
            {magnitudes(x.q).data(), x.scale.data(), magnitudes(w.q).data(), w.scale.data(),
             c.offsets.data(), abs_sum.data(), rows, c.experts, c.n, c.k},
            pool());
      }
      expect_wgmma_gemm_close(d_out.download(), ref, abs_sum, where);
    } else {
      expect_gemm_close(d_out.download(), ref, where);
    }
  }
}

TEST(GpuFp8Kernels, BlockGroupedMatmulMatchesTheCpu) {
  std::mt19937 rng(24);
  for (const GroupedCase& c : grouped_cases(rng)) {
    check_block_grouped_kinds(c,
                              {GroupedGemmKind::Tiled, GroupedGemmKind::Streaming,
                               GroupedGemmKind::CutlassCooperative, GroupedGemmKind::Auto},
                              rng);
  }
}

// Shapes for the CUTLASS kernel's edges: 128 x 128 tiles in 1 x 2 clusters (an odd number of n
// tiles leaves a cluster half outside n), a partial last k-block, experts with 0 rows first and
// last, one token, a single expert holding every row, few rows per expert, and a large batch.
TEST(GpuFp8Kernels, CutlassBlockGroupedMatmulMatchesTheCpu) {
  std::mt19937 rng(29);
  std::vector<GroupedCase> cases;
  cases.push_back({"one token", 4, 264, 400, {0, 0, 0, 1, 1}});
  cases.push_back(
      {"odd sizes, empty experts, 3 n tiles", 8, 264, 2048, random_offsets(8, 300, 0.3, rng)});
  cases.push_back({"partial k-block", 6, 256, 400, random_offsets(6, 400, 0.2, rng)});
  cases.push_back({"one expert holds every row", 5, 384, 256, {0, 0, 0, 777, 777, 777}});
  cases.push_back({"1-5 rows per expert", 32, 192, 128, random_offsets(32, 5, 0.2, rng)});
  cases.push_back(
      {"1024 tokens top-8 over 128 experts", 128, 384, 512, routed_offsets(1024, 128, 8, rng)});
  for (const GroupedCase& c : cases) {
    check_block_grouped_kinds(c, {GroupedGemmKind::CutlassCooperative, GroupedGemmKind::Auto}, rng);
  }
}

TEST(GpuFp8Kernels, BlockMatmulMatchesTheCpu) {
  std::mt19937 rng(25);
  struct Case {
    int m, n, k;
  };
  for (Case c : {Case{1, 4096, 2048}, Case{7, 264, 136}, Case{300, 192, 2056},
                 Case{4096, 256, 2048}, Case{33, 384, 200}}) {
    const QuantisedActs x = quantise_acts(c.m, c.k, rng);
    const QuantisedWeights w = quantise_weights(1, c.n, c.k, rng);
    std::vector<float> ref(static_cast<size_t>(c.m) * c.n);
    kernels::launch_fp8_block_matmul(
        {x.q.data(), x.scale.data(), w.q.data(), w.scale.data(), ref.data(), c.m, c.n, c.k},
        pool());
    DeviceBuffer<uint8_t> d_xq(x.q), d_wq(w.q);
    DeviceBuffer<float> d_xs(x.scale), d_ws(w.scale);
    for (auto kind : {GroupedGemmKind::Tiled, GroupedGemmKind::Streaming, GroupedGemmKind::Auto}) {
      // Streaming re-reads the weight once per 8 rows: only the decode shapes.
      if (kind == GroupedGemmKind::Streaming && c.m > 64) continue;
      DeviceBuffer<bf16> d_out(ref.size());
      kernels::launch_fp8_block_matmul(
          {d_xq.get(), d_xs.get(), d_wq.get(), d_ws.get(), d_out.get(), c.m, c.n, c.k}, kind,
          nullptr);
      expect_gemm_close(d_out.download(), ref,
                        std::string(kernels::grouped_gemm_kind_name(kind)) + " m " + std::to_string(c.m) + " n " +
                            std::to_string(c.n) + " k " + std::to_string(c.k));
    }
  }
}

// MX operands made by the CPU quantisers: activations [rows, k], weights [experts, n, k].
struct MxOperands {
  std::vector<uint8_t> xq, xs, wq, ws;
};
MxOperands mx_operands(int rows, int experts, int n, int k, std::mt19937& rng) {
  MxOperands o;
  const Bf16Data x = activations(rows, k, rng);
  o.xq.resize(x.f32.size());
  o.xs.resize(static_cast<size_t>(rows) * groups_of(k, 32));
  kernels::launch_mxfp8_act_quant({x.f32.data(), o.xq.data(), o.xs.data(), rows, k}, pool());
  const std::vector<float> w = random_weights(static_cast<size_t>(experts) * n * k, rng);
  o.wq.resize(w.size());
  o.ws.resize(static_cast<size_t>(experts) * n * groups_of(k, 32));
  kernels::quantize_weight_mxfp8(w.data(), static_cast<int64_t>(experts) * n, k, o.wq.data(),
                               o.ws.data());
  return o;
}

TEST(GpuFp8Kernels, MxMatmulMatchesTheCpu) {
  std::mt19937 rng(26);
  struct Case {
    int m, n, k;
  };
  for (Case c :
       {Case{1, 264, 136}, Case{7, 192, 2056}, Case{300, 256, 200}, Case{1031, 512, 1024}}) {
    const MxOperands o = mx_operands(c.m, 1, c.n, c.k, rng);
    std::vector<float> ref(static_cast<size_t>(c.m) * c.n);
    kernels::launch_mxfp8_matmul(
        {o.xq.data(), o.xs.data(), o.wq.data(), o.ws.data(), ref.data(), c.m, c.n, c.k}, pool());
    DeviceBuffer<uint8_t> d_xq(o.xq), d_xs(o.xs), d_wq(o.wq), d_ws(o.ws);
    DeviceBuffer<bf16> d_out(ref.size());
    kernels::launch_mxfp8_matmul(
        {d_xq.get(), d_xs.get(), d_wq.get(), d_ws.get(), d_out.get(), c.m, c.n, c.k}, nullptr);
    expect_gemm_close(
        d_out.download(), ref,
        "m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k));
  }
}

TEST(GpuFp8Kernels, MxGroupedMatmulMatchesTheCpu) {
  std::mt19937 rng(27);
  for (const GroupedCase& c : grouped_cases(rng)) {
    const int rows = c.offsets.back();
    const MxOperands o = mx_operands(rows, c.experts, c.n, c.k, rng);
    std::vector<float> ref(static_cast<size_t>(rows) * c.n);
    kernels::launch_mxfp8_grouped_matmul({o.xq.data(), o.xs.data(), o.wq.data(), o.ws.data(),
                                        c.offsets.data(), ref.data(), rows, c.experts, c.n, c.k},
                                       pool());
    DeviceBuffer<uint8_t> d_xq(o.xq), d_xs(o.xs), d_wq(o.wq), d_ws(o.ws);
    DeviceBuffer<int32_t> d_off(c.offsets);
    DeviceBuffer<bf16> d_out(ref.size());
    kernels::launch_mxfp8_grouped_matmul({d_xq.get(), d_xs.get(), d_wq.get(), d_ws.get(),
                                          d_off.get(), d_out.get(), rows, c.experts, c.n, c.k},
                                         nullptr);
    expect_gemm_close(d_out.download(), ref, std::string(c.name) + " rows " + std::to_string(rows));
  }
}

// The Blackwell-native kernel called directly (on a compute capability 10.0 GPU the two tests above
// already reach it through the dispatch): every grouped case whose k it takes (a multiple of 16,
// so 136 and 200 test a partial last 128-element stage and 4-group scale atom), and dense GEMMs as
// one group without offsets. Skipped on other GPUs: the H200 here has never run it.
TEST(GpuFp8Kernels, MxGroupedMatmulSm100MatchesTheCpu) {
  if (!kernels::mxfp8_sm100_available()) {
    GTEST_SKIP() << "needs a compute capability 10.0 GPU and a build with -DRELAY_SM100=ON";
  }
  std::mt19937 rng(31);
  for (const GroupedCase& c : grouped_cases(rng)) {
    if (!kernels::mxfp8_sm100_supported(c.n, c.k)) continue;
    const int rows = c.offsets.back();
    const MxOperands o = mx_operands(rows, c.experts, c.n, c.k, rng);
    std::vector<float> ref(static_cast<size_t>(rows) * c.n);
    kernels::launch_mxfp8_grouped_matmul({o.xq.data(), o.xs.data(), o.wq.data(), o.ws.data(),
                                        c.offsets.data(), ref.data(), rows, c.experts, c.n, c.k},
                                       pool());
    DeviceBuffer<uint8_t> d_xq(o.xq), d_xs(o.xs), d_wq(o.wq), d_ws(o.ws);
    DeviceBuffer<int32_t> d_off(c.offsets);
    DeviceBuffer<bf16> d_out(ref.size());
    kernels::launch_mxfp8_grouped_matmul_sm100({d_xq.get(), d_xs.get(), d_wq.get(), d_ws.get(),
                                                d_off.get(), d_out.get(), rows, c.experts, c.n,
                                                c.k},
                                               nullptr);
    expect_gemm_close(d_out.download(), ref, std::string(c.name) + " rows " + std::to_string(rows));
  }
  for (int m : {1, 129, 1031}) {
    const int n = 264, k = 2064;
    const MxOperands o = mx_operands(m, 1, n, k, rng);
    std::vector<float> ref(static_cast<size_t>(m) * n);
    kernels::launch_mxfp8_matmul({o.xq.data(), o.xs.data(), o.wq.data(), o.ws.data(), ref.data(), m,
                                n, k},
                               pool());
    DeviceBuffer<uint8_t> d_xq(o.xq), d_xs(o.xs), d_wq(o.wq), d_ws(o.ws);
    DeviceBuffer<bf16> d_out(ref.size());
    kernels::launch_mxfp8_grouped_matmul_sm100(
        {d_xq.get(), d_xs.get(), d_wq.get(), d_ws.get(), nullptr, d_out.get(), m, 1, n, k},
        nullptr);
    expect_gemm_close(d_out.download(), ref, "dense m " + std::to_string(m));
  }
}

// ---- Bounded FP8 expert ops (kernels::LiveRows, ops.h) ------------------------------------------
// The DP + EP form: the token quantiser and the permutation of quantised rows over a receive
// buffer of `slots`-token regions filled up to their counts, dead tokens holding NaN; the fused
// SwiGLU quantiser over the rows of this rank's experts. Live results bit-identical to the CPU (or
// the unfused pair); every element a kernel must not write keeps the 0xFF poison.

// Rows of a [rows, width] byte-array-like tensor not marked live that lost their poison.
template <typename T>
size_t written_dead_elements(const std::vector<T>& v, const std::vector<char>& live, size_t width) {
  size_t n = 0;
  for (size_t r = 0; r < live.size(); ++r) {
    if (live[r]) continue;
    for (size_t i = 0; i < width; ++i) {
      T poison;
      std::memset(&poison, 0xFF, sizeof(T));
      n += std::memcmp(&v[r * width + i], &poison, sizeof(T)) != 0;
    }
  }
  return n;
}

template <typename T>
size_t mismatched_live_elements(const std::vector<T>& got, const std::vector<T>& want,
                                const std::vector<char>& live, size_t width) {
  size_t n = 0;
  for (size_t r = 0; r < live.size(); ++r) {
    if (!live[r]) continue;
    for (size_t i = 0; i < width; ++i)
      n += std::memcmp(&got[r * width + i], &want[r * width + i], sizeof(T)) != 0;
  }
  return n;
}

TEST(GpuFp8Kernels, BoundedActQuantAndPermuteRowsAreBitIdenticalToTheCpu) {
  std::mt19937 rng(29);
  struct Case {
    int slots, k, top_k;
    std::vector<int32_t> counts;
  };
  for (const Case& c : {Case{16, 2048, 8, {3, 0}}, Case{64, 2064, 8, {64, 5, 0, 100}},
                        Case{8, 128, 4, {0, 0}}, Case{24, 512, 2, {1, 2, 3, 4, 5, 6, 7, 30}}}) {
    const int regions = static_cast<int>(c.counts.size()), tokens = regions * c.slots;
    const int groups = groups_of(c.k, 128), rows = tokens * c.top_k;
    const kernels::LiveRows bound{c.counts.data(), c.slots};
    std::vector<char> live(tokens);
    for (int t = 0; t < tokens; ++t) live[t] = kernels::is_live_row(bound, t);
    Bf16Data x = activations(tokens, c.k, rng);
    for (int t = 0; t < tokens; ++t) {
      if (live[t]) continue;
      for (size_t i = static_cast<size_t>(t) * c.k; i < static_cast<size_t>(t + 1) * c.k; ++i) {
        x.bits[i] = __nv_bfloat16_raw{0x7FC0};
        x.f32[i] = std::numeric_limits<float>::quiet_NaN();
      }
    }
    const std::string where = "slots " + std::to_string(c.slots) + " k " + std::to_string(c.k) +
                              " regions " + std::to_string(regions);
    DeviceBuffer<int32_t> d_counts(c.counts);
    DeviceBuffer<bf16> d_x(x.bits);
    std::vector<uint8_t> tok_q;  // the token-major CPU result, which the permutation below takes
    std::vector<float> tok_s;
    for (bool group_major : {false, true}) {
      // Sentinels the CPU must leave on the dead tokens.
      std::vector<uint8_t> q_ref(x.f32.size(), 0xAB);
      std::vector<float> s_ref(static_cast<size_t>(tokens) * groups, -1.0f);
      kernels::Fp8ActQuantParams<float> cp{x.f32.data(), q_ref.data(), s_ref.data(), tokens,
                                         c.k,          128,          group_major};
      cp.live_tokens = bound;
      kernels::launch_fp8_act_quant(cp, pool());
      DeviceBuffer<uint8_t> d_q(q_ref.size());
      DeviceBuffer<float> d_s(s_ref.size());
      kernels::Fp8ActQuantParams<bf16> gp{d_x.get(), d_q.get(), d_s.get(),  tokens,
                                        c.k,       128,       group_major};
      gp.live_tokens = {d_counts.get(), c.slots};
      kernels::launch_fp8_act_quant(gp, nullptr);
      const auto q = d_q.download();
      auto s = d_s.download();
      EXPECT_EQ(mismatched_live_elements(q, q_ref, live, c.k), 0u)
          << where << " group_major " << group_major;
      EXPECT_EQ(written_dead_elements(q, live, c.k), 0u) << where << " group_major " << group_major;
      if (group_major) {  // compared token-major
        std::vector<float> t_ref(s_ref.size()), t_got(s.size());
        for (int t = 0; t < tokens; ++t)
          for (int g = 0; g < groups; ++g) {
            t_ref[static_cast<size_t>(t) * groups + g] = s_ref[static_cast<size_t>(g) * tokens + t];
            t_got[static_cast<size_t>(t) * groups + g] = s[static_cast<size_t>(g) * tokens + t];
          }
        s_ref = t_ref, s = t_got;
      }
      EXPECT_EQ(mismatched_live_elements(s, s_ref, live, groups), 0u)
          << where << " group_major " << group_major;
      EXPECT_EQ(written_dead_elements(s, live, groups), 0u)
          << where << " group_major " << group_major;
      size_t cpu_written = 0;
      for (int t = 0; t < tokens; ++t) {
        if (live[t]) continue;
        for (int i = 0; i < c.k; ++i)
          cpu_written += q_ref[static_cast<size_t>(t) * c.k + i] != 0xAB;
        for (int g = 0; g < groups; ++g)
          cpu_written += s_ref[static_cast<size_t>(t) * groups + g] != -1.0f;
      }
      EXPECT_EQ(cpu_written, 0u) << where << ": the CPU reference wrote dead tokens";
      if (!group_major) tok_q = q_ref, tok_s = s_ref;
    }

    // The permutation of the quantised rows (the token-major codes and scales) with an
    // expert-parallel index: experts [16, 32) of 64 here, the absent id 16 sorted last, not copied.
    const int experts = 64, begin = 16, local = 16;
    std::vector<int32_t> ids(static_cast<size_t>(rows));
    std::vector<float> w(ids.size(), 1.0f);
    for (int t = 0; t < tokens; ++t) {
      std::vector<int32_t> pick(experts);
      std::iota(pick.begin(), pick.end(), 0);
      std::shuffle(pick.begin(), pick.end(), rng);
      for (int j = 0; j < c.top_k; ++j)
        ids[static_cast<size_t>(t) * c.top_k + j] = live[t] ? pick[j] : 1 << 20;
    }
    for (size_t r = 0; r < ids.size(); ++r) {
      if (!live[r / c.top_k]) continue;
      const int32_t l = ids[r] - begin;
      ids[r] = l >= 0 && l < local ? l : local;
    }
    std::vector<int32_t> index(rows, -1), offsets(local + 2);
    kernels::MoePermuteParams<float> ip{nullptr,      ids.data(),     nullptr,
                                        index.data(), offsets.data(), tokens,
                                        c.k,          local + 1,      c.top_k};
    ip.live_tokens = bound;
    kernels::launch_moe_permute(ip, pool());
    const int computed = offsets[local];
    std::vector<uint8_t> pq_ref(static_cast<size_t>(rows) * c.k, 0xAB);
    std::vector<float> ps_ref(static_cast<size_t>(rows) * groups, -1.0f);
    kernels::Fp8PermuteRowsParams cpr{tok_q.data(),  tok_s.data(), index.data(), pq_ref.data(),
                                    ps_ref.data(), tokens,       c.k,          c.top_k};
    cpr.live_tokens = bound;
    cpr.copied_rows = {&computed, rows};
    kernels::launch_fp8_permute_rows(cpr, pool());
    DeviceBuffer<uint8_t> d_q(tok_q), d_pq(pq_ref.size());
    DeviceBuffer<float> d_s(tok_s), d_ps(ps_ref.size());
    DeviceBuffer<int32_t> d_index(index), d_computed(std::vector<int32_t>{computed});
    kernels::Fp8PermuteRowsParams gpr{d_q.get(),  d_s.get(), d_index.get(), d_pq.get(),
                                    d_ps.get(), tokens,    c.k,           c.top_k};
    gpr.live_tokens = {d_counts.get(), c.slots};
    gpr.copied_rows = {d_computed.get(), rows};
    kernels::launch_fp8_permute_rows(gpr, nullptr);
    std::vector<char> row_live(rows, 0);
    std::fill_n(row_live.begin(), computed, 1);
    const auto pq = d_pq.download();
    const auto ps = d_ps.download();
    EXPECT_EQ(mismatched_live_elements(pq, pq_ref, row_live, c.k), 0u) << where;
    EXPECT_EQ(mismatched_live_elements(ps, ps_ref, row_live, groups), 0u) << where;
    EXPECT_EQ(std::count(pq_ref.begin() + static_cast<size_t>(computed) * c.k, pq_ref.end(), 0xAB) +
                  std::count(ps_ref.begin() + static_cast<size_t>(computed) * groups, ps_ref.end(),
                             -1.0f),
              static_cast<std::ptrdiff_t>(rows - computed) * (c.k + groups))
        << where << ": the CPU reference wrote rows past " << computed;
    EXPECT_EQ(written_dead_elements(pq, row_live, c.k), 0u)
        << where << ": rows past " << computed << " written";
    EXPECT_EQ(written_dead_elements(ps, row_live, groups), 0u)
        << where << ": scales past " << computed;
  }
}

TEST(GpuFp8Kernels, BoundedSwigluQuantEqualsBoundedSwigluThenQuant) {
  std::mt19937 rng(30);
  const int rows = 1031, width = 1536, groups = groups_of(width, 128);
  for (int prefix : {-1, 0, 1, 700}) {  // -1: three regions of 344 rows (the last 343)
    const std::vector<int32_t> counts =
        prefix < 0 ? std::vector<int32_t>{100, 0, 344} : std::vector<int32_t>{prefix};
    const int region_rows = prefix < 0 ? 344 : rows;
    std::vector<char> live(rows);
    for (int r = 0; r < rows; ++r) live[r] = kernels::is_live_row({counts.data(), region_rows}, r);
    Bf16Data gate_up = random_bf16(static_cast<size_t>(rows) * 2 * width, rng, 2.0f);
    for (int r = 0; r < rows; ++r) {
      if (live[r]) continue;
      for (size_t i = static_cast<size_t>(r) * 2 * width;
           i < static_cast<size_t>(r + 1) * 2 * width; ++i)
        gate_up.bits[i] = __nv_bfloat16_raw{0x7FC0};
    }
    const size_t n = static_cast<size_t>(rows) * width,
                 num_scales = static_cast<size_t>(rows) * groups;
    DeviceBuffer<int32_t> d_counts(counts);
    const kernels::LiveRows bound{d_counts.get(), region_rows};
    DeviceBuffer<bf16> d_gate_up(gate_up.bits), d_h(n);
    DeviceBuffer<uint8_t> d_q(n), d_q2(n), d_q_all(n);
    DeviceBuffer<float> d_s(num_scales), d_s2(num_scales), d_s_all(num_scales);
    kernels::SwigluFp8QuantParams fp{d_gate_up.get(), d_q.get(), d_s.get(), rows, width};
    fp.live_rows = bound;
    kernels::launch_swiglu_fp8_quant(fp, nullptr);
    kernels::SwigluParams<bf16> sp{d_gate_up.get(), d_h.get(), rows, width};
    sp.live_rows = bound;
    kernels::launch_swiglu(sp, nullptr);
    kernels::Fp8ActQuantParams<bf16> qp{d_h.get(), d_q2.get(), d_s2.get(), rows, width, 128};
    qp.live_tokens = bound;
    kernels::launch_fp8_act_quant(qp, nullptr);
    // Unbounded: the live rows' results must not depend on the bound (the dead rows' NaN stay
    // there).
    kernels::launch_swiglu_fp8_quant({d_gate_up.get(), d_q_all.get(), d_s_all.get(), rows, width},
                                     nullptr);
    const auto q = d_q.download();
    const auto s = d_s.download();
    EXPECT_EQ(q, d_q2.download()) << "prefix " << prefix;
    // Bitwise: the dead rows keep the buffers' 0xFF poison, a NaN pattern that never compares equal.
    const auto s2 = d_s2.download();
    ASSERT_EQ(s.size(), s2.size());
    EXPECT_EQ(0, std::memcmp(s.data(), s2.data(), s.size() * sizeof(float))) << "prefix " << prefix;
    EXPECT_EQ(mismatched_live_elements(q, d_q_all.download(), live, width), 0u)
        << "prefix " << prefix;
    EXPECT_EQ(mismatched_live_elements(s, d_s_all.download(), live, groups), 0u)
        << "prefix " << prefix;
    EXPECT_EQ(written_dead_elements(q, live, width), 0u) << "prefix " << prefix;
    EXPECT_EQ(written_dead_elements(s, live, groups), 0u) << "prefix " << prefix;
  }
}
// ---- end of the bounded FP8 expert ops ----------------------------------------------------------

// Each variant is warmed up once, then captured into a graph (which must not allocate or
// synchronise) and replayed into a poisoned output.
TEST(GpuFp8Kernels, GroupedMatmulCapturesIntoAGraph) {
  std::mt19937 rng(28);
  const int experts = 16, n = 256, k = 512;
  for (int max_rows : {2, 300}) {
    const std::vector<int32_t> offsets = random_offsets(experts, max_rows, 0.25, rng);
    const int rows = offsets.back();
    const QuantisedActs x = quantise_acts(rows, k, rng);
    const QuantisedWeights w = quantise_weights(experts, n, k, rng);
    std::vector<float> ref(static_cast<size_t>(rows) * n);
    kernels::launch_fp8_block_grouped_matmul({x.q.data(), x.scale.data(), w.q.data(), w.scale.data(),
                                            offsets.data(), ref.data(), rows, experts, n, k},
                                           pool());
    DeviceBuffer<uint8_t> d_xq(x.q), d_wq(w.q);
    DeviceBuffer<float> d_xs(x.scale), d_ws(w.scale);
    DeviceBuffer<int32_t> d_off(offsets);
    DeviceBuffer<bf16> d_out(ref.size());
    const kernels::Fp8BlockGroupedMatmulParams<bf16> p{
        d_xq.get(),  d_xs.get(), d_wq.get(), d_ws.get(), d_off.get(),
        d_out.get(), rows,       experts,    n,          k};
    std::vector<float> abs_sum(ref.size());
    kernels::launch_fp8_block_grouped_matmul(
        {magnitudes(x.q).data(), x.scale.data(), magnitudes(w.q).data(), w.scale.data(),
         offsets.data(), abs_sum.data(), rows, experts, n, k},
        pool());
    for (auto kind : {GroupedGemmKind::Tiled, GroupedGemmKind::Streaming,
                      GroupedGemmKind::CutlassCooperative}) {
      cudaStream_t stream;
      GPU_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      kernels::launch_fp8_block_grouped_matmul(p, kind, stream);
      GPU_TEST_CUDA(cudaStreamSynchronize(stream));
      cudaGraph_t graph;
      GPU_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      kernels::launch_fp8_block_grouped_matmul(p, kind, stream);
      GPU_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec;
      GPU_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      d_out.poison();  // on the legacy stream, which a non-blocking stream does not wait for
      GPU_TEST_CUDA(cudaDeviceSynchronize());
      GPU_TEST_CUDA(cudaGraphLaunch(exec, stream));
      GPU_TEST_CUDA(cudaStreamSynchronize(stream));
      const std::string where = std::string("graph ") + kernels::grouped_gemm_kind_name(kind) +
                                " rows " + std::to_string(rows);
      if (kind == GroupedGemmKind::CutlassCooperative) {
        expect_wgmma_gemm_close(d_out.download(), ref, abs_sum, where);
      } else {
        expect_gemm_close(d_out.download(), ref, where);
      }
      GPU_TEST_CUDA(cudaGraphExecDestroy(exec));
      GPU_TEST_CUDA(cudaGraphDestroy(graph));
      GPU_TEST_CUDA(cudaStreamDestroy(stream));
    }
  }
}

}  // namespace
}  // namespace relay::gpu_test

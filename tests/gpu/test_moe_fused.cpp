// The MoE's fused decode ops against the ops they replace: the combine with the next RMSNorm
// against the combine and the norm kernels run apart (the same bits).
#include <string>
#include <vector>

#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace relay::gpu_test {
namespace {

using kernels::bf16;

void check_combine_norm(int tokens, int hidden, bool with_extra, std::mt19937& rng) {
  const int k = 9, rows = tokens * k;
  std::vector<int32_t> index(rows);
  for (int r = 0; r < rows; ++r) index[r] = (r * 37) % rows;
  std::vector<float> weights(rows);
  for (auto& w : weights) w = static_cast<float>(rng() % 1000) / 1000.0f;
  weights[k - 1] = 0.0f;
  auto expert_out = random_bf16(static_cast<size_t>(rows) * hidden, rng);
  for (int i = 0; i < hidden; ++i) {
    expert_out.bits[static_cast<size_t>(index[k - 1]) * hidden + i] = __float2bfloat16(NAN);
  }
  auto res = random_bf16(static_cast<size_t>(tokens) * hidden, rng, 3.0f);
  auto norm = random_bf16(hidden, rng);
  const size_t n = static_cast<size_t>(tokens) * hidden;
  auto extra = random_bf16(n, rng), extra_gate = random_bf16(tokens, rng, 2.0f);
  DeviceBuffer<bf16> d_eo(expert_out.bits), d_norm(norm.bits), d_extra(extra.bits),
      d_extra_gate(extra_gate.bits);
  DeviceBuffer<int32_t> d_index(index);
  DeviceBuffer<float> d_w(weights);
  // Apart: the combine, the gated extra term, then rms_norm with the residual.
  DeviceBuffer<bf16> a_out(n), a_res(res.bits), a_normed(n);
  kernels::launch_moe_unpermute_combine(
      {d_eo.get(), d_index.get(), d_w.get(), a_out.get(), tokens, hidden, k}, nullptr);
  if (with_extra) {
    kernels::launch_sigmoid_gate(
        {d_extra.get(), d_extra_gate.get(), a_out.get(), tokens, hidden, 1, true}, nullptr);
    // The plain combine with the extra term: the same bits as the two kernels.
    DeviceBuffer<bf16> e_out(n);
    kernels::MoeUnpermuteCombineParams<bf16> ep{d_eo.get(), d_index.get(), d_w.get(),
                                                e_out.get(), tokens, hidden, k};
    ep.extra = d_extra.get();
    ep.extra_gate = d_extra_gate.get();
    kernels::launch_moe_unpermute_combine(ep, nullptr);
    EXPECT_EQ(rel_error(to_f32(e_out.download()), to_f32(a_out.download())), 0.0)
        << "extra term without the norm, tokens " << tokens << " hidden " << hidden;
  }
  kernels::launch_rms_norm(
      {a_out.get(), a_res.get(), d_norm.get(), a_normed.get(), tokens, hidden, 1e-6f},
      nullptr);
  // Fused.
  DeviceBuffer<bf16> f_out(n), f_res(res.bits), f_normed(n);
  kernels::MoeUnpermuteCombineParams<bf16> p{d_eo.get(), d_index.get(), d_w.get(),
                                             f_out.get(), tokens, hidden, k};
  p.residual = f_res.get();
  p.norm_weight = d_norm.get();
  p.normed = f_normed.get();
  p.eps = 1e-6f;
  if (with_extra) {
    p.extra = d_extra.get();
    p.extra_gate = d_extra_gate.get();
  }
  kernels::launch_moe_unpermute_combine(p, nullptr);
  const std::string what = "tokens " + std::to_string(tokens) + " hidden " +
                           std::to_string(hidden) + " extra " + std::to_string(with_extra);
  EXPECT_EQ(rel_error(to_f32(f_out.download()), to_f32(a_out.download())), 0.0) << what;
  EXPECT_EQ(rel_error(to_f32(f_res.download()), to_f32(a_res.download())), 0.0) << what;
  EXPECT_EQ(rel_error(to_f32(f_normed.download()), to_f32(a_normed.download())), 0.0)
      << what;

  std::vector<float> eo_ref = expert_out.f32, out_ref(n), res_ref = res.f32, normed_ref(n);
  kernels::MoeUnpermuteCombineParams<float> c{eo_ref.data(), index.data(), weights.data(),
                                              out_ref.data(), tokens, hidden, k};
  c.residual = res_ref.data();
  c.norm_weight = norm.f32.data();
  c.normed = normed_ref.data();
  c.eps = 1e-6f;
  if (with_extra) {
    c.extra = extra.f32.data();
    c.extra_gate = extra_gate.f32.data();
  }
  kernels::launch_moe_unpermute_combine(c, pool());
  EXPECT_LT(rel_error(to_f32(f_normed.download()), normed_ref), kBf16Tolerance) << what;
  EXPECT_LT(rel_error(to_f32(f_res.download()), res_ref), kBf16Tolerance) << what;
}

// The combine with the norm fused stores what the combine and rms_norm store apart, bit for bit
// (out, residual and normed), and matches the CPU reference; a route of weight 0 (an absent
// expert's NaN row) is skipped. With the extra term (the shared expert run apart), against the
// combine, the sigmoid gate's accumulate and the norm; and the extra term without the norm.
TEST(GpuMoeFused, CombineWithNormEqualsCombineThenNorm) {
  std::mt19937 rng(33);
  for (int tokens : {1, 7, 300}) {
    for (int hidden : {64, 2048, 4104}) {
      for (bool with_extra : {false, true}) check_combine_norm(tokens, hidden, with_extra, rng);
    }
  }
}

}  // namespace
}  // namespace relay::gpu_test

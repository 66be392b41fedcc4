// The MoE's fused decode ops against the ops they replace: the combine with the next RMSNorm
// against the combine and the norm kernels run apart (the same bits), and the fused routing
// against the norm, router, top-k and permute kernels.
#include <cmath>
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

struct RouteCase {
  int tokens, hidden, experts, top_k, shared_parts;
  bool renormalize;
};

void check_route(const RouteCase& c, std::mt19937& rng) {
  const int columns = c.experts + (c.shared_parts > 0 ? 1 : 0), routes = c.top_k + c.shared_parts;
  const int groups = c.experts + c.shared_parts, rows = c.tokens * routes;
  const size_t n = static_cast<size_t>(c.tokens) * c.hidden;
  auto x = random_bf16(n, rng), res = random_bf16(n, rng, 3.0f), norm = random_bf16(c.hidden, rng);
  // Router rows of norm 1 / sqrt(hidden) x 4: logits of a few units, so the softmax is not flat.
  auto router = random_bf16(static_cast<size_t>(columns) * c.hidden, rng,
                            4.0f / std::sqrt(static_cast<float>(c.hidden)));
  DeviceBuffer<bf16> d_x(x.bits), d_norm(norm.bits), d_router(router.bits);
  // Apart: rms_norm with the residual, the router GEMM (streaming at decode's rows).
  DeviceBuffer<bf16> a_res(res.bits), a_normed(n), a_logits(static_cast<size_t>(c.tokens) * columns);
  kernels::launch_rms_norm({d_x.get(), a_res.get(), d_norm.get(), a_normed.get(), c.tokens, c.hidden, 1e-6f},
                           nullptr);
  kernels::launch_matmul({a_normed.get(), d_router.get(), nullptr, a_logits.get(), c.tokens, columns, c.hidden},
                         nullptr);
  // Fused, twice: the second launch finds the counter the first one reset.
  DeviceBuffer<bf16> f_res(n), f_normed(n), f_logits(static_cast<size_t>(c.tokens) * columns);
  DeviceBuffer<int32_t> f_ids(rows), f_index(rows), f_offsets(groups + 1);
  DeviceBuffer<float> f_weights(rows);
  for (int launch = 0; launch < 2; ++launch) {
    f_res.upload(res.bits);
    f_normed.poison();
    f_index.poison();
    f_offsets.poison();
    kernels::launch_moe_route({d_x.get(), f_res.get(), d_norm.get(), f_normed.get(), d_router.get(),
                               f_logits.get(), f_ids.get(), f_weights.get(), f_index.get(),
                               f_offsets.get(), c.tokens, c.hidden, c.experts, c.top_k,
                               c.renormalize, c.shared_parts, 1e-6f},
                              nullptr);
  }
  const std::string what = "tokens " + std::to_string(c.tokens) + " hidden " + std::to_string(c.hidden) +
                           " experts " + std::to_string(c.experts) + " shared " + std::to_string(c.shared_parts);
  EXPECT_EQ(rel_error(to_f32(f_res.download()), to_f32(a_res.download())), 0.0) << what;
  EXPECT_EQ(rel_error(to_f32(f_normed.download()), to_f32(a_normed.download())), 0.0) << what;
  EXPECT_LT(rel_error(to_f32(f_logits.download()), to_f32(a_logits.download())), 1e-2) << what;
  // The top-k and the index of the fused kernel's own logits: the kernels' bits.
  DeviceBuffer<int32_t> a_ids(rows), a_index(rows), a_offsets(groups + 1);
  DeviceBuffer<float> a_weights(rows);
  kernels::launch_moe_router_topk({f_logits.get(), a_ids.get(), a_weights.get(), c.tokens, c.experts,
                                   c.top_k, c.renormalize, c.shared_parts},
                                  nullptr);
  kernels::launch_moe_permute({f_normed.get(), a_ids.get(), nullptr, a_index.get(), a_offsets.get(),
                               c.tokens, c.hidden, groups, routes},
                              nullptr);
  EXPECT_EQ(f_ids.download(), a_ids.download()) << what;
  EXPECT_EQ(f_weights.download(), a_weights.download()) << what;
  EXPECT_EQ(f_index.download(), a_index.download()) << what;
  EXPECT_EQ(f_offsets.download(), a_offsets.download()) << what;

  // The CPU reference of the whole op.
  std::vector<float> res_ref = res.f32, normed_ref(n), logits_ref(static_cast<size_t>(c.tokens) * columns);
  std::vector<int32_t> ids_ref(rows), index_ref(rows), offsets_ref(groups + 1);
  std::vector<float> weights_ref(rows);
  kernels::launch_moe_route({x.f32.data(), res_ref.data(), norm.f32.data(), normed_ref.data(),
                             router.f32.data(), logits_ref.data(), ids_ref.data(), weights_ref.data(),
                             index_ref.data(), offsets_ref.data(), c.tokens, c.hidden, c.experts,
                             c.top_k, c.renormalize, c.shared_parts, 1e-6f},
                            pool());
  EXPECT_LT(rel_error(to_f32(f_res.download()), res_ref), kBf16Tolerance) << what;
  EXPECT_LT(rel_error(to_f32(f_normed.download()), normed_ref), kBf16Tolerance) << what;
  EXPECT_LT(rel_error(to_f32(f_logits.download()), logits_ref), kBf16Tolerance) << what;
}

// The fused decode routing stores the residual and normed rows rms_norm stores, bit for bit, logits
// within bf16 of the router GEMM's (its sums run in another order), and the top-k and permute
// index the two kernels compute from those logits; the CPU reference agrees. Qwen3-30B-A3B's and
// Qwen3.5's router shapes (the latter with its shared expert folded: 257 router rows, 9 routes), a
// short row (fewer vectors than a warp's lanes) and 235B's 4096 and the widest 8192 (several weight
// rounds a lane), at 1 to 8 tokens.
TEST(GpuMoeFused, RouteEqualsNormRouterTopkPermute) {
  std::mt19937 rng(35);
  for (const RouteCase& c : {RouteCase{1, 2048, 128, 8, 0, true}, RouteCase{8, 2048, 128, 8, 0, true},
                             RouteCase{1, 2048, 256, 8, 1, true}, RouteCase{5, 2048, 256, 8, 1, true},
                             RouteCase{3, 64, 16, 4, 0, false}, RouteCase{2, 4096, 128, 8, 0, true},
                             RouteCase{8, 8192, 512, 10, 1, false}}) {
    check_route(c, rng);
  }
}

}  // namespace
}  // namespace relay::gpu_test

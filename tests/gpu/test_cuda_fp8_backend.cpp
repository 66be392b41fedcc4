// CudaBackend with block-scaled FP8 weights (docs/fp8.md): against the bf16 GPU run and the
// transformers fixtures (top-1 agreement and mean KL divergence of the next-token distribution),
// an FP8 checkpoint written by `relay quantize` equal to quantising the same bf16 weights at load,
// and decoding through CUDA graphs equal to eager decoding.
//
// FP8 rounds every weight to 3 mantissa bits and every activation entering a linear to e4m3 per
// (token, 128-group), so logits move by a few percent: these tests bound the distribution shift
// (KL) and the arg-max agreement rather than element errors, and print both.
#include <cmath>
#include <filesystem>
#include <iostream>

#include "convert/quantize_checkpoint.h"
#include "tests/gpu/backend_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace relay::gpu_test {
namespace {

CudaBackendOptions fp8_options(bool graphs) {
  CudaBackendOptions o = small_options(graphs);
  o.weights = WeightFormat::kFp8;
  return o;
}

// Mean KL(p_want || p_got) over rows, and the fraction of rows whose arg-max agrees.
struct Divergence {
  double mean_kl = 0.0, top1 = 0.0;
  int rows = 0;
};
Divergence divergence(const std::vector<float>& got, const std::vector<float>& want, int vocab) {
  Divergence d;
  d.rows = static_cast<int>(want.size() / vocab);
  int agree = 0;
  for (int r = 0; r < d.rows; ++r) {
    const float* g = got.data() + static_cast<size_t>(r) * vocab;
    const float* w = want.data() + static_cast<size_t>(r) * vocab;
    const float gmax = *std::max_element(g, g + vocab), wmax = *std::max_element(w, w + vocab);
    double gz = 0, wz = 0;
    for (int v = 0; v < vocab; ++v)
      gz += std::exp(double(g[v]) - gmax), wz += std::exp(double(w[v]) - wmax);
    double kl = 0;
    for (int v = 0; v < vocab; ++v) {
      const double lw = double(w[v]) - wmax - std::log(wz), lg = double(g[v]) - gmax - std::log(gz);
      kl += std::exp(lw) * (lw - lg);
    }
    d.mean_kl += kl;
    agree += (std::max_element(g, g + vocab) - g) == (std::max_element(w, w + vocab) - w);
  }
  d.mean_kl /= std::max(d.rows, 1);
  d.top1 = double(agree) / std::max(d.rows, 1);
  return d;
}

// The fixtures the FP8 path serves: every unshifted one except attention biases (the FP8 GEMMs add
// none; loading one is refused, tested below).
std::vector<std::string> fp8_fixtures() {
  std::vector<std::string> out;
  for (const std::string& n : unshifted_fixtures()) {
    if (n.find("bias") == std::string::npos) out.push_back(n);
  }
  return out;
}

class CudaFp8Fixture : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaFp8Fixture, PromptLogitsTrackTransformers) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CudaBackend backend(dir, fp8_options(false));
  EXPECT_GT(backend.load_stats().fp8_linears, 0);
  const int vocab = static_cast<int>(backend.config().vocab_size);
  // NOTE: the fixtures are random-weight models whose next-token distributions are nearly flat, so
  // the arg-max flips under FP8 noise far more often than on a trained model (the demo model below
  // agrees on 95%); the distribution shift (KL) is the tight bound, top-1 the loose one, over all
  // positions of all prompts (measured on the H200: 0.65-1.0 per prompt, 0.73 over sparse-step).
  Divergence total;
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    const Divergence d = divergence(prefill_logits(backend, fx.prompts[i]), fx.logits[i], vocab);
    std::cout << GetParam() << " prompt " << i << ": fp8 vs transformers top-1 " << d.top1
              << ", mean KL " << d.mean_kl << " over " << d.rows << " positions\n";
    EXPECT_LT(d.mean_kl, 0.02) << GetParam() << " prompt " << i;
    total.top1 += d.top1 * d.rows;
    total.rows += d.rows;
  }
  EXPECT_GE(total.top1 / total.rows, 0.6) << GetParam();
}

TEST_P(CudaFp8Fixture, GraphDecodeEqualsEager) {
  auto dir = test::fixture_models_dir() / GetParam();
  auto fx = test::ModelFixture::load(dir, dir);
  CudaBackend eager(dir, fp8_options(false));
  CudaBackend graphs(dir, fp8_options(true));
  EXPECT_EQ(greedy_batched(eager, fx.prompts, 12), greedy_batched(graphs, fx.prompts, 12))
      << GetParam();
}

std::string fp8_param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaFp8Fixture, ::testing::ValuesIn(fp8_fixtures()),
                         fp8_param_name);

TEST(CudaFp8Backend, RefusesAttentionBiasWithAMessage) {
  const auto dir = test::fixture_models_dir() / "qwen3-attention-bias";
  try {
    CudaBackend backend(dir, fp8_options(false));
    FAIL() << "loaded an attention-bias model in FP8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attention_bias"), std::string::npos) << e.what();
  }
}

// The demo model: FP8 against bf16 on the GPU over every position of the fixture's prompts and
// continuations; a `relay quantize` checkpoint loads as FP8 and equals quantising at load.
TEST(CudaFp8Backend, DemoModelAgainstBf16AndTheQuantizedCheckpoint) {
  const auto model_dir = std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  auto fx =
      test::ModelFixture::load(test::fixture_models_dir() / "relay-demo-moe-expected", model_dir);
  const auto fp8_dir = std::filesystem::temp_directory_path() / "relay-gpu-test-demo-fp8";
  std::filesystem::remove_all(fp8_dir);
  quant::quantize_checkpoint({model_dir, fp8_dir, quant::QuantMethod::Fp8Block, {}});

  CudaBackend bf16(model_dir, small_options(false));
  CudaBackend at_load(model_dir, fp8_options(false));
  CudaBackendOptions auto_opts =
      small_options(false);  // kAuto: the checkpoint's F8 tensors stay FP8
  CudaBackend from_ckpt(fp8_dir, auto_opts);
  EXPECT_EQ(from_ckpt.load_stats().fp8_linears, at_load.load_stats().fp8_linears);
  const int vocab = static_cast<int>(bf16.config().vocab_size);
  Divergence total;
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    std::vector<int32_t> seq = fx.prompts[i];
    seq.insert(seq.end(), fx.greedy[i].begin(), fx.greedy[i].end());
    const std::vector<float> want = prefill_logits(bf16, seq);
    const std::vector<float> got = prefill_logits(at_load, seq);
    EXPECT_EQ(prefill_logits(from_ckpt, seq), got) << "prompt " << i;
    const Divergence d = divergence(got, want, vocab);
    total.mean_kl += d.mean_kl * d.rows;
    total.top1 += d.top1 * d.rows;
    total.rows += d.rows;
  }
  std::cout << "demo: fp8 vs bf16 top-1 " << total.top1 / total.rows << ", mean KL "
            << total.mean_kl / total.rows << " over " << total.rows << " positions\n";
  EXPECT_GE(total.top1 / total.rows, 0.9);
  EXPECT_LT(total.mean_kl / total.rows, 0.02);
  // kBf16 on the FP8 checkpoint dequantises at load: no FP8 linears.
  CudaBackendOptions bf16_opts = small_options(false);
  bf16_opts.weights = WeightFormat::kBf16;
  CudaBackend dequantized(fp8_dir, bf16_opts);
  EXPECT_EQ(dequantized.load_stats().fp8_linears, 0);
  std::filesystem::remove_all(fp8_dir);
}

}  // namespace
}  // namespace relay::gpu_test

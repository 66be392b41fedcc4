// FP8 checkpoints through Relay's model loader (model/layers.cpp dequantises F8_E4M3 weights with
// their scales into fp32 at load, through quant::dequantize_stored_weight):
//   - the torch-made Qwen3-*-FP8-layout fixture (tests/fixtures/quant/qwen3-moe-fp8, BF16 scales):
//     every dequantised weight equals torch's `q.float() * scale_inv.float()` bit for bit (FNV-1a
//     hashes of the fp32 bytes), and the loaded model's logits match transformers' fp32 forward
//     with those weights, within the tolerance tests/unit/engine/test_model_fixtures.cpp justifies;
//   - accuracy of `relay quantize` on the demo model (models/relay-demo-moe): bf16 vs fp8-block128
//     and vs mxfp8, top-1 agreement and mean KL(p_bf16 || p_fp8) of the next-token distribution
//     over every position of the demo fixture's prompts + greedy continuations (teacher-forced).
//     The numbers are printed (docs/fp8.md records them); the assertions only catch a broken path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>

#include <nlohmann/json.hpp>

#include "core/thread_pool.h"
#include "model/registry.h"
#include "model/safetensors.h"
#include "convert/quantize_checkpoint.h"
#include "quant/quant_config.h"
#include "quant/weight_quant.h"

namespace relay::quant {
namespace {

namespace fs = std::filesystem;

const fs::path kFp8Fixture = fs::path(RELAY_FIXTURES_DIR) / "quant" / "qwen3-moe-fp8";

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

std::string fnv1a64(const std::vector<float>& values) {
  uint64_t h = 0xCBF29CE484222325ull;
  const auto* bytes = reinterpret_cast<const uint8_t*>(values.data());
  for (size_t i = 0; i < values.size() * sizeof(float); ++i) h = (h ^ bytes[i]) * 0x100000001B3ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// One sequence at a time through a Model, all positions' logits.
class Runner {
 public:
  explicit Runner(const fs::path& dir)
      : model_(load_model(dir)), kv_(model_->kv_layout(kBlockSize, kNumBlocks)), pool_(2) {}

  // Logits [tokens.size(), vocab] of a fresh sequence (positions 0..n-1).
  std::vector<float> run(const std::vector<int32_t>& tokens) {
    std::vector<int32_t> positions(tokens.size()), rows(tokens.size()), table(kNumBlocks);
    std::iota(positions.begin(), positions.end(), 0);
    std::iota(rows.begin(), rows.end(), 0);
    std::iota(table.begin(), table.end(), 0);
    std::vector<int64_t> slots(tokens.begin(), tokens.end());
    std::iota(slots.begin(), slots.end(), 0);
    const std::vector<int32_t> starts{0, static_cast<int32_t>(tokens.size())};
    const std::vector<int32_t> context{static_cast<int32_t>(tokens.size())};
    ForwardBatch b{tokens, positions, starts, context, table, kNumBlocks, slots, rows};
    std::vector<float> logits;
    model_->forward(b, kv_, pool_, logits);
    return logits;
  }
  int vocab() const { return model_->vocab_size(); }

 private:
  static constexpr int kBlockSize = 16, kNumBlocks = 8;
  std::unique_ptr<Model> model_;
  KvPool kv_;
  ThreadPool pool_;
};

TEST(Fp8Checkpoint, DequantisedWeightsEqualTorchBitForBit) {
  const Checkpoint ckpt(kFp8Fixture);
  const QuantConfig config = QuantConfig::load(kFp8Fixture);
  ASSERT_EQ(config.method, QuantMethod::Fp8Block);
  const nlohmann::json hashes = read_json(kFp8Fixture / "expected.json").at("dequant_fnv1a64");
  ASSERT_EQ(hashes.size(), 3u * (4 + 8 * 3));
  for (const auto& [name, hash] : hashes.items()) {
    const TensorView& w = ckpt.get(name);
    const TensorView& s = ckpt.get(scale_tensor_name(config, name));
    ASSERT_EQ(s.dtype, DType::BF16) << name;
    std::vector<float> out(w.shape[0] * w.shape[1]);
    dequantize_stored_weight(config, {w.name, w.file, w.dtype, w.shape, w.data},
                             {s.name, s.file, s.dtype, s.shape, s.data}, out.data());
    EXPECT_EQ(fnv1a64(out), hash.get<std::string>()) << name;
  }
}

TEST(Fp8Checkpoint, LoadedModelMatchesTransformersOnTheDequantisedWeights) {
  Runner runner(kFp8Fixture);
  const auto prompts = read_json(kFp8Fixture / "expected.json")
                           .at("prompts")
                           .get<std::vector<std::vector<int32_t>>>();
  const SafetensorsFile expected(kFp8Fixture / "expected.safetensors");
  double worst = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<float> ours = runner.run(prompts[i]);
    const std::vector<float> ref =
        tensor_to_f32(expected.tensors().at("logits_" + std::to_string(i)));
    ASSERT_EQ(ours.size(), ref.size());
    for (size_t e = 0; e < ours.size(); ++e) {
      const float err = std::fabs(ours[e] - ref[e]);
      worst = std::max(worst, static_cast<double>(err));
      ASSERT_LE(err, 1e-4f + 1e-4f * std::fabs(ref[e])) << "prompt " << i << " element " << e;
    }
  }
  std::printf("[ qwen3-moe-fp8 ] max |logit error| vs transformers = %.3g\n", worst);
}

struct Agreement {
  int positions = 0;
  int top1_agree = 0;
  double kl_sum = 0;
  double kl_max = 0;
};

// KL(p || q) of the softmaxes of two logit rows, in double.
double kl_divergence(const float* p_logits, const float* q_logits, int n) {
  const double p_max = *std::max_element(p_logits, p_logits + n),
               q_max = *std::max_element(q_logits, q_logits + n);
  double p_sum = 0, q_sum = 0;
  for (int i = 0; i < n; ++i) {
    p_sum += std::exp(p_logits[i] - p_max);
    q_sum += std::exp(q_logits[i] - q_max);
  }
  const double p_log_z = p_max + std::log(p_sum), q_log_z = q_max + std::log(q_sum);
  double kl = 0;
  for (int i = 0; i < n; ++i) {
    const double log_p = p_logits[i] - p_log_z, log_q = q_logits[i] - q_log_z;
    kl += std::exp(log_p) * (log_p - log_q);
  }
  return std::max(kl, 0.0);
}

// The demo fixture's prompts + greedy continuations, each teacher-forced as one sequence.
std::vector<std::vector<int32_t>> demo_sequences() {
  const nlohmann::json j = read_json(fs::path(RELAY_FIXTURES_DIR) / "models" /
                                     "relay-demo-moe-expected" / "expected.json");
  const auto prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
  const auto greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
  std::vector<std::vector<int32_t>> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    seqs.push_back(prompts[i]);
    seqs.back().insert(seqs.back().end(), greedy[i].begin(), greedy[i].end());
  }
  return seqs;
}

Agreement compare_demo(const fs::path& quantized_dir) {
  const fs::path demo = fs::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  Runner reference(demo), quantized(quantized_dir);
  Agreement a;
  const int vocab = reference.vocab();
  for (const std::vector<int32_t>& seq : demo_sequences()) {
    const std::vector<float> p = reference.run(seq), q = quantized.run(seq);
    for (size_t t = 0; t < seq.size(); ++t) {
      const float* pr = p.data() + t * vocab;
      const float* qr = q.data() + t * vocab;
      a.top1_agree +=
          std::max_element(pr, pr + vocab) - pr == std::max_element(qr, qr + vocab) - qr;
      const double kl = kl_divergence(pr, qr, vocab);
      a.kl_sum += kl;
      a.kl_max = std::max(a.kl_max, kl);
      ++a.positions;
    }
  }
  return a;
}

class DemoAccuracy : public ::testing::TestWithParam<QuantMethod> {};

TEST_P(DemoAccuracy, QuantisedDemoModelTracksBf16) {
  const std::string format = GetParam() == QuantMethod::Fp8Block ? "fp8-block128" : "mxfp8";
  const fs::path out = fs::path(::testing::TempDir()) / ("relay_demo_" + format);
  fs::remove_all(out);
  quantize_checkpoint(
      {fs::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe", out, GetParam(), {}});
  const Agreement a = compare_demo(out);
  const double top1 = static_cast<double>(a.top1_agree) / a.positions,
               mean_kl = a.kl_sum / a.positions;
  std::printf(
      "[ demo %s ] positions %d  top-1 agreement %.4f (%d/%d)  mean KL %.3e nats  max KL %.3e\n",
      format.c_str(), a.positions, top1, a.top1_agree, a.positions, mean_kl, a.kl_max);
  RecordProperty("top1_agreement", std::to_string(top1));
  RecordProperty("mean_kl", std::to_string(mean_kl));
  EXPECT_GE(a.positions, 200);
  EXPECT_GE(top1, 0.9);
  EXPECT_LT(mean_kl, 0.05);
}

INSTANTIATE_TEST_SUITE_P(Formats, DemoAccuracy,
                         ::testing::Values(QuantMethod::Fp8Block, QuantMethod::Mxfp8),
                         [](const auto& info) {
                           return info.param == QuantMethod::Fp8Block ? "Fp8Block128" : "Mxfp8";
                         });

}  // namespace
}  // namespace relay::quant

// The MTP draft head (model/mtp.h, Model::forward_mtp) against the torch oracle of
// tests/fixtures/make_mtp_fixtures.py, on three heads: the checkpoint's own mtp.* of the Qwen3.5
// MoE and dense fixtures, and a random head for the Qwen3-MoE fixture shipped in a directory of its
// own (qwen3-moe-mtp, the in-house case).
//
// Checked, per prompt of the fixture: the target's last_hidden() after its prefill against
// transformers' last_hidden_state (the head's input), the head's prefill over every prompt row
// (token t[p + 1] with hidden[p] at position p) against mtp_logits, and three chained steps (the
// previous draft with the previous row's output y) against mtp_chain_logits and the oracle's greedy
// drafts; then all prompts in one batch, target and head both in two chunks, in shuffled blocks
// (the head reads its own K/V of the first chunk back from its KV layer). Loading the head leaves
// the target's logits bit for bit as they were, and a missing head, a missing or misshapen tensor
// or a second MTP layer is an error that names the tensor and the directory or file.
// (The Qwen3.5 fixtures' two pre-fc norms are both all ones, HYBRID.md: only the Qwen3-MoE head
// tells them apart.) Tolerance as the hybrid model tests: |ours - oracle| <= 1e-4 + 1e-4 |oracle|
// (the oracle agrees with an independent float64 forward to ~1e-6; the smallest draft margin is
// 6e-4).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "../engine/fixtures.h"
#include "../error_text.h"
#include "core/error.h"
#include "model/registry.h"
#include "model_runner.h"

namespace relay {
namespace {

using test::argmax;
using test::Runner;
using test::Seq;

constexpr float kAbsTol = 1e-4f;
constexpr float kRelTol = 1e-4f;

std::filesystem::path models_dir() { return std::filesystem::path(RELAY_FIXTURES_DIR) / "models"; }

// One head of the fixtures: the target, where its head comes from, where the references are.
struct HeadFixture {
  std::string name;
  std::string target;
  std::string head_dir;  // empty: the checkpoint's own mtp.*

  std::filesystem::path target_path() const { return models_dir() / target; }
  std::filesystem::path expected_dir() const {
    return models_dir() / (head_dir.empty() ? target : head_dir);
  }
  MtpSource source() const {
    return {.enabled = true,
            .dir = head_dir.empty() ? std::filesystem::path{} : models_dir() / head_dir};
  }
};

void PrintTo(const HeadFixture& f, std::ostream* os) { *os << f.name; }

const std::vector<HeadFixture> kHeads = {{"qwen3_5_moe", "qwen3_5-moe", ""},
                                         {"qwen3_5_dense", "qwen3_5-dense", ""},
                                         {"qwen3_moe_separate_head", "qwen3-moe", "qwen3-moe-mtp"}};

// mtp_expected.{json,safetensors}.
struct MtpExpected {
  std::vector<std::vector<int32_t>> prompts, inputs, drafts;
  std::vector<std::vector<float>> hidden, logits, chain_logits;  // per prompt, row-major

  static MtpExpected load(const std::filesystem::path& dir) {
    MtpExpected e;
    std::ifstream in(dir / "mtp_expected.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    e.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
    e.inputs = j.at("inputs").get<std::vector<std::vector<int32_t>>>();
    e.drafts = j.at("drafts").get<std::vector<std::vector<int32_t>>>();
    SafetensorsFile st(dir / "mtp_expected.safetensors");
    auto read = [&](const std::string& name) { return test::read_f32(st, name); };
    for (size_t i = 0; i < e.prompts.size(); ++i) {
      e.hidden.push_back(read(str("hidden_", i)));
      e.logits.push_back(read(str("mtp_logits_", i)));
      e.chain_logits.push_back(read(str("mtp_chain_logits_", i)));
    }
    return e;
  }
};

// Checks `ours` against `ref` element by element; returns the largest absolute error.
double expect_close(std::span<const float> ours, std::span<const float> ref,
                    const std::string& what) {
  EXPECT_EQ(ours.size(), ref.size()) << what;
  double worst = 0;
  for (size_t e = 0; e < std::min(ours.size(), ref.size()); ++e) {
    const float err = std::fabs(ours[e] - ref[e]);
    worst = std::max(worst, static_cast<double>(err));
    if (!(err <= kAbsTol + kRelTol * std::fabs(ref[e]))) {
      ADD_FAILURE() << what << ": element " << e << " is " << ours[e] << ", the oracle " << ref[e];
      return worst;
    }
  }
  return worst;
}

std::vector<float> last_row(std::span<const float> rows, size_t width) {
  return {rows.end() - static_cast<ptrdiff_t>(width), rows.end()};
}

class MtpHeadTest : public ::testing::TestWithParam<HeadFixture> {};

TEST_P(MtpHeadTest, PrefillAndChainedDraftsMatchTheOracle) {
  const HeadFixture& f = GetParam();
  const MtpExpected ex = MtpExpected::load(f.expected_dir());
  Runner r(f.target_path(), f.source());
  ASSERT_TRUE(r.model().has_mtp());
  const size_t v = r.vocab(), h = r.hidden_size();
  double worst_hidden = 0, worst = 0;
  for (size_t i = 0; i < ex.prompts.size(); ++i) {
    const std::string what = str(f.name, " prompt ", i);
    Seq s = r.new_seq();
    r.target({&s}, {ex.prompts[i]});
    const std::vector<float> hidden(r.model().last_hidden().begin(), r.model().last_hidden().end());
    worst_hidden = std::max(worst_hidden, expect_close(hidden, ex.hidden[i], what + " hidden"));

    // The head's prefill reads last_hidden() itself: forward_mtp may be given the Model's scratch.
    std::vector<float> logits = r.head({&s}, {ex.inputs[i]}, r.model().last_hidden()).front();
    worst = std::max(worst, expect_close(logits, ex.logits[i], what + " prefill"));
    ASSERT_EQ(argmax(logits.data() + logits.size() - v, v), ex.drafts[i][0]) << what;
    for (size_t k = 0; k < 3; ++k) {
      const std::vector<float> y = last_row(r.model().last_hidden(), h);
      logits = r.head({&s}, {{ex.drafts[i][k]}}, y).front();
      const std::span<const float> ref(ex.chain_logits[i].data() + k * v, v);
      worst = std::max(worst, expect_close(logits, ref, str(what, " chain step ", k)));
      ASSERT_EQ(argmax(logits.data(), v), ex.drafts[i][k + 1]) << what << " chain step " << k;
    }
  }
  std::printf("[ %s ] max |hidden error| %.3g, max |MTP logit error| %.3g\n", f.name.c_str(),
              worst_hidden, worst);
}

TEST_P(MtpHeadTest, BatchedChunkedPrefillReadsItsOwnCache) {
  const HeadFixture& f = GetParam();
  const MtpExpected ex = MtpExpected::load(f.expected_dir());
  Runner r(f.target_path(), f.source());
  const size_t v = r.vocab(), h = r.hidden_size(), n = ex.prompts.size();
  std::vector<Seq> seqs;
  std::vector<Seq*> all;
  for (size_t i = 0; i < n; ++i) seqs.push_back(r.new_seq());
  for (Seq& s : seqs) all.push_back(&s);
  // Each prompt in two chunks (the first at least one token); the head runs after each target
  // chunk on its rows, the first chunk's last row pairing with the second chunk's first token. A
  // one-token prompt has no second chunk and sits that step out.
  std::vector<std::vector<float>> got(n), last_y(n);
  for (int chunk = 0; chunk < 2; ++chunk) {
    std::vector<Seq*> step;
    std::vector<std::vector<int32_t>> target_tokens, head_tokens;
    std::vector<size_t> index;
    for (size_t i = 0; i < n; ++i) {
      const size_t cut = (ex.prompts[i].size() + 1) / 2;
      const size_t begin = chunk == 0 ? 0 : cut, end = chunk == 0 ? cut : ex.prompts[i].size();
      if (begin == end) continue;
      step.push_back(all[i]);
      target_tokens.emplace_back(ex.prompts[i].begin() + begin, ex.prompts[i].begin() + end);
      head_tokens.emplace_back(ex.inputs[i].begin() + begin, ex.inputs[i].begin() + end);
      index.push_back(i);
    }
    r.target(step, target_tokens);
    const std::vector<float> hidden(r.model().last_hidden().begin(), r.model().last_hidden().end());
    const std::vector<std::vector<float>> out = r.head(step, head_tokens, hidden);
    const std::span<const float> y = r.model().last_hidden();
    size_t row = 0;
    for (size_t k = 0; k < step.size(); ++k) {
      got[index[k]].insert(got[index[k]].end(), out[k].begin(), out[k].end());
      row += head_tokens[k].size();
      last_y[index[k]].assign(y.begin() + (row - 1) * h, y.begin() + row * h);
    }
  }
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    worst = std::max(worst, expect_close(got[i], ex.logits[i], str(f.name, " batched prompt ", i)));
  }
  // Every sequence's first chained step together, each on its own last y.
  std::vector<std::vector<int32_t>> first_drafts;
  std::vector<float> ys;
  for (size_t i = 0; i < n; ++i) {
    first_drafts.push_back({ex.drafts[i][0]});
    ys.insert(ys.end(), last_y[i].begin(), last_y[i].end());
  }
  const std::vector<std::vector<float>> chain = r.head(all, first_drafts, ys);
  for (size_t i = 0; i < n; ++i) {
    const std::span<const float> ref(ex.chain_logits[i].data(), v);
    worst = std::max(worst, expect_close(chain[i], ref, str(f.name, " batched chain, prompt ", i)));
    EXPECT_EQ(argmax(chain[i].data(), v), ex.drafts[i][1]) << "prompt " << i;
  }
  std::printf("[ %s ] batched, chunked: max |MTP logit error| %.3g\n", f.name.c_str(), worst);
}

TEST_P(MtpHeadTest, TheHeadLeavesTheTargetAsItWas) {
  const HeadFixture& f = GetParam();
  const MtpExpected ex = MtpExpected::load(f.expected_dir());
  Runner with(f.target_path(), f.source()), without(f.target_path(), {});
  EXPECT_FALSE(without.model().has_mtp());
  EXPECT_EQ(without.model().num_mtp_layers(), 0);
  EXPECT_EQ(with.model().num_mtp_layers(), 1);
  // The head's K/V layer follows the target's attention layers.
  const int target_layers = static_cast<int>(with.model().config().num_kv_cache_layers());
  EXPECT_EQ(with.model().kv_layout(4, 8).num_layers, target_layers + 1);
  EXPECT_EQ(without.model().kv_layout(4, 8).num_layers, target_layers);
  for (size_t i = 0; i < ex.prompts.size(); ++i) {
    Seq a = with.new_seq(), b = without.new_seq();
    EXPECT_EQ(with.target({&a}, {ex.prompts[i]}), without.target({&b}, {ex.prompts[i]}))
        << "prompt " << i;
  }
  Seq s = without.new_seq();
  without.target({&s}, {ex.prompts[0]});
  const std::vector<float> hidden(without.model().last_hidden().begin(),
                                  without.model().last_hidden().end());
  EXPECT_NE(test::error_text([&] {
              without.head({&s}, {ex.inputs[0]}, hidden);
            }).find("was loaded without an MTP head"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MtpHeadTest, ::testing::ValuesIn(kHeads),
                         [](const auto& info) { return info.param.name; });

// The qwen3-moe-mtp head's tensors, to write altered copies of.
std::vector<TensorToWrite> separate_head_tensors() {
  SafetensorsFile st(models_dir() / "qwen3-moe-mtp" / "model.safetensors");
  std::vector<TensorToWrite> out;
  for (const auto& [name, t] : st.tensors()) {
    out.push_back({name, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.nbytes)});
  }
  return out;
}

std::string load_error(const std::filesystem::path& head_dir,
                       const std::vector<TensorToWrite>& tensors) {
  std::filesystem::create_directories(head_dir);
  write_safetensors(head_dir / "model.safetensors", tensors);
  return test::error_text(
      [&] { load_model(models_dir() / "qwen3-moe", {.enabled = true, .dir = head_dir}); });
}

TEST(MtpHeadErrors, ACheckpointWithoutAHeadPointsAtTheModelDirectory) {
  const std::string e = test::error_text(
      [&] { load_model(models_dir() / "qwen3-moe", {.enabled = true, .dir = {}}); });
  EXPECT_NE(e.find("has no tensor mtp.fc.weight"), std::string::npos) << e;
  EXPECT_NE(e.find((models_dir() / "qwen3-moe").string()), std::string::npos) << e;
  EXPECT_NE(e.find("it ships no MTP head"), std::string::npos) << e;
  EXPECT_NE(e.find("\"model\": DIR"), std::string::npos) << e;
}

TEST(MtpHeadErrors, AMisshapenTensorIsNamedWithItsFileAndBothShapes) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "mtp-misshapen";
  std::vector<TensorToWrite> tensors = separate_head_tensors();
  for (TensorToWrite& t : tensors) {
    // The in-house mistake of a head trained for another width: o_proj [64, 128] saved as [64, 64].
    if (t.name != "mtp.layers.0.self_attn.o_proj.weight") continue;
    t.shape = {64, 64};
    t.bytes.resize(t.bytes.size() / 2);
  }
  const std::string e = load_error(dir, tensors);
  EXPECT_NE(e.find("mtp.layers.0.self_attn.o_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find((dir / "model.safetensors").string()), std::string::npos) << e;
  EXPECT_NE(e.find("[64, 64]"), std::string::npos) << e;
  EXPECT_NE(e.find("[64, 128]"), std::string::npos) << e;
}

TEST(MtpHeadErrors, AMissingTensorIsNamedWithTheDirectory) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "mtp-missing";
  std::vector<TensorToWrite> tensors = separate_head_tensors();
  std::erase_if(tensors,
                [](const TensorToWrite& t) { return t.name == "mtp.pre_fc_norm_hidden.weight"; });
  const std::string e = load_error(dir, tensors);
  EXPECT_NE(e.find("the MTP head directory " + dir.string() +
                   " has no tensor mtp.pre_fc_norm_hidden.weight"),
            std::string::npos)
      << e;
}

TEST(MtpHeadErrors, ASecondLayerIsRefused) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "mtp-two-layers";
  std::vector<TensorToWrite> tensors = separate_head_tensors();
  const size_t n = tensors.size();
  for (size_t i = 0; i < n; ++i) {
    if (!tensors[i].name.starts_with("mtp.layers.0.")) continue;
    TensorToWrite copy = tensors[i];
    copy.name.replace(0, std::strlen("mtp.layers.0."), "mtp.layers.1.");
    tensors.push_back(std::move(copy));
  }
  const std::string e = load_error(dir, tensors);
  EXPECT_NE(e.find("has 2 layers"), std::string::npos) << e;
  EXPECT_NE(e.find("Relay runs exactly one"), std::string::npos) << e;
}

}  // namespace
}  // namespace relay

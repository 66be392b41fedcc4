// Reading the model fixtures made by tests/fixtures/make_model_fixtures.py (HF transformers outputs).
#pragma once

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "model/safetensors.h"
#include "parallel/parallel_config.h"

namespace relay::test {

inline std::filesystem::path fixture_models_dir() { return std::filesystem::path(RELAY_FIXTURES_DIR) / "models"; }

// An fp32 tensor of an oracle's expected-output file, copied out.
inline std::vector<float> read_f32(const SafetensorsFile& st, const std::string& name) {
  const TensorView& t = st.tensors().at(name);
  std::vector<float> v(t.numel());
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

struct ModelFixture {
  std::filesystem::path dir;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> greedy;
  int position_offset = 0;
  std::vector<std::vector<float>> logits;  // per prompt [len, vocab] (demo: [1, vocab] of prompt 0)

  static ModelFixture load(const std::filesystem::path& expected_dir, const std::filesystem::path& model_dir) {
    ModelFixture f;
    f.dir = model_dir;
    std::ifstream in(expected_dir / "expected.json");
    nlohmann::json j = nlohmann::json::parse(in);
    f.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
    f.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
    f.position_offset = j.at("position_offset").get<int>();
    SafetensorsFile st(expected_dir / "expected.safetensors");
    for (size_t i = 0;; ++i) {
      auto it = st.tensors().find("logits_" + std::to_string(i));
      if (it == st.tensors().end()) it = st.tensors().find("last_logits_" + std::to_string(i));
      if (it == st.tensors().end()) break;
      f.logits.push_back(read_f32(st, it->first));
    }
    return f;
  }
};

// The trained demo hybrid (models/relay-demo-hybrid) and what its recipe measured in torch
// (tests/fixtures/models/relay-demo-hybrid-expected/expected_demo_hybrid.json, written by the
// recipe's train.py on the GPU machine): per sample, transformers' fp32 greedy continuation (64
// tokens), each step's top-1 - top-2 logit margin, and whether the teacher-forced MTP draft at
// each position p from the prompt's last one on equals token p + 2 (mtp_hits[j] is the draft that
// guesses generated_ids[j + 1]).
struct DemoHybridFixture {
  struct Sample {
    std::vector<int32_t> prompt_ids, generated_ids;
    std::vector<float> margins;
    std::vector<int> mtp_hits;
  };
  std::vector<Sample> samples;
  double mtp_acceptance_k1 = 0;  // torch's: hits / positions over every sample

  static std::filesystem::path model_dir() {
    return std::filesystem::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-hybrid";
  }

  static DemoHybridFixture load() {
    std::ifstream in(fixture_models_dir() / "relay-demo-hybrid-expected" /
                     "expected_demo_hybrid.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    DemoHybridFixture f;
    f.mtp_acceptance_k1 = j.at("mtp_acceptance_k1").get<double>();
    for (const nlohmann::json& s : j.at("samples")) {
      f.samples.push_back({s.at("prompt_ids").get<std::vector<int32_t>>(),
                           s.at("generated_ids").get<std::vector<int32_t>>(),
                           s.at("margins").get<std::vector<float>>(),
                           s.at("mtp_hits").get<std::vector<int>>()});
    }
    return f;
  }
};

// A parameterised test's model and rank layout, and its gtest name ("qwen3_moe_tp2_ep2_dp1").
struct LayoutCase {
  std::string model;  // a fixture name, or "demo"
  parallel::ParallelConfig parallel;
};

inline void PrintTo(const LayoutCase& c, std::ostream* os) {
  *os << c.model << " " << c.parallel.describe();
}

inline std::string layout_case_name(const ::testing::TestParamInfo<LayoutCase>& info) {
  std::string n = info.param.model + "_tp" + std::to_string(info.param.parallel.tp) + "_ep" +
                  std::to_string(info.param.parallel.ep) + "_dp" +
                  std::to_string(info.param.parallel.dp);
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

// The tiny HF checkpoints, one per architecture variant.
inline std::vector<std::string> tiny_fixture_names() {
  return {"qwen3-dense", "qwen3-moe", "qwen3-moe-sparse-step", "qwen3-moe-no-norm-topk", "qwen3-yarn",
          "qwen3-attention-bias"};
}

}  // namespace relay::test

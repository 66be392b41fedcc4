// Speculative decoding in the engine (EngineConfig::speculative): with the n-gram proposer the
// CPU backend writes exactly the tokens it writes without it, in fewer steps when drafts are
// accepted, and the spec-decode counters add up; configurations a backend cannot run are refused.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../error_text.h"
#include "../scheduler/fake_backend.h"
#include "engine/cpu_backend.h"
#include "engine/llm_engine.h"

namespace relay {
namespace {

const std::string kDemo = RELAY_SOURCE_DIR "/models/relay-demo-moe";

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(kDemo);
  return t;
}

struct Decoded {
  std::vector<int32_t> tokens;
  int steps = 0;
  SpecDecodeStats stats;
};

// Decodes three requests (a repetitive one among them) to completion.
Decoded run(const SpeculativeConfig& spec, float temperature) {
  CpuBackendOptions o;
  o.num_blocks = 96;
  o.num_threads = 2;
  EngineConfig config;
  config.max_num_batched_tokens = 64;  // chunked prefill for the longer prompt
  config.speculative = spec;
  LLMEngine engine(std::make_unique<CpuBackend>(kDemo, o), tokenizer(), config);
  const std::vector<std::string> prompts = {
      "def add(a, b):\n    return a + b\n\ndef add(a, b):",
      "import os\nimport sys\nimport os\nimport",
      "class Tree:\n    def __init__(self, left, right):\n        self.left = left\n        self.right = right\n"};
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r;
    r.prompt = tokenizer().encode(prompts[i]);
    r.sampling.temperature = temperature;
    r.sampling.seed = 11 + i;
    r.stop.max_tokens = 48;
    r.stop.ignore_eos = true;
    engine.add_request(static_cast<int64_t>(i), r);
  }
  Decoded out;
  std::vector<std::vector<int32_t>> tokens(prompts.size());
  while (engine.has_work()) {
    for (const RequestOutput& o : engine.step()) {
      tokens.at(static_cast<size_t>(o.id)).insert(tokens[o.id].end(), o.new_tokens.begin(),
                                                  o.new_tokens.end());
    }
    ++out.steps;
  }
  for (const auto& t : tokens) out.tokens.insert(out.tokens.end(), t.begin(), t.end());
  out.stats = engine.stats().spec_decode;
  return out;
}

TEST(SpeculativeEngine, NgramDraftsAreLosslessAndSaveSteps) {
  SpeculativeConfig ngram;
  ngram.method = SpeculativeConfig::Method::kNgram;
  ngram.num_speculative_tokens = 4;
  ngram.prompt_lookup_min = 1;
  ngram.prompt_lookup_max = 4;
  for (const float temperature : {0.0f, 0.8f}) {
    const Decoded plain = run({}, temperature);
    const Decoded spec = run(ngram, temperature);
    EXPECT_EQ(spec.tokens, plain.tokens) << "temperature " << temperature;
    EXPECT_EQ(plain.stats.num_drafts, 0u);
    EXPECT_GT(spec.stats.num_drafts, 0u);
    EXPECT_GT(spec.stats.num_accepted_tokens, 0u);
    EXPECT_LE(spec.stats.num_accepted_tokens, spec.stats.num_draft_tokens);
    ASSERT_EQ(spec.stats.num_accepted_tokens_per_pos.size(), 4u);
    uint64_t per_pos = 0;
    for (size_t pos = 0; pos < 4; ++pos) {
      per_pos += spec.stats.num_accepted_tokens_per_pos[pos];
      // A draft is accepted only after the ones before it.
      if (pos > 0) {
        EXPECT_LE(spec.stats.num_accepted_tokens_per_pos[pos],
                  spec.stats.num_accepted_tokens_per_pos[pos - 1]);
      }
    }
    EXPECT_EQ(per_pos, spec.stats.num_accepted_tokens);
    if (temperature == 0.0f) {
      EXPECT_LT(spec.steps, plain.steps);
    }
  }
}

TEST(SpeculativeEngine, ConfigurationsABackendCannotRunAreRefused) {
  SpeculativeConfig ngram;
  ngram.method = SpeculativeConfig::Method::kNgram;
  ngram.num_speculative_tokens = 2;
  EngineConfig config;
  config.speculative = ngram;
  struct NoDrafts : testing::ScriptedBackend {
    using ScriptedBackend::ScriptedBackend;
    bool supports_draft_tokens() const override { return false; }
  };
  EXPECT_NE(test::error_text([&] {
              LLMEngine e(std::make_unique<NoDrafts>(std::vector<int32_t>{1}), tokenizer(), config);
            }).find("does not verify drafts"),
            std::string::npos);
  config.speculative.method = SpeculativeConfig::Method::kMtp;
  EXPECT_NE(test::error_text([&] {
              LLMEngine e(std::make_unique<testing::ScriptedBackend>(std::vector<int32_t>{1}),
                          tokenizer(), config);
            }).find("MTP drafting is not built yet"),
            std::string::npos);
}

}  // namespace
}  // namespace relay

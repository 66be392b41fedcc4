// engine/step_check.h: each malformed field of a step's sequence is refused, naming the sequence
// and what is wrong; a well-formed one (drafts, prompt logprobs, constraints) passes.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "../error_text.h"
#include "engine/step_check.h"

namespace relay {
namespace {

TEST(StepCheck, RefusesEachMalformedFieldByName) {
  const StepLimits limits{100, 4, 2, 5, "the test backend"};
  SamplingParams sp;
  std::vector<int32_t> tokens{1, 2, 3}, blocks{0};
  std::vector<uint32_t> mask(2 * 4, 1u);  // 4 words per row for 100 tokens, two rows
  std::vector<std::pair<int32_t, float>> bias{{7, 1.0f}};
  std::vector<TokenLogprob> prompt_lps;
  auto good = [&] {
    StepSequence s;
    s.seq_id = 9;
    s.tokens = tokens;
    s.num_computed = 1;
    s.block_table = blocks;
    s.sample = true;
    s.sampling = &sp;
    s.num_draft_tokens = 1;
    s.allowed_tokens = mask;
    s.logit_bias = bias;
    s.num_prompt_logprobs = 5;
    s.prompt_logprobs = &prompt_lps;
    return s;
  };
  check_step_sequence(good(), limits);
  const std::vector<int32_t> none, one_block{0};
  std::vector<uint32_t> short_mask(4, 1u), empty_row(8, 0u);
  std::fill(empty_row.begin(), empty_row.begin() + 4, 1u);
  const std::vector<std::pair<int32_t, float>> far_bias{{100, 1.0f}};
  struct Case {
    const char* what;
    std::function<void(StepSequence&)> spoil;
  };
  const std::vector<Case> cases = {
      {"has no tokens", [&](StepSequence& s) { s.tokens = none; s.num_draft_tokens = 0; }},
      {"num_computed -1", [](StepSequence& s) { s.num_computed = -1; }},
      {"needs 8 KV slots", [](StepSequence& s) { s.num_computed = 5; }},
      {"no SamplingParams", [](StepSequence& s) { s.sampling = nullptr; }},
      {"verifies at most 2", [](StepSequence& s) { s.num_draft_tokens = 3; }},
      {"drafts need a sampling sequence", [](StepSequence& s) { s.sample = false; }},
      {"asks for 6 prompt logprobs", [](StepSequence& s) { s.num_prompt_logprobs = 6; }},
      {"into a prompt_logprobs output", [](StepSequence& s) { s.prompt_logprobs = nullptr; }},
      {"token bitmask of 4 words", [&](StepSequence& s) { s.allowed_tokens = short_mask; }},
      {"row 1 allows no token", [&](StepSequence& s) { s.allowed_tokens = empty_row; }},
      {"logit_bias token 100", [&](StepSequence& s) { s.logit_bias = far_bias; }},
  };
  for (const Case& c : cases) {
    StepSequence s = good();
    c.spoil(s);
    test::expect_error([&] { check_step_sequence(s, limits); }, c.what);
    test::expect_error([&] { check_step_sequence(s, limits); }, "sequence 9");
  }
}

}  // namespace
}  // namespace relay

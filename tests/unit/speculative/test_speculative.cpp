// speculative/speculative.h: vLLM's --speculative-config parsed with errors naming the field, and
// the n-gram proposer's choice of suffix and occurrence.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "../error_text.h"
#include "core/error.h"
#include "speculative/speculative.h"

namespace relay {
namespace {

using Tokens = std::vector<int32_t>;

TEST(SpeculativeConfig, ParsesVllmsJson) {
  SpeculativeConfig c = SpeculativeConfig::parse(
      R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2})");
  EXPECT_EQ(c.method, SpeculativeConfig::Method::kNgram);
  EXPECT_EQ(c.num_speculative_tokens, 3);
  EXPECT_EQ(c.prompt_lookup_max, 4);
  EXPECT_EQ(c.prompt_lookup_min, 2);
  EXPECT_EQ(c.describe(), "ngram k=3 lookup 2..4");
  c = SpeculativeConfig::parse(R"({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 1})");
  EXPECT_EQ(c.prompt_lookup_min, 1);  // the default never exceeds the maximum given
  c = SpeculativeConfig::parse(R"({"method": "mtp", "num_speculative_tokens": 2, "model": "/m"})");
  EXPECT_EQ(c.method, SpeculativeConfig::Method::kMtp);
  EXPECT_EQ(c.model, "/m");
  EXPECT_EQ(c.disable_by_batch_size, 0);
  c = SpeculativeConfig::parse(R"({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8})");
  EXPECT_EQ(c.disable_by_batch_size, 8);
  EXPECT_EQ(c.describe(), "ngram k=2 lookup 2..5, off above 8 running");
  EXPECT_FALSE(SpeculativeConfig{}.enabled());
}

TEST(SpeculativeConfig, MinDraftAcceptance) {
  const SpeculativeConfig c = SpeculativeConfig::parse(
      R"({"method": "mtp", "num_speculative_tokens": 2, "min_draft_acceptance": 0.4})");
  EXPECT_DOUBLE_EQ(c.min_draft_acceptance, 0.4);
  EXPECT_EQ(c.describe(), "mtp k=2, drafts landing >= 0.4");
  for (const char* bad : {"0", "1", "1.5", "-0.2", "\"high\""}) {
    const std::string json =
        str(R"({"method": "ngram", "num_speculative_tokens": 2, "min_draft_acceptance": )", bad, "}");
    EXPECT_NE(test::error_text([&] { SpeculativeConfig::parse(json); })
                  .find("'min_draft_acceptance' must be a number between 0 and 1"),
              std::string::npos)
        << bad;
  }
}

// A request starts at K drafts, keeps the drafts likely to land under its recent acceptance, stops
// when even the first is unlikely, and probes with one draft after 4, 8, 16 ... steps off.
TEST(DraftLength, FollowsTheRequestsAcceptance) {
  DraftLength d(4, 0.3);
  EXPECT_EQ(d.next(), 4);
  for (int i = 0; i < 20; ++i) d.observe(4, 4);  // everything accepted
  EXPECT_GT(d.acceptance(), 0.99);
  EXPECT_EQ(d.next(), 4);
  // Half of the drafts reached accepted: draft 0 lands 0.5, draft 1 0.25 < 0.3.
  for (int i = 0; i <= 40; ++i) d.observe(1, i % 2);
  EXPECT_NEAR(d.acceptance(), 0.5, 0.1);
  EXPECT_EQ(d.next(), 1);
  // Rejected every time: off (the step whose next() said 0 is the first without), then a probe
  // after 4 steps without; a failed probe doubles the wait.
  int steps = 0;
  while (d.next() > 0) {
    d.observe(1, 0);
    ASSERT_LT(++steps, 10);
  }
  int off = 1;
  for (int wait : {4, 8, 16, 32, 64, 64}) {
    for (int i = off; i < wait; ++i) EXPECT_EQ(d.next(), 0) << wait;
    off = 0;
    EXPECT_EQ(d.next(), 1) << wait;
    EXPECT_EQ(d.next(), 1) << wait;  // until a probe is verified
    d.observe(1, 0);
  }
  // A probe accepted: the wait drops back to 4, and drafting resumes once acceptance recovers.
  for (int i = 0; i < 64; ++i) EXPECT_EQ(d.next(), 0);
  EXPECT_EQ(d.next(), 1);
  d.observe(1, 1);
  int probes = 0;
  for (int step = 0; step < 40 && d.next() < 4; ++step) {
    if (d.next() > 0) {
      d.observe(1, 1);
      ++probes;
    }
  }
  EXPECT_GE(probes, 1);
  EXPECT_EQ(d.next(), 4);
  EXPECT_THROW(d.observe(2, 3), Error);
  EXPECT_THROW(DraftLength(0, 0.5), Error);
}

TEST(SpeculativeConfig, BadConfigurationsNameTheField) {
  auto error = [](const std::string& json) {
    return test::error_text([&] { SpeculativeConfig::parse(json); });
  };
  EXPECT_NE(error(R"({"method": "eagle", "num_speculative_tokens": 2})").find("unknown method 'eagle'"),
            std::string::npos);
  EXPECT_NE(error(R"({"method": "ngram"})").find("'num_speculative_tokens' is required"), std::string::npos);
  EXPECT_NE(error(R"({"method": "ngram", "num_speculative_tokens": 0})").find("between 1 and 16"),
            std::string::npos);
  EXPECT_NE(error(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6, "prompt_lookup_max": 3})")
                .find("exceeds 'prompt_lookup_max'"),
            std::string::npos);
  EXPECT_NE(error(R"({"method": "ngram", "num_speculative_tokens": 2, "speed": 9})").find("unknown field 'speed'"),
            std::string::npos);
  EXPECT_NE(error(R"({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3})")
                .find("is an ngram option"),
            std::string::npos);
  EXPECT_NE(error(R"({"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 1})")
                .find("'disable_by_batch_size' must be between 2"),
            std::string::npos);
  EXPECT_NE(error("[1]").find("must be a JSON object"), std::string::npos);
  EXPECT_NE(error("{").find("not valid JSON"), std::string::npos);
}

TEST(NgramProposer, TheLongestSuffixAtItsLatestEarlierOccurrence) {
  // ... 1 2 3 | 7 8 9 ... 1 2 3 | 4 5 ... 1 2 3: the 3-gram "1 2 3" last occurred before "4 5".
  const Tokens t = {1, 2, 3, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 1, 2, 3};
  EXPECT_EQ(propose_ngram(t, 1, 3, 2), (Tokens{4, 5}));
  // Past the end the match repeats with its period (6 here): an overlapping copy.
  EXPECT_EQ(propose_ngram(t, 1, 3, 10), (Tokens{4, 5, 6, 1, 2, 3, 4, 5, 6, 1}));
  // A short loop fills the draft: "a b a b" drafts "a b a", a run of one token "7 7 7".
  EXPECT_EQ(propose_ngram(Tokens{3, 1, 2, 1, 2}, 1, 3, 3), (Tokens{1, 2, 1}));
  EXPECT_EQ(propose_ngram(Tokens{5, 7, 7}, 1, 3, 3), (Tokens{7, 7, 7}));
  // A longer suffix wins over a more recent shorter one: "9 0" occurred once, "0" twice.
  const Tokens u = {9, 0, 5, 5, 0, 6, 9, 0};
  EXPECT_EQ(propose_ngram(u, 1, 2, 1), Tokens{5});
  EXPECT_EQ(propose_ngram(u, 1, 1, 1), Tokens{6});  // "0" alone: its latest occurrence
  // No repeated suffix long enough: nothing.
  EXPECT_TRUE(propose_ngram(Tokens{1, 2, 3, 4}, 1, 3, 4).empty());
  EXPECT_TRUE(propose_ngram(u, 3, 5, 2).empty());
  EXPECT_TRUE(propose_ngram(Tokens{7}, 1, 3, 2).empty());
  EXPECT_TRUE(propose_ngram(Tokens{}, 1, 3, 2).empty());
}

TEST(NgramProposer, EqualsTheDefinitionOnRandomContexts) {
  // The definition, one suffix length at a time: the longest suffix of min_n..max_n tokens with an
  // earlier occurrence, its latest one, and the k tokens after it (periodic past the end).
  auto reference = [](const Tokens& t, int min_n, int max_n, int k) -> Tokens {
    const int len = static_cast<int>(t.size());
    for (int n = std::min(max_n, len - 1); n >= min_n; --n) {
      for (int start = len - n - 1; start >= 0; --start) {
        if (!std::equal(t.end() - n, t.end(), t.begin() + start)) continue;
        Tokens draft;
        for (int i = 0; i < k; ++i) draft.push_back(t[start + n + i % (len - start - n)]);
        return draft;
      }
    }
    return {};
  };
  std::mt19937 rng(3);
  for (int trial = 0; trial < 2000; ++trial) {
    Tokens t(rng() % 40);
    const int vocab = 2 + static_cast<int>(rng() % 4);  // few ids: many matches and loops
    for (int32_t& id : t) id = static_cast<int32_t>(rng() % vocab);
    const int min_n = 1 + static_cast<int>(rng() % 3), max_n = min_n + static_cast<int>(rng() % 4);
    const int k = 1 + static_cast<int>(rng() % 6);
    ASSERT_EQ(propose_ngram(t, min_n, max_n, k), reference(t, min_n, max_n, k))
        << "trial " << trial << ", " << t.size() << " tokens, lookup " << min_n << ".." << max_n;
  }
}

}  // namespace
}  // namespace relay

namespace relay {
namespace {

TEST(SpecDecodeStats, AcceptanceRateAndLengthSinceAnEarlierReading) {
  SpecDecodeStats before{.num_drafts = 2, .num_draft_tokens = 4, .num_accepted_tokens = 1,
                         .num_accepted_tokens_per_pos = {1, 0}};
  SpecDecodeStats now{.num_drafts = 6, .num_draft_tokens = 12, .num_accepted_tokens = 7,
                      .num_accepted_tokens_per_pos = {4, 3}};
  const SpecDecodeStats d = now.since(before);
  EXPECT_EQ(d.num_drafts, 4u);
  EXPECT_EQ(d.num_draft_tokens, 8u);
  EXPECT_EQ(d.num_accepted_tokens, 6u);
  EXPECT_EQ(d.num_accepted_tokens_per_pos, (std::vector<uint64_t>{3, 3}));
  EXPECT_DOUBLE_EQ(d.acceptance_rate(), 0.75);
  EXPECT_DOUBLE_EQ(d.mean_acceptance_length(), 2.5);  // vLLM's: 1 + accepted per decode
  EXPECT_EQ(SpecDecodeStats{}.acceptance_rate(), 0.0);
  EXPECT_EQ(SpecDecodeStats{}.mean_acceptance_length(), 0.0);
}

}  // namespace
}  // namespace relay

// The sampler's semantics (vLLM's): masks, penalties, greedy, determinism in (seed, sample_index),
// logprobs of the raw logits (of a sampled token, or of a given one for prompt logprobs), and the
// verification of drafts: greedy acceptance, each row sampled as without drafts, and the rejection
// rule for a point-mass draft against the exact probabilities of a fixed row.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <vector>

#include "core/error.h"
#include "engine/sampler.h"

namespace relay {
namespace {

const float kInf = std::numeric_limits<float>::infinity();

std::vector<float> probs_of(const std::vector<float>& logits) {
  double mx = -kInf, sum = 0;
  for (float l : logits) mx = std::max<double>(mx, l);
  std::vector<float> p(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) sum += (p[i] = std::exp(logits[i] - mx));
  for (float& x : p) x /= sum;
  return p;
}

TEST(Sampler, TopKKeepsTheKLargestAndTies) {
  std::vector<float> l{1, 5, 3, 5, 2, 4};
  apply_top_k(l, 2);
  EXPECT_EQ(l, (std::vector<float>{-kInf, 5, -kInf, 5, -kInf, -kInf}));
  std::vector<float> m{1, 5, 3, 4};
  apply_top_k(m, 3);
  EXPECT_EQ(m, (std::vector<float>{-kInf, 5, 3, 4}));
  std::vector<float> n{1, 2};
  apply_top_k(n, 0);  // off
  EXPECT_EQ(n, (std::vector<float>{1, 2}));
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  // probabilities 0.5, 0.25, 0.125, 0.125
  std::vector<float> base{std::log(0.5f), std::log(0.25f), std::log(0.125f), std::log(0.125f)};
  auto l = base;
  apply_top_p(l, 0.7f);  // 0.5 < 0.7 <= 0.75
  EXPECT_TRUE(std::isfinite(l[0]) && std::isfinite(l[1]));
  EXPECT_TRUE(std::isinf(l[2]) && std::isinf(l[3]));
  l = base;
  apply_top_p(l, 0.4f);  // the top token alone
  EXPECT_TRUE(std::isfinite(l[0]) && std::isinf(l[1]));
  l = base;
  apply_top_p(l, 1e-6f);  // never empty
  EXPECT_TRUE(std::isfinite(l[0]));
  l = base;
  apply_top_p(l, 1.0f);  // off
  EXPECT_EQ(l, base);
}

TEST(Sampler, TopPOnALargeVocabularyMatchesAFullSort) {
  // Flat and peaked distributions, so the nucleus is sometimes wider than the first partial sort.
  for (float spread : {0.05f, 1.0f, 6.0f}) {
    std::vector<float> base(20000);
    uint64_t state = 42;
    for (float& l : base) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      l = spread * static_cast<float>(static_cast<int64_t>(state >> 40) % 1000) / 100.0f;
    }
    for (float top_p : {0.1f, 0.5f, 0.9f, 0.99f}) {
      auto got = base;
      apply_top_p(got, top_p);
      std::vector<int32_t> order(base.size());
      std::iota(order.begin(), order.end(), 0);
      // Recompute the nucleus with a full sort, in double like the sampler.
      std::vector<double> p64(base.size());
      double mx = *std::max_element(base.begin(), base.end()), sum = 0;
      for (size_t i = 0; i < base.size(); ++i) sum += (p64[i] = std::exp(static_cast<double>(base[i]) - mx));
      for (double& x : p64) x /= sum;
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return p64[a] > p64[b] || (p64[a] == p64[b] && a < b);
      });
      double cumulative = 0;
      size_t keep = 0;
      while (keep < order.size() && (keep == 0 || cumulative < top_p)) cumulative += p64[order[keep++]];
      std::vector<bool> kept(base.size(), false);
      for (size_t i = 0; i < keep; ++i) kept[order[i]] = true;
      for (size_t i = 0; i < base.size(); ++i) {
        ASSERT_EQ(std::isfinite(got[i]), kept[i]) << "spread " << spread << " top_p " << top_p << " token " << i;
      }
    }
  }
}

TEST(Sampler, MinPMasksRelativeToTheMostLikelyToken) {
  std::vector<float> l{std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  apply_min_p(l, 0.2f);  // threshold 0.1: drops only the 0.05 token
  EXPECT_TRUE(std::isfinite(l[2]));
  EXPECT_TRUE(std::isinf(l[3]));
  apply_min_p(l, 0.5f);  // threshold 0.25
  EXPECT_TRUE(std::isfinite(l[1]));
  EXPECT_TRUE(std::isinf(l[2]));
}

TEST(Sampler, PenaltiesFollowVllm) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  std::vector<float> l{4, -4, 4, -4, 4};
  std::vector<int32_t> prompt{0, 1}, output{2, 2, 3};
  apply_penalties(l, prompt, output, p);
  EXPECT_FLOAT_EQ(l[0], 2.0f);                       // prompt only: repetition
  EXPECT_FLOAT_EQ(l[1], -8.0f);                      // negative: multiplied
  EXPECT_FLOAT_EQ(l[2], 2.0f - 2 * 0.5f - 0.25f);    // output twice: all three
  EXPECT_FLOAT_EQ(l[3], -8.0f - 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(l[4], 4.0f);                       // unseen
}

TEST(Sampler, GreedyIsArgmaxOfPenalisedLogitsWithLowestIndexOnTies) {
  SamplingParams p;
  p.temperature = 0.0f;
  std::vector<float> l{1, 3, 3, 2};
  EXPECT_EQ(sample_token(l, p, {}, {}, 0).token, 1);
  p.presence_penalty = 5.0f;
  std::vector<int32_t> out{1};
  std::vector<float> m{1, 3, 3, 2};
  EXPECT_EQ(sample_token(m, p, {}, out, 0).token, 2);
}

TEST(Sampler, DrawsAreAPureFunctionOfSeedAndIndex) {
  SamplingParams p;
  p.temperature = 1.0f;
  std::vector<float> base(50);
  for (size_t i = 0; i < base.size(); ++i) base[i] = std::sin(static_cast<float>(i)) * 2;
  auto draw = [&](uint64_t seed, uint64_t index) {
    auto l = base;
    p.seed = seed;
    return sample_token(l, p, {}, {}, index).token;
  };
  std::vector<int32_t> a, b, c;
  for (uint64_t i = 0; i < 64; ++i) {
    a.push_back(draw(7, i));
    b.push_back(draw(7, i));
    c.push_back(draw(8, i));
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(sample_uniform(1, 2), sample_uniform(1, 2));
  EXPECT_NE(sample_uniform(1, 2), sample_uniform(1, 3));
}

TEST(Sampler, SampledFrequenciesFollowTheDistribution) {
  std::vector<float> base{0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};  // 0.1 0.2 0.3 0.4
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 99;
  const int n = 20000;
  std::vector<int> counts(4, 0);
  for (int i = 0; i < n; ++i) {
    auto l = base;
    ++counts[sample_token(l, p, {}, {}, i).token];
  }
  for (int t = 0; t < 4; ++t) EXPECT_NEAR(counts[t] / static_cast<double>(n), 0.1 * (t + 1), 0.015) << "token " << t;
  // temperature sharpens: at 0.25 the probabilities go as (t+1)^4
  p.temperature = 0.25f;
  std::fill(counts.begin(), counts.end(), 0);
  for (int i = 0; i < n; ++i) {
    auto l = base;
    ++counts[sample_token(l, p, {}, {}, i).token];
  }
  EXPECT_NEAR(counts[3] / static_cast<double>(n), 256.0 / (1 + 16 + 81 + 256), 0.015);
}

// ---- Drafts -------------------------------------------------------------------------------------

// Concatenated rows of logits.
std::vector<float> rows_of(const std::vector<std::vector<float>>& rows) {
  std::vector<float> out;
  for (const auto& r : rows) out.insert(out.end(), r.begin(), r.end());
  return out;
}

std::vector<int32_t> tokens_of(const std::vector<SampledToken>& sampled) {
  std::vector<int32_t> out;
  for (const SampledToken& t : sampled) out.push_back(t.token);
  return out;
}

// Greedy: drafts are accepted while they equal their row's argmax; the first that does not is
// replaced by the argmax, and after k accepted drafts the last row gives the bonus token. Each
// token's logprobs are its own row's.
TEST(Sampler, GreedyDraftsAreAcceptedWhileTheyEqualTheArgmax) {
  const std::vector<std::vector<float>> rows{{0, 1, 3, 2}, {4, 1, 0, 2}, {0, 1, 2, 5}};
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.num_logprobs = 1;
  auto verify = [&](std::vector<int32_t> drafts) {
    std::vector<float> l = rows_of(rows);
    l.resize((drafts.size() + 1) * 4);
    return sample_with_drafts(l, drafts, greedy, {}, {}, 0);
  };
  const std::vector<SampledToken> all = verify({2, 0});
  EXPECT_EQ(tokens_of(all), (std::vector<int32_t>{2, 0, 3}));  // both accepted, then the bonus
  EXPECT_EQ(tokens_of(verify({2, 1})), (std::vector<int32_t>{2, 0}));  // the correction at 1
  EXPECT_EQ(tokens_of(verify({1, 0})), (std::vector<int32_t>{2}));
  EXPECT_EQ(tokens_of(verify({})), (std::vector<int32_t>{2}));
  for (size_t j = 0; j < all.size(); ++j) {
    std::vector<float> lp(4);
    log_softmax(rows[j], lp);
    EXPECT_FLOAT_EQ(all[j].logprob, lp[static_cast<size_t>(all[j].token)]) << "row " << j;
    ASSERT_EQ(all[j].top.size(), 1u);
    EXPECT_EQ(all[j].top[0].first, all[j].token);
  }
  std::vector<float> short_rows(8);
  const std::vector<int32_t> two{1, 2};
  EXPECT_THROW(sample_with_drafts(short_rows, two, greedy, {}, {}, 0), Error);
}

// The benchmark's forced acceptance: each draft is accepted with the given probability whatever
// its row sampled (not lossless); a rejected one is replaced by its row's token.
TEST(Sampler, ForcedAcceptanceIgnoresTheTarget) {
  const std::vector<std::vector<float>> rows{{0, 1, 3, 2}, {4, 1, 0, 2}, {0, 1, 2, 5}};
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  auto verify = [&](std::vector<int32_t> drafts, std::optional<double> forced, uint64_t index) {
    std::vector<float> l = rows_of(rows);
    return tokens_of(sample_with_drafts(l, drafts, greedy, {}, {}, index, {}, forced));
  };
  // Drafts the target would reject (argmaxes are 2, 0, 3): all accepted at 1, then the bonus.
  EXPECT_EQ(verify({1, 1}, 1.0, 0), (std::vector<int32_t>{1, 1, 3}));
  // At 0 none is, even one the target agrees with: the first row's token stands.
  EXPECT_EQ(verify({2, 0}, 0.0, 0), (std::vector<int32_t>{2}));
  EXPECT_EQ(verify({2, 0}, std::nullopt, 0), (std::vector<int32_t>{2, 0, 3}));
  // At 0.5, about half of the first drafts over many sample indices.
  int accepted = 0;
  for (uint64_t index = 0; index < 2000; ++index) accepted += verify({1, 1}, 0.5, index).size() > 1;
  EXPECT_NEAR(accepted / 2000.0, 0.5, 0.05);
}

// Row j's penalties count the drafts before it as output, and its constraints are its own bitmask.
TEST(Sampler, EachDraftRowIsSampledAfterTheDraftsBeforeIt) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.frequency_penalty = 2.0f;
  const std::vector<float> row{0.0f, 3.0f, 2.5f, 1.5f};
  const std::vector<int32_t> drafts{1, 2};
  std::vector<float> l = rows_of({row, row, row});
  // Row 0 takes 1; row 1, with 1 penalised, takes 2; row 2, with 1 and 2 penalised, takes 3.
  EXPECT_EQ(tokens_of(sample_with_drafts(l, drafts, p, {}, {}, 0)),
            (std::vector<int32_t>{1, 2, 3}));
  // The same with a history: 3 was output before, so row 2 takes 1 again.
  const std::vector<int32_t> history{3};
  l = rows_of({row, row, row});
  EXPECT_EQ(tokens_of(sample_with_drafts(l, drafts, p, {}, history, 0)),
            (std::vector<int32_t>{1, 2, 1}));
  // Bitmasks per row: row 1 allows only token 3, so draft 2 is rejected for 3.
  p.frequency_penalty = 0.0f;
  const std::vector<uint32_t> masks{0xfu, 0x8u, 0xfu};
  l = rows_of({row, row, row});
  EXPECT_EQ(tokens_of(sample_with_drafts(l, drafts, p, {}, {}, 0, {masks, {}})),
            (std::vector<int32_t>{1, 3}));
  const std::vector<uint32_t> two_masks{0xfu, 0xfu};
  l = rows_of({row, row, row});
  EXPECT_THROW(sample_with_drafts(l, drafts, p, {}, {}, 0, {two_masks, {}}), Error);
}

// Seeded sampling with drafts draws, row by row, the tokens sample_token draws without them (the
// same sample indices and histories): right drafts reproduce them all, a wrong one is replaced by
// what would have been sampled there.
TEST(Sampler, DraftsGiveTheTokensSampledWithoutThem) {
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_p = 0.95f;
  p.min_p = 0.01f;
  p.presence_penalty = 0.3f;
  const size_t vocab = 40;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    p.seed = seed;
    std::vector<std::vector<float>> rows(3, std::vector<float>(vocab));
    for (size_t j = 0; j < 3; ++j) {
      for (size_t v = 0; v < vocab; ++v) {
        rows[j][v] = 2.0f * std::sin(static_cast<float>(seed * 7 + j * 13 + v * v));
      }
    }
    std::vector<int32_t> history{5}, without;
    for (size_t j = 0; j < 3; ++j) {
      std::vector<float> l = rows[j];
      without.push_back(sample_token(l, p, {}, history, 11 + j).token);
      history.push_back(without.back());
    }
    const std::vector<int32_t> before{5};
    std::vector<float> l = rows_of(rows);
    const std::vector<int32_t> right{without[0], without[1]};
    ASSERT_EQ(tokens_of(sample_with_drafts(l, right, p, {}, before, 11)), without);
    l = rows_of(rows);
    const std::vector<int32_t> wrong{without[0], (without[1] + 1) % static_cast<int32_t>(vocab)};
    ASSERT_EQ(tokens_of(sample_with_drafts(l, wrong, p, {}, before, 11)),
              (std::vector<int32_t>{without[0], without[1]}));
  }
}

// The acceptance rule against the exact probabilities of a fixed row: p is the row's distribution
// after temperature and top-k; a draft d is accepted with probability p(d), and on rejection the
// token follows p with d removed and renormalised (a draft outside the top k is never accepted).
// Over fixed seeds the frequencies must lie within 4.5 standard deviations of those probabilities.
TEST(Sampler, DraftAcceptanceIsTheRejectionRuleForAPointMass) {
  const std::vector<float> row{1.0f, 0.2f, 0.7f, -0.5f, 0.4f, -3.0f};
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_k = 4;  // token 5 (and 3, the 5th largest) out
  std::vector<double> prob(row.size(), 0.0);
  double sum = 0.0;
  for (size_t t = 0; t < row.size(); ++t) {
    if (t == 3 || t == 5) continue;
    sum += prob[t] = std::exp(static_cast<double>(row[t]) / p.temperature);
  }
  for (double& x : prob) x /= sum;
  const int n = 40000;
  const auto within = [&](double frequency, double expected, int trials) {
    const double sigma = std::sqrt(expected * (1 - expected) / trials);
    return std::fabs(frequency - expected) <= 4.5 * sigma + 1e-12;
  };
  for (const int32_t d : {0, 2, 4, 3}) {
    int accepted = 0;
    std::vector<int> rejected_as(row.size(), 0);
    for (int i = 0; i < n; ++i) {
      p.seed = 1000 + static_cast<uint64_t>(i);
      std::vector<float> l = rows_of({row, row});
      const std::vector<int32_t> draft{d};
      const std::vector<SampledToken> got = sample_with_drafts(l, draft, p, {}, {}, 3);
      if (got.size() == 2) {
        ++accepted;
      } else {
        ++rejected_as[static_cast<size_t>(got[0].token)];
      }
    }
    EXPECT_TRUE(within(accepted / static_cast<double>(n), prob[d], n))
        << "draft " << d << " accepted " << accepted << " of " << n << ", p = " << prob[d];
    const int rejections = n - accepted;
    EXPECT_EQ(rejected_as[static_cast<size_t>(d)], 0);
    for (size_t t = 0; t < row.size(); ++t) {
      if (static_cast<int32_t>(t) == d) continue;
      const double residual = prob[t] / (1.0 - prob[static_cast<size_t>(d)]);
      EXPECT_TRUE(within(rejected_as[t] / static_cast<double>(rejections), residual, rejections))
          << "draft " << d << ": token " << t << " drawn " << rejected_as[t] << " of " << rejections
          << " rejections, expected " << residual;
    }
  }
}

TEST(Sampler, MasksRestrictWhatCanBeSampled) {
  std::vector<float> base{2.0f, 1.9f, 1.8f, 0.0f, -1.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;
  for (uint64_t i = 0; i < 500; ++i) {
    auto l = base;
    int32_t t = sample_token(l, p, {}, {}, i).token;
    ASSERT_TRUE(t == 0 || t == 1);
  }
}

TEST(Sampler, LogprobsAreOfTheRawLogitsAndSumToOne) {
  std::vector<float> base{0.3f, -1.0f, 2.5f, 2.5f, 0.0f, 1.0f};
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 2;
  p.repetition_penalty = 1.5f;
  p.num_logprobs = 3;
  std::vector<int32_t> out{2};
  auto l = base;
  SampledToken s = sample_token(l, p, {}, out, 5);
  std::vector<float> lp(base.size());
  log_softmax(base, lp);
  double total = 0;
  for (float v : lp) total += std::exp(v);
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_FLOAT_EQ(s.logprob, lp[s.token]);
  ASSERT_EQ(s.top.size(), 3u);
  EXPECT_EQ(s.top[0].first, 2);  // tie with 3 broken by the lower id
  EXPECT_EQ(s.top[1].first, 3);
  EXPECT_EQ(s.top[2].first, 5);
  EXPECT_FLOAT_EQ(s.top[2].second, lp[5]);
  auto probs = probs_of(base);
  EXPECT_NEAR(std::exp(s.top[0].second), probs[2], 1e-6);
}

// top_logprobs keeps the k best in one pass; on a vocabulary with many ties and random values it
// equals a full sort by (logprob, then lower id), for every k up to past the vocabulary.
TEST(Sampler, TopLogprobsEqualAFullSort) {
  std::vector<float> lp(3000);
  for (size_t i = 0; i < lp.size(); ++i) lp[i] = -static_cast<float>((i * 7919) % 97) / 8.0f;
  std::vector<int32_t> ids(lp.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(),
            [&](int32_t a, int32_t b) { return lp[a] > lp[b] || (lp[a] == lp[b] && a < b); });
  for (int k : {0, 1, 5, 64, 2999, 3000, 5000}) {
    const auto top = top_logprobs(lp, k);
    ASSERT_EQ(top.size(), std::min<size_t>(k, lp.size())) << "k " << k;
    for (size_t i = 0; i < top.size(); ++i) {
      EXPECT_EQ(top[i].first, ids[i]) << "k " << k << " rank " << i;
      EXPECT_EQ(top[i].second, lp[ids[i]]) << "k " << k << " rank " << i;
    }
  }
  EXPECT_TRUE(top_logprobs(lp, -1).empty());
}

// token_logprob scores a given token (prompt logprobs) exactly as sample_token scores the one it
// draws: the raw logits' log-softmax and the same top tokens.
TEST(Sampler, TokenLogprobScoresAGivenTokenLikeASampledOne) {
  const std::vector<float> base{0.3f, -1.0f, 2.5f, 2.5f, 0.0f, 1.0f};
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.num_logprobs = 4;
  std::vector<float> l = base;
  const SampledToken s = sample_token(l, greedy, {}, {}, 0);
  std::vector<float> scratch;
  const TokenLogprob t = token_logprob(base, s.token, 4, scratch);
  EXPECT_EQ(t.token, s.token);
  EXPECT_EQ(t.logprob, s.logprob);
  EXPECT_EQ(t.top, s.top);
  const TokenLogprob other = token_logprob(base, 4, 0, scratch);
  EXPECT_EQ(other.logprob, scratch[4]);
  EXPECT_TRUE(other.top.empty());
  EXPECT_THROW(token_logprob(base, 6, 1, scratch), Error);
}

TEST(Sampler, RejectsInvalidParameters) {
  std::vector<float> l{1, 2};
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_THROW(sample_token(l, p, {}, {}, 0), Error);
  p = {};
  p.temperature = -1.0f;
  EXPECT_THROW(sample_token(l, p, {}, {}, 0), Error);
  p = {};
  std::vector<int32_t> bad{7};
  p.presence_penalty = 1.0f;
  EXPECT_THROW(sample_token(l, p, {}, bad, 0), Error);
}

}  // namespace
}  // namespace relay

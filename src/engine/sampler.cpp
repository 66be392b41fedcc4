// See sampler.h.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "core/error.h"
#include "grammar/grammar.h"

namespace relay {

namespace {

constexpr float kMasked = -std::numeric_limits<float>::infinity();

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// softmax(logits) into probs, in double for stable sums over large vocabularies.
void softmax(std::span<const float> logits, std::vector<double>& probs) {
  float max_logit = *std::max_element(logits.begin(), logits.end());
  probs.resize(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    probs[i] = logits[i] == kMasked ? 0.0 : std::exp(static_cast<double>(logits[i]) - max_logit);
    sum += probs[i];
  }
  for (double& p : probs) p /= sum;
}

}  // namespace

double sample_uniform(uint64_t seed, uint64_t index) {
  uint64_t bits = splitmix64(splitmix64(seed) ^ index);
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

void log_softmax(std::span<const float> logits, std::span<float> out) {
  float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max_logit);
  double log_sum = max_logit + std::log(sum);
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<float>(logits[i] - log_sum);
}

std::vector<std::pair<int32_t, float>> top_logprobs(std::span<const float> logprobs, int k) {
  const size_t n = std::min(static_cast<size_t>(std::max(k, 0)), logprobs.size());
  std::vector<std::pair<int32_t, float>> top;
  if (n == 0) return top;
  // NOTE: one pass with a heap of the n best so far (its front the worst of them): prompt logprobs
  // run this on every row of a prompt, where sorting ids over a 150k vocabulary per row would cost
  // more than the row's forward pass. Ids arrive in increasing order, so on equal logprobs the
  // earlier (lower) id is kept, the same total order as a full sort.
  const auto better = [](const std::pair<int32_t, float>& a, const std::pair<int32_t, float>& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  };
  top.reserve(n);
  for (size_t i = 0; i < logprobs.size(); ++i) {
    const std::pair<int32_t, float> candidate{static_cast<int32_t>(i), logprobs[i]};
    if (top.size() < n) {
      top.push_back(candidate);
      std::push_heap(top.begin(), top.end(), better);
    } else if (better(candidate, top.front())) {
      std::pop_heap(top.begin(), top.end(), better);
      top.back() = candidate;
      std::push_heap(top.begin(), top.end(), better);
    }
  }
  std::sort_heap(top.begin(), top.end(), better);
  return top;
}

int32_t rank_of(std::span<const float> logprobs, int32_t token) {
  const float value = logprobs[static_cast<size_t>(token)];
  return 1 + static_cast<int32_t>(
                 std::count_if(logprobs.begin(), logprobs.end(), [&](float x) { return x > value; }));
}

TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int num_top,
                           std::vector<float>& scratch) {
  RELAY_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size(), "logprob of token ", token,
              " outside the vocabulary [0, ", logits.size(), ")");
  scratch.resize(logits.size());
  log_softmax(logits, scratch);
  return {token, scratch[token], top_logprobs(scratch, num_top), rank_of(scratch, token)};
}

void apply_penalties(std::span<float> logits, std::span<const int32_t> prompt_tokens,
                     std::span<const int32_t> output_tokens, const SamplingParams& p) {
  const auto vocab = static_cast<int32_t>(logits.size());
  auto check = [&](int32_t t) { RELAY_CHECK(t >= 0 && t < vocab, "penalty token ", t, " out of [0, ", vocab, ")"); };
  if (p.repetition_penalty != 1.0f) {
    RELAY_CHECK(p.repetition_penalty > 0.0f, "repetition_penalty must be > 0, got ", p.repetition_penalty);
    std::vector<bool> seen(logits.size(), false);
    for (int32_t t : prompt_tokens) check(t), seen[t] = true;
    for (int32_t t : output_tokens) check(t), seen[t] = true;
    for (size_t i = 0; i < logits.size(); ++i) {
      if (!seen[i]) continue;
      logits[i] = logits[i] > 0 ? logits[i] / p.repetition_penalty : logits[i] * p.repetition_penalty;
    }
  }
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;
    for (int32_t t : output_tokens) check(t), ++counts[t];
    for (auto [t, n] : counts) {
      logits[t] -= p.frequency_penalty * static_cast<float>(n) + p.presence_penalty;
    }
  }
}

void apply_min_p(std::span<float> logits, float min_p) {
  if (min_p <= 0.0f) return;
  // p_i >= min_p * p_max  <=>  logit_i >= logit_max + ln(min_p)
  float max_logit = *std::max_element(logits.begin(), logits.end());
  float threshold = max_logit + std::log(min_p);
  for (float& l : logits) {
    if (l < threshold) l = kMasked;
  }
}

void apply_top_k(std::span<float> logits, int top_k) {
  if (top_k <= 0 || static_cast<size_t>(top_k) >= logits.size()) return;
  std::vector<float> sorted(logits.begin(), logits.end());
  std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<float>());
  float kth = sorted[top_k - 1];
  for (float& l : logits) {
    if (l < kth) l = kMasked;
  }
}

void apply_top_p(std::span<float> logits, float top_p) {
  if (top_p >= 1.0f) return;
  std::vector<double> probs;
  softmax(logits, probs);
  std::vector<int32_t> order;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (probs[i] > 0.0) order.push_back(static_cast<int32_t>(i));
  }
  auto more_likely = [&](int32_t a, int32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); };
  // NOTE: sorting a 150k vocabulary per token costs milliseconds, while the nucleus is usually a few
  // hundred tokens: order only the m most likely (nth_element + sort, the same total order as a full
  // sort) and widen m until they hold top_p of the mass.
  size_t sorted = std::min<size_t>(order.size(), 256);
  for (;;) {
    std::nth_element(order.begin(), order.begin() + (sorted - 1), order.end(), more_likely);
    std::sort(order.begin(), order.begin() + sorted, more_likely);
    double mass = 0.0;
    for (size_t i = 0; i < sorted; ++i) mass += probs[order[i]];
    if (mass >= top_p || sorted == order.size()) break;
    sorted = std::min(order.size(), sorted * 4);
  }
  double cumulative = 0.0;
  size_t keep = 0;
  while (keep < sorted && (keep == 0 || cumulative < top_p)) cumulative += probs[order[keep++]];
  for (size_t i = keep; i < order.size(); ++i) logits[order[i]] = kMasked;
}

int32_t argmax(std::span<const float> logits) {
  // NOTE: std::max_element is one long compare-and-select dependency chain; over a 150k vocabulary
  // that costs more than the rest of a greedy step's sampling. Eight independent running maxima
  // first, then the first index holding the maximum (so ties still go to the lowest index).
  constexpr size_t kLanes = 8;
  float lane_max[kLanes];
  std::fill(lane_max, lane_max + kLanes, -std::numeric_limits<float>::infinity());
  size_t i = 0;
  for (; i + kLanes <= logits.size(); i += kLanes) {
    for (size_t l = 0; l < kLanes; ++l) lane_max[l] = std::max(lane_max[l], logits[i + l]);
  }
  float best = *std::max_element(lane_max, lane_max + kLanes);
  for (; i < logits.size(); ++i) best = std::max(best, logits[i]);
  for (size_t j = 0; j < logits.size(); ++j) {
    if (logits[j] == best) return static_cast<int32_t>(j);
  }
  // Only NaNs compare unequal to the maximum: fall back to the definition.
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

int32_t sample_categorical(std::span<const float> logits, double u) {
  std::vector<double> probs;
  softmax(logits, probs);
  double cumulative = 0.0;
  int32_t last_possible = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] == 0.0) continue;
    cumulative += probs[i];
    last_possible = static_cast<int32_t>(i);
    if (u < cumulative) return last_possible;
  }
  return last_possible;  // u within rounding of 1
}

void apply_token_constraints(std::span<float> logits, const TokenConstraints& c) {
  const auto vocab = static_cast<int64_t>(logits.size());
  for (const auto& [token, bias] : c.logit_bias) {
    RELAY_CHECK(token >= 0 && token < vocab, "logit_bias token ", token, " outside [0, ", vocab, ")");
    logits[static_cast<size_t>(token)] += bias;
  }
  if (c.allowed_tokens.empty()) return;
  RELAY_CHECK(c.allowed_tokens.size() == token_bitmask_words(vocab), "a token bitmask of ",
              c.allowed_tokens.size(), " words for a vocabulary of ", vocab);
  RELAY_CHECK(std::any_of(c.allowed_tokens.begin(), c.allowed_tokens.end(),
                          [](uint32_t w) { return w != 0; }),
              "the token bitmask allows no token");
  apply_token_bitmask(logits, c.allowed_tokens);
}

SampledToken sample_token(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt_tokens,
                          std::span<const int32_t> output_tokens, uint64_t sample_index,
                          const TokenConstraints& constraints) {
  RELAY_CHECK(!logits.empty(), "sampling an empty logits row");
  RELAY_CHECK(p.temperature >= 0.0f, "temperature must be >= 0, got ", p.temperature);
  RELAY_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "top_p must be in (0, 1], got ", p.top_p);
  RELAY_CHECK(p.min_p >= 0.0f && p.min_p <= 1.0f, "min_p must be in [0, 1], got ", p.min_p);
  SampledToken out;
  std::vector<float> logprobs;
  if (p.num_logprobs >= 0) {
    logprobs.resize(logits.size());
    log_softmax(logits, logprobs);
  }
  apply_penalties(logits, prompt_tokens, output_tokens, p);
  apply_token_constraints(logits, constraints);
  // NOTE: vLLM treats temperatures below 1e-5 as greedy too (dividing by them overflows).
  if (p.temperature < 1e-5f) {
    out.token = argmax(logits);
  } else {
    for (float& l : logits) l /= p.temperature;
    apply_min_p(logits, p.min_p);
    apply_top_k(logits, p.top_k);
    apply_top_p(logits, p.top_p);
    out.token = sample_categorical(logits, sample_uniform(p.seed, sample_index));
  }
  if (p.num_logprobs >= 0) {
    out.logprob = logprobs[out.token];
    out.top = top_logprobs(logprobs, p.num_logprobs);
    out.rank = rank_of(logprobs, out.token);
  }
  return out;
}

std::vector<SampledToken> verify_drafts(std::span<const int32_t> drafts, uint64_t seed,
                                        uint64_t sample_index,
                                        std::optional<double> forced_acceptance,
                                        const std::function<SampledToken(size_t)>& sample_row) {
  std::vector<SampledToken> out;
  for (size_t j = 0; j <= drafts.size(); ++j) {
    out.push_back(sample_row(j));
    if (j == drafts.size()) break;
    if (forced_acceptance) {
      // The benchmark's rule: a coin of its own per draft (apart from the row's draw, and differing
      // between sequences through the draft), whatever the target sampled.
      const uint64_t draft_hash = static_cast<uint64_t>(drafts[j]) * 0x9e3779b97f4a7c15ull;
      const uint64_t coin_seed = seed ^ 0x5ca1ab1e0ddba11ull ^ draft_hash;
      if (sample_uniform(coin_seed, sample_index + j) >= *forced_acceptance) break;
      if (out.back().token != drafts[j]) {
        out.back() = SampledToken{};
        out.back().token = drafts[j];
      }
    } else if (out.back().token != drafts[j]) {
      break;
    }
  }
  return out;
}

std::vector<SampledToken> sample_with_drafts(
    std::span<float> logits, std::span<const int32_t> drafts, const SamplingParams& p,
    std::span<const int32_t> prompt_tokens, std::span<const int32_t> output_tokens,
    uint64_t sample_index, const TokenConstraints& constraints,
    std::optional<double> forced_acceptance) {
  const size_t rows = drafts.size() + 1;
  RELAY_CHECK(!logits.empty() && logits.size() % rows == 0, "sampling ", rows, " rows (",
              drafts.size(), " drafts) from ", logits.size(), " logits");
  RELAY_CHECK(constraints.allowed_tokens.size() % rows == 0, "a token bitmask of ",
              constraints.allowed_tokens.size(), " words for ", rows, " rows");
  const size_t vocab = logits.size() / rows;
  const size_t words = constraints.allowed_tokens.size() / rows;
  // Row j's penalties count drafts[0, j) as output, as they would be once accepted.
  std::vector<int32_t> history;
  if (!drafts.empty()) history.assign(output_tokens.begin(), output_tokens.end());
  return verify_drafts(drafts, p.seed, sample_index, forced_acceptance, [&](size_t j) {
    if (j > 0) history.push_back(drafts[j - 1]);
    const TokenConstraints row{constraints.allowed_tokens.subspan(j * words, words),
                               constraints.logit_bias};
    return sample_token(logits.subspan(j * vocab, vocab), p, prompt_tokens,
                        drafts.empty() ? output_tokens : std::span<const int32_t>(history),
                        sample_index + j, row);
  });
}

}  // namespace relay

// See speculative.h.
#include "speculative/speculative.h"

#include <algorithm>

#include "core/error.h"
#include "core/json.h"

namespace relay {

SpeculativeConfig SpeculativeConfig::parse(std::string_view json_text) {
  const nlohmann::json j = parse_json(json_text, "--speculative-config");
  RELAY_CHECK(j.is_object(), "--speculative-config must be a JSON object, e.g. "
              R"({"method": "ngram", "num_speculative_tokens": 3})");
  SpeculativeConfig c;
  auto integer = [&](const char* name, int lo, int hi, int fallback) {
    const auto it = j.find(name);
    if (it == j.end() || it->is_null()) return fallback;
    RELAY_CHECK(it->is_number_integer(), "--speculative-config: '", name, "' must be an integer");
    const int64_t v = it->get<int64_t>();
    RELAY_CHECK(v >= lo && v <= hi, "--speculative-config: '", name, "' must be between ", lo,
                " and ", hi, ", got ", v);
    return static_cast<int>(v);
  };
  const auto method = j.find("method");
  RELAY_CHECK(method != j.end() && method->is_string(),
              "--speculative-config: 'method' is required (\"ngram\" or \"mtp\")");
  const std::string name = method->get<std::string>();
  if (name == "ngram") {
    c.method = Method::kNgram;
  } else if (name == "mtp") {
    c.method = Method::kMtp;
  } else {
    fail(str("--speculative-config: unknown method '", name, "' (Relay has \"ngram\" and \"mtp\")"));
  }
  RELAY_CHECK(j.contains("num_speculative_tokens"),
              "--speculative-config: 'num_speculative_tokens' is required");
  c.num_speculative_tokens = integer("num_speculative_tokens", 1, kMaxSpeculativeTokens, 0);
  c.prompt_lookup_max = integer("prompt_lookup_max", 1, 64, c.prompt_lookup_max);
  c.prompt_lookup_min = integer("prompt_lookup_min", 1, 64, std::min(c.prompt_lookup_min,
                                                                     c.prompt_lookup_max));
  RELAY_CHECK(c.prompt_lookup_min <= c.prompt_lookup_max, "--speculative-config: ",
              "'prompt_lookup_min' (", c.prompt_lookup_min, ") exceeds 'prompt_lookup_max' (",
              c.prompt_lookup_max, ")");
  c.disable_by_batch_size = integer("disable_by_batch_size", 2, 1 << 20, 0);
  if (const auto r = j.find("min_draft_acceptance"); r != j.end() && !r->is_null()) {
    RELAY_CHECK(r->is_number() && r->get<double>() > 0.0 && r->get<double>() < 1.0,
                "--speculative-config: 'min_draft_acceptance' must be a number between 0 and 1 "
                "(exclusive), got ", r->dump());
    c.min_draft_acceptance = r->get<double>();
  }
  if (const auto m = j.find("model"); m != j.end() && !m->is_null()) {
    RELAY_CHECK(m->is_string(), "--speculative-config: 'model' must be a directory");
    c.model = m->get<std::string>();
  }
  for (const auto& [key, value] : j.items()) {
    static const char* const kKnown[] = {"method", "num_speculative_tokens", "prompt_lookup_max",
                                         "prompt_lookup_min", "model", "disable_by_batch_size",
                                         "min_draft_acceptance"};
    RELAY_CHECK(std::find(std::begin(kKnown), std::end(kKnown), key) != std::end(kKnown),
                "--speculative-config: unknown field '", key, "'");
    RELAY_CHECK(c.method == Method::kNgram || (key != "prompt_lookup_max" && key != "prompt_lookup_min"),
                "--speculative-config: '", key, "' is an ngram option");
    RELAY_CHECK(c.method == Method::kMtp || key != "model",
                "--speculative-config: 'model' is an mtp option");
  }
  return c;
}

std::string SpeculativeConfig::describe() const {
  const std::string limits =
      (disable_by_batch_size > 0 ? str(", off above ", disable_by_batch_size, " running") : "") +
      (min_draft_acceptance > 0 ? str(", drafts landing >= ", min_draft_acceptance) : "");
  switch (method) {
    case Method::kNone:
      return "off";
    case Method::kNgram:
      return str("ngram k=", num_speculative_tokens, " lookup ", prompt_lookup_min, "..",
                 prompt_lookup_max, limits);
    case Method::kMtp:
      return str("mtp k=", num_speculative_tokens, model.empty() ? "" : str(" head ", model),
                 limits);
  }
  return "";
}

double SpecDecodeStats::acceptance_rate() const {
  return num_draft_tokens == 0 ? 0.0
                               : static_cast<double>(num_accepted_tokens) / num_draft_tokens;
}

double SpecDecodeStats::mean_acceptance_length() const {
  return num_drafts == 0 ? 0.0 : 1.0 + static_cast<double>(num_accepted_tokens) / num_drafts;
}

SpecDecodeStats SpecDecodeStats::since(const SpecDecodeStats& earlier) const {
  SpecDecodeStats d;
  d.num_drafts = num_drafts - earlier.num_drafts;
  d.num_draft_tokens = num_draft_tokens - earlier.num_draft_tokens;
  d.num_accepted_tokens = num_accepted_tokens - earlier.num_accepted_tokens;
  d.num_accepted_tokens_per_pos = num_accepted_tokens_per_pos;
  const size_t n =
      std::min(earlier.num_accepted_tokens_per_pos.size(), d.num_accepted_tokens_per_pos.size());
  for (size_t i = 0; i < n; ++i)
    d.num_accepted_tokens_per_pos[i] -= earlier.num_accepted_tokens_per_pos[i];
  return d;
}

DraftLength::DraftLength(int max_drafts, double min_acceptance)
    : max_drafts_(max_drafts), min_acceptance_(min_acceptance) {
  RELAY_CHECK(max_drafts >= 1 && min_acceptance > 0.0 && min_acceptance < 1.0,
              "DraftLength: ", max_drafts, " drafts at acceptance ", min_acceptance);
}

int DraftLength::landing() const {
  const double a = acceptance();
  int n = 0;
  for (double land = a; n < max_drafts_ && land >= min_acceptance_; land *= a) ++n;
  return n;
}

int DraftLength::next() {
  if (const int n = landing(); n > 0) {
    steps_off_ = 0;
    return n;
  }
  return ++steps_off_ > backoff_ ? 1 : 0;  // a probe after the back-off
}

void DraftLength::observe(int num_drafts, int num_accepted) {
  RELAY_CHECK(num_accepted >= 0 && num_accepted <= num_drafts, "DraftLength: ", num_accepted,
              " of ", num_drafts, " drafts accepted");
  if (num_drafts == 0) return;
  const bool off = landing() == 0;
  accepted_ = kDecay * accepted_ + num_accepted;
  tries_ = kDecay * tries_ + num_accepted + (num_accepted < num_drafts ? 1 : 0);
  if (!off) {
    backoff_ = kFirstBackoff;
  } else {  // a probe
    steps_off_ = 0;
    backoff_ = num_accepted == 0 ? std::min(2 * backoff_, kMaxBackoff) : kFirstBackoff;
  }
}

std::vector<int32_t> propose_ngram(std::span<const int32_t> tokens, int min_n, int max_n, int k) {
  const auto len = static_cast<int64_t>(tokens.size());
  const int64_t longest = std::min<int64_t>(max_n, len - 1);
  if (longest < min_n || k <= 0) return {};
  // One pass over the earlier positions, latest first: the length of the suffix each one ends
  // (capped at max_n), keeping the first position that ends a longer one. That is the longest
  // suffix's latest earlier occurrence (the freshest context is the likeliest to be copied
  // again), found in one sweep rather than one per suffix length: a long context that drafts
  // nothing costs one comparison per token, not max_n - min_n + 1.
  int64_t best_n = 0, best_end = -1;
  for (int64_t end = len - 2; end >= 0 && best_n < longest; --end) {
    int64_t n = 0;
    while (n < longest && n <= end && tokens[static_cast<size_t>(end - n)] ==
                                          tokens[static_cast<size_t>(len - 1 - n)]) {
      ++n;
    }
    if (n > best_n) {
      best_n = n;
      best_end = end;
    }
  }
  if (best_n < min_n) return {};
  // Past the end of the context the copy goes on from its own start, as an LZ77 decoder copies an
  // overlapping match: the match says the text repeats with period len - from, so a loop shorter
  // than k (a repeated line, a run of one token) still fills the draft. vLLM stops at the end (a
  // period-2 loop drafts 2 of K = 3); verification keeps either lossless, and a draft past a
  // loop's end is rejected as one inside it would be.
  const int64_t from = best_end + 1, period = len - from;
  std::vector<int32_t> draft(static_cast<size_t>(k));
  for (size_t i = 0; i < draft.size(); ++i) {
    draft[i] = tokens[static_cast<size_t>(from + static_cast<int64_t>(i) % period)];
  }
  return draft;
}

}  // namespace relay

// See step_check.h.
#include "engine/step_check.h"

#include <algorithm>

#include "core/error.h"
#include "grammar/grammar.h"

namespace relay {

void check_step_sequence(const StepSequence& s, const StepLimits& limits) {
  RELAY_CHECK(!s.tokens.empty(), "sequence ", s.seq_id, " has no tokens in this step");
  RELAY_CHECK(s.num_computed >= 0, "sequence ", s.seq_id, " has num_computed ", s.num_computed);
  const int64_t context = s.num_computed + static_cast<int64_t>(s.tokens.size());
  RELAY_CHECK(static_cast<int64_t>(s.block_table.size()) * limits.block_size >= context,
              "sequence ", s.seq_id, " needs ", context, " KV slots but its block table has ",
              s.block_table.size(), " blocks of ", limits.block_size);
  RELAY_CHECK(!s.sample || s.sampling != nullptr, "sequence ", s.seq_id,
              " samples but has no SamplingParams");
  RELAY_CHECK(s.num_draft_tokens == 0 ||
                  (s.sample && s.num_draft_tokens > 0 &&
                   static_cast<size_t>(s.num_draft_tokens) < s.tokens.size() &&
                   s.num_draft_tokens <= limits.max_draft_tokens),
              "sequence ", s.seq_id, " has ", s.num_draft_tokens, " drafts among ",
              s.tokens.size(), " tokens (sample ", s.sample,
              "): drafts need a sampling sequence and a token before them, and ", limits.backend,
              " verifies at most ", limits.max_draft_tokens);
  RELAY_CHECK(s.num_prompt_logprobs >= -1 && s.num_prompt_logprobs <= limits.max_prompt_logprobs &&
                  (s.num_prompt_logprobs < 0 || s.prompt_logprobs != nullptr),
              "sequence ", s.seq_id, " asks for ", s.num_prompt_logprobs, " prompt logprobs; ",
              limits.backend, " gives -1 (none) to ", limits.max_prompt_logprobs,
              ", into a prompt_logprobs output");
  const size_t words = token_bitmask_words(limits.vocab_size);
  const size_t rows = 1 + static_cast<size_t>(s.num_draft_tokens);
  RELAY_CHECK(s.allowed_tokens.empty() || s.allowed_tokens.size() == words * rows, "sequence ",
              s.seq_id, " has a token bitmask of ", s.allowed_tokens.size(), " words; ", rows,
              " sampled rows over a vocabulary of ", limits.vocab_size, " take ", words * rows);
  for (size_t at = 0; at < s.allowed_tokens.size(); at += words) {
    const auto mask = s.allowed_tokens.subspan(at, words);
    RELAY_CHECK(std::any_of(mask.begin(), mask.end(), [](uint32_t w) { return w != 0; }),
                "sequence ", s.seq_id, ": the token bitmask of row ", at / words,
                " allows no token");
  }
  for (const auto& [token, bias] : s.logit_bias) {
    RELAY_CHECK(token >= 0 && token < limits.vocab_size, "sequence ", s.seq_id,
                ": logit_bias token ", token, " outside [0, ", limits.vocab_size, ")");
  }
}

}  // namespace relay

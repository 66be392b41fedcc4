// See mtp_plan.h.
#include "engine/mtp_plan.h"

#include "core/error.h"

namespace relay {

std::vector<MtpCatchUp> plan_mtp_catch_up(std::span<const StepSequence> batch,
                                          std::span<const SampledToken> sampled) {
  std::vector<MtpCatchUp> out(batch.size());
  size_t k = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSequence& s = batch[i];
    const int t = static_cast<int>(s.tokens.size());
    if (s.sample) {
      size_t n = 0;
      while (k + n < sampled.size() && sampled[k + n].seq_id == s.seq_id) ++n;
      RELAY_CHECK(n >= 1, "MTP drafting: sequence ", s.seq_id, " sampled nothing");
      // Its rows up to the last accepted draft's; after that comes the token sampled last.
      out[i] = {t - s.num_draft_tokens + static_cast<int>(n) - 1, sampled[k + n - 1].token};
      k += n;
      continue;
    }
    // A prompt chunk: the token after its last row is the sequence's next one (the prompt's, or an
    // output's in a recompute). A prompt-only sequence at the end of its prompt has none: its last
    // row gets no MTP row, and the row before it pairs with its last token.
    const size_t next = static_cast<size_t>(s.num_computed) + static_cast<size_t>(t);
    if (next < s.prompt_tokens.size()) {
      out[i] = {t, s.prompt_tokens[next]};
    } else if (next - s.prompt_tokens.size() < s.output_tokens.size()) {
      out[i] = {t, s.output_tokens[next - s.prompt_tokens.size()]};
    } else {
      out[i] = {t - 1, s.tokens[static_cast<size_t>(t) - 1]};
    }
  }
  return out;
}

}  // namespace relay

// See after_step.h.
#include "engine/after_step.h"

#include <algorithm>

#include "core/error.h"

namespace relay {

std::vector<std::span<const SampledToken>> tokens_per_sequence(
    std::span<const StepSequence> batch, std::span<const SampledToken> sampled) {
  std::vector<std::span<const SampledToken>> out(batch.size());
  size_t next = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!batch[i].sample) continue;
    size_t n = 0;
    while (next + n < sampled.size() && sampled[next + n].seq_id == batch[i].seq_id) ++n;
    out[i] = sampled.subspan(next, n);
    next += n;
  }
  return out;
}

std::vector<StateCopy> draft_state_copies(const StepSequence& s, size_t accepted, bool padded) {
  const size_t k = static_cast<size_t>(s.num_draft_tokens);
  RELAY_CHECK(accepted <= k, "sequence ", s.seq_id, ": ", accepted, " of its ", k,
              " drafts accepted");
  // Where the state after row j is now.
  auto after_row = [&](size_t j) { return static_cast<int32_t>(j < k || padded ? 1 + j : 0); };
  std::vector<StateCopy> copies;
  for (const SnapshotSave& save : s.save_state_snapshots) {
    if (static_cast<size_t>(save.row) <= accepted)
      copies.push_back({after_row(static_cast<size_t>(save.row)), -1, save.snapshot});
  }
  if (accepted < k || padded) copies.push_back({after_row(accepted), 0, -1});
  return copies;
}

std::vector<MtpCatchUp> plan_mtp_catch_up(std::span<const StepSequence> batch,
                                          std::span<const SampledToken> sampled, int max_drafts,
                                          int block_size) {
  const std::vector<std::span<const SampledToken>> runs = tokens_per_sequence(batch, sampled);
  std::vector<MtpCatchUp> out(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSequence& s = batch[i];
    const int t = static_cast<int>(s.tokens.size());
    out[i].first_position = s.num_computed;
    if (s.sample) {
      const size_t n = runs[i].size();
      if (n == 0) continue;  // sampled on another node, which drafts for it
      // Its rows up to the last accepted draft's; after that comes the token sampled last.
      out[i].rows = t - s.num_draft_tokens + static_cast<int>(n) - 1;
      out[i].next_token = runs[i].back().token;
      if (s.proposed_drafts == nullptr) continue;
      // Chain row k writes its K/V at chain_position(k): the chain stops where the table ends.
      const int64_t room = static_cast<int64_t>(s.block_table.size()) * block_size;
      const int cap = std::min(max_drafts, s.max_proposed_drafts);
      int& drafts = out[i].drafts;
      drafts = cap > 0 ? 1 : 0;
      while (drafts < cap && out[i].chain_position(drafts) < room) ++drafts;
      continue;
    }
    // A prompt chunk: the token after its last row is the sequence's next one (the prompt's, or an
    // output's in a recompute). A prompt-only sequence at the end of its prompt has none: its last
    // row gets no MTP row, and the row before it pairs with its last token.
    const size_t next = static_cast<size_t>(s.num_computed) + static_cast<size_t>(t);
    if (next < s.prompt_tokens.size()) {
      out[i].rows = t, out[i].next_token = s.prompt_tokens[next];
    } else if (next - s.prompt_tokens.size() < s.output_tokens.size()) {
      out[i].rows = t, out[i].next_token = s.output_tokens[next - s.prompt_tokens.size()];
    } else {
      out[i].rows = t - 1, out[i].next_token = s.tokens[static_cast<size_t>(t) - 1];
    }
  }
  return out;
}

}  // namespace relay

// Applying a grammar's token bitmask to a row of fp32 logits (the sampler's CPU path, grammar.h).
//
// A constrained step usually allows few tokens (a JSON key, a digit) or nearly all (inside a
// string), so the loop works a 32-token word at a time: an all-ones word is skipped, an all-zeros
// word is filled, and only mixed words are walked bit by bit.
#include <algorithm>
#include <bit>
#include <limits>

#include "core/error.h"
#include "grammar/grammar.h"

namespace relay {

void apply_token_bitmask(std::span<float> logits, std::span<const uint32_t> bitmask) {
  RELAY_CHECK(bitmask.size() == token_bitmask_words(static_cast<int64_t>(logits.size())),
              "token bitmask: ", bitmask.size(), " words for ", logits.size(),
              " logits, which need ", token_bitmask_words(static_cast<int64_t>(logits.size())));
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  for (size_t word = 0; word < bitmask.size(); ++word) {
    const uint32_t bits = bitmask[word];
    if (bits == ~uint32_t{0}) continue;
    const size_t begin = word * 32;
    const size_t end = std::min(begin + 32, logits.size());
    if (bits == 0) {
      std::fill(logits.begin() + begin, logits.begin() + end, kMasked);
      continue;
    }
    for (uint32_t cleared = ~bits; cleared != 0; cleared &= cleared - 1) {
      const size_t i = begin + static_cast<size_t>(std::countr_zero(cleared));
      if (i < end) logits[i] = kMasked;
    }
  }
}

}  // namespace relay

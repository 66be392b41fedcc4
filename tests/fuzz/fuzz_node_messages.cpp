// libFuzzer target for the messages between the nodes of a multi-node worker (engine/node_group.h),
// the bytes a follower reads off its socket. The first byte picks the decoder (a step or a result);
// decoding must either succeed or throw relay::Error. A decoded result must re-encode to the same
// bytes, and a decoded step's spans must point inside the storage the step owns, its
// num_prompt_logprobs be -1 or more, its prompt_logprobs output unset (a follower answers in its
// NodeResult), and its drafts only on a sampling sequence, fewer than its tokens, with a bitmask
// that splits into one per sampled row; only a sampling sequence asks for MTP drafts, written into
// the step's own storage.
//
// The corpus (tests/fuzz/corpus_node_messages) holds the first byte, then what encode_step and
// encode_result write for the batch and results of tests/unit/engine/test_node_group.cpp's round
// trips (a step with drafts and per-row bitmasks, a shutdown, a result with a sequence's accepted
// draft and one with an error); regenerate it when the wire version changes.
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "core/error.h"
#include "engine/node_group.h"

namespace {

template <typename T>
bool inside(std::span<const T> s, const std::vector<T>& owner) {
  return s.empty() || (s.data() >= owner.data() && s.data() + s.size() <= owner.data() + owner.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size == 0) return 0;
  const std::span<const uint8_t> message(bytes + 1, size - 1);
  try {
    if (bytes[0] & 1) {
      const relay::NodeResult r = relay::decode_result(message);
      const std::vector<uint8_t> again = relay::encode_result(r);
      if (again.size() != message.size() || !std::equal(again.begin(), again.end(), message.begin()))
        std::abort();
    } else {
      const relay::NodeStep step = relay::decode_step(message);
      for (size_t i = 0; i < step.batch.size(); ++i) {
        const relay::StepSequence& s = step.batch[i];
        if (!inside(s.tokens, step.tokens[i]) || !inside(s.block_table, step.block_tables[i]) ||
            !inside(s.prompt_tokens, step.prompt_tokens[i]) ||
            !inside(s.output_tokens, step.output_tokens[i]) ||
            !inside(s.allowed_tokens, step.allowed_tokens[i]) ||
            !inside(s.logit_bias, step.logit_bias[i]) ||
            (s.sample && s.sampling != &step.sampling[i]) || (!s.sample && s.sampling != nullptr) ||
            s.num_prompt_logprobs < -1 || s.prompt_logprobs != nullptr ||
            (s.proposed_drafts != nullptr &&
             (!s.sample || s.proposed_drafts != &step.proposed_drafts[i])))
          std::abort();
        const auto rows = static_cast<size_t>(s.num_draft_tokens) + 1;
        if (s.num_draft_tokens < 0 ||
            (s.num_draft_tokens > 0 && (!s.sample || rows > s.tokens.size())) ||
            s.allowed_tokens.size() % rows != 0)
          std::abort();
      }
      (void)relay::encode_step(step.command, step.batch);
    }
  } catch (const relay::Error&) {
    // a damaged message is the expected outcome for most inputs
  }
  return 0;
}

// Test doubles for Backend: FakeBackend, whose "model" really reads its paged KV cache, and
// ScriptedBackend, which samples a fixed script (so the text a test expects is known). Both verify
// drafts as backend.h asks: each sampled row's token is what a step without drafts would sample
// there, and drafts are accepted while they equal it.
//
// The cache stores, per slot, the token id written there. Computing a token writes it into the slot
// its block table names; sampling hashes the whole context *read back from the cache* through the
// block table. So a wrong block table, a prefix hit that points at other content, a block reused
// while still in use, a position read before it was written, or a rejected draft's slot read as if
// it held a committed token changes the output (or fails a check): equal outputs between a
// constrained and an unconstrained run prove the KV bookkeeping.
//
// With state slots (a stand-in for a hybrid model's recurrent layers) each sequence also folds
// every token it computes into the state in its first slot, from a fresh state when it starts at
// position 0, and keeps the state after its last committed token (the accepted drafts' row, the
// others going to its scratch slots). Every sampled row checks that state against the fold of the
// context read back from the cache, so a slot shared, not reset for a recompute, or left holding a
// rejected draft fails the test. With state snapshots (prefix caching of a hybrid model) a
// restore copies a snapshot over the sequence's state before its chunk and a save keeps the state
// after a row, so a hit restoring a snapshot of another prefix fails the same check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/backend.h"

namespace relay::testing {

class FakeBackend : public Backend {
 public:
  static constexpr int32_t kVocab = 1000;

  FakeBackend(int num_blocks, int block_size, int num_state_slots = 0, int num_snapshots = 0)
      : num_blocks_(num_blocks),
        block_size_(block_size),
        slots_(static_cast<size_t>(num_blocks) * block_size, -1),
        states_(static_cast<size_t>(num_state_slots), 0),
        snapshots_(static_cast<size_t>(num_snapshots), 0) {
    config_.vocab_size = kVocab;
    config_.max_position_embeddings = 1 << 20;
    config_.eos_token_ids = {kEos};
  }
  static constexpr int32_t kEos = 999;

  const ModelConfig& config() const override { return config_; }
  int block_size() const override { return block_size_; }
  int num_kv_blocks() const override { return num_blocks_; }
  int num_state_slots() const override { return static_cast<int>(states_.size()); }
  int num_state_snapshots() const override { return static_cast<int>(snapshots_.size()); }

  bool supports_draft_tokens() const override { return true; }

  std::vector<SampledToken> step(std::span<const StepSequence> batch) override {
    std::vector<SampledToken> out;
    StepRecord rec;
    for (const StepSequence& s : batch) {
      rec.tokens_per_seq.push_back(static_cast<int>(s.tokens.size()));
      rec.drafts_per_seq.push_back(s.num_draft_tokens);
      for (size_t i = 0; i < s.tokens.size(); ++i) {
        slot(s, s.num_computed + static_cast<int>(i)) = s.tokens[i];
      }
      // Row j follows draft j - 1: its context ends there.
      const int first_row = static_cast<int>(s.tokens.size()) - 1 - s.num_draft_tokens;
      // The recurrent state after each row (after the chunk's last token when it does not sample).
      std::vector<uint64_t> row_states, all_states;  // after each verify row / each row
      if (!states_.empty()) {
        EXPECT_GE(s.state_slots.size(), static_cast<size_t>(1 + s.num_draft_tokens))
            << "sequence " << s.seq_id << " has no scratch slot for each draft";
        if (s.restore_state_snapshot >= 0) {
          EXPECT_GT(s.num_computed, 0) << "sequence " << s.seq_id << " restores from position 0";
          state_slot(s, 0) = snapshots_.at(static_cast<size_t>(s.restore_state_snapshot));
          ++num_restores;
        }
        uint64_t state = s.num_computed == 0 ? kFreshState : state_slot(s, 0);
        for (size_t i = 0; i < s.tokens.size(); ++i) {
          state = fold(state, s.tokens[i]);
          all_states.push_back(state);
          if (static_cast<int>(i) >= first_row) row_states.push_back(state);
        }
      }
      size_t num_rows = 1;  // the last token's row and one per accepted draft
      if (s.sample) {
        for (int j = 0; j <= s.num_draft_tokens; ++j) {
          const uint64_t* state = row_states.empty() ? nullptr : &row_states[j];
          out.push_back(sample(s, s.num_computed + first_row + j + 1, s.sample_index + j, state));
          if (j == s.num_draft_tokens || out.back().token != s.tokens[first_row + j + 1]) break;
          ++num_rows;
        }
      }
      // A save keeps the state after its row; with drafts only at rows the step committed (the
      // last token's and the accepted drafts'), as backend.h says: a save at a rejected row stays
      // unwritten, so a scheduler that committed it would restore a stale state.
      const int committed_rows = first_row + static_cast<int>(num_rows);
      for (const SnapshotSave& save : s.save_state_snapshots) {
        if (all_states.empty() || (s.num_draft_tokens > 0 && save.row >= committed_rows)) continue;
        snapshots_.at(static_cast<size_t>(save.snapshot)) = all_states.at(static_cast<size_t>(save.row));
      }
      if (!row_states.empty()) {
        for (size_t j = 1; j < row_states.size(); ++j) state_slot(s, j) = row_states[j];
        // The state after the last committed token (the token sampled after it is computed next
        // step).
        state_slot(s, 0) = row_states[num_rows - 1];
      }
    }
    steps.push_back(rec);
    return out;
  }

  struct StepRecord {
    std::vector<int> tokens_per_seq;
    std::vector<int> drafts_per_seq;
  };
  std::vector<StepRecord> steps;
  int num_restores = 0;  // state snapshots restored

 private:
  // The token after the first `context` positions: a hash of them read back from the cache.
  // With state slots, `state` is the sequence's recurrent state after position context - 1.
  SampledToken sample(const StepSequence& s, int context, uint64_t sample_index,
                      const uint64_t* state) {
    uint64_t h = kFreshState;
    for (int pos = 0; pos < context; ++pos) {
      const int32_t t = slot(s, pos);
      EXPECT_GE(t, 0) << "sequence " << s.seq_id << " reads unwritten position " << pos;
      h = fold(h, t);
    }
    if (state != nullptr) {
      EXPECT_EQ(*state, h) << "sequence " << s.seq_id << ": its recurrent state after " << context
                           << " tokens is not that of its context";
    }
    if (s.sampling->temperature > 0) {
      h = (h ^ s.sampling->seed) * 1099511628211ull;
      h = (h ^ sample_index) * 1099511628211ull;
    }
    SampledToken tok;
    tok.seq_id = s.seq_id;
    tok.token = static_cast<int32_t>((h >> 17) % kVocab);
    tok.logprob = -static_cast<float>(tok.token % 7) / 8.0f;
    for (int k = 0; k < s.sampling->num_logprobs; ++k) {
      tok.top.emplace_back((tok.token + k) % kVocab, tok.logprob - static_cast<float>(k));
    }
    return tok;
  }

  static constexpr uint64_t kFreshState = 1469598103934665603ull;
  static uint64_t fold(uint64_t state, int32_t token) {
    return (state ^ static_cast<uint64_t>(token + 1)) * 1099511628211ull;
  }

  uint64_t& state_slot(const StepSequence& s, size_t i) {
    EXPECT_LT(i, s.state_slots.size()) << "sequence " << s.seq_id;
    const int32_t slot = i < s.state_slots.size() ? s.state_slots[i] : 0;
    EXPECT_TRUE(slot >= 0 && static_cast<size_t>(slot) < states_.size())
        << "sequence " << s.seq_id << " names state slot " << slot;
    return states_[static_cast<size_t>(std::clamp<int32_t>(slot, 0,
                                                            static_cast<int32_t>(states_.size()) - 1))];
  }

  int32_t& slot(const StepSequence& s, int pos) {
    const size_t block = static_cast<size_t>(pos / block_size_);
    EXPECT_LT(block, s.block_table.size())
        << "sequence " << s.seq_id << " position " << pos << " is past its block table";
    const int32_t b = block < s.block_table.size() ? s.block_table[block] : 0;
    return slots_[static_cast<size_t>(b) * block_size_ + pos % block_size_];
  }

  ModelConfig config_;
  int num_blocks_;
  int block_size_;
  std::vector<int32_t> slots_;
  std::vector<uint64_t> states_;     // per state slot
  std::vector<uint64_t> snapshots_;  // per state snapshot
};

// Samples script[sample_index] for every sequence (then repeats the last id); computes nothing.
// It takes token constraints: each sampled row's bitmask is recorded (empty when unconstrained),
// and a scripted token the bitmask does not allow fails the test.
class ScriptedBackend : public Backend {
 public:
  explicit ScriptedBackend(std::vector<int32_t> script, int num_blocks = 64)
      : script_(std::move(script)), num_blocks_(num_blocks) {
    config_.vocab_size = 151936;  // the Qwen3 vocabulary, so real tokenizer ids are valid
    config_.max_position_embeddings = 4096;
    config_.eos_token_ids = {151645};  // <|im_end|>
  }
  const ModelConfig& config() const override { return config_; }
  int block_size() const override { return 4; }
  int num_kv_blocks() const override { return num_blocks_; }
  bool supports_token_constraints() const override { return true; }
  bool supports_draft_tokens() const override { return true; }
  std::vector<SampledToken> step(std::span<const StepSequence> batch) override {
    std::vector<SampledToken> out;
    for (const StepSequence& s : batch) {
      if (!s.sample) continue;
      const size_t rows = 1 + static_cast<size_t>(s.num_draft_tokens);
      const size_t words = s.allowed_tokens.size() / rows;
      const auto drafts = s.tokens.last(static_cast<size_t>(s.num_draft_tokens));
      for (size_t j = 0; j < rows; ++j) {
        const uint64_t index = s.sample_index + j;
        SampledToken t;
        t.seq_id = s.seq_id;
        t.token = script_[std::min<size_t>(index, script_.size() - 1)];
        const auto mask = s.allowed_tokens.subspan(j * words, words);
        masks.emplace_back(mask.begin(), mask.end());
        biases.emplace_back(s.logit_bias.begin(), s.logit_bias.end());
        if (!mask.empty()) {
          EXPECT_TRUE(mask[t.token / 32] >> (t.token % 32) & 1)
              << "sample " << index << ": the mask forbids the scripted token " << t.token;
        }
        t.logprob = -0.5f - static_cast<float>(index);
        for (int k = 0; k < s.sampling->num_logprobs; ++k) t.top.emplace_back(k, -1.0f - k);
        out.push_back(t);
        if (j == drafts.size() || t.token != drafts[j]) break;
      }
    }
    return out;
  }

  std::vector<std::vector<uint32_t>> masks;  // per sampled row, in order
  std::vector<std::vector<std::pair<int32_t, float>>> biases;

 private:
  std::vector<int32_t> script_;
  int num_blocks_;
  ModelConfig config_;
};

}  // namespace relay::testing

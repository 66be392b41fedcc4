// A test harness for Model::forward and Model::forward_mtp without a backend: sequences in
// shuffled KV blocks (and recurrent-state slots for hybrid models), each call appending rows after
// what the sequence computed before, every row's logits returned. Used by the MTP head's oracle
// tests (test_mtp.cpp) and the trained demo hybrid's teacher-forced tests (test_demo_hybrid.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kvcache/recurrent_state.h"
#include "model/registry.h"

namespace relay::test {

// One sequence: its (shuffled) KV blocks, its state slot, and how many tokens it has computed.
struct Seq {
  std::vector<int32_t> blocks;
  int32_t slot = 0;
  int num_computed = 0;      // target
  int num_mtp_computed = 0;  // head
};

// Drives Model::forward and Model::forward_mtp over several sequences at once. Each call's rows
// are (sequence, tokens), appended after what the sequence computed before.
class Runner {
 public:
  static constexpr int kBlockSize = 4;

  // Room for `max_seqs` sequences of up to kBlockSize * blocks_per_seq tokens each.
  Runner(const std::filesystem::path& dir, const MtpSource& mtp, int max_seqs = 5,
         int blocks_per_seq = 24)
      : max_seqs_(max_seqs),
        blocks_per_seq_(blocks_per_seq),
        model_(load_model(dir, mtp)),
        kv_(model_->kv_layout(kBlockSize, blocks_per_seq * max_seqs)),
        pool_(2) {
    if (model_->config().has_linear_attention()) {
      state_ = std::make_unique<RecurrentStatePool>(model_->recurrent_state_layout(max_seqs));
    }
    free_blocks_.resize(static_cast<size_t>(blocks_per_seq) * max_seqs);
    std::iota(free_blocks_.begin(), free_blocks_.end(), 0);
    std::shuffle(free_blocks_.begin(), free_blocks_.end(), std::mt19937(7));
  }

  Seq new_seq() {
    RELAY_CHECK(num_seqs_ < max_seqs_, "the runner holds ", max_seqs_, " sequences");
    Seq s;
    s.slot = num_seqs_++;
    s.blocks.assign(free_blocks_.end() - blocks_per_seq_, free_blocks_.end());
    free_blocks_.resize(free_blocks_.size() - static_cast<size_t>(blocks_per_seq_));
    return s;
  }

  // The target forward; returns every row's logits, per sequence.
  std::vector<std::vector<float>> target(const std::vector<Seq*>& seqs,
                                         const std::vector<std::vector<int32_t>>& tokens) {
    Batch b = batch(seqs, tokens, false);
    ForwardBatch fb = b.view();
    if (state_) {
      fb.recurrent_state = state_.get();
      fb.state_slots = b.slots;
      fb.state_fresh = b.fresh;
    }
    std::vector<float> logits;
    model_->forward(fb, kv_, pool_, logits);
    return split(b, logits);
  }

  // One MTP forward: row r of the call takes hidden row r of `hidden`; returns every row's logits.
  std::vector<std::vector<float>> head(const std::vector<Seq*>& seqs,
                                       const std::vector<std::vector<int32_t>>& tokens,
                                       std::span<const float> hidden) {
    Batch b = batch(seqs, tokens, true);
    std::vector<float> logits;
    model_->forward_mtp(b.view(), hidden, kv_, pool_, logits);
    return split(b, logits);
  }

  Model& model() { return *model_; }
  size_t vocab() const { return static_cast<size_t>(model_->vocab_size()); }
  size_t hidden_size() const { return static_cast<size_t>(model_->config().hidden_size); }

 private:
  struct Batch {
    std::vector<int32_t> ids, positions, starts{0}, context, tables, rows, slots;
    std::vector<uint8_t> fresh;
    std::vector<int64_t> slot_mapping;
    int blocks_per_seq = 0;
    ForwardBatch view() const {
      return ForwardBatch{ids,    positions,      starts,       context,
                          tables, blocks_per_seq, slot_mapping, rows};
    }
  };

  Batch batch(const std::vector<Seq*>& seqs, const std::vector<std::vector<int32_t>>& tokens,
              bool mtp) const {
    Batch b;
    b.blocks_per_seq = blocks_per_seq_;
    for (size_t k = 0; k < seqs.size(); ++k) {
      Seq& s = *seqs[k];
      int& computed = mtp ? s.num_mtp_computed : s.num_computed;
      b.fresh.push_back(computed == 0);
      for (size_t j = 0; j < tokens[k].size(); ++j) {
        const int pos = computed + static_cast<int>(j);
        b.ids.push_back(tokens[k][j]);
        b.positions.push_back(pos);
        b.slot_mapping.push_back(static_cast<int64_t>(s.blocks[pos / kBlockSize]) * kBlockSize +
                                 pos % kBlockSize);
        b.rows.push_back(static_cast<int32_t>(b.ids.size()) - 1);
      }
      computed += static_cast<int>(tokens[k].size());
      b.starts.push_back(static_cast<int32_t>(b.ids.size()));
      b.context.push_back(computed);
      b.tables.insert(b.tables.end(), s.blocks.begin(), s.blocks.end());
      b.slots.push_back(s.slot);
    }
    return b;
  }

  std::vector<std::vector<float>> split(const Batch& b, const std::vector<float>& logits) const {
    std::vector<std::vector<float>> out;
    const size_t v = vocab();
    for (size_t k = 0; k + 1 < b.starts.size(); ++k) {
      out.emplace_back(logits.begin() + b.starts[k] * v, logits.begin() + b.starts[k + 1] * v);
    }
    return out;
  }

  int max_seqs_, blocks_per_seq_;
  std::unique_ptr<Model> model_;
  KvPool kv_;
  std::unique_ptr<RecurrentStatePool> state_;
  ThreadPool pool_;
  std::vector<int32_t> free_blocks_;
  int num_seqs_ = 0;
};

inline int32_t argmax(const float* row, size_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

}  // namespace relay::test

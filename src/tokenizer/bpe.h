// Byte-pair encoding of one pre-token, merging by rank as Hugging Face `tokenizers` does.
//
// Works on raw bytes instead of the byte-level alphabet: the ByteLevel mapping is a bijection, so
// starting from the 256 single-byte tokens and applying merges on token ids gives the same result
// without building mapped strings. The merge order is the oracle's: repeatedly the pair with the
// lowest rank, the leftmost among equal ranks (a min-heap over (rank, position) with stale entries
// skipped), which stays O(n log n) for pathological 100 kB words.
//
// Results for words up to kMaxCachedWordBytes are cached (bounded, sharded so threads encoding at
// once rarely contend); the cache never changes results.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace relay::tokenizer_detail {

class BpeModel {
 public:
  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kCacheCapacityWords = 1 << 16;

  // `byte_ids[b]`: the token of the single byte b. `merges`: (left id, right id, merged id) in
  // rank order (a later duplicate pair takes the later rank, as in the oracle). `whole_words`
  // (ignore_merges only; empty otherwise): tokens by their bytes, a word that is one skips merging.
  BpeModel(const std::array<int32_t, 256>& byte_ids,
           const std::vector<std::array<int32_t, 3>>& merges,
           const std::vector<std::pair<std::string, int32_t>>& whole_words);
  ~BpeModel();
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of `word` (raw bytes, non-empty) to `out`.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

 private:
  struct State;
  void merge(std::string_view word, std::vector<int32_t>& out) const;

  std::unique_ptr<State> state_;
};

}  // namespace relay::tokenizer_detail

// See bpe.h. The merge table is an open-addressing hash map keyed by the id pair (151k Qwen merges
// fit in 4 MiB and a lookup is one or two probes), the hot operation of the merge loop.
#include "tokenizer/bpe.h"

#include <algorithm>
#include <functional>
#include <mutex>
#include <queue>
#include <unordered_map>

#include "core/error.h"

namespace relay::tokenizer_detail {
namespace {

struct MergeResult {
  int32_t rank;
  int32_t id;
};

class MergeTable {
 public:
  explicit MergeTable(size_t num_merges) {
    size_t capacity = 16;
    while (capacity < num_merges * 2) capacity *= 2;
    slots_.assign(capacity, Slot{kEmpty, {0, 0}});
    mask_ = capacity - 1;
  }

  void insert_or_assign(int32_t left, int32_t right, MergeResult result) {
    const uint64_t key = pack(left, right);
    for (size_t i = hash(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmpty || slots_[i].key == key) {
        slots_[i] = Slot{key, result};
        return;
      }
    }
  }

  const MergeResult* find(int32_t left, int32_t right) const {
    const uint64_t key = pack(left, right);
    for (size_t i = hash(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i].result;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are non-negative, so no pair packs to it
  struct Slot {
    uint64_t key;
    MergeResult result;
  };
  static uint64_t pack(int32_t left, int32_t right) {
    return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
  }
  size_t hash(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

// Word -> ids, split into shards each with its own lock; a full shard is cleared (bounded memory
// that follows the current text) rather than refusing new words.
class WordCache {
 public:
  static constexpr size_t kNumShards = 32;

  explicit WordCache(size_t capacity_words) : shard_capacity_(capacity_words / kNumShards) {}

  bool get(std::string_view word, std::vector<int32_t>& out) const {
    const Shard& shard = shards_[shard_of(word)];
    std::lock_guard lock(shard.mutex);
    const auto it = shard.map.find(word);
    if (it == shard.map.end()) return false;
    out.insert(out.end(), it->second.begin(), it->second.end());
    return true;
  }

  void put(std::string_view word, std::vector<int32_t> ids) const {
    Shard& shard = shards_[shard_of(word)];
    std::lock_guard lock(shard.mutex);
    if (shard.map.size() >= shard_capacity_) shard.map.clear();
    shard.map.emplace(std::string(word), std::move(ids));
  }

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  struct Shard {
    mutable std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, Hash, std::equal_to<>> map;
  };
  static size_t shard_of(std::string_view word) {
    return (std::hash<std::string_view>{}(word) >> 7) % kNumShards;
  }

  size_t shard_capacity_;
  mutable std::array<Shard, kNumShards> shards_;
};

}  // namespace

struct BpeModel::State {
  std::array<int32_t, 256> byte_ids;
  MergeTable merges;
  WordCache cache{kCacheCapacityWords};
  std::unordered_map<std::string, int32_t> whole_words;

  State(const std::array<int32_t, 256>& ids, size_t num_merges)
      : byte_ids(ids), merges(num_merges) {}
};

BpeModel::BpeModel(const std::array<int32_t, 256>& byte_ids,
                   const std::vector<std::array<int32_t, 3>>& merges,
                   const std::vector<std::pair<std::string, int32_t>>& whole_words)
    : state_(std::make_unique<State>(byte_ids, merges.size())) {
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right, merged] = merges[rank];
    state_->merges.insert_or_assign(left, right, MergeResult{int32_t(rank), merged});
  }
  state_->whole_words.insert(whole_words.begin(), whole_words.end());
}

BpeModel::~BpeModel() = default;

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (!state_->whole_words.empty()) {
    const auto it = state_->whole_words.find(std::string(word));
    if (it != state_->whole_words.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() == 1) {
    out.push_back(state_->byte_ids[uint8_t(word[0])]);
    return;
  }
  if (word.size() > kMaxCachedWordBytes) {
    merge(word, out);
    return;
  }
  if (state_->cache.get(word, out)) return;
  const size_t first = out.size();
  merge(word, out);
  state_->cache.put(word, std::vector<int32_t>(out.begin() + std::ptrdiff_t(first), out.end()));
}

void BpeModel::merge(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;  // index of the previous live symbol, -1 at the start
    int32_t next;  // index of the next live symbol, -1 at the end
    bool live;
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;  // index of the left symbol
    int32_t id;   // the merged token this entry was queued for
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  const MergeTable& table = state_->merges;
  const int32_t n = int32_t(word.size());
  std::vector<Symbol> symbols(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    symbols[size_t(i)] = {state_->byte_ids[uint8_t(word[size_t(i)])], i - 1, i + 1 < n ? i + 1 : -1,
                          true};
  }
  std::vector<Candidate> storage;
  storage.reserve(size_t(n));
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue(std::greater<>{},
                                                                               std::move(storage));
  for (int32_t i = 0; i + 1 < n; ++i) {
    if (const MergeResult* m = table.find(symbols[size_t(i)].id, symbols[size_t(i) + 1].id)) {
      queue.push({m->rank, i, m->id});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[size_t(top.pos)];
    if (!left.live || left.next < 0) continue;
    Symbol& right = symbols[size_t(left.next)];
    // A stale entry: one side was merged away since it was queued.
    const MergeResult* current = table.find(left.id, right.id);
    if (current == nullptr || current->id != top.id) continue;
    left.id = top.id;
    right.live = false;
    left.next = right.next;
    if (left.next >= 0) symbols[size_t(left.next)].prev = top.pos;
    if (left.prev >= 0) {
      if (const MergeResult* m = table.find(symbols[size_t(left.prev)].id, left.id)) {
        queue.push({m->rank, left.prev, m->id});
      }
    }
    if (left.next >= 0) {
      if (const MergeResult* m = table.find(left.id, symbols[size_t(left.next)].id)) {
        queue.push({m->rank, top.pos, m->id});
      }
    }
  }
  for (int32_t i = 0; i >= 0; i = symbols[size_t(i)].next) out.push_back(symbols[size_t(i)].id);
}

}  // namespace relay::tokenizer_detail

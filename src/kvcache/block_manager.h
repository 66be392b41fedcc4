// The KV block manager: which pool blocks each sequence owns, and which full blocks are cached.
//
// The pool is `num_blocks` block ids (the backend owns the memory; a block id names the same slot
// in every layer). Each sequence has a block table, the ids covering its tokens in order. A block
// is either *used* (reference count > 0: in one or more block tables) or *free* (count 0, in the
// free list); never both.
//
// Prefix caching: once a block is full and its K/V has been computed, it is registered under a
// chained hash, hash(parent block's hash, the block's token ids), so the hash names the whole
// prefix up to and including the block. A new sequence whose prompt starts with the same full
// blocks reuses them (reference count + 1) instead of recomputing them: a shared system prompt is
// computed once. A cached block whose count drops to 0 stays findable in the free list until it is
// reused for something else; the free list is LRU ordered (allocation takes from the front), blocks
// that hold nothing cached go to the front, and a sequence's blocks are freed tail first so the
// start of a prompt, the part most likely shared, is evicted last. Each cached block keeps its
// tokens and parent hash, so a 64-bit hash collision can never hand a sequence the wrong K/V.
//
// Allocation is all-or-nothing: a call that cannot get every block it needs changes nothing.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace relay {

// Full blocks of a token sequence found in the prefix cache (the result of find_cached_prefix).
struct PrefixHit {
  std::vector<int32_t> blocks;   // block ids, in order, covering blocks.size() * block_size tokens
  std::vector<uint64_t> hashes;  // their chained hashes (allocate re-checks them)
  uint64_t last_hash = 0;        // hash of the last hit block (the chain continues from it)
  int64_t num_tokens(int block_size) const {
    return static_cast<int64_t>(blocks.size()) * block_size;
  }
};

class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size, bool enable_prefix_caching = true);

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int num_free_blocks() const { return num_free_; }
  int num_used_blocks() const { return num_blocks_ - num_free_; }
  // Fraction of the pool in use (cached but free blocks count as free), as vLLM's kv_cache_usage.
  double usage() const { return static_cast<double>(num_used_blocks()) / num_blocks_; }
  // Blocks needed to hold `num_tokens` tokens.
  int blocks_for_tokens(int64_t num_tokens) const {
    return static_cast<int>((num_tokens + block_size_ - 1) / block_size_);
  }

  // The longest run of cached full blocks at the start of `tokens`. At most (tokens.size() - 1)
  // tokens are covered: the last token is always computed, since its logits are what a step
  // samples.
  PrefixHit find_cached_prefix(std::span<const int32_t> tokens) const;

  // Whether allocate(seq_id, num_tokens, hit) would succeed now.
  bool can_allocate(int64_t seq_id, int64_t num_tokens, const PrefixHit* hit = nullptr) const;
  // Grows the block table of `seq_id` (created if new) to cover `num_tokens` tokens. For a new
  // sequence `hit` (from find_cached_prefix, in the same scheduling pass) supplies its first
  // blocks. Returns false, changing nothing, when the pool lacks free blocks.
  bool allocate(int64_t seq_id, int64_t num_tokens, const PrefixHit* hit = nullptr);
  // Registers the full blocks among the first `num_computed_tokens` of `tokens` (the sequence's
  // whole token list) in the prefix cache. Call after the step that computed them.
  void cache_full_blocks(int64_t seq_id, std::span<const int32_t> tokens,
                         int64_t num_computed_tokens);
  // Releases every block of `seq_id` (a no-op for an unknown id).
  void free(int64_t seq_id);

  bool has_sequence(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  std::span<const int32_t> block_table(int64_t seq_id) const;
  int ref_count(int32_t block) const { return blocks_[block].ref_count; }
  int num_cached_blocks() const { return static_cast<int>(cached_.size()); }

  // Verifies every invariant (free/used partition, reference counts equal block-table occurrences,
  // the free list's length and links, the cache index); throws relay::Error naming the first broken
  // one. O(num_blocks); for tests.
  void check_invariants() const;

 private:
  static constexpr int32_t kNone = -1;
  static constexpr uint64_t kRootHash = 0x9e3779b97f4a7c15ull;  // the parent of a first block

  struct Block {
    int ref_count = 0;
    bool cached = false;  // registered in cached_ under `hash`
    uint64_t hash = 0;
    uint64_t parent_hash = 0;  // hash of the previous block of the prefix (kRootHash for the first)
    std::vector<int32_t> tokens;         // the block's tokens while cached (collision check)
    int32_t prev = kNone, next = kNone;  // free-list links while ref_count == 0
  };
  struct SeqBlocks {
    std::vector<int32_t> table;
    int num_hashed = 0;      // leading blocks already registered (or found) in the prefix cache
    uint64_t last_hash = 0;  // chained hash of block num_hashed - 1 (kRootHash when none)
  };

  static uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens);
  bool matches(const Block& b, uint64_t parent, std::span<const int32_t> tokens) const;
  int num_hit_blocks_now_free(const PrefixHit* hit) const;
  void unlink_free(int32_t block);
  void push_free_front(int32_t block);
  void push_free_back(int32_t block);
  int32_t pop_free();  // takes the LRU block, evicting it from the cache

  int num_blocks_;
  int block_size_;
  bool enable_prefix_caching_;
  std::vector<Block> blocks_;
  int32_t free_head_ = kNone, free_tail_ = kNone;
  int num_free_ = 0;
  std::unordered_map<uint64_t, int32_t> cached_;  // chained hash -> block
  std::unordered_map<int64_t, SeqBlocks> seqs_;
};

}  // namespace relay

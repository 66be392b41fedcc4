// The KV block manager: which pool blocks each sequence owns, and which full blocks are cached.
//
// The pool is `num_blocks` block ids (the backend owns the memory; a block id names the same slot
// in every layer). Each sequence has a block table, the ids covering its tokens in order. A block
// is either *used* (reference count > 0: in one or more block tables) or *free* (count 0, in the
// free list); never both.
//
// Partitions: with data-parallel (DP) attention each DP rank owns its own KV pool and runs its own
// sequences, yet one scheduler and one block manager serve every rank. The id space is therefore
// split into `num_partitions` equal contiguous ranges, partition p owning ids
// [p * blocks_per_partition, (p + 1) * blocks_per_partition), one per rank. A sequence is bound to
// one partition when it is created and all its blocks come from there: its K/V lives on one rank.
// Each partition has its own free list, and a partition out of free blocks refuses allocation even
// when others have some. One partition (no DP) is the whole pool.
//
// Prefix caching: once a block is full and its K/V has been computed, it is registered under a
// chained hash, hash(parent block's hash, the block's token ids), so the hash names the whole
// prefix up to and including the block. A new sequence whose prompt starts with the same full
// blocks reuses them (reference count + 1) instead of recomputing them: a shared system prompt is
// computed once. Each partition's chain starts from its own root hash, so the same prompt cached on
// two ranks is two entries and a hit only ever names blocks of one partition (another rank's K/V
// is of no use). A cached block whose count drops to 0 stays findable in its free list until it is
// reused for something else; each free list is LRU ordered (allocation takes from the front),
// blocks that hold nothing cached go to the front, and a sequence's blocks are freed tail first so
// the start of a prompt, the part most likely shared, is evicted last. Each cached block keeps its
// tokens and parent hash, so a 64-bit hash collision can never hand a sequence the wrong K/V.
//
// Recurrent-state snapshots (state_snapshots.h) name prefixes by the same hashes and live only as
// long as the cached block under their hash: cached_prefix_block tells which block that is for a
// sequence's prefix, and take_uncached (when record_uncached is on) lists the blocks that left the
// cache, so their snapshots can be dropped with them.
//
// Allocation is all-or-nothing: a call that cannot get every block it needs changes nothing.
//
// Truncation (rollback, as llama.cpp's seq_rm): a speculative step writes K/V for draft tokens that
// may be rejected, so a sequence's tail can be cut back to its first n tokens. Blocks wholly past
// them are released like free() releases them. The block holding the cut stays, and the sequence
// will write the rest of its slots again: if the prefix cache lists it (it was full), its hash
// would name tokens it no longer holds, so it leaves the cache; if another sequence shares it (a
// prefix hit), its slots are that sequence's K/V and must not be rewritten, so it is released too
// and the sequence keeps only the blocks before it. Either way a cached block appears in block
// tables only among a sequence's hashed blocks, under the hash that sequence chained for its place
// (check_invariants verifies it), so no hash ever outlives the tokens it names.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace relay {

// Full blocks of a token sequence found in the prefix cache (the result of find_cached_prefix).
struct PrefixHit {
  std::vector<int32_t> blocks;   // block ids, in order, covering blocks.size() * block_size tokens
  std::vector<uint64_t> hashes;  // their chained hashes (allocate re-checks them)
  uint64_t last_hash = 0;        // hash of the last hit block (the chain continues from it)
  int partition = -1;            // the partition holding the blocks (-1 when no block hit)
  int64_t num_tokens(int block_size) const {
    return static_cast<int64_t>(blocks.size()) * block_size;
  }
};

// A cached block and the chained hash it is cached under (cached_prefix_block).
struct CachedPrefixBlock {
  uint64_t hash = 0;
  int32_t block = -1;
};

class BlockManager {
 public:
  // `num_blocks` must be a multiple of `num_partitions` (one partition per DP attention rank).
  BlockManager(int num_blocks, int block_size, bool enable_prefix_caching = true,
               int num_partitions = 1);

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int num_partitions() const { return static_cast<int>(free_lists_.size()); }
  int blocks_per_partition() const { return blocks_per_partition_; }
  int partition_of_block(int32_t block) const { return block / blocks_per_partition_; }
  // The partition `seq_id` is bound to, -1 for an unknown sequence.
  int partition_of(int64_t seq_id) const;
  int num_free_blocks() const { return num_free_; }  // over all partitions
  int num_free_blocks(int partition) const;
  int num_used_blocks() const { return num_blocks_ - num_free_; }
  // Fraction of the pool in use (cached but free blocks count as free), as vLLM's kv_cache_usage.
  double usage() const { return static_cast<double>(num_used_blocks()) / num_blocks_; }
  // Blocks needed to hold `num_tokens` tokens.
  int blocks_for_tokens(int64_t num_tokens) const {
    return static_cast<int>((num_tokens + block_size_ - 1) / block_size_);
  }

  // The longest run of cached full blocks at the start of `tokens`, over every partition (ties go
  // to the partition with the most free blocks, then the lowest index). At most (tokens.size() - 1)
  // tokens are covered: the last token is always computed, since its logits are what a step
  // samples.
  PrefixHit find_cached_prefix(std::span<const int32_t> tokens) const;
  // `hit` less its last block (none left: no hit), for a sequence that must compute that block's
  // tokens itself (scheduler.h: an MTP drafter's K/V there depends on the token after the hit).
  PrefixHit without_last_block(PrefixHit hit) const;
  // `hit` cut to its first `num_blocks` blocks (all of them when it has fewer; none: no hit).
  PrefixHit first_blocks(PrefixHit hit, size_t num_blocks) const;
  // The cached block naming the prefix of `seq_id`'s first block_index + 1 blocks: the one cached
  // under the hash the sequence chained for its block `block_index`, provided it holds the same
  // tokens after the same parent (the collision check of a hit). Nothing when the sequence has not
  // hashed that block yet or the prefix is not cached now. `tokens`: the sequence's tokens.
  std::optional<CachedPrefixBlock> cached_prefix_block(int64_t seq_id,
                                                       std::span<const int32_t> tokens,
                                                       int block_index) const;
  // From now on, remembers every block that leaves the prefix cache (evicted for reuse or cut by
  // truncate), with the hash it was cached under, until take_uncached; off by default, so nothing
  // accumulates unread.
  void record_uncached() { record_uncached_ = true; }
  std::vector<CachedPrefixBlock> take_uncached() { return std::exchange(uncached_, {}); }

  // Whether allocate(seq_id, num_tokens, hit) would succeed now.
  bool can_allocate(int64_t seq_id, int64_t num_tokens, const PrefixHit* hit = nullptr) const;
  // Grows the block table of `seq_id` (created if new) to cover `num_tokens` tokens. For a new
  // sequence `hit` (from find_cached_prefix, in the same scheduling pass) supplies its first
  // blocks. A new sequence is bound to the hit's partition when the hit has blocks, otherwise to
  // the partition with the most free blocks (the lowest index on ties); an existing one grows in
  // its own. Returns false, changing nothing, when that partition lacks free blocks.
  bool allocate(int64_t seq_id, int64_t num_tokens, const PrefixHit* hit = nullptr);
  // Binds a new sequence, with no blocks yet, to `partition`: its first allocate (without a hit)
  // grows it there. A hybrid model's sequence must live where its recurrent-state slot is
  // (state_slots.h). free() undoes it.
  void bind(int64_t seq_id, int partition);
  // Registers the full blocks among the first `num_computed_tokens` of `tokens` (the sequence's
  // whole token list) in the prefix cache. Call after the step that computed them.
  void cache_full_blocks(int64_t seq_id, std::span<const int32_t> tokens,
                         int64_t num_computed_tokens);
  // Releases every block of `seq_id` (a no-op for an unknown id).
  void free(int64_t seq_id);
  // Keeps the K/V of the first `num_tokens` tokens of `seq_id` and releases the blocks wholly past
  // them (see Truncation above). Returns how many tokens the sequence keeps: `num_tokens`, or the
  // start of the block holding the cut when another sequence shares that block (the caller
  // recomputes from there). The sequence stays bound to its partition, even with no block left.
  int64_t truncate(int64_t seq_id, int64_t num_tokens);

  bool has_sequence(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  std::span<const int32_t> block_table(int64_t seq_id) const;
  int ref_count(int32_t block) const { return blocks_[block].ref_count; }
  int num_cached_blocks() const { return static_cast<int>(cached_.size()); }

  // Verifies every invariant (free xor used, reference counts equal block-table occurrences, each
  // free list's length and links and that it holds only its partition's blocks, each block table
  // within one partition, the cache index, cached blocks in block tables only where the sequence
  // hashed them and under that hash); throws relay::Error naming the first broken one.
  // O(num_blocks); for tests.
  void check_invariants() const;

 private:
  static constexpr int32_t kNone = -1;
  static constexpr uint64_t kRootHash = 0x9e3779b97f4a7c15ull;  // partition 0's chain root

  struct Block {
    int ref_count = 0;
    bool cached = false;  // registered in cached_ under `hash`
    uint64_t hash = 0;
    uint64_t parent_hash = 0;  // hash of the previous block of the prefix (the root for the first)
    std::vector<int32_t> tokens;         // the block's tokens while cached (collision check)
    int32_t prev = kNone, next = kNone;  // free-list links while ref_count == 0
  };
  struct SeqBlocks {
    std::vector<int32_t> table;  // every id in `partition`
    int partition = 0;
    // The chained hash of each leading block already registered (or found) in the prefix cache;
    // kept per block so that truncation can cut the chain back.
    std::vector<uint64_t> hashes;
    // The hash the next block chains from: the last hashed block's, or the partition's root.
    uint64_t chain_end() const { return hashes.empty() ? root_hash(partition) : hashes.back(); }
  };
  struct FreeList {
    int32_t head = kNone, tail = kNone;
    int num_free = 0;
  };

  // The parent hash of a partition's first blocks. Partition 0 keeps kRootHash; chain_hash starts
  // with mix64, a bijection, so each root starts its own chain (a 64-bit collision across chains is
  // still caught: find_cached_prefix checks the parent hash, the tokens and the block's partition).
  static uint64_t root_hash(int partition) { return kRootHash + static_cast<uint64_t>(partition); }
  static uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens);
  bool matches(const Block& b, uint64_t parent, std::span<const int32_t> tokens) const;
  PrefixHit find_cached_prefix_in(int partition, std::span<const int32_t> tokens) const;
  int most_free_partition() const;
  int num_hit_blocks_now_free(const PrefixHit* hit) const;
  void unlink_free(int32_t block);
  void push_free_front(int32_t block);
  void push_free_back(int32_t block);
  // Drops one reference of `seq_id`'s block; at 0 it joins the free list (at the back while cached,
  // so it stays findable longest; at the front otherwise).
  void release(int64_t seq_id, int32_t block);
  int32_t pop_free(int partition);  // takes the partition's LRU block, evicting it from the cache
  void uncache(Block& b);           // takes a cached block out of the prefix cache

  int num_blocks_;
  int block_size_;
  bool enable_prefix_caching_;
  int blocks_per_partition_;
  std::vector<Block> blocks_;
  std::vector<FreeList> free_lists_;              // one per partition
  int num_free_ = 0;                              // over all partitions
  std::unordered_map<uint64_t, int32_t> cached_;  // chained hash -> block
  std::unordered_map<int64_t, SeqBlocks> seqs_;
  bool record_uncached_ = false;
  std::vector<CachedPrefixBlock> uncached_;  // since take_uncached, when recorded
};

}  // namespace relay

// The block manager's free list, reference counts and prefix cache (see block_manager.h).
#include "kvcache/block_manager.h"

#include <algorithm>

#include "core/error.h"

namespace relay {

namespace {

// splitmix64's finaliser: a cheap, well-mixed 64-bit permutation.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

BlockManager::BlockManager(int num_blocks, int block_size, bool enable_prefix_caching,
                           int num_partitions)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      blocks_per_partition_(0) {
  RELAY_CHECK(num_blocks > 0, "the KV pool needs at least one block, got ", num_blocks);
  RELAY_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
  RELAY_CHECK(num_partitions > 0, "num_partitions must be positive, got ", num_partitions);
  RELAY_CHECK(num_blocks % num_partitions == 0, "the KV pool's ", num_blocks,
              " blocks do not split evenly into ", num_partitions,
              " partitions (one per DP attention rank)");
  blocks_per_partition_ = num_blocks / num_partitions;
  blocks_.resize(num_blocks);
  free_lists_.resize(num_partitions);
  for (int32_t b = 0; b < num_blocks; ++b) push_free_back(b);
}

int BlockManager::partition_of(int64_t seq_id) const {
  const auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? -1 : it->second.partition;
}

int BlockManager::num_free_blocks(int partition) const {
  RELAY_CHECK(partition >= 0 && partition < num_partitions(), "partition ", partition,
              " is outside [0, ", num_partitions(), ")");
  return free_lists_[partition].num_free;
}

int BlockManager::most_free_partition() const {
  int best = 0;
  for (int p = 1; p < num_partitions(); ++p) {
    if (free_lists_[p].num_free > free_lists_[best].num_free) best = p;
  }
  return best;
}

uint64_t BlockManager::chain_hash(uint64_t parent, std::span<const int32_t> tokens) {
  uint64_t h = mix64(parent);
  for (int32_t t : tokens) h = mix64(h ^ static_cast<uint32_t>(t));
  return h;
}

bool BlockManager::matches(const Block& b, uint64_t parent, std::span<const int32_t> tokens) const {
  return b.cached && b.parent_hash == parent &&
         std::equal(tokens.begin(), tokens.end(), b.tokens.begin(), b.tokens.end());
}

PrefixHit BlockManager::find_cached_prefix_in(int partition,
                                              std::span<const int32_t> tokens) const {
  PrefixHit hit;
  hit.last_hash = root_hash(partition);
  const size_t max_blocks = (tokens.size() - 1) / block_size_;
  for (size_t i = 0; i < max_blocks; ++i) {
    const auto chunk = tokens.subspan(i * block_size_, block_size_);
    const uint64_t h = chain_hash(hit.last_hash, chunk);
    const auto it = cached_.find(h);
    if (it == cached_.end() || partition_of_block(it->second) != partition ||
        !matches(blocks_[it->second], hit.last_hash, chunk)) {
      break;
    }
    hit.blocks.push_back(it->second);
    hit.hashes.push_back(h);
    hit.last_hash = h;
  }
  if (!hit.blocks.empty()) hit.partition = partition;
  return hit;
}

PrefixHit BlockManager::find_cached_prefix(std::span<const int32_t> tokens) const {
  PrefixHit best;
  best.last_hash = kRootHash;
  if (!enable_prefix_caching_ || tokens.empty()) return best;
  for (int p = 0; p < num_partitions(); ++p) {
    PrefixHit hit = find_cached_prefix_in(p, tokens);
    if (hit.blocks.empty()) continue;
    // NOTE: on equal length the partition with more free blocks is likelier to fit the rest.
    if (hit.blocks.size() > best.blocks.size() ||
        (hit.blocks.size() == best.blocks.size() &&
         free_lists_[p].num_free > free_lists_[best.partition].num_free)) {
      best = std::move(hit);
    }
  }
  return best;
}

PrefixHit BlockManager::without_last_block(PrefixHit hit) const {
  if (hit.blocks.empty()) return hit;
  const size_t n = hit.blocks.size() - 1;
  return first_blocks(std::move(hit), n);
}

PrefixHit BlockManager::first_blocks(PrefixHit hit, size_t num_blocks) const {
  if (num_blocks >= hit.blocks.size()) return hit;
  hit.blocks.resize(num_blocks);
  hit.hashes.resize(num_blocks);
  hit.last_hash = hit.hashes.empty() ? root_hash(hit.partition) : hit.hashes.back();
  if (hit.blocks.empty()) hit.partition = -1;
  return hit;
}

std::optional<CachedPrefixBlock> BlockManager::cached_prefix_block(int64_t seq_id,
                                                                   std::span<const int32_t> tokens,
                                                                   int block_index) const {
  const auto it = seqs_.find(seq_id);
  if (it == seqs_.end() || block_index < 0 ||
      static_cast<size_t>(block_index) >= it->second.hashes.size() ||
      static_cast<size_t>(block_index + 1) * block_size_ > tokens.size()) {
    return std::nullopt;
  }
  const SeqBlocks& seq = it->second;
  const uint64_t hash = seq.hashes[static_cast<size_t>(block_index)];
  const uint64_t parent = block_index == 0 ? root_hash(seq.partition)
                                           : seq.hashes[static_cast<size_t>(block_index - 1)];
  const auto cached = cached_.find(hash);
  if (cached == cached_.end() ||
      !matches(blocks_[cached->second], parent,
               tokens.subspan(static_cast<size_t>(block_index) * block_size_, block_size_))) {
    return std::nullopt;
  }
  return CachedPrefixBlock{hash, cached->second};
}

int BlockManager::num_hit_blocks_now_free(const PrefixHit* hit) const {
  int n = 0;
  if (hit == nullptr || hit->blocks.empty()) return 0;
  RELAY_CHECK(hit->partition >= 0 && hit->partition < num_partitions(), "prefix hit partition ",
              hit->partition, " is outside [0, ", num_partitions(), ")");
  for (size_t i = 0; i < hit->blocks.size(); ++i) {
    RELAY_CHECK(partition_of_block(hit->blocks[i]) == hit->partition, "prefix hit block ",
                hit->blocks[i], " is not in the hit's partition ", hit->partition);
    const Block& b = blocks_[hit->blocks[i]];
    RELAY_CHECK(b.cached && b.hash == hit->hashes[i], "prefix hit block ", hit->blocks[i],
                " was evicted between find_cached_prefix and allocate");
    if (b.ref_count == 0) ++n;
  }
  return n;
}

bool BlockManager::can_allocate(int64_t seq_id, int64_t num_tokens, const PrefixHit* hit) const {
  const auto it = seqs_.find(seq_id);
  const bool is_new = it == seqs_.end();
  RELAY_CHECK(is_new || hit == nullptr || hit->blocks.empty(),
              "a prefix hit can only start a new sequence (sequence ", seq_id, ")");
  const bool use_hit = is_new && hit != nullptr && !hit->blocks.empty();
  const int partition =
      is_new ? (use_hit ? hit->partition : most_free_partition()) : it->second.partition;
  const int have = is_new ? (use_hit ? static_cast<int>(hit->blocks.size()) : 0)
                          : static_cast<int>(it->second.table.size());
  const int fresh = std::max(0, blocks_for_tokens(num_tokens) - have);
  // Hit blocks sitting in the free list leave it when taken, so they count against it too.
  const int hit_free = num_hit_blocks_now_free(use_hit ? hit : nullptr);
  return fresh + hit_free <= free_lists_[partition].num_free;
}

bool BlockManager::allocate(int64_t seq_id, int64_t num_tokens, const PrefixHit* hit) {
  if (!can_allocate(seq_id, num_tokens, hit)) return false;
  auto [it, is_new] = seqs_.try_emplace(seq_id);
  SeqBlocks& seq = it->second;
  if (is_new) {
    const bool use_hit = hit != nullptr && !hit->blocks.empty();
    seq.partition = use_hit ? hit->partition : most_free_partition();
    if (use_hit) {
      for (int32_t b : hit->blocks) {
        if (blocks_[b].ref_count++ == 0) unlink_free(b);
        seq.table.push_back(b);
      }
      seq.hashes = hit->hashes;
    }
  }
  while (static_cast<int>(seq.table.size()) < blocks_for_tokens(num_tokens)) {
    const int32_t b = pop_free(seq.partition);
    blocks_[b].ref_count = 1;
    seq.table.push_back(b);
  }
  return true;
}

void BlockManager::bind(int64_t seq_id, int partition) {
  RELAY_CHECK(partition >= 0 && partition < num_partitions(), "bind: partition ", partition,
              " is not one of the ", num_partitions());
  const auto [it, is_new] = seqs_.try_emplace(seq_id);
  RELAY_CHECK(is_new, "bind: sequence ", seq_id, " already has its partition");
  it->second.partition = partition;
}

void BlockManager::cache_full_blocks(int64_t seq_id, std::span<const int32_t> tokens,
                                     int64_t num_computed_tokens) {
  if (!enable_prefix_caching_) return;
  const auto it = seqs_.find(seq_id);
  RELAY_CHECK(it != seqs_.end(), "cache_full_blocks: unknown sequence ", seq_id);
  RELAY_CHECK(num_computed_tokens <= static_cast<int64_t>(tokens.size()),
              "cache_full_blocks: ", num_computed_tokens, " computed tokens but the sequence has ",
              tokens.size());
  SeqBlocks& seq = it->second;
  const int num_full = static_cast<int>(
      std::min<int64_t>(num_computed_tokens / block_size_, static_cast<int64_t>(seq.table.size())));
  for (int i = static_cast<int>(seq.hashes.size()); i < num_full; ++i) {
    const auto chunk = tokens.subspan(static_cast<size_t>(i) * block_size_, block_size_);
    const uint64_t parent = seq.chain_end();
    const uint64_t h = chain_hash(parent, chunk);
    Block& b = blocks_[seq.table[i]];
    // NOTE: when another sequence already cached this prefix (both computed it in the same step),
    // the first copy stays the cached one and this block remains private.
    if (!b.cached && cached_.count(h) == 0) {
      b.cached = true;
      b.hash = h;
      b.parent_hash = parent;
      b.tokens.assign(chunk.begin(), chunk.end());
      cached_.emplace(h, seq.table[i]);
    }
    seq.hashes.push_back(h);
  }
}

void BlockManager::free(int64_t seq_id) {
  const auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  const std::vector<int32_t>& table = it->second.table;
  for (auto b = table.rbegin(); b != table.rend(); ++b) release(seq_id, *b);
  seqs_.erase(it);
}

int64_t BlockManager::truncate(int64_t seq_id, int64_t num_tokens) {
  const auto it = seqs_.find(seq_id);
  RELAY_CHECK(it != seqs_.end(), "truncate: unknown sequence ", seq_id);
  RELAY_CHECK(num_tokens >= 0, "truncate: sequence ", seq_id, " cannot keep ", num_tokens,
              " tokens");
  SeqBlocks& seq = it->second;
  // The blocks to keep: those holding the first num_tokens tokens; the last of them holds the cut
  // unless it ends at a block boundary.
  size_t keep = std::min(seq.table.size(), static_cast<size_t>(blocks_for_tokens(num_tokens)));
  int64_t kept = num_tokens;
  if (num_tokens % block_size_ != 0 && keep == static_cast<size_t>(blocks_for_tokens(num_tokens))) {
    Block& cut = blocks_[seq.table[keep - 1]];
    if (cut.ref_count > 1) {
      --keep;
      kept = static_cast<int64_t>(keep) * block_size_;
    } else if (cut.cached) {
      uncache(cut);
    }
  }
  // Tail first, as free() does.
  while (seq.table.size() > keep) {
    release(seq_id, seq.table.back());
    seq.table.pop_back();
  }
  seq.hashes.resize(std::min(seq.hashes.size(), static_cast<size_t>(kept / block_size_)));
  return kept;
}

std::span<const int32_t> BlockManager::block_table(int64_t seq_id) const {
  const auto it = seqs_.find(seq_id);
  RELAY_CHECK(it != seqs_.end(), "block_table: unknown sequence ", seq_id);
  return it->second.table;
}

void BlockManager::uncache(Block& b) {
  if (record_uncached_) {
    uncached_.push_back({b.hash, static_cast<int32_t>(&b - blocks_.data())});
  }
  cached_.erase(b.hash);
  b.cached = false;
  b.tokens.clear();
}

void BlockManager::release(int64_t seq_id, int32_t block) {
  Block& b = blocks_[block];
  RELAY_CHECK(b.ref_count > 0, "block ", block, " of sequence ", seq_id, " is already free");
  if (--b.ref_count > 0) return;
  if (b.cached) {
    push_free_back(block);
  } else {
    push_free_front(block);
  }
}

void BlockManager::unlink_free(int32_t block) {
  FreeList& list = free_lists_[partition_of_block(block)];
  Block& b = blocks_[block];
  if (b.prev != kNone)
    blocks_[b.prev].next = b.next;
  else
    list.head = b.next;
  if (b.next != kNone)
    blocks_[b.next].prev = b.prev;
  else
    list.tail = b.prev;
  b.prev = b.next = kNone;
  --list.num_free;
  --num_free_;
}

void BlockManager::push_free_front(int32_t block) {
  FreeList& list = free_lists_[partition_of_block(block)];
  Block& b = blocks_[block];
  b.prev = kNone;
  b.next = list.head;
  if (list.head != kNone)
    blocks_[list.head].prev = block;
  else
    list.tail = block;
  list.head = block;
  ++list.num_free;
  ++num_free_;
}

void BlockManager::push_free_back(int32_t block) {
  FreeList& list = free_lists_[partition_of_block(block)];
  Block& b = blocks_[block];
  b.next = kNone;
  b.prev = list.tail;
  if (list.tail != kNone)
    blocks_[list.tail].next = block;
  else
    list.head = block;
  list.tail = block;
  ++list.num_free;
  ++num_free_;
}

int32_t BlockManager::pop_free(int partition) {
  const int32_t block = free_lists_[partition].head;
  RELAY_CHECK(block != kNone, "partition ", partition, " of the KV pool has no free block");
  unlink_free(block);
  if (blocks_[block].cached) uncache(blocks_[block]);
  return block;
}

void BlockManager::check_invariants() const {
  std::vector<int> refs(num_blocks_, 0);
  for (const auto& [id, seq] : seqs_) {
    RELAY_CHECK(seq.partition >= 0 && seq.partition < num_partitions(), "sequence ", id,
                " is bound to partition ", seq.partition, " outside [0, ", num_partitions(), ")");
    RELAY_CHECK(seq.hashes.size() <= seq.table.size(), "sequence ", id, " hashed ",
                seq.hashes.size(), " blocks of ", seq.table.size());
    for (size_t i = 0; i < seq.table.size(); ++i) {
      const int32_t b = seq.table[i];
      RELAY_CHECK(b >= 0 && b < num_blocks_, "sequence ", id, " holds block id ", b,
                  " outside the pool");
      RELAY_CHECK(partition_of_block(b) == seq.partition, "sequence ", id, " of partition ",
                  seq.partition, " holds block ", b, " of partition ", partition_of_block(b));
      // A cached block's hash names its tokens: any sequence holding it has those tokens there.
      RELAY_CHECK(!blocks_[b].cached || (i < seq.hashes.size() && blocks_[b].hash == seq.hashes[i]),
                  "sequence ", id, " holds cached block ", b, " at block ", i,
                  i < seq.hashes.size() ? " under another hash" : ", past the blocks it hashed");
      ++refs[b];
    }
  }
  std::vector<bool> in_free(num_blocks_, false);
  int total_free = 0;
  for (int p = 0; p < num_partitions(); ++p) {
    const FreeList& list = free_lists_[p];
    int n = 0;
    int32_t prev = kNone;
    for (int32_t b = list.head; b != kNone; b = blocks_[b].next) {
      RELAY_CHECK(partition_of_block(b) == p, "free list of partition ", p, " holds block ", b,
                  " of partition ", partition_of_block(b));
      RELAY_CHECK(!in_free[b], "block ", b, " appears twice in the free lists");
      RELAY_CHECK(blocks_[b].prev == prev, "free list back link of block ", b, " is broken");
      in_free[b] = true;
      prev = b;
      ++n;
    }
    RELAY_CHECK(prev == list.tail, "free list tail of partition ", p, " is ", list.tail,
                " but the walk ends at ", prev);
    RELAY_CHECK(n == list.num_free, "free list of partition ", p, " holds ", n,
                " blocks but its num_free is ", list.num_free);
    total_free += n;
  }
  RELAY_CHECK(total_free == num_free_, "the free lists hold ", total_free,
              " blocks but num_free is ", num_free_);
  for (int32_t b = 0; b < num_blocks_; ++b) {
    const Block& block = blocks_[b];
    RELAY_CHECK(block.ref_count == refs[b], "block ", b, " has ref_count ", block.ref_count,
                " but appears in ", refs[b], " block tables");
    RELAY_CHECK(in_free[b] == (block.ref_count == 0), "block ", b, " with ref_count ",
                block.ref_count, (in_free[b] ? " is" : " is not"), " in the free list");
    if (block.cached) {
      const auto it = cached_.find(block.hash);
      RELAY_CHECK(it != cached_.end() && it->second == b, "cached block ", b,
                  " is missing from the cache index");
      RELAY_CHECK(static_cast<int>(block.tokens.size()) == block_size_, "cached block ", b,
                  " holds ", block.tokens.size(), " tokens");
    }
  }
  for (const auto& [h, b] : cached_) {
    RELAY_CHECK(blocks_[b].cached && blocks_[b].hash == h, "cache index entry for block ", b,
                " is stale");
  }
}

}  // namespace relay

// Test helpers shared by the transfer tests: KV pools backed by real byte buffers, a pattern keyed
// by (layer, K/V, head, token, dim), and running a copy plan through the in-process transport.
//
// Source pools are filled with kSourceJunk and then the pattern for the tokens they hold, so a copy
// that reads a byte it should not (a token past the end, another block) writes junk the check sees;
// destination pools start zeroed, and the expected destination is built independently by writing
// the pattern straight into a zeroed copy through the destination's descriptor. Pattern bytes lie
// in [1, 0x7f], so they are never 0 (untouched) nor kSourceJunk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <vector>

#include "transfer/kv_pool.h"
#include "transfer/layout_mapper.h"

namespace relay::test {

constexpr std::byte kSourceJunk{0xEE};

inline uint16_t kv_pattern(int layer, KvPart part, int head, int64_t token, int dim) {
  uint64_t x = (static_cast<uint64_t>(layer) * 2 + static_cast<uint64_t>(part)) * 1000003u;
  x = (x + static_cast<uint64_t>(head)) * 1000033u;
  x = (x + static_cast<uint64_t>(token)) * 1000037u + static_cast<uint64_t>(dim);
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return static_cast<uint16_t>((x & 0x7e7e) | 0x0101);
}

// One rank's pool and the memory behind each region it uses.
struct PoolMemory {
  KvPoolDesc desc;
  std::map<RegionId, std::vector<std::byte>> regions;

  PoolMemory(KvPoolDesc d, std::byte fill) : desc(std::move(d)) {
    for (int layer = 0; layer < desc.num_layers; ++layer) {
      for (KvPart part : {KvPart::K, KvPart::V}) {
        const RegionId id = desc.tensor(layer, part).region;
        if (!regions.contains(id)) {
          regions[id].assign(kv_pool_region_bytes(desc, id), fill);
        }
      }
    }
  }

  // Writes the pattern for tokens [token_begin, token_end) of layers [layer_begin, layer_end) and
  // every head the pool holds, at the blocks `block_table` gives. Elements are 2 bytes.
  void write_pattern(std::span<const int32_t> block_table, int64_t token_begin, int64_t token_end,
                     int layer_begin, int layer_end) {
    for (int layer = layer_begin; layer < layer_end; ++layer) {
      for (KvPart part : {KvPart::K, KvPart::V}) {
        std::vector<std::byte>& mem = regions.at(desc.tensor(layer, part).region);
        for (int64_t t = token_begin; t < token_end; ++t) {
          const int32_t block = block_table[t / desc.block_size];
          for (int h = desc.heads.first; h < desc.heads.end(); ++h) {
            const uint64_t at =
                desc.offset_bytes(layer, part, block, h, static_cast<int>(t % desc.block_size));
            for (int dim = 0; dim < desc.head_dim; ++dim) {
              const uint16_t value = kv_pattern(layer, part, h, t, dim);
              std::memcpy(mem.data() + at + 2 * dim, &value, 2);
            }
          }
        }
      }
    }
  }
};

// Registers every region of `pools` with a fresh in-process engine, runs `copies` as one request
// and returns "ok", or the reason it did not succeed.
std::string run_copies(const std::vector<PoolMemory*>& pools, std::span<const KvCopy> copies);

}  // namespace relay::test

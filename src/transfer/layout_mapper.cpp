// The layout mapper (see layout_mapper.h for the algorithm).
#include "transfer/layout_mapper.h"

#include <algorithm>

#include "core/error.h"

namespace relay {

namespace {

// Checks one side against the scope: consistent ranks, heads inside the model, and block ids for
// every block the scope touches.
void validate_side(const KvTransferSide& side, const char* name, const KvCopyScope& scope) {
  RELAY_CHECK(side.num_kv_heads > 0, name, " side has ", side.num_kv_heads, " KV heads");
  RELAY_CHECK(!side.ranks.empty(), name, " side has no ranks");
  const KvPoolDesc& first = side.ranks[0];
  for (size_t r = 0; r < side.ranks.size(); ++r) {
    const KvPoolDesc& pool = side.ranks[r];
    validate_kv_pool(pool, str(name, " rank ", r));
    RELAY_CHECK(pool.block_size == first.block_size && pool.num_layers == first.num_layers &&
                    pool.head_dim == first.head_dim && pool.elem_bytes == first.elem_bytes,
                name, " rank ", r, " (block_size ", pool.block_size, ", layers ", pool.num_layers,
                ", head_dim ", pool.head_dim, ", elem_bytes ", pool.elem_bytes,
                ") differs from rank 0 (", first.block_size, ", ", first.num_layers, ", ",
                first.head_dim, ", ", first.elem_bytes, ")");
    RELAY_CHECK(pool.heads.end() <= side.num_kv_heads, name, " rank ", r, " holds heads [",
                pool.heads.first, ", ", pool.heads.end(), ") beyond the model's ",
                side.num_kv_heads, " KV heads");
  }
  if (scope.token_end == scope.token_begin) return;
  const int64_t block_size = first.block_size;
  const int64_t first_block = scope.token_begin / block_size;
  const int64_t end_block = (scope.token_end + block_size - 1) / block_size;
  RELAY_CHECK(static_cast<int64_t>(side.block_table.size()) >= end_block, name, " block table has ",
              side.block_table.size(), " blocks; tokens up to ", scope.token_end, " need ",
              end_block, " blocks of ", block_size);
  for (int64_t j = first_block; j < end_block; ++j) {
    const int32_t block = side.block_table[j];
    for (size_t r = 0; r < side.ranks.size(); ++r) {
      RELAY_CHECK(block >= 0 && block < side.ranks[r].num_blocks, name, " block table entry ", j,
                  " is block ", block, ", outside rank ", r, "'s pool of ",
                  side.ranks[r].num_blocks, " blocks");
    }
  }
}

}  // namespace

std::vector<KvCopy> plan_kv_copies(const KvTransferSide& src, const KvTransferSide& dst,
                                   const KvCopyScope& scope) {
  RELAY_CHECK(scope.token_begin >= 0 && scope.token_begin <= scope.token_end,
              "KV copy token range [", scope.token_begin, ", ", scope.token_end, ") is invalid");
  validate_side(src, "source", scope);
  validate_side(dst, "destination", scope);
  const KvPoolDesc& src0 = src.ranks[0];
  const KvPoolDesc& dst0 = dst.ranks[0];
  RELAY_CHECK(src.num_kv_heads == dst.num_kv_heads, "source has ", src.num_kv_heads,
              " KV heads, destination ", dst.num_kv_heads);
  RELAY_CHECK(src0.num_layers == dst0.num_layers && src0.head_dim == dst0.head_dim &&
                  src0.elem_bytes == dst0.elem_bytes,
              "source KV (layers ", src0.num_layers, ", head_dim ", src0.head_dim, ", elem_bytes ",
              src0.elem_bytes, ") does not match destination (", dst0.num_layers, ", ",
              dst0.head_dim, ", ", dst0.elem_bytes, ")");
  const int layer_end = scope.layer_end < 0 ? src0.num_layers : scope.layer_end;
  RELAY_CHECK(
      scope.layer_begin >= 0 && scope.layer_begin <= layer_end && layer_end <= src0.num_layers,
      "KV copy layer range [", scope.layer_begin, ", ", layer_end, ") is outside ", src0.num_layers,
      " layers");
  RELAY_CHECK(scope.src_rank >= -1 && scope.src_rank < static_cast<int>(src.ranks.size()),
              "KV copy source rank ", scope.src_rank, " is outside the source side's ",
              src.ranks.size(), " ranks");

  // replicas[h]: the source ranks holding head h, in rank order.
  std::vector<std::vector<int>> replicas(src.num_kv_heads);
  for (size_t r = 0; r < src.ranks.size(); ++r) {
    for (int h = src.ranks[r].heads.first; h < src.ranks[r].heads.end(); ++h) {
      replicas[h].push_back(static_cast<int>(r));
    }
  }
  for (size_t d = 0; d < dst.ranks.size(); ++d) {
    for (int h = dst.ranks[d].heads.first; h < dst.ranks[d].heads.end(); ++h) {
      RELAY_CHECK(!replicas[h].empty(), "destination rank ", d, " needs KV head ", h,
                  ", which no source rank holds");
    }
  }
  std::vector<KvCopy> out;
  if (scope.token_begin == scope.token_end || scope.layer_begin == layer_end) return out;

  const int64_t src_block_size = src0.block_size;
  const int64_t dst_block_size = dst0.block_size;
  const uint64_t token_bytes = src0.token_bytes();
  for (int s = 0; s < static_cast<int>(src.ranks.size()); ++s) {
    if (scope.src_rank >= 0 && s != scope.src_rank) continue;
    const KvPoolDesc& sp = src.ranks[s];
    for (int d = 0; d < static_cast<int>(dst.ranks.size()); ++d) {
      const KvPoolDesc& dp = dst.ranks[d];
      const int head_lo = std::max(sp.heads.first, dp.heads.first);
      const int head_hi = std::min(sp.heads.end(), dp.heads.end());
      if (head_lo >= head_hi) continue;
      for (int layer = scope.layer_begin; layer < layer_end; ++layer) {
        for (KvPart part : {KvPart::K, KvPart::V}) {
          const RegionId src_region = sp.tensor(layer, part).region;
          const RegionId dst_region = dp.tensor(layer, part).region;
          for (int64_t j = scope.token_begin / src_block_size; j * src_block_size < scope.token_end;
               ++j) {
            const int64_t run_lo = std::max(j * src_block_size, scope.token_begin);
            const int64_t run_hi = std::min((j + 1) * src_block_size, scope.token_end);
            // Cut the source block's tokens at destination block boundaries.
            for (int64_t t0 = run_lo, t1 = 0; t0 < run_hi; t0 = t1) {
              const int64_t k = t0 / dst_block_size;
              t1 = std::min(run_hi, (k + 1) * dst_block_size);
              for (int h = head_lo; h < head_hi; ++h) {
                const std::vector<int>& reps = replicas[h];
                if (reps[(j + d) % static_cast<int64_t>(reps.size())] != s) continue;
                append_merged_copy(
                    out, KvCopy{s, d, src_region,
                                sp.offset_bytes(layer, part, src.block_table[j], h,
                                                static_cast<int>(t0 - j * src_block_size)),
                                dst_region,
                                dp.offset_bytes(layer, part, dst.block_table[k], h,
                                                static_cast<int>(t0 - k * dst_block_size)),
                                static_cast<uint64_t>(t1 - t0) * token_bytes});
              }
            }
          }
        }
      }
    }
  }
  return out;
}

void append_merged_copy(std::vector<KvCopy>& copies, const KvCopy& copy) {
  if (!copies.empty()) {
    KvCopy& last = copies.back();
    if (last.src_rank == copy.src_rank && last.dst_rank == copy.dst_rank &&
        last.src_region == copy.src_region && last.dst_region == copy.dst_region &&
        last.src_offset_bytes + last.bytes == copy.src_offset_bytes &&
        last.dst_offset_bytes + last.bytes == copy.dst_offset_bytes) {
      last.bytes += copy.bytes;
      return;
    }
  }
  copies.push_back(copy);
}

std::vector<TransferCopy> transfer_copies(std::span<const KvCopy> copies, int src_rank) {
  std::vector<TransferCopy> out;
  for (const KvCopy& c : copies) {
    if (src_rank >= 0 && c.src_rank != src_rank) continue;
    out.push_back({c.src_region, c.src_offset_bytes, c.dst_region, c.dst_offset_bytes, c.bytes});
  }
  return out;
}

}  // namespace relay

// Paged GQA attention on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate), flash style.
//
// Rows, not tokens: a CTA owns one KV head and a tile of kBm "rows", where a row is one (new token,
// q head of this KV head's group) pair of one sequence. The group's q heads of one token are
// contiguous in q, so a tile is a plain block of q, and every K/V tile loaded into shared memory
// serves all q heads that share it — a decode step with 8 q heads per KV head reads each KV page
// once. K/V tiles of kBn cache positions are gathered from the paged HND cache through the block
// table with cp.async (two stages), rows XOR-swizzled so ldmatrix is free of bank conflicts.
// Scores stay in registers: S = Q K^T, online softmax in the exp2 domain, then P (re-packed from the
// S accumulators as the A operand) times V (ldmatrix.trans). Causality is per row: new token j of a
// sequence with n new tokens and context c sees positions [0, c - n + j].
//
// Two configurations, chosen by the host: prefill (4 warps, 64 rows, 64-position tiles) and decode
// (every sequence has one new token: 1 warp, 16 rows, 32-position tiles, context split across CTAs,
// each writing an fp32 partial output and its log-sum-exp; attention_combine merges them). The split
// count depends only on shapes the host knows (batch, KV heads, max_blocks_per_seq), never on the
// device-side context lengths, so a captured CUDA graph stays valid as contexts grow.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/wgmma.cuh"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows hold kChunks chunks.
template <int kChunks>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  if constexpr (kChunks >= 8) {
    return (row * kChunks + (chunk ^ (row & 7))) * 16;
  } else {
    return (row * kChunks + (chunk ^ ((row >> 1) & 3))) * 16;
  }
}

// What the host decides per launch besides the op's params: the split-K plan and the block shift.
struct SplitOutput {
  float* partial_out;  // [num_splits, num_tokens, num_q_heads, head_dim]
  float* partial_lse;  // [num_splits, num_tokens, num_q_heads], log2 domain
  int num_splits;
  int split_positions;  // cache positions per split (a multiple of the KV tile)
  int log2_block_size;  // block_size is a power of two >= 4
};

// The online-softmax step on one S tile held in mma C order (s[n][e]: row lane / 4 + 8 (e / 2) of
// the warp's 16, cache position pos0 + 8 n + 2 (lane % 4) + e % 2): mask positions past each row's
// causal limit or kv_end, move to the exp2 domain, update the running max m and sum l of both rows
// and leave P in s. alpha is the factor the rows' O accumulators must be scaled by. Tiles wholly
// inside both rows' limits skip the per-element mask.
template <int kNt>
__device__ __forceinline__ void online_softmax_tile(float (&s)[kNt][4], int pos0, const int (&limit)[2], int kv_end,
                                                    float scale_log2, float (&m)[2], float (&l)[2],
                                                    float (&alpha)[2]) {
  const int lane = threadIdx.x & 31;
  const int last = pos0 + kNt * 8 - 1;
  const bool unmasked = last <= limit[0] && last <= limit[1] && last < kv_end;
  pos0 += (lane & 3) * 2;
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < kNt; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int pos = pos0 + n * 8 + (e & 1);
      const int i = e >> 1;
      s[n][e] = (unmasked || (pos <= limit[i] && pos < kv_end)) ? s[n][e] * scale_log2 : -INFINITY;
      tile_max[i] = fmaxf(tile_max[i], s[n][e]);
    }
  }
  float m_use[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
    const float m_new = fmaxf(m[i], tile_max[i]);
    m_use[i] = m_new == -INFINITY ? 0.0f : m_new;
    alpha[i] = exp2f(m[i] - m_use[i]);
    m[i] = m_new;
    l[i] *= alpha[i];
  }
#pragma unroll
  for (int n = 0; n < kNt; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = exp2f(s[n][e] - m_use[e >> 1]);
      l[e >> 1] += s[n][e];
    }
  }
}

template <int kDt>
__device__ __forceinline__ void rescale_rows(float (&o)[kDt][4], const float (&alpha)[2]) {
#pragma unroll
  for (int d = 0; d < kDt; ++d) {
    o[d][0] *= alpha[0];
    o[d][1] *= alpha[0];
    o[d][2] *= alpha[1];
    o[d][3] *= alpha[1];
  }
}

// The end of a row tile: finish the quad-spread row sums and write this lane's two rows (tile rows
// `row` and row + 8) — normalised bf16, or with split-K the fp32 partial and its log-sum-exp.
template <int kDt>
__device__ __forceinline__ void store_rows(const PagedAttentionParams<bf16>& p, const SplitOutput& split,
                                           const float (&o)[kDt][4], const float (&m)[2], float (&l)[2], int q_start,
                                           int num_rows, int row, int kv_head, int group) {
  constexpr int kHeadDim = kDt * 8;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row + 8 * i;
    if (r >= num_rows) continue;
    const int token = q_start + r / group, head = kv_head * group + r % group;
    const int64_t out_row = static_cast<int64_t>(token) * p.num_q_heads + head;
    const float inv_l = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    if (split.num_splits > 1) {
      const int64_t base = static_cast<int64_t>(blockIdx.z) * p.num_tokens * p.num_q_heads + out_row;
      float* dst = split.partial_out + base * kHeadDim;
#pragma unroll
      for (int d = 0; d < kDt; ++d) {
        const int col = d * 8 + (lane & 3) * 2;
        *reinterpret_cast<float2*>(dst + col) = make_float2(o[d][2 * i] * inv_l, o[d][2 * i + 1] * inv_l);
      }
      if ((lane & 3) == 0) split.partial_lse[base] = m[i] + log2f(l[i]);
    } else {
      bf16* dst = p.out + out_row * kHeadDim;
#pragma unroll
      for (int d = 0; d < kDt; ++d) {
        const int col = d * 8 + (lane & 3) * 2;
        *reinterpret_cast<__nv_bfloat162*>(dst + col) =
            __floats2bfloat162_rn(o[d][2 * i] * inv_l, o[d][2 * i + 1] * inv_l);
      }
    }
  }
}

// Gathers the K and V rows of cache positions [pos0, pos0 + kBn) of one KV head from the paged
// cache into shared memory (zeros past kv_end), 16-byte chunk `chunk` of tile row r at byte
// offset(r, chunk). Called by all kThreads threads.
// NOTE: a tile starts at a multiple of kBn and spans at most max(1, kBn / block_size) <= 32 blocks
// (block_size >= 4), so each lane loads one block-table entry and the per-chunk lookups are warp
// shuffles: one table-load latency per tile instead of a dependent global load before every cp.async.
template <int kHeadDim, int kBn, int kThreads, class Offset>
__device__ __forceinline__ void load_kv_tile(const PagedAttentionParams<bf16>& p, const int* table, int kv_head,
                                             int pos0, int kv_end, int log2_block_size, uint8_t* k_dst,
                                             uint8_t* v_dst, Offset offset_of) {
  constexpr int kChunks = kHeadDim / 8;
  static_assert(kBn * kChunks % kThreads == 0, "every lane of every warp takes part in the shuffles");
  const int lane = threadIdx.x & 31;
  const int first_block = pos0 >> log2_block_size;
  const int last_block = (min(pos0 + kBn, kv_end) - 1) >> log2_block_size;
  const int my_block = first_block + lane <= last_block ? table[first_block + lane] : 0;
#pragma unroll 4
  for (int c = threadIdx.x; c < kBn * kChunks; c += kThreads) {
    const int r = c / kChunks, chunk = c % kChunks;
    const int pos = pos0 + r;
    const bool valid = pos < kv_end;
    const int64_t block = __shfl_sync(0xffffffffu, my_block, ((pos >> log2_block_size) - first_block) & 31);
    const int64_t offset =
        ((block * p.num_kv_heads + kv_head) * p.block_size + (pos & (p.block_size - 1))) * kHeadDim + chunk * 8;
    const uint32_t dst = offset_of(r, chunk);
    cp_async_16(k_dst + dst, p.k_cache + (valid ? offset : 0), valid);
    cp_async_16(v_dst + dst, p.v_cache + (valid ? offset : 0), valid);
  }
}

// Which (sequence, row tile) tile number `target` is, counting the row tiles of all sequences in
// order: a warp-wide scan over the sequences' tile counts. Called by a whole warp; seq is -1 past the
// last tile.
__device__ __forceinline__ void locate_row_tile(const PagedAttentionParams<bf16>& p, int rows_per_tile, int target,
                                                int& seq, int& tile) {
  const int lane = threadIdx.x & 31;
  const int group = p.num_q_heads / p.num_kv_heads;
  seq = -1;
  tile = 0;
  for (int base = 0; base < p.num_seqs && seq < 0; base += 32) {
    const int sq = base + lane;
    int count = 0;
    if (sq < p.num_seqs) count = ((p.query_starts[sq + 1] - p.query_starts[sq]) * group + rows_per_tile - 1) / rows_per_tile;
    int inclusive = count;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += v;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, inclusive > target && sq < p.num_seqs);
    if (hit) {
      const int first = __ffs(hit) - 1;
      seq = base + first;
      tile = target - (__shfl_sync(0xffffffffu, inclusive, first) - __shfl_sync(0xffffffffu, count, first));
    } else {
      target -= __shfl_sync(0xffffffffu, inclusive, 31);
    }
  }
}

template <int kHeadDim, int kWarps, int kBn>
__global__ void __launch_bounds__(kWarps * 32)
    paged_attention_kernel(PagedAttentionParams<bf16> p, SplitOutput split) {
  constexpr int kBm = 16 * kWarps;
  constexpr int kThreads = kWarps * 32;
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  constexpr int kNt = kBn / 8;           // n8 tiles of S
  constexpr int kDt = kHeadDim / 8;      // n8 tiles of O
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* q_smem = smem;
  uint8_t* k_smem = q_smem + kBm * kHeadDim * 2;  // [2][kBn][kHeadDim]
  uint8_t* v_smem = k_smem + 2 * kBn * kHeadDim * 2;
  __shared__ int tile_seq, tile_index;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int kv_head = blockIdx.y;

  if (warp == 0) {
    int found_seq, found_tile;
    locate_row_tile(p, kBm, blockIdx.x, found_seq, found_tile);
    if (lane == 0) {
      tile_seq = found_seq;
      tile_index = found_tile;
    }
  }
  __syncthreads();
  const int seq = tile_seq;
  if (seq < 0) return;
  const int q_start = p.query_starts[seq];
  const int num_new = p.query_starts[seq + 1] - q_start;
  const int context = p.context_lens[seq];
  const int num_rows = num_new * group;
  const int row0 = tile_index * kBm;
  const int last_row = min(row0 + kBm, num_rows) - 1;
  // Positions this tile needs: up to the causal limit of its last token.
  int kv_end = context - num_new + last_row / group + 1;
  int kv_begin = 0;
  if (split.num_splits > 1) {
    kv_begin = blockIdx.z * split.split_positions;
    kv_end = min(kv_end, kv_begin + split.split_positions);
  }
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;

  if (kv_begin >= kv_end) {  // an empty split: contributes nothing to the combine
    for (int r = threadIdx.x; r < kBm; r += kThreads) {
      const int row = row0 + r;
      if (row >= num_rows) continue;
      const int token = q_start + row / group, head = kv_head * group + row % group;
      split.partial_lse[(static_cast<int64_t>(blockIdx.z) * p.num_tokens + token) * p.num_q_heads + head] =
          -INFINITY;
    }
    return;
  }

  // Q tile: rows are contiguous in q ([token][q_head][dim], this KV head's group).
  for (int c = threadIdx.x; c < kBm * kChunks; c += kThreads) {
    const int r = c / kChunks, chunk = c % kChunks;
    const int row = row0 + r;
    const bool valid = row < num_rows;
    const int token = q_start + (valid ? row / group : 0), head = kv_head * group + (valid ? row % group : 0);
    const bf16* src = p.q + (static_cast<int64_t>(token) * p.num_q_heads + head) * kHeadDim + chunk * 8;
    cp_async_16(q_smem + swizzle<kChunks>(r, chunk), src, valid);
  }
  auto load_kv = [&](int tile, int stage) {
    load_kv_tile<kHeadDim, kBn, kThreads>(p, table, kv_head, kv_begin + tile * kBn, kv_end, split.log2_block_size,
                                          k_smem + stage * kBn * kHeadDim * 2, v_smem + stage * kBn * kHeadDim * 2,
                                          [](int r, int chunk) { return swizzle<kChunks>(r, chunk); });
  };
  const int num_tiles = (kv_end - kv_begin + kBn - 1) / kBn;
  load_kv(0, 0);
  cp_async_commit();

  // This lane's two rows (r, r + 8 of the warp's 16) and their causal limits.
  const int warp_row = warp * 16 + (lane >> 2);
  int limit[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + warp_row + 8 * i;
    limit[i] = row < num_rows ? context - num_new + row / group : context - 1;
  }
  const float scale_log2 = p.scale * kLog2e;
  float o[kDt][4];
#pragma unroll
  for (int d = 0; d < kDt; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t qf[kHeadDim / 16][4];

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_tiles) load_kv(tile + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (tile == 0) {
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const int r = warp * 16 + (lane & 15), chunk = kk * 2 + (lane >> 4);
        ldmatrix_x4(qf[kk], q_smem + swizzle<kChunks>(r, chunk));
      }
    }
    const uint8_t* ks = k_smem + stage * kBn * kHeadDim * 2;
    const uint8_t* vs = v_smem + stage * kBn * kHeadDim * 2;

    float s[kNt][4];
#pragma unroll
    for (int n = 0; n < kNt; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
#pragma unroll
      for (int nb = 0; nb < kNt / 2; ++nb) {
        uint32_t b[4];
        const int r = nb * 16 + (lane & 7) + ((lane >> 4) << 3), chunk = kk * 2 + ((lane >> 3) & 1);
        ldmatrix_x4(b, ks + swizzle<kChunks>(r, chunk));
        mma_bf16_16816(s[2 * nb], qf[kk], b);
        mma_bf16_16816(s[2 * nb + 1], qf[kk], b + 2);
      }
    }
    float alpha[2];
    online_softmax_tile(s, kv_begin + tile * kBn, limit, kv_end, scale_log2, m, l, alpha);
    rescale_rows(o, alpha);
    // O += P V, P re-packed from the S accumulators as the A operand.
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {
      uint32_t a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                       pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                       pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int nd = 0; nd < kDt / 2; ++nd) {
        uint32_t b[4];
        const int r = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), chunk = nd * 2 + (lane >> 4);
        ldmatrix_x4_trans(b, vs + swizzle<kChunks>(r, chunk));
        mma_bf16_16816(o[2 * nd], a, b);
        mma_bf16_16816(o[2 * nd + 1], a, b + 2);
      }
    }
    __syncthreads();  // the stage is overwritten by the next iteration's load
  }

  store_rows(p, split, o, m, l, q_start, num_rows, row0 + warp_row, kv_head, group);
}

// Prefill attention on Hopper's warp-group MMA (sm_90a), head_dim 128. A CTA owns 2 x 64
// rows of one sequence and KV head (the same rows as the mma.sync kernel), every warp group reading
// the shared K/V tile: S = Q K^T with Q and K both from shared memory (K-major), the online softmax
// in registers (the accumulator layout is mma.sync's per warp, so the softmax code is shared), then
// O += P V with P re-packed in registers as the A operand and V from shared memory (MN-major). Q
// and K/V tiles sit in 128-byte-swizzled shared memory (wgmma.cuh), filled by cp.async through the
// block table, two K/V stages. CTAs take the row tiles heaviest first: under causality a
// sequence's later tiles see the most context, so starting them first shortens the last wave.
//
// Tile shape measured on the H200 (8k causal, GQA 32/4): 128 rows x 128 positions (2 warp groups,
// one CTA per SM, 200 registers) 334 TFLOP/s; 128 x 64 301; 64 x 64 (1 warp group, 2 CTAs per SM)
// 281; the mma.sync kernel 179.
constexpr int kWgmmaWarpGroups = 2;
constexpr int kWgmmaBn = 128;

__global__ void __launch_bounds__(kWgmmaWarpGroups * 128, 1)
    prefill_attention_wgmma_kernel(PagedAttentionParams<bf16> p, int log2_block_size) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kHeadDim = 128, kBn = kWgmmaBn;
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kBm = 64 * kWgmmaWarpGroups;
  constexpr int kThreads = 128 * kWgmmaWarpGroups;
  constexpr int kNt = kBn / 8, kDt = kHeadDim / 8;
  constexpr uint32_t kTileBytes = kBn * kHeadDim * 2;
  extern __shared__ uint8_t smem_raw[];
  // The swizzle pattern is anchored at 1024-byte boundaries; the host adds 1 KB for this alignment.
  uint8_t* q_smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* k_smem = q_smem + kBm * kHeadDim * 2;  // [2 stages][kBn rows]
  uint8_t* v_smem = k_smem + 2 * kTileBytes;
  __shared__ int tile_seq, tile_index;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int kv_head = blockIdx.y;
  if (warp == 0) {
    int found_seq, found_tile;
    locate_row_tile(p, kBm, gridDim.x - 1 - blockIdx.x, found_seq, found_tile);
    if (lane == 0) {
      tile_seq = found_seq;
      tile_index = found_tile;
    }
  }
  __syncthreads();
  const int seq = tile_seq;
  if (seq < 0) return;
  const int q_start = p.query_starts[seq];
  const int num_new = p.query_starts[seq + 1] - q_start;
  const int context = p.context_lens[seq];
  const int num_rows = num_new * group;
  const int row0 = tile_index * kBm;
  const int last_row = min(row0 + kBm, num_rows) - 1;
  const int kv_end = context - num_new + last_row / group + 1;
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;

  for (int c = threadIdx.x; c < kBm * kChunks; c += kThreads) {
    const int r = c / kChunks, chunk = c % kChunks;
    const int row = row0 + r;
    const bool valid = row < num_rows;
    const int token = q_start + (valid ? row / group : 0), head = kv_head * group + (valid ? row % group : 0);
    const bf16* src = p.q + (static_cast<int64_t>(token) * p.num_q_heads + head) * kHeadDim + chunk * 8;
    cp_async_16(q_smem + sw128_offset(r, chunk, kBm), src, valid);
  }
  auto load_kv = [&](int tile, int stage) {
    load_kv_tile<kHeadDim, kBn, kThreads>(p, table, kv_head, tile * kBn, kv_end, log2_block_size,
                                          k_smem + stage * kTileBytes, v_smem + stage * kTileBytes,
                                          [](int r, int chunk) { return sw128_offset(r, chunk, kBn); });
  };
  const int num_tiles = (kv_end + kBn - 1) / kBn;
  load_kv(0, 0);
  cp_async_commit();

  const int warp_row = wg * 64 + (warp & 3) * 16 + (lane >> 2);
  int limit[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + warp_row + 8 * i;
    limit[i] = row < num_rows ? context - num_new + row / group : context - 1;
  }
  const float scale_log2 = p.scale * kLog2e;
  float o[kDt][4];
#pragma unroll
  for (int d = 0; d < kDt; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float s[kNt][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  // This warp group's 64 rows of Q; K and V tile bases.
  const uint32_t q_base = smem_addr(q_smem) + wg * 64 * 128;
  const uint32_t k_base = smem_addr(k_smem), v_base = smem_addr(v_smem);

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < num_tiles) load_kv(tile + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async_shared();
    __syncthreads();

    // S = Q K^T: 8 k16 steps over head_dim, 4 per 64-column atom.
    wgmma_fence_operands(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint64_t a = gmma_desc_sw128(q_base + (kk >> 2) * (kBm * 128) + (kk & 3) * 32, 16, 1024);
      const uint64_t b =
          gmma_desc_sw128(k_base + stage * kTileBytes + (kk >> 2) * (kBn * 128) + (kk & 3) * 32, 16, 1024);
      wgmma_ss<kBn>(&s[0][0], a, b, kk);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(s);

    float alpha[2];
    online_softmax_tile(s, tile * kBn, limit, kv_end, scale_log2, m, l, alpha);
    rescale_rows(o, alpha);

    // O += P V: one k16 step per 16 cache positions; V's two 64-column atoms are kTileBytes / 2 apart.
    // P is packed before the batch so no register write lands between its wgmmas.
    uint32_t pa[kBn / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {
      pa[kk][0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
    wgmma_fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {
      const uint64_t b = gmma_desc_sw128(v_base + stage * kTileBytes + kk * 2048, kBn * 128, 1024);
      wgmma_rs_n128_mn_major_b(&o[0][0], pa[kk], b);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(o);
    __syncthreads();  // the stage is overwritten by the next iteration's load
  }
  store_rows(p, SplitOutput{nullptr, nullptr, 1, 0, log2_block_size}, o, m, l, q_start, num_rows, row0 + warp_row,
             kv_head, group);
#else
  __trap();  // built without sm_90a: the host never launches this kernel on such an image
#endif
}

// One warp per (token, q head): weights 2^(lse_s - max) over the splits, normalised.
template <int kHeadDim>
__global__ void attention_combine_kernel(PagedAttentionParams<bf16> p, SplitOutput split) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t num_rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  if (row >= num_rows) return;
  float max_lse = -INFINITY;
  for (int sp = 0; sp < split.num_splits; ++sp) max_lse = fmaxf(max_lse, split.partial_lse[sp * num_rows + row]);
  constexpr int kPerLane = kHeadDim / 32;
  float acc[kPerLane] = {};
  float total = 0.0f;
  for (int sp = 0; sp < split.num_splits; ++sp) {
    const float lse = split.partial_lse[sp * num_rows + row];
    if (lse == -INFINITY) continue;
    const float w = exp2f(lse - max_lse);
    total += w;
    const float* src = split.partial_out + (sp * num_rows + row) * kHeadDim;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) acc[j] += w * src[lane + 32 * j];
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) p.out[row * kHeadDim + lane + 32 * j] = __float2bfloat16(acc[j] * inv);
}

DeviceWorkspace& split_workspace() {
  static DeviceWorkspace ws;
  return ws;
}

template <int kHeadDim, int kWarps, int kBn>
void run(const PagedAttentionParams<bf16>& p, const SplitOutput& split, cudaStream_t s) {
  constexpr int kBm = 16 * kWarps;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t max_tiles = (static_cast<int64_t>(p.num_tokens) * group + kBm - 1) / kBm + p.num_seqs;
  const int smem_bytes = (kBm + 4 * kBn) * kHeadDim * 2;
  auto kernel = paged_attention_kernel<kHeadDim, kWarps, kBn>;
  static bool configured = false;  // one attribute call per instantiation
  if (!configured) {
    RELAY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    configured = true;
  }
  dim3 grid(static_cast<unsigned>(max_tiles), p.num_kv_heads, split.num_splits);
  kernel<<<grid, kWarps * 32, smem_bytes, s>>>(p, split);
  RELAY_CUDA_CHECK_LAUNCH("paged_attention_kernel");
  if (split.num_splits > 1) {
    const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
    attention_combine_kernel<kHeadDim><<<ceil_div(rows, 4), 128, 0, s>>>(p, split);
    RELAY_CUDA_CHECK_LAUNCH("attention_combine_kernel");
  }
}

void run_wgmma(const PagedAttentionParams<bf16>& p, cudaStream_t s) {
  constexpr int kBm = 64 * kWgmmaWarpGroups, kBn = kWgmmaBn;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t max_tiles = (static_cast<int64_t>(p.num_tokens) * group + kBm - 1) / kBm + p.num_seqs;
  const int smem_bytes = (kBm + 4 * kBn) * 128 * 2 + 1024;
  auto kernel = prefill_attention_wgmma_kernel;
  static bool configured = false;
  if (!configured) {
    RELAY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    configured = true;
  }
  dim3 grid(static_cast<unsigned>(max_tiles), p.num_kv_heads, 1);
  kernel<<<grid, kWgmmaWarpGroups * 128, smem_bytes, s>>>(p, __builtin_ctz(p.block_size));
  RELAY_CUDA_CHECK_LAUNCH("prefill_attention_wgmma_kernel");
}

// wgmma exists on compute capability 9.0 only (Blackwell has its own tensor-core instructions).
bool device_has_wgmma() {
  static const bool has = [] {
    int device = 0, major = 0, minor = 0;
    RELAY_CUDA_CHECK(cudaGetDevice(&device));
    RELAY_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    RELAY_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return major == 9 && minor == 0;
  }();
  return has;
}

template <int kHeadDim>
void dispatch_config(const PagedAttentionParams<bf16>& p, PrefillAttentionKind kind, cudaStream_t s) {
  constexpr int kDecodeBn = 32;
  if (p.num_tokens != p.num_seqs) {
    if (kind == PrefillAttentionKind::Auto) {
      kind = kHeadDim == 128 && device_has_wgmma() ? PrefillAttentionKind::Wgmma : PrefillAttentionKind::MmaSync;
    }
    if (kind == PrefillAttentionKind::MmaSync) {
      run<kHeadDim, 4, 64>(p, SplitOutput{nullptr, nullptr, 1, 0, __builtin_ctz(p.block_size)}, s);
      return;
    }
    RELAY_CHECK(kHeadDim == 128 && device_has_wgmma(), "paged_attention: the ", prefill_attention_kind_name(kind),
                " kernel needs head_dim 128 on an sm_90 GPU (got head_dim ", kHeadDim, ")");
    if constexpr (kHeadDim == 128) {
      run_wgmma(p, s);
      return;
    }
  }
  // Decode: enough CTAs to cover the chip a few times, each at least 4 KV tiles long.
  const int64_t max_context = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int64_t ctas = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  const int64_t max_splits = std::max<int64_t>(1, max_context / (4 * kDecodeBn));
  const int num_splits = static_cast<int>(std::clamp<int64_t>((132 * 6 + ctas - 1) / ctas, 1, max_splits));
  SplitOutput split{nullptr, nullptr, num_splits, 0, __builtin_ctz(p.block_size)};
  if (num_splits > 1) {
    split.split_positions = static_cast<int>((max_context + num_splits - 1) / num_splits);
    split.split_positions = (split.split_positions + kDecodeBn - 1) / kDecodeBn * kDecodeBn;
    const int64_t rows = static_cast<int64_t>(num_splits) * p.num_tokens * p.num_q_heads;
    auto* base = static_cast<float*>(
        split_workspace().get(rows * (kHeadDim + 1) * sizeof(float), s, "paged_attention split-K"));
    split.partial_out = base;
    split.partial_lse = base + rows * kHeadDim;
  }
  run<kHeadDim, 1, kDecodeBn>(p, split, s);
}

}  // namespace

void launch_paged_attention(const PagedAttentionParams<bf16>& p, cudaStream_t s) {
  launch_paged_attention(p, PrefillAttentionKind::Auto, s);
}

void launch_paged_attention(const PagedAttentionParams<bf16>& p, PrefillAttentionKind kind, cudaStream_t s) {
  RELAY_CHECK(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0, "paged_attention: ",
              p.num_q_heads, " q heads are not a multiple of ", p.num_kv_heads, " kv heads");
  RELAY_CHECK(p.block_size >= 4 && (p.block_size & (p.block_size - 1)) == 0, "paged_attention: block_size ",
              p.block_size, " must be a power of two >= 4");
  if (p.num_tokens == 0) return;
  switch (p.head_dim) {
    case 32: dispatch_config<32>(p, kind, s); break;
    case 64: dispatch_config<64>(p, kind, s); break;
    case 128: dispatch_config<128>(p, kind, s); break;
    default: fail(str("paged_attention: head_dim ", p.head_dim, " is not built (32, 64, 128)"));
  }
}

}  // namespace relay::kernels

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
// Three kernels, chosen by the host: prefill on mma.sync (4 warps, 64 rows, 64-position tiles),
// prefill on wgmma (sm_90a, below), and decode (every sequence has one new token; see
// decode_attention_kernel): the context of a (sequence, KV head) is split across CTAs and within a
// CTA across warps. The split count depends only on shapes the host knows (batch, KV heads,
// max_blocks_per_seq); the split boundaries are computed on the device from the actual context
// lengths, so a captured CUDA graph stays valid, and balanced, as contexts grow.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/wgmma.cuh"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr float kLog2e = 1.4426950408889634f;

constexpr int kMaxDecodeSplits = 64;

// The decode split-K plan the host decides per launch besides the op's params.
struct DecodeSplit {
  float* partial_out;  // [num_splits, num_tokens, num_q_heads, head_dim], normalised
  float* partial_lse;  // [num_splits, num_tokens, num_q_heads], log2 domain
  int* done;           // [num_seqs, num_kv_heads, row_tiles] CTAs finished; zero between launches
  int num_splits;
  int row_tiles;        // 16-row tiles per KV head's group of q heads
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
// `row` and row + 8), normalised, in bf16.
template <int kDt>
__device__ __forceinline__ void store_rows(const PagedAttentionParams<bf16>& p, const float (&o)[kDt][4],
                                           float (&l)[2], int q_start, int num_rows, int row, int kv_head,
                                           int group) {
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
    bf16* dst = p.out + out_row * kHeadDim;
#pragma unroll
    for (int d = 0; d < kDt; ++d) {
      const int col = d * 8 + (lane & 3) * 2;
      *reinterpret_cast<__nv_bfloat162*>(dst + col) =
          __floats2bfloat162_rn(o[d][2 * i] * inv_l, o[d][2 * i + 1] * inv_l);
    }
  }
}

// S = Q K^T for one warp's 16 rows and a kBn-position K tile in swizzled shared memory (rows of
// kHeadDim bf16), Q already in registers as m16n8k16 A fragments.
template <int kHeadDim, int kNt>
__device__ __forceinline__ void tile_scores(float (&s)[kNt][4], const uint32_t (&qf)[kHeadDim / 16][4],
                                            const uint8_t* ks, int lane) {
  constexpr int kChunks = kHeadDim / 8;
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
}

// O += P V: P re-packed from the S accumulators as the A operand, V (kBn = 8 kNt rows) read
// transposed from swizzled shared memory.
template <int kHeadDim, int kNt>
__device__ __forceinline__ void tile_accumulate_pv(float (&o)[kHeadDim / 8][4], const float (&s)[kNt][4],
                                                   const uint8_t* vs, int lane) {
  constexpr int kChunks = kHeadDim / 8, kDt = kHeadDim / 8;
#pragma unroll
  for (int kk = 0; kk < kNt / 2; ++kk) {
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
}

// Gathers the K and V rows of cache positions [pos0, pos0 + kBn) of one KV head from the paged
// cache into shared memory (zeros past kv_end), 16-byte chunk `chunk` of tile row r at byte
// offset(r, chunk). Called by kThreads threads (whole warps), `thread` being this one's index among them.
// NOTE: a tile starts at a multiple of kBn and spans at most max(1, kBn / block_size) <= 32 blocks
// (block_size >= 4), so each lane loads one block-table entry and the per-chunk lookups are warp
// shuffles: one table-load latency per tile instead of a dependent global load before every cp.async.
template <int kHeadDim, int kBn, int kThreads, class Offset>
__device__ __forceinline__ void load_kv_tile(const PagedAttentionParams<bf16>& p, const int* table, int kv_head,
                                             int pos0, int kv_end, int log2_block_size, int thread,
                                             uint8_t* k_dst, uint8_t* v_dst, Offset offset_of) {
  constexpr int kChunks = kHeadDim / 8;
  static_assert(kBn * kChunks % kThreads == 0, "every lane of every warp takes part in the shuffles");
  const int lane = threadIdx.x & 31;
  const int first_block = pos0 >> log2_block_size;
  const int last_block = (min(pos0 + kBn, kv_end) - 1) >> log2_block_size;
  const int my_block = first_block + lane <= last_block ? table[first_block + lane] : 0;
#pragma unroll 4
  for (int c = thread; c < kBn * kChunks; c += kThreads) {
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
    paged_attention_kernel(PagedAttentionParams<bf16> p, int log2_block_size) {
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
  const int kv_end = context - num_new + last_row / group + 1;
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;

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
    load_kv_tile<kHeadDim, kBn, kThreads>(p, table, kv_head, tile * kBn, kv_end, log2_block_size, threadIdx.x,
                                          k_smem + stage * kBn * kHeadDim * 2, v_smem + stage * kBn * kHeadDim * 2,
                                          [](int r, int chunk) { return swizzle<kChunks>(r, chunk); });
  };
  const int num_tiles = (kv_end + kBn - 1) / kBn;
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
    tile_scores<kHeadDim>(s, qf, ks, lane);
    float alpha[2];
    online_softmax_tile(s, tile * kBn, limit, kv_end, scale_log2, m, l, alpha);
    rescale_rows(o, alpha);
    // O += P V, P re-packed from the S accumulators as the A operand.
    tile_accumulate_pv<kHeadDim>(o, s, vs, lane);
    __syncthreads();  // the stage is overwritten by the next iteration's load
  }

  store_rows(p, o, l, q_start, num_rows, row0 + warp_row, kv_head, group);
}

// Prefill attention on Hopper's warp-group MMA (sm_90a), head_dim 128 or 256. A CTA owns 2 x 64
// rows of one sequence and KV head (the same rows as the mma.sync kernel), every warp group reading
// the shared K/V tile: S = Q K^T with Q and K both from shared memory (K-major), the online softmax
// in registers (the accumulator layout is mma.sync's per warp, so the softmax code is shared), then
// O += P V with P re-packed in registers as the A operand and V from shared memory (MN-major). Q
// and K/V tiles sit in 128-byte-swizzled shared memory (wgmma.cuh), filled by cp.async through the
// block table, two K/V stages. CTAs take the row tiles heaviest first: under causality a
// sequence's later tiles see the most context, so starting them first shortens the last wave.
//
// Tile shape measured on the H200 (8k causal, GQA 32/4, head_dim 128): 128 rows x 128 positions
// (2 warp groups, one CTA per SM, 200 registers) 334 TFLOP/s; 128 x 64 301; 64 x 64 (1 warp group,
// 2 CTAs per SM) 281; the mma.sync kernel 179. Head_dim 256 (Qwen3.5's gated attention) doubles
// the O accumulators, so its K/V tiles are 64 positions: 128 fp32 of O, 32 of S and 16 of P per
// thread fit the 255 registers one CTA per SM allows (212, no spills), and Q plus two stages of K
// and V take 193 KiB of shared memory. Its P V runs as two n128 halves (wgmma's n stops at 256,
// and one n256 instruction would name all 128 accumulators at once).
constexpr int kWgmmaWarpGroups = 2;

template <int kHeadDim>
__host__ __device__ constexpr int wgmma_bn() {
  static_assert(kHeadDim == 128 || kHeadDim == 256, "the wgmma kernel is built for head_dim 128 and 256");
  return kHeadDim == 256 ? 64 : 128;
}

template <int kHeadDim>
__global__ void __launch_bounds__(kWgmmaWarpGroups * 128, 1)
    prefill_attention_wgmma_kernel(PagedAttentionParams<bf16> p, int log2_block_size) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBn = wgmma_bn<kHeadDim>();
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
    load_kv_tile<kHeadDim, kBn, kThreads>(p, table, kv_head, tile * kBn, kv_end, log2_block_size, threadIdx.x,
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

    // S = Q K^T: a k16 step per 16 of head_dim, 4 per 64-column atom.
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

    // O += P V: one k16 step per 16 cache positions, for each 128 columns of O (two of V's 64-column
    // atoms, which lie kBn * 128 bytes apart). P is packed before the batch so no register write
    // lands between its wgmmas.
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
#pragma unroll
      for (int half = 0; half < kHeadDim / 128; ++half) {
        const uint64_t b =
            gmma_desc_sw128(v_base + stage * kTileBytes + half * 2 * kBn * 128 + kk * 2048, kBn * 128, 1024);
        wgmma_rs_n128_mn_major_b(&o[half * 16][0], pa[kk], b);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(o);
    __syncthreads();  // the stage is overwritten by the next iteration's load
  }
  store_rows(p, o, l, q_start, num_rows, row0 + warp_row, kv_head, group);
#else
  __trap();  // built without sm_90a: the host never launches this kernel on such an image
#endif
}

// Decode attention: every sequence has one new token, so a (sequence, KV head) has only its group of
// q heads as rows and the whole cost is streaming the context's K/V once. A CTA owns one 16-row tile
// of the group, one KV head of one sequence and one split of its context; its kWarps warps take the
// split's kBn-position tiles in turn, each warp through its own two cp.async stages, so the loop
// needs no CTA barrier and a CTA keeps kWarps tiles in flight. At the end the warps' (m, l, O) are
// merged in shared memory. With several splits each CTA writes its fp32 partial and log-sum-exp and
// counts itself done; the last CTA of a (sequence, KV head, row tile) merges the splits (and resets
// the count for the next launch), so no second kernel runs. Splits are balanced over the sequence's
// actual context: only their number comes from the host.
template <int kHeadDim, int kWarps, int kBn>
__global__ void __launch_bounds__(kWarps * 32)
    decode_attention_kernel(PagedAttentionParams<bf16> p, DecodeSplit split) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kNt = kBn / 8, kDt = kHeadDim / 8;
  constexpr int kStageBytes = kBn * kHeadDim * 2;  // one of K or V
  static_assert(kWarps * 16 * (kHeadDim + 2) * 4 <= kWarps * 4 * kStageBytes, "the merge fits over the K/V stages");
  static_assert(16 * (kMaxDecodeSplits + 1) * 4 <= kWarps * 4 * kStageBytes, "the split weights fit there too");
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* q_smem = smem;                                  // [16 rows][kHeadDim]
  uint8_t* kv_smem = q_smem + 16 * kHeadDim * 2;           // per warp: [2 stages][K, V][kBn][kHeadDim]
  __shared__ int is_last;

  wait_on_prior_grid();  // q and the cache come from the kernel before (launched dependent)
  release_dependent_grid();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int seq = blockIdx.x / split.row_tiles, row_tile = blockIdx.x % split.row_tiles;
  const int kv_head = blockIdx.y;
  const int token = p.query_starts[seq];
  const int context = p.context_lens[seq];
  const int row0 = row_tile * 16;
  const int num_rows = min(16, group - row0);
  const int64_t head0 = static_cast<int64_t>(token) * p.num_q_heads + kv_head * group + row0;  // out/partial row
  const int total_tiles = (context + kBn - 1) / kBn;
  const int split_tiles = (total_tiles + split.num_splits - 1) / split.num_splits;
  const int kv_begin = min(context, static_cast<int>(blockIdx.z) * split_tiles * kBn);
  const int kv_end = min(context, kv_begin + split_tiles * kBn);
  const int num_tiles = (kv_end - kv_begin + kBn - 1) / kBn;
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;

  for (int c = threadIdx.x; c < 16 * kChunks; c += kWarps * 32) {
    const int r = c / kChunks, chunk = c % kChunks;
    cp_async_16(q_smem + swizzle<kChunks>(r, chunk), p.q + (head0 + min(r, num_rows - 1)) * kHeadDim + chunk * 8,
                r < num_rows);
  }
  cp_async_commit();
  uint8_t* my_kv = kv_smem + warp * 4 * kStageBytes;
  auto load_kv = [&](int i, int stage) {  // this warp's i-th tile
    load_kv_tile<kHeadDim, kBn, 32>(p, table, kv_head, kv_begin + (warp + i * kWarps) * kBn, kv_end,
                                    split.log2_block_size, lane, my_kv + stage * 2 * kStageBytes,
                                    my_kv + stage * 2 * kStageBytes + kStageBytes,
                                    [](int r, int chunk) { return swizzle<kChunks>(r, chunk); });
  };
  if (my_tiles > 0) load_kv(0, 0);
  cp_async_commit();
  cp_async_wait<1>();  // the Q tile (every thread's part of it, after the barrier)
  __syncthreads();
  uint32_t qf[kHeadDim / 16][4];
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    ldmatrix_x4(qf[kk], q_smem + swizzle<kChunks>(lane & 15, kk * 2 + (lane >> 4)));
  }

  const int limit[2] = {context - 1, context - 1};
  const float scale_log2 = p.scale * kLog2e;
  float o[kDt][4];
#pragma unroll
  for (int d = 0; d < kDt; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int i = 0; i < my_tiles; ++i) {
    const int stage = i & 1;
    if (i + 1 < my_tiles) load_kv(i + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncwarp();  // the other lanes' cp.async data of this stage
    const uint8_t* ks = my_kv + stage * 2 * kStageBytes;
    const uint8_t* vs = ks + kStageBytes;
    float s[kNt][4];
    tile_scores<kHeadDim>(s, qf, ks, lane);
    float alpha[2];
    online_softmax_tile(s, kv_begin + (warp + i * kWarps) * kBn, limit, kv_end, scale_log2, m, l, alpha);
    rescale_rows(o, alpha);
    tile_accumulate_pv<kHeadDim>(o, s, vs, lane);
    __syncwarp();  // the stage is overwritten by the next iteration's load
  }

  // Merge the warps: each leaves its unnormalised O and its (m, l) per row in shared memory (over
  // the K/V stages, which every warp is done with after the barrier).
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  cp_async_wait<0>();
  __syncthreads();
  float* o_smem = reinterpret_cast<float*>(kv_smem);  // [kWarps][16][kHeadDim]
  float* ml_smem = o_smem + kWarps * 16 * kHeadDim;   // [kWarps][16][m, l]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = (lane >> 2) + 8 * i;
    float* dst = o_smem + (warp * 16 + r) * kHeadDim;
#pragma unroll
    for (int d = 0; d < kDt; ++d) {
      *reinterpret_cast<float2*>(dst + d * 8 + (lane & 3) * 2) = make_float2(o[d][2 * i], o[d][2 * i + 1]);
    }
    if ((lane & 3) == 0) {
      ml_smem[(warp * 16 + r) * 2] = m[i];
      ml_smem[(warp * 16 + r) * 2 + 1] = l[i];
    }
  }
  __syncthreads();
  const int64_t num_out_rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  for (int c = threadIdx.x; c < num_rows * kHeadDim; c += kWarps * 32) {
    const int r = c / kHeadDim, d = c % kHeadDim;
    float m_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_max = fmaxf(m_max, ml_smem[(w * 16 + r) * 2]);
    float sum = 0.0f, acc = 0.0f;
    if (m_max != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float scale = exp2f(ml_smem[(w * 16 + r) * 2] - m_max);
        sum += scale * ml_smem[(w * 16 + r) * 2 + 1];
        acc += scale * o_smem[(w * 16 + r) * kHeadDim + d];
      }
    }
    const float out = sum > 0.0f ? acc / sum : 0.0f;
    if (split.num_splits == 1) {
      p.out[(head0 + r) * kHeadDim + d] = __float2bfloat16(out);
    } else {
      const int64_t prow = blockIdx.z * num_out_rows + head0 + r;
      split.partial_out[prow * kHeadDim + d] = out;
      if (d == 0) split.partial_lse[prow] = sum > 0.0f ? m_max + log2f(sum) : -INFINITY;
    }
  }
  if (split.num_splits == 1) return;

  // The last CTA to finish merges the splits: the fence orders this CTA's partials before its count,
  // and the reads below go to L2 (__ldcg), where the other CTAs' partials are.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* done = split.done + (static_cast<int64_t>(seq) * p.num_kv_heads + kv_head) * split.row_tiles + row_tile;
    is_last = atomicAdd(done, 1) == split.num_splits - 1;
    if (is_last) *done = 0;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Every (row, split) weight first, then each thread a float4 of the output summed over the splits:
  // the loads of all splits are independent, so the merge costs a few rounds of L2 latency however
  // many splits there are (one warp walking the splits in turn cost one round per split).
  float* weight = reinterpret_cast<float*>(kv_smem);  // [16 rows][num_splits]
  float* inv_total = weight + 16 * split.num_splits;  // [16 rows]
  const int num_splits = split.num_splits;
  for (int i = threadIdx.x; i < num_rows * num_splits; i += kWarps * 32) {
    const int r = i / num_splits, sp = i % num_splits;
    weight[i] = __ldcg(split.partial_lse + sp * num_out_rows + head0 + r);
  }
  __syncthreads();
  for (int r = warp; r < num_rows; r += kWarps) {
    float max_lse = -INFINITY;
    for (int sp = lane; sp < num_splits; sp += 32) max_lse = fmaxf(max_lse, weight[r * num_splits + sp]);
    max_lse = warp_max(max_lse);
    float total = 0.0f;
    for (int sp = lane; sp < num_splits; sp += 32) {
      const float lse = weight[r * num_splits + sp];
      const float w = lse == -INFINITY ? 0.0f : exp2f(lse - max_lse);
      weight[r * num_splits + sp] = w;
      total += w;
    }
    total = warp_sum(total);
    if (lane == 0) inv_total[r] = total > 0.0f ? 1.0f / total : 0.0f;
  }
  __syncthreads();
  constexpr int kQuads = kHeadDim / 4;
  for (int i = threadIdx.x; i < num_rows * kQuads; i += kWarps * 32) {
    const int r = i / kQuads, d = (i % kQuads) * 4;
    const float* src = split.partial_out + (head0 + r) * kHeadDim + d;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int sp = 0; sp < num_splits; ++sp) {
      const float w = weight[r * num_splits + sp];
      const float4 v = __ldcg(reinterpret_cast<const float4*>(src + sp * num_out_rows * kHeadDim));
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
    const float inv = inv_total[r];
    __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(p.out + (head0 + r) * kHeadDim + d);
    out[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    out[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  }
}

struct SplitTag;
struct SplitCountTag;

template <int kHeadDim>
void run_mma_sync(const PagedAttentionParams<bf16>& p, cudaStream_t s) {
  constexpr int kWarps = 4, kBm = 16 * kWarps, kBn = 64;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t max_tiles = (static_cast<int64_t>(p.num_tokens) * group + kBm - 1) / kBm + p.num_seqs;
  const int smem_bytes = (kBm + 4 * kBn) * kHeadDim * 2;
  auto kernel = paged_attention_kernel<kHeadDim, kWarps, kBn>;
  allow_dynamic_smem(kernel, smem_bytes);
  dim3 grid(static_cast<unsigned>(max_tiles), p.num_kv_heads, 1);
  kernel<<<grid, kWarps * 32, smem_bytes, s>>>(p, __builtin_ctz(p.block_size));
  RELAY_CUDA_CHECK_LAUNCH("paged_attention_kernel");
}

template <int kHeadDim>
void run_wgmma(const PagedAttentionParams<bf16>& p, cudaStream_t s) {
  constexpr int kBm = 64 * kWgmmaWarpGroups, kBn = wgmma_bn<kHeadDim>();
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t max_tiles = (static_cast<int64_t>(p.num_tokens) * group + kBm - 1) / kBm + p.num_seqs;
  const int smem_bytes = (kBm + 4 * kBn) * kHeadDim * 2 + 1024;
  auto kernel = prefill_attention_wgmma_kernel<kHeadDim>;
  allow_dynamic_smem(kernel, smem_bytes);
  dim3 grid(static_cast<unsigned>(max_tiles), p.num_kv_heads, 1);
  kernel<<<grid, kWgmmaWarpGroups * 128, smem_bytes, s>>>(p, __builtin_ctz(p.block_size));
  RELAY_CUDA_CHECK_LAUNCH("prefill_attention_wgmma_kernel");
}

// The decode split count: the CTAs of all splits should fill whole waves of the chip, and every
// warp should get a few KV tiles. Only host-known shapes enter (graph-safe): the table width bounds
// the contexts, and graphs are keyed on a power-of-two width, so a context is assumed ~3/4 of it.
// Cost model per split count: waves x (tiles per warp + a fixed cost of about 2 tiles per CTA for
// the Q load, the warp merge and the partials).
int decode_num_splits(int64_t ctas, int64_t slots, int64_t max_context, int tile, int warps) {
  const int64_t tiles = std::max<int64_t>(1, (max_context * 3 / 4 + tile - 1) / tile);
  const int64_t max_splits = std::clamp<int64_t>(tiles / (2 * warps), 1, kMaxDecodeSplits);
  int best = 1;
  double best_cost = 0.0;
  for (int64_t splits = 1; splits <= max_splits; ++splits) {
    const int64_t waves = (ctas * splits + slots - 1) / slots;
    const double cost = static_cast<double>(waves) * (std::ceil(static_cast<double>(tiles) / splits / warps) + 2.0);
    if (splits == 1 || cost < best_cost) {
      best = static_cast<int>(splits);
      best_cost = cost;
    }
  }
  return best;
}

template <int kHeadDim>
void run_decode(const PagedAttentionParams<bf16>& p, int forced_splits, cudaStream_t s) {
  constexpr int kWarps = 4, kBn = 16;
  const int smem_bytes = (16 + kWarps * 4 * kBn) * kHeadDim * 2;
  auto kernel = decode_attention_kernel<kHeadDim, kWarps, kBn>;
  allow_dynamic_smem(kernel, smem_bytes);
  // Resident CTAs on the whole device (the devices of one process are one model).
  static const int64_t slots = resident_ctas(kernel, kWarps * 32, smem_bytes);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int row_tiles = (group + 15) / 16;
  const int64_t ctas = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * row_tiles;
  const int64_t max_context = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int num_splits =
      forced_splits > 0 ? std::min(forced_splits, kMaxDecodeSplits) : decode_num_splits(ctas, slots, max_context, kBn, kWarps);
  DecodeSplit split{nullptr, nullptr, nullptr, num_splits, row_tiles, __builtin_ctz(p.block_size)};
  if (split.num_splits > 1) {
    const int64_t rows = static_cast<int64_t>(split.num_splits) * p.num_tokens * p.num_q_heads;
    auto* base = static_cast<float*>(
        per_stream<DeviceWorkspace, SplitTag>(s).get(rows * (kHeadDim + 1) * sizeof(float), s,
                                                     "paged_attention split-K"));
    split.partial_out = base;
    split.partial_lse = base + rows * kHeadDim;
    split.done = static_cast<int*>(per_stream<DeviceWorkspace, SplitCountTag>(s).get_zeroed(
        ctas * sizeof(int), s, "paged_attention split counts"));
  }
  dim3 grid(static_cast<unsigned>(p.num_seqs * row_tiles), p.num_kv_heads, split.num_splits);
  launch_dependent("decode_attention_kernel", kernel, grid, dim3(kWarps * 32), smem_bytes, s, p, split);
}

// decode_splits: the decode kernel's split count (0: the cost model's).
template <int kHeadDim>
void dispatch_config(const PagedAttentionParams<bf16>& p, PrefillAttentionKind kind, int decode_splits,
                     cudaStream_t s) {
  if (p.num_tokens == p.num_seqs) {
    run_decode<kHeadDim>(p, decode_splits, s);
    return;
  }
  constexpr bool kWgmmaBuilt = kHeadDim == 128 || kHeadDim == 256;
  if (kind == PrefillAttentionKind::Auto) {
    kind = kWgmmaBuilt && device_has_wgmma() ? PrefillAttentionKind::Wgmma : PrefillAttentionKind::MmaSync;
  }
  if (kind == PrefillAttentionKind::MmaSync) {
    run_mma_sync<kHeadDim>(p, s);
    return;
  }
  RELAY_CHECK(kWgmmaBuilt && device_has_wgmma(), "paged_attention: the ", prefill_attention_kind_name(kind),
              " kernel needs head_dim 128 or 256 on an sm_90 GPU (got head_dim ", kHeadDim, ")");
  if constexpr (kWgmmaBuilt) run_wgmma<kHeadDim>(p, s);
}

void launch_attention(const PagedAttentionParams<bf16>& p, PrefillAttentionKind kind, int decode_splits,
                      cudaStream_t s) {
  RELAY_CHECK(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0, "paged_attention: ",
              p.num_q_heads, " q heads are not a multiple of ", p.num_kv_heads, " kv heads");
  RELAY_CHECK(p.block_size >= 4 && (p.block_size & (p.block_size - 1)) == 0, "paged_attention: block_size ",
              p.block_size, " must be a power of two >= 4");
  if (p.num_tokens == 0) return;
  switch (p.head_dim) {
    case 32: dispatch_config<32>(p, kind, decode_splits, s); break;
    case 64: dispatch_config<64>(p, kind, decode_splits, s); break;
    case 128: dispatch_config<128>(p, kind, decode_splits, s); break;
    case 256: dispatch_config<256>(p, kind, decode_splits, s); break;  // Qwen3.5 / Qwen3-Next
    default: fail(str("paged_attention: head_dim ", p.head_dim, " is not built (32, 64, 128, 256)"));
  }
}

}  // namespace

void launch_decode_attention(const PagedAttentionParams<bf16>& p, int num_splits, cudaStream_t s) {
  RELAY_CHECK(p.num_tokens == p.num_seqs, "decode_attention: one token per sequence (", p.num_tokens, " tokens, ",
              p.num_seqs, " sequences)");
  launch_attention(p, PrefillAttentionKind::Auto, num_splits, s);
}

void launch_paged_attention(const PagedAttentionParams<bf16>& p, cudaStream_t s) {
  launch_attention(p, PrefillAttentionKind::Auto, 0, s);
}

void launch_paged_attention(const PagedAttentionParams<bf16>& p, PrefillAttentionKind kind, cudaStream_t s) {
  launch_attention(p, kind, 0, s);
}

}  // namespace relay::kernels

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

  // Which (sequence, row tile) this CTA owns: a warp-wide scan over the sequences' tile counts.
  if (warp == 0) {
    int target = blockIdx.x, found_seq = -1, found_tile = 0;
    for (int base = 0; base < p.num_seqs && found_seq < 0; base += 32) {
      const int s = base + lane;
      int count = 0;
      if (s < p.num_seqs) count = ((p.query_starts[s + 1] - p.query_starts[s]) * group + kBm - 1) / kBm;
      int inclusive = count;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += v;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, inclusive > target && s < p.num_seqs);
      if (hit) {
        const int first = __ffs(hit) - 1;
        found_seq = base + first;
        found_tile = target - (__shfl_sync(0xffffffffu, inclusive, first) -
                               __shfl_sync(0xffffffffu, count, first));
      } else {
        target -= __shfl_sync(0xffffffffu, inclusive, 31);
      }
    }
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
  // NOTE: a tile spans at most kBn / block_size + 1 <= 32 blocks, so each lane loads one block-table
  // entry and the per-chunk lookups are warp shuffles: one table-load latency per tile instead of a
  // dependent global load before every cp.async.
  auto load_kv = [&](int tile, int stage) {
    const int pos0 = kv_begin + tile * kBn;
    const int first_block = pos0 >> split.log2_block_size;
    const int last_block = (min(pos0 + kBn, kv_end) - 1) >> split.log2_block_size;
    const int my_block = first_block + lane <= last_block ? table[first_block + lane] : 0;
#pragma unroll 4
    for (int c = threadIdx.x; c < kBn * kChunks; c += kThreads) {
      const int r = c / kChunks, chunk = c % kChunks;
      const int pos = pos0 + r;
      const bool valid = pos < kv_end;
      const int64_t block = __shfl_sync(0xffffffffu, my_block, ((pos >> split.log2_block_size) - first_block) & 31);
      const int64_t offset =
          ((block * p.num_kv_heads + kv_head) * p.block_size + (pos & (p.block_size - 1))) * kHeadDim + chunk * 8;
      const int dst = stage * kBn * kHeadDim * 2 + swizzle<kChunks>(r, chunk);
      cp_async_16(k_smem + dst, p.k_cache + (valid ? offset : 0), valid);
      cp_async_16(v_smem + dst, p.v_cache + (valid ? offset : 0), valid);
    }
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
    // Mask, then the online softmax update for both rows.
    const int pos0 = kv_begin + tile * kBn + (lane & 3) * 2;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kNt; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = pos0 + n * 8 + (e & 1);
        const int i = e >> 1;
        s[n][e] = (pos <= limit[i] && pos < kv_end) ? s[n][e] * scale_log2 : -INFINITY;
        tile_max[i] = fmaxf(tile_max[i], s[n][e]);
      }
    }
    float alpha[2], m_use[2];
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
#pragma unroll
    for (int d = 0; d < kDt; ++d) {
      o[d][0] *= alpha[0];
      o[d][1] *= alpha[0];
      o[d][2] *= alpha[1];
      o[d][3] *= alpha[1];
    }
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

  // Row sums are spread over the quad; finish them, then write.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + warp_row + 8 * i;
    if (row >= num_rows) continue;
    const int token = q_start + row / group, head = kv_head * group + row % group;
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

template <int kHeadDim>
void dispatch_config(const PagedAttentionParams<bf16>& p, cudaStream_t s) {
  constexpr int kDecodeBn = 32;
  if (p.num_tokens != p.num_seqs) {
    run<kHeadDim, 4, 64>(p, SplitOutput{nullptr, nullptr, 1, 0, __builtin_ctz(p.block_size)}, s);
    return;
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
  RELAY_CHECK(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0, "paged_attention: ",
              p.num_q_heads, " q heads are not a multiple of ", p.num_kv_heads, " kv heads");
  RELAY_CHECK(p.block_size >= 4 && (p.block_size & (p.block_size - 1)) == 0, "paged_attention: block_size ",
              p.block_size, " must be a power of two >= 4");
  if (p.num_tokens == 0) return;
  switch (p.head_dim) {
    case 32: dispatch_config<32>(p, s); break;
    case 64: dispatch_config<64>(p, s); break;
    case 128: dispatch_config<128>(p, s); break;
    default: fail(str("paged_attention: head_dim ", p.head_dim, " is not built (32, 64, 128)"));
  }
}

}  // namespace relay::kernels

// The Gated DeltaNet ops (Qwen3.5 / Qwen3-Next linear attention) on the GPU (semantics in
// kernels/ops.h; CPU references in kernels/cpu/linear_attention.cpp). The three in one kernel for
// decode steps: gated_delta_net_step.cu; the per-token math both share: gated_delta_net.cuh.
//
// The conv runs a thread per (channel, 16 batch tokens; 1 in decode batches) with its window in
// registers. The conv, the decode form and the gated norm are launched dependent (PDL,
// common.cuh) as the other decode kernels are: a plain launch among them would end each kernel's
// overlap with the next one's launch.
//
// The recurrence has two forms. The decode form walks each sequence's tokens one at a time, in the
// CPU reference's order: a CTA per (sequence, value head, 32 columns of the head's fp32 state S
// [key_dim, value_dim]), four threads per column each holding a quarter of its rows in registers;
// per token the CTA normalises q and k into shared memory, then each column decays, forms its
// entry of S^T k (a sum over its four threads), adds k delta_j and forms its entry of S^T q. It
// suits decode steps; on a long prompt it is a serial chain of tiny steps.
//
// The chunked (WY) form takes a prefill's long sequences 64 tokens at a time on tensor cores
// (mma.sync, bf16 operands, fp32 accumulators; the state itself stays fp32). Within a chunk, with
// G the cumulative log decay and S0 the state before it, the delta rule unrolls to
//   (I + A) D = diag(beta) (V - diag(exp G) K S0),  A[t,i] = beta_t exp(G_t - G_i) k_t.k_i (i < t)
// so with T = (I + A)^-1, W = T diag(beta exp G) K and U = T diag(beta) V the chunk's deltas are
// D = U - W S0, its outputs O = diag(exp G) Q S0 + P D with P[t,i] = exp(G_t - G_i) q_t.k_i
// (i <= t), and the state after row r is exp(G_r) S0 + sum_{i<=r} exp(G_r - G_i) k_i D_i^T.
// Everything but S0 is local to the chunk, so two kernels: gdn_chunk_prepare_kernel, a CTA per
// (chunk, value head), all in parallel: normalised q and k, G, A and T (forward substitution in
// fp32), W, U and P into a workspace; then gdn_chunk_scan_kernel, a CTA per (sequence, value head,
// half of the value columns), walks the chunks in order with its state slice in mma accumulators:
// three products per chunk, the next chunk's operands loading (cp.async) meanwhile. A snapshot row
// inside a chunk gets the truncated sum above. (An fp32 SIMT version of the same form was slower
// than the decode form on H100, 258 against 138 ms for a 4096-token prompt of Qwen3.5-35B-A3B's
// first 8 layers: it did as many multiply-adds per thread as the walk. The products must be on
// tensor cores.)
#include <cfloat>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gated_delta_net.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;
using namespace gdn;

namespace {

// The conv's batch tokens per thread (conv_tile_tokens): 16 where sequences are long (prefill), 1
// where they are a few tokens each (decode, draft verification), so each thread there starts from
// one sequence's state as a thread per (sequence, channel) would. Inputs load kConvBatch at a time,
// all in flight before the outputs that need them.
constexpr int kConvLongTile = 16;
constexpr int kConvBatch = 8;
int conv_tile_tokens(const CausalConv1dParams<bf16>& p) {
  return p.num_tokens > 8 * p.num_seqs ? kConvLongTile : 1;
}

// A thread per (channel, tile of `tile` batch tokens), so a long prompt spreads over many CTAs
// instead of one thread walking its thousands of tokens (13.6 ms for a 4096-token prompt of
// Qwen3.5-35B-A3B's 8 first layers). A tile takes each sequence it overlaps in turn, its window
// starting from the inputs before its first token. Who touches a sequence's slot: the tile holding
// the sequence's first token, alone. It reads the carried state, takes the tokens whose window
// reaches into it (the first `width`, even past the tile's end; later tiles start after them),
// and writes the state the sequence ends with (its last `width` inputs, from x and, for a sequence
// shorter than that, the old state), so no other CTA reads a slot while it changes. Snapshots go
// to other slots, by whichever tile takes their token.
//
// The window's width (kernel_size - 1) is the template argument kWidth: with it a constant, the
// taps and window stay in registers (a runtime width indexed them in local memory) and the loops
// over kMaxConvWidth drop their predicated slots. Nsight Compute put the runtime-width form at
// 0.69 warps issued per scheduler cycle with DRAM 19% busy: bound by its instructions.
template <int kWidth>
__global__ void causal_conv1d_kernel(CausalConv1dParams<bf16> p, int tile) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= p.conv_dim) return;
  constexpr int width = kWidth;
  const int t0 = blockIdx.x * tile, t1 = min(t0 + tile, p.num_tokens);
  float taps[kMaxConvWidth + 1];
  load_conv_taps(p.weight, c, kWidth + 1, taps);
  auto input = [&](int t) { return __bfloat162float(p.x[static_cast<int64_t>(t) * p.x_stride + c]); };
  // The first sequence that ends past t0 or starts at it or later (a token-less sequence belongs
  // to the tile holding its start, the last tile's end included).
  int lo = 0, hi = p.num_seqs;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (p.query_starts[mid + 1] > t0 || p.query_starts[mid] >= t0) hi = mid;
    else lo = mid + 1;
  }
  for (int s = lo; s < p.num_seqs; ++s) {
    const int start = p.query_starts[s], end = p.query_starts[s + 1];
    if (start >= t1 && !(start == t1 && t1 == p.num_tokens && start == end)) break;
    float w[kMaxConvWidth];  // the inputs before token t, oldest first
    int t = start;
    const bool owns_state = start >= t0;
    float* state = nullptr;
    if (owns_state) {
      const bool keeps = p.state_slots[s] >= 0;  // -1: padding, no state
      state = keeps ? p.conv_states + p.state_slots[s] * p.state_stride + static_cast<int64_t>(c) * width : nullptr;
#pragma unroll
      for (int j = 0; j < kMaxConvWidth; ++j) w[j] = j < width && keeps && !p.state_fresh[s] ? state[j] : 0.0f;
    } else {
      t = max(t0, start + width);  // the first tile took the tokens before
#pragma unroll
      for (int j = 0; j < kMaxConvWidth; ++j) w[j] = j < width ? input(t - width + j) : 0.0f;
    }
    float old[kMaxConvWidth];  // the carried state, for the state a short sequence ends with
#pragma unroll
    for (int j = 0; j < kMaxConvWidth; ++j) old[j] = w[j];
    const int stop = min(end, owns_state ? max(t1, start + width) : t1);
    for (; t < stop; t += kConvBatch) {
      float xs[kConvBatch];
#pragma unroll
      for (int i = 0; i < kConvBatch; ++i) xs[i] = t + i < stop ? input(t + i) : 0.0f;
#pragma unroll
      for (int i = 0; i < kConvBatch; ++i) {
        if (t + i >= stop) break;
        p.out[static_cast<int64_t>(t + i) * p.conv_dim + c] = __float2bfloat16(conv_step(taps, w, width, xs[i]));
        if (p.snapshot_slots != nullptr && p.snapshot_slots[t + i] >= 0) {
          float* snap = p.conv_states + p.snapshot_slots[t + i] * p.state_stride + static_cast<int64_t>(c) * width;
#pragma unroll
          for (int j = 0; j < kMaxConvWidth; ++j) {
            if (j < width) snap[j] = w[j];
          }
        }
      }
    }
    if (state == nullptr) continue;
    // Input end - width + j, which for a sequence of len < width - j tokens is old[j + len].
    const int len = end - start;
#pragma unroll
    for (int j = 0; j < kMaxConvWidth; ++j) {
      if (j >= width) continue;
      float v = 0.0f;
      if (j + len >= width) {
        v = input(end - width + j);
      } else {
#pragma unroll
        for (int i = 0; i < kMaxConvWidth; ++i) {
          if (i == j + len) v = old[i];
        }
      }
      state[j] = v;
    }
  }
}

// Value head h of the state in pool slot `slot` (beside gdn's, not hiding it).
using gdn::head_state;
__device__ __forceinline__ float* head_state(const GatedDeltaRuleParams<bf16>& p, int slot, int h) {
  return head_state(p.states, p.state_stride, slot, h, p.key_dim, p.value_dim);
}

// Whether sequence s takes the chunked form (given a workspace).
__device__ __forceinline__ bool takes_chunks(const GatedDeltaRuleParams<bf16>& p, int s) {
  return p.query_starts[s + 1] - p.query_starts[s] >= kGatedDeltaChunkedMinTokens;
}

// The decode form: one CTA per (sequence, value head, kWalkColumns state columns), kParts
// consecutive threads per column (thread t: column t / kParts, rows t % kParts + kParts r), so a
// thread holds MaxDk / kParts floats of the state, a warp's loads of one r fill whole 32-byte
// sectors, and a decode step's many small CTAs keep the SM's loads in flight.
constexpr int kWalkColumns = 32;
constexpr int kWalkThreads = kParts * kWalkColumns;  // >= key_dim: each loads one q and k element

template <int MaxDk>
__global__ void __launch_bounds__(kWalkThreads, 4) gated_delta_rule_kernel(GatedDeltaRuleParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  constexpr int kRows = MaxDk / kParts;
  __shared__ float q[MaxDk], k[MaxDk];
  __shared__ float scratch[32];
  const int column_blocks = (p.value_dim + kWalkColumns - 1) / kWalkColumns;
  const int s = blockIdx.x / column_blocks / p.num_v_heads, h = blockIdx.x / column_blocks % p.num_v_heads;
  if (p.chunk_workspace != nullptr && takes_chunks(p, s)) return;
  const int dk = p.key_dim, dv = p.value_dim;
  const int kh = h / (p.num_v_heads / p.num_k_heads);
  const int e = threadIdx.x;  // the q and k element this thread loads
  const int j = blockIdx.x % column_blocks * kWalkColumns + threadIdx.x / kParts, part = threadIdx.x % kParts;
  const bool owns = j < dv;
  // Without a slot (graph padding) the state starts from zeros and is not kept.
  const int slot = p.state_slots[s];
  float* state = slot >= 0 ? head_state(p, slot, h) : nullptr;
  float col[kRows];
  load_state_column<MaxDk>(state, slot < 0 || p.state_fresh[s], dk, dv, j, part, col);
  const int64_t row = 2 * static_cast<int64_t>(p.num_k_heads) * dk + static_cast<int64_t>(p.num_v_heads) * dv;
  const float a_rate = expf(p.a_log[h]);
  const float dt_bias = __bfloat162float(p.dt_bias[h]);
  for (int t = p.query_starts[s]; t < p.query_starts[s + 1]; ++t) {
    const bf16* in = p.qkv + t * row;
    const float qi = e < dk ? __bfloat162float(in[static_cast<int64_t>(kh) * dk + e]) : 0.0f;
    const float ki = e < dk ? __bfloat162float(in[static_cast<int64_t>(p.num_k_heads + kh) * dk + e]) : 0.0f;
    const float v = owns ? __bfloat162float(in[2 * static_cast<int64_t>(p.num_k_heads) * dk +
                                               static_cast<int64_t>(h) * dv + j])
                         : 0.0f;
    const float2 gates = delta_rule_gates(__bfloat162float(p.b[t * p.gate_stride + h]),
                                          __bfloat162float(p.a[t * p.gate_stride + h]), a_rate, dt_bias);
    normalise_qk<MaxDk>(qi, ki, dk, q, k, scratch);
    const float o = delta_rule_column_step<MaxDk>(col, q, k, part, v, gates);
    if (owns && part == 0) p.out[(static_cast<int64_t>(t) * p.num_v_heads + h) * dv + j] = __float2bfloat16(o);
    if (owns && p.snapshot_slots != nullptr && p.snapshot_slots[t] >= 0) {
      store_state_column<MaxDk>(head_state(p, p.snapshot_slots[t], h), dk, dv, j, part, col);
    }
    __syncthreads();  // q and k are rewritten for the next token
  }
  if (owns && state != nullptr) store_state_column<MaxDk>(state, dk, dv, j, part, col);
}

// ---------------------------------------------------------------- the chunked (WY) form

constexpr int kChunk = 64;     // tokens per chunk
constexpr int kDim = 128;      // key_dim = value_dim
constexpr int kAStride = 68;   // floats per row of A in shared memory (16-byte rows, few conflicts)
constexpr int kChunkThreads = 128;  // the prepare kernel's
constexpr int kScanThreads = 256;   // the scan's: 8 warps, see gdn_chunk_scan_kernel

// The chunked form's scratch, carved from chunk_workspace: per token, the normalised q (already
// divided by sqrt(key_dim)) and k of each key head, and per value head W's and U's rows, the row of
// the chunk's P and the cumulative log decay G.
struct ChunkWorkspace {
  bf16 *qn, *kn;  // [num_tokens, num_k_heads, 128]
  bf16 *w, *u;    // [num_tokens, num_v_heads, 128]
  bf16* pm;       // [num_tokens, num_v_heads, 64]
  float* gcum;    // [num_tokens, num_v_heads]
};

constexpr size_t align256(size_t n) { return (n + 255) / 256 * 256; }

ChunkWorkspace carve_workspace(void* base, int num_tokens, int num_k_heads, int num_v_heads,
                               size_t* bytes) {
  const size_t T = num_tokens;
  const size_t sizes[6] = {T * num_k_heads * kDim * 2, T * num_k_heads * kDim * 2,
                           T * num_v_heads * kDim * 2, T * num_v_heads * kDim * 2,
                           T * num_v_heads * kChunk * 2, T * num_v_heads * 4};
  uint8_t* at = static_cast<uint8_t*>(base);
  void* parts[6];
  size_t total = 0;
  for (int i = 0; i < 6; ++i) {
    parts[i] = at == nullptr ? nullptr : at + total;
    total += align256(sizes[i]);
  }
  if (bytes != nullptr) *bytes = total;
  return {static_cast<bf16*>(parts[0]), static_cast<bf16*>(parts[1]), static_cast<bf16*>(parts[2]),
          static_cast<bf16*>(parts[3]), static_cast<bf16*>(parts[4]), static_cast<float*>(parts[5])};
}

struct ChunkPlace {
  int seq, t0, len;  // len 0: no such chunk
};

// Chunk c of the chunked sequences (each cut into kChunk-token chunks from its first new token,
// in sequence order). Called by a whole warp; every lane gets the answer.
__device__ ChunkPlace find_chunk(const GatedDeltaRuleParams<bf16>& p, int c) {
  const int lane = threadIdx.x & 31;
  int before = 0;  // chunks of the sequences passed
  for (int s0 = 0; s0 < p.num_seqs; s0 += 32) {
    const int s = s0 + lane;
    const int n = s < p.num_seqs && takes_chunks(p, s)
                      ? (p.query_starts[s + 1] - p.query_starts[s] + kChunk - 1) / kChunk
                      : 0;
    int upto = n;  // inclusive scan over the lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, upto, o);
      if (lane >= o) upto += v;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, c < before + upto);
    if (hit != 0) {
      const int l = __ffs(hit) - 1;
      const int first = before + __shfl_sync(0xffffffffu, upto - n, l);
      const int seq = s0 + l;
      const int t0 = p.query_starts[seq] + (c - first) * kChunk;
      return {seq, t0, min(kChunk, p.query_starts[seq + 1] - t0)};
    }
    before += __shfl_sync(0xffffffffu, upto, 31);
  }
  return {0, 0, 0};
}

// Byte offset of element (row, col) of a swizzled bf16 tile whose rows hold kChunks 16-byte chunks.
template <int kChunks>
__device__ __forceinline__ int tile_offset(int row, int col) {
  return swizzle<kChunks>(row, col >> 3) + (col & 7) * 2;
}

__device__ __forceinline__ void store_bf16x2(void* at, float lo, float hi) {
  *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(lo, hi);
}

// One warp's 16 rows (row0..) of a [16, 8 * kNt] product, k = 16 * kKt: A rows from a swizzled
// row-major tile (kAChunks per row), B from a swizzled tile holding B's rows (k-major, kBChunks per
// row; ldmatrix.trans) from its 16-byte chunk b_chunk0 on, acc in mma C order.
template <int kKt, int kNt, int kAChunks, int kBChunks>
__device__ __forceinline__ void warp_rows_times(float (&acc)[kNt][4], const uint8_t* a_tile,
                                                int row0, const uint8_t* b_tile, int b_chunk0,
                                                int lane) {
#pragma unroll
  for (int kt = 0; kt < kKt; ++kt) {
    uint32_t a[4];
    ldmatrix_x4(a, a_tile + swizzle<kAChunks>(row0 + (lane & 15), kt * 2 + (lane >> 4)));
#pragma unroll
    for (int nd = 0; nd < kNt / 2; ++nd) {
      uint32_t b[4];
      const int r = kt * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
      ldmatrix_x4_trans(b, b_tile + swizzle<kBChunks>(r, b_chunk0 + nd * 2 + (lane >> 4)));
      mma_bf16_16816(acc[2 * nd], a, b);
      mma_bf16_16816(acc[2 * nd + 1], a, b + 2);
    }
  }
}

constexpr int kPrepareBytes = 3 * kChunk * kDim * 2 + kChunk * kChunk * 2 + kChunk * kAStride * 4 + 2 * kChunk * 4;

// Per (chunk, value head): q and k normalised, G, A, T = (I + A)^-1, then W, U and P rows into the
// workspace (q and k by the first value head of each key head).
__global__ void __launch_bounds__(kChunkThreads)
    gdn_chunk_prepare_kernel(GatedDeltaRuleParams<bf16> p, ChunkWorkspace ws) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* qs = smem;                     // [64][128] q; then beta exp(G) k
  uint8_t* ks = qs + kChunk * kDim * 2;   // [64][128] k
  uint8_t* vs = ks + kChunk * kDim * 2;   // [64][128] v; then beta v
  uint8_t* ts = vs + kChunk * kDim * 2;   // [64][64] T
  float* am = reinterpret_cast<float*>(ts + kChunk * kChunk * 2);  // [64][kAStride] A
  float* gs = am + kChunk * kAStride;     // [64] G (g before the scan)
  float* bs = gs + kChunk;                // [64] beta
  __shared__ ChunkPlace place;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp == 0) {
    const ChunkPlace c = find_chunk(p, blockIdx.x);
    if (lane == 0) place = c;
  }
  __syncthreads();
  const int t0 = place.t0, len = place.len;
  if (len == 0) return;
  const int h = blockIdx.y, hk = p.num_k_heads, hv = p.num_v_heads;
  const int kh = h / (hv / hk);
  const bool writes_qk = h % (hv / hk) == 0;
  const int64_t row_width = 2 * int64_t{hk} * kDim + int64_t{hv} * kDim;
  const float a_rate = expf(p.a_log[h]);
  const float dt_bias = __bfloat162float(p.dt_bias[h]);

  // The chunk's q, k and v rows by cp.async (zeros past its end), the gates meanwhile (beta 0 and
  // g 0 past the end make those rows inert): every load in flight at once.
  for (int e = threadIdx.x; e < kChunk * kDim / 8; e += kChunkThreads) {
    const int i = e / (kDim / 8), c = e % (kDim / 8);
    const bf16* in = p.qkv + int64_t{t0 + min(i, len - 1)} * row_width + c * 8;
    const int off = swizzle<16>(i, c);
    cp_async_16(qs + off, in + kh * kDim, i < len);
    cp_async_16(ks + off, in + (hk + kh) * kDim, i < len);
    cp_async_16(vs + off, in + (2 * hk + h) * kDim, i < len);
  }
  cp_async_commit();
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    const int64_t t = t0 + i;
    gs[i] = i < len ? -a_rate * softplus(__bfloat162float(p.a[t * p.gate_stride + h]) + dt_bias) : 0.0f;
    bs[i] = i < len ? 1.0f / (1.0f + expf(-__bfloat162float(p.b[t * p.gate_stride + h]))) : 0.0f;
  }
  cp_async_wait<0>();
  __syncthreads();
  // q and k l2-normalised in place (q also divided by sqrt(key_dim), as the decode form), eight
  // lanes per row, each with two of its 16-byte pieces.
  for (int i = warp * 16 + (lane >> 3); i < warp * 16 + 16; i += 4) {
    const int c0 = lane & 7;
    uint4 raw[2][2];  // [q, k][piece]
    float ss[2] = {0.0f, 0.0f};
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        raw[m][half] = *reinterpret_cast<const uint4*>((m == 0 ? qs : ks) + swizzle<16>(i, c0 + 8 * half));
        const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&raw[m][half]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(x[e]);
          ss[m] += f.x * f.x + f.y * f.y;
        }
      }
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) {
      ss[0] += __shfl_xor_sync(0xffffffffu, ss[0], o);
      ss[1] += __shfl_xor_sync(0xffffffffu, ss[1], o);
    }
    const float q_scale = sqrtf(static_cast<float>(kDim));
    const float mul[2] = {rsqrtf(ss[0] + 1e-6f), rsqrtf(ss[1] + 1e-6f)};
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        __nv_bfloat162* x = reinterpret_cast<__nv_bfloat162*>(&raw[m][half]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(x[e]);
          x[e] = m == 0 ? __floats2bfloat162_rn((f.x * mul[0]) / q_scale, (f.y * mul[0]) / q_scale)
                        : __floats2bfloat162_rn(f.x * mul[1], f.y * mul[1]);
        }
        const int c = c0 + 8 * half;
        *reinterpret_cast<uint4*>((m == 0 ? qs : ks) + swizzle<16>(i, c)) = raw[m][half];
        if (writes_qk && i < len) {
          bf16* dst = (m == 0 ? ws.qn : ws.kn) + (int64_t{t0 + i} * hk + kh) * kDim + c * 8;
          *reinterpret_cast<uint4*>(dst) = raw[m][half];
        }
      }
  }
  __syncthreads();
  if (warp == 0) {  // G: the inclusive scan of g, two rows per lane
    const float g0 = gs[2 * lane], g1 = gs[2 * lane + 1];
    float upto = g0 + g1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float v = __shfl_up_sync(0xffffffffu, upto, o);
      if (lane >= o) upto += v;
    }
    gs[2 * lane] = upto - g1;
    gs[2 * lane + 1] = upto;
  }
  __syncthreads();
  if (threadIdx.x < len) ws.gcum[int64_t{t0 + threadIdx.x} * hv + h] = gs[threadIdx.x];

  // K K^T and Q K^T for this warp's 16 rows, decayed and masked: A (strictly lower, times beta)
  // into shared memory, P (lower with the diagonal) into the workspace.
  {
    float kk[8][4] = {}, qk[8][4] = {};
#pragma unroll
    for (int kt = 0; kt < kDim / 16; ++kt) {
      uint32_t ak[4], aq[4];
      ldmatrix_x4(ak, ks + swizzle<16>(warp * 16 + (lane & 15), kt * 2 + (lane >> 4)));
      ldmatrix_x4(aq, qs + swizzle<16>(warp * 16 + (lane & 15), kt * 2 + (lane >> 4)));
#pragma unroll
      for (int nb = 0; nb < 4; ++nb) {
        uint32_t b[4];
        const int r = nb * 16 + (lane & 7) + ((lane >> 4) << 3);
        ldmatrix_x4(b, ks + swizzle<16>(r, kt * 2 + ((lane >> 3) & 1)));
        mma_bf16_16816(kk[2 * nb], ak, b);
        mma_bf16_16816(kk[2 * nb + 1], ak, b + 2);
        mma_bf16_16816(qk[2 * nb], aq, b);
        mma_bf16_16816(qk[2 * nb + 1], aq, b + 2);
      }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = warp * 16 + (lane >> 2) + 8 * half, j = n * 8 + (lane & 3) * 2;
        float a2[2], p2[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float decay = j + e <= i ? __expf(gs[i] - gs[j + e]) : 0.0f;
          a2[e] = j + e < i ? bs[i] * decay * kk[n][2 * half + e] : 0.0f;
          p2[e] = decay * qk[n][2 * half + e];
        }
        am[i * kAStride + j] = a2[0];
        am[i * kAStride + j + 1] = a2[1];
        if (i < len) store_bf16x2(ws.pm + (int64_t{t0 + i} * hv + h) * kChunk + j, p2[0], p2[1]);
      }
    }
  }
  __syncthreads();

  if (warp < 2) {
    // T = (I + A)^-1 by forward substitution, thread j holding column j: T[i][j] = [i == j] -
    // sum_{m < i} A[i][m] T[m][j] (the terms with m < j vanish, as T is lower triangular).
    const int j = threadIdx.x;
    float tc[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) tc[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int m = 0; m < i; m += 4) {  // A[i][m..m+3] past i - 1 are zeros, as tc[i..] still are
        const float4 a4 = *reinterpret_cast<const float4*>(am + i * kAStride + m);
        acc[0] += a4.x * tc[m];
        acc[1] += a4.y * tc[m + 1];
        acc[2] += a4.z * tc[m + 2];
        acc[3] += a4.w * tc[m + 3];
      }
      tc[i] = (i == j ? 1.0f : 0.0f) - ((acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      *reinterpret_cast<bf16*>(ts + tile_offset<8>(i, j)) = __float2bfloat16(tc[i]);
    }
  } else {
    // Meanwhile: beta exp(G) k over q's tile (done with it) and beta v in place.
    for (int e = threadIdx.x - 64; e < kChunk * kDim / 8; e += 64) {
      const int i = e / (kDim / 8), off = swizzle<16>(i, e % (kDim / 8));
      const float sk = bs[i] * __expf(gs[i]), sv = bs[i];
      uint4 kraw = *reinterpret_cast<const uint4*>(ks + off), vraw = *reinterpret_cast<const uint4*>(vs + off);
      __nv_bfloat162* kp = reinterpret_cast<__nv_bfloat162*>(&kraw);
      __nv_bfloat162* vp = reinterpret_cast<__nv_bfloat162*>(&vraw);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        kp[m] = __floats2bfloat162_rn(__low2float(kp[m]) * sk, __high2float(kp[m]) * sk);
        vp[m] = __floats2bfloat162_rn(__low2float(vp[m]) * sv, __high2float(vp[m]) * sv);
      }
      *reinterpret_cast<uint4*>(qs + off) = kraw;
      *reinterpret_cast<uint4*>(vs + off) = vraw;
    }
  }
  __syncthreads();

  // W = T (beta exp(G) k), U = T (beta v): this warp's 16 rows.
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    float acc[kDim / 8][4] = {};
    warp_rows_times<kChunk / 16, kDim / 8, 8, 16>(acc, ts, warp * 16, which == 0 ? qs : vs, 0,
                                                  lane);
    bf16* dst = which == 0 ? ws.w : ws.u;
#pragma unroll
    for (int n = 0; n < kDim / 8; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = warp * 16 + (lane >> 2) + 8 * half, j = n * 8 + (lane & 3) * 2;
        if (i < len) store_bf16x2(dst + (int64_t{t0 + i} * hv + h) * kDim + j, acc[n][2 * half], acc[n][2 * half + 1]);
      }
    }
  }
}

// The scan's shared memory for kV value columns per CTA: two stages of a chunk's operands, then
// the per-chunk tiles.
template <int kV>
struct ScanSmem {
  static constexpr int kW = 0, kQ = kW + kChunk * kDim * 2, kK = kQ + kChunk * kDim * 2,
                       kU = kK + kChunk * kDim * 2, kP = kU + kChunk * kV * 2,
                       kStage = kP + kChunk * kChunk * 2;
  static constexpr int kSb = 2 * kStage;               // [128][kV] bf16 copy of the state slice
  static constexpr int kKd = kSb + kDim * kV * 2;      // [64][128] exp(G_last - G) k
  static constexpr int kKs = kKd + kChunk * kDim * 2;  // [64][128] the same for a snapshot row
  static constexpr int kVp = kKs + kChunk * kDim * 2;  // [64][kV] this chunk's deltas D
  static constexpr int kG = kVp + kChunk * kV * 2;     // [64] G
  static constexpr int kBytes = kG + kChunk * 4;
};

// Issues the cp.async loads of chunk [t0, t0 + len)'s W, q, k, U (this CTA's kV columns from v0)
// and P rows into `stage` (zeros past len), one group.
template <int kV>
__device__ __forceinline__ void load_scan_stage(const ChunkWorkspace& ws, uint8_t* stage, int t0,
                                                int len, int h, int kh, int hk, int hv, int v0) {
  using L = ScanSmem<kV>;
  constexpr int kRowChunks = kDim / 8;
  for (int e = threadIdx.x; e < kChunk * kRowChunks; e += kScanThreads) {
    const int i = e / kRowChunks, c = e % kRowChunks, t = t0 + min(i, len - 1);
    const int off = swizzle<16>(i, c);
    cp_async_16(stage + L::kW + off, ws.w + (int64_t{t} * hv + h) * kDim + c * 8, i < len);
    cp_async_16(stage + L::kQ + off, ws.qn + (int64_t{t} * hk + kh) * kDim + c * 8, i < len);
    cp_async_16(stage + L::kK + off, ws.kn + (int64_t{t} * hk + kh) * kDim + c * 8, i < len);
  }
  for (int e = threadIdx.x; e < kChunk * (kV / 8); e += kScanThreads) {
    const int i = e / (kV / 8), c = e % (kV / 8), t = t0 + min(i, len - 1);
    cp_async_16(stage + L::kU + swizzle<kV / 8>(i, c),
                ws.u + (int64_t{t} * hv + h) * kDim + v0 + c * 8, i < len);
  }
  for (int e = threadIdx.x; e < kChunk * 8; e += kScanThreads) {
    const int i = e / 8, c = e % 8, t = t0 + min(i, len - 1);
    cp_async_16(stage + L::kP + swizzle<8>(i, c), ws.pm + (int64_t{t} * hv + h) * kChunk + c * 8,
                i < len);
  }
  cp_async_commit();
}

// acc += Kd^T D for a scan warp's part of the state slice, key dims 32 rw.. and the kV / 2 columns
// from 16-byte chunk cc0: Kd a swizzled [64][128] tile of decayed k rows, D the swizzled [64][kV]
// deltas (the key dims are Kd^T's rows: ldmatrix.trans).
template <int kV>
__device__ __forceinline__ void add_kd_times_d(float (&acc)[2][kV / 16][4], const uint8_t* kd,
                                               const uint8_t* d, int rw, int cc0, int lane) {
#pragma unroll
  for (int kt = 0; kt < kChunk / 16; ++kt) {
    uint32_t a[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int r = kt * 16 + (lane & 7) + ((lane >> 4) << 3);
      ldmatrix_x4_trans(a[mt], kd + swizzle<16>(r, (rw * 32 + mt * 16) / 8 + ((lane >> 3) & 1)));
    }
#pragma unroll
    for (int nd = 0; nd < kV / 32; ++nd) {
      uint32_t b[4];
      const int r = kt * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
      ldmatrix_x4_trans(b, d + swizzle<kV / 8>(r, cc0 + nd * 2 + (lane >> 4)));
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma_bf16_16816(acc[mt][2 * nd], a[mt], b);
        mma_bf16_16816(acc[mt][2 * nd + 1], a[mt], b + 2);
      }
    }
  }
}

// Rows i <= last of k, times exp(G_last - G_i), into the swizzled tile `dst` (zeros past last).
__device__ __forceinline__ void decay_k_rows(uint8_t* dst, const uint8_t* k, const float* gs, int last) {
  const float g_last = gs[last];
  for (int e = threadIdx.x; e < kChunk * kDim / 8; e += kScanThreads) {
    const int i = e / (kDim / 8), off = swizzle<16>(i, e % (kDim / 8));
    const float f = i <= last ? __expf(g_last - gs[i]) : 0.0f;
    uint4 raw = *reinterpret_cast<const uint4*>(k + off);
    __nv_bfloat162* kp = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int m = 0; m < 4; ++m) kp[m] = __floats2bfloat162_rn(__low2float(kp[m]) * f, __high2float(kp[m]) * f);
    *reinterpret_cast<uint4*>(dst + off) = raw;
  }
}

// f(mt, n, e, d, j) for each element of a scan CTA's state slice this thread holds in mma C order:
// element e of tile (mt, n), key dim d = 32 rw + 16 mt + lane / 4 + 8 (e / 2), value column
// j = v0 + (kV / 2) cw + 8 n + 2 (lane % 4) + e % 2 (rw, cw: the warp's row and column parts).
template <int kV, class F>
__device__ __forceinline__ void for_state_slice(int rw, int cw, int lane, int v0, F f) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < kV / 16; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        f(mt, n, e, rw * 32 + mt * 16 + (lane >> 2) + 8 * (e >> 1),
          v0 + cw * (kV / 2) + n * 8 + (lane & 3) * 2 + (e & 1));
}

// Per (chunked sequence, value head, kV value columns): the chunks in order, the state slice
// [128 key dims, kV value columns] in mma C order across 8 warps: warp w holds key dims 32 rw.. of
// the columns half cw (rw = w % 4, cw = w / 4), and computes a chunk's rows 16 rw.. of D and O in
// those columns. The chunks are sequential, so a CTA's time is the chunk count times one chunk's
// latency, and that is instruction latency (Nsight Compute, 4 warps: a warp issued every 3.1
// cycles, 0.32 a scheduler cycle): two warps per scheduler, each with half the instructions.
// The narrower slices (kV = 32) spread a batch of few sequences and heads over more SMs
// (gated_delta_rule_scan_columns).
template <int kV>
__global__ void __launch_bounds__(kScanThreads, 1)
    gdn_chunk_scan_kernel(GatedDeltaRuleParams<bf16> p, ChunkWorkspace ws) {
  extern __shared__ __align__(1024) uint8_t smem[];
  using L = ScanSmem<kV>;
  constexpr int kBlocks = kDim / kV;
  const int s = blockIdx.x / (p.num_v_heads * kBlocks), h = blockIdx.x / kBlocks % p.num_v_heads;
  const int v0 = blockIdx.x % kBlocks * kV;
  if (!takes_chunks(p, s)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rw = warp & 3, cw = warp >> 2;
  const int cc0 = cw * (kV / 16);  // the warp's first 16-byte column chunk of a [rows][kV] tile
  const int hk = p.num_k_heads, hv = p.num_v_heads, kh = h / (hv / hk);
  const int start = p.query_starts[s], end = p.query_starts[s + 1];
  uint8_t* sb = smem + L::kSb;
  uint8_t* kd = smem + L::kKd;
  uint8_t* ksnap = smem + L::kKs;
  uint8_t* vp = smem + L::kVp;
  float* gs = reinterpret_cast<float*>(smem + L::kG);
  __shared__ uint32_t snap_mask[2];

  const bool keeps = p.state_slots[s] >= 0;
  const bool fresh = !keeps || p.state_fresh[s];
  float* state = keeps ? head_state(p, p.state_slots[s], h) : nullptr;
  float st[2][kV / 16][4];
  for_state_slice<kV>(rw, cw, lane, v0, [&](int mt, int n, int e, int d, int j) {
    st[mt][n][e] = fresh ? 0.0f : state[d * kDim + j];
  });

  // G and the snapshot slot of row threadIdx.x (< 64) of the chunk at t0, prefetched a chunk ahead.
  auto row_meta = [&](int t0, int len, float& g, int& snap) {
    const int i = threadIdx.x;
    g = i < len ? ws.gcum[int64_t{t0 + i} * hv + h] : 0.0f;
    snap = i < len && p.snapshot_slots != nullptr ? p.snapshot_slots[t0 + i] : -1;
  };
  float g_cur = 0.0f;
  int snap_cur = -1;
  if (threadIdx.x < kChunk) row_meta(start, min(kChunk, end - start), g_cur, snap_cur);
  load_scan_stage<kV>(ws, smem, start, min(kChunk, end - start), h, kh, hk, hv, v0);

  for (int c = 0, t0 = start; t0 < end; ++c, t0 += kChunk) {
    const int len = min(kChunk, end - t0);
    const uint8_t* stage = smem + (c & 1) * L::kStage;
    float g_next = 0.0f;
    int snap_next = -1;
    __syncthreads();  // the other stage's readers (the previous chunk) are done
    if (t0 + kChunk < end) {
      const int next_len = min(kChunk, end - t0 - kChunk);
      if (threadIdx.x < kChunk) row_meta(t0 + kChunk, next_len, g_next, snap_next);
      load_scan_stage<kV>(ws, smem + ((c + 1) & 1) * L::kStage, t0 + kChunk, next_len, h, kh, hk,
                          hv, v0);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if (threadIdx.x < kChunk) {
      gs[threadIdx.x] = g_cur;
      const unsigned m = __ballot_sync(0xffffffffu, snap_cur >= 0);
      if (lane == 0) snap_mask[warp] = m;
    }
    // The state slice as bf16 (the B operand of W S0 and Q S0).
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int n = 0; n < kV / 16; ++n)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int d = rw * 32 + mt * 16 + (lane >> 2) + 8 * half;
          const int j = cw * (kV / 2) + n * 8 + (lane & 3) * 2;
          store_bf16x2(sb + tile_offset<kV / 8>(d, j), st[mt][n][2 * half],
                       st[mt][n][2 * half + 1]);
        }
    __syncthreads();
    decay_k_rows(kd, stage + L::kK, gs, len - 1);

    // D = U - W S0 and O = diag(exp G) Q S0 for this warp's 16 rows and columns.
    float dv[kV / 16][4] = {}, o[kV / 16][4] = {};
#pragma unroll
    for (int kt = 0; kt < kDim / 16; ++kt) {
      uint32_t aw[4], aq[4];
      ldmatrix_x4(aw, stage + L::kW + swizzle<16>(rw * 16 + (lane & 15), kt * 2 + (lane >> 4)));
      ldmatrix_x4(aq, stage + L::kQ + swizzle<16>(rw * 16 + (lane & 15), kt * 2 + (lane >> 4)));
#pragma unroll
      for (int nd = 0; nd < kV / 32; ++nd) {
        uint32_t b[4];
        const int r = kt * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        ldmatrix_x4_trans(b, sb + swizzle<kV / 8>(r, cc0 + nd * 2 + (lane >> 4)));
        mma_bf16_16816(dv[2 * nd], aw, b);
        mma_bf16_16816(dv[2 * nd + 1], aw, b + 2);
        mma_bf16_16816(o[2 * nd], aq, b);
        mma_bf16_16816(o[2 * nd + 1], aq, b + 2);
      }
    }
#pragma unroll
    for (int n = 0; n < kV / 16; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = rw * 16 + (lane >> 2) + 8 * half, j = cw * (kV / 2) + n * 8 + (lane & 3) * 2;
        const float2 u = __bfloat1622float2(
            *reinterpret_cast<const __nv_bfloat162*>(stage + L::kU + tile_offset<kV / 8>(i, j)));
        store_bf16x2(vp + tile_offset<kV / 8>(i, j), u.x - dv[n][2 * half],
                     u.y - dv[n][2 * half + 1]);
        const float decay = __expf(gs[i]);
        o[n][2 * half] *= decay;
        o[n][2 * half + 1] *= decay;
      }
    __syncthreads();

    // O += P D, out.
    warp_rows_times<kChunk / 16, kV / 16, 8, kV / 8>(o, stage + L::kP, rw * 16, vp, cc0, lane);
#pragma unroll
    for (int n = 0; n < kV / 16; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = rw * 16 + (lane >> 2) + 8 * half;
        const int j = v0 + cw * (kV / 2) + n * 8 + (lane & 3) * 2;
        if (i < len) store_bf16x2(p.out + (int64_t{t0 + i} * hv + h) * kDim + j, o[n][2 * half], o[n][2 * half + 1]);
      }

    // Snapshot rows: exp(G_r) S0 + sum_{i <= r} exp(G_r - G_i) k_i D_i^T into their slots.
    uint64_t snaps = snap_mask[0] | uint64_t{snap_mask[1]} << 32;
    while (snaps != 0) {
      const int r = __ffsll(static_cast<long long>(snaps)) - 1;
      snaps &= snaps - 1;
      const int slot = p.snapshot_slots[t0 + r];
      float* snap = head_state(p, slot, h);
      decay_k_rows(ksnap, stage + L::kK, gs, r);
      __syncthreads();
      float acc[2][kV / 16][4];
      const float decay = __expf(gs[r]);
      for_state_slice<kV>(rw, cw, lane, v0, [&](int mt, int n, int e, int, int) {
        acc[mt][n][e] = decay * st[mt][n][e];
      });
      add_kd_times_d<kV>(acc, ksnap, vp, rw, cc0, lane);
      for_state_slice<kV>(rw, cw, lane, v0, [&](int mt, int n, int e, int d, int j) {
        snap[d * kDim + j] = acc[mt][n][e];
      });
      __syncthreads();  // ksnap is rewritten for the next snapshot row
    }

    // The state after the chunk.
    const float decay = __expf(gs[len - 1]);
    for_state_slice<kV>(rw, cw, lane, v0,
                        [&](int mt, int n, int e, int, int) { st[mt][n][e] *= decay; });
    add_kd_times_d<kV>(st, kd, vp, rw, cc0, lane);
    g_cur = g_next;
    snap_cur = snap_next;
  }
  if (state == nullptr) return;
  for_state_slice<kV>(rw, cw, lane, v0, [&](int mt, int n, int e, int d, int j) {
    state[d * kDim + j] = st[mt][n][e];
  });
}

// One warp per (token, head) row.
__global__ void gated_rms_norm_kernel(GatedRmsNormParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= static_cast<int64_t>(p.num_tokens) * p.num_heads) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = r / p.num_heads, h = r % p.num_heads;
  const bf16* x = p.x + r * p.head_dim;
  const bf16* gate = p.gate + t * p.gate_stride + h * p.head_dim;
  float ss = 0.0f;
  for (int i = lane; i < p.head_dim; i += 32) {
    const float v = __bfloat162float(x[i]);
    ss += v * v;
  }
  const float inv_rms = rsqrtf(warp_sum(ss) / static_cast<float>(p.head_dim) + p.eps);
  for (int i = lane; i < p.head_dim; i += 32) {
    p.out[r * p.head_dim + i] = __float2bfloat16(
        gated_norm(__bfloat162float(p.weight[i]), __bfloat162float(x[i]), inv_rms, __bfloat162float(gate[i])));
  }
}

// The same over 16-byte vectors where a row is kLanes of them (head_dim 8 kLanes): kLanes lanes
// per row, one vector each, 32 / kLanes rows per warp; a quarter of the load instructions of the
// per-element form at Qwen3.5's 128.
template <int kLanes>
__global__ void gated_rms_norm_vec_kernel(GatedRmsNormParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const int lane = threadIdx.x % kLanes;
  // Rows past the end still join the shuffles (every lane of the warp takes part).
  const bool live = r < static_cast<int64_t>(p.num_tokens) * p.num_heads;
  float x[8] = {}, gate[8] = {}, w[8];
  if (live) {
    const int64_t t = r / p.num_heads, h = r % p.num_heads;
    bf16x8_to_f32(reinterpret_cast<const Bf16x8*>(p.x + r * kLanes * 8)[lane], x);
    bf16x8_to_f32(
        reinterpret_cast<const Bf16x8*>(p.gate + t * p.gate_stride + h * kLanes * 8)[lane], gate);
  }
  float ss = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) ss += x[e] * x[e];
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (!live) return;
  const float inv_rms = rsqrtf(ss / static_cast<float>(kLanes * 8) + p.eps);
  bf16x8_to_f32(reinterpret_cast<const Bf16x8*>(p.weight)[lane], w);
  float o[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = gated_norm(w[e], x[e], inv_rms, gate[e]);
  reinterpret_cast<Bf16x8*>(p.out + r * kLanes * 8)[lane] = f32_to_bf16x8(o);
}

// causal_conv1d_kernel<kernel_size - 1>: every width the check below admits has its instance.
template <int kWidth = 0>
void launch_conv1d_of_width(const CausalConv1dParams<bf16>& p, dim3 grid, dim3 block, int tile,
                            cudaStream_t s) {
  if constexpr (kWidth <= kMaxConvWidth) {
    if (p.kernel_size - 1 != kWidth)
      return launch_conv1d_of_width<kWidth + 1>(p, grid, block, tile, s);
    launch_dependent("causal_conv1d_kernel", causal_conv1d_kernel<kWidth>, grid, block, 0, s, p,
                     tile);
  }
}

// The scan over a batch's chunks in kV-column slices: a CTA per (sequence, value head, slice).
template <int kV>
void launch_chunk_scan(const GatedDeltaRuleParams<bf16>& p, const ChunkWorkspace& ws,
                       cudaStream_t s) {
  allow_dynamic_smem(gdn_chunk_scan_kernel<kV>, ScanSmem<kV>::kBytes);
  gdn_chunk_scan_kernel<kV><<<p.num_seqs * p.num_v_heads * (kDim / kV), kScanThreads,
                              ScanSmem<kV>::kBytes, s>>>(p, ws);
  RELAY_CUDA_CHECK_LAUNCH("gdn_chunk_scan_kernel");
}

}  // namespace

void launch_causal_conv1d(const CausalConv1dParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.kernel_size >= 1 && p.kernel_size - 1 <= kMaxConvWidth && p.conv_dim > 0,
              "causal_conv1d: kernel_size ", p.kernel_size, " (1 to ", kMaxConvWidth + 1,
              ") and conv_dim ", p.conv_dim, " (positive)");
  if (p.num_seqs == 0 || p.num_tokens == 0) return;
  constexpr int kThreads = 128;
  const int tile = conv_tile_tokens(p);
  // Tiles on x: a batch may hold more than gridDim.y's 65535.
  const dim3 grid(ceil_div(p.num_tokens, tile), ceil_div(p.conv_dim, kThreads));
  launch_conv1d_of_width(p, grid, dim3(kThreads), tile, s);
}

bool gated_delta_rule_chunks(int key_dim, int value_dim) { return key_dim == kDim && value_dim == kDim; }

int gated_delta_rule_scan_columns(int num_seqs, int num_v_heads) {
  // One scan CTA per SM (its shared memory): the 32-column slices while their CTAs all fit.
  return int64_t{num_seqs} * num_v_heads * (kDim / 32) <= device_sm_count() ? 32 : 64;
}

size_t gated_delta_rule_workspace_bytes(int num_tokens, int num_k_heads, int num_v_heads) {
  size_t bytes = 0;
  carve_workspace(nullptr, num_tokens, num_k_heads, num_v_heads, &bytes);
  return bytes;
}

void launch_gated_delta_rule(const GatedDeltaRuleParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.num_k_heads > 0 && p.num_v_heads % p.num_k_heads == 0,
              "gated_delta_rule: num_v_heads ", p.num_v_heads,
              " must be a multiple of num_k_heads ", p.num_k_heads);
  RELAY_CHECK(p.key_dim > 0 && p.key_dim <= 128 && p.value_dim > 0,
              "gated_delta_rule: key_dim ", p.key_dim, " (1 to 128) and value_dim ", p.value_dim,
              " (positive)");
  if (p.num_seqs == 0 || p.num_tokens == 0) return;
  // Some sequence can reach kGatedDeltaChunkedMinTokens only when the batch has that many more
  // tokens than sequences, less one.
  if (p.chunk_workspace != nullptr && p.num_tokens - p.num_seqs + 1 >= kGatedDeltaChunkedMinTokens) {
    RELAY_CHECK(gated_delta_rule_chunks(p.key_dim, p.value_dim),
                "gated_delta_rule: the chunked form takes key_dim and value_dim ", kDim, ", not ",
                p.key_dim, " and ", p.value_dim);
    const ChunkWorkspace ws =
        carve_workspace(p.chunk_workspace, p.num_tokens, p.num_k_heads, p.num_v_heads, nullptr);
    allow_dynamic_smem(gdn_chunk_prepare_kernel, kPrepareBytes);
    // Chunks: at most one partial one per sequence besides num_tokens / kChunk full ones.
    const dim3 chunks(static_cast<unsigned>(ceil_div(p.num_tokens, kChunk) + p.num_seqs), p.num_v_heads);
    gdn_chunk_prepare_kernel<<<chunks, kChunkThreads, kPrepareBytes, s>>>(p, ws);
    RELAY_CUDA_CHECK_LAUNCH("gdn_chunk_prepare_kernel");
    const int columns = gated_delta_rule_scan_columns(p.num_seqs, p.num_v_heads);
    if (columns == 32) {
      launch_chunk_scan<32>(p, ws, s);
    } else {
      RELAY_CHECK(columns == 64, "gated_delta_rule: no chunk scan of ", columns, " columns");
      launch_chunk_scan<64>(p, ws, s);
    }
  }
  const dim3 ctas(static_cast<unsigned>(int64_t{p.num_seqs} * p.num_v_heads *
                                         ceil_div(p.value_dim, kWalkColumns)));
  auto walk = [&](auto kernel) {
    launch_dependent("gated_delta_rule_kernel", kernel, ctas, dim3(kWalkThreads), 0, s, p);
  };
  if (p.key_dim <= 32) {
    walk(gated_delta_rule_kernel<32>);
  } else if (p.key_dim <= 64) {
    walk(gated_delta_rule_kernel<64>);
  } else {
    walk(gated_delta_rule_kernel<128>);
  }
}

void launch_gated_rms_norm(const GatedRmsNormParams<bf16>& p, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  if (rows == 0) return;
  constexpr int kWarps = 8;
  const bool aligned = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.gate) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.weight) % 16 == 0 && p.gate_stride % 8 == 0;
  auto vec = [&](auto kernel) {  // head_dim / 8 lanes a row
    launch_dependent("gated_rms_norm_vec_kernel", kernel,
                     dim3(static_cast<unsigned>(ceil_div(rows * (p.head_dim / 8), kWarps * 32))),
                     dim3(kWarps * 32), 0, s, p);
  };
  if (aligned && p.head_dim == 64) return vec(gated_rms_norm_vec_kernel<8>);
  if (aligned && p.head_dim == 128) return vec(gated_rms_norm_vec_kernel<16>);
  if (aligned && p.head_dim == 256) return vec(gated_rms_norm_vec_kernel<32>);
  launch_dependent("gated_rms_norm_kernel", gated_rms_norm_kernel,
                   dim3(static_cast<unsigned>(ceil_div(rows, kWarps))), dim3(kWarps * 32), 0, s, p);
}

}  // namespace relay::kernels

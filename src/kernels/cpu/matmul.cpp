// CPU matmuls: out = x @ w^T for the linear layers, the LM head and the MoE experts' grouped GEMMs.
//
// This is where the CPU backend spends its time. The output is cut into tiles of kTileRows rows of x
// by kTileCols rows of w; tiles are the unit of parallel work. Inside a tile a register-blocked
// micro-kernel computes kMr x kNr dot products at once with 8-lane accumulators (simd.h), so each
// loaded x vector is reused kNr times and each w vector kMr times; the w rows of a column block are
// reused for every row block of the tile while they sit in L1. Decode (m = 1) is a matrix-vector
// product bound by reading w: the tile split over n keeps every core streaming its own slice. Weights
// may be fp32 or bf16 bits (the LM head of a bf16 checkpoint), widened exactly in registers.
//
// NOTE: the tile loop is compiled twice through target_clones — for x86-64-v3 (AVX2 + FMA) and the
// baseline — and picked at load time from the CPU's features, so one binary is fast on modern CPUs
// and still runs on any x86-64. This file alone is built with -ffp-contract=fast so the AVX2 clone
// fuses multiply-adds (see src/CMakeLists.txt); per-lane summation order is unchanged.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/simd.h"
#include "kernels/ops.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RELAY_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define RELAY_CPU_CLONES
#endif

namespace relay::kernels {

namespace {

using cpu::hsum8;
using cpu::load8;
using cpu::V8;

constexpr int kMr = 4;
constexpr int kNr = 3;
constexpr int kTileRows = 64;
constexpr int kTileCols = 48;

// Eight weights widened to fp32: a plain load, or bf16 bits shifted into the high half (exact).
inline V8 load_w8(const float* p) { return load8(p); }
inline V8 load_w8(const Bf16Bits* p) {
  typedef uint16_t U16x8 __attribute__((vector_size(16)));
  typedef uint32_t U32x8 __attribute__((vector_size(32)));
  U16x8 h;
  std::memcpy(&h, p, sizeof h);
  U32x8 wide = __builtin_convertvector(h, U32x8) << 16;
  V8 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}
inline float widen(float v) { return v; }
inline float widen(Bf16Bits v) {
  uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One output problem: x [m, k] (row stride ldx), w [n, k], out [m, n] (row stride ldo).
template <typename W>
struct Gemm {
  const float* x;
  int64_t ldx;
  const W* w;
  const float* bias;
  float* out;
  int64_t ldo;
  int m, n, k;
};

template <int MR, int NR, typename W>
[[gnu::always_inline]] inline void micro_kernel(const Gemm<W>& g, int i0, int j0) {
  V8 acc[MR][NR] = {};
  const float* xr[MR];
  const W* wr[NR];
  for (int i = 0; i < MR; ++i) xr[i] = g.x + (i0 + i) * g.ldx;
  for (int j = 0; j < NR; ++j) wr[j] = g.w + static_cast<int64_t>(j0 + j) * g.k;
  int kk = 0;
  for (; kk + 8 <= g.k; kk += 8) {
    V8 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_w8(wr[j] + kk);
    for (int i = 0; i < MR; ++i) {
      V8 xv = load8(xr[i] + kk);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hsum8(acc[i][j]);
      // std::fma: the tail rounds the same way in every clone and weight type (contraction of a
      // plain multiply-add is up to the compiler, per instantiation).
      for (int t = kk; t < g.k; ++t) s = std::fma(xr[i][t], widen(wr[j][t]), s);
      if (g.bias != nullptr) s += g.bias[j0 + j];
      g.out[(i0 + i) * g.ldo + j0 + j] = s;
    }
  }
}

template <int MR, typename W>
[[gnu::always_inline]] inline void micro_row_block(const Gemm<W>& g, int i0, int j0, int nr) {
  switch (nr) {
    case 3: micro_kernel<MR, 3>(g, i0, j0); break;
    case 2: micro_kernel<MR, 2>(g, i0, j0); break;
    default: micro_kernel<MR, 1>(g, i0, j0); break;
  }
}

// Computes the tile rows [i0, i1) x columns [j0, j1) of g (one clone set per weight type; target
// clones cannot be templates).
template <typename W>
[[gnu::always_inline]] inline void gemm_tile_body(const Gemm<W>& g, int i0, int i1, int j0, int j1) {
  for (int j = j0; j < j1; j += kNr) {
    int nr = std::min(kNr, j1 - j);
    int i = i0;
    for (; i + kMr <= i1; i += kMr) micro_row_block<kMr>(g, i, j, nr);
    switch (i1 - i) {
      case 3: micro_row_block<3>(g, i, j, nr); break;
      case 2: micro_row_block<2>(g, i, j, nr); break;
      case 1: micro_row_block<1>(g, i, j, nr); break;
      default: break;
    }
  }
}

RELAY_CPU_CLONES void gemm_tile(const Gemm<float>& g, int i0, int i1, int j0, int j1) {
  gemm_tile_body(g, i0, i1, j0, j1);
}
RELAY_CPU_CLONES void gemm_tile(const Gemm<Bf16Bits>& g, int i0, int i1, int j0, int j1) {
  gemm_tile_body(g, i0, i1, j0, j1);
}

// Tiles of one problem, enumerated row-block-major so neighbouring tasks share x rows.
struct TileGrid {
  int row_tiles, col_tiles;
  int64_t count() const { return static_cast<int64_t>(row_tiles) * col_tiles; }
};

template <typename W>
TileGrid tile_grid(const Gemm<W>& g) {
  return {(g.m + kTileRows - 1) / kTileRows, (g.n + kTileCols - 1) / kTileCols};
}

template <typename W>
void run_tile(const Gemm<W>& g, const TileGrid& grid, int64_t tile) {
  int rt = static_cast<int>(tile / grid.col_tiles);
  int ct = static_cast<int>(tile % grid.col_tiles);
  int i0 = rt * kTileRows, j0 = ct * kTileCols;
  gemm_tile(g, i0, std::min(g.m, i0 + kTileRows), j0, std::min(g.n, j0 + kTileCols));
}

// Tiles per task: at least ~256k multiply-adds (tens of microseconds), so waking a worker pays off
// and a decode step's small projections stay on the calling thread; the LM head still splits.
template <typename W>
int64_t tile_grain(const Gemm<W>& g) {
  int64_t tile_macs = static_cast<int64_t>(std::min(g.m, kTileRows)) * kTileCols * g.k;
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, tile_macs));
}

template <typename W>
void run_gemm(const Gemm<W>& g, ThreadPool& pool) {
  if (g.m == 0 || g.n == 0) return;
  TileGrid grid = tile_grid(g);
  pool.parallel_for(grid.count(), tile_grain(g), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) run_tile(g, grid, t);
  });
}

}  // namespace

void launch_matmul(const MatmulParams<float>& p, ThreadPool& pool) {
  run_gemm(Gemm<float>{p.x, p.k, p.w, p.bias, p.out, p.n, p.m, p.n, p.k}, pool);
}

namespace {
template <typename W>
void lm_head(const LmHeadParams<float, W>& p, ThreadPool& pool) {
  // Gathering the sampled rows first lets the GEMM see them as one contiguous x.
  thread_local std::vector<float> gathered;
  gathered.resize(static_cast<size_t>(p.num_rows) * p.hidden);
  for (int r = 0; r < p.num_rows; ++r) {
    std::copy_n(p.x + static_cast<int64_t>(p.rows[r]) * p.hidden, p.hidden,
                gathered.data() + static_cast<int64_t>(r) * p.hidden);
  }
  run_gemm(Gemm<W>{gathered.data(), p.hidden, p.w, nullptr, p.logits, p.vocab_size, p.num_rows, p.vocab_size,
                   p.hidden},
           pool);
}
}  // namespace

void launch_lm_head(const LmHeadParams<float>& p, ThreadPool& pool) { lm_head(p, pool); }
void launch_lm_head(const LmHeadParams<float, Bf16Bits>& p, ThreadPool& pool) { lm_head(p, pool); }

void launch_moe_grouped_matmul(const MoeGroupedMatmulParams<float>& p, ThreadPool& pool) {
  if (p.permuted_index != nullptr) {
    // Gathered: the permuted rows first (what moe_permute's copy would have written), then as usual.
    RELAY_CHECK(p.top_k > 0 && p.num_rows % p.top_k == 0, "moe_grouped_matmul: gathered rows need top_k (",
                p.top_k, ") dividing num_rows (", p.num_rows, ")");
    thread_local std::vector<float> gathered;
    gathered.resize(static_cast<size_t>(p.num_rows) * p.k);
    for (int i = 0; i < p.num_rows; ++i) {
      const int32_t r = p.permuted_index[i];
      RELAY_CHECK(r >= 0 && r < p.num_rows, "moe_grouped_matmul: permuted_index[", i, "] = ", r, " outside ",
                  p.num_rows, " rows");
      std::copy_n(p.x + static_cast<int64_t>(i / p.top_k) * p.k, p.k, gathered.data() + static_cast<int64_t>(r) * p.k);
    }
    MoeGroupedMatmulParams<float> q = p;
    q.x = gathered.data();
    q.permuted_index = nullptr;
    launch_moe_grouped_matmul(q, pool);
    return;
  }
  if (p.swiglu) {
    // The products, then the SwiGLU op itself: the fused form means exactly the two ops in turn.
    RELAY_CHECK(p.n % 2 == 0, "moe_grouped_matmul: swiglu needs an even n (gate | up), got ", p.n);
    thread_local std::vector<float> gate_up;
    gate_up.resize(static_cast<size_t>(p.num_rows) * p.n);
    MoeGroupedMatmulParams<float> q = p;
    q.out = gate_up.data();
    q.swiglu = false;
    launch_moe_grouped_matmul(q, pool);
    SwigluParams<float> sp;
    sp.gate_up = gate_up.data();
    sp.out = p.out;
    sp.num_rows = p.num_experts > 0 ? p.expert_offsets[p.num_experts] : 0;  // rows past the experts': never computed
    sp.width = p.n / 2;
    launch_swiglu(sp, pool);
    return;
  }
  // One task list across all experts, so a decode step with a handful of rows per expert still
  // keeps every thread busy instead of running one small parallel_for per expert.
  std::vector<Gemm<float>> gemms;
  std::vector<TileGrid> grids;
  std::vector<int64_t> first_tile{0};
  for (int e = 0; e < p.num_experts; ++e) {
    int begin = p.expert_offsets[e], end = p.expert_offsets[e + 1];
    if (begin == end) continue;
    Gemm<float> g{p.x + static_cast<int64_t>(begin) * p.k, p.k, p.w + static_cast<int64_t>(e) * p.n * p.k,
           nullptr, p.out + static_cast<int64_t>(begin) * p.n, p.n, end - begin, p.n, p.k};
    gemms.push_back(g);
    grids.push_back(tile_grid(g));
    first_tile.push_back(first_tile.back() + grids.back().count());
  }
  if (gemms.empty()) return;
  int64_t grain = tile_grain(gemms.front());
  pool.parallel_for(first_tile.back(), grain, [&](int64_t begin, int64_t end) {
    size_t e = std::upper_bound(first_tile.begin(), first_tile.end(), begin) - first_tile.begin() - 1;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= first_tile[e + 1]) ++e;
      run_tile(gemms[e], grids[e], t - first_tile[e]);
    }
  });
}

}  // namespace relay::kernels

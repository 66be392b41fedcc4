// MoE routing on the GPU: router softmax + top-k, the stable permutation of (token, k) rows by
// expert, and the weighted un-permute/combine.
//
// Router: one warp per token, experts spread over lanes; softmax in fp32 and k rounds of a warp
// arg-max (ties to the lower expert id, as the CPU reference and torch.topk).
// Permute: one CTA per expert scans the top-k ids twice — counting the rows of lower experts (its
// offset) and its own per warp segment, then ranking its own rows in (token, k) order — so the
// result equals the CPU's stable counting sort exactly and needs no global atomics or second launch
// for the offsets; a decode step's few rows are ranked by one CTA instead. A second kernel copies
// each token's row to its top_k places. Both read only device data, so a decode step that routes
// on the GPU can be captured in a graph.
//
// LiveRows bounds (ops.h): every kernel builds the bound's LiveRowMap once per CTA in shared memory
// and walks live rows only. The index kernel's warps split the live routed rows, not the capacity,
// so a DP + EP receive buffer of 2 x 16384 slots holding a few tokens costs a few steps per warp;
// the row copy and the combine take a capped grid that strides over the live tokens. The combine
// can take the next RMSNorm with it (one CTA per token then).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kMaxExpertsPerLane = 16;  // 512 experts
constexpr int kPermuteThreads = 1024;

// One route of a token, held by lane k < top_k + shared_expert_parts of the warp that routed it.
struct Route {
  int32_t id;
  float weight;
};

// Softmax + top-k of one token's logits (num_experts, then the shared expert's gate logit when it
// has parts) by the calling warp.
__device__ __forceinline__ Route route_token(const bf16* logits, int num_experts, int top_k,
                                             bool renormalize, int shared_expert_parts) {
  const int lane = threadIdx.x & 31;
  auto logit = [&](int e) { return __bfloat162float(logits[e]); };
  float prob[kMaxExpertsPerLane];
  float max_logit = -INFINITY;
#pragma unroll
  for (int j = 0; j < kMaxExpertsPerLane; ++j) {
    const int e = lane + 32 * j;
    prob[j] = e < num_experts ? logit(e) : -INFINITY;
    max_logit = fmaxf(max_logit, prob[j]);
  }
  max_logit = warp_max(max_logit);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxExpertsPerLane; ++j) {
    prob[j] = lane + 32 * j < num_experts ? expf(prob[j] - max_logit) : 0.0f;
    sum += prob[j];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < kMaxExpertsPerLane; ++j) prob[j] = lane + 32 * j < num_experts ? prob[j] / sum : -1.0f;
  float top_sum = 0.0f, chosen_prob = 0.0f;
  int chosen_id = 0;
  for (int k = 0; k < top_k; ++k) {
    float best = -1.0f;
    int best_id = INT32_MAX;
#pragma unroll
    for (int j = 0; j < kMaxExpertsPerLane; ++j) {
      if (prob[j] > best) {  // ascending ids within a lane: strict > keeps the lower id
        best = prob[j];
        best_id = lane + 32 * j;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, o);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (other > best || (other == best && other_id < best_id)) {
        best = other;
        best_id = other_id;
      }
    }
    if (best_id % 32 == lane) {
#pragma unroll
      for (int j = 0; j < kMaxExpertsPerLane; ++j) {
        if (j == best_id / 32) prob[j] = -1.0f;
      }
    }
    top_sum += best;
    if (lane == k) {
      chosen_prob = best;
      chosen_id = best_id;
    }
  }
  if (lane < top_k) return {chosen_id, renormalize ? chosen_prob / top_sum : chosen_prob};
  // The shared expert's parts (lanes past the routes get one too, unused).
  return {num_experts + lane - top_k, sigmoid_of(logit(num_experts))};
}

__global__ void router_topk_kernel(MoeRouterTopkParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;
  const int routes = p.top_k + p.shared_expert_parts;
  const int columns = p.num_experts + (p.shared_expert_parts > 0 ? 1 : 0);
  const Route r = route_token(p.logits + static_cast<int64_t>(t) * columns, p.num_experts,
                              p.top_k, p.renormalize, p.shared_expert_parts);
  if (lane < routes) {
    p.topk_ids[static_cast<int64_t>(t) * routes + lane] = r.id;
    p.topk_weights[static_cast<int64_t>(t) * routes + lane] = r.weight;
  }
}

// NOTE: each warp owns one contiguous segment of the (token, k) rows and each lane 4 consecutive
// rows of a 128-row step, so the ranking needs two sweeps and two CTA barriers in all; ranking
// 1024-row chunks in turn (a ballot, two barriers and a 32-warp sum per chunk) took 45 us at 4096
// tokens x top-8, more than copying the rows.
constexpr int kPermuteRowsPerLane = 4;
constexpr int kPermuteStep = 32 * kPermuteRowsPerLane;

// Grids of the kernels that stride over live tokens, when a bound is set (the count of live tokens
// is known only on the device): enough CTAs to fill an H200 several times over.
constexpr int kMaxLiveGridCtas = 2048;

// The routed row of live routed row v (its token's live index v / top_k): v itself unbounded.
__device__ __forceinline__ int live_routed_row(const LiveRowMap& live, bool bounded, int v,
                                               int top_k) {
  return bounded ? static_cast<int>(live.row(v / top_k)) * top_k + v % top_k : v;
}

// Thread 0 builds the CTA's map of the live rows; every thread returns after the barrier.
__device__ __forceinline__ void load_live_map(LiveRowMap& map, const LiveRows& live, int num_rows) {
  if (threadIdx.x == 0) map = live_row_map(live, num_rows);
  __syncthreads();
}

__global__ void __launch_bounds__(kPermuteThreads) permute_index_kernel(MoePermuteParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  constexpr int kWarps = kPermuteThreads / 32;
  __shared__ int warp_below[kWarps], warp_mine[kWarps];
  __shared__ LiveRowMap live;
  const int e = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool bounded = p.live_tokens.counts != nullptr;
  load_live_map(live, p.live_tokens, p.num_tokens);
  // Rows below are live routed rows (live_routed_row maps them to (t, k) rows).
  const int num_rows = live.total() * p.top_k;
  const int segment = (num_rows + kWarps * kPermuteStep - 1) / (kWarps * kPermuteStep) * kPermuteStep;
  const int seg_begin = warp * segment, seg_end = min(num_rows, seg_begin + segment);
  // Sweep 1: rows of lower experts (this expert's offset) and of this expert, per warp.
  int below = 0, mine = 0;
  for (int base = seg_begin; base < seg_end; base += kPermuteStep) {
#pragma unroll
    for (int j = 0; j < kPermuteRowsPerLane; ++j) {
      const int r = base + lane * kPermuteRowsPerLane + j;
      if (r < seg_end) {
        const int id = p.topk_ids[live_routed_row(live, bounded, r, p.top_k)];
        below += id < e;
        mine += id == e;
      }
    }
  }
  below = __reduce_add_sync(0xffffffffu, below);
  mine = __reduce_add_sync(0xffffffffu, mine);
  if (lane == 0) {
    warp_below[warp] = below;
    warp_mine[warp] = mine;
  }
  __syncthreads();
  int offset = 0, rank = 0;
  for (int w = 0; w < kWarps; ++w) {
    offset += warp_below[w];
    rank += w < warp ? warp_mine[w] : 0;
  }
  if (threadIdx.x == 0) {
    p.expert_offsets[e] = offset;
    if (e == p.num_experts - 1) p.expert_offsets[p.num_experts] = num_rows;
  }
  if (mine == 0) return;
  // Sweep 2: this expert's rows in (token, k) order get consecutive places from offset + rank.
  rank += offset;
  for (int base = seg_begin; base < seg_end; base += kPermuteStep) {
    bool hit[kPermuteRowsPerLane];
    int count = 0;
#pragma unroll
    for (int j = 0; j < kPermuteRowsPerLane; ++j) {
      const int r = base + lane * kPermuteRowsPerLane + j;
      hit[j] = r < seg_end && p.topk_ids[live_routed_row(live, bounded, r, p.top_k)] == e;
      count += hit[j];
    }
    int inclusive = count;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += v;
    }
    int place = rank + inclusive - count;
#pragma unroll
    for (int j = 0; j < kPermuteRowsPerLane; ++j) {
      // The row is mapped again rather than kept: at most one in num_experts rows is a hit, and
      // four more live registers made the kernel spill at 1024 threads.
      if (hit[j])
        p.permuted_index[live_routed_row(live, bounded, base + lane * kPermuteRowsPerLane + j,
                                         p.top_k)] = place++;
    }
    rank += __shfl_sync(0xffffffffu, inclusive, 31);
  }
}

// The index of a decode step's few rows (at most kOneCtaPermuteRows, every row live) in one CTA:
// the multi-CTA kernel above launches a 1024-thread CTA per expert (257 for Qwen3.5) to rank a
// batch-1 step's 9 rows. Each expert's offset counts the rows of lower experts and each row's
// place adds the earlier rows of its own expert: the same stable counting sort, in O(rows^2 +
// experts x rows) compares spread over the CTA.
constexpr int kOneCtaPermuteRows = 256;

__global__ void __launch_bounds__(kPermuteThreads)
    permute_index_one_cta_kernel(MoePermuteParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  __shared__ int32_t ids[kOneCtaPermuteRows];
  const int rows = p.num_tokens * p.top_k;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) ids[r] = p.topk_ids[r];
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    int below = 0;
    for (int r = 0; r < rows; ++r) below += ids[r] < e;
    p.expert_offsets[e] = below;
  }
  if (threadIdx.x == 0) p.expert_offsets[p.num_experts] = rows;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const int id = ids[r];
    int place = 0;
    for (int q = 0; q < rows; ++q) place += ids[q] < id || (q < r && ids[q] == id);
    p.permuted_index[r] = place;
  }
}

// One warp per token: the token's row is read once and written to its top_k permuted rows. A CTA
// holds kPermuteRowWarps tokens, so a launch is a few thousand CTAs rather than one tiny CTA per
// routed row (which left the copy at a third of the device's bandwidth); every lane issues all its
// loads before its stores. Unbounded, each warp copies one token; with live_tokens the warps stride
// over the live tokens. Permuted rows outside copied_rows are skipped (the whole warp agrees).
constexpr int kPermuteRowWarps = 8;
constexpr int kPermuteMaxTopK = 32;

__global__ void __launch_bounds__(kPermuteRowWarps * 32) permute_rows_kernel(MoePermuteParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  __shared__ LiveRowMap live;
  load_live_map(live, p.live_tokens, p.num_tokens);
  const int lane = threadIdx.x & 31;
  Bf16x8* out = reinterpret_cast<Bf16x8*>(p.permuted_x);
  const int vecs = p.hidden / 8;
  for (int v_tok = blockIdx.x * kPermuteRowWarps + (threadIdx.x >> 5); v_tok < live.total();
       v_tok += gridDim.x * kPermuteRowWarps) {
    const int64_t t = live.row(v_tok);
    const int dest = lane < p.top_k ? copy_destination(p.permuted_index, p.copied_rows, t, p.top_k, lane) : -1;
    const Bf16x8* src = reinterpret_cast<const Bf16x8*>(p.x + t * p.hidden);
    constexpr int kUnroll = 4;
    for (int base = 0; base < vecs; base += 32 * kUnroll) {
      Bf16x8 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < vecs) v[u] = src[i];
      }
      for (int k = 0; k < p.top_k; ++k) {
        const int64_t row = __shfl_sync(0xffffffffu, dest, k);
        if (row < 0) continue;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int i = base + u * 32 + lane;
          if (i < vecs) out[row * vecs + i] = v[u];
        }
      }
    }
  }
}

// One CTA per token and slice of the hidden vector (gridDim.y slices: several when the tokens are
// few, so a decode step's few tokens still spread over SMs); with live_tokens the CTAs stride over
// the live tokens. The token's weights and rows go to shared memory first, then each thread loads
// its vector of all of them at once before it sums them: the sum is latency-bound at decode's few
// tokens, and loads that waited on each other (weight, index, row, per expert) cost a round trip
// each. The terms are added in k order as before.
constexpr int kCombineThreads = 128;
constexpr int kCombineBatch = 8;  // expert rows loaded at once

// The weighted sum of a token's expert rows at vector i (8 elements), in k order; weight and
// row_of in shared memory.
__device__ __forceinline__ void combine_vector(const MoeUnpermuteCombineParams<bf16>& p,
                                               const float* weight, const int64_t* row_of, int i,
                                               float (&acc)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  for (int k0 = 0; k0 < p.top_k; k0 += kCombineBatch) {
    Bf16x8 v[kCombineBatch];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const int k = k0 + b;
      if (k < p.top_k && row_of[k] >= 0)
        v[b] = reinterpret_cast<const Bf16x8*>(p.expert_out + row_of[k] * p.hidden)[i];
    }
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const int k = k0 + b;
      if (k >= p.top_k || row_of[k] < 0) continue;
      float f[8];
      bf16x8_to_f32(v[b], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += f[j] * weight[k];
    }
  }
}

// Vector i of token t's combined row as the combine stores it (bf16), with the extra term added
// where there is one (rounded again, as the sigmoid gate's accumulate stores it; extra_scale is
// sigmoid of the token's extra gate). The extra vector loads with the expert rows, not after
// their sum: one round trip to memory fewer.
__device__ __forceinline__ Bf16x8 combined_vector(const MoeUnpermuteCombineParams<bf16>& p,
                                                  const float* weight, const int64_t* row_of,
                                                  int64_t t, int i, float extra_scale) {
  Bf16x8 extra{};
  if (p.extra != nullptr) extra = reinterpret_cast<const Bf16x8*>(p.extra + t * p.hidden)[i];
  float acc[8];
  combine_vector(p, weight, row_of, i, acc);
  Bf16x8 mixed = f32_to_bf16x8(acc);
  if (p.extra != nullptr) {
    float x[8];
    bf16x8_to_f32(mixed, acc);
    bf16x8_to_f32(extra, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = add_gated(acc[e], x[e], extra_scale);
    mixed = f32_to_bf16x8(acc);
  }
  return mixed;
}

__device__ __forceinline__ float extra_scale_of(const MoeUnpermuteCombineParams<bf16>& p, int64_t t) {
  return p.extra != nullptr ? sigmoid_of(__bfloat162float(p.extra_gate[t])) : 0.0f;
}

// Token t's weights and expert rows into shared memory (thread k < top_k loads route k).
__device__ __forceinline__ void load_token_routes(const MoeUnpermuteCombineParams<bf16>& p,
                                                  int64_t t, float* weight, int64_t* row_of) {
  if (threadIdx.x < p.top_k) {
    const float w = p.topk_weights[t * p.top_k + threadIdx.x];
    weight[threadIdx.x] = w;
    row_of[threadIdx.x] = w == 0.0f ? -1 : p.permuted_index[t * p.top_k + threadIdx.x];
  }
}

__global__ void __launch_bounds__(kCombineThreads) unpermute_combine_kernel(MoeUnpermuteCombineParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  __shared__ LiveRowMap live;
  __shared__ float weight[kPermuteMaxTopK];
  __shared__ int64_t row_of[kPermuteMaxTopK];  // -1: an absent expert's row, never computed (ops.h)
  load_live_map(live, p.live_tokens, p.num_tokens);
  const int num_vecs = p.hidden / 8;
  for (int v_tok = blockIdx.x; v_tok < live.total(); v_tok += gridDim.x) {
    const int64_t t = live.row(v_tok);
    __syncthreads();  // the previous token's weights are read
    load_token_routes(p, t, weight, row_of);
    __syncthreads();
    const float extra_scale = extra_scale_of(p, t);
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < num_vecs; i += blockDim.x * gridDim.y) {
      reinterpret_cast<Bf16x8*>(p.out + t * p.hidden)[i] =
          combined_vector(p, weight, row_of, t, i, extra_scale);
    }
  }
}

// The combine with the next RMSNorm fused: one CTA per token holds its combined row in registers
// (as rms_norm_kernel holds its input), adds it to the residual and normalises it: out, residual
// and normed get the bits the two kernels store.
constexpr int kCombineNormThreads = 256;
constexpr int kCombineNormVecs = 4;  // per thread: hidden up to 8192

__global__ void __launch_bounds__(kCombineNormThreads)
    unpermute_combine_norm_kernel(MoeUnpermuteCombineParams<bf16> p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  __shared__ float weight[kPermuteMaxTopK];
  __shared__ int64_t row_of[kPermuteMaxTopK];
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  load_token_routes(p, t, weight, row_of);
  __syncthreads();
  const int num_vecs = p.hidden / 8;
  const float extra_scale = extra_scale_of(p, t);
  float v[kCombineNormVecs][8];
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kCombineNormVecs; ++j) {
    const int i = threadIdx.x + j * kCombineNormThreads;
    if (i < num_vecs) {
      // The residual loads with the expert rows too: after the store to out it would wait for
      // them (the two may alias, as far as the compiler knows).
      Bf16x8* residual = reinterpret_cast<Bf16x8*>(p.residual + t * p.hidden) + i;
      const Bf16x8 old_residual = *residual;
      const Bf16x8 mixed = combined_vector(p, weight, row_of, t, i, extra_scale);
      reinterpret_cast<Bf16x8*>(p.out + t * p.hidden)[i] = mixed;
      bf16x8_to_f32(mixed, v[j]);
      add_to_residual(v[j], old_residual, residual);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum_sq += v[j][e] * v[j][e];
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / p.hidden + p.eps);
#pragma unroll
  for (int j = 0; j < kCombineNormVecs; ++j) {
    const int i = threadIdx.x + j * kCombineNormThreads;
    if (i < num_vecs) {
      reinterpret_cast<Bf16x8*>(p.normed + t * p.hidden)[i] =
          rms_scaled(v[j], reinterpret_cast<const Bf16x8*>(p.norm_weight)[i], inv_rms);
    }
  }
}

__global__ void localize_experts_kernel(MoeLocalizeExpertsParams p) {
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.num_rows) return;
  const int32_t local = p.topk_ids[r] - p.expert_begin;
  const bool here = local >= 0 && local < p.num_local_experts;
  p.topk_ids[r] = here ? local : p.num_local_experts;
  if (!here) p.topk_weights[r] = 0.0f;
}

}  // namespace

void launch_moe_localize_experts(const MoeLocalizeExpertsParams& p, cudaStream_t s) {
  RELAY_CHECK(p.num_rows >= 0 && p.num_local_experts > 0 && p.expert_begin >= 0,
              "moe_localize_experts: rows ", p.num_rows, ", experts [", p.expert_begin, ", +",
              p.num_local_experts, ")");
  if (p.num_rows == 0) return;
  launch_dependent("localize_experts_kernel", localize_experts_kernel, dim3(ceil_div(p.num_rows, 256)), dim3(256), 0, s,
                   p);
}

void launch_moe_router_topk(const MoeRouterTopkParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.num_experts <= 32 * kMaxExpertsPerLane && p.top_k >= 1 && p.shared_expert_parts >= 0 &&
                  p.top_k + p.shared_expert_parts <= kMaxRoutesPerToken && p.top_k <= p.num_experts,
              "moe_router_topk: ", p.num_experts, " experts, top_k ", p.top_k, " and ", p.shared_expert_parts,
              " shared expert parts (at most ", 32 * kMaxExpertsPerLane, " experts, at most ", kMaxRoutesPerToken,
              " routes a token)");
  if (p.num_tokens == 0) return;
  launch_dependent("router_topk_kernel", router_topk_kernel, dim3(ceil_div(p.num_tokens, 4)), dim3(128), 0, s, p);
}

// CTAs for `units` units of work, `per_cta` per CTA: all of them unbounded (one pass), capped with
// a bound (the kernels stride over the live units).
int live_grid(int64_t units, int per_cta, bool bounded) {
  const int ctas = ceil_div(units, per_cta);
  return bounded ? std::min(ctas, kMaxLiveGridCtas) : ctas;
}

void launch_moe_permute(const MoePermuteParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.hidden % 8 == 0, "moe_permute: hidden ", p.hidden, " must be a multiple of 8");
  RELAY_CHECK(p.top_k >= 1 && p.top_k <= kPermuteMaxTopK, "moe_permute: top_k ", p.top_k, " must be in [1, ",
              kPermuteMaxTopK, "]");
  RELAY_CHECK(live_rows_valid(p.live_tokens, p.num_tokens), "moe_permute: live_tokens.region_rows ",
              p.live_tokens.region_rows, " must be positive with at most ", kMaxLiveRegions,
              " regions over ", p.num_tokens, " tokens");
  RELAY_CHECK(live_rows_valid(p.copied_rows, int64_t{p.num_tokens} * p.top_k),
              "moe_permute: copied_rows.region_rows ", p.copied_rows.region_rows,
              " must be positive with at most ", kMaxLiveRegions, " regions over ",
              int64_t{p.num_tokens} * p.top_k, " rows");
  if (p.live_tokens.counts == nullptr && int64_t{p.num_tokens} * p.top_k <= kOneCtaPermuteRows) {
    launch_dependent("permute_index_one_cta_kernel", permute_index_one_cta_kernel, dim3(1),
                     dim3(kPermuteThreads), 0, s, p);
  } else {
    launch_dependent("permute_index_kernel", permute_index_kernel, dim3(p.num_experts),
                     dim3(kPermuteThreads), 0, s, p);
  }
  if (p.num_tokens == 0 || p.permuted_x == nullptr) return;
  const int blocks = live_grid(p.num_tokens, kPermuteRowWarps, p.live_tokens.counts != nullptr);
  launch_dependent("permute_rows_kernel", permute_rows_kernel, dim3(blocks), dim3(kPermuteRowWarps * 32), 0, s, p);
}

void launch_moe_unpermute_combine(const MoeUnpermuteCombineParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.hidden % 8 == 0, "moe_unpermute_combine: hidden ", p.hidden, " must be a multiple of 8");
  RELAY_CHECK(live_rows_valid(p.live_tokens, p.num_tokens),
              "moe_unpermute_combine: live_tokens.region_rows ", p.live_tokens.region_rows,
              " must be positive with at most ", kMaxLiveRegions, " regions over ", p.num_tokens,
              " tokens");
  RELAY_CHECK(p.top_k >= 1 && p.top_k <= kPermuteMaxTopK, "moe_unpermute_combine: top_k ", p.top_k,
              " must be in [1, ", kPermuteMaxTopK, "]");
  RELAY_CHECK(p.extra == nullptr || (p.extra_gate != nullptr && p.live_tokens.counts == nullptr),
              "moe_unpermute_combine: the extra term needs its gate and every token live");
  if (p.num_tokens == 0) return;
  if (p.norm_weight != nullptr) {
    RELAY_CHECK(p.live_tokens.counts == nullptr && p.residual != nullptr && p.normed != nullptr &&
                    p.hidden <= kCombineNormThreads * kCombineNormVecs * 8,
                "moe_unpermute_combine: the fused norm needs every token live, a residual, an "
                "output and hidden ", p.hidden, " at most ", kCombineNormThreads * kCombineNormVecs * 8);
    launch_dependent("unpermute_combine_norm_kernel", unpermute_combine_norm_kernel,
                     dim3(p.num_tokens), dim3(kCombineNormThreads), 0, s, p);
    return;
  }
  const int blocks = live_grid(p.num_tokens, 1, p.live_tokens.counts != nullptr);
  // Slices of the hidden vector: one vector per thread at a decode step's few tokens (at most 16
  // CTAs' worth), one slice when there are tokens enough to fill the GPU.
  const int slices = p.num_tokens >= 64 ? 1 : static_cast<int>(std::min<int64_t>(16, ceil_div(p.hidden / 8, kCombineThreads)));
  launch_dependent("unpermute_combine_kernel", unpermute_combine_kernel, dim3(blocks, slices),
                   dim3(kCombineThreads), 0, s, p);
}

}  // namespace relay::kernels

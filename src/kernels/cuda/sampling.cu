// GPU sampling: one 1024-thread CTA per row of fp32 logits (see ops_cuda.h for the semantics).
// Constrained rows (structured outputs, logit_bias) cost two more passes, a scored prompt row one.
//
// Every stage is a pass over the row with a block reduction; the row (600 KB at vocab 151936) stays
// in L2 between passes. Greedy rows cost two passes (max/arg-max, sum of exponentials); each
// requested top logprob one more; a filtered random draw about 100 (32-step bisections for top-k and
// top-p, then a chunked prefix scan for the draw), still far cheaper than copying logits to the host.
#include <cfloat>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kThreads = 1024;

// Monotone map float -> uint32 (larger float, larger key); -inf maps to the smallest finite key set.
__device__ __forceinline__ uint32_t ordered_key(float f) {
  const uint32_t bits = __float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

struct ValueId {
  float value;
  int id;
};
// Larger value first, lower id on ties.
__device__ __forceinline__ ValueId better(ValueId a, ValueId b) {
  return (b.value > a.value || (b.value == a.value && b.id < a.id)) ? b : a;
}

__device__ ValueId block_best(ValueId v, ValueId* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ValueId other{__shfl_xor_sync(0xffffffffu, v.value, o), __shfl_xor_sync(0xffffffffu, v.id, o)};
    v = better(v, other);
  }
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[lane];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ValueId other{__shfl_xor_sync(0xffffffffu, v.value, o), __shfl_xor_sync(0xffffffffu, v.id, o)};
    v = better(v, other);
  }
  return v;
}

// The largest key k with (sum over logits l with ordered_key(l) >= k and l >= floor of weight(l)) >= target.
template <typename Weight>
__device__ uint32_t bisect_threshold(const float* row, int vocab, float floor, uint32_t lo, uint32_t hi,
                                     float target, Weight weight, float* scratch) {
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float l = row[i];
      if (l >= floor && ordered_key(l) >= mid) sum += weight(l);
    }
    sum = block_sum(sum, scratch);
    if (sum >= target) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ float key_to_float(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? key & 0x7fffffffu : ~key);
}

__global__ void __launch_bounds__(kThreads) sample_kernel(SampleParams p) {
  __shared__ float scratch[32];
  __shared__ ValueId best_scratch[32];
  __shared__ int chosen;
  const int r = blockIdx.x;
  float* row = p.logits + static_cast<int64_t>(r) * p.vocab_size;
  const SampleRowParams sp = p.rows[r];

  ValueId best{-INFINITY, INT32_MAX};
  for (int i = threadIdx.x; i < p.vocab_size; i += kThreads) best = better(best, ValueId{row[i], i});
  best = block_best(best, best_scratch);
  const float max_logit = best.value;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < p.vocab_size; i += kThreads) sum += __expf(row[i] - max_logit);
  const float log_sum = max_logit + logf(block_sum(sum, scratch));

  // Top logprobs: repeated arg-max over what ranks strictly after the previous pick.
  ValueId prev{INFINITY, -1};
  for (int k = 0; k < p.max_logprobs; ++k) {
    ValueId cand{-INFINITY, INT32_MAX};
    for (int i = threadIdx.x; i < p.vocab_size; i += kThreads) {
      const float l = row[i];
      if (l < prev.value || (l == prev.value && i > prev.id)) cand = better(cand, ValueId{l, i});
    }
    cand = block_best(cand, best_scratch);
    if (threadIdx.x == 0) {
      p.top_ids[static_cast<int64_t>(r) * p.max_logprobs + k] = cand.id;
      p.top_logprobs[static_cast<int64_t>(r) * p.max_logprobs + k] = cand.value - log_sum;
    }
    prev = cand;
  }

  if (sp.score_token >= 0) {  // a prompt row: rank and logprob of the given token, raw logits
    const float l = row[sp.score_token];
    int above = 0;
    for (int i = threadIdx.x; i < p.vocab_size; i += kThreads) above += row[i] > l ? 1 : 0;
    above = static_cast<int>(block_sum(static_cast<float>(above), scratch));
    if (threadIdx.x == 0) {
      p.tokens[r] = sp.score_token;
      p.logprobs[r] = l - log_sum;
      p.ranks[r] = 1 + above;
    }
    return;
  }

  // The constraints, in place: the biased tokens' raw logits are kept for the logprob.
  const bool constrained = sp.mask_row >= 0 || sp.bias_count > 0;
  if (constrained) {
    __syncthreads();  // every raw read above is done
    for (int k = threadIdx.x; k < sp.bias_count; k += kThreads) {
      p.bias_raw[sp.bias_begin + k] = row[p.bias_tokens[sp.bias_begin + k]];
    }
    __syncthreads();
    for (int k = threadIdx.x; k < sp.bias_count; k += kThreads) {
      atomicAdd(&row[p.bias_tokens[sp.bias_begin + k]], p.bias_values[sp.bias_begin + k]);
    }
    __syncthreads();
    if (sp.mask_row >= 0) {
      const uint32_t* mask = p.allowed + static_cast<int64_t>(sp.mask_row) * p.mask_words;
      for (int i = threadIdx.x; i < p.vocab_size; i += kThreads) {
        if (!((mask[i >> 5] >> (i & 31)) & 1u)) row[i] = -INFINITY;
      }
    }
    __syncthreads();
    best = ValueId{-INFINITY, INT32_MAX};
    for (int i = threadIdx.x; i < p.vocab_size; i += kThreads) best = better(best, ValueId{row[i], i});
    best = block_best(best, best_scratch);
  }
  const float top_logit = best.value;  // of the constrained row

  int token = best.id;
  if (sp.temperature >= 1e-5f) {
    // Work in scaled logits l / T; the filters raise a floor below which tokens are masked.
    const float inv_t = 1.0f / sp.temperature;
    const float scaled_max = top_logit * inv_t;
    float floor = -FLT_MAX;
    if (sp.min_p > 0.0f) floor = fmaxf(floor, (scaled_max + logf(sp.min_p)) / inv_t);
    const uint32_t lo_key = ordered_key(-FLT_MAX), hi_key = ordered_key(top_logit);
    if (sp.top_k > 0 && sp.top_k < p.vocab_size) {
      auto one = [](float) { return 1.0f; };
      const uint32_t key = bisect_threshold(row, p.vocab_size, floor, lo_key, hi_key, static_cast<float>(sp.top_k),
                                            one, scratch);
      floor = fmaxf(floor, key_to_float(key));
    }
    auto mass = [&](float l) { return __expf((l - top_logit) * inv_t); };
    if (sp.top_p < 1.0f) {
      float kept = 0.0f;
      for (int i = threadIdx.x; i < p.vocab_size; i += kThreads) kept += row[i] >= floor ? mass(row[i]) : 0.0f;
      kept = block_sum(kept, scratch);
      const uint32_t key = bisect_threshold(row, p.vocab_size, floor, lo_key, hi_key, sp.top_p * kept, mass, scratch);
      floor = fmaxf(floor, key_to_float(key));
    }
    float total = 0.0f;
    for (int i = threadIdx.x; i < p.vocab_size; i += kThreads) total += row[i] >= floor ? mass(row[i]) : 0.0f;
    total = block_sum(total, scratch);
    const float target = static_cast<float>(sp.uniform) * total;
    // Inverse CDF in token order: chunks of kThreads ids, a block prefix sum per chunk.
    if (threadIdx.x == 0) chosen = -1;
    float running = 0.0f;
    int last_kept = best.id;
    for (int base = 0; base < p.vocab_size; base += kThreads) {
      const int i = base + threadIdx.x;
      const float w = (i < p.vocab_size && row[i] >= floor) ? mass(row[i]) : 0.0f;
      float inclusive = w;
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const float v = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += v;
      }
      __syncthreads();
      if (lane == 31) scratch[warp] = inclusive;
      __syncthreads();
      float warp_prefix = 0.0f, chunk_total = 0.0f;
      for (int wi = 0; wi < kThreads / 32; ++wi) {
        warp_prefix += wi < warp ? scratch[wi] : 0.0f;
        chunk_total += scratch[wi];
      }
      const bool hit = w > 0.0f && running + warp_prefix + inclusive > target;
      if (hit) atomicMin(reinterpret_cast<unsigned*>(&chosen), static_cast<unsigned>(i));
      if (w > 0.0f) last_kept = max(last_kept, i);  // per thread; combined below if nothing hits
      running += chunk_total;
      __syncthreads();
      if (chosen >= 0) break;
    }
    if (chosen < 0) {  // target within rounding of the total: the last kept token
      const ValueId last = block_best(ValueId{static_cast<float>(last_kept), 0}, best_scratch);
      if (threadIdx.x == 0) chosen = static_cast<int>(last.value);
      __syncthreads();
    }
    token = chosen;
  }
  if (threadIdx.x == 0) {
    float raw = row[token];  // unchanged unless biased
    for (int k = 0; k < sp.bias_count; ++k) {
      if (p.bias_tokens[sp.bias_begin + k] == token) {
        raw = p.bias_raw[sp.bias_begin + k];
        break;
      }
    }
    p.tokens[r] = token;
    p.logprobs[r] = raw - log_sum;
  }
}

}  // namespace

void launch_sample(const SampleParams& p, cudaStream_t s) {
  RELAY_CHECK(p.max_logprobs == 0 || (p.top_ids && p.top_logprobs), "sample: max_logprobs ", p.max_logprobs,
              " needs top_ids and top_logprobs");
  RELAY_CHECK(p.mask_words == 0 || (p.allowed && p.mask_words == (p.vocab_size + 31) / 32),
              "sample: bitmasks of ", p.mask_words, " words for a vocabulary of ", p.vocab_size);
  if (p.num_rows == 0) return;
  sample_kernel<<<p.num_rows, kThreads, 0, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("sample_kernel");
}

}  // namespace relay::kernels

// CPU reference for the MoE routing ops: router softmax + top-k, permute by expert, combine.
//
// The router matches HF's Qwen3MoeTopKRouter: softmax over all experts in fp32, top-k by
// probability (ties to the lower expert id), then optional renormalisation. Permutation is a stable
// counting sort by expert, so rows inside an expert stay in (token, k) order and the result is
// deterministic; the GPU version computes the same offsets. The combine sums the k weighted expert
// outputs of a token in k order (then the next RMSNorm, where fused). With LiveRows bounds (ops.h)
// the permute sorts the live tokens' rows only and each op touches only live rows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/ops.h"

namespace relay::kernels {

void launch_moe_router_topk(const MoeRouterTopkParams<float>& p, ThreadPool& pool) {
  const int columns = p.num_experts + (p.shared_expert_parts > 0 ? 1 : 0);
  const int routes = p.top_k + p.shared_expert_parts;
  pool.parallel_for(p.num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(p.num_experts);
    std::vector<int32_t> order(p.num_experts);
    for (int64_t t = begin; t < end; ++t) {
      const float* logits = p.logits + t * columns;
      float max_logit = *std::max_element(logits, logits + p.num_experts);
      float sum = 0.0f;
      for (int e = 0; e < p.num_experts; ++e) {
        probs[e] = std::exp(logits[e] - max_logit);
        sum += probs[e];
      }
      for (int e = 0; e < p.num_experts; ++e) probs[e] /= sum;
      for (int e = 0; e < p.num_experts; ++e) order[e] = e;
      std::partial_sort(order.begin(), order.begin() + p.top_k, order.end(), [&](int32_t a, int32_t b) {
        return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
      });
      float top_sum = 0.0f;
      for (int k = 0; k < p.top_k; ++k) top_sum += probs[order[k]];
      int32_t* ids = p.topk_ids + t * routes;
      float* weights = p.topk_weights + t * routes;
      for (int k = 0; k < p.top_k; ++k) {
        ids[k] = order[k];
        weights[k] = p.renormalize ? probs[order[k]] / top_sum : probs[order[k]];
      }
      if (p.shared_expert_parts > 0) {
        const float gate = 1.0f / (1.0f + std::exp(-logits[p.num_experts]));
        for (int i = 0; i < p.shared_expert_parts; ++i) {
          ids[p.top_k + i] = p.num_experts + i;
          weights[p.top_k + i] = gate;
        }
      }
    }
  });
}

void launch_moe_permute(const MoePermuteParams<float>& p, ThreadPool& pool) {
  const int64_t capacity_rows = static_cast<int64_t>(p.num_tokens) * p.top_k;
  RELAY_CHECK(live_rows_valid(p.live_tokens, p.num_tokens), "moe_permute: live_tokens.region_rows ",
              p.live_tokens.region_rows, " must be positive with at most ", kMaxLiveRegions,
              " regions over ", p.num_tokens, " tokens");
  RELAY_CHECK(live_rows_valid(p.copied_rows, capacity_rows),
              "moe_permute: copied_rows.region_rows ", p.copied_rows.region_rows,
              " must be positive with at most ", kMaxLiveRegions, " regions over ", capacity_rows,
              " rows");
  // The routed rows of the live tokens, in (t, k) order: the rows the counting sort sees.
  const LiveRowMap live = live_row_map(p.live_tokens, p.num_tokens);
  const int64_t num_rows = static_cast<int64_t>(live.total()) * p.top_k;
  auto routed_row = [&](int64_t v) {
    return live.row(static_cast<int>(v / p.top_k)) * p.top_k + v % p.top_k;
  };
  std::fill(p.expert_offsets, p.expert_offsets + p.num_experts + 1, 0);
  for (int64_t v = 0; v < num_rows; ++v) ++p.expert_offsets[p.topk_ids[routed_row(v)] + 1];
  for (int e = 0; e < p.num_experts; ++e) p.expert_offsets[e + 1] += p.expert_offsets[e];
  std::vector<int32_t> next(p.expert_offsets, p.expert_offsets + p.num_experts);
  for (int64_t v = 0; v < num_rows; ++v) {
    const int64_t r = routed_row(v);
    p.permuted_index[r] = next[p.topk_ids[r]]++;
  }
  if (p.permuted_x == nullptr) return;
  pool.parallel_for(num_rows, std::max(1, 16384 / std::max(1, p.hidden)), [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int64_t r = routed_row(v), dest = p.permuted_index[r];
      if (!is_live_row(p.copied_rows, dest)) continue;
      std::memcpy(p.permuted_x + dest * p.hidden, p.x + (r / p.top_k) * p.hidden,
                  sizeof(float) * p.hidden);
    }
  });
}

void launch_moe_unpermute_combine(const MoeUnpermuteCombineParams<float>& p, ThreadPool& pool) {
  RELAY_CHECK(live_rows_valid(p.live_tokens, p.num_tokens),
              "moe_unpermute_combine: live_tokens.region_rows ", p.live_tokens.region_rows,
              " must be positive with at most ", kMaxLiveRegions, " regions over ", p.num_tokens,
              " tokens");
  RELAY_CHECK(p.extra == nullptr || p.live_tokens.counts == nullptr,
              "moe_unpermute_combine: the extra term needs every token live");
  const LiveRowMap live = live_row_map(p.live_tokens, p.num_tokens);
  pool.parallel_for(live.total(), std::max(1, 16384 / std::max(1, p.hidden * p.top_k)),
                    [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int64_t t = live.row(static_cast<int>(v));
      float* out = p.out + t * p.hidden;
      std::fill(out, out + p.hidden, 0.0f);
      for (int k = 0; k < p.top_k; ++k) {
        const float w = p.topk_weights[t * p.top_k + k];
        if (w == 0.0f) continue;
        const float* row = p.expert_out + static_cast<int64_t>(p.permuted_index[t * p.top_k + k]) * p.hidden;
        for (int i = 0; i < p.hidden; ++i) out[i] += row[i] * w;
      }
    }
  });
  if (p.extra != nullptr) {
    launch_sigmoid_gate({p.extra, p.extra_gate, p.out, p.num_tokens, p.hidden, 1, true}, pool);
  }
  if (p.norm_weight == nullptr) return;
  RELAY_CHECK(p.live_tokens.counts == nullptr && p.residual != nullptr && p.normed != nullptr,
              "moe_unpermute_combine: the fused norm needs every token live, a residual and an "
              "output");
  launch_rms_norm({p.out, p.residual, p.norm_weight, p.normed, p.num_tokens, p.hidden, p.eps},
                  pool);
}

void launch_moe_localize_experts(const MoeLocalizeExpertsParams& p, ThreadPool& pool) {
  (void)pool;  // one pass over tokens x top_k integers: not worth a parallel_for
  for (int r = 0; r < p.num_rows; ++r) {
    const int32_t local = p.topk_ids[r] - p.expert_begin;
    const bool here = local >= 0 && local < p.num_local_experts;
    p.topk_ids[r] = here ? local : p.num_local_experts;
    if (!here) p.topk_weights[r] = 0.0f;
  }
}

}  // namespace relay::kernels

// See collectives_reference.h.
#include "parallel/cuda/collectives_reference.h"

#include "core/dtype.h"
#include "core/error.h"

namespace relay::parallel::cuda {

std::vector<float> reference_all_reduce(const std::vector<std::vector<float>>& inputs) {
  RELAY_CHECK(!inputs.empty(), "reference_all_reduce: no ranks");
  std::vector<float> sum = inputs[0];
  for (size_t r = 1; r < inputs.size(); ++r) {
    RELAY_CHECK(inputs[r].size() == sum.size(), "reference_all_reduce: rank ", r, " has ",
                inputs[r].size(), " values, rank 0 ", sum.size());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += inputs[r][i];
  }
  return sum;
}

std::vector<uint16_t> reference_all_reduce_bf16(const std::vector<std::vector<uint16_t>>& inputs) {
  RELAY_CHECK(!inputs.empty(), "reference_all_reduce_bf16: no ranks");
  const size_t n = inputs[0].size();
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    float acc = 0.0f;
    for (const auto& in : inputs) acc += bf16_to_f32(in.at(i));
    out[i] = f32_to_bf16(acc);
  }
  return out;
}

std::vector<std::vector<MoeReceived>> reference_moe_dispatch(
    const std::vector<MoeRankTokens>& ranks, int num_experts, int hidden, int top_k) {
  const int num_ranks = static_cast<int>(ranks.size());
  RELAY_CHECK(num_ranks >= 1 && num_experts % num_ranks == 0,
              "reference_moe_dispatch: ", num_experts, " experts over ", num_ranks, " ranks");
  const int per_rank = num_experts / num_ranks;
  std::vector<std::vector<MoeReceived>> received(num_ranks, std::vector<MoeReceived>(num_ranks));
  for (int s = 0; s < num_ranks; ++s) {
    const MoeRankTokens& src = ranks[s];
    for (int t = 0; t < src.num_tokens; ++t) {
      const int32_t* ids = src.topk_ids.data() + static_cast<size_t>(t) * top_k;
      const float* w = src.topk_weights.data() + static_cast<size_t>(t) * top_k;
      for (int d = 0; d < num_ranks; ++d) {
        const int first = d * per_rank;
        bool any = false;
        for (int k = 0; k < top_k; ++k) any = any || (ids[k] >= first && ids[k] < first + per_rank);
        if (!any) continue;
        MoeReceived& r = received[d][s];
        r.source_tokens.push_back(t);
        r.hidden.insert(r.hidden.end(), src.hidden.begin() + static_cast<size_t>(t) * hidden,
                        src.hidden.begin() + static_cast<size_t>(t + 1) * hidden);
        for (int k = 0; k < top_k; ++k) {
          const bool there = ids[k] >= first && ids[k] < first + per_rank;
          r.weights.push_back(there ? w[k] : 0.0f);
          r.local_ids.push_back(there ? ids[k] - first : per_rank);
        }
      }
    }
  }
  return received;
}

std::vector<std::vector<uint16_t>> reference_moe_combine(
    const std::vector<std::vector<MoeReceived>>& received,
    const std::vector<std::vector<std::vector<uint16_t>>>& partials,
    const std::vector<int>& num_tokens, int hidden) {
  const int num_ranks = static_cast<int>(num_tokens.size());
  std::vector<std::vector<float>> acc(num_ranks);
  for (int s = 0; s < num_ranks; ++s) acc[s].assign(static_cast<size_t>(num_tokens[s]) * hidden, 0);
  for (int d = 0; d < num_ranks; ++d) {
    for (int s = 0; s < num_ranks; ++s) {
      const MoeReceived& r = received[d][s];
      const std::vector<uint16_t>& part = partials[d][s];
      RELAY_CHECK(part.size() == r.source_tokens.size() * hidden, "reference_moe_combine: rank ", d,
                  " returns ", part.size(), " values for ", r.source_tokens.size(),
                  " tokens of rank ", s);
      for (size_t i = 0; i < r.source_tokens.size(); ++i) {
        float* dst = acc[s].data() + static_cast<size_t>(r.source_tokens[i]) * hidden;
        for (int j = 0; j < hidden; ++j) dst[j] += bf16_to_f32(part[i * hidden + j]);
      }
    }
  }
  std::vector<std::vector<uint16_t>> out(num_ranks);
  for (int s = 0; s < num_ranks; ++s) {
    out[s].resize(acc[s].size());
    for (size_t i = 0; i < acc[s].size(); ++i) out[s][i] = f32_to_bf16(acc[s][i]);
  }
  return out;
}

}  // namespace relay::parallel::cuda

// See rope.h. Variable names follow transformers' modeling_rope_utils.py so the two read side by side.
#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace relay {

namespace {

// base ** (arange(0, dim, 2) / dim) in fp32, as torch computes pos_freqs.
std::vector<float> pos_freqs(double base, int dim) {
  std::vector<float> f(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    f[i] = std::pow(static_cast<float>(base), exponent);
  }
  return f;
}

double find_correction_dim(double num_rotations, int dim, double base, double max_position) {
  return (dim * std::log(max_position / (num_rotations * 2 * std::numbers::pi))) / (2 * std::log(base));
}

RopeTables yarn(const ModelConfig& c, int dim) {
  const RopeScaling& r = c.rope_scaling;
  double base = c.rope_theta;
  double factor = r.factor;
  double original = r.original_max_position_embeddings > 0
                        ? static_cast<double>(r.original_max_position_embeddings)
                        : static_cast<double>(c.max_position_embeddings);
  double attention_factor = r.attention_factor > 0 ? r.attention_factor
                            : factor <= 1         ? 1.0
                                                  : 0.1 * std::log(factor) + 1.0;
  double low = find_correction_dim(r.beta_fast, dim, base, original);
  double high = find_correction_dim(r.beta_slow, dim, base, original);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // transformers: prevent a singular ramp

  std::vector<float> freqs = pos_freqs(base, dim);
  RopeTables t;
  t.inv_freq.resize(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    float extrapolation = 1.0f / freqs[i];
    float interpolation = 1.0f / (static_cast<float>(factor) * freqs[i]);
    float ramp = (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low);
    ramp = std::clamp(ramp, 0.0f, 1.0f);
    float extrapolation_factor = 1.0f - ramp;
    t.inv_freq[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  t.attention_scaling = static_cast<float>(attention_factor);
  return t;
}

}  // namespace

RopeTables compute_rope(const ModelConfig& c) {
  // transformers computes every rope type over the rotated dims only (partial rotary: Qwen3.5).
  const int dim = static_cast<int>(c.rotary_dim());
  RELAY_CHECK(dim > 0 && dim % 2 == 0, "RoPE needs an even number of rotated dims, got ", dim);
  switch (c.rope_scaling.type) {
    case RopeScaling::Type::None:
    case RopeScaling::Type::Linear: {
      std::vector<float> freqs = pos_freqs(c.rope_theta, dim);
      RopeTables t;
      t.inv_freq.resize(dim / 2);
      for (int i = 0; i < dim / 2; ++i) t.inv_freq[i] = 1.0f / freqs[i];
      if (c.rope_scaling.type == RopeScaling::Type::Linear) {
        for (float& f : t.inv_freq) f /= static_cast<float>(c.rope_scaling.factor);
      }
      return t;
    }
    case RopeScaling::Type::Yarn:
      return yarn(c, dim);
    case RopeScaling::Type::Dynamic:
      break;
  }
  fail("rope_scaling type \"dynamic\" is not supported (its frequencies depend on the sequence length)");
}

}  // namespace relay

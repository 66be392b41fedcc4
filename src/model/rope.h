// Rotary position embedding parameters, computed exactly as transformers computes them.
//
// A backend needs only inv_freq (one angle rate per rotated pair) and attention_scaling (a factor on
// cos and sin); the angle position * inv_freq[i] is formed in the kernel. The arithmetic here follows
// transformers' ROPE_INIT_FUNCTIONS step by step in the same precision (fp32 tensors, Python-double
// scalars), so a long context sees the same angles as the oracle: "default" RoPE, "linear"
// (inv_freq / factor) and "yarn" (_compute_yarn_parameters: the NTK-by-parts ramp between
// interpolated and extrapolated frequencies, and attention_factor = 0.1 ln(factor) + 1 unless the
// config gives one).
#pragma once

#include <vector>

#include "model/config.h"

namespace relay {

struct RopeTables {
  std::vector<float> inv_freq;  // [rotary_dim / 2] (ModelConfig::rotary_dim: head_dim for Qwen3)
  float attention_scaling = 1.0f;
};

// Throws for scaling types Relay cannot compute exactly (dynamic NTK), naming the type.
RopeTables compute_rope(const ModelConfig& config);

}  // namespace relay

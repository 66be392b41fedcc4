// Random inputs for the CPU kernel tests.
#pragma once

#include <cstddef>
#include <random>
#include <vector>

namespace relay::kernels {

// n samples of normal(0, scale).
inline std::vector<float> random_vec(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

}  // namespace relay::kernels

// Portable 8-wide float vectors for the CPU kernels (GCC/Clang vector extensions).
//
// Without -ffast-math the compiler may not reorder a float reduction, so a plain dot-product loop
// stays scalar. Writing the reduction over 8 independent lanes makes the order explicit (and fixed:
// results do not depend on the ISA) and lets the compiler use whatever vector width the target has —
// two SSE registers on baseline x86-64, one AVX register in the AVX2 clones of matmul.cpp.
#pragma once

#include <cstring>

namespace relay::kernels::cpu {

typedef float V8 __attribute__((vector_size(32)));

inline V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, V8 v) { std::memcpy(p, &v, sizeof v); }

inline float hsum8(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// sum_i a[i] * b[i] with 8 lane accumulators, then the scalar tail.
inline float dot(const float* a, const float* b, int n) {
  V8 acc = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
  float s = hsum8(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace relay::kernels::cpu

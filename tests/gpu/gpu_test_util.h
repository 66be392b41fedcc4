// Helpers for the GPU tests: device buffers, bf16 rounding of random inputs, and error metrics.
//
// Every comparison feeds the CPU fp32 reference the same bf16-rounded inputs the GPU sees, so the
// only difference left is the GPU's bf16 outputs and accumulation order; the relative error
// ||gpu - ref|| / ||ref|| then sits near 1e-3 and a tolerance of 1e-2 catches every real bug. Device
// outputs are poisoned (0xFF bytes: NaN in bf16 and fp32) before each launch, so an element the
// kernel forgot to write shows up as NaN and fails.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace relay::gpu_test {

#define GPU_TEST_CUDA(call)                                                                  \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) throw ::relay::Error(::relay::str(#call, ": ", cudaGetErrorString(e_))); \
  } while (0)

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n) GPU_TEST_CUDA(cudaMalloc(&ptr_, n * sizeof(T)));
    poison();
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), n_(o.n_) { o.ptr_ = nullptr, o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void poison() {
    if (n_) GPU_TEST_CUDA(cudaMemset(ptr_, 0xFF, n_ * sizeof(T)));
  }
  void upload(const std::vector<T>& host) {
    if (n_) GPU_TEST_CUDA(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    GPU_TEST_CUDA(cudaDeviceSynchronize());
    if (n_) GPU_TEST_CUDA(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// Random values rounded to bf16: `f32` is what the CPU reference gets, `bits` what the GPU gets.
struct Bf16Data {
  std::vector<float> f32;
  std::vector<__nv_bfloat16> bits;
};

inline Bf16Data random_bf16(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  Bf16Data d;
  d.f32.resize(n);
  d.bits.resize(n);
  for (size_t i = 0; i < n; ++i) {
    uint16_t b = f32_to_bf16(dist(rng));
    d.f32[i] = bf16_to_f32(b);
    __nv_bfloat16_raw raw;
    raw.x = b;
    d.bits[i] = raw;
  }
  return d;
}

inline std::vector<float> to_f32(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = bf16_to_f32(static_cast<__nv_bfloat16_raw>(v[i]).x);
  }
  return out;
}

// ||got - want|| / ||want||; infinite when any value is NaN (an unwritten or broken output).
inline double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) return INFINITY;
    diff += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  return norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

constexpr double kBf16Tolerance = 1e-2;

// The pool the CPU references run on.
inline ThreadPool& pool() {
  static ThreadPool p(0);
  return p;
}

}  // namespace relay::gpu_test

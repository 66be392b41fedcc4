// Helpers shared by the CUDA kernel files: error checks, bf16 vector types, warp reductions and the
// inline-PTX wrappers for tensor-core loads (ldmatrix), async copies (cp.async) and mma.sync.
//
// Kept header-only and small so each .cu file compiles on its own in a few seconds.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>

#include "core/error.h"

// Throws relay::Error naming the CUDA call and the error string.
#define RELAY_CUDA_CHECK(call)                                                              \
  do {                                                                                      \
    cudaError_t relay_cuda_err_ = (call);                                                   \
    RELAY_CHECK(relay_cuda_err_ == cudaSuccess, #call, ": ", cudaGetErrorString(relay_cuda_err_)); \
  } while (0)

// After a launch: throws naming the kernel when the launch failed (bad config, missing image).
#define RELAY_CUDA_CHECK_LAUNCH(kernel_name)                                               \
  do {                                                                                      \
    cudaError_t relay_cuda_err_ = cudaGetLastError();                                       \
    RELAY_CHECK(relay_cuda_err_ == cudaSuccess, "launch of ", kernel_name, " failed: ",     \
                cudaGetErrorString(relay_cuda_err_));                                       \
  } while (0)

namespace relay::kernels::cuda {

using bf16 = __nv_bfloat16;

// 8 bf16 values in one 16-byte load.
struct alignas(16) Bf16x8 {
  __nv_bfloat162 v[4];
};

__device__ __forceinline__ void bf16x8_to_f32(const Bf16x8& in, float* out) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(in.v[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ Bf16x8 f32_to_bf16x8(const float* in) {
  Bf16x8 r;
#pragma unroll
  for (int i = 0; i < 4; ++i) r.v[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// silu(g) * u as every bf16 SwiGLU on the GPU computes it (one expression, so the fused and the
// separate forms store the same bits).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// sigmoid(g) as every sigmoid gate on the GPU computes it (the gate kernels and the combine's
// extra term: one expression, so the fused and the separate forms store the same bits).
__device__ __forceinline__ float sigmoid_of(float g) { return 1.0f / (1.0f + expf(-g)); }
// out + x * sigmoid(g) with s = sigmoid_of(g): one rounding, wherever a gated term accumulates.
__device__ __forceinline__ float add_gated(float out, float x, float s) { return __fmaf_rn(x, s, out); }

// The residual add of every fused add + RMSNorm: v = old + v rounded to bf16 (HF's bf16 residual
// stream rounds the sum before the norm), stored into residual (where old was read: the caller
// loads it, so it can load it early).
__device__ __forceinline__ void add_to_residual(float (&v)[8], const Bf16x8& old,
                                                Bf16x8* residual) {
  float r[8];
  bf16x8_to_f32(old, r);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = __bfloat162float(__float2bfloat16(r[e] + v[e]));
  *residual = f32_to_bf16x8(v);
}

// RMSNorm's scaling of 8 elements of a row: weight * (v * inv_rms), rounded to bf16.
__device__ __forceinline__ Bf16x8 rms_scaled(const float (&v)[8], const Bf16x8& weight,
                                             float inv_rms) {
  float w[8], o[8];
  bf16x8_to_f32(weight, w);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = w[e] * (v[e] * inv_rms);
  return f32_to_bf16x8(o);
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int num_warps = blockDim.x >> 5;
  v = lane < num_warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

// 16 bytes read once in a kernel's life (streamed weights): through the read-only path without
// allocating in L1, so they do not evict what is re-read.
__device__ __forceinline__ void load_streaming_16(uint32_t (&r)[4], const void* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "l"(p));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; `valid` false writes zeros (the tail of a tile).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a shared-memory tile whose rows hold
// kChunks chunks, XOR-swizzled so the eight row addresses of an ldmatrix hit distinct banks.
template <int kChunks>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  if constexpr (kChunks >= 8) {
    return (row * kChunks + (chunk ^ (row & 7))) * 16;
  } else {
    return (row * kChunks + (chunk ^ ((row >> 1) & 3))) * 16;
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// d += a (16x16, row) * b (16x8, col), bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Programmatic dependent launch (PDL, compute capability 9.0+). A kernel launched through
// launch_dependent() may start while the kernel before it on the stream is still running: its CTAs
// become resident once every CTA of the earlier kernel has called release_dependent_grid() (or
// exited), and they must call wait_on_prior_grid() before touching any memory an earlier kernel
// writes or reads. What comes before the wait is limited to reading data no kernel of the step
// writes (weights), which is how a decode step's weight streams start under the previous kernel's
// tail. Every thread waits before it can exit, so a kernel completes only after its predecessor
// has: the ordering stays transitive along the stream. Plain <<<>>> launches (cuBLASLt, CUTLASS,
// the collectives) keep full stream ordering, before and after.
__device__ __forceinline__ void wait_on_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void release_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launch_dependent() asks for PDL: on devices of compute capability 9.0+, unless
// RELAY_PDL=0 (the benchmark's A/B switch) or a sharded backend turned it off for the process
// (disable_pdl). Read once per process, on the first caller's device.
inline std::atomic<int>& pdl_state() {  // -1 undecided, 0 off, 1 on
  static std::atomic<int> state{-1};
  return state;
}
inline bool pdl_enabled() {
  std::atomic<int>& state = pdl_state();
  int v = state.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("RELAY_PDL");
    int device = 0, major = 0;
    RELAY_CUDA_CHECK(cudaGetDevice(&device));
    RELAY_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    int expected = -1;
    state.compare_exchange_strong(expected, (env != nullptr && std::string_view(env) == "0") || major < 9 ? 0 : 1);
    v = state.load(std::memory_order_relaxed);
  }
  return v == 1;
}
// Launches from here on take plain stream order. NOTE: the sharded CUDA backend calls this: with
// PDL, TP 2 + EP 2 and DP 2 + EP 2 with both ranks on one H200 hung or faulted from batch 8 in
// `relay bench` (2026-12-04; the sharded GPU tests passed, and RELAY_PDL=0 ran the same bench
// through) — not yet understood, so sharded ranks run without it.
inline void disable_pdl() { pdl_state().store(0, std::memory_order_relaxed); }

// A launch that may overlap the kernel before it (PDL).
template <typename... Params, typename... Args>
void launch_dependent(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t s, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = s;
  config.attrs = &attr;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  RELAY_CHECK(err == cudaSuccess, "launch of ", name, " failed: ", cudaGetErrorString(err));
}

// Lets `kernel` take `bytes` of dynamic shared memory (past the 48 KiB default) on the current
// device. The attribute holds per device, so a process driving several GPUs (a rank per device)
// must set it on each: on the kernel's first eager launch there, before a CUDA graph captures it.
// A per-process flag set it on the first device only, and every other rank's launch failed. The
// attribute is one ceiling per (kernel, device) that only ever rises here: setting it to each
// launch's size let a smaller launch lower it under a larger size already marked as allowed.
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, int bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> allowed;
  int device = 0;
  RELAY_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  int& ceiling = allowed[{reinterpret_cast<const void*>(kernel), device}];
  if (bytes <= ceiling) return;
  RELAY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  ceiling = bytes;
}

// wgmma exists on compute capability 9.0 only (Blackwell has its own tensor-core instructions).
// Read once per process, on the first caller's device (a process drives GPUs of one kind).
inline bool device_has_wgmma() {
  static const bool has = [] {
    int device = 0, major = 0, minor = 0;
    RELAY_CUDA_CHECK(cudaGetDevice(&device));
    RELAY_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    RELAY_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return major == 9 && minor == 0;
  }();
  return has;
}

// SMs of the current device, queried once per device: the grid of a persistent kernel that holds
// one CTA per SM, without a device query on every launch.
inline int device_sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices] = {};
  int device = 0;
  RELAY_CUDA_CHECK(cudaGetDevice(&device));
  RELAY_CHECK(device >= 0 && device < kMaxDevices, "device ", device, " past ", kMaxDevices);
  int sms = counts[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    RELAY_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    counts[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// CTAs of `kernel` resident on the current device at once (SMs x occupancy at this block size and
// dynamic shared memory; at least one per SM): the grid a persistent or wave-sized launch fills.
template <typename Kernel>
int resident_ctas(Kernel kernel, int threads, size_t smem_bytes) {
  int per_sm = 0;
  RELAY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes));
  return device_sm_count() * std::max(per_sm, 1);
}

// Whether the calling thread's stream is capturing a CUDA graph (workspaces must not grow then).
inline bool stream_is_capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  RELAY_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  return status != cudaStreamCaptureStatusNone;
}

// A device buffer that grows to the largest size asked for. A CUDA graph captured earlier may still
// point at the old buffer, so growing retires it instead of freeing it (growth is geometric, so the
// retired buffers cost at most as much as the live one); it never grows during capture. Growth is
// stream-ordered (cudaMallocAsync): a plain cudaMalloc may wait for the whole device, and a sharded
// rank's peers may be spinning there in a collective that waits for this rank.
class DeviceWorkspace {
 public:
  void* get(size_t bytes, cudaStream_t s, const char* what) {
    if (bytes > bytes_) {
      RELAY_CHECK(!stream_is_capturing(s), "workspace of ", what, " must grow to ", bytes,
                  " bytes during CUDA graph capture; warm up with the same shapes first");
      const size_t grown = std::max(bytes, 2 * bytes_);
      RELAY_CUDA_CHECK(cudaMallocAsync(&ptr_, grown, s));
      bytes_ = grown;
    }
    return ptr_;
  }
  // The same, for state that kernels keep at zero between launches (they reset what they count):
  // only a newly allocated buffer needs clearing.
  void* get_zeroed(size_t bytes, cudaStream_t s, const char* what) {
    const size_t before = bytes_;
    void* p = get(bytes, s, what);
    if (bytes_ != before) RELAY_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes_, s));
    return p;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// One T per (device, stream): the state launches keep between calls (workspaces, GEMM adapters,
// cuBLASLt handles) is reused in stream order, so calls on one stream may share it and calls on
// different streams must not. A sharded backend runs each rank on its own stream (and possibly its
// own device) from its own thread, concurrently; this gives every rank its own copy. Created on
// first use, on the calling thread's current device. Tag tells apart several Ts of one type.
template <typename T, typename Tag = T>
T& per_stream(cudaStream_t s) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, std::unique_ptr<T>> items;
  int device = 0;
  RELAY_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mu);
  std::unique_ptr<T>& slot = items[{device, s}];
  if (!slot) slot = std::make_unique<T>();
  return *slot;
}

}  // namespace relay::kernels::cuda

// See all_reduce.h for the algorithms and the window layout.
//
// Kernel params are __grid_constant__: each block indexes p.ranks[blockIdx.y], and a by-value param
// indexed at run time would otherwise be copied to every thread's local memory (on the H200 such a
// copy read out of bounds under compute-sanitizer). The partial-unit loops have a fixed trip count so
// the accumulators stay in registers.
//
// Elements move in 16-byte units (4 fp32 or 8 bf16). The last unit may be partial, and a user
// buffer that is not 16-byte aligned is read and written one element at a time; staging areas are
// always aligned. Two-shot slices are whole multiples of 8 units (128 bytes, one cache line), so no
// line holds two ranks' slices.
#include <cuda_bf16.h>

#include <algorithm>

#include "core/error.h"
#include "parallel/cuda/all_reduce.h"
#include "parallel/cuda/cuda_check.h"
#include "parallel/cuda/peer_sync.cuh"

namespace relay::parallel::cuda {
namespace {

template <typename T>
struct Unit {
  static constexpr int kElems = 16 / sizeof(T);
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Element i of a buffer a peer may have written (L2, not L1; see peer_sync.cuh).
template <typename T>
__device__ __forceinline__ T load_cg(const T* p);
template <>
__device__ __forceinline__ float load_cg<float>(const float* p) {
  return __ldcg(p);
}
template <>
__device__ __forceinline__ __nv_bfloat16 load_cg<__nv_bfloat16>(const __nv_bfloat16* p) {
  const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
  return __ushort_as_bfloat16(bits);
}

// Adds unit u of `src` (elements [u*kElems, count)) to acc as floats.
template <typename T>
__device__ __forceinline__ void add_unit(const T* src, size_t u, size_t count, float* acc) {
  constexpr int kE = Unit<T>::kElems;
  const size_t first = u * kE;
  if (first + kE <= count) {
    const int4 raw = __ldcg(reinterpret_cast<const int4*>(src) + u);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kE; ++i) acc[i] += to_float(v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kE; ++i) {
      if (first + i < count) acc[i] += to_float(load_cg(src + first + i));
    }
  }
}

// Writes acc (floats) as unit u of `dst`; `aligned` says dst is 16-byte aligned.
template <typename T>
__device__ __forceinline__ void store_unit(T* dst, size_t u, size_t count, const float* acc,
                                           bool aligned) {
  constexpr int kE = Unit<T>::kElems;
  const size_t first = u * kE;
  if (aligned && first + kE <= count) {
    int4 raw;
    T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kE; ++i) v[i] = from_float<T>(acc[i]);
    reinterpret_cast<int4*>(dst)[u] = raw;
  } else {
#pragma unroll
    for (int i = 0; i < kE; ++i) {
      if (first + i < count) dst[first + i] = from_float<T>(acc[i]);
    }
  }
}

// Copies unit u from src to dst without conversion; src_aligned / dst_aligned as for store_unit.
template <typename T>
__device__ __forceinline__ void copy_unit(const T* src, T* dst, size_t u, size_t count,
                                          bool src_aligned, bool dst_aligned) {
  constexpr int kE = Unit<T>::kElems;
  const size_t first = u * kE;
  if (src_aligned && dst_aligned && first + kE <= count) {
    reinterpret_cast<int4*>(dst)[u] = __ldcg(reinterpret_cast<const int4*>(src) + u);
  } else {
#pragma unroll
    for (int i = 0; i < kE; ++i) {
      if (first + i < count) dst[first + i] = load_cg(src + first + i);
    }
  }
}

__device__ __forceinline__ AllReduceWindow* window_head(char* w) {
  return reinterpret_cast<AllReduceWindow*>(w);
}
template <typename T>
__device__ __forceinline__ T* staging(char* w) {
  return reinterpret_cast<T*>(w + AllReduceWindow::kStagingOffset);
}

// Block b of this rank meets block b of every rank at barrier value `value`.
__device__ __forceinline__ void block_barrier(const AllReduceRankView& v, int num_ranks,
                                              uint32_t value, uint64_t timeout_ns,
                                              PeerAbort* abort) {
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < num_ranks) {
    signal_flag(&window_head(v.windows[peer])->flags[blockIdx.x][v.rank], value);
    wait_flag(&window_head(v.windows[v.rank])->flags[blockIdx.x][peer], value, timeout_ns, abort,
              PeerOp::kAllReduceBarrier, v.rank, peer);
  }
  __syncthreads();
}

__device__ __forceinline__ uint32_t read_epoch(const AllReduceRankView& v) {
  __shared__ uint32_t epoch;
  if (threadIdx.x == 0) epoch = window_head(v.windows[v.rank])->epochs[blockIdx.x];
  __syncthreads();
  return epoch;
}

__device__ __forceinline__ void write_epoch(const AllReduceRankView& v, uint32_t epoch) {
  if (threadIdx.x == 0) window_head(v.windows[v.rank])->epochs[blockIdx.x] = epoch;
}

template <typename T>
__global__ void __launch_bounds__(kAllReduceThreads)
    one_shot_all_reduce_kernel(const __grid_constant__ PeerAllReduceParams p) {
  const AllReduceRankView& v = p.ranks[blockIdx.y];
  T* data = static_cast<T*>(v.data);
  const bool aligned = reinterpret_cast<uintptr_t>(data) % 16 == 0;
  const size_t units = (p.count + Unit<T>::kElems - 1) / Unit<T>::kElems;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint32_t epoch = read_epoch(v);

  T* mine = staging<T>(v.windows[v.rank]);
  for (size_t u = first; u < units; u += stride) copy_unit(data, mine, u, p.count, aligned, true);
  block_barrier(v, p.num_ranks, epoch + 1, p.timeout_ns, p.abort);

  for (size_t u = first; u < units; u += stride) {
    float acc[Unit<T>::kElems] = {};
    for (int q = 0; q < p.num_ranks; ++q) add_unit(staging<T>(v.windows[q]), u, p.count, acc);
    store_unit(data, u, p.count, acc, aligned);
  }
  block_barrier(v, p.num_ranks, epoch + 2, p.timeout_ns, p.abort);  // peers have read our staging
  write_epoch(v, epoch + 2);
}

template <typename T>
__global__ void __launch_bounds__(kAllReduceThreads)
    two_shot_all_reduce_kernel(const __grid_constant__ PeerAllReduceParams p, size_t slice_units) {
  const AllReduceRankView& v = p.ranks[blockIdx.y];
  T* data = static_cast<T*>(v.data);
  const bool aligned = reinterpret_cast<uintptr_t>(data) % 16 == 0;
  const size_t units = (p.count + Unit<T>::kElems - 1) / Unit<T>::kElems;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint32_t epoch = read_epoch(v);
  // Units of slice q: [q * slice_units, min((q + 1) * slice_units, units)).
  const auto slice_end = [&](int q) {
    const size_t end = (q + 1) * slice_units;
    return end < units ? end : units;
  };

  T* mine = staging<T>(v.windows[v.rank]);
  for (int q = 0; q < p.num_ranks; ++q)
    for (size_t u = q * slice_units + first; u < slice_end(q); u += stride)
      copy_unit(data, mine, u, p.count, aligned, true);
  block_barrier(v, p.num_ranks, epoch + 1, p.timeout_ns, p.abort);

  // Reduce-scatter: our slice, summed over every rank's staging in rank order, back into ours.
  for (size_t u = v.rank * slice_units + first; u < slice_end(v.rank); u += stride) {
    float acc[Unit<T>::kElems] = {};
    for (int q = 0; q < p.num_ranks; ++q) add_unit(staging<T>(v.windows[q]), u, p.count, acc);
    store_unit(mine, u, p.count, acc, true);
  }
  block_barrier(v, p.num_ranks, epoch + 2, p.timeout_ns, p.abort);

  // All-gather: slice q from rank q.
  for (int q = 0; q < p.num_ranks; ++q) {
    const T* theirs = staging<T>(v.windows[q]);
    for (size_t u = q * slice_units + first; u < slice_end(q); u += stride)
      copy_unit(theirs, data, u, p.count, true, aligned);
  }
  block_barrier(v, p.num_ranks, epoch + 3, p.timeout_ns, p.abort);  // peers have read our slice
  write_epoch(v, epoch + 3);
}

__global__ void peer_barrier_kernel(const __grid_constant__ PeerAllReduceParams p) {
  const AllReduceRankView& v = p.ranks[blockIdx.y];
  const uint32_t epoch = read_epoch(v);
  block_barrier(v, p.num_ranks, epoch + 1, p.timeout_ns, p.abort);
  write_epoch(v, epoch + 1);
}

void check_params(const PeerAllReduceParams& p, const char* what) {
  RELAY_CHECK(p.num_ranks >= 1 && p.num_ranks <= kMaxRanks, what, ": ", p.num_ranks,
              " ranks, supported 1..", kMaxRanks);
  RELAY_CHECK(p.num_local_ranks >= 1 && p.num_local_ranks <= p.num_ranks, what, ": ",
              p.num_local_ranks, " local ranks of ", p.num_ranks);
  RELAY_CHECK(p.max_blocks >= 1 && p.max_blocks <= kMaxAllReduceBlocks, what, ": max_blocks ",
              p.max_blocks, " not in 1..", kMaxAllReduceBlocks);
  RELAY_CHECK(p.dtype == DType::F32 || p.dtype == DType::BF16, what, ": dtype ",
              dtype_name(p.dtype), " (F32 or BF16 only)");
  const size_t bytes = p.count * dtype_size(p.dtype);
  RELAY_CHECK(bytes <= p.capacity_bytes, what, ": ", bytes, " bytes exceed the staging capacity ",
              p.capacity_bytes);
  for (int l = 0; l < p.num_local_ranks; ++l) {
    const AllReduceRankView& v = p.ranks[l];
    RELAY_CHECK(v.rank >= 0 && v.rank < p.num_ranks, what, ": view ", l, " has rank ", v.rank);
    for (int q = 0; q < p.num_ranks; ++q)
      RELAY_CHECK(v.windows[q] != nullptr && reinterpret_cast<uintptr_t>(v.windows[q]) % 16 == 0,
                  what, ": rank ", v.rank, "'s window pointer for rank ", q,
                  " is null or not 16-byte aligned");
  }
}

template <typename Kernel>
void launch(Kernel kernel, const char* name, const PeerAllReduceParams& p, int blocks,
            cudaStream_t stream, auto... extra) {
  const dim3 grid(blocks, p.num_local_ranks);
  if (p.num_local_ranks > 1) ensure_co_resident(kernel, grid, kAllReduceThreads, 0, name);
  kernel<<<grid, kAllReduceThreads, 0, stream>>>(p, extra...);
  RELAY_CUDA_CHECK_LAUNCH(name);
}

int blocks_for(size_t units, int max_blocks) {
  const size_t wanted = (units + kAllReduceThreads - 1) / kAllReduceThreads;
  return static_cast<int>(std::clamp<size_t>(wanted, 1, static_cast<size_t>(max_blocks)));
}

}  // namespace

void launch_one_shot_all_reduce(const PeerAllReduceParams& p, cudaStream_t stream) {
  check_params(p, "one-shot all-reduce");
  if (p.count == 0) return;
  const size_t units = (p.count * dtype_size(p.dtype) + 15) / 16;
  const int blocks = blocks_for(units, p.max_blocks);
  if (p.dtype == DType::BF16)
    launch(one_shot_all_reduce_kernel<__nv_bfloat16>, "one_shot_all_reduce<bf16>", p, blocks,
           stream);
  else
    launch(one_shot_all_reduce_kernel<float>, "one_shot_all_reduce<f32>", p, blocks, stream);
}

void launch_two_shot_all_reduce(const PeerAllReduceParams& p, cudaStream_t stream) {
  check_params(p, "two-shot all-reduce");
  if (p.count == 0) return;
  const size_t elem = dtype_size(p.dtype);
  const size_t units = (p.count * elem + 15) / 16;
  const size_t per_rank = (units + p.num_ranks - 1) / p.num_ranks;
  const size_t slice_units = (per_rank + 7) / 8 * 8;
  const int blocks = blocks_for(slice_units, p.max_blocks);
  if (p.dtype == DType::BF16)
    launch(two_shot_all_reduce_kernel<__nv_bfloat16>, "two_shot_all_reduce<bf16>", p, blocks,
           stream, slice_units);
  else
    launch(two_shot_all_reduce_kernel<float>, "two_shot_all_reduce<f32>", p, blocks, stream,
           slice_units);
}

void launch_peer_barrier(const PeerAllReduceParams& p, cudaStream_t stream) {
  PeerAllReduceParams q = p;
  q.count = 0;  // nothing to move: the capacity and dtype checks are moot
  q.dtype = DType::F32;
  check_params(q, "peer barrier");
  launch(peer_barrier_kernel, "peer_barrier", q, 1, stream);
}

PeerAllReduceParams one_rank_params(int rank, const std::vector<char*>& windows, void* data,
                                    size_t count, DType dtype, size_t capacity_bytes,
                                    int max_blocks, uint64_t timeout_ms, PeerAbort* abort) {
  PeerAllReduceParams p;
  p.ranks[0].data = data;
  p.ranks[0].rank = rank;
  for (size_t q = 0; q < windows.size(); ++q) p.ranks[0].windows[q] = windows[q];
  p.num_local_ranks = 1;
  p.num_ranks = static_cast<int>(windows.size());
  p.count = count;
  p.dtype = dtype;
  p.capacity_bytes = capacity_bytes;
  p.max_blocks = max_blocks;
  p.timeout_ns = timeout_ms * 1'000'000;
  p.abort = abort;
  return p;
}

}  // namespace relay::parallel::cuda

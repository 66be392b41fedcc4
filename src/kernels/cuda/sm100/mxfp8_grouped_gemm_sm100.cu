// MXFP8 grouped GEMM on Blackwell (sm_100a): the native path of Mxfp8GroupedMatmulParams,
// out[r] = sum over 32-groups g of (x_q[r] . w_q[e] over g) * 2^(x_e8m0[r, g] - 127) *
// 2^(w_e8m0[e, n, g] - 127), for the rows r of each expert e.
//
// Built only into the sm_100a library (relay_kernels_cuda_sm100) and reached through
// launch_mxfp8_grouped_matmul / launch_mxfp8_matmul when the current GPU is compute capability
// 10.x. It has been compiled in CI but not run on hardware: the GPU machine here is an H200
// (tests/gpu/test_fp8_kernels.cpp's Sm100 test skips there).
//
// The kernel is CUTLASS 4's sm100 ptr-array grouped GEMM with the block-scaled tcgen05 MMA for
// mx_float8_t operands (KernelPtrArrayTmaWarpSpecialized1SmMxf8f6f4Sm100): a TMA producer fills a
// shared-memory ring with 128 x 128 e4m3 tiles of x and w and their E8M0 scale tiles, one thread
// issues the MMAs into tensor memory (the scales are applied by the instruction itself, per
// 32-group: no per-block promotion in registers as on Hopper), and the epilogue warps move the fp32
// accumulators out of tensor memory and store bf16 through TMA. One group per expert; experts with
// no rows are groups with M = 0.
//
// Scales: the MMA reads scale factors in the interleaved layout of Sm1xxBlockScaledConfig (atoms of
// 128 rows x 4 groups = 512 bytes: row r of the atom at (r % 32) * 16 + (r / 32) * 4, its group g at
// + g; atoms ordered k-fastest), not Relay's row-major [rows, ceil(k / 32)]. Every call therefore
// rewrites both operands' scales into that layout in a workspace (for the weights 1/32 of their
// bytes), the activations per group at a 128-row-aligned offset computed on the device from
// expert_offsets; the padding is E8M0 127 (x 1.0), so the zero-filled tail of a partial k tile
// never meets a NaN scale. A backend serving MXFP8 on Blackwell would convert the weight scales
// once at load instead.
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/detail/sm100_blockscaled_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <mutex>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_cuda.h"

#if !defined(CUTLASS_ARCH_MMA_SM100_SUPPORTED)
#error "the sm_100a MXFP8 grouped GEMM needs CUDA >= 12.8 and CUTLASS's SM100 support"
#endif

namespace relay::kernels {

namespace {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // <M, N, K> per group
using ElementMx = cutlass::mx_float8_t<cutlass::float_e4m3_t>;
using ElementOut = cutlass::bfloat16_t;
// x [rows, k] row-major; w[e] [n, k] row-major is the K x N column-major B; out [rows, n]
// row-major.
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignmentIn = 16;  // e4m3 elements per 16 bytes (TMA's minimum)
constexpr int kAlignmentOut = 8;  // bf16
constexpr int kGroup = kMxGroupSize;
static_assert(kGroup == 32, "the sm100 block-scaled MMA scales every 32 elements of k");

// 1-SM tcgen05 MMA, 128 x 128 output tile, 128 elements (four scale groups) of k per stage; no
// cluster (ragged experts would idle a cluster's partner on an odd tile count).
using Tile = Shape<_128, _128, _128>;
using Cluster = Shape<_1, _1, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*,
    kAlignmentOut,  // no C operand: D = acc
    ElementOut, LayoutD*, kAlignmentOut, cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementMx, LayoutA*,
    kAlignmentIn, ElementMx, LayoutB*, kAlignmentIn, float, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmMxf8f6f4Sm100>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using ElementIn = typename Gemm::ElementA;  // float_e4m3_t
using ElementSF = typename Kernel::ElementSF;  // float_ue8m0_t
using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;
using LayoutSFA = typename Mainloop::InternalLayoutSFA;
using LayoutSFB = typename Mainloop::InternalLayoutSFB;
using ScaleConfig = typename Mainloop::Sm1xxBlkScaledConfig;
static_assert(ScaleConfig::SFVecSize == kGroup);

constexpr int kSfAtomRows = 128;   // rows of one scale atom
constexpr int kSfAtomGroups = 4;   // 32-groups of k in one scale atom
constexpr int kSfAtomBytes = kSfAtomRows * kSfAtomGroups;
constexpr uint8_t kE8m0One = 127;  // 2^0: the padding

__host__ __device__ inline int64_t sf_bytes(int rows, int k) {
  const int64_t row_atoms = (rows + kSfAtomRows - 1) / kSfAtomRows;
  const int64_t group_atoms = ((k + kGroup - 1) / kGroup + kSfAtomGroups - 1) / kSfAtomGroups;
  return row_atoms * group_atoms * kSfAtomBytes;
}

// The device arrays CUTLASS reads per group, carved from one buffer, plus where each group's x
// scales start inside the converted-scale buffer.
struct GroupArgs {
  ProblemShape::UnderlyingProblemShape* shapes;
  const ElementIn** a;
  const ElementIn** b;
  ElementOut** d;
  const ElementSF** sfa;
  const ElementSF** sfb;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  int64_t* sfa_offset;  // [groups]: byte offset of the group's x scales in sfa_base
};

// Rows of group e: expert_offsets, or (no offsets: a dense GEMM) all rows as one group.
__device__ inline int group_row0(const Mxfp8GroupedMatmulParams<bf16>& p, int e) {
  return p.expert_offsets ? p.expert_offsets[e] : 0;
}
__device__ inline int group_rows(const Mxfp8GroupedMatmulParams<bf16>& p, int e) {
  return p.expert_offsets ? p.expert_offsets[e + 1] - p.expert_offsets[e] : p.num_rows;
}

// One CTA: the per-group arguments, and the x-scale offsets by a serial prefix sum over the
// groups' padded sizes (a few hundred groups at most).
__global__ void fill_mxfp8_group_args_kernel(Mxfp8GroupedMatmulParams<bf16> p, GroupArgs g,
                                             uint8_t* sfa_base, const uint8_t* sfb_base,
                                             int64_t sfa_capacity) {
  if (threadIdx.x == 0) {
    int64_t at = 0;
    for (int e = 0; e < p.num_experts; ++e) {
      g.sfa_offset[e] = at;
      at += sf_bytes(group_rows(p, e), p.k);
    }
    if (at > sfa_capacity) __trap();  // the host's bound is wrong: fail loudly, never overrun
  }
  __syncthreads();
  const int64_t w_sf = sf_bytes(p.n, p.k);
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    const int64_t row0 = group_row0(p, e);
    const int rows = group_rows(p, e);
    g.shapes[e] = {rows, p.n, p.k};
    g.a[e] = reinterpret_cast<const ElementIn*>(p.x) + row0 * p.k;
    g.b[e] = reinterpret_cast<const ElementIn*>(p.w) + static_cast<int64_t>(e) * p.n * p.k;
    g.d[e] = reinterpret_cast<ElementOut*>(p.out) + row0 * p.n;
    g.sfa[e] = reinterpret_cast<const ElementSF*>(sfa_base + g.sfa_offset[e]);
    g.sfb[e] = reinterpret_cast<const ElementSF*>(sfb_base + e * w_sf);
    StrideA sa{};
    StrideB sb{};
    StrideD sd{};
    get<0>(sa) = p.k;
    get<0>(sb) = p.k;
    get<0>(sd) = p.n;
    g.stride_a[e] = sa;
    g.stride_b[e] = sb;
    g.stride_d[e] = sd;
    g.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, p.n, p.k, 1));
    g.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, p.n, p.k, 1));
  }
}

// x scales [num_rows, groups] row-major -> each group's interleaved block; one thread per
// (row, 32-group), the row's expert found by binary search of expert_offsets.
__global__ void convert_x_scales_kernel(Mxfp8GroupedMatmulParams<bf16> p, GroupArgs g,
                                        uint8_t* sfa_base) {
  const int groups = (p.k + kGroup - 1) / kGroup;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(p.num_rows) * groups) return;
  const int row = static_cast<int>(i / groups);
  const int kg = static_cast<int>(i % groups);
  int e = 0;
  if (p.expert_offsets) {
    int lo = 0, hi = p.num_experts - 1;  // the last e with expert_offsets[e] <= row
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.expert_offsets[mid] <= row) lo = mid; else hi = mid - 1;
    }
    e = lo;
  }
  const int m = row - group_row0(p, e);
  const LayoutSFA layout = ScaleConfig::tile_atom_to_shape_SFA(
      make_shape(group_rows(p, e), p.n, p.k, 1));
  sfa_base[g.sfa_offset[e] + layout(m, kg * kGroup, 0)] = p.x_scale[i];
}

// w scales [experts, n, groups] -> one interleaved block per expert, sf_bytes(n, k) apart.
__global__ void convert_w_scales_kernel(Mxfp8GroupedMatmulParams<bf16> p,
                                        uint8_t* sfb_base) {
  const int groups = (p.k + kGroup - 1) / kGroup;
  const int64_t per_expert = static_cast<int64_t>(p.n) * groups;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= per_expert * p.num_experts) return;
  const int e = static_cast<int>(i / per_expert);
  const int col = static_cast<int>(i % per_expert / groups);
  const int kg = static_cast<int>(i % groups);
  const LayoutSFB layout = ScaleConfig::tile_atom_to_shape_SFB(make_shape(1, p.n, p.k, 1));
  sfb_base[e * sf_bytes(p.n, p.k) + layout(col, kg * kGroup, 0)] = p.w_scale[i];
}

GroupArgs carve_group_args(void* base, int groups, size_t* total_bytes) {
  const size_t n = static_cast<size_t>(groups);
  char* at = static_cast<char*>(base);
  size_t total = 0;
  auto take = [&](auto*& ptr, size_t element_bytes) {
    ptr = reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(at ? at + total : nullptr);
    total += (n * element_bytes + 127) / 128 * 128;
  };
  GroupArgs g{};
  take(g.shapes, sizeof(*g.shapes));
  take(g.a, sizeof(void*));
  take(g.b, sizeof(void*));
  take(g.d, sizeof(void*));
  take(g.sfa, sizeof(void*));
  take(g.sfb, sizeof(void*));
  take(g.stride_a, sizeof(StrideA));
  take(g.stride_b, sizeof(StrideB));
  take(g.stride_d, sizeof(StrideD));
  take(g.layout_sfa, sizeof(LayoutSFA));
  take(g.layout_sfb, sizeof(LayoutSFB));
  take(g.sfa_offset, sizeof(int64_t));
  *total_bytes = total;
  return g;
}

// As CutlassFp8GroupedContext (fp8_grouped_gemm_cutlass.cu): one set of arrays and one adapter per
// stream; the buffers only grow and retire rather than free, so captured graphs stay valid.
class Sm100MxGroupedContext {
 public:
  static Sm100MxGroupedContext& get(cudaStream_t s) {
    return cuda::per_stream<Sm100MxGroupedContext>(s);
  }

  void run(const Mxfp8GroupedMatmulParams<bf16>& p, cudaStream_t s) {
    std::lock_guard lock(mu_);
    const int groups = p.num_experts;
    size_t bytes = 0;
    carve_group_args(nullptr, groups, &bytes);
    const GroupArgs g = carve_group_args(arrays_.get(bytes, s, "mxfp8 sm100 group arguments"),
                                         groups, &bytes);
    // Every group pads its rows to whole 128-row atoms: at most one partial atom per group.
    const int64_t sfa_capacity =
        sf_bytes(p.num_rows, p.k) + static_cast<int64_t>(groups) * sf_bytes(kSfAtomRows, p.k);
    const int64_t sfb_bytes = static_cast<int64_t>(groups) * sf_bytes(p.n, p.k);
    auto* sfa = static_cast<uint8_t*>(sfa_.get(sfa_capacity, s, "mxfp8 sm100 x scales"));
    auto* sfb = static_cast<uint8_t*>(sfb_.get(sfb_bytes, s, "mxfp8 sm100 w scales"));
    RELAY_CUDA_CHECK(cudaMemsetAsync(sfa, kE8m0One, sfa_capacity, s));
    RELAY_CUDA_CHECK(cudaMemsetAsync(sfb, kE8m0One, sfb_bytes, s));
    fill_mxfp8_group_args_kernel<<<1, 256, 0, s>>>(p, g, sfa, sfb, sfa_capacity);
    RELAY_CUDA_CHECK_LAUNCH("fill_mxfp8_group_args_kernel");
    const int kgroups = (p.k + kGroup - 1) / kGroup;
    const int64_t x_items = static_cast<int64_t>(p.num_rows) * kgroups;
    convert_x_scales_kernel<<<static_cast<unsigned>((x_items + 255) / 256), 256, 0, s>>>(p, g, sfa);
    RELAY_CUDA_CHECK_LAUNCH("convert_x_scales_kernel");
    const int64_t w_items = static_cast<int64_t>(groups) * p.n * kgroups;
    convert_w_scales_kernel<<<static_cast<unsigned>((w_items + 255) / 256), 256, 0, s>>>(p, sfb);
    RELAY_CUDA_CHECK_LAUNCH("convert_w_scales_kernel");
    if (groups != groups_ || g.shapes != shapes_) {
      typename Gemm::Arguments args{
          cutlass::gemm::GemmUniversalMode::kGrouped,
          {groups, g.shapes, nullptr},  // problem shapes live on the device only
          {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb},
          {{}, nullptr, {}, g.d, g.stride_d},
          hw_info_};
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = 0.0f;
      cutlass::Status st = gemm_.can_implement(args);
      RELAY_CHECK(st == cutlass::Status::kSuccess, "mxfp8_grouped_matmul (sm100): cannot run n ",
                  p.n, " k ", p.k, ": ", cutlassGetStatusString(st));
      void* workspace = workspace_.get(Gemm::get_workspace_size(args), s, "mxfp8 sm100 workspace");
      st = gemm_.initialize(args, workspace, s);
      RELAY_CHECK(st == cutlass::Status::kSuccess,
                  "mxfp8_grouped_matmul (sm100): initialize failed: ", cutlassGetStatusString(st));
      groups_ = groups;
      shapes_ = g.shapes;
    }
    const cutlass::Status st = gemm_.run(s);
    RELAY_CHECK(st == cutlass::Status::kSuccess,
                "mxfp8_grouped_matmul (sm100): launch failed: ", cutlassGetStatusString(st));
    RELAY_CUDA_CHECK_LAUNCH("CUTLASS sm100 MXFP8 grouped GEMM");
  }

  Sm100MxGroupedContext() {  // on the current device (per_stream)
    int device = 0;
    RELAY_CUDA_CHECK(cudaGetDevice(&device));
    hw_info_.device_id = device;
    hw_info_.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }

 private:

  std::mutex mu_;
  cutlass::KernelHardwareInfo hw_info_;
  cuda::DeviceWorkspace arrays_;
  cuda::DeviceWorkspace sfa_;
  cuda::DeviceWorkspace sfb_;
  cuda::DeviceWorkspace workspace_;
  Gemm gemm_;
  int groups_ = -1;
  const void* shapes_ = nullptr;
};

bool aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

void launch_mxfp8_grouped_matmul_sm100(const Mxfp8GroupedMatmulParams<bf16>& p,
                                       cudaStream_t s) {
  RELAY_CHECK(mxfp8_sm100_supported(p.n, p.k), "mxfp8_grouped_matmul (sm100): n ", p.n, " and k ",
              p.k, " must be positive multiples of 8 and 16 (TMA moves 16-byte rows)");
  RELAY_CHECK(aligned_16(p.x) && aligned_16(p.w) && aligned_16(p.out),
              "mxfp8_grouped_matmul (sm100): x, w and out must be 16-byte aligned for TMA");
  RELAY_CHECK(p.num_rows >= 0 && p.num_experts > 0 &&
                  (p.expert_offsets != nullptr || p.num_experts == 1),
              "mxfp8_grouped_matmul (sm100): rows ", p.num_rows, ", experts ", p.num_experts,
              " (expert_offsets may be null only for one group)");
  if (p.num_rows == 0) return;
  Sm100MxGroupedContext::get(s).run(p, s);
}

}  // namespace relay::kernels

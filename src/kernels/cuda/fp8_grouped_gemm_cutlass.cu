// FP8 block-scaled MoE grouped GEMM through CUTLASS's Hopper kernel, one GEMM "group" per expert:
// for the rows r of each expert e, out[r] = sum over k-blocks b of (x_q[r] . w_q[e] over b) *
// x_scale[r, b] * w_scale[e, n/128, b] (kernels/fp8_ops.h's contract).
//
// The kernel is CUTLASS 4's sm90 ptr-array grouped GEMM with the blockwise-scaled FP8 mainloop
// (KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise): persistent CTAs walk a tile schedule
// over every group; one producer warp TMA-loads 128 x 128 e4m3 tiles of x and w into a multi-stage
// shared-memory ring, a second one cp.asyncs each stage's scales (128 x scales and one w scale),
// and two consumer warp groups run wgmma over the stage into zeroed fp32 partials which they then
// add to the accumulators times x_scale[row] * w_scale. That per-k-block promotion is the CPU
// reference's structure, and it bounds the error of Hopper's reduced-precision FP8 accumulation
// inside wgmma to one block. A TMA epilogue stores bf16.
//
// As in grouped_gemm_cutlass.cu, a one-CTA kernel writes each group's pointers, strides, problem
// shape and scale layouts from expert_offsets on the device, so the host never reads the routing
// and the launch can be captured in a CUDA graph; experts with no rows are groups with M = 0,
// which the tile schedule skips.
//
// One configuration, 128x128x128 tiles in 1x2 clusters:
// - tile K is one 128-block: the mainloop promotes once per scale block along K, and needs tile K
//   to be a multiple of it. A 128 x 256 tile would hold 128 accumulators plus 128 partials per
//   consumer thread and spill; 128 x 128 holds 64 + 64.
// - the cluster pairs CTAs on neighbouring n tiles of one expert, which share (multicast) the x
//   tile. Rows per expert are ragged, so a 2x1 cluster (pairs of m tiles) would idle half a
//   cluster on every expert with an odd number of m tiles; n (Qwen3's 1536 / 2048 / 3072 / 4096)
//   always holds an even number of 128-column tiles.
//
// Scale layouts: both scale operands are K-major, which is how Relay stores them, so no transpose
// runs. x_scale [rows, ceil(k/128)] holds one row of k-block scales per token (SFA: M granularity
// 1, K-major) and w_scale[e] [ceil(n/128), ceil(k/128)] is the checkpoint's weight_scale_inv
// (SFB: 128 x 128, K-major).
// NOTE: in grouped mode CUTLASS 4.2 rebuilds each group's scale layout from that group's problem
// shape (ScaleConfig::tile_atom_to_shape_SFA/SFB), so each group's scale pointer must address a
// compact block of its own rows. Token-major x scales are exactly that (x_scale + row0 *
// ceil(k/128)); M-major ones would have to be [ceil(k/128), rows_e] per expert, which is not the
// group-major layout the quantiser can write for cuBLASLt ([ceil(k/128), num_rows]: a stride of
// num_rows, not rows_e), so that route would need a per-expert transpose kernel.
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <mutex>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_cuda.h"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the CUTLASS FP8 grouped GEMM needs CUDA >= 12.3 (modifiable TMA descriptors on sm_90a)"
#endif

namespace relay::kernels {

namespace {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // <M, N, K> per group
using ElementIn = cutlass::float_e4m3_t;
using ElementOut = cutlass::bfloat16_t;
// x [rows, k] row-major; w[e] [n, k] row-major is the K x N column-major B; out [rows, n]
// row-major.
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignmentIn = 16;  // elements per 16 bytes (TMA's minimum): e4m3
constexpr int kAlignmentOut = 8;  // bf16

// One scale per (row, 128-block of k) for x and per 128 x 128 block for w, both K-major.
using ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, kFp8BlockSize, kFp8BlockSize,
                                              cute::GMMA::Major::K, cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Tile = Shape<_128, _128, Int<kFp8BlockSize>>;
using Cluster = Shape<_1, _2, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*,
    kAlignmentOut,  // no C operand: D = acc
    ElementOut, LayoutD*, kAlignmentOut, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementOut, float>>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn,
    cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentIn, ElementIn, cute::tuple<LayoutB*, LayoutSFB*>,
    kAlignmentIn, float, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using StrideA = Gemm::GemmKernel::InternalStrideA;
using StrideB = Gemm::GemmKernel::InternalStrideB;
using StrideD = Gemm::GemmKernel::InternalStrideD;
static_assert(std::is_same_v<LayoutSFA, Mainloop::InternalLayoutSFA> &&
              std::is_same_v<LayoutSFB, Mainloop::InternalLayoutSFB>);

// The device arrays CUTLASS reads per group, carved from one buffer.
struct GroupArgs {
  ProblemShape::UnderlyingProblemShape* shapes;
  const ElementIn** a;
  const ElementIn** b;
  ElementOut** d;
  const float** sfa;
  const float** sfb;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
};

__global__ void fill_fp8_group_args_kernel(Fp8BlockGroupedMatmulParams<bf16> p,
                                           GroupArgs g) {
  const int num_kb = (p.k + kFp8BlockSize - 1) / kFp8BlockSize;
  const int num_nb = (p.n + kFp8BlockSize - 1) / kFp8BlockSize;
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    const int64_t row0 = p.expert_offsets[e];
    const int rows = p.expert_offsets[e + 1] - static_cast<int>(row0);
    g.shapes[e] = {rows, p.n, p.k};
    g.a[e] = reinterpret_cast<const ElementIn*>(p.x) + row0 * p.k;
    g.b[e] = reinterpret_cast<const ElementIn*>(p.w) + static_cast<int64_t>(e) * p.n * p.k;
    g.d[e] = reinterpret_cast<ElementOut*>(p.out) + row0 * p.n;
    g.sfa[e] = p.x_scale + row0 * num_kb;
    g.sfb[e] = p.w_scale + static_cast<int64_t>(e) * num_nb * num_kb;
    // Packed strides: only the leading dimension is dynamic (K for x and w, N for out).
    StrideA sa{};
    StrideB sb{};
    StrideD sd{};
    get<0>(sa) = p.k;
    get<0>(sb) = p.k;
    get<0>(sd) = p.n;
    g.stride_a[e] = sa;
    g.stride_b[e] = sb;
    g.stride_d[e] = sd;
    // CUTLASS 4.2 re-derives these from the group's shape (see the file comment); they are written
    // because the kernel's arguments name them.
    g.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, p.n, p.k, 1));
    g.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, p.n, p.k, 1));
  }
}

// The per-group arrays for num_experts groups inside `base`, each on a 128-byte boundary; with
// base == nullptr only the total size is computed.
GroupArgs carve_group_args(void* base, int num_experts, size_t* total_bytes) {
  const size_t n = static_cast<size_t>(num_experts);
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
  *total_bytes = total;
  return g;
}

// One set of per-group arrays and one adapter per stream (cuda::per_stream), like cuBLASLt's
// workspace in blas.cu: calls on one stream reuse the arrays in order. Both
// buffers only grow, and growing retires the old buffer rather than freeing it, so a graph
// captured before still finds its arrays and workspace.
class CutlassFp8GroupedContext {
 public:
  static CutlassFp8GroupedContext& get(cudaStream_t s) {
    return cuda::per_stream<CutlassFp8GroupedContext>(s);
  }

  void run(const Fp8BlockGroupedMatmulParams<bf16>& p, cudaStream_t s) {
    std::lock_guard lock(mu_);
    size_t bytes = 0;
    carve_group_args(nullptr, p.num_experts, &bytes);
    const GroupArgs g = carve_group_args(
        arrays_.get(bytes, s, "fp8_block_grouped_matmul (CUTLASS) group arguments"), p.num_experts,
        &bytes);
    fill_fp8_group_args_kernel<<<1, 256, 0, s>>>(p, g);
    RELAY_CUDA_CHECK_LAUNCH("fill_fp8_group_args_kernel");
    // The arguments name only device arrays, so the adapter is initialised (TMA descriptor
    // templates, tile schedule, launch attributes) once per expert count and array placement.
    if (p.num_experts != num_experts_ || g.shapes != shapes_) {
      typename Gemm::Arguments args{
          cutlass::gemm::GemmUniversalMode::kGrouped,
          {p.num_experts, g.shapes, nullptr},  // problem shapes live on the device only
          {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb},
          {{}, nullptr, {}, g.d, g.stride_d},
          hw_info_};
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = 0.0f;
      cutlass::Status st = gemm_.can_implement(args);
      RELAY_CHECK(st == cutlass::Status::kSuccess,
                  "fp8_block_grouped_matmul (CUTLASS): cannot run n ", p.n, " k ", p.k, ": ",
                  cutlassGetStatusString(st));
      void* workspace =
          workspace_.get(Gemm::get_workspace_size(args), s, "fp8_block_grouped_matmul (CUTLASS)");
      st = gemm_.initialize(args, workspace, s);
      RELAY_CHECK(
          st == cutlass::Status::kSuccess,
          "fp8_block_grouped_matmul (CUTLASS): initialize failed: ", cutlassGetStatusString(st));
      num_experts_ = p.num_experts;
      shapes_ = g.shapes;
    }
    const cutlass::Status st = gemm_.run(s);
    RELAY_CHECK(st == cutlass::Status::kSuccess,
                "fp8_block_grouped_matmul (CUTLASS): launch failed: ", cutlassGetStatusString(st));
    RELAY_CUDA_CHECK_LAUNCH("CUTLASS FP8 block-scaled grouped GEMM");
  }

  CutlassFp8GroupedContext() {  // on the current device (per_stream)
    int device = 0;
    RELAY_CUDA_CHECK(cudaGetDevice(&device));
    hw_info_.device_id = device;
    hw_info_.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }

 private:

  std::mutex mu_;
  cutlass::KernelHardwareInfo hw_info_;
  cuda::DeviceWorkspace arrays_;
  cuda::DeviceWorkspace workspace_;
  Gemm gemm_;
  // What gemm_ was initialised for: the expert count and where its arrays start.
  int num_experts_ = -1;
  const void* shapes_ = nullptr;
};

bool aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

void launch_fp8_block_grouped_matmul_cutlass(const Fp8BlockGroupedMatmulParams<bf16>& p,
                                             cudaStream_t s) {
  RELAY_CHECK(p.block_n == kFp8BlockSize && p.block_k == kFp8BlockSize,
              "fp8_block_grouped_matmul (CUTLASS): blocks ", p.block_n, "x", p.block_k,
              " are not supported (only 128x128)");
  RELAY_CHECK(fp8_block_grouped_matmul_cutlass_supported(p.n, p.k),
              "fp8_block_grouped_matmul (CUTLASS): n ", p.n, " and k ", p.k,
              " must be positive multiples of 8 and 16 (TMA moves 16-byte rows of x, w and out)");
  RELAY_CHECK(aligned_16(p.x) && aligned_16(p.w) && aligned_16(p.out),
              "fp8_block_grouped_matmul (CUTLASS): x, w and out must be 16-byte aligned for TMA");
  RELAY_CHECK(p.num_rows >= 0 && p.num_experts > 0 && p.expert_offsets != nullptr,
              "fp8_block_grouped_matmul (CUTLASS): rows ", p.num_rows, ", experts ", p.num_experts,
              " (expert_offsets must be set)");
  if (p.num_rows == 0) return;
  CutlassFp8GroupedContext::get(s).run(p, s);
}

}  // namespace relay::kernels

// MoE grouped GEMM through CUTLASS's Hopper grouped kernel: out[r] = x[r] @ w[e]^T for the rows r
// of each expert e, one GEMM "group" per expert.
//
// The kernel is CUTLASS 4's sm90 ptr-array grouped GEMM: persistent CTAs walk a tile schedule over
// every group, TMA loads A/B tiles into a multi-stage shared-memory ring filled by a producer warp,
// wgmma consumes them (bf16 in, fp32 accumulate) and a TMA epilogue stores bf16. Each group needs
// its own A/B/D pointers and problem shape on the device; a one-CTA kernel writes them from
// expert_offsets, so — as with the hand-written tiled kernel — the host never reads the routing and
// the whole thing can be captured in a CUDA graph. Experts with no rows are groups with M = 0,
// which the tile schedule skips.
//
// Two configurations, chosen by rows per expert (the measured crossover is in grouped_gemm.cu):
// cooperative 128x256x64 tiles in 2x1 clusters (two consumer warp groups share a tile; the cluster
// multicasts the weight tile to both M halves) for prefill, and ping-pong 64x128x64 tiles (two warp
// groups alternate tiles, one's epilogue overlapping the other's math) when experts hold few rows.
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <mutex>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the CUTLASS grouped GEMM needs CUDA >= 12.3 (modifiable TMA descriptors on sm_90a)"
#endif

namespace relay::kernels {

namespace {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // <M, N, K> per group
using Element = cutlass::bfloat16_t;
// x [rows, k] row-major; w[e] [n, k] row-major is the K x N column-major B; out [rows, n]
// row-major.
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignment = 8;  // 16 bytes of bf16: TMA's minimum

template <class Tile, class Cluster, class KernelSchedule, class EpilogueSchedule>
struct GroupedGemmConfig {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*,
      kAlignment,  // no C operand: D = acc
      Element, LayoutD*, kAlignment, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment, Element,
      LayoutB*, kAlignment, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using CooperativeGemm =
    GroupedGemmConfig<Shape<_128, _256, _64>, Shape<_2, _1, _1>,
                      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::Gemm;
using PingpongGemm = GroupedGemmConfig<Shape<_64, _128, _64>, Shape<_1, _1, _1>,
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>::Gemm;

// Both configurations share operand types, so one set of per-group argument arrays serves both.
using StrideA = CooperativeGemm::GemmKernel::InternalStrideA;
using StrideB = CooperativeGemm::GemmKernel::InternalStrideB;
using StrideD = CooperativeGemm::GemmKernel::InternalStrideD;
static_assert(std::is_same_v<StrideA, PingpongGemm::GemmKernel::InternalStrideA> &&
              std::is_same_v<StrideD, PingpongGemm::GemmKernel::InternalStrideD>);

// The device arrays CUTLASS reads per group. One set per stream (cuda::per_stream), like cuBLASLt's
// workspace in blas.cu: consecutive calls on a stream reuse them in order.
struct GroupArgs {
  ProblemShape::UnderlyingProblemShape* shapes;
  const Element** a;
  const Element** b;
  Element** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
};

__global__ void fill_group_args_kernel(MoeGroupedMatmulParams<bf16> p, GroupArgs g) {
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    const int64_t row0 = p.expert_offsets[e];
    const int rows = p.expert_offsets[e + 1] - static_cast<int>(row0);
    g.shapes[e] = {rows, p.n, p.k};
    g.a[e] = reinterpret_cast<const Element*>(p.x) + row0 * p.k;
    g.b[e] = reinterpret_cast<const Element*>(p.w) + static_cast<int64_t>(e) * p.n * p.k;
    g.d[e] = reinterpret_cast<Element*>(p.out) + row0 * p.n;
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
  }
}

template <class Gemm>
struct GemmRunner {
  Gemm gemm;
  int num_experts = -1;
};

class CutlassGroupedContext {
 public:
  static CutlassGroupedContext& get(cudaStream_t s) { return cuda::per_stream<CutlassGroupedContext>(s); }

  template <class Gemm>
  void run(GemmRunner<Gemm>& runner, const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s) {
    std::lock_guard lock(mu_);
    reserve(p.num_experts, s);
    fill_group_args_kernel<<<1, 256, 0, s>>>(p, args_);
    RELAY_CUDA_CHECK_LAUNCH("fill_group_args_kernel");
    // The arguments name only device arrays whose addresses never change, so the adapter is
    // initialised (TMA descriptor templates, tile schedule, launch attributes) once per expert
    // count.
    if (runner.num_experts != p.num_experts) {
      typename Gemm::Arguments args{
          cutlass::gemm::GemmUniversalMode::kGrouped,
          {p.num_experts, args_.shapes, nullptr},  // problem shapes live on the device only
          {args_.a, args_.stride_a, args_.b, args_.stride_b},
          {{}, nullptr, {}, args_.d, args_.stride_d},
          hw_info_};
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = 0.0f;
      if (grow(workspace_, workspace_bytes_, Gemm::get_workspace_size(args), s)) {
        cooperative.num_experts = pingpong.num_experts = -1;  // they hold the old workspace
      }
      cutlass::Status st = runner.gemm.can_implement(args);
      RELAY_CHECK(st == cutlass::Status::kSuccess, "moe_grouped_matmul (CUTLASS): cannot run n ",
                  p.n, " k ", p.k, ": ", cutlassGetStatusString(st));
      st = runner.gemm.initialize(args, workspace_, s);
      RELAY_CHECK(st == cutlass::Status::kSuccess,
                  "moe_grouped_matmul (CUTLASS): initialize failed: ", cutlassGetStatusString(st));
      runner.num_experts = p.num_experts;
    }
    const cutlass::Status st = runner.gemm.run(s);
    RELAY_CHECK(st == cutlass::Status::kSuccess,
                "moe_grouped_matmul (CUTLASS): launch failed: ", cutlassGetStatusString(st));
    RELAY_CUDA_CHECK_LAUNCH("CUTLASS grouped GEMM");
  }

  GemmRunner<CooperativeGemm> cooperative;
  GemmRunner<PingpongGemm> pingpong;

  CutlassGroupedContext() {  // on the current device (per_stream)
    int device = 0;
    RELAY_CUDA_CHECK(cudaGetDevice(&device));
    hw_info_.device_id = device;
    hw_info_.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }

 private:

  // Grows a device buffer (its old contents are not kept); never while a graph is being captured
  // (cudaMalloc would break the capture), which the engine's eager warm-up step rules out.
  // Returns whether it reallocated.
  static bool grow(void*& buffer, size_t& bytes, size_t need, cudaStream_t s) {
    need = std::max<size_t>(need, 256);
    if (need <= bytes) return false;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    RELAY_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
    RELAY_CHECK(capture == cudaStreamCaptureStatusNone, "moe_grouped_matmul (CUTLASS): needs ",
                need,
                " bytes of new workspace inside a CUDA "
                "graph capture; run the shape once eagerly first");
    // NOTE: the old buffer is retired, not freed, and the new one allocated in stream order: a
    // graph captured before may still use the old one, and cudaFree / cudaMalloc may wait for the
    // whole device, where a sharded rank's peers may be spinning in a collective that waits for
    // this rank.
    RELAY_CUDA_CHECK(cudaMallocAsync(&buffer, need, s));
    bytes = need;
    return true;
  }

  // Lays out the per-group arrays for num_experts groups.
  void reserve(int num_experts, cudaStream_t s) {
    if (num_experts <= capacity_) return;
    const size_t n = static_cast<size_t>(num_experts);
    // Each array starts on a 128-byte boundary.
    auto round = [](size_t bytes) { return (bytes + 127) / 128 * 128; };
    const size_t sizes[] = {round(n * sizeof(*args_.shapes)), round(n * sizeof(void*)),
                            round(n * sizeof(void*)),         round(n * sizeof(void*)),
                            round(n * sizeof(StrideA)),       round(n * sizeof(StrideB)),
                            round(n * sizeof(StrideD))};
    size_t total = 0;
    for (size_t b : sizes) total += b;
    grow(buffer_, buffer_bytes_, total, s);
    char* at = static_cast<char*>(buffer_);
    auto take = [&](auto*& ptr, size_t bytes) {
      ptr = reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(at);
      at += bytes;
    };
    take(args_.shapes, sizes[0]);
    take(args_.a, sizes[1]);
    take(args_.b, sizes[2]);
    take(args_.d, sizes[3]);
    take(args_.stride_a, sizes[4]);
    take(args_.stride_b, sizes[5]);
    take(args_.stride_d, sizes[6]);
    capacity_ = num_experts;
    // The adapters captured the old array addresses.
    cooperative.num_experts = pingpong.num_experts = -1;
  }

  std::mutex mu_;
  cutlass::KernelHardwareInfo hw_info_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  void* buffer_ = nullptr;
  size_t buffer_bytes_ = 0;
  int capacity_ = 0;
  GroupArgs args_{};
};

}  // namespace

void launch_moe_grouped_matmul_cutlass(const MoeGroupedMatmulParams<bf16>& p, bool cooperative,
                                       cudaStream_t s) {
  RELAY_CHECK(p.k % kAlignment == 0 && p.n % kAlignment == 0, "moe_grouped_matmul (CUTLASS): n ",
              p.n, " and k ", p.k, " must be multiples of ", kAlignment);
  if (p.num_rows == 0) return;
  CutlassGroupedContext& ctx = CutlassGroupedContext::get(s);
  if (cooperative) {
    ctx.run(ctx.cooperative, p, s);
  } else {
    ctx.run(ctx.pingpong, p, s);
  }
}

}  // namespace relay::kernels

// Gated DeltaNet's decode step in one kernel (GatedDeltaNetStepParams in kernels/ops.h; its CPU
// reference runs the conv, the recurrence and the gated norm in turn): a decode or verification
// step's conv, recurrence and gated norm. It keeps the
// decode form's CTA per (sequence, value head, Columns state columns) and makes the CTAs of one
// (sequence, key head), its value heads' column blocks, a cluster. The conv's q and k channels of
// the key head feed every CTA of the cluster, so they are split among its CTAs: each convolves
// its share and stores the results into every CTA's shared memory (DSMEM), and each conv state
// thus has exactly one reader and writer in the grid, the thread of its channel (a CTA's v
// channels are its own columns'). The gated norm's sum of squares over a value head's columns
// adds up the partial sums its CTAs store into one another the same way. Two cluster barriers per
// token, one after each exchange; both exchanges alternate between two buffers by token parity,
// so a CTA a token ahead never overwrites what another still reads.
#include <cooperative_groups.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gated_delta_net.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;
using namespace gdn;
namespace cg = cooperative_groups;

namespace {

constexpr int kStepMaxCluster = 8;  // the portable cluster size

struct StepShape {
  int columns = 0;     // state columns per CTA: 32 or 64
  int cluster = 0;     // CTAs per (sequence, key head)
  int qk_per_cta = 0;  // q and k channels each CTA convolves
};

StepShape step_shape(int num_k_heads, int num_v_heads, int key_dim, int value_dim) {
  if (num_k_heads <= 0 || num_v_heads % num_k_heads != 0 || key_dim > 128) return {};
  const int ratio = num_v_heads / num_k_heads;
  for (const int columns : {32, 64}) {
    const int cluster = ratio * static_cast<int>(ceil_div(value_dim, columns));
    const int per = static_cast<int>(ceil_div(2 * key_dim, cluster));
    // A thread per conv channel: the CTA's q and k share and then its columns' v.
    if (cluster <= kStepMaxCluster && per + columns <= kParts * columns) return {columns, cluster, per};
  }
  return {};
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

template <int MaxDk, int Columns>
__global__ void __launch_bounds__(kParts * Columns)
    gated_delta_net_step_kernel(GatedDeltaNetStepParams<bf16> p, StepShape shape) {
  constexpr int kRows = MaxDk / kParts;
  __shared__ float qk[2][2 * MaxDk];                // the key head's conv'd q | k, by token parity
  __shared__ float sum_sq[2][kStepMaxCluster];      // the value head's partial sums, by parity
  __shared__ float v_conv[Columns];                 // the conv'd v of this CTA's columns
  __shared__ float q[MaxDk], k[MaxDk];              // normalised
  __shared__ float scratch[32];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int group = blockIdx.x / shape.cluster;  // (sequence, key head)
  const int s = group / p.num_k_heads, kh = group % p.num_k_heads;
  const int dk = p.key_dim, dv = p.value_dim, hk = p.num_k_heads, hv = p.num_v_heads;
  const int column_blocks = (dv + Columns - 1) / Columns;  // CTAs per value head
  const int h = kh * (hv / hk) + rank / column_blocks;
  const int head_rank0 = rank - rank % column_blocks;  // the value head's first CTA
  const int j0 = rank % column_blocks * Columns;
  const int tid = threadIdx.x, part = tid % kParts, j = j0 + tid / kParts;
  const bool owns = j < dv;
  const int conv_dim = p.conv_dim(), width = p.kernel_size - 1;
  const int slot = p.state_slots[s];  // -1: graph padding, zeros in and nothing kept
  const bool fresh = slot < 0 || p.state_fresh[s];

  // This thread's conv channel, if any: the CTA's share of the key head's q | k, then its v.
  int channel = -1, qk_index = -1, v_index = -1;
  if (tid < shape.qk_per_cta) {
    const int c = rank * shape.qk_per_cta + tid;
    if (c < 2 * dk) {
      qk_index = c;
      channel = (c < dk ? kh : hk + kh) * dk + c % dk;
    }
  } else if (tid - shape.qk_per_cta < Columns) {
    v_index = tid - shape.qk_per_cta;
    if (j0 + v_index < dv) channel = 2 * hk * dk + h * dv + j0 + v_index;
  }
  float taps[kMaxConvWidth + 1], w[kMaxConvWidth];  // the inputs before the token, oldest first
  float* conv_state = nullptr;
  if (channel >= 0) {
    load_conv_taps(p.conv_weight, channel, p.kernel_size, taps);
    if (slot >= 0) conv_state = p.conv_states + slot * p.state_stride + static_cast<int64_t>(channel) * width;
#pragma unroll
    for (int i = 0; i < kMaxConvWidth; ++i) w[i] = i < width && !fresh ? conv_state[i] : 0.0f;
  }
  float* state = slot >= 0 ? head_state(p.states, p.state_stride, slot, h, dk, dv) : nullptr;
  float col[kRows];
  load_state_column<MaxDk>(state, fresh, dk, dv, j, part, col);
  const float a_rate = expf(p.a_log[h]);
  const float dt_bias = __bfloat162float(p.dt_bias[h]);
  const float norm_weight = owns ? __bfloat162float(p.norm_weight[j]) : 0.0f;
  const int64_t z_col = conv_dim + static_cast<int64_t>(h) * dv + j;
  const int64_t b_col = conv_dim + static_cast<int64_t>(hv) * dv + h;
  // Launched dependent (common.cuh): the loads above (weights, the step's metadata and the
  // states, which only this layer's op of an earlier step wrote) ran under in_proj's tail; its
  // output, the projections, only after the wait.
  wait_on_prior_grid();
  release_dependent_grid();
  // Every CTA of the cluster runs before any stores into its shared memory.
  cluster.sync();

  for (int t = p.query_starts[s], n = 0; t < p.query_starts[s + 1]; ++t, ++n) {
    const int buf = n & 1;
    const bf16* row = p.proj + t * p.proj_stride;
    // The token's gate inputs and its z, loaded with its conv input: each would otherwise be one
    // more round trip to L2 behind a barrier.
    const float b_in = __bfloat162float(row[b_col]), a_in = __bfloat162float(row[b_col + hv]);
    const float z = owns ? __bfloat162float(row[z_col]) : 0.0f;
    const int snapshot = p.snapshot_slots != nullptr ? p.snapshot_slots[t] : -1;
    if (channel >= 0) {
      // Rounded as the separate conv stores its output.
      const float y = round_bf16(conv_step(taps, w, width, __bfloat162float(row[channel])));
      if (snapshot >= 0) {
        float* snap = p.conv_states + snapshot * p.state_stride + static_cast<int64_t>(channel) * width;
#pragma unroll
        for (int i = 0; i < kMaxConvWidth; ++i) {
          if (i < width) snap[i] = w[i];
        }
      }
      if (qk_index >= 0) {
        for (int r = 0; r < shape.cluster; ++r) *cluster.map_shared_rank(&qk[buf][qk_index], r) = y;
      } else {
        v_conv[v_index] = y;
      }
    } else if (v_index >= 0) {
      v_conv[v_index] = 0.0f;
    }
    cluster.sync();  // q | k whole in every CTA, and this CTA's v

    normalise_qk<MaxDk>(tid < dk ? qk[buf][tid] : 0.0f, tid < dk ? qk[buf][dk + tid] : 0.0f, dk, q, k, scratch);
    const float2 gates = delta_rule_gates(b_in, a_in, a_rate, dt_bias);
    // Rounded as the separate recurrence stores its output.
    const float o = round_bf16(delta_rule_column_step<MaxDk>(col, q, k, part, owns ? v_conv[j - j0] : 0.0f, gates));
    if (owns && snapshot >= 0) {
      store_state_column<MaxDk>(head_state(p.states, p.state_stride, snapshot, h, dk, dv), dk, dv, j, part, col);
    }
    const float partial = block_sum(owns && part == 0 ? o * o : 0.0f, scratch);
    if (tid == 0) {
      for (int r = 0; r < column_blocks; ++r) {
        *cluster.map_shared_rank(&sum_sq[buf][rank - head_rank0], head_rank0 + r) = partial;
      }
    }
    cluster.sync();  // the value head's partial sums in each of its CTAs

    float sum = 0.0f;
    for (int r = 0; r < column_blocks; ++r) sum += sum_sq[buf][r];
    const float inv_rms = rsqrtf(sum / static_cast<float>(dv) + p.eps);
    if (owns && part == 0) {
      p.out[(static_cast<int64_t>(t) * hv + h) * dv + j] =
          __float2bfloat16(gated_norm(norm_weight, o, inv_rms, z));
    }
  }
  if (owns && state != nullptr) store_state_column<MaxDk>(state, dk, dv, j, part, col);
  if (conv_state != nullptr) {
#pragma unroll
    for (int i = 0; i < kMaxConvWidth; ++i) {
      if (i < width) conv_state[i] = w[i];
    }
  }
}

}  // namespace

bool gated_delta_net_step_fused(int num_k_heads, int num_v_heads, int key_dim, int value_dim) {
  return step_shape(num_k_heads, num_v_heads, key_dim, value_dim).columns > 0;
}

void launch_gated_delta_net_step(const GatedDeltaNetStepParams<bf16>& p, cudaStream_t s) {
  const StepShape shape = step_shape(p.num_k_heads, p.num_v_heads, p.key_dim, p.value_dim);
  RELAY_CHECK(shape.columns > 0, "gated_delta_net_step: no fused kernel for ", p.num_k_heads,
              " key heads, ", p.num_v_heads, " value heads, key_dim ", p.key_dim, " and value_dim ",
              p.value_dim, " (key_dim up to 128, at most ", kStepMaxCluster,
              " CTAs of 64 columns per key head); take the three ops");
  RELAY_CHECK(p.kernel_size >= 1 && p.kernel_size - 1 <= kMaxConvWidth,
              "gated_delta_net_step: kernel_size ", p.kernel_size, " (1 to ", kMaxConvWidth + 1, ")");
  if (p.num_seqs == 0 || p.num_tokens == 0) return;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(p.num_seqs * p.num_k_heads * shape.cluster));
  config.blockDim = dim3(static_cast<unsigned>(kParts * shape.columns));
  config.stream = s;
  cudaLaunchAttribute attrs[2]{};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = static_cast<unsigned>(shape.cluster);
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attrs;
  config.numAttrs = pdl_enabled() ? 2 : 1;
  auto launch = [&](auto kernel) { RELAY_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p, shape)); };
  const bool wide = shape.columns == 64;
  if (p.key_dim <= 32) {
    wide ? launch(gated_delta_net_step_kernel<32, 64>) : launch(gated_delta_net_step_kernel<32, 32>);
  } else if (p.key_dim <= 64) {
    wide ? launch(gated_delta_net_step_kernel<64, 64>) : launch(gated_delta_net_step_kernel<64, 32>);
  } else {
    wide ? launch(gated_delta_net_step_kernel<128, 64>) : launch(gated_delta_net_step_kernel<128, 32>);
  }
  RELAY_CUDA_CHECK_LAUNCH("gated_delta_net_step_kernel");
}

}  // namespace relay::kernels

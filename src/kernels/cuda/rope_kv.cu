// Fused per-head RMSNorm of q and k, rotate-half RoPE, and the paged HND KV-cache write.
//
// One warp per head (a token's heads spread over a row of CTAs): a warp normalises its head in fp32 (sum of squares by warp
// shuffle), rotates pairs (i, i + head_dim/2) in registers and writes q to q_out or k/v to the page
// at slot_mapping[t] ([block][kv_head][offset][head_dim]). cos/sin use full-precision sinf/cosf of
// the fp32 product position * inv_freq, as the CPU reference and transformers do: positions reach
// 10^5 and fast intrinsics lose the angle there.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kMaxHeadDim = 256;

__global__ void qk_norm_rope_kv_write_kernel(QkNormRopeKvWriteParams<bf16> p) {
  const int t = blockIdx.x;
  const int lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
  const int warp = blockIdx.y * num_warps + (threadIdx.x >> 5);  // this warp's first head
  const int head_stride = gridDim.y * num_warps;
  const int hd = p.head_dim, half = hd / 2;
  const QkvSections sec = qkv_sections(p.num_q_heads, p.num_kv_heads, hd, p.section_align);
  const bf16* src = p.qkv + t * sec.row;
  const float pos = static_cast<float>(p.positions[t]);
  const int64_t slot = p.slot_mapping[t];
  const int num_heads = p.num_q_heads + 2 * p.num_kv_heads;
  for (int h = warp; h < num_heads; h += head_stride) {
    const bf16* in =
        h < p.num_q_heads ? src + static_cast<int64_t>(h) * hd
        : h < p.num_q_heads + p.num_kv_heads
            ? src + sec.k_col + static_cast<int64_t>(h - p.num_q_heads) * hd
            : src + sec.v_col + static_cast<int64_t>(h - p.num_q_heads - p.num_kv_heads) * hd;
    if (h >= p.num_q_heads + p.num_kv_heads) {  // v: copied into the page unchanged
      if (slot < 0) continue;
      const int kv_h = h - p.num_q_heads - p.num_kv_heads;
      const int64_t block = slot / p.block_size, offset = slot % p.block_size;
      bf16* dst = p.v_cache + ((block * p.num_kv_heads + kv_h) * p.block_size + offset) * hd;
      for (int i = lane; i < hd; i += 32) dst[i] = in[i];
      continue;
    }
    const bool is_q = h < p.num_q_heads;
    if (!is_q && slot < 0) continue;
    const bf16* norm_w = is_q ? p.q_norm_weight : p.k_norm_weight;
    float lo[kMaxHeadDim / 64], hi[kMaxHeadDim / 64];
    float sum_sq = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxHeadDim / 64; ++j) {
      const int i = lane + 32 * j;
      lo[j] = hi[j] = 0.0f;
      if (i < half) {
        lo[j] = __bfloat162float(in[i]);
        hi[j] = __bfloat162float(in[i + half]);
        sum_sq += lo[j] * lo[j] + hi[j] * hi[j];
      }
    }
    const float inv_rms = rsqrtf(warp_sum(sum_sq) / hd + p.eps);
    bf16* dst;
    if (is_q) {
      dst = p.q_out + (static_cast<int64_t>(t) * p.num_q_heads + h) * hd;
    } else {
      const int kv_h = h - p.num_q_heads;
      const int64_t block = slot / p.block_size, offset = slot % p.block_size;
      dst = p.k_cache + ((block * p.num_kv_heads + kv_h) * p.block_size + offset) * hd;
    }
#pragma unroll
    for (int j = 0; j < kMaxHeadDim / 64; ++j) {
      const int i = lane + 32 * j;
      if (i < half) {
        const float a = __bfloat162float(norm_w[i]) * (lo[j] * inv_rms);
        const float b = __bfloat162float(norm_w[i + half]) * (hi[j] * inv_rms);
        const float angle = pos * p.inv_freq[i];
        const float c = cosf(angle) * p.attention_scaling, s = sinf(angle) * p.attention_scaling;
        dst[i] = __float2bfloat16(a * c - b * s);
        dst[i + half] = __float2bfloat16(b * c + a * s);
      }
    }
  }
}

}  // namespace

void launch_qk_norm_rope_kv_write(const QkNormRopeKvWriteParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.head_dim % 2 == 0 && p.head_dim <= kMaxHeadDim, "qk_norm_rope_kv_write: head_dim ",
              p.head_dim, " must be even and at most ", kMaxHeadDim);
  if (p.num_tokens == 0) return;
  // One warp per head, in CTAs of 8 warps: a decode step of a few tokens spreads its heads over
  // several SMs instead of queueing five heads per warp in one CTA.
  constexpr int kWarps = 8;
  const int num_heads = p.num_q_heads + 2 * p.num_kv_heads;
  const dim3 grid(p.num_tokens, ceil_div(num_heads, kWarps));
  qk_norm_rope_kv_write_kernel<<<grid, kWarps * 32, 0, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("qk_norm_rope_kv_write_kernel");
}

}  // namespace relay::kernels

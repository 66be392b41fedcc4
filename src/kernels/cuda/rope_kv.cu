// Fused per-head RMSNorm of q and k, rotate-half RoPE, and the paged HND KV-cache write.
//
// One warp per head (a token's heads spread over a row of CTAs): a warp normalises its head in fp32
// (sum of squares by warp shuffle), rotates pairs (i, i + head_dim/2) in registers, two adjacent
// elements per lane (4-byte loads and stores), and writes q to q_out or k/v to the page at
// slot_mapping[t] ([block][kv_head][offset][head_dim]). cos/sin are full-precision sincosf of the
// fp32 product position * inv_freq, as the CPU reference and transformers compute them: positions
// reach 10^5 and fast intrinsics lose the angle there.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kMaxHeadDim = 256;

__device__ __forceinline__ float2 bf16x2_to_f2(__nv_bfloat162 v) { return __bfloat1622float2(v); }

__global__ void qk_norm_rope_kv_write_kernel(QkNormRopeKvWriteParams<bf16> p) {
  // The token's cos/sin table, once per CTA: every q and k head of a token rotates by the same
  // angles, and full-precision sincosf is the costly part of the op.
  __shared__ float cos_s[kMaxHeadDim / 2], sin_s[kMaxHeadDim / 2];
  const int t = blockIdx.x;
  const int lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
  const int warp = blockIdx.y * num_warps + (threadIdx.x >> 5);  // this warp's first head
  const int head_stride = gridDim.y * num_warps;
  const int hd = p.head_dim, half = hd / 2, half2 = half / 2;  // half2: bf16 pairs per half
  const QkvSections sec = qkv_sections(p.num_q_heads, p.num_kv_heads, hd, p.section_align);
  const bf16* src = p.qkv + t * sec.row;
  const int64_t slot = p.slot_mapping[t];
  const float pos = static_cast<float>(p.positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float sn, cs;
    sincosf(pos * p.inv_freq[i], &sn, &cs);
    cos_s[i] = cs * p.attention_scaling;
    sin_s[i] = sn * p.attention_scaling;
  }
  __syncthreads();
  const int num_heads = p.num_q_heads + 2 * p.num_kv_heads;
  for (int h = warp; h < num_heads; h += head_stride) {
    const bf16* in =
        h < p.num_q_heads ? src + static_cast<int64_t>(h) * hd
        : h < p.num_q_heads + p.num_kv_heads
            ? src + sec.k_col + static_cast<int64_t>(h - p.num_q_heads) * hd
            : src + sec.v_col + static_cast<int64_t>(h - p.num_q_heads - p.num_kv_heads) * hd;
    const auto* in2 = reinterpret_cast<const __nv_bfloat162*>(in);
    if (h >= p.num_q_heads + p.num_kv_heads) {  // v: copied into the page unchanged
      if (slot < 0) continue;
      const int kv_h = h - p.num_q_heads - p.num_kv_heads;
      const int64_t block = slot / p.block_size, offset = slot % p.block_size;
      auto* dst = reinterpret_cast<__nv_bfloat162*>(
          p.v_cache + ((block * p.num_kv_heads + kv_h) * p.block_size + offset) * hd);
      for (int i = lane; i < hd / 2; i += 32) dst[i] = in2[i];
      continue;
    }
    const bool is_q = h < p.num_q_heads;
    if (!is_q && slot < 0) continue;
    const auto* norm_w = reinterpret_cast<const __nv_bfloat162*>(is_q ? p.q_norm_weight : p.k_norm_weight);
    // Lane pairs (2i, 2i + 1) of the first half and their partners in the second.
    float2 lo[kMaxHeadDim / 128], hi[kMaxHeadDim / 128];
    float sum_sq = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxHeadDim / 128; ++j) {
      const int i = lane + 32 * j;
      lo[j] = hi[j] = make_float2(0.0f, 0.0f);
      if (i < half2) {
        lo[j] = bf16x2_to_f2(in2[i]);
        hi[j] = bf16x2_to_f2(in2[i + half2]);
        sum_sq += lo[j].x * lo[j].x + lo[j].y * lo[j].y + hi[j].x * hi[j].x + hi[j].y * hi[j].y;
      }
    }
    const float inv_rms = rsqrtf(warp_sum(sum_sq) / hd + p.eps);
    __nv_bfloat162* dst;
    if (is_q) {
      dst = reinterpret_cast<__nv_bfloat162*>(p.q_out + (static_cast<int64_t>(t) * p.num_q_heads + h) * hd);
    } else {
      const int kv_h = h - p.num_q_heads;
      const int64_t block = slot / p.block_size, offset = slot % p.block_size;
      dst = reinterpret_cast<__nv_bfloat162*>(p.k_cache +
                                               ((block * p.num_kv_heads + kv_h) * p.block_size + offset) * hd);
    }
#pragma unroll
    for (int j = 0; j < kMaxHeadDim / 128; ++j) {
      const int i = lane + 32 * j;
      if (i < half2) {
        const float2 wl = bf16x2_to_f2(norm_w[i]), wh = bf16x2_to_f2(norm_w[i + half2]);
        const float a0 = wl.x * (lo[j].x * inv_rms), a1 = wl.y * (lo[j].y * inv_rms);
        const float b0 = wh.x * (hi[j].x * inv_rms), b1 = wh.y * (hi[j].y * inv_rms);
        const float c0 = cos_s[2 * i], c1 = cos_s[2 * i + 1], s0 = sin_s[2 * i], s1 = sin_s[2 * i + 1];
        dst[i] = __floats2bfloat162_rn(a0 * c0 - b0 * s0, a1 * c1 - b1 * s1);
        dst[i + half2] = __floats2bfloat162_rn(b0 * c0 + a0 * s0, b1 * c1 + a1 * s1);
      }
    }
  }
}

}  // namespace

void launch_qk_norm_rope_kv_write(const QkNormRopeKvWriteParams<bf16>& p, cudaStream_t s) {
  RELAY_CHECK(p.head_dim % 4 == 0 && p.head_dim <= kMaxHeadDim, "qk_norm_rope_kv_write: head_dim ",
              p.head_dim, " must be a multiple of 4 and at most ", kMaxHeadDim);
  if (p.num_tokens == 0) return;
  // CTAs of 8 warps. A decode step of a few tokens spreads a token's heads over a row of CTAs, one
  // warp per head, instead of queueing five heads per warp in one CTA; a prefill has CTAs enough
  // with one per token, and there the per-CTA cost (launch, the cos/sin table) was what limited it:
  // 4096 tokens x 40 heads, 5 CTAs per token, ran at a third of the copy bandwidth.
  constexpr int kWarps = 8, kOneCtaPerTokenFrom = 512;
  const int num_heads = p.num_q_heads + 2 * p.num_kv_heads;
  const dim3 grid(p.num_tokens, p.num_tokens >= kOneCtaPerTokenFrom ? 1 : ceil_div(num_heads, kWarps));
  qk_norm_rope_kv_write_kernel<<<grid, kWarps * 32, 0, s>>>(p);
  RELAY_CUDA_CHECK_LAUNCH("qk_norm_rope_kv_write_kernel");
}

}  // namespace relay::kernels

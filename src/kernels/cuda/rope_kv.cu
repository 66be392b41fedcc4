// Fused per-head RMSNorm of q and k, rotate-half RoPE (of the first rotary_dim dims: all of them in
// Qwen3, a quarter in Qwen3.5 / Qwen3-Next), and the paged HND KV-cache write.
//
// A head is held by head_dim / 8 lanes, eight consecutive elements (one 16-byte load and store)
// each, so a warp works on 32 * 8 / head_dim heads at once (two for head_dim 128): the lanes of the
// first half of a head meet their rotation partners, head_dim / 2 further on, in the lanes
// (head_dim / 16) away, by shuffle. The lane group normalises its head in fp32 (sum of squares by
// shuffles inside the group), rotates, and writes q to q_out or k/v to the page at slot_mapping[t]
// ([block][kv_head][offset][head_dim]). cos/sin are full-precision sincosf of the fp32 product
// position * inv_freq, as the CPU reference and transformers compute them: positions reach 10^5
// and fast intrinsics lose the angle there. Each CTA computes its token's table once.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops_cuda.h"

namespace relay::kernels {

using namespace cuda;

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kElemsPerLane = 8;  // one 16-byte vector of bf16

union Bf16x8 {
  uint4 v;
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ const bf16* head_input(const QkNormRopeKvWriteParams<bf16>& p,
                                                  const bf16* src, const QkvSections& sec, int h) {
  const int hd = p.head_dim;
  if (h < p.num_q_heads) return src + static_cast<int64_t>(h) * hd;
  if (h < p.num_q_heads + p.num_kv_heads) {
    return src + sec.k_col + static_cast<int64_t>(h - p.num_q_heads) * hd;
  }
  return src + sec.v_col + static_cast<int64_t>(h - p.num_q_heads - p.num_kv_heads) * hd;
}

__global__ void qk_norm_rope_kv_write_kernel(QkNormRopeKvWriteParams<bf16> p) {
  __shared__ float cos_s[kMaxHeadDim / 2], sin_s[kMaxHeadDim / 2];
  wait_on_prior_grid();  // launched dependent (common.cuh)
  release_dependent_grid();
  const int t = blockIdx.x;
  const int lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
  const int hd = p.head_dim;
  const int rd = p.rotary_dim == 0 ? hd : p.rotary_dim, half = rd / 2;  // rotated dims, their half
  const int group_lanes = hd / kElemsPerLane;      // lanes per head
  const int heads_per_warp = 32 / group_lanes;
  const int sub = lane % group_lanes;              // this lane's place in its head
  const int group = lane / group_lanes;
  const unsigned group_mask =
      group_lanes == 32 ? 0xffffffffu : ((1u << group_lanes) - 1u) << (group * group_lanes);
  // Partial rotary: the first rd / 8 lanes of a head rotate (their halves rd / 16 lanes apart),
  // the others pass their normed elements through. With rd 8 (a small head_dim's quarter) the
  // first lane holds both halves and rotates its own elements, four apart.
  const int rot_lanes = rd / kElemsPerLane;
  const bool in_lane = rot_lanes == 1;
  const bool rotates = sub < rot_lanes;
  const bool first_half = sub < rot_lanes / 2;
  const int elem = sub * kElemsPerLane;                         // within the head
  const int angle0 = first_half ? elem : elem - half;           // within the cos/sin table
  const QkvSections sec = qkv_sections(p.num_q_heads, p.num_kv_heads, hd, p.section_align);
  const bf16* src = p.qkv + t * sec.row;
  const int64_t slot = p.slot_mapping[t];
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const float pos = static_cast<float>(p.positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float sn, cs;
    sincosf(pos * p.inv_freq[i], &sn, &cs);
    cos_s[i] = cs * p.attention_scaling;
    sin_s[i] = sn * p.attention_scaling;
  }
  __syncthreads();
  const int num_heads = p.num_q_heads + 2 * p.num_kv_heads;
  const int first_head = (blockIdx.y * num_warps + (threadIdx.x >> 5)) * heads_per_warp + group;
  const int head_stride = gridDim.y * num_warps * heads_per_warp;
  for (int h = first_head; h < num_heads; h += head_stride) {
    const bool is_q = h < p.num_q_heads, is_v = h >= p.num_q_heads + p.num_kv_heads;
    if (!is_q && slot < 0) continue;
    Bf16x8 in;
    in.v = *reinterpret_cast<const uint4*>(head_input(p, src, sec, h) + elem);
    if (is_v) {  // copied into the page unchanged
      const int kv_h = h - p.num_q_heads - p.num_kv_heads;
      *reinterpret_cast<uint4*>(p.v_cache + ((block * p.num_kv_heads + kv_h) * p.block_size + offset) * hd +
                                elem) = in.v;
      continue;
    }
    float x[kElemsPerLane];
    float sum_sq = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(in.h[j]);
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
      sum_sq += f.x * f.x + f.y * f.y;
    }
    for (int o = group_lanes / 2; o > 0; o >>= 1) sum_sq += __shfl_xor_sync(group_mask, sum_sq, o);
    const float inv_rms = rsqrtf(sum_sq / hd + p.eps);
    Bf16x8 w;
    w.v = *reinterpret_cast<const uint4*>((is_q ? p.q_norm_weight : p.k_norm_weight) + elem);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(w.h[j]);
      x[2 * j] = f.x * (x[2 * j] * inv_rms);
      x[2 * j + 1] = f.y * (x[2 * j + 1] * inv_rms);
    }
    // out_first = a cos - b sin, out_second = b cos + a sin, a from the first half, b the second.
    Bf16x8 out;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float r[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int i = 2 * j + c;
        constexpr int kHalfLane = kElemsPerLane / 2;
        const float partner =
            in_lane ? x[i ^ kHalfLane] : __shfl_xor_sync(group_mask, x[i], rot_lanes / 2);
        if (!rotates) {
          r[c] = x[i];
          continue;
        }
        const int a = in_lane ? i % kHalfLane : angle0 + i;
        const bool first = in_lane ? i < kHalfLane : first_half;
        const float cs = cos_s[a], sn = sin_s[a];
        r[c] = first ? x[i] * cs - partner * sn : x[i] * cs + partner * sn;
      }
      out.h[j] = __floats2bfloat162_rn(r[0], r[1]);
    }
    bf16* dst = is_q ? p.q_out + (static_cast<int64_t>(t) * p.num_q_heads + h) * hd
                     : p.k_cache + ((block * p.num_kv_heads + (h - p.num_q_heads)) * p.block_size + offset) * hd;
    *reinterpret_cast<uint4*>(dst + elem) = out.v;
  }
}

}  // namespace

void launch_qk_norm_rope_kv_write(const QkNormRopeKvWriteParams<bf16>& p, cudaStream_t s) {
  // head_dim / 8 lanes per head must divide a warp, and each half hold whole 8-element vectors.
  const bool shape_ok = p.head_dim >= 16 && p.head_dim <= kMaxHeadDim && (p.head_dim & (p.head_dim - 1)) == 0;
  RELAY_CHECK(shape_ok, "qk_norm_rope_kv_write: head_dim ", p.head_dim,
              " must be a power of two from 16 to ", kMaxHeadDim);
  // The rotated dims' halves are whole lane groups a power of two apart (a shuffle by XOR), or
  // both in the first lane (8).
  const int rd = p.rotary_dim == 0 ? p.head_dim : p.rotary_dim;
  RELAY_CHECK(rd >= 8 && rd <= p.head_dim && (rd & (rd - 1)) == 0, "qk_norm_rope_kv_write: rotary_dim ",
              rd, " must be a power of two from 8 to head_dim ", p.head_dim);
  const QkvSections sec = qkv_sections(p.num_q_heads, p.num_kv_heads, p.head_dim, p.section_align);
  RELAY_CHECK(sec.row % kElemsPerLane == 0 && sec.k_col % kElemsPerLane == 0 && sec.v_col % kElemsPerLane == 0,
              "qk_norm_rope_kv_write: q|k|v sections must start on 16-byte boundaries (section_align ",
              p.section_align, ")");
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  RELAY_CHECK(aligned(p.qkv) && aligned(p.q_out) && aligned(p.k_cache) && aligned(p.v_cache) &&
                  aligned(p.q_norm_weight) && aligned(p.k_norm_weight),
              "qk_norm_rope_kv_write: qkv, q_out, the caches and the norm weights must be 16-byte aligned");
  if (p.num_tokens == 0) return;
  // CTAs of 8 warps. A decode step of a few tokens spreads a token's heads over a row of CTAs, one
  // lane group per head, instead of queueing heads per warp in one CTA; a prefill has CTAs enough
  // with one per token, and there the per-CTA cost (launch, the cos/sin table) was what limited it:
  // 4096 tokens x 40 heads, 5 CTAs per token, ran at a third of the copy bandwidth.
  constexpr int kWarps = 8, kOneCtaPerTokenFrom = 512;
  const int num_heads = p.num_q_heads + 2 * p.num_kv_heads;
  const int heads_per_cta = kWarps * (32 * kElemsPerLane / p.head_dim);
  const dim3 grid(p.num_tokens, p.num_tokens >= kOneCtaPerTokenFrom ? 1 : ceil_div(num_heads, heads_per_cta));
  launch_dependent("qk_norm_rope_kv_write_kernel", qk_norm_rope_kv_write_kernel, grid, dim3(kWarps * 32), 0, s, p);
}

}  // namespace relay::kernels

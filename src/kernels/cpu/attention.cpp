// CPU reference for attention: fused q/k-norm + RoPE + paged KV write, and paged GQA attention.
//
// Both follow Hugging Face's Qwen3Attention in fp32. The RoPE angle is the fp32 product
// position * inv_freq[i] and cos/sin are scaled by attention_scaling before use, as HF's
// rotary embedding does (with YaRN this is where mscale enters). With partial rotary (Qwen3.5),
// only the first rotary_dim dims of a head turn, exactly as HF's apply_rotary_pos_emb splits
// q[..., :rotary_dim] from the pass-through rest. Attention computes the scores of a
// query row against its whole visible context, then an exact softmax (max-subtracted, fp32) and the
// weighted sum of V — the same arithmetic as eager attention, with no online-softmax rescaling.
// Work is split over (token, q head) pairs; each task keeps its score row in thread-local scratch.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/simd.h"
#include "kernels/ops.h"

namespace relay::kernels {

using cpu::dot;

namespace {

// In-place RMSNorm of one head vector followed by rotate-half RoPE of its first rotary_dim dims.
void norm_rope_head(float* v, const float* norm_weight, int head_dim, int rotary_dim, float eps,
                    const float* cos_v, const float* sin_v) {
  float variance = dot(v, v, head_dim) / static_cast<float>(head_dim);
  float inv_rms = 1.0f / std::sqrt(variance + eps);
  for (int i = 0; i < head_dim; ++i) v[i] = norm_weight[i] * (v[i] * inv_rms);
  int half = rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    float a = v[i], b = v[i + half];
    // HF: q * cos + rotate_half(q) * sin, with rotate_half(q) = [-q2, q1] and cos/sin repeated
    // twice.
    v[i] = a * cos_v[i] + (-b) * sin_v[i];
    v[i + half] = b * cos_v[i] + a * sin_v[i];
  }
}

}  // namespace

void launch_qk_norm_rope_kv_write(const QkNormRopeKvWriteParams<float>& p, ThreadPool& pool) {
  const int hd = p.head_dim;
  const int rd = p.rotary_dim == 0 ? hd : p.rotary_dim;
  RELAY_CHECK(rd > 0 && rd % 2 == 0 && rd <= hd, "qk_norm_rope_kv_write: rotary_dim ", rd,
              " must be even and in (0, head_dim ", hd, "]");
  const QkvSections sec = qkv_sections(p.num_q_heads, p.num_kv_heads, hd, p.section_align);
  const int64_t row = sec.row;
  pool.parallel_for(p.num_tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> cos_v(rd / 2), sin_v(rd / 2), k(hd);
    for (int64_t t = begin; t < end; ++t) {
      float pos = static_cast<float>(p.positions[t]);
      for (int i = 0; i < rd / 2; ++i) {
        float angle = pos * p.inv_freq[i];
        cos_v[i] = std::cos(angle) * p.attention_scaling;
        sin_v[i] = std::sin(angle) * p.attention_scaling;
      }
      const float* src = p.qkv + t * row;
      float* q = p.q_out + t * static_cast<int64_t>(p.num_q_heads) * hd;
      std::copy_n(src, static_cast<int64_t>(p.num_q_heads) * hd, q);
      for (int h = 0; h < p.num_q_heads; ++h) {
        norm_rope_head(q + h * hd, p.q_norm_weight, hd, rd, p.eps, cos_v.data(), sin_v.data());
      }
      int64_t slot = p.slot_mapping[t];
      if (slot < 0) continue;
      int64_t block = slot / p.block_size, offset = slot % p.block_size;
      const float* k_src = src + sec.k_col;
      const float* v_src = src + sec.v_col;
      for (int h = 0; h < p.num_kv_heads; ++h) {
        int64_t dst = ((block * p.num_kv_heads + h) * p.block_size + offset) * hd;
        std::copy_n(k_src + h * hd, hd, k.data());
        norm_rope_head(k.data(), p.k_norm_weight, hd, rd, p.eps, cos_v.data(), sin_v.data());
        std::copy_n(k.data(), hd, p.k_cache + dst);
        std::copy_n(v_src + h * hd, hd, p.v_cache + dst);
      }
    }
  });
}

void launch_paged_attention(const PagedAttentionParams<float>& p, ThreadPool& pool) {
  const int hd = p.head_dim;
  const int group = p.num_q_heads / p.num_kv_heads;
  // Map each query row to its sequence once, so tasks can start anywhere.
  std::vector<int32_t> seq_of_token(p.num_tokens);
  for (int s = 0; s < p.num_seqs; ++s) {
    for (int t = p.query_starts[s]; t < p.query_starts[s + 1]; ++t) seq_of_token[t] = s;
  }
  int64_t num_tasks = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  pool.parallel_for(num_tasks, 4, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    std::vector<float> acc(hd);
    for (int64_t task = begin; task < end; ++task) {
      int t = static_cast<int>(task / p.num_q_heads);
      int h = static_cast<int>(task % p.num_q_heads);
      int kv_h = h / group;
      int s = seq_of_token[t];
      int num_new = p.query_starts[s + 1] - p.query_starts[s];
      int visible = p.context_lens[s] - num_new + (t - p.query_starts[s]) + 1;
      const int32_t* table = p.block_tables + static_cast<int64_t>(s) * p.max_blocks_per_seq;
      const float* q = p.q + task * hd;
      auto kv_offset = [&](int pos) {
        int64_t block = table[pos / p.block_size];
        return ((block * p.num_kv_heads + kv_h) * p.block_size + pos % p.block_size) * hd;
      };
      scores.resize(visible);
      float max_score = -INFINITY;
      for (int pos = 0; pos < visible; ++pos) {
        scores[pos] = dot(q, p.k_cache + kv_offset(pos), hd) * p.scale;
        max_score = std::max(max_score, scores[pos]);
      }
      float sum = 0.0f;
      for (int pos = 0; pos < visible; ++pos) {
        scores[pos] = std::exp(scores[pos] - max_score);
        sum += scores[pos];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float inv_sum = 1.0f / sum;
      for (int pos = 0; pos < visible; ++pos) {
        const float* v = p.v_cache + kv_offset(pos);
        float w = scores[pos] * inv_sum;
        for (int i = 0; i < hd; ++i) acc[i] += w * v[i];
      }
      std::copy(acc.begin(), acc.end(), p.out + task * hd);
    }
  });
}

}  // namespace relay::kernels

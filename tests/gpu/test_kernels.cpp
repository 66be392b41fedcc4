// Every CUDA kernel against its fp32 CPU reference (kernels/cpu) over a sweep of shapes: one token,
// odd sizes, experts with no tokens, large batches, decode with split-K. See gpu_test_util.h for the
// tolerance and the poisoning of outputs.
#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "engine/sampler.h"
#include "grammar/grammar.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace relay::gpu_test {
namespace {

using kernels::bf16;

TEST(GpuKernels, Embedding) {
  std::mt19937 rng(1);
  for (int num_tokens : {1, 37}) {
    const int vocab = 1000, hidden = 264;
    auto table = random_bf16(static_cast<size_t>(vocab) * hidden, rng);
    std::vector<int32_t> ids(num_tokens);
    for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
    std::vector<float> ref(static_cast<size_t>(num_tokens) * hidden);
    kernels::launch_embedding({ids.data(), table.f32.data(), ref.data(), num_tokens, hidden, vocab}, pool());
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<bf16> d_table(table.bits), d_out(ref.size());
    kernels::launch_embedding({d_ids.get(), d_table.get(), d_out.get(), num_tokens, hidden, vocab}, nullptr);
    EXPECT_EQ(rel_error(to_f32(d_out.download()), ref), 0.0) << "tokens " << num_tokens;
  }
}

TEST(GpuKernels, RmsNorm) {
  std::mt19937 rng(2);
  for (int num_tokens : {1, 7, 300}) {
    for (int hidden : {128, 2048, 4104}) {
      for (bool with_residual : {false, true}) {
        const size_t n = static_cast<size_t>(num_tokens) * hidden;
        auto x = random_bf16(n, rng), res = random_bf16(n, rng, 3.0f), w = random_bf16(hidden, rng);
        std::vector<float> ref(n), ref_res = res.f32;
        kernels::launch_rms_norm({x.f32.data(), with_residual ? ref_res.data() : nullptr, w.f32.data(), ref.data(),
                                  num_tokens, hidden, 1e-6f},
                                 pool());
        DeviceBuffer<bf16> d_x(x.bits), d_res(res.bits), d_w(w.bits), d_out(n);
        kernels::launch_rms_norm({d_x.get(), with_residual ? d_res.get() : nullptr, d_w.get(), d_out.get(), num_tokens,
                                  hidden, 1e-6f},
                                 nullptr);
        EXPECT_LT(rel_error(to_f32(d_out.download()), ref), kBf16Tolerance)
            << "tokens " << num_tokens << " hidden " << hidden << " residual " << with_residual;
        if (with_residual) {
          EXPECT_LT(rel_error(to_f32(d_res.download()), ref_res), kBf16Tolerance);
        }
      }
    }
  }
}

TEST(GpuKernels, Matmul) {
  std::mt19937 rng(3);
  // m up to kMaxStreamingRows runs both the weight-streaming kernel and cuBLASLt; n 100 leaves a
  // partial column tile, k 4104 an uneven last round of loads.
  for (int m : {1, 2, 3, 5, 8, 17, 300}) {
    for (auto [n, k] : {std::pair{64, 128}, std::pair{100, 4104}, std::pair{264, 2056}, std::pair{4096, 2048}}) {
      for (bool bias : {false, true}) {
        auto x = random_bf16(static_cast<size_t>(m) * k, rng), w = random_bf16(static_cast<size_t>(n) * k, rng, 0.05f);
        auto b = random_bf16(n, rng);
        std::vector<float> ref(static_cast<size_t>(m) * n);
        kernels::launch_matmul({x.f32.data(), w.f32.data(), bias ? b.f32.data() : nullptr, ref.data(), m, n, k}, pool());
        DeviceBuffer<bf16> d_x(x.bits), d_w(w.bits), d_b(b.bits);
        const kernels::MatmulParams<bf16> p{d_x.get(), d_w.get(), bias ? d_b.get() : nullptr, nullptr, m, n, k};
        for (auto kind : {kernels::DenseGemmKind::Auto, kernels::DenseGemmKind::Cublas, kernels::DenseGemmKind::Streaming}) {
          if (kind == kernels::DenseGemmKind::Streaming && !kernels::streaming_matmul_supported(p)) continue;
          DeviceBuffer<bf16> d_out(ref.size());
          auto q = p;
          q.out = d_out.get();
          kernels::launch_matmul(q, kind, nullptr);
          EXPECT_LT(rel_error(to_f32(d_out.download()), ref), kBf16Tolerance)
              << "m " << m << " n " << n << " k " << k << " bias " << bias << " " << kernels::dense_gemm_kind_name(kind);
        }
      }
    }
  }
}

TEST(GpuKernels, LmHead) {
  std::mt19937 rng(4);
  const int hidden = 256, vocab = 5003 - 3, num_tokens = 9;
  auto x = random_bf16(static_cast<size_t>(num_tokens) * hidden, rng), w = random_bf16(static_cast<size_t>(vocab) * hidden, rng, 0.1f);
  for (std::vector<int32_t> rows : {std::vector<int32_t>{8}, std::vector<int32_t>{0, 3, 4, 8}}) {
    const int num_rows = static_cast<int>(rows.size());
    std::vector<float> ref(static_cast<size_t>(num_rows) * vocab);
    kernels::launch_lm_head({x.f32.data(), rows.data(), w.f32.data(), ref.data(), num_rows, hidden, vocab}, pool());
    DeviceBuffer<bf16> d_x(x.bits), d_w(w.bits);
    DeviceBuffer<int32_t> d_rows(rows);
    DeviceBuffer<float> d_logits(ref.size());
    kernels::launch_lm_head({d_x.get(), d_rows.get(), d_w.get(), d_logits.get(), num_rows, hidden, vocab}, nullptr);
    EXPECT_LT(rel_error(d_logits.download(), ref), kBf16Tolerance) << "rows " << num_rows;
  }
}

TEST(GpuKernels, Swiglu) {
  std::mt19937 rng(5);
  for (int rows : {1, 33, 1000}) {
    for (int width : {192, 768}) {
      auto gu = random_bf16(static_cast<size_t>(rows) * 2 * width, rng, 2.0f);
      std::vector<float> ref(static_cast<size_t>(rows) * width);
      kernels::launch_swiglu({gu.f32.data(), ref.data(), rows, width}, pool());
      DeviceBuffer<bf16> d_gu(gu.bits), d_out(ref.size());
      kernels::launch_swiglu({d_gu.get(), d_out.get(), rows, width}, nullptr);
      EXPECT_LT(rel_error(to_f32(d_out.download()), ref), kBf16Tolerance) << "rows " << rows << " width " << width;
    }
  }
}

// A paged cache with a shuffled block pool, so logical order differs from physical order.
struct PagedSetup {
  int num_blocks, block_size, num_kv_heads, head_dim, max_blocks_per_seq;
  std::vector<int32_t> block_tables;
};

PagedSetup make_tables(const std::vector<int>& contexts, int block_size, int num_kv_heads, int head_dim,
                       std::mt19937& rng) {
  PagedSetup s{0, block_size, num_kv_heads, head_dim, 0, {}};
  for (int c : contexts) s.max_blocks_per_seq = std::max(s.max_blocks_per_seq, (c + block_size - 1) / block_size);
  s.num_blocks = s.max_blocks_per_seq * static_cast<int>(contexts.size()) + 3;
  std::vector<int32_t> ids(s.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  s.block_tables.assign(contexts.size() * s.max_blocks_per_seq, 0);
  int next = 0;
  for (size_t q = 0; q < contexts.size(); ++q) {
    const int used = (contexts[q] + block_size - 1) / block_size;
    for (int b = 0; b < used; ++b) s.block_tables[q * s.max_blocks_per_seq + b] = ids[next++];
  }
  return s;
}

TEST(GpuKernels, QkNormRopeKvWrite) {
  std::mt19937 rng(6);
  struct Case { int tokens, q_heads, kv_heads, head_dim, rotary_dim = 0; };
  for (Case c : {Case{1, 32, 4, 128}, Case{19, 32, 4, 128}, Case{5, 4, 2, 32}, Case{300, 16, 4, 64},
                 Case{600, 32, 4, 128}, Case{9, 6, 2, 256}, Case{33, 8, 8, 16},
                 // partial rotary: Qwen3.5 / Qwen3-Next (head_dim 256, a quarter rotated), and others
                 // (8 of 32: the hybrid test fixtures, both halves in one lane)
                 Case{7, 16, 2, 256, 64}, Case{700, 16, 2, 256, 64}, Case{5, 4, 2, 128, 32},
                 Case{3, 2, 1, 64, 16}, Case{6, 4, 2, 32, 8}}) {
    const int rd = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
    const int block_size = 16;
    PagedSetup s = make_tables({c.tokens + 40}, block_size, c.kv_heads, c.head_dim, rng);
    const int row = (c.q_heads + 2 * c.kv_heads) * c.head_dim;
    auto qkv = random_bf16(static_cast<size_t>(c.tokens) * row, rng, 2.0f);
    auto qn = random_bf16(c.head_dim, rng), kn = random_bf16(c.head_dim, rng);
    const size_t cache_n = static_cast<size_t>(s.num_blocks) * c.kv_heads * block_size * c.head_dim;
    auto kc = random_bf16(cache_n, rng), vc = random_bf16(cache_n, rng);
    std::vector<int32_t> positions(c.tokens);
    std::vector<int64_t> slots(c.tokens);
    for (int t = 0; t < c.tokens; ++t) {
      positions[t] = 40 + t + (t == 0 ? 70000 : 0);  // one far position checks the precise angle
      const int pos = 40 + t;
      slots[t] = (t % 7 == 3) ? -1 : int64_t{s.block_tables[pos / block_size]} * block_size + pos % block_size;
    }
    std::vector<float> inv_freq(rd / 2);
    for (int i = 0; i < rd / 2; ++i) inv_freq[i] = std::pow(1e6f, -2.0f * i / rd);
    std::vector<float> q_ref(static_cast<size_t>(c.tokens) * c.q_heads * c.head_dim), k_ref = kc.f32, v_ref = vc.f32;
    kernels::launch_qk_norm_rope_kv_write({qkv.f32.data(), qn.f32.data(), kn.f32.data(), positions.data(),
                                           inv_freq.data(), 1.0f, slots.data(), q_ref.data(), k_ref.data(),
                                           v_ref.data(), c.tokens, c.q_heads, c.kv_heads, c.head_dim, block_size, 1e-6f,
                                           0, c.rotary_dim},
                                          pool());
    DeviceBuffer<bf16> d_qkv(qkv.bits), d_qn(qn.bits), d_kn(kn.bits), d_q(q_ref.size()), d_k(kc.bits), d_v(vc.bits);
    DeviceBuffer<int32_t> d_pos(positions);
    DeviceBuffer<float> d_freq(inv_freq);
    DeviceBuffer<int64_t> d_slots(slots);
    kernels::launch_qk_norm_rope_kv_write({d_qkv.get(), d_qn.get(), d_kn.get(), d_pos.get(), d_freq.get(), 1.0f,
                                           d_slots.get(), d_q.get(), d_k.get(), d_v.get(), c.tokens, c.q_heads,
                                           c.kv_heads, c.head_dim, block_size, 1e-6f, 0, c.rotary_dim},
                                          nullptr);
    EXPECT_LT(rel_error(to_f32(d_q.download()), q_ref), kBf16Tolerance) << "tokens " << c.tokens << " rd " << rd;
    EXPECT_LT(rel_error(to_f32(d_k.download()), k_ref), kBf16Tolerance) << "tokens " << c.tokens << " rd " << rd;
    EXPECT_EQ(rel_error(to_f32(d_v.download()), v_ref), 0.0) << "tokens " << c.tokens;
  }
}

// seqs: (new tokens, context) pairs.
void check_attention(const std::vector<std::pair<int, int>>& seqs, int q_heads, int kv_heads, int head_dim,
                     int block_size, std::mt19937& rng,
                     kernels::PrefillAttentionKind kind = kernels::PrefillAttentionKind::Auto,
                     int decode_splits = -1) {  // >= 0: the decode kernel with this split count
  std::vector<int> contexts;
  std::vector<int32_t> query_starts{0}, context_lens;
  for (auto [n, ctx] : seqs) {
    contexts.push_back(ctx);
    context_lens.push_back(ctx);
    query_starts.push_back(query_starts.back() + n);
  }
  PagedSetup s = make_tables(contexts, block_size, kv_heads, head_dim, rng);
  const int num_tokens = query_starts.back(), num_seqs = static_cast<int>(seqs.size());
  const size_t cache_n = static_cast<size_t>(s.num_blocks) * kv_heads * block_size * head_dim;
  auto q = random_bf16(static_cast<size_t>(num_tokens) * q_heads * head_dim, rng);
  auto kc = random_bf16(cache_n, rng), vc = random_bf16(cache_n, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> ref(q.f32.size());
  kernels::launch_paged_attention({q.f32.data(), kc.f32.data(), vc.f32.data(), query_starts.data(), context_lens.data(),
                                   s.block_tables.data(), ref.data(), num_seqs, num_tokens, q_heads, kv_heads, head_dim,
                                   block_size, s.max_blocks_per_seq, scale},
                                  pool());
  DeviceBuffer<bf16> d_q(q.bits), d_k(kc.bits), d_v(vc.bits), d_out(ref.size());
  DeviceBuffer<int32_t> d_qs(query_starts), d_cl(context_lens), d_bt(s.block_tables);
  const kernels::PagedAttentionParams<bf16> p{d_q.get(), d_k.get(), d_v.get(), d_qs.get(), d_cl.get(), d_bt.get(),
                                              d_out.get(), num_seqs, num_tokens, q_heads, kv_heads, head_dim,
                                              block_size, s.max_blocks_per_seq, scale};
  if (decode_splits >= 0) {
    kernels::launch_decode_attention(p, decode_splits, nullptr);
  } else {
    kernels::launch_paged_attention(p, kind, nullptr);
  }
  EXPECT_LT(rel_error(to_f32(d_out.download()), ref), kBf16Tolerance)
      << kernels::prefill_attention_kind_name(kind) << " seqs " << num_seqs << " tokens " << num_tokens << " heads "
      << q_heads << "/" << kv_heads << " hd " << head_dim << " splits " << decode_splits;
}

TEST(GpuKernels, PagedAttentionPrefill) {
  std::mt19937 rng(7);
  check_attention({{1, 1}}, 32, 4, 128, 16, rng);
  check_attention({{77, 77}}, 32, 4, 128, 16, rng);
  check_attention({{50, 300}}, 32, 4, 128, 16, rng);  // chunked prefill over earlier context
  check_attention({{13, 13}, {100, 260}, {1, 40}, {64, 64}}, 32, 4, 128, 32, rng);
  check_attention({{37, 37}, {5, 90}}, 4, 2, 32, 16, rng);
  check_attention({{129, 200}}, 64, 4, 64, 16, rng);
  // head_dim 256 (Qwen3.5 / Qwen3-Next gated attention: 16 q heads over 2 KV heads, or 32 / 2)
  check_attention({{77, 77}, {30, 200}}, 16, 2, 256, 16, rng);
  check_attention({{300, 300}}, 32, 2, 256, 16, rng);
}

// Every prefill kernel over the shapes that stress its tiling: one-token and odd-length sequences,
// a tile's rows spanning sequences' ends, chunked prefill over earlier context, several sequences
// with decodes mixed in, block sizes from 4 (a 128-position tile spans 32 blocks) to 128, long
// prompts (many KV tiles, the heaviest-first order), both GQA groups of the targets and head_dim 256.
TEST(GpuKernels, PagedAttentionPrefillKernels) {
  using kernels::PrefillAttentionKind;
  std::mt19937 rng(17);
  for (auto kind : {PrefillAttentionKind::MmaSync, PrefillAttentionKind::Wgmma}) {
    check_attention({{1, 1}, {2, 2}}, 32, 4, 128, 16, rng, kind);
    check_attention({{77, 77}}, 32, 4, 128, 16, rng, kind);
    check_attention({{50, 300}}, 32, 4, 128, 16, rng, kind);
    check_attention({{13, 13}, {100, 260}, {1, 40}, {64, 64}}, 32, 4, 128, 32, rng, kind);
    check_attention({{129, 129}, {3, 700}}, 32, 4, 128, 4, rng, kind);
    check_attention({{200, 333}}, 32, 4, 128, 128, rng, kind);
    check_attention({{1000, 1000}}, 32, 4, 128, 16, rng, kind);
    check_attention({{65, 65}, {300, 500}}, 64, 4, 128, 16, rng, kind);
    check_attention({{31, 31}}, 16, 16, 128, 16, rng, kind);  // group 1: a tile holds 64 tokens
    // Qwen3.5's gated attention: head_dim 256, GQA 16/2 (the wgmma kernel's 64-position tiles).
    check_attention({{1, 1}, {70, 70}}, 16, 2, 256, 16, rng, kind);
    check_attention({{100, 260}, {5, 5}}, 16, 2, 256, 4, rng, kind);
    check_attention({{700, 700}}, 16, 2, 256, 32, rng, kind);
  }
}

// The decode kernel splits a context over CTAs (balanced over the actual context, so the short
// sequences of a batch with one long one get most of their splits empty) and over warps, and the
// last CTA of a split group merges it: repeated shapes check that its done-counters are reset.
TEST(GpuKernels, PagedAttentionDecode) {
  std::mt19937 rng(8);
  check_attention({{1, 1}}, 32, 4, 128, 16, rng);
  check_attention({{1, 2000}}, 32, 4, 128, 16, rng);  // split-K
  check_attention({{1, 2000}}, 32, 4, 128, 16, rng);
  check_attention({{1, 4097}}, 32, 4, 128, 16, rng);
  check_attention({{1, 16384}}, 64, 4, 128, 16, rng);
  std::vector<std::pair<int, int>> batch;
  for (int i = 0; i < 64; ++i) batch.push_back({1, 1 + static_cast<int>(rng() % 1500)});
  check_attention(batch, 32, 4, 128, 16, rng);
  check_attention(batch, 32, 4, 128, 16, rng);
  std::vector<std::pair<int, int>> wide;
  for (int i = 0; i < 256; ++i) wide.push_back({1, 1 + static_cast<int>(rng() % 600)});
  check_attention(wide, 32, 4, 128, 16, rng);
  check_attention({{1, 700}, {1, 3}, {1, 64}}, 64, 4, 128, 16, rng);
  check_attention({{1, 5000}, {1, 17}}, 64, 4, 128, 4, rng);   // a 16-position tile spans 4 blocks
  check_attention({{1, 3000}, {1, 129}}, 32, 4, 128, 128, rng);
  check_attention({{1, 900}, {1, 40}}, 64, 2, 128, 16, rng);   // group 32: two row tiles per KV head
  check_attention({{1, 12}, {1, 1000}}, 20, 4, 64, 16, rng);   // group 5
  check_attention({{1, 33}, {1, 300}}, 4, 2, 32, 16, rng);
  check_attention({{1, 40}, {1, 3000}}, 16, 2, 256, 16, rng);  // head_dim 256, split-K
  check_attention({{1, 700}}, 32, 2, 256, 16, rng);
}

// Every split count merges to the same attention (more splits than tiles leave empty splits).
TEST(GpuKernels, PagedAttentionDecodeAnySplitCount) {
  std::mt19937 rng(31);
  for (int splits : {1, 2, 7, 24, 64}) {
    check_attention({{1, 4097}}, 32, 4, 128, 16, rng, kernels::PrefillAttentionKind::Auto, splits);
    check_attention({{1, 300}, {1, 5}, {1, 1}}, 64, 4, 128, 16, rng, kernels::PrefillAttentionKind::Auto, splits);
  }
}

// Plain, and with the shared expert's routes (one and two parts) after the top_k, its gate logit in
// one more column.
TEST(GpuKernels, MoeRouterTopk) {
  std::mt19937 rng(9);
  for (int tokens : {1, 100}) {
    for (auto [experts, k] : {std::pair{16, 4}, std::pair{128, 8}}) {
      for (bool renorm : {false, true}) {
        for (int parts : {0, 1, 2}) {
          const int columns = experts + (parts > 0), routes = k + parts;
          auto logits = random_bf16(static_cast<size_t>(tokens) * columns, rng, 2.0f);
          std::vector<int32_t> ids_ref(static_cast<size_t>(tokens) * routes);
          std::vector<float> w_ref(ids_ref.size());
          kernels::launch_moe_router_topk(
              {logits.f32.data(), ids_ref.data(), w_ref.data(), tokens, experts, k, renorm, parts}, pool());
          DeviceBuffer<bf16> d_logits(logits.bits);
          DeviceBuffer<int32_t> d_ids(ids_ref.size());
          DeviceBuffer<float> d_w(w_ref.size());
          kernels::launch_moe_router_topk({d_logits.get(), d_ids.get(), d_w.get(), tokens, experts, k, renorm, parts},
                                          nullptr);
          EXPECT_EQ(d_ids.download(), ids_ref) << "tokens " << tokens << " experts " << experts << " parts " << parts;
          EXPECT_LT(rel_error(d_w.download(), w_ref), 1e-5);
        }
      }
    }
  }
}

// Routing with a skew so some experts get many rows and others none.
std::vector<int32_t> random_routing(int tokens, int experts, int k, std::mt19937& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * k);
  for (int t = 0; t < tokens; ++t) {
    std::vector<int32_t> pick(experts);
    std::iota(pick.begin(), pick.end(), 0);
    std::partial_sort(pick.begin(), pick.begin() + k, pick.end(), [&](int a, int b) {
      return (a % 3 == 0 ? 0.5 : 1.0) * (a + 1) * (rng() % 1000) < (b % 3 == 0 ? 0.5 : 1.0) * (b + 1) * (rng() % 1000);
    });
    std::shuffle(pick.begin(), pick.begin() + k, rng);
    std::copy_n(pick.begin(), k, ids.begin() + static_cast<size_t>(t) * k);
  }
  return ids;
}

TEST(GpuKernels, MoePermuteAndCombine) {
  std::mt19937 rng(10);
  // Up to 32 tokens (256 rows) one CTA ranks the rows, past it a CTA per expert.
  for (auto [tokens, hidden] : {std::pair{1, 64}, std::pair{5, 64}, std::pair{32, 64}, std::pair{33, 64},
                                std::pair{1000, 64}, std::pair{300, 2056}}) {
    const int experts = 128, k = 8;
    auto ids = random_routing(tokens, experts, k, rng);
    auto x = random_bf16(static_cast<size_t>(tokens) * hidden, rng);
    const size_t rows = ids.size();
    std::vector<float> px_ref(rows * hidden);
    std::vector<int32_t> pi_ref(rows), off_ref(experts + 1);
    kernels::launch_moe_permute({x.f32.data(), ids.data(), px_ref.data(), pi_ref.data(), off_ref.data(), tokens, hidden,
                                 experts, k},
                                pool());
    DeviceBuffer<bf16> d_x(x.bits), d_px(px_ref.size());
    DeviceBuffer<int32_t> d_ids(ids), d_pi(rows), d_off(experts + 1);
    kernels::launch_moe_permute({d_x.get(), d_ids.get(), d_px.get(), d_pi.get(), d_off.get(), tokens, hidden, experts, k},
                                nullptr);
    EXPECT_EQ(d_pi.download(), pi_ref) << "tokens " << tokens;
    EXPECT_EQ(d_off.download(), off_ref) << "tokens " << tokens;
    EXPECT_EQ(rel_error(to_f32(d_px.download()), px_ref), 0.0);

    auto expert_out = random_bf16(rows * hidden, rng);
    std::vector<float> weights(rows);
    for (auto& w : weights) w = static_cast<float>(rng() % 1000) / 1000.0f;
    std::vector<float> out_ref(static_cast<size_t>(tokens) * hidden);
    kernels::launch_moe_unpermute_combine({expert_out.f32.data(), pi_ref.data(), weights.data(), out_ref.data(), tokens,
                                           hidden, k},
                                          pool());
    DeviceBuffer<bf16> d_eo(expert_out.bits), d_out(out_ref.size());
    DeviceBuffer<float> d_w(weights);
    kernels::launch_moe_unpermute_combine({d_eo.get(), d_pi.get(), d_w.get(), d_out.get(), tokens, hidden, k}, nullptr);
    EXPECT_LT(rel_error(to_f32(d_out.download()), out_ref), kBf16Tolerance) << "tokens " << tokens;
  }
}

TEST(GpuKernels, MoeLocalizeExpertsAndCombineSkipsAbsentRows) {
  std::mt19937 rng(12);
  for (int tokens : {1, 37, 1000}) {
    const int experts = 128, k = 8, hidden = 64, begin = 32, local = 32;
    auto ids = random_routing(tokens, experts, k, rng);
    std::vector<float> w(ids.size());
    for (auto& v : w) v = static_cast<float>(rng() % 1000 + 1) / 1000.0f;
    std::vector<int32_t> ids_ref = ids;
    std::vector<float> w_ref = w;
    kernels::launch_moe_localize_experts({ids_ref.data(), w_ref.data(), static_cast<int>(ids.size()), begin, local},
                                         pool());
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> d_w(w);
    kernels::launch_moe_localize_experts({d_ids.get(), d_w.get(), static_cast<int>(ids.size()), begin, local}, nullptr);
    EXPECT_EQ(d_ids.download(), ids_ref) << "tokens " << tokens;
    EXPECT_EQ(d_w.download(), w_ref) << "tokens " << tokens;

    // The absent rows sort last and hold NaN (never computed): the combine must not read them.
    const size_t rows = ids.size();
    std::vector<int32_t> pi(rows), off(local + 2);
    kernels::launch_moe_permute({nullptr, ids_ref.data(), nullptr, pi.data(), off.data(), tokens, hidden, local + 1, k},
                                pool());
    auto expert_out = random_bf16(rows * hidden, rng);
    const uint16_t nan_bits = 0x7FC0;
    for (size_t r = static_cast<size_t>(off[local]) * hidden; r < rows * hidden; ++r) {
      expert_out.bits[r] = __nv_bfloat16_raw{nan_bits};
      expert_out.f32[r] = std::numeric_limits<float>::quiet_NaN();
    }
    std::vector<float> out_ref(static_cast<size_t>(tokens) * hidden);
    kernels::launch_moe_unpermute_combine({expert_out.f32.data(), pi.data(), w_ref.data(), out_ref.data(), tokens,
                                           hidden, k},
                                          pool());
    DeviceBuffer<bf16> d_eo(expert_out.bits), d_out(out_ref.size());
    DeviceBuffer<int32_t> d_pi(pi);
    kernels::launch_moe_unpermute_combine({d_eo.get(), d_pi.get(), d_w.get(), d_out.get(), tokens, hidden, k}, nullptr);
    EXPECT_LT(rel_error(to_f32(d_out.download()), out_ref), kBf16Tolerance) << "tokens " << tokens;
  }
}

// ---- Bounded expert ops (kernels::LiveRows, ops.h) ----------------------------------------------
// The kernels against the CPU reference with the bounds the backend passes under DP + EP:
// live_tokens = the receive counts (regions of `slots` tokens), copied_rows / live_rows = the
// permuted rows of this rank's experts (the absent id sorts last). Dead tokens hold garbage the
// kernels must not read (ids out of range, NaN rows and weights), the absent expert's rows are NaN
// (never computed), and every element a kernel must not write keeps the 0xFF poison.

constexpr uint16_t kBf16NaNBits = 0x7FC0;
constexpr uint16_t kBf16PoisonBits = 0xFFFF;  // DeviceBuffer's 0xFF bytes

uint16_t bf16_bits(bf16 v) { return static_cast<__nv_bfloat16_raw>(v).x; }

void set_bf16_nan(Bf16Data& d, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    d.bits[i] = __nv_bfloat16_raw{kBf16NaNBits};
    d.f32[i] = std::numeric_limits<float>::quiet_NaN();
  }
}

// An expert-parallel rank's receive buffer: counts.size() regions of `slots` tokens, region g
// filled up to counts[g]; ids local to experts [begin, begin + local) with the absent id `local`
// (weight 0) for the others. Dead tokens get ids out of range and NaN weights.
struct BoundedRouting {
  int tokens = 0;
  std::vector<int32_t> counts, ids;
  std::vector<float> weights;
  std::vector<char> live;  // [tokens]
};

BoundedRouting bounded_routing(const std::vector<int32_t>& counts, int slots, int experts,
                               int begin, int local, int k, std::mt19937& rng) {
  BoundedRouting b;
  b.tokens = static_cast<int>(counts.size()) * slots;
  b.counts = counts;
  b.ids = random_routing(b.tokens, experts, k, rng);
  b.weights.resize(b.ids.size());
  for (auto& w : b.weights) w = static_cast<float>(rng() % 1000 + 1) / 1000.0f;
  kernels::launch_moe_localize_experts(
      {b.ids.data(), b.weights.data(), static_cast<int>(b.ids.size()), begin, local}, pool());
  const kernels::LiveRows bound{b.counts.data(), slots};
  for (int t = 0; t < b.tokens; ++t) {
    b.live.push_back(kernels::is_live_row(bound, t));
    if (b.live.back()) continue;
    for (int j = 0; j < k; ++j) {
      b.ids[static_cast<size_t>(t) * k + j] = j % 2 ? 1 << 20 : -5;
      b.weights[static_cast<size_t>(t) * k + j] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  return b;
}

// The live rows of a [num_rows, width] tensor, as floats (to compare with rel_error).
std::vector<float> live_rows_of(const std::vector<float>& v, const std::vector<char>& live,
                                int width) {
  std::vector<float> out;
  for (size_t r = 0; r < live.size(); ++r) {
    if (live[r]) out.insert(out.end(), v.begin() + r * width, v.begin() + (r + 1) * width);
  }
  return out;
}

// How many elements of the rows not marked live lost their poison.
size_t written_dead_elements(const std::vector<bf16>& v, const std::vector<char>& live, int width) {
  size_t n = 0;
  for (size_t r = 0; r < live.size(); ++r) {
    if (live[r]) continue;
    for (int i = 0; i < width; ++i) n += bf16_bits(v[r * width + i]) != kBf16PoisonBits;
  }
  return n;
}

// A bounded op's output: its live rows match the reference and its dead rows kept their poison.
void expect_only_live_rows(const std::vector<bf16>& out, const std::vector<float>& ref,
                           const std::vector<char>& live, int width, const std::string& where) {
  EXPECT_LT(rel_error(live_rows_of(to_f32(out), live, width), live_rows_of(ref, live, width)),
            kBf16Tolerance)
      << where;
  EXPECT_EQ(written_dead_elements(out, live, width), 0u) << where << ": rows outside the bound written";
}

TEST(GpuKernels, MoeBoundedPermuteAndCombineTouchOnlyLiveRows) {
  std::mt19937 rng(13);
  struct Case {
    int slots, hidden;
    std::vector<int32_t> counts;
  };
  // A few tokens in a big buffer, full regions, counts above the region size, 8 regions, nothing.
  for (const Case& c :
       {Case{16, 64, {3, 0}}, Case{64, 2056, {64, 5}}, Case{300, 256, {250, 17, 0, 300}},
        Case{40, 64, {1, 0, 7, 300, 0, 2, 40, 1}}, Case{8, 64, {0, 0}}}) {
    const int experts = 128, begin = 32, local = 32, k = 8, hidden = c.hidden;
    const BoundedRouting b = bounded_routing(c.counts, c.slots, experts, begin, local, k, rng);
    const int tokens = b.tokens, rows = tokens * k;
    auto x = random_bf16(static_cast<size_t>(tokens) * hidden, rng);
    for (int t = 0; t < tokens; ++t) {
      if (!b.live[t])
        set_bf16_nan(x, static_cast<size_t>(t) * hidden, static_cast<size_t>(t + 1) * hidden);
    }
    const std::string where = "slots " + std::to_string(c.slots) + " regions " +
                              std::to_string(c.counts.size()) + " hidden " + std::to_string(hidden);

    std::vector<float> px_ref(static_cast<size_t>(rows) * hidden);
    std::vector<int32_t> pi_ref(rows, -1), off_ref(local + 2);
    kernels::MoePermuteParams<float> cp{x.f32.data(),  b.ids.data(),   px_ref.data(),
                                        pi_ref.data(), off_ref.data(), tokens,
                                        hidden,        local + 1,      k};
    cp.live_tokens = {b.counts.data(), c.slots};
    cp.copied_rows = {&off_ref[local], rows};
    kernels::launch_moe_permute(cp, pool());

    DeviceBuffer<bf16> d_x(x.bits), d_px(px_ref.size());
    DeviceBuffer<int32_t> d_ids(b.ids), d_counts(b.counts), d_pi(rows), d_off(local + 2);
    kernels::MoePermuteParams<bf16> gp{d_x.get(), d_ids.get(), d_px.get(), d_pi.get(), d_off.get(),
                                       tokens,    hidden,      local + 1,  k};
    gp.live_tokens = {d_counts.get(), c.slots};
    gp.copied_rows = {d_off.get() + local, rows};
    kernels::launch_moe_permute(gp, nullptr);
    EXPECT_EQ(d_off.download(), off_ref) << where;
    const auto pi = d_pi.download();
    size_t bad_index = 0;
    for (int r = 0; r < rows; ++r) bad_index += pi[r] != (b.live[r / k] ? pi_ref[r] : -1);
    EXPECT_EQ(bad_index, 0u) << where << ": index entries wrong (dead tokens' must stay unwritten)";
    // Rows of this rank's experts are copied; the absent expert's and the unused rows are not.
    const size_t copied = static_cast<size_t>(off_ref[local]) * hidden;
    const auto px = d_px.download();
    size_t bad_rows = 0;
    for (size_t i = 0; i < px.size(); ++i) {
      bad_rows += i < copied ? bf16_to_f32(bf16_bits(px[i])) != px_ref[i]
                             : bf16_bits(px[i]) != kBf16PoisonBits;
    }
    EXPECT_EQ(bad_rows, 0u) << where << ": permuted elements wrong or written past "
                            << off_ref[local] << " rows";

    // The combine over expert outputs whose uncomputed rows hold NaN, with the GPU's index (dead
    // tokens' entries still poison, -1) and NaN weights on the dead tokens.
    auto expert_out = random_bf16(static_cast<size_t>(rows) * hidden, rng);
    set_bf16_nan(expert_out, copied, expert_out.f32.size());
    std::vector<float> out_ref(static_cast<size_t>(tokens) * hidden);
    kernels::MoeUnpermuteCombineParams<float> cc{
        expert_out.f32.data(), pi_ref.data(), b.weights.data(), out_ref.data(), tokens, hidden, k};
    cc.live_tokens = cp.live_tokens;
    kernels::launch_moe_unpermute_combine(cc, pool());
    DeviceBuffer<bf16> d_eo(expert_out.bits), d_out(out_ref.size());
    DeviceBuffer<float> d_w(b.weights);
    kernels::MoeUnpermuteCombineParams<bf16> gc{d_eo.get(), d_pi.get(), d_w.get(), d_out.get(),
                                                tokens,     hidden,     k};
    gc.live_tokens = gp.live_tokens;
    kernels::launch_moe_unpermute_combine(gc, nullptr);
    expect_only_live_rows(d_out.download(), out_ref, b.live, hidden, where + " (combine)");
  }
}

// Permute -> SwiGLU -> combine with the bounds, captured once into a graph and replayed after the
// counts on the device change: the kernels must follow the counts they read, not the capture's.
TEST(GpuKernels, MoeBoundedOpsFollowTheDeviceCountsInAGraph) {
  std::mt19937 rng(14);
  const int experts = 64, begin = 16, local = 16, k = 4, width = 128, slots = 32;
  const std::vector<std::vector<int32_t>> rounds{{5, 0, 17}, {0, 32, 1}, {32, 32, 32}, {0, 0, 0}};
  BoundedRouting b = bounded_routing({slots, slots, slots}, slots, experts, begin, local, k, rng);
  const int tokens = b.tokens, rows = tokens * k;
  const auto x = random_bf16(static_cast<size_t>(tokens) * 2 * width, rng, 2.0f);
  DeviceBuffer<bf16> d_x(x.bits), d_px(static_cast<size_t>(rows) * 2 * width),
      d_act(static_cast<size_t>(rows) * width), d_out(static_cast<size_t>(tokens) * width);
  DeviceBuffer<int32_t> d_ids(b.ids), d_counts(rounds[0]), d_pi(rows), d_off(local + 2);
  DeviceBuffer<float> d_w(b.weights);
  const kernels::LiveRows live_tokens{d_counts.get(), slots}, computed{d_off.get() + local, rows};
  kernels::MoePermuteParams<bf16> pp{d_x.get(), d_ids.get(), d_px.get(), d_pi.get(), d_off.get(),
                                     tokens,    2 * width,   local + 1,  k};
  pp.live_tokens = live_tokens;
  pp.copied_rows = computed;
  kernels::SwigluParams<bf16> sp{d_px.get(), d_act.get(), rows, width};
  sp.live_rows = computed;
  kernels::MoeUnpermuteCombineParams<bf16> cp{d_act.get(), d_pi.get(), d_w.get(), d_out.get(),
                                              tokens,      width,      k};
  cp.live_tokens = live_tokens;

  cudaStream_t stream;
  GPU_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  GPU_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  kernels::launch_moe_permute(pp, stream);
  kernels::launch_swiglu(sp, stream);
  kernels::launch_moe_unpermute_combine(cp, stream);
  GPU_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  GPU_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (const std::vector<int32_t>& counts : rounds) {
    b.counts = counts;
    const kernels::LiveRows bound{b.counts.data(), slots};
    for (int t = 0; t < tokens; ++t) b.live[t] = kernels::is_live_row(bound, t);
    std::vector<float> px_ref(static_cast<size_t>(rows) * 2 * width),
        act_ref(static_cast<size_t>(rows) * width), out_ref(static_cast<size_t>(tokens) * width);
    std::vector<int32_t> pi_ref(rows), off_ref(local + 2);
    kernels::MoePermuteParams<float> cpp{x.f32.data(),  b.ids.data(),   px_ref.data(),
                                         pi_ref.data(), off_ref.data(), tokens,
                                         2 * width,     local + 1,      k};
    cpp.live_tokens = bound;
    kernels::launch_moe_permute(cpp, pool());
    kernels::SwigluParams<float> csp{px_ref.data(), act_ref.data(), rows, width};
    csp.live_rows = {&off_ref[local], rows};
    kernels::launch_swiglu(csp, pool());
    kernels::MoeUnpermuteCombineParams<float> ccp{
        act_ref.data(), pi_ref.data(), b.weights.data(), out_ref.data(), tokens, width, k};
    ccp.live_tokens = bound;
    kernels::launch_moe_unpermute_combine(ccp, pool());

    d_counts.upload(counts);  // on the legacy stream, as the poisoning; then wait for both
    d_px.poison(), d_act.poison(), d_out.poison(), d_pi.poison(), d_off.poison();
    GPU_TEST_CUDA(cudaDeviceSynchronize());
    GPU_TEST_CUDA(cudaGraphLaunch(exec, stream));
    GPU_TEST_CUDA(cudaStreamSynchronize(stream));
    const std::string where = "counts " + std::to_string(counts[0]) + " " +
                              std::to_string(counts[1]) + " " + std::to_string(counts[2]);
    EXPECT_EQ(d_off.download(), off_ref) << where;
    std::vector<char> act_live(rows, 0);
    std::fill_n(act_live.begin(), off_ref[local], 1);
    expect_only_live_rows(d_act.download(), act_ref, act_live, width, where + " (SwiGLU)");
    expect_only_live_rows(d_out.download(), out_ref, b.live, width, where + " (combine)");
  }
  GPU_TEST_CUDA(cudaGraphExecDestroy(exec));
  GPU_TEST_CUDA(cudaGraphDestroy(graph));
  GPU_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(GpuKernels, SwigluBoundedComputesOnlyLiveRows) {
  std::mt19937 rng(15);
  const int rows = 1000, width = 768;
  const std::vector<int32_t> region_counts{3, 0, 400};  // regions of 334 rows (the last 332)
  for (int prefix : {-1, 0, 1, 517, 1000}) {            // -1: the regions instead of a prefix
    const std::vector<int32_t> counts = prefix < 0 ? region_counts : std::vector<int32_t>{prefix};
    const int region_rows = prefix < 0 ? 334 : rows;
    const kernels::LiveRows bound{counts.data(), region_rows};
    std::vector<char> live(rows);
    for (int r = 0; r < rows; ++r) live[r] = kernels::is_live_row(bound, r);
    auto gu = random_bf16(static_cast<size_t>(rows) * 2 * width, rng, 2.0f);
    for (int r = 0; r < rows; ++r) {
      if (!live[r])
        set_bf16_nan(gu, static_cast<size_t>(r) * 2 * width,
                     static_cast<size_t>(r + 1) * 2 * width);
    }
    std::vector<float> ref(static_cast<size_t>(rows) * width);
    kernels::SwigluParams<float> cp{gu.f32.data(), ref.data(), rows, width};
    cp.live_rows = bound;
    kernels::launch_swiglu(cp, pool());
    DeviceBuffer<bf16> d_gu(gu.bits), d_out(ref.size());
    DeviceBuffer<int32_t> d_counts(counts);
    kernels::SwigluParams<bf16> gp{d_gu.get(), d_out.get(), rows, width};
    gp.live_rows = {d_counts.get(), region_rows};
    kernels::launch_swiglu(gp, nullptr);
    expect_only_live_rows(d_out.download(), ref, live, width, "prefix " + std::to_string(prefix));
  }
}
// ---- end of the bounded expert ops -------------------------------------------------------------

TEST(GpuKernels, MoeGroupedMatmul) {
  std::mt19937 rng(11);
  struct Case { int tokens, experts, k_top, n, k; };
  // {2, 16, 8, 200, 4096}: two rounds of weight loads per streaming CTA and a partial column tile;
  // {64, 4, 2, 256, 512}: 32 rows per expert, several passes of the streaming kernel over one expert;
  // {2048, 64, 4, 512, 256}: about 128 rows per expert, so the wgmma kernel's last tiles of an
  // expert hold one or two live halves, and its CTAs walk several tiles round the stage ring;
  // {1100, 16, 4, 384, 128} and {1800, 16, 4, 256, 64}: about 275 and 450 rows per expert, a full
  // 256-row tile and a second m tile of one to four live slabs (the latter in one k step);
  // {300, 8, 2, 336, 128}: partial last column tiles (80 of 128 columns, 40 of 64 fused SwiGLU's).
  for (Case c : {Case{1, 128, 8, 1536, 2048}, Case{3, 16, 4, 384, 128}, Case{64, 128, 8, 2048, 768},
                 Case{600, 128, 8, 1536, 2048}, Case{257, 8, 2, 264, 136}, Case{2, 16, 8, 200, 4096},
                 Case{64, 4, 2, 256, 512}, Case{2048, 64, 4, 512, 256}, Case{1100, 16, 4, 384, 128},
                 Case{1800, 16, 4, 256, 64}, Case{300, 8, 2, 336, 128}}) {
    auto ids = random_routing(c.tokens, c.experts, c.k_top, rng);
    const int rows = static_cast<int>(ids.size());
    std::vector<int32_t> offsets(c.experts + 1, 0);
    for (int32_t e : ids) ++offsets[e + 1];
    for (int e = 0; e < c.experts; ++e) offsets[e + 1] += offsets[e];
    auto x = random_bf16(static_cast<size_t>(rows) * c.k, rng);
    auto w = random_bf16(static_cast<size_t>(c.experts) * c.n * c.k, rng, 0.05f);
    std::vector<float> ref(static_cast<size_t>(rows) * c.n);
    kernels::launch_moe_grouped_matmul({x.f32.data(), w.f32.data(), offsets.data(), ref.data(), rows, c.experts, c.n, c.k},
                                       pool());
    DeviceBuffer<bf16> d_x(x.bits), d_w(w.bits);
    DeviceBuffer<int32_t> d_off(offsets);
    // The cases change the expert count between calls, so the CUTLASS adapters re-initialise.
    for (auto kind : {kernels::GroupedGemmKind::Tiled, kernels::GroupedGemmKind::Streaming,
                      kernels::GroupedGemmKind::CutlassCooperative, kernels::GroupedGemmKind::CutlassPingpong,
                      kernels::GroupedGemmKind::Wgmma}) {
      DeviceBuffer<bf16> d_out(ref.size());
      kernels::launch_moe_grouped_matmul({d_x.get(), d_w.get(), d_off.get(), d_out.get(), rows, c.experts, c.n, c.k}, kind,
                                         nullptr);
      EXPECT_LT(rel_error(to_f32(d_out.download()), ref), kBf16Tolerance)
          << "tokens " << c.tokens << " n " << c.n << " k " << c.k << " kind " << static_cast<int>(kind);
    }
    // The streaming kernel with settled offsets (the down projection's: its weight loads issued
    // before it waits on the kernel before) stores the same bits.
    {
      DeviceBuffer<bf16> d_waited(ref.size()), d_settled(ref.size());
      kernels::MoeGroupedMatmulParams<bf16> sp{d_x.get(), d_w.get(), d_off.get(), d_waited.get(),
                                               rows, c.experts, c.n, c.k};
      kernels::launch_moe_grouped_matmul(sp, kernels::GroupedGemmKind::Streaming, nullptr);
      sp.out = d_settled.get();
      sp.offsets_settled = true;
      kernels::launch_moe_grouped_matmul(sp, kernels::GroupedGemmKind::Streaming, nullptr);
      const std::vector<bf16> waited = d_waited.download(), settled = d_settled.download();
      EXPECT_EQ(0, std::memcmp(waited.data(), settled.data(), waited.size() * sizeof(bf16)))
          << "settled offsets, tokens " << c.tokens;
    }
    // The streaming and wgmma kernels with the SwiGLU fused: against the CPU's fused form, and bit
    // for bit against the same kernel's separate GEMM + swiglu on the GPU.
    if (c.n % 16 == 0) {
      const int width = c.n / 2;
      std::vector<float> fused_ref(static_cast<size_t>(rows) * width);
      kernels::MoeGroupedMatmulParams<float> cp{x.f32.data(), w.f32.data(), offsets.data(), fused_ref.data(),
                                                rows, c.experts, c.n, c.k};
      cp.swiglu = true;
      kernels::launch_moe_grouped_matmul(cp, pool());
      DeviceBuffer<bf16> d_gu(static_cast<size_t>(rows) * c.n), d_sep(fused_ref.size()), d_fused(fused_ref.size());
      kernels::launch_moe_grouped_matmul({d_x.get(), d_w.get(), d_off.get(), d_gu.get(), rows, c.experts, c.n, c.k},
                                         kernels::GroupedGemmKind::Streaming, nullptr);
      kernels::launch_swiglu({d_gu.get(), d_sep.get(), rows, width}, nullptr);
      kernels::MoeGroupedMatmulParams<bf16> gp{d_x.get(), d_w.get(), d_off.get(), d_fused.get(), rows, c.experts, c.n, c.k};
      gp.swiglu = true;
      kernels::launch_moe_grouped_matmul(gp, kernels::GroupedGemmKind::Streaming, nullptr);
      const std::vector<bf16> fused = d_fused.download(), separate = d_sep.download();
      EXPECT_LT(rel_error(to_f32(fused), fused_ref), kBf16Tolerance) << "swiglu, tokens " << c.tokens << " n " << c.n;
      EXPECT_EQ(0, std::memcmp(fused.data(), separate.data(), fused.size() * sizeof(bf16)))
          << "fused and separate SwiGLU differ, tokens " << c.tokens << " n " << c.n;
      // The wgmma kernel's fused form (gate and up halves of one tile): its own GEMM + swiglu's
      // bits, column tiles past n / 2 included.
      DeviceBuffer<bf16> d_wsep(fused_ref.size()), d_wfused(fused_ref.size());
      kernels::launch_moe_grouped_matmul(
          {d_x.get(), d_w.get(), d_off.get(), d_gu.get(), rows, c.experts, c.n, c.k},
          kernels::GroupedGemmKind::Wgmma, nullptr);
      kernels::launch_swiglu({d_gu.get(), d_wsep.get(), rows, width}, nullptr);
      gp.out = d_wfused.get();
      kernels::launch_moe_grouped_matmul(gp, kernels::GroupedGemmKind::Wgmma, nullptr);
      const std::vector<bf16> wfused = d_wfused.download(), wsep = d_wsep.download();
      EXPECT_LT(rel_error(to_f32(wfused), fused_ref), kBf16Tolerance)
          << "wgmma swiglu, tokens " << c.tokens;
      EXPECT_EQ(0, std::memcmp(wfused.data(), wsep.data(), wfused.size() * sizeof(bf16)))
          << "wgmma's fused and separate SwiGLU differ, tokens " << c.tokens << " n " << c.n;
      // The other kernels refuse instead of computing something else.
      EXPECT_THROW(kernels::launch_moe_grouped_matmul(gp, kernels::GroupedGemmKind::Tiled, nullptr), Error);
    }
    // Gathered rows: the unpermuted tokens and the permute's index give the bits the permuted copy
    // gives, with and without the SwiGLU (the row order is the CPU permute's, which the GPU's equals).
    if (rows <= kernels::kMaxGatheredRows && c.n % 16 == 0) {
      auto xt = random_bf16(static_cast<size_t>(c.tokens) * c.k, rng);
      std::vector<float> px(static_cast<size_t>(rows) * c.k);
      std::vector<int32_t> pidx(rows), offs(c.experts + 1);
      kernels::launch_moe_permute({xt.f32.data(), ids.data(), px.data(), pidx.data(), offs.data(), c.tokens, c.k,
                                   c.experts, c.k_top},
                                  pool());
      ASSERT_EQ(offs, offsets);
      std::vector<bf16> px_bits(px.size());
      for (int i = 0; i < rows; ++i) {
        std::copy_n(xt.bits.begin() + static_cast<size_t>(i / c.k_top) * c.k, c.k,
                    px_bits.begin() + static_cast<size_t>(pidx[i]) * c.k);
      }
      DeviceBuffer<bf16> d_xt(xt.bits), d_px(px_bits);
      DeviceBuffer<int32_t> d_pidx(pidx);
      for (bool swiglu : {false, true}) {
        const size_t out_n = static_cast<size_t>(rows) * (swiglu ? c.n / 2 : c.n);
        DeviceBuffer<bf16> d_copied(out_n), d_gathered(out_n);
        kernels::MoeGroupedMatmulParams<bf16> gp{d_px.get(), d_w.get(), d_off.get(), d_copied.get(), rows, c.experts, c.n, c.k};
        gp.swiglu = swiglu;
        kernels::launch_moe_grouped_matmul(gp, kernels::GroupedGemmKind::Streaming, nullptr);
        gp.x = d_xt.get();
        gp.out = d_gathered.get();
        gp.permuted_index = d_pidx.get();
        gp.top_k = c.k_top;
        kernels::launch_moe_grouped_matmul(gp, kernels::GroupedGemmKind::Streaming, nullptr);
        const std::vector<bf16> copied = d_copied.download(), gathered = d_gathered.download();
        EXPECT_EQ(0, std::memcmp(copied.data(), gathered.data(), out_n * sizeof(bf16)))
            << "gathered rows differ, tokens " << c.tokens << " swiglu " << swiglu;
        if (!swiglu) {
          // And the CPU's gathered form against its own reference.
          std::vector<float> cpu(static_cast<size_t>(rows) * c.n);
          kernels::MoeGroupedMatmulParams<float> cp{xt.f32.data(), w.f32.data(), offsets.data(), cpu.data(),
                                                    rows, c.experts, c.n, c.k};
          cp.permuted_index = pidx.data();
          cp.top_k = c.k_top;
          kernels::launch_moe_grouped_matmul(cp, pool());
          EXPECT_LT(rel_error(to_f32(gathered), cpu), kBf16Tolerance) << "gathered, tokens " << c.tokens;
        }
        EXPECT_THROW(kernels::launch_moe_grouped_matmul(gp, kernels::GroupedGemmKind::Tiled, nullptr), Error);
      }
    }
  }
}

// The causal conv1d on the GPU against its CPU reference on the same bf16-rounded random inputs
// (rows conv_dim + 8 apart, one sequence per slot entry): the outputs within bf16 rounding, the
// fp32 conv states (where the window has a width) to 1e-6.
void check_causal_conv1d(int K, int conv_dim, int num_slots, const std::vector<int32_t>& starts,
                         const std::vector<int32_t>& slots, const std::vector<uint8_t>& fresh,
                         const std::vector<int32_t>& snapshots, std::mt19937& rng) {
  const int seqs = static_cast<int>(slots.size()), T = starts.back(), width = K - 1;
  const int x_stride = conv_dim + 8;
  Bf16Data x = random_bf16(size_t(T) * x_stride, rng);
  Bf16Data w = random_bf16(size_t(conv_dim) * K, rng, 0.5f);
  Bf16Data conv0 = random_bf16(size_t(num_slots) * conv_dim * std::max(width, 1), rng);
  std::vector<float> conv_states = conv0.f32, out(size_t(T) * conv_dim);
  const int64_t conv_stride = int64_t{conv_dim} * width;
  kernels::CausalConv1dParams<float> cc{x.f32.data(), x_stride, w.f32.data(), conv_states.data(),
                                        conv_stride, starts.data(), slots.data(), fresh.data(),
                                        snapshots.data(), out.data(), seqs, T, conv_dim, K};
  kernels::launch_causal_conv1d(cc, pool());
  DeviceBuffer<bf16> d_x(x.bits), d_w(w.bits), d_out(out.size());
  DeviceBuffer<float> d_conv(conv0.f32);
  DeviceBuffer<int32_t> d_starts(starts), d_slots(slots), d_snap(snapshots);
  DeviceBuffer<uint8_t> d_fresh(fresh);
  kernels::launch_causal_conv1d({d_x.get(), x_stride, d_w.get(), d_conv.get(), conv_stride,
                                 d_starts.get(), d_slots.get(), d_fresh.get(), d_snap.get(),
                                 d_out.get(), seqs, T, conv_dim, K},
                                nullptr);
  EXPECT_LT(rel_error(to_f32(d_out.download()), out), kBf16Tolerance);
  if (width > 0) {
    EXPECT_LT(rel_error(d_conv.download(), conv_states), 1e-6);
  }
}

// The causal conv1d at every kernel size it takes (each window width is its own kernel instance):
// against the CPU reference, with sequences across the 16-token tiles, a fresh one, one without a
// slot and snapshots, then one-token tiles (four tokens a sequence).
TEST(GpuKernels, CausalConv1dEveryKernelSize) {
  std::mt19937 rng(7);
  const std::vector<int32_t> slots{2, 0, -1, 5};
  const std::vector<uint8_t> fresh{0, 1, 0, 0};
  for (const int K : {1, 2, 3, 4, 5, 8})
  for (const std::vector<int32_t>& starts : {std::vector<int32_t>{0, 2, 40, 57, 90},
                                             std::vector<int32_t>{0, 4, 8, 12, 16}}) {
    SCOPED_TRACE(::testing::Message() << "kernel_size " << K << ", " << starts.back() << " tokens");
    std::vector<int32_t> snapshots(starts.back(), -1);
    if (starts.back() > 50) snapshots[20] = 7, snapshots[45] = 8;
    check_causal_conv1d(K, 200, 9, starts, slots, fresh, snapshots, rng);
  }
}

// Gated DeltaNet's ops against their CPU references on the same bf16-rounded inputs: four
// sequences (one token, a short chunk, a long one of 150 tokens; one fresh, two continuing random
// states in scattered slots, one taking snapshots mid-chunk, the long one at its tokens 55 and 70;
// and graph padding without a slot), then one token each, then four with three long ones (one
// exactly a 64-token chunk, fresh, with snapshots at its rows 3, 6 and 63; one without a slot),
// then continuing sequences starting just before the conv's 16-token tile boundary, then a
// verify-like batch of 4-token sequences (the conv's one-token tiles, a sequence's first tokens
// taken by the tile holding its start), at
// the released shapes' head dims and small odd ones; at the released dims the recurrence also in
// its chunked form (its scan in 32- and 64-column slices); then the sigmoid gate, per element and
// per row with accumulation.
TEST(GpuKernels, GatedDeltaNetOps) {
  struct Shape {
    int k_heads, v_heads, key_dim, value_dim;
  };
  // 4 sequences x 4 value heads take the chunk scan's 32-column slices, x 48 its 64-column ones.
  ASSERT_EQ(kernels::gated_delta_rule_scan_columns(4, 4), 32);
  ASSERT_EQ(kernels::gated_delta_rule_scan_columns(4, 48), 64);
  for (const Shape sh : {Shape{2, 4, 128, 128}, Shape{4, 48, 128, 128}, Shape{1, 3, 24, 40}})
  for (const std::vector<int32_t>& starts :
       {std::vector<int32_t>{0, 1, 8, 158, 162}, std::vector<int32_t>{0, 1, 2, 3, 4},
        std::vector<int32_t>{0, 64, 65, 200, 330}, std::vector<int32_t>{0, 13, 14, 60, 100},
        std::vector<int32_t>{0, 4, 8, 9, 13}}) {
    SCOPED_TRACE(::testing::Message() << "key_dim " << sh.key_dim << " value_dim " << sh.value_dim
                                      << ", " << starts.back() << " tokens");
    std::mt19937 rng(31 + sh.key_dim);
    const std::vector<int32_t> slots{2, 0, 3, -1};
    const std::vector<uint8_t> fresh{0, 1, 0, 0};
    const int seqs = 4, T = starts.back(), num_slots = 7;
    std::vector<int32_t> snapshots(T, -1);
    for (auto [row, slot] : {std::pair{3, 1}, {6, 4}, {63, 6}, {78, 5}}) {
      if (T > 8 && row < T) snapshots[row] = slot;
    }
    const int conv_dim = 2 * sh.k_heads * sh.key_dim + sh.v_heads * sh.value_dim;

    // The convolution (Qwen3.5's kernel size 4).
    check_causal_conv1d(4, conv_dim, num_slots, starts, slots, fresh, snapshots, rng);

    // The recurrence.
    const int64_t row = conv_dim, gate_stride = sh.v_heads + 3;
    const int64_t state_stride = int64_t{sh.v_heads} * sh.key_dim * sh.value_dim;
    Bf16Data qkv = random_bf16(size_t(T) * row, rng), b = random_bf16(size_t(T) * gate_stride, rng),
             a = random_bf16(size_t(T) * gate_stride, rng), dt = random_bf16(sh.v_heads, rng, 0.5f);
    std::vector<float> a_log(sh.v_heads);
    for (float& v : a_log) v = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
    std::vector<float> states0(size_t(num_slots) * state_stride);
    for (float& v : states0) v = std::normal_distribution<float>(0.0f, 0.1f)(rng);
    std::vector<float> states = states0, out(size_t(T) * sh.v_heads * sh.value_dim);
    kernels::GatedDeltaRuleParams<float> gd{qkv.f32.data(), b.f32.data(), a.f32.data(), gate_stride,
                                            a_log.data(), dt.f32.data(), states.data(), state_stride,
                                            starts.data(), slots.data(), fresh.data(),
                                            snapshots.data(), out.data(), seqs, T, sh.k_heads,
                                            sh.v_heads, sh.key_dim, sh.value_dim};
    kernels::launch_gated_delta_rule(gd, pool());
    DeviceBuffer<bf16> d_qkv(qkv.bits), d_b(b.bits), d_a(a.bits), d_dt(dt.bits);
    DeviceBuffer<float> d_a_log(a_log);
    DeviceBuffer<int32_t> d_starts(starts), d_slots(slots), d_snap(snapshots);
    DeviceBuffer<uint8_t> d_fresh(fresh);
    const bool chunks = kernels::gated_delta_rule_chunks(sh.key_dim, sh.value_dim);
    for (const bool chunked : {false, true}) {
      if (chunked && !chunks) continue;
      SCOPED_TRACE(chunked ? "chunked form" : "decode form");
      DeviceBuffer<bf16> d_out(out.size());
      DeviceBuffer<float> d_states(states0);
      DeviceBuffer<uint8_t> d_ws(chunked ? kernels::gated_delta_rule_workspace_bytes(T, sh.k_heads, sh.v_heads) : 1);
      kernels::launch_gated_delta_rule({d_qkv.get(), d_b.get(), d_a.get(), gate_stride, d_a_log.get(),
                                        d_dt.get(), d_states.get(), state_stride, d_starts.get(),
                                        d_slots.get(), d_fresh.get(), d_snap.get(), d_out.get(), seqs,
                                        T, sh.k_heads, sh.v_heads, sh.key_dim, sh.value_dim,
                                        chunked ? d_ws.get() : nullptr},
                                       nullptr);
      EXPECT_LT(rel_error(to_f32(d_out.download()), out), kBf16Tolerance);
      // The decode form's fp32 states from the same inputs differ only in the order of fp32
      // operations; the chunked form multiplies bf16-rounded operands on tensor cores.
      EXPECT_LT(rel_error(d_states.download(), states), chunked ? kBf16Tolerance : 1e-4);
    }
  }
  // The sigmoid gate: per element (gated attention), then one gate per row added (shared expert),
  // then a gate per 8 columns (the vector form) and per 3 (the per-element form), added.
  std::mt19937 rng(77);
  const int rows = 37, width = 96;
  Bf16Data gx = random_bf16(size_t(rows) * width, rng), gg = random_bf16(size_t(rows) * width, rng),
           base = random_bf16(size_t(rows) * width, rng);
  for (int gate_width : {width, 1, 12, 32}) {
    const bool acc = gate_width != width;
    std::vector<float> want = acc ? base.f32 : std::vector<float>(gx.f32.size());
    kernels::launch_sigmoid_gate({gx.f32.data(), gg.f32.data(), want.data(), rows, width, gate_width, acc},
                                 pool());
    DeviceBuffer<bf16> d_gx(gx.bits), d_gg(gg.bits), d_gout(base.bits);
    kernels::launch_sigmoid_gate({d_gx.get(), d_gg.get(), d_gout.get(), rows, width, gate_width, acc},
                                 nullptr);
    EXPECT_LT(rel_error(to_f32(d_gout.download()), want), kBf16Tolerance) << "gate_width " << gate_width;
  }
}

// Gated DeltaNet's output norm against its CPU reference, gated by a strided z: the 16-byte vector
// form at head dims 64, 128 and 256 (8, 16 and 32 lanes a row, rows ending mid-warp) with a
// vector-aligned z stride, the per-element form at an odd stride and at head dim 40.
TEST(GpuKernels, GatedRmsNormForms) {
  std::mt19937 rng(53);
  for (const int hd : {64, 128, 256, 40})
  for (const int pad : {0, 8, 5}) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << hd << ", z stride padded by " << pad);
    const int T = 7, heads = 3;
    const int64_t z_stride = int64_t{heads} * hd + pad;
    Bf16Data y = random_bf16(size_t(T) * heads * hd, rng);
    Bf16Data z = random_bf16(size_t(T) * z_stride, rng), nw = random_bf16(hd, rng);
    std::vector<float> normed(y.f32.size());
    kernels::launch_gated_rms_norm({y.f32.data(), z.f32.data(), z_stride, nw.f32.data(),
                                    normed.data(), T, heads, hd, 1e-6f},
                                   pool());
    DeviceBuffer<bf16> d_y(y.bits), d_z(z.bits), d_nw(nw.bits), d_normed(normed.size());
    kernels::launch_gated_rms_norm({d_y.get(), d_z.get(), z_stride, d_nw.get(), d_normed.get(), T,
                                    heads, hd, 1e-6f},
                                   nullptr);
    EXPECT_LT(rel_error(to_f32(d_normed.download()), normed), kBf16Tolerance);
  }
}

// Gated DeltaNet's fused step (conv, recurrence and gated norm in one kernel of clusters) against
// its CPU reference and against the three GPU ops it fuses, on one in_proj row layout: decode
// batches, verify-like ones (4-token sequences, snapshots after some tokens), one with a token-less
// sequence; a fresh state, continuing ones in scattered slots and graph padding without a slot; at
// the released heads with 2 and 4 value heads per key head (8 CTAs of 32 and of 64 columns per
// cluster) and small odd ones (a cluster of 6, columns past value_dim). A head ratio no cluster
// holds is refused by name.
TEST(GpuKernels, GatedDeltaNetStep) {
  struct Shape {
    int k_heads, v_heads, key_dim, value_dim;
  };
  for (const Shape sh : {Shape{2, 4, 128, 128}, Shape{1, 4, 128, 128}, Shape{1, 3, 24, 40}})
  for (const std::vector<int32_t>& starts :
       {std::vector<int32_t>{0, 1, 2, 3, 4}, std::vector<int32_t>{0, 4, 8, 9, 13},
        std::vector<int32_t>{0, 4, 4, 8, 12}}) {
    SCOPED_TRACE(::testing::Message() << sh.k_heads << " key heads, " << sh.v_heads << " value heads, key_dim "
                                      << sh.key_dim << " value_dim " << sh.value_dim << ", "
                                      << starts.back() << " tokens");
    ASSERT_TRUE(kernels::gated_delta_net_step_fused(sh.k_heads, sh.v_heads, sh.key_dim, sh.value_dim));
    std::mt19937 rng(41 + sh.key_dim + sh.v_heads);
    const std::vector<int32_t> slots{2, 0, 3, -1};
    const std::vector<uint8_t> fresh{0, 1, 0, 0};
    const int seqs = 4, T = starts.back(), num_slots = 7, K = 4, width = K - 1;
    std::vector<int32_t> snapshots(T, -1);
    if (T > 4) snapshots[1] = 4, snapshots[2] = 5, snapshots[9] = 6;
    const int conv_dim = 2 * sh.k_heads * sh.key_dim + sh.v_heads * sh.value_dim;
    const int v_dim = sh.v_heads * sh.value_dim;
    const int64_t proj_stride = conv_dim + v_dim + 2 * sh.v_heads + 6;
    const int64_t conv_elems = int64_t{conv_dim} * width;
    const int64_t state_stride = conv_elems + int64_t{sh.v_heads} * sh.key_dim * sh.value_dim;
    Bf16Data proj = random_bf16(size_t(T) * proj_stride, rng), w = random_bf16(size_t(conv_dim) * K, rng, 0.5f),
             dt = random_bf16(sh.v_heads, rng, 0.5f), nw = random_bf16(sh.value_dim, rng);
    std::vector<float> a_log(sh.v_heads);
    for (float& v : a_log) v = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
    // One pool: each slot's conv state, then its recurrent state (bf16-exact conv states).
    Bf16Data conv0 = random_bf16(size_t(num_slots) * conv_elems, rng);
    std::vector<float> pool0(size_t(num_slots) * state_stride);
    for (int i = 0; i < num_slots; ++i) {
      std::copy_n(conv0.f32.begin() + i * conv_elems, conv_elems, pool0.begin() + i * state_stride);
      for (int64_t e = conv_elems; e < state_stride; ++e) {
        pool0[i * state_stride + e] = std::normal_distribution<float>(0.0f, 0.1f)(rng);
      }
    }
    std::vector<float> want_pool = pool0, want(size_t(T) * v_dim);
    kernels::GatedDeltaNetStepParams<float> cpu{
        proj.f32.data(), proj_stride, w.f32.data(), a_log.data(), dt.f32.data(), nw.f32.data(),
        want_pool.data(), want_pool.data() + conv_elems, state_stride, starts.data(), slots.data(),
        fresh.data(), snapshots.data(), want.data(), seqs, T, sh.k_heads, sh.v_heads, sh.key_dim,
        sh.value_dim, K, 1e-6f};
    kernels::launch_gated_delta_net_step(cpu, pool());

    DeviceBuffer<bf16> d_proj(proj.bits), d_w(w.bits), d_dt(dt.bits), d_nw(nw.bits);
    DeviceBuffer<float> d_a_log(a_log);
    DeviceBuffer<int32_t> d_starts(starts), d_slots(slots), d_snap(snapshots);
    DeviceBuffer<uint8_t> d_fresh(fresh);
    // The fused kernel, then the conv, the recurrence (its decode form) and the norm.
    DeviceBuffer<float> d_fused(pool0), d_split(pool0);
    DeviceBuffer<bf16> d_out(want.size()), d_split_out(want.size()), d_conv_out(size_t(T) * conv_dim);
    kernels::launch_gated_delta_net_step(
        {d_proj.get(), proj_stride, d_w.get(), d_a_log.get(), d_dt.get(), d_nw.get(), d_fused.get(),
         d_fused.get() + conv_elems, state_stride, d_starts.get(), d_slots.get(), d_fresh.get(),
         d_snap.get(), d_out.get(), seqs, T, sh.k_heads, sh.v_heads, sh.key_dim, sh.value_dim, K, 1e-6f},
        nullptr);
    kernels::launch_causal_conv1d({d_proj.get(), proj_stride, d_w.get(), d_split.get(), state_stride,
                                   d_starts.get(), d_slots.get(), d_fresh.get(), d_snap.get(),
                                   d_conv_out.get(), seqs, T, conv_dim, K},
                                  nullptr);
    const bf16* d_b = d_proj.get() + conv_dim + v_dim;
    kernels::launch_gated_delta_rule({d_conv_out.get(), d_b, d_b + sh.v_heads, proj_stride, d_a_log.get(),
                                      d_dt.get(), d_split.get() + conv_elems, state_stride, d_starts.get(),
                                      d_slots.get(), d_fresh.get(), d_snap.get(), d_split_out.get(), seqs, T,
                                      sh.k_heads, sh.v_heads, sh.key_dim, sh.value_dim, nullptr},
                                     nullptr);
    kernels::launch_gated_rms_norm({d_split_out.get(), d_proj.get() + conv_dim, proj_stride, d_nw.get(),
                                    d_split_out.get(), T, sh.v_heads, sh.value_dim, 1e-6f},
                                   nullptr);
    const std::vector<float> got = to_f32(d_out.download()), got_pool = d_fused.download();
    EXPECT_LT(rel_error(got, want), kBf16Tolerance);
    EXPECT_LT(rel_error(got_pool, want_pool), kBf16Tolerance);  // q, k and v rounded to bf16 on the GPU
    // The same bf16 roundings as the three ops: the same states, the outputs but for the order of
    // the norm's sum.
    EXPECT_LT(rel_error(got_pool, d_split.download()), 1e-5);
    EXPECT_LT(rel_error(got, to_f32(d_split_out.download())), 1e-2);
  }
  // Eight value heads per key head of 128 columns: more CTAs than a portable cluster.
  EXPECT_FALSE(kernels::gated_delta_net_step_fused(1, 8, 128, 128));
  EXPECT_THROW(kernels::launch_gated_delta_net_step({nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                     nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                     1, 1, 1, 8, 128, 128, 4, 1e-6f},
                                                    nullptr),
               Error);
}

// Rows of every kind: greedy and filtered draws, some with a logit_bias and/or a token bitmask
// (the constraints change the draw, never the raw logprobs), and scored prompt rows.
TEST(GpuKernels, Sampling) {
  std::mt19937 rng(12);
  const int vocab = 5000, num_rows = 48, max_logprobs = 5;
  const int words = static_cast<int>(token_bitmask_words(vocab));
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(num_rows) * vocab);
  for (auto& l : logits) l = dist(rng);
  std::vector<kernels::SampleRowParams> rows(num_rows);
  std::vector<SamplingParams> cpu(num_rows);
  std::vector<uint32_t> masks;
  std::vector<int32_t> bias_tokens;
  std::vector<float> bias_values;
  std::vector<std::vector<std::pair<int32_t, float>>> biases(num_rows);
  std::uniform_int_distribution<int> any_token(0, vocab - 1);
  for (int r = 0; r < num_rows; ++r) {
    SamplingParams& sp = cpu[r];
    sp.temperature = r % 6 == 0 ? 0.0f : 0.3f + 0.1f * (r % 9);
    sp.top_k = r % 4 == 1 ? 1 + r * 7 : 0;
    sp.top_p = r % 3 == 2 ? 0.5f + 0.01f * r : 1.0f;
    sp.min_p = r % 5 == 3 ? 0.05f : 0.0f;
    sp.seed = 1234 + r;
    sp.num_logprobs = max_logprobs;
    rows[r] = {sp.temperature, sp.top_k, sp.top_p, sp.min_p, sample_uniform(sp.seed, 7)};
    if (r % 7 == 4) rows[r].score_token = any_token(rng);
    if (r % 4 == 2 || r % 5 == 1) {  // a bitmask allowing about a third of the vocabulary
      rows[r].mask_row = static_cast<int32_t>(masks.size()) / words;
      for (int w = 0; w < words; ++w) masks.push_back(static_cast<uint32_t>(rng()) & static_cast<uint32_t>(rng()));
      masks.back() &= vocab % 32 ? (1u << (vocab % 32)) - 1 : ~0u;
    }
    if (r % 3 == 1) {  // biases, one large enough to win most greedy rows
      rows[r].bias_begin = static_cast<int32_t>(bias_tokens.size());
      for (float b : {25.0f, -5.0f, 2.5f}) biases[r].emplace_back(any_token(rng), b);
      for (const auto& [t, b] : biases[r]) bias_tokens.push_back(t), bias_values.push_back(b);
      rows[r].bias_count = 3;
    }
  }
  DeviceBuffer<float> d_logits(logits), d_lp(num_rows), d_top_lp(static_cast<size_t>(num_rows) * max_logprobs);
  DeviceBuffer<kernels::SampleRowParams> d_rows(rows);
  DeviceBuffer<int32_t> d_tokens(num_rows), d_top(static_cast<size_t>(num_rows) * max_logprobs), d_ranks(num_rows);
  DeviceBuffer<uint32_t> d_masks(masks);
  DeviceBuffer<int32_t> d_bias_tokens(bias_tokens);
  DeviceBuffer<float> d_bias_values(bias_values), d_bias_raw(bias_values.size());
  kernels::SampleParams p{.logits = d_logits.get(), .rows = d_rows.get(), .tokens = d_tokens.get(),
                          .logprobs = d_lp.get(), .top_ids = d_top.get(), .top_logprobs = d_top_lp.get(),
                          .ranks = d_ranks.get(), .allowed = d_masks.get(), .mask_words = words,
                          .bias_tokens = d_bias_tokens.get(), .bias_values = d_bias_values.get(),
                          .bias_raw = d_bias_raw.get(), .num_rows = num_rows, .vocab_size = vocab,
                          .max_logprobs = max_logprobs};
  kernels::launch_sample(p, nullptr);
  auto tokens = d_tokens.download();
  auto lps = d_lp.download();
  auto top = d_top.download();
  auto top_lp = d_top_lp.download();
  auto ranks = d_ranks.download();
  int constrained = 0;
  for (int r = 0; r < num_rows; ++r) {
    std::vector<float> row(logits.begin() + static_cast<size_t>(r) * vocab, logits.begin() + static_cast<size_t>(r + 1) * vocab);
    SampledToken want;
    if (rows[r].score_token >= 0) {
      std::vector<float> scratch;
      static_cast<TokenLogprob&>(want) = token_logprob(row, rows[r].score_token, max_logprobs, scratch);
      EXPECT_EQ(ranks[r], want.rank) << "row " << r;
    } else {
      TokenConstraints c;
      if (rows[r].mask_row >= 0) c.allowed_tokens = std::span(masks).subspan(size_t(rows[r].mask_row) * words, words);
      c.logit_bias = biases[r];
      constrained += !c.allowed_tokens.empty() || !c.logit_bias.empty();
      want = sample_token(row, cpu[r], {}, {}, 7, c);
      if (!c.allowed_tokens.empty()) {
        EXPECT_TRUE((c.allowed_tokens[tokens[r] / 32] >> (tokens[r] % 32)) & 1u) << "row " << r;
      }
    }
    EXPECT_EQ(tokens[r], want.token) << "row " << r;
    EXPECT_NEAR(lps[r], want.logprob, 1e-3) << "row " << r;
    for (int k = 0; k < max_logprobs; ++k) {
      EXPECT_EQ(top[r * max_logprobs + k], want.top[k].first) << "row " << r << " rank " << k;
      EXPECT_NEAR(top_lp[r * max_logprobs + k], want.top[k].second, 1e-3);
    }
  }
  EXPECT_GT(constrained, 20);
  p.mask_words = words - 1;  // a bitmask of the wrong size
  EXPECT_THROW(kernels::launch_sample(p, nullptr), Error);
}

}  // namespace
}  // namespace relay::gpu_test

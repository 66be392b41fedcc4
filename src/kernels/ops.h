// The model's compute operations: one params struct and one launch function per op.
//
// Every op is described by a params struct templated on the element type T of its activations and
// weights, so the CPU reference (T = float, src/kernels/cpu/) and the CUDA backend (T = bf16, its
// own launch overloads taking a stream) share one description of shapes and semantics. Every
// pointer field carries its shape; shapes are row-major and "[a, b]" means b is contiguous. Index
// tensors are int32 (row counts and block ids fit), slot mappings int64 (num_blocks * block_size
// may not).
//
// The ops follow one decoder layer of Qwen3 / Qwen3-MoE over a flattened batch of T tokens:
//   embedding -> [rms_norm(+residual) -> matmul(qkv) -> qk_norm_rope_kv_write -> paged_attention
//   -> matmul(o) -> rms_norm(+residual) -> (dense: matmul(gate_up) -> swiglu -> matmul(down))
//   | (moe: matmul(router) -> moe_router_topk -> moe_permute -> moe_grouped_matmul(gate_up) ->
//   swiglu
//   -> moe_grouped_matmul(down) -> moe_unpermute_combine)] x layers -> rms_norm(+residual) ->
//   lm_head.
// Qwen3.5 / Qwen3-Next (hybrid) layers add: gated attention (matmul(gate), partial rotary in
// qk_norm_rope_kv_write, sigmoid_gate before matmul(o)); the Gated DeltaNet token mixer
// (matmul(in_proj) -> causal_conv1d -> gated_delta_rule -> gated_rms_norm -> matmul(out_proj)),
// whose state lives in per-sequence slots instead of the paged KV cache; and the MoE's shared
// expert (dense MLP -> matmul(shared_expert_gate) -> sigmoid_gate accumulated into the output).
//
// The KV cache is paged and HND: for one layer, K and V are each
// [num_blocks, num_kv_heads, block_size, head_dim] (see kvcache/kv_cache.h); a token's "slot" is
// block_id * block_size + offset_in_block.
//
// CPU launches take the thread pool they may use (the CUDA ones take a stream); ops that are cheap
// next to the matmuls still split rows over it so nothing single-threaded dominates a step.
#pragma once

#include <cstdint>

namespace relay {
class ThreadPool;
}

namespace relay::kernels {

// ceil(a / b) for positive b: tiles, groups, grid sizes.
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// out[t] = table[token_ids[t]].
template <typename T>
struct EmbeddingParams {
  const int32_t* token_ids = nullptr;  // [num_tokens], each in [0, vocab_size)
  const T* table = nullptr;            // [vocab_size, hidden]
  T* out = nullptr;                    // [num_tokens, hidden]
  int num_tokens = 0;
  int hidden = 0;
  int vocab_size = 0;
};

// RMSNorm as Hugging Face computes it: y = weight * (x / sqrt(mean(x^2) + eps)), statistics in
// fp32. With `residual` set, the residual stream is updated first (residual += x) and the norm is
// taken of the updated residual — the pre-norm block's "h = h + sublayer(x); x = norm(h)" in one
// pass.
template <typename T>
struct RmsNormParams {
  const T* x = nullptr;       // [num_tokens, hidden]
  T* residual = nullptr;      // [num_tokens, hidden] or null; updated in place to residual + x
  const T* weight = nullptr;  // [hidden]
  T* out = nullptr;           // [num_tokens, hidden]; may alias x
  int num_tokens = 0;
  int hidden = 0;
  float eps = 1e-6f;
};

// out = x @ w^T (+ bias): every linear layer (qkv, o, dense MLP, router).
template <typename T>
struct MatmulParams {
  const T* x = nullptr;     // [m, k]
  const T* w = nullptr;     // [n, k] (the nn.Linear weight layout)
  const T* bias = nullptr;  // [n] or null
  T* out = nullptr;         // [m, n]; must not alias x
  int m = 0;
  int n = 0;
  int k = 0;
};

// Qwen3 attention's pre-attention work for every token, fused:
//   q_h = rope(rms_norm(q_h) * q_norm_weight), k_h = rope(rms_norm(k_h) * k_norm_weight) per head,
//   then K and V are written to the paged cache at slot_mapping[t]. RoPE is the rotate-half (NeoX)
// form over the full head_dim: angle_i = position * inv_freq[i] (fp32 product, as HF), and cos/sin
// are multiplied by attention_scaling (YaRN's mscale; 1 for plain RoPE) before use. inv_freq and
// attention_scaling come from relay::compute_rope (model/rope.h), which follows transformers
// exactly.
template <typename T>
struct QkNormRopeKvWriteParams {
  const T* qkv = nullptr;  // [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]: q | k | v
  const T* q_norm_weight = nullptr;    // [head_dim]
  const T* k_norm_weight = nullptr;    // [head_dim]
  const int32_t* positions = nullptr;  // [num_tokens]
  const float* inv_freq = nullptr;     // [rotary_dim / 2] (head_dim / 2 by default, see below)
  float attention_scaling = 1.0f;
  const int64_t* slot_mapping =
      nullptr;           // [num_tokens]; slot = block * block_size + offset, -1 = don't store
  T* q_out = nullptr;    // [num_tokens, num_q_heads, head_dim]
  T* k_cache = nullptr;  // [num_blocks, num_kv_heads, block_size, head_dim] (this layer)
  T* v_cache = nullptr;  // [num_blocks, num_kv_heads, block_size, head_dim] (this layer)
  int num_tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  float eps = 1e-6f;
  // 0: q | k | v packed. > 0: k and v each start on a multiple of this many columns, with the
  // padding after q and after k unread (the output of a packed FP8 q|k|v weight, quant/fp8_pack.h);
  // a row is then round_up(q, a) + round_up(kv, a) + kv wide.
  int section_align = 0;
  // Partial rotary (Qwen3.5 / Qwen3-Next): RoPE turns only dims [0, rotary_dim) of each head,
  // rotate-half within them (pairs i, i + rotary_dim / 2), and inv_freq holds rotary_dim / 2
  // rates; dims [rotary_dim, head_dim) pass through (normed). 0 means head_dim (Qwen3). The CUDA
  // kernel takes a power of two from 8.
  int rotary_dim = 0;
};

// Where q, k and v start in a row of qkv, and the row's width (QkNormRopeKvWriteParams). Shared by
// the CPU reference and the CUDA kernel, hence callable from device code when nvcc compiles it.
#if defined(__CUDACC__)
#define RELAY_HOST_DEVICE __host__ __device__
#else
#define RELAY_HOST_DEVICE
#endif
struct QkvSections {
  int64_t k_col, v_col, row;
};
RELAY_HOST_DEVICE inline QkvSections qkv_sections(int num_q_heads, int num_kv_heads, int head_dim,
                                                  int align) {
  const int64_t q = int64_t{num_q_heads} * head_dim, kv = int64_t{num_kv_heads} * head_dim;
  const int64_t q_pad = align > 0 ? (q + align - 1) / align * align : q;
  const int64_t kv_pad = align > 0 ? (kv + align - 1) / align * align : kv;
  return {q_pad, q_pad + kv_pad, q_pad + kv_pad + kv};
}

// Which rows of a fixed-capacity tensor hold data. A CUDA graph fixes every launch's shape on the
// host, but under DP attention + EP MoE how many tokens an expert rank received is known only on
// the device: its receive buffer is R regions of max_tokens slots, region s filled up to the count
// source s sent (parallel/cuda/moe_all_to_all.h). An op given a bound reads and writes only the
// live rows, so its work follows the tokens received rather than the capacity, and leaves the
// outputs of dead rows as they were. The rows form regions of region_rows (the last may be
// shorter); row r is live iff r % region_rows < counts[r / region_rows] — a count above the
// region's size means all of it, a negative one none. One region bounds a prefix: {&n, num_rows}
// makes rows [0, n) live. `counts` is read by the op itself (device memory for a CUDA launch, never
// read on the host); null, the default, makes every row live: the op as it is without a bound.
struct LiveRows {
  const int32_t* counts = nullptr;  // [ceil(num_rows / region_rows)] (<= kMaxLiveRegions), or null
  int region_rows = 0;              // > 0 when counts is set
};
constexpr int kMaxLiveRegions = 8;  // a region per rank of an expert-parallel group (kMaxRanks)

// Whether `live` suits an op over num_rows rows (every launch checks it at the boundary).
inline bool live_rows_valid(const LiveRows& live, int64_t num_rows) {
  return live.counts == nullptr ||
         (live.region_rows > 0 &&
          (num_rows + live.region_rows - 1) / live.region_rows <= kMaxLiveRegions);
}

// Whether row r (0 <= r < the op's row count) is live.
RELAY_HOST_DEVICE inline bool is_live_row(const LiveRows& live, int64_t r) {
  return live.counts == nullptr || r % live.region_rows < live.counts[r / live.region_rows];
}

// Where the permute's row copy puts copy k of token t: its permuted row, or -1 when that row is
// outside `copied` (not copied). Shared by the bf16 and the FP8 row copies.
RELAY_HOST_DEVICE inline int copy_destination(const int32_t* permuted_index, const LiveRows& copied, int64_t t,
                                              int top_k, int k) {
  const int dest = permuted_index[t * top_k + k];
  return is_live_row(copied, dest) ? dest : -1;
}

// The live rows of a bound as an op walks them: live row v, 0 <= v < total(), is row(v), in row
// order, so an op that keeps row order (the permute's stable sort) keeps it over the live rows.
// A trivial type, so a CUDA kernel can build one per CTA in shared memory.
struct LiveRowMap {
  int num_regions;
  int region_rows;
  int begin[kMaxLiveRegions + 1];  // live rows before region g; begin[num_regions] = total()

  RELAY_HOST_DEVICE int total() const { return begin[num_regions]; }
  RELAY_HOST_DEVICE int64_t row(int v) const {
    int g = 0;
    while (g + 1 < num_regions && v >= begin[g + 1]) ++g;  // empty regions are stepped over
    return int64_t{g} * region_rows + (v - begin[g]);
  }
};

// The map of `live` over num_rows rows, each count clamped to its region's size (is_live_row's
// meaning). A CUDA kernel builds it once per CTA: a few loads of the counts.
RELAY_HOST_DEVICE inline LiveRowMap live_row_map(const LiveRows& live, int num_rows) {
  LiveRowMap m;
  m.begin[0] = 0;
  if (live.counts == nullptr) {
    m.num_regions = 1;
    m.region_rows = num_rows;
    m.begin[1] = num_rows;
    return m;
  }
  m.region_rows = live.region_rows;
  m.num_regions = (num_rows + live.region_rows - 1) / live.region_rows;
  for (int g = 0; g < m.num_regions; ++g) {
    const int size = num_rows - g * live.region_rows < live.region_rows
                         ? num_rows - g * live.region_rows
                         : live.region_rows;
    const int count = live.counts[g];
    m.begin[g + 1] = m.begin[g] + (count < 0 ? 0 : count > size ? size : count);
  }
  return m;
}

// Paged GQA attention for a flattened batch of sequences (prefill chunks and decode alike).
// Sequence s owns query rows [query_starts[s], query_starts[s+1]) and has context_lens[s] tokens in
// the cache, its new tokens included (they were written by qk_norm_rope_kv_write). Its new token j
// (of n_s) sits at position context_lens[s] - n_s + j and attends to cache positions
// [0, context_lens[s] - n_s + j]: causal among the new tokens, full over earlier context. Cache
// position p lives in block block_tables[s * max_blocks_per_seq + p / block_size] at offset
// p % block_size. Query head h reads KV head h / (num_q_heads / num_kv_heads).
template <typename T>
struct PagedAttentionParams {
  const T* q = nullptr;                   // [num_tokens, num_q_heads, head_dim]
  const T* k_cache = nullptr;             // [num_blocks, num_kv_heads, block_size, head_dim]
  const T* v_cache = nullptr;             // [num_blocks, num_kv_heads, block_size, head_dim]
  const int32_t* query_starts = nullptr;  // [num_seqs + 1], query_starts[0] = 0, last = num_tokens
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  T* out = nullptr;                       // [num_tokens, num_q_heads, head_dim]
  int num_seqs = 0;
  int num_tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  float scale = 1.0f;  // 1 / sqrt(head_dim) for Qwen3
};

// out = silu(gate) * up over rows whose first half is gate and second half up (HF's gate_up
// layout). With live_rows, only the live rows are read and written: over an expert-parallel rank's
// permuted rows, {&expert_offsets[absent], num_rows} leaves out the absent expert's rows (sorted
// last, never computed: the down GEMM does not read them) and, under DP + EP, the dead slots'.
template <typename T>
struct SwigluParams {
  const T* gate_up = nullptr;  // [num_rows, 2 * width]
  T* out = nullptr;            // [num_rows, width]
  int num_rows = 0;
  int width = 0;
  LiveRows live_rows = {};  // over the num_rows rows; none: every row
};

// The MoE router after its matmul: probabilities = softmax(logits) in fp32, the top_k largest (ties
// to the lower expert id, as torch.topk on CPU), optionally renormalised to sum to one.
//
// shared_expert_parts > 0: the logits carry one more column, the shared expert's gate logit
// (Qwen3.5 / Qwen3-Next, their shared expert run as that many more experts of the routed width,
// ids num_experts and up: a SwiGLU MLP of width n W is the sum of n of width W over its slices),
// left out of the softmax; every token gets that many more routes after its top_k, each with weight
// sigmoid(gate logit). Rows of logits, ids and weights are then num_experts + 1 and top_k +
// shared_expert_parts long.
template <typename T>
struct MoeRouterTopkParams {
  const T* logits = nullptr;      // [num_tokens, num_experts (+ 1)]
  int32_t* topk_ids = nullptr;    // [num_tokens, top_k (+ shared_expert_parts)], best first
  float* topk_weights = nullptr;  // [num_tokens, top_k (+ shared_expert_parts)]
  int num_tokens = 0;
  int num_experts = 0;
  int top_k = 0;
  bool renormalize = false;  // norm_topk_prob
  int shared_expert_parts = 0;
};

// Groups the (token, k) assignments by expert: row r = t * top_k + k goes to permuted row
// permuted_index[r]; rows of expert e are [expert_offsets[e], expert_offsets[e+1]), in (t, k) order
// inside an expert. Experts with no tokens get an empty range. Without permuted_x only the index
// and the offsets are computed (the FP8 path quantises each token once and permutes the quantised
// rows: Fp8PermuteRowsParams).
//
// Bounds (LiveRows; none: today's op). live_tokens: only the live tokens are routed, as if the dead
// ones were not there — expert_offsets count live rows only (expert_offsets[num_experts] = live
// tokens x top_k), the live rows' places are the stable sort of the live rows alone, and the dead
// tokens' topk_ids are not read and their permuted_index entries not written. copied_rows: rows of
// permuted_x that are not live are not written (permuted_index still places them). It is read
// after the index is built, so it may point into expert_offsets: an expert-parallel rank passes
// {&expert_offsets[absent], num_tokens * top_k}, skipping the absent expert's rows, sorted last.
template <typename T>
struct MoePermuteParams {
  const T* x = nullptr;               // [num_tokens, hidden]
  const int32_t* topk_ids = nullptr;  // [num_tokens, top_k]
  T* permuted_x = nullptr;            // [num_tokens * top_k, hidden], or null
  int32_t* permuted_index = nullptr;  // [num_tokens * top_k]: (t, k) row -> permuted row
  int32_t* expert_offsets = nullptr;  // [num_experts + 1]
  int num_tokens = 0;
  int hidden = 0;
  int num_experts = 0;
  int top_k = 0;
  LiveRows live_tokens = {};  // over the num_tokens tokens
  LiveRows copied_rows = {};  // over the num_tokens * top_k permuted rows
};

// out[r] = x[r] @ w[e]^T for every permuted row r of expert e (the experts' gate_up or down).
template <typename T>
struct MoeGroupedMatmulParams {
  const T* x = nullptr;  // [num_rows, k]
  const T* w = nullptr;  // [num_experts, n, k]
  const int32_t* expert_offsets =
      nullptr;       // [num_experts + 1], expert_offsets[num_experts] = num_rows
  T* out = nullptr;  // [num_rows, n], or [num_rows, n / 2] with swiglu
  int num_rows = 0;
  int num_experts = 0;
  int n = 0;
  int k = 0;
  // The experts' gate_up with the SwiGLU fused: out = silu(x @ gate^T) * (x @ up^T), gate being the
  // first n / 2 weight rows (HF's layout, as SwigluParams). The two products are rounded to T
  // first, so the result equals the separate grouped matmul + swiglu exactly.
  bool swiglu = false;
  // Gathered rows: with permuted_index set, x is the unpermuted tokens [num_rows / top_k, k] and
  // permuted row r reads token t where permuted_index[t * top_k + j] == r (moe_permute's index
  // without its row copy). Every entry must be a permuted row: a whole permute, not a live-bounded
  // one.
  const int32_t* permuted_index = nullptr;  // [num_rows]
  int top_k = 0;
  // expert_offsets (and permuted_index) were written before the kernel launched just before this
  // one (the down projection after gate_up): on the GPU the weight-streaming kernel then reads
  // them and starts its weight loads before it waits on that kernel (PDL, kernels/cuda/common.cuh).
  bool offsets_settled = false;
};

// An expert-parallel rank's view of the router's choices, in place: ids of the experts it holds,
// [expert_begin, expert_begin + num_local_experts), become local ids 0..num_local_experts-1; every
// other id becomes the absent id num_local_experts, with weight 0. The permute then sorts the
// absent rows last (run it with num_local_experts + 1 experts), the grouped GEMMs never compute
// them, the combine skips them, and with the bound {&expert_offsets[num_local_experts], rows} the
// permute's copy and the SwiGLU leave them out too.
struct MoeLocalizeExpertsParams {
  int32_t* topk_ids = nullptr;    // [num_rows] global in, local or absent out
  float* topk_weights = nullptr;  // [num_rows]
  int num_rows = 0;               // tokens x top_k
  int expert_begin = 0;
  int num_local_experts = 0;
};

// out[t] = sum_k topk_weights[t, k] * expert_out[permuted_index[t * top_k + k]] (k ascending).
// Terms of weight exactly 0 are skipped, not multiplied: they are the absent experts of an
// expert-parallel rank (and padded receive rows), whose rows were never computed and may hold
// anything, NaN included. With live_tokens only the live tokens are read and written (the DP + EP
// combine reads back only the slots a source filled).
template <typename T>
struct MoeUnpermuteCombineParams {
  const T* expert_out = nullptr;            // [num_tokens * top_k, hidden]
  const int32_t* permuted_index = nullptr;  // [num_tokens * top_k]
  const float* topk_weights = nullptr;      // [num_tokens, top_k]
  T* out = nullptr;                         // [num_tokens, hidden]
  int num_tokens = 0;
  int hidden = 0;
  int top_k = 0;
  LiveRows live_tokens = {};  // over the num_tokens tokens; none: every token
  // A gated extra term (the hybrids' shared expert, run apart): out += sigmoid(extra_gate[t]) *
  // extra[t] after the sum, as SigmoidGateParams' accumulate computes it (gate_width 1).
  const T* extra = nullptr;       // [num_tokens, hidden] or null
  const T* extra_gate = nullptr;  // [num_tokens]
  // The next RMSNorm fused (norm_weight set, every token live, residual set): residual += out
  // and normed = RMSNorm(residual) * norm_weight, as RmsNormParams{out, residual, norm_weight,
  // normed} computes them (the same roundings); out is still written.
  T* residual = nullptr;           // [num_tokens, hidden]
  const T* norm_weight = nullptr;  // [hidden]
  T* normed = nullptr;             // [num_tokens, hidden]
  float eps = 1e-6f;
};

// bf16 weights kept in their checkpoint encoding on the CPU (the raw bits). Widening bf16 to fp32
// is exact, so a kernel that widens in registers computes exactly what it would on pre-widened
// weights while reading half the bytes.
struct Bf16Bits {
  uint16_t bits;
};

// logits[i] = x[rows[i]] @ w^T in fp32: the LM head over only the rows that sample. W is the stored
// weight type (T by default; Bf16Bits for the CPU's bf16 checkpoints: the LM head is the largest
// weight a decode step reads).
template <typename T, typename W = T>
struct LmHeadParams {
  const T* x = nullptr;           // [num_tokens, hidden] (already final-normed)
  const int32_t* rows = nullptr;  // [num_rows], indices into x
  const W* w = nullptr;           // [vocab_size, hidden]
  float* logits = nullptr;        // [num_rows, vocab_size]
  int num_rows = 0;
  int hidden = 0;
  int vocab_size = 0;
};

// out = x * sigmoid(gate), each gate value scaling width / gate_width consecutive columns of its
// row; with accumulate, out += x * sigmoid(gate) instead. Gated attention's output gate (gate_width
// = width, before o_proj) and the MoE shared expert's (gate_width = 1, added into the routed
// experts' output). sigmoid(g) = 1 / (1 + exp(-g)) in fp32.
template <typename T>
struct SigmoidGateParams {
  const T* x = nullptr;     // [num_rows, width]
  const T* gate = nullptr;  // [num_rows, gate_width]; gate_width divides width
  T* out = nullptr;         // [num_rows, width]; may alias x (without accumulate)
  int num_rows = 0;
  int width = 0;
  int gate_width = 0;
  bool accumulate = false;
};

// Gated DeltaNet's short convolution: a causal depthwise conv1d of kernel_size taps over each
// sequence's new tokens, then SiLU, continuing from the sequence's conv state:
//   out[t, c] = silu(sum_j weight[c, j] * in[t - (kernel_size - 1) + j, c]),   j < kernel_size
// where the inputs before the sequence's first new token are the state's columns (the last
// kernel_size - 1 inputs it saw, oldest first; zeros for a fresh sequence). Afterwards the state
// holds the last kernel_size - 1 inputs, this step's included, so a prefill in one chunk, in
// several, and one token at a time compute the same thing. Sequence s's state is the slot
// state_slots[s]; slots of one batch must differ. A slot of -1 (graph padding, warm-up) starts
// from zeros and keeps nothing. The state is fp32 whatever T is: every backend's recurrent-state
// pool is fp32 (kvcache/recurrent_state.h), so a hand-off between any two copies bytes.
template <typename T>
struct CausalConv1dParams {
  const T* x = nullptr;       // [num_tokens, x_stride]; columns [0, conv_dim) are the input
  int64_t x_stride = 0;       // elements between consecutive tokens of x
  const T* weight = nullptr;  // [conv_dim, kernel_size] (conv1d.weight [conv_dim, 1, K])
  // Slot i's state at conv_states + i * state_stride: [conv_dim, kernel_size - 1].
  float* conv_states = nullptr;
  int64_t state_stride = 0;               // elements between consecutive slots
  const int32_t* query_starts = nullptr;  // [num_seqs + 1], as PagedAttentionParams
  const int32_t* state_slots = nullptr;   // [num_seqs]
  const uint8_t* state_fresh = nullptr;   // [num_seqs]; 1: start from zeros, not the slot's state
  // [num_tokens] or null: after token t, its sequence's state is also copied into slot
  // snapshot_slots[t] when that is >= 0 (drafts: the states a rollback may return to)
  const int32_t* snapshot_slots = nullptr;
  T* out = nullptr;                       // [num_tokens, conv_dim]
  int num_seqs = 0;
  int num_tokens = 0;
  int conv_dim = 0;
  int kernel_size = 0;
};

// Gated DeltaNet's recurrence (the gated delta rule), token by token for each sequence and value
// head, with an fp32 state S [key_dim, value_dim] per value head carried in the sequence's slot:
//   q, k <- q * rsqrt(|q|^2 + 1e-6), k * rsqrt(|k|^2 + 1e-6);  q <- q / sqrt(key_dim)
//   beta = sigmoid(b);  g = -exp(a_log) * softplus(a + dt_bias)   (softplus(x) = x above 20)
//   S <- exp(g) * S;  S <- S + k (beta * (v - S^T k))^T;  out = S^T q
// Value head h reads key head h / (num_v_heads / num_k_heads) (transformers' repeat_interleave).
// A prefill chunk is its tokens' decode steps in turn, so any chunking gives the same state and
// outputs (the GPU's chunked form is a faster order of the same sums). The gates are computed in
// fp32 whatever T is. Sequence s's state is the slot state_slots[s]; slots of one batch must
// differ; a slot of -1 starts from zeros and keeps nothing (as CausalConv1dParams).
template <typename T>
struct GatedDeltaRuleParams {
  // [num_tokens, 2 * num_k_heads * key_dim + num_v_heads * value_dim]: q | k | v (conv output)
  const T* qkv = nullptr;
  const T* b = nullptr;          // [num_tokens, gate_stride]; columns [0, num_v_heads)
  const T* a = nullptr;          // [num_tokens, gate_stride]; columns [0, num_v_heads)
  int64_t gate_stride = 0;       // elements between consecutive tokens of b and of a
  const float* a_log = nullptr;  // [num_v_heads] (A_log, kept fp32)
  const T* dt_bias = nullptr;    // [num_v_heads]
  // Slot i's state at states + i * state_stride: [num_v_heads, key_dim, value_dim], fp32.
  float* states = nullptr;
  int64_t state_stride = 0;               // elements between consecutive slots
  const int32_t* query_starts = nullptr;  // [num_seqs + 1]
  const int32_t* state_slots = nullptr;   // [num_seqs]
  const uint8_t* state_fresh = nullptr;   // [num_seqs]; 1: start from a zero state
  const int32_t* snapshot_slots = nullptr;  // [num_tokens] or null, as CausalConv1dParams
  T* out = nullptr;                       // [num_tokens, num_v_heads, value_dim]
  int num_seqs = 0;
  int num_tokens = 0;
  int num_k_heads = 0;
  int num_v_heads = 0;  // a multiple of num_k_heads
  int key_dim = 0;
  int value_dim = 0;
  // GPU only: scratch of gated_delta_rule_workspace_bytes() for the chunked (WY) form, which then
  // takes every sequence of at least kGatedDeltaChunkedMinTokens new tokens; null walks them all
  // token by token (the decode form). The CPU reference always walks.
  void* chunk_workspace = nullptr;
};

// Gated DeltaNet's output norm, per head vector, norm before gate (transformers'
// RMSNormGated): out = (weight * (x / sqrt(mean(x^2) + eps))) * silu(gate). The weight is plain,
// not zero-centred, and shared by every head.
template <typename T>
struct GatedRmsNormParams {
  const T* x = nullptr;       // [num_tokens, num_heads, head_dim]
  const T* gate = nullptr;    // [num_tokens, gate_stride]; columns [0, num_heads * head_dim), as x
  int64_t gate_stride = 0;    // elements between consecutive tokens of gate
  const T* weight = nullptr;  // [head_dim]
  T* out = nullptr;           // [num_tokens, num_heads, head_dim]; may alias x
  int num_tokens = 0;
  int num_heads = 0;
  int head_dim = 0;
  float eps = 1e-6f;
};

// Gated DeltaNet's whole recurrent step in one op: the causal conv1d (+ SiLU) on q | k | v, the
// gated delta rule walking each sequence's tokens, and the gated output norm, exactly as
// launch_causal_conv1d, launch_gated_delta_rule (without a chunk workspace) and
// launch_gated_rms_norm in turn, with the conv's and the recurrence's outputs rounded to T between
// them as those ops store them. Decode and draft verification take it on the GPU in one kernel; a
// prefill's long sequences take the three ops (the conv and the recurrence in their prefill forms).
// Every pointer and count means what it means in those three ops.
template <typename T>
struct GatedDeltaNetStepParams {
  // [num_tokens, proj_stride], in_proj's rows: q | k | v (conv_dim = 2 * num_k_heads * key_dim +
  // num_v_heads * value_dim) | z (num_v_heads * value_dim) | b (num_v_heads) | a (num_v_heads)
  const T* proj = nullptr;
  int64_t proj_stride = 0;
  const T* conv_weight = nullptr;  // [conv_dim, kernel_size]
  const float* a_log = nullptr;    // [num_v_heads]
  const T* dt_bias = nullptr;      // [num_v_heads]
  const T* norm_weight = nullptr;  // [value_dim]
  // Slot i's conv state at conv_states + i * state_stride ([conv_dim, kernel_size - 1]) and its
  // recurrent state at states + i * state_stride ([num_v_heads, key_dim, value_dim]): one pool.
  float* conv_states = nullptr;
  float* states = nullptr;
  int64_t state_stride = 0;
  const int32_t* query_starts = nullptr;    // [num_seqs + 1]
  const int32_t* state_slots = nullptr;     // [num_seqs]
  const uint8_t* state_fresh = nullptr;     // [num_seqs]
  const int32_t* snapshot_slots = nullptr;  // [num_tokens] or null
  T* out = nullptr;                         // [num_tokens, num_v_heads, value_dim]
  int num_seqs = 0;
  int num_tokens = 0;
  int num_k_heads = 0;
  int num_v_heads = 0;
  int key_dim = 0;
  int value_dim = 0;
  int kernel_size = 0;
  float eps = 1e-6f;

  RELAY_HOST_DEVICE int conv_dim() const {
    return 2 * num_k_heads * key_dim + num_v_heads * value_dim;
  }
};

// CPU reference implementations (fp32), src/kernels/cpu/*.cpp.
void launch_embedding(const EmbeddingParams<float>& p, ThreadPool& pool);
void launch_rms_norm(const RmsNormParams<float>& p, ThreadPool& pool);
void launch_matmul(const MatmulParams<float>& p, ThreadPool& pool);
void launch_qk_norm_rope_kv_write(const QkNormRopeKvWriteParams<float>& p, ThreadPool& pool);
void launch_paged_attention(const PagedAttentionParams<float>& p, ThreadPool& pool);
void launch_swiglu(const SwigluParams<float>& p, ThreadPool& pool);
void launch_moe_router_topk(const MoeRouterTopkParams<float>& p, ThreadPool& pool);
void launch_moe_permute(const MoePermuteParams<float>& p, ThreadPool& pool);
void launch_moe_grouped_matmul(const MoeGroupedMatmulParams<float>& p, ThreadPool& pool);
void launch_moe_unpermute_combine(const MoeUnpermuteCombineParams<float>& p, ThreadPool& pool);
void launch_moe_localize_experts(const MoeLocalizeExpertsParams& p, ThreadPool& pool);
void launch_lm_head(const LmHeadParams<float>& p, ThreadPool& pool);
void launch_lm_head(const LmHeadParams<float, Bf16Bits>& p, ThreadPool& pool);
void launch_sigmoid_gate(const SigmoidGateParams<float>& p, ThreadPool& pool);
void launch_causal_conv1d(const CausalConv1dParams<float>& p, ThreadPool& pool);
void launch_gated_delta_rule(const GatedDeltaRuleParams<float>& p, ThreadPool& pool);
void launch_gated_rms_norm(const GatedRmsNormParams<float>& p, ThreadPool& pool);
void launch_gated_delta_net_step(const GatedDeltaNetStepParams<float>& p, ThreadPool& pool);

}  // namespace relay::kernels

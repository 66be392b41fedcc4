// The CUDA implementations of the ops in kernels/ops.h: bf16 storage, fp32 accumulation.
//
// Each op is an overload of the CPU launch taking the same params struct instantiated on
// __nv_bfloat16 and a stream instead of a thread pool, so a model forward reads the same on both
// backends. Launches are asynchronous, never synchronise and never allocate once warmed up (the few
// that need scratch space grow a per-op workspace on first use and refuse to grow while a CUDA graph
// is being captured), so a decode step can be captured into a graph. Launch errors are thrown as
// relay::Error naming the kernel. Only files compiled for the CUDA build include this header; the
// CPU-only parts of Relay never see a CUDA type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ops.h"

namespace relay::kernels {

using bf16 = __nv_bfloat16;

void launch_embedding(const EmbeddingParams<bf16>& p, cudaStream_t s);
void launch_rms_norm(const RmsNormParams<bf16>& p, cudaStream_t s);
// Creates the cuBLASLt state GEMMs on `s` use (handle, workspace) now rather than at the first GEMM:
// cublasLtCreate waits for the whole device, so a sharded rank must not call it while its peers
// may be spinning in a collective (CudaBackend prepares every rank's stream before any step).
void prepare_blas_stream(cudaStream_t s);
// Dense x @ w^T (bf16 in/out, fp32 accumulation): the weight-streaming kernel at one or two rows
// (decode, where the weights are all the bytes), cuBLASLt otherwise (plans cached per shape). The
// kind forces one (tests, the benchmark); Streaming takes up to kMaxStreamingRows rows and needs
// streaming_matmul_supported.
enum class DenseGemmKind { Auto, Cublas, Streaming };
void launch_matmul(const MatmulParams<bf16>& p, cudaStream_t s);
void launch_matmul(const MatmulParams<bf16>& p, DenseGemmKind kind, cudaStream_t s);
inline const char* dense_gemm_kind_name(DenseGemmKind kind) {
  switch (kind) {
    case DenseGemmKind::Auto: return "auto";
    case DenseGemmKind::Cublas: return "cublas";
    case DenseGemmKind::Streaming: return "streaming";
  }
  return "?";
}
// The weight-streaming kernels (streaming_gemm.cu): dense at 1 to kMaxStreamingRows rows (k a
// multiple of 8, x and w 16-byte aligned), and grouped over the active experts.
constexpr int kMaxStreamingRows = 8;
bool streaming_matmul_supported(const MatmulParams<bf16>& p);
void launch_streaming_matmul(const MatmulParams<bf16>& p, cudaStream_t s);
void launch_streaming_grouped_matmul(const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s);
void launch_qk_norm_rope_kv_write(const QkNormRopeKvWriteParams<bf16>& p, cudaStream_t s);
// Flash-style paged attention on tensor cores. A CTA owns one KV head and a tile of (token, q head)
// rows of one sequence, so the q heads sharing a KV head read each K/V tile once. When every
// sequence has exactly one new token (decode) the context is also split across CTAs (split-K) and
// the last CTA of each (sequence, KV head) merges the partial softmaxes.
void launch_paged_attention(const PagedAttentionParams<bf16>& p, cudaStream_t s);
// Which kernel serves batches with a multi-token sequence (exposed so tests and the benchmark can
// force each): the mma.sync kernel (any head_dim, any GPU since sm_80) or the wgmma kernel
// (head_dim 128 or 256 on sm_90; 128 rows x 128 cache positions per tile, x 64 at 256). Auto
// takes wgmma where it
// exists. Decode batches always take the split-K mma.sync kernel.
enum class PrefillAttentionKind { Auto, MmaSync, Wgmma };
void launch_paged_attention(const PagedAttentionParams<bf16>& p, PrefillAttentionKind kind, cudaStream_t s);
// The decode kernel with its split count forced (0: the cost model's choice, as
// launch_paged_attention), for tests and the benchmark's sweep; capped at 64.
void launch_decode_attention(const PagedAttentionParams<bf16>& p, int num_splits, cudaStream_t s);
inline const char* prefill_attention_kind_name(PrefillAttentionKind kind) {
  switch (kind) {
    case PrefillAttentionKind::Auto: return "auto";
    case PrefillAttentionKind::MmaSync: return "mma_sync";
    case PrefillAttentionKind::Wgmma: return "wgmma";
  }
  return "?";
}
void launch_swiglu(const SwigluParams<bf16>& p, cudaStream_t s);
// A warp per token, a lane per route: top_k plus the shared expert's parts.
constexpr int kMaxRoutesPerToken = 32;
void launch_moe_router_topk(const MoeRouterTopkParams<bf16>& p, cudaStream_t s);
void launch_moe_permute(const MoePermuteParams<bf16>& p, cudaStream_t s);
// Grouped GEMM over experts: a tensor-core tile kernel when experts hold many rows (prefill), a
// weight-streaming kernel when they hold a few (decode). Both read expert_offsets on the device.
void launch_moe_grouped_matmul(const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s);
void launch_moe_unpermute_combine(const MoeUnpermuteCombineParams<bf16>& p, cudaStream_t s);
void launch_moe_localize_experts(const MoeLocalizeExpertsParams& p, cudaStream_t s);
// Gathers the sampled rows and runs one cuBLASLt GEMM with fp32 output.
void launch_lm_head(const LmHeadParams<bf16>& p, cudaStream_t s);

// Which grouped GEMM variant launch_moe_grouped_matmul picks (exposed so tests and the benchmark
// can force each one): Relay's mma.sync tile kernel, its weight-streaming kernel, CUTLASS's Hopper
// grouped kernel (wgmma + TMA, grouped_gemm_cutlass.cu) with cooperative 128x256 or ping-pong
// 64x128 tiles, or Relay's warp-specialised wgmma + TMA kernel whose 128-row tiles skip an empty
// 64-row half (grouped_gemm_wgmma.cu, bf16 only).
enum class GroupedGemmKind { Auto, Tiled, Streaming, CutlassCooperative, CutlassPingpong, Wgmma };
void launch_moe_grouped_matmul(const MoeGroupedMatmulParams<bf16>& p, GroupedGemmKind kind,
                               cudaStream_t s);
// The variant's name in benchmark records and test messages.
inline const char* grouped_gemm_kind_name(GroupedGemmKind kind) {
  switch (kind) {
    case GroupedGemmKind::Auto: return "auto";
    case GroupedGemmKind::Tiled: return "tiled";
    case GroupedGemmKind::Streaming: return "streaming";
    case GroupedGemmKind::CutlassCooperative: return "cutlass_cooperative";
    case GroupedGemmKind::CutlassPingpong: return "cutlass_pingpong";
    case GroupedGemmKind::Wgmma: return "wgmma";
  }
  return "?";
}
// The kernel RELAY_MOE_PREFILL_GEMM forces on the prefill regime (over 16 rows per expert on
// average): tiled, cutlass_cooperative, cutlass_pingpong or wgmma, which the benchmark uses to time
// the model with each; Auto when unset (then the shape decides: moe_grouped_matmul_auto_kind). The
// FP8 block-scaled grouped GEMM runs CUTLASS's cooperative kernel for Auto and either wgmma kind.
// Read once per process; an unknown name throws.
GroupedGemmKind prefill_grouped_gemm_kind();
// The kind Auto runs for p (by rows per expert on average). Streaming and Wgmma take p.swiglu
// (Wgmma with n a multiple of 16); only Streaming takes p.permuted_index (at most kMaxGatheredRows
// rows: its row -> token map lives in shared memory), so a caller fusing either asks this first.
constexpr int kMaxGatheredRows = 1024;
GroupedGemmKind moe_grouped_matmul_auto_kind(const MoeGroupedMatmulParams<bf16>& p);
// The CUTLASS variants and the wgmma kernel themselves (called through launch_moe_grouped_matmul).
void launch_moe_grouped_matmul_cutlass(const MoeGroupedMatmulParams<bf16>& p, bool cooperative,
                                       cudaStream_t s);
void launch_moe_grouped_matmul_wgmma(const MoeGroupedMatmulParams<bf16>& p, cudaStream_t s);
// Whether the wgmma kernel takes p's expert count (its tile prefix lives in shared memory).
bool moe_grouped_matmul_wgmma_supported(const MoeGroupedMatmulParams<bf16>& p);

// Sampling on the GPU with the shared sampler's semantics (engine/sampler.h), one row of fp32 logits
// per sequence and one CTA per row: the raw log-softmax logprob of the chosen token and the top
// `max_logprobs` (token, logprob) pairs (best first, ties to the lower id); then the row's token
// constraints (logit_bias entries added, then every token its bitmask leaves out set to -inf, in
// place in `logits`), then greedy argmax when temperature < 1e-5, else logits / temperature, min-p,
// top-k, top-p and an inverse-CDF draw in token order at `uniform` (the caller passes sampler.h's
// sample_uniform(seed, sample_index), so both backends draw the same token). Penalties are not
// applied here: the backend samples rows that need them on the host. Thresholds are found by
// bisection over the ordered bit patterns of the logits, which keeps every token tied at a
// top-k/top-p boundary (the CPU splits top-p ties by id).
// A row with score_token >= 0 is scored instead of sampled (prompt logprobs, sampler.h's
// token_logprob): its token is score_token, with its raw logprob, its rank (1 + the tokens with a
// larger logit) in `ranks`, and the top logprobs.
struct SampleRowParams {
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  double uniform = 0.0;  // in [0, 1)
  int32_t score_token = -1;
  int32_t mask_row = -1;  // the row's bitmask in SampleParams::allowed, -1: none
  int32_t bias_begin = 0, bias_count = 0;  // its entries in SampleParams::bias_*
};
struct SampleParams {
  float* logits = nullptr;                  // [num_rows, vocab_size]; constrained rows change
  const SampleRowParams* rows = nullptr;    // [num_rows]
  int32_t* tokens = nullptr;                // [num_rows]
  float* logprobs = nullptr;                // [num_rows]
  int32_t* top_ids = nullptr;               // [num_rows, max_logprobs] or null when max_logprobs == 0
  float* top_logprobs = nullptr;            // [num_rows, max_logprobs]
  int32_t* ranks = nullptr;                 // [num_rows], written for scored rows
  // Token constraints: bitmasks of mask_words words (bit t of word t / 32: token t allowed; no
  // row's may be all zero), and logit_bias entries with scratch for their tokens' raw logits.
  const uint32_t* allowed = nullptr;
  int mask_words = 0;
  const int32_t* bias_tokens = nullptr;
  const float* bias_values = nullptr;
  float* bias_raw = nullptr;
  int num_rows = 0;
  int vocab_size = 0;
  int max_logprobs = 0;
};
void launch_sample(const SampleParams& p, cudaStream_t s);

// Gated DeltaNet and the sigmoid gate (linear_attention.cu), fp32 states. The conv (kernel_size
// up to 8) and the recurrence's decode form (key_dim up to 128, any value_dim) keep the CPU
// references' token-by-token order; the recurrence's chunked form (key_dim = value_dim = 128, the
// released models' heads) takes the sequences of a prefill with a chunk_workspace.
constexpr int kGatedDeltaChunkedMinTokens = 16;
bool gated_delta_rule_chunks(int key_dim, int value_dim);
// Value columns per CTA of the chunked form's sequential scan over a batch's chunks (32 or 64):
// the narrower slices where num_seqs x num_v_heads would leave SMs idle.
int gated_delta_rule_scan_columns(int num_seqs, int num_v_heads);
size_t gated_delta_rule_workspace_bytes(int num_tokens, int num_k_heads, int num_v_heads);
void launch_causal_conv1d(const CausalConv1dParams<bf16>& p, cudaStream_t s);
void launch_gated_delta_rule(const GatedDeltaRuleParams<bf16>& p, cudaStream_t s);
void launch_gated_rms_norm(const GatedRmsNormParams<bf16>& p, cudaStream_t s);
// The fused step (one kernel, clusters of the CTAs of a key head) where the shapes allow it:
// key_dim up to 128 and (num_v_heads / num_k_heads) x value_dim up to 512 columns per key head.
// It pays at small batches only: on H100 at Qwen3.5-35B-A3B's heads a layer's step took 12.1 us
// fused against 15.6 as three ops at batch 1, but 219 against 137 at batch 64 (3.1 against 1.9 us
// a sequence, the launches saved worth about 5), so the engine fuses up to this many sequences.
constexpr int kGatedDeltaNetStepFusedMaxSeqs = 4;
bool gated_delta_net_step_fused(int num_k_heads, int num_v_heads, int key_dim, int value_dim);
void launch_gated_delta_net_step(const GatedDeltaNetStepParams<bf16>& p, cudaStream_t s);
void launch_sigmoid_gate(const SigmoidGateParams<bf16>& p, cudaStream_t s);

}  // namespace relay::kernels

// One rank of the CUDA backend (engine/cuda_backend.h): its shard of the weights, KV pool,
// stream, activations and graphs, and what it does in a step. The rank executor
// (engine/cuda_backend.cu) owns the ranks and splits each step among them. The rank is one
// struct split by concern over this folder:
//   weights.cu   loading a shard of the checkpoint (bf16 or block-FP8) onto the device
//   memory.cu    the activation and KV-pool plan
//   forward.cu   the forward pass as CUDA blocks (attention, dense MLP, MoE, collectives)
//   batch.cu     a step's checks, its metadata upload, the decode graph cache, warm-up
//   sampling.cu  the sampler driver: a step's sampled and scored rows, logits, profiles
//   mtp.cu       the MTP draft head after a step: catch-up rows, K chained greedy drafts
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "engine/cuda_backend.h"
#include "engine/ranks.h"
#include "engine/sampler.h"
#include "grammar/grammar.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_cuda.h"
#include "kernels/cuda/ops_cuda.h"
#include "kvcache/kv_cache.h"
#include "kvcache/recurrent_state.h"
#include "model/decoder_plan.h"
#include "model/forward_batch.h"
#include "model/layers.h"
#include "model/model.h"
#include "model/rope.h"
#include "model/safetensors.h"
#include "model/shard.h"
#include "parallel/cuda/thread_peer_group.h"
#include "quant/fp8_pack.h"
#include "quant/quant_config.h"
#include "quant/weight_quant.h"

namespace relay::cuda_engine {

using kernels::bf16;

inline constexpr int kMaxLogprobs = 20;
// Decode graph buckets: batch sizes a step is padded up to.
inline constexpr int kBatchBuckets[] = {1,   2,   4,   8,   16,  24,  32,  48,  64, 96,
                                        128, 160, 192, 224, 256, 320, 384, 448, 512};

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Bump allocation inside one device allocation (weights, activations).
class Arena {
 public:
  void reserve(size_t bytes) {
    RELAY_CUDA_CHECK(cudaMalloc(&base_, bytes));
    capacity_ = bytes;
  }
  template <typename T>
  T* take(size_t count) {
    const size_t bytes = align_up(count * sizeof(T), 256);
    RELAY_CHECK(used_ + bytes <= capacity_, "device arena overflow: ", used_ + bytes, " > ",
                capacity_);
    T* p = reinterpret_cast<T*>(static_cast<uint8_t*>(base_) + used_);
    used_ += bytes;
    return p;
  }
  void zero(cudaStream_t s) { RELAY_CUDA_CHECK(cudaMemsetAsync(base_, 0, capacity_, s)); }
  void release() {
    if (base_) cudaFree(base_);
    base_ = nullptr;
  }

 private:
  void* base_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
};

// A block-FP8 linear on the device in the quant/fp8_pack.h layout: e4m3 codes [rows, cols] and
// fp32 scales [rows / 128, ceil(cols / 128)] per copy, experts stacked.
struct Fp8Weight {
  uint8_t* q = nullptr;
  float* scale = nullptr;
  // Dense weights only: the scales repeated per row ([scale_cols, rows]), for cuBLASLt where it
  // pairs only 1 x 128 scales (kernels::expand_fp8_row_scales).
  float* row_scale = nullptr;
  quant::Fp8PackedShape shape;  // of one copy
  bool present() const { return q != nullptr; }
};

// Norm weights of zero-centred models (the hybrids) are stored as 1 + w, formed in fp32 and
// rounded to bf16 once at load (model/layers.h folds it the same way in fp32).
struct LayerWeights {
  MixerKind mixer = MixerKind::kAttention;
  int kv_layer = -1;     // (gated) attention: its layer of the KV pool
  int state_layer = -1;  // Gated DeltaNet: its layer of the recurrent-state pool
  bf16* input_norm = nullptr;  // [hidden]
  bf16* post_norm = nullptr;   // [hidden]
  bf16* qkv = nullptr;         // [(q_heads + 2 kv_heads) * head_dim, hidden]
  bf16* qkv_bias = nullptr;    // [(q_heads + 2 kv_heads) * head_dim] or null
  bf16* o = nullptr;           // [hidden, q_heads * head_dim]
  bf16* o_bias = nullptr;      // [hidden] or null
  bf16* q_norm = nullptr;      // [head_dim]
  bf16* k_norm = nullptr;      // [head_dim]
  bf16* attn_gate = nullptr;   // gated attention: [q_heads * head_dim, hidden], q_proj's gate rows
  // Gated DeltaNet (bf16 always: an FP8 checkpoint's tensors are dequantised at load).
  bf16* in_proj = nullptr;   // [conv_dim + v_dim + 2 v_heads, hidden]: q | k | v | z | b | a
  bf16* conv = nullptr;      // [conv_dim, kernel_size]
  float* a_log = nullptr;    // [v_heads]
  bf16* dt_bias = nullptr;   // [v_heads]
  bf16* gdn_norm = nullptr;  // [value_dim], plain (not zero-centred)
  bf16* out_proj = nullptr;  // [hidden, v_dim]
  bool moe = false;
  // The MoE's sigmoid-gated shared expert (hybrid MoE layers; bf16): added after the routed sum.
  bf16* shared_gate_up = nullptr;  // [2 shared_width, hidden]
  bf16* shared_down = nullptr;     // [hidden, shared_width]
  bf16* shared_gate = nullptr;     // [1, hidden]
  int shared_width = 0;
  // Folded (shared_parts > 0, 1 today): the shared expert is also expert `experts` of gate_up
  // and down and its gate row `experts` of the router, and a step of at most
  // kSharedExpertFoldMaxTokens tokens routes every token to it with weight sigmoid(gate) instead
  // of running it apart; a larger one runs it apart, through the pointers above (views of those
  // parts for bf16 experts, a bf16 copy beside FP8 ones). Where the MoE runs on the rank's own
  // tokens whole (one rank for it: no TP or EP) and the shared expert is as wide as an expert.
  int shared_parts = 0;
  bf16* router = nullptr;   // [experts (+ 1 folded), hidden]
  bf16* gate_up = nullptr;  // moe: [experts, 2 width, hidden]; dense: [2 width, hidden]
  bf16* down = nullptr;     // moe: [experts, hidden, width]; dense: [hidden, width]
  int width = 0;
  // FP8 groups (present instead of the bf16 pointers): q|k|v with k and v on whole 128-row blocks;
  // gate|up with each half padded to act_width (a multiple of 128) and down [hidden, act_width].
  Fp8Weight qkv8, o8, gate_up8, down8;
  int act_width = 0;  // the SwiGLU output width: width, or its FP8 padding
};

// Steps of at most this many tokens run a folded shared expert as one more expert. On H100 at
// Qwen3.5-35B-A3B's shapes it paid at decode batch 1 and 64 (its five launches gone for about a
// ninth more expert rows), and cost 0.5 ms over 8 layers at a 512-token prefill, where the
// experts' grouped GEMMs took 5.64 ms instead of 4.78 with its rows and the router GEMM an odd
// width (bench/results/2026-12-07-h100-gdn-step-shared-fold/).
constexpr int kSharedExpertFoldMaxTokens = 64;

// The MTP draft head (model/mtp.h) on the device: fc as its two column halves (fc(cat([e, h])) =
// fc_embed(e) + fc_hidden(h)), its three norms (zero-centred ones as 1 + w) and its decoder layer.
struct MtpWeights {
  bool present = false;
  bf16 *fc_embed = nullptr, *fc_hidden = nullptr;  // [hidden, hidden] each
  bf16 *norm_embed = nullptr, *norm_hidden = nullptr, *norm = nullptr;  // [hidden]
  LayerWeights layer;  // (gated) attention at KV-pool layer num_kv_cache_layers(), layer 0's FFN
};

// The per-step metadata, packed contiguously so one copy moves it to the device. Offsets depend
// only on (tokens, seqs, logit rows, table width), so a graph bucket always sees the same
// addresses.
// The recurrent-state fields (hybrid models) are there for every model: a few bytes.
struct MetaLayout {
  size_t token_ids, positions, logit_rows, query_starts, context_lens, slot_mapping, block_tables,
      state_slots, snapshot_slots, state_fresh, bytes;
  static MetaLayout make(int tokens, int seqs, int rows, int width) {
    MetaLayout m{};
    size_t at = 0;
    auto put = [&](size_t bytes) {
      const size_t off = at;
      at = align_up(at + bytes, 16);
      return off;
    };
    m.slot_mapping = put(sizeof(int64_t) * tokens);
    m.token_ids = put(sizeof(int32_t) * tokens);
    m.positions = put(sizeof(int32_t) * tokens);
    m.logit_rows = put(sizeof(int32_t) * rows);
    m.query_starts = put(sizeof(int32_t) * (seqs + 1));
    m.context_lens = put(sizeof(int32_t) * seqs);
    m.block_tables = put(sizeof(int32_t) * static_cast<size_t>(seqs) * width);
    m.state_slots = put(sizeof(int32_t) * seqs);
    m.snapshot_slots = put(sizeof(int32_t) * tokens);
    m.state_fresh = put(sizeof(uint8_t) * seqs);
    m.bytes = at;
    return m;
  }
};

// The graphed MTP head's chained forwards' metadata (RankEngine::mtp_meta_dev): a decode step's
// MetaLayout for `seqs` sequences of table width `width`, holding chain step 1's; then for each
// chain step s >= 2 its slot_mapping | token_ids | positions prefix (the layout's first fields)
// and its context_lens, which the graph copies over the layout's before that step (the tokens
// then come from the previous step's drafts).
struct MtpChainMeta {
  MetaLayout meta;
  size_t prefix_bytes = 0, step_bytes = 0;
  static MtpChainMeta make(int seqs, int width) {
    MtpChainMeta c;
    c.meta = MetaLayout::make(seqs, seqs, seqs, width);
    RELAY_CHECK(c.meta.slot_mapping == 0 && c.meta.token_ids < c.meta.positions,
                "MetaLayout must start with slot_mapping, token_ids, positions");
    c.prefix_bytes = c.meta.positions + sizeof(int32_t) * seqs;
    c.step_bytes = align_up(c.prefix_bytes, 16) + align_up(sizeof(int32_t) * seqs, 16);
    return c;
  }
  // Chain step s's prefix (s >= 2); its context_lens follow at context_of(s).
  size_t prefix_of(int s) const { return align_up(meta.bytes, 16) + (s - 2) * step_bytes; }
  size_t context_of(int s) const { return prefix_of(s) + align_up(prefix_bytes, 16); }
  // The bytes for a head of k drafts: chain steps 1 .. k - 1, of which 2 .. k - 1 stored apart.
  size_t bytes(int k) const {
    return align_up(meta.bytes, 16) + static_cast<size_t>(std::max(k - 2, 0)) * step_bytes;
  }
};

inline bool needs_host_sampling(const SamplingParams& p) {
  return p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
}

// One rank of the backend: its shard of the weights, its KV pool, stream, activations and graphs.
// With one rank it is the whole model.
struct RankEngine {
  CudaBackendOptions opt;
  ModelConfig cfg;
  quant::QuantConfig quant_cfg;
  CudaLoadStats stats;
  cudaStream_t stream = nullptr;
  Arena weights, acts;
  // Local counts: q_heads / kv_heads are this rank's heads, local_experts its experts; experts is
  // the model's (the router's width).
  int hidden = 0, q_heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, experts = 0, top_k = 0;
  int local_experts = 0;
  int qkv_dim = 0, max_ffn_width = 0, max_blocks = 0;

  // Parallelism: what this rank holds and how it meets the others (all unused with one rank).
  ShardSpec shard;
  int rank = 0;
  parallel::cuda::ThreadPeerGroup* group = nullptr;
  parallel::cuda::DeviceCommunicator* comm = nullptr;
  bool tp_reduce = false;   // all-reduce after o_proj and a dense MLP (tp > 1)
  bool moe_reduce = false;  // all-reduce after the MoE: replicated tokens, experts or widths split
  bool dispatch = false;    // DP + EP: tokens travel to their experts' ranks and back
  // The expert layers run on moe_tokens token rows: max_num_tokens, or under DP + EP the whole
  // receive buffer (group size x max_num_tokens, a fixed shape for the graphs; the ops' work is
  // bounded by the receive counts on the device, enqueue_moe).
  int moe_tokens = 0;
  // DP + EP: how many tokens the sources can dispatch to this rank in the running step, set by the
  // backend before each step to the sum over the DP ranks of what they send (step_tokens) — every
  // token goes at most once to each rank. A graph is captured with moe_graph_tokens(q) instead
  // and replays only in steps whose sum is within it. The expert GEMMs and SwiGLU size their
  // launches, and pick their variant, from the bound in force (moe_bound_tokens) rather than from
  // the receive buffer's capacity; the rows past it are the padded slots the permute sorts last.
  int moe_step_tokens = 0;
  int moe_bound_tokens = 0;  // the bound the launches being enqueued use
  int moe_sources = 1;       // ranks that dispatch tokens to this one (DP + EP: the group size)
  // Logit rows a step may sample: one per sequence, and one more per draft it verifies.
  int logit_rows() const { return opt.max_num_seqs * (1 + opt.max_draft_tokens); }
  // The bound a graph of q tokens per sequence keeps (every source sends at most max_num_seqs x q).
  int moe_graph_tokens(int q) const {
    return std::min(moe_tokens, moe_sources * opt.max_num_seqs * q);
  }
  // The permute's expert count: local_experts, plus the absent id under EP.
  int route_experts() const { return shard.ep_size > 1 ? local_experts + 1 : local_experts; }
  int64_t max_qkv_width = 0;   // qkv activation row: qkv_dim, or a packed FP8 q|k|v's rows
  bf16* embedding = nullptr;   // [vocab, hidden]
  bf16* final_norm = nullptr;  // [hidden]
  bf16* lm_head = nullptr;     // [vocab, hidden] (the embedding when tied)
  float* inv_freq = nullptr;   // [head_dim / 2]
  float attention_scaling = 1.0f;
  std::vector<LayerWeights> layers;
  MtpWeights mtp;  // when opt.mtp.enabled

  // KV pool: one allocation, kvcache/kv_cache.h layout with bf16 elements; a layer for each
  // attention layer (LayerWeights::kv_layer).
  KvCacheLayout kv_layout;
  bf16* kv_pool = nullptr;

  // Hybrid models: the recurrent-state pool (kvcache/recurrent_state.h, fp32 as on the CPU, so a
  // disaggregated hand-off copies bytes between any two backends): state_slots sequence slots (the
  // engine's slots of this DP rank, local ids), then state_snapshots prefix-cache snapshots.
  RecurrentStateLayout state_layout;
  float* state_pool = nullptr;
  int state_slots = 0, state_snapshots = 0;
  int dp_rank = 0;  // whose slot and snapshot ids this rank holds
  int gdn_heads_k = 0, gdn_heads_v = 0, gdn_key_dim = 0, gdn_value_dim = 0, gdn_conv_dim = 0;
  int gdn_kernel = 0, gdn_in_width = 0;  // in_proj rows
  int rotary_dim = 0;

  // Activations, sized for max_num_tokens.
  bf16 *residual, *normed, *mix, *qkv, *q, *attn, *router_logits, *permuted_x, *gate_up, *act,
      *expert_out;
  // Hybrid layers: gated attention's gate, Gated DeltaNet's projection / conv output / core
  // output, the shared expert's output and gate logit (null when no layer needs them).
  bf16 *attn_gate_out = nullptr, *gdn_proj = nullptr, *gdn_conv_out = nullptr, *gdn_core = nullptr,
       *shared_out = nullptr, *shared_logit = nullptr;
  // The chunked Gated DeltaNet form's scratch (kernels::gated_delta_rule_workspace_bytes for
  // max_num_tokens; null where the heads do not suit it): eager steps' prompts take that form.
  uint8_t* gdn_chunk_workspace = nullptr;
  // The MTP head: its rows' embeddings and hidden inputs, and which hidden row each gathers
  // (max_num_tokens + 2 max_num_seqs: a graphed head's three gathers, propose_mtp_graphed).
  bf16 *mtp_embed = nullptr, *mtp_hidden = nullptr;
  int32_t *mtp_rows_dev = nullptr, *mtp_rows_host = nullptr;
  // The graphed head (propose_mtp_graphed): the chained forwards' metadata (MtpChainMeta) and its
  // pinned staging, greedy sample rows for max_num_seqs rows, each forward's drafts ([K,
  // max_num_seqs]) and their pinned mirror, and the graphs by (batch bucket, table width, tokens
  // per sequence) of the target step they follow.
  uint8_t *mtp_meta_dev = nullptr, *mtp_meta_host = nullptr;
  kernels::SampleRowParams* greedy_rows_dev = nullptr;
  int32_t *mtp_drafts_dev = nullptr, *mtp_drafts_host = nullptr;
  std::map<std::tuple<int, int, int>, cudaGraphExec_t> mtp_graphs;
  int32_t *topk_ids, *permuted_index, *expert_offsets;
  float *topk_weights, *logits;
  bf16* recv_sum = nullptr;  // DP + EP: each received row's weighted expert sum [moe_tokens, H]
  // FP8 GEMM inputs: e4m3 codes and per (row, 128-group) scales of the activation being multiplied.
  uint8_t* act_q = nullptr;
  float* act_scale = nullptr;
  uint8_t* token_q = nullptr;  // FP8 experts: the tokens' codes and scales before the permutation
  float* token_scale = nullptr;
  FlatBatch flat;                // a step's flattened metadata (model/forward_batch.h), host side
  uint8_t* meta_dev = nullptr;   // packed metadata (MetaLayout)
  uint8_t* meta_host = nullptr;  // pinned mirror
  size_t meta_capacity = 0;
  // Sampling in/out (pinned host mirrors of the device arrays).
  kernels::SampleRowParams *sample_rows_dev, *sample_rows_host;
  int32_t *tokens_dev, *tokens_host, *top_ids_dev, *top_ids_host, *ranks_dev, *ranks_host;
  kernels::cuda::DeviceWorkspace constraints_ws;  // a step's token bitmasks and logit_bias entries
  float *logprobs_dev, *logprobs_host, *top_lp_dev, *top_lp_host;

  // (batch bucket, table width, tokens per sequence) -> graph
  std::map<std::tuple<int, int, int>, cudaGraphExec_t> graphs;

  // Per-op events of profile_forward(): op names[i] runs from starts[i] to ends[i]. The launches
  // queue behind a host function that holds the stream (a gate) until a segment of them is
  // enqueued, so the GPU runs them back to back and the events time the GPU, not the host's launch
  // rate (eager launches at batch 1 are slower than the kernels they launch). A segment is bounded
  // (kSegmentOps ops): a stream takes only so many pending launches before a launch blocks the host,
  // which would then wait for a GPU that waits for it (the 48-layer 30B-A3B forward is past that).
  // Ranks that meet in collectives still all progress: a host blocks only at its own segment ends,
  // after releasing its gate.
  // Empty outside profile_forward, so enqueue_forward records nothing in steps and graph captures.
  struct OpMarks {
    static constexpr size_t kSegmentOps = 48;
    std::vector<std::string> names;
    std::vector<cudaEvent_t> starts, ends;
    std::vector<std::unique_ptr<std::atomic<bool>>> gates;  // the last one holds the stream
    size_t segment_ops = 0;

    static cudaEvent_t record(cudaStream_t stream) {
      cudaEvent_t e = nullptr;
      RELAY_CUDA_CHECK(cudaEventCreate(&e));
      RELAY_CUDA_CHECK(cudaEventRecord(e, stream));
      return e;
    }
    void hold(cudaStream_t stream) {
      gates.push_back(std::make_unique<std::atomic<bool>>(false));
      RELAY_CUDA_CHECK(cudaLaunchHostFunc(
          stream,
          [](void* flag) {
            auto* f = static_cast<std::atomic<bool>*>(flag);
            while (!f->load(std::memory_order_acquire)) std::this_thread::yield();
          },
          gates.back().get()));
      segment_ops = 0;
    }
    void release() {
      if (!gates.empty()) gates.back()->store(true, std::memory_order_release);
    }
    // Op `name` is about to be enqueued: the previous op (if any) ends here, this one starts.
    void begin(cudaStream_t stream, std::string name) {
      if (segment_ops == kSegmentOps) {  // run the segment, then hold the stream again
        if (!names.empty()) ends.push_back(record(stream));
        release();
        RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
        hold(stream);
        starts.push_back(record(stream));
      } else {
        cudaEvent_t e = record(stream);
        if (!names.empty()) ends.push_back(e);
        starts.push_back(e);
      }
      names.push_back(std::move(name));
      ++segment_ops;
    }
    // After the last op: it ends, and the last segment runs.
    void finish(cudaStream_t stream) {
      if (!names.empty()) ends.push_back(record(stream));
      release();
      RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    ~OpMarks() {  // the stream has run past every gate: profile_forward synchronized it
      std::set<cudaEvent_t> all(starts.begin(), starts.end());
      all.insert(ends.begin(), ends.end());
      for (cudaEvent_t e : all) cudaEventDestroy(e);
    }
  };
  OpMarks* marks = nullptr;
  // RELAY_TRACE_OPS=1 prints every op as its rank's host enqueues it (where a hung rank's host
  // stopped); =sync also waits for the previous op to finish first (whose kernel hangs), outside
  // graph captures. A diagnostic for sharded hangs (docs/parallel.md).
  enum class Trace { kOff, kEnqueue, kSync };
  static Trace trace_mode() {
    static const Trace mode = [] {
      const char* v = std::getenv("RELAY_TRACE_OPS");
      const std::string s = v ? v : "";
      return s.empty() || s == "0" ? Trace::kOff : s == "sync" ? Trace::kSync : Trace::kEnqueue;
    }();
    return mode;
  }
  void mark(const char* name, const char* suffix = "") {
    if (const Trace t = trace_mode(); t != Trace::kOff) {
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      RELAY_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
      if (t == Trace::kSync && capturing == cudaStreamCaptureStatusNone) {
        RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
      }
      std::fprintf(stderr, "relay trace: rank %d %s%s%s\n", rank, name, suffix,
                   capturing == cudaStreamCaptureStatusNone ? "" : " (capturing)");
    }
    if (marks) marks->begin(stream, std::string(name) + suffix);
  }
  cudaEvent_t step_begin = nullptr, step_end = nullptr;
  double last_step_device_ms = 0.0;

  ~RankEngine() {
    for (auto& [key, g] : graphs) cudaGraphExecDestroy(g);
    for (auto& [key, g] : mtp_graphs) cudaGraphExecDestroy(g);
    if (mtp_meta_host) cudaFreeHost(mtp_meta_host);
    if (mtp_drafts_host) cudaFreeHost(mtp_drafts_host);
    if (step_begin) cudaEventDestroy(step_begin);
    if (step_end) cudaEventDestroy(step_end);
    if (meta_host) cudaFreeHost(meta_host);
    if (mtp_rows_host) cudaFreeHost(mtp_rows_host);
    if (sample_rows_host) cudaFreeHost(sample_rows_host);  // owns the other sampling mirrors too
    if (kv_pool) cudaFree(kv_pool);
    if (state_pool) cudaFree(state_pool);
    weights.release();
    acts.release();
    if (stream) cudaStreamDestroy(stream);
  }

  // ---------------------------------------------------------------- loading
  void load(const std::filesystem::path& dir);

  // ---------------------------------------------------------------- memory plan
  void allocate_activations();

  // The KV pool's layout with `num_blocks` blocks (this rank's KV heads).
  KvCacheLayout kv_layout_for(int num_blocks) const;
  // How many KV blocks this rank's share of its device's free memory holds, when `sharing` ranks
  // (this one included) still have to allocate their pools there. The reserve is per rank: each
  // has its own streams' cuBLASLt workspace, grown workspaces and graphs.
  int blocks_that_fit(int sharing);
  void allocate_kv(int num_blocks);
  // The recurrent-state pool of `slots` sequence slots and `snapshots` snapshots (hybrid models;
  // before the KV pool, which takes what is left). The error names --max-num-seqs and
  // --num-state-snapshots when the device cannot hold it.
  void allocate_states(int slots, int snapshots);
  float* state_slot_ptr(int local_slot) const {
    return state_pool + static_cast<int64_t>(local_slot) * state_layout.slot_stride();
  }
  // Copies local slot `src`'s whole state over `dst`'s on the stream.
  void copy_state_slot(int dst, int src);

  // ---------------------------------------------------------------- forward
  struct Shape {
    int tokens, seqs, rows, width;
    // A graph step's tokens per sequence (each padded to it, upload_batch), 0 for an eager step.
    int per_seq = 0;
  };

  // Enqueues the forward pass of the batch whose metadata is in meta_dev (laid out for `sh`); the
  // logits of the `sh.rows` requested rows land in `logits`. No host synchronisation.
  void enqueue_forward(const Shape& sh);

  // A DP + EP rank's step without sequences: it still receives the other ranks' tokens for its
  // experts in every MoE layer and sends the results back (as Model::forward_idle on the CPU).
  void enqueue_idle();

  // x [m, k] @ w^T -> out [m, n]: cuBLASLt for bf16 weights; for FP8 ones, x is quantised per
  // (row, 128-group) first (or already was: `quantized`), then the block-scaled GEMM — cuBLASLt's
  // where it has one for the shape (its x scales are group-major), else Relay's kernel.
  bool fp8_on_cublaslt(const Fp8Weight& w8, int m, int k) const;
  void linear(const char* name, const bf16* x, const bf16* w16, const Fp8Weight& w8,
              const bf16* bias, bf16* out, int m, int n, int k, bool quantized = false);
  // The MoE form over permuted rows, for this rank's experts (offsets_settled:
  // kernels::MoeGroupedMatmulParams's).
  void grouped(const char* name, const bf16* x, const bf16* w16, const Fp8Weight& w8, bf16* out,
               int rows, int groups, int n, int k, bool quantized = false,
               bool offsets_settled = false);
  // silu(gate) * up -> the down projection's input: bf16 `act`, or (FP8 down) straight into the
  // quantised activation buffer, its scales in the layout the down GEMM reads. Only `live` rows
  // (all by default) are computed.
  void swiglu(const LayerWeights& w, int rows, const kernels::LiveRows& live = {});

  // The MoE block on the T tokens in `normed`, its output in `mix`. The router sees every expert;
  // the experts run on the token rows they get: this rank's own tokens (one rank; or, replicated
  // under TP / TP + EP, followed by the all-reduce of the partial sums), or under DP + EP the
  // receive buffer the dispatch filled, whose weighted sums the combine returns to their sources.
  //
  // NOTE: under DP + EP every launch keeps the receive buffer's fixed shape (group size x
  // max_num_tokens tokens, so the decode graphs replay), but the expert ops take the receive counts
  // on the device as a bound (kernels::LiveRows) and touch only the slots the sources filled; under
  // EP the permute's copy and the SwiGLU also skip the absent expert's rows. The grouped GEMMs
  // read expert_offsets on the device and so compute only live rows of this rank's experts anyway.
  //
  // next_norm: the RMSNorm after the layer (RankEngine::enqueue_layer); the combine applies it
  // where nothing follows the combine on the rank (no all-reduce or DP + EP return) and says so.
  // add_shared: the combine adds the shared expert that ran before (enqueue_shared_expert).
  bool enqueue_moe(const LayerWeights& w, int T, int shared_parts = 0,
                   const bf16* next_norm = nullptr, bool add_shared = false);
  // The layer's mixers: (gated) softmax attention over its KV-pool layer, and Gated DeltaNet over
  // its recurrent-state layer (kernels/ops.h has the math); both leave their output in `mix`.
  struct StepMeta {
    const int32_t *token_ids, *positions, *logit_rows, *query_starts, *context_lens, *tables,
        *state_slots, *snapshot_slots;
    const int64_t* slots;
    const uint8_t* state_fresh;
  };
  // The device arrays of the metadata at `base` (meta_dev by default), laid out for sh.
  StepMeta step_meta(const Shape& sh, const uint8_t* base = nullptr) const;
  // A decoder layer after its input norm (normed holds it; residual the stream): the mixer, its
  // reduction, the post-attention norm and the feed-forward, whose output is left in `mix`.
  // next_norm (or null) is the weight of the RMSNorm that follows the layer (the next layer's
  // input norm, the final or the MTP head's norm): true when the layer's last op applied it
  // (residual += mix, normed = the norm), so the caller must not.
  bool enqueue_layer(const LayerWeights& w, const Shape& sh, const StepMeta& m,
                     const bf16* next_norm = nullptr);
  void enqueue_attention(const LayerWeights& w, const Shape& sh, const StepMeta& m);
  void enqueue_gated_delta_net(const LayerWeights& w, const Shape& sh, const StepMeta& m);
  // mix += sigmoid(x . shared_gate) * shared_expert(x), x = normed (the MoE's input); without
  // add, only shared_out and shared_logit (for the MoE's combine to add).
  void enqueue_shared_expert(const LayerWeights& w, int T, bool add);

  // Every check of a batch that can fail, made before anything is enqueued: a sharded step checks
  // every rank's part first, so no rank is left spinning in a collective for one that threw.
  void check_batch(std::span<const StepSequence> batch) const;

  // Fills meta_host for `batch` and copies it to the device. Returns the shape. With pad_seqs > 0
  // (a graph step, graph_tokens_per_seq) every sequence is padded to per_seq tokens with filler
  // rows after its own, and the batch to pad_seqs sequences with dummies of per_seq tokens; fillers
  // and dummies write no K/V, and every token row gets logits (a graph step's sequences sample
  // after their last token and each draft) unless `graph_rows` names them (the graphed MTP head
  // drafts from one row per sequence); else the logit rows are `rows`. A filler row sits at the
  // positions after the sequence's drafts: causal attention keeps it out of the real rows.
  Shape upload_batch(std::span<const StepSequence> batch, int pad_seqs, int width,
                     const std::vector<int32_t>& rows, int per_seq = 1,
                     std::span<const int32_t> graph_rows = {});

  static int bucket_of(int n) {
    for (int b : kBatchBuckets) {
      if (b >= n) return b;
    }
    return n;
  }
  // The block-table width of `batch`'s metadata: its longest table, at least min_width; with pow2
  // (graph steps) rounded up to a power of two from 16, within max_blocks.
  int width_of(std::span<const StepSequence> batch, bool pow2, int min_width = 1) const;

  // The tokens per sequence q of the graph that can run `batch` (under DP + EP also if the step's
  // senders fit the graph's bound, run()), 0 for none: every sequence samples after its last token
  // and its drafts, if any (a decode or a verify step), and q is one more than the most drafts a
  // sequence brings; sequences with fewer are padded (upload_batch), so the n-gram proposer's
  // varying drafts replay graphs as an MTP head's uniform ones do.
  int graph_tokens_per_seq(std::span<const StepSequence> batch) const;
  // The token rows a step of `batch` sends through the MoE layers: a graph step's padded batch, or
  // its tokens (an upper bound either way, which is what moe_step_tokens needs).
  int step_tokens(std::span<const StepSequence> batch) const;

  // The first run of a graph's work: enqueues it (eagerly, which also grows any workspace), then
  // captures it again and returns the instantiated graph, not launched.
  cudaGraphExec_t run_then_capture(const std::function<void()>& enqueue);
  // Runs the forward for a step; decode and verify batches through (and into) the graph cache.
  Shape run(std::span<const StepSequence> batch, const std::vector<int32_t>& rows);
  Shape last_shape{};  // of the last run()

  void finish_step();

  // A sequence's device-sampled rows' constraints (StepSequence::allowed_tokens, logit_bias) into
  // the host staging, for its `rows` rows from `first` on (sample_rows_host); a graph step's
  // filler rows after them stay unconstrained.
  void stage_constraints(const StepSequence& s, int first, int rows, std::vector<uint32_t>& masks,
                         std::vector<int32_t>& bias_tokens, std::vector<float>& bias_values) const;

  // The sample kernel over rows [0, n) of `logits` (sample_rows_host filled), its results copied
  // to the host mirrors (the ranks only when `scored`: rows scoring prompt logprobs); the
  // constraints staged for them (stage_constraints) go up first.
  void launch_sampling(int n, int max_logprobs, bool scored, const std::vector<uint32_t>& masks,
                       const std::vector<int32_t>& bias_tokens,
                       const std::vector<float>& bias_values);

  // Row r of the last launch_sampling as a TokenLogprob with its top `top` logprobs.
  TokenLogprob sampled_row(int r, int max_logprobs, int top) const;

  // The local state slot of a sequence's state_slots[i] (this DP rank's ids), and the pool slot of
  // a snapshot id.
  int local_state_slot(const StepSequence& s, size_t i) const;
  int snapshot_pool_slot(const StepSequence& s, int32_t snapshot) const;
  // After the last run() of `batch` verified its drafts (`sampled`: what the group's sampling rank
  // returned): each drafted or graph-padded sequence's prefix-cache saves at accepted rows and its
  // state after its last accepted token, copied from the draft slots the kernels filled
  // (upload_batch; engine/after_step.h, draft_state_copies, has the rule). Every TP rank of the
  // DP group does it for its heads: the sampling one at the end of step(), the others when the
  // rank executor hands them the sampled tokens.
  void settle_draft_states(std::span<const StepSequence> batch,
                           std::span<const SampledToken> sampled);

  // The MTP head over the batch whose metadata `m` holds (laid out for `sh`): row r reads its
  // token's embedding and row gather[r] of `hidden_in` ([hidden_rows, hidden]: the target's
  // final-normed rows, or the head's previous output when chaining); its output y is left in
  // `normed` and the logits of the `sh.rows` requested rows in `logits`.
  void enqueue_mtp(const Shape& sh, const StepMeta& m, const bf16* hidden_in, int hidden_rows,
                   const int32_t* gather);
  // Greedy drafts of logits rows [0, n) into out[0, n) (the sample kernel at temperature 0).
  void enqueue_greedy_drafts(int n, int32_t* out);
  // After a step of `batch` (this rank's part) whose sampling rank returned `sampled`: the head's
  // catch-up rows, then opt.num_mtp_drafts chained greedy drafts per sequence that wants them
  // (StepSequence::proposed_drafts, written when `lead`). Every TP rank of the group runs it (the
  // head's collectives); under DP + EP a rank whose rows ran out joins the remaining MoE
  // exchanges idle, and a rank without sequences calls mtp_idle.
  void propose_mtp(std::span<const StepSequence> batch, std::span<const SampledToken> sampled,
                   bool lead);
  void mtp_idle();
  // propose_mtp after a graph step (last_shape.per_seq > 0; under DP + EP too): the head's K
  // forwards and their greedy drafts as one graph with one host synchronisation. The catch-up
  // forward takes the target step's padded shape, so its row r reads the target's row r: a
  // sequence's row j reads the token after row j, and the rows past its last accepted one read
  // its rejected drafts (their K/V lies past the sequence's end, and the chain's first row writes
  // its position itself before it reads it; the next step's catch-up writes the rest). The chain's
  // K - 1 forwards take a decode step's shape; each one's positions are the host's (uploaded
  // ahead, copied into place on the device) and its tokens the previous forward's drafts. Drafts
  // past a sequence's blocks are computed on a clamped row that writes nothing, and dropped.
  bool mtp_graphable() const;
  void propose_mtp_graphed(std::span<const StepSequence> batch,
                           std::span<const SampledToken> sampled, bool lead);

  // Runs a checked batch (check_batch) and samples its sampling sequences, unless `sample` is
  // false (a TP rank other than 0: the same logits, sampled by rank 0). A sequence with k drafts
  // samples k + 1 rows, the last token's and each draft's, which verify the drafts in order
  // (sampler.h, verify_drafts): it returns its accepted drafts and the token after them. Token
  // constraints apply in the sample kernel; a sequence with penalties is sampled on the host,
  // constraints included. Prompt logprobs score their rows in the same kernel, after the sampled
  // rows, in chunks of what the logits buffer holds.
  std::vector<SampledToken> step(std::span<const StepSequence> batch, bool sample);

  std::vector<float> forward_logits(std::span<const StepSequence> batch, CudaBackend::LogitRows which);

  std::vector<OpTiming> profile_forward(std::span<const StepSequence> batch);
  // Runs this rank alone, collectives off, on a prompt of every power of two up to a full step (and
  // the full step), sampling up to logit_rows() rows, so every one-time setup of the kernels it
  // will use — function attributes, workspaces, GEMM plans, adapters and the cuBLASLt kernel of
  // every row bucket (blas.cu) — happens now. Some of those calls wait for the whole device, which
  // a step must never do while a peer may be spinning in a collective for this rank. The KV pool is
  // zeroed again afterwards, as allocate_kv left it: a page no sequence wrote reads the same in
  // every layout (the bench decodes over contexts it never wrote, and compares layouts' tokens).
  void warm_up_alone();
  // Binds this rank's device to the calling thread (every rank thread, before any CUDA call).
  void bind() const { RELAY_CUDA_CHECK(cudaSetDevice(opt.device)); }
  // A DP + EP rank's step without sequences (enqueue_idle), to completion.
  void idle_step();
};

}  // namespace relay::cuda_engine

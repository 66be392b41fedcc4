// See cuda_backend.h.
#include "engine/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <atomic>
#include <chrono>
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
#include "engine/ranks.h"
#include "engine/sampler.h"
#include "grammar/grammar.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_cuda.h"
#include "kernels/cuda/ops_cuda.h"
#include "kvcache/kv_cache.h"
#include "model/layers.h"
#include "model/rope.h"
#include "model/safetensors.h"
#include "model/shard.h"
#include "parallel/cuda/thread_peer_group.h"
#include "quant/fp8_pack.h"
#include "quant/quant_config.h"
#include "quant/weight_quant.h"

namespace relay {

using kernels::bf16;

namespace {

constexpr int kMaxLogprobs = 20;
constexpr size_t kStagingBytes = size_t{64} << 20;
// Decode graph buckets: batch sizes a step is padded up to.
constexpr int kBatchBuckets[] = {1,   2,   4,   8,   16,  24,  32,  48,  64, 96,
                                 128, 160, 192, 224, 256, 320, 384, 448, 512};

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

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
  // pairs only 1 x 128 scales (quant::expand_fp8_row_scales).
  float* row_scale = nullptr;
  quant::Fp8PackedShape shape;  // of one copy
  bool present() const { return q != nullptr; }
};

struct LayerWeights {
  bf16* input_norm = nullptr;  // [hidden]
  bf16* post_norm = nullptr;   // [hidden]
  bf16* qkv = nullptr;         // [(q_heads + 2 kv_heads) * head_dim, hidden]
  bf16* qkv_bias = nullptr;    // [(q_heads + 2 kv_heads) * head_dim] or null
  bf16* o = nullptr;           // [hidden, q_heads * head_dim]
  bf16* o_bias = nullptr;      // [hidden] or null
  bf16* q_norm = nullptr;      // [head_dim]
  bf16* k_norm = nullptr;      // [head_dim]
  bool moe = false;
  bf16* router = nullptr;   // [experts, hidden]
  bf16* gate_up = nullptr;  // moe: [experts, 2 width, hidden]; dense: [2 width, hidden]
  bf16* down = nullptr;     // moe: [experts, hidden, width]; dense: [hidden, width]
  int width = 0;
  // FP8 groups (present instead of the bf16 pointers): q|k|v with k and v on whole 128-row blocks;
  // gate|up with each half padded to act_width (a multiple of 128) and down [hidden, act_width].
  Fp8Weight qkv8, o8, gate_up8, down8;
  int act_width = 0;  // the SwiGLU output width: width, or its FP8 padding
};

// The per-step metadata, packed contiguously so one copy moves it to the device. Offsets depend
// only on (tokens, seqs, logit rows, table width), so a graph bucket always sees the same
// addresses.
struct MetaLayout {
  size_t token_ids, positions, logit_rows, query_starts, context_lens, slot_mapping, block_tables,
      bytes;
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
    m.bytes = at;
    return m;
  }
};

bool needs_host_sampling(const SamplingParams& p) {
  return p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
}

}  // namespace

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

  // KV pool: one allocation, kvcache/kv_cache.h layout with bf16 elements.
  KvCacheLayout kv_layout;
  bf16* kv_pool = nullptr;

  // Activations, sized for max_num_tokens.
  bf16 *residual, *normed, *mix, *qkv, *q, *attn, *router_logits, *permuted_x, *gate_up, *act,
      *expert_out;
  int32_t *topk_ids, *permuted_index, *expert_offsets;
  float *topk_weights, *logits;
  bf16* recv_sum = nullptr;  // DP + EP: each received row's weighted expert sum [moe_tokens, H]
  // FP8 GEMM inputs: e4m3 codes and per (row, 128-group) scales of the activation being multiplied.
  uint8_t* act_q = nullptr;
  float* act_scale = nullptr;
  uint8_t* token_q = nullptr;  // FP8 experts: the tokens' codes and scales before the permutation
  float* token_scale = nullptr;
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
    if (step_begin) cudaEventDestroy(step_begin);
    if (step_end) cudaEventDestroy(step_end);
    if (meta_host) cudaFreeHost(meta_host);
    if (sample_rows_host) cudaFreeHost(sample_rows_host);  // owns the other sampling mirrors too
    if (kv_pool) cudaFree(kv_pool);
    weights.release();
    acts.release();
    if (stream) cudaStreamDestroy(stream);
  }

  // ---------------------------------------------------------------- loading
  void load(const std::filesystem::path& dir) {
    const auto t0 = std::chrono::steady_clock::now();
    cfg = ModelConfig::load(dir);
    RELAY_CHECK(cfg.architecture == "Qwen3ForCausalLM" || cfg.architecture == "Qwen3MoeForCausalLM",
                "the CUDA backend runs Qwen3ForCausalLM and Qwen3MoeForCausalLM, not ",
                cfg.architecture);
    const Checkpoint ckpt = open_checkpoint(dir, opt.load_format);
    quant_cfg = quant::QuantConfig::load(dir);
    hidden = static_cast<int>(cfg.hidden_size);
    q_heads = shard.num_local_q_heads;
    kv_heads = shard.num_local_kv_heads;
    head_dim = static_cast<int>(cfg.head_dim);
    vocab = static_cast<int>(cfg.vocab_size);
    experts = static_cast<int>(cfg.num_experts);
    local_experts = shard.num_local_experts;
    top_k = static_cast<int>(cfg.num_experts_per_tok);
    qkv_dim = (q_heads + 2 * kv_heads) * head_dim;
    const int64_t H = hidden, hd = head_dim;
    // Full (checkpoint) and local (this rank's) projection widths; the q rows of a rank are its q
    // heads', its k / v rows its KV heads' (model/shard.h).
    const int64_t q_full = cfg.num_attention_heads * hd, kv_full = cfg.num_key_value_heads * hd;
    const int64_t q_dim = int64_t{q_heads} * hd, kv_dim = int64_t{kv_heads} * hd;
    const IndexRange q_rows{shard.q_head_begin * hd, q_dim}, kv_rows{shard.kv_head_begin * hd, kv_dim};
    // A fused group of linears (q|k|v, an MLP's gate|up|down) is FP8 when any of its tensors is an
    // FP8 checkpoint tensor (unless --dtype bf16 asked to dequantise) or when --dtype fp8 asked to
    // quantise bf16 ones; the other members of an FP8 group are quantised with it, so one group
    // runs one kind of GEMM. The router, embeddings, norms and lm_head always stay bf16.
    auto group_fp8 = [&](std::initializer_list<std::string> names) {
      if (opt.weights == WeightFormat::kBf16) return false;
      if (opt.weights == WeightFormat::kFp8) return true;
      for (const std::string& n : names) {
        if (ckpt.get(n).dtype == DType::F8_E4M3) return true;
      }
      return false;
    };
    RELAY_CHECK(!(cfg.attention_bias && opt.weights == WeightFormat::kFp8), "--dtype fp8 on ",
                dir.string(),
                ": config.json has attention_bias true, and the FP8 GEMMs add no bias (no released "
                "Qwen3 checkpoint has attention biases); serve it with --dtype bf16");

    // Plan every layer (formats and padded widths) and size every tensor, so the weights are one
    // allocation.
    struct Plan {
      bool qkv_fp8 = false, o_fp8 = false, mlp_fp8 = false;
      quant::Fp8PackedShape qkv, o, gate_up, down;  // per expert for MoE layers
    };
    std::vector<Plan> plans(cfg.num_hidden_layers);
    size_t total = 0;
    auto count = [&](int64_t n, size_t elem = 2) {
      total += align_up(static_cast<size_t>(n) * elem, 256);
    };
    auto count_fp8 = [&](const quant::Fp8PackedShape& s, int64_t copies) {
      count(s.code_bytes() * copies, 1);
      count(s.scale_count() * copies, 4);
      if (copies == 1) count(s.scale_cols() * s.rows, 4);  // Fp8Weight::row_scale
    };
    // The MLP width this rank holds of layer l and where it starts in the checkpoint's.
    auto mlp_width = [&](bool moe) {
      return moe ? IndexRange{shard.moe_width_begin, shard.num_local_moe_width}
                 : IndexRange{shard.mlp_width_begin, shard.num_local_mlp_width};
    };
    count(int64_t{vocab} * H);
    count(H);
    if (!cfg.tie_word_embeddings) count(int64_t{vocab} * H);
    for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
      const std::string p = str("model.layers.", l, ".");
      Plan& plan = plans[l];
      count(H), count(H), count(head_dim), count(head_dim);
      if (cfg.attention_bias) count(qkv_dim), count(H);
      plan.qkv_fp8 = group_fp8({p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                p + "self_attn.v_proj.weight"});
      plan.o_fp8 = group_fp8({p + "self_attn.o_proj.weight"});
      RELAY_CHECK(!(cfg.attention_bias && (plan.qkv_fp8 || plan.o_fp8)), dir.string(), ": layer ",
                  l,
                  " has FP8 attention weights and attention_bias, which the FP8 "
                  "GEMMs do not add");
      if (plan.qkv_fp8) {
        plan.qkv = {quant::round_up_to_block(q_dim) + quant::round_up_to_block(kv_dim) + kv_dim, H};
        count_fp8(plan.qkv, 1);
      } else {
        count(qkv_dim * H);
      }
      if (plan.o_fp8) {
        plan.o = {H, q_dim};
        count_fp8(plan.o, 1);
      } else {
        count(q_dim * H);
      }
      const bool moe = cfg.layer_is_moe(l);
      const int64_t W = mlp_width(moe).count;
      const std::string mp = moe ? p + "mlp.experts.0." : p + "mlp.";
      plan.mlp_fp8 =
          group_fp8({mp + "gate_proj.weight", mp + "up_proj.weight", mp + "down_proj.weight"});
      const int64_t copies = moe ? local_experts : 1;
      if (moe) count(int64_t{experts} * H);
      if (plan.mlp_fp8) {
        // gate and up each padded to whole blocks, so silu(gate) * up pairs column j with j + Wp;
        // the padding columns come out 0 and meet zero columns of the padded down projection.
        const int64_t Wp = quant::round_up_to_block(W);
        plan.gate_up = {2 * Wp, H};
        plan.down = {H, Wp};
        count_fp8(plan.gate_up, copies);
        count_fp8(plan.down, copies);
      } else {
        count(copies * 2 * W * H);
        count(copies * H * W);
      }
    }
    total += static_cast<size_t>(head_dim) * 4 + 256;
    weights.reserve(total);
    // Zeroed once: the padding of packed FP8 weights must read as zero codes.
    weights.zero(stream);

    Uploader up(stream);
    ThreadPool pack_pool(std::max(2u, std::thread::hardware_concurrency()));
    auto stored = [](const TensorView& v) {
      return quant::StoredTensor{v.name, v.file, v.dtype, v.shape, v.data};
    };
    // The part of checkpoint tensor `name` (full shape `shape`) this rank holds — rows x cols, a
    // count of -1 meaning all — and, for an F8_E4M3 tensor, the matching part of its scales. Whole
    // tensors are the checkpoint's views; slices are copied into `slices` (cleared after each
    // layer). FP8 slices must fall on the 128 x 128 scale blocks.
    std::deque<TensorSlice> slices;
    std::mutex slices_mu;  // experts are packed in parallel
    struct Source {
      const TensorView* w = nullptr;
      const TensorView* scale = nullptr;  // F8_E4M3 weights only
    };
    auto source = [&](const std::string& name, std::vector<int64_t> shape, IndexRange rows = {},
                      IndexRange cols = {}) -> Source {
      const TensorView& t = ckpt.get(name, shape);
      const int64_t num_rows = shape.size() == 1 ? 1 : shape[0], num_cols = shape.back();
      if (rows.count < 0) rows = {0, num_rows};
      if (cols.count < 0) cols = {0, num_cols};
      const bool fp8 = t.dtype == DType::F8_E4M3;
      if (fp8) RELAY_CHECK(quant_cfg.quantized(), "tensor ", name, " in ", t.file,
                           " is F8_E4M3 but config.json has no quantization_config");
      const TensorView* scale =
          fp8 ? &ckpt.get(quant::scale_tensor_name(quant_cfg, name)) : nullptr;
      if (rows.begin == 0 && rows.count == num_rows && cols.begin == 0 && cols.count == num_cols)
        return {&t, scale};
      std::lock_guard lock(slices_mu);
      slices.push_back(slice_tensor(t, rows.begin, rows.count, cols.begin, cols.count));
      const TensorView* w = &slices.back().view;
      if (!fp8) return {w, nullptr};
      const int64_t B = quant::kFp8BlockSize;
      auto on_blocks = [&](IndexRange r, int64_t n) {
        return r.begin % B == 0 && (r.count % B == 0 || r.begin + r.count == n);
      };
      RELAY_CHECK(on_blocks(rows, num_rows) && on_blocks(cols, num_cols), "tensor ", name, " in ",
                  t.file, ": rank ", rank, " holds rows [", rows.begin, ", +", rows.count,
                  ") x cols [", cols.begin, ", +", cols.count,
                  "), which do not fall on its 128 x 128 FP8 scale blocks; shard the experts with "
                  "--ep instead of splitting their width, or load it with --dtype bf16");
      slices.push_back(slice_tensor(*scale, rows.begin / B, (rows.count + B - 1) / B,
                                    cols.begin / B, (cols.count + B - 1) / B));
      return {w, &slices.back().view};
    };
    // A bf16 destination from any checkpoint tensor part: FP8 ones (with --dtype bf16) dequantised.
    auto put = [&](bf16* dst, const Source& src) {
      const TensorView& t = *src.w;
      if (t.dtype != DType::F8_E4M3) {
        up.put(dst, t);
        return;
      }
      std::vector<float> w(static_cast<size_t>(t.numel()));
      quant::dequantize_stored_weight(
          quant_cfg, stored(t), [&](const std::string&) { return stored(*src.scale); }, w.data());
      up.put_f32(dst, w.data(), w.size());
    };
    // One part of a packed FP8 weight, into host buffers (q, scale) laid out as `packed`.
    auto pack = [&](const Source& src, const quant::Fp8PackedShape& packed, int64_t row_offset,
                    uint8_t* q, float* scale, ThreadPool* pool) {
      const quant::StoredTensor w = stored(*src.w);
      if (src.scale != nullptr) {
        const quant::StoredTensor s = stored(*src.scale);
        quant::pack_fp8_block_part(quant_cfg, w, &s, packed, row_offset, q, scale, pool);
      } else {
        quant::pack_fp8_block_part(quant_cfg, w, nullptr, packed, row_offset, q, scale, pool);
      }
    };
    // Packs `copies` instances (experts) of a weight in parallel and uploads them as one tensor.
    auto upload_fp8 = [&](Fp8Weight& dst, const quant::Fp8PackedShape& shape, int64_t copies,
                          const std::function<void(int64_t, uint8_t*, float*, ThreadPool*)>& fill) {
      dst.shape = shape;
      dst.q = weights.take<uint8_t>(shape.code_bytes() * copies);
      dst.scale = weights.take<float>(shape.scale_count() * copies);
      std::vector<uint8_t> q(static_cast<size_t>(shape.code_bytes() * copies), 0);
      std::vector<float> scale(static_cast<size_t>(shape.scale_count() * copies), 0.0f);
      if (copies == 1) {
        fill(0, q.data(), scale.data(), &pack_pool);
      } else {
        pack_pool.parallel_for(copies, 1, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            fill(i, q.data() + i * shape.code_bytes(), scale.data() + i * shape.scale_count(),
                 nullptr);
          }
        });
      }
      up.put_bytes(dst.q, q.data(), q.size());
      up.put_bytes(dst.scale, scale.data(), scale.size() * 4);
      if (copies == 1) {
        const std::vector<float> rows =
            quant::expand_fp8_row_scales(scale.data(), shape.rows, shape.cols);
        dst.row_scale = weights.take<float>(rows.size());
        up.put_bytes(dst.row_scale, rows.data(), rows.size() * 4);
      }
      ++stats.fp8_linears;
    };

    embedding = weights.take<bf16>(size_t(vocab) * H);
    put(embedding, source("model.embed_tokens.weight", {vocab, H}));
    final_norm = weights.take<bf16>(H);
    put(final_norm, source("model.norm.weight", {H}));
    if (cfg.tie_word_embeddings) {
      lm_head = embedding;
    } else {
      lm_head = weights.take<bf16>(size_t(vocab) * H);
      put(lm_head, source("lm_head.weight", {vocab, H}));
    }
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const std::string p = str("model.layers.", l, ".");
      const std::string a = p + "self_attn.";
      const Plan& plan = plans[l];
      LayerWeights w;
      w.input_norm = weights.take<bf16>(H);
      put(w.input_norm, source(p + "input_layernorm.weight", {H}));
      w.post_norm = weights.take<bf16>(H);
      put(w.post_norm, source(p + "post_attention_layernorm.weight", {H}));
      if (plan.qkv_fp8) {
        const int64_t k_row = quant::round_up_to_block(q_dim),
                      v_row = k_row + quant::round_up_to_block(kv_dim);
        upload_fp8(w.qkv8, plan.qkv, 1, [&](int64_t, uint8_t* q, float* s, ThreadPool* pool) {
          pack(source(a + "q_proj.weight", {q_full, H}, q_rows), plan.qkv, 0, q, s, pool);
          pack(source(a + "k_proj.weight", {kv_full, H}, kv_rows), plan.qkv, k_row, q, s, pool);
          pack(source(a + "v_proj.weight", {kv_full, H}, kv_rows), plan.qkv, v_row, q, s, pool);
        });
      } else {
        w.qkv = weights.take<bf16>(qkv_dim * H);
        put(w.qkv, source(a + "q_proj.weight", {q_full, H}, q_rows));
        put(w.qkv + q_dim * H, source(a + "k_proj.weight", {kv_full, H}, kv_rows));
        put(w.qkv + (q_dim + kv_dim) * H, source(a + "v_proj.weight", {kv_full, H}, kv_rows));
      }
      // o_proj is row-parallel: this rank's q-head columns.
      if (plan.o_fp8) {
        upload_fp8(w.o8, plan.o, 1, [&](int64_t, uint8_t* q, float* s, ThreadPool* pool) {
          pack(source(a + "o_proj.weight", {H, q_full}, {}, q_rows), plan.o, 0, q, s, pool);
        });
      } else {
        w.o = weights.take<bf16>(q_dim * H);
        put(w.o, source(a + "o_proj.weight", {H, q_full}, {}, q_rows));
      }
      w.q_norm = weights.take<bf16>(head_dim);
      put(w.q_norm, source(a + "q_norm.weight", {head_dim}));
      w.k_norm = weights.take<bf16>(head_dim);
      put(w.k_norm, source(a + "k_norm.weight", {head_dim}));
      if (cfg.attention_bias) {
        w.qkv_bias = weights.take<bf16>(qkv_dim);
        put(w.qkv_bias, source(a + "q_proj.bias", {q_full}, {}, q_rows));
        put(w.qkv_bias + q_dim, source(a + "k_proj.bias", {kv_full}, {}, kv_rows));
        put(w.qkv_bias + q_dim + kv_dim, source(a + "v_proj.bias", {kv_full}, {}, kv_rows));
        // The o bias joins the all-reduced sum once, from TP rank 0.
        if (shard.tp_rank == 0) {
          w.o_bias = weights.take<bf16>(H);
          put(w.o_bias, source(a + "o_proj.bias", {H}));
        }
      }
      w.moe = cfg.layer_is_moe(l);
      const int64_t full_w = w.moe ? cfg.moe_intermediate_size : cfg.intermediate_size;
      const IndexRange cols = mlp_width(w.moe);
      const int64_t W = cols.count;
      const int64_t copies = w.moe ? local_experts : 1;
      w.width = static_cast<int>(W);
      w.act_width = w.width;
      auto prefix = [&](int64_t e) {
        return w.moe ? str(p, "mlp.experts.", shard.expert_begin + e, ".") : p + "mlp.";
      };
      if (w.moe) {
        w.router = weights.take<bf16>(size_t(experts) * H);
        put(w.router, source(p + "mlp.gate.weight", {experts, H}));
      }
      if (plan.mlp_fp8) {
        w.act_width = static_cast<int>(plan.down.cols);
        upload_fp8(
            w.gate_up8, plan.gate_up, copies,
            [&](int64_t e, uint8_t* q, float* s, ThreadPool* pool) {
              pack(source(prefix(e) + "gate_proj.weight", {full_w, H}, cols), plan.gate_up, 0, q,
                   s, pool);
              pack(source(prefix(e) + "up_proj.weight", {full_w, H}, cols), plan.gate_up,
                   w.act_width, q, s, pool);
            });
        upload_fp8(w.down8, plan.down, copies,
                   [&](int64_t e, uint8_t* q, float* s, ThreadPool* pool) {
                     pack(source(prefix(e) + "down_proj.weight", {H, full_w}, {}, cols), plan.down,
                          0, q, s, pool);
                   });
      } else {
        w.gate_up = weights.take<bf16>(size_t(copies) * 2 * W * H);
        w.down = weights.take<bf16>(size_t(copies) * H * W);
        for (int64_t e = 0; e < copies; ++e) {
          bf16* gu = w.gate_up + e * 2 * W * H;
          put(gu, source(prefix(e) + "gate_proj.weight", {full_w, H}, cols));
          put(gu + W * H, source(prefix(e) + "up_proj.weight", {full_w, H}, cols));
          put(w.down + e * H * W, source(prefix(e) + "down_proj.weight", {H, full_w}, {}, cols));
        }
      }
      max_ffn_width = std::max(max_ffn_width, w.act_width);
      max_qkv_width = std::max<int64_t>(max_qkv_width, plan.qkv_fp8 ? plan.qkv.rows : qkv_dim);
      layers.push_back(w);
      up.finish();  // the staging buffers no longer read this layer's slices
      slices.clear();
    }
    RopeTables rope = compute_rope(cfg);
    inv_freq = weights.take<float>(rope.inv_freq.size());
    RELAY_CUDA_CHECK(cudaMemcpy(inv_freq, rope.inv_freq.data(), rope.inv_freq.size() * 4,
                                cudaMemcpyHostToDevice));
    attention_scaling = rope.attention_scaling;
    up.finish();
    stats.weight_bytes = up.bytes();
    stats.load_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // Copies host data to the device through two pinned staging buffers: while one chunk crosses
  // PCIe, threads fill the other (from the mmapped file, converting dtypes on the way), so reading
  // the file and the transfer overlap.
  class Uploader {
   public:
    explicit Uploader(cudaStream_t s) : stream_(s), pool_(8) {
      for (int i = 0; i < 2; ++i) {
        RELAY_CUDA_CHECK(cudaMallocHost(&staging_[i], kStagingBytes));
        RELAY_CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
      }
    }
    ~Uploader() {
      for (int i = 0; i < 2; ++i) {
        cudaFreeHost(staging_[i]);
        cudaEventDestroy(done_[i]);
      }
    }
    // A BF16/F16/F32 checkpoint tensor as bf16.
    void put(bf16* dst, const TensorView& t) {
      RELAY_CHECK(t.dtype == DType::BF16 || t.dtype == DType::F32 || t.dtype == DType::F16,
                  "tensor ", t.name, " in ", t.file, " has dtype ", dtype_name(t.dtype),
                  "; the CUDA backend loads BF16/F16/F32 (and F8_E4M3 with its scales)");
      upload(dst, static_cast<size_t>(t.numel()), 2, [&](size_t begin, size_t n, uint8_t* stage) {
        if (t.dtype == DType::BF16) {
          std::memcpy(stage, t.data + begin * 2, n * 2);
          return;
        }
        auto* out = reinterpret_cast<uint16_t*>(stage);
        for (size_t i = 0; i < n; ++i) {
          float f;
          if (t.dtype == DType::F32) {
            std::memcpy(&f, t.data + (begin + i) * 4, 4);
          } else {
            uint16_t h;
            std::memcpy(&h, t.data + (begin + i) * 2, 2);
            f = f16_to_f32(h);
          }
          out[i] = f32_to_bf16(f);
        }
      });
    }
    // fp32 host values as bf16.
    void put_f32(bf16* dst, const float* src, size_t count) {
      upload(dst, count, 2, [&](size_t begin, size_t n, uint8_t* stage) {
        auto* out = reinterpret_cast<uint16_t*>(stage);
        for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(src[begin + i]);
      });
    }
    void put_bytes(void* dst, const void* src, size_t bytes) {
      upload(dst, bytes, 1, [&](size_t begin, size_t n, uint8_t* stage) {
        std::memcpy(stage, static_cast<const uint8_t*>(src) + begin, n);
      });
    }
    void finish() { RELAY_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
    size_t bytes() const { return bytes_; }

   private:
    // Moves `count` destination elements of `elem` bytes; fill(begin, n, stage) writes elements
    // [begin, begin + n) into the staging buffer, called in parallel on disjoint ranges.
    void upload(void* dst, size_t count, size_t elem,
                const std::function<void(size_t, size_t, uint8_t*)>& fill) {
      const size_t per_chunk = kStagingBytes / elem;
      constexpr size_t kPiece = size_t{1} << 18;
      for (size_t begin = 0; begin < count; begin += per_chunk) {
        const size_t n = std::min(per_chunk, count - begin);
        uint8_t* stage = staging_[next_];
        RELAY_CUDA_CHECK(cudaEventSynchronize(done_[next_]));
        const int64_t pieces = static_cast<int64_t>((n + kPiece - 1) / kPiece);
        pool_.parallel_for(pieces, 1, [&](int64_t b, int64_t e) {
          const size_t lo = static_cast<size_t>(b) * kPiece,
                       hi = std::min(n, static_cast<size_t>(e) * kPiece);
          fill(begin + lo, hi - lo, stage + lo * elem);
        });
        RELAY_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + begin * elem, stage, n * elem,
                                         cudaMemcpyHostToDevice, stream_));
        RELAY_CUDA_CHECK(cudaEventRecord(done_[next_], stream_));
        next_ ^= 1;
        bytes_ += n * elem;
      }
    }

    cudaStream_t stream_;
    ThreadPool pool_;
    uint8_t* staging_[2] = {};
    cudaEvent_t done_[2] = {};
    int next_ = 0;
    size_t bytes_ = 0;
  };

  // ---------------------------------------------------------------- memory plan
  void allocate_activations() {
    const size_t T = opt.max_num_tokens, S = opt.max_num_seqs;
    // Expert rows: every (token, k) pair of the token rows the experts run on.
    const size_t M = moe_tokens, routes = T * std::max(top_k, 1);
    const size_t rows = std::max(T, M * std::max(top_k, 1));
    const int64_t max_context =
        cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 32768;
    max_blocks = static_cast<int>((max_context + opt.block_size - 1) / opt.block_size);
    const MetaLayout meta =
        MetaLayout::make(static_cast<int>(T), static_cast<int>(S), static_cast<int>(T), max_blocks);
    meta_capacity = meta.bytes;
    const size_t W = max_ffn_width;
    size_t bytes = 0;
    auto add = [&](size_t n, size_t elem) { bytes += align_up(n * elem, 256); };
    const size_t fp8_k = std::max<size_t>({size_t(hidden), size_t(q_heads) * head_dim, W});
    const bool any_fp8 = stats.fp8_linears > 0;
    add(T * hidden, 2), add(T * hidden, 2), add(T * hidden, 2), add(T * max_qkv_width, 2);
    if (any_fp8) add(rows * fp8_k, 1), add(rows * ((fp8_k + 127) / 128), 4);
    if (any_fp8 && experts > 0) add(M * hidden, 1), add(M * ((hidden + 127) / 128), 4);
    if (dispatch) add(M * hidden, 2);
    add(T * q_heads * head_dim, 2), add(T * q_heads * head_dim, 2);
    add(T * std::max(experts, 1), 2), add(rows * hidden, 2), add(rows * 2 * W, 2), add(rows * W, 2),
        add(rows * hidden, 2);
    add(routes, 4), add(rows, 4), add(local_experts + 2, 4), add(routes, 4);
    const size_t R = logit_rows();
    add(R * size_t(vocab), 4);
    add(meta.bytes, 1);
    add(R * sizeof(kernels::SampleRowParams), 1), add(R, 4), add(R, 4), add(R, 4),
        add(R * kMaxLogprobs, 4), add(R * kMaxLogprobs, 4);
    acts.reserve(bytes + 4096);
    residual = acts.take<bf16>(T * hidden);
    normed = acts.take<bf16>(T * hidden);
    mix = acts.take<bf16>(T * hidden);
    qkv = acts.take<bf16>(T * max_qkv_width);
    if (any_fp8) {
      act_q = acts.take<uint8_t>(rows * fp8_k);
      act_scale = acts.take<float>(rows * ((fp8_k + 127) / 128));
    }
    if (any_fp8 && experts > 0) {
      token_q = acts.take<uint8_t>(M * hidden);
      token_scale = acts.take<float>(M * ((hidden + 127) / 128));
    }
    if (dispatch) recv_sum = acts.take<bf16>(M * hidden);
    q = acts.take<bf16>(T * q_heads * head_dim);
    attn = acts.take<bf16>(T * q_heads * head_dim);
    router_logits = acts.take<bf16>(T * std::max(experts, 1));
    permuted_x = acts.take<bf16>(rows * hidden);
    gate_up = acts.take<bf16>(rows * 2 * W);
    act = acts.take<bf16>(rows * W);
    expert_out = acts.take<bf16>(rows * hidden);
    topk_ids = acts.take<int32_t>(routes);
    permuted_index = acts.take<int32_t>(rows);
    expert_offsets = acts.take<int32_t>(local_experts + 2);
    topk_weights = acts.take<float>(routes);
    logits = acts.take<float>(R * size_t(vocab));
    meta_dev = acts.take<uint8_t>(meta.bytes);
    sample_rows_dev = acts.take<kernels::SampleRowParams>(R);
    tokens_dev = acts.take<int32_t>(R);
    logprobs_dev = acts.take<float>(R);
    ranks_dev = acts.take<int32_t>(R);
    top_ids_dev = acts.take<int32_t>(R * kMaxLogprobs);
    top_lp_dev = acts.take<float>(R * kMaxLogprobs);
    RELAY_CUDA_CHECK(cudaMallocHost(&meta_host, meta.bytes));
    // One pinned block for the sampling mirrors.
    const size_t host_bytes = R * (sizeof(kernels::SampleRowParams) + 12 + 8 * kMaxLogprobs) + 1024;
    uint8_t* h = nullptr;
    RELAY_CUDA_CHECK(cudaMallocHost(&h, host_bytes));
    sample_rows_host = reinterpret_cast<kernels::SampleRowParams*>(h);
    h += align_up(R * sizeof(kernels::SampleRowParams), 16);
    tokens_host = reinterpret_cast<int32_t*>(h);
    h += align_up(R * 4, 16);
    logprobs_host = reinterpret_cast<float*>(h);
    h += align_up(R * 4, 16);
    ranks_host = reinterpret_cast<int32_t*>(h);
    h += align_up(R * 4, 16);
    top_ids_host = reinterpret_cast<int32_t*>(h);
    h += align_up(R * kMaxLogprobs * 4, 16);
    top_lp_host = reinterpret_cast<float*>(h);
  }

  // The KV pool's layout with `num_blocks` blocks (this rank's KV heads).
  KvCacheLayout kv_layout_for(int num_blocks) const {
    KvCacheLayout l;
    l.num_layers = static_cast<int>(cfg.num_hidden_layers);
    l.num_kv_heads = kv_heads;
    l.block_size = opt.block_size;
    l.head_dim = head_dim;
    l.element_bytes = 2;
    l.num_blocks = num_blocks;
    return l;
  }
  // How many KV blocks this rank's share of its device's free memory holds, when `sharing` ranks
  // (this one included) still have to allocate their pools there. The reserve is per rank: each
  // has its own streams' cuBLASLt workspace, grown workspaces and graphs.
  int blocks_that_fit(int sharing) {
    const size_t per_block = kv_layout_for(1).bytes_per_block();
    size_t free_bytes = 0, total_bytes = 0;
    RELAY_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    stats.free_bytes_before_kv = free_bytes / sharing;
    const size_t reserve = opt.memory_reserve_bytes * sharing;
    RELAY_CHECK(free_bytes > reserve + per_block * sharing, "only ", free_bytes,
                " bytes of device memory left for the KV cache of ", sharing, " rank(s) (reserve ",
                opt.memory_reserve_bytes, " per rank)");
    return static_cast<int>(
        std::min<size_t>((free_bytes - reserve) / sharing / per_block, size_t{INT32_MAX} / 2));
  }
  void allocate_kv(int num_blocks) {
    kv_layout = kv_layout_for(num_blocks);
    stats.kv_pool_bytes = kv_layout.total_bytes();
    RELAY_CUDA_CHECK(cudaMalloc(&kv_pool, kv_layout.total_bytes()));
    // NOTE: zeroed so a never-written page (a padded decode row) holds numbers, not NaN patterns.
    RELAY_CUDA_CHECK(cudaMemsetAsync(kv_pool, 0, kv_layout.total_bytes(), stream));
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  // ---------------------------------------------------------------- forward
  struct Shape {
    int tokens, seqs, rows, width;
    // A graph step's tokens per sequence (each padded to it, upload_batch), 0 for an eager step.
    int per_seq = 0;
  };

  // Enqueues the forward pass of the batch whose metadata is in meta_dev (laid out for `sh`); the
  // logits of the `sh.rows` requested rows land in `logits`. No host synchronisation.
  void enqueue_forward(const Shape& sh) {
    const MetaLayout m = MetaLayout::make(sh.tokens, sh.seqs, sh.rows, sh.width);
    auto at = [&](size_t off) { return meta_dev + off; };
    const auto* token_ids = reinterpret_cast<const int32_t*>(at(m.token_ids));
    const auto* positions = reinterpret_cast<const int32_t*>(at(m.positions));
    const auto* logit_rows = reinterpret_cast<const int32_t*>(at(m.logit_rows));
    const auto* query_starts = reinterpret_cast<const int32_t*>(at(m.query_starts));
    const auto* context_lens = reinterpret_cast<const int32_t*>(at(m.context_lens));
    const auto* slots = reinterpret_cast<const int64_t*>(at(m.slot_mapping));
    const auto* tables = reinterpret_cast<const int32_t*>(at(m.block_tables));
    const int T = sh.tokens;
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    mark("embedding");
    kernels::launch_embedding({token_ids, embedding, residual, T, hidden, vocab}, stream);
    for (size_t l = 0; l < layers.size(); ++l) {
      const LayerWeights& w = layers[l];
      mark("input_norm");
      if (l == 0) {
        kernels::launch_rms_norm({residual, nullptr, w.input_norm, normed, T, hidden, eps}, stream);
      } else {
        kernels::launch_rms_norm({mix, residual, w.input_norm, normed, T, hidden, eps}, stream);
      }
      linear("qkv_proj", normed, w.qkv, w.qkv8, w.qkv_bias, qkv, T, qkv_dim, hidden);
      bf16* k_cache = kv_pool + kv_layout.element_offset(static_cast<int>(l), 0, 0, 0);
      bf16* v_cache = kv_pool + kv_layout.element_offset(static_cast<int>(l), 1, 0, 0);
      mark("qk_norm_rope_kv_write");
      kernels::launch_qk_norm_rope_kv_write(
          {qkv, w.q_norm, w.k_norm, positions, inv_freq, attention_scaling, slots, q, k_cache,
           v_cache, T, q_heads, kv_heads, head_dim, opt.block_size, eps,
           w.qkv8.present() ? quant::kFp8BlockSize : 0},
          stream);
      mark("attention");
      kernels::launch_paged_attention(
          {q, k_cache, v_cache, query_starts, context_lens, tables, attn, sh.seqs, T, q_heads,
           kv_heads, head_dim, opt.block_size, sh.width,
           1.0f / std::sqrt(static_cast<float>(head_dim))},
          stream);
      linear("o_proj", attn, w.o, w.o8, w.o_bias, mix, T, hidden, q_heads * head_dim);
      if (tp_reduce) {
        mark("attention_all_reduce");
        comm->all_reduce_sum(mix, static_cast<size_t>(T) * hidden, stream);
      }
      mark("post_attention_norm");
      kernels::launch_rms_norm({mix, residual, w.post_norm, normed, T, hidden, eps}, stream);
      if (w.moe) {
        enqueue_moe(w, T);
      } else {
        linear("mlp_gate_up", normed, w.gate_up, w.gate_up8, nullptr, gate_up, T, 2 * w.width,
               hidden);
        swiglu(w, T);
        linear("mlp_down", act, w.down, w.down8, nullptr, mix, T, hidden, w.act_width,
               w.down8.present());
        if (tp_reduce) {
          mark("mlp_all_reduce");
          comm->all_reduce_sum(mix, static_cast<size_t>(T) * hidden, stream);
        }
      }
    }
    mark("final_norm");
    kernels::launch_rms_norm({mix, residual, final_norm, normed, T, hidden, eps}, stream);
    mark("lm_head");
    kernels::launch_lm_head({normed, logit_rows, lm_head, logits, sh.rows, hidden, vocab}, stream);
    mark("end");
  }

  // A DP + EP rank's step without sequences: it still receives the other ranks' tokens for its
  // experts in every MoE layer and sends the results back (as Model::forward_idle on the CPU).
  void enqueue_idle() {
    for (const LayerWeights& w : layers) {
      if (w.moe) enqueue_moe(w, 0);
    }
  }

  // x [m, k] @ w^T -> out [m, n]: cuBLASLt for bf16 weights; for FP8 ones, x is quantised per
  // (row, 128-group) first (or already was: `quantized`), then the block-scaled GEMM — cuBLASLt's
  // where it has one for the shape (its x scales are group-major), else Relay's kernel.
  bool fp8_on_cublaslt(const Fp8Weight& w8, int m, int k) const {
    return kernels::fp8_block_matmul_cublaslt_supported(m, static_cast<int>(w8.shape.rows), k);
  }
  void linear(const char* name, const bf16* x, const bf16* w16, const Fp8Weight& w8,
              const bf16* bias, bf16* out, int m, int n, int k, bool quantized = false) {
    if (!w8.present()) {
      mark(name);
      kernels::launch_matmul({x, w16, bias, out, m, n, k}, stream);
      return;
    }
    const bool lt = fp8_on_cublaslt(w8, m, k);
    if (!quantized) {
      mark(name, ".act_quant");
      kernels::launch_fp8_act_quant({x, act_q, act_scale, m, k, quant::kFp8BlockSize, lt}, stream);
    }
    mark(name);
    // n is the bf16 width; an FP8 weight's packed rows add any padding between fused parts.
    const quant::Fp8BlockMatmulParams<bf16> mp{act_q, act_scale, w8.q, w8.scale, out, m,
                                               static_cast<int>(w8.shape.rows), k,
                                               quant::kFp8BlockSize, quant::kFp8BlockSize, lt};
    if (lt) {
      kernels::launch_fp8_block_matmul_cublaslt(mp, w8.row_scale, stream);
    } else {
      kernels::launch_fp8_block_matmul(mp, stream);
    }
  }
  // The MoE form over permuted rows, for this rank's experts.
  void grouped(const char* name, const bf16* x, const bf16* w16, const Fp8Weight& w8, bf16* out,
               int rows, int n, int k, bool quantized = false) {
    if (!w8.present()) {
      mark(name);
      kernels::launch_moe_grouped_matmul({x, w16, expert_offsets, out, rows, local_experts, n, k},
                                         stream);
      return;
    }
    if (!quantized) {
      mark(name, ".act_quant");
      kernels::launch_fp8_act_quant({x, act_q, act_scale, rows, k}, stream);
    }
    mark(name);
    kernels::launch_fp8_block_grouped_matmul(
        {act_q, act_scale, w8.q, w8.scale, expert_offsets, out, rows, local_experts,
         static_cast<int>(w8.shape.rows), k},
        stream);
  }
  // silu(gate) * up -> the down projection's input: bf16 `act`, or (FP8 down) straight into the
  // quantised activation buffer, its scales in the layout the down GEMM reads. Only `live` rows
  // (all by default) are computed.
  void swiglu(const LayerWeights& w, int rows, const kernels::LiveRows& live = {}) {
    mark(w.down8.present() ? "swiglu_fp8_quant" : "swiglu");
    if (w.down8.present()) {
      const bool group_major = !w.moe && fp8_on_cublaslt(w.down8, rows, w.act_width);
      kernels::launch_swiglu_fp8_quant(
          {gate_up, act_q, act_scale, rows, w.act_width, group_major, live}, stream);
    } else {
      kernels::launch_swiglu({gate_up, act, rows, w.act_width, live}, stream);
    }
  }

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
  void enqueue_moe(const LayerWeights& w, int T) {
    mark("router_gemm");
    kernels::launch_matmul({normed, w.router, nullptr, router_logits, T, experts, hidden}, stream);
    mark("router_topk");
    kernels::launch_moe_router_topk(
        {router_logits, topk_ids, topk_weights, T, experts, top_k, cfg.norm_topk_prob}, stream);
    const bf16* x = normed;
    const int32_t* ids = topk_ids;
    const float* weights_in = topk_weights;
    int tokens = T;
    bf16* out = mix;
    kernels::LiveRows live_tokens;  // every token, but under DP + EP the ones received
    if (dispatch) {
      mark("moe_dispatch");
      group->moe_dispatch(rank, normed, topk_ids, topk_weights, T, experts, stream);
      x = group->recv_hidden(rank);
      ids = group->recv_ids(rank);
      weights_in = group->recv_weights(rank);
      tokens = moe_tokens;
      out = recv_sum;
      static_assert(kernels::kMaxLiveRegions >= parallel::cuda::kMaxRanks);
      live_tokens = {group->recv_counts(rank), group->moe_layout().max_tokens};
    } else if (shard.ep_size > 1) {
      mark("moe_localize");
      kernels::launch_moe_localize_experts(
          {topk_ids, topk_weights, T * top_k, shard.expert_begin, local_experts}, stream);
    }
    // Under DP + EP the live rows are the received tokens' routes, at most moe_bound_tokens x top_k
    // (see moe_step_tokens); the permute and combine keep the buffer's shape and their device bounds.
    const int R = (dispatch ? std::min(tokens, moe_bound_tokens) : tokens) * top_k;
    // The permuted rows of this rank's experts, [0, expert_offsets[local_experts]): under EP the
    // absent id sorts after them and its rows are never computed, so they need not be copied or
    // activated. (With all experts here the bound would be every row.) One region bounds a prefix,
    // so it must span the largest op it bounds: the permute's copy runs over all tokens x top_k
    // rows (under DP + EP the whole receive buffer, beyond R), the SwiGLU over R of them.
    kernels::LiveRows computed_rows;
    if (shard.ep_size > 1 && R > 0) computed_rows = {expert_offsets + local_experts, tokens * top_k};
    // FP8 experts: each token is quantised once and its codes and scales are permuted (the same
    // bytes as quantising the permuted bf16 rows, 1 / top_k of the work).
    const bool fp8_experts = w.gate_up8.present();
    if (fp8_experts) {
      mark("experts_gate_up.act_quant");
      quant::Fp8ActQuantParams<bf16> qp{x, token_q, token_scale, tokens, hidden};
      qp.live_tokens = live_tokens;
      kernels::launch_fp8_act_quant(qp, stream);
    }
    // bf16 experts at decode's few rows per expert (and no DP + EP bound): the streaming kernel
    // gathers the token rows itself and writes silu(gate) * up straight into the down projection's
    // input, so the permute builds only its index (the two fusions are bit-identical to the ops
    // they replace; two launches and two round trips fewer).
    kernels::MoeGroupedMatmulParams<bf16> gate_up_p{x, w.gate_up, expert_offsets, act, R,
                                                   local_experts, 2 * w.width, hidden};
    const bool streamed = !fp8_experts && !w.down8.present() && !dispatch && R > 0 &&
                          R <= kernels::kMaxGatheredRows &&
                          kernels::moe_grouped_matmul_auto_kind(gate_up_p) ==
                              kernels::GroupedGemmKind::Streaming;
    mark("moe_permute");
    kernels::launch_moe_permute({x, ids, fp8_experts || streamed ? nullptr : permuted_x,
                                 permuted_index, expert_offsets, tokens, hidden, route_experts(),
                                 top_k, live_tokens, computed_rows},
                                stream);
    if (fp8_experts) {
      kernels::launch_fp8_permute_rows({token_q, token_scale, permuted_index, act_q, act_scale,
                                        tokens, hidden, top_k, live_tokens, computed_rows},
                                       stream);
    }
    if (streamed) {
      mark("experts_gate_up_swiglu");
      gate_up_p.swiglu = true;
      gate_up_p.permuted_index = permuted_index;
      gate_up_p.top_k = top_k;
      kernels::launch_moe_grouped_matmul(gate_up_p, stream);
    } else {
      grouped("experts_gate_up", permuted_x, w.gate_up, w.gate_up8, gate_up, R, 2 * w.width,
              hidden, fp8_experts);
      swiglu(w, R, computed_rows);
    }
    grouped("experts_down", act, w.down, w.down8, expert_out, R, hidden, w.act_width,
            w.down8.present());
    mark("moe_combine");
    kernels::launch_moe_unpermute_combine(
        {expert_out, permuted_index, weights_in, out, tokens, hidden, top_k, live_tokens}, stream);
    if (dispatch) {
      mark("moe_dispatch_combine");
      group->moe_combine(rank, recv_sum, mix, T, stream);
    } else if (moe_reduce) {
      mark("moe_all_reduce");
      comm->all_reduce_sum(mix, static_cast<size_t>(T) * hidden, stream);
    }
  }

  // Every check of a batch that can fail, made before anything is enqueued: a sharded step checks
  // every rank's part first, so no rank is left spinning in a collective for one that threw.
  void check_batch(std::span<const StepSequence> batch) const {
    int tokens = 0;
    const int bs = opt.block_size;
    for (const StepSequence& s : batch) {
      RELAY_CHECK(!s.tokens.empty(), "sequence ", s.seq_id, " has no tokens in this step");
      RELAY_CHECK(s.num_computed >= 0, "sequence ", s.seq_id, " has num_computed ", s.num_computed);
      RELAY_CHECK(!s.sample || s.sampling != nullptr, "sequence ", s.seq_id,
                  " samples but has no SamplingParams");
      RELAY_CHECK(s.num_draft_tokens == 0 ||
                      (s.sample && s.num_draft_tokens > 0 &&
                       s.num_draft_tokens < static_cast<int>(s.tokens.size()) &&
                       s.num_draft_tokens <= opt.max_draft_tokens),
                  "sequence ", s.seq_id, " has ", s.num_draft_tokens, " drafts among ",
                  s.tokens.size(), " tokens (sample ", s.sample,
                  "); the CUDA backend verifies at most ", opt.max_draft_tokens,
                  " drafts per sampling sequence");
      RELAY_CHECK(s.num_prompt_logprobs <= kMaxLogprobs &&
                      (s.num_prompt_logprobs < 0 || s.prompt_logprobs != nullptr),
                  "sequence ", s.seq_id, " asks for ", s.num_prompt_logprobs,
                  " prompt logprobs; the CUDA backend gives -1 (none) to ", kMaxLogprobs,
                  ", into a prompt_logprobs output");
      const size_t words = token_bitmask_words(vocab);
      RELAY_CHECK(s.allowed_tokens.empty() ||
                      s.allowed_tokens.size() == words * (1 + size_t(s.num_draft_tokens)),
                  "sequence ", s.seq_id, " has a token bitmask of ", s.allowed_tokens.size(),
                  " words; ", 1 + s.num_draft_tokens, " sampled rows over a vocabulary of ", vocab,
                  " take ", words * (1 + size_t(s.num_draft_tokens)));
      for (size_t at = 0; at < s.allowed_tokens.size(); at += words) {
        const auto mask = s.allowed_tokens.subspan(at, words);
        RELAY_CHECK(std::any_of(mask.begin(), mask.end(), [](uint32_t w) { return w != 0; }),
                    "sequence ", s.seq_id, ": the token bitmask of row ", at / words,
                    " allows no token");
      }
      for (const auto& [token, bias] : s.logit_bias) {
        RELAY_CHECK(token >= 0 && token < vocab, "sequence ", s.seq_id, ": logit_bias token ",
                    token, " outside [0, ", vocab, ")");
      }
      tokens += static_cast<int>(s.tokens.size());
      const int64_t context = s.num_computed + static_cast<int64_t>(s.tokens.size());
      RELAY_CHECK(static_cast<int64_t>(s.block_table.size()) * bs >= context, "sequence ", s.seq_id,
                  " needs ", context, " KV slots but its block table has ", s.block_table.size(),
                  " blocks of ", bs);
      RELAY_CHECK(static_cast<int64_t>(s.block_table.size()) <= max_blocks, "sequence ", s.seq_id,
                  " has ", s.block_table.size(), " blocks; max_position_embeddings allows ",
                  max_blocks);
      for (int32_t b : s.block_table) {
        RELAY_CHECK(b >= 0 && b < kv_layout.num_blocks, "sequence ", s.seq_id, " uses block ", b,
                    " outside the pool of ", kv_layout.num_blocks);
      }
      for (int32_t id : s.tokens) {
        RELAY_CHECK(id >= 0 && id < vocab, "token ", id, " of sequence ", s.seq_id,
                    " is outside the vocabulary of ", vocab);
      }
    }
    RELAY_CHECK(tokens <= opt.max_num_tokens, "step has ", tokens,
                " tokens; the CUDA backend was sized for ", opt.max_num_tokens);
    RELAY_CHECK(batch.size() <= static_cast<size_t>(opt.max_num_seqs), "step has ", batch.size(),
                " sequences; the CUDA backend was sized for ", opt.max_num_seqs);
  }

  // Fills meta_host for `batch` and copies it to the device. Returns the shape. With pad_seqs > 0
  // (a graph step, graph_tokens_per_seq) every sequence is padded to per_seq tokens with filler
  // rows after its own, and the batch to pad_seqs sequences with dummies of per_seq tokens; fillers
  // and dummies write no K/V, and every token row gets logits (a graph step's sequences sample
  // after their last token and each draft); else the logit rows are `rows`. A filler row sits at
  // the positions after the sequence's drafts: causal attention keeps it out of the real rows.
  Shape upload_batch(std::span<const StepSequence> batch, int pad_seqs, int width,
                     const std::vector<int32_t>& rows, int per_seq = 1) {
    const bool graph = pad_seqs > 0;
    int tokens = 0;
    for (const StepSequence& s : batch) tokens += static_cast<int>(s.tokens.size());
    const int seqs = std::max<int>(pad_seqs, static_cast<int>(batch.size()));
    if (graph) tokens = seqs * per_seq;
    const int num_rows = graph ? tokens : static_cast<int>(rows.size());
    RELAY_CHECK(tokens <= opt.max_num_tokens && seqs <= opt.max_num_seqs &&
                    num_rows <= logit_rows(),
                "step of ", tokens, " tokens, ", seqs, " sequences and ", num_rows,
                " logit rows; the CUDA backend was sized for ", opt.max_num_tokens, ", ",
                opt.max_num_seqs, " and ", logit_rows());
    const MetaLayout m = MetaLayout::make(tokens, seqs, num_rows, width);
    RELAY_CHECK(m.bytes <= meta_capacity, "batch metadata of ", m.bytes, " bytes exceeds ",
                meta_capacity);
    auto* token_ids = reinterpret_cast<int32_t*>(meta_host + m.token_ids);
    auto* positions = reinterpret_cast<int32_t*>(meta_host + m.positions);
    auto* logit_rows = reinterpret_cast<int32_t*>(meta_host + m.logit_rows);
    auto* query_starts = reinterpret_cast<int32_t*>(meta_host + m.query_starts);
    auto* context_lens = reinterpret_cast<int32_t*>(meta_host + m.context_lens);
    auto* slots = reinterpret_cast<int64_t*>(meta_host + m.slot_mapping);
    auto* tables = reinterpret_cast<int32_t*>(meta_host + m.block_tables);
    std::memset(tables, 0, sizeof(int32_t) * static_cast<size_t>(seqs) * width);
    const int bs = opt.block_size;
    int t = 0;
    query_starts[0] = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const StepSequence& s = batch[i];
      const int64_t context = s.num_computed + static_cast<int64_t>(s.tokens.size());
      RELAY_CHECK(static_cast<int>(s.block_table.size()) <= width, "sequence ", s.seq_id, " has ",
                  s.block_table.size(), " blocks; the table width is ", width);
      std::copy(s.block_table.begin(), s.block_table.end(), tables + i * width);
      for (size_t j = 0; j < s.tokens.size(); ++j, ++t) {
        const int32_t pos = s.num_computed + static_cast<int32_t>(j);
        token_ids[t] = s.tokens[j];
        positions[t] = pos;
        slots[t] = int64_t{s.block_table[pos / bs]} * bs + pos % bs;
      }
      const int fillers = graph ? per_seq - static_cast<int>(s.tokens.size()) : 0;
      for (int f = 0; f < fillers; ++f, ++t) {
        token_ids[t] = 0;
        positions[t] = static_cast<int32_t>(context) + f;
        slots[t] = -1;
      }
      query_starts[i + 1] = t;
      context_lens[i] = static_cast<int32_t>(context) + fillers;
    }
    for (int i = static_cast<int>(batch.size()); i < seqs; ++i) {  // padding: writes nothing
      for (int j = 0; j < per_seq; ++j, ++t) {
        token_ids[t] = 0;
        positions[t] = j;
        slots[t] = -1;
      }
      query_starts[i + 1] = t;
      context_lens[i] = per_seq;
    }
    if (graph) {
      for (int r = 0; r < num_rows; ++r) logit_rows[r] = r;
    } else {
      std::copy(rows.begin(), rows.end(), logit_rows);
    }
    // The step's device time starts here, after the host built the metadata.
    RELAY_CUDA_CHECK(cudaEventRecord(step_begin, stream));
    RELAY_CUDA_CHECK(cudaMemcpyAsync(meta_dev, meta_host, m.bytes, cudaMemcpyHostToDevice, stream));
    return Shape{tokens, seqs, num_rows, width, graph ? per_seq : 0};
  }

  static int bucket_of(int n) {
    for (int b : kBatchBuckets) {
      if (b >= n) return b;
    }
    return n;
  }
  // The block-table width of `batch`'s metadata: its longest table, at least min_width; with pow2
  // (graph steps) rounded up to a power of two from 16, within max_blocks.
  int width_of(std::span<const StepSequence> batch, bool pow2, int min_width = 1) const {
    int w = min_width;
    for (const StepSequence& s : batch) w = std::max(w, static_cast<int>(s.block_table.size()));
    if (!pow2) return w;
    int p = 16;
    while (p < w) p *= 2;
    return std::min(p, std::max(w, max_blocks));
  }

  // The tokens per sequence q of the graph that can run `batch` (under DP + EP also if the step's
  // senders fit the graph's bound, run()), 0 for none: every sequence samples after its last token
  // and its drafts, if any (a decode or a verify step), and q is one more than the most drafts a
  // sequence brings; sequences with fewer are padded (upload_batch), so the n-gram proposer's
  // varying drafts replay graphs as an MTP head's uniform ones do.
  int graph_tokens_per_seq(std::span<const StepSequence> batch) const {
    if (!opt.cuda_graphs || batch.empty() || static_cast<int>(batch.size()) > opt.max_num_seqs)
      return 0;
    int q = 1;
    for (const StepSequence& s : batch) {
      if (!s.sample || static_cast<int>(s.tokens.size()) != 1 + s.num_draft_tokens) return 0;
      q = std::max(q, 1 + s.num_draft_tokens);
    }
    for (const StepSequence& s : batch) {  // the fillers' positions stay within the tables' width
      if ((s.num_computed + q + opt.block_size - 1) / opt.block_size > max_blocks) return 0;
    }
    const int padded = std::min(bucket_of(static_cast<int>(batch.size())), opt.max_num_seqs);
    return padded * q <= opt.max_num_tokens ? q : 0;
  }
  // The token rows a step of `batch` sends through the MoE layers: a graph step's padded batch, or
  // its tokens (an upper bound either way, which is what moe_step_tokens needs).
  int step_tokens(std::span<const StepSequence> batch) const {
    if (batch.empty()) return 0;
    if (const int q = graph_tokens_per_seq(batch); q > 0)
      return std::min(bucket_of(static_cast<int>(batch.size())), opt.max_num_seqs) * q;
    int tokens = 0;
    for (const StepSequence& s : batch) tokens += static_cast<int>(s.tokens.size());
    return tokens;
  }

  // Runs the forward for a step; decode and verify batches through (and into) the graph cache.
  Shape run(std::span<const StepSequence> batch, const std::vector<int32_t>& rows) {
    const int q = graph_tokens_per_seq(batch);
    if (q == 0 || (dispatch && moe_step_tokens > moe_graph_tokens(q))) {
      const Shape sh = upload_batch(batch, 0, width_of(batch, false), rows);
      moe_bound_tokens = moe_step_tokens;
      enqueue_forward(sh);
      return sh;
    }
    moe_bound_tokens = moe_graph_tokens(q);  // what the captured graph keeps
    const int padded = std::min(bucket_of(static_cast<int>(batch.size())), opt.max_num_seqs);
    // The fillers' positions run up to q - 1 past a sequence's drafts: the table covers them too.
    int reach = 1;
    for (const StepSequence& s : batch) reach = std::max(reach, (s.num_computed + q + opt.block_size - 1) / opt.block_size);
    const int width = width_of(batch, true, reach);
    const Shape sh = upload_batch(batch, padded, width, rows, q);
    const auto key = std::make_tuple(padded, width, q);
    auto it = graphs.find(key);
    if (it != graphs.end()) {
      RELAY_CUDA_CHECK(cudaGraphLaunch(it->second, stream));
      return sh;
    }
    // First time for this bucket: run eagerly (which also grows any workspace), then capture.
    enqueue_forward(sh);
    cudaGraph_t graph = nullptr;
    RELAY_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue_forward(sh);
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    RELAY_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    RELAY_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    RELAY_CUDA_CHECK(cudaGraphDestroy(graph));
    graphs.emplace(key, exec);
    return sh;
  }

  void finish_step() {
    RELAY_CUDA_CHECK(cudaEventRecord(step_end, stream));
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    float ms = 0.0f;
    RELAY_CUDA_CHECK(cudaEventElapsedTime(&ms, step_begin, step_end));
    last_step_device_ms = ms;
  }

  // A sequence's device-sampled rows' constraints (StepSequence::allowed_tokens, logit_bias) into
  // the host staging, for its rows from `first` on (sample_rows_host); `rows` of them, the others
  // (a graph step's fillers) unconstrained.
  void stage_constraints(const StepSequence& s, int first, int rows, int per_seq,
                         std::vector<uint32_t>& masks, std::vector<int32_t>& bias_tokens,
                         std::vector<float>& bias_values) const {
    const size_t words = token_bitmask_words(vocab);
    for (int j = 0; j < std::max(rows, per_seq); ++j) {
      kernels::SampleRowParams& row = sample_rows_host[first + j];
      if (j >= rows) continue;
      if (!s.allowed_tokens.empty()) {
        row.mask_row = static_cast<int32_t>(masks.size() / words);
        const auto mask = s.allowed_tokens.subspan(size_t(j) * words, words);
        masks.insert(masks.end(), mask.begin(), mask.end());
      }
      row.bias_begin = static_cast<int32_t>(bias_tokens.size());
      row.bias_count = static_cast<int32_t>(s.logit_bias.size());
      for (const auto& [token, bias] : s.logit_bias) {
        bias_tokens.push_back(token);
        bias_values.push_back(bias);
      }
    }
  }

  // The sample kernel over rows [0, n) of `logits` (sample_rows_host filled), its results copied
  // to the host mirrors; the constraints staged for them (stage_constraints) go up first.
  void launch_sampling(int n, int max_logprobs, const std::vector<uint32_t>& masks,
                       const std::vector<int32_t>& bias_tokens,
                       const std::vector<float>& bias_values) {
    kernels::SampleParams p{.logits = logits, .rows = sample_rows_dev, .tokens = tokens_dev,
                            .logprobs = logprobs_dev, .top_ids = top_ids_dev,
                            .top_logprobs = top_lp_dev, .ranks = ranks_dev,
                            .num_rows = n, .vocab_size = vocab, .max_logprobs = max_logprobs};
    if (!masks.empty() || !bias_tokens.empty()) {
      // NOTE: staged from pageable memory, which the copy reads before it returns.
      const size_t nb = bias_tokens.size(), mask_bytes = align_up(masks.size() * 4, 16);
      const size_t bias_bytes = align_up(nb * 4, 16);
      auto* base = static_cast<uint8_t*>(
          constraints_ws.get(mask_bytes + 3 * bias_bytes + 16, stream, "token constraints"));
      auto up = [&](void* dst, const void* src, size_t bytes) {
        if (bytes) RELAY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
      };
      p.allowed = reinterpret_cast<const uint32_t*>(base);
      p.mask_words = masks.empty() ? 0 : static_cast<int>(token_bitmask_words(vocab));
      p.bias_tokens = reinterpret_cast<const int32_t*>(base + mask_bytes);
      p.bias_values = reinterpret_cast<const float*>(base + mask_bytes + bias_bytes);
      p.bias_raw = reinterpret_cast<float*>(base + mask_bytes + 2 * bias_bytes);
      up(base, masks.data(), masks.size() * 4);
      up(base + mask_bytes, bias_tokens.data(), nb * 4);
      up(base + mask_bytes + bias_bytes, bias_values.data(), nb * 4);
    }
    RELAY_CUDA_CHECK(cudaMemcpyAsync(sample_rows_dev, sample_rows_host,
                                     n * sizeof(kernels::SampleRowParams), cudaMemcpyHostToDevice,
                                     stream));
    kernels::launch_sample(p, stream);
    auto down = [&](void* dst, const void* src, size_t bytes) {
      RELAY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
    };
    down(tokens_host, tokens_dev, n * 4);
    down(logprobs_host, logprobs_dev, n * 4);
    down(ranks_host, ranks_dev, n * 4);
    if (max_logprobs > 0) {
      down(top_ids_host, top_ids_dev, size_t(n) * max_logprobs * 4);
      down(top_lp_host, top_lp_dev, size_t(n) * max_logprobs * 4);
    }
  }

  // Row r of the last launch_sampling as a TokenLogprob with its top `top` logprobs.
  TokenLogprob sampled_row(int r, int max_logprobs, int top) const {
    TokenLogprob tok;
    tok.token = tokens_host[r];
    tok.logprob = logprobs_host[r];
    for (int m = 0; m < top; ++m) {
      tok.top.emplace_back(top_ids_host[r * max_logprobs + m], top_lp_host[r * max_logprobs + m]);
    }
    return tok;
  }

  // Runs a checked batch (check_batch) and samples its sampling sequences, unless `sample` is
  // false (a TP rank other than 0: the same logits, sampled by rank 0). A sequence with k drafts
  // samples k + 1 rows, the last token's and each draft's, which verify the drafts in order
  // (sampler.h, verify_drafts): it returns its accepted drafts and the token after them. Token
  // constraints apply in the sample kernel; a sequence with penalties is sampled on the host,
  // constraints included. Prompt logprobs score their rows in the same kernel, after the sampled
  // rows, in chunks of what the logits buffer holds.
  std::vector<SampledToken> step(std::span<const StepSequence> batch, bool sample) {
    std::vector<int32_t> rows;
    std::vector<const StepSequence*> samplers;
    std::vector<int> first_row;  // samplers[i]'s rows start at rows[first_row[i]]
    struct Scored {
      const StepSequence* seq;
      size_t index;  // in *seq->prompt_logprobs
      int32_t row, target;
    };
    std::vector<Scored> scored;  // prompt logprob rows, by sequence then row
    int t = 0;
    for (const StepSequence& s : batch) {
      const size_t n = s.num_prompt_logprob_rows();
      if (sample && s.num_prompt_logprobs >= 0) s.prompt_logprobs->assign(n, TokenLogprob{});
      for (size_t j = 0; j < n && sample; ++j) {
        scored.push_back({&s, j, t + static_cast<int32_t>(j), s.prompt_tokens[s.num_computed + j + 1]});
      }
      t += static_cast<int>(s.tokens.size());
      if (!s.sample) continue;
      samplers.push_back(&s);
      first_row.push_back(static_cast<int>(rows.size()));
      for (int j = s.num_draft_tokens; j >= 0; --j) rows.push_back(t - 1 - j);
    }
    // The first chunk of scored rows rides on the step's LM head, after the sampled rows.
    const size_t chunk = static_cast<size_t>(logit_rows());
    const size_t scored_first = std::min(scored.size(), chunk - rows.size());
    for (size_t i = 0; i < scored_first; ++i) rows.push_back(scored[i].row);
    const Shape sh = run(batch, rows);
    if ((samplers.empty() && scored.empty()) || !sample) {
      finish_step();
      return {};
    }
    RELAY_CHECK(scored.empty() || sh.per_seq == 0, "prompt logprobs in a CUDA graph step");
    // Logits row r belongs to rows[r] in an eager step. A graph step computes every token row, each
    // sequence's per_seq of them (its last token's, its drafts', then fillers) one after another
    // and the padding's after the real ones; its sequences all sample, and the sampler draws every
    // row of theirs (the fillers' draws go unused).
    int rows_each = 0;  // a graph step's rows per sequence
    if (sh.per_seq > 0) {
      rows_each = sh.per_seq;
      for (size_t i = 0; i < samplers.size(); ++i) first_row[i] = static_cast<int>(i) * rows_each;
    }
    int max_logprobs = 0;
    std::vector<uint32_t> masks;
    std::vector<int32_t> bias_tokens;
    std::vector<float> bias_values;
    for (size_t i = 0; i < samplers.size(); ++i) {
      const StepSequence& s = *samplers[i];
      const SamplingParams& sp = *s.sampling;
      for (int j = 0; j < std::max(rows_each, 1 + s.num_draft_tokens); ++j) {
        sample_rows_host[first_row[i] + j] = {sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                              sample_uniform(sp.seed, s.sample_index + j)};
      }
      if (!needs_host_sampling(sp)) {
        stage_constraints(s, first_row[i], 1 + s.num_draft_tokens, rows_each, masks, bias_tokens,
                          bias_values);
      }
      max_logprobs = std::max(max_logprobs, std::min(sp.num_logprobs, kMaxLogprobs));
    }
    for (const Scored& sc : scored) max_logprobs = std::max(max_logprobs, sc.seq->num_prompt_logprobs);
    const int sampled_rows = sh.per_seq > 0 ? static_cast<int>(samplers.size()) * rows_each
                                            : static_cast<int>(rows.size() - scored_first);
    auto score_rows = [&](size_t begin, size_t end, int at) {  // scored[begin, end) from row `at`
      for (size_t i = begin; i < end; ++i) {
        kernels::SampleRowParams& p = sample_rows_host[at + static_cast<int>(i - begin)];
        p = {};
        p.score_token = scored[i].target;
      }
    };
    auto collect_scores = [&](size_t begin, size_t end, int at) {
      for (size_t i = begin; i < end; ++i) {
        const StepSequence& s = *scored[i].seq;
        const int r = at + static_cast<int>(i - begin);
        TokenLogprob& lp = (*s.prompt_logprobs)[scored[i].index];
        lp = sampled_row(r, max_logprobs, s.num_prompt_logprobs);
        lp.rank = ranks_host[r];
      }
    };
    score_rows(0, scored_first, sampled_rows);
    launch_sampling(sampled_rows + static_cast<int>(scored_first), max_logprobs, masks,
                    bias_tokens, bias_values);
    finish_step();
    collect_scores(0, scored_first, sampled_rows);
    std::vector<SampledToken> out;
    std::vector<float> host_rows;
    for (size_t i = 0; i < samplers.size(); ++i) {
      const StepSequence& s = *samplers[i];
      const SamplingParams& sp = *s.sampling;
      const int r0 = first_row[i], k = s.num_draft_tokens;
      const std::span<const int32_t> drafts = s.tokens.last(static_cast<size_t>(k));
      std::vector<SampledToken> got;
      if (needs_host_sampling(sp)) {  // penalties: the shared sampler on this sequence's rows
        host_rows.resize(size_t(k + 1) * vocab);
        RELAY_CUDA_CHECK(cudaMemcpy(host_rows.data(), logits + size_t(r0) * vocab,
                                    host_rows.size() * 4, cudaMemcpyDeviceToHost));
        got = sample_with_drafts(host_rows, drafts, sp, s.prompt_tokens, s.output_tokens,
                                 s.sample_index, {s.allowed_tokens, s.logit_bias},
                                 opt.forced_draft_acceptance);
      } else {
        const int top = std::min(sp.num_logprobs, kMaxLogprobs);
        got = verify_drafts(drafts, sp.seed, s.sample_index, opt.forced_draft_acceptance,
                            [&](size_t j) {
                              SampledToken tok;
                              const int r = r0 + static_cast<int>(j);
                              if (sp.num_logprobs >= 0) {
                                static_cast<TokenLogprob&>(tok) = sampled_row(r, max_logprobs, top);
                              } else {
                                tok.token = tokens_host[r];
                              }
                              return tok;
                            });
      }
      for (SampledToken& tok : got) {
        tok.seq_id = s.seq_id;
        out.push_back(std::move(tok));
      }
    }
    // The rest of the scored rows (the host samplers have read their logits): the LM head again
    // over each chunk of them.
    for (size_t begin = scored_first; begin < scored.size(); begin += chunk) {
      const size_t end = std::min(scored.size(), begin + chunk);
      const int n = static_cast<int>(end - begin);
      const MetaLayout m = MetaLayout::make(sh.tokens, sh.seqs, sh.rows, sh.width);
      auto* host_rows = reinterpret_cast<int32_t*>(meta_host + m.logit_rows);
      for (int i = 0; i < n; ++i) host_rows[i] = scored[begin + i].row;
      RELAY_CUDA_CHECK(cudaMemcpyAsync(meta_dev + m.logit_rows, host_rows, n * 4,
                                       cudaMemcpyHostToDevice, stream));
      kernels::launch_lm_head({normed, reinterpret_cast<const int32_t*>(meta_dev + m.logit_rows),
                               lm_head, logits, n, hidden, vocab},
                              stream);
      score_rows(begin, end, 0);
      launch_sampling(n, max_logprobs, {}, {}, {});
      RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
      collect_scores(begin, end, 0);
    }
    return out;
  }

  std::vector<float> forward_logits(std::span<const StepSequence> batch, CudaBackend::LogitRows which) {
    std::vector<int32_t> all_rows;
    int t = 0;
    for (const StepSequence& s : batch) {
      const int n = static_cast<int>(s.tokens.size());
      if (which == CudaBackend::LogitRows::kLastTokens) {
        all_rows.push_back(t + n - 1);
      } else {
        for (int j = 0; j < n; ++j) all_rows.push_back(t + j);
      }
      t += n;
    }
    // The logits buffer holds logit_rows() rows: run the LM head in chunks over the final hidden.
    const int chunk = logit_rows();
    std::vector<int32_t> first(all_rows.begin(),
                               all_rows.begin() + std::min<size_t>(chunk, all_rows.size()));
    const Shape sh = upload_batch(batch, 0, width_of(batch, false), first);
    moe_bound_tokens = moe_step_tokens;
    enqueue_forward(sh);
    std::vector<float> out(all_rows.size() * size_t(vocab));
    for (size_t begin = 0; begin < all_rows.size(); begin += chunk) {
      const int n = static_cast<int>(std::min<size_t>(chunk, all_rows.size() - begin));
      if (begin > 0) {
        const MetaLayout m = MetaLayout::make(sh.tokens, sh.seqs, sh.rows, sh.width);
        RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));  // meta_host is reused
        std::copy_n(all_rows.begin() + begin, n,
                    reinterpret_cast<int32_t*>(meta_host + m.logit_rows));
        RELAY_CUDA_CHECK(cudaMemcpyAsync(meta_dev + m.logit_rows, meta_host + m.logit_rows, n * 4,
                                         cudaMemcpyHostToDevice, stream));
        kernels::launch_lm_head({normed, reinterpret_cast<const int32_t*>(meta_dev + m.logit_rows),
                                 lm_head, logits, n, hidden, vocab},
                                stream);
      }
      RELAY_CUDA_CHECK(cudaMemcpyAsync(out.data() + begin * vocab, logits, size_t(n) * vocab * 4,
                                       cudaMemcpyDeviceToHost, stream));
    }
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    return out;
  }

  std::vector<OpTiming> profile_forward(std::span<const StepSequence> batch) {
    std::vector<int32_t> rows;
    int t = 0;
    for (const StepSequence& s : batch) {
      t += static_cast<int>(s.tokens.size());
      rows.push_back(t - 1);  // each sequence's last token, as a step samples it
    }
    const Shape sh = batch.empty() ? Shape{} : upload_batch(batch, 0, width_of(batch, false), rows);
    moe_bound_tokens = moe_step_tokens;
    auto enqueue = [&] { batch.empty() ? enqueue_idle() : enqueue_forward(sh); };
    enqueue();  // warm-up: workspaces, cuBLASLt plans, lazy module loads
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    OpMarks m;
    m.hold(stream);
    marks = &m;
    try {
      enqueue();
    } catch (...) {
      marks = nullptr;
      m.release();
      cudaStreamSynchronize(stream);
      throw;
    }
    marks = nullptr;
    m.finish(stream);
    std::vector<OpTiming> out;
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < m.names.size(); ++i) {
      float ms = 0.0f;
      RELAY_CUDA_CHECK(cudaEventElapsedTime(&ms, m.starts[i], m.ends[i]));
      auto [it, fresh] = index.emplace(m.names[i], out.size());
      if (fresh) out.push_back({m.names[i], 0, 0.0});
      out[it->second].calls += 1;
      out[it->second].ms += ms;
    }
    return out;
  }
  // Runs this rank alone, collectives off, on a prompt of every power of two up to a full step (and
  // the full step), sampling up to logit_rows() rows, so every one-time setup of the kernels it
  // will use — function attributes, workspaces, GEMM plans, adapters and the cuBLASLt kernel of
  // every row bucket (blas.cu) — happens now. Some of those calls wait for the whole device, which
  // a step must never do while a peer may be spinning in a collective for this rank. The KV pool is
  // zeroed again afterwards, as allocate_kv left it: a page no sequence wrote reads the same in
  // every layout (the bench decodes over contexts it never wrote, and compares layouts' tokens).
  void warm_up_alone() {
    const bool tp = tp_reduce, moe = moe_reduce, disp = dispatch;
    tp_reduce = moe_reduce = dispatch = false;
    const int cap = std::min({opt.max_num_tokens, max_blocks * opt.block_size,
                              kv_layout.num_blocks * opt.block_size});
    std::vector<int32_t> tokens(cap, 0), table((cap + opt.block_size - 1) / opt.block_size);
    std::iota(table.begin(), table.end(), 0);
    std::vector<int> sizes;
    for (int n = 1; n < cap; n *= 2) sizes.push_back(n);
    sizes.push_back(cap);
    for (int n : sizes) {
      StepSequence s;
      s.tokens = std::span<const int32_t>(tokens).first(n);
      s.block_table = std::span<const int32_t>(table).first((n + opt.block_size - 1) / opt.block_size);
      const std::vector<StepSequence> batch{s};
      std::vector<int32_t> rows(std::min(n, logit_rows()));  // the LM head's row buckets too
      std::iota(rows.begin(), rows.end(), n - static_cast<int>(rows.size()));
      enqueue_forward(upload_batch(batch, 0, width_of(batch, false), rows));
      RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    RELAY_CUDA_CHECK(cudaMemsetAsync(kv_pool, 0, kv_layout.total_bytes(), stream));
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
    tp_reduce = tp, moe_reduce = moe, dispatch = disp;
  }
  // Binds this rank's device to the calling thread (every rank thread, before any CUDA call).
  void bind() const { RELAY_CUDA_CHECK(cudaSetDevice(opt.device)); }
  // A DP + EP rank's step without sequences (enqueue_idle), to completion.
  void idle_step() {
    moe_bound_tokens = moe_step_tokens;
    enqueue_idle();
    RELAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
};

// A rank's part of a step: the sequences it runs, with block tables in its own block ids.
struct RankPart {
  std::vector<size_t> members;  // batch indices, in batch order
  std::vector<StepSequence> seqs;
  std::vector<std::vector<int32_t>> tables;
};

struct CudaBackend::Impl {
  parallel::ParallelConfig parallel;
  std::unique_ptr<parallel::cuda::ThreadPeerGroup> group;  // null with one rank
  std::vector<std::unique_ptr<RankEngine>> ranks;
  int blocks_per_rank = 0;

  Impl(const std::filesystem::path& model_dir, const CudaBackendOptions& o) : parallel(o.parallel) {
    parallel.validate();
    const int world = parallel.world_size();
    const char* loading = std::getenv("CUDA_MODULE_LOADING");
    RELAY_CHECK(world == 1 || (loading != nullptr && std::string(loading) == "EAGER"),
                "sharded CUDA ranks (", parallel.describe(),
                ") need CUDA_MODULE_LOADING=EAGER set before CUDA starts (relay sets it): with lazy "
                "loading, a kernel loaded on first launch can wait forever behind a peer's kernel "
                "that waits for this rank");
    RELAY_CHECK(o.devices.empty() || static_cast<int>(o.devices.size()) == world, "--gpus lists ",
                o.devices.size(), " devices for ", world, " ranks (", parallel.describe(), ")");
    int visible = 0;
    RELAY_CUDA_CHECK(cudaGetDeviceCount(&visible));
    std::vector<int> devices;
    for (int r = 0; r < world; ++r) {
      const int d = o.devices.empty() ? o.device + r : o.devices[r];
      RELAY_CHECK(d >= 0 && d < visible, "rank ", r, " (", parallel.describe(), ") is on CUDA device ",
                  d, ", but ", visible, " device(s) are visible; pass --gpus with one device per rank "
                  "(a device may repeat)");
      devices.push_back(d);
    }
    // Before any launch (see the NOTE at disable_pdl: sharded ranks run without programmatic
    // dependent launch).
    if (world > 1) kernels::cuda::disable_pdl();
    const ModelConfig cfg = ModelConfig::load(model_dir);
    const bool dispatch = parallel.dp > 1 && parallel.ep > 1 && cfg.num_experts > 0;
    for (int r = 0; r < world; ++r) {
      auto e = std::make_unique<RankEngine>();
      e->opt = o;
      e->opt.device = devices[r];
      e->rank = r;
      e->shard = plan_shard(cfg, parallel, r);
      e->tp_reduce = e->shard.tp_size > 1;
      e->moe_reduce = !dispatch && (e->shard.ep_size > 1 || e->shard.tp_size > 1);
      e->dispatch = dispatch;
      e->moe_tokens = dispatch ? world * o.max_num_tokens : o.max_num_tokens;
      e->moe_sources = dispatch ? world : 1;
      e->moe_step_tokens = e->moe_bound_tokens = e->moe_tokens;
      e->bind();
      RELAY_CUDA_CHECK(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking));
      RELAY_CUDA_CHECK(cudaEventCreate(&e->step_begin));
      RELAY_CUDA_CHECK(cudaEventCreate(&e->step_end));
      kernels::prepare_blas_stream(e->stream);
      e->load(model_dir);
      e->allocate_activations();
      ranks.push_back(std::move(e));
    }
    if (world > 1) {
      parallel::cuda::ThreadPeerGroupOptions g;
      const RankEngine& r0 = *ranks.front();
      g.all_reduce_capacity_bytes = static_cast<size_t>(o.max_num_tokens) * r0.hidden * sizeof(bf16);
      if (dispatch) {
        g.max_tokens_per_rank = o.max_num_tokens;
        g.hidden = r0.hidden;
        g.top_k = r0.top_k;
      }
      group = std::make_unique<parallel::cuda::ThreadPeerGroup>(devices, g);
      for (int r = 0; r < world; ++r) {
        ranks[r]->group = group.get();
        ranks[r]->comm = &group->communicator(r);
      }
    }
    // Every rank gets the same number of blocks (block ids are shared across TP ranks, and DP
    // partitions are equal): the fewest that every device's share of its free memory holds.
    blocks_per_rank = o.num_kv_blocks;
    if (blocks_per_rank <= 0) {
      blocks_per_rank = INT32_MAX;
      for (auto& e : ranks) {
        const int sharing = static_cast<int>(std::count(devices.begin(), devices.end(), e->opt.device));
        e->bind();
        blocks_per_rank = std::min(blocks_per_rank, e->blocks_that_fit(sharing));
      }
    }
    for (auto& e : ranks) {
      e->bind();
      e->allocate_kv(blocks_per_rank);
      if (world > 1) e->warm_up_alone();
    }
    RELAY_CUDA_CHECK(cudaSetDevice(devices.front()));
  }

  size_t size() const { return ranks.size(); }
  parallel::RankPlace place(size_t r) const {
    return parallel::place_rank(parallel, static_cast<int>(r));
  }

  // Splits the batch among the DP groups, checks every rank's part before anything runs and sets
  // each rank's moe_step_tokens.
  std::vector<RankPart> split(std::span<const StepSequence> batch) {
    RELAY_CHECK(!batch.empty(), "step with an empty batch");
    std::vector<std::vector<size_t>> members =
        split_by_kv_partition(batch, parallel.dp, blocks_per_rank);
    std::vector<RankPart> parts(parallel.dp);
    for (int g = 0; g < parallel.dp; ++g) {
      RankPart& p = parts[g];
      p.members = std::move(members[g]);
      p.tables.resize(p.members.size());
      for (size_t j = 0; j < p.members.size(); ++j) {
        StepSequence s = batch[p.members[j]];
        localize_block_table(s, g * blocks_per_rank, blocks_per_rank, p.tables[j]);
        s.block_table = p.tables[j];
        p.seqs.push_back(s);
      }
    }
    // Once per DP group: its TP ranks share the block ids, the limits and the vocabulary.
    for (int g = 0; g < parallel.dp; ++g) ranks[g * parallel.tp]->check_batch(parts[g].seqs);
    // What every rank may receive in this step under DP + EP (moe_step_tokens): all the DP
    // groups' tokens.
    int total = 0;
    for (int g = 0; g < parallel.dp; ++g) total += ranks[g * parallel.tp]->step_tokens(parts[g].seqs);
    for (auto& e : ranks) e->moe_step_tokens = std::min(total, e->moe_tokens);
    return parts;
  }

  // Runs fn(rank, its part) on every rank's thread, each bound to its device. A rank that throws
  // abandons the step on every rank (thread_peer_group.h): the peers' collective kernels return
  // at once instead of waiting for it, each rank fails with the reason once its stream is idle,
  // and the group's windows are reset, so the next step runs as if this one never started.
  void on_ranks(const std::vector<RankPart>& parts,
                const std::function<void(RankEngine&, const RankPart&, bool tp_lead)>& fn) {
    try {
      run_on_rank_threads(
          size(),
          [&](size_t r) {
            RankEngine& e = *ranks[r];
            e.bind();
            try {
              fn(e, parts[place(r).dp_rank], place(r).tp_rank == 0);
              if (group) {
                RELAY_CUDA_CHECK(cudaStreamSynchronize(e.stream));
                RELAY_CHECK(!group->abandoned(), "CUDA rank ", r,
                            " abandoned the step: ", group->abandon_reason());
              }
            } catch (const std::exception& ex) {
              // Said at once: the rethrown error only surfaces after every rank has joined.
              std::fprintf(stderr, "relay: CUDA rank %zu failed: %s\n", r, ex.what());
              throw;
            }
          },
          [&](size_t r) {
            if (group) group->abandon(static_cast<int>(r));
          });
    } catch (...) {
      if (group && group->abandoned()) recover_group();
      throw;
    }
  }

  // After an abandoned step: waits for every rank's stream, then resets the group. A rank whose
  // stream reports an error has a broken CUDA context (a fault, not a late peer): nothing can be
  // reset then, and the step's own error stands.
  void recover_group() {
    for (auto& e : ranks) {
      e->bind();
      if (cudaStreamSynchronize(e->stream) != cudaSuccess) return;
    }
    group->reset_after_abort();
  }

  // Runs fn(rank, part, tp_lead) on every rank with sequences (a DP + EP rank without any idles
  // through the MoE exchanges) and returns, per DP group, what its TP-lead rank's fn returned.
  template <typename R>
  std::vector<R> run_groups(const std::vector<RankPart>& parts,
                            const std::function<R(RankEngine&, const RankPart&, bool)>& fn) {
    std::vector<R> out(parallel.dp);
    on_ranks(parts, [&](RankEngine& e, const RankPart& p, bool lead) {
      if (p.seqs.empty()) {
        if (e.dispatch) e.idle_step();
        return;
      }
      R r = fn(e, p, lead);
      if (lead) out[place(e.rank).dp_rank] = std::move(r);
    });
    return out;
  }

  std::vector<SampledToken> step(std::span<const StepSequence> batch) {
    if (size() == 1) {
      RELAY_CHECK(!batch.empty(), "step with an empty batch");
      ranks[0]->check_batch(batch);
      return ranks[0]->step(batch, true);
    }
    const std::vector<RankPart> parts = split(batch);
    const std::vector<std::vector<SampledToken>> sampled = run_groups<std::vector<SampledToken>>(
        parts, [](RankEngine& e, const RankPart& p, bool lead) { return e.step(p.seqs, lead); });
    // Back in batch order: each DP group's tokens follow its members' order, a sampling member's
    // consecutive (its accepted drafts, then the token after them).
    std::vector<std::span<const SampledToken>> by_index(batch.size());
    for (int g = 0; g < parallel.dp; ++g) {
      size_t next = 0;
      for (size_t i : parts[g].members) {
        if (!batch[i].sample) continue;
        size_t end = next;
        const size_t most = next + 1 + static_cast<size_t>(batch[i].num_draft_tokens);
        while (end < std::min(most, sampled[g].size()) && sampled[g][end].seq_id == batch[i].seq_id)
          ++end;
        RELAY_CHECK(end > next, "DP rank ", g, " returned no token for sequence ", batch[i].seq_id);
        by_index[i] = std::span<const SampledToken>(sampled[g]).subspan(next, end - next);
        next = end;
      }
    }
    std::vector<SampledToken> out;
    for (const std::span<const SampledToken>& tokens : by_index)
      out.insert(out.end(), tokens.begin(), tokens.end());
    return out;
  }

  std::vector<float> forward_logits(std::span<const StepSequence> batch, LogitRows rows) {
    if (size() == 1) {
      RELAY_CHECK(!batch.empty(), "forward_logits with an empty batch");
      ranks[0]->check_batch(batch);
      return ranks[0]->forward_logits(batch, rows);
    }
    const std::vector<RankPart> parts = split(batch);
    const std::vector<std::vector<float>> logits = run_groups<std::vector<float>>(
        parts, [&](RankEngine& e, const RankPart& p, bool) { return e.forward_logits(p.seqs, rows); });
    const size_t vocab = static_cast<size_t>(config().vocab_size);
    auto num_rows = [&](size_t i) -> size_t {
      return rows == LogitRows::kLastTokens ? 1 : batch[i].tokens.size();
    };
    std::vector<const float*> first(batch.size(), nullptr);
    for (int g = 0; g < parallel.dp; ++g) {
      size_t row = 0;
      for (size_t i : parts[g].members) {
        first[i] = logits[g].data() + row * vocab;
        row += num_rows(i);
      }
    }
    std::vector<float> out;
    for (size_t i = 0; i < batch.size(); ++i)
      out.insert(out.end(), first[i], first[i] + num_rows(i) * vocab);
    return out;
  }

  std::vector<OpTiming> profile_forward(std::span<const StepSequence> batch) {
    if (size() == 1) {
      RELAY_CHECK(!batch.empty(), "profile_forward with an empty batch");
      ranks[0]->check_batch(batch);
      return ranks[0]->profile_forward(batch);
    }
    const std::vector<RankPart> parts = split(batch);
    std::vector<OpTiming> rank0;
    on_ranks(parts, [&](RankEngine& e, const RankPart& p, bool) {
      if (p.seqs.empty() && !e.dispatch) return;
      std::vector<OpTiming> t = e.profile_forward(p.seqs);
      if (e.rank == 0) rank0 = std::move(t);
    });
    return rank0;
  }

  const ModelConfig& config() const { return ranks.front()->cfg; }
};

CudaBackend::CudaBackend(const std::filesystem::path& model_dir, const CudaBackendOptions& options) {
  RELAY_CHECK(options.max_draft_tokens >= 0 && options.max_draft_tokens <= 16,
              "CUDA backend options: max_draft_tokens ", options.max_draft_tokens,
              " (0 to 16 drafts per sequence)");
  RELAY_CHECK(options.block_size > 0 && options.max_num_seqs > 0 &&
                  options.max_num_tokens >= options.max_num_seqs,
              "CUDA backend options: block_size ", options.block_size, ", max_num_seqs ",
              options.max_num_seqs, ", max_num_tokens ", options.max_num_tokens);
  impl_ = std::make_unique<Impl>(model_dir, options);
}

CudaBackend::~CudaBackend() = default;
const ModelConfig& CudaBackend::config() const { return impl_->config(); }
int CudaBackend::block_size() const { return impl_->ranks.front()->opt.block_size; }
int CudaBackend::num_kv_blocks() const { return impl_->blocks_per_rank * impl_->parallel.dp; }
int CudaBackend::num_kv_partitions() const { return impl_->parallel.dp; }

std::vector<KvPoolExport> CudaBackend::kv_pool_exports() {
  std::vector<KvPoolExport> out;
  for (size_t r = 0; r < impl_->size(); ++r) {
    const RankEngine& e = *impl_->ranks[r];
    out.push_back({reinterpret_cast<std::byte*>(e.kv_pool), e.kv_layout, e.shard.kv_head_begin,
                   e.kv_layout.num_kv_heads, impl_->place(r).dp_rank, e.opt.device});
  }
  return out;
}
std::vector<SampledToken> CudaBackend::step(std::span<const StepSequence> batch) {
  return impl_->step(batch);
}
bool CudaBackend::supports_draft_tokens() const {
  return impl_->ranks.front()->opt.max_draft_tokens > 0;
}
std::vector<float> CudaBackend::forward_logits(std::span<const StepSequence> batch,
                                               LogitRows rows) {
  return impl_->forward_logits(batch, rows);
}
std::vector<OpTiming> CudaBackend::profile_forward(std::span<const StepSequence> batch) {
  return impl_->profile_forward(batch);
}
const CudaLoadStats& CudaBackend::load_stats() const { return impl_->ranks.front()->stats; }
double CudaBackend::last_step_device_ms() const {
  return impl_->ranks.front()->last_step_device_ms;
}
void CudaBackend::synchronize() {
  for (auto& e : impl_->ranks) {
    e->bind();
    RELAY_CUDA_CHECK(cudaStreamSynchronize(e->stream));
  }
}

}  // namespace relay

// RankEngine::load: a rank's shard of the checkpoint onto the device (see rank_engine.h).
#include "engine/cuda/rank_engine.h"
#include "model/decoder_plan.h"

namespace relay::cuda_engine {

namespace {

constexpr size_t kStagingBytes = size_t{64} << 20;

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

}  // namespace

void RankEngine::load(const std::filesystem::path& dir) {
  const auto t0 = std::chrono::steady_clock::now();
  cfg = ModelConfig::load(dir);
  const Checkpoint ckpt = open_checkpoint(dir, opt.load_format);
  // The decoder's plan (model/decoder_plan.h) names every tensor and gives each layer's kinds.
  const DecoderPlan decoder = plan_decoder(cfg, ckpt);
  // The MTP head (model/mtp.h), when asked for: the checkpoint's own mtp.* or a separate directory
  // of them, checked whole before anything is allocated.
  const std::optional<Checkpoint> separate_head = open_separate_mtp_head(opt.mtp);
  const Checkpoint* head_ckpt = nullptr;
  if (opt.mtp.enabled) {
    head_ckpt = separate_head ? &*separate_head : &ckpt;
    check_mtp_head(cfg, *head_ckpt, !separate_head);
  }
  // The checkpoint the tensor lambdas below read: the model's, then the MTP head's.
  const Checkpoint* from = &ckpt;
  // A layer's attention / feed-forward tensors (expert e of this rank's, or the dense MLP's).
  auto attn = [&](const LayerPlan& lp, const char* name) { return linear_weight(lp.attention(), name); };
  auto fused = [&](const LayerPlan& lp) {
    return lp.ffn != FfnKind::kDenseMlp && from->has(fused_experts_weight(lp.mlp(), "gate_up_proj"));
  };
  auto ffn = [&](const LayerPlan& lp, int64_t e, const char* name) {
    return lp.ffn != FfnKind::kDenseMlp ? expert_weight(lp.mlp(), shard.expert_begin + e, name)
                                        : linear_weight(lp.mlp(), name);
  };
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
  rotary_dim = cfg.rotary_dim() == cfg.head_dim ? 0 : static_cast<int>(cfg.rotary_dim());
  if (cfg.has_linear_attention()) {  // this rank's heads and channels, as its state slot holds them
    const RecurrentStateLayout gdn = recurrent_state_layout(cfg, shard, 0);
    gdn_heads_k = shard.num_local_k_heads;
    gdn_heads_v = gdn.num_heads;
    gdn_key_dim = gdn.key_dim;
    gdn_value_dim = gdn.value_dim;
    gdn_conv_dim = gdn.conv_dim;
    gdn_kernel = gdn.conv_width + 1;
    gdn_in_width = gdn_conv_dim + gdn_heads_v * gdn_value_dim + 2 * gdn_heads_v;
  }
  const int64_t H = hidden, hd = head_dim;
  // Full (checkpoint) and local (this rank's) projection widths; the q rows of a rank are its q
  // heads', its k / v rows its KV heads' (model/shard.h).
  const int64_t q_full = cfg.num_attention_heads * hd, kv_full = cfg.num_key_value_heads * hd;
  const int64_t q_dim = int64_t{q_heads} * hd, kv_dim = int64_t{kv_heads} * hd;
  const IndexRange q_rows{shard.q_head_begin * hd, q_dim}, kv_rows{shard.kv_head_begin * hd, kv_dim};
  const int64_t gdn_v_dim = int64_t{gdn_heads_v} * gdn_value_dim;
  const int64_t shared_w = cfg.shared_expert_intermediate_size;
  // A fused group of linears (q|k|v, an MLP's gate|up|down) is FP8 when any of its tensors is an
  // FP8 checkpoint tensor (unless --dtype bf16 asked to dequantise) or when --dtype fp8 asked to
  // quantise bf16 ones; the other members of an FP8 group are quantised with it, so one group
  // runs one kind of GEMM. The router, embeddings, norms and lm_head always stay bf16, and so do
  // the hybrids' gated attention, Gated DeltaNet and shared expert (their FP8 tensors are
  // dequantised at load).
  auto group_fp8 = [&](std::initializer_list<std::string> names) {
    if (opt.weights == WeightFormat::kBf16) return false;
    if (opt.weights == WeightFormat::kFp8) return true;
    for (const std::string& n : names) {
      if (from->get(n).dtype == DType::F8_E4M3) return true;
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
    int shared_parts = 0;  // the shared expert folded into the experts (LayerWeights::shared_parts)
  };
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
  // A layer's formats, its bytes counted.
  auto plan_layer = [&](const LayerPlan& lp) {
    Plan plan;
    count(H), count(H);
    if (lp.mixer == MixerKind::kGatedDeltaNet) {
      count(int64_t{gdn_in_width} * H), count(int64_t{gdn_conv_dim} * gdn_kernel);
      count(gdn_heads_v, 4), count(gdn_heads_v), count(gdn_value_dim), count(H * gdn_v_dim);
    } else {
      const bool gated = lp.mixer == MixerKind::kGatedAttention;
      count(head_dim), count(head_dim);
      if (cfg.attention_bias) count(qkv_dim), count(H);
      if (gated) count(q_dim * H);
      plan.qkv_fp8 = !gated && group_fp8({attn(lp, "q_proj"), attn(lp, "k_proj"), attn(lp, "v_proj")});
      plan.o_fp8 = !gated && group_fp8({attn(lp, "o_proj")});
      RELAY_CHECK(!(cfg.attention_bias && (plan.qkv_fp8 || plan.o_fp8)), dir.string(), ": ",
                  lp.prefix, " has FP8 attention weights and attention_bias, which the FP8 "
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
    }
    const bool moe = lp.ffn != FfnKind::kDenseMlp;
    const int64_t W = mlp_width(moe).count;
    plan.mlp_fp8 =
        fused(lp) ? group_fp8({fused_experts_weight(lp.mlp(), "gate_up_proj"),
                               fused_experts_weight(lp.mlp(), "down_proj")})
                  : group_fp8({ffn(lp, 0, "gate_proj"), ffn(lp, 0, "up_proj"), ffn(lp, 0, "down_proj")});
    // The shared expert joins the experts where the MoE is one rank's whole (no TP or EP) and it
    // is as wide as one of them (every released hybrid), in the experts' format: an FP8 group takes
    // it only where its own tensors are FP8 too (or --dtype fp8 asks). NOTE: a wider one would fold
    // as several parts, but each part's down projection is rounded to bf16 apart, and on the tiny
    // qwen3_5-moe-text fixture (two parts) that moved a near-tie greedy token past the bf16-noise
    // bound of the GPU tests; those run it apart, as transformers does.
    if (lp.ffn == FfnKind::kMoeWithSharedExpert && shard.tp_size == 1 && shard.ep_size == 1 &&
        shared_w == W && top_k + 1 <= kernels::kMaxRoutesPerToken) {
      const std::string se = lp.shared_expert();
      const bool fp8_fits = group_fp8({linear_weight(se, "gate_proj"), linear_weight(se, "up_proj"),
                                       linear_weight(se, "down_proj")});
      if (!plan.mlp_fp8 || fp8_fits) plan.shared_parts = 1;
    }
    const int64_t copies = (moe ? local_experts : 1) + plan.shared_parts;
    if (moe) count(int64_t{experts + (plan.shared_parts > 0 ? 1 : 0)} * H);
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
    // Apart too (a step of many tokens runs it so): folded bf16, a view of its expert slot.
    if (lp.ffn == FfnKind::kMoeWithSharedExpert && (plan.shared_parts == 0 || plan.mlp_fp8)) {
      count(2 * shared_w * H), count(H * shared_w), count(H);
    }
    return plan;
  };
  count(int64_t{vocab} * H);
  count(H);
  if (!cfg.tie_word_embeddings) count(int64_t{vocab} * H);
  std::vector<Plan> plans;
  for (const LayerPlan& lp : decoder.layers) plans.push_back(plan_layer(lp));
  Plan mtp_plan;
  const LayerPlan mtp_layer = plan_mtp_layer(cfg);
  if (head_ckpt != nullptr) {
    from = head_ckpt;
    mtp_plan = plan_layer(mtp_layer);
    count(2 * H * H), count(H), count(H), count(H);  // fc (as two halves) and the head's norms
    from = &ckpt;
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
  // The part of a checkpoint tensor (full shape `shape`) this rank holds — rows x cols, a count
  // of -1 meaning all — and, for an F8_E4M3 tensor, the matching part of its scales. Whole
  // tensors are the checkpoint's views; slices are copied into `slices` (cleared after each
  // layer). FP8 slices must fall on the 128 x 128 scale blocks.
  std::deque<TensorSlice> slices;
  std::deque<TensorView> views;  // experts of fused 3-D tensors (views into the file)
  std::mutex slices_mu;  // experts are packed in parallel
  struct Source {
    const TensorView* w = nullptr;
    const TensorView* scale = nullptr;  // F8_E4M3 weights only
  };
  auto part = [&](const TensorView& t, const std::vector<int64_t>& shape, IndexRange rows,
                  IndexRange cols) -> Source {
    const int64_t num_rows = shape.size() == 1 ? 1 : shape[0], num_cols = shape.back();
    if (rows.count < 0) rows = {0, num_rows};
    if (cols.count < 0) cols = {0, num_cols};
    const bool fp8 = t.dtype == DType::F8_E4M3;
    if (fp8) RELAY_CHECK(quant_cfg.quantized(), "tensor ", t.name, " in ", t.file,
                         " is F8_E4M3 but config.json has no quantization_config");
    const TensorView* scale =
        fp8 ? &from->get(quant::scale_tensor_name(quant_cfg, t.name)) : nullptr;
    if (rows.begin == 0 && rows.count == num_rows && cols.begin == 0 && cols.count == num_cols)
      return {&t, scale};
    std::lock_guard lock(slices_mu);
    slices.push_back(slice_tensor(t, rows.begin, rows.count, cols.begin, cols.count));
    const TensorView* w = &slices.back().view;
    if (!fp8) return {w, nullptr};
    const int64_t B = kernels::kFp8BlockSize;
    auto on_blocks = [&](IndexRange r, int64_t n) {
      return r.begin % B == 0 && (r.count % B == 0 || r.begin + r.count == n);
    };
    RELAY_CHECK(on_blocks(rows, num_rows) && on_blocks(cols, num_cols), "tensor ", t.name, " in ",
                t.file, ": rank ", rank, " holds rows [", rows.begin, ", +", rows.count,
                ") x cols [", cols.begin, ", +", cols.count,
                "), which do not fall on its 128 x 128 FP8 scale blocks; shard the experts with "
                "--ep instead of splitting their width, or load it with --dtype bf16");
    slices.push_back(slice_tensor(*scale, rows.begin / B, (rows.count + B - 1) / B,
                                  cols.begin / B, (cols.count + B - 1) / B));
    return {w, &slices.back().view};
  };
  auto source = [&](const std::string& name, std::vector<int64_t> shape, IndexRange rows = {},
                    IndexRange cols = {}) -> Source {
    return part(from->get(name, shape), shape, rows, cols);
  };
  // Expert e of a fused 3-D tensor [E, rows, cols] as a 2-D part (bf16 / f16 / f32 tensors).
  auto expert_source = [&](const LayerPlan& lp, const char* name, int64_t e, int64_t rows_per_expert,
                           int64_t cols, IndexRange rows = {}, IndexRange col_range = {}) -> Source {
    const TensorView& t = from->get(fused_experts_weight(lp.mlp(), name),
                                    {experts, rows_per_expert, cols});
    RELAY_CHECK(t.dtype != DType::F8_E4M3, "tensor ", t.name, " in ", t.file,
                ": fused 3-D FP8 experts are not read by the cuda device; store them per expert");
    const size_t bytes = static_cast<size_t>(rows_per_expert * cols) * dtype_size(t.dtype);
    const TensorView* v = nullptr;
    {
      std::lock_guard lock(slices_mu);
      views.push_back(TensorView{str(t.name, "[", shard.expert_begin + e, "]"), t.dtype,
                                 {rows_per_expert, cols},
                                 t.data + static_cast<size_t>(shard.expert_begin + e) * bytes,
                                 bytes, t.file});
      v = &views.back();
    }
    return part(*v, {rows_per_expert, cols}, rows, col_range);
  };
  // Any checkpoint tensor part widened to fp32 (FP8 ones dequantised).
  auto to_f32 = [&](const Source& src) {
    const TensorView& t = *src.w;
    std::vector<float> w(static_cast<size_t>(t.numel()));
    if (t.dtype != DType::F8_E4M3) {
      tensor_to_f32(t, w.data());
    } else {
      quant::dequantize_stored_weight(
          quant_cfg, stored(t), [&](const std::string&) { return stored(*src.scale); }, w.data());
    }
    return w;
  };
  // A bf16 destination from any checkpoint tensor part: FP8 ones (with --dtype bf16) dequantised.
  auto put = [&](bf16* dst, const Source& src) {
    if (src.w->dtype != DType::F8_E4M3) {
      up.put(dst, *src.w);
      return;
    }
    const std::vector<float> w = to_f32(src);
    up.put_f32(dst, w.data(), w.size());
  };
  // An RMSNorm weight: 1 + w in fp32 for zero-centred models, then bf16.
  auto put_norm = [&](bf16* dst, const std::string& name, int64_t size) {
    const Source src = source(name, {size});
    if (!cfg.zero_centered_norms) {
      put(dst, src);
      return;
    }
    std::vector<float> w = to_f32(src);
    for (float& v : w) v += 1.0f;
    up.put_f32(dst, w.data(), w.size());
  };
  // Rows `rows` of tensors stacked along their first dimension (each [tensor_rows[i], ...], as
  // `shapes` say), as one bf16 upload: a Gated DeltaNet layer's in_proj and conv channels.
  auto put_rows = [&](bf16* dst, const std::vector<std::string>& names,
                      const std::vector<std::vector<int64_t>>& shapes,
                      const std::vector<int64_t>& rows) {
    std::vector<std::vector<float>> whole;
    std::vector<int64_t> first_row;
    int64_t cols = 0, stacked = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      whole.push_back(to_f32(source(names[i], shapes[i])));
      first_row.push_back(stacked);
      stacked += shapes[i][0];
      cols = static_cast<int64_t>(whole.back().size()) / shapes[i][0];
    }
    std::vector<float> out;
    out.reserve(rows.size() * static_cast<size_t>(cols));
    for (int64_t r : rows) {
      const size_t i = static_cast<size_t>(
          std::upper_bound(first_row.begin(), first_row.end(), r) - first_row.begin() - 1);
      const float* from = whole[i].data() + (r - first_row[i]) * cols;
      out.insert(out.end(), from, from + cols);
    }
    up.put_f32(dst, out.data(), out.size());
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
          kernels::expand_fp8_row_scales(scale.data(), shape.rows, shape.cols);
      dst.row_scale = weights.take<float>(rows.size());
      up.put_bytes(dst.row_scale, rows.data(), rows.size() * 4);
    }
    ++stats.fp8_linears;
  };

  embedding = weights.take<bf16>(size_t(vocab) * H);
  put(embedding, source(decoder.embed_tokens(), {vocab, H}));
  final_norm = weights.take<bf16>(H);
  put_norm(final_norm, decoder.final_norm(), H);
  if (cfg.tie_word_embeddings) {
    lm_head = embedding;
  } else {
    lm_head = weights.take<bf16>(size_t(vocab) * H);
    put(lm_head, source(decoder.lm_head(), {vocab, H}));
  }
  // One decoder layer (its caches' layers are the caller's to set).
  auto load_layer = [&](const LayerPlan& lp, const Plan& plan) {
    LayerWeights w;
    w.mixer = lp.mixer;
    w.input_norm = weights.take<bf16>(H);
    put_norm(w.input_norm, lp.input_norm(), H);
    w.post_norm = weights.take<bf16>(H);
    put_norm(w.post_norm, lp.post_attention_norm(), H);
    if (lp.mixer == MixerKind::kGatedDeltaNet) {
      const std::string la = lp.linear_attention();
      const InProjPlan ip = plan_in_proj(cfg, lp, ckpt, shard);
      std::vector<std::vector<int64_t>> shapes;
      for (int64_t rows : ip.tensor_rows) shapes.push_back({rows, H});
      w.in_proj = weights.take<bf16>(size_t(gdn_in_width) * H);
      put_rows(w.in_proj, ip.tensors, shapes, ip.rows);
      w.conv = weights.take<bf16>(size_t(gdn_conv_dim) * gdn_kernel);
      put_rows(w.conv, {linear_weight(la, "conv1d")},
               {{cfg.linear_conv_dim(), 1, cfg.linear_conv_kernel_dim}},
               linear_attention_channels(cfg, shard));
      const IndexRange heads{shard.v_head_begin, gdn_heads_v};
      const int64_t all_heads = cfg.linear_num_value_heads;
      w.a_log = weights.take<float>(gdn_heads_v);
      const std::vector<float> a_log = to_f32(source(block_tensor(la, "A_log"), {all_heads}, {}, heads));
      up.put_bytes(w.a_log, a_log.data(), a_log.size() * 4);
      w.dt_bias = weights.take<bf16>(gdn_heads_v);
      put(w.dt_bias, source(block_tensor(la, "dt_bias"), {all_heads}, {}, heads));
      w.gdn_norm = weights.take<bf16>(gdn_value_dim);
      put(w.gdn_norm, source(linear_weight(la, "norm"), {gdn_value_dim}));
      w.out_proj = weights.take<bf16>(size_t(H) * gdn_v_dim);
      put(w.out_proj, source(linear_weight(la, "out_proj"), {H, cfg.linear_value_dim()}, {},
                             {int64_t{shard.v_head_begin} * gdn_value_dim, gdn_v_dim}));
    } else if (lp.mixer == MixerKind::kGatedAttention) {
      RELAY_CHECK(!cfg.attention_bias, dir.string(), ": ", lp.prefix,
                  " is gated attention with attention_bias, which no released hybrid has");
      // q_proj's rows are per head [query | gate]: the queries join q|k|v, the gates their own
      // projection.
      w.qkv = weights.take<bf16>(qkv_dim * H);
      w.attn_gate = weights.take<bf16>(q_dim * H);
      for (int h = 0; h < q_heads; ++h) {
        const int64_t g = shard.q_head_begin + h;
        put(w.qkv + h * hd * H, source(attn(lp, "q_proj"), {2 * q_full, H}, {2 * g * hd, hd}));
        put(w.attn_gate + h * hd * H,
            source(attn(lp, "q_proj"), {2 * q_full, H}, {(2 * g + 1) * hd, hd}));
      }
      put(w.qkv + q_dim * H, source(attn(lp, "k_proj"), {kv_full, H}, kv_rows));
      put(w.qkv + (q_dim + kv_dim) * H, source(attn(lp, "v_proj"), {kv_full, H}, kv_rows));
      w.o = weights.take<bf16>(q_dim * H);
      put(w.o, source(attn(lp, "o_proj"), {H, q_full}, {}, q_rows));
    } else if (plan.qkv_fp8) {
      const int64_t k_row = quant::round_up_to_block(q_dim),
                    v_row = k_row + quant::round_up_to_block(kv_dim);
      upload_fp8(w.qkv8, plan.qkv, 1, [&](int64_t, uint8_t* q, float* s, ThreadPool* pool) {
        pack(source(attn(lp, "q_proj"), {q_full, H}, q_rows), plan.qkv, 0, q, s, pool);
        pack(source(attn(lp, "k_proj"), {kv_full, H}, kv_rows), plan.qkv, k_row, q, s, pool);
        pack(source(attn(lp, "v_proj"), {kv_full, H}, kv_rows), plan.qkv, v_row, q, s, pool);
      });
    } else {
      w.qkv = weights.take<bf16>(qkv_dim * H);
      put(w.qkv, source(attn(lp, "q_proj"), {q_full, H}, q_rows));
      put(w.qkv + q_dim * H, source(attn(lp, "k_proj"), {kv_full, H}, kv_rows));
      put(w.qkv + (q_dim + kv_dim) * H, source(attn(lp, "v_proj"), {kv_full, H}, kv_rows));
    }
    if (lp.mixer == MixerKind::kAttention) {
      // o_proj is row-parallel: this rank's q-head columns.
      if (plan.o_fp8) {
        upload_fp8(w.o8, plan.o, 1, [&](int64_t, uint8_t* q, float* s, ThreadPool* pool) {
          pack(source(attn(lp, "o_proj"), {H, q_full}, {}, q_rows), plan.o, 0, q, s, pool);
        });
      } else {
        w.o = weights.take<bf16>(q_dim * H);
        put(w.o, source(attn(lp, "o_proj"), {H, q_full}, {}, q_rows));
      }
    }
    if (lp.mixer != MixerKind::kGatedDeltaNet) {
      w.q_norm = weights.take<bf16>(head_dim);
      put_norm(w.q_norm, attn(lp, "q_norm"), head_dim);
      w.k_norm = weights.take<bf16>(head_dim);
      put_norm(w.k_norm, attn(lp, "k_norm"), head_dim);
    }
    if (cfg.attention_bias && lp.mixer == MixerKind::kAttention) {
      w.qkv_bias = weights.take<bf16>(qkv_dim);
      put(w.qkv_bias, source(linear_bias(lp.attention(), "q_proj"), {q_full}, {}, q_rows));
      put(w.qkv_bias + q_dim, source(linear_bias(lp.attention(), "k_proj"), {kv_full}, {}, kv_rows));
      put(w.qkv_bias + q_dim + kv_dim, source(linear_bias(lp.attention(), "v_proj"), {kv_full}, {}, kv_rows));
      // The o bias joins the all-reduced sum once, from TP rank 0.
      if (shard.tp_rank == 0) {
        w.o_bias = weights.take<bf16>(H);
        put(w.o_bias, source(linear_bias(lp.attention(), "o_proj"), {H}));
      }
    }
    w.moe = lp.ffn != FfnKind::kDenseMlp;
    const int64_t full_w = w.moe ? cfg.moe_intermediate_size : cfg.intermediate_size;
    const IndexRange cols = mlp_width(w.moe);
    const int64_t W = cols.count;
    const int64_t copies = w.moe ? local_experts : 1;
    w.width = static_cast<int>(W);
    w.act_width = w.width;
    const bool has_shared = lp.ffn == FfnKind::kMoeWithSharedExpert;
    w.shared_parts = plan.shared_parts;
    const bool fold = w.shared_parts > 0;
    const int64_t slots = copies + w.shared_parts;  // the routed experts, then the shared one's parts
    const std::string se = has_shared ? lp.shared_expert() : std::string();
    // The shared expert's tensors, folded as the experts' last slot.
    auto shared_src = [&](const char* name) {
      return std::string_view(name) == "down_proj" ? source(linear_weight(se, name), {H, shared_w})
                                                   : source(linear_weight(se, name), {shared_w, H});
    };
    if (w.moe) {
      w.router = weights.take<bf16>(size_t(experts + (fold ? 1 : 0)) * H);
      put(w.router, source(linear_weight(lp.mlp(), "gate"), {experts, H}));
    }
    // Expert e's (or the dense MLP's) gate, up and down parts of this rank's width.
    const bool fused_experts = fused(lp);
    auto gate_src = [&](int64_t e) {
      return fused_experts ? expert_source(lp, "gate_up_proj", e, 2 * full_w, H, cols)
                           : source(ffn(lp, e, "gate_proj"), {full_w, H}, cols);
    };
    auto up_src = [&](int64_t e) {
      return fused_experts ? expert_source(lp, "gate_up_proj", e, 2 * full_w, H,
                                           {full_w + cols.begin, W})
                           : source(ffn(lp, e, "up_proj"), {full_w, H}, cols);
    };
    auto down_src = [&](int64_t e) {
      return fused_experts ? expert_source(lp, "down_proj", e, H, full_w, {}, cols)
                           : source(ffn(lp, e, "down_proj"), {H, full_w}, {}, cols);
    };
    if (plan.mlp_fp8) {
      w.act_width = static_cast<int>(plan.down.cols);
      upload_fp8(w.gate_up8, plan.gate_up, slots,
                 [&](int64_t e, uint8_t* q, float* s, ThreadPool* pool) {
                   pack(e < copies ? gate_src(e) : shared_src("gate_proj"), plan.gate_up, 0, q,
                        s, pool);
                   pack(e < copies ? up_src(e) : shared_src("up_proj"), plan.gate_up,
                        w.act_width, q, s, pool);
                 });
      upload_fp8(w.down8, plan.down, slots,
                 [&](int64_t e, uint8_t* q, float* s, ThreadPool* pool) {
                   pack(e < copies ? down_src(e) : shared_src("down_proj"), plan.down, 0, q,
                        s, pool);
                 });
    } else {
      w.gate_up = weights.take<bf16>(size_t(slots) * 2 * W * H);
      w.down = weights.take<bf16>(size_t(slots) * H * W);
      for (int64_t e = 0; e < copies; ++e) {
        bf16* gu = w.gate_up + e * 2 * W * H;
        put(gu, gate_src(e));
        put(gu + W * H, up_src(e));
        put(w.down + e * H * W, down_src(e));
      }
    }
    if (has_shared) {
      // Whole on every rank (a TP rank too), added after the MoE's reduction or combine. Folded,
      // also the experts' last slot and the router's last row: bf16, the pointers view them; FP8
      // (packed above), a bf16 copy beside them for the steps that run it apart.
      w.shared_width = static_cast<int>(shared_w);
      const std::string logit = linear_weight(lp.mlp(), "shared_expert_gate");
      const bool view = fold && !plan.mlp_fp8;
      w.shared_gate_up = view ? w.gate_up + copies * 2 * W * H : weights.take<bf16>(size_t(2 * shared_w * H));
      put(w.shared_gate_up, source(linear_weight(se, "gate_proj"), {shared_w, H}));
      put(w.shared_gate_up + shared_w * H, source(linear_weight(se, "up_proj"), {shared_w, H}));
      w.shared_down = view ? w.down + copies * H * W : weights.take<bf16>(size_t(H * shared_w));
      put(w.shared_down, source(linear_weight(se, "down_proj"), {H, shared_w}));
      w.shared_gate = fold ? w.router + experts * H : weights.take<bf16>(H);
      put(w.shared_gate, source(logit, {1, H}));
    }
    max_ffn_width = std::max({max_ffn_width, w.act_width, w.shared_width});
    max_qkv_width = std::max<int64_t>(max_qkv_width, plan.qkv_fp8 ? plan.qkv.rows : qkv_dim);
    up.finish();  // the staging buffers no longer read this layer's slices
    slices.clear();
    views.clear();
    return w;
  };
  for (const LayerPlan& lp : decoder.layers) {
    LayerWeights w = load_layer(lp, plans[lp.index]);
    w.kv_layer = cfg.kv_cache_layer(lp.index);
    w.state_layer = cfg.recurrent_layer(lp.index);
    layers.push_back(w);
  }
  if (head_ckpt != nullptr) {
    // The head's fc [hidden, 2 hidden] as its two halves (embedding | hidden columns), its norms,
    // and its decoder layer, caching K/V in the KV pool's layer after the target's.
    from = head_ckpt;
    const MtpTensors names = mtp_tensors();
    mtp.fc_embed = weights.take<bf16>(size_t(H) * H);
    put(mtp.fc_embed, source(names.fc, {H, 2 * H}, {}, {0, H}));
    mtp.fc_hidden = weights.take<bf16>(size_t(H) * H);
    put(mtp.fc_hidden, source(names.fc, {H, 2 * H}, {}, {H, H}));
    mtp.norm_embed = weights.take<bf16>(H);
    put_norm(mtp.norm_embed, names.pre_fc_norm_embedding, H);
    mtp.norm_hidden = weights.take<bf16>(H);
    put_norm(mtp.norm_hidden, names.pre_fc_norm_hidden, H);
    mtp.norm = weights.take<bf16>(H);
    put_norm(mtp.norm, names.norm, H);
    mtp.layer = load_layer(mtp_layer, mtp_plan);
    mtp.layer.kv_layer = cfg.num_kv_cache_layers();
    mtp.present = true;
    from = &ckpt;
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

}  // namespace relay::cuda_engine

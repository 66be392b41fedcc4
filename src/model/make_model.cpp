// make_model: presets, the HF tensor list, and the streaming random-weight writer.
//
// Determinism: each tensor is cut into blocks of kRngBlockElems elements; block b of tensor `name`
// draws from its own splitmix64 stream seeded by (seed, hash(name), b). Threads split a chunk by
// whole blocks, so values never depend on the thread count, the chunk size or the sharding. Normal
// variates come from Marsaglia and Tsang's ziggurat (128 layers): one table compare and a multiply
// for ~99% of samples, an exact normal distribution overall, and ~5x faster than Box-Muller's
// log/sqrt/sin/cos — which matters when a benchmark checkpoint has tens of billions of weights.
#include "model/make_model.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <regex>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/hash.h"
#include "core/json.h"

namespace relay {
namespace {

using nlohmann::json;

constexpr int64_t kRngBlockElems = 4096;
constexpr float kInitStd = 0.02f;        // transformers' initializer_range for Qwen3
constexpr int32_t kBosToken = 151643;    // <|endoftext|>
constexpr int32_t kImEndToken = 151645;  // <|im_end|>
// Qwen3.5's vocabulary (248,320 rows) and its special tokens, as its releases' config.json and
// generation_config.json name them.
constexpr int64_t kQwen3_5VocabSize = 248320;
constexpr int32_t kQwen3_5EndOfTextToken = 248044;  // <|endoftext|>
constexpr int32_t kQwen3_5ImEndToken = 248046;      // <|im_end|>

// The fields every Qwen3 config.json carries, as transformers writes them (sorted on output).
json base_config() {
  return {
      {"attention_bias", false},          {"attention_dropout", 0.0},  {"bos_token_id", kBosToken},
      {"eos_token_id", kImEndToken},      {"hidden_act", "silu"},      {"initializer_range", 0.02},
      {"max_position_embeddings", 40960}, {"rms_norm_eps", 1e-6},      {"rope_scaling", nullptr},
      {"rope_theta", 1000000.0},          {"sliding_window", nullptr}, {"use_cache", true},
      {"use_sliding_window", false},      {"vocab_size", 151936}};
}

json moe_config(int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads,
                int64_t kv_heads, int64_t head_dim, int64_t experts, int64_t top_k,
                int64_t moe_width, bool tied) {
  json j = base_config();
  j.update({{"architectures", {"Qwen3MoeForCausalLM"}},
            {"model_type", "qwen3_moe"},
            {"hidden_size", hidden},
            {"intermediate_size", intermediate},
            {"num_hidden_layers", layers},
            {"max_window_layers", layers},
            {"num_attention_heads", heads},
            {"num_key_value_heads", kv_heads},
            {"head_dim", head_dim},
            {"num_experts", experts},
            {"num_experts_per_tok", top_k},
            {"moe_intermediate_size", moe_width},
            {"norm_topk_prob", true},
            {"decoder_sparse_step", 1},
            {"mlp_only_layers", json::array()},
            {"output_router_logits", false},
            {"router_aux_loss_coef", 0.001},
            {"tie_word_embeddings", tied}});
  return j;
}

json dense_config(int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, bool tied) {
  json j = base_config();
  j.update({{"architectures", {"Qwen3ForCausalLM"}},
            {"model_type", "qwen3"},
            {"hidden_size", hidden},
            {"intermediate_size", intermediate},
            {"num_hidden_layers", layers},
            {"max_window_layers", layers},
            {"num_attention_heads", heads},
            {"num_key_value_heads", kv_heads},
            {"head_dim", head_dim},
            {"tie_word_embeddings", tied}});
  return j;
}

// layer_types for `num_layers` layers: every `interval`-th layer full attention, the others linear
// attention (transformers' rule for an absent layer_types, which the Qwen3.5 releases spell out).
json hybrid_layer_types(int64_t num_layers, int64_t interval) {
  json types = json::array();
  for (int64_t l = 0; l < num_layers; ++l)
    types.push_back((l + 1) % interval == 0 ? "full_attention" : "linear_attention");
  return types;
}

// The sizes of a hybrid (Gated DeltaNet + gated attention) MoE model; every layer is MoE with a
// shared expert, interval 4 (3 linear-attention layers to 1 full-attention layer), head_dim 256
// unless a tiny preset says otherwise.
struct HybridShape {
  int64_t hidden, layers, heads, kv_heads, head_dim;
  int64_t linear_key_heads, linear_value_heads, linear_head_dim;
  int64_t experts, top_k, moe_width, shared_width;
  int64_t vocab;
};

// The fields both hybrids' releases spell the same way: the attention, Gated DeltaNet and MoE
// sizes, and what transformers writes for every config.
json hybrid_common_fields(const HybridShape& s) {
  return {{"attention_bias", false},
          {"attention_dropout", 0.0},
          {"full_attention_interval", 4},
          {"head_dim", s.head_dim},
          {"hidden_act", "silu"},
          {"hidden_size", s.hidden},
          {"initializer_range", 0.02},
          {"linear_conv_kernel_dim", 4},
          {"linear_key_head_dim", s.linear_head_dim},
          {"linear_num_key_heads", s.linear_key_heads},
          {"linear_num_value_heads", s.linear_value_heads},
          {"linear_value_head_dim", s.linear_head_dim},
          {"max_position_embeddings", 262144},
          {"moe_intermediate_size", s.moe_width},
          {"num_attention_heads", s.heads},
          {"num_experts", s.experts},
          {"num_experts_per_tok", s.top_k},
          {"num_hidden_layers", s.layers},
          {"num_key_value_heads", s.kv_heads},
          {"output_router_logits", false},
          {"rms_norm_eps", 1e-6},
          {"router_aux_loss_coef", 0.001},
          {"shared_expert_intermediate_size", s.shared_width},
          {"tie_word_embeddings", false},
          {"use_cache", true},
          {"vocab_size", s.vocab}};
}

// Qwen3_5MoeForConditionalGeneration's config.json as released: the language model's fields under
// text_config (transformers 5's spelling: rope_parameters with the interleaved MRoPE sections, the
// released-only keys attn_output_gate, mamba_ssm_dtype and the MTP layer count), the vision
// tower's under vision_config (Qwen3_5MoeVisionConfig's values, its output width the hidden size;
// Relay does not run it), and the vision token ids at the top level.
json qwen3_5_moe_config(const HybridShape& s) {
  json text = hybrid_common_fields(s);
  text.update({{"attn_output_gate", true},
               {"bos_token_id", nullptr},
               {"eos_token_id",
                s.vocab == kQwen3_5VocabSize ? kQwen3_5EndOfTextToken : kImEndToken},
               {"layer_types", hybrid_layer_types(s.layers, 4)},
               {"mamba_ssm_dtype", "float32"},
               {"model_type", "qwen3_5_moe_text"},
               {"mtp_num_hidden_layers", 1},
               {"mtp_use_dedicated_embeddings", false},
               {"rope_parameters",
                {{"mrope_interleaved", true},
                 {"mrope_section", {11, 11, 10}},
                 {"partial_rotary_factor", 0.25},
                 {"rope_theta", 10000000.0},
                 {"rope_type", "default"}}}});
  json vision = {{"deepstack_visual_indexes", json::array()},
                 {"depth", 27},
                 {"hidden_act", "gelu_pytorch_tanh"},
                 {"hidden_size", 1152},
                 {"in_channels", 3},
                 {"initializer_range", 0.02},
                 {"intermediate_size", 4304},
                 {"model_type", "qwen3_5_moe"},
                 {"num_heads", 16},
                 {"num_position_embeddings", 2304},
                 {"out_hidden_size", s.hidden},
                 {"patch_size", 16},
                 {"spatial_merge_size", 2},
                 {"temporal_patch_size", 2}};
  return {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
          {"model_type", "qwen3_5_moe"},
          {"text_config", std::move(text)},
          {"vision_config", std::move(vision)},
          {"image_token_id", 248056},
          {"video_token_id", 248057},
          {"vision_start_token_id", 248053},
          {"vision_end_token_id", 248054},
          {"tie_word_embeddings", false}};
}

// Qwen3NextForCausalLM's config.json as released (transformers 4.57's spelling: flat, top-level
// rope_theta and partial_rotary_factor, full_attention_interval and no layer_types, Qwen3-MoE's
// layer rule fields). The release ships an MTP layer but its config names no count, so none is
// written here (num_nextn_predict_layers would be vLLM's name for it).
json qwen3_next_config(const HybridShape& s, int64_t dense_width) {
  json j = base_config();
  j.erase("sliding_window");
  j.update(hybrid_common_fields(s));
  j.update({{"architectures", {"Qwen3NextForCausalLM"}},
            {"model_type", "qwen3_next"},
            {"decoder_sparse_step", 1},
            {"intermediate_size", dense_width},
            {"mlp_only_layers", json::array()},
            {"norm_topk_prob", true},
            {"partial_rotary_factor", 0.25},
            {"rope_theta", 10000000}});
  return j;
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}


void store(float v, DType dtype, uint8_t* out) {
  if (dtype == DType::BF16) {
    const uint16_t b = f32_to_bf16(v);
    std::memcpy(out, &b, 2);
  } else {
    std::memcpy(out, &v, 4);
  }
}

// The ziggurat's tables: layer i covers |x| below x_i; `accept[i]` is the 31-bit threshold under
// which a draw in layer i lands inside the next layer's rectangle and needs no density test.
struct Ziggurat {
  static constexpr int kLayers = 128;
  static constexpr double kTail = 3.442619855899;       // x of the base layer's edge
  static constexpr double kArea = 9.91256303526217e-3;  // area of every layer
  uint32_t accept[kLayers];
  double width[kLayers];    // x per unit of the 31-bit draw
  double density[kLayers];  // exp(-x_i^2 / 2)

  Ziggurat() {
    constexpr double kScale = 2147483648.0;  // 2^31
    double x = kTail, prev = kTail;
    const double base = kArea / std::exp(-0.5 * x * x);
    accept[0] = static_cast<uint32_t>(x / base * kScale);
    accept[1] = 0;
    width[0] = base / kScale;
    width[kLayers - 1] = x / kScale;
    density[0] = 1.0;
    density[kLayers - 1] = std::exp(-0.5 * x * x);
    for (int i = kLayers - 2; i >= 1; --i) {
      x = std::sqrt(-2.0 * std::log(kArea / x + std::exp(-0.5 * x * x)));
      accept[i + 1] = static_cast<uint32_t>(x / prev * kScale);
      prev = x;
      density[i] = std::exp(-0.5 * x * x);
      width[i] = x / kScale;
    }
  }
};

// One standard normal variate from the stream `state`.
double ziggurat_normal(const Ziggurat& z, uint64_t& state) {
  auto uniform = [&] {
    return (static_cast<double>(splitmix64(state) >> 11) + 0.5) * 0x1p-53;
  };  // (0, 1)
  for (;;) {
    const uint64_t bits = splitmix64(state);
    const int layer = static_cast<int>(bits & (Ziggurat::kLayers - 1));
    const bool negative = (bits >> 7) & 1;
    const uint32_t u = static_cast<uint32_t>(bits >> 33);  // 31 bits
    const double x = u * z.width[layer];
    if (u < z.accept[layer]) return negative ? -x : x;
    if (layer == 0) {  // the tail beyond kTail, by Marsaglia's exponential method
      double tx, ty;
      do {
        tx = -std::log(uniform()) / Ziggurat::kTail;
        ty = -std::log(uniform());
      } while (ty + ty < tx * tx);
      return negative ? -(Ziggurat::kTail + tx) : Ziggurat::kTail + tx;
    }
    // The wedge between the rectangles and the curve: accept with the density's odds.
    const double y = z.density[layer] + uniform() * (z.density[layer - 1] - z.density[layer]);
    if (y < std::exp(-0.5 * x * x)) return negative ? -x : x;
  }
}

// Writes elements [first, first + count) of tensor `name` (block-aligned `first`) into `out`.
void fill_normal(uint64_t seed, uint64_t name_hash, DType dtype, int64_t first, int64_t count,
                 uint8_t* out) {
  static const Ziggurat zig;
  const size_t esize = dtype_size(dtype);
  for (int64_t block_start = first; block_start < first + count; block_start += kRngBlockElems) {
    uint64_t state = seed ^ (name_hash * 0x9e3779b97f4a7c15ull);
    state = splitmix64(state) ^ static_cast<uint64_t>(block_start / kRngBlockElems);
    splitmix64(state);
    const int64_t end = std::min(block_start + kRngBlockElems, first + count);
    for (int64_t i = block_start; i < end; ++i) {
      store(kInitStd * static_cast<float>(ziggurat_normal(zig, state)), dtype,
            out + (i - first) * esize);
    }
  }
}

}  // namespace

void fill_random_tensor(const TensorSpec& spec, WeightInit init, uint64_t seed, int num_threads,
                        size_t byte_offset, std::span<uint8_t> out) {
  const size_t esize = dtype_size(spec.dtype);
  if (init != WeightInit::kNormal) {
    const size_t n = out.size() / esize;
    for (size_t i = 0; i < n; ++i)
      store(init == WeightInit::kOnes ? 1.0f : 0.0f, spec.dtype, out.data() + i * esize);
    return;
  }
  const int64_t first = static_cast<int64_t>(byte_offset / esize);
  const int64_t count = static_cast<int64_t>(out.size() / esize);
  const uint64_t name_hash = fnv1a(spec.name);
  const int64_t num_blocks = (count + kRngBlockElems - 1) / kRngBlockElems;
  const int64_t workers = std::min<int64_t>(num_threads, num_blocks);
  if (workers <= 1) {
    fill_normal(seed, name_hash, spec.dtype, first, count, out.data());
    return;
  }
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < workers; ++w) {
    const int64_t b0 = num_blocks * w / workers, b1 = num_blocks * (w + 1) / workers;
    const int64_t begin = b0 * kRngBlockElems, end = std::min(b1 * kRngBlockElems, count);
    threads.emplace_back([=, &spec] {
      fill_normal(seed, name_hash, spec.dtype, first + begin, end - begin,
                  out.data() + begin * esize);
    });
  }
  for (std::thread& t : threads) t.join();
}

namespace {

void write_json(const std::filesystem::path& path, const json& j) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << j.dump(2) << "\n";
  if (!out) fail(str(path.string(), ": write failed"));
}

std::string gigabytes(uint64_t bytes) {
  return str(std::fixed, std::setprecision(2), bytes / 1e9, " GB");
}

}  // namespace

std::vector<std::string> model_preset_names() {
  return {"tiny-dense",         "tiny-moe",          "tiny-qwen3.5-moe",  "tiny-qwen3-next",
          "30b-a3b",            "235b-a22b",         "qwen3.5-35b-a3b",   "qwen3.5-122b-a10b",
          "qwen3.5-397b-a17b",  "qwen3-next-80b-a3b"};
}

json model_preset_config(const std::string& preset) {
  if (preset == "tiny-dense") return dense_config(64, 128, 2, 4, 2, 16, /*tied=*/true);
  if (preset == "tiny-moe") return moe_config(64, 128, 2, 4, 2, 16, 8, 2, 32, /*tied=*/false);
  // The hybrids' tiny presets: the released layouts (and, for Qwen3.5, an MTP layer) at test
  // sizes, with the embedded tokenizer's vocabulary so that every sampled id decodes.
  if (preset == "tiny-qwen3.5-moe")
    return qwen3_5_moe_config({64, 4, 4, 2, 32, 2, 4, 16, 8, 2, 32, 32, 151936});
  if (preset == "tiny-qwen3-next")
    return qwen3_next_config({64, 4, 4, 2, 32, 2, 4, 16, 8, 2, 32, 32, 151936}, 128);
  if (preset == "30b-a3b")
    return moe_config(2048, 6144, 48, 32, 4, 128, 128, 8, 768, /*tied=*/false);
  if (preset == "235b-a22b")
    return moe_config(4096, 12288, 94, 64, 4, 128, 128, 8, 1536, /*tied=*/false);
  // The released hybrids (shared/guide/hybrid-and-mtp.md 1.3). Qwen3.5-35B-A3B: transformers'
  // Qwen3_5MoeTextConfig defaults, documented as that checkpoint (configuration_qwen3_5_moe.py
  // @008e5743), which transcriptions of its config.json repeat. 122B-A10B and 397B-A17B:
  // transcriptions of their config.json in public loaders and tests (hidden 3072 / 4096, 48 / 60
  // layers, 32 query heads, 64 linear value heads, 256 experts top-8 / 512 experts top-10, expert
  // and shared-expert widths 1024), agreeing with the guide's table. Qwen3-Next-80B-A3B:
  // transformers' Qwen3NextConfig defaults (configuration_qwen3_next.py @008e5743) and a
  // transcription of the Instruct release's config.json (dense intermediate_size 5120, unused:
  // every layer is MoE; Qwen3's vocabulary).
  constexpr int64_t kVocab = kQwen3_5VocabSize;
  //                          hidden lay heads kv  hd  lk  lv  ldim  E  top moe  shared vocab
  if (preset == "qwen3.5-35b-a3b")
    return qwen3_5_moe_config({2048, 40, 16, 2, 256, 16, 32, 128, 256, 8, 512, 512, kVocab});
  if (preset == "qwen3.5-122b-a10b")
    return qwen3_5_moe_config({3072, 48, 32, 2, 256, 16, 64, 128, 256, 8, 1024, 1024, kVocab});
  if (preset == "qwen3.5-397b-a17b")
    return qwen3_5_moe_config({4096, 60, 32, 2, 256, 16, 64, 128, 512, 10, 1024, 1024, kVocab});
  if (preset == "qwen3-next-80b-a3b")
    return qwen3_next_config({2048, 48, 16, 2, 256, 16, 32, 128, 512, 10, 512, 512, 151936}, 5120);
  std::string names;
  for (const std::string& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
  fail(str("unknown model preset '", preset, "' (presets: ", names, ")"));
}

json preset_config_with_layers(const std::string& preset, int64_t num_layers,
                               const std::string& config_patch) {
  json config = model_preset_config(preset);
  if (!config_patch.empty()) {
    const json patch = parse_json(config_patch, "make-model: the config patch");
    RELAY_CHECK(patch.is_object(), "make-model: the config patch is not a JSON object: ",
                config_patch);
    config.merge_patch(patch);
  }
  if (num_layers == 0) return config;
  RELAY_CHECK(num_layers > 0, "make-model: layer count must be positive, got ", num_layers);
  // A vision-language release keeps the language model's fields under text_config.
  json& text = config.contains("text_config") ? config["text_config"] : config;
  text["num_hidden_layers"] = num_layers;
  if (text.contains("max_window_layers")) text["max_window_layers"] = num_layers;
  if (text.contains("full_attention_interval")) {
    // The hybrids repeat (interval - 1) linear-attention layers and one full-attention layer; a
    // shorter model keeps that pattern whole, so its layer mix (and its speed per layer) is the
    // release's.
    const json& interval_json = text["full_attention_interval"];
    RELAY_CHECK(interval_json.is_number_integer() && interval_json.get<int64_t>() > 0,
                "make-model: preset ", preset, ": full_attention_interval must be a positive "
                "integer, got ", interval_json.dump());
    const int64_t interval = interval_json.get<int64_t>();
    RELAY_CHECK(num_layers % interval == 0, "make-model: --layers ", num_layers, ": ", preset,
                " repeats ", interval - 1, " linear-attention layers and 1 full-attention layer "
                "(full_attention_interval ", interval, "); give a multiple of ", interval);
    if (text.contains("layer_types"))
      text["layer_types"] = hybrid_layer_types(num_layers, interval);
  }
  return config;
}

WeightInit weight_init_for(const ModelConfig& c, const std::string& name) {
  // The hybrids' decoder norms scale by (1 + w) and transformers initialises their w to 0; the
  // Gated DeltaNet output norm (linear_attn.norm) scales by w, initialised to 1.
  // An RMSNorm's weight: input_layernorm, q_norm, norm, the MTP head's pre_fc_norm_hidden, ...
  const size_t module_end = name.ends_with(".weight") ? name.size() - 7 : 0;
  const size_t module_begin = name.rfind('.', module_end - 1) + 1;
  if (module_end > 0 && name.substr(module_begin, module_end - module_begin).find("norm") !=
                            std::string::npos) {
    return c.zero_centered_norms && !name.ends_with("linear_attn.norm.weight") ? WeightInit::kZeros
                                                                                : WeightInit::kOnes;
  }
  if (name.ends_with(".bias")) return WeightInit::kZeros;
  return WeightInit::kNormal;
}

std::vector<TensorSpec> checkpoint_tensor_specs(const ModelConfig& c, DType dtype,
                                                ExpertStorage experts) {
  std::vector<TensorSpec> specs;
  auto add = [&](std::string name, std::vector<int64_t> shape, DType stored) {
    specs.push_back({std::move(name), stored, std::move(shape)});
  };
  const bool qwen3_5_release = c.architecture == "Qwen3_5MoeForConditionalGeneration" ||
                               c.architecture == "Qwen3_5ForConditionalGeneration";
  // NOTE: the bf16 releases keep A_log in F32 (Qwen3-Next and Qwen3.5) and the gated norm's weight
  // too (Qwen3.5); text-only exports store everything in the checkpoint's dtype.
  const bool next = c.architecture == "Qwen3NextForCausalLM";
  const DType a_log_dtype = dtype == DType::BF16 && (next || qwen3_5_release) ? DType::F32 : dtype;
  const DType gated_norm_dtype = dtype == DType::BF16 && qwen3_5_release ? DType::F32 : dtype;
  // The bf16 Qwen3.5-MoE releases store each decoder layer's experts fused in two 3-D tensors and
  // the MTP layer's per expert; Qwen3-MoE, Qwen3-Next and text-only exports store them per expert.
  const bool fused_experts = experts == ExpertStorage::kAsReleased && qwen3_5_release;
  const int64_t h = c.hidden_size, hd = c.head_dim, q = c.num_attention_heads * hd,
                kv = c.num_key_value_heads * hd;

  auto add_attention = [&](const std::string& p) {
    // Gated attention's q_proj holds [query | gate] per head.
    add(p + "self_attn.q_proj.weight", {c.attn_output_gate ? 2 * q : q, h}, dtype);
    add(p + "self_attn.k_proj.weight", {kv, h}, dtype);
    add(p + "self_attn.v_proj.weight", {kv, h}, dtype);
    add(p + "self_attn.o_proj.weight", {h, q}, dtype);
    if (c.attention_bias) {
      add(p + "self_attn.q_proj.bias", {q}, dtype);
      add(p + "self_attn.k_proj.bias", {kv}, dtype);
      add(p + "self_attn.v_proj.bias", {kv}, dtype);
      add(p + "self_attn.o_proj.bias", {h}, dtype);
    }
    add(p + "self_attn.q_norm.weight", {hd}, dtype);
    add(p + "self_attn.k_norm.weight", {hd}, dtype);
  };
  auto add_linear_attention = [&](const std::string& p) {
    const std::string la = p + "linear_attn.";
    const int64_t v_heads = c.linear_num_value_heads;
    if (next) {  // fused, interleaved per key head (model/qwen3_next.cpp)
      add(la + "in_proj_qkvz.weight", {c.linear_conv_dim() + c.linear_value_dim(), h}, dtype);
      add(la + "in_proj_ba.weight", {2 * v_heads, h}, dtype);
    } else {
      add(la + "in_proj_qkv.weight", {c.linear_conv_dim(), h}, dtype);
      add(la + "in_proj_z.weight", {c.linear_value_dim(), h}, dtype);
      add(la + "in_proj_b.weight", {v_heads, h}, dtype);
      add(la + "in_proj_a.weight", {v_heads, h}, dtype);
    }
    add(la + "conv1d.weight", {c.linear_conv_dim(), 1, c.linear_conv_kernel_dim}, dtype);
    add(la + "dt_bias", {v_heads}, dtype);
    add(la + "A_log", {v_heads}, a_log_dtype);
    add(la + "norm.weight", {c.linear_value_head_dim}, gated_norm_dtype);
    add(la + "out_proj.weight", {h, c.linear_value_dim()}, dtype);
  };
  auto add_mlp = [&](const std::string& p, int64_t layer, bool fused) {
    if (!c.layer_is_moe(layer)) {
      add(p + "mlp.gate_proj.weight", {c.intermediate_size, h}, dtype);
      add(p + "mlp.up_proj.weight", {c.intermediate_size, h}, dtype);
      add(p + "mlp.down_proj.weight", {h, c.intermediate_size}, dtype);
      return;
    }
    const int64_t w = c.moe_intermediate_size;
    add(p + "mlp.gate.weight", {c.num_experts, h}, dtype);
    if (fused) {  // gate rows first in gate_up_proj, as transformers fuses them
      add(p + "mlp.experts.gate_up_proj", {c.num_experts, 2 * w, h}, dtype);
      add(p + "mlp.experts.down_proj", {c.num_experts, h, w}, dtype);
    } else {
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string ep = str(p, "mlp.experts.", e, ".");
        add(ep + "gate_proj.weight", {w, h}, dtype);
        add(ep + "up_proj.weight", {w, h}, dtype);
        add(ep + "down_proj.weight", {h, w}, dtype);
      }
    }
    if (c.shared_expert_intermediate_size > 0) {
      const int64_t sw = c.shared_expert_intermediate_size;
      add(p + "mlp.shared_expert.gate_proj.weight", {sw, h}, dtype);
      add(p + "mlp.shared_expert.up_proj.weight", {sw, h}, dtype);
      add(p + "mlp.shared_expert.down_proj.weight", {h, sw}, dtype);
      add(p + "mlp.shared_expert_gate.weight", {1, h}, dtype);
    }
  };

  // A vision-language release keeps its language model under model.language_model.; its vision
  // tower (model.visual.*) is not written: Relay runs text only and its loader skips it.
  const std::string prefix = qwen3_5_release ? "model.language_model." : "model.";
  add(prefix + "embed_tokens.weight", {c.vocab_size, h}, dtype);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = str(prefix, "layers.", l, ".");
    add(p + "input_layernorm.weight", {h}, dtype);
    if (c.layer_is_linear_attention(l)) {
      add_linear_attention(p);
    } else {
      add_attention(p);
    }
    add(p + "post_attention_layernorm.weight", {h}, dtype);
    add_mlp(p, l, fused_experts);
  }
  add(prefix + "norm.weight", {h}, dtype);
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h}, dtype);
  // The MTP head (model/mtp.h), at the top level: fc over cat([embedding, hidden]), its two input
  // norms, full-attention decoder layers of the target's kind, and its final norm.
  if (c.mtp_num_hidden_layers > 0) {
    add("mtp.fc.weight", {h, 2 * h}, dtype);
    add("mtp.pre_fc_norm_embedding.weight", {h}, dtype);
    add("mtp.pre_fc_norm_hidden.weight", {h}, dtype);
    for (int64_t l = 0; l < c.mtp_num_hidden_layers; ++l) {
      const std::string p = str("mtp.layers.", l, ".");
      add(p + "input_layernorm.weight", {h}, dtype);
      add_attention(p);
      add(p + "post_attention_layernorm.weight", {h}, dtype);
      add_mlp(p, l, /*fused=*/false);
    }
    add("mtp.norm.weight", {h}, dtype);
  }
  return specs;
}

MakeModelResult make_model(const MakeModelOptions& o) {
  namespace fs = std::filesystem;
  const auto start = std::chrono::steady_clock::now();
  auto log = [&](const std::string& line) {
    if (o.log) o.log(line);
  };
  RELAY_CHECK(o.dtype == DType::BF16 || o.dtype == DType::F32,
              "make-model: dtype must be bf16 or f32, got ", dtype_name(o.dtype));
  RELAY_CHECK(o.shard_size_mb > 0, "make-model: shard size must be positive, got ", o.shard_size_mb,
              " MB");
  RELAY_CHECK(!o.out_dir.empty(), "make-model: no output directory");

  json config = preset_config_with_layers(o.preset, o.num_layers, o.config_patch);
  const char* dtype_text = o.dtype == DType::BF16 ? "bfloat16" : "float32";
  if (config.contains("text_config")) {  // transformers 5's spelling, in both objects
    config["dtype"] = dtype_text;
    config["text_config"]["dtype"] = dtype_text;
  } else {
    config["torch_dtype"] = dtype_text;
  }
  const ModelConfig c = ModelConfig::from_json(
      config, str("preset ", o.preset, o.config_patch.empty() ? "" : " with the config patch"));

  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    RELAY_CHECK(fs::exists(o.tokenizer_dir / f), "make-model: ", (o.tokenizer_dir / f).string(),
                " not found (the tokenizer is copied from there)");
  }
  fs::create_directories(o.out_dir);
  // Earlier outputs of this command (shards of another size, a leftover index) would otherwise mix
  // with the new checkpoint; nothing else in the directory is touched.
  const std::regex ours(
      R"(model(-\d{5}-of-\d{5})?\.safetensors(\.tmp)?|model\.safetensors\.index\.json)");
  for (const fs::directory_entry& e : fs::directory_iterator(o.out_dir)) {
    if (e.is_regular_file() && std::regex_match(e.path().filename().string(), ours))
      fs::remove(e.path());
  }
  write_json(o.out_dir / "config.json", config);
  // The releases stop on <|im_end|> and <|endoftext|>, in the vocabulary the preset has.
  const bool qwen3_5_vocab = c.vocab_size == kQwen3_5VocabSize;
  const int32_t end_of_text = qwen3_5_vocab ? kQwen3_5EndOfTextToken : kBosToken;
  write_json(o.out_dir / "generation_config.json",
             {{"bos_token_id", end_of_text},
              {"eos_token_id", {qwen3_5_vocab ? kQwen3_5ImEndToken : kImEndToken, end_of_text}},
              {"do_sample", false}});
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    fs::copy_file(o.tokenizer_dir / f, o.out_dir / f, fs::copy_options::overwrite_existing);
  }
  MakeModelResult r;
  if (o.config_only) {
    log(str("make-model: ", o.preset, " with ", c.num_hidden_layers, " layers, config and "
            "tokenizer only -> ", o.out_dir.string(), " (load it with --load-format dummy)"));
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return r;
  }

  // Shards are filled greedily in state_dict order, as save_pretrained does; a tensor larger than
  // the limit gets a shard of its own.
  const std::vector<TensorSpec> specs =
      checkpoint_tensor_specs(c, o.dtype, ExpertStorage::kAsReleased);
  const uint64_t max_shard_bytes = static_cast<uint64_t>(o.shard_size_mb) * 1000000ull;
  std::vector<std::vector<size_t>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const uint64_t n = tensor_bytes(specs[i]);
    if (!shards.back().empty() && shard_bytes + n > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += n;
    total_bytes += n;
  }
  const int num_threads = o.num_threads > 0
                              ? o.num_threads
                              : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  log(str("make-model: ", o.preset, " with ", c.num_hidden_layers, " layers, ", specs.size(),
          " tensors, ", gigabytes(total_bytes), " in ", shards.size(), " file(s), ", num_threads,
          " threads -> ", o.out_dir.string()));

  json weight_map = json::object();
  uint64_t written = 0, next_report = 1000000000ull;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file =
        shards.size() == 1 ? std::string("model.safetensors")
                           : str("model-", std::setw(5), std::setfill('0'), s + 1, "-of-",
                                 std::setw(5), std::setfill('0'), shards.size(), ".safetensors");
    std::vector<TensorSpec> shard_specs;
    for (size_t i : shards[s]) {
      shard_specs.push_back(specs[i]);
      weight_map[specs[i].name] = file;
    }
    write_safetensors_streamed(
        o.out_dir / file, shard_specs, [&](size_t i, size_t offset, std::span<uint8_t> out) {
          fill_random_tensor(shard_specs[i], weight_init_for(c, shard_specs[i].name), o.seed,
                             num_threads, offset, out);
          written += out.size();
          if (written >= next_report) {
            const double secs =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            log(str("make-model: ", gigabytes(written), " / ", gigabytes(total_bytes), " (",
                    std::fixed, std::setprecision(2), written / 1e9 / secs, " GB/s)"));
            next_report += 1000000000ull;
          }
        });
  }
  if (shards.size() > 1) {
    write_json(o.out_dir / "model.safetensors.index.json",
               {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}});
  }

  r.num_tensors = static_cast<int64_t>(specs.size());
  r.num_shards = static_cast<int64_t>(shards.size());
  r.total_bytes = total_bytes;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log(str("make-model: wrote ", gigabytes(total_bytes), " in ", std::fixed, std::setprecision(1),
          r.seconds, " s"));
  return r;
}

}  // namespace relay

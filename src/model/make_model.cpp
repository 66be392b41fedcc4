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

WeightInit weight_init_for(const std::string& name) {
  if (name.ends_with("norm.weight")) return WeightInit::kOnes;
  if (name.ends_with(".bias")) return WeightInit::kZeros;
  return WeightInit::kNormal;
}

void fill_random_tensor(const TensorSpec& spec, uint64_t seed, int num_threads,
                        size_t byte_offset, std::span<uint8_t> out) {
  const size_t esize = dtype_size(spec.dtype);
  const WeightInit init = weight_init_for(spec.name);
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
  return {"tiny-dense", "tiny-moe", "30b-a3b", "235b-a22b"};
}

json model_preset_config(const std::string& preset) {
  if (preset == "tiny-dense") return dense_config(64, 128, 2, 4, 2, 16, /*tied=*/true);
  if (preset == "tiny-moe") return moe_config(64, 128, 2, 4, 2, 16, 8, 2, 32, /*tied=*/false);
  if (preset == "30b-a3b")
    return moe_config(2048, 6144, 48, 32, 4, 128, 128, 8, 768, /*tied=*/false);
  if (preset == "235b-a22b")
    return moe_config(4096, 12288, 94, 64, 4, 128, 128, 8, 1536, /*tied=*/false);
  std::string names;
  for (const std::string& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
  fail(str("unknown model preset '", preset, "' (presets: ", names, ")"));
}

std::vector<TensorSpec> checkpoint_tensor_specs(const ModelConfig& c, DType dtype) {
  RELAY_CHECK(!c.has_linear_attention() && c.shared_expert_intermediate_size == 0,
              "make-model and --load-format dummy know the Qwen3 / Qwen3-MoE tensors only, not ",
              c.architecture, "'s");
  std::vector<TensorSpec> specs;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    specs.push_back({std::move(name), dtype, std::move(shape)});
  };
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim;
  add("model.embed_tokens.weight", {c.vocab_size, h});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = str("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {h});
    add(p + "self_attn.q_proj.weight", {q, h});
    add(p + "self_attn.k_proj.weight", {kv, h});
    add(p + "self_attn.v_proj.weight", {kv, h});
    add(p + "self_attn.o_proj.weight", {h, q});
    if (c.attention_bias) {
      add(p + "self_attn.q_proj.bias", {q});
      add(p + "self_attn.k_proj.bias", {kv});
      add(p + "self_attn.v_proj.bias", {kv});
      add(p + "self_attn.o_proj.bias", {h});
    }
    add(p + "self_attn.q_norm.weight", {c.head_dim});
    add(p + "self_attn.k_norm.weight", {c.head_dim});
    add(p + "post_attention_layernorm.weight", {h});
    if (c.layer_is_moe(l)) {
      add(p + "mlp.gate.weight", {c.num_experts, h});
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string ep = str(p, "mlp.experts.", e, ".");
        add(ep + "gate_proj.weight", {c.moe_intermediate_size, h});
        add(ep + "up_proj.weight", {c.moe_intermediate_size, h});
        add(ep + "down_proj.weight", {h, c.moe_intermediate_size});
      }
    } else {
      add(p + "mlp.gate_proj.weight", {c.intermediate_size, h});
      add(p + "mlp.up_proj.weight", {c.intermediate_size, h});
      add(p + "mlp.down_proj.weight", {h, c.intermediate_size});
    }
  }
  add("model.norm.weight", {h});
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h});
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
  RELAY_CHECK(o.num_layers >= 0, "make-model: layer count must be positive, got ", o.num_layers);
  RELAY_CHECK(!o.out_dir.empty(), "make-model: no output directory");

  json config = model_preset_config(o.preset);
  if (!o.config_patch.empty()) {
    const json patch = parse_json(o.config_patch, "make-model: the config patch");
    RELAY_CHECK(patch.is_object(),
                "make-model: the config patch is not a JSON object: ", o.config_patch);
    config.merge_patch(patch);
  }
  if (o.num_layers > 0) {
    config["num_hidden_layers"] = o.num_layers;
    config["max_window_layers"] = o.num_layers;
  }
  config["torch_dtype"] = o.dtype == DType::BF16 ? "bfloat16" : "float32";
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
  write_json(o.out_dir / "generation_config.json", {{"bos_token_id", kBosToken},
                                                    {"eos_token_id", {kImEndToken, kBosToken}},
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
  const std::vector<TensorSpec> specs = checkpoint_tensor_specs(c, o.dtype);
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
          fill_random_tensor(shard_specs[i], o.seed, num_threads, offset, out);
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

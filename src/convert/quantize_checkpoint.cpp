// See quantize_checkpoint.h. Each output shard is described up front (names, dtypes, shapes: the
// safetensors header comes first), then filled chunk by chunk; a quantised weight is computed on
// its first chunk and its codes and scales are served from that one cached result.
#include "convert/quantize_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "model/safetensors.h"
#include "quant/weight_quant.h"

namespace relay::quant {

namespace fs = std::filesystem;

namespace {

// Files besides the weights that a Hugging Face checkpoint directory carries and a converted one
// needs unchanged.
constexpr const char* kCopiedFiles[] = {
    "generation_config.json",  "tokenizer.json",      "tokenizer_config.json",
    "special_tokens_map.json", "vocab.json",          "merges.txt",
    "added_tokens.json",       "chat_template.jinja", "chat_template.json",
};

constexpr const char* kIndexName = "model.safetensors.index.json";

// Modules never quantised: embeddings, the LM head, and routers (tiny, and their logits decide
// which experts run, so their precision matters more than their size).
const QuantConfig& kept_modules() {
  static const QuantConfig c = [] {
    QuantConfig k;
    k.modules_to_not_convert = {"lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate"};
    return k;
  }();
  return c;
}

std::string module_of(const std::string& tensor_name) {
  const size_t dot = tensor_name.rfind('.');
  return dot == std::string::npos ? tensor_name : tensor_name.substr(0, dot);
}

nlohmann::ordered_json read_json(const fs::path& path) {
  return parse_json_file<nlohmann::ordered_json>(path);
}

void write_json(const fs::path& path, const nlohmann::ordered_json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  RELAY_CHECK(out.good(), "cannot write ", path.string());
}

// Widens elements [begin, begin + count) of an F32/BF16/F16 tensor to fp32.
void widen_range(const TensorView& t, int64_t begin, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* p = t.data + (begin + i) * dtype_size(t.dtype);
    if (t.dtype == DType::F32) {
      std::memcpy(out + i, p, 4);
    } else {
      uint16_t v;
      std::memcpy(&v, p, 2);
      out[i] = t.dtype == DType::BF16 ? bf16_to_f32(v) : f16_to_f32(v);
    }
  }
}

// What output tensor i of a shard is made from.
struct OutputItem {
  enum class Role { Kept, Codes, Scales };
  Role role;
  const TensorView* source;
};

// The quantised form of one weight, computed once and read by its two output tensors.
struct QuantizedWeight {
  const TensorView* source = nullptr;
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scale_bytes;
};

void quantize_weight(const QuantConfig& config, const TensorView& t, QuantizedWeight& out) {
  const int64_t rows = t.shape[0], cols = t.shape[1];
  out.source = &t;
  out.codes.resize(rows * cols);
  // Stripes of whole scale blocks bound the fp32 working set.
  const int64_t stripe_rows =
      config.method == QuantMethod::Fp8Block ? config.block_out : kernels::kFp8BlockSize;
  std::vector<float> stripe(stripe_rows * cols);
  if (config.method == QuantMethod::Fp8Block) {
    const int64_t scale_cols = kernels::ceil_div(cols, config.block_in);
    std::vector<float> scales(kernels::ceil_div(rows, config.block_out) * scale_cols);
    for (int64_t r0 = 0; r0 < rows; r0 += stripe_rows) {
      const int64_t n = std::min(stripe_rows, rows - r0);
      widen_range(t, r0 * cols, n * cols, stripe.data());
      kernels::quantize_weight_fp8_block(stripe.data(), n, cols, config.block_out, config.block_in,
                                out.codes.data() + r0 * cols,
                                scales.data() + (r0 / config.block_out) * scale_cols);
    }
    out.scale_bytes.resize(scales.size() * sizeof(float));
    std::memcpy(out.scale_bytes.data(), scales.data(), out.scale_bytes.size());
  } else {
    const int64_t groups = kernels::ceil_div(cols, config.group_size);
    out.scale_bytes.resize(rows * groups);
    for (int64_t r0 = 0; r0 < rows; r0 += stripe_rows) {
      const int64_t n = std::min(stripe_rows, rows - r0);
      widen_range(t, r0 * cols, n * cols, stripe.data());
      kernels::quantize_weight_mxfp8(stripe.data(), n, cols, out.codes.data() + r0 * cols,
                            out.scale_bytes.data() + r0 * groups);
    }
  }
}

// Writes bytes [offset, offset + out.size()) of a kept tensor, converted to bf16.
void fill_kept(const TensorView& t, size_t offset, std::span<uint8_t> out) {
  if (t.dtype == DType::BF16) {
    std::memcpy(out.data(), t.data + offset, out.size());
    return;
  }
  const int64_t first = static_cast<int64_t>(offset / 2),
                count = static_cast<int64_t>(out.size() / 2);
  std::vector<float> values(count);
  widen_range(t, first, count, values.data());
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t v = f32_to_bf16(values[i]);
    std::memcpy(out.data() + 2 * i, &v, 2);
  }
}

// The shard files of a checkpoint directory, in index order (or the single model.safetensors).
std::vector<std::string> shard_names(const fs::path& dir) {
  if (!fs::exists(dir / kIndexName)) {
    RELAY_CHECK(fs::exists(dir / "model.safetensors"), dir.string(),
                " has neither model.safetensors nor ", kIndexName);
    return {"model.safetensors"};
  }
  const nlohmann::ordered_json index = read_json(dir / kIndexName);
  RELAY_CHECK(index.contains("weight_map") && index["weight_map"].is_object(),
              (dir / kIndexName).string(), ": no weight_map object");
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    RELAY_CHECK(file.is_string(), (dir / kIndexName).string(), ": weight_map[", tensor,
                "] is not a file name");
    if (seen.insert(file.get<std::string>()).second) names.push_back(file.get<std::string>());
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

QuantMethod parse_quant_format(const std::string& name) {
  if (name == "fp8-block128") return QuantMethod::Fp8Block;
  if (name == "mxfp8") return QuantMethod::Mxfp8;
  fail(str("unknown quantisation format '", name, "' (expected fp8-block128 or mxfp8)"));
}

bool is_quantizable_weight(const std::string& name, size_t rank) {
  return rank == 2 && name.ends_with(".weight") &&
         !kept_modules().keeps_unquantized(module_of(name));
}

QuantizeResult quantize_checkpoint(const QuantizeOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  RELAY_CHECK(options.method != QuantMethod::None, "quantize: no format given");
  RELAY_CHECK(fs::is_directory(options.in_dir), "quantize: input ", options.in_dir.string(),
              " is not a directory");
  fs::create_directories(options.out_dir);
  RELAY_CHECK(!fs::equivalent(options.in_dir, options.out_dir),
              "quantize: --out must differ from --in (", options.in_dir.string(), ")");

  nlohmann::ordered_json config_json = read_json(options.in_dir / "config.json");
  RELAY_CHECK(
      !config_json.contains("quantization_config") || config_json["quantization_config"].is_null(),
      (options.in_dir / "config.json").string(), " already has a quantization_config");

  QuantConfig config;
  config.method = options.method;
  QuantizeResult result;
  const std::vector<std::string> shards = shard_names(options.in_dir);
  // Earlier outputs are removed so a different sharding never leaves stale files behind.
  for (const fs::directory_entry& e : fs::directory_iterator(options.out_dir)) {
    const std::string f = e.path().filename().string();
    if (f.ends_with(".safetensors") || f == kIndexName) fs::remove(e.path());
  }

  std::map<std::string, std::string> weight_map;  // sorted, as transformers writes the index
  std::set<std::string> kept_module_set;
  std::vector<std::string> kept_module_list;
  for (const std::string& shard : shards) {
    const SafetensorsFile in(options.in_dir / shard);
    std::vector<TensorSpec> specs;
    std::vector<OutputItem> items;
    for (const auto& [name, t] : in.tensors()) {
      result.bytes_in += t.nbytes;
      RELAY_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16,
                  "quantize: tensor ", name, " in ", t.file, " has dtype ", dtype_name(t.dtype),
                  "; the input must be F32, BF16 or F16");
      if (is_quantizable_weight(name, t.shape.size())) {
        ++result.num_quantized;
        specs.push_back({name, DType::F8_E4M3, t.shape});
        items.push_back({OutputItem::Role::Codes, &t});
        if (config.method == QuantMethod::Fp8Block) {
          specs.push_back(
              {name + "_scale_inv",
               DType::F32,
               {kernels::ceil_div(t.shape[0], config.block_out), kernels::ceil_div(t.shape[1], config.block_in)}});
        } else {
          specs.push_back({name + "_scale",
                           DType::F8_E8M0,
                           {t.shape[0], kernels::ceil_div(t.shape[1], config.group_size)}});
        }
        items.push_back({OutputItem::Role::Scales, &t});
      } else {
        ++result.num_kept;
        specs.push_back({name, DType::BF16, t.shape});
        items.push_back({OutputItem::Role::Kept, &t});
        const std::string module = module_of(name);
        if (kept_module_set.insert(module).second) kept_module_list.push_back(module);
      }
    }
    for (const TensorSpec& s : specs) {
      weight_map[s.name] = shard;
      result.bytes_out += tensor_bytes(s);
    }

    QuantizedWeight current;
    write_safetensors_streamed(
        options.out_dir / shard, specs, [&](size_t i, size_t offset, std::span<uint8_t> out) {
          const OutputItem& item = items[i];
          if (item.role == OutputItem::Role::Kept) {
            fill_kept(*item.source, offset, out);
            return;
          }
          if (current.source != item.source) quantize_weight(config, *item.source, current);
          const std::vector<uint8_t>& bytes =
              item.role == OutputItem::Role::Codes ? current.codes : current.scale_bytes;
          std::memcpy(out.data(), bytes.data() + offset, out.size());
        });
    ++result.num_shards;
    if (options.log)
      options.log(
          str("wrote ", (options.out_dir / shard).string(), " (", specs.size(), " tensors)"));
  }

  if (fs::exists(options.in_dir / kIndexName)) {
    nlohmann::ordered_json index;
    index["metadata"]["total_size"] = result.bytes_out;
    index["weight_map"] = weight_map;
    write_json(options.out_dir / kIndexName, index);
  }
  config.modules_to_not_convert = kept_module_list;
  config_json["quantization_config"] = config.to_json();
  write_json(options.out_dir / "config.json", config_json);
  for (const char* name : kCopiedFiles) {
    if (fs::exists(options.in_dir / name)) {
      fs::copy_file(options.in_dir / name, options.out_dir / name,
                    fs::copy_options::overwrite_existing);
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace relay::quant

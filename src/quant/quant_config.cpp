// See quant_config.h.
#include "quant/quant_config.h"

#include <fstream>
#include <map>
#include <memory>
#include <mutex>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"

namespace relay::quant {

namespace {

const nlohmann::json& field(const nlohmann::json& j, const char* key, const std::string& source) {
  RELAY_CHECK(j.contains(key), source, ": quantization_config has no '", key, "'");
  return j.at(key);
}

std::string string_field(const nlohmann::json& j, const char* key, const std::string& source) {
  const nlohmann::json& v = field(j, key, source);
  RELAY_CHECK(v.is_string(), source, ": quantization_config.", key, " must be a string, got ",
              v.dump());
  return v.get<std::string>();
}

std::vector<std::string> module_list(const nlohmann::json& j, const std::string& source) {
  std::vector<std::string> out;
  if (!j.contains("modules_to_not_convert") || j.at("modules_to_not_convert").is_null()) return out;
  const nlohmann::json& v = j.at("modules_to_not_convert");
  RELAY_CHECK(v.is_array(), source, ": quantization_config.modules_to_not_convert must be a list");
  for (const nlohmann::json& m : v) {
    RELAY_CHECK(m.is_string(), source, ": quantization_config.modules_to_not_convert holds ",
                m.dump(), ", not a module name");
    out.push_back(m.get<std::string>());
  }
  return out;
}

}  // namespace

bool QuantConfig::keeps_unquantized(std::string_view module) const {
  for (const std::string& entry : modules_to_not_convert) {
    if (module == entry) return true;
    if (module.size() > entry.size() && module.ends_with(entry) &&
        module[module.size() - entry.size() - 1] == '.') {
      return true;
    }
  }
  return false;
}

QuantConfig QuantConfig::from_json(const nlohmann::json& j, const std::string& source) {
  RELAY_CHECK(j.is_object(), source, ": quantization_config must be an object, got ", j.dump());
  QuantConfig c;
  const std::string method = string_field(j, "quant_method", source);
  c.modules_to_not_convert = module_list(j, source);
  if (j.contains("activation_scheme")) {
    const std::string scheme = string_field(j, "activation_scheme", source);
    RELAY_CHECK(scheme == "dynamic", source, ": quantization_config.activation_scheme '", scheme,
                "' is not supported (Relay quantises activations dynamically)");
  }
  if (j.contains("fmt")) {
    const std::string fmt = string_field(j, "fmt", source);
    RELAY_CHECK(fmt == "e4m3", source, ": quantization_config.fmt '", fmt,
                "' is not supported (only e4m3)");
  }
  if (method == "fp8") {
    c.method = QuantMethod::Fp8Block;
    const nlohmann::json& block = field(j, "weight_block_size", source);
    RELAY_CHECK(block.is_array() && block.size() == 2 && block[0].is_number_integer() &&
                    block[1].is_number_integer(),
                source, ": quantization_config.weight_block_size must be [rows, cols], got ",
                block.dump(), " (per-tensor FP8 is not supported)");
    c.block_out = block[0].get<int>();
    c.block_in = block[1].get<int>();
    RELAY_CHECK(c.block_out > 0 && c.block_in > 0, source,
                ": quantization_config.weight_block_size must be positive, got ", block.dump());
  } else if (method == "mxfp8") {
    c.method = QuantMethod::Mxfp8;
    if (j.contains("group_size")) {
      const nlohmann::json& g = j.at("group_size");
      RELAY_CHECK(g.is_number_integer() && g.get<int>() == kernels::kMxGroupSize, source,
                  ": quantization_config.group_size must be ", kernels::kMxGroupSize, " for mxfp8, got ",
                  g.dump());
    }
  } else {
    fail(str(source, ": quantization_config.quant_method '", method,
             "' is not supported (Relay reads 'fp8' with weight_block_size, and 'mxfp8')"));
  }
  return c;
}

nlohmann::json QuantConfig::to_json() const {
  RELAY_CHECK(quantized(), "QuantConfig::to_json: method None has no quantization_config");
  nlohmann::json j;
  j["activation_scheme"] = "dynamic";
  j["fmt"] = "e4m3";
  j["modules_to_not_convert"] = modules_to_not_convert;
  if (method == QuantMethod::Fp8Block) {
    j["quant_method"] = "fp8";
    j["weight_block_size"] = {block_out, block_in};
  } else {
    j["quant_method"] = "mxfp8";
    j["group_size"] = group_size;
    j["scale_fmt"] = "e8m0";
  }
  return j;
}

QuantConfig QuantConfig::load(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / "config.json";
  const nlohmann::json j = parse_json_file(path);
  if (!j.contains("quantization_config") || j.at("quantization_config").is_null())
    return QuantConfig{};
  return from_json(j.at("quantization_config"), path.string());
}

const QuantConfig& QuantConfig::cached(const std::filesystem::path& dir) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<QuantConfig>> by_dir;
  // The modification time is part of the key so a rewritten config.json is parsed again.
  const std::filesystem::path path = std::filesystem::weakly_canonical(dir);
  std::error_code ec;
  const auto mtime = std::filesystem::last_write_time(path / "config.json", ec);
  const std::string key = str(path.string(), "@", ec ? 0 : mtime.time_since_epoch().count());
  std::lock_guard<std::mutex> lock(mutex);
  auto it = by_dir.find(key);
  if (it == by_dir.end()) it = by_dir.emplace(key, std::make_unique<QuantConfig>(load(dir))).first;
  return *it->second;
}

}  // namespace relay::quant

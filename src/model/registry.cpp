// See registry.h.
#include "model/registry.h"

#include "core/error.h"
#include "model/architectures.h"

namespace relay {

namespace {

struct Architecture {
  const char* name;
  std::unique_ptr<Model> (*build)(const ModelConfig&, const Checkpoint&, const ShardSpec&);
};

constexpr Architecture kArchitectures[] = {
    {"Qwen3ForCausalLM", build_qwen3},
    {"Qwen3MoeForCausalLM", build_qwen3_moe},
    {"Qwen3NextForCausalLM", build_qwen3_next},
    {"Qwen3_5ForConditionalGeneration", build_qwen3_5},
    {"Qwen3_5ForCausalLM", build_qwen3_5},
    {"Qwen3_5MoeForConditionalGeneration", build_qwen3_5},
    {"Qwen3_5MoeForCausalLM", build_qwen3_5},
};

}  // namespace

std::vector<std::string> supported_architectures() {
  std::vector<std::string> names;
  for (const Architecture& a : kArchitectures) names.emplace_back(a.name);
  return names;
}

std::unique_ptr<Model> build_model(const ModelConfig& config, const Checkpoint& ckpt) {
  return build_model(config, ckpt, unsharded(config));
}

std::unique_ptr<Model> build_model(const ModelConfig& config, const Checkpoint& ckpt,
                                   const ShardSpec& shard) {
  for (const Architecture& a : kArchitectures) {
    if (config.architecture == a.name) return a.build(config, ckpt, shard);
  }
  std::string supported;
  for (const std::string& name : supported_architectures())
    supported += str(supported.empty() ? "" : ", ", name);
  fail(str("architecture \"", config.architecture, "\" is not supported (supported: ", supported,
           ")"));
}

std::unique_ptr<Model> load_model(const std::filesystem::path& dir) {
  ModelConfig config = ModelConfig::load(dir);
  Checkpoint ckpt(dir);
  return build_model(config, ckpt);
}

}  // namespace relay

// See registry.h.
#include "model/registry.h"

#include <algorithm>

#include "core/error.h"
#include "model/architectures.h"
#include "model/mtp.h"

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
  return build_model(config, ckpt, shard, MtpSource{});
}

namespace {

const Architecture& find_architecture(const std::string& name) {
  for (const Architecture& a : kArchitectures) {
    if (name == a.name) return a;
  }
  std::string supported;
  for (const std::string& n : supported_architectures())
    supported += str(supported.empty() ? "" : ", ", n);
  fail(str("architecture \"", name, "\" is not supported (supported: ", supported, ")"));
}

// The MTP head of `head` (the target's checkpoint when `own`), after checking it is all there.
MtpHead load_mtp(const ModelConfig& config, const Checkpoint& head, const ShardSpec& shard,
                 bool own) {
  check_mtp_head(config, head, own);
  return load_mtp_head(config, head, shard);
}

}  // namespace

std::unique_ptr<Model> build_model(const ModelConfig& config, const Checkpoint& ckpt,
                                   const ShardSpec& shard, const MtpSource& mtp) {
  const Architecture& arch = find_architecture(config.architecture);
  if (!mtp.enabled) {
    log_unloaded_tensors(ckpt, "mtp.", "no MTP speculative decoding asked for");
  } else if (!mtp.dir.empty()) {
    log_unloaded_tensors(ckpt, "mtp.", str("the MTP head comes from ", mtp.dir.string()));
  }
  std::unique_ptr<Model> model = arch.build(config, ckpt, shard);
  if (!mtp.enabled) return model;
  const std::optional<Checkpoint> separate = open_separate_mtp_head(mtp);
  model->set_mtp_head(load_mtp(config, separate ? *separate : ckpt, shard, !separate));
  return model;
}

std::optional<Checkpoint> open_separate_mtp_head(const MtpSource& mtp) {
  if (!mtp.enabled || mtp.dir.empty()) return std::nullopt;
  RELAY_CHECK(std::filesystem::is_directory(mtp.dir), "the MTP head directory ", mtp.dir.string(),
              " (\"model\" in the speculative config) does not exist");
  return std::optional<Checkpoint>(std::in_place, mtp.dir);
}

std::unique_ptr<Model> load_model(const std::filesystem::path& dir) {
  return load_model(dir, MtpSource{});
}

std::unique_ptr<Model> load_model(const std::filesystem::path& dir, const MtpSource& mtp) {
  ModelConfig config = ModelConfig::load(dir);
  Checkpoint ckpt(dir);
  return build_model(config, ckpt, unsharded(config), mtp);
}

}  // namespace relay

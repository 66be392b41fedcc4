// Which architectures Relay runs, keyed by the config's `architecture` (HF's architectures[0]).
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace relay {

// The supported architecture names, e.g. "Qwen3MoeForCausalLM".
std::vector<std::string> supported_architectures();

// Builds the model for config.architecture from the checkpoint's tensors (copied to fp32, so the
// checkpoint may be closed afterwards). An unknown architecture is an error listing the supported
// ones.
std::unique_ptr<Model> build_model(const ModelConfig& config, const Checkpoint& ckpt);
// The same for one rank's shard (model/shard.h: make_shard).
std::unique_ptr<Model> build_model(const ModelConfig& config, const Checkpoint& ckpt,
                                   const ShardSpec& shard);

// ModelConfig::load(dir) + Checkpoint(dir) + build_model.
std::unique_ptr<Model> load_model(const std::filesystem::path& dir);

}  // namespace relay

// Which architectures Relay runs, keyed by the config's `architecture` (HF's architectures[0]).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace relay {

// The supported architecture names, e.g. "Qwen3MoeForCausalLM".
std::vector<std::string> supported_architectures();

// Where the MTP draft head (model/mtp.h) comes from, if one is loaded at all.
//
// Enabled with an empty `dir`, the head is the checkpoint's own mtp.* tensors (Qwen3.5 and
// Qwen3-Next ship one); with a `dir` (speculative config "model": DIR) it is read from that
// directory through the same Checkpoint machinery (model.safetensors or an index with shards;
// no config.json needed: it may hold only mtp.* tensors, whose shapes must fit the target's
// config). That is how a Qwen3 / Qwen3-MoE target, whose checkpoints ship no head, gets one.
// Either way the head shares the target's embedding and LM head.
struct MtpSource {
  bool enabled = false;
  std::filesystem::path dir;  // empty: the checkpoint's own mtp.*
};

// The separate head directory `mtp` names, opened (a missing directory is an error naming it);
// nothing when no head is asked for or it is the target checkpoint's own. Both backends load the
// head from it, or from the target's checkpoint, after model/mtp.h's check_mtp_head.
std::optional<Checkpoint> open_separate_mtp_head(const MtpSource& mtp);

// Builds the model for config.architecture from the checkpoint's tensors (copied to fp32, so the
// checkpoint may be closed afterwards). An unknown architecture is an error listing the supported
// ones. No MTP head: a checkpoint's mtp.* tensors are skipped with a log line.
std::unique_ptr<Model> build_model(const ModelConfig& config, const Checkpoint& ckpt);
// The same for one rank's shard (model/shard.h: make_shard).
std::unique_ptr<Model> build_model(const ModelConfig& config, const Checkpoint& ckpt,
                                   const ShardSpec& shard);
// The same with the MTP head `mtp` asks for (Model::has_mtp, forward_mtp), sharded like the
// target's layers. relay::Error when the head's directory does not exist, when a head tensor is
// missing (naming the first one and the directory; for the checkpoint's own head it says that
// "model": DIR points at a separate head), or of the wrong shape (naming it, its file and both
// shapes), or when there is more than one MTP layer (Relay runs exactly one, as every known
// checkpoint has).
std::unique_ptr<Model> build_model(const ModelConfig& config, const Checkpoint& ckpt,
                                   const ShardSpec& shard, const MtpSource& mtp);

// ModelConfig::load(dir) + Checkpoint(dir) + build_model.
std::unique_ptr<Model> load_model(const std::filesystem::path& dir);
// The same with the MTP head `mtp` asks for, unsharded.
std::unique_ptr<Model> load_model(const std::filesystem::path& dir, const MtpSource& mtp);

}  // namespace relay

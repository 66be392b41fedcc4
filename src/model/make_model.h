// Random-weight checkpoints in the exact Hugging Face layout, for tests and benchmarks.
//
// A preset is a canonical config.json (the real Qwen3-30B-A3B / Qwen3-235B-A22B shapes, the hybrid
// Qwen3.5-35B-A3B / 122B-A10B / 397B-A17B and Qwen3-Next-80B-A3B shapes, or tiny models of each
// layout for unit tests); make_model writes it with generation_config.json, the tokenizer files,
// and safetensors shards named and indexed as transformers' save_pretrained names them. Weights are
// normal(0, 0.02) (norm weights 1, zero-centred norms' w and biases 0) and a pure function of
// (seed, tensor name, element index): the thread count and the shard size never change a value.
// The tokenizer is always the embedded model's (Qwen3's): the Qwen3.5 presets keep their release's
// 248,320-row vocabulary, whose ids past Qwen3's decode to nothing. Writing streams in bounded
// chunks, so a 16 GB checkpoint needs well under a gigabyte of memory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/dtype.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace relay {

// Preset names, in the order `relay make-model --help` lists them.
std::vector<std::string> model_preset_names();
// The config.json of a preset (canonical HF form, as the release's config.json is laid out:
// Qwen3_5MoeForConditionalGeneration with text_config and vision_config for Qwen3.5,
// Qwen3NextForCausalLM flat); throws naming the unknown preset.
nlohmann::json model_preset_config(const std::string& preset);
// The preset's config.json with `config_patch` (a JSON merge patch, RFC 7386; may be empty)
// applied, then with `num_layers` layers when it is > 0: num_hidden_layers (under text_config for
// Qwen3.5), and for the hybrids layer_types rebuilt from full_attention_interval, which
// num_layers must be a multiple of (an error otherwise), so the 3 linear : 1 full pattern stays
// whole.
nlohmann::json preset_config_with_layers(const std::string& preset, int64_t num_layers,
                                         const std::string& config_patch);

// How a checkpoint stores each MoE layer's experts: as the architecture's releases do (the bf16
// Qwen3.5-MoE releases fuse each decoder layer's experts into mlp.experts.gate_up_proj [E, 2I, H]
// and mlp.experts.down_proj [E, H, I]; everything else is per expert), or always per expert.
enum class ExpertStorage { kAsReleased, kPerExpert };

// Every tensor a checkpoint for `c` holds, in the order transformers' state_dict lists them (and
// make_model writes them), with HF names and shapes: embed_tokens, then per layer the norms, the
// token mixer — attention (q/k/v/o, biases when attention_bias, q_norm/k_norm; q_proj doubled to
// [query | gate] per head when attn_output_gate) or Gated DeltaNet (Qwen3.5's split in_proj_qkv /
// z / b / a, Qwen3-Next's fused in_proj_qkvz / ba, conv1d, dt_bias, A_log, norm, out_proj) — and
// the MLP (router gate plus experts and the shared expert with its gate for MoE layers, gate/up/
// down for dense ones), then the final norm, lm_head (absent when tie_word_embeddings), and with
// mtp_num_hidden_layers the MTP head (mtp.*, model/mtp.h). A Qwen3.5 vision-language release's
// language model sits under model.language_model.; its vision tower is not listed (Relay does not
// run it). Tensors are `dtype`, except that bf16 checkpoints keep A_log (and Qwen3.5's gated norm
// weight) in F32, as the releases do.
std::vector<TensorSpec> checkpoint_tensor_specs(const ModelConfig& c, DType dtype,
                                                ExpertStorage experts);

// How make_model initialises tensor `name` of a checkpoint for `c`, as transformers does: every
// RMSNorm weight to 1 (but the hybrids' zero-centred (1 + w) norms: w = 0), biases to 0, the rest
// normal(0, 0.02).
enum class WeightInit { kNormal, kOnes, kZeros };
WeightInit weight_init_for(const ModelConfig& c, const std::string& name);

// Bytes [byte_offset, byte_offset + out.size()) of tensor `spec` as make_model writes it with
// `init`: normal(0, 0.02) as a pure function of (seed, name, element index), or constant 1 or 0.
// `byte_offset` and out.size() are multiples of the element size.
void fill_random_tensor(const TensorSpec& spec, WeightInit init, uint64_t seed, int num_threads,
                        size_t byte_offset, std::span<uint8_t> out);

struct MakeModelOptions {
  std::string preset;
  std::filesystem::path out_dir;
  std::filesystem::path
      tokenizer_dir;       // tokenizer.json and tokenizer_config.json are copied from here
  int64_t num_layers = 0;  // 0: the preset's num_hidden_layers (see preset_config_with_layers)
  // A JSON merge patch (RFC 7386) applied to the preset's config.json before --layers, for variants
  // such as {"norm_topk_prob": false, "mlp_only_layers": [1]}; the result must still parse.
  std::string config_patch;
  uint64_t seed = 0;
  DType dtype = DType::BF16;     // BF16 or F32
  int64_t shard_size_mb = 5000;  // max shard size in 10^6 bytes, as transformers counts
  int num_threads = 0;           // random-number threads; 0: all cores
  // Only config.json, generation_config.json and the tokenizer: a directory for
  // `--load-format dummy`, for shapes whose weights would not fit on disk (Qwen3-235B-A22B).
  bool config_only = false;
  std::function<void(const std::string&)> log;  // progress lines; may be empty
};

struct MakeModelResult {
  int64_t num_tensors = 0;
  int64_t num_shards = 0;
  uint64_t total_bytes = 0;  // tensor data, as the index's metadata.total_size
  double seconds = 0.0;
};

// Writes the checkpoint into options.out_dir (created if needed). Earlier make-model outputs there
// (model*.safetensors, the index) are replaced so a smaller model never inherits stale shards.
MakeModelResult make_model(const MakeModelOptions& options);

}  // namespace relay

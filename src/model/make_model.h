// Random-weight checkpoints in the exact Hugging Face layout, for tests and benchmarks.
//
// A preset is a canonical config.json (the real Qwen3-30B-A3B / Qwen3-235B-A22B shapes, or tiny
// models for unit tests); make_model writes it with generation_config.json, the tokenizer files,
// and safetensors shards named and indexed as transformers' save_pretrained names them. Weights are
// normal(0, 0.02) (norm weights 1, biases 0) and a pure function of (seed, tensor name, element
// index): the thread count and the shard size never change a value. Writing streams in bounded
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
// The config.json of a preset (canonical HF form); throws naming the unknown preset.
nlohmann::json model_preset_config(const std::string& preset);

// Every tensor a checkpoint for `c` holds, in the order transformers' state_dict lists them (and
// make_model writes them), with HF names and shapes: embed_tokens, then per layer the norms, the
// attention (q/k/v/o, biases when attention_bias, q_norm/k_norm) and the MLP (router gate plus
// per-expert gate/up/down for MoE layers, gate/up/down for dense ones), then model.norm and lm_head
// (absent when tie_word_embeddings). Qwen3 / Qwen3-MoE configs only (an error for the hybrids).
std::vector<TensorSpec> checkpoint_tensor_specs(const ModelConfig& c, DType dtype);

// How make_model initialises tensor `name`: every RMSNorm weight (layers, q/k, final) to 1, biases
// to 0, the rest normal(0, 0.02).
enum class WeightInit { kNormal, kOnes, kZeros };
WeightInit weight_init_for(const std::string& name);

// Bytes [byte_offset, byte_offset + out.size()) of tensor `spec` as make_model writes it: normal(0,
// 0.02), norm weights 1, biases 0, a pure function of (seed, name, element index). `byte_offset` and
// out.size() are multiples of the element size.
void fill_random_tensor(const TensorSpec& spec, uint64_t seed, int num_threads, size_t byte_offset,
                        std::span<uint8_t> out);

struct MakeModelOptions {
  std::string preset;
  std::filesystem::path out_dir;
  std::filesystem::path
      tokenizer_dir;       // tokenizer.json and tokenizer_config.json are copied from here
  int64_t num_layers = 0;  // 0: the preset's num_hidden_layers
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

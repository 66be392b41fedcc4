// `--load-format dummy` (vLLM's name for it): random weights made in memory from config.json
// alone, for benchmarks and profiling of shapes whose checkpoints are too large to write here
// (Qwen3-235B-A22B: 94 layers, 470 GB in bf16) or to carry to a GPU machine.
//
// The checkpoint has every tensor a real one has (model/make_model.h's list, bf16 — F32 where the
// releases keep F32 — with the HF names and shapes, experts always per expert), so the backends
// load it through their ordinary path: sharding, FP8 quantisation at load (`--dtype fp8`), fused
// layouts, the hybrids' layouts and their MTP head (mtp.*) when the config has one. The values
// follow make_model's rules (normal(0, 0.02), norm weights 1 or, zero-centred, 0, biases 0), but
// to need memory for one tensor rather than the whole model, every
// normal tensor is a window into one shared pool of random values, at an offset taken from its
// name: weights differ between tensors and are a pure function of (seed, name), yet nothing else
// about them is meaningful — the outputs are noise, fit for speed measurements only.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "model/config.h"
#include "model/safetensors.h"

namespace relay {

enum class LoadFormat {
  kAuto,   // the safetensors files in the model directory
  kDummy,  // random weights for its config.json, made in memory
};

// "auto" | "dummy"; throws naming the option otherwise.
LoadFormat parse_load_format(const std::string& text);

// The random-weight checkpoint for `config` (see above); `dir` names it in messages.
Checkpoint make_dummy_checkpoint(const ModelConfig& config, const std::filesystem::path& dir,
                                 uint64_t seed = 0);

// The checkpoint of model directory `dir` in `format`.
Checkpoint open_checkpoint(const std::filesystem::path& dir, LoadFormat format);

}  // namespace relay

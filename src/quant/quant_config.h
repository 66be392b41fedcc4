// A checkpoint's `quantization_config` (config.json): which quantised format its weights use.
//
// Two methods are understood:
//   - "fp8": the format Qwen/Qwen3-*-FP8 and DeepSeek-V3 ship — E4M3 weights, one scale per
//     weight_block_size = [block_out, block_in] block (128 x 128), stored as
//     `<module>.weight_scale_inv` (a multiplier, despite the name: w = q * scale_inv); activations
//     quantised dynamically.
//   - "mxfp8": Relay's own layout for OCP MXFP8 (no Hugging Face standard exists): E4M3 weights
//   with
//     one E8M0 scale per 32 consecutive input elements, stored as `<module>.weight_scale`.
// `modules_to_not_convert` lists modules kept in bf16 (lm_head, the MoE router `mlp.gate`, norms,
// embeddings). The parse checks every field Relay relies on and names it in errors; docs/fp8.md is
// the full description of both layouts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "kernels/fp8_ops.h"

namespace relay::quant {

enum class QuantMethod { None, Fp8Block, Mxfp8 };

struct QuantConfig {
  QuantMethod method = QuantMethod::None;
  int block_out = kernels::kFp8BlockSize;  // Fp8Block: rows per scale block (weight_block_size[0])
  int block_in = kernels::kFp8BlockSize;   // Fp8Block: columns per scale block (weight_block_size[1])
  int group_size = kernels::kMxGroupSize;  // Mxfp8: input elements per scale
  std::vector<std::string> modules_to_not_convert;

  bool quantized() const { return method != QuantMethod::None; }
  // Whether `module` (e.g. "model.layers.0.mlp.gate") stays unquantised: an entry equal to it, or
  // an entry matching a whole dotted suffix of it ("lm_head", "mlp.gate"), as transformers matches.
  bool keeps_unquantized(std::string_view module) const;

  // Parses the `quantization_config` object; `source` names the file in errors.
  static QuantConfig from_json(const nlohmann::json& j, const std::string& source);
  // The quantization_config object as written to config.json (the inverse of from_json).
  nlohmann::json to_json() const;
  // Reads DIR/config.json; no `quantization_config` means method None.
  static QuantConfig load(const std::filesystem::path& dir);
  // load(dir), parsed once per directory (and config.json modification time) and kept for the
  // process: the model loader asks for it once per weight tensor. Thread-safe.
  static const QuantConfig& cached(const std::filesystem::path& dir);
};

}  // namespace relay::quant

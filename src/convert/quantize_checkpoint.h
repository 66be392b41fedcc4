// `relay quantize`: converts a bf16/f32 Hugging Face checkpoint into an FP8 one in the same layout.
//
// Output = input with every quantisable linear weight (2-D `*.weight` of a module not kept:
// lm_head, embed_tokens, the MoE router `mlp.gate`, Qwen3.5's `shared_expert_gate`) replaced by
// F8_E4M3 codes plus its scales — `<module>.weight_scale_inv` F32 [ceil(out/128), ceil(in/128)] for
// fp8-block128,
// `<module>.weight_scale` F8_E8M0 [out, ceil(in/32)] for mxfp8 — and every other tensor stored as
// bf16. Shards keep their input names and contents (a scale lives next to its weight), the index is
// rewritten with the new sizes, config.json gains a `quantization_config` (quant_config.h) whose
// modules_to_not_convert lists every module left unquantised, and tokenizer / generation files are
// copied. The conversion streams one tensor at a time through write_safetensors_streamed: memory is
// bounded by one quantised tensor (1 byte per element) plus a 128-row fp32 stripe, whatever the
// checkpoint's size.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "quant/quant_config.h"

namespace relay::quant {

struct QuantizeOptions {
  std::filesystem::path in_dir;
  std::filesystem::path out_dir;  // created; must differ from in_dir
  QuantMethod method = QuantMethod::Fp8Block;
  std::function<void(const std::string&)> log;  // progress lines; may be empty
};

struct QuantizeResult {
  int64_t num_quantized = 0;  // weights converted to e4m3
  int64_t num_kept = 0;       // tensors kept (as bf16)
  int64_t num_shards = 0;
  uint64_t bytes_in = 0;   // tensor data read
  uint64_t bytes_out = 0;  // tensor data written
  double seconds = 0.0;
};

// Parses "fp8-block128" / "mxfp8" (the --format values); other names are an error listing both.
QuantMethod parse_quant_format(const std::string& name);

// Whether tensor `name` (shape of `rank` dims) is a linear weight that quantisation converts.
bool is_quantizable_weight(const std::string& name, size_t rank);

QuantizeResult quantize_checkpoint(const QuantizeOptions& options);

}  // namespace relay::quant

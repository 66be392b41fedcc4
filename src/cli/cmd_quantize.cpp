// `relay quantize`: converts a bf16/f32 Hugging Face checkpoint into an FP8 one (block-scaled as
// the Qwen3-*-FP8 checkpoints, or MXFP8) in the same layout; see
// convert/quantize_checkpoint.h.
#include <iostream>

#include "cli/command.h"
#include "core/error.h"
#include "convert/quantize_checkpoint.h"

namespace relay::cli {
namespace {

CommandRegistrar quantize_command({
    "quantize",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<quant::QuantizeOptions>();
      auto format = std::make_shared<std::string>();
      sub.add_option("--in", o->in_dir, "input checkpoint directory (bf16/f32 weights)")
          ->required();
      sub.add_option("--out", o->out_dir,
                     "output directory (created; earlier shards there are replaced)")
          ->required();
      sub.add_option("--format", *format,
                     "fp8-block128: e4m3 with a scale per 128x128 block (Qwen3-*-FP8 layout); "
                     "mxfp8: e4m3 with an E8M0 scale per 32 input elements")
          ->required()
          ->check(CLI::IsMember({"fp8-block128", "mxfp8"}));
      return [o, format] {
        o->method = quant::parse_quant_format(*format);
        o->log = [](const std::string& line) { std::cerr << line << "\n"; };
        const quant::QuantizeResult r = quant::quantize_checkpoint(*o);
        std::cerr << "quantized " << r.num_quantized << " weights, kept " << r.num_kept
                  << " tensors in bf16; " << r.bytes_in << " -> " << r.bytes_out << " bytes in "
                  << r.num_shards << " shard(s), " << r.seconds << " s\n";
        return 0;
      };
    },
    "convert a bf16/f32 checkpoint to FP8 (fp8-block128 or mxfp8), same HF layout",
});

}  // namespace
}  // namespace relay::cli

// `relay make-model`: writes a random-weight checkpoint in the Hugging Face layout from a preset
// (see model/make_model.h), with the embedded model's tokenizer, for tests and benchmarks.
#include <iostream>

#include "cli/command.h"
#include "core/error.h"
#include "model/make_model.h"

namespace relay::cli {
namespace {

CommandRegistrar make_model_command({
    "make-model",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<MakeModelOptions>();
      auto dtype = std::make_shared<std::string>("bf16");
      std::string presets;
      for (const std::string& n : model_preset_names())
        presets += (presets.empty() ? "" : ", ") + n;
      sub.add_option("--preset", o->preset, "model shapes: " + presets)->required();
      sub.add_option("--out", o->out_dir,
                     "output directory (created; earlier shards there are replaced)")
          ->required();
      sub.add_option("--layers", o->num_layers,
                     "override num_hidden_layers (hybrids: a multiple of full_attention_interval, "
                     "keeping the 3 linear : 1 full layer pattern)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--seed", o->seed, "random seed (weights are a pure function of it)");
      sub.add_option("--dtype", *dtype, "weight dtype")->check(CLI::IsMember({"bf16", "f32"}));
      sub.add_option("--shard-size", o->shard_size_mb, "max shard size in MB (10^6 bytes)")
          ->check(CLI::PositiveNumber);
      sub.add_option(
          "--config-patch", o->config_patch,
          "JSON merged into the preset's config.json, e.g. '{\"norm_topk_prob\": false}'");
      sub.add_option("--threads", o->num_threads, "random-number threads (default: all cores)");
      sub.add_flag("--config-only", o->config_only,
                   "write config.json and the tokenizer, no weights: a model directory for "
                   "--load-format dummy (random weights made at load)");
      return [o, dtype] {
        o->dtype = *dtype == "f32" ? DType::F32 : DType::BF16;
        o->tokenizer_dir = default_model_dir();
        o->log = [](const std::string& line) { std::cerr << line << "\n"; };
        make_model(*o);
        return 0;
      };
    },
    "write a random-weight checkpoint (HF layout) from a preset",
});

}  // namespace
}  // namespace relay::cli

// Host cost of one engine step: LLMEngine (scheduler, block manager, detokenizer, stop checks)
// driven over a backend that does no work, so every microsecond measured is time the GPU would sit
// idle between two decode steps.
//
//   build/bench/engine_overhead_bench [--model DIR] [--batch N] [--prompt-len N] [--steps N]
//
// Prints the mean host time per pure decode step and its share of a device step of --device-ms.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "engine/llm_engine.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"

namespace {

// Samples a fixed cycle of ordinary token ids and touches nothing else.
class NullBackend : public relay::Backend {
 public:
  NullBackend(relay::ModelConfig config, int num_blocks)
      : config_(std::move(config)), blocks_(num_blocks) {}
  const relay::ModelConfig& config() const override { return config_; }
  int block_size() const override { return 16; }
  int num_kv_blocks() const override { return blocks_; }
  std::vector<relay::SampledToken> step(std::span<const relay::StepSequence> batch) override {
    std::vector<relay::SampledToken> out;
    out.reserve(batch.size());
    for (const relay::StepSequence& s : batch) {
      if (!s.sample) continue;
      relay::SampledToken t;
      t.seq_id = s.seq_id;
      t.token = 1000 + static_cast<int32_t>((s.sample_index * 7919 + s.seq_id) % 20000);
      out.push_back(t);
    }
    return out;
  }

 private:
  relay::ModelConfig config_;
  int blocks_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Host cost of an engine step over a backend that does no work");
  std::string model = std::string(RELAY_SOURCE_DIR) + "/models/relay-demo-moe";
  int batch = 64, prompt_len = 1024, steps = 512;
  double device_ms = 5.0;
  app.add_option("--model", model, "model directory (config and tokenizer)");
  app.add_option("--batch", batch, "sequences decoded together");
  app.add_option("--prompt-len", prompt_len, "prompt tokens per sequence");
  app.add_option("--steps", steps, "decode steps to time");
  app.add_option("--device-ms", device_ms, "device time of one step, for the share printed");
  CLI11_PARSE(app, argc, argv);

  relay::ModelConfig config = relay::ModelConfig::load(model);
  config.max_position_embeddings = prompt_len + steps + 64;
  const int blocks = batch * ((prompt_len + steps + 64) / 16 + 1);
  relay::EngineConfig ec;
  ec.max_num_seqs = batch;
  ec.max_num_batched_tokens = batch * prompt_len;
  relay::LLMEngine engine(std::make_unique<NullBackend>(config, blocks),
                          relay::Tokenizer::from_model_dir(model), ec);
  for (int i = 0; i < batch; ++i) {
    relay::EngineRequest r;
    for (int t = 0; t < prompt_len; ++t) r.prompt.push_back(100 + (i * 131 + t * 17) % 30000);
    r.stop.max_tokens = steps + 2;
    r.stop.ignore_eos = true;
    engine.add_request(i, std::move(r));
  }
  engine.step();  // the prefill of every prompt
  const auto t0 = std::chrono::steady_clock::now();
  size_t tokens = 0;
  for (int s = 0; s < steps; ++s) {
    for (const relay::RequestOutput& out : engine.step()) tokens += out.new_tokens.size();
  }
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
      steps;
  std::printf(
      "batch %d, context %d..%d: %.1f us host per decode step (%.2f%% of a %.1f ms step), %zu "
      "tokens\n",
      batch, prompt_len, prompt_len + steps, us, 100.0 * us / (device_ms * 1000.0), device_ms,
      tokens);
  return 0;
}

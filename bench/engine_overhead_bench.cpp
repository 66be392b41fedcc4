// Host cost of one engine step: LLMEngine (scheduler, block manager, detokenizer, stop checks)
// driven over a backend that does no work, so every microsecond measured is time the GPU would sit
// idle between two decode steps.
//
//   build/bench/engine_overhead_bench [--model DIR] [--batch N] [--prompt-len N] [--steps N]
//                                     [--serve] [--emulate-device]
//
// Without --serve it times LLMEngine::step() alone and prints the mean host time per pure decode
// step and its share of a device step of --device-ms. With --serve it runs the server's engine
// thread (server::EngineLoop, with its metrics and per-request queues) and one consumer thread per
// sequence that reads its stream and formats every output as JSON, as an HTTP thread does; it
// prints the engine thread's time per decode step (relay:engine_step_seconds_total{kind="decode"},
// and its phases where the build reports them) and the wall time per decode step. --emulate-device
// makes each backend step sleep --device-ms, so the wall time shows what the host adds to a GPU
// step rather than how fast the host alone can go.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "engine/llm_engine.h"
#include "model/config.h"
#include "server/engine_loop.h"
#include "server/metrics.h"
#include "tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

// Samples a fixed cycle of ordinary token ids and touches nothing else; with a sleep it stands in
// for a device step of that length (the host thread waits, as it does on a GPU).
class NullBackend : public relay::Backend {
 public:
  NullBackend(relay::ModelConfig config, int num_blocks, double sleep_ms)
      : config_(std::move(config)), blocks_(num_blocks), sleep_ms_(sleep_ms) {}
  const relay::ModelConfig& config() const override { return config_; }
  int block_size() const override { return 16; }
  int num_kv_blocks() const override { return blocks_; }
  std::vector<relay::SampledToken> step(std::span<const relay::StepSequence> batch) override {
    if (sleep_ms_ > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(sleep_ms_));
    }
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
  double sleep_ms_;
};

relay::EngineRequest make_request(int i, int prompt_len, int max_tokens) {
  relay::EngineRequest r;
  for (int t = 0; t < prompt_len; ++t) r.prompt.push_back(100 + (i * 131 + t * 17) % 30000);
  r.stop.max_tokens = max_tokens;
  r.stop.ignore_eos = true;
  return r;
}

// The values of the series `name` with label `label` in a Prometheus rendering, keyed by that
// label's value, for series that also carry kind="decode" (or no kind at all).
std::map<std::string, double> decode_series(const std::string& text, const std::string& name,
                                            const std::string& label) {
  std::map<std::string, double> out;
  const std::regex line("^" + name + R"(\{([^}]*)\} ([0-9.eE+-]+)$)");
  const std::regex value(label + R"(="([^"]*)\")");
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string l = text.substr(begin, end - begin);
    begin = end + 1;
    std::smatch m;
    if (!std::regex_match(l, m, line)) continue;
    const std::string labels = m[1];
    if (labels.find("kind=") != std::string::npos &&
        labels.find("kind=\"decode\"") == std::string::npos) {
      continue;
    }
    std::smatch v;
    const std::string key = std::regex_search(labels, v, value) ? std::string(v[1]) : "";
    out[key] = std::stod(m[2]);
  }
  return out;
}

int run_engine(const relay::ModelConfig& config, const std::string& model, int batch,
               int prompt_len, int steps, double device_ms, int blocks) {
  relay::EngineConfig ec;
  ec.max_num_seqs = batch;
  ec.max_num_batched_tokens = batch * prompt_len;
  relay::LLMEngine engine(std::make_unique<NullBackend>(config, blocks, 0.0),
                          relay::Tokenizer::from_model_dir(model), ec);
  for (int i = 0; i < batch; ++i) engine.add_request(i, make_request(i, prompt_len, steps + 2));
  engine.step();  // the prefill of every prompt
  const auto t0 = Clock::now();
  size_t tokens = 0;
  for (int s = 0; s < steps; ++s) {
    for (const relay::RequestOutput& out : engine.step()) tokens += out.new_tokens.size();
  }
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / steps;
  std::printf(
      "batch %d, context %d..%d: %.1f us host per decode step (%.2f%% of a %.1f ms step), %zu "
      "tokens\n",
      batch, prompt_len, prompt_len + steps, us, 100.0 * us / (device_ms * 1000.0), device_ms,
      tokens);
  return 0;
}

int run_serve(const relay::ModelConfig& config, const std::string& model, int batch, int prompt_len,
              int steps, double device_ms, bool emulate_device, int blocks) {
  relay::EngineConfig ec;
  ec.max_num_seqs = batch;
  ec.max_num_batched_tokens = batch * prompt_len;
  relay::LLMEngine engine(
      std::make_unique<NullBackend>(config, blocks, emulate_device ? device_ms : 0.0),
      relay::Tokenizer::from_model_dir(model), ec);
  relay::server::Metrics metrics("bench");
  relay::server::EngineLoop loop(engine, metrics);

  std::vector<std::shared_ptr<relay::server::RequestHandle>> handles;
  for (int i = 0; i < batch; ++i)
    handles.push_back(loop.submit(make_request(i, prompt_len, steps)));
  // One consumer per stream, like the HTTP threads: drain the queue, format each output.
  std::atomic<size_t> tokens{0}, bytes{0};
  // When the first consumer sees its second token: the decode steps begin (the first token comes
  // from the prefill step).
  std::atomic<int64_t> decode_start_ns{0};
  std::vector<std::thread> consumers;
  for (auto& h : handles) {
    consumers.emplace_back([&, h] {
      size_t n = 0, b = 0;
      while (!h->done()) {
        for (const relay::RequestOutput& out : h->next(std::chrono::milliseconds(100))) {
          if (out.num_output_tokens == 2) {
            int64_t expected = 0;
            decode_start_ns.compare_exchange_strong(
                expected, Clock::now().time_since_epoch() / std::chrono::nanoseconds(1));
          }
          const nlohmann::json chunk = {
              {"id", "cmpl-bench"},
              {"object", "text_completion"},
              {"choices", {{{"index", 0}, {"text", out.text}, {"finish_reason", nullptr}}}}};
          b += ("data: " + chunk.dump() + "\n\n").size();
          n += out.new_tokens.size();
        }
      }
      tokens += n;
      bytes += b;
    });
  }
  for (std::thread& t : consumers) t.join();
  const double wall_s =
      1e-9 * static_cast<double>(Clock::now().time_since_epoch() / std::chrono::nanoseconds(1) -
                                 decode_start_ns.load());
  loop.stop();

  const std::string text = metrics.render();
  const double num_steps = decode_series(text, "relay:engine_steps_total", "kind")["decode"];
  const double step_s = decode_series(text, "relay:engine_step_seconds_total", "kind")["decode"];
  std::printf("serve: batch %d, context %d..%d, %d consumer threads, device %s: %zu tokens\n",
              batch, prompt_len, prompt_len + steps, batch,
              emulate_device ? (std::to_string(device_ms) + " ms sleep").c_str() : "none",
              tokens.load());
  std::printf("  engine thread per decode step: %.1f us (%.0f decode steps)\n",
              1e6 * step_s / std::max(num_steps, 1.0), num_steps);
  for (const auto& [phase, s] :
       decode_series(text, "relay:engine_step_phase_seconds_total", "phase")) {
    std::printf("    %-9s %.1f us\n", phase.c_str(), 1e6 * s / std::max(num_steps, 1.0));
  }
  for (const auto& [key, s] : decode_series(text, "relay:output_delivery_seconds_total", "")) {
    std::printf("  delivery thread per decode step (overlapped): %.1f us\n",
                1e6 * s / std::max(num_steps, 1.0));
  }
  std::printf("  wall per decode step: %.1f us (the last %d steps)\n", 1e6 * wall_s / (steps - 2),
              steps - 2);
  return tokens.load() == static_cast<size_t>(batch) * steps ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Host cost of an engine step over a backend that does no work");
  std::string model = std::string(RELAY_SOURCE_DIR) + "/models/relay-demo-moe";
  int batch = 64, prompt_len = 1024, steps = 512;
  double device_ms = 5.0;
  bool serve = false, emulate_device = false;
  app.add_option("--model", model, "model directory (config and tokenizer)");
  app.add_option("--batch", batch, "sequences decoded together");
  app.add_option("--prompt-len", prompt_len, "prompt tokens per sequence");
  app.add_option("--steps", steps, "decode steps to time");
  app.add_option("--device-ms", device_ms, "device time of one step, for the share printed");
  app.add_flag("--serve", serve, "run the server's engine thread with one consumer per stream");
  app.add_flag("--emulate-device", emulate_device,
               "with --serve: each backend step sleeps --device-ms");
  CLI11_PARSE(app, argc, argv);

  relay::ModelConfig config = relay::ModelConfig::load(model);
  config.max_position_embeddings = prompt_len + steps + 64;
  const int blocks = batch * ((prompt_len + steps + 64) / 16 + 1);
  if (serve) {
    return run_serve(config, model, batch, prompt_len, steps, device_ms, emulate_device, blocks);
  }
  return run_engine(config, model, batch, prompt_len, steps, device_ms, blocks);
}

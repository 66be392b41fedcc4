// Decode throughput of the CPU backend: prefill a batch of prompts, then time greedy decode steps.
//
//   build/bench/cpu_decode_bench [--model DIR] [--batch N] [--steps N] [--prompt-len N] [--threads N]
//                                [--tp N] [--ep N] [--dp N]
//
// Prints prefill and decode tokens per second. Prompts are fixed pseudo-random token ids, so runs are
// comparable; every step goes through CpuBackend::step exactly as the engine drives it.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "engine/cpu_backend.h"

namespace {

struct BenchSeq {
  std::vector<int32_t> tokens;
  std::vector<int32_t> output;
  std::vector<int32_t> blocks;
  int num_computed = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("CPU backend decode benchmark");
  std::string model = std::string(RELAY_SOURCE_DIR) + "/models/relay-demo-moe";
  int batch = 1, steps = 128, prompt_len = 32, threads = 0;
  app.add_option("--model", model, "model directory");
  app.add_option("--batch", batch, "sequences decoded together");
  app.add_option("--steps", steps, "decode steps to time");
  app.add_option("--prompt-len", prompt_len, "prompt tokens per sequence");
  app.add_option("--threads", threads, "CPU threads (0: all), divided among the ranks");
  relay::parallel::ParallelConfig parallel;
  app.add_option("--tp", parallel.tp, "tensor-parallel ranks");
  app.add_option("--ep", parallel.ep, "expert-parallel ranks (1 or tp x dp)");
  app.add_option("--dp", parallel.dp, "data-parallel attention ranks (sequences spread over them)");
  CLI11_PARSE(app, argc, argv);

  relay::CpuBackendOptions options;
  options.num_threads = threads;
  options.parallel = parallel;
  const int bs = options.block_size;
  const int blocks_per_seq = (prompt_len + steps + bs) / bs;
  const int seqs_per_rank = (batch + parallel.dp - 1) / parallel.dp;
  options.num_blocks = seqs_per_rank * blocks_per_seq;  // per rank
  relay::CpuBackend backend(model, options);

  std::vector<BenchSeq> seqs(batch);
  uint32_t state = 12345;
  for (int i = 0; i < batch; ++i) {
    for (int t = 0; t < prompt_len; ++t) {
      state = state * 1664525u + 1013904223u;
      seqs[i].tokens.push_back(static_cast<int32_t>((state >> 8) % 32000));
    }
    // Sequence i lives on DP rank i % dp, in that rank's partition of the block ids.
    const int rank = i % parallel.dp, slot = i / parallel.dp;
    for (int b = 0; b < blocks_per_seq; ++b) {
      seqs[i].blocks.push_back(rank * options.num_blocks + slot * blocks_per_seq + b);
    }
  }
  relay::SamplingParams greedy;
  greedy.temperature = 0.0f;

  auto run_step = [&] {
    std::vector<relay::StepSequence> step;
    for (int i = 0; i < batch; ++i) {
      relay::StepSequence s;
      s.seq_id = i;
      s.tokens = std::span<const int32_t>(seqs[i].tokens).subspan(seqs[i].num_computed);
      s.num_computed = seqs[i].num_computed;
      s.block_table = seqs[i].blocks;
      s.sample = true;
      s.sampling = &greedy;
      s.output_tokens = seqs[i].output;
      step.push_back(s);
    }
    std::vector<relay::SampledToken> out = backend.step(step);
    for (int i = 0; i < batch; ++i) {
      seqs[i].num_computed = static_cast<int>(seqs[i].tokens.size());
      seqs[i].tokens.push_back(out[i].token);
      seqs[i].output.push_back(out[i].token);
    }
  };

  auto t0 = std::chrono::steady_clock::now();
  run_step();
  double prefill_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) run_step();
  double decode_s = seconds_since(t0);

  std::printf("model %s, %s, %d threads per rank, batch %d, prompt %d tokens, %d decode steps\n", model.c_str(),
              parallel.describe().c_str(), backend.thread_pool().num_threads(), batch, prompt_len, steps);
  std::printf("prefill: %.1f tok/s (%.1f ms)\n", batch * prompt_len / prefill_s, prefill_s * 1e3);
  std::printf("decode:  %.1f tok/s (%.2f ms/step)\n", batch * steps / decode_s, decode_s * 1e3 / steps);
  return 0;
}

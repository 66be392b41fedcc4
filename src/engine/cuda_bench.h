// `relay bench` on the GPU: ceilings, kernel-level figures and end-to-end prefill/decode.
//
// Every result is one JSON line (stdout, and appended to out_path when set) carrying the ceilings
// measured at the start of the same run, so a fraction never mixes two machines' states. No CUDA
// types here: cmd_bench.cpp includes this header in CUDA builds only.
//
// The model mode can shard its backend (`parallel`, `devices`: the CudaBackend's ranks, as `relay
// generate --tp/--ep/--dp/--gpus`); the other modes are one-GPU figures and take neither
// (cmd_bench.cpp refuses them there, before CUDA starts).
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "parallel/parallel_config.h"

namespace relay {

struct CudaBenchOptions {
  std::string mode = "all";  // ceilings | kernels | model | collectives | accuracy | all (the first three)
  std::filesystem::path model_dir;     // checkpoint for the model mode
  std::filesystem::path out_path;      // JSON lines appended here too (empty: stdout only)
  bool quick = false;                  // fewer shapes and repetitions (scripts/gpu-check.sh)
  // Model-mode shapes; empty: the defaults (prefill 512, 4096, 16384; decode batches 1, 8, 64, 256
  // at contexts 512 and 4096). The serving benchmark asks for its own batches and mean contexts.
  std::vector<int> prefill_lengths, decode_batches, decode_contexts;
  std::string dtype = "auto";  // model mode: the backend's weight format (auto | bf16 | fp8)
  int ranks = 1;               // collectives mode: GPUs, one thread each (1: peers emulated on GPU 0)
  // Model mode: the backend's tp / ep / dp ranks and the CUDA device of each (one per rank,
  // repeats allowed: ranks sharing a GPU; empty: rank r on device r). Validated by the caller.
  parallel::ParallelConfig parallel;
  std::vector<int> devices;
  // Model mode: tokens per step the backend is sized for (0: 16384, or the longest prefill). Under
  // DP + EP each rank's MoE receive buffer holds dp x this many tokens.
  int max_num_tokens = 0;
  std::string load_format = "auto";  // model mode: auto | dummy (random weights, no checkpoint)
  // Model mode: each decode shape is also run as verify steps of this many random drafts per
  // sequence ("decode_spec" lines beside "decode"); 0: none. Random drafts are accepted only by
  // forced_acceptance (CudaBackendOptions::forced_draft_acceptance), which sets the rate.
  int spec_tokens = 0;
  std::optional<double> forced_acceptance;
};

// Returns the process exit code.
int run_cuda_bench(const CudaBenchOptions& options);

}  // namespace relay

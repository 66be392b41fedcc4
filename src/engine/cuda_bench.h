// `relay bench` on the GPU: ceilings, kernel-level figures and end-to-end prefill/decode.
//
// Every result is one JSON line (stdout, and appended to out_path when set) carrying the ceilings
// measured at the start of the same run, so a fraction never mixes two machines' states. No CUDA
// types here: cmd_bench.cpp includes this header in CUDA builds only.
#pragma once

#include <filesystem>
#include <string>

namespace relay {

struct CudaBenchOptions {
  std::string mode = "all";            // ceilings | kernels | model | all
  std::filesystem::path model_dir;     // checkpoint for the model mode
  std::filesystem::path out_path;      // JSON lines appended here too (empty: stdout only)
  bool quick = false;                  // fewer shapes and repetitions (scripts/gpu-check.sh)
};

// Returns the process exit code.
int run_cuda_bench(const CudaBenchOptions& options);

}  // namespace relay

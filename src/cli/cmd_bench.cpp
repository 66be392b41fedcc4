// `relay bench`: ceilings, kernel figures and end-to-end prefill/decode on the GPU (engine/cuda_bench.h).
// A build without CUDA keeps the command so scripts get a clear message instead of "unknown command".
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#if RELAY_HAVE_CUDA
#include "engine/cuda_bench.h"
#endif

namespace relay::cli {
namespace {

struct BenchArgs {
  std::string mode = "all";
  std::string model;
  std::string out;
  bool quick = false;
  std::vector<int> prefill_lengths, decode_batches, decode_contexts;
  std::string dtype = "auto";
  int ranks = 1;
};

CommandRegistrar bench_command({
    "bench",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<BenchArgs>();
      sub.add_option("--mode", a->mode,
                     "ceilings | kernels | model | collectives | accuracy (FP8 vs bf16 logits) | all "
                     "(ceilings, kernels, model)")
          ->check(CLI::IsMember({"ceilings", "kernels", "model", "collectives", "accuracy", "all"}));
      sub.add_option("--model", a->model, "checkpoint directory for prefill/decode (e.g. from make-model)");
      sub.add_option("--out", a->out, "append the JSON lines to this file too");
      sub.add_flag("--quick", a->quick, "fewer shapes and repetitions");
      sub.add_option("--dtype", a->dtype, "model mode: weight format auto | bf16 | fp8 (as relay serve)")
          ->check(CLI::IsMember({"auto", "bf16", "fp8"}));
      sub.add_option("--prefill-lengths", a->prefill_lengths, "model mode: prompt lengths (default 512,4096,16384)")
          ->delimiter(',')
          ->check(CLI::PositiveNumber);
      sub.add_option("--decode-batches", a->decode_batches, "model mode: decode batch sizes (default 1,8,64,256)")
          ->delimiter(',')
          ->check(CLI::Range(1, 512));
      sub.add_option("--decode-contexts", a->decode_contexts, "model mode: decode contexts (default 512,4096)")
          ->delimiter(',')
          ->check(CLI::PositiveNumber);
      sub.add_option("--ranks", a->ranks,
                     "collectives mode: GPUs, one thread each; 1 emulates 2, 4 and 8 peers on GPU 0")
          ->check(CLI::Range(1, 8));
      return [a]() -> int {
#if RELAY_HAVE_CUDA
        return run_cuda_bench(
            {a->mode, a->model, a->out, a->quick, a->prefill_lengths, a->decode_batches, a->decode_contexts,
             a->dtype, a->ranks});
#else
        std::cerr << "relay bench measures the GPU and needs the CUDA build; this binary was built without "
                     "CUDA (configure with nvcc available and -DRELAY_CUDA=ON)\n";
        return 2;
#endif
      };
    },
    "measure ceilings, kernels and prefill/decode throughput on the GPU (JSON lines)",
});

}  // namespace
}  // namespace relay::cli

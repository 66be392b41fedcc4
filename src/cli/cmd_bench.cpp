// `relay bench`: ceilings, kernel figures and end-to-end prefill/decode on the GPU (engine/cuda_bench.h).
// A build without CUDA keeps the command so scripts get a clear message instead of "unknown command".
//
// The model mode shards its backend with relay generate's --tp / --ep / --dp / --gpus (the same
// options, validation and messages: backend_choice.h, model/shard.h). Every refusal — a sharding
// flag on a mode that measures one GPU, a layout Relay does not run, a --gpus list of the wrong
// length, a split the model does not divide — is said here, before CUDA starts, so it costs no
// ceiling measurement and reads the same on a build or machine without a GPU.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli/backend_choice.h"
#include "cli/command.h"
#include "core/error.h"
#include "model/config.h"
#include "model/shard.h"
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
  parallel::ParallelConfig parallel;  // model mode: --tp / --ep / --dp
  std::string gpus;                   // model mode: --gpus
  int max_num_batched_tokens = 0;     // model mode: the backend's step capacity (0: the default)
  std::string load_format = "auto";   // model mode: auto | dummy
};

// The CUDA device of every model-mode rank (empty for the other modes), or relay::Error naming
// the flag that cannot work.
std::vector<int> check_sharding(const BenchArgs& a) {
  std::string given;  // a sharding flag that was set, as typed (--tp before --ep, --dp, --gpus)
  if (!a.gpus.empty()) given = "--gpus " + a.gpus;
  if (a.parallel.dp != 1) given = str("--dp ", a.parallel.dp);
  if (a.parallel.ep != 1) given = str("--ep ", a.parallel.ep);
  if (a.parallel.tp != 1) given = str("--tp ", a.parallel.tp);
  if (a.mode != "model") {
    RELAY_CHECK(a.load_format == "auto", "--load-format ", a.load_format,
                " loads the model mode's weights; --mode ", a.mode, " has none");
    RELAY_CHECK(a.max_num_batched_tokens == 0, "--max-num-batched-tokens sizes the model mode's backend; --mode ",
                a.mode, " has none");
    RELAY_CHECK(given.empty(), given, ": --tp, --ep, --dp and --gpus shard the model mode's backend "
                "(relay bench --mode model --model DIR); --mode ", a.mode, " is not sharded",
                a.mode == "collectives" ? " (its GPU count is --ranks)" : "");
    return {};
  }
  RELAY_CHECK(a.ranks == 1, "--ranks ", a.ranks, " is the collectives mode's GPU count; --mode model "
              "places its ranks with --tp, --ep, --dp and --gpus");
  RELAY_CHECK(!a.model.empty(), "bench --mode model needs --model DIR");
  if (a.max_num_batched_tokens > 0) {
    for (int len : a.prefill_lengths) {
      RELAY_CHECK(len <= a.max_num_batched_tokens, "--prefill-lengths ", len, " exceeds --max-num-batched-tokens ",
                  a.max_num_batched_tokens, " (a prompt runs as one step)");
    }
    for (int b : a.decode_batches) {
      RELAY_CHECK(b <= a.max_num_batched_tokens, "--decode-batches ", b, " exceeds --max-num-batched-tokens ",
                  a.max_num_batched_tokens);
    }
  }
  std::vector<int> devices = rank_devices(a.parallel, a.gpus, /*first_gpu=*/0);
  if (a.parallel.world_size() > 1) {
    const ModelConfig config = ModelConfig::load(a.model);
    for (int r = 0; r < a.parallel.world_size(); ++r) plan_shard(config, a.parallel, r);
  }
  return devices;
}

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
      add_parallel_options(sub, a->parallel, a->gpus, "0, 1, 2, ...");
      add_load_format_option(sub, a->load_format);
      sub.add_option("--max-num-batched-tokens", a->max_num_batched_tokens,
                     "model mode: tokens per step the backend is sized for (default 16384, or the longest "
                     "--prefill-lengths); under DP + EP each rank's MoE receive buffer holds dp x this many")
          ->check(CLI::PositiveNumber);
      return [a]() -> int {
        const std::vector<int> devices = check_sharding(*a);
#if RELAY_HAVE_CUDA
        CudaBenchOptions o{a->mode, a->model, a->out, a->quick, a->prefill_lengths, a->decode_batches,
                           a->decode_contexts, a->dtype, a->ranks, a->parallel, devices};
        o.max_num_tokens = a->max_num_batched_tokens;
        o.load_format = a->load_format;
        return run_cuda_bench(o);
#else
        (void)devices;
        std::cerr << "relay bench measures the GPU and needs the CUDA build; this binary was built without "
                     "CUDA (configure with nvcc available and -DRELAY_CUDA=ON)\n";
        return 2;
#endif
      };
    },
    "measure ceilings, kernels and prefill/decode throughput on the GPU (JSON lines); --mode model "
    "takes --tp/--ep/--dp/--gpus as relay generate does",
});

}  // namespace
}  // namespace relay::cli

// `relay bench`: ceilings, kernel figures and end-to-end prefill/decode steps on the GPU
// (engine/cuda_bench.h), and decode through the whole engine — scheduler, backend, speculative
// decoding — on either device (--mode engine; engine/decode_bench.h), which is also what the cpu
// device's model mode measures. A build without CUDA keeps the command so scripts get a clear
// message instead of "unknown command".
//
// The model and engine modes shard their backend with relay generate's --tp / --ep / --dp / --gpus
// (the same options, validation and messages: backend_choice.h, model/shard.h). Every refusal — a
// sharding flag on a mode that measures one GPU, a layout Relay does not run, a --gpus list of the
// wrong length, a split the model does not divide, a flag of the other device or mode, a
// speculative config (parsed as relay serve parses it) the device cannot run — is said here,
// before CUDA starts or a model loads, so it costs no ceiling measurement and reads the same on a
// build or machine without a GPU.
//
// --speculative-config takes relay serve's JSON; decode through the engine reports each shape's
// acceptance rate and mean acceptance length beside its decode rate, and the cuda model mode adds
// a line per decode shape for steps that verify num_speculative_tokens random drafts per sequence
// (engine/cuda_bench.h). --spec-forced-acceptance P
// (the bench only: serve and generate have no such flag) accepts each draft with probability P
// instead of verifying it, so shapes with random weights (make-model presets, --load-format dummy)
// show the speed of speculation at a chosen acceptance; their outputs are noise either way.
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <chrono>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli/backend_choice.h"
#include "cli/command.h"
#include "core/error.h"
#include "core/json.h"
#include "engine/cpu_backend.h"
#include "engine/decode_bench.h"
#include "engine/llm_engine.h"
#include "model/config.h"
#include "model/shard.h"
#include "speculative/speculative.h"
#include "tokenizer/tokenizer.h"
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
  std::string device = "cuda";        // cuda | cpu (whose model mode is the engine mode)
  std::string speculative_config;     // vLLM's --speculative-config JSON (engine mode)
  std::optional<double> forced_acceptance;  // --spec-forced-acceptance, when given
  int decode_tokens = 0;              // engine mode: timed tokens per sequence (0: the default)
  std::string prompt_file;            // engine mode: every request's prompt (instead of contexts)
  int threads = 0;                    // cpu device: threads (0: all cores)
  bool enforce_eager = false;         // engine mode, cuda: no CUDA graphs
};

// Whether the run measures decode through the engine (engine/decode_bench.h): --mode engine on
// either device, and the cpu device's model mode, which is the same thing (the CPU backend has no
// step-level benchmark of its own).
bool through_engine(const BenchArgs& a) { return a.mode == "engine" || a.device == "cpu"; }

// The flags that belong to one device or mode only, and the speculative config: parsed (the parser
// relay serve uses) and checked against the device and mode. Returns the parsed config.
SpeculativeConfig check_device(const BenchArgs& a) {
  const bool engine = through_engine(a);
  const SpeculativeConfig spec = a.speculative_config.empty()
                                     ? SpeculativeConfig{}
                                     : SpeculativeConfig::parse(a.speculative_config);
  if (a.device == "cpu") {
    RELAY_CHECK(a.mode == "model" || a.mode == "engine", "--device cpu measures decode through "
                "the engine (--mode engine, or model) only; --mode ", a.mode, " measures the GPU");
  }
  RELAY_CHECK(!spec.enabled() || engine || a.mode == "model", "--speculative-config measures "
              "decode (--mode engine, or model); --mode ", a.mode, " has none");
  RELAY_CHECK(spec.method != SpeculativeConfig::Method::kMtp || engine, "--speculative-config ",
              spec.describe(), ": --mode model verifies random drafts at a forced acceptance (an "
              "n-gram's form); an MTP head drafts through the engine (--mode engine)");
  RELAY_CHECK(!a.forced_acceptance || spec.enabled(), "--spec-forced-acceptance ",
              *a.forced_acceptance, " sets how often drafts are accepted: it needs "
              "--speculative-config");
  if (engine) {
    RELAY_CHECK(a.prefill_lengths.empty(), "--prefill-lengths: the engine mode measures decode "
                "only (--decode-batches, --decode-contexts, --decode-tokens)");
    RELAY_CHECK(a.prompt_file.empty() || a.decode_contexts.empty(), "--prompt-file ",
                a.prompt_file, " is the context (its tokens); drop --decode-contexts");
    RELAY_CHECK(!a.quick, "--quick picks the GPU benchmark's shapes; decode through the engine "
                "takes --decode-batches, --decode-contexts and --decode-tokens");
  } else {
    RELAY_CHECK(a.decode_tokens == 0, "--decode-tokens sets the timed tokens per sequence of "
                "decode through the engine (--mode engine, or --device cpu); the cuda model mode "
                "times single steps");
  }
  RELAY_CHECK(a.prompt_file.empty() || engine, "--prompt-file gives decode through the engine "
              "its prompt (--mode engine, or --device cpu)");
  RELAY_CHECK(a.threads == 0 || a.device == "cpu",
              "--threads sizes the cpu device's thread pool (add --device cpu)");
  RELAY_CHECK(!a.enforce_eager || (a.mode == "engine" && a.device == "cuda"),
              "--enforce-eager turns CUDA graphs off in the engine mode on the cuda device "
              "(--mode engine --device cuda); the model mode times graph steps and profiles eager "
              "ones itself");
  return spec;
}

// The CUDA device of every model-mode rank (empty for the other modes), or relay::Error naming
// the flag that cannot work.
std::vector<int> check_sharding(const BenchArgs& a) {
  std::string given;  // a sharding flag that was set, as typed (--tp before --ep, --dp, --gpus)
  if (!a.gpus.empty()) given = "--gpus " + a.gpus;
  if (a.parallel.dp != 1) given = str("--dp ", a.parallel.dp);
  if (a.parallel.ep != 1) given = str("--ep ", a.parallel.ep);
  if (a.parallel.tp != 1) given = str("--tp ", a.parallel.tp);
  if (a.mode != "model" && a.mode != "engine") {
    RELAY_CHECK(a.load_format == "auto", "--load-format ", a.load_format,
                " loads the model mode's weights; --mode ", a.mode, " has none");
    RELAY_CHECK(a.max_num_batched_tokens == 0, "--max-num-batched-tokens sizes the model mode's backend; --mode ",
                a.mode, " has none");
    RELAY_CHECK(given.empty(), given, ": --tp, --ep, --dp and --gpus shard the model mode's backend "
                "(relay bench --mode model --model DIR); --mode ", a.mode, " is not sharded",
                a.mode == "collectives" ? " (its GPU count is --ranks)" : "");
    return {};
  }
  RELAY_CHECK(a.ranks == 1, "--ranks ", a.ranks, " is the collectives mode's GPU count; --mode ",
              a.mode, " places its ranks with --tp, --ep, --dp and --gpus");
  RELAY_CHECK(!a.model.empty(), "bench --mode ", a.mode, " needs --model DIR");
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
  if (a.device == "cpu") {
    a.parallel.validate();
    return {};
  }
  std::vector<int> devices = rank_devices(a.parallel, a.gpus, /*first_gpu=*/0);
  if (a.parallel.world_size() > 1) {
    const ModelConfig config = ModelConfig::load(a.model);
    for (int r = 0; r < a.parallel.world_size(); ++r) plan_shard(config, a.parallel, r);
  }
  return devices;
}

// Decode through the engine (--mode engine, or the cpu device's model mode): relay generate's
// backend on --device (cpu_backend_options / cuda_backend_options, with the bench's forced
// acceptance), an engine sized for the largest shape, and one JSON line per shape.
int run_engine_bench(const BenchArgs& a, const SpeculativeConfig& spec) {
  using Clock = std::chrono::steady_clock;
  DecodeBenchOptions d;
  d.batches = a.decode_batches.empty() ? std::vector<int>{1, 8} : a.decode_batches;
  d.contexts = a.decode_contexts.empty() ? std::vector<int>{128} : a.decode_contexts;
  Tokenizer tokenizer = Tokenizer::from_model_dir(a.model);
  if (!a.prompt_file.empty()) {
    d.prompt = tokenizer.encode(read_text_file(a.prompt_file));
    RELAY_CHECK(!d.prompt.empty(), "--prompt-file ", a.prompt_file, ": no tokens (empty file)");
    d.contexts = {static_cast<int>(d.prompt.size())};
  }
  d.num_decode_tokens = a.decode_tokens > 0 ? a.decode_tokens : 32;
  d.speculative = spec;
  // The GPU's one-time costs at a shape's first steps (graph captures, GEMM plans) are not decode.
  d.warmup_runs = a.device == "cuda" ? 1 : 0;
  const int drafts = spec.enabled() ? spec.num_speculative_tokens : 0;
  EngineConfig ec;
  ec.max_num_seqs = *std::max_element(d.batches.begin(), d.batches.end());
  ec.max_num_batched_tokens = a.max_num_batched_tokens > 0
                                  ? a.max_num_batched_tokens
                                  : std::max(2048, ec.max_num_seqs * (1 + drafts));
  ec.speculative = spec;
  BackendChoice choice;
  choice.device = a.device;
  choice.load_format = a.load_format;
  choice.parallel = a.parallel;
  choice.num_threads = a.threads;
  choice.dtype = a.dtype;
  choice.gpus = a.gpus;
  choice.enforce_eager = a.enforce_eager;
  // KV blocks for the largest shape: every sequence's prompt, its tokens and a step of drafts.
  const int max_context = *std::max_element(d.contexts.begin(), d.contexts.end());
  const int tokens_per_seq = max_context + 1 + d.num_decode_tokens + drafts;
  choice.num_kv_blocks = ec.max_num_seqs * a.parallel.dp *
                         ((tokens_per_seq + choice.block_size - 1) / choice.block_size + 1);
  auto make = [&]() -> std::unique_ptr<Backend> {
    if (a.device == "cpu") {
      CpuBackendOptions o = cpu_backend_options(choice, ec.max_num_seqs, spec);
      o.forced_draft_acceptance = a.forced_acceptance;
      return std::make_unique<CpuBackend>(a.model, o);
    }
#if RELAY_HAVE_CUDA
    CudaBackendOptions o =
        cuda_backend_options(choice, ec.max_num_seqs, ec.max_num_batched_tokens, spec);
    o.forced_draft_acceptance = a.forced_acceptance;
    return std::make_unique<CudaBackend>(a.model, o);
#else
    fail("--device cuda: this relay was built without CUDA (no nvcc at build time)");
#endif
  };

  std::ofstream out_file;
  if (!a.out.empty()) {
    out_file.open(a.out, std::ios::app);
    RELAY_CHECK(out_file.good(), "--out ", a.out, ": cannot open for appending");
  }
  auto emit = [&](nlohmann::json j) {
    j["device"] = a.device;
    const std::string line = j.dump();
    std::cout << line << std::endl;
    if (out_file.is_open()) out_file << line << std::endl;
  };
  const Clock::time_point load_start = Clock::now();
  LLMEngine engine(make(), std::move(tokenizer), ec);
  const ModelConfig& c = engine.model_config();
  emit({{"mode", "load"},
        {"model", a.model},
        {"architecture", c.architecture},
        {"layers", c.num_hidden_layers},
        {"load_format", a.load_format},
        {"threads", a.threads},
        {"layout", a.parallel.describe()},
        {"speculative", spec.describe()},
        {"forced_acceptance", a.forced_acceptance ? nlohmann::json(*a.forced_acceptance) : nullptr},
        {"seconds", std::chrono::duration<double>(Clock::now() - load_start).count()}});
  run_decode_bench(engine, d, [&](const nlohmann::json& j) {
    nlohmann::json line = j;
    if (a.forced_acceptance) line["forced_acceptance"] = *a.forced_acceptance;
    emit(std::move(line));
  });
  return 0;
}

CommandRegistrar bench_command({
    "bench",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<BenchArgs>();
      sub.add_option("--mode", a->mode,
                     "ceilings | kernels | model (prefill and decode steps) | engine (decode "
                     "through the whole engine, speculative decoding included) | collectives | "
                     "accuracy (FP8 vs bf16 logits) | all (ceilings, kernels, model)")
          ->check(CLI::IsMember({"ceilings", "kernels", "model", "engine", "collectives", "accuracy", "all"}));
      sub.add_option("--model", a->model, "checkpoint directory for prefill/decode (e.g. from make-model)");
      sub.add_option("--out", a->out, "append the JSON lines to this file too");
      sub.add_flag("--quick", a->quick, "fewer shapes and repetitions");
      sub.add_option("--dtype", a->dtype, "model and engine modes: weight format auto | bf16 | fp8 (as relay serve)")
          ->check(CLI::IsMember({"auto", "bf16", "fp8"}));
      sub.add_option("--prefill-lengths", a->prefill_lengths, "model mode: prompt lengths (default 512,4096,16384)")
          ->delimiter(',')
          ->check(CLI::PositiveNumber);
      sub.add_option("--decode-batches", a->decode_batches, "model and engine modes: decode batch sizes (default 1,8,64,256; engine: 1,8)")
          ->delimiter(',')
          ->check(CLI::Range(1, 512));
      sub.add_option("--decode-contexts", a->decode_contexts, "model and engine modes: decode contexts (default 512,4096; engine: 128)")
          ->delimiter(',')
          ->check(CLI::PositiveNumber);
      sub.add_option("--ranks", a->ranks,
                     "collectives mode: GPUs, one thread each; 1 emulates 2, 4 and 8 peers on GPU 0")
          ->check(CLI::Range(1, 8));
      add_parallel_options(sub, a->parallel, a->gpus, "0, 1, 2, ...");
      add_load_format_option(sub, a->load_format);
      sub.add_option("--device", a->device,
                     "cuda (default) or cpu (the engine mode on the CPU backend; its --mode "
                     "model is the same)")
          ->check(CLI::IsMember({"cuda", "cpu"}));
      sub.add_option("--speculative-config", a->speculative_config,
                     "speculative decoding, relay serve's JSON (vLLM's), e.g. '{\"method\": "
                     "\"mtp\", \"num_speculative_tokens\": 1}': each decode line adds the "
                     "acceptance rate and mean acceptance length (engine mode); the cuda model mode "
                     "adds steps verifying that many random drafts (decode_spec lines)");
      sub.add_option_function<double>(
             "--spec-forced-acceptance", [a](double p) { a->forced_acceptance = p; },
             "accept each draft with this probability instead of verifying it (benchmark only, "
             "not lossless): speculation's speed at a chosen acceptance on models without a "
             "trained draft head, e.g. 0.8")
          ->check(CLI::Range(0.0, 1.0));
      sub.add_flag("--enforce-eager", a->enforce_eager,
                   "engine mode, cuda device: every step eagerly, without CUDA graphs (as relay "
                   "serve --enforce-eager)");
      sub.add_option("--prompt-file", a->prompt_file,
                     "engine mode: every request's prompt, this file's text tokenized (a code "
                     "file to edit, say: n-gram drafting on real text), instead of "
                     "--decode-contexts' synthetic prompts");
      sub.add_option("--decode-tokens", a->decode_tokens,
                     "engine mode: tokens each sequence generates in the timed steps (default 32)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--threads", a->threads, "cpu device: threads (default: all cores)")
          ->check(CLI::NonNegativeNumber);
      sub.add_option("--max-num-batched-tokens", a->max_num_batched_tokens,
                     "model and engine modes: tokens per step the backend is sized for (model default 16384, or the longest "
                     "--prefill-lengths; engine default 2048, or batch x (1 + drafts)); under DP + EP each "
                     "rank's MoE receive buffer holds dp x this many")
          ->check(CLI::PositiveNumber);
      return [a]() -> int {
        const SpeculativeConfig spec = check_device(*a);
        const std::vector<int> devices = check_sharding(*a);
        if (through_engine(*a)) return run_engine_bench(*a, spec);
#if RELAY_HAVE_CUDA
        CudaBenchOptions o;
        o.mode = a->mode;
        o.model_dir = a->model;
        o.out_path = a->out;
        o.quick = a->quick;
        o.prefill_lengths = a->prefill_lengths;
        o.decode_batches = a->decode_batches;
        o.decode_contexts = a->decode_contexts;
        o.dtype = a->dtype;
        o.ranks = a->ranks;
        o.parallel = a->parallel;
        o.devices = devices;
        o.max_num_tokens = a->max_num_batched_tokens;
        o.load_format = a->load_format;
        o.spec_tokens = spec.enabled() ? spec.num_speculative_tokens : 0;
        o.forced_acceptance = a->forced_acceptance;
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
    "and engine take --tp/--ep/--dp/--gpus as relay generate does; --mode engine (and --device cpu) "
    "measures decode through the engine (--speculative-config: acceptance rate and length)",
});

}  // namespace
}  // namespace relay::cli

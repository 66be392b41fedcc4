// See backend_choice.h.
#include "cli/backend_choice.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "engine/cpu_backend.h"
#include "engine/cuda_backend.h"

namespace relay::cli {

void add_backend_options(CLI::App& sub, BackendChoice& c) {
  sub.add_option("--device", c.device, "compute backend: cpu (exact fp32) or cuda (default cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  sub.add_option("--dtype", c.dtype,
                 "cuda weight format: auto (as the checkpoint stores them), bf16 (an FP8 "
                 "checkpoint dequantised at load) or fp8 (block-scaled FP8; a bf16 checkpoint "
                 "quantised at load). The cpu device always computes in fp32 (default auto)")
      ->check(CLI::IsMember({"auto", "bf16", "fp8"}));
  sub.add_flag("--enforce-eager", c.enforce_eager,
               "cuda: run every step eagerly, without CUDA graphs (slower at small batches; for "
               "debugging and comparisons)");
  add_load_format_option(sub, c.load_format);
  sub.add_option("--block-size", c.block_size, "tokens per KV block (default 16)")
      ->check(CLI::PositiveNumber);
  sub.add_option("--num-kv-blocks", c.num_kv_blocks,
                 "exact KV pool size in blocks (overrides --kv-cache-memory)")
      ->check(CLI::PositiveNumber);
  sub.add_option(
      "--kv-cache-memory", c.kv_cache_memory,
      "CPU KV pool size, e.g. 512MiB or 2GiB (default 256MiB; cuda uses the memory left)");
  sub.add_option("--threads", c.num_threads, "CPU threads for the cpu device (default: all cores)");
  sub.add_option(
         "--gpu", c.gpu,
         "CUDA device of rank 0 for the cuda device; rank r runs on --gpu + r unless --gpus "
         "lists the devices (default 0)")
      ->check(CLI::NonNegativeNumber);
  add_parallel_options(sub, c.parallel, c.gpus, "--gpu, --gpu + 1, ...");
  sub.add_option("--nnodes", c.nodes.nnodes,
                 "cpu: processes (on one host or several) the --tp x --dp ranks are spread over, "
                 "each started with the same flags and its own --node-rank (default 1)")
      ->check(CLI::PositiveNumber);
  sub.add_option("--node-rank", c.nodes.node_rank,
                 "this process's node, 0..--nnodes-1; node 0 runs the engine and the server, the "
                 "others follow it (default 0)")
      ->check(CLI::NonNegativeNumber);
  sub.add_option("--dist-init", c.nodes.dist_init,
                 "HOST:PORT node 0 listens on and the other nodes connect to (with --nnodes)");
}

void add_load_format_option(CLI::App& sub, std::string& load_format) {
  sub.add_option("--load-format", load_format,
                 "auto (the model directory's safetensors) or dummy (random weights made at load "
                 "from its config.json: for speed measurements; see make-model --config-only) "
                 "(default auto)")
      ->check(CLI::IsMember({"auto", "dummy"}));
}

void add_parallel_options(CLI::App& sub, parallel::ParallelConfig& parallel, std::string& gpus,
                          const std::string& gpus_default) {
  sub.add_option(
      "--gpus", gpus,
      "cuda: the device of each --tp x --dp rank, in rank order, e.g. 0,1,2,3 (default " +
          gpus_default + "); a device may repeat, its ranks then share it");
  sub.add_option("--tp", parallel.tp,
                 "tensor-parallel ranks: attention heads, MLP widths split (default 1)")
      ->check(CLI::PositiveNumber);
  sub.add_option("--ep", parallel.ep,
                 "expert-parallel ranks: 1 or --tp x --dp, experts divided (default 1)")
      ->check(CLI::PositiveNumber);
  sub.add_option(
         "--dp", parallel.dp,
         "data-parallel attention ranks, each with its own requests and KV cache (default 1)")
      ->check(CLI::PositiveNumber);
}

std::vector<int> rank_devices(const parallel::ParallelConfig& parallel, const std::string& gpus,
                              int first_gpu) {
  parallel.validate();
  const int world = parallel.world_size();
  std::vector<int> devices;
  if (gpus.empty()) {
    for (int r = 0; r < world; ++r) devices.push_back(first_gpu + r);
    return devices;
  }
  devices = parse_device_list(gpus, "--gpus");
  // The message the CUDA backend gives (cuda_backend.cu), said before CUDA starts.
  RELAY_CHECK(static_cast<int>(devices.size()) == world, "--gpus lists ", devices.size(),
              " devices for ", world, " ranks (", parallel.describe(), ")");
  return devices;
}

std::vector<int> parse_device_list(const std::string& text, const std::string& option) {
  std::vector<int> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    size_t used = 0;
    int v = -1;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    RELAY_CHECK(!item.empty() && used == item.size() && v >= 0, option, ": '", item, "' in '", text,
                "' is not a device index (expected a comma-separated list such as 0,1,2,3)");
    out.push_back(v);
    at = comma + 1;
  }
  return out;
}

size_t parse_bytes(const std::string& text, const std::string& option) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    fail(str(option, ": cannot read a size from '", text, "'"));
  }
  const std::string unit = text.substr(pos);
  double scale = 1;
  if (unit == "K" || unit == "KiB" || unit == "KB") {
    scale = 1024.0;
  } else if (unit == "M" || unit == "MiB" || unit == "MB") {
    scale = 1024.0 * 1024;
  } else if (unit == "G" || unit == "GiB" || unit == "GB") {
    scale = 1024.0 * 1024 * 1024;
  } else if (unit != "" && unit != "B") {
    fail(str(option, ": unknown unit '", unit, "' in '", text, "' (use B, KiB, MiB or GiB)"));
  }
  RELAY_CHECK(v > 0, option, " must be positive, got '", text, "'");
  return static_cast<size_t>(v * scale);
}

CpuBackendOptions cpu_backend_options(const BackendChoice& c, int max_num_seqs,
                                      const SpeculativeConfig& speculative,
                                      int num_state_snapshots) {
  RELAY_CHECK(c.gpus.empty(), "--gpus places ranks on CUDA devices; it needs --device cuda");
  RELAY_CHECK(c.dtype == "auto", "--dtype ", c.dtype,
              " is a GPU weight format; the cpu device computes in fp32 (FP8 checkpoints are "
              "dequantised at load): leave --dtype at auto or use --device cuda");
  RELAY_CHECK(!c.enforce_eager, "--enforce-eager turns the cuda device's CUDA graphs off; the cpu "
              "device has none: leave it out or use --device cuda");
  CpuBackendOptions o;
  o.block_size = c.block_size;
  o.num_blocks = c.num_kv_blocks;
  o.kv_cache_bytes = parse_bytes(c.kv_cache_memory, "--kv-cache-memory");
  o.num_threads = c.num_threads;
  o.parallel = c.parallel;
  o.nodes = c.nodes;
  o.load_format = parse_load_format(c.load_format);
  const int drafts = speculative.enabled() ? speculative.num_speculative_tokens : 0;
  o.num_state_slots = max_num_seqs * (1 + drafts);
  o.num_state_snapshots = num_state_snapshots;
  if (speculative.method == SpeculativeConfig::Method::kMtp) {
    o.mtp = {.enabled = true, .dir = speculative.model};
    o.num_mtp_drafts = drafts;
  }
  return o;
}

int follow_leader(const std::string& model_dir, const BackendChoice& c, int max_num_seqs,
                  const SpeculativeConfig& speculative, int num_state_snapshots) {
  c.parallel.validate();
  c.nodes.validate(c.parallel);
  RELAY_CHECK(c.device == "cpu",
              "--nnodes: multi-node workers run on the cpu device; the cuda "
              "device runs every rank as a thread of one process (use --gpus)");
  CpuBackend backend(model_dir,
                     cpu_backend_options(c, max_num_seqs, speculative, num_state_snapshots));
  std::fprintf(stderr, "relay: node %d of %d loaded its ranks; following node 0 at %s\n",
               c.nodes.node_rank, c.nodes.nnodes, c.nodes.dist_init.c_str());
  backend.follow();
  std::fprintf(stderr, "relay: node 0 shut the worker down\n");
  return 0;
}

std::unique_ptr<Backend> make_backend(const std::string& model_dir, const BackendChoice& c,
                                      int max_num_seqs, int max_num_batched_tokens,
                                      const SpeculativeConfig& speculative,
                                      int num_state_snapshots) {
  c.parallel.validate();
  c.nodes.validate(c.parallel);
  if (c.device == "cuda") {
    RELAY_CHECK(c.nodes.nnodes == 1,
                "--nnodes: multi-node workers run on the cpu device; the "
                "cuda device runs every rank as a thread of one process (use --gpus)");
#if RELAY_HAVE_CUDA
    return std::make_unique<CudaBackend>(
        model_dir, cuda_backend_options(c, max_num_seqs, max_num_batched_tokens, speculative,
                                        num_state_snapshots));
#else
    fail("--device cuda: this relay was built without CUDA (no nvcc at build time)");
#endif
  }
  RELAY_CHECK(!is_follower_node(c), "node ", c.nodes.node_rank,
              " of a multi-node worker follows node 0 (follow_leader); it builds no engine");
  return std::make_unique<CpuBackend>(model_dir,
                                      cpu_backend_options(c, max_num_seqs, speculative,
                                                          num_state_snapshots));
}

CudaBackendOptions cuda_backend_options(const BackendChoice& c, int max_num_seqs,
                                        int max_num_batched_tokens,
                                        const SpeculativeConfig& speculative,
                                        int num_state_snapshots) {
  CudaBackendOptions o;
  o.device = c.gpu;
  if (!c.gpus.empty()) o.devices = parse_device_list(c.gpus, "--gpus");
  o.parallel = c.parallel;
  o.weights = c.dtype == "fp8"    ? WeightFormat::kFp8
              : c.dtype == "bf16" ? WeightFormat::kBf16
                                  : WeightFormat::kAuto;
  o.block_size = c.block_size;
  o.num_kv_blocks = c.num_kv_blocks;
  o.load_format = parse_load_format(c.load_format);
  o.cuda_graphs = !c.enforce_eager;
  o.max_num_seqs = max_num_seqs;
  o.max_num_tokens = max_num_batched_tokens;
  o.max_draft_tokens = speculative.enabled() ? speculative.num_speculative_tokens : 0;
  // Hybrid models only (the backend ignores them otherwise), as cpu_backend_options sizes them.
  o.num_state_slots = max_num_seqs * (1 + o.max_draft_tokens);
  o.num_state_snapshots = num_state_snapshots;
  if (speculative.method == SpeculativeConfig::Method::kMtp) {
    o.mtp = {.enabled = true, .dir = speculative.model};
    o.num_mtp_drafts = o.max_draft_tokens;
  }
  return o;
}


}  // namespace relay::cli

// Choosing and building the compute backend for the commands that run the engine (serve, generate).
//
// `--device cpu` (the default) is the exact fp32 CPU backend; `--device cuda` the GPU backend,
// which exists only in builds made with nvcc: asking for it elsewhere is an error that says so,
// never a silent fall back to the CPU.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "engine/backend.h"
#include "engine/cpu_backend.h"
#include "engine/cuda_backend.h"
#include "parallel/parallel_config.h"
#include "speculative/speculative.h"

namespace relay::cli {

struct BackendChoice {
  std::string device = "cpu";              // "cpu" or "cuda"
  int block_size = 16;                     // tokens per KV block
  int num_kv_blocks = 0;                   // > 0: exactly this many blocks
  std::string kv_cache_memory = "256MiB";  // CPU pool budget (CUDA takes the memory left)
  int num_threads = 0;                     // CPU threads (0: all cores)
  int gpu = 0;                             // CUDA device index (of rank 0; rank r on gpu + r)
  std::string gpus;                        // "0,1,2,3": the CUDA device of each rank, in rank order
  std::string dtype = "auto";              // cuda weights: auto (as stored), bf16 or fp8
  std::string load_format = "auto";        // auto (the safetensors) or dummy (random weights)
  bool enforce_eager = false;              // cuda: no CUDA graphs (vLLM's --enforce-eager)
  parallel::ParallelConfig parallel;       // --tp / --ep / --dp ranks
  parallel::NodeConfig nodes;              // --nnodes / --node-rank / --dist-init (cpu device)
};

// Adds --device, --dtype, --enforce-eager, --block-size, --num-kv-blocks, --kv-cache-memory,
// --threads, --gpu, --gpus, --tp, --ep, --dp, --nnodes, --node-rank and --dist-init to `sub`.
void add_backend_options(CLI::App& sub, BackendChoice& choice);
// Adds --load-format (auto | dummy), for the commands that load a model.
void add_load_format_option(CLI::App& sub, std::string& load_format);
// Adds only --tp, --ep, --dp and --gpus (what add_backend_options adds for them), for commands
// that shard a CUDA backend without the rest of the backend flags (`relay bench --mode model`);
// `gpus_default` ends the --gpus help: where the ranks go without it.
void add_parallel_options(CLI::App& sub, parallel::ParallelConfig& parallel, std::string& gpus,
                          const std::string& gpus_default);
// The CUDA device of every rank of `parallel` (validated first): --gpus parsed, with one device
// per rank, else first_gpu + r. Throws relay::Error naming the flag, as the CUDA backend does, but
// without touching CUDA, so a command can refuse a bad layout before it starts the GPU.
std::vector<int> rank_devices(const parallel::ParallelConfig& parallel, const std::string& gpus,
                              int first_gpu);
// Loads the model on the chosen device; `max_num_seqs` and `max_num_batched_tokens` size the GPU
// backend's per-step buffers and graphs. With `speculative` (--speculative-config) a hybrid
// model's recurrent-state slots are max_num_seqs * (1 + num_speculative_tokens) per DP rank, so
// every running sequence has its state and a scratch state per draft, and method "mtp" loads the
// MTP head (the checkpoint's mtp.* or speculative.model). `num_state_snapshots`: a hybrid model's
// recurrent-state snapshots per DP rank for prefix caching (the cpu device; 0: none).
std::unique_ptr<Backend> make_backend(const std::string& model_dir, const BackendChoice& choice,
                                      int max_num_seqs, int max_num_batched_tokens,
                                      const SpeculativeConfig& speculative = {},
                                      int num_state_snapshots = 0);
// The cuda device's backend options, as make_backend builds them (sized for the drafts of
// `speculative`, its MTP head included, and the hybrids' state slots and snapshots); relay bench
// adds its benchmark-only settings to them. Builds without CUDA have the options but no backend
// to take them.
CudaBackendOptions cuda_backend_options(const BackendChoice& choice, int max_num_seqs,
                                        int max_num_batched_tokens,
                                        const SpeculativeConfig& speculative,
                                        int num_state_snapshots = 0);
// The cpu device's backend options, as make_backend builds them (the state slots, snapshots and MTP
// head of `speculative` included); relay bench adds its benchmark-only settings to them.
CpuBackendOptions cpu_backend_options(const BackendChoice& choice, int max_num_seqs,
                                      const SpeculativeConfig& speculative,
                                      int num_state_snapshots = 0);
// True for nodes 1.. of a multi-node worker (--node-rank > 0): they run no engine of their own.
inline bool is_follower_node(const BackendChoice& choice) { return choice.nodes.node_rank > 0; }
// A follower node: loads its ranks with the options node 0's make_backend gets (the same pools,
// state slots and MTP head), runs node 0's steps until node 0 shuts the worker down, and returns
// the exit code (0; a lost leader is a relay::Error).
int follow_leader(const std::string& model_dir, const BackendChoice& choice, int max_num_seqs,
                  const SpeculativeConfig& speculative = {}, int num_state_snapshots = 0);
// "0,1,1" -> {0, 1, 1}; `option` names the flag in errors.
std::vector<int> parse_device_list(const std::string& text, const std::string& option);
// "512MiB", "2G", "1.5GiB", "1000000" -> bytes; `option` names the flag in errors.
size_t parse_bytes(const std::string& text, const std::string& option);

}  // namespace relay::cli

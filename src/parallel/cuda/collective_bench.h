// The collective benchmark: all-reduce latency against message size (Relay's one-shot and two-shot
// against NCCL) and MoE dispatch/combine latency, as JSON records.
//
// With num_ranks >= 2 it runs one thread per GPU (GPUs 0..num_ranks-1) in this process, sharing the
// ncclUniqueId in memory; every rank times the same sequence with CUDA events and a record reports
// the slowest rank. With num_ranks = 1 there are no peers, so it emulates each group size of
// `emulated_ranks` on GPU 0 (all ranks in one launch, see all_reduce.h): that measures the kernels'
// own cost — barriers, launch, HBM traffic — not NVLink, and every record says "emulated": true.
// NCCL needs real peers and is skipped there.
//
// Records (one emit call each):
//   {"kind":"all_reduce","algorithm":"one-shot|two-shot|nccl","ranks":N,"emulated":b,"dtype":"bf16",
//    "bytes":B,"latency_us":t,"bus_bandwidth_gbps":2(N-1)/N B/t}
//   {"kind":"moe_dispatch_combine","ranks":N,"emulated":b,"tokens_per_rank":T,"hidden":H,"top_k":k,
//    "num_experts":E,"dispatch_us":t1,"dispatch_combine_us":t2}
//   {"kind":"note","message":...} for what was skipped and why.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <functional>
#include <vector>

namespace relay::parallel::cuda {

struct CollectiveBenchOptions {
  int num_ranks = 1;  // GPUs, one thread each; 1 = emulated peers on GPU 0
  std::vector<int> emulated_ranks = {2, 4, 8};
  std::vector<size_t> sizes_bytes = {size_t{4} << 10,   size_t{16} << 10, size_t{64} << 10,
                                     size_t{256} << 10, size_t{1} << 20,  size_t{4} << 20,
                                     size_t{16} << 20,  size_t{64} << 20};
  int warmup = 5;
  int iterations = 50;
  std::vector<int> tokens_per_rank = {1, 128};
  int hidden = 4096;  // Qwen3-235B-A22B
  int top_k = 8;
  int num_experts = 128;
};

// Throws relay::Error for options the machine cannot run (more ranks than GPUs, ...).
void run_collective_bench(const CollectiveBenchOptions& opt,
                          const std::function<void(const nlohmann::json&)>& emit);

}  // namespace relay::parallel::cuda

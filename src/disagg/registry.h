// The router's view of its workers: who is up, how loaded, whom to send the next request to, and
// how many replicas the load calls for. Pure CPU code (no I/O), unit-tested with explicit clocks.
//
// Workers announce themselves with heartbeats (the first one registers them); a worker whose last
// heartbeat is older than the timeout, or that the router saw fail, is down until it beats again —
// so a restarted worker is used again as soon as it re-joins. Between heartbeats the router adds
// what it has just sent a worker to that worker's reported load, so a burst of requests spreads
// instead of all picking the worker that looked idle a second ago.
//
// Picks follow the design: prefill -> the worker with the fewest queued prompt tokens; decode ->
// the one with the smallest batch (running + waiting) relative to its max_num_seqs, so a larger
// decoder takes proportionally more. Autoscaling signals (exported as metrics for
// an orchestrator such as a Kubernetes HPA, docs/disaggregation.md):
//   prefill_replicas_needed = ceil(prompt tokens/s arriving / prefill tokens/s one worker
//   sustains), decode_replicas_needed  = ceil(sequences in decode / target batch per decode
//   worker).
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace relay::disagg {

using Clock = std::chrono::steady_clock;

// What a heartbeat reports: the worker's load, and its capacity and layout (fixed for its life).
struct WorkerLoad {
  int num_running = 0;
  int num_waiting = 0;
  double kv_cache_usage = 0.0;
  int64_t queued_prompt_tokens = 0;  // prefill: prompts accepted and not yet handed off
  int64_t prefill_tokens_total = 0;  // prefill: prompt tokens handed off since start
  int max_num_seqs = 0;              // sequences it batches at once (0: unknown)
  int num_kv_blocks = 0;             // its KV pool, all DP ranks
  int block_size = 0;
  std::string layout;        // its ranks, e.g. "tp=2 ep=1 dp=1"
  std::string kv_transport;  // how its KV pages move: "ucx", "cuda_ipc"
};

struct WorkerState {
  std::string url;
  std::string role;  // "prefill" or "decode"
  WorkerLoad load;   // as last reported
  bool up = false;
  Clock::time_point last_seen;
  int64_t pending_tokens = 0;              // prompt tokens sent since the last heartbeat (prefill)
  int pending_seqs = 0;                    // sequences sent since the last heartbeat (decode)
  double peak_prefill_tokens_per_s = 0.0;  // the highest rate measured between two heartbeats
};

struct AutoscaleSignals {
  int prefill_workers_up = 0;
  int decode_workers_up = 0;
  double prompt_tokens_per_s = 0.0;            // arriving at the router, over the rate window
  double prefill_capacity_tokens_per_s = 0.0;  // per worker: configured, else the best measured
  int prefill_replicas_needed = 0;
  int decode_sequences = 0;
  int decode_replicas_needed = 0;
};

struct RegistryOptions {
  std::chrono::milliseconds heartbeat_timeout{3000};  // missed beats before a worker is down
  std::chrono::milliseconds rate_window{30000};       // prompt token rate averaging window
  double prefill_capacity_tokens_per_s = 0.0;         // 0: measure it from the workers' beats
  int decode_target_batch = 32;                       // sequences per decode worker before scaling
};

class WorkerRegistry {
 public:
  explicit WorkerRegistry(RegistryOptions options = {});

  // Registers or refreshes a worker; throws relay::Error for an unknown role or empty url.
  void heartbeat(const std::string& url, const std::string& role, const WorkerLoad& load,
                 Clock::time_point now);
  // The least loaded worker of `role` that is up and not in `exclude`.
  std::optional<std::string> pick(const std::string& role, Clock::time_point now,
                                  const std::set<std::string>& exclude = {});
  // The router just sent `url` a prompt of `prompt_tokens` (prefill) or a sequence (decode).
  void assigned(const std::string& url, int64_t prompt_tokens);
  // The router saw `url` fail: down until its next heartbeat.
  void mark_down(const std::string& url);
  // A prompt of `tokens` tokens arrived (for the prompt-token rate).
  void record_prompt(int64_t tokens, Clock::time_point now);

  std::vector<WorkerState> workers(Clock::time_point now) const;
  AutoscaleSignals signals(Clock::time_point now) const;
  // Workers of `role` that are up now.
  int num_up(const std::string& role, Clock::time_point now) const;

 private:
  bool is_up(const WorkerState& w, Clock::time_point now) const;

  RegistryOptions options_;
  mutable std::mutex mu_;
  std::map<std::string, WorkerState> workers_;
  std::deque<std::pair<Clock::time_point, int64_t>> prompts_;  // arrivals inside the rate window
};

}  // namespace relay::disagg

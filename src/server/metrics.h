// Serving metrics in the Prometheus text format, with vLLM's names and meanings under "relay:".
//
// Counters and histograms are updated by the engine thread (per step and per finished request) and
// by HTTP threads (requests rejected before the engine); gauges are sampled from the engine after
// each step. One mutex guards everything: updates are a handful per step, far below contention.
// Every series carries model_name, as vLLM's do, so dashboards built for vLLM work unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "speculative/speculative.h"

namespace relay::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}
  void observe(double v);
  // Appends the _bucket/_sum/_count lines for metric `name` with the label string `labels`.
  void render(std::string& out, const std::string& name, const std::string& labels) const;
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); the last is +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

struct EngineGauges {
  int num_running = 0;
  int num_waiting = 0;
  double kv_cache_usage = 0.0;  // 0..1
  double state_slot_usage = 0.0;  // 0..1, hybrid models' recurrent-state slots
  int cached_state_snapshots = 0;  // hybrid prefix caching: snapshots a prefix hit could use now
  uint64_t num_preemptions = 0;
  uint64_t prefix_cache_queries = 0;
  uint64_t prefix_cache_hits = 0;
  SpecDecodeStats spec_decode{};  // speculative decoding's counters (zero without it)
};

// Where an engine step's wall time went, in seconds; the phases add up to the step's time.
struct StepPhases {
  double schedule_s = 0.0;  // scheduling and building the batch
  double forward_s = 0.0;   // the backend's forward pass and sampling
  double outputs_s = 0.0;   // detokenization, stop checks, finishing requests
  double handoff_s = 0.0;   // handing the outputs to the delivery thread (waiting for it if behind)
};

class Metrics {
 public:
  explicit Metrics(std::string model_name);

  void set_engine(const EngineGauges& g);
  void add_tokens(uint64_t prompt, uint64_t generation);
  // One finished request; reason is "stop", "length", "abort" or "error".
  void request_finished(const std::string& reason, double e2e_s, double queue_s);
  void observe_ttft(double s);
  void observe_itl(double s);
  void request_rejected(int status);
  // One engine iteration that ran a step: its wall time on the engine thread (scheduling, the
  // forward pass, sampling, output processing and handing the outputs to the delivery thread) and
  // batch size, and that time split into its phases. Decode-only steps (every sequence one token)
  // are counted apart from steps that carry prefill chunks, so decode throughput at a batch size
  // reads as relay:engine_step_sequences_total / relay:engine_step_seconds_total{kind="decode"}.
  void observe_step(bool decode_only, int num_seqs, double seconds, const StepPhases& phases = {});
  // The delivery thread's work for one step's outputs (latency metrics, queue pushes, wakeups),
  // which overlaps the engine's next step.
  void observe_delivery(int num_outputs, double seconds);

  EngineGauges engine() const;
  std::string render() const;
  // Lines appended to every render (a router's worker and autoscaling gauges); `labels` is the
  // model_name label string every series carries. Set once, before serving.
  void set_extra(std::function<std::string(const std::string& labels)> extra);

 private:
  mutable std::mutex mu_;
  std::string model_name_;
  EngineGauges engine_;
  uint64_t prompt_tokens_ = 0;
  uint64_t generation_tokens_ = 0;
  std::map<std::string, uint64_t> finished_;  // by finished_reason
  std::map<int, uint64_t> rejected_;          // by HTTP status
  struct StepCounters {
    uint64_t steps = 0, sequences = 0;
    double seconds = 0.0;
    StepPhases phases;  // summed
  };
  StepCounters decode_steps_, mixed_steps_;
  uint64_t delivered_outputs_ = 0;
  double delivery_seconds_ = 0.0;
  Histogram ttft_;
  Histogram itl_;
  Histogram e2e_;
  Histogram queue_;
  std::function<std::string(const std::string&)> extra_;
};

}  // namespace relay::server

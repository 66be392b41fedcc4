// Prometheus text rendering of the serving metrics (see metrics.h).
#include "server/metrics.h"

#include <algorithm>
#include <charconv>

namespace relay::server {

namespace {

// vLLM's bucket bounds for the same histograms.
const std::vector<double> kTtftBounds = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                         0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                         20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kItlBounds = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                        0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
const std::vector<double> kRequestBounds = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                            5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                            60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

// Shortest text that reads back as the same double ("0.04", not "0.040000000000000001").
std::string num(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

}  // namespace

void Histogram::observe(double v) {
  const size_t i =
      static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    const std::string le = i < bounds_.size() ? num(bounds_[i]) : "+Inf";
    out += name + "_bucket{" + labels + ",le=\"" + le + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_sum{" + labels + "} " + num(sum_) + "\n";
  out += name + "_count{" + labels + "} " + std::to_string(count_) + "\n";
}

Metrics::Metrics(std::string model_name)
    : model_name_(std::move(model_name)),
      ttft_(kTtftBounds),
      itl_(kItlBounds),
      e2e_(kRequestBounds),
      queue_(kRequestBounds) {}

void Metrics::set_engine(const EngineGauges& g) {
  std::lock_guard lock(mu_);
  engine_ = g;
}

EngineGauges Metrics::engine() const {
  std::lock_guard lock(mu_);
  return engine_;
}

void Metrics::add_tokens(uint64_t prompt, uint64_t generation) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += prompt;
  generation_tokens_ += generation;
}

void Metrics::request_finished(const std::string& reason, double e2e_s, double queue_s) {
  std::lock_guard lock(mu_);
  ++finished_[reason];
  e2e_.observe(e2e_s);
  queue_.observe(queue_s);
}

void Metrics::observe_ttft(double s) {
  std::lock_guard lock(mu_);
  ttft_.observe(s);
}

void Metrics::observe_itl(double s) {
  std::lock_guard lock(mu_);
  itl_.observe(s);
}

void Metrics::observe_step(bool decode_only, int num_seqs, double seconds,
                           const StepPhases& phases) {
  std::lock_guard lock(mu_);
  StepCounters& c = decode_only ? decode_steps_ : mixed_steps_;
  ++c.steps;
  c.sequences += static_cast<uint64_t>(num_seqs);
  c.seconds += seconds;
  c.phases.schedule_s += phases.schedule_s;
  c.phases.forward_s += phases.forward_s;
  c.phases.outputs_s += phases.outputs_s;
  c.phases.handoff_s += phases.handoff_s;
}

void Metrics::observe_delivery(int num_outputs, double seconds) {
  std::lock_guard lock(mu_);
  delivered_outputs_ += static_cast<uint64_t>(num_outputs);
  delivery_seconds_ += seconds;
}

void Metrics::request_rejected(int status) {
  std::lock_guard lock(mu_);
  ++rejected_[status];
}

std::string Metrics::render() const {
  std::lock_guard lock(mu_);
  const std::string model = "model_name=\"" + model_name_ + "\"";
  std::string out;
  auto gauge = [&](const std::string& name, const char* help, double v) {
    header(out, name, "gauge", help);
    out += name + "{" + model + "} " + num(v) + "\n";
  };
  auto counter = [&](const std::string& name, const char* help, uint64_t v) {
    header(out, name, "counter", help);
    out += name + "{" + model + "} " + std::to_string(v) + "\n";
  };
  gauge("relay:num_requests_running", "Number of requests in model execution batches.",
        engine_.num_running);
  gauge("relay:num_requests_waiting", "Number of requests waiting to be processed.",
        engine_.num_waiting);
  gauge("relay:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
        engine_.kv_cache_usage);
  gauge("relay:state_slot_usage_perc",
        "Recurrent-state slot usage of linear-attention layers (hybrid models; 0 otherwise). 1 "
        "means 100 percent usage.",
        engine_.state_slot_usage);
  gauge("relay:state_snapshots_cached",
        "Recurrent-state snapshots at block boundaries that a prefix-cache hit of a hybrid model "
        "could restore now (0 otherwise).",
        engine_.cached_state_snapshots);
  counter("relay:num_preemptions_total", "Cumulative number of preemptions.",
          engine_.num_preemptions);
  counter("relay:prefix_cache_queries_total", "Prefix cache queries, in queried tokens.",
          engine_.prefix_cache_queries);
  counter("relay:prefix_cache_hits_total", "Prefix cache hits, in cached tokens.",
          engine_.prefix_cache_hits);
  // Speculative decoding, vLLM's spec_decode_* counters (all zero when it is off).
  const SpecDecodeStats& spec = engine_.spec_decode;
  counter("relay:spec_decode_num_drafts_total", "Number of spec decoding drafts.", spec.num_drafts);
  counter("relay:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
          spec.num_draft_tokens);
  counter("relay:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
          spec.num_accepted_tokens);
  header(out, "relay:spec_decode_num_accepted_tokens_per_pos_total", "counter",
         "Accepted tokens per draft position.");
  for (size_t pos = 0; pos < spec.num_accepted_tokens_per_pos.size(); ++pos) {
    out += "relay:spec_decode_num_accepted_tokens_per_pos_total{" + model + ",position=\"" +
           std::to_string(pos) + "\"} " + std::to_string(spec.num_accepted_tokens_per_pos[pos]) +
           "\n";
  }
  counter("relay:prompt_tokens_total", "Number of prefill tokens processed.", prompt_tokens_);
  counter("relay:generation_tokens_total", "Number of generation tokens processed.",
          generation_tokens_);

  header(out, "relay:request_success_total", "counter",
         "Count of finished requests by finish reason.");
  for (const char* reason : {"stop", "length", "abort", "error"}) {
    const auto it = finished_.find(reason);
    out += "relay:request_success_total{" + model + ",finished_reason=\"" + reason + "\"} " +
           std::to_string(it == finished_.end() ? 0 : it->second) + "\n";
  }
  header(out, "relay:request_rejected_total", "counter",
         "Requests answered with an HTTP error, by status.");
  for (const auto& [status, n] : rejected_) {
    out += "relay:request_rejected_total{" + model + ",status=\"" + std::to_string(status) +
           "\"} " + std::to_string(n) + "\n";
  }
  auto step_counter = [&](const std::string& name, const char* help, auto field) {
    header(out, name, "counter", help);
    const std::pair<const char*, const StepCounters*> kinds[] = {{"decode", &decode_steps_},
                                                                 {"mixed", &mixed_steps_}};
    for (const auto& [kind, c] : kinds) {
      out += name + "{" + model + ",kind=\"" + kind + "\"} " + num(field(*c)) + "\n";
    }
  };
  step_counter("relay:engine_steps_total",
               "Engine steps; kind decode: every sequence one token, mixed: prefill chunks too.",
               [](const StepCounters& c) { return double(c.steps); });
  step_counter("relay:engine_step_sequences_total", "Sequences summed over engine steps.",
               [](const StepCounters& c) { return double(c.sequences); });
  step_counter("relay:engine_step_seconds_total",
               "Wall time of engine steps on the engine thread: scheduling, forward, sampling, "
               "output processing and the hand-off to delivery.",
               [](const StepCounters& c) { return c.seconds; });
  header(out, "relay:engine_step_phase_seconds_total", "counter",
         "Engine step wall time by phase: schedule, forward, outputs (detokenize, stop checks), "
         "handoff (to the delivery thread).");
  for (const auto& [kind, c] :
       {std::pair<const char*, const StepCounters*>{"decode", &decode_steps_},
        {"mixed", &mixed_steps_}}) {
    const std::pair<const char*, double> phases[] = {{"schedule", c->phases.schedule_s},
                                                     {"forward", c->phases.forward_s},
                                                     {"outputs", c->phases.outputs_s},
                                                     {"handoff", c->phases.handoff_s}};
    for (const auto& [phase, seconds] : phases) {
      out += "relay:engine_step_phase_seconds_total{" + model + ",kind=\"" + kind + "\",phase=\"" +
             phase + "\"} " + num(seconds) + "\n";
    }
  }
  counter("relay:output_deliveries_total",
          "Outputs handed to request streams by the delivery thread.", delivered_outputs_);
  header(
      out, "relay:output_delivery_seconds_total", "counter",
      "Delivery thread time: latency metrics, queue pushes and wakeups; overlaps the next step.");
  out += "relay:output_delivery_seconds_total{" + model + "} " + num(delivery_seconds_) + "\n";
  header(out, "relay:time_to_first_token_seconds", "histogram",
         "Histogram of time to first token in seconds.");
  ttft_.render(out, "relay:time_to_first_token_seconds", model);
  header(out, "relay:inter_token_latency_seconds", "histogram",
         "Histogram of inter-token latency in seconds.");
  itl_.render(out, "relay:inter_token_latency_seconds", model);
  header(out, "relay:e2e_request_latency_seconds", "histogram",
         "Histogram of end to end request latency in seconds.");
  e2e_.render(out, "relay:e2e_request_latency_seconds", model);
  header(out, "relay:request_queue_time_seconds", "histogram",
         "Histogram of time spent waiting in the queue in seconds.");
  queue_.render(out, "relay:request_queue_time_seconds", model);
  if (extra_) out += extra_(model);
  return out;
}

void Metrics::set_extra(std::function<std::string(const std::string& labels)> extra) {
  std::lock_guard lock(mu_);
  extra_ = std::move(extra);
}

}  // namespace relay::server

// See registry.h.
#include "disagg/registry.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace relay::disagg {

WorkerRegistry::WorkerRegistry(RegistryOptions options) : options_(options) {}

int WorkerRegistry::num_up(const std::string& role, Clock::time_point now) const {
  std::lock_guard lock(mu_);
  int n = 0;
  for (const auto& [url, w] : workers_) n += w.role == role && is_up(w, now);
  return n;
}

bool WorkerRegistry::is_up(const WorkerState& w, Clock::time_point now) const {
  return w.up && now - w.last_seen <= options_.heartbeat_timeout;
}

void WorkerRegistry::heartbeat(const std::string& url, const std::string& role,
                               const WorkerLoad& load, Clock::time_point now) {
  RELAY_CHECK(!url.empty(), "heartbeat: empty worker url");
  RELAY_CHECK(role == "prefill" || role == "decode", "heartbeat: unknown role '", role, "'");
  std::lock_guard lock(mu_);
  WorkerState& w = workers_[url];
  if (w.url.empty() || w.role != role || load.prefill_tokens_total < w.load.prefill_tokens_total) {
    // New, or restarted with fresh counters: nothing to measure against yet.
    w = WorkerState{};
    w.url = url;
    w.role = role;
  } else if (w.up) {
    const double dt = std::chrono::duration<double>(now - w.last_seen).count();
    const int64_t done = load.prefill_tokens_total - w.load.prefill_tokens_total;
    // NOTE: only intervals that ended with work still queued measure capacity; an idle worker's
    // rate says how much arrived, not how much it could do.
    if (dt > 0 && done > 0 && load.queued_prompt_tokens > 0) {
      w.peak_prefill_tokens_per_s = std::max(w.peak_prefill_tokens_per_s, done / dt);
    }
  }
  w.load = load;
  w.up = true;
  w.last_seen = now;
  w.pending_tokens = 0;
  w.pending_seqs = 0;
}

std::optional<std::string> WorkerRegistry::pick(const std::string& role, Clock::time_point now,
                                                const std::set<std::string>& exclude) {
  std::lock_guard lock(mu_);
  const WorkerState* best = nullptr;
  auto cost = [&](const WorkerState& w) {
    return role == "prefill"
               ? static_cast<double>(w.load.queued_prompt_tokens + w.pending_tokens)
               : static_cast<double>(w.load.num_running + w.load.num_waiting + w.pending_seqs) /
                     std::max(1, w.load.max_num_seqs);
  };
  for (const auto& [url, w] : workers_) {
    if (w.role != role || !is_up(w, now) || exclude.count(url) != 0) continue;
    if (best == nullptr || cost(w) < cost(*best)) best = &w;
  }
  if (best == nullptr) return std::nullopt;
  return best->url;
}

void WorkerRegistry::assigned(const std::string& url, int64_t prompt_tokens) {
  std::lock_guard lock(mu_);
  const auto it = workers_.find(url);
  if (it == workers_.end()) return;
  if (it->second.role == "prefill") {
    it->second.pending_tokens += prompt_tokens;
  } else {
    ++it->second.pending_seqs;
  }
}

void WorkerRegistry::mark_down(const std::string& url) {
  std::lock_guard lock(mu_);
  const auto it = workers_.find(url);
  if (it != workers_.end()) it->second.up = false;
}

void WorkerRegistry::record_prompt(int64_t tokens, Clock::time_point now) {
  std::lock_guard lock(mu_);
  prompts_.emplace_back(now, tokens);
  while (!prompts_.empty() && now - prompts_.front().first > options_.rate_window)
    prompts_.pop_front();
}

std::vector<WorkerState> WorkerRegistry::workers(Clock::time_point now) const {
  std::lock_guard lock(mu_);
  std::vector<WorkerState> out;
  for (const auto& [url, w] : workers_) {
    out.push_back(w);
    out.back().up = is_up(w, now);
  }
  return out;
}

AutoscaleSignals WorkerRegistry::signals(Clock::time_point now) const {
  std::lock_guard lock(mu_);
  AutoscaleSignals s;
  double measured = 0.0;
  for (const auto& [url, w] : workers_) {
    if (!is_up(w, now)) continue;
    if (w.role == "prefill") {
      ++s.prefill_workers_up;
      measured = std::max(measured, w.peak_prefill_tokens_per_s);
    } else {
      ++s.decode_workers_up;
      s.decode_sequences += w.load.num_running + w.load.num_waiting + w.pending_seqs;
    }
  }
  int64_t tokens = 0;
  for (const auto& [t, n] : prompts_) {
    if (now - t <= options_.rate_window) tokens += n;
  }
  s.prompt_tokens_per_s = tokens / std::chrono::duration<double>(options_.rate_window).count();
  s.prefill_capacity_tokens_per_s = options_.prefill_capacity_tokens_per_s > 0
                                        ? options_.prefill_capacity_tokens_per_s
                                        : measured;
  // Without a capacity figure yet, the signal holds the current count rather than guessing.
  s.prefill_replicas_needed =
      s.prefill_capacity_tokens_per_s > 0
          ? std::max(1, static_cast<int>(
                            std::ceil(s.prompt_tokens_per_s / s.prefill_capacity_tokens_per_s)))
          : std::max(1, s.prefill_workers_up);
  s.decode_replicas_needed =
      std::max(1, static_cast<int>(std::ceil(static_cast<double>(s.decode_sequences) /
                                             options_.decode_target_batch)));
  return s;
}

}  // namespace relay::disagg

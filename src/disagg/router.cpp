// See router.h.
#include "disagg/router.h"

#include <httplib.h>

#include <thread>

#include "core/error.h"
#include "core/json.h"
#include "disagg/auth.h"
#include "disagg/control_client.h"
#include "disagg/protocol.h"
#include "http/server.h"

namespace relay::disagg {

using nlohmann::json;

namespace {

template <typename Seconds>
std::chrono::milliseconds ms(Seconds s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

// A control message's headers: its signature when the control plane is authenticated.
httplib::Headers signed_headers(ControlPlaneAuth* auth, const std::string& path,
                                const std::string& body) {
  httplib::Headers headers;
  if (auth != nullptr) {
    for (auto& [name, value] : auth->sign("POST", path, body)) headers.emplace(name, value);
  }
  return headers;
}

http::Response refused(const std::string& why) {
  return http::Response{401, "application/json", json{{"error", "refused: " + why}}.dump(), {}};
}

std::string error_of(const httplib::Result& r) {
  if (!r) return httplib::to_string(r.error());
  try {
    return parse_json(r->body, "an error reply").at("error").get<std::string>();
  } catch (const std::exception&) {
    return str("HTTP ", r->status);
  }
}

}  // namespace

struct DisaggRouter::Live {
  std::shared_ptr<server::RequestHandle> handle;
  std::atomic<bool> aborted{false};
  Clock::time_point arrival = Clock::now();
};

DisaggRouter::DisaggRouter(RouterOptions options, WorkerRegistry& registry,
                           server::Metrics& metrics)
    : options_(options), registry_(registry), metrics_(metrics) {
  metrics_.set_extra([this](const std::string& labels) {
    const AutoscaleSignals s = registry_.signals(Clock::now());
    std::string out;
    auto gauge = [&](const char* name, const char* help, double v) {
      out += str("# HELP ", name, " ", help, "\n# TYPE ", name, " gauge\n", name, "{", labels, "} ",
                 v, "\n");
    };
    gauge("relay:prefill_workers_up", "Prefill workers whose heartbeats are current.",
          s.prefill_workers_up);
    gauge("relay:decode_workers_up", "Decode workers whose heartbeats are current.",
          s.decode_workers_up);
    gauge("relay:prompt_tokens_per_second", "Prompt tokens arriving per second (rate window).",
          s.prompt_tokens_per_s);
    gauge("relay:prefill_capacity_tokens_per_second",
          "Prompt tokens per second one prefill worker sustains.", s.prefill_capacity_tokens_per_s);
    gauge("relay:prefill_replicas_needed", "Prefill workers the arriving prompt tokens call for.",
          s.prefill_replicas_needed);
    gauge("relay:decode_sequences", "Sequences running or waiting on the decode workers.",
          s.decode_sequences);
    gauge("relay:decode_replicas_needed", "Decode workers the decode batch calls for.",
          s.decode_replicas_needed);
    return out;
  });
}

DisaggRouter::~DisaggRouter() {
  stop();
  metrics_.set_extra(nullptr);
}

void DisaggRouter::add_routes(http::Server& svr) {
  // Both answer on the event loop: a heartbeat is a few fields into the registry.
  svr.route_inline("POST", "/disagg/heartbeat", [this](const http::Request& req) {
    if (options_.auth) {
      if (auto why = options_.auth->verify(req)) return refused(*why);
    }
    try {
      const json j = parse_json(req.body, "a heartbeat");
      WorkerLoad load;
      load.num_running = field<int>(j, "num_running", "heartbeat");
      load.num_waiting = field<int>(j, "num_waiting", "heartbeat");
      load.kv_cache_usage = field<double>(j, "kv_cache_usage", "heartbeat");
      load.queued_prompt_tokens = field<int64_t>(j, "queued_prompt_tokens", "heartbeat");
      load.prefill_tokens_total = field<int64_t>(j, "prefill_tokens_total", "heartbeat");
      load.max_num_seqs = field<int>(j, "max_num_seqs", "heartbeat");
      load.num_kv_blocks = field<int>(j, "num_kv_blocks", "heartbeat");
      load.block_size = field<int>(j, "block_size", "heartbeat");
      load.layout = field<std::string>(j, "layout", "heartbeat");
      load.kv_transport = field<std::string>(j, "kv_transport", "heartbeat");
      registry_.heartbeat(field<std::string>(j, "url", "heartbeat"),
                          field<std::string>(j, "role", "heartbeat"), load, Clock::now());
      publish_gauges();
      return http::Response{200, "application/json", "{}", {}};
    } catch (const std::exception& e) {
      return http::Response{400, "application/json", json{{"error", e.what()}}.dump(), {}};
    }
  });
  svr.route_inline("GET", "/disagg/workers", [this](const http::Request& req) {
    if (options_.auth || !options_.api_key.empty()) {
      const bool key = !options_.api_key.empty() &&
                       http::same_secret(req.header("Authorization"), "Bearer " + options_.api_key);
      std::optional<std::string> why = "an API key or a signature is required";
      if (!key && options_.auth) why = options_.auth->verify(req);
      if (!key && why) return refused(*why);
    }
    json out = json::array();
    for (const WorkerState& w : registry_.workers(Clock::now())) {
      out.push_back({{"url", w.url},
                     {"role", w.role},
                     {"up", w.up},
                     {"num_running", w.load.num_running},
                     {"num_waiting", w.load.num_waiting},
                     {"queued_prompt_tokens", w.load.queued_prompt_tokens},
                     {"max_num_seqs", w.load.max_num_seqs},
                     {"num_kv_blocks", w.load.num_kv_blocks},
                     {"block_size", w.load.block_size},
                     {"layout", w.load.layout},
                     {"kv_transport", w.load.kv_transport}});
    }
    return http::Response{200, "application/json", out.dump(), {}};
  });
}

httplib::Result DisaggRouter::post(const std::string& url, const std::string& path,
                                   const std::string& body,
                                   std::chrono::milliseconds read_timeout) {
  return control_client(url, options_.tls, read_timeout)
      ->Post(path.c_str(), signed_headers(options_.auth.get(), path, body), body,
             "application/json");
}

std::shared_ptr<server::RequestHandle> DisaggRouter::submit(EngineRequest request) {
  auto live = std::make_shared<Live>();
  live->handle = std::make_shared<server::RequestHandle>(next_id_++);
  {
    std::lock_guard lock(mu_);
    if (stopping_) {
      live->handle->fail("the server is shutting down");
      return live->handle;
    }
    live_.emplace(live->handle->id(), live);
    ++num_threads_;
  }
  ++num_unfinished_;
  std::thread([this, live, request = std::move(request)]() mutable {
    run(live, std::move(request));
    std::lock_guard lock(mu_);
    live_.erase(live->handle->id());
    --num_threads_;
    cv_.notify_all();
  }).detach();
  return live->handle;
}

void DisaggRouter::abort(int64_t id) {
  std::lock_guard lock(mu_);
  const auto it = live_.find(id);
  if (it != live_.end()) it->second->aborted = true;
}

void DisaggRouter::stop() {
  std::unique_lock lock(mu_);
  stopping_ = true;
  for (auto& [id, live] : live_) live->aborted = true;
  // Every call a request thread makes is bounded, so this ends.
  cv_.wait(lock, [&] { return num_threads_ == 0; });
}

void DisaggRouter::publish_gauges() {
  // The router's view of vLLM's engine gauges: its requests in flight, and the decode workers'
  // pages.
  server::EngineGauges g;
  g.num_running = num_unfinished_.load();
  double usage = 0.0;
  int decoders = 0;
  for (const WorkerState& w : registry_.workers(Clock::now())) {
    if (!w.up || w.role != "decode") continue;
    usage += w.load.kv_cache_usage;
    ++decoders;
  }
  g.kv_cache_usage = decoders > 0 ? usage / decoders : 0.0;
  metrics_.set_engine(g);
}

void DisaggRouter::finish_aborted(Live& live) {
  RequestOutput out;
  out.id = live.handle->id();
  out.finish = FinishReason::kAbort;
  server::record_output(metrics_, *live.handle, out);
  --num_unfinished_;
  live.handle->push(out);
}

void DisaggRouter::finish_failed(Live& live, const std::string& message, int http_status) {
  metrics_.request_finished(
      "error", std::chrono::duration<double>(Clock::now() - live.arrival).count(), 0.0);
  --num_unfinished_;
  live.handle->fail(message, http_status);
}

void DisaggRouter::run(std::shared_ptr<Live> live, EngineRequest request) {
  registry_.record_prompt(static_cast<int64_t>(request.prompt.size()), Clock::now());
  std::string last_error = "no attempt made";
  for (int i = 0; i < options_.max_attempts; ++i) {
    bool retry = false;
    last_error = attempt(*live, request, retry);
    if (!retry) return;
  }
  finish_failed(*live, str("gave up after ", options_.max_attempts, " attempts: ", last_error),
                503);
}

std::string DisaggRouter::attempt(Live& live, const EngineRequest& request, bool& retry) {
  const int64_t n = static_cast<int64_t>(request.prompt.size());
  const Clock::time_point wait_until = Clock::now() + ms(options_.wait_for_workers_s);
  auto wait_a_little = [&] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };
  // A prompt-only request (max_tokens 0: scoring the prompt) ends with its prompt, on the prefill
  // worker: no decode worker takes part.
  const bool prompt_only = request.stop.max_tokens == 0;

  // 1. KV pages on a decode worker.
  std::string decode_url;
  json reservation;
  std::set<std::string> full;
  while (!prompt_only) {
    if (live.aborted) break;
    auto d = registry_.pick("decode", Clock::now(), full);
    if (!d) {
      // None up: fail now (a request that waited would only fail later); all full: wait for room.
      if (registry_.num_up("decode", Clock::now()) == 0) {
        finish_failed(live, "no decode worker is up", 503);
        return "";
      }
      if (Clock::now() > wait_until) {
        finish_failed(live, "every decode worker is full", 503);
        return "";
      }
      full.clear();  // look again at everyone once they had time to free pages
      wait_a_little();
      continue;
    }
    auto r = post(*d, "/disagg/reserve", json{{"prompt", request.prompt}}.dump(),
                  std::chrono::seconds(30));
    if (!r) {
      registry_.mark_down(*d);
      continue;
    }
    if (r->status == 503) {
      full.insert(*d);
      continue;
    }
    if (r->status != 200) {
      finish_failed(live, str("decode worker ", *d, ": ", error_of(r)), 502);
      return "";
    }
    decode_url = *d;
    reservation = parse_json(r->body, "a reserve reply");
    break;
  }
  if (live.aborted) {
    // Not started anywhere yet: the request just ends.
    if (!decode_url.empty()) {
      post(decode_url, "/disagg/release", json{{"id", reservation.at("id")}}.dump(),
           std::chrono::seconds(5));
    }
    finish_aborted(live);
    return "";
  }
  const int64_t reservation_id = prompt_only ? 0 : reservation.at("id").get<int64_t>();
  if (!prompt_only) registry_.assigned(decode_url, n);
  auto release = [&] {
    if (prompt_only) return;
    post(decode_url, "/disagg/release", json{{"id", reservation_id}}.dump(),
         std::chrono::seconds(5));
  };

  // 2. The prompt on a prefill worker, its KV written into the reservation. (Prefill workers
  // queue prompts, so one that is up always takes it: none picked means none is up.)
  const std::optional<std::string> p = registry_.pick("prefill", Clock::now());
  if (!p || live.aborted) {
    release();
    if (live.aborted) {
      finish_aborted(live);
    } else {
      finish_failed(live, "no prefill worker is up", 503);
    }
    return "";
  }
  registry_.assigned(*p, n);
  json prefill_msg = {{"request", request_to_json(request)},
                      {"timeout_ms", static_cast<int64_t>(options_.prefill_timeout_s * 1000)}};
  if (!prompt_only) prefill_msg["kv"] = reservation.at("kv");
  auto pr = post(*p, "/disagg/prefill", prefill_msg.dump(), ms(options_.prefill_timeout_s + 5));
  if (!pr || pr->status == 502 || pr->status == 504) {
    // The prefill worker is gone, or the hand-off failed: send the prompt again, elsewhere.
    if (!pr) registry_.mark_down(*p);
    release();
    retry = true;
    return str("prefill worker ", *p, ": ", error_of(pr));
  }
  if (pr->status != 200) {
    release();
    finish_failed(live, str("prefill worker ", *p, ": ", error_of(pr)), 502);
    return "";
  }
  // A prompt-only request's answer is its one output; any other's, the first token.
  RequestOutput only_output;
  FirstToken first;
  try {
    const json reply = parse_json(pr->body, "a prefill reply");
    if (prompt_only) {
      only_output = output_from_json(field<json>(reply, "output", "prefill reply"));
    } else {
      first = first_token_from_json(field<json>(reply, "first", "prefill reply"));
    }
  } catch (const Error& e) {
    release();
    finish_failed(live, str("prefill worker ", *p, ": ", e.what()), 502);
    return "";
  }
  if (prompt_only) {
    only_output.id = live.handle->id();
    server::record_output(metrics_, *live.handle, only_output);
    --num_unfinished_;
    live.handle->push(std::move(only_output));
    return "";
  }
  // The prompt logprobs go into the request's first output here: the decode worker neither
  // computes nor needs them.
  std::vector<std::optional<TokenLogprob>> prompt_logprobs = std::move(first.prompt_logprobs);
  first.prompt_logprobs.clear();
  EngineRequest decode_request = request;
  decode_request.num_prompt_logprobs = -1;

  // 3. Decode, streaming the outputs into the handle.
  httplib::Request req;
  req.method = "POST";
  req.path = "/disagg/generate";
  req.body = json{{"id", reservation_id},
                  {"request", request_to_json(decode_request)},
                  {"first", first_token_to_json(first)}}
                 .dump();
  req.set_header("Content-Type", "application/json");
  for (auto& [name, value] : signed_headers(options_.auth.get(), req.path, req.body))
    req.set_header(name.c_str(), value.c_str());
  std::string buffer, stream_error;
  bool finished = false;
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    buffer.append(data, len);
    for (size_t nl; (nl = buffer.find('\n')) != std::string::npos;) {
      const std::string line = buffer.substr(0, nl);
      buffer.erase(0, nl + 1);
      if (line.empty()) continue;  // the worker's heartbeat
      RequestOutput out;
      try {
        const json j = parse_json(line, "a decode output line");
        if (j.contains("error") && !j.contains("id")) {
          stream_error = field<std::string>(j, "error", "a decode error line");
          return false;
        }
        out = output_from_json(j);
      } catch (const Error& e) {
        stream_error = e.what();
        return false;
      }
      out.id = live.handle->id();
      if (!prompt_logprobs.empty()) {
        out.prompt_logprobs = std::move(prompt_logprobs);
        prompt_logprobs.clear();
      }
      server::record_output(metrics_, *live.handle, out);
      if (out.finish != FinishReason::kNone) {
        finished = true;
        --num_unfinished_;
      }
      live.handle->push(std::move(out));
    }
    return !live.aborted && !finished;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  control_client(decode_url, options_.tls, ms(options_.stream_timeout_s))->send(req, res, err);
  if (finished) return "";
  if (live.aborted) {
    finish_aborted(live);
    return "";
  }
  if (stream_error.empty()) {
    if (err != httplib::Error::Success) {
      registry_.mark_down(decode_url);  // it went away mid-stream
      stream_error = httplib::to_string(err);
    } else {
      stream_error = str("HTTP ", res.status, " ", res.body);
    }
  }
  finish_failed(live, str("decode worker ", decode_url, " failed: ", stream_error), 502);
  return "";
}

std::string DisaggRouter::unusable_reason() const {
  const Clock::time_point now = Clock::now();
  const bool decode = registry_.num_up("decode", now) > 0;
  const bool prefill = registry_.num_up("prefill", now) > 0;
  if (decode && prefill) return {};
  return str("no ", decode ? "prefill" : prefill ? "decode" : "prefill or decode", " worker is up");
}

}  // namespace relay::disagg

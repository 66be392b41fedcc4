// Routes and response formatting of the OpenAI-compatible server (see http_server.h).
#include "server/http_server.h"

#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <random>

#include "core/error.h"
#include "server/openai_protocol.h"
#include "server/output_parser.h"
#include "tokenizer/utf8.h"

namespace relay::server {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(100);
constexpr auto kHeartbeatInterval = std::chrono::seconds(1);

enum class Phase { kLoading, kReady, kDraining };

// JSON text that never throws on invalid UTF-8 in model output (it becomes U+FFFD).
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One choice of a request (n > 1 runs n engine requests over the same prompt).
struct Choice {
  std::shared_ptr<RequestHandle> handle;
  std::string text;
  std::vector<TokenLogprob> logprobs;
  FinishReason finish = FinishReason::kNone;
  int num_output_tokens = 0;
  int num_cached_tokens = 0;
  std::string error;
  int error_status = 500;
  bool done = false;
};

// A request in flight: its choices and how to answer.
struct Job {
  std::string id;
  int64_t created = 0;
  bool chat = true;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;
  bool tokens_as_ids = false;  // return_tokens_as_token_ids
  int num_prompt_tokens = 0;
  std::string echo_text;  // completions with echo
  // Chat output parsing, one parser per choice.
  bool parse_reasoning = false;
  bool starts_in_reasoning = false;
  bool parse_tools = false;
  std::vector<ChatOutputParser> parsers;
  std::vector<Choice> choices;

  bool all_done() const {
    return std::all_of(choices.begin(), choices.end(), [](const Choice& c) { return c.done; });
  }
};

// Writes one response's bytes, remembering whether the client is still there and when the last
// bytes went out (for heartbeats).
struct ResponseWriter {
  httplib::DataSink& sink;
  bool ok = true;
  Clock::time_point last_write = Clock::now();

  bool operator()(const std::string& data) {
    if (ok) ok = sink.write(data.data(), data.size());
    last_write = Clock::now();
    return ok;
  }
};

// NOTE: Debian's cpp-httplib is a compiled library whose listen() passes a backlog of 5 (its
// CPPHTTPLIB_LISTEN_BACKLOG macro reaches only the header, not the library): a load generator that
// opens hundreds of connections at once overflows that accept queue, and connections the kernel
// completed but could not queue are dropped later (the client sees a reset: httpx ReadError). A
// second listen() on the bound socket raises the backlog (up to net.core.somaxconn); the socket is
// found among the process's descriptors as the listening one bound to `port`.
void raise_listen_backlog(int port) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    int fd = -1;
    try {
      fd = std::stoi(entry.path().filename().string());
    } catch (const std::exception&) {
      continue;
    }
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) continue;
    sockaddr_storage addr{};
    socklen_t addr_len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &addr_len) != 0) continue;
    int bound = -1;
    if (addr.ss_family == AF_INET) bound = ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    if (addr.ss_family == AF_INET6)
      bound = ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
    if (bound == port) ::listen(fd, 4096);
  }
}

}  // namespace

struct HttpServer::State {
  explicit State(ServerOptions o) : options(std::move(o)), metrics(options.served_model_name) {}

  ServerOptions options;
  httplib::Server svr;
  Metrics metrics;
  std::atomic<Phase> phase{Phase::kLoading};
  ServedModel model;
  std::optional<chat::ChatTemplate> chat_template;
  std::unique_ptr<EngineLoop> own_loop;  // when serving a local engine
  RequestSink* loop = nullptr;           // where requests go
  std::atomic<int> active_responses{0};
  std::mutex rng_mu;
  std::mt19937_64 rng{std::random_device{}()};

  uint64_t random64() {
    std::lock_guard lock(rng_mu);
    return rng();
  }
  std::string random_id(const char* prefix) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%s%016llx%08llx", prefix,
                  static_cast<unsigned long long>(random64()),
                  static_cast<unsigned long long>(random64() & 0xffffffffu));
    return buf;
  }

  void send_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    res.set_content(dump(e.body()), "application/json");
    metrics.request_rejected(e.status);
  }

  void check_ready() const {
    const Phase p = phase.load();
    if (p == Phase::kLoading)
      throw ApiError{503, "the model is still loading", "service_unavailable", "", ""};
    if (p == Phase::kDraining) {
      throw ApiError{503, "the server is shutting down", "service_unavailable", "", ""};
    }
  }

  void check_model(const std::string& model) const {
    if (model != options.served_model_name && model != options.model_path) {
      throw ApiError{404,
                     str("The model '", model, "' does not exist; this server serves '",
                         options.served_model_name, "'"),
                     "invalid_request_error", "model", "model_not_found"};
    }
  }

  void check_capacity(int n) const {
    const int limit = options.max_num_seqs + options.max_queue;
    if (loop->num_unfinished() + n > limit) {
      throw ApiError{
          429, str("the server's queue is full (", limit, " requests in flight); retry later"),
          "rate_limit_exceeded", "", "queue_full"};
    }
  }

  // Submits the n choices of a request.
  void submit(Job& job, const std::vector<int32_t>& prompt, const GenerationOptions& o,
              int64_t max_tokens) {
    const int64_t vocab = model.vocab_size;
    check_token_ids(o.stop_token_ids, vocab, "stop_token_ids");
    check_capacity(static_cast<int>(o.n));
    const uint64_t seed = o.seed ? *o.seed : random64();
    for (int64_t i = 0; i < o.n; ++i) {
      EngineRequest r;
      r.prompt = prompt;
      r.sampling.temperature = static_cast<float>(o.temperature);
      r.sampling.top_k = o.top_k < 0 ? 0 : static_cast<int>(o.top_k);
      r.sampling.top_p = static_cast<float>(o.top_p);
      r.sampling.min_p = static_cast<float>(o.min_p);
      r.sampling.presence_penalty = static_cast<float>(o.presence_penalty);
      r.sampling.frequency_penalty = static_cast<float>(o.frequency_penalty);
      r.sampling.repetition_penalty = static_cast<float>(o.repetition_penalty);
      r.sampling.seed = seed + static_cast<uint64_t>(i);
      r.sampling.num_logprobs = o.logprobs ? static_cast<int>(o.top_logprobs) : -1;
      r.stop.max_tokens = max_tokens;
      r.stop.min_tokens = std::min(o.min_tokens, max_tokens);
      for (int64_t t : o.stop_token_ids) r.stop.stop_token_ids.push_back(static_cast<int32_t>(t));
      r.stop.stop_strings = o.stop;
      r.stop.ignore_eos = o.ignore_eos;
      r.stop.include_stop_str_in_output = o.include_stop_str_in_output;
      r.stop.skip_special_tokens = o.skip_special_tokens;
      Choice c;
      c.handle = loop->submit(std::move(r));
      job.choices.push_back(std::move(c));
    }
  }

  void abort_job(Job& job) {
    for (Choice& c : job.choices) {
      if (!c.done) loop->abort(c.handle->id());
    }
  }

  // Waits briefly for outputs of any choice and calls on_output for each.
  template <typename OnOutput>
  void poll(Job& job, OnOutput&& on_output) {
    const auto wait = job.choices.size() == 1 ? kPollInterval : std::chrono::milliseconds(5);
    for (size_t i = 0; i < job.choices.size(); ++i) {
      Choice& c = job.choices[i];
      if (c.done) continue;
      for (RequestOutput& out : c.handle->next(wait)) {
        c.text += out.text;
        c.logprobs.insert(c.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
        c.num_output_tokens = out.num_output_tokens;
        c.num_cached_tokens = out.num_cached_tokens;
        if (out.finish != FinishReason::kNone) {
          c.finish = out.finish;
          c.done = true;
        }
        on_output(i, out);
      }
      if (!c.done && c.handle->done()) {
        c.error = c.handle->error();
        c.error_status = c.handle->error_status();
        c.done = true;
      }
    }
  }

  // ---- formatting ----

  std::string token_text(int32_t id, bool as_id) const {
    return as_id ? str("token_id:", id) : utf8::sanitize(model.tokenizer->token_bytes(id));
  }

  json token_bytes_json(int32_t id) const {
    json bytes = json::array();
    for (unsigned char b : model.tokenizer->token_bytes(id)) bytes.push_back(b);
    return bytes;
  }

  json chat_logprobs(const std::vector<TokenLogprob>& lps, bool as_ids) const {
    json content = json::array();
    for (const TokenLogprob& lp : lps) {
      json top = json::array();
      for (const auto& [id, v] : lp.top) {
        top.push_back(
            {{"token", token_text(id, as_ids)}, {"logprob", v}, {"bytes", token_bytes_json(id)}});
      }
      content.push_back({{"token", token_text(lp.token, as_ids)},
                         {"logprob", lp.logprob},
                         {"bytes", token_bytes_json(lp.token)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }

  json completion_logprobs(const std::vector<TokenLogprob>& lps, size_t text_offset,
                           bool as_ids) const {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    for (const TokenLogprob& lp : lps) {
      const std::string t = token_text(lp.token, as_ids);
      tokens.push_back(t);
      token_logprobs.push_back(lp.logprob);
      json alts = json::object();
      for (const auto& [id, v] : lp.top) alts[token_text(id, as_ids)] = v;
      top.push_back(alts);
      offsets.push_back(text_offset);
      text_offset += model.tokenizer->token_bytes(lp.token).size();
    }
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top},
            {"text_offset", offsets}};
  }

  json usage(const Job& job) const {
    int completion = 0, cached = 0;
    for (const Choice& c : job.choices) {
      completion += c.num_output_tokens;
      cached = std::max(cached, c.num_cached_tokens);
    }
    return {{"prompt_tokens", job.num_prompt_tokens},
            {"completion_tokens", completion},
            {"total_tokens", job.num_prompt_tokens + completion},
            {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  }

  static std::string finish_name(FinishReason r, bool tool_calls) {
    if (r == FinishReason::kStop && tool_calls) return "tool_calls";
    return finish_reason_name(r);
  }

  json tool_calls_json(const std::vector<ParsedToolCall>& calls, int first_index, bool stream) {
    json out = json::array();
    for (size_t k = 0; k < calls.size(); ++k) {
      json call = {{"id", random_id("call_")},
                   {"type", "function"},
                   {"function", {{"name", calls[k].name}, {"arguments", calls[k].arguments}}}};
      if (stream) call["index"] = first_index + static_cast<int>(k);
      out.push_back(std::move(call));
    }
    return out;
  }

  json chunk_base(const Job& job) const {
    return {{"id", job.id},
            {"object", job.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", job.created},
            {"model", options.served_model_name}};
  }

  // The error of the first failed choice, as an OpenAI error object.
  std::optional<ApiError> job_error(const Job& job) const {
    for (const Choice& c : job.choices) {
      if (!c.error.empty()) {
        return ApiError{c.error_status, c.error,
                        c.error_status == 503 ? "service_unavailable" : "internal_server_error", "",
                        ""};
      }
    }
    return std::nullopt;
  }

  // ---- responses ----

  void respond(Job job_value, httplib::Response& res) {
    auto job = std::make_shared<Job>(std::move(job_value));
    if (!job->stream) {
      // NOTE: the status line leaves with the first byte (a heartbeat), so a non-streaming
      // response first waits up to one heartbeat interval for its outcome: a request that fails
      // by then (a failed engine step) gets its HTTP error status, not a 200 with an error body.
      // One that fails later can only report the error in the body.
      const Clock::time_point deadline = Clock::now() + kHeartbeatInterval;
      while (!job->all_done() && Clock::now() < deadline) {
        poll(*job, [](size_t, const RequestOutput&) {});
      }
      if (const auto err = job->all_done() ? job_error(*job) : std::nullopt) {
        res.status = err->status;
        res.set_content(dump(err->body()), "application/json");
        return;
      }
    }
    ++active_responses;
    // NOTE: httplib gzips a chunked "application/json" body when the client accepts gzip, which
    // buffers the heartbeats and hides a disconnect; with a charset parameter it sends bytes as
    // they come.
    const char* content_type =
        job->stream ? "text/event-stream" : "application/json; charset=utf-8";
    res.set_chunked_content_provider(
        content_type,
        [this, job](size_t, httplib::DataSink& sink) {
          ResponseWriter write{sink};
          if (job->stream) {
            stream_job(*job, write);
          } else {
            complete_job(*job, write);
          }
          if (!write.ok) {
            abort_job(*job);
            return false;
          }
          sink.done();
          return true;
        },
        [this, job](bool success) {
          if (!success) abort_job(*job);
          --active_responses;
        });
  }

  // Waits for the job, calling on_output per output, and writes `heartbeat` whenever nothing was
  // written for a while: a write to a client that hung up fails, which ends the wait.
  void wait_with_heartbeat(Job& job, ResponseWriter& write, const std::string& heartbeat,
                           const std::function<void(size_t, const RequestOutput&)>& on_output) {
    while (write.ok && !job.all_done()) {
      poll(job, [&](size_t i, const RequestOutput& out) { on_output(i, out); });
      if (Clock::now() - write.last_write > kHeartbeatInterval) write(heartbeat);
    }
  }

  void stream_job(Job& job, ResponseWriter& write) {
    auto sse = [&](const json& j) { return write("data: " + dump(j) + "\n\n"); };
    std::vector<int> num_calls(job.choices.size(), 0);
    if (job.chat) {
      for (size_t i = 0; i < job.choices.size(); ++i) {
        json c = chunk_base(job);
        c["choices"] = json::array({{{"index", i},
                                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                                     {"logprobs", nullptr},
                                     {"finish_reason", nullptr}}});
        if (job.include_usage) c["usage"] = nullptr;
        if (!sse(c)) return;
      }
    }
    bool echoed = job.echo_text.empty();
    wait_with_heartbeat(job, write, ": keep-alive\n\n", [&](size_t i, const RequestOutput& out) {
      json choice = {{"index", i}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
      bool has_content = !out.logprobs.empty();
      if (job.chat) {
        ParsedDelta d = job.parsers[i].feed(out.text);
        if (out.finish != FinishReason::kNone) {
          ParsedDelta rest = job.parsers[i].finish();
          d.reasoning += rest.reasoning;
          d.content += rest.content;
          d.tool_calls.insert(d.tool_calls.end(), rest.tool_calls.begin(), rest.tool_calls.end());
        }
        json delta = json::object();
        if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
        if (!d.content.empty()) delta["content"] = d.content;
        if (!d.tool_calls.empty()) {
          delta["tool_calls"] = tool_calls_json(d.tool_calls, num_calls[i], true);
          num_calls[i] += static_cast<int>(d.tool_calls.size());
        }
        has_content = has_content || !delta.empty();
        choice["delta"] = delta;
        if (!out.logprobs.empty())
          choice["logprobs"] = chat_logprobs(out.logprobs, job.tokens_as_ids);
      } else {
        std::string text = out.text;
        if (!echoed) {
          text = job.echo_text + text;
          echoed = true;
        }
        has_content = has_content || !text.empty();
        choice["text"] = text;
        if (!out.logprobs.empty())
          choice["logprobs"] = completion_logprobs(out.logprobs, 0, job.tokens_as_ids);
      }
      if (out.finish != FinishReason::kNone) {
        choice["finish_reason"] = finish_name(out.finish, num_calls[i] > 0);
        has_content = true;
      }
      if (!has_content) return;
      json c = chunk_base(job);
      c["choices"] = json::array({choice});
      if (job.include_usage) c["usage"] = nullptr;
      sse(c);
    });
    if (!write.ok) return;
    if (const auto err = job_error(job)) {
      sse(err->body());
    } else if (job.include_usage) {
      json c = chunk_base(job);
      c["choices"] = json::array();
      c["usage"] = usage(job);
      sse(c);
    }
    write("data: [DONE]\n\n");
  }

  void complete_job(Job& job, ResponseWriter& write) {
    wait_with_heartbeat(job, write, " ", [](size_t, const RequestOutput&) {});
    if (!write.ok) return;
    if (const auto err = job_error(job)) {
      write(dump(err->body()));
      return;
    }
    json choices = json::array();
    for (size_t i = 0; i < job.choices.size(); ++i) {
      const Choice& c = job.choices[i];
      json choice = {{"index", i}, {"logprobs", nullptr}};
      if (job.chat) {
        ParsedDelta d = job.parsers[i].feed(c.text);
        ParsedDelta rest = job.parsers[i].finish();
        d.reasoning += rest.reasoning;
        d.content += rest.content;
        d.tool_calls.insert(d.tool_calls.end(), rest.tool_calls.begin(), rest.tool_calls.end());
        json message = {
            {"role", "assistant"},
            {"content",
             d.content.empty() && !d.tool_calls.empty() ? json(nullptr) : json(d.content)},
            {"reasoning_content", d.reasoning.empty() ? json(nullptr) : json(d.reasoning)},
            {"tool_calls", tool_calls_json(d.tool_calls, 0, false)}};
        choice["message"] = message;
        choice["finish_reason"] = finish_name(c.finish, !d.tool_calls.empty());
        if (job.logprobs) choice["logprobs"] = chat_logprobs(c.logprobs, job.tokens_as_ids);
      } else {
        choice["text"] = job.echo_text + c.text;
        choice["finish_reason"] = finish_name(c.finish, false);
        if (job.logprobs)
          choice["logprobs"] =
              completion_logprobs(c.logprobs, job.echo_text.size(), job.tokens_as_ids);
      }
      choices.push_back(std::move(choice));
    }
    json body = {
        {"id", job.id},           {"object", job.chat ? "chat.completion" : "text_completion"},
        {"created", job.created}, {"model", options.served_model_name},
        {"choices", choices},     {"usage", usage(job)}};
    write(dump(body));
  }

  // The chat template's prompt for `messages`; a template error is the request's 400.
  std::string render_chat(const json& messages, const json& tools, bool add_generation_prompt,
                          const json& kwargs) const {
    try {
      return chat_template->render(messages, tools, add_generation_prompt, kwargs);
    } catch (const Error& e) {
      throw bad_param("messages",
                      str("the chat template could not render these messages: ", e.what()));
    }
  }

  // ---- endpoints ----

  void chat_completions(const httplib::Request& req, httplib::Response& res) {
    check_ready();
    ChatRequest r = parse_chat_request(req.body);
    check_model(r.model);
    const bool use_tools = !r.tools.is_null() && r.tool_choice != "none";
    const std::string prompt = render_chat(r.messages, use_tools ? r.tools : json(nullptr),
                                           r.add_generation_prompt, r.chat_template_kwargs);
    const std::vector<int32_t> ids = model.tokenizer->encode(prompt);
    const int64_t max_tokens = check_context_length(static_cast<int64_t>(ids.size()), r.options,
                                                    model.max_model_len, "messages");
    Job job;
    job.id = random_id("chatcmpl-");
    job.created = unix_time();
    job.chat = true;
    job.stream = r.options.stream;
    job.include_usage = r.options.include_usage;
    job.logprobs = r.options.logprobs;
    job.tokens_as_ids = r.options.return_tokens_as_token_ids;
    job.num_prompt_tokens = static_cast<int>(ids.size());
    const auto thinking = r.chat_template_kwargs.find("enable_thinking");
    job.parse_reasoning = thinking == r.chat_template_kwargs.end() || thinking->is_null() ||
                          (thinking->is_boolean() && thinking->get<bool>());
    // Templates that open the think block themselves leave the model inside it from the start.
    job.starts_in_reasoning =
        std::string_view(prompt).substr(0, prompt.find_last_not_of(" \n") + 1).ends_with("<think>");
    job.parse_tools = use_tools;
    submit(job, ids, r.options, max_tokens);
    for (size_t i = 0; i < job.choices.size(); ++i) {
      job.parsers.emplace_back(job.parse_reasoning, job.starts_in_reasoning, job.parse_tools);
    }
    respond(std::move(job), res);
  }

  void completions(const httplib::Request& req, httplib::Response& res) {
    check_ready();
    CompletionRequest r = parse_completion_request(req.body);
    check_model(r.model);
    std::vector<int32_t> ids;
    std::string prompt_text;
    if (r.prompt_text) {
      ids = model.tokenizer->encode(*r.prompt_text);
      prompt_text = *r.prompt_text;
      if (ids.empty()) throw bad_param("prompt", "'prompt' encodes to no tokens");
    } else {
      check_token_ids(r.prompt_ids, model.vocab_size, "prompt");
      ids.assign(r.prompt_ids.begin(), r.prompt_ids.end());
      if (r.echo) prompt_text = model.tokenizer->decode(ids);
    }
    const int64_t max_tokens = check_context_length(static_cast<int64_t>(ids.size()), r.options,
                                                    model.max_model_len, "prompt");
    Job job;
    job.id = random_id("cmpl-");
    job.created = unix_time();
    job.chat = false;
    job.stream = r.options.stream;
    job.include_usage = r.options.include_usage;
    job.logprobs = r.options.logprobs;
    job.tokens_as_ids = r.options.return_tokens_as_token_ids;
    job.num_prompt_tokens = static_cast<int>(ids.size());
    if (r.echo) job.echo_text = prompt_text;
    submit(job, ids, r.options, max_tokens);
    respond(std::move(job), res);
  }

  // vLLM's /tokenize: the ids (and, on request, the vocabulary strings) of a prompt or of chat
  // messages rendered by the chat template, with the context they would have.
  void tokenize(const httplib::Request& req, httplib::Response& res) {
    check_ready();
    const TokenizeRequest r = parse_tokenize_request(req.body);
    if (r.model) check_model(*r.model);
    const std::string text =
        r.prompt ? *r.prompt
                 : render_chat(r.messages, r.tools, r.add_generation_prompt, r.chat_template_kwargs);
    const std::vector<int32_t> ids = model.tokenizer->encode(text);
    json body = {{"count", ids.size()}, {"max_model_len", model.max_model_len}, {"tokens", ids},
                 {"token_strs", nullptr}};
    if (r.return_token_strs) {
      json strs = json::array();
      for (int32_t id : ids) strs.push_back(std::string(model.tokenizer->id_to_token(id).value_or("")));
      body["token_strs"] = std::move(strs);
    }
    res.set_content(dump(body), "application/json");
  }

  // vLLM's /detokenize: the text of token ids (special tokens kept, as vLLM does).
  void detokenize(const httplib::Request& req, httplib::Response& res) {
    check_ready();
    const DetokenizeRequest r = parse_detokenize_request(req.body);
    if (r.model) check_model(*r.model);
    check_token_ids(r.tokens, model.vocab_size, "tokens");
    const std::vector<int32_t> ids(r.tokens.begin(), r.tokens.end());
    res.set_content(dump({{"prompt", utf8::sanitize(model.tokenizer->decode(ids))}}),
                    "application/json");
  }

  void models(httplib::Response& res) {
    check_ready();
    json m = {{"id", options.served_model_name}, {"object", "model"},
              {"created", unix_time()},          {"owned_by", "relay"},
              {"root", options.model_path},      {"max_model_len", model.max_model_len}};
    res.set_content(dump({{"object", "list"}, {"data", json::array({m})}}), "application/json");
  }
};

HttpServer::HttpServer(ServerOptions options)
    : state_(std::make_unique<State>(std::move(options))) {}

HttpServer::~HttpServer() { stop(); }

void HttpServer::start() {
  State& s = *state_;
  httplib::Server& svr = s.svr;
  // NOTE: every streaming response holds a thread while it runs, so the pool covers every request
  // that may be in flight, plus some for health checks, metrics and rejections.
  const size_t num_threads = static_cast<size_t>(s.options.max_num_seqs + s.options.max_queue + 16);
  svr.new_task_queue = [num_threads] { return new httplib::ThreadPool(num_threads); };
  svr.set_payload_max_length(size_t{64} << 20);
  // A client keeps its connection for as many requests as it likes (httplib closes after 5 by
  // default, which makes a load generator reconnect in bursts).
  svr.set_keep_alive_max_count(100000);

  static thread_local Clock::time_point request_start;
  svr.set_pre_routing_handler([&s](const httplib::Request& req, httplib::Response& res) {
    request_start = Clock::now();
    if (!s.options.api_key.empty() && req.path.rfind("/v1/", 0) == 0 &&
        req.get_header_value("Authorization") != "Bearer " + s.options.api_key) {
      s.send_error(
          res, ApiError{401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                        "invalid_request_error", "", "invalid_api_key"});
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  svr.set_logger([](const httplib::Request& req, const httplib::Response& res) {
    const double secs = std::chrono::duration<double>(Clock::now() - request_start).count();
    std::fprintf(stderr, "relay: %s \"%s %s\" %d %.3fs\n", req.remote_addr.c_str(),
                 req.method.c_str(), req.path.c_str(), res.status, secs);
  });
  svr.set_error_handler([&s](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty() || res.status != 404) return;
    s.send_error(res, ApiError{404, str("no route for ", req.method, " ", req.path),
                               "invalid_request_error", "", "not_found"});
  });
  svr.set_exception_handler(
      [&s](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string message = "internal error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          message = e.what();
        } catch (...) {
        }
        s.send_error(res, ApiError{500, message, "internal_server_error", "", ""});
      });

  // Runs a handler, turning ApiError into its JSON answer.
  auto guarded = [&s](auto handler) {
    return [&s, handler](const httplib::Request& req, httplib::Response& res) {
      try {
        handler(req, res);
      } catch (const ApiError& e) {
        s.send_error(res, e);
      }
    };
  };
  svr.Get("/health", [&s](const httplib::Request&, httplib::Response& res) {
    const Phase p = s.phase.load();
    // A ready server whose engine can run no more steps (a multi-node worker that lost a node) is
    // unhealthy: a load balancer or orchestrator should route around it and restart it.
    if (p == Phase::kReady && s.loop) {
      if (const std::string why = s.loop->unusable_reason(); !why.empty()) {
        res.status = 503;
        res.set_content(dump(json{{"status", "unusable"}, {"reason", why}}), "application/json");
        return;
      }
    }
    res.status = p == Phase::kReady ? 200 : 503;
    res.set_content(p == Phase::kReady     ? "{\"status\":\"ok\"}"
                    : p == Phase::kLoading ? "{\"status\":\"loading\"}"
                                           : "{\"status\":\"draining\"}",
                    "application/json");
  });
  svr.Get("/metrics", [&s](const httplib::Request&, httplib::Response& res) {
    res.set_content(s.metrics.render(), "text/plain; version=0.0.4");
  });
  svr.Get("/version", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump(json{{"version", RELAY_VERSION}}), "application/json");
  });
  svr.Post("/tokenize", guarded([&s](const httplib::Request& req, httplib::Response& res) {
             s.tokenize(req, res);
           }));
  svr.Post("/detokenize", guarded([&s](const httplib::Request& req, httplib::Response& res) {
             s.detokenize(req, res);
           }));
  svr.Get("/v1/models",
          guarded([&s](const httplib::Request&, httplib::Response& res) { s.models(res); }));
  svr.Post("/v1/chat/completions",
           guarded([&s](const httplib::Request& req, httplib::Response& res) {
             s.chat_completions(req, res);
           }));
  svr.Post("/v1/completions", guarded([&s](const httplib::Request& req, httplib::Response& res) {
             s.completions(req, res);
           }));

  port_ = s.options.port == 0 ? svr.bind_to_any_port(s.options.host) : s.options.port;
  if (s.options.port != 0 && !svr.bind_to_port(s.options.host, s.options.port)) port_ = -1;
  RELAY_CHECK(port_ > 0, "cannot listen on ", s.options.host, ":", s.options.port);
  raise_listen_backlog(port_);
  listen_thread_ = std::thread([&svr] { svr.listen_after_bind(); });
}

void HttpServer::attach(LLMEngine& engine, chat::ChatTemplate chat_template) {
  State& s = *state_;
  s.own_loop = std::make_unique<EngineLoop>(engine, s.metrics);
  attach(ServedModel{&engine.tokenizer(), engine.model_config().vocab_size, engine.max_model_len()},
         *s.own_loop, std::move(chat_template));
}

void HttpServer::attach(const ServedModel& model, RequestSink& sink,
                        chat::ChatTemplate chat_template) {
  State& s = *state_;
  s.model = model;
  s.chat_template.emplace(std::move(chat_template));
  s.loop = &sink;
  s.phase = Phase::kReady;
}

void HttpServer::add_routes(const std::function<void(httplib::Server&)>& add) { add(state_->svr); }

Metrics& HttpServer::metrics() { return state_->metrics; }

bool HttpServer::drain(double timeout_s) {
  State& s = *state_;
  s.phase = Phase::kDraining;
  const Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                        std::chrono::duration<double>(timeout_s));
  auto idle = [&] { return (!s.loop || s.loop->num_unfinished() == 0) && s.active_responses == 0; };
  while (!idle() && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const bool finished = idle();
  if (s.loop) s.loop->stop();
  // Let the responses of requests failed by stop() write their last bytes.
  const Clock::time_point grace = Clock::now() + std::chrono::seconds(2);
  while (s.active_responses > 0 && Clock::now() < grace)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return finished;
}

void HttpServer::stop() {
  if (!state_) return;
  state_->svr.stop();
  if (listen_thread_.joinable()) listen_thread_.join();
  if (state_->loop) state_->loop->stop();
}

}  // namespace relay::server

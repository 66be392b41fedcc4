// Routes and response formatting of the OpenAI-compatible server (see http_server.h).
#include "server/http_server.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <set>

#include "core/error.h"
#include "core/json.h"
#include "grammar/grammar.h"
#include "http/server.h"
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

// One choice of a request: an engine request over one prompt (n > 1 runs n per prompt, and a
// completions batch runs n for each of its prompts).
struct Choice {
  std::shared_ptr<RequestHandle> handle;  // none for an echo that needs no engine (max_tokens 0)
  std::vector<int32_t> prompt;            // its prompt's ids (echo with logprobs lists them)
  std::string echo_text;                  // completions with echo: the prompt's text
  std::string text;
  std::vector<TokenLogprob> logprobs;
  // The prompt's logprobs, from the engine's first output ([0] empty), when the job asked.
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  FinishReason finish = FinishReason::kNone;
  std::optional<int32_t> stop_token;  // vLLM's stop_reason
  std::optional<std::string> stop_string;
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
  int top_logprobs = 0;
  bool tokens_as_ids = false;  // return_tokens_as_token_ids
  bool echo = false;           // completions: the prompt leads each choice's text and logprobs
  std::optional<int> prompt_logprobs;  // vLLM's prompt_logprobs field, with this many alternatives
  int num_prompt_tokens = 0;           // every prompt's, once (n choices share one)
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

// The grammar a structured-output constraint compiles to.
GrammarSpec spec_of(const OutputConstraint& c) {
  using Kind = OutputConstraint::Kind;
  switch (c.kind) {
    case Kind::kJsonObject:
      return GrammarSpec::json();
    case Kind::kJsonSchema:
      return GrammarSpec::json_schema(c.text, c.strict);
    case Kind::kRegex:
      return GrammarSpec::regex(c.text);
    case Kind::kChoice:
      return GrammarSpec::choice(c.choices);
    case Kind::kGrammar:
      return GrammarSpec::ebnf(c.text);
  }
  fail("unknown output constraint");
}

http::Response json_response(int status, const json& body) {
  return http::Response{status, "application/json", dump(body), {}};
}

}  // namespace

struct HttpServer::State {
  explicit State(ServerOptions o)
      : options(std::move(o)), svr(transport_options(options)), metrics(options.served_model_name) {}

  static http::Options transport_options(const ServerOptions& o) {
    http::Options t;
    t.host = o.host;
    t.port = o.port;
    // NOTE: every generation request holds a worker while it runs, so the pool covers every
    // request that may be in flight, plus some for tokenization and rejections; connections wait
    // for requests on the event loop and hold no worker.
    t.num_workers = o.max_num_seqs + o.max_queue + 16;
    t.max_connections = o.max_connections;
    t.request_head_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.request_head_timeout_s * 1000));
    t.keep_alive_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.keep_alive_timeout_s * 1000));
    t.tls = o.tls;
    t.error_body = [](int status, const std::string& message) {
      return dump(transport_error(status, message).body());
    };
    return t;
  }

  ServerOptions options;
  http::Server svr;
  Metrics metrics;
  std::atomic<Phase> phase{Phase::kLoading};
  ServedModel model;
  std::optional<chat::ChatTemplate> chat_template;
  // How the model writes tool calls: --tool-call-parser, else the chat template's format.
  chat::ToolCallFormat tool_call_format = chat::ToolCallFormat::kHermes;
  std::unique_ptr<EngineLoop> own_loop;  // when serving a local engine
  RequestSink* loop = nullptr;           // where requests go
  std::atomic<int> active_responses{0};
  std::string tokenizer_info_body;  // GET /tokenizer_info, made once the model is attached
  std::once_flag compiler_once;
  std::unique_ptr<GrammarCompiler> compiler;  // structured outputs (grammar_compiler())
  std::mutex ignored_mu;
  std::set<std::string> logged_ignored;  // names already logged by note_ignored
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

  http::Response error_response(const ApiError& e) {
    metrics.request_rejected(e.status);
    return json_response(e.status, e.body());
  }

  // Logs each ignored request field's name the first time a request sends it (a bounded set:
  // a client inventing names cannot grow it forever).
  void note_ignored(const std::vector<std::string>& fields) {
    constexpr size_t kMaxLogged = 1000;
    std::lock_guard lock(ignored_mu);
    for (const std::string& name : fields) {
      if (logged_ignored.size() >= kMaxLogged || !logged_ignored.insert(name).second) continue;
      std::fprintf(stderr, "relay: ignoring the unknown request field '%s' (logged once)\n",
                   name.c_str());
    }
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

  // The checks of a request's options against the model, before any of its choices is submitted:
  // stop tokens in the vocabulary, room for `num_choices` more requests, and prompt logprobs
  // (asked by `param`, or nothing) only where the engine computes them.
  void check_job(const GenerationOptions& o, size_t num_choices, const char* prompt_logprobs_param) {
    check_token_ids(o.stop_token_ids, model.vocab_size, "stop_token_ids");
    if (prompt_logprobs_param != nullptr && !model.prompt_logprobs) {
      throw bad_param(prompt_logprobs_param, str("'", prompt_logprobs_param,
                                                 "' needs prompt logprobs, which this "
                                                 "deployment's backend does not compute"));
    }
    check_capacity(static_cast<int>(num_choices));
  }

  // What a job asks of the sampler besides its options: a compiled grammar (structured output or
  // a forced tool call), logit biases, and where a reasoning model's thinking ends.
  struct Constraints {
    std::shared_ptr<const CompiledGrammar> grammar;
    std::vector<std::pair<int32_t, float>> logit_bias;
    ReasoningTokens reasoning;
  };

  // Built at the first constrained request: building it decodes the whole vocabulary (~50 ms).
  GrammarCompiler& grammar_compiler() {
    std::call_once(compiler_once, [&] {
      GrammarCompilerOptions o;
      o.vocab_size = static_cast<int32_t>(model.vocab_size);
      o.stop_token_ids = model.stop_token_ids;
      compiler = std::make_unique<GrammarCompiler>(*model.tokenizer, o);
    });
    return *compiler;
  }

  // A job's constraints: its structured-output constraint or forced tool calls (`tool_calls`, with
  // the request field `tool_param` that asked) compiled here on the request's thread, so a bad
  // schema is its 400; its logit_bias checked against the vocabulary.
  Constraints constraints(const GenerationOptions& o,
                          const std::optional<GrammarSpec>& tool_calls = std::nullopt) {
    Constraints c;
    std::optional<GrammarSpec> spec;
    std::string param = "tool_choice";
    try {
      if (o.constraint) {
        spec = spec_of(*o.constraint);
        param = o.constraint->param;
      } else {
        spec = tool_calls;
      }
    } catch (const Error& e) {
      throw bad_param(param, e.what());
    }
    if ((spec || !o.logit_bias.empty()) && !model.token_constraints) {
      const std::string field = spec ? param : "logit_bias";
      throw bad_param(field, str("'", field,
                                 "' needs token constraints in the sampler, which this "
                                 "deployment's backend does not apply"));
    }
    for (const auto& [token, bias] : o.logit_bias) {
      check_token_ids({token}, model.vocab_size, "logit_bias");
      c.logit_bias.emplace_back(static_cast<int32_t>(token), static_cast<float>(bias));
    }
    if (spec) {
      try {
        c.grammar = grammar_compiler().compile(*spec);
      } catch (const Error& e) {
        throw bad_param(param, e.what());
      }
    }
    return c;
  }

  // Submits the n choices of one prompt. `num_prompt_logprobs` >= 0 asks the engine for the
  // prompt's logprobs; with max_tokens 0 and none asked (an echo) no engine request is needed.
  void submit(Job& job, const std::vector<int32_t>& prompt, const GenerationOptions& o,
              int64_t max_tokens, int num_prompt_logprobs, const Constraints& constraints,
              const std::string& echo_text = "") {
    const uint64_t seed = o.seed ? *o.seed : random64();
    for (int64_t i = 0; i < o.n; ++i) {
      Choice c;
      c.prompt = prompt;
      c.echo_text = echo_text;
      if (max_tokens == 0 && num_prompt_logprobs < 0) {
        c.finish = FinishReason::kLength;
        c.done = true;
        job.choices.push_back(std::move(c));
        continue;
      }
      EngineRequest r;
      r.prompt = prompt;
      r.num_prompt_logprobs = num_prompt_logprobs;
      r.grammar = constraints.grammar;
      r.logit_bias = constraints.logit_bias;
      r.reasoning = constraints.reasoning;
      r.sampling = sampling_params(o, seed + static_cast<uint64_t>(i));
      r.stop = stop_conditions(o, max_tokens);
      c.handle = loop->submit(std::move(r));
      job.choices.push_back(std::move(c));
    }
  }

  void abort_job(Job& job) {
    for (Choice& c : job.choices) {
      if (!c.done && c.handle) loop->abort(c.handle->id());
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
        if (!out.prompt_logprobs.empty()) c.prompt_logprobs = out.prompt_logprobs;
        c.num_output_tokens = out.num_output_tokens;
        c.num_cached_tokens = out.num_cached_tokens;
        if (out.finish != FinishReason::kNone) {
          c.finish = out.finish;
          c.stop_token = out.stop_token;
          c.stop_string = out.stop_string;
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

  // The legacy completions logprobs of a choice's new tokens `lps`, led by its prompt's tokens when
  // `echo` (the first with null logprobs: nothing precedes it; each other with its top
  // job.top_logprobs alternatives and itself, as vLLM lists them). `text_offset` is the first
  // token's offset in the choice's text and is advanced past them, so a stream's chunks continue it.
  json completion_logprobs(const Job& job, const Choice& c, bool echo,
                           const std::vector<TokenLogprob>& lps, size_t& text_offset) const {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    auto add = [&](int32_t token, const TokenLogprob* lp, bool with_itself) {
      tokens.push_back(token_text(token, job.tokens_as_ids));
      if (lp == nullptr) {
        token_logprobs.push_back(nullptr);
        top.push_back(nullptr);
      } else {
        token_logprobs.push_back(lp->logprob);
        json alts = json::object();
        const size_t k = std::min(lp->top.size(), static_cast<size_t>(job.top_logprobs));
        for (size_t i = 0; i < k; ++i) alts[token_text(lp->top[i].first, job.tokens_as_ids)] = lp->top[i].second;
        if (with_itself) alts[token_text(token, job.tokens_as_ids)] = lp->logprob;
        top.push_back(alts);
      }
      offsets.push_back(text_offset);
      text_offset += model.tokenizer->token_bytes(token).size();
    };
    if (echo) {
      for (size_t pos = 0; pos < c.prompt.size(); ++pos) {
        const bool scored = pos > 0 && pos < c.prompt_logprobs.size() && c.prompt_logprobs[pos];
        add(c.prompt[pos], scored ? &*c.prompt_logprobs[pos] : nullptr, true);
      }
    }
    for (const TokenLogprob& lp : lps) add(lp.token, &lp, false);
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top},
            {"text_offset", offsets}};
  }

  // vLLM's prompt_logprobs of a choice: per prompt position null (the first) or
  // {"<token id>": {"logprob", "rank", "decoded_token"}} for the prompt token and its top k.
  json prompt_logprobs_json(const Choice& c, int k) const {
    json out = json::array();
    for (size_t pos = 0; pos < c.prompt.size(); ++pos) {
      if (pos == 0 || pos >= c.prompt_logprobs.size() || !c.prompt_logprobs[pos]) {
        out.push_back(nullptr);
        continue;
      }
      const TokenLogprob& lp = *c.prompt_logprobs[pos];
      json entry = json::object();
      auto add = [&](int32_t id, float logprob, int rank) {
        const std::string key = std::to_string(id);
        if (entry.contains(key)) return;
        entry[key] = {{"logprob", logprob},
                      {"rank", rank},
                      {"decoded_token", utf8::sanitize(model.tokenizer->token_bytes(id))}};
      };
      add(lp.token, lp.logprob, lp.rank);
      const size_t n = std::min(lp.top.size(), static_cast<size_t>(k));
      for (size_t i = 0; i < n; ++i) add(lp.top[i].first, lp.top[i].second, static_cast<int>(i) + 1);
      out.push_back(std::move(entry));
    }
    return out;
  }

  // vLLM's stop_reason: the stop token id or stop string that ended the choice, or null.
  static json stop_reason(const Choice& c) {
    if (c.stop_token) return *c.stop_token;
    if (c.stop_string) return *c.stop_string;
    return nullptr;
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

  // Answers a submitted job on `ex`. A failure the job meets before its response starts gets its
  // HTTP status (503 when no capacity, 500 when the engine failed): a non-streaming response is
  // written only once every choice is done; a stream starts with its first output, or after one
  // heartbeat interval when none came, and a later failure can only be an error event in it. A
  // client that goes away (Exchange::client_connected, or a failed write) aborts the job, which
  // frees its KV blocks.
  void respond(Job job, http::Exchange& ex) {
    ++active_responses;
    struct Done {
      std::atomic<int>& n;
      ~Done() { --n; }
    } done{active_responses};
    std::vector<std::pair<size_t, RequestOutput>> early;  // outputs before a stream started
    const Clock::time_point first_byte_by = Clock::now() + kHeartbeatInterval;
    while (!job.all_done() && !(job.stream && (!early.empty() || Clock::now() > first_byte_by))) {
      poll(job, [&](size_t i, const RequestOutput& out) {
        if (job.stream) early.emplace_back(i, out);
      });
      if (!ex.client_connected()) return abort_job(job);
    }
    if (job.all_done() && early.empty()) {
      if (const auto err = job_error(job)) {
        ex.respond(json_response(err->status, err->body()));
        return;
      }
    }
    if (!job.stream) {
      ex.respond(http::Response{200, "application/json", complete_job(job), {}});
      return;
    }
    if (!ex.start_stream(200, "text/event-stream") || !stream_job(job, ex, early)) abort_job(job);
  }

  // Waits for the job, calling on_output per output, and writes `heartbeat` whenever nothing was
  // written for a while: a write to a client that hung up fails, which ends the wait. False when
  // the client is gone.
  bool wait_with_heartbeat(Job& job, http::Exchange& ex, const std::string& heartbeat,
                           const std::function<bool(size_t, const RequestOutput&)>& on_output) {
    Clock::time_point last_write = Clock::now();
    bool ok = true;
    while (ok && !job.all_done()) {
      poll(job, [&](size_t i, const RequestOutput& out) {
        if (ok && on_output(i, out)) last_write = Clock::now();
        ok = ok && !ex.failed();
      });
      if (ok && Clock::now() - last_write > kHeartbeatInterval) {
        ok = ex.write(heartbeat);
        last_write = Clock::now();
      }
    }
    return ok;
  }

  // Streams the job as server-sent events, starting with the outputs that came before the stream
  // started. False when the client is gone.
  bool stream_job(Job& job, http::Exchange& ex,
                  const std::vector<std::pair<size_t, RequestOutput>>& early) {
    auto sse = [&](const json& j) { return ex.write("data: " + dump(j) + "\n\n"); };
    std::vector<int> num_calls(job.choices.size(), 0);
    if (job.chat) {
      for (size_t i = 0; i < job.choices.size(); ++i) {
        json c = chunk_base(job);
        c["choices"] = json::array({{{"index", i},
                                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                                     {"logprobs", nullptr},
                                     {"finish_reason", nullptr}}});
        if (job.include_usage) c["usage"] = nullptr;
        if (!sse(c)) return false;
      }
    }
    // Completions with echo: a choice's first chunk leads with its prompt (and its logprobs).
    std::vector<bool> echoed(job.choices.size(), !job.echo);
    std::vector<size_t> text_offset(job.choices.size(), 0);
    // Writes the chunk of one output (if it has anything to say); true when it wrote.
    auto on_output = [&](size_t i, const RequestOutput& out) {
      const Choice& ch = job.choices[i];
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
        const bool echo_now = !echoed[i];
        echoed[i] = true;
        const std::string text = echo_now ? ch.echo_text + out.text : out.text;
        has_content = has_content || !text.empty();
        choice["text"] = text;
        if (job.logprobs && (echo_now || !out.logprobs.empty())) {
          choice["logprobs"] = completion_logprobs(job, ch, echo_now, out.logprobs, text_offset[i]);
        }
      }
      if (out.finish != FinishReason::kNone) {
        choice["finish_reason"] = finish_name(out.finish, num_calls[i] > 0);
        choice["stop_reason"] = stop_reason(ch);
        has_content = true;
      }
      if (!has_content) return false;
      json c = chunk_base(job);
      c["choices"] = json::array({choice});
      if (job.include_usage) c["usage"] = nullptr;
      sse(c);
      return true;
    };
    // Choices that needed no engine (an echo with max_tokens 0) are complete already.
    for (size_t i = 0; i < job.choices.size(); ++i) {
      if (job.choices[i].handle) continue;
      RequestOutput done;
      done.finish = job.choices[i].finish;
      on_output(i, done);
    }
    for (const auto& [i, out] : early) {
      on_output(i, out);
      if (ex.failed()) return false;
    }
    if (!wait_with_heartbeat(job, ex, ": keep-alive\n\n", on_output)) return false;
    if (const auto err = job_error(job)) {
      sse(err->body());
    } else if (job.include_usage) {
      json c = chunk_base(job);
      c["choices"] = json::array();
      c["usage"] = usage(job);
      sse(c);
    }
    return ex.write("data: [DONE]\n\n");
  }

  // The body of a finished, successful non-streaming job.
  std::string complete_job(Job& job) {
    json choices = json::array();
    for (size_t i = 0; i < job.choices.size(); ++i) {
      const Choice& c = job.choices[i];
      json choice = {{"index", i}, {"logprobs", nullptr}};
      size_t text_offset = 0;
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
        choice["text"] = c.echo_text + c.text;
        choice["finish_reason"] = finish_name(c.finish, false);
        if (job.logprobs) {
          choice["logprobs"] = completion_logprobs(job, c, job.echo, c.logprobs, text_offset);
        }
        if (job.prompt_logprobs) choice["prompt_logprobs"] = prompt_logprobs_json(c, *job.prompt_logprobs);
      }
      choice["stop_reason"] = stop_reason(c);
      choices.push_back(std::move(choice));
    }
    json body = {
        {"id", job.id},           {"object", job.chat ? "chat.completion" : "text_completion"},
        {"created", job.created}, {"model", options.served_model_name},
        {"choices", choices},     {"usage", usage(job)}};
    // vLLM puts a chat request's prompt logprobs beside its choices (they share one prompt).
    if (job.chat && job.prompt_logprobs) {
      body["prompt_logprobs"] = prompt_logprobs_json(job.choices.front(), *job.prompt_logprobs);
    }
    return dump(body);
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

  // The grammar of the tool calls a chat request forces (tool_choice "required" or a named
  // function): the model's tool-call text, with each function's parameters as its schema.
  std::optional<GrammarSpec> forced_tool_calls(const ChatRequest& r) const {
    if (r.tool_choice != "required") return std::nullopt;
    std::vector<ToolFunction> functions;
    for (const json& tool : r.tools) {
      const json& f = tool["function"];
      const std::string name = f["name"].get<std::string>();
      if (!r.tool_choice_function.empty() && name != r.tool_choice_function) continue;
      const auto parameters = f.find("parameters");
      functions.push_back({name, parameters == f.end() || parameters->is_null() ? "" : dump(*parameters)});
    }
    const bool one = !r.tool_choice_function.empty() || !r.parallel_tool_calls;
    try {
      return GrammarSpec::tool_calls(functions,
                                     one ? ToolCallCount::kExactlyOne : ToolCallCount::kOneOrMore,
                                     tool_call_format);
    } catch (const Error& e) {
      throw bad_param("tools", e.what());
    }
  }

  // ---- endpoints ----

  void chat_completions(http::Exchange& ex) {
    check_ready();
    ChatRequest r = parse_chat_request(ex.request().body);
    note_ignored(r.ignored_fields);
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
    job.top_logprobs = static_cast<int>(r.options.top_logprobs);
    job.tokens_as_ids = r.options.return_tokens_as_token_ids;
    job.num_prompt_tokens = static_cast<int>(ids.size());
    if (r.options.prompt_logprobs) job.prompt_logprobs = static_cast<int>(*r.options.prompt_logprobs);
    const auto thinking = r.chat_template_kwargs.find("enable_thinking");
    job.parse_reasoning = thinking == r.chat_template_kwargs.end() || thinking->is_null() ||
                          (thinking->is_boolean() && thinking->get<bool>());
    // Templates that open the think block themselves leave the model inside it from the start.
    job.starts_in_reasoning =
        std::string_view(prompt).substr(0, prompt.find_last_not_of(" \n") + 1).ends_with("<think>");
    job.parse_tools = use_tools;
    check_job(r.options, static_cast<size_t>(r.options.n),
              job.prompt_logprobs ? "prompt_logprobs" : nullptr);
    Constraints c = constraints(r.options, forced_tool_calls(r));
    // A reasoning model thinks first: the constraint applies to what follows its thinking.
    if (job.parse_reasoning) {
      const auto open = model.tokenizer->token_to_id("<think>");
      const auto close = model.tokenizer->token_to_id("</think>");
      if (open && close) c.reasoning = {*open, *close, job.starts_in_reasoning};
    }
    submit(job, ids, r.options, max_tokens, job.prompt_logprobs.value_or(-1), c);
    const auto parameter_types = use_tools && tool_call_format == chat::ToolCallFormat::kQwen3Coder
                                     ? std::make_shared<const ToolParameterTypes>(r.tools)
                                     : nullptr;
    for (size_t i = 0; i < job.choices.size(); ++i) {
      job.parsers.emplace_back(job.parse_reasoning, job.starts_in_reasoning, job.parse_tools,
                               tool_call_format, parameter_types);
    }
    respond(std::move(job), ex);
  }

  void completions(http::Exchange& ex) {
    check_ready();
    CompletionRequest r = parse_completion_request(ex.request().body);
    note_ignored(r.ignored_fields);
    check_model(r.model);
    // Every prompt is checked before any is submitted: a bad one fails the whole request.
    struct Prompt {
      std::vector<int32_t> ids;
      std::string text;  // for echo
      int64_t max_tokens = 0;
    };
    std::vector<Prompt> prompts;
    for (const CompletionPrompt& p : r.prompts) {
      Prompt one;
      if (p.text) {
        one.ids = model.tokenizer->encode(*p.text);
        one.text = *p.text;
        if (one.ids.empty()) throw bad_param("prompt", "'prompt' encodes to no tokens");
      } else {
        check_token_ids(p.ids, model.vocab_size, "prompt");
        one.ids.assign(p.ids.begin(), p.ids.end());
        if (r.echo) one.text = model.tokenizer->decode(one.ids);
      }
      one.max_tokens = check_context_length(static_cast<int64_t>(one.ids.size()), r.options,
                                            model.max_model_len, "prompt");
      prompts.push_back(std::move(one));
    }
    Job job;
    job.id = random_id("cmpl-");
    job.created = unix_time();
    job.chat = false;
    job.stream = r.options.stream;
    job.include_usage = r.options.include_usage;
    job.logprobs = r.options.logprobs;
    job.top_logprobs = static_cast<int>(r.options.top_logprobs);
    job.tokens_as_ids = r.options.return_tokens_as_token_ids;
    job.echo = r.echo;
    if (r.options.prompt_logprobs) job.prompt_logprobs = static_cast<int>(*r.options.prompt_logprobs);
    // The engine scores the prompt for echo with logprobs and for prompt_logprobs, with as many
    // alternatives as the larger of the two asks.
    int num_prompt_logprobs = job.prompt_logprobs.value_or(-1);
    if (job.echo && job.logprobs) num_prompt_logprobs = std::max(num_prompt_logprobs, job.top_logprobs);
    check_job(r.options, prompts.size() * static_cast<size_t>(r.options.n),
              job.prompt_logprobs ? "prompt_logprobs"
              : num_prompt_logprobs >= 0 ? "echo" : nullptr);
    const Constraints c = constraints(r.options);
    for (const Prompt& p : prompts) {
      job.num_prompt_tokens += static_cast<int>(p.ids.size());
      submit(job, p.ids, r.options, p.max_tokens, num_prompt_logprobs, c, r.echo ? p.text : "");
    }
    respond(std::move(job), ex);
  }

  // vLLM's /tokenize: the ids (and, on request, the vocabulary strings) of a prompt or of chat
  // messages rendered by the chat template, with the context they would have.
  http::Response tokenize(const http::Request& req) {
    check_ready();
    const TokenizeRequest r = parse_tokenize_request(req.body);
    note_ignored(r.ignored_fields);
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
    return json_response(200, body);
  }

  // vLLM's /detokenize: the text of token ids (special tokens kept, as vLLM does).
  http::Response detokenize(const http::Request& req) {
    check_ready();
    const DetokenizeRequest r = parse_detokenize_request(req.body);
    note_ignored(r.ignored_fields);
    if (r.model) check_model(*r.model);
    check_token_ids(r.tokens, model.vocab_size, "tokens");
    const std::vector<int32_t> ids(r.tokens.begin(), r.tokens.end());
    return json_response(200, {{"prompt", utf8::sanitize(model.tokenizer->decode(ids))}});
  }

  http::Response models() {
    check_ready();
    json m = {{"id", options.served_model_name}, {"object", "model"},
              {"created", unix_time()},          {"owned_by", "relay"},
              {"root", options.model_path},      {"max_model_len", model.max_model_len}};
    return json_response(200, {{"object", "list"}, {"data", json::array({m})}});
  }

  http::Response health() const {
    const Phase p = phase.load();
    // A ready server whose engine can run no more steps (a multi-node worker that lost a node, a
    // router with no worker of a role up) is unhealthy: a load balancer or orchestrator should
    // route around it and restart it.
    if (p == Phase::kReady && loop) {
      if (const std::string why = loop->unusable_reason(); !why.empty()) {
        return json_response(503, {{"status", "unusable"}, {"reason", why}});
      }
    }
    return json_response(p == Phase::kReady ? 200 : 503,
                         {{"status", p == Phase::kReady     ? "ok"
                                     : p == Phase::kLoading ? "loading"
                                                            : "draining"}});
  }

  // /v1 routes with --api-key: the key, compared in constant time.
  std::optional<http::Response> authenticate(const http::Request& req) {
    if (options.api_key.empty() || !req.path.starts_with("/v1/")) return std::nullopt;
    if (http::same_secret(req.header("Authorization"), "Bearer " + options.api_key)) {
      return std::nullopt;
    }
    return error_response(ApiError{401,
                                   "Incorrect or missing API key (send 'Authorization: Bearer "
                                   "<key>')",
                                   "invalid_request_error", "", "invalid_api_key"});
  }
};

HttpServer::HttpServer(ServerOptions options)
    : state_(std::make_unique<State>(std::move(options))) {}

HttpServer::~HttpServer() { stop(); }

void HttpServer::start() {
  State& s = *state_;
  http::Server& svr = s.svr;
  svr.set_guard([&s](const http::Request& req) { return s.authenticate(req); });
  // An ApiError from a handler is its request's answer.
  auto answer = [&s](auto handler) {
    return [&s, handler](const http::Request& req) -> http::Response {
      try {
        return handler(req);
      } catch (const ApiError& e) {
        return s.error_response(e);
      }
    };
  };
  auto answer_stream = [&s](auto handler) {
    return [&s, handler](http::Exchange& ex) {
      try {
        handler(ex);
      } catch (const ApiError& e) {
        if (!ex.responded()) ex.respond(s.error_response(e));
      }
    };
  };
  // Cheap routes answer on the event loop, so they answer under any load.
  svr.route_inline("GET", "/health", [&s](const http::Request&) { return s.health(); });
  svr.route_inline("GET", "/metrics", [&s](const http::Request&) {
    return http::Response{200, "text/plain; version=0.0.4", s.metrics.render(), {}};
  });
  svr.route_inline("GET", "/version", [](const http::Request&) {
    return json_response(200, {{"version", RELAY_VERSION}});
  });
  svr.route_inline("GET", "/v1/models", answer([&s](const http::Request&) { return s.models(); }));
  svr.route_inline("GET", "/tokenizer_info", answer([&s](const http::Request&) {
                     s.check_ready();
                     return http::Response{200, "application/json", s.tokenizer_info_body, {}};
                   }));
  svr.route_blocking("POST", "/tokenize",
                     answer([&s](const http::Request& req) { return s.tokenize(req); }));
  svr.route_blocking("POST", "/detokenize",
                     answer([&s](const http::Request& req) { return s.detokenize(req); }));
  svr.route("POST", "/v1/chat/completions",
            answer_stream([&s](http::Exchange& ex) { s.chat_completions(ex); }));
  svr.route("POST", "/v1/completions",
            answer_stream([&s](http::Exchange& ex) { s.completions(ex); }));
  svr.start();
  port_ = svr.port();
}

void HttpServer::attach(LLMEngine& engine, chat::ChatTemplate chat_template) {
  State& s = *state_;
  s.own_loop = std::make_unique<EngineLoop>(engine, s.metrics);
  attach(ServedModel{&engine.tokenizer(), engine.model_config().vocab_size, engine.max_model_len(),
                     engine.supports_prompt_logprobs(), engine.supports_token_constraints(),
                     engine.model_config().eos_token_ids},
         *s.own_loop, std::move(chat_template));
}

void HttpServer::attach(const ServedModel& model, RequestSink& sink,
                        chat::ChatTemplate chat_template) {
  State& s = *state_;
  s.model = model;
  s.tokenizer_info_body = dump(tokenizer_info(s.options.model_path, model.max_model_len));
  s.tool_call_format = s.options.tool_call_format.value_or(chat_template.tool_call_format());
  std::fprintf(stderr, "relay: tool calls in the %s format (%s)\n",
               std::string(chat::tool_call_format_name(s.tool_call_format)).c_str(),
               s.options.tool_call_format ? "--tool-call-parser" : "the chat template's");
  s.chat_template.emplace(std::move(chat_template));
  s.loop = &sink;
  s.phase = Phase::kReady;
}

void HttpServer::add_routes(const std::function<void(http::Server&)>& add) { add(state_->svr); }

Metrics& HttpServer::metrics() { return state_->metrics; }

GrammarCompiler& HttpServer::grammar_compiler() { return state_->grammar_compiler(); }

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
  // The requests first: their handlers then return, and the HTTP server's workers can be joined.
  if (state_->loop) state_->loop->stop();
  state_->svr.stop();
}

}  // namespace relay::server

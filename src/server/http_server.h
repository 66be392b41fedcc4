// The OpenAI-compatible HTTP front end: routes, authentication, streaming, draining.
//
// Life cycle: start() binds and answers at once (/health is 503 and /v1 routes are 503 while the
// model loads), attach() hands over the loaded engine, drain() stops taking new requests (503) and
// waits for the running ones, stop() fails what is left and closes the listener. Each request is
// validated completely (openai_protocol.h) before it reaches the engine; the engine thread
// (engine_loop.h) runs the steps and the worker thread of each request only formats its outputs.
// The transport is http/server.h: /health, /metrics, /version and /v1/models answer on its event
// loop, so they answer under any load; generation runs on its workers. A non-streaming response is
// written once the request is done, so a failure carries its HTTP status (500, or 503 for no
// capacity and shutdown); a stream starts with its first output and sends an SSE comment as a
// heartbeat while it waits. A client that goes away (found by http::Exchange::client_connected, or
// a failed write) has its request aborted, freeing its KV blocks; one that only half-closes keeps
// it.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "chat/chat_template.h"
#include "engine/llm_engine.h"
#include "http/server.h"
#include "server/engine_loop.h"
#include "server/metrics.h"

namespace relay::server {

// What the front end needs to know of the model it serves.
struct ServedModel {
  const Tokenizer* tokenizer = nullptr;
  int64_t vocab_size = 0;
  int max_model_len = 0;
  bool prompt_logprobs = false;  // the engine computes prompt logprobs (echo + logprobs)
  // The engine applies token constraints (structured outputs, logit_bias, forced tool calls); the
  // grammars are compiled here, over `vocab_size` tokens, completing at `stop_token_ids`.
  bool token_constraints = false;
  std::vector<int32_t> stop_token_ids;
};

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;            // empty: no authentication
  std::string served_model_name;  // the name clients pass as "model"
  std::string model_path;         // also accepted as the model name
  int max_queue = 256;            // requests waiting beyond max_num_seqs before 429
  int max_num_seqs = 64;
  // The transport's limits (http/server.h): open connections, and how long a client may take to
  // start and send a request head.
  int max_connections = 4096;
  double request_head_timeout_s = 10.0;
  double keep_alive_timeout_s = 60.0;
  http::TlsOptions tls;  // HTTPS when tls.enabled() (vLLM's --ssl-* options)
  // The format the model writes tool calls in (vLLM's --tool-call-parser); nullopt: the one its
  // chat template renders them in (chat::ChatTemplate::tool_call_format).
  std::optional<chat::ToolCallFormat> tool_call_format;
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions options);
  ~HttpServer();

  // Binds host:port (port 0 picks a free one) and serves in a background thread. Throws on failure.
  void start();
  int port() const { return port_; }
  // The engine is loaded: /health turns 200 and /v1 routes work. The engine must outlive the
  // server.
  void attach(LLMEngine& engine, chat::ChatTemplate chat_template);
  // The same for a deployment whose engines are elsewhere: requests go to `sink`, prompts are
  // tokenized and checked here with `model` (which, like the sink, must outlive the server).
  void attach(const ServedModel& model, RequestSink& sink, chat::ChatTemplate chat_template);
  // Extra routes (a worker's internal API) on the same listener; call before start().
  void add_routes(const std::function<void(http::Server&)>& add);
  Metrics& metrics();
  // The compiler of the served model's grammars (after attach; built at its first use), which a
  // disaggregated worker also compiles the router's grammars with.
  GrammarCompiler& grammar_compiler();
  // Refuses new requests (503) and waits until running ones finish or `timeout_s` passes; then
  // fails what is left. Returns whether everything finished in time.
  bool drain(double timeout_s);
  void stop();

 private:
  struct State;
  std::unique_ptr<State> state_;
  int port_ = 0;
};

}  // namespace relay::server

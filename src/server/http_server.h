// The OpenAI-compatible HTTP front end: routes, authentication, streaming, draining.
//
// Life cycle: start() binds and answers at once (/health is 503 and /v1 routes are 503 while the
// model loads), attach() hands over the loaded engine, drain() stops taking new requests (503) and
// waits for the running ones, stop() closes the listener. Each request is validated completely
// (openai_protocol.h) before it reaches the engine; the engine thread (engine_loop.h) runs the
// steps and the HTTP thread of each request only formats its outputs. Every generation response,
// streamed or not, is written through a chunked provider that also sends a heartbeat (an SSE
// comment, or JSON-insignificant whitespace) while the request waits, so a client that went away is
// noticed by a failed write and its request is aborted, freeing its KV blocks.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "chat/chat_template.h"
#include "engine/llm_engine.h"
#include "server/engine_loop.h"
#include "server/metrics.h"

namespace httplib {
class Server;
}

namespace relay::server {

// What the front end needs to know of the model it serves.
struct ServedModel {
  const Tokenizer* tokenizer = nullptr;
  int64_t vocab_size = 0;
  int max_model_len = 0;
};

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;            // empty: no authentication
  std::string served_model_name;  // the name clients pass as "model"
  std::string model_path;         // also accepted as the model name
  int max_queue = 256;            // requests waiting beyond max_num_seqs before 429
  int max_num_seqs = 64;
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
  void add_routes(const std::function<void(httplib::Server&)>& add);
  Metrics& metrics();
  // Refuses new requests (503) and waits until running ones finish or `timeout_s` passes; then
  // fails what is left. Returns whether everything finished in time.
  bool drain(double timeout_s);
  void stop();

 private:
  struct State;
  std::unique_ptr<State> state_;
  int port_ = 0;
  std::thread listen_thread_;
};

}  // namespace relay::server

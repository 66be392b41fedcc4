// `relay serve`: the OpenAI-compatible server in one process (CPU or CUDA backend).
//
// The listener comes up first, so /health answers 503 while the model loads; SIGTERM or SIGINT
// starts a drain: new requests get 503, running ones get --drain-timeout seconds to finish, and the
// process exits 0. Signals are blocked in every thread and taken synchronously by the main thread
// (sigwait), so no work happens inside a signal handler.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "chat/chat_template.h"
#include "cli/backend_choice.h"
#include "cli/command.h"
#include "core/error.h"
#include "engine/llm_engine.h"
#include "server/http_server.h"
#include "tokenizer/tokenizer.h"

namespace relay::cli {
namespace {

struct ServeOptions {
  std::string model_dir = default_model_dir();
  std::string served_model_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int max_model_len = 0;
  BackendChoice backend;
  int max_queue = 256;
  double drain_timeout_s = 30.0;
  bool no_prefix_caching = false;
};

int run_serve(const ServeOptions& o) {
  using Clock = std::chrono::steady_clock;
  // Block the shutdown signals before any thread starts, so that every thread inherits the mask and
  // only sigwait below receives them; a client that hangs up must not kill the process either.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  server::ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.api_key = o.api_key;
  so.model_path = o.model_dir;
  so.served_model_name =
      o.served_model_name.empty()
          ? std::filesystem::path(o.model_dir).lexically_normal().filename().string()
          : o.served_model_name;
  if (so.served_model_name.empty()) so.served_model_name = o.model_dir;
  so.max_queue = o.max_queue;
  so.max_num_seqs = o.max_num_seqs;
  server::HttpServer http(so);
  http.start();
  std::fprintf(stderr, "relay: listening on http://%s:%d (model loading)\n", o.host.c_str(),
               http.port());

  const Clock::time_point load_start = Clock::now();
  std::fprintf(stderr, "relay: loading %s on %s ...\n", o.model_dir.c_str(),
               o.backend.device.c_str());
  const Tokenizer tokenizer = Tokenizer::from_model_dir(o.model_dir);
  chat::ChatTemplate chat_template = chat::ChatTemplate::from_model_dir(o.model_dir);
  auto backend = make_backend(o.model_dir, o.backend, o.max_num_seqs, o.max_num_batched_tokens);
  EngineConfig ec;
  ec.max_num_seqs = o.max_num_seqs;
  ec.max_num_batched_tokens = o.max_num_batched_tokens;
  ec.max_model_len = o.max_model_len;
  ec.enable_prefix_caching = !o.no_prefix_caching;
  LLMEngine engine(std::move(backend), tokenizer, ec);
  std::fprintf(stderr,
               "relay: loaded '%s' in %.2f s: %d KV blocks of %d tokens, max_model_len %d, "
               "max_num_seqs %d\n",
               so.served_model_name.c_str(),
               std::chrono::duration<double>(Clock::now() - load_start).count(),
               engine.backend().num_kv_blocks(), engine.backend().block_size(),
               engine.max_model_len(), o.max_num_seqs);
  http.attach(engine, std::move(chat_template));
  std::fprintf(stderr, "relay: ready\n");

  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "relay: %s received, draining (up to %.0f s)\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT", o.drain_timeout_s);
  const bool drained = http.drain(o.drain_timeout_s);
  http.stop();
  std::fprintf(
      stderr, "relay: %s, exiting\n",
      drained ? "all requests finished" : "drain timeout: unfinished requests were failed");
  return 0;
}

CommandRegistrar serve_command({
    "serve",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<ServeOptions>();
      sub.add_option("--model", o->model_dir,
                     "checkpoint directory (default: the embedded demo model)");
      sub.add_option("--served-model-name", o->served_model_name,
                     "the model name clients use (default: the directory's name)");
      sub.add_option("--host", o->host, "address to listen on (default 127.0.0.1)");
      sub.add_option("--port", o->port, "port to listen on (default 8000)")
          ->check(CLI::Range(0, 65535));
      sub.add_option("--api-key", o->api_key, "require 'Authorization: Bearer KEY' on /v1 routes");
      sub.add_option("--max-num-seqs", o->max_num_seqs, "sequences batched at once (default 64)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--max-num-batched-tokens", o->max_num_batched_tokens,
                     "tokens computed per step: decodes plus prefill chunks (default 2048)")
          ->check(CLI::PositiveNumber);
      sub.add_option(
             "--max-model-len", o->max_model_len,
             "context length: prompt + completion (default: the model's, capped by the KV pool)")
          ->check(CLI::PositiveNumber);
      sub.add_option(
             "--max-queue", o->max_queue,
             "requests that may wait beyond --max-num-seqs before new ones get 429 (default 256)")
          ->check(CLI::NonNegativeNumber);
      sub.add_option("--drain-timeout", o->drain_timeout_s,
                     "seconds running requests get to finish after SIGTERM (default 30)")
          ->check(CLI::NonNegativeNumber);
      sub.add_flag("--no-prefix-caching", o->no_prefix_caching, "recompute shared prompt prefixes");
      add_backend_options(sub, o->backend);
      return [o] { return run_serve(*o); };
    },
    "serve the OpenAI-compatible HTTP API (chat, completions, models, health, metrics)",
});

}  // namespace
}  // namespace relay::cli

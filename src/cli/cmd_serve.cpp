// `relay serve`: the OpenAI-compatible server on one process (CPU backend).
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
#include "cli/command.h"
#include "core/error.h"
#include "engine/cpu_backend.h"
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
  std::string kv_cache_memory = "256MiB";
  int num_kv_blocks = 0;
  int block_size = 16;
  int max_queue = 256;
  double drain_timeout_s = 30.0;
  bool no_prefix_caching = false;
  int num_threads = 0;
};

// "512MiB", "2G", "1.5GiB", "1000000" -> bytes.
size_t parse_bytes(const std::string& text) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    fail(str("--kv-cache-memory: cannot read a size from '", text, "'"));
  }
  const std::string unit = text.substr(pos);
  double scale = 1;
  if (unit == "" || unit == "B") {
    scale = 1;
  } else if (unit == "K" || unit == "KiB" || unit == "KB") {
    scale = 1024.0;
  } else if (unit == "M" || unit == "MiB" || unit == "MB") {
    scale = 1024.0 * 1024;
  } else if (unit == "G" || unit == "GiB" || unit == "GB") {
    scale = 1024.0 * 1024 * 1024;
  } else {
    fail(str("--kv-cache-memory: unknown unit '", unit, "' in '", text,
             "' (use B, KiB, MiB or GiB)"));
  }
  RELAY_CHECK(v > 0, "--kv-cache-memory must be positive, got '", text, "'");
  return static_cast<size_t>(v * scale);
}

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
  std::fprintf(stderr, "relay: loading %s ...\n", o.model_dir.c_str());
  const Tokenizer tokenizer = Tokenizer::from_model_dir(o.model_dir);
  chat::ChatTemplate chat_template = chat::ChatTemplate::from_model_dir(o.model_dir);
  CpuBackendOptions bo;
  bo.block_size = o.block_size;
  bo.num_blocks = o.num_kv_blocks;
  bo.kv_cache_bytes = parse_bytes(o.kv_cache_memory);
  bo.num_threads = o.num_threads;
  auto backend = std::make_unique<CpuBackend>(o.model_dir, bo);
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
      sub.add_option("--kv-cache-memory", o->kv_cache_memory,
                     "KV pool size, e.g. 512MiB or 2GiB (default 256MiB)");
      sub.add_option("--num-kv-blocks", o->num_kv_blocks,
                     "exact KV pool size in blocks (overrides --kv-cache-memory)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--block-size", o->block_size, "tokens per KV block (default 16)")
          ->check(CLI::PositiveNumber);
      sub.add_option(
             "--max-queue", o->max_queue,
             "requests that may wait beyond --max-num-seqs before new ones get 429 (default 256)")
          ->check(CLI::NonNegativeNumber);
      sub.add_option("--drain-timeout", o->drain_timeout_s,
                     "seconds running requests get to finish after SIGTERM (default 30)")
          ->check(CLI::NonNegativeNumber);
      sub.add_flag("--no-prefix-caching", o->no_prefix_caching, "recompute shared prompt prefixes");
      sub.add_option("--threads", o->num_threads,
                     "CPU threads for the backend (default: all cores)");
      return [o] { return run_serve(*o); };
    },
    "serve the OpenAI-compatible HTTP API (chat, completions, models, health, metrics)",
});

}  // namespace
}  // namespace relay::cli

// `relay serve`: the OpenAI-compatible server in one process (CPU or CUDA backend), or one role of
// a disaggregated deployment (--role router | prefill | decode, docs/disaggregation.md).
//
// The listener comes up first, so /health answers 503 while the model loads; SIGTERM or SIGINT
// starts a drain: new requests get 503, running ones get --drain-timeout seconds to finish, and the
// process exits 0. Signals are blocked in every thread and taken synchronously by the main thread
// (sigwait), so no work happens inside a signal handler.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "chat/chat_template.h"
#include "cli/backend_choice.h"
#include "cli/command.h"
#include "core/error.h"
#include "disagg/auth.h"
#include "disagg/registry.h"
#include "disagg/router.h"
#include "disagg/worker.h"
#include "engine/llm_engine.h"
#include "http/server.h"
#include "model/config.h"
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
  int num_state_snapshots = -1;    // hybrid models; -1: max_num_seqs
  std::string speculative_config;  // vLLM's --speculative-config JSON
  std::string tool_call_parser;    // vLLM's --tool-call-parser name; empty: the chat template's
  int max_connections = 4096;
  double request_head_timeout_s = 10.0;
  double keep_alive_timeout_s = 60.0;
  // TLS (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs): the listener's,
  // and a disaggregated role's client side towards https peers (mutual TLS).
  http::TlsOptions tls;
  int ssl_cert_reqs = 0;  // Python ssl's CERT_NONE (0), CERT_OPTIONAL (1), CERT_REQUIRED (2)
  // Disaggregation.
  std::string role = "all";  // all (one process), router, prefill, decode
  std::string router;        // workers: the router's host:port
  std::string worker_url;    // workers: how the router reaches this one (default http://host:port)
  double heartbeat_s = 1.0;
  double kv_transfer_timeout_s = 30.0;
  std::string ucx_transports;         // workers: UCX_TLS-style list (default: UCX chooses)
  std::string kv_transport = "auto";  // workers: auto, ucx, cuda_ipc
  double prefill_capacity = 0.0;      // router: prompt tokens/s per prefill worker (0: measured)
  int decode_target_batch = 32;       // router: sequences per decode worker before scaling out
  double worker_wait_s = 30.0;        // router: how long a request waits for a worker with room
  std::string disagg_secret_file;     // the control plane's shared secret (disagg/auth.h)
  bool insecure_control_plane = false;
};

// The --ssl-* options as http::TlsOptions; throws relay::Error on an incomplete set.
http::TlsOptions tls_options(const ServeOptions& o) {
  RELAY_CHECK(o.tls.cert_file.empty() == o.tls.key_file.empty(),
              "--ssl-certfile and --ssl-keyfile go together");
  RELAY_CHECK(o.ssl_cert_reqs == 0 || o.tls.enabled(), "--ssl-cert-reqs ", o.ssl_cert_reqs,
              " needs --ssl-certfile and --ssl-keyfile");
  RELAY_CHECK(o.ssl_cert_reqs == 0 || !o.tls.ca_file.empty(), "--ssl-cert-reqs ", o.ssl_cert_reqs,
              " needs --ssl-ca-certs: the CA that signs the clients' certificates");
  http::TlsOptions t = o.tls;
  t.client_cert = static_cast<http::TlsOptions::ClientCert>(o.ssl_cert_reqs);
  return t;
}

// The URL scheme of this process's listener.
const char* scheme(const ServeOptions& o) { return o.tls.enabled() ? "https" : "http"; }

// What the prefix cache does for this model, for the start-up log.
std::string prefix_caching_summary(const Backend& backend, const EngineConfig& ec) {
  if (!ec.enable_prefix_caching) return "prefix caching off (--no-prefix-caching)";
  if (backend.num_state_slots() == 0) return "prefix caching on (full KV blocks, by chained hash)";
  const int snapshots = backend.num_state_snapshots();
  if (snapshots == 0) {
    return "prefix caching off: the model has linear-attention layers and no recurrent-state "
           "snapshots (--num-state-snapshots 0)";
  }
  return str(
      "prefix caching on (full KV blocks, by chained hash; linear-attention layers: ", snapshots,
      " recurrent-state snapshots at block boundaries, ", backend.state_slot_bytes() >> 10,
      " KiB each; a hit reaches the last snapshotted block boundary)");
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// The control plane's authentication for a disaggregated role: the shared secret's signatures, or
// nothing where that is allowed (a loopback listener, mutual TLS that admits only holders of the
// deployment's certificates, or --insecure-control-plane said so). Secret and mutual TLS combine.
std::shared_ptr<disagg::ControlPlaneAuth> control_plane_auth(const ServeOptions& o) {
  if (!o.disagg_secret_file.empty()) {
    return disagg::ControlPlaneAuth::from_file(o.disagg_secret_file);
  }
  const bool mutual_tls = o.ssl_cert_reqs == 2;
  RELAY_CHECK(is_loopback(o.host) || mutual_tls || o.insecure_control_plane, "--role ", o.role,
              " on --host ", o.host, ": the control plane would accept anyone who reaches this ",
              "port (a fake worker would receive users' prompts); give every process of the ",
              "deployment the same --disagg-secret-file (e.g. from `openssl rand -hex 32`) or ",
              "certificates from one CA with --ssl-cert-reqs 2, or pass ",
              "--insecure-control-plane on a network only the deployment can reach");
  std::fprintf(stderr, "relay: the control plane is %s (no --disagg-secret-file)\n",
               mutual_tls ? "authenticated by mutual TLS only" : "not authenticated");
  return nullptr;
}

// Blocks SIGTERM/SIGINT in every thread (taken by sigwait) and ignores SIGPIPE.
sigset_t block_shutdown_signals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return signals;
}

server::ServerOptions server_options(const ServeOptions& o) {
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
  so.max_connections = o.max_connections;
  so.request_head_timeout_s = o.request_head_timeout_s;
  so.keep_alive_timeout_s = o.keep_alive_timeout_s;
  so.tls = tls_options(o);
  if (!o.tool_call_parser.empty()) {
    so.tool_call_format = chat::tool_call_format_from_name(o.tool_call_parser);
  }
  return so;
}

// Waits for SIGTERM/SIGINT, then drains `http` and stops it.
int wait_and_drain(sigset_t signals, server::HttpServer& http, double drain_timeout_s) {
  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "relay: %s received, draining (up to %.0f s)\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT", drain_timeout_s);
  const bool drained = http.drain(drain_timeout_s);
  http.stop();
  std::fprintf(
      stderr, "relay: %s, exiting\n",
      drained ? "all requests finished" : "drain timeout: unfinished requests were failed");
  return 0;
}

// --role router: the OpenAI front end over remote workers; loads the tokenizer, not the weights.
int run_router(const ServeOptions& o) {
  const sigset_t signals = block_shutdown_signals();
  const ModelConfig config = ModelConfig::load(o.model_dir);
  const Tokenizer tokenizer = Tokenizer::from_model_dir(o.model_dir);
  chat::ChatTemplate chat_template = chat::ChatTemplate::from_model_dir(o.model_dir);
  disagg::RegistryOptions ro;
  ro.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(3000 * o.heartbeat_s));
  ro.prefill_capacity_tokens_per_s = o.prefill_capacity;
  ro.decode_target_batch = o.decode_target_batch;
  disagg::WorkerRegistry registry(ro);
  server::HttpServer http(server_options(o));
  disagg::RouterOptions router_options;
  router_options.wait_for_workers_s = o.worker_wait_s;
  router_options.auth = control_plane_auth(o);
  router_options.api_key = o.api_key;
  router_options.tls = tls_options(o);
  disagg::DisaggRouter router(router_options, registry, http.metrics());
  http.add_routes([&](http::Server& s) { router.add_routes(s); });
  http.start();
  const int max_model_len =
      static_cast<int>(o.max_model_len > 0 ? o.max_model_len : config.max_position_embeddings);
  // NOTE: the router compiles a request's grammar too, so a bad one is its 400 before any worker
  // sees it; the workers compile its spec again and apply it, and score prompts, where the tokens
  // are computed (disagg/protocol.h).
  server::ServedModel served;
  served.tokenizer = &tokenizer;
  served.vocab_size = config.vocab_size;
  served.max_model_len = max_model_len;
  served.prompt_logprobs = true;
  served.token_constraints = true;
  served.stop_token_ids = config.eos_token_ids;
  http.attach(served, router, std::move(chat_template));
  std::fprintf(stderr,
               "relay: router listening on %s://%s:%d (workers register with --router %s:%d)\n",
               scheme(o), o.host.c_str(), http.port(), o.host.c_str(), http.port());
  return wait_and_drain(signals, http, o.drain_timeout_s);
}

int run_serve(const ServeOptions& o) {
  using Clock = std::chrono::steady_clock;
  RELAY_CHECK(o.role == "all" || o.role == "router" || o.role == "prefill" || o.role == "decode",
              "--role must be all, router, prefill or decode, got '", o.role, "'");
  if (o.backend.nodes.nnodes > 1) {
    RELAY_CHECK(o.role != "router", "--nnodes spreads a worker's ranks over processes; the router "
                "runs no ranks");
    RELAY_CHECK(o.role == "all", "--role ", o.role, " with --nnodes ", o.backend.nodes.nnodes,
                ": a disaggregated worker exports its KV pools to the transfer engine, which sees "
                "only one process's ranks; run multi-node workers with --role all");
  }
  RELAY_CHECK(o.role != "router" || o.speculative_config.empty(),
              "--speculative-config belongs on the decode workers (they verify the drafts), not "
              "on the router");
  if (o.role == "router") return run_router(o);
  SpeculativeConfig speculative;
  if (!o.speculative_config.empty()) speculative = SpeculativeConfig::parse(o.speculative_config);
  const int num_state_snapshots =
      o.no_prefix_caching ? 0
                          : (o.num_state_snapshots >= 0 ? o.num_state_snapshots : o.max_num_seqs);
  if (is_follower_node(o.backend)) {
    return follow_leader(o.model_dir, o.backend, o.max_num_seqs, speculative, num_state_snapshots);
  }
  // Block the shutdown signals before any thread starts, so that every thread inherits the mask and
  // only sigwait below receives them; a client that hangs up must not kill the process either.
  const sigset_t signals = block_shutdown_signals();

  const server::ServerOptions so = server_options(o);
  server::HttpServer http(so);
  const bool is_worker = o.role != "all";
  std::atomic<disagg::DisaggWorker*> worker{nullptr};
  std::shared_ptr<disagg::ControlPlaneAuth> auth;
  if (is_worker) {
    auth = control_plane_auth(o);
    http.add_routes([&](http::Server& s) {
      disagg::add_worker_routes(s, o.role, [&] { return worker.load(); }, auth);
    });
  }
  http.start();
  std::fprintf(stderr, "relay: listening on %s://%s:%d (model loading)\n", scheme(o),
               o.host.c_str(), http.port());

  const Clock::time_point load_start = Clock::now();
  std::fprintf(stderr, "relay: loading %s on %s ...\n", o.model_dir.c_str(),
               o.backend.device.c_str());
  const Tokenizer tokenizer = Tokenizer::from_model_dir(o.model_dir);
  chat::ChatTemplate chat_template = chat::ChatTemplate::from_model_dir(o.model_dir);
  EngineConfig ec;
  ec.max_num_seqs = o.max_num_seqs;
  ec.max_num_batched_tokens = o.max_num_batched_tokens;
  ec.max_model_len = o.max_model_len;
  ec.enable_prefix_caching = !o.no_prefix_caching;
  ec.speculative = speculative;
  auto backend = make_backend(o.model_dir, o.backend, o.max_num_seqs, o.max_num_batched_tokens,
                              ec.speculative, num_state_snapshots);
  LLMEngine engine(std::move(backend), tokenizer, ec);
  const int state_slots = engine.backend().num_state_slots();
  std::fprintf(stderr,
               "relay: loaded '%s' in %.2f s: %d KV blocks of %d tokens%s, max_model_len %d, "
               "max_num_seqs %d, speculative decoding %s\n",
               so.served_model_name.c_str(),
               std::chrono::duration<double>(Clock::now() - load_start).count(),
               engine.backend().num_kv_blocks(), engine.backend().block_size(),
               state_slots > 0 ? str(", ", state_slots, " recurrent-state slots").c_str() : "",
               engine.max_model_len(), o.max_num_seqs, ec.speculative.describe().c_str());
  std::fprintf(stderr, "relay: %s\n", prefix_caching_summary(engine.backend(), ec).c_str());
  if (!is_worker) {
    http.attach(engine, std::move(chat_template));
    std::fprintf(stderr, "relay: ready\n");
    return wait_and_drain(signals, http, o.drain_timeout_s);
  }
  server::EngineLoop loop(engine, http.metrics());
  // NOTE: a disaggregated worker's own OpenAI routes run locally, prompt logprobs included.
  http.attach(server::ServedModel{&engine.tokenizer(), engine.model_config().vocab_size,
                                  engine.max_model_len(), engine.supports_prompt_logprobs(),
                                  engine.supports_token_constraints(),
                                  engine.model_config().eos_token_ids},
              loop, std::move(chat_template));
  disagg::WorkerOptions wo;
  wo.role = o.role;
  // A bare HOST:PORT router speaks this process's scheme.
  wo.router = o.router.empty() || o.router.find("://") != std::string::npos
                  ? o.router
                  : str(scheme(o), "://", o.router);
  wo.url = o.worker_url.empty() ? str(scheme(o), "://", o.host, ":", http.port()) : o.worker_url;
  wo.tls = tls_options(o);
  wo.heartbeat_interval_s = o.heartbeat_s;
  wo.layout = o.backend.parallel.describe();
  wo.transfer_timeout_s = o.kv_transfer_timeout_s;
  wo.ucx_transports = o.ucx_transports;
  wo.kv_transport = o.kv_transport;
  wo.auth = auth;
  disagg::DisaggWorker w(wo, engine, loop, [&http](const GrammarSpec& spec) {
    return http.grammar_compiler().compile(spec);
  });
  worker = &w;
  w.start();
  std::fprintf(stderr, "relay: %s worker ready at %s%s\n", o.role.c_str(), wo.url.c_str(),
               o.router.empty() ? "" : str(", reporting to ", o.router).c_str());
  const int rc = wait_and_drain(signals, http, o.drain_timeout_s);
  w.stop();
  return rc;
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
      sub.add_flag("--no-prefix-caching,--no-enable-prefix-caching", o->no_prefix_caching,
                   "recompute shared prompt prefixes (hybrid models: keep no state snapshots)");
      sub.add_option("--num-state-snapshots", o->num_state_snapshots,
                     "hybrid models (Qwen3.5, Qwen3-Next): recurrent-state snapshots kept at block "
                     "boundaries for prefix caching, each the size of one sequence's state and "
                     "taken out of --kv-cache-memory; 0 gives them no prefix hit (default: "
                     "--max-num-seqs)")
          ->check(CLI::NonNegativeNumber);
      sub.add_option("--speculative-config", o->speculative_config,
                     "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                     "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 5}' or "
                     "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}' (the checkpoint's "
                     "MTP head, or \"model\": DIR for a separate one); \"disable_by_batch_size\": B "
                     "turns drafting off while more than B requests run; \"min_draft_acceptance\": R "
                     "drafts per request only what its own recent acceptance says lands with "
                     "probability >= R");
      sub.add_option("--tool-call-parser", o->tool_call_parser,
                     "how the model writes tool calls, as vLLM names it: hermes (Qwen3) or "
                     "qwen3_coder (Qwen3.5, Qwen3-Coder) (default: the format the chat template "
                     "renders tool calls in)")
          ->check(CLI::IsMember({"hermes", "qwen3_coder"}));
      sub.add_option("--max-connections", o->max_connections,
                     "open client connections; past it the longest-idle one is closed (default "
                     "4096)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--request-head-timeout", o->request_head_timeout_s,
                     "seconds a client has to send a request's head, from its first byte; a new "
                     "connection also has this long to start one (default 10)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--keep-alive-timeout", o->keep_alive_timeout_s,
                     "seconds an idle kept-alive connection stays open (default 60)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--ssl-certfile", o->tls.cert_file,
                     "serve HTTPS with this PEM certificate chain (with --ssl-keyfile); a "
                     "disaggregated role also presents it to its https peers")
          ->check(CLI::ExistingFile);
      sub.add_option("--ssl-keyfile", o->tls.key_file, "the PEM private key of --ssl-certfile")
          ->check(CLI::ExistingFile);
      sub.add_option("--ssl-ca-certs", o->tls.ca_file,
                     "PEM CA certificates that verify clients' certificates (--ssl-cert-reqs) and, "
                     "in a disaggregated deployment, the https peers")
          ->check(CLI::ExistingFile);
      sub.add_option("--ssl-cert-reqs", o->ssl_cert_reqs,
                     "client certificates, as Python's ssl.CERT_*: 0 not asked (default), 1 "
                     "optional (verified when sent), 2 required (mutual TLS)")
          ->check(CLI::Range(0, 2));
      add_backend_options(sub, o->backend);
      sub.add_option(
             "--role", o->role,
             "all (one process, default), or one part of a disaggregated deployment: router, "
             "prefill, decode")
          ->check(CLI::IsMember({"all", "router", "prefill", "decode"}));
      sub.add_option("--router", o->router,
                     "prefill/decode: the router to register with: HOST:PORT (this process's "
                     "scheme) or http(s)://HOST:PORT");
      sub.add_option("--worker-url", o->worker_url,
                     "prefill/decode: the URL the router uses to reach this worker (default "
                     "http(s)://HOST:PORT, https with --ssl-certfile)");
      sub.add_option("--heartbeat-interval", o->heartbeat_s,
                     "seconds between worker heartbeats; 3 missed mark a worker down (default 1)")
          ->check(CLI::PositiveNumber);
      sub.add_option(
             "--kv-transfer-timeout", o->kv_transfer_timeout_s,
             "prefill: seconds the KV hand-off may take before the request is retried (default 30)")
          ->check(CLI::PositiveNumber);
      sub.add_option(
             "--kv-transport", o->kv_transport,
             "prefill/decode: how KV pages move: auto (ucx for --device cpu, cuda_ipc for --device "
             "cuda), ucx, cuda_ipc")
          ->check(CLI::IsMember({"auto", "ucx", "cuda_ipc"}));
      sub.add_option("--ucx-transports", o->ucx_transports,
                     "prefill/decode: UCX transports for the KV hand-off, UCX_TLS syntax (default: "
                     "UCX's choice)");
      sub.add_option("--prefill-capacity", o->prefill_capacity,
                     "router: prompt tokens/s one prefill worker sustains (default: measured)")
          ->check(CLI::NonNegativeNumber);
      sub.add_option(
             "--worker-wait", o->worker_wait_s,
             "router: seconds a request waits for a worker with room before 503 (default 30)")
          ->check(CLI::NonNegativeNumber);
      sub.add_option("--disagg-secret-file", o->disagg_secret_file,
                     "router/prefill/decode: a file holding the control plane's shared secret (16+ "
                     "bytes); every control message is signed with it and unsigned ones refused")
          ->check(CLI::ExistingFile);
      sub.add_flag("--insecure-control-plane", o->insecure_control_plane,
                   "router/prefill/decode: run without --disagg-secret-file on a non-loopback "
                   "--host (only on a network nothing else can reach)");
      sub.add_option(
             "--decode-target-batch", o->decode_target_batch,
             "router: sequences per decode worker before decode_replicas_needed grows (default 32)")
          ->check(CLI::PositiveNumber);
      return [o] { return run_serve(*o); };
    },
    "serve the OpenAI-compatible HTTP API (chat, completions, models, health, metrics)",
});

}  // namespace
}  // namespace relay::cli

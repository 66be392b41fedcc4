// Relay's HTTP/1.1 server: connections on an event loop, handlers on a pool of threads.
//
// Why not a thread per connection (cpp-httplib, which Relay used before): a client that sent its
// request head one line every two seconds held a thread for as long as it liked, and ~400 of them
// stopped the server, /health included. Here one event-loop thread (Boost.Asio, parsing with
// Boost.Beast) accepts connections and reads request heads and bodies without blocking, under
// deadlines, and a connection past its deadline is closed:
//   - a connection must start a request (send its first byte) within request_head_timeout when it
//     is new, within keep_alive_timeout between two requests;
//   - the head must be complete request_head_timeout after its first byte;
//   - the body must be complete request_body_timeout after the head.
// At most max_connections are open. Past that, the connection that has waited longest without a
// request in progress (idle, or still sending its head) is closed to make room; when every
// connection has a request in progress, up to kOverflowConnections more are let in on short
// deadlines to reach the inline routes (health checks keep answering) and get 503 for anything
// else. Heads over max_header_bytes get 431, bodies over max_body_bytes 413, malformed requests
// 400, unknown paths 404, other methods 405, each with the body Options::error_body formats.
//
// A complete request runs one of two kinds of handler:
//   - inline handlers (cheap and never blocking: /health, /metrics, heartbeats) run on the event
//     loop and return a whole Response, which is written asynchronously, so they keep answering
//     however many requests are in flight;
//   - worker handlers run on the pool; they may block (waiting for the engine) and may stream
//     (SSE, NDJSON). They own the connection while they run: writes go straight to the socket,
//     each bounded by write_timeout, and Exchange::client_connected() tells whether the client is
//     still there without writing anything it would see.
// When a worker handler returns, a kept-alive connection goes back to the event loop.
//
// A client that closed its socket and one that only shut down its sending side (a half-close)
// look the same, an end of stream, until something is written to them: the closed one then answers
// with a reset. So at an end of stream, client_connected() sends an interim "100 Continue"
// response (HTTP/1.1 clients must accept any number of 1xx responses before the final one) and
// reports the client gone only when the reset comes back: a half-closed client keeps its request,
// a closed one's request is cancelled. (HTTP/1.0 has no interim responses: there the end of stream
// means gone.)
//
// TLS (Options::tls, HTTPS and mutual TLS): the handshake runs on the event loop under the
// request-head deadline (a client that never finishes it is closed, unanswered: there is no session
// to answer on); everything above it is unchanged, the workers' writes included (they go through
// the TLS session, bounded by write_timeout like plain ones). TLS has no half-close: its client's
// close_notify or end of stream means gone, and client_connected() probes nothing.
#pragma once

#include <chrono>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace relay::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Request {
  std::string method;  // "GET", "POST", ...
  std::string path;    // the target before any '?'
  std::string query;   // after the '?', undecoded
  Headers headers;     // as received
  std::string body;
  std::string remote_addr;
  bool http10 = false;  // an HTTP/1.0 request
  // TLS: the subject of the client's verified certificate (RFC 2253), for logs; "" without one.
  std::string client_subject;

  // The first value of header `name` (case-insensitive), or "" when absent.
  std::string header(std::string_view name) const;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  Headers headers;  // extra headers
};

class Connection;

// A worker handler's side of one request: the request, and the connection to answer on.
class Exchange {
 public:
  // `keep_alive`: whether the connection stays open after this response.
  Exchange(std::shared_ptr<Connection> connection, const Request& request, bool keep_alive);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  const Request& request() const { return request_; }
  // A whole response (Content-Length). At most once, and not after start_stream. Returns false
  // when the client is gone.
  bool respond(const Response& response);
  // Starts a streamed response (chunked; close-delimited for HTTP/1.0). write() sends one piece.
  // Both return false once the client is gone (a failed write, or one that made no progress for
  // write_timeout); the handler should then stop.
  bool start_stream(int status, const std::string& content_type, const Headers& headers = {});
  bool write(std::string_view data);
  // Whether the client is still connected; sends nothing but, at an end of stream before the
  // response started, the interim response described at the top of this file.
  bool client_connected();

  bool responded() const { return state_ != State::kNone; }
  int status() const { return status_; }
  bool failed() const { return failed_; }
  // Ends a stream (the last chunk); the server calls it after the handler returns.
  void finish();

 private:
  enum class State { kNone, kWhole, kStream, kFinished };
  // Writes `parts` in one gathered send, bounded by write_timeout; false once the client is gone.
  bool send(std::initializer_list<std::string_view> parts);

  std::shared_ptr<Connection> connection_;
  const Request& request_;
  const bool keep_alive_;
  State state_ = State::kNone;
  int status_ = 0;
  bool failed_ = false;
  bool saw_end_of_stream_ = false;
  bool probed_ = false;
};

// Whether a secret a client sent (an API key) equals the expected one, compared in constant time so
// its bytes cannot be found one at a time by timing answers.
bool same_secret(std::string_view given, std::string_view expected);

using Handler = std::function<Response(const Request&)>;
using WorkerHandler = std::function<void(Exchange&)>;
// Runs before routing on the event loop: returns a response to answer with instead of the route's
// (authentication), or nothing to go on.
using Guard = std::function<std::optional<Response>(const Request&)>;

// Connections let in beyond max_connections when none can be closed to make room, for the inline
// routes only (they get 503 otherwise, and 2 s to send their head).
constexpr int kOverflowConnections = 64;

// TLS for a server (and, in src/disagg, for its clients, which present cert/key and verify their
// peer with ca_file). Files are PEM.
struct TlsOptions {
  // Python ssl's CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED (vLLM's --ssl-cert-reqs 0, 1, 2).
  enum class ClientCert { kNone, kOptional, kRequired };

  std::string cert_file;  // the certificate chain, own certificate first; empty: no TLS
  std::string key_file;   // its private key
  std::string ca_file;    // the CAs that sign the peers' certificates (needed unless kNone)
  ClientCert client_cert = ClientCert::kNone;

  bool enabled() const { return !cert_file.empty(); }
};

struct Options {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  int num_workers = 64;
  int max_connections = 4096;
  std::chrono::milliseconds request_head_timeout{10'000};
  std::chrono::milliseconds keep_alive_timeout{60'000};
  std::chrono::milliseconds request_body_timeout{60'000};
  std::chrono::milliseconds write_timeout{30'000};
  size_t max_header_bytes = size_t{32} << 10;
  size_t max_body_bytes = size_t{64} << 20;
  // The body of an error the server answers by itself (400, 404, 405, 413, 431, 500, 503), and its
  // content type; the default is {"error": message}.
  std::function<std::string(int status, const std::string& message)> error_body;
  std::string error_content_type = "application/json";
  // One line per finished request ("relay: ADDR \"METHOD PATH\" STATUS SECONDSs" by default, then
  // ` client "SUBJECT"` for a client with a verified certificate).
  std::function<void(const Request&, int status, double seconds)> access_log;
  // HTTPS when tls.enabled(); start() throws relay::Error naming a file it cannot use.
  TlsOptions tls;
};

class Server {
 public:
  explicit Server(Options options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Routes: add before start(). A path takes one method per route; another method gets 405.
  void route_inline(const std::string& method, const std::string& path, Handler handler);
  void route(const std::string& method, const std::string& path, WorkerHandler handler);
  // A route whose handler returns a whole response but may block (it runs on the pool).
  void route_blocking(const std::string& method, const std::string& path, Handler handler);
  void set_guard(Guard guard);

  // Binds (throws relay::Error when it cannot) and starts serving on background threads.
  void start();
  int port() const;
  // Closes the listener and every connection, lets running handlers return, and joins the threads.
  void stop();
  // Connections open now (for tests and metrics).
  int num_connections() const;

 private:
  friend class Connection;
  friend class Exchange;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace relay::http

// The event loop, the connections' life cycle and the worker pool (see server.h).
//
// Threads: the event-loop thread alone touches a connection while it waits for or reads a request
// (phases kIdle, kHead, kBody) and while it writes an inline response; a worker alone touches it
// while a worker handler runs (kBusy), writing to the socket with plain non-blocking sends and
// poll(); the hand-over goes through the job queue one way and net::post the other, so no
// connection is ever used by two threads at once. The list of open connections (for eviction and
// stop()) is guarded by a mutex because connections are created and destroyed on both sides.
//
// A TLS connection reads and writes through an asio ssl::stream over a TimedSocket: the event loop
// uses its asynchronous operations, a worker its synchronous ones, which TimedSocket bounds with
// poll() as send_all bounds plain writes.
#include "http/server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "core/error.h"

namespace relay::http {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
namespace ssl = boost::asio::ssl;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;

namespace {

// An overflow connection's deadline for its head, and how long a closing connection keeps
// reading (and discarding) what the client still sends, so that its error response is not lost
// to a reset.
constexpr auto kOverflowHeadTimeout = std::chrono::seconds(2);
constexpr auto kLingerTimeout = std::chrono::seconds(1);
constexpr size_t kMaxLingerBytes = size_t{1} << 20;

std::string default_error_body(int, const std::string& message) {
  std::string body = "{\"error\": \"";
  for (char c : message) {
    if (c == '"' || c == '\\') body += '\\';
    body += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
  }
  return body + "\"}";
}

std::string status_line(int status) {
  const std::string_view reason = bhttp::obsolete_reason(static_cast<bhttp::status>(status));
  return str("HTTP/1.1 ", status, " ", reason.empty() ? "Unknown" : reason, "\r\n");
}

std::string response_head(int status, const std::string& content_type, const Headers& headers,
                          const std::string& framing, bool keep_alive) {
  std::string head = status_line(status);
  head += "Content-Type: " + content_type + "\r\n";
  for (const auto& [name, value] : headers) head += name + ": " + value + "\r\n";
  head += framing;
  if (!keep_alive) head += "Connection: close\r\n";
  return head + "\r\n";
}

bool iequals(std::string_view a, std::string_view b) { return beast::iequals(a, b); }

// Sends every byte of `parts` on a non-blocking socket, waiting (poll) at most `timeout` for any
// progress. False when the peer is gone or stalled.
bool send_all(int fd, std::initializer_list<std::string_view> parts,
              std::chrono::milliseconds timeout) {
  std::vector<iovec> iov;
  for (std::string_view p : parts) {
    if (!p.empty()) iov.push_back({const_cast<char*>(p.data()), p.size()});
  }
  size_t first = 0;
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = iov.size() - first;
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
      pollfd p{fd, POLLOUT, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(timeout.count()));
      if (ready <= 0 || (p.revents & (POLLERR | POLLHUP | POLLNVAL))) return false;
      continue;
    }
    for (size_t sent = static_cast<size_t>(n); sent > 0 && first < iov.size();) {
      const size_t take = std::min(sent, iov[first].iov_len);
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + take;
      iov[first].iov_len -= take;
      sent -= take;
      if (iov[first].iov_len == 0) ++first;
    }
  }
  return true;
}

// The layer under a TLS stream: the connection's non-blocking socket. Asynchronous operations pass
// through; synchronous ones wait (poll) at most `timeout` for progress, then fail with timed_out.
class TimedSocket {
 public:
  using executor_type = tcp::socket::executor_type;
  using lowest_layer_type = tcp::socket::lowest_layer_type;

  TimedSocket(tcp::socket& socket, std::chrono::milliseconds timeout)
      : socket_(&socket), timeout_(timeout) {}

  executor_type get_executor() { return socket_->get_executor(); }
  lowest_layer_type& lowest_layer() { return socket_->lowest_layer(); }
  const lowest_layer_type& lowest_layer() const { return socket_->lowest_layer(); }

  template <typename Buffers>
  size_t read_some(const Buffers& buffers, error_code& ec) {
    return timed(POLLIN, ec, [&] { return socket_->read_some(buffers, ec); });
  }
  template <typename Buffers>
  size_t write_some(const Buffers& buffers, error_code& ec) {
    return timed(POLLOUT, ec, [&] { return socket_->write_some(buffers, ec); });
  }
  template <typename Buffers, typename Token>
  auto async_read_some(const Buffers& buffers, Token&& token) {
    return socket_->async_read_some(buffers, std::forward<Token>(token));
  }
  template <typename Buffers, typename Token>
  auto async_write_some(const Buffers& buffers, Token&& token) {
    return socket_->async_write_some(buffers, std::forward<Token>(token));
  }

 private:
  template <typename Op>
  size_t timed(short events, error_code& ec, Op op) {
    for (;;) {
      const size_t n = op();
      if (ec != net::error::would_block && ec != net::error::try_again) return n;
      pollfd p{socket_->native_handle(), events, 0};
      if (::poll(&p, 1, static_cast<int>(timeout_.count())) <= 0) {
        ec = net::error::timed_out;
        return 0;
      }
    }
  }

  tcp::socket* socket_;
  std::chrono::milliseconds timeout_;
};

using TlsStream = ssl::stream<TimedSocket>;

// The server's TLS context from `t`; throws relay::Error naming the file it cannot use.
std::unique_ptr<ssl::context> make_tls_context(const TlsOptions& t) {
  auto ctx = std::make_unique<ssl::context>(ssl::context::tls_server);
  ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                   ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
  error_code ec;
  ctx->use_certificate_chain_file(t.cert_file, ec);
  RELAY_CHECK(!ec, "cannot use the TLS certificate chain file '", t.cert_file, "': ", ec.message());
  RELAY_CHECK(!t.key_file.empty(), "TLS certificate '", t.cert_file, "' given without a key file");
  ctx->use_private_key_file(t.key_file, ssl::context::pem, ec);
  RELAY_CHECK(!ec, "cannot use the TLS key file '", t.key_file, "': ", ec.message());
  RELAY_CHECK(SSL_CTX_check_private_key(ctx->native_handle()) == 1, "the TLS key file '",
              t.key_file, "' does not match the certificate in '", t.cert_file, "'");
  if (t.client_cert == TlsOptions::ClientCert::kNone) return ctx;
  RELAY_CHECK(!t.ca_file.empty(), "client certificates are requested but no CA file verifies them");
  ctx->load_verify_file(t.ca_file, ec);
  RELAY_CHECK(!ec, "cannot use the TLS CA file '", t.ca_file, "': ", ec.message());
  // The CA names go in the certificate request, so a client holding several certificates picks.
  SSL_CTX_set_client_CA_list(ctx->native_handle(), SSL_load_client_CA_file(t.ca_file.c_str()));
  ctx->set_verify_mode(t.client_cert == TlsOptions::ClientCert::kRequired
                           ? ssl::verify_peer | ssl::verify_fail_if_no_peer_cert
                           : ssl::verify_peer);
  return ctx;
}

// The verified peer certificate's subject (RFC 2253), or "" without one.
std::string peer_subject(SSL* ssl) {
  X509* cert = SSL_get_peer_certificate(ssl);
  if (cert == nullptr) return {};
  std::string subject;
  if (SSL_get_verify_result(ssl) == X509_V_OK) {
    BIO* bio = BIO_new(BIO_s_mem());
    X509_NAME_print_ex(bio, X509_get_subject_name(cert), 0, XN_FLAG_RFC2253);
    char* data = nullptr;
    const long n = BIO_get_mem_data(bio, &data);
    subject.assign(data, static_cast<size_t>(n));
    BIO_free(bio);
  }
  X509_free(cert);
  return subject;
}

}  // namespace

bool same_secret(std::string_view given, std::string_view expected) {
  return given.size() == expected.size() &&
         CRYPTO_memcmp(given.data(), expected.data(), expected.size()) == 0;
}

std::string Request::header(std::string_view name) const {
  for (const auto& [n, v] : headers) {
    if (iequals(n, name)) return v;
  }
  return {};
}

struct Route {
  std::string method;
  Handler inline_handler;    // runs on the event loop
  WorkerHandler worker;      // runs on the pool
};

struct Job {
  std::shared_ptr<Connection> connection;
  Request request;
  WorkerHandler handler;
  bool keep_alive = true;
  Clock::time_point start;
};

struct Server::Impl {
  explicit Impl(Options o) : options(std::move(o)) {
    if (!options.error_body) options.error_body = default_error_body;
    if (!options.access_log) {
      options.access_log = [](const Request& r, int status, double seconds) {
        const std::string client =
            r.client_subject.empty() ? "" : str(" client \"", r.client_subject, "\"");
        std::fprintf(stderr, "relay: %s \"%s %s\" %d %.3fs%s\n", r.remote_addr.c_str(),
                     r.method.c_str(), r.path.c_str(), status, seconds, client.c_str());
      };
    }
  }

  Response error(int status, const std::string& message) const {
    return Response{status, options.error_content_type, options.error_body(status, message), {}};
  }

  void accept();
  void on_accept(tcp::socket socket);
  // Whether a new connection fits under max_connections, after closing, if it must, the one that
  // has waited longest without a request in progress; false when none could be closed.
  bool make_room();
  void enqueue(Job job);
  void worker_loop();

  // NOTE: declared in this order so that destruction runs backwards safely: the io_context's
  // pending handlers, destroyed with it, hold the last references to connections, whose
  // destructors take connections_mu, which must still exist.
  Options options;
  std::unique_ptr<ssl::context> tls;                 // set when options.tls is enabled
  std::map<std::string, std::vector<Route>> routes;  // by path
  Guard guard;
  mutable std::mutex connections_mu;
  std::list<Connection*> connections;
  std::atomic<int> num_overflow{0};

  std::mutex queue_mu;
  std::condition_variable queue_cv;
  std::deque<Job> queue;
  std::atomic<bool> stopping{false};

  net::io_context io{1};
  tcp::acceptor acceptor{io};
  net::steady_timer accept_retry{io};
  int port = 0;
  std::thread io_thread;
  std::vector<std::thread> workers;
};

// One client connection (see the threading note at the top of the file).
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  enum class Phase { kHandshake, kIdle, kHead, kBody, kWriting, kBusy, kClosing };

  Connection(Server::Impl& server, tcp::socket socket, bool overflow)
      : server_(server), socket_(std::move(socket)), timer_(server.io), overflow_(overflow) {
    if (server.tls) tls_.emplace(TimedSocket(socket_, server.options.write_timeout), *server.tls);
    error_code ec;
    const tcp::endpoint peer = socket_.remote_endpoint(ec);
    remote_ = ec ? "?" : peer.address().to_string();
    socket_.set_option(tcp::no_delay(true), ec);  // SSE chunks go out at once
    // A peer that vanished without a FIN (its host died) is found within ~90 s.
    socket_.set_option(net::socket_base::keep_alive(true), ec);
    const int fd = socket_.native_handle();
    const int idle = 60, interval = 10, count = 3;
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
    socket_.non_blocking(true, ec);
    std::lock_guard lock(server_.connections_mu);
    server_.connections.push_back(this);
    position_ = std::prev(server_.connections.end());
    if (overflow_) ++server_.num_overflow;
  }

  ~Connection() {
    std::lock_guard lock(server_.connections_mu);
    server_.connections.erase(position_);
    if (overflow_) --server_.num_overflow;
  }

  int fd() { return socket_.native_handle(); }
  bool is_tls() const { return tls_.has_value(); }
  bool overflow() const { return overflow_; }
  Phase phase() const { return phase_; }
  Clock::time_point since() const { return since_; }
  const Options& options() const { return server_.options; }

  // Event loop: wait for the next request (a new connection's first, or a kept-alive one's next).
  void await_request() {
    if (tls_ && !handshake_done_) return handshake();
    set_phase(Phase::kIdle);
    arm(overflow_       ? head_timeout()
        : num_requests_ ? options().keep_alive_timeout
                        : options().request_head_timeout);
    if (buffer_.size() > 0) return read_head();  // the client already sent (pipelined) its next
    if (tls_) {
      // NOTE: a read, not a wait for the socket: the TLS session may already hold the next
      // request's bytes, read from the socket with the last one's.
      tls_->async_read_some(buffer_.prepare(4096),
                            [self = shared_from_this()](error_code ec, size_t n) {
                              if (ec) return self->close();
                              self->buffer_.commit(n);
                              self->read_head();
                            });
      return;
    }
    socket_.async_wait(tcp::socket::wait_read, [self = shared_from_this()](error_code ec) {
      if (ec) return self->close();
      self->read_head();
    });
  }

  // Worker: writes `parts` (one TLS record for them all), bounded by write_timeout.
  bool send(std::initializer_list<std::string_view> parts) {
    if (!tls_) return send_all(fd(), parts, options().write_timeout);
    std::string joined;
    for (std::string_view p : parts) joined += p;
    error_code ec;
    net::write(*tls_, net::buffer(joined), ec);
    return !ec;
  }

  // Event loop: closes now (a deadline passed, the server stops, or eviction).
  void close() {
    if (phase_ == Phase::kClosing) return;
    set_phase(Phase::kClosing);
    timer_.cancel();
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
  }

  // Event loop, for stop(): ends a connection a worker owns by shutting its socket down (its
  // writes then fail and the worker hands it back to be closed).
  void interrupt() {
    if (phase_ == Phase::kBusy) {
      ::shutdown(fd(), SHUT_RDWR);
    } else {
      close();
    }
  }

  // Worker, when its handler returned: back to the event loop for the next request, or closed.
  void hand_back(bool keep_alive) {
    net::post(server_.io, [self = shared_from_this(), keep_alive] {
      if (self->phase_ == Phase::kClosing) return;
      if (keep_alive && !self->server_.stopping) {
        self->await_request();
      } else {
        self->linger_close();
      }
    });
  }

  void set_phase(Phase p) {
    phase_ = p;
    since_ = Clock::now();
  }

 private:
  std::chrono::milliseconds head_timeout() const {
    return overflow_ ? std::chrono::duration_cast<std::chrono::milliseconds>(kOverflowHeadTimeout)
                     : options().request_head_timeout;
  }

  // Calls op(stream) with the TLS stream or the plain socket.
  template <typename Op>
  void on_stream(Op op) {
    if (tls_) {
      op(*tls_);
    } else {
      op(socket_);
    }
  }

  // Event loop: a TLS connection's handshake, under the head deadline; a failed or late one closes
  // the connection (a client speaking plain HTTP included: it could not read an answer).
  void handshake() {
    set_phase(Phase::kHandshake);
    arm(head_timeout());
    tls_->async_handshake(ssl::stream_base::server, [self = shared_from_this()](error_code ec) {
      if (self->phase_ != Phase::kHandshake) return;  // its deadline closed it
      if (ec) return self->close();
      self->handshake_done_ = true;
      self->client_subject_ = peer_subject(self->tls_->native_handle());
      self->await_request();
    });
  }

  void arm(std::chrono::milliseconds timeout) {
    timer_.expires_after(timeout);
    timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (ec) return;  // cancelled
      const Phase p = self->phase_;
      if (p == Phase::kHead || p == Phase::kBody) {
        // Too slow sending its request: a 408 (as nginx answers), then the connection closes.
        error_code e;
        self->socket_.cancel(e);
        self->keep_alive_ = false;
        self->request_ = Request{"-", "-", "", {}, "", self->remote_, false, self->client_subject_};
        self->request_start_ = Clock::now();
        self->write_inline(self->server_.error(408, "the request was not received in time"));
      } else if (p == Phase::kHandshake || p == Phase::kIdle || p == Phase::kWriting) {
        self->close();
      }
    });
  }

  void read_head() {
    set_phase(Phase::kHead);
    arm(head_timeout());
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(
        std::min<size_t>(options().max_header_bytes, UINT32_MAX)));
    parser_->body_limit(options().max_body_bytes);
    on_stream([&](auto& stream) {
      bhttp::async_read_header(stream, buffer_, *parser_,
                               [self = shared_from_this()](error_code ec, size_t) {
                                 if (ec) return self->read_failed(ec);
                                 self->read_body();
                               });
    });
  }

  void read_body() {
    if (parser_->is_done()) return dispatch();
    set_phase(Phase::kBody);
    if (!overflow_) arm(options().request_body_timeout);
    auto read = [self = shared_from_this()] {
      self->on_stream([&](auto& stream) {
        bhttp::async_read(stream, self->buffer_, *self->parser_, [self](error_code ec, size_t) {
          if (ec) return self->read_failed(ec);
          self->dispatch();
        });
      });
    };
    if (parser_->get().version() == 11 &&
        iequals(parser_->get()[bhttp::field::expect], "100-continue")) {
      out_ = "HTTP/1.1 100 Continue\r\n\r\n";
      on_stream([&](auto& stream) {
        net::async_write(stream, net::buffer(out_),
                         [self = shared_from_this(), read](error_code ec, size_t) {
                           if (ec) return self->close();
                           read();
                         });
      });
      return;
    }
    read();
  }

  void read_failed(error_code ec) {
    if (phase_ == Phase::kWriting || phase_ == Phase::kClosing) return;  // a deadline answered
    if (ec == bhttp::error::header_limit) {
      return answer_error(431, str("the request head is larger than ", options().max_header_bytes,
                                   " bytes"));
    }
    if (ec == bhttp::error::body_limit) {
      return answer_error(413, str("the request body is larger than ", options().max_body_bytes,
                                   " bytes"));
    }
    // The client closed, reset, or its deadline closed the socket: nothing to answer.
    const auto& http_errors = bhttp::make_error_code(bhttp::error::end_of_stream).category();
    if (ec == bhttp::error::end_of_stream || ec == bhttp::error::partial_message ||
        ec.category() != http_errors) {
      return close();
    }
    answer_error(400, str("malformed HTTP request: ", ec.message()));
  }

  void answer_error(int status, const std::string& message) {
    Request r;
    r.method = parser_ && parser_->is_header_done() ? std::string(parser_->get().method_string())
                                                    : "-";
    r.path = parser_ && parser_->is_header_done() ? std::string(parser_->get().target()) : "-";
    r.remote_addr = remote_;
    request_ = std::move(r);
    keep_alive_ = false;
    request_start_ = Clock::now();
    write_inline(server_.error(status, message));
  }

  void dispatch() {
    timer_.cancel();
    auto& msg = parser_->get();
    Request r;
    r.method = std::string(msg.method_string());
    const std::string_view target = msg.target();
    const size_t q = target.find('?');
    r.path = std::string(target.substr(0, q));
    if (q != std::string_view::npos) r.query = std::string(target.substr(q + 1));
    for (const auto& field : msg) r.headers.emplace_back(field.name_string(), field.value());
    r.body = std::move(msg.body());
    r.remote_addr = remote_;
    r.http10 = msg.version() == 10;
    r.client_subject = client_subject_;
    keep_alive_ = msg.keep_alive() && !overflow_ && !server_.stopping;
    parser_.reset();
    ++num_requests_;
    request_start_ = Clock::now();
    request_ = std::move(r);

    if (server_.guard) {
      if (std::optional<Response> answer = server_.guard(request_)) return write_inline(*answer);
    }
    const auto it = server_.routes.find(request_.path);
    if (it == server_.routes.end()) {
      return write_inline(
          server_.error(404, str("no route for ", request_.method, " ", request_.path)));
    }
    const Route* route = nullptr;
    std::string allowed;
    for (const Route& candidate : it->second) {
      if (candidate.method == request_.method) route = &candidate;
      allowed += (allowed.empty() ? "" : ", ") + candidate.method;
    }
    if (route == nullptr) {
      Response r = server_.error(405, str(request_.path, " takes ", allowed, ", not ",
                                          request_.method));
      r.headers.emplace_back("Allow", allowed);
      return write_inline(r);
    }
    if (route->inline_handler) {
      Response answer;
      try {
        answer = route->inline_handler(request_);
      } catch (const std::exception& e) {
        answer = server_.error(500, e.what());
      }
      return write_inline(answer);
    }
    if (overflow_) {
      keep_alive_ = false;
      return write_inline(server_.error(
          503, "the server has too many connections with requests in progress; retry later"));
    }
    set_phase(Phase::kBusy);
    server_.enqueue(Job{shared_from_this(), std::move(request_), route->worker, keep_alive_,
                        request_start_});
  }

  // Event loop: writes a whole response asynchronously, then waits for the next request or closes.
  void write_inline(const Response& r) {
    set_phase(Phase::kWriting);
    arm(options().write_timeout);
    out_ = response_head(r.status, r.content_type, r.headers,
                         str("Content-Length: ", r.body.size(), "\r\n"), keep_alive_) +
           r.body;
    const int status = r.status;
    on_stream([&](auto& stream) {
      net::async_write(
          stream, net::buffer(out_), [self = shared_from_this(), status](error_code ec, size_t) {
            self->options().access_log(
                self->request_, status,
                std::chrono::duration<double>(Clock::now() - self->request_start_).count());
            if (ec) return self->close();
            if (self->keep_alive_ && !self->server_.stopping) {
              self->await_request();
            } else {
              self->linger_close();
            }
          });
    });
  }

  // Stops sending, then reads and discards what the client still sends for a moment before
  // closing: closing with unread bytes would reset the connection and could destroy the response
  // (a 413 to a client still sending its body) before the client read it.
  // A TLS connection sends its close_notify instead (a client reading to the end of the stream,
  // HTTP/1.0, then knows it was not cut off) and waits as long for the client's.
  void linger_close() {
    if (phase_ == Phase::kClosing) return;
    set_phase(Phase::kClosing);
    timer_.expires_after(kLingerTimeout);
    timer_.async_wait([self = shared_from_this()](error_code e) {
      if (!e) self->finish_close();
    });
    if (tls_) {
      tls_->async_shutdown([self = shared_from_this()](error_code) { self->finish_close(); });
      return;
    }
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    drain();
  }

  void drain() {
    socket_.async_read_some(net::buffer(scratch_), [self = shared_from_this()](error_code ec,
                                                                               size_t n) {
      self->lingered_ += n;
      if (ec || self->lingered_ > kMaxLingerBytes) return self->finish_close();
      self->drain();
    });
  }

  void finish_close() {
    timer_.cancel();
    error_code ec;
    socket_.close(ec);
  }

  Server::Impl& server_;
  tcp::socket socket_;
  std::optional<TlsStream> tls_;  // over socket_, for a TLS server
  bool handshake_done_ = false;
  std::string client_subject_;
  net::steady_timer timer_;
  const bool overflow_;
  std::list<Connection*>::iterator position_;
  std::string remote_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  Phase phase_ = Phase::kIdle;
  Clock::time_point since_ = Clock::now();
  int num_requests_ = 0;
  bool keep_alive_ = true;
  Request request_;
  Clock::time_point request_start_;
  std::string out_;
  std::array<char, 4096> scratch_{};
  size_t lingered_ = 0;
};

// ---- Exchange ----

Exchange::Exchange(std::shared_ptr<Connection> connection, const Request& request, bool keep_alive)
    : connection_(std::move(connection)), request_(request), keep_alive_(keep_alive) {}

Exchange::~Exchange() = default;

bool Exchange::send(std::initializer_list<std::string_view> parts) {
  if (failed_) return false;
  if (!connection_->send(parts)) failed_ = true;
  return !failed_;
}

bool Exchange::respond(const Response& r) {
  RELAY_CHECK(state_ == State::kNone, "a response was already sent for ", request_.path);
  state_ = State::kWhole;
  status_ = r.status;
  return send({response_head(r.status, r.content_type, r.headers,
                             str("Content-Length: ", r.body.size(), "\r\n"), keep_alive_),
               r.body});
}

bool Exchange::start_stream(int status, const std::string& content_type, const Headers& headers) {
  RELAY_CHECK(state_ == State::kNone, "a response was already sent for ", request_.path);
  state_ = State::kStream;
  status_ = status;
  if (request_.http10) {
    // No chunked encoding in HTTP/1.0: the stream ends when the connection closes.
    return send({response_head(status, content_type, headers, "", false)});
  }
  return send({response_head(status, content_type, headers, "Transfer-Encoding: chunked\r\n",
                             keep_alive_)});
}

bool Exchange::write(std::string_view data) {
  RELAY_CHECK(state_ == State::kStream, "write() before start_stream() for ", request_.path);
  if (data.empty()) return !failed_;
  if (request_.http10) return send({data});
  char size[24];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  // Size line, data and CRLF in one gathered send: one TCP segment per chunk where it fits.
  return send({size, data, "\r\n"});
}

void Exchange::finish() {
  if (state_ != State::kStream) return;
  state_ = State::kFinished;
  if (!request_.http10) send({"0\r\n\r\n"});
}

bool Exchange::client_connected() {
  if (failed_) return false;
  const int fd = connection_->fd();
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) < 0) return true;
  if (p.revents & (POLLERR | POLLHUP | POLLNVAL)) {
    failed_ = true;  // reset, or closed both ways
    return false;
  }
  // A TLS client that ended its side (FIN) has left: TLS has no half-close. Bytes before it may be
  // its close_notify, which only decryption could tell from a pipelined request.
  if (connection_->is_tls() && (p.revents & POLLRDHUP)) {
    failed_ = true;
    return false;
  }
  if ((p.revents & (POLLIN | POLLRDHUP)) && !saw_end_of_stream_) {
    char c;
    const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) {
      saw_end_of_stream_ = true;
    } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      failed_ = true;
      return false;
    }
    // n > 0: the client's next (pipelined) request: it is there.
  }
  if (!saw_end_of_stream_) return true;
  if (request_.http10) {
    failed_ = true;
    return false;
  }
  if (!probed_ && state_ == State::kNone) {
    probed_ = true;
    return send({"HTTP/1.1 100 Continue\r\n\r\n"});
  }
  // A stream probes with its own writes; after the probe, the reset (if any) arrives within a
  // round trip and is seen above on a later call.
  return true;
}

// ---- Server ----

void Server::Impl::accept() {
  acceptor.async_accept([this](error_code ec, tcp::socket socket) {
    if (!acceptor.is_open()) return;
    if (ec) {
      // Out of descriptors (EMFILE) or a transient error: try again shortly instead of spinning.
      accept_retry.expires_after(std::chrono::milliseconds(100));
      accept_retry.async_wait([this](error_code e) {
        if (!e) accept();
      });
      return;
    }
    on_accept(std::move(socket));
    accept();
  });
}

bool Server::Impl::make_room() {
  std::shared_ptr<Connection> victim;
  {
    std::lock_guard lock(connections_mu);
    int open = 0;
    Connection* oldest = nullptr;
    for (Connection* c : connections) {
      const auto p = c->phase();
      // A closing connection is on its way out; an overflow one is counted apart.
      if (p == Connection::Phase::kClosing || c->overflow()) continue;
      ++open;
      if (p != Connection::Phase::kHandshake && p != Connection::Phase::kIdle &&
          p != Connection::Phase::kHead) {
        continue;
      }
      if (oldest == nullptr || c->since() < oldest->since()) oldest = c;
    }
    if (open < options.max_connections) return true;
    // NOTE: weak_from_this: the connection may be between its last reference and its destructor.
    if (oldest != nullptr) victim = oldest->weak_from_this().lock();
  }
  if (!victim) return false;
  victim->close();
  return true;
}

void Server::Impl::on_accept(tcp::socket socket) {
  if (stopping) return;
  bool overflow = false;
  if (!make_room()) {
    if (num_overflow.load() >= kOverflowConnections) {
      error_code ec;
      // A TLS client could not read a plain answer: it is only closed.
      if (tls) {
        socket.close(ec);
        return;
      }
      const Response r = error(503, "the server has too many connections; retry later");
      const std::string reply =
          response_head(503, r.content_type, {}, str("Content-Length: ", r.body.size(), "\r\n"),
                        false) +
          r.body;
      ::send(socket.native_handle(), reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      socket.close(ec);
      return;
    }
    overflow = true;
  }
  std::make_shared<Connection>(*this, std::move(socket), overflow)->await_request();
}

void Server::Impl::enqueue(Job job) {
  {
    std::lock_guard lock(queue_mu);
    queue.push_back(std::move(job));
  }
  queue_cv.notify_one();
}

void Server::Impl::worker_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock lock(queue_mu);
      queue_cv.wait(lock, [&] { return !queue.empty() || stopping; });
      if (queue.empty()) return;
      job = std::move(queue.front());
      queue.pop_front();
    }
    Exchange exchange(job.connection, job.request, job.keep_alive);
    if (stopping) {
      exchange.respond(error(503, "the server is shutting down"));
    } else {
      try {
        job.handler(exchange);
      } catch (const std::exception& e) {
        if (!exchange.responded() && !exchange.failed()) exchange.respond(error(500, e.what()));
      }
      // A handler that found its client gone answers nothing; one that forgot to is a bug.
      if (!exchange.responded() && !exchange.failed()) {
        exchange.respond(error(500, "the handler sent no response"));
      }
    }
    exchange.finish();
    // 499 (nginx's "client closed request") for a request whose client left before its answer.
    options.access_log(job.request, exchange.responded() ? exchange.status() : 499,
                       std::chrono::duration<double>(Clock::now() - job.start).count());
    job.connection->hand_back(job.keep_alive && !exchange.failed() && !job.request.http10);
  }
}

Server::Server(Options options) : impl_(std::make_unique<Impl>(std::move(options))) {}

Server::~Server() { stop(); }

void Server::route_inline(const std::string& method, const std::string& path, Handler handler) {
  impl_->routes[path].push_back(Route{method, std::move(handler), {}});
}

void Server::route(const std::string& method, const std::string& path, WorkerHandler handler) {
  impl_->routes[path].push_back(Route{method, {}, std::move(handler)});
}

void Server::route_blocking(const std::string& method, const std::string& path, Handler handler) {
  route(method, path, [handler = std::move(handler)](Exchange& ex) {
    ex.respond(handler(ex.request()));
  });
}

void Server::set_guard(Guard guard) { impl_->guard = std::move(guard); }

void Server::start() {
  Impl& s = *impl_;
  if (s.options.tls.enabled()) s.tls = make_tls_context(s.options.tls);
  // Each connection is a descriptor: raise the soft limit to the hard one, and keep the cap below
  // it with room for the rest of the process (model files, UCX, logs), so a full server evicts
  // instead of failing to accept.
  constexpr rlim_t kOtherDescriptors = 256;
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
    if (files.rlim_cur < files.rlim_max) {
      files.rlim_cur = files.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &files);
      ::getrlimit(RLIMIT_NOFILE, &files);
    }
    const rlim_t room = files.rlim_cur > kOtherDescriptors + kOverflowConnections
                            ? files.rlim_cur - kOtherDescriptors - kOverflowConnections
                            : 1;
    if (static_cast<rlim_t>(s.options.max_connections) > room) {
      std::fprintf(stderr,
                   "relay: max_connections %d lowered to %llu: the process may open %llu "
                   "descriptors (ulimit -n)\n",
                   s.options.max_connections, static_cast<unsigned long long>(room),
                   static_cast<unsigned long long>(files.rlim_cur));
      s.options.max_connections = static_cast<int>(room);
    }
  }
  error_code ec;
  tcp::resolver resolver(s.io);
  const auto endpoints = resolver.resolve(s.options.host, std::to_string(s.options.port),
                                          tcp::resolver::passive, ec);
  RELAY_CHECK(!ec && !endpoints.empty(), "cannot listen on ", s.options.host, ":",
              s.options.port, ": ", ec.message());
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  s.acceptor.open(endpoint.protocol(), ec);
  if (!ec) s.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) s.acceptor.bind(endpoint, ec);
  // The kernel's largest backlog (net.core.somaxconn): a load generator opening hundreds of
  // connections at once must not overflow the accept queue.
  if (!ec) s.acceptor.listen(net::socket_base::max_listen_connections, ec);
  RELAY_CHECK(!ec, "cannot listen on ", s.options.host, ":", s.options.port, ": ", ec.message());
  s.port = s.acceptor.local_endpoint().port();
  for (int i = 0; i < s.options.num_workers; ++i) s.workers.emplace_back([&s] { s.worker_loop(); });
  s.accept();
  s.io_thread = std::thread([&s] { s.io.run(); });
}

int Server::port() const { return impl_->port; }

int Server::num_connections() const {
  std::lock_guard lock(impl_->connections_mu);
  return static_cast<int>(impl_->connections.size());
}

void Server::stop() {
  Impl& s = *impl_;
  if (!s.io_thread.joinable()) return;
  s.stopping = true;
  net::post(s.io, [&s] {
    error_code ec;
    s.acceptor.close(ec);
    s.accept_retry.cancel();
    std::vector<std::shared_ptr<Connection>> open;
    {
      std::lock_guard lock(s.connections_mu);
      for (Connection* c : s.connections) {
        if (auto p = c->weak_from_this().lock()) open.push_back(std::move(p));
      }
    }
    for (auto& c : open) c->interrupt();
  });
  s.queue_cv.notify_all();
  for (std::thread& w : s.workers) w.join();
  s.workers.clear();
  // The workers' hand-backs close what they held; then nothing is left to run.
  net::post(s.io, [&s] { s.io.stop(); });
  s.io_thread.join();
}

}  // namespace relay::http

// http/server.h over raw sockets: the limits and deadlines that keep hostile or broken clients from
// stopping the server, the framing of whole and streamed responses, keep-alive and pipelining, and
// telling a closed client from a half-closed one; and the same over TLS, with client certificates
// (certificates made per run by tests/fixtures/make_test_certs.sh).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "http/server.h"

namespace relay::http {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A blocking client socket with a receive timeout.
class Client {
 public:
  explicit Client(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~Client() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return connected_; }
  int fd() const { return fd_; }
  bool send(std::string_view data) {
    return ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(data.size());
  }
  // Reads until `marker` has been seen, the peer closes, or the timeout.
  std::string read_until(std::string_view marker, std::chrono::milliseconds timeout = 5s) {
    const auto deadline = Clock::now() + timeout;
    while (received_.find(marker) == std::string::npos && Clock::now() < deadline) {
      if (!read_some(deadline)) break;
    }
    return received_;
  }
  // Reads until the peer closes (or the timeout); true when it closed.
  bool read_to_close(std::chrono::milliseconds timeout = 5s) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return true;
      received_.append(buf, static_cast<size_t>(n));
    }
    return false;
  }
  const std::string& received() const { return received_; }
  void clear() { received_.clear(); }
  void half_close() { ::shutdown(fd_, SHUT_WR); }
  void close() {
    ::close(fd_);
    fd_ = -1;
  }

 private:
  bool read_some(Clock::time_point deadline) {
    pollfd p{fd_, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0))) <= 0) return false;
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) return false;
    received_.append(buf, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  bool connected_ = false;
  std::string received_;
};

// Waits up to `timeout` for `done()`; a test that waits fails instead of hanging.
template <typename Pred>
bool eventually(Pred done, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

std::string get(std::string_view path, std::string_view extra = "") {
  return std::string("GET ") + std::string(path) + " HTTP/1.1\r\nHost: x\r\n" + std::string(extra) +
         "\r\n";
}

std::string post(std::string_view path, std::string_view body, std::string_view extra = "") {
  return std::string("POST ") + std::string(path) + " HTTP/1.1\r\nHost: x\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n" + std::string(extra) + "\r\n" + std::string(body);
}

struct TestServer {
  explicit TestServer(Options o = {}) {
    o.access_log = [](const Request&, int, double) {};
    server = std::make_unique<Server>(std::move(o));
    server->route_inline("GET", "/health", [](const Request&) {
      return Response{200, "application/json", "{\"status\":\"ok\"}", {}};
    });
    server->route_inline("GET", "/whoami", [](const Request& r) {
      return Response{200, "text/plain", "subject=" + r.client_subject, {}};
    });
    server->route_blocking("POST", "/echo", [](const Request& r) {
      return Response{200, "text/plain", r.body, {{"X-Method", r.method}}};
    });
    // Streams three pieces, then waits until told to finish (or the client is gone).
    server->route("POST", "/stream", [this](Exchange& ex) {
      ex.start_stream(200, "text/event-stream");
      for (int i = 0; i < 3; ++i) ex.write("data: " + std::to_string(i) + "\n\n");
      while (!release && ex.write(": keep-alive\n\n")) std::this_thread::sleep_for(20ms);
    });
    // Waits until released, watching the client; records whether it saw the client go.
    server->route("POST", "/wait", [this](Exchange& ex) {
      ++waiting;
      while (!release) {
        if (!ex.client_connected()) {
          ++saw_gone;
          return;
        }
        std::this_thread::sleep_for(20ms);
      }
      ex.respond(Response{200, "text/plain", "done", {}});
    });
    server->start();
  }
  int port() const { return server->port(); }

  std::unique_ptr<Server> server;
  std::atomic<bool> release{false};
  std::atomic<int> waiting{0};
  std::atomic<int> saw_gone{0};
};

TEST(HttpServer, WholeResponsesKeepAliveAndPipelining) {
  TestServer s;
  Client c(s.port());
  ASSERT_TRUE(c.connected());
  // Two requests in one write: both answered, in order, on the same connection.
  ASSERT_TRUE(c.send(post("/echo", "first") + post("/echo", "second")));
  const std::string both = c.read_until("second");
  const size_t first = both.find("\r\n\r\nfirst");
  const size_t second = both.find("\r\n\r\nsecond");
  ASSERT_NE(first, std::string::npos) << both;
  ASSERT_NE(second, std::string::npos) << both;
  EXPECT_LT(first, second);
  EXPECT_EQ(both.rfind("HTTP/1.1 200 OK\r\n", 0), 0u);
  EXPECT_NE(both.find("Content-Length: 5\r\n"), std::string::npos);
  EXPECT_NE(both.find("X-Method: POST\r\n"), std::string::npos);
  c.clear();
  ASSERT_TRUE(c.send(get("/health")));
  EXPECT_NE(c.read_until("}").find("{\"status\":\"ok\"}"), std::string::npos);
}

TEST(HttpServer, ChunkedRequestBodyAndExpectContinue) {
  TestServer s;
  Client c(s.port());
  ASSERT_TRUE(c.send(
      "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n "
      "world\r\n0\r\n\r\n"));
  EXPECT_NE(c.read_until("hello world").find("\r\n\r\nhello world"), std::string::npos);
  c.clear();
  // curl sends Expect: 100-continue before a large body and waits for the interim response.
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"));
  EXPECT_EQ(c.read_until("\r\n\r\n"), "HTTP/1.1 100 Continue\r\n\r\n");
  c.clear();
  ASSERT_TRUE(c.send("body"));
  EXPECT_NE(c.read_until("body").find("\r\n\r\nbody"), std::string::npos);
}

TEST(HttpServer, ErrorsAnswerWithTheOwnersBody) {
  Options o;
  o.max_header_bytes = 1024;
  o.max_body_bytes = 100;
  o.error_body = [](int status, const std::string& message) {
    return "{\"status\": " + std::to_string(status) + ", \"message\": \"" + message + "\"}";
  };
  TestServer s(o);
  auto answer = [&](const std::string& request) {
    Client c(s.port());
    c.send(request);
    c.read_to_close();
    return c.received();
  };
  const std::string close = "Connection: close\r\n";
  const std::string not_found = answer(get("/nope", close));
  EXPECT_EQ(not_found.rfind("HTTP/1.1 404", 0), 0u) << not_found;
  EXPECT_NE(not_found.find("\"status\": 404"), std::string::npos);
  const std::string wrong_method = answer(get("/echo", close));
  EXPECT_EQ(wrong_method.rfind("HTTP/1.1 405", 0), 0u) << wrong_method;
  EXPECT_NE(wrong_method.find("Allow: POST\r\n"), std::string::npos);
  const std::string big_head = answer(get("/health", "X-Big: " + std::string(2000, 'a') + "\r\n"));
  EXPECT_EQ(big_head.rfind("HTTP/1.1 431", 0), 0u) << big_head;
  EXPECT_NE(big_head.find("\"status\": 431"), std::string::npos);
  // A body over the limit by Content-Length is refused before it is read...
  const std::string big_body = answer(post("/echo", std::string(5000, 'b')));
  EXPECT_EQ(big_body.rfind("HTTP/1.1 413", 0), 0u) << big_body;
  EXPECT_NE(big_body.find("\"status\": 413"), std::string::npos);
  // ... and a chunked one as it grows past it.
  const std::string big_chunks =
      answer("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n80\r\n" +
             std::string(128, 'c') + "\r\n0\r\n\r\n");
  EXPECT_EQ(big_chunks.rfind("HTTP/1.1 413", 0), 0u) << big_chunks;
  const std::string garbage = answer("HELLO\r\n\r\n");
  EXPECT_EQ(garbage.rfind("HTTP/1.1 400", 0), 0u) << garbage;
}

TEST(HttpServer, SlowHeadsAreCutOffAndHealthKeepsAnswering) {
  Options o;
  o.request_head_timeout = 1500ms;
  o.num_workers = 2;
  TestServer s(o);
  // 300 clients that send a header line every 200 ms, never finishing: far more than the workers.
  std::vector<std::unique_ptr<Client>> slow;
  for (int i = 0; i < 300; ++i) {
    slow.push_back(std::make_unique<Client>(s.port()));
    ASSERT_TRUE(slow.back()->connected());
    slow.back()->send("GET /health HTTP/1.1\r\n");
  }
  const auto start = Clock::now();
  int answered = 0;
  while (Clock::now() - start < 1s) {
    for (auto& c : slow) c->send("X-Slow: 1\r\n");
    Client h(s.port());
    h.send(get("/health"));
    if (h.read_until("}", 2s).find("200 OK") != std::string::npos) ++answered;
    Client e(s.port());
    e.send(post("/echo", "still here"));
    EXPECT_NE(e.read_until("still here", 2s).find("still here"), std::string::npos);
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_GE(answered, 3);
  // Past the head deadline every slow client has been answered 408 and closed.
  for (auto& c : slow) {
    EXPECT_TRUE(c->read_to_close(3s));
    EXPECT_EQ(c->received().rfind("HTTP/1.1 408", 0), 0u) << c->received();
  }
}

TEST(HttpServer, ConnectionCapEvictsTheLongestIdleAndLetsHealthChecksIn) {
  Options o;
  o.max_connections = 8;
  o.num_workers = 16;
  TestServer s(o);
  // Eight idle connections fill the cap; a ninth closes the oldest of them.
  std::vector<std::unique_ptr<Client>> idle;
  for (int i = 0; i < 8; ++i) {
    idle.push_back(std::make_unique<Client>(s.port()));
    std::this_thread::sleep_for(5ms);
  }
  Client ninth(s.port());
  ninth.send(get("/health"));
  EXPECT_NE(ninth.read_until("}").find("200 OK"), std::string::npos);
  EXPECT_TRUE(idle.front()->read_to_close(2s));
  // With every connection busy on a request, a health check still gets in (overflow) and others
  // get 503.
  idle.clear();
  std::vector<std::unique_ptr<Client>> busy;
  for (int i = 0; i < 8; ++i) {
    busy.push_back(std::make_unique<Client>(s.port()));
    busy.back()->send(post("/wait", ""));
  }
  ASSERT_TRUE(eventually([&] { return s.waiting == 8; })) << s.waiting;
  Client health(s.port());
  health.send(get("/health"));
  EXPECT_NE(health.read_until("}").find("200 OK"), std::string::npos);
  Client refused(s.port());
  refused.send(post("/echo", "x"));
  refused.read_to_close();
  EXPECT_EQ(refused.received().rfind("HTTP/1.1 503", 0), 0u) << refused.received();
  s.release = true;
  for (auto& c : busy) EXPECT_NE(c->read_until("done").find("done"), std::string::npos);
}

TEST(HttpServer, StreamsAreChunkedAndEndWhenTheClientGoes) {
  TestServer s;
  {
    Client c(s.port());
    c.send(post("/stream", ""));
    const std::string head = c.read_until("data: 2");
    EXPECT_NE(head.find("Transfer-Encoding: chunked\r\n"), std::string::npos) << head;
    EXPECT_NE(head.find("9\r\ndata: 0\n\n\r\n"), std::string::npos) << head;
  }
  // The client closed: the handler's writes fail and it returns (or this test would hang at
  // stop()). A finished stream ends with the last chunk.
  s.release = true;
  Client c(s.port());
  c.send(post("/stream", ""));
  EXPECT_NE(c.read_until("0\r\n\r\n").find("0\r\n\r\n"), std::string::npos);
}

TEST(HttpServer, AClosedClientIsGoneAHalfClosedOneIsNot) {
  TestServer s;
  {
    Client closed(s.port());
    closed.send(post("/wait", ""));
    ASSERT_TRUE(eventually([&] { return s.waiting == 1; }));
    closed.close();
  }
  EXPECT_TRUE(eventually([&] { return s.saw_gone == 1; }, 3s));

  Client half(s.port());
  half.send(post("/wait", ""));
  half.half_close();
  ASSERT_TRUE(eventually([&] { return s.waiting == 2; }));
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(s.saw_gone, 1) << "a half-closed client was taken for gone";
  s.release = true;
  // The interim response first, then the answer.
  const std::string reply = half.read_until("done");
  EXPECT_EQ(reply.rfind("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n", 0), 0u) << reply;
}

TEST(HttpServer, AnIdleKeptAliveConnectionIsClosedAfterItsTimeout) {
  Options o;
  o.keep_alive_timeout = 300ms;
  TestServer s(o);
  Client c(s.port());
  c.send(get("/health"));
  c.read_until("}");
  EXPECT_TRUE(c.read_to_close(2s));
}

TEST(HttpServer, StopEndsRunningHandlers) {
  auto s = std::make_unique<TestServer>();
  Client c(s->port());
  c.send(post("/wait", ""));
  ASSERT_TRUE(eventually([&] { return s->waiting == 1; }));
  const auto start = Clock::now();
  s->server->stop();
  EXPECT_LT(Clock::now() - start, 3s);
  EXPECT_EQ(s->saw_gone, 1);
}

// ---- TLS ----

// The directory of the run's certificates (made once per test binary).
const std::string& cert_dir() {
  static const std::string dir = [] {
    std::string templ = (std::filesystem::temp_directory_path() / "relay-tls-XXXXXX").string();
    const char* made = ::mkdtemp(templ.data());
    EXPECT_NE(made, nullptr);
    const std::string script = std::string(RELAY_SOURCE_DIR) + "/tests/fixtures/make_test_certs.sh";
    EXPECT_EQ(std::system((script + " " + templ + " >/dev/null").c_str()), 0);
    return templ;
  }();
  return dir;
}

std::string cert(const std::string& name) { return cert_dir() + "/" + name; }

Options tls_options(TlsOptions::ClientCert client_cert = TlsOptions::ClientCert::kNone) {
  Options o;
  o.tls.cert_file = cert("server.pem");
  o.tls.key_file = cert("server.key");
  o.tls.ca_file = cert("ca.pem");
  o.tls.client_cert = client_cert;
  return o;
}

// A blocking TLS client (OpenSSL over Client's socket) that verifies the server against the CA and
// presents `own` ("client", "rogue") as its certificate, or none.
class TlsClient {
 public:
  explicit TlsClient(int port, const std::string& own = "") : tcp_(port) {
    ctx_ = SSL_CTX_new(TLS_client_method());
    SSL_CTX_load_verify_locations(ctx_, cert("ca.pem").c_str(), nullptr);
    SSL_CTX_set_verify(ctx_, SSL_VERIFY_PEER, nullptr);
    if (!own.empty()) {
      SSL_CTX_use_certificate_chain_file(ctx_, cert(own + ".pem").c_str());
      SSL_CTX_use_PrivateKey_file(ctx_, cert(own + ".key").c_str(), SSL_FILETYPE_PEM);
    }
    ssl_ = SSL_new(ctx_);
    SSL_set_fd(ssl_, tcp_.fd());
    SSL_set1_host(ssl_, "localhost");
    handshake_ok_ = SSL_connect(ssl_) == 1;
  }
  ~TlsClient() {
    SSL_free(ssl_);
    SSL_CTX_free(ctx_);
  }
  bool handshake_ok() const { return handshake_ok_; }
  bool send(std::string_view data) {
    return SSL_write(ssl_, data.data(), static_cast<int>(data.size())) ==
           static_cast<int>(data.size());
  }
  // Reads until `marker` has been seen, the session ends, or the timeout.
  std::string read_until(std::string_view marker, std::chrono::milliseconds timeout = 5s) {
    const auto deadline = Clock::now() + timeout;
    while (received_.find(marker) == std::string::npos && Clock::now() < deadline) {
      char buf[4096];
      const int n = SSL_read(ssl_, buf, sizeof buf);
      if (n <= 0) break;
      received_.append(buf, static_cast<size_t>(n));
    }
    return received_;
  }
  void clear() { received_.clear(); }
  void close() { tcp_.close(); }

 private:
  Client tcp_;
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
  bool handshake_ok_ = false;
  std::string received_;
};

TEST(HttpsServer, ServesWholeResponsesWithKeepAlive) {
  TestServer s(tls_options());
  TlsClient c(s.port());
  ASSERT_TRUE(c.handshake_ok());
  ASSERT_TRUE(c.send(post("/echo", "first") + post("/echo", "second")));
  const std::string both = c.read_until("second");
  EXPECT_EQ(both.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << both;
  EXPECT_NE(both.find("\r\n\r\nfirst"), std::string::npos) << both;
  c.clear();
  ASSERT_TRUE(c.send(get("/whoami")));
  EXPECT_NE(c.read_until("subject=").find("200 OK"), std::string::npos);
}

TEST(HttpsServer, PlainHttpIsClosedAndOthersAreServed) {
  TestServer s(tls_options());
  TlsClient tls(s.port());
  ASSERT_TRUE(tls.handshake_ok());
  Client plain(s.port());
  ASSERT_TRUE(plain.send(get("/health")));
  EXPECT_TRUE(plain.read_to_close(2s));
  EXPECT_EQ(plain.received().find("HTTP/1.1 200"), std::string::npos) << plain.received();
  ASSERT_TRUE(tls.send(get("/health")));
  EXPECT_NE(tls.read_until("}").find("{\"status\":\"ok\"}"), std::string::npos);
}

TEST(HttpsServer, RequiredClientCertificatesRefuseOthers) {
  TestServer s(tls_options(TlsOptions::ClientCert::kRequired));
  // Over TLS 1.3 the client finishes its handshake first and learns of the refusal when it reads.
  for (const std::string own : {"", "rogue"}) {
    TlsClient refused(s.port(), own);
    if (refused.handshake_ok()) {
      refused.send(get("/whoami"));
      EXPECT_EQ(refused.read_until("subject=", 2s), "") << own;
    }
  }
  TlsClient c(s.port(), "client");
  ASSERT_TRUE(c.handshake_ok());
  ASSERT_TRUE(c.send(get("/whoami")));
  EXPECT_NE(c.read_until("relay-test-client").find("subject=CN=relay-test-client"),
            std::string::npos)
      << c.read_until("");
}

TEST(HttpsServer, OptionalClientCertificates) {
  TestServer s(tls_options(TlsOptions::ClientCert::kOptional));
  TlsClient anonymous(s.port());
  ASSERT_TRUE(anonymous.send(get("/whoami")));
  EXPECT_NE(anonymous.read_until("subject=").find("200 OK"), std::string::npos);
  TlsClient c(s.port(), "client");
  ASSERT_TRUE(c.send(get("/whoami")));
  EXPECT_NE(c.read_until("relay-test-client").find("subject=CN=relay-test-client"),
            std::string::npos);
}

TEST(HttpsServer, AHandshakeNotFinishedInTimeIsClosed) {
  Options o = tls_options();
  o.request_head_timeout = 300ms;
  TestServer s(o);
  Client silent(s.port());
  Client partial(s.port());
  partial.send(std::string("\x16\x03\x01\x02\x00", 5));  // a ClientHello's record header only
  const auto start = Clock::now();
  EXPECT_TRUE(silent.read_to_close(3s));
  EXPECT_TRUE(partial.read_to_close(3s));
  EXPECT_LT(Clock::now() - start, 2s);
  TlsClient c(s.port());
  ASSERT_TRUE(c.send(get("/health")));
  EXPECT_NE(c.read_until("}").find("200 OK"), std::string::npos);
}

TEST(HttpsServer, StreamsAndSeesTheClientGo) {
  TestServer s(tls_options());
  {
    TlsClient c(s.port());
    c.send(post("/stream", ""));
    const std::string head = c.read_until("data: 2");
    EXPECT_NE(head.find("Transfer-Encoding: chunked\r\n"), std::string::npos) << head;
    EXPECT_NE(head.find("9\r\ndata: 0\n\n\r\n"), std::string::npos) << head;
  }
  {
    TlsClient waiting(s.port());
    waiting.send(post("/wait", ""));
    ASSERT_TRUE(eventually([&] { return s.waiting == 1; }));
    waiting.close();
  }
  EXPECT_TRUE(eventually([&] { return s.saw_gone == 1; }, 3s));
  s.release = true;
  TlsClient c(s.port());
  c.send(post("/stream", ""));
  EXPECT_NE(c.read_until("0\r\n\r\n").find("0\r\n\r\n"), std::string::npos);
}

TEST(HttpsServer, BadFilesAreNamedAtStart) {
  Options o = tls_options();
  o.tls.key_file = cert("client.key");  // not the certificate's key
  Server mismatched(o);
  try {
    mismatched.start();
    FAIL() << "a key that does not match the certificate was accepted";
  } catch (const relay::Error& e) {
    EXPECT_NE(std::string(e.what()).find("client.key"), std::string::npos) << e.what();
  }
  o = tls_options();
  o.tls.cert_file = cert("missing.pem");
  Server missing(o);
  try {
    missing.start();
    FAIL() << "a missing certificate file was accepted";
  } catch (const relay::Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.pem"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace relay::http

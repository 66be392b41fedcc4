// See tcp_bootstrap.h. Wire format: every message is an 8-byte little-endian length followed by
// that many bytes. A joining rank sends a hello (magic, rank, size as three little-endian uint32)
// and rank 0 answers with an empty message (welcome) or the text of the refusal.
#include "parallel/tcp_bootstrap.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace relay::parallel {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kHelloMagic = 0x52454c59;  // "RELY"
// Refuses absurd lengths from a confused peer before allocating them.
constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 30;

std::string errno_text() { return std::strerror(errno); }

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

// Waits until fd is readable (POLLIN) or writable (POLLOUT); false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) fail(str("poll failed: ", errno_text()));
  }
}

void put_u32(uint8_t* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(in[i]) << (8 * i);
  return v;
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) ::freeaddrinfo(list);
  }
};

void resolve(const DistInitAddress& a, bool passive, AddrInfo& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string port = std::to_string(a.port);
  const int rc = ::getaddrinfo(a.host.c_str(), port.c_str(), &hints, &out.list);
  RELAY_CHECK(rc == 0, "dist-init: cannot resolve host '", a.host, "' (port ", a.port,
              "): ", ::gai_strerror(rc));
}

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// One non-blocking connect attempt bounded by the deadline; returns the socket or -1 (errno set).
int try_connect(const addrinfo* ai, Clock::time_point deadline) {
  const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return -1;
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
  if (rc != 0 && errno == EINPROGRESS) {
    if (!wait_fd(fd, POLLOUT, deadline)) {
      ::close(fd);
      errno = ETIMEDOUT;
      return -1;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    rc = err == 0 ? 0 : -1;
    errno = err;
  }
  if (rc != 0) {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  }
  ::fcntl(fd, F_SETFL, flags);
  set_nodelay(fd);
  return fd;
}

}  // namespace

DistInitAddress parse_dist_init(std::string_view text) {
  DistInitAddress a;
  std::string_view port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    RELAY_CHECK(
        close != std::string_view::npos && close + 1 < text.size() && text[close + 1] == ':',
        "--dist-init '", text, "': expected [IPV6]:PORT");
    a.host = std::string(text.substr(1, close - 1));
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    RELAY_CHECK(colon != std::string_view::npos && colon > 0, "--dist-init '", text,
                "': expected HOST:PORT");
    a.host = std::string(text.substr(0, colon));
    port = text.substr(colon + 1);
  }
  int value = 0;
  bool digits = !port.empty() && port.size() <= 5;
  for (char c : port) {
    digits = digits && c >= '0' && c <= '9';
    if (digits) value = value * 10 + (c - '0');
  }
  RELAY_CHECK(digits && value >= 1 && value <= 65535, "--dist-init '", text, "': port '", port,
              "' is not a number in 1..65535");
  a.port = value;
  return a;
}

TcpBootstrap::TcpBootstrap(const DistInitAddress& address, int rank, int size,
                           std::chrono::milliseconds timeout)
    : address_(address), rank_(rank), size_(size), timeout_(timeout), peers_(size, -1) {
  RELAY_CHECK(size >= 1 && rank >= 0 && rank < size, "dist-init: rank ", rank,
              " is not in a group of ", size);
  if (size == 1) return;
  const auto deadline = Clock::now() + timeout_;
  const std::string endpoint = str(address_.host, ":", address_.port);

  if (rank_ != 0) {
    AddrInfo ai;
    resolve(address_, false, ai);
    int fd = -1;
    std::string last_error = "no address";
    while (fd < 0) {
      for (const addrinfo* p = ai.list; p && fd < 0; p = p->ai_next) {
        fd = try_connect(p, deadline);
        if (fd < 0) last_error = errno_text();
      }
      if (fd >= 0) break;
      // NOTE: rank 0 may not be listening yet (processes start in any order): retry until the
      // deadline rather than failing on the first refusal.
      RELAY_CHECK(Clock::now() < deadline, "dist-init: rank ", rank_, " of ", size_,
                  " could not connect to rank 0 at ", endpoint, " within ", timeout_.count(),
                  " ms: ", last_error);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    peers_[0] = fd;
    uint8_t hello[12];
    put_u32(hello, kHelloMagic);
    put_u32(hello + 4, static_cast<uint32_t>(rank_));
    put_u32(hello + 8, static_cast<uint32_t>(size_));
    send_message(fd, 0, hello);
    const std::vector<uint8_t> answer = recv_message(fd, 0);
    RELAY_CHECK(answer.empty(), "dist-init: rank 0 at ", endpoint, " refused rank ", rank_, ": ",
                std::string(answer.begin(), answer.end()));
    return;
  }

  AddrInfo ai;
  resolve(address_, true, ai);
  int listener = -1;
  std::string bind_error = "no address";
  for (const addrinfo* p = ai.list; p && listener < 0; p = p->ai_next) {
    listener = ::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol);
    if (listener < 0) continue;
    const int one = 1;
    ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(listener, p->ai_addr, p->ai_addrlen) != 0 || ::listen(listener, size_) != 0) {
      bind_error = errno_text();
      ::close(listener);
      listener = -1;
    }
  }
  RELAY_CHECK(listener >= 0, "dist-init: rank 0 cannot listen on ", endpoint, ": ", bind_error);

  int joined = 1;
  try {
    while (joined < size_) {
      RELAY_CHECK(wait_fd(listener, POLLIN, deadline), "dist-init: rank 0 listening on ", endpoint,
                  ": only ", joined, " of ", size_, " ranks joined within ", timeout_.count(),
                  " ms");
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      set_nodelay(fd);
      std::vector<uint8_t> hello;
      try {
        hello = recv_message(fd, -1);
      } catch (const Error&) {
        ::close(fd);  // a client that is not a Relay rank (a port probe): ignore it
        continue;
      }
      if (hello.size() != 12 || get_u32(hello.data()) != kHelloMagic) {
        ::close(fd);
        continue;
      }
      const int their_rank = static_cast<int>(get_u32(hello.data() + 4));
      const int their_size = static_cast<int>(get_u32(hello.data() + 8));
      std::string refusal;
      if (their_size != size_)
        refusal = str("rank ", their_rank, " expects a group of ", their_size,
                      " but rank 0 was started for ", size_);
      else if (their_rank <= 0 || their_rank >= size_)
        refusal = str("rank ", their_rank, " is not in 1..", size_ - 1);
      else if (peers_[their_rank] >= 0)
        refusal = str("rank ", their_rank, " joined twice");
      const std::string_view text = refusal;
      send_message(fd, their_rank,
                   std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
      if (!refusal.empty()) {
        ::close(fd);
        fail(str("dist-init at ", endpoint, ": ", refusal));
      }
      peers_[their_rank] = fd;
      ++joined;
    }
  } catch (...) {
    ::close(listener);
    for (int& fd : peers_)
      if (fd >= 0) ::close(fd), fd = -1;
    throw;
  }
  ::close(listener);
}

TcpBootstrap::~TcpBootstrap() {
  for (int fd : peers_)
    if (fd >= 0) ::close(fd);
}

std::string TcpBootstrap::where(int peer) const {
  std::string who = peer < 0 ? std::string("a joining rank") : str("rank ", peer);
  return str("dist-init rank ", rank_, " of ", size_, " (", address_.host, ":", address_.port,
             "), talking to ", who);
}

void TcpBootstrap::send_message(int fd, int peer, std::span<const uint8_t> bytes) {
  const auto deadline = Clock::now() + timeout_;
  uint8_t header[8];
  const uint64_t n = bytes.size();
  for (int i = 0; i < 8; ++i) header[i] = static_cast<uint8_t>(n >> (8 * i));
  for (std::span<const uint8_t> part : {std::span<const uint8_t>(header), bytes}) {
    size_t done = 0;
    while (done < part.size()) {
      RELAY_CHECK(wait_fd(fd, POLLOUT, deadline), where(peer), ": send timed out after ",
                  timeout_.count(), " ms");
      const ssize_t sent = ::send(fd, part.data() + done, part.size() - done, MSG_NOSIGNAL);
      if (sent < 0 && errno == EINTR) continue;
      RELAY_CHECK(sent > 0, where(peer), ": send failed: ", errno_text());
      done += static_cast<size_t>(sent);
    }
  }
}

std::vector<uint8_t> TcpBootstrap::recv_message(int fd, int peer) {
  const auto deadline = Clock::now() + timeout_;
  const auto read_exact = [&](uint8_t* out, size_t n) {
    size_t done = 0;
    while (done < n) {
      RELAY_CHECK(wait_fd(fd, POLLIN, deadline), where(peer), ": no data within ", timeout_.count(),
                  " ms");
      const ssize_t got = ::recv(fd, out + done, n - done, 0);
      if (got < 0 && errno == EINTR) continue;
      RELAY_CHECK(got != 0, where(peer), ": the connection was closed");
      RELAY_CHECK(got > 0, where(peer), ": recv failed: ", errno_text());
      done += static_cast<size_t>(got);
    }
  };
  uint8_t header[8];
  read_exact(header, 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(header[i]) << (8 * i);
  RELAY_CHECK(n <= kMaxMessageBytes, where(peer), ": message of ", n, " bytes is too large");
  std::vector<uint8_t> bytes(n);
  read_exact(bytes.data(), bytes.size());
  return bytes;
}

std::vector<uint8_t> TcpBootstrap::broadcast(std::span<const uint8_t> blob) {
  if (size_ == 1) return {blob.begin(), blob.end()};
  if (rank_ != 0) return recv_message(peers_[0], 0);
  for (int r = 1; r < size_; ++r) send_message(peers_[r], r, blob);
  return {blob.begin(), blob.end()};
}

std::vector<std::vector<uint8_t>> TcpBootstrap::all_gather(std::span<const uint8_t> blob) {
  std::vector<std::vector<uint8_t>> all(size_);
  all[rank_].assign(blob.begin(), blob.end());
  if (size_ == 1) return all;
  if (rank_ != 0) {
    send_message(peers_[0], 0, blob);
    for (int r = 0; r < size_; ++r) all[r] = recv_message(peers_[0], 0);
    return all;
  }
  for (int r = 1; r < size_; ++r) all[r] = recv_message(peers_[r], r);
  for (int r = 1; r < size_; ++r)
    for (const auto& part : all) send_message(peers_[r], r, part);
  return all;
}

void TcpBootstrap::barrier() { all_gather({}); }

}  // namespace relay::parallel

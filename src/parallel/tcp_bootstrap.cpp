// See tcp_bootstrap.h. Wire format: every message is an 8-byte little-endian length followed by
// that many bytes. A joining rank sends a hello (magic, rank, size as three little-endian uint32)
// and rank 0 answers with an empty message (welcome) or the text of the refusal.
#include "parallel/tcp_bootstrap.h"

#include <arpa/inet.h>
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

// poll()'s timeout argument for a wait until `deadline`; -1 (forever) for a kNoTimeout call.
int poll_timeout_ms(Clock::time_point deadline, std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) return -1;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

// Waits until one of `fds` has one of its events (or an error or hang-up, which poll() always
// reports); false on timeout.
bool wait_any(std::span<pollfd> fds, Clock::time_point deadline,
              std::chrono::milliseconds timeout) {
  while (true) {
    const int n = ::poll(fds.data(), fds.size(), poll_timeout_ms(deadline, timeout));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) fail(str("poll failed: ", errno_text()));
  }
}

// Waits until fd is readable (POLLIN) or writable (POLLOUT); false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  pollfd p{fd, events, 0};
  return wait_any(std::span(&p, 1), deadline, timeout);
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
int try_connect(const addrinfo* ai, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return -1;
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
  if (rc != 0 && errno == EINPROGRESS) {
    if (!wait_fd(fd, POLLOUT, deadline, timeout)) {
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

// The numeric address of the local end of a connected socket (an IPv4-mapped IPv6 address as plain
// IPv4, so that it binds and connects whichever family the other side resolves it to).
std::string local_address_of(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  RELAY_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0,
              "dist-init: getsockname failed: ", errno_text());
  char text[NI_MAXHOST] = {};
  const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&addr);
  if (addr.ss_family == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {
    ::inet_ntop(AF_INET, v6->sin6_addr.s6_addr + 12, text, sizeof(text));
    return text;
  }
  const int rc = ::getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, text, sizeof(text),
                               nullptr, 0, NI_NUMERICHOST);
  RELAY_CHECK(rc == 0, "dist-init: cannot format the local address: ", ::gai_strerror(rc));
  return text;
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
  const Deadline deadline = deadline_after(timeout_);
  const std::string endpoint = str(address_.host, ":", address_.port);

  if (rank_ != 0) {
    AddrInfo ai;
    resolve(address_, false, ai);
    int fd = -1;
    std::string last_error = "no address";
    while (fd < 0) {
      for (const addrinfo* p = ai.list; p && fd < 0; p = p->ai_next) {
        fd = try_connect(p, deadline.at, deadline.timeout);
        if (fd < 0) last_error = errno_text();
      }
      if (fd >= 0) break;
      // NOTE: rank 0 may not be listening yet (processes start in any order): retry until the
      // deadline rather than failing on the first refusal.
      RELAY_CHECK(Clock::now() < deadline.at, "dist-init: rank ", rank_, " of ", size_,
                  " could not connect to rank 0 at ", endpoint, " within ", timeout_.count(),
                  " ms: ", last_error);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    peers_[0] = fd;
    uint8_t hello[12];
    put_u32(hello, kHelloMagic);
    put_u32(hello + 4, static_cast<uint32_t>(rank_));
    put_u32(hello + 8, static_cast<uint32_t>(size_));
    send_message(fd, 0, hello, deadline);
    const std::vector<uint8_t> answer = recv_message(fd, 0, deadline);
    RELAY_CHECK(answer.empty(), "dist-init: rank 0 at ", endpoint, " refused rank ", rank_, ": ",
                std::string(answer.begin(), answer.end()));
    local_host_ = local_address_of(fd);
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
      RELAY_CHECK(wait_fd(listener, POLLIN, deadline.at, deadline.timeout),
                  "dist-init: rank 0 listening on ", endpoint, ": only ", joined, " of ", size_,
                  " ranks joined within ", timeout_.count(), " ms");
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      set_nodelay(fd);
      std::vector<uint8_t> hello;
      try {
        hello = recv_message(fd, -1, deadline);
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
                   std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()), deadline);
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
  local_host_ = local_address_of(peers_[1]);
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

std::string TcpBootstrap::local_host() const { return local_host_; }

TcpBootstrap::Deadline TcpBootstrap::deadline_after(std::chrono::milliseconds timeout) const {
  if (timeout.count() < 0) return {Clock::time_point::max(), kNoTimeout};
  return {Clock::now() + timeout, timeout};
}

void TcpBootstrap::send_message(int fd, int peer, std::span<const uint8_t> bytes,
                                const Deadline& deadline) {
  uint8_t header[8];
  const uint64_t n = bytes.size();
  for (int i = 0; i < 8; ++i) header[i] = static_cast<uint8_t>(n >> (8 * i));
  for (std::span<const uint8_t> part : {std::span<const uint8_t>(header), bytes}) {
    size_t done = 0;
    while (done < part.size()) {
      RELAY_CHECK(wait_fd(fd, POLLOUT, deadline.at, deadline.timeout), where(peer),
                  ": send timed out after ", deadline.timeout.count(), " ms");
      const ssize_t sent = ::send(fd, part.data() + done, part.size() - done, MSG_NOSIGNAL);
      if (sent < 0 && errno == EINTR) continue;
      RELAY_CHECK(sent > 0, where(peer), ": send failed: ", errno_text());
      done += static_cast<size_t>(sent);
    }
  }
}

std::vector<uint8_t> TcpBootstrap::recv_message(int fd, int peer, const Deadline& deadline) {
  const auto read_exact = [&](uint8_t* out, size_t n) {
    size_t done = 0;
    while (done < n) {
      RELAY_CHECK(wait_fd(fd, POLLIN, deadline.at, deadline.timeout), where(peer),
                  ": no data within ", deadline.timeout.count(), " ms");
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
  return broadcast(blob, timeout_);
}

std::vector<uint8_t> TcpBootstrap::broadcast(std::span<const uint8_t> blob,
                                             std::chrono::milliseconds timeout) {
  if (size_ == 1) return {blob.begin(), blob.end()};
  const Deadline deadline = deadline_after(timeout);
  if (rank_ != 0) return recv_message(peers_[0], 0, deadline);
  for (int r = 1; r < size_; ++r) send_message(peers_[r], r, blob, deadline);
  return {blob.begin(), blob.end()};
}

std::vector<std::vector<uint8_t>> TcpBootstrap::gather(std::span<const uint8_t> blob,
                                                       std::chrono::milliseconds timeout) {
  return gather_until(blob, deadline_after(timeout));
}

std::vector<std::vector<uint8_t>> TcpBootstrap::gather_until(std::span<const uint8_t> blob,
                                                             const Deadline& deadline) {
  if (rank_ != 0) {
    send_message(peers_[0], 0, blob, deadline);
    return {};
  }
  std::vector<std::vector<uint8_t>> all(size_);
  all[0].assign(blob.begin(), blob.end());
  std::vector<int> waiting;
  for (int r = 1; r < size_; ++r) waiting.push_back(r);
  std::vector<pollfd> fds;
  while (!waiting.empty()) {
    // NOTE: rank 0 waits on every rank that still owes its blob at once, not on one after the
    // other, so a rank that closed its connection fails the call at once even while an earlier
    // rank is slow (which matters most under kNoTimeout).
    fds.clear();
    for (int r : waiting) fds.push_back({peers_[r], POLLIN, 0});
    RELAY_CHECK(wait_any(fds, deadline.at, deadline.timeout), where(waiting.front()),
                ": no data within ", deadline.timeout.count(), " ms (", waiting.size(),
                " ranks had not sent their blob)");
    std::vector<int> still_waiting;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) {
        still_waiting.push_back(waiting[i]);
        continue;
      }
      all[waiting[i]] = recv_message(fds[i].fd, waiting[i], deadline);
    }
    waiting = std::move(still_waiting);
  }
  return all;
}

std::vector<std::vector<uint8_t>> TcpBootstrap::all_gather(std::span<const uint8_t> blob) {
  const Deadline deadline = deadline_after(timeout_);
  std::vector<std::vector<uint8_t>> all = gather_until(blob, deadline);
  if (rank_ != 0) {
    all.resize(size_);
    for (int r = 0; r < size_; ++r) all[r] = recv_message(peers_[0], 0, deadline);
    return all;
  }
  for (int r = 1; r < size_; ++r)
    for (const auto& part : all) send_message(peers_[r], r, part, deadline);
  return all;
}

void TcpBootstrap::barrier() { all_gather({}); }

}  // namespace relay::parallel

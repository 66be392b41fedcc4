// See tcp_group.h. Wire format: a connection opens with one Hello (connecting rank to accepting
// rank); after that each collective puts one frame in each direction: a FrameHeader, then `bytes`
// of payload. Everything after the hello's magic is in native byte order.
#include "parallel/tcp_group.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <sstream>
#include <utility>

#include "core/error.h"

namespace relay::parallel {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMeshMagic[4] = {'R', 'L', 'Y', 'M'};
constexpr uint32_t kByteOrderMark = 0x01020304;
// Floats summed per pass of all_reduce_sum's rank-order loop (a 16 KiB accumulator on the stack).
constexpr size_t kSumChunk = 4096;

// The first bytes on every mesh connection, sent by the connecting (higher) rank.
struct Hello {
  char magic[4];        // kMeshMagic
  uint32_t byte_order;  // kByteOrderMark, in the sender's byte order
  uint32_t generation;  // the mesh it belongs to: 0 when made, + 1 per reset()
  int32_t from_rank;    // the connecting rank
  int32_t to_rank;      // the accepting process's rank the socket is for
  int32_t world;
};
static_assert(sizeof(Hello) == 24);

enum class Op : uint64_t { kAllReduceSum = 1, kAllToAllF32, kAllToAllI32, kBarrier };

const char* op_name(uint64_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kAllReduceSum:
      return "all_reduce_sum";
    case Op::kAllToAllF32:
      return "all_to_all (f32)";
    case Op::kAllToAllI32:
      return "all_to_all (i32)";
    case Op::kBarrier:
      return "barrier";
  }
  return "an unknown op";
}

// Precedes every payload.
struct FrameHeader {
  uint64_t op;     // an Op
  uint64_t call;   // the sender's collectives on this communicator since the mesh was built
  uint64_t bytes;  // payload bytes that follow
};
constexpr size_t kFrameHeaderBytes = sizeof(FrameHeader);
static_assert(kFrameHeaderBytes == 24);

std::string errno_text(int err) { return std::strerror(err); }

// poll()'s timeout argument for a wait until `deadline`, rounded up (0 only once it has passed).
int poll_ms(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

// "2, 5, 6": rank lists in messages.
std::string join(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

// Owns a socket until it is released into a rank's slot.
class OwnedFd {
 public:
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  OwnedFd& operator=(OwnedFd&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ~OwnedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

using AddrList = std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)>;

// A numeric host and port (no name lookups: the endpoints come from local_host()).
AddrList resolve_numeric(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* list = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
  RELAY_CHECK(rc == 0 && list, "tcp group: cannot use address ", host, " port ", port, ": ",
              ::gai_strerror(rc));
  return AddrList(list, &::freeaddrinfo);
}

// A member of the bootstrap (one process) as it announced itself.
struct Process {
  int first_rank = 0;
  int num_ranks = 0;
  std::string endpoint;  // "HOST:PORT" of its listener
  sockaddr_storage address{};
  socklen_t address_len = 0;
};

// One local rank's sockets. The rank's own thread uses them inside its collectives; abort() may
// come from any thread, so it only shuts them down (which wakes a poll() in progress) and leaves
// closing them to the collective, when one is running.
struct RankLinks {
  std::mutex mu;               // guards fds (against close) and in_collective
  std::vector<int> fds;        // [world]: the socket to each global rank; -1 for itself
  bool in_collective = false;  // the rank's thread is inside exchange()
  std::atomic<bool> aborted{false};
  uint64_t calls = 0;  // collectives since the mesh was built (the frames' call number)

  // False when the rank was aborted.
  bool enter() {
    std::lock_guard lock(mu);
    if (aborted) return false;
    in_collective = true;
    return true;
  }
  void leave() {
    std::lock_guard lock(mu);
    in_collective = false;
    if (aborted) close_all();
  }
  void abort() {
    std::lock_guard lock(mu);
    aborted = true;
    for (int fd : fds)
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
    if (!in_collective) close_all();
  }
  void close_all() {  // with mu held
    for (int& fd : fds)
      if (fd >= 0) ::close(std::exchange(fd, -1));
  }
};

// What the communicators of one process share; lives until the last of them is destroyed.
struct GroupState {
  GroupState(int first, int num, int world_size, std::chrono::milliseconds t)
      : world(world_size), first_rank(first), num_local(num), timeout(t) {
    for (int i = 0; i < num_local; ++i) {
      links.push_back(std::make_unique<RankLinks>());
      links.back()->fds.assign(world, -1);
    }
  }
  ~GroupState() {
    for (auto& l : links) l->close_all();
    if (listener >= 0) ::close(listener);
  }

  const Process& process_of(int rank) const {
    for (const Process& p : processes)
      if (rank >= p.first_rank && rank < p.first_rank + p.num_ranks) return p;
    fail(str("tcp group: no process hosts rank ", rank));
  }
  std::string ranges() const {  // "ranks [2, 4)" for messages
    return str("ranks [", first_rank, ", ", first_rank + num_local, ")");
  }

  const int world;
  const int first_rank;
  const int num_local;
  const std::chrono::milliseconds timeout;
  std::vector<Process> processes;  // by bootstrap rank
  int listener = -1;
  uint32_t generation = 0;
  std::vector<std::unique_ptr<RankLinks>> links;  // [num_local]
};

// A non-blocking listener on an ephemeral port of `host`; sets `endpoint` to its "HOST:PORT".
int open_listener(const std::string& host, std::string& endpoint) {
  const AddrList ai = resolve_numeric(host, 0, true);
  OwnedFd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  RELAY_CHECK(fd.get() >= 0, "tcp group: socket failed: ", errno_text(errno));
  // NOTE: a process accepts only after all its own connects (tcp_group.h), so every connection to
  // it waits in the backlog meanwhile: ask for the largest (the kernel caps it at somaxconn).
  RELAY_CHECK(
      ::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd.get(), SOMAXCONN) == 0,
      "tcp group: cannot listen on ", host, ": ", errno_text(errno));
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  RELAY_CHECK(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0,
              "tcp group: getsockname failed: ", errno_text(errno));
  const int port = addr.ss_family == AF_INET6
                       ? ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port)
                       : ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  endpoint = addr.ss_family == AF_INET6 ? str("[", host, "]:", port) : str(host, ":", port);
  return fd.release();
}

// Every process announces "FIRST NUM WORLD HOST:PORT"; every process checks all of them the same
// way, so a bad layout fails on every process at once with the same message.
std::vector<Process> exchange_endpoints(TcpBootstrap& bootstrap, const GroupState& g,
                                        const std::string& endpoint) {
  const std::string mine = str(g.first_rank, " ", g.num_local, " ", g.world, " ", endpoint);
  const auto all =
      bootstrap.all_gather(std::span(reinterpret_cast<const uint8_t*>(mine.data()), mine.size()));
  std::vector<Process> processes(all.size());
  int next = 0;  // the first rank the next process must host
  for (size_t p = 0; p < all.size(); ++p) {
    Process& proc = processes[p];
    const std::string text(all[p].begin(), all[p].end());
    std::istringstream in(text);
    int their_world = 0;
    RELAY_CHECK(in >> proc.first_rank >> proc.num_ranks >> their_world >> proc.endpoint,
                "tcp group: process ", p, " announced '", text, "'");
    RELAY_CHECK(their_world == g.world, "tcp group: process ", p, " was started for a world of ",
                their_world, " ranks but process ", bootstrap.rank(), " for ", g.world);
    RELAY_CHECK(
        proc.num_ranks >= 1 && proc.first_rank == next, "tcp group: process ", p, " hosts ranks [",
        proc.first_rank, ", ", proc.first_rank + proc.num_ranks,
        ") but the processes must host ascending contiguous ranges from 0: it must start at ", next,
        " and host at least one rank");
    next += proc.num_ranks;
    const DistInitAddress address = parse_dist_init(proc.endpoint);
    const AddrList ai = resolve_numeric(address.host, address.port, false);
    std::memcpy(&proc.address, ai->ai_addr, ai->ai_addrlen);
    proc.address_len = ai->ai_addrlen;
  }
  RELAY_CHECK(next == g.world, "tcp group: the ", all.size(), " processes host ranks [0, ", next,
              ") but the world has ", g.world);
  return processes;
}

// Writes all of `bytes` to a non-blocking socket by the deadline.
void send_all(int fd, std::span<const uint8_t> bytes, Clock::time_point deadline,
              const std::string& what) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t sent = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (sent > 0) {
      done += static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    RELAY_CHECK(sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), what, ": ",
                errno_text(errno));
    pollfd p{fd, POLLOUT, 0};
    RELAY_CHECK(::poll(&p, 1, poll_ms(deadline)) != 0, what, ": timed out");
  }
}

// Connects rank `from` to rank `to`'s process and sends the hello.
OwnedFd connect_rank(const GroupState& g, int from, int to, Clock::time_point deadline) {
  const Process& target = g.process_of(to);
  const std::string what =
      str("tcp group: rank ", from, " connecting to rank ", to, " at ", target.endpoint);
  OwnedFd fd(::socket(target.address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  RELAY_CHECK(fd.get() >= 0, what, ": socket failed: ", errno_text(errno));
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&target.address), target.address_len) !=
      0) {
    RELAY_CHECK(errno == EINPROGRESS, what, ": ", errno_text(errno));
    pollfd p{fd.get(), POLLOUT, 0};
    RELAY_CHECK(::poll(&p, 1, poll_ms(deadline)) > 0, what, ": no answer within ",
                g.timeout.count(), " ms");
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    RELAY_CHECK(err == 0, what, ": ", errno_text(err));
  }
  set_nodelay(fd.get());
  Hello hello{};
  std::memcpy(hello.magic, kMeshMagic, sizeof(kMeshMagic));
  hello.byte_order = kByteOrderMark;
  hello.generation = g.generation;
  hello.from_rank = from;
  hello.to_rank = to;
  hello.world = g.world;
  send_all(fd.get(), std::span(reinterpret_cast<const uint8_t*>(&hello), sizeof(hello)), deadline,
           what);
  return fd;
}

// A connection accepted but not yet identified by its hello.
struct Joining {
  OwnedFd fd;
  Hello hello{};
  size_t received = 0;
};

// Routes an identified connection to its rank's slot; false when it is to be dropped.
bool route(GroupState& g, Joining& j) {
  const Hello& h = j.hello;
  if (std::memcmp(h.magic, kMeshMagic, sizeof(kMeshMagic)) != 0) return false;  // a port probe
  RELAY_CHECK(h.byte_order == kByteOrderMark, "tcp group: a rank connecting to ", g.ranges(),
              " runs with another byte order");
  // NOTE: a connection of another generation is left over from a mesh build that failed.
  if (h.generation != g.generation) return false;
  RELAY_CHECK(h.world == g.world, "tcp group: rank ", h.from_rank, " was started for a world of ",
              h.world, " ranks but ", g.ranges(), " for ", g.world);
  const int local = h.to_rank - g.first_rank;
  RELAY_CHECK(local >= 0 && local < g.num_local && h.from_rank > h.to_rank && h.from_rank < g.world,
              "tcp group: a connection from rank ", h.from_rank, " to rank ", h.to_rank,
              " reached the process of ", g.ranges(), " (world ", g.world, ")");
  int& slot = g.links[local]->fds[h.from_rank];
  RELAY_CHECK(slot < 0, "tcp group: rank ", h.from_rank, " connected to rank ", h.to_rank,
              " twice");
  slot = j.fd.release();
  return true;
}

// Builds this process's part of the mesh of generation g.generation: every local rank connects to
// each lower rank, then the process accepts a connection from each higher rank of each local rank.
void build_mesh(GroupState& g) {
  const auto deadline = Clock::now() + g.timeout;
  int missing = 0;
  for (int local = 0; local < g.num_local; ++local) {
    const int rank = g.first_rank + local;
    for (int to = 0; to < rank; ++to)
      g.links[local]->fds[to] = connect_rank(g, rank, to, deadline).release();
    missing += g.world - 1 - rank;
  }
  std::vector<Joining> joining;
  std::vector<pollfd> fds;
  while (missing > 0) {
    fds.assign(1, {g.listener, POLLIN, 0});
    for (const Joining& j : joining) fds.push_back({j.fd.get(), POLLIN, 0});
    const int n = ::poll(fds.data(), fds.size(), poll_ms(deadline));
    if (n < 0 && errno == EINTR) continue;
    RELAY_CHECK(n >= 0, "tcp group: poll failed: ", errno_text(errno));
    if (n == 0) {
      std::string waits;
      for (int local = 0; local < g.num_local; ++local) {
        std::vector<int> from;
        for (int r = g.first_rank + local + 1; r < g.world; ++r)
          if (g.links[local]->fds[r] < 0) from.push_back(r);
        if (!from.empty())
          waits += str(waits.empty() ? "" : "; ", "rank ", g.first_rank + local, " from ranks ",
                       join(from));
      }
      fail(str("tcp group: the process of ", g.ranges(), " did not get every connection within ",
               g.timeout.count(), " ms: ", waits));
    }
    std::vector<Joining> still_joining;
    for (size_t i = 1; i < fds.size(); ++i) {
      Joining& j = joining[i - 1];
      if (fds[i].revents != 0) {
        auto* into = reinterpret_cast<uint8_t*>(&j.hello) + j.received;
        const ssize_t got = ::recv(j.fd.get(), into, sizeof(Hello) - j.received, 0);
        if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) continue;  // dropped
        if (got > 0) j.received += static_cast<size_t>(got);
        if (j.received == sizeof(Hello)) {
          if (route(g, j)) --missing;
          continue;
        }
      }
      still_joining.push_back(std::move(j));
    }
    joining = std::move(still_joining);
    if (fds[0].revents != 0) {
      while (true) {
        const int fd = ::accept4(g.listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          if (errno == EINTR || errno == ECONNABORTED) continue;
          fail(str("tcp group: accept on the process of ", g.ranges(),
                   " failed: ", errno_text(errno)));
        }
        set_nodelay(fd);
        joining.push_back({OwnedFd(fd)});
      }
    }
  }
}

// One peer's side of a collective in progress: this rank's frame to it and its frame to this rank.
struct PeerIo {
  int peer = 0;
  int fd = -1;
  FrameHeader out_header{};
  std::span<const uint8_t> out_payload;
  size_t sent = 0;  // bytes of out_header, then out_payload, written
  FrameHeader in_header{};
  uint8_t* in_payload = nullptr;  // where the peer's payload goes, once its header is in
  size_t received = 0;            // bytes of in_header, then the payload, read

  bool sending() const { return sent < kFrameHeaderBytes + out_payload.size(); }
  bool receiving() const {
    return received < kFrameHeaderBytes || received < kFrameHeaderBytes + in_header.bytes;
  }
};

class TcpCommunicator : public Communicator {
 public:
  TcpCommunicator(std::shared_ptr<GroupState> state, int local)
      : state_(std::move(state)),
        links_(*state_->links[local]),
        rank_(state_->first_rank + local),
        contributions_(state_->world) {}

  int rank() const override { return rank_; }
  int size() const override { return state_->world; }

  void all_reduce_sum(float* data, size_t count) override {
    const int n = size();
    const std::span<const uint8_t> mine(reinterpret_cast<const uint8_t*>(data),
                                        count * sizeof(float));
    const std::vector<std::span<const uint8_t>> out(n, mine);
    exchange(Op::kAllReduceSum, out, [&](int peer, uint64_t bytes) {
      if (bytes != mine.size()) {
        abort();
        fail(str("all_reduce_sum: rank ", rank_, " reduces ", count, " values but rank ", peer, " ",
                 bytes / sizeof(float)));
      }
      contributions_[peer].resize(count);
      return reinterpret_cast<uint8_t*>(contributions_[peer].data());
    });
    // NOTE: local_group.cpp's order exactly (rank 0's values, + rank 1's, + rank 2's, ... in
    // fp32), so every rank and the thread group get the same bits; in chunks, so the sum needs no
    // count-sized scratch and may overwrite `data` (this rank's contribution) as it goes.
    float sum[kSumChunk];
    for (size_t begin = 0; begin < count; begin += kSumChunk) {
      const size_t len = std::min(kSumChunk, count - begin);
      const auto part = [&](int r) {
        return (r == rank_ ? data : contributions_[r].data()) + begin;
      };
      std::memcpy(sum, part(0), len * sizeof(float));
      for (int r = 1; r < n; ++r) {
        const float* src = part(r);
        for (size_t i = 0; i < len; ++i) sum[i] += src[i];
      }
      std::memcpy(data + begin, sum, len * sizeof(float));
    }
  }

  void all_to_all(std::span<const std::vector<float>> send,
                  std::vector<std::vector<float>>& recv) override {
    all_to_all_of(Op::kAllToAllF32, send, recv);
  }
  void all_to_all(std::span<const std::vector<int32_t>> send,
                  std::vector<std::vector<int32_t>>& recv) override {
    all_to_all_of(Op::kAllToAllI32, send, recv);
  }

  void barrier() override {
    const std::vector<std::span<const uint8_t>> out(size());
    exchange(Op::kBarrier, out, [&](int peer, uint64_t bytes) -> uint8_t* {
      if (bytes != 0) {
        abort();
        fail(str("barrier: rank ", peer, " sent rank ", rank_, " ", bytes, " bytes"));
      }
      return nullptr;
    });
  }

  void abort() override { links_.abort(); }

  void reset() override {
    GroupState& g = *state_;
    for (auto& links : g.links) {
      std::lock_guard lock(links->mu);
      RELAY_CHECK(!links->in_collective, "tcp group: reset() while a rank of ", g.ranges(),
                  " is inside a collective");
      // NOTE: the ranks stay aborted until the new mesh is complete, so a failed rebuild leaves
      // them throwing "aborted" (and the next reset() tries again).
      links->aborted = true;
      links->close_all();
      links->calls = 0;
    }
    ++g.generation;
    build_mesh(g);
    for (auto& links : g.links) links->aborted = false;
  }

 private:
  [[noreturn]] void throw_aborted() const {
    fail(str("rank ", rank_, " of ", size(),
             ": the group was aborted by a failed rank (reset() re-arms it)"));
  }

  // A peer's connection failed inside a collective: abort this rank too, so that the failure
  // reaches every rank waiting on it, and throw naming the peer.
  [[noreturn]] void lost_peer(int peer, Op op, int err) {
    if (links_.aborted) throw_aborted();  // this rank's own abort() (from another thread) did it
    abort();
    fail(str("rank ", rank_, " of ", size(), ", in ", op_name(static_cast<uint64_t>(op)), ": rank ",
             peer, " closed its connection: it aborted or exited",
             err != 0 ? str(" (", errno_text(err), ")") : std::string()));
  }

  template <typename T>
  void all_to_all_of(Op op, std::span<const std::vector<T>> send,
                     std::vector<std::vector<T>>& recv) {
    const int n = size();
    RELAY_CHECK(static_cast<int>(send.size()) == n, "all_to_all: rank ", rank_, " passed ",
                send.size(), " send buffers for a group of ", n);
    std::vector<std::span<const uint8_t>> out(n);
    for (int d = 0; d < n; ++d)
      if (d != rank_)
        out[d] = {reinterpret_cast<const uint8_t*>(send[d].data()), send[d].size() * sizeof(T)};
    recv.resize(n);
    exchange(op, out, [&](int peer, uint64_t bytes) {
      if (bytes % sizeof(T) != 0) {
        abort();
        fail(str("all_to_all: rank ", peer, " sent rank ", rank_, " ", bytes, " bytes, not whole ",
                 sizeof(T), "-byte values"));
      }
      recv[peer].resize(bytes / sizeof(T));
      return reinterpret_cast<uint8_t*>(recv[peer].data());
    });
    recv[rank_].assign(send[rank_].begin(), send[rank_].end());
  }

  // Sends out[peer] to every peer and receives every peer's frame at once, in one poll() loop.
  // place(peer, bytes) checks a peer's payload size and returns where its payload goes.
  template <typename Place>
  void exchange(Op op, std::span<const std::span<const uint8_t>> out, Place place) {
    if (!links_.enter()) throw_aborted();
    struct Leave {
      RankLinks& links;
      ~Leave() { links.leave(); }
    } leave{links_};
    const uint64_t call = links_.calls++;
    const auto deadline = Clock::now() + state_->timeout;
    std::vector<PeerIo> peers;
    for (int p = 0; p < size(); ++p) {
      if (p == rank_) continue;
      PeerIo io;
      io.peer = p;
      io.fd = links_.fds[p];
      io.out_header = {static_cast<uint64_t>(op), call, out[p].size()};
      io.out_payload = out[p];
      peers.push_back(io);
    }
    std::vector<pollfd> fds;
    std::vector<PeerIo*> polled;
    while (true) {
      if (links_.aborted) throw_aborted();
      fds.clear();
      polled.clear();
      for (PeerIo& io : peers) {
        const short events = (io.sending() ? POLLOUT : 0) | (io.receiving() ? POLLIN : 0);
        if (events == 0) continue;
        fds.push_back({io.fd, events, 0});
        polled.push_back(&io);
      }
      if (fds.empty()) return;
      const int wait_ms = poll_ms(deadline);
      const int n = wait_ms > 0 ? ::poll(fds.data(), fds.size(), wait_ms) : 0;
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        abort();
        fail(str("rank ", rank_, " of ", size(), ": poll failed: ", errno_text(err)));
      }
      if (n == 0) {
        std::vector<int> waiting;
        for (const PeerIo* io : polled) waiting.push_back(io->peer);
        abort();
        fail(str("rank ", rank_, " of ", size(), ": ", op_name(static_cast<uint64_t>(op)),
                 " timed out after ", state_->timeout.count(), " ms waiting for rank(s) ",
                 join(waiting)));
      }
      for (size_t i = 0; i < fds.size(); ++i) {
        const short ev = fds[i].revents;
        PeerIo& io = *polled[i];
        if (io.sending() && (ev & (POLLOUT | POLLERR | POLLHUP))) pump_send(io, op);
        if (io.receiving() && (ev & (POLLIN | POLLERR | POLLHUP))) pump_recv(io, op, call, place);
      }
    }
  }

  // Writes what the socket takes of the frame to io.peer (header and payload in one call).
  void pump_send(PeerIo& io, Op op) {
    while (io.sending()) {
      iovec parts[2];
      int num_parts = 0;
      if (io.sent < kFrameHeaderBytes)
        parts[num_parts++] = {reinterpret_cast<uint8_t*>(&io.out_header) + io.sent,
                              kFrameHeaderBytes - io.sent};
      const size_t payload_done = io.sent > kFrameHeaderBytes ? io.sent - kFrameHeaderBytes : 0;
      if (payload_done < io.out_payload.size())
        parts[num_parts++] = {const_cast<uint8_t*>(io.out_payload.data()) + payload_done,
                              io.out_payload.size() - payload_done};
      msghdr msg{};
      msg.msg_iov = parts;
      msg.msg_iovlen = num_parts;
      const ssize_t sent = ::sendmsg(io.fd, &msg, MSG_NOSIGNAL);
      if (sent > 0) {
        io.sent += static_cast<size_t>(sent);
        continue;
      }
      if (sent < 0 && errno == EINTR) continue;
      if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      lost_peer(io.peer, op, sent < 0 ? errno : 0);
    }
  }

  // Reads what has arrived of io.peer's frame; checks its header as soon as it is complete.
  template <typename Place>
  void pump_recv(PeerIo& io, Op op, uint64_t call, Place& place) {
    while (io.receiving()) {
      uint8_t* into;
      size_t want;
      if (io.received < kFrameHeaderBytes) {
        into = reinterpret_cast<uint8_t*>(&io.in_header) + io.received;
        want = kFrameHeaderBytes - io.received;
      } else {
        const size_t done = io.received - kFrameHeaderBytes;
        into = io.in_payload + done;
        want = io.in_header.bytes - done;
      }
      const ssize_t got = ::recv(io.fd, into, want, 0);
      if (got > 0) {
        io.received += static_cast<size_t>(got);
        if (io.received == kFrameHeaderBytes) {
          check_header(io.peer, op, call, io.in_header);
          io.in_payload = place(io.peer, io.in_header.bytes);
        }
        continue;
      }
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      lost_peer(io.peer, op, got < 0 ? errno : 0);
    }
  }

  void check_header(int peer, Op op, uint64_t call, const FrameHeader& h) {
    if (h.op == static_cast<uint64_t>(op) && h.call == call) return;
    abort();
    fail(str("rank ", rank_, " of ", size(), " is in ", op_name(static_cast<uint64_t>(op)),
             " (call ", call, ") but rank ", peer, " sent ", op_name(h.op), " (call ", h.call,
             "): the ranks' collectives are out of step"));
  }

  std::shared_ptr<GroupState> state_;
  RankLinks& links_;
  const int rank_;
  // [size]: the peers' buffers of the all_reduce_sum in progress (kept: a step's sizes repeat).
  std::vector<std::vector<float>> contributions_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_tcp_group(TcpBootstrap& bootstrap, int first_rank,
                                                          int num_local, int world,
                                                          std::chrono::milliseconds timeout) {
  RELAY_CHECK(world >= 1, "tcp group: a world needs at least one rank, got ", world);
  auto state = std::make_shared<GroupState>(first_rank, num_local, world, timeout);
  std::string endpoint;
  state->listener = open_listener(bootstrap.local_host(), endpoint);
  state->processes = exchange_endpoints(bootstrap, *state, endpoint);
  build_mesh(*state);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int i = 0; i < num_local; ++i) comms.push_back(std::make_unique<TcpCommunicator>(state, i));
  return comms;
}

}  // namespace relay::parallel

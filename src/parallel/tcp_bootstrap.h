// TCP rendezvous for the ranks of one group: how processes (or threads) that share nothing yet find
// each other before NCCL exists.
//
// Rank 0 listens on HOST:PORT (the `--dist-init` string); every other rank connects to it, retrying
// until the deadline because rank 0 may start last. Each connecting rank introduces itself (magic,
// rank, group size): a client without the magic (a port probe) is dropped, and a duplicate rank or
// a disagreement on the group size fails at once on both sides with a message naming them. After
// that the group is a star around rank 0 and offers small collectives: broadcast (rank 0's blob to
// everyone: the ncclUniqueId), gather (one blob per rank to rank 0), all_gather (one blob per rank
// to everyone) and barrier. They are for setup-time bytes and a leader's per-step messages, not
// tensors: every message goes through rank 0.
//
// Plain POSIX sockets and no CUDA, so it lives in the CPU relay_parallel library and CI tests it
// with threads. Every call is bounded as a whole (not per message) by the timeout given at
// creation, or by its own timeout argument; errors name the host, port, rank and timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace relay::parallel {

struct DistInitAddress {
  std::string host;  // name or numeric address; rank 0 binds it, the others connect to it
  int port = 0;      // 1..65535
};

// Parses "HOST:PORT" (IPv6 as "[ADDR]:PORT"); throws relay::Error naming the string.
DistInitAddress parse_dist_init(std::string_view text);

class TcpBootstrap {
 public:
  // Blocks until all `size` ranks have joined. Rank 0 listens; ranks 1..size-1 connect.
  TcpBootstrap(const DistInitAddress& address, int rank, int size,
               std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~TcpBootstrap();
  TcpBootstrap(const TcpBootstrap&) = delete;
  TcpBootstrap& operator=(const TcpBootstrap&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Rank 0 passes the blob; every rank (rank 0 included) gets it back. Other ranks' argument is
  // ignored.
  std::vector<uint8_t> broadcast(std::span<const uint8_t> blob);
  // Every rank passes its blob (sizes may differ); every rank gets all of them, indexed by rank.
  std::vector<std::vector<uint8_t>> all_gather(std::span<const uint8_t> blob);
  void barrier();

  // A per-call timeout for the calls below; kNoTimeout waits as long as the connection lives (a
  // follower process waiting for the leader's next step). A closed connection still fails at once.
  static constexpr std::chrono::milliseconds kNoTimeout{-1};
  std::vector<uint8_t> broadcast(std::span<const uint8_t> blob, std::chrono::milliseconds timeout);
  // Every rank passes a blob; rank 0 gets all of them indexed by rank, the others get an empty
  // vector.
  std::vector<std::vector<uint8_t>> gather(std::span<const uint8_t> blob,
                                           std::chrono::milliseconds timeout);
  // The numeric address of this process's end of its connection to rank 0 (on rank 0: of its end of
  // the connection to rank 1; "127.0.0.1" in a group of one): the interface the other ranks can
  // reach this process on, for endpoints exchanged after the rendezvous.
  std::string local_host() const;

 private:
  // When a call gives up, and the timeout it was given (for messages); a kNoTimeout call never
  // does.
  struct Deadline {
    std::chrono::steady_clock::time_point at;
    std::chrono::milliseconds timeout;
  };
  Deadline deadline_after(std::chrono::milliseconds timeout) const;
  void send_message(int fd, int peer, std::span<const uint8_t> bytes, const Deadline& deadline);
  std::vector<uint8_t> recv_message(int fd, int peer, const Deadline& deadline);
  std::vector<std::vector<uint8_t>> gather_until(std::span<const uint8_t> blob,
                                                 const Deadline& deadline);
  std::string where(int peer) const;  // "rank 2 of 4 (HOST:PORT, peer rank 0)" for messages

  DistInitAddress address_;
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_;
  // Rank 0: peers_[r] is the socket to rank r (peers_[0] unused). Other ranks: peers_[0] is the
  // socket to rank 0.
  std::vector<int> peers_;
  std::string local_host_ = "127.0.0.1";
};

}  // namespace relay::parallel

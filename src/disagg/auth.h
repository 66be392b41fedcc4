// Authentication of the disaggregation control plane: the router and its workers prove to each
// other that they hold one shared secret.
//
// Without it anyone who could reach the router could register a "decode worker" with a heartbeat
// and receive users' prompts in /disagg/reserve and /disagg/generate, and anyone who could reach a
// worker could drive its engine. Every control message is therefore signed: the sender adds
//   X-Relay-Timestamp: <unix seconds>   X-Relay-Nonce: <128 random bits, hex>
//   X-Relay-Signature: hex(HMAC-SHA256(secret, method \n path \n timestamp \n nonce \n
//                                      hex(SHA256(body))))
// and the receiver recomputes the MAC (constant-time comparison), refuses a timestamp more than
// kMaxClockSkew from its own clock, and refuses a nonce it has seen inside that window, so a
// recorded message cannot be replayed or altered. The secret itself never crosses the wire. Workers
// sign their heartbeats (the router learns of a worker only from a valid one); the router signs its
// calls to workers (reserve, prefill, generate, release), so a worker obeys only its router.
//
// What this does not give: confidentiality. Prompts and token streams cross the control plane in
// clear text, as the KV pages cross UCX; run it on a private network. (Mutual TLS would add that;
// it is not built.) Hosts need clocks within kMaxClockSkew of each other (NTP).
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "http/server.h"

namespace relay::disagg {

constexpr auto kMaxClockSkew = std::chrono::seconds(60);

class ControlPlaneAuth {
 public:
  // `secret`: at least 16 bytes (throws relay::Error otherwise).
  explicit ControlPlaneAuth(std::string secret);
  // Reads the secret from a file (its whole content, one trailing newline dropped), as
  // --disagg-secret-file does: a secret on the command line would show in `ps`.
  static std::shared_ptr<ControlPlaneAuth> from_file(const std::string& path);

  // The headers that sign a message (method, path, body) sent now.
  http::Headers sign(std::string_view method, std::string_view path, std::string_view body);
  // Nothing when `request` carries a valid, fresh, unreplayed signature; otherwise why not.
  std::optional<std::string> verify(const http::Request& request);
  // The same, with the current time given (for tests).
  std::optional<std::string> verify(const http::Request& request,
                                    std::chrono::system_clock::time_point now);

 private:
  std::string mac(std::string_view method, std::string_view path, std::string_view timestamp,
                  std::string_view nonce, std::string_view body) const;

  std::string secret_;
  std::mutex mu_;
  // Nonces seen inside the skew window, oldest first, with when they stop mattering.
  std::deque<std::pair<std::chrono::system_clock::time_point, std::string>> seen_order_;
  std::unordered_set<std::string> seen_;
};

}  // namespace relay::disagg

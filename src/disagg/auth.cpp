// See auth.h.
#include "disagg/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <charconv>

#include "core/error.h"
#include "core/json.h"

namespace relay::disagg {

namespace {

using SystemClock = std::chrono::system_clock;

// Bound on the nonces remembered (~50 MB at most): a nonce is kept for two skew windows, so this
// covers 8,700 control messages a second before the oldest are forgotten early.
constexpr size_t kMaxNonces = size_t{1} << 20;

std::string hex(const unsigned char* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return out;
}

std::string sha256_hex(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  RELAY_CHECK(EVP_Digest(data.data(), data.size(), digest, &n, EVP_sha256(), nullptr) == 1,
              "control plane: SHA-256 failed");
  return hex(digest, n);
}

}  // namespace

ControlPlaneAuth::ControlPlaneAuth(std::string secret) : secret_(std::move(secret)) {
  RELAY_CHECK(secret_.size() >= 16, "the control-plane secret must be at least 16 bytes, got ",
              secret_.size(), " (e.g. `openssl rand -hex 32 > secret`)");
}

std::shared_ptr<ControlPlaneAuth> ControlPlaneAuth::from_file(const std::string& path) {
  std::string secret = read_text_file(path);
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (!secret.empty() && secret.back() == '\r') secret.pop_back();
  try {
    return std::make_shared<ControlPlaneAuth>(std::move(secret));
  } catch (const Error& e) {
    fail(str(path, ": ", e.what()));
  }
}

std::string ControlPlaneAuth::mac(std::string_view method, std::string_view path,
                                  std::string_view timestamp, std::string_view nonce,
                                  std::string_view body) const {
  const std::string message =
      str(method, "\n", path, "\n", timestamp, "\n", nonce, "\n", sha256_hex(body));
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  RELAY_CHECK(HMAC(EVP_sha256(), secret_.data(), static_cast<int>(secret_.size()),
                   reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest,
                   &n) != nullptr,
              "control plane: HMAC-SHA256 failed");
  return hex(digest, n);
}

http::Headers ControlPlaneAuth::sign(std::string_view method, std::string_view path,
                                     std::string_view body) {
  unsigned char random[16];
  RELAY_CHECK(RAND_bytes(random, sizeof random) == 1, "control plane: no random bytes for a nonce");
  const std::string nonce = hex(random, sizeof random);
  const std::string timestamp = std::to_string(
      std::chrono::duration_cast<std::chrono::seconds>(SystemClock::now().time_since_epoch())
          .count());
  return {{"X-Relay-Timestamp", timestamp},
          {"X-Relay-Nonce", nonce},
          {"X-Relay-Signature", mac(method, path, timestamp, nonce, body)}};
}

std::optional<std::string> ControlPlaneAuth::verify(const http::Request& request) {
  return verify(request, SystemClock::now());
}

std::optional<std::string> ControlPlaneAuth::verify(const http::Request& request,
                                                    SystemClock::time_point now) {
  const std::string timestamp = request.header("X-Relay-Timestamp");
  const std::string nonce = request.header("X-Relay-Nonce");
  const std::string signature = request.header("X-Relay-Signature");
  if (timestamp.empty() || nonce.empty() || signature.empty()) {
    return "an unsigned control message (X-Relay-Timestamp, X-Relay-Nonce and X-Relay-Signature "
           "are required: start every process of the deployment with the same "
           "--disagg-secret-file)";
  }
  int64_t seconds = 0;
  const auto [end, ec] =
      std::from_chars(timestamp.data(), timestamp.data() + timestamp.size(), seconds);
  if (ec != std::errc() || end != timestamp.data() + timestamp.size()) {
    return "a malformed X-Relay-Timestamp";
  }
  const SystemClock::time_point sent{std::chrono::seconds(seconds)};
  if (sent < now - kMaxClockSkew || sent > now + kMaxClockSkew) {
    return "a control message outside the 60 s window of this host's clock (a replay, or clocks "
           "that disagree: run NTP)";
  }
  if (nonce.size() > 64) return "a malformed X-Relay-Nonce";
  const std::string expected = mac(request.method, request.path, timestamp, nonce, request.body);
  if (signature.size() != expected.size() ||
      CRYPTO_memcmp(signature.data(), expected.data(), expected.size()) != 0) {
    return "a control message with a wrong signature (a different --disagg-secret-file?)";
  }
  std::lock_guard lock(mu_);
  // A nonce matters only while its timestamp is inside the window: forget older ones.
  while (!seen_order_.empty() &&
         (seen_order_.front().first < now || seen_order_.size() >= kMaxNonces)) {
    seen_.erase(seen_order_.front().second);
    seen_order_.pop_front();
  }
  if (!seen_.insert(nonce).second) return "a replayed control message (its nonce was seen)";
  seen_order_.emplace_back(sent + 2 * kMaxClockSkew, nonce);
  return std::nullopt;
}

}  // namespace relay::disagg

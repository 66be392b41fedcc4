// disagg/auth.h: a signed control message verifies once; a wrong secret, an altered message, a
// stale or future timestamp, a replay and a missing signature are each refused with a reason.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "disagg/auth.h"

namespace relay::disagg {
namespace {

using namespace std::chrono_literals;

http::Request signed_request(ControlPlaneAuth& auth, std::string method, std::string path,
                             std::string body) {
  http::Request r;
  r.headers = auth.sign(method, path, body);
  r.method = std::move(method);
  r.path = std::move(path);
  r.body = std::move(body);
  return r;
}

bool refused_for(const std::optional<std::string>& why, std::string_view part) {
  return why && why->find(part) != std::string::npos;
}

TEST(ControlPlaneAuth, ASignedMessageVerifiesOnceOnly) {
  ControlPlaneAuth auth("0123456789abcdef0123456789abcdef");
  const http::Request r = signed_request(auth, "POST", "/disagg/heartbeat", "{\"url\": \"x\"}");
  EXPECT_EQ(auth.verify(r), std::nullopt);
  EXPECT_TRUE(refused_for(auth.verify(r), "replayed"));
  // A fresh signature of the same message is a new message.
  EXPECT_EQ(auth.verify(signed_request(auth, "POST", "/disagg/heartbeat", "{\"url\": \"x\"}")),
            std::nullopt);
}

TEST(ControlPlaneAuth, AlteredMessagesAndOtherSecretsAreRefused) {
  ControlPlaneAuth auth("0123456789abcdef0123456789abcdef");
  ControlPlaneAuth other("fedcba9876543210fedcba9876543210");
  EXPECT_TRUE(refused_for(other.verify(signed_request(auth, "POST", "/disagg/reserve", "{}")),
                          "wrong signature"));
  http::Request body = signed_request(auth, "POST", "/disagg/reserve", "{\"prompt\": [1]}");
  body.body = "{\"prompt\": [2]}";
  EXPECT_TRUE(refused_for(auth.verify(body), "wrong signature"));
  http::Request path = signed_request(auth, "POST", "/disagg/reserve", "{}");
  path.path = "/disagg/release";
  EXPECT_TRUE(refused_for(auth.verify(path), "wrong signature"));
  http::Request method = signed_request(auth, "POST", "/disagg/workers", "");
  method.method = "GET";
  EXPECT_TRUE(refused_for(auth.verify(method), "wrong signature"));
  http::Request unsigned_request;
  unsigned_request.method = "POST";
  unsigned_request.path = "/disagg/heartbeat";
  EXPECT_TRUE(refused_for(auth.verify(unsigned_request), "unsigned control message"));
}

TEST(ControlPlaneAuth, TimestampsOutsideTheWindowAreRefused) {
  ControlPlaneAuth auth("0123456789abcdef0123456789abcdef");
  const auto now = std::chrono::system_clock::now();
  EXPECT_TRUE(refused_for(
      auth.verify(signed_request(auth, "POST", "/p", "b"), now + kMaxClockSkew + 5s), "window"));
  EXPECT_TRUE(refused_for(
      auth.verify(signed_request(auth, "POST", "/p", "b"), now - kMaxClockSkew - 5s), "window"));
  EXPECT_EQ(auth.verify(signed_request(auth, "POST", "/p", "b"), now + kMaxClockSkew - 5s),
            std::nullopt);
  http::Request garbled = signed_request(auth, "POST", "/p", "b");
  for (auto& [name, value] : garbled.headers) {
    if (name == "X-Relay-Timestamp") value += "x";
  }
  EXPECT_TRUE(refused_for(auth.verify(garbled), "malformed X-Relay-Timestamp"));
}

TEST(ControlPlaneAuth, SecretsComeFromFilesAndMustBeLongEnough) {
  EXPECT_THROW(ControlPlaneAuth("short"), Error);
  const auto path = std::filesystem::temp_directory_path() / "relay_test_secret";
  std::ofstream(path) << "0123456789abcdef0123456789abcdef\n";
  auto from_file = ControlPlaneAuth::from_file(path.string());
  ControlPlaneAuth direct("0123456789abcdef0123456789abcdef");
  // The trailing newline is not part of the secret: both sign alike.
  EXPECT_EQ(direct.verify(signed_request(*from_file, "POST", "/p", "b")), std::nullopt);
  std::ofstream(path) << "short\n";
  try {
    ControlPlaneAuth::from_file(path.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path.string() + ": the control-plane secret"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace relay::disagg

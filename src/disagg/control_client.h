// The control plane's HTTP client: how the router reaches its workers and a worker its router.
//
// One cpp-httplib client per peer URL. Over https it verifies the peer's certificate with the
// deployment's CA and presents its own certificate (the same files its server uses), so router and
// workers authenticate each other (mutual TLS). The shared secret's signatures (disagg/auth.h)
// work the same over either scheme; a deployment may use both.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "http/server.h"

namespace httplib {
class Client;
}

namespace relay::disagg {

// A client for `url` ("http://host:port" or "https://host:port"; a bare "host:port" is http).
// Throws relay::Error when the TLS files cannot be used.
std::unique_ptr<httplib::Client> control_client(const std::string& url, const http::TlsOptions& tls,
                                                std::chrono::milliseconds read_timeout);

}  // namespace relay::disagg

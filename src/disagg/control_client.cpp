#include "disagg/control_client.h"

#include <httplib.h>

#include "core/error.h"

namespace relay::disagg {

std::unique_ptr<httplib::Client> control_client(const std::string& url, const http::TlsOptions& tls,
                                                std::chrono::milliseconds read_timeout) {
  const std::string with_scheme = url.find("://") == std::string::npos ? "http://" + url : url;
  auto c = std::make_unique<httplib::Client>(with_scheme, tls.cert_file, tls.key_file);
  RELAY_CHECK(c->is_valid(), "cannot make a client for ", with_scheme,
              " (a TLS client certificate '", tls.cert_file, "' or key '", tls.key_file,
              "' that cannot be used?)");
  if (!tls.ca_file.empty()) c->set_ca_cert_path(tls.ca_file);
  c->set_connection_timeout(std::chrono::seconds(2));
  c->set_read_timeout(read_timeout);
  c->set_write_timeout(std::chrono::seconds(10));
  return c;
}

}  // namespace relay::disagg

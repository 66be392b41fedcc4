// Relay's error type and checks.
//
// Every failure inside the engine is a relay::Error that carries the file, line and the failed
// condition; at the request boundary (HTTP, CLI) it becomes a message for that request only. Checks
// belong at boundaries (file parsing, API arguments, tensor shapes); hot loops trust them.
#pragma once

#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace relay {

// Concatenates any streamable values: str("tensor ", name, " has ", n, " dims").
template <typename... Args>
std::string str(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message,
                 std::source_location where = std::source_location::current())
      : std::runtime_error(message), where_(where) {}

  const std::source_location& where() const { return where_; }
  // "message (at file:line)", for logs.
  std::string detailed() const {
    return str(what(), " (at ", where_.file_name(), ":", where_.line(), ")");
  }

 private:
  std::source_location where_;
};

[[noreturn]] inline void fail(const std::string& message,
                              std::source_location where = std::source_location::current()) {
  throw Error(message, where);
}

}  // namespace relay

// RELAY_CHECK(cond, parts...): throws relay::Error("<parts> [check failed: cond]") when cond is false.
#define RELAY_CHECK(cond, ...)                                                          \
  do {                                                                                  \
    if (!(cond)) [[unlikely]] {                                                         \
      ::relay::fail(::relay::str(__VA_ARGS__ __VA_OPT__(, ) " [check failed: " #cond "]")); \
    }                                                                                   \
  } while (0)

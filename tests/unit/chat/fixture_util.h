// Shared helpers for the chat tests: reading committed fixtures and describing the first byte where
// two renderings differ (a prompt is long; "strings differ" alone is useless).
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

namespace relay::chat::testing {

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ordered_json: fixture objects keep Python's key order, which reaches the output through tojson.
inline nlohmann::ordered_json read_fixture(const std::string& name) {
  return nlohmann::ordered_json::parse(read_text(std::string(RELAY_FIXTURES_DIR) + "/chat/" + name));
}

inline std::string first_difference(const std::string& expected, const std::string& actual) {
  size_t i = 0;
  while (i < expected.size() && i < actual.size() && expected[i] == actual[i]) ++i;
  auto around = [i](const std::string& s) {
    const size_t from = i > 40 ? i - 40 : 0;
    return nlohmann::json(s.substr(from, 80)).dump();
  };
  std::ostringstream ss;
  ss << "first difference at byte " << i << " (expected " << expected.size() << " bytes, got " << actual.size()
     << ")\n  expected: " << around(expected) << "\n  actual:   " << around(actual);
  return ss.str();
}

}  // namespace relay::chat::testing

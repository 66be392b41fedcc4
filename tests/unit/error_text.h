// The message of the relay::Error a call throws ("" when it throws none), for tests that check what
// an error says.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"

namespace relay::test {

template <typename Fn>
std::string error_text(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Expects `fn` to throw a relay::Error whose message contains `needle`.
template <typename Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  const std::string text = error_text(fn);
  if (text.empty()) {
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } else {
    EXPECT_NE(text.find(needle), std::string::npos) << text;
  }
}

}  // namespace relay::test

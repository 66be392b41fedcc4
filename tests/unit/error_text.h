// The message of the relay::Error a call throws ("" when it throws none), for tests that check what
// an error says.
#pragma once

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

}  // namespace relay::test

// FNV-1a over bytes: a small, stable (build- and platform-independent) 64-bit hash for names and
// addresses — make_model's per-tensor random streams, the dummy weights' offsets, the UCX worker
// address checksum. Not for hash tables of untrusted keys.
#pragma once

#include <cstdint>
#include <string_view>

namespace relay {

inline uint64_t fnv1a(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace relay

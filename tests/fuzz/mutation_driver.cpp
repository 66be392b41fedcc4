// A libFuzzer-compatible driver for compilers without libFuzzer (CI builds with g++): it runs a
// target's LLVMFuzzerTestOneInput over every file of its corpus folders, then over random mutations
// of them until a time budget runs out, so each fuzz target also runs in every CI build (with ASan
// and UBSan) for a bounded time. It is not coverage-guided — that is what the clang build with
// -DRELAY_FUZZ=ON is for (tests/fuzz/CMakeLists.txt) — but the mutations aim at what parsers get
// wrong: deep balanced nesting, truncation, repeated and spliced pieces, boundary bytes.
//
//   fuzz_x_ci [--seconds N] [--seed S] CORPUS_DIR...
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size);

namespace {

using Bytes = std::vector<uint8_t>;

// Pieces worth inserting into text formats: JSON and HTTP structure, numbers at type limits.
constexpr std::string_view kDictionary[] = {
    "{",      "}",        "[",           "]",           "\"",          ":",       ",",
    "\\",     "\\u0000",  "\\ud800",     "null",        "true",        "-1",      "1e400",
    "0",      "2147483648", "18446744073709551616", "\"messages\"", "\"role\"", "\"content\"",
    "\"tools\"", "\"tool_calls\"", "\"arguments\"", "\"prompt\"", "\"model\"", "\"user\"",
    "\"assistant\"", "\xff", "\xc3\x28", "\r\n"};

void run(const Bytes& input) { LLVMFuzzerTestOneInput(input.data(), input.size()); }

Bytes mutate(const std::vector<Bytes>& corpus, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  Bytes b = corpus[pick(corpus.size())];
  const int rounds = 1 + static_cast<int>(pick(6));
  for (int r = 0; r < rounds; ++r) {
    const size_t at = b.empty() ? 0 : pick(b.size() + 1);
    switch (pick(9)) {
      case 0:  // flip a bit
        if (!b.empty()) b[pick(b.size())] ^= static_cast<uint8_t>(1u << pick(8));
        break;
      case 1:  // a random byte
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), static_cast<uint8_t>(rng()));
        break;
      case 2: {  // a dictionary piece
        const std::string_view d = kDictionary[pick(std::size(kDictionary))];
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), d.begin(), d.end());
        break;
      }
      case 3:  // cut the tail
        b.resize(at);
        break;
      case 4: {  // delete a range
        if (b.empty()) break;
        const size_t from = pick(b.size()), n = 1 + pick(std::min<size_t>(b.size() - from, 64));
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(from),
                b.begin() + static_cast<std::ptrdiff_t>(from + n));
        break;
      }
      case 5: {  // repeat a range many times (deep nesting, long runs)
        if (b.empty()) break;
        const size_t from = pick(b.size()), n = 1 + pick(std::min<size_t>(b.size() - from, 8));
        const Bytes piece(b.begin() + static_cast<std::ptrdiff_t>(from),
                          b.begin() + static_cast<std::ptrdiff_t>(from + n));
        const size_t times = 1 + pick(pick(2) ? 16 : 4096);
        for (size_t t = 0; t < times; ++t)
          b.insert(b.begin() + static_cast<std::ptrdiff_t>(from), piece.begin(), piece.end());
        break;
      }
      case 6: {  // splice in part of another input
        const Bytes& other = corpus[pick(corpus.size())];
        if (other.empty()) break;
        const size_t from = pick(other.size()), n = 1 + pick(other.size() - from);
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(at),
                 other.begin() + static_cast<std::ptrdiff_t>(from),
                 other.begin() + static_cast<std::ptrdiff_t>(from + n));
        break;
      }
      case 7: {  // balanced nesting, shallow or far past any recursion limit
        const size_t depth = 1 + pick(pick(2) ? 64 : 50000);
        const bool object = pick(2);
        Bytes nest;
        for (size_t d = 0; d < depth; ++d) {
          if (object) {
            nest.insert(nest.end(), {'{', '"', 'a', '"', ':'});
          } else {
            nest.push_back('[');
          }
        }
        nest.push_back('1');
        nest.insert(nest.end(), depth, object ? '}' : ']');
        // Where a value may start, so a JSON input stays JSON: after a ':' (the old value becomes
        // a new member's) or a '['; else anywhere.
        std::vector<size_t> value_starts;
        for (size_t i = 0; i < b.size(); ++i) {
          if (b[i] == ':' || b[i] == '[') value_starts.push_back(i + 1);
        }
        size_t where = at;
        if (!value_starts.empty()) {
          where = value_starts[pick(value_starts.size())];
          const std::string_view tail = b[where - 1] == ':' ? ",\"z\":" : ",";
          nest.insert(nest.end(), tail.begin(), tail.end());
        }
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(where), nest.begin(), nest.end());
        break;
      }
      default:  // a boundary byte value
        if (!b.empty()) b[pick(b.size())] = std::array<uint8_t, 4>{0x00, 0x7f, 0x80, 0xff}[pick(4)];
        break;
    }
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 10.0;
  uint64_t seed = std::random_device{}();
  std::vector<std::filesystem::path> dirs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--seconds" && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (arg == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      dirs.emplace_back(arg);
    }
  }
  std::vector<Bytes> corpus;
  for (const auto& dir : dirs) {
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      std::ifstream in(entry.path(), std::ios::binary);
      corpus.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
  }
  if (corpus.empty()) {
    std::fprintf(stderr, "usage: %s [--seconds N] [--seed S] CORPUS_DIR... (no inputs found)\n",
                 argv[0]);
    return 2;
  }
  for (const Bytes& input : corpus) run(input);
  // The seed is printed first, so a crash can be replayed with --seed.
  std::fprintf(stderr, "%s: %zu corpus inputs replayed; mutating for %.0f s with --seed %llu\n",
               argv[0], corpus.size(), seconds, static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  uint64_t runs = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < 64; ++i, ++runs) run(mutate(corpus, rng));
  }
  std::fprintf(stderr, "%s: %llu mutated inputs, no crash\n", argv[0],
               static_cast<unsigned long long>(runs));
  return 0;
}

// `relay tokenize`: the tokenizer on the command line, for scripts and for the end-to-end tests
// that compare Relay with Hugging Face `tokenizers`. Encoding reads raw bytes from stdin (so
// invalid UTF-8 reaches the tokenizer unchanged) and prints a JSON list of ids; --decode does the
// reverse.
// --batch handles one JSON value per line, so a script pays the tokenizer's load time once.
#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/error.h"
#include "core/json.h"
#include "tokenizer/tokenizer.h"

namespace relay::cli {
namespace {

struct TokenizeOptions {
  std::string model_dir = default_model_dir();
  bool decode = false;
  bool skip_special_tokens = false;
  bool special_as_text = false;
  bool batch = false;
  bool stats = false;
};

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// CPU time of this thread: encode throughput that does not depend on how busy the machine is.
double thread_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e3 + double(t.tv_nsec) / 1e6;
}

void print_stats(double load_ms, size_t num_bytes, size_t num_tokens, double encode_ms) {
  std::cerr << "relay tokenize: load " << load_ms << " ms; encoded " << num_bytes << " bytes into "
            << num_tokens << " tokens in " << encode_ms << " ms of CPU time ("
            << double(num_bytes) / 1e6 / (encode_ms / 1e3) << " MB/s)\n";
}

// All of stdin, in large reads (istreambuf_iterator on a stdio-synced cin reads byte by byte).
std::string read_stdin() {
  std::string input;
  char buffer[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof buffer, stdin)) > 0) input.append(buffer, n);
  return input;
}

std::string ids_to_json(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) out += ",";
    out += std::to_string(ids[i]);
  }
  return out + "]";
}

std::vector<int32_t> json_to_ids(const std::string& text) {
  const nlohmann::json ids = parse_json(text, "--decode's input (a JSON list of token ids)");
  RELAY_CHECK(ids.is_array(), "--decode expects a JSON list of token ids, got ", ids.type_name());
  std::vector<int32_t> values;
  for (const auto& id : ids) {
    RELAY_CHECK(id.is_number_integer(), "--decode: ", id.dump(), " is not an integer token id");
    values.push_back(id.get<int32_t>());
  }
  return values;
}

// One JSON value per input line: strings to encode, or id lists to decode (printed as JSON
// strings).
int run_batch(const Tokenizer& tokenizer, const TokenizeOptions& o, double load_ms) {
  std::string line;
  std::string out;
  double encode_ms = 0;
  size_t num_bytes = 0;
  size_t num_tokens = 0;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    if (o.decode) {
      out += nlohmann::json(tokenizer.decode(json_to_ids(line), o.skip_special_tokens)).dump();
    } else {
      const nlohmann::json text = parse_json(line, "--batch's input line (a JSON string)");
      RELAY_CHECK(text.is_string(), "--batch expects one JSON string per line, got ",
                  text.type_name());
      const std::string& input = text.get_ref<const std::string&>();
      const double encode_start_ms = thread_cpu_ms();
      const std::vector<int32_t> ids = tokenizer.encode(input, !o.special_as_text);
      encode_ms += thread_cpu_ms() - encode_start_ms;
      num_bytes += input.size();
      num_tokens += ids.size();
      out += ids_to_json(ids);
    }
    out += "\n";
  }
  std::cout << out << std::flush;
  if (o.stats && !o.decode) print_stats(load_ms, num_bytes, num_tokens, encode_ms);
  return 0;
}

int run_tokenize(const TokenizeOptions& o) {
  const auto load_start = std::chrono::steady_clock::now();
  const Tokenizer tokenizer = Tokenizer::from_model_dir(o.model_dir);
  const double load_ms = ms_since(load_start);
  if (o.batch) return run_batch(tokenizer, o, load_ms);
  const std::string input = read_stdin();
  if (o.decode) {
    std::cout << tokenizer.decode(json_to_ids(input), o.skip_special_tokens) << std::flush;
  } else {
    const double encode_start_ms = thread_cpu_ms();
    const std::vector<int32_t> ids = tokenizer.encode(input, !o.special_as_text);
    const double encode_ms = thread_cpu_ms() - encode_start_ms;
    std::cout << ids_to_json(ids) << "\n" << std::flush;
    if (o.stats) print_stats(load_ms, input.size(), ids.size(), encode_ms);
  }
  return 0;
}

const CommandRegistrar kRegistrar{Command{
    "tokenize",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<TokenizeOptions>();
      sub.add_option("--model", o->model_dir,
                     "model directory holding tokenizer.json (default: the embedded demo model)");
      sub.add_flag("--decode", o->decode,
                   "read a JSON list of token ids on stdin and write their text to stdout");
      sub.add_flag("--skip-special-tokens", o->skip_special_tokens,
                   "with --decode: leave special tokens such as <|im_end|> out of the text");
      sub.add_flag("--special-as-text", o->special_as_text,
                   "encode special-token strings in the input as plain text instead of their ids");
      sub.add_flag("--stats", o->stats,
                   "when encoding: print load time and encode throughput (CPU time) to stderr");
      sub.add_flag(
          "--batch", o->batch,
          "one JSON value per stdin line (a string to encode, or with --decode an id list); "
          "one JSON result per stdout line");
      sub.footer(
          "Without --decode: reads text (raw bytes; invalid UTF-8 becomes U+FFFD) on stdin and "
          "prints "
          "its token ids as one JSON list, exactly as Hugging Face tokenizers' encode(text, "
          "add_special_tokens=False).");
      return [o] { return run_tokenize(*o); };
    },
    "text on stdin -> JSON list of token ids (or back with --decode)"}};

}  // namespace
}  // namespace relay::cli

// `relay tokenize`: the tokenizer on the command line, for scripts and for the end-to-end tests that
// compare Relay with Hugging Face `tokenizers`. Encoding reads raw bytes from stdin (so invalid
// UTF-8 reaches the tokenizer unchanged) and prints a JSON list of ids; --decode does the reverse.
// --batch handles one JSON value per line, so a script pays the tokenizer's load time once.
#include <iostream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace relay::cli {
namespace {

struct TokenizeOptions {
  std::string model_dir = default_model_dir();
  bool decode = false;
  bool skip_special_tokens = false;
  bool special_as_text = false;
  bool batch = false;
};

std::string ids_to_json(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) out += ",";
    out += std::to_string(ids[i]);
  }
  return out + "]";
}

std::vector<int32_t> json_to_ids(const std::string& text) {
  nlohmann::json ids;
  try {
    ids = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(str("--decode expects a JSON list of token ids: ", e.what()));
  }
  RELAY_CHECK(ids.is_array(), "--decode expects a JSON list of token ids, got ", ids.type_name());
  std::vector<int32_t> values;
  for (const auto& id : ids) {
    RELAY_CHECK(id.is_number_integer(), "--decode: ", id.dump(), " is not an integer token id");
    values.push_back(id.get<int32_t>());
  }
  return values;
}

// One JSON value per input line: strings to encode, or id lists to decode (printed as JSON strings).
int run_batch(const Tokenizer& tokenizer, const TokenizeOptions& o) {
  std::string line;
  std::string out;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    if (o.decode) {
      out += nlohmann::json(tokenizer.decode(json_to_ids(line), o.skip_special_tokens)).dump();
    } else {
      nlohmann::json text;
      try {
        text = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        fail(str("--batch expects one JSON string per line: ", e.what()));
      }
      RELAY_CHECK(text.is_string(), "--batch expects one JSON string per line, got ", text.type_name());
      out += ids_to_json(tokenizer.encode(text.get<std::string>(), !o.special_as_text));
    }
    out += "\n";
  }
  std::cout << out << std::flush;
  return 0;
}

int run_tokenize(const TokenizeOptions& o) {
  const Tokenizer tokenizer = Tokenizer::from_model_dir(o.model_dir);
  if (o.batch) return run_batch(tokenizer, o);
  const std::string input{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
  if (o.decode) {
    std::cout << tokenizer.decode(json_to_ids(input), o.skip_special_tokens) << std::flush;
  } else {
    std::cout << ids_to_json(tokenizer.encode(input, !o.special_as_text)) << "\n" << std::flush;
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
      sub.add_flag("--batch", o->batch,
                   "one JSON value per stdin line (a string to encode, or with --decode an id list); "
                   "one JSON result per stdout line");
      sub.footer(
          "Without --decode: reads text (raw bytes; invalid UTF-8 becomes U+FFFD) on stdin and prints "
          "its token ids as one JSON list, exactly as Hugging Face tokenizers' encode(text, "
          "add_special_tokens=False).");
      return [o] { return run_tokenize(*o); };
    },
    "text on stdin -> JSON list of token ids (or back with --decode)"}};

}  // namespace
}  // namespace relay::cli

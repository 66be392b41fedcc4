// Unit tests of the tokenizer's parts: UTF-8 repair (against Python's errors='replace' results),
// the split regex's character classes on every Unicode code point (against the oracle's classes in
// tests/fixtures/tokenizer/hf_codepoint_classes.json), lookups on the real Qwen3 vocabulary, the
// streaming detokenizer on split characters, thread safety, and the load-time errors that name
// the file and field.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/split_regex.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace relay {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

const std::string kModelDir = std::string(RELAY_SOURCE_DIR) + "/models/relay-demo-moe";

const Tokenizer& qwen() {
  static const Tokenizer tokenizer = Tokenizer::from_model_dir(kModelDir);
  return tokenizer;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// ---------------------------------------------------------------------------------------------
// UTF-8 repair: the expected strings are Python's bytes.decode('utf-8', errors='replace').

TEST(Utf8, SanitizeReplacesMaximalSubparts) {
  const std::string r(utf8::kReplacement);
  EXPECT_EQ(utf8::sanitize("plain ascii"), "plain ascii");
  EXPECT_EQ(utf8::sanitize("caf\xC3\xA9"), "caf\xC3\xA9");
  EXPECT_EQ(utf8::sanitize("\xE2\x82"
                           "A"),
            r + "A");                                            // truncated 3-byte sequence: one
  EXPECT_EQ(utf8::sanitize("\xF0\x9F\x98"), r);                  // truncated 4-byte sequence: one
  EXPECT_EQ(utf8::sanitize("\xC0\x80"), r + r);                  // overlong: each byte
  EXPECT_EQ(utf8::sanitize("\xED\xA0\x80"), r + r + r);          // surrogate: each byte
  EXPECT_EQ(utf8::sanitize("\xF4\x90\x80\x80"), r + r + r + r);  // past U+10FFFF
  EXPECT_EQ(utf8::sanitize("\xE0\x80\xAF"), r + r + r);          // overlong 3-byte
  EXPECT_EQ(utf8::sanitize("\xFF\xFE"
                           "a\x80"),
            r + r + "a" + r);
  EXPECT_EQ(utf8::sanitize("\xF0\x9F\x98\x80\xF0\x9F"), "\xF0\x9F\x98\x80" + r);
  EXPECT_FALSE(utf8::is_valid("\xE2\x82"));
  EXPECT_TRUE(utf8::is_valid("\xF0\x9F\x98\x80"));
}

TEST(Utf8, IncompleteTailIsOnlyAValidPrefix) {
  EXPECT_EQ(utf8::incomplete_tail_length("a\xE2\x82"), 2u);
  EXPECT_EQ(utf8::incomplete_tail_length("a\xE2"), 1u);
  EXPECT_EQ(utf8::incomplete_tail_length("\xF0\x9F\x98"), 3u);
  EXPECT_EQ(utf8::incomplete_tail_length("\xF0\x9F\x98\x80"), 0u);
  EXPECT_EQ(utf8::incomplete_tail_length("\xED\xA0"), 0u);  // can never become valid
  EXPECT_EQ(utf8::incomplete_tail_length("\xC0"), 0u);
  EXPECT_EQ(utf8::incomplete_tail_length("\x80"), 0u);
  EXPECT_EQ(utf8::incomplete_tail_length(""), 0u);
}

// ---------------------------------------------------------------------------------------------
// The split regex classifies every code point as the oracle's Oniguruma does.

TEST(SplitRegex, EveryCodePointClassifiedLikeOracle) {
  const json tokenizer = json::parse(read_file(kModelDir + "/tokenizer.json"));
  const std::string pattern = tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"];
  const tokenizer_detail::SplitRegex split(
      pattern, false, tokenizer_detail::SplitBehavior::Isolated, false, "qwen pattern");
  const json classes = json::parse(
      read_file(std::string(RELAY_FIXTURES_DIR) + "/tokenizer/hf_codepoint_classes.json"));
  const auto& runs = classes["runs"];
  std::vector<tokenizer_detail::Span> pieces;
  const auto num_pieces = [&](const std::string& text) {
    pieces.clear();
    split.split(text, pieces);
    return pieces.size();
  };
  size_t mismatches = 0;
  size_t checked = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    const uint32_t first = runs[r][0];
    const uint32_t end = r + 1 < runs.size() ? uint32_t(runs[r + 1][0]) : 0x110000u;
    const std::string expected = runs[r][1];
    if (expected == "x" || expected == "n") continue;  // surrogates; \r \n are fixed by the pattern
    for (uint32_t cp = first; cp < end; ++cp) {
      std::string c;
      append_utf8(c, cp);
      std::string got;
      if (num_pieces("x" + c) == 1) {
        got = "L";
      } else if (num_pieces("!" + c) == 1) {
        got = "o";
      } else if (num_pieces(c + "x") == 1) {
        got = "s";
      } else {
        got = "N";
      }
      ++checked;
      if (got != expected && ++mismatches <= 10) {
        ADD_FAILURE() << "U+" << std::hex << cp << ": relay " << got << ", oracle " << expected;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_GT(checked, 1'000'000u);
}

TEST(SplitRegex, RewriteRefusesWhatItCannotExpress) {
  EXPECT_THROW(tokenizer_detail::rewrite_pattern_for_pcre2("[\\S]", "p"), Error);
  EXPECT_THROW(tokenizer_detail::rewrite_pattern_for_pcre2("[^\\P{L}]", "p"), Error);
  EXPECT_THROW(tokenizer_detail::rewrite_pattern_for_pcre2("[a[b]]", "p"), Error);
  // \p{Lu} and escapes other than \s \S \p{L} \p{N} pass through unchanged.
  EXPECT_EQ(tokenizer_detail::rewrite_pattern_for_pcre2("\\p{Lu}\\d[]a]", "p"), "\\p{Lu}\\d[]a]");
}

TEST(SplitRegex, CaptureGroupsAndEmptyMatches) {
  using tokenizer_detail::SplitBehavior;
  const auto pieces = [](const std::string& pattern, const std::string& text) {
    const tokenizer_detail::SplitRegex split(pattern, false, SplitBehavior::Isolated, false,
                                             "test");
    std::vector<tokenizer_detail::Span> spans;
    split.split(text, spans);
    std::vector<std::string> out;
    for (const auto& p : spans) out.push_back(text.substr(p.begin, p.end - p.begin));
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("('s|'t)|b", "xa'sb"), (V{"xa", "'s", "b"}));
  // Empty matches cut the text between characters, as the oracle's iteration does.
  EXPECT_EQ(pieces("x*", "ab"), (V{"a", "b"}));
  EXPECT_EQ(pieces("x*", "axxb"), (V{"a", "xx", "b"}));
}

TEST(SplitRegex, BehaviorsFoldDelimitersLikeOracle) {
  // "the-final--countdown" split on "-"; expected pieces are the oracle's pre_tokenize_str output.
  using tokenizer_detail::SplitBehavior;
  const std::string text = "the-final--countdown";
  const auto run = [&](SplitBehavior b, bool invert) {
    const tokenizer_detail::SplitRegex split("-", true, b, invert, "test");
    std::vector<tokenizer_detail::Span> pieces;
    split.split(text, pieces);
    std::vector<std::string> out;
    for (const auto& p : pieces) out.push_back(text.substr(p.begin, p.end - p.begin));
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(run(SplitBehavior::Removed, false), (V{"the", "final", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::Isolated, false), (V{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::MergedWithPrevious, false), (V{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::MergedWithNext, false), (V{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(run(SplitBehavior::Contiguous, false), (V{"the", "-", "final", "--", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::Removed, true), (V{"-", "-", "-"}));
  EXPECT_EQ(run(SplitBehavior::MergedWithPrevious, true), (V{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(run(SplitBehavior::MergedWithNext, true), (V{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::Contiguous, true), (V{"the", "-", "final", "--", "countdown"}));
}

// ---------------------------------------------------------------------------------------------
// Lookups on the real vocabulary.

TEST(Tokenizer, LookupsOnQwenVocabulary) {
  const Tokenizer& t = qwen();
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_EQ(t.token_to_id("<|endoftext|>"), 151643);
  EXPECT_EQ(t.token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(t.token_to_id("<think>"), 151667);
  EXPECT_EQ(t.token_to_id("Ġthe"), 279);
  EXPECT_EQ(t.token_to_id("no such token"), std::nullopt);
  EXPECT_EQ(t.id_to_token(151645), "<|im_end|>");
  EXPECT_EQ(t.id_to_token(279), "Ġthe");
  EXPECT_EQ(t.id_to_token(151700), std::nullopt);  // an embedding padding row
  EXPECT_EQ(t.id_to_token(-1), std::nullopt);
  EXPECT_EQ(t.token_bytes(279), " the");
  EXPECT_TRUE(t.is_special(151645));
  EXPECT_FALSE(t.is_special(151667));  // <think> is added but not special
  EXPECT_FALSE(t.is_special(279));
  const std::vector<int32_t> specials = t.special_token_ids();
  EXPECT_EQ(specials.front(), 151643);
  EXPECT_TRUE(std::is_sorted(specials.begin(), specials.end()));
  EXPECT_EQ(t.decode(std::vector<int32_t>{279, 151700, -5, 151645}), " the<|im_end|>");
  EXPECT_EQ(t.decode(std::vector<int32_t>{279, 151645}, /*skip_special_tokens=*/true), " the");
}

TEST(Tokenizer, SpecialTokensAsTextAreStillEncodedExactly) {
  const Tokenizer& t = qwen();
  EXPECT_EQ(t.encode("<|im_start|>"), (std::vector<int32_t>{151644}));
  const std::vector<int32_t> as_text = t.encode("<|im_start|>", /*allow_special=*/false);
  EXPECT_GT(as_text.size(), 1u);
  EXPECT_EQ(t.decode(as_text), "<|im_start|>");
  EXPECT_EQ(t.encode("<think>", false),
            (std::vector<int32_t>{151667}));  // not special: still cut out
}

// ---------------------------------------------------------------------------------------------
// The streaming detokenizer holds back exactly the bytes of an unfinished character.

TEST(IncrementalDetokenizer, HoldsBackSplitCharacters) {
  const Tokenizer& t = qwen();
  std::array<int32_t, 256> byte_token{};
  for (int32_t id = 0; id < 151643; ++id) {
    if (t.token_bytes(id).size() == 1) byte_token[uint8_t(t.token_bytes(id)[0])] = id;
  }
  IncrementalDetokenizer d(t);
  EXPECT_EQ(d.push(byte_token[0xF0]), "");
  EXPECT_EQ(d.push(byte_token[0x9F]), "");
  EXPECT_EQ(d.push(byte_token[0x98]), "");
  EXPECT_EQ(d.num_pending_bytes(), 3u);
  EXPECT_EQ(d.push(byte_token[0x80]), "\xF0\x9F\x98\x80");
  EXPECT_EQ(d.push(byte_token[0xE4]), "");
  // A byte that cannot continue the sequence: the held byte becomes U+FFFD at once.
  EXPECT_EQ(d.push(byte_token['a']), std::string(utf8::kReplacement) + "a");
  EXPECT_EQ(d.push(byte_token[0xE4]), "");
  EXPECT_EQ(d.flush(), utf8::kReplacement);  // the stream ended inside a character
  EXPECT_EQ(d.num_pending_bytes(), 0u);
}

TEST(IncrementalDetokenizer, SkipsSpecialTokensWhenAsked) {
  const Tokenizer& t = qwen();
  IncrementalDetokenizer d(t, /*skip_special_tokens=*/true);
  std::string text;
  for (const int32_t id : t.encode("<|im_start|>assistant\nhi 😀<|im_end|>")) text += d.push(id);
  text += d.flush();
  EXPECT_EQ(text, "assistant\nhi 😀");
}

// ---------------------------------------------------------------------------------------------
// Arbitrary bytes never break the tokenizer: encode succeeds, ASCII round-trips exactly, and the
// streamed text equals decode().

TEST(Tokenizer, RandomBytesAreSafe) {
  const Tokenizer& t = qwen();
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string bytes(rng() % 64, '\0');
    const bool ascii = i % 2 == 0;
    for (char& c : bytes) c = static_cast<char>(ascii ? rng() % 128 : rng() % 256);
    const std::vector<int32_t> ids = t.encode(bytes);
    const std::string text = t.decode(ids);
    ASSERT_TRUE(utf8::is_valid(text));
    if (ascii) {
      ASSERT_EQ(text, bytes);
    }
    IncrementalDetokenizer d(t);
    std::string streamed;
    for (const int32_t id : ids) streamed += d.push(id);
    streamed += d.flush();
    ASSERT_EQ(streamed, text);
  }
}

// ---------------------------------------------------------------------------------------------
// One Tokenizer shared by threads gives every thread the single-threaded result.

TEST(Tokenizer, ConcurrentEncodesAgree) {
  const Tokenizer& t = qwen();
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i) {
    texts.push_back(str("Request ", i, ": résumé 東京 ", i * 7919,
                        " 😀 <think>x</think> the answer's ", i % 13));
  }
  std::vector<std::vector<int32_t>> expected;
  for (const auto& s : texts) expected.push_back(t.encode(s));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      const Tokenizer copy = t;  // copies share the loaded tables and cache
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < texts.size(); ++i) {
          const size_t j = (i * 31 + size_t(k) * 7 + size_t(round)) % texts.size();
          if (copy.encode(texts[j]) != expected[j]) ++mismatches;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// ---------------------------------------------------------------------------------------------
// Load errors name the file and the field.

// A minimal byte-level BPE tokenizer.json: the 256 byte tokens, two merges, one special token.
json tiny_tokenizer() {
  json vocab = json::object();
  const std::string alphabet_printable =
      "!\"#$%&'()*+,-./"
      "0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~";
  int32_t next_extra = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    std::string ch;
    append_utf8(ch, printable ? b : uint32_t(next_extra++));
    vocab[ch] = int32_t(b);
  }
  vocab["ab"] = 256;
  vocab["abab"] = 257;
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", json::array({json{{"id", 258},
                                                 {"content", "<|end|>"},
                                                 {"single_word", false},
                                                 {"lstrip", false},
                                                 {"rstrip", false},
                                                 {"normalized", false},
                                                 {"special", true}}})},
              {"normalizer", json{{"type", "NFC"}}},
              {"pre_tokenizer",
               json{{"type", "Sequence"},
                    {"pretokenizers", json::array({json{{"type", "Split"},
                                                        {"pattern", json{{"Regex", "\\s+|\\S+"}}},
                                                        {"behavior", "Isolated"},
                                                        {"invert", false}},
                                                   json{{"type", "ByteLevel"},
                                                        {"add_prefix_space", false},
                                                        {"trim_offsets", false},
                                                        {"use_regex", false}}})}}},
              {"post_processor", nullptr},
              {"decoder", json{{"type", "ByteLevel"}}},
              {"model", json{{"type", "BPE"},
                             {"dropout", nullptr},
                             {"unk_token", nullptr},
                             {"vocab", vocab},
                             {"merges", json::array({"a b", json::array({"ab", "ab"})})}}}};
}

class LoadErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           str("relay_tokenizer_test_",
               ::testing::UnitTest::GetInstance()->current_test_info()->name(), "_", getpid());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& text) {
    const std::string path = (dir_ / "tokenizer.json").string();
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  // The error message of loading `doc`, or "" when it loads.
  std::string load_error(const json& doc) {
    const std::string path = write(doc.dump());
    try {
      Tokenizer::from_file(path);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos)
          << "message lacks the file: " << e.what();
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

TEST_F(LoadErrors, TinyTokenizerLoadsAndEncodes) {
  const std::string path = write(tiny_tokenizer().dump());
  const Tokenizer t = Tokenizer::from_file(path);
  // In this vocab byte b has id b.
  EXPECT_EQ(t.encode("abab ab<|end|>a"), (std::vector<int32_t>{257, ' ', 256, 258, 'a'}));
  EXPECT_EQ(t.decode(t.encode("abab ab<|end|>a")), "abab ab<|end|>a");
  EXPECT_EQ(t.vocab_size(), 259);
}

TEST_F(LoadErrors, MissingFile) {
  const std::string path = (dir_ / "nope" / "tokenizer.json").string();
  try {
    Tokenizer::from_file(path);
    FAIL() << "loaded a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos);
  }
}

TEST_F(LoadErrors, MalformedJson) {
  const std::string path = write("{\"model\": {\"type\": \"BPE\",");
  try {
    Tokenizer::from_file(path);
    FAIL() << "loaded malformed JSON";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + " is not valid JSON"), std::string::npos) << e.what();
  }
}

TEST_F(LoadErrors, UnsupportedComponentsNameTheirField) {
  const auto expect_error = [&](const std::function<void(json&)>& edit, const std::string& needle) {
    json doc = tiny_tokenizer();
    edit(doc);
    const std::string message = load_error(doc);
    EXPECT_NE(message.find(needle), std::string::npos)
        << "expected '" << needle << "' in: " << message;
  };
  expect_error([](json& d) { d["model"]["type"] = "WordPiece"; },
               "model.type: 'WordPiece' is not supported");
  expect_error([](json& d) { d["model"]["dropout"] = 0.1; }, "model.dropout");
  expect_error([](json& d) { d["model"]["continuing_subword_prefix"] = "##"; },
               "model.continuing_subword_prefix");
  expect_error([](json& d) { d["model"].erase("vocab"); }, "model.vocab: missing");
  expect_error([](json& d) { d["model"]["merges"][0] = "a zz"; },
               "model.merges[0]: token 'zz' is not in model.vocab");
  expect_error([](json& d) { d["model"]["merges"][0] = "a b c"; }, "model.merges[0]");
  expect_error([](json& d) { d["model"]["vocab"].erase("a"); }, "lacks the byte-level token 'a'");
  expect_error(
      [](json& d) {
        d["normalizer"] = json{{"type", "NFKC"}};
      },
      "normalizer.type: 'NFKC' is not supported");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = true; },
               "pre_tokenizer.pretokenizers[1].use_regex");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; },
               "pre_tokenizer.pretokenizers[1].add_prefix_space");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["type"] = "Whitespace"; },
               "pre_tokenizer.pretokenizers[0].type: 'Whitespace' is not supported");
  expect_error(
      [](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; },
      "pre_tokenizer.pretokenizers[0].pattern: PCRE2 rejects the pattern");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; },
               "pre_tokenizer.pretokenizers[0].behavior: unknown split behavior 'Sideways'");
  expect_error([](json& d) { d["pre_tokenizer"]["pretokenizers"].erase(1); },
               "has no ByteLevel step");
  expect_error(
      [](json& d) {
        d["post_processor"] = json{{"type", "TemplateProcessing"}};
      },
      "post_processor.type");
  expect_error(
      [](json& d) {
        d["decoder"] = json{{"type", "WordPiece"}};
      },
      "decoder: must be ByteLevel");
  expect_error([](json& d) { d["added_tokens"][0]["id"] = 300; },
               "added_tokens[0].id: 300 for '<|end|>' differs");
  expect_error(
      [](json& d) {
        d["truncation"] = json{{"max_length", 5}};
      },
      "truncation: must be null");
}

}  // namespace
}  // namespace relay

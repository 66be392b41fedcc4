// Conformance against Hugging Face `tokenizers` on the committed corpus (tests/fixtures/tokenizer/
// corpus.json, made by make_corpus.py with the real Qwen3 tokenizer.json): every string's ids (with
// special tokens recognised and as text), decode and decode without special tokens, and the
// incremental detokenizer, which must reproduce decode() exactly while never emitting half a
// character. Zero mismatches are allowed; a failure prints the first few offending cases.
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace relay {
namespace {

using json = nlohmann::json;

const std::string kTokenizerPath =
    std::string(RELAY_SOURCE_DIR) + "/models/relay-demo-moe/tokenizer.json";

std::string base64_decode(const std::string& in) {
  static const std::string kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t bits = 0;
  int num_bits = 0;
  for (const char c : in) {
    if (c == '=') break;
    const size_t v = kAlphabet.find(c);
    if (v == std::string::npos) continue;
    bits = (bits << 6) | uint32_t(v);
    num_bits += 6;
    if (num_bits >= 8) {
      num_bits -= 8;
      out.push_back(static_cast<char>((bits >> num_bits) & 0xFF));
    }
  }
  return out;
}

std::string describe(const std::string& text) {
  std::string shown = json(utf8::sanitize(text.substr(0, 120))).dump();
  return shown + (text.size() > 120 ? str("... (", text.size(), " bytes)") : "");
}

std::string ids_string(const std::vector<int32_t>& ids) {
  return json(std::vector<int32_t>(ids.begin(), ids.begin() + std::min<size_t>(ids.size(), 40)))
      .dump();
}

class CorpusTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tokenizer_ = new Tokenizer(Tokenizer::from_file(kTokenizerPath));
    std::ifstream in(std::string(RELAY_FIXTURES_DIR) + "/tokenizer/corpus.json");
    ASSERT_TRUE(in.good()) << "missing tests/fixtures/tokenizer/corpus.json (scripts/unpack-models.sh "
                              "unpacks it from corpus.json.xz)";
    std::stringstream buffer;
    buffer << in.rdbuf();
    corpus_ = new json(json::parse(buffer.str()));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete corpus_;
  }

  // The raw input of a case: its text, or its invalid bytes.
  static std::string input_of(const json& c) {
    return c.contains("t") ? c["t"].get<std::string>() : base64_decode(c["b"].get<std::string>());
  }

  // Streams `ids` through the detokenizer; checks every chunk is valid UTF-8 and returns the text.
  static std::string stream(const std::vector<int32_t>& ids, bool skip_special,
                            std::string& problem) {
    IncrementalDetokenizer detok(*tokenizer_, skip_special);
    std::string text;
    for (const int32_t id : ids) {
      const std::string chunk = detok.push(id);
      if (!utf8::is_valid(chunk)) problem = "a chunk is not valid UTF-8";
      if (detok.num_pending_bytes() > 3) problem = "more than 3 bytes held back";
      text += chunk;
    }
    text += detok.flush();
    return text;
  }

  static Tokenizer* tokenizer_;
  static json* corpus_;
};

Tokenizer* CorpusTest::tokenizer_ = nullptr;
json* CorpusTest::corpus_ = nullptr;

TEST_F(CorpusTest, IsLargeAndMatchesThisTokenizer) {
  EXPECT_GE((*corpus_)["cases"].size(), 2000u);
  EXPECT_EQ((*corpus_)["vocab_size"].get<int32_t>(), tokenizer_->vocab_size());
}

TEST_F(CorpusTest, EncodeMatchesOracle) {
  size_t mismatches = 0;
  for (size_t i = 0; i < (*corpus_)["cases"].size(); ++i) {
    const json& c = (*corpus_)["cases"][i];
    const std::string input = input_of(c);
    const auto expected = c["ids"].get<std::vector<int32_t>>();
    const auto expected_text = c.value("ids_text", expected);
    const std::vector<int32_t> got = tokenizer_->encode(input);
    const std::vector<int32_t> got_text = tokenizer_->encode(input, /*allow_special=*/false);
    if (got != expected && ++mismatches <= 5) {
      ADD_FAILURE() << "case " << i << " " << describe(input) << "\n  relay: " << ids_string(got)
                    << "\n  hf:    " << ids_string(expected);
    }
    if (got_text != expected_text && ++mismatches <= 5) {
      ADD_FAILURE() << "case " << i << " (special tokens as text) " << describe(input)
                    << "\n  relay: " << ids_string(got_text)
                    << "\n  hf:    " << ids_string(expected_text);
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST_F(CorpusTest, DecodeMatchesOracleAndRoundTrips) {
  size_t mismatches = 0;
  for (size_t i = 0; i < (*corpus_)["cases"].size(); ++i) {
    const json& c = (*corpus_)["cases"][i];
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    // Without "d" the oracle's decode gave back the input itself: a round trip.
    const std::string expected =
        c.contains("d") ? c["d"].get<std::string>() : c["t"].get<std::string>();
    const std::string expected_skip = c.value("ds", expected);
    if (tokenizer_->decode(ids) != expected && ++mismatches <= 5) {
      ADD_FAILURE() << "case " << i << " decode: " << describe(tokenizer_->decode(ids)) << " vs "
                    << describe(expected);
    }
    if (tokenizer_->decode(ids, true) != expected_skip && ++mismatches <= 5) {
      ADD_FAILURE() << "case " << i
                    << " decode(skip special): " << describe(tokenizer_->decode(ids, true))
                    << " vs " << describe(expected_skip);
    }
  }
  for (size_t i = 0; i < (*corpus_)["decode_cases"].size(); ++i) {
    const json& c = (*corpus_)["decode_cases"][i];
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    if (tokenizer_->decode(ids) != c["d"].get<std::string>() && ++mismatches <= 5) {
      ADD_FAILURE() << "random ids " << i << ": " << describe(tokenizer_->decode(ids));
    }
    if (tokenizer_->decode(ids, true) != c["ds"].get<std::string>() && ++mismatches <= 5) {
      ADD_FAILURE() << "random ids " << i
                    << " (skip special): " << describe(tokenizer_->decode(ids, true));
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST_F(CorpusTest, IncrementalDetokenizerEqualsDecode) {
  size_t mismatches = 0;
  size_t num_streams = 0;
  const auto check = [&](const std::vector<int32_t>& ids, const std::string& where) {
    for (const bool skip : {false, true}) {
      std::string problem;
      const std::string streamed = stream(ids, skip, problem);
      ++num_streams;
      if ((streamed != tokenizer_->decode(ids, skip) || !problem.empty()) && ++mismatches <= 5) {
        ADD_FAILURE() << where << (skip ? " (skip special)" : "") << ": " << problem << " streamed "
                      << describe(streamed) << " vs decode "
                      << describe(tokenizer_->decode(ids, skip));
      }
    }
  };
  for (size_t i = 0; i < (*corpus_)["cases"].size(); ++i) {
    check((*corpus_)["cases"][i]["ids"].get<std::vector<int32_t>>(), str("case ", i));
  }
  for (size_t i = 0; i < (*corpus_)["decode_cases"].size(); ++i) {
    check((*corpus_)["decode_cases"][i]["ids"].get<std::vector<int32_t>>(), str("random ids ", i));
  }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_GT(num_streams, 4000u);
}

}  // namespace
}  // namespace relay

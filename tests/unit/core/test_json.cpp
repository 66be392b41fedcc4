// core/json.h: the depth limit is found by a scan that ignores brackets in strings, names the
// top-level key, and stops deep inputs before nlohmann builds them.
#include <gtest/gtest.h>

#include <string>

#include "core/json.h"

namespace relay {
namespace {

std::string nested(int depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

TEST(JsonDepth, AtTheLimitIsAcceptedOneMoreIsNot) {
  EXPECT_FALSE(find_json_depth_excess(nested(kMaxJsonDepth), kMaxJsonDepth));
  const auto excess = find_json_depth_excess(nested(kMaxJsonDepth + 1), kMaxJsonDepth);
  ASSERT_TRUE(excess);
  EXPECT_EQ(excess->offset, static_cast<size_t>(kMaxJsonDepth));
  EXPECT_EQ(excess->top_level_key, "");
  EXPECT_EQ(parse_json(nested(kMaxJsonDepth), "test").size(), 1u);
}

TEST(JsonDepth, BracketsInStringsAndEscapesDoNotCount) {
  const std::string deep_text = "\"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"";
  EXPECT_FALSE(find_json_depth_excess("{\"a\": " + deep_text + "}", 4));
  EXPECT_EQ(parse_json("{\"a\": " + deep_text + "}", "test", 4).size(), 1u);
}

TEST(JsonDepth, NamesTheTopLevelKeyTheNestingIsUnder) {
  const std::string body = "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"x\": " +
                           nested(200) + "}], \"max_tokens\": 3}";
  const auto excess = find_json_depth_excess(body, kMaxJsonDepth);
  ASSERT_TRUE(excess);
  EXPECT_EQ(excess->top_level_key, "messages");
  try {
    parse_json(body, "the request body");
    FAIL() << "a 203-level body was parsed";
  } catch (const JsonError& e) {
    EXPECT_EQ(e.param(), "messages");
    EXPECT_NE(std::string(e.what()).find("the request body nests JSON deeper than 128 levels"),
              std::string::npos)
        << e.what();
  }
  // A key followed by a deep value after a shallow member: the later key is named.
  const auto later = find_json_depth_excess("{\"a\": [[1]], \"b\": " + nested(10) + "}", 5);
  ASSERT_TRUE(later);
  EXPECT_EQ(later->top_level_key, "b");
}

TEST(JsonDepth, HugeDepthIsRefusedWithoutRecursion) {
  // 1,000,000 levels: the scan is a loop, and nlohmann never sees it.
  const std::string body = "{\"tools\": " + nested(1000000) + "}";
  try {
    parse_json<nlohmann::ordered_json>(body, "the request body");
    FAIL();
  } catch (const JsonError& e) {
    EXPECT_EQ(e.param(), "tools");
  }
}

TEST(JsonDepth, SyntaxErrorsNameTheInput) {
  try {
    parse_json("{\"a\": ", "config.json");
    FAIL();
  } catch (const JsonError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("config.json is not valid JSON: ", 0), 0u) << e.what();
    EXPECT_EQ(e.param(), "");
  }
  // Unbalanced closers and a trailing open string do not confuse the scan.
  EXPECT_FALSE(find_json_depth_excess("]]]}}}[\"", 2));
}

TEST(JsonFile, MissingFileIsNamed) {
  try {
    parse_json_file("/nonexistent/relay/config.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "/nonexistent/relay/config.json: cannot open");
  }
}

}  // namespace
}  // namespace relay

// The Jinja language itself: snippets covering whitespace control, loops, scoping, macros, filters,
// tests, operators, literals and Python's printing of values, each rendered by Python jinja2 with
// transformers' settings (tests/fixtures/chat/jinja_snippets.json), plus the error contract:
// every failure is a TemplateError with a message that says where and why.
#include <gtest/gtest.h>

#include "chat/chat_template.h"
#include "fixture_util.h"

namespace relay::chat {
namespace {

using testing::first_difference;
using testing::read_fixture;

std::string render(std::string_view source, const nlohmann::ordered_json& context = nlohmann::ordered_json::object()) {
  return Template(source).render(context);
}

std::string error_of(std::string_view source, const nlohmann::ordered_json& context = nlohmann::ordered_json::object()) {
  try {
    render(source, context);
  } catch (const TemplateError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(JinjaLanguage, SnippetsMatchPythonJinja) {
  const nlohmann::ordered_json snippets = read_fixture("jinja_snippets.json");
  ASSERT_GE(snippets.size(), 50u);
  for (const auto& s : snippets) {
    const std::string name = s["name"].get<std::string>();
    SCOPED_TRACE("snippet " + name + ": " + s["source"].get<std::string>());
    if (s.contains("output")) {
      try {
        const std::string got = render(s["source"].get<std::string>(), s["context"]);
        const std::string want = s["output"].get<std::string>();
        EXPECT_TRUE(got == want) << first_difference(want, got);
      } catch (const TemplateError& e) {
        ADD_FAILURE() << "unexpected error: " << e.what();
      }
    } else {
      EXPECT_THROW(render(s["source"].get<std::string>(), s["context"]), TemplateError)
          << "Python raised " << s["error"].get<std::string>();
    }
  }
}

TEST(JinjaLanguage, SyntaxErrorsNameTheLine) {
  EXPECT_EQ(error_of("line one\n{% if x %}\nbody"),
            "chat template syntax error at line 3: unexpected end of template: expected 'elif' or 'else' or "
            "'endif' to close the 'if' block opened at line 2");
  EXPECT_EQ(error_of("a\n\n{{ x|nope }}"), "chat template syntax error at line 3: no filter named 'nope'");
  EXPECT_EQ(error_of("{{ x|indent }}"),
            "chat template syntax error at line 1: the 'indent' filter is not supported by Relay's chat template "
            "interpreter");
  EXPECT_EQ(error_of("{% include 'x' %}"),
            "chat template syntax error at line 1: the 'include' tag is not supported by Relay's chat template "
            "interpreter");
  EXPECT_EQ(error_of("{% break %}"), "chat template syntax error at line 1: 'break' outside of a for loop");
  EXPECT_EQ(error_of("{{ (1 }}"), "chat template syntax error at line 1: unexpected '}', expected ')'");
}

TEST(JinjaLanguage, RuntimeErrorsNameTheLineAndCause) {
  EXPECT_EQ(error_of("\n\n{{- raise_exception('No messages provided.') }}"),
            "chat template raised an exception at line 3: No messages provided.");
  EXPECT_EQ(error_of("{% for m in ms %}\n{{ m.content.strip() }}\n{% endfor %}",
                     nlohmann::ordered_json{{"ms", {{{"role", "user"}}}}}),
            "chat template error at line 2: 'dict object' has no attribute 'content'");
  EXPECT_EQ(error_of("{{ 'a' + 1 }}"), "chat template error at line 1: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(error_of("{{ missing.x }}"), "chat template error at line 1: 'missing' is undefined");
}

TEST(JinjaLanguage, GuardsStopRunawayTemplates) {
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").find("nested deeper than"),
            std::string::npos);
  EXPECT_NE(error_of("{{ range(100001)|list }}").find("Range too big"), std::string::npos);
  EXPECT_NE(error_of("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")
                .find("loop iterations"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 'x' * 1000000000000 }}").find("would build more than"), std::string::npos);
  EXPECT_NE(error_of("{{ " + std::string(1000, '(') + "1" + std::string(1000, ')') + " }}").find("nested deeper than"),
            std::string::npos);
  EXPECT_EQ(render("{{ " + std::string(100, '(') + "1" + std::string(100, ')') + " }}"), "1");
  EXPECT_NE(error_of("{{ 9223372036854775807 + 1 }}").find("integer overflow"), std::string::npos);
}

TEST(JinjaLanguage, TemplateIsReusableAndRendersAreIndependent) {
  const Template t("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}");
  EXPECT_EQ(t.render(nlohmann::ordered_json{{"xs", {1, 2, 3}}}), "6");
  EXPECT_EQ(t.render(nlohmann::ordered_json{{"xs", {10}}}), "10");
  EXPECT_EQ(t.render(nlohmann::ordered_json::object()), "0");
}

}  // namespace
}  // namespace relay::chat

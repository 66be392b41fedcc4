// The real Qwen3, Qwen3-Coder and Qwen3.5 chat templates on committed message lists must render
// byte for byte as Python jinja2 with transformers' settings rendered them
// (tests/fixtures/chat/make_chat_fixtures.py, cross-checked against transformers itself).
#include <gtest/gtest.h>

#include <map>

#include "chat/chat_template.h"
#include "fixture_util.h"

namespace relay::chat {
namespace {

using testing::first_difference;
using testing::read_fixture;
using testing::read_text;

std::map<std::string, ChatTemplate> load_templates(const nlohmann::ordered_json& fixtures) {
  SpecialTokens tokens;
  for (const auto& [name, value] : fixtures["special_tokens"].items()) tokens.emplace_back(name, value.get<std::string>());
  std::map<std::string, ChatTemplate> templates;
  for (const auto& [name, spec] : fixtures["templates"].items()) {
    const std::string path = std::string(RELAY_SOURCE_DIR) + "/" + spec["path"].get<std::string>();
    if (spec["kind"] == "tokenizer_config") {
      ChatTemplate t = ChatTemplate::from_tokenizer_config(path);
      EXPECT_EQ(t.special_tokens(), tokens) << "special tokens read from " << path;
      templates.emplace(name, std::move(t));
    } else {
      templates.emplace(name, ChatTemplate::from_string(read_text(path), tokens));
    }
  }
  return templates;
}

TEST(ChatTemplateFixtures, QwenTemplatesMatchPythonJinja) {
  const nlohmann::ordered_json fixtures = read_fixture("chat_fixtures.json");
  const auto templates = load_templates(fixtures);
  ASSERT_EQ(templates.size(), 3u);
  std::map<std::string, const nlohmann::ordered_json*> cases;
  for (const auto& c : fixtures["cases"]) cases[c["name"].get<std::string>()] = &c;
  ASSERT_GE(cases.size(), 30u);

  size_t num_outputs = 0, num_errors = 0;
  for (const auto& expected : fixtures["expected"]) {
    const std::string case_name = expected["case"].get<std::string>();
    const std::string template_name = expected["template"].get<std::string>();
    SCOPED_TRACE("case " + case_name + " with template " + template_name);
    const nlohmann::ordered_json& c = *cases.at(case_name);
    const ChatTemplate& t = templates.at(template_name);
    const nlohmann::ordered_json tools = c.value("tools", nlohmann::ordered_json());
    const nlohmann::ordered_json kwargs = c.value("kwargs", nlohmann::ordered_json::object());
    const bool add_generation_prompt = c.value("add_generation_prompt", true);
    if (expected.contains("output")) {
      ++num_outputs;
      try {
        const std::string got = t.render(c["messages"], tools, add_generation_prompt, kwargs);
        const std::string want = expected["output"].get<std::string>();
        EXPECT_TRUE(got == want) << first_difference(want, got);
      } catch (const TemplateError& e) {
        ADD_FAILURE() << "unexpected error: " << e.what();
      }
    } else {
      ++num_errors;
      EXPECT_THROW(t.render(c["messages"], tools, add_generation_prompt, kwargs), TemplateError)
          << "Python raised " << expected["error"].get<std::string>();
    }
  }
  EXPECT_GE(num_outputs, 90u);
  EXPECT_GT(num_errors, 0u);
}

TEST(ChatTemplateFixtures, ModelDirectoryLoadsTheTokenizerConfigTemplate) {
  const ChatTemplate from_dir = ChatTemplate::from_model_dir(std::string(RELAY_SOURCE_DIR) + "/models/relay-demo-moe");
  const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(R"([{"role":"user","content":"Hi"}])");
  EXPECT_EQ(from_dir.render(messages, nullptr, true, nullptr), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(from_dir.render(messages, nullptr, true, nlohmann::ordered_json{{"enable_thinking", false}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(ChatTemplateFixtures, BadInputsAreTemplateErrors) {
  const ChatTemplate t = ChatTemplate::from_string("{{ messages[0].content }}");
  EXPECT_THROW(t.render(nlohmann::ordered_json::object(), nullptr, true, nullptr), TemplateError);
  EXPECT_THROW(t.render(nlohmann::ordered_json::array({1}), nullptr, true, nullptr), TemplateError);
  EXPECT_THROW(t.render(nlohmann::ordered_json::array(), "tools", true, nullptr), TemplateError);
  EXPECT_THROW(t.render(nlohmann::ordered_json::array(), nullptr, true, nlohmann::ordered_json{{"messages", 1}}),
               TemplateError);
  EXPECT_THROW(ChatTemplate::from_model_dir("/nonexistent/model"), TemplateError);
}

// The format each real template renders tool calls in, which the server reads and forces them in.
TEST(ChatTemplateFixtures, ToolCallFormatOfTheRealTemplates) {
  const nlohmann::ordered_json fixtures = read_fixture("chat_fixtures.json");
  const auto templates = load_templates(fixtures);
  EXPECT_EQ(templates.at("qwen3").tool_call_format(), ToolCallFormat::kHermes);
  EXPECT_EQ(templates.at("qwen3-coder").tool_call_format(), ToolCallFormat::kQwen3Coder);
  EXPECT_EQ(templates.at("qwen3.5").tool_call_format(), ToolCallFormat::kQwen3Coder);
  const std::string qwen3_jinja =
      read_text(std::string(RELAY_SOURCE_DIR) + "/models/templates/Qwen-Qwen3-0.6B.jinja");
  EXPECT_EQ(ChatTemplate::from_string(qwen3_jinja).tool_call_format(), ToolCallFormat::kHermes);
  EXPECT_EQ(ChatTemplate::from_model_dir(std::string(RELAY_SOURCE_DIR) + "/models/relay-demo-moe")
                .tool_call_format(),
            ToolCallFormat::kHermes);
  // A template that ignores tools, or fails on them, gets the default.
  EXPECT_EQ(ChatTemplate::from_string("{{ messages[0].content }}").tool_call_format(),
            ToolCallFormat::kHermes);
  EXPECT_EQ(ChatTemplate::from_string("{{ raise_exception('no tools here') }}").tool_call_format(),
            ToolCallFormat::kHermes);
}

TEST(ChatTemplateFixtures, ToolCallFormatNamesAreVllms) {
  for (const ToolCallFormat format : {ToolCallFormat::kHermes, ToolCallFormat::kQwen3Coder}) {
    EXPECT_EQ(tool_call_format_from_name(tool_call_format_name(format)), format);
  }
  EXPECT_EQ(tool_call_format_name(ToolCallFormat::kQwen3Coder), "qwen3_coder");
  EXPECT_EQ(tool_call_format_from_name("hermes"), ToolCallFormat::kHermes);
  EXPECT_EQ(tool_call_format_from_name("qwen3_xml"), std::nullopt);
  EXPECT_EQ(tool_call_format_from_name(""), std::nullopt);
}

}  // namespace
}  // namespace relay::chat

// Unit tests of the grammar module (src/grammar) on the real Qwen3 tokenizer (the demo model's) and
// its real vocabulary shape: 151,669 tokens padded to the model's vocab_size of 151,936, stop ids
// <|im_end|> and <|endoftext|>.
//
// Most tests drive a matcher through the tokenizer's encoding of a text, checking at every step
// that the bitmask allows the token the matcher then accepts (the mask and the matcher must agree,
// or the sampler could pick a token the grammar rejects), and what the mask forbids at the points
// that matter: a misspelt key, a value of the wrong type, text after a complete output.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "core/error.h"
#include "grammar/grammar.h"
#include "tokenizer/tokenizer.h"

namespace relay {
namespace {

const std::string kModelDir = std::string(RELAY_SOURCE_DIR) + "/models/relay-demo-moe";
constexpr int32_t kModelVocabSize = 151936;  // the demo model's config.json vocab_size
constexpr int32_t kImEnd = 151645;           // eos_token_id (config.json, generation_config.json)
constexpr int32_t kEndOfText = 151643;       // eos_token_id (generation_config.json)
constexpr int32_t kImStart = 151644;         // special, never text

const Tokenizer& qwen() {
  static const Tokenizer tokenizer = Tokenizer::from_model_dir(kModelDir);
  return tokenizer;
}

GrammarCompilerOptions qwen_options(size_t cache_capacity = 64) {
  GrammarCompilerOptions options;
  options.vocab_size = kModelVocabSize;
  options.stop_token_ids = {kImEnd, kEndOfText};
  options.cache_capacity = cache_capacity;
  return options;
}

GrammarCompiler& compiler() {
  static GrammarCompiler compiler(qwen(), qwen_options());
  return compiler;
}

GrammarMatcher matcher_for(const GrammarSpec& spec) {
  return GrammarMatcher(*compiler().compile(spec));
}

std::vector<uint32_t> next_mask(GrammarMatcher& matcher) {
  std::vector<uint32_t> mask(token_bitmask_words(matcher.vocab_size()));
  matcher.fill_next_token_bitmask(mask);
  return mask;
}

bool allowed(const std::vector<uint32_t>& mask, int32_t id) {
  return (mask[id / 32] >> (id % 32)) & 1u;
}

std::vector<int32_t> allowed_ids(const std::vector<uint32_t>& mask) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < static_cast<int32_t>(mask.size()) * 32; ++id) {
    if (allowed(mask, id)) ids.push_back(id);
  }
  return ids;
}

int32_t token(std::string_view text) {
  const std::vector<int32_t> ids = qwen().encode(text);
  EXPECT_EQ(ids.size(), 1u) << "'" << text << "' is not one token";
  return ids.front();
}

// Feeds `text`'s tokens one by one, each checked against the mask first. Returns how many were
// accepted before the first the grammar rejects (all of them when it accepts the whole text).
size_t feed(GrammarMatcher& matcher, std::string_view text) {
  const std::vector<int32_t> ids = qwen().encode(text);
  for (size_t i = 0; i < ids.size(); ++i) {
    const bool in_mask = allowed(next_mask(matcher), ids[i]);
    const bool accepted = matcher.accept_token(ids[i]);
    EXPECT_EQ(in_mask, accepted) << "mask and matcher disagree on token " << i << " of " << text;
    if (!accepted) return i;
  }
  return ids.size();
}

bool accepts(GrammarMatcher& matcher, std::string_view text) {
  return feed(matcher, text) == qwen().encode(text).size();
}

// After a complete output: only the stop tokens may follow, and one terminates the matcher.
void expect_only_stop_then_terminate(GrammarMatcher& matcher) {
  EXPECT_TRUE(matcher.is_completed());
  EXPECT_FALSE(matcher.is_terminated());
  EXPECT_EQ(allowed_ids(next_mask(matcher)), (std::vector<int32_t>{kEndOfText, kImEnd}));
  EXPECT_TRUE(matcher.accept_token(kImEnd));
  EXPECT_TRUE(matcher.is_terminated());
  EXPECT_FALSE(matcher.accept_token(kImEnd));
  std::vector<uint32_t> mask(token_bitmask_words(matcher.vocab_size()));
  EXPECT_THROW(matcher.fill_next_token_bitmask(mask), Error);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// ---- The vocabulary -----------------------------------------------------------------------------

TEST(GrammarVocabulary, DecodesByteLevelTokens) {
  // "hello world" is two tokens, the second with GPT-2's space marker: "hello" "Ġworld".
  const std::vector<int32_t> ids = qwen().encode("hello world");
  ASSERT_EQ(ids.size(), 2u);
  ASSERT_EQ(qwen().id_to_token(ids[1]), "Ġworld");

  GrammarMatcher matcher = matcher_for(GrammarSpec::ebnf(R"(root ::= "hello world")"));
  std::vector<uint32_t> mask = next_mask(matcher);
  EXPECT_TRUE(allowed(mask, ids[0]));
  EXPECT_TRUE(allowed(mask, token("h")));  // any prefix may start it
  EXPECT_FALSE(allowed(mask, token("world")));
  ASSERT_TRUE(matcher.accept_token(ids[0]));
  mask = next_mask(matcher);
  EXPECT_TRUE(allowed(mask, ids[1]));
  EXPECT_FALSE(allowed(mask, token("world")));  // no space: "helloworld"
  ASSERT_TRUE(matcher.accept_token(ids[1]));
  expect_only_stop_then_terminate(matcher);
}

TEST(GrammarVocabulary, MultiByteCharactersSplitAcrossTokens) {
  // An emoji is several byte-level tokens, none of them valid UTF-8 alone.
  const std::string text = "🦙 ok";
  GrammarMatcher matcher = matcher_for(GrammarSpec::regex("🦙 [a-z]+"));
  EXPECT_TRUE(accepts(matcher, text));
  EXPECT_TRUE(matcher.is_completed());
}

TEST(GrammarVocabulary, PaddingAndSpecialTokensAreNeverAllowed) {
  GrammarMatcher matcher = matcher_for(GrammarSpec::json());
  const std::vector<uint32_t> mask = next_mask(matcher);
  ASSERT_EQ(mask.size(), token_bitmask_words(kModelVocabSize));
  for (int32_t id = qwen().vocab_size(); id < kModelVocabSize; ++id) {
    ASSERT_FALSE(allowed(mask, id)) << "padded id " << id;
  }
  for (int32_t id : qwen().special_token_ids()) EXPECT_FALSE(allowed(mask, id)) << id;
  EXPECT_FALSE(matcher.accept_token(kImStart));
  EXPECT_FALSE(matcher.accept_token(kModelVocabSize - 1));
  EXPECT_THROW(matcher.accept_token(kModelVocabSize), Error);
  EXPECT_THROW(matcher.accept_token(-1), Error);
}

TEST(GrammarVocabulary, TokenizerSizedVocabularyClearsTheLastWordsTail) {
  // 151,669 tokens end mid-word: the bits past the vocabulary must be clear too.
  GrammarCompilerOptions options = qwen_options();
  options.vocab_size = 0;
  GrammarCompiler small(qwen(), options);
  ASSERT_EQ(small.vocab_size(), qwen().vocab_size());
  ASSERT_NE(small.vocab_size() % 32, 0);
  GrammarMatcher matcher(*small.compile(GrammarSpec::regex("[^x]*")));
  const std::vector<uint32_t> mask = next_mask(matcher);
  ASSERT_EQ(mask.size(), token_bitmask_words(qwen().vocab_size()));
  for (int32_t id = small.vocab_size(); id < static_cast<int32_t>(mask.size()) * 32; ++id) {
    EXPECT_FALSE(allowed(mask, id)) << id;
  }
  EXPECT_TRUE(allowed(mask, kImEnd));  // the empty string is complete
}

TEST(GrammarVocabulary, RejectsInconsistentOptions) {
  GrammarCompilerOptions options = qwen_options();
  options.vocab_size = 1000;
  EXPECT_NE(error_of([&] { GrammarCompiler c(qwen(), options); }).find("smaller than"),
            std::string::npos);
  options = qwen_options();
  options.stop_token_ids = {};
  EXPECT_NE(error_of([&] { GrammarCompiler c(qwen(), options); }).find("no stop token"),
            std::string::npos);
  options = qwen_options();
  options.stop_token_ids = {kModelVocabSize};
  EXPECT_NE(error_of([&] { GrammarCompiler c(qwen(), options); }).find("outside the vocabulary"),
            std::string::npos);
}

// ---- JSON ---------------------------------------------------------------------------------------

TEST(GrammarJson, RejectsNonJson) {
  GrammarMatcher matcher = matcher_for(GrammarSpec::json());
  const std::vector<uint32_t> mask = next_mask(matcher);
  EXPECT_FALSE(allowed(mask, token("hello")));
  EXPECT_FALSE(allowed(mask, token("Sure")));
  EXPECT_FALSE(allowed(mask, kImEnd));  // nothing is not JSON
  EXPECT_TRUE(allowed(mask, token("{")));
  EXPECT_FALSE(matcher.accept_token(token("hello")));
  EXPECT_EQ(matcher.num_accepted_tokens(), 0);

  GrammarMatcher closed = matcher_for(GrammarSpec::json());
  ASSERT_TRUE(accepts(closed, R"({"a": 1})"));
  EXPECT_FALSE(closed.accept_token(token("}")));
  EXPECT_FALSE(closed.accept_token(token(",")));
}

TEST(GrammarJson, AcceptsAJsonTokenStreamToTermination) {
  GrammarMatcher matcher = matcher_for(GrammarSpec::json());
  const std::string text = R"({"items": [1, -2.5e3, true, null], "nested": {"s": "a\"b ü"}})";
  ASSERT_TRUE(accepts(matcher, text));
  expect_only_stop_then_terminate(matcher);
}

// ---- JSON schema --------------------------------------------------------------------------------

const std::string kPersonSchema = R"({
  "type": "object",
  "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
  "required": ["name", "age"]
})";

TEST(GrammarJsonSchema, ForcesTheRequiredKeysAndTypes) {
  GrammarMatcher matcher = matcher_for(GrammarSpec::json_schema(kPersonSchema, true));
  ASSERT_TRUE(accepts(matcher, "{\""));
  // A key the schema does not name is masked out, even when a sampler prefers it.
  std::vector<uint32_t> mask = next_mask(matcher);
  const int32_t bad_key = token("nom");
  const int32_t good_key = token("name");
  EXPECT_FALSE(allowed(mask, bad_key));
  EXPECT_TRUE(allowed(mask, good_key));
  EXPECT_FALSE(allowed(mask, token("age")));  // the schema's order: name first
  std::vector<float> logits(kModelVocabSize, 0.0f);
  logits[bad_key] = 10.0f;
  logits[good_key] = 5.0f;
  apply_token_bitmask(logits, mask);
  EXPECT_EQ(std::max_element(logits.begin(), logits.end()) - logits.begin(), good_key);

  ASSERT_TRUE(accepts(matcher, "name\": "));
  mask = next_mask(matcher);
  EXPECT_FALSE(allowed(mask, token("4")));  // name is a string
  EXPECT_TRUE(allowed(mask, token("\"")));
  ASSERT_TRUE(accepts(matcher, "\"Ada\", \"age\": "));
  mask = next_mask(matcher);
  EXPECT_TRUE(allowed(mask, token("4")));  // age is an integer
  EXPECT_FALSE(allowed(mask, token("\"")));
  EXPECT_FALSE(allowed(mask, token("true")));
  ASSERT_TRUE(accepts(matcher, "36"));
  EXPECT_FALSE(allowed(next_mask(matcher), token(".")));
  ASSERT_TRUE(accepts(matcher, "}"));
  expect_only_stop_then_terminate(matcher);
}

TEST(GrammarJsonSchema, AValidInstanceIsAcceptedAndAnIncompleteOneIsNot) {
  GrammarMatcher matcher = matcher_for(GrammarSpec::json_schema(kPersonSchema, true));
  EXPECT_TRUE(accepts(matcher, R"({"name": "Grace Hopper", "age": 85})"));
  EXPECT_TRUE(matcher.is_completed());

  GrammarMatcher missing_age = matcher_for(GrammarSpec::json_schema(kPersonSchema, true));
  ASSERT_TRUE(accepts(missing_age, R"({"name": "Ada")"));
  EXPECT_FALSE(allowed(next_mask(missing_age), token("}")));
}

TEST(GrammarJsonSchema, StrictForbidsPropertiesTheSchemaDoesNotName) {
  const std::string text = R"({"name": "Ada", "age": 36, "city": "London"})";
  GrammarMatcher strict = matcher_for(GrammarSpec::json_schema(kPersonSchema, true));
  EXPECT_FALSE(accepts(strict, text));
  GrammarMatcher lax = matcher_for(GrammarSpec::json_schema(kPersonSchema, false));
  EXPECT_TRUE(accepts(lax, text));
  EXPECT_TRUE(lax.is_completed());
}

TEST(GrammarJsonSchema, AnInvalidSchemaIsAClearError) {
  const size_t cached = compiler().cache_size();
  const std::string not_json =
      error_of([] { compiler().compile(GrammarSpec::json_schema(R"({"type": "object",)", true)); });
  EXPECT_TRUE(not_json.starts_with("invalid JSON schema: Failed to parse JSON")) << not_json;
  const std::string bad_type =
      error_of([] { compiler().compile(GrammarSpec::json_schema(R"({"type": "objekt"})", true)); });
  EXPECT_TRUE(bad_type.starts_with("invalid JSON schema: ")) << bad_type;
  EXPECT_NE(bad_type.find("objekt"), std::string::npos) << bad_type;
  // xgrammar's source location and time stamp are not for the client.
  for (const std::string& message : {not_json, bad_type}) {
    EXPECT_EQ(message.find(".cc:"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  EXPECT_TRUE(error_of([] {
                compiler().compile(GrammarSpec::regex("([a-z]"));
              }).starts_with("invalid regex: "));
  EXPECT_TRUE(error_of([] {
                compiler().compile(GrammarSpec::ebnf("start ::= \"a\""));
              }).starts_with("invalid EBNF grammar: "));
  EXPECT_EQ(compiler().cache_size(), cached);  // failures are not cached
}

// ---- Regex, choice, EBNF ------------------------------------------------------------------------

TEST(GrammarRegex, MatchesThePattern) {
  const GrammarSpec spec = GrammarSpec::regex("[0-9]{3}-[a-z]+");
  GrammarMatcher matcher = matcher_for(spec);
  ASSERT_TRUE(accepts(matcher, "123-"));
  EXPECT_FALSE(matcher.is_completed());
  EXPECT_FALSE(allowed(next_mask(matcher), kImEnd));
  ASSERT_TRUE(accepts(matcher, "abc"));
  // Complete, yet more letters may follow.
  EXPECT_TRUE(matcher.is_completed());
  const std::vector<uint32_t> mask = next_mask(matcher);
  EXPECT_TRUE(allowed(mask, kImEnd));
  EXPECT_TRUE(allowed(mask, token("xyz")));
  EXPECT_FALSE(allowed(mask, token("9")));

  GrammarMatcher wrong = matcher_for(spec);
  EXPECT_FALSE(accepts(wrong, "12a"));
}

TEST(GrammarChoice, AcceptsExactlyOneChoice) {
  const std::vector<std::string> choices = {"yes", "no", "maybe so"};
  const GrammarSpec spec = GrammarSpec::choice(choices);
  EXPECT_EQ(spec, GrammarSpec::choice(choices));
  GrammarMatcher maybe = matcher_for(spec);
  ASSERT_TRUE(accepts(maybe, "maybe so"));
  expect_only_stop_then_terminate(maybe);
  GrammarMatcher no = matcher_for(spec);
  ASSERT_TRUE(accepts(no, "no"));
  expect_only_stop_then_terminate(no);
  GrammarMatcher other = matcher_for(spec);
  EXPECT_FALSE(accepts(other, "perhaps"));
  GrammarMatcher longer = matcher_for(spec);
  EXPECT_FALSE(accepts(longer, "yes!"));
  EXPECT_THROW(GrammarSpec::choice({}), Error);
}

TEST(GrammarEbnf, AcceptsAGbnfGrammar) {
  // A GBNF grammar as llama.cpp / vLLM users write it.
  const GrammarSpec spec = GrammarSpec::ebnf(R"(
root ::= "SELECT " column (", " column)* " FROM " table
column ::= [a-z_]+
table ::= "users" | "orders"
)");
  GrammarMatcher matcher = matcher_for(spec);
  ASSERT_TRUE(accepts(matcher, "SELECT id, created_at FROM orders"));
  expect_only_stop_then_terminate(matcher);
  GrammarMatcher wrong = matcher_for(spec);
  EXPECT_FALSE(accepts(wrong, "SELECT id FROM accounts"));
}

// ---- Tool calls ---------------------------------------------------------------------------------

constexpr chat::ToolCallFormat kHermes = chat::ToolCallFormat::kHermes;
constexpr chat::ToolCallFormat kQwen3Coder = chat::ToolCallFormat::kQwen3Coder;

const std::string kWeatherParameters = R"({
  "type": "object",
  "properties": {
    "city": {"type": "string"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
  },
  "required": ["city"]
})";

std::vector<ToolFunction> tools() {
  return {{"get_weather", kWeatherParameters},
          {"get_time", R"({"type": "object", "properties": {"timezone": {"type": "string"}},
                           "required": ["timezone"]})"},
          {"list_alarms", ""},
          // Not in alphabetical order: the grammar keeps the schema's.
          {"set_alarm", R"({"type": "object", "properties": {"minutes": {"type": "integer"},
                            "label": {"type": "string"}, "days": {"type": "array",
                            "items": {"type": "string"}}}, "required": ["minutes"]})"}};
}

// The model's own chat template (Qwen3's: hermes), and Qwen3.5's (qwen3_coder).
const chat::ChatTemplate& qwen3_template() {
  static const chat::ChatTemplate t = chat::ChatTemplate::from_model_dir(kModelDir);
  return t;
}

const chat::ChatTemplate& qwen35_template() {
  static const chat::ChatTemplate t = [] {
    std::ifstream in(std::string(RELAY_SOURCE_DIR) + "/models/templates/Qwen3.5-4B.jinja");
    std::stringstream text;
    text << in.rdbuf();
    return chat::ChatTemplate::from_string(text.str());
  }();
  return t;
}

// The tool-call text of an assistant message as `chat_template` renders it.
std::string template_tool_call_text(const std::vector<nlohmann::ordered_json>& tool_calls,
                                    const chat::ChatTemplate& chat_template = qwen3_template()) {
  using ojson = nlohmann::ordered_json;
  ojson tool_list = ojson::array();
  for (const ToolFunction& f : tools()) {
    tool_list.push_back(
        {{"type", "function"},
         {"function",
          {{"name", f.name},
           {"parameters", f.parameters.empty() ? ojson::object() : ojson::parse(f.parameters)}}}});
  }
  const ojson messages = {
      {{"role", "user"}, {"content", "What is the weather in Paris?"}},
      {{"role", "assistant"}, {"content", ""}, {"tool_calls", ojson(tool_calls)}}};
  const std::string prompt = chat_template.render(messages, tool_list, false, nullptr);
  const size_t assistant = prompt.rfind("<|im_start|>assistant\n");
  const size_t begin = prompt.find("<tool_call>", assistant);
  const size_t end = prompt.find("<|im_end|>", begin);
  EXPECT_NE(begin, std::string::npos) << prompt;
  return prompt.substr(begin, end - begin);
}

std::string qwen35_tool_call_text(const std::vector<nlohmann::ordered_json>& tool_calls) {
  return template_tool_call_text(tool_calls, qwen35_template());
}

nlohmann::ordered_json call(const std::string& name, const nlohmann::ordered_json& arguments) {
  return {{"type", "function"}, {"function", {{"name", name}, {"arguments", arguments}}}};
}

GrammarMatcher tool_call_matcher(chat::ToolCallFormat format,
                                 ToolCallCount count = ToolCallCount::kOneOrMore,
                                 const std::vector<ToolFunction>& functions = tools()) {
  return matcher_for(GrammarSpec::tool_calls(functions, count, format));
}

TEST(GrammarToolCalls, AcceptsTheChatTemplatesTextForAValidCall) {
  const std::string text =
      template_tool_call_text({call("get_weather", {{"city", "Paris"}, {"unit", "celsius"}})});
  ASSERT_EQ(text,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
            "\"unit\": \"celsius\"}}\n</tool_call>");
  ASSERT_EQ(qwen().encode(text).front(), *qwen().token_to_id("<tool_call>"));  // one token
  GrammarMatcher matcher = tool_call_matcher(kHermes, ToolCallCount::kExactlyOne);
  ASSERT_TRUE(accepts(matcher, text));
  expect_only_stop_then_terminate(matcher);
  // The schema's order of the parameters, not the alphabet's.
  GrammarMatcher ordered = tool_call_matcher(kHermes);
  EXPECT_TRUE(accepts(
      ordered, template_tool_call_text({call("set_alarm", {{"minutes", 5}, {"label", "tea"}})})));
}

TEST(GrammarToolCalls, RejectsAnUnknownFunctionAndBadArguments) {
  const GrammarSpec spec = GrammarSpec::tool_calls(tools(), ToolCallCount::kOneOrMore, kHermes);
  // Rejected within the name.
  const std::string get_stock = template_tool_call_text({call("get_stock", {{"ticker", "X"}})});
  GrammarMatcher unknown = matcher_for(spec);
  EXPECT_LT(feed(unknown, get_stock),
            qwen().encode(get_stock.substr(0, get_stock.find("\", \"arguments"))).size());
  GrammarMatcher missing_city = matcher_for(spec);
  EXPECT_FALSE(accepts(missing_city, template_tool_call_text({call("get_weather", {})})));
  GrammarMatcher bad_enum = matcher_for(spec);
  EXPECT_FALSE(accepts(bad_enum, template_tool_call_text({call(
                                     "get_weather", {{"city", "Oslo"}, {"unit", "kelvin"}})})));
  GrammarMatcher not_a_call = matcher_for(spec);
  EXPECT_FALSE(allowed(next_mask(not_a_call), token("The")));  // no text before the call
  EXPECT_FALSE(allowed(next_mask(not_a_call), kImEnd));        // at least one call
}

TEST(GrammarToolCalls, OneOrMoreAcceptsParallelCallsAndExactlyOneDoesNot) {
  const std::string two = template_tool_call_text({call("get_time", {{"timezone", "Europe/Paris"}}),
                                                   call("list_alarms", nlohmann::json::object())});
  ASSERT_NE(two.find("</tool_call>\n<tool_call>"), std::string::npos) << two;
  GrammarMatcher many = tool_call_matcher(kHermes);
  ASSERT_TRUE(accepts(many, two));
  EXPECT_TRUE(many.is_completed());
  // A stop token, or "\n" and a further call.
  EXPECT_EQ(allowed_ids(next_mask(many)), (std::vector<int32_t>{token("\n"), kEndOfText, kImEnd}));

  GrammarMatcher one = tool_call_matcher(kHermes, ToolCallCount::kExactlyOne);
  EXPECT_FALSE(accepts(one, two));
  EXPECT_TRUE(one.is_completed());  // the first call, then only a stop token

  // A named function: that one only.
  GrammarMatcher forced = tool_call_matcher(kHermes, ToolCallCount::kExactlyOne, {tools()[1]});
  EXPECT_FALSE(accepts(forced, template_tool_call_text({call("get_weather", {{"city", "Rome"}})})));
}

TEST(GrammarToolCalls, SpecErrorsNameTheFunction) {
  const auto spec_error = [](std::vector<ToolFunction> functions,
                             chat::ToolCallFormat format = kHermes) {
    return error_of([&] { GrammarSpec::tool_calls(functions, ToolCallCount::kOneOrMore, format); });
  };
  EXPECT_NE(spec_error({{"f", "{not json"}}).find("parameters of function 'f' are not valid JSON"),
            std::string::npos);
  EXPECT_NE(spec_error({{"f", "[1]"}}).find("not a JSON schema object"), std::string::npos);
  EXPECT_NE(spec_error({{"f", ""}, {"f", ""}}).find("'f' is listed twice"), std::string::npos);
  EXPECT_NE(spec_error({{"say \"hi\"", ""}}).find("contains a quote"), std::string::npos);
  EXPECT_NE(spec_error({{"", ""}}).find("empty name"), std::string::npos);
  EXPECT_NE(spec_error({}).find("no functions"), std::string::npos);
  // What would end a name or a parameter's name in qwen3_coder's tags.
  EXPECT_EQ(spec_error({{"get weather", ""}}), "(no error)");
  EXPECT_NE(spec_error({{"get weather", ""}}, kQwen3Coder).find("contains '<', '>'"),
            std::string::npos);
  EXPECT_NE(spec_error({{"a>b", ""}}, kQwen3Coder).find("qwen3_coder"), std::string::npos);
  EXPECT_NE(spec_error({{"f", R"({"type": "object", "properties": {"a>b": {}}})"}}, kQwen3Coder)
                .find("parameter 'a>b' of function 'f'"),
            std::string::npos);
  for (const chat::ToolCallFormat format : {kHermes, kQwen3Coder}) {
    const std::string bad_schema = error_of([&] {
      const std::vector<ToolFunction> f = {{"e", ""}, {"f", R"({"type": "objekt"})"}};
      compiler().compile(GrammarSpec::tool_calls(f, ToolCallCount::kOneOrMore, format));
    });
    EXPECT_EQ(bad_schema, "invalid parameters of function 'f': Unsupported type \"objekt\"");
  }
}

TEST(GrammarToolCalls, Qwen3CoderAcceptsTheQwen35TemplatesText) {
  const std::string text = qwen35_tool_call_text({call(
      "set_alarm",
      {{"minutes", 15}, {"label", "tea </function> <tool_call>"}, {"days", {"mon", "tue"}}})});
  ASSERT_EQ(text,
            "<tool_call>\n<function=set_alarm>\n<parameter=minutes>\n15\n</parameter>\n"
            "<parameter=label>\ntea </function> <tool_call>\n</parameter>\n<parameter=days>\n"
            "[\"mon\", \"tue\"]\n</parameter>\n</function>\n</tool_call>");
  GrammarMatcher matcher = tool_call_matcher(kQwen3Coder, ToolCallCount::kExactlyOne);
  ASSERT_TRUE(accepts(matcher, text));
  expect_only_stop_then_terminate(matcher);
  // No arguments: one newline between the tags.
  const std::string no_arguments =
      qwen35_tool_call_text({call("list_alarms", nlohmann::ordered_json::object())});
  ASSERT_EQ(no_arguments, "<tool_call>\n<function=list_alarms>\n</function>\n</tool_call>");
  GrammarMatcher empty = tool_call_matcher(kQwen3Coder, ToolCallCount::kExactlyOne);
  ASSERT_TRUE(accepts(empty, no_arguments));
  expect_only_stop_then_terminate(empty);
  // Parallel calls, a newline apart, as the template renders them.
  const std::string two =
      qwen35_tool_call_text({call("get_time", {{"timezone", "Europe/Paris"}}),
                             call("list_alarms", nlohmann::ordered_json::object())});
  ASSERT_NE(two.find("</tool_call>\n<tool_call>"), std::string::npos) << two;
  GrammarMatcher many = tool_call_matcher(kQwen3Coder);
  EXPECT_TRUE(accepts(many, two));
  GrammarMatcher one = tool_call_matcher(kQwen3Coder, ToolCallCount::kExactlyOne);
  EXPECT_FALSE(accepts(one, two));
}

TEST(GrammarToolCalls, Qwen3CoderValuesFollowTheirSchemas) {
  const auto accepts_call = [](std::string_view body) {
    GrammarMatcher m = tool_call_matcher(kQwen3Coder);
    return accepts(m, str("<tool_call>\n", body, "\n</tool_call>"));
  };
  EXPECT_TRUE(
      accepts_call("<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                   "<parameter=unit>celsius</parameter>\n</function>"));
  EXPECT_FALSE(
      accepts_call("<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                   "<parameter=unit>kelvin</parameter>\n</function>"));
  // Whitespace around a value the schema fixes is free, as around JSON values: the parser trims it.
  EXPECT_TRUE(
      accepts_call("<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                   "<parameter=unit>\n celsius\t</parameter>\n</function>"));
  // Required parameters, declared ones only, in the schema's order.
  EXPECT_FALSE(accepts_call("<function=get_weather>\n</function>"));
  EXPECT_FALSE(
      accepts_call("<function=get_time>\n<parameter=timezone>\nUTC\n</parameter>\n"
                   "<parameter=extra>\nx\n</parameter>\n</function>"));
  EXPECT_FALSE(
      accepts_call("<function=set_alarm>\n<parameter=label>\nx\n</parameter>\n"
                   "<parameter=minutes>\n5\n</parameter>\n</function>"));
  // An integer is JSON, whitespace around it free; a string ends at its first </parameter>.
  EXPECT_TRUE(accepts_call("<function=set_alarm><parameter=minutes> 5 </parameter></function>"));
  EXPECT_FALSE(
      accepts_call("<function=set_alarm>\n<parameter=minutes>\nfive\n</parameter>\n"
                   "</function>"));
  EXPECT_FALSE(
      accepts_call("<function=get_time>\n<parameter=timezone>\na</parameter>b\n"
                   "</parameter>\n</function>"));
  EXPECT_FALSE(accepts_call("<function=get_stock>\n</function>"));
  GrammarMatcher not_a_call = tool_call_matcher(kQwen3Coder);
  EXPECT_FALSE(allowed(next_mask(not_a_call), token("The")));
  EXPECT_FALSE(allowed(next_mask(not_a_call), kImEnd));
}

// ---- Rollback -----------------------------------------------------------------------------------

TEST(GrammarMatcher, RollbackRestoresTheState) {
  GrammarMatcher matcher = matcher_for(GrammarSpec::json_schema(kPersonSchema, true));
  ASSERT_TRUE(accepts(matcher, R"({"name": "Ada",)"));
  const int before = matcher.num_accepted_tokens();
  const std::vector<uint32_t> mask_before = next_mask(matcher);
  ASSERT_TRUE(accepts(matcher, R"( "age": 36)"));
  const int added = matcher.num_accepted_tokens() - before;
  ASSERT_GT(added, 1);
  matcher.rollback(added);
  EXPECT_EQ(matcher.num_accepted_tokens(), before);
  EXPECT_EQ(next_mask(matcher), mask_before);
  // The same tokens are accepted again, and a rolled-back stop token un-terminates.
  ASSERT_TRUE(accepts(matcher, R"( "age": 36})"));
  ASSERT_TRUE(matcher.accept_token(kEndOfText));
  ASSERT_TRUE(matcher.is_terminated());
  matcher.rollback(1);
  EXPECT_FALSE(matcher.is_terminated());
  EXPECT_TRUE(matcher.is_completed());
  EXPECT_THROW(matcher.rollback(matcher.num_accepted_tokens() + 1), Error);
  matcher.rollback(matcher.num_accepted_tokens());
  GrammarMatcher fresh = matcher_for(GrammarSpec::json_schema(kPersonSchema, true));
  EXPECT_EQ(next_mask(matcher), next_mask(fresh));
}

TEST(GrammarMatcher, RejectsAWronglySizedBitmask) {
  GrammarMatcher matcher = matcher_for(GrammarSpec::json());
  std::vector<uint32_t> mask(token_bitmask_words(qwen().vocab_size()));
  EXPECT_NE(error_of([&] { matcher.fill_next_token_bitmask(mask); }).find("words given"),
            std::string::npos);
}

// ---- The compile cache --------------------------------------------------------------------------

TEST(GrammarCache, ReturnsTheSameCompiledGrammarForTheSameKey) {
  const auto a = compiler().compile(GrammarSpec::regex("[a-c]+"));
  EXPECT_EQ(compiler().compile(GrammarSpec::regex("[a-c]+")), a);
  EXPECT_NE(compiler().compile(GrammarSpec::ebnf("root ::= [a-c]+")), a);  // another kind
  const auto lax = compiler().compile(GrammarSpec::json_schema(kPersonSchema, false));
  EXPECT_NE(compiler().compile(GrammarSpec::json_schema(kPersonSchema, true)), lax);
}

TEST(GrammarCache, IsBoundedLeastRecentlyUsedFirst) {
  GrammarCompiler small(qwen(), qwen_options(/*cache_capacity=*/2));
  const auto a = small.compile(GrammarSpec::regex("a+"));
  const auto b = small.compile(GrammarSpec::regex("b+"));
  EXPECT_EQ(small.compile(GrammarSpec::regex("a+")), a);   // a is now the most recent
  const auto c = small.compile(GrammarSpec::regex("c+"));  // evicts b
  EXPECT_EQ(small.cache_size(), 2u);
  EXPECT_EQ(small.compile(GrammarSpec::regex("a+")), a);
  EXPECT_EQ(small.compile(GrammarSpec::regex("c+")), c);
  EXPECT_NE(small.compile(GrammarSpec::regex("b+")), b);  // compiled again
  EXPECT_EQ(small.cache_size(), 2u);
}

TEST(GrammarCache, AMatcherOutlivesItsEvictedGrammar) {
  GrammarCompiler one(qwen(), qwen_options(/*cache_capacity=*/1));
  GrammarMatcher matcher(*one.compile(GrammarSpec::regex("x+")));
  one.compile(GrammarSpec::regex("y+"));  // evicts x+, whose last shared_ptr is gone
  ASSERT_EQ(one.cache_size(), 1u);
  EXPECT_TRUE(accepts(matcher, "xxx"));
  EXPECT_TRUE(matcher.is_completed());
}

TEST(GrammarCache, ConcurrentRequestsForOneSpecCompileItOnce) {
  GrammarCompiler shared(qwen(), qwen_options());
  const GrammarSpec spec = GrammarSpec::json_schema(kPersonSchema, true);
  std::vector<std::shared_ptr<const CompiledGrammar>> results(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < results.size(); ++i) {
    threads.emplace_back([&, i] { results[i] = shared.compile(spec); });
  }
  for (std::thread& t : threads) t.join();
  for (const auto& r : results) EXPECT_EQ(r, results.front());
  EXPECT_EQ(shared.cache_size(), 1u);
}

// ---- Applying a bitmask to logits ---------------------------------------------------------------

TEST(TokenBitmask, MasksClearedBitsWithMinusInfinity) {
  // 70 logits: three words, the last one partial.
  std::vector<float> logits(70);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i);
  std::vector<uint32_t> mask = {~uint32_t{0}, 0, 0};
  mask[2] = (1u << 1) | (1u << 5);  // tokens 65 and 69; word 1 (32..63) all masked
  apply_token_bitmask(logits, mask);
  for (size_t i = 0; i < logits.size(); ++i) {
    const bool keep = i < 32 || i == 65 || i == 69;
    if (keep) {
      EXPECT_EQ(logits[i], static_cast<float>(i)) << i;
    } else {
      EXPECT_TRUE(std::isinf(logits[i]) && logits[i] < 0) << i;
    }
  }
  std::vector<uint32_t> short_mask(2);
  EXPECT_THROW(apply_token_bitmask(logits, short_mask), Error);
}

}  // namespace
}  // namespace relay

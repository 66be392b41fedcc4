// Request validation for /v1/chat/completions and /v1/completions (see openai_protocol.h).
#include "server/openai_protocol.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/json.h"

namespace relay::server {

using json = nlohmann::ordered_json;

json ApiError::body() const {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

ApiError bad_param(const std::string& param, const std::string& message) {
  return ApiError{400, message, "invalid_request_error", param, ""};
}

namespace {

constexpr int64_t kMaxN = 16;
constexpr int64_t kMaxTopLogprobs = 20;
constexpr size_t kMaxPrompts = 1024;  // prompts in one completions request
constexpr size_t kMaxLogitBias = 1024;  // tokens in one logit_bias
constexpr size_t kMaxStopStrings = 16;

// Reads the fields of one JSON object, remembering which were read so that the rest can be
// reported as unknown. A null value counts as absent (clients send "field": null for defaults).
class Fields {
 public:
  explicit Fields(const json& obj) : obj_(obj) {}

  const json* get(const std::string& name) {
    seen_.insert(name);
    const auto it = obj_.find(name);
    return (it == obj_.end() || it->is_null()) ? nullptr : &*it;
  }

  std::optional<double> number(const std::string& name, double lo, double hi) {
    const json* v = get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) throw bad_param(name, str("'", name, "' must be a number"));
    const double x = v->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi) {
      throw bad_param(name,
                      str("'", name, "' must be between ", lo, " and ", hi, ", got ", v->dump()));
    }
    return x;
  }

  std::optional<int64_t> integer(const std::string& name, int64_t lo, int64_t hi) {
    const json* v = get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number_integer()) throw bad_param(name, str("'", name, "' must be an integer"));
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      throw bad_param(name, str("'", name, "' is too large"));
    }
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) {
      throw bad_param(name, str("'", name, "' must be between ", lo, " and ", hi, ", got ", x));
    }
    return x;
  }

  std::optional<bool> boolean(const std::string& name) {
    const json* v = get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) throw bad_param(name, str("'", name, "' must be a boolean"));
    return v->get<bool>();
  }

  std::optional<std::string> string(const std::string& name) {
    const json* v = get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) throw bad_param(name, str("'", name, "' must be a string"));
    return v->get<std::string>();
  }

  // Appends the fields nothing read to `ignored` (prefixed, for nested objects), as vLLM ignores
  // fields it does not know (newer clients send reasoning_effort, modalities, verbosity, ...);
  // those that never change what is generated are not even listed.
  void list_unknown(std::vector<std::string>& ignored, const std::string& prefix = "") const {
    static const std::set<std::string> kHarmless = {"user",
                                                    "metadata",
                                                    "store",
                                                    "service_tier",
                                                    "parallel_tool_calls",
                                                    "prompt_cache_key",
                                                    "safety_identifier"};
    for (const auto& [key, value] : obj_.items()) {
      // A null counts as absent, as everywhere here.
      if (seen_.count(key) == 0 && !value.is_null() &&
          (!prefix.empty() || kHarmless.count(key) == 0)) {
        ignored.push_back(prefix + key);
      }
    }
  }

 private:
  const json& obj_;
  std::set<std::string> seen_;
};

// An object's "type" member when it is a string, else "" (nlohmann's value() throws on a mismatch).
std::string type_of(const json& obj) {
  const auto it = obj.find("type");
  return it != obj.end() && it->is_string() ? it->get<std::string>() : "";
}

json parse_object(std::string_view body) {
  json j;
  try {
    j = parse_json<json>(body, "the request body");
  } catch (const JsonError& e) {
    throw ApiError{400, e.what(), "invalid_request_error", e.param(), ""};
  }
  if (!j.is_object()) {
    throw ApiError{400, "the request body must be a JSON object", "invalid_request_error", "", ""};
  }
  return j;
}

std::string read_model(Fields& f) {
  const auto model = f.string("model");
  if (!model) throw bad_param("model", "'model' is required");
  return *model;
}

// Fields common to both endpoints; `max_tokens_names` lists the spellings of max_tokens.
// A JSON schema given as an object or as a string holding one, as compact JSON text.
std::string schema_text(const json& v, const std::string& param) {
  json schema = v;
  if (v.is_string()) {
    try {
      schema = parse_json<json>(v.get_ref<const std::string&>(), str("'", param, "'"));
    } catch (const JsonError& e) {
      throw bad_param(param, e.what());
    }
  }
  if (!schema.is_object()) throw bad_param(param, str("'", param, "' must be a JSON schema object"));
  return schema.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::vector<std::string> choice_list(const json& v, const std::string& param) {
  if (!v.is_array() || v.empty() ||
      !std::all_of(v.begin(), v.end(), [](const json& c) { return c.is_string(); })) {
    throw bad_param(param, str("'", param, "' must be a non-empty list of strings"));
  }
  return v.get<std::vector<std::string>>();
}

// The structured-output constraint of a request: OpenAI's response_format, vLLM's
// structured_outputs, or vLLM's older guided_json / guided_regex / guided_choice / guided_grammar;
// at most one of them.
void read_constraint(Fields& f, GenerationOptions& o, std::vector<std::string>& ignored) {
  using Kind = OutputConstraint::Kind;
  std::vector<OutputConstraint> found;
  auto add = [&](Kind kind, std::string param, std::string text = "", bool strict = false,
                 std::vector<std::string> choices = {}) {
    found.push_back({kind, std::move(text), strict, std::move(choices), std::move(param)});
  };
  if (const json* v = f.get("response_format")) {
    if (!v->is_object()) throw bad_param("response_format", "'response_format' must be an object");
    const std::string type = type_of(*v);
    if (type == "json_object") {
      add(Kind::kJsonObject, "response_format");
    } else if (type == "json_schema") {
      const auto spec = v->find("json_schema");
      if (spec == v->end() || !spec->is_object() || !spec->contains("schema")) {
        throw bad_param("response_format",
                        "'response_format' of type json_schema needs "
                        "{\"json_schema\": {\"name\", \"schema\", \"strict\"}}");
      }
      const auto strict = spec->find("strict");
      add(Kind::kJsonSchema, "response_format.json_schema.schema",
          schema_text((*spec)["schema"], "response_format.json_schema.schema"),
          strict != spec->end() && strict->is_boolean() && strict->get<bool>());
    } else if (type != "text") {
      throw bad_param("response_format",
                      "'response_format' type must be text, json_object or json_schema");
    }
  }
  if (const json* v = f.get("structured_outputs")) {
    if (!v->is_object()) {
      throw bad_param("structured_outputs", "'structured_outputs' must be an object");
    }
    Fields so(*v);
    if (const json* j = so.get("json")) {
      add(Kind::kJsonSchema, "structured_outputs.json", schema_text(*j, "structured_outputs.json"));
    }
    if (auto regex = so.string("regex")) add(Kind::kRegex, "structured_outputs.regex", *regex);
    if (const json* c = so.get("choice")) {
      add(Kind::kChoice, "structured_outputs.choice", "", false,
          choice_list(*c, "structured_outputs.choice"));
    }
    if (auto grammar = so.string("grammar")) {
      add(Kind::kGrammar, "structured_outputs.grammar", *grammar);
    }
    if (so.boolean("json_object").value_or(false)) add(Kind::kJsonObject, "structured_outputs.json_object");
    if (so.get("structural_tag") != nullptr) {
      throw bad_param("structured_outputs.structural_tag", "'structural_tag' is not supported");
    }
    // Tuning options of vLLM's backends that do not change what is valid: accepted, ignored.
    for (const char* knob : {"disable_fallback", "disable_any_whitespace",
                             "disable_additional_properties", "whitespace_pattern", "backend"}) {
      so.get(knob);
    }
    so.list_unknown(ignored, "structured_outputs.");
  }
  if (const json* v = f.get("guided_json")) {
    add(Kind::kJsonSchema, "guided_json", schema_text(*v, "guided_json"));
  }
  if (auto regex = f.string("guided_regex")) add(Kind::kRegex, "guided_regex", *regex);
  if (const json* v = f.get("guided_choice")) {
    add(Kind::kChoice, "guided_choice", "", false, choice_list(*v, "guided_choice"));
  }
  if (auto grammar = f.string("guided_grammar")) add(Kind::kGrammar, "guided_grammar", *grammar);
  for (const char* knob : {"guided_decoding_backend", "guided_whitespace_pattern"}) f.get(knob);
  if (found.size() > 1) {
    throw bad_param(found[1].param, str("give one structured-output constraint, not both '",
                                        found[0].param, "' and '", found[1].param, "'"));
  }
  if (!found.empty()) o.constraint = std::move(found.front());
}

// `min_max_tokens`: 1, or 0 where the caller allows max_tokens 0 (completions with echo).
GenerationOptions read_options(Fields& f, std::initializer_list<const char*> max_tokens_names,
                               int64_t min_max_tokens, std::vector<std::string>& ignored) {
  GenerationOptions o;
  for (const char* name : max_tokens_names) {
    if (auto v = f.integer(name, min_max_tokens, INT32_MAX)) o.max_tokens = *v;
  }
  o.min_tokens = f.integer("min_tokens", 0, INT32_MAX).value_or(0);
  o.temperature = f.number("temperature", 0.0, 2.0).value_or(1.0);
  o.top_p = f.number("top_p", 0.0, 1.0).value_or(1.0);
  if (o.top_p <= 0.0) throw bad_param("top_p", "'top_p' must be greater than 0");
  o.top_k = f.integer("top_k", -1, INT32_MAX).value_or(0);
  o.min_p = f.number("min_p", 0.0, 1.0).value_or(0.0);
  o.presence_penalty = f.number("presence_penalty", -2.0, 2.0).value_or(0.0);
  o.frequency_penalty = f.number("frequency_penalty", -2.0, 2.0).value_or(0.0);
  o.repetition_penalty = f.number("repetition_penalty", 0.0, 10.0).value_or(1.0);
  if (o.repetition_penalty <= 0.0) {
    throw bad_param("repetition_penalty", "'repetition_penalty' must be greater than 0");
  }
  if (const json* v = f.get("seed")) {
    if (!v->is_number_integer()) throw bad_param("seed", "'seed' must be an integer");
    o.seed =
        v->is_number_unsigned() ? v->get<uint64_t>() : static_cast<uint64_t>(v->get<int64_t>());
  }
  o.n = f.integer("n", 1, kMaxN).value_or(1);
  if (const json* v = f.get("stop")) {
    if (v->is_string()) {
      o.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      if (v->size() > kMaxStopStrings) {
        throw bad_param("stop", str("'stop' takes at most ", kMaxStopStrings, " strings"));
      }
      for (const json& s : *v) {
        if (!s.is_string()) throw bad_param("stop", "'stop' must be a string or a list of strings");
        o.stop.push_back(s.get<std::string>());
      }
    } else {
      throw bad_param("stop", "'stop' must be a string or a list of strings");
    }
    for (const std::string& s : o.stop) {
      if (s.empty()) throw bad_param("stop", "'stop' strings must not be empty");
    }
  }
  if (const json* v = f.get("stop_token_ids")) {
    if (!v->is_array())
      throw bad_param("stop_token_ids", "'stop_token_ids' must be a list of integers");
    for (const json& t : *v) {
      if (!t.is_number_integer()) {
        throw bad_param("stop_token_ids", "'stop_token_ids' must be a list of integers");
      }
      o.stop_token_ids.push_back(t.get<int64_t>());
    }
  }
  o.ignore_eos = f.boolean("ignore_eos").value_or(false);
  o.include_stop_str_in_output = f.boolean("include_stop_str_in_output").value_or(false);
  o.skip_special_tokens = f.boolean("skip_special_tokens").value_or(true);
  o.return_tokens_as_token_ids = f.boolean("return_tokens_as_token_ids").value_or(false);
  o.prompt_logprobs = f.integer("prompt_logprobs", 0, kMaxTopLogprobs);
  o.stream = f.boolean("stream").value_or(false);
  if (o.prompt_logprobs && o.stream) {  // as vLLM
    throw bad_param("prompt_logprobs", "'prompt_logprobs' are not available when 'stream' is true");
  }
  if (const json* v = f.get("stream_options")) {
    if (!o.stream) {
      throw bad_param("stream_options", "'stream_options' is only allowed when 'stream' is true");
    }
    if (!v->is_object()) throw bad_param("stream_options", "'stream_options' must be an object");
    Fields so(*v);
    o.include_usage = so.boolean("include_usage").value_or(false);
    so.boolean("continuous_usage_stats");
    so.list_unknown(ignored, "stream_options.");
  }
  if (const json* v = f.get("logit_bias")) {
    if (!v->is_object()) throw bad_param("logit_bias", "'logit_bias' must be an object of token id -> bias");
    if (v->size() > kMaxLogitBias) {
      throw bad_param("logit_bias", str("'logit_bias' takes at most ", kMaxLogitBias, " tokens"));
    }
    for (const auto& [key, bias] : v->items()) {
      int64_t token = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), token);
      if (ec != std::errc() || end != key.data() + key.size()) {
        throw bad_param("logit_bias", str("'logit_bias' keys must be token ids, got '", key, "'"));
      }
      if (!bias.is_number() || !std::isfinite(bias.get<double>()) || bias.get<double>() < -100 ||
          bias.get<double>() > 100) {
        throw bad_param("logit_bias", str("'logit_bias' of token ", key,
                                          " must be a number between -100 and 100"));
      }
      o.logit_bias.emplace_back(token, bias.get<double>());
    }
  }
  read_constraint(f, o, ignored);
  return o;
}

// Message content may be a string or a list of {"type": "text", "text": ...} parts; the template
// takes a string.
json normalize_content(const json& content, size_t index) {
  const std::string param = str("messages[", index, "].content");
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array())
    throw bad_param(param, str("'", param, "' must be a string or a list of parts"));
  std::string text;
  for (const json& part : content) {
    if (!part.is_object() || type_of(part) != "text" || !part.contains("text") ||
        !part["text"].is_string()) {
      throw bad_param(param,
                      str("'", param, "' parts must be {\"type\": \"text\", \"text\": ...}"));
    }
    text += part["text"].get<std::string>();
  }
  return text;
}

json validate_messages(const json* messages) {
  if (messages == nullptr) throw bad_param("messages", "'messages' is required");
  if (!messages->is_array()) throw bad_param("messages", "'messages' must be a list");
  if (messages->empty()) throw bad_param("messages", "'messages' must not be empty");
  static const std::set<std::string> kRoles = {"system", "developer", "user", "assistant", "tool"};
  json out = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string where = str("messages[", i, "]");
    if (!m.is_object()) throw bad_param(where, str("'", where, "' must be an object"));
    const auto role = m.find("role");
    if (role == m.end() || !role->is_string() || kRoles.count(role->get<std::string>()) == 0) {
      throw bad_param(where + ".role", str("'", where,
                                           ".role' must be one of system, developer, user, "
                                           "assistant, tool"));
    }
    json msg = m;
    if (msg.contains("content")) msg["content"] = normalize_content(msg["content"], i);
    const std::string r = role->get<std::string>();
    // An assistant turn that only calls tools has no content; templates expect a string.
    if (r == "assistant" && (!msg.contains("content") || msg["content"].is_null()))
      msg["content"] = "";
    if (r != "assistant" && (!msg.contains("content") || !msg["content"].is_string())) {
      throw bad_param(where + ".content", str("'", where, ".content' is required for role ", r));
    }
    if (msg.contains("tool_calls") && !msg["tool_calls"].is_null()) {
      if (!msg["tool_calls"].is_array()) {
        throw bad_param(where + ".tool_calls", str("'", where, ".tool_calls' must be a list"));
      }
      // The template renders arguments as an object; OpenAI clients send them as a JSON string.
      for (json& call : msg["tool_calls"]) {
        if (!call.is_object() || !call.contains("function") || !call["function"].is_object()) {
          throw bad_param(where + ".tool_calls", "each tool call needs a 'function' object");
        }
        json& args = call["function"]["arguments"];
        if (args.is_string()) {
          const std::string param = where + ".tool_calls";
          try {
            args = parse_json<json>(args.get<std::string>(), str("'", param, "' arguments"));
          } catch (const JsonError& e) {
            throw bad_param(param, str(e.what(), "; tool call 'arguments' must be a JSON object "
                                                 "encoded as a string"));
          }
        }
      }
    }
    out.push_back(std::move(msg));
  }
  return out;
}

json validate_tools(const json* tools) {
  if (tools == nullptr) return nullptr;
  if (!tools->is_array()) throw bad_param("tools", "'tools' must be a list");
  for (size_t i = 0; i < tools->size(); ++i) {
    const json& t = (*tools)[i];
    const std::string where = str("tools[", i, "]");
    if (!t.is_object() || type_of(t) != "function" || !t.contains("function") ||
        !t["function"].is_object() || !t["function"].contains("name") ||
        !t["function"]["name"].is_string()) {
      throw bad_param(
          where,
          str("'", where, "' must be {\"type\": \"function\", \"function\": {\"name\": ...}}"));
    }
  }
  return tools->empty() ? json(nullptr) : *tools;
}

// What the chat template takes besides the messages and tools (chat completions and /tokenize).
void read_template_inputs(Fields& f, json& chat_template_kwargs, bool& add_generation_prompt) {
  if (const json* v = f.get("chat_template_kwargs")) {
    if (!v->is_object())
      throw bad_param("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    chat_template_kwargs = *v;
  }
  add_generation_prompt = f.boolean("add_generation_prompt").value_or(true);
}

}  // namespace

ChatRequest parse_chat_request(std::string_view body) {
  const json j = parse_object(body);
  Fields f(j);
  ChatRequest r;
  r.model = read_model(f);
  r.messages = validate_messages(f.get("messages"));
  r.tools = validate_tools(f.get("tools"));
  if (const json* v = f.get("tool_choice")) {
    if (v->is_string()) {
      r.tool_choice = v->get<std::string>();
      if (r.tool_choice != "auto" && r.tool_choice != "none" && r.tool_choice != "required") {
        throw bad_param("tool_choice", "'tool_choice' must be auto, none, required or a function");
      }
    } else if (v->is_object() && type_of(*v) == "function" && v->contains("function") &&
               (*v)["function"].is_object() && (*v)["function"].contains("name") &&
               (*v)["function"]["name"].is_string()) {
      r.tool_choice = "required";
      r.tool_choice_function = (*v)["function"]["name"].get<std::string>();
    } else {
      throw bad_param("tool_choice", "'tool_choice' must be auto, none, required or a function");
    }
    if (r.tool_choice == "required" && r.tools.is_null()) {
      throw bad_param("tool_choice", "'tool_choice' requires 'tools'");
    }
    if (!r.tool_choice_function.empty() &&
        std::none_of(r.tools.begin(), r.tools.end(), [&](const json& t) {
          return t["function"]["name"] == r.tool_choice_function;
        })) {
      throw bad_param("tool_choice", str("'tool_choice' names the function '",
                                         r.tool_choice_function, "', which is not in 'tools'"));
    }
  }
  read_template_inputs(f, r.chat_template_kwargs, r.add_generation_prompt);
  r.options = read_options(f, {"max_tokens", "max_completion_tokens"}, 1, r.ignored_fields);
  r.parallel_tool_calls = f.boolean("parallel_tool_calls").value_or(true);
  if (r.tool_choice == "required" && r.options.constraint) {
    throw bad_param(r.options.constraint->param,
                    str("'", r.options.constraint->param,
                        "' cannot be combined with a tool_choice that forces a call"));
  }
  r.options.logprobs = f.boolean("logprobs").value_or(false);
  if (auto k = f.integer("top_logprobs", 0, kMaxTopLogprobs)) {
    if (!r.options.logprobs)
      throw bad_param("top_logprobs", "'top_logprobs' requires 'logprobs': true");
    r.options.top_logprobs = *k;
  }
  f.list_unknown(r.ignored_fields);
  return r;
}

CompletionRequest parse_completion_request(std::string_view body) {
  const json j = parse_object(body);
  Fields f(j);
  CompletionRequest r;
  r.model = read_model(f);
  const json* prompt = f.get("prompt");
  if (prompt == nullptr) throw bad_param("prompt", "'prompt' is required");
  // A prompt is a string or a list of token ids; a batch is a list of either.
  auto read_prompt = [](const json& p) -> std::optional<CompletionPrompt> {
    if (p.is_string()) {
      if (p.get_ref<const std::string&>().empty()) {
        throw bad_param("prompt", "'prompt' must not be empty");
      }
      return CompletionPrompt{p.get<std::string>(), {}};
    }
    if (p.is_array() && !p.empty() &&
        std::all_of(p.begin(), p.end(), [](const json& t) { return t.is_number_integer(); })) {
      CompletionPrompt out;
      for (const json& t : p) out.ids.push_back(t.get<int64_t>());
      return out;
    }
    return std::nullopt;
  };
  if (auto one = read_prompt(*prompt)) {
    r.prompts.push_back(std::move(*one));
  } else if (prompt->is_array() && !prompt->empty()) {
    if (prompt->size() > kMaxPrompts) {
      throw bad_param("prompt", str("'prompt' holds at most ", kMaxPrompts, " prompts"));
    }
    for (const json& p : *prompt) {
      auto each = read_prompt(p);
      if (!each) {
        throw bad_param("prompt",
                        "'prompt' must be a string, a list of token ids, or a list of either");
      }
      r.prompts.push_back(std::move(*each));
    }
  } else {
    throw bad_param("prompt", "'prompt' must be a non-empty string or list of token ids");
  }
  r.echo = f.boolean("echo").value_or(false);
  r.options = read_options(f, {"max_tokens"}, 0, r.ignored_fields);
  if (!r.options.max_tokens) r.options.max_tokens = 16;  // OpenAI's default for completions
  // max_tokens 0 returns the prompt alone (with its logprobs): vLLM's scoring request.
  if (*r.options.max_tokens == 0 && !r.echo) {
    throw bad_param("max_tokens", "'max_tokens' may be 0 only with 'echo': true");
  }
  if (auto k = f.integer("logprobs", 0, kMaxTopLogprobs)) {
    r.options.logprobs = true;
    r.options.top_logprobs = *k;
  }
  if (f.get("suffix") != nullptr) throw bad_param("suffix", "'suffix' is not supported");
  if (const json* v = f.get("best_of");
      v != nullptr && !(v->is_number_integer() && v->get<int64_t>() == 1)) {
    throw bad_param("best_of", "'best_of' other than 1 is not supported");
  }
  f.list_unknown(r.ignored_fields);
  return r;
}

TokenizeRequest parse_tokenize_request(std::string_view body) {
  const json j = parse_object(body);
  Fields f(j);
  TokenizeRequest r;
  r.model = f.string("model");
  r.prompt = f.string("prompt");
  if (f.get("messages") != nullptr) {
    if (r.prompt) throw bad_param("messages", "give either 'prompt' or 'messages', not both");
    r.messages = validate_messages(f.get("messages"));
    r.tools = validate_tools(f.get("tools"));
    read_template_inputs(f, r.chat_template_kwargs, r.add_generation_prompt);
  } else if (!r.prompt) {
    throw bad_param("prompt", "'prompt' (a string) or 'messages' is required");
  }
  // NOTE: Qwen tokenizers add no special tokens of their own (no BOS), so add_special_tokens
  // changes nothing; it is accepted for vLLM's clients.
  f.boolean("add_special_tokens");
  r.return_token_strs = f.boolean("return_token_strs").value_or(false);
  f.list_unknown(r.ignored_fields);
  return r;
}

DetokenizeRequest parse_detokenize_request(std::string_view body) {
  const json j = parse_object(body);
  Fields f(j);
  DetokenizeRequest r;
  r.model = f.string("model");
  const json* tokens = f.get("tokens");
  if (tokens == nullptr || !tokens->is_array() ||
      !std::all_of(tokens->begin(), tokens->end(), [](const json& t) { return t.is_number_integer(); })) {
    throw bad_param("tokens", "'tokens' must be a list of token ids");
  }
  for (const json& t : *tokens) r.tokens.push_back(t.get<int64_t>());
  f.list_unknown(r.ignored_fields);
  return r;
}

int64_t check_context_length(int64_t num_prompt_tokens, const GenerationOptions& options,
                             int64_t max_model_len, const std::string& prompt_param) {
  const int64_t wanted = options.max_tokens.value_or(0);
  // Room for max_tokens, or (unset) for at least one token; max_tokens 0 needs only the prompt.
  if (num_prompt_tokens + (options.max_tokens ? wanted : 1) > max_model_len) {
    ApiError e =
        bad_param(prompt_param, str("This model's maximum context length is ", max_model_len,
                                    " tokens. However, you requested ", num_prompt_tokens + wanted,
                                    " tokens (", num_prompt_tokens, " in the ", prompt_param, ", ",
                                    wanted, " in the completion). Please reduce the length of the ",
                                    prompt_param, " or completion."));
    e.code = "context_length_exceeded";
    throw e;
  }
  return options.max_tokens ? wanted : max_model_len - num_prompt_tokens;
}

void check_token_ids(const std::vector<int64_t>& ids, int64_t vocab_size,
                     const std::string& param) {
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size) {
      throw bad_param(param, str("token id ", id, " in '", param,
                                 "' is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
}

ApiError transport_error(int status, const std::string& message) {
  const char* type = status == 503 ? "service_unavailable"
                     : status >= 500 ? "internal_server_error"
                                     : "invalid_request_error";
  const char* code = status == 404   ? "not_found"
                     : status == 405 ? "method_not_allowed"
                     : status == 408 ? "request_timeout"
                     : status == 413 ? "request_too_large"
                     : status == 431 ? "request_header_fields_too_large"
                                     : "";
  return ApiError{status, message, type, "", code};
}

SamplingParams sampling_params(const GenerationOptions& o, uint64_t seed) {
  SamplingParams s;
  s.temperature = static_cast<float>(o.temperature);
  s.top_k = o.top_k < 0 ? 0 : static_cast<int>(o.top_k);
  s.top_p = static_cast<float>(o.top_p);
  s.min_p = static_cast<float>(o.min_p);
  s.presence_penalty = static_cast<float>(o.presence_penalty);
  s.frequency_penalty = static_cast<float>(o.frequency_penalty);
  s.repetition_penalty = static_cast<float>(o.repetition_penalty);
  s.seed = seed;
  s.num_logprobs = o.logprobs ? static_cast<int>(o.top_logprobs) : -1;
  return s;
}

StopConditions stop_conditions(const GenerationOptions& o, int64_t max_tokens) {
  StopConditions s;
  s.max_tokens = max_tokens;
  s.min_tokens = std::min(o.min_tokens, max_tokens);
  for (int64_t t : o.stop_token_ids) s.stop_token_ids.push_back(static_cast<int32_t>(t));
  s.stop_strings = o.stop;
  s.ignore_eos = o.ignore_eos;
  s.include_stop_str_in_output = o.include_stop_str_in_output;
  s.skip_special_tokens = o.skip_special_tokens;
  return s;
}

nlohmann::json tokenizer_info(const std::string& model_dir, int max_model_len) {
  namespace fs = std::filesystem;
  nlohmann::json info = nlohmann::json::object();
  const fs::path config = fs::path(model_dir) / "tokenizer_config.json";
  if (fs::exists(config)) info = parse_json_file<nlohmann::json>(config);
  for (auto& [key, value] : info.items()) {
    // AddedToken objects ({"content": ...}) of older configs, as the string they stand for.
    if (key.ends_with("_token") && value.is_object() && value.contains("content")) {
      value = nlohmann::json(value["content"]);
    }
  }
  const fs::path jinja = fs::path(model_dir) / "chat_template.jinja";
  if (fs::exists(jinja)) info["chat_template"] = read_text_file(jinja);
  info["model_max_length"] = max_model_len;
  return info;
}

}  // namespace relay::server

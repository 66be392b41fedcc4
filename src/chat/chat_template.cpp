// ChatTemplate: transformers' apply_chat_template around a Template (see chat_template.h).
#include "chat/chat_template.h"
#include "core/json.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace relay::chat {
namespace {

// transformers' SPECIAL_TOKENS_ATTRIBUTES that special_tokens_map reports when set.
constexpr const char* kSpecialTokenNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                              "pad_token", "cls_token", "mask_token"};
// Reasoning field names, in transformers' order of preference (_REASONING_FIELDS).
constexpr const char* kReasoningFields[] = {"reasoning_content", "thinking", "reasoning"};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TemplateError(str("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::ordered_json read_json(const std::string& path) {
  try {
    return parse_json<nlohmann::ordered_json>(read_file(path), path);
  } catch (const JsonError& e) {
    throw TemplateError(e.what());
  }
}

SpecialTokens special_tokens_of(const nlohmann::ordered_json& config) {
  SpecialTokens tokens;
  for (const char* name : kSpecialTokenNames) {
    const auto it = config.find(name);
    if (it == config.end()) continue;
    if (it->is_string()) {
      tokens.emplace_back(name, it->get<std::string>());
    } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      tokens.emplace_back(name, (*it)["content"].get<std::string>());
    }
  }
  return tokens;
}

std::string template_of(const nlohmann::ordered_json& config, const std::string& path) {
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) throw TemplateError(str(path, " has no chat_template"));
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const auto& entry : *it) {
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string()) {
        return entry["template"].get<std::string>();
      }
    }
    throw TemplateError(str(path, ": chat_template is a list without a \"default\" entry"));
  }
  throw TemplateError(str(path, ": chat_template must be a string or a list of named templates"));
}

// transformers' _normalize_chat_messages + _alias_reasoning_fields for one message.
nlohmann::ordered_json normalize_message(const nlohmann::ordered_json& message, size_t index) {
  if (!message.is_object()) throw TemplateError(str("messages[", index, "] must be a JSON object"));
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& [k, v] : message.items()) {
    if (!v.is_null()) out[k] = v;
  }
  const nlohmann::ordered_json* reasoning = nullptr;
  for (const char* field : kReasoningFields) {
    const auto it = out.find(field);
    if (it != out.end()) {
      reasoning = &*it;
      break;
    }
  }
  if (reasoning == nullptr) return out;
  // {"thinking": r, **message, "reasoning_content": r}
  const nlohmann::ordered_json r = *reasoning;
  nlohmann::ordered_json aliased = nlohmann::ordered_json::object();
  aliased["thinking"] = r;
  for (const auto& [k, v] : out.items()) aliased[k] = v;
  aliased["reasoning_content"] = r;
  return aliased;
}

}  // namespace

ChatTemplate ChatTemplate::from_string(std::string_view source, SpecialTokens special_tokens) {
  return ChatTemplate(std::make_shared<const Template>(source), std::move(special_tokens));
}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path) {
  const nlohmann::ordered_json config = read_json(path);
  if (!config.is_object()) throw TemplateError(str(path, " must hold a JSON object"));
  return from_string(template_of(config, path), special_tokens_of(config));
}

SpecialTokens ChatTemplate::special_tokens_of_model_dir(const std::string& dir) {
  const std::filesystem::path config_path = std::filesystem::path(dir) / "tokenizer_config.json";
  if (!std::filesystem::exists(config_path)) return {};
  return special_tokens_of(read_json(config_path.string()));
}

ChatTemplate ChatTemplate::from_model_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path config_path = fs::path(dir) / "tokenizer_config.json";
  const fs::path jinja_path = fs::path(dir) / "chat_template.jinja";
  const bool has_config = fs::exists(config_path);
  if (fs::exists(jinja_path)) return from_string(read_file(jinja_path.string()), special_tokens_of_model_dir(dir));
  if (!has_config) throw TemplateError(str(dir, " has neither chat_template.jinja nor tokenizer_config.json"));
  return from_tokenizer_config(config_path.string());
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                 bool add_generation_prompt, const nlohmann::ordered_json& extra_kwargs) const {
  if (!messages.is_array()) throw TemplateError("messages must be a JSON array");
  if (!tools.is_null() && !tools.is_array()) throw TemplateError("tools must be a JSON array or null");
  if (!extra_kwargs.is_null() && !extra_kwargs.is_object()) {
    throw TemplateError("chat_template_kwargs must be a JSON object");
  }
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  for (const auto& [name, token] : special_tokens_) context[name] = token;
  if (extra_kwargs.is_object()) {
    for (const auto& [k, v] : extra_kwargs.items()) {
      if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt") {
        throw TemplateError(str("chat_template_kwargs may not set '", k, "'"));
      }
      context[k] = v;
    }
  }
  nlohmann::ordered_json normalized = nlohmann::ordered_json::array();
  for (size_t i = 0; i < messages.size(); ++i) normalized.push_back(normalize_message(messages[i], i));
  context["messages"] = std::move(normalized);
  context["tools"] = tools;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  return template_->render(context);
}

std::string_view tool_call_format_name(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return "hermes";
    case ToolCallFormat::kQwen3Coder:
      return "qwen3_coder";
  }
  return "unknown";
}

std::optional<ToolCallFormat> tool_call_format_from_name(std::string_view name) {
  for (const ToolCallFormat format : {ToolCallFormat::kHermes, ToolCallFormat::kQwen3Coder}) {
    if (name == tool_call_format_name(format)) return format;
  }
  return std::nullopt;
}

ToolCallFormat ChatTemplate::tool_call_format() const {
  using ojson = nlohmann::ordered_json;
  static const ojson tools = parse_json<ojson>(R"([{"type": "function", "function": {
      "name": "relay_sample", "description": "A sample function.",
      "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}])",
                                               "the sample tools");
  static const ojson messages = parse_json<ojson>(R"([{"role": "user", "content": "Call it."},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
       "function": {"name": "relay_sample", "arguments": {"x": "1"}}}]}])",
                                                  "the sample messages");
  try {
    const std::string text = render(messages, tools, false, nullptr);
    if (text.find("<function=relay_sample>") != std::string::npos)
      return ToolCallFormat::kQwen3Coder;
  } catch (const TemplateError&) {
    // NOTE: a template that cannot render a tool call gets the default; a request with tools then
    // fails to render by itself, with the template's own message.
  }
  return ToolCallFormat::kHermes;
}

}  // namespace relay::chat

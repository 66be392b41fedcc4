// Chat templates: Relay's own Jinja2 interpreter and the transformers-compatible chat rendering on top.
//
// This is the interface of the chat module. `Template` is a parsed Jinja template (the subset Qwen3,
// Qwen3-Coder and Qwen3.5 templates use, with transformers' environment: trim_blocks, lstrip_blocks,
// loop controls, sandbox limits, its tojson and raise_exception); rendering it gives byte for byte
// what Python jinja2 3.1 gives. `ChatTemplate` adds what transformers' apply_chat_template does
// around the template: loading it from a model directory, passing the special tokens, dropping
// null-valued message keys (OpenAI clients send `"content": null`), aliasing reasoning fields
// (reasoning_content / thinking / reasoning), and passing tools, add_generation_prompt and
// chat_template_kwargs (e.g. enable_thinking).
//
// JSON arrives as nlohmann::ordered_json, not nlohmann::json: Python dicts keep insertion order and
// the prompt shows it (tool schemas go through tojson), so the caller must parse request bodies with
// ordered_json for the prompt to match transformers.
//
// Every failure — syntax errors (with line), raise_exception in the template, type errors, runaway
// loops or recursion — throws TemplateError, never crashes; a server maps it to a 400 for that request.
//
// A template also fixes how the model writes tool calls (ToolCallFormat): the text it renders an
// assistant's tool_calls as is what the model learnt to write, so the server reads calls, and
// forces them with a grammar, in that format.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/error.h"

namespace relay::chat {

class TemplateError : public relay::Error {
 public:
  using relay::Error::Error;
};

namespace jinja {
struct Program;
}

// A parsed Jinja template.
class Template {
 public:
  // Parses `source`; throws TemplateError("chat template syntax error at line N: ...").
  explicit Template(std::string_view source);
  // Renders with the top-level variables of `context` (a JSON object). Thread-safe: renders share
  // only the immutable syntax tree.
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  std::shared_ptr<const jinja::Program> program_;
};

// How a model writes tool calls, named as vLLM's --tool-call-parser names them.
enum class ToolCallFormat : uint8_t {
  // "hermes" (Qwen3): <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>
  kHermes,
  // "qwen3_coder" (Qwen3.5, Qwen3-Coder): one function per call, each argument in its own tag,
  // its value as plain text between newlines:
  //   <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>
  kQwen3Coder,
};

// The format's vLLM name, and back: nullopt for a name that is neither "hermes" nor "qwen3_coder".
std::string_view tool_call_format_name(ToolCallFormat format);
std::optional<ToolCallFormat> tool_call_format_from_name(std::string_view name);

// Special tokens passed to the template as variables (bos_token, eos_token, pad_token, ...), as
// transformers' special_tokens_map gives them; unset tokens are absent.
using SpecialTokens = std::vector<std::pair<std::string, std::string>>;

class ChatTemplate {
 public:
  // `dir`/chat_template.jinja when present (transformers gives it precedence), else the
  // "chat_template" of `dir`/tokenizer_config.json. Special tokens come from tokenizer_config.json.
  static ChatTemplate from_model_dir(const std::string& dir);
  // The "chat_template" entry of a tokenizer_config.json file (a string, or a list of
  // {"name", "template"} from which "default" is taken) and its special tokens.
  static ChatTemplate from_tokenizer_config(const std::string& path);
  static ChatTemplate from_string(std::string_view source, SpecialTokens special_tokens = {});
  // The special tokens of `dir`/tokenizer_config.json; empty when the file does not exist.
  static SpecialTokens special_tokens_of_model_dir(const std::string& dir);

  // transformers' apply_chat_template(messages, tools=tools, add_generation_prompt=...,
  // **extra_kwargs, tokenize=False). `messages` is an array of objects; `tools` an array or null
  // (null means no tools: the template sees None); `extra_kwargs` an object or null.
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     bool add_generation_prompt, const nlohmann::ordered_json& extra_kwargs) const;

  // The format this template renders an assistant's tool calls in, found by rendering a sample
  // call: qwen3_coder when it shows `<function=NAME>`, else hermes (also for a template that
  // cannot render the sample, or ignores tools).
  ToolCallFormat tool_call_format() const;

  const Template& raw() const { return *template_; }
  const SpecialTokens& special_tokens() const { return special_tokens_; }

 private:
  ChatTemplate(std::shared_ptr<const Template> t, SpecialTokens tokens)
      : template_(std::move(t)), special_tokens_(std::move(tokens)) {}
  std::shared_ptr<const Template> template_;
  SpecialTokens special_tokens_;
};

}  // namespace relay::chat

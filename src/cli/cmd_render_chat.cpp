// `relay render-chat`: the chat template on the command line. Reads an OpenAI-style request body
// ({"messages": [...], "tools": [...], "chat_template_kwargs": {...}, "add_generation_prompt": true})
// on stdin and writes the prompt text exactly as transformers' apply_chat_template(tokenize=False)
// would, so scripts and the end-to-end tests can compare Relay with Python jinja2.
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "cli/command.h"
#include "core/error.h"
#include "core/json.h"

namespace relay::cli {
namespace {

struct RenderChatOptions {
  std::string model_dir = default_model_dir();
  std::string template_file;
};

int run_render_chat(const RenderChatOptions& o) {
  const chat::ChatTemplate tmpl = [&] {
    if (o.template_file.empty()) return chat::ChatTemplate::from_model_dir(o.model_dir);
    // The template comes from the file; special tokens still come from the model directory.
    const chat::SpecialTokens tokens = chat::ChatTemplate::special_tokens_of_model_dir(o.model_dir);
    std::ifstream in(o.template_file, std::ios::binary);
    RELAY_CHECK(in.good(), "cannot open template file ", o.template_file);
    const std::string source{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    return chat::ChatTemplate::from_string(source, tokens);
  }();
  const std::string input{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
  // ordered_json: key order reaches the prompt through tojson, as in Python.
  const auto body = parse_json<nlohmann::ordered_json>(input, "stdin");
  RELAY_CHECK(body.is_object(), "stdin must hold a JSON object with \"messages\"");
  RELAY_CHECK(body.contains("messages"), "the request has no \"messages\"");
  const nlohmann::ordered_json tools = body.value("tools", nlohmann::ordered_json());
  const nlohmann::ordered_json kwargs = body.value("chat_template_kwargs", nlohmann::ordered_json());
  const nlohmann::ordered_json add = body.value("add_generation_prompt", nlohmann::ordered_json(true));
  RELAY_CHECK(add.is_boolean(), "\"add_generation_prompt\" must be true or false");
  std::cout << tmpl.render(body["messages"], tools, add.get<bool>(), kwargs) << std::flush;
  return 0;
}

const CommandRegistrar kRegistrar{Command{
    "render-chat",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<RenderChatOptions>();
      sub.add_option("--model", o->model_dir,
                     "model directory holding tokenizer_config.json or chat_template.jinja "
                     "(default: the embedded demo model)");
      sub.add_option("--template", o->template_file, "render with this .jinja file instead of the model's template");
      sub.footer(
          "Reads a JSON object on stdin: \"messages\" (required), \"tools\", \"chat_template_kwargs\" "
          "(e.g. {\"enable_thinking\": false}) and \"add_generation_prompt\" (default true). Writes the "
          "prompt text to stdout with no trailing newline.");
      return [o] { return run_render_chat(*o); };
    },
    "OpenAI-style chat request on stdin -> prompt text from the chat template"}};

}  // namespace
}  // namespace relay::cli

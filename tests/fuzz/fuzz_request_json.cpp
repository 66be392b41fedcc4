// Fuzz target for the OpenAI request bodies (server/openai_protocol.h), the JSON any client can send
// without an API key's protection mattering. The first byte picks the route (chat completions,
// completions, /tokenize, /detokenize); the rest is the body. Parsing must succeed or throw
// ApiError (a 400 with a parameter), never crash; a chat request that parses is then rendered by
// the Qwen3 chat template, the recursive walk a 20,000-level body once overflowed, where only a
// template error may come back.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "chat/chat_template.h"
#include "server/openai_protocol.h"

namespace {

const relay::chat::ChatTemplate& chat_template() {
  static const relay::chat::ChatTemplate t =
      relay::chat::ChatTemplate::from_model_dir(RELAY_SOURCE_DIR "/models/relay-demo-moe");
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size == 0) return 0;
  const std::string_view body(reinterpret_cast<const char*>(bytes) + 1, size - 1);
  using namespace relay::server;
  try {
    switch (bytes[0] % 4) {
      case 0: {
        const ChatRequest r = parse_chat_request(body);
        try {
          chat_template().render(r.messages, r.tools, r.add_generation_prompt,
                                 r.chat_template_kwargs);
        } catch (const relay::chat::TemplateError&) {
          // The request's 400: the template refused these messages.
        }
        break;
      }
      case 1:
        parse_completion_request(body);
        break;
      case 2:
        parse_tokenize_request(body);
        break;
      default:
        parse_detokenize_request(body);
        break;
    }
  } catch (const ApiError&) {
    // A 400 for the client.
  }
  return 0;
}

// The control plane's messages between the router and the prefill / decode workers, as JSON.
//
// The control plane is HTTP/1.1 + JSON on the same cpp-httplib server that serves the OpenAI API:
// no second messaging library, every message readable with curl, and the only traffic on it is a
// handful of small messages per request plus the decode worker's token stream (the KV bytes travel
// through the transfer engine, never through here). Message formats are in docs/disaggregation.md;
// every decoder throws relay::Error naming the missing or mistyped field.
#pragma once

#include <functional>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/llm_engine.h"
#include "grammar/grammar.h"

namespace relay::disagg {

// Compiles a grammar against the receiving worker's vocabulary (its GrammarCompiler::compile).
using CompileGrammar = std::function<std::shared_ptr<const CompiledGrammar>(const GrammarSpec&)>;

// An engine request without its prompt's KV: prompt, sampling, stop conditions, prompt logprobs
// and token constraints (logit_bias, the reasoning tokens, the grammar). A compiled grammar belongs
// to one tokenizer's vocabulary, so the message carries its spec (grammar_spec), which the decoder
// compiles again with `compile`; a spec that does not compile is an error naming "grammar".
nlohmann::json request_to_json(const EngineRequest& r);
EngineRequest request_from_json(const nlohmann::json& j, const CompileGrammar& compile);

// One step's output of a request, as the decode worker streams it (one JSON object per line).
nlohmann::json output_to_json(const RequestOutput& o);
RequestOutput output_from_json(const nlohmann::json& j);

// The first generated token, sampled by the prefill worker, and the prompt's logprobs when the
// request asked for them (computed there, with the prompt).
struct FirstToken {
  SampledToken token;
  int num_cached_tokens = 0;  // prompt tokens the prefill worker found in its prefix cache
  // As RequestOutput::prompt_logprobs: one per prompt position, the first nullopt; empty when the
  // request asked for none.
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
};
nlohmann::json first_token_to_json(const FirstToken& t);
FirstToken first_token_from_json(const nlohmann::json& j);

// Reads field `key` of `j` as T, or throws relay::Error naming `what` and the key.
template <typename T>
T field(const nlohmann::json& j, const char* key, const char* what) {
  if (!j.is_object() || !j.contains(key)) fail(str(what, ": missing field \"", key, "\""));
  try {
    return j.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    fail(str(what, ": field \"", key, "\" has the wrong type"));
  }
}

}  // namespace relay::disagg

// Parsing and validating OpenAI-style request bodies, and the error bodies that answer bad ones.
//
// Everything a client can get wrong is caught here, before the request touches the engine: JSON
// syntax and depth, the type and range of every field, and combinations that make no sense. Fields
// Relay does not know are ignored, as vLLM ignores them (clients send newer OpenAI fields such as
// reasoning_effort or modalities); each request lists them (ignored_fields) for the server to log.
// Each failure is an ApiError whose `param` names the offending field, so one bad request gets a
// precise 400 and nothing else is disturbed. Checks that need the tokenizer or the model (context
// length, token ids in range, the model name) are made by the server with the helpers at the end.
// JSON is kept in order (ordered_json), as Python keeps dicts: tool schemas reach the prompt
// through the template's tojson and must appear as the client wrote them. This file depends on JSON
// only, so it is unit-tested and fuzzed on its own.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "sequence/sampling.h"

namespace relay::server {

// An error answered to the client as {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty -> null
  std::string code;   // empty -> null

  nlohmann::ordered_json body() const;
};

ApiError bad_param(const std::string& param, const std::string& message);
// The OpenAI error of a status the transport answers by itself (http/server.h: 404, 405, 408,
// 413, 431, 503, ...).
ApiError transport_error(int status, const std::string& message);

// A structured-output constraint, as one of OpenAI's response_format, vLLM's structured_outputs or
// its older guided_* fields asks (the server compiles it with grammar/grammar.h).
struct OutputConstraint {
  enum class Kind { kJsonObject, kJsonSchema, kRegex, kChoice, kGrammar };
  Kind kind = Kind::kJsonObject;
  std::string text;                  // the JSON schema (compact JSON), the regex or the grammar
  bool strict = false;               // a JSON schema's "strict": no property it does not name
  std::vector<std::string> choices;  // kChoice
  std::string param;                 // the request field it came from, for errors
};

// Sampling and stopping options shared by chat and text completions.
struct GenerationOptions {
  std::optional<int64_t> max_tokens;  // unset: up to the context length; 0 only with echo
  int64_t min_tokens = 0;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;  // 0 or -1: off
  double min_p = 0.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  double repetition_penalty = 1.0;
  std::optional<uint64_t> seed;
  int64_t n = 1;
  bool logprobs = false;
  int64_t top_logprobs = 0;
  std::vector<std::string> stop;
  std::vector<int64_t> stop_token_ids;
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  bool return_tokens_as_token_ids = false;  // logprob tokens as "token_id:N" (a vLLM extension)
  // vLLM's prompt_logprobs: the logprob of every prompt token and its k most likely alternatives.
  std::optional<int64_t> prompt_logprobs;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  std::optional<OutputConstraint> constraint;
  std::vector<std::pair<int64_t, double>> logit_bias;  // (token id, bias in [-100, 100])
};

struct ChatRequest {
  std::string model;
  nlohmann::ordered_json
      messages;                  // array of {role, content (string), ...}: content parts are joined
  nlohmann::ordered_json tools;  // array, or null when absent
  std::string tool_choice = "auto";  // "auto", "none" or "required"; a named function is "required"
  std::string tool_choice_function;  // the function tool_choice names, if it names one
  bool parallel_tool_calls = true;
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  bool add_generation_prompt = true;
  GenerationOptions options;
  std::vector<std::string> ignored_fields;  // unknown fields, ignored (nested ones as "a.b")
};

// One prompt of a completions request: text, or token ids.
struct CompletionPrompt {
  std::optional<std::string> text;  // exactly one of these
  std::vector<int64_t> ids;
};

struct CompletionRequest {
  std::string model;
  // A string or a list of token ids, or a batch of either: choices are answered prompt by prompt,
  // choice index = prompt index * n + sample index (OpenAI's order).
  std::vector<CompletionPrompt> prompts;
  bool echo = false;
  GenerationOptions options;
  std::vector<std::string> ignored_fields;  // unknown fields, ignored (nested ones as "a.b")
};

// vLLM's POST /tokenize: a completion prompt (a string) or chat messages, rendered as
// /v1/chat/completions renders them.
struct TokenizeRequest {
  std::optional<std::string> model;  // checked when given
  std::optional<std::string> prompt;  // exactly one of prompt and messages
  nlohmann::ordered_json messages;    // array, or null for a prompt
  nlohmann::ordered_json tools;       // array, or null
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  bool add_generation_prompt = true;
  bool return_token_strs = false;  // also each token's text
  std::vector<std::string> ignored_fields;  // unknown fields, ignored (nested ones as "a.b")
};

// vLLM's POST /detokenize.
struct DetokenizeRequest {
  std::optional<std::string> model;
  std::vector<int64_t> tokens;
  std::vector<std::string> ignored_fields;  // unknown fields, ignored (nested ones as "a.b")
};

// Parse and validate a body; throw ApiError (400) naming the parameter on any problem.
ChatRequest parse_chat_request(std::string_view body);
CompletionRequest parse_completion_request(std::string_view body);
TokenizeRequest parse_tokenize_request(std::string_view body);
DetokenizeRequest parse_detokenize_request(std::string_view body);

// Server-side checks with the numbers only the server knows.
// 400 code "context_length_exceeded" when the prompt plus max_tokens does not fit; otherwise the
// number of tokens that may be generated (max_tokens, or what is left of the context).
int64_t check_context_length(int64_t num_prompt_tokens, const GenerationOptions& options,
                             int64_t max_model_len, const std::string& prompt_param);
// 400 naming `param` when a token id is outside [0, vocab_size).
void check_token_ids(const std::vector<int64_t>& ids, int64_t vocab_size, const std::string& param);

// The engine's sampling parameters for one choice of a request (its seed `seed`).
SamplingParams sampling_params(const GenerationOptions& o, uint64_t seed);
// Its stop conditions, with the request's max_tokens (0: a prompt-only scoring request).
StopConditions stop_conditions(const GenerationOptions& o, int64_t max_tokens);
// vLLM's GET /tokenizer_info: the model's tokenizer_config.json (special tokens as plain strings),
// with the chat template the server renders with and the context it serves. lm-eval's remote
// tokenizer reads eos_token and chat_template from it.
nlohmann::json tokenizer_info(const std::string& model_dir, int max_model_len);

}  // namespace relay::server

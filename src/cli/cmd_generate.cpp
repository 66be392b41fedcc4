// `relay generate`: one prompt, offline, streamed to stdout as it is generated.
//
// It runs the same LLMEngine as the server (scheduler, block manager, backend), so what it
// prints is what the server would answer for the same request; the timing summary on stderr splits
// the prompt (prefill) from the decode rate.
#include <chrono>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "cli/backend_choice.h"
#include "cli/command.h"
#include "core/error.h"
#include "engine/llm_engine.h"
#include "tokenizer/tokenizer.h"

namespace relay::cli {
namespace {

struct GenerateOptions {
  std::string model_dir = default_model_dir();
  std::string prompt;
  bool chat = false;
  bool no_thinking = false;
  int max_tokens = 128;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  float min_p = 0.0f;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::string speculative_config;  // vLLM's --speculative-config JSON
  BackendChoice backend;
};

int run_generate(const GenerateOptions& o) {
  using Clock = std::chrono::steady_clock;
  EngineConfig config;
  config.max_num_seqs = 1;
  if (!o.speculative_config.empty()) {
    config.speculative = SpeculativeConfig::parse(o.speculative_config);
  }
  if (is_follower_node(o.backend)) {
    return follow_leader(o.model_dir, o.backend, config.max_num_seqs, config.speculative);
  }
  const Tokenizer tokenizer = Tokenizer::from_model_dir(o.model_dir);
  std::string prompt = o.prompt;
  if (o.chat) {
    const auto tmpl = chat::ChatTemplate::from_model_dir(o.model_dir);
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    messages.push_back({{"role", "user"}, {"content", o.prompt}});
    nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
    if (o.no_thinking) kwargs["enable_thinking"] = false;
    prompt = tmpl.render(messages, nullptr, /*add_generation_prompt=*/true, kwargs);
  }
  LLMEngine engine(make_backend(o.model_dir, o.backend, config.max_num_seqs,
                                config.max_num_batched_tokens, config.speculative),
                   tokenizer, config);

  EngineRequest request;
  request.prompt = tokenizer.encode(prompt);
  RELAY_CHECK(!request.prompt.empty(), "the prompt encodes to no tokens");
  request.sampling.temperature = o.temperature;
  request.sampling.top_p = o.top_p;
  request.sampling.top_k = o.top_k;
  request.sampling.min_p = o.min_p;
  request.sampling.seed = o.seed;
  request.stop.ignore_eos = o.ignore_eos;
  request.stop.max_tokens = std::min<int64_t>(
      o.max_tokens, engine.max_model_len() - static_cast<int64_t>(request.prompt.size()));
  RELAY_CHECK(request.stop.max_tokens >= 1, "the prompt (", request.prompt.size(),
              " tokens) leaves no room in the context of ", engine.max_model_len(), " tokens");
  const size_t num_prompt_tokens = request.prompt.size();
  engine.add_request(0, std::move(request));

  const Clock::time_point start = Clock::now();
  Clock::time_point first_token = start;
  int num_generated = 0;
  const char* finish = "";
  while (engine.has_work()) {
    for (const RequestOutput& out : engine.step()) {
      if (num_generated == 0 && !out.new_tokens.empty()) first_token = Clock::now();
      num_generated = out.num_output_tokens;
      std::fwrite(out.text.data(), 1, out.text.size(), stdout);
      std::fflush(stdout);
      if (out.finish != FinishReason::kNone) finish = finish_reason_name(out.finish);
    }
  }
  const Clock::time_point end = Clock::now();
  std::fputc('\n', stdout);
  std::fflush(stdout);
  const double prefill_s = std::chrono::duration<double>(first_token - start).count();
  const double decode_s = std::chrono::duration<double>(end - first_token).count();
  std::fprintf(
      stderr,
      "relay: prompt %zu tokens in %.3f s (%.1f tok/s); decode %d tokens in %.3f s (%.1f tok/s); "
      "finish: %s\n",
      num_prompt_tokens, prefill_s, num_prompt_tokens / std::max(prefill_s, 1e-9),
      num_generated - 1, decode_s, (num_generated - 1) / std::max(decode_s, 1e-9), finish);
  if (config.speculative.enabled()) {
    const SpecDecodeStats s = engine.stats().spec_decode;
    std::fprintf(stderr,
                 "relay: speculative decoding (%s): %llu of %llu drafts accepted (%.2f), %.2f "
                 "tokens per step with drafts\n",
                 config.speculative.describe().c_str(),
                 static_cast<unsigned long long>(s.num_accepted_tokens),
                 static_cast<unsigned long long>(s.num_draft_tokens), s.acceptance_rate(),
                 s.mean_acceptance_length());
  }
  return 0;
}

CommandRegistrar generate_command({
    "generate",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<GenerateOptions>();
      sub.add_option("--model", o->model_dir,
                     "checkpoint directory (default: the embedded demo model)");
      sub.add_option("--prompt", o->prompt, "the prompt text")->required();
      sub.add_flag("--chat", o->chat,
                   "render the prompt as a user message through the model's chat template");
      sub.add_flag("--no-thinking", o->no_thinking,
                   "with --chat: enable_thinking=false (Qwen3 templates)");
      sub.add_option("--max-tokens", o->max_tokens, "tokens to generate at most (default 128)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--temperature", o->temperature, "0 = greedy (default 0)")
          ->check(CLI::Range(0.0, 100.0));
      sub.add_option("--top-p", o->top_p, "nucleus sampling mass (default 1 = off)")
          ->check(CLI::Range(0.0, 1.0));
      sub.add_option("--top-k", o->top_k, "sample among the k most likely (default 0 = off)")
          ->check(CLI::NonNegativeNumber);
      sub.add_option("--min-p", o->min_p,
                     "drop tokens below min_p x the top probability (default 0 = off)")
          ->check(CLI::Range(0.0, 1.0));
      sub.add_option("--seed", o->seed,
                     "sampling seed (default 0); the output is a pure function of it");
      sub.add_flag("--ignore-eos", o->ignore_eos, "keep generating past end-of-sequence tokens");
      sub.add_option("--speculative-config", o->speculative_config,
                     "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                     "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 5}' or "
                     "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}' (the checkpoint's "
                     "MTP head, or \"model\": DIR for a separate one; \"min_draft_acceptance\": "
                     "R drafts only what lands with probability >= R); lossless: the same "
                     "tokens, in fewer steps when drafts are accepted");
      add_backend_options(sub, o->backend);
      return [o] { return run_generate(*o); };
    },
    "generate text for one prompt, streamed to stdout (timing on stderr)",
});

}  // namespace
}  // namespace relay::cli

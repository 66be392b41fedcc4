// Structured outputs: a request's constraint (any JSON, a JSON schema, a regex, a choice among
// strings, an EBNF grammar, or tool calls in the model's format) compiled into a grammar over the
// model's token vocabulary, and a per-sequence matcher that says which tokens may come next.
//
// The engine is xgrammar's C++ library (the one vLLM, SGLang and TensorRT-LLM use), kept behind
// this header: nothing outside src/grammar includes it. Its three parts map onto Relay's threads:
//   - GrammarCompiler, built once per model from the Tokenizer: the vocabulary as byte strings
//     (every id's decoded bytes; special tokens and the padding rows past the tokenizer's
//     vocabulary up to the model's vocab_size are never allowed, except the stop tokens once the
//     grammar is complete). The HTTP threads call compile(), so a bad schema is a relay::Error (a
//     400) before the request is queued. Compilation is ahead of time: it precomputes the token
//     masks of the grammar's states (20-50 ms for a JSON schema on Qwen3's vocabulary), so its
//     results sit in a bounded LRU cache keyed by the spec (kind, text), and concurrent requests
//     for one spec compile it once.
//   - CompiledGrammar: immutable, shared (shared_ptr) by the cache and the requests using it; a
//     matcher keeps the tables it needs alive itself, so eviction never pulls them from under it.
//     It keeps the spec it was compiled from (grammar_spec), which is what crosses a process
//     boundary: a disaggregated worker compiles the router's spec against its own vocabulary.
//   - GrammarMatcher: one per constrained sequence, used by the engine thread only. Each step the
//     sampler asks for the bitmask of allowed next tokens (fill_next_token_bitmask), masks the
//     logits with it (apply_token_bitmask), and the sampled token is accepted (accept_token).
//     rollback() undoes accepted tokens, for speculative decoding's rejected drafts.
//
// JSON (schemas and tool-call arguments) may have whitespace between any two tokens, at most 64
// characters in one place, so a model cannot stall an output in an endless run of spaces.
//
// The bitmask is xgrammar's layout, ceil(vocab_size / 32) 32-bit words: bit (i % 32) of word i / 32
// set means token i is allowed. Ids past the tokenizer's vocabulary (the embedding's padding rows)
// are always clear.
//
// A matcher starts where the constrained text starts: the engine gives it the tokens sampled after
// the prompt (after `</think>` when Qwen3 reasons first, as vLLM's reasoning-aware structured
// outputs do).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace relay {

class Tokenizer;
namespace chat {
enum class ToolCallFormat : uint8_t;  // chat/chat_template.h
}

// ---- Token bitmasks -----------------------------------------------------------------------------

// Number of 32-bit words of a bitmask over `vocab_size` tokens.
constexpr size_t token_bitmask_words(int64_t vocab_size) {
  return static_cast<size_t>((vocab_size + 31) / 32);
}

// Sets logits[i] to -inf for every token i whose bit is clear in `bitmask`, which has
// token_bitmask_words(logits.size()) words. The sampler's CPU path: one row of fp32 logits.
void apply_token_bitmask(std::span<float> logits, std::span<const uint32_t> bitmask);

// ---- What a request constrains its output to ----------------------------------------------------

enum class GrammarKind : uint8_t {
  kJson,              // any JSON object or array (response_format json_object, as vLLM)
  kJsonSchema,        // a JSON schema with JSON Schema's own defaults (extra properties allowed)
  kJsonSchemaStrict,  // a JSON schema, nothing the schema does not name (OpenAI's strict: true)
  kRegex,             // a regular expression (guided_regex)
  kChoice,            // exactly one of a list of strings (guided_choice)
  kEbnf,              // an EBNF / GBNF grammar with a `root` rule (guided_grammar)
  kToolCalls,         // tool calls (tool_choice "required" or a named function)
};

// A tool the model may be forced to call: its name and the JSON schema of its `arguments`.
struct ToolFunction {
  std::string name;
  // The function's `parameters` (a JSON schema, as text); empty means no parameters: `{}`.
  std::string parameters;
};

enum class ToolCallCount : uint8_t {
  kExactlyOne,  // a named function, or parallel_tool_calls false
  kOneOrMore,   // tool_choice "required" with parallel calls allowed
};

// A constraint as a request states it, and the compile cache's key. Build one with the factory
// functions; they check what they can without compiling and throw relay::Error naming the problem.
struct GrammarSpec {
  GrammarKind kind = GrammarKind::kJson;
  // The schema, regex or grammar as given; for kChoice and kToolCalls the xgrammar structural tag
  // (JSON) the factory built, so that equal requests give equal text.
  std::string text;

  static GrammarSpec json();
  static GrammarSpec json_schema(std::string schema, bool strict);
  static GrammarSpec regex(std::string pattern);
  // At least one choice; the output is exactly one of them.
  static GrammarSpec choice(std::span<const std::string> choices);
  static GrammarSpec ebnf(std::string grammar);
  // Tool calls as the model's chat template renders an assistant's tool_calls, in `format`:
  //  - hermes: <tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>, ARGS a JSON object
  //    matching the function's parameters;
  //  - qwen3_coder: <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...
  //    </function>\n</tool_call>, the parameters in the schema's order, each value as its schema
  //    types it (a string as free text without "</parameter>", other values as JSON), with
  //    whitespace between the tags;
  // where NAME is one of `functions` (strictly: no property the schema does not name);
  // kOneOrMore separates calls with "\n". Names must be unique and free of what would end them in
  // the text: '"', '\\' and control characters for hermes (the template writes them into the JSON
  // unescaped), '<', '>', quotes, braces and whitespace for qwen3_coder, whose parameter names may
  // hold no '<', '>' or line break either.
  static GrammarSpec tool_calls(std::span<const ToolFunction> functions, ToolCallCount count,
                                chat::ToolCallFormat format);

  bool operator==(const GrammarSpec&) const = default;
};

// ---- Compiling ----------------------------------------------------------------------------------

// A compiled grammar: immutable, opaque, shared by every matcher built on it.
class CompiledGrammar;

// The spec a grammar was compiled from. A compiled grammar belongs to one tokenizer's vocabulary,
// so a disaggregated router sends its workers this, and each compiles it with its own.
const GrammarSpec& grammar_spec(const CompiledGrammar& grammar);

struct GrammarCompilerOptions {
  // The model's vocab_size (config.json): the logits' width. At least the tokenizer's; 0 means the
  // tokenizer's.
  int32_t vocab_size = 0;
  // The ids that end a sequence (the model's eos_token_ids); allowed once the grammar is complete.
  std::vector<int32_t> stop_token_ids;
  // Compiled grammars kept, least recently used evicted first.
  size_t cache_capacity = 64;
  // Threads one compilation uses to precompute its token masks. Requests already compile in
  // parallel on their own HTTP threads; more threads shorten one large grammar's compilation.
  int compile_threads = 1;
};

// Thread-safe. Building it decodes and sorts the whole vocabulary (once per model).
class GrammarCompiler {
 public:
  GrammarCompiler(const Tokenizer& tokenizer, const GrammarCompilerOptions& options);
  ~GrammarCompiler();
  GrammarCompiler(const GrammarCompiler&) = delete;
  GrammarCompiler& operator=(const GrammarCompiler&) = delete;

  // The compiled grammar of `spec`, from the cache or compiled now (one compilation per spec even
  // when several threads ask at once). Throws relay::Error saying what is wrong with an invalid
  // schema, regex or grammar; failures are not cached.
  std::shared_ptr<const CompiledGrammar> compile(const GrammarSpec& spec);

  int32_t vocab_size() const;
  // Compiled grammars in the cache now (at most options.cache_capacity).
  size_t cache_size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- Matching -----------------------------------------------------------------------------------

// The state of one sequence's output in a grammar. Not thread-safe: one thread (the engine's) uses
// it. Cheap to build: it shares the compiled grammar's tables and keeps them alive itself.
class GrammarMatcher {
 public:
  explicit GrammarMatcher(const CompiledGrammar& grammar);
  ~GrammarMatcher();
  GrammarMatcher(GrammarMatcher&&) noexcept;
  GrammarMatcher& operator=(GrammarMatcher&&) noexcept;

  // Width of the vocabulary the bitmask covers (the compiler's vocab_size).
  int32_t vocab_size() const;

  // Writes the tokens allowed next into `bitmask` (token_bitmask_words(vocab_size()) words). Not
  // after termination: nothing may follow a stop token.
  void fill_next_token_bitmask(std::span<uint32_t> bitmask);

  // Advances by one sampled token; false (and no change) when the grammar does not allow it. A stop
  // token is accepted only when the grammar is complete, and terminates the matcher.
  bool accept_token(int32_t token_id);

  // Whether the tokens accepted so far form a complete output, so a stop token is allowed next
  // (more tokens may be too: `[0-9]+` after "4").
  bool is_completed() const;
  // Whether a stop token was accepted: the constrained output is over and nothing may follow.
  bool is_terminated() const;

  // Undoes the last `num_tokens` accepted tokens (a stop token included, which un-terminates).
  void rollback(int num_tokens);
  // Tokens accepted and not rolled back.
  int num_accepted_tokens() const { return num_accepted_tokens_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int num_accepted_tokens_ = 0;
};

}  // namespace relay

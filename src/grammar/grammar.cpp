// The grammar module over xgrammar (see grammar.h): the vocabulary, spec factories, compilation
// with its cache, and the matcher. The only file that includes xgrammar.
//
// Vocabulary: xgrammar is given every id's bytes as Relay's tokenizer decodes them
// (VocabType::RAW), not the byte-level strings of tokenizer.json: the tokenizer already undoes
// GPT-2's alphabet exactly as HF does (its ByteLevel decoder), added tokens included, so the
// grammar sees the very bytes the detokenizer emits. Special tokens get an empty string, which
// xgrammar treats as never-text, and the ids from the tokenizer's size up to the model's vocab_size
// (embedding padding) are xgrammar's padding ids; both are always masked out. The stop ids are
// passed explicitly, so xgrammar does not guess them from token text.
//
// Cache: a mutex-guarded LRU list of shared futures. The first thread to miss inserts a future and
// compiles outside the lock; threads asking for the same spec meanwhile wait on that future; other
// specs are not held up. A failed compilation is removed again, so errors are never cached and a
// retry compiles afresh. xgrammar's own compile cache is off: this one bounds the memory.
#include "grammar/grammar.h"

#include <algorithm>
#include <future>
#include <list>
#include <mutex>
#include <new>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <xgrammar/xgrammar.h>
#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "core/error.h"
#include "core/json.h"
#include "tokenizer/tokenizer.h"

namespace relay {

// NOTE: ordered, so that a tool's parameters keep the order its schema gives them: the order the
// prompt shows them in and the model writes them in, which a forced call's grammar requires.
using Json = nlohmann::ordered_json;

class CompiledGrammar {
 public:
  CompiledGrammar(GrammarSpec spec, xgrammar::CompiledGrammar compiled)
      : spec_(std::move(spec)), compiled_(std::move(compiled)) {}
  const GrammarSpec& spec() const { return spec_; }
  const xgrammar::CompiledGrammar& xgrammar() const { return compiled_; }

 private:
  GrammarSpec spec_;
  xgrammar::CompiledGrammar compiled_;
};

const GrammarSpec& grammar_spec(const CompiledGrammar& grammar) { return grammar.spec(); }

namespace {

// NOTE: JSON may have whitespace between any two tokens, as vLLM allows, but at most this many
// characters in one place: an unbounded run let a weak model "write" spaces until max_tokens and
// never finish its object (deep pretty-printed JSON stays well inside it).
constexpr int kMaxJsonWhitespace = 64;

const char* kind_name(GrammarKind kind) {
  switch (kind) {
    case GrammarKind::kJson:
      return "JSON grammar";
    case GrammarKind::kJsonSchema:
    case GrammarKind::kJsonSchemaStrict:
      return "JSON schema";
    case GrammarKind::kRegex:
      return "regex";
    case GrammarKind::kChoice:
      return "choice";
    case GrammarKind::kEbnf:
      return "EBNF grammar";
    case GrammarKind::kToolCalls:
      return "tool call";
  }
  return "grammar";
}

// xgrammar's checks throw what() = "[HH:MM:SS] /path/file.cc:123: Check failed: (cond) is false:
// message\n"; a client is told the message only.
std::string xgrammar_message(std::string_view what) {
  if (what.starts_with('[')) {
    const size_t time_end = what.find("] ");
    const size_t location_end =
        time_end == std::string_view::npos ? what.npos : what.find(": ", time_end);
    if (location_end != std::string_view::npos) what.remove_prefix(location_end + 2);
  }
  if (what.starts_with("Check failed: ")) {
    const size_t condition_end = what.find(" is false: ");
    if (condition_end != std::string_view::npos) what.remove_prefix(condition_end + 11);
  }
  while (!what.empty() && (what.back() == '\n' || what.back() == ' ')) what.remove_suffix(1);
  return std::string(what);
}

// Text with nlohmann's JSON escaping; invalid UTF-8 is replaced rather than thrown on, so a bad
// byte in a request becomes a grammar that fails to match it, not an exception of the wrong type.
std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string structural_tag(Json format) {
  return dump(Json{{"type", "structural_tag"}, {"format", std::move(format)}});
}

// A tool call's text around the function's name and arguments, as the chat templates render it,
// and what a name may not hold there.
struct ToolCallText {
  std::string_view before_name, after_name, end;
  std::string_view style;  // how xgrammar writes the arguments (JSONSchemaFormat's style)
  std::string_view forbidden_in_name;  // besides control characters
  std::string_view forbidden_description;
};

constexpr ToolCallText kHermesText = {
    .before_name = "<tool_call>\n{\"name\": \"",
    .after_name = "\", \"arguments\": ",
    .end = "}\n</tool_call>",
    .style = "json",
    .forbidden_in_name = "\"\\",
    .forbidden_description = "a quote, a backslash or a control character",
};
// NOTE: the "\n" after the name and before </function> is whitespace that the arguments' grammar
// allows around its parameters, not part of the tags: a call without arguments renders as
// "<function=NAME>\n</function>", one newline between the tags.
constexpr ToolCallText kQwen3CoderText = {
    .before_name = "<tool_call>\n<function=",
    .after_name = ">",
    .end = "</function>\n</tool_call>",
    .style = "qwen_xml",
    .forbidden_in_name = "<>{}\"' ",
    .forbidden_description = "'<', '>', a brace, a quote, whitespace or a control character",
};

const ToolCallText& tool_call_text(chat::ToolCallFormat format) {
  return format == chat::ToolCallFormat::kQwen3Coder ? kQwen3CoderText : kHermesText;
}

bool has_control_character(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) { return c >= 0 && c < 0x20; });
}

// The function whose parameters xgrammar cannot convert, found by converting them one at a time;
// only run once the whole tool-call grammar has failed, so that the error can name it.
std::string function_with_bad_parameters(const GrammarSpec& spec) {
  const Json tag = parse_json<Json>(spec.text, "a tool-call structural tag");
  for (const Json& call : tag.at("format").at("tags")) {
    try {
      xgrammar::Grammar::FromJSONSchema(dump(call.at("content").at("json_schema")));
    } catch (const std::exception&) {
      const std::string begin = call.at("begin");
      for (const ToolCallText* text : {&kHermesText, &kQwen3CoderText}) {
        if (begin.starts_with(text->before_name) && begin.ends_with(text->after_name)) {
          return begin.substr(text->before_name.size(),
                              begin.size() - text->before_name.size() - text->after_name.size());
        }
      }
    }
  }
  return "";
}

xgrammar::TokenizerInfo make_tokenizer_info(const Tokenizer& tokenizer,
                                            const GrammarCompilerOptions& options,
                                            int32_t vocab_size) {
  std::vector<std::string> vocab(static_cast<size_t>(tokenizer.vocab_size()));
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (!tokenizer.is_special(id)) vocab[id] = std::string(tokenizer.token_bytes(id));
  }
  return xgrammar::TokenizerInfo(vocab, xgrammar::VocabType::RAW, vocab_size,
                                 options.stop_token_ids);
}

}  // namespace

// ---- Specs --------------------------------------------------------------------------------------

GrammarSpec GrammarSpec::json() { return {GrammarKind::kJson, ""}; }

GrammarSpec GrammarSpec::json_schema(std::string schema, bool strict) {
  return {strict ? GrammarKind::kJsonSchemaStrict : GrammarKind::kJsonSchema, std::move(schema)};
}

GrammarSpec GrammarSpec::regex(std::string pattern) {
  return {GrammarKind::kRegex, std::move(pattern)};
}

GrammarSpec GrammarSpec::ebnf(std::string grammar) {
  return {GrammarKind::kEbnf, std::move(grammar)};
}

GrammarSpec GrammarSpec::choice(std::span<const std::string> choices) {
  RELAY_CHECK(!choices.empty(), "choice: the list of choices is empty");
  Json elements = Json::array();
  for (const std::string& choice : choices) {
    elements.push_back({{"type", "const_string"}, {"value", choice}});
  }
  return {GrammarKind::kChoice,
          structural_tag({{"type", "or"}, {"elements", std::move(elements)}})};
}

GrammarSpec GrammarSpec::tool_calls(std::span<const ToolFunction> functions, ToolCallCount count,
                                    chat::ToolCallFormat format) {
  RELAY_CHECK(!functions.empty(), "tool call: no functions to call");
  const ToolCallText& text = tool_call_text(format);
  const std::string_view format_name = chat::tool_call_format_name(format);
  std::unordered_set<std::string_view> names;
  Json tags = Json::array();
  for (const ToolFunction& function : functions) {
    const std::string& name = function.name;
    RELAY_CHECK(!name.empty(), "tool call: a function has an empty name");
    RELAY_CHECK(name.find_first_of(text.forbidden_in_name) == std::string::npos &&
                    !has_control_character(name),
                "tool call: function name '", name, "' contains ", text.forbidden_description,
                ", which the ", format_name, " tool-call format cannot hold");
    RELAY_CHECK(names.insert(name).second, "tool call: function '", name, "' is listed twice");
    Json parameters = Json{{"type", "object"}, {"properties", Json::object()}};
    if (!function.parameters.empty()) {
      try {
        parameters = parse_json<Json>(function.parameters, "the parameters");
      } catch (const JsonError& e) {
        fail(str("tool call: the parameters of function '", name, "' are not valid JSON (",
                 e.what(), ")"));
      }
      RELAY_CHECK(parameters.is_object(), "tool call: the parameters of function '", name,
                  "' are not a JSON schema object");
    }
    if (format == chat::ToolCallFormat::kQwen3Coder) {
      const auto properties = parameters.find("properties");
      if (properties != parameters.end() && properties->is_object()) {
        for (const auto& [parameter, schema] : properties->items()) {
          RELAY_CHECK(parameter.find_first_of("<>\r\n") == std::string::npos,
                      "tool call: parameter '", parameter, "' of function '", name,
                      "' contains '<', '>' or a line break, which the qwen3_coder tool-call format "
                      "cannot hold");
        }
      }
    }
    tags.push_back({{"type", "tag"},
                    {"begin", str(text.before_name, name, text.after_name)},
                    {"content",
                     {{"type", "json_schema"},
                      {"json_schema", std::move(parameters)},
                      {"style", text.style},
                      {"max_whitespace_cnt", kMaxJsonWhitespace}}},
                    {"end", text.end}});
  }
  return {GrammarKind::kToolCalls,
          structural_tag({{"type", "tags_with_separator"},
                          {"tags", std::move(tags)},
                          {"separator", "\n"},
                          {"at_least_one", true},
                          {"stop_after_first", count == ToolCallCount::kExactlyOne}})};
}

// ---- Compiler -----------------------------------------------------------------------------------

struct GrammarCompiler::Impl {
  using Result = std::shared_ptr<const CompiledGrammar>;
  struct Entry {
    std::string key;
    std::shared_future<Result> result;
    uint64_t generation;  // tells a failed compilation's entry from a newer one of the same key
  };

  int32_t vocab_size;
  size_t capacity;
  xgrammar::GrammarCompiler compiler;

  mutable std::mutex mutex;
  std::list<Entry> lru;  // most recently used first
  std::unordered_map<std::string_view, std::list<Entry>::iterator> index;  // views into lru keys
  uint64_t next_generation = 0;

  Impl(const xgrammar::TokenizerInfo& info, int32_t vocab_size,
       const GrammarCompilerOptions& options)
      : vocab_size(vocab_size),
        capacity(options.cache_capacity),
        compiler(info, options.compile_threads, /*cache_enabled=*/false) {}

  xgrammar::CompiledGrammar compile_uncached(const GrammarSpec& spec) {
    switch (spec.kind) {
      case GrammarKind::kJson:
        return compiler.CompileBuiltinJSONGrammar();
      case GrammarKind::kJsonSchema:
      case GrammarKind::kJsonSchemaStrict:
        // Any whitespace between tokens, as vLLM allows by default, but a bounded run of it.
        return compiler.CompileJSONSchema(spec.text, /*any_whitespace=*/true, std::nullopt,
                                          std::nullopt,
                                          spec.kind == GrammarKind::kJsonSchemaStrict,
                                          kMaxJsonWhitespace);
      case GrammarKind::kRegex:
        return compiler.CompileRegex(spec.text);
      case GrammarKind::kEbnf:
        return compiler.CompileGrammar(spec.text, "root");
      case GrammarKind::kChoice:
      case GrammarKind::kToolCalls:
        return compiler.CompileStructuralTag(spec.text);
    }
    fail(str("unknown grammar kind ", static_cast<int>(spec.kind)));
  }

  Result compile_checked(const GrammarSpec& spec) {
    try {
      return std::make_shared<const CompiledGrammar>(spec, compile_uncached(spec));
    } catch (const std::bad_alloc&) {
      throw;
    } catch (const std::exception& e) {
      std::string what = kind_name(spec.kind);
      if (spec.kind == GrammarKind::kToolCalls) {
        const std::string function = function_with_bad_parameters(spec);
        if (!function.empty()) what = str("parameters of function '", function, "'");
      }
      fail(str("invalid ", what, ": ", xgrammar_message(e.what())));
    }
  }

  void erase(std::list<Entry>::iterator it) {
    index.erase(it->key);
    lru.erase(it);
  }
};

GrammarCompiler::GrammarCompiler(const Tokenizer& tokenizer,
                                 const GrammarCompilerOptions& options) {
  const int32_t vocab_size = options.vocab_size == 0 ? tokenizer.vocab_size() : options.vocab_size;
  RELAY_CHECK(vocab_size >= tokenizer.vocab_size(), "grammar vocabulary: the model's vocab_size ",
              vocab_size, " is smaller than the tokenizer's ", tokenizer.vocab_size(), " tokens");
  RELAY_CHECK(!options.stop_token_ids.empty(), "grammar vocabulary: no stop token ids");
  for (int32_t id : options.stop_token_ids) {
    RELAY_CHECK(id >= 0 && id < vocab_size, "grammar vocabulary: stop token id ", id,
                " is outside the vocabulary [0, ", vocab_size, ")");
  }
  RELAY_CHECK(options.cache_capacity >= 1, "grammar compiler: cache_capacity must be at least 1");
  RELAY_CHECK(options.compile_threads >= 1, "grammar compiler: compile_threads must be at least 1");
  impl_ = std::make_unique<Impl>(make_tokenizer_info(tokenizer, options, vocab_size), vocab_size,
                                 options);
}

GrammarCompiler::~GrammarCompiler() = default;

int32_t GrammarCompiler::vocab_size() const { return impl_->vocab_size; }

size_t GrammarCompiler::cache_size() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->lru.size();
}

std::shared_ptr<const CompiledGrammar> GrammarCompiler::compile(const GrammarSpec& spec) {
  Impl& c = *impl_;
  std::string key = str(static_cast<int>(spec.kind), ':', spec.text);
  std::promise<Impl::Result> promise;
  std::shared_future<Impl::Result> result;
  uint64_t generation = 0;
  bool compile_here = false;
  {
    std::lock_guard lock(c.mutex);
    if (const auto it = c.index.find(key); it != c.index.end()) {
      c.lru.splice(c.lru.begin(), c.lru, it->second);
      result = it->second->result;
    } else {
      result = promise.get_future().share();
      generation = c.next_generation++;
      c.lru.push_front(Impl::Entry{std::move(key), result, generation});
      c.index.emplace(c.lru.front().key, c.lru.begin());
      // An evicted entry still being compiled lives on in its waiters' futures.
      while (c.lru.size() > c.capacity) c.erase(std::prev(c.lru.end()));
      compile_here = true;
    }
  }
  if (compile_here) {
    try {
      promise.set_value(c.compile_checked(spec));
    } catch (...) {
      promise.set_exception(std::current_exception());
      std::lock_guard lock(c.mutex);
      const auto it = std::find_if(c.lru.begin(), c.lru.end(), [&](const Impl::Entry& e) {
        return e.generation == generation;
      });
      if (it != c.lru.end()) c.erase(it);
    }
  }
  return result.get();
}

// ---- Matcher ------------------------------------------------------------------------------------

// The xgrammar matcher holds its own reference to the compiled grammar's tables.
struct GrammarMatcher::Impl {
  xgrammar::GrammarMatcher matcher;
  int32_t vocab_size;
};

GrammarMatcher::GrammarMatcher(const CompiledGrammar& grammar)
    : impl_(std::make_unique<Impl>(Impl{xgrammar::GrammarMatcher(grammar.xgrammar()),
                                        grammar.xgrammar().GetTokenizerInfo().GetVocabSize()})) {}

GrammarMatcher::~GrammarMatcher() = default;
GrammarMatcher::GrammarMatcher(GrammarMatcher&&) noexcept = default;
GrammarMatcher& GrammarMatcher::operator=(GrammarMatcher&&) noexcept = default;

int32_t GrammarMatcher::vocab_size() const { return impl_->vocab_size; }

void GrammarMatcher::fill_next_token_bitmask(std::span<uint32_t> bitmask) {
  const size_t num_words = token_bitmask_words(impl_->vocab_size);
  RELAY_CHECK(bitmask.size() == num_words, "token bitmask: ", bitmask.size(),
              " words given, the vocabulary of ", impl_->vocab_size, " tokens needs ", num_words);
  RELAY_CHECK(!impl_->matcher.IsTerminated(),
              "grammar matcher: asked for the next tokens after a stop token");
  int64_t shape[1] = {static_cast<int64_t>(num_words)};
  DLTensor tensor{};
  tensor.data = bitmask.data();
  tensor.device = DLDevice{kDLCPU, 0};
  tensor.ndim = 1;
  tensor.dtype = xgrammar::GetBitmaskDLType();  // int32: the same bits as Relay's uint32 words
  tensor.shape = shape;
  impl_->matcher.FillNextTokenBitmask(&tensor);
}

bool GrammarMatcher::accept_token(int32_t token_id) {
  RELAY_CHECK(token_id >= 0 && token_id < impl_->vocab_size, "grammar matcher: token id ", token_id,
              " is outside the vocabulary [0, ", impl_->vocab_size, ")");
  if (impl_->matcher.IsTerminated()) return false;
  if (!impl_->matcher.AcceptToken(token_id)) return false;
  ++num_accepted_tokens_;
  return true;
}

bool GrammarMatcher::is_completed() const {
  return impl_->matcher.IsTerminated() || impl_->matcher.IsCompleted();
}

bool GrammarMatcher::is_terminated() const { return impl_->matcher.IsTerminated(); }

void GrammarMatcher::rollback(int num_tokens) {
  RELAY_CHECK(num_tokens >= 0 && num_tokens <= num_accepted_tokens_,
              "grammar matcher: cannot roll back ", num_tokens, " tokens, ", num_accepted_tokens_,
              " were accepted");
  impl_->matcher.Rollback(num_tokens);
  num_accepted_tokens_ -= num_tokens;
}

}  // namespace relay

// Jinja lexer with transformers' whitespace settings (trim_blocks=True, lstrip_blocks=True).
//
// The token stream is what jinja2.lexer produces, and whitespace handling follows its rules exactly,
// because chat templates are written around them and a single stray "\n" changes the prompt:
// - the source's newlines are normalised to "\n" and one trailing newline is dropped
//   (keep_trailing_newline=False);
// - `{%-`, `{{-`, `{#-` strip all whitespace before the tag; `-%}`, `-}}`, `-#}` all after it;
// - trim_blocks: a block or comment end eats one following "\n" (unless written `+%}`);
// - lstrip_blocks: spaces and tabs between the start of a line and a block or comment tag are removed
//   (unless written `{%+`); variable tags `{{` are never lstripped;
// - inside `{{ }}` and `{% %}`, a closing `}}`/`%}` while brackets are open is an operator, not the end.
// Comments vanish here. `{% raw %}` sections come out as data.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace relay::chat::jinja {

enum class TokenType : uint8_t {
  kData,           // template text, already whitespace-controlled
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,
  kString,         // value holds the decoded literal
  kInteger,
  kFloat,
  kOperator,       // value holds the operator text: "+", "//", "==", "(", ...
  kEnd,
};

struct Token {
  TokenType type;
  std::string value;
  int line = 1;
  int64_t int_value = 0;
  double float_value = 0.0;
};

// Throws relay::Error("chat template syntax error at line N: ...") on malformed input.
std::vector<Token> tokenize(std::string_view source);

// Human-readable token description for parser errors ("end of statement block", "'foo'").
std::string describe(const Token& t);

}  // namespace relay::chat::jinja

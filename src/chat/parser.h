// Jinja parser: tokens -> syntax tree, following jinja2.parser's grammar and operator precedence
// (filters and `is` tests bind tighter than arithmetic, `not` looser than comparisons, conditional
// expressions loosest). Supported statements: if/elif/else, for (with `if` filter and else), set
// (plain, tuple, namespace attribute, block), macro, break, continue; raw is handled by the lexer.
// Anything else is a syntax error naming the tag and its line.
#pragma once

#include <string_view>

#include "chat/ast.h"
#include "chat/builtins.h"

namespace relay::chat::jinja {

// Throws relay::Error("chat template syntax error at line N: ...").
Program parse(std::string_view source);

}  // namespace relay::chat::jinja

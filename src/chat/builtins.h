// Jinja's built-in filters, tests and global functions, as transformers' chat environment has them.
//
// Filters and tests are looked up by name once, at parse time (an unknown name is a syntax error, as
// in jinja2). Globals: range (capped at the sandbox's MAX_RANGE), namespace, dict, raise_exception and
// strftime_now, the last two being transformers' additions. `tojson` is transformers' override
// (json.dumps with ensure_ascii=False and optional indent/separators/sort_keys), not jinja2's
// HTML-escaping one.
#pragma once

#include <string>
#include <string_view>

#include "chat/ast.h"
#include "core/error.h"

namespace relay::chat::jinja {

// Thrown by raise_exception(message): the template rejected its input on purpose.
class RaisedByTemplate : public relay::Error {
 public:
  using relay::Error::Error;
};

FilterFn find_filter(std::string_view name);
TestFn find_test(std::string_view name);
// True for jinja2 filters this interpreter leaves out, so the error can say "not supported".
bool is_unsupported_builtin_filter(std::string_view name);

// The global functions every render sees (below the caller's context variables).
Dict make_globals();

}  // namespace relay::chat::jinja

// Python operators and attribute access on interpreter values, with jinja2's sandbox rules.
//
// These are the semantics the evaluator defers to: `a + b`, `a < b`, `x in y`, `obj.attr`, `obj[key]`,
// slices, iteration and the str/dict/list methods templates call. Mistakes raise relay::Error with
// Python's wording ("unsupported operand type(s) for +: 'int' and 'str'"); missing attributes and
// keys yield Undefined, as jinja2's getattr/getitem do; operations on Undefined raise its message.
// Methods that would mutate a list or dict are refused, as ImmutableSandboxedEnvironment does.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "chat/value.h"

namespace relay::chat::jinja {

Value get_attribute(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
// obj[start:stop:step]; undefined bounds are "omitted".
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
// Calls obj.name(args) when obj has such a method; nullopt when it has not.
std::optional<Value> call_method(const Value& obj, std::string_view name, const CallArgs& args);

// op in + - * / // % **
Value binary_op(std::string_view op, const Value& a, const Value& b);
Value negate(const Value& v);
// op in == != < <= > >= in "not in"
bool compare(std::string_view op, const Value& a, const Value& b);
bool contains(const Value& container, const Value& item);
// The items a for loop visits: list items, dict keys, string characters; Undefined is empty.
std::vector<Value> iterate(const Value& v);
// len(v); Undefined has length 0.
int64_t length(const Value& v);

// Argument access for built-in callables: positional index `pos` or keyword `name`.
const Value* find_arg(const CallArgs& args, size_t pos, std::string_view name);
// Rejects more positional arguments than `max_positional` or keywords outside `names`.
void check_args(const CallArgs& args, std::string_view callee, size_t max_positional,
                std::initializer_list<std::string_view> names);
// Python-style integer/string/bool extraction with an error naming the callee and argument.
int64_t int_arg(const Value& v, std::string_view callee, std::string_view arg);
std::string str_arg(const Value& v, std::string_view callee, std::string_view arg);

}  // namespace relay::chat::jinja

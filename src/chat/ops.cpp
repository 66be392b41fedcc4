// Python operators, attribute access and methods on interpreter values (see ops.h).
#include "chat/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "chat/pystr.h"
#include "core/error.h"

namespace relay::chat::jinja {
namespace {

// Largest string or list a single operation may build (`'x' * n`, `a + b`), a guard against
// templates or inputs that would exhaust memory.
constexpr size_t kMaxBuiltBytes = size_t{256} << 20;

[[noreturn]] void type_error(const std::string& message) { fail(message); }

std::string object_name(const Value& v) { return str("'", type_name(v), " object'"); }

Value missing_attribute(const Value& obj, const std::string& name) {
  return Value::undefined(str(object_name(obj), " has no attribute '", name, "'"));
}

Value unsafe_attribute(const Value& obj, const std::string& name) {
  return Value::undefined(str("access to attribute '", name, "' of '", type_name(obj), "' object is unsafe."));
}

bool is_string_method(std::string_view name) {
  static constexpr std::string_view kNames[] = {
      "startswith", "endswith", "strip", "lstrip", "rstrip", "split", "rsplit", "replace", "upper", "lower",
      "title", "capitalize", "find", "count", "join", "isdigit", "isalpha", "isalnum", "isspace"};
  return std::find(std::begin(kNames), std::end(kNames), name) != std::end(kNames);
}

bool is_mutating_method(std::string_view name) {
  static constexpr std::string_view kNames[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort",
                                                "clear", "popitem", "setdefault", "update"};
  return std::find(std::begin(kNames), std::end(kNames), name) != std::end(kNames);
}

bool has_method(const Value& obj, std::string_view name) {
  if (obj.is_string()) return is_string_method(name);
  if (obj.is_dict()) return name == "items" || name == "keys" || name == "values" || name == "get";
  if (obj.is_sequence()) return name == "index" || name == "count";
  return false;
}

// Python's slice.indices(): clamps start/stop for a sequence of `n` items.
struct SliceRange {
  int64_t start, stop, step;
};

SliceRange slice_range(int64_t n, const Value& start, const Value& stop, const Value& step) {
  auto bound = [](const Value& v, std::string_view what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    if (!v.is_integral()) type_error(str("slice ", what, " must be an integer or None, not ", type_name(v)));
    return v.as_int();
  };
  const int64_t st = bound(step, "step").value_or(1);
  if (st == 0) type_error("slice step cannot be zero");
  const int64_t lower = st > 0 ? 0 : -1;
  const int64_t upper = st > 0 ? n : n - 1;
  auto clamp = [&](std::optional<int64_t> b, int64_t fallback) {
    if (!b) return fallback;
    int64_t x = *b;
    if (x < 0) {
      x += n;
      if (x < lower) x = lower;
    } else if (x > upper) {
      x = upper;
    }
    return x;
  };
  return {clamp(bound(start, "start"), st > 0 ? lower : upper), clamp(bound(stop, "stop"), st > 0 ? upper : lower),
          st};
}

template <typename F>
void for_slice(const SliceRange& r, F f) {
  if (r.step > 0) {
    for (int64_t i = r.start; i < r.stop; i += r.step) f(i);
  } else {
    for (int64_t i = r.start; i > r.stop; i += r.step) f(i);
  }
}

std::optional<std::string> optional_str(const Value* v, std::string_view callee, std::string_view arg) {
  if (v == nullptr || v->is_none()) return std::nullopt;
  return str_arg(*v, callee, arg);
}

// startswith/endswith: prefix may be a string or a tuple of strings; start/end slice first.
bool affix_match(const std::string& s, const CallArgs& args, bool prefix) {
  const std::string_view callee = prefix ? "str.startswith" : "str.endswith";
  check_args(args, callee, 3, {});
  const Value* what = find_arg(args, 0, "");
  if (what == nullptr) type_error(str(callee, "() takes at least 1 argument (0 given)"));
  std::string subject = s;
  if (args.positional.size() > 1) {
    const Value end = args.positional.size() > 2 ? args.positional[2] : Value::none();
    subject = slice(Value(s), args.positional[1], end, Value::none()).as_string();
  }
  std::vector<std::string> candidates;
  if (what->is_list() && what->as_list().is_tuple) {
    for (const Value& c : what->as_list().items) candidates.push_back(str_arg(c, callee, "prefix"));
  } else {
    if (!what->is_string()) {
      type_error(str(callee, " first arg must be str or a tuple of str, not ", type_name(*what)));
    }
    candidates.push_back(what->as_string());
  }
  for (const std::string& c : candidates) {
    if (c.size() > subject.size()) continue;
    if (prefix ? subject.compare(0, c.size(), c) == 0 : subject.compare(subject.size() - c.size(), c.size(), c) == 0) {
      return true;
    }
  }
  return false;
}

template <typename Pred>
bool all_code_points(const std::string& s, Pred pred) {
  if (s.empty()) return false;
  for (char32_t cp : pystr::decode(s)) {
    if (!pred(cp)) return false;
  }
  return true;
}

Value string_list(std::vector<std::string> parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (auto& p : parts) items.emplace_back(std::move(p));
  return Value::list(std::move(items));
}

Value call_string_method(const std::string& s, std::string_view name, const CallArgs& args) {
  const std::string callee = str("str.", name);
  if (name == "startswith") return Value(affix_match(s, args, true));
  if (name == "endswith") return Value(affix_match(s, args, false));
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    check_args(args, callee, 1, {});
    const auto chars = optional_str(find_arg(args, 0, ""), callee, "chars");
    return Value(pystr::strip(s, chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    check_args(args, callee, 2, {"sep", "maxsplit"});
    const auto sep = optional_str(find_arg(args, 0, "sep"), callee, "sep");
    if (sep && sep->empty()) type_error("empty separator");
    const Value* max = find_arg(args, 1, "maxsplit");
    const int64_t max_split = max ? int_arg(*max, callee, "maxsplit") : -1;
    return string_list(name == "split" ? pystr::split(s, sep, max_split) : pystr::rsplit(s, sep, max_split));
  }
  if (name == "replace") {
    check_args(args, callee, 3, {"count"});
    const Value* old_text = find_arg(args, 0, "");
    const Value* new_text = find_arg(args, 1, "");
    if (old_text == nullptr || new_text == nullptr) type_error("str.replace() takes at least 2 arguments");
    const Value* count = find_arg(args, 2, "count");
    return Value(pystr::replace(s, str_arg(*old_text, callee, "old"), str_arg(*new_text, callee, "new"),
                                count ? int_arg(*count, callee, "count") : -1));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    check_args(args, callee, 0, {});
    if (name == "upper") return Value(pystr::upper(s));
    if (name == "lower") return Value(pystr::lower(s));
    if (name == "title") return Value(pystr::title(s));
    return Value(pystr::capitalize(s));
  }
  if (name == "find" || name == "count") {
    check_args(args, callee, 1, {});
    const Value* sub = find_arg(args, 0, "");
    if (sub == nullptr) type_error(str(callee, "() takes at least 1 argument (0 given)"));
    const std::string needle = str_arg(*sub, callee, "sub");
    return Value(name == "find" ? pystr::find(s, needle) : pystr::count(s, needle));
  }
  if (name == "join") {
    check_args(args, callee, 1, {});
    const Value* items = find_arg(args, 0, "");
    if (items == nullptr) type_error("str.join() takes exactly one argument (0 given)");
    std::string out;
    bool first = true;
    for (const Value& item : iterate(*items)) {
      if (!item.is_string()) type_error(str("sequence item: expected str instance, ", type_name(item), " found"));
      if (!first) out += s;
      first = false;
      out += item.as_string();
    }
    return Value(std::move(out));
  }
  check_args(args, callee, 0, {});
  if (name == "isspace") return Value(all_code_points(s, pystr::is_space));
  // isdigit/isalpha/isalnum on ASCII classes, which is all templates test.
  auto digit = [](char32_t c) { return c >= '0' && c <= '9'; };
  auto alpha = [](char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); };
  if (name == "isdigit") return Value(all_code_points(s, digit));
  if (name == "isalpha") return Value(all_code_points(s, alpha));
  return Value(all_code_points(s, [&](char32_t c) { return digit(c) || alpha(c); }));
}

Value call_dict_method(const Dict& d, std::string_view name, const CallArgs& args) {
  const std::string callee = str("dict.", name);
  if (name == "get") {
    check_args(args, callee, 2, {});
    const Value* key = find_arg(args, 0, "");
    if (key == nullptr) type_error("dict.get expected at least 1 argument, got 0");
    const Value* def = find_arg(args, 1, "");
    const Value* found = key->is_string() ? d.find(key->as_string()) : nullptr;
    if (found != nullptr) return *found;
    return def ? *def : Value::none();
  }
  check_args(args, callee, 0, {});
  std::vector<Value> out;
  out.reserve(d.entries.size());
  for (const auto& [k, v] : d.entries) {
    if (name == "items") {
      out.push_back(Value::list({Value(k), v}, true));
    } else if (name == "keys") {
      out.emplace_back(k);
    } else {
      out.push_back(v);
    }
  }
  return Value::list(std::move(out));
}

Value call_list_method(const List& l, std::string_view name, const CallArgs& args) {
  check_args(args, str("list.", name), 1, {});
  const Value* x = find_arg(args, 0, "");
  if (x == nullptr) type_error(str("list.", name, "() takes exactly one argument (0 given)"));
  int64_t count = 0;
  for (size_t i = 0; i < l.items.size(); ++i) {
    if (!equals(l.items[i], *x)) continue;
    if (name == "index") return Value(static_cast<int64_t>(i));
    ++count;
  }
  if (name == "index") type_error(str(to_repr(*x), " is not in list"));
  return Value(count);
}

// 64-bit integer arithmetic that refuses to wrap (Python's ints would grow instead).
int64_t checked_add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) type_error("integer overflow: the result does not fit in 64 bits");
  return r;
}
int64_t checked_sub(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_sub_overflow(a, b, &r)) type_error("integer overflow: the result does not fit in 64 bits");
  return r;
}
int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) type_error("integer overflow: the result does not fit in 64 bits");
  return r;
}

int64_t floor_div(int64_t a, int64_t b) {
  if (a == std::numeric_limits<int64_t>::min() && b == -1) type_error("integer overflow in //");
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t py_mod(int64_t a, int64_t b) {
  if (b == -1) return 0;
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

Value repeat(const Value& seq, int64_t n) {
  n = std::max<int64_t>(n, 0);
  if (seq.is_string() ? seq.as_string().empty() : seq.as_list().items.empty()) n = 0;
  if (seq.is_string()) {
    const size_t bytes = seq.as_string().size();
    RELAY_CHECK(bytes == 0 || static_cast<size_t>(n) <= kMaxBuiltBytes / bytes, "string repetition would build more than ",
                kMaxBuiltBytes, " bytes");
    std::string out;
    out.reserve(bytes * static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out += seq.as_string();
    return Value(std::move(out));
  }
  const List& l = seq.as_list();
  RELAY_CHECK(l.items.empty() || static_cast<size_t>(n) <= kMaxBuiltBytes / 16 / l.items.size(),
              "list repetition would build too many items");
  std::vector<Value> out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), l.items.begin(), l.items.end());
  return Value::list(std::move(out), l.is_tuple);
}

[[noreturn]] void unsupported_operands(std::string_view op, const Value& a, const Value& b) {
  type_error(str("unsupported operand type(s) for ", op, ": '", type_name(a), "' and '", type_name(b), "'"));
}

// Python's ordering: numbers by value, strings by code point (= UTF-8 byte order), sequences
// lexicographically. Returns <0, 0, >0.
int order(std::string_view op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    const int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_sequence() && b.is_sequence() && a.as_list().is_tuple == b.as_list().is_tuple) {
    const auto& x = a.as_list().items;
    const auto& y = b.as_list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return order(op, x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  type_error(str("'", op, "' not supported between instances of '", type_name(a), "' and '", type_name(b), "'"));
}

}  // namespace

const Value* find_arg(const CallArgs& args, size_t pos, std::string_view name) {
  if (pos < args.positional.size()) return &args.positional[pos];
  if (name.empty()) return nullptr;
  for (const auto& [k, v] : args.keyword) {
    if (k == name) return &v;
  }
  return nullptr;
}

void check_args(const CallArgs& args, std::string_view callee, size_t max_positional,
                std::initializer_list<std::string_view> names) {
  if (args.positional.size() > max_positional) {
    type_error(str(callee, "() takes at most ", max_positional, " positional argument(s) (", args.positional.size(),
                   " given)"));
  }
  for (const auto& [k, v] : args.keyword) {
    if (std::find(names.begin(), names.end(), k) == names.end()) {
      type_error(str(callee, "() got an unexpected keyword argument '", k, "'"));
    }
  }
}

int64_t int_arg(const Value& v, std::string_view callee, std::string_view arg) {
  if (!v.is_integral()) type_error(str(callee, "(): argument '", arg, "' must be an integer, not ", type_name(v)));
  return v.as_int();
}

std::string str_arg(const Value& v, std::string_view callee, std::string_view arg) {
  if (v.is_undefined()) fail_undefined(v);
  if (!v.is_string()) type_error(str(callee, "(): argument '", arg, "' must be str, not ", type_name(v)));
  return v.as_string();
}

Value get_attribute(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (has_method(obj, name)) {
    return Value::function(str(type_name(obj), ".", name), [obj, name](const CallArgs& args) {
      return *call_method(obj, name, args);
    });
  }
  if ((obj.is_list() || obj.is_dict()) && is_mutating_method(name)) return unsafe_attribute(obj, name);
  if (obj.is_dict()) {
    const Value* v = obj.as_dict().find(name);
    return v ? *v : missing_attribute(obj, name);
  }
  if (obj.is_namespace()) {
    const Value* v = obj.as_namespace().attrs.find(name);
    return v ? *v : missing_attribute(obj, name);
  }
  return missing_attribute(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (obj.is_dict() && key.is_string()) {
    const Value* v = obj.as_dict().find(key.as_string());
    if (v) return *v;
  } else if ((obj.is_sequence() || obj.is_string()) && key.is_integral()) {
    const int64_t n = obj.is_list() ? static_cast<int64_t>(obj.as_list().items.size()) : length(obj);
    int64_t i = key.as_int();
    if (i < 0) i += n;
    if (i >= 0 && i < n) {
      if (obj.is_list()) return obj.as_list().items[static_cast<size_t>(i)];
      return Value(pystr::encode(std::u32string(1, pystr::decode(obj.as_string())[static_cast<size_t>(i)])));
    }
  }
  // jinja2: a failed subscript with a string key falls back to attribute lookup.
  if (key.is_string()) return get_attribute(obj, key.as_string());
  return Value::undefined(str(object_name(obj), " has no element ", to_repr(key)));
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (obj.is_sequence()) {
    const List& l = obj.as_list();
    std::vector<Value> out;
    for_slice(slice_range(static_cast<int64_t>(l.items.size()), start, stop, step),
              [&](int64_t i) { out.push_back(l.items[static_cast<size_t>(i)]); });
    return Value::list(std::move(out), l.is_tuple);
  }
  if (obj.is_string()) {
    const std::u32string cps = pystr::decode(obj.as_string());
    std::u32string out;
    for_slice(slice_range(static_cast<int64_t>(cps.size()), start, stop, step),
              [&](int64_t i) { out.push_back(cps[static_cast<size_t>(i)]); });
    return Value(pystr::encode(out));
  }
  // jinja compiles slices to Python's own subscript, so this raises rather than giving Undefined.
  type_error(str("'", type_name(obj), "' object is not subscriptable"));
}

std::optional<Value> call_method(const Value& obj, std::string_view name, const CallArgs& args) {
  if (!has_method(obj, name)) return std::nullopt;
  if (obj.is_string()) return call_string_method(obj.as_string(), name, args);
  if (obj.is_dict()) return call_dict_method(obj.as_dict(), name, args);
  return call_list_method(obj.as_list(), name, args);
}

Value binary_op(std::string_view op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  const bool ints = a.is_integral() && b.is_integral();
  const bool nums = a.is_number() && b.is_number();
  if (op == "+") {
    if (ints) return Value(checked_add(a.as_int(), b.as_int()));
    if (nums) return Value(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) {
      RELAY_CHECK(a.as_string().size() + b.as_string().size() <= kMaxBuiltBytes, "string concatenation would build more than ",
                  kMaxBuiltBytes, " bytes");
      return Value(a.as_string() + b.as_string());
    }
    if (a.is_sequence() && b.is_sequence() && a.as_list().is_tuple == b.as_list().is_tuple) {
      std::vector<Value> out = a.as_list().items;
      out.insert(out.end(), b.as_list().items.begin(), b.as_list().items.end());
      return Value::list(std::move(out), a.as_list().is_tuple);
    }
    if (a.is_string()) type_error(str("can only concatenate str (not \"", type_name(b), "\") to str"));
    if (a.is_list()) type_error(str("can only concatenate list (not \"", type_name(b), "\") to list"));
    unsupported_operands(op, a, b);
  }
  if (op == "-") {
    if (ints) return Value(checked_sub(a.as_int(), b.as_int()));
    if (nums) return Value(a.as_double() - b.as_double());
    unsupported_operands(op, a, b);
  }
  if (op == "*") {
    if (ints) return Value(checked_mul(a.as_int(), b.as_int()));
    if (nums) return Value(a.as_double() * b.as_double());
    if ((a.is_string() || a.is_sequence()) && b.is_integral()) return repeat(a, b.as_int());
    if ((b.is_string() || b.is_sequence()) && a.is_integral()) return repeat(b, a.as_int());
    unsupported_operands(op, a, b);
  }
  if (op == "/") {
    if (!nums) unsupported_operands(op, a, b);
    if (b.as_double() == 0.0) type_error("division by zero");
    return Value(a.as_double() / b.as_double());
  }
  if (op == "//" || op == "%") {
    if (a.is_string() && op == "%") type_error("printf-style string formatting (str % args) is not supported");
    if (!nums) unsupported_operands(op, a, b);
    if (b.as_double() == 0.0) type_error(op == "//" ? "integer division or modulo by zero" : "modulo by zero");
    if (ints) return Value(op == "//" ? floor_div(a.as_int(), b.as_int()) : py_mod(a.as_int(), b.as_int()));
    // CPython's float_divmod, so signs and rounding match.
    const double x = a.as_double(), y = b.as_double();
    double m = std::fmod(x, y);
    if (m != 0.0) {
      if ((y < 0) != (m < 0)) m += y;
    } else {
      m = std::copysign(0.0, y);
    }
    if (op == "%") return Value(m);
    const double div = (x - m) / y;
    if (div == 0.0) return Value(std::copysign(0.0, x / y));
    double floor_div_result = std::floor(div);
    if (div - floor_div_result > 0.5) floor_div_result += 1.0;
    return Value(floor_div_result);
  }
  if (op == "**") {
    if (!nums) unsupported_operands(op, a, b);
    if (ints && b.as_int() >= 0) {
      int64_t result = 1, base = a.as_int();
      for (int64_t e = b.as_int(); e > 0; e >>= 1) {
        if (e & 1) result = checked_mul(result, base);
        if (e > 1) base = checked_mul(base, base);
      }
      return Value(result);
    }
    return Value(std::pow(a.as_double(), b.as_double()));
  }
  type_error(str("unknown operator ", op));
}

Value negate(const Value& v) {
  if (v.is_undefined()) fail_undefined(v);
  if (v.is_integral()) return Value(checked_sub(0, v.as_int()));
  if (v.is_float()) return Value(-v.as_double());
  type_error(str("bad operand type for unary -: '", type_name(v), "'"));
}

bool compare(std::string_view op, const Value& a, const Value& b) {
  if (op == "==") return equals(a, b);
  if (op == "!=") return !equals(a, b);
  if (op == "in") return contains(b, a);
  if (op == "not in") return !contains(b, a);
  const int c = order(op, a, b);
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  return c >= 0;
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined: return false;
    case Value::Kind::kString:
      if (!item.is_string()) {
        type_error(str("'in <string>' requires string as left operand, not ", type_name(item)));
      }
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kList:
      return std::any_of(container.as_list().items.begin(), container.as_list().items.end(),
                         [&](const Value& v) { return equals(v, item); });
    case Value::Kind::kDict:
      return item.is_string() && container.as_dict().find(item.as_string()) != nullptr;
    default:
      type_error(str("argument of type '", type_name(container), "' is not iterable"));
  }
}

std::vector<Value> iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return {};
    case Value::Kind::kList: return v.as_list().items;
    case Value::Kind::kDict: {
      std::vector<Value> keys;
      keys.reserve(v.as_dict().entries.size());
      for (const auto& [k, e] : v.as_dict().entries) keys.emplace_back(k);
      return keys;
    }
    case Value::Kind::kString: {
      std::vector<Value> chars;
      for (char32_t cp : pystr::decode(v.as_string())) chars.emplace_back(pystr::encode(std::u32string(1, cp)));
      return chars;
    }
    default:
      type_error(str("'", type_name(v), "' object is not iterable"));
  }
}

int64_t length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return 0;
    case Value::Kind::kString: return static_cast<int64_t>(pystr::length(v.as_string()));
    case Value::Kind::kList:
      if (v.is_generator()) type_error("object of type 'generator' has no len()");
      return static_cast<int64_t>(v.as_list().items.size());
    case Value::Kind::kDict: return static_cast<int64_t>(v.as_dict().entries.size());
    default:
      type_error(str("object of type '", type_name(v), "' has no len()"));
  }
}

}  // namespace relay::chat::jinja

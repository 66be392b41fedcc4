// Built-in filters, tests and globals (see builtins.h). Each filter mirrors its jinja2.filters
// counterpart's argument order and edge cases (Undefined input, `default` with boolean=true, ...).
#include "chat/builtins.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <unordered_map>

#include "chat/ops.h"
#include "chat/pystr.h"

namespace relay::chat::jinja {
namespace {

// ImmutableSandboxedEnvironment's MAX_RANGE.
constexpr int64_t kMaxRange = 100000;
// find_arg position for keyword-only arguments.
constexpr size_t kKeywordOnly = SIZE_MAX;

const Value* arg(const CallArgs& a, size_t pos, std::string_view name) { return find_arg(a, pos, name); }

Value arg_or(const CallArgs& a, size_t pos, std::string_view name, Value fallback) {
  const Value* v = find_arg(a, pos, name);
  return v ? *v : std::move(fallback);
}

// jinja2's make_attrgetter: "a.b.0" walks attributes/items; integer parts index sequences.
Value get_path(const Value& item, const std::string& path) {
  Value cur = item;
  for (const std::string& part : pystr::split(path, std::string("."), -1)) {
    const bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    cur = get_item(cur, numeric ? Value(static_cast<int64_t>(std::stoll(part))) : Value(part));
  }
  return cur;
}

// ---- filters ----

Value f_default(const Value& v, const CallArgs& a) {
  check_args(a, "default", 2, {"default_value", "boolean"});
  const Value fallback = arg_or(a, 0, "default_value", Value(""));
  const bool boolean = truthy(arg_or(a, 1, "boolean", Value(false)));
  if (v.is_undefined() || (boolean && !truthy(v))) return fallback;
  return v;
}

Value f_length(const Value& v, const CallArgs& a) {
  check_args(a, "length", 0, {});
  return Value(length(v));
}

Value f_first(const Value& v, const CallArgs& a) {
  check_args(a, "first", 0, {});
  if (v.is_list()) {
    if (!v.as_list().items.empty()) return v.as_list().items.front();
  } else {
    std::vector<Value> items = iterate(v);
    if (!items.empty()) return items.front();
  }
  return Value::undefined("No first item, sequence was empty.");
}

Value f_last(const Value& v, const CallArgs& a) {
  check_args(a, "last", 0, {});
  if (v.is_generator()) fail("'generator' object is not reversible");
  if (v.is_list()) {
    if (!v.as_list().items.empty()) return v.as_list().items.back();
  } else {
    std::vector<Value> items = iterate(v);
    if (!items.empty()) return items.back();
  }
  return Value::undefined("No last item, sequence was empty.");
}

Value f_list(const Value& v, const CallArgs& a) {
  check_args(a, "list", 0, {});
  return Value::list(iterate(v));
}

Value f_items(const Value& v, const CallArgs& a) {
  check_args(a, "items", 0, {});
  if (v.is_undefined()) return Value::list({});
  if (!v.is_dict()) fail("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [k, e] : v.as_dict().entries) out.push_back(Value::list({Value(k), e}, true));
  return Value::generator(std::move(out));
}

Value f_join(const Value& v, const CallArgs& a) {
  check_args(a, "join", 2, {"d", "attribute"});
  const std::string sep = to_str(arg_or(a, 0, "d", Value("")));
  const Value* attribute = arg(a, 1, "attribute");
  std::string out;
  bool first = true;
  for (const Value& item : iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += to_str(attribute && !attribute->is_none() ? get_path(item, to_str(*attribute)) : item);
  }
  return Value(std::move(out));
}

Value f_trim(const Value& v, const CallArgs& a) {
  check_args(a, "trim", 1, {"chars"});
  const Value* chars = arg(a, 0, "chars");
  std::optional<std::string> set;
  if (chars && !chars->is_none()) set = to_str(*chars);
  return Value(pystr::strip(to_str(v), set, true, true));
}

Value f_upper(const Value& v, const CallArgs& a) {
  check_args(a, "upper", 0, {});
  return Value(pystr::upper(to_str(v)));
}

Value f_lower(const Value& v, const CallArgs& a) {
  check_args(a, "lower", 0, {});
  return Value(pystr::lower(to_str(v)));
}

Value f_capitalize(const Value& v, const CallArgs& a) {
  check_args(a, "capitalize", 0, {});
  return Value(pystr::capitalize(to_str(v)));
}

// jinja's title: split before runs of [-\s({[<]; each piece's first char upper, rest lower.
Value f_title(const Value& v, const CallArgs& a) {
  check_args(a, "title", 0, {});
  const std::u32string cps = pystr::decode(to_str(v));
  auto is_break = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || pystr::is_space(c);
  };
  std::string out;
  size_t i = 0;
  while (i < cps.size()) {
    size_t j = i;
    const bool breaks = is_break(cps[i]);
    while (j < cps.size() && is_break(cps[j]) == breaks) ++j;
    const std::string piece = pystr::encode(std::u32string_view(cps).substr(i, j - i));
    if (breaks) {
      out += piece;
    } else {
      const std::string head = pystr::encode(std::u32string(1, cps[i]));
      out += pystr::upper(head) + pystr::lower(piece.substr(head.size()));
    }
    i = j;
  }
  return Value(std::move(out));
}

Value f_replace(const Value& v, const CallArgs& a) {
  check_args(a, "replace", 3, {"old", "new", "count"});
  const Value* old_text = arg(a, 0, "old");
  const Value* new_text = arg(a, 1, "new");
  if (!old_text || !new_text) fail("replace filter needs 'old' and 'new'");
  const Value* count = arg(a, 2, "count");
  return Value(pystr::replace(to_str(v), to_str(*old_text), to_str(*new_text),
                              count && !count->is_none() ? int_arg(*count, "replace", "count") : -1));
}

Value f_string(const Value& v, const CallArgs& a) {
  check_args(a, "string", 0, {});
  return v.is_string() ? v : Value(to_str(v));
}

Value f_escape(const Value& v, const CallArgs& a) {
  check_args(a, "escape", 0, {});
  std::string out;
  for (char c : to_str(v)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return Value(std::move(out));
}

// Python's int(str, base) for the `int` filter; nullopt when it would raise ValueError.
std::optional<int64_t> parse_int(std::string s, int base) {
  s = pystr::strip(s, std::nullopt, true, true);
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  if (s.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, base);
  if (errno != 0 || end != s.c_str() + s.size()) return std::nullopt;
  return static_cast<int64_t>(v);
}

std::optional<double> parse_float(const std::string& text) {
  const std::string s = pystr::strip(text, std::nullopt, true, true);
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return v;
}

Value f_int(const Value& v, const CallArgs& a) {
  check_args(a, "int", 2, {"default", "base"});
  const Value fallback = arg_or(a, 0, "default", Value(int64_t{0}));
  const int base = static_cast<int>(int_arg(arg_or(a, 1, "base", Value(int64_t{10})), "int", "base"));
  if (v.is_undefined()) fail_undefined(v);  // int(Undefined) raises in jinja
  if (v.is_integral()) return Value(v.as_int());
  if (v.is_float() && std::isfinite(v.as_double())) return Value(static_cast<int64_t>(v.as_double()));
  if (v.is_string()) {
    if (auto i = parse_int(v.as_string(), base)) return Value(*i);
    // jinja: "42.23"|int gives 42.
    if (auto f = parse_float(v.as_string()); f && std::isfinite(*f)) return Value(static_cast<int64_t>(*f));
  }
  return fallback;
}

Value f_float(const Value& v, const CallArgs& a) {
  check_args(a, "float", 1, {"default"});
  const Value fallback = arg_or(a, 0, "default", Value(0.0));
  if (v.is_undefined()) fail_undefined(v);  // float(Undefined) raises in jinja
  if (v.is_number()) return Value(v.as_double());
  if (v.is_string()) {
    if (auto f = parse_float(v.as_string())) return Value(*f);
  }
  return fallback;
}

Value f_abs(const Value& v, const CallArgs& a) {
  check_args(a, "abs", 0, {});
  if (v.is_integral()) return v.as_int() < 0 ? negate(Value(v.as_int())) : Value(v.as_int());
  if (v.is_float()) return Value(std::fabs(v.as_double()));
  fail(str("bad operand type for abs(): '", type_name(v), "'"));
}

Value f_round(const Value& v, const CallArgs& a) {
  check_args(a, "round", 2, {"precision", "method"});
  const int64_t precision = int_arg(arg_or(a, 0, "precision", Value(int64_t{0})), "round", "precision");
  const std::string method = to_str(arg_or(a, 1, "method", Value("common")));
  if (!v.is_number()) fail(str("round filter needs a number, not ", type_name(v)));
  if (method == "common" && precision >= 0 && precision <= 300 && std::isfinite(v.as_double())) {
    // Python's round(x, n) rounds the exact binary value, ties to even; so does glibc's printf.
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), v.as_double());
    return Value(std::strtod(buf, nullptr));
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_double() * scale;
  double r;
  if (method == "common") {
    r = std::nearbyint(x);
  } else if (method == "ceil") {
    r = std::ceil(x);
  } else if (method == "floor") {
    r = std::floor(x);
  } else {
    fail("method must be 'common', 'ceil' or 'floor'");
  }
  return Value(r / scale);
}

Value f_sum(const Value& v, const CallArgs& a) {
  check_args(a, "sum", 2, {"attribute", "start"});
  const Value* attribute = arg(a, 0, "attribute");
  Value total = arg_or(a, 1, "start", Value(int64_t{0}));
  for (const Value& item : iterate(v)) {
    total = binary_op("+", total, attribute && !attribute->is_none() ? get_path(item, to_str(*attribute)) : item);
  }
  return total;
}

// Sort key for sort/min/max/unique: the attribute if given, lowercased strings unless case-sensitive.
Value sort_key(const Value& item, const Value* attribute, bool case_sensitive) {
  Value key = attribute && !attribute->is_none() ? get_path(item, to_str(*attribute)) : item;
  if (!case_sensitive && key.is_string()) key = Value(pystr::lower(key.as_string()));
  return key;
}

Value f_sort(const Value& v, const CallArgs& a) {
  check_args(a, "sort", 3, {"reverse", "case_sensitive", "attribute"});
  const bool reverse = truthy(arg_or(a, 0, "reverse", Value(false)));
  const bool case_sensitive = truthy(arg_or(a, 1, "case_sensitive", Value(false)));
  const Value* attribute = arg(a, 2, "attribute");
  std::vector<Value> items = iterate(v);
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    const Value kx = sort_key(x, attribute, case_sensitive), ky = sort_key(y, attribute, case_sensitive);
    return reverse ? compare("<", ky, kx) : compare("<", kx, ky);
  });
  return Value::list(std::move(items));
}

Value min_max(const Value& v, const CallArgs& a, bool want_max) {
  check_args(a, want_max ? "max" : "min", 2, {"case_sensitive", "attribute"});
  const bool case_sensitive = truthy(arg_or(a, 0, "case_sensitive", Value(false)));
  const Value* attribute = arg(a, 1, "attribute");
  const std::vector<Value> items = iterate(v);
  if (items.empty()) return Value::undefined(str("No aggregated item, sequence was empty."));
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    const Value ki = sort_key(items[i], attribute, case_sensitive);
    const Value kb = sort_key(items[best], attribute, case_sensitive);
    if (want_max ? compare(">", ki, kb) : compare("<", ki, kb)) best = i;
  }
  return items[best];
}

Value f_min(const Value& v, const CallArgs& a) { return min_max(v, a, false); }
Value f_max(const Value& v, const CallArgs& a) { return min_max(v, a, true); }

Value f_unique(const Value& v, const CallArgs& a) {
  check_args(a, "unique", 2, {"case_sensitive", "attribute"});
  const bool case_sensitive = truthy(arg_or(a, 0, "case_sensitive", Value(false)));
  const Value* attribute = arg(a, 1, "attribute");
  std::vector<Value> out, seen;
  for (const Value& item : iterate(v)) {
    const Value key = sort_key(item, attribute, case_sensitive);
    if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) {
      seen.push_back(key);
      out.push_back(item);
    }
  }
  return Value::generator(std::move(out));
}

Value f_reverse(const Value& v, const CallArgs& a) {
  check_args(a, "reverse", 0, {});
  if (v.is_string()) {
    std::u32string cps = pystr::decode(v.as_string());
    std::reverse(cps.begin(), cps.end());
    return Value(pystr::encode(cps));
  }
  // jinja returns reversed(value), an iterator (a list only when the input is not reversible).
  std::vector<Value> items = iterate(v);
  std::reverse(items.begin(), items.end());
  return v.is_generator() ? Value::list(std::move(items)) : Value::generator(std::move(items));
}

Value f_attr(const Value& v, const CallArgs& a) {
  check_args(a, "attr", 1, {});
  const Value* name = arg(a, 0, "");
  if (!name) fail("attr filter needs an attribute name");
  return get_attribute(v, to_str(*name));
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
Value f_tojson(const Value& v, const CallArgs& a) {
  check_args(a, "tojson", 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonDumpOptions o;
  o.ensure_ascii = truthy(arg_or(a, 0, "ensure_ascii", Value(false)));
  const Value indent = arg_or(a, 1, "indent", Value::none());
  if (indent.is_integral()) {
    o.indent = std::string(static_cast<size_t>(std::max<int64_t>(indent.as_int(), 0)), ' ');
  } else if (indent.is_string()) {
    o.indent = indent.as_string();
  } else if (!indent.is_none()) {
    fail(str("tojson: indent must be an int or a string, not ", type_name(indent)));
  }
  const Value separators = arg_or(a, 2, "separators", Value::none());
  if (!separators.is_none()) {
    if (!separators.is_list() || separators.as_list().items.size() != 2 || !separators.as_list().items[0].is_string() ||
        !separators.as_list().items[1].is_string()) {
      fail("tojson: separators must be a pair of strings");
    }
    o.separators = std::make_pair(separators.as_list().items[0].as_string(), separators.as_list().items[1].as_string());
  }
  o.sort_keys = truthy(arg_or(a, 3, "sort_keys", Value(false)));
  return Value(to_json(v, o));
}

CallArgs rest_args(const CallArgs& a, size_t from) {
  CallArgs rest;
  rest.positional.assign(a.positional.begin() + static_cast<std::ptrdiff_t>(std::min(from, a.positional.size())),
                         a.positional.end());
  rest.keyword = a.keyword;
  return rest;
}

TestFn test_by_name(const Value& name) {
  const std::string n = to_str(name);
  TestFn t = find_test(n);
  if (t == nullptr) fail(str("no test named '", n, "'"));
  return t;
}

Value f_map(const Value& v, const CallArgs& a) {
  std::vector<Value> out;
  if (a.positional.empty()) {
    const Value* attribute = arg(a, 0, "attribute");
    if (!attribute) fail("map filter needs a filter name or attribute=");
    check_args(a, "map", 0, {"attribute", "default"});
    const Value* fallback = arg(a, kKeywordOnly, "default");
    for (const Value& item : iterate(v)) {
      Value x = get_path(item, to_str(*attribute));
      out.push_back(x.is_undefined() && fallback ? *fallback : x);
    }
    return Value::generator(std::move(out));
  }
  const std::string name = to_str(a.positional[0]);
  const FilterFn f = find_filter(name);
  if (f == nullptr) fail(str("no filter named '", name, "'"));
  const CallArgs rest = rest_args(a, 1);
  for (const Value& item : iterate(v)) out.push_back(f(item, rest));
  return Value::generator(std::move(out));
}

Value select_impl(const Value& v, const CallArgs& a, bool by_attribute, bool keep_when) {
  std::vector<Value> out;
  size_t next = 0;
  std::string attribute;
  if (by_attribute) {
    if (a.positional.empty()) fail("selectattr/rejectattr need an attribute name");
    attribute = to_str(a.positional[next++]);
  }
  TestFn test = nullptr;
  CallArgs rest;
  if (next < a.positional.size()) {
    test = test_by_name(a.positional[next]);
    rest = rest_args(a, next + 1);
  }
  for (const Value& item : iterate(v)) {
    const Value subject = by_attribute ? get_path(item, attribute) : item;
    const bool passed = test ? test(subject, rest) : truthy(subject);
    if (passed == keep_when) out.push_back(item);
  }
  return Value::generator(std::move(out));
}

Value f_select(const Value& v, const CallArgs& a) { return select_impl(v, a, false, true); }
Value f_reject(const Value& v, const CallArgs& a) { return select_impl(v, a, false, false); }
Value f_selectattr(const Value& v, const CallArgs& a) { return select_impl(v, a, true, true); }
Value f_rejectattr(const Value& v, const CallArgs& a) { return select_impl(v, a, true, false); }

// ---- tests ----

const Value& test_arg(const CallArgs& a, std::string_view test) {
  if (a.positional.empty()) fail(str("test '", test, "' needs an argument"));
  return a.positional[0];
}

bool t_defined(const Value& v, const CallArgs&) { return !v.is_undefined(); }
bool t_undefined(const Value& v, const CallArgs&) { return v.is_undefined(); }
bool t_none(const Value& v, const CallArgs&) { return v.is_none(); }
bool t_boolean(const Value& v, const CallArgs&) { return v.is_bool(); }
bool t_true(const Value& v, const CallArgs&) { return v.is_bool() && v.as_bool(); }
bool t_false(const Value& v, const CallArgs&) { return v.is_bool() && !v.as_bool(); }
bool t_integer(const Value& v, const CallArgs&) { return v.is_int(); }
bool t_float(const Value& v, const CallArgs&) { return v.is_float(); }
bool t_number(const Value& v, const CallArgs&) { return v.is_number(); }
bool t_string(const Value& v, const CallArgs&) { return v.is_string(); }
bool t_mapping(const Value& v, const CallArgs&) { return v.is_dict(); }
// Undefined counts: jinja's Undefined defines __call__ (to raise), so callable() says True.
bool t_callable(const Value& v, const CallArgs&) { return v.is_function() || v.is_undefined(); }
bool t_escaped(const Value&, const CallArgs&) { return false; }
// Python: iter(x) works for str, list, dict and jinja's Undefined.
bool t_iterable(const Value& v, const CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
// jinja's test_sequence: len(x) and x.__getitem__ exist (true for dicts and Undefined too).
bool t_sequence(const Value& v, const CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_sequence() || v.is_dict();
}
bool t_eq(const Value& v, const CallArgs& a) { return equals(v, test_arg(a, "eq")); }
bool t_ne(const Value& v, const CallArgs& a) { return !equals(v, test_arg(a, "ne")); }
bool t_lt(const Value& v, const CallArgs& a) { return compare("<", v, test_arg(a, "lt")); }
bool t_le(const Value& v, const CallArgs& a) { return compare("<=", v, test_arg(a, "le")); }
bool t_gt(const Value& v, const CallArgs& a) { return compare(">", v, test_arg(a, "gt")); }
bool t_ge(const Value& v, const CallArgs& a) { return compare(">=", v, test_arg(a, "ge")); }
bool t_in(const Value& v, const CallArgs& a) { return contains(test_arg(a, "in"), v); }
bool t_sameas(const Value& v, const CallArgs& a) {
  const Value& other = test_arg(a, "sameas");
  if (v.kind() != other.kind()) return false;
  if (v.is_none() || v.is_undefined()) return true;
  if (v.is_bool()) return v.as_bool() == other.as_bool();
  return v.identity() != nullptr && v.identity() == other.identity();
}
// jinja: value % 2 == 1, value % 2 == 0, value % num == 0 (Python's %, so floats work too).
bool t_odd(const Value& v, const CallArgs&) { return equals(binary_op("%", v, Value(int64_t{2})), Value(int64_t{1})); }
bool t_even(const Value& v, const CallArgs&) { return equals(binary_op("%", v, Value(int64_t{2})), Value(int64_t{0})); }
bool t_divisibleby(const Value& v, const CallArgs& a) {
  return equals(binary_op("%", v, test_arg(a, "divisibleby")), Value(int64_t{0}));
}
bool t_lower(const Value& v, const CallArgs&) {
  const std::string s = to_str(v);
  return pystr::lower(s) == s && pystr::upper(s) != s;
}
bool t_upper(const Value& v, const CallArgs&) {
  const std::string s = to_str(v);
  return pystr::upper(s) == s && pystr::lower(s) != s;
}
bool t_filter(const Value& v, const CallArgs&) { return v.is_string() && find_filter(v.as_string()) != nullptr; }
bool t_test(const Value& v, const CallArgs&) { return v.is_string() && find_test(v.as_string()) != nullptr; }

// ---- globals ----

Value g_range(const CallArgs& a) {
  check_args(a, "range", 3, {});
  if (a.positional.empty()) fail("range expected at least 1 argument, got 0");
  int64_t start = 0, stop = 0, step = 1;
  if (a.positional.size() == 1) {
    stop = int_arg(a.positional[0], "range", "stop");
  } else {
    start = int_arg(a.positional[0], "range", "start");
    stop = int_arg(a.positional[1], "range", "stop");
    if (a.positional.size() > 2) step = int_arg(a.positional[2], "range", "step");
  }
  if (step == 0) fail("range() arg 3 must not be zero");
  const double count = std::max(0.0, std::ceil((static_cast<double>(stop) - static_cast<double>(start)) /
                                               static_cast<double>(step)));
  if (count > static_cast<double>(kMaxRange)) {
    fail(str("Range too big. The sandbox blocks ranges larger than MAX_RANGE (", kMaxRange, ")."));
  }
  std::vector<Value> out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.emplace_back(i);
  return Value::list(std::move(out));
}

// dict(mapping, **kwargs) / namespace(mapping, **kwargs).
Dict dict_from_args(const CallArgs& a, std::string_view callee) {
  check_args(a, callee, 1, {});
  Dict d;
  if (!a.positional.empty()) {
    if (!a.positional[0].is_dict()) fail(str(callee, "() positional argument must be a mapping"));
    d = a.positional[0].as_dict();
  }
  return d;
}

Dict with_keywords(Dict d, const CallArgs& a) {
  for (const auto& [k, v] : a.keyword) d.set(k, v);
  return d;
}

Value g_namespace(const CallArgs& a) {
  CallArgs positional_only{a.positional, {}};
  Dict attrs = with_keywords(dict_from_args(positional_only, "namespace"), a);
  for (const auto& [k, v] : attrs.entries) {
    if (!k.empty() && k[0] == '_') {
      fail(str("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '", k,
               "'. Please rename the attribute."));
    }
  }
  return Value::make_namespace(std::move(attrs));
}

Value g_dict(const CallArgs& a) {
  CallArgs positional_only{a.positional, {}};
  return Value::dict(with_keywords(dict_from_args(positional_only, "dict"), a));
}

Value g_raise_exception(const CallArgs& a) {
  check_args(a, "raise_exception", 1, {});
  throw RaisedByTemplate(a.positional.empty() ? std::string() : to_str(a.positional[0]));
}

Value g_strftime_now(const CallArgs& a) {
  check_args(a, "strftime_now", 1, {});
  if (a.positional.empty()) fail("strftime_now() needs a format");
  const std::string format = str_arg(a.positional[0], "strftime_now", "format");
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[512];
  const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &local);
  return Value(std::string(buf, n));
}

const std::unordered_map<std::string_view, FilterFn>& filters() {
  static const std::unordered_map<std::string_view, FilterFn> table = {
      {"abs", f_abs},         {"attr", f_attr},     {"capitalize", f_capitalize}, {"count", f_length},
      {"d", f_default},       {"default", f_default}, {"e", f_escape},            {"escape", f_escape},
      {"first", f_first},     {"float", f_float},   {"int", f_int},               {"items", f_items},
      {"join", f_join},       {"last", f_last},     {"length", f_length},         {"list", f_list},
      {"lower", f_lower},     {"map", f_map},       {"max", f_max},               {"min", f_min},
      {"reject", f_reject},   {"rejectattr", f_rejectattr}, {"replace", f_replace}, {"reverse", f_reverse},
      {"round", f_round},     {"safe", f_string},   {"select", f_select},         {"selectattr", f_selectattr},
      {"sort", f_sort},       {"string", f_string}, {"sum", f_sum},               {"title", f_title},
      {"tojson", f_tojson},   {"trim", f_trim},     {"unique", f_unique},         {"upper", f_upper},
  };
  return table;
}

const std::unordered_map<std::string_view, TestFn>& tests() {
  static const std::unordered_map<std::string_view, TestFn> table = {
      {"defined", t_defined},   {"undefined", t_undefined}, {"none", t_none},       {"boolean", t_boolean},
      {"true", t_true},         {"false", t_false},         {"integer", t_integer}, {"float", t_float},
      {"number", t_number},     {"string", t_string},       {"mapping", t_mapping}, {"iterable", t_iterable},
      {"sequence", t_sequence}, {"callable", t_callable},   {"sameas", t_sameas},   {"escaped", t_escaped},
      {"in", t_in},             {"odd", t_odd},             {"even", t_even},       {"divisibleby", t_divisibleby},
      {"lower", t_lower},       {"upper", t_upper},         {"filter", t_filter},   {"test", t_test},
      {"eq", t_eq},             {"equalto", t_eq},          {"==", t_eq},           {"ne", t_ne},
      {"!=", t_ne},             {"lt", t_lt},               {"lessthan", t_lt},     {"<", t_lt},
      {"le", t_le},             {"<=", t_le},               {"gt", t_gt},           {"greaterthan", t_gt},
      {">", t_gt},              {"ge", t_ge},               {">=", t_ge},
  };
  return table;
}

}  // namespace

FilterFn find_filter(std::string_view name) {
  const auto it = filters().find(name);
  return it == filters().end() ? nullptr : it->second;
}

TestFn find_test(std::string_view name) {
  const auto it = tests().find(name);
  return it == tests().end() ? nullptr : it->second;
}

bool is_unsupported_builtin_filter(std::string_view name) {
  static constexpr std::string_view kNames[] = {
      "batch", "center", "dictsort", "filesizeformat", "forceescape", "format", "groupby", "indent", "pprint",
      "random", "slice", "striptags", "truncate", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"};
  return std::find(std::begin(kNames), std::end(kNames), name) != std::end(kNames);
}

Dict make_globals() {
  Dict g;
  g.set("range", Value::function("range", g_range));
  g.set("namespace", Value::function("namespace", g_namespace));
  g.set("dict", Value::function("dict", g_dict));
  g.set("raise_exception", Value::function("raise_exception", g_raise_exception));
  g.set("strftime_now", Value::function("strftime_now", g_strftime_now));
  return g;
}

}  // namespace relay::chat::jinja

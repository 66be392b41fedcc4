// Values of the Jinja interpreter: Python's JSON-like types plus Undefined, callables and namespaces.
//
// Design: a Value is a small tagged object; scalars and strings are held inline, containers sit behind
// shared pointers to immutable data, so copying a message list into a loop variable is a pointer copy.
// Templates run in transformers' ImmutableSandboxedEnvironment, where lists and dicts cannot be
// mutated, so sharing is safe. The one mutable object is the namespace() (its attributes change under
// `{% set ns.x = ... %}` and every holder must see it), so it is shared by reference on purpose.
// Dicts keep insertion order (Python dicts do, and tojson/items output depends on it); their keys are
// strings, which is all JSON input and Qwen templates produce.
//
// Undefined carries the message Jinja would raise when an operation on it is not allowed
// ("'dict object' has no attribute 'content'"); printing it yields "" as in Jinja's default Undefined.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace relay::chat::jinja {

class Value;

struct List {
  std::vector<Value> items;
  bool is_tuple = false;  // printed as (a, b) and unequal to a list, as in Python
  // The result of a lazy jinja filter (map, select, items, ...): iterable, but always true, without
  // len() or subscripts, as a Python generator is. `|list` turns it into a list.
  bool is_generator = false;
};

struct Dict {
  std::vector<std::pair<std::string, Value>> entries;  // insertion order
  const Value* find(std::string_view key) const;
  // Replaces the value of an existing key in place (Python keeps its position) or appends.
  void set(std::string key, Value value);
};

struct Namespace {
  mutable Dict attrs;  // mutable: `{% set ns.x = v %}` writes through every copy of the handle
};

// Arguments of a call: positional then keyword, in source order.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct Function {
  std::string name;
  std::function<Value(const CallArgs&)> call;
};

class Value {
 public:
  enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunction, kNamespace };

  Value() = default;  // undefined with a generic message
  Value(bool b) : kind_(Kind::kBool), int_(b) {}  // NOLINT(google-explicit-constructor)
  Value(int64_t i) : kind_(Kind::kInt), int_(i) {}  // NOLINT
  Value(int i) : kind_(Kind::kInt), int_(i) {}  // NOLINT
  Value(double f) : kind_(Kind::kFloat), float_(f) {}  // NOLINT
  Value(std::string s) : kind_(Kind::kString), str_(std::move(s)) {}  // NOLINT
  Value(const char* s) : kind_(Kind::kString), str_(s) {}  // NOLINT

  static Value undefined(std::string message);
  static Value none();
  static Value list(std::vector<Value> items, bool is_tuple = false);
  static Value generator(std::vector<Value> items);
  static Value dict(Dict d);
  static Value function(std::string name, std::function<Value(const CallArgs&)> call);
  static Value make_namespace(Dict attrs);
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  // bool is an int in Python: True + 1 == 2, 1 == True.
  bool is_number() const { return kind_ == Kind::kBool || kind_ == Kind::kInt || kind_ == Kind::kFloat; }
  bool is_integral() const { return kind_ == Kind::kBool || kind_ == Kind::kInt; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_generator() const { return kind_ == Kind::kList && as_list().is_generator; }
  // A list or tuple with len() and subscripts (not a generator).
  bool is_sequence() const { return kind_ == Kind::kList && !as_list().is_generator; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_function() const { return kind_ == Kind::kFunction; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }  // bool or int
  double as_double() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& as_string() const { return str_; }
  const List& as_list() const { return *static_cast<const List*>(ptr_.get()); }
  const Dict& as_dict() const { return *static_cast<const Dict*>(ptr_.get()); }
  const Function& as_function() const { return *static_cast<const Function*>(ptr_.get()); }
  const Namespace& as_namespace() const { return *static_cast<const Namespace*>(ptr_.get()); }
  const void* identity() const { return ptr_.get(); }
  // The error an operation on this undefined value raises.
  const std::string& undefined_message() const { return str_; }

 private:
  Kind kind_ = Kind::kUndefined;
  int64_t int_ = 0;
  double float_ = 0.0;
  std::string str_;                 // string value, or the undefined message
  std::shared_ptr<const void> ptr_;  // List, Dict, Function or Namespace
};

// Python's type(x).__name__, for messages ("dict", "str", "NoneType", ...).
std::string type_name(const Value& v);
// Python's bool(x).
bool truthy(const Value& v);
// Python's ==.
bool equals(const Value& a, const Value& b);
// Python's str(x) and repr(x). str(undefined) is "".
std::string to_str(const Value& v);
std::string to_repr(const Value& v);

// json.dumps(x, ensure_ascii=..., indent=..., separators=..., sort_keys=...) as transformers' tojson.
struct JsonDumpOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // nullopt: one line; "  ": newline + this per level
  std::optional<std::pair<std::string, std::string>> separators;  // (item, key); default by indent
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonDumpOptions& options);

// Throws the error an operation on an undefined value raises ("'x' is undefined").
[[noreturn]] void fail_undefined(const Value& v);

}  // namespace relay::chat::jinja

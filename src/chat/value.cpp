// Python semantics of interpreter values: str(), repr(), ==, bool() and json.dumps (see value.h).
#include "chat/value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "chat/pystr.h"
#include "core/error.h"

namespace relay::chat::jinja {

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::set(std::string key, Value value) {
  for (auto& [k, v] : entries) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

Value Value::undefined(std::string message) {
  Value v;
  v.str_ = std::move(message);
  return v;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value Value::list(std::vector<Value> items, bool is_tuple) {
  Value v;
  v.kind_ = Kind::kList;
  v.ptr_ = std::make_shared<const List>(List{std::move(items), is_tuple, false});
  return v;
}

Value Value::generator(std::vector<Value> items) {
  Value v;
  v.kind_ = Kind::kList;
  v.ptr_ = std::make_shared<const List>(List{std::move(items), false, true});
  return v;
}

Value Value::dict(Dict d) {
  Value v;
  v.kind_ = Kind::kDict;
  v.ptr_ = std::make_shared<const Dict>(std::move(d));
  return v;
}

Value Value::function(std::string name, std::function<Value(const CallArgs&)> call) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.ptr_ = std::make_shared<const Function>(Function{std::move(name), std::move(call)});
  return v;
}

Value Value::make_namespace(Dict attrs) {
  Value v;
  v.kind_ = Kind::kNamespace;
  auto ns = std::make_shared<Namespace>();
  ns->attrs = std::move(attrs);
  v.ptr_ = std::move(ns);
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      RELAY_CHECK(u <= static_cast<uint64_t>(INT64_MAX), "chat template input: integer ", u,
                  " is larger than the interpreter's 64-bit integers");
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      d.entries.reserve(j.size());
      for (const auto& [k, e] : j.items()) d.entries.emplace_back(k, from_json(e));
      return dict(std::move(d));
    }
    default:
      fail("chat template input: unsupported JSON value (binary or discarded)");
  }
}

std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kList: return v.as_list().is_generator ? "generator" : v.as_list().is_tuple ? "tuple" : "list";
    case Value::Kind::kDict: return "dict";
    case Value::Kind::kFunction: return "function";
    case Value::Kind::kNamespace: return "Namespace";
  }
  return "object";
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool:
    case Value::Kind::kInt: return v.as_int() != 0;
    case Value::Kind::kFloat: return v.as_double() != 0.0;
    case Value::Kind::kString: return !v.as_string().empty();
    case Value::Kind::kList: return v.as_list().is_generator || !v.as_list().items.empty();
    case Value::Kind::kDict: return !v.as_dict().entries.empty();
    case Value::Kind::kFunction:
    case Value::Kind::kNamespace: return true;
  }
  return false;
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_double() == b.as_double();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kString: return a.as_string() == b.as_string();
    case Value::Kind::kList: {
      const List& x = a.as_list();
      const List& y = b.as_list();
      if (x.is_generator || y.is_generator) return &x == &y;
      if (x.is_tuple != y.is_tuple || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i) {
        if (!equals(x.items[i], y.items[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.find(k);
        if (other == nullptr || !equals(v, *other)) return false;
      }
      return true;
    }
    default: return a.identity() == b.identity();
  }
}

namespace {

void append_repr(std::string& out, const Value& v);

void append_str(std::string& out, const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return;
    case Value::Kind::kNone: out += "None"; return;
    case Value::Kind::kBool: out += v.as_bool() ? "True" : "False"; return;
    case Value::Kind::kInt: out += std::to_string(v.as_int()); return;
    case Value::Kind::kFloat: out += pystr::float_repr(v.as_double()); return;
    case Value::Kind::kString: out += v.as_string(); return;
    case Value::Kind::kList: {
      const List& l = v.as_list();
      if (l.is_generator) {
        out += "<generator object>";
        return;
      }
      out += l.is_tuple ? '(' : '[';
      for (size_t i = 0; i < l.items.size(); ++i) {
        if (i > 0) out += ", ";
        append_repr(out, l.items[i]);
      }
      if (l.is_tuple && l.items.size() == 1) out += ',';
      out += l.is_tuple ? ')' : ']';
      return;
    }
    case Value::Kind::kDict: {
      out += '{';
      bool first = true;
      for (const auto& [k, e] : v.as_dict().entries) {
        if (!first) out += ", ";
        first = false;
        out += pystr::repr(k);
        out += ": ";
        append_repr(out, e);
      }
      out += '}';
      return;
    }
    case Value::Kind::kFunction: out += "<function " + v.as_function().name + ">"; return;
    case Value::Kind::kNamespace: {
      out += "<Namespace ";
      append_str(out, Value::dict(v.as_namespace().attrs));
      out += '>';
      return;
    }
  }
}

void append_repr(std::string& out, const Value& v) {
  if (v.is_string()) {
    out += pystr::repr(v.as_string());
  } else if (v.is_undefined()) {
    out += "Undefined";
  } else {
    append_str(out, v);
  }
}

void append_json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  char buf[16];
  out += '"';
  if (!ensure_ascii) {
    for (char c : s) {
      const auto u = static_cast<unsigned char>(c);
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (u < 0x20) {
            std::snprintf(buf, sizeof(buf), "\\u%04x", u);
            out += buf;
          } else {
            out += c;
          }
      }
    }
  } else {
    for (char32_t cp : pystr::decode(s)) {
      switch (cp) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (cp >= 0x20 && cp < 0x7F) {
            out += static_cast<char>(cp);
          } else if (cp < 0x10000) {
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(cp));
            out += buf;
          } else {
            // Astral code points become a UTF-16 surrogate pair, as json.dumps writes them.
            const char32_t v = cp - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                          static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
            out += buf;
          }
      }
    }
  }
  out += '"';
}

struct JsonWriter {
  const JsonDumpOptions& options;
  std::string item_separator;
  std::string key_separator;
  std::string out;

  void newline(int depth) {
    out += '\n';
    for (int i = 0; i < depth; ++i) out += *options.indent;
  }

  void write(const Value& v, int depth) {
    RELAY_CHECK(depth < 512, "tojson: value nested deeper than 512 levels");
    switch (v.kind()) {
      case Value::Kind::kNone: out += "null"; return;
      case Value::Kind::kBool: out += v.as_bool() ? "true" : "false"; return;
      case Value::Kind::kInt: out += std::to_string(v.as_int()); return;
      case Value::Kind::kFloat: {
        const double f = v.as_double();
        if (std::isnan(f)) {
          out += "NaN";
        } else if (std::isinf(f)) {
          out += f < 0 ? "-Infinity" : "Infinity";
        } else {
          out += pystr::float_repr(f);
        }
        return;
      }
      case Value::Kind::kString: append_json_string(out, v.as_string(), options.ensure_ascii); return;
      case Value::Kind::kList: {
        if (v.is_generator()) fail("Object of type generator is not JSON serializable");
        const auto& items = v.as_list().items;
        if (items.empty()) {
          out += "[]";
          return;
        }
        out += '[';
        for (size_t i = 0; i < items.size(); ++i) {
          if (i > 0) out += item_separator;
          if (options.indent) newline(depth + 1);
          write(items[i], depth + 1);
        }
        if (options.indent) newline(depth);
        out += ']';
        return;
      }
      case Value::Kind::kDict: {
        std::vector<const std::pair<std::string, Value>*> entries;
        for (const auto& e : v.as_dict().entries) entries.push_back(&e);
        if (entries.empty()) {
          out += "{}";
          return;
        }
        if (options.sort_keys) {
          std::stable_sort(entries.begin(), entries.end(),
                           [](const auto* a, const auto* b) { return a->first < b->first; });
        }
        out += '{';
        for (size_t i = 0; i < entries.size(); ++i) {
          if (i > 0) out += item_separator;
          if (options.indent) newline(depth + 1);
          append_json_string(out, entries[i]->first, options.ensure_ascii);
          out += key_separator;
          write(entries[i]->second, depth + 1);
        }
        if (options.indent) newline(depth);
        out += '}';
        return;
      }
      default:
        fail(str("Object of type ", type_name(v), " is not JSON serializable"));
    }
  }
};

}  // namespace

std::string to_str(const Value& v) {
  std::string out;
  append_str(out, v);
  return out;
}

std::string to_repr(const Value& v) {
  std::string out;
  append_repr(out, v);
  return out;
}

std::string to_json(const Value& v, const JsonDumpOptions& options) {
  JsonWriter w{options, ", ", ": ", {}};
  if (options.separators) {
    w.item_separator = options.separators->first;
    w.key_separator = options.separators->second;
  } else if (options.indent) {
    w.item_separator = ",";
  }
  w.write(v, 0);
  return std::move(w.out);
}

void fail_undefined(const Value& v) {
  fail(v.undefined_message().empty() ? std::string("value is undefined") : v.undefined_message());
}

}  // namespace relay::chat::jinja

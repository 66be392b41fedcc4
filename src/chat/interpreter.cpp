// The tree-walking evaluator behind chat::Template (declared in chat_template.h).
//
// Scoping follows jinja2: `if` shares its frame with the surrounding code; each for-loop iteration
// gets a fresh frame whose parent is the frame around the loop (so `set` inside a loop never leaks
// out or into the next iteration); a macro's body runs in a new frame whose parent is the frame the
// macro was defined in, looked up at call time (a macro sees top-level variables set after its
// definition, not the caller's loop variables). Frames live until the render ends because macros
// may hold them. Errors carry the line of the statement or expression being evaluated.
#include <deque>

#include "chat/builtins.h"
#include "chat/chat_template.h"
#include "chat/ops.h"
#include "chat/parser.h"

#include <nlohmann/json.hpp>

namespace relay::chat {
namespace jinja {
namespace {

// Sandboxing limits: nested macro calls, loop iterations in one render, and output size.
constexpr int kMaxCallDepth = 200;
constexpr int64_t kMaxLoopIterations = 10'000'000;
constexpr size_t kMaxOutputBytes = size_t{256} << 20;

struct Frame {
  Frame* parent = nullptr;
  Dict vars;
  bool captured = false;  // a macro defined here holds a pointer to this frame
};

enum class Flow { kNormal, kBreak, kContinue };

class Interpreter {
 public:
  Interpreter(Dict context) {
    Frame& globals = new_frame(nullptr);
    globals.vars = make_globals();
    Frame& ctx = new_frame(&globals);
    ctx.vars = std::move(context);
    root_ = &new_frame(&ctx);
  }

  std::string run(const Program& program) {
    std::string out;
    exec_block(program.body, *root_, out);
    return out;
  }

  int line() const { return line_; }

 private:
  std::deque<Frame> frames_;
  Frame* root_ = nullptr;
  int line_ = 0;
  int call_depth_ = 0;
  int64_t iterations_ = 0;

  Frame& new_frame(Frame* parent) {
    frames_.emplace_back();
    frames_.back().parent = parent;
    return frames_.back();
  }

  static void append(std::string& out, std::string_view text) {
    RELAY_CHECK(out.size() + text.size() <= kMaxOutputBytes, "template output exceeds ", kMaxOutputBytes, " bytes");
    out += text;
  }

  Value lookup(const std::string& name, const Frame& frame) const {
    for (const Frame* f = &frame; f != nullptr; f = f->parent) {
      if (const Value* v = f->vars.find(name)) return *v;
    }
    return Value::undefined(str("'", name, "' is undefined"));
  }

  // ---- statements ----

  Flow exec_block(const std::vector<StmtPtr>& body, Frame& frame, std::string& out) {
    for (const StmtPtr& s : body) {
      const Flow flow = exec(*s, frame, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s, Frame& frame, std::string& out) {
    line_ = s.line;
    switch (s.kind) {
      case StmtKind::kOutput:
        append(out, s.text);
        return Flow::kNormal;
      case StmtKind::kPrint:
        append(out, to_str(eval(*s.expr, frame)));
        return Flow::kNormal;
      case StmtKind::kIf:
        return exec_block(truthy(eval(*s.expr, frame)) ? s.body : s.else_body, frame, out);
      case StmtKind::kFor:
        return exec_for(s, frame, out);
      case StmtKind::kSet:
        exec_set(s, frame);
        return Flow::kNormal;
      case StmtKind::kSetBlock: {
        std::string captured;
        exec_block(s.body, frame, captured);
        Value v(std::move(captured));
        for (const ExprPtr& f : s.filters) v = apply_filter(*f, v, frame);
        frame.vars.set(s.targets[0], std::move(v));
        return Flow::kNormal;
      }
      case StmtKind::kMacro:
        define_macro(s, frame);
        return Flow::kNormal;
      case StmtKind::kBreak:
        return Flow::kBreak;
      case StmtKind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void assign(Frame& frame, const std::vector<std::string>& targets, const Value& v) {
    if (targets.size() == 1) {
      frame.vars.set(targets[0], v);
      return;
    }
    const std::vector<Value> items = iterate(v);
    if (items.size() != targets.size()) {
      fail(str(items.size() < targets.size() ? "not enough" : "too many", " values to unpack (expected ",
               targets.size(), ", got ", items.size(), ")"));
    }
    for (size_t i = 0; i < targets.size(); ++i) frame.vars.set(targets[i], items[i]);
  }

  void exec_set(const Stmt& s, Frame& frame) {
    Value v = eval(*s.expr, frame);
    if (s.attribute.empty()) {
      assign(frame, s.targets, v);
      return;
    }
    const Value ns = lookup(s.targets[0], frame);
    if (!ns.is_namespace()) fail(str("cannot assign attribute '", s.attribute, "' on non-namespace object '", s.targets[0], "'"));
    if (s.attribute[0] == '_') {
      fail(str("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '", s.attribute, "'"));
    }
    ns.as_namespace().attrs.set(s.attribute, std::move(v));
  }

  Value loop_object(size_t i, const std::vector<Value>& items) {
    const auto n = static_cast<int64_t>(items.size());
    const auto index0 = static_cast<int64_t>(i);
    Dict loop;
    loop.entries.reserve(12);
    loop.entries.emplace_back("index", Value(index0 + 1));
    loop.entries.emplace_back("index0", Value(index0));
    loop.entries.emplace_back("revindex", Value(n - index0));
    loop.entries.emplace_back("revindex0", Value(n - index0 - 1));
    loop.entries.emplace_back("first", Value(i == 0));
    loop.entries.emplace_back("last", Value(index0 == n - 1));
    loop.entries.emplace_back("length", Value(n));
    loop.entries.emplace_back("depth", Value(int64_t{1}));
    loop.entries.emplace_back("depth0", Value(int64_t{0}));
    if (i > 0) loop.entries.emplace_back("previtem", items[i - 1]);
    if (index0 + 1 < n) loop.entries.emplace_back("nextitem", items[i + 1]);
    loop.entries.emplace_back("cycle", Value::function("loop.cycle", [index0](const CallArgs& a) {
      if (a.positional.empty()) fail("no items for cycling given");
      return a.positional[static_cast<size_t>(index0) % a.positional.size()];
    }));
    return Value::dict(std::move(loop));
  }

  void count_iteration() {
    if (++iterations_ > kMaxLoopIterations) {
      fail(str("template ran more than ", kMaxLoopIterations, " loop iterations"));
    }
  }

  Flow exec_for(const Stmt& s, Frame& frame, std::string& out) {
    std::vector<Value> items = iterate(eval(*s.expr, frame));
    if (s.filter) {
      std::vector<Value> kept;
      Frame& scratch = new_frame(&frame);
      for (Value& item : items) {
        count_iteration();
        scratch.vars.entries.clear();
        assign(scratch, s.targets, item);
        if (truthy(eval(*s.filter, scratch))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec_block(s.else_body, frame, out);
      return Flow::kNormal;
    }
    Frame* iteration = &new_frame(&frame);
    for (size_t i = 0; i < items.size(); ++i) {
      count_iteration();
      line_ = s.line;
      if (iteration->captured) {
        iteration = &new_frame(&frame);
      } else {
        iteration->vars.entries.clear();
      }
      assign(*iteration, s.targets, items[i]);
      if (s.uses_loop) iteration->vars.set("loop", loop_object(i, items));
      if (exec_block(s.body, *iteration, out) == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  void define_macro(const Stmt& s, Frame& frame) {
    frame.captured = true;
    Frame* closure = &frame;
    const Stmt* macro = &s;
    frame.vars.set(s.name, Value::function(s.name, [this, macro, closure](const CallArgs& args) {
      return call_macro(*macro, *closure, args);
    }));
  }

  Value call_macro(const Stmt& m, Frame& closure, const CallArgs& args) {
    if (call_depth_ >= kMaxCallDepth) fail(str("macro calls nested deeper than ", kMaxCallDepth, " levels"));
    const int saved_line = line_;
    Frame& frame = new_frame(&closure);
    std::vector<bool> bound(m.params.size(), false);
    std::vector<Value> varargs;
    for (size_t i = 0; i < args.positional.size(); ++i) {
      if (i < m.params.size()) {
        frame.vars.set(m.params[i].first, args.positional[i]);
        bound[i] = true;
      } else if (m.uses_varargs) {
        varargs.push_back(args.positional[i]);
      } else {
        fail(str("macro '", m.name, "' takes not more than ", m.params.size(), " argument(s)"));
      }
    }
    Dict kwargs;
    for (const auto& [key, value] : args.keyword) {
      size_t p = 0;
      while (p < m.params.size() && m.params[p].first != key) ++p;
      if (p < m.params.size()) {
        if (bound[p]) fail(str("macro '", m.name, "' got multiple values for argument '", key, "'"));
        frame.vars.set(key, value);
        bound[p] = true;
      } else if (m.uses_kwargs) {
        kwargs.set(key, value);
      } else {
        fail(str("macro '", m.name, "' takes no keyword argument '", key, "'"));
      }
    }
    for (size_t p = 0; p < m.params.size(); ++p) {
      if (bound[p]) continue;
      const auto& [name, def] = m.params[p];
      frame.vars.set(name, def ? eval(*def, frame) : Value::undefined(str("parameter '", name, "' was not provided")));
    }
    if (m.uses_varargs) frame.vars.set("varargs", Value::list(std::move(varargs), true));
    if (m.uses_kwargs) frame.vars.set("kwargs", Value::dict(std::move(kwargs)));
    std::string out;
    ++call_depth_;
    exec_block(m.body, frame, out);
    --call_depth_;
    line_ = saved_line;
    return Value(std::move(out));
  }

  // ---- expressions ----

  CallArgs eval_args(const Expr& e, size_t first, Frame& frame) {
    CallArgs args;
    args.positional.reserve(e.args.size() - first);
    for (size_t i = first; i < e.args.size(); ++i) args.positional.push_back(eval(*e.args[i], frame));
    for (const auto& [k, v] : e.kwargs) args.keyword.emplace_back(k, eval(*v, frame));
    return args;
  }

  Value apply_filter(const Expr& e, const Value& operand, Frame& frame) {
    const CallArgs args = eval_args(e, 1, frame);
    line_ = e.line;
    return e.filter(operand, args);
  }

  Value call(const Expr& e, Frame& frame) {
    const Expr& callee = *e.args[0];
    if (callee.kind == ExprKind::kGetattr) {
      // obj.method(...) without building a bound-method object.
      const Value obj = eval(*callee.args[0], frame);
      if (obj.is_undefined()) fail_undefined(obj);
      const CallArgs args = eval_args(e, 1, frame);
      line_ = e.line;
      if (auto result = call_method(obj, callee.name, args)) return std::move(*result);
      return call_value(get_attribute(obj, callee.name), args);
    }
    const Value fn = eval(callee, frame);
    const CallArgs args = eval_args(e, 1, frame);
    line_ = e.line;
    return call_value(fn, args);
  }

  Value call_value(const Value& fn, const CallArgs& args) {
    if (fn.is_undefined()) fail_undefined(fn);
    if (!fn.is_function()) fail(str("'", type_name(fn), "' object is not callable"));
    return fn.as_function().call(args);
  }

  Value eval(const Expr& e, Frame& frame) {
    line_ = e.line;
    switch (e.kind) {
      case ExprKind::kConst:
        return e.value;
      case ExprKind::kName:
        return lookup(e.name, frame);
      case ExprKind::kList:
      case ExprKind::kTuple: {
        std::vector<Value> items;
        items.reserve(e.args.size());
        for (const ExprPtr& a : e.args) items.push_back(eval(*a, frame));
        return Value::list(std::move(items), e.kind == ExprKind::kTuple);
      }
      case ExprKind::kDict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          const Value key = eval(*e.args[i], frame);
          if (!key.is_string()) fail(str("dict keys must be strings in chat templates, got ", type_name(key)));
          d.set(key.as_string(), eval(*e.args[i + 1], frame));
        }
        return Value::dict(std::move(d));
      }
      case ExprKind::kGetattr:
        return get_attribute(eval(*e.args[0], frame), e.name);
      case ExprKind::kGetitem: {
        const Value obj = eval(*e.args[0], frame);
        return get_item(obj, eval(*e.args[1], frame));
      }
      case ExprKind::kSlice: {
        const Value obj = eval(*e.args[0], frame);
        auto part = [&](size_t i) { return e.args[i] ? eval(*e.args[i], frame) : Value::none(); };
        const Value start = part(1), stop = part(2), step = part(3);
        return slice(obj, start, stop, step);
      }
      case ExprKind::kCall:
        return call(e, frame);
      case ExprKind::kFilter:
        return apply_filter(e, eval(*e.args[0], frame), frame);
      case ExprKind::kTest: {
        const Value operand = eval(*e.args[0], frame);
        const CallArgs args = eval_args(e, 1, frame);
        line_ = e.line;
        return Value(e.test(operand, args));
      }
      case ExprKind::kNot:
        return Value(!truthy(eval(*e.args[0], frame)));
      case ExprKind::kNeg:
        return negate(eval(*e.args[0], frame));
      case ExprKind::kPos: {
        Value v = eval(*e.args[0], frame);
        if (v.is_undefined()) fail_undefined(v);
        if (!v.is_number()) fail(str("bad operand type for unary +: '", type_name(v), "'"));
        return v.is_bool() ? Value(v.as_int()) : v;
      }
      case ExprKind::kBinary: {
        const Value a = eval(*e.args[0], frame);
        const Value b = eval(*e.args[1], frame);
        line_ = e.line;
        return binary_op(e.name, a, b);
      }
      case ExprKind::kCompare: {
        Value left = eval(*e.args[0], frame);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], frame);
          line_ = e.line;
          if (!compare(e.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case ExprKind::kAnd: {
        Value a = eval(*e.args[0], frame);
        return truthy(a) ? eval(*e.args[1], frame) : a;
      }
      case ExprKind::kOr: {
        Value a = eval(*e.args[0], frame);
        return truthy(a) ? a : eval(*e.args[1], frame);
      }
      case ExprKind::kCond:
        if (truthy(eval(*e.args[0], frame))) return eval(*e.args[1], frame);
        if (e.args[2]) return eval(*e.args[2], frame);
        return Value::undefined("the conditional expression had no else branch");
      case ExprKind::kConcat: {
        std::string out;
        for (const ExprPtr& a : e.args) out += to_str(eval(*a, frame));
        return Value(std::move(out));
      }
    }
    return Value();
  }
};

}  // namespace
}  // namespace jinja

Template::Template(std::string_view source) {
  try {
    program_ = std::make_shared<const jinja::Program>(jinja::parse(source));
  } catch (const TemplateError&) {
    throw;
  } catch (const relay::Error& e) {
    throw TemplateError(e.what());
  }
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  if (!context.is_object() && !context.is_null()) throw TemplateError("template context must be a JSON object");
  jinja::Dict vars;
  if (context.is_object()) {
    for (const auto& [k, v] : context.items()) vars.set(k, jinja::Value::from_json(v));
  }
  jinja::Interpreter interpreter(std::move(vars));
  try {
    return interpreter.run(*program_);
  } catch (const jinja::RaisedByTemplate& e) {
    throw TemplateError(str("chat template raised an exception at line ", interpreter.line(), ": ", e.what()));
  } catch (const relay::Error& e) {
    throw TemplateError(str("chat template error at line ", interpreter.line(), ": ", e.what()));
  } catch (const std::bad_alloc&) {
    throw TemplateError(str("chat template error at line ", interpreter.line(), ": out of memory"));
  }
}

}  // namespace relay::chat

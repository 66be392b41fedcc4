// Jinja parser (see parser.h). Recursive descent mirroring jinja2.parser function by function, so the
// precedence quirks templates depend on come out the same: `'\n' + content | trim + '\n'` trims only
// `content`, `not x is defined` negates the test, `a if c else b | f` filters only `b`.
#include "chat/parser.h"

#include <initializer_list>

#include "chat/lexer.h"
#include "core/error.h"

namespace relay::chat::jinja {
namespace {

// Nesting depth of expressions and blocks; deeper input is rejected rather than overflowing the stack.
constexpr int kMaxNestingDepth = 500;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Program parse_program() {
    Program p;
    p.body = subparse({}, "");
    return p;
  }

 private:
  std::vector<Token> toks_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  std::vector<Stmt*> macros_;  // macros being parsed, innermost last
  std::vector<Stmt*> loops_;   // for loops whose body is being parsed, innermost last

  // Guards recursion; one per nested expression or block.
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxNestingDepth) p.error(str("template nested deeper than ", kMaxNestingDepth, " levels"));
    }
    ~DepthGuard() { --p.depth_; }
  };

  const Token& cur() const { return toks_[i_]; }
  const Token& look() const { return toks_[std::min(i_ + 1, toks_.size() - 1)]; }
  void next() {
    if (i_ + 1 < toks_.size()) ++i_;
  }
  [[noreturn]] void error(const std::string& message) const { error_at(cur().line, message); }
  [[noreturn]] static void error_at(int line, const std::string& message) {
    fail(str("chat template syntax error at line ", line, ": ", message));
  }

  bool is_op(std::string_view op) const { return cur().type == TokenType::kOperator && cur().value == op; }
  bool is_name(std::string_view name) const { return cur().type == TokenType::kName && cur().value == name; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op)) error(str("expected token '", op, "', got ", describe(cur())));
  }
  void expect(TokenType type, std::string_view what) {
    if (cur().type != type) error(str("expected ", what, ", got ", describe(cur())));
    next();
  }
  std::string expect_name() {
    if (cur().type != TokenType::kName) error(str("expected a name, got ", describe(cur())));
    std::string v = cur().value;
    next();
    return v;
  }

  static ExprPtr make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }
  static StmtPtr make_stmt(StmtKind kind, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  // ---- statements ----

  // Parses until `{% <one of end_tags>`; leaves the cursor on that tag name. `opened` names the block
  // for the error when the template ends first.
  std::vector<StmtPtr> subparse(std::initializer_list<std::string_view> end_tags, std::string_view opened,
                                int opened_line = 0) {
    DepthGuard guard(*this);
    std::vector<StmtPtr> body;
    while (true) {
      const Token& t = cur();
      if (t.type == TokenType::kEnd) {
        if (end_tags.size() == 0) return body;
        std::string expected;
        for (std::string_view tag : end_tags) expected += str(expected.empty() ? "" : " or ", "'", tag, "'");
        error(str("unexpected end of template: expected ", expected, " to close the '", opened,
                  "' block opened at line ", opened_line));
      }
      if (t.type == TokenType::kData) {
        auto s = make_stmt(StmtKind::kOutput, t.line);
        s->text = t.value;
        body.push_back(std::move(s));
        next();
      } else if (t.type == TokenType::kVariableBegin) {
        next();
        auto s = make_stmt(StmtKind::kPrint, t.line);
        s->expr = parse_tuple(false, true);
        expect(TokenType::kVariableEnd, "end of print statement '}}'");
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        next();
        for (std::string_view tag : end_tags) {
          if (is_name(tag)) return body;
        }
        body.push_back(parse_statement());
        expect(TokenType::kBlockEnd, "end of statement block '%}'");
      } else {
        error(str("unexpected ", describe(t)));
      }
    }
  }

  // After the header of a block: `%}`, then the body up to one of end_tags (cursor left on it).
  std::vector<StmtPtr> parse_body(std::initializer_list<std::string_view> end_tags, std::string_view opened,
                                  int opened_line) {
    expect(TokenType::kBlockEnd, "end of statement block '%}'");
    return subparse(end_tags, opened, opened_line);
  }

  StmtPtr parse_statement() {
    if (cur().type != TokenType::kName) error(str("tag name expected, got ", describe(cur())));
    const std::string tag = cur().value;
    const int line = cur().line;
    if (tag == "if") return parse_if();
    if (tag == "for") return parse_for();
    if (tag == "set") return parse_set();
    if (tag == "macro") return parse_macro();
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) error(str("'", tag, "' outside of a for loop"));
      next();
      return make_stmt(tag == "break" ? StmtKind::kBreak : StmtKind::kContinue, line);
    }
    static constexpr std::string_view kJinjaTags[] = {"block", "extends", "include", "import", "from", "with",
                                                       "filter", "call", "autoescape", "do", "print", "trans"};
    for (std::string_view known : kJinjaTags) {
      if (tag == known) error(str("the '", tag, "' tag is not supported by Relay's chat template interpreter"));
    }
    error(str("encountered unknown tag '", tag, "'"));
  }

  StmtPtr parse_if() {
    const int line = cur().line;
    next();
    auto root = make_stmt(StmtKind::kIf, line);
    Stmt* node = root.get();
    while (true) {
      node->expr = parse_tuple(false, false);
      node->body = parse_body({"elif", "else", "endif"}, "if", line);
      const std::string which = cur().value;
      const int branch_line = cur().line;
      next();
      if (which == "elif") {
        node->else_body.push_back(make_stmt(StmtKind::kIf, branch_line));
        node = node->else_body.back().get();
        continue;
      }
      if (which == "else") {
        node->else_body = parse_body({"endif"}, "if", line);
        next();
      }
      return root;
    }
  }

  // Names separated by commas, optionally parenthesised: `a`, `a, b`, `(a, b)`.
  std::vector<std::string> parse_target_names() {
    std::vector<std::string> names;
    const bool paren = skip_op("(");
    do {
      if (paren && is_op(")")) break;
      names.push_back(expect_name());
    } while (skip_op(","));
    if (paren) expect_op(")");
    return names;
  }

  StmtPtr parse_for() {
    const int line = cur().line;
    next();
    auto s = make_stmt(StmtKind::kFor, line);
    s->targets = parse_target_names();
    if (!skip_name("in")) error(str("expected 'in' in for loop, got ", describe(cur())));
    s->expr = parse_tuple(false, false, "recursive");
    if (skip_name("if")) s->filter = parse_expression(true);
    if (is_name("recursive")) error("recursive for loops are not supported by Relay's chat template interpreter");
    ++loop_depth_;
    loops_.push_back(s.get());
    s->body = parse_body({"endfor", "else"}, "for", line);
    loops_.pop_back();
    --loop_depth_;
    const std::string which = cur().value;
    next();
    if (which == "else") {
      s->else_body = parse_body({"endfor"}, "for", line);
      next();
    }
    return s;
  }

  StmtPtr parse_set() {
    const int line = cur().line;
    next();
    if (cur().type == TokenType::kName && look().type == TokenType::kOperator && look().value == ".") {
      auto s = make_stmt(StmtKind::kSet, line);
      s->targets.push_back(expect_name());
      next();
      s->attribute = expect_name();
      expect_op("=");
      s->expr = parse_tuple(false, true);
      return s;
    }
    std::vector<std::string> targets = parse_target_names();
    if (skip_op("=")) {
      auto s = make_stmt(StmtKind::kSet, line);
      s->targets = std::move(targets);
      s->expr = parse_tuple(false, true);
      return s;
    }
    if (targets.size() != 1) error("a block set needs exactly one target name");
    auto s = make_stmt(StmtKind::kSetBlock, line);
    s->targets = std::move(targets);
    while (is_op("|")) s->filters.push_back(parse_filter(nullptr));
    const int saved_loops = loop_depth_;
    s->body = parse_body({"endset"}, "set", line);
    loop_depth_ = saved_loops;
    next();
    return s;
  }

  StmtPtr parse_macro() {
    const int line = cur().line;
    next();
    auto s = make_stmt(StmtKind::kMacro, line);
    s->name = expect_name();
    expect_op("(");
    bool seen_default = false;
    while (!is_op(")")) {
      if (!s->params.empty()) expect_op(",");
      std::string param = expect_name();
      ExprPtr def;
      if (skip_op("=")) {
        def = parse_expression(true);
        seen_default = true;
      } else if (seen_default) {
        error("non-default argument follows default argument");
      }
      s->params.emplace_back(std::move(param), std::move(def));
    }
    expect_op(")");
    macros_.push_back(s.get());
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_body({"endmacro"}, "macro", line);
    loop_depth_ = saved_loops;
    macros_.pop_back();
    next();
    return s;
  }

  // ---- expressions ----

  bool is_tuple_end(std::string_view extra_end_name) const {
    const Token& t = cur();
    if (t.type == TokenType::kVariableEnd || t.type == TokenType::kBlockEnd || t.type == TokenType::kEnd) return true;
    if (t.type == TokenType::kOperator && t.value == ")") return true;
    return !extra_end_name.empty() && t.type == TokenType::kName && t.value == extra_end_name;
  }

  // A comma-separated list of expressions; one without a comma is just that expression.
  ExprPtr parse_tuple(bool explicit_parentheses, bool with_condexpr, std::string_view extra_end_name = "") {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end_name)) break;
      items.push_back(parse_expression(with_condexpr));
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) error(str("expected an expression, got ", describe(cur())));
    }
    auto e = make(ExprKind::kTuple, line);
    e->args = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    const int line = cur().line;
    ExprPtr expr1 = parse_or();
    while (skip_name("if")) {
      ExprPtr expr2 = parse_or();
      ExprPtr expr3;
      if (skip_name("else")) expr3 = parse_condexpr();
      auto e = make(ExprKind::kCond, line);
      e->args.push_back(std::move(expr2));
      e->args.push_back(std::move(expr1));
      e->args.push_back(std::move(expr3));
      expr1 = std::move(e);
    }
    return expr1;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const int line = cur().line;
      next();
      auto e = make(ExprKind::kOr, line);
      e->args.push_back(std::move(left));
      e->args.push_back(parse_and());
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const int line = cur().line;
      next();
      auto e = make(ExprKind::kAnd, line);
      e->args.push_back(std::move(left));
      e->args.push_back(parse_not());
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this);
      auto e = make(ExprKind::kNot, cur().line);
      next();
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr expr = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().type == TokenType::kOperator &&
          (cur().value == "==" || cur().value == "!=" || cur().value == "<" || cur().value == "<=" ||
           cur().value == ">" || cur().value == ">=")) {
        op = cur().value;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && look().type == TokenType::kName && look().value == "in") {
        op = "not in";
        next();
        next();
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(ExprKind::kCompare, line);
        cmp->args.push_back(std::move(expr));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(expr);
  }

  ExprPtr binary(std::string op, ExprPtr left, ExprPtr right, int line) {
    auto e = make(ExprKind::kBinary, line);
    e->name = std::move(op);
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = cur().value;
      const int line = cur().line;
      next();
      left = binary(op, std::move(left), parse_concat(), line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    const int line = cur().line;
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto e = make(ExprKind::kConcat, line);
    e->args.push_back(std::move(first));
    while (skip_op("~")) e->args.push_back(parse_math2());
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = cur().value;
      const int line = cur().line;
      next();
      left = binary(op, std::move(left), parse_pow(), line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const int line = cur().line;
      next();
      left = binary("**", std::move(left), parse_unary(true), line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    const int line = cur().line;
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      node = make(is_op("-") ? ExprKind::kNeg : ExprKind::kPos, line);
      next();
      node->args.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  void note_name(const std::string& name) {
    if (name == "loop" && !loops_.empty()) loops_.back()->uses_loop = true;
    if (macros_.empty()) return;
    if (name == "varargs") macros_.back()->uses_varargs = true;
    if (name == "kwargs") macros_.back()->uses_kwargs = true;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    const int line = t.line;
    if (t.type == TokenType::kName) {
      ExprPtr e;
      if (t.value == "true" || t.value == "True" || t.value == "false" || t.value == "False") {
        e = make(ExprKind::kConst, line);
        e->value = Value(t.value == "true" || t.value == "True");
      } else if (t.value == "none" || t.value == "None") {
        e = make(ExprKind::kConst, line);
        e->value = Value::none();
      } else {
        e = make(ExprKind::kName, line);
        e->name = t.value;
        note_name(t.value);
      }
      next();
      return e;
    }
    if (t.type == TokenType::kString) {
      std::string text;
      while (cur().type == TokenType::kString) {
        text += cur().value;
        next();
      }
      auto e = make(ExprKind::kConst, line);
      e->value = Value(std::move(text));
      return e;
    }
    if (t.type == TokenType::kInteger || t.type == TokenType::kFloat) {
      auto e = make(ExprKind::kConst, line);
      e->value = t.type == TokenType::kInteger ? Value(t.int_value) : Value(t.float_value);
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      ExprPtr e = parse_tuple(true, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = make(ExprKind::kList, line);
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = make(ExprKind::kDict, line);
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      expect_op("}");
      return e;
    }
    error(str("unexpected ", describe(t)));
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter(std::move(node));
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const int line = cur().line;
    if (skip_op(".")) {
      if (cur().type == TokenType::kName) {
        auto e = make(ExprKind::kGetattr, line);
        e->args.push_back(std::move(node));
        e->name = cur().value;
        next();
        return e;
      }
      if (cur().type != TokenType::kInteger) error("expected name or number after '.'");
      auto e = make(ExprKind::kGetitem, line);
      e->args.push_back(std::move(node));
      auto index = make(ExprKind::kConst, line);
      index->value = Value(cur().int_value);
      e->args.push_back(std::move(index));
      next();
      return e;
    }
    expect_op("[");
    std::vector<ExprPtr> subs;
    while (!is_op("]")) {
      if (!subs.empty()) expect_op(",");
      subs.push_back(parse_subscribed(line));
    }
    expect_op("]");
    if (subs.size() != 1) error("subscripts need exactly one index or slice");
    ExprPtr sub = std::move(subs[0]);
    if (sub->kind == ExprKind::kSlice && !sub->args.empty() && sub->args[0] == nullptr) {
      sub->args[0] = std::move(node);
      return sub;
    }
    auto e = make(ExprKind::kGetitem, line);
    e->args.push_back(std::move(node));
    e->args.push_back(std::move(sub));
    return e;
  }

  // One subscript: an expression, or a slice (returned as kSlice with a null object slot).
  ExprPtr parse_subscribed(int line) {
    std::vector<ExprPtr> parts;
    if (skip_op(":")) {
      parts.push_back(nullptr);
    } else {
      ExprPtr e = parse_expression(true);
      if (!skip_op(":")) return e;
      parts.push_back(std::move(e));
    }
    if (is_op(":") || is_op("]") || is_op(",")) {
      parts.push_back(nullptr);
    } else {
      parts.push_back(parse_expression(true));
    }
    if (skip_op(":")) {
      parts.push_back(is_op("]") || is_op(",") ? nullptr : parse_expression(true));
    } else {
      parts.push_back(nullptr);
    }
    auto s = make(ExprKind::kSlice, line);
    s->args.push_back(nullptr);  // the object, filled by parse_subscript
    for (auto& p : parts) s->args.push_back(std::move(p));
    return s;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool require_comma = false;
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) error("*args and **kwargs in calls are not supported");
      if (cur().type == TokenType::kName && look().type == TokenType::kOperator && look().value == "=") {
        std::string key = cur().value;
        next();
        next();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!e.kwargs.empty()) error("positional argument follows keyword argument");
        e.args.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = make(ExprKind::kCall, cur().line);
    e->args.push_back(std::move(node));
    parse_call_args(*e);
    return e;
  }

  std::string parse_dotted_name() {
    std::string name = expect_name();
    while (skip_op(".")) name += "." + expect_name();
    return name;
  }

  ExprPtr parse_filter(ExprPtr node) {
    expect_op("|");
    const int line = cur().line;
    auto e = make(ExprKind::kFilter, line);
    e->name = parse_dotted_name();
    e->filter = find_filter(e->name);
    if (e->filter == nullptr) {
      if (is_unsupported_builtin_filter(e->name)) {
        error_at(line, str("the '", e->name, "' filter is not supported by Relay's chat template interpreter"));
      }
      error_at(line, str("no filter named '", e->name, "'"));
    }
    e->args.push_back(std::move(node));
    if (is_op("(")) parse_call_args(*e);
    return e;
  }

  ExprPtr parse_test(ExprPtr node) {
    const int line = cur().line;
    next();  // is
    const bool negated = skip_name("not");
    auto e = make(ExprKind::kTest, line);
    e->name = parse_dotted_name();
    e->test = find_test(e->name);
    if (e->test == nullptr) error_at(line, str("no test named '", e->name, "'"));
    e->args.push_back(std::move(node));
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((cur().type == TokenType::kName || cur().type == TokenType::kString ||
                cur().type == TokenType::kInteger || cur().type == TokenType::kFloat || is_op("(") ||
                is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) error("you cannot chain multiple tests with 'is'");
      e->args.push_back(parse_postfix(parse_primary()));
    }
    if (!negated) return e;
    auto n = make(ExprKind::kNot, line);
    n->args.push_back(std::move(e));
    return n;
  }
};

}  // namespace

Program parse(std::string_view source) { return Parser(tokenize(source)).parse_program(); }

}  // namespace relay::chat::jinja

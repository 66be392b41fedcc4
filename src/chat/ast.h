// Syntax tree of a parsed Jinja template: expressions and statements, built by parser.cpp and walked
// by interpreter.cpp.
//
// One node struct per tree (Expr, Stmt) with a kind tag rather than a class per node: the evaluator is
// a switch over kinds, and the fields a kind uses are documented next to each field. Filters and
// tests are resolved to function pointers at parse time, so an unknown filter is a syntax error (as
// jinja2's TemplateAssertionError is) and a render does no name lookups for them.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/value.h"

namespace relay::chat::jinja {

// Filters take the piped value and the call's arguments; tests answer `value is name(args)`.
using FilterFn = Value (*)(const Value& operand, const CallArgs& args);
using TestFn = bool (*)(const Value& operand, const CallArgs& args);

enum class ExprKind : uint8_t {
  kConst,    // value
  kName,     // name
  kList,     // args: items
  kTuple,    // args: items
  kDict,     // args: key0, value0, key1, value1, ...
  kGetattr,  // args[0].name
  kGetitem,  // args[0][args[1]]
  kSlice,    // args[0][args[1]:args[2]:args[3]], omitted parts are null
  kCall,     // args[0](args[1..], kwargs)
  kFilter,   // args[0] | name(args[1..], kwargs); args[0] is null in a `{% set x | f %}` block
  kTest,     // args[0] is name(args[1..], kwargs)
  kNot,      // not args[0]
  kNeg,      // -args[0]
  kPos,      // +args[0]
  kBinary,   // args[0] <name> args[1], name in + - * / // % **
  kCompare,  // args[0] ops[0] args[1] ops[1] args[2] ... (chained as in Python)
  kAnd,      // args[0] and args[1]
  kOr,       // args[0] or args[1]
  kCond,     // args[1] if args[0] else args[2] (args[2] null: undefined)
  kConcat,   // args[0] ~ args[1] ~ ...
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind;
  int line = 0;
  std::string name;
  Value value;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  FilterFn filter = nullptr;
  TestFn test = nullptr;
};

enum class StmtKind : uint8_t {
  kOutput,    // text
  kPrint,     // {{ expr }}
  kIf,        // if expr: body else: else_body (an elif is an If inside else_body)
  kFor,       // for targets in expr [if filter]: body else: else_body
  kSet,       // set targets = expr, or set targets[0].attribute = expr (namespace)
  kSetBlock,  // set targets[0] | filters: body
  kMacro,     // macro name(params): body
  kBreak,
  kContinue,
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  std::vector<std::string> targets;
  std::string attribute;
  ExprPtr filter;
  std::vector<ExprPtr> filters;
  std::vector<StmtPtr> body;
  std::vector<StmtPtr> else_body;
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;  // default expression null when required
  bool uses_varargs = false;  // the macro body reads `varargs`: extra positional arguments allowed
  bool uses_kwargs = false;   // the macro body reads `kwargs`: unknown keyword arguments allowed
  bool uses_loop = false;     // the for body reads `loop`: build the loop object per iteration
};

struct Program {
  std::vector<StmtPtr> body;
};

}  // namespace relay::chat::jinja

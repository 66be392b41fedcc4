// Python string semantics over UTF-8 bytes, for the Jinja interpreter.
//
// Chat templates are Python code in disguise: `content.strip('\n')`, `split('</think>')[-1]`, `x|trim`
// and `str(1.0)` must give exactly what CPython gives. Relay keeps strings as UTF-8 std::string; the
// functions here decode to code points only where Python's answer depends on them (whitespace classes,
// strip character sets, case mapping, indexing and length) and work on bytes elsewhere (find, split,
// replace on valid UTF-8 give the same answer either way).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace relay::chat::pystr {

// Code points of a UTF-8 string (invalid bytes decode to U+FFFD, as Python's "replace" handler would).
std::u32string decode(std::string_view s);
std::string encode(std::u32string_view cps);
// Number of code points (Python's len()).
size_t length(std::string_view s);

// str.isspace() for one code point (Python's whitespace set, wider than C's).
bool is_space(char32_t cp);
// str.isprintable() for one code point, as repr() uses it.
bool is_printable(char32_t cp);

// str.strip/lstrip/rstrip: chars == nullopt strips whitespace, otherwise any code point in *chars.
std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right);
// str.split / str.rsplit; sep == nullopt splits on whitespace runs. max_split < 0 means no limit.
std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, int64_t max_split);
std::vector<std::string> rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t max_split);
// str.replace(old, new, count); count < 0 replaces all.
std::string replace(std::string_view s, std::string_view old_text, std::string_view new_text, int64_t count);
// str.count(sub) (non-overlapping; the empty string occurs len+1 times).
int64_t count(std::string_view s, std::string_view sub);
// str.find(sub) as a code point index, -1 when absent.
int64_t find(std::string_view s, std::string_view sub);

std::string upper(std::string_view s);
std::string lower(std::string_view s);
// str.title() and str.capitalize() (Python's definitions, not Jinja's `title` filter).
std::string title(std::string_view s);
std::string capitalize(std::string_view s);

// repr(str): quotes chosen and characters escaped as CPython does.
std::string repr(std::string_view s);
// repr(float) / str(float): shortest round-trip digits, fixed or exponent form by CPython's rule.
std::string float_repr(double x);

}  // namespace relay::chat::pystr

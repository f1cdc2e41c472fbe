#pragma once

// The compiled form of a chat template (chat_template.hpp): the parser (chat_template.cpp) builds
// it, the renderer (chat_template_render.cpp) walks it. Private to those two files.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpu/chat_template.hpp"

namespace baton::gpu::jinja {

using value = nlohmann::ordered_json;

/// Jinja's undefined (a missing variable, key or attribute): renders as nothing, is false, and
/// `is defined` tells it apart from none. JSON's "discarded" kind never occurs in data.
inline value undefined() { return value(value::value_t::discarded); }
inline bool is_undefined(const value& v) { return v.is_discarded(); }

/// What a template does that it may not: raised while compiling or rendering, caught at the
/// chat_template boundary and turned into its `why`.
struct error {
  std::string what;
};

struct expr;
using expr_ptr = std::shared_ptr<const expr>;

struct expr {
  enum class kind {
    literal,  ///< value
    name,     ///< text
    attr,     ///< args[0].text
    item,     ///< args[0][args[1]]
    slice,    ///< args[0][args[1]:args[2]:args[3]] (null: left out)
    call,     ///< args[0](args[1..], kwargs)
    filter,   ///< args[0] | text(args[1..], kwargs)
    test,     ///< args[0] is [not] text(args[1..])
    neg,      ///< -args[0]
    not_,     ///< not args[0]
    binary,   ///< args[0] text args[1]: + - * / // % ** ~ and or in "not in" == != < > <= >=
    cond,     ///< args[0] if args[1] else args[2] (null: undefined)
    list,     ///< [args...]
    dict,     ///< {args[0]: args[1], ...}
  };
  kind k = kind::literal;
  int line = 0;
  std::string text;
  value literal;
  bool negated = false;  ///< `is not`
  std::vector<expr_ptr> args;
  std::vector<std::pair<std::string, expr_ptr>> kwargs;
};

struct stmt;
using body = std::vector<std::shared_ptr<const stmt>>;

struct stmt {
  enum class kind {
    text,       ///< text
    output,     ///< {{ e }}
    if_,        ///< branches, else_body
    for_,       ///< for targets in e [if filter]: inner; else_body when it ran no iteration
    set,        ///< set targets[0][.targets[1]] = e
    set_block,  ///< set targets[0]: inner rendered
    macro,      ///< macro text(params): inner
    break_,
    continue_,
  };
  kind k = kind::text;
  int line = 0;
  std::string text;
  expr_ptr e;
  expr_ptr filter;
  std::vector<std::pair<expr_ptr, body>> branches;
  body inner;
  body else_body;
  std::vector<std::string> targets;
  std::vector<std::pair<std::string, expr_ptr>> params;  ///< a macro's, with their defaults (null: none)
};

}  // namespace baton::gpu::jinja

namespace baton::gpu {

struct chat_template::program {
  jinja::body root;
};

namespace jinja {

// Python's view of values (chat_template_values.cpp). `line` names the template line in errors.
const char* type_name(const value& v);                 ///< Python's: str, int, dict, ...
bool is_number(const value& v);                        ///< a number or a bool (Python's True is 1)
bool is_integral(const value& v);                      ///< an int or a bool
double as_double(const value& v);
int64_t as_int(const value& v);
bool truthy(const value& v);                           ///< Python's bool(): empty, 0, None, undefined are false
std::string py_float(double d);                        ///< repr(): the shortest text that reads back
std::string py_repr(const value& v);                   ///< repr(): 'quoted', [1, 'a'], {'k': None}
std::string to_text(const value& v);                   ///< str(), what {{ v }} writes (undefined: nothing)
/// json.dumps's options, as transformers' tojson passes them (ensure_ascii off by default).
struct json_style {
  int indent = -1;  ///< -1: one line
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::string item_separator = ", ";  ///< "," once indented (Python's default)
  std::string key_separator = ": ";
};
void dump_json(const value& v, const json_style& style, int level, int line, std::string& out);  ///< json.dumps
bool equal(const value& a, const value& b);            ///< ==, with 1 == 1.0 == True
bool less(const value& a, const value& b, int line);   ///< <, numbers and strings and lists only
std::vector<size_t> char_starts(const std::string& s);  ///< each UTF-8 character's byte offset, then the size
size_t length_of(const value& v, int line);            ///< len(); a string's in characters
std::vector<value> items_of(const value& v, int line);  ///< what a for loop visits: items, keys or characters
value to_list(const std::vector<value>& items);
bool is_space(uint32_t c);  ///< Python's str.isspace() of one code point
std::string strip(const std::string& s, const value& chars, bool left, bool right);  ///< chars: null for whitespace
value split(const std::string& s, const value& sep, int64_t maxsplit);             ///< str.split()
std::string replace_all(std::string s, const std::string& from, const std::string& to, int64_t count);
std::string case_of(std::string s, int how);  ///< 0 lower, 1 upper, 2 capitalize, 3 title (ASCII letters)

/// Renders `p` with `context`'s keys as variables; throws error.
std::string render_program(const chat_template::program& p, const value& context);
/// The filters, tests, methods and functions the renderer has (the parser refuses the others).
bool known_filter(const std::string& name);
bool known_test(const std::string& name);
bool known_method(const std::string& name);
bool known_function(const std::string& name);
}  // namespace jinja

}  // namespace baton::gpu

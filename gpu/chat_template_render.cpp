// The chat template's renderer: walks the compiled tree with Python's and Jinja's semantics for
// what chat templates use (truthiness, ==, +, //, %, slices, str() and repr() of values, json.dumps
// for tojson, a fresh scope per loop iteration so that only namespaces carry state out).

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <optional>
#include <set>
#include <unordered_map>

#include "gpu/chat_template_ast.hpp"

namespace baton::gpu::jinja {

namespace {

/// Bounds on what a template may make: a prompt is far smaller; these stop a runaway loop.
constexpr size_t max_output_bytes = 64u << 20;
constexpr size_t max_range = 1u << 20;
constexpr size_t max_steps = 1u << 20;  ///< loop iterations and macro calls, all together
/// Bytes and items the template's values copy, all together: a loop that grows a list or a string
/// by one each turn copies it whole each turn, quadratic work that max_steps alone let run for
/// minutes. A real template copies a few times its output.
constexpr size_t max_work = size_t{1} << 28;
/// How deep a list or dict the template builds may nest: values are copied (and freed)
/// recursively, so a loop wrapping a list in a list each turn would overflow the stack.
constexpr size_t max_value_depth = 64;

/// Whether `v` nests lists and dicts deeper than `limit`; `*visited` counts the values looked at.
bool nests_deeper_than(const value& v, size_t limit, size_t* visited) {
  ++*visited;
  if (!v.is_array() && !v.is_object()) return false;
  if (limit == 0) return true;
  for (const auto& x : v)
    if (nests_deeper_than(x, limit - 1, visited)) return true;
  return false;
}
constexpr int max_macro_depth = 64;

[[noreturn]] void fail(int line, const std::string& what) {
  throw error{"chat template line " + std::to_string(line) + ": " + what};
}

// ---- The renderer -----------------------------------------------------------------------------

enum class flow { normal, break_, continue_ };

class renderer {
public:
  explicit renderer(const value& context) {
    frames_.emplace_back();
    for (const auto& [k, v] : context.items()) frames_.back()[k] = v;
  }

  flow run(const body& b, std::string& out) {
    for (const auto& s : b) {
      const flow f = exec(*s, out);
      if (f != flow::normal) return f;
      if (out.size() > max_output_bytes) fail(s->line, "the rendered text passed " + std::to_string(max_output_bytes) + " bytes");
    }
    return flow::normal;
  }

private:
  using frame = std::unordered_map<std::string, value>;

  value* find(const std::string& name) {
    for (auto f = frames_.rbegin(); f != frames_.rend(); ++f)
      if (auto it = f->find(name); it != f->end()) return &it->second;
    return nullptr;
  }

  flow exec(const stmt& s, std::string& out) {
    switch (s.k) {
      case stmt::kind::text: out += s.text; return flow::normal;
      case stmt::kind::output: out += to_text(eval(*s.e)); return flow::normal;
      case stmt::kind::if_:
        for (const auto& [cond, inner] : s.branches)
          if (truthy(eval(*cond))) return run(inner, out);
        return run(s.else_body, out);
      case stmt::kind::for_: return loop(s, out);
      case stmt::kind::set: {
        value v = eval(*s.e);
        if (s.targets.size() == 1) {
          frames_.back()[s.targets[0]] = std::move(v);
        } else {
          value* ns = find(s.targets[0]);
          if (!ns || !ns->is_object()) fail(s.line, "'" + s.targets[0] + "' is not a namespace: its attributes cannot be set");
          (*ns)[s.targets[1]] = std::move(v);
        }
        return flow::normal;
      }
      case stmt::kind::set_block: {
        std::string inner;
        run(s.inner, inner);
        frames_.back()[s.targets[0]] = inner;
        return flow::normal;
      }
      case stmt::kind::macro: macros_[s.text] = &s; return flow::normal;
      case stmt::kind::break_: return flow::break_;
      case stmt::kind::continue_: return flow::continue_;
    }
    return flow::normal;
  }

  void bind(const stmt& s, const value& item) {
    if (s.targets.size() == 1) {
      frames_.back()[s.targets[0]] = item;
      return;
    }
    if (!item.is_array() || item.size() != s.targets.size())
      fail(s.line, "cannot unpack " + py_repr(item) + " into " + std::to_string(s.targets.size()) + " names");
    for (size_t i = 0; i < s.targets.size(); ++i) frames_.back()[s.targets[i]] = item[i];
  }

  flow loop(const stmt& s, std::string& out) {
    const value iterable = eval(*s.e);
    if (iterable.is_null()) fail(s.line, "none cannot be iterated");
    std::vector<value> items = items_of(iterable, s.line);
    if (s.filter) {  // Jinja filters first: loop.* count what is left
      std::vector<value> kept;
      for (auto& x : items) {
        frames_.emplace_back();
        bind(s, x);
        const bool keep = truthy(eval(*s.filter));
        frames_.pop_back();
        if (keep) kept.push_back(std::move(x));
      }
      items = std::move(kept);
    }
    for (size_t i = 0; i < items.size(); ++i) {
      step(s.line);
      // A fresh scope each time: what the body sets is gone by the next iteration (Jinja's rule).
      frames_.emplace_back();
      bind(s, items[i]);
      const auto n = static_cast<int64_t>(items.size()), k = static_cast<int64_t>(i);
      value lp = {{"index", k + 1}, {"index0", k},         {"revindex", n - k}, {"revindex0", n - k - 1},
                  {"first", i == 0}, {"last", k == n - 1}, {"length", n}};
      lp["previtem"] = i > 0 ? items[i - 1] : undefined();
      lp["nextitem"] = k + 1 < n ? items[i + 1] : undefined();
      frames_.back()["loop"] = std::move(lp);
      const flow f = run(s.inner, out);
      frames_.pop_back();
      if (f == flow::break_) break;
    }
    if (items.empty()) return run(s.else_body, out);
    return flow::normal;
  }

  // ---- expressions ----

  value eval(const expr& e) {
    switch (e.k) {
      case expr::kind::literal: return e.literal;
      case expr::kind::name: {
        if (const value* v = find(e.text)) return copied(*v, e.line);
        // A global function is defined (`strftime_now is defined` picks the date a template
        // writes); as a value it is only its name.
        return known_function(e.text) ? value("<function " + e.text + ">") : undefined();
      }
      case expr::kind::attr:
        if (const value* v = ref(*e.args[0])) return copied(attribute(*v, e.text, e), e.line);
        return attribute(eval(*e.args[0]), e.text, e);
      case expr::kind::item: {
        // The key first: evaluating it may call a macro that sets a namespace's attribute, which
        // moves the values a pointer from ref() would point into.
        const value key = eval(*e.args[1]);
        if (const value* v = ref(*e.args[0])) return copied(item(*v, key, e), e.line);
        return item(eval(*e.args[0]), key, e);
      }
      case expr::kind::slice: return slice(e);
      case expr::kind::call: return held(call(e), e.line);
      case expr::kind::filter: return held(filter(e), e.line);
      case expr::kind::test: return test(e) != e.negated;
      case expr::kind::neg: {
        const value v = eval(*e.args[0]);
        if (!is_number(v)) fail(e.line, std::string{"cannot negate a "} + type_name(v));
        if (is_integral(v) && as_int(v) == INT64_MIN) fail(e.line, "integer overflow");
        return is_integral(v) ? value(-as_int(v)) : value(-as_double(v));
      }
      case expr::kind::not_: return !truthy(eval(*e.args[0]));
      case expr::kind::binary: return binary(e);
      case expr::kind::cond:
        if (truthy(eval(*e.args[1]))) return eval(*e.args[0]);
        return e.args[2] ? eval(*e.args[2]) : undefined();
      case expr::kind::list: {
        value out = value::array();
        for (const auto& a : e.args) out.push_back(eval(*a));
        return shallow(std::move(out), e.line);
      }
      case expr::kind::dict: {
        value out = value::object();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          const value k = eval(*e.args[i]);
          if (!k.is_string()) fail(e.line, "dict keys must be strings here, got a " + std::string{type_name(k)});
          out[k.get<std::string>()] = eval(*e.args[i + 1]);
        }
        return shallow(std::move(out), e.line);
      }
    }
    return undefined();
  }

  /// The value `e` names, without copying it: a variable, or an attribute or item of one (null
  /// when `e` is computed, or names nothing). A template reads a turn, or the conversation's
  /// length, once per turn: copying the conversation each time would make rendering quadratic.
  const value* ref(const expr& e) {
    if (e.k == expr::kind::name) return find(e.text);
    if (e.k != expr::kind::attr && e.k != expr::kind::item) return nullptr;
    // The key before the pointer (see eval's item): nothing is evaluated once it is taken.
    const value key = e.k == expr::kind::attr ? value(e.text) : eval(*e.args[1]);
    const value* v = ref(*e.args[0]);
    if (!v) return nullptr;
    if (v->is_object() && key.is_string()) {
      const auto it = v->find(key.get_ref<const std::string&>());
      return it == v->end() ? nullptr : &*it;
    }
    if (v->is_array() && e.k == expr::kind::item && is_integral(key)) {
      const auto n = static_cast<int64_t>(v->size());
      const int64_t i = as_int(key) < 0 ? as_int(key) + n : as_int(key);
      return i < 0 || i >= n ? nullptr : &(*v)[static_cast<size_t>(i)];
    }
    return nullptr;
  }

  static std::string what(const expr& e) {
    if (e.k == expr::kind::name) return "'" + e.text + "'";
    if (e.k == expr::kind::attr) return what(*e.args[0]) + "." + e.text;
    return "the value";
  }

  value attribute(const value& v, const std::string& name, const expr& e) {
    if (is_undefined(v)) fail(e.line, what(*e.args[0]) + " is undefined: it has no attribute '" + name + "'");
    if (v.is_object()) {
      const auto it = v.find(name);
      return it == v.end() ? undefined() : *it;
    }
    return undefined();
  }

  value item(const value& v, const value& key, const expr& e) {
    if (is_undefined(v)) fail(e.line, what(*e.args[0]) + " is undefined: it has no item " + py_repr(key));
    if (v.is_object() && key.is_string()) {
      const auto it = v.find(key.get<std::string>());
      return it == v.end() ? undefined() : *it;
    }
    if ((v.is_array() || v.is_string()) && is_integral(key)) {
      const auto items = v.is_array() ? std::vector<value>{} : items_of(v, e.line);
      const auto n = static_cast<int64_t>(v.is_array() ? v.size() : items.size());
      int64_t i = as_int(key);
      if (i < 0) i += n;
      if (i < 0 || i >= n) return undefined();
      return v.is_array() ? v[static_cast<size_t>(i)] : items[static_cast<size_t>(i)];
    }
    return undefined();
  }

  value slice(const expr& e) {
    const value v = eval(*e.args[0]);
    const auto bound = [&](const expr_ptr& p) -> std::optional<int64_t> {
      if (!p) return std::nullopt;
      const value b = eval(*p);
      if (b.is_null()) return std::nullopt;
      if (!is_integral(b)) fail(e.line, "slice bounds must be integers");
      return as_int(b);
    };
    const std::vector<value> items = v.is_array() || v.is_string() ? items_of(v, e.line) : std::vector<value>{};
    if (!v.is_array() && !v.is_string()) fail(e.line, std::string{"a "} + type_name(v) + " cannot be sliced");
    const auto n = static_cast<int64_t>(items.size());
    const int64_t step = bound(e.args[3]).value_or(1);
    if (step == 0) fail(e.line, "slice step cannot be zero");
    // Python's rules: negative bounds count from the end, then clamp to the sequence.
    const auto clamp = [&](std::optional<int64_t> b, int64_t dflt) {
      if (!b) return dflt;
      int64_t x = *b < 0 ? *b + n : *b;
      return step > 0 ? std::clamp<int64_t>(x, 0, n) : std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t start = clamp(bound(e.args[1]), step > 0 ? 0 : n - 1);
    const int64_t stop = clamp(bound(e.args[2]), step > 0 ? n : -1);
    std::vector<value> picked;
    // By count, not by stepping past the end: a huge step must not overflow.
    const int64_t span = step > 0 ? stop - start : start - stop;
    const int64_t stride = step > 0 ? step : (step == INT64_MIN ? INT64_MAX : -step);
    const int64_t count = span <= 0 ? 0 : 1 + (span - 1) / stride;
    for (int64_t k = 0; k < count; ++k) picked.push_back(items[static_cast<size_t>(start + (step > 0 ? k * stride : -k * stride))]);
    if (v.is_array()) return to_list(picked);
    std::string s;
    for (const auto& c : picked) s += c.get<std::string>();
    return s;
  }

  value binary(const expr& e) {
    const std::string& op = e.text;
    if (op == "and") {
      value a = eval(*e.args[0]);
      return truthy(a) ? eval(*e.args[1]) : a;
    }
    if (op == "or") {
      value a = eval(*e.args[0]);
      return truthy(a) ? a : eval(*e.args[1]);
    }
    const value a = eval(*e.args[0]), b = eval(*e.args[1]);
    if (op == "==") return equal(a, b);
    if (op == "!=") return !equal(a, b);
    if (op == "<") return less(a, b, e.line);
    if (op == ">") return less(b, a, e.line);
    if (op == "<=") return !less(b, a, e.line);
    if (op == ">=") return !less(a, b, e.line);
    if (op == "in" || op == "not in") return contains(b, a, e.line) == (op == "in");
    if (op == "~") return bounded(to_text(a) + to_text(b), e.line);
    if (op == "+") {
      if (a.is_string() && b.is_string()) return bounded(a.get<std::string>() + b.get<std::string>(), e.line);
      if (a.is_array() && b.is_array()) {
        if (a.size() + b.size() > max_range) fail(e.line, "a list grew past " + std::to_string(max_range) + " items");
        charge(a.size() + b.size(), e.line);
        value out = a;
        for (const auto& x : b) out.push_back(x);
        return out;
      }
    }
    if (op == "*" && (a.is_string() || a.is_array()) && is_integral(b)) {
      const int64_t times = std::max<int64_t>(as_int(b), 0);
      if (times == 0 || a.empty() || (a.is_string() && a.get_ref<const std::string&>().empty()))
        return a.is_string() ? value("") : value::array();
      if (a.is_string()) {
        const auto& s = a.get_ref<const std::string&>();
        if (!s.empty() && static_cast<uint64_t>(times) > max_output_bytes / s.size())
          fail(e.line, "a string grew past " + std::to_string(max_output_bytes) + " bytes");
        charge(static_cast<size_t>(times) * s.size(), e.line);
        std::string out;
        for (int64_t i = 0; i < times; ++i) out += s;
        return out;
      }
      if (!a.empty() && static_cast<uint64_t>(times) > max_range / a.size()) fail(e.line, "a list grew past " + std::to_string(max_range) + " items");
      charge(static_cast<size_t>(times) * a.size(), e.line);
      value out = value::array();
      for (int64_t i = 0; i < times; ++i)
        for (const auto& x : a) out.push_back(x);
      return out;
    }
    if (!is_number(a) || !is_number(b))
      fail(e.line, std::string{"cannot apply '"} + op + "' to " + type_name(a) + " and " + type_name(b));
    const bool ints = is_integral(a) && is_integral(b);
    const double x = as_double(a), y = as_double(b);
    if ((op == "/" || op == "//" || op == "%") && y == 0) fail(e.line, "division by zero");
    int64_t r = 0;
    const auto checked = [&](bool overflowed) -> value {
      if (overflowed) fail(e.line, "integer overflow in '" + op + "'");
      return r;
    };
    if (op == "+") return ints ? checked(__builtin_add_overflow(as_int(a), as_int(b), &r)) : value(x + y);
    if (op == "-") return ints ? checked(__builtin_sub_overflow(as_int(a), as_int(b), &r)) : value(x - y);
    if (op == "*") return ints ? checked(__builtin_mul_overflow(as_int(a), as_int(b), &r)) : value(x * y);
    if (op == "/") return x / y;
    if (op == "//" && ints) {  // Python floors; exact in integers
      const int64_t p = as_int(a), q = as_int(b);
      if (p == INT64_MIN && q == -1) fail(e.line, "integer overflow in '//'");
      return p / q - ((p % q != 0) && ((p < 0) != (q < 0)) ? 1 : 0);
    }
    if (op == "//") return std::floor(x / y);
    if (op == "%" && ints) {  // the divisor's sign, as Python's
      const int64_t p = as_int(a), q = as_int(b);
      if (q == -1) return int64_t{0};
      const int64_t m = p % q;
      return m != 0 && ((m < 0) != (q < 0)) ? m + q : m;
    }
    if (op == "%") {
      const double m = x - y * std::floor(x / y);  // the divisor's sign, as Python's
      return ints ? value(static_cast<int64_t>(m)) : value(m);
    }
    if (op == "**" && ints && as_int(b) >= 0) {
      const double p = std::pow(x, y);
      if (!(std::fabs(p) < 9.2e18)) fail(e.line, "integer overflow in '**'");
      return static_cast<int64_t>(p);
    }
    if (op == "**") return std::pow(x, y);
    fail(e.line, "unknown operator " + op);
  }

  static bool contains(const value& haystack, const value& needle, int line) {
    if (haystack.is_string()) {
      if (!needle.is_string()) fail(line, "'in <string>' needs a string on its left");
      return haystack.get_ref<const std::string&>().find(needle.get_ref<const std::string&>()) != std::string::npos;
    }
    if (haystack.is_array()) {
      for (const auto& x : haystack)
        if (equal(x, needle)) return true;
      return false;
    }
    if (haystack.is_object()) return needle.is_string() && haystack.contains(needle.get<std::string>());
    if (is_undefined(haystack)) return false;
    fail(line, std::string{"cannot look for a value in a "} + type_name(haystack));
  }

  /// Positional and keyword arguments, evaluated; `names` gives each positional slot's keyword.
  struct arguments {
    std::vector<value> values;  ///< by slot; undefined where not given
    value get(size_t i, value dflt = undefined()) const {
      return i < values.size() && !is_undefined(values[i]) ? values[i] : dflt;
    }
  };
  arguments args_of(const expr& e, std::vector<std::string> names, size_t first = 1) {
    arguments a;
    a.values.assign(std::max(names.size(), e.args.size() - std::min(first, e.args.size())), undefined());
    for (size_t i = first; i < e.args.size(); ++i) a.values[i - first] = eval(*e.args[i]);
    for (const auto& [k, x] : e.kwargs) {
      const auto it = std::find(names.begin(), names.end(), k);
      if (it == names.end()) fail(e.line, "'" + e.text + "' takes no argument named '" + k + "'");
      a.values[static_cast<size_t>(it - names.begin())] = eval(*x);
    }
    return a;
  }

  value call(const expr& e) {
    const expr& callee = *e.args[0];
    if (callee.k == expr::kind::attr) return method(eval(*callee.args[0]), callee.text, e);
    const std::string& name = callee.text;
    if (auto m = macros_.find(name); m != macros_.end()) return invoke(*m->second, e);
    if (name == "raise_exception") {
      const value msg = e.args.size() > 1 ? eval(*e.args[1]) : value("");
      throw error{to_text(msg)};
    }
    if (name == "namespace" || name == "dict") {
      value out = value::object();
      if (e.args.size() > 1) {
        const value init = eval(*e.args[1]);
        if (init.is_object()) out = init;
      }
      for (const auto& [k, x] : e.kwargs) out[k] = eval(*x);
      return out;
    }
    if (name == "range") {
      std::vector<int64_t> a;
      for (size_t i = 1; i < e.args.size(); ++i) {
        const value x = eval(*e.args[i]);
        if (!is_integral(x)) fail(e.line, "range() takes integers");
        a.push_back(as_int(x));
      }
      if (a.empty() || a.size() > 3) fail(e.line, "range() takes one to three integers");
      const int64_t start = a.size() > 1 ? a[0] : 0, stop = a.size() > 1 ? a[1] : a[0], step = a.size() > 2 ? a[2] : 1;
      if (step == 0) fail(e.line, "range() step cannot be zero");
      value out = value::array();
      for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
        if (out.size() >= max_range) fail(e.line, "range() is too long");
        out.push_back(i);
        if (__builtin_add_overflow(i, step, &i)) break;
      }
      return out;
    }
    if (name == "strftime_now") {
      const value fmt = e.args.size() > 1 ? eval(*e.args[1]) : value("");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, to_text(fmt).c_str(), &tm);
      return std::string(buf, n);
    }
    fail(e.line, "the function '" + name + "' is not defined");
  }

  value invoke(const stmt& m, const expr& e) {
    if (depth_ >= max_macro_depth) fail(e.line, "macros call each other more than " + std::to_string(max_macro_depth) + " deep");
    if (e.args.size() - 1 > m.params.size()) fail(e.line, "the macro '" + m.text + "' takes " + std::to_string(m.params.size()) + " arguments");
    frame f;
    for (size_t i = 0; i < m.params.size(); ++i) f[m.params[i].first] = undefined();
    for (size_t i = 1; i < e.args.size(); ++i) f[m.params[i - 1].first] = eval(*e.args[i]);
    for (const auto& [k, x] : e.kwargs) {
      if (!f.count(k)) fail(e.line, "the macro '" + m.text + "' has no parameter '" + k + "'");
      f[k] = eval(*x);
    }
    frames_.push_back(std::move(f));
    for (const auto& [k, d] : m.params)
      if (is_undefined(frames_.back()[k]) && d) frames_.back()[k] = eval(*d);
    ++depth_;
    step(e.line);
    std::string out;
    run(m.inner, out);
    --depth_;
    frames_.pop_back();
    return out;
  }

  value method(const value& self, const std::string& name, const expr& e) {
    if (is_undefined(self)) fail(e.line, what(*e.args[0]->args[0]) + " is undefined: it has no method '" + name + "'");
    if (self.is_string()) {
      const auto& s = self.get_ref<const std::string&>();
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        const auto a = args_of(e, {"chars"});
        return strip(s, a.get(0), name != "rstrip", name != "lstrip");
      }
      if (name == "split") {
        const auto a = args_of(e, {"sep", "maxsplit"});
        const value max = a.get(1, -1);
        return jinja::split(s, a.get(0), is_integral(max) ? as_int(max) : -1);
      }
      if (name == "startswith" || name == "endswith") {
        const value x = args_of(e, {"prefix"}).get(0);
        std::vector<value> options = x.is_array() ? items_of(x, e.line) : std::vector<value>{x};
        for (const auto& o : options) {
          if (!o.is_string()) fail(e.line, name + "() takes a string or a tuple of strings");
          const auto& p = o.get_ref<const std::string&>();
          if (p.size() <= s.size() && s.compare(name == "startswith" ? 0 : s.size() - p.size(), p.size(), p) == 0) return true;
        }
        return false;
      }
      if (name == "lower") return case_of(s, 0);
      if (name == "upper") return case_of(s, 1);
      if (name == "capitalize") return case_of(s, 2);
      if (name == "title") return case_of(s, 3);
      if (name == "replace") {
        const auto a = args_of(e, {"old", "new", "count"});
        const value count = a.get(2, -1);
        return replace_all(s, to_text(a.get(0)), to_text(a.get(1)), is_integral(count) ? as_int(count) : -1);
      }
      if (name == "join") {
        std::string out;
        const auto items = items_of(args_of(e, {"iterable"}).get(0), e.line);
        for (size_t i = 0; i < items.size(); ++i) out += (i ? s : "") + to_text(items[i]);
        return out;
      }
      if (name == "find") {
        const auto at = s.find(to_text(args_of(e, {"sub"}).get(0)));
        return at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(char_starts(s.substr(0, at)).size() - 1);
      }
      if (name == "count") {
        const std::string sub = to_text(args_of(e, {"sub"}).get(0));
        int64_t n = 0;
        for (size_t at = 0; !sub.empty() && (at = s.find(sub, at)) != std::string::npos; at += sub.size()) ++n;
        return n;
      }
    }
    if (self.is_object()) {
      if (name == "items" || name == "keys" || name == "values") {
        value out = value::array();
        for (const auto& [k, x] : self.items())
          out.push_back(name == "items" ? value::array({k, x}) : name == "keys" ? value(k) : x);
        return out;
      }
      if (name == "get") {
        const auto a = args_of(e, {"key", "default"});
        const value k = a.get(0);
        if (k.is_string())
          if (auto it = self.find(k.get<std::string>()); it != self.end()) return *it;
        return a.get(1, nullptr);
      }
    }
    fail(e.line, std::string{"a "} + type_name(self) + " has no method '" + name + "'");
  }

  value filter(const expr& e) {
    if (e.text == "length" || e.text == "count")
      if (const value* v = ref(*e.args[0])) return static_cast<int64_t>(length_of(*v, e.line));  // no copy
    return apply_filter(e.text, eval(*e.args[0]), e);
  }

  value apply_filter(const std::string& name, const value& v, const expr& e, size_t first_arg = 1) {
    if (name == "length" || name == "count") return static_cast<int64_t>(length_of(v, e.line));
    if (name == "trim") return strip(to_text(v), args_of(e, {"chars"}, first_arg).get(0), true, true);
    if (name == "default" || name == "d") {
      const auto a = args_of(e, {"default_value", "boolean"}, first_arg);
      const bool use = is_undefined(v) || (truthy(a.get(1, false)) && !truthy(v));
      return use ? a.get(0, "") : v;
    }
    if (name == "tojson") {
      const auto a = args_of(e, {"ensure_ascii", "indent", "separators", "sort_keys"}, first_arg);
      json_style style;
      style.ensure_ascii = truthy(a.get(0, false));
      const value indent = a.get(1, nullptr);
      if (is_integral(indent)) style.indent = static_cast<int>(std::clamp<int64_t>(as_int(indent), 0, 64));
      else if (indent.is_string()) fail(e.line, "tojson's indent must be a number");
      if (style.indent >= 0) style.item_separator = ",";
      const value separators = a.get(2, nullptr);
      if (separators.is_array() && separators.size() == 2 && separators[0].is_string() && separators[1].is_string()) {
        style.item_separator = separators[0].get<std::string>();
        style.key_separator = separators[1].get<std::string>();
      } else if (!separators.is_null()) {
        fail(e.line, "tojson's separators must be two strings");
      }
      style.sort_keys = truthy(a.get(3, false));
      std::string out;
      dump_json(v, style, 0, e.line, out);
      return out;
    }
    if (name == "string") return to_text(v);
    if (name == "safe") return v;
    if (name == "lower") return case_of(to_text(v), 0);
    if (name == "upper") return case_of(to_text(v), 1);
    if (name == "capitalize") return case_of(to_text(v), 2);
    if (name == "title") return case_of(to_text(v), 3);
    if (name == "int") {
      if (is_number(v)) return as_int(v);
      try {
        return static_cast<int64_t>(std::stoll(to_text(v)));
      } catch (const std::exception&) {
        return args_of(e, {"default"}, first_arg).get(0, 0);
      }
    }
    if (name == "float") {
      if (is_number(v)) return as_double(v);
      try {
        return std::stod(to_text(v));
      } catch (const std::exception&) {
        return args_of(e, {"default"}, first_arg).get(0, 0.0);
      }
    }
    if (name == "abs") {
      if (!is_number(v)) fail(e.line, std::string{"abs of a "} + type_name(v));
      if (is_integral(v) && as_int(v) == INT64_MIN) fail(e.line, "integer overflow in abs");
      return is_integral(v) ? value(std::llabs(as_int(v))) : value(std::fabs(as_double(v)));
    }
    if (name == "replace") {
      const auto a = args_of(e, {"old", "new", "count"}, first_arg);
      const value count = a.get(2, -1);
      return replace_all(to_text(v), to_text(a.get(0)), to_text(a.get(1)), is_integral(count) ? as_int(count) : -1);
    }
    if (name == "indent") {
      const auto a = args_of(e, {"width", "first", "blank"}, first_arg);
      const value w = a.get(0, 4);
      if (!w.is_string() && !(is_integral(w) && as_int(w) >= 0 && as_int(w) <= 1024))
        fail(e.line, "indent's width must be a string or a number from 0 to 1024");
      const std::string pad = w.is_string() ? w.get<std::string>() : std::string(static_cast<size_t>(as_int(w)), ' ');
      const auto lines = jinja::split(to_text(v), "\n", -1);
      std::string out;
      for (size_t i = 0; i < lines.size(); ++i) {
        const auto& l = lines[i].get_ref<const std::string&>();
        const bool indent = (i > 0 || truthy(a.get(1, false))) && (!l.empty() || truthy(a.get(2, false)));
        out += (i ? "\n" : "") + (indent ? pad : "") + l;
      }
      return out;
    }
    const auto items = items_of(v, e.line);
    if (name == "first") return items.empty() ? undefined() : items.front();
    if (name == "last") return items.empty() ? undefined() : items.back();
    if (name == "list") return to_list(items);
    if (name == "reverse") {
      if (v.is_string()) {
        std::string out;
        for (auto it = items.rbegin(); it != items.rend(); ++it) out += it->get<std::string>();
        return out;
      }
      return to_list({items.rbegin(), items.rend()});
    }
    if (name == "items") {
      if (!v.is_object()) fail(e.line, std::string{"items of a "} + type_name(v));
      value out = value::array();
      for (const auto& [k, x] : v.items()) out.push_back(value::array({k, x}));
      return out;
    }
    if (name == "join") {
      const auto a = args_of(e, {"d", "attribute"}, first_arg);
      const std::string sep = to_text(a.get(0, ""));
      std::string out;
      for (size_t i = 0; i < items.size(); ++i)
        out += (i ? sep : "") + to_text(a.get(1).is_string() ? path(items[i], a.get(1).get<std::string>(), e) : items[i]);
      return out;
    }
    if (name == "unique") {
      value out = value::array();
      for (const auto& x : items)
        if (!contains(out, x, e.line)) out.push_back(x);
      return out;
    }
    if (name == "map") {
      value out = value::array();
      const auto attr = std::find_if(e.kwargs.begin(), e.kwargs.end(), [](const auto& kw) { return kw.first == "attribute"; });
      for (const auto& x : items) {
        if (attr != e.kwargs.end()) {
          out.push_back(path(x, to_text(eval(*attr->second)), e));
        } else {
          if (e.args.size() <= first_arg) fail(e.line, "map needs a filter name or attribute=");
          const std::string f = to_text(eval(*e.args[first_arg]));
          if (!known_filter(f) || f == "map") fail(e.line, "map of the filter '" + f + "', which is not supported");
          out.push_back(apply_filter(f, x, e, first_arg + 1));
        }
      }
      return out;
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool by_attr = name == "selectattr" || name == "rejectattr";
      const bool keep_if = name == "select" || name == "selectattr";
      size_t at = first_arg;
      std::string attr;
      if (by_attr) {
        if (e.args.size() <= at) fail(e.line, name + " needs an attribute");
        attr = to_text(eval(*e.args[at++]));
      }
      std::string t = e.args.size() > at ? to_text(eval(*e.args[at++])) : std::string{};
      if (!t.empty() && !known_test(t)) fail(e.line, name + " with the test '" + t + "', which is not supported");
      value out = value::array();
      for (const auto& x : items) {
        const value subject = by_attr ? path(x, attr, e) : x;
        const bool passed = t.empty() ? truthy(subject) : apply_test(t, subject, e, at);
        if (passed == keep_if) out.push_back(x);
      }
      return out;
    }
    fail(e.line, "the filter '" + name + "' is not supported");
  }

  /// `a.b.c` of a map/selectattr attribute, each step a key (or a list index).
  value path(value v, const std::string& dotted, const expr& e) {
    for (const auto& part : jinja::split(dotted, ".", -1)) {
      const auto& key = part.get_ref<const std::string&>();
      if (v.is_object()) {
        auto it = v.find(key);
        v = it == v.end() ? undefined() : *it;
      } else if (v.is_array() && !key.empty() && key.size() < 10 && std::all_of(key.begin(), key.end(), ::isdigit)) {
        const auto i = std::stoull(key);
        v = i < v.size() ? v[i] : undefined();
      } else {
        return is_undefined(v) ? v : undefined();
      }
      (void)e;
    }
    return v;
  }

  bool test(const expr& e) { return apply_test(e.text, eval(*e.args[0]), e, 1); }

  bool apply_test(const std::string& name, const value& v, const expr& e, size_t first_arg) {
    const auto arg = [&]() -> value {
      if (e.args.size() <= first_arg) fail(e.line, "the test '" + name + "' needs an argument");
      return eval(*e.args[first_arg]);
    };
    if (name == "defined") return !is_undefined(v);
    if (name == "undefined") return is_undefined(v);
    if (name == "none") return v.is_null();
    if (name == "string") return v.is_string();
    if (name == "number") return v.is_number();
    if (name == "integer") return v.is_number_integer();
    if (name == "float") return v.is_number_float();
    if (name == "boolean") return v.is_boolean();
    if (name == "true") return v.is_boolean() && v.get<bool>();
    if (name == "false") return v.is_boolean() && !v.get<bool>();
    if (name == "mapping") return v.is_object();
    if (name == "sequence") return v.is_array() || v.is_string() || v.is_object();
    if (name == "iterable") return v.is_array() || v.is_string() || v.is_object() || is_undefined(v);
    if (name == "callable") return false;
    if (name == "lower") return v.is_string() && case_of(v.get<std::string>(), 0) == v.get<std::string>();
    if (name == "upper") return v.is_string() && case_of(v.get<std::string>(), 1) == v.get<std::string>();
    if (name == "odd" || name == "even") {
      if (!is_integral(v)) fail(e.line, "'" + name + "' tests an integer");
      return (as_int(v) % 2 != 0) == (name == "odd");
    }
    if (name == "divisibleby") {
      const value d = arg();
      if (!is_integral(v) || !is_integral(d) || as_int(d) == 0) fail(e.line, "'divisibleby' tests integers by a non-zero one");
      return as_int(d) == -1 || as_int(v) % as_int(d) == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==" || name == "sameas") return equal(v, arg());
    if (name == "ne" || name == "!=") return !equal(v, arg());
    if (name == "lt" || name == "lessthan" || name == "<") return less(v, arg(), e.line);
    if (name == "gt" || name == "greaterthan" || name == ">") return less(arg(), v, e.line);
    if (name == "le" || name == "<=") return !less(arg(), v, e.line);
    if (name == "ge" || name == ">=") return !less(v, arg(), e.line);
    if (name == "in") return contains(arg(), v, e.line);
    fail(e.line, "the test '" + name + "' is not supported");
  }

  void step(int line) {
    if (++steps_ > max_steps) fail(line, "the template ran more than " + std::to_string(max_steps) + " loop iterations");
  }
  /// Counts `n` bytes or items copied toward max_work.
  void charge(size_t n, int line) {
    work_ += n;
    if (work_ > max_work)
      fail(line, "the template copied more than " + std::to_string(max_work) + " bytes and items (a value grown by one each "
                 "turn of a loop is copied whole each turn)");
  }
  /// A string a template builds (+, ~, *, a filter or method) is held to the output's bound, and
  /// its bytes are charged.
  value bounded(std::string s, int line) {
    if (s.size() > max_output_bytes) fail(line, "a string grew past " + std::to_string(max_output_bytes) + " bytes");
    charge(s.size(), line);
    return s;
  }
  value held(value v, int line) {
    if (v.is_string()) return bounded(v.get<std::string>(), line);
    if (v.is_array() && v.size() > max_range) fail(line, "a list grew past " + std::to_string(max_range) + " items");
    if (v.is_array() || v.is_object()) charge(v.size(), line);
    return v;
  }
  /// A value read from a variable (a copy): its bytes, or its items, are charged.
  value copied(value v, int line) {
    if (v.is_string()) charge(v.get_ref<const std::string&>().size(), line);
    else if (v.is_array() || v.is_object()) charge(v.size(), line);
    return v;
  }
  /// A list or dict the template built: held to max_value_depth (the look is charged).
  value shallow(value v, int line) {
    size_t visited = 0;
    const bool deep = nests_deeper_than(v, max_value_depth, &visited);
    charge(visited, line);
    if (deep) fail(line, "a list or dict nests deeper than " + std::to_string(max_value_depth) + " levels");
    return v;
  }

  std::vector<frame> frames_;
  std::unordered_map<std::string, const stmt*> macros_;
  int depth_ = 0;
  size_t steps_ = 0;
  size_t work_ = 0;  ///< see max_work
};

}  // namespace

bool known_filter(const std::string& n) {
  static const std::set<std::string> names = {
      "length", "count",  "trim",  "default", "d",      "tojson",  "string", "safe",   "lower",  "upper",
      "capitalize", "title", "int", "float", "abs",    "replace", "indent", "first",  "last",   "list",
      "reverse", "items", "join",  "unique",  "map",    "select",  "reject", "selectattr", "rejectattr"};
  return names.count(n) > 0;
}

bool known_test(const std::string& n) {
  static const std::set<std::string> names = {
      "defined", "undefined", "none", "string", "number", "integer", "float", "boolean", "true",   "false",
      "mapping", "sequence", "iterable", "callable", "lower", "upper", "odd", "even", "divisibleby", "eq",
      "equalto", "==", "sameas", "ne", "!=", "lt", "lessthan", "<", "gt", "greaterthan", ">", "le", "<=", "ge", ">=", "in"};
  return names.count(n) > 0;
}

bool known_method(const std::string& n) {
  static const std::set<std::string> names = {"strip", "lstrip", "rstrip", "split",  "startswith", "endswith",
                                              "lower", "upper",  "capitalize", "title", "replace", "join",
                                              "find",  "count",  "items",  "keys",   "values",     "get"};
  return names.count(n) > 0;
}

bool known_function(const std::string& n) {
  return n == "raise_exception" || n == "namespace" || n == "dict" || n == "range" || n == "strftime_now";
}

std::string render_program(const chat_template::program& p, const value& context) {
  renderer r{context};
  std::string out;
  r.run(p.root, out);
  return out;
}

}  // namespace baton::gpu::jinja

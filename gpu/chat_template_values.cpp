// The chat template's values as Python sees them: truthiness, str() and repr(), json.dumps,
// ==, <, lengths, iteration, and the string helpers the renderer's methods and filters share.

#include <algorithm>
#include <charconv>
#include <cmath>

#include "gpu/chat_template_ast.hpp"

namespace baton::gpu::jinja {

namespace {
[[noreturn]] void fail(int line, const std::string& what) {
  throw error{"chat template line " + std::to_string(line) + ": " + what};
}
}  // namespace

// ---- Python's view of values ----------------------------------------------------------------

const char* type_name(const value& v) {
  if (is_undefined(v)) return "undefined";
  switch (v.type()) {
    case value::value_t::null: return "none";
    case value::value_t::boolean: return "bool";
    case value::value_t::string: return "str";
    case value::value_t::array: return "list";
    case value::value_t::object: return "dict";
    case value::value_t::number_float: return "float";
    default: return "int";
  }
}

bool is_number(const value& v) { return v.is_number() || v.is_boolean(); }  // Python's True is 1
double as_double(const value& v) { return v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>(); }
int64_t as_int(const value& v) {
  if (v.is_boolean()) return v.get<bool>() ? 1 : 0;
  if (v.is_number_float()) {  // truncated, and held inside int64 (NaN is 0)
    const double d = v.get<double>();
    if (std::isnan(d)) return 0;
    if (d >= 9.2e18) return INT64_MAX;
    if (d <= -9.2e18) return INT64_MIN;
    return static_cast<int64_t>(d);
  }
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return INT64_MAX;
  return v.get<int64_t>();
}
bool is_integral(const value& v) { return v.is_boolean() || v.is_number_integer(); }

bool truthy(const value& v) {
  if (is_undefined(v) || v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_float()) return v.get<double>() != 0.0;
  if (v.is_number()) return v.get<int64_t>() != 0;
  if (v.is_string()) return !v.get_ref<const std::string&>().empty();
  return !v.empty();
}

/// Python's repr() of a float: the shortest digits that read back as the same number, written
/// plainly when the exponent is in [-4, 16) and as d.ddde+XX otherwise.
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  const std::string sci{buf, r.ptr};  // -1.2345e+06
  const size_t e = sci.find('e');
  const bool negative = sci[0] == '-';
  std::string digits;
  for (size_t i = negative ? 1 : 0; i < e; ++i)
    if (sci[i] != '.') digits += sci[i];
  const int exp = std::stoi(sci.substr(e + 1));
  std::string out = negative ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) return out + "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    const auto point = static_cast<size_t>(exp) + 1;
    if (digits.size() <= point) return out + digits + std::string(point - digits.size(), '0') + ".0";
    return out + digits.substr(0, point) + "." + digits.substr(point);
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) {
    out += '.';
    out.append(digits, 1, std::string::npos);
  }
  const std::string mag = std::to_string(exp < 0 ? -exp : exp);
  return out + "e" + (exp < 0 ? "-" : "+") + (mag.size() < 2 ? "0" : "") + mag;
}

std::string py_str_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == q) out += std::string{"\\"} + static_cast<char>(q);
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else out += static_cast<char>(c);
  }
  return out + q;
}

std::string to_text(const value& v);

std::string py_repr(const value& v) {
  if (v.is_string()) return py_str_repr(v.get_ref<const std::string&>());
  if (v.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + py_repr(v[i]);
    return out + "]";
  }
  if (v.is_object()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, x] : v.items()) {
      out += (first ? "" : ", ") + py_str_repr(k) + ": " + py_repr(x);
      first = false;
    }
    return out + "}";
  }
  return to_text(v);
}

/// What {{ v }} writes: Python's str().
std::string to_text(const value& v) {
  if (is_undefined(v)) return "";
  switch (v.type()) {
    case value::value_t::null: return "None";
    case value::value_t::boolean: return v.get<bool>() ? "True" : "False";
    case value::value_t::string: return v.get<std::string>();
    case value::value_t::number_float: return py_float(v.get<double>());
    case value::value_t::number_unsigned: return std::to_string(v.get<uint64_t>());
    case value::value_t::number_integer: return std::to_string(v.get<int64_t>());
    default: return py_repr(v);
  }
}

/// Python's json.dumps(ensure_ascii=False): ", " and ": " on one line, or "," and indented lines.
namespace {

/// What a byte that starts no well-formed UTF-8 sequence reads as: no character (a lone 0xA0 of
/// Latin-1 text is not a no-break space).
constexpr uint32_t not_a_character = 0xffffffff;

/// The code point that starts at s[i] and its length in bytes; a byte that starts no well-formed
/// UTF-8 sequence (cut short, overlong, a surrogate, past U+10FFFF) is taken alone, as
/// not_a_character.
std::pair<uint32_t, size_t> code_point_at(const std::string& s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  const size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 0;
  if (n == 1) return {b, 1};
  if (n == 0 || i + n > s.size()) return {not_a_character, 1};
  uint32_t c = b & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) {
    const auto x = static_cast<unsigned char>(s[i + k]);
    if ((x & 0xc0) != 0x80) return {not_a_character, 1};
    c = (c << 6) | (x & 0x3f);
  }
  static constexpr uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (c < least[n] || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return {not_a_character, 1};
  return {c, n};
}

/// Decodes the UTF-8 character at s[i] (advancing i); a broken byte reads as itself.
uint32_t next_code_point(const std::string& s, size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  const auto [cp, n] = code_point_at(s, i);
  i += n;
  return cp == not_a_character ? b : cp;
}

void dump_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  const auto u = [&](uint32_t unit) {
    char buf[16];  // "\\u" and up to 8 hex digits: the compiler cannot see units stay below 0x10000
    std::snprintf(buf, sizeof buf, "\\u%04x", unit);
    out += buf;
  };
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t start = i;
      const uint32_t cp = next_code_point(s, i);
      if (!ensure_ascii) {
        out.append(s, start, i - start);
      } else if (cp >= 0x10000) {  // a surrogate pair, as Python writes it
        u(0xD800 + ((cp - 0x10000) >> 10));
        u(0xDC00 + ((cp - 0x10000) & 0x3FF));
      } else {
        u(cp);
      }
      continue;
    }
    ++i;
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (ensure_ascii && c == 0x7f)) u(c);
        else out += static_cast<char>(c);
    }
  }
  out += '"';
}

}  // namespace

void dump_json(const value& v, const json_style& style, int level, int line, std::string& out) {
  const auto newline = [&](int lvl) {
    if (style.indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(style.indent * lvl), ' ');
  };
  if (is_undefined(v)) fail(line, "tojson of an undefined value");
  switch (v.type()) {
    case value::value_t::null: out += "null"; return;
    case value::value_t::boolean: out += v.get<bool>() ? "true" : "false"; return;
    case value::value_t::number_float: {
      const double d = v.get<double>();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity") : py_float(d);
      return;
    }
    case value::value_t::string: dump_string(v.get_ref<const std::string&>(), style.ensure_ascii, out); return;
    case value::value_t::array: {
      if (v.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += style.item_separator;
        newline(level + 1);
        dump_json(v[i], style, level + 1, line, out);
      }
      newline(level);
      out += ']';
      return;
    }
    case value::value_t::object: {
      if (v.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<std::string, const value*>> entries;
      for (const auto& [k, x] : v.items()) entries.emplace_back(k, &x);
      if (style.sort_keys)
        std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += style.item_separator;
        newline(level + 1);
        dump_string(entries[i].first, style.ensure_ascii, out);
        out += style.key_separator;
        dump_json(*entries[i].second, style, level + 1, line, out);
      }
      newline(level);
      out += '}';
      return;
    }
    default: out += to_text(v); return;
  }
}

bool equal(const value& a, const value& b) {
  if (is_undefined(a) || is_undefined(b)) return is_undefined(a) && is_undefined(b);
  if (is_number(a) && is_number(b)) return as_double(a) == as_double(b);
  if (a.is_array() && b.is_array()) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (!equal(a[i], b[i])) return false;
    return true;
  }
  return a == b;
}

bool less(const value& a, const value& b, int line) {
  if (is_number(a) && is_number(b)) return as_double(a) < as_double(b);
  if (a.is_string() && b.is_string()) return a.get_ref<const std::string&>() < b.get_ref<const std::string&>();
  if (a.is_array() && b.is_array()) {
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      if (less(a[i], b[i], line)) return true;
      if (less(b[i], a[i], line)) return false;
    }
    return a.size() < b.size();
  }
  fail(line, std::string{"cannot order "} + type_name(a) + " and " + type_name(b));
}

/// Byte offsets of a UTF-8 string's characters, and its size last.
std::vector<size_t> char_starts(const std::string& s) {
  std::vector<size_t> out;
  for (size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) out.push_back(i);
  out.push_back(s.size());
  return out;
}

size_t length_of(const value& v, int line) {
  if (is_undefined(v)) return 0;
  if (v.is_string()) return char_starts(v.get_ref<const std::string&>()).size() - 1;
  if (v.is_array() || v.is_object()) return v.size();
  fail(line, std::string{"a "} + type_name(v) + " has no length");
}

/// A list of what iterating `v` gives: a list's items, a dict's keys, a string's characters.
std::vector<value> items_of(const value& v, int line) {
  std::vector<value> out;
  if (is_undefined(v)) return out;
  if (v.is_array()) {
    out.assign(v.begin(), v.end());
  } else if (v.is_object()) {
    for (const auto& [k, x] : v.items()) out.emplace_back(k);
  } else if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    const auto starts = char_starts(s);
    for (size_t i = 0; i + 1 < starts.size(); ++i) out.emplace_back(s.substr(starts[i], starts[i + 1] - starts[i]));
  } else {
    fail(line, std::string{"a "} + type_name(v) + " cannot be iterated");
  }
  return out;
}

value to_list(const std::vector<value>& items) {
  value out = value::array();
  for (const auto& x : items) out.push_back(x);
  return out;
}

namespace {

/// Where the code point that ends at s[e] (exclusive) starts, not before `floor`.
size_t code_point_before(const std::string& s, size_t e, size_t floor) {
  size_t k = e - 1;
  while (k > floor && e - k < 4 && (static_cast<unsigned char>(s[k]) & 0xc0) == 0x80) --k;
  return code_point_at(s, k).second == e - k ? k : e - 1;
}

}  // namespace

/// Python's str.isspace(), which strip(), split() and Jinja's trim go by: ASCII's six, the
/// separators \x1c-\x1f, and Unicode's spaces (U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028,
/// U+2029, U+202F, U+205F, U+3000).
bool is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

std::string strip(const std::string& s, const value& chars, bool left, bool right) {
  // Characters, not bytes: strip("é") takes é, not each of its bytes wherever they occur.
  std::vector<uint32_t> set;
  if (chars.is_string()) {
    const auto& c = chars.get_ref<const std::string&>();
    for (size_t i = 0; i < c.size();) {
      const auto [cp, n] = code_point_at(c, i);
      set.push_back(cp);
      i += n;
    }
  }
  const auto drop = [&](uint32_t c) {
    return chars.is_string() ? std::find(set.begin(), set.end(), c) != set.end() : is_space(c);
  };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e) {
      const auto [cp, n] = code_point_at(s, b);
      if (!drop(cp)) break;
      b += n;
    }
  if (right)
    while (e > b) {
      const size_t k = code_point_before(s, e, b);
      if (!drop(code_point_at(s, k).first)) break;
      e = k;
    }
  return s.substr(b, e - b);
}

value split(const std::string& s, const value& sep, int64_t maxsplit) {
  value out = value::array();
  if (!sep.is_string()) {  // runs of whitespace, no empty parts
    const auto space_at = [&](size_t i) { return is_space(code_point_at(s, i).first); };
    const auto next = [&](size_t i) { return i + code_point_at(s, i).second; };
    size_t i = 0;
    while (i < s.size()) {
      while (i < s.size() && space_at(i)) i = next(i);
      if (i >= s.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        out.push_back(s.substr(i));  // the rest as it is, trailing whitespace too (as Python)
        break;
      }
      size_t j = i;
      while (j < s.size() && !space_at(j)) j = next(j);
      out.push_back(s.substr(i, j - i));
      i = j;
    }
    return out;
  }
  const auto& d = sep.get_ref<const std::string&>();
  size_t from = 0, at;
  while ((maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) && !d.empty() &&
         (at = s.find(d, from)) != std::string::npos) {
    out.push_back(s.substr(from, at - from));
    from = at + d.size();
  }
  out.push_back(s.substr(from));
  return out;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) return s;
  size_t at = 0;
  for (int64_t n = 0; (count < 0 || n < count) && (at = s.find(from, at)) != std::string::npos; ++n) {
    s.replace(at, from.size(), to);
    at += to.size();
  }
  return s;
}

std::string case_of(std::string s, int how) {  // 0 lower, 1 upper, 2 capitalize, 3 title (ASCII letters)
  bool word_start = true;
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    const bool up = how == 1 || (how == 2 && i == 0) || (how == 3 && word_start);
    s[i] = static_cast<char>(up ? std::toupper(c) : std::tolower(c));
    word_start = !std::isalnum(c);
  }
  return s;
}

}  // namespace baton::gpu::jinja

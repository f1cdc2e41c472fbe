#include "gpu/gbnf_grammar.hpp"

#include <algorithm>
#include <optional>
#include <unordered_map>
#include <vector>

#include "gpu/regex_grammar.hpp"

namespace baton::gpu {

namespace {

using sym = grammar::symbol;
/// The most rules one grammar may make (its counts multiply).
constexpr uint32_t max_gbnf_rules = 50000;

/// A character as UTF-8 (false past U+10FFFF or for a surrogate).
bool append_utf8(uint32_t cp, std::string* out) {
  if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return true;
}

class gbnf_parser {
public:
  gbnf_parser(grammar& g, std::string_view text) : g_(g), t_(text), first_rule_(g.rules()) {}

  bool parse(uint32_t* root, std::string* why) {
    const bool ok = rules() && check(root);
    if (!ok) *why = why_;
    return ok;
  }

private:
  bool fail(const std::string& what) { return fail_at(what, at_); }
  bool fail_at(const std::string& what, size_t at) {
    size_t line = 1, column = 1;
    for (size_t i = 0; i < at && i < t_.size(); ++i) {
      if (t_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    why_ = "grammar: " + what + ", at line " + std::to_string(line) + ", column " + std::to_string(column);
    return false;
  }
  bool more() const { return at_ < t_.size(); }
  char peek() const { return t_[at_]; }
  static bool word_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }
  static bool newline(char c) { return c == '\n' || c == '\r'; }

  /// Blanks and comments; line ends too when `newlines` (inside a group, after ::= or |).
  void skip(bool newlines) {
    while (more()) {
      const char c = peek();
      if (c == ' ' || c == '\t' || (newlines && newline(c))) {
        ++at_;
      } else if (c == '#') {
        while (more() && !newline(peek())) ++at_;
      } else {
        break;
      }
    }
  }

  std::string name() {
    const size_t start = at_;
    while (more() && word_char(peek())) ++at_;
    return std::string(t_.substr(start, at_ - start));
  }

  /// A rule without a name (a group, a repeat), part of the rule being defined.
  uint32_t new_rule() {
    const uint32_t r = g_.add_rule();
    part_of_[r] = defining_;
    return r;
  }

  /// The rule called `n`, made at its first mention (a use may come before the definition).
  uint32_t rule_named(const std::string& n) {
    auto [it, fresh] = ids_.try_emplace(n, 0);
    if (fresh) {
      it->second = g_.add_rule();
      first_use_[it->second] = at_ - n.size();
      names_[it->second] = n;
    }
    return it->second;
  }

  bool rules() {
    skip(true);
    while (more()) {
      const size_t start = at_;
      const std::string n = name();
      if (n.empty()) return fail(std::string("expected a rule's name, got '") + peek() + "'");
      skip(false);
      if (t_.substr(at_, 3) != "::=") return fail_at("expected '::=' after the rule name '" + n + "'", at_);
      at_ += 3;
      const uint32_t rule = rule_named(n);
      if (!defined_.emplace(rule, start).second) return fail_at("the rule '" + n + "' is defined twice", start);
      defining_ = rule;
      skip(true);
      if (!alternatives(rule, false)) return false;
      skip(false);
      if (more() && !newline(peek())) return fail(std::string("unexpected '") + peek() + "'");
      skip(true);
    }
    return true;
  }

  bool alternatives(uint32_t rule, bool nested) {
    for (;;) {
      std::vector<sym> seq;
      if (!sequence(nested, &seq)) return false;
      g_.add_alternative(rule, seq);
      skip(nested);
      if (!more() || peek() != '|') return true;
      ++at_;
      skip(true);
    }
  }

  bool sequence(bool nested, std::vector<sym>* out) {
    for (;;) {
      skip(nested);
      if (!more() || peek() == '|' || peek() == ')' || (!nested && newline(peek()))) return true;
      if (g_.rules() - first_rule_ > max_gbnf_rules)
        return fail("the grammar makes more than " + std::to_string(max_gbnf_rules) + " rules");
      std::vector<sym> item;
      if (!element(&item)) return false;
      skip(nested);  // llama.cpp takes `"a" *` as `"a"*`
      if (!quantifier(&item)) return false;
      out->insert(out->end(), item.begin(), item.end());
    }
  }

  bool element(std::vector<sym>* out) {
    const char c = peek();
    if (c == '"') return literal(out);
    if (c == '[') return char_class(out);
    if (c == '.') {
      ++at_;
      // One rule for every '.': it reads a character at once, so it is part of no rule's
      // left recursion and needs no owner in part_of_.
      if (any_char_ == no_rule) {
        any_char_ = g_.add_rule();
        g_.add_alternative(any_char_, {grammar::range(0, 0x7F)});
        g_.add_utf8_multibyte(any_char_);
      }
      out->push_back(grammar::ref(any_char_));
      return true;
    }
    if (c == '(') {
      if (++groups_open_ > max_group_depth)
        return fail("groups nest deeper than " + std::to_string(max_group_depth));
      ++at_;
      const uint32_t group = new_rule();
      skip(true);
      if (!alternatives(group, true)) return false;
      skip(true);
      if (!more() || peek() != ')') return fail("a group without its ')'");
      ++at_;
      --groups_open_;
      out->push_back(grammar::ref(group));
      return true;
    }
    if (word_char(c)) {
      const std::string n = name();
      out->push_back(grammar::ref(rule_named(n)));
      return true;
    }
    return fail(std::string("unexpected '") + c + "'");
  }

  /// Hex digits for an escape: exactly `digits` of them.
  bool hex(size_t digits, uint32_t* cp) {
    *cp = 0;
    for (size_t k = 0; k < digits; ++k, ++at_) {
      if (!more()) return fail("a short \\x, \\u or \\U escape");
      const char h = peek();
      const int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (v < 0) return fail(std::string("'") + h + "' is not a hex digit");
      *cp = *cp * 16 + static_cast<uint32_t>(v);
    }
    return true;
  }

  bool literal(std::vector<sym>* out) {
    const size_t start = at_++;
    std::string bytes;
    while (more() && peek() != '"') {
      if (newline(peek())) return fail_at("a literal without its closing quote", start);
      if (peek() != '\\') {
        bytes.push_back(t_[at_++]);
        continue;
      }
      ++at_;
      if (!more()) break;
      const char e = t_[at_++];
      uint32_t cp = 0;
      switch (e) {
        case 'n': bytes.push_back('\n'); break;
        case 'r': bytes.push_back('\r'); break;
        case 't': bytes.push_back('\t'); break;
        case '\\': case '"': case '[': case ']': bytes.push_back(e); break;
        case 'x': case 'u': case 'U':
          if (!hex(e == 'x' ? 2 : e == 'u' ? 4 : 8, &cp)) return false;
          if (!append_utf8(cp, &bytes)) return fail("an escape past U+10FFFF, or half a surrogate pair");
          break;
        default: return fail(std::string("the escape \\") + e + " is not known");
      }
    }
    if (!more()) return fail_at("a literal without its closing quote", start);
    ++at_;
    const auto syms = grammar::literal(bytes);
    out->insert(out->end(), syms.begin(), syms.end());
    return true;
  }

  /// A character class, read by the regular expression compiler: the same syntax.
  bool char_class(std::vector<sym>* out) {
    const size_t start = at_;
    size_t end = at_ + 1;
    if (end < t_.size() && t_[end] == '^') ++end;
    if (end < t_.size() && t_[end] == ']') ++end;  // a leading ']' is a member
    while (end < t_.size() && t_[end] != ']' && !newline(t_[end])) end += t_[end] == '\\' ? 2 : 1;
    if (end >= t_.size() || t_[end] != ']') return fail("a character class without its ']'");
    at_ = end + 1;
    uint32_t rule = 0;
    std::string why;
    if (!text_matching(g_, t_.substr(start, at_ - start), &rule, &why, "class")) return fail_at(why, start);
    out->push_back(grammar::ref(rule));
    return true;
  }

  bool count(uint32_t* v) { return read_count(t_, &at_, v); }

  /// *, +, ?, {m}, {m,}, {m,n} after an element: `item` becomes a rule that repeats it.
  bool quantifier(std::vector<sym>* item) {
    if (!more()) return true;
    const char c = peek();
    uint32_t lo = 0, hi = 0;
    constexpr uint32_t unbounded = grammar::unbounded;
    if (c == '*' || c == '+' || c == '?') {
      ++at_;
      lo = c == '+' ? 1 : 0;
      hi = c == '?' ? 1 : unbounded;
    } else if (c == '{') {
      ++at_;
      skip(false);
      if (!count(&lo)) return fail("a malformed {m,n}");
      skip(false);
      hi = lo;
      if (more() && peek() == ',') {
        ++at_;
        skip(false);
        hi = unbounded;
        if (more() && peek() != '}' && !count(&hi)) return fail("a malformed {m,n}");
        skip(false);
      }
      if (!more() || peek() != '}') return fail("a malformed {m,n}");
      ++at_;
      if (auto e = count_bounds_error(lo, hi); !e.empty()) return fail(e);
    } else {
      return true;
    }
    uint32_t one = 0;
    if (item->size() == 1 && item->front().is_rule) {
      one = item->front().rule;
    } else {
      one = new_rule();
      g_.add_alternative(one, *item);
    }
    const uint32_t first = g_.rules();
    const uint32_t whole = g_.add_repeat(one, lo, hi);
    for (uint32_t r = first; r < g_.rules(); ++r) part_of_[r] = defining_;
    *item = {grammar::ref(whole)};
    return true;
  }

  /// Every rule used is defined, `root` is one of them, and none is left-recursive.
  bool check(uint32_t* root) {
    // The first in the text, of those never defined.
    std::optional<std::pair<size_t, uint32_t>> undefined;
    for (const auto& [rule, at] : first_use_)
      if (!defined_.count(rule) && (!undefined || at < undefined->first)) undefined = {at, rule};
    if (undefined)
      return fail_at("the rule '" + names_[undefined->second] + "' is used but never defined", undefined->first);
    auto it = ids_.find("root");
    if (it == ids_.end()) return fail_at("no rule named 'root' (the whole answer)", 0);
    if (const auto shape = g_.left_shape(); shape.left_recursive) {
      // A group's or a repeat's rule has no name: the rule it is part of has.
      const uint32_t named = part_of_.count(shape.rule) ? part_of_[shape.rule] : shape.rule;
      const auto n = names_.count(named) ? names_[named] : std::string("?");
      return fail_at("the rule '" + n + "' is left-recursive (it can come back to itself before reading "
                     "anything); write the repeat on the right, as x ::= \"y\" \"z\"*",
                     defined_.count(named) ? defined_[named] : 0);
    }
    *root = it->second;
    return true;
  }

  grammar& g_;
  static constexpr int max_group_depth = 64;
  std::string_view t_;
  size_t at_ = 0;
  int groups_open_ = 0;
  uint32_t first_rule_;
  std::unordered_map<std::string, uint32_t> ids_;
  std::unordered_map<uint32_t, std::string> names_;
  std::unordered_map<uint32_t, size_t> first_use_;  ///< rule -> where it was first named
  std::unordered_map<uint32_t, size_t> defined_;    ///< rule -> where its definition starts
  std::unordered_map<uint32_t, uint32_t> part_of_;  ///< a rule without a name -> the rule it is part of
  static constexpr uint32_t no_rule = UINT32_MAX;
  uint32_t any_char_ = no_rule;  ///< the rule of '.', made at its first use
  uint32_t defining_ = 0;                           ///< the named rule being read
  std::string why_;
};

}  // namespace

bool gbnf_rules(grammar& g, std::string_view text, uint32_t* root, std::string* why) {
  if (text.size() > max_gbnf_bytes) {
    *why = "grammar: " + std::to_string(text.size()) + " bytes; at most " + std::to_string(max_gbnf_bytes);
    return false;
  }
  return gbnf_parser(g, text).parse(root, why);
}

}  // namespace baton::gpu

#include "gpu/regex_grammar.hpp"

#include <algorithm>
#include <bitset>
#include <cstdio>
#include <memory>
#include <optional>
#include <vector>

namespace baton::gpu {

namespace {

using sym = grammar::symbol;
constexpr uint32_t unbounded = grammar::unbounded;
/// The most rules one expression may make (its counts multiply).
constexpr uint32_t max_regex_rules = 50000;

/// One piece of a parsed expression.
struct node {
  enum kind { chars, seq, alt, repeat } k = chars;
  std::bitset<128> ascii;              ///< chars: the ASCII characters it takes
  bool non_ascii = false;              ///< chars: and any character past ASCII
  std::vector<std::string> multibyte;  ///< chars: and these characters past ASCII (UTF-8)
  std::vector<node> kids;              ///< seq, alt: the parts; repeat: the one repeated
  uint32_t min = 1, max = 1;           ///< repeat
};

node any_char() {
  node n;
  n.ascii.set();
  n.non_ascii = true;
  return n;
}

class parser {
public:
  /// `ecma_dot`: `.` excludes \r as well as \n (JSON schema's ECMA-262); otherwise only \n (as
  /// Python's re, which vLLM's guided_regex follows).
  parser(std::string_view p, std::string name, bool ecma_dot = true) : p_(p), name_(std::move(name)), ecma_dot_(ecma_dot) {}

  bool parse(node* out, std::string* why) {
    if (!alternation(out)) {
      *why = why_;
      return false;
    }
    if (at_ < p_.size()) {
      *why = name_ + ": unbalanced ')' at offset " + std::to_string(at_);
      return false;
    }
    return true;
  }

private:
  bool fail(const std::string& what) {
    why_ = name_ + ": " + what + " (offset " + std::to_string(at_) + ")";
    return false;
  }
  bool more() const { return at_ < p_.size(); }
  char peek() const { return p_[at_]; }

  bool alternation(node* out) {
    node first;
    if (!sequence(&first)) return false;
    if (!more() || peek() != '|') {
      *out = std::move(first);
      return true;
    }
    out->k = node::alt;
    out->kids.push_back(std::move(first));
    while (more() && peek() == '|') {
      ++at_;
      node next;
      if (!sequence(&next)) return false;
      out->kids.push_back(std::move(next));
    }
    return true;
  }

  bool sequence(node* out) {
    out->k = node::seq;
    while (more() && peek() != '|' && peek() != ')') {
      node a;
      if (!atom(&a) || !quantifier(&a)) return false;
      out->kids.push_back(std::move(a));
    }
    return true;
  }

  bool quantifier(node* a) {
    if (!more()) return true;
    uint32_t lo = 0, hi = 0;
    const size_t start = at_;
    const char c = peek();
    if (c == '*' || c == '+' || c == '?') {
      ++at_;
      lo = c == '+' ? 1 : 0;
      hi = c == '?' ? 1 : unbounded;
    } else if (c == '{') {
      ++at_;
      if (!number(&lo)) {  // not a count: a literal '{', as ECMA-262 reads it outside unicode mode
        at_ = start;
        return true;
      }
      hi = lo;
      if (more() && peek() == ',') {
        ++at_;
        hi = unbounded;
        if (more() && peek() != '}' && !number(&hi)) return fail("a malformed {m,n}");
      }
      if (!more() || peek() != '}') return fail("a malformed {m,n}");
      ++at_;
      if (auto e = count_bounds_error(lo, hi); !e.empty()) return fail(e);
    } else {
      return true;
    }
    if (more() && peek() == '?') ++at_;  // lazy: the same strings match
    if (more() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{'))
      return fail("a quantifier after a quantifier");
    node r;
    r.k = node::repeat;
    r.min = lo;
    r.max = hi;
    r.kids.push_back(std::move(*a));
    *a = std::move(r);
    return true;
  }

  bool number(uint32_t* out) { return read_count(p_, &at_, out); }

  bool atom(node* out) {
    const char c = p_[at_++];
    switch (c) {
      case '(': {
        if (++groups_open_ > max_group_depth) return fail("groups nest deeper than " + std::to_string(max_group_depth));
        if (more() && peek() == '?') {
          if (at_ + 1 < p_.size() && p_[at_ + 1] == ':') {
            at_ += 2;
          } else if (at_ + 1 < p_.size() && p_[at_ + 1] == '<' && at_ + 2 < p_.size() && p_[at_ + 2] != '=' &&
                     p_[at_ + 2] != '!') {
            const size_t end = p_.find('>', at_);  // a named group: a group
            if (end == std::string_view::npos) return fail("an unclosed group name");
            at_ = end + 1;
          } else {
            return fail("lookarounds are not supported");
          }
        }
        if (!alternation(out)) return false;
        if (!more() || peek() != ')') return fail("an unclosed group");
        ++at_;
        --groups_open_;
        return true;
      }
      case ')': return fail("unbalanced ')'");
      case '[': return set(out);
      case '.':
        *out = any_char();
        out->ascii.reset('\n');
        if (ecma_dot_) out->ascii.reset('\r');
        return true;
      case '^': return fail("^ is supported only at the start");
      case '$': return fail("$ is supported only at the end");
      case '*': case '+': case '?': return fail(std::string("nothing to repeat before '") + c + "'");
      case '\\': return escape(out, false);
      default:
        --at_;
        return literal(out);
    }
  }

  /// One character as itself (UTF-8: a character past ASCII is several bytes).
  bool literal(node* out) {
    const auto b = static_cast<uint8_t>(p_[at_]);
    if (b < 0x80) {
      out->ascii.set(b);
      ++at_;
      return true;
    }
    const size_t len = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 0;
    if (len == 0 || at_ + len > p_.size()) return fail("malformed UTF-8");
    out->multibyte.emplace_back(p_.substr(at_, len));
    at_ += len;
    return true;
  }

  bool escape(node* out, bool in_class) {
    if (!more()) return fail("a trailing backslash");
    const char c = p_[at_++];
    auto range = [&](char lo, char hi) {
      for (int x = lo; x <= hi; ++x) out->ascii.set(x);
    };
    switch (c) {
      case 'd': range('0', '9'); return true;
      case 'w': range('0', '9'); range('a', 'z'); range('A', 'Z'); out->ascii.set('_'); return true;
      case 's': for (char x : std::string_view(" \t\n\r\f\v")) out->ascii.set(static_cast<uint8_t>(x)); return true;
      case 'D': case 'W': case 'S': {
        if (in_class) return fail(std::string("\\") + c + " inside a class is not supported");
        node positive;
        parser sub(std::string_view(&"dws"[c == 'D' ? 0 : c == 'W' ? 1 : 2], 1), name_);
        sub.escape(&positive, false);  // the lower-case class, then its complement
        out->ascii = ~positive.ascii;
        out->non_ascii = true;
        return true;
      }
      case 'n': out->ascii.set('\n'); return true;
      case 't': out->ascii.set('\t'); return true;
      case 'r': out->ascii.set('\r'); return true;
      case 'f': out->ascii.set('\f'); return true;
      case 'v': out->ascii.set('\v'); return true;
      case '0': out->ascii.set(0); return true;
      case 'b':
        if (in_class) {
          out->ascii.set('\b');
          return true;
        }
        return fail("word boundaries (\\b) are not supported");
      case 'x': case 'u': {
        const size_t digits = c == 'x' ? 2 : 4;
        if (at_ + digits > p_.size()) return fail(std::string("a malformed \\") + c);
        uint32_t cp = 0;
        for (size_t i = 0; i < digits; ++i) {
          const char h = p_[at_++];
          const int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
          if (v < 0) return fail(std::string("a malformed \\") + c);
          cp = cp * 16 + static_cast<uint32_t>(v);
        }
        if (cp < 0x80) {
          out->ascii.set(cp);
          return true;
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) return fail("surrogate escapes are not supported");
        std::string u;
        if (cp < 0x800) {
          u = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
        } else {
          u = {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
               static_cast<char>(0x80 | (cp & 0x3F))};
        }
        out->multibyte.push_back(u);
        return true;
      }
      default:
        if (c >= '1' && c <= '9') return fail("backreferences are not supported");
        if (c == 'p' || c == 'P') return fail("Unicode property classes are not supported");
        if (c == 'B' || c == 'k' || c == 'c') return fail(std::string("\\") + c + " is not supported");
        // Any other letter or digit: an escape some dialect gives a meaning (\U, \A, \Z, \h),
        // which read as the letter itself would match something else.
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
          return fail(std::string("the escape \\") + c + " is not known");
        if (static_cast<uint8_t>(c) >= 0x80) {
          --at_;
          return literal(out);
        }
        out->ascii.set(static_cast<uint8_t>(c));  // an escaped punctuation character: itself
        return true;
    }
  }

  // One member of a class: an escape (read in class mode, where \b is a backspace) or a literal.
  bool class_char(node* out) {
    if (peek() != '\\') return literal(out);
    ++at_;
    return escape(out, true);
  }

  bool set(node* out) {
    const bool negated = more() && peek() == '^';
    if (negated) ++at_;
    bool first = true;
    while (more() && (peek() != ']' || first)) {
      first = false;
      node item;
      if (!class_char(&item)) return false;
      // A range: two single ASCII characters around '-' (not the class's last character).
      if (more() && peek() == '-' && at_ + 1 < p_.size() && p_[at_ + 1] != ']') {
        ++at_;
        node hi;
        if (!class_char(&hi)) return false;
        if (item.ascii.count() != 1 || hi.ascii.count() != 1 || !item.multibyte.empty() || !hi.multibyte.empty())
          return fail("class ranges are supported between ASCII characters only");
        size_t lo_c = 0, hi_c = 0;
        while (!item.ascii.test(lo_c)) ++lo_c;
        while (!hi.ascii.test(hi_c)) ++hi_c;
        if (hi_c < lo_c) return fail("a class range out of order");
        for (size_t x = lo_c; x <= hi_c; ++x) out->ascii.set(x);
        continue;
      }
      out->ascii |= item.ascii;
      out->non_ascii |= item.non_ascii;
      for (auto& m : item.multibyte) out->multibyte.push_back(std::move(m));
    }
    if (!more()) return fail("an unclosed class");
    ++at_;
    if (negated) {
      if (!out->multibyte.empty()) return fail("a negated class with characters past ASCII is not supported");
      out->ascii = ~out->ascii;
      out->non_ascii = !out->non_ascii;
    }
    return true;
  }

  static constexpr int max_group_depth = 64;
  std::string_view p_;
  std::string name_;  ///< what the expression is called in what is wrong
  bool ecma_dot_;
  size_t at_ = 0;
  int groups_open_ = 0;
  std::string why_;
};

/// Whether `n` matches the empty text.
bool nullable(const node& n) {
  switch (n.k) {
    case node::chars: return false;
    case node::seq: return std::all_of(n.kids.begin(), n.kids.end(), nullable);
    case node::alt: return std::any_of(n.kids.begin(), n.kids.end(), nullable);
    case node::repeat: return n.min == 0 || nullable(n.kids[0]);
  }
  return false;
}

/// Grammar rules for a parsed expression, writing its text as itself or as the inside of a JSON
/// string.
class builder {
public:
  builder(grammar& g, std::string name, bool json_escaped)
      : g_(g), name_(std::move(name)), start_rules_(g.rules()), json_escaped_(json_escaped) {}

  bool build(const node& n, uint32_t* rule, std::string* why) {
    if (too_large(why)) return false;
    const uint32_t r = g_.add_rule();
    switch (n.k) {
      case node::chars: chars(n, r); break;
      case node::seq: {
        std::vector<sym> parts;
        for (const auto& k : n.kids) {
          uint32_t kr = 0;
          if (!build(k, &kr, why)) return false;
          parts.push_back(grammar::ref(kr));
        }
        g_.add_alternative(r, parts);
        break;
      }
      case node::alt:
        for (const auto& k : n.kids) {
          uint32_t kr = 0;
          if (!build(k, &kr, why)) return false;
          g_.add_alternative(r, {grammar::ref(kr)});
        }
        break;
      case node::repeat: {
        // An item that may match nothing lets each repetition end without reading a byte, so every
        // parse reaches each later repetition at once: (\w* ?){1,50} kept fifty parses alive, each
        // re-walked for every token, and was refused as too costly. The same texts are 0 to n of
        // the item's non-empty matches (empty ones only pad the count), one repetition per parse.
        uint32_t item_rule = 0;
        if (n.max != 0 && nullable(n.kids[0])) {
          std::optional<uint32_t> non_empty;
          if (!build_non_empty(n.kids[0], &non_empty, why)) return false;
          if (!non_empty) {  // the item matches only the empty text: so does the repeat
            g_.add_alternative(r, {});
            break;
          }
          g_.add_alternative(r, {grammar::ref(g_.add_repeat(*non_empty, 0, n.max))});
          break;
        }
        if (!build(n.kids[0], &item_rule, why)) return false;
        g_.add_alternative(r, {grammar::ref(g_.add_repeat(item_rule, n.min, n.max))});
        break;
      }
    }
    *rule = r;
    return true;
  }

private:
  bool too_large(std::string* why) const {
    if (g_.rules() - start_rules_ <= max_regex_rules) return false;
    *why = name_ + ": the expression's counts make it too large (more than " + std::to_string(max_regex_rules) +
           " rules)";
    return true;
  }

  /// Rules for what `n` matches but the empty text (`*rule` empty when that is all it matches),
  /// each part built once whole and once non-empty (a copy of the expression's tail per nullable
  /// part grew as its square: 4 KB of a? in a group took 370 MB). Repeats of such groups nested k
  /// deep build 2^k rules; max_regex_rules refuses them in milliseconds.
  bool build_non_empty(const node& n, std::optional<uint32_t>* rule, std::string* why) {
    rule->reset();
    if (too_large(why)) return false;
    switch (n.k) {
      case node::chars: {
        uint32_t r = 0;
        if (!build(n, &r, why)) return false;
        *rule = r;
        return true;
      }
      case node::alt: {
        std::vector<uint32_t> kids;
        for (const auto& k : n.kids) {
          std::optional<uint32_t> kr;
          if (!build_non_empty(k, &kr, why)) return false;
          if (kr) kids.push_back(*kr);
        }
        if (kids.empty()) return true;
        const uint32_t r = g_.add_rule();
        for (uint32_t kr : kids) g_.add_alternative(r, {grammar::ref(kr)});
        *rule = r;
        return true;
      }
      case node::seq: {
        // The first part that is not empty is part i, every part before it empty: one
        // alternative each, non-empty(part i) then S_{i+1} (the parts after it as written), side
        // by side in one rule (not a chain N_i = ... | N_{i+1}, which nests as deep as the parts
        // are many).
        const size_t count = n.kids.size();
        size_t last = 0;  // the last part that may be the first non-empty one
        while (last + 1 < count && nullable(n.kids[last])) ++last;
        std::vector<std::optional<uint32_t>> after(count + 1);  // after[i]: S_i; after[count]: nothing
        for (size_t i = count; i-- > 1;) {
          uint32_t part_rule = 0;
          if (!build(n.kids[i], &part_rule, why)) return false;
          const uint32_t r = g_.add_rule();
          std::vector<grammar::symbol> parts{grammar::ref(part_rule)};
          if (after[i + 1]) parts.push_back(grammar::ref(*after[i + 1]));
          g_.add_alternative(r, parts);
          after[i] = r;
        }
        std::optional<uint32_t> r;
        for (size_t i = 0; i <= last && i < count; ++i) {
          std::optional<uint32_t> first;
          if (!build_non_empty(n.kids[i], &first, why)) return false;
          if (!first) continue;
          if (!r) r = g_.add_rule();
          std::vector<grammar::symbol> parts{grammar::ref(*first)};
          if (after[i + 1]) parts.push_back(grammar::ref(*after[i + 1]));
          g_.add_alternative(*r, parts);
        }
        *rule = r;
        return true;
      }
      case node::repeat: {
        if (n.max == 0) return true;
        const node& item = n.kids[0];
        uint32_t item_rule = 0;
        if (nullable(item)) {  // X{m,n} of an X that may be empty: 1 to n of X's non-empty matches
          std::optional<uint32_t> non_empty;
          if (!build_non_empty(item, &non_empty, why)) return false;
          if (!non_empty) return true;
          item_rule = *non_empty;
        } else if (!build(item, &item_rule, why)) {
          return false;
        }
        *rule = g_.add_repeat(item_rule, std::max<uint32_t>(nullable(item) ? 1 : n.min, 1), n.max);
        return true;
      }
    }
    return true;
  }

  /// One character of the set, as itself or as JSON writes it inside a string.
  void chars(const node& n, uint32_t r) {
    sym plain;
    bool any_plain = false;
    for (uint32_t c = 0; c < 128; ++c) {
      if (!n.ascii.test(c)) continue;
      if (!json_escaped_ || (c >= 0x20 && c != '"' && c != '\\')) {
        plain.set[c >> 6] |= uint64_t{1} << (c & 63);
        any_plain = true;
        continue;
      }
      std::string e;
      switch (c) {
        case '"': e = "\\\""; break;
        case '\\': e = "\\\\"; break;
        case '\n': e = "\\n"; break;
        case '\t': e = "\\t"; break;
        case '\r': e = "\\r"; break;
        case '\b': e = "\\b"; break;
        case '\f': e = "\\f"; break;
        default: {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          e = buf;
        }
      }
      g_.add_alternative(r, grammar::literal(e));
    }
    if (any_plain) g_.add_alternative(r, {plain});
    for (const auto& m : n.multibyte) g_.add_alternative(r, grammar::literal(m));
    if (n.non_ascii) g_.add_utf8_multibyte(r);
  }

  grammar& g_;
  std::string name_;
  uint32_t start_rules_;
  bool json_escaped_;
};

/// Whether the byte at `i` is escaped (an odd run of backslashes before it).
bool escaped(std::string_view p, size_t i) {
  size_t n = 0;
  while (i > n && p[i - n - 1] == '\\') ++n;
  return n % 2 == 1;
}

/// Whether the expression has a '|' outside every group and class.
bool top_level_alternation(std::string_view p) {
  int depth = 0;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (escaped(p, i)) continue;
    const char c = p[i];
    if (in_class) in_class = c != ']';
    else if (c == '[') in_class = true;
    else if (c == '(') ++depth;
    else if (c == ')') --depth;
    else if (c == '|' && depth == 0) return true;
  }
  return false;
}

/// Reads `pattern` (called `name` in what is wrong): its anchors, ^ and $ at the ends, and the
/// expression between.
bool parse_pattern(std::string_view pattern, const std::string& name, bool ecma_dot, node* out, bool* from_start,
                   bool* to_end, std::string* why) {
  if (pattern.size() > max_regex_bytes) {
    *why = name + ": longer than " + std::to_string(max_regex_bytes) + " bytes";
    return false;
  }
  *from_start = !pattern.empty() && pattern.front() == '^';
  *to_end = !pattern.empty() && pattern.back() == '$' && !escaped(pattern, pattern.size() - 1) &&
            (pattern.size() > 1 || !*from_start);
  std::string_view body = pattern.substr(*from_start ? 1 : 0);
  if (*to_end) body.remove_suffix(1);
  if ((*from_start || *to_end) && top_level_alternation(body)) {
    *why = name + ": an anchor beside a top-level '|' is ambiguous here; group it, as ^(a|b)$";
    return false;
  }
  return parser(body, name, ecma_dot).parse(out, why);
}

}  // namespace

bool read_count(std::string_view text, size_t* at, uint32_t* out) {
  const size_t start = *at;
  uint64_t v = 0;
  // Every digit is read (a count too large is refused as such, not as a malformed one).
  for (; *at < text.size() && text[*at] >= '0' && text[*at] <= '9'; ++*at)
    v = std::min<uint64_t>(v * 10 + static_cast<uint64_t>(text[*at] - '0'), UINT32_MAX);
  *out = static_cast<uint32_t>(v);
  return *at > start;
}

std::string count_bounds_error(uint32_t lo, uint32_t hi) {
  if (hi < lo) return "{m,n} with n below m";
  if (lo > max_regex_count || (hi != unbounded && hi > max_regex_count))
    return "counts are supported up to " + std::to_string(max_regex_count);
  return {};
}

bool json_string_matching(grammar& g, std::string_view pattern, uint32_t* rule, std::string* why) {
  node parsed;
  bool from_start = false, to_end = false;
  if (!parse_pattern(pattern, "pattern", true, &parsed, &from_start, &to_end, why)) return false;
  // Anchors: without ^ (or $) the text may have anything before (or after) a match.
  node whole;
  whole.k = node::seq;
  node anything;
  anything.k = node::repeat;
  anything.min = 0;
  anything.max = unbounded;
  anything.kids.push_back(any_char());
  if (!from_start) whole.kids.push_back(anything);
  whole.kids.push_back(std::move(parsed));
  if (!to_end) whole.kids.push_back(anything);
  uint32_t inside = 0;
  if (!builder(g, "pattern", true).build(whole, &inside, why)) return false;
  const uint32_t out = g.add_rule();
  g.add_alternative(out, {grammar::byte('"'), grammar::ref(inside), grammar::byte('"')});
  *rule = out;
  return true;
}

bool text_matching(grammar& g, std::string_view pattern, uint32_t* rule, std::string* why, const std::string& name) {
  // The whole text matches, so anchors at the ends say nothing more.
  node parsed;
  bool from_start = false, to_end = false;
  return parse_pattern(pattern, name, false, &parsed, &from_start, &to_end, why) &&
         builder(g, name, false).build(parsed, rule, why);
}

}  // namespace baton::gpu

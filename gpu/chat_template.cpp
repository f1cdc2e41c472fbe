// The chat template's compiler: the template's text into pieces (text, {{ }} and {% %}, with
// Jinja's whitespace rules as transformers sets them), each tag's expression into tokens and then
// a tree, with Jinja's operator precedence.

#include "gpu/chat_template.hpp"

#include <cctype>
#include <set>
#include <utility>

#include "gpu/chat_template_ast.hpp"

namespace baton::gpu {

namespace {

using jinja::body;
using jinja::error;
using jinja::expr;
using jinja::expr_ptr;
using jinja::stmt;
using jinja::value;

[[noreturn]] void fail(int line, const std::string& what) { throw error{"line " + std::to_string(line) + ": " + what}; }

// ---- The template's pieces -------------------------------------------------------------------

struct piece {
  enum class kind { text, expression, statement } k;
  std::string text;  ///< the text, or the tag's inside
  int line = 0;
};

int line_at(const std::string& s, size_t pos) {
  int line = 1;
  for (size_t i = 0; i < pos && i < s.size(); ++i) line += s[i] == '\n';
  return line;
}

/// Where a tag opened at `from` ends (the index of its closing "}}", "%}" or "#}"), skipping
/// string literals inside expressions.
size_t tag_end(const std::string& s, size_t from, char closer, int line) {
  char quote = 0;
  for (size_t i = from; i + 1 < s.size(); ++i) {
    const char c = s[i];
    if (quote) {
      if (c == '\\') ++i;
      else if (c == quote) quote = 0;
      continue;
    }
    if (closer != '#' && (c == '\'' || c == '"')) quote = c;
    else if (c == closer && s[i + 1] == '}') return i;
  }
  if (quote) fail(line, "a string literal is never closed");
  fail(line, std::string{"a tag opened here is never closed (no '"} + closer + "}')");
}

/// Splits the source into pieces as transformers' Jinja environment does: trim_blocks (a block or
/// comment tag eats the newline after it), lstrip_blocks (spaces and tabs between a line's start
/// and a block or comment tag go), `-` inside a tag strips all whitespace on its side, `+` turns
/// lstrip off, and one trailing newline of the template is dropped (keep_trailing_newline off).
std::vector<piece> scan(std::string src) {
  if (!src.empty() && src.back() == '\n') src.pop_back();
  std::vector<piece> out;
  size_t pos = 0;
  bool line_starting = true;  // the text at `pos` begins a line
  while (pos <= src.size()) {
    size_t start = pos;
    while ((start = src.find('{', start)) != std::string::npos &&
           (start + 1 >= src.size() || (src[start + 1] != '{' && src[start + 1] != '%' && src[start + 1] != '#')))
      ++start;
    std::string text = src.substr(pos, start == std::string::npos ? std::string::npos : start - pos);
    if (start == std::string::npos) {
      if (!text.empty()) out.push_back({piece::kind::text, std::move(text), 0});
      break;
    }
    const char opener = src[start + 1];
    const char closer = opener == '{' ? '}' : opener;
    const int line = line_at(src, start);
    size_t inner = start + 2;
    const char sign = inner < src.size() && (src[inner] == '-' || src[inner] == '+') ? src[inner++] : 0;
    if (sign == '-') {
      while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    } else if (sign != '+' && opener != '{') {
      const size_t l = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
      bool blank = l < text.size();
      for (size_t i = l; i < text.size(); ++i) blank = blank && std::isspace(static_cast<unsigned char>(text[i]));
      if ((l > 0 || line_starting) && blank) text.erase(l);
    }
    if (!text.empty()) out.push_back({piece::kind::text, std::move(text), 0});
    const size_t end = tag_end(src, inner, closer, line);
    const bool strip_after = end > inner && src[end - 1] == '-';
    const bool keep_newline = end > inner && src[end - 1] == '+';  // `+%}`: trim_blocks off for this tag
    std::string tag = src.substr(inner, end - inner - (strip_after || keep_newline ? 1 : 0));
    pos = end + 2;
    line_starting = false;
    if (keep_newline) {
    } else if (strip_after) {
      while (pos < src.size() && std::isspace(static_cast<unsigned char>(src[pos]))) line_starting = src[pos++] == '\n';
    } else if (opener != '{' && pos < src.size() && src[pos] == '\n') {
      ++pos;
      line_starting = true;
    }
    if (opener == '#') continue;
    out.push_back({opener == '{' ? piece::kind::expression : piece::kind::statement, std::move(tag), line});
  }
  return out;
}

// ---- Expressions ----------------------------------------------------------------------------

struct token {
  enum class kind { name, string, number, op, end } k = kind::end;
  std::string text;  ///< a name or operator
  value v;           ///< a string's or number's value
};

/// Appends code point `cp` as UTF-8.
void put_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

constexpr size_t max_tag_tokens = 4096;

/// A tag's inside as tokens. Strings take Python's escapes (Jinja decodes them so).
std::vector<token> tokenize(const std::string& src, int line) {
  std::vector<token> out;
  size_t i = 0;
  static const char* const ops[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                    "(",  ")",  "[",  "]",  "{",  "}",  ".", ",", ":", "|", "="};
  while (i < src.size()) {
    const char c = src[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < src.size() && (std::isalnum(static_cast<unsigned char>(src[j])) || src[j] == '_')) ++j;
      out.push_back({token::kind::name, src.substr(i, j - i), {}});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < src.size() && (std::isdigit(static_cast<unsigned char>(src[j])) || src[j] == '_')) ++j;
      const auto digits_at = [&](size_t k) { return k < src.size() && std::isdigit(static_cast<unsigned char>(src[k])); };
      if (src[j] == '.' && digits_at(j + 1)) {
        is_float = true;
        for (++j; digits_at(j); ++j) {
        }
      }
      if (j < src.size() && (src[j] == 'e' || src[j] == 'E')) {  // 1e3, 2.5E-4
        const size_t k = j + 1 + (j + 1 < src.size() && (src[j + 1] == '+' || src[j + 1] == '-'));
        if (digits_at(k)) {
          is_float = true;
          for (j = k; digits_at(j); ++j) {
          }
        }
      }
      std::string digits;
      for (size_t k = i; k < j; ++k)
        if (src[k] != '_') digits += src[k];
      try {
        out.push_back({token::kind::number, {}, is_float ? value(std::stod(digits)) : value(std::stoll(digits))});
      } catch (const std::exception&) {
        fail(line, "the number " + digits.substr(0, 32) + " is too large");
      }
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < src.size() && src[j] != c; ++j) {
        if (src[j] != '\\' || j + 1 >= src.size()) {
          v += src[j];
          continue;
        }
        const char e = src[++j];
        switch (e) {
          case 'n': v += '\n'; break;
          case 't': v += '\t'; break;
          case 'r': v += '\r'; break;
          case '0': v += '\0'; break;
          case '\\': case '\'': case '"': v += e; break;
          case '\n': break;  // a continued line
          case 'x': case 'u': case 'U': {
            const size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            const std::string hex = j + digits < src.size() ? src.substr(j + 1, digits) : std::string{};
            if (hex.size() != digits || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
              fail(line, "a string's \\" + std::string(1, e) + " escape needs " + std::to_string(digits) + " hex digits");
            const auto cp = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
            if (cp > 0x10FFFF) fail(line, "a string's \\U escape is past U+10FFFF");
            put_utf8(v, cp);
            j += digits;
            break;
          }
          default: v += '\\'; v += e;  // Python keeps an unknown escape as written
        }
      }
      if (j >= src.size()) fail(line, "a string literal is never closed");
      out.push_back({token::kind::string, {}, value(std::move(v))});
      i = j + 1;
    } else {
      bool matched = false;
      for (const char* op : ops)
        if (src.compare(i, std::char_traits<char>::length(op), op) == 0) {
          out.push_back({token::kind::op, op, {}});
          i += std::char_traits<char>::length(op);
          matched = true;
          break;
        }
      if (!matched) fail(line, std::string{"unexpected character '"} + c + "'");
    }
  }
  // A tag's expression is a tree as deep as its chain of operators: bounded through its length.
  if (out.size() > max_tag_tokens) fail(line, "a tag holds more than " + std::to_string(max_tag_tokens) + " tokens");
  out.push_back({token::kind::end, {}, {}});
  return out;
}

/// Jinja's expression grammar, lowest precedence first: `x if c else y`, or, and, not,
/// comparisons (== != < > <= >= in, not in), + -, ~, * / // %, **, unary -, then a primary with
/// its postfixes (.attr, [item], [a:b:c], (call)) and filters and tests (| f, is t).
class parser {
public:
  parser(std::vector<token> tokens, int line) : t_(std::move(tokens)), line_(line) {}

  expr_ptr expression() { return condexpr(); }
  /// Without `x if c else y`: a for loop's `if` filters it.
  expr_ptr expression_without_if() { return or_expr(); }
  bool at_end() const { return peek().k == token::kind::end; }
  const token& peek(size_t ahead = 0) const { return t_[std::min(i_ + ahead, t_.size() - 1)]; }
  bool is_name(const char* n, size_t ahead = 0) const { return peek(ahead).k == token::kind::name && peek(ahead).text == n; }
  bool is_op(const char* o) const { return peek().k == token::kind::op && peek().text == o; }
  bool skip_name(const char* n) { return is_name(n) ? (++i_, true) : false; }
  bool skip_op(const char* o) { return is_op(o) ? (++i_, true) : false; }
  void expect_op(const char* o) {
    if (!skip_op(o)) fail(line_, std::string{"expected '"} + o + "', found " + describe(peek()));
  }
  std::string expect_name() {
    if (peek().k != token::kind::name) fail(line_, "expected a name, found " + describe(peek()));
    return t_[i_++].text;
  }
  void expect_end(const char* what) {
    if (!at_end()) fail(line_, std::string{"unexpected "} + describe(peek()) + " after " + what);
  }
  static std::string describe(const token& t) {
    switch (t.k) {
      case token::kind::end: return "the end of the tag";
      case token::kind::string: return "a string";
      case token::kind::number: return "a number";
      default: return "'" + t.text + "'";
    }
  }

private:
  expr_ptr node(expr::kind k, std::vector<expr_ptr> args, std::string text = {}) {
    auto e = std::make_shared<expr>();
    e->k = k;
    e->line = line_;
    e->args = std::move(args);
    e->text = std::move(text);
    return e;
  }

  expr_ptr condexpr() {
    // Each nested (, [, { or `if` comes back here: bounded, so that no template overflows the stack.
    if (++depth_ > max_depth) fail(line_, "the expression nests deeper than " + std::to_string(max_depth) + " levels");
    struct leave {
      int& d;
      ~leave() { --d; }
    } guard{depth_};
    auto e = or_expr();
    while (skip_name("if")) {
      auto c = or_expr();
      expr_ptr otherwise = skip_name("else") ? condexpr() : nullptr;
      e = node(expr::kind::cond, {e, c, otherwise});
    }
    return e;
  }
  expr_ptr or_expr() {
    auto e = and_expr();
    while (skip_name("or")) e = node(expr::kind::binary, {e, and_expr()}, "or");
    return e;
  }
  expr_ptr and_expr() {
    auto e = not_expr();
    while (skip_name("and")) e = node(expr::kind::binary, {e, not_expr()}, "and");
    return e;
  }
  expr_ptr not_expr() {
    if (!skip_name("not")) return compare();
    if (++depth_ > max_depth) fail(line_, "the expression nests deeper than " + std::to_string(max_depth) + " levels");
    auto e = node(expr::kind::not_, {not_expr()});
    --depth_;
    return e;
  }
  expr_ptr compare() {
    auto e = math1();
    for (;;) {
      std::string op;
      if (peek().k == token::kind::op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                          peek().text == ">" || peek().text == "<=" || peek().text == ">="))
        op = t_[i_++].text;
      else if (skip_name("in"))
        op = "in";
      else if (is_name("not") && is_name("in", 1))
        i_ += 2, op = "not in";
      else
        return e;
      e = node(expr::kind::binary, {e, math1()}, op);
    }
  }
  expr_ptr math1() {
    auto e = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = t_[i_++].text;
      e = node(expr::kind::binary, {e, concat()}, op);
    }
    return e;
  }
  expr_ptr concat() {
    auto e = math2();
    while (skip_op("~")) e = node(expr::kind::binary, {e, math2()}, "~");
    return e;
  }
  expr_ptr math2() {
    auto e = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = t_[i_++].text;
      e = node(expr::kind::binary, {e, power()}, op);
    }
    return e;
  }
  expr_ptr power() {
    auto e = unary(true);
    while (skip_op("**")) e = node(expr::kind::binary, {e, unary(true)}, "**");
    return e;
  }
  expr_ptr unary(bool with_filter) {
    expr_ptr e;
    if (is_op("-") || is_op("+")) {  // - - - x recurses once per sign: bounded as nesting is
      const bool negate = t_[i_++].text == "-";
      if (++depth_ > max_depth) fail(line_, "the expression nests deeper than " + std::to_string(max_depth) + " levels");
      e = unary(false);
      --depth_;
      if (negate) e = node(expr::kind::neg, {e});
    } else {
      e = primary();
    }
    e = postfix(e);
    return with_filter ? filters(e) : e;
  }
  expr_ptr primary() {
    const token t = peek();
    if (t.k == token::kind::string) {
      std::string s;
      while (peek().k == token::kind::string) s += t_[i_++].v.get<std::string>();  // 'a' 'b' is 'ab'
      auto e = node(expr::kind::literal, {});
      std::const_pointer_cast<expr>(e)->literal = s;
      return e;
    }
    if (t.k == token::kind::number) {
      ++i_;
      auto e = node(expr::kind::literal, {});
      std::const_pointer_cast<expr>(e)->literal = t.v;
      return e;
    }
    if (t.k == token::kind::name) {
      ++i_;
      auto e = node(expr::kind::literal, {});
      auto& lit = std::const_pointer_cast<expr>(e)->literal;
      if (t.text == "true" || t.text == "True") lit = true;
      else if (t.text == "false" || t.text == "False") lit = false;
      else if (t.text == "none" || t.text == "None") lit = nullptr;
      else return node(expr::kind::name, {}, t.text);
      return e;
    }
    if (skip_op("(")) {  // a parenthesised expression, or a tuple (a list here)
      if (skip_op(")")) return node(expr::kind::list, {});
      auto e = expression();
      if (!is_op(",")) {
        expect_op(")");
        return e;
      }
      std::vector<expr_ptr> items{e};
      while (skip_op(",") && !is_op(")")) items.push_back(expression());
      expect_op(")");
      return node(expr::kind::list, std::move(items));
    }
    if (skip_op("[")) {
      std::vector<expr_ptr> items;
      while (!skip_op("]")) {
        if (!items.empty()) expect_op(",");
        if (skip_op("]")) break;
        items.push_back(expression());
      }
      return node(expr::kind::list, std::move(items));
    }
    if (skip_op("{")) {
      std::vector<expr_ptr> items;
      while (!skip_op("}")) {
        if (!items.empty()) expect_op(",");
        if (skip_op("}")) break;
        items.push_back(expression());
        expect_op(":");
        items.push_back(expression());
      }
      return node(expr::kind::dict, std::move(items));
    }
    fail(line_, "expected a value, found " + describe(t));
  }
  /// Call arguments after '(': positional, then name=value.
  void call_args(const std::shared_ptr<expr>& call) {
    while (!skip_op(")")) {
      if (call->args.size() > 1 || !call->kwargs.empty()) expect_op(",");
      if (skip_op(")")) break;
      if (is_op("*") || is_op("**")) fail(line_, "*args and **kwargs are not supported");
      if (peek().k == token::kind::name && peek(1).k == token::kind::op && peek(1).text == "=") {
        std::string key = t_[i_].text;
        i_ += 2;
        call->kwargs.emplace_back(std::move(key), expression());
      } else {
        if (!call->kwargs.empty()) fail(line_, "a positional argument follows a keyword argument");
        call->args.push_back(expression());
      }
    }
  }
  expr_ptr postfix(expr_ptr e) {
    for (;;) {
      if (skip_op(".")) {
        if (peek().k == token::kind::number) {  // x.0 is x[0]
          auto idx = node(expr::kind::literal, {});
          std::const_pointer_cast<expr>(idx)->literal = t_[i_++].v;
          e = node(expr::kind::item, {e, idx});
        } else {
          e = node(expr::kind::attr, {e}, expect_name());
        }
      } else if (skip_op("[")) {
        expr_ptr a = is_op(":") ? nullptr : expression();
        if (skip_op(":")) {
          expr_ptr b = is_op(":") || is_op("]") ? nullptr : expression();
          expr_ptr c = skip_op(":") && !is_op("]") ? expression() : nullptr;
          e = node(expr::kind::slice, {e, a, b, c});
        } else {
          e = node(expr::kind::item, {e, a});
        }
        expect_op("]");
      } else if (skip_op("(")) {
        auto call = std::const_pointer_cast<expr>(node(expr::kind::call, {e}));
        call_args(call);
        e = call;
      } else {
        return e;
      }
    }
  }
  expr_ptr filters(expr_ptr e) {
    for (;;) {
      if (skip_op("|")) {
        const std::string name = expect_name();
        if (!jinja::known_filter(name)) fail(line_, "the filter '" + name + "' is not supported");
        auto f = std::const_pointer_cast<expr>(node(expr::kind::filter, {e}, name));
        if (skip_op("(")) call_args(f);
        e = postfix(f);
      } else if (skip_name("is")) {
        const bool negated = skip_name("not");
        const std::string name = expect_name();
        if (!jinja::known_test(name)) fail(line_, "the test '" + name + "' is not supported");
        auto t = std::const_pointer_cast<expr>(node(expr::kind::test, {e}, name));
        t->negated = negated;
        if (skip_op("(")) {
          call_args(t);
        } else if ((peek().k == token::kind::name && !is_name("else") && !is_name("or") && !is_name("and") &&
                    !is_name("if") && !is_name("in") && !is_name("not")) ||
                   peek().k == token::kind::string || peek().k == token::kind::number || is_op("[") || is_op("{")) {
          t->args.push_back(postfix(primary()));  // `is divisibleby 3`, `is equalto 'x'`
        }
        e = t;
      } else {
        return e;
      }
    }
  }

  static constexpr int max_depth = 128;
  std::vector<token> t_;
  size_t i_ = 0;
  int line_;
  int depth_ = 0;
};

// ---- Statements -------------------------------------------------------------------------------

class compiler {
public:
  explicit compiler(std::vector<piece> pieces) : p_(std::move(pieces)) {}

  body program() {
    std::string end_tag;
    auto b = block({}, &end_tag);
    return b;
  }
  const std::set<std::string>& macros() const { return macros_; }

private:
  /// Statements up to one of `ends` (its name in `*end`; its parser left positioned after the
  /// name), or the template's end when `ends` is empty.
  body block(const std::set<std::string>& ends, std::string* end, std::unique_ptr<parser>* end_parser = nullptr) {
    if (++depth_ > max_depth)
      fail(i_ < p_.size() ? p_[i_].line : 0, "statements nest deeper than " + std::to_string(max_depth) + " levels");
    struct leave {
      int& d;
      ~leave() { --d; }
    } guard{depth_};
    body out;
    while (i_ < p_.size()) {
      const piece& pc = p_[i_++];
      auto s = std::make_shared<stmt>();
      s->line = pc.line;
      if (pc.k == piece::kind::text) {
        s->text = pc.text;
        out.push_back(s);
        continue;
      }
      auto owner = std::make_unique<parser>(tokenize(pc.text, pc.line), pc.line);
      parser& ps = *owner;
      if (pc.k == piece::kind::expression) {
        s->k = stmt::kind::output;
        s->e = ps.expression();
        ps.expect_end("an expression");
        out.push_back(s);
        continue;
      }
      const std::string name = ps.expect_name();
      if (ends.count(name)) {
        if (name.rfind("end", 0) == 0 || name == "else") ps.expect_end(name.c_str());
        *end = name;
        if (end_parser) *end_parser = std::move(owner);  // elif's condition follows its name
        return out;
      }
      if (name == "if") {
        s->k = stmt::kind::if_;
        std::string e = "elif";
        auto cond = ps.expression();
        ps.expect_end("if's condition");
        while (e == "elif") {
          std::unique_ptr<parser> next;
          auto b = block({"elif", "else", "endif"}, &e, &next);
          if (e.empty()) fail(pc.line, "this if is never closed with endif");
          s->branches.emplace_back(cond, std::move(b));
          if (e == "elif") {
            cond = next->expression();
            next->expect_end("elif's condition");
          }
        }
        if (e == "else") {
          s->else_body = block({"endif"}, &e);
          if (e.empty()) fail(pc.line, "this if is never closed with endif");
        }
      } else if (name == "for") {
        s->k = stmt::kind::for_;
        do s->targets.push_back(ps.expect_name());
        while (ps.skip_op(","));
        if (!ps.skip_name("in")) fail(pc.line, "expected 'in' in the for loop");
        s->e = ps.expression_without_if();
        if (ps.skip_name("if")) s->filter = ps.expression();
        if (ps.is_name("recursive")) fail(pc.line, "recursive loops are not supported");
        ps.expect_end("the for loop's head");
        std::string e;
        ++loops_;
        s->inner = block({"else", "endfor"}, &e);
        --loops_;
        if (e == "else") s->else_body = block({"endfor"}, &e);
        if (e.empty()) fail(pc.line, "this for is never closed with endfor");
      } else if (name == "set") {
        s->targets.push_back(ps.expect_name());
        if (ps.skip_op(".")) s->targets.push_back(ps.expect_name());
        if (ps.is_op(",")) fail(pc.line, "setting several names at once is not supported");
        if (ps.skip_op("=")) {
          s->k = stmt::kind::set;
          s->e = ps.expression();
          ps.expect_end("set's value");
        } else {
          ps.expect_end("set's name");
          if (s->targets.size() > 1) fail(pc.line, "a set block sets a name, not an attribute");
          s->k = stmt::kind::set_block;
          std::string e;
          s->inner = block({"endset"}, &e);
          if (e.empty()) fail(pc.line, "this set is never closed with endset");
        }
      } else if (name == "macro") {
        s->k = stmt::kind::macro;
        s->text = ps.expect_name();
        ps.expect_op("(");
        while (!ps.skip_op(")")) {
          if (!s->params.empty()) ps.expect_op(",");
          if (ps.skip_op(")")) break;
          std::string param = ps.expect_name();
          s->params.emplace_back(std::move(param), ps.skip_op("=") ? ps.expression() : nullptr);
        }
        ps.expect_end("the macro's parameters");
        macros_.insert(s->text);
        std::string e;
        const int loops = std::exchange(loops_, 0);  // a macro's body is outside any loop around it
        s->inner = block({"endmacro"}, &e);
        loops_ = loops;
        if (e.empty()) fail(pc.line, "this macro is never closed with endmacro");
      } else if (name == "break" || name == "continue") {
        ps.expect_end(name.c_str());
        if (loops_ == 0) fail(pc.line, "'" + name + "' is outside a for loop");
        s->k = name == "break" ? stmt::kind::break_ : stmt::kind::continue_;
      } else if (name == "generation") {  // transformers' marker of the assistant's text: rendered as is
        ps.expect_end("generation");
        std::string e;
        auto inner = block({"endgeneration"}, &e);
        if (e.empty()) fail(pc.line, "this generation is never closed with endgeneration");
        out.insert(out.end(), inner.begin(), inner.end());
        continue;
      } else if (name == "endif" || name == "endfor" || name == "endset" || name == "endmacro" || name == "elif" ||
                 name == "else" || name == "endgeneration") {
        fail(pc.line, "'" + name + "' closes nothing open here");
      } else {
        fail(pc.line, "the statement '" + name + "' is not supported");
      }
      out.push_back(s);
    }
    end->clear();
    return out;
  }

  static constexpr int max_depth = 64;
  std::vector<piece> p_;
  size_t i_ = 0;
  int depth_ = 0;
  int loops_ = 0;  ///< for loops open around the statement being read (break and continue need one)
  std::set<std::string> macros_;
};

/// Every call of a bare name is a function the renderer has or a macro the template defines:
/// checked once the whole template is read (a macro may be called above its definition).
void check_calls(const expr_ptr& e, const std::set<std::string>& macros) {
  if (!e) return;
  if (e->k == expr::kind::call && e->args[0]->k != expr::kind::name && e->args[0]->k != expr::kind::attr)
    fail(e->line, "only functions, macros and methods can be called");
  if (e->k == expr::kind::call && e->args[0]->k == expr::kind::name && !jinja::known_function(e->args[0]->text) &&
      !macros.count(e->args[0]->text))
    fail(e->line, "the function '" + e->args[0]->text + "' is not defined");
  if (e->k == expr::kind::call && e->args[0]->k == expr::kind::attr && !jinja::known_method(e->args[0]->text))
    fail(e->line, "the method '" + e->args[0]->text + "' is not supported");
  for (const auto& a : e->args) check_calls(a, macros);
  for (const auto& [k, a] : e->kwargs) check_calls(a, macros);
}

void check_calls(const body& b, const std::set<std::string>& macros) {
  for (const auto& s : b) {
    check_calls(s->e, macros);
    check_calls(s->filter, macros);
    for (const auto& [c, inner] : s->branches) {
      check_calls(c, macros);
      check_calls(inner, macros);
    }
    for (const auto& [name, d] : s->params) check_calls(d, macros);
    check_calls(s->inner, macros);
    check_calls(s->else_body, macros);
  }
}

}  // namespace

chat_template::chat_template(std::unique_ptr<program> p) : p_(std::move(p)) {}
chat_template::~chat_template() = default;

std::unique_ptr<chat_template> chat_template::compile(const std::string& source, std::string* why) {
  try {
    compiler c{scan(source)};
    auto p = std::make_unique<program>();
    p->root = c.program();
    check_calls(p->root, c.macros());
    return std::unique_ptr<chat_template>(new chat_template(std::move(p)));
  } catch (const jinja::error& e) {
    *why = "chat template " + e.what;
    return nullptr;
  } catch (const std::exception& e) {  // a number too large for stoll/stod
    *why = std::string{"chat template: "} + e.what();
    return nullptr;
  }
}

bool chat_template::render(const nlohmann::ordered_json& context, std::string* out, std::string* why) const {
  try {
    *out = jinja::render_program(*p_, context);
    return true;
  } catch (const jinja::error& e) {
    *why = e.what;
    return false;
  } catch (const std::exception& e) {  // a value too large for the library (bad_alloc, length_error)
    *why = std::string{"chat template: "} + e.what();
    return false;
  }
}

}  // namespace baton::gpu

#include "gpu/json_schema_grammar.hpp"

#include <algorithm>
#include <cmath>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "gpu/gbnf_grammar.hpp"
#include "gpu/text_file.hpp"
#include "gpu/json_schema_numbers.hpp"
#include "gpu/regex_grammar.hpp"

namespace baton::gpu {

namespace {

/// What the ambiguity probe read, as a client can read it: printable ASCII as itself, the rest
/// as \xNN (it reads the lowest byte of each class: a NUL, tabs).
std::string shown_probe(const std::string& read) {
  std::string out = "\"";
  for (unsigned char c : read) {
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  return out + "\"";
}

/// Why a grammar the greedy probe read is not followed (grammar::max_parses, max_probe_work), as
/// `name` says it; empty when it is.
std::string cost_problem(const grammar::ambiguity& amb, const std::string& name) {
  const auto read = amb.read.empty() ? std::string{"at its start"}
                                     : "after the " + std::to_string(amb.read.size()) + " characters " + shown_probe(amb.read);
  if (amb.parses > grammar::max_parses)
    return name + ": too ambiguous to follow: " + read + " it can be read " + std::to_string(amb.parses) +
           (amb.parses >= 4096 ? " or more" : "") + " ways at once (at most " + std::to_string(grammar::max_parses) +
           "); nested counts of optional items, such as (.{0,64}){64}, do this";
  if (amb.work > grammar::max_probe_work)
    return name + ": too costly to follow: reading " + std::to_string(amb.read.size()) + " characters made " +
           std::to_string(amb.work) + " parse steps (at most " + std::to_string(grammar::max_probe_work) +
           "), which every token would repeat; many optional items one after another, such as \\w? written 200 times, do this";
  return {};
}

using json = nlohmann::ordered_json;  // properties keep the schema's order
using sym = grammar::symbol;
using seq = std::vector<sym>;

/// Deeper schemas are refused: compiling recurses once per level.
constexpr int max_schema_depth = 64;
/// The most items a bounded array spells out (one rule each).
constexpr uint64_t max_bounded_items = 1024;
/// The most rules one schema may make (a guard against schemas that would blow up).
constexpr uint32_t max_rules = 100000;


class compiler {
public:
  compiler(const json* root, bool compact) : root_(root) { build_common(compact); }

  grammar& g() { return *g_; }
  std::shared_ptr<const grammar> finish(uint32_t start) {
    g_->set_start(start);
    return std::move(g_);
  }

  /// Keywords that schema writers (Pydantic, zod) emit at values that restrict nothing: taken,
  /// as they ask for nothing the grammar would have to enforce. At any other value, refused.
  static bool restricts_nothing(const std::string& key, const json& v, const json& s) {
    if (key == "uniqueItems") return v == false;
    if (key == "minProperties") return v == 0;
    if (key == "multipleOf") return v == 1 && s.contains("type") && s["type"] == "integer";
    return false;
  }

  /// A rule matching values of `s` (at JSON pointer `where`), or false and why_.
  bool value(const json& s, const std::string& where, int depth, uint32_t* rule) {
    if (depth > max_schema_depth) return fail(where, "the schema nests deeper than " + std::to_string(max_schema_depth));
    if (g_->rules() > max_rules) return fail(where, "the schema makes more than " + std::to_string(max_rules) + " rules");
    if (s.is_boolean()) {
      if (!s.get<bool>()) return fail(where, "the schema `false` matches nothing");
      *rule = any_value_;
      return true;
    }
    if (!s.is_object()) return fail(where, "a schema must be an object or a boolean, got " + std::string(s.type_name()));
    for (const auto& [key, v] : s.items()) {
      static const std::set<std::string> known = {
          "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum", "const",
          "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "title", "description", "default", "examples",
          "$schema", "$id", "$comment", "strict", "nullable", "pattern", "format", "minLength", "maxLength",
          "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "prefixItems", "discriminator",
          "deprecated", "readOnly", "writeOnly"};
      if (!known.count(key) && !restricts_nothing(key, v, s))
        return fail(where, "the keyword '" + key + "' is not supported (Baton's grammars cannot enforce it)");
    }
    if (!discriminator_holds(s, where)) return false;
    // A keyword that takes the whole value (a reference, a list of values, a choice of schemas)
    // leaves nothing for others beside it to say: one that would, would be ignored, so it is
    // refused ($defs and annotations aside; a type beside an enum is implied by its values).
    const auto alone = [&](const std::string& key, std::initializer_list<const char*> allowed) {
      // (OpenAPI's discriminator, which Pydantic writes beside every tagged union's oneOf, only
      // names the property that tells its schemas apart: the schemas still decide.)
      static const std::set<std::string> quiet = {"title",       "description", "default",    "examples",
                                                  "$schema",     "$id",         "$comment",   "strict",
                                                  "$defs",       "definitions", "discriminator", "deprecated",
                                                  "readOnly",    "writeOnly"};
      for (auto it = s.begin(); it != s.end(); ++it) {
        const std::string& k = it.key();
        if (k == key || quiet.count(k)) continue;
        bool fine = false;
        for (const char* a : allowed) fine = fine || k == a;
        if (fine) continue;
        return fail(where, "'" + k + "' beside " + key + " is not supported (it would be ignored); move it into " +
                               (key == "$ref" ? "the schema referred to" : key == "enum" || key == "const"
                                                                            ? "nothing: the values say it all"
                                                                            : "each of " + key + "'s schemas"));
      }
      return true;
    };
    if (auto it = s.find("$ref"); it != s.end()) {
      if (!alone("$ref", {})) return false;
      return ref(*it, where, depth, rule);
    }
    if (auto it = s.find("const"); it != s.end()) {
      if (!alone("const", {"type", "nullable"})) return false;
      return literals(json::array({*it}), rule);
    }
    if (auto it = s.find("enum"); it != s.end()) {
      if (!it->is_array() || it->empty()) return fail(where + "/enum", "enum must be a non-empty array");
      if (!alone("enum", {"type", "nullable"})) return false;
      return literals(*it, rule);
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (auto it = s.find(key); it != s.end()) {
        if (!alone(key, {})) return false;
        if (!it->is_array() || it->empty()) return fail(where + "/" + key, std::string(key) + " must be a non-empty array");
        const uint32_t r = g_->add_rule();
        const std::string tag = discriminator_property(s);
        for (size_t i = 0; i < it->size(); ++i) {
          uint32_t alt = 0;
          // A discriminated branch always writes its tag: Pydantic leaves a defaulted tag
          // (kind: Literal["cat"] = "cat") out of `required`, yet its validator needs it.
          const json* branch = &(*it)[i];
          json tagged;
          if (const json* b = tag.empty() ? nullptr : resolved(*branch); b && b->is_object() && !lists_required(*b, tag)) {
            tagged = *b;
            tagged["required"].push_back(tag);
            branch = &tagged;
          }
          if (!value(*branch, where + "/" + key + "/" + std::to_string(i), depth + 1, &alt)) return false;
          g_->add_alternative(r, {grammar::ref(alt)});
        }
        *rule = r;
        return true;
      }
    if (auto it = s.find("allOf"); it != s.end()) {
      if (!it->is_array() || it->size() != 1) return fail(where + "/allOf", "allOf is supported with one schema only");
      if (!alone("allOf", {})) return false;
      return value((*it)[0], where + "/allOf/0", depth + 1, rule);
    }
    std::vector<std::string> types;
    if (auto it = s.find("type"); it != s.end()) {
      if (it->is_string()) types.push_back(it->get<std::string>());
      else if (it->is_array())
        for (const auto& t : *it) {
          if (!t.is_string()) return fail(where + "/type", "type must be a string or a list of strings");
          types.push_back(t.get<std::string>());
        }
      else
        return fail(where + "/type", "type must be a string or a list of strings");
      if (types.empty()) return fail(where + "/type", "type lists no type");
    } else if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required")) {
      types.push_back("object");
    } else if (s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems")) {
      types.push_back("array");
    } else if (s.contains("pattern") || s.contains("format") || s.contains("minLength") || s.contains("maxLength")) {
      types.push_back("string");  // only strings have them: the answer is one
    } else if (s.contains("minimum") || s.contains("maximum") || s.contains("exclusiveMinimum") ||
               s.contains("exclusiveMaximum")) {
      return fail(where, "a bound without a type: give type integer or number");
    } else {
      *rule = any_value_;
      return true;
    }
    if (auto n = s.find("nullable"); n != s.end()) {  // OpenAPI's spelling of ["T", "null"]
      if (!n->is_boolean()) return fail(where + "/nullable", "nullable must be true or false");
      if (n->get<bool>()) types.push_back("null");
    }
    const uint32_t r = g_->add_rule();
    for (const auto& t : types) {
      uint32_t one = 0;
      if (t == "object") {
        if (!object(s, where, depth, &one)) return false;
      } else if (t == "array") {
        if (!array(s, where, depth, &one)) return false;
      } else if (t == "string") {
        if (!string_rule(s, where, &one)) return false;
      } else if (t == "integer") {
        if (!integer_rule(s, where, &one)) return false;
      } else if (t == "number") {
        if (!number_rule(s, where, &one)) return false;
      }
      else if (t == "boolean") one = boolean_;
      else if (t == "null") one = null_;
      else
        return fail(where + "/type", "unknown type '" + t + "'");
      g_->add_alternative(r, {grammar::ref(one)});
    }
    *rule = r;
    return true;
  }

  std::string why_;

private:
  bool fail(const std::string& where, const std::string& what) {
    why_ = "json_schema at " + (where.empty() ? std::string("/") : where) + ": " + what;
    return false;
  }

  seq lit(std::string_view text) { return grammar::literal(text); }
  sym r(uint32_t rule) { return grammar::ref(rule); }

  /// Exactly one of these values, written compactly (enum, const).
  bool literals(const json& values, uint32_t* rule) {
    const uint32_t out = g_->add_rule();
    for (const auto& v : values) g_->add_alternative(out, lit(v.dump()));
    *rule = out;
    return true;
  }

  /// OpenAPI's discriminator names the property that tells a oneOf's (anyOf's) schemas apart. It
  /// asks nothing the grammar does not hold when every schema pins that property (const or enum),
  /// as Pydantic's tagged unions do, and each writes it (the oneOf's compile makes it required).
  /// Otherwise an answer could carry one schema's tag with another's fields, and it is refused.
  /// The schema a oneOf branch is: itself, or what its "$ref" names (null: a broken reference).
  const json* resolved(const json& b) const {
    if (!b.is_object() || !b.contains("$ref") || !b["$ref"].is_string()) return &b;
    const std::string path = b["$ref"].get<std::string>();
    if (path.size() <= 1 || path[0] != '#') return path == "#" ? root_ : nullptr;
    try {
      return &root_->at(json::json_pointer(path.substr(1)));
    } catch (const json::exception&) {
      return nullptr;
    }
  }
  static bool lists_required(const json& b, const std::string& name) {
    return b.contains("required") && b["required"].is_array() &&
           std::find(b["required"].begin(), b["required"].end(), json(name)) != b["required"].end();
  }
  /// The discriminator's propertyName beside a oneOf/anyOf (checked by discriminator_holds), or "".
  static std::string discriminator_property(const json& s) {
    const auto d = s.find("discriminator");
    return d != s.end() && d->is_object() && d->contains("propertyName") && (*d)["propertyName"].is_string()
               ? (*d)["propertyName"].get<std::string>()
               : std::string{};
  }

  bool discriminator_holds(const json& s, const std::string& where) {
    const auto d = s.find("discriminator");
    if (d == s.end()) return true;
    const std::string at = where + "/discriminator";
    if (!d->is_object() || !d->contains("propertyName") || !(*d)["propertyName"].is_string())
      return fail(at, "discriminator must be an object with a propertyName");
    const std::string name = (*d)["propertyName"].get<std::string>();
    const char* key = s.contains("oneOf") ? "oneOf" : "anyOf";
    const auto list = s.find(key);
    if (list == s.end() || !list->is_array()) return fail(at, "discriminator goes beside oneOf or anyOf");
    for (size_t i = 0; i < list->size(); ++i) {
      const json* b = resolved((*list)[i]);
      if (!b) continue;  // value() names the broken reference
      const json* p = b->is_object() && b->contains("properties") && (*b)["properties"].is_object() &&
                              (*b)["properties"].contains(name)
                          ? &(*b)["properties"][name]
                          : nullptr;
      // (Required or not: the grammar has each branch write it, as the oneOf's compile does.)
      if (!p || !p->is_object() || !(p->contains("const") || p->contains("enum")))
        return fail(at, "discriminator names '" + name + "', which " + key + "/" + std::to_string(i) +
                            " does not pin (a property with const or enum): an answer could carry one schema's tag "
                            "with another's fields");
    }
    return true;
  }

  bool ref(const json& target, const std::string& where, int depth, uint32_t* rule) {
    if (!target.is_string()) return fail(where + "/$ref", "$ref must be a string");
    const std::string path = target.get<std::string>();
    if (auto it = refs_.find(path); it != refs_.end()) {
      *rule = it->second;
      return true;
    }
    if (path.empty() || path[0] != '#')
      return fail(where + "/$ref", "$ref '" + path + "' is not inside this schema (only #/... is followed)");
    const json* at = root_;
    try {
      if (path.size() > 1) at = &root_->at(json::json_pointer(path.substr(1)));
    } catch (const json::exception&) {
      return fail(where + "/$ref", "$ref '" + path + "' names nothing in this schema");
    }
    // The rule exists before its body, so a schema that refers to itself (a tree) recurses.
    const uint32_t out = g_->add_rule();
    refs_.emplace(path, out);
    uint32_t body = 0;
    if (!value(*at, path.substr(1), depth + 1, &body)) return false;
    g_->add_alternative(out, {r(body)});
    *rule = out;
    return true;
  }

  bool object(const json& s, const std::string& where, int depth, uint32_t* rule) {
    const auto props = s.find("properties");
    const auto extra = s.find("additionalProperties");
    std::set<std::string> required;
    if (auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) return fail(where + "/required", "required must be a list of property names");
      for (const auto& n : *it) {
        if (!n.is_string()) return fail(where + "/required", "required must be a list of property names");
        required.insert(n.get<std::string>());
      }
    }
    const uint32_t out = g_->add_rule();
    if (props == s.end() || (props->is_object() && props->empty() && required.empty())) {
      // Any keys: additionalProperties' schema for every value (absent or true: any value).
      uint32_t v = any_value_;
      if (extra != s.end() && extra->is_boolean() && !extra->get<bool>()) {
        g_->add_alternative(out, lit("{") + seq{r(ws_)} + lit("}"));
        *rule = out;
        return true;
      }
      if (extra != s.end() && !extra->is_boolean() &&
          !value(*extra, where + "/additionalProperties", depth + 1, &v))
        return false;
      if (!required.empty()) return fail(where + "/required", "required names properties that `properties` lacks");
      *rule = members(v);
      return true;
    }
    if (!props->is_object()) return fail(where + "/properties", "properties must be an object");
    if (extra != s.end() && !extra->is_boolean())
      return fail(where + "/additionalProperties",
                  "an additionalProperties schema beside properties is not supported (use false)");
    for (const auto& n : required)
      if (!props->contains(n)) return fail(where + "/required", "required names '" + n + "', which properties lacks");
    // Properties in order, required ones always, optional ones maybe, commas only between:
    // rest[i][c]: the properties from i on, c = whether one was written already (a comma first).
    const size_t n = props->size();
    std::vector<std::array<uint32_t, 2>> rest(n + 1);
    for (auto& rr : rest) rr = {g_->add_rule(), g_->add_rule()};
    g_->add_alternative(rest[n][0], {});
    g_->add_alternative(rest[n][1], {});
    size_t i = 0;
    for (const auto& [name, schema] : props->items()) {
      uint32_t v = 0;
      if (!value(schema, where + "/properties/" + name, depth + 1, &v)) return false;
      const seq kv = lit(json(name).dump()) + seq{r(ws_)} + lit(":") + seq{r(ws_), r(v)};
      const bool must = required.count(name) > 0;
      g_->add_alternative(rest[i][0], kv + seq{r(rest[i + 1][1])});
      g_->add_alternative(rest[i][1], seq{r(ws_)} + lit(",") + seq{r(ws_)} + kv + seq{r(rest[i + 1][1])});
      if (!must) {
        g_->add_alternative(rest[i][0], {r(rest[i + 1][0])});
        g_->add_alternative(rest[i][1], {r(rest[i + 1][1])});
      }
      ++i;
    }
    g_->add_alternative(out, lit("{") + seq{r(ws_), r(rest[0][0]), r(ws_)} + lit("}"));
    *rule = out;
    return true;
  }

  /// A string; with pattern, format or minLength/maxLength, as a regular expression says.
  bool string_rule(const json& s, const std::string& where, uint32_t* rule) {
    const auto pattern = s.find("pattern"), format = s.find("format");
    const bool lengths = s.contains("minLength") || s.contains("maxLength");
    if (pattern == s.end() && format == s.end() && !lengths) {
      *rule = string_;
      return true;
    }
    if ((pattern != s.end()) + (format != s.end()) + lengths > 1)
      return fail(where, "pattern, format and minLength/maxLength are supported one at a time");
    std::string regex, at = where;
    if (pattern != s.end()) {
      if (!pattern->is_string()) return fail(where + "/pattern", "pattern must be a string");
      regex = pattern->get<std::string>();
      at += "/pattern";
    } else if (format != s.end()) {
      // What each format's strings look like; every string they match is valid (email: a
      // common subset of addresses: dot-separated atoms, so no leading, trailing or doubled dot,
      // and domain labels that neither start nor end with a hyphen).
      static const std::map<std::string, std::string> formats = {
          {"date", date_regex},
          {"time", "^" + time_regex + "$"},
          {"date-time", date_regex.substr(0, date_regex.size() - 1) + "T" + time_regex + "$"},
          {"uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"},
          {"ipv4", "^((25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)\\.){3}(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)$"},
          // ipv6 written out in full (eight groups, no ::); hostname as RFC 1123's labels (no hyphen at
          // either end), at most 8 labels of at most 30 characters, so never past 253 in all;
          // duration as RFC 3339's Appendix A grammar (which ISO 8601 allows too): PnW, or a date
          // part (Y, then M, then D, none skipped between the first and last given) and/or a time
          // part (H, M, S likewise).
          {"ipv6", "^([0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}$"},
          {"hostname", "^[A-Za-z0-9]([A-Za-z0-9-]{0,28}[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]{0,28}[A-Za-z0-9])?){0,7}$"},
          {"duration", "^P((\\d+D|\\d+M(\\d+D)?|\\d+Y(\\d+M(\\d+D)?)?)(T(\\d+H(\\d+M"
                       "(\\d+S)?)?|\\d+M(\\d+S)?|\\d+S))?|T(\\d+H(\\d+M(\\d+S)?)?|\\d+M(\\d+S)?|\\d+S)|\\d+W)$"},
          {"email", "^[A-Za-z0-9_%+-]+(\\.[A-Za-z0-9_%+-]+)*@[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
                    "(\\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*\\.[A-Za-z]{2,}$"}};
      const auto f = format->is_string() ? formats.find(format->get<std::string>()) : formats.end();
      if (f == formats.end())
        return fail(where + "/format", "the format " + format->dump() +
                                           " is not supported (date, time, date-time, duration, uuid, ipv4, ipv6, hostname and "
                                           "email are)");
      regex = f->second;
    } else {
      uint64_t lo = 0, hi = UINT64_MAX;
      if (!count_bounds(s, where, "minLength", "maxLength", max_regex_count, &lo, &hi)) return false;
      regex = "^(?:.|\\n|\\r){" + std::to_string(lo) + "," + (hi == UINT64_MAX ? "" : std::to_string(hi)) + "}$";
    }
    std::string why;
    if (!json_string_matching(*g_, regex, rule, &why)) return fail(at, why);
    // Probed on its own too: the whole schema's probe spends its characters on blank space and
    // the properties before this one, and never reaches it (a review).
    grammar alone;
    uint32_t start = 0;
    if (json_string_matching(alone, regex, &start, &why)) {
      alone.set_start(start);
      if (auto problem = cost_problem(alone.probe_ambiguity(64, grammar::max_parses), "pattern"); !problem.empty())
        return fail(at, problem);
    }
    return true;
  }

  /// A number; with minimum / maximum (exclusive ones too), only those in the range, written
  /// without an exponent (json_schema_numbers.hpp). Bounds on numbers must be whole numbers (as
  /// Pydantic's ge=0, le=1 are): a fractional one is refused.
  bool number_rule(const json& s, const std::string& where, uint32_t* rule) {
    std::optional<number_bound> lo, hi;
    for (const char* key : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
      auto it = s.find(key);
      if (it == s.end()) continue;
      if (!it->is_number() || std::abs(it->get<double>()) > 1e15 || it->get<double>() != std::floor(it->get<double>()))
        return fail(where + "/" + key, std::string(key) + " on a number must be a whole number within +-1e15 (bounds "
                                                           "between whole numbers are not supported), got " + it->dump());
      const std::string k = key;
      const number_bound b{static_cast<int64_t>(it->get<double>()), k == "minimum" || k == "maximum"};
      auto& end = k == "minimum" || k == "exclusiveMinimum" ? lo : hi;
      const bool lower = &end == &lo;
      // The tighter of two: the larger lower bound (the smaller upper one); at a tie, the exclusive one.
      if (!end || (lower ? b.value > end->value : b.value < end->value) || (b.value == end->value && !b.inclusive)) end = b;
    }
    if (!lo && !hi) {
      *rule = number_;
      return true;
    }
    const auto out = bounded_number(*g_, digits_, lo, hi);
    if (!out) return fail(where, "no number lies between its minimum and maximum");
    *rule = *out;
    return true;
  }

  /// An integer; with minimum / maximum (exclusive ones too), only those in the range: spelled
  /// out digit by digit, as a range of numbers is in a regular expression.
  bool integer_rule(const json& s, const std::string& where, uint32_t* rule) {
    std::optional<int64_t> lo, hi;
    constexpr double limit = 1e15;  // well inside int64 and exact in a double
    for (const char* key : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
      auto it = s.find(key);
      if (it == s.end()) continue;
      if (!it->is_number() || std::abs(it->get<double>()) > limit)
        return fail(where + "/" + key, std::string(key) + " must be a number within +-1e15 (draft 4's boolean "
                                                           "exclusiveMinimum is not supported)");
      const double v = it->get<double>();
      const std::string k = key;
      std::optional<int64_t>& bound = k == "minimum" || k == "exclusiveMinimum" ? lo : hi;
      int64_t b = k == "minimum"            ? static_cast<int64_t>(std::ceil(v))
                  : k == "maximum"          ? static_cast<int64_t>(std::floor(v))
                  : k == "exclusiveMinimum" ? static_cast<int64_t>(std::floor(v)) + 1
                                            : static_cast<int64_t>(std::ceil(v)) - 1;
      bound = !bound ? b : (&bound == &lo ? std::max(*bound, b) : std::min(*bound, b));
    }
    if (!lo && !hi) {
      *rule = integer_;
      return true;
    }
    if (lo && hi && *lo > *hi) return fail(where, "no integer lies between its minimum and maximum");
    const uint32_t out = g_->add_rule();
    const auto minus = [&](std::optional<int64_t> from, std::optional<int64_t> to) {  // -y for y in [from, to]
      const uint32_t part = natural_range(*g_, digits_, *from, to);
      g_->add_alternative(out, lit("-") + seq{r(part)});
    };
    if (lo && *lo >= 0) {
      g_->add_alternative(out, {r(natural_range(*g_, digits_, *lo, hi))});
    } else if (hi && *hi < 0) {
      minus(-*hi, lo ? std::optional<int64_t>(-*lo) : std::nullopt);
    } else {  // the negatives down to lo, then 0 up to hi
      minus(1, lo ? std::optional<int64_t>(-*lo) : std::nullopt);
      g_->add_alternative(out, {r(natural_range(*g_, digits_, 0, hi))});
    }
    *rule = out;
    return true;
  }

  static inline const std::string date_regex = "^\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])$";
  static inline const std::string time_regex =
      "([01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(\\.\\d{1,9})?(Z|[+-]([01]\\d|2[0-3]):[0-5]\\d)";

  /// A pair of counts (minItems / maxItems, minLength / maxLength): integers >= 0, in order, at
  /// most `limit`; absent, 0 and UINT64_MAX (no end).
  bool count_bounds(const json& s, const std::string& where, const char* min_key, const char* max_key, uint64_t limit,
                    uint64_t* lo, uint64_t* hi) {
    for (const auto& [key, out] : {std::pair<const char*, uint64_t*>{min_key, lo}, {max_key, hi}})
      if (auto it = s.find(key); it != s.end()) {
        if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0))
          return fail(where + "/" + key, std::string(key) + " must be an integer >= 0");
        *out = it->get<uint64_t>();
      }
    if (*lo > *hi) return fail(where, std::string(min_key) + " is above " + max_key);
    if (*lo > limit || (*hi != UINT64_MAX && *hi > limit))
      return fail(where, std::string(min_key) + " and " + max_key + " are supported up to " + std::to_string(limit));
    return true;
  }

  /// {"key": value, ...} with any keys.
  uint32_t members(uint32_t v) {
    if (auto it = members_.find(v); it != members_.end()) return it->second;
    const uint32_t out = g_->add_rule(), more = g_->add_rule();
    const seq kv = seq{r(string_), r(ws_)} + lit(":") + seq{r(ws_), r(v)};
    g_->add_alternative(out, lit("{") + seq{r(ws_)} + lit("}"));
    g_->add_alternative(out, lit("{") + seq{r(ws_)} + kv + seq{r(more)});
    g_->add_alternative(more, seq{r(ws_)} + lit("}"));
    g_->add_alternative(more, seq{r(ws_)} + lit(",") + seq{r(ws_)} + kv + seq{r(more)});
    members_.emplace(v, out);
    return out;
  }

  /// An array: items (prefixItems' schemas first, one per position -- a tuple, as Pydantic writes
  /// one -- then `items` for the rest: `false` allows none), between minItems and maxItems.
  bool array(const json& s, const std::string& where, int depth, uint32_t* rule) {
    uint32_t item = any_value_;
    uint64_t lo = 0, hi = UINT64_MAX;
    if (!count_bounds(s, where, "minItems", "maxItems", max_bounded_items, &lo, &hi)) return false;
    std::vector<uint32_t> prefix;
    if (auto it = s.find("prefixItems"); it != s.end()) {
      if (!it->is_array() || it->size() > max_bounded_items)
        return fail(where + "/prefixItems", "prefixItems must be an array of at most " +
                                                std::to_string(max_bounded_items) + " schemas");
      for (size_t i = 0; i < it->size(); ++i)
        if (!value((*it)[i], where + "/prefixItems/" + std::to_string(i), depth + 1, &prefix.emplace_back()))
          return false;
    }
    if (auto it = s.find("items"); it != s.end() && !(it->is_boolean() && it->get<bool>())) {
      if (it->is_boolean()) hi = std::min<uint64_t>(hi, prefix.size());  // items: false, no more than the prefix
      else if (!value(*it, where + "/items", depth + 1, &item)) return false;
    }
    if (lo > hi) return fail(where, "no array holds to these counts (minItems " + std::to_string(lo) +
                                        ", at most " + std::to_string(hi) + " items)");
    const auto item_at = [&](uint64_t k) { return k < prefix.size() ? prefix[k] : item; };
    // after[k]: k items written; more may follow while k < hi, the list may close once k >= lo.
    // Unbounded lists share one rule for every k past the prefix and lo (it refers to itself).
    const uint64_t distinct = hi == UINT64_MAX ? std::max<uint64_t>({lo, prefix.size() + 1, 1}) : hi;
    std::vector<uint32_t> after(distinct + 1);
    for (auto& a : after) a = g_->add_rule();
    for (uint64_t k = 1; k <= distinct; ++k) {
      if (k >= lo) g_->add_alternative(after[k], seq{r(ws_)} + lit("]"));
      if (k < hi) {
        const uint32_t next = after[std::min(k + 1, distinct)];
        g_->add_alternative(after[k], seq{r(ws_)} + lit(",") + seq{r(ws_), r(item_at(k)), r(next)});
      }
    }
    const uint32_t out = g_->add_rule();
    if (lo == 0) g_->add_alternative(out, lit("[") + seq{r(ws_)} + lit("]"));
    if (hi >= 1) g_->add_alternative(out, lit("[") + seq{r(ws_), r(item_at(0)), r(after[1])});
    *rule = out;
    return true;
  }

  /// The rules every JSON grammar uses: whitespace, strings, numbers, literals, any value.
  void build_common(bool compact) {
    grammar& G = *g_;
    // blanks: nothing, a space, or a newline and up to 24 spaces or tabs; ws, between JSON's
    // tokens: the same, or nothing at all when compact.
    sym blank = grammar::byte(' ');
    blank.set['\t' >> 6] |= uint64_t{1} << ('\t' & 63);
    uint32_t indent = G.add_rule();
    G.add_alternative(indent, {});
    for (int k = 0; k < 24; ++k) {
      const uint32_t more = G.add_rule();
      G.add_alternative(more, {});
      G.add_alternative(more, {blank, r(indent)});
      indent = more;
    }
    blanks_ = G.add_rule();
    G.add_alternative(blanks_, {});
    G.add_alternative(blanks_, lit(" "));
    G.add_alternative(blanks_, lit("\n") + seq{r(indent)});
    ws_ = blanks_;
    if (compact) {
      ws_ = G.add_rule();
      G.add_alternative(ws_, {});
    }
    // string: '"' then characters up to the closing quote; escapes as JSON spells them.
    string_ = G.add_rule();
    const uint32_t chars = G.add_rule();
    const uint32_t hex = G.add_rule();
    sym hexset = grammar::range('0', '9');
    for (int b = 'a'; b <= 'f'; ++b) hexset.set[b >> 6] |= uint64_t{1} << (b & 63);
    for (int b = 'A'; b <= 'F'; ++b) hexset.set[b >> 6] |= uint64_t{1} << (b & 63);
    // \uXXXX of a character, never of half a surrogate pair (a lone one is not valid JSON text
    // to most parsers; characters past U+FFFF come as UTF-8 instead).
    sym hex_not_d = hexset;
    for (int b : {'d', 'D'}) hex_not_d.set[b >> 6] &= ~(uint64_t{1} << (b & 63));
    G.add_alternative(hex, {hex_not_d, hexset, hexset, hexset});
    G.add_alternative(hex, {grammar::range('d', 'd'), grammar::range('0', '7'), hexset, hexset});
    G.add_alternative(hex, {grammar::range('D', 'D'), grammar::range('0', '7'), hexset, hexset});
    // Plain ASCII, and characters past it as well-formed UTF-8 (never a stray byte).
    sym plain = grammar::range(0x20, 0x7F);
    for (int b : {'"', '\\'}) plain.set[b >> 6] &= ~(uint64_t{1} << (b & 63));
    const uint32_t utf8 = G.add_rule();
    G.add_utf8_multibyte(utf8);
    sym escaped = grammar::byte('"');
    for (char c : std::string_view("\\/bfnrt")) escaped.set[static_cast<uint8_t>(c) >> 6] |= uint64_t{1} << (c & 63);
    G.add_alternative(string_, lit("\"") + seq{r(chars)});
    G.add_alternative(chars, lit("\""));
    G.add_alternative(chars, {plain, r(chars)});
    G.add_alternative(chars, {r(utf8), r(chars)});
    G.add_alternative(chars, lit("\\") + seq{escaped, r(chars)});
    G.add_alternative(chars, lit("\\u") + seq{r(hex), r(chars)});
    // numbers: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
    const sym digit = grammar::range('0', '9');
    const uint32_t digits = digits_ = G.add_rule();  // [0-9]*
    G.add_alternative(digits, {});
    G.add_alternative(digits, {digit, r(digits)});
    const uint32_t natural = G.add_rule();
    G.add_alternative(natural, lit("0"));
    G.add_alternative(natural, {grammar::range('1', '9'), r(digits)});
    integer_ = G.add_rule();
    G.add_alternative(integer_, {r(natural)});
    G.add_alternative(integer_, lit("-") + seq{r(natural)});
    const uint32_t fraction = G.add_rule(), exponent = G.add_rule(), sign = G.add_rule();
    G.add_alternative(fraction, {});
    G.add_alternative(fraction, lit(".") + seq{digit, r(digits)});
    G.add_alternative(sign, {});
    G.add_alternative(sign, lit("+"));
    G.add_alternative(sign, lit("-"));
    G.add_alternative(exponent, {});
    G.add_alternative(exponent, lit("e") + seq{r(sign), digit, r(digits)});
    G.add_alternative(exponent, lit("E") + seq{r(sign), digit, r(digits)});
    number_ = G.add_rule();
    G.add_alternative(number_, {r(integer_), r(fraction), r(exponent)});
    boolean_ = G.add_rule();
    G.add_alternative(boolean_, lit("true"));
    G.add_alternative(boolean_, lit("false"));
    null_ = G.add_rule();
    G.add_alternative(null_, lit("null"));
    // any value: objects and lists of any values, recursively.
    any_value_ = G.add_rule();
    const uint32_t any_array = G.add_rule(), any_more = G.add_rule();
    G.add_alternative(any_array, lit("[") + seq{r(ws_)} + lit("]"));
    G.add_alternative(any_array, lit("[") + seq{r(ws_), r(any_value_), r(any_more)});
    G.add_alternative(any_more, seq{r(ws_)} + lit("]"));
    G.add_alternative(any_more, seq{r(ws_)} + lit(",") + seq{r(ws_), r(any_value_), r(any_more)});
    any_object_ = members(any_value_);
    for (uint32_t one : {any_object_, any_array, string_, number_, boolean_, null_})
      G.add_alternative(any_value_, {r(one)});
  }

  const json* root_;
  std::shared_ptr<grammar> g_ = std::make_shared<grammar>();
  std::map<std::string, uint32_t> refs_;
  std::map<uint32_t, uint32_t> members_;
  uint32_t digits_ = 0;  ///< [0-9]*

public:
  uint32_t blanks_ = 0, ws_ = 0, string_ = 0, integer_ = 0, number_ = 0, boolean_ = 0, null_ = 0, any_value_ = 0, any_object_ = 0;
};

/// A rule matching any bytes up to and including `marker`, then `then`: a string-matching
/// automaton over the marker (state k: its first k bytes just seen), written as rules.
uint32_t until(grammar& g, std::string_view marker, uint32_t then) {
  const size_t m = marker.size();
  // KMP: fail[k] = the longest proper prefix of marker[0, k) that is also its suffix.
  std::vector<size_t> fail(m + 1, 0);
  for (size_t k = 2; k <= m; ++k) {
    size_t f = fail[k - 1];
    while (f > 0 && marker[f] != marker[k - 1]) f = fail[f];
    fail[k] = marker[f] == marker[k - 1] ? f + 1 : 0;
  }
  std::vector<uint32_t> state(m);
  for (auto& s : state) s = g.add_rule();
  for (size_t k = 0; k < m; ++k) {
    std::map<size_t, grammar::symbol> by_target;
    for (unsigned b = 0; b < 256; ++b) {
      size_t f = k;
      while (f > 0 && static_cast<uint8_t>(marker[f]) != b) f = fail[f];
      const size_t next = static_cast<uint8_t>(marker[f]) == b ? f + 1 : 0;
      auto& s = by_target[next];
      s.set[b >> 6] |= uint64_t{1} << (b & 63);
    }
    for (const auto& [next, s] : by_target) g.add_alternative(state[k], {s, grammar::ref(next == m ? then : state[next])});
  }
  return state[0];
}

/// Drops a schema's annotations in place (title, description, examples, default, $comment:
/// they restrict no value), walking schema positions only: a property named "description" stays.
void drop_annotations(json& s, int depth) {
  if (depth > max_schema_depth || !s.is_object()) return;
  for (const char* k : {"title", "description", "examples", "default", "$comment"}) s.erase(k);
  for (auto& [key, v] : s.items()) {
    if (key == "properties" || key == "$defs" || key == "definitions") {
      if (v.is_object())
        for (auto& [name, sub] : v.items()) drop_annotations(sub, depth + 1);
    } else if (key == "anyOf" || key == "oneOf" || key == "allOf" || key == "prefixItems") {
      if (v.is_array())
        for (auto& sub : v) drop_annotations(sub, depth + 1);
    } else if (key == "items" || key == "additionalProperties") {
      drop_annotations(v, depth + 1);
    }
  }
}

std::shared_ptr<const grammar> compile_checked(output_format kind, const std::string& text, const output_options& options,
                                               std::string* why);

}  // namespace

std::shared_ptr<const grammar> compile_output_grammar(output_format kind, const std::string& text,
                                                      const output_options& options, std::string* why) {
  // Every field is checked for its type before it is read; this is the net under that: the
  // caller is the router, whose end would end every request's service.
  try {
    return compile_checked(kind, text, options, why);
  } catch (const std::exception& e) {
    *why = std::string{"the constraint could not be read ("} + e.what() + ")";
    return nullptr;
  }
}

namespace {


std::shared_ptr<const grammar> compile_checked(output_format kind, const std::string& text, const output_options& options,
                                               std::string* why) {
  if (kind == output_format::free || static_cast<uint8_t>(kind) > max_output_format) {
    *why = "no constrained output was asked for";
    return nullptr;
  }
  json root;
  if (kind == output_format::schema) {
    if (text.size() > max_json_schema_text_bytes) {
      *why = "json_schema is " + std::to_string(text.size()) + " bytes; at most " + std::to_string(max_json_schema_text_bytes);
      return nullptr;
    }
    // Parsed and dumped below: nlohmann dumps recursively, and a string of 75,000 brackets (a
    // 150 KB guided_json, which the body's own depth check does not see inside its string)
    // overflowed the stack. A schema of max_schema_depth levels nests its JSON about twice that.
    if (json_nested_deeper_than(text, 4 * max_schema_depth)) {
      *why = "json_schema nests arrays and objects deeper than " + std::to_string(4 * max_schema_depth) + " levels";
      return nullptr;
    }
    root = json::parse(text, nullptr, false);
    if (root.is_discarded()) {
      *why = "json_schema is not valid JSON";
      return nullptr;
    }
    // The bound is on what compiles: forty well-described tools of a forced call (one anyOf of
    // their parameters) passed 64 KiB in descriptions alone.
    drop_annotations(root, 0);
    if (const auto size = root.dump().size(); size > max_json_schema_bytes) {
      *why = "json_schema is " + std::to_string(size) + " bytes without its titles, descriptions and examples; at most " +
             std::to_string(max_json_schema_bytes);
      return nullptr;
    }
  }
  compiler c(&root, options.compact);
  uint32_t value = c.any_object_;
  if (kind == output_format::schema && !c.value(root, "", 0, &value)) {
    *why = c.why_;
    return nullptr;
  }
  if (kind == output_format::regex && !text_matching(c.g(), text, &value, why)) return nullptr;
  if (kind == output_format::gbnf && !gbnf_rules(c.g(), text, &value, why)) return nullptr;
  const bool json = kind == output_format::object || kind == output_format::schema;
  uint32_t start = value;
  if (options.after_thinking) {
    uint32_t answer = value;
    if (json) {  // blank lines after </think> ("\n\n"), as JSON may start; text answers start at once
      answer = c.g().add_rule();
      c.g().add_alternative(answer, {grammar::ref(c.blanks_), grammar::ref(c.blanks_), grammar::ref(value)});
    }
    start = until(c.g(), "</think>", answer);
  }
  auto g = c.finish(start);
  // What the matcher could not follow exactly is refused here, not found out mid-answer.
  const std::string name = json ? "json_schema" : kind == output_format::regex ? "regex" : "grammar";
  if (g->elements().size() > max_grammar_elements) {
    *why = name + ": too large (" + std::to_string(g->elements().size()) + " grammar elements; at most " +
           std::to_string(max_grammar_elements) + ")";
    return nullptr;
  }
  const auto shape = g->left_shape();
  if (shape.matches_nothing) {
    *why = name + ": matches no text at all";
    return nullptr;
  }
  if (shape.left_recursive) {
    *why = name + ": left-recursive (a rule comes back to itself before reading anything)";
    return nullptr;
  }
  if (shape.deepest > grammar::max_expand_depth) {
    *why = name + ": rules nest up to " + std::to_string(shape.deepest) + " deep before reading a character; at most " +
           std::to_string(grammar::max_expand_depth);
    return nullptr;
  }
  // Refused here, before a rank spends seconds on each token's mask: every parse alive is walked
  // for it. Not GBNF: a recursive grammar written as people write them (items ::= item | item ","
  // items) doubles its parses with each level of nesting the greedy probe reads, which few
  // answers reach. A rank stops an answer that goes past the bound where this probe did not look.
  if (kind != output_format::gbnf)
    if (auto problem = cost_problem(g->probe_ambiguity(64, grammar::max_parses), name); !problem.empty()) {
      *why = std::move(problem);
      return nullptr;
    }
  return g;
}

}  // namespace

std::shared_ptr<const grammar> cached_output_grammar(output_format kind, const std::string& text,
                                                     const output_options& options, std::string* why) {
  struct entry {
    output_format kind;
    output_options options;
    std::string text;
    std::shared_ptr<const grammar> compiled;
  };
  // The most grammars kept, and their elements in all (about 8 bytes each): large grammars from
  // distinct requests cannot pin memory without bound.
  constexpr size_t kept = 64, kept_elements = 8 * max_grammar_elements;
  static std::mutex mutex;
  static std::list<entry> recent;  // most recent first
  static size_t elements = 0;
  auto same = [&](const entry& e) { return e.kind == kind && e.options == options && e.text == text; };
  {
    std::lock_guard lock{mutex};
    if (auto it = std::find_if(recent.begin(), recent.end(), same); it != recent.end()) {
      recent.splice(recent.begin(), recent, it);
      return it->compiled;
    }
  }
  // Compiled outside the lock: a large schema takes milliseconds, and two threads compiling the
  // same one at once only waste work.
  auto compiled = compile_output_grammar(kind, text, options, why);
  if (!compiled) return nullptr;
  std::lock_guard lock{mutex};
  if (std::find_if(recent.begin(), recent.end(), same) == recent.end()) {
    recent.push_front(entry{kind, options, text, compiled});
    elements += compiled->elements().size();
    while (recent.size() > kept || (elements > kept_elements && recent.size() > 1)) {
      elements -= recent.back().compiled->elements().size();
      recent.pop_back();
    }
  }
  return compiled;
}

}  // namespace baton::gpu

// The answer's constraint in a request body (openai_fields.hpp): a forced tool call (OpenAI's
// tools and tool_choice are read here), OpenAI's response_format,
// vLLM's guided_* and structured_outputs, SGLang's json_schema / regex / ebnf, each refused by
// name when malformed or mixed. The grammar itself is compiled, and refused by keyword, by the
// router.

#include <algorithm>
#include <cctype>
#include <string_view>

#include "deploy/openai_fields.hpp"
#include "deploy/openai_tool_calls_xml.hpp"
#include "gpu/json_schema_grammar.hpp"
#include "gpu/regex_grammar.hpp"

namespace baton::deploy::openai {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {

/// response_format: {type: "text"} (the default), {type: "json_object"} (any JSON object), or
/// {type: "json_schema", json_schema: {name, schema, strict}} (JSON matching the schema, in its
/// key order). The answer is constrained to it (gpu/json_schema_grammar.hpp); a schema the
/// grammar cannot honour is refused by the router, naming the keyword.
bool parse_response_format(const json& j, const ordered_json& body, call* out, api_error* err) {
  auto it = j.find("response_format");
  if (it == j.end() || it->is_null()) return true;
  const auto shape = [&] {
    *err = bad("response_format", "response_format must be {type: \"text\"}, {type: \"json_object\"} or {type: "
                                  "\"json_schema\", json_schema: {name, schema}}, got " + describe(*it));
    return false;
  };
  if (!it->is_object() || !it->contains("type")) return shape();
  // An unknown type named as such: the shape's "got an object" did not say which part was wrong.
  if (!type_is(*it, "text") && !type_is(*it, "json_object") && !type_is(*it, "json_schema")) {
    *err = bad("response_format", "response_format.type must be \"text\", \"json_object\" or \"json_schema\", got " +
                                      describe((*it)["type"]));
    return false;
  }
  if (type_is(*it, "text")) return true;
  if (out->req.output_format != 0) {
    *err = bad("response_format", "response_format cannot be combined with a forced tool_choice");
    return false;
  }
  if (type_is(*it, "json_object")) {
    out->req.output_format = static_cast<uint8_t>(gpu::output_format::object);
    return true;
  }
  if (!type_is(*it, "json_schema") || !it->contains("json_schema") || !(*it)["json_schema"].is_object()) return shape();
  const auto& spec = body["response_format"]["json_schema"];
  if (!spec.contains("schema")) {
    *err = bad("response_format", "response_format.json_schema needs its schema");
    return false;
  }
  out->req.output_format = static_cast<uint8_t>(gpu::output_format::schema);
  out->req.output_spec = spec["schema"].dump();
  out->constraint_param = "response_format";
  out->constraint_label = "response_format.json_schema.schema";
  return true;
}

/// One of `choices`, exactly, as a regular expression (gpu/regex_grammar.hpp's syntax).
std::string regex_of_choices(const json& choices) {
  std::string out = "(?:";
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) out += '|';
    for (char c : choices[i].get<std::string>()) {
      if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
      out += c;
    }
  }
  return out + ")";
}

/// vLLM's structured outputs, for clients written against it: guided_json (a schema, as an
/// object or its text), guided_regex (the whole answer matches it), guided_choice (the answer is
/// one of these strings), guided_grammar (GBNF), or the same as structured_outputs {json, regex,
/// choice, grammar, json_object}, where disable_any_whitespace asks for compact JSON (from
/// response_format or a forced tool too). What Baton cannot honour (whitespace patterns,
/// structural tags) is refused by name; backend choices are ignored (there is one).
bool parse_guided(const json& j, const ordered_json& body, call* out, api_error* err) {
  auto& r = out->req;
  // A field given null is not given (clients that write every field of vLLM's params do so).
  const auto given_in = [](const json& o, const std::string& key) { return o.contains(key) && !o[key].is_null(); };
  const bool structured = given_in(j, "structured_outputs");
  if (given_in(j, "guided_whitespace_pattern")) {
    *err = bad("guided_whitespace_pattern", "guided_whitespace_pattern is not supported (structured_outputs' "
                                            "disable_any_whitespace is)");
    return false;
  }
  if (structured && (given_in(j, "guided_json") || given_in(j, "guided_regex") || given_in(j, "guided_choice") ||
                     given_in(j, "guided_grammar"))) {
    *err = bad("structured_outputs", "give structured_outputs or the guided_* fields, not both");
    return false;
  }
  const json& spec = structured ? j["structured_outputs"] : j;
  const ordered_json& ordered = structured ? body["structured_outputs"] : body;
  const std::string prefix = structured ? "structured_outputs." : "guided_";
  const std::string param = structured ? "structured_outputs" : "";
  auto name = [&](const char* key) { return prefix + key; };
  if (structured) {
    if (!spec.is_object()) {
      *err = bad(param, "structured_outputs must be an object, got " + describe(spec));
      return false;
    }
    for (const auto& [key, v] : spec.items()) {
      if (v.is_null()) continue;
      if (key == "json" || key == "regex" || key == "choice" || key == "grammar" || key == "json_object" ||
          key == "disable_fallback" ||
          key == "disable_additional_properties")
        continue;  // the fallback and extra properties: Baton has none of either to disable
      if (key == "disable_any_whitespace") {
        if (!v.is_boolean()) {
          *err = bad(param, "structured_outputs.disable_any_whitespace must be true or false, got " + describe(v));
          return false;
        }
        r.json_compact = v.get<bool>();  // also for response_format's and forced tools' JSON
        continue;
      }
      *err = bad(param, "structured_outputs." + key +
                            " is not supported (json, regex, choice, grammar, json_object and "
                            "disable_any_whitespace are)");
      return false;
    }
  }
  const json* given = nullptr;
  std::string key;
  for (const char* k : {"json", "regex", "choice", "grammar", "json_object"}) {
    auto it = spec.find(structured ? std::string(k) : name(k));
    if (it == spec.end() || it->is_null() || (!structured && std::string(k) == "json_object")) continue;
    if (given) {
      *err = bad(structured ? param : name(k), "give one of " + name("json") + ", " + name("regex") + ", " +
                                                   name("choice") + " and " + name("grammar") + ", not " +
                                                   name(key.c_str()) + " and " + name(k));
      return false;
    }
    given = &*it;
    key = k;
  }
  if (!given) return true;
  const std::string field = name(key.c_str());
  const std::string at = structured ? param : field;
  if (r.output_format != 0) {
    *err = bad(at, field + " cannot be combined with response_format or a forced tool_choice");
    return false;
  }
  if (key == "json") {
    if (given->is_object() || given->is_boolean()) r.output_spec = ordered.at(structured ? "json" : field).dump();
    else if (given->is_string() && !given->get<std::string>().empty()) r.output_spec = given->get<std::string>();
    else {
      *err = bad(at, field + " must be a JSON schema (an object, or its text), got " + describe(*given));
      return false;
    }
    r.output_format = static_cast<uint8_t>(gpu::output_format::schema);
  } else if (key == "json_object") {
    if (*given != true) {
      *err = bad(at, field + " must be true, got " + describe(*given));
      return false;
    }
    r.output_format = static_cast<uint8_t>(gpu::output_format::object);
  } else if (key == "regex" || key == "grammar") {
    if (!given->is_string() || given->get<std::string>().empty()) {
      *err = bad(at, field + " must be a non-empty " + (key == "regex" ? "regular expression" : "GBNF grammar") +
                         ", got " + describe(*given));
      return false;
    }
    r.output_format = static_cast<uint8_t>(key == "regex" ? gpu::output_format::regex : gpu::output_format::gbnf);
    r.output_spec = given->get<std::string>();
  } else {
    if (!given->is_array() || given->empty() || given->size() > 1024 ||
        !std::all_of(given->begin(), given->end(), [](const json& c) { return c.is_string(); })) {
      *err = bad(at, field + " must be an array of 1 to 1024 strings, got " + describe(*given));
      return false;
    }
    r.output_format = static_cast<uint8_t>(gpu::output_format::regex);
    r.output_spec = regex_of_choices(*given);
    if (r.output_spec.size() > gpu::max_regex_bytes) {
      *err = bad(at, field + "'s strings come to " + std::to_string(r.output_spec.size()) + " bytes as an expression; at most " +
                         std::to_string(gpu::max_regex_bytes));
      return false;
    }
  }
  out->constraint_param = at;
  out->constraint_label = field;
  return true;
}

/// SGLang's structured outputs (its OpenAI API's extra fields): json_schema (a schema's text, or
/// the schema itself), regex, ebnf (xgrammar's grammar text, GBNF). One of them, and not with the
/// OpenAI or vLLM forms.
bool parse_sglang_constraint(const json& j, const ordered_json& body, call* out, api_error* err) {
  auto& r = out->req;
  const char* field = nullptr;
  for (const char* k : {"json_schema", "regex", "ebnf"}) {
    if (!j.contains(k) || j[k].is_null()) continue;
    if (field) {
      *err = bad(k, std::string("give one of json_schema, regex and ebnf, not ") + field + " and " + k);
      return false;
    }
    field = k;
  }
  if (!field) return true;
  const json& given = j[field];
  if (r.output_format != 0) {
    *err = bad(field, std::string(field) + " cannot be combined with response_format, a forced tool_choice, "
                                            "guided_* or structured_outputs");
    return false;
  }
  const std::string name = field;
  if (name == "json_schema" && (given.is_object() || given.is_boolean())) {
    r.output_spec = body.at("json_schema").dump();  // the client's key order: properties come in it
  } else if (given.is_string() && !given.get<std::string>().empty()) {
    r.output_spec = given.get<std::string>();
  } else {
    *err = bad(field, name + " must be a non-empty " +
                          (name == "json_schema" ? "JSON schema (its text, or an object)"
                           : name == "regex"     ? "regular expression"
                                                 : "grammar (GBNF)") +
                          ", got " + describe(given));
    return false;
  }
  r.output_format = static_cast<uint8_t>(name == "json_schema" ? gpu::output_format::schema
                                         : name == "regex"     ? gpu::output_format::regex
                                                               : gpu::output_format::gbnf);
  out->constraint_param = out->constraint_label = name;
  return true;
}

/// The compiler's sentence about the answer's grammar, with the field the client wrote in place
/// of the compiler's own name for it ("json_schema at /x: ..." for a response_format schema is
/// "response_format.json_schema.schema at /x: ..."). A "required" tool_choice's schema is a list
/// of {name, parameters} made here: a place inside tool K's parameters is named as in them.
std::string name_constraint_error(const call& c, const std::string& why) {
  static constexpr std::string_view list_part = "json_schema at /items/anyOf/";
  if (c.forced_calls && why.starts_with(list_part)) {
    size_t at = list_part.size(), k = 0;
    const size_t digits = at;
    while (at < why.size() && std::isdigit(static_cast<unsigned char>(why[at]))) k = k * 10 + (why[at++] - '0');
    static constexpr std::string_view params = "/properties/parameters";
    if (at > digits && std::string_view{why}.substr(at).starts_with(params)) {
      at += params.size();
      const size_t colon = why.find(": ", at);
      const std::string inside = colon == std::string::npos ? why.substr(at) : why.substr(at, colon - at);
      return "tools[" + std::to_string(k) + "].function.parameters at " + (inside.empty() ? "/" : inside) +
             (colon == std::string::npos ? "" : why.substr(colon));
    }
  }
  for (std::string_view own : {"json_schema", "regex", "grammar"})
    if (why.starts_with(own) && why.size() > own.size() && (why[own.size()] == ' ' || why[own.size()] == ':'))
      return c.constraint_label + why.substr(own.size());
  return c.constraint_label + ": " + why;
}

}  // namespace

/// OpenAI's tools: function definitions, kept in the client's key order for the template.
/// tool_choice: "auto" (the default), "none" (the template still shows the tools, as OpenAI's and
/// vLLM's by default, so the prompt and its cached prefix stay those of the turns before; the
/// answer is not read for calls), or a forced call:
/// "required" (one call or more, of any of the tools; one with parallel_tool_calls false) or
/// {type: "function", function: {name}} (that one). A forced answer is constrained to JSON (the
/// named function's parameters, or a list of {name, parameters}), which the gateway reads back
/// as the calls (call::forced_tool, call::forced_calls), as vLLM does.
bool parse_tools(const json& j, const ordered_json& body, call* out, api_error* err) {
  generate_request* req = &out->req;
  auto it = j.find("tools");
  const bool none = it == j.end() || it->is_null() || (it->is_array() && it->empty());
  if (!none && !it->is_array()) {
    *err = bad("tools", "tools must be an array of {type: \"function\", function: {name, ...}}");
    return false;
  }
  for (size_t k = 0; !none && k < it->size(); ++k) {
    const auto& t = (*it)[k];
    if (!t.is_object() || !type_is(t, "function") || !t.contains("function") || !t["function"].is_object() ||
        !t["function"].contains("name") || !t["function"]["name"].is_string()) {
      *err = bad("tools", "tools[" + std::to_string(k) + "] must be {type: \"function\", function: {name, ...}}");
      return false;
    }
    // Names as OpenAI takes them (letters, digits, _ and -, at most 64), each once: a call names
    // its function, and a template or a parser reading a name with a space or a twin misreads it.
    const auto& f = t["function"];
    const auto& name = f["name"].get_ref<const std::string&>();
    if (name.empty() || name.size() > 64 || !std::all_of(name.begin(), name.end(), [](char ch) {
          return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-';
        })) {
      *err = bad("tools", "tools[" + std::to_string(k) + "].function.name must be 1 to 64 letters, digits, _ or -, got " +
                              describe(f["name"]));
      return false;
    }
    for (size_t before = 0; before < k; ++before)
      if ((*it)[before]["function"]["name"] == f["name"]) {
        *err = bad("tools", "tools[" + std::to_string(k) + "] repeats the function name '" + name + "' of tools[" +
                                std::to_string(before) + "]");
        return false;
      }
    // A call's arguments are a JSON object: its parameters must allow one. (A schema of anything
    // else, followed for a forced call, answered "false" as plain text, with no tool_calls.)
    if (!f.contains("parameters") || f["parameters"].is_null()) continue;
    const auto& p = f["parameters"];
    const auto allows_object = [](const json& type) {
      if (type.is_string()) return type == "object";
      return type.is_array() && std::find(type.begin(), type.end(), json("object")) != type.end();
    };
    if (!(p.is_boolean() ? p.get<bool>() : p.is_object() && (!p.contains("type") || allows_object(p["type"])))) {
      *err = bad("tools", "tools[" + std::to_string(k) + "].function.parameters must be the JSON schema of an object " +
                              "(a call's arguments are one), got " + describe(p.is_object() && p.contains("type") ? p["type"] : p));
      return false;
    }
  }
  // A function's parameters as a schema (none: it takes no arguments). Placed inside a larger
  // schema (`at`, a JSON pointer), its own references ("#/$defs/...") are moved along with it.
  const auto parameters = [&](size_t k, const std::string& at) {
    const auto& f = body["tools"][k]["function"];
    if (!f.contains("parameters") || f["parameters"].is_null())
      return ordered_json{{"type", "object"}, {"properties", ordered_json::object()}, {"additionalProperties", false}};
    ordered_json p = f["parameters"];
    // Held to an object (checked above that the schema allows one): true and {} allow anything,
    // a type list may allow null too; a forced call's arguments must still be an object.
    if (p.is_boolean() || p.empty()) p = ordered_json{{"type", "object"}};
    else p["type"] = "object";
    std::vector<ordered_json*> todo = {&p};
    while (!todo.empty()) {
      ordered_json* v = todo.back();
      todo.pop_back();
      if (v->is_object())
        for (auto& [key, child] : v->items()) {
          if (key == "$ref" && child.is_string() && child.get<std::string>().rfind('#', 0) == 0)
            child = "#" + at + child.get<std::string>().substr(1);
          else
            todo.push_back(&child);
        }
      else if (v->is_array())
        for (auto& child : *v) todo.push_back(&child);
    }
    return p;
  };
  if (auto c = j.find("tool_choice"); c != j.end() && !c->is_null()) {
    if (*c == "none") {
      if (!none) req->tools_json = body["tools"].dump();
      out->tool_choice_none = true;
      return true;
    }
    if (none && *c != "auto") {
      *err = bad("tool_choice", "tool_choice forces a call, but the request gives no tools");
      return false;
    }
    if (*c == "required") {
      ordered_json calls = ordered_json::array();
      for (size_t k = 0; k < it->size(); ++k)
        calls.push_back({{"type", "object"},
                         {"properties", {{"name", {{"const", (*it)[k]["function"]["name"]}}},
                                         {"parameters", parameters(k, "/items/anyOf/" + std::to_string(k) +
                                                                          "/properties/parameters")}}},
                         {"required", {"name", "parameters"}},
                         {"additionalProperties", false}});
      ordered_json schema = {{"type", "array"}, {"items", {{"anyOf", calls}}}, {"minItems", 1}};
      if (auto p = j.find("parallel_tool_calls"); p != j.end() && p->is_boolean() && !p->get<bool>()) schema["maxItems"] = 1;
      req->output_spec = schema.dump();
      out->forced_calls = true;
      out->constraint_label = "tools";
    } else if (c->is_object() && type_is(*c, "function") && c->contains("function") && (*c)["function"].is_object() &&
               (*c)["function"].contains("name") && (*c)["function"]["name"].is_string()) {
      const auto name = (*c)["function"]["name"].get<std::string>();
      size_t k = 0;
      while (k < it->size() && (*it)[k]["function"]["name"] != name) ++k;
      if (k == it->size()) {
        *err = bad("tool_choice", "tool_choice names the function '" + name.substr(0, 64) + "', which tools lacks");
        return false;
      }
      req->output_spec = parameters(k, "").dump();
      out->forced_tool = name;
      out->constraint_label = "tools[" + std::to_string(k) + "].function.parameters";
    } else if (*c != "auto") {
      *err = bad("tool_choice", "tool_choice must be \"auto\", \"none\", \"required\" or {type: \"function\", "
                                "function: {name}}, got " + describe(*c));
      return false;
    }
    if (!req->output_spec.empty()) {
      req->output_format = static_cast<uint8_t>(gpu::output_format::schema);
      out->constraint_param = "tools";
    }
  }
  if (!none) {
    req->tools_json = body["tools"].dump();
    // Once per request: every choice's answer reader types a Qwen3-Coder call's values by them.
    out->tool_parameters = std::make_shared<const tool_parameter_kinds>(tool_parameter_kinds_of(*it));
  }
  return true;
}

bool parse_constraint(const json& j, const ordered_json& body, call* out, api_error* err) {
  if (!parse_response_format(j, body, out, err) || !parse_guided(j, body, out, err) ||
      !parse_sglang_constraint(j, body, out, err))
    return false;
  // disable_any_whitespace shapes JSON only; vLLM ignores it for text answers, and so does Baton
  // (the router refuses json_compact elsewhere, to tell a direct client it has no effect).
  auto& r = out->req;
  if (r.output_format != static_cast<uint8_t>(gpu::output_format::object) &&
      r.output_format != static_cast<uint8_t>(gpu::output_format::schema))
    r.json_compact = false;
  // Compiled here already: a schema, expression or grammar that does not compile is refused
  // naming the field the client wrote it in, not as the router's unnamed admission error. (The
  // process-wide cache makes the router's own check a lookup when both compile it alike; for a
  // prompt that opens a thinking block the router compiles the after-thinking form, a second
  // entry. Parsing runs on the call's actor, a scheduler thread, not the gateway's broker.)
  const auto kind = static_cast<gpu::output_format>(r.output_format);
  if (kind != gpu::output_format::schema && kind != gpu::output_format::regex && kind != gpu::output_format::gbnf)
    return true;
  std::string why;
  if (gpu::cached_output_grammar(kind, r.output_spec, {.compact = r.json_compact}, &why)) return true;
  *err = bad(out->constraint_param, name_constraint_error(*out, why));
  return false;
}

}  // namespace baton::deploy::openai

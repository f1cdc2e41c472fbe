// Qwen3-Coder's XML tool calls read whole (openai_tool_calls_xml.hpp gives the rules; the
// stream's side is in openai_tool_calls.cpp, by the same rules and functions). A value is raw
// text: its type comes from the request's tool schema, as vLLM's qwen3_coder parser
// (Qwen3CoderToolParser) reads it, so that clients moving from vLLM get the same arguments.
//
// What a client would see differ from vLLM:
// - arguments are written compact, {"a":1,"b":"x"}, where vLLM's json.dumps writes {"a": 1,
//   "b": "x"} (the same JSON); an integral number past 64 bits stays a float here (1e+300),
//   vLLM writes its digits;
// - text between and after the calls is content here (each piece on a line of its own, the
//   <tool_call> markers dropped); vLLM's content is the text before the first call only, the
//   rest is dropped;
// - a boolean is read trimmed (" true" is true; vLLM: false), and a value that is neither true nor
//   false stays text (vLLM: false);
// - integers as Python's int() reads them, but no underscores ("1_000") and 64 bits at most: else
//   text (vLLM: the number);
// - a type other than string, integer, number and boolean (object, array, ["integer", "null"],
//   ...) reads the value as JSON; vLLM tries json.loads for object and array types only, then
//   Python's ast.literal_eval ('a', True, (1, 2) read there; JSON's true does not, for the
//   others);
// - a tag's name is trimmed (<function= f > is f) and must be on one line without '<': else the
//   tag is text, passed over (vLLM takes anything up to the first '>');
// - a tag without its '>' (broken, or cut by max_tokens) is text here: a parameter's is passed
//   over, a function's is text among the calls (content), and the other calls stand; vLLM then
//   reads no call at all, the whole answer being content;
// - a call ends at its first </function> only: a </tool_call> inside a value is text (vLLM ends
//   the block there, cutting the value and dropping the rest of the call); a call whose
//   </function> is missing runs to the next </function> or the answer's end, taking in any
//   later block's parameters (vLLM ends it at its block's </tool_call>);
// - a bare <function=NAME> (no <tool_call> before it) is a call wherever it is; vLLM reads bare
//   calls only in an answer with no <tool_call> at all, and drops a <function= outside the
//   blocks otherwise (one before the first <tool_call> is part of its content);
// - a value without </parameter> that runs to its call's end (a cut call's last one, say) loses
//   one trailing line break, as any value; vLLM's regex ($) loses one more there;
// - streamed, a call's arguments go out in one piece at its </function> (at the stream's end for
//   a call cut by max_tokens), where vLLM sends each parameter as it ends; joined, they are the
//   same. Streamed and whole answers read the same here, bare calls and two calls in a block
//   included, which vLLM's stream does not.

#include "deploy/openai_tool_calls_xml.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "deploy/openai_tool_call_forms.hpp"

namespace baton::deploy::openai {

using nlohmann::ordered_json;

namespace {


char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

bool same_letters(std::string_view a, std::string_view b) {  // ASCII, case aside (Python's .lower() ==)
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (lower(a[i]) != lower(b[i])) return false;
  return true;
}

/// Python's int() and float() take a leading '+', from_chars does not: it is dropped ("+-1" is no
/// number). False where nothing is left.
bool drop_plus(std::string_view* t) {
  if (t->starts_with('+')) {
    t->remove_prefix(1);
    if (t->starts_with('-')) return false;
  }
  return !t->empty();
}

/// from_chars of all of `t`, in range.
template <typename T>
std::optional<T> whole_number(std::string_view t) {
  T v{};
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc{} || end != t.data() + t.size()) return std::nullopt;
  return v;
}

/// Python's int() of the text, where it fits 64 bits (a larger one stays text: JSON readers
/// round it anyway). Underscores between digits, which Python takes, are not.
std::optional<ordered_json> integer_value(std::string_view t) {
  if (!drop_plus(&t)) return std::nullopt;
  if (const auto v = whole_number<int64_t>(t)) return ordered_json(*v);
  if (const auto v = whole_number<uint64_t>(t)) return ordered_json(*v);
  return std::nullopt;
}

/// Python's float() of the text, an integral one written as an integer (vLLM's). Not a finite
/// number (inf, nan, 1e999): text, as vLLM's own check fails on those.
std::optional<ordered_json> number_value(std::string_view t) {
  if (!drop_plus(&t)) return std::nullopt;
  const auto parsed = whole_number<double>(t);
  if (!parsed || !std::isfinite(*parsed)) return std::nullopt;
  const double v = *parsed;
  constexpr double two_63 = 9223372036854775808.0;
  if (v == std::trunc(v) && v >= -two_63 && v < two_63) return ordered_json(static_cast<int64_t>(v));
  return ordered_json(v);
}

/// One parameter's value, its text typed by `kind`. Whatever does not read as its type stays
/// text (nothing the model wrote is lost).
ordered_json typed_value(std::string_view text, parameter_kind kind) {
  if (same_letters(text, "null")) return nullptr;  // vLLM's: null whatever the type, a string's too
  const auto t = trimmed_view(text);
  switch (kind) {
    case parameter_kind::text: break;
    case parameter_kind::integer:
      if (auto v = integer_value(t)) return *v;
      break;
    case parameter_kind::number:
      if (auto v = number_value(t)) return *v;
      break;
    case parameter_kind::boolean:
      // vLLM makes anything but "true" false; a value that is neither stays text here.
      if (same_letters(t, "true")) return true;
      if (same_letters(t, "false")) return false;
      break;
    case parameter_kind::json:
      // vLLM tries Python's ast.literal_eval next ('a', True, (1, 2)); JSON only here. Nested
      // past a request body's depth: text, never parsed that deep.
      if (!nested_too_deep(t)) {
        auto j = ordered_json::parse(t, nullptr, false);
        if (!j.is_discarded()) return j;
      }
      break;
  }
  return std::string{text};
}

/// A parameter's schema's "type", read as vLLM's _convert_param_value reads it.
parameter_kind kind_of(const nlohmann::json& schema) {
  if (!schema.is_object()) return parameter_kind::text;
  const auto it = schema.find("type");
  if (it == schema.end()) return parameter_kind::text;
  // ["integer", "null"] and the like: vLLM reads the value as a Python literal, JSON here.
  if (!it->is_string()) return parameter_kind::json;
  std::string type{trimmed_view(it->get_ref<const std::string&>())};
  for (char& c : type) c = lower(c);
  const auto is = [&](std::initializer_list<std::string_view> names) {
    return std::find(names.begin(), names.end(), type) != names.end();
  };
  const auto starts = [&](std::initializer_list<std::string_view> prefixes) {
    return std::any_of(prefixes.begin(), prefixes.end(), [&](std::string_view p) { return type.starts_with(p); });
  };
  if (is({"string", "str", "text", "varchar", "char", "enum"})) return parameter_kind::text;
  if (starts({"int", "uint", "long", "short", "unsigned"})) return parameter_kind::integer;
  if (starts({"num", "float"})) return parameter_kind::number;
  if (is({"boolean", "bool", "binary"})) return parameter_kind::boolean;
  return parameter_kind::json;
}

/// A value the answer's end cut off (max_tokens): the start of the tag that was coming
/// ("Rome\n</p") is not the value's.
std::string_view without_cut_tag(std::string_view value) {
  const size_t lt = value.rfind('<');
  if (lt == npos) return value;
  const auto tail = value.substr(lt);
  for (std::string_view tag : {xml_parameter_end, xml_function_end, xml_parameter_begin, xml_call_end})
    if (tail.size() < tag.size() && tag.starts_with(tail)) return value.substr(0, lt);
  return value;
}

/// Text among the calls, as content: its <tool_call> and </tool_call> markers are the form's and
/// go; each piece between them, trimmed, on a line of its own (append_line).
void append_text(std::string_view text, std::string* rest) {
  // Each marker looked for again only once passed (the two never overlap).
  size_t from = 0, open = text.find(xml_call_begin), close = text.find(xml_call_end);
  for (;;) {
    const size_t at = std::min(open, close);
    append_line(rest, std::string{trimmed_view(text.substr(from, at == npos ? npos : at - from))});
    if (at == npos) return;
    if (at == open) {
      from = open + xml_call_begin.size();
      open = text.find(xml_call_begin, from);
    } else {
      from = close + xml_call_end.size();
      close = text.find(xml_call_end, from);
    }
  }
}

}  // namespace

xml_tag_name read_xml_tag_name(std::string_view s, size_t at, size_t scanned) {
  // A name is one line: a tag never closed must not make a stream wait (and look) to the end.
  const size_t close = s.find_first_of(">\n<", std::max(at, scanned));
  if (close == npos) return {{}, npos, true};
  if (s[close] != '>') return {};
  return {std::string{trimmed_view(s.substr(at, close - at))}, close, false};
}

std::string xml_call_arguments(std::string_view name, std::string_view body, const tool_parameter_kinds* parameters) {
  const std::map<std::string, parameter_kind, std::less<>>* kinds = nullptr;
  if (parameters)
    if (const auto f = parameters->find(name); f != parameters->end()) kinds = &f->second;
  ordered_json args = ordered_json::object();
  // The next <parameter= and </parameter> from where the reading stands, each looked for again
  // only once passed: the body is read once, however its tags fall.
  size_t open = body.find(xml_parameter_begin), close = body.find(xml_parameter_end);
  while (open != npos) {
    const auto tag = read_xml_tag_name(body, open + xml_parameter_begin.size());
    if (tag.name.empty()) {  // no tag: text, passed over
      open = body.find(xml_parameter_begin, open + 1);
      continue;
    }
    // Raw text up to </parameter> (one inside a value ends it: vLLM's reading too); where the
    // model left that out, up to the next parameter or the call's end, as vLLM reads it.
    const size_t from = tag.close + 1;
    if (close < from) close = body.find(xml_parameter_end, from);
    open = body.find(xml_parameter_begin, from);
    const size_t end = std::min(close, open);
    std::string_view value = body.substr(from, end == npos ? npos : end - from);
    if (end == npos) value = without_cut_tag(value);
    // The template writes each value on lines of its own: one line break before and after it
    // is the form's, not the value's.
    if (value.starts_with('\n')) value.remove_prefix(1);
    if (value.ends_with('\n')) value.remove_suffix(1);
    auto kind = parameter_kind::text;
    if (kinds)
      if (const auto k = kinds->find(tag.name); k != kinds->end()) kind = k->second;
    args[tag.name] = typed_value(value, kind);  // a name written twice: the last value, in the first's place (vLLM's)
    // Text after the value's </parameter> up to the next <parameter= is passed over.
  }
  // Text that is not UTF-8 (an answer cut inside a character) is replaced, not thrown on.
  return args.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

answer_parts read_qwen3_xml(const std::string& content, const tool_parameter_kinds* parameters) {
  const std::string_view s = content;
  const size_t first = std::min(s.find(xml_call_begin), s.find(xml_function_begin));
  if (first == npos) return whole(content);
  answer_parts out;
  std::string rest;
  size_t text_from = first;  // the text since the last call's end (or the first marker): content
  for (size_t at = s.find(xml_function_begin, first); at != npos; at = s.find(xml_function_begin, at)) {
    const auto tag = read_xml_tag_name(s, at + xml_function_begin.size());
    if (tag.name.empty()) {  // no tag (or one cut before its '>'): text
      ++at;
      continue;
    }
    append_text(s.substr(text_from, at - text_from), &rest);
    // The call ends at its first </function> (values are raw text). None: the answer was cut
    // inside the call, which is read with the parameters written so far.
    if (!declared(parameters, tag.name)) return stop_at_undeclared(s, first, std::move(rest), at, std::move(out));
    const size_t body = tag.close + 1;
    const size_t end = s.find(xml_function_end, body);
    auto args = xml_call_arguments(tag.name, s.substr(body, end == npos ? npos : end - body), parameters);
    out.tool_calls.push_back({tag.name, std::move(args), static_cast<uint32_t>(out.tool_calls.size())});
    if (end == npos) {
      text_from = s.size();
      break;
    }
    at = text_from = end + xml_function_end.size();
  }
  if (out.tool_calls.empty()) return whole(content);
  append_text(s.substr(text_from), &rest);
  join_content(s.substr(0, first), rest, &out);
  return out;
}

tool_parameter_kinds tool_parameter_kinds_of(const nlohmann::json& tools) {
  tool_parameter_kinds out;
  if (!tools.is_array()) return out;
  for (const auto& tool : tools) {
    if (!tool.is_object() || !tool.contains("function")) continue;
    const auto& f = tool["function"];
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string()) continue;
    const auto [kinds, fresh] = out.try_emplace(f["name"].get<std::string>());
    if (!fresh) continue;  // the first tool of a name counts (vLLM's)
    const auto p = f.find("parameters");
    if (p == f.end() || !p->is_object()) continue;
    // Parameters without "properties": vLLM takes the object itself as the properties.
    const auto props = p->find("properties");
    const auto& properties = props != p->end() ? *props : *p;
    if (!properties.is_object()) continue;
    for (const auto& [key, schema] : properties.items()) kinds->second.emplace(key, kind_of(schema));
  }
  return out;
}

}  // namespace baton::deploy::openai

// Reading the tool calls in a whole chat answer, in each form a model's chat template asks for
// (gpu/tool_call_format.hpp). Pure. Every JSON form is all or nothing: an answer whose calls do
// not all read is content, whole. A call of a function the request did not declare ends the
// calls: it and what follows are content (the calls before it stand, as a stream sent them).
// Qwen3-Coder's XML calls are read leniently, as vLLM reads them (a call once named always
// reads), in openai_tool_calls_xml.cpp. The stream's reader is openai_tool_call_stream.cpp.

#include <algorithm>
#include <cctype>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "deploy/openai.hpp"
#include "deploy/openai_tool_call_forms.hpp"

namespace baton::deploy::openai {

using gpu::tool_call_format;
using nlohmann::ordered_json;


bool scan_json(std::string_view s, json_scan& scan) {
  for (; scan.at < s.size(); ++scan.at) {
    const char c = s[scan.at];
    if (scan.in_string) {
      if (scan.escaped) scan.escaped = false;
      else if (c == '\\') scan.escaped = true;
      else if (c == '"') scan.in_string = false;
    } else if (c == '"') {
      scan.in_string = true;
    } else if (c == '{' || c == '[') {
      ++scan.depth;
    } else if ((c == '}' || c == ']') && --scan.depth == 0) {
      ++scan.at;
      return true;
    }
  }
  return false;
}

namespace {

/// One past the end of the JSON object or array that starts at `at`, brackets and strings matched
/// (the parser checks the rest), or npos where it does not end (an answer cut by max_tokens).
size_t json_extent(std::string_view s, size_t at) {
  if (at >= s.size() || (s[at] != '{' && s[at] != '[')) return npos;
  json_scan scan{at};
  return scan_json(s, scan) ? scan.at : npos;
}



/// A call's JSON, or a discarded value where it is not JSON or nests deeper than a request body
/// may (max_json_depth): a model writing ten thousand brackets must not make the reader (or the
/// answer's JSON writer) recurse that deep.
ordered_json parse_json(std::string_view text) {
  if (nested_too_deep(text)) return ordered_json(ordered_json::value_t::discarded);
  return ordered_json::parse(text, nullptr, false);
}

/// A member of a JSON object: its key, and where its value's text lies.
struct member {
  std::string key;
  size_t begin, end;
};

/// The members of a well-formed object (one that parsed) in the order written, with the text of
/// each value: a call's arguments go out as the model wrote them, which is what a stream can send
/// before the call ends.
std::vector<member> object_members(std::string_view s) {
  std::vector<member> out;
  size_t at = skip_space(s, 1);
  while (at < s.size() && s[at] == '"') {
    const size_t key_end = value_extent(s, at);
    auto key = string_token(s.substr(at, key_end - at));
    const size_t begin = skip_space(s, skip_space(s, key_end) + 1);  // past the ':'
    const size_t end = value_extent(s, begin);
    out.push_back({key.value_or(""), begin, end});
    at = skip_space(s, end);
    if (at < s.size() && s[at] == ',') at = skip_space(s, at + 1);
  }
  return out;
}

/// The elements of a well-formed array (one that parsed), as the text of each.
std::vector<std::string_view> array_elements(std::string_view s) {
  std::vector<std::string_view> out;
  size_t at = skip_space(s, 1);
  while (at < s.size() && s[at] != ']') {
    const size_t end = value_extent(s, at);
    out.push_back(s.substr(at, end - at));
    at = skip_space(s, end);
    if (at < s.size() && s[at] == ',') at = skip_space(s, at + 1);
  }
  return out;
}


/// A call written as one JSON object (`text`, exactly the object): its "name", and its
/// "arguments" (or Llama's "parameters"), which `need_args` requires (a Llama answer that is
/// JSON with a "name" alone is an answer). The arguments are their text as written when an
/// object, the string's text when the model wrote a string, and `{}` when none or null. A second
/// "name", or a second set of arguments, makes it no call: which one would be meant?
bool add_object_call(std::string_view text, answer_parts* out, bool need_args = false) {
  const auto body = parse_json(text);
  if (!body.is_object() || !body.contains("name") || !body["name"].is_string()) return false;
  const member* args = nullptr;
  int names = 0;
  const auto members = object_members(text);
  for (const auto& m : members) {
    if (m.key == "name") ++names;
    if (!arguments_key(m.key)) continue;
    if (args) return false;
    args = &m;
  }
  if (names != 1 || (!args && need_args)) return false;
  std::string arguments = "{}";
  if (args) {
    const auto& value = body[args->key];
    if (value.is_object()) arguments = std::string{text.substr(args->begin, args->end - args->begin)};
    else if (value.is_string()) arguments = value.get<std::string>();
    else if (!value.is_null()) return false;
  }
  out->tool_calls.push_back({body["name"].get<std::string>(), std::move(arguments), static_cast<uint32_t>(out->tool_calls.size())});
  return true;
}

/// A call given as a name and its arguments' JSON text (an object, as written; none or null is
/// `{}`).
bool add_named_call(std::string name, std::string_view args, answer_parts* out) {
  if (name.empty()) return false;
  const auto body = trimmed_view(args);
  const auto parsed = body.empty() ? ordered_json{} : parse_json(body);
  if (!parsed.is_object() && !parsed.is_null()) return false;
  out->tool_calls.push_back({std::move(name), parsed.is_object() ? std::string{body} : "{}",
                             static_cast<uint32_t>(out->tool_calls.size())});
  return true;
}


}  // namespace

/// `before`, right-trimmed, then the text the calls left (between and after them) on a line of
/// its own: nothing the model wrote is dropped.
void join_content(std::string_view before, const std::string& rest, answer_parts* out) {
  std::string c{before};
  while (!c.empty() && json_space(c.back())) c.pop_back();
  if (!rest.empty()) c += (c.empty() ? "" : "\n") + rest;
  out->content = std::move(c);
}

void append_line(std::string* rest, const std::string& text) {
  if (!text.empty()) *rest += (rest->empty() ? "" : "\n") + text;
}

size_t value_extent(std::string_view s, size_t at) {
  if (at >= s.size()) return npos;
  if (s[at] == '{' || s[at] == '[') return json_extent(s, at);
  if (s[at] == '"') {
    for (size_t i = at + 1; i < s.size(); ++i) {
      if (s[i] == '\\') ++i;
      else if (s[i] == '"') return i + 1;
    }
    return npos;
  }
  for (size_t i = at; i < s.size(); ++i)
    if (s[i] == ',' || s[i] == '}' || s[i] == ']' || json_space(s[i])) return i;
  return npos;
}
std::optional<std::string> string_token(std::string_view token) {
  const auto j = ordered_json::parse(token, nullptr, false);
  if (!j.is_string()) return std::nullopt;
  return j.get<std::string>();
}
std::string_view kimi_name(std::string_view head) {
  std::string_view name = trimmed_view(head.substr(0, head.rfind(':')));
  if (const size_t dot = name.rfind('.'); dot != npos) name = name.substr(dot + 1);
  return name;
}
std::string kimi_id(std::string_view head) {
  head = trimmed_view(head);
  const size_t colon = head.rfind(':');
  if (colon == npos || colon == 0 || colon + 1 == head.size()) return {};
  for (size_t i = colon + 1; i < head.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(head[i]))) return {};
  for (char c : head)
    if (json_space(c)) return {};
  return std::string{head};
}

answer_parts stop_at_undeclared(std::string_view s, size_t first, std::string rest, size_t at, answer_parts out) {
  if (out.tool_calls.empty()) return whole(std::string{s});
  append_line(&rest, trimmed(s.substr(at)));
  join_content(s.substr(0, first), rest, &out);
  return out;
}

namespace {

/// Whether the call just read (the last of `out`) is of a declared function; if not, it is taken
/// back: the reader stops there (stop_at_undeclared).
bool took_undeclared(const tool_parameter_kinds* tools, answer_parts* out) {
  if (declared(tools, out->tool_calls.back().name)) return false;
  out->tool_calls.pop_back();
  return true;
}

answer_parts read_hermes(const std::string& content, const tool_parameter_kinds* tools) {
  const std::string_view s = content;
  const size_t first = s.find(hermes_begin);
  if (first == npos) return whole(content);
  answer_parts out;
  std::string rest;
  size_t at = first;
  while (at != npos) {
    const size_t from = at + hermes_begin.size();
    // The end tag after the call's JSON: one inside its strings (an argument that quotes
    // </tool_call>) is text.
    const size_t extent = json_extent(s, skip_space(s, from));
    const size_t end = s.find(hermes_end, extent == npos ? from : extent);
    // A call cut off by max_tokens has no end tag: it is read to the answer's end.
    if (!add_object_call(trimmed_view(s.substr(from, end == npos ? npos : end - from)), &out)) return whole(content);
    if (took_undeclared(tools, &out)) return stop_at_undeclared(s, first, std::move(rest), at, std::move(out));
    if (end == npos) break;
    const size_t after = end + hermes_end.size();
    at = s.find(hermes_begin, after);
    append_line(&rest, trimmed(s.substr(after, at == npos ? npos : at - after)));
  }
  join_content(s.substr(0, first), rest, &out);
  return out;
}

/// A JSON list of call objects (`text`, exactly the list), each read as add_object_call; an empty
/// list is none.
bool add_call_list(std::string_view text, answer_parts* out, bool need_args = false) {
  const auto list = text.empty() ? ordered_json{} : parse_json(text);
  if (!list.is_array() || list.empty()) return false;
  for (const auto element : array_elements(text))
    if (!add_object_call(element, out, need_args)) return false;
  return true;
}

answer_parts read_llama(const std::string& content, const tool_parameter_kinds* tools) {
  const std::string_view s = content;
  size_t at = skip_space(s, 0);
  if (starts_with(s, at, python_tag)) at = skip_space(s, at + python_tag.size());
  if (at >= s.size() || s[at] != '{') return whole(content);
  answer_parts out;
  while (at < s.size() && s[at] == '{') {  // calls, `;` between them
    const size_t end = json_extent(s, at);
    if (end == npos || !add_object_call(s.substr(at, end - at), &out, /*need_args*/ true))
      return whole(content);
    if (took_undeclared(tools, &out)) return stop_at_undeclared(s, 0, {}, at, std::move(out));
    at = skip_space(s, end);
    if (at < s.size() && s[at] == ';') at = skip_space(s, at + 1);
  }
  join_content({}, trimmed(s.substr(at)), &out);
  return out;
}


/// Mistral's newer form at `at`: name, [CALL_ID]id optionally, [ARGS], a JSON object.
bool read_mistral_named(std::string_view s, size_t* at, answer_parts* out) {
  size_t i = *at;
  while (i < s.size() && name_char(s[i])) ++i;
  const std::string name{s.substr(*at, i - *at)};
  if (starts_with(s, i, mistral_call_id)) {  // an id of letters and digits, then [ARGS] at once
    i += mistral_call_id.size();
    while (i < s.size() && std::isalnum(static_cast<unsigned char>(s[i]))) ++i;
  }
  if (name.empty() || !starts_with(s, i, mistral_args)) return false;
  const size_t from = skip_space(s, i + mistral_args.size());
  const size_t end = json_extent(s, from);
  if (end == npos || s[from] != '{' || !add_named_call(name, s.substr(from, end - from), out)) return false;
  *at = end;
  return true;
}

answer_parts read_mistral(const std::string& content, const tool_parameter_kinds* tools) {
  const std::string_view s = content;
  const size_t first = s.find(mistral_calls);
  if (first == npos) return whole(content);
  answer_parts out;
  std::string rest;
  size_t at = first;
  while ((at = skip_space(s, at)) < s.size()) {
    const size_t call_at = at;  // where the call's text begins, its marker included
    const bool marked = starts_with(s, at, mistral_calls);
    if (marked) at = skip_space(s, at + mistral_calls.size());
    if (marked && at < s.size() && s[at] == '[') {  // v0.3: a JSON list of calls
      const size_t end = json_extent(s, at);
      const size_t before = out.tool_calls.size();
      const auto list = end == npos ? std::string_view{} : s.substr(at, end - at);
      if (!add_call_list(list, &out)) return whole(content);
      const auto elements = array_elements(list);
      for (size_t i = before; i < out.tool_calls.size(); ++i)
        if (!declared(tools, out.tool_calls[i].name)) {  // the list's calls before it stand
          out.tool_calls.resize(i);
          const size_t element_at = static_cast<size_t>(elements[i - before].data() - s.data());
          return stop_at_undeclared(s, first, std::move(rest), i == before ? call_at : element_at, std::move(out));
        }
      at = end;
    } else if (marked) {
      if (!read_mistral_named(s, &at, &out)) return whole(content);
      if (took_undeclared(tools, &out)) return stop_at_undeclared(s, first, std::move(rest), call_at, std::move(out));
    } else if (!out.tool_calls.empty() && read_mistral_named(s, &at, &out)) {
      // a named call right after another: it needs no marker of its own
      if (took_undeclared(tools, &out)) return stop_at_undeclared(s, first, std::move(rest), call_at, std::move(out));
    } else {  // text, up to the next marker
      const size_t next = s.find(mistral_calls, at);
      append_line(&rest, trimmed(s.substr(at, next == npos ? npos : next - at)));
      at = next == npos ? s.size() : next;
    }
  }
  if (out.tool_calls.empty()) return whole(content);
  join_content(s.substr(0, first), rest, &out);
  return out;
}



/// One call of a sectioned form from its head and arguments.
bool add_sectioned_call(tool_call_format f, std::string_view head, std::string_view right, answer_parts* out) {
  if (f == tool_call_format::kimi) {
    if (!add_named_call(std::string{kimi_name(head)}, right, out)) return false;
    out->tool_calls.back().id = kimi_id(head);
    return true;
  }
  if (head == "function") {  // DeepSeek V3, R1: the name on its own line, then a ```json block
    const size_t line = right.find('\n');
    if (line == npos) return false;
    std::string_view args = right.substr(line + 1);
    if (const size_t open = args.find("```json"); open != npos) {
      // The block ends after the JSON (a ``` inside one of its strings is text): its extent,
      // strings matched, where it is an object or array; else at the next fence.
      const size_t json_at = skip_space(args, open + 7);
      const size_t extent = json_extent(args, json_at);
      const size_t close = extent != npos ? extent : args.find("```", open + 7);
      args = args.substr(open + 7, close == npos ? npos : close - open - 7);
    }
    return add_named_call(trimmed(right.substr(0, line)), args, out);
  }
  return add_named_call(trimmed(head), right, out);  // DeepSeek V3.1: the name, then the arguments
}

answer_parts read_sectioned(const std::string& content, tool_call_format f, const sectioned_form& form,
                            const tool_parameter_kinds* tools) {
  const std::string_view s = content;
  const size_t first = s.find(form.section_begin);
  if (first == npos) return whole(content);
  answer_parts out;
  size_t at = first + form.section_begin.size();
  while ((at = skip_space(s, at)) < s.size()) {
    if (starts_with(s, at, form.section_end)) {
      at += form.section_end.size();
      break;
    }
    if (!starts_with(s, at, form.call_begin)) return whole(content);
    const size_t from = at + form.call_begin.size();
    const size_t end = s.find(form.call_end, from);  // none: cut by max_tokens, read to the end
    const std::string_view body = s.substr(from, end == npos ? npos : end - from);
    const size_t sep = body.find(form.sep);
    if (sep == npos || !add_sectioned_call(f, body.substr(0, sep), body.substr(sep + form.sep.size()), &out))
      return whole(content);
    if (took_undeclared(tools, &out)) return stop_at_undeclared(s, first, {}, at, std::move(out));
    if (end == npos) {
      at = s.size();
      break;
    }
    at = end + form.call_end.size();
  }
  if (out.tool_calls.empty()) return whole(content);
  join_content(s.substr(0, first), trimmed(s.substr(std::min(at, s.size()))), &out);
  return out;
}

}  // namespace

answer_parts read_tool_calls(const std::string& content, tool_call_format format,
                             const tool_parameter_kinds* parameters) {
  switch (format) {
    case tool_call_format::hermes: return read_hermes(content, parameters);
    case tool_call_format::llama_json: return read_llama(content, parameters);
    case tool_call_format::mistral: return read_mistral(content, parameters);
    case tool_call_format::deepseek: return read_sectioned(content, format, deepseek_form, parameters);
    case tool_call_format::kimi: return read_sectioned(content, format, kimi_form, parameters);
    case tool_call_format::qwen3_xml: return read_qwen3_xml(content, parameters);
    case tool_call_format::none: break;
  }
  return whole(content);
}

answer_parts read_forced_calls(const std::string& text, const std::string& forced_tool) {
  answer_parts out;
  const auto body = trimmed_view(text);
  if (!forced_tool.empty() && !body.empty() && body[0] == '{' && parse_json(body).is_object()) {
    out.tool_calls.push_back({forced_tool, std::string{body}});
    return out;
  }
  if (forced_tool.empty() && !body.empty() && body[0] == '[' && add_call_list(body, &out, /*need_args*/ true)) return out;
  out.tool_calls.clear();
  out.content = text;
  return out;
}

}  // namespace baton::deploy::openai

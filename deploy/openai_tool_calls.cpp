// Reading the tool calls in a chat answer, in each form a model's chat template asks for
// (gpu/tool_call_format.hpp), whole or as the answer streams. Pure: the gateway's per-choice
// state. Read whole, every JSON form is all or nothing: an answer whose calls do not all read is
// content, whole. Streamed, each call goes out as it is written (tool_call_splitter). Qwen3-Coder's
// XML calls are read leniently, as vLLM reads them (a call once named always reads), whole in
// openai_tool_calls_xml.cpp; their stream is here with the others', by the same rules.

#include <algorithm>
#include <array>
#include <cctype>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "actors/text_stream.hpp"
#include "deploy/openai.hpp"
#include "deploy/openai_tool_calls_xml.hpp"

namespace baton::deploy::openai {

using gpu::tool_call_format;
using nlohmann::ordered_json;

namespace {

constexpr auto npos = std::string_view::npos;
// Hermes (Qwen2.5, Qwen3): <tool_call>{...}</tool_call> per call (Qwen3-Coder's XML calls too).
constexpr std::string_view hermes_begin = xml_call_begin;
constexpr std::string_view hermes_end = xml_call_end;
// Llama 3.1: the answer is the call's JSON, after <|python_tag|> when the model writes one.
constexpr std::string_view python_tag = "<|python_tag|>";
// Mistral: [TOOL_CALLS] then a JSON list (v0.3), or name[ARGS]{...} per call (newer tokenizers,
// with [CALL_ID]id before [ARGS] in some).
constexpr std::string_view mistral_calls = "[TOOL_CALLS]";
constexpr std::string_view mistral_args = "[ARGS]";
constexpr std::string_view mistral_call_id = "[CALL_ID]";
/// Forms whose calls sit in a section of marker tokens, each call being <call_begin>, a head,
/// <sep>, the arguments, <call_end>.
struct sectioned_form {
  std::string_view section_begin, section_end, call_begin, call_end, sep;
};
// DeepSeek: <｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>
// (V3, R1) or <｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜> (V3.1).
constexpr sectioned_form deepseek_form{"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                       "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"};
// Kimi-K2: <|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>.
constexpr sectioned_form kimi_form{"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                   "<|tool_call_end|>", "<|tool_call_argument_begin|>"};

size_t skip_space(std::string_view s, size_t at) {
  while (at < s.size() && json_space(s[at])) ++at;
  return at;
}

std::string trimmed(std::string_view s) { return std::string{trimmed_view(s)}; }

bool starts_with(std::string_view s, size_t at, std::string_view prefix) { return s.substr(at, prefix.size()) == prefix; }

}  // namespace

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

/// One past the end of the JSON value that starts at `at` (any kind), or npos where the text ends
/// first: a number at the very end may still go on.
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

/// A JSON string token's text, decoded; nullopt where it is not one.
std::optional<std::string> string_token(std::string_view token) {
  const auto j = ordered_json::parse(token, nullptr, false);
  if (!j.is_string()) return std::nullopt;
  return j.get<std::string>();
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

bool arguments_key(std::string_view key) { return key == "arguments" || key == "parameters"; }

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

answer_parts whole(const std::string& content) {
  answer_parts out;
  out.content = content;
  return out;
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

namespace {

answer_parts read_hermes(const std::string& content) {
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

answer_parts read_llama(const std::string& content) {
  const std::string_view s = content;
  size_t at = skip_space(s, 0);
  if (starts_with(s, at, python_tag)) at = skip_space(s, at + python_tag.size());
  if (at >= s.size() || s[at] != '{') return whole(content);
  answer_parts out;
  while (at < s.size() && s[at] == '{') {  // calls, `;` between them
    const size_t end = json_extent(s, at);
    if (end == npos || !add_object_call(s.substr(at, end - at), &out, /*need_args*/ true))
      return whole(content);
    at = skip_space(s, end);
    if (at < s.size() && s[at] == ';') at = skip_space(s, at + 1);
  }
  join_content({}, trimmed(s.substr(at)), &out);
  return out;
}

bool name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.'; }

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

answer_parts read_mistral(const std::string& content) {
  const std::string_view s = content;
  const size_t first = s.find(mistral_calls);
  if (first == npos) return whole(content);
  answer_parts out;
  std::string rest;
  size_t at = first;
  while ((at = skip_space(s, at)) < s.size()) {
    const bool marked = starts_with(s, at, mistral_calls);
    if (marked) at = skip_space(s, at + mistral_calls.size());
    if (marked && at < s.size() && s[at] == '[') {  // v0.3: a JSON list of calls
      const size_t end = json_extent(s, at);
      if (!add_call_list(end == npos ? std::string_view{} : s.substr(at, end - at), &out)) return whole(content);
      at = end;
    } else if (marked) {
      if (!read_mistral_named(s, &at, &out)) return whole(content);
    } else if (!out.tool_calls.empty() && read_mistral_named(s, &at, &out)) {
      // a named call right after another: it needs no marker of its own
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

/// A Kimi call's name from its head, the call's id: functions.name:index, or name:index.
std::string_view kimi_name(std::string_view head) {
  std::string_view name = trimmed_view(head.substr(0, head.rfind(':')));
  if (const size_t dot = name.rfind('.'); dot != npos) name = name.substr(dot + 1);
  return name;
}

/// A Kimi call's head as its id, where it has the id's form (NAME:N, no spaces), as vLLM keeps
/// it: the model numbers its calls (and its template may render them) its own way; else empty.
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

answer_parts read_sectioned(const std::string& content, tool_call_format f, const sectioned_form& form) {
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

/// The texts that start the calls in a marked format (Llama's have none): whichever comes first.
/// Qwen3-Coder's calls may come without their <tool_call> (vLLM reads those too).
std::array<std::string_view, 2> call_markers(tool_call_format f) {
  switch (f) {
    case tool_call_format::hermes: return {hermes_begin};
    case tool_call_format::qwen3_xml: return {xml_call_begin, xml_function_begin};
    case tool_call_format::mistral: return {mistral_calls};
    case tool_call_format::deepseek: return {deepseek_form.section_begin};
    case tool_call_format::kimi: return {kimi_form.section_begin};
    default: return {};
  }
}

/// `marker`'s first place in `s` from *from on. Where it is not there (yet), *from moves on to
/// the last marker.size() - 1 bytes, which more text may make the marker: however a text grows
/// (a byte at a time, say), each of its bytes is searched once, not once per piece.
size_t find_forward(std::string_view s, std::string_view marker, size_t* from) {
  const size_t at = s.find(marker, *from);
  if (at == npos && s.size() >= marker.size()) *from = std::max(*from, s.size() - marker.size() + 1);
  return at;
}

/// Where a stream stands on its next call: the call's head read (its name, and where its
/// arguments' object begins), more text needed, or none that can stream (the end reads the rest).
struct call_head {
  enum status_t { none, more, found } status = none;
  std::string name;
  size_t args = 0;
  /// Text that ends the call where the whole answer's reader looks for it (hermes_end, the
  /// call's end marker, a closing fence): the arguments stop there, whatever their JSON says.
  std::array<std::string_view, 2> ends{};
  std::string id{};  ///< tool_call::id
};

const call_head more_text{call_head::more, {}, 0, {}};

/// Whether `marker` is at `at`: yes, no, or not known yet (the text ends inside it).
enum class seen { yes, no, more };
seen see(std::string_view s, size_t at, std::string_view marker) {
  const auto rest = s.substr(std::min(at, s.size()));
  if (rest.size() >= marker.size()) return rest.substr(0, marker.size()) == marker ? seen::yes : seen::no;
  return marker.substr(0, rest.size()) == rest ? seen::more : seen::no;
}

/// A call object's head, the object starting at `at`: "name" (a string) first, then "arguments"
/// or "parameters" as an object. Anything else is for the end to read.
call_head object_head(std::string_view s, size_t at) {
  std::optional<std::string> name;
  for (size_t i = at + 1;; ++i) {  // at a member, after '{' or ','
    i = skip_space(s, i);
    if (i >= s.size()) return more_text;
    if (s[i] != '"') return {};
    const size_t key_end = value_extent(s, i);
    if (key_end == npos) return more_text;
    const auto key = string_token(s.substr(i, key_end - i));
    i = skip_space(s, key_end);
    if (!key || (i < s.size() && s[i] != ':')) return {};
    i = skip_space(s, i + 1);
    if (i >= s.size()) return more_text;
    if (arguments_key(*key)) {
      if (!name || s[i] != '{') return {};
      return {call_head::found, std::move(*name), i};
    }
    const size_t end = value_extent(s, i);
    if (end == npos) return more_text;
    if (*key == "name") {
      if (name || s[i] != '"') return {};
      name = string_token(s.substr(i, end - i));
      if (!name) return {};
    }
    i = skip_space(s, end);
    if (i >= s.size()) return more_text;
    if (s[i] != ',') return {};
  }
}

/// The arguments' object at `at`, for a call named `name`.
call_head args_at(std::string_view s, size_t at, std::string name) {
  if (at >= s.size()) return more_text;
  if (name.empty() || s[at] != '{') return {};
  return {call_head::found, std::move(name), at};
}

/// The next call object in a JSON list of calls: the first after the '[' at `open`, or the one
/// after the call whose arguments ended at `from`.
call_head list_head(std::string_view s, size_t open, size_t from, bool first) {
  size_t at = skip_space(s, first ? open + 1 : from);
  if (!first) {  // the call object closes, then a ',' and the next
    if (at < s.size() && s[at] == '}') at = skip_space(s, at + 1);
    if (at >= s.size()) return more_text;
    if (s[at] != ',') return {};
    at = skip_space(s, at + 1);
  }
  if (at >= s.size()) return more_text;
  return s[at] == '{' ? object_head(s, at) : call_head{};
}

/// Mistral's newer form at `at`: name, [CALL_ID]id optionally, [ARGS], the arguments' object.
call_head mistral_named_head(std::string_view s, size_t at) {
  size_t i = at;
  while (i < s.size() && name_char(s[i])) ++i;
  if (i >= s.size()) return more_text;
  std::string name{s.substr(at, i - at)};
  switch (see(s, i, mistral_call_id)) {
    case seen::more: return more_text;
    case seen::yes:
      i += mistral_call_id.size();
      while (i < s.size() && std::isalnum(static_cast<unsigned char>(s[i]))) ++i;
      if (i >= s.size()) return more_text;
      break;
    case seen::no: break;
  }
  switch (see(s, i, mistral_args)) {
    case seen::more: return more_text;
    case seen::no: return {};
    case seen::yes: break;
  }
  return args_at(s, skip_space(s, i + mistral_args.size()), std::move(name));
}

/// `*from`: where the last call's JSON ended, moved on as the text is searched (find_forward);
/// `*end_seen`: its </tool_call> is behind *from, the next <tool_call> is looked for.
call_head hermes_head(std::string_view s, size_t* from, bool* end_seen, bool first) {
  size_t at = hermes_begin.size();  // the text starts at the first call's marker
  if (!first) {  // after this call's end tag, the next call's marker (any text between is read at the end)
    if (!*end_seen) {
      const size_t end = find_forward(s, hermes_end, from);
      if (end == npos) return more_text;
      *from = end + hermes_end.size();
      *end_seen = true;
    }
    const size_t next = find_forward(s, hermes_begin, from);
    if (next == npos) return more_text;
    at = next + hermes_begin.size();
  }
  at = skip_space(s, at);
  if (at >= s.size()) return more_text;
  auto head = s[at] == '{' ? object_head(s, at) : call_head{};
  head.ends = {hermes_end};
  return head;
}

call_head llama_head(std::string_view s, size_t from, bool first) {
  size_t at = skip_space(s, first ? 0 : from);
  if (first) {
    switch (see(s, at, python_tag)) {
      case seen::more: return more_text;
      case seen::yes: at = skip_space(s, at + python_tag.size()); break;
      case seen::no: break;
    }
  } else {
    if (at < s.size() && s[at] == '}') at = skip_space(s, at + 1);  // the call object closes
    if (at < s.size() && s[at] == ';') at = skip_space(s, at + 1);
  }
  if (at >= s.size()) return more_text;
  return s[at] == '{' ? object_head(s, at) : call_head{};
}

call_head mistral_head(std::string_view s, size_t from, bool first) {
  const size_t open = skip_space(s, mistral_calls.size());  // the text starts at the first marker
  if (open >= s.size()) return more_text;
  if (s[open] == '[') return list_head(s, open, from, first);  // v0.3's list: its calls stream
  size_t at = first ? open : skip_space(s, from);
  if (!first) {
    // Another named call with a marker of its own streams. One without is read at the end: it
    // is a call only if its JSON reads, else text, which a stream cannot know yet.
    if (at >= s.size()) return more_text;
    switch (see(s, at, mistral_calls)) {
      case seen::more: return more_text;
      case seen::yes: at = skip_space(s, at + mistral_calls.size()); break;
      case seen::no: return {};
    }
  }
  return mistral_named_head(s, at);
}

/// `*from`: where the last call's JSON ended, moved on as the text is searched (find_forward).
/// `*scanned`: how far this call's head has been searched for its separator, its end marker and
/// (DeepSeek V3's name line) a line break, so that a long head is not searched again from its
/// start with every piece (all 0 for a call not yet begun).
call_head sectioned_head(std::string_view s, size_t* from, bool first, tool_call_format f, const sectioned_form& form,
                         std::array<size_t, 3>* scanned) {
  size_t at = form.section_begin.size();  // the text starts at the section's marker
  if (!first) {
    const size_t end = find_forward(s, form.call_end, from);
    if (end == npos) return more_text;
    at = end + form.call_end.size();
  }
  at = skip_space(s, at);
  switch (see(s, at, form.call_begin)) {
    case seen::more: return more_text;
    case seen::no: return {};
    case seen::yes: break;
  }
  const size_t head = at + form.call_begin.size();
  auto found = [&](size_t args, std::string name, std::string_view fence = {}) {
    auto h = args_at(s, args, std::move(name));
    h.ends = {form.call_end, fence};
    return h;
  };
  const auto search = [&](std::string_view marker, size_t start, size_t& resume) {
    resume = std::max(resume, start);
    return find_forward(s, marker, &resume);
  };
  const size_t sep = search(form.sep, head, (*scanned)[0]);
  const size_t end = search(form.call_end, head, (*scanned)[1]);
  if (end != npos && (sep == npos || end < sep)) return {};
  if (sep == npos) return more_text;
  const std::string_view head_text = s.substr(head, sep - head);
  const size_t right = sep + form.sep.size();
  if (f == tool_call_format::kimi) {
    auto h = found(skip_space(s, right), std::string{kimi_name(head_text)});
    h.id = kimi_id(head_text);
    return h;
  }
  if (head_text != "function") return found(skip_space(s, right), trimmed(head_text));
  // DeepSeek V3, R1: the name on its own line, then the arguments in a ```json block.
  const size_t line = search("\n", right, (*scanned)[2]);
  if (line == npos) return more_text;
  if (end != npos && end < line) return {};
  size_t args = skip_space(s, line + 1);
  switch (see(s, args, "```json")) {
    case seen::more: return more_text;
    case seen::yes: return found(skip_space(s, args + 7), trimmed(s.substr(right, line - right)), "```");
    case seen::no: break;
  }
  return found(args, trimmed(s.substr(right, line - right)));
}

/// Qwen3-Coder's next call: the next <function=NAME> tag from *from on (the first marker, then
/// the last call's </function>), in a <tool_call> block or not, named once its '>' is read; a
/// <function= that is no tag is text, passed over (read_qwen3_xml's rules: text among the calls
/// is read at the end). *from moves on as the text is searched (find_forward), stopping at a
/// <function= whose tag goes on; *tag_scanned: how far that tag has been looked at. Its arguments
/// (from just past the '>') are not JSON as written: stream_xml_arguments sends them whole at
/// </function>.
call_head xml_head(std::string_view s, size_t* from, size_t* tag_scanned) {
  for (;;) {
    const size_t at = find_forward(s, xml_function_begin, from);
    if (at == npos) return more_text;
    *from = at;
    auto tag = read_xml_tag_name(s, at + xml_function_begin.size(), *tag_scanned);
    if (tag.more) {
      *tag_scanned = s.size();
      return more_text;
    }
    *tag_scanned = 0;
    if (!tag.name.empty()) return {call_head::found, std::move(tag.name), tag.close + 1};
    *from = at + 1;
  }
}

call_head forced_head(std::string_view s, size_t from, bool first, const std::string& tool) {
  if (!tool.empty()) return first ? args_at(s, skip_space(s, 0), tool) : call_head{};
  const size_t open = skip_space(s, 0);
  if (open >= s.size()) return more_text;
  return s[open] == '[' ? list_head(s, open, from, first) : call_head{};
}

}  // namespace

answer_parts read_tool_calls(const std::string& content, tool_call_format format,
                             const tool_parameter_kinds* parameters) {
  switch (format) {
    case tool_call_format::hermes: return read_hermes(content);
    case tool_call_format::llama_json: return read_llama(content);
    case tool_call_format::mistral: return read_mistral(content);
    case tool_call_format::deepseek: return read_sectioned(content, format, deepseek_form);
    case tool_call_format::kimi: return read_sectioned(content, format, kimi_form);
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

tool_call_splitter tool_call_splitter::forced(std::string tool) {
  tool_call_splitter s{tool_call_format::none};
  s.forced_ = true;
  s.forced_tool_ = std::move(tool);
  s.calling_ = true;
  return s;
}

answer_parts tool_call_splitter::read_held() const {
  if (forced_) return read_forced_calls(held_, forced_tool_);
  auto out = read_tool_calls(held_, format_, parameters_.get());
  const auto undeclared = [&](const tool_call& c) { return !declared(parameters_.get(), c.name); };
  return std::any_of(out.tool_calls.begin(), out.tool_calls.end(), undeclared) ? whole(held_) : out;
}

std::string_view tool_call_splitter::sent_arguments(const sent_call& call) const {
  if (!call.built.empty()) return call.built;
  return std::string_view{held_}.substr(call.args_begin, call.args_sent - call.args_begin);
}

bool tool_call_splitter::stream_xml_arguments(answer_parts* out) {
  // The call's text from args_begin on; scan_.at: how far </function> has been looked for (each
  // byte is looked at once as the text grows; held_ only grows while calls stream). None before
  // the answer ends (cut by max_tokens): the end reads the call with the parameters so far, and
  // sends them as the rest of this call (sent_arguments is "" until then).
  const std::string_view s = held_;
  auto& call = sent_.back();
  const size_t end = find_forward(s, xml_function_end, &scan_.at);
  if (end == npos) return false;
  // Once named, a call always reads (text among its parameters is passed over): its arguments
  // are a JSON object, `{}` at least, never empty, so `built` tells a call whose arguments went.
  auto args = xml_call_arguments(call.name, s.substr(call.args_begin, end - call.args_begin), parameters_.get());
  const auto index = static_cast<uint32_t>(sent_.size() - 1);
  if (!out->tool_calls.empty() && out->tool_calls.back().index == index) out->tool_calls.back().arguments += args;
  else out->tool_calls.push_back({{}, args, index, false});
  call.built = std::move(args);
  args_open_ = false;
  next_from_ = end + xml_function_end.size();
  return true;
}

void tool_call_splitter::stream_calls(answer_parts* out) {
  const std::string_view s = held_;
  while (!stopped_) {
    if (args_open_ && format_ == tool_call_format::qwen3_xml && !stream_xml_arguments(out)) return;
    if (args_open_) {  // the last call's arguments so far; trailing whitespace waits (the end may trim it)
      auto& call = sent_.back();
      const bool ended = scan_json(s, scan_);
      size_t upto = ended ? scan_.at : s.size();
      bool cut = false;
      for (const std::string_view end : call.ends) {
        const size_t from = std::max(call.args_begin, call.args_sent >= end.size() ? call.args_sent - end.size() + 1 : 0);
        // An end marker inside one of the arguments' strings (a file's content with a ``` fence,
        // say) is text, not the end: only one outside every string cuts the arguments.
        for (size_t at = s.find(end, from); at < upto; at = s.find(end, at + 1)) {
          // Read on from where the last look stopped (each byte once, as the text grows); from
          // the start again only for a marker behind it (another end's).
          if (probe_.at > at) probe_ = json_scan{call.args_begin};
          scan_json(s.substr(0, at), probe_);
          if (probe_.in_string) continue;
          upto = at;
          cut = true;
          break;
        }
      }
      // A tail that may still become an end marker waits, as does half a UTF-8 character.
      if (!ended && !cut) upto = streamable_prefix(s.substr(0, upto), call.ends);
      while ((cut || !ended) && upto > call.args_sent && json_space(s[upto - 1])) --upto;
      upto = std::max(upto, call.args_sent);
      if (upto > call.args_sent) {
        const auto piece = s.substr(call.args_sent, upto - call.args_sent);
        const auto index = static_cast<uint32_t>(sent_.size() - 1);
        if (!out->tool_calls.empty() && out->tool_calls.back().index == index) out->tool_calls.back().arguments += piece;
        else out->tool_calls.push_back({{}, std::string{piece}, index, false});
        call.args_sent = upto;
      }
      if (cut) {  // the JSON did not end before the call did: the end reads it
        stopped_ = true;
        return;
      }
      if (!ended) return;
      args_open_ = false;
      next_from_ = scan_.at;
    }
    const bool first = sent_.empty();
    call_head head;
    if (forced_) {
      head = forced_head(s, next_from_, first, forced_tool_);
    } else {
      switch (format_) {
        case tool_call_format::hermes: head = hermes_head(s, &next_from_, &end_seen_, first); break;
        case tool_call_format::llama_json: head = llama_head(s, next_from_, first); break;
        case tool_call_format::mistral: head = mistral_head(s, next_from_, first); break;
        case tool_call_format::deepseek:
          head = sectioned_head(s, &next_from_, first, format_, deepseek_form, &head_scanned_);
          break;
        case tool_call_format::kimi: head = sectioned_head(s, &next_from_, first, format_, kimi_form, &head_scanned_); break;
        case tool_call_format::qwen3_xml: head = xml_head(s, &next_from_, &tag_scanned_); break;
        case tool_call_format::none: break;
      }
    }
    if (head.status == call_head::more) return;
    if (head.status == call_head::none || !declared(parameters_.get(), head.name)) {  // (another function's: content)
      stopped_ = true;
      return;
    }
    out->tool_calls.push_back({head.name, {}, static_cast<uint32_t>(sent_.size()), true, head.id});
    head_scanned_ = {};  // the next call's head is searched from its own start
    sent_.push_back({std::move(head.name), head.args, head.args, {}, {}});
    for (const auto end : head.ends)  // once per call, not per token
      if (!end.empty()) sent_.back().ends.emplace_back(end);
    scan_ = json_scan{head.args};
    probe_ = scan_;
    args_open_ = true;
    end_seen_ = false;
  }
}

answer_parts tool_call_splitter::feed(const std::string& content, bool last) {
  answer_parts out;
  held_ += content;
  if (plain_) {
    out.content = std::move(held_);
    held_.clear();
    return out;
  }
  if (!calling_ && format_ == tool_call_format::llama_json) {  // (a forced answer is calling_ from the start)
    // A Llama call is the answer itself: held while the answer may still start with one.
    const std::string_view rest = std::string_view{held_}.substr(skip_space(held_, 0));
    const bool undecided = rest.size() < python_tag.size() && python_tag.substr(0, rest.size()) == rest;
    if (undecided && !last) return out;
    calling_ = !undecided && (rest[0] == '{' || starts_with(rest, 0, python_tag));
    if (!calling_) {
      plain_ = true;
      out.content = std::move(held_);
      held_.clear();
      return out;
    }
  } else if (!calling_) {
    // held_ is the tail held back (what may start a marker) and the new piece: searched once.
    size_t at = npos;
    std::vector<std::string> markers;
    for (const auto marker : call_markers(format_))
      if (!marker.empty()) {
        at = std::min(at, held_.find(marker));
        markers.emplace_back(marker);
      }
    if (at != npos) {
      out.content = held_.substr(0, at);
      held_.erase(0, at);
      calling_ = true;
    } else {
      const size_t shown = last || markers.empty() ? held_.size() : streamable_prefix(held_, markers);
      out.content = held_.substr(0, shown);
      held_.erase(0, shown);
      shown_ |= !out.content.empty();
      return out;
    }
  }
  shown_ |= !out.content.empty();
  if (!last) {
    stream_calls(&out);
    return out;
  }
  auto calls = read_held();
  if (forced_ && calls.tool_calls.empty()) {
    // A forced answer cut before its JSON closed (max_tokens): the calls as far as they go --
    // named, their arguments so far, as OpenAI sends a cut call with finish_reason "length" --
    // never the grammar's JSON as text (a list of {name, parameters} the client never asked for).
    stream_calls(&out);
    if (!sent_.empty() && args_open_) {  // what the stream held back (trailing blanks) goes too
      auto& call = sent_.back();
      if (call.args_sent < held_.size()) {
        const auto index = static_cast<uint32_t>(sent_.size() - 1);
        auto piece = held_.substr(call.args_sent);
        if (!out.tool_calls.empty() && out.tool_calls.back().index == index) out.tool_calls.back().arguments += piece;
        else out.tool_calls.push_back({{}, std::move(piece), index, false});
      }
    }
    out.called = false;  // not finished calls: the finish_reason says what cut them
    out.cut = true;
    held_.clear();
    return out;
  }
  // The whole answer's calls must go on from the pieces already sent.
  bool agrees = !calls.tool_calls.empty() && calls.tool_calls.size() >= sent_.size();
  for (size_t i = 0; agrees && i < sent_.size(); ++i) {
    const auto& sent = sent_[i];
    agrees = calls.tool_calls[i].name == sent.name &&
             std::string_view{calls.tool_calls[i].arguments}.starts_with(sent_arguments(sent));
  }
  out.called = agrees || !sent_.empty();
  if (!agrees) {
    out.content += held_;  // no calls after all, or not the ones sent: the held text is content
  } else {
    for (auto& c : calls.tool_calls) {
      if (c.index < sent_.size()) {  // the rest of a call already begun
        c.arguments.erase(0, sent_arguments(sent_[c.index]).size());
        c.name.clear();
        c.first = false;
        if (c.arguments.empty()) continue;
      }
      out.tool_calls.push_back(std::move(c));
    }
    // The content before the first call already went out; what the calls leave (text between
    // and after them) follows it now.
    if (!calls.content.empty()) out.content += (shown_ ? "\n" : "") + calls.content;
  }
  held_.clear();
  return out;
}

}  // namespace baton::deploy::openai

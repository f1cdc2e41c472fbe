// Reading the tool calls in a chat answer, in each form a model's chat template asks for
// (gpu/tool_call_format.hpp), whole or as the answer streams. Pure: the gateway's per-choice
// state. Every reader is all or nothing: an answer whose calls do not all read is content, whole.

#include <cctype>
#include <string_view>

#include <nlohmann/json.hpp>

#include "actors/text_stream.hpp"
#include "deploy/openai.hpp"

namespace baton::deploy::openai {

using gpu::tool_call_format;
using nlohmann::ordered_json;

namespace {

constexpr auto npos = std::string_view::npos;
// Hermes (Qwen2.5, Qwen3): <tool_call>{...}</tool_call> per call.
constexpr std::string_view hermes_begin = "<tool_call>";
constexpr std::string_view hermes_end = "</tool_call>";
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

bool space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

size_t skip_space(std::string_view s, size_t at) {
  while (at < s.size() && space(s[at])) ++at;
  return at;
}

std::string_view trimmed_view(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && space(s[b])) ++b;
  while (e > b && space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

std::string trimmed(std::string_view s) { return std::string{trimmed_view(s)}; }

bool starts_with(std::string_view s, size_t at, std::string_view prefix) { return s.substr(at, prefix.size()) == prefix; }

/// One past the end of the JSON object or array that starts at `at`, brackets and strings matched
/// (the parser checks the rest), or npos where it does not end (an answer cut by max_tokens).
size_t json_extent(std::string_view s, size_t at) {
  if (at >= s.size() || (s[at] != '{' && s[at] != '[')) return npos;
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = at; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if ((c == '}' || c == ']') && --depth == 0) {
      return i + 1;
    }
  }
  return npos;
}

/// A call's JSON, or a discarded value where it is not JSON or nests deeper than a request body
/// may (max_json_depth): a model writing ten thousand brackets must not make the reader (or the
/// answer's JSON writer) recurse that deep.
ordered_json parse_json(std::string_view text) {
  if (nested_too_deep(text)) return ordered_json(ordered_json::value_t::discarded);
  return ordered_json::parse(text, nullptr, false);
}

/// OpenAI's arguments: JSON text of the object (a string the model wrote stays as it is; none
/// is `{}`). False for anything that is not an object or a string.
bool arguments_text(const ordered_json& args, std::string* out) {
  if (args.is_null()) return *out = "{}", true;
  if (args.is_string()) return *out = args.get<std::string>(), true;
  if (!args.is_object()) return false;
  *out = args.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  return true;
}

/// A call written as one JSON object: its "name", and its "arguments" (or Llama's "parameters"),
/// which `need_args` requires (a Llama answer that is JSON with a "name" alone is an answer).
bool add_object_call(const ordered_json& body, answer_parts* out, bool need_args = false) {
  if (!body.is_object() || !body.contains("name") || !body["name"].is_string()) return false;
  const char* key = body.contains("arguments") ? "arguments" : body.contains("parameters") ? "parameters" : nullptr;
  if (!key && need_args) return false;
  std::string text;
  if (!arguments_text(key ? body[key] : ordered_json{}, &text)) return false;
  out->tool_calls.push_back({body["name"].get<std::string>(), std::move(text)});
  return true;
}

/// A call given as a name and its arguments' JSON text.
bool add_named_call(std::string name, std::string_view args, answer_parts* out) {
  if (name.empty()) return false;
  const auto body = trimmed(args);
  const auto parsed = body.empty() ? ordered_json{} : parse_json(body);
  std::string text;
  if (parsed.is_discarded() || !arguments_text(parsed, &text) || parsed.is_string()) return false;
  out->tool_calls.push_back({std::move(name), std::move(text)});
  return true;
}

answer_parts whole(const std::string& content) {
  answer_parts out;
  out.content = content;
  return out;
}

/// `before`, right-trimmed, then the text the calls left (between and after them) on a line of
/// its own: nothing the model wrote is dropped.
void join_content(std::string_view before, const std::string& rest, answer_parts* out) {
  std::string c{before};
  while (!c.empty() && space(c.back())) c.pop_back();
  if (!rest.empty()) c += (c.empty() ? "" : "\n") + rest;
  out->content = std::move(c);
}

void append_line(std::string* rest, const std::string& text) {
  if (!text.empty()) *rest += (rest->empty() ? "" : "\n") + text;
}

answer_parts read_hermes(const std::string& content) {
  const std::string_view s = content;
  const size_t first = s.find(hermes_begin);
  if (first == npos) return whole(content);
  answer_parts out;
  std::string rest;
  size_t at = first;
  while (at != npos) {
    const size_t from = at + hermes_begin.size();
    const size_t end = s.find(hermes_end, from);
    // A call cut off by max_tokens has no end tag: it is read to the answer's end.
    const auto body = parse_json(s.substr(from, end == npos ? npos : end - from));
    if (!add_object_call(body, &out)) return whole(content);
    if (end == npos) break;
    const size_t after = end + hermes_end.size();
    at = s.find(hermes_begin, after);
    append_line(&rest, trimmed(s.substr(after, at == npos ? npos : at - after)));
  }
  join_content(s.substr(0, first), rest, &out);
  return out;
}

answer_parts read_llama(const std::string& content) {
  const std::string_view s = content;
  size_t at = skip_space(s, 0);
  if (starts_with(s, at, python_tag)) at = skip_space(s, at + python_tag.size());
  if (at >= s.size() || s[at] != '{') return whole(content);
  answer_parts out;
  while (at < s.size() && s[at] == '{') {  // calls, `;` between them
    const size_t end = json_extent(s, at);
    if (end == npos || !add_object_call(parse_json(s.substr(at, end - at)), &out, /*need_args*/ true))
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
      const auto list = end == npos ? ordered_json{} : parse_json(s.substr(at, end - at));
      if (!list.is_array() || list.empty()) return whole(content);
      for (const auto& c : list)
        if (!add_object_call(c, &out)) return whole(content);
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

/// One call of a sectioned form from its head and arguments.
bool add_sectioned_call(tool_call_format f, std::string_view head, std::string_view right, answer_parts* out) {
  if (f == tool_call_format::kimi) {  // the head is the call's id: functions.name:index, or name:index
    const size_t colon = head.rfind(':');
    std::string_view name = trimmed_view(head.substr(0, colon));
    if (const size_t dot = name.rfind('.'); dot != npos) name = name.substr(dot + 1);
    return add_named_call(std::string{name}, right, out);
  }
  if (head == "function") {  // DeepSeek V3, R1: the name on its own line, then a ```json block
    const size_t line = right.find('\n');
    if (line == npos) return false;
    std::string_view args = right.substr(line + 1);
    const size_t open = args.find("```json");
    const size_t close = open == npos ? npos : args.find("```", open + 7);
    if (open != npos) args = args.substr(open + 7, close == npos ? npos : close - open - 7);
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

/// The text that starts a call in a marked format (Llama's have none).
std::string_view call_marker(tool_call_format f) {
  switch (f) {
    case tool_call_format::hermes: return hermes_begin;
    case tool_call_format::mistral: return mistral_calls;
    case tool_call_format::deepseek: return deepseek_form.section_begin;
    case tool_call_format::kimi: return kimi_form.section_begin;
    default: return {};
  }
}

}  // namespace

answer_parts read_tool_calls(const std::string& content, tool_call_format format) {
  switch (format) {
    case tool_call_format::hermes: return read_hermes(content);
    case tool_call_format::llama_json: return read_llama(content);
    case tool_call_format::mistral: return read_mistral(content);
    case tool_call_format::deepseek: return read_sectioned(content, format, deepseek_form);
    case tool_call_format::kimi: return read_sectioned(content, format, kimi_form);
    case tool_call_format::none: break;
  }
  return whole(content);
}

answer_parts tool_call_splitter::feed(const std::string& content, bool last) {
  answer_parts out;
  held_ += content;
  if (plain_) {
    out.content = std::move(held_);
    held_.clear();
    return out;
  }
  if (!calling_ && format_ == tool_call_format::llama_json) {
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
    const auto marker = call_marker(format_);
    if (const auto at = held_.find(marker); !marker.empty() && at != std::string::npos) {
      out.content = held_.substr(0, at);
      held_.erase(0, at);
      calling_ = true;
    } else {
      const size_t shown = last || marker.empty() ? held_.size() : streamable_prefix(held_, {std::string{marker}});
      out.content = held_.substr(0, shown);
      held_.erase(0, shown);
      shown_ |= !out.content.empty();
      return out;
    }
  }
  shown_ |= !out.content.empty();
  if (!last) return out;
  auto calls = read_tool_calls(held_, format_);
  held_.clear();
  if (calls.tool_calls.empty()) {
    out.content += calls.content;  // no calls after all: the held text is content
  } else {
    // The content before the first call already went out; what the calls leave (text between
    // and after them) follows it now.
    out.tool_calls = std::move(calls.tool_calls);
    if (!calls.content.empty()) out.content += (shown_ ? "\n" : "") + calls.content;
  }
  return out;
}

}  // namespace baton::deploy::openai

#pragma once

// The tool-call forms' markers and the pieces their two readers share: the whole answer's
// (openai_tool_calls.cpp, openai_tool_calls_xml.cpp) and the stream's (tool_call_splitter,
// openai_tool_call_stream.cpp). Internal: openai.hpp's users need none of it.

#include <cctype>
#include <optional>
#include <string>
#include <string_view>

#include "deploy/openai.hpp"
#include "deploy/openai_tool_calls_xml.hpp"

namespace baton::deploy::openai {

inline constexpr auto npos = std::string_view::npos;
// Hermes (Qwen2.5, Qwen3): <tool_call>{...}</tool_call> per call (Qwen3-Coder's XML calls too).
inline constexpr std::string_view hermes_begin = xml_call_begin;
inline constexpr std::string_view hermes_end = xml_call_end;
// Llama 3.1: the answer is the call's JSON, after <|python_tag|> when the model writes one.
inline constexpr std::string_view python_tag = "<|python_tag|>";
// Mistral: [TOOL_CALLS] then a JSON list (v0.3), or name[ARGS]{...} per call (newer tokenizers,
// with [CALL_ID]id before [ARGS] in some).
inline constexpr std::string_view mistral_calls = "[TOOL_CALLS]";
inline constexpr std::string_view mistral_args = "[ARGS]";
inline constexpr std::string_view mistral_call_id = "[CALL_ID]";
/// Forms whose calls sit in a section of marker tokens, each call being <call_begin>, a head,
/// <sep>, the arguments, <call_end>.
struct sectioned_form {
  std::string_view section_begin, section_end, call_begin, call_end, sep;
};
// DeepSeek: <｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>
// (V3, R1) or <｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜> (V3.1).
inline constexpr sectioned_form deepseek_form{"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                              "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"};
// Kimi-K2: <|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>.
inline constexpr sectioned_form kimi_form{"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                          "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"};

inline size_t skip_space(std::string_view s, size_t at) {
  while (at < s.size() && json_space(s[at])) ++at;
  return at;
}
inline std::string trimmed(std::string_view s) { return std::string{trimmed_view(s)}; }
inline bool starts_with(std::string_view s, size_t at, std::string_view prefix) {
  return s.substr(at, prefix.size()) == prefix;
}
inline bool name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
}
inline bool arguments_key(std::string_view key) { return key == "arguments" || key == "parameters"; }

/// An answer read as content alone.
inline answer_parts whole(const std::string& content) {
  answer_parts out;
  out.content = content;
  return out;
}

/// One past the end of the JSON value that starts at `at` (any kind), or npos where the text ends
/// first: a number at the very end may still go on.
size_t value_extent(std::string_view s, size_t at);
/// A JSON string token's text, decoded; nullopt where it is not one.
std::optional<std::string> string_token(std::string_view token);
/// A Kimi call's name from its head, the call's id: functions.name:index, or name:index.
std::string_view kimi_name(std::string_view head);
/// A Kimi call's head as its id, where it has the id's form (NAME:N, no spaces); else empty.
std::string kimi_id(std::string_view head);

/// `before`, right-trimmed, then the text the calls left on a line of its own; and a line added
/// to that text.
void join_content(std::string_view before, const std::string& rest, answer_parts* out);
void append_line(std::string* rest, const std::string& text);

/// A whole answer whose reader met, at `at`, a call of a function the request did not declare:
/// the calls read before it stand, and the text from it on is content after `rest` (the text
/// among those calls), as a stream that sent them ends -- it stops at that call's name. With no
/// call before it, the answer is content, whole. `first`: where the calls began.
answer_parts stop_at_undeclared(std::string_view s, size_t first, std::string rest, size_t at, answer_parts out);

}  // namespace baton::deploy::openai

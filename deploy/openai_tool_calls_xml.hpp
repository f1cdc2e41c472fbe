#pragma once

// Qwen3-Coder's XML tool calls (gpu::tool_call_format::qwen3_xml), shared by the whole reader
// (openai_tool_calls_xml.cpp), the stream (tool_call_splitter, openai_tool_calls.cpp) and the
// request reader that types their values (openai_request.cpp). Internal: openai.hpp's users need
// none of it.
//
//   <tool_call>
//   <function=get_weather>
//   <parameter=city>
//   Paris
//   </parameter>
//   </function>
//   </tool_call>
//
// Read leniently, as vLLM's qwen3_coder parser reads it, by rules a stream can apply as the text
// grows (so that whole and streamed reads always agree):
// - the calls begin at the first <tool_call> or <function=, whichever comes first; the text
//   before is the content;
// - from there on, every <function=NAME> tag outside a call's body is a call, in a <tool_call>
//   block or not, two in one block too; a <function= that is no tag ('<' or a line break before
//   its '>', none yet at the answer's end, an empty name) is text;
// - a call's body ends at its first </function>, or at the answer's end (cut by max_tokens: the
//   call is read with the parameters written so far);
// - in the body, each <parameter=NAME> tag starts a value, which ends at the first </parameter>
//   or the next <parameter=; any other text in the body (between parameters, before them, after
//   a value that quoted </parameter>, a parameter tag that is no tag) is passed over. A call
//   always has arguments: a JSON object, maybe empty;
// - text among the calls (outside every call's body) is content, the <tool_call> and
//   </tool_call> markers in it dropped.
// The differences from vLLM a client would see are listed in openai_tool_calls_xml.cpp.

#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "deploy/openai.hpp"

namespace baton::deploy::openai {

/// Whether `name` is one of the request's functions (`tools` null: no list to hold calls to).
/// OpenAI answers calls only of the tools it was given: an answer that calls another is content.
inline bool declared(const tool_parameter_kinds* tools, std::string_view name) {
  return !tools || tools->find(name) != tools->end();
}

/// JSON's whitespace, which both tool call readers pass over between tokens and trim from values.
inline bool json_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }
inline std::string_view trimmed_view(std::string_view s) {
  while (!s.empty() && json_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && json_space(s.back())) s.remove_suffix(1);
  return s;
}

inline constexpr std::string_view xml_call_begin = "<tool_call>";
inline constexpr std::string_view xml_call_end = "</tool_call>";
inline constexpr std::string_view xml_function_begin = "<function=";
inline constexpr std::string_view xml_function_end = "</function>";
inline constexpr std::string_view xml_parameter_begin = "<parameter=";
inline constexpr std::string_view xml_parameter_end = "</parameter>";

/// The name of a <function=NAME> or <parameter=NAME> tag, which starts at `at` (just past the
/// '='): the text up to its '>', trimmed. A line break or '<' before the '>', or an empty name,
/// makes it no tag (`name` empty); `more` where the text ends first (a stream waits; read whole,
/// it is no tag). `scanned`: the text from `at` up to there is known to hold none of '>', '<' or
/// a line break (a stream's last look, which found `more`): the look goes on from there, so a
/// long tag streamed byte by byte is read once.
struct xml_tag_name {
  std::string name;
  size_t close = std::string_view::npos;  ///< the '>'
  bool more = false;
};
xml_tag_name read_xml_tag_name(std::string_view s, size_t at, size_t scanned = 0);

/// A call's arguments as JSON text (an object, `{}` where there are no parameters), from its
/// parameters: `body` is the text between <function=NAME> and </function> (or the answer's end),
/// each value typed by the tool `name`'s schema in `parameters` (may be null: every value is then
/// text). Text in the body that is no parameter is passed over.
std::string xml_call_arguments(std::string_view name, std::string_view body, const tool_parameter_kinds* parameters);

/// A whole answer's calls, read by the rules above; the content is the text before the first
/// call's marker (right-trimmed), then the text among the calls, a line per piece. No call (no
/// <function=NAME> tag after the first marker): the answer is content, whole.
answer_parts read_qwen3_xml(const std::string& content, const tool_parameter_kinds* parameters);

/// The request's `tools` (parse_tools checked each is {type: "function", function: {name, ...}}),
/// as the parameter types a Qwen3-Coder call's values are read by.
tool_parameter_kinds tool_parameter_kinds_of(const nlohmann::json& tools);

}  // namespace baton::deploy::openai

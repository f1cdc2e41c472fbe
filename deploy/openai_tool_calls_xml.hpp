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

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "deploy/openai.hpp"

namespace baton::deploy::openai {

inline constexpr std::string_view xml_call_begin = "<tool_call>";
inline constexpr std::string_view xml_call_end = "</tool_call>";
inline constexpr std::string_view xml_function_begin = "<function=";
inline constexpr std::string_view xml_function_end = "</function>";
inline constexpr std::string_view xml_parameter_begin = "<parameter=";
inline constexpr std::string_view xml_parameter_end = "</parameter>";

/// The name of a <function=NAME> or <parameter=NAME> tag, which starts at `at` (just past the
/// '='): the text up to its '>', trimmed. A line break or '<' before the '>', or an empty name,
/// makes it no tag (`name` empty); `more` where the text ends first (a stream waits).
struct xml_tag_name {
  std::string name;
  size_t close = std::string_view::npos;  ///< the '>'
  bool more = false;
};
xml_tag_name read_xml_tag_name(std::string_view s, size_t at);

/// A call's arguments as JSON text, from its parameters: `body` is the text between
/// <function=NAME> and </function>, each value typed by the tool `name`'s schema in `parameters`
/// (may be null: every value is then text). nullopt where the body holds anything but parameters.
std::optional<std::string> xml_call_arguments(std::string_view name, std::string_view body,
                                              const tool_parameter_kinds* parameters);

/// A whole answer's calls, each <tool_call><function=NAME>...</function></tool_call> one call
/// (</tool_call> may be missing at the answer's end: cut by max_tokens); read_tool_calls' rules.
answer_parts read_qwen3_xml(const std::string& content, const tool_parameter_kinds* parameters);

/// The request's `tools` (parse_tools checked each is {type: "function", function: {name, ...}}),
/// as the parameter types a Qwen3-Coder call's values are read by.
tool_parameter_kinds tool_parameter_kinds_of(const nlohmann::json& tools);

/// openai_tool_calls.cpp's: `before`, right-trimmed, then the text the calls left on a line of
/// its own; and a line added to that text.
void join_content(std::string_view before, const std::string& rest, answer_parts* out);
void append_line(std::string* rest, const std::string& text);

}  // namespace baton::deploy::openai

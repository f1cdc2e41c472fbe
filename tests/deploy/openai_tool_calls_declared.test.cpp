// A call of a function the request did not declare, in every tool-call form: OpenAI's API answers
// calls only of the tools it was given. Read whole or streamed in pieces of any size, the answer
// is the same: the calls before it stand (a stream has sent them), and the text from it on is
// content; with no call before it, the answer is content, whole.

#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "deploy/openai.hpp"

using namespace baton;
using gpu::tool_call_format;

namespace {

using calls = std::vector<std::pair<std::string, std::string>>;

struct read_answer {
  std::string content;
  calls got;
};

/// The answer read as the gateway reads it, in pieces of `step` bytes.
read_answer streamed(tool_call_format f, const std::shared_ptr<const deploy::openai::tool_parameter_kinds>& tools,
                     const std::string& text, size_t step) {
  deploy::openai::tool_call_splitter s{f, tools};
  read_answer out;
  for (size_t at = 0; at < text.size(); at += step) {
    const auto part = s.feed(text.substr(at, step), at + step >= text.size());
    out.content += part.content;
    for (const auto& c : part.tool_calls) {
      if (c.first) out.got.emplace_back(c.name, "");
      REQUIRE(c.index + 1 == out.got.size());
      out.got.back().second += c.arguments;
    }
  }
  return out;
}

}  // namespace

TEST_CASE("a call of a function the request did not declare ends the calls, in every form, whole and streamed "
          "alike: the calls before it stand, the text from it on is content") {
  const auto tools = std::make_shared<const deploy::openai::tool_parameter_kinds>(
      deploy::openai::tool_parameter_kinds{{"get_weather", {}}, {"f", {}}});
  const std::string ds_begin = "<｜tool▁calls▁begin｜>", ds_end = "<｜tool▁calls▁end｜>", ds_call = "<｜tool▁call▁begin｜>",
                    ds_call_end = "<｜tool▁call▁end｜>", ds_sep = "<｜tool▁sep｜>";
  struct example {
    tool_call_format format;
    std::string text;
    std::string content;  ///< "=": the text itself
    calls want;
  };
  const std::string rm = R"({"name": "rm_rf", "arguments": {"path": "/"}})";
  const std::vector<example> examples = {
      {tool_call_format::hermes,
       "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\nthen\n"
       "<tool_call>\n" + rm + "\n</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
       "Let me check.\nthen\n<tool_call>\n" + rm + "\n</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
       {{"get_weather", R"({"city": "Paris"})"}}},
      {tool_call_format::hermes, "Sure. <tool_call>" + rm + "</tool_call>", "=", {}},  // the first: content, whole
      {tool_call_format::llama_json, R"({"name": "f", "parameters": {"x": 1}}; )" + rm, rm, {{"f", R"({"x": 1})"}}},
      {tool_call_format::llama_json, rm, "=", {}},
      {tool_call_format::mistral, "[TOOL_CALLS]f[ARGS]{\"x\": 1}[TOOL_CALLS]rm_rf[ARGS]{}", "[TOOL_CALLS]rm_rf[ARGS]{}",
       {{"f", R"({"x": 1})"}}},
      {tool_call_format::mistral, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}, " + rm + "]", rm + "]", {{"f", "{}"}}},
      {tool_call_format::mistral, "[TOOL_CALLS][" + rm + "]", "=", {}},
      {tool_call_format::deepseek,
       "Checking." + ds_begin + ds_call + "f" + ds_sep + "{\"x\": 1}" + ds_call_end + ds_call + "rm_rf" + ds_sep + "{}" +
           ds_call_end + ds_end,
       "Checking.\n" + ds_call + "rm_rf" + ds_sep + "{}" + ds_call_end + ds_end, {{"f", R"({"x": 1})"}}},
      {tool_call_format::kimi,
       "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}"
       "<|tool_call_end|><|tool_call_begin|>functions.rm_rf:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
       "<|tool_calls_section_end|>",
       "<|tool_call_begin|>functions.rm_rf:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
       {{"get_weather", "{}"}}},
      {tool_call_format::qwen3_xml,
       "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
       "<function=rm_rf>\n</function>\n</tool_call>",
       "<function=rm_rf>\n</function>\n</tool_call>", {{"f", R"({"x":"1"})"}}},
  };
  for (const auto& ex : examples) {
    CAPTURE(ex.text);
    const auto whole = deploy::openai::read_tool_calls(ex.text, ex.format, tools.get());
    CHECK(whole.content == (ex.content == "=" ? ex.text : ex.content));
    calls got;
    for (const auto& c : whole.tool_calls) got.emplace_back(c.name, c.arguments);
    CHECK(got == ex.want);
    // The gateway reads a whole answer as one piece (its content keeps the text before the calls
    // as written, then the rest on a line of its own), a stream in pieces: the same answer.
    const auto one = streamed(ex.format, tools, ex.text, ex.text.size());
    CHECK(one.got == ex.want);
    for (size_t step : {1, 2, 3, 7, 16}) {
      CAPTURE(step);
      const auto s = streamed(ex.format, tools, ex.text, step);
      CHECK(s.content == one.content);
      CHECK(s.got == ex.want);
    }
    // Without a list of tools (a forced call's reading, say), every function's call is a call.
    CHECK(deploy::openai::read_tool_calls(ex.text, ex.format).tool_calls.size() > ex.want.size());
  }
}

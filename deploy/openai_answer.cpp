// Reading a chat answer as it streams: its reasoning (before </think>), its content, and the
// tool calls it makes (those read in openai_tool_calls.cpp). Pure: the gateway's per-choice state.

#include "actors/text_stream.hpp"
#include "deploy/openai.hpp"

#include <algorithm>

namespace baton::deploy::openai {

namespace {
constexpr std::string_view think_begin = "<think>";
constexpr std::string_view think_end = "</think>";
}  // namespace

reasoning_splitter::parts reasoning_splitter::feed(const std::string& text, bool last) {
  parts out;
  if (closed_) {
    out.content = text;
    return out;
  }
  std::string pending = std::move(held_) + text;
  held_.clear();
  if (undecided_) {  // does the answer open <think> itself?
    const size_t start = pending.find_first_not_of(" \t\r\n");
    const std::string_view rest = start == std::string::npos ? std::string_view{} : std::string_view{pending}.substr(start);
    if (rest.size() < think_begin.size() && think_begin.substr(0, rest.size()) == rest && !last) {
      held_ = std::move(pending);  // whitespace, or the start of <think>: not known yet
      return out;
    }
    undecided_ = false;
    if (rest.substr(0, think_begin.size()) != think_begin) {  // no thinking: all of it is content
      closed_ = true;
      out.content = std::move(pending);
      return out;
    }
    pending.erase(0, start + think_begin.size());
  }
  if (const auto end = pending.find(think_end); end != std::string::npos) {
    closed_ = true;
    out.reasoning = pending.substr(0, end);
    out.content = pending.substr(end + think_end.size());
    return out;
  }
  // Hold back the longest tail that </think> starts with, as a stop string's (none at the end).
  const size_t shown = last ? pending.size() : streamable_prefix(pending, {std::string{think_end}});
  held_ = pending.substr(shown);
  pending.resize(shown);
  out.reasoning = std::move(pending);
  return out;
}

reasoning_splitter::parts split_reasoning(const std::string& text, bool opened) {
  return reasoning_splitter{opened}.feed(text, true);
}

answer_parts answer_reader::feed(const std::string& text, bool last) {
  auto out = read(text, last);
  if (one_call_)  // the first call only, whole or in pieces
    std::erase_if(out.tool_calls, [](const tool_call& c) { return c.index > 0; });
  return out;
}

answer_parts answer_reader::read(const std::string& text, bool last) {
  answer_parts out;
  if (reasoning_) {
    out = thinking_.feed(text, last);
  } else if (forced_ && prompt_thinking_) {
    // A forced call after a thinking block, shown as generated: the thinking, its </think> and
    // the blank lines after it are content; the JSON the grammar asked for is still the call.
    out = thinking_.feed(text, last);
    std::string shown = std::move(out.reasoning);
    if (thinking_.closed() && !think_closed_) {
      shown += "</think>";
      think_closed_ = true;
    }
    if (think_closed_ && !forced_started_) {  // blanks between </think> and the JSON
      const size_t json = std::min(out.content.find_first_not_of(" \t\r\n"), out.content.size());
      shown += out.content.substr(0, json);
      out.content.erase(0, json);
      forced_started_ = !out.content.empty();
    }
    auto told = calls_.feed(out.content, last);
    told.content.insert(0, shown);
    return told;
  } else {
    out.content = text;
  }
  if (tools_ || forced_) {  // a forced answer is JSON to the end: its calls stream as they are read
    auto told = calls_.feed(out.content, last);
    out.content = std::move(told.content);
    out.tool_calls = std::move(told.tool_calls);
    out.called = told.called;
    out.cut = told.cut;
  }
  return out;
}

}  // namespace baton::deploy::openai

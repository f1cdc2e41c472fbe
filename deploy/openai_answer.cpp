// Reading a chat answer as it streams: its reasoning (before </think>), its content, and the
// tool calls it makes (Hermes' <tool_call> JSON). Pure: the gateway's per-choice state.

#include <cctype>

#include <nlohmann/json.hpp>

#include "actors/text_stream.hpp"
#include "deploy/openai.hpp"

namespace baton::deploy::openai {

using nlohmann::ordered_json;

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

namespace {
constexpr std::string_view call_begin = "<tool_call>";
constexpr std::string_view call_end = "</tool_call>";
}  // namespace

answer_parts read_tool_calls(const std::string& content) {
  answer_parts out;
  const size_t first = content.find(call_begin);
  if (first == std::string::npos) {
    out.content = content;
    return out;
  }
  // Text between and after the calls (rarely more than whitespace) joins the content: nothing
  // the model wrote is dropped.
  const auto trimmed = [](std::string s) {
    const auto b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return std::string{};
    return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
  };
  std::string rest;
  size_t at = first;
  while (at != std::string::npos) {
    const size_t from = at + call_begin.size();
    const size_t end = content.find(call_end, from);
    // A call cut off by max_tokens has no end: it is read to the answer's end.
    const auto body = ordered_json::parse(content.substr(from, end == std::string::npos ? std::string::npos : end - from),
                                          nullptr, false);
    if (!body.is_object() || !body.contains("name") || !body["name"].is_string()) {
      out.tool_calls.clear();  // not a call after all: the answer is content, whole
      out.content = content;
      return out;
    }
    const auto args = body.contains("arguments") ? body["arguments"] : ordered_json::object();
    out.tool_calls.push_back({body["name"].get<std::string>(),
                              args.is_string() ? args.get<std::string>() : args.dump(-1, ' ', false, ordered_json::error_handler_t::replace)});
    if (end == std::string::npos) break;
    const size_t after = end + call_end.size();
    at = content.find(call_begin, after);
    const auto between = trimmed(content.substr(after, at == std::string::npos ? std::string::npos : at - after));
    if (!between.empty()) rest += (rest.empty() ? "" : "\n") + between;
  }
  out.content = content.substr(0, first);
  while (!out.content.empty() && std::isspace(static_cast<unsigned char>(out.content.back()))) out.content.pop_back();
  if (!rest.empty()) out.content += (out.content.empty() ? "" : "\n") + rest;
  return out;
}

answer_parts tool_call_splitter::feed(const std::string& content, bool last) {
  answer_parts out;
  held_ += content;
  if (!calling_) {
    if (const auto at = held_.find(call_begin); at != std::string::npos) {
      out.content = held_.substr(0, at);
      held_.erase(0, at);
      calling_ = true;
    } else {
      const size_t shown = last ? held_.size() : streamable_prefix(held_, {std::string{call_begin}});
      out.content = held_.substr(0, shown);
      held_.erase(0, shown);
      return out;
    }
  }
  if (!last) return out;
  auto calls = read_tool_calls(held_);
  held_.clear();
  if (calls.tool_calls.empty()) {
    out.content += calls.content;  // no calls after all: the held text is content
  } else {
    // The content before the first call already went out; what the calls leave (text between
    // and after them) follows it now.
    out.tool_calls = std::move(calls.tool_calls);
    if (!calls.content.empty()) out.content += "\n" + calls.content;
  }
  return out;
}

answer_parts answer_reader::feed(const std::string& text, bool last) {
  answer_parts out;
  if (reasoning_) out = thinking_.feed(text, last);
  else out.content = text;
  if (tools_) {
    auto told = calls_.feed(out.content, last);
    out.content = std::move(told.content);
    out.tool_calls = std::move(told.tool_calls);
  }
  return out;
}

}  // namespace baton::deploy::openai

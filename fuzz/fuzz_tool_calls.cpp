// A model's chat answer, read for its reasoning and tool calls as the gateway reads it
// (answer_reader): any bytes, in every tool-call form and as a forced tool_choice's JSON. Beyond
// not crashing, the answer read in one piece and the same answer streamed in pieces of 1-16 bytes
// must tell apart the same reasoning and content, and where the whole answer reads as calls, the
// streamed pieces must join to exactly those calls: a stream sends a call's arguments before the
// call ends, so it must never send what the whole answer then reads otherwise. (Where the whole
// answer is content, a stream may have sent calls it cannot take back; its content is then the
// same text, so nothing is lost.)
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "deploy/openai.hpp"

namespace {

struct told {
  std::string reasoning, content;
  std::vector<std::string> calls;  ///< name, then arguments, per call
};

told read(const baton::deploy::openai::call& c, uint8_t thinking, const std::string& text, size_t step) {
  baton::deploy::openai::answer_reader r{c, thinking};
  told out;
  size_t at = 0;
  do {
    const auto piece = text.substr(at, step);
    at += step;
    auto parts = r.feed(piece, at >= text.size());
    out.reasoning += parts.reasoning;
    out.content += parts.content;
    for (auto& t : parts.tool_calls) {  // a call's pieces, joined: the first names it
      if (t.first) {
        if (t.index * 2 != out.calls.size()) __builtin_trap();
        out.calls.push_back(std::move(t.name));
        out.calls.push_back(std::move(t.arguments));
      } else {
        if (t.index * 2 + 2 != out.calls.size()) __builtin_trap();
        out.calls.back() += t.arguments;
      }
    }
  } while (at < text.size());
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  baton::deploy::openai::call c;
  c.chat = true;
  const unsigned form = (data[0] & 0x0f) % (baton::gpu::max_tool_call_format + 3);
  if (form <= baton::gpu::max_tool_call_format) c.tool_calls = static_cast<baton::gpu::tool_call_format>(form);
  else if (form == baton::gpu::max_tool_call_format + 1) c.forced_tool = "f";  // tool_choice naming a function
  else c.forced_calls = true;                                                 // tool_choice required
  // Qwen3-Coder's XML values typed as a request's tools type them (f's a: integer, b: number, c:
  // boolean, d: JSON; the other forms ignore it).
  using baton::deploy::openai::parameter_kind;
  static const auto typed = std::make_shared<const baton::deploy::openai::tool_parameter_kinds>(
      baton::deploy::openai::tool_parameter_kinds{{"f",
                                                   {{"a", parameter_kind::integer},
                                                    {"b", parameter_kind::number},
                                                    {"c", parameter_kind::boolean},
                                                    {"d", parameter_kind::json}}}});
  c.tool_parameters = typed;
  c.separate_reasoning = data[0] & 0x10;
  const uint8_t thinking = data[0] & 0x20 ? 1 : 2;  // the router's word: the prompt opened <think> or not
  const size_t step = 1 + data[1] % 16;
  const std::string text(reinterpret_cast<const char*>(data) + 2, size - 2);
  const auto whole = read(c, thinking, text, text.size() + 1);
  const auto streamed = read(c, thinking, text, step);
  if (whole.reasoning != streamed.reasoning || whole.content != streamed.content) __builtin_trap();
  if (!whole.calls.empty() && whole.calls != streamed.calls) __builtin_trap();
  return 0;
}

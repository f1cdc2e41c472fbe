#pragma once

// How a model writes the tool calls its chat template asks for: told from the template when the
// model loads (gpu/tokenizer.cpp), and how the gateway reads answers for calls
// (deploy/openai_tool_calls.cpp). A header of its own so that the gateway's pure JSON code needs no
// tokenizer.

#include <cstdint>

namespace baton::gpu {

enum class tool_call_format : uint8_t {
  none,        ///< the template shows no tools Baton can read calls of
  hermes,      ///< <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5, Qwen3, Hermes)
  llama_json,  ///< the answer is {"name": ..., "parameters": {...}} (Llama 3.1-3.3), `;` between calls
  mistral,     ///< [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or [TOOL_CALLS]name[ARGS]{...}
  deepseek,    ///< <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁sep｜>...<｜tool▁call▁end｜> (V3, R1, V3.1)
  kimi,        ///< <|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...} (Kimi-K2)
  qwen3_xml,   ///< <tool_call><function=name><parameter=k>value</parameter></function></tool_call> (Qwen3-Coder)
};
/// The largest value: a cluster's answer carries the format as a number.
inline constexpr uint8_t max_tool_call_format = static_cast<uint8_t>(tool_call_format::qwen3_xml);

}  // namespace baton::gpu

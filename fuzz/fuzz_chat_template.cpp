// Chat templates: arbitrary text must compile or be refused with a reason, and whatever compiles
// must render a conversation (with tools) or fail with a reason -- within the engine's bounds on
// nesting, loop iterations and text, never a crash, a hang or unbounded memory.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "gpu/chat_template.hpp"

namespace {
nlohmann::ordered_json context;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  context = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>"},
                 {"role": "assistant", "content": "<think>x</think>Hello.", "tool_calls": [{"type": "function",
                  "function": {"name": "f", "arguments": {"a": [1, 2.5, null, true]}}}]},
                 {"role": "tool", "content": "42"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  std::string why, out;
  auto t = baton::gpu::chat_template::compile(source, &why);
  if (!t) {
    if (why.empty()) __builtin_trap();  // a refusal always says why
    return 0;
  }
  if (!t->render(context, &out, &why) && why.empty()) __builtin_trap();
  return 0;
}

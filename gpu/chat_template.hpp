#pragma once

// A Hugging Face chat template -- the Jinja2 text in tokenizer_config.json's `chat_template` --
// compiled once and rendered as transformers' apply_chat_template renders it: trim_blocks and
// lstrip_blocks on, break/continue, `{% generation %}` blocks, raise_exception() and
// strftime_now(), and a tojson that writes Python's json.dumps (", " and ": ", UTF-8 as is).
//
// It is the subset of Jinja that chat templates use: text, {{ }}, {# #} and whitespace control;
// if/elif/else, for (tuple targets, a filter condition, loop.*, else), set (names, namespace
// attributes, set blocks), macros with defaults; Python's literals, operators, `x if c else y`,
// slices, tests (defined, none, string, mapping, ...), the common filters (length, trim, tojson,
// default, join, map, selectattr, ...) and the string and dict methods templates call (strip,
// split, startswith, items, get, ...). Anything else is refused when the template is compiled,
// naming the construct and its line, so a model whose template Baton cannot run says so at
// startup instead of rendering a prompt the model was not trained on.
//
// Conformance: tests/gpu/chat_template_engine.test.cpp renders tests/data/chat_templates against
// the text Jinja2 itself rendered (tests/data/chat_templates/render.py regenerates it).

#include <memory>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace baton::gpu {

class chat_template {
public:
  ~chat_template();
  chat_template(const chat_template&) = delete;
  chat_template& operator=(const chat_template&) = delete;

  /// nullptr and a sentence naming the line and what is wrong or not supported.
  static std::unique_ptr<chat_template> compile(const std::string& source, std::string* why);

  /// Renders with `context`'s keys as the template's variables (messages, add_generation_prompt,
  /// bos_token, eos_token, tools, ...). False and a sentence when the template raises (its own
  /// message, e.g. "Conversation roles must alternate") or an expression fails (naming its line).
  /// Ordered JSON: Python's dicts keep their keys' order, and tojson shows it.
  bool render(const nlohmann::ordered_json& context, std::string* out, std::string* why) const;

  struct program;

private:
  explicit chat_template(std::unique_ptr<program> p);
  std::unique_ptr<program> p_;
};

}  // namespace baton::gpu

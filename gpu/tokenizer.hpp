#pragma once

// What the router needs from a model's tokenizer: prompt text to ids (with the model's leading
// special tokens), ids back to text, and chat messages rendered through the model's chat
// template. Two implementations: the built-in byte tokenizer, and a Hugging Face tokenizer.json
// (byte-level BPE) with the chat template its directory names.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/model_config.hpp"
#include "gpu/tool_call_format.hpp"

namespace baton::gpu {

class token_vocabulary;  // gpu/grammar.hpp

struct chat_message {
  std::string role;  ///< system | user | assistant | tool
  std::string content;
  std::string fields_json{};  ///< more of the turn for the template, a JSON object's text (tool_calls, tool_call_id)
};

/// What a chat request gives its template besides the messages.
struct chat_extras {
  std::string variables_json;  ///< more variables, a JSON object's text (vLLM's chat_template_kwargs)
  std::string tools_json;      ///< `tools`, a JSON array's text (empty: none)
};

/// How a model's chat answers carry their reasoning (tokenizer::reasoning), told by its template.
enum class chat_reasoning : uint8_t {
  none,         ///< the template has no <think>
  opened,       ///< its generation prompt ends inside <think> (DeepSeek-R1, QwQ): answers start thinking
  model_opens,  ///< it knows <think> but leaves opening it to the model (Qwen3): an answer that starts <think> thinks
};

/// Whether a rendered chat leaves its answer inside a thinking block: the text ends with <think>
/// (trailing spaces and newlines aside).
bool opens_thinking(std::string_view rendered);

class tokenizer {
public:
  virtual ~tokenizer() = default;
  /// Ids of a prompt, starting with the model's begin-of-text token when it has one.
  virtual std::vector<int32_t> encode_prompt(const std::string& text) const = 0;
  /// Ids of a rendered chat (render_chat): the template wrote its special tokens, so none is
  /// added (the built-in byte tokenizer has no template: its prompt's ids).
  virtual std::vector<int32_t> encode_chat(const std::string& text) const { return encode_prompt(text); }
  /// Text of generated ids (special tokens left out).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  /// A special token's text as a prompt writes it (`<|bos|>`); empty for other tokens.
  virtual std::string special_text(int32_t) const { return {}; }
  /// The begin-of-text token encode_prompt puts first (-1: none): add_special_tokens adds or
  /// drops this one, which is not always config.json's bos_token_id (Qwen's tokenizers add none).
  virtual int32_t bos_id() const { return -1; }
  /// The chat as the model was trained to see it, ending where the assistant's answer starts;
  /// false and a sentence when the model has no (supported) chat template. `variables_json`: more
  /// variables and tools for the template; variables may not set what the chat sets (messages,
  /// add_generation_prompt, bos_token, eos_token, tools): refused by name.
  virtual bool render_chat(const std::vector<chat_message>& messages, const chat_extras& extras, std::string* text,
                           std::string* why) const = 0;
  bool render_chat(const std::vector<chat_message>& messages, std::string* text, std::string* why) const {
    return render_chat(messages, chat_extras{}, text, why);
  }
  /// Short description for logs ("bytes", "bpe 771 tokens, chatml").
  virtual std::string describe() const = 0;
  /// Whether and how a chat answer starts with its reasoning, up to a </think>.
  virtual chat_reasoning reasoning() const { return chat_reasoning::none; }
  /// How the model writes tool calls, as its template shows it (none: requests with tools are refused).
  virtual tool_call_format tool_calls() const { return tool_call_format::none; }
  /// Each token's bytes, as constrained decoding walks them (made at the first call, then shared).
  virtual std::shared_ptr<const token_vocabulary> vocabulary() const = 0;
};

/// The built-in model's tokenizer (one id per byte, <bos> first); no chat template.
std::shared_ptr<const tokenizer> make_byte_tokenizer(const model_config& cfg);

/// tokenizer.json of a model directory, and its chat template (chat_template.jinja, else
/// tokenizer_config.json's chat_template) run by Baton's Jinja engine (chat_template.hpp). A
/// template the engine cannot run still loads: chat requests then get its sentence. nullptr and
/// a sentence when the tokenizer itself cannot be read.
/// `chat_template_file`: a Jinja file that replaces the directory's template (vLLM's --chat-template).
std::shared_ptr<const tokenizer> load_model_tokenizer(const std::string& dir, const model_config& cfg, std::string* why,
                                                      const std::string& chat_template_file = {});

}  // namespace baton::gpu

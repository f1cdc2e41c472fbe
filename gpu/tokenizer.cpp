#include "gpu/tokenizer.hpp"

#include <filesystem>
#include <mutex>
#include <optional>

#include <nlohmann/json.hpp>

#include "gpu/bpe_tokenizer.hpp"
#include "gpu/byte_tokenizer.hpp"
#include "gpu/chat_template.hpp"
#include "gpu/chat_template_ast.hpp"
#include "gpu/grammar.hpp"
#include "gpu/json_file.hpp"
#include "gpu/text_file.hpp"

namespace baton::gpu {

namespace {

class bytes final : public tokenizer {
public:
  explicit bytes(const model_config& c) : t_(c.bos_token_id, c.eos_token_id), bos_(c.bos_token_id), vocab_size_(c.vocab_size) {}
  int32_t bos_id() const override { return bos_; }
  std::vector<int32_t> encode_prompt(const std::string& text) const override { return t_.encode(text); }
  std::string decode(const std::vector<int32_t>& ids) const override { return t_.decode(ids); }
  bool render_chat(const std::vector<chat_message>&, const chat_extras&, std::string*, std::string* why) const override {
    *why = "the built-in byte model has no chat template";
    return false;
  }
  std::string describe() const override { return "bytes"; }
  std::shared_ptr<const token_vocabulary> vocabulary() const override {
    std::call_once(vocab_once_, [&] { vocab_ = byte_vocabulary(vocab_size_); });
    return vocab_;
  }

private:
  byte_tokenizer t_;
  int32_t bos_;
  uint32_t vocab_size_;
  mutable std::once_flag vocab_once_;
  mutable std::shared_ptr<const token_vocabulary> vocab_;
};

/// A model directory's chat template, compiled (chat_template.hpp), or why it cannot be used.
struct chat_setup {
  std::unique_ptr<chat_template> tmpl;
  std::string unusable;    ///< the compiler's sentence (a template Baton's engine does not run)
  std::string bos_text;    ///< bos_token as the template writes it
  std::string eos_text;    ///< eos_token
  chat_reasoning reasoning = chat_reasoning::none;
  tool_call_format tool_calls = tool_call_format::none;
};

}  // namespace

bool opens_thinking(std::string_view rendered) {
  while (!rendered.empty() && (rendered.back() == '\n' || rendered.back() == ' ')) rendered.remove_suffix(1);
  constexpr std::string_view think = "<think>";
  return rendered.size() >= think.size() && rendered.substr(rendered.size() - think.size()) == think;
}

namespace {

/// How a template asks for tool calls, told by the text it writes for an assistant's calls.
tool_call_format tool_format_of(const std::string& source) {
  const auto has = [&](const char* text) { return source.find(text) != std::string::npos; };
  // Before Hermes: Qwen3-Coder's template wraps its XML calls in <tool_call> too. (The XML in
  // other wrappers, as Seed-OSS's <seed:tool_call>, is not this reader's.)
  if (has("<tool_call>") && has("<function=") && has("<parameter=")) return tool_call_format::qwen3_xml;
  if (has("<tool_call>")) return tool_call_format::hermes;
  if (has("[TOOL_CALLS]")) return tool_call_format::mistral;
  if (has("<｜tool▁calls▁begin｜>")) return tool_call_format::deepseek;
  if (has("<|tool_calls_section_begin|>")) return tool_call_format::kimi;
  if (has("{\"name\": ") && has("\"parameters\": ")) return tool_call_format::llama_json;
  return tool_call_format::none;
}

/// The special tokens that mark a format's calls: decoded answers keep them (where the
/// vocabulary calls them special, decoding would drop them, and the calls with them).
std::vector<const char*> tool_call_markers(tool_call_format f) {
  switch (f) {
    case tool_call_format::hermes:
    case tool_call_format::qwen3_xml: return {"<tool_call>", "</tool_call>"};
    case tool_call_format::llama_json: return {"<|python_tag|>"};
    case tool_call_format::mistral: return {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"};
    case tool_call_format::deepseek:
      return {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
              "<｜tool▁sep｜>"};
    case tool_call_format::kimi:
      return {"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
              "<|tool_call_argument_begin|>"};
    case tool_call_format::none: break;
  }
  return {};
}

/// The variables every chat sets: a request's chat_template_kwargs may not replace them
/// (add_generation_prompt it may, as vLLM's request field).
bool chat_sets(const std::string& key) {
  return key == "messages" || key == "bos_token" || key == "eos_token" || key == "tools";
}

/// Cuts `text` right after the final message's content (transformers' continue_final_message);
/// false and why when that content is not in the text.
bool cut_after_final(const std::vector<chat_message>& messages, std::string* text, std::string* why) {
  const std::string& content = messages.back().content;
  const auto trimmed_end = content.find_last_not_of(" \t\r\n");
  const auto trimmed_begin = content.find_first_not_of(" \t\r\n");
  for (const std::string& piece : {content, trimmed_end == std::string::npos ? std::string{}
                                                                            : content.substr(trimmed_begin, trimmed_end - trimmed_begin + 1)}) {
    if (piece.empty()) continue;
    if (const auto at = text->rfind(piece); at != std::string::npos) {
      text->resize(at + piece.size());
      return true;
    }
  }
  *why = "continue_final_message: the final message's content is not in the chat template's text, so there is "
         "nothing to continue";
  return false;
}

nlohmann::ordered_json chat_context(const std::vector<chat_message>& messages, const chat_setup& chat) {
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = nlohmann::ordered_json::array();
  for (const auto& m : messages) {
    nlohmann::ordered_json turn = nlohmann::ordered_json::object();
    turn["role"] = m.role;
    turn["content"] = m.content;
    if (!m.fields_json.empty()) {
      const auto fields = nlohmann::ordered_json::parse(m.fields_json, nullptr, false);
      if (fields.is_object())
        for (const auto& [k, v] : fields.items()) turn[k] = v;
    }
    context["messages"].push_back(std::move(turn));
  }
  context["add_generation_prompt"] = true;
  context["bos_token"] = chat.bos_text;
  context["eos_token"] = chat.eos_text;
  context["tools"] = nullptr;
  return context;
}

/// The conversation as vLLM hands it to a template (its "string" content form) where that differs
/// from transformers' (chat_context): a null content is "". nullopt when none is null.
std::optional<nlohmann::ordered_json> null_content_as_empty(const nlohmann::ordered_json& context) {
  auto out = context;
  bool changed = false;
  for (auto& turn : out["messages"])
    if (auto c = turn.find("content"); c != turn.end() && c->is_null()) {
      *c = "";
      changed = true;
    }
  if (!changed) return std::nullopt;
  return out;
}

/// Every call's arguments as JSON text (as json.dumps writes it, which is how models write and
/// clients send them), not an object: what templates written for raw OpenAI messages add to
/// strings (DeepSeek-V3.1's). nullopt when no call has structured arguments.
std::optional<nlohmann::ordered_json> arguments_as_text(const nlohmann::ordered_json& context) {
  auto out = context;
  bool changed = false;
  for (auto& turn : out["messages"])
    if (auto calls = turn.find("tool_calls"); calls != turn.end() && calls->is_array())
      for (auto& call : *calls)
        if (auto f = call.find("function"); f != call.end() && f->is_object())
          if (auto a = f->find("arguments"); a != f->end() && a->is_structured()) {
            std::string text;
            jinja::dump_json(*a, jinja::json_style{}, 0, 0, text);
            *a = std::move(text);
            changed = true;
          }
  if (!changed) return std::nullopt;
  return out;
}

class hf final : public tokenizer {
public:
  /// `bos`: the id the encoder puts first (-1: none).
  hf(std::unique_ptr<bpe_tokenizer> t, int32_t bos, chat_setup chat) : t_(std::move(t)), bos_(bos), chat_(std::move(chat)) {}
  int32_t bos_id() const override { return bos_; }
  std::vector<int32_t> encode_prompt(const std::string& text) const override {
    std::vector<int32_t> ids;
    if (bos_ >= 0) ids.push_back(bos_);
    auto rest = t_->encode(text);
    ids.insert(ids.end(), rest.begin(), rest.end());
    return ids;
  }
  /// The template writes the special tokens it wants (its begin-of-text among them): the encoder
  /// adds none, as transformers' apply_chat_template and vLLM encode a chat.
  std::vector<int32_t> encode_chat(const std::string& text) const override { return t_->encode(text); }
  std::string decode(const std::vector<int32_t>& ids) const override { return t_->decode(ids, true); }
  std::string special_text(int32_t id) const override {
    return t_->decode({id}, true).empty() ? t_->decode({id}, false) : std::string{};
  }
  bool render_chat(const std::vector<chat_message>& messages, const chat_extras& extras, std::string* text,
                   std::string* why) const override {
    for (const auto& m : messages)
      if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool") {
        *why = "chat role '" + m.role + "' is not system, user, assistant or tool";
        return false;
      }
    // Copied into the template's context (and by the template) recursively: a request from a C++
    // client is not the gateway's body, whose depth the gateway checks.
    const auto too_deep = [&](const std::string& text, const std::string& what) {
      if (!json_nested_deeper_than(text)) return false;
      *why = what + " nest arrays and objects deeper than " + std::to_string(max_json_depth) + " levels";
      return true;
    };
    for (const auto& m : messages)
      if (too_deep(m.fields_json, (m.role == "assistant" ? "an " : "a ") + m.role + " message's fields")) return false;
    if (too_deep(extras.tools_json, "tools") || too_deep(extras.variables_json, "chat_template_kwargs")) return false;
    if (!chat_.tmpl) {
      *why = chat_.unusable.empty() ? "the model directory has no chat template (chat_template.jinja, or tokenizer_config.json's chat_template)"
                                    : "the model's chat template cannot be used: " + chat_.unusable;
      return false;
    }
    auto context = chat_context(messages, chat_);
    // vLLM's chat options among the variables: add_generation_prompt (a template variable) and
    // continue_final_message (the renderer's: the answer continues the last message, an
    // assistant's, as transformers' apply_chat_template does -- the text is cut after it).
    bool continue_final = false;
    if (!extras.tools_json.empty()) {
      auto tools = nlohmann::ordered_json::parse(extras.tools_json, nullptr, false);
      if (!tools.is_array()) {
        *why = "tools must be a JSON array";
        return false;
      }
      context["tools"] = std::move(tools);
    }
    if (!extras.variables_json.empty()) {
      const auto extra = nlohmann::ordered_json::parse(extras.variables_json, nullptr, false);
      if (!extra.is_object()) {
        *why = "chat_template_kwargs must be a JSON object";
        return false;
      }
      bool generation_prompt = false;  // asked for explicitly
      for (const auto& [k, v] : extra.items()) {
        if (chat_sets(k)) {
          *why = "chat_template_kwargs may not set '" + k + "': the chat sets it";
          return false;
        }
        if ((k == "add_generation_prompt" || k == "continue_final_message") && !v.is_boolean()) {
          *why = k + " must be true or false";
          return false;
        }
        if (k == "continue_final_message") {
          continue_final = v.get<bool>();
          continue;  // the renderer's, not the template's
        }
        if (k == "add_generation_prompt") generation_prompt = v.get<bool>();
        context[k] = v;
      }
      if (continue_final) {
        if (generation_prompt) {
          *why = "continue_final_message and add_generation_prompt cannot both be true: the answer either continues "
                 "the last message or starts a new one";
          return false;
        }
        if (messages.empty() || messages.back().role != "assistant") {
          *why = "continue_final_message needs the conversation's last message to be the assistant's";
          return false;
        }
        context["add_generation_prompt"] = false;
      }
    }
    if (chat_.tmpl->render(context, text, why)) return !continue_final || cut_after_final(messages, text, why);
    // Templates that fail on transformers' form of a conversation get two more tries, each only
    // when the one before failed: a null content as "" (vLLM's form: Qwen3's tests `'</think>'
    // in message.content`), then also the calls' arguments as JSON text (DeepSeek-V3.1's adds
    // them to a string). The first error stands when both fail.
    const auto render_instead = [&](const nlohmann::ordered_json& c) {
      std::string other, ignored;
      if (!chat_.tmpl->render(c, &other, &ignored)) return false;
      *text = std::move(other);
      why->clear();
      return true;
    };
    const auto empty = null_content_as_empty(context);
    bool rendered = empty && render_instead(*empty);
    if (!rendered) {
      const auto as_text = arguments_as_text(empty ? *empty : context);
      rendered = as_text && render_instead(*as_text);
    }
    return rendered && (!continue_final || cut_after_final(messages, text, why));
  }
  chat_reasoning reasoning() const override { return chat_.reasoning; }
  tool_call_format tool_calls() const override { return chat_.tool_calls; }
  std::shared_ptr<const token_vocabulary> vocabulary() const override {
    std::call_once(vocab_once_, [&] {
      std::vector<std::string> text(t_->vocab_size());
      std::vector<bool> special(text.size());
      for (uint32_t id = 0; id < text.size(); ++id) {
        text[id] = t_->decode({static_cast<int32_t>(id)}, false);
        // A reasoning model's think markers are text to the grammar: an answer after a thinking
        // block must be able to close it (Qwen3's and DeepSeek-R1's are plain added tokens, not
        // every vocabulary's are).
        special[id] = t_->is_special(static_cast<int32_t>(id)) && text[id] != "<think>" && text[id] != "</think>";
      }
      vocab_ = std::make_shared<token_vocabulary>(std::move(text), std::move(special));
    });
    return vocab_;
  }
  std::string describe() const override {
    const char* thinking = chat_.reasoning == chat_reasoning::opened        ? " (answers start thinking)"
                           : chat_.reasoning == chat_reasoning::model_opens ? " (answers may think)"
                                                                            : "";
    return "bpe " + std::to_string(t_->vocab_size()) + " tokens" +
           (chat_.tmpl ? std::string{", chat template"} + thinking
                       : chat_.unusable.empty() ? std::string{} : ", chat template unusable (" + chat_.unusable + ")");
  }

private:
  std::unique_ptr<bpe_tokenizer> t_;
  int32_t bos_;
  chat_setup chat_;
  mutable std::once_flag vocab_once_;
  mutable std::shared_ptr<const token_vocabulary> vocab_;
};

/// The file's text; empty when it cannot be read (the JSON parse that follows then says so).
std::string read_file(const std::string& path) {
  std::string text;
  read_text_file(path, &text);
  return text;
}

/// A special token named in tokenizer_config.json: a string, or an AddedToken object.
std::string token_text(const nlohmann::json& c, const char* key) {
  if (!c.contains(key)) return {};
  const auto& v = c[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}

/// The template transformers would use: chat_template.jinja beside the tokenizer (newer
/// transformers save it there), else tokenizer_config.json's chat_template -- a string, or a list
/// of named templates of which "default" is the chat's.
std::string template_source(const std::string& dir, const nlohmann::json& config) {
  if (path_exists(dir + "/chat_template.jinja")) return read_file(dir + "/chat_template.jinja");
  if (!config.is_object() || !config.contains("chat_template")) return {};
  const auto& t = config["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array())
    for (const auto& named : t)
      if (named.is_object() && named.contains("name") && named["name"] == "default" && named.contains("template") &&
          named["template"].is_string())
        return named["template"].get<std::string>();
  return {};
}

}  // namespace

std::shared_ptr<const tokenizer> make_byte_tokenizer(const model_config& cfg) { return std::make_shared<bytes>(cfg); }

std::shared_ptr<const tokenizer> load_model_tokenizer(const std::string& dir, const model_config& cfg, std::string* why,
                                                      const std::string& chat_template_file) {
  std::string given_template;
  if (!chat_template_file.empty()) {
    if (!path_exists(chat_template_file)) {
      *why = "--chat-template " + chat_template_file + ": no such file";
      return nullptr;
    }
    given_template = read_file(chat_template_file);
    if (given_template.empty()) {
      *why = "--chat-template " + chat_template_file + ": the file is empty or cannot be read";
      return nullptr;
    }
  }
  auto t = bpe_tokenizer::load(dir + "/tokenizer.json", why);
  if (!t) return nullptr;
  // An id past the embedding table would read outside it (or be served as garbage).
  if (t->vocab_size() > cfg.vocab_size) {
    *why = dir + "/tokenizer.json: its ids go up to " + std::to_string(t->vocab_size() - 1) +
           ", past the model's vocab_size of " + std::to_string(cfg.vocab_size) + " (config.json)";
    return nullptr;
  }
  // The leading token: tokenizer_config.json's add_bos_token, else a TemplateProcessing
  // post-processor that starts with a special token (Llama 3 does, Qwen2 does not).
  int32_t bos = -1;
  nlohmann::json config;
  try {
    auto j = nlohmann::json::parse(read_file(dir + "/tokenizer.json"), nullptr, false);
    if (!j.is_discarded() && j.contains("post_processor") && j["post_processor"].is_object()) {
      const auto& pp = j["post_processor"];
      std::vector<const nlohmann::json*> procs;  // pointers: a copy of a value is recursive
      if (pp.value("type", std::string{}) == "Sequence" && pp.contains("processors"))
        for (const auto& p : pp["processors"]) procs.push_back(&p);
      else
        procs.push_back(&pp);
      for (const auto* proc : procs) {
        const auto& p = *proc;
        if (p.value("type", std::string{}) == "TemplateProcessing" && p.contains("single") && p["single"].is_array() &&
            !p["single"].empty() && p["single"][0].contains("SpecialToken"))
          bos = t->token_id(p["single"][0]["SpecialToken"].value("id", std::string{}));
      }
    }
    if (path_exists(dir + "/tokenizer_config.json")) {
      if (!parse_json_object(read_file(dir + "/tokenizer_config.json"), dir + "/tokenizer_config.json", &config, why))
        return nullptr;
      if (config.value("add_bos_token", false) && cfg.bos_token_id >= 0) bos = cfg.bos_token_id;
    }
  } catch (const nlohmann::json::exception& e) {
    *why = dir + ": " + e.what();
    return nullptr;
  }
  // The special tokens as the template writes them: named in tokenizer_config.json, else the
  // text of config.json's ids.
  const auto special_text = [&](int32_t id) {
    return id >= 0 && static_cast<uint32_t>(id) < t->vocab_size() ? t->decode({id}, false) : std::string{};
  };
  chat_setup chat;
  chat.bos_text = config.is_object() ? token_text(config, "bos_token") : std::string{};
  chat.eos_text = config.is_object() ? token_text(config, "eos_token") : std::string{};
  if (chat.bos_text.empty()) chat.bos_text = special_text(cfg.bos_token_id);
  if (chat.eos_text.empty()) chat.eos_text = special_text(cfg.eos_token_id);
  if (const auto source = given_template.empty() ? template_source(dir, config) : given_template; !source.empty()) {
    chat.tmpl = chat_template::compile(source, &chat.unusable);
    // Does the answer start inside a thinking block? The generation prompt of a one-turn chat
    // says; else a template that knows </think> leaves it to the model (Qwen3's).
    std::string probe, ignored;
    if (chat.tmpl && chat.tmpl->render(chat_context({{"user", "?"}}, chat), &probe, &ignored)) {
      if (opens_thinking(probe)) chat.reasoning = chat_reasoning::opened;
      else if (source.find("</think>") != std::string::npos) chat.reasoning = chat_reasoning::model_opens;
    }
    if (chat.tmpl) chat.tool_calls = tool_format_of(source);
    for (const char* marker : tool_call_markers(chat.tool_calls)) t->show_special(marker);
  }
  return std::make_shared<hf>(std::move(t), bos, std::move(chat));
}

}  // namespace baton::gpu

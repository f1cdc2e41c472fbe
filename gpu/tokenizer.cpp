#include "gpu/tokenizer.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gpu/bpe_tokenizer.hpp"
#include "gpu/byte_tokenizer.hpp"

namespace baton::gpu {

namespace {

class bytes final : public tokenizer {
public:
  explicit bytes(const model_config& c) : t_(c.bos_token_id, c.eos_token_id) {}
  std::vector<int32_t> encode_prompt(const std::string& text) const override { return t_.encode(text); }
  std::string decode(const std::vector<int32_t>& ids) const override { return t_.decode(ids); }
  bool render_chat(const std::vector<chat_message>&, std::string*, std::string* why) const override {
    *why = "the built-in byte model has no chat template";
    return false;
  }
  std::string describe() const override { return "bytes"; }

private:
  byte_tokenizer t_;
};

/// The chat templates Baton renders, each recognised in tokenizer_config.json's chat_template by
/// the markers only it has (Baton runs no Jinja: a template it does not know is refused).
enum class chat_format {
  none,
  chatml,       ///< Qwen2/Qwen3: <|im_start|>role\n ... <|im_end|>\n
  llama3,       ///< <|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|>
  deepseek_v2,  ///< DeepSeek-V2(-Lite)-Chat: "User: ...\n\n", "Assistant: ..." + EOS, system in place
  deepseek_v3,  ///< DeepSeek-V2.5/V3/R1: system prompts first, <｜User｜>..., <｜Assistant｜>...<｜end▁of▁sentence｜>
};

/// What a DeepSeek-V3-style template does besides its markers (R1 and its distillations).
struct chat_variant {
  bool think_prompt = false;  ///< the answer starts inside <think>: the prompt ends "<｜Assistant｜><think>\n"
  bool strip_think = false;   ///< earlier answers lose everything up to their last </think>
};

const char* chat_name(chat_format f) {
  switch (f) {
    case chat_format::chatml: return ", chatml";
    case chat_format::llama3: return ", llama3 chat";
    case chat_format::deepseek_v2: return ", deepseek-v2 chat";
    case chat_format::deepseek_v3: return ", deepseek-v3 chat";
    default: return "";
  }
}

class hf final : public tokenizer {
public:
  /// `bos_text`: what the DeepSeek templates write first ({{ bos_token }}), empty when the encoder
  /// adds the begin-of-text id itself (`bos` >= 0), so that a chat starts with exactly one.
  /// `eos_text`: the end-of-sentence token's text, which DeepSeek-V2 writes after each answer.
  hf(std::unique_ptr<bpe_tokenizer> t, int32_t bos, chat_format chat, chat_variant variant, std::string bos_text,
     std::string eos_text)
    : t_(std::move(t)), bos_(bos), chat_(chat), variant_(variant), bos_text_(std::move(bos_text)),
      eos_text_(std::move(eos_text)) {}
  std::vector<int32_t> encode_prompt(const std::string& text) const override {
    std::vector<int32_t> ids;
    if (bos_ >= 0) ids.push_back(bos_);
    auto rest = t_->encode(text);
    ids.insert(ids.end(), rest.begin(), rest.end());
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override { return t_->decode(ids, true); }
  bool render_chat(const std::vector<chat_message>& messages, std::string* text, std::string* why) const override {
    for (const auto& m : messages)
      if (m.role != "system" && m.role != "user" && m.role != "assistant") {
        *why = "chat role '" + m.role + "' is not system, user or assistant";
        return false;
      }
    if (chat_ == chat_format::deepseek_v2 || chat_ == chat_format::deepseek_v3) {
      *text = render_deepseek(messages);
      return true;
    }
    std::string out;
    for (const auto& m : messages) {
      if (chat_ == chat_format::chatml)
        out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      else if (chat_ == chat_format::llama3)
        out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>";
    }
    if (chat_ == chat_format::chatml) out += "<|im_start|>assistant\n";
    else if (chat_ == chat_format::llama3) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
    else {
      *why = "the model directory has no supported chat template (ChatML, Llama 3, DeepSeek-V2 or DeepSeek-V3)";
      return false;
    }
    *text = std::move(out);
    return true;
  }
  std::string describe() const override {
    return "bpe " + std::to_string(t_->vocab_size()) + " tokens" + chat_name(chat_) +
           (variant_.think_prompt ? " (answers start thinking)" : "");
  }

private:
  /// DeepSeek's two templates, as their tokenizer_config.json writes them (tools aside).
  std::string render_deepseek(const std::vector<chat_message>& messages) const {
    std::string out = bos_text_;
    if (chat_ == chat_format::deepseek_v2) {
      for (const auto& m : messages) {
        if (m.role == "user") out += "User: " + m.content + "\n\n";
        else if (m.role == "assistant") out += "Assistant: " + m.content + eos_text_;
        else out += m.content + "\n\n";  // system, where it stands
      }
      return out + "Assistant:";
    }
    // V3: every system prompt first, joined by a blank line, then the turns.
    bool first_system = true;
    for (const auto& m : messages)
      if (m.role == "system") {
        out += (first_system ? "" : "\n\n") + m.content;
        first_system = false;
      }
    for (const auto& m : messages) {
      if (m.role == "user") {
        out += "<｜User｜>" + m.content;
      } else if (m.role == "assistant") {
        auto content = m.content;
        if (const auto end = content.rfind("</think>"); variant_.strip_think && end != std::string::npos)
          content = content.substr(end + 8);
        out += "<｜Assistant｜>" + content + "<｜end▁of▁sentence｜>";
      }
    }
    return out + (variant_.think_prompt ? "<｜Assistant｜><think>\n" : "<｜Assistant｜>");
  }

  std::unique_ptr<bpe_tokenizer> t_;
  int32_t bos_;
  chat_format chat_;
  chat_variant variant_;
  std::string bos_text_, eos_text_;
};

}  // namespace

std::shared_ptr<const tokenizer> make_byte_tokenizer(const model_config& cfg) { return std::make_shared<bytes>(cfg); }

std::shared_ptr<const tokenizer> load_model_tokenizer(const std::string& dir, const model_config& cfg, std::string* why) {
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
  chat_format chat = chat_format::none;
  chat_variant variant;
  try {
    std::ifstream tj{dir + "/tokenizer.json"};
    std::stringstream ss;
    ss << tj.rdbuf();
    auto j = nlohmann::json::parse(ss.str(), nullptr, false);
    if (!j.is_discarded() && j.contains("post_processor") && j["post_processor"].is_object()) {
      const auto& pp = j["post_processor"];
      std::vector<nlohmann::json> procs;
      if (pp.value("type", std::string{}) == "Sequence" && pp.contains("processors"))
        for (const auto& p : pp["processors"]) procs.push_back(p);
      else
        procs.push_back(pp);
      for (const auto& p : procs)
        if (p.value("type", std::string{}) == "TemplateProcessing" && p.contains("single") && p["single"].is_array() &&
            !p["single"].empty() && p["single"][0].contains("SpecialToken"))
          bos = t->token_id(p["single"][0]["SpecialToken"].value("id", std::string{}));
    }
    if (std::filesystem::exists(dir + "/tokenizer_config.json")) {
      std::ifstream cf{dir + "/tokenizer_config.json"};
      std::stringstream cs;
      cs << cf.rdbuf();
      auto c = nlohmann::json::parse(cs.str(), nullptr, false);
      if (!c.is_discarded() && c.is_object()) {
        if (c.value("add_bos_token", false) && cfg.bos_token_id >= 0) bos = cfg.bos_token_id;
        const auto tmpl = c.contains("chat_template") && c["chat_template"].is_string()
                              ? c["chat_template"].get<std::string>()
                              : std::string{};
        const auto has = [&](const char* marker) { return tmpl.find(marker) != std::string::npos; };
        if (has("<|im_start|>")) chat = chat_format::chatml;
        else if (has("<|start_header_id|>")) chat = chat_format::llama3;
        else if (has("'Assistant: ' + message['content'] + eos_token")) chat = chat_format::deepseek_v2;
        else if (has("<｜User｜>") && has("<｜Assistant｜>") && has("<｜end▁of▁sentence｜>")) chat = chat_format::deepseek_v3;
        variant.think_prompt = chat == chat_format::deepseek_v3 && has("<｜Assistant｜><think>\\n");
        variant.strip_think = chat == chat_format::deepseek_v3 && has("split('</think>')");
      }
    }
  } catch (const nlohmann::json::exception& e) {
    *why = dir + ": " + e.what();
    return nullptr;
  }
  // The DeepSeek templates write {{ bos_token }} themselves: rendered as text only when the encoder
  // does not add the id (it would be there twice otherwise).
  const auto special_text = [&](int32_t id) {
    return id >= 0 && static_cast<uint32_t>(id) < t->vocab_size() ? t->decode({id}, false) : std::string{};
  };
  const std::string bos_text = bos < 0 ? special_text(cfg.bos_token_id) : std::string{};
  const std::string eos_text = special_text(cfg.eos_token_id);
  return std::make_shared<hf>(std::move(t), bos, chat, variant, bos_text, eos_text);
}

}  // namespace baton::gpu

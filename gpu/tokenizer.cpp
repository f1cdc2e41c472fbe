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

enum class chat_format { none, chatml, llama3 };

class hf final : public tokenizer {
public:
  hf(std::unique_ptr<bpe_tokenizer> t, int32_t bos, chat_format chat)
    : t_(std::move(t)), bos_(bos), chat_(chat) {}
  std::vector<int32_t> encode_prompt(const std::string& text) const override {
    std::vector<int32_t> ids;
    if (bos_ >= 0) ids.push_back(bos_);
    auto rest = t_->encode(text);
    ids.insert(ids.end(), rest.begin(), rest.end());
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override { return t_->decode(ids, true); }
  bool render_chat(const std::vector<chat_message>& messages, std::string* text, std::string* why) const override {
    std::string out;
    for (const auto& m : messages) {
      if (m.role != "system" && m.role != "user" && m.role != "assistant") {
        *why = "chat role '" + m.role + "' is not system, user or assistant";
        return false;
      }
      if (chat_ == chat_format::chatml)
        out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      else if (chat_ == chat_format::llama3)
        out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>";
    }
    if (chat_ == chat_format::chatml) out += "<|im_start|>assistant\n";
    else if (chat_ == chat_format::llama3) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
    else {
      *why = "the model directory has no supported chat template (ChatML or Llama 3)";
      return false;
    }
    *text = std::move(out);
    return true;
  }
  std::string describe() const override {
    return "bpe " + std::to_string(t_->vocab_size()) + " tokens" +
           (chat_ == chat_format::chatml ? ", chatml" : chat_ == chat_format::llama3 ? ", llama3 chat" : "");
  }

private:
  std::unique_ptr<bpe_tokenizer> t_;
  int32_t bos_;
  chat_format chat_;
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
        if (tmpl.find("<|im_start|>") != std::string::npos) chat = chat_format::chatml;
        else if (tmpl.find("<|start_header_id|>") != std::string::npos) chat = chat_format::llama3;
      }
    }
  } catch (const nlohmann::json::exception& e) {
    *why = dir + ": " + e.what();
    return nullptr;
  }
  return std::make_shared<hf>(std::move(t), bos, chat);
}

}  // namespace baton::gpu

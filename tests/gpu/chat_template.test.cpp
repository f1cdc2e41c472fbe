// Chat rendering: each template Baton knows (ChatML, Llama 3, DeepSeek-V2, DeepSeek-V3 and R1),
// recognised in a model directory's tokenizer_config.json, renders a conversation as the model was
// trained to see it, and a chat encodes with exactly one begin-of-text id; a template Baton does
// not know is refused by name.

#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "gpu/bpe_tokenizer.hpp"
#include "gpu/tokenizer.hpp"

using namespace baton::gpu;

namespace {

/// The special tokens of every template, after the 256 byte symbols.
const std::vector<std::string> specials = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                           "<｜Assistant｜>",        "<|im_start|>",          "<|im_end|>",
                                           "<|start_header_id|>",    "<|end_header_id|>",     "<|eot_id|>"};
constexpr int32_t bos_id = 256, eos_id = 257;

/// A model directory with a byte-level tokenizer.json (no merges) and a tokenizer_config.json
/// holding `chat_template`; removed with the object.
struct model_dir {
  std::filesystem::path path;
  model_dir(const std::string& name, const std::string& chat_template, bool add_bos_token) {
    path = std::filesystem::temp_directory_path() / ("baton-chat-" + name + "-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    nlohmann::json vocab = nlohmann::json::object();
    const auto& byte_sym = byte_level_symbols();
    for (int b = 0; b < 256; ++b) vocab[byte_sym[b]] = b;
    nlohmann::json added = nlohmann::json::array();
    for (size_t i = 0; i < specials.size(); ++i)
      added.push_back({{"id", 256 + static_cast<int>(i)}, {"content", specials[i]}, {"special", true}});
    const nlohmann::json tok = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
                                {"added_tokens", added},
                                {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                                {"normalizer", nullptr}};
    std::ofstream{path / "tokenizer.json"} << tok.dump();
    const nlohmann::json cfg = {{"add_bos_token", add_bos_token}, {"chat_template", chat_template}};
    std::ofstream{path / "tokenizer_config.json"} << cfg.dump();
  }
  ~model_dir() { std::filesystem::remove_all(path); }
  std::shared_ptr<const tokenizer> load() const {
    model_config m;
    m.vocab_size = 512;
    m.bos_token_id = bos_id;
    m.eos_token_id = eos_id;
    std::string why;
    auto t = load_model_tokenizer(path.string(), m, &why);
    REQUIRE_MESSAGE(t, why);
    return t;
  }
};

std::string render(const tokenizer& t, const std::vector<chat_message>& messages) {
  std::string text, why;
  REQUIRE_MESSAGE(t.render_chat(messages, &text, &why), why);
  return text;
}

const std::vector<chat_message> conversation = {
    {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Why?"}};

}  // namespace

TEST_CASE("chat: ChatML and Llama 3 render each turn between their markers and leave the answer open") {
  {
    model_dir d{"chatml", "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>'}}", false};
    const auto t = d.load();
    CHECK(t->describe().find("chatml") != std::string::npos);
    CHECK(render(*t, conversation) ==
          "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
          "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n");
  }
  {
    model_dir d{"llama3", "{{ bos_token }}{{'<|start_header_id|>' + m['role'] + '<|end_header_id|>'}}", false};
    const auto t = d.load();
    CHECK(render(*t, {{"user", "Hi"}}) ==
          "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  }
}

TEST_CASE("chat: DeepSeek-V2 writes the system prompt where it stands, 'User: ' and 'Assistant: ' turns, EOS after "
          "each answer, and one begin-of-text id however the tokenizer adds it") {
  const std::string tmpl =
      "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + "
      "'\\n\\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}{% endif "
      "%}{% endfor %}";
  model_dir d{"dsv2", tmpl, false};  // the encoder adds no begin-of-text id: the template's text brings it
  const auto t = d.load();
  CHECK(t->describe().find("deepseek-v2 chat") != std::string::npos);
  const auto text = render(*t, conversation);
  CHECK(text ==
        "<｜begin▁of▁sentence｜>Be brief.\n\nUser: Hi\n\nAssistant: Hello.<｜end▁of▁sentence｜>User: Why?\n\nAssistant:");
  const auto ids = t->encode_prompt(text);
  REQUIRE_FALSE(ids.empty());
  CHECK(ids.front() == bos_id);
  CHECK(std::count(ids.begin(), ids.end(), bos_id) == 1);
  CHECK(std::count(ids.begin(), ids.end(), eos_id) == 1);  // one per earlier answer
}

TEST_CASE("chat: DeepSeek-V3 puts every system prompt first, marks turns with <｜User｜> and <｜Assistant｜>; R1's "
          "template opens the answer in <think> and drops earlier answers' thinking") {
  const std::string v3 =
      "{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{{'<｜User｜>' + message['content']}}"
      "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{% endfor %}{{'<｜Assistant｜>'}}";
  const std::vector<chat_message> chat = {{"system", "Be brief."},
                                          {"user", "Hi"},
                                          {"assistant", "<think>greet</think>Hello."},
                                          {"system", "Use English."},
                                          {"user", "Why?"}};
  {
    model_dir d{"dsv3", v3, true};  // the encoder adds the begin-of-text id: the text must not carry one too
    const auto t = d.load();
    CHECK(t->describe().find("deepseek-v3 chat") != std::string::npos);
    const auto text = render(*t, chat);
    CHECK(text == "Be brief.\n\nUse English.<｜User｜>Hi<｜Assistant｜><think>greet</think>Hello.<｜end▁of▁sentence｜>"
                  "<｜User｜>Why?<｜Assistant｜>");
    const auto ids = t->encode_prompt(text);
    REQUIRE_FALSE(ids.empty());
    CHECK(ids.front() == bos_id);
    CHECK(std::count(ids.begin(), ids.end(), bos_id) == 1);
  }
  {
    const std::string r1 = v3.substr(0, v3.size() - std::string{"{{'<｜Assistant｜>'}}"}.size()) +
                           "{% set content = content.split('</think>')[-1] %}{{'<｜Assistant｜><think>\\n'}}";
    model_dir d{"r1", r1, true};
    const auto t = d.load();
    CHECK(t->describe().find("answers start thinking") != std::string::npos);
    CHECK(render(*t, chat) == "Be brief.\n\nUse English.<｜User｜>Hi<｜Assistant｜>Hello.<｜end▁of▁sentence｜>"
                              "<｜User｜>Why?<｜Assistant｜><think>\n");
  }
}

TEST_CASE("chat: a template Baton does not know, and a role it does not take, are refused with a sentence") {
  model_dir d{"mistral", "{{ bos_token }}{% for m in messages %}{{ '[INST] ' + m['content'] + '[/INST]' }}{% endfor %}", false};
  const auto t = d.load();
  std::string text, why;
  CHECK_FALSE(t->render_chat(conversation, &text, &why));
  CHECK(why == "the model directory has no supported chat template (ChatML, Llama 3, DeepSeek-V2 or DeepSeek-V3)");
  model_dir v3{"dsv3-tool", "<｜User｜><｜Assistant｜><｜end▁of▁sentence｜>", false};
  CHECK_FALSE(v3.load()->render_chat({{"tool", "42"}}, &text, &why));
  CHECK(why == "chat role 'tool' is not system, user or assistant");
}

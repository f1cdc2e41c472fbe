// Chat through a model directory's tokenizer: its chat template (tokenizer_config.json's, or
// chat_template.jinja) renders a conversation as the model was trained to see it, a chat encodes
// with exactly one begin-of-text id, a template that opens a thinking block is recognised, and a
// template the engine cannot run, or none, is refused with a sentence. The engine itself is tested
// against Jinja2 in chat_template_engine.test.cpp.

#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "gpu/bpe_tokenizer.hpp"
#include "gpu/tokenizer.hpp"

using namespace baton::gpu;

namespace {

/// The special tokens of every template, after the 256 byte symbols.
const std::vector<std::string> specials = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                           "<｜Assistant｜>",        "<|im_start|>",          "<|im_end|>",
                                           "<|start_header_id|>",    "<|end_header_id|>",     "<|eot_id|>",
                                           // tool-call markers (special in their models' vocabularies)
                                           "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<｜tool▁calls▁begin｜>",
                                           "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                                           "<｜tool▁sep｜>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                           "<|tool_call_argument_begin|>"};
constexpr int32_t bos_id = 256, eos_id = 257;

/// A model directory with a byte-level tokenizer.json (no merges) and a tokenizer_config.json
/// holding `chat_template` (a string, or the list form) and `config` (bos_token, eos_token), and
/// chat_template.jinja if given; removed with the object.
struct model_dir {
  std::filesystem::path path;
  model_dir(const std::string& name, const nlohmann::json& chat_template, bool add_bos_token,
            const std::string& jinja_file = {}, const nlohmann::json& config = nlohmann::json::object()) {
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
    nlohmann::json cfg = config;
    cfg["add_bos_token"] = add_bos_token;
    if (!chat_template.is_null()) cfg["chat_template"] = chat_template;
    std::ofstream{path / "tokenizer_config.json"} << cfg.dump();
    if (!jinja_file.empty()) std::ofstream{path / "chat_template.jinja"} << jinja_file;
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


/// Templates in the manner of the models' own (the engine runs them as Jinja would:
/// tests/gpu/chat_template_engine.test.cpp).
const std::string chatml =
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
const std::string llama3 =
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
    "m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
const std::string deepseek_v2 =
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + "
    "'\n\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}";
const std::string r1 =
    "{% set ns = namespace(system_prompt='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.system_prompt = m['content'] %}{% endif %}{% endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{% set content = m['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}{{ '<｜Assistant｜>' + content + "
    "'<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{% endif %}";

}  // namespace

TEST_CASE("chat: a model's template renders the conversation and leaves the answer open (ChatML, Llama 3)") {
  {
    model_dir d{"chatml", chatml, false};
    const auto t = d.load();
    CHECK(t->describe().find(", chat template") != std::string::npos);
    CHECK(t->reasoning() == chat_reasoning::none);
    CHECK(render(*t, conversation) ==
          "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
          "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n");
  }
  {
    model_dir d{"llama3", llama3, true};  // the encoder adds <bos> to prompts; a chat's comes from its template
    const auto t = d.load();
    const auto text = render(*t, {{"user", " Hi "}});
    CHECK(text == "<｜begin▁of▁sentence｜><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n");
    const auto ids = t->encode_chat(text);
    CHECK(ids.front() == bos_id);
    CHECK(std::count(ids.begin(), ids.end(), bos_id) == 1);
  }
}

TEST_CASE("chat: DeepSeek-V2's template, the system prompt where it stands, EOS after each answer, and one "
          "begin-of-text id, the template's, whether or not the encoder adds one to prompts") {
  for (const bool encoder_adds : {false, true}) {
    CAPTURE(encoder_adds);
    model_dir d{"dsv2", deepseek_v2, encoder_adds};
    const auto t = d.load();
    const auto text = render(*t, conversation);
    CHECK(text == "<｜begin▁of▁sentence｜>Be brief.\n\nUser: Hi\n\nAssistant: Hello.<｜end▁of▁sentence｜>User: Why?\n\nAssistant:");
    const auto ids = t->encode_chat(text);
    REQUIRE_FALSE(ids.empty());
    CHECK(ids.front() == bos_id);
    CHECK(std::count(ids.begin(), ids.end(), bos_id) == 1);
    CHECK(std::count(ids.begin(), ids.end(), eos_id) == 1);  // one per earlier answer
  }
}

TEST_CASE("chat: R1's template opens the answer in <think> (the tokenizer says so) and drops earlier thinking") {
  const std::vector<chat_message> chat = {{"system", "Be brief."},
                                          {"user", "Hi"},
                                          {"assistant", "<think>greet</think>Hello."},
                                          {"system", "Use English."},
                                          {"user", "Why?"}};
  model_dir d{"r1", r1, true};
  const auto t = d.load();
  CHECK(t->reasoning() == chat_reasoning::opened);
  CHECK(t->describe().find("answers start thinking") != std::string::npos);
  CHECK(render(*t, chat) == "<｜begin▁of▁sentence｜>Use English.<｜User｜>Hi<｜Assistant｜>Hello.<｜end▁of▁sentence｜>"
                            "<｜User｜>Why?<｜Assistant｜><think>\n");
}

TEST_CASE("chat: a template that leaves <think> to the model (Qwen3's) says answers may think; a request's "
          "chat_template_kwargs reach it (enable_thinking), but not in place of what the chat sets") {
  const std::string qwen3 =
      chatml.substr(0, chatml.find("{% if add_generation_prompt %}")) +
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and "
      "enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}";
  model_dir d{"qwen3", qwen3, false};
  const auto t = d.load();
  CHECK(t->reasoning() == chat_reasoning::model_opens);
  CHECK(t->describe().find("answers may think") != std::string::npos);
  std::string text, why;
  REQUIRE(t->render_chat({{"user", "Hi"}}, chat_extras{R"({"enable_thinking": false})", {}}, &text, &why));
  CHECK(text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  REQUIRE(t->render_chat({{"user", "Hi"}}, chat_extras{R"({"enable_thinking": true})", {}}, &text, &why));
  CHECK(text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  CHECK_FALSE(t->render_chat({{"user", "Hi"}}, chat_extras{R"({"messages": []})", {}}, &text, &why));
  CHECK(why == "chat_template_kwargs may not set 'messages': the chat sets it");
  CHECK_FALSE(t->render_chat({{"user", "Hi"}}, chat_extras{"[1]", {}}, &text, &why));
  CHECK(why == "chat_template_kwargs must be a JSON object");
  // A C++ client's request is not a gateway body (whose depth the gateway checks): nesting that
  // would overflow the stack when copied into the context is refused by name.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  CHECK_FALSE(t->render_chat({{"user", "Hi", "{\"x\": " + deep + "}"}}, {}, &text, &why));
  CHECK(why == "a user message's fields nest arrays and objects deeper than 64 levels");
  CHECK_FALSE(t->render_chat({{"user", "Hi"}}, chat_extras{{}, deep}, &text, &why));
  CHECK(why == "tools nest arrays and objects deeper than 64 levels");
}

TEST_CASE("chat: vLLM's add_generation_prompt and continue_final_message (among chat_template_kwargs): the text "
          "ends after the last message, or inside it, so that the answer continues a prefilled assistant message") {
  model_dir d{"options", chatml, false};
  const auto t = d.load();
  const std::vector<chat_message> prefilled = {{"user", "Name a colour."}, {"assistant", "The colour is "}};
  std::string text, why;
  REQUIRE(t->render_chat({{"user", "Hi"}}, chat_extras{R"({"add_generation_prompt": false})", {}}, &text, &why));
  CHECK(text == "<|im_start|>user\nHi<|im_end|>\n");
  // Cut right after the content (its trailing space kept: the template's own text, not trimmed).
  REQUIRE(t->render_chat(prefilled, chat_extras{R"({"continue_final_message": true})", {}}, &text, &why));
  CHECK(text == "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nThe colour is ");
  REQUIRE(t->render_chat(prefilled, chat_extras{R"({"continue_final_message": true, "add_generation_prompt": false})", {}},
                         &text, &why));
  CHECK(text == "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nThe colour is ");
  // Llama 3's template trims each message: the trimmed content is where the text is cut.
  model_dir trims{"options-trim", llama3, false};
  REQUIRE(trims.load()->render_chat(prefilled, chat_extras{R"({"continue_final_message": true})", {}}, &text, &why));
  CHECK(text.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\nThe colour is"));
  // Refused, naming why.
  CHECK_FALSE(t->render_chat(prefilled, chat_extras{R"({"continue_final_message": true, "add_generation_prompt": true})", {}},
                             &text, &why));
  CHECK(why == "continue_final_message and add_generation_prompt cannot both be true: the answer either continues the "
               "last message or starts a new one");
  CHECK_FALSE(t->render_chat({{"user", "Hi"}}, chat_extras{R"({"continue_final_message": true})", {}}, &text, &why));
  CHECK(why == "continue_final_message needs the conversation's last message to be the assistant's");
  CHECK_FALSE(t->render_chat(prefilled, chat_extras{R"({"continue_final_message": "yes"})", {}}, &text, &why));
  CHECK(why == "continue_final_message must be true or false");
  model_dir drops{"options-drop", "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}", false};
  CHECK_FALSE(drops.load()->render_chat(prefilled, chat_extras{R"({"continue_final_message": true})", {}}, &text, &why));
  CHECK(why.find("the final message's content is not in the chat template's text") != std::string::npos);
}

TEST_CASE("chat: chat_template.jinja beside the tokenizer wins, and of a list of named templates 'default' is used") {
  model_dir file{"jinja-file", chatml, false, "{% for m in messages %}[{{ m.role }}]{% endfor %}"};
  CHECK(render(*file.load(), {{"user", "Hi"}}) == "[user]");
  const nlohmann::json named = nlohmann::json::array(
      {{{"name", "tool_use"}, {"template", "tools"}}, {{"name", "default"}, {"template", "{{ messages | length }} turns"}}});
  model_dir list{"named", named, false};
  CHECK(render(*list.load(), conversation) == "4 turns");
}

TEST_CASE("chat: a template the engine cannot run, no template, and a role Baton does not take are refused with a "
          "sentence") {
  std::string text, why;
  model_dir odd{"odd", "{% for m in messages %}{{ m.content | wordwrap(8) }}{% endfor %}", false};
  const auto t = odd.load();  // the model still loads: completions need no template
  CHECK(t->describe().find("chat template unusable") != std::string::npos);
  CHECK_FALSE(t->render_chat(conversation, &text, &why));
  CHECK(why == "the model's chat template cannot be used: chat template line 1: the filter 'wordwrap' is not supported");
  model_dir none{"none", nullptr, false};
  CHECK_FALSE(none.load()->render_chat(conversation, &text, &why));
  CHECK(why == "the model directory has no chat template (chat_template.jinja, or tokenizer_config.json's chat_template)");
  model_dir strict{"strict", "{{ raise_exception('Only user and assistant roles are supported!') }}", false};
  CHECK_FALSE(strict.load()->render_chat(conversation, &text, &why));
  CHECK(why == "Only user and assistant roles are supported!");
  model_dir v3{"tool", chatml, false};
  CHECK_FALSE(v3.load()->render_chat({{"function", "42"}}, &text, &why));
  CHECK(why == "chat role 'function' is not system, user, assistant or tool");
}

TEST_CASE("chat: tools, an assistant's tool calls and the tools' results reach a Hermes-style template as "
          "transformers gives them (the text Jinja2 rendered for the same conversation)") {
  const std::string dir = BATON_SOURCE_DIR "/tests/data/chat_templates/";
  const auto read = [](const std::string& path) {
    std::ifstream in{path};
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  model_dir d{"hermes", read(dir + "chatml_tools.jinja"), false};
  const auto t = d.load();
  CHECK(t->tool_calls() == tool_call_format::hermes);
  const auto context = nlohmann::ordered_json::parse(read(dir + "contexts.json"))["tools"];
  std::vector<chat_message> messages;
  for (const auto& m : context["messages"]) {
    nlohmann::ordered_json fields = m;  // what the gateway passes: every field but role and content
    fields.erase("role");
    fields.erase("content");
    messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>(), fields.empty() ? "" : fields.dump()});
  }
  std::string text, why;
  REQUIRE_MESSAGE(t->render_chat(messages, chat_extras{{}, context["tools"].dump()}, &text, &why), why);
  const auto expected = nlohmann::json::parse(read(dir + "expected.json"));
  CHECK(text == expected["chatml_tools/tools"]["text"].get<std::string>());
  model_dir plain{"no-tools", chatml, false};
  CHECK(plain.load()->tool_calls() == tool_call_format::none);
}

TEST_CASE("chat: a template's tool-call form is told from what it writes for an assistant's calls (Llama 3.1's JSON, "
          "Mistral's [TOOL_CALLS], DeepSeek's and Kimi-K2's tokens), and answers keep that form's markers though they are special "
          "tokens") {
  const auto id = [](const std::string& content) {
    return 256 + static_cast<int32_t>(std::find(specials.begin(), specials.end(), content) - specials.begin());
  };
  const int32_t a = 'a';
  std::ifstream in{BATON_SOURCE_DIR "/tests/data/chat_templates/header_tools.jinja"};
  std::stringstream llama_source;
  llama_source << in.rdbuf();
  const std::string mistral_source =
      "{% for m in messages %}{% if m.tool_calls is defined %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{% else %}"
      "{{ m.content }}{% endif %}{% endfor %}";
  const std::string deepseek_source =
      "{% for m in messages %}{% if m.tool_calls is defined %}<｜tool▁calls▁begin｜>{% for c in m.tool_calls %}"
      "<｜tool▁call▁begin｜>{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments | tojson }}<｜tool▁call▁end｜>"
      "{% endfor %}<｜tool▁calls▁end｜>{% else %}{{ m.content }}{% endif %}{% endfor %}";
  const std::string kimi_source =
      "{% for m in messages %}{% if m.tool_calls is defined %}<|tool_calls_section_begin|>{% for c in m.tool_calls %}"
      "<|tool_call_begin|>functions.{{ c.function.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>"
      "{{ c.function.arguments | tojson }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% else %}"
      "{{ m.content }}{% endif %}{% endfor %}";
  model_dir llama{"llama-tools", llama_source.str(), true}, mistral{"mistral-tools", mistral_source, true},
      deepseek{"deepseek-tools", deepseek_source, true}, kimi{"kimi-tools", kimi_source, true},
      plain{"plain-tools", "{{ messages[0].content }}", true};
  const auto l = llama.load(), m = mistral.load(), d = deepseek.load(), k = kimi.load(), p = plain.load();
  CHECK(k->tool_calls() == tool_call_format::kimi);
  CHECK(k->decode({id("<|tool_call_begin|>"), a, id("<|tool_call_argument_begin|>"), eos_id}) ==
        "<|tool_call_begin|>a<|tool_call_argument_begin|>");
  CHECK(l->tool_calls() == tool_call_format::llama_json);
  CHECK(m->tool_calls() == tool_call_format::mistral);
  CHECK(d->tool_calls() == tool_call_format::deepseek);
  CHECK(p->tool_calls() == tool_call_format::none);
  // Generated ids decode without special tokens, but a format's markers stay: its reader needs them.
  CHECK(l->decode({id("<|python_tag|>"), a, eos_id}) == "<|python_tag|>a");
  CHECK(m->decode({id("[TOOL_CALLS]"), a, id("[ARGS]"), eos_id}) == "[TOOL_CALLS]a[ARGS]");
  CHECK(m->decode({id("<|python_tag|>"), a}) == "a");  // another format's marker is special as ever
  CHECK(d->decode({id("<｜tool▁calls▁begin｜>"), id("<｜tool▁call▁begin｜>"), a, id("<｜tool▁sep｜>"),
                   id("<｜tool▁call▁end｜>"), id("<｜tool▁calls▁end｜>")}) ==
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜><｜tool▁call▁end｜><｜tool▁calls▁end｜>");
  CHECK(p->decode({id("[TOOL_CALLS]"), a}) == "a");
}

TEST_CASE("chat: the models' own templates (Qwen3-Coder's, Qwen3's, DeepSeek-V3.1's, Kimi-K2's, Mistral Small 3.2's, "
          "Llama 3.3's) render tools, calls and their results as Jinja2 rendered them (null content as \"\", then "
          "arguments as text, where a form fails: rendered_as), and each one's tool-call form is told "
          "(tests/data/chat_templates/real)") {
  const std::string dir = BATON_SOURCE_DIR "/tests/data/chat_templates/real/";
  const auto read = [](const std::string& path) {
    std::ifstream in{path};
    REQUIRE_MESSAGE(in.good(), path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  const auto contexts = nlohmann::ordered_json::parse(read(dir + "contexts.json"));
  const auto expected = nlohmann::ordered_json::parse(read(dir + "expected.json"));
  const auto models = nlohmann::ordered_json::parse(read(dir + "models.json"));
  const std::vector<std::pair<std::string, tool_call_format>> templates = {
      {"qwen3_coder", tool_call_format::qwen3_xml}, {"qwen3", tool_call_format::hermes},
      {"deepseek_v3_1", tool_call_format::deepseek}, {"kimi_k2", tool_call_format::kimi},
      {"mistral_small_3_2", tool_call_format::mistral}, {"llama3_3", tool_call_format::llama_json}};
  REQUIRE(models.size() == templates.size());
  REQUIRE(expected.size() == templates.size() * contexts.size());
  for (const auto& [stem, format] : templates) {
    CAPTURE(stem);
    nlohmann::json tokens = nlohmann::json::object();  // the model's, where its template reads them
    for (const char* key : {"bos_token", "eos_token"})
      if (const auto& token = models.at(stem).at(key); token.is_string()) tokens[key] = token.get<std::string>();
    model_dir d{"real-" + stem, nullptr, false, read(dir + stem + ".jinja"), tokens};
    const auto t = d.load();
    CHECK_MESSAGE(t->describe().find("chat template unusable") == std::string::npos, t->describe());
    CHECK(t->tool_calls() == format);
    for (const auto& [name, context] : contexts.items()) {
      CAPTURE(name);
      std::vector<chat_message> messages;
      for (const auto& m : context["messages"]) {
        nlohmann::ordered_json fields = m;  // every field but role, and content where it is text (null stays)
        fields.erase("role");
        std::string content;
        if (m["content"].is_string()) {
          content = m["content"].get<std::string>();
          fields.erase("content");
        }
        messages.push_back({m["role"].get<std::string>(), content, fields.empty() ? "" : fields.dump()});
      }
      std::string text, why;
      const bool ok = t->render_chat(messages, chat_extras{{}, context["tools"].dump()}, &text, &why);
      const auto& want = expected.at(stem + "/" + name);
      if (want.contains("text")) {
        CHECK_MESSAGE(ok, why);
        CHECK(text == want["text"].get<std::string>());
      } else if (want.contains("error")) {  // the template's raise_exception, its words as they are
        CHECK_FALSE(ok);
        CHECK(why == want["error"].get<std::string>());
      } else {  // Jinja2 failed on the template's own bug (str + dict, 'x' in None): so must Baton, naming the line
        CAPTURE(want["python_error"].get<std::string>());
        CHECK_FALSE(ok);
        CHECK_MESSAGE(why.find("chat template line ") == 0, why);
      }
    }
  }
}

TEST_CASE("chat: a template file given in place of the directory's (vLLM's --chat-template) renders instead, and one "
          "that does not exist is refused by name") {
  const model_dir dir{"override", chatml, false};
  const auto file = dir.path / "other.jinja";
  std::ofstream{file} << llama3;
  model_config m;
  m.vocab_size = 512;
  m.bos_token_id = bos_id;
  m.eos_token_id = eos_id;
  std::string why;
  auto t = load_model_tokenizer(dir.path.string(), m, &why, file.string());
  REQUIRE_MESSAGE(t, why);
  CHECK(render(*t, {{"user", "Hi"}}) == render(*model_dir{"override-l3", llama3, false}.load(), {{"user", "Hi"}}));
  CHECK(render(*t, {{"user", "Hi"}}) != render(*dir.load(), {{"user", "Hi"}}));
  CHECK_FALSE(load_model_tokenizer(dir.path.string(), m, &why, (dir.path / "missing.jinja").string()));
  CHECK_MESSAGE(why.find("--chat-template " + (dir.path / "missing.jinja").string() + ": no such file") != std::string::npos, why);
}

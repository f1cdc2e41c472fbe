// Tool call ids in the form each model was trained on: clients send them back in the next turn
// (the assistant's tool_calls[].id, the tool message's tool_call_id) and the model's template
// renders them. Mistral's: 9 characters [A-Za-z0-9] (its templates refuse any other); Kimi-K2's:
// the model's own functions.NAME:N, or N counting the conversation's calls where it wrote none;
// every other model's: unchanged. The
// whole answer and its stream give the same ids.

#include <doctest/doctest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "actors/messages.hpp"
#include "deploy/openai.hpp"
#include "gpu/bpe_tokenizer.hpp"
#include "gpu/tokenizer.hpp"

using namespace baton;
using nlohmann::json;
using gpu::tool_call_format;

namespace {

const std::string tools = R"([
  {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
  {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}}}},
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}])";

/// A chat call with the tools above: `messages` its conversation (a JSON array's text), n
/// choices, and answers read as `format` (the gateway's word on the model).
deploy::openai::call chat_call(tool_call_format format, const std::string& messages, uint32_t n = 1) {
  const std::string body =
      R"({"n": )" + std::to_string(n) + R"(, "messages": )" + messages + R"(, "tools": )" + tools + "}";
  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE_MESSAGE(deploy::openai::parse_body(body, true, "m", &c, &e), e.message);
  c.tool_calls = format;
  return c;
}

const std::string one_question = R"([{"role": "user", "content": "x"}])";

/// Per choice, its calls' ids in order.
using ids = std::vector<std::vector<std::string>>;

/// The whole answer's ids: each choice answers `text`.
ids whole_ids(const deploy::openai::call& c, const std::string& text, const std::string& answer_id) {
  std::vector<completion> done(c.num_choices());
  for (auto& d : done) d.text = text, d.finish_reason = "eos";
  const auto answer = json::parse(deploy::openai::completion_json(c, done, answer_id, 0));
  ids out;
  for (const auto& choice : answer["choices"]) {
    REQUIRE(choice["finish_reason"] == "tool_calls");
    out.emplace_back();
    for (const auto& call : choice["message"]["tool_calls"]) out.back().push_back(call["id"].get<std::string>());
  }
  return out;
}

/// The same answer streamed in pieces of `step` bytes, as the gateway streams each choice: a
/// call's id comes with its first piece, once.
ids streamed_ids(const deploy::openai::call& c, const std::string& text, const std::string& answer_id, size_t step) {
  ids out(c.num_choices());
  for (uint32_t choice = 0; choice < c.num_choices(); ++choice) {
    deploy::openai::answer_reader reader{c, 0};
    REQUIRE(reader.active());
    for (size_t at = 0; at < text.size(); at += step) {
      stream_chunk chunk;
      chunk.text = text.substr(at, step);
      if (at + step >= text.size()) chunk.finish_reason = "eos";
      const auto parts = reader.feed(chunk.text, !chunk.finish_reason.empty());
      const auto event =
          json::parse(deploy::openai::chunk_json(c, chunk, answer_id, 0, at == 0, 0, choice, &parts))["choices"][0];
      CHECK(event["index"] == choice);
      if (!event["delta"].contains("tool_calls")) continue;
      for (const auto& call : event["delta"]["tool_calls"]) {
        if (!call.contains("id")) continue;
        CHECK(call["index"] == out[choice].size());
        out[choice].push_back(call["id"].get<std::string>());
      }
    }
  }
  return out;
}

bool mistral_shaped(const std::string& id) {
  return id.size() == 9 && std::all_of(id.begin(), id.end(), [](unsigned char ch) { return std::isalnum(ch) != 0; });
}

std::string read_file(const std::string& path) {
  std::ifstream in{path};
  REQUIRE_MESSAGE(in.good(), path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// A model directory for a real template: a byte-level tokenizer.json (no merges) whose added
/// tokens are the template's own, <s> and </s> first, and a tokenizer_config.json with the
/// template and those as bos_token and eos_token; removed with the object.
struct model_dir {
  std::filesystem::path path;
  model_dir(const std::string& name, const std::string& chat_template, const std::vector<std::string>& specials) {
    path = std::filesystem::temp_directory_path() / ("baton-ids-" + name + "-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    json vocab = json::object();
    const auto& byte_sym = gpu::byte_level_symbols();
    for (int b = 0; b < 256; ++b) vocab[byte_sym[b]] = b;
    json added = json::array();
    for (size_t i = 0; i < specials.size(); ++i)
      added.push_back({{"id", 256 + static_cast<int>(i)}, {"content", specials[i]}, {"special", true}});
    const json tok = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
                      {"added_tokens", added},
                      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                      {"normalizer", nullptr}};
    std::ofstream{path / "tokenizer.json"} << tok.dump();
    std::ofstream{path / "tokenizer_config.json"} << json{{"chat_template", chat_template},
                                                          {"bos_token", specials.at(0)},
                                                          {"eos_token", specials.at(1)},
                                                          {"add_bos_token", false}}
                                                         .dump();
  }
  ~model_dir() { std::filesystem::remove_all(path); }
  std::shared_ptr<const gpu::tokenizer> load() const {
    gpu::model_config m;
    m.vocab_size = 512;
    m.bos_token_id = 256;
    m.eos_token_id = 257;
    std::string why;
    auto t = gpu::load_model_tokenizer(path.string(), m, &why);
    REQUIRE_MESSAGE(t, why);
    return t;
  }
};

/// A parsed call's conversation as the router gives it to the template.
std::vector<gpu::chat_message> chat_of(const deploy::openai::call& c) {
  std::vector<gpu::chat_message> out;
  for (const auto& m : c.req.messages) out.push_back({m.role, m.content, m.fields_json});
  return out;
}

}  // namespace

TEST_CASE("tool call ids, Mistral's form: 9 characters [A-Za-z0-9], a different one for each call and each choice, "
          "the same whole and streamed, and another answer's others") {
  const auto c = chat_call(tool_call_format::mistral, one_question, 2);
  const std::string text = "[TOOL_CALLS]f[ARGS]{\"x\": 1}[TOOL_CALLS]g[ARGS]{}";
  const auto whole = whole_ids(c, text, "chatcmpl-1700000000-1");
  REQUIRE(whole.size() == 2);
  std::set<std::string> seen;
  for (const auto& choice : whole) {
    REQUIRE(choice.size() == 2);
    for (const auto& id : choice) {
      CAPTURE(id);
      CHECK(mistral_shaped(id));
      seen.insert(id);
    }
  }
  CHECK(seen.size() == 4);  // the two choices answered the same calls, and still got their own ids
  for (size_t step : {size_t{1}, size_t{5}, text.size()}) {
    CAPTURE(step);
    CHECK(streamed_ids(c, text, "chatcmpl-1700000000-1", step) == whole);
  }
  // The next answer's calls (the gateway's next id) are others.
  for (const auto& choice : whole_ids(c, text, "chatcmpl-1700000000-2"))
    for (const auto& id : choice) CHECK(seen.insert(id).second);
  // Many answers' first calls, none alike.
  const auto one = chat_call(tool_call_format::mistral, one_question);
  std::set<std::string> firsts;
  for (int k = 0; k < 2000; ++k) {
    const auto id = whole_ids(one, text, "chatcmpl-1700000000-" + std::to_string(k))[0][0];
    CHECK(mistral_shaped(id));
    firsts.insert(id);
  }
  CHECK(firsts.size() == 2000);
}

TEST_CASE("tool call ids, Kimi-K2's form: functions.NAME:N as the model wrote it (vLLM's), and where it wrote "
          "none, N counting on from the calls in the conversation's history (each choice from the same), whole and "
          "streamed alike") {
  // Two calls before, in two assistant turns; an assistant turn without calls (null) counts none.
  const std::string history = R"([
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
    {"role": "tool", "tool_call_id": "functions.f:0", "content": "1"},
    {"role": "assistant", "content": "", "tool_calls": [
      {"id": "functions.g:1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "functions.g:1", "content": "2"},
    {"role": "assistant", "content": "Done.", "tool_calls": null},
    {"role": "user", "content": "Again."}])";
  const auto c = chat_call(tool_call_format::kimi, history, 2);
  CHECK(c.num_history_tool_calls == 2);
  const auto answer = [](std::string_view first_head, std::string_view second_head) {
    return "Again.<|tool_calls_section_begin|><|tool_call_begin|>" + std::string{first_head} +
           "<|tool_call_argument_begin|>{\"x\": 2}<|tool_call_end|><|tool_call_begin|>" + std::string{second_head} +
           "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
  };
  const auto both_ways = [&](const deploy::openai::call& c, const std::string& text, const ids& want) {
    CHECK(whole_ids(c, text, "chatcmpl-1700000000-1") == want);
    for (size_t step : {size_t{1}, size_t{9}, text.size()}) {
      CAPTURE(step);
      CHECK(streamed_ids(c, text, "chatcmpl-1700000000-1", step) == want);
    }
  };
  // The model's own ids, whatever it counted (Kimi-K2's first template numbers each turn's calls
  // from 0; its later ones render the ids given back).
  both_ways(c, answer("functions.f:0", " functions.g:7 "), {{"functions.f:0", "functions.g:7"}, {"functions.f:0", "functions.g:7"}});
  // Heads that are no id (no index, an index that is no number): counted from the history.
  both_ways(c, answer("functions.f", "functions.g:x"), {{"functions.f:2", "functions.g:3"}, {"functions.f:2", "functions.g:3"}});
  // A conversation's first calls count from 0.
  const auto first = chat_call(tool_call_format::kimi, one_question);
  CHECK(first.num_history_tool_calls == 0);
  both_ways(first, answer("f", "g"), {{"functions.f:0", "functions.g:1"}});
}

TEST_CASE("tool call ids of other forms (Hermes') are as they were: the answer's id, the choice and the call's place") {
  const std::string history = R"([
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_9", "content": "1"},
    {"role": "user", "content": "Again."}])";
  const auto c = chat_call(tool_call_format::hermes, history, 2);
  const std::string text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call>"
                           "<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
  const ids want = {{"call_7-1-0-0", "call_7-1-0-1"}, {"call_7-1-1-0", "call_7-1-1-1"}};
  CHECK(whole_ids(c, text, "chatcmpl-7-1") == want);
  CHECK(streamed_ids(c, text, "chatcmpl-7-1", 4) == want);
}

TEST_CASE("tool call ids: Mistral Small 3.2's own template takes the id the gateway gave back in the next turn (and "
          "refuses the old call_ form, as it did)") {
  const std::string dir = BATON_SOURCE_DIR "/tests/data/chat_templates/real/";
  model_dir d{"mistral", read_file(dir + "mistral_small_3_2.jinja"),
              {"<s>", "</s>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
               "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"}};
  const auto t = d.load();
  REQUIRE(t->tool_calls() == tool_call_format::mistral);

  // The first turn: the model calls get_weather, and the gateway answers with the call's id.
  const std::string question = R"({"role": "user", "content": "Weather in Paris?"})";
  const auto first = chat_call(t->tool_calls(), "[" + question + "]");
  completion done;
  done.text = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}";
  done.finish_reason = "eos";
  const auto message = json::parse(deploy::openai::completion_json(first, done, "chatcmpl-1700000000-1", 0))["choices"][0]["message"];
  REQUIRE(message["tool_calls"].size() == 1);
  const auto id = message["tool_calls"][0]["id"].get<std::string>();
  CHECK(mistral_shaped(id));

  // The next turn, as a client sends it: the assistant's message as answered, then the result.
  const auto next_turn = [&](const json& assistant, const std::string& call_id) {
    const json tool = {{"role", "tool"}, {"tool_call_id", call_id}, {"content", "21"}};
    return chat_call(t->tool_calls(), "[" + question + ", " + assistant.dump() + ", " + tool.dump() + "]");
  };
  const auto second = next_turn(message, id);
  std::string text, why;
  REQUIRE_MESSAGE(t->render_chat(chat_of(second), gpu::chat_extras{{}, second.req.tools_json}, &text, &why), why);
  CHECK(text.find("[TOOL_CALLS]get_weather[CALL_ID]" + id + "[ARGS]") != std::string::npos);
  CHECK(text.find("[TOOL_RESULTS]" + id + "[TOOL_CONTENT]21[/TOOL_RESULTS]") != std::string::npos);

  // What the gateway gave before: refused by the template (an HTTP 400 on every second turn).
  json old = message;
  old["tool_calls"][0]["id"] = "call_1700000000-1-0-0";
  const auto refused = next_turn(old, "call_1700000000-1-0-0");
  CHECK_FALSE(t->render_chat(chat_of(refused), gpu::chat_extras{{}, refused.req.tools_json}, &text, &why));
  CHECK(why == "Tool call IDs should be alphanumeric strings with length 9!");
}

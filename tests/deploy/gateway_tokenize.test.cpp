// vLLM's /tokenize, /detokenize and /version over real sockets on 127.0.0.1: a prompt's count is
// the one its generation's usage reports (text and chat), ids come back as their text, and bad
// bodies are refused by field.

#include "tests/deploy/gateway_fixture.hpp"

using namespace baton;
using namespace baton::test_gateway;
using nlohmann::json;

TEST_CASE("/tokenize counts a prompt as its completion's usage does, /detokenize gives the ids' text back, "
          "add_special_tokens adds or leaves out the begin-of-text token") {
  // The built-in model under a chat template that writes the begin-of-text token itself.
  // Its tokenizer puts <|bos|> before a text prompt (add_bos_token), as Llama's do.
  const templated_model dir{"tokenize",
                            "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                            "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
                            true};
  served_cluster s{{}, 0, 0, dir.path.string()};
  const uint16_t port = s.gateway.port;
  const std::string prompt = "In the beginning God created";
  const auto tok = round_trip(port, post("/tokenize", json{{"model", "baton-kjv-tiny"}, {"prompt", prompt}}.dump()));
  REQUIRE_MESSAGE(tok.status == 200, tok.body);
  const auto t = json::parse(tok.body);
  const auto ids = t["tokens"].get<std::vector<int32_t>>();
  REQUIRE_FALSE(ids.empty());
  CHECK(t["count"] == ids.size());
  CHECK(t["token_strs"].is_null());
  const auto models = json::parse(round_trip(port, get("/v1/models")).body);
  CHECK(t["max_model_len"] == models["data"][0]["max_model_len"]);
  // The generation sees the same prompt.
  const auto done = round_trip(port, post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 1}}.dump()));
  REQUIRE(done.status == 200);
  CHECK(json::parse(done.body)["usage"]["prompt_tokens"] == ids.size());
  // Half a surrogate pair, escaped: read as U+FFFD by both, so the counts still agree (it was a
  // 400 at /tokenize alone).
  const std::string cut = R"({"prompt":"In the beginning \ud83d God")";
  const auto cut_tok = round_trip(port, post("/tokenize", cut + "}"));
  REQUIRE_MESSAGE(cut_tok.status == 200, cut_tok.body);
  const auto cut_done = round_trip(port, post("/v1/completions", cut + R"(,"max_tokens":1})"));
  REQUIRE_MESSAGE(cut_done.status == 200, cut_done.body);
  CHECK(json::parse(cut_done.body)["usage"]["prompt_tokens"] == json::parse(cut_tok.body)["count"]);
  // Back to text.
  const auto detok = round_trip(port, post("/detokenize", json{{"tokens", ids}}.dump()));
  REQUIRE_MESSAGE(detok.status == 200, detok.body);
  CHECK(json::parse(detok.body)["prompt"] == "<|bos|>" + prompt);  // the tokenizer's begin-of-text token first

  // A chat: the template's text, its begin-of-text token written out by /detokenize, and the
  // count its chat completion's usage gives.
  const json messages = json::array({{{"role", "user"}, {"content", "Who made the light?"}}});
  const auto chat = round_trip(port, post("/tokenize", json{{"messages", messages}}.dump()));
  REQUIRE_MESSAGE(chat.status == 200, chat.body);
  const auto chat_ids = json::parse(chat.body)["tokens"].get<std::vector<int32_t>>();
  const auto answered = round_trip(port, post("/v1/chat/completions", json{{"messages", messages}, {"max_tokens", 1}}.dump()));
  REQUIRE(answered.status == 200);
  CHECK(json::parse(answered.body)["usage"]["prompt_tokens"] == chat_ids.size());
  const auto chat_text = json::parse(round_trip(port, post("/detokenize", json{{"tokens", chat_ids}}.dump())).body)["prompt"];
  CHECK(chat_text == "<|bos|>user: Who made the light?\nassistant: ");
  // add_generation_prompt false: the text ends after the last message.
  const auto bare = round_trip(port, post("/tokenize", json{{"messages", messages}, {"add_generation_prompt", false}}.dump()));
  REQUIRE(bare.status == 200);
  CHECK(json::parse(bare.body)["count"] < chat_ids.size());

  // add_special_tokens: a chat given true gets a second begin-of-text token (as transformers'
  // encode does); a prompt given false has none, and its generation counts the same.
  const auto doubled = round_trip(port, post("/tokenize", json{{"messages", messages}, {"add_special_tokens", true}}.dump()));
  REQUIRE(doubled.status == 200);
  const auto doubled_ids = json::parse(doubled.body)["tokens"].get<std::vector<int32_t>>();
  REQUIRE(doubled_ids.size() == chat_ids.size() + 1);
  CHECK(doubled_ids[0] == chat_ids[0]);
  const auto without = round_trip(port, post("/tokenize", json{{"prompt", prompt}, {"add_special_tokens", false}}.dump()));
  REQUIRE(without.status == 200);
  CHECK(json::parse(without.body)["tokens"] == std::vector<int32_t>(ids.begin() + 1, ids.end()));
  const auto plain = round_trip(port, post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 1},
                                                                   {"add_special_tokens", false}}.dump()));
  REQUIRE(plain.status == 200);
  CHECK(json::parse(plain.body)["usage"]["prompt_tokens"] == ids.size() - 1);
  // An empty prompt is its begin-of-text token alone (vLLM's count), not refused.
  const auto empty = round_trip(port, post("/tokenize", json{{"prompt", ""}}.dump()));
  REQUIRE_MESSAGE(empty.status == 200, empty.body);
  CHECK(json::parse(empty.body)["tokens"] == std::vector<int32_t>{ids[0]});
}

TEST_CASE("add_special_tokens adds or drops only the token the model's tokenizer puts first: with none (the built-in "
          "model's BPE, as Qwen's), a text prompt's literal begin-of-text stays and a chat gets nothing added") {
  const templated_model dir{"tokenize-nobos", "{% for m in messages %}{{ m['content'] }}{% endfor %}"};
  served_cluster s{{}, 0, 0, dir.path.string()};
  const auto ids = [&](const json& body) {
    const auto a = round_trip(s.gateway.port, post("/tokenize", body.dump()));
    REQUIRE_MESSAGE(a.status == 200, a.body);
    return json::parse(a.body)["tokens"].get<std::vector<int32_t>>();
  };
  const std::string literal = "<|bos|>In the beginning";
  CHECK(ids({{"prompt", literal}, {"add_special_tokens", false}}) == ids({{"prompt", literal}}));
  const json messages = json::array({{{"role", "user"}, {"content", "In the beginning"}}});
  CHECK(ids({{"messages", messages}, {"add_special_tokens", true}}) == ids({{"messages", messages}}));
  CHECK(ids({{"prompt", ""}}).empty());  // no begin-of-text token: nothing
}

TEST_CASE("/tokenize and /detokenize refuse bad bodies by field, need the API key, and /version needs none") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  const auto refused = [&](const std::string& path, const json& body, int status = 400) {
    const auto a = round_trip(port, post(path, body.dump()));
    CHECK_MESSAGE(a.status == status, a.body);
    return a.status == status ? json::parse(a.body)["error"] : json{};
  };
  CHECK(refused("/tokenize", json::object())["message"] == "prompt is required");
  CHECK(refused("/tokenize", {{"prompt", "a"}, {"return_token_strs", true}})["param"] == "return_token_strs");
  CHECK(refused("/tokenize", {{"prompt", {"a", "b"}}})["message"] == "/tokenize takes one prompt, not a batch of 2");
  CHECK(refused("/tokenize", {{"prompt", "a"}, {"add_special_tokens", "yes"}})["param"] == "add_special_tokens");
  CHECK(refused("/tokenize", {{"prompt", "a"}, {"model", "gpt-4"}}, 404)["param"] == "model");
  CHECK(refused("/detokenize", {{"tokens", json::array()}})["param"] == "tokens");
  CHECK(refused("/detokenize", {{"tokens", {1, -2}}})["message"] ==
        "tokens[1] must be a token id (an integer >= 0), got -2");
  const auto outside = refused("/detokenize", {{"tokens", {1, 99999}}})["message"].get<std::string>();
  CHECK_MESSAGE(outside.find("token 99999 at position 1 is outside the vocabulary [0, ") != std::string::npos, outside);
  CHECK(round_trip(port, post("/tokenize", R"({"prompt":"a"})", "")).status == 401);
  CHECK(round_trip(port, post("/tokenize", "{")).status == 400);
  const auto version = round_trip(port, get("/version", ""));
  REQUIRE(version.status == 200);
  CHECK_FALSE(json::parse(version.body)["version"].get<std::string>().empty());
  CHECK(round_trip(port, get("/tokenize")).status == 405);
}

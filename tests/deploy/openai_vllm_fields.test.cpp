// vLLM's request fields beyond OpenAI's that a migrating client sends: each is implemented, or
// refused by name when it asks for something Baton does not do -- never taken and ignored (the
// answer would look right and be unrestricted). Their no-op values pass.

#include <doctest/doctest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "deploy/openai.hpp"

using namespace baton;

namespace {

deploy::openai::api_error refused(const std::string& body, bool chat = false) {
  deploy::openai::call c;
  deploy::openai::api_error e;
  CHECK_FALSE(deploy::openai::parse_body(body, chat, "m", &c, &e));
  return e;
}

bool taken(const std::string& body, bool chat = false, deploy::openai::call* out = nullptr) {
  deploy::openai::call c;
  deploy::openai::api_error e;
  const bool ok = deploy::openai::parse_body(body, chat, "m", &c, &e);
  if (!ok) MESSAGE(e.message);
  if (out) *out = c;
  return ok;
}

const std::string chat_body = R"({"messages":[{"role":"user","content":"a"}])";

}  // namespace

TEST_CASE("vLLM's fields Baton does not implement are refused by name when they ask for something; at their defaults "
          "they pass") {
  const struct {
    const char* asks;     ///< the field with a value that asks for something
    const char* no_op;    ///< the same field at its default
    const char* param;
  } fields[] = {
      {R"("allowed_token_ids":[293])", R"("allowed_token_ids":[])", "allowed_token_ids"},
      {R"("bad_words":["the"])", R"("bad_words":[])", "bad_words"},
      {R"("truncate_prompt_tokens":3)", R"("truncate_prompt_tokens":null)", "truncate_prompt_tokens"},
      {R"("skip_special_tokens":false)", R"("skip_special_tokens":true)", "skip_special_tokens"},
      {R"("spaces_between_special_tokens":false)", R"("spaces_between_special_tokens":true)", "spaces_between_special_tokens"},
      {R"("return_tokens_as_token_ids":true)", R"("return_tokens_as_token_ids":false)", "return_tokens_as_token_ids"},
      {R"("detokenize":false)", R"("detokenize":true)", "detokenize"},
      {R"("logits_processors":["x"])", R"("logits_processors":[])", "logits_processors"},
      {R"("chat_template":"{{ x }}")", R"("chat_template":"")", "chat_template"},
      {R"("documents":[{"text":"d"}])", R"("documents":[])", "documents"},
      {R"("modalities":["text","audio"])", R"("modalities":["text"])", "modalities"},
      {R"("audio":{"voice":"alloy"})", R"("audio":null)", "audio"},
      {R"("stream":true,"stream_options":{"continuous_usage_stats":true})",
       R"("stream":true,"stream_options":{"continuous_usage_stats":false})", "stream_options"},
      {R"("priority":5)", R"("priority":0)", "priority"},
  };
  for (const auto& f : fields) {
    CAPTURE(f.asks);
    for (bool chat : {false, true}) {
      const std::string head = chat ? chat_body : std::string{R"({"prompt":"a")"};
      const auto e = refused(head + "," + f.asks + "}", chat);
      CHECK(e.param == f.param);
      CHECK(e.message.find(f.param) == 0);
      CHECK(e.status == 400);
      CHECK(taken(head + "," + f.no_op + "}", chat));
    }
  }
  CHECK(refused(R"({"prompt":"a","priority":1.5})").message ==
        "priority must be \"interactive\" or \"batch\" (vLLM's integer priorities are not supported; 0 is taken as no "
        "priority), got 1.5");
  deploy::openai::call c;
  REQUIRE(taken(R"({"prompt":"a","priority":"batch"})", false, &c));
  CHECK(c.req.priority == "batch");
}

TEST_CASE("vLLM's add_generation_prompt and continue_final_message reach the chat template's renderer among its "
          "variables, beside chat_template_kwargs (the fields win); on completions, or not booleans, they are refused") {
  deploy::openai::call c;
  REQUIRE(taken(R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"The"}],
      "continue_final_message":true,"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false}})",
                true, &c));
  CHECK(nlohmann::json::parse(c.req.chat_template_kwargs) ==
        nlohmann::json{{"enable_thinking", false}, {"continue_final_message", true}, {"add_generation_prompt", false}});
  REQUIRE(taken(chat_body + R"(,"add_generation_prompt":false,"chat_template_kwargs":{"add_generation_prompt":true}})", true, &c));
  CHECK(nlohmann::json::parse(c.req.chat_template_kwargs) == nlohmann::json{{"add_generation_prompt", false}});
  REQUIRE(taken(chat_body + "}", true, &c));
  CHECK(c.req.chat_template_kwargs.empty());
  CHECK(refused(R"({"prompt":"a","continue_final_message":true})").message ==
        "continue_final_message is for /v1/chat/completions");
  CHECK(refused(chat_body + R"(,"add_generation_prompt":"no"})", true).message ==
        "add_generation_prompt must be true or false, got \"no\"");
}

TEST_CASE("vLLM's stop_reason: the stop string that matched, the stop token's id, or null; in a whole answer's "
          "choices and in a stream's last chunk (null in the chunks before, as vLLM's)") {
  using nlohmann::json;
  deploy::openai::call c;
  REQUIRE(taken(R"({"prompt":"a","stop":["x","yz"],"stop_token_ids":[7]})", false, &c));
  completion by_string, by_token, by_end;
  by_string.finish_reason = "stop", by_string.stop_string = "yz";
  by_token.finish_reason = "stop", by_token.stop_token = 7;
  by_end.finish_reason = "eos";
  c.n = 3;
  const auto whole = json::parse(deploy::openai::completion_json(c, {by_string, by_token, by_end}, "id", 0));
  CHECK(whole["choices"][0]["stop_reason"] == "yz");
  CHECK(whole["choices"][1]["stop_reason"] == 7);
  CHECK(whole["choices"][2]["stop_reason"].is_null());
  CHECK(whole["choices"][2]["finish_reason"] == "stop");
  stream_chunk middle, last;
  middle.text = "a";
  last.finish_reason = "stop", last.stop_string = "x";
  CHECK(json::parse(deploy::openai::chunk_json(c, middle, "id", 0, false, 0))["choices"][0]["stop_reason"].is_null());
  CHECK(json::parse(deploy::openai::chunk_json(c, last, "id", 0, false, 0))["choices"][0]["stop_reason"] == "x");
  deploy::openai::call chat;
  REQUIRE(taken(chat_body + "}", true, &chat));
  CHECK(json::parse(deploy::openai::chunk_json(chat, last, "id", 0, false, 0))["choices"][0]["stop_reason"] == "x");
}

// The gateway's pure parts, without sockets or actors: OpenAI bodies into generate_request,
// answers into OpenAI's JSON, and what streaming may show of a text (the HTTP parser: http.test.cpp).

#include <doctest/doctest.h>

#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "actors/messages.hpp"
#include "actors/request.hpp"
#include "deploy/http.hpp"
#include "deploy/openai.hpp"

using namespace baton;
using nlohmann::json;

TEST_CASE("streamable_prefix holds back half a UTF-8 character and the start of a stop string") {
  CHECK(streamable_prefix("hello", {}) == 5);
  CHECK(streamable_prefix("caf\xC3", {}) == 3);          // é's first byte only
  CHECK(streamable_prefix("caf\xC3\xA9", {}) == 5);      // é complete
  CHECK(streamable_prefix("x\xE2\x82", {}) == 1);        // € missing its last byte
  CHECK(streamable_prefix("x\xF0\x9F\x98\x80", {}) == 5);  // a whole emoji
  CHECK(streamable_prefix("the end. S", {"STOP"}) == 9);
  CHECK(streamable_prefix("the end. ST", {"STOP", "xyz"}) == 9);
  CHECK(streamable_prefix("the end. SX", {"STOP"}) == 11);
  CHECK(streamable_prefix("abc", {"", "bcd"}) == 1);
}

TEST_CASE("OpenAI request bodies map onto generate_request, and refusals name the field") {
  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE(deploy::openai::parse_body(R"({"model":"m","prompt":"hi","max_tokens":5,"temperature":0.5,"top_p":0.9,
      "top_k":-1,"seed":7,"stop":"\n","stream":true,"stream_options":{"include_usage":true},"user":"x"})",
                                     false, "m", &c, &e));
  CHECK(c.req.prompt == "hi");
  CHECK(c.req.max_tokens == 5);
  CHECK(c.req.temperature == doctest::Approx(0.5));
  CHECK(c.req.top_k == 0);
  CHECK(c.req.seed == 7);
  CHECK(c.req.stop == std::vector<std::string>{"\n"});
  CHECK(c.stream);
  CHECK(c.include_usage);
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"hi","frequency_penalty":0.5,"presence_penalty":-0.25})", false, "m", &c, &e));
  CHECK(c.req.frequency_penalty == 0.5f);
  CHECK(c.req.presence_penalty == -0.25f);
  REQUIRE(deploy::openai::parse_body(R"({"prompt":[1,2,3]})", false, "m", &c, &e));
  CHECK(c.req.prompt_tokens == std::vector<int32_t>{1, 2, 3});
  CHECK(c.req.max_tokens == deploy::openai::default_completion_tokens);
  CHECK(c.model == "m");
  REQUIRE(deploy::openai::parse_body(
      R"({"messages":[{"role":"developer","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]})",
      true, "m", &c, &e));
  REQUIRE(c.req.messages.size() == 2);
  CHECK(c.req.messages[0].role == "system");
  CHECK(c.req.messages[1].content == "a\nb");  // joined by a newline, as vLLM joins text parts
  CHECK(c.req.max_tokens == 0);  // not given: the router gives what the context leaves (OpenAI's chat default)
  auto refused = [&](const std::string& body, bool chat = false) {
    e = {};
    CHECK_FALSE(deploy::openai::parse_body(body, chat, "m", &c, &e));
    return e;
  };
  // Where and what, without nlohmann's quote of the text (it may hold bytes that are no UTF-8).
  CHECK(refused("{not json").message == "the body is not valid JSON (line 1, column 3: syntax error while parsing "
                                        "object key - invalid literal; expected string literal)");
  const auto bad_utf8 = refused("{\"prompt\":\"a\xff\"}").message;
  CHECK_MESSAGE(bad_utf8.rfind("the body is not valid JSON (line 1, column ", 0) == 0, bad_utf8);
  CHECK(bad_utf8.find('\xff') == std::string::npos);
  // Half a surrogate pair, escaped (a JS or Python client cut a string inside an emoji): U+FFFD,
  // as those languages' own parsers read it; whole pairs and an escaped backslash stay as sent.
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a\ud83d|\ude42|\ud83d\ude42|\\ud83d"})", false, "m", &c, &e));
  CHECK(c.req.prompt == "a\xef\xbf\xbd|\xef\xbf\xbd|\xf0\x9f\x99\x82|\\ud83d");
  // Valid JSON whose number a double cannot hold: said as such, not as a syntax error.
  CHECK(refused(R"({"prompt":"a","temperature":1e400})").message == "a number in the body is out of range, got 1e400");
  CHECK(refused(R"({"prompt":"a","n":0})").param == "n");
  CHECK(refused(R"({"prompt":"a","n":65})").message == "n must be in [1, 64], got 65");
  CHECK(refused(R"({"prompt":"a","logprobs":21})").message == "logprobs must be in [0, 20], got 21");
  CHECK(refused(R"({"prompt":"a","logprobs":true})").param == "logprobs");  // completions: a count
  CHECK(refused(R"({"messages":[{"role":"user","content":"x"}],"echo":true})", true).message ==
        "echo is supported on /v1/completions only");
  CHECK(refused(R"({"prompt":"a","echo":1})").message == "echo must be true or false");
  CHECK(refused(R"({"prompt":"a","max_tokens":0})").message ==
        "max_tokens must be at least 1 (0 asks for the prompt's scores alone, with echo: true)");
  CHECK(refused(R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})", true).message ==
        "top_logprobs needs logprobs: true");
  CHECK(refused(R"({"prompt":"a","frequency_penalty":2.5})").message == "frequency_penalty must be in [-2, 2], got 2.5");
  CHECK(refused(R"({"prompt":"a","max_tokens":"5"})").param == "max_tokens");
  CHECK(refused(R"({"prompt":"a","max_tokens":2.5})").message.find("integer") != std::string::npos);
  // The real upper limit is the router's (max_new_tokens_limit, the context), unknown here: not
  // quoted as 2147483647.
  CHECK(refused(R"({"prompt":"a","max_tokens":-1})").message == "max_tokens must be >= 1, got -1");
  CHECK(refused(R"({"messages":[{"role":"user","content":"x"}],"max_tokens":-1})", true).message ==
        "max_tokens must be >= 1, got -1");
  CHECK(refused(R"({"messages":[{"role":"user","content":"x"}],"max_completion_tokens":-1})", true).message ==
        "max_completion_tokens must be >= 1, got -1");
  CHECK(refused(R"({"prompt":"a","max_tokens":3000000000})").message == "max_tokens 3000000000 exceeds the server's limit");
  CHECK(refused(R"({"prompt":"a","min_tokens":-1})").message == "min_tokens must be >= 0, got -1");
  CHECK(refused(R"({"prompt":"a","temperature":7})").message == "temperature must be in [0, 2], got 7");
  for (const char* p : {"2", "-0.5"})
    CHECK(refused(std::string{R"({"prompt":"a","top_p":)"} + p + "}").message == std::string{"top_p must be in [0, 1], got "} + p);
  // top_p 0, as OpenAI takes it: the most likely token alone (top_k 1; the sampler's top_p is in (0, 1]).
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","top_p":0,"temperature":0.7})", false, "m", &c, &e));
  CHECK(c.req.top_k == 1);
  CHECK(c.req.top_p == 1.0f);
  CHECK(c.top_k_given);  // the model's default top_k does not replace it
  CHECK(refused(R"({"prompt":"a","user":5})").message == "user must be a string, got 5");
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","user":"u-1","metadata":{"k":"v"},"store":true,"service_tier":"flex"})",
                                     false, "m", &c, &e));
  CHECK(refused(R"({"prompt":["a",[1]]})").message == "prompt[1]: a batch holds strings only, or non-empty token-id arrays only");
  CHECK(refused(R"({"prompt":[[1],[]]})").message == "prompt[1]: a batch holds strings only, or non-empty token-id arrays only");
  CHECK(refused(R"({"prompt":[[1],[2,-1]]})").message == "prompt[1] token ids must be non-negative integers");
  CHECK(refused(R"({"prompt":[]})").param == "prompt");
  CHECK(refused(R"({"prompt":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"],"n":64})").message ==
        "17 prompts times n 64 is 1088 generations; at most 1024 in one call");
  CHECK(refused(R"({"prompt":[1,-2]})").param == "prompt");
  CHECK(refused(R"({"prompt":"a","model":"gpt-4"})").status == 404);
  CHECK(refused(R"({"messages":[{"role":"function","content":"x"}]})", true).param == "messages[0].role");
  // Every accepted role is listed (developer was accepted but left out).
  CHECK(refused(R"({"messages":[{"role":"wizard","content":"x"}]})", true).message ==
        "messages[0].role must be system, developer, user, assistant or tool, got 'wizard'");
  // Content is required but for an assistant turn with tool calls (a user turn without it passed).
  for (const char* m : {R"({"role":"user"})", R"({"role":"user","content":null})"}) {
    const auto e2 = refused(std::string{R"({"messages":[)"} + m + "]}", true);
    CHECK(e2.param == "messages[0].content");
    CHECK(e2.message == "messages[0].content is required for a user message");
  }
  CHECK(refused(R"({"messages":[{"role":"user","content":"x"},{"role":"tool","tool_call_id":"c"}]})", true).message ==
        "messages[1].content is required for a tool message");
  // A tool message names the call it answers (OpenAI requires it; templates print it).
  for (const char* tool : {R"({"role":"tool","content":"21"})", R"({"role":"tool","tool_call_id":7,"content":"21"})",
                           R"({"role":"tool","tool_call_id":"","content":"21"})"}) {
    const auto e3 = refused(std::string{R"({"messages":[{"role":"user","content":"x"},)"} + tool + "]}", true);
    CHECK(e3.param == "messages[1].tool_call_id");
    CHECK(e3.message == "messages[1].tool_call_id is required for a tool message: the id of the assistant's tool call "
                        "it answers, as a non-empty string");
  }
  CHECK(refused(R"({"messages":[{"role":"developer"},{"role":"user","content":"x"}]})", true).message ==
        "messages[0].content is required for a developer message");
  CHECK(refused(R"({"messages":[{"role":"user","content":"x"},{"role":"assistant"}]})", true).message ==
        "messages[1].content is required for an assistant message without tool_calls");
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"},{"role":"assistant","tool_calls":
      [{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c","content":""}]})",
                                     true, "m", &c, &e));
  CHECK(c.req.messages.size() == 3);
  // An assistant turn an SDK echoes back with a refusal and null content, or with function_call
  // null (the older SDKs' dump of a message).
  for (const char* a : {R"({"role":"assistant","content":null,"refusal":"I cannot help with that."})",
                        R"({"role":"assistant","content":"ok","function_call":null})"})
    CHECK_MESSAGE(deploy::openai::parse_body(std::string{R"({"messages":[{"role":"user","content":"x"},)"} + a +
                                                 R"(,{"role":"user","content":"y"}]})",
                                             true, "m", &c, &e),
                  e.message);
  // A legacy function_call was taken and dropped (the call vanished from the chat): refused by name.
  const auto legacy = refused(R"({"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,
      "function_call":{"name":"f","arguments":"{}"}}]})", true);
  CHECK(legacy.param == "messages[1].function_call");
  CHECK(legacy.message.find("send it as tool_calls") != std::string::npos);
  CHECK(refused(R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", true).param ==
        "messages[0].content");
  CHECK(refused(R"({"prompt":"a","stop":["ok",""]})").param == "stop");
  CHECK(refused(R"({"prompt":"a","tools":[{"type":"function"}]})").param == "tools");
  CHECK(refused(R"({"prompt":"a","suffix":"b"})").message == "suffix is not supported");
  // vLLM's min_p and min_tokens are read; out of range or mistyped, refused by name.
  CHECK(refused(R"({"prompt":"a","min_p":1.5})").param == "min_p");
  CHECK(refused(R"({"prompt":"a","min_tokens":-1})").param == "min_tokens");
  CHECK(refused(R"({"prompt":"a","min_tokens":2.5})").param == "min_tokens");
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","min_p":0.05,"min_tokens":4})", false, "m", &c, &e));
  CHECK(c.req.min_p == doctest::Approx(0.05));
  CHECK(c.req.min_tokens == 4);
  // vLLM's beam search, which Baton does not compute: refused unless false (it was ignored silently).
  CHECK(refused(R"({"prompt":"a","use_beam_search":true})").message == "use_beam_search is not supported (only false)");
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","min_p":0.0,"min_tokens":0,"use_beam_search":false})",
                                     false, "m", &c, &e));
  CHECK_FALSE(c.req.include_stop_str_in_output);
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","include_stop_str_in_output":true})", false, "m", &c, &e));
  CHECK(c.req.include_stop_str_in_output);
  CHECK(refused(R"({"prompt":"a","include_stop_str_in_output":1})").param == "include_stop_str_in_output");
  // logit_bias: token ids (as the object's keys) to biases in [-100, 100].
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","logit_bias":{"50256":-100,"7":2.5}})", false, "m", &c, &e));
  CHECK(c.req.logit_bias_tokens == std::vector<int32_t>{50256, 7});
  CHECK(c.req.logit_bias_values == std::vector<float>{-100.0f, 2.5f});
  CHECK(refused(R"({"prompt":"a","logit_bias":{"x1":1}})").message ==
        "logit_bias keys must be token ids (decimal integers >= 0), got 'x1'");
  CHECK(refused(R"({"prompt":"a","logit_bias":{"-3":1}})").param == "logit_bias");
  CHECK(refused(R"({"prompt":"a","logit_bias":{"3":101}})").message == "logit_bias of token 3 must be a number in [-100, 100], got 101");
  CHECK(refused(R"({"prompt":"a","logit_bias":{"3":"1"}})").param == "logit_bias");
  CHECK(refused(R"({"prompt":"a","logit_bias":[1]})").param == "logit_bias");
  // Fields of the wrong type, where a string was expected inside: a 400 naming the field, never
  // an exception through the gateway (these threw nlohmann's type_error, and the connection died).
  CHECK(refused(R"({"messages":[{"role":"user","content":[{"type":1,"text":"x"}]}]})", true).param == "messages[0].content");
  CHECK(refused(R"({"prompt":"a","response_format":{"type":5}})").param == "response_format");
  // An unknown type is named, with the accepted ones (it said only "got an object").
  CHECK(refused(R"({"prompt":"a","response_format":{"type":"xml"}})").message ==
        R"(response_format.type must be "text", "json_object" or "json_schema", got "xml")");
  CHECK(refused(R"({"prompt":"a","response_format":{"type":"json_schema"}})").param == "response_format");
  CHECK(refused(R"({"prompt":"a","response_format":{"type":"json_schema","json_schema":{"name":"x"}}})").message ==
        "response_format.json_schema needs its schema");
  CHECK(refused(R"({"prompt":"a","functions":[{"name":"f"}]})").param == "functions");
  // Nesting 100,000 deep in a number field: printing it for the message recursed that deep and
  // crashed the process.
  const std::string deep = R"({"prompt":"a","max_tokens":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  CHECK(refused(deep).message.find("deeper than 64 levels") != std::string::npos);
  CHECK(refused(R"({"prompt":"a","max_tokens":[[1]]})").message == "max_tokens must be a number, got an array of 1");
  CHECK(refused(R"({"prompt":"a","stream_options":{"include_usage":true}})").param == "stream_options");
  // Seeds: any 64-bit integer, exactly (a double would round the second).
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","seed":-1})", false, "m", &c, &e));
  CHECK(c.req.seed == ~uint64_t{0});
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","seed":9007199254740993})", false, "m", &c, &e));
  CHECK(c.req.seed == 9007199254740993ull);
  CHECK(refused(R"({"prompt":"a","seed":1.5})").param == "seed");
}

TEST_CASE("logprobs: completions take a count, chat a flag and top_logprobs; both render OpenAI's shapes, with "
          "-9999 for a token that could not be picked and each token's bytes in chat") {
  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","logprobs":2})", false, "m", &c, &e));
  CHECK(c.req.logprobs);
  CHECK(c.req.top_logprobs == 2);
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","logprobs":0})", false, "m", &c, &e));
  CHECK(c.req.logprobs);
  CHECK(c.req.top_logprobs == 0);
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a"})", false, "m", &c, &e));
  CHECK_FALSE(c.req.logprobs);
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","logprobs":false})", false, "m", &c, &e));  // as null
  CHECK_FALSE(c.req.logprobs);
  // text_offset counts characters: a token ending inside one counts it, the rest of it does not.
  CHECK(deploy::openai::utf8_chars("h\xc3") == 2);
  CHECK(deploy::openai::utf8_chars("\xa9x") == 1);
  completion done;
  done.tokens = {104, 195};
  done.text = "h\xc3";
  done.finish_reason = "length";
  done.logprobs = {{104, -0.5f, "h", {104, 105}, {-0.5f, -1.5f}, {"h", "i"}},
                   {195, -std::numeric_limits<float>::infinity(), "\xc3", {}, {}, {}}};
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","logprobs":2})", false, "m", &c, &e));
  auto lp = json::parse(deploy::openai::completion_json(c, done, "id", 0))["choices"][0]["logprobs"];
  CHECK(lp["tokens"].size() == 2);
  CHECK(lp["token_logprobs"] == json::array({-0.5, -9999.0}));
  CHECK(lp["top_logprobs"][0] == json{{"h", -0.5}, {"i", -1.5}});
  CHECK(lp["text_offset"] == json::array({0, 1}));
  // A stream's chunk carries its own tokens, offset past the ones streamed before.
  stream_chunk chunk;
  chunk.tokens = {195};
  chunk.logprobs = {done.logprobs[1]};
  auto clp = json::parse(deploy::openai::chunk_json(c, chunk, "id", 0, false, 1))["choices"][0]["logprobs"];
  CHECK(clp["text_offset"] == json::array({1}));
  // Chat: an entry per token, with its bytes (half a UTF-8 character as it is).
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":2})",
                                     true, "m", &c, &e));
  auto chat = json::parse(deploy::openai::completion_json(c, done, "id", 0))["choices"][0]["logprobs"]["content"];
  REQUIRE(chat.size() == 2);
  CHECK(chat[0]["token"] == "h");
  CHECK(chat[0]["logprob"] == -0.5);
  CHECK(chat[0]["bytes"] == json::array({104}));
  CHECK(chat[0]["top_logprobs"][1] == json{{"token", "i"}, {"logprob", -1.5}, {"bytes", json::array({105})}});
  CHECK(chat[1]["bytes"] == json::array({195}));
  CHECK(chat[1]["logprob"] == -9999.0);
  // Not asked: null, as before.
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a"})", false, "m", &c, &e));
  CHECK(json::parse(deploy::openai::completion_json(c, done, "id", 0))["choices"][0]["logprobs"].is_null());
}

TEST_CASE("vLLM's prompt_logprobs: per prompt token an object keyed by token id with logprob, rank and text, the k "
          "most likely added; in each completions choice, at the top of a chat answer; echo's own alternatives stay "
          "as logprobs asks") {
  deploy::openai::call c;
  deploy::openai::api_error e;
  completion done;
  done.num_prompt_tokens = 3;
  done.tokens = {120};
  done.text = "x";
  done.finish_reason = "length";
  done.prompt_text = "ab";
  done.prompt_logprobs = {{1, std::numeric_limits<float>::quiet_NaN(), "", {}, {}, {}},
                          {97, -2.0f, "a", {98, 99}, {-1.0f, -1.5f}, {"b", "c"}, 3},
                          {98, -0.5f, "b", {98, 97}, {-0.5f, -1.0f}, {"b", "a"}, 1}};
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":1})", true, "m", &c, &e));
  CHECK(c.vllm_prompt_logprobs);
  CHECK(c.req.prompt_logprobs);
  CHECK(c.req.prompt_top_logprobs == 1);
  CHECK_FALSE(c.req.logprobs);
  auto chat = json::parse(deploy::openai::completion_json(c, done, "id", 0));
  const json want = json::array(
      {nullptr,
       {{"97", {{"logprob", -2.0}, {"rank", 3}, {"decoded_token", "a"}}}, {"98", {{"logprob", -1.0}, {"rank", 1}, {"decoded_token", "b"}}}},
       {{"98", {{"logprob", -0.5}, {"rank", 1}, {"decoded_token", "b"}}}}});
  CHECK(chat["prompt_logprobs"] == want);
  CHECK_FALSE(chat["choices"][0].contains("prompt_logprobs"));
  // Completions: in the choice. With echo and logprobs 1 besides, echo's alternatives stay one.
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"ab","echo":true,"logprobs":1,"prompt_logprobs":2})", false, "m", &c, &e));
  CHECK(c.req.prompt_top_logprobs == 2);
  CHECK(c.req.top_logprobs == 1);
  auto text = json::parse(deploy::openai::completion_json(c, done, "id", 0))["choices"][0];
  CHECK(text["prompt_logprobs"][1].size() == 3);  // the token and the two most likely
  CHECK(text["prompt_logprobs"][1]["99"]["rank"] == 2);
  CHECK(text["logprobs"]["top_logprobs"][1] == json{{"a", -2.0}, {"b", -1.0}});  // the most likely, and the token
  // Refused: streamed, past 20, negative.
  CHECK_FALSE(deploy::openai::parse_body(R"({"prompt":"a","prompt_logprobs":0,"stream":true})", false, "m", &c, &e));
  CHECK(e.param == "prompt_logprobs");
  CHECK_FALSE(deploy::openai::parse_body(R"({"prompt":"a","prompt_logprobs":-1})", false, "m", &c, &e));
  CHECK(e.param == "prompt_logprobs");
}

TEST_CASE("echo: the prompt comes back before the completion, its tokens' log-probabilities first (null for the "
          "first token), and max_tokens 0 answers the prompt alone") {
  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"ab","echo":true,"logprobs":1,"max_tokens":0})", false, "m", &c, &e));
  CHECK(c.req.echo);
  CHECK(c.req.prompt_logprobs);
  CHECK(c.req.prompt_only);
  CHECK(c.req.max_tokens == 1);  // the prefill's pick, not shown
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"ab","echo":true})", false, "m", &c, &e));
  CHECK(c.req.echo);
  CHECK_FALSE(c.req.prompt_logprobs);  // the text alone needs no scores
  CHECK_FALSE(c.req.prompt_only);
  completion done;
  done.num_prompt_tokens = 3;
  done.tokens = {120};
  done.text = "x";
  done.finish_reason = "length";
  done.prompt_text = "ab";
  done.logprobs = {{120, -0.25f, "x", {120}, {-0.25f}, {"x"}}};
  done.prompt_logprobs = {{1, std::numeric_limits<float>::quiet_NaN(), "", {}, {}, {}},
                          {97, -2.0f, "a", {98}, {-1.0f}, {"b"}},
                          {98, -0.5f, "b", {98}, {-0.5f}, {"b"}}};
  // Echo without logprobs: the text only.
  auto plain = json::parse(deploy::openai::completion_json(c, done, "id", 0))["choices"][0];
  CHECK(plain["text"] == "abx");
  CHECK(plain["logprobs"].is_null());
  // With logprobs: the prompt's tokens, then the completion's, offsets running on.
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"ab","echo":true,"logprobs":1})", false, "m", &c, &e));
  auto both = json::parse(deploy::openai::completion_json(c, done, "id", 0));
  auto lp = both["choices"][0]["logprobs"];
  CHECK(both["choices"][0]["text"] == "abx");
  CHECK(lp["tokens"] == json::array({"", "a", "b", "x"}));
  CHECK(lp["token_logprobs"] == json::array({nullptr, -2.0, -0.5, -0.25}));
  CHECK(lp["top_logprobs"][0].is_null());
  CHECK(lp["top_logprobs"][1] == json{{"a", -2.0}, {"b", -1.0}});  // "a" not the most likely: there too
  CHECK(lp["text_offset"] == json::array({0, 0, 1, 2}));
  CHECK(both["usage"]["completion_tokens"] == 1);
  // max_tokens 0: the prompt alone, nothing generated is shown or counted.
  REQUIRE(deploy::openai::parse_body(R"({"prompt":[1,97,98],"echo":true,"logprobs":1,"max_tokens":0})", false, "m", &c, &e));
  auto alone = json::parse(deploy::openai::completion_json(c, done, "id", 0));
  CHECK(alone["choices"][0]["text"] == "ab");  // token ids: as they decode
  CHECK(alone["choices"][0]["logprobs"]["tokens"].size() == 3);
  CHECK(alone["choices"][0]["finish_reason"] == "length");
  CHECK(alone["usage"]["completion_tokens"] == 0);
  CHECK(alone["usage"]["prompt_tokens"] == 3);
  // Streamed: the first chunk brings the prompt ahead of its token; with max_tokens 0, only it.
  stream_chunk first;
  first.tokens = {120};
  first.text = "x";
  first.logprobs = done.logprobs;
  first.prompt_text = "ab";
  first.prompt_logprobs = done.prompt_logprobs;
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"ab","echo":true,"logprobs":1,"stream":true})", false, "m", &c, &e));
  auto ev = json::parse(deploy::openai::chunk_json(c, first, "id", 0, true))["choices"][0];
  CHECK(ev["text"] == "abx");
  CHECK(ev["logprobs"]["token_logprobs"] == json::array({nullptr, -2.0, -0.5, -0.25}));
  stream_chunk later;
  later.tokens = {121};
  later.text = "y";
  later.logprobs = {{121, -1.0f, "y", {121}, {-1.0f}, {"y"}}};
  later.finish_reason = "length";
  ev = json::parse(deploy::openai::chunk_json(c, later, "id", 0, false, 3))["choices"][0];
  CHECK(ev["text"] == "y");
  CHECK(ev["logprobs"]["text_offset"] == json::array({3}));
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"ab","echo":true,"max_tokens":0,"stream":true})", false, "m", &c, &e));
  CHECK(json::parse(deploy::openai::chunk_json(c, first, "id", 0, true))["choices"][0]["text"] == "ab");
  ev = json::parse(deploy::openai::chunk_json(c, later, "id", 0, false))["choices"][0];
  CHECK(ev["text"] == "");
  CHECK(ev["finish_reason"] == "length");
}

TEST_CASE("a batch of prompts: choice i answers prompt i / n with seed + i % n (+ i without a seed: every prompt its "
          "own draws), echo shows each its own prompt, and usage counts each prompt once") {
  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE(deploy::openai::parse_body(R"({"prompt":["one","two"],"n":2,"seed":10,"echo":true})", false, "m", &c, &e));
  REQUIRE(c.num_prompts() == 2);
  REQUIRE(c.num_choices() == 4);
  CHECK(c.choice_request(0).prompt == "one");
  CHECK(c.choice_request(1).prompt == "one");
  CHECK(c.choice_request(1).seed == 11);
  CHECK(c.choice_request(2).prompt == "two");
  CHECK(c.choice_request(2).seed == 10);
  CHECK(c.choice_request(3).seed == 11);
  // No seed (the gateway draws one per call): identical prompts in a batch drew identical text.
  REQUIRE(deploy::openai::parse_body(R"({"prompt":["same","same","same"]})", false, "m", &c, &e));
  c.req.seed = 77;
  CHECK(c.choice_request(0).seed == 77);
  CHECK(c.choice_request(1).seed == 78);
  CHECK(c.choice_request(2).seed == 79);
  REQUIRE(deploy::openai::parse_body(R"({"prompt":["one","two"],"n":2,"echo":true,"logprobs":0})", false, "m", &c, &e));
  CHECK(c.choice_request(0).prompt_logprobs);  // each prompt scored once, by its first choice
  CHECK_FALSE(c.choice_request(1).prompt_logprobs);
  CHECK(c.choice_request(2).prompt_logprobs);
  REQUIRE(deploy::openai::parse_body(R"({"prompt":["one","two"],"n":2,"seed":10,"echo":true})", false, "m", &c, &e));
  std::vector<completion> done(4);
  for (size_t i = 0; i < 4; ++i) {
    done[i].num_prompt_tokens = i < 2 ? 4 : 5;
    done[i].tokens = {1, 2};
    done[i].text = std::string{"!"} + std::to_string(i);  // not "!" + ...: GCC 12 warns falsely (-Wrestrict)
    done[i].finish_reason = "length";
  }
  auto out = json::parse(deploy::openai::completion_json(c, done, "id", 0));
  REQUIRE(out["choices"].size() == 4);
  CHECK(out["choices"][0]["text"] == "one!0");
  CHECK(out["choices"][3]["text"] == "two!3");
  CHECK(out["choices"][3]["index"] == 3);
  CHECK(out["usage"]["prompt_tokens"] == 9);  // 4 + 5: each prompt once
  CHECK(out["usage"]["completion_tokens"] == 8);
  // Token-id batches, as evaluation harnesses send them; a batch of one is a plain prompt.
  REQUIRE(deploy::openai::parse_body(R"({"prompt":[[1,2],[3]]})", false, "m", &c, &e));
  CHECK(c.choice_request(1).prompt_tokens == std::vector<int32_t>{3});
  REQUIRE(deploy::openai::parse_body(R"({"prompt":[[1,2]]})", false, "m", &c, &e));
  CHECK(c.num_prompts() == 1);
  CHECK(c.req.prompt_tokens == std::vector<int32_t>{1, 2});
  REQUIRE(deploy::openai::parse_body(R"({"prompt":["x"]})", false, "m", &c, &e));
  CHECK(c.num_prompts() == 1);
  CHECK(c.req.prompt == "x");
}

TEST_CASE("best_of: best_of generations per prompt, the n with the highest log-probability per token answered, best "
          "first; usage counts every generation; logprobs shown only when asked; bad combinations refused by name") {
  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE(deploy::openai::parse_body(R"({"prompt":["one","two"],"n":2,"best_of":3,"seed":10})", false, "m", &c, &e));
  CHECK(c.n == 3);  // generations per prompt
  CHECK(c.best_of_keep == 2);
  CHECK(c.num_choices() == 6);
  CHECK(c.req.logprobs);  // on, to rank them
  CHECK(c.logprobs_for_ranking);
  CHECK(c.choice_request(4).prompt == "two");
  CHECK(c.choice_request(4).seed == 11);
  // Per token: prompt one's generations -1.0, -0.5, -2.0; prompt two's -3.0, (none), -0.1.
  const std::vector<std::vector<float>> lps = {{-1, -1}, {-0.5f, -0.5f, -0.5f}, {-2}, {-3}, {}, {-0.1f}};
  std::vector<completion> done(6);
  for (size_t i = 0; i < 6; ++i) {
    done[i].num_prompt_tokens = 4;
    done[i].text = std::string{"g"} + std::to_string(i);
    done[i].finish_reason = "length";
    for (float v : lps[i]) {
      done[i].tokens.push_back(1);
      done[i].logprobs.push_back(token_logprob{1, v, "x", {}, {}, {}});
    }
  }
  const auto kept = deploy::openai::best_of_choices(c, done);
  REQUIRE(kept.size() == 4);
  CHECK(kept[0].text == "g1");
  CHECK(kept[1].text == "g0");
  CHECK(kept[2].text == "g5");
  CHECK(kept[3].text == "g3");  // a generation with no token ranks last
  auto out = json::parse(deploy::openai::completion_json(c, done, "id", 0));
  REQUIRE(out["choices"].size() == 4);
  CHECK(out["choices"][0]["text"] == "g1");
  CHECK(out["choices"][3]["index"] == 3);
  CHECK(out["choices"][0]["logprobs"].is_null());  // not asked for
  CHECK(out["usage"]["completion_tokens"] == 8);   // all six generations: 2 + 3 + 1 + 1 + 0 + 1
  CHECK(out["usage"]["prompt_tokens"] == 8);       // each prompt once
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"one","best_of":2,"logprobs":1})", false, "m", &c, &e));
  CHECK_FALSE(c.logprobs_for_ranking);
  out = json::parse(deploy::openai::completion_json(c, std::vector<completion>{done[0], done[1]}, "id", 0));
  REQUIRE(out["choices"].size() == 1);
  CHECK(out["choices"][0]["text"] == "g1");
  CHECK(out["choices"][0]["logprobs"]["token_logprobs"].size() == 3);  // asked for: shown
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"one","n":2,"best_of":2})", false, "m", &c, &e));
  CHECK(c.best_of_keep == 0);  // best_of == n: every generation answered
  CHECK_FALSE(c.req.logprobs);

  auto refused = [&](const std::string& body, bool chat = false) {
    e = {};
    CHECK_FALSE(deploy::openai::parse_body(body, chat, "m", &c, &e));
    CHECK(e.param == "best_of");
    return e.message;
  };
  CHECK(refused(R"({"prompt":"a","n":3,"best_of":2})") == "best_of (2) must be at least n (3)");
  CHECK(refused(R"({"prompt":"a","best_of":2,"stream":true})").find("not streamed") != std::string::npos);
  CHECK(refused(R"({"prompt":"a","best_of":2,"echo":true})").find("echo") != std::string::npos);
  CHECK(refused(R"({"prompt":"a","best_of":65})") == "best_of must be in [1, 64], got 65");
  CHECK(refused(R"({"messages":[{"role":"user","content":"x"}],"best_of":2})", true) == "best_of is for /v1/completions");
  CHECK(refused(R"({"prompt":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"],"best_of":64})") ==
        "17 prompts times best_of 64 is 1088 generations; at most 1024 in one call");
}

TEST_CASE("a thinking model's chat answer: reasoning_content up to the first </think>, content after it, told apart "
          "as it streams even when the tag is cut between pieces") {
  using deploy::openai::reasoning_splitter;
  {
    reasoning_splitter s;
    auto a = s.feed("Let me think.</th", false);  // the tag's start is held back
    CHECK(a.reasoning == "Let me think.");
    CHECK(a.content.empty());
    auto b = s.feed("ink>\n\nYes.", false);
    CHECK(b.reasoning.empty());
    CHECK(b.content == "\n\nYes.");
    CHECK(s.feed(" </think> stays", true).content == " </think> stays");  // only the first closes
  }
  {
    reasoning_splitter s;  // a held tail that was no tag after all goes out with the next piece
    CHECK(s.feed("a <", false).reasoning == "a ");
    CHECK(s.feed("b", false).reasoning == "<b");
    CHECK(s.feed("</", true).reasoning == "</");  // the last piece holds nothing back
  }
  {
    reasoning_splitter s{false};  // the model opens <think> itself, or not (Qwen3)
    CHECK(s.feed("\n <thi", false).reasoning.empty());  // not known yet: held
    auto a = s.feed("nk>\nhmm</think>ok", false);
    CHECK(a.reasoning == "\nhmm");
    CHECK(a.content == "ok");
    reasoning_splitter plain{false};
    CHECK(plain.feed(" ", false).content.empty());
    CHECK(plain.feed(" Hello", false).content == "  Hello");  // no <think>: all content
    CHECK(plain.feed("</think>", true).content == "</think>");
    CHECK(deploy::openai::split_reasoning("<thin", false).content == "<thin");  // the end decides
  }
  CHECK(deploy::openai::split_reasoning("all thinking").reasoning == "all thinking");
  CHECK(deploy::openai::split_reasoning("all thinking").content.empty());
  CHECK(deploy::openai::split_reasoning("</think>answer").content == "answer");

  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}]})", true, "m", &c, &e));
  CHECK(c.reasoning_wanted);
  CHECK_FALSE(c.separate_reasoning);  // the gateway sets it, for a model that thinks
  CHECK_FALSE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"separate_reasoning":"no"})",
                                         true, "m", &c, &e));
  CHECK(e.param == "separate_reasoning");
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"separate_reasoning":false})", true,
                                     "m", &c, &e));
  CHECK_FALSE(c.reasoning_wanted);
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"enable_thinking":false}})",
                                     true, "m", &c, &e));
  CHECK(c.req.chat_template_kwargs == R"({"enable_thinking":false})");
  CHECK_FALSE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[1]})", true,
                                         "m", &c, &e));
  CHECK(e.param == "chat_template_kwargs");
  CHECK_FALSE(deploy::openai::parse_body(R"({"prompt":"x","chat_template_kwargs":{}})", false, "m", &c, &e));
  CHECK(e.message == "chat_template_kwargs is for /v1/chat/completions");
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}]})", true, "m", &c, &e));

  completion done;
  done.text = "hmm</think>Yes.";
  done.finish_reason = "eos";
  done.prompt_thinking = 1;  // the router's word: this chat's prompt opened <think>
  auto message = json::parse(deploy::openai::completion_json(c, done, "id", 0))["choices"][0]["message"];
  CHECK(message["content"] == "hmm</think>Yes.");  // not split: as generated
  CHECK_FALSE(message.contains("reasoning_content"));
  c.separate_reasoning = true;
  message = json::parse(deploy::openai::completion_json(c, done, "id", 0))["choices"][0]["message"];
  CHECK(message["reasoning_content"] == "hmm");
  CHECK(message["content"] == "Yes.");
  done.text = "hmm, still";  // cut while thinking: no content at all (null), as vLLM answers
  done.finish_reason = "length";
  message = json::parse(deploy::openai::completion_json(c, done, "id", 0))["choices"][0]["message"];
  CHECK(message["reasoning_content"] == "hmm, still");
  CHECK(message["content"].is_null());
  done.text = "hmm</think>Yes.";
  done.finish_reason = "eos";
  // Streamed: the delta carries what the splitter told apart; the first has the role.
  stream_chunk chunk;
  chunk.text = "ignored when split";
  const reasoning_splitter::parts first{"hmm", "", {}}, both{"m", "Yes", {}};
  auto d = json::parse(deploy::openai::chunk_json(c, chunk, "id", 0, true, 0, 0, &first))["choices"][0]["delta"];
  CHECK(d == json{{"role", "assistant"}, {"reasoning_content", "hmm"}});
  d = json::parse(deploy::openai::chunk_json(c, chunk, "id", 0, false, 0, 0, &both))["choices"][0]["delta"];
  CHECK(d == json{{"reasoning_content", "m"}, {"content", "Yes"}});
}

TEST_CASE("tools: OpenAI's tools and tool_choice, tool results and an assistant's calls parse into what the chat "
          "template gets; what cannot be honoured is refused by name") {
  deploy::openai::call c;
  deploy::openai::api_error e;
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}])";
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"Paris?"}],)" + tools + "}", true, "m", &c, &e));
  // Kept in the client's key order (type before properties), as the template prints it.
  CHECK(c.req.tools_json ==
        R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}])");
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"none",)" + tools + "}", true,
                                     "m", &c, &e));
  // "none": the model is shown them, as OpenAI's and vLLM's are (the prompt, and its cached
  // prefix, stay those of the turns that could call), but its answer is not read for calls.
  CHECK(c.req.tools_json ==
        R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}])");
  CHECK(c.tool_choice_none);
  CHECK(c.req.output_spec.empty());
  CHECK_FALSE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"maybe",)" + tools + "}",
                                         true, "m", &c, &e));
  CHECK(e.param == "tool_choice");
  CHECK_FALSE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"code"}]})", true, "m", &c, &e));
  CHECK(e.message == R"(tools[0] must be {type: "function", function: {name, ...}})");
  CHECK_FALSE(deploy::openai::parse_body(R"({"prompt":"x",)" + tools + "}", false, "m", &c, &e));
  CHECK(e.message == "tools are for /v1/chat/completions");
  // A call's arguments are an object: parameters that allow none are refused by name; true, {}
  // and a type list with null are held to an object when the call is forced (they answered a
  // bare "false", with no tool_calls).
  const auto with_parameters = [](const std::string& params, const std::string& choice) {
    return R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":)" +
           params + "}}]" + choice + "}";
  };
  for (const char* p : {R"("x")", R"({"type":"string"})", "false", R"({"type":["array","null"]})"}) {
    CAPTURE(p);
    CHECK_FALSE(deploy::openai::parse_body(with_parameters(p, ""), true, "m", &c, &e));
    CHECK(e.param == "tools");
    CHECK(e.message.find("tools[0].function.parameters must be the JSON schema of an object") == 0);
  }
  // Names as OpenAI takes them, each once.
  CHECK_FALSE(deploy::openai::parse_body(
      R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"get weather"}}]})", true,
      "m", &c, &e));
  CHECK(e.message == R"(tools[0].function.name must be 1 to 64 letters, digits, _ or -, got "get weather")");
  CHECK_FALSE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function",
      "function":{"name":"f"}},{"type":"function","function":{"name":"f"}}]})",
                                         true, "m", &c, &e));
  CHECK(e.message == "tools[1] repeats the function name 'f' of tools[0]");
  const std::string named = R"(,"tool_choice":{"type":"function","function":{"name":"f"}})";
  for (const char* p : {"{}", "true", R"({"type":["object","null"]})", R"({"properties":{"a":{"type":"string"}}})"}) {
    CAPTURE(p);
    REQUIRE_MESSAGE(deploy::openai::parse_body(with_parameters(p, named), true, "m", &c, &e), e.message);
    CHECK(json::parse(c.req.output_spec)["type"] == "object");
  }

  const std::string turns = R"({"messages":[{"role":"user","content":"Paris?"},
      {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
      {"role":"tool","tool_call_id":"call_1","content":"21"}]})";
  REQUIRE(deploy::openai::parse_body(turns, true, "m", &c, &e));
  REQUIRE(c.req.messages.size() == 3);
  // The arguments reach the template as an object, in their order; a null content stays none.
  CHECK(c.req.messages[1].fields_json ==
        R"({"content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}}]})");
  CHECK(c.req.messages[2].role == "tool");
  CHECK(c.req.messages[2].fields_json == R"({"tool_call_id":"call_1"})");
  // Arguments that are not JSON (a call cut by max_tokens, sent back by an agent) reach the
  // template as the string they are, as OpenAI takes them.
  std::string cut = turns;
  cut.replace(cut.find(R"(\"unit\")"), 8, "");
  REQUIRE(deploy::openai::parse_body(cut, true, "m", &c, &e));
  CHECK(c.req.messages[1].fields_json.find(R"("arguments":"{\"city\": \"Paris\", : \"c\"}")") != std::string::npos);
}

TEST_CASE("tool calls in an answer: Hermes' <tool_call> JSON becomes tool_calls and finish_reason tool_calls, whole "
          "or streamed; text that is no call stays content, whole") {
  const auto read_tool_calls = [](const std::string& text) {
    return deploy::openai::read_tool_calls(text, gpu::tool_call_format::hermes);
  };
  auto two = read_tool_calls("Checking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"b\": 1, \"a\": [2]}}\n</tool_call>\n"
                             "<tool_call>{\"name\": \"g\"}</tool_call>");
  CHECK(two.content == "Checking.");
  REQUIRE(two.tool_calls.size() == 2);
  CHECK(two.tool_calls[0].name == "f");
  CHECK(two.tool_calls[0].arguments == R"({"b": 1, "a": [2]})");  // as the model wrote them
  CHECK(two.tool_calls[1].arguments == "{}");
  // parallel_tool_calls false: the first call only, whole or streamed.
  {
    deploy::openai::call one;
    deploy::openai::api_error e1;
    REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"parallel_tool_calls":false})", true,
                                       "m", &one, &e1));
    CHECK(one.one_tool_call);
    one.tool_calls = gpu::tool_call_format::hermes;
    const std::string text = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"g\", "
                             "\"arguments\": {\"y\": 2}}</tool_call>";
    const auto whole = deploy::openai::answer_reader{one, 0}.feed(text, true);
    REQUIRE(whole.tool_calls.size() == 1);
    CHECK(whole.tool_calls[0].name == "f");
    deploy::openai::answer_reader live{one, 0};
    std::vector<std::string> names;
    for (size_t i = 0; i < text.size(); i += 5)
      for (const auto& piece : live.feed(text.substr(i, 5), i + 5 >= text.size()).tool_calls)
        if (!piece.name.empty()) names.push_back(piece.name);
    CHECK(names == std::vector<std::string>{"f"});
    CHECK(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}],"parallel_tool_calls":"no"})", true, "m",
                                     &one, &e1) == false);
    CHECK(e1.param == "parallel_tool_calls");
  }
  CHECK(read_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": {}}").tool_calls.size() == 1);  // cut by max_tokens
  // An argument that quotes the end tag: the call ends after its JSON, whole or streamed.
  const std::string quoting = "<tool_call>{\"name\": \"f\", \"arguments\": {\"note\": \"close with </tool_call>\"}}</tool_call>";
  const auto quoted = read_tool_calls(quoting);
  REQUIRE(quoted.tool_calls.size() == 1);
  CHECK(quoted.tool_calls[0].arguments == R"({"note": "close with </tool_call>"})");
  CHECK(quoted.content.empty());
  deploy::openai::tool_call_splitter quoting_live{gpu::tool_call_format::hermes};
  std::string streamed_args;
  for (size_t i = 0; i < quoting.size(); i += 7)
    for (const auto& piece : quoting_live.feed(quoting.substr(i, 7), i + 7 >= quoting.size()).tool_calls)
      streamed_args += piece.arguments;
  CHECK(streamed_args == quoted.tool_calls[0].arguments);
  const auto not_json = read_tool_calls("a <tool_call> b </tool_call>");
  CHECK(not_json.tool_calls.empty());
  CHECK(not_json.content == "a <tool_call> b </tool_call>");

  deploy::openai::tool_call_splitter s{gpu::tool_call_format::hermes};
  CHECK(s.feed("Let me check.<tool", false).content == "Let me check.");
  auto mid = s.feed("_call>{\"name\": \"f\", ", false);
  CHECK(mid.content.empty());
  CHECK(mid.tool_calls.empty());
  auto end = s.feed("\"arguments\": {\"x\": 1}}</tool_call>", true);
  REQUIRE(end.tool_calls.size() == 1);
  CHECK(end.tool_calls[0].arguments == R"({"x": 1})");
  // Streamed: the call goes out once its name and the start of its arguments are read, then its
  // arguments as they grow (a trailing blank waits); the end sends what is left.
  deploy::openai::tool_call_splitter live{gpu::tool_call_format::hermes};
  CHECK(live.feed("<tool_call>{\"name\": \"get_", false).tool_calls.empty());
  auto named = live.feed("weather\", \"arguments\": {\"city\": ", false);
  REQUIRE(named.tool_calls.size() == 1);
  CHECK(named.tool_calls[0].first);
  CHECK(named.tool_calls[0].name == "get_weather");
  CHECK(named.tool_calls[0].arguments == R"({"city":)");
  auto more = live.feed("\"Par", false);
  REQUIRE(more.tool_calls.size() == 1);
  CHECK_FALSE(more.tool_calls[0].first);
  CHECK(more.tool_calls[0].arguments == R"( "Par)");
  auto rest = live.feed("is\"}}</tool_call>", true);
  REQUIRE(rest.tool_calls.size() == 1);
  CHECK(rest.tool_calls[0].arguments == R"(is"})");
  CHECK(rest.called);
  CHECK(rest.content.empty());
  // A stream cannot take back what it sent: a call whose JSON breaks stays sent, and the text
  // from its marker on follows as content.
  deploy::openai::tool_call_splitter broken{gpu::tool_call_format::hermes};
  CHECK(broken.feed("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1", false).tool_calls.size() == 1);
  auto after = broken.feed("]]</tool_call>", true);
  CHECK(after.tool_calls.empty());
  CHECK(after.called);
  CHECK(after.content == "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1]]</tool_call>");
  deploy::openai::tool_call_splitter no_call{gpu::tool_call_format::hermes};
  CHECK(no_call.feed("a <tool_call", false).content == "a ");
  CHECK(no_call.feed("> nope", true).content == "<tool_call> nope");  // held, then given back

  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}]})", true, "m", &c, &e));
  c.tool_calls = gpu::tool_call_format::hermes;
  completion done;
  done.text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call>";
  done.finish_reason = "eos";
  const auto choice = json::parse(deploy::openai::completion_json(c, done, "chatcmpl-7-1", 0))["choices"][0];
  CHECK(choice["finish_reason"] == "tool_calls");
  CHECK(choice["message"]["content"].is_null());
  CHECK(choice["message"]["tool_calls"] ==
        json::parse(R"([{"id":"call_7-1-0-0","type":"function","function":{"name":"f","arguments":"{\"x\": 1}"}}])"));
  stream_chunk last;
  last.finish_reason = "eos";
  deploy::openai::answer_parts parts;
  parts.tool_calls = {{"f", "{", 1, true}};
  stream_chunk mid_chunk;
  const auto opened = json::parse(deploy::openai::chunk_json(c, mid_chunk, "chatcmpl-7-1", 0, false, 0, 0, &parts))["choices"][0];
  CHECK(opened["finish_reason"].is_null());
  CHECK(opened["delta"]["tool_calls"] ==
        json::parse(R"([{"index":1,"id":"call_7-1-0-1","type":"function","function":{"name":"f","arguments":"{"}}])"));
  parts.tool_calls = {{"", "}", 1, false}};
  parts.called = true;
  const auto streamed = json::parse(deploy::openai::chunk_json(c, last, "chatcmpl-7-1", 0, false, 0, 0, &parts))["choices"][0];
  CHECK(streamed["finish_reason"] == "tool_calls");
  CHECK(streamed["delta"]["tool_calls"] == json::parse(R"([{"index":1,"function":{"arguments":"}"}}])"));
}

TEST_CASE("tool calls in Llama 3.1's, Mistral's, DeepSeek's and Kimi-K2's forms: read whole, and streamed in pieces of any size "
          "alike; an answer whose calls do not all read stays content, whole") {
  using gpu::tool_call_format;
  using calls = std::vector<std::pair<std::string, std::string>>;
  struct example {
    tool_call_format format;
    std::string text;
    std::string content;  ///< "=": the text itself (no call read)
    calls want;
    calls sent = {};  ///< where no call reads whole: what a stream had sent by then (it cannot take it back)
  };
  const std::string ds_begin = "<｜tool▁calls▁begin｜>", ds_end = "<｜tool▁calls▁end｜>", call = "<｜tool▁call▁begin｜>",
                    end = "<｜tool▁call▁end｜>", sep = "<｜tool▁sep｜>";
  const std::vector<example> examples = {
      {tool_call_format::llama_json, " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "",
       {{"get_weather", R"({"city": "Paris"})"}}},
      {tool_call_format::llama_json, "<|python_tag|>{\"name\": \"f\", \"arguments\": {\"x\": \"};\"}}; {\"name\": \"g\", \"parameters\": {}}",
       "", {{"f", R"({"x": "};"})"}, {"g", "{}"}}},
      {tool_call_format::llama_json, "{\"name\": \"f\", \"parameters\": {}}\nDone.", "Done.", {{"f", "{}"}}},
      {tool_call_format::llama_json, "It is sunny in {Paris}.", "=", {}},
      {tool_call_format::llama_json, "<b>bold</b>", "=", {}},
      {tool_call_format::llama_json, "{\"name\": \"f\", \"parameters\": {\"x\": ", "=", {},  // cut by max_tokens
       {{"f", R"({"x":)"}}},
      {tool_call_format::llama_json, "{\"city\": \"Paris\"}", "=", {}},                     // JSON, but no call
      {tool_call_format::llama_json, "{\"name\": \"Bob\", \"age\": 3}", "=", {}},           // a name, but no arguments
      {tool_call_format::llama_json,
       "{\"name\": \"f\", \"parameters\": {\"a\": " + std::string(100, '[') + std::string(100, ']') + "}}", "=",
       {},  // nested past max_json_depth: text, never parsed (nor written back) that deep
       {{"f", "{\"a\": " + std::string(100, '[') + std::string(100, ']') + "}"}}},
      {tool_call_format::mistral, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"x\": \"a]b\"}}, {\"name\": \"g\", \"arguments\": {}}]",
       "", {{"f", R"({"x": "a]b"})"}, {"g", "{}"}}},
      {tool_call_format::mistral, "Let me look.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]f[CALL_ID]ab12[ARGS]{}",
       "Let me look.", {{"get_weather", R"({"city": "Paris"})"}, {"f", "{}"}}},
      {tool_call_format::mistral, "[TOOL_CALLS]f[ARGS]{\"x\": 1}g[ARGS]{\"y\": 2}", "", {{"f", R"({"x": 1})"}, {"g", R"({"y": 2})"}}},
      {tool_call_format::mistral, "No [TOOL_CALLS] here", "=", {}},
      // An id that is not one (text before [ARGS]): not a call, and never another call's arguments.
      {tool_call_format::mistral, "[TOOL_CALLS]f[CALL_ID]x y[TOOL_CALLS]g[ARGS]{}", "=", {}},
      {tool_call_format::mistral, "[TOOL_CALLS][{\"arguments\": {}}]", "=", {}},  // a call without a name
      {tool_call_format::deepseek,
       "Checking." + ds_begin + call + "function" + sep + "get_weather\n```json\n{\"city\": \"Paris\"}\n```" + end + ds_end,
       "Checking.", {{"get_weather", R"({"city": "Paris"})"}}},
      {tool_call_format::deepseek, ds_begin + call + "f" + sep + "{\"x\": 1}" + end + call + "g" + sep + "{}" + end + ds_end, "",
       {{"f", R"({"x": 1})"}, {"g", "{}"}}},
      {tool_call_format::deepseek, ds_begin + call + "f" + sep + "{\"x\": " + end + ds_end, "=", {}, {{"f", R"({"x":)"}}},
      {tool_call_format::deepseek, "A plain answer.", "=", {}},
      // A ``` fence inside an argument's string (a file's content) is text, not the block's end.
      {tool_call_format::deepseek,
       ds_begin + call + "function" + sep + "write_file\n```json\n{\"path\": \"R.md\", \"content\": \"Run:\\n```sh\\nmake\\n```\"}\n```" +
           end + ds_end,
       "", {{"write_file", R"({"path": "R.md", "content": "Run:\n```sh\nmake\n```"})"}}},
      {tool_call_format::kimi,
       "Sure.<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
       "{\"city\": \"Paris\"}<|tool_call_end|>\n<|tool_call_begin|>g:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
       "<|tool_calls_section_end|>",
       "Sure.", {{"get_weather", R"({"city": "Paris"})"}, {"g", "{}"}}},
      {tool_call_format::kimi, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{}<|tool_call_end|>", "=", {}},
  };
  for (const auto& ex : examples) {
    CAPTURE(ex.text);
    const auto whole = deploy::openai::read_tool_calls(ex.text, ex.format);
    CHECK(whole.content == (ex.content == "=" ? ex.text : ex.content));
    calls got;
    for (const auto& c : whole.tool_calls) got.emplace_back(c.name, c.arguments);
    CHECK(got == ex.want);
    for (size_t step : {1, 2, 5, 13, 4096}) {  // as an answer streams: pieces of `step` bytes
      CAPTURE(step);
      deploy::openai::tool_call_splitter s{ex.format};
      std::string content;
      calls streamed;
      bool early = false;  // a call went out before the answer's last piece: it streamed
      for (size_t at = 0; at < ex.text.size(); at += step) {
        const bool last = at + step >= ex.text.size();
        const auto part = s.feed(ex.text.substr(at, step), last);
        content += part.content;
        early |= !last && !part.tool_calls.empty();
        for (const auto& c : part.tool_calls) {  // a call's pieces, joined
          if (c.first) streamed.emplace_back(c.name, "");
          REQUIRE(c.index + 1 == streamed.size());
          streamed.back().second += c.arguments;
        }
      }
      CHECK(content == whole.content);
      if (!ex.want.empty() || step >= ex.text.size()) {
        CHECK(streamed == ex.want);
        // Every form's first call streams (later ones may wait: a Mistral call without a marker
        // of its own is a call only if its JSON reads).
        if (step == 1 && !ex.want.empty()) CHECK(early);
      } else {  // what went out before the last piece, which depends on where the pieces broke
        REQUIRE(streamed.size() <= ex.sent.size());
        for (size_t i = 0; i < streamed.size(); ++i) {
          CHECK(streamed[i].first == ex.sent[i].first);
          CHECK(ex.sent[i].second.starts_with(streamed[i].second));
        }
        if (step == 1) CHECK(streamed == ex.sent);
      }
    }
  }
  // A Llama answer that is a call: no content, finish_reason tool_calls.
  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE(deploy::openai::parse_body(R"({"messages":[{"role":"user","content":"x"}]})", true, "m", &c, &e));
  c.tool_calls = tool_call_format::llama_json;
  completion done;
  done.text = R"({"name": "f", "parameters": {"x": 1}})";
  done.finish_reason = "eos";
  const auto choice = json::parse(deploy::openai::completion_json(c, done, "chatcmpl-9-1", 0))["choices"][0];
  CHECK(choice["finish_reason"] == "tool_calls");
  CHECK(choice["message"]["content"].is_null());
  CHECK(choice["message"]["tool_calls"][0]["function"]["arguments"] == R"({"x": 1})");
}

// The gateway's structured outputs, without sockets or actors: response_format, forced
// tool_choice and vLLM's guided_* / structured_outputs fields into generate_request's
// constraint, and forced answers read back as tool calls.

#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "deploy/openai.hpp"
#include "gpu/json_schema_grammar.hpp"

using namespace baton;
using nlohmann::json;

TEST_CASE("structured outputs: response_format and a forced tool_choice become a JSON grammar's request, and the "
          "forced answer reads back as the calls") {
  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","response_format":{"type":"text"}})", false, "m", &c, &e));
  CHECK(c.req.output_format == 0);
  REQUIRE(deploy::openai::parse_body(R"({"prompt":"a","response_format":{"type":"json_object"}})", false, "m", &c, &e));
  CHECK(c.req.output_format == 1);
  CHECK(c.req.output_spec.empty());
  // The schema keeps the client's key order: its properties are written in it.
  REQUIRE(deploy::openai::parse_body(
      R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":
          {"name":"p","strict":true,"schema":{"type":"object","properties":{"zeta":{"type":"integer"},"alpha":{"type":"string"}}}}}})",
      true, "m", &c, &e));
  CHECK(c.req.output_format == 2);
  CHECK(c.req.output_spec == R"({"type":"object","properties":{"zeta":{"type":"integer"},"alpha":{"type":"string"}}})");

  const std::string tools = R"("tools":[{"type":"function","function":{"name":"get_weather","parameters":
      {"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}},
      {"type":"function","function":{"name":"now"}}])";
  const std::string chat = R"({"messages":[{"role":"user","content":"x"}],)";
  REQUIRE(deploy::openai::parse_body(chat + R"("tool_choice":{"type":"function","function":{"name":"get_weather"}},)" + tools + "}",
                                     true, "m", &c, &e));
  CHECK(c.forced_tool == "get_weather");
  CHECK(c.req.output_format == 2);
  CHECK(c.req.output_spec == R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})");
  CHECK_FALSE(c.req.tools_json.empty());  // the model still sees them
  REQUIRE(deploy::openai::parse_body(chat + R"("tool_choice":"required","parallel_tool_calls":false,)" + tools + "}", true, "m",
                                     &c, &e));
  CHECK(c.forced_calls);
  const auto schema = json::parse(c.req.output_spec);
  CHECK(schema["type"] == "array");
  CHECK(schema["minItems"] == 1);
  CHECK(schema["maxItems"] == 1);
  CHECK(schema["items"]["anyOf"].size() == 2);
  CHECK(schema["items"]["anyOf"][1]["properties"]["name"] == json{{"const", "now"}});
  // A function without parameters takes an empty object.
  CHECK(schema["items"]["anyOf"][1]["properties"]["parameters"]["additionalProperties"] == false);
  // A tool whose parameters refer to their own $defs (as pydantic writes them): the references
  // move with the parameters into the list's schema, which then compiles.
  const std::string with_refs = R"("tools":[{"type":"function","function":{"name":"book","parameters":
      {"type":"object","properties":{"who":{"$ref":"#/$defs/P"}},"required":["who"],
       "$defs":{"P":{"type":"object","properties":{"name":{"type":"string"}},"required":["name"]}}}}}])";
  REQUIRE(deploy::openai::parse_body(chat + R"("tool_choice":"required",)" + with_refs + "}", true, "m", &c, &e));
  CHECK(json::parse(c.req.output_spec)["items"]["anyOf"][0]["properties"]["parameters"]["properties"]["who"]["$ref"] ==
        "#/items/anyOf/0/properties/parameters/$defs/P");
  std::string why;
  CHECK_MESSAGE(gpu::compile_output_grammar(gpu::output_format::schema, c.req.output_spec, {}, &why), why);
  CHECK_FALSE(deploy::openai::parse_body(chat + R"("tool_choice":{"type":"function","function":{"name":"nope"}},)" + tools + "}",
                                         true, "m", &c, &e));
  CHECK(e.message == "tool_choice names the function 'nope', which tools lacks");
  CHECK_FALSE(deploy::openai::parse_body(chat + R"("tool_choice":"required"})", true, "m", &c, &e));
  CHECK(e.message == "tool_choice forces a call, but the request gives no tools");
  CHECK_FALSE(deploy::openai::parse_body(chat + R"("tool_choice":"required","response_format":{"type":"json_object"},)" + tools +
                                             "}",
                                         true, "m", &c, &e));
  CHECK(e.message == "response_format cannot be combined with a forced tool_choice");

  // Reading the forced answers back, whole and streamed: the JSON is the calls.
  deploy::openai::call named;
  named.chat = true;
  named.forced_tool = "get_weather";
  deploy::openai::answer_reader r{named, 0};
  CHECK(r.active());
  auto part = r.feed(R"({"city": )", false);  // the call goes out at once, its arguments as they come
  CHECK(part.content.empty());
  REQUIRE(part.tool_calls.size() == 1);
  CHECK(part.tool_calls[0].first);
  CHECK(part.tool_calls[0].name == "get_weather");
  CHECK(part.tool_calls[0].arguments == R"({"city":)");
  part = r.feed(R"("Paris"})", true);
  REQUIRE(part.tool_calls.size() == 1);
  CHECK_FALSE(part.tool_calls[0].first);
  CHECK(part.tool_calls[0].arguments == R"( "Paris"})");
  CHECK(part.called);
  CHECK(deploy::openai::answer_reader{named, 0}.feed(R"( {"city": "Paris"} )", true).tool_calls[0].arguments ==
        R"({"city": "Paris"})");
  const auto list = deploy::openai::read_forced_calls(R"([{"name":"now","parameters":{}}, {"name":"get_weather","parameters":{"city":"Oslo"}}])", "");
  REQUIRE(list.tool_calls.size() == 2);
  CHECK(list.tool_calls[1].arguments == R"({"city":"Oslo"})");
  deploy::openai::call required;
  required.chat = true;
  required.forced_calls = true;
  deploy::openai::answer_reader listed{required, 0};
  const auto first_call = listed.feed(R"([{"name": "now", "parameters": {"tz": "UTC"}}, {"name": "get_w)", false);
  REQUIRE(first_call.tool_calls.size() == 1);  // the first call, whole; the second's name is not read yet
  CHECK(first_call.tool_calls[0].arguments == R"({"tz": "UTC"})");
  const auto second_call = listed.feed(R"(eather", "parameters": {}}])", true);
  REQUIRE(second_call.tool_calls.size() == 1);
  CHECK(second_call.tool_calls[0].index == 1);
  CHECK(second_call.tool_calls[0].name == "get_weather");
  CHECK(second_call.tool_calls[0].arguments == "{}");
  // Cut by max_tokens: the JSON does not read as calls ...
  const auto cut = deploy::openai::read_forced_calls(R"({"city": "Par)", "get_weather");
  CHECK(cut.tool_calls.empty());
  CHECK(cut.content == R"({"city": "Par)");
  // ... so the answer is the calls as far as they go, whole or streamed: the names read, their
  // arguments so far (as OpenAI answers a cut call), and never the grammar's JSON as content.
  for (const bool whole : {true, false}) {
    CAPTURE(whole);
    const auto read_cut = [&](const deploy::openai::call& c, const std::string& text) {
      deploy::openai::answer_reader reader{c, 0};
      deploy::openai::answer_parts all;
      const std::vector<std::string> pieces =
          whole ? std::vector<std::string>{text} : std::vector<std::string>{text.substr(0, text.size() / 2), text.substr(text.size() / 2)};
      for (size_t k = 0; k < pieces.size(); ++k) {
        auto p = reader.feed(pieces[k], k + 1 == pieces.size());
        all.content += p.content;
        all.called |= p.called;
        all.cut |= p.cut;
        for (auto& t : p.tool_calls) {
          if (t.index < all.tool_calls.size()) all.tool_calls[t.index].arguments += t.arguments;
          else all.tool_calls.push_back(std::move(t));
        }
      }
      return all;
    };
    const auto named_cut = read_cut(named, R"({"city": "Par)");
    CHECK(named_cut.content.empty());
    REQUIRE(named_cut.tool_calls.size() == 1);
    CHECK(named_cut.tool_calls[0].name == "get_weather");
    CHECK(named_cut.tool_calls[0].arguments == R"({"city": "Par)");
    // Not finished calls: finish_reason stays "length" (or "stop", for a stop string inside).
    CHECK_FALSE(named_cut.called);
    CHECK(named_cut.cut);
    const auto listed_cut = read_cut(required, R"([{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"ci)");
    CHECK(listed_cut.content.empty());
    REQUIRE(listed_cut.tool_calls.size() == 2);
    CHECK(listed_cut.tool_calls[0].name == "now");
    CHECK(listed_cut.tool_calls[0].arguments == "{}");
    CHECK(listed_cut.tool_calls[1].name == "get_weather");
    CHECK(listed_cut.tool_calls[1].arguments == R"({"ci)");
    // Cut before the first name was read: nothing to call, and no JSON as text either.
    const auto unnamed = read_cut(required, R"([ { "n)");
    CHECK(unnamed.content.empty());
    CHECK(unnamed.tool_calls.empty());
    CHECK_FALSE(unnamed.called);
  }
  {  // ... whose whole answer has content null (no text to show), as OpenAI's and vLLM's have
    completion done;
    done.text = R"([ { "n)";
    done.finish_reason = "length";
    const auto message = json::parse(deploy::openai::completion_json(required, done, "id", 0))["choices"][0]["message"];
    CHECK(message["content"].is_null());
    CHECK_FALSE(message.contains("tool_calls"));
  }
  // After a thinking block the prompt opened: with separate_reasoning the thinking is
  // reasoning_content; without it, content as generated (</think> and the blank lines too).
  // Either way the JSON after it is the call, streamed in any pieces or whole.
  for (const bool separate : {true, false}) {
    CAPTURE(separate);
    named.separate_reasoning = separate;
    const std::vector<std::string> pieces = {"Let me th", "ink</thi", "nk>\n", "\n{\"city\": ", "\"Oslo\"}"};
    for (const bool whole : {false, true}) {
      CAPTURE(whole);
      deploy::openai::answer_reader thinking{named, 1};
      deploy::openai::answer_parts all;
      auto take = [&](const deploy::openai::answer_parts& p) {
        all.reasoning += p.reasoning;
        all.content += p.content;
        for (const auto& c : p.tool_calls) {  // a call's pieces, joined
          if (c.first) all.tool_calls.push_back(c);
          else all.tool_calls.at(c.index).arguments += c.arguments;
        }
      };
      if (whole) {
        std::string text;
        for (const auto& p : pieces) text += p;
        take(thinking.feed(text, true));
      } else {
        for (size_t i = 0; i < pieces.size(); ++i) take(thinking.feed(pieces[i], i + 1 == pieces.size()));
      }
      CHECK(all.reasoning == (separate ? "Let me think" : ""));
      CHECK(all.content == (separate ? "" : "Let me think</think>\n\n"));
      REQUIRE(all.tool_calls.size() == 1);
      CHECK(all.tool_calls[0].name == "get_weather");
      CHECK(all.tool_calls[0].arguments == R"({"city": "Oslo"})");
    }
  }
}

TEST_CASE("vLLM's structured outputs: guided_json, guided_regex, guided_choice and guided_grammar, or "
          "structured_outputs, become the grammar's request; what Baton cannot honour is refused by name") {
  const auto parse = [](const std::string& fields, deploy::openai::call* c) {
    deploy::openai::api_error e;
    *c = {};
    const bool ok = deploy::openai::parse_body(R"({"prompt":"a",)" + fields + "}", false, "m", c, &e);
    return ok ? std::string() : e.param + ": " + e.message;
  };
  deploy::openai::call c;
  REQUIRE(parse(R"("guided_json":{"type":"object","properties":{"z":{"type":"integer"},"a":{}}})", &c).empty());
  CHECK(c.req.output_format == 2);
  CHECK(c.req.output_spec == R"({"type":"object","properties":{"z":{"type":"integer"},"a":{}}})");  // key order kept
  REQUIRE(parse(R"("guided_json":"{\"type\":\"string\"}")", &c).empty());  // a schema as its text
  CHECK(c.req.output_spec == R"({"type":"string"})");
  REQUIRE(parse(R"("guided_regex":"[0-9]{3}")", &c).empty());
  CHECK(c.req.output_format == 3);
  CHECK(c.req.output_spec == "[0-9]{3}");
  // A choice becomes an alternation of its strings, their special characters escaped.
  REQUIRE(parse(R"x("guided_choice":["yes","no","1+1 (two)"])x", &c).empty());
  CHECK(c.req.output_spec == R"((?:yes|no|1\+1 \(two\)))");
  std::string why;
  auto g = gpu::compile_output_grammar(gpu::output_format::regex, c.req.output_spec, {}, &why);
  REQUIRE_MESSAGE(g, why);
  for (const auto& [text, ok] : std::vector<std::pair<std::string, bool>>{
           {"yes", true}, {"1+1 (two)", true}, {"11 (two)", false}, {"yesno", false}, {"", false}}) {
    gpu::grammar_matcher m(g, gpu::byte_vocabulary(258), {257});
    CHECK_MESSAGE((m.accept_bytes(text) && m.complete()) == ok, text);
  }
  // The newer form.
  REQUIRE(parse(R"("structured_outputs":{"choice":["a","b"]})", &c).empty());
  CHECK(c.req.output_spec == "(?:a|b)");
  REQUIRE(parse(R"("structured_outputs":{"json":{"type":"boolean"},"disable_fallback":true})", &c).empty());
  CHECK(c.req.output_spec == R"({"type":"boolean"})");
  REQUIRE(parse(R"("structured_outputs":{"json_object":true})", &c).empty());
  CHECK(c.req.output_format == 1);
  REQUIRE(parse(R"("structured_outputs":{"regex":"x+"})", &c).empty());
  CHECK(c.req.output_spec == "x+");
  CHECK_FALSE(c.req.json_compact);
  // disable_any_whitespace shapes JSON only: on a text answer it is dropped, as vLLM ignores it
  // (the router would refuse json_compact there).
  REQUIRE(parse(R"("structured_outputs":{"regex":"x+","disable_any_whitespace":true})", &c).empty());
  CHECK(c.req.output_format == 3);
  CHECK_FALSE(c.req.json_compact);
  REQUIRE(parse(R"("structured_outputs":{"disable_any_whitespace":true})", &c).empty());
  CHECK(c.req.output_format == 0);
  CHECK_FALSE(c.req.json_compact);
  // Compact JSON, for response_format's JSON too.
  REQUIRE(parse(R"("response_format":{"type":"json_object"},"structured_outputs":{"disable_any_whitespace":true})", &c)
              .empty());
  CHECK(c.req.output_format == 1);
  CHECK(c.req.json_compact);
  // Refusals, by name.
  // Grammars as text (GBNF).
  REQUIRE(parse(R"("guided_grammar":"root ::= \"a\"")", &c).empty());
  CHECK(c.req.output_format == 4);
  CHECK(c.req.output_spec == R"(root ::= "a")");
  REQUIRE(parse(R"("structured_outputs":{"grammar":"root ::= [0-9]+"})", &c).empty());
  CHECK(c.req.output_spec == "root ::= [0-9]+");
  CHECK(parse(R"("structured_outputs":{"structural_tag":"x"})", &c) ==
        "structured_outputs: structured_outputs.structural_tag is not supported (json, regex, choice, grammar, "
        "json_object and disable_any_whitespace are)");
  CHECK(parse(R"("guided_whitespace_pattern":" *")", &c).find("guided_whitespace_pattern is not supported") !=
        std::string::npos);
  CHECK(parse(R"("guided_regex":"a","guided_choice":["a"])", &c) ==
        "guided_choice: give one of guided_json, guided_regex, guided_choice and guided_grammar, not guided_regex and "
        "guided_choice");
  CHECK(parse(R"("structured_outputs":{"regex":"a"},"guided_regex":"a")", &c) ==
        "structured_outputs: give structured_outputs or the guided_* fields, not both");
  CHECK(parse(R"("guided_regex":"a","response_format":{"type":"json_object"})", &c) ==
        "guided_regex: guided_regex cannot be combined with response_format or a forced tool_choice");
  CHECK(parse(R"("guided_choice":[])", &c) == "guided_choice: guided_choice must be an array of 1 to 1024 strings, got an array of 0");
  CHECK(parse(R"("guided_choice":["a",1])", &c).find("must be an array of 1 to 1024 strings") != std::string::npos);
  CHECK(parse(R"("guided_regex":7)", &c) == "guided_regex: guided_regex must be a non-empty regular expression, got 7");
  CHECK(parse(R"("guided_json":7)", &c) ==
        "guided_json: guided_json must be a JSON schema (an object, or its text), got 7");
  CHECK(parse(R"("guided_json":"")", &c) ==
        "guided_json: guided_json must be a JSON schema (an object, or its text), got \"\"");
  CHECK(parse(R"("structured_outputs":{"json_object":false})", &c) ==
        "structured_outputs: structured_outputs.json_object must be true, got false");
  CHECK(parse(R"("structured_outputs":"x")", &c) == "structured_outputs: structured_outputs must be an object, got \"x\"");
  // Fields given null are not given, as clients that write all of vLLM's params send them.
  REQUIRE(parse(R"("guided_json":null,"guided_grammar":null,"structured_outputs":{"choice":["a"],"regex":null,
      "structural_tag":null,"whitespace_pattern":null,"disable_any_whitespace":null})", &c).empty());
  CHECK(c.req.output_spec == "(?:a)");
  // SGLang's fields (its OpenAI API's extras): json_schema (its text, or the schema), regex, ebnf.
  REQUIRE(parse(R"("json_schema":"{\"type\":\"integer\"}")", &c).empty());
  CHECK(c.req.output_format == 2);
  CHECK(c.req.output_spec == R"({"type":"integer"})");
  REQUIRE(parse(R"("json_schema":{"type":"object","properties":{"z":{},"a":{}}})", &c).empty());
  CHECK(c.req.output_spec == R"({"type":"object","properties":{"z":{},"a":{}}})");  // key order kept
  REQUIRE(parse(R"("regex":"[0-9]+","ebnf":null)", &c).empty());
  CHECK(c.req.output_format == 3);
  CHECK(c.req.output_spec == "[0-9]+");
  REQUIRE(parse(R"("ebnf":"root ::= \"a\"")", &c).empty());
  CHECK(c.req.output_format == 4);
  CHECK(c.req.output_spec == R"(root ::= "a")");
  CHECK(parse(R"("regex":"a","ebnf":"root ::= \"a\"")", &c) == "ebnf: give one of json_schema, regex and ebnf, not regex and ebnf");
  CHECK(parse(R"("regex":"a","guided_regex":"a")", &c) ==
        "regex: regex cannot be combined with response_format, a forced tool_choice, guided_* or structured_outputs");
  CHECK(parse(R"("ebnf":7)", &c) == "ebnf: ebnf must be a non-empty grammar (GBNF), got 7");
  CHECK(parse(R"("json_schema":[1])", &c) ==
        "json_schema: json_schema must be a non-empty JSON schema (its text, or an object), got an array of 1");
  CHECK(parse(R"("structured_outputs":{"disable_any_whitespace":"yes"})", &c) ==
        "structured_outputs: structured_outputs.disable_any_whitespace must be true or false, got \"yes\"");
  std::string many = R"("guided_choice":[)";
  for (int i = 0; i < 600; ++i) many += std::string(i ? "," : "") + "\"choice" + std::to_string(i) + "\"";
  CHECK(parse(many + "]", &c).find("as an expression; at most 4096") != std::string::npos);
}

TEST_CASE("structured outputs: a schema, expression or grammar that does not compile is refused by the gateway, "
          "naming the field it was written in (and the tool, for a forced call), not the compiler's own name") {
  const auto refused = [](const std::string& body) {
    deploy::openai::call c;
    deploy::openai::api_error e;
    if (deploy::openai::parse_body(body, body.find("messages") != std::string::npos, "m", &c, &e)) return std::string("parsed");
    return e.param + ": " + e.message;
  };
  const std::string chat = R"({"messages":[{"role":"user","content":"x"}],)";
  CHECK(refused(chat + R"("response_format":{"type":"json_schema","json_schema":{"name":"p","schema":
      {"type":"object","properties":{"a":{"type":"frob"}}}}}})") ==
        "response_format: response_format.json_schema.schema at /properties/a/type: unknown type 'frob'");
  CHECK(refused(chat + R"("response_format":{"type":"json_schema","json_schema":{"name":"p","schema":
      {"type":"object","properties":{"a":{"type":"string","pattern":"(["}}}}}})") ==
        "response_format: response_format.json_schema.schema at /properties/a/pattern: pattern: an unclosed class (offset 2)");
  // A forced call: the place inside the tool's own parameters, whichever way it was forced.
  const std::string tools = R"("tools":[{"type":"function","function":{"name":"ok","parameters":{"type":"object"}}},
      {"type":"function","function":{"name":"bad","parameters":{"type":"object","properties":{"a":{"type":"frob"}}}}}])";
  CHECK(refused(chat + R"("tool_choice":"required",)" + tools + "}") ==
        "tools: tools[1].function.parameters at /properties/a/type: unknown type 'frob'");
  CHECK(refused(chat + R"("tool_choice":{"type":"function","function":{"name":"bad"}},)" + tools + "}") ==
        "tools: tools[1].function.parameters at /properties/a/type: unknown type 'frob'");
  // Not forced: the schema only shows the model the tool (as vLLM, not compiled).
  CHECK(refused(chat + R"("tool_choice":"auto",)" + tools + "}") == "parsed");
  CHECK(refused(R"({"prompt":"a","guided_regex":"(["})") == "guided_regex: guided_regex: an unclosed class (offset 2)");
  CHECK(refused(R"({"prompt":"a","structured_outputs":{"regex":"(["}})") ==
        "structured_outputs: structured_outputs.regex: an unclosed class (offset 2)");
  CHECK(refused(R"({"prompt":"a","regex":"(["})") == "regex: regex: an unclosed class (offset 2)");
  CHECK(refused(R"({"prompt":"a","json_schema":{"type":"frob"}})") == "json_schema: json_schema at /type: unknown type 'frob'");
  CHECK(refused(R"({"prompt":"a","ebnf":"root ::= missing"})") ==
        "ebnf: ebnf: the rule 'missing' is used but never defined, at line 1, column 10");
}

TEST_CASE("the members whose key order matters may not hold an object of more than 1024 keys (kept in order, each "
          "key costs a search of those before it); an object that wide elsewhere is parsed and checked as before") {
  const auto refused = [](const std::string& body) {
    deploy::openai::call c;
    deploy::openai::api_error e;
    if (deploy::openai::parse_body(body, body.find("messages") != std::string::npos, "m", &c, &e)) return std::string("parsed");
    return e.param + ": " + e.message;
  };
  const auto wide = [](size_t keys, const char* value) {
    std::string o = "{";
    for (size_t i = 0; i < keys; ++i) o += (i ? ",\"" : "\"") + std::to_string(i) + "\":" + value;
    return o + "}";
  };
  const std::string props_1025 = wide(1025, R"({"type":"integer"})");
  CHECK(refused(R"({"prompt":"a","guided_json":{"type":"object","properties":)" + props_1025 + "}}") ==
        "guided_json: guided_json holds an object of more than 1024 keys");
  CHECK(refused(R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f",)"
                R"("parameters":{"type":"object","properties":)" + props_1025 + "}}}]}") ==
        "tools: tools holds an object of more than 1024 keys");
  // A duplicate member does not hide one (the ordered parse builds the first), nor does a tool
  // call's arguments, JSON text parsed in order for the template.
  CHECK(refused(R"({"prompt":"a","guided_json":)" + props_1025 + R"(,"guided_json":{"type":"object"}})") ==
        "guided_json: guided_json holds an object of more than 1024 keys");
  CHECK(refused(R"({"messages":[{"role":"assistant","content":"","tool_calls":[{"id":"c","type":"function",)"
                R"("function":{"name":"f","arguments":)" + json(wide(1025, "1")).dump() + "}}]}]}") ==
        "messages[0].tool_calls[0]: messages[0].tool_calls[0].function.arguments holds an object of more than 1024 keys");
  // 1024 is fine, and keeps its order: the schema's first property is the first the grammar asks for.
  deploy::openai::call c;
  deploy::openai::api_error e;
  const std::string body = R"({"prompt":"a","guided_json":{"type":"object","properties":)" + wide(1024, R"({"type":"integer"})") +
                           R"(,"required":["7"]},"unknown_field":)" + wide(50'000, "1") + "}";
  REQUIRE_MESSAGE(deploy::openai::parse_body(body, false, "m", &c, &e), e.message);
  CHECK(c.req.output_spec.rfind(R"({"type":"object","properties":{"0":{"type":"integer"},"1":)", 0) == 0);
  // A wide logit_bias is still refused by its own rule.
  CHECK(refused(R"({"prompt":"a","logit_bias":)" + wide(80'000, "1") + "}") ==
        "logit_bias: logit_bias names 80000 tokens; at most 1024");
}

// Constrained decoding's grammars (gpu/grammar.hpp, gpu/json_schema_grammar.hpp): what a JSON
// grammar accepts and refuses, byte by byte and token by token, and that the vocabulary walk
// allows exactly the tokens a token-by-token check allows.

#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <thread>
#include <tuple>

#include "gpu/json_schema_grammar.hpp"

using namespace baton::gpu;

namespace {

std::shared_ptr<const grammar> compile(const std::string& schema, std::string* why = nullptr, bool thinking = false) {
  std::string w;
  auto g = compile_output_grammar(schema.empty() ? output_format::object : output_format::schema, schema, {.after_thinking = thinking}, &w);
  if (why) *why = w;
  return g;
}

/// `piece` written `n` times.
std::string repeated(const std::string& piece, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += piece;
  return out;
}

/// Whether the whole text is a sentence of the grammar.
bool matches(const std::shared_ptr<const grammar>& g, std::string_view text) {
  grammar_matcher m(g, byte_vocabulary(258), {257});
  return m.accept_bytes(text) && m.complete();
}

/// Whether the text can still grow into a sentence.
bool viable(const std::shared_ptr<const grammar>& g, std::string_view text) {
  grammar_matcher m(g, byte_vocabulary(258), {257});
  return m.accept_bytes(text);
}

/// A vocabulary of JSON-ish pieces (several bytes, some spanning structure), specials, an end.
std::shared_ptr<const token_vocabulary> json_pieces() {
  std::vector<std::string> text = {"{",   "}",     "[",    "]",  "\"",   ":",   ",",     " ",     "\n",  "\n  ", "\t",
                                   "{\"", "\":",   "\": ", "\",", "\"}", "a",   "ab",    "name",  "\"name\"", "ok",
                                   "true", "tru",  "e",    "false", "null", "0",   "1",     "12",    "-",   ".",  "5e",
                                   "x",   "y",     "\"x\"", "ada", "bob",  "\\",  "\\n",   "\\u00", "e9",  "é",  "\xc3",
                                   "]}",  "},",    "[\"",   "tags", "\"tags\":[", "\",\"", "<think>", "</think>", "</",
                                   "think", ">",   "", "<|end|>", "<|im_start|>"};
  std::vector<bool> special(text.size(), false);
  special[text.size() - 1] = true;
  special[text.size() - 2] = true;
  // Every printable byte on its own too, as real vocabularies have: any viable text can go on;
  // and pieces that run through a pattern's repeats.
  for (char c = ' '; c < 127; ++c) {
    text.emplace_back(1, c);
    special.push_back(false);
  }
  for (const char* t : {"aa", "ba", "bb", "aab", "b\"", "a\"", "\xa9"}) {
    text.emplace_back(t);
    special.push_back(false);
  }
  return std::make_shared<token_vocabulary>(text, special);
}

constexpr int32_t end_token = 55;  // "<|end|>" in json_pieces (the empty token is 54, <|im_start|> 56)

}  // namespace

TEST_CASE("grammar: json_object accepts JSON objects, whitespace between tokens, and nothing else") {
  const auto g = compile("");
  REQUIRE(g);
  for (const char* ok : {"{}", "{ }", R"({"a":1})", R"({"a": [1, 2.5e-3, -0, true, null, {"b": "c\n\u00e9"}]})",
                         "{\n  \"a\": {\n    \"b\": []\n  }\n}", R"({"é": "ü"})"})
    CHECK_MESSAGE(matches(g, ok), ok);
  for (const char* bad : {"[1]", "1", "\"a\"", R"({"a":})", R"({"a" 1})", R"({"a":1,})", R"({a:1})", R"({"a":01})",
                          R"({"a":1.})", "{\"a\":\"\x01\"}", R"({"a":"\q"})", "{}}", " {}", "{}\n"})
    CHECK_FALSE_MESSAGE(matches(g, bad), bad);
  CHECK(viable(g, R"({"a": [1, )"));
  CHECK_FALSE(viable(g, R"({"a": ]})"));
  // Whitespace is bounded: a newline and 24 blanks, but not 25, nor two newlines.
  CHECK(viable(g, "{\n" + std::string(24, ' ')));
  CHECK_FALSE(viable(g, "{\n" + std::string(25, ' ')));
  CHECK_FALSE(viable(g, "{\n\n"));
}

TEST_CASE("grammar: a schema's properties come in order, required always, optional maybe, no others") {
  const auto g = compile(R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},
      "tags":{"type":"array","items":{"enum":["x","y"]},"minItems":1,"maxItems":2}},"required":["name"]})");
  REQUIRE(g);
  CHECK(matches(g, R"({"name":"ada"})"));
  CHECK(matches(g, R"({"name": "ada", "age": 36})"));
  CHECK(matches(g, R"({"name":"ada","tags":["x"]})"));
  CHECK(matches(g, R"({"name":"ada","age":-1,"tags":["y","x"]})"));
  CHECK_FALSE(matches(g, R"({})"));                               // name is required
  CHECK_FALSE(matches(g, R"({"age":1,"name":"ada"})"));           // out of order
  CHECK_FALSE(matches(g, R"({"name":"ada","email":"a@b"})"));     // not a property
  CHECK_FALSE(matches(g, R"({"name":"ada","age":1.5})"));         // not an integer
  CHECK_FALSE(matches(g, R"({"name":"ada","tags":[]})"));         // minItems 1
  CHECK_FALSE(matches(g, R"({"name":"ada","tags":["x","y","x"]})"));  // maxItems 2
  CHECK_FALSE(matches(g, R"({"name":"ada","tags":["z"]})"));      // not in the enum
  CHECK_FALSE(matches(g, R"({"name":"ada",})"));
  CHECK_FALSE(matches(g, R"({,"name":"ada"})"));
}

TEST_CASE("grammar: enum, const, anyOf, type lists, nullable and $ref recursion") {
  CHECK(matches(compile(R"({"enum":["red",1,null,{"a":[true]}]})"), R"({"a":[true]})"));
  CHECK(matches(compile(R"({"enum":["red",1,null]})"), "null"));
  CHECK_FALSE(matches(compile(R"({"enum":["red",1,null]})"), "\"blue\""));
  CHECK(matches(compile(R"({"const":"only"})"), "\"only\""));
  const auto either = compile(R"({"anyOf":[{"type":"integer"},{"type":"array","items":{"type":"boolean"}}]})");
  CHECK(matches(either, "7"));
  CHECK(matches(either, "[true, false]"));
  CHECK_FALSE(matches(either, "\"7\""));
  CHECK(matches(compile(R"({"type":["string","null"]})"), "null"));
  CHECK(matches(compile(R"({"type":"number","nullable":true})"), "null"));
  // A tree through $defs: each node's children are nodes.
  const auto tree = compile(R"({"$ref":"#/$defs/node","$defs":{"node":{"type":"object",
      "properties":{"v":{"type":"integer"},"kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},
      "required":["v","kids"],"additionalProperties":false}}})");
  REQUIRE(tree);
  CHECK(matches(tree, R"({"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4,"kids":[]}]}]})"));
  CHECK_FALSE(matches(tree, R"({"v":1,"kids":[{"v":2}]})"));
  // Objects without properties: any keys, values by additionalProperties.
  const auto map = compile(R"({"type":"object","additionalProperties":{"type":"integer"}})");
  CHECK(matches(map, R"({"a":1,"b":2})"));
  CHECK_FALSE(matches(map, R"({"a":"1"})"));
  CHECK(matches(compile(R"({"type":"object","additionalProperties":false})"), "{}"));
  CHECK_FALSE(matches(compile(R"({"type":"object","additionalProperties":false})"), R"({"a":1})"));
}

TEST_CASE("grammar: prefixItems (tuples, as Pydantic writes them) and the annotations Pydantic adds to its unions") {
  // Tuple[int, str]: exactly those two, in order.
  const auto pair = compile(R"({"type":"array","prefixItems":[{"type":"integer"},{"type":"string"}],"minItems":2,"maxItems":2})");
  REQUIRE(pair);
  CHECK(matches(pair, R"([1, "a"])"));
  CHECK_FALSE(matches(pair, R"(["a", 1])"));
  CHECK_FALSE(matches(pair, R"([1])"));
  CHECK_FALSE(matches(pair, R"([1, "a", 2])"));
  // items: false allows no more than the prefix; items as a schema holds for the rest.
  const auto closed = compile(R"({"prefixItems":[{"type":"integer"},{"type":"boolean"}],"items":false})");
  REQUIRE(closed);
  CHECK(matches(closed, "[]"));
  CHECK(matches(closed, "[1]"));
  CHECK(matches(closed, "[1, true]"));
  CHECK_FALSE(matches(closed, "[1, true, 2]"));
  CHECK_FALSE(matches(closed, "[true]"));
  const auto rest = compile(R"({"prefixItems":[{"type":"string"}],"items":{"type":"integer"},"minItems":1})");
  REQUIRE(rest);
  CHECK(matches(rest, R"(["x", 1, 2, 3])"));
  CHECK_FALSE(matches(rest, R"(["x", 1, "y"])"));
  CHECK_FALSE(matches(rest, "[]"));
  std::string why;
  CHECK(compile(R"({"prefixItems":[{"type":"integer"}],"items":false,"minItems":2})", &why) == nullptr);
  CHECK(why.find("no array holds to these counts") != std::string::npos);
  // A tagged union: the discriminator only names the telling property; the schemas decide.
  const auto pet = compile(R"({"oneOf":[{"$ref":"#/$defs/cat"},{"$ref":"#/$defs/dog"}],
      "discriminator":{"propertyName":"kind","mapping":{"cat":"#/$defs/cat","dog":"#/$defs/dog"}},
      "$defs":{"cat":{"type":"object","properties":{"kind":{"const":"cat"},"lives":{"type":"integer"}},"required":["kind","lives"]},
               "dog":{"type":"object","properties":{"kind":{"const":"dog"},"good":{"type":"boolean","deprecated":true}},
                      "required":["kind","good"]}}})");
  REQUIRE(pet);
  CHECK(matches(pet, R"({"kind":"cat","lives":9})"));
  CHECK(matches(pet, R"({"kind":"dog","good":true})"));
  CHECK_FALSE(matches(pet, R"({"kind":"cat","good":true})"));
  // Branches whose tag is any string: an answer could carry one's tag with another's fields.
  CHECK(compile(R"({"oneOf":[{"type":"object","properties":{"kind":{"type":"string"},"lives":{"type":"integer"}},
      "required":["kind","lives"]},{"type":"object","properties":{"kind":{"const":"dog"}},"required":["kind"]}],
      "discriminator":{"propertyName":"kind"}})",
                &why) == nullptr);
  CHECK(why == "json_schema at /discriminator: discriminator names 'kind', which oneOf/0 does not pin (a property "
               "with const or enum): an answer could carry one schema's tag with another's fields");
  // Pydantic's defaulted tag (kind: Literal["cat"] = "cat") is left out of `required`; each
  // branch still writes it, since its validator needs it to choose.
  const auto defaulted = compile(R"({"oneOf":[{"$ref":"#/$defs/cat"},{"$ref":"#/$defs/dog"}],
      "discriminator":{"propertyName":"kind"},
      "$defs":{"cat":{"type":"object","properties":{"kind":{"const":"cat","default":"cat"},"lives":{"type":"integer"}},
                      "required":["lives"]},
               "dog":{"type":"object","properties":{"kind":{"const":"dog","default":"dog"},"good":{"type":"boolean"}}}}})");
  REQUIRE(defaulted);
  CHECK(matches(defaulted, R"({"kind":"cat","lives":9})"));
  CHECK(matches(defaulted, R"({"kind":"dog"})"));
  CHECK_FALSE(matches(defaulted, R"({"lives":9})"));
  CHECK_FALSE(matches(defaulted, "{}"));
}

TEST_CASE("grammar: schemas Baton cannot honour are refused, naming the keyword and where it is") {
  const auto refused = [](const std::string& schema) {
    std::string why;
    CHECK_MESSAGE(compile(schema, &why) == nullptr, schema);
    return why;
  };
  CHECK(refused(R"({"type":"integer","multipleOf":3})") == "json_schema at /: the keyword 'multipleOf' is not supported "
                                                             "(Baton's grammars cannot enforce it)");
  // A nullable that is not a boolean (it threw through the compiler, which ended the router).
  CHECK(refused(R"({"type":"string","nullable":"yes"})") == "json_schema at /nullable: nullable must be true or false");
  CHECK(refused(R"({"properties":{"a":{"type":"integer","nullable":1}}})").find("/properties/a/nullable") != std::string::npos);
  CHECK(refused(R"({"properties":{"when":{"type":"string","format":"uri"}}})") ==
        "json_schema at /properties/when/format: the format \"uri\" is not supported (date, time, date-time, "
        "duration, uuid, ipv4, ipv6, hostname and email are)");
  CHECK(refused(R"({"type":"number","minimum":0.5})").find("/minimum: minimum on a number must be a whole number") !=
        std::string::npos);
  CHECK(refused(R"({"type":"number","exclusiveMinimum":1,"maximum":1})").find("no number lies between") != std::string::npos);
  CHECK(refused(R"x({"type":"string","pattern":"a(?=b)"})x") ==
        "json_schema at /pattern: pattern: lookarounds are not supported (offset 2)");
  CHECK(refused(R"({"type":"string","pattern":"(a)\\1"})").find("backreferences are not supported") != std::string::npos);
  CHECK(refused(R"({"type":"string","pattern":"a{2000}"})").find("counts are supported up to 1024") != std::string::npos);
  CHECK(refused(R"({"type":"string","pattern":"^a|b$"})").find("group it, as ^(a|b)$") != std::string::npos);
  CHECK(refused(R"({"type":"string","pattern":"a","format":"date"})").find("one at a time") != std::string::npos);
  CHECK(refused(R"({"type":"integer","minimum":5,"maximum":4})").find("no integer lies between") != std::string::npos);
  CHECK(refused(R"({"type":"decimal"})").find("unknown type 'decimal'") != std::string::npos);
  // What a keyword taking the whole value would leave unsaid is refused, not ignored.
  CHECK(refused(R"({"$ref":"#/$defs/a","minItems":2,"$defs":{"a":{"type":"array"}}})") ==
        "json_schema at /: 'minItems' beside $ref is not supported (it would be ignored); move it into the schema "
        "referred to");
  CHECK(refused(R"({"type":"string","anyOf":[{"maxLength":5},{"pattern":"x"}]})").find("'type' beside anyOf") !=
        std::string::npos);
  CHECK(refused(R"({"enum":["a"],"maxLength":3})").find("'maxLength' beside enum") != std::string::npos);
  CHECK(refused(R"({"minimum":3})").find("a bound without a type") != std::string::npos);
  CHECK(refused(R"({"$ref":"#/$defs/missing"})").find("names nothing") != std::string::npos);
  CHECK(refused(R"({"$ref":"http://x/y.json"})").find("not inside this schema") != std::string::npos);
  CHECK(refused(R"({"properties":{"a":{}},"required":["b"]})").find("required names 'b'") != std::string::npos);
  CHECK(refused(R"({"items":{},"minItems":3,"maxItems":2})").find("minItems is above maxItems") != std::string::npos);
  CHECK(refused(R"({"items":{},"maxItems":100000})").find("up to 1024") != std::string::npos);
  CHECK(refused("false").find("matches nothing") != std::string::npos);
  CHECK(refused("{\"type\":").find("not valid JSON") != std::string::npos);
  CHECK(refused("[1]").find("must be an object or a boolean") != std::string::npos);
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += R"({"type":"array","items":)";
  deep += "{}" + std::string(100, '}');
  CHECK(refused(deep).find("nests deeper than 64") != std::string::npos);
  // Keywords at values that restrict nothing are taken (Pydantic and zod write them); at any
  // other value they restrict, and are refused.
  CHECK(compile(R"({"type":"array","items":{"type":"integer"},"uniqueItems":false})"));
  CHECK(compile(R"({"type":"object","properties":{"a":{"type":"integer","multipleOf":1}},"minProperties":0})"));
  CHECK(refused(R"({"type":"array","uniqueItems":true})").find("'uniqueItems' is not supported") != std::string::npos);
  CHECK(refused(R"({"type":"object","minProperties":1})").find("'minProperties' is not supported") != std::string::npos);
  CHECK(refused(R"({"type":"number","multipleOf":1})").find("'multipleOf' is not supported") != std::string::npos);
}

TEST_CASE("grammar: the schema size bound counts what compiles: titles, descriptions and examples are left out, a "
          "property named description is not") {
  // 80 properties, each with a 1 KiB description: 80 KiB sent, a few KiB compiled.
  nlohmann::json schema = {{"type", "object"}, {"properties", nlohmann::json::object()}};
  for (int i = 0; i < 80; ++i)
    schema["properties"]["p" + std::to_string(i)] = {{"type", "string"}, {"description", std::string(1024, 'd')}};
  schema["properties"]["description"] = {{"type", "integer"}, {"title", "a property named description"}};
  schema["required"] = {"description"};
  REQUIRE(schema.dump().size() > max_json_schema_bytes);
  std::string why;
  const auto g = compile(schema.dump(), &why);
  REQUIRE_MESSAGE(g, why);
  CHECK(matches(g, R"({"description":7})"));
  CHECK_FALSE(matches(g, R"({"p0":"x"})"));  // the required property named description is kept
  // What compiles still has its bound.
  nlohmann::json wide = {{"type", "object"}, {"properties", nlohmann::json::object()}};
  for (int i = 0; i < 3000; ++i) wide["properties"]["property_number_" + std::to_string(i)] = {{"type", "string"}};
  CHECK(compile(wide.dump(), &why) == nullptr);
  CHECK_MESSAGE(why.find("bytes without its titles, descriptions and examples; at most 65536") != std::string::npos, why);
  // 400,000 brackets inside a guided_json string (the body's depth check does not see them):
  // refused before the parse, not dumped recursively until the stack overflows (a review).
  const std::string deep = std::string(400000, '[') + std::string(400000, ']');
  CHECK(compile(deep, &why) == nullptr);
  CHECK_MESSAGE(why.find("nests arrays and objects deeper than 256 levels") != std::string::npos, why);
}

TEST_CASE("grammar: the process-wide cache gives the same grammar for the same schema and kind, and keeps no failures") {
  const std::string schema = R"({"type":"object","properties":{"cached":{"type":"boolean"}}})";
  std::string why;
  auto a = cached_output_grammar(output_format::schema, schema, {}, &why);
  REQUIRE(a != nullptr);
  CHECK(cached_output_grammar(output_format::schema, schema, {}, &why) == a);
  // The kind and the thinking prefix are part of what is cached.
  auto thinking = cached_output_grammar(output_format::schema, schema, {.after_thinking = true}, &why);
  REQUIRE(thinking != nullptr);
  CHECK(thinking != a);
  CHECK(cached_output_grammar(output_format::object, "", {}, &why) != a);
  CHECK(matches(a, R"({"cached":true})"));
  CHECK_FALSE(matches(a, R"({"cached":1})"));
  // A refused schema is refused again, by the same sentence.
  const std::string bad = R"({"type":"integer","multipleOf":3})";
  std::string first, second;
  CHECK(cached_output_grammar(output_format::schema, bad, {}, &first) == nullptr);
  CHECK(cached_output_grammar(output_format::schema, bad, {}, &second) == nullptr);
  CHECK(first == second);
  CHECK(first.find("multipleOf") != std::string::npos);
  // Past 64 other schemas, the first is compiled anew (a different grammar, the same language).
  for (int i = 0; i < 64; ++i)
    REQUIRE(cached_output_grammar(output_format::schema, R"({"const":)" + std::to_string(i) + "}", {}, &why));
  auto again = cached_output_grammar(output_format::schema, schema, {}, &why);
  CHECK(again != a);
  CHECK(matches(again, R"({"cached":false})"));
}

TEST_CASE("grammar: string patterns, formats and lengths, as the decoded text; integer ranges, digit by digit") {
  const auto str = [](const std::string& keywords) { return compile(R"({"type":"string",)" + keywords + "}"); };
  const auto zip = str(R"("pattern":"^[0-9]{5}(-[0-9]{4})?$")");
  CHECK(matches(zip, R"("12345")"));
  CHECK(matches(zip, R"("12345-6789")"));
  CHECK_FALSE(matches(zip, R"("1234")"));
  CHECK_FALSE(matches(zip, R"("12345-")"));
  // Unanchored: the text need only contain a match.
  CHECK(matches(str(R"("pattern":"ab+c")"), R"("xxabbbcyy")"));
  CHECK_FALSE(matches(str(R"("pattern":"ab+c")"), R"("xxacyy")"));
  // Characters JSON escapes are written escaped; a pattern's class takes them decoded.
  const auto quoted = str(R"("pattern":"^[\"\\\\a]+\\n$")");  // the class holds ", \ and a
  CHECK(matches(quoted, R"("\"a\\\n")"));
  CHECK_FALSE(matches(quoted, "\"\"\\n\""));  // a raw quote would end the string
  // . and \w, classes past ASCII, negated classes.
  CHECK(matches(str(R"("pattern":"^.\\w[^a-z]$")"), "\"é_Q\""));
  CHECK_FALSE(matches(str(R"("pattern":"^.\\w[^a-z]$")"), "\"é_q\""));
  CHECK(matches(str(R"("format":"date")"), R"("2026-12-04")"));
  CHECK_FALSE(matches(str(R"("format":"date")"), R"("2026-13-04")"));
  CHECK(matches(str(R"("format":"date-time")"), R"("2026-12-04T23:59:60Z")") == false);  // no leap second
  CHECK(matches(str(R"("format":"date-time")"), R"("2026-12-04T23:59:59.5+01:00")"));
  CHECK(matches(str(R"("format":"uuid")"), R"("123e4567-e89b-12d3-a456-426614174000")"));
  CHECK(matches(str(R"("format":"ipv4")"), R"("192.168.0.255")"));
  CHECK_FALSE(matches(str(R"("format":"ipv4")"), R"("192.168.0.256")"));
  CHECK(matches(str(R"("format":"ipv6")"), R"("2001:0db8:85a3:0:0:8a2e:370:7334")"));
  CHECK_FALSE(matches(str(R"("format":"ipv6")"), R"("2001:db8::1:2:3:4:5")"));  // (no :: -- written out)
  CHECK_FALSE(matches(str(R"("format":"ipv6")"), R"("2001:0db8:85a3:0:0:8a2e:370:7334:1")"));
  for (const char* good : {R"("localhost")", R"("api.eu-west-1.internal.example.com")", R"("a1")", R"("a.b.c.d.e.f.g.h")"})
    CHECK_MESSAGE(matches(str(R"("format":"hostname")"), good), good);
  for (const char* bad : {R"("-a.com")", R"("a-.com")", R"("a..com")", R"(".a")", R"("a b")"})
    CHECK_FALSE_MESSAGE(matches(str(R"("format":"hostname")"), bad), bad);
  CHECK_FALSE(matches(str(R"("format":"hostname")"), "\"" + std::string(64, 'a') + "\""));  // a label of 64
  CHECK_FALSE(matches(str(R"("format":"hostname")"), R"("a.b.c.d.e.f.g.h.i")"));  // 9 labels: a subset, never past 253
  for (const char* good : {R"("P3W")", R"("P1Y2M3D")", R"("P2M")", R"("P1DT12H")", R"("PT1H30M")", R"("PT90S")"})
    CHECK_MESSAGE(matches(str(R"("format":"duration")"), good), good);
  // (Whole seconds only: a subset, every string of which is a duration.)
  for (const char* bad : {R"("P")", R"("PT")", R"("P1DT")", R"("1D")", R"("P1H")", R"("P1W2D")", R"("PT0.5S")",
                          R"("P1Y3D")", R"("PT1H5S")"})  // (RFC 3339: no unit skipped inside a part)
    CHECK_FALSE_MESSAGE(matches(str(R"("format":"duration")"), bad), bad);
  CHECK(matches(str(R"("format":"email")"), R"("ada@example.org")"));
  CHECK_FALSE(matches(str(R"("format":"email")"), R"("ada@example")"));
  // Dot-separated atoms and hyphen-trimmed labels (a leading or doubled dot once passed).
  CHECK(matches(str(R"("format":"email")"), R"("ada.lovelace+x@mail.example-1.org")"));
  for (const char* bad : {R"(".ada@example.org")", R"("ada.@example.org")", R"("a..b@example.org")",
                          R"("ada@-example.org")", R"("ada@example-.org")", R"("ada@example..org")"})
    CHECK_FALSE_MESSAGE(matches(str(R"("format":"email")"), bad), bad);
  const auto len = str(R"("minLength":2,"maxLength":3)");
  CHECK(matches(len, R"("ab")"));
  CHECK(matches(len, R"("a\né")"));  // three characters: a, a newline, é (two bytes)
  CHECK_FALSE(matches(len, R"("a")"));
  CHECK_FALSE(matches(len, R"("abcd")"));
  // Integers in a range, and only those: every value from -130 to 130 against each range.
  for (const auto& [keywords, lo, hi] : std::vector<std::tuple<std::string, int, int>>{
           {R"("minimum":0)", 0, 1000000}, {R"("minimum":-17,"maximum":123)", -17, 123},
           {R"("exclusiveMinimum":9,"exclusiveMaximum":100)", 10, 99}, {R"("maximum":-3)", -1000000, -3},
           {R"("minimum":-100,"maximum":-99)", -100, -99}, {R"("minimum":7,"maximum":7)", 7, 7}}) {
    CAPTURE(keywords);
    const auto g = compile(R"({"type":"integer",)" + keywords + "}");
    REQUIRE(g);
    for (int v = -130; v <= 130; ++v) CHECK_MESSAGE(matches(g, std::to_string(v)) == (v >= lo && v <= hi), v);
    CHECK_FALSE(matches(g, "007"));
    CHECK_FALSE(matches(g, "-0"));
  }
  CHECK(matches(compile(R"({"type":"integer","minimum":0})"), "123456789012"));
  // Numbers in a range (Pydantic's confloat(ge=0, le=1), gt=0, ...), and only those, written
  // without an exponent or -0: every candidate from -3 to 3 by quarters, in several spellings.
  std::vector<std::string> candidates;
  for (int q = -12; q <= 12; ++q) {
    const double v = q / 4.0;
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    candidates.push_back(buf);
    std::snprintf(buf, sizeof buf, "%.3f", v);
    candidates.push_back(buf);
  }
  for (const char* more : {"-0", "-0.0", "1e0", "0.0001", "-0.0001", "1.0000", "2.9999", "3.0001", "100", "-100"})
    candidates.push_back(more);
  for (const auto& [keywords, lo, lo_in, hi, hi_in] : std::vector<std::tuple<std::string, double, bool, double, bool>>{
           {R"("minimum":0,"maximum":1)", 0, true, 1, true},
           {R"("exclusiveMinimum":0)", 0, false, 1e9, true},
           {R"("minimum":-2,"exclusiveMaximum":2)", -2, true, 2, false},
           {R"("exclusiveMinimum":-1,"exclusiveMaximum":0)", -1, false, 0, false},
           {R"("maximum":-1)", -1e9, true, -1, true},
           {R"("minimum":3,"maximum":3)", 3, true, 3, true},
           {R"("minimum":0,"exclusiveMinimum":0,"maximum":2)", 0, false, 2, true},
           {R"("minimum":-5,"exclusiveMinimum":-1,"maximum":2,"exclusiveMaximum":9)", -1, false, 2, true}}) {
    CAPTURE(keywords);
    const auto g = compile(R"({"type":"number",)" + keywords + "}");
    REQUIRE(g);
    for (const auto& c : candidates) {
      const double v = std::stod(c);
      const bool written = c.find('e') == std::string::npos && !(c[0] == '-' && v == 0);  // the subset written
      const bool in = (lo_in ? v >= lo : v > lo) && (hi_in ? v <= hi : v < hi);
      CHECK_MESSAGE(matches(g, c) == (written && in), c);
    }
  }
  // A string's keywords without a type: a string (only strings have them).
  CHECK(matches(compile(R"({"pattern":"^x+$"})"), R"("xx")"));
  CHECK_FALSE(matches(compile(R"({"pattern":"^x+$"})"), "1"));
  // Strings are well-formed UTF-8: no stray byte, no overlong form, no surrogate, no lone \uD800.
  CHECK(viable(compile(""), "{\"\xc3"));
  CHECK_FALSE(viable(compile(""), "{\"\xc3\""));
  CHECK_FALSE(viable(compile(""), "{\"\xc0\xaf"));
  CHECK_FALSE(viable(compile(""), "{\"\xed\xa0\x80"));
  CHECK_FALSE(viable(compile(""), R"({"\uD800)"));
  CHECK(matches(compile(""), "{\"\xf0\x9f\x98\x80\":\"\\u00e9\"}"));
}

TEST_CASE("grammar: an expression matches exactly the texts std::regex matches, repeats of items that may be empty "
          "included (every text of up to 6 characters over a, b, space and comma)") {
  // Repeats of items that may be empty are compiled as repeats of the items' non-empty matches
  // (regex_grammar.cpp): these check that rewrite against an independent engine.
  const std::vector<std::string> patterns = {
      "(\\w* ?){1,5}", "(a?){3}",  "(a?b?){2,4}", "((a|b)*,?){0,3}", "(a*|b)+", "(|a)+b", "((a?)*)*",
      "(a?,?)*b",       "( ?(a|)){2}", "(a{0,2}b?){1,3}", "(()|a){2,3}", "(a?){0}b", "((a?)?b?){3}", "(a? ?)+,",
      "(a?b)*(b?a){1,2}", "(\\s*\\w+\\s*){1,3}", "((a|)(b|)){2,3},?", "(a*b*){0,2}a", "(a|b?){2,}b"};
  std::vector<std::string> texts{""};
  for (size_t i = 0; i < texts.size(); ++i)
    if (texts[i].size() < 6)
      for (char c : std::string("ab ,")) texts.push_back(texts[i] + c);
  for (const auto& p : patterns) {
    CAPTURE(p);
    std::string why;
    const auto g = compile_output_grammar(output_format::regex, p, {}, &why);
    REQUIRE_MESSAGE(g, why);
    const std::regex reference(p);
    size_t matched = 0, differ = 0;
    for (const auto& t : texts) {
      const bool expected = std::regex_match(t, reference);
      matched += expected;
      if (matches(g, t) != expected && ++differ <= 3) CHECK_MESSAGE(false, "'" << t << "': std::regex says " << expected);
    }
    CHECK(differ == 0);
    CHECK(matched > 0);
  }
}

TEST_CASE("grammar: a whole answer matching a regular expression, written as itself (guided_regex, guided_choice)") {
  const auto regex = [](const std::string& pattern, bool thinking = false) {
    std::string why;
    auto g = compile_output_grammar(output_format::regex, pattern, {.after_thinking = thinking}, &why);
    CHECK_MESSAGE(g != nullptr, why);
    return g;
  };
  // Anchored at both ends whether or not it says so: the whole text matches.
  for (const std::string p : {"[a-z]+-[0-9]{2}", "^[a-z]+-[0-9]{2}$"}) {
    CAPTURE(p);
    const auto g = regex(p);
    CHECK(matches(g, "abc-12"));
    CHECK_FALSE(matches(g, "abc-123"));
    CHECK_FALSE(matches(g, "xabc-12 "));
    CHECK(viable(g, "ab"));
    CHECK_FALSE(viable(g, "1"));
  }
  // Written as itself: quotes, backslashes and newlines are not JSON-escaped.
  const auto raw = regex(R"x("[^"\n]*"\n\\)x");
  CHECK(matches(raw, "\"hi there\"\n\\"));
  CHECK(matches(raw, "\"hi\\nthere\"\n\\"));  // a backslash and an n: neither a quote nor a newline
  CHECK_FALSE(matches(raw, "\"hi\nthere\"\n\\"));
  // A choice among strings, as the gateway writes guided_choice: exactly one of them.
  const auto choice = regex(R"((?:yes|no|a\.b \(c\)))");
  CHECK(matches(choice, "yes"));
  CHECK(matches(choice, "a.b (c)"));
  CHECK_FALSE(matches(choice, "axb (c)"));
  CHECK_FALSE(matches(choice, "yesno"));
  CHECK(matches(regex("[^a]", false), "é"));  // past ASCII, as UTF-8
  // `.` is any character but a newline, as Python's re has it (a schema's pattern, ECMA-262's,
  // also keeps \r out).
  CHECK(matches(regex("a.b"), "a\rb"));
  CHECK_FALSE(matches(regex("a.b"), "a\nb"));
  CHECK_FALSE(matches(compile(R"({"type":"string","pattern":"^a.b$"})"), R"("a\rb")"));
  // After a thinking block, the expression's text follows its </think> at once: the content is
  // exactly a match (JSON, which may start with blanks, takes blank lines there).
  const auto thinking = regex("(?:positive|negative)", true);
  CHECK(matches(thinking, "Hmm, mixed.</think>negative"));
  CHECK_FALSE(matches(thinking, "Hmm, mixed.</think>\n\nnegative"));
  CHECK_FALSE(matches(thinking, "negative"));
  std::string unknown;
  CHECK(compile_output_grammar(output_format::regex, "a\\Ub", {}, &unknown) == nullptr);
  CHECK(unknown == "regex: the escape \\U is not known (offset 3)");
  // What is wrong is named as the regex's, with its offset; the process-wide cache takes it too.
  std::string why;
  CHECK(compile_output_grammar(output_format::regex, "a(?=b)", {}, &why) == nullptr);
  CHECK(why == "regex: lookarounds are not supported (offset 2)");
  CHECK(cached_output_grammar(output_format::regex, "^a|b$", {}, &why) == nullptr);
  CHECK(why == "regex: an anchor beside a top-level '|' is ambiguous here; group it, as ^(a|b)$");
  CHECK(compile_output_grammar(output_format::regex, std::string(5000, 'a'), {}, &why) == nullptr);
  CHECK(why == "regex: longer than 4096 bytes");
  CHECK(compile_output_grammar(static_cast<output_format>(4), "a", {}, &why) == nullptr);
}

TEST_CASE("grammar: compact JSON has no whitespace between tokens (a thinking block may still end in blank lines)") {
  const std::string schema = R"({"type":"object","properties":{"a":{"type":"array","items":{"type":"integer"}}}})";
  std::string why;
  const auto compact = compile_output_grammar(output_format::schema, schema, {.compact = true}, &why);
  REQUIRE_MESSAGE(compact, why);
  CHECK(matches(compact, R"({"a":[1,2]})"));
  CHECK(matches(compact, R"({"a":[]})"));
  CHECK_FALSE(matches(compact, R"({"a": [1,2]})"));
  CHECK_FALSE(matches(compact, R"({"a":[1, 2]})"));
  CHECK_FALSE(matches(compact, "{\n\"a\":[1]}"));
  CHECK(matches(compile(schema), R"({ "a" : [1, 2] })"));  // the default: bounded whitespace
  const auto object = compile_output_grammar(output_format::object, "", {.compact = true}, &why);
  CHECK(matches(object, R"({"k":{"n":[null,true,"s",1.5]}})"));
  CHECK_FALSE(matches(object, R"({"k": 1})"));
  const auto thinking =
      compile_output_grammar(output_format::object, "", {.after_thinking = true, .compact = true}, &why);
  CHECK(matches(thinking, "Fine.</think>\n\n{\"k\":1}"));
  CHECK_FALSE(matches(thinking, "Fine.</think>\n\n{\"k\": 1}"));
  // The cache tells them apart.
  CHECK(cached_output_grammar(output_format::object, "", {.compact = true}, &why) !=
        cached_output_grammar(output_format::object, "", {}, &why));
}

TEST_CASE("grammar: after a thinking block, free text up to </think>, then the JSON") {
  const auto g = compile("", nullptr, true);
  REQUIRE(g);
  CHECK(matches(g, "Let me see. </thin </ think> <</think>{\"a\":1}"));
  CHECK(matches(g, "</think>\n\n{}"));
  CHECK_FALSE(matches(g, "{\"a\":1}"));  // the thinking block must close first
  CHECK_FALSE(matches(g, "</think>x{}"));
}

TEST_CASE("grammar: tokens follow the grammar as their bytes do; specials never, the end token only when complete") {
  const auto vocab = json_pieces();
  grammar_matcher m(compile(""), vocab, {end_token});
  const auto id = [&](std::string_view t) {
    for (uint32_t i = 0; i < vocab->size(); ++i)
      if (vocab->text(static_cast<int32_t>(i)) == t) return static_cast<int32_t>(i);
    FAIL("no token " << t);
    return -1;
  };
  CHECK(m.allows(id("{\"")));
  CHECK_FALSE(m.allows(id("[")));
  CHECK_FALSE(m.allows(end_token));
  CHECK_FALSE(m.allows(56));  // <|im_start|>, special
  CHECK_FALSE(m.allows(54));  // empty text
  for (const char* t : {"{\"", "name", "\": ", "\"x\"", "}"}) REQUIRE(m.accept(id(t)));
  CHECK(m.complete());
  CHECK_FALSE(m.allows(id(",")));
  CHECK_FALSE(m.accept(id(",")));  // refused, and nothing changed
  CHECK(m.allows(end_token));
  CHECK(m.accept(end_token));
  CHECK(m.ended());
  // Over: only more end tokens (a request that ignores them runs on to max_tokens).
  CHECK(m.allows(end_token));
  CHECK_FALSE(m.allows(id("}")));
  CHECK_FALSE(m.accept(id("}")));
  CHECK(m.accept(end_token));
  CHECK(m.consumed() == 7);
}

TEST_CASE("grammar: the vocabulary walk allows exactly what token-by-token checks allow, on random walks, from the "
          "grammar's cache of stack tops as from a whole walk") {
  const auto vocab = json_pieces();
  const std::string schema = R"({"type":"object","properties":{"name":{"enum":["ada","bob"]},"ok":{"type":"boolean"},
      "tags":{"type":"array","items":{"enum":["x","y"]},"maxItems":3}},"required":["name","ok"]})";
  struct grammar_case {
    output_format kind;
    std::string text;
    bool finite;  ///< a JSON schema's language that always ends: the text is checked against it
    bool thinking = false;
  };
  const std::vector<grammar_case> cases = {
      {output_format::object, "", false},
      {output_format::schema, schema, true},
      // Patterns whose repeats may match nothing: a rule reaches itself again without a byte read.
      {output_format::schema, R"({"type":"string","pattern":"^(a*b?)*$"})", false},
      {output_format::schema, R"({"type":"array","items":{"type":"string","pattern":"^(a?)*x?$"},"maxItems":2})", false},
      // Free text after a thinking block, then JSON; text answers, where '.' takes any character.
      {output_format::object, "", false, true},
      {output_format::regex, "(?:ab|a\\.x)+[^\"]{0,3}\"?", false},
      {output_format::gbnf, "root ::= \"{\" item (\",\" item)* \"}\"\nitem ::= \"\\\"\" [^\"]* \"\\\"\" | .", false},
  };
  for (const auto& c : cases) {
    CAPTURE(c.text);
    CAPTURE(c.thinking);
    std::string why;
    // One grammar for all the walks: later ones start from the tops earlier ones kept.
    const auto g = compile_output_grammar(c.kind, c.text, {.after_thinking = c.thinking}, &why);
    REQUIRE_MESSAGE(g, why);
    std::mt19937 rng(7);
    for (int walk = 0; walk < 40; ++walk) {
      grammar_matcher m(g, vocab, {end_token});
      std::string text;
      for (int step = 0; step < 60 && !m.ended(); ++step) {
        std::vector<uint8_t> mask, whole;
        const size_t n = m.allowed(&mask);
        REQUIRE(m.allowed_by_whole_walk(&whole) == n);
        REQUIRE_MESSAGE(mask == whole, "after '" << text << "'");
        std::vector<int32_t> ok;
        for (uint32_t t = 0; t < vocab->size(); ++t) {
          REQUIRE_MESSAGE(static_cast<bool>(mask[t]) == m.allows(static_cast<int32_t>(t)),
                          "token " << t << " after '" << text << "'");
          if (mask[t]) ok.push_back(static_cast<int32_t>(t));
        }
        REQUIRE(ok.size() == n);
        REQUIRE_FALSE_MESSAGE(ok.empty(), "after '" << text << "'");  // a viable prefix always has a way on
        // Lean towards ending once the text is long, so finite grammars finish: no more blanks.
        if (step > 30) {
          std::vector<int32_t> solid;
          for (int32_t t : ok)
            if (vocab->text(t).find_first_of(" \n\t") == std::string::npos) solid.push_back(t);
          if (!solid.empty()) ok.swap(solid);
        }
        int32_t pick = ok[rng() % ok.size()];
        if (step > 30 && m.allows(end_token)) pick = end_token;
        REQUIRE(m.accept(pick));
        if (pick != end_token) text += vocab->text(pick);
      }
      if (!c.finite) continue;
      REQUIRE_MESSAGE(m.ended(), text);
      const auto j = nlohmann::json::parse(text);  // the schema's language is finite: it always ends
      CHECK((j["name"] == "ada" || j["name"] == "bob"));
      CHECK(j["ok"].is_boolean());
      CHECK(j.size() == (j.contains("tags") ? 3u : 2u));
    }
    // The answers went through the cache (strings, patterns and free text take most bytes).
    CHECK(g->cached_tops(vocab) > 0);
  }
}

TEST_CASE("grammar: matchers on several threads share one grammar's cache of stack tops, and each answer equals the "
          "whole walk") {
  const auto vocab = json_pieces();
  std::string why;
  const auto g = compile_output_grammar(output_format::object, "", {}, &why);
  REQUIRE_MESSAGE(g, why);
  // Four threads walk the same answers at once, so they reach the same new tops together: each
  // may walk a top on its own while another stores it.
  const std::vector<std::string> answers = {"{\"a\": \"x y\", \"b\": [1, \"é\"]}", "{\"note\": \"a\\n\", \"n\": {\"c\": \"d\"}}"};
  std::vector<std::string> failures(4);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < failures.size(); ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round)
        for (const auto& answer : answers) {
          grammar_matcher m(g, vocab, {end_token});
          for (size_t at = 0; at < answer.size(); ++at) {
            std::vector<uint8_t> mask, whole;
            if (m.allowed(&mask) != m.allowed_by_whole_walk(&whole) || mask != whole) {
              failures[t] = "after '" + answer.substr(0, at) + "'";
              return;
            }
            if (!m.accept_bytes(answer.substr(at, 1))) {
              failures[t] = "refused byte " + std::to_string(at) + " of " + answer;
              return;
            }
          }
        }
    });
  for (auto& th : threads) th.join();
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
  CHECK(g->cached_tops(vocab) > 0);
}

TEST_CASE("grammar: GBNF text (guided_grammar): rules, literals, classes, groups, repeats; refusals name line and column") {
  const auto gbnf = [](const std::string& text) {
    std::string why;
    auto g = compile_output_grammar(output_format::gbnf, text, {}, &why);
    CHECK_MESSAGE(g != nullptr, why);
    return g;
  };
  const auto g = gbnf(R"(# a list of answers
root   ::= answer ("," ws answer)*   # at least one
answer ::= "yes" | "no" | [0-9]{1,3} | "\x41\u00e9\"" | quoted
quoted ::= "'" [^'\n]* "'"
ws     ::= [ \t]?
)");
  REQUIRE(g);
  CHECK(matches(g, "yes"));
  CHECK(matches(g, "yes, no,12,999"));
  CHECK(matches(g, "A\xc3\xa9\""));  // \x41, \u00e9 as UTF-8, \"
  CHECK(matches(g, "'it''s'") == false);
  CHECK(matches(g, "'its', 'é'"));
  CHECK_FALSE(matches(g, "1000"));
  CHECK_FALSE(matches(g, "yes,"));
  CHECK(viable(g, "yes, "));
  CHECK_FALSE(matches(g, "maybe"));
  // Rules across lines inside groups and after ::= or |; use before definition; recursion on the
  // right; `.` is any character.
  const auto nested = gbnf("root ::=\n  (\n  \"[\" items? \"]\"\n  )\nitems ::= item | item \",\" items\nitem ::= "
                           "nested-list | . \nnested-list ::= \"[\" items? \"]\"");
  CHECK(matches(nested, "[[a,[]],\xc3\xa9]"));
  CHECK_FALSE(matches(nested, "[[a,]]"));
  CHECK(matches(gbnf("root ::= (\"a\"?)* \"b\""), "aab"));  // a repeat of something optional is not left recursion
  CHECK(matches(gbnf("root ::= \"\""), ""));
  // Refusals.
  const auto refused = [](const std::string& text) {
    std::string why;
    CHECK_MESSAGE(compile_output_grammar(output_format::gbnf, text, {}, &why) == nullptr, text);
    return why;
  };
  CHECK(refused("root ::= a \"x\"\n") == "grammar: the rule 'a' is used but never defined, at line 1, column 10");
  CHECK(refused("start ::= \"x\"") == "grammar: no rule named 'root' (the whole answer), at line 1, column 1");
  CHECK(refused("root ::= \"x\"\nroot ::= \"y\"") == "grammar: the rule 'root' is defined twice, at line 2, column 1");
  CHECK(refused("root ::= expr\nexpr ::= expr \"+\" term | term\nterm ::= [0-9]")
            .find("grammar: the rule 'expr' is left-recursive") == 0);
  CHECK(refused("root ::= (x? root \"a\") | \"b\"\nx ::= \"c\"").find("the rule 'root' is left-recursive") !=
        std::string::npos);
  // Through a repeat's own rules, still named by the rule written.
  CHECK(refused("root ::= \"b\" | list\nlist ::= (list \"a\")*").find("the rule 'list' is left-recursive") !=
        std::string::npos);
  CHECK(refused("root ::= \"abc") == "grammar: a literal without its closing quote, at line 1, column 10");
  CHECK(refused("root ::= (\"a\"") == "grammar: a group without its ')', at line 1, column 14");
  CHECK(refused("root ::= [a-") == "grammar: a character class without its ']', at line 1, column 10");
  CHECK(refused("root ::= [z-a]").find("grammar: class: a class range out of order") == 0);
  CHECK(refused("root ::= \"a\"{2000}") == "grammar: counts are supported up to 1024, at line 1, column 19");
  CHECK(refused("root = \"a\"") == "grammar: expected '::=' after the rule name 'root', at line 1, column 6");
  CHECK(refused("root ::= \"a\" )") == "grammar: unexpected ')', at line 1, column 14");
  CHECK(refused("root ::= \"\\q\"") == "grammar: the escape \\q is not known, at line 1, column 13");
  CHECK(refused(std::string(70000, '#')).find("at most 65536") != std::string::npos);
  // What the matcher could not follow exactly is refused at compile time, not mid-answer.
  CHECK(refused("root ::= " + std::string(65, '(') + "\"a\"" + std::string(65, ')')) ==
        "grammar: groups nest deeper than 64, at line 1, column 74");
  CHECK(refused("root ::= root") == "grammar: matches no text at all");
  CHECK(refused("root ::= a | b\na ::= b\nb ::= a") == "grammar: matches no text at all");
  std::string chain = "root ::= r0\n";
  for (int k = 0; k < 2100; ++k) {  // (appended piece by piece: GCC 12 warns falsely on a + chain here)
    chain += 'r';
    chain += std::to_string(k);
    chain += " ::= r";
    chain += std::to_string(k + 1);
    chain += " \"x\"\n";
  }
  chain += "r2100 ::= \"y\"";
  CHECK(refused(chain).find("grammar: rules nest up to 2102 deep before reading a character; at most 2048") == 0);
  std::string huge = "root ::=";
  for (int k = 0; k < 1000; ++k) huge += " \"a\"{1024}";
  CHECK(refused(huge).find("grammar: too large (") == 0);
  CHECK(refused("root ::= \"a\"{100000}") == "grammar: counts are supported up to 1024, at line 1, column 21");
  CHECK(refused("root ::= [\\U00000041-\\U0000005A]").find("the escape \\U is not known") != std::string::npos);
  // Of several rules never defined, the first in the text is named.
  CHECK(refused("root ::= b a\nc ::= z") == "grammar: the rule 'b' is used but never defined, at line 1, column 10");
  // llama.cpp's spacing: blanks between an element and its quantifier.
  const auto spaced = gbnf("root ::= \"a\" * (\"b\" | \"c\") +");
  CHECK(matches(spaced, "aabcb"));
  CHECK_FALSE(matches(spaced, "aa"));
}

TEST_CASE("grammar: left recursion is found where a rule comes back to itself with something left to read, and "
          "nowhere else: not in JSON, regex or GBNF grammars written on the right") {
  std::string why;
  for (const auto& [kind, text] : std::vector<std::pair<output_format, std::string>>{
           {output_format::object, ""},
           {output_format::schema, R"({"$defs":{"t":{"type":"array","items":{"$ref":"#/$defs/t"}}},"$ref":"#/$defs/t"})"},
           {output_format::regex, "((a?)*b|c*)+"},
           {output_format::gbnf, "root ::= (x? y?)* \"z\"\nx ::= \"a\"*\ny ::= x"}}) {
    auto g = compile_output_grammar(kind, text, {}, &why);
    REQUIRE_MESSAGE(g, why);
    CHECK_MESSAGE(!g->left_shape().left_recursive, text);
    CHECK(g->left_shape().deepest < grammar::max_expand_depth);
    CHECK_FALSE(g->left_shape().matches_nothing);
  }
  grammar direct;
  const uint32_t a = direct.add_rule();
  direct.add_alternative(a, {grammar::ref(a), grammar::byte('x')});
  direct.add_alternative(a, {grammar::byte('y')});
  CHECK(direct.left_shape().left_recursive);
  CHECK(direct.left_shape().rule == a);
  // Through another rule that may match nothing.
  grammar indirect;
  const uint32_t b = indirect.add_rule(), c = indirect.add_rule(), empty = indirect.add_rule();
  indirect.add_alternative(empty, {});
  indirect.add_alternative(b, {grammar::ref(empty), grammar::ref(c), grammar::byte('x')});
  indirect.add_alternative(c, {grammar::ref(b)});
  indirect.add_alternative(c, {grammar::byte('y')});
  CHECK(indirect.left_shape().left_recursive);
  // Right recursion is not.
  grammar right;
  const uint32_t r = right.add_rule();
  right.add_alternative(r, {grammar::byte('x'), grammar::ref(r)});
  right.add_alternative(r, {});
  right.set_start(r);
  CHECK_FALSE(right.left_shape().left_recursive);
  CHECK_FALSE(right.left_shape().matches_nothing);
  CHECK(right.left_shape().deepest == 1);
}

TEST_CASE("grammar: an expression that keeps more parses alive than a rank follows is refused at compile time, "
          "naming what it read and how many ways; a merely optional repeat and a choice among many names are not") {
  const auto compiled = [](output_format kind, const std::string& text) {
    std::string why;
    auto g = compile_output_grammar(kind, text, {}, &why);
    return g ? std::string{"compiled"} : why;
  };
  // Every way of sharing the text among 64 groups of 0 to 64 characters: thousands.
  const auto nested = compiled(output_format::regex, "(.{0,64}){64}");
  CHECK_MESSAGE(nested.find("regex: too ambiguous to follow: after the ") == 0, nested);
  CHECK_MESSAGE(nested.find("ways at once (at most 1024); nested counts of optional items") != std::string::npos, nested);
  CHECK(compiled(output_format::regex, repeated(".?", 300)).find("regex: too ambiguous to follow: at its start it can be read ") == 0);
  // Behind a literal, inside a JSON string's pattern, and in GBNF alike.
  CHECK(compiled(output_format::regex, "id-(.{0,32}){32}").find("regex: too ambiguous") == 0);
  CHECK(compiled(output_format::schema, R"({"type":"object","properties":{"a":{"type":"string","pattern":"^(.{0,64}){64}$"}},"required":["a"]})")
            .find("at /properties/a/pattern: pattern: too ambiguous to follow") != std::string::npos);
  // A schema's pattern is probed on its own: the whole schema's probe never reaches one behind
  // other properties (or an optional one).
  CHECK(compiled(output_format::schema, R"({"type":"object","properties":{"n":{"type":"integer"},"a":{"type":"string",)"
                                        R"("pattern":"(.{0,64}){64}"}},"required":["n","a"]})")
            .find("at /properties/a/pattern: pattern: too ambiguous to follow") != std::string::npos);
  CHECK(compiled(output_format::schema, R"({"type":"object","properties":{"a":{"type":"string","pattern":")" +
                                            repeated("\\\\w?", 200) + R"("}}})")
            .find("at /properties/a/pattern: pattern: too costly to follow") != std::string::npos);
  // Not GBNF: a list written `items ::= item | item "," items` doubles its parses with each level
  // of nesting (a rank stops an answer that nests that deep).
  CHECK(compiled(output_format::gbnf, "root ::= \"[\" items? \"]\"\nitems ::= item | item \",\" items\nitem ::= root | [a-z]") ==
        "compiled");
  // Followed as before: repeats of optional items as people write them, and a choice among 200
  // names read together.
  CHECK(compiled(output_format::regex, "(.?){16}") == "compiled");
  CHECK(compiled(output_format::regex, "(\\w+,?\\s?){0,50}") == "compiled");
  CHECK(compiled(output_format::regex, "(\\s*\\w+\\s*){1,100}") == "compiled");
  // Repeats of items that may be empty read as repeats of their non-empty matches: one parse
  // each, not one for every later repeat ((\w?){200} kept 191, each producing 200 at every
  // character, and was refused as too costly).
  CHECK(compiled(output_format::regex, "(\\w?){200}") == "compiled");
  CHECK(compiled(output_format::regex, "(.?){256}") == "compiled");
  CHECK(compiled(output_format::regex, "^(\\w* ?){1,50}$") == "compiled");
  CHECK(compiled(output_format::regex, "^([a-z]*\\s*){1,50}$") == "compiled");
  // Few parses, each producing hundreds at every character (optional items written out one after
  // another): too costly, refused as such.
  const auto costly = compiled(output_format::regex, repeated("\\w?", 200));
  CHECK_MESSAGE(costly.find("regex: too costly to follow: reading ") == 0, costly);
  CHECK_MESSAGE(costly.find(" parse steps (at most 300000), which every token would repeat") != std::string::npos, costly);
  CHECK(compiled(output_format::regex, repeated(".?", 64)).find("regex: too costly to follow") == 0);
  // In a repeated group, the items' non-empty form is built in rules linear in the expression (a
  // copy per optional item took 370 MB for this before it was refused).
  CHECK(compiled(output_format::regex, "(" + repeated("a?", 2000) + ")*").find("regex: ") == 0);
  CHECK(compiled(output_format::regex, "[a-z]+@[a-z]+\\.(com|org)") == "compiled");
  std::string names = "(";
  for (int i = 0; i < 200; ++i) names += (i ? "|tool_" : "tool_") + std::to_string(i);
  CHECK(compiled(output_format::regex, names + ")") == "compiled");
  CHECK(compiled(output_format::object, "") == "compiled");
}

TEST_CASE("grammar: a matcher says when its parses pass the bound a rank follows (too_ambiguous), with how many and "
          "after how many tokens") {
  std::string why;
  // 70 forced characters hide the ambiguity from the compile-time probe (64 characters deep).
  auto g = compile_output_grammar(output_format::regex, std::string(70, 'a') + "(.{0,64}){64}", {}, &why);
  REQUIRE_MESSAGE(g, why);
  grammar_matcher m(g, byte_vocabulary(258), {257});
  size_t tokens = 0;
  while (too_ambiguous(m).empty() && tokens < 200) {
    REQUIRE(m.accept('a'));
    ++tokens;
  }
  CHECK(tokens >= 70);
  CHECK(tokens < 200);
  CHECK(m.parses() > grammar::max_parses);
  CHECK(too_ambiguous(m).find("the answer's grammar is too ambiguous to follow: after " + std::to_string(tokens) +
                              " tokens it can be read " + std::to_string(m.parses()) + " ways at once (at most 1024)") == 0);
}

TEST_CASE("grammar: a walk that costs more than a rank spends for one token's choice stops there (too_ambiguous: too "
          "costly), a bound on the walk itself relative to the vocabulary, whatever the number of parses") {
  std::string why;
  // 70 forced characters hide the cost from the compile-time probe.
  auto g = compile_output_grammar(output_format::regex, std::string(70, 'a') + repeated("\\w?", 200), {}, &why);
  REQUIRE_MESSAGE(g, why);
  // A vocabulary of 8,000 word pieces of 1 to 4 characters: the walk visits each for every parse.
  std::mt19937 rng{5};
  std::vector<std::string> text;
  std::vector<bool> special;
  for (int i = 0; i < 8000; ++i) {
    std::string t;
    for (int k = 0, n = 1 + static_cast<int>(rng() % 4); k < n; ++k) t += static_cast<char>('a' + rng() % 26);
    text.push_back(t);
    special.push_back(false);
  }
  text.push_back("");
  special.push_back(true);  // the end token
  const auto vocab = std::make_shared<token_vocabulary>(text, special);
  grammar_matcher m(g, vocab, {8000});
  REQUIRE(m.accept_bytes(std::string(70, 'a')));
  std::vector<uint8_t> mask;
  CHECK(m.allowed(&mask) > 0);
  CHECK(m.parses() <= grammar::max_parses);  // not too many parses: too much work
  CHECK(m.last_walk_over_budget());
  CHECK(m.last_walk_work() > grammar::max_mask_work_per_trie_node * vocab->trie().size());  // more than its trie allows
  CHECK(too_ambiguous(m).find("the answer's grammar is too costly to follow: after 0 tokens one token's choice passed ") == 0);
  // What the cut walk allowed is allowed: narrowed, never widened.
  for (size_t t = 0; t < mask.size(); ++t)
    if (mask[t]) CHECK(m.allows(static_cast<int32_t>(t)));
  // A plain JSON schema's string over the same vocabulary stays well inside the bound.
  auto json_string = compile_output_grammar(output_format::schema, R"({"type":"object","properties":{"name":{"type":"string"}},"required":["name"]})", {}, &why);
  REQUIRE_MESSAGE(json_string, why);
  grammar_matcher plain(json_string, vocab, {8000});
  REQUIRE(plain.accept_bytes("{\"name\":\""));
  CHECK(plain.allowed(&mask) > 0);
  CHECK_FALSE(plain.last_walk_over_budget());
  CHECK(too_ambiguous(plain).empty());
}

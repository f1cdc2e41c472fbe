// Baton's chat template engine against Jinja2 itself: every template in tests/data/chat_templates
// (written for these tests in the manner of Qwen2.5's, Llama 3.1's, Mistral's, Llama 2's,
// DeepSeek-R1's and Gemma's, plus one of every construct the engine claims) rendered with every
// conversation in contexts.json must give exactly the text Jinja2 gave (expected.json, made by
// render.py with transformers' environment), or fail where Jinja2 raised. Then what the engine
// refuses, by name and line.

#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gpu/chat_template.hpp"

using baton::gpu::chat_template;
using nlohmann::ordered_json;

namespace {

const std::string data_dir = BATON_SOURCE_DIR "/tests/data/chat_templates/";

std::string read(const std::string& path) {
  std::ifstream in{path};
  REQUIRE_MESSAGE(in.good(), path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string render(const std::string& source, const ordered_json& context = ordered_json::object()) {
  std::string why, out;
  auto t = chat_template::compile(source, &why);
  REQUIRE_MESSAGE(t, why);
  REQUIRE_MESSAGE(t->render(context, &out, &why), why);
  return out;
}

std::string compile_error(const std::string& source) {
  std::string why;
  CHECK_FALSE(chat_template::compile(source, &why));
  return why;
}

std::string render_error(const std::string& source, const ordered_json& context = ordered_json::object()) {
  std::string why, out;
  auto t = chat_template::compile(source, &why);
  REQUIRE_MESSAGE(t, why);
  CHECK_FALSE(t->render(context, &out, &why));
  return why;
}

}  // namespace

TEST_CASE("chat templates render exactly as Jinja2 renders them (tests/data/chat_templates/expected.json)") {
  const auto contexts = ordered_json::parse(read(data_dir + "contexts.json"));
  const auto expected = ordered_json::parse(read(data_dir + "expected.json"));
  REQUIRE(expected.size() >= 28);
  for (const auto& [key, want] : expected.items()) {
    CAPTURE(key);
    const auto slash = key.find('/');
    const std::string stem = key.substr(0, slash), context = key.substr(slash + 1);
    std::string why, out;
    auto t = chat_template::compile(read(data_dir + stem + ".jinja"), &why);
    REQUIRE_MESSAGE(t, why);
    const bool ok = t->render(contexts.at(context), &out, &why);
    if (want.contains("text")) {
      CHECK_MESSAGE(ok, why);
      CHECK(out == want["text"].get<std::string>());
    } else if (want.contains("error")) {  // the template's own raise_exception: its message, as is
      CHECK_FALSE(ok);
      CHECK(why == want["error"].get<std::string>());
    } else {  // Python failed on the template's own bug (str + dict): so must Baton, naming the line
      CHECK_FALSE(ok);
      CHECK(why.find("chat template line ") == 0);
    }
  }
}

TEST_CASE("chat template whitespace: trim_blocks, lstrip_blocks, '-' and '+' as transformers sets them") {
  CHECK(render("a\n  {% if true %}\n  b\n  {% endif %}\nc") == "a\n  b\nc");
  CHECK(render("a  {%- if true -%}  b  {%- endif -%}  c") == "abc");
  CHECK(render("x {{ 1 }} y") == "x 1 y");           // expression tags keep their spaces
  CHECK(render("  {{- 'v' -}}  \n") == "v");         // ... unless told
  CHECK(render("{% if true %}\nkept\n{% endif +%}\n.") == "kept\n\n.");
  CHECK(render("{# note #}\ntext\n") == "text");     // a comment eats its newline; the last newline goes
}

TEST_CASE("the chat template engine refuses what it does not run, naming the construct and its line") {
  CHECK(compile_error("a\n{{ x | groupby('y') }}") == "chat template line 2: the filter 'groupby' is not supported");
  CHECK(compile_error("{% include 'other' %}") == "chat template line 1: the statement 'include' is not supported");
  CHECK(compile_error("{% if x is even_ish %}{% endif %}") == "chat template line 1: the test 'even_ish' is not supported");
  CHECK(compile_error("{{ cycler(1) }}") == "chat template line 1: the function 'cycler' is not defined");
  CHECK(compile_error("{{ s.zfill(3) }}") == "chat template line 1: the method 'zfill' is not supported");
  CHECK(compile_error("\n\n{% for m in messages %}") == "chat template line 3: this for is never closed with endfor");
  CHECK(compile_error("{{ 'open }}") == "chat template line 1: a string literal is never closed");
  CHECK(compile_error("{{ x") == "chat template line 1: a tag opened here is never closed (no '}}')");
  CHECK(compile_error("{{ (1 }}") == "chat template line 1: expected ')', found the end of the tag");
}

TEST_CASE("a chat template's failures while rendering name the line; raise_exception passes the template's words") {
  CHECK(render_error("{{ raise_exception('Only user and assistant roles') }}") == "Only user and assistant roles");
  CHECK(render_error("\n{{ message.content.strip() }}") ==
        "chat template line 2: 'message' is undefined: it has no attribute 'content'");
  CHECK(render_error("{{ 'a' + 1 }}") == "chat template line 1: cannot apply '+' to str and int");
  CHECK(render_error("{% for x in none %}{% endfor %}") == "chat template line 1: none cannot be iterated");
  CHECK(render_error("{{ 1 // 0 }}") == "chat template line 1: division by zero");
  CHECK(render_error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}").find("more than 64 deep") != std::string::npos);
  // Undefined is lenient where Jinja's is: it prints nothing, is false, and has no length.
  CHECK(render("[{{ nothing }}]{{ nothing | length }}{% if not nothing %}!{% endif %}") == "[]0!");
}

TEST_CASE("regression: the chat template engine holds odd templates to an error, never a crash, a hang or an "
          "overflow (found in review)") {
  CHECK(render_error("{{ -9223372036854775807 - 2 }}") == "chat template line 1: integer overflow in '-'");
  CHECK(render_error("{{ 9223372036854775807 * 2 }}") == "chat template line 1: integer overflow in '*'");
  CHECK(render("{{ (-9223372036854775807 - 1) // -1 if false else 7 // -2 }} {{ -7 % 3 }} {{ 7 % -3 }}") == "-4 2 -2");
  CHECK(render("{{ 5 is divisibleby(-1) }}{{ '' * 9223372036854775807 }}{{ [] * 9223372036854775807 }}") == "True[]");
  CHECK(render("{{ 'abcdef'[1::9223372036854775807] }} {{ 'abcdef'[::-9223372036854775807] }}") == "b f");
  CHECK(render("{{ range(9223372036854775806, 9223372036854775807, 9223372036854775807) | list }}") ==
        "[9223372036854775806]");
  // A subscript whose key calls a macro that adds to the namespace holding the list: the list's
  // storage moved under a pointer taken before the key was computed.
  CHECK(render("{% set ns = namespace(a=[1,2]) %}{% macro g() %}{% set ns.b = 1 %}1{% endmacro %}{{ ns.a[g()|int] }}") == "2");
  CHECK(render_error("{{ 'x' | indent(-1) }}") == "chat template line 1: indent's width must be a string or a number from 0 to 1024");
  CHECK(compile_error("{{ 99999999999999999999 }}") == "chat template line 1: the number 99999999999999999999 is too large");
  CHECK(compile_error("{{ '\\x4Z' }}") == "chat template line 1: a string's \\x escape needs 2 hex digits");
  std::string deep = "{{ ";
  for (int i = 0; i < 200; ++i) deep += "not ";
  CHECK(compile_error(deep + "x }}") == "chat template line 1: the expression nests deeper than 128 levels");
  std::string chain = "{{ a";
  for (int i = 0; i < 3000; ++i) chain += " + a";
  CHECK(compile_error(chain + " }}") == "chat template line 1: a tag holds more than 4096 tokens");
  CHECK(compile_error("{% break %}") == "chat template line 1: 'break' is outside a for loop");
  CHECK(compile_error("{% endif %}") == "chat template line 1: 'endif' closes nothing open here");
  CHECK(compile_error("{% if x %}{% else if y %}{% endif %}") == "chat template line 1: unexpected 'if' after else");
  CHECK(compile_error("{{ 'a'(1) }}") == "chat template line 1: only functions, macros and methods can be called");
  // Loops within max_steps whose work is quadratic (each turn copies what the last built) ran for
  // minutes; a list wrapped in a list each turn would overflow the stack when copied.
  const std::string copied = "chat template line 1: the template copied more than 268435456 bytes and items";
  CHECK(render_error("{% set ns = namespace(x=[]) %}{% for i in range(1000000) %}{% set ns.x = ns.x + [i] %}{% endfor %}")
            .find(copied) == 0);
  CHECK(render_error("{% set ns = namespace(s='') %}{% for i in range(1000000) %}{% set ns.s = ns.s ~ 'xxxxxxxxxx' %}{% endfor %}")
            .find(copied) == 0);
  CHECK(render_error("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}") ==
        "chat template line 1: a list or dict nests deeper than 64 levels");
}

TEST_CASE("a conversation's turns and length are read in place: a template that looks back at the previous turn, "
          "as Qwen's do, renders thousands of turns") {
  ordered_json context = {{"messages", ordered_json::array()}};
  for (int i = 0; i < 20000; ++i) context["messages"].push_back({{"role", i % 2 ? "assistant" : "user"}, {"content", "x"}});
  const auto out = render(
      "{% for m in messages %}{% if loop.index0 > 0 and messages[loop.index0 - 1].role != m.role %}"
      "{{ (messages | length) - loop.index0 }}{% endif %}{% endfor %}",
      context);
  CHECK(out.size() > 20000);
}

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

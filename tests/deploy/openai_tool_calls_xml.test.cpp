// Qwen3-Coder's XML tool calls (gpu::tool_call_format::qwen3_xml): told from the model's chat
// template, read from answers whole and streamed (leniently, as vLLM's qwen3_coder parser reads
// them, and the same both ways), each value typed by the request's tool schema as vLLM types it.

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
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

/// A chat call to a Qwen3-Coder model with two tools, their parameters typed; `extra`: more of
/// the body's fields.
deploy::openai::call coder_call(const std::string& extra = "") {
  const std::string body = R"({"messages": [{"role": "user", "content": "x"}], "tools": [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
      "city": {"type": "string"}, "days": {"type": "integer"}, "lat": {"type": "number"},
      "radius": {"type": "number"}, "metric": {"type": "boolean"}, "filters": {"type": "object"},
      "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
      "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"}}}}}])" +
                           extra + "}";
  deploy::openai::call c;
  deploy::openai::api_error e;
  REQUIRE_MESSAGE(deploy::openai::parse_body(body, true, "m", &c, &e), e.message);
  REQUIRE(c.tool_parameters);
  c.tool_calls = tool_call_format::qwen3_xml;  // the gateway's, from the cluster's word on the model
  return c;
}

/// Two calls as Qwen3-Coder writes them, after a line of content.
const std::string two_calls =
    "I'll check.\n"
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n"
    "<parameter=lat>\n48.85\n</parameter>\n"
    "<parameter=radius>\n1e1\n</parameter>\n"
    "<parameter=metric>\nTrue\n</parameter>\n"
    "<parameter=filters>\n{\"rain\": true, \"wind\": [1, 2]}\n</parameter>\n"
    "<parameter=tags>\nnull\n</parameter>\n"
    "<parameter=note>\n5\n</parameter>\n"  // not in the schema: text
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=write_file>\n"
    "<parameter=path>\na.html\n</parameter>\n"
    "<parameter=content>\n<p>1 < 2</p>\nclose with </tool_call>\n\n</parameter>\n"
    "<parameter=mode>\n0644x\n</parameter>\n"  // no integer: text
    "</function>\n</tool_call>";

const json weather_args = json::parse(
    R"({"city": "Paris", "days": 3, "lat": 48.85, "radius": 10, "metric": true,
        "filters": {"rain": true, "wind": [1, 2]}, "tags": null, "note": "5"})");
const json file_args = {{"path", "a.html"}, {"content", "<p>1 < 2</p>\nclose with </tool_call>\n"}, {"mode", "0644x"}};

using calls = std::vector<std::pair<std::string, std::string>>;  ///< name, arguments

struct told {
  std::string content;
  calls got;
  bool called = false;
  bool named_early = false;   ///< a call's name went out before the answer's last piece
  bool args_early = false;    ///< a call's arguments did
  size_t num_arg_pieces = 0;  ///< pieces that carried arguments
};

/// The answer as the gateway reads it, fed in pieces of `step` bytes (one piece: whole).
told read(const deploy::openai::call& c, const std::string& text, size_t step) {
  deploy::openai::answer_reader r{c, 0};
  told out;
  for (size_t at = 0; at < text.size(); at += step) {
    const bool last = at + step >= text.size();
    auto part = r.feed(text.substr(at, step), last);
    out.content += part.content;
    out.called |= part.called;
    for (const auto& t : part.tool_calls) {
      if (t.first) {
        REQUIRE(t.index == out.got.size());
        out.got.emplace_back(t.name, "");
        out.named_early |= !last;
      }
      REQUIRE(t.index + 1 == out.got.size());
      out.got.back().second += t.arguments;
      if (!t.arguments.empty()) {
        ++out.num_arg_pieces;
        out.args_early |= !last;
      }
    }
  }
  return out;
}

/// A model directory holding a byte-level tokenizer.json whose added tokens are <tool_call>,
/// </tool_call> and <|im_end|> (special, as the end of text is), and a tokenizer_config.json with
/// `chat_template`; removed with the object.
struct model_dir {
  std::filesystem::path path;
  model_dir(const std::string& name, const std::string& chat_template) {
    path = std::filesystem::temp_directory_path() / ("baton-xml-" + name + "-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    json vocab = json::object();
    const auto& byte_sym = gpu::byte_level_symbols();
    for (int b = 0; b < 256; ++b) vocab[byte_sym[b]] = b;
    const json added = {{{"id", 256}, {"content", "<tool_call>"}, {"special", true}},
                        {{"id", 257}, {"content", "</tool_call>"}, {"special", true}},
                        {{"id", 258}, {"content", "<|im_end|>"}, {"special", true}}};
    const json tok = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
                      {"added_tokens", added},
                      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                      {"normalizer", nullptr}};
    std::ofstream{path / "tokenizer.json"} << tok.dump();
    std::ofstream{path / "tokenizer_config.json"} << json{{"chat_template", chat_template}}.dump();
  }
  ~model_dir() { std::filesystem::remove_all(path); }
  std::shared_ptr<const gpu::tokenizer> load() const {
    gpu::model_config m;
    m.vocab_size = 512;
    m.bos_token_id = -1;
    m.eos_token_id = 258;
    std::string why;
    auto t = gpu::load_model_tokenizer(path.string(), m, &why);
    REQUIRE_MESSAGE(t, why);
    return t;
  }
};

}  // namespace

TEST_CASE("tool calls: a template that writes <tool_call>, <function= and <parameter= (Qwen3-Coder's) asks for XML "
          "calls, not Hermes' JSON, and answers keep its <tool_call> markers") {
  // What Qwen3-Coder's template writes for an assistant's calls (its own, trimmed).
  const std::string coder_source =
      "{%- for m in messages %}{%- if m.tool_calls is defined %}{%- for c in m.tool_calls %}"
      "{{- '\\n<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
      "{%- for k, v in c.function.arguments | items %}{{- '<parameter=' + k + '>\\n' }}{{- v | string }}"
      "{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
      "{%- else %}{{- m.content }}{%- endif %}{%- endfor %}";
  const std::string hermes_source =
      "{%- for m in messages %}{%- if m.tool_calls is defined %}{%- for c in m.tool_calls %}<tool_call>\n"
      "{{ c.function | tojson }}\n</tool_call>{%- endfor %}{%- else %}{{- m.content }}{%- endif %}{%- endfor %}";
  // The same XML in another wrapper (Seed-OSS's <seed:tool_call>) is not Qwen3-Coder's: its calls
  // would never read as those.
  std::string seed_source = coder_source;
  for (const auto& [tag, seed_tag] :
       {std::pair{"<tool_call>", "<seed:tool_call>"}, {"</tool_call>", "</seed:tool_call>"}})
    for (size_t at; (at = seed_source.find(tag)) != std::string::npos;)
      seed_source.replace(at, std::string_view{tag}.size(), seed_tag);
  model_dir coder{"coder", coder_source}, hermes{"hermes", hermes_source}, seed{"seed", seed_source};
  const auto c = coder.load(), h = hermes.load();
  CHECK(c->tool_calls() == tool_call_format::qwen3_xml);
  CHECK(h->tool_calls() == tool_call_format::hermes);
  CHECK(seed.load()->tool_calls() == tool_call_format::none);
  // Decoding drops special tokens, but not the markers the calls are found by.
  CHECK(c->decode({256, '\n', '<', 'f', 257, 258}) == "<tool_call>\n<f</tool_call>");
  // The cluster's answer carries the format as a number, checked against the largest.
  CHECK(gpu::max_tool_call_format == static_cast<uint8_t>(tool_call_format::qwen3_xml));
}

TEST_CASE("tool calls in Qwen3-Coder's XML: each <tool_call> block is a call, its parameters typed by the tool's "
          "schema (integer, number, boolean, object, null; a string's text as written), content before them") {
  const auto c = coder_call();
  const auto whole = deploy::openai::read_tool_calls(two_calls, tool_call_format::qwen3_xml, c.tool_parameters.get());
  CHECK(whole.content == "I'll check.");
  REQUIRE(whole.tool_calls.size() == 2);
  CHECK(whole.tool_calls[0].name == "get_weather");
  CHECK(json::parse(whole.tool_calls[0].arguments) == weather_args);
  CHECK(json::parse(whole.tool_calls[0].arguments)["radius"].is_number_integer());  // 1e1: integral, written as 10
  CHECK(whole.tool_calls[0].arguments.starts_with(R"({"city":"Paris","days":3,)"));  // in the order written
  CHECK(whole.tool_calls[1].name == "write_file");
  CHECK(json::parse(whole.tool_calls[1].arguments) == file_args);

  // As the gateway answers it: the calls, finish_reason tool_calls.
  completion done;
  done.text = two_calls;
  done.finish_reason = "eos";
  const auto choice = json::parse(deploy::openai::completion_json(c, done, "chatcmpl-7-1", 0))["choices"][0];
  CHECK(choice["finish_reason"] == "tool_calls");
  CHECK(choice["message"]["content"] == "I'll check.\n");
  REQUIRE(choice["message"]["tool_calls"].size() == 2);
  CHECK(choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather");
  CHECK(json::parse(choice["message"]["tool_calls"][1]["function"]["arguments"].get<std::string>()) == file_args);

  // Cut by max_tokens after </function>: the call is whole, and reads.
  const auto cut = deploy::openai::read_tool_calls("<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
                                                   "</function>\n",
                                                   tool_call_format::qwen3_xml, c.tool_parameters.get());
  REQUIRE(cut.tool_calls.size() == 1);
  CHECK(cut.tool_calls[0].arguments == R"({"days":2})");
}

TEST_CASE("tool calls in Qwen3-Coder's XML: a parameter the tools do not type, and a call without tools, keep their "
          "values' text (null aside); a missing </parameter> ends at the next parameter") {
  const auto c = coder_call();
  const std::string text = "<tool_call>\n<function=search>\n<parameter=q>\n{\"a\": 1}\n</parameter>\n"
                           "<parameter=n>\n7\n<parameter=none>\nNULL\n</parameter>\n</function>\n</tool_call>";
  const json want = {{"q", "{\"a\": 1}"}, {"n", "7"}, {"none", nullptr}};
  // A function the request's tools do not declare is no call (openai_tool_calls_declared.test.cpp).
  CHECK(deploy::openai::read_tool_calls(text, tool_call_format::qwen3_xml, c.tool_parameters.get()).content == text);
  const auto untyped = deploy::openai::read_tool_calls(text, tool_call_format::qwen3_xml);  // no tools' types
  REQUIRE(untyped.tool_calls.size() == 1);
  CHECK(json::parse(untyped.tool_calls[0].arguments) == want);
  // Typed by the schema, the same text is a number; no tools, text.
  const std::string days = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
  CHECK(deploy::openai::read_tool_calls(days, tool_call_format::qwen3_xml, c.tool_parameters.get()).tool_calls[0].arguments ==
        R"({"days":3})");
  CHECK(deploy::openai::read_tool_calls(days, tool_call_format::qwen3_xml).tool_calls[0].arguments == R"({"days":"3"})");
}

TEST_CASE("tool calls in Qwen3-Coder's XML streamed in pieces of any size (a byte at a time too) read as the whole "
          "answer does: no XML in the content, each call named at <function=NAME>, its arguments whole at "
          "</function>") {
  const auto c = coder_call();
  const auto whole = read(c, two_calls, two_calls.size());
  REQUIRE(whole.got.size() == 2);
  CHECK(whole.content == "I'll check.\n");  // what went before the first marker, as it was written
  CHECK(whole.called);
  CHECK(json::parse(whole.got[0].second) == weather_args);
  for (size_t step : {1, 2, 3, 5, 7, 13, 64}) {
    CAPTURE(step);
    const auto streamed = read(c, two_calls, step);
    CHECK(streamed.content == whole.content);
    CHECK(streamed.got == whole.got);
    CHECK(streamed.called);
    CHECK(streamed.named_early);
    CHECK(streamed.args_early);  // the first call's, at its </function>, before the answer ends
    CHECK(streamed.num_arg_pieces == 2);  // one piece per call
  }
  // The name goes out at its '>', the arguments at </function>, nothing at </tool_call>.
  deploy::openai::answer_reader live{c, 0};
  CHECK(live.feed("Sure.\n<tool_call>\n<function=get_wea", false).content == "Sure.\n");
  auto named = live.feed("ther>\n<parameter=city>\nPar", false);
  REQUIRE(named.tool_calls.size() == 1);
  CHECK(named.tool_calls[0].first);
  CHECK(named.tool_calls[0].name == "get_weather");
  CHECK(named.tool_calls[0].arguments.empty());
  CHECK(named.content.empty());
  CHECK(live.feed("is\n</parameter>\n</func", false).tool_calls.empty());
  auto args = live.feed("tion>\n</tool_", false);
  REQUIRE(args.tool_calls.size() == 1);
  CHECK_FALSE(args.tool_calls[0].first);
  CHECK(args.tool_calls[0].arguments == R"({"city":"Paris"})");
  auto end = live.feed("call>", true);
  CHECK(end.tool_calls.empty());
  CHECK(end.content.empty());
  CHECK(end.called);
}

TEST_CASE("tool calls in Qwen3-Coder's XML: an answer with no <function=NAME> tag (Hermes' JSON in the block, a tag "
          "without its '>', one cut before it) is content, whole and streamed") {
  const auto c = coder_call();
  const std::vector<std::string> no_calls = {
      "Hm. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>",  // Hermes' JSON
      "<tool_call>\n<function=get_weather\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",  // no '>'
      "<tool_call>\n<function= >\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",  // no name
      "I'll look.\n<tool_call>\n<function=get_wea",  // cut inside the tag
      "Write <function=\nname> tags.",  // a bare <function= that is no tag
  };
  for (const auto& text : no_calls) {
    CAPTURE(text);
    const auto whole = deploy::openai::read_tool_calls(text, tool_call_format::qwen3_xml, c.tool_parameters.get());
    CHECK(whole.tool_calls.empty());
    CHECK(whole.content == text);
    for (size_t step : {size_t{1}, size_t{4}, text.size()}) {
      CAPTURE(step);
      const auto streamed = read(c, text, step);
      CHECK(streamed.content == text);
      CHECK(streamed.got.empty());  // nothing was named: nothing went out but the text
      CHECK_FALSE(streamed.called);
    }
  }
}

namespace {

/// The answer read as the gateway reads it, whole and streamed in pieces of several sizes (a byte
/// at a time too): the two must agree, and every streamed call's arguments must be a JSON object
/// (never "", which SDKs' JSON.parse refuses). The whole read (which read_tool_calls agrees with).
told read_both(const deploy::openai::call& c, const std::string& text) {
  const auto whole = read(c, text, text.size());
  const auto direct = deploy::openai::read_tool_calls(text, tool_call_format::qwen3_xml, c.tool_parameters.get());
  REQUIRE(direct.tool_calls.size() == whole.got.size());
  for (size_t i = 0; i < whole.got.size(); ++i) {
    CHECK(direct.tool_calls[i].name == whole.got[i].first);
    CHECK(direct.tool_calls[i].arguments == whole.got[i].second);
  }
  for (size_t step : {1, 2, 3, 7, 64}) {
    CAPTURE(step);
    const auto streamed = read(c, text, step);
    CHECK(streamed.content == whole.content);
    CHECK(streamed.got == whole.got);
    CHECK(streamed.called == whole.called);
    for (const auto& [name, args] : streamed.got) {
      CAPTURE(name);
      REQUIRE_FALSE(args.empty());
      CHECK(json::parse(args).is_object());
    }
  }
  return whole;
}

/// What an answer should read as: its calls (name, arguments) and its content (the reader's: the
/// text before the first call as written, then what the calls left on a line of its own).
struct want_read {
  std::string text;
  std::vector<std::pair<std::string, json>> calls;
  std::string content;
};

void check_reads(const deploy::openai::call& c, const want_read& want) {
  CAPTURE(want.text);
  const auto got = read_both(c, want.text);
  CHECK(got.called);
  CHECK(got.content == want.content);
  REQUIRE(got.got.size() == want.calls.size());
  for (size_t i = 0; i < want.calls.size(); ++i) {
    CHECK(got.got[i].first == want.calls[i].first);
    CHECK(json::parse(got.got[i].second) == want.calls[i].second);
  }
}

}  // namespace

TEST_CASE("tool calls in Qwen3-Coder's XML are read leniently, as vLLM reads them: text among the parameters is "
          "passed over, a body without parameters is {}, every <function= in a block is a call; whole and streamed "
          "a byte at a time read the same, arguments always a JSON object") {
  const auto c = coder_call();
  const std::vector<want_read> lenient = {
      // Text and no parameter: a call without arguments.
      {"<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>", {{"get_weather", json::object()}}, ""},
      // Stray text before, between and after the parameters is passed over.
      {"<tool_call>\n<function=get_weather>\nLet me see.\n<parameter=city>\nParis\n</parameter>\nand\n"
       "<parameter=days>\n3\n</parameter>\ndone\n</function>\n</tool_call>",
       {{"get_weather", {{"city", "Paris"}, {"days", 3}}}},
       ""},
      // A value quoting </parameter> ends there (raw text, vLLM's reading); the rest is passed over.
      {"<tool_call>\n<function=write_file>\n<parameter=content>\na </parameter> b\n</parameter>\n</function>\n"
       "</tool_call>",
       {{"write_file", {{"content", "a "}}}},
       ""},
      // Two functions in one block: two calls.
      {"<tool_call>\n<function=get_weather>\n<parameter=days>\n1\n</parameter>\n</function>\n"
       "<function=write_file>\n<parameter=path>\na\n</parameter>\n</function>\n</tool_call>",
       {{"get_weather", {{"days", 1}}}, {"write_file", {{"path", "a"}}}},
       ""},
      // Text between </function> and </tool_call>, and after the block: content (vLLM drops it).
      {"I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
       "oops\n</tool_call>\nDone.",
       {{"get_weather", {{"city", "Paris"}}}},
       "I'll look.\n\noops\nDone."},
      // A parameter tag that is no tag (a line break in its name) is passed over with its value.
      {"<tool_call>\n<function=get_weather>\n<parameter=da\nys>\n3\n</parameter>\n<parameter=city>\nParis\n"
       "</parameter>\n</function>\n</tool_call>",
       {{"get_weather", {{"city", "Paris"}}}},
       ""},
      // A <function= inside a value is the value's text.
      {"<tool_call>\n<function=write_file>\n<parameter=content>\nuse <function=f> tags\n</parameter>\n"
       "</function>\n</tool_call>",
       {{"write_file", {{"content", "use <function=f> tags"}}}},
       ""},
      // The last value without </parameter> ends at </function>.
      {"<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
       {{"get_weather", {{"city", "Paris"}}}},
       ""},
      // A call ends at its first </function> only: one missing it takes in the next block's parameters
      // (vLLM ends it at </tool_call>; openai_tool_calls_xml.cpp lists the differences).
      {"<tool_call>\n<function=get_weather>\n<parameter=days>\n1\n</parameter>\n</tool_call>\n<tool_call>\n"
       "<function=write_file>\n<parameter=path>\na\n</parameter>\n</function>\n</tool_call>",
       {{"get_weather", {{"days", 1}, {"path", "a"}}}},
       ""},
  };
  for (const auto& want : lenient) check_reads(c, want);

  // Streamed, the second call of a block is named at its own tag, before the answer ends.
  const auto& two_in_one = lenient[3].text;
  const auto streamed = read(c, two_in_one, 1);
  CHECK(streamed.named_early);
  CHECK(streamed.num_arg_pieces == 2);
}

TEST_CASE("tool calls in Qwen3-Coder's XML: an answer cut inside a call (max_tokens) reads as the call with the "
          "parameters written so far, whole and streamed; streamed, that call's arguments go out at the end") {
  const auto c = coder_call();
  const std::vector<want_read> cut = {
      {"Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", {{"get_weather", {{"city", "Par"}}}},
       "Sure.\n"},
      {"<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n", {{"get_weather", {{"days", 3}}}}, ""},
      // Cut inside the value's end tag: the tag's start is not the value's.
      {"<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</p", {{"get_weather", {{"city", "Rome"}}}}, ""},
      // Cut inside a parameter's tag: that parameter is not read.
      {"<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=ci",
       {{"get_weather", {{"days", 3}}}},
       ""},
      // Cut just after the name: no arguments.
      {"<tool_call>\n<function=get_weather>", {{"get_weather", json::object()}}, ""},
      // The first call whole, the second cut.
      {two_calls.substr(0, two_calls.find("close with")),
       {{"get_weather", weather_args}, {"write_file", {{"path", "a.html"}, {"content", "<p>1 < 2</p>"}}}},
       "I'll check.\n"},
  };
  for (const auto& want : cut) check_reads(c, want);

  // The cut call's arguments go out with the last piece: named early, its arguments not.
  const auto& one = cut[0].text;
  for (size_t step : {size_t{1}, size_t{5}}) {
    const auto streamed = read(c, one, step);
    CHECK(streamed.named_early);
    CHECK_FALSE(streamed.args_early);
    CHECK(streamed.num_arg_pieces == 1);
  }

  // As the gateway answers it: the call, with finish_reason length (the answer was cut).
  completion done;
  done.text = one;
  done.finish_reason = "length";
  const auto choice = json::parse(deploy::openai::completion_json(c, done, "chatcmpl-7-2", 0))["choices"][0];
  CHECK(choice["finish_reason"] == "length");
  REQUIRE(choice["message"]["tool_calls"].size() == 1);
  CHECK(json::parse(choice["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()) ==
        json{{"city", "Par"}});
}

TEST_CASE("tool calls in Qwen3-Coder's XML: a bare <function=NAME> with no <tool_call> before it is a call (vLLM "
          "reads those whole), streamed alike") {
  const auto c = coder_call();
  const std::vector<want_read> bare = {
      {"Sure. <function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
       {{"get_weather", {{"city", "Paris"}}}},
       "Sure. "},
      {"<function=get_weather>\n</function>\n<tool_call>\n<function=write_file>\n</function>\n</tool_call>",
       {{"get_weather", json::object()}, {"write_file", json::object()}},
       ""},
  };
  for (const auto& want : bare) check_reads(c, want);
  CHECK(deploy::openai::read_tool_calls(bare[0].text, tool_call_format::qwen3_xml, c.tool_parameters.get()).content ==
        "Sure.");
  // The content before it streams at once, the name at its '>'.
  deploy::openai::answer_reader live{c, 0};
  CHECK(live.feed("Sure. <func", false).content == "Sure. ");
  const auto named = live.feed("tion=get_weather>\n", false);
  REQUIRE(named.tool_calls.size() == 1);
  CHECK(named.tool_calls[0].name == "get_weather");
  CHECK(named.content.empty());
}

TEST_CASE("tool calls streamed a byte at a time with a long text after the last call, or between its end and "
          "</tool_call> (Qwen3-Coder's XML and Hermes' JSON), read as the whole answer does") {
  // Each piece looks for the next call from where the last look stopped (find_forward in
  // openai_tool_calls.cpp), so 200 KB streamed a byte at a time is searched once, not once per
  // byte; what is checked here is what they read. The text has '<' and "</" that may start a marker.
  std::string prose;
  while (prose.size() < 200'000) prose += "Then a < b, and </ is no tag. ";
  const std::string trimmed_prose = prose.substr(0, prose.size() - 1);
  auto c = coder_call();

  const std::string xml_call = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n";
  for (const auto& text : {xml_call + "</tool_call>\n" + prose, xml_call + prose + "\n</tool_call>"}) {
    const auto whole = read(c, text, text.size());
    REQUIRE(whole.got.size() == 1);
    CHECK(json::parse(whole.got[0].second) == json{{"days", 2}});
    CHECK(whole.content == trimmed_prose);
    const auto streamed = read(c, text, 1);
    CHECK(streamed.got == whole.got);
    CHECK(streamed.content == whole.content);
  }
  // A long value streams the same (its </function> is looked for from where the last look stopped).
  const std::string long_value =
      "<tool_call>\n<function=write_file>\n<parameter=content>\n" + prose + "\n</parameter>\n</function>\n</tool_call>";
  const auto value = read(c, long_value, 1);
  REQUIRE(value.got.size() == 1);
  CHECK(json::parse(value.got[0].second) == json{{"content", prose}});

  c.tool_calls = tool_call_format::hermes;
  const std::string hermes_call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 2}}";
  const std::string after = hermes_call + "\n</tool_call>\n" + prose;
  const auto whole = read(c, after, after.size());
  REQUIRE(whole.got.size() == 1);
  CHECK(whole.content == trimmed_prose);
  const auto streamed = read(c, after, 1);
  CHECK(streamed.got == whole.got);
  CHECK(streamed.content == whole.content);
  // Text between the JSON and </tool_call> breaks the call read whole (content, whole); the
  // stream named it before it could know, and its text follows as content.
  const std::string between = hermes_call + prose + "</tool_call>";
  CHECK(read(c, between, between.size()).content == between);
  const auto late = read(c, between, 1);
  CHECK(late.content == between);
  CHECK(late.got.size() == 1);
}

TEST_CASE("tool calls in Qwen3-Coder's XML with parallel_tool_calls false: the first call only, whole or streamed") {
  const auto c = coder_call(R"(, "parallel_tool_calls": false)");
  REQUIRE(c.one_tool_call);
  for (size_t step : {size_t{1}, two_calls.size()}) {
    CAPTURE(step);
    const auto one = read(c, two_calls, step);
    REQUIRE(one.got.size() == 1);
    CHECK(one.got[0].first == "get_weather");
    CHECK(json::parse(one.got[0].second) == weather_args);
    CHECK(one.content == "I'll check.\n");
  }
}

// The OpenAI API's features over real sockets on 127.0.0.1, each against the router's own
// answer: log-probabilities, echo and prompt scoring (as evaluation harnesses call it), n
// choices, best_of and batches of prompts, request bodies sent in chunks, and a thinking model's reasoning.

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "tests/deploy/gateway_fixture.hpp"
#include "tests/deploy/metrics_text.hpp"

using namespace baton;
using namespace baton::test_gateway;
using nlohmann::json;

namespace {

/// A streamed chat answer's reasoning_content and content deltas, each joined.
std::pair<std::string, std::string> streamed_chat(const std::string& body) {
  std::vector<json> events;
  sse_text(body, &events, true);
  std::string reasoning, content;
  for (const auto& ev : events) {
    if (!ev.is_object() || ev["choices"].empty()) continue;
    const auto& delta = ev["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
    if (delta.contains("content")) content += delta["content"].get<std::string>();
  }
  return {reasoning, content};
}

}  // namespace

TEST_CASE("logprobs over HTTP: the whole answer's and the stream's are the router's, token for token") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  generate_request ref_req;
  ref_req.prompt = "The quick brown fox";
  ref_req.max_tokens = 8;
  ref_req.ignore_eos = true;
  ref_req.logprobs = true;
  ref_req.top_logprobs = 2;
  const auto ref = s.direct(ref_req);
  REQUIRE(ref.logprobs.size() == 8);
  const std::string body = R"({"prompt":"The quick brown fox","max_tokens":8,"ignore_eos":true,"logprobs":2)";
  auto whole = round_trip(port, post("/v1/completions", body + "}"));
  REQUIRE(whole.status == 200);
  auto lp = json::parse(whole.body)["choices"][0]["logprobs"];
  REQUIRE(lp["token_logprobs"].size() == 8);
  uint64_t offset = 0;
  for (size_t i = 0; i < 8; ++i) {
    CAPTURE(i);
    CHECK(lp["tokens"][i] == ref.logprobs[i].text);
    CHECK(lp["token_logprobs"][i].get<double>() == doctest::Approx(ref.logprobs[i].logprob));
    CHECK(lp["text_offset"][i] == offset);
    offset += deploy::openai::utf8_chars(ref.logprobs[i].text);
    CHECK(lp["top_logprobs"][i].size() <= 2);
    CHECK(lp["top_logprobs"][i][ref.logprobs[i].top_texts[0]].get<double>() == doctest::Approx(ref.logprobs[i].top_logprobs[0]));
  }
  auto streamed = round_trip(port, post("/v1/completions", body + R"(,"stream":true})"));
  REQUIRE(streamed.status == 200);
  std::vector<json> events;
  sse_text(streamed.body, &events);
  std::vector<double> values;
  std::vector<uint64_t> offsets;
  for (const auto& ev : events)
    if (ev.is_object() && !ev["choices"].empty() && !ev["choices"][0]["logprobs"].is_null())
      for (size_t k = 0; k < ev["choices"][0]["logprobs"]["token_logprobs"].size(); ++k) {
        values.push_back(ev["choices"][0]["logprobs"]["token_logprobs"][k].get<double>());
        offsets.push_back(ev["choices"][0]["logprobs"]["text_offset"][k].get<uint64_t>());
      }
  REQUIRE(values.size() == 8);
  for (size_t i = 0; i < 8; ++i) {
    CHECK(values[i] == doctest::Approx(lp["token_logprobs"][i].get<double>()));
    CHECK(offsets[i] == lp["text_offset"][i].get<uint64_t>());
  }
}

TEST_CASE("a stop string that cuts into a token: the log-probability entries' texts join to the answer's text, "
          "whole and streamed, and a streamed entry never runs ahead of the text sent") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  generate_request ref_req;
  ref_req.prompt = "In the beginning";
  ref_req.max_tokens = 24;
  ref_req.ignore_eos = true;
  ref_req.logprobs = true;
  const auto ref = s.direct(ref_req);
  // A token of two or more characters whose tail first appears in it: the stop string is that
  // tail, so the cut runs through the token (as " LORD" by "LO": its leading space stays).
  REQUIRE(!ref.logprobs.empty());
  std::string before = ref.logprobs[0].text, stop, want;
  size_t cut_token = 0;
  for (size_t k = 1; k < ref.logprobs.size() && stop.empty(); ++k) {
    const auto& t = ref.logprobs[k].text;
    if (t.size() >= 2 && static_cast<unsigned char>(t[1]) < 0x80 && (before + t).find(t.substr(1)) == before.size() + 1) {
      stop = t.substr(1);
      want = before + t.substr(0, 1);
      cut_token = k;
    }
    before += t;
  }
  REQUIRE_MESSAGE(!stop.empty(), "no token of two characters to cut in: " << ref.text);
  CAPTURE(stop);
  const std::string body = R"({"prompt":"In the beginning","max_tokens":24,"ignore_eos":true,"logprobs":1,"stop":)" +
                           json(stop).dump();
  auto whole = round_trip(port, post("/v1/completions", body + "}"));
  REQUIRE(whole.status == 200);
  const auto choice = json::parse(whole.body)["choices"][0];
  CHECK(choice["text"] == want);
  CHECK(choice["finish_reason"] == "stop");
  std::string joined;
  for (const auto& t : choice["logprobs"]["tokens"]) joined += t.get<std::string>();
  CHECK(joined == want);
  CHECK(choice["logprobs"]["tokens"].size() == cut_token + 1);  // the cut token keeps its text before the cut
  auto streamed = round_trip(port, post("/v1/completions", body + R"(,"stream":true})"));
  REQUIRE(streamed.status == 200);
  std::vector<json> events;
  sse_text(streamed.body, &events);
  std::string text, tokens;
  for (const auto& ev : events) {
    if (!ev.is_object() || ev["choices"].empty()) continue;
    text += ev["choices"][0]["text"].get<std::string>();
    if (!ev["choices"][0]["logprobs"].is_null())
      for (const auto& t : ev["choices"][0]["logprobs"]["tokens"]) tokens += t.get<std::string>();
    CHECK_MESSAGE(text.compare(0, tokens.size(), tokens) == 0, "entries ran ahead of the text: '" << tokens << "' vs '" << text << "'");
  }
  CHECK(text == want);
  CHECK(tokens == want);
}

TEST_CASE("echo over HTTP, as evaluation harnesses score: the prompt's token log-probabilities are the router's, "
          "max_tokens 0 answers the prompt alone, and a text prompt comes back ahead of its completion") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  generate_request ref_req;
  ref_req.prompt = "In the beginning";
  ref_req.max_tokens = 1;
  ref_req.prompt_logprobs = true;
  ref_req.top_logprobs = 1;
  ref_req.echo = true;
  const auto ref = s.direct(ref_req);
  REQUIRE(ref.prompt_logprobs.size() == ref.num_prompt_tokens);
  ref_req.prompt = "And God said";
  const auto ref2 = s.direct(ref_req);
  // The harness's request: a batch of token-id prompts, echo, one alternative, nothing generated.
  json ids = json::array(), ids2 = json::array();
  for (const auto& t : ref.prompt_logprobs) ids.push_back(t.token);
  for (const auto& t : ref2.prompt_logprobs) ids2.push_back(t.token);
  auto scored = round_trip(port, post("/v1/completions", json{{"prompt", {ids, ids2}}, {"echo", true}, {"logprobs", 1},
                                                               {"max_tokens", 0}, {"temperature", 0}}.dump()));
  REQUIRE(scored.status == 200);
  const auto answer = json::parse(scored.body);
  REQUIRE(answer["choices"].size() == 2);
  const auto lp2 = answer["choices"][1]["logprobs"];
  REQUIRE(lp2["token_logprobs"].size() == ref2.num_prompt_tokens);
  for (size_t i = 1; i < ref2.num_prompt_tokens; ++i)
    CHECK(lp2["token_logprobs"][i].get<double>() == doctest::Approx(ref2.prompt_logprobs[i].logprob));
  CHECK(answer["choices"][1]["text"] == ref2.prompt_text);
  CHECK(answer["usage"]["prompt_tokens"] == ref.num_prompt_tokens + ref2.num_prompt_tokens);
  const auto lp = answer["choices"][0]["logprobs"];
  REQUIRE(lp["token_logprobs"].size() == ref.num_prompt_tokens);
  CHECK(lp["token_logprobs"][0].is_null());
  CHECK(lp["top_logprobs"][0].is_null());
  for (size_t i = 1; i < ref.num_prompt_tokens; ++i) {
    CAPTURE(i);
    CHECK(lp["tokens"][i] == ref.prompt_logprobs[i].text);
    CHECK(lp["token_logprobs"][i].get<double>() == doctest::Approx(ref.prompt_logprobs[i].logprob));
    // The most likely token, and the prompt's own when it is not that one (as vLLM gives them).
    const auto& top = lp["top_logprobs"][i];
    REQUIRE((top.size() == 1 || top.size() == 2));
    CHECK(top.contains(ref.prompt_logprobs[i].text));
    for (const auto& [text, value] : top.items()) CHECK(value.get<double>() >= lp["token_logprobs"][i].get<double>() - 1e-6);
  }
  CHECK(answer["choices"][0]["text"] == ref.prompt_text);
  CHECK(answer["usage"]["completion_tokens"] == 0);
  // A prompt that fills the whole context can be scored (its picked token is never fed back);
  // one token more cannot, and generating after a full context cannot either.
  const uint32_t ctx = s.stats().context_tokens;
  json full = json::array(), over = json::array();
  for (uint32_t i = 0; i < ctx; ++i) full.push_back(ids[i % ids.size()]);
  over = full;
  over.push_back(ids[0]);
  auto whole_context = round_trip(port, post("/v1/completions", json{{"prompt", full}, {"echo", true}, {"logprobs", 0},
                                                                     {"max_tokens", 0}}.dump()));
  REQUIRE_MESSAGE(whole_context.status == 200, whole_context.body);
  CHECK(json::parse(whole_context.body)["choices"][0]["logprobs"]["token_logprobs"].size() == ctx);
  CHECK(round_trip(port, post("/v1/completions", json{{"prompt", over}, {"echo", true}, {"max_tokens", 0}}.dump())).status == 400);
  CHECK(round_trip(port, post("/v1/completions", json{{"prompt", full}, {"max_tokens", 1}}.dump())).status == 400);
  // n choices of a prompt: scored once, every choice shows the scores; a stream cannot wait for them.
  auto twice = round_trip(port, post("/v1/completions", json{{"prompt", ids}, {"echo", true}, {"logprobs", 0},
                                                              {"n", 2}, {"max_tokens", 2}, {"temperature", 1}}.dump()));
  REQUIRE(twice.status == 200);
  const auto both = json::parse(twice.body)["choices"];
  REQUIRE(both.size() == 2);
  const auto prompt_part = [&](const json& choice) {
    auto v = choice["logprobs"]["token_logprobs"];
    return json(std::vector<json>(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(ref.num_prompt_tokens)));
  };
  CHECK(prompt_part(both[0]) == prompt_part(both[1]));
  CHECK(prompt_part(both[1])[1].get<double>() == doctest::Approx(ref.prompt_logprobs[1].logprob));
  CHECK(both[1]["logprobs"]["token_logprobs"].size() == ref.num_prompt_tokens + 2);
  auto streamed_twice = round_trip(port, post("/v1/completions", json{{"prompt", ids}, {"echo", true}, {"logprobs", 0},
                                                                       {"n", 2}, {"stream", true}}.dump()));
  CHECK(streamed_twice.status == 400);
  CHECK(json::parse(streamed_twice.body)["error"]["param"] == "n");
  // A text prompt, echoed ahead of three generated tokens (the router's greedy ones).
  ref_req.prompt = "In the beginning";
  ref_req.max_tokens = 3;
  ref_req.prompt_logprobs = false;
  ref_req.top_logprobs = 0;
  ref_req.ignore_eos = true;
  const auto gen = s.direct(ref_req);
  auto echoed = round_trip(port, post("/v1/completions", R"({"prompt":"In the beginning","echo":true,"max_tokens":3,"ignore_eos":true})"));
  REQUIRE(echoed.status == 200);
  CHECK(json::parse(echoed.body)["choices"][0]["text"] == "In the beginning" + gen.text);
  CHECK(json::parse(echoed.body)["choices"][0]["logprobs"].is_null());
  // Streamed, the prompt comes in the first event, ahead of the tokens.
  auto streamed = round_trip(port, post("/v1/completions", R"({"prompt":"In the beginning","echo":true,"max_tokens":3,"ignore_eos":true,"stream":true})"));
  REQUIRE(streamed.status == 200);
  std::vector<json> events;
  CHECK(sse_text(streamed.body, &events) == "In the beginning" + gen.text);
  // A special token the prompt writes reads as itself among the tokens (they join back into the
  // echoed text, and text_offset counts it); it read as an empty string, and every offset after it
  // fell 7 characters short.
  auto special = round_trip(port, post("/v1/completions", R"({"prompt":"<|bos|>In the beginning","echo":true,"max_tokens":1,"logprobs":1,"temperature":0})"));
  REQUIRE_MESSAGE(special.status == 200, special.body);
  const auto choice = json::parse(special.body)["choices"][0];
  const auto text = choice["text"].get<std::string>();
  REQUIRE(text.rfind("<|bos|>In the beginning", 0) == 0);
  std::string joined;
  for (size_t i = 0; i < choice["logprobs"]["tokens"].size(); ++i) {
    CHECK(choice["logprobs"]["text_offset"][i].get<size_t>() == joined.size());  // ASCII: characters are bytes
    joined += choice["logprobs"]["tokens"][i].get<std::string>();
  }
  CHECK(joined == text);
  CHECK(choice["logprobs"]["tokens"][0] == "<|bos|>");
}

TEST_CASE("vLLM's prompt_logprobs over HTTP: each prompt token's log-probability, rank and "
          "the k most likely tokens, the router's; refused when streamed or past 20") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  generate_request ref_req;
  ref_req.prompt = "In the beginning";
  ref_req.max_tokens = 1;
  ref_req.prompt_logprobs = true;
  ref_req.prompt_top_logprobs = 2;
  const auto ref = s.direct(ref_req);
  REQUIRE(ref.prompt_logprobs.size() == ref.num_prompt_tokens);
  auto got = round_trip(port, post("/v1/completions", json{{"prompt", "In the beginning"}, {"prompt_logprobs", 2},
                                                           {"max_tokens", 1}, {"n", 2}, {"temperature", 1}}.dump()));
  REQUIRE_MESSAGE(got.status == 200, got.body);
  const auto answer = json::parse(got.body);
  REQUIRE(answer["choices"].size() == 2);
  CHECK(answer["choices"][0]["prompt_logprobs"] == answer["choices"][1]["prompt_logprobs"]);  // scored once
  CHECK(answer["choices"][0]["logprobs"].is_null());  // nothing asked of the generated token
  const auto pl = answer["choices"][0]["prompt_logprobs"];
  REQUIRE(pl.size() == ref.num_prompt_tokens);
  CHECK(pl[0].is_null());
  for (size_t i = 1; i < ref.num_prompt_tokens; ++i) {
    CAPTURE(i);
    const auto& want = ref.prompt_logprobs[i];
    const auto& mine = pl[i][std::to_string(want.token)];
    CHECK(mine["logprob"].get<double>() == doctest::Approx(want.logprob));
    CHECK(mine["rank"] == want.rank);
    CHECK(mine["decoded_token"] == want.text);
    CHECK(want.rank >= 1);
    // The two most likely too (ranks 1 and 2), unless the prompt token is one of them.
    REQUIRE(want.top_tokens.size() == 2);
    CHECK(pl[i].size() == (want.rank <= 2 ? 2u : 3u));
    CHECK(pl[i][std::to_string(want.top_tokens[0])]["rank"] == (want.top_tokens[0] == want.token ? want.rank : 1u));
    CHECK(pl[i][std::to_string(want.top_tokens[1])]["logprob"].get<double>() == doctest::Approx(want.top_logprobs[1]));
  }
  // (Chat's shape is checked in openai.test.cpp: this cluster's model has no chat template.)
  // Refused by name: streamed (as vLLM refuses it), more than 20, not a count.
  for (const auto& body : {json{{"prompt", "x"}, {"prompt_logprobs", 1}, {"stream", true}},
                           json{{"prompt", "x"}, {"prompt_logprobs", 21}}, json{{"prompt", "x"}, {"prompt_logprobs", "all"}}}) {
    auto refused = round_trip(port, post("/v1/completions", body.dump()));
    CHECK(refused.status == 400);
    CHECK(json::parse(refused.body)["error"]["param"] == "prompt_logprobs");
  }
}

TEST_CASE("n choices: each is the router's answer for seed + i, whole or streamed (events tagged by index), usage "
          "counts the prompt once; best_of answers the one of them with the highest log-probability per token") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  generate_request ref_req;
  ref_req.prompt = "The quick brown fox";
  ref_req.max_tokens = 6;
  ref_req.ignore_eos = true;
  ref_req.temperature = 0.9f;
  std::vector<completion> refs;
  for (uint64_t i = 0; i < 3; ++i) {
    ref_req.seed = 40 + i;
    refs.push_back(s.direct(ref_req));
  }
  CHECK((refs[0].tokens != refs[1].tokens || refs[1].tokens != refs[2].tokens));  // the seeds differ
  const std::string body = R"({"prompt":"The quick brown fox","max_tokens":6,"ignore_eos":true,"temperature":0.9,"seed":40,"n":3)";
  auto whole = round_trip(port, post("/v1/completions", body + "}"));
  REQUIRE(whole.status == 200);
  auto j = json::parse(whole.body);
  REQUIRE(j["choices"].size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(j["choices"][i]["index"] == i);
    CHECK(j["choices"][i]["text"] == json(refs[i].text).get<std::string>());
  }
  CHECK(j["usage"]["prompt_tokens"] == refs[0].num_prompt_tokens);
  CHECK(j["usage"]["completion_tokens"] == 18);
  auto streamed = round_trip(port, post("/v1/completions", body + R"(,"stream":true,"stream_options":{"include_usage":true}})"));
  REQUIRE(streamed.status == 200);
  std::vector<json> events;
  sse_text(streamed.body, &events);
  std::string texts[3];
  int finished = 0;
  for (const auto& ev : events)
    if (ev.is_object() && !ev["choices"].empty()) {
      const auto& c = ev["choices"][0];
      texts[c["index"].get<size_t>()] += c["text"].get<std::string>();
      finished += !c["finish_reason"].is_null();
    }
  for (size_t i = 0; i < 3; ++i) CHECK(texts[i] == json(refs[i].text).get<std::string>());
  CHECK(finished == 3);
  REQUIRE(events.size() >= 2);
  CHECK(events.back() == "[DONE]");
  CHECK(events[events.size() - 2]["usage"]["completion_tokens"] == 18);  // after every choice's last chunk

  // best_of 3: the same three generations, the one with the highest log-probability per token answered.
  ref_req.logprobs = true;
  double best = -1e30;
  std::string best_text;
  for (uint64_t i = 0; i < 3; ++i) {
    ref_req.seed = 40 + i;
    const auto scored = s.direct(ref_req);
    REQUIRE(scored.logprobs.size() == 6);
    double sum = 0;
    for (const auto& t : scored.logprobs) sum += t.logprob;
    if (sum / 6 > best) best = sum / 6, best_text = scored.text;
  }
  auto best_of = round_trip(port, post("/v1/completions", R"({"prompt":"The quick brown fox","max_tokens":6,"ignore_eos":true,)"
                                                          R"("temperature":0.9,"seed":40,"best_of":3})"));
  REQUIRE(best_of.status == 200);
  j = json::parse(best_of.body);
  REQUIRE(j["choices"].size() == 1);
  CHECK(j["choices"][0]["text"] == json(best_text).get<std::string>());
  CHECK(j["choices"][0]["logprobs"].is_null());     // not asked for
  CHECK(j["usage"]["completion_tokens"] == 18);     // every generation counts
}

TEST_CASE("a sampled call without a seed draws its own (a retry samples anew); with a seed the same body answers "
          "the same text") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  const std::string body = R"({"prompt":"The quick brown fox","max_tokens":8,"ignore_eos":true,"temperature":2)";
  auto text_of = [&](const std::string& b) {
    auto r = round_trip(port, post("/v1/completions", b));
    REQUIRE_MESSAGE(r.status == 200, r.body);
    return json::parse(r.body)["choices"][0]["text"].get<std::string>();
  };
  // Four equal texts from four seeds would need each of 8 tokens drawn at temperature 2 to come
  // out the same four times; before, every call drew with seed 0 and all four were equal.
  std::set<std::string> unseeded;
  for (int i = 0; i < 4; ++i) unseeded.insert(text_of(body + "}"));
  CHECK(unseeded.size() > 1);
  CHECK(text_of(body + R"(,"seed":7})") == text_of(body + R"(,"seed":7})"));
}

TEST_CASE("a call without temperature, top_p or top_k samples as the model's generation_config.json says (do_sample "
          "false: greedy), with OpenAI's temperature 1 where the directory has none; its max_new_tokens caps chat") {
  // The built-in model's directory under another generation_config.json (none: nullptr).
  struct generation_model {
    std::filesystem::path path;
    explicit generation_model(const char* name, const json* generation) {
      path = std::filesystem::temp_directory_path() / ("baton-gen-" + std::string(name) + "-" + std::to_string(::getpid()));
      std::filesystem::create_directories(path);
      const std::filesystem::path src = BATON_SOURCE_DIR "/models/baton-kjv-tiny";
      for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
        std::filesystem::create_symlink(src / f, path / f);
      if (generation) std::ofstream{path / "generation_config.json"} << generation->dump();
    }
    ~generation_model() { std::filesystem::remove_all(path); }
  };
  const std::string prompt = "The quick brown fox";
  const auto answer = [&](served_cluster& s, const std::string& fields) {
    auto r = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":")" + prompt +
                                                                   R"(","max_tokens":8,"ignore_eos":true,"seed":5)" + fields + "}"));
    REQUIRE_MESSAGE(r.status == 200, r.body);
    return json::parse(r.body)["choices"][0]["text"].get<std::string>();
  };
  const auto direct = [&](served_cluster& s, float temperature, float top_p, uint32_t top_k) {
    generate_request req;
    req.prompt = prompt;
    req.max_tokens = 8;
    req.ignore_eos = true;
    req.seed = 5;
    req.temperature = temperature;
    req.top_p = top_p;
    req.top_k = top_k;
    return s.direct(req).text;
  };
  {  // do_sample true: its temperature, top_p and top_k; a field the call gives wins
    const json g = {{"do_sample", true}, {"temperature", 1.5}, {"top_p", 0.9}, {"top_k", 40}};
    generation_model m{"sample", &g};
    served_cluster s{{}, 0, 0, m.path.string()};
    const auto sampled = direct(s, 1.5f, 0.9f, 40);
    CHECK(answer(s, "") == sampled);
    CHECK(answer(s, R"(,"temperature":0)") == direct(s, 0, 1, 0));
    CHECK(direct(s, 0, 1, 0) != sampled);  // else the first check could not fail
    CHECK(answer(s, R"(,"top_k":1)") == direct(s, 1.5f, 0.9f, 1));
  }
  {  // do_sample false (the built-in model's own): greedy whatever its temperature says
    const json g = {{"do_sample", false}, {"temperature", 1.5}};
    generation_model m{"greedy", &g};
    served_cluster s{{}, 0, 0, m.path.string()};
    CHECK(answer(s, "") == direct(s, 0, 1, 0));
  }
  {  // its repetition_penalty (Qwen2.5-Instruct ships 1.05), greedy too, as HF's generate and vLLM
    const json g = {{"do_sample", false}, {"repetition_penalty", 1.8}};
    generation_model m{"repeat", &g};
    served_cluster s{{}, 0, 0, m.path.string()};
    generate_request req;
    req.prompt = prompt;
    req.max_tokens = 8;
    req.ignore_eos = true;
    req.repetition_penalty = 1.8f;
    const auto penalised = s.direct(req).text;
    CHECK(answer(s, "") == penalised);
    CHECK(penalised != direct(s, 0, 1, 0));  // else the check above could not fail
    CHECK(answer(s, R"(,"repetition_penalty":1)") == direct(s, 0, 1, 0));
  }
  {  // its max_new_tokens: the cap of a chat call that names no max_tokens (vLLM's reading)
    const json g = {{"do_sample", false}, {"max_new_tokens", 3}};
    generation_model m{"cap", &g};
    std::ofstream{m.path / "chat_template.jinja"} << "{% for m in messages %}{{ m['content'] }}{% endfor %}";
    served_cluster s{{}, 0, 0, m.path.string()};
    for (const auto& [fields, tokens] : {std::pair{"", 3}, {R"(,"max_tokens":5)", 5}}) {  // the call's own wins
      auto r = round_trip(s.gateway.port, post("/v1/chat/completions", std::string{R"({"ignore_eos":true,"messages":[)"
                                                                                   R"({"role":"user","content":"Hi"}])"} + fields + "}"));
      REQUIRE_MESSAGE(r.status == 200, r.body);
      CHECK(json::parse(r.body)["usage"]["completion_tokens"] == tokens);
    }
  }
  {  // no generation_config.json: OpenAI's temperature 1
    generation_model m{"none", nullptr};
    served_cluster s{{}, 0, 0, m.path.string()};
    CHECK(answer(s, "") == direct(s, 1, 1, 0));
    CHECK(direct(s, 1, 1, 0) != direct(s, 0, 1, 0));
  }
}

TEST_CASE("a body sent in chunks (curl -T -, a client streaming its upload) is answered as the same body with a "
          "Content-Length, including after 100 Continue; one past the limit gets 413") {
  deploy::gateway_config gc;
  gc.limits.max_body_bytes = 4096;
  served_cluster s{gc};
  const std::string body = R"({"prompt":"In the beginning","max_tokens":4,"ignore_eos":true})";
  const auto whole = round_trip(s.gateway.port, post("/v1/completions", body));
  REQUIRE(whole.status == 200);
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-test\r\n"
                           "Transfer-Encoding: chunked\r\n";
  std::string chunks;
  for (size_t at = 0; at < body.size(); at += 7) {
    const auto part = body.substr(at, 7);
    char size[16];
    std::snprintf(size, sizeof size, "%zx", part.size());
    chunks += std::string(size) + "\r\n" + part + "\r\n";
  }
  chunks += "0\r\n\r\n";
  const auto got = round_trip(s.gateway.port, head + "\r\n" + chunks);
  REQUIRE(got.status == 200);
  CHECK(json::parse(got.body)["choices"][0]["text"] == json::parse(whole.body)["choices"][0]["text"]);
  // Expect: 100-continue: the gateway says "go on" after the head, then answers the chunks.
  const int fd = connect_to(s.gateway.port);
  send_all(fd, head + "Expect: 100-continue\r\n\r\n");
  CHECK(read_head(fd) == "HTTP/1.1 100 Continue\r\n\r\n");
  std::string buf;
  send_all(fd, chunks);
  const auto after = read_answer(fd, buf);
  ::close(fd);
  CHECK(after.status == 200);
  CHECK(round_trip(s.gateway.port, head + "\r\n1001\r\n").status == 413);  // 4097 bytes: refused before they come
}

TEST_CASE("a model whose chat template opens a thinking block (DeepSeek-R1's) answers chat with its reasoning in "
          "reasoning_content and the rest in content, whole and streamed; separate_reasoning false keeps it in content") {
  // The built-in model under R1's chat markers: a template that ends the prompt inside <think>.
  const templated_model dir{"r1",
                            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
                            "{% else %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
                            "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"};
  {
    served_cluster s{{}, 0, 0, dir.path.string()};
    const std::string messages = R"("messages":[{"role":"user","content":"In the beginning"}],"max_tokens":12)";
    const auto raw = round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + R"(,"separate_reasoning":false})"));
    REQUIRE(raw.status == 200);
    const std::string generated = json::parse(raw.body)["choices"][0]["message"]["content"];
    REQUIRE_FALSE(generated.empty());
    const auto want = deploy::openai::split_reasoning(generated);

    const auto whole = round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + "}"));
    REQUIRE(whole.status == 200);
    const auto message = json::parse(whole.body)["choices"][0]["message"];
    CHECK(message["reasoning_content"] == want.reasoning);
    CHECK(message["content"] == (want.content.empty() ? json(nullptr) : json(want.content)));  // null: all reasoning

    const auto streamed = round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + R"(,"stream":true})"));
    REQUIRE(streamed.status == 200);
    const auto [reasoning, content] = streamed_chat(streamed.body);
    CHECK(reasoning == want.reasoning);
    CHECK(content == want.content);
  }
}

TEST_CASE("a chat whose own template variables open the thinking block (DeepSeek-V3.1's `thinking`) has its answer "
          "read as reasoning, whole and streamed; the same model's chat without them answers in content") {
  // In the manner of DeepSeek-V3.1's template: <think> after the assistant marker when the
  // request's chat_template_kwargs say thinking, else </think> (the model's default).
  const templated_model dir{"v31",
                            "{{ bos_token }}{% for m in messages %}{{ '<｜User｜>' + m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% if thinking is defined and thinking %}"
                            "{{ '<think>' }}{% else %}{{ '</think>' }}{% endif %}{% endif %}"};
  served_cluster s{{}, 0, 0, dir.path.string()};
  const std::string messages = R"("messages":[{"role":"user","content":"In the beginning"}],"max_tokens":12)";
  const std::string thinking = R"(,"chat_template_kwargs":{"thinking":true})";
  // What the model writes after each prompt, untouched.
  const auto raw_text = [&](const std::string& extra) {
    const auto raw = round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + extra + R"(,"separate_reasoning":false})"));
    REQUIRE(raw.status == 200);
    return json::parse(raw.body)["choices"][0]["message"]["content"].get<std::string>();
  };
  const auto thought = raw_text(thinking), plain = raw_text("");
  REQUIRE_FALSE(thought.empty());
  REQUIRE(plain.rfind("<think>", 0) != 0);  // the model does not open <think> itself here
  const auto want = deploy::openai::split_reasoning(thought, true);  // all reasoning, up to a </think>
  REQUIRE_FALSE(want.reasoning.empty());

  const auto whole = json::parse(round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + thinking + "}")).body);
  CHECK(whole["choices"][0]["message"]["reasoning_content"] == want.reasoning);
  CHECK(whole["choices"][0]["message"]["content"] == (want.content.empty() ? json(nullptr) : json(want.content)));
  const auto streamed = round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + thinking + R"(,"stream":true})"));
  REQUIRE(streamed.status == 200);
  const auto [reasoning, content] = streamed_chat(streamed.body);
  CHECK(reasoning == want.reasoning);
  CHECK(content == want.content);
  // The first event carries the role alone, as OpenAI's: the text comes after it.
  std::vector<json> events;
  sse_text(streamed.body, &events, true);
  REQUIRE(events.size() >= 3);
  CHECK(events[0]["choices"][0]["delta"] == json{{"role", "assistant"}, {"content", ""}});
  CHECK_FALSE(events[1]["choices"][0]["delta"].contains("role"));
  // Without the variable the prompt closes the block: the answer is content.
  const auto no_think = json::parse(round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + "}")).body);
  CHECK(no_think["choices"][0]["message"]["content"] == plain);
  CHECK(no_think["choices"][0]["message"]["reasoning_content"].is_null());
}

TEST_CASE("tools over HTTP: a model whose template asks for <tool_call>s is shown the tools (its prompt grows by "
          "them) and answers; a model whose template has no tool format refuses tools with a sentence, unless the call is "
          "forced") {
  std::ifstream in{BATON_SOURCE_DIR "/tests/data/chat_templates/chatml_tools.jinja"};
  std::stringstream tmpl;
  tmpl << in.rdbuf();
  const templated_model hermes{"hermes", tmpl.str()};
  const std::string messages = R"("messages":[{"role":"user","content":"Weather in Paris?"}],"max_tokens":4)";
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}])";
  {
    served_cluster s{{}, 0, 0, hermes.path.string()};
    const auto plain = round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + "}"));
    const auto with = round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + "," + tools + "}"));
    REQUIRE(plain.status == 200);
    REQUIRE(with.status == 200);
    const auto p = json::parse(plain.body), w = json::parse(with.body);
    CHECK(w["usage"]["prompt_tokens"].get<int>() > p["usage"]["prompt_tokens"].get<int>() + 20);
    // The built-in model writes no <tool_call>: its answer is content, as without tools.
    CHECK(w["choices"][0]["message"]["content"].is_string());
    CHECK_FALSE(w["choices"][0]["message"].contains("tool_calls"));
  }
  const templated_model plain{"plain", "{% for m in messages %}{{ m['content'] }}{% endfor %}"};
  served_cluster s{{}, 0, 0, plain.path.string()};
  const auto refused = round_trip(s.gateway.port, post("/v1/chat/completions", "{" + messages + "," + tools + "}"));
  CHECK(refused.status == 400);
  CHECK(refused.body.find("tools need a model whose chat template asks for tool calls") != std::string::npos);
  // A forced call is constrained JSON the gateway reads back, in no template's form: served (a
  // named function's call is named at once, even if this random model's answer is cut).
  const auto forced = round_trip(s.gateway.port, post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"Hi"}],
      "max_tokens":120,"tool_choice":{"type":"function","function":{"name":"f"}},"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object",
      "properties":{"city":{"enum":["Paris","Oslo"]}},"required":["city"],"additionalProperties":false}}}]})"));
  REQUIRE_MESSAGE(forced.status == 200, forced.body);
  CHECK_MESSAGE(json::parse(forced.body)["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f", forced.body);
  // A chat longer than the context: the router's refusal names the chat's field.
  const auto long_chat = round_trip(
      s.gateway.port, post("/v1/chat/completions", R"({"messages":[{"role":"user","content":")" + std::string(20000, 'a') + R"("}]})"));
  CHECK(long_chat.status == 400);
  CHECK_MESSAGE(json::parse(long_chat.body)["error"]["param"] == "messages", long_chat.body);
}

TEST_CASE("structured outputs over HTTP: a json_schema answer is JSON that holds to the schema, whole and streamed "
          "alike; a forced tool_choice comes back as tool_calls whose arguments hold to the function's parameters") {
  std::ifstream in{BATON_SOURCE_DIR "/tests/data/chat_templates/chatml_tools.jinja"};
  std::stringstream tmpl;
  tmpl << in.rdbuf();
  const templated_model hermes{"hermes-json", tmpl.str()};
  // Room for the tools' preamble: the tiny model's 256 positions would leave a call 8 tokens
  // (its RoPE runs on past them; the answers need not be good, only well-formed).
  json config = json::parse(std::ifstream{BATON_SOURCE_DIR "/models/baton-kjv-tiny/config.json"});
  config["max_position_embeddings"] = 1024;
  std::filesystem::remove(hermes.path / "config.json");
  std::ofstream{hermes.path / "config.json"} << config.dump();
  served_cluster s{{}, 0, 0, hermes.path.string()};
  // The trained built-in model (byte-level BPE) writes Bible verses, never JSON, unless made to.
  const std::string format = R"("response_format":{"type":"json_schema","json_schema":{"name":"v","schema":
      {"type":"object","properties":{"book":{"enum":["Genesis","Exodus"]},"verse":{"type":"boolean"}},
       "required":["book","verse"]}}})";
  const std::string body = R"({"prompt":"In the beginning","max_tokens":200,)" + format;
  const auto whole = round_trip(s.gateway.port, post("/v1/completions", body + "}"));
  REQUIRE_MESSAGE(whole.status == 200, whole.body);
  const auto answer = json::parse(whole.body)["choices"][0];
  CHECK(answer["finish_reason"] == "stop");
  const auto j = json::parse(answer["text"].get<std::string>());
  CHECK((j["book"] == "Genesis" || j["book"] == "Exodus"));
  CHECK(j["verse"].is_boolean());
  const auto streamed = round_trip(s.gateway.port, post("/v1/completions", body + R"(,"stream":true})"));
  REQUIRE(streamed.status == 200);
  std::vector<json> chunks;
  CHECK(sse_text(streamed.body, &chunks) == answer["text"].get<std::string>());
  // Compact JSON (vLLM's disable_any_whitespace): the same schema, and no blank anywhere (its
  // strings have none).
  const auto compact = round_trip(s.gateway.port, post("/v1/completions", body + R"(,"structured_outputs":
      {"disable_any_whitespace":true}})"));
  REQUIRE_MESSAGE(compact.status == 200, compact.body);
  const auto tight = json::parse(compact.body)["choices"][0]["text"].get<std::string>();
  CHECK(json::parse(tight)["verse"].is_boolean());
  CHECK(tight.find_first_of(" \n\t") == std::string::npos);
  // A schema the grammar cannot hold to is refused, naming the keyword.
  const auto refused = round_trip(
      s.gateway.port, post("/v1/completions", R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":
          {"name":"v","schema":{"type":"string","format":"uri"}}}})"));
  CHECK(refused.status == 400);
  CHECK(refused.body.find(R"(the format \"uri\" is not supported)") != std::string::npos);  // as JSON escapes it
  // vLLM's guided_choice, guided_regex and guided_grammar: the answer is one of the strings, or
  // text the expression (or grammar) matches whole, then the model's end (finish_reason stop).
  for (const std::string guided : {R"("guided_choice":["Exodus","Leviticus 19"])", R"("guided_regex":"[A-Z][a-z]+ [0-9]{1,3}")",
                                   R"("guided_grammar":"root ::= [A-Z] [a-z]+ \" \" num\nnum ::= [0-9]{1,3}")"}) {
    CAPTURE(guided);
    const auto one = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"In the beginning","max_tokens":40,)" +
                                                                            guided + "}"));
    REQUIRE_MESSAGE(one.status == 200, one.body);
    const auto got = json::parse(one.body)["choices"][0];
    CHECK(got["finish_reason"] == "stop");
    const auto text = got["text"].get<std::string>();
    if (guided.find("choice") != std::string::npos) CHECK((text == "Exodus" || text == "Leviticus 19"));
    else CHECK(std::regex_match(text, std::regex("[A-Z][a-z]+ [0-9]{1,3}")));
  }
  const auto bad_regex = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"x","guided_regex":"(a"})"));
  CHECK(bad_regex.status == 400);
  CHECK(bad_regex.body.find("regex: an unclosed group") != std::string::npos);

  const std::string chat = R"({"messages":[{"role":"user","content":"Weather in Paris?"}],"max_tokens":200,
      "tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
        "properties":{"city":{"enum":["Paris","Oslo"]},"celsius":{"type":"boolean"}},"required":["city"]}}}],
      "tool_choice":{"type":"function","function":{"name":"get_weather"}})";
  const auto called = round_trip(s.gateway.port, post("/v1/chat/completions", chat + "}"));
  REQUIRE_MESSAGE(called.status == 200, called.body);
  const auto choice = json::parse(called.body)["choices"][0];
  CHECK(choice["finish_reason"] == "tool_calls");
  REQUIRE(choice["message"]["tool_calls"].size() == 1);
  const auto& call = choice["message"]["tool_calls"][0]["function"];
  CHECK(call["name"] == "get_weather");
  const auto args = json::parse(call["arguments"].get<std::string>());
  CHECK((args["city"] == "Paris" || args["city"] == "Oslo"));
  const auto called_streamed = round_trip(s.gateway.port, post("/v1/chat/completions", chat + R"(,"stream":true})"));
  REQUIRE(called_streamed.status == 200);
  std::vector<json> events;
  sse_text(called_streamed.body, &events, true);
  // The call streams: its name first, then its arguments a token or so at a time, which join to
  // the whole answer's; the last event's finish_reason says tool_calls.
  std::string streamed_name, streamed_args, last_finish;
  int pieces = 0;
  for (const auto& ev : events) {
    if (!ev.is_object() || ev["choices"].empty()) continue;
    const auto& ch = ev["choices"][0];
    if (!ch["finish_reason"].is_null()) last_finish = ch["finish_reason"];
    if (!ch["delta"].contains("tool_calls")) continue;
    for (const auto& piece : ch["delta"]["tool_calls"]) {
      CHECK(piece["index"] == 0);
      if (piece.contains("id")) streamed_name += piece["function"]["name"].get<std::string>();
      streamed_args += piece["function"]["arguments"].get<std::string>();
      ++pieces;
    }
  }
  CHECK(streamed_name == "get_weather");
  CHECK(streamed_args == call["arguments"]);
  CHECK(pieces > 2);
  CHECK(last_finish == "tool_calls");
}

TEST_CASE("a request's own x-request-id comes back in its answer and in the request log beside the call's id; one "
          "that is not 1 to 128 visible characters is refused 400 naming it; refusals before a call are logged too") {
  deploy::gateway_config gc;
  gc.api_keys = {"sk-test"};
  gc.log_requests = true;
  // The log goes to standard output through CAF's printer actor: caught here until its lines came.
  std::ostringstream log;
  auto* const saved = std::cout.rdbuf(log.rdbuf());
  {
    served_cluster s{gc};
    const uint16_t port = s.gateway.port;
    const auto with_id = [](std::string raw, const std::string& id) {
      return raw.insert(raw.find("\r\n") + 2, "X-Request-Id: " + id + "\r\n");
    };
    auto own = round_trip(port, with_id(post("/v1/completions", R"({"prompt":"In","max_tokens":2})"), "trace-7f3a"));
    CHECK(own.status == 200);
    CHECK(own.head.find("x-request-id: trace-7f3a\r\n") != std::string::npos);
    const auto call_id = json::parse(own.body)["id"].get<std::string>();
    // Without one, the answer's id (as before).
    auto plain = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})"));
    CHECK(plain.head.find("x-request-id: " + json::parse(plain.body)["id"].get<std::string>() + "\r\n") != std::string::npos);
    auto spaced = round_trip(port, with_id(post("/v1/completions", R"({"prompt":"In","max_tokens":2})"), "a b"));
    CHECK(spaced.status == 400);
    CHECK(json::parse(spaced.body)["error"]["message"].get<std::string>().find("x-request-id must be 1 to 128 visible") !=
          std::string::npos);
    auto long_id = round_trip(port, with_id(get("/v1/models"), std::string(129, 'x')));
    CHECK(long_id.status == 400);
    CHECK(json::parse(long_id.body)["error"]["message"].get<std::string>().find("this one has 129 bytes") != std::string::npos);
    CHECK(round_trip(port, with_id(get("/v1/models", "sk-wrong"), "probe-1")).status == 401);
    auto twice = round_trip(port, with_id(with_id(get("/v1/models"), "a"), "b"));
    CHECK(twice.status == 400);
    CHECK(json::parse(twice.body)["error"]["message"] == "more than one x-request-id header");
    CHECK(round_trip(port, get("/v1/nothing")).status == 404);
    // Every line is in: the printer writes them in order, the 404's last.
    for (int i = 0; i < 200 && log.str().find("GET /v1/nothing 404") == std::string::npos; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    const auto lines = log.str();
    std::cout.rdbuf(saved);
    // (a plain key is named by its place: key-1)
    CHECK_MESSAGE(lines.find(" call " + call_id + " (x-request-id trace-7f3a) key key-1 /v1/completions 200 ") != std::string::npos, lines);
    CHECK_MESSAGE(lines.find(" call - POST /v1/completions 400 ") != std::string::npos, lines);
    CHECK_MESSAGE(lines.find(" call - (x-request-id probe-1) GET /v1/models 401 ") != std::string::npos, lines);
    CHECK_MESSAGE(lines.find(" call - GET /v1/nothing 404 0.0 ms: no route GET /v1/nothing") != std::string::npos, lines);
  }
  std::cout.rdbuf(saved);
}

TEST_CASE("an expression too ambiguous to follow is refused 400 before any work; one whose ambiguity only shows "
          "mid-answer is stopped there with a 400 naming it, not placed again on another rank") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  auto at_once = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":3,"guided_regex":"(.{0,64}){64}"})"));
  CHECK(at_once.status == 400);
  CHECK(json::parse(at_once.body)["error"]["message"].get<std::string>().find("guided_regex: too ambiguous to follow") !=
        std::string::npos);
  // 70 forced characters first: deeper than the gateway's probe reads.
  auto later = round_trip(port, post("/v1/completions", json{{"prompt", "In"}, {"max_tokens", 120},
                                                            {"guided_regex", std::string(70, 'a') + "(.{0,64}){64}"}}.dump()));
  CHECK(later.status == 400);
  const auto why = json::parse(later.body)["error"]["message"].get<std::string>();
  CHECK_MESSAGE(why.find("stage decode: the answer's grammar is too ") != std::string::npos, why);
  CHECK_MESSAGE(why.find("attempt") == std::string::npos, why);  // the only attempt: not retried
  // Nothing is left behind on the decode ranks.
  for (int i = 0; i < 100; ++i) {
    bool idle = true;
    for (const auto& r : s.stats().decode) idle = idle && r.num_running == 0 && r.num_free_pages == r.num_total_pages;
    if (idle) break;
    std::this_thread::sleep_for(std::chrono::milliseconds{50});
  }
  for (const auto& r : s.stats().decode) CHECK(r.num_free_pages == r.num_total_pages);
}

TEST_CASE("a refused value is quoted in its error bounded and escaped: a megabyte of traffic_class does not come back "
          "whole, nor a control character raw") {
  served_cluster s;
  auto big = round_trip(s.gateway.port, post("/v1/completions", json{{"prompt", "In"}, {"max_tokens", 2},
                                                                    {"traffic_class", std::string(1'000'000, 'A')}}.dump()));
  CHECK(big.status == 400);
  CHECK(big.body.size() < 1000);
  const auto msg = json::parse(big.body)["error"]["message"].get<std::string>();
  CHECK_MESSAGE(msg.find("traffic_class must be chat, agent or batch, got '" + std::string(64, 'A') + "...'") !=
                    std::string::npos, msg);
  auto ctl = round_trip(s.gateway.port, post("/v1/completions", json{{"prompt", "In"}, {"max_tokens", 2},
                                                                    {"priority", "x\n\u00e9"}}.dump()));
  CHECK(ctl.status == 400);
  CHECK(json::parse(ctl.body)["error"]["message"].get<std::string>().find("got 'x\\x0a\\xc3\\xa9'") != std::string::npos);
}

TEST_CASE("/metrics counts a call the gateway refused for its body as bad_request, as it counts the router's "
          "refusals: the failures by reason add up to the 400s clients saw") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  CHECK(round_trip(port, post("/v1/completions", R"({"prompt":"In","temperature":5})")).status == 400);  // the gateway's
  CHECK(round_trip(port, post("/v1/completions", R"({"max_tokens":2})")).status == 400);                 // the gateway's
  CHECK(round_trip(port, post("/v1/completions", R"({"prompt":"In the beginning","max_tokens":255})")).status ==
        400);  // the router's: past the context
  CHECK(round_trip(port, "GET /v1/models HTTP/1.1\r\n\r\n").status == 400);  // no Host: refused before any call
  // Probes, scrapes and paths that are no route are not API calls: not counted.
  CHECK(round_trip(port, "GET /health HTTP/1.1\r\n\r\n").status == 400);
  CHECK(round_trip(port, get("/no/such/route")).status == 404);
  const auto text = round_trip(port, get("/metrics")).body;
  CHECK(test::value_of(text, "baton_request_failures_total{reason=\"bad_request\"}") == 4);
  CHECK(text.find("baton_request_failures_total{reason=\"http_404\"}") == std::string::npos);
}

TEST_CASE("the router's refusals of stop and stop_token_ids name the field in param: a list too long, an empty "
          "string, a token outside the vocabulary") {
  served_cluster s;
  json many_stops = json::array(), many_ids = json::array();
  for (int i = 0; i < 17; ++i) many_stops.push_back("s" + std::to_string(i));
  for (int i = 0; i < 1025; ++i) many_ids.push_back(1);
  auto stops = round_trip(s.gateway.port, post("/v1/completions", json{{"prompt", "In"}, {"stop", many_stops}}.dump()));
  CHECK(stops.status == 400);
  CHECK(json::parse(stops.body)["error"]["param"] == "stop");
  CHECK(json::parse(stops.body)["error"]["message"].get<std::string>().find("stop holds 17 strings; at most 16") !=
        std::string::npos);
  auto ids = round_trip(s.gateway.port, post("/v1/completions", json{{"prompt", "In"}, {"stop_token_ids", many_ids}}.dump()));
  CHECK(ids.status == 400);
  CHECK(json::parse(ids.body)["error"]["param"] == "stop_token_ids");
  // An empty stop string (it would end every answer before it began) and a token no vocabulary
  // has (the router's check, which C++ clients meet too).
  auto empty = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"In","stop":["x",""]})"));
  CHECK(empty.status == 400);
  CHECK(json::parse(empty.body)["error"]["param"] == "stop");
  CHECK(json::parse(empty.body)["error"]["message"].get<std::string>().find("stop strings must not be empty") != std::string::npos);  // the gateway's own check
  auto outside = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"In","stop_token_ids":[2,99999]})"));
  CHECK(outside.status == 400);
  CHECK(json::parse(outside.body)["error"]["param"] == "stop_token_ids");
  CHECK_MESSAGE(json::parse(outside.body)["error"]["message"].get<std::string>().find(
                    "stop_token_ids[1] is 99999, outside the vocabulary [0, ") != std::string::npos,
                outside.body);
}

TEST_CASE("tool calls are read only as the request asks: a call of a function it did not declare is content, whole "
          "and streamed; tool_choice none still shows the tools but reads no call; a model without a tool format "
          "takes tool_choice none") {
  std::ifstream in{BATON_SOURCE_DIR "/tests/data/chat_templates/chatml_tools.jinja"};
  std::stringstream tmpl;
  tmpl << in.rdbuf();
  const templated_model hermes{"hermes-calls", tmpl.str()};
  json config = json::parse(std::ifstream{BATON_SOURCE_DIR "/models/baton-kjv-tiny/config.json"});
  config["max_position_embeddings"] = 1024;  // room for the tools' preamble, as above
  std::filesystem::remove(hermes.path / "config.json");
  std::ofstream{hermes.path / "config.json"} << config.dump();
  served_cluster s{{}, 0, 0, hermes.path.string()};
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{}}}}])";
  // The model is made to write a <tool_call> of `name` (vLLM's guided_regex), whatever it would.
  const auto ask = [&](const std::string& name, const std::string& choice, bool stream) {
    return round_trip(s.gateway.port,
                      post("/v1/chat/completions",
                           R"({"messages":[{"role":"user","content":"Weather in Paris?"}],"max_tokens":100,)" + tools +
                               R"(,"tool_choice":)" + choice + R"(,"guided_regex":"<tool_call>\\{\"name\": \")" + name +
                               R"(\", \"arguments\": \\{\\}\\}</tool_call>")" + (stream ? R"(,"stream":true})" : "}")));
  };
  const auto declared = ask("get_weather", R"("auto")", false);
  REQUIRE_MESSAGE(declared.status == 200, declared.body);
  const auto call = json::parse(declared.body);
  CHECK(call["choices"][0]["finish_reason"] == "tool_calls");
  REQUIRE(call["choices"][0]["message"]["tool_calls"].size() == 1);
  CHECK(call["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather");
  // OpenAI answers calls only of the tools it was given: another function's "call" is text.
  const std::string other_text = R"(<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>)";
  const auto other = json::parse(ask("rm_rf", R"("auto")", false).body)["choices"][0];
  CHECK(other["finish_reason"] == "stop");
  CHECK(other["message"]["content"] == other_text);
  CHECK_FALSE(other["message"].contains("tool_calls"));
  std::vector<json> events;
  CHECK(sse_text(ask("rm_rf", R"("auto")", true).body, &events, true) == other_text);
  std::string last_finish;
  for (const auto& ev : events) {
    if (!ev.is_object() || ev["choices"].empty()) continue;
    CHECK_FALSE(ev["choices"][0]["delta"].contains("tool_calls"));
    if (!ev["choices"][0]["finish_reason"].is_null()) last_finish = ev["choices"][0]["finish_reason"];
  }
  CHECK(last_finish == "stop");
  // tool_choice none: the same prompt (the tools shown, so the turns before stay cached), and
  // what looks like a call is content.
  const auto none = json::parse(ask("get_weather", R"("none")", false).body);
  CHECK(none["usage"]["prompt_tokens"] == call["usage"]["prompt_tokens"]);
  CHECK(none["choices"][0]["finish_reason"] == "stop");
  CHECK(none["choices"][0]["message"]["content"] == R"(<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>)");
  CHECK_FALSE(none["choices"][0]["message"].contains("tool_calls"));
  // A template that shows no tools: tool_choice none asks nothing of it, so it answers.
  const templated_model plain{"plain-none", "{% for m in messages %}{{ m['content'] }}{% endfor %}"};
  served_cluster p{{}, 0, 0, plain.path.string()};
  const auto plain_none = round_trip(p.gateway.port, post("/v1/chat/completions",
                                                          R"({"messages":[{"role":"user","content":"x"}],"max_tokens":2,)" +
                                                              tools + R"(,"tool_choice":"none"})"));
  CHECK_MESSAGE(plain_none.status == 200, plain_none.body);
}

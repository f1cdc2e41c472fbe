// API keys as callers of a shared cluster (deploy/api_keys.hpp): named in the request log and
// /metrics, each held to its own generations in flight, its calls pinned to batch if asked.

#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <sys/socket.h>
#include <unistd.h>

#include "deploy/access_log.hpp"
#include "deploy/api_keys.hpp"
#include "tests/deploy/gateway_fixture.hpp"
#include "tests/deploy/metrics_text.hpp"

using namespace baton;
using namespace baton::test_gateway;
using nlohmann::json;

TEST_CASE("a keys file names each key and its limits; anything else in it is refused naming the entry and field") {
  std::vector<deploy::api_key> keys;
  std::string why;
  REQUIRE(deploy::parse_api_keys(R"({"keys": [
      {"name": "search", "key": "sk-search-0001", "max_in_flight": 64, "max_tokens": 512},
      {"name": "evals.nightly", "key": "sk-evals-0001", "priority": "batch", "requests_per_minute": 60,
       "tokens_per_minute": 100000}]})",
                                 &keys, &why));
  REQUIRE(keys.size() == 2);
  CHECK(keys[0].name == "search");
  CHECK(keys[0].max_in_flight == 64);
  CHECK(keys[0].max_tokens == 512);
  CHECK(keys[1].max_tokens == 0);
  CHECK_FALSE(keys[0].batch);
  CHECK(keys[1].batch);
  CHECK(keys[1].max_in_flight == 0);
  CHECK(keys[1].requests_per_minute == 60);
  CHECK(keys[1].tokens_per_minute == 100000);
  CHECK(keys[0].requests_per_minute == 0);
  const auto refused = [&](const std::string& text) {
    std::vector<deploy::api_key> out;
    std::string w;
    CHECK_MESSAGE(!deploy::parse_api_keys(text, &out, &w), text);
    return w;
  };
  CHECK(refused("nope") == "the keys file is not JSON");
  std::vector<deploy::api_key> none;
  CHECK_FALSE(deploy::read_api_keys_file("/nonexistent/keys.json", &none, &why));
  CHECK(why == "cannot read the API keys file /nonexistent/keys.json");
  CHECK(refused(R"([{"name":"a","key":"sk-aaaaaaaa"}])").find("must be {\"keys\"") != std::string::npos);
  CHECK(refused(R"({"keys":[]})").find("lists no key") != std::string::npos);
  CHECK(refused(R"({"keys":[{"name":"a","key":"short"}]})").find("keys[0].key must be a string of at least 8 visible") == 0);
  CHECK(refused(R"({"keys":[{"name":"a","key":"sk-with space"}]})").find("keys[0].key must be") == 0);
  CHECK(refused(R"({"keys":[{"name":"a","key":"sk-aaaaaaaa"}],"limits":{}})") ==
        "the keys file has the unknown field 'limits' beside \"keys\"");
  CHECK(refused(R"({"keys":[{"name":"a b","key":"sk-aaaaaaaa"}]})").find("keys[0].name must be 1 to 64") != std::string::npos);
  CHECK(refused(R"({"keys":[{"name":"a","key":"sk-aaaaaaaa","max_in_flight":-1}]})").find("keys[0].max_in_flight") !=
        std::string::npos);
  CHECK(refused(R"({"keys":[{"name":"a","key":"sk-aaaaaaaa","priority":"urgent"}]})").find("keys[0].priority") !=
        std::string::npos);
  CHECK(refused(R"({"keys":[{"name":"a","key":"sk-aaaaaaaa"},{"name":"b","key":"sk-bbbbbbbb","rpm":5}]})") ==
        "keys[1] has the unknown field 'rpm' (name, key, max_in_flight, max_tokens, requests_per_minute, "
        "tokens_per_minute and priority are known)");
  CHECK(refused(R"({"keys":[{"name":"a","key":"sk-aaaaaaaa","tokens_per_minute":1.5}]})")
            .find("keys[0].tokens_per_minute must be an integer") == 0);
  CHECK(refused(R"({"keys":[{"name":"a","key":"sk-aaaaaaaa","requests_per_minute":"ten"}]})")
            .find("keys[0].requests_per_minute must be an integer") == 0);
  CHECK(refused(R"({"keys":[{"name":"a","key":"sk-aaaaaaaa","max_tokens":0}]})").find("keys[0].max_tokens must be") == 0);
  CHECK(refused(R"({"keys":[{"key":"sk-aaaaaaaa"}]})") == "keys[0] needs a name and a key");
  // Plain keys follow, named key-1, key-2, ...; a name or a key given twice is refused.
  std::vector<deploy::api_key> all;
  REQUIRE(deploy::merge_api_keys(keys, {"sk-plain-0001", "sk-plain-0002"}, &all, &why));
  REQUIRE(all.size() == 4);
  CHECK(all[2].name == "key-1");
  CHECK(all[3].name == "key-2");
  CHECK_FALSE(deploy::merge_api_keys(keys, {"sk-search-0001"}, &all, &why));
  CHECK(why == "the API key named 'key-1' is the same key as 'search' (one key, one name: its calls are counted and "
               "limited under it)");
  // The same plain key twice (--api-key and BATON_API_KEYS) is one caller.
  REQUIRE(deploy::merge_api_keys({}, {"sk-plain-0001", "sk-plain-0002", "sk-plain-0001"}, &all, &why));
  CHECK(all.size() == 2);
  CHECK_FALSE(deploy::merge_api_keys({}, {"sk-a\tb"}, &all, &why));
  CHECK(why.find("API key 1 (--api-key, BATON_API_KEYS) has a space or a control character") == 0);
  CHECK(deploy::describe_api_keys(keys) ==
        "search (at most 64 in flight; max_tokens at most 512), evals.nightly (batch; no in-flight limit; 60 calls a "
        "minute; 100000 tokens a minute)");
  CHECK_FALSE(deploy::merge_api_keys({{"key-1", "sk-aaaaaaaa", 0, false}}, {"sk-bbbbbbbb"}, &all, &why));
  CHECK(why.find("'key-1' is given twice (plain keys are named key-1") != std::string::npos);
}

TEST_CASE("a key's generations in flight are held until their hold ends, and a take past its limit takes none") {
  auto key = std::make_shared<deploy::api_key_state>(deploy::api_key{"team", "sk-team-0001", 4, false});
  uint32_t had = 0;
  {
    deploy::in_flight_hold a, b, c;
    CHECK(a.take(key, 3, &had));
    CHECK(key->in_flight == 3);
    CHECK_FALSE(b.take(key, 2, &had));  // 3 + 2 > 4
    CHECK(had == 3);
    CHECK(key->in_flight == 3);
    CHECK(key->limited == 1);
    CHECK(c.take(key, 1, &had));
    CHECK(key->in_flight == 4);
  }
  CHECK(key->in_flight == 0);  // the holds ended
  auto open = std::make_shared<deploy::api_key_state>(deploy::api_key{"open", "sk-open-0001", 0, false});
  deploy::in_flight_hold big;
  CHECK(big.take(open, 100000, &had));  // no limit of its own
  CHECK(deploy::find_api_key({key, open}, "sk-open-0001") == open);
  CHECK(deploy::find_api_key({key, open}, "sk-open-000") == nullptr);
}

TEST_CASE("the request log names a call's API key, and sums up a batch call's generations past the first 16") {
  std::vector<completion> many(20);
  for (size_t i = 0; i < many.size(); ++i) {
    many[i].request_id = i + 1;
    many[i].num_prompt_tokens = 10;
    many[i].tokens = {1, 2};
    many[i].finish_reason = i % 2 ? "stop" : "length";
    many[i].ttft_us = static_cast<int64_t>(1000 * (i + 1));
  }
  const auto line = deploy::access_line({std::chrono::system_clock::now(), "cmpl-1-1", "/v1/completions", 200, false, 9.0,
                                         &many, {}, {}, false, "evals"});
  CHECK(line.find(" call cmpl-1-1 key evals /v1/completions 200 ") != std::string::npos);
  CHECK(line.find("request 16 ") != std::string::npos);
  CHECK(line.find("request 17 ") == std::string::npos);
  CHECK_MESSAGE(line.find("; and 4 more generations: prompts 40 (cached 0, each generation's counted), 8 tokens (2 length, 2 stop), "
                           "TTFT at most 20.0 ms") !=
                    std::string::npos,
                line);
}

TEST_CASE("named API keys over HTTP: a key past its max_in_flight gets 429 naming its own limit while another key's "
          "calls go on; a call asking more than the limit gets 400; the log and /metrics name each key") {
  deploy::gateway_config gc;
  gc.named_keys = {{"team-a", "sk-team-a-0001", 1, false}, {"evals", "sk-evals-0001", 0, true, 3}};
  gc.api_keys = {"sk-plain-0001"};
  gc.log_requests = true;
  std::ostringstream log;
  auto* const saved = std::cout.rdbuf(log.rdbuf());
  {
    // Decode steps of 100 ms: team-a's streaming call is still generating when its next call comes.
    served_cluster s{gc, 0, 100};
    const uint16_t port = s.gateway.port;
    const int fd = connect_to(port);
    send_all(fd, post("/v1/completions", R"({"prompt":"In","max_tokens":40,"ignore_eos":true,"stream":true})", "sk-team-a-0001"));
    std::string got = read_head(fd);
    REQUIRE(got.find("200 OK") != std::string::npos);
    char tmp[4096];
    for (int i = 0; i < 1000 && got.find("data: {") == std::string::npos; ++i) {  // its first token: it runs
      const auto n = ::recv(fd, tmp, sizeof tmp, 0);
      REQUIRE(n > 0);
      got.append(tmp, static_cast<size_t>(n));
    }
    const auto second = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})", "sk-team-a-0001"));
    CHECK(second.status == 429);
    CHECK(second.head.find("Retry-After: 1") != std::string::npos);
    const auto err = json::parse(second.body)["error"];
    CHECK(err["code"] == "rate_limit_exceeded");
    CHECK(err["type"] == "requests");  // OpenAI's type for a limit on requests, not invalid_request_error
    CHECK_MESSAGE(err["message"].get<std::string>().find("the API key 'team-a' has 1 generations in flight at this "
                                                         "gateway, its limit is 1") != std::string::npos,
                  second.body);
    // Other keys' calls go on meanwhile.
    const auto plain = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})", "sk-plain-0001"));
    CHECK(plain.status == 200);
    const auto evals = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2,"n":3})", "sk-evals-0001"));
    REQUIRE(evals.status == 200);
    CHECK(evals.status == 200);
    // evals' max_tokens cap: a call asking more is refused, one asking none gets at most that many.
    const auto long_ask = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":8})", "sk-evals-0001"));
    CHECK(long_ask.status == 400);
    CHECK(json::parse(long_ask.body)["error"]["message"] == "max_tokens 8 exceeds the API key 'evals''s limit of 3");
    CHECK(json::parse(long_ask.body)["error"]["param"] == "max_tokens");
    const auto capped = round_trip(port, post("/v1/completions", R"({"prompt":"In","ignore_eos":true})", "sk-evals-0001"));
    CHECK(json::parse(capped.body)["usage"]["completion_tokens"] == 3);  // (OpenAI's default is 16)
    // More than the limit in one call could never be admitted: 400, naming it.
    const auto too_many = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2,"n":2})", "sk-team-a-0001"));
    CHECK(too_many.status == 400);
    CHECK(json::parse(too_many.body)["error"]["message"].get<std::string>().find("more than the API key 'team-a' may run "
                                                                                  "at once (1, its max_in_flight)") !=
          std::string::npos);
    ::close(fd);  // the first call is cancelled: its generation leaves team-a's count
    std::string metrics;
    for (int i = 0; i < 500; ++i) {
      metrics = round_trip(port, get("/metrics", "")).body;
      if (metrics.find("baton_api_key_in_flight{key=\"team-a\"} 0\n") != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
    CHECK_MESSAGE(metrics.find("baton_api_key_in_flight{key=\"team-a\"} 0\n") != std::string::npos, metrics);
    CHECK(round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})", "sk-team-a-0001")).status == 200);
    metrics = round_trip(port, get("/metrics", "")).body;
    CHECK(metrics.find("baton_api_key_responses_total{key=\"team-a\",code=\"429\"} 1\n") != std::string::npos);
    CHECK(metrics.find("baton_api_key_responses_total{key=\"team-a\",code=\"400\"} 1\n") != std::string::npos);
    CHECK(metrics.find("baton_api_key_responses_total{key=\"key-1\",code=\"200\"} 1\n") != std::string::npos);
    CHECK(metrics.find("baton_api_key_limited_total{key=\"team-a\"} 1\n") != std::string::npos);
    CHECK(metrics.find("baton_api_key_max_in_flight{key=\"team-a\"} 1\n") != std::string::npos);
    // Usage as the answers say it: evals' prompt once for its 3 choices, 6 tokens generated.
    const auto usage = json::parse(evals.body)["usage"];
    CHECK(usage["completion_tokens"] == 6);
    CHECK(metrics.find("baton_api_key_completion_tokens_total{key=\"evals\"} 9\n") != std::string::npos);  // 6 + the capped 3
    CHECK(metrics.find("baton_api_key_prompt_tokens_total{key=\"evals\"} " + std::to_string(2 * usage["prompt_tokens"].get<int>()) +
                       "\n") != std::string::npos);
    const auto id = json::parse(plain.body)["id"].get<std::string>();
    for (int i = 0; i < 200 && log.str().find(" call " + id + " ") == std::string::npos; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    const auto lines = log.str();
    std::cout.rdbuf(saved);
    CHECK_MESSAGE(lines.find(" call " + id + " key key-1 /v1/completions 200 ") != std::string::npos, lines);
    CHECK_MESSAGE(lines.find(" key team-a /v1/completions 429 ") != std::string::npos, lines);
  }
  std::cout.rdbuf(saved);
}

TEST_CASE("a keys file rewritten is read again without a restart: a key added, one rotated (its counters go on), a "
          "limit changed; a version that does not read leaves the keys as they were, and says so") {
  const auto dir = std::filesystem::temp_directory_path() / ("baton-keys-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto file = (dir / "keys.json").string();
  const auto write = [&](const std::string& text) {
    const auto tmp = file + ".new";
    std::ofstream{tmp} << text;
    std::filesystem::rename(tmp, file);  // as an editor or a config manager replaces it
  };
  write(R"({"keys":[{"name":"team-a","key":"sk-team-a-0001","max_in_flight":4}]})");
  deploy::gateway_config gc;
  std::string why;
  REQUIRE(deploy::parse_api_keys(R"({"keys":[{"name":"team-a","key":"sk-team-a-0001","max_in_flight":4}]})",
                                 &gc.named_keys, &why));
  gc.keys_file = file;
  gc.keys_file_stamp = deploy::file_stamp(file);
  gc.keys_poll_ms = 20;
  std::ostringstream log;
  auto* const saved = std::cout.rdbuf(log.rdbuf());
  {
    served_cluster s{gc};
    const uint16_t port = s.gateway.port;
    const auto ask = [&](const std::string& key) {
      return round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})", key)).status;
    };
    CHECK(ask("sk-team-a-0001") == 200);
    CHECK(ask("sk-team-b-0001") == 401);
    write(R"({"keys":[{"name":"team-a","key":"sk-team-a-0002","max_in_flight":2},
                      {"name":"team-b","key":"sk-team-b-0001","priority":"batch"}]})");
    int status = 0;
    for (int i = 0; i < 500 && (status = ask("sk-team-b-0001")) != 200; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    CHECK(status == 200);
    CHECK(ask("sk-team-a-0001") == 401);  // rotated: the old secret is gone
    CHECK(ask("sk-team-a-0002") == 200);
    auto metrics = round_trip(port, get("/metrics", "")).body;
    CHECK(metrics.find("baton_api_key_responses_total{key=\"team-a\",code=\"200\"} 2\n") != std::string::npos);
    CHECK(metrics.find("baton_api_key_max_in_flight{key=\"team-a\"} 2\n") != std::string::npos);
    write(R"({"keys":[{"name":"team-a","key":"short"}]})");
    for (int i = 0; i < 500 && log.str().find("does not read") == std::string::npos; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    CHECK(ask("sk-team-b-0001") == 200);  // as they were
    const auto lines = log.str();
    std::cout.rdbuf(saved);
    CHECK_MESSAGE(lines.find("API keys read again from " + file + ": team-a (at most 2 in flight), team-b (batch; no "
                             "limit of its own)") != std::string::npos,
                  lines);
    CHECK_MESSAGE(lines.find("the API keys file does not read (" + file + ": keys[0].key must be") != std::string::npos,
                  lines);
  }
  std::cout.rdbuf(saved);
  std::filesystem::remove_all(dir);
}

TEST_CASE("named API keys over HTTP: past its requests_per_minute, or once its answers have spent its "
          "tokens_per_minute, a key's call gets 429 naming the budget, with Retry-After the seconds to wait; other "
          "keys' calls go on") {
  deploy::gateway_config gc;
  deploy::api_key calls{"calls", "sk-calls-0001"}, tokens{"tokens", "sk-tokens-0001"}, other{"other", "sk-other-0001"};
  calls.requests_per_minute = 2;  // one every 30 s once the burst is spent
  tokens.tokens_per_minute = 10;  // one call's prompt and 16 tokens spend it for a minute and more
  gc.named_keys = {calls, tokens, other};
  served_cluster s{gc};
  const std::string body = R"({"prompt":"In the beginning","max_tokens":16,"ignore_eos":true})";
  const auto ask = [&](const char* key) { return round_trip(s.gateway.port, post("/v1/completions", body, key)); };
  CHECK(ask("sk-calls-0001").status == 200);
  CHECK(ask("sk-calls-0001").status == 200);
  const auto third = ask("sk-calls-0001");
  REQUIRE(third.status == 429);
  const auto err = json::parse(third.body)["error"];
  CHECK(err["code"] == "rate_limit_exceeded");
  CHECK(err["message"].get<std::string>().find("the API key 'calls' has used its requests_per_minute (2 calls a "
                                               "minute): retry in ") == 0);
  // Retry-After: the whole seconds until a call's worth has refilled (30 s at 2 a minute).
  const auto at = third.head.find("Retry-After: ");
  REQUIRE(at != std::string::npos);
  const int wait = std::stoi(third.head.substr(at + 13));
  CHECK(wait >= 29);
  CHECK(wait <= 30);
  // And in milliseconds, as the OpenAI SDKs read it first; the error's type is the budget (OpenAI's).
  const auto ms_at = third.head.find("retry-after-ms: ");
  REQUIRE(ms_at != std::string::npos);
  const int wait_ms = std::stoi(third.head.substr(ms_at + 16));
  CHECK(wait_ms > 29000);
  CHECK(wait_ms <= 30000);
  CHECK(err["type"] == "requests");
  // Tokens: charged as the answer ends (its usage), so the first call runs; the next waits.
  const auto first = ask("sk-tokens-0001");
  REQUIRE(first.status == 200);
  CHECK(json::parse(first.body)["usage"]["total_tokens"].get<int>() > 10);
  const auto next = ask("sk-tokens-0001");
  REQUIRE(next.status == 429);
  CHECK(json::parse(next.body)["error"]["message"].get<std::string>().find(
            "the API key 'tokens' has used its tokens_per_minute (10 prompt and generated tokens a minute)") == 0);
  CHECK(next.head.find("Retry-After: 1\r\n") == std::string::npos);  // more than a second: it overspent
  CHECK(json::parse(next.body)["error"]["type"] == "tokens");
  CHECK(ask("sk-other-0001").status == 200);  // the budgets are the keys' own
}

TEST_CASE("a key's budgets over HTTP: a streamed call whose client goes spends the tokens it computed, and a call the "
          "cluster refuses (overloaded) gives its request back") {
  deploy::gateway_config gc;
  deploy::api_key tokens{"tokens", "sk-tokens-0001"}, calls{"calls", "sk-calls-0001"}, other{"other", "sk-other-0001"};
  tokens.tokens_per_minute = 10;
  calls.requests_per_minute = 1;
  gc.named_keys = {tokens, calls, other};
  // Decode steps of 100 ms; the router admits one request at a time.
  served_cluster s{gc, 0, 100, BATON_SOURCE_DIR "/models/baton-kjv-tiny", 1};
  const uint16_t port = s.gateway.port;
  const auto metric = [&](const std::string& series) {
    return test::value_of(round_trip(port, get("/metrics", "")).body, series);
  };
  {  // A stream read for a dozen tokens, then its client goes: 499, and its tokens are spent.
    const int fd = connect_to(port);
    send_all(fd, post("/v1/completions", R"({"prompt":"In","max_tokens":60,"ignore_eos":true,"stream":true})",
                      "sk-tokens-0001"));
    std::string got = read_head(fd);
    REQUIRE(got.find("200 OK") != std::string::npos);
    char tmp[4096];
    size_t events = 0;
    for (int i = 0; i < 2000 && events < 12; ++i) {
      const auto n = ::recv(fd, tmp, sizeof tmp, 0);
      REQUIRE(n > 0);
      got.append(tmp, static_cast<size_t>(n));
      events = 0;
      for (size_t at = got.find("data: {"); at != std::string::npos; at = got.find("data: {", at + 1)) ++events;
    }
    ::close(fd);
  }
  for (int i = 0; i < 500 && metric("baton_api_key_in_flight{key=\"tokens\"}") != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  REQUIRE(metric("baton_api_key_in_flight{key=\"tokens\"}") == 0);
  const auto after = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})", "sk-tokens-0001"));
  CHECK(after.status == 429);
  CHECK(after.body.find("has used its tokens_per_minute") != std::string::npos);
  // The cluster full (one request admitted, another key's running): a call refused for that is
  // not the key's to count, and its one call a minute is still there.
  const int busy = connect_to(port);
  send_all(busy, post("/v1/completions", R"({"prompt":"In","max_tokens":30,"ignore_eos":true,"stream":true})",
                      "sk-other-0001"));
  REQUIRE(read_head(busy).find("200 OK") != std::string::npos);
  const auto refused = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})", "sk-calls-0001"));
  CHECK(refused.status == 429);
  CHECK(json::parse(refused.body)["error"]["code"] == "overloaded");
  CHECK(json::parse(refused.body)["error"]["type"] == "requests");
  ::close(busy);
  const std::string limited = "baton_api_key_budget_limited_total{key=\"calls\",budget=\"requests_per_minute\"}";
  http_answer ok;
  for (int i = 0; i < 300; ++i) {  // once the other key's call has ended (its client went)
    ok = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})", "sk-calls-0001"));
    if (ok.status != 429 || json::parse(ok.body)["error"]["code"] != "overloaded") break;
    std::this_thread::sleep_for(std::chrono::milliseconds{20});
  }
  CHECK(ok.status == 200);
  CHECK(metric(limited) == 0);
  CHECK(round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})", "sk-calls-0001")).status == 429);
  CHECK(metric(limited) == 1);
  CHECK(metric("baton_api_key_requests_per_minute{key=\"calls\"}") == 1);
  CHECK(metric("baton_api_key_tokens_per_minute{key=\"tokens\"}") == 10);
}

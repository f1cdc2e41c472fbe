// The client-facing paths: streaming from the request actor, the HTTP parser and OpenAI
// mapping, and the gateway over real sockets on 127.0.0.1 (the C++ client library:
// client.test.cpp).

#include <future>
#include <random>

#include <caf/event_based_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "tests/deploy/gateway_fixture.hpp"

using namespace baton;
using namespace baton::test_gateway;
using nlohmann::json;

TEST_CASE("the gateway answers OpenAI requests over HTTP with the router's tokens, streamed or whole") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  generate_request ref_req;
  ref_req.prompt = "The quick brown fox";
  ref_req.max_tokens = 12;
  ref_req.ignore_eos = true;
  const auto ref = s.direct(ref_req);
  REQUIRE(ref.tokens.size() == 12);

  auto whole = round_trip(port, post("/v1/completions", R"({"prompt":"The quick brown fox","max_tokens":12,"ignore_eos":true})"));
  REQUIRE(whole.status == 200);
  auto j = json::parse(whole.body);
  CHECK(j["object"] == "text_completion");
  CHECK(j["choices"][0]["text"] == json(ref.text).get<std::string>());
  CHECK(j["choices"][0]["finish_reason"] == "length");
  CHECK(j["usage"]["completion_tokens"] == 12);
  CHECK(j["usage"]["prompt_tokens"] == ref.num_prompt_tokens);

  // Streamed: the events' text joins to the same text; the last content event says why it ended.
  auto streamed = round_trip(port, post("/v1/completions", R"({"prompt":"The quick brown fox","max_tokens":12,
      "ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}})"));
  REQUIRE(streamed.status == 200);
  CHECK(streamed.head.find("text/event-stream") != std::string::npos);
  std::vector<json> events;
  CHECK(sse_text(streamed.body, &events) == ref.text);
  REQUIRE(events.size() >= 3);
  CHECK(events.back() == "[DONE]");
  CHECK(events[events.size() - 2]["usage"]["completion_tokens"] == 12);
  CHECK(events[events.size() - 3]["choices"][0]["finish_reason"] == "length");
  CHECK(events.size() >= 5);  // tokens arrive as they are made, not in one piece

  // A stop string: the stream never shows the text it cuts.
  ref_req.stop = {ref.text.substr(6, 3)};
  const auto cut = s.direct(ref_req);
  CHECK(cut.finish_reason == "stop");
  events.clear();
  auto stopped = round_trip(port, post("/v1/completions", json{{"prompt", "The quick brown fox"}, {"max_tokens", 12},
                                                             {"ignore_eos", true}, {"stream", true},
                                                             {"stop", ref_req.stop[0]}}.dump()));
  CHECK(sse_text(stopped.body, &events) == cut.text);

  // An HTTP/1.0 client knows no chunked encoding: the events come raw, and the close ends them.
  {
    const std::string body = R"({"prompt":"The quick brown fox","max_tokens":12,"ignore_eos":true,"stream":true})";
    const int fd10 = connect_to(port);
    send_all(fd10, "POST /v1/completions HTTP/1.0\r\nAuthorization: Bearer sk-test\r\nContent-Length: " +
                       std::to_string(body.size()) + "\r\n\r\n" + body);
    const std::string all = read_to_close(fd10);
    ::close(fd10);
    const auto head_end = all.find("\r\n\r\n");
    REQUIRE(head_end != std::string::npos);
    const auto head = all.substr(0, head_end);
    CHECK(head.find("HTTP/1.1 200") == 0);
    CHECK(head.find("Transfer-Encoding") == std::string::npos);
    CHECK(head.find("Connection: close") != std::string::npos);
    std::vector<json> raw_events;
    CHECK(sse_text(all.substr(head_end + 4), &raw_events) == ref.text);
    REQUIRE(!raw_events.empty());
    CHECK(raw_events.back() == "[DONE]");
  }

  // Two pipelined requests on one connection are answered in order.
  const int fd = connect_to(port);
  send_all(fd, get("/v1/models") + post("/v1/completions", R"({"prompt":"a","max_tokens":2})"));
  std::string buf;
  auto first = read_answer(fd, buf);
  auto second = read_answer(fd, buf);
  ::close(fd);
  CHECK(first.status == 200);
  CHECK(json::parse(first.body)["data"][0]["id"] == s.stats().model);
  CHECK(second.status == 200);
  CHECK(json::parse(second.body)["choices"][0]["finish_reason"].is_string());
}

TEST_CASE("regression: after a streamed answer, the next request on the connection that the cluster refuses gets "
          "its own status, not a stream event") {
  served_cluster s;
  const int fd = connect_to(s.gateway.port);
  // The prompt fits the built-in model's context, prompt plus max_tokens does not: the router
  // refuses it, after the gateway has parsed it.
  send_all(fd, post("/v1/completions", R"({"prompt":"a","max_tokens":2,"stream":true})") +
                   post("/v1/completions", R"({"prompt":"In the beginning","max_tokens":255})"));
  std::string buf;
  auto first = read_answer(fd, buf);
  auto second = read_answer(fd, buf);
  ::close(fd);
  CHECK(first.status == 200);
  CHECK(second.status == 400);
  CHECK(second.head.find("Transfer-Encoding: chunked") == std::string::npos);
  CHECK(json::parse(second.body)["error"]["message"].get<std::string>().find("context") != std::string::npos);
}

TEST_CASE("--served-model-name: the API knows the model by that id alone (calls, answers, /v1/models with its "
          "max_model_len); a name "
          "that is not printable ASCII is refused") {
  deploy::gateway_config gc;
  gc.served_model_name = "org/my-kjv";
  served_cluster s{gc};
  const uint16_t port = s.gateway.port;
  auto models = json::parse(round_trip(port, get("/v1/models")).body);
  REQUIRE(models["data"].size() == 1);
  CHECK(models["data"][0]["id"] == "org/my-kjv");
  CHECK(models["data"][0]["max_model_len"] == 256);  // vLLM's field: the built-in model's context
  const auto one = round_trip(port, get("/v1/models/org/my-kjv"));
  CHECK(one.status == 200);
  CHECK(json::parse(one.body)["max_model_len"] == 256);
  const auto encoded = round_trip(port, get("/v1/models/org%2Fmy-kjv"));  // the SDKs' models.retrieve
  CHECK(encoded.status == 200);
  CHECK(json::parse(encoded.body)["id"] == "org/my-kjv");
  const auto malformed = round_trip(port, get("/v1/models/org%2"));
  CHECK(malformed.status == 400);
  CHECK_MESSAGE(malformed.body.find("malformed %-escape") != std::string::npos, malformed.body);
  auto named = round_trip(port, post("/v1/completions", R"({"model":"org/my-kjv","prompt":"In","max_tokens":2})"));
  REQUIRE(named.status == 200);
  CHECK(json::parse(named.body)["model"] == "org/my-kjv");
  auto unnamed = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})"));
  REQUIRE(unnamed.status == 200);
  CHECK(json::parse(unnamed.body)["model"] == "org/my-kjv");
  auto own = round_trip(port, post("/v1/completions", R"({"model":"baton-kjv-tiny","prompt":"In","max_tokens":2})"));
  CHECK(own.status == 404);
  CHECK(own.body.find("this cluster serves 'org/my-kjv'") != std::string::npos);
  deploy::gateway_config bad;
  bad.served_model_name = "caf\xc3";
  CHECK(bad.validate().find("--served-model-name must be printable ASCII") != std::string::npos);
  bad.served_model_name = "tab\tname";
  CHECK(!bad.validate().empty());
}

TEST_CASE("the gateway refuses what it cannot serve with the right status and a sentence") {
  deploy::gateway_config gc;
  gc.limits.max_body_bytes = 4096;
  served_cluster s{gc};
  const uint16_t port = s.gateway.port;
  CHECK(round_trip(port, get("/health", "")).status == 200);  // no key needed for health checks
  const auto scraped = round_trip(port, get("/metrics", ""));  // nor for Prometheus' scrape
  CHECK(scraped.status == 200);
  CHECK(scraped.body.find("baton_router_up 1") != std::string::npos);
  auto unauth = round_trip(port, get("/v1/models", ""));
  CHECK(unauth.status == 401);
  CHECK(unauth.head.find("WWW-Authenticate: Bearer") != std::string::npos);
  CHECK(round_trip(port, get("/v1/models", "sk-wrong")).status == 401);
  CHECK(round_trip(port, get("/v1/models", "sk-other")).status == 200);
  CHECK(round_trip(port, get("/v1/nothing")).status == 404);
  // HTTP/1.1 without a Host (RFC 9112 §3.2); HTTP/1.0 needs none.
  auto no_host = round_trip(port, "GET /health HTTP/1.1\r\n\r\n");
  CHECK(no_host.status == 400);
  CHECK(json::parse(no_host.body)["error"]["message"] == "an HTTP/1.1 request needs a Host header");
  {
    const int fd = connect_to(port);
    send_all(fd, "GET /health HTTP/1.0\r\n\r\n");
    CHECK(read_to_close(fd).rfind("HTTP/1.1 200", 0) == 0);
    ::close(fd);
  }
  auto wrong_method = round_trip(port, get("/v1/completions"));
  CHECK(wrong_method.status == 405);
  CHECK(wrong_method.head.find("Allow: POST") != std::string::npos);
  auto bad = round_trip(port, post("/v1/completions", R"({"prompt":"a","max_tokens":100000})"));
  CHECK(bad.status == 400);
  CHECK(json::parse(bad.body)["error"]["message"].get<std::string>().find("max_tokens") != std::string::npos);
  // Refused by the router's checks (its limit), still naming the field.
  CHECK_MESSAGE(json::parse(bad.body)["error"]["message"].get<std::string>().find("stage admission") != std::string::npos,
                bad.body);
  CHECK(json::parse(bad.body)["error"]["param"] == "max_tokens");
  auto no_model = round_trip(port, post("/v1/completions", R"({"prompt":"a","model":"nope"})"));
  CHECK(no_model.status == 404);
  // OpenAI's codes where it has one, which clients branch on; null elsewhere.
  CHECK(json::parse(no_model.body)["error"]["code"] == "model_not_found");
  CHECK(json::parse(unauth.body)["error"]["code"] == "invalid_api_key");
  CHECK(json::parse(bad.body)["error"]["code"].is_null());
  auto too_long = round_trip(port, post("/v1/completions", R"({"prompt":"In the beginning God created the heaven","max_tokens":250})"));
  CHECK(too_long.status == 400);
  CHECK_MESSAGE(json::parse(too_long.body)["error"]["code"] == "context_length_exceeded", too_long.body);
  CHECK(round_trip(port, post("/v1/completions", std::string(5000, ' '))).status == 413);
  CHECK(round_trip(port, "BROKEN\r\n\r\n").status == 400);
  // A chat needs a template; the built-in model has none: a clear 400, not a crash.
  auto chat = round_trip(port, post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}]})"));
  CHECK(chat.status == 400);
  CHECK(json::parse(chat.body)["error"]["message"].get<std::string>().find("chat template") != std::string::npos);
  // The gateway still serves after all of that, and counts it.
  CHECK(round_trip(port, post("/v1/completions", R"({"prompt":"a","max_tokens":2})")).status == 200);
  // A scoring call generates no token: no TTFT (its prefill would skew the histogram).
  CHECK(round_trip(port, post("/v1/completions", R"({"prompt":"abc","max_tokens":0,"echo":true,"logprobs":1})")).status ==
        200);
  auto metrics = round_trip(port, get("/metrics"));
  REQUIRE(metrics.status == 200);
  CHECK(metrics.body.find("baton_http_responses_total{route=\"/v1/completions\",code=\"400\"} 2") != std::string::npos);
  CHECK(metrics.body.find("baton_ttft_seconds_count 1\n") != std::string::npos);
  CHECK(metrics.body.find("baton_rank_free_kv_pages{role=\"decode\",rank=\"decode-0\"}") != std::string::npos);
  CHECK(metrics.body.find("baton_rank_available{role=\"prefill\",rank=\"prefill-0\"} 1\n") != std::string::npos);
  CHECK(metrics.body.find("baton_router_up 1") != std::string::npos);
  // The router's refusal of traffic_class names it as the param, as every other field's does.
  auto cls = round_trip(port, post("/v1/completions", R"({"prompt":"a","max_tokens":2,"traffic_class":"gold"})"));
  CHECK(cls.status == 400);
  CHECK_MESSAGE(json::parse(cls.body)["error"]["param"] == "traffic_class", cls.body);
}

TEST_CASE("the gateway keeps serving a client that pipelines thousands of requests behind a stream") {
  served_cluster s;
  const int fd = connect_to(s.gateway.port);
  // Answered at once, one after another, once the stream ends: this recursed once per request
  // (pump, reply, finish, pump ...) and overflowed the stack at about 16,000.
  constexpr int n = 40000;
  std::string flood = post("/v1/completions", R"({"prompt":"a","max_tokens":40,"ignore_eos":true,"stream":true})");
  for (int i = 0; i < n; ++i) flood += "GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  std::thread sender{[&] { send_all(fd, flood); }};
  std::string buf;
  CHECK(read_answer(fd, buf).status == 200);
  int not_found = 0;
  for (int i = 0; i < n; ++i) not_found += read_answer(fd, buf).status == 404;
  sender.join();
  ::close(fd);
  CHECK(not_found == n);
  CHECK(round_trip(s.gateway.port, get("/health", "")).status == 200);
}

TEST_CASE("/health counts only ranks that take work: with every decode rank draining it answers 503 naming them, "
          "and 200 again once one takes work") {
  served_cluster s;
  const auto health = [&] { return round_trip(s.gateway.port, get("/health", "")); };
  auto h = health();
  CHECK(h.status == 200);
  CHECK_MESSAGE(h.body == "{\"status\":\"ok\",\"prefill_ranks\":2,\"decode_ranks\":2}", h.body);
  caf::scoped_actor self{s.sys};
  self->send(s.cluster.decode_balancer, drain_atom::value, s.cluster.decode[0].handle);
  for (int i = 0; i < 500 && health().body.find("\"decode_ranks\":1") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  h = health();
  CHECK(h.status == 200);
  CHECK_MESSAGE(h.body.find("\"decode_ranks\":1,\"ranks_not_taking_work\":1") != std::string::npos, h.body);
  self->send(s.cluster.decode_balancer, drain_atom::value, s.cluster.decode[1].handle);
  for (int i = 0; i < 500 && health().status != 503; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
  h = health();
  CHECK(h.status == 503);
  CHECK_MESSAGE(h.body.find("the cluster has 2 prefill and 0 decode ranks taking work (2 more draining, stepped "
                            "aside or failed); it needs one of each") != std::string::npos,
                h.body);
  // The metrics say which: each draining rank is unavailable.
  const auto m = round_trip(s.gateway.port, get("/metrics"));
  CHECK_MESSAGE(m.body.find("baton_rank_available{role=\"decode\",rank=\"decode-0\"} 0") != std::string::npos, m.body);
  self->send(s.cluster.decode_balancer, undrain_atom::value, s.cluster.decode[1].handle);
  for (int i = 0; i < 500 && health().status != 200; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(health().status == 200);
}

TEST_CASE("a call whose first token misses the gateway's first-token timeout gets 504 and stops its generation; "
          "none of its text reaches the next answer") {
  deploy::gateway_config gc;
  gc.first_token_timeout_ms = 100;
  served_cluster s{gc, 1500};  // every prefill starts 1.5 s late: no first token within 100 ms
  const int fd = connect_to(s.gateway.port);
  send_all(fd, post("/v1/completions", R"({"prompt":"a","max_tokens":40,"ignore_eos":true,"stream":true})"));
  std::string buf;
  auto a = read_answer(fd, buf);
  CHECK(a.status == 504);
  CHECK(a.body.find("no token within the gateway's first-token timeout of 100 ms") != std::string::npos);
  CHECK(a.body.find(", stage first_token: ") != std::string::npos);  // and which call it was
  ::close(fd);
  CHECK(s.settles());  // its generation was cancelled: its pages came back
}

TEST_CASE("a generation that outlasts the first-token timeout is not cut once its tokens flow, streamed or whole") {
  deploy::gateway_config gc;
  gc.first_token_timeout_ms = 1000;
  served_cluster s{gc, 0, 40};  // each decode step starts 40 ms late: 40 tokens take over 1.5 s
  generate_request b;
  b.prompt = "a";
  b.max_tokens = 40;
  b.ignore_eos = true;
  const auto ref = s.direct(b);
  for (const bool stream : {true, false}) {
    CAPTURE(stream);
    const int fd = connect_to(s.gateway.port);
    // Each token comes well within the request's own watchdog; the whole generation does not
    // come within the first-token timeout.
    send_all(fd, post("/v1/completions", std::string{R"({"prompt":"a","max_tokens":40,"ignore_eos":true,"stream":)"} +
                                             (stream ? "true" : "false") + "}"));
    std::string buf;
    auto a = read_answer(fd, buf);
    ::close(fd);
    CHECK(a.status == 200);
    if (stream) {
      std::vector<json> events;
      CHECK(sse_text(a.body, &events) == ref.text);
    } else {
      CHECK(json::parse(a.body)["choices"][0]["text"] == ref.text);
    }
  }
  CHECK(s.settles());
}

TEST_CASE("a streaming call that waits for its first token past stream_keepalive_ms gets its 200 head and comment "
          "lines meanwhile (a proxy sees it alive), then the same events; a failure after that is the stream's "
          "error event; a whole answer waits as before") {
  deploy::gateway_config gc;
  gc.stream_keepalive_ms = 50;
  served_cluster s{gc, 400};  // every prefill starts 0.4 s late
  generate_request b;
  b.prompt = "a";
  b.max_tokens = 8;
  b.ignore_eos = true;
  const auto ref = s.direct(b);
  auto streamed = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"a","max_tokens":8,"ignore_eos":true,"stream":true})"));
  CHECK(streamed.status == 200);
  const auto comment = streamed.body.find(": waiting for the first token\n\n");
  REQUIRE(comment != std::string::npos);
  CHECK(comment < streamed.body.find("data: "));
  std::vector<json> events;
  CHECK(sse_text(streamed.body, &events) == ref.text);  // clients skip the comments
  auto whole = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"a","max_tokens":8,"ignore_eos":true})"));
  CHECK(whole.status == 200);
  CHECK(json::parse(whole.body)["choices"][0]["text"] == ref.text);

  deploy::gateway_config late;
  late.stream_keepalive_ms = 50;
  late.first_token_timeout_ms = 300;
  served_cluster t{late, 1500};  // no first token within 300 ms
  auto cut = round_trip(t.gateway.port, post("/v1/completions", R"({"prompt":"a","max_tokens":8,"stream":true})"));
  CHECK(cut.status == 200);  // sent with the first comment
  CHECK(cut.body.find(": waiting for the first token") != std::string::npos);
  CHECK_MESSAGE(cut.body.find(R"(data: {"error":)") != std::string::npos, cut.body);
  CHECK(cut.body.find("no token within the gateway's first-token timeout of 300 ms") != std::string::npos);
  CHECK(t.settles());
}

TEST_CASE("the gateway answers load balancers' and SDKs' small requests: HEAD /health, a model by id, any case of "
          "Bearer, Expect: 100-continue") {
  served_cluster s;
  const uint16_t port = s.gateway.port;
  {  // HEAD: the head only, and the connection stays in step for the next request
    const int fd = connect_to(port);
    send_all(fd, "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n" + get("/v1/models"));
    std::string buf;
    char tmp[4096];
    while (buf.find("\r\n\r\n") == std::string::npos || buf.find("\r\n\r\n{") == std::string::npos) {
      const auto n = ::recv(fd, tmp, sizeof(tmp), 0);
      REQUIRE(n > 0);
      buf.append(tmp, static_cast<size_t>(n));
    }
    ::close(fd);
    CHECK(buf.rfind("HTTP/1.1 200 OK", 0) == 0);
    const auto second = buf.find("HTTP/1.1 200 OK", 1);
    REQUIRE(second != std::string::npos);
    CHECK(buf.substr(buf.find("\r\n\r\n") + 4, second - buf.find("\r\n\r\n") - 4).empty());  // no body after HEAD's head
  }
  auto model = round_trip(port, get("/v1/models/" + s.stats().model));
  REQUIRE(model.status == 200);
  CHECK(json::parse(model.body)["id"] == s.stats().model);
  CHECK(round_trip(port, get("/v1/models/gpt-4")).status == 404);
  CHECK(round_trip(port, "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: bearer sk-test\r\n\r\n").status == 200);
  {  // Expect: 100-continue: told to go on before the body is sent
    const int fd = connect_to(port);
    const std::string body = R"({"prompt":"a","max_tokens":2})";
    send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-test\r\nExpect: 100-continue\r\nContent-Length: " +
                     std::to_string(body.size()) + "\r\n\r\n");
    CHECK(read_head(fd) == "HTTP/1.1 100 Continue\r\n\r\n");
    std::string buf;
    send_all(fd, body);
    CHECK(read_answer(fd, buf).status == 200);
    ::close(fd);
  }
}

TEST_CASE("a connection that sends nothing is closed after the idle limit, so silent sockets cannot hold every slot") {
  deploy::gateway_config gc;
  gc.idle_timeout_ms = 200;
  gc.max_connections = 2;
  served_cluster s{gc};
  const int a = connect_to(s.gateway.port), b = connect_to(s.gateway.port);
  char tmp[64];
  CHECK(::recv(a, tmp, sizeof tmp, 0) == 0);  // closed by the gateway (the socket's own limit is 30 s)
  CHECK(::recv(b, tmp, sizeof tmp, 0) == 0);
  ::close(a);
  ::close(b);
  CHECK(round_trip(s.gateway.port, get("/health", "")).status == 200);
}

TEST_CASE("a body past the limit is answered 413 while the client is still sending it, and the client reads the 413 "
          "(a lingering close: no reset discards the answer)") {
  deploy::gateway_config gc;
  gc.limits.max_body_bytes = 4096;
  served_cluster s{gc};
  const int fd = connect_to(s.gateway.port);
  const std::string body(4 << 20, ' ');  // 4 MiB: far more than the socket buffers hold
  send_all(fd, post("/v1/completions", body).substr(0, 300));  // the head and the body's start
  std::string buf;
  // The client goes on sending while the answer comes (a client that sends its whole body before
  // reading, as most do); the gateway drops what it sends.
  std::thread sender{[&] {
    size_t off = 0;
    while (off < body.size()) {
      const auto n = ::send(fd, body.data() + off, std::min<size_t>(65536, body.size() - off), MSG_NOSIGNAL);
      if (n <= 0) break;  // the gateway closed after its linger: the rest is not wanted
      off += static_cast<size_t>(n);
    }
  }};
  // The client reads a moment later (it was busy sending): by then a gateway that closed at once
  // has answered the bytes still coming with a reset, which discards the 413 unread.
  std::this_thread::sleep_for(std::chrono::milliseconds{300});
  const auto a = read_answer(fd, buf);
  sender.join();
  ::close(fd);
  CHECK(a.status == 413);
  CHECK_MESSAGE(a.body.find("exceeds the limit of 4096") != std::string::npos, a.body);
  CHECK(round_trip(s.gateway.port, get("/health", "")).status == 200);
}

TEST_CASE("a CRLF after a request's body is no request: the idle connection is closed quietly, not answered 408") {
  deploy::gateway_config gc;
  gc.idle_timeout_ms = 200;
  served_cluster s{gc};
  const int fd = connect_to(s.gateway.port);
  send_all(fd, get("/v1/models") + "\r\n");  // RFC 9112 §2.2 allows the stray CRLF
  std::string buf;
  CHECK(read_answer(fd, buf).status == 200);
  // Then nothing more: the gateway closes the idle connection without a word (a 408 written
  // here would be read as the answer to the client's next request).
  std::string rest = buf;
  char tmp[256];
  for (;;) {
    const auto n = ::recv(fd, tmp, sizeof tmp, 0);
    if (n <= 0) break;
    rest.append(tmp, static_cast<size_t>(n));
  }
  ::close(fd);
  CHECK_MESSAGE(rest.empty(), rest);
}

TEST_CASE("a request that trickles in a byte at a time is cut off with 408 once it has taken the idle limit, "
          "however often a byte arrives (slowloris)") {
  deploy::gateway_config gc;
  gc.idle_timeout_ms = 200;
  served_cluster s{gc};
  const int fd = connect_to(s.gateway.port);
  const std::string slow = get("/health", "");
  std::string buf;
  // One byte every 20 ms: each arrives well inside the idle limit, the request never completes.
  size_t sent = 0;
  for (; sent < slow.size() - 1; ++sent) {
    if (::send(fd, slow.data() + sent, 1, MSG_NOSIGNAL) != 1) break;  // the gateway closed it
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20) > 0) break;  // it answered
  }
  CHECK(sent < slow.size() - 1);  // cut off before the request was whole
  const auto a = read_answer(fd, buf);
  CHECK(a.status == 408);
  CHECK_MESSAGE(a.body.find("did not arrive whole within 200 ms") != std::string::npos, a.body);
  ::close(fd);
  CHECK(round_trip(s.gateway.port, get("/health", "")).status == 200);
}

TEST_CASE("a request pipelined behind one that closes the connection is never started") {
  served_cluster s;
  const auto before = s.stats().num_admitted;
  const int fd = connect_to(s.gateway.port);
  const std::string body = R"({"prompt":"Once upon a time","max_tokens":50,"ignore_eos":true})";
  // HTTP/1.0 without keep-alive: the first answer closes the connection.
  send_all(fd, "GET /v1/models HTTP/1.0\r\nAuthorization: Bearer sk-test\r\n\r\n"
               "POST /v1/completions HTTP/1.0\r\nAuthorization: Bearer sk-test\r\nContent-Length: " +
                   std::to_string(body.size()) + "\r\n\r\n" + body);
  std::string all;
  char tmp[4096];
  for (ssize_t n; (n = ::recv(fd, tmp, sizeof tmp, 0)) > 0;) all.append(tmp, static_cast<size_t>(n));
  ::close(fd);
  CHECK(all.rfind("HTTP/1.1 200", 0) == 0);
  CHECK(all.find("HTTP/1.1", 1) == std::string::npos);  // one answer only
  CHECK(s.settles());
  CHECK(s.stats().num_admitted == before);  // no generation was started
}

TEST_CASE("a client that pipelines requests and reads none of the answers is held to a bounded backlog: the "
          "gateway stops reading from it, then drops the connection once it has read nothing for the idle limit") {
  deploy::gateway_config gc;
  // Far longer than the send phase and the stall below, even on a loaded machine (a CI run once
  // spent more than 1.5 s sending and was dropped mid-stall): the stall shows the read limit.
  gc.idle_timeout_ms = 4000;
  served_cluster s{gc};
  const int fd = connect_to(s.gateway.port);
  int small = 64 * 1024;  // small socket buffers: the backlog shows in megabytes, not tens of them
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  // 404s, answered at once without a key: ~250 bytes of answer per 35 bytes of request.
  std::string burst;
  while (burst.size() < 64 * 1024) burst += "GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n";
  size_t accepted = 0;
  int stalls = 0;
  while (accepted < (64u << 20) && stalls < 20) {  // at most 64 MiB; stalled: 20 x 25 ms refused
    const size_t at = accepted % burst.size();  // a partial send resumes mid-request
    const auto n = ::send(fd, burst.data() + at, burst.size() - at, MSG_NOSIGNAL);
    if (n > 0) {
      accepted += static_cast<size_t>(n);
      stalls = 0;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      ++stalls;
      std::this_thread::sleep_for(std::chrono::milliseconds{25});
    } else {
      MESSAGE("send failed after " << accepted << " bytes: errno " << errno << ", stalls " << stalls);
      break;
    }
  }
  // It stopped taking requests: about its 1 MiB answer limit's worth plus one request's limits
  // and the sockets' buffers, not the 64 MiB (whose answers would have been ~460 MiB in its memory).
  CHECK(stalls == 20);
  CHECK_MESSAGE(accepted < (16u << 20), accepted);  // 8.5 MB seen under load: the kernel grows loopback buffers
  // Reading nothing for the idle limit, the client is dropped (bounded wait).
  bool dropped = false;
  for (int i = 0; i < 1000 && !dropped; ++i) {
    const auto n = ::send(fd, burst.data() + accepted++ % burst.size(), 1, MSG_NOSIGNAL);
    dropped = n < 0 && (errno == ECONNRESET || errno == EPIPE);
    if (!dropped) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  CHECK(dropped);
  ::close(fd);
  CHECK(round_trip(s.gateway.port, get("/health", "")).status == 200);
}

TEST_CASE("a gateway whose max_connections the process's descriptor limit cannot hold is refused, naming both") {
  served_cluster s;
  rlimit files{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &files) == 0);
  if (files.rlim_max == RLIM_INFINITY || files.rlim_max > (1u << 30)) return;  // nothing to exceed here
  deploy::gateway_config gc;
  gc.port = 0;
  gc.max_connections = 1u << 30;
  deploy::gateway_handle h;
  std::string why;
  CHECK_FALSE(deploy::spawn_gateway(s.sys, gc, s.cluster.router, &h, &why));
  CHECK_MESSAGE(why.find("gateway: max_connections 1073741824 needs about 1073741888 file descriptors; this process "
                         "may open ") != std::string::npos,
                why);
  // Raised to the hard limit on the way: the default 1024 connections fit.
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &files) == 0);
  CHECK(files.rlim_cur == files.rlim_max);
}

TEST_CASE("HEAD is answered wherever GET is, with the head alone") {
  served_cluster s;
  const int fd = connect_to(s.gateway.port);
  send_all(fd, "HEAD /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string all;
  char tmp[4096];
  while (all.find("\"status\":\"ok\"") == std::string::npos) {
    const auto n = ::recv(fd, tmp, sizeof tmp, 0);
    REQUIRE(n > 0);
    all.append(tmp, static_cast<size_t>(n));
  }
  ::close(fd);
  CHECK(all.rfind("HTTP/1.1 200", 0) == 0);
  // The HEAD's head, then at once the next answer: no body in between.
  const auto next = all.find("\r\n\r\n") + 4;
  CHECK(all.compare(next, 12, "HTTP/1.1 200") == 0);
}

TEST_CASE("a client that hangs up mid-stream cancels its request (every choice of it) and its KV pages come back") {
  served_cluster s;
  for (const char* n : {"1", "3"}) {
    CAPTURE(n);
    const int fd = connect_to(s.gateway.port);
    send_all(fd, post("/v1/completions", std::string{R"({"prompt":"Once upon a time","max_tokens":200,"ignore_eos":true,"stream":true,"n":)"} + n + "}"));
    std::string buf;
    char tmp[4096];
    while (buf.find("data: ") == std::string::npos) {  // the stream has begun
      const auto got = ::recv(fd, tmp, sizeof(tmp), 0);
      REQUIRE(got > 0);
      buf.append(tmp, static_cast<size_t>(got));
    }
    ::close(fd);
    CHECK(s.settles());
  }
  // Both hang-ups are counted, as nginx counts a client that left before its answer: 499.
  CHECK(round_trip(s.gateway.port, get("/metrics")).body.find(R"(baton_http_responses_total{route="/v1/completions",code="499"} 2)") !=
        std::string::npos);
}

TEST_CASE("clients that hang up before their answer's first byte, many at once, leave no sequence and no KV page "
          "behind on the decode ranks") {
  served_cluster s;
  const std::string req = post("/v1/completions", R"({"prompt":"In the beginning","max_tokens":200,"ignore_eos":true})");
  std::vector<std::thread> clients;
  for (int k = 0; k < 16; ++k)
    clients.emplace_back([&, k] {
      std::mt19937 rng(static_cast<uint32_t>(k));
      for (int j = 0; j < 8; ++j) {
        const int fd = connect_to(s.gateway.port);
        send_all(fd, req);
        // Gone at any moment of the request's start: before its reservation is answered, while
        // its prompt is computed, as its KV is sent.
        std::this_thread::sleep_for(std::chrono::microseconds{rng() % 50000});
        ::close(fd);
      }
    });
  for (auto& c : clients) c.join();
  const bool settled = s.settles();
  std::string left = "active " + std::to_string(s.stats().num_active) + ";";
  for (const auto& d : s.stats().decode)
    left += " " + d.name + ": " + std::to_string(d.num_running) + " running, " + std::to_string(d.num_free_pages) + "/" +
            std::to_string(d.num_total_pages) + " pages free;";
  // (Before, a request gone between its decode placement and its reservation left the
  // placement charged to the rank for a whole charge TTL: /metrics showed it running, and
  // placements parked behind it.)
  CHECK_MESSAGE(settled, left);
}

TEST_CASE("a call of more generations than the router admits at once is refused 400 naming n (or the prompts), "
          "not 429: no retry could ever get it in") {
  served_cluster s{{}, 0, 0, BATON_SOURCE_DIR "/models/baton-kjv-tiny", 2};
  auto a = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"In the beginning","max_tokens":2,"n":3})"));
  CHECK(a.status == 400);
  auto j = json::parse(a.body);
  CHECK(j["error"]["param"] == "n");
  CHECK(j["error"]["message"] == "n: this call asks for 3 generations (n, or best_of), more than the cluster runs at "
                                 "once (2, --max-active-requests): ask for at most that many");
  a = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":["a","b","c"],"max_tokens":2})"));
  CHECK(a.status == 400);
  CHECK(json::parse(a.body)["error"]["param"] == "prompt");
  // Within the limit: answered.
  a = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"In the beginning","max_tokens":2,"n":2})"));
  CHECK(a.status == 200);
  CHECK(s.stats().num_rejected == 0);  // nothing of the refused calls reached the router
}


namespace {

using answer_tick_atom = caf::atom_constant<caf::atom("anstick")>;

/// A stand-in router (for fault injection only) that reproduces what CAF's network layer can do
/// to a short request: the sink hears its request actor end, with exit_reason::unknown, before
/// that actor's answer arrives. Each streamed call gets one chunk from an actor that then ends
/// so; the answer follows `answer_after` later, or never (zero).
caf::behavior fault_late_answer_router(caf::event_based_actor* self, std::chrono::milliseconds answer_after) {
  auto pending = std::make_shared<std::vector<caf::typed_response_promise<completion>>>();
  return {
      [=](stats_atom) {
        cluster_stats s;
        s.model = "stand-in";
        return s;
      },
      [=](generate_atom, generate_request&, client_sink_actor& sink) {
        self->spawn([sink](caf::event_based_actor* request) {
          stream_chunk c;
          c.text = "late";
          request->send(sink, std::move(c));
          request->quit(caf::exit_reason::unknown);
        });
        pending->push_back(self->make_response_promise<completion>());
        if (answer_after.count() > 0) self->delayed_send(self, answer_after, answer_tick_atom::value);
        return pending->back();
      },
      [=](answer_tick_atom) {
        completion c;
        c.text = "late answer";
        c.finish_reason = "length";
        for (auto& p : *pending) p.deliver(c);
        pending->clear();
      },
  };
}

}  // namespace

TEST_CASE("regression: a request actor reported ended (exit_reason unknown) before its answer arrives still gets "
          "its answer to the client; with no answer the call fails with 503 after the grace") {
  caf::actor_system_config cfg;
  caf::actor_system sys{served_cluster::init(cfg)};
  for (const int answer_ms : {300, 0}) {
    CAPTURE(answer_ms);
    auto router = caf::actor_cast<router_actor>(sys.spawn(fault_late_answer_router, std::chrono::milliseconds{answer_ms}));
    deploy::gateway_config gc;
    gc.port = 0;
    gc.unanswered_grace_ms = 1000;  // the answer, when it comes, is 300 ms behind
    deploy::gateway_handle gw;
    std::string why;
    REQUIRE_MESSAGE(deploy::spawn_gateway(sys, gc, router, &gw, &why), why);
    const auto a = round_trip(gw.port, post("/v1/completions", R"({"prompt":"x","max_tokens":4})", ""));
    if (answer_ms > 0) {
      CHECK(a.status == 200);
      CHECK(json::parse(a.body)["choices"][0]["text"] == "late answer");
    } else {
      CHECK(a.status == 503);
      CHECK(a.body.find("the request ended without an answer") != std::string::npos);
      CHECK(json::parse(a.body)["error"]["code"] == "rank_unavailable");  // the cluster's reason, for clients to test
    }
    caf::anon_send_exit(gw.server, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
  }
}

TEST_CASE("an answer that closes its connection (HTTP/1.0) is sent whole to a client that starts reading it late, "
          "not reset after the lingering close's two seconds while it is still going out") {
  served_cluster s;
  const int fd = connect_to(s.gateway.port);
  // 64 choices with 20 alternatives per token: an answer of ~8 MB, more than the sockets'
  // buffers on loopback take in (4 MiB sending, 128 KiB receiving before the reader reads).
  const std::string body = R"({"prompt":"In the beginning","max_tokens":240,"ignore_eos":true,"n":64,"logprobs":20})";
  send_all(fd, "POST /v1/completions HTTP/1.0\r\nAuthorization: Bearer sk-test\r\nContent-Length: " +
                   std::to_string(body.size()) + "\r\n\r\n" + body);
  // The answer's first byte: the whole answer is written now, then the connection lingers.
  std::string all;
  std::vector<char> tmp(1 << 16);
  auto n = ::recv(fd, tmp.data(), 1, 0);
  REQUIRE(n == 1);
  all.push_back(tmp[0]);
  std::this_thread::sleep_for(std::chrono::milliseconds{3000});
  while ((n = ::recv(fd, tmp.data(), tmp.size(), 0)) > 0) all.append(tmp.data(), static_cast<size_t>(n));
  ::close(fd);
  CHECK(n == 0);  // a close, not a reset
  const auto head_end = all.find("\r\n\r\n");
  REQUIRE(head_end != std::string::npos);
  const auto cl = all.find("Content-Length: ");
  REQUIRE(cl != std::string::npos);
  const size_t length = std::stoul(all.substr(cl + 16));
  CHECK_MESSAGE(length > (6u << 20), length);
  CHECK(all.size() - head_end - 4 == length);
  CHECK_MESSAGE(json::parse(all.substr(head_end + 4))["choices"].size() == 64, all.substr(0, 400));
}

namespace {

/// A client that reads a 12 MB stream at tens of kB a second, under `gc`: its call ends (499)
/// within 30 s, and a client that reads at once gets the whole stream under the same limits.
void slow_reader_is_cut(deploy::gateway_config gc) {
  gc.idle_timeout_ms = 600000;  // the idle limit (which also says 499) cannot be what ends it
  served_cluster s{gc};
  // 64 choices of 240 tokens with 20 alternatives each: 12 MB of events, made in seconds.
  const auto call = post("/v1/completions", R"({"prompt":"In the beginning","max_tokens":240,"ignore_eos":true,)"
                                            R"("stream":true,"n":64,"logprobs":20})");
  // The control: a client that reads at once gets the whole stream under the same limit.
  auto whole = round_trip(s.gateway.port, call);
  CHECK(whole.status == 200);
  CHECK(whole.body.find("data: [DONE]") != std::string::npos);
  CHECK(whole.body.size() > (8u << 20));
  const int fd = connect_to(s.gateway.port);
  int small = 4 * 1024;  // a window that crawls on loopback: tens of kB a second
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  send_all(fd, call);
  const auto cut = [&] {
    return round_trip(s.gateway.port, get("/metrics")).body.find(R"(baton_http_responses_total{route="/v1/completions",code="499"} 1)") !=
           std::string::npos;
  };
  bool ended = false;
  char c;
  for (int i = 0; i < 300 && !(ended = cut()); ++i) {  // bounded: 30 s
    (void)::recv(fd, &c, 1, MSG_DONTWAIT);            // it reads, a little
    std::this_thread::sleep_for(std::chrono::milliseconds{100});
  }
  ::close(fd);
  CHECK(ended);
  CHECK(s.settles());
}

}  // namespace

TEST_CASE("a stream whose client reads far slower than it is made ends (499) once its unsent events pass the "
          "limit, though the client reads (the idle limit never comes)") {
  deploy::gateway_config gc;
  gc.max_stream_backlog_bytes = 1 << 20;
  slow_reader_is_cut(gc);
}

TEST_CASE("slow readers are bounded together too: past the gateway's max_total_backlog_bytes, a stream with more "
          "than 1 MiB unread ends (499) though it is under its own limit") {
  deploy::gateway_config gc;  // its own limit, 32 MiB, is more than the whole stream
  gc.max_total_backlog_bytes = 4 << 20;
  slow_reader_is_cut(gc);
}

TEST_CASE("a request that expects 100-continue with a wrong key is answered 401 at once, and no body is invited") {
  served_cluster s;
  const int fd = connect_to(s.gateway.port);
  send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nContent-Length: 20\r\n"
               "Expect: 100-continue\r\n\r\n");
  std::string buf;
  const auto a = read_answer(fd, buf);
  ::close(fd);
  CHECK(a.status == 401);
  CHECK(buf.find("100 Continue") == std::string::npos);
}

TEST_CASE("OPTIONS says what a route allows; a browser's preflight from an allowed origin is answered with CORS "
          "headers, and that origin's answers carry Access-Control-Allow-Origin; other origins get none") {
  deploy::gateway_config gc;
  gc.cors_origins = {"https://app.example.com"};
  served_cluster s{gc};
  const uint16_t port = s.gateway.port;
  const auto preflight = [&](const std::string& origin, const std::string& headers = "authorization, content-type") {
    return round_trip(port, "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: " + origin +
                                "\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: " + headers +
                                "\r\n\r\n");
  };
  auto ok = preflight("https://app.example.com");
  CHECK(ok.status == 204);  // no key: a preflight carries none
  CHECK(ok.head.find("Allow: POST, OPTIONS") != std::string::npos);
  CHECK(ok.head.find("Access-Control-Allow-Origin: https://app.example.com") != std::string::npos);
  CHECK(ok.head.find("Access-Control-Allow-Headers: authorization, content-type") != std::string::npos);
  // An SDK's own headers are allowed as asked; what is no list of header names is not echoed.
  CHECK(preflight("https://app.example.com", "authorization, x-stainless-os")
            .head.find("Access-Control-Allow-Headers: authorization, x-stainless-os") != std::string::npos);
  CHECK(preflight("https://app.example.com", "a;b").head.find("Access-Control-Allow-Headers: Authorization, Content-Type") !=
        std::string::npos);
  CHECK(ok.head.find("Content-Length") == std::string::npos);  // RFC 9110: none on a 204
  auto other = preflight("https://evil.example.com");
  CHECK(other.status == 204);
  CHECK(other.head.find("Access-Control-Allow-Origin") == std::string::npos);
  // A call from the allowed origin: its answer (a stream's head too) names the origin.
  const std::string body = R"({"prompt":"a","max_tokens":2,"stream":true})";
  auto call = round_trip(port, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: https://app.example.com\r\n"
                               "Authorization: Bearer sk-test\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  CHECK(call.status == 200);
  CHECK(call.head.find("Access-Control-Allow-Origin: https://app.example.com") != std::string::npos);
  CHECK(call.head.find("Access-Control-Expose-Headers: Retry-After") != std::string::npos);
  const auto plain = round_trip(port, get("/v1/models"));  // no Origin: no CORS, but caches keep the two apart
  CHECK(plain.head.find("Access-Control-Allow-Origin") == std::string::npos);
  CHECK(plain.head.find("Vary: Origin") != std::string::npos);
  // A compressed body is refused as such, not read as broken JSON.
  auto gz = round_trip(port, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-test\r\n"
                             "Content-Encoding: gzip\r\nContent-Length: 3\r\n\r\n\x1f\x8b\x08");
  CHECK(gz.status == 415);
  CHECK_MESSAGE(gz.body.find("Content-Encoding gzip is not supported") != std::string::npos, gz.body);
  deploy::gateway_config bad;
  for (const std::string o : {"app.example.com", "https://app.example.com/", "https://App.example.com"}) {
    bad.cors_origins = {o};
    CHECK_MESSAGE(bad.validate().find("--cors-origin '" + o + "' is not an origin") != std::string::npos, o);
  }
}

TEST_CASE("--served-model-name NAME,ALIAS: calls may name the model by either and are answered under the name "
          "they gave; /v1/models lists both; another name is 404") {
  deploy::gateway_config gc;
  gc.served_model_name = "kjv,kjv-old";
  served_cluster s{gc};
  const uint16_t port = s.gateway.port;
  auto models = json::parse(round_trip(port, get("/v1/models")).body);
  REQUIRE(models["data"].size() == 2);
  CHECK(models["data"][0]["id"] == "kjv");
  CHECK(models["data"][1]["id"] == "kjv-old");
  const auto one = round_trip(port, get("/v1/models/kjv-old"));
  CHECK(one.status == 200);
  CHECK(json::parse(one.body)["id"] == "kjv-old");
  auto old = round_trip(port, post("/v1/completions", R"({"model":"kjv-old","prompt":"In","max_tokens":2})"));
  REQUIRE(old.status == 200);
  CHECK(json::parse(old.body)["model"] == "kjv-old");
  auto plain = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})"));
  REQUIRE(plain.status == 200);
  CHECK(json::parse(plain.body)["model"] == "kjv");
  CHECK(round_trip(port, post("/v1/completions", R"({"model":"kjv,kjv-old","prompt":"In"})")).status == 404);
  CHECK(round_trip(port, get("/v1/models/other")).status == 404);
}

TEST_CASE("a batch whose prompt the router refuses says which prompt of the batch it was (the router's sentence "
          "names only the token and its position)") {
  served_cluster s;
  const auto r = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":[[1,2],[5000]],"max_tokens":2})"));
  CHECK(r.status == 400);
  const auto err = json::parse(r.body)["error"];
  CHECK(err["param"] == "prompt");
  CHECK_MESSAGE(err["message"].get<std::string>().find("(in prompt 1 of the batch, counted from 0)") != std::string::npos,
                r.body);
}

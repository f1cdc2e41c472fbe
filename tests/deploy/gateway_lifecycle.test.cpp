// The gateway's life and its connections': draining, a router that goes away and comes back, a
// gateway stopped under a stream, connection slots held by idle sockets, and memory that
// connections and calls leave behind, over real sockets on 127.0.0.1.

#include <future>

#include <malloc.h>

#include <caf/event_based_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "tests/deploy/gateway_fixture.hpp"
#include "tests/deploy/metrics_text.hpp"

using namespace baton;
using namespace baton::test_gateway;
using nlohmann::json;

TEST_CASE("a draining gateway answers new calls and /health 503 (Retry-After, Connection: close) while the stream "
          "in progress runs to its [DONE]; the drain returns when it has ended") {
  served_cluster s{{}, 0, 40};  // every decode step 40 ms late: the stream runs about 1.5 s
  const int fd = connect_to(s.gateway.port);
  send_all(fd, post("/v1/completions", R"({"prompt":"In the beginning","max_tokens":40,"ignore_eos":true,"stream":true})"));
  const auto head = read_head(fd);  // the stream's head: its first token came
  CHECK(head.find("200 OK") != std::string::npos);
  auto drained = std::async(std::launch::async, [&] {
    return deploy::drain_gateway(s.sys, s.gateway, std::chrono::seconds{60});
  });
  http_answer h;
  for (int i = 0; i < 500 && (h = round_trip(s.gateway.port, get("/health", ""))).status != 503; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(h.status == 503);
  CHECK(h.head.find("Retry-After: 1") != std::string::npos);
  CHECK(h.head.find("Connection: close") != std::string::npos);
  const auto call = round_trip(s.gateway.port, post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}]})"));
  CHECK(call.status == 503);
  CHECK_MESSAGE(call.body.find("this gateway is shutting down") != std::string::npos, call.body);
  CHECK(round_trip(s.gateway.port, get("/v1/models")).status == 200);  // what needs no call still answers
  CHECK(drained.wait_for(std::chrono::milliseconds{0}) != std::future_status::ready);  // the stream runs on
  // The stream ends whole, and its connection closes after it.
  bool closed = false;
  const std::string rest = read_to_close(fd, head.substr(head.find("\r\n\r\n") + 4), &closed);
  CHECK(closed);  // by the gateway after the last chunk, not by recv's timeout
  ::close(fd);
  CHECK(rest.find("data: [DONE]") != std::string::npos);
  CHECK(rest.find("\"error\"") == std::string::npos);
  CHECK(drained.get() == 0);
}

TEST_CASE("a gateway whose router went away keeps its port and answers calls and /health 503 naming why, and "
          "serves again once given a router") {
  served_cluster s;
  deploy::gateway_router_lost(s.gateway, "the cluster's head went away for a test");
  http_answer h;
  for (int i = 0; i < 500 && (h = round_trip(s.gateway.port, get("/health", ""))).status != 503; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(h.status == 503);
  CHECK(h.body.find("the cluster's head went away for a test") != std::string::npos);
  const auto call = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"a","max_tokens":2})"));
  CHECK(call.status == 503);
  CHECK(call.head.find("Retry-After: 1") != std::string::npos);
  CHECK(call.body.find("went away for a test") != std::string::npos);
  std::string why;
  REQUIRE_MESSAGE(deploy::gateway_set_router(s.sys, s.gateway, s.cluster.router, &why), why);
  http_answer again;
  for (int i = 0; i < 500 && (again = round_trip(s.gateway.port, post("/v1/completions", R"({"prompt":"a","max_tokens":2})"))).status != 200; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(again.status == 200);
  CHECK(round_trip(s.gateway.port, get("/health", "")).status == 200);
}

TEST_CASE("a draining router refuses new requests as shutting_down (retryable) and lets the admitted ones finish") {
  served_cluster s{{}, 0, 20};
  generate_request req;
  req.prompt = "In the beginning";
  req.max_tokens = 30;
  req.ignore_eos = true;
  auto running = std::async(std::launch::async, [&] { return s.direct(req); });
  for (int i = 0; i < 2000 && s.stats().num_active == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE(s.stats().num_active == 1);
  caf::scoped_actor self{s.sys};
  self->send(s.cluster.router, drain_atom::value);
  std::string refused;
  self->request(s.cluster.router, std::chrono::seconds{30}, generate_atom::value, req)
      .receive([&](completion&) { refused = "answered"; },
               [&](caf::error& e) {
                 CHECK(e.category() == caf::atom("baton"));
                 CHECK(static_cast<errc>(e.code()) == errc::shutting_down);
                 CHECK(is_retryable(errc::shutting_down));
                 refused = e.context().get_as<std::string>(0);
               });
  CHECK_MESSAGE(refused.find("stage admission: the cluster's head is shutting down") != std::string::npos, refused);
  // A gateway of that router (one in its own process sees only the router) says so to probes.
  const auto h = round_trip(s.gateway.port, get("/health", ""));
  CHECK(h.status == 503);
  CHECK_MESSAGE(h.body.find("the cluster's head is shutting down") != std::string::npos, h.body);
  CHECK(running.get().tokens.size() == 30);
}

TEST_CASE("connections that come and go leave no memory behind: a timer a connection had pending when it closed, "
          "and the monitor it put on the gateway's server, each kept its storage for as long as the server ran; the "
          "server's timer of it, until it fired") {
  deploy::gateway_config gc;
  gc.api_keys = {"sk-test"};
  // The default idle limit: a connection's tick is 15 s away when it closes, and must not hold it.
  served_cluster s{gc};
  const uint16_t port = s.gateway.port;
  const auto heap = [] { return static_cast<int64_t>(mallinfo2().uordblks); };
  const auto connections = [&](int n) {
    for (int i = 0; i < n; ++i) REQUIRE(round_trip(port, get("/v1/models")).status == 200);  // a connection each
    // Every connection gone but the scrape's own, and past their last timer.
    const auto open = [&] { return test::value_of(round_trip(port, get("/metrics")).body, "baton_http_connections"); };
    for (int i = 0; i < 200 && open() > 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
    REQUIRE(open() == 1);
    std::this_thread::sleep_for(std::chrono::milliseconds{300});
  };
  connections(300);  // warm: pools, caches
  const auto before = heap();
  connections(3000);
  const auto grown = heap() - before;
  // At 1.5 KB a connection, the leak was 4.5 MB.
  CHECK_MESSAGE(grown < 1'000'000, "the heap grew by " << grown << " bytes");
}

TEST_CASE("with every connection slot held, a few more connections still answer /health and /metrics (load "
          "balancers' probes and scrapes), once each and nothing else; past those, 503 at once; idle ones go in 2 s") {
  deploy::gateway_config gc;
  gc.api_keys = {"sk-test"};
  gc.max_connections = 2;
  served_cluster s{gc};
  const uint16_t port = s.gateway.port;
  std::vector<int> held;
  const auto hold = [&] {
    held.push_back(connect_to(port));
    send_all(held.back(), get("/health"));  // answered: the connection is the gateway's, and stays open
    std::string buf;
    return read_answer(held.back(), buf).status;
  };
  CHECK(hold() == 200);
  CHECK(hold() == 200);
  // Past the two: a probe is answered, and its connection closed after it; a call is not.
  {
    const int fd = connect_to(port);
    send_all(fd, get("/health"));
    const auto all = read_to_close(fd);  // returns: the gateway closed it
    ::close(fd);
    CHECK(all.rfind("HTTP/1.1 200", 0) == 0);
    CHECK(all.find("Connection: close") != std::string::npos);
  }
  CHECK(round_trip(port, get("/metrics")).status == 200);
  auto call = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})"));
  CHECK(call.status == 503);
  CHECK(json::parse(call.body)["error"]["message"] ==
        "too many connections; retry later (this one may ask /health and /metrics only)");
  // Sixteen idle sockets take the probe slots: refused before a byte is read...
  std::vector<int> idle;
  for (int i = 0; i < 16; ++i) idle.push_back(connect_to(port));
  bool refused = false;
  for (int i = 0; i < 50 && !refused; ++i) refused = round_trip(port, get("/health")).status == 503;
  CHECK(refused);
  // ... but not for long: they are closed after 2 s, and probes are answered again.
  bool answered = false;
  for (int i = 0; i < 100 && !answered; ++i) {
    answered = round_trip(port, get("/health")).status == 200;
    if (!answered) std::this_thread::sleep_for(std::chrono::milliseconds{50});
  }
  CHECK(answered);
  for (int fd : idle) ::close(fd);
  for (int fd : held) ::close(fd);
  // Slots come back as the holders go.
  bool served = false;
  for (int i = 0; i < 100 && !served; ++i) {
    served = round_trip(port, post("/v1/completions", R"({"prompt":"In","max_tokens":2})")).status == 200;
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds{20});
  }
  CHECK(served);
}

TEST_CASE("a gateway stopped under a stream still closes that connection after its lingering close, though the "
          "client neither reads to the end nor closes: the connection's timers do not go with the server") {
  served_cluster s{{}, 0, 40};  // every decode step 40 ms late: the stream outlasts the stop
  const int fd = connect_to(s.gateway.port);
  send_all(fd, post("/v1/completions", R"({"prompt":"In the beginning","max_tokens":100,"ignore_eos":true,"stream":true})"));
  const auto head = read_head(fd);
  REQUIRE(head.find("200 OK") != std::string::npos);
  caf::scoped_actor{s.sys}->send_exit(s.gateway.server, caf::exit_reason::user_shutdown);
  bool closed = false;
  const auto rest = read_to_close(fd, {}, &closed);  // the 503 event, then the gateway's half-close
  CHECK(closed);
  CHECK(rest.find("this gateway stopped before the answer was done") != std::string::npos);
  // Lingering, the gateway reads and drops what the client sends; once the linger (2 s) ends it
  // closes for good, and what the client sends then is refused (a reset).
  bool reset = false;
  for (int i = 0; i < 40 && !reset; ++i) {  // bounded: 10 s
    std::this_thread::sleep_for(std::chrono::milliseconds{250});
    reset = ::send(fd, "x", 1, MSG_NOSIGNAL) < 0;
  }
  ::close(fd);
  CHECK(reset);
}

TEST_CASE("a gateway whose router stops answering (a stalled head, a link that stays open) answers new calls 503 "
          "at once, saying so, and serves again when it answers") {
  deploy::gateway_config gc;
  gc.router_silence_ms = 400;
  served_cluster s{gc};
  // A router that answers only while `answering`; its unanswered requests are held, not dropped.
  auto answering = std::make_shared<std::atomic<bool>>(true);
  auto held = std::make_shared<std::vector<caf::typed_response_promise<bool>>>();
  auto stalling = s.sys.spawn([=](router_actor::pointer self) -> router_actor::behavior_type {
    return {
        [=](generate_atom, generate_request&) -> caf::result<completion> { return completion{}; },
        [=](generate_atom, generate_request&, client_sink_actor&) -> caf::result<completion> {
          completion c;
          c.finish_reason = "length";
          return c;
        },
        [](stats_atom) { return cluster_stats{}; },
        [](tokenize_atom, generate_request&) { return std::vector<int32_t>{}; },
        [](detokenize_atom, std::vector<int32_t>&) { return std::string{}; },
        [=](ping_atom) {
          auto p = self->make_response_promise<bool>();
          if (*answering) p.deliver(true);
          else held->push_back(p);
          return p;
        },
        [](drain_atom) {},
        [](rank_gone_atom, std::vector<std::string>&, std::string&) {},
        [](directory_atom, node_stats_actor&) {},
    };
  });
  std::string why;
  REQUIRE_MESSAGE(deploy::gateway_set_router(s.sys, s.gateway, stalling, &why), why);
  const std::string body = R"({"prompt":"a","max_tokens":2})";
  http_answer call;
  for (int i = 0; i < 500 && (call = round_trip(s.gateway.port, post("/v1/completions", body))).status != 200; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  REQUIRE(call.status == 200);
  *answering = false;
  for (int i = 0; i < 1000 && (call = round_trip(s.gateway.port, post("/v1/completions", body))).status != 503; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  CHECK(call.status == 503);
  CHECK_MESSAGE(call.body.find("the cluster's head has not answered for 400 ms") != std::string::npos, call.body);
  CHECK(call.head.find("Retry-After") != std::string::npos);
  *answering = true;
  for (int i = 0; i < 1000 && (call = round_trip(s.gateway.port, post("/v1/completions", body))).status != 200; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  CHECK(call.status == 200);
  caf::anon_send_exit(stalling, caf::exit_reason::user_shutdown);
}

TEST_CASE("a drain waits for a /tokenize call whose answer is still on its way from the router, and the call "
          "gets it") {
  served_cluster s;
  // A router whose tokenizer answers only when told: the call is in flight until then. Its
  // tokenizer is a plain actor holding the asks (get: how many; put: answer them).
  auto tokenizer = s.sys.spawn([](caf::event_based_actor* self) -> caf::behavior {
    auto held = std::make_shared<std::vector<caf::response_promise>>();
    return {
        [=](tokenize_atom) {
          held->push_back(self->make_response_promise());
          return held->back();
        },
        [=](caf::get_atom) { return static_cast<uint32_t>(held->size()); },
        [=](caf::put_atom) {
          for (auto& p : *held) p.deliver(std::vector<int32_t>{1, 2, 3});
          held->clear();
        },
    };
  });
  auto slow = s.sys.spawn([=](router_actor::pointer self) -> router_actor::behavior_type {
    return {
        [=](generate_atom, generate_request&) -> caf::result<completion> { return completion{}; },
        [=](generate_atom, generate_request&, client_sink_actor&) -> caf::result<completion> { return completion{}; },
        [](stats_atom) { return cluster_stats{}; },
        [=](tokenize_atom, generate_request&) {
          auto p = self->make_response_promise<std::vector<int32_t>>();
          self->request(tokenizer, caf::infinite, tokenize_atom::value)
              .then([=](std::vector<int32_t>& ids) mutable { p.deliver(std::move(ids)); });
          return p;
        },
        [](detokenize_atom, std::vector<int32_t>&) { return std::string{}; },
        [](ping_atom) { return true; },
        [](drain_atom) {},
        [](rank_gone_atom, std::vector<std::string>&, std::string&) {},
        [](directory_atom, node_stats_actor&) {},
    };
  });
  std::string why;
  REQUIRE_MESSAGE(deploy::gateway_set_router(s.sys, s.gateway, slow, &why), why);
  const int fd = connect_to(s.gateway.port);
  send_all(fd, post("/tokenize", R"({"prompt":"In the beginning"})"));
  caf::scoped_actor self{s.sys};
  uint32_t asked = 0;
  for (int i = 0; i < 1000 && asked == 0; ++i) {
    self->request(tokenizer, std::chrono::seconds{5}, caf::get_atom::value)
        .receive([&](uint32_t n) { asked = n; }, [](caf::error&) {});
    if (asked == 0) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  REQUIRE(asked == 1);
  // The gateway's drain asks how many calls still run (drain_gateway repeats it until none).
  auto in_flight = [&] {
    uint32_t n = 99;
    self->request(s.gateway.server, std::chrono::seconds{5}, drain_atom::value)
        .receive([&](uint32_t x) { n = x; }, [](caf::error&) {});
    return n;
  };
  CHECK(in_flight() == 1);
  self->send(tokenizer, caf::put_atom::value);
  bool closed = false;
  const std::string answer = read_to_close(fd, "", &closed);  // draining: the answer ends the connection
  ::close(fd);
  CHECK(closed);
  CHECK_MESSAGE(answer.find("200 OK") != std::string::npos, answer);
  CHECK_MESSAGE(answer.find("\"tokens\":[1,2,3]") != std::string::npos, answer);
  CHECK(in_flight() == 0);
  caf::anon_send_exit(slow, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(tokenizer, caf::exit_reason::user_shutdown);
}

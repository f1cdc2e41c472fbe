// The C++ client library (client/baton/client.hpp) against a served cluster or a stand-in
// router on 127.0.0.1: streaming and cancelling, how a stream fails (the request's actor or the
// router gone), what a result says of its failovers, and a port that is not a router's.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <caf/event_based_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/node_directory.hpp"
#include "tests/deploy/gateway_fixture.hpp"
#include "tests/test_util.hpp"

using namespace baton;
using namespace baton::test_gateway;

TEST_CASE("the C++ client library streams a request's tokens and can cancel it") {
  served_cluster s{{}, 0, 5};  // decode steps 5 ms late: the cancel below lands mid-stream on a stalled machine too
  caf::scoped_actor self{s.sys};
  auto port = s.sys.middleman().publish(s.cluster.router, 0, "127.0.0.1", true);
  REQUIRE(port);
  std::string why;
  auto conn = baton::client::connection::connect("127.0.0.1", *port, &why);
  REQUIRE_MESSAGE(conn, why);
  std::string model;
  uint32_t context = 0;
  REQUIRE(conn->model_info(&model, &context, &why));
  CHECK(model == s.stats().model);
  CHECK(context == 256);

  generate_request ref_req;
  ref_req.prompt = "Disaggregated serving";
  ref_req.max_tokens = 10;
  ref_req.ignore_eos = true;
  const auto ref = s.direct(ref_req);
  baton::client::request req;
  req.prompt = ref_req.prompt;
  req.max_tokens = 10;
  req.ignore_eos = true;
  auto stream = conn->submit(req);
  baton::client::token_chunk c;
  std::vector<int32_t> tokens;
  std::string text;
  uint32_t chunks = 0;
  while (stream->next(&c, std::chrono::seconds{60})) {
    CHECK(c.first_index == tokens.size());
    tokens.insert(tokens.end(), c.tokens.begin(), c.tokens.end());
    text += c.text;
    ++chunks;
  }
  REQUIRE_FALSE_MESSAGE(stream->failed(), stream->error_info().code << ": " << stream->error_info().message);
  CHECK(tokens == ref.tokens);
  CHECK(text == ref.text);
  // One chunk per token (the first from prefill, then one per decode step) as it is made, and
  // the last, which only says why it ended.
  CHECK(chunks == 11);
  CHECK(stream->final_result().tokens == ref.tokens);
  CHECK(c.finish_reason == "length");

  // Log-probabilities come with their chunks, one per token.
  req.logprobs = true;
  req.top_logprobs = 1;
  auto scored = conn->submit(req);
  std::vector<baton::client::token_logprob> lps;
  while (scored->next(&c, std::chrono::seconds{60})) {
    CHECK(c.logprobs.size() == c.tokens.size());
    lps.insert(lps.end(), c.logprobs.begin(), c.logprobs.end());
  }
  REQUIRE(lps.size() == ref.tokens.size());
  for (size_t i = 0; i < lps.size(); ++i) {
    CHECK(lps[i].token == ref.tokens[i]);
    CHECK(lps[i].top_tokens == std::vector<int32_t>{ref.tokens[i]});  // greedy
  }
  req.logprobs = false;
  req.top_logprobs = 0;

  // Prompt scoring: the prompt's tokens' log-probabilities in the result, the first NaN.
  req.prompt_logprobs = true;
  auto prompt_scored = conn->submit(req);
  while (prompt_scored->next(&c, std::chrono::seconds{60})) {
  }
  REQUIRE_FALSE(prompt_scored->failed());
  const auto& pl = prompt_scored->final_result().prompt_logprobs;
  REQUIRE(pl.size() == prompt_scored->final_result().num_prompt_tokens);
  CHECK(std::isnan(pl[0].logprob));
  for (size_t i = 1; i < pl.size(); ++i) CHECK(pl[i].logprob <= 0.0f);
  CHECK(prompt_scored->final_result().tokens == ref.tokens);
  req.prompt_logprobs = false;

  // Bad input comes back as an error naming the field.
  req.max_tokens = -1;
  auto bad = conn->submit(req);
  while (bad->next(&c, std::chrono::seconds{30})) {
  }
  REQUIRE(bad->failed());
  CHECK(bad->error_info().code == "bad_request");
  CHECK(bad->error_info().message.find("max_tokens") != std::string::npos);

  // Cancel after the first chunk: the stream ends as cancelled, the cluster frees everything.
  req.max_tokens = 200;
  auto long_one = conn->submit(req);
  REQUIRE(long_one->next(&c, std::chrono::seconds{60}));
  long_one->cancel();
  while (long_one->next(&c, std::chrono::seconds{5})) {
  }
  CHECK(long_one->failed());
  CHECK(long_one->error_info().code == "cancelled");
  CHECK(s.settles());
}

namespace {

/// Cuts the links to this process's TCP port `port` as a network would: shuts down the server
/// end of each established connection (found in /proc/self/net/tcp, its socket among our fds).
/// Returns how many it cut.
int shut_down_connections_to(uint16_t port) {
  std::set<std::string> inodes;
  std::ifstream tcp{"/proc/self/net/tcp"};
  std::string line;
  std::getline(tcp, line);  // the header
  char local[64], state[8];
  while (std::getline(tcp, line)) {
    unsigned long inode = 0;
    // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
    if (std::sscanf(line.c_str(), "%*s %63s %*s %7s %*s %*s %*s %*s %*s %lu", local, state, &inode) != 3) continue;
    const char* colon = std::strchr(local, ':');
    if (colon && std::strtoul(colon + 1, nullptr, 16) == port && std::string{state} == "01")  // established
      inodes.insert("socket:[" + std::to_string(inode) + "]");
  }
  int cut = 0;
  for (const auto& entry : std::filesystem::directory_iterator{"/proc/self/fd"}) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (!ec && inodes.count(target) && ::shutdown(std::stoi(entry.path().filename().string()), SHUT_RDWR) == 0) ++cut;
  }
  return cut;
}

/// A C++ client connected to `router` (a stand-in), published on a port of 127.0.0.1.
std::unique_ptr<baton::client::connection> client_of(caf::actor_system& sys, const router_actor& router) {
  auto port = sys.middleman().publish(router, 0, "127.0.0.1", true);
  REQUIRE(port);
  std::string why;
  auto conn = baton::client::connection::connect("127.0.0.1", *port, &why);
  REQUIRE_MESSAGE(conn, why);
  return conn;
}

/// A router stand-in: `generate` answers the streamed request (the sink's); the rest are inert.
template <class Generate>
router_actor stand_in_router(caf::actor_system& sys, Generate generate) {
  return sys.spawn([generate](router_actor::pointer self) -> router_actor::behavior_type {
    return {
        [](generate_atom, generate_request&) -> caf::result<completion> { return completion{}; },
        [self, generate](generate_atom, generate_request&, client_sink_actor sink) -> caf::result<completion> {
          return generate(self, std::move(sink));
        },
        [](stats_atom) { return cluster_stats{}; },
        [](tokenize_atom, generate_request&) { return std::vector<int32_t>{}; },
        [](detokenize_atom, std::vector<int32_t>&) { return std::string{}; },
        [](ping_atom) { return true; },
        [](drain_atom) {},
        [](rank_gone_atom, std::vector<std::string>&, std::string&) {},
        [](directory_atom, node_stats_actor&) {},
    };
  });
}

}  // namespace

TEST_CASE("the C++ client's stream fails (rank_unavailable, naming who went) when the request's actor ends "
          "without an answer, instead of waiting out the reader's timeout") {
  caf::actor_system_config cfg;
  caf::actor_system sys{served_cluster::init(cfg)};  // no cluster: its actor system alone
  // A router stand-in whose request actor streams one chunk and then fails; the promise of the
  // answer is kept and never kept, as CAF 0.17 may leave a request whose actor went.
  auto promises = std::make_shared<std::vector<caf::response_promise>>();
  auto router = stand_in_router(sys, [promises](router_actor::pointer self, client_sink_actor sink) -> caf::result<completion> {
    auto rp = self->make_response_promise<completion>();
    promises->push_back(rp);
    self->spawn([sink](caf::event_based_actor* req) {
      stream_chunk c;
      c.request_id = 1;
      c.tokens = {7};
      c.text = "x";
      req->send(sink, std::move(c));
      req->quit(caf::exit_reason::user_shutdown);
    });
    return rp;
  });
  auto conn = client_of(sys, router);
  auto stream = conn->submit(baton::client::request{});
  baton::client::token_chunk c;
  REQUIRE(stream->next(&c, std::chrono::seconds{60}));
  CHECK(c.text == "x");
  CHECK_FALSE(stream->next(&c, std::chrono::seconds{60}));  // the grace is 5 s
  CHECK_FALSE(stream->timed_out());
  REQUIRE(stream->failed());
  CHECK(stream->error_info().code == "rank_unavailable");
  CHECK(stream->error_info().message.find("the request's actor ended before the answer") == 0);
  conn.reset();
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
}

TEST_CASE("the C++ client's stream says router_gone when the router itself ends without an answer: a caller "
          "(baton generate) stops sending instead of waiting out the grace once per prompt") {
  caf::actor_system_config cfg;
  caf::actor_system sys{served_cluster::init(cfg)};
  // A router stand-in that takes the request and then ends, answering nothing.
  auto router = stand_in_router(sys, [](router_actor::pointer self, client_sink_actor) -> caf::result<completion> {
    self->quit(caf::exit_reason::user_shutdown);
    return self->make_response_promise<completion>();
  });
  auto conn = client_of(sys, router);
  auto stream = conn->submit(baton::client::request{});
  baton::client::token_chunk c;
  CHECK_FALSE(stream->next(&c, std::chrono::seconds{60}));  // the grace is 5 s
  REQUIRE(stream->failed());
  CHECK(stream->error_info().code == "router_gone");
  CHECK_MESSAGE(stream->error_info().message.find("the router ended before the answer") == 0, stream->error_info().message);
}

TEST_CASE("the C++ client hears at once that the link to its router's process was lost: streams in flight and "
          "every later submit fail with router_gone (not a retryable rank failure after a grace), and connected() "
          "says so") {
  caf::actor_system_config cfg;
  caf::actor_system sys{served_cluster::init(cfg)};  // no cluster: its actor system alone
  // A router stand-in whose request actor streams a chunk and then waits, as would a live cluster.
  auto promises = std::make_shared<std::vector<caf::response_promise>>();
  auto requests = std::make_shared<std::vector<caf::actor>>();
  auto router = stand_in_router(sys, [promises, requests](router_actor::pointer self, client_sink_actor sink) -> caf::result<completion> {
    promises->push_back(self->make_response_promise<completion>());
    requests->push_back(self->spawn([sink](caf::event_based_actor* req) -> caf::behavior {
      stream_chunk c;
      c.request_id = 1;
      c.tokens = {7};
      c.text = "x";
      req->send(sink, std::move(c));
      return {[](int32_t) {}};
    }));
    return promises->back();
  });
  auto port = sys.middleman().publish(router, 0, "127.0.0.1", true);
  REQUIRE(port);
  std::string why;
  auto conn = baton::client::connection::connect("127.0.0.1", *port, &why);
  REQUIRE_MESSAGE(conn, why);
  CHECK(conn->connected());
  auto stream = conn->submit(baton::client::request{});
  baton::client::token_chunk c;
  REQUIRE(stream->next(&c, std::chrono::seconds{60}));
  // The link goes: the router's end of every connection to its port is shut down.
  REQUIRE(shut_down_connections_to(*port) > 0);
  CHECK_FALSE(stream->next(&c, std::chrono::seconds{60}));
  REQUIRE(stream->failed());
  CHECK(stream->error_info().code == "router_gone");
  CHECK_MESSAGE(stream->error_info().message == "the connection to the router was lost before the answer",
                stream->error_info().message);
  for (int i = 0; i < 5000 && conn->connected(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE_FALSE(conn->connected());
  std::string model;
  uint32_t context = 0;
  CHECK_FALSE(conn->model_info(&model, &context, &why));  // at once, not after its 10 s wait
  CHECK_MESSAGE(why.find("was lost: connect again") != std::string::npos, why);
  auto later = conn->submit(baton::client::request{});
  CHECK(later->done());  // at once, before any wait
  REQUIRE(later->failed());
  CHECK(later->error_info().code == "router_gone");
  CHECK_MESSAGE(later->error_info().message.find("the connection to the router at 127.0.0.1:") == 0, later->error_info().message);
  CHECK_MESSAGE(later->error_info().message.find("was lost: connect again") != std::string::npos, later->error_info().message);
  conn.reset();
  for (auto& r : *requests) caf::anon_send_exit(r, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
}

TEST_CASE("destroying a C++ client connection cancels its streams still going: a reader blocked on one wakes with "
          "cancelled instead of the destructor waiting for an answer that may never come") {
  caf::actor_system_config cfg;
  caf::actor_system sys{served_cluster::init(cfg)};
  // A router stand-in that takes the request and never answers (a frozen cluster).
  auto promises = std::make_shared<std::vector<caf::response_promise>>();
  auto router = stand_in_router(sys, [promises](router_actor::pointer self, client_sink_actor) -> caf::result<completion> {
    promises->push_back(self->make_response_promise<completion>());
    return promises->back();
  });
  auto conn = client_of(sys, router);
  auto stream = conn->submit(baton::client::request{});
  bool got = true;
  std::thread reader{[&] {
    baton::client::token_chunk c;
    got = stream->next(&c, std::chrono::seconds{120});
  }};
  conn.reset();  // before the fix: blocked until the answer, here never
  reader.join();
  CHECK_FALSE(got);
  CHECK_FALSE(stream->timed_out());
  REQUIRE(stream->failed());
  CHECK(stream->error_info().code == "cancelled");
  CHECK(stream->error_info().message == "the connection was closed before the answer");
  stream.reset();  // after its connection: it holds nothing of the client's actor system
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
}

TEST_CASE("the C++ client refuses TLS files it cannot read at once, naming the file, and takes a null why") {
  baton::client::connect_options o;
  o.tls_cert = "/nonexistent/client.pem";
  o.tls_key = o.tls_ca = __FILE__;  // files that exist
  std::string why;
  CHECK_FALSE(baton::client::connection::connect("127.0.0.1", 1, o, &why));
  CHECK(why == "tls_cert: cannot read /nonexistent/client.pem (No such file or directory)");
  CHECK_FALSE(baton::client::connection::connect("127.0.0.1", 1, o, nullptr));
  o.tls_cert = "/tmp";  // a directory opens, but is no certificate
  CHECK_FALSE(baton::client::connection::connect("127.0.0.1", 1, o, &why));
  CHECK(why == "tls_cert: cannot read /tmp (not a file)");
  o.tls_cert = __FILE__;  // a file, but no certificate
  CHECK_FALSE(baton::client::connection::connect("127.0.0.1", 1, o, &why));
  CHECK(why == std::string{"tls_cert: "} + __FILE__ + " holds no PEM certificate");
}

TEST_CASE("the C++ client's result carries how the request got through: its failovers, the last failure that "
          "re-placed it, and its decode moves") {
  caf::actor_system_config cfg;
  caf::actor_system sys{served_cluster::init(cfg)};  // no cluster: its actor system alone
  // A router stand-in answering with a completion that went through two failovers and a move.
  auto router = stand_in_router(sys, [](router_actor::pointer, client_sink_actor) -> caf::result<completion> {
    completion c;
    c.request_id = 1;
    c.tokens = {7};
    c.text = "x";
    c.finish_reason = "length";
    c.failovers = 2;
    c.failover_why = "request 1, rank decode-0, stage decode: the actor is down";
    c.migrations = 1;
    return c;
  });
  auto conn = client_of(sys, router);
  auto stream = conn->submit(baton::client::request{});
  baton::client::token_chunk c;
  while (stream->next(&c, std::chrono::seconds{60})) {
  }
  REQUIRE_FALSE(stream->failed());
  const auto& r = stream->final_result();
  CHECK(r.text == "x");
  CHECK(r.failovers == 2);
  CHECK(r.failover_why == "request 1, rank decode-0, stage decode: the actor is down");
  CHECK(r.migrations == 1);
  conn.reset();
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
}

TEST_CASE("the C++ client's connect waits connect_timeout_ms for a port that never answers, then says so") {
  // A TCP port that takes connections and says nothing (another kind of server, a stuck one).
  test::loopback_socket silent;
  REQUIRE(silent.listen());
  baton::client::connect_options o;
  o.connect_timeout_ms = 300;
  std::string why;
  CHECK_FALSE(baton::client::connection::connect("127.0.0.1", silent.port, o, &why));
  CHECK_MESSAGE(why.find("within 300 ms") != std::string::npos, why);
  o.connect_timeout_ms = 0;
  CHECK_FALSE(baton::client::connection::connect("127.0.0.1", silent.port, o, &why));
  CHECK(why == "connect_timeout_ms must be >= 1");
  // A port whose listen queue is full drops new connections' packets (as a firewall would): the
  // kernel would retry for minutes; the connect gives up within its time.
  test::loopback_socket full;
  REQUIRE(full.listen(0));
  std::vector<int> queued;
  for (int i = 0; i < 8; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(full.port);
    ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    queued.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds{100});
  o.connect_timeout_ms = 300;
  CHECK_FALSE(baton::client::connection::connect("127.0.0.1", full.port, o, &why));
  // (Where the kernel queues it after all, the handshake's wait says the same time.)
  CHECK_MESSAGE(why.find("within 300 ms") != std::string::npos, why);
  for (int fd : queued) ::close(fd);
}

TEST_CASE("the C++ client pointed at another Baton port (a node directory's) says so in a sentence, not CAF's "
          "screenful of both interfaces") {
  caf::actor_system_config cfg;
  caf::actor_system sys{served_cluster::init(cfg)};  // no cluster: its actor system alone
  auto directory = spawn_node_directory(sys, {}, cluster_welcome{});
  auto port = sys.middleman().publish(directory, 0, "127.0.0.1", true);
  REQUIRE(port);
  std::string why;
  auto conn = baton::client::connection::connect("127.0.0.1", *port, &why);
  CHECK_FALSE(conn);
  CHECK_MESSAGE(why.find("another Baton actor listens there, not the one asked for") != std::string::npos, why);
  CHECK_MESSAGE(why.size() < 400, why);
  caf::anon_send_exit(directory, caf::exit_reason::user_shutdown);
}

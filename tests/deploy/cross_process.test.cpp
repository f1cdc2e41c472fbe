// Disaggregation across processes: prefill rank here, decode rank in a `baton node` process,
// joined through CAF's network layer, KV over UCX -- shared memory, then TCP on 127.0.0.1; and
// elastic ranks in a node process, moved between the roles by the head's controller; and the
// wire form of the messages' floats.

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <caf/io/middleman.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/node_agent.hpp"
#include "actors/node_directory.hpp"
#include "deploy/expert_processes.hpp"
#include "deploy/processes.hpp"
#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "tests/actors/elastic_phases.hpp"
#include "tests/deploy/directory_fixture.hpp"
#include "tests/test_util.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

using namespace baton;
using namespace baton::test;

namespace {

/// Stops the test's node processes, then the in-process cluster's actors.
struct cluster_guard {
  std::vector<pid_t>& pids;
  caf::scoped_actor& self;
  local_cluster& c;
  ~cluster_guard() {
    deploy::stop_processes(pids);
    for (auto& a : c.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
  }
};

/// Asks the router for `prompt` (8 tokens, logits returned) and waits for the answer.
caf::expected<completion> ask(caf::scoped_actor& self, const router_actor& router, const std::string& prompt) {
  generate_request req;
  req.prompt = prompt;
  req.max_tokens = 8;
  req.return_logits = true;
  caf::expected<completion> got{caf::error{}};
  self->request(router, std::chrono::seconds{60}, generate_atom::value, req)
      .receive([&](completion& c) { got = std::move(c); }, [&](caf::error& e) { got = std::move(e); });
  return got;
}

/// `wire`: the KV's form on the wire (every traffic class); the reference is then the colocated
/// run with the prompt's KV through that form.
void run_across_processes(const char* ucx_tls, bool with_store = false,
                          transport::wire_format wire = transport::wire_format::f32) {
  // UCX reads its configuration from the environment, in this process and in the child.
  setenv("UCX_TLS", ucx_tls, 1);
  network_system n;
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 0;
  cfg.transport = "ucx";
  cfg.prefill.chunk_tokens = 16;
  cfg.executor.num_kv_pages = 64;
  cfg.router.request.kv_wire.chat = cfg.router.request.kv_wire.agent = cfg.router.request.kv_wire.batch = wire;
  const std::string store_dir = "/tmp/baton-cross-store-" + std::to_string(::getpid());
  if (with_store) {  // block servers here; the remote decode rank writes back to them over UCX
    std::filesystem::remove_all(store_dir);
    cfg.store.enabled = true;
    cfg.store.dir = store_dir;
    cfg.store.block_tokens = 16;
    cfg.prefill.prefix_cache_blocks = 0;  // prefixes must come from the store, not this rank's pages
  }
  auto cluster = start_local_cluster(n.sys, cfg);
  caf::scoped_actor self{n.sys};
  auto port = n.sys.middleman().publish(cluster.directory, 0, "127.0.0.1", true);
  REQUIRE(port);
  std::vector<pid_t> children;
  cluster_guard g{children, self, cluster};
  std::string why;
  auto pid = deploy::spawn_process({BATON_BINARY, "node", "--role", "decode", "--name", "decode-remote", "--model", "random", "--connect",
                                    "127.0.0.1:" + std::to_string(*port), "--kv-pages", "64", "--weights-seed",
                                    std::to_string(cfg.weights_seed)},
                                   &why);
  REQUIRE_MESSAGE(pid > 0, why);
  children.push_back(pid);
  size_t joined = 0;
  for (int i = 0; i < 300 && joined == 0; ++i) {
    REQUIRE_MESSAGE(deploy::process_alive(pid), "the decode node exited before joining (its stderr says why)");
    self->request(cluster.decode_balancer, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](std::vector<rank_load>& loads) { joined = loads.size(); }, [](caf::error&) {});
    if (joined == 0) std::this_thread::sleep_for(std::chrono::milliseconds{50});
  }
  REQUIRE(joined == 1);

  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  const gpu::byte_tokenizer tok{cfg.model.bos_token_id, cfg.model.eos_token_id};
  for (const std::string prompt : {"across two processes", "a prompt long enough for three chunks of sixteen tokens"}) {
    auto got = ask(self, cluster.router, prompt);
    REQUIRE_MESSAGE(got, n.sys.render(got.error()));
    CHECK(got->decode_rank == "decode-remote");
    auto ref = gpu::generate_colocated(*exec, tok.encode(prompt), 8, cfg.prefill.chunk_tokens, {}, false,
                                       wire == transport::wire_format::f32 ? gpu::after_prefill_fn{}
                                                                           : test::wire_round_trip(wire));
    CHECK(got->tokens == ref.tokens);
    CHECK(test::same_bits(got->step_logits, ref.step_logits));
    if (wire != transport::wire_format::f32) {  // and the wire form did change the decode steps
      auto plain = gpu::generate_colocated(*exec, tok.encode(prompt), 8, cfg.prefill.chunk_tokens);
      CHECK_FALSE(test::same_bits(got->step_logits, plain.step_logits));
    }
  }
  if (!with_store) return;
  // The remote decode rank wrote the long prompt's blocks back across processes; wait for them,
  // then the same prompt loads its prefix from the store and still gives the same output.
  const std::string prompt = "a prompt long enough for three chunks of sixteen tokens";  // 57 tokens
  for (int i = 0; i < 500; ++i) {
    store_stats s;
    self->request(cluster.store_index[0], std::chrono::seconds{5}, stats_atom::value)
        .receive([&](store_stats& x) { s = x; }, [](caf::error&) {});
    if (s.blocks >= 5) break;  // 1 block of the short prompt + 4 of the long one
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  auto got = ask(self, cluster.router, prompt);
  REQUIRE_MESSAGE(got, n.sys.render(got.error()));
  CHECK(got->cached_tokens == 48);
  auto ref = gpu::generate_colocated(*exec, tok.encode(prompt), 8, cfg.prefill.chunk_tokens);
  CHECK(got->tokens == ref.tokens);
  CHECK(test::same_bits(got->step_logits, ref.step_logits));
  std::filesystem::remove_all(store_dir);
}

}  // namespace

TEST_CASE("tcp_listening answers true only while something listens on the port") {
  baton::test::loopback_socket s;
  REQUIRE(s.fd >= 0);
  const uint16_t port = s.port;
  CHECK_FALSE(baton::deploy::tcp_listening("127.0.0.1", port, 200));  // bound, not listening: refused
  REQUIRE(s.listen());
  CHECK(baton::deploy::tcp_listening("127.0.0.1", port, 200));
  CHECK(baton::deploy::tcp_listening("localhost", port, 200));
  s.close();
  CHECK_FALSE(baton::deploy::tcp_listening("127.0.0.1", port, 200));
  CHECK_FALSE(baton::deploy::tcp_listening("no-such-host.invalid", port, 200));
}

TEST_CASE("across processes over UCX shared memory: tokens and logits equal the colocated run") {
  run_across_processes("sm");
}

TEST_CASE("across processes over UCX TCP on 127.0.0.1: tokens and logits equal the colocated run") {
  run_across_processes("tcp");
}

TEST_CASE("across processes with KV in INT8 and INT4 on the wire (UCX shared memory, then TCP on 127.0.0.1): "
          "tokens and logits equal the colocated run whose prompt KV went through the same form") {
  run_across_processes("sm", false, transport::wire_format::int8);
  run_across_processes("tcp", false, transport::wire_format::int4);
}

TEST_CASE("across processes with the block store: a remote decode rank writes blocks back over UCX, the "
          "next request loads them, same tokens and logits") {
  run_across_processes("sm", true);
}

TEST_CASE("elastic ranks in a node process (baton node --role elastic): the head's controller moves them between "
          "prefill and decode as the load shifts, moved decode sequences keep their KV, and the tokens are a "
          "static run's") {
  setenv("UCX_TLS", "sm", 1);
  network_system n;
  // Fixed prefill-0 and decode-0 here; elastic-0 (prefill) and elastic-1 (decode) in the node.
  // Targets that make the load phases unambiguous, as the in-process elastic test's.
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.elastic_nodes = true;
  cfg.transport = "ucx";
  cfg.executor.num_kv_pages = 1024;
  cfg.prefill.chunk_tokens = 32;
  test::eager_elastic_planner(&cfg.elastic);
  REQUIRE(cfg.validate().empty());
  auto cluster = start_local_cluster(n.sys, cfg);
  caf::scoped_actor self{n.sys};
  REQUIRE(cluster.elastic_controller);
  auto port = n.sys.middleman().publish(cluster.directory, 0, "127.0.0.1", true);
  REQUIRE(port);
  std::vector<pid_t> children;
  cluster_guard g{children, self, cluster};
  std::string why;
  auto pid = deploy::spawn_process({BATON_BINARY, "node", "--role", "elastic", "--name", "elastic", "--model", "random", "--ranks", "2",
                                    "--prefill-at-start", "1", "--connect", "127.0.0.1:" + std::to_string(*port),
                                    "--kv-pages", "1024", "--chunk-tokens", "32", "--weights-seed",
                                    std::to_string(cfg.weights_seed)},
                                   &why);
  REQUIRE_MESSAGE(pid > 0, why);
  children.push_back(pid);
  auto registered = [&](auto balancer) {
    size_t k = 0;
    self->request(balancer, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](std::vector<rank_load>& l) { k = l.size(); }, [](caf::error&) {});
    return k;
  };
  for (int i = 0; i < 300 && (registered(cluster.prefill_balancer) < 2 || registered(cluster.decode_balancer) < 2); ++i) {
    REQUIRE_MESSAGE(deploy::process_alive(pid), "the elastic node exited before joining (its stderr says why)");
    std::this_thread::sleep_for(std::chrono::milliseconds{50});
  }
  REQUIRE(registered(cluster.prefill_balancer) == 2);  // prefill-0 and elastic-0
  REQUIRE(registered(cluster.decode_balancer) == 2);   // decode-0 and elastic-1
  const auto got = test::run_elastic_phases(n.sys, self, cluster.router, cluster.elastic_controller, cfg, "elastic-1");
  // The migrations counted there crossed processes: the node's decode side handed its sequences
  // to decode-0, here. Requests were served by the node's ranks.
  const auto on_node = std::count_if(got.done.begin(), got.done.end(), [](const completion& c) {
    return c.decode_rank.rfind("elastic-", 0) == 0 || c.prefill_rank.rfind("elastic-", 0) == 0;
  });
  MESSAGE(on_node << " requests served by the node's elastic ranks");
  CHECK(on_node > 0);
}

TEST_CASE("a node whose start outlasts the directory's heartbeat timeout heartbeats while it starts and is never "
          "declared gone") {
  network_system n;
  node_directory_config dc;
  dc.heartbeat_interval_ms = 50;
  dc.missed_heartbeats = 8;  // silent for 400 ms: gone (room for a stalled machine's late beat)
  auto dir = spawn_node_directory(n.sys, dc, {});
  // A start that blocks the agent for 30 heartbeat intervals (almost 4 timeouts), as spawning
  // expert processes or uploading weights to a GPU may.
  auto started = std::make_shared<std::atomic<bool>>(false);
  node_agent_config ac;
  ac.hello = node_hello{"slow-node", {"decode"}, 1, ""};
  auto agent = spawn_node_agent(n.sys, dir, ac, [started](caf::actor_system&, const cluster_welcome&, node_actors*) {
    std::this_thread::sleep_for(std::chrono::milliseconds{1500});
    started->store(true);
    return std::string{};
  });
  caf::scoped_actor self{n.sys};
  std::vector<std::string> states;
  for (int i = 0; i < 4000 && !started->load(); ++i) {
    self->request(dir, std::chrono::seconds{5}, stats_atom::value)
        .receive(
            [&](std::vector<node_status>& all) {
              for (const auto& s : all)
                if (s.name == "slow-node") states.push_back(s.state);
            },
            [](caf::error&) {});
    std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  CHECK(started->load());
  CHECK(states.size() > 10);  // watched through the start
  CHECK(std::count(states.begin(), states.end(), "gone") == 0);
  self->send_exit(agent, caf::exit_reason::user_shutdown);
  self->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the launcher's wait for draining nodes ends when they have left the head's register, or at its budget "
          "naming those still there") {
  network_system n;
  auto dir = spawn_node_directory(n.sys, {}, {});
  node_agent_config ac;
  ac.hello = node_hello{"far-node", {"decode"}, 1, ""};
  auto agent = spawn_node_agent(n.sys, dir, ac, [](caf::actor_system&, const cluster_welcome&, node_actors*) {
    return std::string{};
  });
  caf::scoped_actor self{n.sys};
  bool joined = false;
  for (int i = 0; i < 2000 && !joined; ++i) {
    self->request(dir, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](std::vector<node_status>& all) { joined = !all.empty() && all[0].state == "joined"; }, [](caf::error&) {});
    if (!joined) std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  REQUIRE(joined);
  // Serving, not draining: still there when the budget runs out. A node never seen counts as gone.
  CHECK(wait_nodes_gone(n.sys, dir, {"far-node", "never-joined"}, std::chrono::milliseconds{200}) ==
        std::vector<std::string>{"far-node"});
  self->send(agent, drain_atom::value);  // as SIGHUP does on its host: it drains and leaves
  CHECK(wait_nodes_gone(n.sys, dir, {"far-node"}, std::chrono::seconds{30}).empty());
  self->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("an expert shard that prints no key within the engine's deadline fails the group's start, naming the "
          "shard, instead of hanging the engine") {
  // The shard stalls 30 s before its keys (BATON_FAULT_EXPERTS_STALL_MS, inherited); the engine
  // waits 500 ms. Without the deadline the start would block until the keys came, and succeed.
  ::setenv("BATON_FAULT_EXPERTS_STALL_MS", "30000", 1);
  deploy::expert_spawn s;
  s.model_arg = "deepseek-v3-tiny";
  s.size = 2;
  s.slot_bytes = 1 << 20;
  s.name = "stalled";
  s.key_timeout_ms = 500;
  s.executable = BATON_BINARY;
  std::string why;
  auto group = deploy::spawn_expert_group(s, gpu::deepseek_tiny_config(true), &why);
  ::unsetenv("BATON_FAULT_EXPERTS_STALL_MS");
  CHECK(group == nullptr);
  CHECK_MESSAGE(why.find("expert shard stalled-ep1 printed no key within 500 ms of its start") != std::string::npos, why);
}

TEST_CASE("process_gone and process_alive see how a child ended without reaping it, so its owner still can (the "
          "launcher's restarts go by the reaped exit)") {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) _exit(3);
  for (int i = 0; i < 500 && deploy::process_alive(pid); ++i)  // bounded: 5 s at most
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  CHECK_FALSE(deploy::process_alive(pid));
  std::string how;
  const bool gone = deploy::process_gone(pid, &how);  // process_alive left the exit to be seen
  REQUIRE(gone);
  CHECK(how == "exit code 3");
  CHECK(deploy::process_gone(pid, &how));  // still there to be asked
  std::string reaped;
  CHECK(deploy::process_exited(pid, &reaped));  // and its owner reaps it
  CHECK(reaped == "exit code 3");
  CHECK_FALSE(deploy::process_gone(pid, &how));  // reaped: nothing left
}

TEST_CASE("floats cross processes bit for bit, NaN and infinities too (CAF 0.17 packs floats by hand: NaN became 1.0 "
          "and an infinity hung the sender)") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  auto bits = [](float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return b;
  };
  completion c;
  c.step_logits = {{1.5f, -inf, inf, nan, -0.0f, 1e-40f}};  // 1e-40: subnormal, also lost by the hand packing
  c.logprobs = {{7, -inf, "x", {7, 8}, {-inf, nan}, {"x", "y"}}};
  c.prompt_logprobs = {{1, nan, "", {}, {}, {}}};
  prefill_result p;
  p.logprobs = {gpu::token_logprobs{-inf, {3}, {nan}}};
  p.logits = {inf};
  generate_request g;
  g.temperature = inf;
  g.include_stop_str_in_output = true;  // the newest field: the wire form carries it too
  rank_load load;
  load.predicted_us = std::numeric_limits<double>::infinity();
  std::vector<char> buf;
  caf::binary_serializer sink{nullptr, buf};
  REQUIRE_FALSE(sink(c, p, g, load));
  completion c2;
  prefill_result p2;
  generate_request g2;
  rank_load load2;
  caf::binary_deserializer source{nullptr, buf};
  REQUIRE_FALSE(source(c2, p2, g2, load2));
  REQUIRE(c2.step_logits.size() == 1);
  REQUIRE(c2.step_logits[0].size() == c.step_logits[0].size());
  for (size_t i = 0; i < c.step_logits[0].size(); ++i) CHECK(bits(c2.step_logits[0][i]) == bits(c.step_logits[0][i]));
  CHECK(bits(c2.logprobs[0].logprob) == bits(-inf));
  CHECK(bits(c2.logprobs[0].top_logprobs[1]) == bits(nan));
  CHECK(std::isnan(c2.prompt_logprobs[0].logprob));
  CHECK(bits(p2.logprobs[0].logprob) == bits(-inf));
  CHECK(std::isnan(p2.logprobs[0].top_logprobs[0]));
  CHECK(bits(p2.logits[0]) == bits(inf));
  CHECK(std::isinf(g2.temperature));
  CHECK(g2.include_stop_str_in_output);
  CHECK(std::isinf(load2.predicted_us));
}

// Disaggregation across processes: prefill rank here, decode rank in a `baton node` process,
// joined through CAF's network layer, KV over UCX -- shared memory, then TCP on 127.0.0.1; and
// elastic ranks in a node process, moved between the roles by the head's controller.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include <caf/io/middleman.hpp>

#include "deploy/processes.hpp"
#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "tests/test_util.hpp"

#include <unistd.h>

using namespace baton;

namespace {

struct network_system {
  caf::actor_system_config cfg;
  caf::actor_system sys;
  static caf::actor_system_config& init(caf::actor_system_config& c) {
    register_message_types(c);
    c.load<caf::io::middleman>();
    c.set("scheduler.max-threads", 2);
    c.set("work-stealing.moderate-poll-attempts", 0);
    return c;
  }
  network_system() : sys(init(cfg)) {}
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

void run_across_processes(const char* ucx_tls, bool with_store = false) {
  // UCX reads its configuration from the environment, in this process and in the child.
  setenv("UCX_TLS", ucx_tls, 1);
  network_system n;
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 0;
  cfg.transport = "ucx";
  cfg.prefill.chunk_tokens = 16;
  cfg.executor.num_kv_pages = 64;
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
  struct guard {
    std::vector<pid_t>& pids;
    caf::scoped_actor& self;
    local_cluster& c;
    ~guard() {
      deploy::stop_processes(pids);
      for (auto& a : c.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
    }
  } g{children, self, cluster};
  std::string why;
  auto pid = deploy::spawn_process({BATON_BINARY, "node", "--role", "decode", "--name", "decode-remote", "--connect",
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
    auto ref = gpu::generate_colocated(*exec, tok.encode(prompt), 8, cfg.prefill.chunk_tokens);
    CHECK(got->tokens == ref.tokens);
    CHECK(test::same_bits(got->step_logits, ref.step_logits));
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

TEST_CASE("across processes over UCX shared memory: tokens and logits equal the colocated run") {
  run_across_processes("sm");
}

TEST_CASE("across processes over UCX TCP on 127.0.0.1: tokens and logits equal the colocated run") {
  run_across_processes("tcp");
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
  auto& p = cfg.elastic.planner;
  p.ttft_target_ms = 1;
  p.tbt_target_ms = 1e6;
  p.kv_full = 1.0;
  p.smooth_s = 0;
  p.hold_s = 0;
  p.cooldown_s = 0.3;
  p.dwell_s = 1;
  cfg.elastic.interval_ms = 20;
  REQUIRE(cfg.validate().empty());
  auto cluster = start_local_cluster(n.sys, cfg);
  caf::scoped_actor self{n.sys};
  REQUIRE(cluster.elastic_controller);
  auto port = n.sys.middleman().publish(cluster.directory, 0, "127.0.0.1", true);
  REQUIRE(port);
  std::vector<pid_t> children;
  struct guard {
    std::vector<pid_t>& pids;
    caf::scoped_actor& self;
    local_cluster& c;
    ~guard() {
      deploy::stop_processes(pids);
      for (auto& a : c.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
    }
  } g{children, self, cluster};
  std::string why;
  auto pid = deploy::spawn_process({BATON_BINARY, "node", "--role", "elastic", "--name", "elastic", "--ranks", "2",
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
  auto changes = [&] {
    std::vector<role_change> out;
    self->request(cluster.elastic_controller, std::chrono::seconds{5}, events_atom::value)
        .receive([&](std::vector<role_change>& l) { out = std::move(l); }, [](caf::error&) {});
    return out;
  };
  auto done_changes = [](const std::vector<role_change>& log) {
    return std::count_if(log.begin(), log.end(), [](auto& c) { return c.state == "done"; });
  };
  auto send = [&](std::string prompt, int32_t max_tokens) {
    generate_request req;
    req.prompt = std::move(prompt);
    req.max_tokens = max_tokens;
    req.ignore_eos = true;
    return self->request(cluster.router, std::chrono::seconds{120}, generate_atom::value, std::move(req));
  };
  // Phase 1, prefill-heavy: 4 long generations (some decode on elastic-1 when it moves), then 40
  // prompts of 100 tokens with one token each.
  std::vector<std::string> prompts;
  std::vector<decltype(send("", 1))> handles;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back("a long story, part " + std::to_string(i));
    handles.push_back(send(prompts.back(), 300));
  }
  for (int i = 0; i < 40; ++i) {
    std::string s;
    for (int k = 0; k < 99; ++k) s.push_back(static_cast<char>('a' + (i * 7 + k * 3) % 26));
    prompts.push_back(s);
    handles.push_back(send(s, 1));
  }
  std::vector<completion> done(handles.size());
  for (size_t i = 0; i < handles.size(); ++i)
    handles[i].receive([&](completion& c) { done[i] = std::move(c); },
                       [&](caf::error& e) { FAIL("phase 1 request " << i << ": " << n.sys.render(e)); });
  auto log = changes();
  for (int i = 0; i < 500 && done_changes(log) < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
    log = changes();
  }
  REQUIRE(done_changes(log) >= 1);
  CHECK(log[0].rank == "elastic-1");
  CHECK(log[0].from == "decode");
  CHECK(log[0].to == "prefill");
  CHECK_MESSAGE(log[0].why.find("prefill pool hot, decode pool cold") == 0, log[0].why);
  // Phase 2, decode-heavy: 10 short prompts with 1,400 tokens each.
  const size_t phase2 = handles.size();
  for (int i = 0; i < 10; ++i) {
    prompts.push_back("decode heavy " + std::to_string(i));
    handles.push_back(send(prompts.back(), 1400));
  }
  done.resize(handles.size());
  for (size_t i = phase2; i < handles.size(); ++i)
    handles[i].receive([&](completion& c) { done[i] = std::move(c); },
                       [&](caf::error& e) { FAIL("phase 2 request " << i << ": " << n.sys.render(e)); });
  log = changes();
  for (const auto& c : log)
    MESSAGE(c.at_s << " s: " << c.rank << " " << c.from << " -> " << c.to << " (" << c.state << ", " << c.drain_s << " s): " << c.why);
  REQUIRE(done_changes(log) >= 2);
  const auto& back = *std::find_if(log.begin() + 1, log.end(), [](auto& c) { return c.state == "done"; });
  CHECK(back.from == "prefill");
  CHECK(back.to == "decode");
  CHECK_MESSAGE(back.why.find("decode pool hot, prefill pool cold") == 0, back.why);
  // Nothing lost or duplicated, nothing recomputed; the tokens are those of the prompt run alone.
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  const gpu::byte_tokenizer tok{cfg.model.bos_token_id, cfg.model.eos_token_id};
  for (size_t i : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{17}, size_t{43}, handles.size() - 1}) {
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    auto ref = gpu::generate_colocated(*exec, tok.encode(prompts[i]), done[i].tokens.size(), 32, {}, true);
    CHECK_MESSAGE(done[i].tokens == ref.tokens, "request " << i);
  }
  uint32_t migrations = 0, on_node = 0;
  for (size_t i = 0; i < done.size(); ++i) {
    CHECK(done[i].failovers == 0);
    migrations += done[i].migrations;
    on_node += done[i].decode_rank.rfind("elastic-", 0) == 0 || done[i].prefill_rank.rfind("elastic-", 0) == 0;
  }
  MESSAGE(migrations << " decode sequences moved with their KV across processes; " << on_node
                     << " requests served by the node's elastic ranks");
  CHECK(migrations > 0);
  CHECK(on_node > 0);
}

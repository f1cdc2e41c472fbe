// The block store in a running cluster when a cached block fails: a corrupted or deleted file, a
// server killed before or during a read, a read slower than its reader's wait, a put that fails.
// Each ends as a recompute with correct output, and nothing waits for ever. A store node whose
// server went down, or hangs, is adopted again, and serves its disk's blocks to every rank.

#include <doctest/doctest.h>

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "tests/actors/store_fixture.hpp"
#include "actors/block_index.hpp"
#include "actors/store_host.hpp"
#include "actors/store_keeper.hpp"
#include "transport/fault_proxy.hpp"
#include "transport/loopback.hpp"
#include "transport/ucx.hpp"

using namespace baton;
using namespace baton::test_store;

namespace {

/// Server 0 as a rank's watch (store_watch.hpp) sees it once it differs from generation 0 and
/// up (`known_down` false) or down (true): its actor, the generation, and whether it is down.
/// Waits up to 30 s (a failure names why); what comes is checked by the caller.
struct watched_server {
  block_server_actor actor;
  uint64_t generation = 0;
  bool down = false;
};
watched_server watch_server0(caf::actor_system& sys, caf::scoped_actor& asker, const block_index_actor& index,
                             bool known_down) {
  watched_server out;
  asker->request(index, std::chrono::seconds{30}, servers_atom::value, uint32_t{0}, uint64_t{0}, known_down)
      .receive([&](block_server_actor& s, uint64_t generation, bool down) { out = {s, generation, down}; },
               [&](caf::error& e) { FAIL(sys.render(e)); });
  return out;
}

}  // namespace

TEST_CASE("store: a corrupted block file and a deleted one end as recomputation with correct output") {
  temp_dir dir{"damage"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto p = prompt_tokens(cfg, 99, 2);
  const auto ref = reference(cfg, p);
  REQUIRE(t.generate(cluster.router, request_for(p)));
  wait_for_blocks(t, cluster, 3);
  const auto server_dir = dir.path + "/server-0";
  // One byte of block 1's KV (layer 2) flipped: the header is intact, the landed layer is not.
  damage_layer_2(store::block_path(server_dir, key_of(cfg, p, 1)), cfg);
  auto got = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK(got->cached_tokens == 32);      // block 0 loaded ...
  CHECK(got->recomputed_blocks == 2);   // ... block 1 failed its checksum, and block 2 follows it
  check_equal(*got, ref);
  const auto events = t.events(cluster.prefill[0].handle);
  CHECK(std::any_of(events.begin(), events.end(), [](auto& e) { return e.kind == "prefix_recompute" && e.chunk == 2; }));
  // Streaming: the computation started on the optimistic prefix and was aborted when layer 2 of
  // block 1 failed its checksum, then restarted after block 0.
  CHECK(std::any_of(events.begin(), events.end(), [](auto& e) { return e.kind == "prefix_abort"; }));

  // The recompute's write-back repaired block 1 (from cached_blocks = 1 on); now delete block 0.
  std::this_thread::sleep_for(std::chrono::milliseconds{100});
  std::filesystem::remove(store::block_path(server_dir, key_of(cfg, p, 0)));
  got = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK(got->cached_tokens == 0);
  CHECK(got->recomputed_blocks == 3);
  check_equal(*got, ref);
  // The block server counted what it could not serve.
  caf::scoped_actor self{t.sys};
  store_stats s;
  self->request(cluster.store_servers[0].handle, std::chrono::seconds{5}, stats_atom::value)
      .receive([&](store_stats& x) { s = x; }, [](caf::error&) {});
  CHECK(s.read_failures >= 1);
}

TEST_CASE("store: with every block server down, a finished sequence's blocks are dropped (counted), and no "
          "write-back is left in flight for ever (it kept the rank from ever being idle)") {
  temp_dir dir{"alldown"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  {
    caf::scoped_actor self{t.sys};
    self->send_exit(cluster.store_servers[0].handle, caf::exit_reason::kill);
  }
  // No wait for the decode rank to hear of the death: whether the ring already skips the server or
  // its write_begin fails, each block reaches no server and is counted as dropped.
  const auto p = prompt_tokens(cfg, 99, 7);
  auto got = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  check_equal(*got, reference(cfg, p));
  const auto& decode = cluster.decode[0].handle;
  for (int i = 0; i < 2500 && t.stats(decode).write_backs_dropped < 3; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{4});
  const auto st = t.stats(decode);
  CHECK(st.write_backs_dropped == 3);
  CHECK(st.num_writes_in_flight == 0);
}

TEST_CASE("store: with 2 replicas, a killed block server still yields hits; with 1, its blocks are misses") {
  for (uint32_t replicas : {2u, 1u}) {
    CAPTURE(replicas);
    temp_dir dir{"replicas" + std::to_string(replicas)};
    test::cluster_system t;
    auto cfg = store_cluster(dir.path, 2, replicas);
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    const auto p = prompt_tokens(cfg, 99, 3);
    const auto ref = reference(cfg, p);
    REQUIRE(t.generate(cluster.router, request_for(p)));
    wait_for_blocks(t, cluster, 3);
    // Every replica's write has landed (the index counts a block at its first copy).
    for (size_t b = 0; b < 3; ++b)
      for (int i = 0; i < 2500 && servers_of(t, cluster, key_of(cfg, p, b)).size() < replicas; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds{4});
    // Kill the server holding block 0's primary copy, and wait until the index has seen it go.
    const store::server_ring ring{2};
    const auto primary = ring.servers_for(key_of(cfg, p, 0), 1)[0];
    const auto router_stats = [&] {  // what /metrics and /health show
      cluster_stats out;
      caf::scoped_actor self{t.sys};
      self->request(cluster.router, std::chrono::seconds{5}, stats_atom::value)
          .receive([&](cluster_stats& c) { out = std::move(c); }, [](caf::error&) {});
      return out;
    };
    const auto written = [&] { return router_stats().store.bytes_written; };  // summed over the servers
    const uint64_t written_before = written();
    CHECK(written_before > 0);
    CHECK(router_stats().store_servers_up == 2);
    {
      caf::scoped_actor self{t.sys};
      self->send_exit(cluster.store_servers[primary].handle, caf::exit_reason::kill);
    }
    const auto names_primary = [&] {
      const auto s = servers_of(t, cluster, key_of(cfg, p, 0));
      return std::find(s.begin(), s.end(), primary) != s.end();
    };
    for (int i = 0; i < 2500 && names_primary(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{4});
    REQUIRE_FALSE(names_primary());
    CHECK(written() >= written_before);  // a dead server's writes still count: the counter never goes back
    CHECK(router_stats().store_servers == 2);
    CHECK(router_stats().store_servers_up == 1);
    auto got = t.generate(cluster.router, request_for(p));
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    check_equal(*got, ref);
    if (replicas == 2) {
      CHECK(got->cached_tokens == 96);
      CHECK(got->recomputed_blocks == 0);
    } else {
      // The index watches its servers: it no longer names the dead one, so block 0 is a miss
      // (computed, never waited for) and nothing after it can be used.
      CHECK(got->cached_tokens == 0);
      CHECK(got->recomputed_blocks == 0);
      CHECK(servers_of(t, cluster, key_of(cfg, p, 0)).empty());
    }
  }
}

TEST_CASE("store: a read slower than the reader's timeout: the server starts no put past its budget, the prompt is "
          "recomputed, and the pages it named are held from the next prompts until no put of it can land") {
  temp_dir dir{"slow-read"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  // The server's budget: 300 ms, with room on a loaded machine. Write-back's slot requests wait
  // write_slot_timeout_ms (5 s by default), not this, so the first prompt's blocks land.
  cfg.store.read_timeout_ms = 600;
  // A put given up may land later still: the pages are held this long (60 s by default), more
  // than read_timeout_ms + store_put_limit_ms.
  cfg.prefill.late_put_quarantine_ms = 12000;
  // The server takes 900 ms before each layer of a read (reads only: write-back is unaffected).
  auto slow = [](caf::actor_system& sys, block_server_config bc, std::shared_ptr<transport::transport> xport,
                 std::vector<block_index_actor> index) {
    bc.fault_layer_delay_ms = 900;
    return spawn_block_server(sys, std::move(bc), std::move(xport), std::move(index));
  };
  auto cluster = start_local_cluster(t.sys, cfg, {}, {}, slow);
  test::cluster_system::stopper stop{t, cluster};
  const auto p = prompt_tokens(cfg, 99, 12);
  REQUIRE(t.generate(cluster.router, request_for(p)));
  wait_for_blocks(t, cluster, 3);
  auto again = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(again, t.sys.render(again.error()));
  CHECK(again->cached_tokens == 0);  // the read timed out: recomputed
  check_equal(*again, reference(cfg, p));
  auto held = [&](const char* kind) {
    const auto ev = t.events(cluster.prefill[0].handle);
    return std::count_if(ev.begin(), ev.end(), [&](auto& e) { return e.kind == kind; });
  };
  CHECK(held("pages_held") == 1);
  for (const auto& e : t.events(cluster.prefill[0].handle))
    if (e.kind == "pages_held") CHECK(e.layer == 12000);  // the hold, in ms
  // The next prompt on the rank gets other pages, and its own answer.
  const auto q = prompt_tokens(cfg, 50, 13);
  auto other = t.generate(cluster.router, request_for(q));
  REQUIRE(other);
  check_equal(*other, reference(cfg, q));
  // The server stopped at its budget: it put nothing and says why (it answers after its 900 ms).
  caf::scoped_actor self{t.sys};
  store_stats s;
  for (int i = 0; i < 500 && s.read_failures + s.blocks_read < 3; ++i) {
    self->request(cluster.store_servers[0].handle, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](store_stats& x) { s = x; }, [](caf::error&) {});
    if (s.read_failures + s.blocks_read < 3) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  CHECK(s.blocks_read == 0);
  CHECK(s.read_failures == 3);
  CHECK(s.bytes_read == 0);
  // The held pages come back after the quarantine.
  for (int i = 0; i < 400 && held("pages_unheld") == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{50});
  CHECK(held("pages_unheld") == 1);
  CHECK(t.stats(cluster.prefill[0].handle).num_free_pages == cfg.executor.num_kv_pages);
}

TEST_CASE("store: a write-back put that fails gives its slot back, so later write-backs find room; bytes that are "
          "not what the writer checksummed never become a block") {
  for (auto kind : {transport::fault_kind::fail, transport::fault_kind::drop}) {
    CAPTURE(static_cast<int>(kind));
    temp_dir dir{"slots" + std::to_string(static_cast<int>(kind))};
    test::cluster_system t;
    auto cfg = store_cluster(dir.path);
    // Staging for one block at a time: one slot lost for good would stop every write.
    const auto lay = gpu::model_kv_layout(cfg.model, 1, cfg.executor.page_size_tokens);
    const uint64_t block = uint64_t{cfg.store.block_tokens / cfg.executor.page_size_tokens} * lay.page_bytes() * lay.num_layers;
    cfg.store.staging_bytes = block * 3 / 2;
    REQUIRE(cfg.validate().empty());
    // decode-0's first write-back put fails (fail) or does nothing yet says it landed (drop).
    auto wrap = [&](std::unique_ptr<transport::transport> inner, const std::string& name)
        -> std::shared_ptr<transport::transport> {
      if (name != "decode-0") return std::shared_ptr<transport::transport>{std::move(inner)};
      return std::shared_ptr<transport::transport>{transport::make_fault_proxy(std::move(inner), {kind, {}, {}, 1, 1})};
    };
    auto cluster = start_local_cluster(t.sys, cfg, {}, wrap);
    test::cluster_system::stopper stop{t, cluster};
    auto server_stats = [&] {
      caf::scoped_actor self{t.sys};
      store_stats s;
      self->request(cluster.store_servers[0].handle, std::chrono::seconds{5}, stats_atom::value)
          .receive([&](store_stats& x) { s = x; }, [](caf::error&) {});
      return s;
    };
    // Prompts of their own per kind: memory freed by the first cluster may come back to the
    // second one's staging with the first one's blocks still in it.
    const char k = static_cast<char>(kind) * 2;
    const auto p = prompt_tokens(cfg, 99, static_cast<char>(14 + k));
    REQUIRE(t.generate(cluster.router, request_for(p)));  // block 0 took the slot; 1 and 2 found it full
    for (int i = 0; i < 500 && server_stats().slots_reclaimed + server_stats().write_failures == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds{4});
    if (kind == transport::fault_kind::fail) {
      CHECK(server_stats().slots_reclaimed == 1);  // given back at once, not after write_slot_ttl_ms
    } else {
      // The slot held stale bytes: before, they were written as p's block 0 and committed.
      CHECK(server_stats().write_failures == 1);
      CHECK(server_stats().blocks_written == 0);
    }
    // Every block of p counts as dropped: 1 and 2 found the staging full, block 0's put failed
    // or its write did (the server answers 0 then; before, any answer counted as stored).
    const auto& decode = cluster.decode[0].handle;
    for (int i = 0; i < 1250 && t.stats(decode).write_backs_dropped < 3; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds{4});
    CHECK(t.stats(decode).write_backs_dropped == 3);
    const auto q = prompt_tokens(cfg, 99, static_cast<char>(15 + k));
    REQUIRE(t.generate(cluster.router, request_for(q)));
    wait_for_blocks(t, cluster, 1);  // q's block 0: there was room again
    CHECK(server_stats().blocks_written == 1);
    auto again = t.generate(cluster.router, request_for(p));  // p's blocks: none stored
    REQUIRE(again);
    CHECK(again->cached_tokens == 0);
    check_equal(*again, reference(cfg, p));
  }
}

TEST_CASE("store: a block server killed in the middle of a read ends as a recompute with correct output") {
  temp_dir dir{"killed"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  transport::fault_proxy* proxy = nullptr;
  // The server's puts of layer 1 stall (after the first request's write-back, which uses no puts).
  auto wrap = [&](std::unique_ptr<transport::transport> inner, const std::string& name)
      -> std::shared_ptr<transport::transport> {
    if (name != "store-0") return std::shared_ptr<transport::transport>{std::move(inner)};
    auto p = transport::make_fault_proxy(std::move(inner), {transport::fault_kind::stall, 1, {}, 1, 1});
    proxy = p.get();
    return std::shared_ptr<transport::transport>{std::move(p)};
  };
  auto cluster = start_local_cluster(t.sys, cfg, {}, wrap);
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(proxy != nullptr);
  const auto p = prompt_tokens(cfg, 99, 10);
  REQUIRE(t.generate(cluster.router, request_for(p)));
  wait_for_blocks(t, cluster, 3);
  caf::scoped_actor self{t.sys};
  auto pending = self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, request_for(p));
  // Mid-read: layer 0 of the blocks landed, layer 1's put is stuck. Then the server dies.
  for (int i = 0; i < 2000 && proxy->num_injected() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE(proxy->num_injected() == 1);
  self->send_exit(cluster.store_servers[0].handle, caf::exit_reason::kill);
  completion got;
  const auto t0 = std::chrono::steady_clock::now();
  pending.receive([&](completion& c) { got = std::move(c); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(got.cached_tokens == 0);
  CHECK(got.recomputed_blocks == 3);
  MESSAGE("answered after " << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s");
  check_equal(got, reference(cfg, p));
}


TEST_CASE("store node lost and back: the head adopts it again under the same server id; its disk's blocks are hits "
          "again for the prefill rank, the decode rank writes to it again, and /health counts it up") {
  temp_dir dir{"readopt"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path, 0);  // the store's only server lives in a store node
  cfg.transport = "ucx";
  cfg.store.readopt_interval_ms = 20;
  store_host_config hc;
  hc.name = "store-a";
  hc.dir = dir.path + "/node";
  auto host = spawn_store_host(t.sys, hc, [](const std::string& name, std::string* why) {
    return std::shared_ptr<transport::transport>{transport::make_ucx_transport({.name = name}, why)};
  });
  cfg.remote_store_hosts = {host};
  auto reconnects = std::make_shared<std::atomic<int>>(0);
  cfg.reconnect_store_host = [host, reconnects](size_t node) -> caf::expected<store_host_actor> {
    ++*reconnects;
    if (node != 0) return make_error(errc::bad_request, "no such node");
    return host;
  };
  test::captured_lines log;
  cfg.store_log = log.sink();
  auto cluster = start_local_cluster(t.sys, cfg);
  REQUIRE_MESSAGE(cluster.setup_error.empty(), cluster.setup_error);
  test::cluster_system::stopper stop{t, cluster};
  struct host_stopper {
    test::cluster_system& t;
    store_host_actor host;
    ~host_stopper() { caf::anon_send_exit(host, caf::exit_reason::user_shutdown); }
  } stop_host{t, host};
  REQUIRE(cluster.store_keeper);

  const auto p = prompt_tokens(cfg, 99, 21);
  const auto ref = reference(cfg, p);
  REQUIRE(t.generate(cluster.router, request_for(p)));
  wait_for_blocks(t, cluster, 3);
  auto hit = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(hit, t.sys.render(hit.error()));
  CHECK(hit->cached_tokens == 96);

  caf::scoped_actor self{t.sys};
  const auto servers_now = [&] {
    std::vector<block_server_actor> out;
    self->request(cluster.store_index[0], std::chrono::seconds{5}, servers_atom::value)
        .receive([&](std::vector<block_server_actor>& s) { out = std::move(s); }, [](caf::error&) {});
    return out;
  };
  const auto router_stats = [&] {
    cluster_stats out;
    self->request(cluster.router, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](cluster_stats& c) { out = std::move(c); }, [](caf::error&) {});
    return out;
  };
  const auto servers_up = [&] { return router_stats().store_servers_up; };
  CHECK(servers_up() == 1);
  const uint64_t written_before = router_stats().store.bytes_written;
  CHECK(written_before > 0);
  const auto old_server = cluster.store_servers.at(0).handle;
  REQUIRE(servers_now() == std::vector<block_server_actor>{old_server});
  // A watch as a rank keeps one (store_watch.hpp): "server 0 other than generation 0, up?" It is
  // answered at the first change: the server going down.
  caf::scoped_actor watcher{t.sys};
  auto watch = watcher->request(cluster.store_index[0], std::chrono::seconds{30}, servers_atom::value, uint32_t{0},
                                uint64_t{0}, false);
  // The node's server dies (its process would have); the host answers again at once.
  self->send_exit(old_server, caf::exit_reason::kill);
  bool told_down = false;
  std::move(watch).receive(
      [&](block_server_actor& s, uint64_t generation, bool down) {
        told_down = down && generation == 0 && s == old_server;
      },
      [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(told_down);
  // Watched again knowing it down: answered once it is adopted again, with the new actor.
  const auto readopted = watch_server0(t.sys, watcher, cluster.store_index[0], true);
  CHECK(readopted.generation == 1);
  CHECK_FALSE(readopted.down);
  const auto next = readopted.actor;
  CHECK(next);
  CHECK(next != old_server);
  for (int i = 0; i < 2500 && servers_now().at(0) == old_server; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{4});
  const auto now = servers_now();
  REQUIRE(now.at(0) != old_server);
  CHECK(reconnects->load() >= 1);
  // The new server found the 3 blocks on the node's disk and committed them under server 0.
  for (int i = 0; i < 2500 && servers_of(t, cluster, key_of(cfg, p, 2)).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{4});
  for (size_t b = 0; b < 3; ++b) CHECK(servers_of(t, cluster, key_of(cfg, p, b)) == std::vector<uint32_t>{0});
  CHECK(servers_up() == 1);  // the router asks the new server
  // Counters of the old server are kept: the sums /metrics shows never go back.
  CHECK(router_stats().store.bytes_written >= written_before);

  // The prefill rank reads from the new actor: a hit again, the same output. (It learns of the
  // new actor asynchronously: a read sent before that recomputes, so allow a few tries.)
  uint32_t cached = 0;
  for (int i = 0; i < 50 && cached != 96; ++i) {
    auto again = t.generate(cluster.router, request_for(p));
    REQUIRE_MESSAGE(again, t.sys.render(again.error()));
    check_equal(*again, ref);
    cached = again->cached_tokens;
    if (cached != 96) std::this_thread::sleep_for(std::chrono::milliseconds{20});
  }
  CHECK(cached == 96);
  // The decode rank writes a new prompt's blocks to it (it skipped server 0 while it was down).
  const auto q = prompt_tokens(cfg, 99, 22);
  REQUIRE(t.generate(cluster.router, request_for(q)));
  for (int i = 0; i < 2500 && servers_of(t, cluster, key_of(cfg, q, 2)).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{4});
  CHECK(servers_of(t, cluster, key_of(cfg, q, 2)) == std::vector<uint32_t>{0});
  const auto lines = log.lines();
  REQUIRE(lines.size() >= 2);
  CHECK_MESSAGE(lines.front().find("store node 0 (block server 0) went down") == 0, lines.front());
  CHECK_MESSAGE(lines.back() == "store node 0 (block server 0) adopted again: it serves the blocks its disk holds",
                lines.back());
}

namespace {

/// FAKE, for failure injection only: a block server that answers its stats (the keeper's probe)
/// until `hung` is set, and from then on answers nothing, as a store node's server does when its
/// process hangs or its packets are dropped while the TCP link lingers. Everything else fails.
struct fake_hanging_server_state {
  std::shared_ptr<std::atomic<bool>> hung;
  std::vector<caf::typed_response_promise<store_stats>> held;  ///< never delivered while hung
  static inline const char* name = "test.fake_hanging_server";
};

block_server_actor::behavior_type fake_hanging_server(
    block_server_actor::stateful_pointer<fake_hanging_server_state> self, std::shared_ptr<std::atomic<bool>> hung) {
  self->state.hung = std::move(hung);
  return {
      [=](store_read_order&) -> caf::result<store_read_result> { return make_error(errc::bad_request, "fake"); },
      [=](store_write_begin&) -> caf::result<store_write_slot> { return make_error(errc::bad_request, "fake"); },
      [=](store_write_order&) { return uint64_t{0}; },
      [=](release_atom, uint64_t) {},
      [=](expire_atom, uint64_t) {},
      [=](delete_atom, uint64_t, uint64_t, uint64_t) {},
      [=](touch_atom, std::vector<uint64_t>&) {},
      [=](stats_atom) -> caf::result<store_stats> {
        if (!self->state.hung->load()) return store_stats{};
        auto rp = self->make_response_promise<store_stats>();
        self->state.held.push_back(rp);
        return rp;
      },
      [=](io_atom, uint64_t) {},
  };
}

}  // namespace

TEST_CASE("store keeper: a store node's server that answers no probe is given up (the index marks it down, its "
          "watchers are told) and adopted again under the same id once its host answers") {
  test::cluster_system t;
  auto hung = std::make_shared<std::atomic<bool>>(false);
  auto fresh = std::make_shared<std::atomic<bool>>(false);
  const block_server_actor old_server = t.sys.spawn(fake_hanging_server, hung);
  const block_server_actor new_server = t.sys.spawn(fake_hanging_server, fresh);
  auto index = spawn_block_index(t.sys, {}, {old_server});
  // The node's host: answers the re-adoption with the new server (a real host would stop the
  // hung one first), once the test lets it be reached.
  auto adoptions = std::make_shared<std::atomic<int>>(0);
  store_host_actor host = t.sys.spawn([adoptions, new_server](store_host_actor::pointer) -> store_host_actor::behavior_type {
    return {[=](adopt_atom, store_adoption& a) -> caf::result<block_server_actor> {
      ++*adoptions;
      if (a.server_id != 0) return make_error(errc::bad_request, "fake host: expected server 0");
      return new_server;
    }};
  });
  auto reachable = std::make_shared<std::atomic<bool>>(false);
  auto tries = std::make_shared<std::atomic<int>>(0);
  store_keeper_config kc;
  kc.reconnect = [host, reachable, tries](size_t) -> caf::expected<store_host_actor> {
    ++*tries;
    if (!reachable->load()) return make_error(errc::rank_unavailable, "fake: the node does not answer yet");
    return host;
  };
  kc.retry_interval_ms = 10;
  kc.probe_interval_ms = 20;
  kc.missed_probes = 3;
  test::captured_lines log;
  kc.log = log.sink();
  store_adoption adoption;
  adoption.server_id = 0;
  adoption.index = {index};
  auto keeper = spawn_store_keeper(t.sys, kc, {{"store node 0", adoption, old_server}});
  struct stopper {
    std::vector<caf::actor> actors;
    ~stopper() {
      for (auto& a : actors) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    }
  } stop{{caf::actor_cast<caf::actor>(keeper), caf::actor_cast<caf::actor>(index), caf::actor_cast<caf::actor>(host),
          caf::actor_cast<caf::actor>(old_server), caf::actor_cast<caf::actor>(new_server)}};

  caf::scoped_actor self{t.sys};
  // Answering probes: never given up, however long (20 probe intervals).
  auto watch = self->request(index, std::chrono::seconds{30}, servers_atom::value, uint32_t{0}, uint64_t{0}, false);
  std::this_thread::sleep_for(std::chrono::milliseconds{400});
  CHECK(tries->load() == 0);
  // Hung: a probe unanswered for 3 intervals, the index marks it down and answers the watch.
  hung->store(true);
  bool told_down = false;
  std::move(watch).receive(
      [&](block_server_actor& s, uint64_t generation, bool down) { told_down = down && generation == 0 && s == old_server; },
      [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(told_down);
  // While its host cannot be reached it stays down, and the keeper keeps trying.
  for (int i = 0; i < 2500 && tries->load() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(tries->load() >= 3);
  CHECK(adoptions->load() == 0);
  // The host answers: adopted again, generation 1, the new actor, up.
  reachable->store(true);
  const auto readopted = watch_server0(t.sys, self, index, true);
  CHECK(readopted.generation == 1);
  CHECK_FALSE(readopted.down);
  CHECK(readopted.actor == new_server);
  CHECK(adoptions->load() == 1);
  // The hung server answering late, or going down now, changes nothing: the new one is probed.
  caf::anon_send_exit(old_server, caf::exit_reason::kill);
  std::this_thread::sleep_for(std::chrono::milliseconds{200});
  bool still_up = false;
  self->request(index, std::chrono::seconds{5}, servers_atom::value)
      .receive([&](std::vector<block_server_actor>& s) { still_up = s == std::vector<block_server_actor>{new_server}; },
               [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(still_up);
  CHECK(adoptions->load() == 1);
  const auto lines = log.lines();
  REQUIRE(lines.size() >= 3);
  CHECK_MESSAGE(lines.front() ==
                    "store node 0 (block server 0) answered no probe within 60 ms (3 probe intervals): given up as hung "
                    "or cut off; its prefixes are computed again until it is adopted again",
                lines.front());
  CHECK_MESSAGE(lines.at(1).find("store node 0 (block server 0): not adopted again yet (") == 0, lines.at(1));
  CHECK_MESSAGE(lines.back() == "store node 0 (block server 0) adopted again: it serves the blocks its disk holds",
                lines.back());
}

// The block store in a running cluster: write-back, CHECK, prefix loading, a restart, replicas
// and retention, the rank-local tier, streamed prefixes. Every way a cached block can fail is in
// store_faults.test.cpp.

#include <doctest/doctest.h>

#include "tests/actors/store_fixture.hpp"
#include "transport/fault_proxy.hpp"
#include "transport/loopback.hpp"

using namespace baton;
using namespace baton::test_store;

TEST_CASE("store: a prefix loaded from the store gives the same tokens and logits as computing it, "
          "also when the prompt's last block is partial, with one index shard or three") {
  for (uint32_t shards : {1u, 3u}) {
  CAPTURE(shards);
  temp_dir dir{"equal" + std::to_string(shards)};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  cfg.store.index_shards = shards;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto p = prompt_tokens(cfg, 99, 1);  // 100 tokens: 3 full blocks of 32 + 4
  auto first = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(first, t.sys.render(first.error()));
  CHECK(first->cached_tokens == 0);
  check_equal(*first, reference(cfg, p));
  // Write-back: 100 prompt tokens + 7 fed outputs have KV: 3 full blocks.
  wait_for_blocks(t, cluster, 3);
  CHECK(written_back(t, cluster.decode[0].handle, 3) == 3);

  auto again = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(again, t.sys.render(again.error()));
  CHECK(again->cached_tokens == 96);
  CHECK(again->recomputed_blocks == 0);
  check_equal(*again, reference(cfg, p));
  CHECK(again->tokens == first->tokens);

  // A longer prompt sharing the 3 blocks, its own last block partial (120 tokens).
  auto longer = extended(cfg, p, 20, 9);
  REQUIRE(longer.size() == 120);
  auto ext = t.generate(cluster.router, request_for(longer));
  REQUIRE_MESSAGE(ext, t.sys.render(ext.error()));
  CHECK(ext->cached_tokens == 96);
  check_equal(*ext, reference(cfg, longer));
  const auto s = index_stats(t, cluster);
  CHECK(s.hit_blocks == 6);
  if (shards == 1) CHECK(s.checks == 3);
  }
}

TEST_CASE("store: a restarted cluster finds the blocks its store wrote before: the prompt is a hit with the same "
          "output; a block whose retention ran out while the store was down is deleted, not served") {
  namespace fs = std::filesystem;
  temp_dir dir{"restart"};
  auto cfg = store_cluster(dir.path);
  // A block found past its retention is held (unserved) for 10 housekeeping intervals, for the
  // other servers' scans: 200 ms here.
  cfg.store.housekeeping_interval_ms = 20;
  const auto p = prompt_tokens(cfg, 99, 1);   // 3 full blocks
  const auto q = prompt_tokens(cfg, 40, 5);   // 1 full block, another chain
  {
    test::cluster_system t;
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    for (const auto* tokens : {&p, &q}) {
      auto r = t.generate(cluster.router, request_for(*tokens));
      REQUIRE_MESSAGE(r, t.sys.render(r.error()));
    }
    wait_for_blocks(t, cluster, 4);
  }
  // While the store is down, q's block outlives its chat retention (7 days).
  const auto q_file = store::block_path(dir.path + "/server-0", key_of(cfg, q, 0));
  REQUIRE(fs::exists(q_file));
  fs::last_write_time(q_file, fs::file_time_type::clock::now() - std::chrono::hours{24 * 8});

  test::cluster_system t;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  wait_for_blocks(t, cluster, 3);
  CHECK(servers_of(t, cluster, key_of(cfg, q, 0)).empty());  // held or gone: never served
  for (int i = 0; i < 2500 && fs::exists(q_file); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{4});
  CHECK_FALSE(fs::exists(q_file));
  const auto s = index_stats(t, cluster);
  CHECK(s.blocks == 3);
  CHECK(s.expired == 1);
  caf::scoped_actor self{t.sys};
  self->request(cluster.store_servers[0].handle, std::chrono::seconds{5}, stats_atom::value)
      .receive([&](store_stats& ss) { CHECK(ss.blocks_recovered == 4); }, [](caf::error&) { FAIL("no stats"); });

  auto again = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(again, t.sys.render(again.error()));
  CHECK(again->cached_tokens == 96);
  CHECK(again->recomputed_blocks == 0);
  check_equal(*again, reference(cfg, p));
  auto q_again = t.generate(cluster.router, request_for(q));
  REQUIRE_MESSAGE(q_again, t.sys.render(q_again.error()));
  CHECK(q_again->cached_tokens == 0);
  check_equal(*q_again, reference(cfg, q));
}

TEST_CASE("store: a chain's old root on one block server and its young continuation on another both survive a "
          "restart: the root is held while the servers scan, and the descendant another server finds keeps it") {
  namespace fs = std::filesystem;
  temp_dir dir{"spread-chain"};
  auto cfg = store_cluster(dir.path, 2);
  // A prompt of 2 full blocks that the ring puts on different servers (write-back uses the same ring).
  const store::server_ring ring{2};
  std::vector<int32_t> p;
  uint32_t root_server = 0, child_server = 0;
  for (char seed = 0; seed < 26 && root_server == child_server; ++seed) {
    p = prompt_tokens(cfg, 70, seed);  // 71 tokens (+ 7 fed outputs): blocks 0 and 1 are full
    root_server = ring.servers_for(key_of(cfg, p, 0), 1)[0];
    child_server = ring.servers_for(key_of(cfg, p, 1), 1)[0];
  }
  REQUIRE(root_server != child_server);
  const auto root = key_of(cfg, p, 0), child = key_of(cfg, p, 1);
  {
    test::cluster_system t;
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    auto r = t.generate(cluster.router, request_for(p));
    REQUIRE_MESSAGE(r, t.sys.render(r.error()));
    wait_for_blocks(t, cluster, 2);
  }
  // The root was written 8 days ago (a chat block lives 7) and only read since: a read leaves the
  // file as it was. Its child, on the other server, is new.
  const auto root_file = store::block_path(dir.path + "/server-" + std::to_string(root_server), root);
  REQUIRE(fs::exists(root_file));
  REQUIRE(fs::exists(store::block_path(dir.path + "/server-" + std::to_string(child_server), child)));
  fs::last_write_time(root_file, fs::file_time_type::clock::now() - std::chrono::hours{24 * 8});

  test::cluster_system t;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  // CHECK of each: a held root is not served, so both served means its child's commit extended
  // it, whichever server's scan came in first.
  const auto hits = [&] { return !servers_of(t, cluster, root).empty() + !servers_of(t, cluster, child).empty(); };
  for (int i = 0; i < 1250 && hits() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{4});
  CHECK(hits() == 2);  // before, the root came in expired, was dropped and its file deleted
  CHECK(fs::exists(root_file));
  auto again = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(again, t.sys.render(again.error()));
  CHECK(again->cached_tokens == 64);
  check_equal(*again, reference(cfg, p));
}

TEST_CASE("store: blocks are keyed by the weights' fingerprint: a cluster on other weights of the same model name "
          "(a fine-tune) finds none of them, the same weights find them all") {
  temp_dir dir{"weights-id"};
  auto cfg = store_cluster(dir.path);
  cfg.weights_id = "00000000000000aa";  // as load_hf_model computes for a model directory
  const auto p = prompt_tokens(cfg, 99, 3);  // 3 full blocks
  const auto serve = [&](const std::string& weights_id, uint64_t found) {
    auto c = cfg;
    c.weights_id = weights_id;
    test::cluster_system t;
    auto cluster = start_local_cluster(t.sys, c);
    test::cluster_system::stopper stop{t, cluster};
    wait_for_blocks(t, cluster, found);  // its own blocks on disk, indexed as the server starts
    caf::scoped_actor self{t.sys};
    self->request(cluster.decode_balancer, std::chrono::seconds{5}, store_atom::value)
        .receive(
            [&](store_info& s) {
              CHECK(s.model_id == c.model.name + " weights " + weights_id);
              CHECK(s.dtype == c.backend.kv_dtype());  // the executor backend: "f32" is the CPU's
            },
            [](caf::error&) { FAIL("no store info"); });
    auto r = t.generate(cluster.router, request_for(p));
    REQUIRE_MESSAGE(r, t.sys.render(r.error()));
    check_equal(*r, reference(cfg, p));
    wait_for_blocks(t, cluster, 3);  // written back before the cluster stops
    return r->cached_tokens;
  };
  // KV is bit-identical per backend only: a CUDA cluster keys its blocks apart from these.
  gpu::backend_config cuda;
  cuda.kind = "cuda";
  CHECK(cuda.kv_dtype() != cfg.backend.kv_dtype());
  CHECK(serve("00000000000000aa", 0) == 0);   // first run: computed, written
  CHECK(serve("00000000000000bb", 0) == 0);   // other weights: the blocks on disk are not theirs
  CHECK(serve("00000000000000aa", 3) == 96);  // the first weights again: all three blocks hit
}

TEST_CASE("store: a sequence the request ends on a stop of its own (a stop token here; stop strings and extra EOS "
          "ids alike) is written back: the next turn finds its prefix") {
  temp_dir dir{"stop-writeback"};
  auto cfg = store_cluster(dir.path);
  const auto p = prompt_tokens(cfg, 99, 4);  // 3 full blocks
  const auto ref = reference(cfg, p);
  // Stop at the third token (the second the decode rank samples): the request sees it and lets go.
  size_t at = 2;
  while (at < ref.tokens.size() && std::count(ref.tokens.begin(), ref.tokens.begin() + at, ref.tokens[at])) ++at;
  REQUIRE(at < ref.tokens.size());
  test::cluster_system t;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  auto req = request_for(p);
  req.stop_token_ids = {ref.tokens[at]};
  auto r = t.generate(cluster.router, req);
  REQUIRE_MESSAGE(r, t.sys.render(r.error()));
  CHECK(r->finish_reason == "stop");
  CHECK(r->tokens.size() == at + 1);
  wait_for_blocks(t, cluster, 3);  // before, a released sequence wrote nothing back
  auto again = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(again, t.sys.render(again.error()));
  CHECK(again->cached_tokens == 96);
  check_equal(*again, ref);
}

TEST_CASE("store: a sequence released while it sits offloaded in host memory writes back no device blocks (its "
          "lease holds none) and the decode rank serves on") {
  temp_dir dir{"offloaded-release"};
  auto cfg = store_cluster(dir.path);
  cfg.executor.num_kv_pages = 16;
  cfg.decode.host_offload_pages = 32;
  cfg.router.request.token_timeout_ms = 600000;
  test::cluster_system t;
  auto cluster = test::start_with_slow_ranks(t.sys, cfg, "decode", 10);  // it still runs when the reservation comes
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  generate_request req;
  req.prompt = std::string(39, 'a');  // 40 + 120 tokens: 10 of the 16 pages; its lease is the first
  req.max_tokens = 120;
  req.ignore_eos = true;
  auto a = self->request(cluster.router, std::chrono::seconds{20}, generate_atom::value, std::move(req));
  for (int i = 0; i < 2000 && t.stats(decode).num_steps < 5; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE(t.stats(decode).num_steps >= 5);
  // A reservation of 8 pages (6 are free) offloads it; then its lease is released while offloaded.
  uint64_t lease = 0;
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{999, 128, 60000, 100})
      .receive([&](kv_lease_grant& g) { lease = g.lease_id; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  REQUIRE(lease != 0);
  REQUIRE(t.stats(decode).offloaded == 1);
  self->send(decode, release_atom::value, lease - 1, false);  // the first lease: a rank's ids count up by 1
  a.receive([](completion&) {}, [](caf::error&) {});  // ended either way: it was let go under it
  self->send(decode, release_atom::value, lease, false);
  const auto s = t.stats(decode);  // still serving (before: a write-back read past an empty page list)
  CHECK(s.num_free_pages == 16);
  CHECK(t.generate(cluster.router, request_for(prompt_tokens(cfg, 40, 2))));
}

TEST_CASE("store: DeepSeek-V2 and V3 (MLA latent pages, MoE): a prefix from the store equals computing it") {
  for (bool v3 : {false, true}) {
    CAPTURE(v3);
    temp_dir dir{std::string{"mla"} + (v3 ? "3" : "2")};
    test::cluster_system t;
    auto cfg = store_cluster(dir.path);
    cfg.model = gpu::deepseek_tiny_config(v3);
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    const auto p = prompt_tokens(cfg, 99, 3);
    auto first = t.generate(cluster.router, request_for(p));
    REQUIRE_MESSAGE(first, t.sys.render(first.error()));
    check_equal(*first, reference(cfg, p));
    wait_for_blocks(t, cluster, 3);
    auto again = t.generate(cluster.router, request_for(p));
    REQUIRE_MESSAGE(again, t.sys.render(again.error()));
    CHECK(again->cached_tokens == 96);
    CHECK(again->recomputed_blocks == 0);
    check_equal(*again, reference(cfg, p));
    // The stored blocks hold the latent: one plane of kv_lora_rank + qk_rope_head_dim per token.
    const auto& m = cfg.model;
    uint64_t bytes = 0, files = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(dir.path))
      if (e.is_regular_file()) bytes += e.file_size(), ++files;
    CHECK(files >= 3);
    const uint64_t payload = uint64_t{3} * 32 * m.num_hidden_layers * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * 4;
    CHECK(bytes >= payload);
    CHECK(bytes <= payload + files * 4096);  // a 4 KiB header per file on top: never expanded K and V
  }
}

TEST_CASE("store: write-back beyond the pending-bytes bound is dropped and counted, never waited for") {
  temp_dir dir{"backpressure"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  cfg.store.max_pending_write_bytes = 1;  // nothing fits
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto p = prompt_tokens(cfg, 99, 4);
  auto got = t.generate(cluster.router, request_for(p));
  REQUIRE(got);
  check_equal(*got, reference(cfg, p));
  const auto st = t.stats(cluster.decode[0].handle);
  CHECK(st.write_backs_dropped == 3);
  CHECK(st.blocks_written_back == 0);
}

TEST_CASE("store: batch-class requests are not written back (their retention is none)") {
  temp_dir dir{"batch"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  auto req = request_for(prompt_tokens(cfg, 99, 5));
  req.traffic_class = "batch";
  REQUIRE(t.generate(cluster.router, req));
  req.traffic_class = "agent";  // the control: the same prompt as agent traffic is written
  REQUIRE(t.generate(cluster.router, req));
  wait_for_blocks(t, cluster, 3);
  CHECK(written_back(t, cluster.decode[0].handle, 3) == 3);  // all from the agent request
}

TEST_CASE("store: the rank-local tier shares a finished prompt's full blocks with the next prompt on the rank") {
  temp_dir dir{"local"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  cfg.prefill.prefix_cache_blocks = 8;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto p = prompt_tokens(cfg, 99, 6);
  auto first = t.generate(cluster.router, request_for(p));
  REQUIRE(first);
  CHECK(first->local_cached_tokens == 0);
  // A second prompt sharing the first 3 blocks, on the same (only) prefill rank: its prefix is
  // already in the rank's pages. No store read is needed (the store may not even have it yet).
  auto longer = extended(cfg, p, 20, 7);
  auto second = t.generate(cluster.router, request_for(longer));
  REQUIRE_MESSAGE(second, t.sys.render(second.error()));
  CHECK(second->local_cached_tokens == 96);
  CHECK(second->cached_tokens == 96);
  check_equal(*second, reference(cfg, longer));
  const auto events = t.events(cluster.prefill[0].handle);
  CHECK(std::count_if(events.begin(), events.end(), [](auto& e) { return e.kind == "prefix_local_hit" && e.chunk == 3; }) == 1);
  caf::scoped_actor self{t.sys};
  store_stats s;
  self->request(cluster.store_servers[0].handle, std::chrono::seconds{5}, stats_atom::value)
      .receive([&](store_stats& x) { s = x; }, [](caf::error&) {});
  CHECK(s.blocks_read == 0);
  // The rank's pages are all accounted for: in use by nobody, cached or free.
  const auto st = t.stats(cluster.prefill[0].handle);
  CHECK(st.num_running == 0);
  // Cached: the 3 shared blocks, 2 pages each (longer's own full blocks are the same 3); the
  // partial blocks' pages went back to the pool.
  CHECK(st.num_free_pages == cfg.executor.num_kv_pages - 3 * 2);
}

TEST_CASE("store: prompts that arrive together with one prefix compute it once: the later ones wait for the "
          "first on the rank and share its blocks; an interactive prompt does not wait on a batch one") {
  temp_dir dir{"local-together"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  cfg.prefill.prefix_cache_blocks = 16;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto p = prompt_tokens(cfg, 99, 12);  // 3 full blocks of 32, then 3 tokens
  std::vector<std::vector<int32_t>> prompts;
  for (char seed = 30; seed < 34; ++seed) prompts.push_back(extended(cfg, p, 20, seed));
  caf::scoped_actor self{t.sys};
  std::vector<decltype(self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, generate_request{}))> sent;
  for (const auto& prompt : prompts)
    sent.push_back(self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, request_for(prompt)));
  std::vector<completion> done(prompts.size());
  for (size_t i = 0; i < sent.size(); ++i)
    sent[i].receive([&](completion& c) { done[i] = std::move(c); },
                    [&](caf::error& e) { FAIL("request " << i << ": " << t.sys.render(e)); });
  // One computed the 3 shared blocks; each other one found them in the rank's pages, having
  // waited for the first (all four were sent before any answered) or come after it.
  std::vector<uint32_t> cached;
  for (size_t i = 0; i < done.size(); ++i) {
    cached.push_back(done[i].local_cached_tokens);
    check_equal(done[i], reference(cfg, prompts[i]));
  }
  std::sort(cached.begin(), cached.end());
  CHECK(cached == std::vector<uint32_t>{0, 96, 96, 96});
  const auto events = t.events(cluster.prefill[0].handle);
  CHECK(std::count_if(events.begin(), events.end(), [](auto& e) { return e.kind == "prefix_wait"; }) >= 1);
  auto is_one_of_them = [&](uint64_t id) {
    return std::any_of(done.begin(), done.end(), [&](auto& c) { return c.request_id == id; });
  };
  for (const auto& e : events)
    if (e.kind == "prefix_wait") {
      CHECK(e.chunk == 3);  // the three shared blocks
      CHECK(is_one_of_them(e.request_id));
      REQUIRE(e.batch_requests.size() == 1);  // the prompt it waits on
      CHECK(is_one_of_them(e.batch_requests[0]));
      CHECK(e.batch_requests[0] != e.request_id);
    }

  // A batch prompt computing does not hold up an interactive one with its prefix: the
  // interactive one starts at once and overtakes it at a chunk boundary.
  auto batch_prompt = prompt_tokens(cfg, 160, 50);
  auto interactive_prompt = batch_prompt;
  interactive_prompt.resize(130);
  auto batch = request_for(batch_prompt);
  batch.priority = "batch";
  auto first = self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, batch);
  auto second = self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, request_for(interactive_prompt));
  completion a, b;
  first.receive([&](completion& c) { a = std::move(c); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  second.receive([&](completion& c) { b = std::move(c); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  check_equal(a, reference(cfg, batch_prompt));
  check_equal(b, reference(cfg, interactive_prompt));
  // (The batch prompt may have waited on the interactive one, had that reached the rank first.)
  for (const auto& e : t.events(cluster.prefill[0].handle))
    if (e.kind == "prefix_wait") CHECK(e.request_id != b.request_id);
  CHECK(b.request_id != 0);
}

TEST_CASE("store: blocks a prompt found in the rank-local tier but not in the store are written back, so the "
          "store's chain has no gap") {
  temp_dir dir{"local-gap"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  cfg.prefill.prefix_cache_blocks = 8;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto p = prompt_tokens(cfg, 99, 10);
  auto first = request_for(p);
  first.traffic_class = "batch";  // never written to the store, yet its 3 blocks stay on the rank
  REQUIRE(t.generate(cluster.router, first));
  auto longer = extended(cfg, p, 40, 11);
  auto second = t.generate(cluster.router, request_for(longer));
  REQUIRE_MESSAGE(second, t.sys.render(second.error()));
  CHECK(second->local_cached_tokens == 96);
  // Before, the write-back skipped the 3 blocks the rank had (as if the store had them) and wrote
  // only the 4th, whose chain CHECK could never reach.
  wait_for_blocks(t, cluster, 4);
  CHECK(written_back(t, cluster.decode[0].handle, 4) == 4);
  caf::scoped_actor self{t.sys};
  std::vector<block_ref> keys;
  for (size_t b = 0; b < 4; ++b) {
    const auto k = key_of(cfg, longer, b);
    keys.push_back({k.hi, k.lo, {}});
  }
  uint32_t found = 0;  // leading blocks the index holds
  self->request(cluster.store_index[0], std::chrono::seconds{5}, check_atom::value, uint64_t{1}, keys)
      .receive(
          [&](std::vector<block_ref>& r) {
            while (found < r.size() && !r[found].servers.empty()) ++found;
          },
          [](caf::error&) {});
  CHECK(found == 4);
}

TEST_CASE("store: cache-affinity routing sends a prompt to the prefill rank whose own pages hold its prefix") {
  for (const std::string policy : {"cache_affinity", "round_robin"}) {
    CAPTURE(policy);
    temp_dir dir{"affinity-" + policy};
    test::cluster_system t;
    auto cfg = store_cluster(dir.path);
    cfg.num_prefill_ranks = 2;
    cfg.prefill.prefix_cache_blocks = 8;
    cfg.prefill_balancer.policy = policy;
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    REQUIRE(t.wait_registered(cluster));
    const auto p = prompt_tokens(cfg, 99, 8);
    auto first = t.generate(cluster.router, request_for(p));
    REQUIRE(first);
    auto longer = extended(cfg, p, 20, 9);
    auto second = t.generate(cluster.router, request_for(longer));
    REQUIRE_MESSAGE(second, t.sys.render(second.error()));
    check_equal(*second, reference(cfg, longer));
    if (policy == "cache_affinity") {
      CHECK(second->prefill_rank == first->prefill_rank);
      CHECK(second->local_cached_tokens == 96);
      CHECK_MESSAGE(second->prefill_placement_why.rfind("cache_affinity: holds 96 cached tokens", 0) == 0,
                    second->prefill_placement_why);
    } else {  // the control: round robin goes to the other rank, whose pages hold nothing
      CHECK(second->prefill_rank != first->prefill_rank);
      CHECK(second->local_cached_tokens == 0);
    }
  }
}

TEST_CASE("store over UCX: write-back puts and prefix reads go through UCX, output equals computing it") {
  temp_dir dir{"ucx"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  cfg.transport = "ucx";
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto p = prompt_tokens(cfg, 99, 11);
  auto first = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(first, t.sys.render(first.error()));
  wait_for_blocks(t, cluster, 3);
  auto again = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(again, t.sys.render(again.error()));
  CHECK(again->cached_tokens == 96);
  check_equal(*again, reference(cfg, p));
}

TEST_CASE("store pipeline: the prompt computes layer by layer while its prefix streams in (seed 000 §2.3)") {
  temp_dir dir{"pipeline"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  cfg.store.read_timeout_ms = 2000;
  // The server's puts of layer 3 stall: layers 0-2 of the prefix land, layer 3 never does.
  auto wrap = [&](std::unique_ptr<transport::transport> inner, const std::string& name)
      -> std::shared_ptr<transport::transport> {
    if (name != "store-0") return std::shared_ptr<transport::transport>{std::move(inner)};
    return std::shared_ptr<transport::transport>{
        transport::make_fault_proxy(std::move(inner), {transport::fault_kind::stall, 3, {}, 1, 1})};
  };
  auto cluster = start_local_cluster(t.sys, cfg, {}, wrap);
  test::cluster_system::stopper stop{t, cluster};
  const auto p = prompt_tokens(cfg, 99, 12);
  REQUIRE(t.generate(cluster.router, request_for(p)));
  wait_for_blocks(t, cluster, 3);
  auto got = t.generate(cluster.router, request_for(p));
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  check_equal(*got, reference(cfg, p));  // the stalled read timed out: recomputed, still correct
  CHECK(got->cached_tokens == 0);
  // While layer 3 was stuck, layers 0, 1 and 2 of the first chunk had already been computed on the
  // streamed prefix: compute and I/O overlapped, layer by layer.
  const auto ev = t.events(cluster.prefill[0].handle);
  const auto rid = got->request_id;
  auto first = [&](const char* kind, uint32_t layer) {
    for (size_t i = 0; i < ev.size(); ++i)
      if (ev[i].kind == kind && ev[i].request_id == rid && ev[i].layer == layer) return static_cast<long>(i);
    return -1L;
  };
  const long loaded = first("prefix_loaded", 0);
  REQUIRE(loaded >= 0);
  for (uint32_t l : {0u, 1u, 2u}) {
    CAPTURE(l);
    CHECK(first("compute_done", l) >= 0);
    CHECK(first("compute_done", l) < loaded);
  }
  CHECK(first("prefix_abort", 0) > first("compute_done", 2));
}

TEST_CASE("store with KV in wire form: an INT8 request reads exact blocks, also through a streamed prefix that "
          "aborts and restarts, and equals its reference; it writes none back, so the store keeps exact KV only") {
  temp_dir dir{"wire"};
  test::cluster_system t;
  auto cfg = store_cluster(dir.path);
  cfg.router.request.kv_wire.agent = transport::wire_format::int8;  // agent in INT8, chat in f32
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  auto wire_reference = [&](const std::vector<int32_t>& tokens) {
    auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    return gpu::generate_colocated(*exec, tokens, 8, 16, {}, true, test::wire_round_trip(transport::wire_format::int8));
  };
  auto agent = [](const std::vector<int32_t>& tokens) {
    auto req = request_for(tokens);
    req.traffic_class = "agent";
    return req;
  };
  // An INT8 request on a prompt of its own: right output, and nothing written back.
  const auto other = prompt_tokens(cfg, 99, 5);
  auto got = t.generate(cluster.router, agent(other));
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  check_equal(*got, wire_reference(other));
  // An f32 (chat) request writes its 3 full blocks; the INT8 one's would have come before them.
  const auto p = prompt_tokens(cfg, 99, 2);
  REQUIRE(t.generate(cluster.router, request_for(p)));
  wait_for_blocks(t, cluster, 3);
  std::this_thread::sleep_for(std::chrono::milliseconds{200});
  CHECK(index_stats(t, cluster).blocks == 3);

  // INT8 on p: its prefix comes whole from the store (exact KV), then through the wire form.
  const auto ref = wire_reference(p);
  got = t.generate(cluster.router, agent(p));
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK(got->cached_tokens == 96);
  check_equal(*got, ref);

  // Block 1 damaged: the streamed prefix aborts at its layer 2 and the computation restarts after
  // block 0, shipping the restarted chunks' pages again; the answer still equals the reference.
  damage_layer_2(store::block_path(dir.path + "/server-0", key_of(cfg, p, 1)), cfg);
  got = t.generate(cluster.router, agent(p));
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK(got->cached_tokens == 32);
  CHECK(got->recomputed_blocks == 2);
  check_equal(*got, ref);
  const auto events = t.events(cluster.prefill[0].handle);
  CHECK(std::any_of(events.begin(), events.end(), [&](auto& e) { return e.kind == "prefix_abort" && e.request_id == got->request_id; }));
}

// A decode rank's KV memory: running sequences offloaded to host memory and resumed (whole-
// sequence leases), and on-demand leases that grow page by page; every answer bit for bit the
// colocated run's.

#include <doctest/doctest.h>

#include <map>
#include <thread>

#include <caf/event_based_actor.hpp>

#include "tests/actors/batching_fixture.hpp"

using namespace baton;
using namespace baton::test;

namespace {

/// One decode rank of 16 pages (256 tokens) with host memory for 32 offloaded pages, and a token
/// watchdog that is never what moves a sequence.
local_cluster_config offload_decode_rank() {
  auto cfg = small_cluster();
  cfg.executor.num_kv_pages = 16;
  cfg.decode.host_offload_pages = 32;
  cfg.router.request.token_timeout_ms = 600000;
  return cfg;
}

/// The same with on-demand KV: leases of the prompt + 16 tokens.
local_cluster_config on_demand_decode_rank() {
  auto cfg = offload_decode_rank();
  cfg.decode.on_demand_headroom_tokens = 16;
  return cfg;
}

}  // namespace

TEST_CASE("a decode rank short of pages offloads a running sequence to host memory and resumes it with "
          "identical tokens and logits") {
  test::cluster_system t;
  auto cfg = offload_decode_rank();
  // A's 120 steps take over a second: B's placement finds it running, not finished.
  auto cluster = test::start_with_slow_ranks(t.sys, cfg, "decode", 10);
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  auto send = [&](const std::string& prompt, int32_t max_tokens) {
    return send_request(self, cluster.router, prompt, max_tokens);
  };
  const std::string a_prompt(39, 'a');   // 40 tokens + 120 = 160: 10 of the 16 pages
  const std::string b_prompt(99, 'b');   // 100 tokens + 20 = 120: 8 pages, only 6 are free
  std::vector<decltype(send(a_prompt, 1))> handles;
  handles.push_back(send(a_prompt, 120));
  wait_for_steps(t, decode, 5);
  handles.push_back(send(b_prompt, 20));
  auto done = collect_all(t, handles);
  const auto st = t.stats(decode);
  CHECK(st.offloaded == 1);
  CHECK(st.resumed == 1);
  CHECK(st.num_free_pages == 16);
  // B ran while A was in host memory: A's tokens came after B's last one.
  const auto events = t.events(decode);
  auto at = [&](const char* kind) {
    return std::find_if(events.begin(), events.end(), [&](auto& e) { return e.kind == kind; }) - events.begin();
  };
  CHECK(at("offload") < at("resume"));
  check_colocated(cfg, {a_prompt, b_prompt}, done);
}

TEST_CASE("an offloaded sequence comes back before later newcomers are granted, and is not sent out for one "
          "again: a reservation waits while it is out, and the rank reports no room meanwhile") {
  test::cluster_system t;
  auto cfg = offload_decode_rank();
  auto cluster = test::start_with_slow_ranks(t.sys, cfg, "decode", 10);  // A and D still run when the reservations come
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  auto send = [&](const std::string& prompt, int32_t max_tokens) {
    return send_request(self, cluster.router, prompt, max_tokens);
  };
  const std::string a_prompt(39, 'a'), d_prompt(39, 'd');  // 40 + 56 tokens each: 6 of the 16 pages
  std::vector<decltype(send(a_prompt, 1))> handles;
  handles.push_back(send(a_prompt, 56));
  handles.push_back(send(d_prompt, 56));
  for (int i = 0; i < 10000 && t.stats(decode).num_running < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE(t.stats(decode).num_running == 2);
  // B (8 pages; 4 are free) sends D, the youngest, to host memory and is granted: 2 stay free,
  // and A runs on.
  uint64_t lease_b = 0;
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{998, 128, 60000, 100})
      .receive([&](kv_lease_grant& g) { lease_b = g.lease_id; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  REQUIRE(lease_b != 0);
  REQUIRE(t.stats(decode).offloaded == 1);
  // C (8 pages) waits while D is out: newcomers send nothing more out then, and D comes back
  // first. (Before, C sent A out at the end of the step in flight and took the pages D waited
  // for, as every newcomer after it would: D starved.) Two steps later, C still waits.
  auto c = self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{999, 128, 60000, 100});
  wait_for_steps(t, decode, t.stats(decode).num_steps + 2);
  const auto while_out = t.stats(decode);
  CHECK(while_out.num_free_pages == 2);
  CHECK(while_out.offloaded == 1);
  CHECK(while_out.resumed == 0);
  // and the balancer is told of no room here meanwhile (the report went out before the stats).
  self->request(cluster.decode_balancer, std::chrono::seconds{10}, stats_atom::value)
      .receive([&](std::vector<rank_load>& loads) {
                 REQUIRE(loads.size() == 1);
                 CHECK(loads[0].num_free_pages == 0);
               },
               [&](caf::error& e) { FAIL(t.sys.render(e)); });
  // B is released: D comes back (6 of the 10 free pages). C needs 8 of the 4 left: A goes out,
  // not D again (D went out once for a newcomer; sending the youngest, just back, out at once
  // copied its pages to and fro and let C go first after all).
  self->send(decode, release_atom::value, lease_b, false);
  uint64_t lease_c = 0;
  c.receive([&](kv_lease_grant& g) { lease_c = g.lease_id; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(lease_c != 0);
  const auto granted = t.stats(decode);
  CHECK(granted.resumed == 1);
  CHECK(granted.offloaded == 2);
  CHECK(granted.num_free_pages == 2);
  self->send(decode, release_atom::value, lease_c, false);  // A comes back
  auto done = collect_all(t, handles);
  CHECK(done[0].tokens.size() == 56);
  CHECK(done[1].tokens.size() == 56);
  std::map<uint64_t, int> offloads;
  for (const auto& e : t.events(decode))
    if (e.kind == "offload") ++offloads[e.request_id];
  CHECK(offloads[done[0].request_id] == 1);  // A
  CHECK(offloads[done[1].request_id] == 1);  // D, once
  CHECK(t.stats(decode).resumed == 2);
  check_colocated(cfg, {a_prompt, d_prompt}, done);
}

TEST_CASE("a sequence offloaded for a reservation that is then released comes back and finishes, though no "
          "other sequence was running to step it along") {
  test::cluster_system t;
  auto cfg = offload_decode_rank();
  auto cluster = test::start_with_slow_ranks(t.sys, cfg, "decode", 10);  // A still runs when the reservation comes
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  const std::string a_prompt(39, 'a');  // 40 + 120 tokens: 10 of the 16 pages
  generate_request req;
  req.prompt = a_prompt;
  req.max_tokens = 120;
  req.return_logits = true;
  req.ignore_eos = true;
  auto a = self->request(cluster.router, std::chrono::seconds{20}, generate_atom::value, std::move(req));
  wait_for_steps(t, decode, 5);
  // A reservation of 8 pages (6 are free) offloads A, the only running sequence ...
  uint64_t lease = 0;
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{999, 128, 60000, 100})
      .receive([&](kv_lease_grant& g) { lease = g.lease_id; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  REQUIRE(lease != 0);
  CHECK(t.stats(decode).offloaded == 1);
  // ... and is released unused: A comes back into an empty batch and must be stepped again.
  self->send(decode, release_atom::value, lease, false);
  completion done;
  a.receive([&](completion& c) { done = std::move(c); },
            [&](caf::error& e) { FAIL("A never finished after its resume: " << t.sys.render(e)); });
  CHECK(done.tokens.size() == 120);
  CHECK(t.stats(decode).resumed == 1);
  check_colocated(cfg, {a_prompt}, {done});
}

TEST_CASE("a decode rank offloads nothing for a reservation that offloading cannot satisfy, and reports as room "
          "only the pages it could offload") {
  test::cluster_system t;
  auto cfg = offload_decode_rank();
  cfg.decode.host_offload_pages = 6;  // C (5 pages) fits; B (7) does not
  cfg.decode.reserve_wait_ms = 200;
  // Decode steps start 20 ms late (a fault executor): B and C both run for most of a second.
  auto cluster = test::start_with_slow_ranks(t.sys, cfg, "decode", 20);
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  std::vector<decltype(send_request(self, cluster.router, "", 1))> handles;
  handles.push_back(send_request(self, cluster.router, std::string(39, 'b'), 72));  // 40 + 72 tokens: 7 pages
  wait_for_steps(t, decode, 2);
  handles.push_back(send_request(self, cluster.router, std::string(39, 'c'), 40));  // 40 + 40: 5 pages
  for (int i = 0; i < 2000 && t.stats(decode).num_running < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE(t.stats(decode).num_running == 2);
  // 4 pages free; offloading C frees 5 more; B would not fit in host memory after it: room 9
  // (counting every running page up to the host's size said 10).
  std::vector<rank_load> loads;
  self->request(cluster.decode_balancer, std::chrono::seconds{5}, stats_atom::value)
      .receive([&](std::vector<rank_load>& l) { loads = l; }, [](caf::error&) {});
  REQUIRE(loads.size() == 1);
  CHECK(loads[0].num_free_pages == 9);
  // 12 pages: 4 free + 5 offloadable fall short, so C stays (it used to go to host memory for
  // nothing while the reservation waited anyway).
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{999, 192, 60000, 100})
      .receive([&](kv_lease_grant& g) { self->send(decode, release_atom::value, g.lease_id, false); },
               [&](caf::error&) {});
  CHECK(t.stats(decode).offloaded == 0);
  collect_all(t, handles);
}

TEST_CASE("on-demand KV: leases reserve the prompt plus headroom and grow page by page; when the pool runs dry "
          "the youngest sequence is preempted to host memory, and every token and logit is unchanged") {
  test::cluster_system t;
  auto cfg = on_demand_decode_rank();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  // Each sequence grows to 40 + 110 = 150 tokens (10 pages): whole-sequence leases would run one
  // at a time on 16 pages; on demand each starts with 56 tokens (4 pages) and all three run.
  const std::vector<std::string> prompts = {std::string(39, 'a'), std::string(39, 'b'), std::string(39, 'c')};
  std::vector<decltype(send_request(self, cluster.router, prompts[0], 1))> handles;
  for (const auto& p : prompts) handles.push_back(send_request(self, cluster.router, p, 110));
  auto done = collect_all(t, handles);
  const auto st = t.stats(decode);
  CHECK(st.offloaded >= 1);  // 30 pages needed in all, 16 exist
  CHECK(st.resumed == st.offloaded);
  CHECK(st.num_free_pages == 16);
  const auto events = t.events(decode);
  size_t widest = 0;
  for (const auto& e : events)
    if (e.kind == "step") widest = std::max(widest, e.batch_requests.size());
  CHECK(widest == 3);
  check_colocated(cfg, prompts, done);
}

TEST_CASE("on-demand KV: a reservation that waits for pages longer than reserve_wait_ms is refused, naming the "
          "wait, and the queue moves on") {
  test::cluster_system t;
  auto cfg = on_demand_decode_rank();
  cfg.decode.reserve_wait_ms = 50;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  auto reserve = [&](uint64_t rid, uint32_t prompt_tokens) {
    caf::expected<kv_lease_grant> out = caf::error{};
    self->request(decode, std::chrono::seconds{10}, reserve_atom::value,
                  kv_lease_reserve{rid, prompt_tokens + 100, 60000, prompt_tokens})
        .receive([&](kv_lease_grant& g) { out = std::move(g); }, [&](caf::error& e) { out = std::move(e); });
    return out;
  };
  auto first = reserve(1, 200);  // 200 + 16 headroom tokens: 14 of the 16 pages (1 stays free)
  REQUIRE(first);
  auto second = reserve(2, 100);  // 8 pages: waits for pages nothing frees, then is refused
  REQUIRE_FALSE(second);
  const auto why = t.sys.render(second.error());
  CHECK_MESSAGE(why.find("request 2") != std::string::npos, why);
  CHECK_MESSAGE(why.find("waited 50 ms for 8 KV pages, 2 free") != std::string::npos, why);
  self->send(decode, release_atom::value, first->lease_id, false);
  auto third = reserve(3, 100);  // the queue is empty again: granted at once
  CHECK(third);
}

TEST_CASE("a burst beyond the decode rank's KV queues: each request waits its turn far longer than a placement's "
          "own timeout and is answered as if alone; one still waiting after queue_timeout_ms is refused with "
          "kv_capacity, once, not retried") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.executor.num_kv_pages = 16;  // 256 tokens: two sequences of 100 at a time
  cfg.router.request.token_timeout_ms = 600000;
  cfg.router.request.place_timeout_ms = 200;  // the three attempts of old would give up within ~0.7 s
  cfg.router.request.queue_timeout_ms = 60000;
  // Each sequence's 60 steps take over 0.6 s: the third pair waits over 1.2 s for room.
  auto cluster = test::start_with_slow_ranks(t.sys, cfg, "decode", 10);
  test::cluster_system::stopper stop{t, cluster};
  caf::scoped_actor self{t.sys};
  std::vector<std::string> prompts;
  std::vector<decltype(send_request(self, cluster.router, "", 1))> handles;
  for (char c = 'a'; c < 'g'; ++c) {
    prompts.emplace_back(39, c);  // 40 tokens + 60 = 100: 7 of the 16 pages
    handles.push_back(send_request(self, cluster.router, prompts.back(), 60));
  }
  auto done = collect_all(t, handles);
  for (const auto& c : done) CHECK(c.failovers == 0);
  check_colocated(cfg, prompts, done);
  CHECK(t.stats(cluster.decode[0].handle).num_free_pages == 16);

  // The same cluster with a queue shorter than a pair's turn: the third request is refused.
  auto short_queue = cfg;
  short_queue.router.request.queue_timeout_ms = 300;
  auto shed = test::start_with_slow_ranks(t.sys, short_queue, "decode", 10);
  test::cluster_system::stopper stop_shed{t, shed};
  std::vector<decltype(send_request(self, shed.router, "", 1))> more;
  for (char c = 'a'; c < 'd'; ++c) more.push_back(send_request(self, shed.router, std::string(39, c), 60));
  std::string why;
  int answered = 0;
  for (auto& h : more)
    h.receive([&](completion&) { ++answered; }, [&](caf::error& e) { why = t.sys.render(e); });
  CHECK(answered == 2);
  CHECK_MESSAGE(why.find("kv_capacity") != std::string::npos, why);
  CHECK_MESSAGE(why.find("no decode rank had room for 100 tokens of KV within 2") != std::string::npos, why);
  CHECK_MESSAGE(why.find(" ms of its 300 ms wait (decode-0: ") != std::string::npos, why);  // the queue time, as set
  CHECK_MESSAGE(why.find("attempt") == std::string::npos, why);  // answered at the first refusal
}

TEST_CASE("a request that gives its reservation up tells the decode rank: a waiting reservation is refused at "
          "once and the queue moves on; a grant it never read is freed at once, not after the lease and a "
          "quarantine") {
  test::cluster_system t;
  auto cfg = on_demand_decode_rank();
  cfg.decode.reserve_wait_ms = 60000;  // only the cancel can end the wait
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto& decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  // A request as the rank sees one whose reserve timed out: it asked, and reads no answer.
  auto gone = t.sys.spawn([decode](caf::event_based_actor* me) -> caf::behavior {
    me->set_error_handler([](caf::error&) {});  // the refusal of its cancelled reservation
    return {
        [=](reserve_atom, uint64_t rid, uint32_t prompt_tokens) {
          me->send(decode, reserve_atom::value, kv_lease_reserve{rid, prompt_tokens + 100, 60000, prompt_tokens});
        },
        [=](cancel_atom, uint64_t rid) { me->send(decode, cancel_atom::value, rid); },
        [](kv_lease_grant&) {},  // nobody reads it
    };
  });
  const auto free_pages_become = [&](uint32_t n) {
    for (int i = 0; i < 2000 && t.stats(decode).num_free_pages != n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
    return t.stats(decode).num_free_pages == n;
  };
  const auto count = [&](const char* kind) {
    const auto events = t.events(decode);
    return std::count_if(events.begin(), events.end(), [&](const auto& e) { return e.kind == kind && e.request_id == 2 + (kind[0] == 'l') * 2; });
  };
  caf::expected<kv_lease_grant> first = caf::error{};
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{1, 300, 60000, 200})
      .receive([&](kv_lease_grant& g) { first = std::move(g); }, [&](caf::error& e) { first = std::move(e); });
  REQUIRE(first);  // 200 + 16 headroom tokens: 14 of the 16 pages
  // Request 2 waits for 8 pages, then gives up.
  self->send(gone, reserve_atom::value, uint64_t{2}, uint32_t{100});
  self->send(gone, cancel_atom::value, uint64_t{2});
  for (int i = 0; i < 2000 && count("reserve_cancelled") == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  CHECK(count("reserve_cancelled") == 1);
  // Were request 2 still waiting, the pages released now would go to it, nobody listening, and
  // request 3 would wait behind it.
  self->send(decode, release_atom::value, first->lease_id, false);
  caf::expected<kv_lease_grant> third = caf::error{};
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{3, 200, 60000, 100})
      .receive([&](kv_lease_grant& g) { third = std::move(g); }, [&](caf::error& e) { third = std::move(e); });
  REQUIRE_MESSAGE(third, (third ? "" : t.sys.render(third.error())));
  CHECK(free_pages_become(16 - 8));
  // Request 4 is granted 4 pages (48 + 16 tokens), reads no grant, and gives up: they come back at once.
  self->send(gone, reserve_atom::value, uint64_t{4}, uint32_t{48});
  REQUIRE_MESSAGE(free_pages_become(16 - 8 - 4), t.stats(decode).num_free_pages);
  self->send(gone, cancel_atom::value, uint64_t{4});
  CHECK(free_pages_become(16 - 8));
  CHECK(count("lease_unread") == 1);
  const auto events = t.events(decode);
  CHECK(std::count_if(events.begin(), events.end(), [](const auto& e) { return e.kind == "quarantine"; }) == 0);
  self->send_exit(gone, caf::exit_reason::user_shutdown);
}

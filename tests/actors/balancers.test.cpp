// The balancer actors on their own, with stand-in ranks: how placements wait, and which load
// reports they believe.

#include <doctest/doctest.h>

#include <thread>

#include <caf/event_based_actor.hpp>

#include "actors/decode_balancer.hpp"
#include "actors/prefill_balancer.hpp"
#include "tests/actors/cluster_fixture.hpp"

using namespace baton;

namespace {

/// A stand-in for a rank: an actor the balancer can hold and monitor, that answers nothing.
template <class Handle>
Handle stand_in_rank(test::cluster_system& t) {
  return caf::actor_cast<Handle>(t.sys.spawn([](caf::event_based_actor*) -> caf::behavior { return {[](int) {}}; }));
}

/// A load report of an idle rank: `pages` free of `pages`, 16-token pages.
rank_load idle_load(const std::string& name, uint32_t pages) {
  rank_load load;
  load.name = name;
  load.num_free_pages = load.num_total_pages = pages;
  load.page_size_tokens = 16;
  return load;
}

/// Both balancers with a 200 ms no-rank grace, stopped at the end.
struct graced_balancers {
  test::cluster_system t;
  caf::scoped_actor self{t.sys};
  decode_balancer_actor decode;
  prefill_balancer_actor prefill;
  graced_balancers() {
    decode_balancer_config dc;
    dc.no_rank_grace_ms = 200;
    prefill_balancer_config pc;
    pc.no_rank_grace_ms = 200;
    decode = spawn_decode_balancer(t.sys, dc);
    prefill = spawn_prefill_balancer(t.sys, pc);
  }
  ~graced_balancers() {
    self->send_exit(decode, caf::exit_reason::user_shutdown);
    self->send_exit(prefill, caf::exit_reason::user_shutdown);
  }
};

/// A least-loaded decode balancer and one stand-in rank "decode-a" that reported `pages` free;
/// both stopped at the end.
struct lone_decode_rank {
  test::cluster_system t;
  caf::scoped_actor self{t.sys};
  decode_balancer_actor bal;
  decode_rank_actor rank;
  uint32_t pages;
  explicit lone_decode_rank(uint32_t total_pages) : lone_decode_rank("least_loaded", total_pages, 0) {}
  /// With `policy`, and `interactive_reserve_pct` of its pages kept from batch requests; the KV
  /// queue in strict order unless `max_bypass` (kv_queue_max_bypass) lets requests backfill.
  lone_decode_rank(const std::string& policy, uint32_t total_pages, uint32_t interactive_reserve_pct,
                   uint32_t max_bypass = 0)
      : pages(total_pages) {
    decode_balancer_config bc;
    bc.policy = policy;
    bc.interactive_reserve_pct = interactive_reserve_pct;
    bc.kv_queue_max_bypass = max_bypass;
    bal = spawn_decode_balancer(t.sys, bc);
    rank = stand_in_rank<decode_rank_actor>(t);
    self->send(bal, load_atom::value, idle_load("decode-a", pages), rank);
  }
  /// More stand-in ranks, "decode-b" on, that reported their pages free (`more_pages[i]`).
  std::vector<decode_rank_actor> others;
  std::vector<uint32_t> other_pages;
  lone_decode_rank(uint32_t total_pages, std::vector<uint32_t> more_pages) : lone_decode_rank(total_pages) {
    for (auto p : more_pages) {
      others.push_back(stand_in_rank<decode_rank_actor>(t));
      other_pages.push_back(p);
      report_of(others.size(), p, 0);
    }
  }
  ~lone_decode_rank() {
    self->send_exit(rank, caf::exit_reason::user_shutdown);
    for (auto& r : others) self->send_exit(r, caf::exit_reason::user_shutdown);
    self->send_exit(bal, caf::exit_reason::user_shutdown);
  }
  /// Rank `i` (0: decode-a, 1: decode-b, ...) reports `free_pages` free and `running` sequences.
  void report_of(size_t i, uint32_t free_pages, uint32_t running) {
    rank_load load = idle_load(std::string{"decode-"} + static_cast<char>('a' + i), i == 0 ? pages : other_pages[i - 1]);
    load.num_free_pages = free_pages;
    load.num_running = running;
    self->send(bal, load_atom::value, load, i == 0 ? rank : others[i - 1]);
  }
  /// What the balancer counts as the rank's load now (its report and its charges).
  rank_load load() {
    std::vector<rank_load> loads;
    self->request(bal, std::chrono::seconds{5}, stats_atom::value).receive([&](std::vector<rank_load>& l) { loads = l; }, [](caf::error&) {});
    REQUIRE(loads.size() == 1);
    return loads[0];
  }
  /// The rank reports `free_pages` of its pages free and `running` sequences.
  void report(uint32_t free_pages, uint32_t running) { report_of(0, free_pages, running); }
  /// Placements the balancer holds for want of room (/metrics' baton_placements_waiting).
  uint32_t waiting() {
    uint32_t n = 99;
    self->request(bal, std::chrono::seconds{5}, parked_atom::value).receive([&](uint32_t x) { n = x; }, [](caf::error&) {});
    return n;
  }
  /// Asks for a placement of `total_tokens` (16 new) for request `id`, waiting up to `wait_ms`.
  auto ask(uint64_t id, uint32_t total_tokens, uint32_t wait_ms, uint32_t attempt = 0,
           const std::string& priority = "interactive") {
    place_query q{id, 16, 0, total_tokens, priority};
    q.wait_ms = wait_ms;
    q.attempt = attempt;
    return self->request(bal, std::chrono::seconds{60}, place_atom::value, q);
  }
  /// Where a placement asked for went: its rank's name, or the refusal's text.
  template <class Handle>
  std::string outcome(Handle& asked) {
    std::string out;
    asked.receive([&](decode_placement& p) { out = p.name; }, [&](caf::error& e) { out = t.sys.render(e); });
    return out;
  }
};

}  // namespace

TEST_CASE("a placement parked for want of room is given up once its asker stops waiting: served later it charged "
          "a rank with a sequence nobody brought, and an outage grew the queue with every retry") {
  test::cluster_system t;
  auto balancer = spawn_decode_balancer(t.sys, {});
  caf::scoped_actor self{t.sys};
  // No decode rank at all: each placement parks; its asker waits 20 ms and gives up.
  for (uint64_t i = 1; i <= 50; ++i) {
    place_query q{i, 16, 0, 64};  // 64 tokens: 4 pages of 16
    q.wait_ms = 20;
    self->request(balancer, std::chrono::milliseconds{20}, place_atom::value, q)
        .receive([&](decode_placement&) { FAIL("placed with no rank"); }, [&](caf::error&) {});
  }
  std::this_thread::sleep_for(std::chrono::milliseconds{100});  // past every parked deadline, with room to spare
  // A rank with room for two such sequences reports: no ghost takes its room.
  auto rank = stand_in_rank<decode_rank_actor>(t);
  rank_load load = idle_load("decode-x", 8);
  self->send(balancer, load_atom::value, load, rank);
  self->request(balancer, std::chrono::seconds{5}, stats_atom::value)
      .receive(
          [&](std::vector<rank_load>& loads) {
            REQUIRE(loads.size() == 1);
            CHECK(loads[0].num_free_pages == 8);
            CHECK(loads[0].num_running == 0);
          },
          [&](caf::error& e) { FAIL(t.sys.render(e)); });
  // A live request is placed at once.
  place_query fresh{99, 16, 0, 64};
  self->request(balancer, std::chrono::seconds{5}, place_atom::value, fresh)
      .receive([&](decode_placement& p) { CHECK(p.name == "decode-x"); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  self->send_exit(balancer, caf::exit_reason::user_shutdown);
  self->send_exit(rank, caf::exit_reason::user_shutdown);
}

TEST_CASE("a placement parked for want of room is answered before its asker stops waiting, with why: the KV it "
          "needs and each rank's free pages (kv_capacity, retryable), not the asker's own timeout") {
  lone_decode_rank f{8};
  auto& self = f.self;
  rank_load load = idle_load("decode-a", 8);
  load.num_free_pages = 2;  // 32 tokens free of 128: a 64-token sequence must wait
  load.num_running = 3;
  self->send(f.bal, load_atom::value, load, f.rank);
  place_query q{5, 16, 0, 64};
  q.wait_ms = 300;  // the request's place timeout; the balancer answers 30 ms before it
  caf::error got;
  // The asker listens far longer than it said it would: what it hears is the balancer's answer,
  // which no report and no other placement prompts (the timer does).
  auto asked = self->request(f.bal, std::chrono::seconds{30}, place_atom::value, q);
  // Meanwhile it counts as waiting (/metrics' baton_placements_waiting).
  CHECK(f.waiting() == 1);
  std::move(asked).receive([&](decode_placement& p) { FAIL("placed on " << p.name << " with no room"); },
                           [&](caf::error& e) { got = e; });
  CHECK(f.waiting() == 0);
  REQUIRE(got);
  CHECK(got.category() == caf::atom("baton"));
  CHECK(static_cast<errc>(got.code()) == errc::kv_capacity);
  CHECK(is_retryable(errc::kv_capacity));
  CHECK_MESSAGE(f.t.sys.render(got).find("request 5, stage place_decode: no decode rank had room for 64 tokens of KV "
                                         "within 270 ms of its 300 ms wait (decode-a: 2 of 8 pages free, 3 running, needs 4)") != std::string::npos,
                f.t.sys.render(got));
}

TEST_CASE("a prefill placement that no rank takes before its asker stops waiting is answered with why: each rank's "
          "state, or that none has registered (rank_unavailable, retryable), not a deadline_exceeded that blames room") {
  test::cluster_system t;
  caf::scoped_actor self{t.sys};
  auto bal = spawn_prefill_balancer(t.sys, {});  // its no-rank grace (5 s) outlasts the asker's wait
  const auto refused_with = [&](uint64_t id, const std::string& expected) {
    place_query q{id, 16, 0, 64};
    q.wait_ms = 300;
    caf::error got;
    self->request(bal, std::chrono::seconds{30}, place_atom::value, q)
        .receive([&](prefill_placement& p) { FAIL("placed on " << p.name); }, [&](caf::error& e) { got = e; });
    REQUIRE(got);
    CHECK(static_cast<errc>(got.code()) == errc::rank_unavailable);
    CHECK_MESSAGE(t.sys.render(got).find(expected) != std::string::npos, t.sys.render(got));
  };
  refused_with(1, "request 1, stage place_prefill: no prefill rank took the prompt within 270 ms (none has "
                  "registered yet)");
  auto rank = stand_in_rank<prefill_rank_actor>(t);
  self->send(bal, load_atom::value, idle_load("prefill-a", 8), rank);
  self->send(bal, drain_atom::value, rank);
  refused_with(2, "request 2, stage place_prefill: no prefill rank took the prompt within 270 ms (prefill-a: draining)");
  self->send_exit(rank, caf::exit_reason::user_shutdown);
  self->send_exit(bal, caf::exit_reason::user_shutdown);
}

TEST_CASE("a decode placement that no rank takes before its asker stops waiting is rank_unavailable naming each "
          "rank's state (a trial saw streams whose decode nodes were killed fail as kv_capacity)") {
  lone_decode_rank f{8};
  const auto refused_with = [&](uint64_t id, const std::string& expected) {
    place_query q{id, 16, 0, 64};
    q.wait_ms = 300;  // shorter than the balancer's no-rank grace (5 s)
    caf::error got;
    f.self->request(f.bal, std::chrono::seconds{30}, place_atom::value, q)
        .receive([&](decode_placement& p) { FAIL("placed on " << p.name); }, [&](caf::error& e) { got = e; });
    REQUIRE(got);
    CHECK(static_cast<errc>(got.code()) == errc::rank_unavailable);
    CHECK_MESSAGE(f.t.sys.render(got).find(expected) != std::string::npos, f.t.sys.render(got));
  };
  f.self->send(f.bal, drain_atom::value, f.rank);
  refused_with(1, "request 1, stage place_decode: no decode rank took work within 270 ms of its 300 ms wait "
                  "(decode-a: takes no new work (draining))");
  // Its rank gone (its node killed): the same, naming that none is registered.
  f.self->send_exit(f.rank, caf::exit_reason::kill);
  refused_with(2, "request 2, stage place_decode: no decode rank took work within 270 ms of its 300 ms wait "
                  "(no rank registered)");
}

TEST_CASE("parked placements are served in the order the router admitted their requests: one asking again after a "
          "refusal goes ahead of those admitted after it") {
  lone_decode_rank f{8};
  f.report(0, 2);
  auto later = f.ask(9, 64, 1000);     // 4 pages; admitted after request 5
  auto younger = f.ask(7, 64, 1000);   // the same
  auto again = f.ask(5, 64, 1000, 1);  // request 5's second attempt: its first was refused
  // Room for one sequence: the oldest request takes it, the others wait out their time.
  f.report(4, 2);
  CHECK(f.outcome(again) == "decode-a");
  CHECK(f.outcome(younger).find("no decode rank had room") != std::string::npos);
  CHECK(f.outcome(later).find("no decode rank had room") != std::string::npos);
}

TEST_CASE("a newcomer that would fit does not pass a request waiting for room: it waits behind it, and both are "
          "placed, oldest first, when room comes") {
  lone_decode_rank f{8};
  f.report(3, 2);
  auto big = f.ask(5, 96, 30000);    // 6 pages: waits
  auto small = f.ask(7, 32, 30000);  // 2 pages would fit now, but request 5 came first
  CHECK(f.waiting() == 2);
  f.report(8, 2);
  CHECK(f.outcome(big) == "decode-a");
  CHECK(f.outcome(small) == "decode-a");
  CHECK(f.waiting() == 0);
}

TEST_CASE("the KV queue's backfill: requests that fit pass one that fits no rank, each counted, up to "
          "kv_queue_max_bypass; then it keeps its room, and takes it first when room comes") {
  lone_decode_rank f{"least_loaded", 16, 0, 2};
  f.report(3, 2);                  // 3 of 16 pages free
  auto big = f.ask(5, 96, 30000);  // 6 pages: waits
  auto a = f.ask(6, 16, 30000);    // 1 page: fits, and passes it (1 of 2)
  CHECK(f.outcome(a) == "decode-a");
  auto b = f.ask(7, 16, 30000);    // passes it too (2 of 2)
  CHECK(f.outcome(b) == "decode-a");
  auto c = f.ask(8, 16, 30000);    // 1 page is still free, but the big one keeps the rank now
  CHECK(f.waiting() == 2);
  f.report(16, 2);  // 14 free beside the two placed ones' charges: the big one first, then c
  CHECK(f.outcome(big) == "decode-a");
  CHECK(f.outcome(c) == "decode-a");
  std::vector<uint64_t> order;
  f.self->request(f.bal, std::chrono::seconds{5}, events_atom::value)
      .receive([&](std::vector<placement_record>& log) { for (const auto& r : log) if (r.request_id) order.push_back(r.request_id); },
               [](caf::error&) {});
  CHECK(order == std::vector<uint64_t>{6, 7, 5, 8});
}

TEST_CASE("waiting for room, interactive requests go before batch ones that came earlier, but at most 4 in a row "
          "pass the oldest batch request (seed 002's priority, as at the prefill ranks)") {
  lone_decode_rank f{8};
  f.report(0, 2);
  std::vector<decltype(f.ask(0, 0, 0))> asked;
  asked.push_back(f.ask(1, 16, 30000, 0, "batch"));  // one page each
  for (uint64_t id = 2; id <= 7; ++id) asked.push_back(f.ask(id, 16, 30000));
  CHECK(f.waiting() == 7);
  f.report(8, 2);
  for (auto& a : asked) CHECK(f.outcome(a) == "decode-a");
  std::vector<uint64_t> order;
  f.self->request(f.bal, std::chrono::seconds{5}, events_atom::value)
      .receive([&](std::vector<placement_record>& log) { for (const auto& r : log) if (r.request_id) order.push_back(r.request_id); },
               [](caf::error&) {});
  CHECK(order == std::vector<uint64_t>{2, 3, 4, 5, 1, 6, 7});
}

TEST_CASE("batch requests leave the interactive reserve of a rank's pages free: a batch flood fills the rest, an "
          "interactive request still finds room at once, and a batch one that found none says what was kept") {
  for (const char* policy : {"least_loaded", "seed"}) {
    CAPTURE(policy);
    lone_decode_rank f{policy, 10, 20};  // 2 of 10 pages kept
    auto flood = f.ask(1, 128, 30000, 0, "batch");  // 8 pages: all that batch may take
    CHECK(f.outcome(flood) == "decode-a");
    auto more = f.ask(2, 16, 300, 0, "batch");  // 2 pages are free, both kept
    const auto refused = f.outcome(more);
    CHECK_MESSAGE(refused.find("kv_capacity") != std::string::npos, refused);
    CHECK_MESSAGE(refused.find("2 of 10 pages free (2 kept for interactive requests)") != std::string::npos, refused);
    auto chat = f.ask(3, 32, 300);  // interactive: the 2 kept pages are its
    CHECK(f.outcome(chat) == "decode-a");
    // More than a batch request may ever take of a rank: refused at once, naming the reserve.
    auto huge = f.ask(4, 144, 30000, 0, "batch");  // 9 pages of the 8 batch may use
    const auto never = f.outcome(huge);
    CHECK_MESSAGE(never.find("bad_request") != std::string::npos, never);
    CHECK_MESSAGE(never.find("holds 128 in all for a batch request (the rest is kept for interactive ones: "
                             "interactive_reserve_pct 20)") != std::string::npos,
                  never);
  }
}

TEST_CASE("a batch request waiting at the head of the KV queue keeps its rank from other batch requests, not from "
          "interactive ones, which may still take the pages kept for them") {
  lone_decode_rank f{"least_loaded", 10, 20};  // 2 of 10 pages kept
  f.report(0, 8);
  auto batch = f.ask(1, 64, 600, 0, "batch");  // 4 pages
  std::vector<decltype(f.ask(0, 0, 0))> chats;
  for (uint64_t id = 2; id <= 6; ++id) chats.push_back(f.ask(id, 16, 30000));  // 1 page each
  CHECK(f.waiting() == 6);
  // 6 free: four chats pass the batch request (batch_max_bypass), which then heads the queue with
  // 2 free -- both kept -- and holds the rank; the fifth chat takes a kept page all the same.
  f.report(6, 8);
  CHECK(f.waiting() == 1);  // the batch request alone (a held rank kept the fifth chat waiting with it)
  for (auto& c : chats) CHECK(f.outcome(c) == "decode-a");
  const auto refused = f.outcome(batch);
  CHECK_MESSAGE(refused.find("kv_capacity") != std::string::npos, refused);
}

TEST_CASE("a request waiting for room keeps it on one rank only, the one nearest to holding it: those behind it "
          "are placed on the other ranks meanwhile, never there; one that no rank taking work could hold stops "
          "nothing") {
  lone_decode_rank f{8, {8}};
  f.report_of(0, 2, 3);  // decode-a: 2 of 8 pages free
  f.report_of(1, 3, 3);  // decode-b: 3 of 8 free, the nearest to holding 6
  auto head = f.ask(5, 96, 30000);  // 6 pages: waits, keeping decode-b's room for itself
  auto behind = f.ask(7, 32, 30000);  // 2 pages: fits on decode-a
  CHECK(f.outcome(behind) == "decode-a");
  auto next = f.ask(9, 48, 30000);  // 3 pages: would fit on decode-b only, which is kept
  CHECK(f.waiting() == 2);
  f.report_of(1, 8, 0);  // decode-b emptied: the head first, then what fits behind it
  CHECK(f.outcome(head) == "decode-b");
  f.report_of(0, 8, 1);  // request 7's pages are still charged on top of it: 6 free
  CHECK(f.outcome(next) == "decode-a");

  // A pool of 16 and 8 pages whose big rank drains: a request only it could hold waits for it
  // (undrained, or another joining) without holding up one that the small rank takes now.
  lone_decode_rank g{16, {8}};
  g.self->send(g.bal, drain_atom::value, g.rank);
  auto big = g.ask(5, 208, 30000);  // 13 pages
  auto small = g.ask(7, 32, 30000);
  CHECK(g.outcome(small) == "decode-b");
  CHECK(g.waiting() == 1);  // the big one, still waiting
  g.self->send(g.bal, undrain_atom::value, g.rank);
  CHECK(g.outcome(big) == "decode-a");

  // KV on demand: a rank keeps its growth watermark (1 %, a page here) from newcomers, so a
  // prompt that needs every page can never be granted there, and holds nothing.
  lone_decode_rank h{8};
  rank_load on_demand = idle_load("decode-a", 8);
  on_demand.on_demand_headroom_tokens = 16;
  on_demand.num_free_pages = 7;  // as the rank reports: less its watermark
  h.self->send(h.bal, load_atom::value, on_demand, h.rank);
  place_query whole{5, 112, 0, 128};  // 112 prompt tokens + 16 headroom: 8 pages
  whole.wait_ms = 300;
  auto never = h.self->request(h.bal, std::chrono::seconds{60}, place_atom::value, whole);
  auto fits = h.ask(7, 32, 30000);
  CHECK(h.outcome(fits) == "decode-a");
  CHECK(h.outcome(never).find("no decode rank had room for 128 tokens") != std::string::npos);
}

TEST_CASE("a rank forgotten because its node was given up for lost stays forgotten when a load report it sent "
          "earlier arrives late, and comes back -- still draining if it was -- only once told it may rejoin") {
  test::cluster_system t;
  caf::scoped_actor self{t.sys};
  auto decode_bal = spawn_decode_balancer(t.sys, {});
  auto prefill_bal = spawn_prefill_balancer(t.sys, {});
  auto decode = stand_in_rank<decode_rank_actor>(t);
  auto prefill = stand_in_rank<prefill_rank_actor>(t);
  rank_load load;
  load.num_free_pages = load.num_total_pages = 8;
  load.page_size_tokens = 16;
  const auto names = [&](auto& balancer) {
    std::vector<std::string> out;
    self->request(balancer, std::chrono::seconds{5}, stats_atom::value)
        .receive(
            [&](std::vector<rank_load>& loads) {
              for (const auto& l : loads) out.push_back(l.name);
            },
            [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return out;
  };
  const auto placed = [&](auto& balancer, auto placement) {
    place_query q{7, 16, 0, 32};
    q.wait_ms = 20;
    bool ok = false;
    self->request(balancer, std::chrono::seconds{5}, place_atom::value, q)
        .receive([&](decltype(placement)&) { ok = true; }, [&](caf::error&) {});
    return ok;
  };
  const auto logged = [&](auto& balancer, const std::string& why) {
    bool found = false;
    self->request(balancer, std::chrono::seconds{5}, events_atom::value)
        .receive(
            [&](std::vector<placement_record>& log) {
              for (const auto& r : log) found |= r.why == why;
            },
            [](caf::error&) {});
    return found;
  };
  const auto both = [&](auto check) {
    check(decode_bal, decode, "decode-x", decode_placement{});
    check(prefill_bal, prefill, "prefill-x", prefill_placement{});
  };
  both([&](auto& bal, auto& rank, const std::string& name, auto kind) {
    CAPTURE(name);
    load.name = name;
    self->send(bal, load_atom::value, load, rank);
    CHECK(names(bal) == std::vector<std::string>{name});
    self->send(bal, drain_atom::value, rank);  // an elastic move began on it
    CHECK(!placed(bal, kind));
    // Its node is given up for lost; a report it sent before that arrives after.
    self->send(bal, forget_atom::value, rank);
    self->send(bal, load_atom::value, load, rank);
    CHECK(names(bal).empty());
    // The node is back: the balancer hears so, then the rank's report -- it still drains.
    self->send(bal, rejoin_atom::value, rank, true);
    self->send(bal, load_atom::value, load, rank);
    CHECK(names(bal) == std::vector<std::string>{name});
    CHECK(logged(bal, "rejoined, still draining"));
    CHECK(!placed(bal, kind));
    // An elastic move takes it to the other role (drained, then forgotten) and later back: it
    // returns taking work, as that drain was the move's.
    self->send(bal, forget_atom::value, rank);
    self->send(bal, rejoin_atom::value, rank, false);
    self->send(bal, load_atom::value, load, rank);
    CHECK(names(bal) == std::vector<std::string>{name});
    CHECK(placed(bal, kind));
    // A rejoin for a rank that was not set aside changes nothing.
    self->send(bal, rejoin_atom::value, rank, true);
    CHECK(names(bal) == std::vector<std::string>{name});
  });
  for (auto a : {caf::actor_cast<caf::actor>(decode), caf::actor_cast<caf::actor>(prefill),
                 caf::actor_cast<caf::actor>(decode_bal), caf::actor_cast<caf::actor>(prefill_bal)})
    self->send_exit(a, caf::exit_reason::user_shutdown);
}

TEST_CASE("a prefill placement whose prompt never reaches its rank (no report follows) stops counting as that "
          "rank's load after charge_ttl_ms, instead of for as long as the idle rank stays silent") {
  test::cluster_system t;
  caf::scoped_actor self{t.sys};
  prefill_balancer_config bc;
  bc.policy = "least_loaded";
  bc.charge_ttl_ms = 1000;  // long enough that placements 1 to 5 all fall inside it on a stalled machine
  auto bal = spawn_prefill_balancer(t.sys, bc);
  auto rank = stand_in_rank<prefill_rank_actor>(t);
  rank_load load = idle_load("prefill-x", 64);
  self->send(bal, load_atom::value, load, rank);
  const auto place = [&](uint64_t id) {
    std::string why;
    self->request(bal, std::chrono::seconds{5}, place_atom::value, place_query{id, 100, 0, 120})
        .receive([&](prefill_placement& p) { why = p.why; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return why;
  };
  CHECK(place(1).rfind("least_loaded: 0 queued tokens", 0) == 0);
  CHECK(place(2).rfind("least_loaded: 100 queued tokens", 0) == 0);  // the first counts until a report
  // A report that settles the first (its order arrived and ran) drops its charge; the second's
  // order has not arrived, so it still counts on top of the report.
  load.settled = {1};
  self->send(bal, load_atom::value, load, rank);
  CHECK(place(3).rfind("least_loaded: 100 queued tokens", 0) == 0);
  load.settled = {2, 3};  // and a report that settles them both
  self->send(bal, load_atom::value, load, rank);
  CHECK(place(5).rfind("least_loaded: 0 queued tokens", 0) == 0);
  // No report follows placement 5 (its request failed before ordering): past the limit it goes.
  std::this_thread::sleep_for(std::chrono::milliseconds{1200});
  CHECK(place(4).rfind("least_loaded: 0 queued tokens", 0) == 0);
  bool logged = false;
  self->request(bal, std::chrono::seconds{5}, events_atom::value)
      .receive(
          [&](std::vector<placement_record>& log) {
            for (const auto& r : log) logged |= r.rank == "prefill-x" && r.why.find("taken back") != std::string::npos;
          },
          [](caf::error&) {});
  CHECK(logged);
  self->send_exit(bal, caf::exit_reason::user_shutdown);
  self->send_exit(rank, caf::exit_reason::user_shutdown);
}

TEST_CASE("a prefill rank that went down takes its charges with it: a rank restarted under its name starts without "
          "them") {
  test::cluster_system t;
  caf::scoped_actor self{t.sys};
  prefill_balancer_config bc;
  bc.policy = "least_loaded";
  bc.charge_ttl_ms = 600000;  // the charge would outlive the test: only the forgetting can drop it
  auto bal = spawn_prefill_balancer(t.sys, bc);
  const auto place = [&](uint64_t id) {
    std::string why;
    self->request(bal, std::chrono::seconds{5}, place_atom::value, place_query{id, 100, 0, 120})
        .receive([&](prefill_placement& p) { why = p.why; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return why;
  };
  const auto ranks = [&] {
    size_t n = 99;
    self->request(bal, std::chrono::seconds{5}, stats_atom::value).receive([&](std::vector<rank_load>& l) { n = l.size(); }, [](caf::error&) {});
    return n;
  };
  auto first = stand_in_rank<prefill_rank_actor>(t);
  self->send(bal, load_atom::value, idle_load("prefill-x", 64), first);
  CHECK(place(1).rfind("least_loaded: 0 queued tokens", 0) == 0);
  self->send_exit(first, caf::exit_reason::kill);  // its prompt never ran: no report settles it
  for (int i = 0; i < 500 && ranks() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
  REQUIRE(ranks() == 0);
  auto second = stand_in_rank<prefill_rank_actor>(t);
  self->send(bal, load_atom::value, idle_load("prefill-x", 64), second);
  CHECK(place(2).rfind("least_loaded: 0 queued tokens", 0) == 0);
  self->send_exit(bal, caf::exit_reason::user_shutdown);
  self->send_exit(second, caf::exit_reason::user_shutdown);
}

TEST_CASE("a decode placement whose sequence never reserves on its rank gives its pages back after charge_ttl_ms, "
          "and a placement parked behind it is then served without waiting for a report") {
  test::cluster_system t;
  caf::scoped_actor self{t.sys};
  decode_balancer_config bc;
  bc.policy = "least_loaded";
  bc.charge_ttl_ms = 600;
  auto bal = spawn_decode_balancer(t.sys, bc);
  auto rank = stand_in_rank<decode_rank_actor>(t);
  rank_load load = idle_load("decode-x", 4);
  self->send(bal, load_atom::value, load, rank);
  const auto place = [&](uint64_t id, uint32_t wait_ms) {
    std::string where;
    place_query q{id, 60, 0, 64};
    q.wait_ms = wait_ms;
    self->request(bal, std::chrono::seconds{5}, place_atom::value, q)
        .receive([&](decode_placement& p) { where = p.name; }, [&](caf::error& e) { where = t.sys.render(e); });
    return where;
  };
  // The first takes all four pages; the second fits only once the first is taken back: the
  // rank never reports again (the first request failed before reserving). The second parks
  // 500 ms after the first and may wait 400 ms: the retry comes when the first's charge expires
  // (100 ms after it parked), not a whole charge_ttl_ms after it parked (past its deadline).
  CHECK(place(1, 5000) == "decode-x");
  std::this_thread::sleep_for(std::chrono::milliseconds{500});
  CHECK(place(2, 400) == "decode-x");
  std::vector<rank_load> loads;
  self->request(bal, std::chrono::seconds{5}, stats_atom::value).receive([&](std::vector<rank_load>& l) { loads = l; }, [](caf::error&) {});
  REQUIRE(loads.size() == 1);
  CHECK(loads[0].num_free_pages == 0);  // the second's charge: it has not reserved either
  CHECK(loads[0].num_running == 1);
  bool logged = false;
  self->request(bal, std::chrono::seconds{5}, events_atom::value)
      .receive(
          [&](std::vector<placement_record>& log) {
            for (const auto& r : log) logged |= r.rank == "decode-x" && r.why.find("taken back") != std::string::npos;
          },
          [](caf::error&) {});
  CHECK(logged);
  // A report that settles the second (its reservation was refused, say) replaces its charge at once.
  load.settled = {2};
  self->send(bal, load_atom::value, load, rank);
  self->request(bal, std::chrono::seconds{5}, stats_atom::value).receive([&](std::vector<rank_load>& l) { loads = l; }, [](caf::error&) {});
  CHECK(loads[0].num_free_pages == 4);
  self->send_exit(bal, caf::exit_reason::user_shutdown);
  self->send_exit(rank, caf::exit_reason::user_shutdown);
}

TEST_CASE("two attempts of one request placed on the same rank are two charges: the report that settles the first "
          "keeps the second") {
  lone_decode_rank d{16};
  auto& self = d.self;
  for (int attempt = 0; attempt < 2; ++attempt)  // request 7, placed again after its first attempt failed
    self->request(d.bal, std::chrono::seconds{5}, place_atom::value, place_query{7, 60, 0, 64})
        .receive([](decode_placement&) {}, [&](caf::error& e) { FAIL(d.t.sys.render(e)); });
  // The rank settled the first attempt's reservation (and freed it: the attempt failed); the
  // second's is still on its way.
  rank_load load = idle_load("decode-a", 16);
  load.settled = {7};
  self->send(d.bal, load_atom::value, load, d.rank);
  const auto now = d.load();
  CHECK(now.num_free_pages == 16 - 4);  // the second attempt still takes its room (it used to be 16)
  CHECK(now.num_running == 1);
}

TEST_CASE("a release voids the placement of the attempt it names, made or parked, and no other: its charge goes at "
          "once (not after the TTL), another attempt's stays") {
  lone_decode_rank d{8};
  auto& self = d.self;
  const auto place = [&](uint32_t attempt) {
    place_query q{7, 60, 0, 64};
    q.attempt = attempt;
    return q;
  };
  for (uint32_t attempt : {0u, 1u})  // two attempts of request 7, neither reserved yet: 4 pages each
    self->request(d.bal, std::chrono::seconds{5}, place_atom::value, place(attempt))
        .receive([](decode_placement&) {}, [&](caf::error& e) { FAIL(d.t.sys.render(e)); });
  CHECK(d.load().num_free_pages == 0);
  // Attempt 1 gave up (its client left): its room is free at once, attempt 0's is still taken.
  self->send(d.bal, release_atom::value, uint64_t{7}, uint32_t{1});
  CHECK(d.load().num_free_pages == 4);
  // Request 8 takes the last 4 pages; a third attempt of 7 parks. A release of an attempt never
  // placed changes nothing; the parked one's release drops it, answered cancelled.
  self->request(d.bal, std::chrono::seconds{5}, place_atom::value, place_query{8, 60, 0, 64})
      .receive([](decode_placement&) {}, [&](caf::error& e) { FAIL(d.t.sys.render(e)); });
  auto parked = self->request(d.bal, std::chrono::seconds{30}, place_atom::value, place(2));
  self->send(d.bal, release_atom::value, uint64_t{7}, uint32_t{5});
  CHECK(d.load().num_free_pages == 0);
  self->send(d.bal, release_atom::value, uint64_t{7}, uint32_t{2});
  std::string why;
  std::move(parked).receive([](decode_placement&) {}, [&](caf::error& e) { why = d.t.sys.render(e); });
  CHECK_MESSAGE(why.find("request 7, stage place_decode: the request gave up its placement") != std::string::npos, why);
  CHECK(d.load().num_free_pages == 0);  // attempt 0 and request 8 still hold theirs
}

TEST_CASE("a decode rank's report drops the charges of the placements it settled and keeps those still on their "
          "way, so a burst spreads over the ranks instead of piling onto the one that reported first") {
  test::cluster_system t;
  caf::scoped_actor self{t.sys};
  decode_balancer_config bc;
  bc.policy = "least_loaded";
  auto bal = spawn_decode_balancer(t.sys, bc);
  std::vector<decode_rank_actor> ranks;
  for (const char* name : {"decode-a", "decode-b"}) {
    ranks.push_back(stand_in_rank<decode_rank_actor>(t));
    self->send(bal, load_atom::value, idle_load(name, 16), ranks.back());
  }
  std::vector<std::string> placed;
  const auto place = [&](uint64_t id) {
    self->request(bal, std::chrono::seconds{5}, place_atom::value, place_query{id, 60, 0, 64})
        .receive([&](decode_placement& p) { placed.push_back(p.name); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  };
  place(1);
  place(2);
  place(3);
  place(4);
  REQUIRE(placed.size() == 4);
  // Request 1 reached its rank, whose report counts it (4 pages); the other placements there
  // are still on their way.
  const auto first = placed[0];
  const auto& first_rank = first == "decode-a" ? ranks[0] : ranks[1];
  rank_load load = idle_load(first, 16);
  load.num_free_pages = 12;
  load.num_running = 1;
  load.settled = {1};
  self->send(bal, load_atom::value, load, first_rank);
  std::vector<rank_load> loads;
  self->request(bal, std::chrono::seconds{5}, stats_atom::value).receive([&](std::vector<rank_load>& l) { loads = l; }, [](caf::error&) {});
  REQUIRE(loads.size() == 2);
  uint32_t charged_there = 0;
  for (size_t i = 1; i < placed.size(); ++i) charged_there += placed[i] == first;
  for (const auto& l : loads)
    if (l.name == first) {
      CHECK(l.num_free_pages == 12 - 4 * charged_there);  // not 12: the others still take their room
      CHECK(l.num_running == 1 + charged_there);
    }
  for (auto& r : ranks) self->send_exit(r, caf::exit_reason::user_shutdown);
  self->send_exit(bal, caf::exit_reason::user_shutdown);
}

TEST_CASE("once every rank of a role has been gone past the grace, placements are refused at once "
          "(rank_unavailable, naming why) instead of each waiting out its asker's timeout; within the grace, and before "
          "any rank joined, they wait; a rank back takes work again") {
  graced_balancers b;
  auto& t = b.t;
  auto& decode = b.decode;
  auto& prefill = b.prefill;
  auto& self = b.self;
  const auto refused_at_once = [&](const auto& balancer, auto placement, const char* stage) {
    using placement_t = decltype(placement);
    const auto asked = std::chrono::steady_clock::now();
    std::string why;
    place_query q{7, 16, 0, 64};
    q.wait_ms = 30'000;
    self->request(balancer, std::chrono::seconds{30}, place_atom::value, q)
        .receive([&](placement_t&) { FAIL("placed with no rank"); },
                 [&](caf::error& e) {
                   CHECK(e.code() == static_cast<uint8_t>(errc::rank_unavailable));
                   why = t.sys.render(e);
                 });
    CHECK(std::chrono::steady_clock::now() - asked < std::chrono::seconds{20});  // not its 30 s
    CHECK_MESSAGE(why.find(std::string{stage} + ": no ") != std::string::npos, why);
    CHECK_MESSAGE(why.find("every one that joined has left, none came back within 200 ms") != std::string::npos, why);
  };
  // Before any rank reported, a placement waits (ranks are on their way at start).
  place_query early{1, 16, 0, 64};
  early.wait_ms = 30'000;
  auto parked = self->request(decode, std::chrono::seconds{30}, place_atom::value, early);
  auto rank = stand_in_rank<decode_rank_actor>(t);
  self->send(decode, load_atom::value, idle_load("decode-x", 8), rank);
  parked.receive([&](decode_placement& p) { CHECK(p.name == "decode-x"); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  // The last decode rank goes. Within the grace a placement waits, and the rank back takes it.
  self->send_exit(rank, caf::exit_reason::kill);
  const auto gone = [&](const auto& balancer) {
    for (int i = 0; i < 500; ++i) {  // bounded: until the balancer has seen it go
      bool empty = false;
      self->request(balancer, std::chrono::seconds{5}, stats_atom::value)
          .receive([&](const std::vector<rank_load>& loads) { empty = loads.empty(); }, [](caf::error&) {});
      if (empty) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds{2});
    }
    return false;
  };
  REQUIRE(gone(decode));
  auto waiting = self->request(decode, std::chrono::seconds{30}, place_atom::value, place_query{2, 16, 0, 64});
  auto back = stand_in_rank<decode_rank_actor>(t);
  self->send(decode, load_atom::value, idle_load("decode-y", 8), back);
  waiting.receive([&](decode_placement& p) { CHECK(p.name == "decode-y"); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  // Gone for good: past the grace, refused at once.
  self->send_exit(back, caf::exit_reason::kill);
  REQUIRE(gone(decode));
  std::this_thread::sleep_for(std::chrono::milliseconds{250});
  refused_at_once(decode, decode_placement{}, "place_decode");
  // The prefill balancer alike.
  auto p_rank = stand_in_rank<prefill_rank_actor>(t);
  self->send(prefill, load_atom::value, idle_load("prefill-x", 8), p_rank);
  self->send_exit(p_rank, caf::exit_reason::kill);
  REQUIRE(gone(prefill));
  std::this_thread::sleep_for(std::chrono::milliseconds{250});
  refused_at_once(prefill, prefill_placement{}, "place_prefill");
}

TEST_CASE("a placement parked while every rank of the role drains is refused once the grace runs out (rank_unavailable, "
          "naming the draining rank), not left to its asker's timeout; one a rank takes work again for within the "
          "grace is placed") {
  graced_balancers b;
  auto& t = b.t;
  auto& decode = b.decode;
  auto& prefill = b.prefill;
  auto& self = b.self;
  auto d_rank = stand_in_rank<decode_rank_actor>(t);
  auto p_rank = stand_in_rank<prefill_rank_actor>(t);
  self->send(decode, load_atom::value, idle_load("decode-x", 8), d_rank);
  self->send(prefill, load_atom::value, idle_load("prefill-x", 8), p_rank);
  const auto ask = [&](const auto& balancer, uint64_t id) {
    place_query q{id, 16, 0, 64};
    q.wait_ms = 30'000;
    return self->request(balancer, std::chrono::seconds{30}, place_atom::value, q);
  };
  // Drained within the grace and back: the parked placement goes to it.
  self->send(decode, drain_atom::value, d_rank);
  auto parked = ask(decode, 1);
  self->send(decode, undrain_atom::value, d_rank);
  self->send(decode, load_atom::value, idle_load("decode-x", 8), d_rank);  // its next report serves the parked ones
  parked.receive([&](decode_placement& p) { CHECK(p.name == "decode-x"); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  // Draining for good: refused at the grace's end, with no report or other placement to wake it.
  const auto refused = [&](const auto& balancer, auto placement, const char* stage, const char* rank) {
    using placement_t = decltype(placement);
    const auto asked = std::chrono::steady_clock::now();
    std::string why;
    ask(balancer, 2).receive([&](placement_t&) { FAIL("placed on a draining rank"); },
                             [&](caf::error& e) {
                               CHECK(e.code() == static_cast<uint8_t>(errc::rank_unavailable));
                               why = t.sys.render(e);
                             });
    CHECK(std::chrono::steady_clock::now() - asked < std::chrono::seconds{20});  // not its 30 s
    CHECK_MESSAGE(why.find(std::string{stage} + ": no ") != std::string::npos, why);
    CHECK_MESSAGE(why.find(std::string{"rank takes work: the 1 here are draining or stepped aside ("} + rank +
                           ": draining), and none took work again or joined within 200 ms") != std::string::npos,
                  why);
  };
  self->send(decode, drain_atom::value, d_rank);
  refused(decode, decode_placement{}, "place_decode", "decode-x");
  // A placement parked for want of room while the rank took work: the rank then drains, and no
  // other placement or report comes; the drain starts the grace, whose end refuses it.
  self->send(decode, undrain_atom::value, d_rank);
  auto full = idle_load("decode-x", 8);
  full.num_free_pages = 0;
  self->send(decode, load_atom::value, full, d_rank);
  auto parked_for_room = ask(decode, 3);
  self->send(decode, drain_atom::value, d_rank);
  std::string why;
  parked_for_room.receive([&](decode_placement&) { FAIL("placed on a full, draining rank"); },
                          [&](caf::error& e) { why = t.sys.render(e); });
  CHECK_MESSAGE(why.find("no decode rank takes work: the 1 here are draining") != std::string::npos, why);
  self->send(prefill, drain_atom::value, p_rank);
  refused(prefill, prefill_placement{}, "place_prefill", "prefill-x");
  self->send_exit(d_rank, caf::exit_reason::user_shutdown);
  self->send_exit(p_rank, caf::exit_reason::user_shutdown);
}

// The all-to-all exchange over the transport interface (expert-parallel dispatch and combine):
// every rank's chunk reaches every rank intact, round after round, over loopback and UCX; a
// silent rank or an oversized chunk fails with a sentence naming who and what.

#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "gpu/job_queue.hpp"
#include "transport/all_to_all.hpp"
#include "transport/fault_proxy.hpp"
#include "transport/loopback.hpp"
#include "transport/ucx.hpp"

using namespace baton::transport;

namespace {

/// Rank `src`'s chunk for rank `dst` in round `round`: a length and bytes that say all three.
std::vector<std::byte> chunk(uint32_t src, uint32_t dst, uint32_t round) {
  std::vector<std::byte> v((src * 7 + dst * 3 + round * 5) % 11 * 97);  // some are empty
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::byte(static_cast<uint8_t>(src * 31 + dst * 17 + round * 13 + i));
  return v;
}

std::vector<std::unique_ptr<transport>> make_group(const std::string& backend, uint32_t n, std::vector<std::string>* names) {
  static auto fabric = make_loopback_fabric();
  std::vector<std::unique_ptr<transport>> out;
  for (uint32_t r = 0; r < n; ++r) {
    names->push_back("ep-" + std::to_string(r));
    std::string why;
    if (backend == "loopback") out.push_back(make_loopback_transport(fabric, names->back() + "-" + std::to_string(::getpid())));
    else out.push_back(make_ucx_transport({.name = names->back(), .send = backend == "ucx-am" ? "am" : "put"}, &why));
    REQUIRE_MESSAGE(out.back(), why);
  }
  return out;
}

}  // namespace

TEST_CASE("all-to-all: three ranks exchange distinct chunks (empty ones too) for six rounds, intact, over loopback "
          "and UCX, by direct stores into mapped peers and by puts (RMA and rendezvous active messages)") {
  struct mode {
    std::string backend;
    bool direct;
  };
  for (const auto& [backend, direct] : {mode{"loopback", true}, mode{"loopback", false}, mode{"ucx", true},
                                        mode{"ucx", false}, mode{"ucx-am", false}}) {
    CAPTURE(backend);
    CAPTURE(direct);
    std::vector<std::string> names;
    auto ts = make_group(backend, 3, &names);
    std::vector<std::unique_ptr<all_to_all>> groups;
    std::vector<region_key> keys;
    for (uint32_t r = 0; r < 3; ++r) {
      all_to_all_config cfg{r, 3, 4096};
      cfg.direct = direct;
      groups.push_back(std::make_unique<all_to_all>(*ts[r], names, cfg));
      REQUIRE_MESSAGE(groups.back()->error().empty(), groups.back()->error());
      keys.push_back(groups.back()->key());
    }
    for (auto& g : groups) g->connect(keys);
    // UCX maps a peer's receive region (its own shared-memory segment) into this process.
    for (auto& g : groups) CHECK(g->direct_peers() == (direct ? 2u : 0u));
    std::vector<std::string> failures(3);
    std::vector<int> verified(3, 0);
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < 3; ++r)
      threads.emplace_back([&, r] {
        for (uint32_t round = 0; round < 6; ++round) {
          std::vector<std::vector<std::byte>> out;
          std::vector<std::span<const std::byte>> send, recv;
          for (uint32_t d = 0; d < 3; ++d) out.push_back(chunk(r, d, round));
          for (auto& o : out) send.emplace_back(o);
          if (!groups[r]->exchange(send, &recv, &failures[r])) return;
          for (uint32_t s = 0; s < 3; ++s) {
            const auto want = chunk(s, r, round);
            if (recv[s].size() == want.size() && std::equal(want.begin(), want.end(), recv[s].begin())) ++verified[r];
          }
        }
      });
    for (auto& t : threads) t.join();
    for (uint32_t r = 0; r < 3; ++r) {
      CHECK_MESSAGE(failures[r].empty(), failures[r]);
      CHECK(verified[r] == 18);
      CHECK(groups[r]->exchanges() == 6);
    }
  }
}

TEST_CASE("all-to-all: a rank asleep on its doorbells is woken by a peer that stores its doorbell, or its abort "
          "word, over loopback and UCX shared memory (a second mapping of the region: the futex is not private)") {
  using std::chrono::seconds;
  for (const std::string backend : {"loopback", "ucx"}) {
    CAPTURE(backend);
    for (const bool abort : {false, true}) {
      CAPTURE(abort);
      std::vector<std::string> names;
      auto ts = make_group(backend, 2, &names);
      std::vector<std::unique_ptr<all_to_all>> g;
      std::vector<region_key> keys;
      for (uint32_t r = 0; r < 2; ++r) {
        // Sleeps of a minute: a rank that was not woken sleeps one out (slept_out()) and fails the
        // test, rather than passing by polling.
        g.push_back(std::make_unique<all_to_all>(*ts[r], names,
                                                 all_to_all_config{.rank = r,
                                                                   .size = 2,
                                                                   .slot_bytes = 64,
                                                                   .timeout = std::chrono::hours{1},
                                                                   .min_sleep = seconds{60},
                                                                   .max_sleep = seconds{60},
                                                                   .max_sleep_woken = seconds{60}}));
        REQUIRE_MESSAGE(g.back()->error().empty(), g.back()->error());
        keys.push_back(g.back()->key());
      }
      for (auto& x : g) x->connect(keys);
      REQUIRE(g[0]->direct_peers() == 1);
      REQUIRE(g[1]->direct_peers() == 1);
      g[1]->set_abort([&](uint32_t s) { return g[1]->peer_aborted(s) ? std::string{"it stopped"} : std::string{}; });
      std::vector<std::byte> mine(8, std::byte{7});
      std::vector<std::span<const std::byte>> send(2, std::span<const std::byte>{mine}), recv0, recv1;
      std::string why0, why1;
      bool ok1 = false;
      std::thread sleeper([&] { ok1 = g[1]->exchange(send, &recv1, &why1); });
      for (int i = 0; i < 2000 && !g[1]->sleeping(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
      REQUIRE(g[1]->sleeping());
      if (abort) {
        g[0]->signal_abort();
      } else {
        CHECK_MESSAGE(g[0]->exchange(send, &recv0, &why0), why0);
      }
      sleeper.join();
      CHECK(g[1]->slept_out() == 0);
      if (abort) {
        CHECK_FALSE(ok1);
        CHECK_MESSAGE(why1.find("rank ep-1 stops waiting for ep-0: it stopped") != std::string::npos, why1);
      } else {
        CHECK_MESSAGE(ok1, why1);
        REQUIRE(recv1.size() == 2);
        CHECK((recv1[0].size() == 8 && recv1[0][0] == std::byte{7}));
      }
    }
  }
  CHECK(all_to_all_config{.size = 2, .min_sleep = std::chrono::microseconds{10'000}}.validate() ==
        "all-to-all: min_sleep (10000 us) must be > 0 and at most max_sleep (5000 us) and max_sleep_woken (50000 us)");
}

TEST_CASE("a job thread dozing on its all-to-all (a data-parallel member, idle) is woken by a job, by a peer "
          "starting an exchange, which it then joins, and by its stop") {
  using namespace std::chrono;
  std::vector<std::string> names;
  auto ts = make_group("loopback", 2, &names);
  std::vector<std::unique_ptr<all_to_all>> g;
  std::vector<region_key> keys;
  for (uint32_t r = 0; r < 2; ++r) {
    g.push_back(std::make_unique<all_to_all>(*ts[r], names, all_to_all_config{.rank = r, .size = 2, .slot_bytes = 64}));
    keys.push_back(g.back()->key());
  }
  for (auto& x : g) x->connect(keys);
  std::vector<std::byte> none;
  std::vector<std::span<const std::byte>> send(2, std::span<const std::byte>{none});
  std::atomic<int> ran{0}, joined{0};
  baton::gpu::job_queue q;
  // Dozes of a minute: one that nothing ended sooner counts in slept_out().
  q.start([](const baton::gpu::forward_job&) { return std::string{}; },
          [&](const baton::gpu::forward_job&, baton::gpu::executor_sink&) { ++ran; }, {},
          {.look =
               [&] {
                 if (!g[0]->peer_started()) return false;
                 std::vector<std::span<const std::byte>> recv;
                 std::string why;
                 if (g[0]->exchange(send, &recv, &why)) ++joined;
                 return true;
               },
           .every = minutes{1},
           .at_most = minutes{1},
           .doze = [&](microseconds d, const std::function<bool()>& ready) { g[0]->doze(d, ready); },
           .nudge = [&] { g[0]->nudge(); }});
  const auto until_asleep = [&] {
    for (int i = 0; i < 2000 && !g[0]->sleeping(); ++i) std::this_thread::sleep_for(milliseconds{5});
    return g[0]->sleeping();
  };
  struct no_sink : baton::gpu::executor_sink {
    void on_layer_kv_ready(uint64_t, uint32_t) override {}
    void on_done(uint64_t, baton::gpu::forward_output) override {}
    void on_failed(uint64_t, std::string) override {}
  };
  // A job: submit nudges the dozing thread.
  REQUIRE(until_asleep());
  q.submit({}, std::make_shared<no_sink>());
  for (int i = 0; i < 24000 && ran.load() == 0; ++i) std::this_thread::sleep_for(milliseconds{5});
  CHECK(ran.load() == 1);
  CHECK(g[0]->slept_out() == 0);
  // A peer's step: its doorbell wakes the thread, whose look joins the exchange.
  REQUIRE(until_asleep());
  std::string why1;
  std::vector<std::span<const std::byte>> recv1;
  CHECK_MESSAGE(g[1]->exchange(send, &recv1, &why1), why1);
  for (int i = 0; i < 24000 && joined.load() == 0; ++i) std::this_thread::sleep_for(milliseconds{5});
  CHECK(joined.load() == 1);
  CHECK(g[0]->slept_out() == 0);
  // A stop: the thread ends now, not at its doze's end.
  REQUIRE(until_asleep());
  q.stop();
  CHECK(g[0]->slept_out() == 0);
}

TEST_CASE("all-to-all: ranks whose receive regions differ (another slot size, another build) are refused at connect, "
          "naming both sizes") {
  std::vector<std::string> names;
  auto ts = make_group("loopback", 2, &names);
  all_to_all a{*ts[0], names, {.rank = 0, .size = 2, .slot_bytes = 64}};
  all_to_all b{*ts[1], names, {.rank = 1, .size = 2, .slot_bytes = 128}};
  a.connect({a.key(), b.key()});
  CHECK(a.error().find("all-to-all rank ep-0: rank ep-1's receive region is ") == 0);
  CHECK(a.error().find(": not the same slot size, or not the same build of Baton") != std::string::npos);
  std::vector<std::byte> x(8);
  std::vector<std::span<const std::byte>> send(2, std::span<const std::byte>{x}), recv;
  std::string why;
  CHECK_FALSE(a.exchange(send, &recv, &why));
  CHECK(why == a.error());
}

TEST_CASE("all-to-all: a rank that never exchanges is named in the others' error; an oversized chunk is refused") {
  std::vector<std::string> names;
  auto ts = make_group("loopback", 3, &names);
  std::vector<std::unique_ptr<all_to_all>> groups;
  std::vector<region_key> keys;
  for (uint32_t r = 0; r < 3; ++r) {
    groups.push_back(std::make_unique<all_to_all>(*ts[r], names, all_to_all_config{r, 3, 64, std::chrono::milliseconds{1000}}));
    keys.push_back(groups.back()->key());
  }
  for (auto& g : groups) g->connect(keys);
  std::vector<std::byte> small(8, std::byte{1}), big(65, std::byte{2});
  std::vector<std::span<const std::byte>> send(3, std::span<const std::byte>{small}), recv;
  std::string why0, why1;
  std::thread other([&] { groups[1]->exchange(send, &recv, &why1); });
  std::vector<std::span<const std::byte>> recv0;
  CHECK_FALSE(groups[0]->exchange(send, &recv0, &why0));
  other.join();
  CHECK_MESSAGE(why0.find("all-to-all exchange 1: rank ep-0 has nothing from ep-2 after 1000 ms") != std::string::npos, why0);
  CHECK_MESSAGE(why1.find("has nothing from ep-2") != std::string::npos, why1);
  send[2] = big;
  CHECK_FALSE(groups[0]->exchange(send, &recv0, &why0));
  CHECK(why0 == "all-to-all exchange 2: rank ep-0 -> ep-2: chunk of 65 bytes exceeds the slot of 64");
  CHECK(all_to_all_config{3, 3}.validate() == "all-to-all: rank 3 outside a group of 3");
}

TEST_CASE("all-to-all through a fault proxy puts every byte, so the proxy's faults reach it: a failed put is named") {
  auto fabric = make_loopback_fabric();
  const std::vector<std::string> names{"ep-0", "ep-1"};
  auto failing = make_fault_proxy(make_loopback_transport(fabric, "ep-0"), {.kind = fault_kind::fail});
  auto plain = make_loopback_transport(fabric, "ep-1");
  all_to_all a{*failing, names, {0, 2, 64, std::chrono::milliseconds{200}}};
  all_to_all b{*plain, names, {1, 2, 64, std::chrono::milliseconds{200}}};
  a.connect({a.key(), b.key()});
  b.connect({a.key(), b.key()});
  CHECK(a.direct_peers() == 0);  // the proxy maps nothing: a direct store would pass it by
  CHECK(b.direct_peers() == 1);
  std::vector<std::byte> bytes(8, std::byte{7});
  std::vector<std::span<const std::byte>> send(2, std::span<const std::byte>{bytes}), recv;
  std::string why;
  CHECK_FALSE(a.exchange(send, &recv, &why));
  CHECK_MESSAGE(why.find("all-to-all exchange 1: rank ep-0 -> ep-1: put failed") != std::string::npos, why);
  CHECK(failing->num_injected() == 1);
}

TEST_CASE("all-to-all: a put that never settles fails the exchange after put_timeout, naming the rank it went "
          "to; a group given too few or too many peer keys is refused by name") {
  auto fabric = make_loopback_fabric();
  const std::vector<std::string> names{"ep-0", "ep-1"};
  auto stalled = make_fault_proxy(make_loopback_transport(fabric, "ep-0"), {.kind = fault_kind::stall, .max_faults = 100});
  auto plain = make_loopback_transport(fabric, "ep-1");
  all_to_all_config ca{0, 2, 64, std::chrono::milliseconds{200}};
  ca.put_timeout = std::chrono::milliseconds{30};
  all_to_all a{*stalled, names, ca};
  all_to_all b{*plain, names, {1, 2, 64, std::chrono::milliseconds{200}}};
  a.connect({a.key(), b.key()});
  std::vector<std::byte> bytes(8, std::byte{7});
  std::vector<std::span<const std::byte>> send(2, std::span<const std::byte>{bytes}), recv;
  std::string why;
  CHECK_FALSE(a.exchange(send, &recv, &why));
  CHECK_MESSAGE(why.find("all-to-all exchange 1: rank ep-0 -> ep-1: put failed: request 1") != std::string::npos, why);
  CHECK_MESSAGE(why.find("not complete after 30 ms") != std::string::npos, why);
  for (const size_t n : {size_t{1}, size_t{3}}) {
    all_to_all c{*plain, names, {1, 2, 64, std::chrono::milliseconds{200}}};
    c.connect(std::vector<region_key>(n, b.key()));
    why.clear();
    CHECK_FALSE(c.exchange(send, &recv, &why));
    CHECK(why == "all-to-all rank ep-1: " + std::to_string(n) + " peer keys for a group of 2");
  }
}

TEST_CASE("a region key survives a line of text between processes; a malformed line gives nothing") {
  const region_key k{"ucx", 42, 1 << 20, {0x00, 0x7f, 0xff, 0x10}};
  const auto line = key_to_text(k);
  CHECK(line == "ucx 42 1048576 007fff10");
  const auto back = key_from_text(line + "\n");
  REQUIRE(back);
  CHECK(back->backend == "ucx");
  CHECK(back->region_id == 42);
  CHECK(back->size_bytes == 1048576);
  CHECK(back->packed == k.packed);
  CHECK(key_from_text("loopback 1 8 -")->packed.empty());
  CHECK_FALSE(key_from_text("ucx 42 1048576 0g"));
  CHECK_FALSE(key_from_text("ucx 42 1048576 abc"));
  CHECK_FALSE(key_from_text("ucx forty-two 1 00"));
}

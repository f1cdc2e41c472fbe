#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "tests/transport/settle.hpp"
#include "transport/cuda_ipc.hpp"
#include "transport/fault_proxy.hpp"
#include "transport/loopback.hpp"
#include "transport/nccl.hpp"
#include "transport/ucx.hpp"

using namespace baton::transport;

namespace {

struct two_ranks {
  std::shared_ptr<loopback_fabric> fabric = make_loopback_fabric();
  std::vector<std::byte> src = std::vector<std::byte>(4096), dst = std::vector<std::byte>(4096);
  two_ranks() {
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 7);
  }
};

/// Two endpoints of one backend: the sender and the receiver.
struct endpoints {
  std::unique_ptr<transport> a, b;
};

endpoints make_endpoints(const std::string& backend, two_ranks& t) {
  if (backend == "loopback") return {make_loopback_transport(t.fabric, "a"), make_loopback_transport(t.fabric, "b")};
  if (backend == "modelled") return {make_modelled_link(t.fabric, "a"), make_modelled_link(t.fabric, "b")};
  std::string why;
  // "ucx-am": the sender's bytes travel as rendezvous active messages instead of RMA puts.
  const std::string mode = backend == "ucx-am" ? "am" : "put";
  auto a = make_ucx_transport({.name = "a", .send = mode}, &why);
  REQUIRE_MESSAGE(a, why);
  auto b = make_ucx_transport({.name = "b", .send = mode}, &why);
  REQUIRE_MESSAGE(b, why);
  return {std::move(a), std::move(b)};
}

/// Puts four layers of 1 KiB from `ka` into `kb` through `proxy`, set to corrupt layer 2: exactly
/// one byte, of layer 2, must differ.
void check_one_byte_flipped(fault_proxy& proxy, const region_key& ka, const region_key& kb, two_ranks& t) {
  xfer_error err;
  for (uint32_t layer = 0; layer < 4; ++layer) {
    auto id = proxy.post_put({1, layer, "b", ka.region_id, kb, {{layer * 1024ull, layer * 1024ull, 1024}}});
    CHECK(baton::test::settle(proxy, id, &err) == xfer_state::done);
    proxy.release(id);
  }
  CHECK(proxy.num_injected() == 1);
  size_t differing = 0, where = 0;
  for (size_t i = 0; i < t.src.size(); ++i)
    if (t.src[i] != t.dst[i]) ++differing, where = i;
  CHECK(differing == 1);
  CHECK(where / 1024 == 2);
}

}  // namespace

// The same expectations for every backend (design.md §8: conformance suites).
TEST_CASE("transport conformance: a put copies its segments and nothing else") {
  for (const std::string backend : {"loopback", "ucx", "ucx-am"}) {
    CAPTURE(backend);
    two_ranks t;
    auto [a, b] = make_endpoints(backend, t);
    CHECK(a->caps().one_sided_put);
    xfer_error err;
    auto ka = a->register_region(t.src.data(), t.src.size(), &err);
    auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
    REQUIRE(ka);
    REQUIRE(kb);
    auto id = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 1024, 512}, {2048, 0, 256}}});
    CHECK(baton::test::settle(*a, id, &err) == xfer_state::done);
    a->release(id);
    CHECK(std::equal(t.src.begin(), t.src.begin() + 512, t.dst.begin() + 1024));
    CHECK(std::equal(t.src.begin() + 2048, t.src.begin() + 2304, t.dst.begin()));
    CHECK(t.dst[600] == std::byte{0});  // untouched
    // Many transfers in flight at once all land.
    std::vector<uint64_t> ids;
    for (uint64_t i = 0; i < 16; ++i) ids.push_back(a->post_put({2, uint32_t(i), "b", ka->region_id, *kb, {{i * 256, i * 256, 256}}}));
    for (auto x : ids) CHECK(baton::test::settle(*a, x, &err) == xfer_state::done);
    CHECK(std::equal(t.src.begin(), t.src.end(), t.dst.begin()));
  }
}

TEST_CASE("transport conformance: the transport's own memory takes puts; a peer that maps it stores straight into "
          "it, and nothing maps memory a put must reach (the modelled link, the fault proxy)") {
  for (const std::string backend : {"loopback", "ucx", "ucx-am"}) {
    CAPTURE(backend);
    two_ranks t;
    auto [a, b] = make_endpoints(backend, t);
    xfer_error err;
    std::byte* mem = b->allocate_memory(8192, &err);
    REQUIRE_MESSAGE(mem, err.to_string());
    CHECK(reinterpret_cast<uintptr_t>(mem) % 4096 == 0);
    std::fill(mem, mem + 8192, std::byte{0});
    auto ka = a->register_region(t.src.data(), t.src.size(), &err);
    auto kb = b->register_region(mem + 4096, 4096, &err);  // a region inside the allocation
    REQUIRE(ka);
    REQUIRE(kb);
    auto id = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 100, 1000}}});
    CHECK(baton::test::settle(*a, id, &err) == xfer_state::done);
    a->release(id);
    CHECK(std::equal(t.src.begin(), t.src.begin() + 1000, mem + 4096 + 100));
    CHECK(mem[4096 + 99] == std::byte{0});
    // Loopback shares the process; UCX maps b's shared-memory segment into a's process.
    std::byte* remote = a->map_remote(*kb);
    REQUIRE(remote);
    remote[7] = std::byte{0x5a};
    CHECK(mem[4096 + 7] == std::byte{0x5a});
    b->deregister_region(kb->region_id);
    b->free_memory(mem);
  }
  two_ranks t;
  auto link = make_modelled_link(t.fabric, "m");
  xfer_error err;
  auto key = link->register_region(t.dst.data(), t.dst.size(), &err);
  REQUIRE(key);
  CHECK(link->map_remote(*key) == nullptr);  // its puts move no byte; stores would bypass its timing
  auto proxy = make_fault_proxy(make_loopback_transport(t.fabric, "p"), {.kind = fault_kind::drop});
  CHECK(proxy->map_remote(*key) == nullptr);  // its faults need every byte to be a put
  CHECK(make_loopback_transport(t.fabric, "q")->map_remote(*key) == t.dst.data());
}

TEST_CASE("UCX calls the settled listener when a transfer settles, done or failed, so owners need not poll on a timer") {
  for (const std::string backend : {"ucx", "ucx-am"}) {
    CAPTURE(backend);
    two_ranks t;
    auto [a, b] = make_endpoints(backend, t);
    std::atomic<int> calls{0};
    a->set_settled_listener([&calls] { ++calls; });
    xfer_error err;
    auto ka = a->register_region(t.src.data(), t.src.size(), &err);
    auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
    REQUIRE(ka);
    REQUIRE(kb);
    auto id = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 0, 512}}});
    for (int i = 0; i < 2'000'000 && calls == 0; ++i) std::this_thread::yield();
    CHECK(calls == 1);
    CHECK(a->poll(id, &err) == xfer_state::done);  // settled before the listener ran
    a->release(id);
    auto bad = a->post_put({2, 3, "b", ka->region_id, *kb, {{0, 4000, 512}}});  // past the region's end
    for (int i = 0; i < 2'000'000 && calls == 1; ++i) std::this_thread::yield();
    CHECK(calls == 2);
    CHECK(a->poll(bad, &err) == xfer_state::failed);
    a->set_settled_listener({});
    auto quiet = a->post_put({3, 0, "b", ka->region_id, *kb, {{0, 0, 8}}});
    CHECK(baton::test::settle(*a, quiet, &err) == xfer_state::done);
    CHECK(calls == 2);
  }
}

TEST_CASE("fault proxy over UCX: corrupt flips exactly one byte of the chosen layer, after the put has landed (UCX "
          "completes puts out of post order: the flip once raced the put it corrupts)") {
  for (const std::string backend : {"ucx", "ucx-am"}) {
    CAPTURE(backend);
    two_ranks t;
    auto [a, b] = make_endpoints(backend, t);
    auto proxy = make_fault_proxy(std::move(a), {fault_kind::corrupt_byte, 2, {}, 1, 99});
    xfer_error err;
    auto ka = proxy->register_region(t.src.data(), t.src.size(), &err);
    auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
    REQUIRE(ka);
    REQUIRE(kb);
    check_one_byte_flipped(*proxy, *ka, *kb, t);
  }
}

TEST_CASE("UCX quiesce: its thread stops; a put posted after fails at once, saying so; registering and mapping give "
          "nothing, deregistering and freeing return; its peers serve on") {
  for (const std::string backend : {"ucx", "ucx-am"}) {
    CAPTURE(backend);
    two_ranks t;
    auto [a, b] = make_endpoints(backend, t);
    xfer_error err;
    auto ka = a->register_region(t.src.data(), t.src.size(), &err);
    auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
    REQUIRE(ka);
    REQUIRE(kb);
    auto first = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 0, 512}}});
    REQUIRE(baton::test::settle(*a, first, &err) == xfer_state::done);
    a->release(first);
    auto* mem = a->allocate_memory(4096, &err);
    REQUIRE(mem);
    a->quiesce();
    a->quiesce();  // again: nothing more to stop
    auto late = a->post_put({2, 5, "b", ka->region_id, *kb, {{0, 0, 512}}});
    CHECK(a->poll(late, &err) == xfer_state::failed);
    CHECK(err.what.find("stopped") != std::string::npos);
    CHECK(err.layer == 5);
    CHECK(err.peer == "b");  // the put's destination (it named this side)
    a->release(late);
    xfer_error reg_err;
    CHECK_FALSE(a->register_region(t.src.data(), 64, &reg_err));
    CHECK(reg_err.what.find("stopped") != std::string::npos);
    CHECK(a->map_remote(*kb) == nullptr);
    a->deregister_region(ka->region_id);
    mem[0] = std::byte{1};  // still mapped until the transport goes
    a->free_memory(mem);
    // The peer it talked to takes puts from another transport as before.
    std::string why;
    auto c = make_ucx_transport({.name = "c", .send = backend == "ucx-am" ? "am" : "put"}, &why);
    REQUIRE_MESSAGE(c, why);
    auto kc = c->register_region(t.src.data(), t.src.size(), &err);
    REQUIRE(kc);
    auto id = c->post_put({3, 0, "b", kc->region_id, *kb, {{1024, 1024, 512}}});
    CHECK(baton::test::settle(*c, id, &err) == xfer_state::done);
    CHECK(std::equal(t.src.begin() + 1024, t.src.begin() + 1536, t.dst.begin() + 1024));
  }
}

TEST_CASE("UCX active messages: a put into a region its target no longer has is refused there, and fails as fatal "
          "(unknown_region), naming the call") {
  two_ranks t;
  auto [a, b] = make_endpoints("ucx-am", t);
  xfer_error err;
  auto ka = a->register_region(t.src.data(), t.src.size(), &err);
  auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
  REQUIRE(ka);
  REQUIRE(kb);
  auto ok = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 0, 512}}});
  REQUIRE(baton::test::settle(*a, ok, &err) == xfer_state::done);
  b->deregister_region(kb->region_id);
  auto stale = a->post_put({2, 1, "b", ka->region_id, *kb, {{0, 0, 512}}});
  REQUIRE(baton::test::settle(*a, stale, &err) == xfer_state::failed);
  CHECK(err.code == xfer_errc::unknown_region);
  CHECK_FALSE(err.retryable);
  CHECK_MESSAGE(err.what.find("ucp_am_send_nbx") != std::string::npos, err.what);
}

TEST_CASE("UCX keeps a bounded cache of peers' keys: past its cap the least recently used idle one is dropped, "
          "idle ones go after key_idle_ms, a mapped one stays, a dropped one is unpacked again on its next put, "
          "and puts keep flowing both ways") {
  for (const std::string mode : {"put", "am"}) {
    CAPTURE(mode);
    std::string why;
    ucx_config cfg{.name = "sender", .send = mode};
    cfg.max_keys_per_peer = 2;
    auto a = make_ucx_transport(cfg, &why);
    REQUIRE_MESSAGE(a, why);
    auto b = make_ucx_transport({.name = "b", .send = mode}, &why);
    REQUIRE_MESSAGE(b, why);
    std::vector<std::byte> src(4096, std::byte{7});
    xfer_error err;
    auto ka = a->register_region(src.data(), src.size(), &err);
    REQUIRE(ka);
    // Three segments of b's own memory: each has a key of its own (regions of plain memory may
    // share one, the same bytes).
    std::vector<std::byte*> dst;
    std::vector<region_key> keys;
    for (int i = 0; i < 3; ++i) {
      dst.push_back(b->allocate_memory(4096, &err));
      REQUIRE(dst.back());
      keys.push_back(*b->register_region(dst.back(), 4096, &err));
    }
    REQUIRE(keys[0].packed != keys[1].packed);
    auto put = [&](int k, std::byte value) {
      std::fill(src.begin(), src.end(), value);
      auto id = a->post_put({1, 0, "b", ka->region_id, keys[k], {{0, 0, 4096}}});
      const auto state = baton::test::settle(*a, id, &err);
      a->release(id);
      return state == xfer_state::done && dst[k][0] == value && dst[k][4095] == value;
    };
    CHECK(put(0, std::byte{1}));
    CHECK(put(1, std::byte{2}));
    CHECK(a->stats().keys == 2);
    CHECK(put(2, std::byte{3}));  // key 0, least recently used, goes
    CHECK(a->stats().keys == 2);
    CHECK(a->stats().peers == 1);  // the endpoint stays
    CHECK(put(0, std::byte{4}));   // unpacked again (key 1 goes)
    CHECK(put(1, std::byte{5}));
    CHECK(a->stats().keys == 2);
    CHECK(a->stats().in_flight == 0);
    // A mapped key is never dropped: the pointer must stay valid.
    if (mode == "put") {
      std::byte* mem = b->allocate_memory(4096, &err);
      REQUIRE(mem);
      auto km = b->register_region(mem, 4096, &err);
      REQUIRE(km);
      std::byte* remote = a->map_remote(*km);
      REQUIRE(remote);
      CHECK(put(2, std::byte{8}));
      CHECK(put(0, std::byte{9}));
      CHECK(put(1, std::byte{10}));
      CHECK(a->stats().keys == 2);  // the mapped one and the last used: the others churned past it
      remote[5] = std::byte{0x42};
      CHECK(mem[5] == std::byte{0x42});
    }
  }
  // Idle keys go on their own; the endpoints stay, and puts go on both ways (UCX pairs the two
  // workers' endpoints: closing one side's would have cut the other's puts).
  for (const std::string mode : {"put", "am"}) {
    CAPTURE(mode);
    std::string why;
    ucx_config cfg{.name = "a", .send = mode};
    cfg.key_idle_ms = 1;
    auto a = make_ucx_transport(cfg, &why);
    auto b = make_ucx_transport({.name = "b", .send = mode}, &why);
    REQUIRE(a);
    REQUIRE(b);
    std::vector<std::byte> abuf(512, std::byte{1}), bbuf(512, std::byte{0});
    xfer_error err;
    auto ka = a->register_region(abuf.data(), abuf.size(), &err);
    auto kb = b->register_region(bbuf.data(), bbuf.size(), &err);
    auto round = [&](std::byte value) {
      std::fill(abuf.begin(), abuf.end(), value);
      auto id = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 0, 512}}});
      bool ok = baton::test::settle(*a, id, &err) == xfer_state::done && bbuf[511] == value;
      a->release(id);
      bbuf[0] = static_cast<std::byte>(static_cast<int>(value) + 1);
      id = b->post_put({2, 0, "a", kb->region_id, *ka, {{0, 0, 1}}});
      ok = ok && baton::test::settle(*b, id, &err) == xfer_state::done && abuf[0] == bbuf[0];
      b->release(id);
      return ok;
    };
    CHECK(round(std::byte{2}));
    bool gone = false;
    for (int i = 0; i < 5000 && !gone; ++i) {  // bounded: up to ~5 s for a 1 ms idle limit
      gone = a->stats().keys == 0;
      if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds{1});
    }
    CHECK(gone);
    CHECK(a->stats().peers == 1);
    CHECK(round(std::byte{4}));
    CHECK(round(std::byte{6}));
  }
  std::string why;
  CHECK(make_ucx_transport({.name = "c", .max_keys_per_peer = 0}, &why) == nullptr);
  CHECK(why.find("max_keys_per_peer") != std::string::npos);
}

TEST_CASE("transport conformance: errors name request, peer and layer") {
  for (const std::string backend : {"loopback", "ucx", "ucx-am", "modelled"}) {
    CAPTURE(backend);
    two_ranks t;
    auto [a, b] = make_endpoints(backend, t);
    xfer_error err;
    auto ka = a->register_region(t.src.data(), t.src.size(), &err);
    auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
    auto id = a->post_put({7, 3, "decode-0", ka->region_id, *kb, {{4000, 0, 200}}});
    CHECK(baton::test::settle(*a, id, &err) == xfer_state::failed);
    CHECK(err.code == xfer_errc::out_of_bounds);
    CHECK(err.to_string().find("request 7, peer decode-0, layer 3") != std::string::npos);
    id = a->post_put({8, 1, "decode-0", ka->region_id + 1000, *kb, {{0, 0, 10}}});
    CHECK(baton::test::settle(*a, id, &err) == xfer_state::failed);
    CHECK(err.code == xfer_errc::unknown_region);
    CHECK(err.what.find("local region") != std::string::npos);
    auto foreign = *kb;
    foreign.backend = backend.rfind("ucx", 0) == 0 ? "loopback" : "ucx";  // (the modelled link's keys say loopback)
    id = a->post_put({9, 1, "decode-0", ka->region_id, foreign, {{0, 0, 10}}});
    CHECK(baton::test::settle(*a, id, &err) == xfer_state::failed);
    CHECK(err.code == xfer_errc::unknown_region);
  }
}

TEST_CASE("modelled link (sims): a put is checked and completes, and no byte moves") {
  two_ranks t;
  auto [a, b] = make_endpoints("modelled", t);
  CHECK(a->caps().name == "modelled");
  xfer_error err;
  auto ka = a->register_region(t.src.data(), t.src.size(), &err);
  auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
  const auto id = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 0, 4096}}});
  CHECK(baton::test::settle(*a, id, &err) == xfer_state::done);
  CHECK(std::all_of(t.dst.begin(), t.dst.end(), [](std::byte x) { return x == std::byte{0}; }));
}

TEST_CASE("modelled link with timing: a put is pending until its bytes crossed both NICs, which queue") {
  two_ranks t;
  auto timing = std::make_shared<link_timing>();
  int64_t now = 0;
  timing->now_ns = [&now] { return now; };
  timing->gbps = 1.0;  // 1 byte per ns
  timing->latency_ns = 100;
  auto a = make_modelled_link(t.fabric, "a", timing);
  auto b = make_modelled_link(t.fabric, "b", timing);
  xfer_error err;
  auto ka = a->register_region(t.src.data(), t.src.size(), &err);
  auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
  const auto first = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 0, 1000}}});
  const auto second = a->post_put({1, 1, "b", ka->region_id, *kb, {{0, 0, 1000}}});  // queues behind
  now = 1099;
  CHECK(a->poll(first, &err) == xfer_state::pending);
  now = 1100;
  CHECK(a->poll(first, &err) == xfer_state::done);
  CHECK(a->poll(second, &err) == xfer_state::pending);
  now = 2200;
  CHECK(a->poll(second, &err) == xfer_state::done);
  CHECK(timing->modelled_bytes == 2000);
}

TEST_CASE("modelled link with timing: an endpoint with a faster NIC takes two senders' puts together, each at its "
          "sender's rate, instead of one after the other") {
  two_ranks t;
  auto timing = std::make_shared<link_timing>();
  int64_t now = 0;
  timing->now_ns = [&now] { return now; };
  timing->gbps = 1.0;                  // the senders' NICs: 1 byte per ns
  timing->endpoint_gbps["b"] = 4.0;    // the receiver's: 4
  timing->latency_ns = 100;
  auto a = make_modelled_link(t.fabric, "a", timing);
  auto c = make_modelled_link(t.fabric, "c", timing);
  auto b = make_modelled_link(t.fabric, "b", timing);
  xfer_error err;
  auto ka = a->register_region(t.src.data(), t.src.size(), &err);
  auto kc = c->register_region(t.src.data(), t.src.size(), &err);
  auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
  const auto from_a = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 0, 1000}}});
  const auto from_c = c->post_put({2, 0, "b", kc->region_id, *kb, {{0, 0, 1000}}});
  now = 1100;  // 1000 bytes at the slower end's 1 B/ns, plus latency
  CHECK(a->poll(from_a, &err) == xfer_state::done);
  CHECK(c->poll(from_c, &err) == xfer_state::pending);
  now = 1350;  // behind a's quarter of b's time (250 ns), not behind all of a's put (it was 2200)
  CHECK(c->poll(from_c, &err) == xfer_state::done);
}

TEST_CASE("fault proxy: corrupt flips exactly one byte of the chosen layer and drop, delay, disconnect, fail and stall behave as named") {
  two_ranks t;
  auto proxy = make_fault_proxy(make_loopback_transport(t.fabric, "a"), {fault_kind::corrupt_byte, 2, {}, 1, 99});
  auto b = make_loopback_transport(t.fabric, "b");
  xfer_error err;
  auto ka = proxy->register_region(t.src.data(), t.src.size(), &err);
  auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
  check_one_byte_flipped(*proxy, *ka, *kb, t);
  // A put with no bytes at the chosen layer has nothing to flip (it divided by zero before).
  for (const std::vector<segment>& segs : {std::vector<segment>{}, std::vector<segment>{{0, 0, 0}}}) {
    auto empty = make_fault_proxy(make_loopback_transport(t.fabric, segs.empty() ? "z0" : "z1"), {fault_kind::corrupt_byte, 2, {}, 1, 99});
    auto kz = empty->register_region(t.src.data(), t.src.size(), &err);
    auto eid = empty->post_put({2, 2, "b", kz->region_id, *kb, segs});
    CHECK(empty->poll(eid, &err) == xfer_state::done);
    empty->release(eid);
  }

  auto failing = make_fault_proxy(make_loopback_transport(t.fabric, "c"), {fault_kind::fail, {}, 5, 1, 1});
  auto kc = failing->register_region(t.src.data(), t.src.size(), &err);
  auto id = failing->post_put({5, 0, "b", kc->region_id, *kb, {{0, 0, 8}}});
  CHECK(failing->poll(id, &err) == xfer_state::failed);
  CHECK(err.code == xfer_errc::injected_failure);
  CHECK(err.retryable);
  auto ok = failing->post_put({6, 0, "b", kc->region_id, *kb, {{0, 0, 8}}});  // other request: untouched
  CHECK(failing->poll(ok, &err) == xfer_state::done);

  auto dropping = make_fault_proxy(make_loopback_transport(t.fabric, "e"), {fault_kind::drop, {}, {}, 1, 1});
  auto ke = dropping->register_region(t.src.data(), t.src.size(), &err);
  std::fill(t.dst.begin(), t.dst.end(), std::byte{0});
  id = dropping->post_put({10, 0, "b", ke->region_id, *kb, {{0, 0, 64}}});
  CHECK(dropping->poll(id, &err) == xfer_state::done);  // reports success ...
  CHECK(t.dst[1] == std::byte{0});                        // ... but nothing landed

  auto slow = make_fault_proxy(make_loopback_transport(t.fabric, "f"), {fault_kind::delay, {}, {}, 1, 1, 3});
  auto kf = slow->register_region(t.src.data(), t.src.size(), &err);
  id = slow->post_put({11, 0, "b", kf->region_id, *kb, {{0, 0, 64}}});
  for (int i = 0; i < 3; ++i) CHECK(slow->poll(id, &err) == xfer_state::pending);
  CHECK(slow->poll(id, &err) == xfer_state::done);

  auto cut = make_fault_proxy(make_loopback_transport(t.fabric, "g"), {fault_kind::disconnect, 1, {}, 1, 1});
  auto kg = cut->register_region(t.src.data(), t.src.size(), &err);
  id = cut->post_put({12, 0, "b", kg->region_id, *kb, {{0, 0, 8}}});
  CHECK(cut->poll(id, &err) == xfer_state::done);  // layer 0 passes
  for (uint32_t layer : {1u, 2u}) {                // from layer 1 on, the peer is gone
    id = cut->post_put({12, layer, "b", kg->region_id, *kb, {{0, 0, 8}}});
    CHECK(cut->poll(id, &err) == xfer_state::failed);
    CHECK(err.code == xfer_errc::peer_unreachable);
  }

  auto stalling = make_fault_proxy(make_loopback_transport(t.fabric, "d"), {fault_kind::stall, {}, {}, 1, 1});
  auto kd = stalling->register_region(t.src.data(), t.src.size(), &err);
  id = stalling->post_put({9, 0, "b", kd->region_id, *kb, {{0, 0, 8}}});
  CHECK(stalling->poll(id, &err) == xfer_state::pending);
}

TEST_CASE("nccl transport: a wrong config is refused by name; where it cannot start, it says why") {
  CHECK(nccl_config{.name = ""}.validate().find("rank name") != std::string::npos);
  CHECK(nccl_config{.name = "p0", .device = -1}.validate().find("device -1") != std::string::npos);
  CHECK(nccl_config{.name = "p0", .world_size = 0}.validate().find("world_size 0") != std::string::npos);
  CHECK(nccl_config{.name = "p0", .world_size = 2, .rank = 2, .unique_id = std::string(256, 'a')}.validate().find("rank 2 is outside a world of 2") != std::string::npos);
  CHECK(nccl_config{.name = "p0", .world_size = 2, .rank = 1}.validate().find("needs the communicator's unique_id") != std::string::npos);
  CHECK(nccl_config{.name = "p0", .world_size = 2, .rank = 1, .unique_id = "abc"}.validate().find("256 lowercase hex digits, got 3") != std::string::npos);
  CHECK(nccl_config{.name = "p0", .world_size = 2, .rank = 1, .unique_id = std::string(256, 'g')}.validate().find("hex") != std::string::npos);
  CHECK(nccl_config{.name = "p0", .world_size = 2, .rank = 1, .unique_id = std::string(256, 'a')}.validate().empty());
  CHECK(nccl_config{.name = "p0"}.validate().empty());

  std::string why;
  CHECK_FALSE(make_nccl_transport({.name = "p0", .world_size = 3, .rank = 5}, &why));
  CHECK(why.find("rank 5") != std::string::npos);
  // Without NCCL in the build, or without a GPU, nothing is made and the reason is named; with
  // both, a one-rank communicator starts and offers device memory.
  why.clear();
  auto t = make_nccl_transport({.name = "p0"}, &why);
  if (t) {
    CHECK(t->caps().name == "nccl");
    CHECK(t->caps().device_memory);
  } else {
    INFO(why);
    CHECK((why.find("no NCCL") != std::string::npos || why.find("no CUDA device") != std::string::npos ||
           why.find("does not exist") != std::string::npos));
  }
  if (!nccl_built()) CHECK(nccl_unique_id(&why).empty());
}

TEST_CASE("coalesce_segments joins segments that continue each other on both sides, drops empty ones, keeps order") {
  const std::vector<segment> in = {{0, 100, 10}, {10, 110, 5}, {15, 200, 5}, {20, 205, 0}, {20, 205, 5}, {99, 0, 1}};
  const auto out = coalesce_segments(in);
  REQUIRE(out.size() == 3);
  CHECK((out[0].src_offset == 0 && out[0].dst_offset == 100 && out[0].size_bytes == 15));
  CHECK((out[1].src_offset == 15 && out[1].dst_offset == 200 && out[1].size_bytes == 10));  // dst jumped: a new run
  CHECK((out[2].src_offset == 99 && out[2].dst_offset == 0 && out[2].size_bytes == 1));
  CHECK(coalesce_segments({}).empty());
}

TEST_CASE("cuda_ipc keys: what a key carries comes back unchanged; a key of another backend, version or length is "
          "refused by name; a wrong config is refused by name; where it cannot start, it says why") {
  cuda_ipc_key k;
  k.host = cuda_ipc_host_id();
  k.pid = 4242;
  k.process = cuda_ipc_process_id();
  k.device = 3;
  k.offset = (uint64_t{1} << 40) + 17;
  for (size_t i = 0; i < k.handle.size(); ++i) k.handle[i] = static_cast<uint8_t>(i * 31 + 7);
  region_key key{"cuda_ipc", 9, 1 << 20, pack_cuda_ipc_key(k)};
  std::string why;
  auto back = unpack_cuda_ipc_key(key, &why);
  REQUIRE_MESSAGE(back, why);
  CHECK(back->host == k.host);
  CHECK(back->pid == 4242);
  CHECK(back->process == cuda_ipc_process_id());
  CHECK(back->device == 3);
  CHECK(back->offset == k.offset);
  CHECK(back->handle == k.handle);
  CHECK(cuda_ipc_host_id() != 0);
  CHECK(cuda_ipc_host_id() == cuda_ipc_host_id());
  CHECK(cuda_ipc_process_id() != 0);
  CHECK(cuda_ipc_process_id() == cuda_ipc_process_id());

  auto refused = [&](region_key bad) {
    why.clear();
    CHECK_FALSE(unpack_cuda_ipc_key(bad, &why));
    return why;
  };
  auto other = key;
  other.backend = "ucx";
  CHECK(refused(other).find("a ucx key, not a cuda_ipc one") != std::string::npos);
  auto short_key = key;
  short_key.packed.pop_back();
  CHECK(refused(short_key).find("this one 103") != std::string::npos);
  auto newer = key;
  newer.packed[0] = 2;
  CHECK(refused(newer).find("version 2") != std::string::npos);

  CHECK(cuda_ipc_config{.name = ""}.validate().find("rank name") != std::string::npos);
  CHECK(cuda_ipc_config{.name = "d0", .device = -2}.validate().find("device -2") != std::string::npos);
  CHECK(cuda_ipc_config{.name = "d0", .max_open_peer_allocations = 0}.validate().find("max_open_peer_allocations") !=
        std::string::npos);
  CHECK(cuda_ipc_config{.name = "d0"}.validate().empty());
  why.clear();
  CHECK_FALSE(make_cuda_ipc_transport({.name = "d0", .device = -1}, &why));
  CHECK(why.find("device -1") != std::string::npos);
  why.clear();
  auto t = make_cuda_ipc_transport({.name = "d0"}, &why);
  if (t) {  // a GPU: the GPU suite checks its puts (tests/gpu/cuda_ipc_transport.test.cpp)
    CHECK(t->caps().name == "cuda_ipc");
    CHECK(t->caps().one_sided_put);
    CHECK(t->caps().crosses_processes);
  } else {
    INFO(why);
    CHECK((why.find("no CUDA") != std::string::npos || why.find("does not exist") != std::string::npos));
  }
}

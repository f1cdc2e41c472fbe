#include <doctest/doctest.h>

#include <numeric>

#include "transport/fault_proxy.hpp"
#include "transport/loopback.hpp"

using namespace baton::transport;

namespace {

struct two_ranks {
  std::shared_ptr<loopback_fabric> fabric = make_loopback_fabric();
  std::vector<std::byte> src = std::vector<std::byte>(4096), dst = std::vector<std::byte>(4096);
  two_ranks() {
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 7);
  }
};

}  // namespace

TEST_CASE("loopback put copies the segments and nothing else") {
  two_ranks t;
  auto a = make_loopback_transport(t.fabric, "a"), b = make_loopback_transport(t.fabric, "b");
  xfer_error err;
  auto ka = a->register_region(t.src.data(), t.src.size(), &err);
  auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
  REQUIRE(ka);
  REQUIRE(kb);
  auto id = a->post_put({1, 0, "b", ka->region_id, *kb, {{0, 1024, 512}, {2048, 0, 256}}});
  CHECK(a->poll(id, &err) == xfer_state::done);
  a->release(id);
  CHECK(std::equal(t.src.begin(), t.src.begin() + 512, t.dst.begin() + 1024));
  CHECK(std::equal(t.src.begin() + 2048, t.src.begin() + 2304, t.dst.begin()));
  CHECK(t.dst[600] == std::byte{0});  // untouched
}

TEST_CASE("loopback errors name request, peer and layer") {
  two_ranks t;
  auto a = make_loopback_transport(t.fabric, "a");
  xfer_error err;
  auto ka = a->register_region(t.src.data(), t.src.size(), &err);
  auto kb = a->register_region(t.dst.data(), t.dst.size(), &err);
  auto id = a->post_put({7, 3, "decode-0", ka->region_id, *kb, {{4000, 0, 200}}});
  CHECK(a->poll(id, &err) == xfer_state::failed);
  CHECK(err.code == xfer_errc::out_of_bounds);
  CHECK(err.to_string().find("request 7, peer decode-0, layer 3") != std::string::npos);
  a->deregister_region(kb->region_id);
  id = a->post_put({8, 1, "decode-0", ka->region_id, *kb, {{0, 0, 10}}});
  CHECK(a->poll(id, &err) == xfer_state::failed);
  CHECK(err.code == xfer_errc::unknown_region);
  CHECK(err.what.find("remote region") != std::string::npos);
}

TEST_CASE("fault proxy: corrupt flips exactly one byte of the chosen layer, fail and stall are reported") {
  two_ranks t;
  auto proxy = make_fault_proxy(make_loopback_transport(t.fabric, "a"), {fault_kind::corrupt_byte, 2, {}, 1, 99});
  auto b = make_loopback_transport(t.fabric, "b");
  xfer_error err;
  auto ka = proxy->register_region(t.src.data(), t.src.size(), &err);
  auto kb = b->register_region(t.dst.data(), t.dst.size(), &err);
  for (uint32_t layer = 0; layer < 4; ++layer) {
    auto id = proxy->post_put({1, layer, "b", ka->region_id, *kb, {{layer * 1024ull, layer * 1024ull, 1024}}});
    CHECK(proxy->poll(id, &err) == xfer_state::done);
    proxy->release(id);
  }
  CHECK(proxy->num_injected() == 1);
  size_t differing = 0, where = 0;
  for (size_t i = 0; i < t.src.size(); ++i)
    if (t.src[i] != t.dst[i]) ++differing, where = i;
  CHECK(differing == 1);
  CHECK(where / 1024 == 2);

  auto failing = make_fault_proxy(make_loopback_transport(t.fabric, "c"), {fault_kind::fail, {}, 5, 1, 1});
  auto kc = failing->register_region(t.src.data(), t.src.size(), &err);
  auto id = failing->post_put({5, 0, "b", kc->region_id, *kb, {{0, 0, 8}}});
  CHECK(failing->poll(id, &err) == xfer_state::failed);
  CHECK(err.code == xfer_errc::injected_failure);
  CHECK(err.retryable);
  auto ok = failing->post_put({6, 0, "b", kc->region_id, *kb, {{0, 0, 8}}});  // other request: untouched
  CHECK(failing->poll(ok, &err) == xfer_state::done);

  auto stalling = make_fault_proxy(make_loopback_transport(t.fabric, "d"), {fault_kind::stall, {}, {}, 1, 1});
  auto kd = stalling->register_region(t.src.data(), t.src.size(), &err);
  id = stalling->post_put({9, 0, "b", kd->region_id, *kb, {{0, 0, 8}}});
  CHECK(stalling->poll(id, &err) == xfer_state::pending);
}

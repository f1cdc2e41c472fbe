#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <map>
#include <mutex>

#include "actors/prefill_rank_state.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "tests/test_util.hpp"
#include "transport/fault_proxy.hpp"
#include "transport/kv_wire.hpp"

// What the KV handoff puts on the wire: each page of each layer once (a chunk that ends mid-page
// leaves that page to the next), and in a wire form (INT8, INT4) the form's bytes, checked and
// expanded on the decode rank. The rest of the handoff's behaviour is in disaggregation.test.cpp.

using namespace baton;
using test::chunk_tokens;
using test::encode;
using test::prompts;
using test::small_cluster;

namespace {

namespace xp = baton::transport;  // inside a transport, `transport` names the class

/// Passes everything to `inner`, adding up the bytes each layer's puts carry.
class put_counting_transport final : public xp::transport {
public:
  explicit put_counting_transport(std::unique_ptr<xp::transport> inner) : inner_(std::move(inner)) {}
  xp::capabilities caps() const override { return inner_->caps(); }
  std::optional<xp::region_key> register_region(std::byte* base, uint64_t size, xp::xfer_error* err) override {
    return inner_->register_region(base, size, err);
  }
  void deregister_region(uint64_t id) override { inner_->deregister_region(id); }
  uint64_t post_put(const xp::put_desc& d) override {
    {
      std::lock_guard<std::mutex> lock{m_};
      for (const auto& s : d.segments) bytes_[d.layer] += s.size_bytes;
    }
    return inner_->post_put(d);
  }
  xp::xfer_state poll(uint64_t id, xp::xfer_error* err) override { return inner_->poll(id, err); }
  void release(uint64_t id) override { inner_->release(id); }
  std::byte* allocate_memory(uint64_t size, xp::xfer_error* err) override { return inner_->allocate_memory(size, err); }
  void free_memory(std::byte* base) override { inner_->free_memory(base); }
  std::byte* map_remote(const xp::region_key& key) override { return inner_->map_remote(key); }
  void set_settled_listener(std::function<void()> fn) override { inner_->set_settled_listener(std::move(fn)); }
  std::map<uint32_t, uint64_t> bytes() const {
    std::lock_guard<std::mutex> lock{m_};
    return bytes_;
  }

private:
  std::unique_ptr<xp::transport> inner_;
  mutable std::mutex m_;
  std::map<uint32_t, uint64_t> bytes_;
};

/// A transport wrapper for start_local_cluster: prefill-0's puts are counted in `*counted`.
auto counting_prefill_0(std::shared_ptr<put_counting_transport>* counted) {
  return [counted](std::unique_ptr<xp::transport> inner, const std::string& name) -> std::shared_ptr<xp::transport> {
    if (name != "prefill-0") return std::shared_ptr<xp::transport>{std::move(inner)};
    *counted = std::make_shared<put_counting_transport>(std::move(inner));
    return *counted;
  };
}

}  // namespace

TEST_CASE("a chunk that ends mid-page leaves that page to the next chunk: each page of each layer is shipped once, "
          "and the answer equals the colocated run") {
  // 65 tokens in chunks of 16. Pages of 10: four chunks end mid-page. Pages of 40: three chunks
  // ship nothing at all (each lies inside a page another chunk ships whole).
  for (uint32_t page_tokens : {10u, 40u}) {
    CAPTURE(page_tokens);
    test::cluster_system t;
    auto cfg = small_cluster();
    cfg.executor.page_size_tokens = page_tokens;
    std::shared_ptr<put_counting_transport> counted;
    auto cluster = start_local_cluster(t.sys, cfg, {}, counting_prefill_0(&counted));
    test::cluster_system::stopper stop{t, cluster};
    REQUIRE(counted);
    const std::string text = prompts[2];
    generate_request req;
    req.prompt = text;
    req.max_tokens = 8;
    req.return_logits = true;
    auto got = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    const auto prompt = encode(cfg, text);
    REQUIRE(prompt.size() == 65);
    auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    const auto ref = gpu::generate_colocated(*exec, prompt, 8, chunk_tokens);
    REQUIRE(ref.error.empty());
    CHECK(got->tokens == ref.tokens);
    for (size_t i = 0; i < ref.step_logits.size() && i < got->step_logits.size(); ++i)
      CHECK_MESSAGE(test::same_bits(got->step_logits[i], ref.step_logits[i]), "step " << i);
    // Every layer carried each of the prompt's pages exactly once.
    const uint64_t pages = (prompt.size() + page_tokens - 1) / page_tokens;
    const uint64_t page_bytes = exec->kv().layout().page_bytes();
    const auto bytes = counted->bytes();
    REQUIRE(bytes.size() == cfg.model.num_hidden_layers);
    for (const auto& [layer, b] : bytes) {
      CAPTURE(layer);
      CHECK(b == pages * page_bytes);
    }
  }
}

TEST_CASE("KV in wire form (INT8, INT4): the decode rank's steps equal the colocated run whose prompt KV went "
          "through the same form, bit for bit, and each layer carries each page's wire bytes once") {
  for (const std::string transport : {"loopback", "ucx"})
    for (const auto form : {transport::wire_format::int8, transport::wire_format::int4}) {
      CAPTURE(transport);
      CAPTURE(transport::to_string(form));
      test::cluster_system t;
      auto cfg = small_cluster();
      cfg.transport = transport;
      // The batch class only: a chat request in the same cluster still travels as f32.
      cfg.router.request.kv_wire.batch = form;
      std::shared_ptr<put_counting_transport> counted;
      auto cluster = start_local_cluster(t.sys, cfg, {}, counting_prefill_0(&counted));
      test::cluster_system::stopper stop{t, cluster};
      REQUIRE(counted);
      auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
      auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
      const auto prompt = encode(cfg, prompts[2]);  // 65 tokens: five pages of 16, the last holding one
      const auto plain = gpu::generate_colocated(*exec, prompt, 10, chunk_tokens);
      const auto through = gpu::generate_colocated(*exec, prompt, 10, chunk_tokens, {}, false, test::wire_round_trip(form));
      REQUIRE(plain.error.empty());
      REQUIRE(through.error.empty());

      generate_request req;
      req.prompt = prompts[2];
      req.max_tokens = 10;
      req.return_logits = true;
      req.traffic_class = "batch";
      auto got = t.generate(cluster.router, req);
      REQUIRE_MESSAGE(got, t.sys.render(got.error()));
      CHECK(got->tokens == through.tokens);
      REQUIRE(got->step_logits.size() == through.step_logits.size());
      bool moved = false;  // the wire form did change the decode steps' inputs
      for (size_t i = 0; i < through.step_logits.size(); ++i) {
        CHECK_MESSAGE(test::same_bits(got->step_logits[i], through.step_logits[i]), "step " << i);
        if (i < plain.step_logits.size()) moved |= !test::same_bits(got->step_logits[i], plain.step_logits[i]);
      }
      CHECK(moved);
      // The first token is the prefill rank's, from its own f32 KV.
      CHECK(test::same_bits(got->step_logits[0], plain.step_logits[0]));
      const uint64_t page_values = exec->kv().layout().page_bytes() / sizeof(float);
      const uint64_t pages = exec->kv().pages_for_tokens(static_cast<uint32_t>(prompt.size()));
      auto bytes = counted->bytes();
      REQUIRE(bytes.size() == cfg.model.num_hidden_layers);
      for (const auto& [layer, b] : bytes) {
        CAPTURE(layer);
        CHECK(b == pages * transport::wire_bytes(form, page_values));
      }

      // A chat request in the same cluster: f32 on the wire, and bit for bit the plain colocated run.
      req.traffic_class = "chat";
      auto chat = t.generate(cluster.router, req);
      REQUIRE_MESSAGE(chat, t.sys.render(chat.error()));
      CHECK(chat->tokens == plain.tokens);
      CHECK(test::same_bits(chat->step_logits, plain.step_logits));
      bytes = counted->bytes();
      for (const auto& [layer, b] : bytes) CHECK(b == pages * (transport::wire_bytes(form, page_values) + exec->kv().layout().page_bytes()));
      CHECK(t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages);
      CHECK(t.stats(cluster.prefill[0].handle).num_free_pages == cfg.executor.num_kv_pages);
    }
}

TEST_CASE("KV in wire form: a corrupted layer fails its checksum over the wire bytes and never reaches decoding; the "
          "lease's pages come back") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.router.request.max_attempts = 1;
  cfg.router.request.kv_wire.chat = transport::wire_format::int8;
  auto cluster = start_local_cluster(t.sys, cfg, {}, [](std::unique_ptr<transport::transport> inner,
                                                        const std::string& name) -> std::shared_ptr<transport::transport> {
    if (name != "prefill-0") return std::shared_ptr<transport::transport>{std::move(inner)};
    return std::shared_ptr<transport::transport>{
        transport::make_fault_proxy(std::move(inner), {transport::fault_kind::corrupt_byte, 2, {}, 1, 5})};
  });
  test::cluster_system::stopper stop{t, cluster};
  generate_request req;
  req.prompt = prompts[1];
  req.max_tokens = 6;
  auto got = t.generate(cluster.router, req);
  REQUIRE_FALSE(got);
  const auto text = t.sys.render(got.error());
  CHECK_MESSAGE(text.find("transfer_failed") != std::string::npos, text);
  CHECK_MESSAGE(text.find("rank decode-0, stage kv_recv: layer 2 from prefill-0 failed its checksum in int8 form") !=
                    std::string::npos,
                text);
  bool stepped = false;
  for (const auto& e : t.events(cluster.decode[0].handle)) stepped |= e.kind == "step";
  CHECK_FALSE(stepped);
  bool back = false;
  for (int i = 0; i < 500 && !back; ++i) {
    back = t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages;
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  CHECK(back);
  // The next request (no fault left to inject) succeeds in INT8.
  req.prompt = "after the corruption";
  CHECK(t.generate(cluster.router, req));
}

TEST_CASE("KV in wire form: a partly filled last page travels with the prompt's rows only, the rest as zeros, so "
          "a stale value there (even a NaN) neither fails the prompt nor reaches the decode rank") {
  const gpu::kv_layout lay{2, 4, 8, 64, 2};  // 2 layers, 4 pages of 8 positions, K and V of 64 values
  gpu::kv_cache kv{lay};
  const auto pages = *kv.kv_page_alloc(2);
  for (uint32_t l = 0; l < 2; ++l)
    for (uint32_t i = 0; i < 2; ++i) {
      float* page = kv.k_at(l, pages[i], 0);
      for (uint64_t v = 0; v < lay.page_bytes() / 4; ++v) page[v] = 0.01f * static_cast<float>((v * 7 + l + i) % 23) - 0.1f;
    }
  // The prompt fills 11 positions: page 0 whole, 3 rows of page 1. Row 5 of page 1 holds a NaN
  // from a former sequence, in K and in V.
  kv.k_at(1, pages[1], 5)[3] = std::numeric_limits<float>::quiet_NaN();
  kv.v_at(1, pages[1], 5)[9] = std::numeric_limits<float>::quiet_NaN();
  auto staging = std::make_shared<kv_wire_staging>();
  staging->num_pages = lay.num_pages;
  staging->page_values = lay.page_bytes() / 4;
  staging->slot_bytes = kv_wire_staging::slot_bytes_for(lay);
  staging->memory = std::shared_ptr<std::byte>(new std::byte[staging->slot_bytes * lay.num_layers * lay.num_pages],
                                               std::default_delete<std::byte[]>());
  prefill_detail::chunk_sender sender{};
  sender.request_id = 7;
  sender.last = true;
  sender.first_page = 0, sender.end_page = 2;
  sender.local_pages = pages, sender.remote_pages = {0, 1};
  sender.local_layout = sender.remote_layout = lay;
  sender.wire = transport::wire_format::int8;
  sender.staging = staging;
  sender.tail_tokens = 3;
  for (uint32_t l = 0; l < 2; ++l) REQUIRE(sender.encode_layer(l, kv).empty());
  std::vector<float> back(staging->page_values);
  transport::wire_decode(transport::wire_format::int8, reinterpret_cast<const uint8_t*>(staging->slot(1, pages[1])),
                         staging->page_values, back.data());
  const uint64_t plane = 8 * 64;
  for (uint64_t p = 0; p < 2; ++p)
    for (uint64_t v = 0; v < plane; ++v) {
      const float orig = kv.k_at(1, pages[1], 0)[p * plane + v];
      if (v < 3 * 64) CHECK(std::fabs(back[p * plane + v] - orig) <= 0.1f / 127 + 1e-6f);  // the prompt's rows
      else CHECK(back[p * plane + v] == 0.0f);                                             // the rest
    }
  // A NaN in the prompt's own rows has no wire form: the layer says which page.
  kv.k_at(0, pages[0], 2)[1] = std::numeric_limits<float>::quiet_NaN();
  const auto why = sender.encode_layer(0, kv);
  CHECK_MESSAGE(why.find("page 0 of the prompt") != std::string::npos, why);
}

TEST_CASE("a lease freed while its layers are still being checked keeps its pages out of the pool until the last "
          "check answers, then gives every one back") {
  test::cluster_system t;
  auto cfg = small_cluster();
  // Each check waits 500 ms on the rank's check worker (one thread, in order): the layers below
  // are still queued there for about layers x 500 ms after the first is announced.
  cfg.decode.fault_check_delay_ms = 500;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto decode = cluster.decode[0].handle;
  const uint32_t all = cfg.executor.num_kv_pages;
  REQUIRE(cfg.model.num_hidden_layers >= 2);
  caf::scoped_actor self{t.sys};
  const uint32_t prompt = 40;
  kv_lease_grant g;
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{1, prompt + 4, 60000, prompt})
      .receive([&](kv_lease_grant& x) { g = std::move(x); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  REQUIRE(t.stats(decode).num_free_pages < all);
  // Every layer announced (its checksum does not matter: the lease is gone before any answer),
  // then the lease released by a holder whose writers are done, so no quarantine holds it.
  for (uint32_t l = 0; l < cfg.model.num_hidden_layers; ++l)
    self->send(decode, kv_layer_ready{1, g.lease_id, l, prompt, 1, "prefill-0"});
  self->send(decode, release_atom::value, g.lease_id, false);
  // Messages from one sender arrive in order: the release came before this question.
  CHECK(t.stats(decode).num_free_pages < all);  // held: a check (an expansion) may still write them
  bool quarantined = false;
  for (const auto& e : t.events(decode)) quarantined |= e.kind == "quarantine";
  CHECK_FALSE(quarantined);  // held by the checks, not by a quarantine
  bool back = false;
  for (int i = 0; i < 1000 && !back; ++i) {
    back = t.stats(decode).num_free_pages == all;
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  CHECK(back);
  // Once, not twice: a second lease gets the whole pool and no more.
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{2, prompt + 4, 60000, prompt})
      .receive([&](kv_lease_grant& x) { CHECK(x.lease_id != g.lease_id); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(t.stats(decode).num_free_pages == all - static_cast<uint32_t>(g.page_ids.size()));
}

#include <doctest/doctest.h>

#include <regex>

#include <malloc.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include <caf/event_based_actor.hpp>

#include "actors/prefill_rank_state.hpp"
#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/fault_executor.hpp"
#include "gpu/expert_parallel.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "tests/test_util.hpp"
#include "transport/fault_proxy.hpp"
#include "transport/loopback.hpp"

using namespace baton;

using test::chunk_tokens;
using test::colocated;
using test::encode;
using test::prompts;
using test::small_cluster;

/// Three prompts through prefill rank -> KV handoff -> decode rank, each compared with the same
/// prompt run colocated on one executor with the same chunk schedule and sampling.
static void check_disaggregated_equals_colocated(const std::string& transport, float temperature,
                                                 const gpu::model_config& model = gpu::builtin_tiny_config()) {
  CAPTURE(transport);
  CAPTURE(temperature);
  CAPTURE(model.name);
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.transport = transport == "ucx-am" ? "ucx" : transport;
  if (transport == "ucx-am") cfg.ucx_send = "am";  // rendezvous active messages instead of RMA puts
  cfg.model = model;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  std::vector<std::vector<int32_t>> outputs;
  for (const auto& p : prompts) {
    generate_request req;
    req.prompt = p;
    req.max_tokens = 12;
    req.temperature = temperature;
    req.seed = 7;
    req.return_logits = true;
    auto got = t.generate(cluster.router, req);
    REQUIRE_MESSAGE(got, t.sys.render(got.error()));
    auto ref = colocated(cfg, encode(cfg, p), 12, {temperature, 7});
    REQUIRE(ref.error.empty());
    CHECK(got->tokens == ref.tokens);
    REQUIRE(got->step_logits.size() == ref.step_logits.size());
    for (size_t i = 0; i < ref.step_logits.size(); ++i)
      CHECK_MESSAGE(test::same_bits(got->step_logits[i], ref.step_logits[i]), "step " << i << " of '" << p << "'");
    CHECK(got->prefill_rank == "prefill-0");
    CHECK(got->decode_rank == "decode-0");
    CHECK(got->tbt_us.size() + 1 == got->tokens.size());
    outputs.push_back(got->tokens);
  }
  // The prompts continue differently, so equality above is not a coincidence of a constant model.
  CHECK(outputs[0] != outputs[1]);
  CHECK(outputs[1] != outputs[2]);
  CHECK(outputs[0] != outputs[2]);
  // Every lease was returned.
  CHECK(t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages);
  CHECK(t.stats(cluster.prefill[0].handle).num_free_pages == cfg.executor.num_kv_pages);
}

TEST_CASE("disaggregated tokens and every step's logits equal the colocated run, bit for bit") {
  check_disaggregated_equals_colocated("loopback", 0.0f);
  check_disaggregated_equals_colocated("ucx", 0.0f);
  check_disaggregated_equals_colocated("ucx-am", 0.0f);
}

TEST_CASE("DeepSeek-V2 and V3 (MLA latent KV, MoE): disaggregated equals colocated, bit for bit, the handoff "
          "carrying the latent") {
  for (bool v3 : {false, true}) {
    check_disaggregated_equals_colocated("loopback", 0.0f, gpu::deepseek_tiny_config(v3));
    check_disaggregated_equals_colocated("ucx", 0.0f, gpu::deepseek_tiny_config(v3));
  }
}

TEST_CASE("sampled tokens are the same whether the first is drawn on the prefill rank and the rest on decode") {
  check_disaggregated_equals_colocated("loopback", 0.8f);
}

TEST_CASE("negative control: one flipped byte in one transferred layer changes the decode rank's logits") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.decode.verify_kv_checksums = false;  // let the damage through, to prove the handoff is used
  transport::fault_proxy* proxy = nullptr;
  auto wrap = [&](std::unique_ptr<transport::transport> inner, const std::string& name)
      -> std::shared_ptr<transport::transport> {
    if (name != "prefill-0") return std::shared_ptr<transport::transport>{std::move(inner)};
    auto p = transport::make_fault_proxy(std::move(inner), {transport::fault_kind::corrupt_byte, 2, {}, 1, 5});
    proxy = p.get();
    return std::shared_ptr<transport::transport>{std::move(p)};
  };
  auto cluster = start_local_cluster(t.sys, cfg, {}, wrap);
  test::cluster_system::stopper stop{t, cluster};
  generate_request req;
  req.prompt = prompts[1];
  req.max_tokens = 6;
  req.return_logits = true;
  auto got = t.generate(cluster.router, req);
  REQUIRE(got);
  REQUIRE(proxy != nullptr);
  CHECK(proxy->num_injected() == 1);
  auto ref = colocated(cfg, encode(cfg, prompts[1]), 6);
  // The first token comes from the prefill rank's own KV: unaffected.
  CHECK(test::same_bits(got->step_logits[0], ref.step_logits[0]));
  // Decode steps read the corrupted page: their logits differ.
  bool any_differs = false;
  for (size_t i = 1; i < std::min(got->step_logits.size(), ref.step_logits.size()); ++i)
    any_differs |= !test::same_bits(got->step_logits[i], ref.step_logits[i]);
  CHECK(any_differs);
}

TEST_CASE("lease ids differ between decode ranks and between a rank's incarnations, so a request's attempt on "
          "another rank never reuses an earlier attempt's (request, lease) pair; sims' are set, a range per rank") {
  // Prefill ranks tell a request's attempts apart by (request id, lease id): cancels and split
  // parts' notices of an attempt given up must not reach the next one. Every rank used to count
  // from 1, so a failover's lease on another rank (or on the same rank restarted) could equal it.
  const auto first_leases = [](uint64_t first_lease_id) {
    test::cluster_system t;
    auto cfg = small_cluster();
    cfg.num_decode_ranks = 2;
    cfg.decode.first_lease_id = first_lease_id;
    auto cluster = start_local_cluster(t.sys, cfg);
    test::cluster_system::stopper stop{t, cluster};
    caf::scoped_actor self{t.sys};
    std::vector<uint64_t> ids;
    for (const auto& r : cluster.decode)
      self->request(r.handle, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{77, 8, 60000, 4})
          .receive([&](kv_lease_grant& g) { ids.push_back(g.lease_id); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return ids;
  };
  const auto a = first_leases(0), b = first_leases(0);  // two clusters: every rank a new incarnation
  REQUIRE(a.size() == 2);
  REQUIRE(b.size() == 2);
  const std::set<uint64_t> all{a[0], a[1], b[0], b[1]};
  CHECK(all.size() == 4);
  for (auto id : all) CHECK((id >> 63) == 0);  // below prefill_only_tag's range
  CHECK(first_leases(1) == std::vector<uint64_t>{1, 1 + (uint64_t{1} << 40)});
}

TEST_CASE("a cluster is up once the router lists every rank (each registers with its balancer after it "
          "starts); a rank no balancer knows is named once the wait's budget is spent, or when it gives up") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.num_prefill_ranks = 2;
  cfg.num_decode_ranks = 2;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  auto names = cluster.rank_names();
  REQUIRE(names.size() == 4);
  CHECK(await_ranks_registered(t.sys, cluster.router, names, std::chrono::seconds{10}).empty());
  caf::scoped_actor self{t.sys};
  std::set<std::string> listed;
  self->request(cluster.router, std::chrono::seconds{10}, stats_atom::value)
      .receive(
          [&](cluster_stats& s) {
            for (const auto* loads : {&s.prefill, &s.decode})
              for (const auto& l : *loads) listed.insert(l.name);
          },
          [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(listed == std::set<std::string>(names.begin(), names.end()));
  names.push_back("decode-9");
  CHECK(await_ranks_registered(t.sys, cluster.router, names, std::chrono::milliseconds{100}) ==
        std::vector<std::string>{"decode-9"});
  int asked = 0;
  CHECK(await_ranks_registered(t.sys, cluster.router, {"decode-9"}, std::chrono::hours{1}, [&] { return ++asked == 3; }) ==
        std::vector<std::string>{"decode-9"});
  CHECK(asked == 3);
}

TEST_CASE("layer-wise handoff: a layer's send is posted once its KV is written, before the layer's compute finishes") {
  test::cluster_system t;
  auto cfg = small_cluster();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  generate_request req;
  req.prompt = prompts[2];  // 66 tokens: 5 chunks of 16
  req.max_tokens = 2;
  REQUIRE(t.generate(cluster.router, req));
  auto log = t.events(cluster.prefill[0].handle);
  const uint32_t layers = cfg.model.num_hidden_layers;
  std::map<std::tuple<std::string, uint32_t, uint32_t>, uint64_t> seq;  // (kind, chunk, layer) -> seq
  for (const auto& e : log) seq[{e.kind, e.chunk, e.layer}] = e.seq;
  const uint32_t chunks = (static_cast<uint32_t>(encode(cfg, prompts[2]).size()) + chunk_tokens - 1) / chunk_tokens;
  REQUIRE(chunks >= 3);
  // A layer's send is posted once its KV is written, before that same layer's attention and
  // MLP finish: the last layer's send hides under its own compute too.
  for (uint32_t c = 0; c < chunks; ++c)
    for (uint32_t l = 0; l < layers; ++l) {
      REQUIRE(seq.count({"kv_written", c, l}));
      REQUIRE(seq.count({"send_posted", c, l}));
      REQUIRE(seq.count({"compute_done", c, l}));
      CHECK(seq[{"kv_written", c, l}] < seq[{"send_posted", c, l}]);
      CHECK(seq[{"send_posted", c, l}] < seq[{"compute_done", c, l}]);
    }
}

TEST_CASE("bad input gets a clear error naming the problem, and the cluster keeps serving") {
  test::cluster_system t;
  auto cfg = small_cluster();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  uint64_t refused = 0;
  auto expect_bad = [&](generate_request req, const std::string& words) {
    auto got = t.generate(cluster.router, std::move(req));
    REQUIRE_FALSE(got);
    const auto text = t.sys.render(got.error());
    CHECK_MESSAGE(text.find("bad_request") != std::string::npos, text);
    CHECK_MESSAGE(text.find(words) != std::string::npos, text);
    CHECK_MESSAGE(text.find("stage admission") != std::string::npos, text);
    ++refused;
  };
  generate_request empty;
  expect_bad(empty, "prompt is empty");
  generate_request too_long;
  too_long.prompt = std::string(cfg.model.max_position_embeddings, 'x');
  expect_bad(too_long, "tokens leaves no room in the model's context of 2048 tokens");  // the prompt's fault
  generate_request over;  // fits, but not with what it asks for: max_tokens' fault
  over.prompt_tokens.assign(2000, 72);
  over.max_tokens = 100;
  expect_bad(over, "prompt of 2000 tokens plus max_tokens 100 exceeds the model's context of 2048 tokens");
  generate_request zero;
  zero.prompt = "hi";
  zero.max_tokens = -5;
  expect_bad(zero, "max_tokens must be >= 1 (or 0: as many as the context leaves), got -5");
  // 0: what the context leaves after the prompt (OpenAI's chat default), within the router's limit.
  zero.max_tokens = 0;
  std::vector<int32_t> tokens;
  CHECK(tokenize_and_validate(zero, cfg.model, 0, &tokens).empty());
  CHECK(zero.max_tokens == static_cast<int32_t>(cfg.model.max_position_embeddings - tokens.size()));
  zero.max_tokens = 0;
  CHECK(tokenize_and_validate(zero, cfg.model, 100, &tokens).empty());
  CHECK(zero.max_tokens == 100);
  zero.max_tokens = 0;  // the router's default cap (router_config::default_max_tokens)
  CHECK(tokenize_and_validate(zero, cfg.model, 0, &tokens, nullptr, 64).empty());
  CHECK(zero.max_tokens == 64);
  zero.max_tokens = 0;  // and the request's own cap (an API key's), the lower of the two
  zero.max_tokens_cap = 24;
  CHECK(tokenize_and_validate(zero, cfg.model, 0, &tokens, nullptr, 64).empty());
  CHECK(zero.max_tokens == 24);
  generate_request full;
  full.prompt_tokens.assign(cfg.model.max_position_embeddings, 72);
  full.max_tokens = 0;
  expect_bad(full, "prompt of 2048 tokens leaves no room in the model's context of 2048 tokens");
  generate_request huge;
  huge.prompt = "hi";
  huge.max_tokens = 1'000'000'000;
  expect_bad(huge, "max_tokens 1000000000 exceeds the limit of 2048");
  generate_request unknown;
  unknown.prompt_tokens = {256, 72, 9999, 1};
  expect_bad(unknown, "prompt token 9999 at position 2 is outside the vocabulary [0, 259)");
  unknown.prompt_tokens = {-1};
  expect_bad(unknown, "prompt token -1 at position 0");
  generate_request both;
  both.prompt = "a";
  both.prompt_tokens = {1};
  expect_bad(both, "give one of prompt, prompt_tokens or messages, not several");
  generate_request hot;
  hot.prompt = "a";
  hot.temperature = -1e6f;
  expect_bad(hot, "temperature must be a finite number >= 0, got -1000000");  // not %f's -1000000.000000
  generate_request sampling;
  sampling.prompt = "a";
  sampling.top_p = 0.0f;
  expect_bad(sampling, "top_p must be in (0, 1], got 0");
  sampling.top_p = 1.0f;
  sampling.repetition_penalty = -2.0f;
  expect_bad(sampling, "repetition_penalty must be > 0");
  generate_request stops;
  stops.prompt = "a";
  stops.stop = {"fine", std::string(2000, 'x')};
  expect_bad(stops, "stop string 1 is 2000 bytes; at most 1024");
  stops.stop = {"fine", ""};
  expect_bad(stops, "stop string 1 is empty");
  stops.stop = {};
  stops.stop_token_ids = {72, 300};
  expect_bad(stops, "stop_token_ids[1] is 300, outside the vocabulary [0, 259)");
  generate_request chat;
  chat.messages = {{"user", "hello"}};
  expect_bad(chat, "the built-in byte model has no chat template");

  generate_request good;
  good.prompt = "still serving?";
  good.max_tokens = 3;
  auto got = t.generate(cluster.router, good);
  REQUIRE(got);
  CHECK(got->tokens.size() >= 1);
  CHECK(t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages);
  // Each request's actor checks it (the router's one thread only counts it): the router still
  // counts every refusal, and admits the one good request.
  caf::scoped_actor self{t.sys};
  cluster_stats cs;
  for (int i = 0; i < 500; ++i) {  // a refusal is counted as its actor's end reaches the router
    self->request(cluster.router, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](cluster_stats& x) { cs = x; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    if (cs.num_rejected == refused) break;
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  CHECK(cs.num_rejected == refused);
  CHECK(cs.num_admitted == 1);
}

TEST_CASE("a failed transfer fails the request with request, rank and stage named and the next one succeeds") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.router.request.max_attempts = 1;  // how one attempt's failure surfaces (failover: below)
  auto wrap = [&](std::unique_ptr<transport::transport> inner, const std::string& name)
      -> std::shared_ptr<transport::transport> {
    if (name != "prefill-0") return std::shared_ptr<transport::transport>{std::move(inner)};
    return std::shared_ptr<transport::transport>{
        transport::make_fault_proxy(std::move(inner), {transport::fault_kind::fail, 1, {}, 1, 5})};
  };
  auto cluster = start_local_cluster(t.sys, cfg, {}, wrap);
  test::cluster_system::stopper stop{t, cluster};
  generate_request req;
  req.prompt = "this one loses layer 1";
  req.max_tokens = 4;
  auto got = t.generate(cluster.router, req);
  REQUIRE_FALSE(got);
  const auto text = t.sys.render(got.error());
  CHECK_MESSAGE(text.find("transfer_failed") != std::string::npos, text);
  CHECK_MESSAGE(text.find("request 1, rank prefill-0, stage kv_send") != std::string::npos, text);
  CHECK_MESSAGE(text.find("layer 1") != std::string::npos, text);
  req.prompt = "this one is fine";
  got = t.generate(cluster.router, req);
  CHECK(got);
  // The failed request's lease went back to the decode rank.
  CHECK(t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages);
}

namespace {

/// A cluster whose prefill-0 transport goes through a fault proxy with `plan`.
struct faulty_cluster {
  test::cluster_system t;
  local_cluster_config cfg = small_cluster();
  local_cluster cluster;
  std::unique_ptr<test::cluster_system::stopper> stop;
  explicit faulty_cluster(transport::fault_plan plan, uint32_t lease_ms = 2000, uint32_t max_attempts = 1) {
    cfg.router.request.max_attempts = max_attempts;  // 1: how one attempt's failure surfaces
    cfg.router.request.lease_ms = lease_ms;
    cfg.prefill.kv_send_timeout_ms = lease_ms;
    // A put abandoned at the send timeout may still land: its lease's pages wait this long.
    cfg.decode.kv_quarantine_ms = 1500;
    cluster = start_local_cluster(t.sys, cfg, {}, [plan](std::unique_ptr<transport::transport> inner,
                                                         const std::string& name) -> std::shared_ptr<transport::transport> {
      if (name != "prefill-0") return std::shared_ptr<transport::transport>{std::move(inner)};
      return std::shared_ptr<transport::transport>{transport::make_fault_proxy(std::move(inner), plan)};
    });
    stop.reset(new test::cluster_system::stopper{t, cluster});  // in place: a temporary would stop it now
  }
  std::string fail_one() {
    generate_request req;
    req.prompt = prompts[1];
    req.max_tokens = 6;
    auto got = t.generate(cluster.router, req);
    return got ? std::string{"no error"} : t.sys.render(got.error());
  }
  /// Waits (bounded) until the decode rank's pages are all free again.
  bool decode_pages_back() {
    for (int i = 0; i < 500; ++i) {
      if (t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
    return false;
  }
  bool decoded_any() {
    for (const auto& e : t.events(cluster.decode[0].handle))
      if (e.kind == "step") return true;
    return false;
  }
};

}  // namespace

TEST_CASE("a corrupted layer is caught by its checksum and never reaches decoding") {
  faulty_cluster f{{transport::fault_kind::corrupt_byte, 2, {}, 1, 5}};
  const auto text = f.fail_one();
  CHECK_MESSAGE(text.find("transfer_failed") != std::string::npos, text);
  CHECK_MESSAGE(text.find("rank decode-0, stage kv_recv: layer 2 from prefill-0 failed its checksum") != std::string::npos,
                text);
  CHECK_FALSE(f.decoded_any());
  CHECK(f.decode_pages_back());
}

TEST_CASE("a dropped layer (reported sent, never landed) is caught by its checksum") {
  faulty_cluster f{{transport::fault_kind::drop, 1, {}, 1, 5}};
  const auto text = f.fail_one();
  CHECK_MESSAGE(text.find("layer 1 from prefill-0 failed its checksum") != std::string::npos, text);
  CHECK_FALSE(f.decoded_any());
  CHECK(f.decode_pages_back());
}

TEST_CASE("a stalled layer expires the lease, frees the decode rank's pages and fails the request clearly") {
  faulty_cluster f{{transport::fault_kind::stall, 3, {}, 1, 5}, /*lease_ms*/ 300};
  const auto text = f.fail_one();
  CHECK_MESSAGE(text.find("request 1, rank prefill-0, stage kv_send: put of layer 3 still pending after 300 ms (to "
                          "decode rank decode-0)") != std::string::npos,
                text);
  // The abandoned put cannot be recalled and may still land: the pages are held, not reused,
  // until the quarantine runs out (1.5 s here); no notice ends it early.
  CHECK(f.t.stats(f.cluster.decode[0].handle).num_free_pages < f.cfg.executor.num_kv_pages);
  CHECK(f.decode_pages_back());
  bool expired = false;
  for (const auto& e : f.t.events(f.cluster.decode[0].handle)) expired |= e.kind == "quarantine_expired";
  CHECK(expired);
  CHECK_FALSE(f.decoded_any());
  // The cluster keeps serving.
  generate_request req;
  req.prompt = "after the stall";
  req.max_tokens = 3;
  CHECK(f.t.generate(f.cluster.router, req));
}

namespace {

/// As a request whose prefill succeeded: a lease on `decode` for `total` tokens with every layer
/// of its `prompt` announced landed (not written: the cluster's verify_kv_checksums is off), and
/// a decode order for it, its first token 7, streaming to `to`.
decode_order landed_order(test::cluster_system& t, caf::scoped_actor& self, const decode_rank_actor& decode,
                          uint32_t layers, uint64_t rid, uint32_t prompt, uint32_t total, request_actor to) {
  kv_lease_grant g;
  self->request(decode, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{rid, total, 60000, prompt})
      .receive([&](kv_lease_grant& x) { g = std::move(x); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  for (uint32_t l = 0; l < layers; ++l) self->send(decode, kv_layer_ready{rid, g.lease_id, l, prompt, 1, "prefill-0"});
  decode_order o;
  o.request_id = rid;
  o.lease_id = g.lease_id;
  o.first_token = 7;
  o.prompt_len = prompt;
  o.max_new_tokens = total - prompt;
  o.ignore_eos = true;
  o.stream_to = std::move(to);
  return o;
}

}  // namespace

TEST_CASE("a sequence whose prefill writer gave up a put (it may still land) has its pages quarantined when it "
          "finishes, even before the writer's own notice arrives; one whose last page is partly filled is not decoded") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.decode.verify_kv_checksums = false;  // the layers below are announced, not written
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  auto listener = caf::actor_cast<request_actor>(
      t.sys.spawn([](caf::event_based_actor*) -> caf::behavior { return {[](token_event&) {}}; }));
  // As a request whose prefill succeeded: every layer landed, then the decode order. `abandoned`
  // is what prefill_result::abandoned_put told the request. `refused`: the order's error, if any.
  const auto decode_one = [&](uint64_t rid, bool abandoned, uint32_t prompt, std::string* refused = nullptr) {
    auto o = landed_order(t, self, decode, cfg.model.num_hidden_layers, rid, prompt, prompt + 4, listener);
    o.max_new_tokens = 2;
    o.writer_abandoned = abandoned;
    self->request(decode, std::chrono::seconds{30}, o)
        .receive([&](decode_summary& d) { CHECK(d.finish_reason == "length"); },
                 [&](caf::error& e) {
                   if (!refused) FAIL(t.sys.render(e));
                   else *refused = t.sys.render(e);
                 });
    bool quarantined = false;
    for (const auto& e : t.events(decode)) quarantined |= e.kind == "quarantine" && e.request_id == rid;
    return quarantined;
  };
  CHECK_FALSE(decode_one(1, false, 20));  // its writers are done: the pages go back at once
  CHECK(decode_one(2, true, 32));          // a late put could land in them: they wait (kv_quarantine_ms)
  // A prompt ending mid-page (16-token pages): an f32 put ships that page whole, and a late one
  // would land over the rows decoding writes. Refused (retryable: placed again), pages kept.
  std::string refused;
  CHECK(decode_one(3, true, 20, &refused));
  CHECK(refused.find("transfer_failed") != std::string::npos);
  CHECK(refused.find("request 3, rank decode-0, stage decode: a put of this prompt's KV was abandoned") != std::string::npos);
  CHECK(t.stats(decode).num_free_pages < cfg.executor.num_kv_pages);
  caf::anon_send_exit(listener, caf::exit_reason::user_shutdown);
}

TEST_CASE("a running sequence whose tokens' receiver failed ends at once ('released'), its pages back, instead of "
          "running on to max_tokens") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.decode.verify_kv_checksums = false;  // the layers below are announced, not written
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto decode = cluster.decode[0].handle;
  caf::scoped_actor self{t.sys};
  // The receiver fails at its first token, as a request actor whose node or link went: its end
  // is not a normal one, so no release ever comes from it.
  auto receiver = caf::actor_cast<request_actor>(t.sys.spawn([](caf::event_based_actor* me) -> caf::behavior {
    return {[me](token_event&) { me->quit(caf::exit_reason::user_shutdown); }};
  }));
  const uint32_t prompt = 20, max_new = 900;  // 58 of the 64 pages
  auto o = landed_order(t, self, decode, cfg.model.num_hidden_layers, 1, prompt, prompt + max_new, receiver);
  self->request(decode, std::chrono::seconds{60}, o)
      .receive(
          [&](decode_summary& d) {
            CHECK(d.finish_reason == "released");
            CHECK(d.num_tokens < max_new);
          },
          [&](caf::error& e) { FAIL(t.sys.render(e)); });
  bool noticed = false;
  for (const auto& e : t.events(decode)) noticed |= e.kind == "stream_gone" && e.request_id == 1;
  CHECK(noticed);
  for (int i = 0; i < 1000 && t.stats(decode).num_free_pages != cfg.executor.num_kv_pages; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(t.stats(decode).num_free_pages == cfg.executor.num_kv_pages);
}

TEST_CASE("a lease whose holder ended without learning of it goes back at once; one whose holder failed waits out "
          "its lease") {
  test::cluster_system t;
  auto cfg = small_cluster();
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto decode = cluster.decode[0].handle;
  const uint32_t all = cfg.executor.num_kv_pages;
  // A holder that asks and ends at once, normally: as a request actor whose client hung up
  // while its reservation waited. Its lease is for a minute: only the fix can give it back soon.
  auto ask_and_end = [&](uint64_t id) {
    return t.sys.spawn([=](caf::event_based_actor* self) {
      self->request(decode, caf::infinite, reserve_atom::value, kv_lease_reserve{id, 64, 60000, 32})
          .then([](kv_lease_grant&) {}, [](caf::error&) {});
      self->quit();
    });
  };
  ask_and_end(1);
  auto orphaned = [&] {
    const auto ev = t.events(decode);
    return std::count_if(ev.begin(), ev.end(), [](auto& e) { return e.kind == "lease_orphaned"; });
  };
  for (int i = 0; i < 5000 && orphaned() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(orphaned() == 1);
  CHECK(t.stats(decode).num_free_pages == all);
  // The control: a holder that failed (it may have told a writer) leaves its lease to run out.
  auto failing = t.sys.spawn([=](caf::event_based_actor* self) {
    self->request(decode, caf::infinite, reserve_atom::value, kv_lease_reserve{2, 64, 60000, 32})
        .then([self](kv_lease_grant&) { self->quit(caf::exit_reason::user_shutdown); }, [](caf::error&) {});
  });
  caf::scoped_actor self{t.sys};
  self->wait_for(failing);
  CHECK(t.stats(decode).num_free_pages < all);
}

TEST_CASE("failover: a corrupted, a dropped or a stalled layer re-places the request, which completes with the "
          "colocated tokens") {
  for (auto kind : {transport::fault_kind::corrupt_byte, transport::fault_kind::drop, transport::fault_kind::stall}) {
    CAPTURE(static_cast<int>(kind));
    // A lease of 1 s: the stall is found at its end, and the clean retry's lease does not run out
    // on a stalled machine (which would make a second failover).
    faulty_cluster f{{kind, 1, {}, 1, 5}, /*lease_ms*/ 1000, /*max_attempts*/ 3};
    generate_request req;
    req.prompt = prompts[1];
    req.max_tokens = 6;
    auto got = f.t.generate(f.cluster.router, req);
    REQUIRE_MESSAGE(got, f.t.sys.render(got.error()));
    CHECK(got->tokens == colocated(f.cfg, encode(f.cfg, prompts[1]), 6).tokens);
    CHECK(got->failovers == 1);
    CHECK(got->retry_wait_us >= 50000);  // it paused before the retry (request_config::retry_backoff_ms)
    CHECK(got->failed_attempts_us > 0);    // and the failed attempt's time is said apart from it
    CHECK_MESSAGE(got->failover_why.find("layer 1") != std::string::npos, got->failover_why);
    CHECK(f.decode_pages_back());
  }
}

TEST_CASE("failover of a sampled request: the retry draws the same tokens (a draw depends only on the seed and the "
          "token's position)") {
  faulty_cluster f{{transport::fault_kind::corrupt_byte, 1, {}, 1, 5}, /*lease_ms*/ 1000, /*max_attempts*/ 3};
  generate_request req;
  req.prompt = prompts[2];
  req.max_tokens = 12;
  req.temperature = 0.9f;
  req.top_p = 0.95f;
  req.seed = 77;
  auto got = f.t.generate(f.cluster.router, req);
  REQUIRE_MESSAGE(got, f.t.sys.render(got.error()));
  CHECK(got->failovers == 1);
  gpu::sampling_config sc;
  sc.temperature = 0.9f;
  sc.top_p = 0.95f;
  sc.seed = 77;
  const auto want = colocated(f.cfg, encode(f.cfg, prompts[2]), 12, sc).tokens;
  CHECK(got->tokens == want);
  CHECK(want != colocated(f.cfg, encode(f.cfg, prompts[2]), 12).tokens);  // it did sample
}

/// Asks for 4 tokens after prompts[1], which must fail: the error, rendered.
template <class Router>
std::string failure_of(test::cluster_system& t, const Router& router) {
  generate_request req;
  req.prompt = prompts[1];
  req.max_tokens = 4;
  auto got = t.generate(router, req);
  REQUIRE_FALSE(got);
  return t.sys.render(got.error());
}

/// Executors for a local cluster: CPU ones on the seeded weights, prefill-0's wrapped by `wrap`
/// (a fault executor).
template <class Wrap>
auto prefill0_wrapped(const local_cluster_config& cfg, Wrap wrap) {
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  return [cfg, weights, wrap](const std::string& name) -> std::shared_ptr<gpu::executor> {
    std::shared_ptr<gpu::executor> x = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    return name == "prefill-0" ? wrap(std::move(x)) : x;
  };
}

TEST_CASE("a prefill that fails after posting a layer's put is answered only once that put has settled, so the "
          "decode rank never frees pages a put may still write") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.router.request.max_attempts = 1;
  // The delayed put must settle, not be given up: 2000 polls can outlast the default 2 s on a
  // stalled machine, and an abandoned put logs no send_done.
  cfg.prefill.kv_send_timeout_ms = 60000;
  const uint32_t layer = 1;
  auto make_exec = prefill0_wrapped(cfg, [layer](std::shared_ptr<gpu::executor> x) {
    return gpu::make_fault_failing_prefill_executor(std::move(x), layer);
  });
  // Layer 1's put lands, but stays pending for 2000 polls: long after the job has failed.
  const transport::fault_plan plan{transport::fault_kind::delay, layer, {}, 1, 5, 2000};
  auto cluster = start_local_cluster(t.sys, cfg, make_exec,
                                     test::fault_proxy_on("prefill-0", plan));
  test::cluster_system::stopper stop{t, cluster};
  CHECK(failure_of(t, cluster.router).find("failed in layer 1") != std::string::npos);
  // When the client heard of the failure, every put the prefill rank had posted had settled. A
  // later chunk may have started before the first one's failure was seen (chunks pipeline), so
  // the count of puts is not fixed: each chunk posts layers 0..1 only, never a later one.
  uint32_t posted = 0, settled = 0, past_layer = 0;
  for (const auto& e : t.events(cluster.prefill[0].handle)) {
    posted += e.kind == "send_posted";
    settled += e.kind == "send_done";
    past_layer += e.kind == "send_posted" && e.layer > layer;
  }
  CHECK(posted >= layer + 1);
  CHECK(past_layer == 0);
  CHECK(settled == posted);
}

TEST_CASE("a prefill whose last chunk brings no token is answered with an error that says so, not left waiting") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.router.request.max_attempts = 1;
  auto make_exec = prefill0_wrapped(cfg, [](std::shared_ptr<gpu::executor> x) {
    return gpu::make_fault_tokenless_prefill_executor(std::move(x));
  });
  auto cluster = start_local_cluster(t.sys, cfg, make_exec);
  test::cluster_system::stopper stop{t, cluster};
  const auto what = failure_of(t, cluster.router);
  CHECK_MESSAGE(what.find("the last chunk returned no token") != std::string::npos, what);
  CHECK_MESSAGE(what.find("prefill-0") != std::string::npos, what);
}

TEST_CASE("a delayed layer only delays: tokens still equal the colocated run") {
  faulty_cluster f{{transport::fault_kind::delay, 0, {}, 4, 5, 200}};
  generate_request req;
  req.prompt = prompts[1];
  req.max_tokens = 6;
  auto got = f.t.generate(f.cluster.router, req);
  REQUIRE(got);
  CHECK(got->tokens == colocated(f.cfg, encode(f.cfg, prompts[1]), 6).tokens);
}

TEST_CASE("extra end-of-sequence tokens (generation_config.json's list) end generation as eos, unless ignore_eos") {
  auto cfg = small_cluster();
  const std::string prompt = "where does it end";
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  const auto ref = gpu::generate_colocated(*exec, encode(cfg, prompt), 10, chunk_tokens, {}, true);
  REQUIRE(ref.tokens.size() == 10);
  cfg.router.extra_eos_token_ids = {ref.tokens[4]};
  test::cluster_system t;
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  generate_request req;
  req.prompt = prompt;
  req.max_tokens = 10;
  auto got = t.generate(cluster.router, req);
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK(got->finish_reason == "eos");
  const auto first = std::find(ref.tokens.begin(), ref.tokens.end(), ref.tokens[4]) - ref.tokens.begin();
  CHECK(got->tokens == std::vector<int32_t>(ref.tokens.begin(), ref.tokens.begin() + first + 1));
  req.ignore_eos = true;
  got = t.generate(cluster.router, req);
  REQUIRE(got);
  CHECK(got->tokens == ref.tokens);
}

namespace {

/// Executors for start_local_cluster: ranks `a` and `b` are the two members of one data-parallel
/// group over loopback ("<rank>-dp", in *members), every other rank stands alone; all share the
/// seeded weights of `cfg`.
executor_factory grouped_executors(const local_cluster_config& cfg, const std::string& a, const std::string& b,
                                   std::vector<std::shared_ptr<gpu::expert_peers>>* members) {
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto fabric = transport::make_loopback_fabric();
  std::string why;
  *members = gpu::make_peer_group(
      {a + "-dp", b + "-dp"}, cfg.model, {gpu::expert_slot_bytes(cfg.model, 512)},
      [&](const std::string& name, std::string*) { return transport::make_loopback_transport(fabric, name); }, &why);
  REQUIRE_MESSAGE(members->size() == 2, why);
  return [cfg, weights, fabric, a, b, m = *members](const std::string& rank) -> std::shared_ptr<gpu::executor> {
    auto ec = cfg.executor;
    if (rank == a) ec.peers = m[0];
    if (rank == b) ec.peers = m[1];
    return gpu::make_cpu_executor(cfg.model, weights, ec);
  };
}

/// `prompt` through the cluster, 8 greedy tokens, checked against its colocated run.
completion ask_as_colocated(test::cluster_system& t, const local_cluster& cluster, const local_cluster_config& cfg,
                            const std::string& prompt) {
  generate_request req;
  req.prompt = prompt;
  req.max_tokens = 8;
  auto got = t.generate(cluster.router, req);
  REQUIRE_MESSAGE(got, t.sys.render(got.error()));
  CHECK(got->tokens == colocated(cfg, encode(cfg, prompt), 8).tokens);
  return *got;
}

}  // namespace

TEST_CASE("data-parallel decode ranks in a cluster answer as colocated; once their group breaks they report no room "
          "on their own, refuse new work naming why, and requests go to the rank outside the group") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.model = gpu::deepseek_tiny_config(true);
  cfg.num_decode_ranks = 3;  // decode-0 and decode-1 form a group, decode-2 stands alone
  std::vector<std::shared_ptr<gpu::expert_peers>> members;
  auto cluster = start_local_cluster(t.sys, cfg, grouped_executors(cfg, "decode-0", "decode-1", &members));
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(t.wait_registered(cluster));
  auto ask = [&](const std::string& p) { return ask_as_colocated(t, cluster, cfg, p); };
  int in_group = 0;
  for (const auto& p : prompts) in_group += ask(p).decode_rank != "decode-2";
  CHECK(in_group > 0);  // the balancer placed work on the group's ranks
  CHECK(members[0]->failure().empty());

  members[0]->fault_break_for_test("injected by the test");
  CHECK(members[0]->failure() == "data-parallel group, member decode-0-dp: injected by the test");
  CHECK(members[1]->failure() == "data-parallel group of decode-1-dp: member decode-0-dp is out of step");
  caf::scoped_actor self{t.sys};
  // Both ranks step aside on their own, before any request tries them: the balancer hears that
  // they have no room (bounded wait).
  bool aside = false;
  for (int i = 0; i < 500 && !aside; ++i) {
    self->request(cluster.decode_balancer, std::chrono::seconds{5}, stats_atom::value)
        .receive(
            [&](std::vector<rank_load>& loads) {
              int none_free = 0;
              for (const auto& l : loads) none_free += (l.name == "decode-0" || l.name == "decode-1") && l.num_free_pages == 0;
              aside = none_free == 2;
            },
            [](caf::error&) {});
    if (!aside) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  CHECK(aside);
  std::string refusal;
  self->request(cluster.decode[1].handle, std::chrono::seconds{10}, reserve_atom::value, kv_lease_reserve{99, 32, 1000, 16})
      .receive([](kv_lease_grant&) {}, [&](caf::error& e) { refusal = t.sys.render(e); });
  CHECK(refusal.find("rank_unavailable") != std::string::npos);
  CHECK(refusal.find("request 99, rank decode-1, stage kv_reserve: data-parallel group of decode-1-dp: member "
                     "decode-0-dp is out of step") != std::string::npos);
  for (int round = 0; round < 2; ++round)
    for (const auto& p : prompts) CHECK(ask(p).decode_rank == "decode-2");
}

TEST_CASE("prefill ranks whose expert group broke step aside on their own: the balancer hears why and places "
          "nothing there, orders sent anyway are refused naming why, and prompts go to the rank outside the group") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.model = gpu::deepseek_tiny_config(true);
  cfg.num_prefill_ranks = 3;  // prefill-0 and prefill-1 form a group, prefill-2 stands alone
  std::vector<std::shared_ptr<gpu::expert_peers>> members;
  auto cluster = start_local_cluster(t.sys, cfg, grouped_executors(cfg, "prefill-0", "prefill-1", &members));
  test::cluster_system::stopper stop{t, cluster};
  REQUIRE(t.wait_registered(cluster));
  auto ask = [&](const std::string& p) { return ask_as_colocated(t, cluster, cfg, p); };
  int in_group = 0;
  for (int round = 0; round < 2; ++round)
    for (const auto& p : prompts) in_group += ask(p).prefill_rank != "prefill-2";
  CHECK(in_group > 0);  // the balancer placed prompts on the group's ranks, which answered as colocated

  members[1]->fault_break_for_test("injected by the test");
  const std::string broken = "data-parallel group of prefill-0-dp: member prefill-1-dp is out of step";
  CHECK(members[0]->failure() == broken);
  caf::scoped_actor self{t.sys};
  // Both ranks step aside before any prompt tries them: their reports name why (bounded wait).
  std::map<std::string, std::string> aside;
  for (int i = 0; i < 500 && aside.size() < 2; ++i) {
    self->request(cluster.prefill_balancer, std::chrono::seconds{5}, stats_atom::value)
        .receive(
            [&](std::vector<rank_load>& loads) {
              for (const auto& l : loads)
                if (!l.unavailable.empty()) aside[l.name] = l.unavailable;
            },
            [](caf::error&) {});
    if (aside.size() < 2) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  REQUIRE(aside.size() == 2);
  CHECK(aside["prefill-0"] == broken);
  CHECK(aside["prefill-1"] == "data-parallel group, member prefill-1-dp: injected by the test");
  bool logged = false;
  self->request(cluster.prefill_balancer, std::chrono::seconds{5}, events_atom::value)
      .receive(
          [&](std::vector<placement_record>& log) {
            for (const auto& r : log) logged |= r.rank == "prefill-0" && r.why == "steps aside: " + broken;
          },
          [](caf::error&) {});
  CHECK(logged);
  // An order placed before the balancer heard is refused, retryably, naming the rank and why.
  std::string refusal;
  prefill_order order;
  order.request_id = 99;
  order.tokens = {1, 2, 3};
  self->request(cluster.prefill[0].handle, std::chrono::seconds{10}, order)
      .receive([](prefill_result&) {}, [&](caf::error& e) { refusal = t.sys.render(e); });
  CHECK(refusal.find("rank_unavailable") != std::string::npos);
  CHECK_MESSAGE(refusal.find("request 99, rank prefill-0, stage prefill: " + broken) != std::string::npos, refusal);
  for (int round = 0; round < 2; ++round)
    for (const auto& p : prompts) CHECK(ask(p).prefill_rank == "prefill-2");
}

TEST_CASE("a request whose every attempt fails says which attempt its error is, of how many, how long after it "
          "arrived, and what made it fail over: the sentence of the last alone bounds only that attempt") {
  faulty_cluster f{{transport::fault_kind::drop, 1, {}, 100, 5}, /*lease_ms*/ 1000, /*max_attempts*/ 2};
  const auto why = failure_of(f.t, f.cluster.router);
  CHECK_MESSAGE(why.find("layer 1") != std::string::npos, why);
  CHECK_MESSAGE(std::regex_search(why, std::regex{R"(\(attempt 2 of 2, [0-9]+ ms after the request arrived; it failed )"
                                                  R"(over 1 time\(s\), first after: request [0-9]+, .*layer 1.*\)$)"}),
                why);
  // The router counted the failover as it started, though the request failed in the end
  // (/metrics' baton_failovers_total summed finished requests' and missed it).
  caf::scoped_actor self{f.t.sys};
  uint64_t failovers = 0;
  self->request(f.cluster.router, std::chrono::seconds{5}, stats_atom::value)
      .receive([&](cluster_stats& s) { failovers = s.num_failovers; }, [](caf::error&) {});
  CHECK(failovers == 1);
}

TEST_CASE("finished requests leave no memory behind: a monitor a request left on a rank it watched kept the request "
          "actor's storage for as long as the rank ran") {
  test::cluster_system t;
  auto cfg = small_cluster();
  cfg.router.request.token_timeout_ms = 2000;  // the watchdog's one message is gone 2 s after the request
  cfg.prefill.event_log_events = cfg.decode.event_log_events = 256;  // full after the warm-up: no growth after
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  const auto heap = [] { return static_cast<int64_t>(mallinfo2().uordblks); };
  const auto requests = [&](int n) {
    for (int i = 0; i < n; ++i) {
      generate_request req;
      req.prompt = "a memory check";
      req.max_tokens = 8;
      req.ignore_eos = true;
      REQUIRE(t.generate(cluster.router, req));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{2500});
  };
  requests(100);  // warm: pools, caches, the ranks' event logs filling their first blocks
  const auto before = heap();
  requests(600);
  const auto grown = heap() - before;
  CHECK_MESSAGE(grown < 600'000, "the heap grew by " << grown << " bytes");
}

// Issue 15: a draining decode rank hands its running sequences, KV and all, to another decode
// rank; they continue there from the moved KV (no recompute) with the tokens they would have had.

#include <doctest/doctest.h>

#include <filesystem>
#include <optional>
#include <utility>
#include <thread>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "transport/fault_proxy.hpp"

#include <unistd.h>

using namespace baton;

namespace {

/// One prefill rank and two decode ranks with room for long sequences.
local_cluster_config two_decode_ranks() {
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 2;
  cfg.executor.num_kv_pages = 512;
  return cfg;
}

using pending_answer = decltype(std::declval<caf::scoped_actor&>()->request(
    std::declval<router_actor>(), std::chrono::seconds{1}, generate_atom::value, generate_request{}));

/// `n` greedy requests of `max_tokens` tokens each (eos ignored), prompts `name i` (every other
/// one longer); their prompts go to `prompts` when given.
std::vector<pending_answer> send_long(caf::scoped_actor& self, const router_actor& router, int n, int32_t max_tokens,
                                      const std::string& name, std::vector<std::string>* prompts = nullptr) {
  std::vector<pending_answer> handles;
  for (int i = 0; i < n; ++i) {
    generate_request req;
    req.prompt = name + " " + std::to_string(i) + (i % 2 ? " with more words in it" : "");
    req.max_tokens = max_tokens;
    req.ignore_eos = true;
    if (prompts) prompts->push_back(req.prompt);
    handles.push_back(self->request(router, std::chrono::seconds{120}, generate_atom::value, std::move(req)));
  }
  return handles;
}

/// The first of decode ranks `among` seen running a sequence; nullopt when none does within
/// ~10 s (bounded: a loaded CI machine prefills slowly).
std::optional<size_t> first_running(test::cluster_system& t, const local_cluster& cluster, std::vector<size_t> among) {
  for (int i = 0; i < 10000; ++i) {
    for (size_t k : among)
      if (t.stats(cluster.decode[k].handle).num_running > 0) return k;
    std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  return std::nullopt;
}

/// Every answer, in order; one that failed fails the test, naming it.
std::vector<completion> answers(test::cluster_system& t, std::vector<pending_answer>& handles) {
  std::vector<completion> done(handles.size());
  for (size_t i = 0; i < handles.size(); ++i)
    handles[i].receive([&](completion& c) { done[i] = std::move(c); },
                       [&](caf::error& e) { FAIL("request " << i << ": " << t.sys.render(e)); });
  return done;
}

}  // namespace

TEST_CASE("a drained decode rank moves its running sequences with their KV; they finish elsewhere with the same "
          "tokens, no recompute") {
  test::cluster_system t;
  auto cfg = two_decode_ranks();
  REQUIRE(cfg.validate().empty());
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  // Both decode ranks known to the balancer first: else the requests may all go to the one
  // that registered first, and the rank a test drains has nothing to move.
  REQUIRE(t.wait_registered(cluster));
  caf::scoped_actor self{t.sys};
  const auto& leaving = cluster.decode[1].handle;

  constexpr int n = 6, max_tokens = 400;
  std::vector<std::string> prompts;
  auto handles = send_long(self, cluster.router, n, max_tokens, "moving sequence number", &prompts);
  // Once the leaving rank decodes some of them, drain it and move them.
  REQUIRE(first_running(t, cluster, {1}));
  self->send(cluster.decode_balancer, drain_atom::value, leaving);
  self->send(leaving, migrate_atom::value);

  const auto done = answers(t, handles);
  const auto st = t.stats(leaving);
  CHECK(st.migrated_out > 0);
  CHECK(st.migrate_failed == 0);
  CHECK(st.num_running == 0);
  uint32_t moved = 0;
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  const gpu::byte_tokenizer tok{cfg.model.bos_token_id, cfg.model.eos_token_id};
  for (int i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(done[i].failovers == 0);  // nothing was recomputed
    CHECK(done[i].tokens.size() == max_tokens);
    moved += done[i].migrations;
    if (done[i].migrations) CHECK(done[i].decode_rank == cluster.decode[0].name);
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    auto ref = gpu::generate_colocated(*exec, tok.encode(prompts[i]), max_tokens, 64, {}, true);
    CHECK(done[i].tokens == ref.tokens);
  }
  CHECK(moved == st.migrated_out);
  MESSAGE(moved << " of " << n << " sequences moved, KV and all");
  // /metrics reads the count from the rank's load reports (at the router, through its balancer).
  uint64_t reported = 0;
  for (int i = 0; i < 200 && reported != st.migrated_out; ++i) {
    self->request(cluster.router, std::chrono::seconds{10}, stats_atom::value)
        .receive(
            [&](cluster_stats& c) {
              for (const auto& l : c.decode)
                if (l.name == cluster.decode[1].name) reported = l.migrated_out;
            },
            [&](caf::error&) {});
    if (reported != st.migrated_out) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  CHECK(reported == st.migrated_out);
}

namespace {

/// What a test of a move that fails sees: the leaving rank's stats once every answer came, and
/// whether both ranks' pages came back and the leaving rank could then change role.
struct failed_move {
  rank_stats leaving;
  bool pages_back = false;
  bool idle = false;
};

/// Four greedy requests on two decode ranks; once decode-1 runs some, it is drained and moves
/// them, every put of its transport faulted by `fault`. Every move must fail: the sequences
/// finish where they were with the tokens they would have had, nothing recomputed.
failed_move run_failed_moves(local_cluster_config cfg, transport::fault_plan fault, const std::string& name) {
  test::cluster_system t;
  cfg.decode.kv_quarantine_ms = 500;  // the target holds pages a faulted put might still reach
  REQUIRE(cfg.validate().empty());
  auto wrap = [fault](std::unique_ptr<transport::transport> inner, const std::string& rank) -> std::shared_ptr<transport::transport> {
    if (rank != "decode-1") return std::shared_ptr<transport::transport>{std::move(inner)};
    return std::shared_ptr<transport::transport>{transport::make_fault_proxy(std::move(inner), fault)};
  };
  auto cluster = start_local_cluster(t.sys, cfg, {}, wrap);
  test::cluster_system::stopper stop{t, cluster};
  // Both decode ranks known to the balancer first: else the requests may all go to the one
  // that registered first, and the rank a test drains has nothing to move.
  REQUIRE(t.wait_registered(cluster));
  caf::scoped_actor self{t.sys};
  const auto& leaving = cluster.decode[1].handle;
  const auto& target = cluster.decode[0].handle;
  constexpr int n = 4, max_tokens = 200;
  std::vector<std::string> prompts;
  auto handles = send_long(self, cluster.router, n, max_tokens, name, &prompts);
  REQUIRE(first_running(t, cluster, {1}));
  self->send(cluster.decode_balancer, drain_atom::value, leaving);
  self->send(leaving, migrate_atom::value);
  const auto done = answers(t, handles);
  failed_move out{t.stats(leaving)};
  CHECK(out.leaving.migrate_failed > 0);
  CHECK(out.leaving.migrated_out == 0);
  CHECK(out.leaving.num_running == 0);
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  const gpu::byte_tokenizer tok{cfg.model.bos_token_id, cfg.model.eos_token_id};
  for (int i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(done[i].failovers == 0);
    CHECK(done[i].migrations == 0);
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    CHECK(done[i].tokens == gpu::generate_colocated(*exec, tok.encode(prompts[i]), max_tokens, 64, {}, true).tokens);
  }
  // Both ranks' pages come back (the target's after its quarantine, at the latest).
  for (int i = 0; i < 500 && !out.pages_back; ++i) {
    out.pages_back = t.stats(target).num_free_pages == cfg.executor.num_kv_pages &&
                     t.stats(leaving).num_free_pages == cfg.executor.num_kv_pages;
    if (!out.pages_back) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  self->request(leaving, std::chrono::seconds{5}, role_atom::value, false)
      .receive([&](bool ok) { out.idle = ok; }, [](caf::error&) {});
  return out;
}

}  // namespace

TEST_CASE("a move whose KV puts never land (a stalled link) is given up after migrate_send_timeout_ms: the "
          "sequences finish where they were, the target's pages come back, the rank is not left busy") {
  auto cfg = two_decode_ranks();
  cfg.decode.migrate_send_timeout_ms = 300;
  // Every put of the leaving rank from now on stalls: pending for ever.
  const auto got = run_failed_moves(cfg, {transport::fault_kind::stall, {}, {}, 1000000, 1}, "stalled move");
  CHECK(got.leaving.last_migrate_error.find("did not land within migrate_send_timeout_ms") != std::string::npos);
  CHECK(got.pages_back);
  CHECK(got.idle);  // its moves given up, it can change role
}

TEST_CASE("a move whose KV is corrupted on the way is given up when the target's check fails: the sequences "
          "finish where they were, nothing is recomputed, and the rank says why") {
  // Every put of the leaving rank lands with one byte flipped (only moves put from decode ranks
  // here: no store). Before: "migrated" on the puts alone, the request's order found the
  // target's lease dropped as corrupt, and the sequence was recomputed from its prompt.
  const auto got =
      run_failed_moves(two_decode_ranks(), {transport::fault_kind::corrupt_byte, {}, {}, 1000000, 7}, "a corrupted move");
  CHECK(got.leaving.last_migrate_error.find("checksum") != std::string::npos);
  CHECK(got.leaving.last_migrate_error.find("to decode-0") != std::string::npos);  // the peer
  CHECK(got.pages_back);
}

TEST_CASE("a move whose KV takes longer to land than a request's lease lasts still completes: the target holds "
          "the lease as long as the source waits for its puts, and nothing is recomputed") {
  test::cluster_system t;
  auto cfg = two_decode_ranks();
  // A move's puts take longer than this below; still long enough that keepalives (every third of
  // it) do not miss it on a stalled machine (a failover would spoil the count).
  cfg.router.request.lease_ms = 600;
  cfg.decode.migrate_send_timeout_ms = 60000;  // slow puts, not abandoned ones
  REQUIRE(cfg.validate().empty());
  // The decode ranks' puts (only moves use them) each report pending for their first 5000 polls:
  // at least 1 s at the 200 us poll interval.
  auto wrap = [](std::unique_ptr<transport::transport> inner, const std::string& name) -> std::shared_ptr<transport::transport> {
    if (name.rfind("decode", 0) != 0) return std::shared_ptr<transport::transport>{std::move(inner)};
    transport::fault_plan slow{transport::fault_kind::delay, {}, {}, 1000000, 1};
    slow.delay_polls = 5000;
    return std::shared_ptr<transport::transport>{transport::make_fault_proxy(std::move(inner), slow)};
  };
  auto cluster = start_local_cluster(t.sys, cfg, {}, wrap);
  test::cluster_system::stopper stop{t, cluster};
  // Both decode ranks known to the balancer first: else the requests may all go to the one
  // that registered first, and the rank a test drains has nothing to move.
  REQUIRE(t.wait_registered(cluster));
  caf::scoped_actor self{t.sys};
  constexpr int n = 6, max_tokens = 300;
  auto handles = send_long(self, cluster.router, n, max_tokens, "a slow move, number");
  // Whichever rank decodes some of them first leaves.
  const auto found = first_running(t, cluster, {0, 1});
  REQUIRE(found);
  const auto leaving = cluster.decode[*found].handle;
  self->send(cluster.decode_balancer, drain_atom::value, leaving);
  self->send(leaving, migrate_atom::value);
  const auto done = answers(t, handles);
  for (int i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(done[i].failovers == 0);  // before: the target's lease expired first, and the move became a recompute
    CHECK(done[i].tokens.size() == max_tokens);
  }
  const auto st = t.stats(leaving);
  CHECK(st.migrated_out > 0);
  CHECK(st.migrate_failed == 0);
}

TEST_CASE("a sequence whose prompt came in a wire form keeps that mark when it moves: neither decode rank writes it "
          "back to the store (the store keeps exact KV only), and its tokens are the wire form's reference") {
  struct temp_dir {  // removed after the cluster has stopped (declared before it)
    std::string path = "/tmp/baton-migrate-wire-" + std::to_string(::getpid());
    temp_dir() { std::filesystem::remove_all(path); }
    ~temp_dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } tmp;
  const std::string& dir = tmp.path;
  test::cluster_system t;
  auto cfg = two_decode_ranks();
  cfg.store.enabled = true;
  cfg.store.dir = dir;
  cfg.store.block_tokens = 16;
  cfg.router.request.kv_wire.chat = transport::wire_format::int8;  // chat in INT8; agent in f32
  REQUIRE(cfg.validate().empty());
  auto cluster = start_local_cluster(t.sys, cfg);
  test::cluster_system::stopper stop{t, cluster};
  // Both decode ranks known to the balancer first: else the requests may all go to the one
  // that registered first, and the rank a test drains has nothing to move.
  REQUIRE(t.wait_registered(cluster));
  caf::scoped_actor self{t.sys};

  constexpr int n = 6, max_tokens = 300;
  std::vector<std::string> prompts;
  auto handles = send_long(self, cluster.router, n, max_tokens, "a quantised sequence on the move", &prompts);
  // The first decode rank seen running sequences leaves (bounded wait); the other takes them.
  const auto from = first_running(t, cluster, {0, 1});
  REQUIRE(from);
  const auto& leaving = cluster.decode[*from].handle;
  const auto& target = cluster.decode[1 - *from].handle;
  self->send(cluster.decode_balancer, drain_atom::value, leaving);
  self->send(leaving, migrate_atom::value);
  const auto done = answers(t, handles);
  uint32_t moved = 0;
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  const gpu::byte_tokenizer tok{cfg.model.bos_token_id, cfg.model.eos_token_id};
  for (int i = 0; i < n; ++i) {
    CAPTURE(i);
    moved += done[i].migrations;
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    auto ref = gpu::generate_colocated(*exec, tok.encode(prompts[i]), max_tokens, cfg.prefill.chunk_tokens, {}, true,
                                       test::wire_round_trip(transport::wire_format::int8));
    CHECK(done[i].tokens == ref.tokens);
  }
  REQUIRE(moved > 0);
  CHECK(t.stats(target).blocks_written_back == 0);
  CHECK(t.stats(leaving).blocks_written_back == 0);
  // The control: an f32 (agent) request in the same cluster is written back.
  generate_request req;
  req.prompt = "an exact sequence, written back";
  req.max_tokens = 20;
  req.traffic_class = "agent";
  auto control = t.generate(cluster.router, req);
  REQUIRE(control);
  uint64_t written = 0;
  for (int i = 0; i < 500 && written == 0; ++i) {
    written = t.stats(target).blocks_written_back + t.stats(leaving).blocks_written_back;
    if (written == 0) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  CHECK(written > 0);
  // A block counts once a server confirmed it (or as dropped): by the control's, any write-back
  // the wire-form sequences (300 tokens and more: 18 blocks each) had started has settled too.
  // Every block written or dropped is the control's.
  const auto settled = [&](const decode_rank_actor& r) {
    const auto s = t.stats(r);
    return s.blocks_written_back + s.write_backs_dropped;
  };
  const size_t control_blocks = (tok.encode(req.prompt).size() + control->tokens.size()) / cfg.store.block_tokens;
  CHECK(settled(target) + settled(leaving) <= control_blocks);
}

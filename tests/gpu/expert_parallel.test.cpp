// Expert parallelism on the CPU executor (issue 14): MoE rows dispatched to EP ranks over the
// all-to-all and combined in expert order, with dual-batch overlap and live EPLB; every variant's
// tokens and logits equal EP 1's, bit for bit. Shards run on threads here (loopback and UCX);
// tests/deploy/expert_parallel_e2e.sh runs them as processes.

#include <doctest/doctest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "gpu/cpu_executor.hpp"
#include "gpu/expert_parallel.hpp"
#include "gpu/local_generate.hpp"
#include "policies/eplb.hpp"
#include "tests/test_util.hpp"
#include "transport/all_to_all.hpp"
#include "transport/loopback.hpp"
#include "transport/ucx.hpp"

using namespace baton;
using namespace baton::gpu;
namespace {

/// An EP group of `size` over loopback or UCX: rank 0's expert_group for the executor, the
/// shards serving on threads (in production they are processes: `baton experts`).
struct ep_fixture {
  std::vector<std::unique_ptr<transport::transport>> shard_t;  // before the all-to-alls registered on them
  std::vector<std::unique_ptr<transport::all_to_all>> shard_a2a;
  std::vector<std::thread> shards;
  std::vector<std::string> shard_errors;
  std::shared_ptr<expert_group> group;
  /// Each shard's own weights (shard r at r - 1): it keeps only the experts placed on it.
  std::vector<std::unique_ptr<model_weights>> shard_w;

  std::vector<std::unique_ptr<transport::all_to_all>> shard_b;  ///< dual-batch overlap's second channel

  ep_fixture(const std::string& backend, uint32_t size, const model_config& cfg, std::shared_ptr<const model_weights> w,
             bool dual = false) {
    static auto fabric = transport::make_loopback_fabric();
    static int serial = 0;
    ++serial;
    std::vector<std::string> names;
    std::vector<std::unique_ptr<transport::transport>> ts;
    for (uint32_t r = 0; r < size; ++r) {
      names.push_back("ep" + std::to_string(serial) + "-" + std::to_string(r));
      std::string why;
      ts.push_back(backend == "ucx" ? transport::make_ucx_transport({names.back()}, &why)
                                    : transport::make_loopback_transport(fabric, names.back()));
      REQUIRE_MESSAGE(ts.back(), why);
    }
    std::vector<std::unique_ptr<transport::all_to_all>> a2a;
    std::vector<transport::region_key> keys;
    for (uint32_t r = 0; r < size; ++r) {
      // Shards wait for the lead as long as a test may take; the lead waits 10 s for answers.
      const auto wait = std::chrono::milliseconds{r == 0 ? 10'000 : 120'000};
      a2a.push_back(std::make_unique<transport::all_to_all>(
          *ts[r], names, transport::all_to_all_config{r, size, expert_slot_bytes(cfg, 64), wait}));
      REQUIRE_MESSAGE(a2a.back()->error().empty(), a2a.back()->error());
      keys.push_back(a2a.back()->key());
    }
    for (auto& a : a2a) a->connect(keys);
    std::vector<std::unique_ptr<transport::all_to_all>> b(size);
    if (dual) {
      keys.clear();
      for (uint32_t r = 0; r < size; ++r) {
        b[r] = std::make_unique<transport::all_to_all>(
            *ts[r], names, transport::all_to_all_config{r, size, expert_slot_bytes(cfg, 64), a2a[r]->config().timeout});
        keys.push_back(b[r]->key());
      }
      for (auto& x : b) x->connect(keys);
    }
    shard_errors.resize(size);
    for (uint32_t r = 1; r < size; ++r) shard_w.push_back(std::make_unique<model_weights>(*w));
    for (uint32_t r = 1; r < size; ++r) {
      auto* a = a2a[r].get();
      auto* second = b[r].get();
      auto* mine = shard_w[r - 1].get();
      shards.emplace_back([this, a, second, r, cfg, mine] {
        if (!run_expert_shard(cfg, *mine, *a, &shard_errors[r], second)) return;
        shard_errors[r] = "stopped";
      });
    }
    for (uint32_t r = 1; r < size; ++r) {
      shard_a2a.push_back(std::move(a2a[r]));
      shard_b.push_back(std::move(b[r]));
      shard_t.push_back(std::move(ts[r]));
    }
    group = std::make_shared<expert_group>(std::move(ts[0]), std::move(a2a[0]), size, std::move(b[0]));
  }
  /// Stops the shards (the group's destructor sends stop) and joins them.
  void finish() {
    group.reset();
    for (auto& t : shards) t.join();
    shards.clear();
  }
  ~ep_fixture() {
    if (!shards.empty()) finish();
  }
};

}  // namespace

TEST_CASE("expert parallelism: EP 2 and 4 (shards over loopback and UCX), with and without dual-batch overlap, give "
          "the tokens and logits of EP 1, bit for bit; every shard stops when told") {
  for (bool v3 : {false, true}) {
    const auto cfg = deepseek_tiny_config(v3);
    auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 21));
    auto alone = make_cpu_executor(cfg, w, {});
    std::vector<int32_t> prompt;
    for (int i = 0; i < 40; ++i) prompt.push_back((i * 41 + 5) % 256);
    const auto ref = generate_colocated(*alone, prompt, 6, 16, {}, true);
    REQUIRE(ref.error.empty());
    for (const std::string backend : {"loopback", "ucx"})
      for (uint32_t size : {2u, 4u})
      for (bool dual : {false, true}) {
        CAPTURE(v3);
        CAPTURE(backend);
        CAPTURE(size);
        CAPTURE(dual);
        ep_fixture ep{backend, size, cfg, w, dual};
        CHECK(ep.group->dual_batch() == dual);
        cpu_executor_config ec;
        ec.experts = ep.group;
        auto exec = make_cpu_executor(cfg, w, ec);
        const auto got = generate_colocated(*exec, prompt, 6, 16, {}, true);
        REQUIRE_MESSAGE(got.error.empty(), got.error);
        CHECK(got.tokens == ref.tokens);
        CHECK(test::same_bits(got.step_logits, ref.step_logits));
        // With dual-batch overlap the three prefill chunks (16, 16 and 8 rows) overlap attention
        // too; the one-row decode steps have no second micro-batch.
        uint64_t moe_layers = 0;
        for (uint32_t l = 0; l < cfg.num_hidden_layers; ++l) moe_layers += cfg.is_moe_layer(l) ? 1 : 0;
        CHECK(ep.group->split_rounds() == (dual ? 3 * moe_layers : 0));
        exec.reset();
        ec.experts.reset();
        ep.finish();
        for (uint32_t r = 1; r < size; ++r) CHECK(ep.shard_errors[r] == "stopped");
      }
  }
}

TEST_CASE("expert parallelism: a malformed dispatch chunk is refused with a sentence, and a silent shard fails the "
          "job naming the layer and the shard") {
  const auto cfg = deepseek_tiny_config(true);
  auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 3));
  std::vector<std::byte> out, junk(7);
  std::string why;
  CHECK_FALSE(serve_expert_chunk(cfg, *w, junk, &out, &why));
  CHECK(why == "expert dispatch: a chunk of 7 bytes has no header");
  std::vector<std::byte> bad(12 + 4 + cfg.hidden_size * 4);
  const uint32_t hdr[3] = {1, 0, 1};  // layer 0 is dense
  std::memcpy(bad.data(), hdr, sizeof hdr);
  CHECK_FALSE(serve_expert_chunk(cfg, *w, bad, &out, &why));
  CHECK(why.find("layer 0 with 1 entries does not fit") != std::string::npos);
  const uint32_t hdr2[3] = {1, 1, 1};
  const uint32_t expert = 99;
  std::memcpy(bad.data(), hdr2, sizeof hdr2);
  std::memcpy(bad.data() + 12, &expert, 4);
  CHECK_FALSE(serve_expert_chunk(cfg, *w, bad, &out, &why));
  CHECK(why == "expert dispatch: expert 99 does not exist");
  // Work for an expert whose weights this rank does not hold (a placement gone wrong) is refused.
  auto partial = *w;
  partial.layers[1].experts[5] = {};
  const uint32_t five = 5;
  std::memcpy(bad.data() + 12, &five, 4);
  CHECK(serve_expert_chunk(cfg, *w, bad, &out, &why));
  CHECK_FALSE(serve_expert_chunk(cfg, partial, bad, &out, &why));
  CHECK(why == "expert dispatch: expert 5 of layer 1 is not held here (the placement and the weights disagree)");

  // A group whose shard never serves: rank 1's all-to-all exists but nobody runs it.
  auto fabric = transport::make_loopback_fabric();
  std::vector<std::string> names{"lead", "mute"};
  auto t0 = transport::make_loopback_transport(fabric, "lead"), t1 = transport::make_loopback_transport(fabric, "mute");
  transport::all_to_all_config c0{0, 2, expert_slot_bytes(cfg, 64), std::chrono::milliseconds{200}}, c1 = c0;
  c1.rank = 1;
  auto a0 = std::make_unique<transport::all_to_all>(*t0, names, c0);
  transport::all_to_all a1{*t1, names, c1};
  a0->connect({a0->key(), a1.key()});
  a1.connect({a0->key(), a1.key()});
  cpu_executor_config ec;
  ec.experts = std::make_shared<expert_group>(std::move(t0), std::move(a0), 2);
  auto exec = make_cpu_executor(cfg, w, ec);
  const auto got = generate_colocated(*exec, {1, 2, 3}, 2, 16, {}, true);
  CHECK(got.error.find("layer 1: expert dispatch, layer 1: all-to-all exchange 1: rank lead has nothing from mute") !=
        std::string::npos);
  // Out of step with its shard from here on: the group is out for good, and says so (the rank
  // steps aside and the keeper starts new shards), not failing every later job for ever.
  CHECK(exec->standing_failure().find("expert parallelism: the lead: expert dispatch, layer 1: all-to-all exchange 1") == 0);
  exec.reset();
  ec.experts.reset();  // its stop goes unanswered within the timeout

  // The same with dual-batch overlap: the failed round left micro-batch B's exchange open, and
  // every later job failed ("exchange ... is still open") with the rank never stepping aside.
  {
    auto tl = transport::make_loopback_transport(fabric, "lead-d"), tm = transport::make_loopback_transport(fabric, "mute-d");
    std::vector<std::string> dn{"lead-d", "mute-d"};
    auto la = std::make_unique<transport::all_to_all>(*tl, dn, c0), lb = std::make_unique<transport::all_to_all>(*tl, dn, c0);
    transport::all_to_all ma{*tm, dn, c1}, mb{*tm, dn, c1};
    la->connect({la->key(), ma.key()});
    ma.connect({la->key(), ma.key()});
    lb->connect({lb->key(), mb.key()});
    mb.connect({lb->key(), mb.key()});
    cpu_executor_config dc;
    dc.experts = std::make_shared<expert_group>(std::move(tl), std::move(la), 2, std::move(lb));
    REQUIRE(dc.experts->dual_batch());
    auto dual_exec = make_cpu_executor(cfg, w, dc);
    const auto first = generate_colocated(*dual_exec, {1, 2, 3, 4, 5, 6, 7, 8}, 2, 16, {}, true);
    CHECK_FALSE(first.error.empty());
    CHECK_MESSAGE(dual_exec->standing_failure().find("expert parallelism: the lead: ") == 0, dual_exec->standing_failure());
    dual_exec.reset();
    dc.experts->watch_shards([](uint32_t) { return std::string{"gone"}; });  // its stop is not waited for
    dc.experts.reset();
  }

  // A shard that fails (here: it holds none of its experts) says so, and the lead's job fails at
  // once naming it, not at the timeout.
  auto t2 = transport::make_loopback_transport(fabric, "lead2"), t3 = transport::make_loopback_transport(fabric, "broken");
  std::vector<std::string> names2{"lead2", "broken"};
  transport::all_to_all_config c2{0, 2, expert_slot_bytes(cfg, 64), std::chrono::milliseconds{120'000}}, c3 = c2;
  c3.rank = 1;
  auto a2 = std::make_unique<transport::all_to_all>(*t2, names2, c2);
  transport::all_to_all a3{*t3, names2, c3};
  a2->connect({a2->key(), a3.key()});
  a3.connect({a2->key(), a3.key()});
  model_weights none = *w;
  std::string shard_why;
  std::thread shard([&] {
    auto emptied = none;
    keep_expert_block(cfg, emptied, 2, 2);  // a rank past the last: no expert left
    // run_expert_shard keeps rank 1's block of what it is given: nothing.
    CHECK_FALSE(run_expert_shard(cfg, emptied, a3, &shard_why));
  });
  cpu_executor_config ec2;
  ec2.experts = std::make_shared<expert_group>(std::move(t2), std::move(a2), 2);
  auto exec2 = make_cpu_executor(cfg, w, ec2);
  const auto failed = generate_colocated(*exec2, {1, 2, 3, 4, 5, 6, 7, 8}, 2, 16, {}, true);
  shard.join();
  CHECK(shard_why.find("is not held here") != std::string::npos);
  CHECK(failed.error.find("rank lead2 stops waiting for broken: the shard failed") != std::string::npos);
  exec2.reset();
  ec2.experts.reset();

  // A shard whose process is gone (watch_shards: as spawn_expert_group looks at its children)
  // fails the lead's job with its fate, long before the two-minute timeout.
  auto t4 = transport::make_loopback_transport(fabric, "lead3"), t5 = transport::make_loopback_transport(fabric, "dead");
  std::vector<std::string> names3{"lead3", "dead"};
  auto a4 = std::make_unique<transport::all_to_all>(*t4, names3, c2);
  transport::all_to_all a5{*t5, names3, c3};
  a4->connect({a4->key(), a5.key()});
  a5.connect({a4->key(), a5.key()});
  cpu_executor_config ec3;
  ec3.experts = std::make_shared<expert_group>(std::move(t4), std::move(a4), 2);
  uint32_t looked = 0;
  ec3.experts->watch_shards([&](uint32_t rank) -> std::string {
    ++looked;
    return rank == 1 && looked > 3 ? "its process (dead, pid 4242) ended with signal 9" : "";
  });
  auto exec3 = make_cpu_executor(cfg, w, ec3);
  std::atomic<int> told{0};
  exec3->on_health_change([&] { ++told; });
  CHECK(exec3->standing_failure().empty());
  const auto gone = generate_colocated(*exec3, {1, 2, 3}, 2, 16, {}, true);
  CHECK_MESSAGE(gone.error.find("rank lead3 stops waiting for dead: its process (dead, pid 4242) ended with signal 9") !=
                    std::string::npos,
                gone.error);
  // Out for good: the executor says so from now on, and its rank heard it once, so that it steps
  // aside (a decode rank offers no room) before another request finds out.
  CHECK(exec3->standing_failure() ==
        "expert parallelism: expert shard 1 of 2: its process (dead, pid 4242) ended with signal 9");
  for (int i = 0; i < 200 && told.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  CHECK(told.load() == 1);
  exec3.reset();
  ec3.experts->watch_shards([](uint32_t) { return std::string{"gone"}; });  // its stop is not waited for either
  ec3.experts.reset();
}

TEST_CASE("expert parallelism: an idle engine notices by itself a shard that is out for good and steps aside, takes "
          "a new group between jobs (replace_experts) and answers as EP 1 again; replacements it cannot take are "
          "refused with a sentence") {
  const auto cfg = deepseek_tiny_config(true);
  auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 21));
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back((i * 37 + 11) % 256);
  const auto ref = generate_colocated(*make_cpu_executor(cfg, w, {}), prompt, 4, 16, {}, true);
  REQUIRE(ref.error.empty());
  // Declared before what reads them: the fixtures' groups ask `dead`, the executor tells `told`.
  std::atomic<bool> dead{false};
  std::atomic<int> told{0};
  ep_fixture first{"loopback", 2, cfg, w}, second{"loopback", 2, cfg, w};
  // As spawn_expert_group's watch: the shard's process ended (here: the test says so).
  first.group->watch_shards([&dead](uint32_t r) {
    return r == 1 && dead ? std::string{"its process (test-shard, pid 1) ended with signal 9"} : std::string{};
  });
  cpu_executor_config ec;
  ec.experts = first.group;
  auto exec = make_cpu_executor(cfg, w, ec);
  ec.experts.reset();
  exec->on_health_change([&told] { ++told; });
  auto got = generate_colocated(*exec, prompt, 4, 16, {}, true);
  REQUIRE_MESSAGE(got.error.empty(), got.error);
  CHECK(got.tokens == ref.tokens);
  std::string why;
  CHECK_FALSE(exec->replace_experts(second.group, &why));
  CHECK(why == "its expert group has not failed; nothing to replace");
  CHECK_FALSE(exec->replace_experts(nullptr, &why));
  CHECK(why == "replace_experts: no group given");

  dead = true;  // no job runs: the idle executor looks at its shards by itself
  for (int i = 0; i < 400 && told.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  CHECK(told.load() == 1);
  CHECK(exec->standing_failure() ==
        "expert parallelism: expert shard 1 of 2: its process (test-shard, pid 1) ended with signal 9");
  REQUIRE_MESSAGE(exec->replace_experts(second.group, &why), why);
  for (int i = 0; i < 400 && told.load() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  CHECK(told.load() == 2);  // the rank hears that the failure cleared
  CHECK(exec->standing_failure().empty());
  CHECK_FALSE(exec->rejoin_pending());
  first.finish();  // the old shard stops: only the new group can serve from here on
  CHECK(first.shard_errors[1] == "stopped");
  got = generate_colocated(*exec, prompt, 4, 16, {}, true);
  REQUIRE_MESSAGE(got.error.empty(), got.error);
  CHECK(got.tokens == ref.tokens);
  CHECK(test::same_bits(got.step_logits, ref.step_logits));
  CHECK_FALSE(exec->replace_experts(second.group, &why));
  CHECK(why == "its expert group has not failed; nothing to replace");
  exec.reset();
  second.finish();
  CHECK(second.shard_errors[1] == "stopped");
  // An executor without shards has nothing to replace.
  auto plain = make_cpu_executor(cfg, w, {});
  ep_fixture third{"loopback", 2, cfg, w};
  CHECK_FALSE(plain->replace_experts(third.group, &why));
  CHECK(why == "this executor has no expert shards");
}

TEST_CASE("live EPLB: on a skewed routing load the hottest EP rank's copies drop from 3.8x the mean to 1.15x, and "
          "tokens stay those of EP 1") {
  const auto cfg = deepseek_tiny_config(true);
  auto skewed = make_seeded_weights(cfg, 21);
  for (auto& l : skewed.layers)  // V3's correction bias steers the choice: experts 0 and 1 turn hot
    if (!l.router_bias.empty()) l.router_bias[0] += 1.0f, l.router_bias[1] += 1.0f;
  auto w = std::make_shared<const model_weights>(std::move(skewed));
  std::vector<int32_t> prompt;
  for (int i = 0; i < 48; ++i) prompt.push_back((i * 29 + 3) % 256);
  auto alone = make_cpu_executor(cfg, w, {});
  const auto ref = generate_colocated(*alone, prompt, 8, 16, {}, true);
  REQUIRE(ref.error.empty());
  auto imbalance_of = [](const std::vector<uint64_t>& copies) {
    std::vector<double> v(copies.begin(), copies.end());
    return policies::imbalance(v);
  };
  double before = 0, after = 0;
  for (bool eplb : {false, true}) {
    CAPTURE(eplb);
    ep_fixture ep{"loopback", 4, cfg, w};
    std::string why;
    // A plan every 8 forward passes (2 MoE layers each): from the prefill and 7 decode steps.
    if (eplb) REQUIRE_MESSAGE(ep.group->enable_eplb({4, 16}, cfg.moe.n_routed_experts, &why), why);
    cpu_executor_config ec;
    ec.experts = ep.group;
    auto exec = make_cpu_executor(cfg, w, ec);
    auto first = generate_colocated(*exec, prompt, 8, 16, {}, true);  // EPLB's first window
    REQUIRE_MESSAGE(first.error.empty(), first.error);
    CHECK(first.tokens == ref.tokens);
    CHECK(test::same_bits(first.step_logits, ref.step_logits));
    ep.group->take_rank_copies();
    const auto second = generate_colocated(*exec, prompt, 8, 16, {}, true);
    CHECK(second.tokens == ref.tokens);
    CHECK(test::same_bits(second.step_logits, ref.step_logits));
    const auto copies = ep.group->take_rank_copies();
    (eplb ? after : before) = imbalance_of(copies);
    MESSAGE(std::string{eplb ? "EPLB on" : "EPLB off"} << ": copies per EP rank " << copies[0] << " " << copies[1]
                                                       << " " << copies[2] << " " << copies[3] << ", plans "
                                                       << ep.group->plans());
    const uint64_t installed = ep.group->bytes_installed(), evicted = ep.group->experts_evicted();
    exec.reset();
    ec.experts.reset();
    ep.finish();
    // Each shard holds the experts placed on it and no others: its contiguous block without
    // EPLB (8 experts over 4 ranks), at most its 4 slots with it, moved there by the lead.
    bool moved = false;
    for (uint32_t r = 1; r < 4; ++r)
      for (uint32_t l = 0; l < cfg.num_hidden_layers; ++l) {
        if (!cfg.is_moe_layer(l)) continue;
        const auto held = held_experts(cfg, *ep.shard_w[r - 1], l);
        const std::vector<uint32_t> block{2 * r, 2 * r + 1};
        if (!eplb) CHECK(held == block);
        if (eplb) CHECK((held.size() >= 1 && held.size() <= 4));
        moved |= held != block;
      }
    CHECK(moved == eplb);
    CHECK((installed > 0) == eplb);
    CHECK((evicted > 0) == eplb);
    if (eplb) MESSAGE("EPLB moved " << installed << " bytes of expert weights to the shards and dropped " << evicted << " experts");
  }
  CHECK(before > 3.5);  // 211 of 220 copies on rank 0, which holds experts 0 and 1
  CHECK(after < 1.2);   // 63 / 62 / 49 / 46
  // A slot budget that cannot hold the experts is refused.
  ep_fixture ep{"loopback", 4, cfg, w};
  std::string why;
  CHECK_FALSE(ep.group->enable_eplb({1, 2}, cfg.moe.n_routed_experts, &why));
  CHECK(why == "EPLB: 4 ranks x 1 slots cannot hold 8 experts");
  ep.group.reset();
}

namespace {

/// A cached prefix whose layers from `at` on never arrive: the job fails at layer `at`'s
/// attention, after the MoE rounds of the layers before it.
struct fails_at_gate final : layer_gate {
  uint32_t at;
  explicit fails_at_gate(uint32_t layer) : at(layer) {}
  bool wait(uint32_t layer) const override { return layer < at; }
};

/// A data-parallel group of `size` CPU executors in this process, over loopback or UCX.
struct dp_fixture {
  std::vector<std::shared_ptr<expert_peers>> members;
  std::vector<std::unique_ptr<executor>> execs;
  std::shared_ptr<model_weights> attention_only;  ///< what the executors share: no routed experts

  dp_fixture(const std::string& backend, uint32_t size, const model_config& cfg, std::shared_ptr<const model_weights> w,
             const live_eplb_config& eplb = {}, bool dual = false) {
    static auto fabric = transport::make_loopback_fabric();
    static int serial = 0;
    ++serial;
    std::vector<std::string> names;
    for (uint32_t r = 0; r < size; ++r) names.push_back("dp" + std::to_string(serial) + "-" + std::to_string(r));
    std::string why;
    members = make_peer_group(
        names, cfg, {expert_slot_bytes(cfg, 64), std::chrono::milliseconds{10'000}, dual},
        [&](const std::string& name, std::string* err) -> std::unique_ptr<transport::transport> {
          if (backend == "ucx") return transport::make_ucx_transport({name}, err);
          return transport::make_loopback_transport(fabric, name);
        },
        &why);
    REQUIRE_MESSAGE(members.size() == size, why);
    // The executors' own weights have no routed experts at all: every expert a member runs comes
    // from its store, which holds its block and no others, so a copy routed to the wrong member
    // fails its job instead of passing unnoticed.
    attention_only = std::make_shared<model_weights>(*w);
    keep_expert_block(cfg, *attention_only, size, size);  // a rank past the last: keeps none
    for (auto& m : members) {
      m->hold_block(cfg, *w);
      if (eplb.slots_per_rank) REQUIRE_MESSAGE(m->enable_eplb(eplb, cfg.moe.n_routed_experts, &why), why);
      cpu_executor_config ec;
      ec.peers = m;
      execs.push_back(make_cpu_executor(cfg, attention_only, ec));
    }
  }
  /// Every member stops before any goes: none is left waiting on a vanished peer.
  ~dp_fixture() {
    for (auto& e : execs) e->stop();
  }
};

std::vector<int32_t> prompt_of(int salt, int n) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 37 + salt * 11 + 1) % 256);
  return p;
}

}  // namespace

TEST_CASE("data-parallel attention: 2 and 4 members (loopback and UCX, with and without dual-batch overlap), each "
          "decoding its own prompt at once while the last one idles, give EP 1's tokens and logits bit for bit; the "
          "idle member joins their steps") {
  for (bool v3 : {false, true}) {
    const auto cfg = deepseek_tiny_config(v3);
    auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 21));
    auto alone = make_cpu_executor(cfg, w, {});
    for (const std::string backend : {"loopback", "ucx"})
      for (uint32_t size : {2u, 4u})
      for (bool dual : {false, true}) {
        CAPTURE(v3);
        CAPTURE(backend);
        CAPTURE(size);
        CAPTURE(dual);
        std::vector<colocated_generation> ref(size - 1), got(size - 1);
        for (uint32_t r = 0; r + 1 < size; ++r) ref[r] = generate_colocated(*alone, prompt_of(r, 24 + 8 * r), 6, 16, {}, true);
        dp_fixture dp{backend, size, cfg, w, {}, dual};
        CHECK(dp.members[0]->dual_batch() == dual);
        std::vector<std::thread> users;
        for (uint32_t r = 0; r + 1 < size; ++r)
          users.emplace_back([&, r] { got[r] = generate_colocated(*dp.execs[r], prompt_of(r, 24 + 8 * r), 6, 16, {}, true); });
        for (auto& u : users) u.join();
        for (uint32_t r = 0; r + 1 < size; ++r) {
          CAPTURE(r);
          REQUIRE_MESSAGE(got[r].error.empty(), got[r].error);
          CHECK(got[r].tokens == ref[r].tokens);
          CHECK(test::same_bits(got[r].step_logits, ref[r].step_logits));
        }
        // The idle member served its experts in every step a peer ran (at least the longest
        // peer's 2 prefill chunks and 5 decode steps).
        CHECK(dp.members[size - 1]->steps_joined() >= 7);
      }
  }
}

namespace {

/// `count` sequences prefilled one by one, then `steps` decode steps with all of them in one job
/// (greedy): each sequence's logits, the prefill's first.
std::vector<std::vector<std::vector<float>>> batched_decode(executor& e, int count, uint32_t steps, int salt) {
  std::vector<std::vector<std::vector<float>>> out(count);
  std::vector<std::vector<uint32_t>> pages(count);
  std::vector<int32_t> next(count);
  std::vector<uint32_t> pos(count);
  uint64_t id = 1;
  for (int i = 0; i < count; ++i) {
    const auto prompt = prompt_of(salt + i, 12 + 5 * i);
    pages[i] = *e.kv().kv_page_alloc(e.kv().pages_for_tokens(static_cast<uint32_t>(prompt.size()) + steps + 1));
    auto r = run_blocking(e, {id++, {{static_cast<uint64_t>(i), prompt, 0, pages[i], true}}});
    REQUIRE_MESSAGE(r.error.empty(), r.error);
    pos[i] = static_cast<uint32_t>(prompt.size());
    next[i] = sample_token(r.logits[0], {}, pos[i], nullptr);
    out[i].push_back(std::move(r.logits[0]));
  }
  for (uint32_t s = 0; s < steps; ++s) {
    forward_job job{id++, {}, forward_job::decode};
    for (int i = 0; i < count; ++i) job.seqs.push_back({static_cast<uint64_t>(i), {next[i]}, pos[i], pages[i], true});
    auto r = run_blocking(e, std::move(job));
    REQUIRE_MESSAGE(r.error.empty(), r.error);
    for (int i = 0; i < count; ++i) {
      ++pos[i];
      next[i] = sample_token(r.logits[i], {}, pos[i], nullptr);
      out[i].push_back(std::move(r.logits[i]));
    }
  }
  for (auto& p : pages) e.kv().kv_page_free(p);
  return out;
}

}  // namespace

TEST_CASE("dual-batch overlap with attention overlapped (prefill chunks split in two, decode batches of 3 and 4 "
          "sequences: micro-batch B's attention while A's dispatch travels, A's next attention while B's combine "
          "does) gives EP 1's logits bit for bit, in the expert-group form and the data-parallel form") {
  for (bool v3 : {false, true}) {
    CAPTURE(v3);
    const auto cfg = deepseek_tiny_config(v3);
    auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 21));
    auto alone = make_cpu_executor(cfg, w, {});
    uint64_t moe_layers = 0;
    for (uint32_t l = 0; l < cfg.num_hidden_layers; ++l) moe_layers += cfg.is_moe_layer(l) ? 1 : 0;
    for (int count : {3, 4}) {
      CAPTURE(count);
      const auto ref = batched_decode(*alone, count, 5, 0);
      for (const std::string backend : {"loopback", "ucx"}) {
        CAPTURE(backend);
        {
          ep_fixture ep{backend, 2, cfg, w, true};
          cpu_executor_config ec;
          ec.experts = ep.group;
          auto exec = make_cpu_executor(cfg, w, ec);
          const auto got = batched_decode(*exec, count, 5, 0);
          for (int i = 0; i < count; ++i) CHECK(test::same_bits(got[i], ref[i]));
          // Every MoE layer of the prefills (one per sequence, 12 to 27 rows each) and of the five
          // decode steps, each run in three steps.
          CHECK(ep.group->split_rounds() == (count + 5) * moe_layers);
          exec.reset();
          ec.experts.reset();
          ep.finish();
        }
        // Both members decode batches at once; each is EP 1's.
        dp_fixture dp{backend, 2, cfg, w, {}, true};
        std::vector<std::vector<std::vector<float>>> got[2];
        std::thread other([&] { got[1] = batched_decode(*dp.execs[1], count, 5, 0); });
        got[0] = batched_decode(*dp.execs[0], count, 5, 0);
        other.join();
        for (int m = 0; m < 2; ++m)
          for (int i = 0; i < count; ++i) CHECK(test::same_bits(got[m][i], ref[i]));
        CHECK(dp.members[0]->split_rounds() == (count + 5) * moe_layers);
      }
    }
  }
}

TEST_CASE("data-parallel attention: a member whose forward fails midway, or whose job outgrows the slots, still ends "
          "its step, so its peer's tokens are unchanged and its own next job runs; a member that stopped fails the "
          "others' next step at once, naming it") {
  const auto cfg = deepseek_tiny_config(true);  // layer 0 dense, layers 1 and 2 MoE
  auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 5));
  auto alone = make_cpu_executor(cfg, w, {});
  const auto ref = generate_colocated(*alone, prompt_of(3, 30), 6, 16, {}, true);
  REQUIRE(ref.error.empty());
  dp_fixture dp{"loopback", 2, cfg, w};
  CHECK(held_experts(cfg, *dp.attention_only, 1).empty());
  CHECK(dp.members[0]->held(1) == std::vector<uint32_t>{0, 1, 2, 3});
  CHECK(dp.members[1]->held(1) == std::vector<uint32_t>{4, 5, 6, 7});
  colocated_generation got;
  std::thread peer([&] { got = generate_colocated(*dp.execs[1], prompt_of(3, 30), 6, 16, {}, true); });
  // Member 0: jobs whose cached prefix stops arriving at layer 2, after layer 1's MoE round.
  for (int i = 0; i < 4; ++i) {
    forward_job job{100u + i, {forward_seq{7, {1, 2, 3}, 0, {0}, true, std::make_shared<fails_at_gate>(2)}}};
    const auto r = run_blocking(*dp.execs[0], std::move(job));
    CHECK(r.error.find("layer 2 of its cached prefix will not arrive") != std::string::npos);
  }
  // A job larger than the group's slots fails alone, naming the slot; the group stays in step.
  const auto huge = generate_colocated(*dp.execs[0], prompt_of(4, 300), 1, 300, {}, true);
  CHECK(huge.error.find("exceed the slot of") != std::string::npos);
  peer.join();
  REQUIRE_MESSAGE(got.error.empty(), got.error);
  CHECK(got.tokens == ref.tokens);
  CHECK(test::same_bits(got.step_logits, ref.step_logits));
  // Member 0 is still in step: its own generation is EP 1's too.
  const auto again = generate_colocated(*dp.execs[0], prompt_of(3, 30), 6, 16, {}, true);
  REQUIRE_MESSAGE(again.error.empty(), again.error);
  CHECK(again.tokens == ref.tokens);

  dp.execs[1]->stop();
  const auto after = generate_colocated(*dp.execs[0], prompt_of(3, 30), 2, 16, {}, true);
  CHECK(after.error.find("data-parallel group of " + std::string{"dp"}) != std::string::npos);
  CHECK(after.error.find("-1 has stopped") != std::string::npos);
  // A group needs MoE experts for each member.
  std::string why;
  CHECK(make_peer_group({"a"}, cfg, {1024}, {}, &why).empty());
  CHECK(why == "a data-parallel group needs at least 2 members");
  cpu_executor_config both;
  both.peers = dp.members[0];
  both.experts = std::make_shared<expert_group>(nullptr, nullptr, 2);
  CHECK(both.validate() == "an executor is in an expert group or a data-parallel group, not both");
}

TEST_CASE("live EPLB in a data-parallel group: on a skewed routing load the busiest member's served copies drop toward "
          "the mean, experts move between members within their slots, and tokens stay those of EP 1") {
  const auto cfg = deepseek_tiny_config(true);
  auto skewed = make_seeded_weights(cfg, 21);
  for (auto& l : skewed.layers)  // experts 0 and 1 turn hot; both live on member 0 at start
    if (!l.router_bias.empty()) l.router_bias[0] += 1.0f, l.router_bias[1] += 1.0f;
  auto w = std::make_shared<const model_weights>(std::move(skewed));
  auto alone = make_cpu_executor(cfg, w, {});
  std::vector<colocated_generation> ref(2);
  for (int r = 0; r < 2; ++r) ref[r] = generate_colocated(*alone, prompt_of(r, 40), 8, 16, {}, true);
  double before = 0, after = 0;
  for (bool eplb : {false, true}) {
    CAPTURE(eplb);
    // 4 members, 4 slots each (8 experts): a plan every 16 MoE rounds (8 steps).
    // With EPLB, dual-batch overlap too: plans run on the first channel between steps.
    dp_fixture dp{"loopback", 4, cfg, w, eplb ? live_eplb_config{4, 16} : live_eplb_config{}, eplb};
    auto run = [&] {
      std::vector<colocated_generation> got(2);
      std::thread t0([&] { got[0] = generate_colocated(*dp.execs[0], prompt_of(0, 40), 8, 16, {}, true); });
      std::thread t1([&] { got[1] = generate_colocated(*dp.execs[1], prompt_of(1, 40), 8, 16, {}, true); });
      t0.join();
      t1.join();
      for (int r = 0; r < 2; ++r) {
        REQUIRE_MESSAGE(got[r].error.empty(), got[r].error);
        CHECK(got[r].tokens == ref[r].tokens);
        CHECK(test::same_bits(got[r].step_logits, ref[r].step_logits));
      }
    };
    run();  // EPLB's first windows
    for (auto& m : dp.members) m->take_copies_served();
    run();
    for (auto& e : dp.execs) e->stop();  // no member is still in a step while the counters are read
    std::vector<double> served;
    for (auto& m : dp.members) served.push_back(static_cast<double>(m->take_copies_served()));
    (eplb ? after : before) = policies::imbalance(served);
    MESSAGE(std::string{eplb ? "EPLB on" : "EPLB off"} << ": copies served per member " << served[0] << " " << served[1] << " "
                                            << served[2] << " " << served[3] << ", plans " << dp.members[0]->plans());
    uint64_t installed = 0, evicted = 0;
    for (auto& m : dp.members) {
      installed += m->bytes_installed();
      evicted += m->experts_evicted();
      for (uint32_t l = 1; l < cfg.num_hidden_layers; ++l) {
        const auto held = m->held(l);
        CHECK((held.size() >= 1 && held.size() <= 4));
        if (!eplb) CHECK(held == std::vector<uint32_t>{2 * m->rank(), 2 * m->rank() + 1});
      }
    }
    CHECK((installed > 0) == eplb);
    CHECK((evicted > 0) == eplb);
    if (eplb) MESSAGE("EPLB moved " << installed << " bytes of expert weights between members and dropped " << evicted << " experts");
  }
  CHECK(before > 3.0);
  CHECK(after < 1.5);
}

namespace {

/// A group of two built as two processes build it: each half alone, meeting by a rendezvous
/// like the head directory's (each posts its key, both get both).
struct two_halves {
  std::vector<std::string> names;
  std::vector<std::shared_ptr<expert_peers>> half0, half1;
  std::string why0, why1;
};

two_halves build_halves(const model_config& cfg, const std::string& backend) {
  static auto fabric = transport::make_loopback_fabric();
  static int serial = 0;
  two_halves h;
  h.names = {"far" + std::to_string(++serial) + ".0", "far" + std::to_string(serial) + ".1"};
  std::mutex m;
  std::condition_variable cv;
  std::vector<transport::region_key> keys(2);
  int posted = 0;
  auto meet = [&](uint32_t, const std::vector<std::pair<uint32_t, transport::region_key>>& mine,
                  std::vector<transport::region_key>* all, std::string*) {
    std::unique_lock<std::mutex> lock{m};
    for (const auto& [r, key] : mine) keys[r] = key;
    posted += static_cast<int>(mine.size());
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds{30}, [&] { return posted == 2; });
    *all = keys;
    return posted == 2;
  };
  auto make_t = [&](const std::string& name, std::string* err) -> std::unique_ptr<transport::transport> {
    if (backend == "ucx") return transport::make_ucx_transport({name}, err);
    return transport::make_loopback_transport(fabric, name);
  };
  const peer_group_config gc{expert_slot_bytes(cfg, 64)};
  std::thread other([&] { h.half1 = make_peer_group(h.names, {1}, cfg, gc, make_t, meet, &h.why1); });
  h.half0 = make_peer_group(h.names, {0}, cfg, gc, make_t, meet, &h.why0);
  other.join();
  return h;
}

}  // namespace

TEST_CASE("data-parallel attention across processes: two halves of a group, built apart and met by a rendezvous, "
          "answer as EP 1; when one half stops, the other learns it at once through the abort word, names it, and "
          "reports a standing failure") {
  const auto cfg = deepseek_tiny_config(true);
  auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 9));
  auto alone = make_cpu_executor(cfg, w, {});
  const auto ref = generate_colocated(*alone, prompt_of(5, 30), 6, 16, {}, true);
  REQUIRE(ref.error.empty());
  for (const std::string backend : {"loopback", "ucx"}) {
    CAPTURE(backend);
    auto [names, half0, half1, why0, why1] = build_halves(cfg, backend);
    REQUIRE_MESSAGE(half0.size() == 1, why0);
    REQUIRE_MESSAGE(half1.size() == 1, why1);
    cpu_executor_config e0, e1;
    e0.peers = half0[0];
    e1.peers = half1[0];
    auto x0 = make_cpu_executor(cfg, w, e0), x1 = make_cpu_executor(cfg, w, e1);
    const auto got = generate_colocated(*x0, prompt_of(5, 30), 6, 16, {}, true);  // half 1 idles and serves
    REQUIRE_MESSAGE(got.error.empty(), got.error);
    CHECK(got.tokens == ref.tokens);
    CHECK(test::same_bits(got.step_logits, ref.step_logits));
    CHECK(x0->standing_failure().empty());
    x1->stop();  // the other "process" leaves: it puts its abort word into half 0's region
    CHECK(x1->standing_failure() == "data-parallel group: member " + names[1] + " has stopped");
    CHECK(x0->standing_failure() == "data-parallel group of " + names[0] + ": member " + names[1] + " has left the group");
    const auto after = generate_colocated(*x0, prompt_of(5, 30), 2, 16, {}, true);
    CHECK(after.error.find("member " + names[1] + " has left the group") != std::string::npos);
    x0->stop();
  }
}

TEST_CASE("data-parallel attention across processes: a member whose process died without a word is lost when the "
          "head says so; the others' steps then fail at once, naming it, and their ranks see a standing failure") {
  const auto cfg = deepseek_tiny_config(true);
  auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 9));
  auto [names, half0, half1, why0, why1] = build_halves(cfg, "loopback");
  REQUIRE_MESSAGE(half0.size() == 1, why0);
  REQUIRE_MESSAGE(half1.size() == 1, why1);
  // Half 1 never gets an executor: like a killed process, it neither joins steps nor leaves an
  // abort word. Until the head's notice, half 0 sees nothing wrong.
  cpu_executor_config e0;
  e0.peers = half0[0];
  auto x0 = make_cpu_executor(cfg, w, e0);
  std::atomic<bool> told{false};
  x0->on_health_change([&] { told = true; });
  CHECK(x0->standing_failure().empty());
  half0[0]->peer_lost(1, "node far-b went down");
  const std::string want = "data-parallel group of " + names[0] + ": member " + names[1] + " is lost: node far-b went down";
  CHECK(x0->standing_failure() == want);
  for (int i = 0; i < 500 && !told; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  CHECK(told.load());  // the idle hook told the rank, before any request tried it
  const auto after = generate_colocated(*x0, prompt_of(5, 30), 2, 16, {}, true);
  CHECK(after.error.find(want) != std::string::npos);
  x0->stop();
}

TEST_CASE("data-parallel attention: a broken group re-forms in place; the surviving executor rejoins it between jobs, "
          "its standing failure clears and its rank is told, and the re-formed group answers as EP 1") {
  const auto cfg = deepseek_tiny_config(true);
  auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 13));
  auto alone = make_cpu_executor(cfg, w, {});
  const auto ref = generate_colocated(*alone, prompt_of(7, 30), 6, 16, {}, true);
  REQUIRE(ref.error.empty());
  std::string why;
  CHECK_FALSE(alone->rejoin_group(nullptr, &why));
  CHECK(why == "rejoin: no group given");

  dp_fixture dp{"loopback", 2, cfg, w, {5, 4}};  // with live EPLB: the new group plans from scratch
  std::atomic<int> told{0};
  dp.execs[0]->on_health_change([&] { ++told; });
  const auto before = generate_colocated(*dp.execs[0], prompt_of(7, 30), 6, 16, {}, true);
  REQUIRE_MESSAGE(before.error.empty(), before.error);
  CHECK(before.tokens == ref.tokens);

  // Build the replacement first: a group that has not broken is not left.
  auto make_t = [](const std::string& name, std::string*) -> std::unique_ptr<transport::transport> {
    static auto fabric = transport::make_loopback_fabric();
    return transport::make_loopback_transport(fabric, name);
  };
  const peer_group_config gc{expert_slot_bytes(cfg, 64)};
  auto next = make_peer_group({"re-0", "re-1"}, cfg, gc, make_t, &why);
  REQUIRE_MESSAGE(next.size() == 2, why);
  CHECK_FALSE(dp.execs[0]->rejoin_group(next[0], &why));
  CHECK(why == "its data-parallel group has not broken; nothing to rejoin");

  // Member 1's process goes (here: its executor stops, leaving its abort word).
  dp.execs[1]->stop();
  for (int i = 0; i < 500 && told.load() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  CHECK(told.load() == 1);
  CHECK_FALSE(dp.execs[0]->standing_failure().empty());

  // The group met afresh: the survivor rejoins, the restarted member comes with a new executor.
  for (auto& m : next) REQUIRE_MESSAGE(m->enable_eplb({5, 4}, cfg.moe.n_routed_experts, &why), why);
  // The executors' shared weights keep no routed experts (as in `baton node`): the new members'
  // stores must come filled, from the model loaded again.
  CHECK_FALSE(dp.execs[0]->rejoin_group(next[0], &why));
  CHECK(why == "the re-formed group's member holds no experts, and this executor's weights have none to give it");
  for (auto& m : next) m->hold_block(cfg, *w);
  REQUIRE_MESSAGE(dp.execs[0]->rejoin_group(next[0], &why), why);
  cpu_executor_config ec;
  ec.peers = next[1];
  auto restarted = make_cpu_executor(cfg, dp.attention_only, ec);
  CHECK_FALSE(dp.execs[0]->rejoin_group(next[0], &why));  // unless it has switched already
  for (int i = 0; i < 500 && (dp.execs[0]->rejoin_pending() || told.load() < 2); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  CHECK_FALSE(dp.execs[0]->rejoin_pending());
  CHECK(dp.execs[0]->standing_failure().empty());
  CHECK(told.load() == 2);  // the rank heard that it may take work again

  colocated_generation theirs;
  std::thread peer([&] { theirs = generate_colocated(*restarted, prompt_of(8, 20), 6, 16, {}, true); });
  const auto after = generate_colocated(*dp.execs[0], prompt_of(7, 30), 6, 16, {}, true);
  peer.join();
  REQUIRE_MESSAGE(after.error.empty(), after.error);
  CHECK(after.tokens == ref.tokens);
  CHECK(test::same_bits(after.step_logits, ref.step_logits));
  REQUIRE_MESSAGE(theirs.error.empty(), theirs.error);
  CHECK(theirs.tokens == generate_colocated(*alone, prompt_of(8, 20), 6, 16, {}, true).tokens);
  CHECK(next[0]->plans() > 0);  // live EPLB ran in the re-formed group
  restarted->stop();
  dp.execs[1]->stop();
  CHECK_FALSE(dp.execs[1]->rejoin_group(next[1], &why));
  CHECK(why == "this executor has stopped");
}

TEST_CASE("data-parallel attention: a healthy group that must re-form (a member its shrunk group lacks came back) is "
          "retired: every member in the process steps aside at once, saying why, and the survivors rejoin a group of "
          "another size, which answers as EP 1") {
  const auto cfg = deepseek_tiny_config(true);
  auto w = std::make_shared<const model_weights>(make_seeded_weights(cfg, 17));
  auto alone = make_cpu_executor(cfg, w, {});
  const auto ref = generate_colocated(*alone, prompt_of(9, 30), 6, 16, {}, true);
  REQUIRE(ref.error.empty());
  dp_fixture dp{"loopback", 3, cfg, w};  // the shrunk group of three members
  const auto before = generate_colocated(*dp.execs[0], prompt_of(9, 30), 6, 16, {}, true);
  REQUIRE_MESSAGE(before.error.empty(), before.error);
  CHECK(before.tokens == ref.tokens);
  dp.members[0]->retire("member 3 came back");  // the others in the process see it at once
  CHECK(dp.execs[1]->standing_failure().find("member " + std::string{"dp"}) != std::string::npos);
  for (auto& m : dp.members) m->retire("member 3 came back");  // as a node does for each of its members
  for (auto& x : dp.execs) CHECK(x->standing_failure().find("re-forms: member 3 came back") != std::string::npos);
  const auto refused = generate_colocated(*dp.execs[1], prompt_of(9, 30), 2, 16, {}, true);
  CHECK(refused.error.find("re-forms: member 3 came back") != std::string::npos);
  // The survivors of a group of three meet again as four: each serves a smaller block.
  static auto fabric = transport::make_loopback_fabric();
  auto make_t = [](const std::string& name, std::string*) -> std::unique_ptr<transport::transport> {
    return transport::make_loopback_transport(fabric, name);
  };
  std::string why;
  auto next = make_peer_group({"g-0", "g-1", "g-2", "g-3"}, cfg, {expert_slot_bytes(cfg, 64)}, make_t, &why);
  REQUIRE_MESSAGE(next.size() == 4, why);
  for (auto& m : next) m->hold_block(cfg, *w);
  CHECK(next[0]->held(cfg.moe.first_k_dense_replace).size() == cfg.moe.n_routed_experts / 4);
  for (uint32_t i = 0; i < 3; ++i) REQUIRE_MESSAGE(dp.execs[i]->rejoin_group(next[i], &why), why);
  cpu_executor_config ec;
  ec.peers = next[3];
  auto returned = make_cpu_executor(cfg, dp.attention_only, ec);
  for (int i = 0; i < 500; ++i) {
    bool pending = false;
    for (auto& x : dp.execs) pending = pending || x->rejoin_pending();
    if (!pending) break;
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  for (auto& x : dp.execs) CHECK(x->standing_failure().empty());
  const auto after = generate_colocated(*dp.execs[2], prompt_of(9, 30), 6, 16, {}, true);
  REQUIRE_MESSAGE(after.error.empty(), after.error);
  CHECK(after.tokens == ref.tokens);
  CHECK(test::same_bits(after.step_logits, ref.step_logits));
  returned->stop();
  for (auto& x : dp.execs) x->stop();
}

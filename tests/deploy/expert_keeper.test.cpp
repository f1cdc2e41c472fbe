// deploy::expert_group_keeper mending a data-parallel group of this process (`baton local
// --dp-attention`). Its other form, new shard processes for an engine whose shard died, needs
// the `baton` executable: tests/deploy/expert_shard_restart_e2e.sh.

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "deploy/expert_processes.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "tests/test_util.hpp"

using namespace baton;

namespace {

/// A data-parallel group of two in this process (`names`) and an executor for each member.
std::pair<std::vector<std::shared_ptr<gpu::expert_peers>>, std::vector<std::shared_ptr<gpu::executor>>> group_of_two(
    const gpu::model_config& cfg, std::shared_ptr<const gpu::model_weights> w, const std::vector<std::string>& names) {
  const gpu::peer_group_config pg{.slot_bytes = gpu::expert_slot_bytes(cfg, 64)};
  std::string why;
  auto members = deploy::make_dp_attention_groups(names, 2, cfg, pg, {}, "put", &why);
  REQUIRE_MESSAGE(members.size() == 2, why);
  std::vector<std::shared_ptr<gpu::executor>> execs;
  for (auto& m : members) {
    gpu::cpu_executor_config ec;
    ec.peers = m;
    execs.push_back(gpu::make_cpu_executor(cfg, w, ec));
  }
  return {members, execs};
}

}  // namespace

TEST_CASE("expert group keeper: a data-parallel group of this process that broke is made afresh in place, both "
          "members rejoin it between jobs, and each answers as EP 1 again") {
  const auto cfg = gpu::deepseek_tiny_config(true);
  auto w = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg, 33));
  std::vector<int32_t> prompt;
  for (int i = 0; i < 20; ++i) prompt.push_back((i * 53 + 7) % 256);
  const auto ref = gpu::generate_colocated(*gpu::make_cpu_executor(cfg, w, {}), prompt, 4, 16, {}, true);
  REQUIRE(ref.error.empty());
  const std::vector<std::string> names{"keep-0", "keep-1"};
  const gpu::peer_group_config pg{.slot_bytes = gpu::expert_slot_bytes(cfg, 64)};
  auto remake = [&](std::string* why) { return deploy::make_dp_attention_groups(names, 2, cfg, pg, {}, "put", why); };
  auto [members, execs] = group_of_two(cfg, w, names);
  auto answer = [&](size_t i) {
    const auto got = gpu::generate_colocated(*execs[i], prompt, 4, 16, {}, true);
    REQUIRE_MESSAGE(got.error.empty(), got.error);
    CHECK(got.tokens == ref.tokens);
    CHECK(test::same_bits(got.step_logits, ref.step_logits));
  };
  {
    deploy::expert_group_keeper keeper{"keeper test"};
    keeper.add_dp_member("dp0", 1, 2, execs[1], remake);  // in any order
    answer(0);  // the group is looked at only once both members are added: nothing to do yet
    keeper.add_dp_member("dp0", 0, 2, execs[0], remake);
    answer(1);  // member 0 idles and joins member 1's steps
    CHECK(keeper.repairs() == 0);

    members[0]->fault_break_for_test("injected by the test");
    CHECK_FALSE(execs[1]->standing_failure().empty());
    bool mended = false;
    for (int i = 0; i < 1000 && !mended; ++i) {
      mended = keeper.repairs() == 1 && execs[0]->standing_failure().empty() && execs[1]->standing_failure().empty();
      if (!mended) std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
    REQUIRE(mended);
    members.clear();  // the old members go with their executors' last references
    answer(0);
    answer(1);
    CHECK(keeper.repairs() == 1);
  }
  for (auto& e : execs) e->stop();
}

TEST_CASE("expert group keeper: a group it cannot mend is tried again with a growing pause, and after the given "
          "number of failures in a row it gives up on it once, naming the group and the last failure") {
  const auto cfg = gpu::deepseek_tiny_config(true);
  auto w = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg, 35));
  auto [members, execs] = group_of_two(cfg, w, {"lost-0", "lost-1"});
  std::atomic<int> tries{0}, given_up{0};
  std::mutex m;
  std::string label, last;
  {
    deploy::expert_keeper_config kc;
    kc.give_up_after = 3;
    kc.first_backoff = std::chrono::milliseconds{10};
    kc.give_up = [&](const std::string& l, const std::string& y) {
      std::lock_guard<std::mutex> lock{m};
      label = l, last = y;
      ++given_up;
    };
    deploy::expert_group_keeper keeper{"keeper test", kc};
    auto remake = [&](std::string* y) {
      *y = "try " + std::to_string(++tries) + ": no transport today";
      return std::vector<std::shared_ptr<gpu::expert_peers>>{};
    };
    keeper.add_dp_member("dp7", 0, 2, execs[0], remake);
    keeper.add_dp_member("dp7", 1, 2, execs[1], remake);
    members[0]->fault_break_for_test("injected by the test");
    for (int i = 0; i < 500 && given_up.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
    REQUIRE(given_up.load() == 1);
    std::this_thread::sleep_for(std::chrono::milliseconds{400});  // 4 looks more: nothing is tried again
    CHECK(tries.load() == 3);
    CHECK(given_up.load() == 1);
    CHECK(keeper.repairs() == 0);
    std::lock_guard<std::mutex> lock{m};
    CHECK(label == "data-parallel group dp7");
    CHECK(last == "try 3: no transport today");
  }
  for (auto& e : execs) CHECK_FALSE(e->standing_failure().empty());  // still aside: nobody mended it
  for (auto& e : execs) e->stop();
}

TEST_CASE("expert group keeper: a group that breaks again right after each repair counts those repairs as failed, "
          "pauses between them and gives up; one that stays whole past the settle time starts its count afresh") {
  const auto cfg = gpu::deepseek_tiny_config(true);
  auto w = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg, 37));
  const std::vector<std::string> names{"flap-0", "flap-1"};
  for (const bool settles : {false, true}) {
    CAPTURE(settles);
    auto [members, execs] = group_of_two(cfg, w, names);
    const gpu::peer_group_config pg{.slot_bytes = gpu::expert_slot_bytes(cfg, 64)};
    std::mutex m;
    std::vector<std::shared_ptr<gpu::expert_peers>> latest = members;
    std::atomic<int> given_up{0};
    std::string last;
    {
      deploy::expert_keeper_config kc;
      kc.give_up_after = 3;
      kc.first_backoff = std::chrono::milliseconds{10};
      // Settled: a group is whole for about 100 ms before the test breaks it again.
      kc.settle = settles ? std::chrono::milliseconds{50} : std::chrono::milliseconds{60'000};
      kc.give_up = [&](const std::string&, const std::string& y) {
        std::lock_guard<std::mutex> lock{m};
        last = y;
        ++given_up;
      };
      deploy::expert_group_keeper keeper{"keeper test", kc};
      auto remake = [&](std::string* why) {
        auto made = deploy::make_dp_attention_groups(names, 2, cfg, pg, {}, "put", why);
        std::lock_guard<std::mutex> lock{m};
        latest = made;
        return made;
      };
      keeper.add_dp_member("dp5", 0, 2, execs[0], remake);
      keeper.add_dp_member("dp5", 1, 2, execs[1], remake);
      // Break the group, and again after each repair, five times or until the keeper gives up.
      uint64_t breaks = 0;
      for (int i = 0; i < 1500 && breaks < 5 && given_up.load() == 0; ++i) {
        const bool whole = execs[0]->standing_failure().empty() && execs[1]->standing_failure().empty();
        if (whole && keeper.repairs() == breaks) {
          if (settles) std::this_thread::sleep_for(std::chrono::milliseconds{100});
          std::lock_guard<std::mutex> lock{m};
          latest[0]->fault_break_for_test("injected by the test, break " + std::to_string(++breaks));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds{5});
      }
      if (settles) {
        CHECK(given_up.load() == 0);
        CHECK(breaks == 5);
        for (int i = 0; i < 500 && keeper.repairs() < 5; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
        CHECK(keeper.repairs() == 5);
      } else {
        // Three repairs worked; the group broke at once after each, so the third break gives up.
        REQUIRE(given_up.load() == 1);
        CHECK(keeper.repairs() == 3);
        CHECK(breaks == 4);
        std::lock_guard<std::mutex> lock{m};
        CHECK(last.find("broke again") != std::string::npos);
        CHECK(last.find("injected by the test, break 4") != std::string::npos);
      }
    }
    latest.clear();
    members.clear();
    for (auto& e : execs) e->stop();
  }
}

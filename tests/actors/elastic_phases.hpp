#pragma once

// The load of the elastic P/D tests, in-process (tests/actors/elastic.test.cpp) and with the
// elastic ranks in a node process (tests/deploy/cross_process.test.cpp): a prefill-heavy phase
// that must move the decode-side elastic instance to prefill, then a decode-heavy phase that must
// move one back; every checked answer must equal the prompt run alone, and nothing may be
// recomputed.

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"

namespace baton::test {

/// Targets that make the load phases unambiguous: any queued prompt is far over a 1 ms TTFT
/// target; decode pressure comes from KV alone (steps never near a 1,000 s TBT).
inline void eager_elastic_planner(elastic_controller_config* c) {
  auto& p = c->planner;
  p.ttft_target_ms = 1;
  p.tbt_target_ms = 1e6;
  p.kv_full = 1.0;
  p.smooth_s = 0;
  // A queue must stay hot for 0.25 s: the four long generations' own short prefills pass well
  // inside it, so the first move comes from phase 1's 40 prompts, after those generations decode.
  p.hold_s = 0.25;
  p.cooldown_s = 0.3;
  p.dwell_s = 1;
  c->interval_ms = 20;
}

inline std::vector<role_change> role_changes(caf::scoped_actor& self, const elastic_controller_actor& c) {
  std::vector<role_change> out;
  self->request(c, std::chrono::seconds{5}, events_atom::value)
      .receive([&](std::vector<role_change>& l) { out = std::move(l); }, [](caf::error&) {});
  return out;
}

inline size_t done_changes(const std::vector<role_change>& log) {
  return static_cast<size_t>(std::count_if(log.begin(), log.end(), [](auto& c) { return c.state == "done"; }));
}

struct elastic_phases_result {
  std::vector<completion> done;
  std::vector<role_change> log;
  uint32_t migrations = 0;  ///< decode sequences moved with their KV
};

/// Runs both phases through `router` against a cluster with KV pages for 16K tokens per rank and
/// chunks of 32 (cfg), checks the moves (`moving` goes decode -> prefill first, then a rank goes
/// back), the tokens and that no request failed over; returns what happened.
inline elastic_phases_result run_elastic_phases(caf::actor_system& sys, caf::scoped_actor& self, const router_actor& router,
                                                const elastic_controller_actor& controller,
                                                const local_cluster_config& cfg, const std::string& moving) {
  elastic_phases_result out;
  auto send = [&](std::string prompt, int32_t max_tokens) {
    generate_request req;
    req.prompt = std::move(prompt);
    req.max_tokens = max_tokens;
    req.ignore_eos = true;
    return self->request(router, std::chrono::seconds{120}, generate_atom::value, std::move(req));
  };
  // Decode ranks' loads as the router knows them (sequences + leases of each).
  auto decode_running = [&](const std::string& only) {
    uint32_t n = 0;
    self->request(router, std::chrono::seconds{5}, stats_atom::value)
        .receive(
            [&](cluster_stats& cs) {
              for (const auto& d : cs.decode)
                if (only.empty() || d.name == only) n += d.num_running;
            },
            [](caf::error&) {});
    return n;
  };
  // Phase 1, prefill-heavy: 4 long generations, some of which must be on `moving` when it moves
  // (so that its drain hands them over with their KV), then 40 prompts of 100 tokens with one
  // token each (answered by prefill ranks alone: no decode KV). The generations go one at a time,
  // each once the last is placed, so that placement sees every earlier one and spreads them over
  // the decode ranks; they are long enough (~1 ms a step here) to outlast the 40 prompts' queue,
  // which moves `moving` once it has been hot for the planner's hold time.
  std::vector<std::string> prompts;
  std::vector<decltype(send("", 1))> handles;
  for (int i = 0; i < 4; ++i) {
    const auto before = decode_running("");
    prompts.push_back("a long story, part " + std::to_string(i));
    handles.push_back(send(prompts.back(), 1000));
    for (int k = 0; k < 500 && decode_running("") <= before; ++k) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  REQUIRE_MESSAGE(decode_running(moving) > 0, "no long generation was placed on " << moving);
  for (int i = 0; i < 40; ++i) {
    std::string s;
    for (int k = 0; k < 99; ++k) s.push_back(static_cast<char>('a' + (i * 7 + k * 3) % 26));
    prompts.push_back(s);
    handles.push_back(send(s, 1));
  }
  out.done.resize(handles.size());
  for (size_t i = 0; i < handles.size(); ++i)
    handles[i].receive([&](completion& c) { out.done[i] = std::move(c); },
                       [&](caf::error& e) { FAIL("phase 1 request " << i << ": " << sys.render(e)); });
  auto log = role_changes(self, controller);
  for (int i = 0; i < 500 && done_changes(log) < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
    log = role_changes(self, controller);
  }
  REQUIRE(done_changes(log) >= 1);
  CHECK(log[0].rank == moving);
  CHECK(log[0].from == "decode");
  CHECK(log[0].to == "prefill");
  CHECK_MESSAGE(log[0].why.find("prefill pool hot, decode pool cold") == 0, log[0].why);
  // Phase 2, decode-heavy: 10 short prompts with 1,400 tokens each reserve 85% of the remaining
  // fixed decode rank's KV.
  const size_t phase2 = handles.size();
  for (int i = 0; i < 10; ++i) {
    prompts.push_back("decode heavy " + std::to_string(i));
    handles.push_back(send(prompts.back(), 1400));
  }
  out.done.resize(handles.size());
  for (size_t i = phase2; i < handles.size(); ++i)
    handles[i].receive([&](completion& c) { out.done[i] = std::move(c); },
                       [&](caf::error& e) { FAIL("phase 2 request " << i << ": " << sys.render(e)); });
  out.log = role_changes(self, controller);
  for (const auto& c : out.log)
    MESSAGE(c.at_s << " s: " << c.rank << " " << c.from << " -> " << c.to << " (" << c.state << ", " << c.drain_s << " s): " << c.why);
  REQUIRE(done_changes(out.log) >= 2);
  const auto& back = *std::find_if(out.log.begin() + 1, out.log.end(), [](auto& c) { return c.state == "done"; });
  CHECK(back.from == "prefill");
  CHECK(back.to == "decode");
  CHECK_MESSAGE(back.why.find("decode pool hot, prefill pool cold") == 0, back.why);
  // Nothing lost or duplicated: every request answered once; the tokens are those of the prompt
  // run alone.
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  const gpu::byte_tokenizer tok{cfg.model.bos_token_id, cfg.model.eos_token_id};
  for (size_t i : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{17}, size_t{43}, handles.size() - 1}) {
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    auto ref = gpu::generate_colocated(*exec, tok.encode(prompts[i]), out.done[i].tokens.size(), 32, {}, true);
    CHECK_MESSAGE(out.done[i].tokens == ref.tokens, "request " << i);
  }
  for (size_t i = phase2; i < handles.size(); ++i) CHECK(out.done[i].tokens.size() == 1400);
  // No request was recomputed: a decode rank that left decode handed its sequences over with
  // their KV (migrate_on_drain).
  for (const auto& c : out.done) {
    CHECK(c.failovers == 0);
    out.migrations += c.migrations;
  }
  MESSAGE(out.migrations << " decode sequences moved with their KV during role changes");
  CHECK(out.migrations > 0);
  return out;
}

}  // namespace baton::test

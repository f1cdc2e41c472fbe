#include <doctest/doctest.h>

#include <functional>

#include "actors/block_index.hpp"
#include "actors/local_cluster.hpp"
#include "policies/cost_model.hpp"
#include "sims/modelled_executor.hpp"
#include "tests/sims/sim_fixture.hpp"

using namespace baton;

namespace {

sims::modelled_executor_config model_times() {
  sims::modelled_executor_config m;
  m.prefill = {0.01, 0.002, 5.0};   // alpha, beta, gamma in microseconds
  m.decode = {800.0, 10.0, 0.1};    // base, per sequence, per context token
  m.num_kv_pages = 64;
  return m;
}

/// The modelled time of a prompt of n tokens in chunks of `chunk`, summed independently of the actors.
int64_t prefill_ns(const local_cluster_config& cfg, const sims::modelled_executor_config& times, uint32_t n,
                   uint32_t chunk) {
  int64_t ns = 0;
  for (uint32_t start = 0; start < n; start += chunk) {
    gpu::forward_job job{0, {gpu::forward_seq{0, std::vector<int32_t>(std::min(chunk, n - start), 1), start, {}, true}}};
    ns += sims::modelled_layer_ns(job, cfg.model, times) * cfg.model.num_hidden_layers;
  }
  return ns;
}

/// The modelled time of one decode step of a single sequence whose input sits at `pos`.
int64_t step_ns(const local_cluster_config& cfg, const sims::modelled_executor_config& times, uint32_t pos) {
  gpu::forward_job step{0, {gpu::forward_seq{0, {1}, pos, {}, true}}, gpu::forward_job::decode};
  return sims::modelled_layer_ns(step, cfg.model, times) * cfg.model.num_hidden_layers;
}

local_cluster_config one_by_one() {
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.prefill.chunk_tokens = 16;
  return cfg;
}

/// A cluster on modelled executors; `tweak` adjusts one rank's model (hangs, fewer pages).
local_cluster modelled_cluster(test::sim_system& s, const local_cluster_config& cfg,
                               const sims::modelled_executor_config& times,
                               std::function<void(const std::string&, sims::modelled_executor_config&)> tweak = {}) {
  return start_local_cluster(s.sys, cfg, [&cfg, times, tweak](const std::string& name) -> std::shared_ptr<gpu::executor> {
    auto t = times;
    if (tweak) tweak(name, t);
    return sims::make_modelled_executor(cfg.model, t);
  });
}

const char* forty_token_prompt = "forty bytes of prompt, in three chunks!";  // + <bos> = 40: 16 + 16 + 8

}  // namespace

TEST_CASE("sim seam: the production actors serve a request in virtual time and TTFT is the modelled times summed") {
  test::sim_system s;
  auto cfg = one_by_one();
  const auto times = model_times();
  auto cluster = modelled_cluster(s, cfg, times);
  test::sim_system::stopper stop{s, cluster};
  generate_request req;
  req.prompt = forty_token_prompt;
  req.max_tokens = 5;
  auto result = s.generate(cluster.router, req);
  REQUIRE(s.run_until_idle());
  REQUIRE(result->has_value());
  REQUIRE_MESSAGE(**result, s.sys.render((*result)->error()));
  const auto& c = ***result;
  REQUIRE(c.num_prompt_tokens == 40);
  CHECK(c.ttft_us == prefill_ns(cfg, times, 40, 16) / 1000);
  REQUIRE(c.tokens.size() == 5);
  REQUIRE(c.tbt_us.size() == 4);
  for (uint32_t i = 0; i < 4; ++i) CHECK(c.tbt_us[i] == step_ns(cfg, times, 40 + i) / 1000);
  CHECK(c.tokens[0] == 'a');
}

TEST_CASE("deadline: a decode rank that stops producing fails its request exactly one token deadline after the last token") {
  test::sim_system s;
  auto cfg = one_by_one();
  cfg.router.request.token_timeout_ms = 2000;
  cfg.router.request.max_attempts = 1;  // how the deadline surfaces (failover: below)
  const auto times = model_times();
  auto cluster = modelled_cluster(s, cfg, times, [](const std::string& name, auto& t) {
    if (name == "decode-0") t.hang_after_jobs = 2;  // two steps, then the device hangs
  });
  test::sim_system::stopper stop{s, cluster};
  generate_request req;
  req.prompt = forty_token_prompt;
  req.max_tokens = 10;
  const auto t0 = s.now();
  auto at = std::make_shared<test::sim_system::time_point>();
  auto result = s.generate(cluster.router, req, at);
  const auto last_token = std::chrono::nanoseconds{prefill_ns(cfg, times, 40, 16) + step_ns(cfg, times, 40) +
                                                   step_ns(cfg, times, 41)};
  const auto deadline = t0 + last_token + std::chrono::milliseconds{2000};
  s.run_until(deadline - std::chrono::nanoseconds{1});
  CHECK_MESSAGE(!result->has_value(), "answered before the deadline");
  s.run_until(deadline);
  REQUIRE(result->has_value());
  REQUIRE_FALSE(**result);
  const auto text = s.sys.render((*result)->error());
  CHECK_MESSAGE(text.find("deadline_exceeded") != std::string::npos, text);
  CHECK_MESSAGE(text.find("request 1, rank decode-0, stage decode: no token within 2000 ms after token 2") !=
                    std::string::npos,
                text);
  CHECK(*at == deadline);
}

TEST_CASE("failover: a decode rank that hangs mid-generation loses its request to another rank one token deadline "
          "later; the tokens equal an undisturbed run") {
  auto run = [](bool hang) {
    test::sim_system s;
    auto cfg = one_by_one();
    cfg.num_decode_ranks = 2;
    cfg.router.request.token_timeout_ms = 2000;
    const auto times = model_times();
    auto cluster = modelled_cluster(s, cfg, times, [hang](const std::string& name, auto& t) {
      if (hang && name == "decode-0") t.hang_after_jobs = 2;  // two steps, then the device hangs
    });
    test::sim_system::stopper stop{s, cluster};
    REQUIRE(s.run_until_idle());  // both decode ranks registered
    generate_request req;
    req.prompt = forty_token_prompt;
    req.max_tokens = 10;
    auto result = s.generate(cluster.router, req);
    s.run_until(s.now() + std::chrono::seconds{30});
    REQUIRE(result->has_value());
    REQUIRE_MESSAGE(**result, s.sys.render((*result)->error()));
    return ***result;
  };
  const auto calm = run(false);
  const auto hung = run(true);
  CHECK(calm.decode_rank == "decode-0");
  CHECK(calm.failovers == 0);
  CHECK(hung.tokens == calm.tokens);
  CHECK(hung.failovers == 1);
  CHECK_MESSAGE(hung.failover_why.find("rank decode-0, stage decode: no token within 2000 ms after token 2") !=
                    std::string::npos,
                hung.failover_why);
  CHECK(hung.decode_rank == "decode-1");
  REQUIRE(hung.tbt_us.size() == 9);
  CHECK(hung.tbt_us[2] > 2000000);  // the gap a client sees: one token deadline plus the re-prefill
  CHECK(hung.tbt_us[1] == calm.tbt_us[1]);
}

TEST_CASE("lease: an unfinished handoff's lease ends when it expires, not before; its pages, which the hung prefill "
          "rank might still write, return after the quarantine") {
  test::sim_system s;
  auto cfg = one_by_one();
  cfg.router.request.max_attempts = 1;  // how the expiry surfaces (failover: elsewhere)
  cfg.router.request.lease_ms = 1000;
  cfg.router.request.prefill_timeout_ms = 5000;
  cfg.decode.kv_quarantine_ms = 2500;
  const auto times = model_times();
  auto cluster = modelled_cluster(s, cfg, times, [](const std::string& name, auto& t) {
    if (name == "prefill-0") t.hang_after_jobs = 0;  // prefill never finishes: the handoff stalls
  });
  test::sim_system::stopper stop{s, cluster};
  const auto& decode = cluster.decode[0].handle;
  const uint32_t start_free = s.stats(decode).num_free_pages;
  REQUIRE(start_free == times.num_kv_pages);
  generate_request req;
  req.prompt = forty_token_prompt;
  req.max_tokens = 10;
  const auto t0 = s.now();
  auto at = std::make_shared<test::sim_system::time_point>();
  auto result = s.generate(cluster.router, req, at);
  s.run_until(t0 + std::chrono::milliseconds{999});
  CHECK(s.stats(decode).num_free_pages == start_free - 4);  // 50 tokens -> 4 pages of 16, still leased
  s.run_until(t0 + std::chrono::milliseconds{1000});
  CHECK(s.stats(decode).num_waiting == 0);                  // the lease expired
  // Its pages stay out of the pool: the prefill rank's chunk is still in its (hung) executor and
  // would put its layers there if it woke; nothing says it will not, so the quarantine runs out.
  CHECK(s.stats(decode).num_free_pages == start_free - 4);
  s.run_until(t0 + std::chrono::milliseconds{3499});
  CHECK(s.stats(decode).num_free_pages == start_free - 4);
  s.run_until(t0 + std::chrono::milliseconds{3500});
  CHECK(s.stats(decode).num_free_pages == start_free);
  // The request itself fails at its prefill deadline, naming rank and stage.
  s.run_until(t0 + std::chrono::milliseconds{4999});
  CHECK_FALSE(result->has_value());
  s.run_until(t0 + std::chrono::milliseconds{5000});
  REQUIRE(result->has_value());
  REQUIRE_FALSE(**result);
  const auto text = s.sys.render((*result)->error());
  CHECK_MESSAGE(text.find("request 1, rank prefill-0, stage prefill: no answer within 5000 ms") != std::string::npos,
                text);
  CHECK(*at == t0 + std::chrono::milliseconds{5000});
}

TEST_CASE("a prompt queued at a busy prefill rank longer than the lease still completes: the queue keeps its lease") {
  test::sim_system s;
  auto cfg = one_by_one();
  cfg.router.request.max_attempts = 1;  // it must complete on its first attempt, not by failover
  cfg.router.request.lease_ms = 1000;
  cfg.router.request.prefill_timeout_ms = 60000;
  auto times = model_times();
  times.prefill.gamma_us = 75000.0;  // 40 tokens take 3 s of modelled prefill
  auto cluster = modelled_cluster(s, cfg, times, [](const std::string& name, auto& t) {
    if (name == "prefill-0") t.num_kv_pages = 3;  // room for one 40-token prompt at a time
  });
  test::sim_system::stopper stop{s, cluster};
  generate_request req;
  req.prompt = forty_token_prompt;
  req.max_tokens = 3;
  auto first = s.generate(cluster.router, req);
  auto second = s.generate(cluster.router, req);  // waits ~3 s for the first one's pages
  REQUIRE(s.run_until_idle());
  REQUIRE(first->has_value());
  REQUIRE(second->has_value());
  CHECK_MESSAGE(**first, s.sys.render((*first)->error()));
  REQUIRE_MESSAGE(**second, s.sys.render((*second)->error()));
  CHECK((***second).prefill_queue_us >= 3000000);  // it really waited three leases long
  CHECK(s.stats(cluster.decode[0].handle).num_free_pages == times.num_kv_pages);
}

namespace {

/// The executor order of a prefill rank's chunks: (request, chunk) of each layer-0 completion.
std::vector<std::pair<uint64_t, uint32_t>> chunk_order(const std::vector<rank_event>& events) {
  std::vector<std::pair<uint64_t, uint32_t>> out;
  for (const auto& e : events)
    if (e.kind == "compute_done" && e.layer == 0) out.emplace_back(e.request_id, e.chunk);
  return out;
}

}  // namespace

TEST_CASE("time-budget chunking at the rank: chunks shrink along the prompt and TTFT is their modelled times summed") {
  test::sim_system s;
  auto cfg = one_by_one();
  auto times = model_times();
  times.prefill = {0.01, 0.05, 5.0};  // attention to the prefix matters: chunks must shrink
  cfg.prefill.cost = times.prefill;   // the rank plans with the model the executor follows
  cfg.prefill.step_budget_us = 1000;
  cfg.prefill.chunk_tokens = 1024;    // the budget, not the cap, sizes the chunks
  auto cluster = modelled_cluster(s, cfg, times);
  test::sim_system::stopper stop{s, cluster};
  generate_request req;
  req.prompt = std::string(400, 'x');  // + <bos> = 401 tokens
  req.max_tokens = 2;
  auto result = s.generate(cluster.router, req);
  REQUIRE(s.run_until_idle());
  REQUIRE(result->has_value());
  REQUIRE_MESSAGE(**result, s.sys.render((*result)->error()));
  const auto plan = policies::plan_chunks(cfg.prefill.cost, 0, 401, 1000, 1024);
  REQUIRE(plan.size() >= 3);
  int64_t ns = 0;
  uint32_t start = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    if (i + 1 < plan.size()) CHECK(plan[i] < (i ? plan[i - 1] : 100000u));
    CHECK(cfg.prefill.cost.prefill_us(plan[i], start) <= 1000.0);
    gpu::forward_job job{0, {gpu::forward_seq{0, std::vector<int32_t>(plan[i], 1), start, {}, true}}};
    ns += sims::modelled_layer_ns(job, cfg.model, times) * cfg.model.num_hidden_layers;
    start += plan[i];
  }
  CHECK((***result).ttft_us == ns / 1000);
  const auto order = chunk_order(s.events(cluster.prefill[0].handle));
  REQUIRE(order.size() == plan.size());
  for (uint32_t i = 0; i < order.size(); ++i) CHECK(order[i].second == i);
}

TEST_CASE("priority classes at a prefill rank: a batch prompt yields to interactive ones, but at most N chunks in a row") {
  for (const bool batch : {true, false}) {
    CAPTURE(batch);
    test::sim_system s;
    auto cfg = one_by_one();
    cfg.prefill.batch_max_bypass = 2;
    auto times = model_times();
    times.num_kv_pages = 128;
    auto cluster = modelled_cluster(s, cfg, times);
    test::sim_system::stopper stop{s, cluster};
    generate_request big;
    big.prompt = std::string(200, 'b');  // 201 tokens: 13 chunks of 16
    big.max_tokens = 2;
    big.priority = batch ? "batch" : "interactive";
    auto at_big = std::make_shared<test::sim_system::time_point>();
    auto big_result = s.generate(cluster.router, big, at_big);
    std::vector<test::sim_system::result_slot> small;
    std::vector<std::shared_ptr<test::sim_system::time_point>> at_small;
    for (int i = 0; i < 5; ++i) {
      generate_request r;
      r.prompt = std::string(20, static_cast<char>('k' + i));  // 2 chunks each
      r.max_tokens = 2;
      at_small.push_back(std::make_shared<test::sim_system::time_point>());
      small.push_back(s.generate(cluster.router, r, at_small.back()));
    }
    REQUIRE(s.run_until_idle());
    REQUIRE(big_result->has_value());
    REQUIRE(**big_result);
    const uint64_t big_id = (***big_result).request_id;
    int64_t small_ttft_max = 0;
    for (auto& r : small) {
      REQUIRE(r->has_value());
      REQUIRE(**r);
      small_ttft_max = std::max(small_ttft_max, (***r).ttft_us);
    }
    const auto order = chunk_order(s.events(cluster.prefill[0].handle));
    REQUIRE(order.size() == 13 + 5 * 2);
    if (batch) {
      // Every interactive prompt got its first token before the batch prompt did ...
      CHECK(small_ttft_max < (***big_result).ttft_us);
      // ... but while the batch prompt had chunks left, at most 2 interactive chunks ran in a row.
      size_t first_big = order.size(), last_big = 0;
      for (size_t i = 0; i < order.size(); ++i)
        if (order[i].first == big_id) first_big = std::min(first_big, i), last_big = i;
      int run = 0, longest = 0;
      for (size_t i = first_big; i <= last_big; ++i) {
        run = order[i].first == big_id ? 0 : run + 1;
        longest = std::max(longest, run);
      }
      CHECK(longest == 2);
    } else {
      // Negative control: all interactive, first come first served — the long prompt, which
      // arrived first, runs to its end and the short ones wait behind it.
      CHECK((***big_result).ttft_us < small_ttft_max);
    }
  }
}

TEST_CASE("store retention under virtual time: agent blocks expire after 3 days, chat blocks survive until 7") {
  test::sim_system s;
  block_index_config cfg;
  cfg.housekeeping_interval_ms = 3600 * 1000;  // hourly
  auto index = spawn_block_index(s.sys, cfg, {});
  auto commit = [&](uint64_t id, const char* cls) {
    block_commit c;
    c.block = {1, id, {0}};
    c.retention = cls;
    c.size_bytes = 4096;
    caf::anon_send(index, commit_atom::value, std::vector<block_commit>{c});
  };
  commit(10, "agent");
  commit(11, "agent");
  commit(20, "chat");
  commit(21, "chat");
  auto check = [&](std::vector<uint64_t> ids) {
    auto out = std::make_shared<size_t>(99);
    std::vector<block_ref> chain;
    for (auto id : ids) chain.push_back({1, id, {}});
    s.sys.spawn([=](caf::event_based_actor* self) {
      self->request(index, std::chrono::seconds{1}, check_atom::value, uint64_t{1}, chain)
          .then([=](std::vector<block_ref>& answer) {  // the leading run of blocks present
            size_t n = 0;
            while (n < answer.size() && !answer[n].servers.empty()) ++n;
            *out = n;
          });
    });
    s.sched.run();
    return *out;
  };
  s.sched.run();
  const auto t0 = s.now();
  CHECK(check({10, 11}) == 2);
  CHECK(check({20, 21}) == 2);
  s.run_until(t0 + std::chrono::hours{71});
  CHECK(check({10, 11}) == 2);  // not yet 3 days
  s.run_until(t0 + std::chrono::hours{72});
  CHECK(check({10, 11}) == 0);  // agent: gone at 3 days
  CHECK(check({20, 21}) == 2);  // chat: kept
  auto stats = std::make_shared<store_stats>();
  s.sys.spawn([=](caf::event_based_actor* self) {
    self->request(index, std::chrono::seconds{1}, stats_atom::value).then([=](store_stats& x) { *stats = x; });
  });
  s.sched.run();
  CHECK(stats->expired == 2);  // the background housekeeping removed them (and told the servers)
  CHECK(stats->blocks == 2);
  s.run_until(t0 + std::chrono::hours{168});
  CHECK(check({20, 21}) == 0);  // chat: gone at 7 days
  caf::anon_send_exit(index, caf::exit_reason::user_shutdown);
  s.run_until_idle();
}

TEST_CASE("a request that lets go mid-prefill: its prefill rank posts no more of its KV, and the decode rank keeps "
          "the lease's pages from other requests until that rank says that nothing more of it will land") {
  test::sim_system s;
  auto cfg = one_by_one();
  cfg.router.request.max_attempts = 1;
  cfg.router.request.lease_ms = 10000;
  cfg.router.request.prefill_timeout_ms = 1500;  // it gives up during the second of three chunks
  auto times = model_times();
  times.prefill.gamma_us = 75000.0;  // 40 tokens take 3 s of modelled prefill: 1.2 s per 16-token chunk
  auto cluster = modelled_cluster(s, cfg, times);
  test::sim_system::stopper stop{s, cluster};
  const auto& decode = cluster.decode[0].handle;
  const uint32_t start_free = s.stats(decode).num_free_pages;
  generate_request req;
  req.prompt = forty_token_prompt;
  req.max_tokens = 10;
  const auto t0 = s.now();
  auto result = s.generate(cluster.router, req);
  s.run_until(t0 + std::chrono::milliseconds{1500});
  REQUIRE(result->has_value());
  REQUIRE_FALSE(**result);  // the request timed out and let go of its lease
  CHECK(s.stats(decode).num_waiting == 0);
  // The chunks already in the executor still compute, and a put of theirs would land in the
  // lease's pages: they stay out of the pool (given to the next request, its KV could be
  // overwritten).
  CHECK(s.stats(decode).num_free_pages == start_free - 4);
  s.run_until(t0 + std::chrono::milliseconds{2900});
  CHECK(s.stats(decode).num_free_pages == start_free - 4);
  // Once they are done (3 s) and nothing of the prompt is in flight, the prefill rank says so:
  // the pages come back, long before the quarantine's limit (60 s).
  s.run_until(t0 + std::chrono::milliseconds{3500});
  CHECK(s.stats(decode).num_free_pages == start_free);
  std::vector<std::string> decode_kinds;
  for (const auto& e : s.events(decode))
    if (e.kind.rfind("quarantine", 0) == 0) decode_kinds.push_back(e.kind);
  CHECK(decode_kinds == std::vector<std::string>{"quarantine", "quarantine_end"});
  // After the cancel the prefill rank posted nothing: only the first chunk's layers were sent.
  uint32_t posted = 0;
  for (const auto& e : s.events(cluster.prefill[0].handle))
    if (e.kind == "send_posted") {
      CHECK(e.chunk == 0);
      ++posted;
    }
  CHECK(posted == cfg.model.num_hidden_layers);
}

TEST_CASE("two prompts started together at a prefill rank: the one that waits its turn behind the other's chunks "
          "longer than the lease keeps its lease, and both complete on their first attempt") {
  test::sim_system s;
  auto cfg = one_by_one();
  cfg.router.request.max_attempts = 1;
  cfg.router.request.lease_ms = 1000;
  cfg.router.request.prefill_timeout_ms = 60000;
  auto times = model_times();
  times.prefill.gamma_us = 75000.0;  // 3 s per 40-token prompt: the second one's turn comes after 3 s
  auto cluster = modelled_cluster(s, cfg, times);
  test::sim_system::stopper stop{s, cluster};
  generate_request req;
  req.prompt = forty_token_prompt;
  req.max_tokens = 3;
  auto first = s.generate(cluster.router, req);
  auto second = s.generate(cluster.router, req);
  REQUIRE(s.run_until_idle());
  REQUIRE(first->has_value());
  REQUIRE(second->has_value());
  CHECK_MESSAGE(**first, s.sys.render((*first)->error()));
  CHECK_MESSAGE(**second, s.sys.render((*second)->error()));
  CHECK(s.stats(cluster.decode[0].handle).num_free_pages == times.num_kv_pages);
}

TEST_CASE("a colocated step's one-token rows are timed as a decode step's and the pass's fixed cost is charged "
          "once, not once per row and chunk") {
  const auto cfg = one_by_one();
  auto times = model_times();
  times.prefill.delta_us = 300.0;
  const uint32_t layers = cfg.model.num_hidden_layers;
  // One 64-token chunk after 32 cached, and 8 running sequences at positions 100..107.
  gpu::forward_job step{0, {gpu::forward_seq{0, std::vector<int32_t>(64, 1), 32, {}, true}}, gpu::forward_job::prefill};
  uint64_t context = 0;
  for (uint32_t i = 0; i < 8; ++i) {
    step.seqs.push_back(gpu::forward_seq{1 + i, {1}, 100 + i, {}, true});
    context += 100 + i + 1;
  }
  const auto& p = times.prefill;
  const double chunk_us = p.alpha_us * 64 * 64 + p.beta_us * 64 * 32 + p.gamma_us * 64;
  const double rows_us = times.decode.per_seq_us * 8 + times.decode.per_context_token_us * static_cast<double>(context);
  const double fixed_us = std::max(p.delta_us, times.decode.step_base_us);  // 800: the decode step's
  CHECK(sims::modelled_layer_ns(step, cfg.model, times) == std::llround((chunk_us + rows_us + fixed_us) * 1000.0 / layers));
  // A chunk alone: the prefill model as it stands (its delta once).
  gpu::forward_job chunk{0, {step.seqs[0]}, gpu::forward_job::prefill};
  CHECK(sims::modelled_layer_ns(chunk, cfg.model, times) == std::llround(p.prefill_us(64, 32) * 1000.0 / layers));
  // Two prompts' chunks in one pass: delta once.
  gpu::forward_job two{0, {step.seqs[0], gpu::forward_seq{9, std::vector<int32_t>(16, 1), 0, {}, true}}, gpu::forward_job::prefill};
  CHECK(sims::modelled_layer_ns(two, cfg.model, times) ==
        std::llround((p.prefill_us(64, 32) + p.prefill_us(16, 0) - p.delta_us) * 1000.0 / layers));
}

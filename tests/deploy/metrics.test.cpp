// /metrics as the gateway renders it: what it records from each completion, and the cluster's
// gauges and counters from the router's stats (no sockets: the rendering alone).

#include <doctest/doctest.h>

#include "actors/client_messages.hpp"
#include "actors/messages.hpp"
#include "deploy/metrics.hpp"
#include "tests/deploy/metrics_text.hpp"

using namespace baton;

using test::value_of;

TEST_CASE("/metrics: a completion's stages, lengths and finish reason land in their histograms and counters") {
  deploy::gateway_metrics m;
  completion c;
  c.num_prompt_tokens = 700;
  c.tokens.assign(3, 1);
  c.finish_reason = "length";
  c.check_us = 200;
  c.place_us = 300;
  c.reserve_us = 500;      // routing: 1 ms
  c.prefill_queue_us = 20'000;
  c.prefill_us = 80'000;
  c.decode_queue_us = 3'000;
  c.migrations = 2;
  c.recomputed_blocks = 4;
  c.prefill_rank = "prefill-0";
  c.decode_rank = "decode-0";
  m.record(c);
  c.finish_reason = "stop";
  c.num_prompt_tokens = 3;
  c.prefill_queue_us = 7'000'000;
  m.record(c);
  const auto text = m.render(nullptr);
  CHECK(text.find("# TYPE baton_prefill_queue_seconds histogram\n") != std::string::npos);
  // Cumulative buckets: one request within 25 ms, both within 10 s.
  CHECK(value_of(text, "baton_prefill_queue_seconds_bucket{le=\"0.01\"}") == 0);
  CHECK(value_of(text, "baton_prefill_queue_seconds_bucket{le=\"0.025\"}") == 1);
  CHECK(value_of(text, "baton_prefill_queue_seconds_bucket{le=\"5\"}") == 1);
  CHECK(value_of(text, "baton_prefill_queue_seconds_bucket{le=\"10\"}") == 2);
  CHECK(value_of(text, "baton_prefill_queue_seconds_sum") == doctest::Approx(7.02));
  CHECK(value_of(text, "baton_routing_seconds_bucket{le=\"0.001\"}") == 2);
  CHECK(value_of(text, "baton_routing_seconds_bucket{le=\"0.0005\"}") == 0);
  CHECK(value_of(text, "baton_prefill_seconds_sum") == doctest::Approx(0.16));
  CHECK(value_of(text, "baton_decode_queue_seconds_count") == 2);
  CHECK(value_of(text, "baton_request_prompt_tokens_bucket{le=\"5\"}") == 1);
  CHECK(value_of(text, "baton_request_prompt_tokens_bucket{le=\"500\"}") == 1);
  CHECK(value_of(text, "baton_request_prompt_tokens_bucket{le=\"1000\"}") == 2);
  CHECK(value_of(text, "baton_request_generated_tokens_sum") == 6);
  CHECK(value_of(text, "baton_finished_total{finish_reason=\"length\"}") == 1);
  CHECK(value_of(text, "baton_finished_total{finish_reason=\"stop\"}") == 1);
  CHECK(value_of(text, "baton_completions_total") == 2);
  CHECK(value_of(text, "baton_migrations_total") == 4);
  CHECK(value_of(text, "baton_recomputed_blocks_total") == 8);
  CHECK(value_of(text, "baton_router_up") == 0);  // no cluster stats given
  // A prompt-only call (no decode rank) is not a 0 s wait for one.
  c.decode_rank.clear();
  m.record(c);
  CHECK(value_of(m.render(nullptr), "baton_decode_queue_seconds_count") == 2);
  CHECK(value_of(m.render(nullptr), "baton_prefill_seconds_count") == 3);
}

TEST_CASE("/metrics: token intervals by decode rank, so that a slow rank shows beside its peers") {
  deploy::gateway_metrics m;
  completion fast, slow;
  fast.decode_rank = "decode-a";
  fast.tbt_us = {2'000, 2'000, 2'000};
  slow.decode_rank = "decode-b";
  slow.tbt_us = {40'000, 40'000};
  m.record(fast);
  m.record(slow);
  const auto text = m.render(nullptr);
  CHECK(text.find("# TYPE baton_decode_rank_tbt_seconds histogram\n") != std::string::npos);
  CHECK(value_of(text, "baton_decode_rank_tbt_seconds_count{rank=\"decode-a\"}") == 3);
  CHECK(value_of(text, "baton_decode_rank_tbt_seconds_sum{rank=\"decode-a\"}") == doctest::Approx(0.006));
  CHECK(value_of(text, "baton_decode_rank_tbt_seconds_bucket{rank=\"decode-b\",le=\"0.025\"}") == 0);
  CHECK(value_of(text, "baton_decode_rank_tbt_seconds_bucket{rank=\"decode-b\",le=\"0.05\"}") == 2);
  CHECK(value_of(text, "baton_decode_rank_tbt_seconds_bucket{rank=\"decode-b\",le=\"+Inf\"}") == 2);
  CHECK(value_of(text, "baton_tbt_seconds_count") == 5);  // the cluster's, as before
  // A request that failed over to decode-a: its 150 ms gap was the failover, not decode-a's
  // step; it counts in the cluster's histogram only.
  completion moved;
  moved.decode_rank = "decode-a";
  moved.failovers = 1;
  moved.tbt_us = {2'000, 150'000, 2'000};
  m.record(moved);
  const auto after = m.render(nullptr);
  CHECK(value_of(after, "baton_decode_rank_tbt_seconds_count{rank=\"decode-a\"}") == 3);
  CHECK(value_of(after, "baton_tbt_seconds_count") == 8);
  // A call that failed after 11 tokens generated them all the same.
  const double generated = value_of(after, "baton_generated_tokens_total");
  m.count_generated(11);
  CHECK(value_of(m.render(nullptr), "baton_generated_tokens_total") == generated + 11);
}

TEST_CASE("/metrics: failed calls by the cluster's reason, so that running out of KV reads apart from other 503s") {
  deploy::gateway_metrics m;
  m.count_failure("kv_capacity");
  m.count_failure("kv_capacity");
  m.count_failure("http_503");
  const auto text = m.render(nullptr);
  CHECK(value_of(text, "baton_request_failures_total{reason=\"kv_capacity\"}") == 2);
  CHECK(value_of(text, "baton_request_failures_total{reason=\"http_503\"}") == 1);
}

TEST_CASE("/metrics: a call's first token is timed as it comes and a failed call's time to its failure by reason, "
          "so that an incident's TTFT and failures show while it lasts (a trial's histograms counted only the calls "
          "that finished, each once its whole generation had)") {
  deploy::gateway_metrics m;
  m.first_token(0.02);
  m.first_token(3.0);  // a call that fails afterwards: its first token still counts
  completion c;
  c.ttft_us = 20'000;
  m.record(c);  // the finished generation adds no second TTFT
  m.count_failure("kv_capacity");
  m.failed_after("kv_capacity", 1.35);
  m.failed_after("rank_unavailable", 7.0);
  const auto text = m.render(nullptr);
  CHECK(value_of(text, "baton_ttft_seconds_count") == 2);
  CHECK(value_of(text, "baton_ttft_seconds_bucket{le=\"0.025\"}") == 1);
  CHECK(value_of(text, "baton_ttft_seconds_sum") == doctest::Approx(3.02));
  CHECK(value_of(text, "baton_e2e_seconds_count") == 1);
  CHECK(text.find("# TYPE baton_failed_call_seconds histogram\n") != std::string::npos);
  CHECK(value_of(text, "baton_failed_call_seconds_bucket{reason=\"kv_capacity\",le=\"1\"}") == 0);
  CHECK(value_of(text, "baton_failed_call_seconds_bucket{reason=\"kv_capacity\",le=\"2.5\"}") == 1);
  CHECK(value_of(text, "baton_failed_call_seconds_count{reason=\"rank_unavailable\"}") == 1);
  // Failovers are the router's count, as each starts (a failed request's too): none without it.
  CHECK(text.find("baton_failovers_total") == std::string::npos);
  cluster_stats cs;
  cs.num_failovers = 3;
  cs.failed_codes = {"kv_capacity", "rank_unavailable"};
  cs.failed_counts = {4, 1};
  const auto routed = m.render(&cs);
  CHECK(value_of(routed, "baton_failovers_total") == 3);
  CHECK(routed.find("# TYPE baton_router_request_failures_total counter\n") != std::string::npos);
  CHECK(value_of(routed, "baton_router_request_failures_total{code=\"kv_capacity\"}") == 4);
  CHECK(value_of(routed, "baton_router_request_failures_total{code=\"rank_unavailable\"}") == 1);
  CHECK(routed.find("baton_node_state") == std::string::npos);  // the router knew no directory
  // The head's nodes: one series each, its state a label; one that went stays, lost or left.
  cs.nodes_known = true;
  cs.nodes = {{"dec-a", {"decode"}, 10, 100, "joined", {"dec-a"}, "", false},
              {"dec-b", {"decode"}, 11, 9000, "gone", {}, "went down (exit_reason(kill))", false},
              {"pre-c", {"prefill", "gateway"}, 12, 9000, "gone", {}, "left (its agent ended)", true}};
  const auto with_nodes = m.render(&cs);
  CHECK(value_of(with_nodes, "baton_node_state{node=\"dec-a\",roles=\"decode\",state=\"joined\"}") == 1);
  CHECK(value_of(with_nodes, "baton_node_state{node=\"dec-b\",roles=\"decode\",state=\"lost\"}") == 1);
  CHECK(value_of(with_nodes, "baton_node_state{node=\"pre-c\",roles=\"prefill,gateway\",state=\"left\"}") == 1);
  CHECK(value_of(with_nodes, "baton_nodes{state=\"lost\"}") == 1);
  CHECK(value_of(with_nodes, "baton_nodes{state=\"draining\"}") == 0);
}

TEST_CASE("/metrics: each decode rank's counters (offloads, moves, write-backs) from its last load report, as "
          "counters, and none for prefill ranks") {
  deploy::gateway_metrics m;
  cluster_stats c;
  rank_load d;
  d.name = "decode-3";
  d.offloaded = 4;
  d.resumed = 3;
  d.migrated_out = 2;
  d.migrate_failed = 1;
  d.blocks_written_back = 9;
  d.write_backs_dropped = 5;
  c.decode.push_back(d);
  rank_load p;
  p.name = "prefill-0";
  c.prefill.push_back(p);
  const auto text = m.render(&c);
  for (const auto& [name, value] : std::vector<std::pair<std::string, int>>{{"offloaded", 4},
                                                                            {"resumed", 3},
                                                                            {"migrated", 2},
                                                                            {"migrate_failed", 1},
                                                                            {"blocks_written_back", 9},
                                                                            {"write_backs_dropped", 5}}) {
    CAPTURE(name);
    const std::string metric = "baton_rank_" + name + "_total";
    CHECK(text.find("# TYPE " + metric + " counter\n") != std::string::npos);
    CHECK(text.find(metric + "{role=\"decode\",rank=\"decode-3\"} " + std::to_string(value) + "\n") != std::string::npos);
    CHECK(text.find(metric + "{role=\"prefill\"") == std::string::npos);
  }
}

TEST_CASE("/metrics: the placements each balancer holds waiting for a rank, as a gauge by stage") {
  deploy::gateway_metrics m;
  cluster_stats c;
  c.prefill_parked = 2;
  c.decode_parked = 7;
  const auto text = m.render(&c);
  CHECK(text.find("# TYPE baton_placements_waiting gauge\n") != std::string::npos);
  CHECK(value_of(text, "baton_placements_waiting{stage=\"prefill\"}") == 2);
  CHECK(value_of(text, "baton_placements_waiting{stage=\"decode\"}") == 7);
}

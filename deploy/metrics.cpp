#include "deploy/metrics.hpp"

#include <cstdio>
#include <map>

#include "actors/messages.hpp"

namespace baton::deploy {

void histogram::observe(double x) {
  size_t i = 0;
  while (i < bounds.size() && x > bounds[i]) ++i;
  ++counts[i];
  sum += x;
  ++count;
}

namespace {

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", x);
  return buf;
}

void render_histogram(std::string& out, const char* name, const char* help, const histogram& h) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cumulative += h.counts[i];
    out += std::string(name) + "_bucket{le=\"" + num(h.bounds[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  cumulative += h.counts.back();
  out += std::string(name) + "_bucket{le=\"+Inf\"} " + std::to_string(cumulative) + "\n";
  out += std::string(name) + "_sum " + num(h.sum) + "\n";
  out += std::string(name) + "_count " + std::to_string(h.count) + "\n";
}

/// One family of histograms, one per value of label `key` (a rank's name, say).
void render_labeled_histograms(std::string& out, const char* name, const char* help, const char* key,
                               const std::map<std::string, histogram>& hs, std::string (*escape)(const std::string&)) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " histogram\n";
  for (const auto& [value, h] : hs) {
    const std::string l = std::string(key) + "=\"" + escape(value) + "\"";
    uint64_t cumulative = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cumulative += h.counts[i];
      out += std::string(name) + "_bucket{" + l + ",le=\"" + num(h.bounds[i]) + "\"} " + std::to_string(cumulative) + "\n";
    }
    cumulative += h.counts.back();
    out += std::string(name) + "_bucket{" + l + ",le=\"+Inf\"} " + std::to_string(cumulative) + "\n";
    out += std::string(name) + "_sum{" + l + "} " + num(h.sum) + "\n";
    out += std::string(name) + "_count{" + l + "} " + std::to_string(h.count) + "\n";
  }
}

void render_counter(std::string& out, const char* name, const char* help, double value, const char* type = "counter") {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " + num(value) +
         "\n";
}

/// A label value, escaped as the exposition format asks (backslash, quote, newline).
std::string label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

/// Each API key's numbers at this gateway, labelled with its name (gateway_config's keys).
void render_keys(std::string& out, const std::vector<api_key_ptr>& keys) {
  if (keys.empty()) return;
  const auto family = [&](const char* name, const char* help, const char* type, auto value) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    for (const auto& k : keys) out += std::string(name) + "{key=\"" + label(k->cfg.name) + "\"} " + num(value(*k)) + "\n";
  };
  out += "# HELP baton_api_key_responses_total answers to each API key's calls, by HTTP status\n"
         "# TYPE baton_api_key_responses_total counter\n";
  for (const auto& k : keys)
    for (const auto& [code, n] : k->responses_now())
      out += "baton_api_key_responses_total{key=\"" + label(k->cfg.name) + "\",code=\"" + std::to_string(code) + "\"} " +
             std::to_string(n) + "\n";
  family("baton_api_key_prompt_tokens_total",
         "prompt tokens of each key's answered calls, as their usage counts them (a prompt once per call, whatever its "
         "n; baton_prompt_tokens_total counts it per generation)",
         "counter", [](api_key_state& k) { return static_cast<double>(k.prompt_tokens.load()); });
  family("baton_api_key_cached_prompt_tokens_total", "of those, tokens loaded from the prefix cache", "counter",
         [](api_key_state& k) { return static_cast<double>(k.cached_tokens.load()); });
  family("baton_api_key_completion_tokens_total", "tokens generated for each key's answered calls (usage's)", "counter",
         [](api_key_state& k) { return static_cast<double>(k.completion_tokens.load()); });
  family("baton_api_key_in_flight", "generations of each key's calls running now through this gateway", "gauge",
         [](api_key_state& k) { return static_cast<double>(k.in_flight.load()); });
  family("baton_api_key_max_in_flight", "each key's limit on those (0: none)", "gauge",
         [](api_key_state& k) { return static_cast<double>(k.max_in_flight.load()); });
  family("baton_api_key_max_tokens", "each key's cap on a generation's max_tokens (0: the cluster's)", "gauge",
         [](api_key_state& k) { return static_cast<double>(k.max_tokens.load()); });
  family("baton_api_key_limited_total", "calls refused (429) for their key's max_in_flight or per-minute budgets", "counter",
         [](api_key_state& k) { return static_cast<double>(k.limited.load()); });
  family("baton_api_key_requests_per_minute", "each key's budget of calls a minute at this gateway (0: none)", "gauge",
         [](api_key_state& k) { return k.budgets_now().first; });
  family("baton_api_key_tokens_per_minute", "each key's budget of prompt and generated tokens a minute (0: none)", "gauge",
         [](api_key_state& k) { return k.budgets_now().second; });
  out += "# HELP baton_api_key_budget_limited_total of the calls refused, those refused for each per-minute budget\n"
         "# TYPE baton_api_key_budget_limited_total counter\n";
  for (const auto& k : keys)
    for (const auto& [budget, n] : {std::pair{"requests_per_minute", k->limited_requests.load()},
                                    std::pair{"tokens_per_minute", k->limited_tokens.load()}})
      out += "baton_api_key_budget_limited_total{key=\"" + label(k->cfg.name) + "\",budget=\"" + budget + "\"} " +
             std::to_string(n) + "\n";
}

// Seconds per stage, from half a millisecond (a CHECK on an idle cluster) to ten minutes (a
// request waiting out the whole KV queue, request_config::queue_timeout_ms).
const std::vector<double> stage_bounds{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                       1,      2.5,   5,      10,    30,   60,    120,  300,  600};
// Tokens per request: 1-2-5 steps up to the longest contexts served (Mooncake's traces reach 128K).
const std::vector<double> length_bounds{1,    2,    5,    10,    20,    50,     100,   200,  500,
                                        1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000};

double seconds(int64_t us) { return static_cast<double>(us) / 1e6; }

}  // namespace

gateway_metrics::gateway_metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600}),  // up to the queue's 600 s
      tbt_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}),
      e2e_({0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200}),
      kv_send_({0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1}),
      routing_(stage_bounds),
      prefill_queue_(stage_bounds),
      prefill_(stage_bounds),
      decode_queue_(stage_bounds),
      prompt_len_(length_bounds),
      generated_len_(length_bounds) {}

void gateway_metrics::count_response(const std::string& route, int status, api_key_state* key) {
  if (key) key->count_response(status);
  std::lock_guard<std::mutex> guard{mutex_};
  ++responses_[{route, status}];
}

void gateway_metrics::count_failure(const std::string& reason) {
  std::lock_guard<std::mutex> guard{mutex_};
  ++failures_[reason];
}

void gateway_metrics::record(const completion& c) {
  std::lock_guard<std::mutex> guard{mutex_};
  ++completions_;
  int64_t total = c.ttft_us;
  // Per decode rank too, so that a slow one shows (a rank whose steps take 4x its peers' did
  // not, in a trial: the cluster's histogram averaged it away). Not a request that failed over
  // or moved: its intervals span ranks, and the gap of the failover itself would be charged to
  // the rank that took it over (a trial's alert on a slow rank fired on the healthy survivor).
  histogram* by_rank = nullptr;
  if (!c.decode_rank.empty() && !c.tbt_us.empty() && c.failovers == 0 && c.migrations == 0)
    by_rank = &rank_tbt_.try_emplace(c.decode_rank, tbt_.bounds).first->second;
  for (auto us : c.tbt_us) {
    tbt_.observe(seconds(us));
    if (by_rank) by_rank->observe(seconds(us));
    total += us;
  }
  e2e_.observe(seconds(total));
  if (c.kv_bytes > 0) kv_send_.observe(seconds(c.kv_send_us));
  routing_.observe(seconds(c.check_us + c.place_us + c.reserve_us));
  // A stage the request never ran (no decode rank: a prompt-only call) is no 0 s observation.
  if (!c.prefill_rank.empty()) {
    prefill_queue_.observe(seconds(c.prefill_queue_us));
    prefill_.observe(seconds(c.prefill_us));
  }
  if (!c.decode_rank.empty()) decode_queue_.observe(seconds(c.decode_queue_us));
  prompt_len_.observe(c.num_prompt_tokens);
  generated_len_.observe(static_cast<double>(c.tokens.size()));
  ++finished_[c.finish_reason.empty() ? "unknown" : c.finish_reason];
  migrations_ += c.migrations;
  recomputed_blocks_ += c.recomputed_blocks;
  prompt_tokens_ += c.num_prompt_tokens;
  cached_tokens_ += c.cached_tokens;
  generated_tokens_ += c.tokens.size();
  kv_bytes_ += c.kv_bytes;
}

void gateway_metrics::count_generated(uint64_t tokens) {
  std::lock_guard<std::mutex> guard{mutex_};
  generated_tokens_ += tokens;
}

void gateway_metrics::first_token(double s) {
  std::lock_guard<std::mutex> guard{mutex_};
  ttft_.observe(s);
}

void gateway_metrics::failed_after(const std::string& reason, double s) {
  std::lock_guard<std::mutex> guard{mutex_};
  failed_after_.try_emplace(reason, e2e_.bounds).first->second.observe(s);
}

std::string gateway_metrics::render(const cluster_stats* cluster) const {
  std::string out;
  {
    std::lock_guard<std::mutex> guard{mutex_};
    out += "# HELP baton_http_responses_total HTTP responses by route and status code\n";
    out += "# TYPE baton_http_responses_total counter\n";
    for (const auto& [key, n] : responses_)
      out += "baton_http_responses_total{route=\"" + label(key.first) + "\",code=\"" + std::to_string(key.second) +
             "\"} " + std::to_string(n) + "\n";
    render_histogram(out, "baton_ttft_seconds",
                     "per call: its arrival at the gateway to its first token, observed as the token comes (calls "
                     "that fail later count too)",
                     ttft_);
    render_histogram(out, "baton_tbt_seconds", "every interval between consecutive tokens", tbt_);
    render_labeled_histograms(out, "baton_decode_rank_tbt_seconds",
                              "every interval between consecutive tokens, by the decode rank the sequence ran on (requests that failed over or moved are left out: their intervals span ranks)",
                              "rank", rank_tbt_, label);
    render_histogram(out, "baton_e2e_seconds",
                     "per finished generation: first token plus every interval, on the router's clock (so a short "
                     "answer's may be below the gateway-timed TTFT; failed calls: baton_failed_call_seconds)",
                     e2e_);
    render_labeled_histograms(out, "baton_failed_call_seconds",
                              "per failed call: its arrival at the gateway to its failure, by the reason "
                              "baton_request_failures_total counts it under (refusals before a call began, as a "
                              "401 or a 405, are counted there alone)",
                              "reason", failed_after_, label);
    render_histogram(out, "baton_kv_transfer_seconds", "per request: first KV put posted to last layer announced",
                     kv_send_);
    render_histogram(out, "baton_routing_seconds", "per request: the router's CHECK, placement (with any wait for a prefill and a decode rank with room) and KV lease round trips",
                     routing_);
    render_histogram(out, "baton_prefill_queue_seconds", "per request: its prefill order waiting at the prefill rank",
                     prefill_queue_);
    render_histogram(out, "baton_prefill_seconds",
                     "per request: prefill order sent to first token back (queue, compute, KV send)", prefill_);
    render_histogram(out, "baton_decode_queue_seconds",
                     "per request: its decode order waiting at the decode rank to join the batch (KV layers arriving)",
                     decode_queue_);
    render_histogram(out, "baton_request_prompt_tokens", "per request: prompt tokens", prompt_len_);
    render_histogram(out, "baton_request_generated_tokens", "per request: tokens generated", generated_len_);
    render_counter(out, "baton_completions_total", "generations finished", static_cast<double>(completions_));
    out += "# HELP baton_finished_total generations finished, by finish_reason\n# TYPE baton_finished_total counter\n";
    for (const auto& [reason, n] : finished_)
      out += "baton_finished_total{finish_reason=\"" + label(reason) + "\"} " + std::to_string(n) + "\n";
    out += "# HELP baton_request_failures_total calls that failed, by the cluster's reason (kv_capacity: no decode rank "
           "had room; rank_unavailable, deadline_exceeded, ...) or http_<status>\n# TYPE baton_request_failures_total counter\n";
    for (const auto& [reason, n] : failures_)
      out += "baton_request_failures_total{reason=\"" + label(reason) + "\"} " + std::to_string(n) + "\n";
    render_counter(out, "baton_migrations_total", "decode moves, KV and all, to another rank (summed over finished requests)",
                   static_cast<double>(migrations_));
    render_counter(out, "baton_recomputed_blocks_total", "cached KV blocks found but recomputed (a failed read or check)",
                   static_cast<double>(recomputed_blocks_));
    render_counter(out, "baton_prompt_tokens_total", "prompt tokens of finished generations",
                   static_cast<double>(prompt_tokens_));
    render_counter(out, "baton_cached_prompt_tokens_total", "prompt tokens loaded instead of computed",
                   static_cast<double>(cached_tokens_));
    render_counter(out, "baton_generated_tokens_total", "tokens generated (by calls that failed after some too)", static_cast<double>(generated_tokens_));
    render_counter(out, "baton_kv_transfer_bytes_total", "KV bytes shipped from prefill to decode ranks",
                   static_cast<double>(kv_bytes_));
    render_counter(out, "baton_cache_hit_ratio", "cached prompt tokens / prompt tokens, since start",
                   prompt_tokens_ ? static_cast<double>(cached_tokens_) / static_cast<double>(prompt_tokens_) : 0.0,
                   "gauge");
  }
  render_keys(out, keys_);
  if (!cluster) {
    render_counter(out, "baton_router_up", "1 when the router answered this scrape", 0, "gauge");
    return out;
  }
  const auto& c = *cluster;
  render_counter(out, "baton_router_up", "1 when the router answered this scrape", 1, "gauge");
  render_counter(out, "baton_router_start_time_seconds",
                 "when the router (the cluster's head) started, Unix seconds: the router's and the ranks' counters count "
                 "from then, so a change of it explains counters that fell",
                 static_cast<double>(c.started_unix_ms) / 1e3, "gauge");
  render_counter(out, "baton_requests_active", "request actors alive at the router", static_cast<double>(c.num_active),
                 "gauge");
  render_counter(out, "baton_requests_admitted_total", "requests that passed admission (taken in, tokenized and checked)",
                 static_cast<double>(c.num_admitted));
  render_counter(out, "baton_requests_rejected_total", "requests refused (bad input or overload)",
                 static_cast<double>(c.num_rejected));
  render_counter(out, "baton_requests_overloaded_total", "requests refused by admission control (HTTP 429)",
                 static_cast<double>(c.num_overloaded));
  render_counter(out, "baton_failovers_total",
                 "re-placements of requests, counted by the router as each starts (failed requests' too): a rank "
                 "failed mid-request, or a re-placement found no rank in time; router-wide: every gateway of a "
                 "cluster shows the same count (take max over gateways, not sum)",
                 static_cast<double>(c.num_failovers));
  out += "# HELP baton_router_request_failures_total admitted requests that failed, by the cluster's code, from every "
         "client (the C++ client's and baton generate's too; of this gateway's calls, baton_request_failures_total), "
         "a client's cancel or hang-up as cancelled; router-wide: every gateway of a cluster shows the same count "
         "(take max, not sum)\n"
         "# TYPE baton_router_request_failures_total counter\n";
  for (size_t i = 0; i < c.failed_codes.size() && i < c.failed_counts.size(); ++i)
    out += "baton_router_request_failures_total{code=\"" + label(c.failed_codes[i]) + "\"} " +
           std::to_string(c.failed_counts[i]) + "\n";
  out += "# HELP baton_placements_waiting placements a balancer holds until a rank takes them (decode: KV room; "
         "prefill: a rank taking work), in arrival order: decode's is the KV queue, answered with why (kv_capacity, 503) when a request's queue time runs out\n"
         "# TYPE baton_placements_waiting gauge\n";
  out += "baton_placements_waiting{stage=\"prefill\"} " + std::to_string(c.prefill_parked) + "\n";
  out += "baton_placements_waiting{stage=\"decode\"} " + std::to_string(c.decode_parked) + "\n";
  // The node processes as the head's directory knows them: one that went keeps its series, as
  // lost or left, where its ranks' series are gone with it (a trial's alert needed absent() per
  // rank). One series per node, its state as a label (alert on state="lost").
  if (c.nodes_known) {
    const auto state_of = [](const node_status& n) -> std::string {
      return n.state != "gone" ? n.state : n.left ? "left" : "lost";
    };
    std::map<std::string, uint64_t> counts{{"joined", 0}, {"draining", 0}, {"left", 0}, {"lost", 0}};
    out += "# HELP baton_node_state the head's node processes (baton node, gateways), 1 in their state: joined, "
           "draining, left (went on purpose: drained) or lost (died, went silent, or left to be restarted); a "
           "process that rejoins under the name takes its entry; router-wide (take max over gateways, not sum)\n"
           "# TYPE baton_node_state gauge\n";
    for (const auto& n : c.nodes) {
      std::string roles;
      for (const auto& r : n.roles) roles += (roles.empty() ? "" : ",") + r;
      ++counts[state_of(n)];
      out += "baton_node_state{node=\"" + label(n.name) + "\",roles=\"" + label(roles) + "\",state=\"" +
             label(state_of(n)) + "\"} 1\n";
    }
    out += "# HELP baton_nodes the head's node processes by state\n# TYPE baton_nodes gauge\n";
    for (const auto& [state, n] : counts)
      out += "baton_nodes{state=\"" + label(state) + "\"} " + std::to_string(n) + "\n";
  }
  // One family over ranks: a gauge over both roles, or a counter of the decode ranks alone (as of
  // each rank's last load report).
  auto family = [&](const char* name, const char* help, const char* type, bool decode_only, auto value) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    for (const auto& [role, ranks] : {std::pair{"prefill", &c.prefill}, std::pair{"decode", &c.decode}})
      if (!decode_only || ranks == &c.decode)
        for (const auto& r : *ranks)
          out += std::string(name) + "{role=\"" + role + "\",rank=\"" + label(r.name) + "\"} " +
                 num(static_cast<double>(value(r))) + "\n";
  };
  auto per_rank = [&](const char* name, const char* help, auto value) { family(name, help, "gauge", false, value); };
  per_rank("baton_rank_queued_tokens", "prefill: prompt tokens accepted but not computed (decode ranks: 0)",
           [](const rank_load& r) { return static_cast<double>(r.queued_tokens); });
  per_rank("baton_rank_running", "prefill: prompts in progress; decode: sequences and leases",
           [](const rank_load& r) { return static_cast<double>(r.num_running); });
  per_rank("baton_rank_free_kv_pages", "free KV pages", [](const rank_load& r) { return static_cast<double>(r.num_free_pages); });
  per_rank("baton_rank_kv_pages", "KV pages in all", [](const rank_load& r) { return static_cast<double>(r.num_total_pages); });
  per_rank("baton_rank_available", "0 while the rank takes no new work (draining, or stepped aside: its executor can run nothing, a broken expert group), else 1",
           [](const rank_load& r) { return r.unavailable.empty() ? 1.0 : 0.0; });
  auto per_decode_rank = [&](const char* name, const char* help, auto value) { family(name, help, "counter", true, value); };
  per_decode_rank("baton_rank_offloaded_total", "sequences sent to host memory for lack of KV pages",
                  [](const rank_load& r) { return r.offloaded; });
  per_decode_rank("baton_rank_resumed_total", "offloaded sequences brought back", [](const rank_load& r) { return r.resumed; });
  per_decode_rank("baton_rank_migrated_total", "running sequences moved with their KV to other decode ranks (elastic drain)",
                  [](const rank_load& r) { return r.migrated_out; });
  per_decode_rank("baton_rank_migrate_failed_total", "moves given up (the sequence finished where it was)",
                  [](const rank_load& r) { return r.migrate_failed; });
  per_decode_rank("baton_rank_blocks_written_back_total", "full KV blocks written back to the block store",
                  [](const rank_load& r) { return r.blocks_written_back; });
  per_decode_rank("baton_rank_write_backs_dropped_total", "blocks no block server stored (staging full, no server, write failed)",
                  [](const rank_load& r) { return r.write_backs_dropped; });
  family("baton_rank_quarantined_kv_pages",
         "KV pages held out of use until a late writer's puts cannot land (decode: kv_quarantine_ms; prefill: the "
         "source pages of a put given up, a late store read's, a failed split part's): neither free nor running",
         "gauge", false, [](const rank_load& r) { return static_cast<double>(r.quarantined_pages); });
  per_decode_rank("baton_rank_spec_draft_tokens_total", "speculative decoding: draft tokens run in decode steps",
                  [](const rank_load& r) { return r.drafted_tokens; });
  per_decode_rank("baton_rank_spec_accepted_tokens_total",
                  "speculative decoding: draft tokens the model picked too (tokens gained beyond one per step)",
                  [](const rank_load& r) { return r.accepted_tokens; });
  render_counter(out, "baton_store_blocks", "blocks in the KV block store's index", static_cast<double>(c.store.blocks),
                 "gauge");
  render_counter(out, "baton_store_servers", "block servers the store was started with",
                 static_cast<double>(c.store_servers), "gauge");
  render_counter(out, "baton_store_servers_up", "block servers that answered this scrape",
                 static_cast<double>(c.store_servers_up), "gauge");
  render_counter(out, "baton_store_bytes_written_total", "bytes the block servers wrote",
                 static_cast<double>(c.store.bytes_written));
  render_counter(out, "baton_store_bytes_read_total", "bytes the block servers read", static_cast<double>(c.store.bytes_read));
  render_counter(out, "baton_store_evicted_blocks_total", "blocks evicted for capacity", static_cast<double>(c.store.evicted));
  render_counter(out, "baton_store_disk_bytes", "bytes the block servers' files take on disk (4 KiB units)",
                 static_cast<double>(c.store.disk_bytes), "gauge");
  render_counter(out, "baton_store_disk_evicted_blocks_total",
                 "block files the servers deleted for room: to stay within --store-capacity-gib, or when the disk was full",
                 static_cast<double>(c.store.disk_evicted));
  render_counter(out, "baton_store_read_failures_total",
                 "blocks the servers could not serve (missing, damaged, a read past its budget, a failed put): each a recompute",
                 static_cast<double>(c.store.read_failures));
  render_counter(out, "baton_store_damaged_blocks_total",
                 "of those, damaged block files (a broken header, a short file, a layer off its checksum), deleted and logged",
                 static_cast<double>(c.store.damaged_dropped));
  render_counter(out, "baton_store_write_failures_total", "blocks the servers did not write (dropped: a future miss)",
                 static_cast<double>(c.store.write_failures));
  render_counter(out, "baton_store_write_no_space_total", "of those, writes the disk refused for room (ENOSPC, EDQUOT)",
                 static_cast<double>(c.store.write_no_space));
  return out;
}

}  // namespace baton::deploy

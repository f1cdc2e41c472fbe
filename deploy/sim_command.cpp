// `baton sim run|goodput|compare`: replays a request trace (or synthetic arrivals) through the
// production actors under virtual time on modelled GPUs (sims/sim_run.hpp) and reports TTFT,
// TBT, TPOT, E2E, SLO attainment and goodput.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/profile_file.hpp"
#include "sims/roofline.hpp"
#include "sims/sim_plot.hpp"
#include "sims/sim_run.hpp"
#include "sims/trace.hpp"

namespace baton::deploy {

namespace {

struct sim_options {
  sims::sim_config cfg;
  std::string trace_path;
  float rate_scale = 1.0f, window_s = 0.0f, window_start_s = 0.0f;
  uint32_t max_requests = 0;
  // Synthetic arrivals when no --trace is given.
  float synthetic_rate = 2.0f, synthetic_duration_s = 60.0f, arrival_cv = 1.0f;
  uint32_t input_mean = 2048, output_mean = 256;
  float day_s = 0, day_swing = 0.5f;  ///< a diurnal day: its period, and the rate's swing
  uint32_t alt_input_mean = 512, alt_output_mean = 1024;  ///< the workload half a day later
  float ttft_slo_ms = 2000.0f, tbt_slo_ms = 100.0f;
  std::string report;
  std::string svg;  ///< prefix of the plots' files
  // goodput / compare
  float lo = 0.25f, hi = 8.0f, target = 0.9f;
  uint32_t steps = 6;
  std::vector<std::string> variants;
  std::vector<std::string> kills;  ///< RANK@SECONDS
  std::vector<std::string> degrades;  ///< NAME@SECONDS=GBPS
  std::vector<std::string> then_traces;  ///< played after --trace, back to back
  float nic_gbps = 0.0f;
  float store_gbps = 40.0f;
  float pcie_gbps = 0.0f;
  float sample_s = 10.0f;
  float elastic_interval_s = 5.0f;
  float elastic_hot = 0.8f, elastic_cold = 0.4f;
  std::string cost_profile;
  bool free_links = false;
};

/// Carries the flags that have no field of their own type into the config (SLOs, links, --kill
/// RANK@SECONDS as faults); false and why on a malformed one.
bool finish_options(sim_options* o, std::string* why) {
  o->cfg.slos = {o->ttft_slo_ms, o->tbt_slo_ms};
  o->cfg.nic_gbps = o->nic_gbps;
  o->cfg.store_gbps = o->store_gbps;
  o->cfg.pcie_gbps = o->pcie_gbps;
  o->cfg.sample_s = o->sample_s;
  o->cfg.elastic_interval_s = o->elastic_interval_s;
  o->cfg.elastic_hot = o->elastic_hot;
  o->cfg.elastic_cold = o->elastic_cold;
  o->cfg.use_cost_profile = !o->cost_profile.empty();
  if (o->cfg.use_cost_profile) {
    executor_profile p;
    if (!read_profile(o->cost_profile, &p, why)) return false;
    o->cfg.prefill_cost = p.prefill;
    o->cfg.decode_cost = p.decode;
    o->cfg.cost_profile_name = o->cost_profile + " (" + p.executor + ", " + p.model + ")";
  }
  o->cfg.model_links = !o->free_links;
  o->cfg.faults.clear();
  for (const auto& k : o->kills) {
    const auto at = k.rfind('@');
    char* end = nullptr;
    const double s = at == std::string::npos ? -1 : std::strtod(k.c_str() + at + 1, &end);
    if (at == std::string::npos || at == 0 || !end || *end != '\0' || !(s >= 0)) {
      *why = "--kill must be RANK@SECONDS (e.g. decode-1@600), got '" + k + "'";
      return false;
    }
    o->cfg.faults.push_back({s, k.substr(0, at)});
  }
  for (const auto& d : o->degrades) {  // NAME@SECONDS=GBPS
    const auto at = d.rfind('@'), eq = d.rfind('=');
    char *end1 = nullptr, *end2 = nullptr;
    const bool shape = at != std::string::npos && at > 0 && eq != std::string::npos && eq > at + 1;
    const double s = shape ? std::strtod(d.substr(at + 1, eq - at - 1).c_str(), &end1) : -1;
    const double g = shape ? std::strtod(d.c_str() + eq + 1, &end2) : -1;
    if (!shape || !end1 || *end1 != '\0' || !end2 || *end2 != '\0' || !(s >= 0) || !(g > 0)) {
      *why = "--degrade must be NAME@SECONDS=GBPS (e.g. decode-1@300=5), got '" + d + "'";
      return false;
    }
    o->cfg.faults.push_back({s, d.substr(0, at), g});
  }
  return true;
}

void add_sim_flags(flag_set& f, sim_options* o) {
  f.add("--trace", &o->trace_path, "a request trace: Mooncake .jsonl, Azure .csv or vLLM *_requests.jsonl (none: synthetic)");
  f.add("--then-trace", &o->then_traces, "another trace played after the previous one ends (repeatable: a shifting load)");
  f.add("--rate-scale", &o->rate_scale, "k times the trace's arrival rate");
  f.add("--window-start-s", &o->window_start_s, "keep arrivals from this second of the trace");
  f.add("--window-s", &o->window_s, "... for this long (0: to the end)");
  f.add("--max-requests", &o->max_requests, "keep at most this many requests (0: all)");
  f.add("--rate", &o->synthetic_rate, "synthetic: requests per second");
  f.add("--duration-s", &o->synthetic_duration_s, "synthetic: seconds of arrivals");
  f.add("--arrival-cv", &o->arrival_cv, "synthetic: 1 = Poisson, > 1 = bursty (gamma)");
  f.add("--input-mean", &o->input_mean, "synthetic: mean prompt tokens (lognormal, cv 1)");
  f.add("--output-mean", &o->output_mean, "synthetic: mean output tokens (lognormal, cv 1)");
  f.add("--day-s", &o->day_s,
        "synthetic: a diurnal day of this period: the rate swings, the mix drifts to --alt-* and back (0: steady)");
  f.add("--day-swing", &o->day_swing, "synthetic day: the rate's relative swing, in [0, 1)");
  f.add("--alt-input-mean", &o->alt_input_mean, "synthetic day: mean prompt tokens half a day later");
  f.add("--alt-output-mean", &o->alt_output_mean, "synthetic day: mean output tokens half a day later");
  f.add("--seed", &o->cfg.seed, "synthetic arrivals' seed (a replayed trace samples nothing)");
  f.add("--model", &o->cfg.model, "model shape: llama-3-8b | llama-3-70b | qwen3-32b | deepseek-v3");
  f.add("--prefill-gpu", &o->cfg.prefill_gpu, "GPU of prefill instances: H200 | H100 | H800 | RTX4090 | RTXPRO6000");
  f.add("--decode-gpu", &o->cfg.decode_gpu, "GPU of decode instances");
  f.add("--tp", &o->cfg.tp, "GPUs per instance (tensor parallel)");
  f.add("--prefill-ep", &o->cfg.prefill_ep,
        "MoE models: expert parallelism of each prefill instance (N GPUs, data-parallel attention; 1 = off)");
  f.add("--decode-ep", &o->cfg.decode_ep, "MoE models: expert parallelism of each decode instance");
  f.add("--eplb", &o->cfg.eplb, "expert parallelism: place redundant copies of hot experts (policies::plan_eplb)");
  f.add("--eplb-redundant", &o->cfg.eplb_redundant, "EPLB: redundant expert copies per instance and MoE layer");
  f.add("--expert-skew", &o->cfg.expert_skew, "expert popularity: Zipf exponent over the experts (0 = uniform)");
  f.add("--gpus-per-node", &o->cfg.gpus_per_node, "expert parallelism: GPUs that share a node's NVLink");
  f.add("--prefill-instances", &o->cfg.prefill_instances, "prefill instances");
  f.add("--decode-instances", &o->cfg.decode_instances, "decode instances (colocated: all instances)");
  f.add("--elastic-instances", &o->cfg.elastic_instances,
        "elastic P/D: instances (of the decode GPU) that the controller moves between prefill and decode");
  f.add("--elastic-prefill", &o->cfg.elastic_prefill_at_start, "elastic P/D: of them, how many start as prefill");
  f.add("--elastic-interval-s", &o->elastic_interval_s, "elastic P/D: how often the controller plans");
  f.add("--elastic-hot", &o->elastic_hot, "elastic P/D: pool pressure (signal / SLO target) that needs ranks");
  f.add("--elastic-cold", &o->elastic_cold, "elastic P/D: pool pressure at which a pool can give a rank");
  f.add("--elastic-signal", &o->cfg.elastic_signal,
        "elastic P/D: a pool's pressure is the mean over its ranks (default) or the max (a tail signal)");
  f.add("--colocated", &o->cfg.colocated, "the colocated baseline: chunked prefill on the decode instances");
  f.add("--chunk-tokens", &o->cfg.colocated_chunk_tokens, "colocated: tokens per step (max_num_batched_tokens)");
  f.add("--max-batch", &o->cfg.max_batch, "sequences per decode step (max_num_seqs)");
  f.add("--prefill-policy", &o->cfg.prefill_policy,
        "seed | least_loaded | round_robin | cache_affinity (split: not in sims yet)");
  f.add("--decode-policy", &o->cfg.decode_policy, "seed | least_loaded | round_robin");
  f.add("--prefix-cache-blocks", &o->cfg.prefix_cache_blocks, "per prefill instance: its local tier of prompt blocks");
  f.add("--profile", &o->cfg.profile,
        "step times from per-layer profile tables PREFIX_{dense,attention,per_sequence}.csv (vLLM's format)");
  f.add("--store", &o->cfg.store, "the shared KV block store: write-back, and prefix loads by any prefill instance");
  f.add("--store-servers", &o->cfg.store_servers, "store: storage nodes (modelled block servers)");
  f.add("--store-gbps", &o->store_gbps, "store: each node's read/write bandwidth, GB/s");
  f.add("--pcie-gbps", &o->pcie_gbps, "store loads: each GPU's host-to-device GB/s (0: the prefill GPU's)");
  f.add("--store-capacity-blocks", &o->cfg.store_capacity_blocks, "store: index capacity in blocks (0: unbounded)");
  f.add("--kv-on-demand", &o->cfg.kv_on_demand_tokens,
        "N > 0: decode KV allocated on demand (prompt + N tokens, then page by page, preempting when full)");
  f.add("--cost-profile", &o->cost_profile, "step times from a `baton profile` file's fitted cost models");
  f.add("--kv-tokens", &o->cfg.kv_tokens, "KV tokens per instance (0: HBM after the weights)");
  f.add("--nic-gbps", &o->nic_gbps, "GB/s of one GPU's NIC for KV handoffs (0: the GPU's default, 50)");
  f.add("--free-links", &o->free_links, "KV handoffs take no virtual time");
  f.add("--sim-layers", &o->cfg.sim_layers, "layer groups the actors see (KV ships per group)");
  f.add("--page-tokens", &o->cfg.page_tokens, "KV page size of the modelled ranks (block size must be a multiple)");
  f.add("--ttft-slo-ms", &o->ttft_slo_ms, "SLO on time to first token");
  f.add("--tbt-slo-ms", &o->tbt_slo_ms, "SLO on Mooncake's TBT (a request's slowest 10% of intervals)");
  f.add("--report", &o->report, "run only: write the JSON report here");
  f.add("--svg", &o->svg,
        "write plots PREFIX-{ttft,tbt,throughput,utilisation,queues}.svg");
  f.add("--sample-s", &o->sample_s, "the timeline's interval: rank utilisation and queues (0: none)");
  f.add("--horizon-s", &o->cfg.horizon_s,
        "stop waiting for answers this long (virtual) after the last arrival; what is left counts as unanswered");
  f.add("--kill", &o->kills,
        "RANK@SECONDS: kill that rank's (or store-<i>'s) actor at that virtual time (repeatable)");
  f.add("--degrade", &o->degrades,
        "NAME@SECONDS=GBPS: from that virtual time the endpoint's NIC moves only GBPS GB/s (repeatable)");
  f.add("--progress", &o->cfg.progress, "a progress line on stderr");
}

/// The synthetic arrivals (no --trace) at `scale` times the flags' rate: one place, so the checks
/// before any run see the same spec the runs will draw from.
sims::synthetic_spec synthetic_spec_of(const sim_options& o, double scale) {
  sims::synthetic_spec s;
  s.rate_per_s = o.synthetic_rate * o.rate_scale * scale;
  s.duration_s = o.synthetic_duration_s;
  s.arrival_cv = o.arrival_cv;
  s.input = {sims::length_dist::lognormal, static_cast<double>(o.input_mean), 1.0, 1, 32768};
  s.output = {sims::length_dist::lognormal, static_cast<double>(o.output_mean), 1.0, 1, 4096};
  s.period_s = o.day_s;
  s.rate_swing = o.day_s > 0 ? o.day_swing : 0.0;
  s.alt_input = {sims::length_dist::lognormal, static_cast<double>(o.alt_input_mean), 1.0, 1, 32768};
  s.alt_output = {sims::length_dist::lognormal, static_cast<double>(o.alt_output_mean), 1.0, 1, 4096};
  s.seed = o.cfg.seed;
  return s;
}

bool make_trace(const sim_options& o, double scale, sims::trace* t, std::string* name, std::string* why) {
  if (!o.trace_path.empty()) {
    sims::trace_options to;
    to.rate_scale = o.rate_scale * scale;
    to.window_start_s = o.window_start_s;
    to.window_s = o.window_s;
    to.max_requests = o.max_requests;
    if (auto e = to.validate(); !e.empty()) {
      *why = e;
      return false;
    }
    *name = o.trace_path;
    if (!sims::load_trace(o.trace_path, to, t, why)) return false;
    // Traces played back to back (a load that shifts): each starts a second after the last
    // arrival of the one before, with the same scaling and window.
    for (const auto& next : o.then_traces) {
      sims::trace more;
      if (!sims::load_trace(next, to, &more, why)) return false;
      const int64_t offset = (t->requests.empty() ? 0 : t->requests.back().arrival_us + 1'000'000);
      for (auto& r : more.requests) {
        r.arrival_us += offset;
        t->requests.push_back(std::move(r));
      }
      t->lines += more.lines;
      t->skipped += more.skipped;
      *name += " then " + next;
    }
    return true;
  }
  const auto s = synthetic_spec_of(o, scale);
  if (auto e = s.validate(); !e.empty()) {
    *why = e;
    return false;
  }
  *t = sims::synthetic_trace(s);
  *name = "synthetic";
  return true;
}

/// A flag's number as it was typed (0.05, not 0.050000).
std::string num(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", x);
  return b;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : ", ") + i;
  return out;
}

/// Tensor parallelism gives each GPU of an instance a whole share of the attention heads, and of
/// the KV heads -- or, with more GPUs than KV heads, the same number of GPUs per KV head, each
/// holding a copy (vLLM's rule; MLA has no KV heads to split). A split that no engine can run
/// would still be timed by the roofline, as if it could.
bool tp_splits(const sims::model_shape& m, uint32_t tp) {
  if (tp == 0 || m.num_heads % tp != 0) return false;
  return m.kv_heads == 0 || (tp <= m.kv_heads ? m.kv_heads % tp == 0 : tp % m.kv_heads == 0);
}

/// "decode-0 to decode-3": the ranks of one kind that --kill and --degrade can name.
std::string rank_range(const std::string& kind, uint32_t n) {
  if (n == 1) return kind + "-0";
  return kind + "-0 to " + kind + "-" + std::to_string(n - 1);
}

/// sim_config::validate() names the config's fields ("tp and decode_instances must be >= 1");
/// the user typed flags. For what cluster_problem does not check itself (fields without a flag,
/// checks added to validate() later), the fields are given as their flags. Only snake_case words
/// are replaced: a bare word such as "tp" may be part of a path in the same message.
std::string with_flag_names(const std::string& text) {
  static const std::map<std::string, std::string> flags = {
      {"decode_instances", "--decode-instances"}, {"prefill_instances", "--prefill-instances"},
      {"prefill_ep", "--prefill-ep"}, {"decode_ep", "--decode-ep"}, {"gpus_per_node", "--gpus-per-node"},
      {"expert_skew", "--expert-skew"}, {"elastic_instances", "--elastic-instances"},
      {"elastic_prefill_at_start", "--elastic-prefill"}, {"elastic_interval_s", "--elastic-interval-s"},
      {"sample_s", "--sample-s"}, {"horizon_s", "--horizon-s"}, {"page_tokens", "--page-tokens"},
      {"sim_layers", "--sim-layers"}, {"store_servers", "--store-servers"}, {"store_gbps", "--store-gbps"},
      {"max_batch", "--max-batch"}, {"colocated_chunk_tokens", "--chunk-tokens"}, {"degrade_gbps", "--degrade"},
      {"kv_tokens", "--kv-tokens"}, {"kv_on_demand_tokens", "--kv-on-demand"}, {"prefill_policy", "--prefill-policy"},
      {"decode_policy", "--decode-policy"}, {"eplb_redundant", "--eplb-redundant"}};
  auto word = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  std::string out;
  for (size_t i = 0; i < text.size();) {
    if (!word(text[i])) {
      out += text[i++];
      continue;
    }
    size_t j = i;
    while (j < text.size() && word(text[j])) ++j;
    const std::string w = text.substr(i, j - i);
    const bool in_path = (i > 0 && std::strchr("/.-", text[i - 1])) || (j < text.size() && std::strchr("/.", text[j]));
    const auto f = flags.find(w);
    out += f != flags.end() && !in_path ? f->second : w;
    i = j;
  }
  return out;
}

/// The cluster's flags, before anything runs: those whose refusal is clearer with the flag's
/// value and what it may be (names, counts, --tp that the model's heads do not split over, the
/// ranks --kill may name); the rest as sim_config::validate() words them, its fields as flags.
std::string cluster_problem(const sim_options& o) {
  const auto& c = o.cfg;
  const auto shape = sims::named_model(c.model);
  if (!shape) return "--model '" + c.model + "' is not a known model shape (known: " + join(sims::model_names()) + ")";
  for (const auto& [flag, gpu] : {std::pair{"--prefill-gpu", &c.prefill_gpu}, std::pair{"--decode-gpu", &c.decode_gpu}})
    if (!sims::named_gpu(*gpu))
      return std::string{flag} + " '" + *gpu + "' is not a known GPU (known: " + join(sims::gpu_names()) + ")";
  for (const auto& [flag, v] :
       {std::pair{"--tp", c.tp}, std::pair{"--decode-instances", c.decode_instances}, std::pair{"--prefill-ep", c.prefill_ep},
        std::pair{"--decode-ep", c.decode_ep}, std::pair{"--gpus-per-node", c.gpus_per_node},
        std::pair{"--sim-layers", c.sim_layers}, std::pair{"--max-batch", c.max_batch},
        std::pair{"--chunk-tokens", c.colocated_chunk_tokens}})
    if (v == 0) return std::string{flag} + " must be >= 1, got 0";
  for (const auto& [flag, ep] : {std::pair{"--prefill-ep", c.prefill_ep}, std::pair{"--decode-ep", c.decode_ep}})
    if (ep > 1 && shape->num_experts == 0) {
      std::vector<std::string> moe;
      for (const auto& n : sims::model_names())
        if (sims::named_model(n)->num_experts > 0) moe.push_back(n);
      return std::string{flag} + " " + std::to_string(ep) + " needs a model with routed experts; " + c.model +
             " has none (" + join(moe) + " has)";
    }
  // An expert-parallel pool's instances are ep GPUs with data-parallel attention: --tp applies
  // only to the pools without it (a colocated cluster has no prefill pool).
  const bool tp_used = c.decode_ep == 1 || (!c.colocated && c.prefill_ep == 1);
  if (tp_used && !tp_splits(*shape, c.tp)) {
    std::vector<std::string> fits;
    for (uint32_t t = 1; t <= shape->num_heads; ++t)
      if (tp_splits(*shape, t)) fits.push_back(std::to_string(t));
    return "--tp " + std::to_string(c.tp) + " does not split " + c.model + "'s " + std::to_string(shape->num_heads) +
           " attention heads" + (shape->kv_heads ? " and " + std::to_string(shape->kv_heads) + " KV heads" : std::string{}) +
           " evenly over an instance's GPUs; " + c.model + " takes --tp " + join(fits);
  }
  // The rest of sim_config::validate()'s checks speak of its fields: with_flag_names below.
  // finish_options() turned --kill and then --degrade into faults, in that order.
  for (size_t i = 0; i < c.faults.size(); ++i) {
    const auto& f = c.faults[i];
    const std::string flag = i < o.kills.size()                     ? "--kill " + o.kills[i]
                             : i < o.kills.size() + o.degrades.size() ? "--degrade " + o.degrades[i - o.kills.size()]
                                                                      : "fault on " + f.rank;
    bool known = false;
    for (uint32_t k = 0; k < c.decode_instances && !known; ++k) known = f.rank == "decode-" + std::to_string(k);
    for (uint32_t k = 0; !c.colocated && k < c.prefill_instances && !known; ++k)
      known = f.rank == "prefill-" + std::to_string(k);
    for (uint32_t k = 0; c.store && k < c.store_servers && !known; ++k) known = f.rank == "store-" + std::to_string(k);
    if (!known) {
      std::vector<std::string> ranks;
      if (!c.colocated && c.prefill_instances > 0) ranks.push_back(rank_range("prefill", c.prefill_instances));
      ranks.push_back(rank_range("decode", c.decode_instances));
      if (c.store) ranks.push_back(rank_range("store", c.store_servers));
      return flag + ": this cluster has no rank '" + f.rank + "' (it has " + join(ranks) + ")";
    }
    if (!(f.at_s <= 1e9)) return flag + ": the time must be at most 1e9 s";
    if (!std::isfinite(f.degrade_gbps)) return flag + ": GBPS must be a finite number";
    if (f.degrade_gbps > 0 && !c.model_links) return flag + " needs timed links, not --free-links";
  }
  if (auto e = c.validate(); !e.empty()) return with_flag_names(e);
  return {};
}

/// The arrivals' flags, at every rate scale the command uses: 1, and for goodput and compare
/// up to --hi, so that a synthetic trace too large at --hi stops here and not after the runs at
/// the lower rates.
std::string arrivals_problem(const sim_options& o, bool searches) {
  if (!(o.rate_scale > 0)) return "--rate-scale must be > 0, got " + num(o.rate_scale);
  if (!o.then_traces.empty() && o.trace_path.empty())
    return "--then-trace " + o.then_traces.front() + " follows a --trace, and none is given (synthetic arrivals have no end "
           "to follow)";
  if (!o.trace_path.empty()) {
    if (o.window_start_s < 0) return "--window-start-s must be >= 0, got " + num(o.window_start_s);
    if (o.window_s < 0) return "--window-s must be >= 0 (0: to the end), got " + num(o.window_s);
    return {};
  }
  if (!(o.synthetic_rate > 0)) return "--rate must be > 0, got " + num(o.synthetic_rate);
  if (!(o.synthetic_duration_s > 0)) return "--duration-s must be > 0, got " + num(o.synthetic_duration_s);
  if (!(o.arrival_cv > 0)) return "--arrival-cv must be > 0 (1: Poisson), got " + num(o.arrival_cv);
  if (o.input_mean == 0) return "--input-mean must be >= 1, got 0";
  if (o.output_mean == 0) return "--output-mean must be >= 1, got 0";
  if (o.day_s < 0) return "--day-s must be >= 0 (0: steady), got " + num(o.day_s);
  if (o.day_s > 0) {
    if (!(o.day_swing >= 0 && o.day_swing < 1)) return "--day-swing must be in [0, 1), got " + num(o.day_swing);
    if (o.alt_input_mean == 0) return "--alt-input-mean must be >= 1, got 0";
    if (o.alt_output_mean == 0) return "--alt-output-mean must be >= 1, got 0";
  }
  if (auto e = synthetic_spec_of(o, 1.0).validate(); !e.empty()) return e;
  if (searches && o.hi > 1)
    if (auto e = synthetic_spec_of(o, o.hi).validate(); !e.empty()) return "at --hi " + num(o.hi) + ": " + e;
  return {};
}

/// Goodput's bisection over [--lo, --hi]: a range, and a number of steps that each cost a whole
/// run. Outside them it printed a goodput of 0 that no run had measured.
std::string search_problem(const sim_options& o) {
  if (!(o.lo > 0)) return "--lo must be > 0 (a rate scale), got " + num(o.lo);
  if (!(o.lo < o.hi))
    return "--lo " + num(o.lo) + " must be below --hi " + num(o.hi) + " (goodput bisects the rate scales between them)";
  if (o.steps < 1 || o.steps > 40)
    return "--steps must be between 1 and 40, got " + std::to_string(o.steps) +
           " (each step is one more run; 40 narrow the range a trillion-fold)";
  if (!(o.target > 0 && o.target <= 1))
    return "--target must be a fraction in (0, 1] (0.9: 90% of requests), got " + num(o.target);
  return {};
}

/// Why `path` cannot be written (empty: it can), asked before the runs rather than after them,
/// when a bad path would throw the whole simulation away. Nothing is left behind or truncated: a
/// file made to try is removed again. `shown` is what the user typed (the --svg prefix of
/// `path`, or `path` itself).
std::string unwritable(const std::string& flag, const std::string& shown, const std::string& path) {
  namespace fs = std::filesystem;
  // "--report r.json ..." or, for a file the flag's value only starts, "--svg p: p-ttft.svg ...".
  const std::string subject = flag + " " + shown + (path == shown ? "" : ": " + path), head = flag + " " + shown + ": ";
  std::error_code ec;
  const fs::path p{path};
  if (fs::is_directory(p, ec)) {
    const std::string example = flag == "--report" ? " (e.g. " + (p / "report.json").string() + ")" : "";
    return subject + " is a directory, not a file" + example;
  }
  // access() says yes to root everywhere and knows nothing of filesystems such as /proc: a file
  // is opened as the writer will open it. A device or pipe (/dev/stdout) is only asked: opening
  // a pipe with no reader would wait here.
  if (fs::exists(p, ec)) {
    if (!fs::is_regular_file(p, ec)) {
      if (::access(path.c_str(), W_OK) == 0) return {};
    } else if (const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC); fd >= 0) {
      ::close(fd);
      return {};
    }
    return subject + " cannot be written (" + std::strerror(errno) + ")";
  }
  if (!p.has_filename()) return subject + " ends in '/' and names no file";
  // A link to a file not there yet: the writer creates its target (the trial below could not).
  if (fs::is_symlink(fs::symlink_status(p, ec))) return {};
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path{"."};
  const bool dir_there = fs::exists(dir, ec);
  if (ec) return head + "cannot look into " + dir.string() + " (" + ec.message() + ")";
  if (!dir_there) return head + "the directory " + dir.string() + " does not exist";
  if (!fs::is_directory(dir, ec)) return head + dir.string() + " is not a directory";
  if (const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644); fd >= 0) {
    ::close(fd);
    ::unlink(path.c_str());
    return {};
  }
  return head + "cannot create a file in " + dir.string() + " (" + std::strerror(errno) + ")";
}

/// What the runs of one configuration need: its cluster and its arrivals (up to --hi when
/// `searches`, for goodput and compare's goodput column).
std::string runs_problem(const sim_options& o, bool searches) {
  if (auto e = cluster_problem(o); !e.empty()) return e;
  return arrivals_problem(o, searches);
}

/// The files `mode` writes at the end. goodput writes none (it prints one line); compare writes
/// only the two CDFs.
std::string outputs_problem(const sim_options& o, const std::string& mode) {
  // Asked for and never written would be worse than refused.
  if (mode != "run" && !o.report.empty()) return "--report is written by `baton sim run` only, not by " + mode;
  if (mode == "goodput" && !o.svg.empty()) return "--svg is drawn by `baton sim run` and `compare` only, not by goodput";
  if (mode == "run" && !o.report.empty())
    if (auto e = unwritable("--report", o.report, o.report); !e.empty()) return e;
  if (mode != "goodput" && !o.svg.empty()) {
    std::vector<std::string> plots = {"ttft", "tbt"};
    if (mode == "run") plots.insert(plots.end(), {"throughput", "utilisation", "queues"});
    for (const auto& plot : plots)
      if (auto e = unwritable("--svg", o.svg, o.svg + "-" + plot + ".svg"); !e.empty()) return e;
  }
  return {};
}

/// Every flag, checked before the first run: a bad one found after a long trace, or after a
/// goodput search's runs, wasted them. compare checks its variants instead of the common flags
/// (the common ones alone never run: a variant may override a bad one). Empty when all are usable.
std::string options_problem(const sim_options& o, const std::string& mode) {
  if (mode != "run")
    if (auto e = search_problem(o); !e.empty()) return e;
  if (mode != "compare")
    if (auto e = runs_problem(o, mode == "goodput"); !e.empty()) return e;
  return outputs_problem(o, mode);
}

/// The failed requests' most common reasons, grouped by their words (numbers -- request ids,
/// sizes -- do not split a group), each with one verbatim example: "failed 293" alone gave no
/// hint whether a fault, the KV capacity or the horizon failed them.
void print_failures(const std::vector<sims::request_outcome>& outcomes) {
  struct group {
    size_t count = 0;
    std::string example;
  };
  std::map<std::string, group> groups;
  size_t failed = 0;
  for (const auto& out : outcomes) {
    if (out.ok) continue;
    ++failed;
    std::string kind;
    for (char ch : out.error)
      if (!std::isdigit(static_cast<unsigned char>(ch))) kind += ch;
      else if (kind.empty() || kind.back() != '#') kind += '#';
    auto& g = groups[kind];
    if (g.count++ == 0) g.example = out.error.empty() ? "(no reason given)" : out.error;
  }
  if (failed == 0) return;
  std::vector<const group*> common;
  for (const auto& [kind, g] : groups) common.push_back(&g);
  std::stable_sort(common.begin(), common.end(), [](auto* a, auto* b) { return a->count > b->count; });
  constexpr size_t shown = 3, longest = 240;
  std::printf("  failed %zu of %zu requests%s:\n", failed, outcomes.size(),
              common.size() == 1 ? "" : ", by reason (the most common first)");
  size_t listed = 0;
  for (size_t k = 0; k < common.size() && k < shown; ++k) {
    const auto& e = common[k]->example;
    std::printf("    %zu x, e.g. %s%s\n", common[k]->count, e.substr(0, longest).c_str(), e.size() > longest ? "..." : "");
    listed += common[k]->count;
  }
  if (common.size() > shown)
    std::printf("    and %zu more for %zu other reasons (--report lists them all under \"errors\")\n", failed - listed,
                common.size() - shown);
}

/// TTFT and TBT CDFs (cut at p99, the tail named in the title) and completions per 10 s of
/// virtual time.
bool write_plots(const std::string& prefix, const sims::sim_result& r, std::string* why) {
  std::vector<double> ttft, tbt;
  std::map<int64_t, double> done;
  for (const auto& o : r.outcomes) {
    if (!o.ok) continue;
    ttft.push_back(static_cast<double>(o.ttft_us) / 1e3);
    if (o.output_tokens > 1) tbt.push_back(o.tbt_slow10_us / 1e3);
    done[(o.arrival_us + o.e2e_us) / 10'000'000] += 0.1;
  }
  sims::plot_series rate{"completions", {}};
  for (const auto& [bucket, per_s] : done) rate.points.push_back({static_cast<double>(bucket) * 10, per_s});
  const auto& s = r.summary;
  // Utilisation and queues over time, per pool: the ranks' mean occupied fraction, and the
  // summed queues (per rank they are in the JSON report's timeline).
  std::map<std::string, sims::plot_series> pool_busy, pool_queue;
  for (const auto& rank : r.timeline.ranks) {
    const std::string pool = rank.rank.substr(0, rank.rank.find('-'));
    const double share = 1.0 / static_cast<double>(std::count_if(r.timeline.ranks.begin(), r.timeline.ranks.end(), [&](auto& x) {
      return x.rank.rfind(pool + "-", 0) == 0;
    }));
    auto add = [&](sims::plot_series& series, const std::string& name, const std::vector<double>& v, double scale) {
      series.name = name;
      if (series.points.size() < v.size()) series.points.resize(v.size());
      for (size_t k = 0; k < v.size(); ++k)
        series.points[k] = {static_cast<double>(k + 1) * r.timeline.interval_s, series.points[k].second + v[k] * scale};
    };
    add(pool_busy[pool], pool + " (mean)", rank.busy, share);
    add(pool_queue[pool + " waiting"], pool + " waiting", rank.waiting, 1.0);
    add(pool_queue[pool + " running"], pool + " running", rank.running, 1.0);
  }
  std::vector<sims::plot_series> busy_series, queue_series;
  for (auto& [k, v] : pool_busy) busy_series.push_back(std::move(v));
  for (auto& [k, v] : pool_queue) queue_series.push_back(std::move(v));
  std::vector<std::pair<std::string, std::string>> files = {
      {prefix + "-ttft.svg", sims::svg_plot("TTFT CDF (to p99; max " + std::to_string(static_cast<int64_t>(s.ttft_ms.max)) + " ms)",
                                            "TTFT (ms)", "fraction of requests", {sims::cdf_of("TTFT", ttft)}, s.ttft_ms.p99)},
      {prefix + "-tbt.svg", sims::svg_plot("TBT CDF (slowest 10% of each request's intervals)", "TBT (ms)",
                                           "fraction of requests", {sims::cdf_of("TBT", tbt)})},
      {prefix + "-throughput.svg", sims::svg_plot("Completions over virtual time (10 s buckets)", "time (s)",
                                                  "requests/s", {rate})}};
  if (!busy_series.empty()) {
    files.push_back({prefix + "-utilisation.svg", sims::svg_plot("GPU occupancy per pool over virtual time", "time (s)",
                                                                 "fraction of each interval busy", busy_series)});
    files.push_back({prefix + "-queues.svg", sims::svg_plot("Queues over virtual time (summed over each pool's ranks)",
                                                            "time (s)", "prompts / sequences", queue_series)});
  }
  for (const auto& [path, text] : files) {
    std::ofstream out(path);
    out << text;
    if (!out) {
      *why = "cannot write " + path;
      return false;
    }
  }
  return true;
}

void print_summary(const sims::sim_summary& s) {
  std::printf("  requests %zu, completed %zu, failed %zu; SLO attainment %.1f%%; cache hit ratio %.3f\n", s.requests,
              s.completed, s.failed, 100 * s.slo_attainment, s.cache_hit_ratio);
  // A --kill run's point: how many requests moved off the failed rank (the JSON report has it too).
  if (s.failovers) std::printf("  failovers: %llu (requests re-placed after a rank failed)\n",
                               static_cast<unsigned long long>(s.failovers));
  auto row = [](const char* what, const sims::percentiles& p) {
    std::printf("  %-5s ms  mean %9.1f  p50 %9.1f  p90 %9.1f  p99 %9.1f  max %9.1f\n", what, p.mean, p.p50, p.p90,
                p.p99, p.max);
  };
  row("TTFT", s.ttft_ms);
  row("TBT", s.tbt_ms);
  row("TPOT", s.tpot_ms);
  row("E2E", s.e2e_ms);
  // Over its own span, which the header's arrival and end times do not give: failed requests
  // (and the wait for unanswered ones) can run the virtual clock far past the last completion.
  if (s.completed == 0)
    std::printf("  throughput: none (no request completed)\n");
  else
    std::printf("  throughput: %.1f requests/s, %.0f output tokens/s of completed requests over %.1f s (first arrival "
                "to last completion)\n",
                s.requests_per_s, s.output_tokens_per_s, s.span_s);
}

/// What a goodput search found: the scale and its rate, or that even --lo missed the target (and
/// by how much).
struct goodput_answer {
  double scale = 0, req_per_s = 0;
  bool below_lo = false;
  double lo_attainment = 0, lo_req_per_s = 0;
};

/// One variant of `baton sim compare`: NAME=FLAGS, the flags applied over the common ones.
bool apply_variant(const std::string& v, const sim_options& base, sim_options* out, std::string* name, std::string* why) {
  const auto eq = v.find('=');
  if (eq == std::string::npos || eq == 0) {
    *why = "--variant must be NAME=FLAGS (e.g. colocated=--colocated), got '" + v + "'";
    return false;
  }
  *name = v.substr(0, eq);
  std::istringstream in(v.substr(eq + 1));
  std::vector<std::string> args;
  for (std::string w; in >> w;) args.push_back(w);
  *out = base;
  out->variants.clear();
  flag_set f;
  add_sim_flags(f, out);
  if (auto rc = f.parse_command_line(args, "sim compare", "--variant NAME=FLAGS")) {
    *why = "variant '" + *name + "': bad flags";
    return false;
  }
  // Files are written by `baton sim run` only: in a variant they were ignored without a word.
  if (out->report != base.report || out->svg != base.svg) {
    *why = "variant '" + *name + "': --report and --svg are not per variant (compare writes a table; `baton sim run` "
           "with the variant's flags writes its files)";
    return false;
  }
  if (!finish_options(out, why)) {
    *why = "variant '" + *name + "': " + *why;
    return false;
  }
  return true;
}

}  // namespace

int run_sim(const std::vector<std::string>& raw) {
  if (raw.size() == 1 && (raw[0] == "--help" || raw[0] == "-h")) {  // asked for: stdout, exit 0
    std::printf("usage: baton sim run|goodput|compare [flags]\n"
                "  run      replay a trace (or a synthetic load) into the cluster's actors under virtual time\n"
                "  goodput  the highest rate scale whose requests meet their TTFT and TBT targets\n"
                "  compare  the same trace under several variants (--variant NAME=FLAGS), side by side\n"
                "`baton sim MODE --help` lists each mode's flags; docs/sims.md explains the reports.\n");
    return 0;
  }
  if (raw.empty() || (raw[0] != "run" && raw[0] != "goodput" && raw[0] != "compare")) {
    std::fprintf(stderr, "usage: baton sim run|goodput|compare [flags]   (`baton sim run --help` lists them)\n");
    return 2;
  }
  const std::string mode = raw[0];
  std::vector<std::string> args(raw.begin() + 1, raw.end());
  sim_options o;
  flag_set f;
  add_sim_flags(f, &o);
  if (mode != "run") {
    f.add("--lo", &o.lo, "goodput: lowest rate scale tried");
    f.add("--hi", &o.hi, "goodput: highest rate scale tried");
    f.add("--steps", &o.steps, "goodput: bisection steps (1 to 40), one run each");
    f.add("--target", &o.target, "goodput: fraction of requests within both SLOs, in (0, 1]");
  }
  if (mode == "compare")
    f.add("--variant", &o.variants, "NAME=FLAGS: a configuration to compare (repeatable), e.g. colo=--colocated");
  if (auto rc = f.parse_command_line(args, "sim " + mode, "baton sim " + mode + " [flags]")) return *rc;
  std::string why, name;
  if (!finish_options(&o, &why)) {
    std::fprintf(stderr, "baton sim: %s\n", why.c_str());
    return 2;
  }
  if (auto e = options_problem(o, mode); !e.empty()) {
    std::fprintf(stderr, "baton sim: %s\n", e.c_str());
    return 2;
  }
  // compare runs one variant after another: a bad one found after the others' runs (and their
  // goodput searches) would waste them, so every variant is checked before the first.
  if (mode == "compare") {
    if (o.variants.empty()) o.variants = {"as-given="};
    for (const auto& v : o.variants) {
      sim_options vo;
      std::string vname;
      if (!apply_variant(v, o, &vo, &vname, &why)) {
        std::fprintf(stderr, "baton sim: %s\n", why.c_str());
        return 2;
      }
      if (auto e = runs_problem(vo, true); !e.empty()) {
        std::fprintf(stderr, "baton sim: variant '%s': %s\n", vname.c_str(), e.c_str());
        return 2;
      }
    }
  }
  // Only now, with every flag checked: a refused command leaves the process's allocator alone.
  sims::tune_allocator_for_sims();

  if (mode == "run") {
    sims::trace t;
    if (!make_trace(o, 1.0, &t, &name, &why)) {
      std::fprintf(stderr, "baton sim: %s\n", why.c_str());
      return 2;
    }
    const auto w0 = std::chrono::steady_clock::now();
    sims::sim_result r;
    if (!sims::run_sim(o.cfg, t, name, &r, &why)) {
      std::fprintf(stderr, "baton sim: %s\n", why.c_str());
      return 2;
    }
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    // Which span each figure covers: the arrivals, then the virtual clock's end (the last event:
    // answers, failures, the wait for unanswered requests), then the throughput's own.
    const double first_s = t.requests.empty() ? 0 : static_cast<double>(t.requests.front().arrival_us) / 1e6;
    const double last_s = t.requests.empty() ? 0 : static_cast<double>(t.requests.back().arrival_us) / 1e6;
    std::printf("baton sim: %s, %zu requests arriving from %.1f s to %.1f s of virtual time; the sim ended at %.1f s\n",
                name.c_str(), t.requests.size(), first_s, last_s, r.virtual_s);
    print_summary(r.summary);
    print_failures(r.outcomes);
    auto vs = [](const char* what, const sims::percentiles& sim, const sims::percentiles& m) {
      if (m.count == 0 || m.mean <= 0 || m.p50 <= 0) return;
      std::printf("  measured %-4s ms  mean %9.1f  p50 %9.1f   (sim: mean %+.1f%%, p50 %+.1f%%)\n", what, m.mean, m.p50,
                  100 * (sim.mean / m.mean - 1), 100 * (sim.p50 / m.p50 - 1));
    };
    vs("TTFT", r.summary.ttft_ms, r.measured_ttft_ms);
    vs("TPOT", r.summary.tpot_ms, r.measured_tpot_ms);
    vs("E2E", r.summary.e2e_ms, r.measured_e2e_ms);
    for (const auto& c : r.role_changes) std::printf("  role change: %s\n", c.c_str());
    if (o.cfg.prefill_ep > 1 || o.cfg.decode_ep > 1)
      std::printf("  experts: dispatch + combine %.1f GB across nodes, %.1f GB inside nodes; busiest GPU's routed load "
                  "%.3fx the mean (prefill), %.3fx (decode)\n",
                  r.ep_cross_node_gb, r.ep_intra_node_gb, r.prefill_ep_imbalance, r.decode_ep_imbalance);
    std::printf("  simulated in %.2f s wall: %.0f requests/s, %.2fM events (%.0f per request, %.2fM events/s)\n", wall,
                static_cast<double>(t.requests.size()) / wall, static_cast<double>(r.events) / 1e6,
                static_cast<double>(r.events) / std::max<double>(1, static_cast<double>(t.requests.size())),
                static_cast<double>(r.events) / wall / 1e6);
    if (!o.report.empty()) {
      std::ofstream out(o.report);
      out << r.json;
      if (!out) {
        std::fprintf(stderr, "baton sim: cannot write %s\n", o.report.c_str());
        return 1;
      }
      std::printf("  report: %s\n", o.report.c_str());
    }
    if (!o.svg.empty()) {
      if (!write_plots(o.svg, r, &why)) {
        std::fprintf(stderr, "baton sim: %s\n", why.c_str());
        return 1;
      }
      std::printf("  plots: %s-{ttft,tbt,throughput,utilisation,queues}.svg\n", o.svg.c_str());
    }
    return r.summary.failed ? 1 : 0;
  }

  auto goodput_of = [&](const sim_options& v, goodput_answer* a) {
    std::vector<std::pair<double, double>> runs;
    why.clear();
    sims::trace base;
    if (!make_trace(v, 1.0, &base, &name, &why)) return false;
    const double base_rate = base.span_s() > 0 ? static_cast<double>(base.requests.size()) / base.span_s() : 0;
    std::string trace_why;
    a->scale = sims::find_goodput(
        v.cfg,
        [&](double s) {
          sims::trace t;
          std::string n;
          if (!make_trace(v, s, &t, &n, &trace_why)) t = {};
          return t;
        },
        v.lo, v.hi, v.steps, v.target, &runs, &why);
    if (!why.empty() || !trace_why.empty()) {
      if (why.empty()) why = trace_why;
      return false;
    }
    a->req_per_s = a->scale * base_rate;
    // find_goodput runs --lo first and, under the target there, returns 0: not a goodput of 0
    // but one below the range searched.
    a->below_lo = !runs.empty() && runs.front().second < v.target;
    a->lo_attainment = runs.empty() ? 0 : runs.front().second;
    a->lo_req_per_s = v.lo * base_rate;
    return true;
  };

  if (mode == "goodput") {
    goodput_answer g;
    if (!goodput_of(o, &g)) {
      std::fprintf(stderr, "baton sim: %s\n", why.c_str());
      return 2;
    }
    const double scale = g.scale, rate = g.req_per_s;
    if (g.below_lo) {
      std::printf("baton sim goodput: even the lowest rate tried (%.3f x the trace's rate = %.2f requests/s) meets the "
                  "SLOs (TTFT <= %.0f ms and TBT <= %.0f ms) for only %.1f%% of requests (target %g%%); the goodput "
                  "is below it: try a lower --lo. If a lower one does no better, the misses are not the load's (a "
                  "trace's own long prompts, say, or the placement policy): `baton sim run --rate-scale %g` shows "
                  "its TTFT and TBT percentiles against the SLOs\n",
                  o.lo, g.lo_req_per_s, o.ttft_slo_ms, o.tbt_slo_ms, 100 * g.lo_attainment, 100 * o.target, o.lo);
      return 1;
    }
    // At the top of the range the knee was not found: say "at least".
    const char* bound = scale >= o.hi ? ">= " : "";
    std::printf("baton sim goodput: %s%.3f x the trace's rate = %s%.2f requests/s with >= %.0f%% within TTFT <= %.0f ms "
                "and TBT <= %.0f ms\n",
                bound, scale, bound, rate, 100 * o.target, o.ttft_slo_ms, o.tbt_slo_ms);
    return 0;
  }

  // compare: one row per variant at the trace's rate, plus its goodput; with --svg, the
  // variants' TTFT and TBT CDFs overlaid.
  std::vector<sims::plot_series> ttft_cdfs, tbt_cdfs;
  double ttft_cut = 0;
  std::printf("%-16s %10s %10s %10s %10s %8s %10s %12s\n", "variant", "TTFT p50", "TTFT p99", "TBT p50", "TBT p99",
              "SLO %", "goodput x", "goodput r/s");
  for (const auto& v : o.variants) {
    sim_options vo;
    std::string vname;
    if (!apply_variant(v, o, &vo, &vname, &why)) {
      std::fprintf(stderr, "baton sim: %s\n", why.c_str());
      return 2;
    }
    sims::trace t;
    sims::sim_result r;
    if (!make_trace(vo, 1.0, &t, &name, &why) || !sims::run_sim(vo.cfg, t, name, &r, &why)) {
      std::fprintf(stderr, "baton sim: %s: %s\n", vname.c_str(), why.c_str());
      return 2;
    }
    goodput_answer ga;
    if (!goodput_of(vo, &ga)) {
      std::fprintf(stderr, "baton sim: %s: %s\n", vname.c_str(), why.c_str());
      return 2;
    }
    const auto& s = r.summary;
    if (!o.svg.empty()) {
      std::vector<double> ttft, tbt;
      for (const auto& out : r.outcomes) {
        if (!out.ok) continue;
        ttft.push_back(static_cast<double>(out.ttft_us) / 1e3);
        if (out.output_tokens > 1) tbt.push_back(out.tbt_slow10_us / 1e3);
      }
      ttft_cdfs.push_back(sims::cdf_of(vname, std::move(ttft)));
      tbt_cdfs.push_back(sims::cdf_of(vname, std::move(tbt)));
      ttft_cut = std::max(ttft_cut, s.ttft_ms.p99);
    }
    // At the top of the range the knee was not found: "at least" (">="); under the target even at
    // --lo: "below" ("<") the lowest rate tried, not a goodput of 0.
    char g[2][32];
    if (ga.below_lo) {
      std::snprintf(g[0], sizeof g[0], "<%.3f", static_cast<double>(vo.lo));
      std::snprintf(g[1], sizeof g[1], "<%.2f", ga.lo_req_per_s);
    } else {
      std::snprintf(g[0], sizeof g[0], "%s%.3f", ga.scale >= vo.hi ? ">=" : "", ga.scale);
      std::snprintf(g[1], sizeof g[1], "%s%.2f", ga.scale >= vo.hi ? ">=" : "", ga.req_per_s);
    }
    std::printf("%-16s %10.0f %10.0f %10.1f %10.1f %8.1f %10s %12s\n", vname.c_str(), s.ttft_ms.p50, s.ttft_ms.p99,
                s.tbt_ms.p50, s.tbt_ms.p99, 100 * s.slo_attainment, g[0], g[1]);
    std::fflush(stdout);
  }
  if (!o.svg.empty()) {
    for (const auto& [path, text] :
         {std::pair{o.svg + "-ttft.svg", sims::svg_plot("TTFT CDF by variant (to the largest p99)", "TTFT (ms)",
                                                       "fraction of requests", ttft_cdfs, ttft_cut)},
          std::pair{o.svg + "-tbt.svg", sims::svg_plot("TBT CDF by variant (slowest 10% of each request's intervals)",
                                                      "TBT (ms)", "fraction of requests", tbt_cdfs)}}) {
      std::ofstream out(path);
      out << text;
      if (!out) {
        std::fprintf(stderr, "baton sim: cannot write %s\n", path.c_str());
        return 1;
      }
    }
    std::printf("plots: %s-ttft.svg, %s-tbt.svg (one CDF per variant)\n", o.svg.c_str(), o.svg.c_str());
  }
  return 0;
}

}  // namespace baton::deploy

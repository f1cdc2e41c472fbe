// `baton sim run|goodput|compare`: replays a request trace (or synthetic arrivals) through the
// production actors under virtual time on modelled GPUs (sims/sim_run.hpp) and reports TTFT,
// TBT, TPOT, E2E, SLO attainment and goodput. Its flags, and the checks made before any run,
// are in deploy/sim_options.hpp.

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>

#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/sim_options.hpp"
#include "sims/sim_plot.hpp"
#include "sims/sim_run.hpp"
#include "sims/trace.hpp"

namespace baton::deploy {

using namespace sim_cli;

namespace {

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
    // Grouped by the sentence of the last attempt: what the attempts said before it (the
    // "(attempt N of M, ...; it failed over ...)" that ends it) varies between requests.
    const std::string_view cause = std::string_view{out.error}.substr(0, out.error.find(" (attempt "));
    std::string kind;
    for (char ch : cause)
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
  // A --kill run's point: how many requests moved off the failed rank (the JSON report's
  // "failovers"). The request actors count every re-placement alike: after a rank failed or
  // timed out, and after a decode rank refused the lease for lack of free KV pages (the balancer
  // saw it a step earlier), which an overloaded run without faults has too. The label says so.
  if (s.failovers)
    std::printf("  re-placements: %llu (a request placed again after a rank failed or timed out, or refused it for "
                "lack of KV)\n",
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
    f.add("--steps", &o.steps,
          "goodput: bisection steps (1 to 40) after the runs at --lo and --hi: up to steps + 2 runs");
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
  // goodput searches) would waste them, so every variant -- its flags, cluster and trace -- is
  // checked before the first.
  if (mode == "compare") {
    if (o.variants.empty()) o.variants = {"as-given="};
    if (auto e = variants_problem(o); !e.empty()) {
      std::fprintf(stderr, "baton sim: %s\n", e.c_str());
      return 2;
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
    if (t.requests.empty()) {  // every percentile would read 0.0, as if measured
      std::fprintf(stderr, "baton sim: synthetic arrivals at --rate %g over --duration-s %g drew no request: raise either\n",
                   static_cast<double>(o.synthetic_rate * o.rate_scale), static_cast<double>(o.synthetic_duration_s));
      return 2;
    }
    // run_sim would refuse the same, in its config's words; these are the flags'.
    if (auto e = trace_run_problem(o, t, name, false); !e.empty()) {
      std::fprintf(stderr, "baton sim: %s\n", e.c_str());
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
    if (t.zero_output_rows)
      std::printf("  requests that record 0 output tokens: %zu, replayed as prefill-only (1 token: the first)\n",
                  t.zero_output_rows);
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
    // An elastic run that moved nothing: why that can be right (both pools hot: no rank to give).
    if (o.cfg.elastic_instances > 0 && r.role_changes.empty())
      std::printf("  role changes: none -- a rank moves only from a cold pool (pressure <= --elastic-cold %.2f) to a hot "
                  "one (>= --elastic-hot %.2f) after that has held for 10 s; both pools hot (or both cold) move nothing "
                  "(docs/elastic.md)\n",
                  o.cfg.elastic_cold, o.cfg.elastic_hot);
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
    // Arrivals at one instant have no rate to scale (goodput printed ">= 0.00 requests/s").
    if (auto e = trace_run_problem(v, base, name, true); !e.empty()) {
      why = e;
      return false;
    }
    const double base_rate = static_cast<double>(base.requests.size()) / base.span_s();
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
    // Requests/s of the trace run at a scale: a replayed trace's arrivals are compressed (its rate
    // scales), but synthetic arrivals are drawn afresh at the scaled rate, whose own count and
    // span say it (scale x the scale-1 draw's rate read 13% low there).
    const auto rate_at = [&](double s) {
      sims::trace t;
      std::string n, w;
      if (s <= 0 || !make_trace(v, s, &t, &n, &w) || t.requests.size() < 2 || t.span_s() <= 0) return s * base_rate;
      return static_cast<double>(t.requests.size()) / t.span_s();
    };
    a->req_per_s = rate_at(a->scale);
    // find_goodput runs --lo first and, under the target there, returns 0: not a goodput of 0
    // but one below the range searched.
    a->below_lo = !runs.empty() && runs.front().second < v.target;
    a->lo_attainment = runs.empty() ? 0 : runs.front().second;
    a->lo_req_per_s = rate_at(v.lo);
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
  std::printf("%-16s %10s %10s %10s %10s %8s %10s %12s\n", "", "ms", "ms", "ms", "ms", "", "rate", "requests/s");
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

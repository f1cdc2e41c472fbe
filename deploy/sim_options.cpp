// `baton sim`'s flags and the checks made before any run (deploy/sim_options.hpp).

#include "deploy/sim_options.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>

#include "deploy/profile_file.hpp"
#include "sims/profile_table.hpp"
#include "sims/roofline.hpp"
#include "sims/sim_report.hpp"

namespace baton::deploy::sim_cli {

namespace {

/// Synthetic lengths are drawn lognormal (cv 1) and cut here, so that one draw from the tail
/// stays a request a model serves. A mean near the cut would be a different distribution (a
/// mean of 65,536 prompt tokens gave 25,000): means go up to a quarter of it, where the cut moves
/// the mean by a few percent; longer ones come from a trace.
constexpr uint32_t synthetic_input_cut = 32768, synthetic_output_cut = 4096;

/// The synthetic arrivals (no --trace) at `scale` times the flags' rate: one place, so the checks
/// before any run see the same spec the runs will draw from.
sims::synthetic_spec synthetic_spec_of(const sim_options& o, double scale) {
  sims::synthetic_spec s;
  s.rate_per_s = o.synthetic_rate * o.rate_scale * scale;
  s.duration_s = o.synthetic_duration_s;
  s.arrival_cv = o.arrival_cv;
  s.input = {sims::length_dist::lognormal, static_cast<double>(o.input_mean), 1.0, 1, synthetic_input_cut};
  s.output = {sims::length_dist::lognormal, static_cast<double>(o.output_mean), 1.0, 1, synthetic_output_cut};
  s.period_s = o.day_s;
  s.rate_swing = o.day_s > 0 ? o.day_swing : 0.0;
  s.alt_input = {sims::length_dist::lognormal, static_cast<double>(o.alt_input_mean), 1.0, 1, synthetic_input_cut};
  s.alt_output = {sims::length_dist::lognormal, static_cast<double>(o.alt_output_mean), 1.0, 1, synthetic_output_cut};
  s.seed = o.cfg.seed;
  return s;
}

/// A flag's number as it was typed (0.05, not 0.050000).
std::string num(double x) { return sims::as_typed(x); }

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

/// Rates, bandwidths, SLOs and intervals, by value: a flag parses any finite number, and a
/// negative or zero one went through without a word (--nic-gbps -3 ran as the default rate,
/// --ttft-slo-ms 0 failed every request). Each refusal names the flag and the value typed.
std::string numbers_problem(const sim_options& o) {
  struct positive {
    const char* flag;
    double value;
    const char* unit;
  };
  for (const auto& p : {positive{"--ttft-slo-ms", o.ttft_slo_ms, "milliseconds"},
                        positive{"--tbt-slo-ms", o.tbt_slo_ms, "milliseconds"},
                        positive{"--store-gbps", o.store_gbps, "GB/s"},
                        positive{"--elastic-interval-s", o.elastic_interval_s, "seconds"},
                        positive{"--horizon-s", o.cfg.horizon_s, "seconds"}})
    if (!(p.value > 0)) return std::string{p.flag} + " must be > 0 (" + p.unit + "), got " + num(p.value);
  // 0 asks for the GPU's own rate; below it there is nothing to mean.
  for (const auto& [flag, value] : {std::pair{"--nic-gbps", o.nic_gbps}, std::pair{"--pcie-gbps", o.pcie_gbps}})
    if (!(value >= 0)) return std::string{flag} + " must be > 0 GB/s (or 0: the GPU's own), got " + num(value);
  if (!(o.sample_s >= 0)) return "--sample-s must be >= 0 (0: no timeline), got " + num(o.sample_s);
  if (!(o.cfg.expert_skew >= 0)) return "--expert-skew must be >= 0 (0: uniform), got " + num(o.cfg.expert_skew);
  // The elastic planner's (policies::role_planner_config), checked there only when a run starts.
  if (!(o.elastic_cold >= 0 && o.elastic_cold < o.elastic_hot))
    return "--elastic-cold " + num(o.elastic_cold) + " and --elastic-hot " + num(o.elastic_hot) +
           ": the planner needs 0 <= cold < hot";
  if (o.cfg.elastic_signal != "mean" && o.cfg.elastic_signal != "max")
    return "--elastic-signal must be mean or max, got '" + o.cfg.elastic_signal + "'";
  return {};
}

/// The cluster's flags, before anything runs: those whose refusal is clearer with the flag's
/// value and what it may be (names, counts, --tp that the model's heads do not split over, the
/// ranks --kill may name); the rest as sim_config::validate() words them, its fields as flags.
std::string cluster_problem(const sim_options& o) {
  if (auto e = numbers_problem(o); !e.empty()) return e;
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
  if (!tp_used && c.tp != sim_options{}.cfg.tp)  // (given: the default cannot be told from one typed)
    return "--tp " + std::to_string(c.tp) + " applies to pools without expert parallelism, and every pool here has "
           "--prefill-ep or --decode-ep (data-parallel attention): drop --tp";
  // The roofline times a TP all-reduce at NVLink's bandwidth with no per-call latency: across
  // nodes it would be the NIC's, and 64 GPUs read as 0.6 ms per token.
  if (tp_used && c.tp > c.gpus_per_node)
    return "--tp " + std::to_string(c.tp) + " spans more than one node (--gpus-per-node " + std::to_string(c.gpus_per_node) +
           "): tensor parallelism is timed over NVLink within a node only";
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
  // The KV pools' pages and this machine's memory: otherwise the cluster refused them at the run,
  // in `baton local`'s words (--kv-pages, which sim has not).
  if (auto e = sims::kv_memory_problem(c); !e.empty()) return with_flag_names(e);
  // Read at the run's start: a missing table was found after the runs before it.
  std::string why;
  if (!c.profile.empty() && !sims::profile_table::load(c.profile, &why)) return "--profile " + c.profile + ": " + why;
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
  // Flags of the other kind of arrivals shaped nothing, without a word: refused, named. (Each
  // differs from its default: one given at its default changes nothing either way.)
  const sim_options defaults;
  std::vector<std::string> unused;
  auto given = [&](const char* flag, double value, double default_value, bool integer = false) {
    if (value != default_value)
      unused.push_back(std::string{flag} + " " + (integer ? std::to_string(static_cast<uint64_t>(value)) : num(value)));
  };
  if (!o.trace_path.empty()) {
    given("--rate", o.synthetic_rate, defaults.synthetic_rate);
    given("--duration-s", o.synthetic_duration_s, defaults.synthetic_duration_s);
    given("--arrival-cv", o.arrival_cv, defaults.arrival_cv);
    given("--input-mean", o.input_mean, defaults.input_mean, true);
    given("--output-mean", o.output_mean, defaults.output_mean, true);
    given("--day-s", o.day_s, defaults.day_s);
    given("--day-swing", o.day_swing, defaults.day_swing);
    given("--alt-input-mean", o.alt_input_mean, defaults.alt_input_mean, true);
    given("--alt-output-mean", o.alt_output_mean, defaults.alt_output_mean, true);
    if (!unused.empty())
      return join(unused) + (unused.size() == 1 ? " shapes" : " shape") + " synthetic arrivals, and --trace " +
             o.trace_path + " replays a trace instead: drop " + (unused.size() == 1 ? "it" : "them") +
             " (--rate-scale scales a trace's rate)";
    if (o.window_start_s < 0) return "--window-start-s must be >= 0, got " + num(o.window_start_s);
    if (o.window_s < 0) return "--window-s must be >= 0 (0: to the end), got " + num(o.window_s);
    return {};
  }
  given("--window-start-s", o.window_start_s, defaults.window_start_s);
  given("--window-s", o.window_s, defaults.window_s);
  given("--max-requests", o.max_requests, defaults.max_requests, true);
  if (!unused.empty())
    return join(unused) + (unused.size() == 1 ? " cuts" : " cut") +
           " a --trace, and none is given: synthetic arrivals are as many as --rate and --duration-s make";
  if (!(o.synthetic_rate > 0)) return "--rate must be > 0, got " + num(o.synthetic_rate);
  if (!(o.synthetic_duration_s > 0)) return "--duration-s must be > 0, got " + num(o.synthetic_duration_s);
  if (!(o.arrival_cv > 0)) return "--arrival-cv must be > 0 (1: Poisson), got " + num(o.arrival_cv);
  const auto mean_fits = [](const char* flag, uint32_t mean, uint32_t cut) -> std::string {
    if (mean == 0) return std::string{flag} + " must be >= 1, got 0";
    if (mean > cut / 4)
      return std::string{flag} + " must be at most " + std::to_string(cut / 4) + ", got " + std::to_string(mean) +
             ": synthetic lengths are lognormal (cv 1) cut at " + std::to_string(cut) +
             " tokens, which would pull a larger mean well below what was asked; replay a --trace for longer ones";
    return {};
  };
  if (auto e = mean_fits("--input-mean", o.input_mean, synthetic_input_cut); !e.empty()) return e;
  if (auto e = mean_fits("--output-mean", o.output_mean, synthetic_output_cut); !e.empty()) return e;
  if (o.day_s < 0) return "--day-s must be >= 0 (0: steady), got " + num(o.day_s);
  if (o.day_s > 0) {
    if (!(o.day_swing >= 0 && o.day_swing < 1)) return "--day-swing must be in [0, 1), got " + num(o.day_swing);
    if (auto e = mean_fits("--alt-input-mean", o.alt_input_mean, synthetic_input_cut); !e.empty()) return e;
    if (auto e = mean_fits("--alt-output-mean", o.alt_output_mean, synthetic_output_cut); !e.empty()) return e;
  } else {
    given("--day-swing", o.day_swing, defaults.day_swing);
    given("--alt-input-mean", o.alt_input_mean, defaults.alt_input_mean, true);
    given("--alt-output-mean", o.alt_output_mean, defaults.alt_output_mean, true);
    if (!unused.empty())
      return join(unused) + (unused.size() == 1 ? " shapes" : " shape") +
             " a synthetic day, and --day-s is 0 (steady arrivals): give --day-s too, or drop " +
             (unused.size() == 1 ? "it" : "them");
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

/// The goodput search scales the arrival rate: a trace whose arrivals share one instant has
/// none, and the search printed ">= 0.00 requests/s" for it, as if measured.
std::string no_rate_problem(const sims::trace& t, const std::string& name) {
  if (t.span_s() > 0) return {};
  if (t.requests.empty()) return name + " holds no request";
  const std::string what = t.requests.size() == 1 ? std::string{"holds one request"}
                                                  : "has " + std::to_string(t.requests.size()) +
                                                        " requests, all arriving at the same instant";
  return name + " " + what + ": goodput scales a trace's arrival rate, and arrivals that span 0 s have none to scale "
         "(`baton sim run` replays it as it is; a --window-s or --max-requests that keeps arrivals spread over time "
         "leaves goodput a rate)";
}

/// What identifies the arrivals a variant reads from files: variants that agree share one read.
std::string trace_key(const sim_options& o) {
  std::string key = o.trace_path;
  for (const auto& t : o.then_traces) key += "\n" + t;
  char numbers[96];
  std::snprintf(numbers, sizeof numbers, "\n%.9g %.9g %.9g %u", static_cast<double>(o.rate_scale),
                static_cast<double>(o.window_start_s), static_cast<double>(o.window_s), o.max_requests);
  return key + numbers;
}

}  // namespace

/// Carries the flags that have no field of their own type into the config (SLOs, links, --kill
/// RANK@SECONDS and --degrade NAME@SECONDS=GBPS as faults); false and why on a malformed one.
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
  // The arrivals as the report's config says them: two runs of one trace at two scales, or
  // two synthetic draws, told apart by their reports alone.
  if (!o->trace_path.empty()) {
    o->cfg.arrivals = o->trace_path;
    for (const auto& t : o->then_traces) o->cfg.arrivals += " then " + t;
    o->cfg.arrivals += ", rate x " + num(o->rate_scale) + ", window from " + num(o->window_start_s) + " s for " +
                       (o->window_s > 0 ? num(o->window_s) + " s" : std::string{"the rest"}) +
                       (o->max_requests ? ", at most " + std::to_string(o->max_requests) + " requests" : "");
  } else {
    o->cfg.arrivals = "synthetic: " + num(o->synthetic_rate * o->rate_scale) + " requests/s for " +
                      num(o->synthetic_duration_s) + " s, arrival cv " + num(o->arrival_cv) + ", prompts mean " +
                      std::to_string(o->input_mean) + ", outputs mean " + std::to_string(o->output_mean) +
                      " tokens (lognormal, cv 1)" +
                      (o->day_s > 0 ? ", a day of " + num(o->day_s) + " s (rate swing " + num(o->day_swing) +
                                          ", prompts mean " + std::to_string(o->alt_input_mean) + " and outputs mean " +
                                          std::to_string(o->alt_output_mean) + " half a day later)"
                                    : "");
  }
  o->cfg.faults.clear();
  // A number the whole of `text` spells (strtod alone took "decode-1@" as 0 s).
  auto number = [](const std::string& text, double* out) {
    char* end = nullptr;
    *out = std::strtod(text.c_str(), &end);
    return !text.empty() && end == text.c_str() + text.size();
  };
  for (const auto& k : o->kills) {
    const auto at = k.rfind('@');
    double s = -1;
    if (at == std::string::npos || at == 0 || !number(k.substr(at + 1), &s)) {
      *why = "--kill must be RANK@SECONDS (e.g. decode-1@600), got '" + k + "'";
      return false;
    }
    if (!(s >= 0)) {
      *why = "--kill " + k + ": SECONDS must be >= 0 (a virtual time from the first arrival), got " + k.substr(at + 1);
      return false;
    }
    o->cfg.faults.push_back({s, k.substr(0, at)});
  }
  for (const auto& d : o->degrades) {  // NAME@SECONDS=GBPS
    const auto at = d.rfind('@'), eq = d.rfind('=');
    double s = -1, g = -1;
    if (at == std::string::npos || at == 0 || eq == std::string::npos || eq < at + 1 ||
        !number(d.substr(at + 1, eq - at - 1), &s) || !number(d.substr(eq + 1), &g)) {
      *why = "--degrade must be NAME@SECONDS=GBPS (e.g. decode-1@300=5), got '" + d + "'";
      return false;
    }
    if (!(s >= 0)) {
      *why = "--degrade " + d + ": SECONDS must be >= 0 (a virtual time from the first arrival), got " +
             d.substr(at + 1, eq - at - 1);
      return false;
    }
    // sim_fault reads a rate of 0 as a kill: a degrade to 0 (or below) is refused, not made one.
    if (!(g > 0)) {
      *why = "--degrade " + d + ": GBPS must be > 0 (the endpoint's NIC rate from then on; --kill takes a rank "
             "down), got " + d.substr(eq + 1);
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
  f.add("--input-mean", &o->input_mean, "synthetic: mean prompt tokens (lognormal, cv 1, cut at 32768; at most 8192)");
  f.add("--output-mean", &o->output_mean, "synthetic: mean output tokens (lognormal, cv 1, cut at 4096; at most 1024)");
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
  f.add("--max-batch", &o->cfg.max_batch, "sequences per decode step; unlike vLLM's max_num_seqs, more are admitted (as KV allows) and steps take them in turn, so TPOT grows rather than TTFT");
  f.add("--prefill-policy", &o->cfg.prefill_policy,
        "seed | least_loaded | round_robin | cache_affinity (split: not in sims yet)");
  f.add("--decode-policy", &o->cfg.decode_policy, "seed | least_loaded | round_robin");
  f.add("--kv-queue-max-bypass", &o->cfg.kv_queue_max_bypass,
        "the decode KV queue: later requests that may pass one that fits nowhere before it keeps room (0: strict order)");
  f.add("--prefix-cache-blocks", &o->cfg.prefix_cache_blocks, "per prefill instance: its local tier of prompt blocks");
  f.add("--no-in-flight-sharing", &o->cfg.no_in_flight_sharing,
        "a prompt does not wait for one computing its prefix on its instance (each computes it)");
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
      t->zero_output_rows += more.zero_output_rows;
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
      {"decode_policy", "--decode-policy"}, {"eplb_redundant", "--eplb-redundant"}, {"nic_gbps", "--nic-gbps"},
      {"pcie_gbps", "--pcie-gbps"}, {"ttft_ms", "--ttft-slo-ms"}, {"tbt_ms", "--tbt-slo-ms"}};
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

/// What the runs of one configuration need: its cluster and its arrivals (up to --hi when
/// `searches`, for goodput and compare's goodput column).
std::string runs_problem(const sim_options& o, bool searches) {
  if (auto e = cluster_problem(o); !e.empty()) return e;
  return arrivals_problem(o, searches);
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

std::string trace_run_problem(const sim_options& o, const sims::trace& t, const std::string& name, bool searches) {
  if (auto e = sims::run_problem(o.cfg, t, name); !e.empty()) return with_flag_names(e);
  if (searches) return no_rate_problem(t, name);
  return {};
}

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

std::string variants_problem(const sim_options& o) {
  // Each trace file is read (and cut) once for all the variants that share it. Reading is cheap
  // beside the runs: a whole file parses in a small fraction of one run's time (the goodput
  // search reads it again for each of its runs), and a read finds what opening alone would not --
  // malformed rows, an empty window, arrivals at one instant, a request longer than the KV.
  // Synthetic arrivals are drawn at the run (up to 5e7 of them): their flags are checked here,
  // not the draw.
  struct trace_read {
    bool ok = false;
    sims::trace t;
    std::string name, why;
  };
  std::map<std::string, trace_read> read;
  for (const auto& v : o.variants) {
    sim_options vo;
    std::string vname, why;
    if (!apply_variant(v, o, &vo, &vname, &why)) return why;
    std::string e = runs_problem(vo, true);
    if (e.empty() && !vo.trace_path.empty()) {
      auto it = read.find(trace_key(vo));
      if (it == read.end()) {
        trace_read r;
        r.ok = make_trace(vo, 1.0, &r.t, &r.name, &r.why);
        it = read.emplace(trace_key(vo), std::move(r)).first;
      }
      e = it->second.ok ? trace_run_problem(vo, it->second.t, it->second.name, true) : it->second.why;
    }
    if (!e.empty()) return "variant '" + vname + "': " + e;
  }
  return {};
}

}  // namespace baton::deploy::sim_cli

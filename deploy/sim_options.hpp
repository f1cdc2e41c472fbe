#pragma once

// `baton sim`'s flags as one typed struct -- one declaration for run, goodput and compare and
// for each --variant of compare -- and their checks, made before anything runs: a bad flag found
// after a long trace, after a goodput search's runs or after compare's earlier variants wasted
// them. The command itself (deploy/sim_command.cpp) runs and prints.

#include <cstdint>
#include <string>
#include <vector>

#include "deploy/flags.hpp"
#include "sims/sim_run.hpp"
#include "sims/trace.hpp"

namespace baton::deploy::sim_cli {

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

/// The flags every mode takes (goodput's and compare's own are added by the command).
void add_sim_flags(flag_set& f, sim_options* o);

/// Carries the flags that have no field of their own type into the config (SLOs, links, --kill
/// RANK@SECONDS and --degrade NAME@SECONDS=GBPS as faults, a cost profile read); false and why
/// on a malformed one.
bool finish_options(sim_options* o, std::string* why);

/// The arrivals `o` describes at `scale` times its rate: its trace (and --then-trace ones), cut
/// and scaled, or synthetic ones; `name` says which.
bool make_trace(const sim_options& o, double scale, sims::trace* t, std::string* name, std::string* why);

/// sim_config's field names in a message, given as the flags that set them ("kv_tokens" ->
/// "--kv-tokens"); words inside a path are left alone.
std::string with_flag_names(const std::string& text);

/// What the runs of one configuration need from its flags: its cluster (sims::kv_memory_problem
/// included) and its arrivals' flags (up to --hi when `searches`: goodput and compare's goodput
/// column). Empty when they can run. The trace itself is checked by trace_run_problem.
std::string runs_problem(const sim_options& o, bool searches);

/// Every flag of `mode`, checked before the first run; compare checks its variants instead of
/// the common flags (variants_problem). Empty when all are usable.
std::string options_problem(const sim_options& o, const std::string& mode);

/// What the arrivals `t` (named `name`, made from `o`) ask that `o`'s cluster cannot give
/// (sims::run_problem, in flags' words), and with `searches`, a rate to scale: a goodput search
/// of a trace whose arrivals share one instant printed a goodput of ">= 0.00 requests/s".
std::string trace_run_problem(const sim_options& o, const sims::trace& t, const std::string& name, bool searches);

/// One variant of `baton sim compare`: NAME=FLAGS, the flags applied over the common ones.
bool apply_variant(const std::string& v, const sim_options& base, sim_options* out, std::string* name, std::string* why);

/// compare runs one variant after another: every variant is checked before the first runs --
/// its flags, its cluster, and its trace file read and checked against its cluster (each file
/// read once). Empty when all can run; else the first problem, naming its variant.
std::string variants_problem(const sim_options& o);

}  // namespace baton::deploy::sim_cli

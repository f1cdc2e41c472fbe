#pragma once

// The sim driver (issue 8): the production actors -- router, request actors, balancers, prefill
// and decode ranks -- run under CAF's test coordinator (one thread, virtual time) while a trace's
// requests arrive at their recorded times. Only the executors are modelled: a roofline of a named
// GPU and model shape gives each step's time (sims/roofline.hpp). Deterministic: the same trace
// and configuration give a byte-identical report.
//
// KV handoff between instances takes virtual time on a modelled link: one NIC per GPU, a FIFO
// queue per instance shared by its transfers in and out (transport::link_timing). With the
// shared store on, the real block index (capacity, retention, leaf-first LRU) answers CHECK and
// modelled block servers (sims/modelled_block_server.hpp) take virtual time for every read and
// write-back on one queue per storage node; prefixes stream in layer by layer while the prefill
// computes. A store load also queues on the reader's PCIe (pcie_gbps), not on its NIC.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "policies/cost_model.hpp"
#include "sims/sim_report.hpp"
#include "sims/trace.hpp"

namespace baton::sims {

/// A fault in virtual time at `at_s`: the named rank's or block server's actor is killed (as its
/// process would be) and the actors' real failure handling re-places what it held; or, with
/// `degrade_gbps` > 0, its NIC drops to that many GB/s (the whole instance's) from then on.
struct sim_fault {
  double at_s = 0;
  std::string rank;         ///< prefill-<i>, decode-<i> or (with the store) store-<i>
  double degrade_gbps = 0;  ///< 0: kill
};

struct sim_config {
  std::string model = "llama-3-70b";     ///< a named shape (roofline.hpp)
  std::string prefill_gpu = "H200";      ///< GPU kind of prefill instances
  std::string decode_gpu = "H200";       ///< ... and of decode instances (heterogeneous clusters)
  uint32_t tp = 2;                       ///< GPUs per instance (tensor parallel)
  /// Expert parallelism (MoE models): N > 1 makes each instance of that pool N GPUs with
  /// data-parallel attention and the routed experts sharded N ways (tp does not apply to it).
  uint32_t prefill_ep = 1, decode_ep = 1;
  /// EPLB: redundant copies of hot experts placed by policies::plan_eplb (`eplb_redundant` extra
  /// copies per instance and MoE layer); off: contiguous blocks of experts, one copy each.
  bool eplb = false;
  uint32_t eplb_redundant = 32;
  /// Expert popularity: tokens per expert follow Zipf(expert_skew) over a fixed shuffle of the
  /// experts (0: uniform). The traces carry no routing; this stands in for a measured histogram.
  double expert_skew = 0.5;
  uint32_t gpus_per_node = 8;
  uint32_t prefill_instances = 4;        ///< disaggregated: prefill instances (each one prefill rank)
  uint32_t decode_instances = 4;         ///< disaggregated: decode instances; colocated: all instances
  /// Elastic P/D (issue 15): instances of the decode GPU that serve either role, moved by the
  /// elastic controller and its role planner (targets: the SLOs) as the load shifts; the first
  /// elastic_prefill_at_start start as prefill.
  uint32_t elastic_instances = 0;
  uint32_t elastic_prefill_at_start = 0;
  double elastic_interval_s = 5;         ///< how often the controller reads the ranks and plans
  double elastic_hot = 0.8, elastic_cold = 0.4;  ///< the planner's pool pressure thresholds
  std::string elastic_signal = "mean";           ///< the planner's pool signal: mean or max (tail)
  /// Colocated baseline (vLLM-style continuous batching with chunked prefill): no prefill
  /// instances; every prompt is prefilled on its decode instance in chunks of
  /// `colocated_chunk_tokens` riding with the decode steps (max_num_batched_tokens).
  bool colocated = false;
  uint32_t colocated_chunk_tokens = 2048;
  uint32_t max_batch = 256;              ///< sequences per decode step (max_num_seqs)
  uint32_t prefill_chunk_tokens = 16384; ///< disaggregated prefill chunk
  std::string prefill_policy = "seed";   ///< seed | least_loaded | round_robin | cache_affinity | split
  std::string decode_policy = "seed";    ///< seed | least_loaded | round_robin
  uint32_t kv_queue_max_bypass = 512;    ///< decode_balancer_config::kv_queue_max_bypass (0: strict order)
  uint32_t block_tokens = 512;           ///< prefix-cache block (Mooncake's hash ids are 512-token blocks)
  uint32_t prefix_cache_blocks = 4096;   ///< per prefill rank: its local tier of full prompt blocks
  bool no_in_flight_sharing = false;     ///< prompts do not wait for one computing their prefix on the rank
  /// The shared KV block store (Mooncake's / 3FS-style): finished requests' blocks are written
  /// back and any prefill rank loads them; off: only the prefill ranks' local tiers hit.
  bool store = false;
  uint32_t store_servers = 4;            ///< storage nodes (block servers)
  double store_gbps = 40;                ///< each node's read/write bandwidth (a 3FS node reads ~37 GB/s)
  uint64_t store_capacity_blocks = 0;    ///< the index's capacity in blocks; 0: unbounded
  double pcie_gbps = 0;                  ///< per GPU, host to device, for store loads; 0: the prefill GPU's
  uint32_t page_tokens = 64;             ///< KV page size of the modelled ranks
  uint32_t sim_layers = 4;               ///< layers the actors see (KV ships per layer group); time uses the real count
  /// How the arrivals were made (a trace and its cuts and scale, or the synthetic draw's flags),
  /// as the report's config says it; set by the caller, which knows (empty: only the trace name).
  std::string arrivals;
  /// Step times from per-layer profile tables (`<prefix>_dense.csv`, ... as in
  /// traces/vllm_measured/profiles/, sims/profile_table.hpp) instead of the roofline;
  /// the GPUs' memory still sizes the KV. One profile times every instance.
  std::string profile;
  /// Or step times from fitted cost models (a `baton profile` file: prefill cost(q, c) per
  /// prompt chunk, decode step(n, context)); `cost_profile_name` names its source. Every instance.
  bool use_cost_profile = false;
  policies::cost_model prefill_cost;
  policies::decode_cost_model decode_cost;
  std::string cost_profile_name;
  uint64_t kv_tokens = 0;                ///< KV capacity per instance; 0: from the roofline (HBM after weights)
  /// KV allocation on the decode instances: 0 reserves each sequence's whole length at placement;
  /// N > 0 allocates on demand (prompt + N tokens, then page by page, preempting the youngest
  /// sequence to host memory when full), as vLLM does.
  uint32_t kv_on_demand_tokens = 0;
  bool model_links = true;               ///< KV transfers take time on the instances' NICs (false: free)
  double nic_gbps = 0;                   ///< per GPU; 0: the prefill GPU's (50 GB/s, 400 Gb/s)
  slo slos;
  std::vector<sim_fault> faults;
  uint64_t seed = 1;                     ///< recorded; the replay itself samples nothing
  bool progress = false;                 ///< a progress line on stderr
  /// Virtual time after the last arrival that the sim still waits for answers: a reply lost by
  /// some actor must end as an unanswered request, not a sim that never stops (its timers, the
  /// sampler's and the index's housekeeping, would keep virtual time going for ever).
  double horizon_s = 86400;
  double sample_s = 10;                  ///< the timeline's interval (rank utilisation and queues); 0: none
  std::string validate() const;
};

struct sim_result {
  std::vector<request_outcome> outcomes;  ///< in trace order
  sim_summary summary;
  uint64_t events = 0;                    ///< actor messages and timers processed
  double virtual_s = 0;                   ///< virtual time at the end
  double kv_transfer_gb = 0;              ///< modelled KV bytes moved between instances
  /// Expert parallelism: dispatch and combine bytes over the NICs (between nodes) and over
  /// NVLink (between GPUs of a node), and each pool's busiest-GPU routed load over the mean.
  double ep_cross_node_gb = 0, ep_intra_node_gb = 0;
  double prefill_ep_imbalance = 1, decode_ep_imbalance = 1;
  /// What the engine measured, when the trace records it (vLLM request files): the same
  /// percentiles over the same requests (those the sim completed), to set beside `summary`
  /// (count 0: not recorded).
  percentiles measured_ttft_ms, measured_tpot_ms, measured_e2e_ms;
  sims::timeline timeline;                ///< per rank over virtual time (empty when sample_s is 0)
  std::string json;                       ///< the deterministic report
  std::vector<std::string> role_changes;  ///< elastic P/D: each move, "at_s rank from -> to: why"
};

/// What makes `cfg` unable to run whatever the trace (empty: nothing): validate()'s checks, then
/// the ranks' KV pages, which a rank counts in a uint32_t and this machine holds as carrier KV
/// (kv_tokens too large, or the roofline's capacity times many instances). Asked before a run --
/// by run_sim, and by a caller with several configurations before the first of them runs.
std::string kv_memory_problem(const sim_config& cfg);

/// kv_memory_problem, then what `t` asks of `cfg`: a last arrival within the virtual clock's
/// range, KV pages for the longest request (prompt, on a prefill rank) and the model's context.
/// Everything run_sim refuses before it starts the actors (a profile table's file aside).
std::string run_problem(const sim_config& cfg, const trace& t, const std::string& trace_name);

/// Replays `t` through the cluster `cfg` describes. False and a sentence when the configuration
/// cannot run (unknown GPU or model, KV capacity too small for the longest request, ...).
bool run_sim(const sim_config& cfg, const trace& t, const std::string& trace_name, sim_result* out, std::string* why);

/// Tunes glibc's allocator for a sim process: the sim's mix of large short-lived vectors (prompts)
/// among many small messages makes fastbin consolidation one of its top costs; without fastbins
/// a long trace runs ~15% faster. Process-wide: call it in programs that mostly simulate.
void tune_allocator_for_sims();

/// DistServe's goodput: the highest rate scale at which at least `target` of the requests meet
/// both SLOs, by bisection over [lo, hi]: runs at lo and hi, then one per step (up to steps + 2).
/// `make_trace(scale)` gives the trace at a scale. Returns the scale (0 when even `lo` misses)
/// and each run's (scale, attainment).
double find_goodput(const sim_config& cfg, const std::function<trace(double)>& make_trace, double lo, double hi,
                    uint32_t steps, double target, std::vector<std::pair<double, double>>* runs, std::string* why);

}  // namespace baton::sims

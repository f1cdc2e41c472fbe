#include "sims/sim_run.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <tuple>

#include <malloc.h>
#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "gpu/kv_cache.hpp"
#include "policies/cost_fit.hpp"
#include "policies/eplb.hpp"
#include "policies/placement.hpp"
#include "sims/modelled_block_server.hpp"
#include "sims/modelled_executor.hpp"
#include "sims/profile_table.hpp"
#include "sims/roofline.hpp"
#include "transport/loopback.hpp"

namespace baton::sims {

std::string sim_config::validate() const {
  if (!named_model(model)) return "unknown model '" + model + "' (known: llama-3-8b, llama-3-70b, qwen3-32b, deepseek-v3)";
  for (const auto* g : {&prefill_gpu, &decode_gpu})
    if (!named_gpu(*g)) return "unknown GPU '" + *g + "' (known: H200, H100, H800, RTX4090, RTXPRO6000)";
  if (tp == 0 || decode_instances == 0) return "tp and decode_instances must be >= 1";
  if (prefill_ep == 0 || decode_ep == 0 || gpus_per_node == 0) return "prefill_ep, decode_ep and gpus_per_node must be >= 1";
  if ((prefill_ep > 1 || decode_ep > 1) && named_model(model)->num_experts == 0)
    return "expert parallelism needs a model with routed experts (" + model + " has none)";
  if (!(expert_skew >= 0)) return "expert_skew must be >= 0";
  if (!colocated && prefill_instances == 0 && elastic_prefill_at_start == 0)
    return "a disaggregated cluster needs prefill_instances >= 1 (or elastic instances starting as prefill)";
  if (elastic_prefill_at_start > elastic_instances) return "elastic_prefill_at_start exceeds elastic_instances";
  if (elastic_instances > 0 && colocated) return "elastic instances need a disaggregated cluster";
  // Timers below a millisecond round to 0 and re-arm at the same virtual instant for ever: the
  // clock stops and the sim never ends.
  if (elastic_instances > 0 && !(elastic_interval_s >= 1e-3 && elastic_interval_s <= 1e6))
    return "elastic_interval_s must be between 0.001 and 1e6";
  if (!(sample_s == 0 || (sample_s >= 1e-3 && sample_s <= 1e6))) return "sample_s must be 0 (off) or between 0.001 and 1e6";
  if (!(horizon_s > 0 && horizon_s <= 1e9)) return "horizon_s must be > 0 and at most 1e9";
  if (page_tokens == 0 || block_tokens == 0 || block_tokens % page_tokens != 0)
    return "block_tokens must be a positive multiple of page_tokens";
  if (sim_layers == 0) return "sim_layers must be >= 1";
  // The balancers parse their policy names only when they start, inside a run: checked here too
  // (with the parser they use), so a bad name is refused before any run -- compare ran its
  // earlier variants first. split parses but is refused just below, so it is not offered.
  if (!policies::parse_prefill_policy(prefill_policy))
    return "prefill_policy must be seed, least_loaded, round_robin or cache_affinity, got '" + prefill_policy + "'";
  if (!policies::parse_decode_policy(decode_policy))
    return "decode_policy must be seed, least_loaded or round_robin, got '" + decode_policy + "'";
  // A split prompt's later parts wait, layer by layer, for the earlier parts' KV through the
  // executor's layer gates; the modelled executor does not honour gates yet, so the timing
  // would be wrong (and with timed links the parts stall).
  if (prefill_policy == "split") return "the split prefill policy is not supported in sims yet (layer gates are not modelled)";
  // A target of 0 or less makes every request miss (or, negative, reads as no SLO at all); a
  // negative rate read as "the GPU's default", the same as 0, without a word.
  if (!(slos.ttft_ms > 0) || !(slos.tbt_ms > 0)) return "the SLOs (ttft_ms, tbt_ms) must be > 0";
  if (!(nic_gbps >= 0) || !(pcie_gbps >= 0)) return "nic_gbps and pcie_gbps must be >= 0 (0: the GPU's own rate)";
  // A profile measured at one TP degree (its name says which, as `_tp1`) times only that degree.
  if (auto at = profile.rfind("_tp"); !profile.empty() && at != std::string::npos &&
                                      profile.substr(at + 3) != std::to_string(tp))
    return "the profile " + profile + " was measured at TP " + profile.substr(at + 3) + ", not --tp " + std::to_string(tp);
  if (use_cost_profile && !profile.empty()) return "give a profile table or a cost profile, not both";
  if (store && (store_servers == 0 || !(store_gbps > 0))) return "the store needs store_servers >= 1 and store_gbps > 0";
  if (max_batch == 0 || prefill_chunk_tokens == 0 || colocated_chunk_tokens == 0)
    return "max_batch and chunk sizes must be >= 1";
  for (const auto& f : faults) {  // ranks are named <kind>-<index> (local_cluster)
    bool known = false;
    for (uint32_t i = 0; i < decode_instances && !known; ++i) known = f.rank == "decode-" + std::to_string(i);
    for (uint32_t i = 0; !colocated && i < prefill_instances && !known; ++i) known = f.rank == "prefill-" + std::to_string(i);
    for (uint32_t i = 0; store && i < store_servers && !known; ++i) known = f.rank == "store-" + std::to_string(i);
    if (!known)
      return "fault names no rank '" + f.rank + "' (prefill-<i>, decode-<i> or, with the store, store-<i> of this cluster)";
    if (!(f.at_s >= 0 && f.at_s <= 1e9)) return "fault on " + f.rank + " must be at a time between 0 and 1e9 s";
    // NaN fails both < 0 and > 0: it took the kill path, and infinity made the link free.
    if (!std::isfinite(f.degrade_gbps))
      return "fault on " + f.rank + " degrades its link to a rate that is not a finite number (degrade_gbps)";
    if (f.degrade_gbps < 0) return "fault on " + f.rank + " degrades its link to a negative rate";
    if (f.degrade_gbps > 0 && !model_links) return "a degraded link needs timed links (not --free-links)";
  }
  return {};
}

namespace {

/// What the actors see of the model: the real layer count (or sim_layers of it) for per-layer
/// handoff, a token-sized KV of 2 floats so pages cost little memory, the real context length.
gpu::model_config carrier_model(const model_shape& m, const sim_config& c) {
  gpu::model_config g;
  g.name = m.name + "-modelled";
  g.vocab_size = 64;  // small: every step samples over it (61^512 distinct blocks are plenty)
  g.hidden_size = 8;
  g.intermediate_size = 8;
  g.num_hidden_layers = std::min(c.sim_layers, m.num_layers);
  g.num_attention_heads = 1;
  g.num_key_value_heads = 1;
  g.head_dim = 2;
  g.max_position_embeddings = m.max_context;
  g.bos_token_id = 1;
  g.eos_token_id = 2;
  return g;
}

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// A request's prompt: block b's tokens come from its hash id, so requests that share their
/// first k ids share their first k blocks exactly (the ids are chained). The ids name blocks of
/// the trace's own size (mooncake_block_tokens), whatever block size the simulated store uses.
/// Without ids, every request's tokens are its own.
std::vector<int32_t> prompt_of(const trace_request& r, size_t index, uint32_t block_tokens, uint32_t vocab) {
  std::vector<int32_t> out(r.input_tokens);
  for (uint32_t start = 0, b = 0; start < r.input_tokens; start += block_tokens, ++b) {
    uint64_t x = b < r.hash_ids.size() ? mix(r.hash_ids[b] + 0x5bd1e995) : mix(0xabcdef + index * 1000003 + b);
    for (uint32_t i = start; i < std::min(r.input_tokens, start + block_tokens); ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64: the block's tokens from its seed
      out[i] = static_cast<int32_t>(3 + x % (vocab - 3));  // never bos/eos
    }
  }
  return out;
}

/// An expert-parallel pool's layout: the busiest GPU's share of routed tokens and the fraction
/// of dispatched copies that leave their node, from the expert placement (contiguous blocks, or
/// EPLB's plan) over a Zipf popularity, with tokens spread evenly over the instance's GPUs and
/// each going to a copy on its own node when there is one (policies::pick_replica's rule).
ep_layout ep_layout_for(const model_shape& m, const sim_config& cfg, uint32_t size) {
  ep_layout ep;
  ep.size = size;
  ep.gpus_per_node = cfg.gpus_per_node;
  if (size <= 1 || m.num_experts == 0) return ep;
  std::vector<double> load(m.num_experts);
  for (uint32_t i = 0; i < m.num_experts; ++i)
    load[(uint64_t{i} * 97 + 13) % m.num_experts] = 1.0 / std::pow(i + 1.0, cfg.expert_skew);
  const uint32_t redundant = cfg.eplb ? cfg.eplb_redundant : 0;
  policies::eplb_config ec{size, cfg.gpus_per_node, (m.num_experts + redundant + size - 1) / size, redundant};
  const auto placement = cfg.eplb ? policies::plan_eplb(load, ec) : policies::static_placement(m.num_experts, ec);
  ep.redundant_experts = redundant;
  ep.imbalance = policies::imbalance(policies::rank_loads(placement, load));
  const uint32_t nodes = (size + cfg.gpus_per_node - 1) / cfg.gpus_per_node;
  double total = 0, remote = 0;
  for (uint32_t e = 0; e < m.num_experts; ++e) {
    uint32_t with_copy = 0;  // nodes holding a copy of e
    for (uint32_t n = 0; n < nodes; ++n)
      for (auto r : placement.replicas[e])
        if (r / cfg.gpus_per_node == n) {
          ++with_copy;
          break;
        }
    total += load[e];
    remote += load[e] * (nodes - with_copy) / nodes;
  }
  ep.cross_node_fraction = total > 0 ? remote / total : 0;
  return ep;
}

/// The balancer's cost model, fitted to the prefill instances' roofline (what `baton profile`
/// does on a real GPU), so the seed policy predicts the times the sim will take.
policies::cost_model fitted_cost(const roofline& r) {
  std::vector<policies::prefill_sample> samples;
  for (uint64_t q : {256, 1024, 4096, 16384, 65536})
    for (uint64_t c : {0, 4096, 32768}) samples.push_back({q, c, r.step_us({{static_cast<uint32_t>(q), static_cast<uint32_t>(c)}})});
  if (auto m = policies::fit_cost_model(samples)) return *m;
  return builtin_cpu_cost_model();
}

struct run_state {
  std::vector<request_outcome> outcomes;
  size_t done = 0;
  bool closed = false;  ///< the horizon passed: answers that come later are not counted
};

/// The two pools' rooflines; an expert-parallel pool's layout sizes its weights, hence its KV.
struct pool_rooflines {
  roofline prefill, decode;
};
pool_rooflines rooflines_of(const sim_config& cfg, const model_shape& shape) {
  return {roofline{*named_gpu(cfg.prefill_gpu), shape, cfg.prefill_ep > 1 ? 1 : cfg.tp, ep_layout_for(shape, cfg, cfg.prefill_ep)},
          roofline{*named_gpu(cfg.decode_gpu), shape, cfg.decode_ep > 1 ? 1 : cfg.tp, ep_layout_for(shape, cfg, cfg.decode_ep)}};
}

/// KV tokens per instance of a pool: kv_tokens, or the HBM its roofline leaves after the weights.
uint64_t kv_tokens_of(const sim_config& cfg, const roofline& r) {
  return cfg.kv_tokens ? cfg.kv_tokens : r.kv_capacity_tokens();
}

/// "llama-3-8b on 1 x H200": what holds a pool's KV, for messages.
std::string instance_of(const sim_config& cfg, const roofline& r, const std::string& gpu) {
  return cfg.model + " on " + std::to_string(r.gpus()) + " x " + gpu;
}

}  // namespace

std::string kv_memory_problem(const sim_config& cfg) {
  if (auto e = cfg.validate(); !e.empty()) return e;
  const auto shape = *named_model(cfg.model);
  const auto roofs = rooflines_of(cfg, shape);
  // Each rank's pool is carrier KV, allocated and never written (the modelled executors write no
  // KV, the modelled links move no bytes): it takes address space, not memory, so the pools are
  // not held to this machine's memory together (local_cluster_config::kv_pools_untouched; the
  // expert-parallel split, whose pools add up to 50 GB, peaked at 118 MB). Each is still one
  // allocation, which the kernel refuses past its memory.
  const auto lay = gpu::model_kv_layout(carrier_model(shape, cfg), 1, cfg.page_tokens);
  const long double page_bytes = static_cast<long double>(lay.page_bytes()) * lay.num_layers;
  const long double memory =
      static_cast<long double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<long double>(::sysconf(_SC_PAGESIZE));
  for (const auto& [roof, gpu, is_prefill] :
       {std::tuple{&roofs.decode, cfg.decode_gpu, false}, std::tuple{&roofs.prefill, cfg.prefill_gpu, true}}) {
    if (is_prefill && cfg.colocated) continue;  // no prefill pool
    const uint64_t tokens = kv_tokens_of(cfg, *roof), pages = tokens / cfg.page_tokens;
    if (pages > UINT32_MAX)
      return "an instance's " + std::to_string(tokens) + " KV tokens (" + instance_of(cfg, *roof, gpu) + ") make " +
             std::to_string(pages) + " pages of " + std::to_string(cfg.page_tokens) + ", more than a rank counts (4294967295)";
    if (memory <= 0 || pages * page_bytes <= memory) continue;  // memory unknown: nothing to compare with
    char sizes[96];
    std::snprintf(sizes, sizeof sizes, "%.0Lf MiB in one allocation, more than this machine's %.0Lf MiB",
                  pages * page_bytes / (1 << 20), memory / (1 << 20));
    return std::string{is_prefill ? "a prefill" : "a decode"} + " rank's KV pool of " + std::to_string(pages) +
           " pages (" + std::to_string(tokens) + " KV tokens per instance" +
           (cfg.kv_tokens ? std::string{} : ", the HBM " + instance_of(cfg, *roof, gpu) + " leaves") + "; " +
           std::to_string(static_cast<uint64_t>(page_bytes)) + " bytes of carrier KV a page) needs " + sizes +
           ": give a smaller kv_tokens";
  }
  return {};
}

std::string run_problem(const sim_config& cfg, const trace& t, const std::string& trace_name) {
  if (auto e = kv_memory_problem(cfg); !e.empty()) return e;
  // Virtual time counts nanoseconds in an int64 (about 292 years): a trace past that ended with
  // every request failed and no reason given.
  constexpr double max_virtual_s = 9.0e9;  // ~285 years
  if (!t.requests.empty() &&
      static_cast<double>(t.requests.back().arrival_us) / 1e6 + cfg.horizon_s > max_virtual_s)
    return trace_name + ": its last arrival (" + std::to_string(t.requests.back().arrival_us / 1000000) +
           " s) plus horizon_s passes what the sims' clock counts (9e9 s)";
  const auto shape = *named_model(cfg.model);
  const auto roofs = rooflines_of(cfg, shape);
  // A prefill rank holds only its prompt's KV (the decode rank generates the rest); a decode rank
  // the whole sequence.
  uint64_t longest = 0, longest_prompt = 0;
  for (const auto& r : t.requests) {
    longest = std::max<uint64_t>(longest, uint64_t{r.input_tokens} + r.output_tokens);
    longest_prompt = std::max<uint64_t>(longest_prompt, r.input_tokens);
  }
  // Ranks get as many whole pages as the tokens fill: a request fits in those pages, not in the
  // tokens (a part-page is not allocated).
  auto pages_for = [&](uint64_t tokens) { return (tokens + cfg.page_tokens - 1) / cfg.page_tokens; };
  for (const auto& [roof, gpu, is_prefill] :
       {std::tuple{&roofs.decode, cfg.decode_gpu, false}, std::tuple{&roofs.prefill, cfg.prefill_gpu, true}}) {
    if (is_prefill && cfg.colocated) continue;  // a colocated cluster has no prefill pool (nor elastic ranks)
    const uint64_t tokens = kv_tokens_of(cfg, *roof), pages = tokens / cfg.page_tokens;
    // With faults, a killed decode rank's sequences are prefilled again with their output so far.
    const uint64_t need = is_prefill && cfg.faults.empty() ? longest_prompt : longest;
    if (tokens == 0 && cfg.kv_tokens == 0) {  // the weights alone fill the HBM ("holds 0 KV tokens" said too little)
      char gb[64];
      std::snprintf(gb, sizeof gb, "%.0f GB of weights, %.0f GB of HBM (90%% usable)",
                    (shape.dense_params + shape.routed_params) * shape.bytes_per_param / 1e9,
                    roof->gpu.hbm_gb * roof->gpus());
      return "the weights do not fit " + instance_of(cfg, *roof, gpu) + " (" + gb +
             "): no room for KV; give more GPUs per instance (--tp, or --prefill-ep/--decode-ep)";
    }
    if (pages < pages_for(need) || pages == 0)
      return "an instance holds " + std::to_string(tokens) + " KV tokens (" + std::to_string(pages) + " pages of " +
             std::to_string(cfg.page_tokens) + "; " + instance_of(cfg, *roof, gpu) + "), the longest " +
             (is_prefill ? "prompt" : "request") + " needs " + std::to_string(need) + " (" +
             std::to_string(pages_for(need)) + " pages)";
  }
  if (longest > shape.max_context)
    return "a request needs " + std::to_string(longest) + " tokens, beyond " + cfg.model + "'s context of " +
           std::to_string(shape.max_context);
  return {};
}

bool run_sim(const sim_config& cfg, const trace& t, const std::string& trace_name, sim_result* out, std::string* why) {
  if (auto e = run_problem(cfg, t, trace_name); !e.empty()) {
    *why = e;
    return false;
  }
  const auto shape = *named_model(cfg.model);
  std::shared_ptr<const profile_table> profile;
  if (!cfg.profile.empty()) {
    auto p = profile_table::load(cfg.profile, why);
    if (!p) return false;
    profile = std::make_shared<const profile_table>(std::move(*p));
  }
  const auto roofs = rooflines_of(cfg, shape);
  const roofline& prefill_roof = roofs.prefill;
  const roofline& decode_roof = roofs.decode;
  const uint64_t kv_tokens = kv_tokens_of(cfg, decode_roof);
  // Prefill instances hold their prompts (and local tier) in their own GPUs' memory.
  const uint64_t prefill_kv_tokens = kv_tokens_of(cfg, prefill_roof);

  local_cluster_config cc;
  cc.model = carrier_model(shape, cfg);
  cc.num_prefill_ranks = cfg.colocated ? 0 : cfg.prefill_instances;
  cc.num_decode_ranks = cfg.decode_instances;
  cc.num_elastic_ranks = cfg.elastic_instances;
  cc.elastic_prefill_at_start = cfg.elastic_prefill_at_start;
  cc.elastic.interval_ms = static_cast<uint32_t>(cfg.elastic_interval_s * 1000);
  cc.elastic.drain_timeout_ms = 3'600'000;
  cc.elastic.planner.ttft_target_ms = cfg.slos.ttft_ms;
  cc.elastic.planner.tbt_target_ms = cfg.slos.tbt_ms;
  cc.elastic.planner.hot = cfg.elastic_hot;
  cc.elastic.planner.cold = cfg.elastic_cold;
  cc.elastic.planner.pool_signal = cfg.elastic_signal;
  cc.transport = "modelled";  // the KV is not real: puts are checked and counted, nothing is copied
  cc.decode.first_lease_id = 1;  // lease ids as a run's function, not drawn: runs repeat
  cc.executor.page_size_tokens = cfg.page_tokens;
  cc.executor.num_kv_pages = static_cast<uint32_t>(kv_tokens / cfg.page_tokens);
  cc.kv_pools_untouched = true;
  cc.prefill.chunk_tokens = cfg.prefill_chunk_tokens;
  cc.prefill.step_budget_us = 0;
  cc.prefill.cost = cc.prefill_balancer.cost = cfg.use_cost_profile ? cfg.prefill_cost : fitted_cost(prefill_roof);
  cc.prefill.prefix_cache_blocks = cfg.prefix_cache_blocks;
  cc.prefill.share_in_flight_prefix = !cfg.no_in_flight_sharing;
  cc.prefill.kv_send_timeout_ms = 3'600'000;
  cc.prefill.checksum_kv = false;  // modelled KV is all zeros (the decode side does not verify either)
  cc.prefill_balancer.policy = cfg.prefill_policy;
  cc.decode_balancer.policy = cfg.decode_policy;
  cc.decode_balancer.kv_queue_max_bypass = cfg.kv_queue_max_bypass;
  cc.decode.max_batch_size = cfg.max_batch;
  // Nobody reads the ranks' event logs in a sim: keep them small (they hold batch lists).
  cc.prefill.event_log_events = cc.decode.event_log_events = 64;
  cc.decode.local_prefill_chunk_tokens = cfg.colocated_chunk_tokens;
  cc.decode.verify_kv_checksums = false;
  if (cfg.kv_on_demand_tokens > 0) {
    cc.decode.on_demand_headroom_tokens = cfg.kv_on_demand_tokens;
    cc.decode.host_offload_pages = cc.executor.num_kv_pages;  // preempted sequences wait there
  }  // modelled KV is all zeros: nothing to check, time saved
  // Queueing is what a sim measures: no hop deadline cuts it short (an hour of virtual time).
  auto& rq = cc.router.request;
  rq.place_timeout_ms = rq.queue_timeout_ms = rq.reserve_timeout_ms = rq.prefill_timeout_ms = rq.token_timeout_ms =
      3'600'000;
  rq.lease_ms = 3'600'000;
  // A decode rank that is full when the reservation arrives (the balancer saw it a step ago)
  // refuses; the request is placed again, as in production, with more attempts than a live
  // cluster gives so that an overloaded sim measures queueing rather than refusals.
  rq.max_attempts = 20;
  rq.hybrid_prefill_below_tokens = cfg.colocated ? UINT32_MAX : 0;
  cc.router.max_active_requests = 0;  // admission control off: every trace request is served
  cc.router.max_new_tokens_limit = 0;
  // The store's block size is the prefix cache's unit; without the shared store, only the
  // prefill ranks' local tiers.
  cc.store.block_tokens = cfg.block_tokens;
  cc.store.local_tier_only = !cfg.store;
  if (cfg.store) {
    cc.store.enabled = true;
    cc.store.dir = "(modelled)";  // no files: the servers are modelled
    cc.store.num_servers = cfg.store_servers;
    cc.store.capacity_blocks = cfg.store_capacity_blocks;
    // Carrier blocks are small (KB): small staging buffers keep hundreds of ranks cheap.
    cc.store.staging_bytes = 4ull << 20;
    cc.store.max_pending_write_bytes = 4ull << 20;
  }
  if (auto e = cc.validate(); !e.empty()) {
    *why = e;
    return false;
  }

  caf::actor_system_config sys_cfg;
  register_message_types(sys_cfg);
  sys_cfg.set("scheduler.policy", caf::atom("testing"));
  sys_cfg.set("logger.file-verbosity", caf::atom("quiet"));
  sys_cfg.set("logger.console-verbosity", caf::atom("quiet"));
  caf::actor_system sys{sys_cfg};
  auto& sched = dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler());

  const auto model = cc.model;
  const auto t0 = sched.clock().now();
  auto now_ns = [&sched, t0] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(sched.clock().now() - t0).count();
  };
  std::map<std::string, std::shared_ptr<executor_usage>> usage;  // by rank, for the timeline
  struct all_to_all_bytes {
    double cross_node = 0, intra_node = 0;
  };
  auto ep_traffic = std::make_shared<all_to_all_bytes>();  // every modelled step adds its dispatch/combine
  auto make_exec = [&](const std::string& name) -> std::shared_ptr<gpu::executor> {
    const bool prefill = name.rfind(cc.prefill.name, 0) == 0;  // elastic instances: decode GPUs
    modelled_executor_config m;
    m.usage = usage[name] = std::make_shared<executor_usage>(executor_usage{now_ns});
    m.num_kv_pages = prefill ? static_cast<uint32_t>(prefill_kv_tokens / cfg.page_tokens) : cc.executor.num_kv_pages;
    m.page_size_tokens = cfg.page_tokens;
    m.emitted_token = 7;
    m.coarse_decode = true;
    const roofline roof = prefill ? prefill_roof : decode_roof;
    if (cfg.use_cost_profile) {  // the modelled executor's own cost-model timing
      m.prefill = cfg.prefill_cost;
      m.decode = cfg.decode_cost;
      return make_modelled_executor(model, m);
    }
    m.job_us = [roof, profile, layers = shape.num_layers, a2a = ep_traffic](const gpu::forward_job& job) {
      std::vector<step_seq> seqs;
      seqs.reserve(job.seqs.size());
      for (const auto& s : job.seqs) seqs.push_back({static_cast<uint32_t>(s.tokens.size()), s.start_pos});
      if (profile) return profile->step_us(seqs, layers);
      const auto b = roof.step(seqs);
      a2a->cross_node += b.cross_node_bytes;
      a2a->intra_node += b.intra_node_bytes;
      return b.total_us;
    };
    return make_modelled_executor(model, m);
  };
  // The modelled link: a put of carrier KV stands for kv_bytes_per_token / layer groups bytes
  // per token and layer group, over the instance's tp NICs.
  std::shared_ptr<transport::link_timing> timing;
  transport_wrapper wrap;
  if (cfg.model_links) {
    timing = std::make_shared<transport::link_timing>();
    timing->now_ns = now_ns;
    timing->gbps = (cfg.nic_gbps > 0 ? cfg.nic_gbps : prefill_roof.gpu.nic_gbps) * prefill_roof.gpus();
    // A decode instance moves KV over its own NICs: another GPU, or another width (a wide EP
    // instance has a NIC per GPU), than the prefill instances whose rate is the default.
    const double decode_gbps = (cfg.nic_gbps > 0 ? cfg.nic_gbps : decode_roof.gpu.nic_gbps) * decode_roof.gpus();
    if (decode_gbps != timing->gbps)
      for (uint32_t i = 0; i < cc.num_decode_ranks; ++i) timing->endpoint_gbps[cc.decode.name + "-" + std::to_string(i)] = decode_gbps;
    const double carrier_per_token_layer = static_cast<double>(cc.model.kv_values_per_token()) * sizeof(float);
    timing->bytes_scale = static_cast<double>(shape.kv_bytes_per_token) / cc.model.num_hidden_layers / carrier_per_token_layer;
    auto fabric = transport::make_loopback_fabric();
    wrap = [fabric, timing](std::unique_ptr<transport::transport>, const std::string& name) {
      return std::shared_ptr<transport::transport>{transport::make_modelled_link(fabric, name, timing)};
    };
    cc.prefill.poll_interval_us = 1000;  // transfers land on a 1 ms grid of virtual time
  }
  block_server_factory make_server;
  if (cfg.store) {
    modelled_store_config ms;
    ms.gbps = cfg.store_gbps;
    // Each GPU of the instance loads its shard over its own PCIe link.
    ms.pcie_gbps = (cfg.pcie_gbps > 0 ? cfg.pcie_gbps : prefill_roof.gpu.pcie_gbps) * prefill_roof.gpus();
    ms.bytes_scale = static_cast<double>(shape.kv_bytes_per_token) / cc.model.num_hidden_layers /
                     (static_cast<double>(cc.model.kv_values_per_token()) * sizeof(float));
    make_server = [ms](caf::actor_system& s, block_server_config bc, std::shared_ptr<transport::transport> x,
                       std::vector<block_index_actor> idx) {
      return spawn_modelled_block_server(s, std::move(bc), std::move(x), std::move(idx), ms);
    };
  }
  auto cluster = start_local_cluster(sys, cc, make_exec, wrap, make_server);

  auto st = std::make_shared<run_state>();
  st->outcomes.resize(t.requests.size());
  // The feeder: one timer at a time (the next arrival), which sends every request arriving then.
  sys.spawn([&t, &cfg, &cc, st, router = cluster.router](caf::event_based_actor* self) {
    auto send = [=, &t, &cfg, &cc](size_t i) {
      const auto& r = t.requests[i];
      generate_request req;
      req.prompt_tokens = prompt_of(r, i, mooncake_block_tokens, cc.model.vocab_size);
      req.max_tokens = static_cast<int32_t>(std::max<uint32_t>(1, r.output_tokens));
      req.ignore_eos = true;
      auto& o = st->outcomes[i];
      o.id = r.id;
      o.arrival_us = r.arrival_us;
      o.input_tokens = r.input_tokens;
      o.output_tokens = std::max<uint32_t>(1, r.output_tokens);
      self->request(router, caf::infinite, generate_atom::value, std::move(req))
          .then(
              [=](completion& c) {
                if (st->closed) return;  // past the horizon: already counted as unanswered
                auto& o = st->outcomes[i];
                o.ok = true;
                o.ttft_us = c.ttft_us;
                int64_t sum = 0;
                for (auto x : c.tbt_us) sum += x;
                o.e2e_us = c.ttft_us + sum;
                o.tpot_us = c.tbt_us.empty() ? 0.0 : static_cast<double>(sum) / static_cast<double>(c.tbt_us.size());
                summarize_intervals(c.tbt_us, &o);
                o.cached_tokens = c.cached_tokens;
                o.failovers = c.failovers;
                o.prefill_rank = c.prefill_rank.empty() ? c.decode_rank : c.prefill_rank;
                o.decode_rank = c.decode_rank;
                ++st->done;
              },
              [=](caf::error& e) {
                if (st->closed) return;  // e.g. the shutdown below failing what is still in flight
                st->outcomes[i].error = self->system().render(e);
                ++st->done;
              });
    };
    if (!t.requests.empty())
      self->delayed_send(self, std::chrono::microseconds{t.requests[0].arrival_us}, uint64_t{0});
    return caf::behavior{[=, &t](uint64_t first) {
      const auto at = t.requests[first].arrival_us;
      size_t i = first;
      for (; i < t.requests.size() && t.requests[i].arrival_us == at; ++i) send(i);
      if (i < t.requests.size())
        self->delayed_send(self, std::chrono::microseconds{t.requests[i].arrival_us - at}, uint64_t{i});
    }};
  });

  // The timeline: every sample_s of virtual time, each rank's occupied fraction (from its
  // executor) and its queues (its stats, asked at that instant), until the last request is done.
  auto tl = std::make_shared<timeline>();
  tl->interval_s = cfg.sample_s;
  // Per timeline entry, the actors to ask (an elastic instance's two: the active one answers).
  std::vector<std::vector<caf::actor>> sampled;
  for (const auto& r : cluster.prefill)
    tl->ranks.push_back({r.name, {}, {}, {}, {}}), sampled.push_back({caf::actor_cast<caf::actor>(r.handle)});
  for (const auto& r : cluster.decode)
    tl->ranks.push_back({r.name, {}, {}, {}, {}}), sampled.push_back({caf::actor_cast<caf::actor>(r.handle)});
  for (const auto& e : cluster.elastic)
    tl->ranks.push_back({e.name, {}, {}, {}, {}}),
        sampled.push_back({caf::actor_cast<caf::actor>(e.prefill), caf::actor_cast<caf::actor>(e.decode)});
  if (cfg.sample_s > 0)
    sys.spawn([tl, sampled, st, &usage, total = t.requests.size()](caf::event_based_actor* self) {
      const auto every = std::chrono::microseconds{static_cast<int64_t>(tl->interval_s * 1e6)};
      auto last = std::make_shared<std::vector<int64_t>>(sampled.size(), 0);
      self->delayed_send(self, every, timer_atom::value);
      return caf::behavior{[=, &usage](timer_atom) {
        if (st->done == total || st->closed) return self->quit();
        const double interval_ns = tl->interval_s * 1e9;
        for (size_t i = 0; i < sampled.size(); ++i) {
          auto& r = tl->ranks[i];
          const int64_t occupied = usage.at(r.rank)->occupied_ns();
          r.busy.push_back(std::min(1.0, static_cast<double>(occupied - (*last)[i]) / interval_ns));
          (*last)[i] = occupied;
          const size_t k = r.busy.size() - 1;
          r.running.push_back(0), r.waiting.push_back(0), r.kv_used.push_back(0);  // a dead rank stays at 0
          for (const auto& a : sampled[i])
            self->request(a, caf::infinite, stats_atom::value).then([tl, i, k](const rank_stats& s) {
              if (!s.active) return;  // an elastic instance's side on standby
              auto& r = tl->ranks[i];
              r.running[k] = s.num_running;
              r.waiting[k] = s.num_waiting;
              r.kv_used[k] = s.num_total_pages ? 1.0 - static_cast<double>(s.num_free_pages) / s.num_total_pages : 0.0;
            }, [](caf::error&) {});
        }
        self->delayed_send(self, every, timer_atom::value);
      }};
    });

  // Faults: each kills its rank's (or block server's) actor, or degrades its NIC, at its virtual
  // time (the names were checked by validate()).
  for (const auto& f : cfg.faults) {
    caf::actor victim;
    for (const auto& r : cluster.prefill)
      if (r.name == f.rank) victim = caf::actor_cast<caf::actor>(r.handle);
    for (const auto& r : cluster.decode)
      if (r.name == f.rank) victim = caf::actor_cast<caf::actor>(r.handle);
    for (const auto& r : cluster.store_servers)
      if (r.name == f.rank) victim = caf::actor_cast<caf::actor>(r.handle);
    sys.spawn([victim, f, timing](caf::event_based_actor* self) {
      self->delayed_send(self, std::chrono::microseconds{static_cast<int64_t>(f.at_s * 1e6)}, timer_atom::value);
      return caf::behavior{[=](timer_atom) {
        if (f.degrade_gbps > 0) {
          std::lock_guard<std::mutex> lock{timing->mutex};
          auto e = timing->endpoint_gbps.find(f.rank);  // drops to, never rises to
          timing->endpoint_gbps[f.rank] = std::min(f.degrade_gbps, e != timing->endpoint_gbps.end() ? e->second : timing->gbps);
        } else {
          self->send_exit(victim, caf::exit_reason::kill);
        }
        self->quit();
      }};
    });
  }
  uint64_t events = 0;
  size_t shown = 0;
  const auto horizon = t0 + std::chrono::microseconds{t.requests.empty() ? 0 : t.requests.back().arrival_us} +
                       std::chrono::microseconds{static_cast<int64_t>(cfg.horizon_s * 1e6)};
  bool past_horizon = false;
  for (;;) {
    events += sched.run();
    if (cfg.progress && st->done >= shown + std::max<size_t>(1, t.requests.size() / 100)) {
      shown = st->done;
      std::fprintf(stderr, "\rsim: %zu/%zu requests, %.0f s virtual, %llu events", st->done, t.requests.size(),
                   std::chrono::duration<double>(sched.clock().now() - t0).count(),
                   static_cast<unsigned long long>(events));
    }
    if (st->done == t.requests.size() || !sched.has_pending_timeout()) break;
    if (sched.clock().now() > horizon) {
      past_horizon = true;
      st->closed = true;
      break;
    }
    sched.trigger_timeout();
    ++events;
  }
  if (cfg.progress) std::fprintf(stderr, "\n");
  out->virtual_s = std::chrono::duration<double>(sched.clock().now() - t0).count();
  out->events = events;
  out->kv_transfer_gb = timing ? static_cast<double>(timing->modelled_bytes) / 1e9 : 0.0;
  out->ep_cross_node_gb = ep_traffic->cross_node / 1e9;
  out->ep_intra_node_gb = ep_traffic->intra_node / 1e9;
  out->prefill_ep_imbalance = prefill_roof.ep.imbalance;
  out->decode_ep_imbalance = decode_roof.ep.imbalance;
  // Elastic P/D: the controller's change log, for the report.
  if (cluster.elastic_controller) {
    auto log = std::make_shared<std::vector<role_change>>();
    sys.spawn([log, c = cluster.elastic_controller](caf::event_based_actor* self) {
      self->request(c, caf::infinite, events_atom::value).then([=](std::vector<role_change>& l) {
        *log = std::move(l);
        self->quit();
      });
    });
    for (int i = 0; i < 100 && log->empty() && sched.run() > 0; ++i) {
    }
    for (const auto& c : *log) {
      char line[96];
      std::snprintf(line, sizeof line, "%.1f s %s %s -> %s (%s, %.1f s): ", c.at_s, c.rank.c_str(), c.from.c_str(),
                    c.to.c_str(), c.state.c_str(), c.drain_s);
      out->role_changes.push_back(line + c.why);
    }
  }
  // Stop every actor of the cluster and let them finish: the actor system's destructor waits for
  // them, and under the test coordinator only this thread can run them.
  for (auto& a : cluster.actors()) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  for (size_t i = 0; i < 100000 && (sched.run() > 0 || sched.has_pending_timeout()); ++i)
    if (sched.has_pending_timeout()) sched.trigger_timeouts();
  char horizon_text[64];
  std::snprintf(horizon_text, sizeof horizon_text, "not answered %g s (horizon_s) after the last arrival", cfg.horizon_s);
  for (auto& o : st->outcomes)
    if (!o.ok && o.error.empty())
      o.error = past_horizon ? horizon_text : "not answered when the simulation ran out of events";
  out->outcomes = std::move(st->outcomes);
  out->summary = summarize(out->outcomes, cfg.slos);
  // The measured percentiles over the requests the sim completed: the simulated ones are over
  // those only, and the two are set side by side as errors.
  std::vector<double> mttft, mtpot, me2e;
  for (size_t i = 0; i < t.requests.size(); ++i) {
    const auto& r = t.requests[i];
    if (!out->outcomes[i].ok) continue;
    if (r.measured_ttft_s >= 0) mttft.push_back(r.measured_ttft_s * 1e3);
    if (r.measured_tpot_s >= 0) mtpot.push_back(r.measured_tpot_s * 1e3);
    if (r.measured_e2e_s >= 0) me2e.push_back(r.measured_e2e_s * 1e3);
  }
  out->measured_ttft_ms = percentiles_of(std::move(mttft));
  out->measured_tpot_ms = percentiles_of(std::move(mtpot));
  out->measured_e2e_ms = percentiles_of(std::move(me2e));
  const auto g = as_typed;  // numbers as typed (2000, 0.5)
  std::map<std::string, std::string> echo = {
      {"trace", trace_name},
      {"batching", "max batch " + std::to_string(cfg.max_batch) + " sequences per decode step, prefill chunk " +
                       std::to_string(cfg.prefill_chunk_tokens) + " tokens" +
                       (cfg.colocated ? ", colocated chunk " + std::to_string(cfg.colocated_chunk_tokens) + " tokens" : "") +
                       ", KV page " + std::to_string(cfg.page_tokens) + " tokens, KV queue bypass " +
                       std::to_string(cfg.kv_queue_max_bypass) + ", prefix tier " + std::to_string(cfg.prefix_cache_blocks) +
                       " blocks of " + std::to_string(cfg.block_tokens) + " tokens per prefill rank" +
                       (cfg.no_in_flight_sharing ? " (no in-flight sharing)" : "") + ", " + std::to_string(cfg.sim_layers) +
                       " layer groups"},
      {"model", cfg.model},
      {"mode", cfg.colocated ? "colocated" : "disaggregated"},
      {"prefill", cfg.colocated ? "-" : std::to_string(cfg.prefill_instances) + " x " + std::to_string(prefill_roof.gpus()) + " " + cfg.prefill_gpu +
                                            (cfg.prefill_ep > 1 ? " (EP " + std::to_string(cfg.prefill_ep) + ")" : std::string{})},
      {"decode", std::to_string(cfg.decode_instances) + " x " + std::to_string(decode_roof.gpus()) + " " + cfg.decode_gpu +
                     (cfg.decode_ep > 1 ? " (EP " + std::to_string(cfg.decode_ep) + ")" : std::string{})},
      {"policies", cfg.prefill_policy + " / " + cfg.decode_policy},
      {"kv_tokens_per_instance", std::to_string(kv_tokens) + " decode, " + std::to_string(prefill_kv_tokens) + " prefill"},
      {"store", cfg.store ? std::to_string(cfg.store_servers) + " modelled servers at " + g(cfg.store_gbps) +
                                " GB/s (PCIe " + g((cfg.pcie_gbps > 0 ? cfg.pcie_gbps : prefill_roof.gpu.pcie_gbps) * prefill_roof.gpus()) +
                                " GB/s per prefill instance), capacity " + (cfg.store_capacity_blocks ? std::to_string(cfg.store_capacity_blocks) + " blocks" : std::string{"unbounded"})
                          : std::string{"off (prefill ranks' local tiers only)"}},
      {"step_times", profile                 ? "profile " + profile->source()
                     : cfg.use_cost_profile ? "cost models " + cfg.cost_profile_name
                                            : "roofline"},
      {"kv_allocation", cfg.kv_on_demand_tokens ? "on demand, headroom " + std::to_string(cfg.kv_on_demand_tokens) + " tokens" : "whole sequence"},
      {"links", cfg.model_links ? g(timing->gbps) + " GB/s per instance" : "free"},
      {"slo", "TTFT <= " + g(cfg.slos.ttft_ms) + " ms, TBT <= " + g(cfg.slos.tbt_ms) + " ms"},
      {"seed", std::to_string(cfg.seed)},
  };
  if (!cfg.arrivals.empty()) echo["arrivals"] = cfg.arrivals;
  if (cfg.prefill_ep > 1 || cfg.decode_ep > 1)
    echo["experts"] = std::string{cfg.eplb ? "EPLB, " + std::to_string(cfg.eplb_redundant) + " redundant copies per instance"
                                           : "contiguous blocks, no copies"} +
                      ", Zipf " + g(cfg.expert_skew) + " popularity, " + std::to_string(cfg.gpus_per_node) +
                      " GPUs per node, dual-batch overlap";
  if (cfg.elastic_instances > 0) {
    echo["elastic"] = std::to_string(cfg.elastic_instances) + " x " + std::to_string(cfg.tp) + " " + cfg.decode_gpu + ", " +
                      std::to_string(cfg.elastic_prefill_at_start) + " prefill at start";
    for (size_t i = 0; i < out->role_changes.size(); ++i) {
      char key[48];
      std::snprintf(key, sizeof key, "role change %03zu", i + 1);
      echo[key] = out->role_changes[i];
    }
  }
  for (const auto& f : cfg.faults)
    echo["fault " + f.rank] = f.degrade_gbps > 0 ? "link at " + g(f.degrade_gbps) + " GB/s from " + g(f.at_s) + " s"
                                                 : "killed at " + g(f.at_s) + " s";
  std::map<std::string, double> extra = {
      {"events", static_cast<double>(out->events)},
      {"events_per_request", t.requests.empty() ? 0.0 : static_cast<double>(out->events) / static_cast<double>(t.requests.size())},
      {"virtual_s", out->virtual_s},
      {"kv_transfer_gb", out->kv_transfer_gb}};
  if (cfg.prefill_ep > 1 || cfg.decode_ep > 1) {
    extra["ep_cross_node_gb"] = out->ep_cross_node_gb;
    extra["ep_intra_node_gb"] = out->ep_intra_node_gb;
    extra["prefill_ep_imbalance"] = out->prefill_ep_imbalance;
    extra["decode_ep_imbalance"] = out->decode_ep_imbalance;
  }
  // Fidelity: how close the sim came to what the engine measured on the same requests.
  auto vs = [&](const char* what, const percentiles& sim, const percentiles& measured) {
    if (measured.count == 0) return;
    extra[std::string{"measured_"} + what + "_ms_mean"] = measured.mean;
    extra[std::string{"measured_"} + what + "_ms_p50"] = measured.p50;
    if (measured.mean > 0) extra[std::string{what} + "_mean_error"] = sim.mean / measured.mean - 1;
    if (measured.p50 > 0) extra[std::string{what} + "_p50_error"] = sim.p50 / measured.p50 - 1;
  };
  vs("ttft", out->summary.ttft_ms, out->measured_ttft_ms);
  vs("tpot", out->summary.tpot_ms, out->measured_tpot_ms);
  vs("e2e", out->summary.e2e_ms, out->measured_e2e_ms);
  out->timeline = *tl;
  out->json = report_json(echo, out->summary, extra, cfg.sample_s > 0 ? tl.get() : nullptr);
  return true;
}

void tune_allocator_for_sims() {
  // Prompts of long traces reach 500 KB: above glibc's default mmap threshold (128 KB) every
  // copy between actors would map fresh pages the kernel must zero (12% of a Mooncake replay).
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_MXFAST, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 256 << 20);
}

double find_goodput(const sim_config& cfg, const std::function<trace(double)>& make_trace, double lo, double hi,
                    uint32_t steps, double target, std::vector<std::pair<double, double>>* runs, std::string* why) {
  auto attainment = [&](double scale, bool* ok) {
    sim_result r;
    *ok = run_sim(cfg, make_trace(scale), "goodput", &r, why);
    if (runs && *ok) runs->push_back({scale, r.summary.slo_attainment});
    return *ok ? r.summary.slo_attainment : 0.0;
  };
  bool ok = true;
  if (const double a = attainment(lo, &ok); !ok || a < target) return 0.0;
  if (const double a = attainment(hi, &ok); !ok || a >= target) return ok ? hi : 0.0;
  for (uint32_t i = 0; i < steps && ok; ++i) {
    const double mid = (lo + hi) / 2;
    (attainment(mid, &ok) >= target ? lo : hi) = mid;
  }
  return ok ? lo : 0.0;
}

}  // namespace baton::sims

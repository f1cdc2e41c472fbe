#include "deploy/node_options.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "gpu/kv_cache.hpp"

namespace baton::deploy {

std::string builtin_model_dir() {
  const std::string dir = BATON_MODELS_DIR "/baton-kjv-tiny";
  return std::filesystem::exists(dir + "/config.json") ? dir : "random";
}

namespace {

/// A fault-injection default from the environment; the flags override it. False and a sentence
/// when the value is not a number of milliseconds.
bool fault_from_env(const char* name, uint32_t* out, std::string* why) {
  const char* v = std::getenv(name);
  if (!v || !*v) return true;
  char* end = nullptr;
  const unsigned long x = std::strtoul(v, &end, 10);
  if (*end != '\0' || x > 600000) {
    *why = std::string{name} + " must be a number of milliseconds up to 600000, got '" + v + "'";
    return false;
  }
  *out = static_cast<uint32_t>(x);
  return true;
}

void add_node_flags(flag_set& flags, node_options* o, bool* cuda_fp32) {
  add_security_flags(flags, &o->sec);
  flags.add("--role", &o->role,
            "what this node runs: decode | prefill | store | elastic (ranks the head's elastic controller moves "
            "between prefill and decode; the head needs --elastic-nodes)");
  flags.add("--prefill-at-start", &o->prefill_at_start, "elastic: of the ranks, how many start as prefill (the rest decode)");
  flags.add("--name", &o->name,
            "the node's name (its ranks are <name>, or <name>-0, <name>-1, ... with --ranks > 1; default: <role>-0, or store)");
  flags.add("--connect", &o->connect, "decode, prefill: host:port of the head's node directory");
  flags.add("--listen", &o->listen, "store: host:port where the head connects to adopt this node's block server");
  flags.add("--store-dir", &o->store_dir, "store: the directory of the block files (server-<id> below it)");
  flags.add("--store-capacity-gib", &o->store_capacity_gib,
            "store: disk budget of the block files in GiB; the least recently used are deleted to make room (0 = "
            "unbounded)");
  flags.add("--fault-layer-delay-ms", &o->fault_layer_delay_ms,
            "store, fault injection for tests: each layer of a read waits this long, a slow disk (env "
            "BATON_FAULT_LAYER_DELAY_MS)");
  flags.add("--fault-job-delay-ms", &o->fault_job_delay_ms,
            "decode, prefill, fault injection for tests: each executor job starts this late, a slow GPU (env "
            "BATON_FAULT_JOB_DELAY_MS)");
  flags.add("--prefix-cache-blocks", &o->prefill.prefix_cache_blocks,
            "prefill: full prompt blocks kept in the rank's KV pages for later prompts (0 = only the block store)");
  flags.add("--ranks", &o->num_ranks, "ranks in this process (one per GPU; CPU executors here)");
  flags.add("--event-log-events", &o->event_log_events, event_log_help);
  flags.add("--chunk-tokens", &o->prefill.chunk_tokens, "prefill: largest chunk, in tokens");
  flags.add("--step-budget-us", &o->prefill.step_budget_us, "prefill: size each chunk to this predicted time (0 = fixed)");
  flags.add("--kv-pages", &o->exec.num_kv_pages, "KV pages per rank");
  flags.add("--max-batch-size", &o->rank.max_batch_size,
            "decode: sequences in one decode step, at most; more are admitted as KV allows and steps take them in turn (unlike vLLM's --max-num-seqs, which queues them)");
  flags.add("--speculative-tokens", &o->rank.speculative_tokens,
            "decode: speculative decoding by prompt lookup, up to this many draft tokens per sequence and step (0 = off; CPU executor: a CUDA rank runs none)");
  flags.add("--speculative-max-batch", &o->rank.speculative_max_batch,
            "decode: drafts only in steps of at most this many sequences (0: any; drafts cost compute once a step is compute-bound)");
  flags.add("--prompt-lookup-min", &o->rank.prompt_lookup_min, "decode, speculative decoding: shortest n-gram looked up");
  flags.add("--prompt-lookup-max", &o->rank.prompt_lookup_max, "decode, speculative decoding: longest n-gram looked up");
  flags.add("--page-tokens", &o->exec.page_size_tokens, "tokens per KV page");
  flags.add("--executor-threads", &o->exec.num_threads, "math threads per rank");
  flags.add("--executor", &o->backend.kind, "executor backend: cpu (default) or cuda (ranks in turn on the GPUs this process sees)");
  flags.add("--cuda-fp32", cuda_fp32, "cuda: fp32 weights and KV instead of bf16");
  flags.add("--weights-seed", &o->weights_seed, "seed of `--model random`'s weights (must match the head)");
  flags.add("--scheduler-threads", &o->scheduler_threads, "CAF scheduler threads");
  flags.add("--poll-attempts", &o->poll_attempts, "CAF work-stealing moderate-poll-attempts");
  flags.add("--drain-timeout-ms", &o->drain_timeout_ms, "on SIGTERM, stop anyway after this long");
  flags.add("--model", &o->model_dir,
            "the head's model directory (the built-in one by default, as the head's), or `random` for the seeded random model");
  flags.add("--expert-parallel", &o->expert_parallel,
            "MoE models: split each rank's routed experts over N EP ranks (N - 1 `baton experts` processes)");
  flags.add("--dual-batch-overlap", &o->dual_batch_overlap, "with --expert-parallel: two micro-batches per MoE round");
  flags.add("--expert-restarts", &o->expert_restarts,
            "with --expert-parallel (without --dp-attention): failed starts in a row of a rank's new expert shards "
            "(after one died; 1 s apart, doubling; shards that die within 30 s of their start count as failed) before "
            "the node leaves with exit code 3, to be restarted or replaced by a spare (0 = keep trying)");
  flags.add("--eplb-slots", &o->eplb.slots_per_rank,
            "with --expert-parallel: expert copies each EP rank holds; above experts / N, live EPLB places copies of "
            "hot experts (0 = off)");
  flags.add("--eplb-interval", &o->eplb.interval_rounds, "live EPLB: MoE rounds between plans");
  flags.add("--dp-attention", &o->dp_attention,
            "decode, with --expert-parallel N: the cluster's decode ranks form data-parallel groups of N, each rank "
            "running attention for its own requests and serving 1/N of every MoE layer's experts to its group, in "
            "lockstep (instead of each rank leading N - 1 expert processes); groups may span node processes");
  flags.add("--dp-first-rank", &o->dp_first_rank,
            "with --dp-attention: the cluster-wide index of this node's first decode rank (rank F + i is member "
            "(F + i) % N of group (F + i) / N; members in other nodes meet through the head)");
  flags.add("--head-wait-s", &o->head_wait_s,
            "decode, prefill, elastic: when the head goes away, stop this node's ranks but keep its model, and wait "
            "this long for a head at --connect to come back (restarted: `baton launch --restart-failed`), then "
            "join it afresh; a head not there yet when the node starts is waited for as long (0 = leave at once)");
  flags.add("--dp-meet-timeout-s", &o->dp_meet_timeout_s,
            "with --dp-attention: how long this node waits at the head for its groups' members in other nodes "
            "(Ctrl-C ends the wait at once)");
  flags.add("--dp-shrink-after-s", &o->dp_shrink_after_s,
            "with --dp-attention: a group re-forming after a loss meets without the lost members once it has waited "
            "this long for them, its experts spread over the members left, and grows back when they return "
            "(0 = never: it waits up to --dp-meet-timeout-s, then leaves to be restarted)");
  flags.add("--dp-step-timeout-ms", &o->dp_step_timeout_ms,
            "with --dp-attention: a member silent this long in a step breaks its group, which then re-forms "
            "(longer tolerates slower steps; shorter frees the other members sooner)");
  flags.add("--ucx-send", &o->ucx_send, "how this node's ranks send KV: put (RMA) or am (rendezvous active messages)");
  flags.add("--standby", &o->standby,
            "decode, prefill, elastic: a spare standing by: load the model (with --dp-attention every routed expert, "
            "its members being unknown yet), then wait for one line on stdin with the flags of the node it stands in "
            "for (`--dp-first-rank N`, or nothing) before joining the head; `baton launch` starts spares so");
}

}  // namespace

std::string node_options::rank_name(uint32_t i) const {
  return num_ranks > 1 ? name + "-" + std::to_string(i) : name;
}

std::string node_options::validate() {
  if (role != "decode" && role != "prefill" && role != "store" && role != "elastic")
    return "--role must be decode, prefill, store or elastic (got '" + role + "')";
  if (auto e = backend.validate(); !e.empty()) return e;
  if (auto e = sec.validate(); !e.empty()) return e;
  if (name.empty()) name = role == "store" ? "store" : role + "-0";
  rank.name = prefill.name = name;
  if (role == "store") {
    if (standby) return "--standby is for decode, prefill and elastic nodes (a spare), not store nodes";
    if (listen.empty() || store_dir.empty()) return "--role store needs --listen HOST:PORT and --store-dir DIR";
    return store::capacity_gib_error(store_capacity_gib, "--store-capacity-gib");
  }
  if (store_capacity_gib != 0) return "--store-capacity-gib budgets a store node's disk: it needs --role store";
  if (std::string why; !parse_host_port(connect, "--connect", &head_host, &head_port, &why) || head_port == 0)
    return why.empty() ? "--connect needs a non-zero port" : why;
  if (num_ranks == 0) return "--ranks must be >= 1";
  if (role == "elastic" && prefill_at_start > num_ranks)
    return "--prefill-at-start " + std::to_string(prefill_at_start) + " exceeds --ranks " + std::to_string(num_ranks);
  if (eplb.slots_per_rank && expert_parallel < 2)
    return "--eplb-slots places expert copies over EP ranks: it needs --expert-parallel N >= 2";
  if (dp_first_rank && !dp_attention) return "--dp-first-rank numbers data-parallel members: it needs --dp-attention";
  if (dp_meet_timeout_s == 0) return "--dp-meet-timeout-s must be at least 1";
  if (dp_shrink_after_s && (!dp_attention || dp_shrink_after_s >= dp_meet_timeout_s))
    return "--dp-shrink-after-s " + std::to_string(dp_shrink_after_s) +
           " needs --dp-attention and must be below --dp-meet-timeout-s (" + std::to_string(dp_meet_timeout_s) +
           "): a meeting must be able to shrink before it times out";
  if (dp_step_timeout_ms < 100)  // it also bounds the EPLB weight transfers between steps
    return "--dp-step-timeout-ms must be at least 100";
  if (dp_attention && (role != "decode" || expert_parallel < 2))
    return "--dp-attention groups decode ranks: it needs --role decode and --expert-parallel N >= 2";
  if (expert_parallel > 1 && backend.kind != "cpu")
    return "--expert-parallel " + std::to_string(expert_parallel) + " runs on the CPU executor (not --executor " +
           backend.kind + ")";
  return (role != "prefill" ? rank.validate() : std::string{}) + (role != "decode" ? prefill.validate() : std::string{}) +
         exec.validate();
}

std::string node_options::validate_for(const gpu::model_config& model) const {
  if (!serves_ranks()) return {};
  if (expert_parallel > 1 && model.moe.n_routed_experts < expert_parallel)
    return "--expert-parallel " + std::to_string(expert_parallel) + " needs a model with at least that many routed " +
           "experts (" + model.name + " has " + std::to_string(model.moe.n_routed_experts) + ")";
  return gpu::kv_pools_fit_memory(model, exec.num_kv_pages, exec.page_size_tokens, 1);
}

std::optional<int> parse_node_options(const std::vector<std::string>& args, node_options* out) {
  apply_serving_prefill_defaults(&out->prefill);
  std::string why;
  if (!fault_from_env("BATON_FAULT_JOB_DELAY_MS", &out->fault_job_delay_ms, &why) ||
      !fault_from_env("BATON_FAULT_LAYER_DELAY_MS", &out->fault_layer_delay_ms, &why)) {
    std::fprintf(stderr, "baton node: %s\n", why.c_str());
    return 2;
  }
  flag_set flags;
  bool cuda_fp32 = false;
  add_node_flags(flags, out, &cuda_fp32);
  if (auto rc = flags.parse_command_line(
          args, "node",
          "baton node --role decode|prefill|elastic --connect HOST:PORT | --role store --listen HOST:PORT [flags]"))
    return rc;
  out->backend.cuda_bf16 = !cuda_fp32;
  if (why = out->validate(); !why.empty()) {
    std::fprintf(stderr, "baton node: %s\n", why.c_str());
    return 2;
  }
  return std::nullopt;
}

}  // namespace baton::deploy

// `baton node --role decode|prefill|store`: decode or prefill ranks, or a block server, in their
// own process. A rank node's agent joins the head's node directory (published by `baton local
// --serve --cluster-listen`, or by `baton local --decode-processes`), gets the balancers and the
// block store from it, starts the ranks, and heartbeats. Decode ranks receive KV over UCX and stream tokens to request actors in
// the head; prefill ranks load cached prefixes from the block servers and send KV to decode ranks
// over UCX -- all messages through CAF's network layer. SIGTERM or SIGINT drains the node: no new
// placements, the running work finishes, then it leaves. When the head goes away its ranks stop,
// and it waits (--head-wait-s) for a head at the same address to join afresh, its model loaded.
//
// A store node is the other way round: it listens (--listen), and the head connects to it at
// start and adopts its block server, whose files live on this node's disk. It outlives heads:
// a new head adopts it again. SIGTERM or SIGINT stops it.

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <iterator>
#include <sstream>
#include <poll.h>
#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/exit_reason.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "actors/decode_rank.hpp"
#include "actors/prefill_rank.hpp"
#include "actors/store_host.hpp"
#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "actors/node_agent.hpp"
#include "deploy/commands.hpp"
#include "deploy/dp_meeting.hpp"
#include "deploy/expert_processes.hpp"
#include "deploy/flags.hpp"
#include "deploy/net_security.hpp"
#include "deploy/processes.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/cuda_executor.hpp"
#include "gpu/fault_executor.hpp"
#include "transport/ucx.hpp"

namespace baton::deploy {

namespace {

/// Fault injection defaults from the environment (a cluster spec's node "env" sets them for one
/// node in multi-process tests); the flags override them. False: the value is not a number.
bool fault_from_env(const char* name, uint32_t* out) {
  const char* v = std::getenv(name);
  if (!v || !*v) return true;
  char* end = nullptr;
  const unsigned long x = std::strtoul(v, &end, 10);
  if (*end != '\0' || x > 600000) {
    std::fprintf(stderr, "baton node: %s must be a number of milliseconds up to 600000, got '%s'\n", name, v);
    return false;
  }
  *out = static_cast<uint32_t>(x);
  return true;
}

/// `--role store`: publishes the store host and serves until a stop signal.
int run_store_node(caf::actor_system& sys, const net_security& sec, const std::string& listen, store_host_config cfg) {
  std::string host, why;
  uint16_t port = 0;
  if (!parse_host_port(listen, "--listen", &host, &port, &why)) {
    std::fprintf(stderr, "baton node %s: %s\n", cfg.name.c_str(), why.c_str());
    return 2;
  }
  const std::string name = cfg.name, dir = cfg.dir;
  auto store = spawn_store_host(sys, std::move(cfg), [](const std::string& name, std::string* why) {
    return std::shared_ptr<transport::transport>{transport::make_ucx_transport({name}, why)};
  });
  auto bound = publish_actor(sys, sec, store, port, host);
  if (!bound) {
    std::fprintf(stderr, "baton node %s: cannot listen on %s: %s\n", name.c_str(), listen.c_str(),
                 sys.render(bound.error()).c_str());
    caf::anon_send_exit(store, caf::exit_reason::user_shutdown);
    return 1;
  }
  std::printf("baton node %s: store node on %s:%u, blocks under %s; waiting for the head to adopt it\n", name.c_str(),
              host.c_str(), static_cast<unsigned>(*bound), dir.c_str());
  std::fflush(stdout);
  while (!stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds{100});
  caf::anon_send_exit(store, caf::exit_reason::user_shutdown);
  std::printf("baton node %s: stopped\n", name.c_str());
  return 0;
}

}  // namespace

int run_node(const std::vector<std::string>& args) {
  std::string role = "decode", connect, listen;
  store_host_config store_cfg;
  uint32_t fault_job_delay_ms = 0;
  decode_rank_config rank;
  prefill_rank_config prefill;  // chunked as the head's own prefill ranks are
  apply_serving_prefill_defaults(&prefill);
  gpu::cpu_executor_config exec_cfg;
  uint64_t weights_seed = local_cluster_config{}.weights_seed;
  uint32_t scheduler_threads = 2, poll_attempts = 0, num_ranks = 1;
  node_agent_config agent_cfg;
  net_security sec;
  if (!fault_from_env("BATON_FAULT_JOB_DELAY_MS", &fault_job_delay_ms) ||
      !fault_from_env("BATON_FAULT_LAYER_DELAY_MS", &store_cfg.fault_layer_delay_ms))
    return 2;
  flag_set flags;
  add_security_flags(flags, &sec);
  flags.add("--role", &role,
            "what this node runs: decode | prefill | store | elastic (ranks the head's elastic controller moves "
            "between prefill and decode; the head needs --elastic-nodes)");
  uint32_t prefill_at_start = 0;
  flags.add("--prefill-at-start", &prefill_at_start, "elastic: of the ranks, how many start as prefill (the rest decode)");
  std::string name;
  flags.add("--name", &name,
            "the node's name (its ranks are <name>, or <name>-0, <name>-1, ... with --ranks > 1; default: <role>-0, or store)");
  flags.add("--connect", &connect, "decode, prefill: host:port of the head's node directory");
  flags.add("--listen", &listen, "store: host:port where the head connects to adopt this node's block server");
  flags.add("--store-dir", &store_cfg.dir, "store: the directory of the block files (server-<id> below it)");
  flags.add("--fault-layer-delay-ms", &store_cfg.fault_layer_delay_ms,
            "store, fault injection for tests: each layer of a read waits this long, a slow disk (env "
            "BATON_FAULT_LAYER_DELAY_MS)");
  flags.add("--fault-job-delay-ms", &fault_job_delay_ms,
            "decode, prefill, fault injection for tests: each executor job starts this late, a slow GPU (env "
            "BATON_FAULT_JOB_DELAY_MS)");
  flags.add("--prefix-cache-blocks", &prefill.prefix_cache_blocks,
            "prefill: full prompt blocks kept in the rank's KV pages for later prompts (0 = only the block store)");
  flags.add("--ranks", &num_ranks, "ranks in this process (one per GPU; CPU executors here)");
  flags.add("--chunk-tokens", &prefill.chunk_tokens, "prefill: largest chunk, in tokens");
  flags.add("--step-budget-us", &prefill.step_budget_us, "prefill: size each chunk to this predicted time (0 = fixed)");
  flags.add("--kv-pages", &exec_cfg.num_kv_pages, "KV pages per rank");
  flags.add("--page-tokens", &exec_cfg.page_size_tokens, "tokens per KV page");
  flags.add("--executor-threads", &exec_cfg.num_threads, "math threads per rank");
  gpu::backend_config backend;
  bool cuda_fp32 = false;
  flags.add("--executor", &backend.kind, "executor backend: cpu (default) or cuda");
  flags.add("--cuda-fp32", &cuda_fp32, "cuda: fp32 weights and KV instead of bf16");
  flags.add("--weights-seed", &weights_seed, "seed of `--model random`'s weights (must match the head)");
  flags.add("--scheduler-threads", &scheduler_threads, "CAF scheduler threads");
  flags.add("--poll-attempts", &poll_attempts, "CAF work-stealing moderate-poll-attempts");
  flags.add("--drain-timeout-ms", &agent_cfg.drain_timeout_ms, "on SIGTERM, stop anyway after this long");
  std::string model_dir = "random";
  flags.add("--model", &model_dir, "the head's model directory, or `random` for the seeded random model");
  uint32_t expert_parallel = 1;
  bool dual_batch_overlap = false;
  std::string ucx_send = "put";
  flags.add("--expert-parallel", &expert_parallel,
            "MoE models: split each rank's routed experts over N EP ranks (N - 1 `baton experts` processes)");
  flags.add("--dual-batch-overlap", &dual_batch_overlap, "with --expert-parallel: two micro-batches per MoE round");
  uint32_t expert_restarts = 5;
  flags.add("--expert-restarts", &expert_restarts,
            "with --expert-parallel (without --dp-attention): failed starts in a row of a rank's new expert shards "
            "(after one died; 1 s apart, doubling; shards that die within 30 s of their start count as failed) before the node leaves with exit code 3, to be restarted or "
            "replaced by a spare (0 = keep trying)");
  bool dp_attention = false;
  uint32_t dp_first_rank = 0;
  gpu::live_eplb_config eplb;
  flags.add("--eplb-slots", &eplb.slots_per_rank,
            "with --expert-parallel: expert copies each EP rank holds; above experts / N, live EPLB places copies of "
            "hot experts (0 = off)");
  flags.add("--eplb-interval", &eplb.interval_rounds, "live EPLB: MoE rounds between plans");
  flags.add("--dp-attention", &dp_attention,
            "decode, with --expert-parallel N: the cluster's decode ranks form data-parallel groups of N, each rank "
            "running attention for its own requests and serving 1/N of every MoE layer's experts to its group, in "
            "lockstep (instead of each rank leading N - 1 expert processes); groups may span node processes");
  flags.add("--dp-first-rank", &dp_first_rank,
            "with --dp-attention: the cluster-wide index of this node's first decode rank (rank F + i is member "
            "(F + i) % N of group (F + i) / N; members in other nodes meet through the head)");
  uint32_t head_wait_s = 60;
  flags.add("--head-wait-s", &head_wait_s,
            "decode, prefill, elastic: when the head goes away, stop this node's ranks but keep its model, and wait "
            "this long for a head at --connect to come back (restarted: `baton launch --restart-failed`), then "
            "join it afresh (0 = leave at once)");
  uint32_t dp_meet_timeout_s = 120;
  flags.add("--dp-meet-timeout-s", &dp_meet_timeout_s,
            "with --dp-attention: how long this node waits at the head for its groups' members in other nodes "
            "(Ctrl-C ends the wait at once)");
  uint32_t dp_shrink_after_s = 0;
  flags.add("--dp-shrink-after-s", &dp_shrink_after_s,
            "with --dp-attention: a group re-forming after a loss meets without the lost members once it has waited "
            "this long for them, its experts spread over the members left, and grows back when they return "
            "(0 = never: it waits up to --dp-meet-timeout-s, then leaves to be restarted)");
  uint32_t dp_step_timeout_ms = 10'000;
  flags.add("--dp-step-timeout-ms", &dp_step_timeout_ms,
            "with --dp-attention: a member silent this long in a step breaks its group, which then re-forms "
            "(longer tolerates slower steps; shorter frees the other members sooner)");
  flags.add("--ucx-send", &ucx_send, "how this node's ranks send KV: put (RMA) or am (rendezvous active messages)");
  bool standby = false;
  flags.add("--standby", &standby,
            "decode, prefill, elastic: a spare standing by: load the model (with --dp-attention every routed expert, "
            "its members being unknown yet), then wait for one line on stdin with the flags of the node it stands in "
            "for (`--dp-first-rank N`, or nothing) before joining the head; `baton launch` starts spares so");
  if (auto rc = flags.parse_command_line(
          args, "node",
          "baton node --role decode|prefill|elastic --connect HOST:PORT | --role store --listen HOST:PORT [flags]"))
    return *rc;
  backend.cuda_bf16 = !cuda_fp32;
  if (auto e = backend.validate(); !e.empty()) {
    std::fprintf(stderr, "baton node: %s\n", e.c_str());
    return 2;
  }
  if (role != "decode" && role != "prefill" && role != "store" && role != "elastic") {
    std::fprintf(stderr, "baton node: --role must be decode, prefill, store or elastic (got '%s')\n", role.c_str());
    return 2;
  }
  if (role == "elastic" && prefill_at_start > num_ranks) {
    std::fprintf(stderr, "baton node: --prefill-at-start %u exceeds --ranks %u\n", prefill_at_start, num_ranks);
    return 2;
  }
  if (auto e = sec.validate(); !e.empty()) {
    std::fprintf(stderr, "baton node: %s\n", e.c_str());
    return 2;
  }
  if (standby && role == "store") {
    std::fprintf(stderr, "baton node: --standby is for decode, prefill and elastic nodes (a spare), not store nodes\n");
    return 2;
  }
  if (name.empty()) name = role == "store" ? "store" : role + "-0";
  rank.name = prefill.name = store_cfg.name = name;
  if (role == "store") {
    if (listen.empty() || store_cfg.dir.empty()) {
      std::fprintf(stderr, "baton node: --role store needs --listen HOST:PORT and --store-dir DIR\n");
      return 2;
    }
    if (std::string why; !ensure_writable_dir(store_cfg.dir, "--store-dir", &why)) {
      std::fprintf(stderr, "baton node: %s\n", why.c_str());
      return 2;
    }
    install_stop_signals();
    caf::actor_system_config cfg;
    configure_networked_system(cfg, scheduler_threads, poll_attempts, sec);
    caf::actor_system sys{cfg};
    return run_store_node(sys, sec, listen, std::move(store_cfg));
  }
  std::string host, why;
  uint16_t port = 0;
  if (!parse_host_port(connect, "--connect", &host, &port, &why) || port == 0) {
    std::fprintf(stderr, "baton node: %s\n", why.empty() ? "--connect needs a non-zero port" : why.c_str());
    return 2;
  }
  if (num_ranks == 0) {
    std::fprintf(stderr, "baton node: --ranks must be >= 1\n");
    return 2;
  }
  // A data-parallel node loads the routed experts of its own members' blocks and no others
  // (DeepSeek-V3's experts are 97% of its weights: no node of a wide-EP group could hold them all).
  // A spare standing by does not know its members yet: it loads every expert.
  std::vector<uint32_t> local_members;
  for (uint32_t i = 0; dp_attention && expert_parallel > 1 && !standby && i < num_ranks; ++i)
    local_members.push_back((dp_first_rank + i) % expert_parallel);
  const gpu::expert_filter node_experts =
      local_members.empty() ? gpu::expert_filter{} : keep_blocks_of(local_members, expert_parallel);
  local_cluster_config loaded;  // the model this node serves: the head's
  if (model_dir != "random") {
    if (!load_model_into(model_dir, &loaded, &why, node_experts)) {
      std::fprintf(stderr, "baton node: %s\n", why.c_str());
      return 2;
    }
  }
  auto model = loaded.model;
  // Constrained decoding walks the model's vocabulary on the ranks that pick tokens (a built-in
  // model has no tokenizer here: the ranks use its byte vocabulary).
  if (loaded.router.tokenizer) rank.vocabulary = prefill.vocabulary = loaded.router.tokenizer->vocabulary();
  if (eplb.slots_per_rank && expert_parallel < 2) {
    std::fprintf(stderr, "baton node: --eplb-slots places expert copies over EP ranks: it needs --expert-parallel N >= 2\n");
    return 2;
  }
  if (dp_first_rank && !dp_attention) {
    std::fprintf(stderr, "baton node: --dp-first-rank numbers data-parallel members: it needs --dp-attention\n");
    return 2;
  }
  if (dp_meet_timeout_s == 0) {
    std::fprintf(stderr, "baton node: --dp-meet-timeout-s must be at least 1\n");
    return 2;
  }
  if (dp_shrink_after_s && (!dp_attention || dp_shrink_after_s >= dp_meet_timeout_s)) {
    std::fprintf(stderr, "baton node: --dp-shrink-after-s %u needs --dp-attention and must be below "
                         "--dp-meet-timeout-s (%u): a meeting must be able to shrink before it times out\n",
                 dp_shrink_after_s, dp_meet_timeout_s);
    return 2;
  }
  if (dp_step_timeout_ms < 100) {  // it also bounds the EPLB weight transfers between steps
    std::fprintf(stderr, "baton node: --dp-step-timeout-ms must be at least 100\n");
    return 2;
  }
  if (dp_attention && (role != "decode" || expert_parallel < 2)) {
    std::fprintf(stderr, "baton node: --dp-attention groups decode ranks: it needs --role decode and "
                         "--expert-parallel N >= 2\n");
    return 2;
  }
  if (expert_parallel > 1 && (model.moe.n_routed_experts < expert_parallel || backend.kind != "cpu")) {
    std::fprintf(stderr, "baton node: --expert-parallel %u needs a model with at least that many routed experts "
                         "(%s has %u) on the CPU executor\n",
                 expert_parallel, model.name.c_str(), model.moe.n_routed_experts);
    return 2;
  }
  if (auto err = (role != "prefill" ? rank.validate() : std::string{}) + (role != "decode" ? prefill.validate() : std::string{}) +
                 exec_cfg.validate();
      !err.empty() || !(err = gpu::kv_pools_fit_memory(model, exec_cfg.num_kv_pages, exec_cfg.page_size_tokens, 1)).empty()) {
    std::fprintf(stderr, "baton node: %s\n", err.c_str());
    return 2;
  }

  install_stop_signals();
  caf::actor_system_config cfg;
  configure_networked_system(cfg, scheduler_threads, poll_attempts, sec);
  caf::actor_system sys{cfg};
  auto directory = connect_actor<node_directory_actor>(sys, sec, host, port);
  // The head's directory now: a head that restarts is joined afresh, and meetings after that go
  // to the new one (re-formings run on threads of their own).
  struct head_link {
    std::mutex m;
    node_directory_actor dir;
    node_directory_actor get() {
      std::lock_guard<std::mutex> lock{m};
      return dir;
    }
  };
  auto head = std::make_shared<head_link>();
  if (directory) head->dir = *directory;
  if (!directory) {
    std::fprintf(stderr, "baton node %s: cannot reach the head's node directory at %s: %s\n", name.c_str(),
                 connect.c_str(), explain_connect_error(sys, directory.error(), sec.tls()).c_str());
    return 1;
  }
  // The model, with the routed experts `keep` chooses, from a directory or drawn from the seed.
  // A data-parallel node's members take their blocks out of it, and the node loads it again only
  // when a group re-forms.
  auto load_weights = [=](const gpu::expert_filter& keep, std::string* err) -> std::shared_ptr<const gpu::model_weights> {
    local_cluster_config again;  // a directory's weights; a built-in model's come from the seed
    if (model_dir != "random" && !load_model_into(model_dir, &again, err, keep)) return nullptr;
    if (again.weights) return again.weights;
    return std::make_shared<gpu::model_weights>(gpu::make_seeded_weights(model, weights_seed, keep));
  };
  auto weights = loaded.weights ? loaded.weights : load_weights(node_experts, &why);
  loaded.weights.reset();  // `weights` holds the model now; a data-parallel node replaces it below
  if (standby) {
    // The model is loaded: taking a failed node's place costs no load from here on.
    std::printf("baton node %s: standing by with the model loaded; waiting for the flags of the node to stand in for\n",
                name.c_str());
    std::fflush(stdout);
    std::string line;
    if (!read_stand_in(&line)) {
      std::printf("baton node %s: stood by; %s\n", name.c_str(),
                  stop_requested() ? "stopped" : "its launcher left (stdin closed)");
      return 0;
    }
    if (!parse_stand_in(line, &dp_first_rank, &why)) {
      std::fprintf(stderr, "baton node %s: standing by: %s\n", name.c_str(), why.c_str());
      return 2;
    }
    if (dp_first_rank && !dp_attention) {
      std::fprintf(stderr, "baton node %s: standing by: --dp-first-rank numbers data-parallel members: it needs "
                           "--dp-attention\n", name.c_str());
      return 2;
    }
    std::printf("baton node %s: stands in%s\n", name.c_str(), line.empty() ? "" : (" (" + line + ")").c_str());
    std::fflush(stdout);
  }
  auto rank_name_of = [name, num_ranks](uint32_t i) { return num_ranks > 1 ? name + "-" + std::to_string(i) : name; };
  // The node's members of its data-parallel groups, and its executors: a group that lost a member
  // re-forms in place (below), replacing its members here while the executors rejoin it.
  struct dp_members {
    /// Where a re-forming group is. A loss notice means the old group while it is `meeting`; the
    /// new one once it has `met` (held until its members are in place, then applied to them);
    /// and it is applied to the new members directly once they are `assigned`.
    enum class stage { meeting, met, assigned };
    struct lost_note {
      std::vector<uint32_t> members;  ///< in the new group's numbering
      std::string why;
      bool everyone = false;  ///< the new group must re-form at once (it lacks a member that came back)
    };
    std::mutex m;
    std::vector<std::shared_ptr<gpu::expert_peers>> peers;  ///< [local rank]
    std::vector<std::shared_ptr<gpu::executor>> execs;      ///< [local rank], once started
    std::map<uint32_t, stage> reforming;                    ///< groups re-forming now
    std::map<uint32_t, std::vector<lost_note>> held;        ///< losses of groups that have met, not yet assigned
    std::map<uint32_t, dp_shape> shapes;                    ///< each group's shape (the new one's from `met` on)
    /// Return notices (members back at the group's shrunk meeting) that came while it was meeting
    /// again: if it then meets shrunk, it re-forms once more, at full size.
    std::map<uint32_t, std::string> noticed;
    struct reformer {
      std::thread thread;
      std::shared_ptr<std::atomic<bool>> done;
    };
    std::vector<reformer> threads;  ///< the re-formings: finished ones joined at the next start, the rest at exit
  };
  auto dp = std::make_shared<dp_members>();
  dp->execs.resize(num_ranks);
  // Ranks with expert shards of their own: a lost shard is started afresh (the rank steps aside
  // meanwhile), not left to fail the rank for good.
  // A group that cannot re-form in place, or expert shards that cannot be started again: the
  // node drains and leaves with exit code 3, so that whoever restarts it (`baton launch
  // --restart-failed`, a Kubernetes pod) brings it back whole; a data-parallel group meets afresh
  // at the head once every node of its lost meeting has gone.
  auto group_lost = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<expert_group_keeper> keeper;
  if (expert_parallel > 1 && !dp_attention) {
    expert_keeper_config kc;
    kc.give_up_after = expert_restarts;
    kc.give_up = [group_lost, name](const std::string& label, const std::string&) {
      std::printf("baton node %s: %s's expert shards cannot be started again; leaving so that the node is restarted "
                  "or replaced\n",
                  name.c_str(), label.c_str());
      std::fflush(stdout);
      group_lost->store(true);
    };
    keeper = std::make_shared<expert_group_keeper>("baton node " + name, std::move(kc));
  }
  // Set when this node leaves (a stop, or a group that could not re-form): meetings in progress end.
  auto leaving = std::make_shared<std::atomic<bool>>(false);
  // Set while the head is away (from its loss until a new agent runs): meetings in progress end,
  // no re-form starts, and one that fails meanwhile does not make the node leave.
  auto head_down = std::make_shared<std::atomic<bool>>(false);
  const dp_layout dp_at{num_ranks, dp_first_rank, expert_parallel};
  const dp_meeting_config dp_meet{name, dp_meet_timeout_s, dp_shrink_after_s,
                                  {.slot_bytes = engine_slot_bytes(model, prefill, rank),
                                   .timeout = std::chrono::milliseconds{dp_step_timeout_ms},
                                   .dual_batch = dual_batch_overlap},
                                  eplb, ucx_send,
                                  [leaving, head_down] { return stop_requested() || leaving->load() || head_down->load(); }};
  auto meet_shrunk = [=, &sys](uint32_t g, const dp_shape& shape, std::string* err) {
    return meet_shrunk_group(sys, head->get(), dp_at, g, shape, model, dp_meet, load_weights, err);
  };
  // Data-parallel groups first: their members in other nodes wait for these at the head.
  if (dp_attention) {
    // A node coming back to a group that re-forms (its meeting is not the group's first at this
    // head) may find it closing without members still missing: it then meets the others as the
    // smaller group too, with stores of their own (`filled`).
    std::vector<bool> filled;
    why.clear();
    for (uint32_t g = dp_at.first_group(); g <= dp_at.last_group() && why.empty(); ++g) {
      dp_shape shape;
      auto members = meet_dp_group(sys, *directory, dp_at, g, {}, dp_shrink_after_s > 0, model, dp_meet, &shape, &why);
      if (members.empty() && shape.shrunk()) {
        std::printf("baton node %s: data-parallel %s\n", name.c_str(), why.c_str());
        why.clear();
        members = meet_shrunk(g, shape, &why);
        dp->shapes[g] = shape;
      }
      if (members.empty() && why.empty()) why = "group dp" + std::to_string(g) + " did not meet";
      dp->peers.insert(dp->peers.end(), members.begin(), members.end());
      filled.resize(dp->peers.size(), shape.shrunk());
    }
    if (!why.empty()) {
      std::fprintf(stderr, "baton node %s: data-parallel attention: %s\n", name.c_str(), why.c_str());
      return stop_requested() ? 0 : 1;  // asked to stop while meeting: not a failure to restart
    }
    // Each member serves routed experts from its own store: its block, moved out of the weights
    // (which hold only this node's blocks when they come from a directory); the weights the
    // executors share then keep none.
    gpu::model_weights attention_only = gpu::take_or_copy(std::move(weights));
    std::printf("baton node %s: loaded %zu of %u routed experts per layer from %s\n", name.c_str(),
                gpu::held_experts(model, attention_only, model.moe.first_k_dense_replace).size(),
                model.moe.n_routed_experts, model_dir == "random" ? "the seed" : model_dir.c_str());
    for (size_t i = 0; i < dp->peers.size(); ++i)
      if (!filled[i]) dp->peers[i]->take_block(model, attention_only);
    gpu::keep_expert_block(model, attention_only, expert_parallel, expert_parallel);  // what a seeded model has left
    weights = std::make_shared<const gpu::model_weights>(std::move(attention_only));
    const uint32_t first_moe = model.moe.first_k_dense_replace;
    for (uint32_t i = 0; i < num_ranks; ++i)
      std::printf("baton node %s: rank %s is member %u of data-parallel group %s, serving %zu of %u routed experts "
                  "per layer\n",
                  name.c_str(), rank_name_of(i).c_str(), dp->peers[i]->rank(),
                  dp->shapes[dp_at.group_of(i)].meeting(dp_at.group_of(i)).c_str(),
                  dp->peers[i]->held(first_moe).size(), model.moe.n_routed_experts);
    std::fflush(stdout);
  }
  agent_cfg.hello = {name, {role}, static_cast<int32_t>(::getpid()),
                     model_fingerprint(model)};
  // Re-forming group `g` in place: this node's members meet the others afresh at the head, whose
  // directory holds the meeting until every node of the lost one has gone or posted again (the
  // lost node restarted, or a replacement under its name). The new members' stores are filled
  // from the model loaded again, and each executor rejoins between jobs; its rank then takes work
  // again. The node never restarts, so its other groups, its KV pools and its block-store
  // connections stay.
  auto reform = [=, &sys](uint32_t g) {
    std::string err;
    // The members' stores come from the model loaded again (the executors' shared weights keep
    // no routed experts), before the meeting: once it completes, the others may step at once, and
    // a load from disk could outlast their step timeout. So while it waits at the head, a node
    // holds a second copy of the shared weights and of this group's members' blocks.
    const auto group_members = dp_at.members_of(g);
    auto full = load_weights(keep_blocks_of(group_members, expert_parallel), &err);
    std::vector<std::shared_ptr<gpu::expert_peers>> members;
    dp_shape shape;  // full, unless the head closes the meeting without lost members
    if (full) members = meet_dp_group(sys, head->get(), dp_at, g, {}, dp_shrink_after_s > 0, model, dp_meet, &shape, &err);
    if (!members.empty()) {
      auto blocks = gpu::take_or_copy(std::move(full));
      for (auto& m : members) m->take_block(model, blocks);
    } else if (shape.shrunk()) {
      std::printf("baton node %s: data-parallel %s\n", name.c_str(), err.c_str());
      std::fflush(stdout);
      full.reset();
      err.clear();
      members = meet_shrunk(g, shape, &err);
    }
    full.reset();
    if (!members.empty()) {
      std::lock_guard<std::mutex> lock{dp->m};
      dp->reforming[g] = dp_members::stage::met;  // a loss from here on is the new group's
      dp->shapes[g] = shape;
      // A shrunk group told, while it met, that members came back to its full meeting re-forms
      // once more: the full group may meet now.
      if (auto n = dp->noticed.find(g); n != dp->noticed.end() && shape.shrunk())
        dp->held[g].push_back({{}, n->second, true});
      dp->noticed.erase(g);
    }
    // The executors of this group's ranks: after a head came back, the new ones may still be
    // starting (bounded wait).
    for (int i = 0; i < 200 && !members.empty(); ++i) {
      bool all = true;
      {
        std::lock_guard<std::mutex> lock{dp->m};
        for (uint32_t r = 0; r < num_ranks; ++r) all = all && (dp_at.group_of(r) != g || dp->execs[r]);
      }
      if (all || stop_requested() || leaving->load()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds{50});
    }
    if (!members.empty()) {
      std::lock_guard<std::mutex> lock{dp->m};
      for (uint32_t i = 0, j = 0; i < num_ranks && err.empty(); ++i) {
        if (dp_at.group_of(i) != g) continue;
        auto& exec = dp->execs[i];
        if (!exec) err = "rank " + rank_name_of(i) + " has no executor yet";
        else if (!exec->rejoin_group(members[j], &err)) err = "rank " + rank_name_of(i) + ": " + err;
        else dp->peers[i] = members[j];
        ++j;
      }
      if (err.empty()) {
        // Losses told while the stores filled: the new members step aside at once, and the group
        // re-forms again once they have switched (watch_groups).
        for (const auto& note : dp->held[g])
          for (auto& m : members) {
            if (note.everyone) m->retire(note.why);
            for (uint32_t lost : note.members) m->peer_lost(lost, note.why);
          }
        dp->held.erase(g);
        dp->reforming[g] = dp_members::stage::assigned;
      }
    }
    if (!members.empty() && err.empty()) {
      // Each executor switches between jobs (after the one it runs); until all have, the group
      // stays re-forming, so that its old failure does not count as a new break (watch_groups).
      bool switched = false;
      while (!switched && !stop_requested() && !leaving->load() && !head_down->load()) {
        switched = true;
        {
          std::lock_guard<std::mutex> lock{dp->m};
          for (uint32_t i = 0; i < num_ranks; ++i)
            if (dp_at.group_of(i) == g && dp->execs[i]->rejoin_pending()) switched = false;
        }
        if (!switched) std::this_thread::sleep_for(std::chrono::milliseconds{10});
      }
      std::lock_guard<std::mutex> lock{dp->m};
      dp->reforming.erase(g);
      if (switched) {
        const std::string as = shape.shrunk() ? " as " + std::to_string(shape.present.size()) + " of " +
                                                    std::to_string(expert_parallel) + " members (" + shape.meeting(g) + ")"
                                              : std::string{};
        std::printf("baton node %s: data-parallel group dp%u re-formed in place%s; its ranks here take work again\n",
                    name.c_str(), g, as.c_str());
        std::fflush(stdout);
      }
      return;
    }
    {
      std::lock_guard<std::mutex> lock{dp->m};
      dp->reforming.erase(g);
      dp->held.erase(g);
      dp->noticed.erase(g);
    }
    // A meeting that failed because the head went away (its loss may reach this node's agent a
    // moment after the meeting's error) is not the group's fault: the group re-forms at the head
    // that comes back.
    for (int i = 0; i < 20 && !head_down->load() && !stop_requested() && !leaving->load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds{50});
    if (head_down->load()) {
      std::printf("baton node %s: data-parallel group dp%u did not re-form (%s): the head went away; it re-forms at the "
                  "next head\n",
                  name.c_str(), g, err.c_str());
      std::fflush(stdout);
      return;
    }
    if (!stop_requested() && !leaving->load())
      std::printf("baton node %s: data-parallel group dp%u could not re-form in place (%s); leaving so that it re-forms "
                  "from restarted nodes\n",
                  name.c_str(), g, err.c_str());
    std::fflush(stdout);
    group_lost->store(true);
  };
  // Starts re-forming group `g` unless it is already meeting afresh (dp->m held).
  auto start_reform = [=](uint32_t g, const std::string& cause) {
    if (leaving->load() || stop_requested() || head_down->load()) return;  // on its way out, or no head to meet at
    if (!dp->reforming.emplace(g, dp_members::stage::meeting).second) return;  // on_member_gone routes its losses
    std::printf("baton node %s: data-parallel group dp%u re-forms in place (%s): waiting at the head for its "
                "members to meet again\n",
                name.c_str(), g, cause.c_str());
    std::fflush(stdout);
    std::erase_if(dp->threads, [](dp_members::reformer& r) {  // each finished one's stack goes
      if (!r.done->load()) return false;
      r.thread.join();
      return true;
    });
    auto done = std::make_shared<std::atomic<bool>>(false);
    dp->threads.push_back({std::thread([reform, g, done] {
                             reform(g);
                             done->store(true);
                           }),
                           done});
  };
  // A group can also break with no node seen to go: a member stalled past the all-to-all's
  // timeout mid-step, one stopped on purpose (its abort word), one whose process died after the
  // meeting but before its node joined the head (seen at the next step). Its members here then
  // report a standing failure, and the group re-forms as after a loss. Polled by the main loop.
  auto watch_groups = [=] {
    if (head_down->load()) return;  // the ranks stopped: their groups re-form at the head that comes back
    std::lock_guard<std::mutex> lock{dp->m};
    for (uint32_t i = 0; i < dp->execs.size(); ++i) {
      const uint32_t g = dp_at.group_of(i);
      if (!dp->execs[i] || dp->reforming.count(g)) continue;
      if (auto failure = dp->execs[i]->standing_failure(); !failure.empty()) start_reform(g, failure);
    }
  };
  // A node of one of this node's groups went: its members are lost, and this node's members of
  // that group step aside at once (each rank then refuses work and reports no room), then meet
  // afresh with the lost member's replacement (reform above).
  agent_cfg.on_member_gone = [=](const std::string& meeting, const std::vector<uint32_t>& members, const std::string& why,
                                 bool returned) {
    const std::string channel = meeting.substr(0, meeting.find('/'));  // "dp3/b" is dp3's second channel
    const std::string group = channel.substr(0, channel.find('~'));     // "dp3~5": dp3 shrunk (see dp_meeting.hpp)
    const uint64_t serial = channel.size() > group.size() ? std::strtoull(channel.c_str() + group.size() + 1, nullptr, 10) : 0;
    std::lock_guard<std::mutex> lock{dp->m};
    uint32_t g = dp_at.first_group();
    while (g <= dp_at.last_group() && group != "dp" + std::to_string(g)) ++g;
    if (g > dp_at.last_group()) return;  // not a group of this node's
    const auto r = dp->reforming.find(g);
    const bool met = r != dp->reforming.end() && r->second == dp_members::stage::met;
    // Members that came back to a shrunk meeting while this node meets again (as the smaller
    // group, say): once met, the group re-forms at full size.
    if (r != dp->reforming.end() && r->second == dp_members::stage::meeting && returned && meeting == channel)
      dp->noticed[g] = why;
    // The notice in the group's own numbering. A shrunk group's meeting names its indices; the
    // full meeting names the layout's, and a member the shrunk group lacks came back (or its
    // meeting is over): the group re-forms at full size.
    const dp_shape& shape = dp->shapes[g];
    std::vector<uint32_t> lost;
    bool everyone = false;
    if (returned) {
      if (!shape.shrunk() || serial != 0) return;  // the group is whole already: an old notice
      everyone = true;
    } else if (serial != shape.serial) {
      if (serial != 0) return;  // about a shrunk group that is no more
      for (uint32_t m : members) {
        const int64_t k = shape.index_of(m);
        if (k < 0) everyone = true;  // a member it lacks: its meeting is over
        else lost.push_back(static_cast<uint32_t>(k));
      }
    } else {
      lost = members;
    }
    // A group whose new meeting completed but whose members are not in place yet: the loss is
    // the new group's, applied once they are (reform).
    if (met) {
      dp->held[g].push_back({lost, why, everyone});
      return;
    }
    for (uint32_t i = 0; i < dp->peers.size(); ++i) {
      if (dp_at.group_of(i) != g) continue;
      if (everyone) dp->peers[i]->retire(why);
      for (uint32_t m : lost) dp->peers[i]->peer_lost(m, why);
      if (meeting != channel) continue;  // dual-batch overlap's second channel: the same members, said once
      std::string line = "baton node " + name + ": rank " + rank_name_of(i) + " steps aside: data-parallel group " +
                         channel + (everyone ? " re-forms" : " lost member(s)");
      for (uint32_t m : everyone ? std::vector<uint32_t>{} : lost) line.append(1, ' ').append(std::to_string(m));
      line += " (" + why + ")\n";
      std::fputs(line.c_str(), stdout);
    }
    std::fflush(stdout);
    if (meeting == channel && !dp->peers.empty()) start_reform(g, everyone ? "a member it lacks came back" : "lost member(s)");
  };
  auto start = [=](caf::actor_system& sys, const cluster_welcome& w, node_actors* out) -> std::string {
    // The cluster's block store, if it runs one: decode ranks write finished sequences back to
    // it, prefill ranks load cached prefixes from it -- through UCX, like the head's own ranks.
    const auto store = store_access::from_info(w.store);
    if (role == "elastic" && !w.elastic_controller)
      return "elastic ranks need the head's elastic controller: start the head with --elastic-nodes";
    for (uint32_t i = 0; i < num_ranks; ++i) {
      const std::string rank_name = rank_name_of(i);
      std::string why;
      std::shared_ptr<transport::transport> xport{transport::make_ucx_transport({.name = rank_name, .send = ucx_send}, &why)};
      if (!xport) return "rank " + rank_name + ": UCX: " + why;
      // An elastic instance's decode actor has a transport of its own.
      std::shared_ptr<transport::transport> decode_xport;
      if (role == "elastic") {
        decode_xport = transport::make_ucx_transport({.name = rank_name + "-decode", .send = ucx_send}, &why);
        if (!decode_xport) return "rank " + rank_name + ": UCX: " + why;
      }
      // The KV pool in the transport's memory: peers on this host (prefill ranks sending KV, the
      // store's servers) then store into it directly, without this process's progress thread.
      // An elastic instance's pool belongs to its decode side, which receives prompts' KV.
      auto ec = exec_cfg;
      ec.kv_memory = kv_pool_in(decode_xport ? decode_xport : xport);
      std::shared_ptr<gpu::executor> exec;
      if (dp_attention) {
        {
          std::lock_guard<std::mutex> lock{dp->m};  // a re-form may replace it meanwhile
          ec.peers = dp->peers[i];
        }
        exec = gpu::make_cpu_executor(model, weights, ec);
      } else if (expert_parallel > 1) {
        const expert_spawn spawn{model_dir,    weights_seed, expert_parallel, engine_slot_bytes(model, prefill, rank),
                                 rank_name, dual_batch_overlap};
        auto group = spawn_expert_group(spawn, model, &why);
        if (!group) return "rank " + rank_name + ": expert parallelism: " + why;
        if (eplb.slots_per_rank && !group->enable_eplb(eplb, model.moe.n_routed_experts, &why))
          return "rank " + rank_name + ": expert parallelism: " + why;
        ec.experts = std::move(group);
        exec = gpu::make_cpu_executor(model, weights, ec);
        keeper->add(exec, spawn, model, eplb);
      } else {
        exec = gpu::make_backend_executor(backend, model, weights, ec);
      }
      if (fault_job_delay_ms) exec = gpu::make_fault_slow_executor(std::move(exec), fault_job_delay_ms);
      if (dp_attention) {
        std::lock_guard<std::mutex> lock{dp->m};
        dp->execs[i] = exec;  // rejoins its group when the group re-forms
      }
      if (role == "elastic") {
        // The side not serving is on standby until the head's controller moves the instance.
        auto e = spawn_elastic_instance(sys, rank_name, i < prefill_at_start, prefill, rank, std::move(exec),
                                        std::move(xport), std::move(decode_xport), w.prefill_balancer,
                                        w.decode_balancer, store);
        caf::anon_send(w.elastic_controller, controller_join{rank_name, e.prefill, e.decode, e.serves_prefill});
        out->ranks.prefill.push_back(e.prefill);
        out->ranks.decode.push_back(e.decode);
      } else if (role == "decode") {
        auto rc = rank;
        rc.name = rank_name;
        out->ranks.decode.push_back(spawn_decode_rank(sys, rc, std::move(exec), std::move(xport), w.decode_balancer, store));
        // Its load counts in the decode pool's pressure when the head moves elastic ranks.
        if (w.elastic_controller)
          caf::anon_send(w.elastic_controller, controller_join{rank_name, {}, out->ranks.decode.back(), false});
      } else {
        auto pc = prefill;
        pc.name = rank_name;
        out->ranks.prefill.push_back(
            spawn_prefill_rank(sys, pc, std::move(exec), std::move(xport), w.prefill_balancer, store));
        if (w.elastic_controller)
          caf::anon_send(w.elastic_controller, controller_join{rank_name, out->ranks.prefill.back(), {}, true});
      }
      out->ranks.names.push_back(rank_name);
    }
    std::printf("baton node %s: joined the head; %u %s rank(s) serving\n", name.c_str(), num_ranks, role.c_str());
    std::fflush(stdout);
    return {};
  };
  // Set by the agent as it stops the ranks because the head went away (before it ends itself).
  agent_cfg.on_head_lost = [head_down] { head_down->store(true); };
  auto agent = spawn_node_agent(sys, *directory, agent_cfg, start);
  caf::scoped_actor self{sys};
  self->monitor(agent);
  bool gone = false, drain_sent = false, leaving_for_group = false, no_head = false;
  caf::error reason;
  for (uint32_t heads = 1;; ++heads) {
    while (!gone) {
      if (dp_attention && !drain_sent) watch_groups();
      if ((stop_requested() || group_lost->load()) && !drain_sent) {
        leaving_for_group = !stop_requested();
        leaving->store(true);  // re-formings still meeting give up
        self->send(agent, drain_atom::value);
        drain_sent = true;
      }
      self->receive(
          [&](const caf::down_msg& dm) {
            gone = true;
            reason = dm.reason;
          },
          caf::after(std::chrono::milliseconds{100}) >> [] {});
    }
    if (!head_down->load() || drain_sent || head_wait_s == 0 || stop_requested()) break;
    // The head went away (crashed, or restarted): the agent stopped the ranks, whose executors
    // stop with them; the model stays loaded. A head that comes back at the same address is
    // joined afresh, and the ranks start again with new executors over the same weights (a
    // data-parallel group's members, broken by the stop, re-form through the new head).
    std::printf("baton node %s: the head went away; its ranks stopped; waiting up to %u s for a head at %s (the model "
                "stays loaded)\n",
                name.c_str(), head_wait_s, connect.c_str());
    std::fflush(stdout);
    {
      // Re-formings meeting at the old head end (cancelled); the stopped executors go, so that
      // nothing re-forms around them before the new ranks start.
      std::vector<dp_members::reformer> ending;
      {
        std::lock_guard<std::mutex> lock{dp->m};
        ending.swap(dp->threads);
      }
      for (auto& r : ending) r.thread.join();
      std::lock_guard<std::mutex> lock{dp->m};
      for (auto& x : dp->execs) x.reset();
      dp->reforming.clear();
      dp->held.clear();
      dp->noticed.clear();
    }
    std::string last = "nothing listens there";
    const auto next = connect_actor_until<node_directory_actor>(
        sys, sec, host, port, std::chrono::steady_clock::now() + std::chrono::seconds{head_wait_s}, stop_requested, &last,
        head->get());
    if (!next) {
      if (!stop_requested())
        std::fprintf(stderr, "baton node %s: no head came back at %s within %u s (%s); leaving\n", name.c_str(),
                     connect.c_str(), head_wait_s, last.c_str());
      no_head = !stop_requested();
      break;
    }
    {
      std::lock_guard<std::mutex> lock{head->m};
      head->dir = *next;
    }
    std::printf("baton node %s: a head is back at %s; joining it (head %u)\n", name.c_str(), connect.c_str(), heads + 1);
    std::fflush(stdout);
    head_down->store(false);  // from here on, groups re-form at this head
    agent = spawn_node_agent(sys, *next, agent_cfg, start);
    self->monitor(agent);
    gone = false;
    reason = {};
  }
  leaving->store(true);
  std::vector<dp_members::reformer> reformings;
  {
    std::lock_guard<std::mutex> lock{dp->m};
    reformings.swap(dp->threads);  // no new one starts: the agent is gone
  }
  for (auto& r : reformings) r.thread.join();
  // The executors and members go now, before the actor system: the agent's callbacks (which
  // outlive it in agent_cfg) hold `dp` too, and a rank's KV pool must go with its executor.
  std::vector<std::shared_ptr<gpu::expert_peers>> final_peers;
  {
    std::lock_guard<std::mutex> lock{dp->m};
    dp->execs.clear();
    final_peers = std::move(dp->peers);
    dp->peers.clear();
  }
  for (uint32_t i = 0; i < final_peers.size(); ++i)  // what each data-parallel member's live EPLB did
    if (eplb.slots_per_rank)
      std::printf("baton node %s: rank %s: %llu EPLB plans, %llu bytes of expert weights received, %llu experts dropped\n",
                  name.c_str(), rank_name_of(i).c_str(), static_cast<unsigned long long>(final_peers[i]->plans()),
                  static_cast<unsigned long long>(final_peers[i]->bytes_installed()),
                  static_cast<unsigned long long>(final_peers[i]->experts_evicted()));
  final_peers.clear();
  std::fflush(stdout);
  if (no_head) return 1;
  if (leaving_for_group) {
    std::printf("baton node %s: left to be restarted (exit code 3): its data-parallel group could not re-form in "
                "place, or its expert shards could not be started again\n",
                name.c_str());
    return 3;
  }
  if (reason && reason != caf::exit_reason::normal) {
    std::fprintf(stderr, "baton node %s: %s\n", name.c_str(), sys.render(reason).c_str());
    return drain_sent ? 0 : 1;  // after a drain request, leaving is the goal
  }
  if (drain_sent) std::printf("baton node %s: drained and left\n", name.c_str());
  return 0;
}

}  // namespace baton::deploy

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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/exit_reason.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/sec.hpp>
#include <caf/send.hpp>

#include "actors/decode_rank.hpp"
#include "actors/prefill_rank.hpp"
#include "actors/store_host.hpp"
#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "actors/node_agent.hpp"
#include "deploy/commands.hpp"
#include "deploy/utc_stamp.hpp"
#include "deploy/dp_meeting.hpp"
#include "deploy/expert_processes.hpp"
#include "deploy/flags.hpp"
#include "deploy/net_security.hpp"
#include "deploy/node_options.hpp"
#include "deploy/processes.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/cuda_executor.hpp"
#include "gpu/fault_executor.hpp"
#include "transport/ucx.hpp"

namespace baton::deploy {

namespace {

/// `--role store`: publishes the store host and serves until a stop signal.
int run_store_node(const node_options& o) {
  // Its own lock in the directory, by name: store nodes (and a head's own servers) may share one
  // directory on a host, each server in its server-N below it under that folder's own lock (the
  // block server's); the same node started twice is refused here. (The directory's one lock
  // refused every second store process on a host: the spec's documented layout did not start.)
  std::string lock_name = ".lock-" + o.name;
  std::replace(lock_name.begin(), lock_name.end(), '/', '_');
  if (std::string why; !ensure_writable_dir(o.store_dir, "--store-dir", &why) ||
                       !hold_store_dir(o.store_dir, "--store-dir", &why, lock_name)) {
    std::fprintf(stderr, "baton node: %s\n", why.c_str());
    return 2;
  }
  std::string host, why;
  uint16_t port = 0;
  if (!parse_host_port(o.listen, "--listen", &host, &port, &why)) {
    std::fprintf(stderr, "baton node %s: %s\n", o.name.c_str(), why.c_str());
    return 2;
  }
  install_stop_signals();
  caf::actor_system_config cfg;
  configure_networked_system(cfg, o.scheduler_threads, o.poll_attempts, o.sec);
  caf::actor_system sys{cfg};
  store_host_config store_cfg;
  store_cfg.name = o.name;
  store_cfg.dir = o.store_dir;
  store_cfg.fault_layer_delay_ms = o.fault_layer_delay_ms;
  store_cfg.capacity_bytes = store::capacity_bytes_of(o.store_capacity_gib);
  auto store = spawn_store_host(sys, std::move(store_cfg), [](const std::string& name, std::string* why) {
    return std::shared_ptr<transport::transport>{transport::make_ucx_transport({name}, why)};
  });
  auto bound = publish_actor(sys, o.sec, store, port, host);
  if (!bound) {
    std::fprintf(stderr, "baton node %s: cannot listen on %s: %s\n", o.name.c_str(), o.listen.c_str(),
                 sys.render(bound.error()).c_str());
    caf::anon_send_exit(store, caf::exit_reason::user_shutdown);
    return 1;
  }
  const uint64_t capacity = store::capacity_bytes_of(o.store_capacity_gib);
  const std::string budget = capacity ? "at most " + std::to_string(capacity) + " bytes" : "no capacity limit";
  std::printf("baton node %s: store node on %s:%u, blocks under %s (%s); waiting for the head to adopt it (a head "
              "adopts store nodes as it starts, and again within a second when one it had comes back)\n",
              o.name.c_str(), host.c_str(), static_cast<unsigned>(*bound), o.store_dir.c_str(), budget.c_str());
  std::fflush(stdout);
  while (!stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds{100});
  caf::anon_send_exit(store, caf::exit_reason::user_shutdown);
  std::printf("baton node %s: stopped\n", o.name.c_str());
  return 0;
}

/// `--standby`: the model is loaded, so taking a failed node's place costs no load from here on.
/// Waits for the line with the flags of the node to stand in for; an exit code when the node
/// ends here instead (stopped, its launcher gone, or a line it cannot take).
std::optional<int> stand_by(node_options& o) {
  std::printf("baton node %s: standing by with the model loaded; waiting for the flags of the node to stand in for\n",
              o.name.c_str());
  std::fflush(stdout);
  std::string line, why;
  if (!read_stand_in(&line)) {
    std::printf("baton node %s: stood by; %s\n", o.name.c_str(),
                stop_requested() ? "stopped" : "its launcher left (stdin closed)");
    return 0;
  }
  if (!parse_stand_in(line, &o.dp_first_rank, &why) || !(why = o.validate()).empty()) {
    std::fprintf(stderr, "baton node %s: standing by: %s\n", o.name.c_str(), why.c_str());
    return 2;
  }
  std::printf("baton node %s: stands in%s\n", o.name.c_str(), line.empty() ? "" : (" (" + line + ")").c_str());
  std::fflush(stdout);
  return std::nullopt;
}

/// The head's directory now: a head that restarts is joined afresh, and meetings after that go
/// to the new one (re-formings run on threads of their own).
class head_link {
public:
  node_directory_actor get() {
    std::lock_guard<std::mutex> lock{mutex_};
    return dir_;
  }
  void set(node_directory_actor dir) {
    std::lock_guard<std::mutex> lock{mutex_};
    dir_ = std::move(dir);
  }

private:
  std::mutex mutex_;
  node_directory_actor dir_;
};

/// Starts a rank node's ranks once the head welcomes it (node_agent's `node_start`), and again
/// after a head that went away came back: new executors and transports over the same weights.
struct rank_starter {
  node_options o;
  gpu::model_config model;
  std::shared_ptr<const gpu::model_weights> weights;
  std::shared_ptr<dp_node_groups> groups;           ///< --dp-attention
  std::shared_ptr<expert_group_keeper> keeper;      ///< --expert-parallel without --dp-attention

  std::string operator()(caf::actor_system& sys, const cluster_welcome& w, node_actors* out) const {
    // The cluster's block store, if it runs one: decode ranks write finished sequences back to
    // it, prefill ranks load cached prefixes from it -- through UCX, like the head's own ranks.
    const auto store = store_access::from_info(w.store);
    // Blocks are keyed by the head's KV form (store::kv_identity::dtype): a node computing
    // another (CUDA's bf16 against the CPU's f32) would write its KV under their keys and read
    // theirs as its own.
    if (store.enabled() && store.identity.dtype != o.backend.kv_dtype())
      return "the cluster's block store keeps KV as " + store.identity.dtype + " (the head's executor) but this node's is " +
             o.backend.kv_dtype() + ": start it with the head's --executor";
    if (o.role == "elastic" && !w.elastic_controller)
      return "elastic ranks need the head's elastic controller: start the head with --elastic-nodes";
    for (uint32_t i = 0; i < o.num_ranks; ++i) {
      const std::string rank_name = o.rank_name(i);
      std::string why;
      std::shared_ptr<transport::transport> xport{
          transport::make_ucx_transport({.name = rank_name, .send = o.ucx_send}, &why)};
      if (!xport) return "rank " + rank_name + ": UCX: " + why;
      // An elastic instance's decode actor has a transport of its own.
      std::shared_ptr<transport::transport> decode_xport;
      if (o.role == "elastic") {
        decode_xport = transport::make_ucx_transport({.name = rank_name + "-decode", .send = o.ucx_send}, &why);
        if (!decode_xport) return "rank " + rank_name + ": UCX: " + why;
      }
      // The KV pool in the transport's memory: peers on this host (prefill ranks sending KV, the
      // store's servers) then store into it directly, without this process's progress thread.
      // An elastic instance's pool belongs to its decode side, which receives prompts' KV.
      auto ec = o.exec;
      ec.kv_memory = kv_pool_in(decode_xport ? decode_xport : xport);
      auto exec = make_executor(rank_name, i, std::move(ec), &why);
      if (!exec) return "rank " + rank_name + ": expert parallelism: " + why;
      if (groups) groups->started(i, exec);  // rejoins its group when the group re-forms
      if (o.role == "elastic") {
        // The side not serving is on standby until the head's controller moves the instance.
        auto e = spawn_elastic_instance(sys, rank_name, i < o.prefill_at_start, o.prefill, o.rank, std::move(exec),
                                        std::move(xport), std::move(decode_xport), w.prefill_balancer,
                                        w.decode_balancer, store);
        caf::anon_send(w.elastic_controller, controller_join{rank_name, e.prefill, e.decode, e.serves_prefill});
        out->ranks.prefill.push_back(e.prefill);
        out->ranks.decode.push_back(e.decode);
      } else if (o.role == "decode") {
        auto rc = o.rank;
        rc.name = rank_name;
        out->ranks.decode.push_back(spawn_decode_rank(sys, rc, std::move(exec), std::move(xport), w.decode_balancer, store));
        // Its load counts in the decode pool's pressure when the head moves elastic ranks.
        if (w.elastic_controller)
          caf::anon_send(w.elastic_controller, controller_join{rank_name, {}, out->ranks.decode.back(), false});
      } else {
        auto pc = o.prefill;
        pc.name = rank_name;
        out->ranks.prefill.push_back(
            spawn_prefill_rank(sys, pc, std::move(exec), std::move(xport), w.prefill_balancer, store));
        if (w.elastic_controller)
          caf::anon_send(w.elastic_controller, controller_join{rank_name, out->ranks.prefill.back(), {}, true});
      }
      out->ranks.names.push_back(rank_name);
    }
    std::printf("%s baton node %s: joined the head; %u %s rank(s) serving\n", utc_stamp().c_str(), o.name.c_str(), o.num_ranks, o.role.c_str());
    std::fflush(stdout);
    return {};
  }

  /// Rank `i`'s executor: a data-parallel member, the lead of expert shards of its own (started
  /// here, and again by the keeper when one dies), or the backend's whole model. Null and a
  /// sentence when its expert shards cannot start.
  std::shared_ptr<gpu::executor> make_executor(const std::string& rank_name, uint32_t i, gpu::cpu_executor_config ec,
                                               std::string* why) const {
    std::shared_ptr<gpu::executor> exec;
    if (groups) {
      ec.peers = groups->member(i);
      exec = gpu::make_cpu_executor(model, weights, ec);
    } else if (o.expert_parallel > 1) {
      const expert_spawn spawn{o.model_dir, o.weights_seed,   o.expert_parallel, engine_slot_bytes(model, o.prefill, o.rank),
                               rank_name,   o.dual_batch_overlap};
      auto group = spawn_expert_group(spawn, model, why);
      if (!group) return nullptr;
      if (o.eplb.slots_per_rank && !group->enable_eplb(o.eplb, model.moe.n_routed_experts, why)) return nullptr;
      ec.experts = std::move(group);
      exec = gpu::make_cpu_executor(model, weights, ec);
      keeper->add(exec, spawn, model, o.eplb);
    } else {
      exec = gpu::make_backend_executor(o.backend.for_rank(i, gpu::visible_cuda_devices()), model, weights, ec);
    }
    if (o.fault_job_delay_ms) exec = gpu::make_fault_slow_executor(std::move(exec), o.fault_job_delay_ms);
    return exec;
  }
};

/// A decode, prefill or elastic node: loads the model, meets its data-parallel groups, joins the
/// head and serves until it drains, must leave, or the head is gone for good.
int run_rank_node(node_options o) {
  // A data-parallel node loads the routed experts of its own members' blocks and no others
  // (DeepSeek-V3's experts are 97% of its weights: no node of a wide-EP group could hold them all).
  // A spare standing by does not know its members yet: it loads every expert.
  std::vector<uint32_t> local_members;
  for (uint32_t i = 0; o.dp_attention && !o.standby && i < o.num_ranks; ++i)
    local_members.push_back((o.dp_first_rank + i) % o.expert_parallel);
  const gpu::expert_filter node_experts =
      local_members.empty() ? gpu::expert_filter{} : keep_blocks_of(local_members, o.expert_parallel);
  std::string why;
  local_cluster_config loaded;  // the model this node serves: the head's
  if (o.model_dir != "random" && !load_model_into(o.model_dir, &loaded, &why, node_experts)) {
    std::fprintf(stderr, "baton node: %s\n", why.c_str());
    return 2;
  }
  const auto model = loaded.model;
  // Constrained decoding walks the model's vocabulary on the ranks that pick tokens (a built-in
  // model has no tokenizer here: the ranks use its byte vocabulary).
  if (loaded.router.tokenizer) o.rank.vocabulary = o.prefill.vocabulary = loaded.router.tokenizer->vocabulary();
  o.rank.event_log_events = o.prefill.event_log_events = o.event_log_events;
  if (why = o.validate_for(model); !why.empty()) {
    std::fprintf(stderr, "baton node: %s\n", why.c_str());
    return 2;
  }

  install_stop_signals();
  caf::actor_system_config cfg;
  configure_networked_system(cfg, o.scheduler_threads, o.poll_attempts, o.sec);
  caf::actor_system sys{cfg};
  // A head that is not there yet (starting, restarted, its host rebooting) is waited for as one
  // that went away is (--head-wait-s): a node started first, or restarted while the head is
  // down, joins it when it comes instead of failing at once. Only absence is waited out (nothing
  // listens, or nothing answers in time): a refusal -- another cluster's id, a certificate the
  // cluster CA did not sign -- will not change, and is said at once.
  std::optional<node_directory_actor> directory;
  if (auto first = connect_actor<node_directory_actor>(sys, o.sec, o.head_host, o.head_port)) {
    directory = *first;
  } else {
    std::string last = explain_connect_error(sys, first.error(), o.sec.tls());
    const bool absent = first.error() == caf::sec::cannot_connect_to_node || first.error() == caf::sec::request_timeout;
    if (absent && o.head_wait_s > 0 && !stop_requested()) {
      std::printf("baton node %s: the head's node directory at %s does not answer (%s); waiting up to %u s for it\n",
                  o.name.c_str(), o.connect.c_str(), last.c_str(), o.head_wait_s);
      std::fflush(stdout);
      directory = connect_actor_until<node_directory_actor>(
          sys, o.sec, o.head_host, o.head_port, std::chrono::steady_clock::now() + std::chrono::seconds{o.head_wait_s},
          stop_requested, &last);
    }
    if (!directory) {
      if (stop_requested()) return 0;  // asked to stop while waiting: not a failure to restart
      const std::string within = absent && o.head_wait_s > 0 ? " within " + std::to_string(o.head_wait_s) + " s" : "";
      std::fprintf(stderr, "baton node %s: cannot reach the head's node directory at %s%s: %s\n", o.name.c_str(),
                   o.connect.c_str(), within.c_str(), last.c_str());
      return 1;
    }
  }
  auto head = std::make_shared<head_link>();
  head->set(*directory);
  // The model, with the routed experts `keep` chooses, from a directory or drawn from the seed.
  // A data-parallel node's members take their blocks out of it, and the node loads it again only
  // when a group re-forms.
  const weights_loader load_weights = [model_dir = o.model_dir, seed = o.weights_seed, model](
                                          const gpu::expert_filter& keep,
                                          std::string* err) -> std::shared_ptr<const gpu::model_weights> {
    local_cluster_config again;  // a directory's weights; a built-in model's come from the seed
    if (model_dir != "random" && !load_model_into(model_dir, &again, err, keep)) return nullptr;
    if (again.weights) return again.weights;
    return std::make_shared<gpu::model_weights>(gpu::make_seeded_weights(model, seed, keep));
  };
  auto weights = loaded.weights ? std::move(loaded.weights) : load_weights(node_experts, &why);
  if (o.standby)
    if (auto rc = stand_by(o)) return *rc;  // its stand-in line may set --dp-first-rank
  rank_starter start{o, model, std::move(weights), {}, {}};

  auto state = std::make_shared<node_state>();
  node_agent_config agent_cfg;
  agent_cfg.drain_timeout_ms = o.drain_timeout_ms;
  // Expert shards that cannot be started again, or a data-parallel group that cannot re-form in
  // place: the node drains and leaves with exit code 3, so that whoever restarts it (`baton
  // launch --restart-failed`, a Kubernetes pod) brings it back whole; a data-parallel group meets
  // afresh at the head once every node of its lost meeting has gone.
  if (o.expert_parallel > 1 && !o.dp_attention) {
    expert_keeper_config kc;
    kc.give_up_after = o.expert_restarts;
    kc.give_up = [state, name = o.name](const std::string& label, const std::string&) {
      std::printf("baton node %s: %s's expert shards cannot be started again; leaving so that the node is restarted "
                  "or replaced\n",
                  name.c_str(), label.c_str());
      std::fflush(stdout);
      state->must_leave.store(true);
    };
    start.keeper = std::make_shared<expert_group_keeper>("baton node " + o.name, std::move(kc));
  }
  // Data-parallel groups first: their members in other nodes wait for these at the head.
  if (o.dp_attention) {
    const dp_layout at{o.num_ranks, o.dp_first_rank, o.expert_parallel};
    dp_meeting_config meet{o.name, o.dp_meet_timeout_s, o.dp_shrink_after_s,
                           {.slot_bytes = engine_slot_bytes(model, o.prefill, o.rank),
                            .timeout = std::chrono::milliseconds{o.dp_step_timeout_ms},
                            .dual_batch = o.dual_batch_overlap},
                           o.eplb, o.ucx_send, [state] { return state->winding_down(); }};
    start.groups = std::make_shared<dp_node_groups>(
        sys,
        dp_node_groups::setup{o.name, at, model, std::move(meet), load_weights, [head] { return head->get(); },
                              [o](uint32_t i) { return o.rank_name(i); }},
        state);
    if (why = start.groups->form(&start.weights, o.model_dir == "random" ? "the seed" : o.model_dir); !why.empty()) {
      std::fprintf(stderr, "baton node %s: data-parallel attention: %s\n", o.name.c_str(), why.c_str());
      return stop_requested() ? 0 : 1;  // asked to stop while meeting: not a failure to restart
    }
    agent_cfg.on_member_gone = [groups = start.groups](const std::string& meeting, const std::vector<uint32_t>& members,
                                                       const std::string& why, bool returned) {
      groups->member_gone(meeting, members, why, returned);
    };
  }
  agent_cfg.hello = {o.name, {o.role}, static_cast<int32_t>(::getpid()), model_fingerprint(model)};
  agent_cfg.hello.weights = weights_identity(loaded.weights_id, o.weights_seed);
  agent_cfg.hello.page_tokens = o.exec.page_size_tokens;
  // Set by the agent as it stops the ranks because the head went away (before it ends itself).
  agent_cfg.on_head_lost = [state] { state->head_down.store(true); };
  agent_cfg.on_replaced = [state](int32_t pid) { state->replaced_by.store(pid); };
  auto agent = spawn_node_agent(sys, *directory, agent_cfg, start);
  caf::scoped_actor self{sys};
  self->monitor(agent);
  bool gone = false, drain_sent = false, leaving_for_group = false, no_head = false;
  caf::error reason;
  for (uint32_t heads = 1;; ++heads) {
    while (!gone) {
      if (start.groups && !drain_sent) start.groups->watch();
      if ((stop_requested() || state->must_leave.load()) && !drain_sent) {
        leaving_for_group = !stop_requested();
        state->leaving.store(true);  // re-formings still meeting give up
        self->send(agent, drain_atom::value, leaving_for_group);  // to be restarted: the head counts it lost
        drain_sent = true;
      }
      // 10 ms: a stop is told to the head at once. At 100 ms a trial's replacement, started
      // right after SIGTERM, joined first and was taken for a restart of a live node (its
      // drain cut short), not the successor of a draining one.
      self->receive(
          [&](const caf::down_msg& dm) {
            gone = true;
            reason = dm.reason;
          },
          caf::after(std::chrono::milliseconds{10}) >> [] {});
    }
    if (!state->head_down.load() || drain_sent || o.head_wait_s == 0 || stop_requested()) break;
    // The head went away (crashed, or restarted): the agent stopped the ranks, whose executors
    // stop with them; the model stays loaded. A head that comes back at the same address is
    // joined afresh, and the ranks start again with new executors over the same weights (a
    // data-parallel group's members, broken by the stop, re-form through the new head).
    std::printf("%s baton node %s: the head went away; its ranks stopped; waiting up to %u s for a head at %s (the model "
                "stays loaded)\n", utc_stamp().c_str(),
                o.name.c_str(), o.head_wait_s, o.connect.c_str());
    std::fflush(stdout);
    if (start.groups) start.groups->head_lost();
    std::string last = "nothing listens there";
    const auto next = connect_actor_until<node_directory_actor>(
        sys, o.sec, o.head_host, o.head_port, std::chrono::steady_clock::now() + std::chrono::seconds{o.head_wait_s},
        stop_requested, &last, head->get());
    if (!next) {
      if (!stop_requested())
        std::fprintf(stderr, "baton node %s: no head came back at %s within %u s (%s); leaving\n", o.name.c_str(),
                     o.connect.c_str(), o.head_wait_s, last.c_str());
      no_head = !stop_requested();
      break;
    }
    head->set(*next);
    std::printf("baton node %s: a head is back at %s; joining it (head %u)\n", o.name.c_str(), o.connect.c_str(),
                heads + 1);
    std::fflush(stdout);
    state->head_down.store(false);  // from here on, groups re-form at this head
    agent = spawn_node_agent(sys, *next, agent_cfg, start);
    self->monitor(agent);
    gone = false;
    reason = {};
  }
  state->leaving.store(true);
  // The executors and members go now, before the actor system: the agent's callbacks (which
  // outlive it in agent_cfg) hold the groups too, and a rank's KV pool must go with its executor.
  if (start.groups) {
    const auto members = start.groups->finish();
    for (uint32_t i = 0; i < members.size() && o.eplb.slots_per_rank; ++i)  // what each member's live EPLB did
      std::printf("baton node %s: rank %s: %llu EPLB plans, %llu bytes of expert weights received, %llu experts dropped\n",
                  o.name.c_str(), o.rank_name(i).c_str(), static_cast<unsigned long long>(members[i]->plans()),
                  static_cast<unsigned long long>(members[i]->bytes_installed()),
                  static_cast<unsigned long long>(members[i]->experts_evicted()));
    std::fflush(stdout);
  }
  if (no_head) return 1;
  if (stop_requested() && !drain_sent) {
    // Stopped while its head was away (waiting for one to come back): asked to stop, not a
    // failure -- as a stop during the first connect is -- so no supervisor restarts it.
    std::printf("baton node %s: stopped while waiting for a head\n", o.name.c_str());
    return 0;
  }
  if (const int32_t pid = state->replaced_by.load()) {
    // Not a failure to restart: another process serves under the name now (a restart by hand, or
    // by another supervisor, while this one was out of reach or still running).
    std::printf("%s baton node %s: a newer process (pid %d) joined the head under this node's name; its ranks were "
                "forgotten, so this one stopped them and leaves (exit code 0)\n", utc_stamp().c_str(),
                o.name.c_str(), pid);
    return 0;
  }
  if (leaving_for_group) {
    std::printf("baton node %s: left to be restarted (exit code 3): its data-parallel group could not re-form in "
                "place, or its expert shards could not be started again\n",
                o.name.c_str());
    return 3;
  }
  if (reason && reason != caf::exit_reason::normal) {
    std::fprintf(stderr, "baton node %s: %s\n", o.name.c_str(), sys.render(reason).c_str());
    return drain_sent ? 0 : 1;  // after a drain request, leaving is the goal
  }
  if (drain_sent) std::printf("baton node %s: drained and left\n", o.name.c_str());
  return 0;
}

}  // namespace

int run_node(const std::vector<std::string>& args) {
  node_options o;
  if (auto rc = parse_node_options(args, &o)) return *rc;
  return o.serves_ranks() ? run_rank_node(std::move(o)) : run_store_node(o);
}

}  // namespace baton::deploy

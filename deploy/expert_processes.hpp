#pragma once

// Expert parallelism across processes on one machine: an engine's expert shards as child
// processes (`baton experts`), connected to the engine's executor over UCX through the
// all-to-all of transport/all_to_all.hpp. The keys travel over the children's stdin and stdout.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "actors/config.hpp"
#include "gpu/executor.hpp"
#include "gpu/expert_parallel.hpp"

namespace baton::deploy {

struct expert_spawn {
  std::string model_arg;       ///< what `--model` names in the children (a directory or a seeded shape)
  uint64_t weights_seed = 0;
  uint32_t size = 2;           ///< EP ranks, this process included
  uint64_t slot_bytes = 0;     ///< gpu::expert_slot_bytes for the engine's largest job
  std::string name;            ///< the engine's name: the shards are <name>-ep<i>
  bool dual_batch = false;     ///< dual-batch overlap: a second all-to-all channel per group
  /// A shard prints its keys once it holds its experts' weights: a shard silent this long (hung
  /// in its weights or its transport) fails the group's start, naming it, instead of hanging it.
  uint32_t key_timeout_ms = 600000;
  std::string executable{};    ///< the binary that runs `baton experts` (empty: this process's own)
};

/// The all-to-all slot an engine's expert group needs: twice its largest job's rows (a prefill
/// chunk, or a decode step with its local prompts), every row's top-k copies bound for one rank.
uint64_t engine_slot_bytes(const gpu::model_config& cfg, const prefill_rank_config& prefill,
                           const decode_rank_config& decode);

/// Starts size - 1 shard processes and returns rank 0's group (its deleter stops and reaps them),
/// or null with `*why`.
std::shared_ptr<gpu::expert_group> spawn_expert_group(const expert_spawn& s, const gpu::model_config& cfg,
                                                      std::string* why);

/// Keeps the expert groups of this process's engines whole. Every 100 ms it looks at what it
/// was given; once an executor's standing failure comes from its group, the rank has stepped
/// aside (its load reports name the failure), and the keeper repairs the group:
/// - an engine with expert shards (the attention-lead form), whose shard's process ended or
///   failed: a new group of shards is started as the first was (spawn_expert_group, live EPLB
///   on again if it was) and handed over with gpu::executor::replace_experts;
/// - a data-parallel group of this process (`baton local --dp-attention`), once every member
///   reports it broken (a member stalled past the step timeout, say): the group is made afresh
///   and every executor rejoins it (gpu::executor::rejoin_group). `baton node` groups span
///   processes and re-form through the head instead (dp_node_groups, deploy/dp_meeting.hpp).
/// Each executor switches between jobs; its rank then takes work again. A repair that fails is
/// tried again after `first_backoff` (1 s), doubling up to 30 s; after `give_up_after` failures
/// in a row the keeper stops trying that group and calls `give_up` (a node then leaves, to be
/// restarted or replaced; 0: it never gives up). A repaired group that breaks again within
/// `settle` counts as a failed repair too: shards that die right after every start would
/// otherwise be started again forever. `who` prefixes its lines on stdout ("baton node
/// decode-a"). One thread, joined by the destructor; executors are held weakly.
struct expert_keeper_config {
  uint32_t give_up_after = 0;  ///< failed repairs in a row of one group before giving up on it (0: never)
  std::chrono::milliseconds first_backoff{1000};
  /// How long a repaired group must stay whole before its failures in a row start again from 0.
  std::chrono::milliseconds settle{30'000};
  /// Called once per group given up on, on the keeper's thread: its label ("rank decode-a") and the last failure.
  std::function<void(const std::string& label, const std::string& why)> give_up;
};

class expert_group_keeper {
public:
  using remake_fn = std::function<std::vector<std::shared_ptr<gpu::expert_peers>>(std::string* why)>;
  explicit expert_group_keeper(std::string who, expert_keeper_config cfg = {});
  ~expert_group_keeper();
  expert_group_keeper(const expert_group_keeper&) = delete;
  expert_group_keeper& operator=(const expert_group_keeper&) = delete;
  /// Keeps `exec`'s shards running as `s` says (the model `cfg`, live EPLB per `eplb`).
  void add(const std::shared_ptr<gpu::executor>& exec, expert_spawn s, const gpu::model_config& cfg,
           gpu::live_eplb_config eplb);
  /// `exec` is member `member` of the `size` members of data-parallel group `group`, which
  /// `remake` builds afresh (its members in member order). Members may be added in any order;
  /// the group is looked at once all are.
  void add_dp_member(const std::string& group, uint32_t member, uint32_t size, const std::shared_ptr<gpu::executor>& exec,
                     remake_fn remake);
  /// Groups repaired so far.
  uint64_t repairs() const;

private:
  struct engine;
  void loop();
  /// Repairs `e` when every executor of it reports its group broken (keeper thread).
  void look_at(engine& e);
  /// Counts a failed repair of `e` (why): pauses it, or gives up on it; true when given up.
  bool note_failure(engine& e, const std::string& why);
  std::string who_;
  expert_keeper_config cfg_;
  mutable std::mutex m_;
  std::vector<std::shared_ptr<engine>> engines_;
  uint64_t repairs_ = 0;
  bool stop_ = false;
  std::condition_variable wake_;
  std::thread thread_;
};

/// Data-parallel attention among ranks of this process (gpu::expert_peers): `ranks` (names, in
/// order) form groups of `ep` consecutive ranks over UCX, each rank its group's member (with
/// `group.dual_batch`, two channels each for dual-batch overlap; with `eplb` on, live EPLB in
/// each group); the result is in the order of `ranks`. Empty with `*why` when the ranks do not
/// split into groups, a transport cannot start or the EPLB settings do not fit.
std::vector<std::shared_ptr<gpu::expert_peers>> make_dp_attention_groups(const std::vector<std::string>& ranks,
                                                                         uint32_t ep, const gpu::model_config& cfg,
                                                                         const gpu::peer_group_config& group,
                                                                         const gpu::live_eplb_config& eplb,
                                                                         const std::string& ucx_send, std::string* why);
/// UCX transports for data-parallel members, sending as `ucx_send` says (put, or am over TCP).
gpu::peer_transport_maker ucx_peer_transports(const std::string& ucx_send);

/// `baton experts`: one expert shard (started by spawn_expert_group, not by hand).
int run_experts(const std::vector<std::string>& args);

}  // namespace baton::deploy

#pragma once

// Expert parallelism across processes on one machine: an engine's expert shards as child
// processes (`baton experts`), connected to the engine's executor over UCX through the
// all-to-all of transport/all_to_all.hpp. The keys travel over the children's stdin and stdout.

#include <condition_variable>
#include <cstdint>
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
};

/// The all-to-all slot an engine's expert group needs: twice its largest job's rows (a prefill
/// chunk, or a decode step with its local prompts), every row's top-k copies bound for one rank.
uint64_t engine_slot_bytes(const gpu::model_config& cfg, const prefill_rank_config& prefill,
                           const decode_rank_config& decode);

/// Starts size - 1 shard processes and returns rank 0's group (its deleter stops and reaps them),
/// or null with `*why`.
std::shared_ptr<gpu::expert_group> spawn_expert_group(const expert_spawn& s, const gpu::model_config& cfg,
                                                      std::string* why);

/// Restarts lost expert shards. Every 100 ms it looks at each engine it was given: one whose
/// executor's standing failure comes from its expert group (a shard's process ended, or the
/// shard failed) gets a new group of shards, started as the first one was (spawn_expert_group,
/// live EPLB on again if it was), handed over with gpu::executor::replace_experts. Meanwhile the
/// engine's rank has stepped aside (its load reports name the failure); it takes work again
/// once its executor switched. A start that fails is tried again after 1 s, doubling up to
/// 30 s. `who` prefixes its lines on stdout ("baton node decode-a"). One thread, joined by the
/// destructor; executors are held weakly.
class expert_group_keeper {
public:
  explicit expert_group_keeper(std::string who);
  ~expert_group_keeper();
  expert_group_keeper(const expert_group_keeper&) = delete;
  expert_group_keeper& operator=(const expert_group_keeper&) = delete;
  /// Keeps `exec`'s shards running as `s` says (the model `cfg`, live EPLB per `eplb`).
  void add(const std::shared_ptr<gpu::executor>& exec, expert_spawn s, const gpu::model_config& cfg,
           gpu::live_eplb_config eplb);
  /// Groups started in place of lost ones so far.
  uint64_t restarts() const;

private:
  struct engine;
  void loop();
  std::string who_;
  mutable std::mutex m_;
  std::vector<std::shared_ptr<engine>> engines_;
  uint64_t restarts_ = 0;
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

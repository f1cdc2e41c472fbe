#pragma once

// What `baton node` is asked to run: its flags as one typed struct, read and checked before the
// node loads a model or opens a socket, so that a wrong flag costs nothing and names itself.
// No CAF here: the checks are tested without an actor system (tests/deploy/flags.test.cpp).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "actors/config.hpp"
#include "deploy/processes.hpp"
#include "gpu/cuda_executor.hpp"
#include "gpu/executor.hpp"
#include "gpu/expert_parallel.hpp"

namespace baton::deploy {

/// --event-log-events (baton local, baton node): why a server keeps fewer than a test.
inline constexpr const char* event_log_help =
    "recent events each rank keeps for diagnostics (a decode step's names every request in its batch: 65,536 "
    "held tens of MB per rank)";

/// The built-in model: the trained one shipped in the repository (models/baton-kjv-tiny) where it
/// is there, else `random`. `baton local`'s default, and so a node's: a node started without
/// --model joins a head started without one.
std::string builtin_model_dir();

struct node_options {
  std::string role = "decode";  ///< decode | prefill | elastic | store
  std::string name;             ///< default: <role>-0, or store
  std::string connect;          ///< rank nodes: the head's node directory, HOST:PORT
  std::string listen;           ///< store: where the head connects to adopt this node's block server
  std::string store_dir;        ///< store: the block files' directory
  double store_capacity_gib = 0;  ///< store: the directory's disk budget (store_host_config::capacity_bytes); 0 = unbounded
  uint32_t num_ranks = 1;
  uint32_t prefill_at_start = 0;  ///< elastic: ranks that start as prefill
  decode_rank_config rank;
  prefill_rank_config prefill;  ///< chunked as the head's own prefill ranks are
  /// Each rank's diagnostic event ring (event_log_help): smaller than the configs' default, which
  /// keeps a test's whole history.
  uint32_t event_log_events = 4096;
  gpu::cpu_executor_config exec;
  gpu::backend_config backend;
  std::string model_dir = builtin_model_dir();  ///< the head's default too (baton local)
  uint64_t weights_seed = 20261130;  ///< the head's default (local_cluster_config; a test keeps them equal)
  uint32_t scheduler_threads = 2, poll_attempts = 0;
  uint32_t drain_timeout_ms = 60000;  ///< node_agent_config's default (a test keeps them equal)
  net_security sec;
  std::string ucx_send = "put";
  uint32_t head_wait_s = 60;
  bool standby = false;
  // Expert parallelism.
  uint32_t expert_parallel = 1;
  bool dual_batch_overlap = false;
  uint32_t expert_restarts = 5;
  gpu::live_eplb_config eplb;
  // Data-parallel attention.
  bool dp_attention = false;
  uint32_t dp_first_rank = 0;
  uint32_t dp_meet_timeout_s = 120;
  uint32_t dp_shrink_after_s = 0;
  uint32_t dp_step_timeout_ms = 10'000;
  // Fault injection for tests (flags, or the environment: a cluster spec's node "env").
  uint32_t fault_job_delay_ms = 0;    ///< each executor job starts this late (a slow GPU)
  uint32_t fault_layer_delay_ms = 0;  ///< store: each layer of a read waits this long (a slow disk)
  // From `connect`, once valid.
  std::string head_host;
  uint16_t head_port = 0;

  /// Empty when the flags make sense together, else a sentence naming the flag(s) at fault.
  /// Fills head_host/head_port from --connect. Needs no model: it runs before one is loaded.
  std::string validate();
  /// What the model the node serves rules out (expert parallelism past its experts, KV pools
  /// past the host's memory); empty when nothing.
  std::string validate_for(const gpu::model_config& model) const;
  bool serves_ranks() const { return role != "store"; }
  /// Rank i's name: the node's own with one rank, else <name>-i.
  std::string rank_name(uint32_t i) const;
};

/// Reads `baton node`'s flags over the environment's fault injection and the serving defaults,
/// then validates them. An exit code when the command ends here (--help: 0; a flag it cannot
/// read or that makes no sense: 2, said on stderr as "baton node: <why>"); nothing when `*out`
/// is ready to run.
std::optional<int> parse_node_options(const std::vector<std::string>& args, node_options* out);

}  // namespace baton::deploy

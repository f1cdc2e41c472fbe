#pragma once

// A whole cluster inside one actor system: router, prefill and decode ranks on CPU executors,
// KV handoff over the in-process loopback transport. `baton local`, tests and sims build on it.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/block_server.hpp"
#include "actors/config.hpp"
#include "actors/elastic_controller.hpp"
#include "actors/messages.hpp"
#include "actors/router.hpp"
#include "actors/store_access.hpp"
#include "actors/store_keeper.hpp"
#include "gpu/cuda_executor.hpp"
#include "gpu/executor.hpp"
#include "gpu/weights.hpp"
#include "transport/transport.hpp"

namespace caf {
class actor_system;
}

namespace baton {

struct local_cluster_config {
  gpu::model_config model = gpu::builtin_tiny_config();
  uint64_t weights_seed = 20261130;
  /// Weights loaded from a model directory; null: the built-in model's, drawn from weights_seed.
  std::shared_ptr<const gpu::model_weights> weights;
  /// The loaded weights' fingerprint (gpu::hf_model::weights_id), which keys the block store's
  /// KV in place of the seed; empty for seeded weights.
  std::string weights_id;
  uint32_t num_prefill_ranks = 2;
  uint32_t num_decode_ranks = 2;
  /// Elastic P/D: instances that serve either role, each an executor (one set of weights) with a
  /// prefill and a decode actor of which one is active; named <elastic_name>-0, ... The first
  /// elastic_prefill_at_start start as prefill. With any, the elastic controller runs.
  uint32_t num_elastic_ranks = 0;
  uint32_t elastic_prefill_at_start = 0;
  std::string elastic_name = "elastic";
  /// Run the elastic controller even without in-process elastic ranks: node processes bring theirs
  /// (`baton node --role elastic`) and announce them, and their fixed ranks, through the welcome.
  bool elastic_nodes = false;
  elastic_controller_config elastic;
  /// KV handoff backend: loopback (in-process memcpy), ucx, or modelled (sims: no bytes move)
  std::string transport = "loopback";
  /// Sims: the executors are modelled and write no KV, so their pools take address space, never
  /// memory (a run whose pools add up to 50 GB peaked at 118 MB): validate() does not hold them
  /// to this machine's memory.
  bool kv_pools_untouched = false;
  /// With transport ucx: how this process's ranks send ("put": RMA; "am": rendezvous active
  /// messages, several times faster over TCP). Receivers take either.
  std::string ucx_send = "put";
  gpu::cpu_executor_config executor;  ///< the KV pool's size (and the CPU backend's threads)
  gpu::backend_config backend;        ///< cpu (default) or cuda
  prefill_rank_config prefill;  ///< name is a prefix: ranks are <name>-0, <name>-1, ...
  decode_rank_config decode;
  prefill_balancer_config prefill_balancer;
  decode_balancer_config decode_balancer;  ///< page_size_tokens is taken from `executor`
  store_config store;                      ///< off by default
  /// Store nodes (`baton node --role store`) whose block servers the cluster adopts, after the
  /// in-process ones (server ids num_servers, num_servers + 1, ...). Needs a real actor system
  /// (adoption waits for the answers), not the sims' test coordinator.
  std::vector<store_host_actor> remote_store_hosts;
  uint32_t adopt_timeout_ms = 10000;
  /// Reaches store node i's host again once its server went down (a restarted node process, a
  /// broken link): the cluster adopts it again (store_keeper). Null: a lost store node stays lost.
  store_host_connector reconnect_store_host;
  /// A line per store node lost or adopted again; null: silent.
  std::function<void(const std::string&)> store_log;
  /// A line per node process that joins, is given up, or comes back (node_directory_config::log);
  /// null: silent.
  std::function<void(const std::string&)> node_log;
  router_config router;

  local_cluster_config() {
    prefill.name = "prefill";
    decode.name = "decode";
  }
  std::string validate() const;
};

/// A KV pool source for a rank's executor: pages from the rank's transport, so that peers on this
/// host store incoming KV into them directly (transport::allocate_memory); the pool holds the
/// transport until it goes.
gpu::kv_memory_source kv_pool_in(std::shared_ptr<transport::transport> t);

/// One elastic instance (in `baton local` or a `baton node --role elastic`): a prefill and a
/// decode actor named `name` on one executor, each with its own transport, the one not serving
/// (`serves_prefill`) on standby, and linked: the two share an executor that either one's exit
/// stops, so a side that dies takes the other with it (its balancer then forgets it) rather than
/// leaving it to accept work that never runs.
elastic_instance spawn_elastic_instance(caf::actor_system& sys, const std::string& name, bool serves_prefill,
                                        prefill_rank_config pc, decode_rank_config dc,
                                        std::shared_ptr<gpu::executor> exec,
                                        std::shared_ptr<transport::transport> prefill_transport,
                                        std::shared_ptr<transport::transport> decode_transport,
                                        prefill_balancer_actor pb, decode_balancer_actor db, const store_access& store);

/// Makes the executor of a rank (sims pass modelled executors). Default: CPU executors.
using executor_factory = std::function<std::shared_ptr<gpu::executor>(const std::string& rank_name)>;
/// Wraps a rank's transport (tests wrap a fault proxy around it). Default: none.
using transport_wrapper = std::function<std::shared_ptr<transport::transport>(
    std::unique_ptr<transport::transport> inner, const std::string& rank_name)>;

/// Spawns an in-process block server (sims pass modelled ones). Default: spawn_block_server.
using block_server_factory = std::function<block_server_actor(
    caf::actor_system& sys, block_server_config cfg, std::shared_ptr<transport::transport> xport,
    std::vector<block_index_actor> index)>;

template <class Handle>
struct named_rank {
  std::string name;
  Handle handle;
};

struct local_cluster {
  router_actor router;
  prefill_balancer_actor prefill_balancer;
  decode_balancer_actor decode_balancer;
  std::vector<named_rank<prefill_rank_actor>> prefill;
  std::vector<named_rank<decode_rank_actor>> decode;
  std::vector<elastic_instance> elastic;  ///< elastic P/D instances (both actors of each)
  elastic_controller_actor elastic_controller;  ///< null without elastic instances
  std::vector<block_index_actor> store_index;  ///< index shards; empty when the store is off
  std::vector<named_rank<block_server_actor>> store_servers;
  store_keeper_actor store_keeper;  ///< null without store nodes
  store_info store;  ///< for ranks that join from other processes (empty when the store is off)
  /// Where node processes join (`baton node`): publish it to let them in.
  node_directory_actor directory;
  /// Empty, or why the cluster could not start (a store node refused or did not answer); the
  /// actors above are then stopped.
  std::string setup_error;

  /// Every actor of the cluster, for shutting it down.
  std::vector<caf::actor> actors() const;
  /// Every rank's name: prefill, decode and elastic instances (as balancers list them).
  std::vector<std::string> rank_names() const;
};

/// A model's identity in one line, for a node's join to be checked against the head's: its name
/// and shape. (Not its weights: a named built-in model is drawn from its seed on the head and
/// loaded from files on a node, the same weights either way.)
std::string model_fingerprint(const gpu::model_config& m);
/// Which weights of the model a process serves, as the node directory compares them: a
/// checkpoint's fingerprint (gpu::hf_model::weights_id) or, for drawn ones, the seed.
std::string weights_identity(const std::string& weights_id, uint64_t weights_seed);

/// Spawns the cluster. The config must validate (callers report validate()'s sentence).
local_cluster start_local_cluster(caf::actor_system& sys, const local_cluster_config& cfg,
                                  executor_factory make_executor = {}, transport_wrapper wrap = {},
                                  block_server_factory make_block_server = {});

}  // namespace baton

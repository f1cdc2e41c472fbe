#include "actors/local_cluster.hpp"

#include <caf/actor_system.hpp>
#include <caf/monitorable_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "actors/block_index.hpp"
#include "actors/block_server.hpp"
#include "actors/decode_balancer.hpp"
#include "actors/decode_rank.hpp"
#include "actors/kv_wire_staging.hpp"
#include "actors/node_directory.hpp"
#include "actors/prefill_balancer.hpp"
#include "actors/prefill_rank.hpp"
#include "gpu/cpu_executor.hpp"
#include "transport/loopback.hpp"
#include "transport/ucx.hpp"

namespace baton {

namespace {

/// One whole block of the store in the model's host KV layout (what a write slot holds).
uint64_t store_block_bytes(const local_cluster_config& cfg) {
  const auto lay = gpu::model_kv_layout(cfg.model, 1, cfg.executor.page_size_tokens);
  return uint64_t{cfg.store.block_tokens / cfg.executor.page_size_tokens} * lay.page_bytes() * lay.num_layers;
}

/// The store's buffers: as configured, or (0) sized for the model's blocks.
std::pair<uint64_t, uint64_t> store_buffers(const local_cluster_config& cfg) {
  const uint64_t block = store_block_bytes(cfg), floor = 64ull << 20;
  return {cfg.store.staging_bytes ? cfg.store.staging_bytes : std::max(floor, 2 * block),
          cfg.store.max_pending_write_bytes ? cfg.store.max_pending_write_bytes : std::max(floor, 4 * block)};
}

}  // namespace

std::string local_cluster_config::validate() const {
  if (auto e = model.validate(); !e.empty()) return "model: " + e;
  if (auto e = executor.validate(); !e.empty()) return "executor: " + e;
  // With a quantised wire form, each rank makes wire-form staging on its first such request; an
  // elastic instance may make one per role.
  const uint32_t stagings =
      router.request.kv_wire.any_quantised() ? num_prefill_ranks + num_decode_ranks + 2 * num_elastic_ranks : 0;
  const uint64_t staging_bytes =
      stagings * kv_wire_staging::bytes_for(gpu::model_kv_layout(model, 1, executor.page_size_tokens), executor.num_kv_pages);
  if (auto e = kv_pools_untouched ? std::string{}
                                  : gpu::kv_pools_fit_memory(model, executor.num_kv_pages, executor.page_size_tokens,
                                                             num_prefill_ranks + num_decode_ranks + num_elastic_ranks,
                                                             staging_bytes);
      !e.empty())
    return e;
  // A head that runs no rank (its ranks in node processes) needs no device: its backend only
  // names the KV form the store's keys carry (kv_dtype), which its nodes must share.
  const bool runs_ranks = num_prefill_ranks + num_decode_ranks + num_elastic_ranks > 0;
  if (auto e = runs_ranks ? backend.validate() : backend.kind_problem(); !e.empty()) return e;
  if (auto e = prefill.validate(); !e.empty()) return e;
  if (auto e = decode.validate(); !e.empty()) return e;
  if (!prefill.checksum_kv && decode.verify_kv_checksums)
    return "prefill.checksum_kv is off but decode.verify_kv_checksums is on: every layer would fail its check; turn "
           "both off (only where the KV is not real, as the sims' modelled executors) or leave both on";
  if (auto e = router.request.validate(); !e.empty()) return e;
  if (auto e = prefill_balancer.validate(); !e.empty()) return e;
  if (auto e = decode_balancer.validate(); !e.empty()) return e;
  if (!remote_store_hosts.empty() && !store.enabled) return "store nodes given but the store is off";
  if (auto e = store.validate(executor.page_size_tokens, remote_store_hosts.size()); !e.empty()) return e;
  // Keyed for the prefill ranks' own tiers alone: the same block size rule as the store's (a
  // block of 0 tokens divided by zero; one not of whole pages left every tier off, silently).
  if (!store.enabled && store.local_tier_only &&
      (store.block_tokens == 0 || store.block_tokens % executor.page_size_tokens != 0))
    return "store block_tokens (--block-tokens) must be a positive multiple of the KV page size (" +
           std::to_string(executor.page_size_tokens) + " tokens), got " + std::to_string(store.block_tokens) +
           ": prefill ranks keep their prefix tiers in whole pages";
  // A block longer than the context is never filled: the store would hold nothing, silently (a
  // soak trial's store stayed empty under the default 512 with a 256-token model).
  // (A hit needs the block and a token after it to compute, within the context.)
  if ((store.enabled || store.local_tier_only) && store.block_tokens + 2 > model.max_position_embeddings)
    return "store block_tokens (--block-tokens) is " + std::to_string(store.block_tokens) + ", too long for the model's context of " +
           std::to_string(model.max_position_embeddings) +
           " tokens: no prompt would fill a block and leave a token to compute, and nothing would be cached";
  if (store.enabled && store.staging_bytes && store.staging_bytes < store_block_bytes(*this))
    return "store staging_bytes (" + std::to_string(store.staging_bytes) + ") is smaller than one block of this model (" +
           std::to_string(store_block_bytes(*this)) + " bytes: " + std::to_string(store.block_tokens) +
           " tokens of every layer's KV): no block could be written or read; leave it 0 to size it for the model";
  if (store.enabled && store.capacity_gib > 0) {
    if (store.num_servers == 0)
      return "store capacity_gib (--store-capacity-gib) budgets this process's block servers (--store-servers), and "
             "it runs none: store nodes take their own (baton node --role store --store-capacity-gib)";
    const uint64_t file = store::block_disk_bytes(store::block_header::fixed_header_bytes + store_block_bytes(*this));
    const uint64_t share = store::capacity_bytes_of(store.capacity_gib) / store.num_servers;
    if (share < file)
      return "store capacity_gib (--store-capacity-gib) leaves each of the " + std::to_string(store.num_servers) +
             " block servers under the store dir " + std::to_string(share) +
             " bytes, less than one block file of this model (" + std::to_string(file) + " bytes on disk: " +
             std::to_string(store.block_tokens) + " tokens of every layer's KV and a 4 KiB header)";
  }
  // Prefill and decode ranks may also join from other processes (`baton node`), so 0
  // in-process is valid.
  if (elastic_prefill_at_start > num_elastic_ranks)
    return "elastic_prefill_at_start (" + std::to_string(elastic_prefill_at_start) + ") exceeds num_elastic_ranks (" +
           std::to_string(num_elastic_ranks) + ")";
  if (num_elastic_ranks > 0 || elastic_nodes) {
    if (auto e = elastic.planner.validate(); !e.empty()) return e;
    // 0 would re-arm the controller's timer without pause, spinning a core.
    if (elastic.interval_ms == 0) return "elastic interval_ms (--elastic-interval-ms) must be > 0";
  }
  if (transport != "loopback" && transport != "ucx" && transport != "modelled")
    return "transport must be loopback, ucx or modelled, got '" + transport + "'";
  if (ucx_send != "put" && ucx_send != "am") return "ucx_send must be put or am, got '" + ucx_send + "'";
  return {};
}

namespace {

/// What the cluster's KV blocks are keyed by: the model and weights, layout and block size, and
/// the executor backend: KV is bit-identical only per backend, so a store directory reused after
/// a switch must not serve the other backend's blocks. The dtype field carries it
/// (backend_config::kv_dtype: "f32" on the CPU, "cuda-bf16" or "cuda-f32" on CUDA); naming the
/// backend again elsewhere would change every existing store's keys for nothing.
store::kv_identity kv_identity_of(const local_cluster_config& cfg) {
  const auto& m = cfg.model;
  const std::string weights = cfg.weights_id.empty() ? " seed " + std::to_string(cfg.weights_seed) : " weights " + cfg.weights_id;
  return {m.name + weights, m.num_hidden_layers, m.kv_dim(), cfg.store.block_tokens, cfg.executor.page_size_tokens,
          cfg.backend.kv_dtype()};
}

}  // namespace

gpu::kv_memory_source kv_pool_in(std::shared_ptr<transport::transport> t) {
  return [t = std::move(t)](uint64_t bytes) {
    auto m = transport::transport_memory(t, bytes, nullptr);
    return gpu::kv_host_memory{m.get(), m};
  };
}

elastic_instance spawn_elastic_instance(caf::actor_system& sys, const std::string& name, bool serves_prefill,
                                        prefill_rank_config pc, decode_rank_config dc,
                                        std::shared_ptr<gpu::executor> exec,
                                        std::shared_ptr<transport::transport> prefill_transport,
                                        std::shared_ptr<transport::transport> decode_transport,
                                        prefill_balancer_actor pb, decode_balancer_actor db, const store_access& store) {
  pc.name = dc.name = name;
  pc.standby = !serves_prefill;
  dc.standby = serves_prefill;
  elastic_instance out{name, spawn_prefill_rank(sys, pc, exec, std::move(prefill_transport), std::move(pb), store),
                       spawn_decode_rank(sys, dc, std::move(exec), std::move(decode_transport), std::move(db), store),
                       serves_prefill};
  if (auto* p = dynamic_cast<caf::monitorable_actor*>(caf::actor_cast<caf::abstract_actor*>(out.prefill)))
    p->link_to(out.decode);
  return out;
}

std::string model_fingerprint(const gpu::model_config& m) {
  return "model '" + m.name + "' (vocabulary " + std::to_string(m.vocab_size) + ", " + std::to_string(m.num_hidden_layers) +
         " layers, hidden " + std::to_string(m.hidden_size) + ")";
}

std::string weights_identity(const std::string& weights_id, uint64_t weights_seed) {
  return weights_id.empty() ? "weights drawn from seed " + std::to_string(weights_seed) : "weights " + weights_id;
}

local_cluster start_local_cluster(caf::actor_system& sys, const local_cluster_config& cfg,
                                  executor_factory make_executor, transport_wrapper wrap,
                                  block_server_factory make_block_server) {
  // The transport of the rank being built, when the default executors take their KV pool from it
  // (UCX: see kv_pool_in).
  std::shared_ptr<transport::transport> pool_transport;
  if (!make_executor) {
    auto weights = cfg.weights ? cfg.weights
                               : std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
    // The i-th rank made here on the i-th device (round), as gpu::backend_config::for_rank says.
    const int devices = cfg.backend.kind == "cuda" ? gpu::visible_cuda_devices() : 0;
    make_executor = [weights, &cfg, &pool_transport, devices, made = uint32_t{0}](const std::string&) mutable
        -> std::shared_ptr<gpu::executor> {
      auto ec = cfg.executor;
      if (pool_transport && cfg.transport == "ucx") ec.kv_memory = kv_pool_in(pool_transport);
      return gpu::make_backend_executor(cfg.backend.for_rank(made++, devices), cfg.model, weights, ec);
    };
  }
  auto fabric = transport::make_loopback_fabric();
  auto make_transport = [&](const std::string& name) -> std::shared_ptr<transport::transport> {
    std::unique_ptr<transport::transport> t;
    if (cfg.transport == "ucx") {
      std::string why;
      t = transport::make_ucx_transport({.name = name, .send = cfg.ucx_send}, &why);
      // A rank without a transport refuses work and says why (rank_core::setup_error).
      if (!t) t = std::make_unique<transport::failed_transport>("ucx: " + why);
    } else if (cfg.transport == "modelled") {
      t = transport::make_modelled_link(fabric, name);
    } else {
      t = transport::make_loopback_transport(fabric, name);
    }
    if (wrap) return wrap(std::move(t), name);
    return std::shared_ptr<transport::transport>{std::move(t)};
  };
  local_cluster out;
  store_access access;
  if (cfg.store.enabled) {
    access.identity = kv_identity_of(cfg);
    access.replicas = cfg.store.replicas;
    access.read_timeout_ms = cfg.store.read_timeout_ms;
    access.write_slot_timeout_ms = cfg.store.write_slot_timeout_ms;
    const auto [staging_bytes, pending_write_bytes] = store_buffers(cfg);
    access.max_pending_write_bytes = pending_write_bytes;
    access.retention = cfg.store.retention;
    for (uint32_t i = 0; i < cfg.store.index_shards; ++i)  // capacity is split over the shards
      out.store_index.push_back(spawn_block_index(
          sys,
          {(cfg.store.capacity_blocks + cfg.store.index_shards - 1) / cfg.store.index_shards, cfg.store.retention,
           cfg.store.housekeeping_interval_ms},
          {}));
    for (uint32_t i = 0; i < cfg.store.num_servers; ++i) {
      const std::string name = "store-" + std::to_string(i);
      block_server_config bc{i, name, cfg.store.dir + "/server-" + std::to_string(i), access.identity, staging_bytes};
      bc.retention = cfg.store.retention;
      // The directory's budget, split evenly: the ring gives each server about the same share of keys.
      bc.capacity_bytes = store::capacity_bytes_of(cfg.store.capacity_gib) / cfg.store.num_servers;
      auto server = make_block_server ? make_block_server(sys, std::move(bc), make_transport(name), out.store_index)
                                      : spawn_block_server(sys, std::move(bc), make_transport(name), out.store_index);
      out.store_servers.push_back({name, server});
      access.servers.push_back(server);
    }
    // Store nodes: each starts the block server we ask for in its own process and disk.
    if (!cfg.remote_store_hosts.empty()) {
      std::vector<kept_store_node> kept;
      caf::scoped_actor self{sys};
      for (size_t i = 0; i < cfg.remote_store_hosts.size() && out.setup_error.empty(); ++i) {
        const auto& id = access.identity;
        store_adoption a{static_cast<uint32_t>(access.servers.size()), out.store_index, id.model_id, id.num_layers,
                         id.kv_dim, id.block_tokens, id.page_tokens, id.dtype, staging_bytes,
                         cfg.store.retention.chat_ttl_s, cfg.store.retention.agent_ttl_s, cfg.store.retention.batch_ttl_s};
        a.block_bytes = store_block_bytes(cfg);
        self->request(cfg.remote_store_hosts[i], std::chrono::milliseconds{cfg.adopt_timeout_ms}, adopt_atom::value, a)
            .receive(
                [&](block_server_actor& server) {
                  out.store_servers.push_back({"store node " + std::to_string(i), server});
                  access.servers.push_back(server);
                  kept.push_back({"store node " + std::to_string(i), a, server});
                },
                [&](caf::error& e) {
                  out.setup_error = "store node " + std::to_string(i) + " (server " + std::to_string(a.server_id) +
                                    "): adoption failed: " + sys.render(e);
                });
      }
      if (out.setup_error.empty())
        out.store_keeper = spawn_store_keeper(
            sys,
            {cfg.reconnect_store_host, cfg.store.readopt_interval_ms, cfg.adopt_timeout_ms, cfg.store.probe_interval_ms,
             cfg.store.missed_probes, cfg.store_log},
            std::move(kept));
    }
    for (const auto& shard : out.store_index) caf::anon_send(shard, access.servers);
    access.index = out.store_index;
  }
  if (!cfg.store.enabled && cfg.store.local_tier_only) {
    access.identity = kv_identity_of(cfg);
    access.local_tier_only = true;
  }
  out.prefill_balancer = spawn_prefill_balancer(sys, cfg.prefill_balancer);
  auto dbc = cfg.decode_balancer;
  dbc.page_size_tokens = cfg.executor.page_size_tokens;
  out.decode_balancer = spawn_decode_balancer(sys, dbc, access.keyed() ? access.to_info() : store_info{});
  // Ranks that pick tokens walk the router's vocabulary for constrained decoding.
  auto prefill_cfg = cfg.prefill;
  auto decode_cfg = cfg.decode;
  if (cfg.router.tokenizer && !prefill_cfg.vocabulary) prefill_cfg.vocabulary = cfg.router.tokenizer->vocabulary();
  if (cfg.router.tokenizer && !decode_cfg.vocabulary) decode_cfg.vocabulary = cfg.router.tokenizer->vocabulary();
  // A set first lease id (sims) gives each rank a range of its own (2^40 ids each).
  auto lease_range = [&](uint32_t rank) {
    return decode_cfg.first_lease_id ? decode_cfg.first_lease_id + (uint64_t{rank} << 40) : 0;
  };
  for (uint32_t i = 0; i < cfg.num_decode_ranks; ++i) {
    auto rc = decode_cfg;
    rc.name = cfg.decode.name + "-" + std::to_string(i);
    rc.first_lease_id = lease_range(i);
    pool_transport = make_transport(rc.name);
    auto exec = make_executor(rc.name);
    out.decode.push_back({rc.name, spawn_decode_rank(sys, rc, std::move(exec), std::move(pool_transport),
                                                           out.decode_balancer, access)});
  }
  for (uint32_t i = 0; i < cfg.num_prefill_ranks; ++i) {
    auto rc = prefill_cfg;
    rc.name = cfg.prefill.name + "-" + std::to_string(i);
    pool_transport = make_transport(rc.name);
    auto exec = make_executor(rc.name);
    out.prefill.push_back({rc.name, spawn_prefill_rank(sys, rc, std::move(exec), std::move(pool_transport),
                                                             out.prefill_balancer, access)});
  }
  // Elastic instances: one executor each (one set of weights), a prefill and a decode actor on
  // it, the inactive one on standby; the controller moves them between the roles.
  for (uint32_t i = 0; i < cfg.num_elastic_ranks; ++i) {
    const std::string name = cfg.elastic_name + "-" + std::to_string(i);
    auto dc = decode_cfg;
    dc.first_lease_id = lease_range(cfg.num_decode_ranks + i);
    out.elastic.push_back(spawn_elastic_instance(sys, name, i < cfg.elastic_prefill_at_start, prefill_cfg, dc,
                                                 make_executor(name), make_transport(name), make_transport(name),
                                                 out.prefill_balancer, out.decode_balancer, access));
  }
  if (!out.elastic.empty() || cfg.elastic_nodes) {
    std::vector<prefill_rank_actor> fp;
    std::vector<decode_rank_actor> fd;
    for (const auto& r : out.prefill) fp.push_back(r.handle);
    for (const auto& r : out.decode) fd.push_back(r.handle);
    out.elastic_controller = spawn_elastic_controller(sys, cfg.elastic, out.elastic, fp, fd, out.prefill_balancer,
                                                      out.decode_balancer);
  }
  auto rc = cfg.router;
  if (!rc.tokenizer) rc.tokenizer = gpu::make_byte_tokenizer(cfg.model);
  out.router = spawn_router(sys, rc, cfg.model, out.prefill_balancer, out.decode_balancer, access);
  // With the store, or with prompts keyed for the ranks' own tiers alone: prefill ranks joining
  // from node processes key them alike (store_access::from_info).
  if (access.keyed()) out.store = access.to_info();
  cluster_welcome welcome{.router = out.router, .prefill_balancer = out.prefill_balancer,
                          .decode_balancer = out.decode_balancer, .store = out.store};
  welcome.elastic_controller = out.elastic_controller;
  node_directory_config dc;
  dc.model = model_fingerprint(cfg.model);
  dc.weights = weights_identity(cfg.weights_id, cfg.weights_seed);
  dc.page_tokens = cfg.executor.page_size_tokens;
  dc.log = cfg.node_log;
  out.directory = spawn_node_directory(sys, dc, welcome);
  // Its stats name the nodes. From a scoped actor: the router takes it only from its own process.
  caf::scoped_actor{sys}->send(out.router, directory_atom::value, node_stats_actor{out.directory});
  if (!out.setup_error.empty())
    for (auto& a : out.actors()) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  return out;
}

std::vector<caf::actor> local_cluster::actors() const {
  std::vector<caf::actor> out{caf::actor_cast<caf::actor>(router), caf::actor_cast<caf::actor>(prefill_balancer),
                              caf::actor_cast<caf::actor>(decode_balancer), caf::actor_cast<caf::actor>(directory)};
  for (const auto& r : prefill) out.push_back(caf::actor_cast<caf::actor>(r.handle));
  for (const auto& r : decode) out.push_back(caf::actor_cast<caf::actor>(r.handle));
  for (const auto& e : elastic) {
    out.push_back(caf::actor_cast<caf::actor>(e.prefill));
    out.push_back(caf::actor_cast<caf::actor>(e.decode));
  }
  if (elastic_controller) out.push_back(caf::actor_cast<caf::actor>(elastic_controller));
  for (const auto& shard : store_index) out.push_back(caf::actor_cast<caf::actor>(shard));
  if (store_keeper) out.push_back(caf::actor_cast<caf::actor>(store_keeper));  // first: it sees the servers stop
  for (const auto& s : store_servers) out.push_back(caf::actor_cast<caf::actor>(s.handle));
  return out;
}

std::vector<std::string> local_cluster::rank_names() const {
  std::vector<std::string> out;
  for (const auto& r : prefill) out.push_back(r.name);
  for (const auto& r : decode) out.push_back(r.name);
  for (const auto& e : elastic) out.push_back(e.name);
  return out;
}

}  // namespace baton

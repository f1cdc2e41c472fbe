#include "sims/modelled_block_server.hpp"

#include <caf/actor_system.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "actors/block_index.hpp"
#include "gpu/kv_cache.hpp"
#include "store/staging_pool.hpp"
#include "transport/transport.hpp"

namespace baton::sims {

namespace {

struct key_hash {
  size_t operator()(const std::pair<uint64_t, uint64_t>& k) const { return k.first ^ (k.second * 0x9e3779b97f4a7c15ull); }
};

struct modelled_server_state {
  block_server_config cfg;
  modelled_store_config model;
  std::shared_ptr<transport::transport> xport;
  std::vector<block_index_actor> index;
  /// The blocks written here: per block, its per-layer checksums (what a reader verifies).
  std::unordered_map<std::pair<uint64_t, uint64_t>, std::vector<uint64_t>, key_hash> blocks;
  // Writers put into this registered staging, as into a real server's.
  std::vector<std::byte> write_staging;
  std::optional<transport::region_key> write_key;
  write_slot_table slots;
  std::string setup_error;
  /// The one queue of the node's disks and NIC: when it is next free (actor clock).
  caf::actor_clock::time_point busy_until;
  /// Work waiting for its virtual time, by job id (an io_atom message fires it).
  std::unordered_map<uint64_t, std::function<void()>> jobs;
  uint64_t last_job = 0;
  store_stats stats;
  static inline const char* name = "baton.modelled_block_server";
};

using pointer = block_server_actor::stateful_pointer<modelled_server_state>;

/// Runs `fn` at virtual time `at`.
void at_time(pointer self, caf::actor_clock::time_point at, std::function<void()> fn) {
  const uint64_t id = ++self->state.last_job;
  self->state.jobs[id] = std::move(fn);
  const auto now = self->clock().now();
  self->delayed_send(self, at > now ? at - now : caf::actor_clock::duration_type{0}, io_atom::value, id);
}

/// Books `real_bytes` on the node's queue and, for a read, on the reader's PCIe queue; returns
/// when the transfer starts and, via `per`, how long each of `parts` equal shares takes.
caf::actor_clock::time_point book(pointer self, double real_bytes, uint32_t parts, const std::string& reader,
                                  caf::actor_clock::duration_type* per) {
  auto& st = self->state;
  const auto now = self->clock().now();
  const bool pcie = !reader.empty() && st.model.pcie_gbps > 0;
  auto start = std::max(now, st.busy_until);
  double gbps = st.model.gbps;
  if (pcie) {
    auto [it, fresh] = st.model.pcie_free->try_emplace(reader, now);
    start = std::max(start, it->second);
    gbps = std::min(gbps, st.model.pcie_gbps);
  }
  const double total_ns = real_bytes / (gbps * 1e9) * 1e9;
  *per = std::chrono::nanoseconds{std::llround(total_ns / std::max(1u, parts))};
  st.busy_until = start + *per * std::max(1u, parts);
  if (pcie) (*st.model.pcie_free)[reader] = st.busy_until;
  // The access latency delays this transfer's data, not the queue behind it.
  return start + std::chrono::nanoseconds{std::llround(st.model.latency_us * 1e3)};
}

/// Announces layer `l` of a read, then (after the next share of queue time) the next one; the
/// last layer also answers the read.
void serve_layer(pointer self, std::shared_ptr<store_read_order> order, std::shared_ptr<store_read_result> result,
                 caf::typed_response_promise<store_read_result> promise, uint32_t l, caf::actor_clock::time_point at,
                 caf::actor_clock::duration_type per) {
  at_time(self, at, [=]() mutable {
    if (order->reader_actor) {
      store_layer_landed ev{order->request_id, l, {}, {}, order->tag};
      for (size_t i = 0; i < order->blocks.size(); ++i)
        if (result->errors[i].empty()) {
          ev.block_index.push_back(order->block_index[i]);
          ev.checksums.push_back(result->checksums[i][l]);
        }
      caf::anon_send(order->reader_actor, std::move(ev));
    }
    if (l + 1 < order->region.num_layers) return serve_layer(self, order, result, promise, l + 1, at + per, per);
    promise.deliver(std::move(*result));
  });
}

block_server_actor::behavior_type modelled_server(pointer self, block_server_config cfg,
                                                  std::shared_ptr<transport::transport> xport,
                                                  std::vector<block_index_actor> index, modelled_store_config m) {
  auto& st = self->state;
  st.cfg = std::move(cfg);
  st.model = m;
  st.xport = std::move(xport);
  st.index = std::move(index);
  st.busy_until = self->clock().now();
  st.write_staging.resize(st.cfg.staging_bytes);
  transport::xfer_error err;
  st.write_key = st.xport->register_region(st.write_staging.data(), st.write_staging.size(), &err);
  if (!st.write_key) st.setup_error = st.cfg.name + ": cannot register the write staging: " + err.to_string();
  st.slots.reset(st.write_staging.size(), st.write_key);
  return {
      [=](store_read_order& o) -> caf::result<store_read_result> {
        auto& s = self->state;
        const size_t n = o.blocks.size();
        auto result = std::make_shared<store_read_result>(
            store_read_result{o.request_id, o.block_index, std::vector<std::string>(n), std::vector<std::vector<uint64_t>>(n)});
        const auto& reg = o.region;
        const gpu::kv_layout layout{reg.num_layers, reg.num_pages, reg.page_size_tokens, reg.kv_dim, reg.kv_planes};
        const uint32_t ppb = reg.page_size_tokens ? o.block_tokens / reg.page_size_tokens : 0;
        double bytes = 0;
        for (size_t i = 0; i < n; ++i) {
          auto b = s.blocks.find({o.blocks[i].hi, o.blocks[i].lo});
          if (!s.setup_error.empty())
            result->errors[i] = s.setup_error;
          else if (b == s.blocks.end())
            result->errors[i] = "block not on this server";
          else if (b->second.size() != reg.num_layers || ppb == 0)
            result->errors[i] = "block layout does not match the reader's pages";
          else {
            result->checksums[i] = b->second;
            bytes += static_cast<double>(ppb) * layout.page_bytes() * reg.num_layers;
            ++s.stats.blocks_read;
          }
          if (!result->errors[i].empty()) ++s.stats.read_failures;
        }
        s.stats.bytes_read += static_cast<uint64_t>(bytes * s.model.bytes_scale);
        caf::actor_clock::duration_type per{};
        const auto start = book(self, bytes * s.model.bytes_scale, reg.num_layers, o.reader, &per);
        auto promise = self->make_response_promise<store_read_result>();
        if (reg.num_layers == 0) {
          promise.deliver(std::move(*result));
          return promise;
        }
        serve_layer(self, std::make_shared<store_read_order>(std::move(o)), result, promise, 0, start + per, per);
        return promise;
      },
      [=](store_write_begin& b) -> caf::result<store_write_slot> {
        auto& s = self->state;
        auto slot = s.slots.grant(b, s.cfg.name, s.setup_error);
        if (!slot) return std::move(slot.error());
        return std::move(*slot);
      },
      // Modelled writers' puts do not fail unannounced; a failed one gives its slot back.
      [=](release_atom, uint64_t slot_id) {
        if (self->state.slots.reclaim(slot_id)) ++self->state.stats.slots_reclaimed;
      },
      [=](expire_atom, uint64_t slot_id) {
        if (self->state.slots.reclaim(slot_id)) ++self->state.stats.slots_reclaimed;
      },
      [=](store_write_order& w) -> caf::result<uint64_t> {
        auto& s = self->state;
        if (!s.slots.claim(w.slot_id))
          return make_error(errc::bad_request, where(w.request_id, s.cfg.name, "store_write") + ": unknown slot");
        caf::actor_clock::duration_type per{};
        const auto start = book(self, static_cast<double>(w.bytes) * s.model.bytes_scale, 1, {}, &per);
        auto promise = self->make_response_promise<uint64_t>();
        at_time(self, start + per, [=, w = std::move(w)]() mutable {
          auto& s = self->state;
          s.slots.release(w.slot_id);
          if (w.checksums.empty()) {  // as the real server: a block must be whole layers
            promise.deliver(uint64_t{0});
            return;
          }
          s.blocks[{w.block.hi, w.block.lo}] = w.checksums;
          ++s.stats.blocks_written;
          s.stats.bytes_written += static_cast<uint64_t>(static_cast<double>(w.bytes) * s.model.bytes_scale);
          block_ref b{w.block.hi, w.block.lo, {s.cfg.server_id}};
          self->send(s.index[shard_of({b.hi, b.lo}, static_cast<uint32_t>(s.index.size()))], commit_atom::value,
                     std::vector<block_commit>{{b, w.parent_hi, w.parent_lo, w.retention, w.bytes}});
          promise.deliver(w.bytes);
        });
        return promise;
      },
      // No race to guard against here (one thread, virtual time): write_seq is not checked.
      [=](delete_atom, uint64_t hi, uint64_t lo, uint64_t) { self->state.blocks.erase({hi, lo}); },
      [=](touch_atom, std::vector<uint64_t>&) {},  // no disk capacity modelled: only the index's LRU counts
      [=](stats_atom) { return self->state.stats; },
      [=](io_atom, uint64_t id) {
        auto& s = self->state;
        auto i = s.jobs.find(id);
        if (i == s.jobs.end()) return;
        auto fn = std::move(i->second);
        s.jobs.erase(i);
        fn();
      },
  };
}

}  // namespace

block_server_actor spawn_modelled_block_server(caf::actor_system& sys, block_server_config cfg,
                                               std::shared_ptr<transport::transport> xport,
                                               std::vector<block_index_actor> index, modelled_store_config m) {
  return sys.spawn(modelled_server, std::move(cfg), std::move(xport), std::move(index), m);
}

}  // namespace baton::sims

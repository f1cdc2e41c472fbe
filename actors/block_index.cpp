#include "actors/block_index.hpp"

#include <set>

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

namespace baton {

namespace {

struct block_index_state {
  block_index_config cfg;
  store::block_index index;
  std::vector<block_server_actor> servers;
  /// Servers whose actor went down (their store node died): CHECK no longer names them, so
  /// readers do not wait on them, and the index forgets their copies (once the store node is
  /// back, the head adopts it again, and its new server commits what its disk holds again).
  std::vector<bool> server_down;
  /// Deletes for servers the index does not know yet, or that are down: a server recovering its
  /// blocks commits them (and its expired ones are dropped) before the cluster hands the index
  /// its server list, or before its adoption again reaches the index. Sent when the server is
  /// known and up, or those files would stay on disk for good. Bounded by the blocks evicted or
  /// recovered meanwhile.
  struct pending_delete {
    uint32_t server;
    store::block_key key;
    uint64_t write_seq;
  };
  std::vector<pending_delete> pending_deletes;
  /// Ranks' watches on the servers (servers_atom, id, generation, down), answered at the server's
  /// next change: it goes down, or is adopted again. One per rank and server; a rank that stops
  /// (watched: `watchers`) takes its own with it.
  struct watch {
    uint32_t server;
    caf::actor_addr asker;
    caf::typed_response_promise<block_server_actor, uint64_t, bool> rp;
  };
  std::vector<watch> waiting;
  std::set<caf::actor_addr> watchers;
  /// By server id: how often it was adopted again (0: the actor the cluster started with).
  std::vector<uint64_t> generation;
  caf::actor_clock::time_point started;
  store_stats stats;
  static inline const char* name = "baton.block_index";
};

using pointer = block_index_actor::stateful_pointer<block_index_state>;

double now_s(pointer self) {
  return std::chrono::duration<double>(self->clock().now() - self->state.started).count();
}

void drop(pointer self, const std::vector<store::block_meta>& gone) {
  auto& st = self->state;
  for (const auto& m : gone)
    for (size_t k = 0; k < m.servers.size(); ++k) {
      const auto s = m.servers[k];
      const uint64_t seq = k < m.write_seqs.size() ? m.write_seqs[k] : 0;
      if (s >= st.servers.size() || st.server_down[s]) st.pending_deletes.push_back({s, m.key, seq});
      else self->send(st.servers[s], delete_atom::value, m.key.hi, m.key.lo, seq);
    }
}

/// Sends the deletes held for servers that are now known and up.
void flush_pending_deletes(pointer self) {
  auto& st = self->state;
  auto pending = std::exchange(st.pending_deletes, {});
  for (const auto& d : pending) {
    if (d.server < st.servers.size() && !st.server_down[d.server])
      self->send(st.servers[d.server], delete_atom::value, d.key.hi, d.key.lo, d.write_seq);
    else st.pending_deletes.push_back(d);  // still unknown, or down
  }
}

void set_servers(pointer self, std::vector<block_server_actor> servers) {
  auto& st = self->state;
  st.servers = std::move(servers);
  st.server_down.assign(st.servers.size(), false);
  st.generation.assign(st.servers.size(), 0);
  for (const auto& s : st.servers) self->monitor(s);
  flush_pending_deletes(self);
}

/// Tells the ranks watching server `id` how it is now.
void answer_watches(pointer self, uint32_t id) {
  auto& st = self->state;
  auto waiting = std::exchange(st.waiting, {});
  for (auto& w : waiting) {
    if (w.server == id) w.rp.deliver(st.servers[id], st.generation[id], static_cast<bool>(st.server_down[id]));
    else st.waiting.push_back(std::move(w));
  }
}

/// Server `id` is `server` now: a store node that went down, adopted again. It commits what its
/// disk holds as it starts, and CHECK names it again.
void readopted(pointer self, uint32_t id, block_server_actor server) {
  auto& st = self->state;
  if (id >= st.servers.size() || !server) return;
  st.servers[id] = server;
  st.server_down[id] = false;
  ++st.generation[id];
  self->monitor(server);
  flush_pending_deletes(self);
  answer_watches(self, id);
}

/// Server `id` is down: its actor went down (its store node died, or the link to it broke), or
/// the store keeper gave up on it (it answered no probe: a node hung or cut off, whose link may
/// take minutes to break).
void went_down(pointer self, uint32_t id) {
  auto& st = self->state;
  if (id >= st.servers.size() || st.server_down[id]) return;
  st.server_down[id] = true;
  // Blocks only it held cannot be read: they must not take the room of blocks that can. No
  // delete goes anywhere: their files stay on its disk.
  st.index.forget_server(id);
  // Ranks in other processes see no down message of their own (their messages to it went
  // through the head): they learn it here, and stop writing to it.
  answer_watches(self, id);
}

void schedule_housekeeping(pointer self) {
  self->delayed_send(self, std::chrono::milliseconds{self->state.cfg.housekeeping_interval_ms}, timer_atom::value,
                     uint64_t{0});
}

block_index_actor::behavior_type block_index_impl(pointer self, block_index_config cfg,
                                                  std::vector<block_server_actor> servers) {
  auto& st = self->state;
  st.index.set_capacity(cfg.capacity_blocks);
  st.cfg = std::move(cfg);
  set_servers(self, std::move(servers));
  st.started = self->clock().now();
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& st = self->state;
    if (st.watchers.erase(dm.source)) {  // a rank that watched servers stopped
      std::erase_if(st.waiting, [&](const auto& w) { return w.asker == dm.source; });
      return;
    }
    for (size_t i = 0; i < st.servers.size(); ++i)
      if (caf::actor_cast<caf::actor_addr>(st.servers[i]) == dm.source) went_down(self, static_cast<uint32_t>(i));
  });
  schedule_housekeeping(self);
  return {
      [=](check_atom, uint64_t, std::vector<block_ref>& keys) {
        // Per key, where it lives (no servers: absent or expired). With several index shards a
        // request asks each for its own keys and takes the leading run that all of them hold.
        auto& st = self->state;
        const double now = now_s(self);
        std::vector<store::block_key> hits;
        std::vector<std::vector<uint64_t>> per_server(st.servers.size());  // hits by server, for touch_atom
        for (auto& b : keys) {
          const auto* m = st.index.find({b.hi, b.lo});
          b.servers.clear();
          if (!m || m->expires_at_s <= now) continue;
          for (auto s : m->servers)
            if (s >= st.server_down.size() || !st.server_down[s]) b.servers.push_back(s);
          if (b.servers.empty()) continue;  // every copy was on servers that are gone: a miss
          hits.push_back({b.hi, b.lo});
          for (auto s : b.servers)
            if (s < per_server.size()) per_server[s].insert(per_server[s].end(), {b.hi, b.lo});
        }
        // A hit is a use: the blocks become most recently used, leading ones last -- here, and
        // on the servers holding them, which order their own files for their disks' capacity.
        st.index.touch_chain(hits, now);
        for (size_t s = 0; s < per_server.size(); ++s)
          if (!per_server[s].empty()) self->send(st.servers[s], touch_atom::value, std::move(per_server[s]));
        ++st.stats.checks;
        st.stats.hit_blocks += hits.size();
        return keys;
      },
      [=](commit_atom, std::vector<block_commit>& commits) {
        auto& st = self->state;
        const double now = now_s(self);
        for (auto& c : commits) {
          const auto cls = store::parse_retention(c.retention).value_or(store::retention::chat);
          const double expires = now + st.cfg.retention.ttl_s(cls) - static_cast<double>(c.age_ms) / 1e3;
          store::block_meta m{{c.block.hi, c.block.lo}, {c.parent_hi, c.parent_lo}, c.block.servers, c.size_bytes, cls,
                              expires, now, std::vector<uint64_t>(c.block.servers.size(), c.write_seq)};
          // Found on disk by a restarted server (age_ms > 0). Even one whose retention ran out
          // while the store was down is not deleted yet: the ring put its descendants on other
          // servers, whose scans may not be in, and one of them may keep it alive as the live
          // index did. Unserved meanwhile; housekeeping deletes it when the hold ends, if nothing
          // extended it.
          const double hold_until =
              c.age_ms > 0 ? now + uint64_t{st.cfg.recovery_hold_intervals} * st.cfg.housekeeping_interval_ms / 1e3 : 0.0;
          st.index.upsert(std::move(m), now, hold_until);
        }
        // Once per message: a recovered batch past the capacity loses its least recent blocks,
        // as one block at a time would.
        auto evicted = st.index.evict_to_capacity();
        st.stats.evicted += evicted.size();
        drop(self, evicted);
      },
      [=](delete_atom, uint32_t server, uint64_t hi, uint64_t lo, uint64_t write_seq) {
        // A server made room on its disk (block_server_config::capacity_bytes): CHECK must stop
        // sending readers to a file that is gone. No delete goes back: the file is already gone.
        self->state.index.drop_copy({hi, lo}, server, write_seq);
      },
      [=](timer_atom, uint64_t) {
        // Background housekeeping: reads and CHECKs are never blocked by it (one actor turn).
        auto& st = self->state;
        auto expired = st.index.expire(now_s(self));
        st.stats.expired += expired.size();
        drop(self, expired);
        auto evicted = st.index.evict_to_capacity();
        st.stats.evicted += evicted.size();
        drop(self, evicted);
        schedule_housekeeping(self);
      },
      [=](std::vector<block_server_actor>& servers) { set_servers(self, std::move(servers)); },
      [=](adopt_atom, uint32_t id, block_server_actor& server) { readopted(self, id, std::move(server)); },
      [=](lost_atom, uint32_t id, const block_server_actor& server) {
        // Only the actor given up on: a keeper's word that crossed its re-adoption is stale.
        if (id < self->state.servers.size() && self->state.servers[id] == server) went_down(self, id);
      },
      [=](servers_atom) { return self->state.servers; },
      [=](servers_atom, uint32_t id, uint64_t have, bool known_down) -> caf::result<block_server_actor, uint64_t, bool> {
        auto& st = self->state;
        if (id >= st.servers.size())
          return make_error(errc::bad_request, "block index: no block server " + std::to_string(id) + " (the store has " +
                                                   std::to_string(st.servers.size()) + ")");
        const bool down = st.server_down[id];
        if (st.generation[id] != have || down != known_down) return {st.servers[id], st.generation[id], down};
        auto asker = caf::actor_cast<caf::actor_addr>(self->current_sender());
        if (st.watchers.insert(asker).second) self->monitor(caf::actor_cast<caf::actor>(self->current_sender()));
        auto rp = self->make_response_promise<block_server_actor, uint64_t, bool>();
        st.waiting.push_back({id, std::move(asker), rp});
        return rp;
      },
      [=](stats_atom) {
        auto s = self->state.stats;
        s.blocks = self->state.index.size();
        return s;
      },
  };
}

}  // namespace

block_index_actor spawn_block_index(caf::actor_system& sys, block_index_config cfg,
                                    std::vector<block_server_actor> servers) {
  return sys.spawn(block_index_impl, std::move(cfg), std::move(servers));
}

}  // namespace baton

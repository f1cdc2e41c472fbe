// Elastic drain of a decode rank (issue 15): its running sequences move to other decode ranks
// with their KV, so a rank turning into a prefill rank hands its work over instead of finishing
// it (slow) or dropping it (recompute).
//
// Per sequence, between steps: out of the batch; a rank from the decode balancer (this one is
// drained there, so never itself); a lease there (the same reserve a request makes); one put per
// layer from this pool into that lease's pages, each announced with kv_layer_ready and its
// checksum, as a prefill rank does; once every layer landed and the target said each passed its
// check (kv_commit_atom), the request's decode_order is answered "migrated" with the new rank
// and lease, and the request sends that rank the order that continues the sequence (request.cpp). Sampling depends only on (seed, position) and the
// executor is batch-invariant, so the tokens are the ones the sequence would have had here.
// Any failure puts the sequence back into the batch: it finishes here.

#include <caf/typed_event_based_actor.hpp>

#include <algorithm>
#include <cstdio>

#include "actors/decode_rank_state.hpp"

namespace baton::decode_detail {

namespace {

constexpr auto migrate_timeout = std::chrono::seconds{2};

/// A sequence released while it moved: its decode order is answered as any released one is.
void answer_released(decode_state& st, uint64_t lease_id) {
  auto l = st.leases.find(lease_id);
  if (l != st.leases.end() && l->second.has_order && l->second.promise.pending())
    l->second.promise.deliver(decode_summary{.request_id = l->second.request_id, .finish_reason = "released"});
}

void schedule_poll(decode_pointer self) {
  auto& st = self->state;
  // Only while some move has puts in flight: one still waiting for a place or a lease (seconds)
  // has nothing to poll, and its answer schedules the poll when its puts go.
  if (st.migrate_poll_scheduled || std::none_of(st.migrations.begin(), st.migrations.end(), [](const auto& m) {
        return !m.second.xfers.empty() && !m.second.committing;
      }))
    return;
  st.migrate_poll_scheduled = true;
  self->delayed_send(self, std::chrono::microseconds{200}, migrate_poll_atom::value);
}

/// The move failed: release what the target holds for it and let the sequence finish here.
void abandon(decode_pointer self, uint64_t lease_id, const std::string& why) {
  auto& st = self->state;
  auto m = st.migrations.find(lease_id);
  if (m == st.migrations.end()) return;
  bool in_flight = false;  // puts released here may still land in the target's pages
  for (auto x : m->second.xfers)
    if (x) {
      st.core.xport->release(x);
      in_flight = true;
    }
  if (m->second.grant.lease_id && m->second.target)
    self->send(m->second.target, release_atom::value, m->second.grant.lease_id, in_flight);
  st.core.log->add({0, "migrate_failed", st.leases.count(lease_id) ? st.leases.at(lease_id).request_id : 0, 0, 0, {}, {}});
  const auto rid = st.leases.count(lease_id) ? st.leases.at(lease_id).request_id : 0;
  st.last_migrate_error = where(rid, st.cfg.name, "migrate") +
                          (m->second.target_name.empty() ? "" : ": to " + m->second.target_name) + ": " + why;
  ++st.migrate_failed;
  // Moves are rare (a drain), and each failure leaves a rank busy longer than its operator asked.
  std::fprintf(stderr, "baton: %s (the sequence finishes here)\n", st.last_migrate_error.c_str());
  const auto seq = m->second.seq;
  const bool released = m->second.released;
  st.migrations.erase(m);
  if (released) {
    answer_released(st, lease_id);
    free_lease(self, lease_id);
    return;
  }
  st.stay.push_back(lease_id);
  st.batch.push_back(seq);
  maybe_step(self);
}

/// Every layer landed and passed its check there: the request learns where its sequence went;
/// this lease is freed.
void complete(decode_pointer self, uint64_t lease_id) {
  auto& st = self->state;
  auto m = st.migrations.find(lease_id);
  auto l = st.leases.find(lease_id);
  if (m == st.migrations.end() || l == st.leases.end()) return;
  // Every put landed: the target hears that its one writer is done, so a lease that nobody
  // takes up (the request gave up meanwhile) is freed at its expiry, not quarantined.
  self->send(m->second.target, writer_done_atom::value, m->second.grant.lease_id, uint32_t{1});
  if (m->second.released) {
    self->send(m->second.target, release_atom::value, m->second.grant.lease_id, false);
    answer_released(st, lease_id);
  } else {
    decode_summary s{.request_id = l->second.request_id, .num_tokens = m->second.seq.num_generated, .finish_reason = "migrated",
                     .queue_us = l->second.queue_us};
    s.moved_to = caf::actor_cast<caf::strong_actor_ptr>(m->second.target);
    s.moved_rank = m->second.target_name;
    s.moved_lease = m->second.grant.lease_id;
    l->second.promise.deliver(std::move(s));
    ++st.migrated_out;
    st.core.log->add({0, "migrated", l->second.request_id, m->second.seq.pos, 0, {}, {}});
  }
  st.migrations.erase(m);
  free_lease(self, lease_id);
}

/// Every put landed: the sequence stays here until the target says each layer passed its check
/// (kv_commit_atom). Answered "migrated" on the puts alone, a layer corrupted on the way would
/// have failed the request over to a recompute instead of leaving the sequence where it was.
void commit(decode_pointer self, uint64_t lease_id) {
  auto& st = self->state;
  auto& m = st.migrations.at(lease_id);
  m.committing = true;
  const uint64_t rid = st.leases.count(lease_id) ? st.leases.at(lease_id).request_id : 0;
  // The checks run on the target's worker at its memory's speed: far quicker than the puts.
  const auto timeout = std::chrono::milliseconds{st.cfg.migrate_send_timeout_ms} + migrate_timeout;
  self->request(m.target, timeout, kv_commit_atom::value, m.grant.lease_id, rid)
      .then(
          [=](bool) {
            if (self->state.migrations.count(lease_id)) complete(self, lease_id);
            report_load(self);
          },
          [=](caf::error& e) {
            if (!self->state.migrations.count(lease_id)) return;
            abandon(self, lease_id, "the target's check: " + self->system().render(e));
            report_load(self);
          });
}

/// Placed and reserved: one put per layer of the pages holding positions [0, pos).
void send_layers(decode_pointer self, uint64_t lease_id) {
  auto& st = self->state;
  auto& m = st.migrations.at(lease_id);
  const auto& l = st.leases.at(lease_id);
  const auto& kv = st.core.exec->kv();
  const auto& lay = kv.layout();
  const auto& r = m.grant.region;
  if (!st.core.pool_key || r.num_layers != lay.num_layers || r.page_size_tokens != lay.page_size_tokens ||
      r.kv_dim != lay.kv_dim || r.kv_planes != lay.planes)
    return abandon(self, lease_id, "the target's KV layout differs");
  const gpu::kv_layout remote{r.num_layers, r.num_pages, r.page_size_tokens, r.kv_dim, r.kv_planes};
  const uint32_t pages = kv.pages_for_tokens(m.seq.pos);
  if (pages > m.grant.page_ids.size()) return abandon(self, lease_id, "the target lease is too small");
  const transport::region_key key{r.backend, r.region_id, r.size_bytes, r.packed_key};
  m.xfers.assign(lay.num_layers, 0);
  m.posted_at = self->clock().now();
  for (uint32_t layer = 0; layer < lay.num_layers; ++layer) {
    transport::put_desc d{l.request_id, layer, m.target_name, st.core.pool_key->region_id, key, {}};
    for (uint32_t i = 0; i < pages; ++i)
      d.segments.push_back(
          {lay.offset_bytes(layer, l.pages[i]), remote.offset_bytes(layer, m.grant.page_ids[i]), lay.page_bytes()});
    m.xfers[layer] = st.core.xport->post_put(d);
  }
  schedule_poll(self);
}

void start(decode_pointer self, const running_seq& seq) {
  auto& st = self->state;
  const auto& l = st.leases.at(seq.lease_id);
  auto& m = st.migrations[seq.lease_id];
  m.seq = seq;
  const uint32_t remaining = l.order.max_new_tokens > seq.num_generated ? l.order.max_new_tokens - seq.num_generated : 0;
  const uint32_t total = seq.pos + remaining + 1;
  // The target must not write back what this rank would not: expanded KV, or KV a late put of
  // an abandoned writer may have touched.
  const bool inexact_kv = l.wire_form || l.writers.abandoned;
  const uint64_t lease_id = seq.lease_id, rid = l.request_id;
  // The target's lease must outlive the puts: each landed layer renews it, but a long sequence's
  // first layer may take longer than a request's lease (2 s) to land, and a lease expired there
  // would turn a finished move into a failover that recomputes everything. It lasts as long as
  // this rank waits for the puts (migrate_send_timeout_ms), plus the time to place and reserve.
  const uint32_t lease_ms = std::max<uint32_t>(
      l.lease_ms, st.cfg.migrate_send_timeout_ms +
                      static_cast<uint32_t>(std::chrono::duration_cast<std::chrono::milliseconds>(migrate_timeout).count()));
  place_query q{rid, 0, seq.pos, total};
  q.attempt = placement_of_move;
  q.wait_ms = static_cast<uint32_t>(std::chrono::duration_cast<std::chrono::milliseconds>(migrate_timeout).count());
  self->request(st.balancer, migrate_timeout, place_atom::value, std::move(q))
      .then(
          [=](decode_placement& p) {
            auto& st = self->state;
            // A placement not taken up gives its charge back at once: it would count on the
            // target's load (on this rank's, placed on itself) until the charge's time ran out.
            const bool gone = !st.migrations.count(lease_id);
            if (gone || p.rank == caf::actor_cast<decode_rank_actor>(self))
              self->send(st.balancer, release_atom::value, rid, placement_of_move);
            if (gone) return;
            if (p.rank == caf::actor_cast<decode_rank_actor>(self)) return abandon(self, lease_id, "placed on itself");
            st.migrations.at(lease_id).target = p.rank;
            st.migrations.at(lease_id).target_name = p.name;
            // Longer than the target may hold a reservation waiting for pages (reserve_wait_ms, the
            // same config on every rank): giving up first would leave its late grant to nobody.
            const auto reserve_timeout = std::chrono::milliseconds{self->state.cfg.reserve_wait_ms} + migrate_timeout;
            self->request(p.rank, reserve_timeout, reserve_atom::value, kv_lease_reserve{rid, total, lease_ms, seq.pos, 0, inexact_kv})
                .then(
                    [=](kv_lease_grant& g) {
                      auto& st = self->state;
                      auto m = st.migrations.find(lease_id);
                      if (m == st.migrations.end()) {
                        self->send(p.rank, release_atom::value, g.lease_id, false);
                        return;
                      }
                      m->second.grant = std::move(g);
                      send_layers(self, lease_id);
                    },
                    [=](caf::error& e) {
                      // A grant may yet come, to nobody: the target frees it (or the waiting reservation).
                      if (e == caf::sec::request_timeout) self->send(p.rank, cancel_atom::value, rid);
                      abandon(self, lease_id, "reserve at " + p.name + ": " + self->system().render(e));
                    });
          },
          [=](caf::error& e) {
            // Given up while parked: the balancer drops it (its asker stopped waiting); sent
            // all the same, as a placement made as the wait ran out would charge a rank.
            self->send(self->state.balancer, release_atom::value, rid, placement_of_move);
            abandon(self, lease_id, "placement: " + self->system().render(e));
          });
}

}  // namespace

void take_for_migration(decode_pointer self) {
  auto& st = self->state;
  if (!st.migrate_out || st.step_in_flight || !st.balancer || st.batch.empty()) return;
  std::vector<running_seq> keep, go;
  for (const auto& s : st.batch) {
    const auto& l = st.leases.at(s.lease_id);
    const bool stays = std::count(st.stay.begin(), st.stay.end(), s.lease_id) > 0;
    // Nothing left to generate: it finishes with its next step anyway.
    (stays || l.release_after_step || s.num_generated >= l.order.max_new_tokens ? keep : go).push_back(s);
  }
  st.batch = std::move(keep);
  for (const auto& s : go) start(self, s);
}

void poll_migrations(decode_pointer self) {
  auto& st = self->state;
  st.migrate_poll_scheduled = false;
  std::vector<uint64_t> done, failed;
  std::vector<std::string> why;
  const auto now = self->clock().now();
  const auto limit = std::chrono::milliseconds{st.cfg.migrate_send_timeout_ms};
  for (auto& [lease_id, m] : st.migrations) {
    if (m.xfers.empty()) continue;  // not placed or reserved yet
    // Polled first, the deadline after: puts that settled since the last poll count (given up
    // with them, the move would leave the sequence here for good and quarantine the target's
    // pages for puts that had landed).
    const auto& l = st.leases.at(lease_id);
    bool broke = false;
    for (uint32_t layer = 0; layer < m.xfers.size(); ++layer) {
      if (!m.xfers[layer]) continue;
      transport::xfer_error err;
      const auto state = st.core.xport->poll(m.xfers[layer], &err);
      if (state == transport::xfer_state::pending) continue;
      st.core.xport->release(m.xfers[layer]);
      m.xfers[layer] = 0;
      if (state == transport::xfer_state::failed) {
        failed.push_back(lease_id);
        why.push_back("layer " + std::to_string(layer) + ": " + err.what);
        broke = true;
        break;
      }
      const uint32_t pages = st.core.exec->kv().pages_for_tokens(m.seq.pos);
      const uint64_t sum =
          st.cfg.verify_kv_checksums ? std::max<uint64_t>(1, st.core.exec->kv().kv_layer_checksum(layer, l.pages, pages)) : 1;
      self->send(m.target, kv_layer_ready{l.request_id, m.grant.lease_id, layer, m.seq.pos, sum, st.cfg.name});
      if (++m.landed == m.xfers.size()) done.push_back(lease_id);
    }
    if (!broke && m.landed < m.xfers.size() && now - m.posted_at > limit) {
      failed.push_back(lease_id);
      why.push_back(std::to_string(m.xfers.size() - m.landed) + " of " + std::to_string(m.xfers.size()) +
                    " layers did not land within migrate_send_timeout_ms (" + std::to_string(st.cfg.migrate_send_timeout_ms) +
                    " ms)");
    }
  }
  for (size_t i = 0; i < failed.size(); ++i) abandon(self, failed[i], why[i]);
  for (auto id : done) commit(self, id);
  schedule_poll(self);
  if (!done.empty() || !failed.empty()) report_load(self);
}

bool release_migrating(decode_pointer self, uint64_t lease_id) {
  auto& st = self->state;
  auto m = st.migrations.find(lease_id);
  if (m == st.migrations.end()) return false;
  m->second.released = true;  // the puts still read its pages: freed when they settle
  if (m->second.xfers.empty() && !m->second.grant.lease_id) {
    // Still asking for a place or a lease: those answers find no migration and clean up.
    st.migrations.erase(m);
    answer_released(st, lease_id);
    free_lease(self, lease_id);
  }
  return true;
}

}  // namespace baton::decode_detail

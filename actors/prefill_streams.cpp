// KV that streams into a prefill rank while it computes (see prefill_rank_state.hpp): a cached
// prefix from the block store (seed 000 §2.3), and the earlier parts of a split prompt (seed 002).

#include <algorithm>
#include <map>

#include <caf/actor_system.hpp>
#include <caf/send.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/prefill_rank_state.hpp"

namespace baton::prefill_detail {

// This file's own, declared here because they call one another out of order.
void abort_attempt(prefill_pointer self, prefill_job_state& r);
void on_round_done(prefill_pointer self, uint64_t rid);
void block_failed(prefix_load& ld, size_t b, const std::string& why);
void load_round(prefill_pointer self, uint64_t rid);

/// Split: our part's layer `layer` into a later part's pages.
void put_to_peer(prefill_pointer self, prefill_job_state& r, size_t peer, uint32_t layer) {
  auto& st = self->state;
  const auto& pr = r.split.peers[peer];
  const auto& lay = st.core.exec->kv().layout();
  const auto& reg = pr.region;
  const gpu::kv_layout remote{reg.num_layers, reg.num_pages, reg.page_size_tokens, reg.kv_dim, reg.kv_planes};
  // The peer by its rank's name: errors name it, and a modelled link queues on its NIC.
  const auto& names = r.order.part_names;
  transport::put_desc d{r.order.request_id, layer,
                        pr.part < names.size() ? names[pr.part] : "part-" + std::to_string(pr.part),
                        st.core.pool_key->region_id,
                        transport::region_key{reg.backend, reg.region_id, reg.size_bytes, reg.packed_key}, {}};
  const uint32_t ps = lay.page_size_tokens;
  for (uint32_t pg = r.split.begin / ps; pg < (r.split.end + ps - 1) / ps && pg < pr.pages.size(); ++pg)
    d.segments.push_back({lay.offset_bytes(layer, r.local_pages[pg]), remote.offset_bytes(layer, pr.pages[pg]),
                          lay.page_bytes()});
  track_put(self, {r.order.request_id, layer, st.core.xport->post_put(d), 0, self->clock().now(), r.attempt,
                   static_cast<int32_t>(peer)});
}

/// Split, the last part: a layer is announced once our puts and every earlier part's have it.
void maybe_announce_split(prefill_pointer self, prefill_job_state& r, uint32_t layer) {
  if (r.split.last() && r.split.layer_done[layer] && r.split.seen[layer] == r.split.index)
    announce_layer(self, r, layer);
}

/// Split: our layer landed in a later part's pages (and, before that, in the decode rank's).
void on_peer_put_landed(prefill_pointer self, uint64_t request_id, int32_t peer, uint32_t layer) {
  auto& st = self->state;
  auto i = st.requests.find(request_id);
  if (i == st.requests.end()) return;
  if (i->second.failed) return finish_if_done(self, request_id);  // its answer may have waited for this put
  auto& r = i->second;
  // A put of an attempt since superseded (the request was placed here again: new peers).
  if (peer < 0 || static_cast<size_t>(peer) >= r.split.peers.size()) return;
  caf::anon_send(r.split.peers[peer].rank, split_layer{request_id, r.order.grant.lease_id, r.split.index, layer});
  ++r.split.peer_puts_landed;
  finish_if_done(self, request_id);
}

/// Streaming: a cached block failed, so the optimistic computation cannot stand. Its jobs are
/// told to stop (the gate) and their results become stale (the attempt number).
void abort_attempt(prefill_pointer self, prefill_job_state& r) {
  auto& ld = r.load;
  // A failed request restarts nothing (fail_request aborted its gate already).
  if (!ld.gate || ld.aborted || r.failed) return;
  ld.aborted = true;
  ld.gate->abort();
  ++r.attempt;
  r.cancelled->store(true);  // the old attempt's layers post nothing more
  r.cancelled = std::make_shared<std::atomic<bool>>(false);
  r.chunk_sizes.clear();
  r.num_chunks = r.chunks_submitted = r.chunks_done = 0;
  self->state.core.log->add({0, "prefix_abort", r.order.request_id, r.attempt, 0, {}, {}});
}

/// After an abort: recompute from `restart_from` once the old attempt's jobs have left the
/// executor (they fail at the gate quickly).
void maybe_restart(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto i = st.requests.find(rid);
  if (i == st.requests.end()) return;
  // Failed meanwhile (stopped, superseded): nothing restarts; its answer waited for these jobs.
  if (i->second.failed) return finish_if_done(self, rid);
  if (!i->second.restart_from || i->second.jobs_in_executor > 0) return;
  const uint32_t from = *i->second.restart_from;
  i->second.restart_from.reset();
  start_compute(self, rid, from);
}

/// Streaming: layer `ev.layer` of some blocks landed. Each is verified in our pages; when that
/// layer of every block is good, the gate lets the computation's layer through.
void on_layer_landed(prefill_pointer self, const store_layer_landed& ev) {
  auto& st = self->state;
  auto i = st.requests.find(ev.request_id);
  if (i == st.requests.end() || i->second.order.grant.lease_id != ev.tag) return;  // of an earlier attempt's read
  auto& r = i->second;
  auto& ld = r.load;
  if (!ld.gate || ld.aborted) return;
  auto& kv = st.core.exec->kv();
  const uint32_t ppb = r.order.block_tokens / kv.layout().page_size_tokens;
  for (size_t k = 0; k < ev.block_index.size() && k < ev.checksums.size(); ++k) {
    const uint32_t b = ev.block_index[k];
    if (b >= ld.verified.size() || ld.verified[b] != ev.layer) continue;  // out of order: the final answer decides
    std::vector<uint32_t> pages(r.local_pages.begin() + b * ppb, r.local_pages.begin() + (b + 1) * ppb);
    if (std::max<uint64_t>(1, kv.kv_layer_checksum(ev.layer, pages, ppb)) == std::max<uint64_t>(1, ev.checksums[k]))
      ++ld.verified[b];
    else
      return abort_attempt(self, r);  // the final answer marks the block failed
  }
  uint32_t open = kv.layout().num_layers;
  for (size_t b = r.shared_blocks; b < ld.verified.size(); ++b) open = std::min(open, ld.verified[b]);
  ld.gate->open_through(open);
}

/// The reads of a round are all answered: verify what landed, retry failed blocks on their next
/// replica, or start computing after the longest verified prefix.
void on_round_done(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  auto& ld = r.load;
  if (r.failed) return finish_if_done(self, rid);  // stopped meanwhile: its answer waited for the reads
  renew_lease(self, r.order);  // loading is progress: the lease lives on
  bool retry = false;
  for (size_t b = 0; b < ld.state.size(); ++b)
    if (ld.state[b] == prefix_load::retrying) {
      ld.state[b] = prefix_load::pending;
      retry = true;
    }
  if (retry) return load_round(self, rid);
  uint32_t good = 0;
  while (good < ld.state.size() && ld.state[good] == prefix_load::ok) ++good;
  r.recomputed_blocks = static_cast<uint32_t>(ld.state.size()) - good;
  st.core.log->add({0, "prefix_loaded", rid, good, 0, {}, {}});
  if (r.recomputed_blocks) st.core.log->add({0, "prefix_recompute", rid, r.recomputed_blocks, 0, {}, {}});
  if (!ld.gate) return start_compute(self, rid, good * r.order.block_tokens);
  if (r.recomputed_blocks == 0 && !ld.aborted) {
    ld.gate->open_through(st.core.exec->kv().layout().num_layers);  // every layer verified
    return;
  }
  abort_attempt(self, r);
  r.restart_from = good * r.order.block_tokens;
  maybe_restart(self, rid);
}

/// Marks block b failed on its current server: the next replica gets it next round, if any.
void block_failed(prefix_load& ld, size_t b, const std::string& why) {
  ld.errors[b] = why;
  ld.state[b] = ++ld.tried[b] < ld.blocks[b].servers.size() ? prefix_load::retrying : prefix_load::failed;
  if (b < ld.verified.size()) ld.verified[b] = 0;  // a replica streams it again from layer 0
}

/// Asks each block's current server for the pending blocks, one read order per server.
void load_round(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  auto& ld = r.load;
  std::map<uint32_t, store_read_order> orders;
  const auto& pool = st.core.exec->kv();
  for (size_t b = 0; b < ld.state.size(); ++b) {
    if (ld.state[b] != prefix_load::pending) continue;
    const uint32_t server = ld.blocks[b].servers[ld.tried[b]];
    if (server >= st.store.servers.size()) {
      block_failed(ld, b, "unknown block server " + std::to_string(server));
      continue;
    }
    auto& o = orders[server];
    if (o.blocks.empty()) {
      const auto& lay = pool.layout();
      o.request_id = rid;
      o.block_tokens = r.order.block_tokens;
      o.region = kv_region_desc{st.core.pool_key->backend, st.core.pool_key->region_id, st.core.pool_key->size_bytes,
                                st.core.pool_key->packed, lay.num_layers, lay.num_pages, lay.page_size_tokens,
                                lay.kv_dim, lay.planes};
      o.page_ids = r.local_pages;
      o.reader = st.cfg.name;
      o.budget_ms = std::max<uint32_t>(1, st.store.read_timeout_ms / 2);
      o.tag = r.order.grant.lease_id;
      if (r.load.gate) o.reader_actor = caf::actor_cast<caf::actor>(self);
    }
    o.blocks.push_back(ld.blocks[b]);
    o.block_index.push_back(static_cast<uint32_t>(b));
    ld.state[b] = prefix_load::in_flight;
  }
  if (orders.empty()) return on_round_done(self, rid);
  ld.outstanding = static_cast<uint32_t>(orders.size());
  schedule_keepalive(self);  // a slow read must not let the decode rank's lease expire
  // Replies are matched by request and lease: the request may have finished here and been placed
  // here again (a new lease) while a reply of this read was still on its way.
  const uint64_t lease = r.order.grant.lease_id;
  for (auto& [server, order] : orders) {
    const std::vector<uint32_t> asked = order.block_index;
    auto on_reply = [=](store_read_result& res) {
      auto& st = self->state;
      auto i = st.requests.find(rid);
      if (i == st.requests.end() || i->second.order.grant.lease_id != lease) return;
      auto& r = i->second;
      r.load.late_writer |= res.puts_abandoned;  // a put of it may still land: hold the pages
      auto& kv = st.core.exec->kv();
      const uint32_t ppb = r.order.block_tokens / kv.layout().page_size_tokens;
      for (size_t k = 0; k < res.block_index.size() && k < res.errors.size(); ++k) {
        const uint32_t b = res.block_index[k];
        // An answer from another process: a block this server was not asked for (or a short
        // checksum list) is malformed, never an index into our pages.
        if (std::find(asked.begin(), asked.end(), b) == asked.end()) continue;  // failed below if asked
        if (!res.errors[k].empty()) {
          block_failed(r.load, b, res.errors[k]);
          continue;
        }
        // End to end: the bytes now in our pages must match what the writer checksummed.
        std::vector<uint32_t> pages(r.local_pages.begin() + b * ppb, r.local_pages.begin() + (b + 1) * ppb);
        bool intact = k < res.checksums.size() && res.checksums[k].size() == kv.layout().num_layers;
        for (uint32_t l = 0; intact && l < kv.layout().num_layers; ++l)
          intact = std::max<uint64_t>(1, kv.kv_layer_checksum(l, pages, ppb)) == std::max<uint64_t>(1, res.checksums[k][l]);
        if (intact)
          r.load.state[b] = prefix_load::ok;
        else
          block_failed(r.load, b, "block failed its checksum after landing");
      }
      for (auto b : asked)  // blocks the server did not mention
        if (r.load.state[b] == prefix_load::in_flight) block_failed(r.load, b, "not in the server's answer");
      if (r.load.gate && std::any_of(r.load.state.begin(), r.load.state.end(), [](auto x) {
            return x == prefix_load::retrying || x == prefix_load::failed;
          }))
        abort_attempt(self, r);  // the optimistic computation read a block that is not good
      if (--r.load.outstanding == 0) on_round_done(self, rid);
    };
    auto on_error = [=](caf::error& err) {
      auto& st = self->state;
      auto i = st.requests.find(rid);
      if (i == st.requests.end() || i->second.order.grant.lease_id != lease) return;
      i->second.load.late_writer = true;  // no answer: the server may still be putting
      for (auto b : asked)
        if (i->second.load.state[b] == prefix_load::in_flight)
          block_failed(i->second.load, b, "block server " + std::to_string(server) + ": " + self->system().render(err));
      abort_attempt(self, i->second);
      if (--i->second.load.outstanding == 0) on_round_done(self, rid);
    };
    self->request(st.store.servers[server], std::chrono::milliseconds{st.store.read_timeout_ms}, std::move(order))
        .then(std::move(on_reply), std::move(on_error));
  }
}

/// Split: the backstop of prefill_rank_config::split_wait_ms, `wait_ms` after our part started.
/// By now every peer should have found us: each earlier part's first layer landed here, and each
/// later part said where its pages are.
void check_split_peers(prefill_pointer self, uint64_t rid, uint64_t lease_id, uint32_t wait_ms) {
  auto& st = self->state;
  auto i = st.requests.find(rid);
  if (i == st.requests.end() || i->second.order.grant.lease_id != lease_id || i->second.failed) return;
  const auto& sp = i->second.split;
  const auto& names = i->second.order.part_names;
  const auto part = [&](uint32_t j) {
    return "part " + std::to_string(j) + " (rank " + (j < names.size() ? names[j] : std::string{"?"}) + ")";
  };
  std::string missing;
  const auto add = [&](std::string what) { missing += (missing.empty() ? "" : "; ") + what; };
  for (uint32_t j = 0; j < sp.index; ++j)
    if (!sp.landed_from[j][0]) add(part(j) + " sent no KV");
  for (uint32_t j = sp.index + 1; j < sp.parts; ++j)
    if (std::none_of(sp.peers.begin(), sp.peers.end(), [&](const auto& p) { return p.part == j; }))
      add(part(j) + " never said where its pages are");
  if (missing.empty()) return;
  fail_request(self, rid, errc::deadline_exceeded, "split",
               "part " + std::to_string(sp.index) + " of " + std::to_string(sp.parts) + ": " + missing + " within " +
                   std::to_string(wait_ms) + " ms");
}

/// Split: starts our part. The earlier parts' ranks learn where our pages are, so they can put
/// their KV there; each of our layers waits for theirs.
void launch_split(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  const auto& o = r.order;
  const uint64_t lease_id = o.grant.lease_id;
  const uint32_t layers = st.core.exec->kv().layout().num_layers;
  auto& sp = r.split;
  sp.active = true;
  sp.index = o.part_index;
  sp.parts = static_cast<uint32_t>(o.part_ranks.size());
  sp.begin = o.part_bounds.at(sp.index);
  sp.end = o.part_bounds.at(sp.index + 1);
  sp.seen.assign(layers, 0);
  sp.landed_from.assign(sp.index, std::vector<bool>(layers, false));
  sp.layer_done.assign(layers, false);
  st.core.log->add({0, "split_part", rid, sp.index, 0, {}, {}});
  if (sp.index > 0) {
    r.load.gate = std::make_shared<gpu::streamed_layers_gate>();
    const auto& lay = st.core.exec->kv().layout();
    const auto& key = *st.core.pool_key;
    kv_region_desc region{key.backend, key.region_id, key.size_bytes, key.packed, lay.num_layers, lay.num_pages,
                          lay.page_size_tokens, lay.kv_dim, lay.planes};
    for (uint32_t j = 0; j < sp.index; ++j)
      caf::anon_send(o.part_ranks[j],
                     split_peer{rid, lease_id, sp.index, region, r.local_pages, caf::actor_cast<caf::actor>(self)});
  }
  if (auto e = st.early_peers.find(rid); e != st.early_peers.end()) {
    auto peers = std::move(e->second.peers);
    st.early_peers.erase(e);
    for (auto& p : peers)
      if (p.lease_id == lease_id) on_split_peer(self, std::move(p));  // else: of an attempt given up
  }
  const uint32_t wait_ms = st.cfg.split_wait_ms;
  st.core.runner->run_after(std::chrono::milliseconds{wait_ms},
                            [self, rid, lease_id, wait_ms] { check_split_peers(self, rid, lease_id, wait_ms); });
  if (sp.index > 0 && sp.seen[0] < sp.index) {
    sp.compute_deferred = true;  // on_split_layer starts it (see split_state)
    return;
  }
  start_compute(self, rid, sp.begin);
}

/// Split: a later part's pages are known: every layer we have finished goes there now, the rest
/// as they finish.
void on_split_peer(prefill_pointer self, split_peer peer) {
  auto& st = self->state;
  auto i = st.requests.find(peer.request_id);
  if (i == st.requests.end() || !i->second.split.active || i->second.order.grant.lease_id != peer.lease_id) {
    // Our order has not started yet (or only an older attempt's has): kept until it does, for a
    // while. The order may never come -- its request gave up first -- so old entries go.
    const auto now = self->clock().now();
    const auto limit = std::chrono::milliseconds{st.cfg.split_wait_ms};
    for (auto e = st.early_peers.begin(); e != st.early_peers.end();)
      e = now - e->second.first_at > limit ? st.early_peers.erase(e) : std::next(e);
    auto [e, fresh] = st.early_peers.try_emplace(peer.request_id);
    if (fresh) e->second.first_at = now;
    if (e->second.peers.size() < 64) e->second.peers.push_back(std::move(peer));
    return;
  }
  auto& r = i->second;
  // A part that already failed (cancelled, or told another part failed) sends nothing more: its
  // puts would land in the pages of a part that is failing too, and hold its own answer back.
  if (r.failed) return;
  const auto& sp = r.split;
  // One entry per later part: a repeated notice would send that part every layer twice.
  if (peer.part_index <= sp.index || peer.part_index >= sp.parts ||
      std::any_of(sp.peers.begin(), sp.peers.end(), [&](const auto& p) { return p.part == peer.part_index; }))
    return;
  r.split.peers.push_back({peer.part_index, std::move(peer.region), std::move(peer.page_ids), std::move(peer.rank)});
  const size_t p = r.split.peers.size() - 1;
  for (uint32_t l = 0; l < r.split.layer_done.size(); ++l)
    if (r.split.layer_done[l]) put_to_peer(self, r, p, l);
  finish_if_done(self, r.order.request_id);
}

/// Split: an earlier part's layer landed in our pages; the layer gate follows the slowest part.
void on_split_layer(prefill_pointer self, const split_layer& ev) {
  auto& st = self->state;
  auto i = st.requests.find(ev.request_id);
  if (i == st.requests.end() || !i->second.split.active || i->second.failed ||
      i->second.order.grant.lease_id != ev.lease_id || ev.from_part >= i->second.split.index ||
      ev.layer >= i->second.split.seen.size())
    return;
  auto& r = i->second;
  auto landed = r.split.landed_from[ev.from_part][ev.layer];
  if (landed) return;  // counted already
  landed = true;
  ++r.split.seen[ev.layer];
  if (r.split.compute_deferred && r.split.seen[0] == r.split.index) {
    r.split.compute_deferred = false;
    start_compute(self, ev.request_id, r.split.begin);
  }
  uint32_t open = 0;
  while (open < r.split.seen.size() && r.split.seen[open] == r.split.index) ++open;
  if (r.load.gate) r.load.gate->open_through(open);
  maybe_announce_split(self, r, ev.layer);
  finish_if_done(self, ev.request_id);
}

/// Split: another part of the prompt failed; ours cannot finish without it.
void on_split_abort(prefill_pointer self, const split_abort& ev) {
  auto& st = self->state;
  // Our part is over and its pages held (return_pages): a put given up into them pushes the
  // hold out to the quarantine.
  if (auto h = st.split_holds.find(ev.lease_id); ev.abandoned && h != st.split_holds.end() && h->second.request_id == ev.request_id)
    h->second.until = std::max(h->second.until, self->clock().now() + std::chrono::milliseconds{st.cfg.late_put_quarantine_ms});
  auto i = st.requests.find(ev.request_id);
  if (i == st.requests.end() || !i->second.split.active || i->second.order.grant.lease_id != ev.lease_id) return;
  if (ev.abandoned) i->second.split.peer_abandoned = true;  // even when failed already: its pages wait longer
  const bool known = ev.code >= static_cast<uint8_t>(errc::bad_request) && ev.code <= static_cast<uint8_t>(errc::router_unavailable);
  fail_request(self, ev.request_id, known ? static_cast<errc>(ev.code) : errc::rank_unavailable, "split",
               "part " + std::to_string(ev.from_part) + " failed: " + ev.why);
}

/// Starts loading a prompt's cached prefix from the block store (blocks the rank-local tier
/// did not have): the reads go out at once; with overlap on, so does the computation, each layer
/// waiting for that layer of every block.
void start_prefix_load(prefill_pointer self, uint64_t rid, uint32_t shared_blocks) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  const auto& o = r.order;
  const auto& local = st.core.exec->kv().layout();
  auto& ld = r.load;
  ld.blocks = o.prefix;
  ld.state.assign(o.prefix.size(), prefix_load::pending);
  for (uint32_t b = 0; b < shared_blocks; ++b) ld.state[b] = prefix_load::ok;  // already in our pages
  ld.tried.assign(o.prefix.size(), 0);
  ld.errors.assign(o.prefix.size(), {});
  for (size_t b = shared_blocks; b < ld.blocks.size(); ++b)
    if (ld.blocks[b].servers.empty()) block_failed(ld, b, "no server holds the block");
  st.core.log->add({0, "prefix_load_start", rid, static_cast<uint32_t>(ld.blocks.size() - shared_blocks), 0, {}, {}});
  ld.verified.assign(o.prefix.size(), local.num_layers);  // shared blocks: all layers in place
  for (size_t b = shared_blocks; b < ld.blocks.size(); ++b) ld.verified[b] = 0;
  const bool streaming = st.cfg.overlap_prefix_load &&
                         std::none_of(ld.state.begin(), ld.state.end(), [](auto x) { return x == prefix_load::failed || x == prefix_load::retrying; });
  if (streaming) {
    // Seed 000 §2.3: compute while the prefix streams in, each layer gated on its arrival.
    ld.gate = std::make_shared<gpu::streamed_layers_gate>();
    start_compute(self, rid, static_cast<uint32_t>(ld.blocks.size()) * o.block_tokens);
  }
  load_round(self, rid);
}

}  // namespace baton::prefill_detail

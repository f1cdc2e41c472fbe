// The decode rank's side of the KV handoff: reservations (leases granted now, after offloads
// make room, or refused), the layer-ready signals that admit a sequence once every layer landed
// and passed its checksum, and the expansion of layers that came in a wire form (INT8, INT4).
// Checks and expansions run on the rank's worker thread (serial_worker), not the actor's: a
// layer's checksum is a pass over its bytes, and the rank's step scheduling must not wait on it.

#include "actors/decode_rank_state.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <caf/actor_cast.hpp>
#include <caf/send.hpp>

#include "transport/kv_wire.hpp"

namespace baton::decode_detail {

/// Corrupt KV never reaches a decode step: the lease is dropped, the request told why (now, or
/// when its order comes).
void drop_corrupt_lease(decode_pointer self, uint64_t lease_id, std::string why) {
  auto& s = self->state;
  auto& l = s.leases.at(lease_id);
  if (l.has_order) l.promise.deliver(make_error(errc::transfer_failed, why));
  answer_commits(l, why);
  if (s.corrupted.size() >= 1024) s.corrupted.erase(s.corrupted.begin());  // bounded: orders may never come
  s.corrupted[lease_id] = std::move(why);
  free_lease(self, lease_id, true);  // the later layers' puts may still come
}

/// Checks a landed layer against the sender's checksum: its f32 pages, or in a wire form its
/// staged wire bytes, which are then expanded into the pages. Runs on the rank's worker: reads
/// and writes only the lease's pages and staging slots, which nothing else touches until the
/// lease is admitted (and a freed lease's pages wait for it: give_back_pages). Empty, or why the
/// layer cannot be used.
std::string check_layer(gpu::kv_cache& kv, const kv_wire_staging* staging, transport::wire_format wire, bool verify,
                        uint32_t layer, const std::vector<uint32_t>& pages, uint64_t sent) {
  const auto n = static_cast<uint32_t>(pages.size());
  if (wire == transport::wire_format::f32) {
    const uint64_t got = std::max<uint64_t>(1, kv.kv_layer_checksum(layer, pages, n));
    return got == sent ? std::string{}
                       : "failed its checksum (sent " + std::to_string(sent) + ", landed " + std::to_string(got) + ")";
  }
  if (verify) {
    const uint64_t got = std::max<uint64_t>(1, staging->checksum(wire, layer, pages, n));
    if (got != sent)
      return "failed its checksum in " + std::string(transport::to_string(wire)) + " form (sent " +
             std::to_string(sent) + ", landed " + std::to_string(got) + ")";
  }
  for (uint32_t page : pages)
    transport::wire_decode(wire, reinterpret_cast<const uint8_t*>(staging->slot(layer, page)), staging->page_values,
                           kv.k_at(layer, page, 0));
  return {};
}

/// The layer is in: counted once, the lease renewed, and the sequence admitted if all is here.
void mark_landed(decode_pointer self, lease& l, uint64_t lease_id, uint32_t layer) {
  auto& s = self->state;
  if (!l.landed[layer]) {
    l.landed[layer] = true;
    if (++l.num_landed == l.landed.size()) {
      s.core.log->add({0, "kv_landed", l.request_id, 0, 0, {}, {}});
      answer_commits(l, {});
    }
  }
  l.expires_at = self->clock().now() + std::chrono::milliseconds{l.lease_ms};  // progress renews
  maybe_admit(self, lease_id);
}

void answer_commits(lease& l, const std::string& why) {
  for (auto& p : l.commits) {
    if (!p.pending()) continue;
    if (why.empty())
      p.deliver(true);
    else
      p.deliver(make_error(errc::transfer_failed, why));
  }
  l.commits.clear();
}

caf::result<bool> on_commit(decode_pointer self, uint64_t lease_id, uint64_t request_id) {
  auto& s = self->state;
  const auto stage = where(request_id, s.cfg.name, "kv_commit") + ": lease " + std::to_string(lease_id) + " ";
  auto i = s.leases.find(lease_id);
  if (i == s.leases.end() || i->second.request_id != request_id) {
    if (auto c = s.corrupted.find(lease_id); c != s.corrupted.end()) return make_error(errc::transfer_failed, c->second);
    return make_error(errc::lease_expired, stage + "is gone (expired or released before its layers were checked)");
  }
  auto& l = i->second;
  if (l.num_landed == l.landed.size()) return true;
  // Layers still being checked on the worker (or their signals still on the way): answered by
  // mark_landed or drop_corrupt_lease, or by free_lease when the lease ends first.
  auto p = self->make_response_promise<bool>();
  l.commits.push_back(p);
  return p;
}

kv_lease_grant grant_lease(decode_pointer self, const kv_lease_reserve& req, std::vector<uint32_t> pages,
                           const caf::actor_addr& holder) {
  auto& s = self->state;
  const uint64_t id = ++s.last_lease;
  auto& l = s.leases[id];
  l.request_id = req.request_id;
  l.holder = holder;
  // A holder already gone is told at once (a reservation that waited for pages outlived it).
  watch(self, holder);
  l.pages = std::move(pages);
  l.landed.assign(s.core.exec->config().num_hidden_layers, false);
  l.checking.assign(l.landed.size(), 0);
  l.lease_ms = req.lease_ms;
  l.wire_form = req.inexact_kv;
  l.expires_at = self->clock().now() + std::chrono::milliseconds{req.lease_ms};
  self->delayed_send(self, std::chrono::milliseconds{req.lease_ms}, expire_atom::value, id);
  s.settled.push_back(req.request_id);
  report_load(self);
  kv_lease_grant grant{req.request_id, id, s.cfg.name, s.region, l.pages, req.lease_ms, {}};
  // The form on the wire the request asked for, with this rank's staging for it; f32 (said once)
  // where the rank has none.
  if (auto f = transport::wire_format_of(req.wire); f && *f != transport::wire_format::f32) {
    std::string why;
    if (const auto* w = s.core.wire_staging(&why)) {
      grant.wire = kv_wire_region{req.wire, w->key.backend, w->key.region_id, w->key.size_bytes, w->key.packed,
                                  w->slot_bytes};
    } else if (!s.wire_refusal_said) {
      s.wire_refusal_said = true;
      std::fprintf(stderr, "baton: decode rank %s: request %llu asked for KV in %s on the wire; it comes as f32 (%s)\n",
                   s.cfg.name.c_str(), static_cast<unsigned long long>(req.request_id), transport::to_string(*f),
                   why.c_str());
    }
  }
  return grant;
}

/// Pages a reservation takes now: the whole sequence, or on demand the prompt plus headroom.
uint32_t pages_to_reserve(const decode_state& st, const kv_lease_reserve& req) {
  uint32_t tokens = req.num_tokens;
  if (on_demand(st) && req.prompt_tokens > 0)
    tokens = std::min(tokens, req.prompt_tokens + st.cfg.on_demand_headroom_tokens);
  return st.core.exec->kv().pages_for_tokens(tokens);
}

caf::result<kv_lease_grant> on_reserve(decode_pointer self, const kv_lease_reserve& req) {
  auto& s = self->state;
  const auto stage = where(req.request_id, s.cfg.name, "kv_reserve");
  // A refusal settles the balancer's charge for it with the next report (as a grant does).
  auto refuse = [&](errc code, const std::string& why) {
    s.settled.push_back(req.request_id);
    return make_error(code, stage + ": " + why);
  };
  // A failed setup, or an executor that can run nothing (a broken data-parallel group): the
  // request is placed again elsewhere, and the balancer hears that this rank has no room.
  if (auto failure = s.core.unavailable(); !failure.empty()) {
    auto e = refuse(errc::rank_unavailable, failure);
    report_load(self);
    return e;
  }
  // On standby the executor's pool belongs to this instance's other role: a placement made
  // before the switch must go elsewhere.
  if (s.cfg.standby) return refuse(errc::rank_unavailable, "on standby (serving as prefill)");
  auto& pool = s.core.exec->kv();
  const uint32_t need = pages_to_reserve(s, req);
  if (s.reserves.empty() && s.paused.empty() && pool.num_free_pages() >= need + watermark_pages(s))
    if (auto pages = pool.kv_page_alloc(need))
      return grant_lease(self, req, std::move(*pages), caf::actor_cast<caf::actor_addr>(self->current_sender()));
  // Short of pages: with host memory for offloads, running sequences make room (between
  // steps); on demand, the reservation waits its turn for pages that finishing sequences
  // free; otherwise refuse now and let the request re-place itself.
  const bool can_wait = on_demand(s) ? need + watermark_pages(s) <= pool.layout().num_pages
                                     : s.cfg.host_offload_pages > 0 && !s.batch.empty();
  if (can_wait && need <= pool.layout().num_pages) {
    // Who asked, read before the promise is made: making it takes the sender out of the message
    // (CAF 0.17), and a waiting reservation's holder was null -- never watched, never matched.
    const auto holder = caf::actor_cast<caf::actor_addr>(self->current_sender());
    auto promise = self->make_response_promise<kv_lease_grant>();
    const uint64_t id = ++s.last_reserve;
    s.reserves.push_back({req, holder, promise, id});
    self->delayed_send(self, std::chrono::milliseconds{s.cfg.reserve_wait_ms}, reserve_expire_atom::value, id);
    rebalance_memory(self);
    return promise;
  }
  // Pages may be free and still not this request's: newcomers wait behind reservations queued
  // and sequences offloaded to host memory (they come back first), and the watermark stays free.
  std::string behind;
  if (!s.reserves.empty()) behind += ", " + std::to_string(s.reserves.size()) + " reservations queued ahead";
  if (!s.paused.empty()) behind += ", " + std::to_string(s.paused.size()) + " offloaded sequences to resume first";
  if (behind.empty() && pool.num_free_pages() >= need)
    behind = ", " + std::to_string(watermark_pages(s)) + " of them kept free (the watermark)";
  auto e = refuse(errc::kv_capacity, "needs " + std::to_string(need) + " KV pages for " +
                                         std::to_string(req.num_tokens) + " tokens, " +
                                         std::to_string(pool.num_free_pages()) + " free" + behind);
  report_load(self);
  return e;
}

void on_reserve_cancelled(decode_pointer self, uint64_t request_id) {
  auto& s = self->state;
  const auto holder = caf::actor_cast<caf::actor_addr>(self->current_sender());
  auto r = std::find_if(s.reserves.begin(), s.reserves.end(),
                        [&](const pending_reserve& x) { return x.req.request_id == request_id && x.holder == holder; });
  if (r != s.reserves.end()) {
    s.settled.push_back(request_id);
    s.core.log->add({0, "reserve_cancelled", request_id, 0, 0, {}, {}});
    r->promise.deliver(make_error(errc::cancelled, where(request_id, s.cfg.name, "kv_reserve") +
                                                       ": the request gave its reservation up while it waited"));
    s.reserves.erase(r);
    rebalance_memory(self);  // the next one in line may fit now
    return report_load(self);
  }
  // Granted, but the grant reached a request that had stopped listening (CAF drops a response
  // that comes after its request's timeout): the request ordered nothing into it and will never
  // release it. Its own releases came before this (one sender, in order), so a lease of it that
  // is still here, untouched, is that one: freed now, not after lease_ms and a quarantine.
  std::vector<uint64_t> unread;
  for (const auto& [id, l] : s.leases)
    if (l.request_id == request_id && l.holder == holder && !l.decoding && !l.has_order && !l.local_writer &&
        !l.release_after_step && l.num_landed == 0 && l.writers.num_done == 0)
      unread.push_back(id);
  for (auto id : unread) {
    s.core.log->add({0, "lease_unread", request_id, static_cast<uint32_t>(s.leases.at(id).pages.size()), 0, {}, {}});
    free_lease(self, id, false);
  }
}

void on_layer_ready(decode_pointer self, const kv_layer_ready& ev) {
  auto& s = self->state;
  auto i = s.leases.find(ev.lease_id);
  if (i == s.leases.end() || i->second.request_id != ev.request_id || ev.layer >= i->second.landed.size())
    return;  // a late layer of a lease that already expired: nothing to do
  auto& l = i->second;
  if (l.decoding) return;  // a repeated layer after admission: its pages hold decode KV now
  auto prefix = [&] {
    return where(ev.request_id, s.cfg.name, "kv_recv") + ": layer " + std::to_string(ev.layer) +
           (ev.from.empty() ? "" : " from " + ev.from) + " ";
  };
  const auto wire = transport::wire_format_of(ev.wire);
  if (wire != transport::wire_format::f32) {
    // In wire form: checked and expanded once. A repeated signal (its slots may be taking a
    // retried attempt's identical bytes) leaves the expanded pages alone.
    if (l.landed[ev.layer] || l.checking[ev.layer] > 0) return;
    if (!wire || !s.core.wire)
      return drop_corrupt_lease(self, ev.lease_id,
                                prefix() + (!wire ? "names wire form " + std::to_string(ev.wire) + ", which does not exist"
                                                  : "came in " + std::string(transport::to_string(*wire)) +
                                                        " form, but this rank granted no staging"));
    l.wire_form = true;  // its pages will hold expanded values (a failed layer drops the lease)
  } else if (!s.cfg.verify_kv_checksums) {
    return mark_landed(self, l, ev.lease_id, ev.layer);
  } else if (l.checking[ev.layer] == UINT8_MAX) {
    return;  // that many checks of it already queued: the last of them decides
  }
  // Checked (and expanded) on the worker; a repeated f32 signal is checked again, as a retried
  // attempt's puts land in the same pages.
  auto& kv = s.core.exec->kv();
  const uint32_t n = std::min<uint32_t>(kv.pages_for_tokens(ev.num_tokens), l.pages.size());
  ++l.checking[ev.layer];
  ++s.checks_in_flight[ev.lease_id];
  l.expires_at = self->clock().now() + std::chrono::milliseconds{l.lease_ms};  // a put landed: progress
  auto check = [exec = s.core.exec, staging = s.core.wire, form = *wire, verify = s.cfg.verify_kv_checksums,
                layer = ev.layer, pages = std::vector<uint32_t>(l.pages.begin(), l.pages.begin() + n),
                sent = ev.checksum, prefix = prefix()] {
    auto why = check_layer(exec->kv(), staging.get(), form, verify, layer, pages, sent);
    return why.empty() ? why : prefix + why;
  };
  if (s.core.exec->on_virtual_time())  // sims: no thread of ours runs in virtual time
    return on_layer_checked(self, ev.lease_id, ev.layer, check());
  if (!s.checker) s.checker = std::make_unique<serial_worker>();
  s.checker->post([check = std::move(check), me = caf::actor_cast<caf::actor_addr>(self), lease_id = ev.lease_id,
                   layer = ev.layer, delay = std::chrono::milliseconds{s.cfg.fault_check_delay_ms}] {
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    auto why = check();
    if (auto rank = caf::actor_cast<decode_rank_actor>(me))
      caf::anon_send(rank, layer_checked_atom::value, lease_id, layer, std::move(why));
  });
}

void on_layer_checked(decode_pointer self, uint64_t lease_id, uint32_t layer, std::string why) {
  auto& s = self->state;
  if (auto c = s.checks_in_flight.find(lease_id); c != s.checks_in_flight.end() && --c->second == 0) {
    s.checks_in_flight.erase(c);
    // Freed while checked: its pages go back now that nothing writes them.
    if (auto h = s.held_pages.find(lease_id); h != s.held_pages.end()) {
      s.core.exec->kv().kv_page_free(h->second);
      s.held_pages.erase(h);
      if (!s.reserves.empty() || !s.paused.empty()) rebalance_memory(self);
      report_load(self);
    }
  }
  auto i = s.leases.find(lease_id);
  if (i == s.leases.end()) return;  // dropped meanwhile (expired, released, or another layer failed)
  auto& l = i->second;
  if (layer < l.checking.size() && l.checking[layer] > 0) --l.checking[layer];
  if (l.decoding) return;
  if (!why.empty()) return drop_corrupt_lease(self, lease_id, std::move(why));
  mark_landed(self, l, lease_id, layer);
}

}  // namespace baton::decode_detail

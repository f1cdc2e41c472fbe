// The prefill rank's puts to the decode rank (and a split's peers): each layer's put tracked
// until it lands or fails, the layer announced once every put of it landed, and the KV's form on
// the wire chosen per prompt. The puts themselves are posted from the executor thread
// (submit_chunk in prefill_rank.cpp); this is the actor's side of them.

#include "actors/prefill_rank_state.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>

namespace baton::prefill_detail {

/// Tells the decode rank that layer `layer` of the whole prompt is in its pages.
void announce_layer(prefill_pointer self, prefill_job_state& r, uint32_t layer) {
  if (r.announced[layer]) return;
  // A layer announced by an aborted attempt stays announced: its bytes were computed from a
  // verified prefix layer, and the restart rewrites them identically.
  r.announced[layer] = true;
  ++r.layers_ready;
  self->state.core.log->add({0, "layer_ready", r.order.request_id, 0, layer, {}, {}});
  self->send(r.order.decode, kv_layer_ready{r.order.request_id, r.order.grant.lease_id, layer,
                                            static_cast<uint32_t>(r.order.tokens.size()), r.checksums[layer],
                                            self->state.cfg.name,
                                            static_cast<uint8_t>(r.wire.value_or(transport::wire_format::f32))});
}

void on_put_landed(prefill_pointer self, uint64_t request_id, uint32_t layer, uint64_t checksum, uint32_t attempt) {
  auto& st = self->state;
  auto i = st.requests.find(request_id);
  if (i == st.requests.end() || i->second.attempt != attempt) return;  // stale attempt
  if (i->second.failed) return finish_if_done(self, request_id);  // its answer may have waited for this put
  auto& r = i->second;
  if (checksum != 0) r.checksums[layer] = checksum;
  // Chunks before the last make progress the decode rank cannot see (a layer completes only with
  // the last chunk): each of their landed layers renews the lease.
  if (r.puts_done[layer] + 1 < r.num_chunks)
    renew_lease(self, r.order);
  if (++r.puts_done[layer] == r.num_chunks) {
    if (!r.split.active) {
      announce_layer(self, r, layer);
    } else {
      r.split.layer_done[layer] = true;
      for (size_t p = 0; p < r.split.peers.size(); ++p) put_to_peer(self, r, p, layer);
      maybe_announce_split(self, r, layer);
    }
  }
  finish_if_done(self, request_id);
}

/// " (to decode rank R)", or " (to part P's prefill rank R)" for a split's peer put: errors
/// name the peer.
std::string to_rank(const prefill_state& st, const pending_put& p) {
  auto i = st.requests.find(p.request_id);
  if (i == st.requests.end()) return {};
  const auto& r = i->second;
  if (p.peer < 0 || static_cast<size_t>(p.peer) >= r.split.peers.size())
    return " (to decode rank " + r.order.grant.rank + ")";
  const uint32_t part = r.split.peers[p.peer].part;
  return " (to part " + std::to_string(part) + "'s prefill rank " +
         (part < r.order.part_names.size() ? r.order.part_names[part] : std::string{"?"}) + ")";
}

/// Polls one transfer; returns true when it is finished (landed or failed).
bool settle(prefill_pointer self, const pending_put& p) {
  auto& st = self->state;
  transport::xfer_error err;
  const auto waited = self->clock().now() - p.posted_at;
  const bool overdue = waited >= std::chrono::milliseconds{st.cfg.kv_send_timeout_ms};
  if (auto i = st.requests.find(p.request_id); i != st.requests.end() && i->second.attempt != p.attempt) {
    // An aborted attempt's put: its outcome no longer matters, but the answer waits for it (its
    // bytes may still land) -- up to the send timeout, as any put; then it may land later.
    if (st.core.xport->poll(p.xfer_id, &err) == transport::xfer_state::pending && !overdue) return false;
    st.core.xport->release(p.xfer_id);
    if (overdue) i->second.abandoned_put = true;
    finish_if_done(self, p.request_id);
    return true;
  }
  switch (st.core.xport->poll(p.xfer_id, &err)) {
    case transport::xfer_state::pending: {
      if (!overdue) return false;
      st.core.xport->release(p.xfer_id);
      if (auto i = st.requests.find(p.request_id); i != st.requests.end()) {
        auto& r = i->second;
        r.abandoned_put = true;
        // Bound for a later part's pages, after this prompt had failed (its split_abort went
        // out without this): that part holds them longer, as the put may still land.
        if (r.failed && p.peer >= 0 && static_cast<size_t>(p.peer) < r.split.peers.size()) {
          const uint32_t part = r.split.peers[p.peer].part;
          if (part < r.order.part_ranks.size())
            caf::anon_send(r.order.part_ranks[part],
                           split_abort{p.request_id, r.order.grant.lease_id, r.split.index,
                                       static_cast<uint8_t>(errc::transfer_failed),
                                       where(p.request_id, st.cfg.name, "kv_send") + ": a put given up may still land", true});
        }
      }
      fail_request(self, p.request_id, errc::transfer_failed, "kv_send",
                   "put of layer " + std::to_string(p.layer) + " still pending after " +
                       std::to_string(st.cfg.kv_send_timeout_ms) + " ms" + to_rank(st, p));
      return true;
    }
    case transport::xfer_state::done:
      st.core.xport->release(p.xfer_id);
      st.core.log->add({0, "send_done", p.request_id, p.attempt, p.layer, {}, {}});
      if (p.peer >= 0)
        on_peer_put_landed(self, p.request_id, p.peer, p.layer);
      else
        on_put_landed(self, p.request_id, p.layer, p.checksum, p.attempt);
      return true;
    case transport::xfer_state::failed:
      st.core.xport->release(p.xfer_id);
      // A put outside its region means the two ranks' layouts disagree: another attempt (a new
      // lease, perhaps on the same kind of rank) fails the same way. Every other failure is
      // retried on a new lease: even a fatal one (a stale key) does not follow it there.
      fail_request(self, p.request_id, err.code == transport::xfer_errc::out_of_bounds ? errc::layout_mismatch : errc::transfer_failed,
                   "kv_send", err.to_string());
      return true;
  }
  return true;
}

/// Polls every tracked put once; settling one may track new ones (a split's peer puts), which
/// wait for the next poll.
void poll_pending(prefill_pointer self) {
  auto& st = self->state;
  auto pending = std::move(st.pending);
  st.pending.clear();
  st.polling = true;
  for (const auto& p : pending)
    if (!settle(self, p)) st.pending.push_back(p);
  st.polling = false;
  for (auto id : std::exchange(st.answer_after_poll, {})) finish_if_done(self, id);
}

/// Polls `p` from now on (never settles it on the spot: callers may be iterating state it changes).
void track_put(prefill_pointer self, pending_put p) {
  auto& st = self->state;
  st.pending.push_back(p);
  if (!st.poll_scheduled) {
    st.poll_scheduled = true;
    self->delayed_send(self, std::chrono::microseconds{st.cfg.poll_interval_us}, poll_atom::value);
  }
}

/// The KV's form on the wire for a prompt: what its grant asks for, if the grant has staging for
/// it, the prompt is not split (parts hand each other f32) and this rank can stage it; else f32.
transport::wire_format choose_wire(prefill_pointer self, const prefill_job_state& r) {
  auto& st = self->state;
  const auto& g = r.order.grant.wire;
  const auto asked = transport::wire_format_of(g.format).value_or(transport::wire_format::f32);
  if (asked == transport::wire_format::f32 || r.order.prefill_only || r.split.active || g.slot_bytes == 0)
    return transport::wire_format::f32;
  std::string why;
  const auto* staging = st.core.wire_staging(&why);
  // The decode rank's slots must hold this rank's pages' wire form: the same page shape.
  if (staging && transport::wire_bytes(asked, staging->page_values) <= g.slot_bytes) return asked;
  if (staging) why = "the decode rank's wire slots of " + std::to_string(g.slot_bytes) + " bytes are smaller than a page";
  if (!st.wire_refusal_said) {
    st.wire_refusal_said = true;
    std::fprintf(stderr, "baton: prefill rank %s: request %llu asked for KV in %s on the wire; sent as f32 (%s)\n",
                 st.cfg.name.c_str(), static_cast<unsigned long long>(r.order.request_id), transport::to_string(asked),
                 why.c_str());
  }
  return transport::wire_format::f32;
}

}  // namespace baton::prefill_detail

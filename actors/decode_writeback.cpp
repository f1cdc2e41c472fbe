// Write-back: a finished sequence's full blocks go from this decode rank to the block servers
// the ring assigns them, through the transport, without any step waiting for it.

#include <caf/typed_event_based_actor.hpp>

#include <algorithm>
#include <cstring>

#include "actors/decode_rank_state.hpp"
#include "store/block_key.hpp"

namespace baton::decode_detail {

namespace {

/// One server finished (`written`) or gave up on a write-back job; the staging range is freed
/// after the last. A block counts as written back once some server confirmed its file, and as
/// dropped when none did, however each one failed (a server that died before this rank heard
/// of it fails its write_begin, not the ring lookup): the two never count the same block.
void write_done_one(decode_pointer self, uint64_t job, bool written) {
  auto& st = self->state;
  auto j = st.writes.find(job);
  if (j == st.writes.end()) return;
  if (written) ++j->second.servers_written;
  if (--j->second.servers_left > 0) return;
  const bool dropped = j->second.servers_written == 0;
  ++(dropped ? st.write_backs_dropped : st.blocks_written_back);
  st.write_slots.release(j->second.offset);
  st.writes.erase(j);
  // /metrics counts both from the load reports, and an idle rank sends no other: one report when
  // a block is dropped or the last write-back settles (not one per block written).
  if (dropped || st.writes.empty()) report_load(self);
}

void schedule_write_poll(decode_pointer self) {
  auto& st = self->state;
  if (st.write_poll_scheduled || st.write_puts.empty()) return;
  st.write_poll_scheduled = true;
  self->delayed_send(self, std::chrono::microseconds{200}, poll_atom::value);
}

}  // namespace

void poll_writes(decode_pointer self) {
  auto& st = self->state;
  st.write_poll_scheduled = false;
  std::vector<write_put> still;
  const auto now = self->clock().now();
  for (const auto& p : st.write_puts) {
    transport::xfer_error err;
    auto state = st.core.xport->poll(p.xfer, &err);
    // A put to a server that died may never settle (UCX over shared memory does not fail it):
    // given up, as the server gives up the slot (its write_slot_ttl_ms), so the staging and the
    // job do not stay for good and keep this rank from ever being idle.
    if (state == transport::xfer_state::pending && now - p.posted_at > std::chrono::milliseconds{store_put_limit_ms})
      state = transport::xfer_state::failed;
    if (state == transport::xfer_state::pending) {
      still.push_back(p);
      continue;
    }
    st.core.xport->release(p.xfer);
    auto j = st.writes.find(p.job);
    if (j == st.writes.end()) continue;
    if (state == transport::xfer_state::failed) {
      // Nothing comes for the slot now: the server takes it back at once, not after its ttl.
      self->send(p.server_actor, release_atom::value, p.slot_id);
      write_done_one(self, p.job, false);
      continue;
    }
    auto order = j->second.order;
    order.slot_id = p.slot_id;
    const uint64_t job = p.job;
    // Bounded: a server that never answers must not hold the job (and this rank's idleness).
    // It answers the bytes it wrote, 0 when it wrote none (the slot's bytes were not what this
    // rank checksummed, its disk failed): that server did not store the block.
    self->request(p.server_actor, std::chrono::milliseconds{store_write_order_timeout_ms}, std::move(order))
        .then([=](uint64_t written) { write_done_one(self, job, written > 0); },
              [=](caf::error&) { write_done_one(self, job, false); });
  }
  st.write_puts = std::move(still);
  schedule_write_poll(self);
}

/// Writes the sequence's full blocks that did not come from the store, each to the servers the
/// ring assigns it: the pages are copied into this rank's registered write staging now (they are
/// freed right after), then per server: a slot there (write_begin), a one-sided put into it
/// through the transport, and the order to write the file. No step waits for any of it; a full
/// staging drops the block (counted).
void write_back(decode_pointer self, const lease& l) {
  auto& st = self->state;
  const auto& o = l.order;
  const uint32_t b = st.store.block_tokens();
  std::vector<int32_t> seq = o.prompt_tokens;
  seq.insert(seq.end(), l.fed.begin(), l.fed.end());
  const auto keys = store::chain_keys(store::salt_of(st.store.identity), seq, b);
  auto& kv = st.core.exec->kv();
  const auto& lay = kv.layout();
  const uint32_t ppb = b / lay.page_size_tokens;
  const uint64_t block_bytes = uint64_t{ppb} * lay.page_bytes() * lay.num_layers;
  // Only blocks whose pages the lease holds on the device: none for a sequence offloaded to host
  // memory when it was released (its pages are host slots then).
  const size_t on_device = ppb > 0 ? l.pages.size() / ppb : 0;
  for (size_t k = o.cached_blocks; k < std::min(keys.size(), on_device); ++k) {
    // Every server of the block down: nobody to write to (a job of no servers would never end).
    const auto servers = st.ring->servers_for(keys[k], st.store.replicas, &st.store_watch.down);
    auto off = st.write_key && !servers.empty() ? st.write_slots.acquire(block_bytes) : std::nullopt;
    if (!off) {
      ++st.write_backs_dropped;  // backpressure: a miss later, never a stall now
      continue;
    }
    std::vector<uint32_t> pages(l.pages.begin() + k * ppb, l.pages.begin() + (k + 1) * ppb);
    store_write_order w;
    w.request_id = l.request_id;
    w.bytes = block_bytes;
    w.block = {keys[k].hi, keys[k].lo, {}};
    if (k > 0) w.parent_hi = keys[k - 1].hi, w.parent_lo = keys[k - 1].lo;
    w.retention = o.traffic_class;
    w.block_tokens = b;
    w.page_tokens = lay.page_size_tokens;
    w.kv_dim = lay.kv_dim;
    for (uint32_t layer = 0; layer < lay.num_layers; ++layer) {
      w.checksums.push_back(std::max<uint64_t>(1, kv.kv_layer_checksum(layer, pages, ppb)));
      for (uint32_t p = 0; p < ppb; ++p)
        std::memcpy(st.write_buf->data() + *off + (uint64_t{layer} * ppb + p) * lay.page_bytes(),
                    kv.data() + lay.offset_bytes(layer, pages[p]), lay.page_bytes());
    }
    const uint64_t job = ++st.last_write;
    st.writes[job] = write_job{*off, static_cast<uint32_t>(servers.size()), 0, std::move(w)};
    for (auto server : servers)
      self->request(st.store.servers[server], std::chrono::milliseconds{st.store.write_slot_timeout_ms},
                    store_write_begin{l.request_id, block_bytes})
          .then(
              [=, granted_by = st.store.servers[server]](store_write_slot& slot) {
                auto& st = self->state;
                auto j = st.writes.find(job);
                if (j == st.writes.end()) return;
                const auto& r = slot.region;
                transport::put_desc d{j->second.order.request_id, 0, "store-" + std::to_string(server),
                                      st.write_key->region_id,
                                      transport::region_key{r.backend, r.region_id, r.size_bytes, r.packed_key},
                                      {{j->second.offset, slot.offset, block_bytes}}};
                st.write_puts.push_back(
                    {job, server, granted_by, slot.slot_id, st.core.xport->post_put(d), self->clock().now()});
                schedule_write_poll(self);
              },
              [=](caf::error&) { write_done_one(self, job, false); });
  }
}

}  // namespace baton::decode_detail

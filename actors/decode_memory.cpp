// A decode rank's KV memory beyond its free pages: running sequences offloaded to host memory
// for lack of pages (whole-sequence leases, for a newcomer; on demand, as the pool runs dry) and
// resumed oldest first, and on-demand leases grown page by page (decode_rank_state.hpp).

#include <algorithm>
#include <cstring>

#include "actors/decode_rank_state.hpp"

namespace baton::decode_detail {

/// May offload_youngest move this lease's sequence to host memory? Not one a writer may still put
/// into (it gave a put up at its send timeout: its device pages would go to another lease with
/// that put still able to land), nor one released during the step being finished
/// (release_after_step: about to be freed; offloaded it would keep its lease and host slots
/// until it resumed), nor, with whole-sequence leases, one that went out for a newcomer before
/// (offloaded_once). On demand a sequence is preempted as often as the pool runs dry.
bool offloadable(const decode_state& st, const lease& l) {
  return !l.writers.abandoned && !l.release_after_step && (on_demand(st) || !l.offloaded_once);
}

/// The device pages offload_youngest can free, as it would: youngest eligible sequence first,
/// stopping at the first that does not fit in the host slots left. 0 on demand (nothing is
/// preempted for a newcomer there).
uint64_t offloadable_pages(const decode_state& st) {
  if (st.host_free.empty() || on_demand(st)) return 0;
  uint64_t host = st.host_free.size(), pages = 0;
  for (auto s = st.batch.rbegin(); s != st.batch.rend(); ++s) {
    const auto& l = st.leases.at(s->lease_id);
    if (!offloadable(st, l)) continue;
    if (host < l.pages.size()) break;
    host -= l.pages.size();
    pages += l.pages.size();
  }
  return pages;
}

/// Copies every layer of `pages` to (or from) host slots.
void copy_pages(decode_state& st, const std::vector<uint32_t>& pages, const std::vector<uint32_t>& slots, bool to_host) {
  auto& kv = st.core.exec->kv();
  const auto& lay = kv.layout();
  const uint64_t slot_bytes = lay.page_bytes() * lay.num_layers;
  for (size_t i = 0; i < pages.size(); ++i)
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      std::byte* dev = kv.data() + lay.offset_bytes(l, pages[i]);
      std::byte* host = st.host_pool.data() + slots[i] * slot_bytes + l * lay.page_bytes();
      if (to_host)
        std::memcpy(host, dev, lay.page_bytes());
      else
        std::memcpy(dev, host, lay.page_bytes());
    }
}


/// Moves the youngest running sequence to host memory, freeing its device pages (between
/// steps only). False when nothing runs or host memory is too full.
bool offload_youngest(decode_pointer self) {
  auto& st = self->state;
  auto v = std::find_if(st.batch.rbegin(), st.batch.rend(),
                        [&](const auto& s) { return offloadable(st, st.leases.at(s.lease_id)); });
  if (v == st.batch.rend()) return false;
  auto victim = *v;
  auto& l = st.leases.at(victim.lease_id);
  if (st.host_free.size() < l.pages.size()) return false;
  std::vector<uint32_t> slots(st.host_free.end() - l.pages.size(), st.host_free.end());
  st.host_free.resize(st.host_free.size() - l.pages.size());
  copy_pages(st, l.pages, slots, true);
  st.core.exec->kv().kv_page_free(l.pages);
  l.pages.clear();
  l.offloaded_once = true;
  st.batch.erase(std::next(v).base());
  st.paused.push_back({victim, std::move(slots)});
  ++st.offloaded;
  st.core.log->add({0, "offload", l.request_id, 0, 0, {}, {}});
  return true;
}

/// Brings the oldest offloaded sequence back if pages allow (it rejoins the batch).
bool resume_oldest(decode_pointer self) {
  auto& st = self->state;
  if (st.paused.empty()) return false;
  auto& p = st.paused.front();
  // On demand, only with room for its next page beyond the watermark: coming back to be
  // preempted again at once would only copy pages to and fro.
  // (With nothing running, nothing else can use the pages: it comes back if it fits at all.)
  if (on_demand(st) && !st.batch.empty() &&
      st.core.exec->kv().num_free_pages() < p.host_slots.size() + 1 + watermark_pages(st))
    return false;
  auto pages = st.core.exec->kv().kv_page_alloc(static_cast<uint32_t>(p.host_slots.size()));
  if (!pages) return false;
  auto& l = st.leases.at(p.seq.lease_id);
  l.pages = std::move(*pages);
  copy_pages(st, l.pages, p.host_slots, false);
  st.host_free.insert(st.host_free.end(), p.host_slots.begin(), p.host_slots.end());
  st.batch.push_back(p.seq);
  st.paused.pop_front();
  ++st.resumed;
  st.core.log->add({0, "resume", l.request_id, 0, 0, {}, {}});
  return true;
}

/// Between steps only (no step writes the pages). Both ways, offloaded sequences come back
/// first, oldest first, as pages allow, and newcomers wait while any is still out. Then
/// whole-sequence leases: waiting reservations are granted in order, offloading the youngest
/// running sequences to host memory while that makes the room. On demand: granted in order while
/// the watermark stays free; nothing is preempted for a newcomer.
void rebalance_memory(decode_pointer self) {
  auto& st = self->state;
  if (st.step_in_flight) return;
  // An executor that can run nothing (a broken data-parallel group) grants no more leases: what
  // waits for pages is placed again elsewhere. (Paused sequences still resume below: their next
  // step fails them over.)
  if (auto failure = st.core.unavailable(); !failure.empty()) {
    for (auto& r : st.reserves) {
      st.settled.push_back(r.req.request_id);  // the balancer stops charging its placement here
      r.promise.deliver(make_error(errc::rank_unavailable, where(r.req.request_id, st.cfg.name, "kv_reserve") + ": " + failure));
    }
    st.reserves.clear();
  }
  auto& kv = st.core.exec->kv();
  // Offloaded sequences come back first, oldest first, as pages allow; while one is still out,
  // newcomers wait (and are refused after reserve_wait_ms, to be placed elsewhere). Granting
  // newcomers first starved an offloaded sequence under steady arrivals, each newcomer taking
  // the pages it waited for, until its token timeout failed it over to be computed again.
  bool resumed = false;
  while (resume_oldest(self)) resumed = true;
  // A sequence back from host memory needs a step, which nothing else may start (the batch was
  // empty; or this runs inside maybe_step, via free_lease): a message to itself starts it.
  if (resumed) self->send(self, resume_atom::value);
  if (on_demand(st)) {
    while (st.paused.empty() && !st.reserves.empty()) {
      auto& r = st.reserves.front();
      const uint32_t need = pages_to_reserve(st, r.req);
      if (kv.num_free_pages() < need + watermark_pages(st)) break;
      r.promise.deliver(grant_lease(self, r.req, *kv.kv_page_alloc(need), r.holder));
      st.reserves.pop_front();
    }
    report_load(self);
    return;
  }
  while (st.paused.empty() && !st.reserves.empty()) {
    auto& r = st.reserves.front();
    const uint32_t need = pages_to_reserve(st, r.req);
    // Offloading cannot make the room: wait for sequences to finish instead of moving them to
    // host memory for nothing. Else the youngest go out until the newcomer fits (one
    // newcomer may send several out; the next waits for them to come back).
    if (kv.num_free_pages() < need && kv.num_free_pages() + offloadable_pages(st) < need) break;
    while (kv.num_free_pages() < need && offload_youngest(self)) {
    }
    auto pages = kv.kv_page_alloc(need);
    if (!pages) break;
    r.promise.deliver(grant_lease(self, r.req, std::move(*pages), r.holder));
    st.reserves.pop_front();
  }
  report_load(self);
}

/// On demand: every running sequence gets the page its next position falls in before the step,
/// preempting the youngest running sequences to host memory while none is free. Those still
/// without a page (host memory full) sit this step out.
void grow_pages(decode_pointer self) {
  auto& st = self->state;
  if (!on_demand(st)) return;
  auto& kv = st.core.exec->kv();
  for (size_t i = 0; i < st.batch.size();) {
    auto& l = st.leases.at(st.batch[i].lease_id);
    if (kv.pages_for_tokens(st.batch[i].pos + 1) <= l.pages.size()) {
      ++i;
    } else if (auto page = kv.kv_page_alloc(1)) {
      l.pages.push_back(page->front());
      ++i;
    } else if (!offload_youngest(self)) {  // may be batch[i] itself: the loop re-checks
      break;
    }
  }
  // Growing takes pages without a lease ending: the balancer hears of it once the free pages
  // moved by a percent of the pool since the last report, not only when a sequence ends (it
  // would go on placing sequences here on a count of free pages long gone).
  const uint32_t moved = kv.num_free_pages() > st.reported_free_pages ? kv.num_free_pages() - st.reported_free_pages
                                                                       : st.reported_free_pages - kv.num_free_pages();
  if (moved > 0 && moved * 100 >= kv.layout().num_pages) report_load(self);
}

}  // namespace baton::decode_detail

#include "actors/decode_rank.hpp"
#include "actors/decode_rank_state.hpp"
#include "policies/decode_placement.hpp"

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>
#include <random>

#include "actors/executor_bridge.hpp"
#include "actors/store_access.hpp"
#include "store/block_index.hpp"
#include "store/block_key.hpp"
#include "store/staging_pool.hpp"
#include "gpu/executor.hpp"
#include "gpu/prompt_lookup.hpp"
#include "gpu/sampling.hpp"
#include "transport/transport.hpp"

namespace baton {

using namespace decode_detail;

namespace decode_detail {


int64_t micros(caf::actor_clock::duration_type d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

bool on_demand(const decode_state& st) { return st.cfg.on_demand_headroom_tokens > 0; }

/// On demand, pages kept free for running sequences to grow into (vLLM's 1% watermark).
uint32_t watermark_pages(const decode_state& st) {
  return on_demand(st) ? policies::on_demand_watermark_pages(st.core.exec->kv().layout().num_pages) : 0;
}

/// Pages held out of the pool for late writers: quarantined leases', and freed leases' still being
/// checked or expanded on the worker.
uint32_t quarantined_pages(const decode_state& st) {
  size_t n = 0;
  for (const auto& [id, q] : st.quarantine) n += q.pages.size();
  for (const auto& [id, pages] : st.held_pages) n += pages.size();
  return static_cast<uint32_t>(n);
}

void report_load(decode_pointer self) {
  auto& st = self->state;
  auto settled = std::exchange(st.settled, {});
  if (!st.balancer || st.cfg.standby) return;  // on standby the balancer must not know us
  const auto& pool = st.core.exec->kv();
  st.reported_free_pages = pool.num_free_pages();
  const auto& layout = pool.layout();
  // With host memory for offloads, pages of running sequences that could move there count as
  // room: the balancer may place a sequence here, and the rank makes the room between steps.
  // While a sequence is offloaded there is none: newcomers wait for it to come back first.
  auto room = st.paused.empty() ? static_cast<uint32_t>(pool.num_free_pages() + offloadable_pages(st)) : 0u;
  auto failure = st.core.unavailable();
  if (!failure.empty()) room = 0;  // it refuses new work: place nothing here
  rank_load load{st.cfg.name, 0, static_cast<uint32_t>(st.leases.size()), room, layout.num_pages};
  load.unavailable = std::move(failure);
  load.settled = std::move(settled);
  load.page_size_tokens = layout.page_size_tokens;
  load.kv_tokens = uint64_t{layout.num_pages - pool.num_free_pages()} * layout.page_size_tokens;
  load.on_demand_headroom_tokens = st.cfg.on_demand_headroom_tokens;
  load.offloaded = st.offloaded;
  load.resumed = st.resumed;
  load.migrated_out = st.migrated_out;
  load.migrate_failed = st.migrate_failed;
  load.blocks_written_back = st.blocks_written_back;
  load.write_backs_dropped = st.write_backs_dropped;
  load.drafted_tokens = st.drafted_tokens;
  load.accepted_tokens = st.accepted_tokens;
  load.quarantined_pages = quarantined_pages(st);
  if (on_demand(st))  // the watermark is the running sequences' room to grow, not a newcomer's
    load.num_free_pages = load.num_free_pages > watermark_pages(st) ? load.num_free_pages - watermark_pages(st) : 0;
  self->send(st.balancer, load_atom::value, std::move(load), caf::actor_cast<decode_rank_actor>(self));
}

void give_back_pages(decode_state& st, uint64_t lease_id, std::vector<uint32_t> pages) {
  if (st.checks_in_flight.count(lease_id)) {
    auto& held = st.held_pages[lease_id];
    held.insert(held.end(), pages.begin(), pages.end());
    return;
  }
  st.core.exec->kv().kv_page_free(pages);
}

/// Gives a quarantined lease's pages back to the pool.
void end_quarantine(decode_pointer self, uint64_t lease_id) {
  auto& st = self->state;
  auto q = st.quarantine.find(lease_id);
  if (q == st.quarantine.end()) return;
  give_back_pages(st, lease_id, std::move(q->second.pages));
  st.core.log->add({0, "quarantine_end", q->second.request_id, 0, 0, {}, {}});
  st.quarantine.erase(q);
  if (!st.reserves.empty() || !st.paused.empty()) rebalance_memory(self);
  report_load(self);
}

void free_lease(decode_pointer self, uint64_t lease_id, bool writer_may_write, bool unreleased) {
  auto& st = self->state;
  auto i = st.leases.find(lease_id);
  if (i == st.leases.end()) {
    auto q = st.quarantine.find(lease_id);
    if (q == st.quarantine.end()) return;
    q->second.holder_may_not_know = false;  // its holder released it: it knew
    // Its writers are known to be done -- unless one abandoned a put, which may still land.
    if (!writer_may_write && !q->second.writers.abandoned) end_quarantine(self, lease_id);
    return;
  }
  st.stay.erase(std::remove(st.stay.begin(), st.stay.end(), lease_id), st.stay.end());
  auto& l = i->second;
  if (!l.commits.empty())
    answer_commits(l, where(l.request_id, st.cfg.name, "kv_commit") + ": the lease ended (expired or released) with " +
                          std::to_string(l.num_landed) + " of " + std::to_string(l.landed.size()) + " layers in");
  // A remote writer still at the lease would put into pages that the pool hands to the next
  // request: they wait for it. (A decoding lease's writers are done; a local one is ours.) A
  // writer that abandoned a put at its send timeout cannot say when it lands: only time can.
  const bool writing = writer_may_write && !l.decoding && !l.local_writer && !l.writers.all_done();
  if ((writing || l.writers.abandoned) && !l.pages.empty()) {
    auto& q = st.quarantine[lease_id];
    q.pages = std::move(l.pages);
    q.request_id = l.request_id;
    q.writers = l.writers;
    q.until = self->clock().now() + std::chrono::milliseconds{st.cfg.kv_quarantine_ms};
    q.holder = l.holder;
    q.holder_may_not_know = unreleased && !l.has_order && l.num_landed == 0 && l.writers.num_done == 0;
    self->delayed_send(self, std::chrono::milliseconds{st.cfg.kv_quarantine_ms}, expire_atom::value, lease_id);
    st.core.log->add({0, "quarantine", l.request_id, static_cast<uint32_t>(q.pages.size()), 0, {}, {}});
    l.pages.clear();
  }
  give_back_pages(st, lease_id, std::move(l.pages));
  for (auto p = st.paused.begin(); p != st.paused.end(); ++p)  // an offloaded sequence's host pages
    if (p->seq.lease_id == lease_id) {
      st.host_free.insert(st.host_free.end(), p->host_slots.begin(), p->host_slots.end());
      st.paused.erase(p);
      break;
    }
  st.leases.erase(i);
  if ((!st.reserves.empty() || !st.paused.empty()) && !st.taking_step) rebalance_memory(self);
  report_load(self);
}

void finish_seq(decode_pointer self, uint64_t lease_id, const std::string& reason);

void release_lease(decode_pointer self, uint64_t lease_id, bool writer_may_write) {
  auto& s = self->state;
  if (release_migrating(self, lease_id)) return;
  auto i = s.leases.find(lease_id);
  if (i == s.leases.end()) return free_lease(self, lease_id, writer_may_write);  // quarantined, maybe
  // A queued local prefill of this lease is dropped (unless its chunk is in the step in
  // flight: finish_local_chunk notices the lease is gone).
  bool chunk_in_step = false;
  for (size_t k = 0; s.step_in_flight && k < s.step_chunks.size() && k < s.local_prefills.size(); ++k)
    chunk_in_step |= s.local_prefills[k].lease_id == lease_id;
  for (auto p = s.local_prefills.begin(); p != s.local_prefills.end(); ++p)
    if (p->lease_id == lease_id && !chunk_in_step) {
      p->promise.deliver(make_error(errc::lease_expired, where(p->order.request_id, s.cfg.name, "prefill") +
                                                             ": the lease was released before the local prefill"));
      s.local_prefills.erase(p);
      break;
    }
  const bool in_step = s.step_in_flight && std::count(s.step_leases.begin(), s.step_leases.end(), lease_id);
  if (in_step || chunk_in_step)
    i->second.release_after_step = true;  // the executor still writes these pages
  else if (i->second.decoding)
    finish_seq(self, lease_id, "released");
  else {
    if (i->second.has_order) i->second.promise.deliver(decode_summary{.request_id = i->second.request_id, .finish_reason = "released"});
    free_lease(self, lease_id, writer_may_write);
  }
}

/// Monitors a lease's holder or its stream's receiver once, however many leases name it.
void watch(decode_pointer self, const caf::actor_addr& who) {
  if (auto h = caf::actor_cast<caf::actor>(who); h && self->state.watched_holders.insert(who).second) self->monitor(h);
}

/// A lease holder (a request actor) ended. One that ended normally let go of every lease it knew
/// (its release came first: one sender, in order), so a lease of it still here, or held at expiry
/// with no word from anyone, was never known to it, nor to any writer: its pages go back now,
/// not after lease_ms and the quarantine (a client that hung up while its reservation waited
/// cost a minute of pages before). A holder that failed, or whose process or link went, may have
/// told a writer: its leases go on as before.
void holder_down(decode_pointer self, const caf::down_msg& dm) {
  auto& st = self->state;
  st.watched_holders.erase(dm.source);
  // A sequence whose tokens have no receiver any more (its request failed, or its node or link
  // went), however that ended: nobody reads what it generates, and it would run on to its
  // max_tokens with its batch slot and pages. Its writers are done (the order comes after the
  // prefill's answer), so its pages need no quarantine beyond what the lease says.
  std::vector<uint64_t> unread;
  for (const auto& [id, l] : st.leases)
    if (l.has_order && !l.release_after_step && caf::actor_cast<caf::actor_addr>(l.order.stream_to) == dm.source)
      unread.push_back(id);
  for (auto id : unread) {
    st.core.log->add({0, "stream_gone", st.leases.at(id).request_id, 0, 0, {}, {}});
    release_lease(self, id, false);
  }
  if (dm.reason && dm.reason != caf::exit_reason::normal) return;
  std::vector<uint64_t> unknown, held;
  for (const auto& [id, l] : st.leases)
    if (l.holder == dm.source && !l.decoding && !l.has_order && !l.local_writer && !l.release_after_step &&
        l.num_landed == 0 && l.writers.num_done == 0)
      unknown.push_back(id);
  for (const auto& [id, q] : st.quarantine)
    if (q.holder == dm.source && q.holder_may_not_know) held.push_back(id);
  for (auto id : unknown) {
    st.core.log->add({0, "lease_orphaned", st.leases.at(id).request_id, 0, 0, {}, {}});
    free_lease(self, id, false);
  }
  for (auto id : held) end_quarantine(self, id);
}

bool has_page_for_next(const decode_state& st, const running_seq& s) {
  return st.core.exec->kv().pages_for_tokens(s.pos + 1) <= st.leases.at(s.lease_id).pages.size();
}

/// Speculative decoding: the drafts a running sequence runs after its input this step, as many
/// as its pages hold and its answer may still take beyond the step's own pick; none for answers
/// held to a grammar or returning logits (those need each pick's state before the next row).
std::vector<int32_t> drafts_for(const decode_state& st, const running_seq& s, lease& l) {
  const auto& cfg = st.cfg;
  if (cfg.speculative_tokens == 0 || !st.core.exec->picks_every_row() || l.grammar || l.order.return_logits) return {};
  const uint32_t left = l.order.max_new_tokens > s.num_generated + 1 ? l.order.max_new_tokens - s.num_generated - 1 : 0;
  uint32_t most = std::min(cfg.speculative_tokens, left);
  const auto& kv = st.core.exec->kv();
  while (most > 0 && kv.pages_for_tokens(s.pos + 1 + most) > l.pages.size()) --most;  // on demand: no page taken for a guess
  if (most == 0) return {};
  // The history: the prompt (and any output before a failover or a move), what was fed here,
  // and this step's input -- kept on the lease and grown by what was fed since, not copied each
  // step (a 32K-token context is 128 KB).
  auto& h = l.lookup_history;
  const auto& prompt = l.order.prompt_tokens;
  if (h.size() < prompt.size() || h.size() > prompt.size() + l.fed.size()) h = prompt;
  for (size_t i = h.size() - prompt.size(); i < l.fed.size(); ++i) h.push_back(l.fed[i]);
  h.push_back(s.next_input);
  auto drafts = gpu::propose_by_lookup(h, cfg.prompt_lookup_min, cfg.prompt_lookup_max, most);
  h.pop_back();
  return drafts;
}

/// A running sequence's row of a decode step: its input, then any drafts, each row with the pick
/// after it (by position: the draw depends on (seed, position), and the penalties read every
/// token before it, drafts included, as they would once accepted).
gpu::forward_seq step_row(const running_seq& s, const lease& l, const std::vector<int32_t>& drafts) {
  gpu::forward_seq seq{l.request_id, {s.next_input}, s.pos, l.pages, l.order.return_logits};
  seq.tokens.insert(seq.tokens.end(), drafts.begin(), drafts.end());
  // The pick after row r sits at position s.pos + r + 1 (row picks read the last pick's history,
  // cut: one copy for the step).
  for (size_t r = 0; r < drafts.size(); ++r) seq.row_samples.push_back(sampling_at(l.order, s.pos + static_cast<uint32_t>(r) + 1, nullptr));
  // The executor picks the next token: greedy rows' logits then stay on the device.
  seq.sample = sampling_at(l.order, s.pos + static_cast<uint32_t>(drafts.size()) + 1, l.grammar);
  if (seq.sample->cfg.penalised()) {  // every token before the one sampled: prompt, what was fed, the rows
    seq.sample->history = l.order.prompt_tokens;
    seq.sample->history.insert(seq.sample->history.end(), l.fed.begin(), l.fed.end());
    seq.sample->history.insert(seq.sample->history.end(), seq.tokens.begin(), seq.tokens.end());
  }
  return seq;
}

void maybe_step(decode_pointer self) {
  auto& st = self->state;
  take_for_migration(self);  // draining (elastic): sequences leave between steps
  // A local prompt whose lease expired (or was released) while it queued cannot run.
  while (!st.local_prefills.empty() && !st.step_in_flight && !st.leases.count(st.local_prefills.front().lease_id)) {
    auto& p = st.local_prefills.front();
    p.promise.deliver(make_error(errc::lease_expired, where(p.order.request_id, st.cfg.name, "prefill") +
                                                          ": the lease expired before the local prefill ran"));
    st.local_prefills.pop_front();
  }
  if (st.step_in_flight || (st.batch.empty() && st.local_prefills.empty())) return;
  grow_pages(self);
  // Local prompts start only while fewer than max_batch_size sequences run (decoding or
  // prefilling), as vLLM's max_num_seqs: beyond that they queue, and their TTFT shows it.
  size_t running = st.batch.size();
  for (const auto& p : st.local_prefills) {  // started prompts are a prefix of the queue
    if (p.next_pos == 0) break;
    ++running;
  }
  gpu::forward_job job{++st.last_job, {}, gpu::forward_job::decode};
  st.step_leases.clear();
  st.step_drafts.clear();
  st.step_chunks.clear();
  rank_event ev{0, "step", 0, 0, 0, {}, {}};
  // When more sequences wait than one step takes, start each step where the last one stopped,
  // so every sequence advances in turn.
  const size_t n = std::min<size_t>(st.batch.size(), st.cfg.max_batch_size);
  const size_t first = st.batch.size() > n ? st.batch_cursor % st.batch.size() : 0;
  size_t rows = n;  // decode rows, drafts included (they count in the step's token budget)
  const bool speculate = st.cfg.speculative_max_batch == 0 || n <= st.cfg.speculative_max_batch;
  for (size_t k = 0; k < n; ++k) {
    const auto& s = st.batch[(first + k) % st.batch.size()];
    if (!has_page_for_next(st, s)) continue;  // on demand, with host memory full: waits for a page
    auto& l = st.leases.at(s.lease_id);
    auto drafts = speculate ? drafts_for(st, s, l) : std::vector<int32_t>{};
    rows += drafts.size();
    job.seqs.push_back(step_row(s, l, drafts));
    st.step_leases.push_back(s.lease_id);
    st.step_drafts.push_back(std::move(drafts));
    ev.batch_requests.push_back(l.request_id);
    ev.batch_contexts.push_back(s.pos + 1);
  }
  st.batch_cursor = first + n;
  ev.chunk = static_cast<uint32_t>(rows - n);  // "step": its draft rows (speculative decoding)
  if (n > 0) st.core.log->add(std::move(ev));
  // Hybrid PD: local prompts' chunks ride in the same batch (their rows after the decode rows)
  // within a step budget of local_prefill_chunk_tokens tokens, decode rows included (vLLM's
  // max_num_batched_tokens): the oldest prompt's next chunk first, then, while budget is left,
  // the next prompts'. So a prompt delays each step by at most a budget, never by a whole prompt.
  // The chunks get at least an eighth of the budget, so a full batch cannot starve prompts.
  const uint32_t budget = st.cfg.local_prefill_chunk_tokens;
  uint32_t left = std::max<uint32_t>(budget > rows ? budget - static_cast<uint32_t>(rows) : 0, std::max(1u, budget / 8));
  for (auto& p : st.local_prefills) {
    if (left == 0) break;
    if (p.next_pos == 0 && running >= st.cfg.max_batch_size) break;  // no room to start another
    auto li = st.leases.find(p.lease_id);
    if (li == st.leases.end()) break;  // gone (released): the queue's front is cleaned up next step
    if (p.next_pos == 0) ++running;
    const auto& l = li->second;
    const auto total = static_cast<uint32_t>(p.order.tokens.size());
    const uint32_t len = std::min(left, total - p.next_pos);
    if (p.queue_us < 0) p.queue_us = micros(self->clock().now() - p.arrived_at);
    const bool last = p.next_pos + len == total;
    job.seqs.push_back(gpu::forward_seq{p.order.request_id,
                                        {p.order.tokens.begin() + p.next_pos, p.order.tokens.begin() + p.next_pos + len},
                                        p.next_pos, l.pages, last && p.order.return_logits});
    if (last) job.seqs.back().sample = sample_next(p.order, total, p.order.tokens, p.grammar);
    job.kind = gpu::forward_job::prefill;
    st.step_chunks.push_back(len);
    st.core.log->add({0, "local_chunk", p.order.request_id, p.num_chunks++, 0, {}, {}});
    left -= len;
  }
  if (job.seqs.empty()) {
    // On demand with host memory full, every running sequence may be waiting for a page that
    // nothing will free: give up the youngest (its request re-places itself) so the rest move.
    if (on_demand(st) && !st.batch.empty() && !st.step_in_flight) {
      // First a sequence outside this step's window (more run than one step takes) that has its
      // page: the next step starts there, and nobody is given up for nothing.
      for (size_t k = 0; k < st.batch.size(); ++k)
        if (has_page_for_next(st, st.batch[k])) {
          st.batch_cursor = k;
          return maybe_step(self);
        }
      const uint64_t victim = st.batch.back().lease_id;
      auto& l = st.leases.at(victim);
      l.promise.deliver(make_error(errc::kv_capacity, where(l.request_id, st.cfg.name, "decode") +
                                                          ": out of KV pages and host memory for its next token"));
      st.batch.pop_back();
      free_lease(self, victim);
      return maybe_step(self);
    }
    return;
  }
  st.step_in_flight = true;
  st.step_started = self->clock().now();
  st.core.exec->submit(std::move(job), std::make_shared<forwarding_sink>(self->address()));
}

/// True when the prompt is done with (answered, or failed because its lease is gone).
bool finish_local_chunk(decode_pointer self, local_prefill& p, gpu::forward_output& out, size_t row) {
  auto& st = self->state;
  auto li = st.leases.find(p.lease_id);
  if (li == st.leases.end()) {  // released while the chunk ran
    p.promise.deliver(make_error(errc::lease_expired, where(p.order.request_id, st.cfg.name, "prefill") +
                                                          ": the lease was released during the local prefill"));
    return true;
  }
  auto& l = li->second;
  if (l.release_after_step) {  // released (cancelled) while its chunk ran
    p.promise.deliver(make_error(errc::cancelled, where(p.order.request_id, st.cfg.name, "prefill") +
                                                      ": the lease was released during the local prefill"));
    free_lease(self, p.lease_id);
    return true;
  }
  l.expires_at = self->clock().now() + std::chrono::milliseconds{l.lease_ms};  // progress renews
  if (p.next_pos < p.order.tokens.size()) return false;
  prefill_result r{p.order.request_id, out.tokens[row], {}, st.cfg.name, p.queue_us};
  if (p.order.return_logits) r.logits = std::move(out.logits[row]);
  if (p.order.logprobs && row < out.logprobs.size()) r.logprobs.push_back(std::move(out.logprobs[row]));
  std::fill(l.landed.begin(), l.landed.end(), true);
  l.num_landed = static_cast<uint32_t>(l.landed.size());
  st.core.log->add({0, "kv_landed", l.request_id, 0, 0, {}, {}});
  p.promise.deliver(std::move(r));
  return true;
}

/// A step carrying local prefill chunks finished: advance each prompt; after its last chunk
/// every layer of the lease holds the prompt's KV, so the first token (picked by the executor) is
/// answered. The chunks' rows of `out` start at `first`, in step order.
void on_local_chunks_done(decode_pointer self, gpu::forward_output& out, size_t first) {
  auto& st = self->state;
  auto p = st.local_prefills.begin();
  for (size_t k = 0; k < st.step_chunks.size() && p != st.local_prefills.end(); ++k) {
    p->next_pos += st.step_chunks[k];
    if (finish_local_chunk(self, *p, out, first + k))
      p = st.local_prefills.erase(p);
    else
      ++p;
  }
  st.step_chunks.clear();
}

/// Joins the batch once every layer has landed and the order is here; the batch changes only
/// between steps.
void maybe_admit(decode_pointer self, uint64_t lease_id) {
  auto& st = self->state;
  auto i = st.leases.find(lease_id);
  if (i == st.leases.end()) return;
  auto& l = i->second;
  if (l.decoding || !l.has_order || l.num_landed != st.core.exec->config().num_hidden_layers) return;
  if (st.checks_in_flight.count(lease_id)) return;  // a repeated layer's check may yet drop it
  l.decoding = true;
  st.core.log->add({0, "admit", l.request_id, 0, 0, {}, {}});
  l.queue_us = micros(self->clock().now() - l.order_at);
  st.batch.push_back(running_seq{lease_id, l.order.prompt_len, l.order.first_token, 0});
  if (!st.host_free.empty()) report_load(self);  // its pages are now offloadable room
  maybe_step(self);
}

void finish_seq(decode_pointer self, uint64_t lease_id, const std::string& reason) {
  auto& st = self->state;
  auto i = st.leases.find(lease_id);
  if (i == st.leases.end()) return;
  uint32_t generated = 0;
  for (auto s = st.batch.begin(); s != st.batch.end(); ++s)
    if (s->lease_id == lease_id) {
      generated = s->num_generated;
      st.batch.erase(s);
      break;
    }
  // Every finish writes back the sequence's full blocks, a release too: the request lets go when
  // it sees a stop of its own (a stop string or token, an extra EOS id such as Llama 3's
  // <|eot_id|>), which ends chat turns -- whose prefix the next turn wants -- and the KV of every
  // token fed is whole whatever ended it. Not when a writer gave up a put into the pages: it may
  // have landed since, and a checksum taken now would seal it. Nor when its prompt came in a wire
  // form: a prefix loaded from the store must equal computing it.
  if (st.store.enabled() && i->second.order.write_back && !i->second.writers.abandoned && !i->second.wire_form)
    write_back(self, i->second);
  i->second.promise.deliver(decode_summary{.request_id = i->second.request_id, .num_tokens = generated, .finish_reason = reason,
                                                   .queue_us = i->second.queue_us});
  free_lease(self, lease_id);
}

/// Ends a running sequence with an error (its request fails over or gives up, by `code`).
void fail_seq(decode_pointer self, uint64_t lease_id, errc code, const std::string& what) {
  auto& st = self->state;
  auto& l = st.leases.at(lease_id);
  l.promise.deliver(make_error(code, where(l.request_id, st.cfg.name, "decode") + ": " + what));
  std::erase_if(st.batch, [&](const running_seq& x) { return x.lease_id == lease_id; });
  free_lease(self, lease_id);
}

/// A running sequence's next token, picked after its input `s.next_input`: fed, checked against
/// its grammar and stop conditions, streamed. False when the sequence ended (finished or failed)
/// with it; otherwise the token is the next input.
bool take_token(decode_pointer self, uint64_t lease_id, lease& l, int32_t tok, gpu::token_logprobs* lp,
                std::vector<float>* logits) {
  auto& st = self->state;
  auto s = std::find_if(st.batch.begin(), st.batch.end(), [&](auto& x) { return x.lease_id == lease_id; });
  if (s == st.batch.end()) return false;
  const auto eos = st.core.exec->config().eos_token_id;
  l.fed.push_back(s->next_input);  // its KV is now at position s->pos
  if (l.grammar && !l.grammar->accept(tok)) {
    // The executor picks among the tokens the grammar allows, so this never happens; if it
    // did, the answer could not be kept to its grammar: it fails rather than go on unchecked.
    fail_seq(self, lease_id, errc::executor_failed, "token " + std::to_string(tok) + " strays from the answer's grammar");
    return false;
  }
  // (Not for the answer's last token: nothing more is walked, and the answer is whole.)
  const bool last = (tok == eos && !l.order.ignore_eos) || (l.grammar && l.grammar->ended()) ||
                    s->num_generated + 1 >= l.order.max_new_tokens;
  if (l.grammar && !last)
    if (auto why = gpu::too_ambiguous(*l.grammar); !why.empty()) {
      // Not retried elsewhere (bad_request): the same answer would cost another rank as much.
      fail_seq(self, lease_id, errc::bad_request, why);
      return false;
    }
  ++s->num_generated;
  token_event ev{l.request_id, s->num_generated, tok, {}, lease_id};
  if (l.order.return_logits && logits) ev.logits = std::move(*logits);
  if (lp) ev.logprobs.push_back(std::move(*lp));
  self->send(l.order.stream_to, std::move(ev));
  if (tok == eos && !l.order.ignore_eos) {
    finish_seq(self, lease_id, "eos");
    return false;
  }
  if (s->num_generated >= l.order.max_new_tokens) {
    finish_seq(self, lease_id, "length");
    return false;
  }
  ++s->pos;
  s->next_input = tok;
  return true;
}

/// A refused step fails every request in it; the rank keeps serving the others. When the
/// executor can run nothing any more, its requests fail over to other ranks instead.
void fail_step(decode_pointer self, const std::string& what) {
  auto& s = self->state;
  const bool standing = !s.core.unavailable().empty();
  const auto code = standing ? errc::rank_unavailable : errc::executor_failed;
  s.step_in_flight = false;
  if (standing) rebalance_memory(self);  // queued reservations go elsewhere; it reports the load
  std::vector<uint64_t> released;  // let go while their chunk ran: nothing else frees them now
  for (size_t k = 0; k < s.step_chunks.size() && !s.local_prefills.empty(); ++k) {
    auto& p = s.local_prefills.front();
    p.promise.deliver(make_error(code, where(p.order.request_id, s.cfg.name, "prefill") + ": " + what));
    if (auto l = s.leases.find(p.lease_id); l != s.leases.end() && l->second.release_after_step)
      released.push_back(p.lease_id);
    s.local_prefills.pop_front();
  }
  for (auto id : released) free_lease(self, id);
  s.step_chunks.clear();
  auto failed = s.step_leases;
  for (auto id : failed) {
    auto i = s.leases.find(id);
    if (i == s.leases.end()) continue;
    i->second.promise.deliver(make_error(code, where(i->second.request_id, s.cfg.name, "decode") + ": " + what));
    s.batch.erase(std::remove_if(s.batch.begin(), s.batch.end(), [&](auto& x) { return x.lease_id == id; }),
                  s.batch.end());
    free_lease(self, id);
  }
  maybe_step(self);
}

void on_step_done(decode_pointer self, gpu::forward_output& out) {
  auto& st = self->state;
  // Every row's pick, or the step failed: an executor that answered short would have its rows
  // read past its output.
  const size_t rows = st.step_leases.size() + st.step_chunks.size();
  if (out.tokens.size() < rows)
    return fail_step(self, "the executor (" + st.core.exec->describe() + ") answered " + std::to_string(out.tokens.size()) +
                               " picks for a step of " + std::to_string(rows) + " sequences");
  st.step_in_flight = false;
  st.taking_step = true;
  ++st.num_steps;
  const double us = static_cast<double>(micros(self->clock().now() - st.step_started));
  st.recent_step_us = st.num_steps == 1 ? us : st.recent_step_us + (us - st.recent_step_us) / 16;
  if (!st.step_chunks.empty())
    on_local_chunks_done(self, out, st.step_leases.size());
  for (size_t row = 0; row < st.step_leases.size(); ++row) {
    const uint64_t lease_id = st.step_leases[row];
    auto li = st.leases.find(lease_id);
    if (li == st.leases.end()) continue;  // released while the step ran
    auto& l = li->second;
    if (std::none_of(st.batch.begin(), st.batch.end(), [&](auto& x) { return x.lease_id == lease_id; })) continue;
    if (l.release_after_step) {
      finish_seq(self, lease_id, "released");
      continue;
    }
    const auto& drafts = st.step_drafts[row];
    if (!drafts.empty() && (row >= out.row_tokens.size() || out.row_tokens[row].size() != drafts.size() ||
                            out.row_logprobs[row].size() != drafts.size())) {
      fail_seq(self, lease_id, errc::executor_failed, "the executor gave " +
               std::to_string(row < out.row_tokens.size() ? out.row_tokens[row].size() : 0) + " picks for " +
               std::to_string(drafts.size()) + " draft rows");
      continue;
    }
    // The picks after the input and after each draft; a draft is kept when the pick before it
    // is that draft, and the first pick that differs is the step's last token (as it would be
    // without drafts: the rows after it read a guess that turned out wrong, and are dropped --
    // their KV is overwritten when those positions are fed for real).
    st.drafted_tokens += drafts.size();
    for (size_t j = 0; j <= drafts.size(); ++j) {
      const bool last_row = j == drafts.size();
      const int32_t tok = last_row ? out.tokens[row] : out.row_tokens[row][j];
      gpu::token_logprobs* lp = nullptr;
      if (l.order.logprobs)
        lp = last_row ? (row < out.logprobs.size() ? &out.logprobs[row] : nullptr) : &out.row_logprobs[row][j];
      const bool kept = !last_row && tok == drafts[j];  // the model picked the draft (counted even if it ends the answer)
      st.accepted_tokens += kept;
      if (!take_token(self, lease_id, l, tok, lp, last_row && l.order.return_logits && row < out.logits.size() ? &out.logits[row] : nullptr)) break;
      if (!kept) break;
    }
  }
  st.taking_step = false;
  if (!st.reserves.empty() || !st.paused.empty()) rebalance_memory(self);
  maybe_step(self);
}

decode_rank_actor::behavior_type decode_rank_impl(decode_pointer self, decode_rank_config cfg,
                                                  std::shared_ptr<gpu::executor> exec,
                                                  std::shared_ptr<transport::transport> xport,
                                                  decode_balancer_actor balancer, store_access store) {
  auto& st = self->state;
  st.balancer = std::move(balancer);
  st.store = std::move(store);
  if (st.store.enabled()) {
    st.ring.emplace(static_cast<uint32_t>(st.store.servers.size()));
    watch_store_servers(self);
  }
  self->set_down_handler([=](caf::down_msg& dm) {
    if (!store_server_went_down(self, dm.source)) holder_down(self, dm);
  });
  if (cfg.host_offload_pages > 0) {
    const auto& lay = exec->kv().layout();
    st.host_pool.resize(uint64_t{cfg.host_offload_pages} * lay.page_bytes() * lay.num_layers);
    for (uint32_t i = cfg.host_offload_pages; i-- > 0;) st.host_free.push_back(i);
  }
  st.core.log->set_capacity(cfg.event_log_events);
  // Bit 63 stays clear: prefill-only attempts' tags have it set (prefill_only_tag).
  st.last_lease = cfg.first_lease_id ? cfg.first_lease_id - 1
                                     : (uint64_t{std::random_device{}()} & 0x7fff'ffffu) << 32;
  st.cfg = std::move(cfg);
  st.core.vocabulary = st.cfg.vocabulary;
  st.core.start(self, std::move(exec), std::move(xport));
  // An executor that can run nothing any more (a broken data-parallel group) says so at once:
  // the rank stops taking work before a request finds out; and again when its group re-formed,
  // so the rank reports room and takes work again. Weak: the executor outlives no actor.
  st.core.exec->on_health_change([addr = caf::actor_cast<caf::actor_addr>(self)] {
    if (auto me = caf::actor_cast<decode_rank_actor>(addr)) caf::anon_send(me, health_atom::value);
  });
  if (st.core.pool_key) {
    const auto& key = *st.core.pool_key;
    const auto& lay = st.core.exec->kv().layout();
    st.region = kv_region_desc{key.backend, key.region_id, key.size_bytes, key.packed,
                               lay.num_layers, lay.num_pages, lay.page_size_tokens, lay.kv_dim, lay.planes};
  }
  if (st.store.enabled() && st.core.setup_error.empty()) {
    st.write_buf->resize(st.store.max_pending_write_bytes);
    st.core.outlive_transport->push_back(st.write_buf);  // in-flight puts read it until the transport goes
    transport::xfer_error err;
    st.write_key = st.core.xport->register_region(st.write_buf->data(), st.write_buf->size(), &err);
    if (st.write_key) {
      st.write_slots = store::staging_pool{st.write_buf->size()};
      self->attach_functor([x = st.core.xport, id = st.write_key->region_id] { x->deregister_region(id); });
    }
  }
  report_load(self);  // registers this rank with its balancer
  return {
      [=](reserve_atom, const kv_lease_reserve& req) -> caf::result<kv_lease_grant> {
        return on_reserve(self, req);
      },
      [=](cancel_atom, uint64_t request_id) { on_reserve_cancelled(self, request_id); },
      [=](prefill_order& order) -> caf::result<prefill_result> {
        auto& s = self->state;
        const auto stage = where(order.request_id, s.cfg.name, "prefill");
        if (!s.core.setup_error.empty()) return make_error(errc::executor_failed, stage + ": " + s.core.setup_error);
        auto i = s.leases.find(order.grant.lease_id);
        if (i == s.leases.end() || i->second.request_id != order.request_id)
          return make_error(errc::lease_expired, stage + ": lease " + std::to_string(order.grant.lease_id) +
                                                     " expired or was never granted");
        if (order.tokens.empty()) return make_error(errc::bad_request, stage + ": empty prompt");
        auto grammar = s.core.follow_grammar(order.grammar, answer_so_far(order), stage);
        if (!grammar) return grammar.error();
        if (order.prompt_logprobs)  // the request sends scored prompts to a prefill rank (request.cpp)
          return make_error(errc::bad_request, stage + ": a decode rank does not score prompts (prompt log-probabilities)");
        if (s.core.exec->kv().pages_for_tokens(static_cast<uint32_t>(order.tokens.size())) > i->second.pages.size())
          return make_error(errc::layout_mismatch, stage + ": the lease is too small for the prompt");
        for (const auto& p : s.local_prefills)
          if (p.lease_id == i->first) return make_error(errc::bad_request, stage + ": already prefilling this lease");
        auto promise = self->make_response_promise<prefill_result>();
        const uint64_t lease_id = i->first;
        s.local_prefills.push_back(
            local_prefill{lease_id, std::move(order), promise, 0, 0, self->clock().now(), -1, std::move(*grammar)});
        i->second.local_writer = true;
        i->second.expires_at = self->clock().now() + std::chrono::milliseconds{i->second.lease_ms};
        maybe_step(self);
        return promise;
      },
      [=](release_atom, uint64_t lease_id, bool writer_may_write) { release_lease(self, lease_id, writer_may_write); },
      [=](writer_done_atom, uint64_t lease_id, uint32_t num_writers) {
        auto& s = self->state;
        if (auto i = s.leases.find(lease_id); i != s.leases.end()) return i->second.writers.note(num_writers);
        auto q = s.quarantine.find(lease_id);
        if (q == s.quarantine.end()) return;
        q->second.writers.note(num_writers);
        if (q->second.writers.all_done()) end_quarantine(self, lease_id);
      },
      [=](kv_commit_atom, uint64_t lease_id, uint64_t request_id) -> caf::result<bool> {
        return on_commit(self, lease_id, request_id);
      },
      [=](const kv_layer_ready& ev) {
        on_layer_ready(self, ev);
      },
      [=](layer_checked_atom, uint64_t lease_id, uint32_t layer, std::string& why) {
        on_layer_checked(self, lease_id, layer, std::move(why));
      },
      [=](keepalive_atom, uint64_t request_id, uint64_t lease_id) {
        // The prompt waits in a prefill rank's queue: that rank is alive and busy, keep the pages.
        auto& s = self->state;
        auto i = s.leases.find(lease_id);
        if (i == s.leases.end() || i->second.request_id != request_id || i->second.decoding) return;
        i->second.expires_at = self->clock().now() + std::chrono::milliseconds{i->second.lease_ms};
      },
      [=](decode_order& order) -> caf::result<decode_summary> {
        auto& s = self->state;
        auto i = s.leases.find(order.lease_id);
        if (auto c = s.corrupted.find(order.lease_id); i == s.leases.end() && c != s.corrupted.end()) {
          auto why = std::move(c->second);
          s.corrupted.erase(c);
          return make_error(errc::transfer_failed, why);
        }
        if (i == s.leases.end() || i->second.request_id != order.request_id)
          return make_error(errc::lease_expired, where(order.request_id, s.cfg.name, "decode") + ": lease " +
                                                     std::to_string(order.lease_id) +
                                                     " expired or was never granted");
        auto& l = i->second;
        // The answer so far: after the request's own prompt, what a failover or a move fed again,
        // then the first token.
        std::vector<int32_t> answer;
        if (order.grammar.kind != 0) {
          if (order.output_from < order.prompt_tokens.size())
            answer.assign(order.prompt_tokens.begin() + order.output_from, order.prompt_tokens.end());
          answer.push_back(order.first_token);
        }
        auto grammar = s.core.follow_grammar(order.grammar, answer, where(order.request_id, s.cfg.name, "decode"));
        if (!grammar) return grammar.error();
        l.grammar = std::move(*grammar);
        l.writers.abandoned |= order.writer_abandoned;  // its writer's own notice may come later
        // An abandoned put may still land. Over the prompt's rows it writes what is there; but
        // an f32 put ships a partly filled last page whole, and the rows past the prompt are
        // where this sequence's tokens' KV goes: landing mid-decode, it would overwrite them
        // (wrong tokens, silently). Such a lease is not decoded: its pages are quarantined and
        // the request goes again on fresh ones (a recompute, in a rare case).
        if (l.writers.abandoned && !l.wire_form && order.prompt_len % s.core.exec->kv().layout().page_size_tokens != 0) {
          const uint64_t lease_id = order.lease_id;
          auto why = where(order.request_id, s.cfg.name, "decode") + ": a put of this prompt's KV was abandoned at its "
                     "send timeout and could still land in the lease's last page, over the rows decoding writes; "
                     "the lease is quarantined and the request placed again";
          free_lease(self, lease_id, /*writer_may_write*/ true, /*unreleased*/ false);
          return make_error(errc::transfer_failed, std::move(why));
        }
        l.order = std::move(order);
        l.has_order = true;
        // The receiver of its tokens: after a move, the lease's holder is the rank it came from.
        watch(self, caf::actor_cast<caf::actor_addr>(l.order.stream_to));
        l.order_at = self->clock().now();
        l.promise = self->make_response_promise<decode_summary>();
        auto promise = l.promise;
        maybe_admit(self, i->first);
        return promise;
      },
      [=](stats_atom) {
        auto& s = self->state;
        const auto& pool = s.core.exec->kv();
        rank_stats r{s.cfg.name, pool.num_free_pages(), pool.layout().num_pages,
                     static_cast<uint32_t>(s.batch.size()),
                     static_cast<uint32_t>(s.leases.size() - s.batch.size()), s.num_steps,
                     s.blocks_written_back, s.write_backs_dropped, s.offloaded, s.resumed,
                     static_cast<uint32_t>(s.writes.size())};
        r.migrated_out = s.migrated_out;
        r.migrate_failed = s.migrate_failed;
        r.last_migrate_error = s.last_migrate_error;
        r.recent_step_us = s.recent_step_us;
        r.active = !s.cfg.standby;
        r.unavailable = s.core.unavailable();
        r.drafted_tokens = s.drafted_tokens;
        r.accepted_tokens = s.accepted_tokens;
        r.quarantined_pages = quarantined_pages(s);
        return r;
      },
      [=](migrate_atom) {
        self->state.migrate_out = true;
        take_for_migration(self);
      },
      [=](migrate_poll_atom) { poll_migrations(self); },
      [=](reserve_expire_atom, uint64_t id) {
        auto& s = self->state;
        auto r = std::find_if(s.reserves.begin(), s.reserves.end(), [&](auto& x) { return x.id == id; });
        if (r == s.reserves.end()) return;  // granted meanwhile
        s.settled.push_back(r->req.request_id);
        const auto& pool = s.core.exec->kv();
        r->promise.deliver(make_error(
            errc::kv_capacity, where(r->req.request_id, s.cfg.name, "kv_reserve") + ": waited " +
                                   std::to_string(s.cfg.reserve_wait_ms) + " ms for " +
                                   std::to_string(pages_to_reserve(s, r->req)) + " KV pages, " +
                                   std::to_string(pool.num_free_pages()) + " free"));
        s.reserves.erase(r);
        rebalance_memory(self);  // the next one in line may fit now
      },
      [=](role_atom, bool active) -> caf::result<bool> {
        auto& s = self->state;
        if (active) {  // serving decode again: no longer draining
          s.migrate_out = false;
          s.stay.clear();
        }
        // Quarantined pages count: freed later by this actor, they must not meet the other role's
        // allocations in the shared pool.
        // So do pages of a lease freed while its layer checks ran (held_pages), freed as the
        // checks are answered.
        const bool busy = s.leases.size() + s.local_prefills.size() + s.writes.size() + s.reserves.size() +
                                  s.quarantine.size() + s.held_pages.size() + s.checks_in_flight.size() > 0 ||
                          s.step_in_flight;
        return change_role(
            active, s.cfg.name,
            busy ? std::to_string(s.leases.size()) + " leases, " + std::to_string(s.writes.size()) + " write-backs" : "",
            &s.cfg.standby, *s.core.log, [=] { report_load(self); }, [] {});
      },
      [=](events_atom) { return self->state.core.log->snapshot(); },
      [=](exec_done_atom, uint64_t, gpu::forward_output& out) { on_step_done(self, out);
      },
      [=](exec_fail_atom, uint64_t, std::string& what) { fail_step(self, what); },
      [=](timer_atom, uint64_t id) { self->state.core.runner->fire(id); },
      [=](health_atom) {
        // The executor's standing failure began (queued reservations go elsewhere, the balancer
        // hears there is no room here) or ended (the balancer hears of the room again), or the
        // head's directory saw this node return and its balancer must hear of it again:
        // rebalance_memory reports, unless a step is in flight.
        rebalance_memory(self);
        if (self->state.step_in_flight) report_load(self);
      },
      [=](resume_atom) { maybe_step(self); },
      [=](poll_atom) { poll_writes(self); },
      [=](expire_atom, uint64_t lease_id) {
        auto& s = self->state;
        const auto now = self->clock().now();
        if (auto q = s.quarantine.find(lease_id); q != s.quarantine.end() && now >= q->second.until) {
          // Its writers never said they were done: gone with their process (whose puts cannot
          // land), or their notice lost. (An earlier timer of the lease itself finds `until` ahead.)
          s.core.log->add({0, "quarantine_expired", q->second.request_id, 0, 0, {}, {}});
          return end_quarantine(self, lease_id);
        }
        auto i = s.leases.find(lease_id);
        if (i == s.leases.end() || i->second.decoding) return;
        // A prompt queued or computing on this rank (hybrid PD) is progress, not an abandoned
        // lease: its wait is this rank's doing. (A cancel releases it.)
        if (std::any_of(s.local_prefills.begin(), s.local_prefills.end(), [&](auto& p) { return p.lease_id == lease_id; }))
          i->second.expires_at = now + std::chrono::milliseconds{i->second.lease_ms};
        if (now < i->second.expires_at) {  // renewed since this timer was set
          self->delayed_send(self, i->second.expires_at - now, expire_atom::value, lease_id);
          return;
        }
        if (i->second.has_order)
          i->second.promise.deliver(make_error(
              errc::lease_expired, where(i->second.request_id, s.cfg.name, "kv_recv") + ": only " +
                                       std::to_string(i->second.num_landed) + " of " +
                                       std::to_string(i->second.landed.size()) + " layers landed before the lease expired"));
        free_lease(self, lease_id, true, true);  // a stalled writer may still put into it
      },
  };
}

}  // namespace decode_detail

decode_rank_actor spawn_decode_rank(caf::actor_system& sys, decode_rank_config cfg,
                                    std::shared_ptr<gpu::executor> exec,
                                    std::shared_ptr<transport::transport> xport, decode_balancer_actor balancer,
                                    store_access store) {
  return sys.spawn(decode_rank_impl, std::move(cfg), std::move(exec), std::move(xport), std::move(balancer),
                   std::move(store));
}

}  // namespace baton

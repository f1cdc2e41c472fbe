#include "actors/prefill_rank.hpp"

#include <algorithm>
#include <utility>
#include <map>

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/prefill_rank_state.hpp"
#include "gpu/sampling.hpp"
#include "policies/cost_model.hpp"

namespace baton {

namespace prefill_detail {

// This file's own, declared here because they call one another out of order.
void report_load(prefill_pointer self);
std::optional<chunk_job> take_job(prefill_pointer self, uint64_t job_id);
void return_pages(prefill_pointer self, prefill_job_state& r, bool success);
void submit_chunk(prefill_pointer self, uint64_t rid);
void pump(prefill_pointer self);
void launch(prefill_pointer self, waiting_order w, std::vector<uint32_t> pages, std::vector<store::block_key> keys,
            uint32_t shared_blocks);
void drain_waiting(prefill_pointer self);

/// A failed split part's held pages (prefill_state::split_holds) go back once their hold is past;
/// a hold pushed out meanwhile (an earlier part gave a put up unsettled) waits on.
void end_split_hold(prefill_pointer self, uint64_t lease) {
  auto& st = self->state;
  auto h = st.split_holds.find(lease);
  if (h == st.split_holds.end()) return;
  if (const auto now = self->clock().now(); now < h->second.until) {
    st.core.runner->run_after(std::chrono::duration_cast<std::chrono::milliseconds>(h->second.until - now) +
                                  std::chrono::milliseconds{1},
                              [self, lease] { end_split_hold(self, lease); });
    return;
  }
  st.core.exec->kv().kv_page_free(h->second.pages);
  st.core.log->add({0, "pages_unheld", h->second.request_id, static_cast<uint32_t>(h->second.pages.size()), 0, {}, {}});
  st.split_holds.erase(h);
  drain_waiting(self);
}

/// The tokens of a scored prompt (prefill_order::prompt_logprobs): the request's own prompt,
/// without output tokens fed back after a failover.
uint32_t scored_prompt(const prefill_order& o) {
  const auto n = static_cast<uint32_t>(o.tokens.size());
  return o.output_from > 0 ? std::min(o.output_from, n) : n;
}

caf::result<prefill_result> accept_prefill(prefill_pointer self, prefill_order order);

/// The queued prompt tokens and the cost model's time for them (what placement weighs).
std::pair<uint64_t, double> queued_work(const prefill_state& st) {
  uint64_t queued = 0;
  double predicted = 0.0;
  for (const auto& [id, r] : st.requests) {
    queued += r.tokens_left;
    uint64_t start = r.cached_tokens;
    for (uint32_t c = 0; c < r.num_chunks; ++c) {
      if (c >= r.chunks_done) predicted += st.cfg.cost.prefill_us(r.chunk_sizes[c], start);
      start += r.chunk_sizes[c];
    }
  }
  st.waiting.for_each([&](const waiting_order& w) {
    queued += w.order.tokens.size();
    predicted += st.cfg.cost.prefill_us(w.order.tokens.size(), 0);
  });
  return {queued, predicted};
}

void report_load(prefill_pointer self) {
  auto& st = self->state;
  auto settled = std::exchange(st.settled, {});
  if (!st.balancer || st.cfg.standby) return;  // on standby the balancer must not know us
  const auto [queued, predicted] = queued_work(st);
  const auto& kv = st.core.exec->kv();
  rank_load load{st.cfg.name, queued, static_cast<uint32_t>(st.requests.size() + st.waiting.size()),
                 kv.num_free_pages(), kv.layout().num_pages};
  load.page_size_tokens = kv.layout().page_size_tokens;
  load.predicted_us = predicted;
  load.unavailable = st.core.unavailable();  // the balancer then places nothing here
  load.settled = std::move(settled);
  // Pages held for late writers (a late store read, a split part, a put given up): neither free
  // nor in use, and not a leak.
  load.quarantined_pages = st.late_held_pages;
  for (const auto& [lease, h] : st.split_holds) load.quarantined_pages += static_cast<uint32_t>(h.pages.size());
  self->send(st.balancer, load_atom::value, std::move(load), caf::actor_cast<prefill_rank_actor>(self));
}

/// Tells the order's decode rank that this writer of its lease is done: nothing of it is in
/// flight, and nothing more will be posted.
void tell_writer_done(prefill_pointer self, const decode_rank_actor& decode, uint64_t lease_id, size_t parts) {
  if (!decode) return;
  self->send(decode, writer_done_atom::value, lease_id, static_cast<uint32_t>(parts));
}

void tell_writer_done(prefill_pointer self, const prefill_order& o) {
  tell_writer_done(self, o.decode, o.grant.lease_id, std::max<size_t>(1, o.part_ranks.size()));
}

/// Ends an order that never ran (it posted nothing) with `err`.
void refuse_order(prefill_pointer self, waiting_order& w, caf::error err) {
  w.promise.deliver(std::move(err));
  tell_writer_done(self, w.order);
}

/// While the executor can run nothing (a broken expert group), prompts still waiting for pages
/// are refused, retryably, so that their requests are placed again on other ranks at once
/// rather than each failing in its first job. Prompts already running fail in their next job.
void refuse_waiting(prefill_pointer self) {
  auto& st = self->state;
  const auto failure = st.core.unavailable();
  if (failure.empty()) return;
  while (auto w = st.waiting.pop())
    refuse_order(self, *w, make_error(errc::rank_unavailable, where(w->order.request_id, st.cfg.name, "prefill") + ": " + failure));
}

/// Counts a finished executor job and returns the request it belonged to (forgetting the job).
std::optional<chunk_job> take_job(prefill_pointer self, uint64_t job_id) {
  auto& st = self->state;
  ++st.num_jobs_done;
  auto j = st.job_to_request.find(job_id);
  if (j == st.job_to_request.end()) return std::nullopt;
  const chunk_job cj = j->second;
  st.job_to_request.erase(j);
  if (st.chunks_in_executor > 0) --st.chunks_in_executor;
  return cj;
}

/// Gives a finished prompt's pages back: shared ones are unpinned; after a success its own full
/// blocks join the rank-local tier (their KV is the prompt's, computed or loaded and verified);
/// the rest is freed.
void return_pages(prefill_pointer self, prefill_job_state& r, bool success) {
  auto& st = self->state;
  auto& kv = st.core.exec->kv();
  // Pages someone else may still put into go to no other prompt (nor to the local tier, shared
  // with later prompts) until that writer's last possible put is past:
  // - a store read that ended unanswered, or whose server gave a put up: the server starts no
  //   put after the order's budget and gives each up after store_put_limit_ms, but a put given
  //   up may land later still (the server keeps its buffer for it): a quarantine;
  // - a later part of a split prompt that failed: the earlier parts (told by split_abort or by
  //   the request) post nothing more, and each posted put settles or is given up within their
  //   kv_send_timeout_ms (this rank's, in a cluster of one configuration), twice for the notice.
  uint32_t hold_ms = 0;
  if (r.load.late_writer) hold_ms = std::max(st.store.read_timeout_ms + store_put_limit_ms, st.cfg.late_put_quarantine_ms);
  //   One given up unsettled (split_abort::abandoned) may land later still: a quarantine.
  if (!success && r.split.active && r.split.index > 0)
    hold_ms = std::max(hold_ms, r.split.peer_abandoned ? st.cfg.late_put_quarantine_ms : 2 * st.cfg.kv_send_timeout_ms);
  // - a put of ours given up at the send timeout: the transport may read its source pages when it
  //   gets to it (a queued put, a rendezvous the target pulls), and a release does not recall
  //   it. Reused meanwhile, they would send another prompt's KV into a lease that may be decoding
  //   (this request's restarted attempt succeeded): the pages, shared blocks too, wait as long
  //   as the decode rank quarantines the lease.
  const bool source_held = r.abandoned_put;
  if (source_held) hold_ms = std::max(hold_ms, st.cfg.late_put_quarantine_ms);
  if (hold_ms > 0) {
    size_t own_from = 0;  // the shared blocks' pages belong to the local tier, not to this prompt
    if (st.local) {
      if (!source_held) st.local->release(r.keys, r.shared_blocks);  // else pinned until the hold ends
      own_from = std::min(size_t{r.shared_blocks} * st.local->pages_per_block(), r.local_pages.size());
    }
    std::vector<uint32_t> held(r.local_pages.begin() + own_from, r.local_pages.end());
    st.core.log->add({0, "pages_held", r.order.request_id, static_cast<uint32_t>(held.size()), hold_ms, {}, {}});  // layer: ms
    if (!success && r.split.active && r.split.index > 0 && !source_held) {
      const uint64_t lease = r.order.grant.lease_id;
      st.split_holds[lease] = {r.order.request_id, std::move(held), self->clock().now() + std::chrono::milliseconds{hold_ms}};
      st.core.runner->run_after(std::chrono::milliseconds{hold_ms}, [self, lease] { end_split_hold(self, lease); });
      return;
    }
    ++st.late_holds;
    st.late_held_pages += static_cast<uint32_t>(held.size());
    std::vector<store::block_key> pinned;  // shared blocks a given-up put may still read
    if (source_held && st.local) pinned.assign(r.keys.begin(), r.keys.begin() + std::min<size_t>(r.shared_blocks, r.keys.size()));
    st.core.runner->run_after(std::chrono::milliseconds{hold_ms},
                              [self, held = std::move(held), pinned = std::move(pinned), rid = r.order.request_id] {
                                --self->state.late_holds;
                                self->state.late_held_pages -= static_cast<uint32_t>(held.size());
                                if (self->state.local && !pinned.empty())
                                  self->state.local->release(pinned, pinned.size());
                                self->state.core.exec->kv().kv_page_free(held);
                                self->state.core.log->add({0, "pages_unheld", rid, static_cast<uint32_t>(held.size()), 0, {}, {}});
                                drain_waiting(self);
                              });
    return;
  }
  if (!st.local) {
    kv.kv_page_free(r.local_pages);
    return;
  }
  const uint32_t ppb = st.local->pages_per_block();
  st.local->release(r.keys, r.shared_blocks);
  size_t own_from = size_t{r.shared_blocks} * ppb;
  if (success) {
    const size_t full = r.keys.size();
    for (size_t b = full; b-- > r.shared_blocks;)
      kv.kv_page_free(st.local->insert(
          r.keys[b], {r.local_pages.begin() + b * ppb, r.local_pages.begin() + (b + 1) * ppb}));
    own_from = full * ppb;
    kv.kv_page_free(st.local->evict(0));  // down to capacity
  }
  kv.kv_page_free({r.local_pages.begin() + std::min(own_from, r.local_pages.size()), r.local_pages.end()});
}

void finish_if_done(prefill_pointer self, uint64_t request_id) {
  auto& st = self->state;
  auto i = st.requests.find(request_id);
  if (i == st.requests.end()) return;
  auto& r = i->second;
  const bool compute_finished = r.chunks_done == r.num_chunks && r.num_chunks > 0;
  const uint32_t layers = st.core.exec->config().num_hidden_layers;
  bool done = compute_finished && r.have_logits && (r.order.prefill_only || r.layers_ready == layers);
  if (r.split.earlier_part()) {  // an earlier part: done when every later part has our KV
    const auto peers_expected = r.split.parts - 1 - r.split.index;
    done = compute_finished && std::all_of(r.split.layer_done.begin(), r.split.layer_done.end(), [](bool b) { return b; }) &&
           r.split.peers.size() == peers_expected && r.split.peer_puts_landed == peers_expected * layers;
  }
  if (!r.failed && !done) return;
  // A failure is answered only when the executor is done with the request and its posted puts
  // have settled: after that no byte of it can still land, so the decode rank may safely reuse
  // the lease's pages. (A layer's put is posted before the layer's MLP, so a job that fails in
  // a MoE layer has that layer's put in flight. A put abandoned at the send timeout cannot be
  // recalled; that path answers at once.) During poll_pending's pass its puts are out of
  // `pending`: the request is looked at again after the pass.
  if (st.polling) return st.answer_after_poll.push_back(request_id);
  const auto in_flight = [&] {
    return std::any_of(st.pending.begin(), st.pending.end(), [&](const pending_put& p) { return p.request_id == request_id; });
  };
  // A success waits too: an aborted attempt's puts (a prefix load that failed late) may still be
  // on their way after the restart announced every layer.
  // A failure also waits for its store reads: the servers are putting into the pages.
  if ((r.failed && (r.jobs_in_executor > 0 || r.load.outstanding > 0)) || in_flight()) return;
  if (r.failed) {
    // A put given up at the send timeout may still land in the lease's pages: the request must
    // hear transfer_failed, whatever failed first, so that its release keeps the pages out of
    // reuse until the quarantine (a quiet error would let the decode rank reuse them at once).
    if (r.abandoned_put && !(r.failure.category() == caf::atom("baton") &&
                             static_cast<errc>(r.failure.code()) == errc::transfer_failed)) {
      std::string what = r.failure.context().match_elements<std::string>() ? r.failure.context().get_as<std::string>(0)
                                                                            : self->system().render(r.failure);
      r.failure = make_error(errc::transfer_failed, what + "; a put given up at the send timeout may still land");
    }
    r.promise.deliver(std::move(r.failure));
  } else {
    const auto& m = st.core.exec->config();
    // Every layer of the whole prompt goes to the decode rank, K and V, as f32 values, or as whole
    // pages' wire forms (none prefill-only).
    const auto wire = r.wire.value_or(transport::wire_format::f32);
    const auto& kv = st.core.exec->kv();
    const uint64_t kv_bytes =
        r.order.prefill_only ? 0
        : wire == transport::wire_format::f32
            ? uint64_t{prompt_end(r)} * m.num_hidden_layers * m.kv_values_per_token() * sizeof(float)
            : uint64_t{kv.pages_for_tokens(prompt_end(r))} * m.num_hidden_layers *
                  transport::wire_bytes(wire, kv.layout().page_bytes() / sizeof(float));
    const int64_t send_us =
        r.first_put_at ? std::chrono::duration_cast<std::chrono::microseconds>(self->clock().now() - *r.first_put_at).count()
                       : 0;
    prefill_result out{request_id, r.first_token, std::move(r.logits), st.cfg.name, r.queue_us,
                       r.split.active ? 0 : r.cached_tokens, r.recomputed_blocks,
                       r.shared_blocks * st.store.block_tokens(), kv_bytes, send_us, r.abandoned_put,
                       std::move(r.logprobs), {}};
    for (auto& scores : r.chunk_scores)
      for (auto& s : scores) out.prompt_logprobs.push_back(std::move(s));
    if (r.order.prompt_logprobs && out.prompt_logprobs.size() + 1 != scored_prompt(r.order))
      r.promise.deliver(make_error(errc::executor_failed,
                                   where(request_id, st.cfg.name, "prefill") + ": the executor (" +
                                       st.core.exec->describe() + ") scored " + std::to_string(out.prompt_logprobs.size()) +
                                       " of the prompt's " + std::to_string(scored_prompt(r.order) - 1) +
                                       " tokens after its first (it may not score prompts)"));
    else
      r.promise.deliver(std::move(out));
  }
  // No put of it is in flight now: a decode rank that dropped its lease meanwhile may reuse the
  // pages (and one that did not counts this writer done). One abandoned at the send timeout may
  // still land, which the notice says (0 writers): the pages then wait out the quarantine.
  if (r.abandoned_put)
    tell_writer_done(self, r.order.decode, r.order.grant.lease_id, 0);
  else
    tell_writer_done(self, r.order);
  return_pages(self, r, !r.failed);
  st.requests.erase(i);
  drain_waiting(self);  // freed pages may start a waiting prompt; reports the load
}

void fail_request(prefill_pointer self, uint64_t request_id, errc code, const std::string& stage,
                  const std::string& what) {
  auto i = self->state.requests.find(request_id);
  if (i == self->state.requests.end()) return;
  // Failed already: this is one of its puts settling (failed, or given up at the send timeout),
  // which its answer may be waiting for.
  if (i->second.failed) return finish_if_done(self, request_id);
  i->second.failed = true;
  i->second.cancelled->store(true);
  // A chunk waiting at the streamed-prefix gate leaves the executor now, not at the gate's timeout
  // (it would hold the executor, and every prompt behind it, for nothing).
  if (i->second.load.gate) i->second.load.gate->abort();
  i->second.num_chunks = i->second.chunks_submitted;  // chunks not yet submitted never will be
  i->second.failure = make_error(code, where(request_id, self->state.cfg.name, stage) + ": " + what);
  // Split: the other parts cannot finish without this one. They stop now, not at their timeouts.
  const auto& r = i->second;
  if (r.split.active)
    for (uint32_t j = 0; j < r.split.parts && j < r.order.part_ranks.size(); ++j)
      if (j != r.split.index)
        caf::anon_send(r.order.part_ranks[j], split_abort{request_id, r.order.grant.lease_id, r.split.index,
                                                          static_cast<uint8_t>(code),
                                                          where(request_id, self->state.cfg.name, stage) + ": " + what,
                                                          r.abandoned_put});
  finish_if_done(self, request_id);
}

/// Submits one chunk of a started prompt. Its layers' puts are posted from the executor thread.
void submit_chunk(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  const auto& order = r.order;
  const auto& local = st.core.exec->kv().layout();
  const auto& reg = order.grant.region;
  gpu::kv_layout remote_layout{reg.num_layers, reg.num_pages, reg.page_size_tokens, reg.kv_dim, reg.kv_planes};
  transport::region_key remote_key{reg.backend, reg.region_id, reg.size_bytes, reg.packed_key};
  const auto num_tokens = prompt_end(r);
  const uint32_t c = r.chunks_submitted++;
  uint32_t start = r.cached_tokens;
  for (uint32_t k = 0; k < c; ++k) start += r.chunk_sizes[k];
  const uint32_t end = start + r.chunk_sizes[c];
  const uint32_t ps = local.page_size_tokens;
  // The first chunk also ships the prefix loaded from the store: the decode rank needs all of it.
  // A chunk that ends mid-page leaves that page to the next chunk, which starts in it and ships
  // it whole; only the part's last chunk ships its partly filled tail. So each page of each
  // layer travels once.
  const bool part_ends = end == num_tokens;
  if (!r.wire) r.wire = choose_wire(self, r);
  auto sender = std::make_shared<const chunk_sender>(chunk_sender{
      rid, r.attempt, c, part_ends, c == 0 && !r.split.active ? 0 : start / ps, part_ends ? (end + ps - 1) / ps : end / ps,
      r.local_pages, order.grant.page_ids, local, remote_layout, st.core.pool_key->region_id, remote_key,
      order.grant.rank, *r.wire, st.core.wire, order.grant.wire, part_ends && end % ps ? end % ps : 0});
  // Runs on the executor thread as soon as layer `l`'s KV is written, before the layer's
  // attention and MLP: the put is posted in stream order and travels while they compute (its
  // checksum reads pages still in the cache), and the actor polls it.
  // Raw pointers on purpose: the callback runs on the executor's thread, and if it held the last
  // reference to the executor, the executor would be destroyed on (and try to join) its own thread.
  // rank_core destroys the executor (joining its thread) before the transport, so both outlive
  // every callback.
  auto on_kv_ready = [sender, xport = st.core.xport.get(), log = st.core.log, exec = st.core.exec.get(),
                      owner = self->address(), checksums = st.cfg.checksum_kv, ships = !order.prefill_only,
                      cancelled = r.cancelled](uint64_t, uint32_t l) {
    log->add({0, "kv_written", sender->request_id, sender->chunk, l, {}, {}});
    if (!ships || cancelled->load()) return;
    const bool in_wire_form = sender->wire != transport::wire_format::f32;
    if (in_wire_form) {
      if (auto why = sender->encode_layer(l, exec->kv()); !why.empty()) {
        if (auto h = caf::actor_cast<caf::actor>(owner)) caf::anon_send(h, xfer_atom::value, sender->request_id, l, why, sender->attempt);
        return;
      }
    }
    // The last chunk completes layer l of the whole prompt: its checksum goes with the
    // layer-ready signal so the decode rank can prove the layer landed intact. In wire form it
    // covers the staged wire bytes, every earlier chunk's pages still staged (slots are per page).
    uint64_t checksum = 0;
    if (sender->last && !checksums) checksum = 1;
    else if (sender->last && in_wire_form)
      checksum = std::max<uint64_t>(1, sender->staging->checksum(sender->wire, l, sender->local_pages, sender->end_page));
    else if (sender->last)
      checksum = std::max<uint64_t>(1, exec->kv().kv_layer_checksum(l, sender->local_pages, sender->end_page));
    const uint64_t xfer = xport->post_put(sender->put_for_layer(l));
    log->add({0, "send_posted", sender->request_id, sender->chunk, l, {}, {}});
    if (auto h = caf::actor_cast<caf::actor>(owner))
      caf::anon_send(h, xfer_atom::value, sender->request_id, l, xfer, checksum, sender->attempt);
  };
  auto on_computed = [log = st.core.log, rid, chunk = c](uint64_t, uint32_t l) {
    log->add({0, "compute_done", rid, chunk, l, {}, {}});
  };
  const uint64_t job_id = ++st.last_job;
  st.job_to_request[job_id] = chunk_job{rid, end - start, r.attempt, c};
  ++st.chunks_in_executor;
  ++r.jobs_in_executor;
  // The prompt's last chunk has its executor pick the first token (greedy rows' logits stay on
  // the device); an earlier part of a split prompt needs neither token nor logits.
  const bool last = end == num_tokens && !r.split.earlier_part();
  gpu::forward_job job{job_id, {gpu::forward_seq{rid, {order.tokens.begin() + start, order.tokens.begin() + end},
                                                 start, r.local_pages, last && order.return_logits}}};
  if (last) job.seqs[0].sample = sample_next(order, static_cast<uint32_t>(order.tokens.size()), order.tokens, r.grammar);
  if (order.prompt_logprobs) {
    // Row p scores the prompt's token p + 1; the prompt's last row has none (it picks the first
    // output token), nor have rows of output tokens fed back after a failover.
    auto& targets = job.seqs[0].score_targets;
    const uint32_t prompt = scored_prompt(order);
    for (uint32_t p = start; p < end; ++p) targets.push_back(p + 1 < prompt ? order.tokens[p + 1] : -1);
    job.seqs[0].score_top = std::max(order.top_logprobs, order.prompt_top_logprobs);
  }
  if (r.load.gate && !r.load.aborted) job.seqs[0].gate = r.load.gate;  // streaming prefix: wait per layer
  st.core.exec->submit(std::move(job),
                       std::make_shared<forwarding_sink>(self->address(), std::move(on_kv_ready), std::move(on_computed),
                                                         /*report_start*/ c == 0));
}

/// Keeps the executor fed: picks the next chunk by priority class while fewer than
/// max_chunks_in_executor are in it.
void pump(prefill_pointer self) {
  auto& st = self->state;
  while (st.chunks_in_executor < max_chunks_in_executor) {
    auto rid = st.runnable.pop();
    if (!rid) return;
    auto i = st.requests.find(*rid);
    if (i == st.requests.end() || i->second.failed || i->second.chunks_submitted >= i->second.chunk_sizes.size())
      continue;
    submit_chunk(self, *rid);
    if (i->second.chunks_submitted < i->second.chunk_sizes.size())
      st.runnable.push_front(*rid, i->second.order.batch_priority);
  }
}

/// Plans the chunks of a prompt whose first `cached` tokens already have KV in its pages, and
/// makes it runnable.
void start_compute(prefill_pointer self, uint64_t rid, uint32_t cached) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  const auto num_tokens = prompt_end(r);
  r.cached_tokens = cached;
  const uint32_t todo = num_tokens - cached;
  r.chunk_sizes.clear();
  r.chunks_submitted = r.chunks_done = 0;
  std::fill(r.puts_done.begin(), r.puts_done.end(), 0);
  std::fill(r.checksums.begin(), r.checksums.end(), 0);
  r.have_logits = false;
  // Seed 000 §3.1 level 4: with a step budget, each chunk is the largest whose predicted cost
  // fits it, so chunks shrink as the context grows; chunk_tokens caps them either way.
  if (st.cfg.step_budget_us > 0)
    r.chunk_sizes = policies::plan_chunks(st.cfg.cost, cached, todo, st.cfg.step_budget_us, st.cfg.chunk_tokens);
  else
    for (uint32_t done = 0; done < todo; done += st.cfg.chunk_tokens)
      r.chunk_sizes.push_back(std::min(st.cfg.chunk_tokens, todo - done));
  if (r.order.prompt_logprobs) {  // each scored row brings its logits to the host: keep chunks short
    std::vector<uint32_t> capped;
    for (auto size : r.chunk_sizes)
      for (uint32_t done = 0; done < size; done += st.cfg.score_chunk_tokens)
        capped.push_back(std::min(st.cfg.score_chunk_tokens, size - done));
    r.chunk_sizes = std::move(capped);
  }
  r.chunk_scores.assign(r.chunk_sizes.size(), {});
  r.num_chunks = static_cast<uint32_t>(r.chunk_sizes.size());
  r.tokens_left = todo;
  st.runnable.push(rid, r.order.batch_priority);
  pump(self);
  report_load(self);
}

/// Starts a prompt whose local pages are allocated: loads its cached prefix from the block
/// store first when CHECK found one, then computes the rest.
void launch(prefill_pointer self, waiting_order w, std::vector<uint32_t> pages, std::vector<store::block_key> keys,
            uint32_t shared_blocks) {
  auto& st = self->state;
  const auto rid = w.order.request_id;
  auto& r = st.requests[rid];
  r.promise = std::move(w.promise);
  r.local_pages = std::move(pages);
  r.keys = std::move(keys);
  r.shared_blocks = shared_blocks;
  if (shared_blocks) st.core.log->add({0, "prefix_local_hit", rid, shared_blocks, 0, {}, {}});
  const auto& local = st.core.exec->kv().layout();
  r.puts_done.assign(local.num_layers, 0);
  r.checksums.assign(local.num_layers, 0);
  r.announced.assign(local.num_layers, false);
  r.arrived_at = w.arrived_at;
  r.order = std::move(w.order);
  r.grammar = std::move(w.grammar);
  const auto& o = r.order;
  if (o.part_ranks.size() > 1) return launch_split(self, rid);
  const bool can_load = st.store.enabled() && st.core.pool_key && !o.prompt_logprobs && o.prefix.size() > shared_blocks &&
                        o.block_tokens > 0 && o.block_tokens % local.page_size_tokens == 0 &&
                        uint64_t{o.prefix.size()} * o.block_tokens < o.tokens.size();
  if (!can_load) return start_compute(self, rid, shared_blocks * st.store.block_tokens());
  start_prefix_load(self, rid, shared_blocks);
}

/// Leading blocks of a waiting prompt (its full-block `keys`, of which the first `hit` are in
/// the rank-local tier and at most `usable` may be shared) that a prompt computing on this rank
/// will add to the tier when it finishes, and that prompt's id; 0 blocks when none will.
///
/// Prompts that share a long prefix often arrive together (a burst of one agent's calls, one
/// system prompt fanned out): started at once, each computes the prefix. The rank runs one prompt
/// of a class at a time (pump), so a prompt of the same class behind the computing one would wait
/// for it anyway: waiting for it to finish costs its puts' last landing and saves the shared
/// blocks' compute. An interactive prompt does not wait on a batch one (it would overtake it), nor
/// on one whose pages will not join the tier (a quarantine: return_pages).
std::pair<size_t, uint64_t> shared_in_flight(const prefill_state& st, const std::vector<store::block_key>& keys,
                                             size_t hit, size_t usable, bool batch) {
  std::pair<size_t, uint64_t> best{0, 0};
  if (usable <= hit || !st.cfg.share_in_flight_prefix) return best;
  for (const auto& [id, r] : st.requests) {
    if (r.failed || r.split.active || r.load.late_writer || (r.order.batch_priority && !batch)) continue;
    // Chained keys: block b's key names every token up to it, so one equal key is an equal prefix.
    size_t n = hit;
    while (n < usable && n < r.keys.size() && r.keys[n] == keys[n]) ++n;
    if (n > hit && n > best.first) best = {n, id};
  }
  best.first = best.first > hit ? best.first - hit : 0;
  return best;
}

/// Starts waiting prompts, in priority order, while local KV pages last; then feeds the
/// executor. While a prompt waits, the keepalive tick renews its lease at the decode rank (a
/// lease otherwise lives only as long as progress: once computing, every landed layer renews it).
void drain_waiting(prefill_pointer self) {
  auto& st = self->state;
  auto& kv = st.core.exec->kv();
  refuse_waiting(self);
  // Prompts whose superseded attempt still winds down here (its sends, up to their timeout)
  // step aside for the ones behind them, and go back in front after: one used to hold up the
  // whole queue for seconds while pages were free.
  // They pass no one by stepping aside (pop(false): the batch bypass count stays).
  std::vector<waiting_order> held;
  // A class with a prompt waiting for a computing one's prefix starts no later prompt of it: they
  // would take its place in line (the rank runs a class's prompts in the order they start).
  bool class_held[2] = {false, false};
  while (const auto* w = st.waiting.peek()) {
    if (st.requests.count(w->order.request_id) || class_held[w->order.batch_priority]) {
      held.push_back(std::move(*st.waiting.pop(false)));
      continue;
    }
    const bool split = w->order.part_ranks.size() > 1;
    const auto len = split ? w->order.part_bounds.at(w->order.part_index + 1) : static_cast<uint32_t>(w->order.tokens.size());
    std::vector<store::block_key> keys;
    size_t hit = 0;
    std::vector<uint32_t> shared;
    if (st.local && !w->keys.empty()) {
      // The rank-local tier first: blocks already in our pages are shared, pinned, not copied.
      keys = w->keys;
      const size_t usable = (len - 1) / st.store.block_tokens();  // the last token is computed
      hit = std::min<size_t>(st.local->match(keys), usable);
      if (const auto [more, on] = shared_in_flight(st, keys, hit, usable, w->order.batch_priority); more > 0) {
        class_held[w->order.batch_priority] = true;
        held.push_back(std::move(*st.waiting.pop(false)));
        if (!std::exchange(held.back().waits_on_prefix, true))
          st.core.log->add({0, "prefix_wait", held.back().order.request_id, static_cast<uint32_t>(more), 0, {on}, {}});
        continue;
      }
      shared = st.local->acquire(keys, hit);
    }
    const auto fresh_needed = static_cast<uint32_t>(kv.pages_for_tokens(len) - shared.size());
    auto fresh = kv.kv_page_alloc(fresh_needed);
    if (!fresh && st.local) {  // make room from unpinned local blocks, oldest first
      kv.kv_page_free(st.local->evict(fresh_needed - std::min(fresh_needed, kv.num_free_pages())));
      fresh = kv.kv_page_alloc(fresh_needed);
    }
    if (!fresh) {
      if (st.local) st.local->release(keys, hit);
      break;
    }
    shared.insert(shared.end(), fresh->begin(), fresh->end());
    launch(self, std::move(*st.waiting.pop()), std::move(shared), std::move(keys), static_cast<uint32_t>(hit));
  }
  for (auto h = held.rbegin(); h != held.rend(); ++h) {
    const bool batch = h->order.batch_priority;
    st.waiting.push_front(std::move(*h), batch);
  }
  pump(self);
  report_load(self);
}

/// A started prompt that waits without a chunk in the executor (runnable behind other prompts),
/// or for its prefix from the store: either may take longer than a lease lives. A chunk that
/// computes renews the lease with its landed layers, so a hung executor lets it expire.
bool needs_keepalive(const prefill_state& st, const prefill_job_state& r) {
  if (r.order.prefill_only || r.failed || r.layers_ready >= st.core.exec->config().num_hidden_layers) return false;
  return r.load.outstanding > 0 || r.jobs_in_executor == 0;
}

/// Arms the keepalive tick while prompts wait or run, at a third of the shortest lease. A prompt
/// computing now counts too: its chunk may end with the next one queued behind other prompts'
/// (nothing renews it then), and no other event would arm the tick again.
void schedule_keepalive(prefill_pointer self) {
  auto& st = self->state;
  uint32_t lease_ms = UINT32_MAX;
  st.waiting.for_each([&](const waiting_order& w) {
    if (!w.order.prefill_only) lease_ms = std::min(lease_ms, w.order.grant.lease_ms);  // prefill-only: no lease
  });
  const uint32_t layers = st.core.exec->config().num_hidden_layers;
  for (const auto& [id, r] : st.requests)  // started, not every layer announced yet
    if (!r.order.prefill_only && !r.failed && r.layers_ready < layers) lease_ms = std::min(lease_ms, r.order.grant.lease_ms);
  if (st.keepalive_scheduled || lease_ms == UINT32_MAX) return;
  st.keepalive_scheduled = true;
  self->delayed_send(self, std::chrono::milliseconds{std::max<uint32_t>(1, lease_ms / 3)}, keepalive_atom::value);
}

/// A split order's parts (dynamic prefill split, seed 002): empty when they make sense, else
/// what does not.
std::string check_split(const prefill_order& o) {
  const size_t parts = o.part_ranks.size();
  if (parts <= 1) return {};
  const auto n = [](size_t x) { return std::to_string(x); };
  const auto& b = o.part_bounds;
  if (o.part_index >= parts) return "part_index " + n(o.part_index) + " is past the " + n(parts) + " parts";
  if (b.size() != parts + 1) return "part_bounds has " + n(b.size()) + " entries, " + n(parts) + " parts need " + n(parts + 1);
  if (o.part_names.size() != parts) return "part_names has " + n(o.part_names.size()) + " names for " + n(parts) + " parts";
  if (b.front() != 0 || b.back() != o.tokens.size())
    return "part_bounds run from " + n(b.front()) + " to " + n(b.back()) + ", not from 0 to the prompt's " +
           n(o.tokens.size()) + " tokens";
  for (size_t i = 0; i + 1 < b.size(); ++i)
    if (b[i] >= b[i + 1]) return "part_bounds do not increase: entry " + n(i) + " is " + n(b[i]) + ", the next " + n(b[i + 1]);
  for (size_t i = 0; i < parts; ++i)
    if (!o.part_ranks[i]) return "part_ranks[" + n(i) + "] (" + o.part_names[i] + ") is no actor";
  return {};
}

/// Checks an order and queues it; it starts as soon as local KV pages are free.
caf::result<prefill_result> accept_prefill(prefill_pointer self, prefill_order order) {
  auto& st = self->state;
  const auto rid = order.request_id;
  const auto stage = where(rid, st.cfg.name, "prefill");
  // On standby the executor's pool belongs to this instance's other role: a placement made
  // before the switch must go elsewhere.
  if (st.cfg.standby) return make_error(errc::rank_unavailable, stage + ": on standby (serving as decode)");
  // A failed setup, or an executor that can run nothing (a broken expert group): the request
  // is placed again elsewhere, and the balancer hears that this rank takes no work (a placement
  // made before it heard may still arrive).
  if (auto failure = st.core.unavailable(); !failure.empty()) {
    report_load(self);
    return make_error(errc::rank_unavailable, stage + ": " + failure);
  }
  auto grammar = st.core.follow_grammar(order.grammar, answer_so_far(order), stage);
  if (!grammar) return grammar.error();
  // The same request again: an earlier attempt of it, which its request actor has given up on
  // (it re-placed itself after losing its decode rank, say) and which may have landed here
  // again. The newer attempt supersedes it: a waiting one is dropped, a running one is stopped
  // and the new one waits until the executor is done with it.
  const std::string superseded = "superseded by a newer attempt of the request";
  if (auto old = st.waiting.take_if([&](const waiting_order& w) { return w.order.request_id == rid; }))
    refuse_order(self, *old, make_error(errc::rank_unavailable, stage + ": " + superseded));
  if (st.requests.count(rid) > 0) fail_request(self, rid, errc::rank_unavailable, "prefill", superseded);
  auto& kv = st.core.exec->kv();
  const auto& local = kv.layout();
  const auto& reg = order.grant.region;
  if (order.prefill_only && order.part_ranks.size() > 1)
    return make_error(errc::bad_request, stage + ": a prefill-only order is computed on one rank, not a split");
  if (!order.prefill_only && (reg.num_layers != local.num_layers || reg.page_size_tokens != local.page_size_tokens ||
      reg.kv_dim != local.kv_dim || reg.kv_planes != local.planes))
    return make_error(errc::layout_mismatch,
                      stage + ": decode rank " + order.grant.rank + " pages are " + std::to_string(reg.num_layers) +
                          " layers x " + std::to_string(reg.page_size_tokens) + " tokens x " +
                          std::to_string(reg.kv_planes) + " planes x " + std::to_string(reg.kv_dim) +
                          " values, this rank's are " + std::to_string(local.num_layers) + " x " +
                          std::to_string(local.page_size_tokens) + " x " + std::to_string(local.planes) + " x " +
                          std::to_string(local.kv_dim));
  const auto num_tokens = static_cast<uint32_t>(order.tokens.size());
  const uint32_t num_pages = kv.pages_for_tokens(num_tokens);
  if (num_tokens == 0) return make_error(errc::bad_request, stage + ": empty prompt");
  if (auto bad = check_split(order); !bad.empty()) return make_error(errc::bad_request, stage + ": " + bad);
  if (order.prompt_logprobs && order.part_ranks.size() > 1)
    return make_error(errc::bad_request, stage + ": prompt log-probabilities need the whole prompt on one rank, not a split");
  if (!order.prefill_only && order.grant.page_ids.size() < num_pages)
    return make_error(errc::layout_mismatch, stage + ": lease has " + std::to_string(order.grant.page_ids.size()) +
                                                 " pages, the prompt needs " + std::to_string(num_pages));
  if (num_pages > local.num_pages)
    return make_error(errc::kv_capacity, stage + ": the prompt needs " + std::to_string(num_pages) +
                                             " KV pages, this rank has " + std::to_string(local.num_pages) + " in all");
  auto promise = self->make_response_promise<prefill_result>();
  const bool batch = order.batch_priority;
  waiting_order w{std::move(order), promise, self->clock().now(), std::move(*grammar), {}, false};
  // A scored prompt computes every token; a split part's blocks are not the prompt's from its start.
  if (st.local && w.order.part_ranks.size() <= 1 && !w.order.prompt_logprobs)
    w.keys = store::chain_keys(st.salt, w.order.tokens, st.store.block_tokens());
  st.waiting.push(std::move(w), batch);
  drain_waiting(self);
  schedule_keepalive(self);
  return promise;
}

}  // namespace prefill_detail

namespace {

using namespace prefill_detail;

prefill_rank_actor::behavior_type prefill_rank_impl(prefill_pointer self, prefill_rank_config cfg,
                                                    std::shared_ptr<gpu::executor> exec,
                                                    std::shared_ptr<transport::transport> xport,
                                                    prefill_balancer_actor balancer, store_access store) {
  auto& st = self->state;
  st.store = std::move(store);
  // Reads go to the servers CHECK names; a store node adopted again serves them as a new actor.
  watch_store_servers(self);
  self->set_down_handler([=](caf::down_msg& dm) { store_server_went_down(self, dm.source); });
  if (st.store.keyed() && cfg.prefix_cache_blocks > 0 && st.store.block_tokens() % exec->kv().layout().page_size_tokens == 0) {
    st.local.emplace(st.store.block_tokens() / exec->kv().layout().page_size_tokens, cfg.prefix_cache_blocks);
    st.salt = store::salt_of(st.store.identity);
  }
  st.balancer = std::move(balancer);
  st.waiting = policies::priority_classes<waiting_order>{cfg.batch_max_bypass};
  st.runnable = policies::priority_classes<uint64_t>{cfg.batch_max_bypass};
  st.core.log->set_capacity(cfg.event_log_events);
  st.cfg = std::move(cfg);
  st.core.vocabulary = st.cfg.vocabulary;
  st.core.start(self, std::move(exec), std::move(xport));
  // A backend that settles transfers on its own thread (UCX) says so at once: the last layer's
  // send is then noticed when it lands, not at the next poll tick (the timer stays, for backends
  // that never call and for the send timeout).
  // One message however many transfers settle before the rank gets to it (each poll polls all).
  st.settled_flag = std::make_shared<std::atomic<bool>>(false);
  st.core.xport->set_settled_listener([h = self->address(), flag = st.settled_flag] {
    if (flag->exchange(true)) return;
    if (auto a = caf::actor_cast<caf::actor>(h)) caf::anon_send(a, settled_atom::value);
  });
  // An executor that can run nothing any more (a shard of its expert group gone, say) says so at
  // once, and again when it can run jobs again: the rank steps aside, or back, before a request
  // finds out. Weak: the executor outlives no actor.
  st.core.exec->on_health_change([addr = caf::actor_cast<caf::actor_addr>(self)] {
    if (auto me = caf::actor_cast<prefill_rank_actor>(addr)) caf::anon_send(me, health_atom::value);
  });
  report_load(self);  // registers this rank with its balancer
  return {
      [=](prefill_order& order) -> caf::result<prefill_result> {
        const auto decode = order.decode;
        const auto lease_id = order.grant.lease_id;
        const auto parts = order.part_ranks.size();
        // Accepted, it counts in the next report's queued work; refused, it never will: either
        // way the balancer's charge for it goes with that report.
        self->state.settled.push_back(order.request_id);
        auto r = accept_prefill(self, std::move(order));
        // Refused at once: it will post nothing (a split's decode lease counts its writers done).
        if (r.flag == caf::rt_error) {
          tell_writer_done(self, decode, lease_id, std::max<size_t>(1, parts));
          report_load(self);
        }
        return r;
      },
      [=](cancel_atom, uint64_t request_id, uint64_t lease_id) {
        // The request let go (its client hung up, it timed out, or it moved elsewhere): its KV
        // goes nowhere now. It stops, and once nothing of it is in flight its decode lease hears
        // that this writer is done.
        auto& s = self->state;
        const auto why = "the request let go of lease " + std::to_string(lease_id) + " (cancelled, or placed again)";
        const auto mine = [&](const prefill_order& o) { return o.request_id == request_id && o.grant.lease_id == lease_id; };
        if (auto w = s.waiting.take_if([&](const waiting_order& w) { return mine(w.order); })) {
          refuse_order(self, *w, make_error(errc::cancelled, where(request_id, s.cfg.name, "prefill") + ": " + why));
          return report_load(self);
        }
        if (auto i = s.requests.find(request_id); i != s.requests.end() && mine(i->second.order))
          fail_request(self, request_id, errc::cancelled, "prefill", why);
      },
      [=](health_atom) {
        // Waiting prompts go elsewhere (refuse_waiting), and the balancer hears that this rank
        // takes no work; or, once the failure cleared (or its node returned to the head after a
        // partition), that it does again.
        drain_waiting(self);
      },
      [=](stats_atom) {
        auto& s = self->state;
        const auto& kv = s.core.exec->kv();
        rank_stats r{s.cfg.name, kv.num_free_pages(), kv.layout().num_pages,
                     static_cast<uint32_t>(s.requests.size()), static_cast<uint32_t>(s.waiting.size()),
                     s.num_jobs_done};
        r.predicted_us = queued_work(s).second;
        r.active = !s.cfg.standby;
        r.unavailable = s.core.unavailable();
        return r;
      },
      [=](role_atom, bool active) -> caf::result<bool> {
        auto& s = self->state;
        // Held pages count: freed later by this actor, they must not meet the other role's
        // allocations in the shared pool (it has no lock: one actor owns it at a time).
        const size_t held = s.split_holds.size() + s.late_holds;
        const bool busy = !s.requests.empty() || s.waiting.size() > 0 || !s.job_to_request.empty() || held > 0;
        return change_role(
            active, s.cfg.name,
            busy ? std::to_string(s.requests.size() + s.waiting.size()) + " prompts, " + std::to_string(held) +
                       " held page sets"
                 : "",
            &s.cfg.standby, *s.core.log, [=] { report_load(self); },
            [=] {  // the executor's KV pool is about to serve the other role: give back the local tier
              auto& s = self->state;
              if (s.local) s.core.exec->kv().kv_page_free(s.local->evict(UINT64_MAX));
            });
      },
      [=](events_atom) { return self->state.core.log->snapshot(); },
      [=](exec_done_atom, uint64_t job_id, gpu::forward_output& out) {
        auto& s = self->state;
        const auto cj = take_job(self, job_id);
        if (!cj) return;
        pump(self);
        const auto rid = &cj->request_id;
        auto i = s.requests.find(*rid);
        if (i == s.requests.end()) return;
        auto& r = i->second;
        --r.jobs_in_executor;
        if (cj->attempt != r.attempt) return maybe_restart(self, *rid);  // an aborted attempt's chunk
        ++r.chunks_done;
        r.tokens_left -= std::min<uint64_t>(r.tokens_left, cj->tokens);
        if (r.order.prompt_logprobs && cj->chunk < r.chunk_scores.size() && !out.scores.empty())
          r.chunk_scores[cj->chunk] = std::move(out.scores[0]);
        if (r.chunks_done == r.num_chunks && !out.tokens.empty() && out.tokens[0] >= 0) {
          r.first_token = out.tokens[0];
          if (r.order.return_logits && !out.logits.empty()) r.logits = std::move(out.logits[0]);
          r.logprobs.clear();
          if (r.order.logprobs && !out.logprobs.empty()) r.logprobs.push_back(std::move(out.logprobs[0]));
          r.have_logits = true;
          s.core.log->add({0, "first_token", *rid, cj->attempt, 0, {}, {}});
        } else if (r.chunks_done == r.num_chunks && !r.split.earlier_part()) {
          // The prompt's last chunk must bring its first token: without one the request would
          // wait for ever (an executor fault, said so rather than hung).
          fail_request(self, *rid, errc::executor_failed, "prefill", "the last chunk returned no token");
        }
        finish_if_done(self, *rid);
      },
      [=](exec_fail_atom, uint64_t job_id, std::string& what) {
        const auto cj = take_job(self, job_id);
        if (!cj) return;
        if (auto i = self->state.requests.find(cj->request_id); i != self->state.requests.end()) {
          --i->second.jobs_in_executor;
          if (cj->attempt != i->second.attempt) {  // stopped at the gate of an aborted attempt
            maybe_restart(self, cj->request_id);
            pump(self);
            return;
          }
          ++i->second.chunks_done;
        }
        // When the executor can run nothing any more, the prompt fails over to another rank.
        const bool standing = !self->state.core.unavailable().empty();
        fail_request(self, cj->request_id, standing ? errc::rank_unavailable : errc::executor_failed, "prefill", what);
        finish_if_done(self, cj->request_id);
        pump(self);
      },
      [=](exec_start_atom, uint64_t job_id) {
        auto& s = self->state;
        auto j = s.job_to_request.find(job_id);
        if (j == s.job_to_request.end()) return;
        if (auto i = s.requests.find(j->second.request_id); i != s.requests.end())
          i->second.queue_us =
              std::chrono::duration_cast<std::chrono::microseconds>(self->clock().now() - i->second.arrived_at).count();
      },
      [=](timer_atom, uint64_t id) { self->state.core.runner->fire(id); },
      [=](store_layer_landed& ev) { on_layer_landed(self, ev); },
      [=](split_peer& p) { on_split_peer(self, std::move(p)); },
      [=](split_layer& ev) { on_split_layer(self, ev); },
      [=](split_abort& ev) { on_split_abort(self, ev); },
      [=](xfer_atom, uint64_t request_id, uint32_t layer, const std::string& why, uint32_t attempt) {
        // A layer could not take its wire form (a value that is not finite): nothing was posted.
        // The model made that KV; another attempt with the same weights makes it again.
        auto i = self->state.requests.find(request_id);
        if (i == self->state.requests.end() || i->second.attempt != attempt) return;
        fail_request(self, request_id, errc::executor_failed, "kv_encode", "layer " + std::to_string(layer) + ": " + why);
      },
      [=](xfer_atom, uint64_t request_id, uint32_t layer, uint64_t xfer_id, uint64_t checksum, uint32_t attempt) {
        pending_put p{request_id, layer, xfer_id, checksum, self->clock().now(), attempt};
        if (auto i = self->state.requests.find(request_id); i != self->state.requests.end() && !i->second.first_put_at)
          i->second.first_put_at = p.posted_at;
        if (settle(self, p)) return;
        track_put(self, p);
      },
      [=](keepalive_atom) {
        auto& s = self->state;
        s.keepalive_scheduled = false;
        s.waiting.for_each([&](const waiting_order& w) { renew_lease(self, w.order); });
        for (const auto& [id, r] : s.requests)
          if (needs_keepalive(s, r)) renew_lease(self, r.order);
        schedule_keepalive(self);
      },
      [=](settled_atom) {
        self->state.settled_flag->store(false);  // before polling: a transfer settling now sends again
        poll_pending(self);
      },
      [=](poll_atom) {
        auto& s = self->state;
        s.poll_scheduled = false;
        poll_pending(self);
        // Settling may have tracked a new put, which scheduled the next poll already: one chain only.
        if (!s.pending.empty() && !s.poll_scheduled) {
          s.poll_scheduled = true;
          self->delayed_send(self, std::chrono::microseconds{s.cfg.poll_interval_us}, poll_atom::value);
        }
      },
  };
}

}  // namespace

prefill_rank_actor spawn_prefill_rank(caf::actor_system& sys, prefill_rank_config cfg,
                                      std::shared_ptr<gpu::executor> exec,
                                      std::shared_ptr<transport::transport> xport,
                                      prefill_balancer_actor balancer, store_access store) {
  return sys.spawn(prefill_rank_impl, std::move(cfg), std::move(exec), std::move(xport), std::move(balancer),
                   std::move(store));
}

}  // namespace baton

#include "actors/request.hpp"
#include "actors/router.hpp"
#include "actors/request_state.hpp"

#include "actors/block_index.hpp"

#include <algorithm>
#include <limits>

#include <caf/actor_system.hpp>
#include <caf/sec.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "gpu/byte_tokenizer.hpp"
#include "policies/placement.hpp"
#include "policies/restart_backoff.hpp"

namespace baton {

using namespace request_detail;

namespace {


/// The lease id this attempt's prefill ranks know it by (prefill_order::grant), which a cancel
/// names: the decode lease's, or a prefill-only attempt's tag.
uint64_t writer_tag(const request_state& st) { return st.prefill_only ? prefill_only_tag(st.attempt) : st.lease_id; }

int64_t micros(caf::actor_clock::duration_type d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

/// Microseconds since the current stage started; starts the next stage.
int64_t lap(request_pointer self) {
  const auto now = self->clock().now();
  const auto us = micros(now - self->state.stage_started);
  self->state.stage_started = now;
  return us;
}


/// This attempt's prompt is scored (generate_request::prompt_logprobs): asked, and not yet
/// answered by an earlier attempt (a failover after the first token re-prefills unscored).
bool scores_prompt(const request_state& st) { return st.plan.params.prompt_logprobs && st.out.prompt_logprobs.empty(); }





/// Streaming: sends the sink the tokens and the text it has not seen yet. Before the end only
/// text that no later token can change is sent (streamable_prefix); the last chunk carries
/// the rest of the final text and the finish reason.
void stream(request_pointer self, bool last) {
  auto& st = self->state;
  if (!st.plan.sink) return;
  if (!last && st.emitted_tokens == st.out.tokens.size()) return;
  stream_chunk c;
  c.request_id = st.plan.request_id;
  c.request = caf::actor_cast<request_cancel_actor>(self);
  c.first_index = static_cast<uint32_t>(st.emitted_tokens);
  c.tokens.assign(st.out.tokens.begin() + static_cast<std::ptrdiff_t>(st.emitted_tokens), st.out.tokens.end());
  c.num_prompt_tokens = st.out.num_prompt_tokens;
  c.prompt_thinking = st.out.prompt_thinking;
  if (st.plan.params.echo && !std::exchange(st.echo_streamed, true)) {
    c.prompt_text = prompt_text(st);
    c.prompt_logprobs = st.out.prompt_logprobs;
  }
  const std::string& text = last ? st.out.text : st.text;
  const size_t end = last ? text.size() : streamable_prefix(text, st.plan.params.stop);
  if (end > st.emitted_text) {
    c.text = text.substr(st.emitted_text, end - st.emitted_text);
    st.emitted_text = end;
  }
  // Log-probabilities go with their text: with stop strings, an entry once its whole text is
  // sent (hits_stop has already cut those past a stop string); at the end, every one left.
  const size_t ready = last || st.plan.params.stop.empty() ? st.out.logprobs.size() : logprobs_ready(st, end);
  if (st.emitted_logprobs < ready)
    c.logprobs.assign(st.out.logprobs.begin() + static_cast<std::ptrdiff_t>(st.emitted_logprobs),
                      st.out.logprobs.begin() + static_cast<std::ptrdiff_t>(ready));
  st.emitted_logprobs = std::max(st.emitted_logprobs, ready);
  if (last) {
    c.finish_reason = st.out.finish_reason;
    c.stop_string = st.out.stop_string;
    c.stop_token = st.out.stop_token;
  }
  st.emitted_tokens = st.out.tokens.size();
  self->send(st.plan.sink, std::move(c));
}

/// Every prefill rank of this attempt: a split prompt's parts' ranks (each writes into the
/// lease, and the later parts wait for the earlier ones), else the one rank.
std::vector<std::pair<prefill_rank_actor, std::string>> prefill_ranks_of(const request_state& st) {
  std::vector<std::pair<prefill_rank_actor, std::string>> out;
  if (st.split.part_ranks.size() > 1) {
    for (size_t i = 0; i < st.split.part_ranks.size(); ++i)
      out.emplace_back(st.split.part_ranks[i], i < st.split.part_names.size() ? st.split.part_names[i] : st.prefill_name);
  } else if (st.prefill) {
    out.emplace_back(st.prefill, st.prefill_name);
  }
  return out;
}

/// Lets go of this attempt's lease; prefill ranks still at it are told to stop, and the decode
/// rank to keep the pages from other requests until they have.
void let_go(request_pointer self) {
  auto& st = self->state;
  const auto id = st.plan.request_id;
  // After the placement request (one sender, in order): the balancer finds it made or parked.
  if (st.decode_charged) self->send(st.plan.decode_balancer, release_atom::value, id, st.attempt);
  if (st.prefill_charged) self->send(st.plan.prefill_balancer, release_atom::value, id, st.attempt);
  st.decode_charged = st.prefill_charged = false;
  const bool writing = (st.num_writers_out > 0 || st.writer_abandoned) && !st.hybrid;
  if (st.lease_id != 0 && st.decode) self->send(st.decode, release_atom::value, st.lease_id, writing);
  // A reservation asked for and not yet answered (or answered after its timeout: CAF drops
  // that answer, and the rank would hold its pages until the lease expired and a quarantine
  // passed): the rank lets it go now. After the reserve (one sender, in order).
  if (st.reserving && st.decode) self->send(st.decode, cancel_atom::value, id);
  st.reserving = false;
  // Every part of a split prompt stops too (a later part keeps its pages from other prompts
  // until the earlier parts' puts into them are past: prefill_rank's return_pages).
  if (writing && writer_tag(st) != 0)
    for (const auto& [rank, name] : prefill_ranks_of(st))
      if (rank) self->send(rank, cancel_atom::value, st.plan.request_id, writer_tag(st));
  st.lease_id = 0;
  st.num_writers_out = 0;
}

/// A prefill rank answered this attempt's order (`err` if it failed). A rank answers only once
/// nothing of the order is in flight -- except a transfer failure, which may be a put abandoned
/// at its send timeout; and a timeout or a lost connection proves nothing.
void writer_answered(request_pointer self, const caf::error& err) {
  auto& st = self->state;
  const bool quiet = !err || (err.category() == caf::atom("baton") && static_cast<errc>(err.code()) != errc::transfer_failed);
  if (quiet && st.num_writers_out > 0) --st.num_writers_out;
}

/// A prefill rank's success: quiet, unless it gave up a put that may still land.
void writer_succeeded(request_pointer self, const prefill_result& r) {
  if (r.abandoned_put) {
    self->state.writer_abandoned = true;  // still counted as writing: a release says so
    return;
  }
  writer_answered(self, {});
}

/// Stops watching the attempt's ranks. A monitor lives on the watched actor until it ends: each
/// one left there kept a finished request's memory (its address holds the actor's storage) for
/// as long as the rank ran.
void stop_watching_ranks(request_pointer self) {
  auto& st = self->state;
  if (st.decode) self->demonitor(caf::actor_cast<caf::actor_addr>(st.decode));
  for (const auto& [rank, name] : prefill_ranks_of(st)) self->demonitor(caf::actor_cast<caf::actor_addr>(rank));
}

void answer(request_pointer self, caf::error err) {
  auto& st = self->state;
  if (st.answered) return;
  st.answered = true;
  let_go(self);
  stop_watching_ranks(self);
  if (err) {
    if (st.plan.counters && err.category() == caf::atom("baton") && err.code() < st.plan.counters->failed.size())
      ++st.plan.counters->failed[err.code()];
    st.promise.deliver(std::move(err));
  }
  else {
    if (!st.stopped) st.out.text = decode_text(st);
    if (st.plan.params.echo) st.out.prompt_text = prompt_text(st);
    stream(self, true);  // before the answer: one sender, so the sink sees it first
    st.promise.deliver(std::move(st.out));
  }
  if (st.reserves_out == 0) self->quit();  // else once the reservation is answered (reserve)
}

/// Turns a failed hop into an error that names request, rank and stage. Errors that ranks
/// produced already carry that context and pass through.
caf::error hop_error(request_pointer self, const caf::error& err, const std::string& rank, const std::string& stage,
                     uint32_t timeout_ms) {
  const auto id = self->state.plan.request_id;
  if (err.category() == caf::atom("baton")) return err;
  if (err == caf::sec::request_timeout)
    return make_error(errc::deadline_exceeded,
                      where(id, rank, stage) + ": no answer within " + std::to_string(timeout_ms) + " ms");
  if (err == caf::sec::request_receiver_down)
    return make_error(errc::rank_unavailable, where(id, rank, stage) + ": the actor is down");
  return make_error(errc::rank_unavailable, where(id, rank, stage) + ": " + self->system().render(err));
}

/// The decode deadline: the next token must come within token_timeout_ms of the last one.
void arm_watchdog(request_pointer self) {
  auto& st = self->state;
  st.watch_from = self->clock().now();
  // One timer at a time, which waits out the rest when it fires early: a delayed message per
  // token held the request actor and the message for the whole timeout (thousands of each in
  // flight for a long answer, and every finished request kept for token_timeout_ms).
  if (st.watch_armed_seq == st.watch_seq) return;
  st.watch_armed_seq = st.watch_seq;
  self->delayed_send(self, std::chrono::milliseconds{st.plan.cfg.token_timeout_ms}, watchdog_atom::value, st.watch_seq);
}


void record_token(request_pointer self, int32_t token, std::vector<float> logits,
                  std::vector<gpu::token_logprobs> logprobs) {
  auto& st = self->state;
  const auto now = self->clock().now();
  if (st.out.tokens.empty())
    st.out.ttft_us = micros(now - st.started);
  else
    st.out.tbt_us.push_back(micros(now - st.last_token_at));
  st.last_token_at = now;
  st.out.tokens.push_back(token);
  if (st.plan.params.return_logits) st.out.step_logits.push_back(std::move(logits));
  if (st.plan.params.logprobs) {
    // A rank that sent none (it cannot: orders ask) would leave a gap: -inf says it honestly.
    auto lp = logprobs.empty() ? gpu::token_logprobs{-std::numeric_limits<float>::infinity(), {}, {}} : std::move(logprobs[0]);
    token_logprob t{token, lp.logprob, token_text(st, token), std::move(lp.top_tokens), std::move(lp.top_logprobs), {}, lp.rank};
    for (auto id : t.top_tokens) t.top_texts.push_back(token_text(st, id));
    st.out.logprobs.push_back(std::move(t));
  }
}

/// The prompt's tokens, each with its log-probability given those before it (the first has
/// none: NaN), from the prefill rank's scores (prefill_result::prompt_logprobs).
void record_prompt_logprobs(request_pointer self, std::vector<gpu::token_logprobs> scores) {
  auto& st = self->state;
  const auto& prompt = st.plan.prompt_tokens;
  auto& out = st.out.prompt_logprobs;
  out.clear();
  // A special token the prompt's text writes (`<|bos|>`) reads as that text, so that the tokens'
  // texts join back into the prompt an echo shows, and text_offset counts it; one the tokenizer
  // added (a begin-of-text the text does not write) stays empty.
  const std::string& written = st.plan.params.prompt;
  size_t at = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    token_logprob t{prompt[i], std::numeric_limits<float>::quiet_NaN(), token_text(st, prompt[i]), {}, {}, {}};
    if (t.text.empty() && st.plan.tokenizer && !written.empty())
      if (auto special = st.plan.tokenizer->special_text(prompt[i]);
          !special.empty() && at <= written.size() && written.compare(at, special.size(), special) == 0)
        t.text = std::move(special);
    at += t.text.size();
    if (i > 0 && i - 1 < scores.size()) {
      auto& s = scores[i - 1];
      t.logprob = s.logprob;
      t.top_tokens = std::move(s.top_tokens);
      t.top_logprobs = std::move(s.top_logprobs);
      t.rank = s.rank;
      for (auto id : t.top_tokens) t.top_texts.push_back(token_text(st, id));
    }
    out.push_back(std::move(t));
  }
}

void check(request_pointer self);
void place(request_pointer self);
void retry(request_pointer self);

/// The last of several attempts says so, how long they all took (its own sentence bounds only
/// itself, "within 4500 ms", while the client waited through every one), and what made the
/// request fail over, first and last: a trial saw a stream whose decode rank was killed fail
/// with only the last attempt's sentence, naming neither the dead rank nor the failover, and a
/// re-trial one whose last failover was only a placement that found no rank.
/// `early`: the attempts end before max_attempts (a KV queue wait that found no room is not
/// tried again).
caf::error last_attempt_error(request_pointer self, caf::error err, bool early = false) {
  auto& st = self->state;
  if (st.attempt == 0 || err.category() != caf::atom("baton") || !err.context().match_elements<std::string>())
    return err;
  std::string why = " ms after the request arrived; it failed over " + std::to_string(st.out.failovers) +
                    " time(s), first after: " + st.first_failover;
  if (st.out.failovers > 1 && st.last_failover != st.first_failover) why += "; the last after: " + st.last_failover;
  return make_error(static_cast<errc>(err.code()),
                    err.context().get_as<std::string>(0) + " (attempt " + std::to_string(st.attempt + 1) +
                        (early ? ", the last: a wait for KV room is not tried again"
                               : " of " + std::to_string(st.plan.cfg.max_attempts)) +
                        ", " + std::to_string(micros(self->clock().now() - st.started) / 1000) + why + ")");
}

/// A failed attempt: re-placed from the start (CHECK, placement, lease, prefill of the prompt plus
/// the tokens generated so far) while the failure is retryable and attempts are left; the
/// request's error otherwise. Answers of the failed attempt that still arrive are ignored.
void fail_or_retry(request_pointer self, caf::error err) {
  auto& st = self->state;
  if (st.answered) return;
  const int32_t done = static_cast<int32_t>(st.out.tokens.size());
  // A sequence whose last token is <eos> ended, only its summary went missing (a link that
  // dropped between the two, a rank gone right after its last step): the request is complete,
  // whatever the failure; a retry would generate past it. Said first, as the ranks say "eos"
  // for an <eos> that is also the last token max_tokens allows.
  if (done > 0 && st.out.tokens.back() == st.plan.eos_token_id && !st.plan.params.ignore_eos) {
    st.out.finish_reason = "eos";
    return answer(self, caf::error{});
  }
  // Likewise every token is here.
  if (done >= st.plan.params.max_tokens) {
    st.out.finish_reason = "length";
    return answer(self, caf::error{});
  }
  const bool retryable = err.category() == caf::atom("baton") && is_retryable(static_cast<errc>(err.code()));
  const auto now = self->clock().now();
  if (!retryable || st.attempt + 1 >= st.plan.cfg.max_attempts) return answer(self, last_attempt_error(self, std::move(err)));
  st.out.failed_attempts_us += micros(now - st.attempt_started);
  let_go(self);
  stop_watching_ranks(self);
  ++st.attempt;
  ++st.watch_seq;  // the old attempt's watchdog is void
  st.out.failovers += 1;
  if (st.plan.counters) ++st.plan.counters->failovers;
  st.out.failover_why = self->system().render(err);
  // The sentence itself (a retryable error is Baton's, its context the sentence).
  st.last_failover = err.context().match_elements<std::string>() ? err.context().get_as<std::string>(0) : st.out.failover_why;
  if (st.out.failovers == 1) st.first_failover = st.last_failover;
  st.prompt = st.plan.prompt_tokens;
  st.prompt.insert(st.prompt.end(), st.out.tokens.begin(), st.out.tokens.end());
  st.decode_fed = 0;
  st.max_new = st.plan.params.max_tokens - done;
  st.prefix.clear();
  st.block_keys.clear();
  st.split = {};
  st.writer_abandoned = false;
  st.hybrid = false;
  st.prefill_only = false;
  st.cached_blocks = 0;
  st.prefill = prefill_rank_actor{};
  st.decode = decode_rank_actor{};
  st.prefill_name.clear();
  st.decode_name.clear();
  const uint32_t pause = policies::retry_backoff{st.plan.cfg.retry_backoff_ms}.delay_ms(st.attempt, st.plan.request_id);
  st.out.retry_wait_us += int64_t{pause} * 1000;
  if (pause > 0) return self->delayed_send(self, std::chrono::milliseconds{pause}, timer_atom::value, uint64_t{st.attempt});
  retry(self);
}

/// Places the request again (after fail_or_retry's pause).
void retry(request_pointer self) {
  auto& st = self->state;
  st.stage_started = st.attempt_started = self->clock().now();
  if (st.plan.store.keyed())
    check(self);
  else
    place(self);
}

/// True when an answer belongs to an earlier attempt (or the request is over): drop it.
bool stale(request_pointer self, uint32_t attempt) { return self->state.answered || attempt != self->state.attempt; }

/// Ranks were lost (down, or their node declared gone): the request moves if it still depends on
/// one of them -- the decode rank always, the prefill rank until this attempt's first token.
/// `prefill_lost`: the name of the lost prefill rank of this attempt (a split prompt's part may
/// be any of its parts' ranks), or empty.
void on_ranks_lost(request_pointer self, bool decode_lost, const std::string& prefill_lost, const std::string& why) {
  auto& st = self->state;
  if (st.answered) return;
  const bool prefilling = st.out.tokens.size() + static_cast<size_t>(st.max_new) ==
                          static_cast<size_t>(st.plan.params.max_tokens);
  const auto id = st.plan.request_id;
  // The stage it was at on that rank: its KV reservation, its prompt (hybrid PD) or the prompt's
  // KV arriving from the prefill rank, or decoding.
  const char* decode_stage = st.reserving ? "kv_reserve" : prefilling ? (st.hybrid ? "prefill" : "kv_recv") : "decode";
  if (decode_lost)
    fail_or_retry(self, make_error(errc::rank_unavailable, where(id, st.decode_name, decode_stage) + ": " + why));
  else if (!prefill_lost.empty() && prefilling)
    fail_or_retry(self, make_error(errc::rank_unavailable, where(id, prefill_lost, "prefill") + ": " + why));
}

/// The prompt and every token fed to decode steps so far (all generated tokens but the last):
/// what the penalties count and a write-back keys, wherever the sequence runs.
std::vector<int32_t> fed_sequence(const request_state& st) {
  std::vector<int32_t> seq = st.prompt;  // after a failover it already holds the earlier output
  seq.insert(seq.end(), st.out.tokens.end() - 1 - st.decode_fed, st.out.tokens.end() - 1);
  return seq;
}

void start_decode(request_pointer self) {
  auto& st = self->state;
  const auto& p = st.plan;
  const uint32_t attempt = st.attempt;
  // After a migration (elastic drain) the order continues the sequence: decode_fed tokens of
  // this attempt were fed at earlier ranks, whose KV for them moved with the rest.
  const uint32_t fed = st.decode_fed;
  decode_order order{p.request_id,
                     st.lease_id,
                     st.out.tokens.back(),  // this attempt's first token (or, moved, the next input)
                     static_cast<uint32_t>(st.prompt.size()) + fed,
                     static_cast<uint32_t>(st.max_new - 1) - fed,
                     p.params.temperature,
                     p.params.seed,
                     p.params.return_logits,
                     p.params.ignore_eos,
                     self};
  // The sequence so far goes with every order: for write-back, the penalties' history, a
  // grammar's answer so far, and speculative decoding's lookups (4 bytes a token, against the
  // KV's hundreds of kilobytes).
  order.prompt_tokens = fed_sequence(st);
  // Write-back: the decode rank stores the sequence's full blocks when it finishes, unless the
  // request's class is not kept at all.
  if (p.store.enabled()) {
    if (auto cls = store::parse_retention(p.params.traffic_class); cls && p.store.retention.ttl_s(*cls) > 0) {
      order.traffic_class = p.params.traffic_class;
      order.cached_blocks = st.cached_blocks;
      order.write_back = true;
    }
  }
  copy_sampling(p, order);
  order.writer_abandoned = st.writer_abandoned;
  arm_watchdog(self);
  // No deadline on the whole generation: the watchdog bounds each token instead.
  self->request(st.decode, caf::infinite, std::move(order))
      .then(
          [=](const decode_summary& s) {
            if (stale(self, attempt)) {
              // Moved while this attempt was being given up (a watchdog, a cancel): the lease the
              // sequence moved into is nobody's; let it go now rather than at its expiry.
              if (s.finish_reason == "migrated" && s.moved_to)
                self->send(caf::actor_cast<decode_rank_actor>(s.moved_to), release_atom::value, s.moved_lease, false);
              return;
            }
            auto& st = self->state;
            if (s.finish_reason == "migrated" && s.moved_to) {
              // The rank drained: the sequence's KV sits in another rank's lease. Continue there.
              self->demonitor(caf::actor_cast<caf::actor_addr>(st.decode));
              st.decode = caf::actor_cast<decode_rank_actor>(s.moved_to);
              st.decode_name = s.moved_rank;
              st.out.decode_rank = s.moved_rank;
              st.lease_id = s.moved_lease;
              // A put the prefill writer gave up could land only in the source's pages, which
              // the source quarantines: the target's lease was written by the move alone, and
              // no prefill writer of this attempt may still put into it.
              st.writer_abandoned = false;
              st.num_writers_out = 0;
              st.decode_fed += s.num_tokens;
              self->monitor(st.decode);
              ++st.out.migrations;
              return start_decode(self);
            }
            st.lease_id = 0;  // the decode rank freed it
            st.out.finish_reason = s.finish_reason;
            st.out.decode_queue_us = s.queue_us;
            answer(self, caf::error{});
          },
          [=](caf::error& err) {
            if (!stale(self, attempt)) fail_or_retry(self, hop_error(self, err, self->state.decode_name, "decode", 0));
          });
}

void on_prefill_result(request_pointer self, prefill_result& r) {
  auto& st = self->state;
  st.out.prefill_us = lap(self);
  st.out.prefill_queue_us = r.queue_us;
  // What the client's usage reports: of its prompt's tokens, as its first prefill found them. A
  // retry after tokens came re-prefills the prompt and those tokens, and finds blocks another
  // request wrote back since: counted, a failover turned a computed prompt into a cached one (a
  // trial's hit ratio rose with every failover), and before the clamp to the prompt, cached
  // tokens outnumbered the prompt's.
  if (st.out.tokens.empty()) {
    st.out.cached_tokens = std::min(r.cached_tokens, st.out.num_prompt_tokens);
    st.out.local_cached_tokens = std::min(r.local_cached_tokens, st.out.cached_tokens);
  }
  st.out.recomputed_blocks = r.recomputed_blocks;
  st.out.kv_bytes = st.hybrid ? 0 : r.kv_bytes;
  st.out.kv_send_us = st.hybrid ? 0 : r.kv_send_us;
  // Blocks the write-back may skip: those the store has. The prompt's cached tokens also count
  // blocks the prefill rank kept in its own tier, which the store may lack (a batch-class prompt
  // is never written back, yet its blocks stay on the rank): those must be written, or the
  // store's chain would have a gap that CHECK never gets past.
  if (st.plan.store.enabled())
    st.cached_blocks = std::min<uint32_t>(r.cached_tokens / st.plan.store.block_tokens(),
                                          static_cast<uint32_t>(st.prefix.size()));
  if (scores_prompt(st)) record_prompt_logprobs(self, std::move(r.prompt_logprobs));
  record_token(self, r.first_token, std::move(r.logits), std::move(r.logprobs));
  const bool eos = r.first_token == st.plan.eos_token_id && !st.plan.params.ignore_eos;
  st.stopped = hits_stop(st, r.first_token);
  if (eos || st.stopped || st.max_new == 1) {
    st.out.finish_reason = st.eos_hit || eos ? "eos" : st.stopped ? "stop" : "length";
    answer(self, caf::error{});  // releases the unused lease
    return;
  }
  stream(self, false);
  start_decode(self);
}

/// Dynamic prefill split: every part's rank gets the order with its part; the last part's
/// answer carries the first token; any part's failure fails the request.
void start_split_prefill(request_pointer self, prefill_order order) {
  auto& st = self->state;
  const auto& sp = st.split;
  order.prefix.clear();
  order.part_bounds = sp.part_bounds;
  for (const auto& r : sp.part_ranks) order.part_ranks.push_back(caf::actor_cast<caf::actor>(r));
  order.part_names = sp.part_names;
  auto left = std::make_shared<size_t>(sp.part_ranks.size());
  st.num_writers_out = static_cast<uint32_t>(sp.part_ranks.size());
  auto last = std::make_shared<prefill_result>();
  const uint32_t attempt = st.attempt;
  for (uint32_t i = 0; i < sp.part_ranks.size(); ++i) {
    auto o = order;
    o.part_index = i;
    const bool is_last = i + 1 == sp.part_ranks.size();
    const std::string name = sp.part_names[i];
    self->request(sp.part_ranks[i], std::chrono::milliseconds{st.plan.cfg.prefill_timeout_ms}, std::move(o))
        .then(
            [=](prefill_result& r) {
              if (stale(self, attempt)) return;
              writer_succeeded(self, r);
              if (is_last) *last = std::move(r);
              if (--*left == 0) on_prefill_result(self, *last);
            },
            [=](caf::error& err) {
              if (stale(self, attempt)) return;
              writer_answered(self, err);
              fail_or_retry(self, hop_error(self, err, name, "prefill", self->state.plan.cfg.prefill_timeout_ms));
            });
  }
}

void start_prefill(request_pointer self, kv_lease_grant grant) {
  auto& st = self->state;
  auto& p = st.plan;
  st.out.reserve_us = lap(self);
  const uint32_t attempt = st.attempt;
  prefill_order order{p.request_id,      st.prompt,                 p.params.temperature,
                      p.params.seed,     p.params.return_logits,    p.params.priority == "batch",
                      std::move(grant),  st.decode};
  if (!st.hybrid) {
    order.prefix = st.prefix;
    order.block_tokens = p.store.block_tokens();
  }
  copy_sampling(p, order);
  order.prompt_logprobs = scores_prompt(st);
  order.prompt_top_logprobs = p.params.prompt_top_logprobs;
  order.prefill_only = st.prefill_only;
  st.prefill_charged = false;  // each prefill rank settles its placement on the order
  if (!st.hybrid && st.split.part_ranks.size() > 1) return start_split_prefill(self, std::move(order));
  st.num_writers_out = st.hybrid ? 0 : 1;  // hybrid: the decode rank writes its own pages
  auto pending = st.hybrid ? self->request(st.decode, std::chrono::milliseconds{p.cfg.prefill_timeout_ms}, std::move(order))
                           : self->request(st.prefill, std::chrono::milliseconds{p.cfg.prefill_timeout_ms}, std::move(order));
  std::move(pending).then(
          [=](prefill_result& r) {
            if (stale(self, attempt)) return;
            writer_succeeded(self, r);
            on_prefill_result(self, r);
          },
          [=](caf::error& err) {
            if (stale(self, attempt)) return;
            writer_answered(self, err);
            auto& st = self->state;
            fail_or_retry(self, hop_error(self, err, st.prefill_name, "prefill", st.plan.cfg.prefill_timeout_ms));
          });
}

void reserve(request_pointer self) {
  auto& st = self->state;
  const auto& p = st.plan;
  st.out.place_us = lap(self);
  st.out.prefill_rank = st.prefill_name;
  st.out.decode_rank = st.decode_name;
  // A prompt-only call's one token is never fed back: no slot for it (the prompt may fill the context).
  const uint32_t unfed = p.params.prompt_only && st.max_new == 1 ? 1 : 0;
  kv_lease_reserve req{p.request_id, static_cast<uint32_t>(st.prompt.size() + st.max_new - unfed), p.cfg.lease_ms,
                       static_cast<uint32_t>(st.prompt.size()),
                       static_cast<uint8_t>(p.cfg.kv_wire.for_class(p.params.traffic_class))};
  const uint32_t attempt = st.attempt;
  // Watched from here on: a decode rank (or prefill rank) that goes down re-places the request.
  self->monitor(st.decode);
  for (const auto& [rank, name] : prefill_ranks_of(st)) self->monitor(rank);
  st.decode_charged = false;  // the rank settles its placement on the reservation, granted or not
  ++st.reserves_out;
  st.reserving = true;
  // An answered request waited only for this: it goes now.
  const auto settle = [=] {
    if (--self->state.reserves_out == 0 && self->state.answered) self->quit();
  };
  self->request(st.decode, std::chrono::milliseconds{p.cfg.reserve_timeout_ms}, reserve_atom::value, req)
      .then(
          [=](kv_lease_grant& grant) {
            if (stale(self, attempt)) {  // too late: give the pages back
              self->send(caf::actor_cast<decode_rank_actor>(self->current_sender()), release_atom::value, grant.lease_id,
                         false);  // nobody was told to write into it
              return settle();
            }
            settle();
            self->state.reserving = false;
            self->state.lease_id = grant.lease_id;
            start_prefill(self, std::move(grant));
          },
          [=](caf::error& err) {
            settle();
            if (stale(self, attempt)) return;
            auto& st = self->state;
            // A timeout proves nothing: the grant may be on its way, and let_go tells the rank.
            if (err != caf::sec::request_timeout) st.reserving = false;
            fail_or_retry(self, hop_error(self, err, st.decode_name, "kv_reserve", st.plan.cfg.reserve_timeout_ms));
          });
}

/// A prefill-only attempt (prefill_order::prefill_only): no decode lease; the order's grant
/// holds no pages and carries the attempt's tag.
void start_prefill_only(request_pointer self) {
  auto& st = self->state;
  st.out.place_us = lap(self);
  st.out.prefill_rank = st.prefill_name;
  // A first attempt has no decode rank; a failover for the last token keeps the one that
  // generated the others (placement's reasons name it too).
  if (st.out.tokens.empty()) st.out.decode_rank.clear();
  self->monitor(st.prefill);  // a prefill rank that goes down re-places the request
  kv_lease_grant none;
  none.request_id = st.plan.request_id;
  none.lease_id = prefill_only_tag(st.attempt);
  start_prefill(self, std::move(none));
}

/// Asks the prefill balancer for this attempt's prefill rank (or a split's ranks), then
/// reserves the decode lease -- or, prefill-only, starts at once.
void place_prefill(request_pointer self, const place_query& q) {
  const uint32_t attempt = self->state.attempt;
  self->state.prefill_charged = true;
  self->request(self->state.plan.prefill_balancer, std::chrono::milliseconds{self->state.plan.cfg.place_timeout_ms},
                place_atom::value, q)
      .then(
          [=](prefill_placement& pp) {
            if (stale(self, attempt)) return;
            auto& st = self->state;
            st.prefill_name = pp.name;
            st.prefill = pp.rank;
            st.out.prefill_placement_why = std::move(pp.why);
            st.split = std::move(pp);
            if (st.prefill_only) return start_prefill_only(self);
            reserve(self);
          },
          [=](caf::error& err) {
            if (stale(self, attempt)) return;
            fail_or_retry(self, hop_error(self, err, "prefill_balancer", "place_prefill", self->state.plan.cfg.place_timeout_ms));
          });
}

void place(request_pointer self) {
  auto& st = self->state;
  const auto& p = st.plan;
  const auto cached = static_cast<uint32_t>(st.prefix.size() * p.store.block_tokens());
  place_query q{p.request_id, static_cast<uint32_t>(st.prompt.size()) - cached, cached,
                static_cast<uint32_t>(st.prompt.size() + st.max_new), p.params.priority,
                st.block_keys, p.store.block_tokens(), p.cfg.place_timeout_ms, scores_prompt(st), st.attempt};
  // The queue: the decode balancer parks the placement, in arrival order, until a rank has
  // room, for what is left of queue_timeout_ms after the request's earlier placements' waits (a
  // re-placement after a failure at least place_timeout_ms, or the whole queue time if that is
  // shorter). The prefill balancer's wait stays place_timeout_ms: its ranks queue prompts
  // themselves.
  const int64_t least = st.attempt > 0 ? std::min(p.cfg.place_timeout_ms, p.cfg.queue_timeout_ms) : 1;
  const auto decode_wait_ms =
      static_cast<uint32_t>(std::max<int64_t>(least, int64_t{p.cfg.queue_timeout_ms} - st.queued_us / 1000));
  const auto asked = self->clock().now();
  // Seed 002, hybrid PD: a short prompt is cheaper to prefill where it decodes than to ship
  // (a scored prompt is computed on a prefill rank, which scores).
  const bool hybrid = !scores_prompt(st) && policies::prefill_on_decode_rank(st.prompt.size(), p.cfg.hybrid_prefill_below_tokens);
  // One token to generate: the prefill picks it, and a decode rank would only receive KV to
  // drop. The prompt is computed on one rank (a split's parts hand their KV to the last part,
  // which ships it on; with nowhere to ship it the split buys nothing here).
  st.prefill_only = p.cfg.single_token_prefill_only && st.max_new == 1 && !hybrid;
  if (st.prefill_only) {
    q.whole_prompt = true;
    return place_prefill(self, q);
  }
  const uint32_t attempt = st.attempt;
  st.decode_charged = true;
  auto decode_q = q;
  decode_q.wait_ms = decode_wait_ms;
  self->request(p.decode_balancer, std::chrono::milliseconds{decode_wait_ms}, place_atom::value, std::move(decode_q))
      .then(
          [=](decode_placement& d) {
            self->state.queued_us += micros(self->clock().now() - asked);
            if (stale(self, attempt)) return;
            auto& st = self->state;
            st.decode_name = d.name;
            st.decode = d.rank;
            st.out.decode_placement_why = std::move(d.why);
            if (hybrid) {  // no prefill rank is involved
              st.hybrid = true;
              st.prefill_name = d.name;
              st.out.prefill_placement_why = "hybrid PD: " + std::to_string(st.prompt.size()) + " < " +
                                             std::to_string(st.plan.cfg.hybrid_prefill_below_tokens) +
                                             " tokens, prefilled on the decode rank";
              return reserve(self);
            }
            place_prefill(self, q);
          },
          [=](caf::error& err) {
            self->state.queued_us += micros(self->clock().now() - asked);
            if (stale(self, attempt)) return;
            // No rank had room while it waited out its queue time: another attempt would only
            // wait again.
            if (err.category() == caf::atom("baton") && static_cast<errc>(err.code()) == errc::kv_capacity)
              return answer(self, last_attempt_error(self, std::move(err), /*early*/ true));
            fail_or_retry(self, hop_error(self, err, "decode_balancer", "place_decode", decode_wait_ms));
          });
}

/// CHECK (seed 000 §2.2): the prompt's key chain against the store's index, metadata only. At
/// least one prompt token is always computed (its logits give the first token), so the last
/// block counts only if a token follows it. An unanswered CHECK is a miss, never a failure.
void check(request_pointer self) {
  auto& st = self->state;
  const auto& p = st.plan;
  const uint32_t b = p.store.block_tokens();
  const size_t usable = st.prompt.empty() ? 0 : (st.prompt.size() - 1) / b;
  auto keys = store::chain_keys(store::salt_of(p.store.identity), st.prompt, b);
  for (const auto& k : keys) st.block_keys.insert(st.block_keys.end(), {k.hi, k.lo});
  keys.resize(std::min(keys.size(), usable));
  // No index, or a scored prompt (computed whole): keys for the balancer only.
  if (keys.empty() || p.store.index.empty() || scores_prompt(st)) return place(self);
  // Each index shard is asked for its own keys, in parallel; the cached prefix is the leading
  // run of keys that some shard holds. A shard that does not answer holds nothing.
  const auto shards = static_cast<uint32_t>(p.store.index.size());
  auto found = std::make_shared<std::vector<block_ref>>(keys.size());
  auto outstanding = std::make_shared<uint32_t>(0);
  std::vector<std::vector<block_ref>> asks(shards);
  std::vector<std::vector<size_t>> positions(shards);
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto s = shard_of(keys[i], shards);
    asks[s].push_back({keys[i].hi, keys[i].lo, {}});
    positions[s].push_back(i);
  }
  const uint32_t attempt = st.attempt;
  auto finish = [=] {
    if (stale(self, attempt)) return;
    auto& st = self->state;
    st.out.check_us = lap(self);
    for (auto& b : *found) {
      if (b.servers.empty()) break;
      st.prefix.push_back(std::move(b));
    }
    place(self);
  };
  for (uint32_t s = 0; s < shards; ++s) {
    if (asks[s].empty()) continue;
    ++*outstanding;
    const auto pos = positions[s];
    self->request(p.store.index[s], std::chrono::milliseconds{p.store.read_timeout_ms}, check_atom::value,
                  p.request_id, std::move(asks[s]))
        .then(
            [=](std::vector<block_ref>& answer) {
              for (size_t k = 0; k < answer.size() && k < pos.size(); ++k) (*found)[pos[k]] = std::move(answer[k]);
              if (--*outstanding == 0) finish();
            },
            [=](caf::error&) {
              if (--*outstanding == 0) finish();
            });
  }
}

request_actor::behavior_type request_impl(request_pointer self, request_plan plan) {
  self->state.plan = std::move(plan);
  return {
      [=](run_atom) {
        auto& st = self->state;
        // Run once: a second run would replace the promise its first caller waits on.
        if (st.promise.pending() || st.answered) {
          auto again = self->make_response_promise<completion>();
          again.deliver(make_error(errc::bad_request, where(st.plan.request_id, "", "run") + ": the request is already running"));
          return again;
        }
        st.promise = self->make_response_promise<completion>();
        if (st.plan.admit) {
          const auto a = std::move(*st.plan.admit);
          st.plan.admit.reset();
          if (auto why = tokenize_and_validate(st.plan.params, *a.model, a.max_new_tokens_limit, &st.plan.prompt_tokens,
                                               st.plan.tokenizer.get(), a.default_max_tokens, &st.plan.prompt_thinking);
              !why.empty()) {
            auto err = make_error(errc::bad_request, where(st.plan.request_id, "", "admission") + ": " + why);
            st.answered = true;
            st.promise.deliver(err);
            self->quit(std::move(err));
            return st.promise;
          }
          if (st.plan.counters) ++st.plan.counters->admitted;
        }
        st.started = st.stage_started = st.attempt_started = self->clock().now();
        st.out.request_id = st.plan.request_id;
        st.out.num_prompt_tokens = static_cast<uint32_t>(st.plan.prompt_tokens.size());
        st.out.prompt_thinking = st.plan.prompt_thinking;
        st.prompt = st.plan.prompt_tokens;
        st.max_new = st.plan.params.max_tokens;
        // A client that goes away (its process, its connection) cancels its request; a rank of
        // this attempt that goes down (its process died, its node was cut off) re-places it.
        if (st.plan.sink) self->monitor(st.plan.sink);
        self->set_down_handler([=](caf::down_msg& dm) {
          auto& st = self->state;
          if (st.plan.sink && dm.source == caf::actor_cast<caf::actor_addr>(st.plan.sink))
            return answer(self, make_error(errc::cancelled, where(st.plan.request_id, "", "stream") +
                                                                ": the client went away"));
          std::string prefill_down;
          for (const auto& [rank, name] : prefill_ranks_of(st))
            if (dm.source == caf::actor_cast<caf::actor_addr>(rank)) prefill_down = name;
          // (A down message does not prove that nothing of it lands: a cut link says the same.
          // The decode rank's quarantine limit covers a writer that never says it is done.)
          on_ranks_lost(self, st.decode && dm.source == caf::actor_cast<caf::actor_addr>(st.decode), prefill_down,
                        "the rank went down (" + self->system().render(dm.reason) + ")");
        });
        // The router stops (its process ends, at once or when a drain's time runs out) and stops
        // its requests: the client hears why, and the attempt's ranks let go now -- a remote
        // prefill rank would compute for nobody, a lease wait out its time.
        self->set_exit_handler([=](caf::exit_msg& m) {
          if (!m.reason) return;  // a linked actor's normal end (none is linked): as CAF's default
          answer(self, make_error(errc::shutting_down, where(self->state.plan.request_id, "", "router") +
                                                           ": the router stopped before the answer"));
          self->quit(m.reason);
        });
        // As a retry does (restart()): keyed for the local tiers too, or cache_affinity routes blind.
        if (st.plan.store.keyed())
          check(self);
        else
          place(self);
        return st.promise;
      },
      [=](token_event& ev) {
        auto& st = self->state;
        if (st.answered) return;
        // Only this attempt's decode rank speaks for the request (a rank given up on may still).
        if (caf::actor_cast<caf::actor_addr>(self->current_sender()) != caf::actor_cast<caf::actor_addr>(st.decode)) return;
        if (ev.lease_id != st.lease_id) return;  // an earlier attempt's sequence on the same rank
        record_token(self, ev.token, std::move(ev.logits), std::move(ev.logprobs));
        if (hits_stop(st, ev.token)) {
          // Done here: the lease is released, the decode rank drops the sequence at its next step.
          st.stopped = true;
          st.out.finish_reason = st.eos_hit ? "eos" : "stop";
          answer(self, caf::error{});
          return;
        }
        stream(self, false);
        arm_watchdog(self);
      },
      [=](rank_gone_atom, const std::vector<std::string>& ranks, const std::string& why) {
        const auto& st = self->state;
        auto gone = [&](const std::string& n) { return !n.empty() && std::find(ranks.begin(), ranks.end(), n) != ranks.end(); };
        std::string prefill_gone;
        for (const auto& [rank, name] : prefill_ranks_of(st))
          if (gone(name)) prefill_gone = name;
        on_ranks_lost(self, gone(st.decode_name), prefill_gone, why);
      },
      [=](cancel_atom) {
        answer(self, make_error(errc::cancelled, where(self->state.plan.request_id, "", "stream") +
                                                     ": cancelled by the client"));
      },
      [=](timer_atom, uint64_t attempt) {
        if (!stale(self, static_cast<uint32_t>(attempt))) retry(self);
      },
      [=](watchdog_atom, uint64_t seq) {
        auto& st = self->state;
        if (seq != st.watch_seq || st.answered) return;
        const auto due = st.watch_from + std::chrono::milliseconds{st.plan.cfg.token_timeout_ms};
        if (const auto now = self->clock().now(); now < due) {
          self->delayed_send(self, due - now, watchdog_atom::value, seq);
          return;
        }
        fail_or_retry(self, make_error(errc::deadline_exceeded,
                                where(st.plan.request_id, st.decode_name, "decode") + ": no token within " +
                                    std::to_string(st.plan.cfg.token_timeout_ms) + " ms after token " +
                                    std::to_string(st.out.tokens.size() - 1)));
      },
  };
}

}  // namespace

request_actor spawn_request(caf::actor_system& sys, request_plan plan) {
  return sys.spawn(request_impl, std::move(plan));
}

}  // namespace baton

#include "actors/decode_balancer.hpp"

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <algorithm>
#include <deque>
#include <optional>

#include "actors/charge_ledger.hpp"
#include "actors/rank_registry.hpp"
#include "policies/decode_placement.hpp"
#include "policies/placement.hpp"

namespace baton {

namespace {

struct decode_balancer_state {
  decode_balancer_config cfg;
  policies::decode_policy policy = policies::decode_policy::seed;
  rank_registry<decode_rank_actor> registry;
  /// Placements that found no rank (none registered yet, or none with room): the KV queue, in
  /// request order, served (interactive before batch, `priority`) after every load report; the
  /// next one that does not fit holds the rest. The requester's wait (wait_ms) bounds each.
  std::deque<parked_placement<decode_placement>> parked;
  parked_priority priority;  ///< interactive before batch among them, batch never starved
  bool grace_timer_armed = false;  ///< a timer_atom is on its way (no rank takes work: arm_grace_check)
  std::optional<caf::actor_clock::time_point> parked_timer_at;  ///< a parked_due_atom's (arm_parked_expiry)
  uint64_t rr_cursor = 0;
  /// The balancer's own placements since each rank's last report (charge_ledger.hpp); those no
  /// report followed within cfg.charge_ttl_ms are taken back.
  struct charge {
    caf::actor_clock::time_point at;
    uint32_t pages;      ///< taken off the rank's free pages (at most what it had)
    uint64_t kv_tokens;
    uint64_t request_id;
    uint32_t pages_needed;  ///< what the sequence asked, to take again after a report
    uint32_t attempt;       ///< place_query::attempt: which placement of the request (a release names it)
  };
  charge_ledger<charge, caf::actor_clock::time_point> charges;
  decision_log log;
  store_info store;  ///< handed to decode ranks that join from other processes
  static inline const char* name = "baton.decode_balancer";
};

using pointer = decode_balancer_actor::stateful_pointer<decode_balancer_state>;

uint32_t page_size(const decode_balancer_state& st, const rank_load& r) {
  return r.page_size_tokens ? r.page_size_tokens : st.cfg.page_size_tokens;
}

/// The most pages rank `r` can ever grant a newcomer (on demand: less its growth watermark).
uint32_t grantable(const rank_load& r) { return policies::grantable_pages(r.num_total_pages, r.on_demand_headroom_tokens > 0); }

/// Pages of rank `r` kept for interactive requests (decode_balancer_config::interactive_reserve_pct).
uint32_t kept(const decode_balancer_state& st, const rank_load& r) {
  return static_cast<uint32_t>(uint64_t{r.num_total_pages} * st.cfg.interactive_reserve_pct / 100);
}

bool is_batch(const place_query& q) { return q.priority == "batch"; }

/// Pages of rank `r` the query may not take: for a batch request, those kept.
uint32_t reserved(const decode_balancer_state& st, const place_query& q, const rank_load& r) {
  return is_batch(q) ? kept(st, r) : 0;
}

/// A rank a waiting request keeps its room on (serve, rank_to_hold): closed to every newcomer,
/// or -- held by a batch request, which cannot use the pages kept for interactive ones anyway --
/// closed to batch requests, and open to interactive ones for those kept pages alone.
enum class hold : uint8_t { none, all, batch };

/// The pages of rank `r` free for the query.
uint32_t free_for(const decode_balancer_state& st, const place_query& q, const rank_load& r) {
  const uint32_t keep = reserved(st, q, r);
  return r.num_free_pages > keep ? r.num_free_pages - keep : 0;
}

/// KV tokens the sequence takes on rank `r` at first: all of it, or (KV on demand) its prompt
/// plus the rank's headroom.
uint32_t need_tokens(const place_query& q, const rank_load& r) {
  if (r.on_demand_headroom_tokens == 0) return q.total_tokens;
  return std::min(q.total_tokens, q.new_tokens + q.cached_tokens + r.on_demand_headroom_tokens);
}

/// Whether rank `i` takes the query while ranks are `held` for requests ahead (none: empty),
/// and the pages it may use there: on a rank a batch request waits for, the kept ones only.
std::optional<uint32_t> room_for(const decode_balancer_state& st, const place_query& q, const std::vector<hold>& held,
                                 size_t i) {
  const hold h = i < held.size() ? held[i] : hold::none;
  if (!st.registry.open(i) || h == hold::all || (h == hold::batch && is_batch(q))) return std::nullopt;
  const auto& r = st.registry.loads[i];
  return h == hold::batch ? std::min(r.num_free_pages, kept(st, r)) : free_for(st, q, r);
}

/// A charge on rank `name` taken back: its sequence never comes (expired, or its request gave
/// its placement up).
void take_back(decode_balancer_state& st, const std::string& name, const decode_balancer_state::charge& c) {
  auto i = st.registry.index_of(name);
  if (!i) return;  // the rank is gone
  auto& r = st.registry.loads[*i];
  r.num_running -= std::min(r.num_running, 1u);
  r.num_free_pages = std::min(r.num_total_pages, r.num_free_pages + c.pages);
  r.kv_tokens -= std::min(r.kv_tokens, c.kv_tokens);
}

/// Takes back the charges no report has replaced within cfg.charge_ttl_ms: their sequences
/// never reached their ranks.
void expire_charges(pointer self) {
  auto& st = self->state;
  st.charges.expire(
      self->clock().now() - std::chrono::milliseconds{st.cfg.charge_ttl_ms},
      [&](const std::string& name, const decode_balancer_state::charge& c) { take_back(st, name, c); },
      [&](const std::string& name, size_t n) {
        if (st.registry.index_of(name))
          st.log.add({0, name, std::to_string(n) + " placement(s) no report followed within charge_ttl_ms (" +
                                   std::to_string(st.cfg.charge_ttl_ms) + " ms): taken back"});
      });
}

/// Parked placements are retried after each load report, but what keeps them parked may be
/// charges whose sequences never came, and an idle rank sends no report: retry them when those
/// charges expire too.
void arm_charge_expiry(pointer self) {
  auto& st = self->state;
  // When the oldest charge expires (a parked placement waits seconds, not a whole TTL).
  if (auto wait = st.charges.arm_timer(self->clock().now(), std::chrono::milliseconds{st.cfg.charge_ttl_ms}, !st.parked.empty()))
    self->delayed_send(self, *wait, expire_atom::value);
}

/// The chosen rank with room for the sequence's KV, counted as its load until its next report.
/// Ranks marked in `held` keep their room for a request ahead in the queue (enum hold).
std::optional<decode_placement> try_place(pointer self, const place_query& q, const std::vector<hold>& held = {}) {
  auto& st = self->state;
  expire_charges(self);
  const auto& loads = st.registry.loads;
  const auto open = [&](size_t i) { return room_for(st, q, held, i).has_value(); };
  const auto free_pages = [&](size_t i) { return room_for(st, q, held, i).value_or(0); };
  std::optional<size_t> pick;
  std::string why;
  switch (st.policy) {
    case policies::decode_policy::seed: {
      std::vector<policies::decode_rank_view> views;
      for (const auto& r : loads) {
        const uint64_t ps = page_size(st, r);
        // Each rank by its own page size and allocation (whole pages; on demand: the prompt and
        // headroom): ranks of a pool need not be alike.
        const uint64_t need = (uint64_t{need_tokens(q, r)} + ps - 1) / ps * ps;
        // (A batch request sees a rank's capacity less the kept pages, and its fullness counts the
        // interactive sequences in them too: it leans to emptier ranks a little early.)
        views.push_back({r.num_running, r.kv_tokens, uint64_t{free_pages(views.size())} * ps,
                         uint64_t{r.num_total_pages - reserved(st, q, r)} * ps, open(views.size()), need});
      }
      // Long or short by the whole sequence (decode_2d_config::long_context_tokens).
      if (auto d = policies::place_decode_2d(views, q.total_tokens, st.cfg.two_d)) {
        pick = d->rank;
        why = "seed 2D: " + d->explain(loads[d->rank].name);
      }
      break;
    }
    case policies::decode_policy::least_loaded:
    case policies::decode_policy::round_robin: {
      std::vector<policies::decode_rank_load> views;
      std::vector<bool> fits;
      for (const auto& r : loads) {
        const uint32_t pages = (need_tokens(q, r) + page_size(st, r) - 1) / page_size(st, r);
        const bool takes = open(fits.size());
        const uint32_t free = free_pages(fits.size());
        views.push_back({r.num_running, free >= pages ? free : 0, r.num_total_pages, takes});
        fits.push_back(takes && free >= pages);
      }
      if (st.policy == policies::decode_policy::least_loaded) {
        pick = policies::least_loaded_decode(views, 1);
        why = "least_loaded";
      } else {
        pick = policies::round_robin(fits, st.rr_cursor);
        why = "round_robin";
      }
      if (pick) why += ": " + std::to_string(loads[*pick].num_running) + " running";
      break;
    }
  }
  if (!pick) return std::nullopt;
  auto& r = st.registry.loads[*pick];
  const uint32_t ps = page_size(st, r);
  const uint32_t pages = (need_tokens(q, r) + ps - 1) / ps;
  const uint32_t taken = std::min(r.num_free_pages, pages);
  r.num_running += 1;
  r.num_free_pages -= taken;
  r.kv_tokens += uint64_t{pages} * ps;
  st.charges.add(r.name, {self->clock().now(), taken, uint64_t{pages} * ps, q.request_id, pages, q.attempt});
  why += " [needs " + std::to_string(q.total_tokens) + " tokens]";
  st.log.add({q.request_id, r.name, why});
  return decode_placement{r.name, st.registry.ranks[*pick], why};
}

/// A placement that waited its time out: the KV it needs, and why each rank could not hold it,
/// so an overload reads as one (kv_capacity: retryable, a 503) rather than a silent balancer;
/// with no rank taking work, rank_unavailable.
caf::error no_room(const decode_balancer_state& st, const place_query& q) {
  const auto wait = std::chrono::milliseconds{q.wait_ms ? q.wait_ms : parked_wait_default_ms};
  const auto waited = std::to_string((wait - parked_answer_margin(wait)).count()) + " ms of its " +
                      std::to_string(wait.count()) + " ms wait";
  std::string ranks;
  bool any_open = false;
  for (size_t i = 0; i < st.registry.loads.size(); ++i) {
    const auto& r = st.registry.loads[i];
    any_open = any_open || st.registry.open(i);
    ranks += (ranks.empty() ? "" : "; ") + r.name + ": ";
    if (!st.registry.open(i))
      ranks += "takes no new work (" + (st.registry.draining[i] ? std::string{"draining"} : r.unavailable) + ")";
    else
      ranks += std::to_string(r.num_free_pages) + " of " + std::to_string(r.num_total_pages) + " pages free" +
               (reserved(st, q, r) ? " (" + std::to_string(reserved(st, q, r)) + " kept for interactive requests)" : "") +
               ", " + std::to_string(r.num_running) + " running, needs " +
               std::to_string((need_tokens(q, r) + page_size(st, r) - 1) / page_size(st, r));
  }
  // No rank taking work at all (none joined, every one gone, draining or stepped aside) within
  // a wait shorter than the registry's grace is no shortage of KV: a trial saw streams whose
  // decode nodes were killed fail as kv_capacity, which sends an operator after capacity.
  if (!any_open)
    return make_error(errc::rank_unavailable,
                      where(q.request_id, "", "place_decode") + ": no decode rank took work within " + waited + " (" +
                          (ranks.empty() ? std::string{"no rank registered"} : ranks) + ")");
  return make_error(errc::kv_capacity, where(q.request_id, "", "place_decode") + ": no decode rank had room for " +
                                           std::to_string(q.total_tokens) + " tokens of KV within " + waited + " (" +
                                           ranks + ")");
}

/// The rank a waiting request keeps room on: of the ranks taking work and not `held` for one
/// ahead of it, one that could ever grant its sequence -- the nearest to holding it (the fewest
/// tokens short; then the most tokens free). None when no such rank could hold it even empty
/// (its only big rank draining).
std::optional<size_t> rank_to_hold(const decode_balancer_state& st, const place_query& q, const std::vector<hold>& held) {
  std::optional<size_t> best;
  uint64_t best_short = 0, best_free = 0;
  for (size_t i = 0; i < st.registry.loads.size(); ++i) {
    const auto& r = st.registry.loads[i];
    const uint32_t ps = page_size(st, r);
    const uint32_t pages = (need_tokens(q, r) + ps - 1) / ps;
    const uint32_t keep = reserved(st, q, r), free = free_for(st, q, r);
    if (!st.registry.open(i) || held[i] != hold::none || uint64_t{pages} + keep > grantable(r)) continue;
    const uint64_t shortfall = uint64_t{pages > free ? pages - free : 0} * ps;
    const uint64_t free_tokens = uint64_t{free} * ps;
    if (!best || shortfall < best_short || (shortfall == best_short && free_tokens > best_free)) {
      best = i;
      best_short = shortfall;
      best_free = free_tokens;
    }
  }
  return best;
}

/// The KV queue: places what is parked while ranks have room, in queue order (interactive before
/// batch, st.priority); those past their deadline are told why first. One that does not fit
/// lets those behind it that fit pass it (backfill), each counted, up to kv_queue_max_bypass;
/// then it keeps room on the rank nearest to holding it (rank_to_hold): those behind it are
/// placed on the other ranks, never there, so a long sequence is not starved by short ones while
/// the rest of the pool keeps taking work. One that no rank taking work could hold even empty
/// holds nothing and waits (for a rank undrained or joining) without stopping the queue.
void serve(pointer self) {
  auto& st = self->state;
  drop_expired(st.parked, self->clock().now(), "place_decode", [=](const place_query& q) { return no_room(self->state, q); });
  std::vector<hold> held(st.registry.loads.size(), hold::none);
  std::vector<bool> passed(st.parked.size(), false);
  // Passed this pass, fitting nowhere, keeping no room yet: each placement behind them counts.
  // (Placements are bounded by the ranks' room, so this costs little even with a long queue.)
  std::vector<size_t> backfilled;
  const auto keep_room = [&](const place_query& q) {
    if (auto r = rank_to_hold(st, q, held))
      held[*r] = is_batch(q) && st.cfg.interactive_reserve_pct ? hold::batch : hold::all;
  };
  const auto room_left = [&] {  // a rank taking work that nobody waits for (or, held by a batch request, its kept pages)
    for (size_t i = 0; i < held.size(); ++i)
      if (st.registry.open(i) && held[i] != hold::all) return true;
    return false;
  };
  // Whether a rank open to `q` has its pages free, as try_place counts them: one that fits
  // nowhere is passed over without the policy's views and words (a saturated queue of thousands,
  // each backfilled, went through try_place on every arrival and report: 66% slower in a sim).
  const auto fits_somewhere = [&](const place_query& q) {
    for (size_t i = 0; i < held.size(); ++i) {
      const auto& r = st.registry.loads[i];
      const uint32_t ps = page_size(st, r);
      if (room_for(st, q, held, i).value_or(0) >= (need_tokens(q, r) + ps - 1) / ps) return true;
    }
    return false;
  };
  expire_charges(self);  // once, before the fits are judged (try_place does it again for its own)
  parked_cursor cursor;
  while (const auto head = st.priority.next(st.parked, cursor, passed)) {
    auto& next = st.parked[*head];
    if (auto placed = fits_somewhere(next.query) ? try_place(self, next.query, held) : std::nullopt) {
      st.priority.placed(st.parked, *head, cursor);
      next.promise.deliver(std::move(*placed));
      st.parked.erase(st.parked.begin() + static_cast<std::ptrdiff_t>(*head));
      passed.erase(passed.begin() + static_cast<std::ptrdiff_t>(*head));
      cursor.erased(*head);
      for (auto& i : backfilled)
        if (i > *head) --i;
      // It passed each of them; one passed kv_queue_max_bypass times keeps its room from now on.
      for (auto i = backfilled.begin(); i != backfilled.end();) {
        if (++st.parked[*i].passed_by < st.cfg.kv_queue_max_bypass) {
          ++i;
          continue;
        }
        keep_room(st.parked[*i].query);
        i = backfilled.erase(i);
      }
      if (!room_left()) return;
      continue;
    }
    passed[*head] = true;
    if (next.passed_by < st.cfg.kv_queue_max_bypass) {
      backfilled.push_back(*head);
      continue;
    }
    keep_room(next.query);
    if (!room_left()) return;
  }
}

decode_balancer_actor::behavior_type decode_balancer_impl(pointer self, decode_balancer_config cfg, store_info store) {
  auto& st = self->state;
  st.store = std::move(store);
  st.policy = *policies::parse_decode_policy(cfg.policy);  // validated by the caller
  st.log.capacity = cfg.decision_log_size;
  st.priority.max_bypass = cfg.batch_max_bypass;
  st.cfg = std::move(cfg);
  // A rank that goes away (its process ended, it drained) takes no more placements.
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& st = self->state;
    std::string name;
    if (auto i = st.registry.index_of_addr(dm.source)) name = st.registry.loads[*i].name;
    st.registry.forget(dm.source, self->clock().now());
    // Its charges go with it -- unless a successor under its name reported first: they are its.
    if (!name.empty() && !st.registry.index_of(name)) st.charges.forget(name);
    after_rank_change(self);
    serve(self);  // what waited for it waits for other ranks now
  });
  return {
      [=](place_atom, place_query& q) -> caf::result<decode_placement> {
        auto& st = self->state;
        if (auto none = st.registry.none_taking_work("decode", self->clock().now(), std::chrono::milliseconds{st.cfg.no_rank_grace_ms});
            !none.empty())
          return make_error(errc::rank_unavailable, where(q.request_id, "", "place_decode") + ": " + none);
        // Refuse at once what no rank could ever hold, instead of parking it until the deadline
        // (a batch request: outside the pages kept for interactive ones).
        uint64_t largest = 0;
        for (const auto& r : st.registry.loads)
          largest = std::max<uint64_t>(largest, uint64_t{r.num_total_pages - reserved(st, q, r)} * page_size(st, r));
        if (!st.registry.loads.empty() && q.total_tokens > largest)
          // bad_request, not kv_capacity: retrying (or a client's Retry-After) cannot help.
          return make_error(errc::bad_request, where(q.request_id, "", "place_decode") + ": needs " +
                                                   std::to_string(q.total_tokens) +
                                                   " tokens of KV, the largest decode rank holds " +
                                                   std::to_string(largest) + " in all" +
                                                   (is_batch(q) && st.cfg.interactive_reserve_pct
                                                        ? " for a batch request (the rest is kept for interactive ones: "
                                                          "interactive_reserve_pct " +
                                                              std::to_string(st.cfg.interactive_reserve_pct) + ")"
                                                        : std::string{}));
        // Placed at once only when nobody waits: otherwise it takes its turn in the queue, placed
        // now if the ranks nobody ahead of it waits for have room, or passing one that fits
        // nowhere only as far as its backfill allows (kv_queue_max_bypass: a trial saw 99 later
        // arrivals served first when nothing counted them).
        if (st.parked.empty())
          if (auto p = try_place(self, q)) return std::move(*p);
        auto promise = self->make_response_promise<decode_placement>();
        park(st.parked, std::move(q), promise, self->clock().now());
        serve(self);
        arm_charge_expiry(self);
        arm_grace_check(self);
        arm_parked_expiry(self);
        return promise;
      },
      [=](parked_due_atom) { parked_timer_fired(self, [=] { serve(self); }); },
      [=](timer_atom) { grace_timer_fired(self, "decode", "place_decode"); },
      [=](load_atom, rank_load& load, decode_rank_actor& rank) {
        auto& st = self->state;
        const std::string name = load.name;
        if (st.registry.report(std::move(load), rank, st.log)) self->monitor(rank);
        // The report counts the placements it settled; the others still take their room.
        if (auto i = st.registry.index_of(rank)) {
          st.charges.reported(name, st.registry.loads[*i].settled, [&](decode_balancer_state::charge& c) {
            auto& r = st.registry.loads[*i];
            c.pages = std::min(r.num_free_pages, c.pages_needed);
            r.num_running += 1;
            r.num_free_pages -= c.pages;
            r.kv_tokens += c.kv_tokens;
          });
          st.registry.loads[*i].settled.clear();
        }
        serve(self);
        after_rank_change(self);
      },
      [=](release_atom, uint64_t request_id, uint32_t attempt) {
        // Its attempt gave up between placement and reservation: the room it was charged is
        // free, and a placement of it still parked is void (placed later, it would be charged
        // to a rank that never hears of it).
        auto& st = self->state;
        drop_parked(st.parked, request_id, attempt, "place_decode");
        const auto freed = st.charges.cancel(request_id, attempt, [&](const std::string& name, const auto& c) {
          take_back(st, name, c);
        });
        if (freed) serve(self);
      },
      [=](expire_atom) {
        self->state.charges.timer_fired();
        expire_charges(self);
        serve(self);
        arm_charge_expiry(self);
      },
      [=](stats_atom) { return self->state.registry.stats(); },
      [=](parked_atom) { return static_cast<uint32_t>(self->state.parked.size()); },
      [=](events_atom) { return self->state.log.snapshot(); },
      [=](store_atom) { return self->state.store; },
      [=](forget_atom, decode_rank_actor& rank) {
        auto& st = self->state;
        if (auto i = st.registry.index_of(rank)) {
          st.log.add({0, st.registry.loads[*i].name, "forgotten: its node is gone"});
          st.charges.forget(st.registry.loads[*i].name);
          st.registry.forget(caf::actor_cast<caf::actor_addr>(rank), self->clock().now(), true);
        }
        after_rank_change(self);
        serve(self);
      },
      [=](rejoin_atom, decode_rank_actor& rank, bool keep_draining) {
        self->state.registry.rejoin(caf::actor_cast<caf::actor_addr>(rank), keep_draining);
      },
      [=](drain_atom, decode_rank_actor& rank) {
        auto& st = self->state;
        if (auto i = st.registry.index_of(rank)) {
          st.log.add({0, st.registry.loads[*i].name, "draining: no new placements"});
          st.registry.draining[*i] = true;
        }
        after_rank_change(self);
        serve(self);  // a request that waited for room there waits for other ranks now
      },
      [=](undrain_atom, decode_rank_actor& rank) {
        auto& st = self->state;
        if (auto i = st.registry.index_of(rank); i && st.registry.draining[*i]) {
          st.log.add({0, st.registry.loads[*i].name, "undrained: placements again"});
          st.registry.draining[*i] = false;
          serve(self);
        }
        after_rank_change(self);
      },
  };
}

}  // namespace

decode_balancer_actor spawn_decode_balancer(caf::actor_system& sys, decode_balancer_config cfg, store_info store) {
  return sys.spawn(decode_balancer_impl, std::move(cfg), std::move(store));
}

}  // namespace baton

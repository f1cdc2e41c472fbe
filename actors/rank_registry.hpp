#pragma once

#include <algorithm>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor_addr.hpp>
#include <caf/actor_cast.hpp>
#include <caf/actor_clock.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/messages.hpp"

namespace baton {

/// The balancers' bounded record of recent decisions (`events` answers with it).
struct decision_log {
  std::deque<placement_record> records;
  size_t capacity = 256;
  void add(placement_record r) {
    records.push_back(std::move(r));
    while (records.size() > capacity) records.pop_front();
  }
  std::vector<placement_record> snapshot() const { return {records.begin(), records.end()}; }
};

/// The balancers' view of their ranks: handles and the last load each reported, in the order
/// the ranks first reported (index i of both vectors is the same rank).
template <class Handle>
struct rank_registry {
  std::vector<Handle> ranks;
  std::vector<rank_load> loads;
  std::vector<bool> draining;  ///< takes no new work; finishes what it has

  /// Whether rank i takes new work: not draining, and its last report named no standing failure.
  bool open(size_t i) const { return !draining[i] && loads[i].unavailable.empty(); }
  /// The loads as /health, /metrics and the elastic controller see them: a draining rank's says
  /// so in `unavailable` (it takes no new work, as one whose executor stepped aside).
  std::vector<rank_load> stats() const {
    auto out = loads;
    for (size_t i = 0; i < out.size(); ++i)
      if (draining[i] && out[i].unavailable.empty()) out[i].unavailable = "draining";
    return out;
  }

  /// Ranks forgotten while they may still run (set_aside): their node was given up for lost, or
  /// an elastic move took them to the other role. A load report they sent before that, arriving
  /// after, must not bring them back; they return by the first report after rejoin(), draining
  /// again if they were. Bounded: the oldest entries go first.
  struct absent_rank {
    caf::actor_addr addr;
    bool draining = false;
    bool may_return = false;
  };
  std::deque<absent_rank> absent;
  static constexpr size_t max_absent = 4096;
  bool had_ranks = false;  ///< some rank has reported since start
  caf::actor_clock::time_point empty_since{};  ///< when the last rank left (had_ranks, none now)
  /// Since when the ranks here all take no work (draining, stepped aside); unset while one does,
  /// or none is here (then empty_since counts). Kept by refresh().
  std::optional<caf::actor_clock::time_point> closed_since;

  /// Keeps closed_since: the balancers call it after every change of the ranks or their state (a
  /// report, a drain or undrain, a rank forgotten or let back).
  void refresh(caf::actor_clock::time_point now) {
    bool any_open = false;
    for (size_t i = 0; i < ranks.size() && !any_open; ++i) any_open = open(i);
    if (ranks.empty() || any_open) closed_since.reset();
    else if (!closed_since) closed_since = now;
  }

  /// Why no placement should wait for a rank: there were ranks, and for longer than `grace` none
  /// has taken work -- every one is gone (their nodes died or stopped, none came back), or those
  /// here are draining or stepped aside. Empty while a rank takes work, within the grace (one may
  /// be on its way back, or mended), and before the first report (at start, ranks are on their
  /// way: a placement waits for them).
  std::string none_taking_work(const char* role, caf::actor_clock::time_point now, caf::timespan grace) const {
    if (!had_ranks) return {};
    const auto grace_ms = std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(grace).count());
    if (ranks.empty()) {
      if (now - empty_since < grace) return {};
      return std::string{"no "} + role + " rank in the cluster: every one that joined has left, none came back within " +
             grace_ms + " ms (a node restarted takes work again once its rank has rejoined)";
    }
    if (!closed_since || now - *closed_since < grace) return {};  // unset: a rank takes work
    std::string first_aside;
    for (size_t i = 0; i < ranks.size() && first_aside.empty(); ++i)
      if (!open(i)) first_aside = loads[i].name + ": " + (draining[i] ? std::string{"draining"} : loads[i].unavailable);
    return std::string{"no "} + role + " rank takes work: the " + std::to_string(ranks.size()) +
           " here are draining or stepped aside (" + first_aside + (ranks.size() > 1 ? ", ..." : "") +
           "), and none took work again or joined within " + grace_ms + " ms";
  }
  /// With no rank taking work, the time left until none_taking_work refuses (a timer then
  /// refuses the placements parked meanwhile); none while a rank takes work or before the first.
  /// (closed_since as refresh() left it.)
  std::optional<caf::timespan> grace_left(caf::actor_clock::time_point now, caf::timespan grace) const {
    if (!had_ranks) return std::nullopt;
    if (ranks.empty()) return std::max(caf::timespan{0}, grace - (now - empty_since));
    if (!closed_since) return std::nullopt;
    return std::max(caf::timespan{0}, grace - (now - *closed_since));
  }

  /// A report replaces the rank's previous one (including the balancer's own placements since).
  /// True when the rank is new (the caller monitors it). A rank stepping aside (its report names
  /// why it takes no work) or back is written to `log`. A report of a rank set aside and not
  /// yet let back (rejoin) is ignored.
  bool report(rank_load load, Handle rank, decision_log& log) {
    auto i = index_of(rank);
    bool was_draining = false;
    if (!i) {
      const auto addr = caf::actor_cast<caf::actor_addr>(rank);
      auto a = std::find_if(absent.begin(), absent.end(), [&](const absent_rank& x) { return x.addr == addr; });
      if (a != absent.end()) {
        if (!a->may_return) return false;  // sent before it was set aside
        was_draining = a->draining;
        absent.erase(a);
        log.add({0, load.name, was_draining ? "rejoined, still draining" : "rejoined"});
      }
    }
    const std::string before = i ? loads[*i].unavailable : std::string{};
    if (load.unavailable != before)
      log.add({0, load.name, load.unavailable.empty() ? "takes work again" : "steps aside: " + load.unavailable});
    if (i) {
      loads[*i] = std::move(load);
      return false;
    }
    ranks.push_back(std::move(rank));
    loads.push_back(std::move(load));
    draining.push_back(was_draining);
    had_ranks = true;
    return true;
  }
  /// A rank that went down (its process ended) is forgotten at `now`; with `until_rejoin` (it may
  /// still run: set aside) its reports are ignored until rejoin().
  void forget(const caf::actor_addr& addr, caf::actor_clock::time_point now, bool until_rejoin = false) {
    for (size_t i = 0; i < ranks.size(); ++i)
      if (caf::actor_cast<caf::actor_addr>(ranks[i]) == addr) {
        if (until_rejoin) {
          absent.push_back({addr, draining[i], false});
          if (absent.size() > max_absent) absent.pop_front();
        }
        ranks.erase(ranks.begin() + static_cast<std::ptrdiff_t>(i));
        loads.erase(loads.begin() + static_cast<std::ptrdiff_t>(i));
        draining.erase(draining.begin() + static_cast<std::ptrdiff_t>(i));
        if (ranks.empty()) empty_since = now;
        return;
      }
  }
  /// A rank set aside may register again with its next report, draining again if it was and
  /// `keep_draining`. True if it was set aside.
  bool rejoin(const caf::actor_addr& addr, bool keep_draining) {
    for (auto& a : absent)
      if (a.addr == addr) {
        a.draining = a.draining && keep_draining;
        return a.may_return = true;
      }
    return false;
  }
  std::optional<size_t> index_of(const Handle& rank) const {
    for (size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i] == rank) return i;
    return std::nullopt;
  }
  /// By address: a rank that went down (its handle can no longer be made from it).
  std::optional<size_t> index_of_addr(const caf::actor_addr& addr) const {
    for (size_t i = 0; i < ranks.size(); ++i)
      if (caf::actor_cast<caf::actor_addr>(ranks[i]) == addr) return i;
    return std::nullopt;
  }
  std::optional<size_t> index_of(const std::string& name) const {
    for (size_t i = 0; i < loads.size(); ++i)
      if (loads[i].name == name) return i;
    return std::nullopt;
  }
};

inline constexpr uint32_t parked_wait_default_ms = 5000;

/// A placement request waiting for a rank that can take it, until `deadline`.
template <class Placement>
struct parked_placement {
  place_query query;
  caf::typed_response_promise<Placement> promise;
  caf::actor_clock::time_point deadline;
  uint32_t passed_by = 0;  ///< the decode KV queue: later requests placed while this one fit nowhere
};

/// Drops the parked placement of request `id`'s attempt `attempt` (it gave up): its asker, if it
/// still listens, hears `cancelled`. True when one was parked.
template <class Placement>
bool drop_parked(std::deque<parked_placement<Placement>>& parked, uint64_t id, uint32_t attempt, const char* stage) {
  auto p = std::find_if(parked.begin(), parked.end(),
                        [&](const auto& x) { return x.query.request_id == id && x.query.attempt == attempt; });
  if (p == parked.end()) return false;
  p->promise.deliver(make_error(errc::cancelled, where(id, "", stage) + ": the request gave up its placement"));
  parked.erase(p);
  return true;
}

/// A parked placement is answered this long before its asker stops waiting: the asker hears why
/// it was not placed (no rank had room: which, and how much), not its own timeout.
inline std::chrono::milliseconds parked_answer_margin(std::chrono::milliseconds wait) {
  return std::min(wait / 10, std::chrono::milliseconds{500});
}

/// Parks `q` (no rank has room now) until just before its asker's wait runs out, in the order
/// the router admitted the requests (their ids): a request asking again after a refusal keeps
/// its place ahead of those admitted after it, so under a sustained overload the oldest are
/// served first instead of refused (a trial saw requests 4 s younger placed ahead of them).
template <class Placement>
void park(std::deque<parked_placement<Placement>>& parked, place_query q,
          caf::typed_response_promise<Placement> promise, caf::actor_clock::time_point now) {
  const auto wait = std::chrono::milliseconds{q.wait_ms ? q.wait_ms : parked_wait_default_ms};
  const auto at = std::upper_bound(parked.begin(), parked.end(), q.request_id,
                                   [](uint64_t id, const parked_placement<Placement>& p) { return id < p.query.request_id; });
  parked.insert(at, {std::move(q), std::move(promise), now + wait - parked_answer_margin(wait)});
}

/// The error a placement parked past its deadline gets; empty: a generic one.
using parked_expiry = std::function<caf::error(const place_query&)>;

/// Answers the placements whose deadline passed (a balancer's own reason, `expired`, or a
/// deadline_exceeded) and drops them: served later they would charge a rank with load nobody
/// brings, and during an outage the queue would grow with every retry. Returns how many.
template <class Placement>
size_t drop_expired(std::deque<parked_placement<Placement>>& parked, caf::actor_clock::time_point now,
                    const char* stage, const parked_expiry& expired = {}) {
  size_t n = 0;
  for (auto i = parked.begin(); i != parked.end();) {
    if (i->deadline > now) {
      ++i;
      continue;
    }
    i->promise.deliver(expired ? expired(i->query)
                               : make_error(errc::deadline_exceeded, where(i->query.request_id, "", stage) +
                                                                         ": no rank had room while the request waited"));
    i = parked.erase(i);
    ++n;
  }
  return n;
}

/// Arms the balancer's timer for the earliest parked deadline (its state: parked and
/// parked_timer_at), unless one as early is on its way: a parked placement is answered at its
/// deadline even when nothing else happens (no report comes from ranks that are full and busy).
template <class Self>
void arm_parked_expiry(Self* self) {
  auto& st = self->state;
  if (st.parked.empty()) return;
  auto earliest = st.parked.front().deadline;
  for (const auto& p : st.parked) earliest = std::min(earliest, p.deadline);
  if (st.parked_timer_at && *st.parked_timer_at <= earliest) return;
  st.parked_timer_at = earliest;
  const auto now = self->clock().now();
  const auto in = earliest > now ? std::chrono::duration_cast<std::chrono::milliseconds>(earliest - now) : std::chrono::milliseconds{0};
  self->delayed_send(self, in + std::chrono::milliseconds{1}, parked_due_atom::value);
}

/// A parked_due_atom came: only the timer for the earliest deadline acts (one armed for a later
/// deadline before an earlier one came is stale), so each that acts arms at most one more.
/// `serve` answers what passed its deadline and places what it can.
template <class Self, class Serve>
void parked_timer_fired(Self* self, Serve serve) {
  auto& at = self->state.parked_timer_at;
  if (!at || self->clock().now() < *at) return;
  at.reset();
  serve();
  arm_parked_expiry(self);
}

/// Seed 002's request-level priority for what waits at a balancer, as at the prefill ranks:
/// interactive requests go before batch ones, but the oldest batch request is passed over by at
/// most `max_bypass` younger interactive ones in a row, so batch work is never starved.
/// Where one pass over the parked placements looks next, per class: every entry before a cursor
/// is passed over, or of the other class. Entries are never un-passed within a pass, so the
/// cursors only move forward (but for an erasure before them): a pass costs the queue's length,
/// not its square (a batch flood with an interactive reserve passed thousands of holds at every
/// load report, each search starting again at the front).
struct parked_cursor {
  size_t batch = 0, interactive = 0;
  /// The entry at `at` left the queue: those after it moved up one.
  void erased(size_t at) {
    if (batch > at) --batch;
    if (interactive > at) --interactive;
  }
};

struct parked_priority {
  uint32_t max_bypass = 4;
  uint32_t bypassed = 0;  ///< younger interactive placements made in a row while a batch one waited

  /// Which parked placement goes next (parked is in request order), of those not `passed`
  /// over already (empty: none is); none when every one is. `cursor`: this pass's (moved on).
  template <class Placement>
  std::optional<size_t> next(const std::deque<parked_placement<Placement>>& parked, parked_cursor& cursor,
                             const std::vector<bool>& passed = {}) const {
    const auto first_from = [&](size_t& from, bool batch) {
      while (from < parked.size() && ((from < passed.size() && passed[from]) || (parked[from].query.priority == "batch") != batch))
        ++from;
      return from < parked.size() ? std::optional<size_t>{from} : std::nullopt;
    };
    const auto batch = first_from(cursor.batch, true), interactive = first_from(cursor.interactive, false);
    if (!batch || !interactive) return batch ? batch : interactive;
    // The oldest batch one goes first once passed over enough -- if it is older at all.
    return bypassed >= max_bypass && *batch < *interactive ? batch : interactive;
  }
  /// Placement `taken` (an index into `parked`, before it leaves), just returned by next() with
  /// `cursor`, was made.
  template <class Placement>
  void placed(const std::deque<parked_placement<Placement>>& parked, size_t taken, const parked_cursor& cursor) {
    if (parked[taken].query.priority == "batch") {
      bypassed = 0;
      return;
    }
    // An interactive one placed while an older batch one waits its turn passed it (the oldest
    // waiting is at the batch cursor); with none waiting (it was placed, expired or cancelled)
    // the count starts again.
    if (cursor.batch < taken) ++bypassed;
    else bypassed = 0;
  }
};

/// Serves parked placements while `try_place(query)` finds a rank for the next one (oldest
/// first, interactive before batch by `priority`); those whose deadline passed are answered
/// first (`expired`). The next one that does not fit holds those behind it.
template <class Placement, class TryPlace>
void serve_parked(std::deque<parked_placement<Placement>>& parked, parked_priority& priority,
                  caf::actor_clock::time_point now, const char* stage, TryPlace try_place,
                  const parked_expiry& expired = {}) {
  drop_expired(parked, now, stage, expired);
  parked_cursor cursor;
  while (const auto head = priority.next(parked, cursor)) {
    auto placed = try_place(parked[*head].query);
    if (!placed) return;
    priority.placed(parked, *head, cursor);
    parked[*head].promise.deliver(std::move(*placed));
    parked.erase(parked.begin() + static_cast<std::ptrdiff_t>(*head));
    cursor.erased(*head);
  }
}

/// Refuses every parked placement: no rank takes work (rank_registry::none_taking_work says why).
template <class Placement>
void refuse_parked(std::deque<parked_placement<Placement>>& parked, const char* stage, const std::string& why) {
  // Those past their deadline too: the reason they waited for nothing is the same.
  for (auto& p : parked)
    p.promise.deliver(make_error(errc::rank_unavailable, where(p.query.request_id, "", stage) + ": " + why));
  parked.clear();
}

/// The grace's timer, for either balancer (its state: registry, parked, grace_timer_armed and
/// cfg.no_rank_grace_ms). With no rank taking work (all gone, draining or stepped aside), a
/// timer at the grace's end refuses the placements parked meanwhile: nothing else may come to
/// wake them (an idle cluster sends no reports), and each would wait out its asker's timeout
/// for a 504.
template <class Self>
void arm_grace_check(Self* self) {
  auto& st = self->state;
  if (st.grace_timer_armed || st.parked.empty()) return;
  if (auto left = st.registry.grace_left(self->clock().now(), std::chrono::milliseconds{st.cfg.no_rank_grace_ms})) {
    st.grace_timer_armed = true;
    self->delayed_send(self, *left + std::chrono::milliseconds{1}, timer_atom::value);
  }
}

/// After any change of the ranks or their state: whether some rank takes work now, and if none
/// does, the grace's timer for what is parked.
template <class Self>
void after_rank_change(Self* self) {
  self->state.registry.refresh(self->clock().now());
  arm_grace_check(self);
}

/// The timer went off: past the grace with no rank taking work, what is parked is refused.
template <class Self>
void grace_timer_fired(Self* self, const char* role, const char* stage) {
  auto& st = self->state;
  st.grace_timer_armed = false;
  const auto now = self->clock().now();
  const auto none = st.registry.none_taking_work(role, now, std::chrono::milliseconds{st.cfg.no_rank_grace_ms});
  if (!none.empty()) return refuse_parked(st.parked, stage, none);
  arm_grace_check(self);  // a rank took work meanwhile and stopped again: a new grace
}

}  // namespace baton

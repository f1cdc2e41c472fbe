#include "actors/prefill_balancer.hpp"

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <list>
#include <map>
#include <optional>
#include <unordered_map>

#include "actors/charge_ledger.hpp"
#include "actors/rank_registry.hpp"
#include "policies/cost_model.hpp"
#include "policies/placement.hpp"
#include "policies/prefill_placement.hpp"

namespace baton {

namespace {

/// A bounded set of block keys, least recently placed forgotten first.
struct recent_keys {
  static constexpr size_t capacity = 4096;
  std::list<std::pair<uint64_t, uint64_t>> order;
  std::map<std::pair<uint64_t, uint64_t>, std::list<std::pair<uint64_t, uint64_t>>::iterator> where;
  size_t leading(const std::vector<uint64_t>& keys) const {
    size_t n = 0;
    while (2 * n + 1 < keys.size() && where.count({keys[2 * n], keys[2 * n + 1]})) ++n;
    return n;
  }
  void add(const std::vector<uint64_t>& keys) {
    for (size_t i = 0; i + 1 < keys.size(); i += 2) {
      const std::pair<uint64_t, uint64_t> k{keys[i], keys[i + 1]};
      if (auto w = where.find(k); w != where.end()) order.erase(w->second);
      order.push_front(k);
      where[k] = order.begin();
    }
    while (order.size() > capacity) {
      where.erase(order.back());
      order.pop_back();
    }
  }
};

struct prefill_balancer_state {
  prefill_balancer_config cfg;
  policies::prefill_policy policy = policies::prefill_policy::seed;
  rank_registry<prefill_rank_actor> registry;
  /// Placements that found no rank (none registered yet, or none with room): retried, oldest
  /// first, after every load report. The requester's place deadline bounds the wait.
  std::deque<parked_placement<prefill_placement>> parked;
  parked_priority priority;  ///< interactive before batch among them, batch never starved
  bool grace_timer_armed = false;  ///< a timer_atom is on its way (no rank takes work: arm_grace_check)
  std::optional<caf::actor_clock::time_point> parked_timer_at;  ///< a parked_due_atom's (arm_parked_expiry)
  /// Level 1 of the seed policy; rebuilt when the number of engines changes (ranks joining).
  std::optional<policies::bucket_allocator> buckets;
  /// Levels 2-3 inputs, kept in step with the registry (rank i is engine i / rpe, slot i % rpe)
  /// so a decision does not rebuild them: a decision at 1,024 ranks stays within microseconds.
  std::vector<policies::prefill_engine_view> engines;
  /// cache_affinity: per rank, the block keys of prompts recently placed there (bounded LRU), an
  /// approximation of what its rank-local tier holds (sgl-router keeps a similar tree).
  std::vector<recent_keys> placed_keys;
  uint64_t rr_cursor = 0;
  /// The balancer's own placements since each rank's last report (charge_ledger.hpp); those no
  /// report followed within cfg.charge_ttl_ms are taken back.
  struct charge {
    caf::actor_clock::time_point at;
    uint64_t tokens;
    double predicted_us;
    uint64_t request_id;
    uint32_t attempt;  ///< place_query::attempt: which placement of the request (a release names it)
  };
  charge_ledger<charge, caf::actor_clock::time_point> charges;
  decision_log log;
  caf::actor_clock::time_point started;
  static inline const char* name = "baton.prefill_balancer";
};

using pointer = prefill_balancer_actor::stateful_pointer<prefill_balancer_state>;

double seconds_since_start(pointer self) {
  return std::chrono::duration<double>(self->clock().now() - self->state.started).count();
}

std::string fmt(const char* f, double a, double b = 0) {
  char buf[160];
  std::snprintf(buf, sizeof buf, f, a, b);
  return buf;
}

/// Levels 1-3 of seed 000 §3.1 over the registered ranks, grouped into engines of
/// ranks_per_engine in registration order.
std::optional<size_t> place_seed(pointer self, const place_query& q, std::string* why) {
  auto& st = self->state;
  const uint32_t rpe = st.cfg.ranks_per_engine;
  const auto num_ranks = st.registry.loads.size();
  const auto num_engines = static_cast<uint32_t>((num_ranks + rpe - 1) / rpe);
  if (num_engines == 0) return std::nullopt;
  const double now = seconds_since_start(self);
  if (!st.buckets)
    st.buckets.emplace(st.cfg.buckets, num_engines);
  else if (st.buckets->engine_buckets().size() != num_engines)
    st.buckets->resize(num_engines, now);  // an elastic move: buckets and demand carry over
  std::string moved;
  if (auto m = st.buckets->rebalance(now))
    moved = "; moved engine " + std::to_string(m->engine) + " from bucket " + std::to_string(m->from_bucket) +
            " to " + std::to_string(m->to_bucket);
  auto d = policies::place_prefill(*st.buckets, st.engines, st.cfg.cost, q.new_tokens, q.cached_tokens);
  if (!d) return std::nullopt;
  st.buckets->record_demand(d->bucket, d->predicted_us, now);
  const size_t pick = static_cast<size_t>(d->engine) * rpe + d->rank;
  *why = "seed: " + d->explain(st.registry.loads[pick].name) + moved;
  return pick;
}

/// Mirrors rank i's predicted load into the engine views.
void sync_view(prefill_balancer_state& st, size_t i) {
  const uint32_t rpe = st.cfg.ranks_per_engine;
  if (st.engines.size() <= i / rpe) st.engines.resize(i / rpe + 1, {st.cfg.engine_quota_us, {}});
  auto& ranks = st.engines[i / rpe].ranks;
  if (ranks.size() <= i % rpe) ranks.resize(i % rpe + 1);
  ranks[i % rpe] = {st.registry.loads[i].predicted_us, st.registry.open(i)};
}

/// The engine views and affinity sets are index-aligned with the registry: rebuilt when a rank
/// leaves it (rare: a node gone or drained).
void resync_views(prefill_balancer_state& st) {
  st.engines.clear();
  for (size_t i = 0; i < st.registry.loads.size(); ++i) sync_view(st, i);
}

/// Drops a rank (its node is gone, or its actor went down) from every view.
void forget_rank(prefill_balancer_state& st, const caf::actor_addr& rank, const char* why, bool until_rejoin,
                 caf::actor_clock::time_point now) {
  for (size_t i = 0; i < st.registry.ranks.size(); ++i)
    if (caf::actor_cast<caf::actor_addr>(st.registry.ranks[i]) == rank) {
      st.log.add({0, st.registry.loads[i].name, why});
      if (i < st.placed_keys.size()) st.placed_keys.erase(st.placed_keys.begin() + static_cast<std::ptrdiff_t>(i));
      // One rank per engine: the later engines keep their buckets (with several, the mapping of
      // ranks to engines shifts, and resize() later drops the last engine instead).
      if (st.buckets && st.cfg.ranks_per_engine == 1) st.buckets->remove_engine(static_cast<uint32_t>(i));
      const std::string name = st.registry.loads[i].name;
      st.registry.forget(rank, now, until_rejoin);
      // Its charges go with it -- unless a successor under its name reported first: they are
      // its (a restarted rank's reports had the dead one's charges added back until they expired).
      if (!st.registry.index_of(name)) st.charges.forget(name);
      resync_views(st);
      return;
    }
}

/// Seed 002 dynamic prefill split over the `parts` least-loaded open ranks.
std::optional<prefill_placement> place_split(pointer self, const place_query& q, uint32_t parts, uint32_t ps) {
  auto& st = self->state;
  std::vector<size_t> order;
  for (size_t i = 0; i < st.registry.loads.size(); ++i)
    if (st.registry.open(i)) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return st.registry.loads[a].predicted_us < st.registry.loads[b].predicted_us;
  });
  // The least-loaded ranks take the parts in registration order: a rank only ever waits for
  // parts on ranks registered before it, so concurrent split prompts cannot wait in a cycle.
  order.resize(parts);
  std::sort(order.begin(), order.end());
  auto sizes = policies::split_prefill(st.cfg.cost, 0, q.new_tokens, parts);
  prefill_placement out;
  out.part_bounds.push_back(0);
  uint64_t at = 0;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    at += sizes[i];
    const auto aligned = static_cast<uint32_t>((at + ps / 2) / ps * ps);  // nearest page boundary
    if (aligned > out.part_bounds.back() && aligned < q.new_tokens) out.part_bounds.push_back(aligned);
  }
  out.part_bounds.push_back(q.new_tokens);
  std::string why = "split: " + std::to_string(q.new_tokens) + " tokens into";
  for (size_t i = 0; i + 1 < out.part_bounds.size(); ++i) {
    auto& r = st.registry.loads[order[i]];
    const uint32_t a = out.part_bounds[i], b = out.part_bounds[i + 1];
    why += " [" + std::to_string(a) + ", " + std::to_string(b) + ") on " + r.name;
    r.queued_tokens += b - a;
    r.num_running += 1;
    r.predicted_us += st.cfg.cost.prefill_us(b - a, a);
    st.charges.add(r.name, {self->clock().now(), b - a, st.cfg.cost.prefill_us(b - a, a), q.request_id, q.attempt});
    sync_view(st, order[i]);
    out.part_ranks.push_back(st.registry.ranks[order[i]]);
    out.part_names.push_back(r.name);
  }
  out.name = out.part_names.back();
  out.rank = out.part_ranks.back();
  out.why = why;
  st.log.add({q.request_id, out.name, why});
  return out;
}

/// A charge on rank `name` taken back: its prompt never comes (expired, or its request gave its
/// placement up). The caller syncs the rank's view.
void take_back(prefill_balancer_state& st, const std::string& name, const prefill_balancer_state::charge& c) {
  auto i = st.registry.index_of(name);
  if (!i) return;  // the rank is gone
  auto& r = st.registry.loads[*i];
  r.queued_tokens -= std::min(r.queued_tokens, c.tokens);
  r.num_running -= std::min(r.num_running, 1u);
  r.predicted_us = std::max(0.0, r.predicted_us - c.predicted_us);
}

/// Takes back the charges (see prefill_balancer_state::charges) no report has replaced within
/// cfg.charge_ttl_ms: their prompts never reached their ranks.
void expire_charges(pointer self) {
  auto& st = self->state;
  st.charges.expire(
      self->clock().now() - std::chrono::milliseconds{st.cfg.charge_ttl_ms},
      [&](const std::string& name, const prefill_balancer_state::charge& c) { take_back(st, name, c); },
      [&](const std::string& name, size_t n) {
        auto i = st.registry.index_of(name);
        if (!i) return;
        st.log.add({0, name, std::to_string(n) + " placement(s) no report followed within charge_ttl_ms (" +
                                 std::to_string(st.cfg.charge_ttl_ms) + " ms): taken back"});
        sync_view(st, *i);
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

/// The chosen rank for `q` under the configured policy, counted as its load until its next
/// report (so a burst spreads instead of piling onto the rank that looked idle).
std::optional<prefill_placement> try_place(pointer self, const place_query& q) {
  auto& st = self->state;
  expire_charges(self);
  std::vector<policies::prefill_rank_load> loads;
  uint32_t open = 0;  // ranks taking work (not draining, not stepped aside)
  if (st.policy != policies::prefill_policy::seed)
    for (size_t i = 0; i < st.registry.loads.size(); ++i) {
      const auto& r = st.registry.loads[i];
      loads.push_back({r.queued_tokens, r.num_running, st.registry.open(i)});
      open += st.registry.open(i) ? 1 : 0;
    }
  std::optional<size_t> pick;
  std::string why;
  switch (st.policy) {
    case policies::prefill_policy::seed: pick = place_seed(self, q, &why); break;
    case policies::prefill_policy::least_loaded:
      pick = policies::least_loaded_prefill(loads);
      if (pick) why = "least_loaded: " + std::to_string(loads[*pick].queued_tokens) + " queued tokens";
      break;
    case policies::prefill_policy::round_robin: {
      std::vector<bool> avail;
      for (size_t i = 0; i < st.registry.loads.size(); ++i) avail.push_back(st.registry.open(i));
      pick = policies::round_robin(avail, st.rr_cursor);
      why = "round_robin";
      break;
    }
    case policies::prefill_policy::split: {
      // Seed 002: a long prompt goes to several ranks, in parts of equal predicted time (later
      // parts are shorter: they attend to more), page-aligned so no two ranks write one page.
      const uint32_t ps = loads.empty() ? 16 : std::max<uint32_t>(1, st.registry.loads[0].page_size_tokens);
      const uint32_t parts = std::min<uint32_t>({st.cfg.split_max_parts, open,
                                                 q.new_tokens / std::max<uint32_t>(ps, 1)});
      if (q.cached_tokens == 0 && q.new_tokens >= st.cfg.split_min_tokens && parts >= 2 && !q.whole_prompt)
        return place_split(self, q, parts, ps);
      pick = policies::least_loaded_prefill(loads);
      if (pick)
        why = "split: not split (" + std::to_string(q.new_tokens) + " tokens" + (q.whole_prompt ? ", computed whole: scored or one token" : "") +
              "), least_loaded";
      break;
    }
    case policies::prefill_policy::cache_affinity: {
      // Cached tokens per rank: the leading blocks of this prompt that were placed there before
      // (and so sit in that rank's local tier unless evicted since).
      st.placed_keys.resize(loads.size());
      const uint64_t block = q.block_tokens;
      std::vector<uint64_t> cached(loads.size(), 0);
      for (size_t i = 0; i < loads.size(); ++i) cached[i] = st.placed_keys[i].leading(q.block_keys) * block;
      if (auto d = policies::cache_affinity_prefill(loads, cached, st.cfg.affinity_max_queued_tokens)) {
        pick = d->rank;
        why = d->by_affinity ? "cache_affinity: holds " + std::to_string(d->cached_tokens) + " cached tokens"
                             : "cache_affinity: no rank holds the prefix, least-loaded";
      }
      break;
    }
  }
  if (!pick) return std::nullopt;
  auto& r = st.registry.loads[*pick];
  const double cost = st.cfg.cost.prefill_us(q.new_tokens, q.cached_tokens);
  why += fmt(" [q %.0f, c %.0f]", q.new_tokens, q.cached_tokens);
  r.queued_tokens += q.new_tokens;
  r.num_running += 1;
  r.predicted_us += cost;
  st.charges.add(r.name, {self->clock().now(), q.new_tokens, cost, q.request_id, q.attempt});
  sync_view(st, *pick);
  if (!q.block_keys.empty()) {
    st.placed_keys.resize(st.registry.loads.size());
    st.placed_keys[*pick].add(q.block_keys);
  }
  st.log.add({q.request_id, r.name, why});
  return prefill_placement{r.name, st.registry.ranks[*pick], why};
}

/// A placement that waited its time out: a prefill rank refuses nothing for lack of room (its
/// queue grows), so none took it because none takes work: say which state each is in, so the
/// operator reads a drain or a broken engine, not a silent balancer (rank_unavailable: retryable).
caf::error none_took(const prefill_balancer_state& st, const place_query& q) {
  const auto wait = std::chrono::milliseconds{q.wait_ms ? q.wait_ms : parked_wait_default_ms};
  std::string ranks;
  for (size_t i = 0; i < st.registry.loads.size(); ++i) {
    const auto& r = st.registry.loads[i];
    ranks += (ranks.empty() ? "" : "; ") + r.name + ": " +
             (st.registry.draining[i] ? std::string{"draining"}
              : r.unavailable.empty() ? std::string{"takes work"}
                                      : "stepped aside (" + r.unavailable + ")");
  }
  return make_error(errc::rank_unavailable,
                    where(q.request_id, "", "place_prefill") + ": no prefill rank took the prompt within " +
                        std::to_string((wait - parked_answer_margin(wait)).count()) + " ms (" +
                        (ranks.empty() ? std::string{"none has registered yet"} : ranks) + ")");
}

/// Places what is parked while ranks take it; those past their deadline are told why first.
void serve(pointer self) {
  serve_parked(self->state.parked, self->state.priority, self->clock().now(), "place_prefill",
               [=](const place_query& q) { return try_place(self, q); },
               [=](const place_query& q) { return none_took(self->state, q); });
}

prefill_balancer_actor::behavior_type prefill_balancer_impl(pointer self, prefill_balancer_config cfg) {
  auto& st = self->state;
  st.policy = *policies::parse_prefill_policy(cfg.policy);  // validated by the caller
  st.log.capacity = cfg.decision_log_size;
  st.cfg = std::move(cfg);
  st.started = self->clock().now();
  // A rank that goes away (its process ended) takes no more placements; its prompts are
  // re-placed by their request actors, which watch it too.
  self->set_down_handler([=](caf::down_msg& dm) {
    forget_rank(self->state, dm.source, "forgotten: it went down", false, self->clock().now());
    after_rank_change(self);
  });
  return {
      [=](place_atom, place_query& q) -> caf::result<prefill_placement> {
        const auto grace = std::chrono::milliseconds{self->state.cfg.no_rank_grace_ms};
        if (auto none = self->state.registry.none_taking_work("prefill", self->clock().now(), grace); !none.empty())
          return make_error(errc::rank_unavailable, where(q.request_id, "", "place_prefill") + ": " + none);
        if (auto p = try_place(self, q)) return std::move(*p);
        auto promise = self->make_response_promise<prefill_placement>();
        drop_expired(self->state.parked, self->clock().now(), "place_prefill",
                     [=](const place_query& x) { return none_took(self->state, x); });
        park(self->state.parked, std::move(q), promise, self->clock().now());
        arm_charge_expiry(self);
        arm_grace_check(self);
        arm_parked_expiry(self);
        return promise;
      },
      [=](timer_atom) { grace_timer_fired(self, "prefill", "place_prefill"); },
      [=](parked_due_atom) { parked_timer_fired(self, [=] { serve(self); }); },
      [=](load_atom, rank_load& load, prefill_rank_actor& rank) {
        auto& st = self->state;
        const std::string name = load.name;
        if (st.registry.report(std::move(load), rank, st.log)) self->monitor(rank);
        // The report counts the orders that reached the rank; placements still on their way keep
        // their charges on top of it.
        if (auto i = st.registry.index_of(rank)) {
          st.charges.reported(name, st.registry.loads[*i].settled, [&](prefill_balancer_state::charge& c) {
            auto& r = st.registry.loads[*i];
            r.queued_tokens += c.tokens;
            r.num_running += 1;
            r.predicted_us += c.predicted_us;
          });
          st.registry.loads[*i].settled.clear();
          sync_view(st, *i);
        }
        serve(self);
        after_rank_change(self);
      },
      [=](release_atom, uint64_t request_id, uint32_t attempt) {
        // Its attempt gave up between placement and order: the work it was charged (each part
        // of a split) never comes, and a placement of it still parked is void.
        auto& st = self->state;
        drop_parked(st.parked, request_id, attempt, "place_prefill");
        const auto freed = st.charges.cancel(request_id, attempt, [&](const std::string& name, const auto& c) {
          take_back(st, name, c);
          if (auto i = st.registry.index_of(name)) sync_view(st, *i);
        });
        if (freed) serve(self);
      },
      [=](expire_atom) {
        self->state.charges.timer_fired();
        expire_charges(self);
        serve(self);
        arm_charge_expiry(self);
      },
      [=](stats_atom) {
        // With each prefill rank's length bucket (the elastic controller weighs buckets apart).
        auto& st = self->state;
        auto loads = st.registry.stats();
        if (st.buckets && st.cfg.ranks_per_engine > 0)
          for (size_t i = 0; i < loads.size(); ++i)
            if (const auto e = i / st.cfg.ranks_per_engine; e < st.buckets->engine_buckets().size())
              loads[i].bucket = st.buckets->engine_buckets()[e];
        return loads;
      },
      [=](parked_atom) { return static_cast<uint32_t>(self->state.parked.size()); },
      [=](events_atom) { return self->state.log.snapshot(); },
      [=](forget_atom, prefill_rank_actor& rank) {
        forget_rank(self->state, caf::actor_cast<caf::actor_addr>(rank), "forgotten: its node is gone", true,
                    self->clock().now());
        after_rank_change(self);
      },
      [=](rejoin_atom, prefill_rank_actor& rank, bool keep_draining) {
        self->state.registry.rejoin(caf::actor_cast<caf::actor_addr>(rank), keep_draining);
      },
      [=](drain_atom, prefill_rank_actor& rank) {
        auto& st = self->state;
        if (auto i = st.registry.index_of(rank)) {
          st.log.add({0, st.registry.loads[*i].name, "draining: no new placements"});
          st.registry.draining[*i] = true;
          sync_view(st, *i);
        }
        after_rank_change(self);
      },
      [=](undrain_atom, prefill_rank_actor& rank) {
        auto& st = self->state;
        if (auto i = st.registry.index_of(rank); i && st.registry.draining[*i]) {
          st.log.add({0, st.registry.loads[*i].name, "undrained: placements again"});
          st.registry.draining[*i] = false;
          sync_view(st, *i);
          serve(self);
        }
        after_rank_change(self);
      },
  };
}

}  // namespace

prefill_balancer_actor spawn_prefill_balancer(caf::actor_system& sys, prefill_balancer_config cfg) {
  return sys.spawn(prefill_balancer_impl, std::move(cfg));
}

}  // namespace baton

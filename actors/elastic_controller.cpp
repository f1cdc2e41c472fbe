#include "actors/elastic_controller.hpp"

#include <caf/actor_ostream.hpp>
#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>

namespace baton {

namespace {

/// A move in progress: the instance, where it stands, and the change record it fills in.
struct pending_move {
  size_t instance = 0;
  bool to_prefill = false;
  caf::actor_clock::time_point decided;
  size_t log_index = 0;
};

struct controller_state {
  elastic_controller_config cfg;
  std::vector<elastic_instance> elastic;
  std::vector<bool> serves_prefill;  ///< each instance's current role
  std::vector<bool> gone;            ///< its node process left or died: no signals, no moves
  std::vector<prefill_rank_actor> fixed_prefill;
  std::vector<decode_rank_actor> fixed_decode;
  prefill_balancer_actor prefill_balancer;
  decode_balancer_actor decode_balancer;
  std::unique_ptr<policies::role_planner> planner;
  caf::actor_clock::time_point started;
  std::optional<pending_move> move;
  bool asking = false;  ///< a round of stats requests is out
  std::vector<role_change> log;
  static inline const char* name = "baton.elastic_controller";
};

using pointer = elastic_controller_actor::stateful_pointer<controller_state>;

double seconds_since(pointer self, caf::actor_clock::time_point t) {
  return std::chrono::duration<double>(self->clock().now() - t).count();
}

void tick_later(pointer self) {
  self->delayed_send(self, std::chrono::milliseconds{self->state.cfg.interval_ms}, timer_atom::value);
}

/// Tells an instance's actor that it serves its role. A rank gone meanwhile answers with an
/// error, which its node's loss reports: ignored here (unhandled, it would end this actor).
template <class Handle>
void make_active(pointer self, const Handle& rank) {
  self->request(rank, caf::infinite, role_atom::value, true).then([](bool) {}, [](caf::error&) {});
}

policies::rank_signal signal_of(const rank_stats& s, policies::rank_role role, bool movable) {
  policies::rank_signal r;
  r.name = s.name;
  r.role = role;
  r.movable = movable;
  r.open = s.unavailable.empty();
  r.running = s.num_running + s.num_waiting;
  if (role == policies::rank_role::prefill) {
    r.predicted_queue_ms = s.predicted_us / 1e3;
  } else {
    r.step_ms = s.num_running > 0 ? s.recent_step_us / 1e3 : 0.0;  // an idle rank's last step is history
    r.kv_used = s.num_total_pages ? 1.0 - static_cast<double>(s.num_free_pages) / s.num_total_pages : 0.0;
  }
  return r;
}

void print_outcome(pointer self, const role_change& rec) {
  if (self->state.cfg.print_moves)
    caf::aout(self) << "elastic: " << rec.rank << " " << rec.from << " -> " << rec.to << " " << rec.state << " after "
                    << rec.drain_s << " s" << std::endl;
}

/// Step 2 of a move: once the draining actor is idle, it goes on standby, its balancer forgets
/// it, and the instance's other actor takes over.
void continue_move(pointer self) {
  auto& st = self->state;
  auto& m = *st.move;
  auto& inst = st.elastic[m.instance];
  auto& rec = st.log[m.log_index];
  if (seconds_since(self, m.decided) * 1e3 > st.cfg.drain_timeout_ms) {
    // It keeps its old role and serves on in it: its balancer places on it again, and the rank
    // is told it is active (a decode rank stops handing its sequences over; a standby answer
    // still in flight is overridden, since the controller's messages arrive in order).
    if (m.to_prefill) {
      self->send(st.decode_balancer, undrain_atom::value, inst.decode);
      make_active(self, inst.decode);
    } else {
      self->send(st.prefill_balancer, undrain_atom::value, inst.prefill);
      make_active(self, inst.prefill);
    }
    rec.state = "abandoned";
    rec.drain_s = seconds_since(self, m.decided);
    print_outcome(self, rec);
    st.move.reset();
    return;
  }
  const size_t this_move = m.log_index;
  auto finish = [=](bool ok) {
    auto& st = self->state;
    // Still busy (the next tick asks again), or the answer of a move since abandoned.
    if (!ok || !st.move || st.move->log_index != this_move) return;
    auto& m = *st.move;
    auto& inst = st.elastic[m.instance];
    // The old role's balancer forgets the instance (ignoring a late report of it) and the new
    // role's may take it back (it forgot it at an earlier move) before the rank reports.
    if (m.to_prefill) {
      self->send(st.decode_balancer, forget_atom::value, inst.decode);
      self->send(st.prefill_balancer, rejoin_atom::value, inst.prefill, false);
      make_active(self, inst.prefill);
    } else {
      self->send(st.prefill_balancer, forget_atom::value, inst.prefill);
      self->send(st.decode_balancer, rejoin_atom::value, inst.decode, false);
      make_active(self, inst.decode);
    }
    st.serves_prefill[m.instance] = m.to_prefill;
    auto& rec = st.log[m.log_index];
    rec.state = "done";
    rec.drain_s = seconds_since(self, m.decided);
    print_outcome(self, rec);
    st.move.reset();
  };
  // Standby refuses while the actor still has work; the answer says which it was.
  if (m.to_prefill)
    self->request(inst.decode, caf::infinite, role_atom::value, false).then(finish, [=](caf::error&) { finish(false); });
  else
    self->request(inst.prefill, caf::infinite, role_atom::value, false).then(finish, [=](caf::error&) { finish(false); });
  (void) rec;
}

/// Step 1: every active rank's stats, then the planner's verdict.
void plan_round(pointer self) {
  auto& st = self->state;
  if (st.asking) return;
  st.asking = true;
  struct round {
    std::vector<policies::rank_signal> signals;
    std::map<std::string, uint32_t> buckets;  ///< prefill rank -> its length bucket
    size_t left = 0;
  };
  auto r = std::make_shared<round>();
  r->left = st.fixed_prefill.size() + st.fixed_decode.size() +
            static_cast<size_t>(std::count(st.gone.begin(), st.gone.end(), false));
  if (r->left == 0) {  // nobody to ask yet (node processes still joining)
    st.asking = false;
    return;
  }
  ++r->left;  // and the prefill balancer, for the ranks' length buckets
  auto done = [=] {
    auto& st = self->state;
    if (--r->left > 0) return;
    st.asking = false;
    if (st.move) return;  // one move at a time
    for (auto& s : r->signals)
      if (auto b = r->buckets.find(s.name); b != r->buckets.end() && s.role == policies::rank_role::prefill) s.bucket = b->second;
    auto m = st.planner->plan(seconds_since(self, st.started), r->signals);
    if (!m) return;
    for (size_t i = 0; i < st.elastic.size(); ++i) {
      if (st.elastic[i].name != m->rank || st.gone[i]) continue;
      const bool to_prefill = m->to == policies::rank_role::prefill;
      st.log.push_back({seconds_since(self, st.started), m->rank, policies::to_string(m->from),
                        policies::to_string(m->to), m->why, "draining", 0});
      st.move = pending_move{i, to_prefill, self->clock().now(), st.log.size() - 1};
      if (st.cfg.print_moves)
        caf::aout(self) << "elastic: " << m->rank << " " << st.log.back().from << " -> " << st.log.back().to
                        << " (draining): " << m->why << std::endl;
      // No new work for it from now on; what it has, it finishes (prefill) or hands over with
      // its KV (decode, migrate_on_drain).
      if (to_prefill) {
        self->send(st.decode_balancer, drain_atom::value, st.elastic[i].decode);
        if (st.cfg.migrate_on_drain) self->send(st.elastic[i].decode, migrate_atom::value);
      } else
        self->send(st.prefill_balancer, drain_atom::value, st.elastic[i].prefill);
      return;
    }
  };
  auto ask = [=](auto handle, policies::rank_role role, bool movable) {
    self->request(handle, std::chrono::seconds{10}, stats_atom::value)
        .then(
            [=](const rank_stats& s) {
              r->signals.push_back(signal_of(s, role, movable));
              done();
            },
            [=](caf::error&) { done(); });  // a rank that does not answer gives no signal
  };
  self->request(st.prefill_balancer, std::chrono::seconds{10}, stats_atom::value)
      .then(
          [=](const std::vector<rank_load>& loads) {
            for (const auto& l : loads) r->buckets[l.name] = l.bucket;
            done();
          },
          [=](caf::error&) { done(); });
  for (const auto& p : st.fixed_prefill) ask(p, policies::rank_role::prefill, false);
  for (const auto& d : st.fixed_decode) ask(d, policies::rank_role::decode, false);
  for (size_t i = 0; i < st.elastic.size(); ++i) {
    if (st.gone[i]) continue;
    // The instance's active side (while it drains, still the old one: its pressure counts).
    if (st.serves_prefill[i])
      ask(st.elastic[i].prefill, policies::rank_role::prefill, true);
    else
      ask(st.elastic[i].decode, policies::rank_role::decode, true);
  }
}

/// Ranks whose node left, died or drains: they give no signal and are never moved again; a move
/// of one of them in progress is over ("lost").
void forget_ranks(pointer self, const std::vector<caf::actor_addr>& leaving) {
  auto& st = self->state;
  auto is_leaving = [&](const caf::actor_addr& a) { return std::find(leaving.begin(), leaving.end(), a) != leaving.end(); };
  for (size_t i = 0; i < st.elastic.size(); ++i) {
    if (st.gone[i] || (!is_leaving(st.elastic[i].prefill.address()) && !is_leaving(st.elastic[i].decode.address()))) continue;
    st.gone[i] = true;
    if (st.move && st.move->instance == i) {
      auto& rec = st.log[st.move->log_index];
      rec.state = "lost";
      rec.drain_s = seconds_since(self, st.move->decided);
      print_outcome(self, rec);
      st.move.reset();
    }
  }
  auto drop = [&](auto& list) {
    list.erase(std::remove_if(list.begin(), list.end(), [&](const auto& a) { return is_leaving(a.address()); }), list.end());
  };
  drop(st.fixed_prefill);
  drop(st.fixed_decode);
}

/// A node given up for gone is back (its heartbeats resumed; the directory let its ranks back
/// into the balancers, draining as they were): its instances are planned again, and each serves
/// in the role it had. A move lost with the node never finished, so that is the old one, whose
/// side was drained for it: it is undrained and told it is active, as an abandoned move's is.
void rejoin_ranks(pointer self, const node_ranks& back) {
  auto& st = self->state;
  auto has = [](const auto& list, const auto& rank) { return std::find(list.begin(), list.end(), rank) != list.end(); };
  for (size_t i = 0; i < st.elastic.size(); ++i) {
    auto& inst = st.elastic[i];
    if (!st.gone[i] || !has(back.prefill, inst.prefill) || !has(back.decode, inst.decode)) continue;
    st.gone[i] = false;
    // Both orders the rank's next report may take: still set aside, it comes back open
    // (rejoin without keep_draining); back already, draining, it is opened (undrain).
    if (st.serves_prefill[i]) {
      self->send(st.prefill_balancer, rejoin_atom::value, inst.prefill, false);
      self->send(st.prefill_balancer, undrain_atom::value, inst.prefill);
      make_active(self, inst.prefill);
    } else {
      self->send(st.decode_balancer, rejoin_atom::value, inst.decode, false);
      self->send(st.decode_balancer, undrain_atom::value, inst.decode);
      make_active(self, inst.decode);
    }
  }
  // Its fixed ranks give signals again.
  auto elastic_side = [&](const auto& rank) {
    return std::any_of(st.elastic.begin(), st.elastic.end(), [&](const elastic_instance& e) {
      return e.prefill.address() == rank.address() || e.decode.address() == rank.address();
    });
  };
  for (const auto& p : back.prefill)
    if (!elastic_side(p) && !has(st.fixed_prefill, p)) st.fixed_prefill.push_back(p);
  for (const auto& d : back.decode)
    if (!elastic_side(d) && !has(st.fixed_decode, d)) st.fixed_decode.push_back(d);
}

elastic_controller_actor::behavior_type controller_impl(pointer self, elastic_controller_config cfg,
                                                        std::vector<elastic_instance> elastic,
                                                        std::vector<prefill_rank_actor> fixed_prefill,
                                                        std::vector<decode_rank_actor> fixed_decode,
                                                        prefill_balancer_actor pb, decode_balancer_actor db) {
  auto& st = self->state;
  st.planner = std::make_unique<policies::role_planner>(cfg.planner);
  st.cfg = std::move(cfg);
  for (const auto& e : elastic) st.serves_prefill.push_back(e.serves_prefill);
  st.gone.assign(elastic.size(), false);
  st.elastic = std::move(elastic);
  st.fixed_prefill = std::move(fixed_prefill);
  st.fixed_decode = std::move(fixed_decode);
  st.prefill_balancer = std::move(pb);
  st.decode_balancer = std::move(db);
  st.started = self->clock().now();
  // A node process's ranks leave with it: they give no signal and are never moved again; a move
  // of one of them in progress is over.
  self->set_down_handler([=](caf::down_msg& dm) { forget_ranks(self, {dm.source}); });
  tick_later(self);
  return {
      [=](controller_join& j) {
        auto& st = self->state;
        if (j.prefill && j.decode) {
          self->monitor(j.prefill);
          self->monitor(j.decode);
          st.serves_prefill.push_back(j.serves_prefill);
          st.gone.push_back(false);
          st.elastic.push_back({std::move(j.name), std::move(j.prefill), std::move(j.decode), j.serves_prefill});
        } else if (j.prefill) {
          self->monitor(j.prefill);
          st.fixed_prefill.push_back(std::move(j.prefill));
        } else if (j.decode) {
          self->monitor(j.decode);
          st.fixed_decode.push_back(std::move(j.decode));
        }
      },
      [=](timer_atom) {
        if (self->state.move)
          continue_move(self);
        else
          plan_round(self);
        tick_later(self);
      },
      [=](events_atom) { return self->state.log; },
      [=](drain_atom, const node_ranks& ranks) {
        std::vector<caf::actor_addr> leaving;
        for (const auto& r : ranks.prefill) leaving.push_back(r.address());
        for (const auto& r : ranks.decode) leaving.push_back(r.address());
        forget_ranks(self, leaving);
      },
      [=](rejoin_atom, const node_ranks& ranks) { rejoin_ranks(self, ranks); },
  };
}

}  // namespace

elastic_controller_actor spawn_elastic_controller(caf::actor_system& sys, elastic_controller_config cfg,
                                                  std::vector<elastic_instance> elastic,
                                                  std::vector<prefill_rank_actor> fixed_prefill,
                                                  std::vector<decode_rank_actor> fixed_decode,
                                                  prefill_balancer_actor prefill_balancer,
                                                  decode_balancer_actor decode_balancer) {
  return sys.spawn(controller_impl, std::move(cfg), std::move(elastic), std::move(fixed_prefill),
                   std::move(fixed_decode), std::move(prefill_balancer), std::move(decode_balancer));
}

}  // namespace baton

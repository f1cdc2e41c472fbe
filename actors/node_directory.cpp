#include "actors/node_directory.hpp"

#include <algorithm>
#include <map>

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

namespace baton {

namespace {

struct node_entry {
  node_hello hello;
  node_ranks ranks;  ///< the node's ranks, once it has started them
  caf::actor_addr agent;
  caf::actor_clock::time_point last_heartbeat;
  std::string state = "joined";
};

using cards_promise = caf::typed_response_promise<std::vector<std::string>>;

/// A post that came while a lost meeting still had members on live nodes: it waits for them to
/// leave, then starts the group's next meeting.
struct queued_post {
  uint32_t first = 0;
  std::vector<std::string> cards;
  std::string node;
  cards_promise promise;
};

/// Members of one group swapping cards; each posting waits for the last one. A meeting that
/// lost a member's node is over: once every node that posted to it has gone too (survivors
/// leave to be restarted), the group meets afresh, so restarted nodes re-form it.
struct meeting {
  uint32_t size = 0;
  std::vector<std::string> cards;
  std::vector<bool> posted;
  std::vector<std::string> nodes;  ///< [member]: the node that posted it
  std::string lost;                ///< why the group can no longer meet (a node that posted went)
  std::vector<cards_promise> waiting;
  std::vector<queued_post> queued;  ///< posts for the next meeting, while this lost one empties
  bool done = false;

  void start(uint32_t members) {
    *this = meeting{};
    size = members;
    cards.resize(size);
    posted.resize(size, false);
    nodes.resize(size);
  }
};

struct node_directory_state {
  node_directory_config cfg;
  std::map<std::string, meeting> meetings;  ///< rendezvous_atom, by group
  cluster_welcome welcome;
  std::map<std::string, node_entry> nodes;
  bool sweeping = false;  ///< a liveness sweep is scheduled
  static inline const char* name = "baton.node_directory";
};

using pointer = node_directory_actor::stateful_pointer<node_directory_state>;

/// Whether every node that posted to `m` is gone (or never joined: it is not serving).
bool posters_gone(const node_directory_state& st, const meeting& m) {
  for (const auto& n : m.nodes) {
    if (n.empty()) continue;
    auto i = st.nodes.find(n);
    if (i != st.nodes.end() && i->second.state != "gone") return false;
  }
  return true;
}

/// Why an open meeting cannot take this post (empty: it can).
std::string refusal(const meeting& r, uint32_t first, const std::vector<std::string>& cards) {
  const std::string who = cards.size() == 1 ? "member " + std::to_string(first)
                                            : "members " + std::to_string(first) + " to " +
                                                  std::to_string(first + cards.size() - 1);
  // Members that met hold each other's addresses; a late one cannot join them.
  if (r.done) return "the group already met; " + who + " cannot join it again";
  for (uint32_t i = 0; i < cards.size(); ++i)
    if (r.posted[first + i]) return "member " + std::to_string(first + i) + " posted twice";
  return {};
}

/// Records a post the meeting can take; answers every post with all the cards once the last
/// member has posted.
void take_post(meeting& r, uint32_t first, std::vector<std::string>& cards, const std::string& node,
               cards_promise promise) {
  for (uint32_t i = 0; i < cards.size(); ++i) {
    r.cards[first + i] = std::move(cards[i]);
    r.posted[first + i] = true;
    r.nodes[first + i] = node;
  }
  r.waiting.push_back(std::move(promise));
  if (std::count(r.posted.begin(), r.posted.end(), true) == static_cast<long>(r.size)) {
    r.done = true;
    for (auto& p : r.waiting) p.deliver(r.cards);
    r.waiting.clear();
  }
}

/// A lost meeting whose nodes have all gone: the group's next meeting starts with the posts that
/// waited for it.
void restart_if_empty(pointer self, const std::string& group, meeting& m) {
  if (m.lost.empty() || !posters_gone(self->state, m)) return;
  auto queued = std::move(m.queued);
  m.start(m.size);
  for (auto& q : queued)
    if (auto bad = refusal(m, q.first, q.cards); !bad.empty())
      q.promise.deliver(caf::make_error(caf::sec::invalid_argument, "rendezvous " + group + ": " + bad));
    else
      take_post(m, q.first, q.cards, q.node, q.promise);
}

/// Node `name` is gone: the other nodes of every data-parallel group it had members in are told
/// which members were lost, so that their members stop waiting for them at once (a killed
/// process leaves no abort word; they would otherwise wait out the all-to-all's timeout in a
/// step, and never notice while idle). A meeting still waiting can no longer complete: its posts
/// are answered with the reason, and later ones refused.
void tell_group_members(pointer self, const std::string& name, const std::string& why) {
  auto& st = self->state;
  for (auto& [group, m] : st.meetings) {
    std::vector<uint32_t> lost;
    for (uint32_t i = 0; i < m.nodes.size(); ++i)
      if (m.nodes[i] == name) lost.push_back(i);
    if (lost.empty()) continue;
    if (!m.lost.empty()) {  // already over: perhaps its last node just went
      restart_if_empty(self, group, m);
      continue;
    }
    const std::string what = "node " + name + ", which hosted " + std::to_string(lost.size()) + " of its " +
                             std::to_string(m.size) + " members, " + why;
    m.lost = what;
    if (!m.done) {
      for (auto& p : m.waiting) p.deliver(caf::make_error(caf::sec::request_receiver_down, "rendezvous " + group + ": " + what));
      m.waiting.clear();
    }
    std::vector<std::string> told;
    for (const auto& other : m.nodes) {
      if (other.empty() || other == name || std::find(told.begin(), told.end(), other) != told.end()) continue;
      told.push_back(other);
      auto i = st.nodes.find(other);
      if (i == st.nodes.end() || i->second.state == "gone") continue;
      if (auto agent = caf::actor_cast<node_agent_actor>(i->second.agent))
        self->send(agent, member_gone_atom::value, group, lost, what);
    }
    restart_if_empty(self, group, m);
  }
}

/// A node is gone (silent past the heartbeat timeout, or its agent went down): the balancers
/// forget its ranks and the router tells every request on them to re-place itself --
/// without waiting for the network to notice a dead connection, which can take minutes.
void mark_gone(pointer self, const std::string& name, node_entry& n, const std::string& why) {
  if (n.state == "gone") return;
  n.state = "gone";
  tell_group_members(self, name, why);
  auto& w = self->state.welcome;
  for (const auto& r : n.ranks.decode) self->send(w.decode_balancer, forget_atom::value, r);
  for (const auto& r : n.ranks.prefill) self->send(w.prefill_balancer, forget_atom::value, r);
  if (!n.ranks.names.empty())
    self->send(w.router, rank_gone_atom::value, n.ranks.names, "node " + name + " " + why);
}

node_directory_actor::behavior_type node_directory_impl(pointer self, node_directory_config cfg,
                                                        cluster_welcome welcome) {
  self->state.cfg = cfg;
  self->state.welcome = std::move(welcome);
  self->state.welcome.heartbeat_interval_ms = cfg.heartbeat_interval_ms;
  self->set_down_handler([=](caf::down_msg& dm) {
    for (auto& [name, n] : self->state.nodes)
      if (n.agent == dm.source) mark_gone(self, name, n, "went down (" + self->system().render(dm.reason) + ")");
  });
  // The liveness sweep runs only while nodes are registered: an idle directory schedules
  // nothing (sims run until no event is left).
  return {
      [=](join_atom, node_hello& hello) -> cluster_welcome {
        if (!self->state.sweeping) {
          self->state.sweeping = true;
          self->delayed_send(self, std::chrono::milliseconds{self->state.cfg.heartbeat_interval_ms}, timer_atom::value);
        }
        auto& n = self->state.nodes[hello.name];  // a node that rejoins replaces its old entry
        n.hello = std::move(hello);
        n.agent = caf::actor_cast<caf::actor_addr>(self->current_sender());
        n.last_heartbeat = self->clock().now();
        n.state = "joined";
        if (auto agent = caf::actor_cast<caf::actor>(self->current_sender())) self->monitor(agent);
        return self->state.welcome;
      },
      [=](heartbeat_atom, const std::string& name) {
        auto& st = self->state;
        auto i = st.nodes.find(name);
        if (i == st.nodes.end()) return;
        i->second.last_heartbeat = self->clock().now();
        // Back after a partition: its ranks rejoin the balancer by their next load report; the
        // requests that left them got their leases released, so nothing runs twice for long.
        if (i->second.state == "gone") {
          i->second.state = "joined";
          if (!st.sweeping) {
            st.sweeping = true;
            self->delayed_send(self, std::chrono::milliseconds{st.cfg.heartbeat_interval_ms}, timer_atom::value);
          }
        }
      },
      [=](const std::string& name, node_ranks& ranks) {
        if (auto i = self->state.nodes.find(name); i != self->state.nodes.end()) i->second.ranks = std::move(ranks);
      },
      [=](rendezvous_atom, const std::string& group, uint32_t size, uint32_t first, std::vector<std::string>& cards,
          const std::string& node) -> caf::result<std::vector<std::string>> {
        const auto refuse = [&](const std::string& what) {
          return caf::make_error(caf::sec::invalid_argument, "rendezvous " + group + ": " + what);
        };
        if (size == 0 || cards.empty() || first + cards.size() > size)
          return refuse((cards.size() == 1 ? "member " + std::to_string(first)
                                           : "members " + std::to_string(first) + " to " +
                                                 std::to_string(first + cards.size() - 1)) +
                        " do not fit a group of " + std::to_string(size));
        // Checked before the meeting exists, so a misfit cannot fix the group's size for the others.
        auto found = self->state.meetings.find(group);
        if (found != self->state.meetings.end() && found->second.size != size)
          return refuse("a post for a group of " + std::to_string(size) + ", but the group has " +
                        std::to_string(found->second.size) + " members");
        auto& r = self->state.meetings[group];
        if (r.size == 0) r.start(size);
        if (!r.lost.empty()) {
          // The group lost a node: a restarted member waits until the others have left too, and
          // then meets them afresh as they come back.
          auto promise = self->make_response_promise<std::vector<std::string>>();
          r.queued.push_back({first, std::move(cards), node, promise});
          restart_if_empty(self, group, r);
          return promise;
        }
        if (auto bad = refusal(r, first, cards); !bad.empty()) return refuse(bad);
        auto promise = self->make_response_promise<std::vector<std::string>>();
        take_post(r, first, cards, node, promise);
        return promise;
      },
      [=](drain_atom, const std::string& name) {
        if (auto i = self->state.nodes.find(name); i != self->state.nodes.end()) i->second.state = "draining";
      },
      [=](stats_atom) {
        std::vector<node_status> out;
        const auto now = self->clock().now();
        for (const auto& [name, n] : self->state.nodes)
          out.push_back({name, n.hello.roles, n.hello.pid,
                         std::chrono::duration_cast<std::chrono::milliseconds>(now - n.last_heartbeat).count(), n.state});
        return out;
      },
      [=](timer_atom) {
        auto& st = self->state;
        const auto silence = std::chrono::milliseconds{uint64_t{st.cfg.heartbeat_interval_ms} * st.cfg.missed_heartbeats};
        const auto now = self->clock().now();
        bool watching = false;
        for (auto& [name, n] : st.nodes) {
          if (n.state != "gone" && now - n.last_heartbeat > silence)
            mark_gone(self, name, n,
                      "missed its heartbeats for " + std::to_string(silence.count()) + " ms");
          watching = watching || n.state != "gone";
        }
        st.sweeping = watching;  // every node gone: the sweep restarts at the next join
        if (watching)
          self->delayed_send(self, std::chrono::milliseconds{st.cfg.heartbeat_interval_ms}, timer_atom::value);

      },
  };
}

}  // namespace

node_directory_actor spawn_node_directory(caf::actor_system& sys, node_directory_config cfg, cluster_welcome welcome) {
  return sys.spawn(node_directory_impl, cfg, std::move(welcome));
}

}  // namespace baton

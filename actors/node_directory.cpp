#include "actors/node_directory.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <set>

#include <thread>

#include <caf/actor_system.hpp>
#include <caf/scoped_actor.hpp>
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
  /// Its agent went down: the process ended, or its connection to the head did (its agent then
  /// sees the head go, and joins afresh). Unlike a node gone silent, it never comes back by a
  /// heartbeat -- one still in flight from its start pulse must not revive it.
  bool ended = false;
  /// It was draining when it was marked gone: if it comes back, it still is.
  bool gone_draining = false;
  std::string gone_why;  ///< how it went (node_status::why)
  /// It went on purpose (node_status::left): its agent ended on its own, or it was draining when
  /// it went (a drain past its timeout, a kill to hurry it), and not to be restarted.
  bool left = false;
  bool drain_for_restart = false;  ///< its drain is a leave to be restarted (a group that could not re-form)
};

using cards_promise = caf::typed_response_promise<std::vector<std::string>>;

/// A post waiting for the rest of its meeting, or (queued) for a lost meeting to empty.
struct pending_post {
  uint32_t first = 0;
  std::vector<std::string> cards;  ///< moved into the meeting once taken
  std::string node;
  int32_t pid = 0;  ///< the posting process (node_hello::pid of its join)
  cards_promise promise;
  /// A survivor re-forming its group: after this long the meeting may close with the members
  /// present (0: it waits for every member, as a group's first meeting does).
  uint32_t shrink_after_ms = 0;
  caf::actor_addr poster;  ///< the actor that posted it (monitored: take_back_posts_of)
};

/// Members of one group swapping cards; each posting waits for the last one.
///
/// A meeting whose member's node went is lost: the other nodes are told and leave to be
/// restarted. Once every node that posted to it is gone, the group's next meeting starts, with
/// the posts of restarted nodes that came meanwhile. A node counts as gone once the directory
/// saw it go, or once it posted again (a new process under the old name). One that posted but
/// has not joined yet counts as alive: it is told when it joins.
struct meeting {
  uint32_t size = 0;
  std::vector<std::string> cards;
  std::vector<bool> posted;
  std::vector<std::string> nodes;  ///< [member]: the node that posted it
  std::vector<int32_t> pids;       ///< [member]: that node's process
  std::vector<pending_post> waiting;  ///< taken posts (cards moved out), answered when all are in
  bool done = false;
  std::string lost;                     ///< why the group can no longer meet (empty: it can)
  std::vector<uint32_t> lost_members;   ///< the members whose node went
  std::set<std::string> reposted;       ///< nodes of the lost meeting that posted again
  std::vector<pending_post> queued;     ///< posts for the next meeting, while this lost one empties
  uint64_t generation = 0;              ///< the group's meetings so far at this head: the first never shrinks
  std::vector<uint32_t> absent;         ///< members it closed without (it shrank); empty when all met
  bool grew = false;                    ///< lost because absent members came back (grow), not with a node
  uint64_t shrink_timer = 0;            ///< the shrink timer that counts (each post restarts it)

  /// A fresh meeting of `members`: every post still waiting here is answered with `why`.
  void start(uint32_t members, const std::string& why) {
    for (auto* list : {&waiting, &queued})
      for (auto& p : *list) p.promise.deliver(caf::make_error(caf::sec::request_receiver_down, why));
    const auto next = generation + 1;
    *this = meeting{};
    generation = next;
    size = members;
    cards.resize(size);
    posted.resize(size, false);
    nodes.resize(size);
    pids.resize(size, 0);
  }
};

struct node_directory_state {
  node_directory_config cfg;
  std::map<std::string, meeting> meetings;  ///< rendezvous_atom, by group
  /// node -> group -> the members it posted; kept across a group's meetings, so that a node the
  /// directory gave up on (missed heartbeats) and that comes back can be told its groups went on.
  std::map<std::string, std::map<std::string, std::vector<uint32_t>>> node_groups;
  cluster_welcome welcome;
  std::map<std::string, node_entry> nodes;
  bool sweeping = false;  ///< a liveness sweep is scheduled
  /// When the last sweep ran (or the first was armed): a sweep that comes far later than its
  /// interval found this process stalled (stopped, starved), with the nodes' heartbeats of that
  /// time still queued behind it.
  caf::actor_clock::time_point last_sweep{};
  /// Processes a newer one under their name replaced while they may still run, by incarnation:
  /// told to leave (their agent, not whoever sends their heartbeats: a starting node's pulse) at
  /// their next heartbeat, or they would run on, serving nothing. Bounded: the oldest go first.
  struct replaced_process {
    std::string name;
    int32_t by_pid = 0;
    caf::actor_addr agent;
  };
  std::map<uint64_t, replaced_process> replaced;
  std::deque<uint64_t> replaced_order;
  uint64_t shrinks = 0;   ///< meetings closed without every member: each numbers its shrunk group
  uint64_t timers = 0;    ///< shrink timers started (meeting::shrink_timer names the one that counts)
  static inline const char* name = "baton.node_directory";
};

using pointer = node_directory_actor::stateful_pointer<node_directory_state>;

std::string roles_text(const std::vector<std::string>& roles) {
  std::string out;
  for (const auto& r : roles) out += (out.empty() ? "" : "+") + r;
  return out.empty() ? "role-less" : out;
}

std::string members_text(uint32_t first, size_t count) {
  return count == 1 ? "member " + std::to_string(first)
                    : "members " + std::to_string(first) + " to " + std::to_string(first + count - 1);
}

/// Whether every node that posted to lost meeting `m` is gone.
bool posters_gone(const node_directory_state& st, const meeting& m) {
  for (const auto& n : m.nodes) {
    if (n.empty() || m.reposted.count(n)) continue;
    auto i = st.nodes.find(n);
    if (i == st.nodes.end() || i->second.state != "gone") return false;
  }
  return true;
}

/// Answers and removes `node`'s posts in `list`: the node posted again (the process that made
/// them gave up, or died, while waiting), and the newest post wins.
void void_posts_of(std::vector<pending_post>& list, const std::string& group, const std::string& node) {
  std::erase_if(list, [&](pending_post& p) {
    if (p.node != node) return false;
    p.promise.deliver(caf::make_error(caf::sec::invalid_argument,
                                      "rendezvous " + group + ": node " + node + " posted again; this post is void"));
    return true;
  });
}

/// The same for an open meeting, whose slots the old posts held.
void drop_posts_of(meeting& r, const std::string& group, const std::string& node) {
  for (uint32_t i = 0; i < r.size; ++i)
    if (r.nodes[i] == node) r.posted[i] = false, r.nodes[i].clear();
  void_posts_of(r.waiting, group, node);
}

/// The posts the actor `poster` made, taken back from every meeting that has not met: it went
/// down (its process ended, say after waiting out its meeting), so its members' slots are free
/// again for a stand-in, and no meeting completes with the card of a process that is gone.
void take_back_posts_of(node_directory_state& st, const caf::actor_addr& poster) {
  for (auto& [group, r] : st.meetings) {
    std::erase_if(r.queued, [&](const pending_post& p) { return p.poster == poster; });
    if (r.done) continue;
    std::erase_if(r.waiting, [&](const pending_post& p) {
      if (p.poster != poster) return false;
      for (uint32_t i = 0; i < r.size; ++i)
        if (r.nodes[i] == p.node && r.pids[i] == p.pid) r.posted[i] = false, r.nodes[i].clear(), r.pids[i] = 0;
      return true;
    });
  }
}

/// Why an open meeting cannot take this post (empty: it can).
std::string refusal(const meeting& r, uint32_t first, const std::vector<std::string>& cards) {
  // Members that met hold each other's addresses; a late one cannot join them.
  if (r.done) return "the group already met; " + members_text(first, cards.size()) + " cannot join it again";
  for (uint32_t i = 0; i < cards.size(); ++i)
    if (r.posted[first + i]) return "member " + std::to_string(first + i) + " posted twice (by node " + r.nodes[first + i] + ")";
  return {};
}

/// Records a post the meeting can take; answers every post with all the cards once the last
/// member has posted. A post that lets the meeting shrink starts its timer (timer_atom).
void take_post(pointer self, const std::string& group, meeting& r, pending_post p) {
  const uint32_t shrink_after_ms = p.shrink_after_ms;
  auto& mine = self->state.node_groups[p.node][group];
  mine.clear();
  for (uint32_t i = 0; i < p.cards.size(); ++i) {
    r.cards[p.first + i] = std::move(p.cards[i]);
    r.posted[p.first + i] = true;
    r.nodes[p.first + i] = p.node;
    r.pids[p.first + i] = p.pid;
    mine.push_back(p.first + i);
  }
  r.waiting.push_back(std::move(p));
  if (std::count(r.posted.begin(), r.posted.end(), true) == static_cast<long>(r.size)) {
    r.done = true;
    for (auto& w : r.waiting) w.promise.deliver(r.cards);
    r.waiting.clear();
  } else if (shrink_after_ms > 0 && r.generation > 1) {
    // The delay counts from the latest post: a survivor still loading its weights is not left out.
    r.shrink_timer = ++self->state.timers;
    self->delayed_send(self, std::chrono::milliseconds{shrink_after_ms}, timer_atom::value, group, r.shrink_timer);
  }
}

/// Meeting `group`'s shrink timer `timer`: if no post came since it started and every post
/// waiting lets the meeting shrink, it closes with the members present. Each absent member's
/// card says so (absent_card and a serial), and the members present meet again as a smaller
/// group under "group~serial". A group's first meeting at a head never shrinks (take_post arms no
/// timer): a cluster starting up, or meeting again at a restarted head, waits for every member.
void shrink(pointer self, const std::string& group, uint64_t timer) {
  auto i = self->state.meetings.find(group);
  if (i == self->state.meetings.end()) return;
  auto& m = i->second;
  if (m.shrink_timer != timer || m.done || !m.lost.empty() || m.waiting.empty()) return;
  for (const auto& w : m.waiting)
    if (w.shrink_after_ms == 0) return;  // a node that does not let its group shrink
  const std::string card = std::string{absent_card} + std::to_string(++self->state.shrinks);
  for (uint32_t k = 0; k < m.size; ++k)
    if (!m.posted[k]) m.absent.push_back(k), m.cards[k] = card;
  m.done = true;
  for (auto& w : m.waiting) w.promise.deliver(m.cards);
  m.waiting.clear();
}

/// Whether `first` and the members after it (`count`) are all absent from shrunk meeting `r`.
bool all_absent(const meeting& r, uint32_t first, size_t count) {
  for (uint32_t k = first; k < first + count; ++k)
    if (std::find(r.absent.begin(), r.absent.end(), k) == r.absent.end()) return false;
  return count > 0;
}

/// Takes `p` into open meeting `r`, or answers it with the reason it cannot be taken.
void post_or_refuse(pointer self, const std::string& group, meeting& r, pending_post p) {
  drop_posts_of(r, group, p.node);
  if (auto bad = refusal(r, p.first, p.cards); !bad.empty()) {
    p.promise.deliver(caf::make_error(caf::sec::invalid_argument, "rendezvous " + group + ": " + bad));
    return;
  }
  take_post(self, group, r, std::move(p));
}

/// A lost meeting whose nodes have all gone: the group's next meeting starts with the posts that
/// waited for it.
void restart_if_empty(pointer self, const std::string& group, meeting& m) {
  if (m.lost.empty() || !posters_gone(self->state, m)) return;
  auto queued = std::move(m.queued);
  m.queued.clear();
  m.start(m.size, "rendezvous " + group + ": the group meets afresh");
  for (auto& q : queued) post_or_refuse(self, group, m, std::move(q));
}

/// Tells node `node`'s agent (if it has joined and is not gone) that `members` of `group` are lost.
void tell_node(pointer self, const std::string& node, const std::string& group, const std::vector<uint32_t>& members,
               const std::string& what, bool returned = false) {
  auto i = self->state.nodes.find(node);
  if (i == self->state.nodes.end() || i->second.state == "gone") return;  // told when it joins
  if (auto agent = caf::actor_cast<node_agent_actor>(i->second.agent))
    self->send(agent, member_gone_atom::value, group, members, what, returned);
}

/// Meeting `group` lost the members `node` posted (those of its process `pid` only, when not -1:
/// a restarted process under the same name may hold members of a newer meeting), for `why`: the
/// other nodes that posted to it
/// are told which members were lost, so that theirs stop waiting for them at once (a killed
/// process leaves no abort word; they would otherwise wait out the all-to-all's timeout in a
/// step, and never notice while idle), and leave to be restarted. Posts still waiting for the
/// meeting to complete are answered with the reason.
void lose(pointer self, const std::string& group, meeting& m, const std::string& node, const std::string& why,
          int32_t pid = -1) {
  std::vector<uint32_t> lost;
  for (uint32_t i = 0; i < m.nodes.size(); ++i)
    if (m.nodes[i] == node && (pid == -1 || m.pids[i] == pid)) lost.push_back(i);
  if (lost.empty()) return;
  if (!m.lost.empty()) return restart_if_empty(self, group, m);  // already over: perhaps its last node just went
  m.lost = "node " + node + ", which hosted " + std::to_string(lost.size()) + " of its " + std::to_string(m.size) +
           " members, " + why;
  m.lost_members = lost;
  for (auto& p : m.waiting)
    p.promise.deliver(caf::make_error(caf::sec::request_receiver_down, "rendezvous " + group + ": " + m.lost));
  m.waiting.clear();
  std::set<std::string> told;
  for (const auto& other : m.nodes)
    if (!other.empty() && other != node && told.insert(other).second) tell_node(self, other, group, lost, m.lost);
  restart_if_empty(self, group, m);
}

/// Members absent from shrunk meeting `m` came back (node `node` posted them): the meeting is
/// over, its nodes are told (naming the returning members, which their shrunk group lacks) and
/// re-form, and the group meets afresh at full size once each of them has posted again.
void grow(pointer self, const std::string& group, meeting& m, const std::string& node, uint32_t first, size_t count) {
  m.lost = members_text(first, count) + " came back (node " + node + "): the group meets again at full size";
  m.grew = true;
  m.lost_members.clear();
  for (uint32_t k = first; k < first + count; ++k) m.lost_members.push_back(k);
  std::set<std::string> told;
  for (const auto& other : m.nodes)
    if (!other.empty() && other != node && told.insert(other).second)
      tell_node(self, other, group, m.lost_members, m.lost, true);
}

/// Node `name`'s process `pid` is gone: every group it had members in loses them.
void tell_group_members(pointer self, const std::string& name, int32_t pid, const std::string& why) {
  for (auto& [group, m] : self->state.meetings) lose(self, group, m, name, why, pid);
}

/// Node `name` joined, or came back after it was marked gone: it hears of every group of its
/// that was lost meanwhile (it was not reachable to be told), so that it leaves too.
void tell_late_node(pointer self, const std::string& name) {
  auto& st = self->state;
  auto groups = st.node_groups.find(name);
  if (groups == st.node_groups.end()) return;
  for (const auto& [group, mine] : groups->second) {
    auto m = st.meetings.find(group);
    if (m == st.meetings.end()) continue;
    const bool in_meeting = std::find(m->second.nodes.begin(), m->second.nodes.end(), name) != m->second.nodes.end();
    if (in_meeting && m->second.lost.empty()) continue;  // its meeting stands
    std::vector<uint32_t> others;
    for (uint32_t i = 0; i < m->second.size; ++i)
      if (std::find(mine.begin(), mine.end(), i) == mine.end()) others.push_back(i);
    const std::string what = in_meeting ? m->second.lost
                                        : "node " + name + " was given up for lost, and group " + group + " went on without it";
    tell_node(self, name, group, in_meeting ? m->second.lost_members : others, what, in_meeting && m->second.grew);
  }
}

void remember_replaced(node_directory_state& st, uint64_t incarnation, node_directory_state::replaced_process p) {
  constexpr size_t max_replaced = 1024;
  if (st.replaced.emplace(incarnation, std::move(p)).second) st.replaced_order.push_back(incarnation);
  if (st.replaced_order.size() > max_replaced) {
    st.replaced.erase(st.replaced_order.front());
    st.replaced_order.pop_front();
  }
}

/// A node is gone (silent past the heartbeat timeout, or its agent went down): the balancers
/// forget its ranks and the router tells every request on them to re-place itself --
/// without waiting for the network to notice a dead connection, which can take minutes.
void log_line(pointer self, const std::string& line) {
  if (self->state.cfg.log) self->state.cfg.log(line);
}

void mark_gone(pointer self, const std::string& name, node_entry& n, const std::string& why) {
  if (n.state == "gone") return;
  log_line(self, "node " + name + " (" + roles_text(n.hello.roles) + ", pid " + std::to_string(n.hello.pid) + ") " + why +
                     (n.ranks.names.empty() ? std::string{} : "; its ranks are taken out of placement"));
  n.gone_draining = n.state == "draining";
  n.state = "gone";
  n.gone_why = why;
  tell_group_members(self, name, n.hello.pid, why);
  auto& w = self->state.welcome;
  for (const auto& r : n.ranks.decode) self->send(w.decode_balancer, forget_atom::value, r);
  for (const auto& r : n.ranks.prefill) self->send(w.prefill_balancer, forget_atom::value, r);
  if (!n.ranks.names.empty())
    self->send(w.router, rank_gone_atom::value, n.ranks.names, "node " + name + " " + why);
  // The elastic controller too: it would otherwise ask the silent node's ranks for stats each
  // round (waiting out each request's timeout) and might pick them for a move.
  if (w.elastic_controller) self->send(w.elastic_controller, drain_atom::value, n.ranks);
}

node_directory_actor::behavior_type node_directory_impl(pointer self, node_directory_config cfg,
                                                        cluster_welcome welcome) {
  self->state.cfg = cfg;
  self->state.welcome = std::move(welcome);
  self->state.welcome.heartbeat_interval_ms = cfg.heartbeat_interval_ms;
  self->set_down_handler([=](caf::down_msg& dm) {
    for (auto& [name, n] : self->state.nodes)
      if (n.agent == dm.source) {
        n.ended = true;
        // Once: a node given up before (missed heartbeats) keeps how it went.
        if (n.state != "gone") n.left = (!dm.reason || n.state == "draining") && !n.drain_for_restart;
        // No reason: its agent ended on its own (the node drained and left); else how it died.
        mark_gone(self, name, n, dm.reason ? "went down (" + self->system().render(dm.reason) + ")" : "left (its agent ended)");
      }
    take_back_posts_of(self->state, dm.source);
  });
  // The liveness sweep runs only while nodes are registered: an idle directory schedules
  // nothing (sims run until no event is left).
  return {
      [=](join_atom, node_hello& hello) -> caf::result<cluster_welcome> {
        const auto& head_model = self->state.cfg.model;
        if (!hello.model.empty() && !head_model.empty() && hello.model != head_model)
          return make_error(errc::bad_request, "node " + hello.name + " serves " + hello.model + ", but this cluster serves " +
                                                   head_model + ": start it with the head's --model (and --weights-seed)");
        const auto& cfg = self->state.cfg;
        // Like for like: a checkpoint's fingerprint against a checkpoint's, a seed against a seed.
        // A model directory exported from the head's seed (`baton export-model`) holds the
        // same weights under a fingerprint the seed has none of, and is let in.
        const auto drawn = [](const std::string& w) { return w.starts_with("weights drawn from seed"); };
        if (!hello.weights.empty() && !cfg.weights.empty() && drawn(hello.weights) == drawn(cfg.weights) &&
            hello.weights != cfg.weights)
          return make_error(errc::bad_request, "node " + hello.name + " serves the model with " + hello.weights +
                                                   ", but this cluster's are " + cfg.weights +
                                                   " (another checkpoint of it): its answers would not be this cluster's; "
                                                   "start it with the head's --model directory or --weights-seed");
        if (hello.page_tokens != 0 && cfg.page_tokens != 0 && hello.page_tokens != cfg.page_tokens)
          return make_error(errc::bad_request, "node " + hello.name + " keeps KV in pages of " +
                                                   std::to_string(hello.page_tokens) + " tokens, but this cluster's are " +
                                                   std::to_string(cfg.page_tokens) +
                                                   " (KV handed between them would not fit): start it with --page-tokens " +
                                                   std::to_string(cfg.page_tokens));
        if (!self->state.sweeping) {
          self->state.sweeping = true;
          self->state.last_sweep = self->clock().now();
          self->delayed_send(self, std::chrono::milliseconds{self->state.cfg.heartbeat_interval_ms}, timer_atom::value);
        }
        const std::string name = hello.name;
        if (auto old = self->state.nodes.find(name);
            old != self->state.nodes.end() && old->second.hello.incarnation != hello.incarnation) {
          auto& o = old->second;
          const bool was_live = o.state != "gone";
          // Two live processes of different kinds under one name (`baton node --name x` and
          // `baton gateway --name x`): one entry cannot stand for both, and the death of either
          // would go unseen while the other heartbeats.
          if (was_live && o.hello.roles != hello.roles)
            return make_error(errc::bad_request, "node name " + name + " is held by a live " + roles_text(o.hello.roles) +
                                                     " process (pid " + std::to_string(o.hello.pid) + "): give this " +
                                                     roles_text(hello.roles) + " process a --name of its own");
          // The same kind of process under a live entry's name: a restart before this directory
          // saw the old one go (a host that froze, or went off the network, sends no down
          // message). The old process is given up now: its heartbeats no longer count, so its
          // silence would never be seen, and its ranks would stay in the balancers. One that
          // drains is left to finish: it no longer takes work and leaves by itself.
          if (o.state == "joined")
            mark_gone(self, name, o, "was replaced by a new process (pid " + std::to_string(hello.pid) + ") under its name");
          // The old process may still run, its ranks forgotten: just given up above, or gone
          // silent before without its agent ending (a partition it may come back from). It is
          // told to leave, now and at each heartbeat it sends later. One that was draining
          // finishes first, and leaves by itself.
          if (o.state == "gone" && !o.ended && !o.gone_draining && o.hello.roles == hello.roles) {
            remember_replaced(self->state, o.hello.incarnation, {name, hello.pid, o.agent});
            if (auto agent = caf::actor_cast<node_agent_actor>(o.agent)) self->send(agent, replaced_atom::value, hello.pid);
          }
          if (was_live) o.ranks = {};
        }
        auto& n = self->state.nodes[name];  // a node that rejoins replaces its old entry
        n.hello = std::move(hello);
        n.agent = caf::actor_cast<caf::actor_addr>(self->current_sender());
        n.last_heartbeat = self->clock().now();
        n.state = "joined";
        n.ended = false;
        n.left = n.drain_for_restart = false;
        n.gone_why.clear();
        // (Not "node <name> joined": that is the launcher's line, which scripts count.)
        log_line(self, "node " + name + ": in the cluster (" + roles_text(n.hello.roles) + ", pid " +
                           std::to_string(n.hello.pid) + ")");
        if (auto agent = caf::actor_cast<caf::actor>(self->current_sender())) self->monitor(agent);
        tell_late_node(self, name);  // a group of its lost a member before it could be told
        return self->state.welcome;
      },
      [=](heartbeat_atom, const std::string& name, uint64_t incarnation) {
        auto& st = self->state;
        auto i = st.nodes.find(name);
        // A process that a newer one under its name replaced keeps no entry alive, nor does one
        // whose agent ended.
        if (auto r = st.replaced.find(incarnation); r != st.replaced.end() && r->second.name == name) {
          // Its agent as it joined; back from a partition, that handle may have gone with the
          // connection, and the sender is the agent itself (a pulse beats only while a node starts).
          auto agent = caf::actor_cast<node_agent_actor>(r->second.agent);
          if (!agent) agent = caf::actor_cast<node_agent_actor>(self->current_sender());
          if (agent) self->send(agent, replaced_atom::value, r->second.by_pid);
          return;
        }
        if (i == st.nodes.end() || i->second.hello.incarnation != incarnation || i->second.ended) return;
        i->second.last_heartbeat = self->clock().now();
        // Back after a partition (or a stall past the heartbeats): its ranks rejoin the balancers
        // by their next load report, which each is asked for at once (health_atom: a rank
        // re-reports its load), so an idle rank is not left forgotten; the requests that left
        // them got their leases released, so nothing runs twice for long. The balancers hear
        // first that the ranks may come back (until then they ignore a report sent before the
        // node was marked gone); they and this directory share a process, so that comes first.
        if (i->second.state == "gone") {
          i->second.state = i->second.gone_draining ? "draining" : "joined";
          log_line(self, "node " + name + " (pid " + std::to_string(i->second.hello.pid) +
                             ") is back: its heartbeats resumed; its ranks take work again");
          auto& w = st.welcome;
          for (const auto& r : i->second.ranks.decode) self->send(w.decode_balancer, rejoin_atom::value, r, true);
          for (const auto& r : i->second.ranks.prefill) self->send(w.prefill_balancer, rejoin_atom::value, r, true);
          for (const auto& r : i->second.ranks.decode) self->send(r, health_atom::value);
          for (const auto& r : i->second.ranks.prefill) self->send(r, health_atom::value);
          // The elastic controller forgot its ranks when it went: unless it is leaving, they
          // serve in their roles again and may be moved (a move lost with it is undone).
          if (w.elastic_controller && !i->second.gone_draining)
            self->send(w.elastic_controller, rejoin_atom::value, i->second.ranks);
          // Its data-parallel groups went on without it (their meetings were lost when it was
          // marked gone): it hears so, and leaves to be restarted.
          tell_late_node(self, name);
          if (!st.sweeping) {
            st.sweeping = true;
            st.last_sweep = self->clock().now();
            self->delayed_send(self, std::chrono::milliseconds{st.cfg.heartbeat_interval_ms}, timer_atom::value);
          }
        }
      },
      // Both from the node's agent alone: an old process under a name a new one took (back from
      // a partition) must neither swap the new one's ranks for its own nor drain it.
      [=](const std::string& name, node_ranks& ranks) {
        if (auto i = self->state.nodes.find(name); i != self->state.nodes.end() && i->second.agent == self->current_sender())
          i->second.ranks = std::move(ranks);
      },
      [=](rendezvous_atom, const std::string& group, uint32_t size, uint32_t first, std::vector<std::string>& cards,
          const std::string& node, int32_t pid, uint32_t shrink_after_ms) -> caf::result<std::vector<std::string>> {
        const auto refuse = [&](const std::string& what) {
          return caf::make_error(caf::sec::invalid_argument, "rendezvous " + group + ": " + what);
        };
        if (size == 0 || cards.empty() || first + cards.size() > size)
          return refuse(members_text(first, cards.size()) + " do not fit a group of " + std::to_string(size));
        // Checked before the meeting exists, so a misfit cannot fix the group's size for the others.
        auto found = self->state.meetings.find(group);
        if (found != self->state.meetings.end() && found->second.size != size)
          return refuse("a post for a group of " + std::to_string(size) + ", but the group has " +
                        std::to_string(found->second.size) + " members");
        const auto poster = caf::actor_cast<caf::actor_addr>(self->current_sender());
        if (auto a = caf::actor_cast<caf::actor>(self->current_sender())) self->monitor(a);
        auto& r = self->state.meetings[group];
        if (r.size == 0) r.start(size, {});
        const bool posted_before = std::find(r.nodes.begin(), r.nodes.end(), node) != r.nodes.end();
        // A node posting again to a meeting it completed is a new process under the old name,
        // restarted before the directory saw the old one go, or a node whose members saw the
        // group break (a stalled or stopped member): either way the group meets afresh.
        if (r.lost.empty() && r.done && posted_before)
          lose(self, group, r, node, "posted to meet again (restarted, or re-forming its broken group)");
        // Members a shrunk meeting closed without came back: the group grows to full size again.
        if (r.lost.empty() && r.done && !posted_before && all_absent(r, first, cards.size()))
          grow(self, group, r, node, first, cards.size());
        if (!r.lost.empty()) {
          // The group lost a node: a restarted member waits until the others have left too, and
          // then meets them afresh as they come back.
          if (posted_before) r.reposted.insert(node);
          void_posts_of(r.queued, group, node);
          auto promise = self->make_response_promise<std::vector<std::string>>();
          r.queued.push_back({first, std::move(cards), node, pid, promise, shrink_after_ms, poster});
          restart_if_empty(self, group, r);
          return promise;
        }
        drop_posts_of(r, group, node);  // the newest post of a node wins
        if (auto bad = refusal(r, first, cards); !bad.empty()) return refuse(bad);
        auto promise = self->make_response_promise<std::vector<std::string>>();
        take_post(self, group, r, {first, std::move(cards), node, pid, promise, shrink_after_ms, poster});
        return promise;
      },
      [=](drain_atom, const std::string& name, bool for_restart) {
        if (auto i = self->state.nodes.find(name); i != self->state.nodes.end() && i->second.agent == self->current_sender()) {
          i->second.state = "draining";
          i->second.drain_for_restart = for_restart;
        }
      },
      [=](stats_atom) {
        std::vector<node_status> out;
        const auto now = self->clock().now();
        for (const auto& [name, n] : self->state.nodes)
          out.push_back({name, n.hello.roles, n.hello.pid,
                         std::chrono::duration_cast<std::chrono::milliseconds>(now - n.last_heartbeat).count(), n.state,
                         n.ranks.names, n.state == "gone" ? n.gone_why : std::string{}, n.state == "gone" && n.left});
        return out;
      },
      [=](timer_atom, const std::string& group, uint64_t timer) { shrink(self, group, timer); },
      [=](timer_atom) {
        auto& st = self->state;
        const auto silence = std::chrono::milliseconds{uint64_t{st.cfg.heartbeat_interval_ms} * st.cfg.missed_heartbeats};
        const auto now = self->clock().now();
        const auto interval = std::chrono::milliseconds{st.cfg.heartbeat_interval_ms};
        // This sweep's lateness is time this process was stalled, not time the nodes were silent
        // -- their heartbeats of then wait behind this message: a head paused 2.5 s (SIGSTOP, a
        // VM pause) declared every node gone and failed over every stream. So each node is given
        // the lateness on top of its silence; a node really gone stays silent and is declared
        // all the same (a later sweep, or this one once its silence outgrows the credit), however
        // late every sweep runs.
        const auto late = std::max<caf::timespan>(caf::timespan{0}, now - st.last_sweep - interval);
        st.last_sweep = now;
        bool watching = false;
        for (auto& [name, n] : st.nodes) {
          if (n.state != "gone" && now - n.last_heartbeat > silence + late)
            mark_gone(self, name, n,
                      "missed its heartbeats for " + std::to_string(silence.count()) + " ms");
          watching = watching || n.state != "gone";
        }
        st.sweeping = watching;  // every node gone: the sweep restarts at the next join
        if (watching)
          self->delayed_send(self, interval, timer_atom::value);
      },
  };
}

}  // namespace

node_directory_actor spawn_node_directory(caf::actor_system& sys, node_directory_config cfg, cluster_welcome welcome) {
  return sys.spawn(node_directory_impl, cfg, std::move(welcome));
}

std::vector<std::string> wait_nodes_gone(caf::actor_system& sys, const node_directory_actor& directory,
                                         std::vector<std::string> names, std::chrono::milliseconds budget) {
  const auto by = std::chrono::steady_clock::now() + budget;
  caf::scoped_actor self{sys};
  for (;;) {
    bool answered = false;
    std::vector<std::string> still;
    self->request(directory, std::chrono::seconds{2}, stats_atom::value)
        .receive(
            [&](std::vector<node_status>& all) {
              answered = true;
              for (const auto& n : names) {
                const auto i = std::find_if(all.begin(), all.end(), [&](const node_status& s) { return s.name == n; });
                if (i != all.end() && i->state != "gone") still.push_back(n);
              }
            },
            [](caf::error&) {});
    if (!answered || still.empty() || std::chrono::steady_clock::now() >= by) return answered ? still : std::vector<std::string>{};
    names = std::move(still);
    std::this_thread::sleep_for(std::chrono::milliseconds{50});
  }
}

}  // namespace baton

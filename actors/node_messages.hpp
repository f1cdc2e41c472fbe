#pragma once

// The messages of cluster membership (deploy: `baton node`, `baton gateway`, `baton launch`):
// a node joining the head's directory, its heartbeats, the data-parallel rendezvous and the
// loss notices of its groups. A part of actors/messages.hpp, which includes it at its end, so
// every includer of either sees both; registered with the rest (actors/message_types.cpp).

#include <string_view>

#include "actors/messages.hpp"

namespace baton {

// --- nodes (deploy: `baton node`, `baton gateway`, `baton launch`) ---------------------------
/// A node process introducing itself to the cluster's directory.
struct node_hello {
  std::string name;
  std::vector<std::string> roles;  ///< decode | prefill | gateway (store nodes do not join)
  int32_t pid = 0;
  /// The model its ranks serve (model_fingerprint); empty for a node without one (a gateway).
  /// The head refuses a node whose model is not its own: its tokens would mean other things.
  std::string model = {};
  /// This process's identity under its name, drawn at random as its agent starts (0: the agent
  /// draws one). A pid is no identity: every container's first process is pid 1, and a node
  /// restarted in its container comes back as pid 1 under the same name.
  uint64_t incarnation = 0;
  /// Which weights of that model (weights_identity: a checkpoint's fingerprint, or the
  /// seed of drawn ones), and the tokens of a KV page: a node whose weights differ would answer
  /// with another model's tokens, one whose pages differ fails every KV handoff with it. The head
  /// refuses either at the join (weights compared like for like: two checkpoints, or two seeds).
  /// Empty / 0: not said (a gateway).
  std::string weights = {};
  uint32_t page_tokens = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_hello& x) {
  return f(caf::meta::type_name("node_hello"), x.name, x.roles, x.pid, x.model, x.incarnation, x.weights, x.page_tokens);
}

/// What a joining node needs to start its actors.
struct cluster_welcome {
  router_actor router;
  prefill_balancer_actor prefill_balancer;
  decode_balancer_actor decode_balancer;
  store_info store;
  uint32_t heartbeat_interval_ms = 500;
  /// Elastic P/D: where node processes announce their ranks (controller_join); null when the head
  /// runs no elastic controller (it does with elastic ranks or `--elastic-nodes`).
  elastic_controller_actor elastic_controller{};
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, cluster_welcome& x) {
  return f(caf::meta::type_name("cluster_welcome"), x.router, x.prefill_balancer, x.decode_balancer, x.store,
           x.heartbeat_interval_ms, x.elastic_controller);
}

/// The head's register of node processes: who joined, their heartbeats, who drains.
using node_directory_actor = caf::typed_actor<
    caf::replies_to<join_atom, node_hello>::with<cluster_welcome>,
    // node name and the incarnation it joined as: a process the name no longer belongs to (a
    // newer one joined under it) keeps no entry alive
    caf::reacts_to<heartbeat_atom, std::string, uint64_t>,
    // node name: it is draining and will leave; true: to be restarted (a failure, not a planned leave)
    caf::reacts_to<drain_atom, std::string, bool>,
    // node name and its ranks: what to drop if the node goes silent
    caf::reacts_to<std::string, node_ranks>,
    caf::replies_to<stats_atom>::with<std::vector<node_status>>,
    // group, members, the first index of this process's members, their cards, its node and pid,
    // and after how many ms the meeting may close without absent members (0: never): answered,
    // once every member has posted, with every card in index order (data-parallel groups across
    // node processes swap UCX keys so); an absent member's card is "absent#N". When that process
    // goes, the group's other nodes hear of it (member_gone_atom).
    caf::replies_to<rendezvous_atom, std::string, uint32_t, uint32_t, std::vector<std::string>, std::string, int32_t,
                    uint32_t>::with<std::vector<std::string>>,
    caf::reacts_to<timer_atom>,                        // liveness sweep (internal)
    caf::reacts_to<timer_atom, std::string, uint64_t>>;  // a meeting's shrink timer: group, timer (internal)

/// The card an absent member gets in a rendezvous that closed without it (a data-parallel group
/// that shrank); the number after '#' names the shrunk group's own meeting ("dpG~N"), unique
/// while the head lives.
inline constexpr std::string_view absent_card = "absent#";

/// A node process's agent: joins, heartbeats, and drains the node's actors on request.
using node_agent_actor = caf::typed_actor<
    caf::reacts_to<heartbeat_atom>,  // tick (internal)
    caf::reacts_to<drain_atom>,      // from the process (SIGTERM): finish the work, then leave
    // the same, to be restarted (true: its data-parallel group could not re-form in place): the
    // head counts it lost, not left on purpose
    caf::reacts_to<drain_atom, bool>,
    caf::reacts_to<poll_atom>,       // drain progress check (internal)
    // from the directory: these members of this group (its meeting's name, member indices) were
    // on a node that went down or fell silent, and why; or (true) members that a shrunk meeting
    // closed without came back, so the group meets again at full size
    caf::reacts_to<member_gone_atom, std::string, std::vector<uint32_t>, std::string, bool>,
    // from the directory: a newer process (its pid) joined under this node's name while this one
    // served: its ranks were forgotten, so it stops them and leaves
    caf::reacts_to<replaced_atom, int32_t>>;

}  // namespace baton

#pragma once

// How the decode ranks of `baton node --dp-attention` meet the other members of their
// data-parallel groups: through the head's node directory (its rendezvous), or in-process when a
// group's members all live in this node. A group meets at start, and again each time it
// re-forms in place. A group that lost a node for good may shrink: survivors re-forming it let
// their meeting close without the absent members after --dp-shrink-after-s, then meet again as a
// smaller group (its own meeting, "dpG~N"), and grow back to full size once the lost member
// returns (the directory tells them, and they re-form).

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "actors/messages.hpp"
#include "gpu/expert_parallel.hpp"

namespace caf {
class actor_system;
}

namespace baton::gpu {
class executor;
}

namespace baton::deploy {

/// The cluster's decode rank F + i is member (F + i) % ep of group (F + i) / ep. Members are
/// named by group ("dp3.1"), which every node can work out.
struct dp_layout {
  uint32_t ranks = 1;  ///< decode ranks in this node
  uint32_t first = 0;  ///< the cluster-wide index of the first
  uint32_t ep = 2;     ///< members per group
  uint32_t first_group() const { return first / ep; }
  uint32_t last_group() const { return (first + ranks - 1) / ep; }
  uint32_t group_of(uint32_t local_rank) const { return (first + local_rank) / ep; }
  /// This node's members of group `g` (layout indices, consecutive).
  std::vector<uint32_t> members_of(uint32_t g) const;
};

/// Which members a group meets as: every member of its layout, or (shrunk) those present when a
/// meeting closed without the others, renumbered in layout order.
struct dp_shape {
  uint64_t serial = 0;            ///< 0: the full group; else the shrunk group's number (its meeting "dpG~serial")
  std::vector<uint32_t> present;  ///< shrunk: [index in the group] the layout's member index
  bool shrunk() const { return serial != 0; }
  uint32_t size(uint32_t ep) const { return shrunk() ? static_cast<uint32_t>(present.size()) : ep; }
  /// The group's index of layout member `m`; -1 when a shrunk group lacks it.
  int64_t index_of(uint32_t m) const;
  /// The meeting's name at the head: "dpG", or "dpG~serial".
  std::string meeting(uint32_t g) const;
};

/// How this node's members meet: the same for a group's first meeting and for every re-forming.
struct dp_meeting_config {
  std::string node;
  uint32_t meet_timeout_s = 120;
  /// How long a meeting that re-forms a group waits (since its latest post) for absent members
  /// before it may close without them (the group shrinks); 0: it waits for every member.
  uint32_t shrink_after_s = 0;
  gpu::peer_group_config group;
  gpu::live_eplb_config eplb;
  std::string ucx_send;
  std::function<bool()> cancelled;  ///< polled while waiting at the head: leave the meeting at once
};

/// Each card carries the member's settings with its key: members that would run different rounds
/// (slots, dual-batch overlap, EPLB) are refused at the meeting, naming both, not broken later.
/// This node's members of group `g` met afresh as `shape` (new transports, new keys), in layout
/// order; EPLB, when on, is enabled on every member (a shrunk group whose slots cannot hold
/// every expert runs without it, saying so). With `may_shrink` (a full group re-forming) the
/// head may close the meeting without absent members: then nothing is returned, `*shrunk_to`
/// holds the shape to meet again as, and `*why` says so (the head closes only a meeting that is
/// not the group's first there, once no post came for the delay). Empty and a sentence when the
/// meeting fails or is cancelled.
std::vector<std::shared_ptr<gpu::expert_peers>> meet_dp_group(caf::actor_system& sys, const node_directory_actor& dir,
                                                              const dp_layout& at, uint32_t g, const dp_shape& shape,
                                                              bool may_shrink, const gpu::model_config& model,
                                                              const dp_meeting_config& mc, dp_shape* shrunk_to,
                                                              std::string* why);

/// Loads the model with the routed experts `keep` chooses (a node's loader).
using weights_loader =
    std::function<std::shared_ptr<const gpu::model_weights>(const gpu::expert_filter& keep, std::string* why)>;

/// The members of group `g` present when its meeting closed without others (`shape`, shrunk)
/// meet again as the smaller group: each serves a larger block of every MoE layer, loaded with
/// `load` before the meeting (once it completes, the others may step at once). The members come
/// with their stores filled, each saying what it serves; empty and a sentence on failure.
std::vector<std::shared_ptr<gpu::expert_peers>> meet_shrunk_group(caf::actor_system& sys, const node_directory_actor& dir,
                                                                  const dp_layout& at, uint32_t g, const dp_shape& shape,
                                                                  const gpu::model_config& model,
                                                                  const dp_meeting_config& mc, const weights_loader& load,
                                                                  std::string* why);

/// Where a node process stands, seen by its parts: its main loop, its data-parallel groups, its
/// expert shards' keeper.
struct node_state {
  std::atomic<bool> leaving{false};     ///< it leaves: a stop, or what must_leave says
  std::atomic<bool> head_down{false};   ///< the head is away, from its loss until a new agent runs
  std::atomic<int32_t> replaced_by{0};  ///< a newer process (this pid) took the node's name: it leaves
  std::atomic<bool> must_leave{false};  ///< a group or expert shards cannot be brought back: leave, exit code 3
  /// Meetings in progress end and no re-forming starts: the node stops or leaves, or has no head.
  bool winding_down() const;
};

/// A node's members of its data-parallel groups, and their ranks' executors, kept whole while it
/// serves. A group breaks when a node of it goes (the head's directory says so: member_gone) or
/// when a member fails mid-step with no node seen to go (a stall past the step timeout, an abort
/// word, a process that died before its node joined: watch). Its members here then step aside
/// (their ranks refuse work and report no room) and the group re-forms in place, on a thread of
/// its own: the members meet afresh at the head, whose directory holds the meeting until every
/// node of the lost one has gone or posted again; the new members' stores are filled from the
/// model loaded again, and each executor rejoins between jobs. The node never restarts, so its
/// other groups, its KV pools and its block-store connections stay. A group that cannot re-form
/// sets must_leave: the node drains and leaves with exit code 3, so that whoever restarts it
/// brings it back whole.
class dp_node_groups {
public:
  struct setup {
    std::string node;  ///< the node's name, in what it prints
    dp_layout at;
    gpu::model_config model;
    dp_meeting_config meet;
    weights_loader load;
    std::function<node_directory_actor()> head;      ///< the head's directory now
    std::function<std::string(uint32_t)> rank_name;  ///< local rank -> its name
  };
  dp_node_groups(caf::actor_system& sys, setup s, std::shared_ptr<node_state> state);
  /// Joins the re-formings still running.
  ~dp_node_groups();
  dp_node_groups(const dp_node_groups&) = delete;
  dp_node_groups& operator=(const dp_node_groups&) = delete;

  /// The groups' first meetings (before the node joins the head: their members in other nodes
  /// wait for these). Each member then takes its block of routed experts out of `*weights`,
  /// which are left holding none (the executors share them); `source` names where they came
  /// from. Empty, or why the groups did not form.
  std::string form(std::shared_ptr<const gpu::model_weights>* weights, const std::string& source);
  /// Local rank `i`'s member (its executor's peers), the latest once its group re-formed.
  std::shared_ptr<gpu::expert_peers> member(uint32_t i);
  /// Rank `i`'s executor started: it rejoins its group when the group re-forms.
  void started(uint32_t i, std::shared_ptr<gpu::executor> exec);
  /// Re-forms the groups whose members here report a standing failure (polled by the node).
  void watch();
  /// The head's directory says members of a group were lost with their node, or came back to a
  /// group that had shrunk without them (`returned`): node_agent_config::on_member_gone.
  void member_gone(const std::string& meeting, const std::vector<uint32_t>& members, const std::string& why,
                   bool returned);
  /// The head went away and the ranks stopped: re-formings end, the executors go (the groups
  /// re-form at the next head, once the new ranks start).
  void head_lost();
  /// The node leaves: re-formings end, the executors go; the members last in place come back.
  std::vector<std::shared_ptr<gpu::expert_peers>> finish();

private:
  /// Where a re-forming group is. A loss notice means the old group while it is `meeting`; the
  /// new one once it has `met` (held until its members are in place, then applied to them); and
  /// it is applied to the new members directly once they are `assigned`.
  enum class stage { meeting, met, assigned };
  struct lost_note {
    std::vector<uint32_t> members;  ///< in the new group's numbering
    std::string why;
    bool everyone = false;  ///< the new group must re-form at once (it lacks a member that came back)
  };
  struct reformer {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };

  void start_reform(uint32_t g, const std::string& cause);  ///< mutex_ held
  void reform(uint32_t g);                                    ///< on a re-forming's thread
  std::vector<std::shared_ptr<gpu::expert_peers>> meet_again(uint32_t g, dp_shape* shape, std::string* why);
  bool put_in_place(uint32_t g, const std::vector<std::shared_ptr<gpu::expert_peers>>& members, const dp_shape& shape,
                    std::string* why);
  void await_switch(uint32_t g, const dp_shape& shape);
  void could_not_reform(uint32_t g, const std::string& why);
  std::vector<reformer> take_threads();

  caf::actor_system& sys_;
  const setup setup_;
  const std::shared_ptr<node_state> state_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<gpu::expert_peers>> peers_;  ///< [local rank]
  std::vector<std::shared_ptr<gpu::executor>> execs_;      ///< [local rank], once started
  std::map<uint32_t, stage> reforming_;                    ///< groups re-forming now
  std::map<uint32_t, std::vector<lost_note>> held_;        ///< losses of groups that have met, not yet assigned
  std::map<uint32_t, dp_shape> shapes_;                    ///< each group's shape (the new one's from `met` on)
  /// Return notices (members back at the group's shrunk meeting) that came while it was meeting
  /// again: if it then meets shrunk, it re-forms once more, at full size.
  std::map<uint32_t, std::string> noticed_;
  std::vector<reformer> threads_;  ///< finished ones joined at the next start, the rest at the end
};

}  // namespace baton::deploy

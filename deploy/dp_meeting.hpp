#pragma once

// How the decode ranks of `baton node --dp-attention` meet the other members of their
// data-parallel groups: through the head's node directory (its rendezvous), or in-process when a
// group's members all live in this node. A group meets at start, and again each time it
// re-forms in place. A group that lost a node for good may shrink: survivors re-forming it let
// their meeting close without the absent members after --dp-shrink-after-s, then meet again as a
// smaller group (its own meeting, "dpG~N"), and grow back to full size once the lost member
// returns (the directory tells them, and they re-form).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/messages.hpp"
#include "gpu/expert_parallel.hpp"

namespace caf {
class actor_system;
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

}  // namespace baton::deploy

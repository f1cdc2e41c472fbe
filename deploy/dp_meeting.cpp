#include "deploy/dp_meeting.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>

#include "actors/node_messages.hpp"
#include "deploy/commands.hpp"
#include "deploy/expert_processes.hpp"
#include "transport/all_to_all.hpp"

namespace baton::deploy {

std::vector<uint32_t> dp_layout::members_of(uint32_t g) const {
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < ranks; ++i)
    if (group_of(i) == g) out.push_back((first + i) % ep);
  return out;
}

int64_t dp_shape::index_of(uint32_t m) const {
  if (!shrunk()) return m;
  for (size_t k = 0; k < present.size(); ++k)
    if (present[k] == m) return static_cast<int64_t>(k);
  return -1;
}

std::string dp_shape::meeting(uint32_t g) const {
  std::string out = "dp" + std::to_string(g);
  if (shrunk()) out.append("~").append(std::to_string(serial));
  return out;
}

namespace {

/// Posts `cards` (this node's members from `first_member` on) to meeting `meeting` of `size` at
/// the head and waits for every member's card. A helper actor asks, so that this thread can wait
/// in slices and leave on Ctrl-C or SIGTERM instead of sitting out the meeting's timeout.
bool ask_head(caf::actor_system& sys, const node_directory_actor& dir, const std::string& meeting, uint32_t size,
              uint32_t first_member, const std::vector<std::string>& cards, uint32_t shrink_after_ms,
              const dp_meeting_config& mc, std::vector<std::string>* got, std::string* err) {
  struct answer {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::vector<std::string> cards;
    std::string error;
  };
  auto ans = std::make_shared<answer>();
  auto settle = [ans](std::vector<std::string> c, std::string e) {
    std::lock_guard<std::mutex> lock{ans->m};
    ans->cards = std::move(c);
    ans->error = std::move(e);
    ans->done = true;
    ans->cv.notify_all();
  };
  const std::string group = meeting.substr(0, meeting.find('/'));
  if (mc.cancelled()) return *err = "group " + group + ": stopped before meeting its other members", false;
  const uint32_t timeout_s = mc.meet_timeout_s;
  auto asker = sys.spawn([=, node = mc.node](caf::event_based_actor* self) {
    self->request(dir, std::chrono::seconds{timeout_s}, rendezvous_atom::value, meeting, size, first_member, cards, node,
                  static_cast<int32_t>(::getpid()), shrink_after_ms)
        .then([settle](std::vector<std::string>& c) { settle(std::move(c), {}); },
              [settle, self](caf::error& e) { settle({}, self->system().render(e)); });
  });
  std::printf("baton node %s: waiting at the head for the other members of data-parallel group %s (up to %u s%s)\n",
              mc.node.c_str(), meeting.c_str(), timeout_s,
              shrink_after_ms ? ("; a re-forming meeting may close without absent ones after " +
                                 std::to_string(shrink_after_ms / 1000) + " s")
                                    .c_str()
                              : "");
  std::fflush(stdout);
  std::unique_lock<std::mutex> lock{ans->m};
  while (!ans->done && !mc.cancelled()) ans->cv.wait_for(lock, std::chrono::milliseconds{100});
  if (!ans->done) {
    caf::anon_send_exit(asker, caf::exit_reason::user_shutdown);  // the actor system waits for it otherwise
    return *err = "group " + group + ": stopped while waiting for its other members at the head", false;
  }
  if (!ans->error.empty()) return *err = "group " + group + ": meeting its members at the head: " + ans->error, false;
  *got = std::move(ans->cards);
  return true;
}

/// The members absent from answer `got` (cards starting with absent_card), and the shrunk group's
/// serial from their card.
std::vector<uint32_t> absent_members(const std::vector<std::string>& got, uint64_t* serial) {
  std::vector<uint32_t> out;
  for (uint32_t m = 0; m < got.size(); ++m)
    if (got[m].rfind(absent_card, 0) == 0) {
      out.push_back(m);
      *serial = std::strtoull(got[m].c_str() + absent_card.size(), nullptr, 10);
    }
  return out;
}

std::string member_list(const std::vector<uint32_t>& ms) {
  std::string out;
  for (uint32_t m : ms) out.append(out.empty() ? "" : " ").append(std::to_string(m));
  return out;
}

}  // namespace

std::vector<std::shared_ptr<gpu::expert_peers>> meet_dp_group(caf::actor_system& sys, const node_directory_actor& dir,
                                                              const dp_layout& at, uint32_t g, const dp_shape& shape,
                                                              bool may_shrink, const gpu::model_config& model,
                                                              const dp_meeting_config& mc, dp_shape* shrunk_to,
                                                              std::string* why) {
  const auto& group_cfg = mc.group;
  const auto& eplb = mc.eplb;
  const std::string settings = "slot_bytes=" + std::to_string(group_cfg.slot_bytes) +
                               " dual_batch=" + std::to_string(group_cfg.dual_batch) +
                               " eplb=" + std::to_string(eplb.slots_per_rank) + "/" + std::to_string(eplb.interval_rounds);
  const std::string group = shape.meeting(g);
  const uint32_t size = shape.size(at.ep);
  // Members keep their layout names in a shrunk group, so that logs name the same member alike.
  std::vector<std::string> names;
  for (uint32_t k = 0; k < size; ++k)
    names.push_back("dp" + std::to_string(g) + "." + std::to_string(shape.shrunk() ? shape.present[k] : k));
  std::vector<uint32_t> local;  // consecutive member indices
  for (uint32_t m : at.members_of(g)) {
    const int64_t k = shape.index_of(m);
    if (k < 0) return *why = "group " + group + " lacks this node's member " + std::to_string(m), std::vector<std::shared_ptr<gpu::expert_peers>>{};
    local.push_back(static_cast<uint32_t>(k));
  }
  const uint32_t shrink_after_ms = may_shrink && !shape.shrunk() ? mc.shrink_after_s * 1000 : 0;
  std::string shrank;  // the meeting closed without absent members: why, as said
  auto meet = [&](uint32_t channel, const std::vector<std::pair<uint32_t, transport::region_key>>& mine,
                  std::vector<transport::region_key>* all, std::string* err) {
    const std::string meeting = channel == 0 ? group : group + "/b";  // dual-batch overlap's second channel
    std::vector<std::string> cards;
    for (const auto& m : mine) cards.push_back(settings + "|" + transport::key_to_text(m.second));
    std::vector<std::string> got;
    if (mine.size() == size) got = cards;
    // Only the first channel's meeting may close without members: the second one's (dual-batch
    // overlap) follows a meeting that had them all.
    else if (!ask_head(sys, dir, meeting, size, mine.front().first, cards, channel == 0 ? shrink_after_ms : 0, mc, &got,
                       err))
      return false;
    uint64_t serial = 0;
    if (auto absent = absent_members(got, &serial); !absent.empty()) {
      // The head closed the meeting without them: the group meets again, smaller, as "dpG~serial".
      if (channel != 0 || !shrink_after_ms)
        return *err = "group " + meeting + " met without member(s) " + member_list(absent) + "; it re-forms", false;
      shrunk_to->serial = serial;
      shrunk_to->present.clear();
      for (uint32_t m = 0; m < size; ++m)
        if (std::find(absent.begin(), absent.end(), m) == absent.end()) shrunk_to->present.push_back(m);
      shrank = "group " + group + " met without member(s) " + member_list(absent) + " after " +
               std::to_string(mc.shrink_after_s) + " s: it shrinks to " + std::to_string(size - absent.size()) + " of " +
               std::to_string(size) + " members";
      return *err = shrank, false;
    }
    for (size_t m = 0; m < got.size(); ++m) {
      const auto bar = got[m].find('|');
      const std::string theirs = bar == std::string::npos ? std::string{"(none)"} : got[m].substr(0, bar);
      if (theirs != settings)
        return *err = "group " + group + ": member " + std::to_string(m) + " runs with " + theirs + ", this node with " +
                      settings + " (every member must be started alike)",
               false;
      auto key = transport::key_from_text(got[m].substr(bar + 1));
      if (!key) return *err = "group " + group + ": member " + std::to_string(m) + "'s key does not parse", false;
      all->push_back(*key);
    }
    // The keys this node met with, by fingerprint: every node of the meeting prints the same line,
    // and an all-to-all that times out names the fingerprints it holds (a stale key shows).
    std::string line = "baton node " + mc.node + ": data-parallel group " + meeting + " met with keys";
    for (size_t m = 0; m < all->size(); ++m) line += " " + names[m] + "=" + transport::key_fingerprint((*all)[m]);
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    return true;
  };
  auto members = gpu::make_peer_group(names, local, model, group_cfg, ucx_peer_transports(mc.ucx_send), meet, why);
  if (!shrank.empty()) return *why = shrank, std::vector<std::shared_ptr<gpu::expert_peers>>{};  // as said, unprefixed
  if (members.empty() || !eplb.slots_per_rank) return members;
  std::string eplb_why;
  if (!members.front()->enable_eplb(eplb, model.moe.n_routed_experts, &eplb_why)) {
    // Every member of a shrunk group computes the same refusal (the slots per member against
    // fewer members): all run without live EPLB, and the group still serves every expert.
    if (!shape.shrunk()) return *why = eplb_why, std::vector<std::shared_ptr<gpu::expert_peers>>{};
    std::printf("baton node %s: data-parallel group %s runs without live EPLB (%s)\n", mc.node.c_str(), group.c_str(),
                eplb_why.c_str());
    std::fflush(stdout);
    return members;
  }
  for (size_t i = 1; i < members.size(); ++i)
    if (!members[i]->enable_eplb(eplb, model.moe.n_routed_experts, why)) return {};
  return members;
}

std::vector<std::shared_ptr<gpu::expert_peers>> meet_shrunk_group(caf::actor_system& sys, const node_directory_actor& dir,
                                                                  const dp_layout& at, uint32_t g, const dp_shape& shape,
                                                                  const gpu::model_config& model,
                                                                  const dp_meeting_config& mc, const weights_loader& load,
                                                                  std::string* why) {
  const auto layout_members = at.members_of(g);
  std::vector<uint32_t> mine;
  for (uint32_t m : layout_members) mine.push_back(static_cast<uint32_t>(shape.index_of(m)));
  auto w = load(keep_blocks_of(mine, shape.size(at.ep)), why);
  if (!w) return {};
  dp_shape unused;
  auto members = meet_dp_group(sys, dir, at, g, shape, false, model, mc, &unused, why);
  if (members.empty()) return {};
  auto blocks = gpu::take_or_copy(std::move(w));
  for (size_t j = 0; j < members.size(); ++j) {
    members[j]->take_block(model, blocks);
    std::printf("baton node %s: member %u of data-parallel group dp%u is member %u of %s, serving %zu of %u routed "
                "experts per layer\n",
                mc.node.c_str(), layout_members[j], g, members[j]->rank(), shape.meeting(g).c_str(),
                members[j]->held(model.moe.first_k_dense_replace).size(), model.moe.n_routed_experts);
  }
  std::fflush(stdout);
  return members;
}

}  // namespace baton::deploy

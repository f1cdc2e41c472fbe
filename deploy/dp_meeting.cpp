#include "deploy/dp_meeting.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <thread>
#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>

#include "actors/node_messages.hpp"
#include "deploy/commands.hpp"
#include "deploy/expert_processes.hpp"
#include "deploy/processes.hpp"
#include "gpu/executor.hpp"
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

bool node_state::winding_down() const { return stop_requested() || leaving.load() || head_down.load(); }

dp_node_groups::dp_node_groups(caf::actor_system& sys, setup s, std::shared_ptr<node_state> state)
    : sys_(sys), setup_(std::move(s)), state_(std::move(state)) {
  execs_.resize(setup_.at.ranks);
}

dp_node_groups::~dp_node_groups() {
  for (auto& r : take_threads()) r.thread.join();
}

std::vector<dp_node_groups::reformer> dp_node_groups::take_threads() {
  std::lock_guard<std::mutex> lock{mutex_};
  return std::exchange(threads_, {});
}

std::string dp_node_groups::form(std::shared_ptr<const gpu::model_weights>* weights, const std::string& source) {
  const auto& at = setup_.at;
  const auto& model = setup_.model;
  // A node coming back to a group that re-forms (its meeting is not the group's first at this
  // head) may find it closing without members still missing: it then meets the others as the
  // smaller group too, with stores of their own (`filled`).
  std::vector<bool> filled;
  std::string why;
  for (uint32_t g = at.first_group(); g <= at.last_group() && why.empty(); ++g) {
    dp_shape shape;
    auto members = meet_dp_group(sys_, setup_.head(), at, g, {}, setup_.meet.shrink_after_s > 0, model, setup_.meet,
                                 &shape, &why);
    if (members.empty() && shape.shrunk()) {
      std::printf("baton node %s: data-parallel %s\n", setup_.node.c_str(), why.c_str());
      why.clear();
      members = meet_shrunk_group(sys_, setup_.head(), at, g, shape, model, setup_.meet, setup_.load, &why);
      shapes_[g] = shape;
    }
    if (members.empty() && why.empty()) why = "group dp" + std::to_string(g) + " did not meet";
    peers_.insert(peers_.end(), members.begin(), members.end());
    filled.resize(peers_.size(), shape.shrunk());
  }
  if (!why.empty()) return why;
  // Each member serves routed experts from its own store: its block, moved out of the weights
  // (which hold only this node's blocks when they come from a directory); the weights the
  // executors share then keep none.
  gpu::model_weights attention_only = gpu::take_or_copy(std::move(*weights));
  std::printf("baton node %s: loaded %zu of %u routed experts per layer from %s\n", setup_.node.c_str(),
              gpu::held_experts(model, attention_only, model.moe.first_k_dense_replace).size(),
              model.moe.n_routed_experts, source.c_str());
  for (size_t i = 0; i < peers_.size(); ++i)
    if (!filled[i]) peers_[i]->take_block(model, attention_only);
  gpu::keep_expert_block(model, attention_only, at.ep, at.ep);  // what a seeded model has left
  *weights = std::make_shared<const gpu::model_weights>(std::move(attention_only));
  for (uint32_t i = 0; i < at.ranks; ++i)
    std::printf("baton node %s: rank %s is member %u of data-parallel group %s, serving %zu of %u routed experts "
                "per layer\n",
                setup_.node.c_str(), setup_.rank_name(i).c_str(), peers_[i]->rank(),
                shapes_[at.group_of(i)].meeting(at.group_of(i)).c_str(),
                peers_[i]->held(model.moe.first_k_dense_replace).size(), model.moe.n_routed_experts);
  std::fflush(stdout);
  return {};
}

std::shared_ptr<gpu::expert_peers> dp_node_groups::member(uint32_t i) {
  std::lock_guard<std::mutex> lock{mutex_};  // a re-forming may replace it meanwhile
  return peers_[i];
}

void dp_node_groups::started(uint32_t i, std::shared_ptr<gpu::executor> exec) {
  std::lock_guard<std::mutex> lock{mutex_};
  execs_[i] = std::move(exec);
}

void dp_node_groups::watch() {
  if (state_->head_down.load()) return;  // the ranks stopped: their groups re-form at the head that comes back
  std::lock_guard<std::mutex> lock{mutex_};
  for (uint32_t i = 0; i < execs_.size(); ++i) {
    const uint32_t g = setup_.at.group_of(i);
    if (!execs_[i] || reforming_.count(g)) continue;
    if (auto failure = execs_[i]->standing_failure(); !failure.empty()) start_reform(g, failure);
  }
}

void dp_node_groups::member_gone(const std::string& meeting, const std::vector<uint32_t>& members,
                                 const std::string& why, bool returned) {
  const auto& at = setup_.at;
  const std::string channel = meeting.substr(0, meeting.find('/'));  // "dp3/b" is dp3's second channel
  const std::string group = channel.substr(0, channel.find('~'));     // "dp3~5": dp3 shrunk (see above)
  const uint64_t serial = channel.size() > group.size() ? std::strtoull(channel.c_str() + group.size() + 1, nullptr, 10) : 0;
  std::lock_guard<std::mutex> lock{mutex_};
  uint32_t g = at.first_group();
  while (g <= at.last_group() && group != "dp" + std::to_string(g)) ++g;
  if (g > at.last_group()) return;  // not a group of this node's
  const auto r = reforming_.find(g);
  const bool met = r != reforming_.end() && r->second == stage::met;
  // Members that came back to a shrunk meeting while this node meets again (as the smaller
  // group, say): once met, the group re-forms at full size.
  if (r != reforming_.end() && r->second == stage::meeting && returned && meeting == channel) noticed_[g] = why;
  // The notice in the group's own numbering. A shrunk group's meeting names its indices; the
  // full meeting names the layout's, and a member the shrunk group lacks came back (or its
  // meeting is over): the group re-forms at full size.
  const dp_shape& shape = shapes_[g];
  std::vector<uint32_t> lost;
  bool everyone = false;
  if (returned) {
    if (!shape.shrunk() || serial != 0) return;  // the group is whole already: an old notice
    everyone = true;
  } else if (serial != shape.serial) {
    if (serial != 0) return;  // about a shrunk group that is no more
    for (uint32_t m : members) {
      const int64_t k = shape.index_of(m);
      if (k < 0) everyone = true;  // a member it lacks: its meeting is over
      else lost.push_back(static_cast<uint32_t>(k));
    }
  } else {
    lost = members;
  }
  // A group whose new meeting completed but whose members are not in place yet: the loss is
  // the new group's, applied once they are (put_in_place).
  if (met) {
    held_[g].push_back({lost, why, everyone});
    return;
  }
  for (uint32_t i = 0; i < peers_.size(); ++i) {
    if (at.group_of(i) != g) continue;
    if (everyone) peers_[i]->retire(why);
    for (uint32_t m : lost) peers_[i]->peer_lost(m, why);
    if (meeting != channel) continue;  // dual-batch overlap's second channel: the same members, said once
    std::string line = "baton node " + setup_.node + ": rank " + setup_.rank_name(i) +
                       " steps aside: data-parallel group " + channel + (everyone ? " re-forms" : " lost member(s)");
    for (uint32_t m : everyone ? std::vector<uint32_t>{} : lost) line.append(1, ' ').append(std::to_string(m));
    line += " (" + why + ")\n";
    std::fputs(line.c_str(), stdout);
  }
  std::fflush(stdout);
  if (meeting == channel && !peers_.empty()) start_reform(g, everyone ? "a member it lacks came back" : "lost member(s)");
}

void dp_node_groups::start_reform(uint32_t g, const std::string& cause) {
  if (state_->winding_down()) return;  // on its way out, or no head to meet at
  if (!reforming_.emplace(g, stage::meeting).second) return;  // member_gone routes its losses
  std::printf("baton node %s: data-parallel group dp%u re-forms in place (%s): waiting at the head for its "
              "members to meet again\n",
              setup_.node.c_str(), g, cause.c_str());
  std::fflush(stdout);
  std::erase_if(threads_, [](reformer& r) {  // each finished one's stack goes
    if (!r.done->load()) return false;
    r.thread.join();
    return true;
  });
  auto done = std::make_shared<std::atomic<bool>>(false);
  threads_.push_back({std::thread([this, g, done] {
                        reform(g);
                        done->store(true);
                      }),
                      done});
}

void dp_node_groups::reform(uint32_t g) {
  std::string why;
  dp_shape shape;  // full, unless the head closes the meeting without lost members
  const auto members = meet_again(g, &shape, &why);
  if (!members.empty() && put_in_place(g, members, shape, &why)) {
    await_switch(g, shape);
    return;
  }
  {
    std::lock_guard<std::mutex> lock{mutex_};
    reforming_.erase(g);
    held_.erase(g);
    noticed_.erase(g);
  }
  could_not_reform(g, why);
}

std::vector<std::shared_ptr<gpu::expert_peers>> dp_node_groups::meet_again(uint32_t g, dp_shape* shape,
                                                                           std::string* why) {
  const auto& at = setup_.at;
  // The members' stores come from the model loaded again (the executors' shared weights keep
  // no routed experts), before the meeting: once it completes, the others may step at once, and
  // a load from disk could outlast their step timeout. So while it waits at the head, a node
  // holds a second copy of the shared weights and of this group's members' blocks.
  auto full = setup_.load(keep_blocks_of(at.members_of(g), at.ep), why);
  if (!full) return {};
  auto members = meet_dp_group(sys_, setup_.head(), at, g, {}, setup_.meet.shrink_after_s > 0, setup_.model,
                               setup_.meet, shape, why);
  if (!members.empty()) {
    auto blocks = gpu::take_or_copy(std::move(full));
    for (auto& m : members) m->take_block(setup_.model, blocks);
  } else if (shape->shrunk()) {
    std::printf("baton node %s: data-parallel %s\n", setup_.node.c_str(), why->c_str());
    std::fflush(stdout);
    full.reset();
    why->clear();
    members = meet_shrunk_group(sys_, setup_.head(), at, g, *shape, setup_.model, setup_.meet, setup_.load, why);
  }
  return members;
}

bool dp_node_groups::put_in_place(uint32_t g, const std::vector<std::shared_ptr<gpu::expert_peers>>& members,
                                  const dp_shape& shape, std::string* why) {
  const auto& at = setup_.at;
  {
    std::lock_guard<std::mutex> lock{mutex_};
    reforming_[g] = stage::met;  // a loss from here on is the new group's
    shapes_[g] = shape;
    // A shrunk group told, while it met, that members came back to its full meeting re-forms
    // once more: the full group may meet now.
    if (auto n = noticed_.find(g); n != noticed_.end() && shape.shrunk()) held_[g].push_back({{}, n->second, true});
    noticed_.erase(g);
  }
  // The executors of this group's ranks: after a head came back, the new ones may still be
  // starting (bounded wait).
  for (int i = 0; i < 200; ++i) {
    bool all = true;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      for (uint32_t r = 0; r < at.ranks; ++r) all = all && (at.group_of(r) != g || execs_[r]);
    }
    if (all || stop_requested() || state_->leaving.load()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds{50});
  }
  std::lock_guard<std::mutex> lock{mutex_};
  for (uint32_t i = 0, j = 0; i < at.ranks; ++i) {
    if (at.group_of(i) != g) continue;
    auto& exec = execs_[i];
    if (!exec) *why = "rank " + setup_.rank_name(i) + " has no executor yet";
    else if (!exec->rejoin_group(members[j], why)) *why = "rank " + setup_.rank_name(i) + ": " + *why;
    else peers_[i] = members[j];
    if (!why->empty()) return false;
    ++j;
  }
  // Losses told while the stores filled: the new members step aside at once, and the group
  // re-forms again once they have switched (watch).
  for (const auto& note : held_[g])
    for (auto& m : members) {
      if (note.everyone) m->retire(note.why);
      for (uint32_t lost : note.members) m->peer_lost(lost, note.why);
    }
  held_.erase(g);
  reforming_[g] = stage::assigned;
  return true;
}

void dp_node_groups::await_switch(uint32_t g, const dp_shape& shape) {
  // Each executor switches between jobs (after the one it runs); until all have, the group
  // stays re-forming, so that its old failure does not count as a new break (watch).
  bool switched = false;
  while (!switched && !state_->winding_down()) {
    switched = true;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      for (uint32_t i = 0; i < setup_.at.ranks; ++i)
        if (setup_.at.group_of(i) == g && execs_[i]->rejoin_pending()) switched = false;
    }
    if (!switched) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  std::lock_guard<std::mutex> lock{mutex_};
  reforming_.erase(g);
  if (!switched) return;
  const std::string as = shape.shrunk() ? " as " + std::to_string(shape.present.size()) + " of " +
                                              std::to_string(setup_.at.ep) + " members (" + shape.meeting(g) + ")"
                                        : std::string{};
  std::printf("baton node %s: data-parallel group dp%u re-formed in place%s; its ranks here take work again\n",
              setup_.node.c_str(), g, as.c_str());
  std::fflush(stdout);
}

void dp_node_groups::could_not_reform(uint32_t g, const std::string& why) {
  // A meeting that failed because the head went away (its loss may reach this node's agent a
  // moment after the meeting's error) is not the group's fault: the group re-forms at the head
  // that comes back.
  for (int i = 0; i < 20 && !state_->winding_down(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{50});
  if (state_->head_down.load()) {
    std::printf("baton node %s: data-parallel group dp%u did not re-form (%s): the head went away; it re-forms at the "
                "next head\n",
                setup_.node.c_str(), g, why.c_str());
    std::fflush(stdout);
    return;
  }
  if (!stop_requested() && !state_->leaving.load())
    std::printf("baton node %s: data-parallel group dp%u could not re-form in place (%s); leaving so that it re-forms "
                "from restarted nodes\n",
                setup_.node.c_str(), g, why.c_str());
  std::fflush(stdout);
  state_->must_leave.store(true);
}

void dp_node_groups::head_lost() {
  // Re-formings meeting at the old head end (cancelled); the stopped executors go, so that
  // nothing re-forms around them before the new ranks start.
  for (auto& r : take_threads()) r.thread.join();
  std::lock_guard<std::mutex> lock{mutex_};
  for (auto& x : execs_) x.reset();
  reforming_.clear();
  held_.clear();
  noticed_.clear();
}

std::vector<std::shared_ptr<gpu::expert_peers>> dp_node_groups::finish() {
  for (auto& r : take_threads()) r.thread.join();  // no new one starts: the node is leaving
  std::lock_guard<std::mutex> lock{mutex_};
  execs_.clear();
  return std::exchange(peers_, {});
}

}  // namespace baton::deploy

#pragma once

// How a rank keeps its handles on the store's block servers current. A store node that dies and
// comes back is adopted again by the head (store_keeper) under the same server id, as a new
// actor; the index shards learn it first. A rank keeps one watch per server waiting at index
// shard 0 -- "tell me when server i is other than: generation g, up (or down)" -- which the index
// answers when the server goes down or is adopted again; the rank takes the news and watches
// again. So a rank in another process learns both as soon as the head does, though it never
// sees the old server's down message (CAF routes its messages to a store node through the head,
// and only the head's link broke). While a server is down, write-backs skip it.
//
// Templates over the rank's actor type; the state must have `store` (store_access) and
// `store_watch` (store_server_watch). Included by the rank files only (CAF-heavy).

#include <cstdint>
#include <vector>

#include "actors/store_access.hpp"

namespace baton {

struct store_server_watch {
  std::vector<bool> down;            ///< by server id: seen to stop (or told so), no next actor yet
  std::vector<uint64_t> generation;  ///< by server id: which adoption of it `store.servers` holds
  /// By server id: what the index last said (down or up). The watch asks about a change from
  /// that, not from `down`, which this rank may also set itself (a down message, a handle that
  /// came invalid): else a mismatch would be answered at once, again and again.
  std::vector<bool> told_down;
};

namespace store_watch_detail {

template <class Self>
void await_next(Self* self, uint32_t id) {
  auto& st = self->state;
  // No timeout: the index answers at the server's next change, however long that takes. If the
  // index goes (the head's end) no answer comes, and there is nothing left to ask.
  self->request(st.store.index.front(), caf::infinite, servers_atom::value, id, st.store_watch.generation[id],
                static_cast<bool>(st.store_watch.told_down[id]))
      .then(
          [self, id](block_server_actor& now, uint64_t generation, bool down) {
            auto& s = self->state;
            s.store_watch.generation[id] = generation;
            if (now && now != s.store.servers[id]) {
              s.store.servers[id] = now;
              self->monitor(now);  // a dead one comes back down at once
            }
            s.store_watch.told_down[id] = down;
            s.store_watch.down[id] = down || !s.store.servers[id];
            await_next(self, id);
          },
          [](caf::error&) {});
}

}  // namespace store_watch_detail

/// At the rank's start: watches every server. A handle that came invalid (a store node that was
/// gone when this rank's store info was made in another process) is down from the start.
template <class Self>
void watch_store_servers(Self* self) {
  auto& st = self->state;
  if (!st.store.enabled()) return;
  st.store_watch.down.assign(st.store.servers.size(), false);
  st.store_watch.generation.assign(st.store.servers.size(), 0);
  st.store_watch.told_down.assign(st.store.servers.size(), false);
  for (uint32_t i = 0; i < st.store.servers.size(); ++i) {
    if (st.store.servers[i]) {
      self->monitor(st.store.servers[i]);
    } else {  // asked as if told down: the index answers at once with the actor it has
      st.store_watch.down[i] = true;
      st.store_watch.told_down[i] = true;
    }
    store_watch_detail::await_next(self, i);
  }
}

/// From the rank's down handler: true if `who` was one of the store's servers (now marked down
/// until its next adoption comes; the index's answer to the watch says the same soon after).
template <class Self>
bool store_server_went_down(Self* self, const caf::actor_addr& who) {
  auto& st = self->state;
  bool found = false;
  for (uint32_t i = 0; i < st.store.servers.size() && i < st.store_watch.down.size(); ++i) {
    if (caf::actor_cast<caf::actor_addr>(st.store.servers[i]) != who) continue;
    st.store_watch.down[i] = true;
    found = true;
  }
  return found;
}

}  // namespace baton

#pragma once

// How a rank keeps its handles on the store's block servers current. A store node that dies and
// comes back is adopted again by the head (store_keeper) under the same server id, as a new
// actor; the index shards learn it first. A rank keeps one question per server waiting at index
// shard 0 -- "a later adoption of server i than the one I have?" -- which the index answers when
// there is one; the rank takes the new actor and asks again. So a rank in another process learns
// of it as soon as the head does, though it never sees the old server's down message (CAF
// routes its messages to a store node through the head, and only the head's link broke).
// A rank that does see the down message (one in the head's process) also marks the server down
// at once: its write-backs skip it until it is back.
//
// Templates over the rank's actor type; the state must have `store` (store_access) and
// `store_watch` (store_server_watch). Included by the rank files only (CAF-heavy).

#include <cstdint>
#include <vector>

#include "actors/store_access.hpp"

namespace baton {

struct store_server_watch {
  std::vector<bool> down;            ///< by server id: seen to stop, no next actor yet
  std::vector<uint64_t> generation;  ///< by server id: which adoption of it `store.servers` holds
};

namespace store_watch_detail {

template <class Self>
void await_next(Self* self, uint32_t id) {
  auto& st = self->state;
  // No timeout: the index answers when the store node is adopted again, however long that is. It
  // fails only if the index itself goes (the head's end), and then there is nothing to ask.
  self->request(st.store.index.front(), caf::infinite, servers_atom::value, id, st.store_watch.generation[id])
      .then(
          [self, id](block_server_actor& next, uint64_t generation) {
            auto& s = self->state;
            if (next && generation > s.store_watch.generation[id]) {
              s.store.servers[id] = next;
              s.store_watch.generation[id] = generation;
              s.store_watch.down[id] = false;
              self->monitor(next);  // a dead one comes back down at once
            }
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
  for (uint32_t i = 0; i < st.store.servers.size(); ++i) {
    if (st.store.servers[i]) self->monitor(st.store.servers[i]);
    else st.store_watch.down[i] = true;
    store_watch_detail::await_next(self, i);
  }
}

/// From the rank's down handler: true if `who` was one of the store's servers (now marked down
/// until its next adoption comes).
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

#pragma once

// The actor system the in-process cluster benchmarks run on: as `baton local` runs it (no
// work-stealing sleeps between messages, platform-notes §1.4), two scheduler threads for this
// 2-vCPU machine, quiet.

#include <caf/actor_system_config.hpp>

#include "actors/messages.hpp"

namespace baton::bench {

inline caf::actor_system_config& cluster_system_config(caf::actor_system_config& c) {
  register_message_types(c);
  c.set("scheduler.max-threads", 2);
  c.set("work-stealing.moderate-poll-attempts", 0);
  c.set("logger.console-verbosity", caf::atom("quiet"));
  return c;
}

}  // namespace baton::bench

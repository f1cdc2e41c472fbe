#pragma once

// `baton local --serve --decode-processes N`: keeps its decode processes running. One that ended
// (killed, crashed) is said as such, with how, reaped, and started again after a wait that
// doubles while it keeps failing soon after its start (policies::restart_backoff, as `baton
// launch --restart-failed`). Meanwhile the node directory has its ranks out of placement; the
// new process joins under the same name.

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "policies/restart_backoff.hpp"

namespace baton::deploy {

class decode_keeper {
 public:
  /// Decode process i runs `argv[i]` and is `children[i]` now; `children` is the caller's list
  /// of processes to stop at the end, kept up to date (the ended out, the restarted in).
  decode_keeper(std::vector<pid_t>& children, std::vector<std::vector<std::string>> argv);
  /// Reaps what ended and starts what is due; called every few tens of milliseconds.
  void check(std::chrono::steady_clock::time_point now);

 private:
  struct slot {
    pid_t pid = -1;  ///< -1 while it waits to be started again
    std::chrono::steady_clock::time_point started, restart_at;
    uint32_t backoff_ms = 0;
  };
  std::vector<pid_t>& children_;
  std::vector<std::vector<std::string>> argv_;
  std::vector<slot> slots_;
  policies::restart_backoff backoff_;
};

}  // namespace baton::deploy

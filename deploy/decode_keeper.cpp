#include "deploy/decode_keeper.hpp"

#include <algorithm>
#include <cstdio>

#include "deploy/processes.hpp"
#include "deploy/utc_stamp.hpp"

namespace baton::deploy {

decode_keeper::decode_keeper(std::vector<pid_t>& children, std::vector<std::vector<std::string>> argv)
    : children_(children), argv_(std::move(argv)), slots_(argv_.size()) {
  const auto now = std::chrono::steady_clock::now();
  for (size_t i = 0; i < slots_.size(); ++i) {
    slots_[i].started = now;
    if (i < children.size()) slots_[i].pid = children[i];
  }
}

void decode_keeper::check(std::chrono::steady_clock::time_point now) {
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& s = slots_[i];
    if (std::string how; s.pid > 0 && process_exited(s.pid, &how)) {
      // Reaped: never signalled again (its pid may be another's by then).
      children_.erase(std::remove(children_.begin(), children_.end(), s.pid), children_.end());
      const auto ran_ms = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(now - s.started).count());
      s.backoff_ms = backoff_.next_delay_ms(s.backoff_ms, ran_ms);
      s.restart_at = now + std::chrono::milliseconds{s.backoff_ms};
      std::printf("%s baton local: decode process decode-%zu (pid %d) ended (%s); starting it again in %u ms\n",
                  utc_stamp().c_str(), i, static_cast<int>(s.pid), how.c_str(), s.backoff_ms);
      std::fflush(stdout);
      s.pid = -1;
    }
    if (s.pid >= 0 || now < s.restart_at) continue;
    std::string why;
    s.started = now;
    if (auto pid = spawn_process(argv_[i], &why); pid > 0) {
      s.pid = pid;
      children_.push_back(pid);
      std::printf("%s baton local: decode process decode-%zu started again (pid %d)\n", utc_stamp().c_str(), i,
                  static_cast<int>(pid));
    } else {  // tried again after the next wait
      s.backoff_ms = backoff_.next_delay_ms(s.backoff_ms, 0);
      s.restart_at = now + std::chrono::milliseconds{s.backoff_ms};
      std::printf("%s baton local: decode process decode-%zu could not be started again (%s); next try in %u ms\n",
                  utc_stamp().c_str(), i, why.c_str(), s.backoff_ms);
    }
    std::fflush(stdout);
  }
}

}  // namespace baton::deploy

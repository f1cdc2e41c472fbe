#include "deploy/processes.hpp"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <thread>

#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>

#include "actors/messages.hpp"

extern char** environ;

namespace baton::deploy {

namespace {
std::atomic<bool> stop_flag{false};
void on_signal(int) { stop_flag = true; }
}  // namespace

void configure_networked_system(caf::actor_system_config& cfg, uint32_t scheduler_threads, uint32_t poll_attempts) {
  register_message_types(cfg);
  cfg.load<caf::io::middleman>();
  cfg.set("scheduler.max-threads", scheduler_threads);
  cfg.set("work-stealing.moderate-poll-attempts", poll_attempts);
  cfg.set("logger.console-verbosity", caf::atom("quiet"));
}

pid_t spawn_process(const std::vector<std::string>& argv, std::string* why, const std::vector<std::string>& env) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e) envp.push_back(*e);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  pid_t pid = -1;
  // posix_spawnp: an ssh command is found on PATH; our own binary comes as an absolute path.
  if (int rc = posix_spawnp(&pid, args[0], nullptr, nullptr, args.data(), envp.data()); rc != 0) {
    if (why) *why = "cannot start " + argv[0] + ": " + std::strerror(rc);
    return -1;
  }
  return pid;
}

bool process_alive(pid_t pid) {
  int status = 0;
  return waitpid(pid, &status, WNOHANG) == 0;
}

bool process_exited(pid_t pid, std::string* how) {
  int status = 0;
  if (waitpid(pid, &status, WNOHANG) != pid) return false;
  if (WIFEXITED(status))
    *how = "exit code " + std::to_string(WEXITSTATUS(status));
  else if (WIFSIGNALED(status))
    *how = "signal " + std::to_string(WTERMSIG(status));
  return true;
}

void stop_processes(std::vector<pid_t>& pids, int grace_ms) {
  for (auto pid : pids) kill(pid, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds{grace_ms};
  for (auto pid : pids) {
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
  }
  pids.clear();
}

std::string self_executable() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string{"baton"};
}

void install_stop_signals() {
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  // A node started over `ssh -tt` gets SIGHUP when its ssh session ends (the launcher stopped
  // it): the same orderly stop.
  sigaction(SIGHUP, &sa, nullptr);
}

bool stop_requested() { return stop_flag.load(); }

}  // namespace baton::deploy

#include "deploy/processes.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <time.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <sstream>
#include <thread>

#include "actors/messages.hpp"
#include "deploy/net_security.hpp"

extern char** environ;

namespace baton::deploy {

namespace {
std::atomic<int> stop_signals{0};  // lock-free: written in a signal handler
std::atomic<int64_t> first_stop_ns{0};
std::atomic<bool> insisted{false};
int64_t monotonic_ns() {  // clock_gettime is async-signal-safe
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}
// A signal a second or more after the first insists. Closer ones are the same request several
// times: a parent's death signal is sent again as the child is handed between the dying
// launcher's threads, and systemd signals a whole process tree, launcher and children alike.
void on_signal(int) {
  const int64_t now = monotonic_ns();
  int64_t none = 0;
  if (!first_stop_ns.compare_exchange_strong(none, now) && now - first_stop_ns.load() >= 1000000000) insisted.store(true);
  stop_signals.fetch_add(1);
}
// A hangup asks for a stop but never insists: it comes with a launcher's own signal (an ssh
// session's end), and must not cut short the drain that one asked for.
void on_hangup(int) {
  int64_t none = 0;
  first_stop_ns.compare_exchange_strong(none, monotonic_ns());
  int zero = 0;
  stop_signals.compare_exchange_strong(zero, 1);
}
/// Reaps `pid` after its SIGKILL, waiting 10 s at most: a child stuck in the kernel (a GPU
/// driver's teardown, a hung NFS mount: uninterruptible) must not hang its parent's stop of the
/// others. False when it did not end in time (it is left to init, a zombie until then).
bool reap_killed(pid_t pid, int* status) {
  for (int i = 0; i < 1000; ++i) {
    const pid_t got = waitpid(pid, status, WNOHANG);
    if (got == pid || (got < 0 && errno != EINTR)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  std::fprintf(stderr, "baton: process %d did not end within 10 s of SIGKILL (stuck in the kernel?); left behind\n",
               static_cast<int>(pid));
  return false;
}
}  // namespace

std::string net_security::validate() const {
  if (cluster_id.empty()) return "--cluster-id must not be empty";
  const int given = !tls_cert.empty() + !tls_key.empty() + !tls_ca.empty();
  if (given != 0 && given != 3) return "TLS needs all three of --tls-cert, --tls-key and --tls-ca";
  for (const auto* f : {&tls_cert, &tls_key, &tls_ca})
    if (!f->empty() && ::access(f->c_str(), R_OK) != 0) return "cannot read " + *f;
  return {};
}

void apply_net_security(caf::actor_system_config& cfg, const net_security& sec) {
  net::apply_identity(cfg, sec.cluster_id, sec.tls_cert, sec.tls_key, sec.tls_ca);
}

void configure_networked_system(caf::actor_system_config& cfg, uint32_t scheduler_threads, uint32_t poll_attempts,
                                const net_security& sec) {
  register_message_types(cfg);
  cfg.load<caf::io::middleman>();
  apply_net_security(cfg, sec);
  cfg.set("scheduler.max-threads", scheduler_threads);
  cfg.set("work-stealing.moderate-poll-attempts", poll_attempts);
  cfg.set("logger.console-verbosity", caf::atom("quiet"));
}

pid_t spawn_process(const std::vector<std::string>& argv, std::string* why, const std::vector<std::string>& env,
                    bool quiet, int* stdin_writer, bool null_stdin) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The inherited environment, then `env` over it: a name given here replaces an inherited one
  // (with both present, getenv would return the inherited value, which comes first). The child
  // learns its parent (BATON_PARENT_PID): a baton process stops when its parent dies, so a
  // launcher killed with SIGKILL leaves no node behind holding its ports.
  std::vector<std::string> own = env;
  own.push_back("BATON_PARENT_PID=" + std::to_string(::getpid()));
  auto name_of = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e) {
    const std::string name = name_of(*e);
    if (std::none_of(own.begin(), own.end(), [&](const std::string& o) { return name_of(o) == name; })) envp.push_back(*e);
  }
  for (auto& e : own) envp.push_back(e.data());
  envp.push_back(nullptr);
  int pipe_fds[2] = {-1, -1};
  if (stdin_writer && pipe2(pipe_fds, O_CLOEXEC) != 0) {
    if (why) *why = std::string{"cannot make a pipe: "} + std::strerror(errno);
    return -1;
  }
  // The child reports a failed exec's errno here (close-on-exec: a successful exec closes it).
  int err_fds[2] = {-1, -1};
  if (pipe2(err_fds, O_CLOEXEC) != 0) {
    if (why) *why = std::string{"cannot make a pipe: "} + std::strerror(errno);
    if (stdin_writer) close(pipe_fds[0]), close(pipe_fds[1]);
    return -1;
  }
  const pid_t parent = ::getpid();
  // fork + exec, not posix_spawn: the child must die with this process (PR_SET_PDEATHSIG), which
  // no spawn attribute sets. Baton children also watch BATON_PARENT_PID themselves, but an ssh
  // (a remote node) would outlive a launcher killed with SIGKILL and keep its node running
  // unsupervised. Between fork and exec only async-signal-safe calls.
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);  // the parent died before the line above
    // A process group of its own: a terminal's Ctrl-C reaches this process alone, which stops
    // its children in order (nodes drain before the head) instead of all of them at once.
    ::setpgid(0, 0);
    if (quiet) {
      const int null_out = ::open("/dev/null", O_WRONLY);
      ::dup2(null_out, 1);
      ::dup2(null_out, 2);
    }
    if (stdin_writer) {
      ::dup2(pipe_fds[0], 0);  // dup2 clears close-on-exec on stdin
    } else if (null_stdin) {
      const int null_in = ::open("/dev/null", O_RDONLY);
      ::dup2(null_in, 0);
    }
    ::execvpe(args[0], args.data(), envp.data());  // PATH: an ssh command; our own binary is absolute
    const int e = errno;
    [[maybe_unused]] auto n = ::write(err_fds[1], &e, sizeof e);
    ::_exit(127);
  }
  const int fork_errno = errno;
  close(err_fds[1]);
  int exec_errno = 0;
  if (pid > 0) {
    ssize_t got;
    while ((got = ::read(err_fds[0], &exec_errno, sizeof exec_errno)) < 0 && errno == EINTR) {
    }
    if (got != static_cast<ssize_t>(sizeof exec_errno)) exec_errno = 0;  // EOF: the exec succeeded
  }
  close(err_fds[0]);
  const int rc = pid < 0 ? fork_errno : exec_errno;
  if (pid > 0 && exec_errno != 0) {
    int status = 0;
    ::waitpid(pid, &status, 0);  // it exited at once: reaped here, no zombie
  }
  if (stdin_writer) {
    close(pipe_fds[0]);
    if (rc != 0) close(pipe_fds[1]);
    else *stdin_writer = pipe_fds[1];
  }
  if (rc != 0) {
    if (why) *why = "cannot start " + argv[0] + ": " + std::strerror(rc);
    return -1;
  }
  return pid;
}

int run_process(const std::vector<std::string>& argv, std::string* why) {
  const pid_t pid = spawn_process(argv, why, {}, /*quiet*/ true);
  if (pid < 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) {
    if (why) *why = argv[0] + ": lost track of the process";
    return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int run_process_with_input(const std::vector<std::string>& argv, const std::string& input, int timeout_ms,
                           std::string* why) {
  std::string ignored;
  if (!why) why = &ignored;
  int writer = -1;
  const pid_t pid = spawn_process(argv, why, {}, /*quiet*/ false, &writer);
  if (pid < 0) return -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds{timeout_ms};
  auto left_ms = [&] {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    return static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT_MAX));
  };
  // Written without blocking past the deadline (a child that never reads, an ssh stuck
  // connecting, must not hold this process), and with SIGPIPE blocked in this thread, after the
  // fork (the child would inherit the mask): a child that exited early fails the write (EPIPE)
  // instead of ending this process.
  sigset_t pipe_signal, old_mask;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, &old_mask);
  ::fcntl(writer, F_SETFL, ::fcntl(writer, F_GETFL) | O_NONBLOCK);
  std::string write_error;
  bool broken_pipe = false;
  for (size_t done = 0; done < input.size() && write_error.empty();) {
    pollfd p{writer, POLLOUT, 0};
    const int ready = ::poll(&p, 1, left_ms());
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      write_error = "it took no input within " + std::to_string(timeout_ms) + " ms";
      break;
    }
    if (ready < 0) {
      write_error = std::string{"cannot wait to write its input: "} + std::strerror(errno);
      break;
    }
    const ssize_t n = ::write(writer, input.data() + done, input.size() - done);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) {
      broken_pipe = errno == EPIPE;
      write_error = std::string{"cannot write its input: "} + std::strerror(errno);
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (broken_pipe) {  // the SIGPIPE that write raised, pending in this thread: taken, not delivered
    const timespec now{0, 0};
    ::sigtimedwait(&pipe_signal, nullptr, &now);
  }
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  ::close(writer);  // the end of its input
  int status = 0;
  for (;;) {
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) break;
    if (got < 0 && errno != EINTR) {
      *why = argv[0] + ": lost track of the process";
      return -1;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      reap_killed(pid, &status);
      *why = argv[0] + " did not finish within " + std::to_string(timeout_ms) + " ms (killed)" +
             (write_error.empty() ? "" : "; " + write_error);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (!write_error.empty()) {
    *why = argv[0] + ": " + write_error;
    if (rc == 0) return -1;  // it ended well without its whole input: not a success
  }
  return rc;
}

bool tcp_listening(const std::string& host, uint16_t port, int timeout_ms) {
  return net::tcp_probe(host, port, timeout_ms) == 0;
}

int open_tcp_listener(const std::string& host, uint16_t port, uint16_t* bound, std::string* why, const std::string& who) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  const std::string h = host == "localhost" ? "127.0.0.1" : host;
  if (inet_pton(AF_INET, h.c_str(), &addr.sin_addr) != 1) {
    *why = who + ": host '" + host + "' is not an IPv4 address";
    return -1;
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *why = who + ": socket: " + std::strerror(errno);
    return -1;
  }
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  // A client gone without a FIN or RST (a dropped NAT entry, a laptop asleep) is noticed within
  // about a minute and its call cancelled, where it used to hold its KV until max_tokens.
  // Accepted connections inherit both options. Keepalive (30 s idle, then 3 probes 10 s apart)
  // finds it while nothing is being sent (a call not streamed); the user timeout (60 s of sent
  // bytes unacknowledged) while a stream sends, where retransmissions alone take ~15 minutes.
  const int idle_s = 30, interval_s = 10, probes = 3;
  const unsigned unacked_ms = 60000;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &unacked_ms, sizeof(unacked_ms));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    *why = who + ": cannot listen on " + host + ":" + std::to_string(port) + ": " + std::strerror(errno);
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *bound = ntohs(addr.sin_port);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}


std::string why_cannot_bind(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0)
    return std::string{"the host does not resolve: "} + ::gai_strerror(rc);
  std::string why;
  for (auto* a = found; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // as CAF binds
    const bool bound = ::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1) == 0;
    if (!bound && why.empty()) why = std::strerror(errno);
    ::close(fd);
    if (bound) {
      why.clear();
      break;
    }
  }
  ::freeaddrinfo(found);
  return why;
}

bool process_alive(pid_t pid) {
  // Looks without reaping (WNOWAIT): the exit stays for process_exited to collect, which the
  // launcher's restarts go by; reaped here, the pid looked alive for good after, and a stop
  // signalled a number the system may have handed to another process.
  siginfo_t info{};
  return waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == 0;
}

bool process_gone(pid_t pid, std::string* how) {
  siginfo_t info{};
  if (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != pid) return false;
  *how = (info.si_code == CLD_EXITED ? "exit code " : "signal ") + std::to_string(info.si_status);
  return true;
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

std::vector<pid_t> stop_processes(std::vector<pid_t>& pids, int grace_ms, bool signalled) {
  if (!signalled)
    for (auto pid : pids) kill(pid, SIGTERM);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::milliseconds{grace_ms};
  std::vector<pid_t> killed;
  bool insisted = false;
  for (size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    while (waitpid(pids[i], &status, WNOHANG) == 0) {
      // Our own stop insisted (a second signal): so do we, to the children still draining --
      // a second or more after their first SIGTERM, or they would take it for a repeat.
      if (!insisted && stop_insisted() && std::chrono::steady_clock::now() - start >= std::chrono::milliseconds{1100}) {
        insisted = true;
        for (size_t j = i; j < pids.size(); ++j) kill(pids[j], SIGTERM);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pids[i], SIGKILL);
        reap_killed(pids[i], &status);
        killed.push_back(pids[i]);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
  }
  pids.clear();
  return killed;
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
  struct sigaction hup{};
  hup.sa_handler = on_hangup;
  sigaction(SIGHUP, &hup, nullptr);
}

bool stop_requested() { return stop_signals.load() > 0; }
bool stop_insisted() { return insisted.load(); }

bool read_stand_in(std::string* line) {
  line->clear();
  while (!stop_requested()) {
    pollfd p{0, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char c;
    const ssize_t n = read(0, &c, 1);
    if (n <= 0) return false;
    if (c == '\n') return true;
    *line += c;
  }
  return false;
}

bool parse_stand_in(const std::string& line, uint32_t* dp_first_rank, std::string* why) {
  std::istringstream in{line};
  std::vector<std::string> words{std::istream_iterator<std::string>{in}, {}};
  if (words.empty()) return true;
  if (words.size() == 2 && words[0] == "--dp-first-rank") {
    char* end = nullptr;
    const unsigned long v = std::strtoul(words[1].c_str(), &end, 10);
    if (!words[1].empty() && *end == '\0' && v <= UINT32_MAX) {
      *dp_first_rank = static_cast<uint32_t>(v);
      return true;
    }
  }
  *why = "cannot take '" + line + "' (only `--dp-first-rank N`, or an empty line)";
  return false;
}


}  // namespace baton::deploy

#pragma once

// Child processes of a node launcher: started with posix_spawn, stopped with SIGTERM (then
// SIGKILL after a grace period), always reaped.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace caf {
class actor_system_config;
}

namespace baton::deploy {

/// Who may talk to whom between Baton's processes (deploy/net_security.hpp has the why).
struct net_security {
  std::string cluster_id = "baton";       ///< processes of different ids refuse each other
  std::string tls_cert, tls_key, tls_ca;  ///< PEM files; all three, or none (plain TCP)
  bool tls() const { return !tls_cert.empty(); }
  /// Empty, or what is wrong (a missing file, only some of the three).
  std::string validate() const;
};

/// The actor system of a process that talks to others: Baton's message types, the network
/// layer (middleman), `scheduler_threads` workers, `poll_attempts` moderate polls (0 avoids the
/// work-stealing scheduler's 50 us sleeps, platform-notes §1.4), a quiet console logger.
/// Also the cluster's id and TLS (deploy/net_security.hpp).
void configure_networked_system(caf::actor_system_config& cfg, uint32_t scheduler_threads, uint32_t poll_attempts,
                                const net_security& sec);

/// Starts `argv[0]` with `argv` (no shell), this process's environment plus `env` ("K=V");
/// returns the pid, or -1 with `*why` set. With `stdin_writer`, the child's stdin is a pipe whose
/// writing end (close-on-exec) comes back there; with `null_stdin`, /dev/null (an `ssh -tt`
/// given the terminal would put it in raw mode, so Ctrl-C would no longer reach this process).
/// The child gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG; so a launcher
/// killed with SIGKILL leaves no ssh behind), and a process group of its own (a terminal's
/// Ctrl-C reaches this process only, which stops its children in its own order).
pid_t spawn_process(const std::vector<std::string>& argv, std::string* why, const std::vector<std::string>& env = {},
                    bool quiet = false, int* stdin_writer = nullptr, bool null_stdin = false);

/// Runs `argv` to its end (no shell), its output discarded; its exit code, or -1 with `*why` set.
int run_process(const std::vector<std::string>& argv, std::string* why);
/// Runs `argv` (no shell) with `input` on its stdin (then closed), its output this process's, and
/// waits for its end, up to `timeout_ms`: its exit code (128 + N for signal N), or -1 with `*why`
/// set when it could not start or ran past the timeout (then it is killed with SIGKILL and
/// reaped). A child that exits without reading its input is no harm: its exit code says the rest
/// (the failed write is in `*why`).
int run_process_with_input(const std::vector<std::string>& argv, const std::string& input, int timeout_ms,
                           std::string* why);

/// SIGTERM to each, wait up to `grace_ms`, then SIGKILL what is left; reaps all.
/// Returns those it had to kill. A second signal to this process while it waits (stop_insisted)
/// is passed on: each child still running gets SIGTERM again.
/// `signalled`: they had their SIGTERM already (none is sent again: within a second, a second
/// one would be a repeat, after it an insistence).
std::vector<pid_t> stop_processes(std::vector<pid_t>& pids, int grace_ms = 3000, bool signalled = false);

/// True while child `pid` has not exited. Never reaps it: process_exited does, once.
bool process_alive(pid_t pid);
/// True when `pid` has exited (reaped); `how` says how: "exit code N" or "signal N".
bool process_exited(pid_t pid, std::string* how);
/// The same without reaping it (waitid's WNOWAIT): its owner still reaps it, and its pid cannot
/// be reused meanwhile.
bool process_gone(pid_t pid, std::string* how);

/// True when something accepts a TCP connection on host:port within `timeout_ms` (the
/// connection is closed at once). For the launcher, which says a gateway's address only once it
/// answers there.
bool tcp_listening(const std::string& host, uint16_t port, int timeout_ms);
/// A listening TCP socket on host:port (an IPv4 literal or "localhost"), non-blocking, for a
/// server of this process (the gateway's broker): accepted connections inherit keepalive and a
/// user timeout, so a client gone without a FIN or RST is noticed within about a minute. -1,
/// and why (prefixed with `who`), on failure; `*bound` is the port (0 asked: the one chosen).
int open_tcp_listener(const std::string& host, uint16_t port, uint16_t* bound, std::string* why, const std::string& who);
/// Why host:port cannot be bound for listening, as the system says it ("Address already in
/// use", "Cannot assign requested address"), or why the host does not resolve; empty when it
/// can. CAF's own refusal says only "tcp socket creation failed".
std::string why_cannot_bind(const std::string& host, uint16_t port);

/// This executable's path (/proc/self/exe), to start sibling nodes.
std::string self_executable();

/// A spare standing by (`baton node --standby`): one line from stdin (without its newline), the
/// flags its launcher writes when it stands in, waiting in slices so that SIGINT or SIGTERM ends
/// the wait at once. False on a stop, or when stdin closes first.
bool read_stand_in(std::string* line);
/// Those flags: `--dp-first-rank N`, or none; false and why for anything else.
bool parse_stand_in(const std::string& line, uint32_t* dp_first_rank, std::string* why);

/// Installs SIGINT/SIGTERM/SIGHUP handlers that set a flag read by stop_requested().
void install_stop_signals();
bool stop_requested();
/// A second SIGINT or SIGTERM came, a second or more after the first: what a graceful stop was
/// waiting for is not waited for any more. (Signals closer together are one request sent
/// several times -- a parent's death signal, systemd signalling a process tree; SIGHUP asks for
/// a stop, never insists.)
bool stop_insisted();

}  // namespace baton::deploy

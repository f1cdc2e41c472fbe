// `baton launch SPEC`: starts every node of a cluster spec -- the head (router, balancers,
// prefill ranks, block store), decode nodes and gateways -- as processes on this machine, or
// over ssh on other hosts; waits until every node has joined the head's node directory; prints
// where clients connect; and on SIGINT/SIGTERM stops them, decode nodes and gateways first (they
// drain), the head last. `baton deploy k8s|slurm SPEC` writes the same nodes for a scheduler.

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/messages.hpp"
#include "actors/node_directory.hpp"
#include "actors/router.hpp"
#include "deploy/api_keys.hpp"
#include "deploy/cluster_spec.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/net_security.hpp"
#include "deploy/processes.hpp"
#include "deploy/utc_stamp.hpp"
#include "gpu/text_file.hpp"
#include "policies/restart_backoff.hpp"

namespace baton::deploy {

namespace {

/// A running cluster's lines start with the time (UTC, as the head's node events and the request
/// log do), so that an incident's timeline reads from the launcher's output alone.
std::string stamp() { return utc_stamp() + " "; }


/// The spec path: the first argument that is neither a flag nor a flag's value (taken out of
/// `args`). A flag's value follows it unless the flag says `--flag=value`, takes none (`no_value`:
/// the boolean flags), or is -h.
std::string take_spec_path(std::vector<std::string>& args, const std::vector<std::string>& no_value = {"--dry-run"}) {
  auto is_flag = [](const std::string& a) { return a.rfind("-", 0) == 0; };
  auto takes_next = [&](const std::string& a) {
    return a.rfind("--", 0) == 0 && a.find('=') == std::string::npos &&
           std::find(no_value.begin(), no_value.end(), a) == no_value.end() && a != "--help";
  };
  for (size_t i = 0; i < args.size(); ++i)
    if (!is_flag(args[i]) && (i == 0 || !takes_next(args[i - 1]))) {
      auto p = args[i];
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
      return p;
    }
  return {};
}

struct child {
  child(node_launch n, pid_t p, int in = -1) : node(std::move(n)), pid(p), standby_in(in) {}
  node_launch node;
  pid_t pid = -1;  ///< -1 while it waits to be restarted
  /// A spare standing by (`baton node --standby`, its model loaded): its stdin, where it is told
  /// the flags of the node it stands in for; -1 for every other child.
  int standby_in = -1;
  std::chrono::steady_clock::time_point started_at = std::chrono::steady_clock::now();
  /// Failed, restarted at this time (--restart-backoff-ms); how it ended, for the message then.
  std::optional<std::chrono::steady_clock::time_point> restart_at;
  std::string ended;
  uint32_t backoff_ms = 0;  ///< the wait before its current run (0: not restarted yet)
};

std::vector<std::string> command_of(const cluster_spec& spec, const node_launch& n) {
  return is_local_host(n.host) ? n.argv : ssh_argv(spec, n.host, n);
}

std::string printable(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) out += (out.empty() ? "" : " ") + (a.find_first_of(" '\"$\\") == std::string::npos ? a : shell_quote(a));
  return out;
}

/// How long the ssh that writes a remote node's environment may take (connecting included).
constexpr int env_write_timeout_ms = 30'000;

/// A remote node's environment, written to its host (env_file_argv) just before the ssh that
/// starts it reads it: its values (API keys, tokens) travel on ssh's stdin, never in an argv that
/// `ps` shows on either host. Nothing to do for a local node (its environment is its own) or one
/// without an environment. False and why on failure.
bool send_remote_env(const cluster_spec& spec, const node_launch& n, std::string* why) {
  if (is_local_host(n.host) || n.env.empty()) return true;
  std::string err;
  const int rc = run_process_with_input(env_file_argv(spec, n.host, n), env_file_text(n), env_write_timeout_ms, &err);
  if (rc == 0) return true;
  *why = "cannot write its environment to ~/" + remote_env_file(spec, n) + " on " + n.host + " over ssh (" +
         (rc < 0 ? err : "exit code " + std::to_string(rc) + (err.empty() ? "" : "; " + err)) + ")";
  return false;
}

/// The cluster CA and a certificate for every node, the launcher and clients, made with the
/// openssl command (EC P-256, one year). Kept when they exist, so a restarted cluster keeps its
/// identity; false and why on failure.
bool make_certificates(const cluster_spec& spec, std::string* why) {
  std::error_code ec;
  std::filesystem::create_directories(spec.tls_dir, ec);
  std::filesystem::permissions(spec.tls_dir, std::filesystem::perms::owner_all, ec);
  const std::string dir = spec.tls_dir;
  auto run = [&](std::vector<std::string> argv) {
    argv.insert(argv.begin(), "openssl");
    const int rc = run_process(argv, why);
    if (rc != 0 && why->empty()) *why = "openssl " + argv[1] + " failed (exit code " + std::to_string(rc) + ")";
    return rc == 0;
  };
  const std::vector<std::string> ec_key = {"-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"};
  if (!std::filesystem::exists(dir + "/ca.pem")) {
    std::vector<std::string> ca = {"req", "-x509", "-days", "365", "-keyout", dir + "/ca.key", "-out", dir + "/ca.pem",
                                   "-subj", "/CN=baton-" + spec.name + "-ca"};
    ca.insert(ca.begin() + 2, ec_key.begin(), ec_key.end());
    if (!run(ca)) return false;
  }
  std::vector<std::string> names = {"launcher", "client"};
  for (const auto& n : spec.nodes) names.push_back(n.name);
  for (const auto& n : names) {
    const auto t = tls_files_for(spec, n);
    if (std::filesystem::exists(t.cert)) continue;
    std::vector<std::string> req = {"req", "-keyout", t.key, "-out", dir + "/" + n + ".csr", "-subj",
                                    "/CN=" + spec.name + "-" + n};
    req.insert(req.begin() + 1, ec_key.begin(), ec_key.end());
    if (!run(req) || !run({"x509", "-req", "-in", dir + "/" + n + ".csr", "-CA", dir + "/ca.pem", "-CAkey",
                           dir + "/ca.key", "-CAcreateserial", "-days", "365", "-out", t.cert}))
      return false;
    std::filesystem::remove(dir + "/" + n + ".csr", ec);
  }
  return true;
}

/// Waits, up to a budget in ms, until the named nodes have left the head's register.
using remote_wait = std::function<void(const std::vector<std::string>& names, int budget_ms)>;

void stop_all(std::vector<child>& children, int drain_ms, const remote_wait& await_remote = {}) {
  // Rank nodes and gateways first: they drain (finish their streams and write-backs) before the
  // head goes; store nodes last, as the write-backs land on them.
  std::vector<pid_t> nodes, head, stores, gateways;
  std::vector<std::string> remote;
  std::map<pid_t, std::string> names;
  for (const auto& c : children)
    if (c.pid > 0) {
      (c.node.role == "head" ? head : c.node.role == "store" ? stores : c.node.role == "gateway" ? gateways : nodes)
          .push_back(c.pid);
      if (c.node.role != "head" && c.node.role != "store" && !is_local_host(c.node.host)) remote.push_back(c.node.process);
      names[c.pid] = c.node.process;
    }
  // Said, not silent: a node killed at the end of its time did not finish its drain.
  const auto stop = [&](std::vector<pid_t>& pids, int grace_ms, bool signalled = false) {
    for (auto pid : stop_processes(pids, grace_ms, signalled))
      std::printf("%sbaton launch: %s did not stop within %d ms of SIGTERM; killed it\n", stamp().c_str(), names[pid].c_str(), grace_ms);
  };
  const auto started = std::chrono::steady_clock::now();
  // Gateways a moment before the rank nodes: they turn new calls away (503) at once, instead of
  // sending them to a cluster whose decode ranks have just stopped taking work (those waited out
  // the balancer's grace for a rank, seconds, before their 503). One SIGTERM each.
  for (auto pid : gateways) kill(pid, SIGTERM);
  if (!gateways.empty()) std::this_thread::sleep_for(std::chrono::milliseconds{300});
  // Then the rank nodes, and all of them drain within the one time: waited on together, so that
  // a second signal reaches the gateways still draining too, not only once every node has gone.
  for (auto pid : nodes) kill(pid, SIGTERM);
  std::vector<pid_t> draining = nodes;
  draining.insert(draining.end(), gateways.begin(), gateways.end());
  stop(draining, drain_ms, true);
  // A remote node's ssh ends at once (its session's end is the node's SIGHUP): the node drains
  // on its host meanwhile, and the head must outlive that drain, which the head's register shows.
  if (await_remote && !remote.empty()) {
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started);
    await_remote(remote, std::max<int>(0, drain_ms - static_cast<int>(spent.count())));
  }
  stop(head, 5000);
  stop(stores, 5000);
  children.clear();
}

}  // namespace

int run_launch(const std::vector<std::string>& raw_args) {
  // Line by line, also into a file or pipe: the nodes write into the same output, and a line of
  // ours held in a buffer came out after theirs (a node "stopped" before it "started").
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  auto args = raw_args;
  const std::string spec_path = take_spec_path(args);
  uint32_t wait_s = 60, drain_ms = 30000, restart_failed = 0;
  bool dry_run = false;
  flag_set flags;
  flags.add("--restart-failed", &restart_failed,
            "start a node again, up to this many times, when it exits with a failure (a signal, or a non-zero code: "
            "3 is a node leaving so that its data-parallel group can re-form or its expert shards start again); the "
            "head too, however it ends (exit code 0 as well: the cluster cannot serve without it), which the other "
            "nodes wait for and join again; a node that then serves 10 minutes has its restarts back; 0: a node that "
            "leaves stays away, and the head's end stops the cluster");
  policies::restart_backoff backoff;
  flags.add("--restart-backoff-ms", &backoff.base_ms,
            "wait this long before the first restart of a failed node, twice as long after each failure that "
            "follows within a minute of its start (at most 30 s), so a crash loop does not spend its restarts at "
            "once; 0 restarts at once");
  flags.add("--wait-s", &wait_s, "give up when the nodes have not all joined after this long");
  flags.add("--drain-ms", &drain_ms,
            "on stop, how long decode nodes and gateways may drain before they are killed (each process gets it as "
            "its --drain-timeout-ms; with --restart-failed, nodes and gateways wait --wait-s + 30 s for a restarted head)");
  flags.add("--dry-run", &dry_run, "print each node's command line and start nothing");
  if (auto rc = flags.parse_command_line(args, "launch", "baton launch SPEC.json [flags]")) return *rc;
  if (drain_ms > 3'600'000) {
    std::fprintf(stderr, "baton launch: --drain-ms %u is more than an hour (3600000)\n", drain_ms);
    return 2;
  }
  if (spec_path.empty()) {
    std::fprintf(stderr, "baton launch: give the cluster spec file (baton launch SPEC.json)\n");
    return 2;
  }
  cluster_spec spec;
  std::string why;
  if (!load_cluster_spec(spec_path, &spec, &why)) {
    std::fprintf(stderr, "baton launch: %s\n", why.c_str());
    return 2;
  }
  if (spec.api_keys.empty() && !spec.api_keys_env.empty() && !dry_run) {
    const char* v = std::getenv(spec.api_keys_env.c_str());
    if (!v || !*v) {
      std::fprintf(stderr, "baton launch: the spec reads its API keys from $%s, which is not set\n", spec.api_keys_env.c_str());
      return 2;
    }
    spec.api_keys = split_list(v);
  }
  if (!spec.api_keys_file.empty()) {  // read here, checked, and handed to the gateways as text
    std::vector<api_key> named;
    if (!gpu::read_text_file(spec.api_keys_file, &spec.api_keys_json) ||
        !parse_api_keys(spec.api_keys_json, &named, &why)) {
      std::fprintf(stderr, "baton launch: spec.api_keys_file %s: %s\n", spec.api_keys_file.c_str(),
                   why.empty() ? "cannot read it" : why.c_str());
      return 2;
    }
  }
  const auto& head = spec.head();
  const std::string binary = spec.binary.empty() ? self_executable() : spec.binary;
  auto plan = plan_launch(spec, self_executable(), {head.host, ""});
  for (auto& n : plan)  // remote hosts run the spec's binary path (default: the same as here)
    if (!is_local_host(n.host)) n.argv[0] = binary;
  // The launcher's timeouts reach its processes: each drains within --drain-ms (their own
  // default, 60 s, cut a longer one short), and with restarts a node or gateway waits for a
  // restarted head as long as the launcher does (--wait-s, plus the longest restart backoff):
  // their own 60 s gave up on a head that reloads a large model, and spent their restarts.
  for (auto& n : plan) {
    const auto has = [&](const char* f) { return std::find(n.argv.begin(), n.argv.end(), f) != n.argv.end(); };
    if (!has("--drain-timeout-ms")) n.argv.insert(n.argv.end(), {"--drain-timeout-ms", std::to_string(drain_ms)});
    if (n.role != "head" && restart_failed > 0 && !has("--head-wait-s"))
      n.argv.insert(n.argv.end(), {"--head-wait-s", std::to_string(std::max<uint32_t>(60, wait_s + 30))});
  }
  if (dry_run) {
    for (const auto& n : plan) {
      auto shown = n;
      if (n.spare) shown.argv.push_back("--standby");  // as stand_by below starts it
      std::printf("# %s (%s on %s%s)\n", n.name.c_str(), n.role.c_str(), n.host.c_str(),
                  n.spare ? "; a spare: stands by with the model loaded until a node fails for good, then takes its place"
                          : "");
      // The environment's names only: its values may be secrets (API keys, tokens), and this
      // output goes to terminals, logs and bug reports.
      if (!n.env.empty()) {
        std::string names;
        for (const auto& kv : n.env) names += " " + kv.first + "=<redacted>";
        std::printf("# environment:%s\n", names.c_str());
        if (!is_local_host(n.host))
          std::printf("# written first, over ssh's stdin: %s\n", printable(env_file_argv(spec, n.host, n)).c_str());
      }
      std::printf("%s\n", printable(command_of(spec, shown)).c_str());
    }
    return 0;
  }

  // Every port this launch listens on here, free before any process starts: a second launch of
  // a running cluster started nodes that joined the live head under their names -- each
  // replacing the live process of its name, which left -- before its own head failed to bind.
  for (const auto& n : spec.nodes) {
    if (!is_local_host(n.host)) continue;  // another host's ports: its processes say so
    for (const auto& [what, port] : {std::pair<const char*, uint16_t>{"router", n.router_port},
                                     {"cluster", n.cluster_port},
                                     {"http", n.http_port},
                                     {"store", n.store_port}}) {
      if (port == 0) continue;
      if (auto taken = why_cannot_bind(n.host, port); !taken.empty()) {
        std::fprintf(stderr,
                     "%sbaton launch: node %s's %s port %s:%u cannot be bound: %s. Is this cluster (or another) already "
                     "running? Stop it first, or give the spec other ports; nothing was started\n", stamp().c_str(),
                     n.name.c_str(), what, n.host.c_str(), static_cast<unsigned>(port), taken.c_str());
        return 1;
      }
    }
  }

  net_security sec;  // the launcher's own connection to the head
  sec.cluster_id = spec.name;
  if (spec.tls) {
    if (!make_certificates(spec, &why)) {
      std::fprintf(stderr, "%sbaton launch: cannot make the cluster's certificates in %s: %s\n", stamp().c_str(), spec.tls_dir.c_str(),
                   why.c_str());
      return 1;
    }
    const auto t = tls_files_for(spec, "launcher");
    sec.tls_cert = t.cert, sec.tls_key = t.key, sec.tls_ca = t.ca;
    const auto c = tls_files_for(spec, "client");
    std::printf("%sbaton launch: mutual TLS; clients use --cluster-id %s --tls-cert %s --tls-key %s --tls-ca %s\n", stamp().c_str(),
                spec.name.c_str(), c.cert.c_str(), c.key.c_str(), c.ca.c_str());
  }
  install_stop_signals();
  std::vector<child> children;
  struct guard {
    std::vector<child>& c;
    uint32_t drain_ms;
    ~guard() { stop_all(c, static_cast<int>(drain_ms)); }
  } g{children, drain_ms};
  auto env_of = [](const node_launch& n) {
    std::vector<std::string> env;
    for (const auto& [k, v] : n.env) env.push_back(k + "=" + v);
    return env;
  };
  std::map<std::string, uint32_t> restarts;  // by node name
  auto spawn = [&](const node_launch& n) -> pid_t {
    const bool local = is_local_host(n.host);
    if (!send_remote_env(spec, n, &why)) return -1;
    // A remote node's ssh reads /dev/null, not the launcher's terminal (see spawn_process).
    return spawn_process(command_of(spec, n), &why, local ? env_of(n) : std::vector<std::string>{}, false, nullptr, !local);
  };
  auto start = [&](const node_launch& n) {
    const auto pid = spawn(n);
    if (pid < 0) return false;
    children.emplace_back(n, pid);
    return true;
  };
  // A spare starts with the others and stands by: it loads the model, then waits on its stdin
  // for the flags of the node it replaces, so taking a failed node's place costs no model load.
  auto stand_by = [&](const node_launch& n) {
    // A spare that died while standing by must fail the write of its flags (EPIPE), not end the
    // launcher with SIGPIPE.
    std::signal(SIGPIPE, SIG_IGN);
    auto sb = n;
    sb.argv.push_back("--standby");
    if (!send_remote_env(spec, sb, &why)) return false;
    int in = -1;
    const auto pid = spawn_process(command_of(spec, sb), &why, is_local_host(n.host) ? env_of(n) : std::vector<std::string>{},
                                   false, &in);
    if (pid < 0) return false;
    children.emplace_back(n, pid, in);
    return true;
  };
  // Nodes that failed before they joined, with restarts allowed: left (unreaped) to the restart
  // loop below, so no longer a reason for the waits before it to end.
  std::set<pid_t> left_before_join;
  // A node (not a spare standing by: one that dies is only started cold later) that has exited.
  auto dead_child = [&]() -> const child* {
    for (const auto& c : children)
      if (c.standby_in < 0 && !left_before_join.count(c.pid) && !process_alive(c.pid)) return &c;
    return nullptr;
  };
  // Store nodes first (the head adopts their block servers as it starts), then the head.
  const auto head_at = static_cast<size_t>(
      std::find_if(plan.begin(), plan.end(), [](const node_launch& n) { return n.role == "head"; }) - plan.begin());
  for (size_t i = 0; i < head_at; ++i) {
    if (!start(plan[i])) {
      std::fprintf(stderr, "%sbaton launch: store node %s: %s\n", stamp().c_str(), plan[i].name.c_str(), why.c_str());
      return 1;
    }
    std::printf("%sbaton launch: store node %s started (pid %d)\n", stamp().c_str(), plan[i].name.c_str(), static_cast<int>(children.back().pid));
  }
  if (!start(plan[head_at])) {
    std::fprintf(stderr, "%sbaton launch: head %s: %s\n", stamp().c_str(), head.name.c_str(), why.c_str());
    return 1;
  }

  caf::actor_system_config cfg;
  configure_networked_system(cfg, 2, 0, sec);
  caf::actor_system sys{cfg};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{wait_s};
  // The head loads the model before it listens: try (bounded) until its directory answers.
  node_directory_actor directory;
  std::string last_error = "nothing listens there yet";
  while (!directory) {
    if (auto d = dead_child()) {
      std::fprintf(stderr, "%sbaton launch: %s %s exited before the head listened; its output says why\n", stamp().c_str(),
                   d->node.role == "head" ? "the head" : "store node", d->node.name.c_str());
      return 1;
    }
    if (stop_requested()) {
      std::fprintf(stderr, "%sbaton launch: stopped while waiting for the head\n", stamp().c_str());
      return 1;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "%sbaton launch: cannot join the head's node directory at %s:%u within %u s: %s\n", stamp().c_str(),
                   head.host.c_str(), static_cast<unsigned>(head.cluster_port), wait_s, last_error.c_str());
      return 1;
    }
    if (auto d = connect_actor<node_directory_actor>(sys, sec, head.host, head.cluster_port)) {
      directory = *d;
    } else {
      last_error = explain_connect_error(sys, d.error(), sec.tls());
      std::this_thread::sleep_for(std::chrono::milliseconds{200});
    }
  }
  std::printf("%sbaton launch: head %s up: router %s:%u (cluster id %s), nodes join at %s:%u\n", stamp().c_str(), head.name.c_str(),
              head.host.c_str(), static_cast<unsigned>(head.router_port), spec.name.c_str(), head.host.c_str(),
              static_cast<unsigned>(head.cluster_port));
  std::fflush(stdout);
  // The head listens once it has adopted the store nodes' block servers; the rest join it.
  // Spares stand by (or, if one cannot start, wait here to start cold) until a node fails for good.
  std::vector<node_launch> spares;
  for (size_t i = head_at + 1; i < plan.size(); ++i) {
    if (plan[i].spare) {
      if (stand_by(plan[i])) {
        std::printf("%sbaton launch: spare %s standing by (pid %d): it takes the place of a node that fails for good\n", stamp().c_str(),
                    plan[i].name.c_str(), static_cast<int>(children.back().pid));
      } else {
        std::fprintf(stderr, "%sbaton launch: spare %s cannot stand by (%s): it starts cold if it is needed\n", stamp().c_str(),
                     plan[i].name.c_str(), why.c_str());
        spares.push_back(plan[i]);
      }
      continue;
    }
    if (!start(plan[i])) {
      std::fprintf(stderr, "%sbaton launch: node %s: %s\n", stamp().c_str(), plan[i].name.c_str(), why.c_str());
      return 1;
    }
  }
  // A node counts once it has joined and started its ranks (it tells the directory their names
  // after its join); their registration with the balancers is awaited below.
  std::set<std::string> waiting;
  std::map<std::string, uint32_t> num_ranks;
  std::vector<std::string> rank_names;
  for (size_t i = head_at + 1; i < plan.size(); ++i)
    if (!plan[i].spare) waiting.insert(plan[i].process), num_ranks[plan[i].process] = plan[i].ranks;
  std::map<std::string, int32_t> joined_pid;  // the process each node last joined as
  caf::scoped_actor self{sys};
  while (!waiting.empty()) {
    if (auto d = dead_child()) {
      // With --restart-failed, a rank node or gateway that fails before it joins is restarted
      // as one failing later is (its backoff, its tries, then a spare), by the loop below once the
      // others have joined: one node's bad start does not take the cluster down. The head's or
      // a store node's end, a clean exit, or no restarts allowed: the launch fails, as before.
      std::string how;
      if (restart_failed > 0 && d->node.role != "head" && d->node.role != "store" && process_gone(d->pid, &how) &&
          how != "exit code 0") {
        std::printf("%sbaton launch: node %s exited before it joined (%s); it is restarted as any failed node is, once "
                    "the others have joined\n", stamp().c_str(),
                    d->node.process.c_str(), how.c_str());
        std::fflush(stdout);
        waiting.erase(d->node.process);
        left_before_join.insert(d->pid);
        continue;
      }
      std::fprintf(stderr, "%sbaton launch: node %s exited before it joined; its output says why\n", stamp().c_str(), d->node.process.c_str());
      return 1;
    }
    if (std::chrono::steady_clock::now() > deadline || stop_requested()) {
      std::string names;
      for (const auto& n : waiting) names += " " + n;
      if (stop_requested())
        std::fprintf(stderr, "%sbaton launch: stopped while waiting for nodes to join:%s\n", stamp().c_str(), names.c_str());
      else
        std::fprintf(stderr, "%sbaton launch: nodes not joined after %u s:%s\n", stamp().c_str(), wait_s, names.c_str());
      return 1;
    }
    self->request(directory, std::chrono::seconds{5}, stats_atom::value)
        .receive(
            [&](std::vector<node_status>& nodes) {
              for (const auto& n : nodes)
                if (n.state == "joined" && n.ranks.size() >= num_ranks[n.name] && waiting.erase(n.name)) {
                  joined_pid[n.name] = n.pid;
                  rank_names.insert(rank_names.end(), n.ranks.begin(), n.ranks.end());
                  std::printf("%sbaton launch: node %s joined (%s, pid %d)\n", stamp().c_str(), n.name.c_str(),
                              n.roles.empty() ? "?" : n.roles.front().c_str(), n.pid);
                }
            },
            [&](caf::error&) {});
    std::fflush(stdout);
    if (!waiting.empty()) std::this_thread::sleep_for(std::chrono::milliseconds{100});
  }
  // The head's own ranks registered before it listened; the nodes' register as they start, and
  // until they have, the first requests would all go to the ranks that registered first.
  {
    // A node that dies meanwhile is the restart loop's below (the wait ends, the cluster is up
    // without it); a stop ends the launch.
    const auto give_up = [&] { return stop_requested() || dead_child() != nullptr; };
    std::string last = "nothing listens there";
    auto router = connect_actor_until<router_actor>(sys, sec, head.host, head.router_port, deadline, give_up, &last);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const auto missing =
        router ? await_ranks_registered(sys, *router, rank_names, std::max(left, std::chrono::milliseconds{0}), give_up)
               : rank_names;
    if (stop_requested()) {
      std::fprintf(stderr, "%sbaton launch: stopped while waiting for the ranks to register\n", stamp().c_str());
      return 1;
    }
    if (auto d = dead_child(); d && d->node.role == "head" && restart_failed == 0) {
      std::fprintf(stderr, "%sbaton launch: the head exited while the ranks registered; stopping the cluster\n", stamp().c_str());
      return 1;
    } else if (d) {
      std::printf("%sbaton launch: %s exited while its ranks registered; %s\n", stamp().c_str(), d->node.process.c_str(),
                  restart_failed > 0 ? "it is restarted as any failed node is (--restart-failed)"
                                     : "it is not restarted (no --restart-failed): the cluster serves without it");
    } else if (!router) {
      std::fprintf(stderr, "%sbaton launch: cannot reach the head's router at %s:%u: %s\n", stamp().c_str(), head.host.c_str(),
                   static_cast<unsigned>(head.router_port), last.c_str());
      return 1;
    } else if (!missing.empty()) {
      std::string names;
      for (const auto& n : missing) names += " " + n;
      std::fprintf(stderr, "%sbaton launch: ranks not registered with the head's balancers after %u s:%s\n", stamp().c_str(), wait_s,
                   names.c_str());
      return 1;
    }
  }
  // A node joins before its gateway listens (a gateway node learns the router's address from
  // its welcome), and clients go to the gateway as soon as this says "is up": wait (within the
  // same deadline) until each gateway accepts connections.
  for (const auto& n : spec.nodes) {
    if (!n.has("gateway")) continue;
    if (std::any_of(children.begin(), children.end(), [&](const child& c) {
          return c.node.name == n.name && c.node.role == "gateway" && left_before_join.count(c.pid);
        })) {  // failed before it joined: the loop below restarts it and says when it has joined
      std::printf("%sbaton launch: gateway %s at http://%s:%u once it is restarted\n", stamp().c_str(), n.name.c_str(), n.host.c_str(),
                  static_cast<unsigned>(n.http_port));
      continue;
    }
    bool answers = tcp_listening(n.host, n.http_port, 200);
    while (!answers && std::chrono::steady_clock::now() < deadline && !stop_requested() && !dead_child()) {
      std::this_thread::sleep_for(std::chrono::milliseconds{100});
      answers = tcp_listening(n.host, n.http_port, 200);
    }
    std::printf("%sbaton launch: gateway %s at http://%s:%u%s\n", stamp().c_str(), n.name.c_str(), n.host.c_str(),
                static_cast<unsigned>(n.http_port), answers ? "" : " (it does not answer there yet)");
  }
  std::printf("%sbaton launch: cluster '%s' is up: %zu processes; SIGINT or SIGTERM stops it\n", stamp().c_str(), spec.name.c_str(),
              children.size());
  std::fflush(stdout);
  // A node that leaves (drained after SIGTERM, or failed) does not take the cluster down with
  // it: the balancers forget its ranks and the rest serves on. Only the head's end stops all.
  // A restarted head until it listens: looked for once per pass, so that the other children are
  // still watched (and restarted) meanwhile.
  struct awaited_head {
    std::chrono::steady_clock::time_point deadline;
    std::string last;  ///< why the last look did not find it
  };
  std::optional<awaited_head> head_back;
  for (uint64_t tick = 0; !stop_requested(); ++tick) {
    if (head_back) {
      auto d = connect_actor<node_directory_actor>(sys, sec, head.host, head.cluster_port);
      if (d && *d != directory) {
        directory = *d;
        head_back.reset();
        joined_pid.clear();  // every node joins the new head: say so as each does
        for (const auto& c : children) restarts.emplace(c.node.process, 0);
        std::printf("%sbaton launch: head %s up again: router %s:%u\n", stamp().c_str(), head.name.c_str(), head.host.c_str(),
                    static_cast<unsigned>(head.router_port));
        std::fflush(stdout);
      } else if (std::chrono::steady_clock::now() >= head_back->deadline) {
        std::fprintf(stderr, "%sbaton launch: the restarted head did not listen within %u s (%s); stopping the cluster\n", stamp().c_str(),
                     wait_s, head_back->last.c_str());
        return 1;
      } else {
        head_back->last =
            d ? std::string{"only the head that went away answers there"} : explain_connect_error(sys, d.error(), sec.tls());
      }
    }
    if (!head_back && !restarts.empty() && tick % 5 == 0)  // restarted nodes and spares: say when they are in
      self->request(directory, std::chrono::seconds{1}, stats_atom::value)
          .receive(
              [&](std::vector<node_status>& nodes) {
                for (const auto& n : nodes)
                  if (n.state == "joined" && restarts.count(n.name)) {
                    const auto seen = joined_pid.find(n.name);
                    if (seen != joined_pid.end() && seen->second == n.pid) continue;
                    const bool again = seen != joined_pid.end();
                    joined_pid[n.name] = n.pid;
                    std::printf("%sbaton launch: node %s joined%s (pid %d)\n", stamp().c_str(), n.name.c_str(), again ? " again" : "", n.pid);
                    std::fflush(stdout);
                  }
              },
              [](caf::error&) {});
    for (auto it = children.begin(); it != children.end();) {
      std::string how;
      bool cannot_restart = false;  // its restart was due and did not start: it failed for good
      const auto now = std::chrono::steady_clock::now();
      if (it->restart_at) {  // failed, waiting out its backoff (pid -1: nothing to reap)
        if (now < *it->restart_at) {
          ++it;
          continue;
        }
        it->restart_at.reset();
        const uint32_t tries = restarts[it->node.process];
        if (const auto pid = spawn(it->node); pid > 0) {
          it->pid = pid;
          it->started_at = now;
          if (it->node.role == "head") {
            std::printf("%sbaton launch: the head exited (%s); restarted it (%u of %u, pid %d, after %.1f s); the nodes wait "
                        "for it\n", stamp().c_str(),
                        it->ended.c_str(), tries, restart_failed, static_cast<int>(pid), it->backoff_ms / 1000.0);
            // Looked for at each pass from now on; one that dies before it listens is seen (not
            // reaped) and restarted by a later pass, while tries are left.
            head_back = awaited_head{now + std::chrono::seconds{wait_s}, {}};
          } else {
            std::printf("%sbaton launch: node %s restarted (%u of %u, pid %d, after %.1f s)\n", stamp().c_str(), it->node.process.c_str(), tries,
                        restart_failed, static_cast<int>(pid), it->backoff_ms / 1000.0);
          }
          std::fflush(stdout);
          ++it;
          continue;
        }
        std::fprintf(stderr, "%sbaton launch: %s %s: cannot restart it: %s\n", stamp().c_str(), it->node.role == "head" ? "head" : "node",
                     it->node.name.c_str(), why.c_str());
        how = it->ended;
        cannot_restart = true;
      } else if (!process_exited(it->pid, &how)) {
        ++it;
        continue;
      }
      const auto ran_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - it->started_at).count();
      if (auto r = restarts.find(it->node.process); !cannot_restart && r != restarts.end() && r->second > 0) {
        auto& used = r->second;
        // Served long enough since its last restart that this is a new failure, not the same
        // crash loop: its restarts are its own again.
        if (const auto kept = backoff.restarts_used(used, static_cast<uint64_t>(ran_ms)); kept != used) {
          std::printf("%sbaton launch: %s %s ran %.0f min since its last restart; its %u restarts are given back\n", stamp().c_str(),
                      it->node.role == "head" ? "head" : "node", it->node.process.c_str(), ran_ms / 60000.0, restart_failed);
          used = kept;
        }
      }
      // Failed with tries left: restarted once its backoff has passed.
      const auto schedule_restart = [&] {
        const uint32_t tries = ++restarts[it->node.process];
        it->backoff_ms = backoff.next_delay_ms(it->backoff_ms, static_cast<uint64_t>(ran_ms));
        it->restart_at = now + std::chrono::milliseconds{it->backoff_ms};
        it->ended = how;
        it->pid = -1;
        return tries;
      };
      if (it->standby_in >= 0) {  // a spare that was standing by: no node to replace, nothing to restart
        std::printf("%sbaton launch: spare %s stopped standing by (%s); it starts cold if it is needed\n", stamp().c_str(),
                    it->node.name.c_str(), how.c_str());
        std::fflush(stdout);
        close(it->standby_in);
        spares.push_back(it->node);  // as one that could not stand by (docs/cluster-spec.md)
        it = children.erase(it);
        continue;
      }
      if (it->node.role == "head") {
        // The head restarted in place: the other nodes keep their processes and models, wait
        // for it (`--head-wait-s`) and join it afresh; store nodes are adopted again as it starts.
        // Requests in flight when it died are lost (their clients got an error).
        if (!cannot_restart && restart_failed > 0 && restarts[it->node.process] < restart_failed) {
          const uint32_t tries = schedule_restart();
          std::printf("%sbaton launch: the head exited (%s); restarting it in %.1f s (%u of %u)\n", stamp().c_str(), how.c_str(),
                      it->backoff_ms / 1000.0, tries, restart_failed);
          std::fflush(stdout);
          ++it;
          continue;
        }
        std::fprintf(stderr, "%sbaton launch: the head exited (%s); stopping the cluster\n", stamp().c_str(), how.c_str());
        it->pid = -1;
        return 1;
      }
      // A store node restarted on its disk is adopted again by the head (store_keeper), which
      // keeps trying its address; meanwhile prefixes on it are computed again.
      const bool failed = how != "exit code 0";
      if (!cannot_restart && failed && restart_failed > 0 && restarts[it->node.process] < restart_failed) {
        const uint32_t tries = schedule_restart();
        std::printf("%sbaton launch: node %s left (%s); restarting it in %.1f s (%u of %u)%s\n", stamp().c_str(), it->node.process.c_str(),
                    how.c_str(), it->backoff_ms / 1000.0, tries, restart_failed,
                    it->node.role == "store" ? "; the head adopts it again once it listens" : "");
        std::fflush(stdout);
        ++it;
        continue;
      }
      if (!cannot_restart && it->node.role == "store" && failed)
        std::printf("%sbaton launch: node %s left (%s); the cluster serves on without its blocks (prefixes there are "
                    "computed again); started again by hand at the same address with the cluster's --cluster-id (`baton "
                    "launch SPEC --dry-run` prints its command), the head adopts it again\n", stamp().c_str(),
                    it->node.process.c_str(), how.c_str());
      else if (!cannot_restart)
        std::printf("%sbaton launch: node %s left (%s)\n", stamp().c_str(), it->node.process.c_str(), how.c_str());
      // Failed for good (restarts used up, or its host cannot start it): a spare of the same
      // role and ranks takes its place, and with it the node's data-parallel members; one
      // standing by first (told the node's flags on its stdin), else one started cold.
      bool replaced = false, by_standby = false;
      for (auto& sb : children) {
        if (!failed || replaced || sb.standby_in < 0 || sb.node.role != it->node.role || sb.node.ranks != it->node.ranks)
          continue;
        const auto in = stand_in(sb.node, it->node);
        std::string line;  // the flags stand_in adds (--dp-first-rank F), or none
        for (size_t a = sb.node.argv.size(); a < in.argv.size(); ++a) line += (line.empty() ? "" : " ") + in.argv[a];
        line += "\n";
        if (write(sb.standby_in, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
          continue;  // it died meanwhile: the next pass reports it
        close(sb.standby_in);
        sb.standby_in = -1;
        std::printf("%sbaton launch: node %s failed for good; spare %s, standing by, takes its place (pid %d)\n", stamp().c_str(),
                    it->node.name.c_str(), in.name.c_str(), static_cast<int>(sb.pid));
        sb.node = in;
        restarts.emplace(in.process, 0);  // a spare may be restarted as any node, and is watched for its join
        replaced = by_standby = true;
      }
      for (auto sp = spares.begin(); failed && !replaced && sp != spares.end();) {
        if (sp->role != it->node.role || sp->ranks != it->node.ranks) {
          ++sp;
          continue;
        }
        const auto in = stand_in(*sp, it->node);
        if (auto pid = spawn(in); pid > 0) {
          std::printf("%sbaton launch: node %s failed for good; spare %s started in its place (pid %d)\n", stamp().c_str(),
                      it->node.name.c_str(), in.name.c_str(), static_cast<int>(pid));
          *it = child{in, pid};
          restarts.emplace(in.process, 0);  // a spare may be restarted as any node, and is watched for its join
          replaced = true;
        } else {
          std::fprintf(stderr, "%sbaton launch: spare %s: cannot start it: %s\n", stamp().c_str(), sp->name.c_str(), why.c_str());
        }
        sp = spares.erase(sp);  // started, or unusable
      }
      if (replaced && !by_standby) {  // the cold spare took over this entry
        std::fflush(stdout);
        ++it;
        continue;
      }
      std::fflush(stdout);
      it = children.erase(it);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{200});
  }
  std::printf("%sbaton launch: stopping (decode nodes and gateways drain first)\n", stamp().c_str());
  std::fflush(stdout);
  stop_all(children, static_cast<int>(drain_ms), [&](const std::vector<std::string>& names, int budget_ms) {
    std::string list;
    for (const auto& n : names) list += " " + n;
    std::printf("%sbaton launch: waiting up to %d ms for the remote nodes%s to drain\n", stamp().c_str(), budget_ms, list.c_str());
    std::fflush(stdout);
    const auto still = wait_nodes_gone(sys, directory, names, std::chrono::milliseconds{budget_ms});
    for (const auto& n : still) std::printf("%sbaton launch: remote node %s still there after the drain time; stopping the head\n", stamp().c_str(), n.c_str());
  });
  return 0;
}

int run_deploy(const std::vector<std::string>& raw_args) {
  auto args = raw_args;
  constexpr const char* usage =
      "usage: baton deploy k8s|slurm SPEC.json [--out FILE]\n"
      "  k8s    Kubernetes manifests: a Deployment per node, a PVC per store directory\n"
      "  slurm  a Slurm batch script that starts every node on its host\n";
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {  // asked for: not an error
    std::fputs(usage, stdout);
    return 0;
  }
  if (args.empty() || (args[0] != "k8s" && args[0] != "slurm")) {
    std::fputs(usage, stderr);
    return 2;
  }
  const std::string kind = args[0];
  args.erase(args.begin());
  const std::string spec_path = take_spec_path(args);
  std::string out_path;
  flag_set flags;
  flags.add("--out", &out_path, "write here instead of standard output");
  if (auto rc = flags.parse_command_line(args, "deploy", "baton deploy k8s|slurm SPEC.json [--out FILE]")) return *rc;
  cluster_spec spec;
  std::string why;
  if (spec_path.empty() || !load_cluster_spec(spec_path, &spec, &why)) {
    std::fprintf(stderr, "baton deploy: %s\n", spec_path.empty() ? "give the cluster spec file" : why.c_str());
    return 2;
  }
  for (const auto& n : spec.nodes)
    if (n.spare) {
      std::fprintf(stderr, "baton deploy: node '%s' is a spare, which only `baton launch` starts (in place of a failed "
                           "node); the %s output has no such step: drop the spare from the spec\n",
                   n.name.c_str(), kind == "k8s" ? "Kubernetes" : "Slurm");
      return 2;
    }
  // Its gateways would start with no key at all (open to anyone): refused, not written.
  if (!spec.api_keys_file.empty() && spec.api_keys.empty() && spec.api_keys_env.empty()) {
    std::fprintf(stderr, "baton deploy: spec.api_keys_file is read by `baton launch` only; the %s output would start "
                         "its gateways without keys. Drop it and give the gateways BATON_API_KEYS_JSON (the file's "
                         "text) from a secret of your own, or use api_keys / api_keys_env\n",
                 kind == "k8s" ? "Kubernetes" : "Slurm");
    return 2;
  }
  if (const auto bad = kind == "k8s" ? kubernetes_name_problem(spec) : std::string{}; !bad.empty()) {
    std::fprintf(stderr, "baton deploy: %s\n", bad.c_str());
    return 2;
  }
  const std::string text = kind == "k8s" ? kubernetes_manifests(spec) : slurm_script(spec);
  if (out_path.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  std::ofstream out(out_path);
  out << text;
  if (!out) {
    std::fprintf(stderr, "baton deploy: cannot write %s\n", out_path.c_str());
    return 1;
  }
  return 0;
}

}  // namespace baton::deploy

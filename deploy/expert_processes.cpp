#include "deploy/expert_processes.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string_view>
#include <thread>
#include <cerrno>

#include "actors/local_cluster.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/processes.hpp"
#include "transport/all_to_all.hpp"
#include "transport/ucx.hpp"

namespace baton::deploy {

namespace {

std::string key_line(const transport::region_key& k) { return transport::key_to_text(k) + "\n"; }

/// A child's stdout, read line by line with a deadline (not stdio: a buffered FILE may hold the
/// next line already while its descriptor has nothing more to poll for).
struct line_reader {
  int fd = -1;
  std::string pending;
  enum outcome { line, ended, late };
  /// One line (without its newline) into *out, unless the child closed its end first or `by`
  /// passed; at most max_bytes are taken without a newline.
  outcome next(std::chrono::steady_clock::time_point by, std::string* out, size_t max_bytes = 16384) {
    for (;;) {
      if (const auto nl = pending.find('\n'); nl != std::string::npos) {
        *out = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        return line;
      }
      if (pending.size() > max_bytes) return ended;  // no line a shard prints is this long
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(by - std::chrono::steady_clock::now());
      if (left.count() <= 0) return late;
      pollfd p{fd, POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
      if (ready < 0 && errno != EINTR) return ended;
      if (ready <= 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) return ended;
      pending.append(buf, static_cast<size_t>(n));
    }
  }
};

std::vector<std::string> names_for(const std::string& engine, uint32_t size) {
  std::vector<std::string> names;
  for (uint32_t r = 0; r < size; ++r) names.push_back(engine + "-ep" + std::to_string(r));
  return names;
}

}  // namespace

uint64_t engine_slot_bytes(const gpu::model_config& cfg, const prefill_rank_config& prefill,
                           const decode_rank_config& decode) {
  // A decode step's rows: each sequence's input, and drafts in steps of at most
  // speculative_max_batch sequences, then local prompts' chunks.
  const uint64_t batch = decode.max_batch_size;
  const uint64_t drafted = decode.speculative_max_batch ? std::min<uint64_t>(batch, decode.speculative_max_batch) : batch;
  const uint64_t step_rows = std::max(batch, drafted * (1 + decode.speculative_tokens));
  const uint64_t rows = std::max<uint64_t>(prefill.chunk_tokens, step_rows + decode.local_prefill_chunk_tokens);
  return gpu::expert_slot_bytes(cfg, 2 * rows);
}

gpu::peer_transport_maker ucx_peer_transports(const std::string& ucx_send) {
  return [ucx_send](const std::string& name, std::string* why) {
    return transport::make_ucx_transport({.name = name, .send = ucx_send}, why);
  };
}

std::vector<std::shared_ptr<gpu::expert_peers>> make_dp_attention_groups(const std::vector<std::string>& ranks,
                                                                         uint32_t ep, const gpu::model_config& cfg,
                                                                         const gpu::peer_group_config& group,
                                                                         const gpu::live_eplb_config& eplb,
                                                                         const std::string& ucx_send, std::string* why) {
  if (ep < 2 || ranks.empty() || ranks.size() % ep != 0)
    return *why = "data-parallel attention groups of " + std::to_string(ep) + " need a multiple of " + std::to_string(ep) +
                  " decode ranks here, not " + std::to_string(ranks.size()),
           std::vector<std::shared_ptr<gpu::expert_peers>>{};
  std::vector<std::shared_ptr<gpu::expert_peers>> out;
  for (size_t g = 0; g < ranks.size(); g += ep) {
    std::vector<std::string> names;
    for (size_t i = g; i < g + ep; ++i) names.push_back(ranks[i] + "-dp");
    // Members of one process: UCX shared memory, stores straight into each other's slots.
    auto members = gpu::make_peer_group(names, cfg, group, ucx_peer_transports(ucx_send), why);
    if (members.empty()) return {};
    for (auto& m : members)
      if (eplb.slots_per_rank && !m->enable_eplb(eplb, cfg.moe.n_routed_experts, why)) return {};
    out.insert(out.end(), members.begin(), members.end());
  }
  return out;
}

std::shared_ptr<gpu::expert_group> spawn_expert_group(const expert_spawn& s, const gpu::model_config& cfg,
                                                      std::string* why) {
  if (s.size < 2) return *why = "expert parallelism needs at least 2 EP ranks", nullptr;
  if (cfg.moe.n_routed_experts < s.size)
    return *why = "model " + cfg.name + " has " + std::to_string(cfg.moe.n_routed_experts) + " routed experts, fewer than " +
                  std::to_string(s.size) + " EP ranks",
           nullptr;
  const auto names = names_for(s.name, s.size);
  auto t = transport::make_ucx_transport({names[0]}, why);
  if (!t) return nullptr;
  auto a2a = std::make_unique<transport::all_to_all>(*t, names, transport::all_to_all_config{0, s.size, s.slot_bytes});
  if (!a2a->error().empty()) return *why = a2a->error(), nullptr;
  std::unique_ptr<transport::all_to_all> b;
  if (s.dual_batch) {
    b = std::make_unique<transport::all_to_all>(*t, names, transport::all_to_all_config{0, s.size, s.slot_bytes});
    if (!b->error().empty()) return *why = b->error(), nullptr;
  }
  const int channels = s.dual_batch ? 2 : 1;
  struct child {
    pid_t pid;
    line_reader out;
    int in;
  };
  std::vector<child> kids;
  auto fail = [&](const std::string& w) -> std::shared_ptr<gpu::expert_group> {
    *why = w;
    std::vector<pid_t> pids;
    for (auto& k : kids) {
      close(k.in);
      close(k.out.fd);
      pids.push_back(k.pid);
    }
    stop_processes(pids, 2000);
    return nullptr;
  };
  for (uint32_t r = 1; r < s.size; ++r) {
    int to[2], from[2];
    // Close-on-exec: a shard of another group forked meanwhile (the keeper thread) must not hold
    // this shard's pipe ends, or a shard that dies before its key line never shows EOF here.
    if (pipe2(to, O_CLOEXEC) != 0)
      return fail("cannot make pipes for an expert shard (" + std::string(std::strerror(errno)) + ")");
    if (pipe2(from, O_CLOEXEC) != 0) {
      const int e = errno;
      close(to[0]);  // the first pair made it: not leaked with each failed try
      close(to[1]);
      return fail("cannot make pipes for an expert shard (" + std::string(std::strerror(e)) + ")");
    }
    const std::vector<std::string> argv = {s.executable.empty() ? self_executable() : s.executable, "experts", "--model", s.model_arg, "--weights-seed",
                                           std::to_string(s.weights_seed), "--ep-rank", std::to_string(r), "--ep-size",
                                           std::to_string(s.size), "--slot-bytes", std::to_string(s.slot_bytes),
                                           "--name", s.name, "--dual-batch", s.dual_batch ? "1" : "0"};
    const pid_t engine = getpid();
    const pid_t pid = fork();
    if (pid < 0) {  // never stored: stop_processes would signal pid -1, every process of ours
      const int e = errno;  // before the closes, which may set it
      for (int fd : {to[0], to[1], from[0], from[1]}) close(fd);
      return fail("cannot fork an expert shard (" + std::string(std::strerror(e)) + ")");
    }
    if (pid == 0) {
      // A process group of its own, first: a terminal's Ctrl-C (SIGINT to the foreground group)
      // must reach the engine alone, which drains while its shards serve on; in the engine's
      // group they died at once and failed the drain's last steps. The shard still ends with its
      // engine: SIGTERM when the thread that forked it ends (the engine's exit included), which
      // this process does not catch; before its keys, also the engine's end of its stdin closing.
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != engine) _exit(127);  // the engine died before the line above
      dup2(to[0], 0);
      dup2(from[1], 1);
      close(to[1]);
      close(from[0]);
      std::vector<char*> cargs;
      for (const auto& a : argv) cargs.push_back(const_cast<char*>(a.c_str()));
      cargs.push_back(nullptr);
      // This very binary even once an upgrade replaced the file (the path would then name
      // "... (deleted)").
      execv(s.executable.empty() ? "/proc/self/exe" : s.executable.c_str(), cargs.data());
      _exit(127);
    }
    close(to[0]);
    close(from[1]);
    kids.push_back({pid, line_reader{from[0], {}}, to[1]});
  }
  // Every process's key per channel: all of channel A's (rank order), then all of channel B's.
  std::vector<std::vector<transport::region_key>> parsed(channels);
  parsed[0].push_back(a2a->key());
  if (b) parsed[1].push_back(b->key());
  const auto keys_by = std::chrono::steady_clock::now() + std::chrono::milliseconds{s.key_timeout_ms};
  for (auto& k : kids)
    for (int c = 0; c < channels; ++c) {
      const auto& name = names[&k - kids.data() + 1];
      std::string line;
      const auto got = k.out.next(keys_by, &line);
      if (got == line_reader::late)
        return fail("expert shard " + name + " printed no key within " + std::to_string(s.key_timeout_ms) +
                    " ms of its start (hung loading its experts, or in its transport?)");
      std::optional<transport::region_key> key;
      if (got == line_reader::line) key = transport::key_from_text(line + "\n");
      if (!key) return fail("expert shard " + name + " did not start (see its stderr)");
      parsed[c].push_back(*key);
    }
  std::string keys;
  for (const auto& channel : parsed)
    for (const auto& key : channel) keys += key_line(key);
  for (auto& k : kids)
    if (write(k.in, keys.data(), keys.size()) != static_cast<ssize_t>(keys.size()))
      return fail("cannot hand the keys to an expert shard");
  a2a->connect(parsed[0]);
  if (b) b->connect(parsed[1]);
  // Each shard says "ready" once it is connected and holds its experts. Until then the group is
  // not used: a first exchange would count its 10 s from here, and a dozen shards starting on
  // two cores can take longer than that to connect (seen in CI: a shard silent at exchange 1).
  const auto ready_by = std::chrono::steady_clock::now() + std::chrono::seconds{120};
  for (auto& k : kids) {
    const auto& name = names[&k - kids.data() + 1];
    std::string line;
    const auto got = k.out.next(ready_by, &line, 64);
    if (got == line_reader::late) return fail("expert shard " + name + " was not ready within 120 s of getting the keys");
    if (got != line_reader::line || line != "ready")
      return fail("expert shard " + name + " ended before it was ready (see its stderr)");
  }
  std::vector<pid_t> pids;
  for (auto& k : kids) {
    pids.push_back(k.pid);
    close(k.in);
    close(k.out.fd);
  }
  // The deleter: the group's destructor tells the shards to stop; then they are reaped.
  auto group = std::shared_ptr<gpu::expert_group>(
      new gpu::expert_group(std::move(t), std::move(a2a), s.size, std::move(b)), [pids](gpu::expert_group* g) mutable {
        delete g;                    // tells the shards to stop
        stop_processes(pids, 2000);  // and reaps them
      });
  // A shard that dies (a crash, a kill) fails the exchange waiting for it at once, naming its
  // fate; each shard looked at every 50 ms of a wait (or of an idle engine's checks), without
  // reaping (the deleter reaps).
  auto next_look = std::make_shared<std::vector<std::chrono::steady_clock::time_point>>(pids.size());
  group->watch_shards([pids, names, next_look](uint32_t rank) -> std::string {
    const auto now = std::chrono::steady_clock::now();
    if (rank == 0 || rank > pids.size() || now < (*next_look)[rank - 1]) return {};
    (*next_look)[rank - 1] = now + std::chrono::milliseconds{50};
    std::string how;
    if (!process_gone(pids[rank - 1], &how)) return {};
    return "its process (" + names[rank] + ", pid " + std::to_string(pids[rank - 1]) + ") ended with " + how;
  });
  return group;
}

struct expert_group_keeper::engine {
  std::string label;      ///< "rank prefill-0", "data-parallel group dp0"
  std::string broken;     ///< how the executors' standing failures from this group begin
  std::string doing, done;
  std::vector<std::weak_ptr<gpu::executor>> execs;  ///< in member order; empty slots until added
  /// Mends the group of these live executors; empty, or why not.
  std::function<std::string(const std::vector<std::shared_ptr<gpu::executor>>&)> repair;
  std::chrono::steady_clock::time_point next_try{};
  std::chrono::milliseconds backoff{0};  ///< before the next try after a failed one (cfg_.first_backoff at first)
  uint32_t failures = 0;                 ///< failed repairs in a row
  /// When the last repair worked; unset once the group was seen broken again after it.
  std::optional<std::chrono::steady_clock::time_point> mended_at;
  bool given_up = false;
};

expert_group_keeper::expert_group_keeper(std::string who, expert_keeper_config cfg)
  : who_(std::move(who)), cfg_(std::move(cfg)), thread_([this] { loop(); }) {}

expert_group_keeper::~expert_group_keeper() {
  {
    std::lock_guard<std::mutex> lock{m_};
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void expert_group_keeper::add(const std::shared_ptr<gpu::executor>& exec, expert_spawn s, const gpu::model_config& cfg,
                              gpu::live_eplb_config eplb) {
  auto e = std::make_shared<engine>();
  e->label = "rank " + s.name;
  e->broken = "expert parallelism: ";
  e->doing = "starting new expert shards";
  e->done = "has new expert shards and takes work again";
  e->execs = {exec};
  e->repair = [s = std::move(s), cfg, eplb](const std::vector<std::shared_ptr<gpu::executor>>& execs) {
    std::string why;
    auto group = spawn_expert_group(s, cfg, &why);
    const bool ok = group && (!eplb.slots_per_rank || group->enable_eplb(eplb, cfg.moe.n_routed_experts, &why)) &&
                    execs[0]->replace_experts(std::move(group), &why);
    return ok ? std::string{} : why.empty() ? std::string{"no reason given"} : why;
  };
  std::lock_guard<std::mutex> lock{m_};
  engines_.push_back(std::move(e));
}

void expert_group_keeper::add_dp_member(const std::string& group, uint32_t member, uint32_t size,
                                        const std::shared_ptr<gpu::executor>& exec, remake_fn remake) {
  std::lock_guard<std::mutex> lock{m_};
  std::shared_ptr<engine> e;
  for (auto& x : engines_)
    if (x->label == "data-parallel group " + group) e = x;
  if (!e) {
    e = std::make_shared<engine>();
    e->label = "data-parallel group " + group;
    e->broken = "data-parallel group";
    e->doing = "re-forming it in place";
    e->done = "re-formed in place; its ranks take work again";
    e->execs.resize(size);
    e->repair = [remake = std::move(remake)](const std::vector<std::shared_ptr<gpu::executor>>& execs) {
      std::string why;
      auto members = remake(&why);
      if (members.size() != execs.size())
        return members.empty() ? why : "the group was made with " + std::to_string(members.size()) + " members, not " +
                                           std::to_string(execs.size());
      // A member refused (stopped meanwhile, say) leaves the others switched to a group that
      // cannot run a step: it breaks again, and the next look re-forms it again.
      for (size_t i = 0; i < execs.size(); ++i)
        if (!execs[i]->rejoin_group(members[i], &why)) return "member " + std::to_string(i) + ": " + why;
      return std::string{};
    };
    engines_.push_back(e);
  }
  if (member < e->execs.size()) e->execs[member] = exec;
}

uint64_t expert_group_keeper::repairs() const {
  std::lock_guard<std::mutex> lock{m_};
  return repairs_;
}

void expert_group_keeper::look_at(engine& e) {
  std::vector<std::shared_ptr<gpu::executor>> execs;
  std::string failure;
  if (e.given_up) return;
  for (const auto& w : e.execs) {
    auto x = w.lock();
    if (!x || x->rejoin_pending()) return;  // not all added yet, gone, or switching already
    auto f = x->standing_failure();
    if (f.rfind(e.broken, 0) != 0) return;  // healthy, or not (yet) broken through its group
    if (failure.empty()) failure = std::move(f);
    execs.push_back(std::move(x));
  }
  if (execs.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  if (e.mended_at) {
    // Broken again since the last repair: a group that stayed whole for `settle` starts its
    // count afresh; one that broke at once counts that repair as failed (and is paused).
    const auto lasted = std::chrono::duration_cast<std::chrono::milliseconds>(now - *e.mended_at);
    e.mended_at.reset();
    if (lasted >= cfg_.settle) {
      e.failures = 0;
      e.backoff = cfg_.first_backoff;
    } else if (note_failure(e, "it broke again " + std::to_string(lasted.count()) + " ms after it was mended (" +
                                   failure + ")")) {
      return;
    }
  }
  if (now < e.next_try) return;
  std::printf("%s: %s stepped aside (%s): %s\n", who_.c_str(), e.label.c_str(), failure.c_str(), e.doing.c_str());
  std::fflush(stdout);
  if (e.backoff.count() == 0) e.backoff = cfg_.first_backoff;
  if (const auto why = e.repair(execs); why.empty()) {
    e.mended_at = std::chrono::steady_clock::now();
    std::printf("%s: %s %s\n", who_.c_str(), e.label.c_str(), e.done.c_str());
    std::lock_guard<std::mutex> lock{m_};
    ++repairs_;
  } else {
    note_failure(e, why);
  }
  std::fflush(stdout);
}

bool expert_group_keeper::note_failure(engine& e, const std::string& why) {
  if (e.backoff.count() == 0) e.backoff = cfg_.first_backoff;
  if (++e.failures >= cfg_.give_up_after && cfg_.give_up_after > 0) {
    e.given_up = true;
    std::printf("%s: %s: %s did not work %u times in a row (last: %s); giving up on it\n", who_.c_str(),
                e.label.c_str(), e.doing.c_str(), e.failures, why.c_str());
    std::fflush(stdout);
    if (cfg_.give_up) cfg_.give_up(e.label, why);
    return true;
  }
  e.next_try = std::chrono::steady_clock::now() + e.backoff;
  std::printf("%s: %s: %s did not work (%s); trying again in %lld ms\n", who_.c_str(), e.label.c_str(),
              e.doing.c_str(), why.c_str(), static_cast<long long>(e.backoff.count()));
  std::fflush(stdout);
  e.backoff = std::min(e.backoff * 2, std::chrono::milliseconds{30000});
  return false;
}

void expert_group_keeper::loop() {
  // Shards are started from this thread, which lives as long as the keeper: a shard's
  // PR_SET_PDEATHSIG follows the thread that forked it, not the process.
  std::unique_lock<std::mutex> lock{m_};
  while (!wake_.wait_for(lock, std::chrono::milliseconds{100}, [this] { return stop_; })) {
    const auto engines = engines_;
    lock.unlock();
    for (const auto& e : engines) look_at(*e);
    lock.lock();
  }
}

int run_experts(const std::vector<std::string>& args) {
  std::string model = "random", name = "engine";
  uint64_t seed = 0, slot = 0;
  uint32_t rank = 0, size = 0;
  flag_set flags;
  flags.add("--model", &model, "the engine's model: a directory or a seeded shape");
  flags.add("--weights-seed", &seed, "seed of seeded weights (must match the engine)");
  flags.add("--ep-rank", &rank, "this shard's EP rank (>= 1)");
  flags.add("--ep-size", &size, "EP ranks in the group");
  flags.add("--slot-bytes", &slot, "all-to-all slot size");
  flags.add("--name", &name, "the engine's name");
  uint32_t dual = 0;
  flags.add("--dual-batch", &dual, "1: dual-batch overlap (a second all-to-all channel)");
  if (auto rc = flags.parse_command_line(args, "experts", "baton experts (started by an engine, not by hand)")) return *rc;
  if (rank == 0 || rank >= size || slot == 0) {
    std::fprintf(stderr, "baton experts: need 1 <= --ep-rank < --ep-size and --slot-bytes > 0\n");
    return 2;
  }
  // Fault injection for tests: while the file this names exists, shards refuse to start (a GPU
  // gone, weights unreadable), so that an engine's keeper giving up can be shown end to end.
  if (const char* f = std::getenv("BATON_FAULT_EXPERTS_REFUSE_IF"); f && *f && access(f, F_OK) == 0) {
    std::fprintf(stderr, "baton experts %s-ep%u: refusing to start: fault injected for a test (%s exists; "
                 "BATON_FAULT_EXPERTS_REFUSE_IF)\n", name.c_str(), rank, f);
    return 1;
  }
  local_cluster_config loaded;
  loaded.weights_seed = seed;
  std::string why;
  // From a directory only this shard's block of routed experts is read (run_expert_shard would
  // drop the others at once; the lead sends any EPLB places here).
  const auto mine_only = keep_blocks_of({rank}, size);
  if (model != "random" && !load_model_into(model, &loaded, &why, mine_only)) {
    std::fprintf(stderr, "baton experts: %s\n", why.c_str());
    return 2;
  }
  auto weights = loaded.weights ? std::move(loaded.weights)
                                : std::make_shared<const gpu::model_weights>(
                                      gpu::make_seeded_weights(loaded.model, seed, mine_only));  // its block only
  const auto names = names_for(name, size);
  auto t = transport::make_ucx_transport({names[rank]}, &why);
  if (!t) {
    std::fprintf(stderr, "baton experts: %s\n", why.c_str());
    return 1;
  }
  // A shard waits for its engine as long as the engine lives (an idle engine sends nothing).
  const transport::all_to_all_config ac{rank, size, slot, std::chrono::hours{24 * 365}};
  transport::all_to_all a2a{*t, names, ac};
  std::unique_ptr<transport::all_to_all> b;
  if (dual) b = std::make_unique<transport::all_to_all>(*t, names, ac);
  for (const auto* x : {&a2a, b.get()})
    if (x && !x->error().empty()) {
      std::fprintf(stderr, "baton experts: %s\n", x->error().c_str());
      return 1;
    }
  // Fault injection for tests: a shard that hangs before it prints its keys (weights on a
  // stalled file system, a transport that never comes up), for the engine's key deadline.
  if (const char* ms = std::getenv("BATON_FAULT_EXPERTS_STALL_MS"); ms && *ms)
    std::this_thread::sleep_for(std::chrono::milliseconds{std::strtoul(ms, nullptr, 10)});
  std::fputs(key_line(a2a.key()).c_str(), stdout);
  if (b) std::fputs(key_line(b->key()).c_str(), stdout);
  std::fflush(stdout);
  // The engine closes its end of this pipe once this shard is ready. Whatever this process writes
  // to stdout later (UCX prints its warnings there) would then kill it with SIGPIPE, silently:
  // from here on stdout is stderr, which the engine's operator sees, and the pipe is kept apart
  // for the one word "ready".
  const int to_engine = dup(STDOUT_FILENO);
  dup2(STDERR_FILENO, STDOUT_FILENO);
  std::vector<transport::region_key> keys[2];
  for (int c = 0; c < (b ? 2 : 1); ++c)
    for (uint32_t r = 0; r < size; ++r) {
      std::string line;
      auto key = std::getline(std::cin, line) ? transport::key_from_text(line) : std::nullopt;
      if (!key) {
        std::fprintf(stderr, "baton experts %s: the engine sent no keys, or malformed ones\n", names[rank].c_str());
        return 1;
      }
      keys[c].push_back(*key);
    }
  a2a.connect(keys[0]);
  if (b) b->connect(keys[1]);
  // The shard's own copy, which keeps only the experts placed on it (run_expert_shard drops the
  // rest at once and follows the lead's EPLB plans).
  gpu::model_weights mine = *weights;  // small now: the other blocks were never loaded
  weights.reset();
  loaded.weights.reset();
  ::signal(SIGPIPE, SIG_IGN);  // an engine gone meanwhile: a failed write, not a silent death
  const bool told = to_engine >= 0 && ::write(to_engine, "ready\n", 6) == 6;
  if (to_engine >= 0) ::close(to_engine);
  if (!told) {
    std::fprintf(stderr, "baton experts %s: cannot tell the engine it is ready (it is gone?)\n", names[rank].c_str());
    return 1;
  }
  if (!gpu::run_expert_shard(loaded.model, mine, a2a, &why, b.get())) {
    std::fprintf(stderr, "baton experts %s: %s\n", names[rank].c_str(), why.c_str());
    return 1;
  }
  return 0;
}

}  // namespace baton::deploy

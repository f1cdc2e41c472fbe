// The gateway's listening broker: it forks a broker per connection (gateway.cpp), keeps their
// timers, and takes the drain and router changes; and the gateway's public functions.

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <optional>
#include <thread>
#include <unordered_map>

#include <caf/actor_system.hpp>
#include <caf/actor_ostream.hpp>
#include <caf/io/broker.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "deploy/flags.hpp"
#include "deploy/gateway_shared.hpp"
#include "deploy/processes.hpp"

namespace baton::deploy {

std::string gateway_config::validate() const {
  if (host.empty()) return "gateway: host must not be empty";
  if (first_token_timeout_ms == 0) return "gateway: first_token_timeout_ms must be >= 1";
  if (max_connections == 0) return "gateway: max_connections must be >= 1";
  for (const auto& k : api_keys)
    if (k.empty()) return "gateway: an API key must not be empty";
  std::vector<api_key> all;
  if (std::string why; !merge_api_keys(named_keys, api_keys, &all, &why)) return "gateway: " + why;
  if (limits.max_body_bytes == 0 || limits.max_header_bytes < 64) return "gateway: HTTP limits are too small";
  for (const auto& o : cors_origins)
    if (auto e = http::origin_problem(o); !e.empty()) return "gateway: --cors-origin " + e;
  if (idle_timeout_ms == 0) return "gateway: idle_timeout_ms must be >= 1";
  if (router_silence_ms > 0 && router_silence_ms < 100)
    return "gateway: --router-silence-ms must be 0 (not watched) or at least 100, got " + std::to_string(router_silence_ms);
  if (max_stream_backlog_bytes < 4096) return "gateway: max_stream_backlog_bytes must be >= 4096";
  if (max_total_backlog_bytes < (uint64_t{1} << 20)) return "gateway: max_total_backlog_bytes must be >= 1 MiB";
  // Printable ASCII: the name goes into every answer's JSON, which must not meet invalid UTF-8.
  for (unsigned char c : served_model_name)
    if (c < 0x20 || c > 0x7e)
      return "gateway: --served-model-name must be printable ASCII, got '" + served_model_name + "'";
  return {};
}

std::pair<int, std::string> cluster_health(const cluster_stats* s) {
  if (!s) return {503, "the router did not answer"};
  // A separate gateway whose head drains: every call would be refused (shutting_down).
  if (s->draining) return {503, "the cluster's head is shutting down; it takes no new requests"};
  // A gateway that can place nothing is not healthy: a load balancer should send elsewhere.
  // Ranks that take no new work (draining, stepped aside, a failed setup) do not count.
  const auto open = [](const std::vector<rank_load>& ranks) {
    return static_cast<size_t>(std::count_if(ranks.begin(), ranks.end(), [](const rank_load& r) { return r.unavailable.empty(); }));
  };
  const size_t prefill = open(s->prefill), decode = open(s->decode);
  const size_t aside = s->prefill.size() - prefill + s->decode.size() - decode;
  if (prefill == 0 || decode == 0)
    return {503, "the cluster has " + std::to_string(prefill) + " prefill and " + std::to_string(decode) +
                     " decode ranks taking work" +
                     (aside ? " (" + std::to_string(aside) + " more draining, stepped aside or failed)" : "") + "; it needs one of each"};
  // The store is a cache: servers down cost hits, not answers (still 200), but are shown.
  std::string store;
  if (s->store_servers)
    store = ",\"store_servers\":" + std::to_string(s->store_servers) +
            ",\"store_servers_up\":" + std::to_string(s->store_servers_up);
  return {200, "{\"status\":\"ok\",\"prefill_ranks\":" + std::to_string(prefill) + ",\"decode_ranks\":" +
                   std::to_string(decode) + (aside ? ",\"ranks_not_taking_work\":" + std::to_string(aside) : std::string{}) +
                   store + "}"};
}

namespace {

using shared_ptr = std::shared_ptr<gateway_shared>;

/// 16 random hex digits, drawn once per gateway: its call ids differ from another gateway's.
std::string random_id_prefix() {
  std::random_device rd;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>((uint64_t{rd()} << 32) | rd()));
  return hex;
}

/// What a gateway takes from the router's numbers: the model's name and how calls are served.
void take_settings(gateway_shared& g, const cluster_stats& s) {
  // --served-model-name a,b: answered as a; calls may name b too (vLLM's list of names).
  const auto names = split_list(g.cfg.served_model_name);
  g.model = names.empty() ? s.model : names.front();
  g.calls.model_aliases.assign(names.size() > 1 ? names.begin() + 1 : names.end(), names.end());
  g.context_tokens = s.context_tokens;
  g.calls.chat_reasoning = s.chat_reasoning;
  g.calls.chat_tool_calls = s.chat_tool_calls;
  g.calls.default_temperature = s.default_temperature;
  g.calls.default_top_p = s.default_top_p;
  g.calls.default_top_k = s.default_top_k;
  g.calls.default_repetition_penalty = s.default_repetition_penalty;
  g.calls.max_active_requests = s.max_active_requests;
}

/// The keys file read again: the new keys in force, each name's counters kept; or, when it does
/// not read, why, and the keys as they were.
void reload_keys(caf::io::broker* self, gateway_shared& g) {
  std::string why;
  std::vector<api_key> named, all;
  if (!read_api_keys_file(g.cfg.keys_file, &named, &why) || !merge_api_keys(named, g.cfg.api_keys, &all, &why)) {
    caf::aout(self) << "gateway: the API keys file does not read (" << why << "); the keys stay as they were" << std::endl;
    return;
  }
  g.keys = renew_api_keys(g.keys, all);
  g.metrics.set_keys(g.keys);
  caf::aout(self) << "gateway: API keys read again from " << g.cfg.keys_file << ": " << describe_api_keys(all) << std::endl;
}

caf::behavior server(caf::io::broker* self, int fd, shared_ptr g) {
  self->add_doorman(fd);
  g->server = self->address();
  // The keys file, looked at now and then (a stat: cheap); every broker runs on this one thread,
  // so the keys change between two requests, never during one's check.
  auto stamp = std::make_shared<std::string>(g->cfg.keys_file_stamp);
  const auto poll = std::chrono::milliseconds{g->cfg.keys_poll_ms};
  if (!g->cfg.keys_file.empty()) self->delayed_send(self, poll, keys_poll_atom::value);
  // The connections whose timers run here, by number; each is forgotten as it ends.
  auto timed = std::make_shared<std::unordered_map<uint64_t, caf::actor_addr>>();
  const auto silence = std::chrono::milliseconds{g->cfg.router_silence_ms};
  if (silence.count() > 0) self->delayed_send(self, silence / 4, router_probe_atom::value);
  return {
      [=](wake_atom, uint32_t delay_ms, uint64_t number, caf::actor_addr& who, caf::atom_value what) {
        (*timed)[number] = std::move(who);
        self->delayed_send(self, std::chrono::milliseconds{delay_ms}, wake_due_atom::value, number, what);
      },
      [=](wake_due_atom, uint64_t number, caf::atom_value what) {
        if (auto i = timed->find(number); i != timed->end())
          if (auto connection = caf::actor_cast<caf::actor>(i->second)) caf::anon_send(connection, what);
      },
      [=](wake_forget_atom, uint64_t number) { timed->erase(number); },
      [=](const caf::io::new_connection_msg& msg) {
        self->fork(gateway_connection, msg.handle, g, caf::actor_cast<caf::actor>(self));
      },
      // drain_gateway: from now on, and each time it asks, the calls still running.
      [=](drain_atom) {
        g->draining = true;
        return g->calls_in_flight.load();
      },
      [=](router_lost_atom, std::string& why) {
        g->router_away = std::move(why);
        g->router_silent = false;
      },
      // One probe at a time, the next a quarter of the silence after its answer (or its failure:
      // a router gone fails at once): a router that answers within the silence is up; one that
      // does not has new calls refused until it does.
      [=](router_probe_atom) {
        if (!g->router) return self->delayed_send(self, silence / 4, router_probe_atom::value);
        const auto asked = g->router;
        self->request(asked, silence, ping_atom::value)
            .then(
                [=](bool) {
                  if (g->router_silent && g->router == asked) {
                    g->router_away.clear();
                    g->router_silent = false;
                    caf::aout(self) << "gateway: the router answers again; calls are served" << std::endl;
                  }
                  self->delayed_send(self, silence / 4, router_probe_atom::value);
                },
                [=](caf::error&) {
                  if (g->router == asked && (g->router_away.empty() || g->router_silent)) {
                    if (!g->router_silent)
                      caf::aout(self) << "gateway: the router has not answered for " << silence.count()
                                      << " ms; new calls get 503 until it does" << std::endl;
                    g->router_away = "the cluster's head has not answered for " + std::to_string(silence.count()) +
                                     " ms (stalled, or cut off); retry shortly";
                    g->router_silent = true;
                  }
                  self->delayed_send(self, silence / 4, router_probe_atom::value);
                });
      },
      [=](keys_poll_atom) {
        if (auto now = file_stamp(g->cfg.keys_file); now != *stamp) {
          *stamp = std::move(now);
          reload_keys(self, *g);
        }
        self->delayed_send(self, poll, keys_poll_atom::value);
      },
      [=](router_set_atom, router_actor& router, cluster_stats& s) {
        g->router = std::move(router);
        take_settings(*g, s);
        g->router_away.clear();
        g->router_silent = false;
      },
  };
}

/// Asks `router` for its numbers, blocking for at most 10 s.
std::optional<cluster_stats> ask_stats(caf::actor_system& sys, const router_actor& router, std::string* why) {
  caf::scoped_actor self{sys};
  std::optional<cluster_stats> got;
  self->request(router, std::chrono::seconds{10}, stats_atom::value)
      .receive([&](cluster_stats& s) { got = std::move(s); },
               [&](caf::error& e) { *why = "gateway: the router did not answer: " + sys.render(e); });
  return got;
}

}  // namespace

bool spawn_gateway(caf::actor_system& sys, const gateway_config& cfg, router_actor router, gateway_handle* out,
                   std::string* why) {
  if (auto e = cfg.validate(); !e.empty()) {
    *why = e;
    return false;
  }
  auto g = std::make_shared<gateway_shared>();
  g->cfg = cfg;
  std::vector<api_key> keys;
  merge_api_keys(cfg.named_keys, cfg.api_keys, &keys, why);  // (validate() saw it work)
  if (!keys.empty()) out->keys = describe_api_keys(keys);
  for (auto& k : keys) g->keys.push_back(std::make_shared<api_key_state>(std::move(k)));
  g->metrics.set_keys(g->keys);
  g->calls.unanswered_grace = std::chrono::milliseconds{cfg.unanswered_grace_ms};
  g->router = router;
  g->started_s = unix_seconds();
  g->id_prefix = random_id_prefix();
  const auto stats = ask_stats(sys, router, why);
  if (!stats) return false;
  take_settings(*g, *stats);
  // Each connection is a descriptor: the soft limit (often 1024, as is max_connections by
  // default) is raised to the hard one, or accept() fails with EMFILE before the gateway's own
  // 503 -- and CAF's acceptor then retries the still-readable socket in a busy loop.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
  }
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY &&
      files.rlim_cur < uint64_t{cfg.max_connections} + 64) {
    *why = "gateway: max_connections " + std::to_string(cfg.max_connections) + " needs about " +
           std::to_string(cfg.max_connections + 64) + " file descriptors; this process may open " +
           std::to_string(files.rlim_cur) + " (ulimit -n)";
    return false;
  }
  uint16_t port = 0;
  const int fd = open_tcp_listener(cfg.host, cfg.port, &port, why, "gateway");
  if (fd < 0) return false;
  out->server = sys.middleman().spawn_broker(server, fd, g);
  out->port = port;
  return true;
}

uint32_t drain_gateway(caf::actor_system& sys, const gateway_handle& gw, std::chrono::milliseconds grace,
                       const std::function<bool()>& give_up) {
  caf::scoped_actor self{sys};
  const auto deadline = std::chrono::steady_clock::now() + grace;
  uint32_t running = 0;
  for (;;) {
    self->request(gw.server, std::chrono::seconds{5}, drain_atom::value)
        .receive([&](uint32_t n) { running = n; }, [&](caf::error&) { running = 0; });  // gone: nothing runs
    if (running == 0 || std::chrono::steady_clock::now() >= deadline || (give_up && give_up())) return running;
    std::this_thread::sleep_for(std::chrono::milliseconds{50});
  }
}

void gateway_router_lost(const gateway_handle& gw, std::string why) {
  caf::anon_send(gw.server, router_lost_atom::value, std::move(why));
}

bool gateway_set_router(caf::actor_system& sys, const gateway_handle& gw, router_actor router, std::string* why) {
  const auto stats = ask_stats(sys, router, why);
  if (!stats) return false;
  caf::anon_send(gw.server, router_set_atom::value, std::move(router), *stats);
  return true;
}

}  // namespace baton::deploy

#include "deploy/cluster_spec.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

#include "gpu/text_file.hpp"
#include "deploy/http.hpp"
#include "policies/placement.hpp"
#include "store/block_file.hpp"

namespace baton::deploy {

using nlohmann::json;

bool node_spec::has(const std::string& role) const {
  return std::find(roles.begin(), roles.end(), role) != roles.end();
}

const node_spec& cluster_spec::head() const {
  for (const auto& n : nodes)
    if (n.has("router")) return n;
  return nodes.front();  // unreachable for a validated spec
}

namespace {

/// Reads an object's fields strictly: a key the reader never asked for is an error (a typo in a
/// spec should not be silently ignored).
class fields {
 public:
  fields(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  bool str(const char* key, std::string* dst, std::string* why) {
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end()) return true;
    if (!it->is_string()) return fail(key, "must be a string", why);
    *dst = it->get<std::string>();
    return true;
  }
  bool strs(const char* key, std::vector<std::string>* dst, std::string* why) {
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end()) return true;
    if (!it->is_array()) return fail(key, "must be an array of strings", why);
    dst->clear();
    for (const auto& s : *it) {
      if (!s.is_string()) return fail(key, "must be an array of strings", why);
      dst->push_back(s.get<std::string>());
    }
    return true;
  }
  template <class T>
  bool num(const char* key, T* dst, uint64_t lo, uint64_t hi, std::string* why) {
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end()) return true;
    if (!it->is_number_unsigned() || it->get<uint64_t>() < lo || it->get<uint64_t>() > hi)
      return fail(key, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", why);
    *dst = static_cast<T>(it->get<uint64_t>());
    return true;
  }
  /// A number, integer or not (absent: unchanged); the caller checks its range.
  bool real(const char* key, double* dst, std::string* why) {
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end()) return true;
    if (!it->is_number()) return fail(key, "must be a number", why);
    *dst = it->get<double>();
    return true;
  }
  /// An object of string values: environment variables.
  bool env(const char* key, std::map<std::string, std::string>* dst, std::string* why) {
    json o;
    if (!object(key, &o, why)) return false;
    for (auto it = o.begin(); it != o.end(); ++it) {
      const auto& k = it.key();
      const bool name_ok = !k.empty() && !std::isdigit(static_cast<unsigned char>(k[0])) &&
                           std::all_of(k.begin(), k.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
      if (!name_ok || !it->is_string()) return fail(key, "must map variable names (A-Z, 0-9, _) to strings", why);
      (*dst)[k] = it->get<std::string>();
    }
    return true;
  }
  /// true or false (absent: unchanged).
  bool boolean(const char* key, bool* dst, std::string* why) {
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end()) return true;
    if (!it->is_boolean()) return fail(key, "must be true or false", why);
    *dst = it->get<bool>();
    return true;
  }
  /// A nested object (absent: an empty one).
  bool object(const char* key, json* dst, std::string* why) {
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end()) {
      *dst = json::object();
      return true;
    }
    if (!it->is_object()) return fail(key, "must be an object", why);
    *dst = *it;
    return true;
  }
  void mark(const char* key) { seen_.insert(key); }  ///< read by the caller itself
  bool no_others(std::string* why) {
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (!seen_.count(it.key())) {
        *why = where_ + ": unknown field '" + it.key() + "'";
        return false;
      }
    return true;
  }
  bool fail(const std::string& key, const std::string& what, std::string* why) {
    *why = where_ + "." + key + " " + what;
    return false;
  }

 private:
  const json& j_;
  std::string where_;
  std::set<std::string> seen_;
};

/// Names become process names, Kubernetes object names and shell words: keep them plain.
bool plain_name(const std::string& s) {
  if (s.empty() || s.size() > 40 || s.front() == '-' || s.back() == '-') return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-'; });
}

/// A host or user that reaches ssh's command line as one word: no leading '-' (ssh would take it
/// for an option, ssh -oProxyCommand=...), no blank or shell character, none of `also_refused`.
bool ssh_word(const std::string& s, std::string_view also_refused = {}) {
  if (s.empty() || s.front() == '-' || s.find_first_of(" \t'\"$`\\;&|<>") != std::string::npos) return false;
  return s.find_first_of(also_refused) == std::string::npos;
}

bool parse_node(const json& j, size_t i, node_spec* n, std::string* why) {
  const std::string where = "nodes[" + std::to_string(i) + "]";
  if (!j.is_object()) {
    *why = where + " must be an object";
    return false;
  }
  fields f{j, where};
  json ports;
  if (!f.str("name", &n->name, why) || !f.str("host", &n->host, why) || !f.strs("roles", &n->roles, why) ||
      !f.num("gpus", &n->gpus, 1, 64, why) || !f.num("prefill_ranks", &n->prefill_ranks, 1, 256, why) ||
      !f.num("prefill_at_start", &n->prefill_at_start, 0, 64, why) || !f.boolean("spare", &n->spare, why) ||
      !f.object("ports", &ports, why) || !f.env("env", &n->env, why) || !f.no_others(why))
    return false;
  if (!plain_name(n->name)) {
    *why = where + ".name must be 1-40 characters of a-z, 0-9 and '-', got '" + n->name + "'";
    return false;
  }
  fields p{ports, where + ".ports"};
  if (!p.num("router", &n->router_port, 1, 65535, why) || !p.num("cluster", &n->cluster_port, 1, 65535, why) ||
      !p.num("http", &n->http_port, 1, 65535, why) || !p.num("store", &n->store_port, 1, 65535, why) ||
      !p.no_others(why))
    return false;
  if (!ssh_word(n->host)) {
    *why = where + ".host '" + n->host + "' is not a host name or address";
    return false;
  }
  if (n->roles.empty()) {
    *why = where + " (" + n->name + ") has no roles";
    return false;
  }
  for (const auto& r : n->roles)
    if (r != "router" && r != "prefill" && r != "store" && r != "decode" && r != "elastic" && r != "gateway") {
      *why = where + " (" + n->name + "): unknown role '" + r + "' (router, prefill, store, decode, elastic, gateway)";
      return false;
    }
  if (n->prefill_at_start > 0 && !n->has("elastic")) {
    *why = where + " (" + n->name + "): prefill_at_start is for elastic nodes";
    return false;
  }
  if (n->has("elastic") && n->prefill_at_start > n->gpus) {
    *why = where + " (" + n->name + "): prefill_at_start (" + std::to_string(n->prefill_at_start) +
           ") exceeds its gpus (" + std::to_string(n->gpus) + ")";
    return false;
  }
  return true;
}

bool validate(const cluster_spec& s, std::string* why) {
  for (const auto& o : s.cors_origins)
    if (auto e = http::origin_problem(o); !e.empty()) return *why = "spec.cors_origins: " + e, false;
  if (s.nodes.empty()) {
    *why = "nodes: a cluster needs at least one node";
    return false;
  }
  size_t routers = 0, decodes = 0, prefills = 0, stores = 0, elastics = 0;
  std::set<std::string> names;
  std::set<std::pair<std::string, uint16_t>> ports;
  for (const auto& n : s.nodes) {
    if (!names.insert(n.name).second) {
      *why = "nodes: the name '" + n.name + "' is used twice";
      return false;
    }
    if (n.spare && (!n.gpu_rank_node() || n.has("gateway") || n.has("store"))) {
      *why = "node '" + n.name + "': a spare stands in for a failed decode, prefill or elastic node: it needs one of "
             "those roles, and no router, store or gateway";
      return false;
    }
    if (n.spare && (n.router_port || n.cluster_port || n.http_port || n.store_port)) {
      *why = "node '" + n.name + "': a spare listens on no port of its own (it takes the failed node's place)";
      return false;
    }
    routers += n.has("router");
    if (n.spare) continue;  // counts for nothing until it stands in
    decodes += n.has("decode") || (n.has("elastic") && n.prefill_at_start < n.gpus);
    prefills += n.has("prefill") || (n.has("elastic") && n.prefill_at_start > 0);
    stores += n.has("store");
    elastics += n.has("elastic");
    const bool head = n.has("router");
    if (head && n.has("elastic")) {
      *why = "node '" + n.name + "': elastic ranks run in their own node processes, not on the router's node";
      return false;
    }
    // The head runs the balancers and may run prefill ranks and block servers in its process;
    // any other node runs one kind of rank process (plus, optionally, a gateway).
    if (!head && n.has("decode") + n.has("prefill") + n.has("store") + n.has("elastic") > 1) {
      *why = "node '" + n.name + "': a node other than the router's runs one of decode, prefill, elastic or store; "
             "split it into several nodes";
      return false;
    }
    if (!head && n.has("store") && !n.store_port) {
      *why = "node '" + n.name + "': a store node needs ports.store (the head connects there)";
      return false;
    }
    if (n.store_port && (head || !n.has("store"))) {
      *why = "node '" + n.name + "': ports.store is for store nodes other than the router's";
      return false;
    }
    if (head && n.has("decode")) {
      *why = "node '" + n.name + "': decode ranks run in their own node processes, not on the router's node";
      return false;
    }
    if (head && (!n.router_port || !n.cluster_port)) {
      *why = "node '" + n.name + "': the router's node needs ports.router and ports.cluster";
      return false;
    }
    if (n.has("gateway") && !n.http_port) {
      *why = "node '" + n.name + "': a gateway needs ports.http";
      return false;
    }
    // localhost, 127.0.0.1 and ::1 are one machine: the same port under two of them collides.
    const std::string machine = is_local_host(n.host) ? std::string{"this machine"} : n.host;
    for (uint16_t p : {n.router_port, n.cluster_port, n.http_port, n.store_port})
      if (p && !ports.insert({machine, p}).second) {
        *why = "node '" + n.name + "': port " + std::to_string(p) + " on " + n.host + " is taken by another node";
        return false;
      }
  }
  if (routers != 1) {
    *why = "nodes: exactly one node must have the router role, found " + std::to_string(routers);
    return false;
  }
  // Every node dials the head at its host: a loopback head is unreachable from other machines.
  if (const auto& h = s.head(); is_local_host(h.host))
    for (const auto& n : s.nodes)
      if (!is_local_host(n.host)) {
        *why = "node '" + n.name + "' on " + n.host + " would dial the router's node '" + h.name + "' at " + h.host +
               ", its own loopback: give the router's node an address the other hosts can reach";
        return false;
      }
  if (!s.store_dir.empty() && s.block_tokens % s.page_tokens != 0) {
    *why = "spec.store.block_tokens (" + std::to_string(s.block_tokens) + ") must be a multiple of spec.executor.page_tokens (" +
           std::to_string(s.page_tokens) + "): a block is whole KV pages";
    return false;
  }
  if (elastics == 0 && (s.elastic_ttft_ms || s.elastic_tbt_ms)) {
    *why = "spec.elastic sets the planner of elastic nodes, but no node has the elastic role";
    return false;
  }
  if (!s.dp_attention && s.dp_shrink_after_s) {
    *why = "spec.expert_parallel.dp_shrink_after_s lets a data-parallel group shrink: it needs dp_attention";
    return false;
  }
  if (!s.dp_attention && s.dp_step_timeout_ms != cluster_spec{}.dp_step_timeout_ms) {
    *why = "spec.expert_parallel.dp_step_timeout_ms bounds a data-parallel group's steps: it needs dp_attention";
    return false;
  }
  if (s.dp_attention) {
    std::string bad = s.decode_ep < 2 ? "expert_parallel.decode is " + std::to_string(s.decode_ep)
                      : elastics > 0 ? std::string{"there are elastic nodes"} : std::string{};
    uint32_t ranks = 0;
    for (const auto& n : s.nodes)
      if (n.gpu_rank_node() && n.has("decode") && !n.spare) ranks += n.gpus;
    if (bad.empty() && ranks % s.decode_ep != 0)
      bad = "the decode nodes have " + std::to_string(ranks) + " ranks in all, not a multiple of " + std::to_string(s.decode_ep);
    if (!bad.empty()) {
      *why = "spec.expert_parallel.dp_attention groups the decode ranks by expert_parallel.decode (>= 2), "
             "without elastic nodes, but " + bad;
      return false;
    }
  }
  if (elastics > 0 && s.prefill_ep != s.decode_ep) {
    *why = "an elastic rank serves both roles with one expert group: with elastic nodes, expert_parallel.prefill "
           "and expert_parallel.decode must be equal";
    return false;
  }
  if (decodes == 0) {
    *why = "nodes: at least one node must have the decode role (or be elastic with a rank starting as decode)";
    return false;
  }
  if (prefills == 0) {
    *why = "nodes: at least one node must have the prefill role (the router's node or a prefill node)";
    return false;
  }
  if (!s.store_dir.empty() && stores == 0) {
    *why = "store.dir is set but no node has the store role";
    return false;
  }
  if (stores > 0 && s.store_dir.empty()) {
    *why = "a node has the store role but store.dir is not set";
    return false;
  }
  if (auto e = store::capacity_gib_error(s.store_capacity_gib, "spec.store.capacity_gib"); !e.empty()) {
    *why = e;
    return false;
  }
  if (s.store_capacity_gib > 0 && s.store_dir.empty()) {
    *why = "spec.store.capacity_gib budgets the store's directories, but store.dir is not set";
    return false;
  }
  if (!plain_name(s.name)) {
    *why = "name must be 1-40 characters of a-z, 0-9 and '-', got '" + s.name + "'";
    return false;
  }
  return true;
}

}  // namespace

bool parse_cluster_spec(const std::string& json_text, const std::string& base_dir, cluster_spec* out, std::string* why) {
  *out = cluster_spec{};
  auto j = json::parse(json_text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    *why = "the spec is not a JSON object";
    return false;
  }
  fields f{j, "spec"};
  json policies, executor, store, ssh, xport, ep, elastic;
  if (auto it = j.find("tls"); it != j.end() && !it->is_boolean()) {
    *why = "spec.tls must be true or false";
    return false;
  } else if (it != j.end()) {
    out->tls = it->get<bool>();
  }
  f.mark("tls");
  if (!f.str("tls_dir", &out->tls_dir, why)) return false;
  if (!f.str("name", &out->name, why) || !f.str("model", &out->model, why) ||
      !f.str("chat_template", &out->chat_template, why) || !f.str("image", &out->image, why) ||
      !f.str("binary", &out->binary, why) || !f.strs("api_keys", &out->api_keys, why) ||
      !f.str("api_keys_env", &out->api_keys_env, why) || !f.str("api_keys_file", &out->api_keys_file, why) ||
      !f.strs("cors_origins", &out->cors_origins, why) ||
      !f.boolean("log_requests", &out->log_requests, why) ||
      !f.object("policies", &policies, why) ||
      !f.object("executor", &executor, why) || !f.object("store", &store, why) || !f.object("ssh", &ssh, why) ||
      !f.env("env", &out->env, why) || !f.object("transport", &xport, why) ||
      !f.object("expert_parallel", &ep, why) || !f.object("elastic", &elastic, why))
    return false;
  fields fel{elastic, "spec.elastic"};
  if (!fel.num("ttft_ms", &out->elastic_ttft_ms, 1, 3'600'000, why) || !fel.num("tbt_ms", &out->elastic_tbt_ms, 1, 3'600'000, why) ||
      !fel.no_others(why))
    return false;
  fields fx{xport, "spec.transport"}, fep{ep, "spec.expert_parallel"};
  if (!fx.str("send", &out->ucx_send, why) || !fx.no_others(why) || !fep.num("prefill", &out->prefill_ep, 1, 256, why) ||
      !fep.num("decode", &out->decode_ep, 1, 256, why) ||
      !fep.boolean("dual_batch_overlap", &out->dual_batch_overlap, why) ||
      !fep.boolean("dp_attention", &out->dp_attention, why) || !fep.num("eplb_slots", &out->eplb_slots, 0, 4096, why) ||
      !fep.num("eplb_interval", &out->eplb_interval, 1, 1u << 30, why) ||
      !fep.num("dp_step_timeout_ms", &out->dp_step_timeout_ms, 100, 3'600'000, why) ||
      !fep.num("dp_shrink_after_s", &out->dp_shrink_after_s, 0, 119, why) || !fep.no_others(why))
    return false;
  if (out->ucx_send != "put" && out->ucx_send != "am") {
    *why = "spec.transport.send must be put (one-sided RMA: shared memory, RDMA) or am (rendezvous active messages: TCP), not '" +
           out->ucx_send + "'";
    return false;
  }
  if (out->eplb_slots && out->prefill_ep < 2 && out->decode_ep < 2) {
    *why = "spec.expert_parallel.eplb_slots places expert copies over EP ranks: it needs prefill or decode >= 2";
    return false;
  }
  if ((out->prefill_ep > 1 || out->decode_ep > 1) && out->model == "random") {
    *why = "spec.expert_parallel needs a model with routed experts (deepseek-v2-tiny, deepseek-v3-tiny or a DeepSeek "
           "directory); the built-in model has none";
    return false;
  }
  fields fp{policies, "spec.policies"}, fe{executor, "spec.executor"}, fs{store, "spec.store"}, fh{ssh, "spec.ssh"};
  if (!fp.str("prefill", &out->prefill_policy, why) || !fp.str("decode", &out->decode_policy, why) ||
      !fp.num("interactive_reserve_pct", &out->interactive_reserve_pct, 0, 90, why) || !fp.no_others(why) || !fe.num("threads", &out->executor_threads, 1, 256, why) ||
      !fe.num("kv_pages", &out->kv_pages, 1, 1u << 24, why) || !fe.num("page_tokens", &out->page_tokens, 1, 4096, why) ||
      !fe.str("backend", &out->executor_backend, why) || !fe.no_others(why) || !fs.str("dir", &out->store_dir, why) || !fs.num("servers", &out->store_servers, 1, 64, why) ||
      !fs.num("block_tokens", &out->block_tokens, 1, 1u << 20, why) ||
      !fs.num("rank_cache_blocks", &out->rank_cache_blocks, 0, 1u << 24, why) ||
      !fs.real("capacity_gib", &out->store_capacity_gib, why) || !fs.no_others(why) ||
      !fh.str("user", &out->ssh_user, why) || !fh.strs("options", &out->ssh_options, why) || !fh.no_others(why))
    return false;
  // Checked here, not first by the head once launched: `--dry-run` and `baton deploy` refuse a typo.
  if (!policies::parse_prefill_policy(out->prefill_policy)) {
    *why = "spec.policies.prefill must be seed, least_loaded, round_robin, cache_affinity or split, got '" +
           out->prefill_policy + "'";
    return false;
  }
  if (!policies::parse_decode_policy(out->decode_policy)) {
    *why = "spec.policies.decode must be seed, least_loaded or round_robin, got '" + out->decode_policy + "'";
    return false;
  }
  if (out->executor_backend != "cpu" && out->executor_backend != "cuda") {
    *why = "spec.executor.backend must be cpu or cuda, got '" + out->executor_backend + "'";
    return false;
  }
  if (out->executor_backend == "cuda" && (out->prefill_ep > 1 || out->decode_ep > 1)) {
    *why = "spec.expert_parallel runs on the CPU executor only so far: with spec.executor.backend cuda, leave it out";
    return false;
  }
  if (!out->ssh_user.empty() && !ssh_word(out->ssh_user, "@")) {  // "user@host" is one word
    *why = "spec.ssh.user '" + out->ssh_user + "' is not a user name";
    return false;
  }
  auto nodes = j.find("nodes");
  if (nodes == j.end() || !nodes->is_array()) {
    *why = "spec.nodes must be an array of nodes";
    return false;
  }
  f.mark("nodes");
  if (!f.no_others(why)) return false;
  for (size_t i = 0; i < nodes->size(); ++i) {
    node_spec n;
    if (!parse_node((*nodes)[i], i, &n, why)) return false;
    out->nodes.push_back(std::move(n));
  }
  for (const auto& k : out->api_keys)
    if (k.size() < 8) {
      *why = "spec.api_keys: every key needs at least 8 characters";
      return false;
    }
  const bool named = out->model == "random" || out->model == "deepseek-v2-tiny" || out->model == "deepseek-v3-tiny";
  if (!named && !out->model.empty() && out->model.front() != '/' && !base_dir.empty())
    out->model = (std::filesystem::path(base_dir) / out->model).lexically_normal().string();
  if (!out->chat_template.empty() && out->chat_template.front() != '/' && !base_dir.empty())
    out->chat_template = (std::filesystem::path(base_dir) / out->chat_template).lexically_normal().string();
  if (!out->api_keys_file.empty() && out->api_keys_file.front() != '/' && !base_dir.empty())
    out->api_keys_file = (std::filesystem::path(base_dir) / out->api_keys_file).lexically_normal().string();
  if (out->tls_dir.empty()) out->tls_dir = ".baton-tls-" + out->name;
  if (out->tls_dir.front() != '/' && !base_dir.empty())
    out->tls_dir = (std::filesystem::path(base_dir) / out->tls_dir).lexically_normal().string();
  // The store's directory too, as the model's: "store" next to the spec, wherever the launcher runs.
  if (!out->store_dir.empty() && out->store_dir.front() != '/' && !base_dir.empty())
    out->store_dir = (std::filesystem::path(base_dir) / out->store_dir).lexically_normal().string();
  return validate(*out, why);
}

bool load_cluster_spec(const std::string& path, cluster_spec* out, std::string* why) {
  std::string text;
  if (!gpu::read_text_file(path, &text)) {
    *why = path + ": cannot read it";
    return false;
  }
  // Absolute: paths resolved against it travel to other machines and processes, whose working
  // directory is not ours ("conf/models/x" would name nothing there).
  std::error_code ec;
  auto base = std::filesystem::absolute(std::filesystem::path(path), ec).parent_path();
  if (ec) base = std::filesystem::path(path).parent_path();
  if (!parse_cluster_spec(text, base.lexically_normal().string(), out, why)) {
    *why = path + ": " + *why;
    return false;
  }
  return true;
}

tls_files tls_files_for(const cluster_spec& s, const std::string& identity) {
  return {s.tls_dir + "/" + identity + ".pem", s.tls_dir + "/" + identity + ".key", s.tls_dir + "/ca.pem"};
}

std::vector<node_launch> plan_launch(const cluster_spec& s, const std::string& binary, const addressing& addr) {
  std::vector<node_launch> out;
  const auto& h = s.head();
  auto listen = [&](const node_spec& n, uint16_t port) {
    return (addr.listen_any.empty() ? n.host : addr.listen_any) + ":" + std::to_string(port);
  };
  const std::string join = addr.head_host + ":" + std::to_string(h.cluster_port);
  std::vector<std::string> executor = {"--executor-threads", std::to_string(s.executor_threads), "--kv-pages",
                                       std::to_string(s.kv_pages), "--page-tokens", std::to_string(s.page_tokens)};
  if (s.executor_backend != "cpu") executor.insert(executor.end(), {"--executor", s.executor_backend});
  // Every process with transports (the head, prefill, decode and elastic nodes) sends as the spec
  // says; engines add their expert parallelism. Only what differs from the defaults.
  std::vector<std::string> send;
  if (s.ucx_send != "put") send = {"--ucx-send", s.ucx_send};
  auto expert_flags = [&s](bool prefill) {
    std::vector<std::string> a;
    if (const uint32_t ep = prefill ? s.prefill_ep : s.decode_ep; ep > 1) {
      a.insert(a.end(), {"--expert-parallel", std::to_string(ep)});
      if (s.dual_batch_overlap) a.push_back("--dual-batch-overlap");
      if (s.dp_attention && !prefill) a.push_back("--dp-attention");
      if (s.dp_attention && !prefill && s.dp_step_timeout_ms != cluster_spec{}.dp_step_timeout_ms)
        a.insert(a.end(), {"--dp-step-timeout-ms", std::to_string(s.dp_step_timeout_ms)});
      if (s.dp_attention && !prefill && s.dp_shrink_after_s)
        a.insert(a.end(), {"--dp-shrink-after-s", std::to_string(s.dp_shrink_after_s)});
      if (s.eplb_slots)
        a.insert(a.end(), {"--eplb-slots", std::to_string(s.eplb_slots), "--eplb-interval", std::to_string(s.eplb_interval)});
    }
    return a;
  };
  std::map<std::string, std::string> key_env;
  if (!s.api_keys.empty()) {
    std::string keys;
    for (const auto& k : s.api_keys) keys += (keys.empty() ? "" : ",") + k;
    key_env["BATON_API_KEYS"] = keys;
  }
  if (!s.api_keys_json.empty()) key_env["BATON_API_KEYS_JSON"] = s.api_keys_json;
  // Each store directory's budget, on every process that has one (only when set: the
  // generated scripts of specs without it stay as they were).
  std::vector<std::string> capacity;
  if (s.store_capacity_gib > 0) {
    char gib[32];
    std::snprintf(gib, sizeof gib, "%.15g", s.store_capacity_gib);
    capacity = {"--store-capacity-gib", gib};
  }
  // Store nodes first: the head connects to them as it starts.
  std::vector<std::string> store_nodes;
  for (const auto& n : s.nodes)
    if (n.has("store") && !n.has("router")) {
      node_launch st{n.name, n.host, "store", {binary, "node", "--role", "store", "--name", n.name, "--listen",
                                               listen(n, n.store_port), "--store-dir", s.store_dir},
                     {}};
      st.argv.insert(st.argv.end(), capacity.begin(), capacity.end());
      out.push_back(std::move(st));
      store_nodes.push_back((addr.host_of ? addr.host_of(n) : n.host) + ":" + std::to_string(n.store_port));
    }
  node_launch head{h.name, h.host, "head", {binary, "local", "--serve", "--model", s.model, "--prefill-ranks",
                                            std::to_string(h.has("prefill") ? h.prefill_ranks : 0), "--decode-ranks",
                                            "0", "--router-listen", listen(h, h.router_port), "--cluster-listen",
                                            listen(h, h.cluster_port),
                                            "--prefill-policy", s.prefill_policy, "--decode-policy", s.decode_policy},
                   {}};
  head.argv.insert(head.argv.end(), executor.begin(), executor.end());
  if (!s.chat_template.empty()) head.argv.insert(head.argv.end(), {"--chat-template", s.chat_template});
  if (s.interactive_reserve_pct)
    head.argv.insert(head.argv.end(), {"--interactive-reserve-pct", std::to_string(s.interactive_reserve_pct)});
  // Elastic nodes: the head runs the controller that moves their ranks.
  if (std::any_of(s.nodes.begin(), s.nodes.end(), [](const node_spec& n) { return n.has("elastic"); })) {
    head.argv.push_back("--elastic-nodes");
    if (s.elastic_ttft_ms) head.argv.insert(head.argv.end(), {"--elastic-ttft-ms", std::to_string(s.elastic_ttft_ms)});
    if (s.elastic_tbt_ms) head.argv.insert(head.argv.end(), {"--elastic-tbt-ms", std::to_string(s.elastic_tbt_ms)});
  }
  head.argv.insert(head.argv.end(), send.begin(), send.end());
  if (h.has("prefill")) {
    const auto e = expert_flags(true);
    head.argv.insert(head.argv.end(), e.begin(), e.end());
  }
  if (h.has("store")) {
    head.argv.insert(head.argv.end(), {"--store-dir", s.store_dir, "--store-servers", std::to_string(s.store_servers)});
    head.argv.insert(head.argv.end(), capacity.begin(), capacity.end());
  }
  for (const auto& a : store_nodes) head.argv.insert(head.argv.end(), {"--store-node", a});
  if (!s.store_dir.empty()) head.argv.insert(head.argv.end(), {"--block-tokens", std::to_string(s.block_tokens)});
  std::vector<std::string> rank_cache;  // prefill ranks, wherever they run
  if (s.rank_cache_blocks >= 0) rank_cache = {"--prefix-cache-blocks", std::to_string(s.rank_cache_blocks)};
  if (h.has("prefill")) head.argv.insert(head.argv.end(), rank_cache.begin(), rank_cache.end());
  std::vector<std::string> cors;  // every gateway's, the head's included
  for (const auto& o : s.cors_origins) cors.insert(cors.end(), {"--cors-origin", o});
  if (s.log_requests) cors.push_back("--log-requests");  // every gateway's flags, as the origins
  if (h.has("gateway")) {
    head.argv.insert(head.argv.end(), {"--http-listen", listen(h, h.http_port)});
    head.argv.insert(head.argv.end(), cors.begin(), cors.end());
    head.env = key_env;
  }
  out.push_back(std::move(head));
  uint32_t decode_ranks = 0;  // before this node: data-parallel groups run across the decode nodes in spec order
  for (const auto& n : s.nodes) {
    if (n.gpu_rank_node()) {
      const std::string role = n.has("decode") ? "decode" : n.has("elastic") ? "elastic" : "prefill";
      node_launch d{n.name, n.host, role, {binary, "node", "--role", role, "--name", n.name, "--connect", join,
                                           "--ranks", std::to_string(n.gpus), "--model", s.model},
                    {},
                    n.spare,
                    n.gpus};
      if (role == "elastic") d.argv.insert(d.argv.end(), {"--prefill-at-start", std::to_string(n.prefill_at_start)});
      d.argv.insert(d.argv.end(), executor.begin(), executor.end());
      const auto e = expert_flags(role == "prefill");
      d.argv.insert(d.argv.end(), send.begin(), send.end());
      d.argv.insert(d.argv.end(), e.begin(), e.end());
      if (role != "decode") d.argv.insert(d.argv.end(), rank_cache.begin(), rank_cache.end());
      // A spare's members are those of the node it stands in for (stand_in).
      if (role == "decode" && s.dp_attention && !n.spare)
        d.argv.insert(d.argv.end(), {"--dp-first-rank", std::to_string(decode_ranks)});
      if (role == "decode" && !n.spare) decode_ranks += n.gpus;
      out.push_back(std::move(d));
    }
    if (n.has("gateway") && !n.has("router")) {
      const std::string process = n.gpu_rank_node() ? n.name + "/gateway" : n.name;
      out.push_back({n.name, n.host, "gateway",
                     {binary, "gateway", "--name", process, "--cluster", join, "--listen", listen(n, n.http_port)},
                     key_env, false, 0, process});
      out.back().argv.insert(out.back().argv.end(), cors.begin(), cors.end());
    }
  }
  for (auto& l : out)
    if (l.process.empty()) l.process = l.name;
  // Every process carries the cluster's id, and with TLS its own certificate.
  for (auto& l : out) {
    l.argv.insert(l.argv.end(), {"--cluster-id", s.name});
    if (s.tls) {
      const auto t = tls_files_for(s, l.name);
      l.argv.insert(l.argv.end(), {"--tls-cert", t.cert, "--tls-key", t.key, "--tls-ca", t.ca});
    }
  }
  // The spec's environment, then the node's own over it (the keys stay as they are).
  for (auto& l : out) {
    const auto& n = *std::find_if(s.nodes.begin(), s.nodes.end(), [&](const node_spec& x) { return x.name == l.name; });
    for (const auto* e : {&s.env, &n.env})
      for (const auto& [k, v] : *e) l.env.insert_or_assign(k, v);
  }
  return out;
}

node_launch stand_in(const node_launch& spare, const node_launch& failed) {
  node_launch out = spare;
  out.spare = false;
  const auto at = std::find(failed.argv.begin(), failed.argv.end(), "--dp-first-rank");
  if (at != failed.argv.end() && at + 1 != failed.argv.end()) out.argv.insert(out.argv.end(), {*at, *(at + 1)});
  return out;
}

bool is_local_host(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

namespace {

/// ssh, its options and the destination ([user@]host), before the remote command.
std::vector<std::string> ssh_to(const cluster_spec& spec, const std::string& host, std::vector<std::string> out) {
  out.push_back("-o");
  out.push_back("BatchMode=yes");
  out.insert(out.end(), spec.ssh_options.begin(), spec.ssh_options.end());
  out.push_back(spec.ssh_user.empty() ? host : spec.ssh_user + "@" + host);
  return out;
}

}  // namespace

std::string remote_env_file(const cluster_spec& spec, const node_launch& n) {
  // Spec names are plain (a-z, 0-9, '-'); a gateway's process is <node>/gateway, whose '/' becomes
  // '.', which no name holds: two processes never share a file. Anything else odd (a name that
  // did not come through the spec's checks) becomes '_': the path is never a shell's to expand.
  auto plain = [](std::string s) {
    for (char& c : s) {
      if (c == '/')
        c = '.';
      else if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_')
        c = '_';
    }
    return s;
  };
  return ".baton/env." + plain(spec.name) + "." + plain(n.process.empty() ? n.name : n.process);
}

std::vector<std::string> env_file_argv(const cluster_spec& spec, const std::string& host, const node_launch& n) {
  // -T: no terminal, which would echo the text and turn its newlines into CR LF. The file is
  // removed before it is made so that umask sets its mode (a file left by an earlier run keeps
  // its own when truncated); sh -c: the login shell may be any, the script is POSIX sh.
  auto out = ssh_to(spec, host, {"ssh", "-T"});
  const std::string file = "\"$HOME/" + remote_env_file(spec, n) + "\"";
  out.push_back("exec sh -c " + shell_quote("umask 077 && mkdir -p \"$HOME/.baton\" && rm -f " + file + " && cat > " + file));
  return out;
}

std::string env_file_text(const node_launch& n) {
  // Names are validated (letters, digits, '_', not a digit first): only the values need quoting.
  std::string out;
  for (const auto& [k, v] : n.env) out += "export " + k + "=" + shell_quote(v) + "\n";
  return out;
}

std::vector<std::string> ssh_argv(const cluster_spec& spec, const std::string& host, const node_launch& n) {
  // -tt: a terminal on the remote side, so that when the launcher ends this ssh the remote
  // process gets SIGHUP and stops (without one it would outlive the session).
  auto out = ssh_to(spec, host, {"ssh", "-tt"});
  // ssh joins its arguments into one command line for the remote shell: quote every word.
  std::string remote = "exec";
  if (!n.env.empty()) {
    // The environment comes from the file env_file_argv wrote: read into the shell, removed
    // before any of it applies (an entry cannot redirect the removal, HOME say), then applied;
    // the node runs with its arguments as sh's "$@". No value is in any command line, here or
    // on that host.
    const std::string file = "\"$HOME/" + remote_env_file(spec, n) + "\"";
    const std::string script = "e=$(cat " + file + ") || exit; rm -f " + file + "; eval \"$e\" || exit; exec \"$@\"";
    remote += " sh -c " + shell_quote(script) + " baton";  // "baton": the script's $0
  }
  for (const auto& a : n.argv) remote.append(" ").append(shell_quote(a));
  out.push_back(remote);
  return out;
}

}  // namespace baton::deploy

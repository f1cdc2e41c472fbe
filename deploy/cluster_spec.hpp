#pragma once

// The cluster spec (JSON) and what it turns into: one `baton` command line per node, started
// here as processes, over ssh on other hosts, or written out as Kubernetes manifests or a Slurm
// batch script. Pure: no processes are started in this file. docs/cluster-spec.md describes the
// format; deploy/examples/ has specs to start from.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace baton::deploy {

struct node_spec {
  std::string name;
  std::string host = "127.0.0.1";
  std::vector<std::string> roles;  ///< head: router [+ prefill, store, gateway]; others: one of decode, prefill, elastic, store [+ gateway]
  uint32_t gpus = 1;               ///< decode or prefill node: one rank per GPU (CPU executors without CUDA)
  uint32_t prefill_ranks = 2;      ///< the head's prefill ranks (DP ranks of its engines)
  uint32_t prefill_at_start = 0;   ///< elastic node: of its `gpus` ranks, how many start as prefill
  uint16_t router_port = 0;        ///< head: C++ clients and gateways connect here
  uint16_t cluster_port = 0;       ///< head: node processes join here
  uint16_t http_port = 0;          ///< gateway
  uint16_t store_port = 0;         ///< store node: the head connects here to adopt its block server
  std::map<std::string, std::string> env;  ///< this node's processes' environment (over the spec's)
  /// A spare: `baton launch` does not start it, but starts it in place of a decode, prefill or
  /// elastic node of the same role and `gpus` that failed for good (its restarts, if any, used
  /// up, or its host unreachable); a data-parallel decode node's members pass to it.
  bool spare = false;
  bool has(const std::string& role) const;
  /// A decode, prefill or elastic node of its own (not the head): one process with `gpus` ranks.
  bool gpu_rank_node() const { return !has("router") && (has("decode") || has("prefill") || has("elastic")); }
};

struct cluster_spec {
  std::string name = "baton";
  std::string model = "random";   ///< a model directory (relative to the spec file) or `random`
  std::string chat_template;      ///< a Jinja file for the head's chat template (relative to the spec file), or none
  std::string image = "baton:latest";  ///< container image (Kubernetes)
  std::string binary;             ///< the `baton` executable on remote hosts (default: the same path)
  std::vector<std::string> api_keys;
  std::string api_keys_env;       ///< or: read the keys from this environment variable at launch
  /// Named keys with limits (deploy/api_keys.hpp), relative to the spec; the launcher reads it
  /// and hands its text to every gateway (BATON_API_KEYS_JSON, as the plain keys).
  std::string api_keys_file;
  std::string api_keys_json;      ///< that file's text, read at launch
  std::vector<std::string> cors_origins;  ///< browser origins every gateway lets call the API (--cors-origin)
  bool log_requests = false;      ///< every gateway writes a line per call (--log-requests)
  std::string prefill_policy = "seed", decode_policy = "seed";
  uint32_t interactive_reserve_pct = 0;  ///< policies' (--interactive-reserve-pct): decode KV batch requests leave free
  uint32_t executor_threads = 1, kv_pages = 512, page_tokens = 16;
  /// executor.backend: cpu, or cuda (every rank process gets `--executor cuda`, and Kubernetes
  /// and Slurm ask for a GPU per rank; without it they ask for none).
  std::string executor_backend = "cpu";
  std::string store_dir;          ///< empty: no block store
  int64_t rank_cache_blocks = -1; ///< prefill ranks' local prefix tier, in blocks (-1: their default)
  uint32_t store_servers = 1, block_tokens = 64;
  double store_capacity_gib = 0;  ///< store.capacity_gib: each store directory's disk budget (--store-capacity-gib); 0 = unbounded
  std::string ssh_user;
  std::vector<std::string> ssh_options;
  /// Environment of every node process (e.g. UCX_TLS, UCX_NET_DEVICES, CUDA_VISIBLE_DEVICES).
  std::map<std::string, std::string> env;
  /// Mutual TLS between the nodes: `baton launch` makes a cluster CA and a certificate per node
  /// (and one for itself and one for clients) in tls_dir (default: .baton-tls-<name> next to the
  /// spec); other hosts must see the same paths.
  bool tls = false;
  std::string tls_dir;
  std::string ucx_send = "put";   ///< transport.send: put (shared memory, RDMA) or am (TCP)
  /// expert_parallel: EP size of prefill and of decode engines (1: none), as DeepSeek runs small EP
  /// for prefill and wide EP for decode; dual-batch overlap for both.
  uint32_t prefill_ep = 1, decode_ep = 1;
  bool dual_batch_overlap = false;
  /// expert_parallel.dp_attention: the decode ranks form data-parallel groups of decode_ep
  /// (gpu::expert_peers), across the decode nodes in spec order, instead of leading expert
  /// processes; a group's members in different nodes meet through the head.
  bool dp_attention = false;
  /// expert_parallel.eplb_slots / eplb_interval: live EPLB in every expert-parallel engine
  /// (gpu::live_eplb_config; 0 slots: off).
  uint32_t eplb_slots = 0, eplb_interval = 64;
  /// expert_parallel.dp_step_timeout_ms: with dp_attention, how long a member may be silent in a
  /// step before its group breaks and re-forms (`baton node --dp-step-timeout-ms`).
  uint32_t dp_step_timeout_ms = 10'000;
  /// expert_parallel.dp_shrink_after_s: with dp_attention, how long a group re-forming after a
  /// loss waits for the lost members before it meets without them (`baton node
  /// --dp-shrink-after-s`; 0: it waits for them, up to the meeting timeout of 120 s).
  uint32_t dp_shrink_after_s = 0;
  /// elastic: the role planner's targets, for the head's controller when nodes have the elastic
  /// role (0: the head's defaults).
  uint32_t elastic_ttft_ms = 0, elastic_tbt_ms = 0;
  std::vector<node_spec> nodes;

  const node_spec& head() const;  ///< the node with the router role (validated: exactly one)
};

/// Parses and validates a spec; false and a sentence naming the field (and node) on failure.
/// `base_dir` resolves a relative model path.
bool parse_cluster_spec(const std::string& json_text, const std::string& base_dir, cluster_spec* out,
                        std::string* why);
bool load_cluster_spec(const std::string& path, cluster_spec* out, std::string* why);

/// The certificate files of one identity (a node, "launcher", "client") in the spec's tls_dir.
struct tls_files {
  std::string cert, key, ca;
};
tls_files tls_files_for(const cluster_spec& spec, const std::string& identity);

/// How node processes reach the head and where they listen.
struct addressing {
  std::string head_host;       ///< the head's address as other nodes see it
  std::string listen_any;      ///< what a process binds to ("" = its spec host; "0.0.0.0" in containers)
  /// A node's address as the head sees it (store nodes); empty: the spec's host.
  std::function<std::string(const node_spec&)> host_of = {};
};

/// One node's process: its `baton` arguments (argv[0] = the binary) and environment additions.
struct node_launch {
  std::string name;
  std::string host;
  std::string role;  ///< head | decode | prefill | store | gateway
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;
  bool spare = false;  ///< not started with the others (node_spec::spare); no data-parallel members of its own
  uint32_t ranks = 0;  ///< decode, prefill or elastic node: its ranks (what a spare must match)
  /// The name this process joins the head's node directory under, one per process: the node's
  /// name, or <node>/gateway for a gateway that shares its node with a rank process (the
  /// directory refuses two kinds of process under one name).
  std::string process{};
};

/// The command that starts spare `spare` in place of node `failed` (same role and ranks): the
/// spare's own command, given the failed node's data-parallel members (--dp-first-rank).
node_launch stand_in(const node_launch& spare, const node_launch& failed);

/// Every node's command line -- store nodes first (the head adopts their block servers as it
/// starts), then the head, then the rest -- with the spec's and the node's environment.
/// Gateways get their API keys through the environment (BATON_API_KEYS), never as a flag. A
/// node on another host gets its environment through a file on that host (env_file_argv), never
/// on a command line, where `ps` would show it.
std::vector<node_launch> plan_launch(const cluster_spec& spec, const std::string& binary, const addressing& addr);

/// True when `host` names this machine (127.0.0.0/8, localhost, ::1).
bool is_local_host(const std::string& host);
/// The argv that runs `argv` on `host` through ssh: every argument single-quoted for the remote
/// shell, so no spec string is ever interpreted by it. With an environment, the remote command
/// first reads it from remote_env_file (written by env_file_argv just before), removes the file,
/// then runs the node: no value of the environment is in this argv or the remote command line.
std::vector<std::string> ssh_argv(const cluster_spec& spec, const std::string& host, const node_launch& n);
/// Where node `n`'s environment waits on its host between the two ssh commands that start it,
/// relative to the remote home: .baton/env.<cluster>.<process> (one file per process, so that a
/// gateway sharing its node with a rank process does not take the other's).
std::string remote_env_file(const cluster_spec& spec, const node_launch& n);
/// The ssh command (no terminal: its stdin passes through as it is) that writes its stdin to
/// remote_env_file on `host`, readable by the remote user only. Its stdin: env_file_text(n).
std::vector<std::string> env_file_argv(const cluster_spec& spec, const std::string& host, const node_launch& n);
/// Node `n`'s environment as POSIX sh lines, each value single-quoted: export K='v'.
std::string env_file_text(const node_launch& n);
/// A string quoted for a POSIX shell: 'it'\''s'.
std::string shell_quote(const std::string& s);

/// `baton deploy k8s`: a Pod per node and a Service for the head and for each gateway (YAML).
std::string kubernetes_manifests(const cluster_spec& spec);
/// Why the spec's Kubernetes object names (<spec name>-<node name>, also the Services' DNS
/// names the pods dial) are not DNS-1035 labels: at most 63 characters, a letter first, a letter
/// or digit last. Empty when they are.
std::string kubernetes_name_problem(const cluster_spec& spec);
/// `baton deploy slurm`: a batch script that starts every node with srun on the allocation.
std::string slurm_script(const cluster_spec& spec);

}  // namespace baton::deploy

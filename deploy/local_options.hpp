#pragma once

// `baton local`'s options (deploy/local_command.cpp parses them) and its sample run: the prompts
// answered, their timings summed up, when it does not serve (deploy/local_samples.cpp).

#include <cstdint>
#include <string>
#include <vector>

#include "actors/local_cluster.hpp"
#include "deploy/commands.hpp"
#include "deploy/gateway.hpp"
#include "deploy/net_security.hpp"
#include "deploy/node_options.hpp"
#include "gpu/hf_model.hpp"

namespace baton::deploy {

struct local_options {
  local_cluster_config cluster = [] {
    local_cluster_config c;
    apply_serving_prefill_defaults(&c.prefill);
    return c;
  }();
  std::vector<std::string> prompts = {
      "The capital of France is",
      "def fibonacci(n):",
      "Once upon a time, in a land far away,",
      "Prefill and decode, disaggregated:",
  };
  uint32_t max_tokens = 24;
  float temperature = 0.0f;
  uint32_t num_requests = 0;       ///< 0 = one per prompt; more cycles through the prompts
  uint32_t decode_processes = 0;   ///< decode ranks in their own processes (`baton node`), over UCX
  uint32_t expert_parallel = 1;    ///< MoE models: EP ranks per engine (the others `baton experts` processes)
  gpu::live_eplb_config eplb;      ///< with expert_parallel: live EPLB (slots_per_rank 0 = off)
  bool dual_batch_overlap = false; ///< with expert_parallel: two micro-batches per MoE round
  bool dp_attention = false;       ///< with expert_parallel: decode ranks in data-parallel groups of that size
  std::vector<std::string> store_nodes;  ///< HOST:PORT of store nodes whose block servers we adopt
  uint32_t store_node_wait_s = 60;       ///< how long to keep trying to reach them
  uint32_t scheduler_threads = 0;  ///< 0 = number of hardware threads
  uint32_t poll_attempts = 0;      ///< CAF work-stealing moderate-poll-attempts (0 avoids 50 us sleeps)
  uint32_t timeout_ms = 120000;
  bool quiet = false;              ///< only the summary
  bool ignore_eos = false;         ///< always generate max_tokens (throughput runs)
  bool one_token_via_decode = false;  ///< max_tokens 1 through a decode rank too (comparison runs)
  bool explain = false;            ///< print each placement's reasons
  std::string model = builtin_model_dir();  ///< a model directory, or "random"
  std::string chat_template;  ///< a Jinja file in place of the model directory's chat template (vLLM's --chat-template)
  bool chat = false;               ///< prompts as chat messages
  uint32_t repeat = 1;             ///< rounds of the prompts, sequentially (a later round can hit the store)
  std::string profile;             ///< cost-model profile file; empty = built-in CPU profile
  // Serving (--serve): no sample prompts; clients reach the cluster until SIGINT/SIGTERM.
  bool serve = false;
  std::string router_listen;       ///< HOST:PORT to publish the router on (C++ clients, gateways)
  std::string cluster_listen;      ///< HOST:PORT to publish the node directory on (`baton node`)
  std::string http_listen;         ///< HOST:PORT of an in-process OpenAI-compatible gateway
  gateway_config gateway;          ///< its settings (host, port and keys come from the flags above)
  std::vector<std::string> api_keys;
  std::string api_keys_file;       ///< named keys with limits (deploy/api_keys.hpp)
  uint32_t drain_timeout_ms = 60000;  ///< on SIGTERM: how long requests in flight may take to end (a node's too)
  uint32_t event_log_events = 4096;  ///< each rank's diagnostic event ring (event_log_help)
  net_security sec;                ///< cluster id and TLS of the published router and directory
};

/// Sends the sample prompts (`opt.prompts`, `opt.num_requests` of them a round, `opt.repeat`
/// rounds one after another) to the cluster's router, prints each answer (unless `opt.quiet`)
/// and the run's summary: throughput, store figures, per-stage percentiles, requests per rank,
/// role changes. Returns the process exit code: 0 when every request was answered.
int answer_sample_prompts(caf::actor_system& sys, const local_cluster& cluster, const local_options& opt);

}  // namespace baton::deploy

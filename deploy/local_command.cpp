// `baton local`: a whole cluster in this process (decode ranks in processes of their own with
// --decode-processes), serving clients (--serve) or answering sample prompts (local_samples.cpp).

#include <algorithm>
#include <chrono>
#include <filesystem>

#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <map>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "deploy/commands.hpp"
#include "deploy/decode_keeper.hpp"
#include "gpu/cpu_executor.hpp"
#include "policies/eplb.hpp"
#include "gpu/cuda_executor.hpp"
#include "deploy/expert_processes.hpp"
#include "deploy/flags.hpp"
#include "deploy/local_options.hpp"
#include "deploy/node_options.hpp"
#include "deploy/gateway.hpp"
#include "deploy/net_security.hpp"
#include "deploy/processes.hpp"
#include "deploy/utc_stamp.hpp"
#include "deploy/profile_file.hpp"
#include "gpu/hf_model.hpp"
#include "gpu/tokenizer.hpp"
#include "gpu/byte_tokenizer.hpp"

namespace baton::deploy {

namespace {

/// A stopping head's graceful part: the router refuses new requests (shutting_down), the gateway
/// new calls (503, so load balancers and retries go elsewhere), and the requests in flight run to
/// their end -- within `timeout_ms`, until a second signal, or until no decode rank is left (what
/// is in flight could only wait out the timeout).
void drain(caf::actor_system& sys, const local_cluster& cluster, const gateway_handle& gateway, uint32_t timeout_ms) {
  std::printf("baton local: draining: no new requests; waiting up to %u ms for those in progress (a second "
              "SIGINT or SIGTERM stops at once)\n", timeout_ms);
  std::fflush(stdout);
  caf::anon_send(cluster.router, drain_atom::value);
  caf::scoped_actor self{sys};
  uint64_t left = 0;
  // Requests in flight that some rank may still serve; false when the router does not answer.
  auto ask = [&] {
    bool answered = false;
    self->request(cluster.router, std::chrono::seconds{2}, stats_atom::value)
        .receive(
            [&](const cluster_stats& s) {
              // Draining decode ranks still finish what they hold; with none at all (`baton
              // launch` stops decode nodes first), nothing in flight can end any more. A decode
              // balancer too busy to answer says nothing about its ranks.
              left = s.decode_answered && s.decode.empty() ? 0 : s.num_active;
              answered = true;
            },
            [&](caf::error&) {});
    return answered;
  };
  const auto grace = std::chrono::milliseconds{timeout_ms};
  const auto deadline = std::chrono::steady_clock::now() + grace;
  if (gateway.server) drain_gateway(sys, gateway, grace, [&] { return stop_insisted() || (ask() && left == 0); });
  while (!stop_insisted() && std::chrono::steady_clock::now() < deadline && ask() && left > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds{50});
  if (left > 0) std::printf("baton local: stopping with %llu requests still in flight\n", static_cast<unsigned long long>(left));
}

/// --serve: publishes what clients and nodes connect to, prints where (one line each, for
/// people and for the launcher), and serves until SIGINT or SIGTERM.
int serve(caf::actor_system& sys, const local_cluster& cluster, const local_options& opt, std::vector<pid_t>& children,
          const std::vector<std::vector<std::string>>& child_argv) {
  std::string host, why;
  uint16_t port = 0;
  if (opt.router_listen.empty() && opt.http_listen.empty()) {
    std::fprintf(stderr, "baton local: --serve needs --router-listen or --http-listen\n");
    return 2;
  }
  // Publishes `handle` on the HOST:PORT of `flag`; prints where ("<what> listening on ..."),
  // or says why not and gives the exit code.
  // (typed handles: CAF publishes a handle's interface, which typed remote_actor checks)
  auto publish = [&](const std::string& listen, const char* flag, const char* what, const auto& handle) -> int {
    if (listen.empty()) return 0;
    if (!parse_host_port(listen, flag, &host, &port, &why)) {
      std::fprintf(stderr, "baton local: %s\n", why.c_str());
      return 2;
    }
    auto bound = publish_actor(sys, opt.sec, handle, port, host);
    if (!bound) {
      std::fprintf(stderr, "baton local: cannot publish the %s on %s: %s\n", what, listen.c_str(),
                   sys.render(bound.error()).c_str());
      return 1;
    }
    std::printf("baton local: %s listening on %s:%u\n", what, host.c_str(), static_cast<unsigned>(*bound));
    return 0;
  };
  if (int rc = publish(opt.router_listen, "--router-listen", "router", cluster.router))
    return rc;
  gateway_handle gateway;
  if (!opt.http_listen.empty()) {
    gateway_config gc = opt.gateway;
    gc.api_keys = opt.api_keys;
    if (!load_gateway_keys(opt.api_keys_file, &gc, &why) || !parse_host_port(opt.http_listen, "--http-listen", &gc.host, &gc.port, &why) ||
        !spawn_gateway(sys, gc, cluster.router, &gateway, &why)) {
      std::fprintf(stderr, "baton local: %s\n", why.c_str());
      return 2;
    }
    std::printf("baton local: gateway listening on http://%s:%u\n", gc.host.c_str(), static_cast<unsigned>(gateway.port));
    if (!gateway.keys.empty()) std::printf("baton local: API keys: %s\n", gateway.keys.c_str());
  }
  // The node directory last: `baton launch` takes its answer (and the nodes joining through it)
  // as "the head is up" and then tells clients the gateway's address, so the gateway must
  // already listen (it did not once: a curl right after "is up" was refused). The line says
  // "cluster": what `baton node --connect` takes.
  if (int rc = publish(opt.cluster_listen, "--cluster-listen", "cluster", cluster.directory)) {
    if (gateway.server) caf::scoped_actor{sys}->send_exit(gateway.server, caf::exit_reason::user_shutdown);
    return rc;
  }
  std::printf("baton local: serving; SIGINT or SIGTERM stops\n");
  std::fflush(stdout);
  install_stop_signals();
  decode_keeper keeper{children, child_argv};
  while (!stop_requested()) {
    std::this_thread::sleep_for(std::chrono::milliseconds{50});
    keeper.check(std::chrono::steady_clock::now());
  }
  drain(sys, cluster, gateway, opt.drain_timeout_ms);
  caf::scoped_actor self{sys};
  if (gateway.server) self->send_exit(gateway.server, caf::exit_reason::user_shutdown);
  std::printf("baton local: stopped\n");
  return 0;
}

}  // namespace

int run_local(const std::vector<std::string>& args) {
  local_options opt;
  flag_set flags;
  bool cuda_fp32 = false;
  std::string kv_wire;
  flags.add("--prefill-ranks", &opt.cluster.num_prefill_ranks, "prefill ranks");
  flags.add("--decode-ranks", &opt.cluster.num_decode_ranks, "decode ranks");
  flags.add("--elastic-ranks", &opt.cluster.num_elastic_ranks,
            "elastic P/D: ranks that serve either role, moved between them as the load shifts");
  flags.add("--elastic-prefill", &opt.cluster.elastic_prefill_at_start, "elastic P/D: of them, how many start as prefill");
  flags.add("--elastic-nodes", &opt.cluster.elastic_nodes,
            "elastic P/D: run the controller for elastic ranks of node processes (baton node --role elastic)");
  flags.add("--elastic-ttft-ms", &opt.cluster.elastic.planner.ttft_target_ms, "elastic P/D: the TTFT the planner aims for");
  flags.add("--elastic-tbt-ms", &opt.cluster.elastic.planner.tbt_target_ms, "elastic P/D: the TBT the planner aims for");
  flags.add("--elastic-interval-ms", &opt.cluster.elastic.interval_ms, "elastic P/D: how often the controller plans");
  flags.add("--elastic-smooth-s", &opt.cluster.elastic.planner.smooth_s, "elastic P/D: the pressures' averaging time");
  flags.add("--elastic-hold-s", &opt.cluster.elastic.planner.hold_s, "elastic P/D: how long a pool stays hot before a move");
  flags.add("--elastic-cooldown-s", &opt.cluster.elastic.planner.cooldown_s, "elastic P/D: at least this long between moves");
  flags.add("--elastic-dwell-s", &opt.cluster.elastic.planner.dwell_s, "elastic P/D: a moved rank keeps its role this long");
  flags.add("--elastic-signal", &opt.cluster.elastic.planner.pool_signal,
            "elastic P/D: a pool's pressure is the mean over its ranks (default) or the max (a tail signal)");
  flags.add("--executor-threads", &opt.cluster.executor.num_threads, "math threads per rank's executor");
  flags.add("--executor", &opt.cluster.backend.kind, "executor backend: cpu (default) or cuda (ranks in turn on the GPUs this process sees)");
  flags.add("--cuda-fp32", &cuda_fp32, "cuda: fp32 weights and KV instead of bf16 (the conformance mode)");
  flags.add("--kv-pages", &opt.cluster.executor.num_kv_pages, "KV pages per rank");
  flags.add("--max-batch-size", &opt.cluster.decode.max_batch_size,
            "decode ranks: sequences in one decode step, at most; more are admitted as KV allows and steps take them in turn (unlike vLLM's --max-num-seqs, which queues them)");
  flags.add("--page-tokens", &opt.cluster.executor.page_size_tokens, "tokens per KV page");
  flags.add("--speculative-tokens", &opt.cluster.decode.speculative_tokens,
            "decode ranks: speculative decoding by prompt lookup, up to this many draft tokens per sequence and step "
            "(0 = off; at most 16; the tokens are the same either way; CPU executor)");
  flags.add("--speculative-max-batch", &opt.cluster.decode.speculative_max_batch,
            "decode ranks: drafts only in steps of at most this many sequences (0: any; drafts cost compute once a step is compute-bound)");
  flags.add("--prompt-lookup-min", &opt.cluster.decode.prompt_lookup_min, "speculative decoding: shortest n-gram looked up");
  flags.add("--prompt-lookup-max", &opt.cluster.decode.prompt_lookup_max, "speculative decoding: longest n-gram looked up");
  flags.add("--chunk-tokens", &opt.cluster.prefill.chunk_tokens, "largest prefill chunk, in tokens");
  flags.add("--step-budget-us", &opt.cluster.prefill.step_budget_us,
            "size each prefill chunk to this predicted time (0 = fixed --chunk-tokens)");
  flags.add("--profile", &opt.profile, "cost-model profile from `baton profile` (default: the built-in CPU one)");
  flags.add("--prefill-policy", &opt.cluster.prefill_balancer.policy,
            "prefill placement: seed | least_loaded | round_robin | cache_affinity | split");
  flags.add("--decode-policy", &opt.cluster.decode_balancer.policy, "decode placement: seed | least_loaded | round_robin");
  flags.add("--interactive-reserve-pct", &opt.cluster.decode_balancer.interactive_reserve_pct,
            "of each decode rank's KV pages, the percent batch requests (priority batch) leave free for interactive "
            "ones, so that a batch flood never makes them wait for room (0: none; at most 90)");
  flags.add("--ranks-per-engine", &opt.cluster.prefill_balancer.ranks_per_engine, "prefill ranks per engine (DP group)");
  flags.add("--split-min-tokens", &opt.cluster.prefill_balancer.split_min_tokens,
            "--prefill-policy split: prompts with at least this many new tokens are split over ranks");
  flags.add("--one-token-via-decode", &opt.one_token_via_decode,
            "send one-token requests (max_tokens 1) through a decode rank as well, shipping their KV "
            "(default: the prefill rank alone answers them)");
  flags.add("--hybrid-below-tokens", &opt.cluster.router.request.hybrid_prefill_below_tokens,
            "hybrid PD: prompts shorter than this are prefilled on their decode rank (0 = never)");
  flags.add("--host-offload-pages", &opt.cluster.decode.host_offload_pages,
            "decode ranks: host memory (in KV pages) for offloading sequences when pages run short");
  flags.add("--kv-on-demand-tokens", &opt.cluster.decode.on_demand_headroom_tokens,
            "decode ranks: N > 0 allocates KV on demand (prompt + N tokens, then page by page; needs --host-offload-pages)");
  flags.add("--explain", &opt.explain,
            "print why each request was placed where it was (--serve: in each call's --log-requests line, which it turns on)");
  flags.add("--store-dir", &opt.cluster.store.dir,
            "enable the KV block store with its files here (prefixes are reused across requests)");
  flags.add("--store-servers", &opt.cluster.store.num_servers, "block servers sharing the key space");
  flags.add("--store-node", &opt.store_nodes,
            "HOST:PORT of a store node (`baton node --role store`) whose block server joins the store (repeatable)");
  flags.add("--store-node-wait-s", &opt.store_node_wait_s, "keep trying to reach the store nodes this long");
  flags.add("--store-replicas", &opt.cluster.store.replicas, "copies of each block (1 or 2)");
  flags.add("--store-capacity-gib", &opt.cluster.store.capacity_gib,
            "disk budget of --store-dir in GiB, split evenly over its block servers: each deletes its least recently "
            "used blocks to make room (0 = unbounded; store nodes take their own)");
  flags.add("--event-log-events", &opt.event_log_events, event_log_help);
  flags.add("--prefix-cache-blocks", &opt.cluster.prefill.prefix_cache_blocks,
            "prefill ranks: full prompt blocks kept in the rank's KV pages for later prompts, with or without a block "
            "store (0 = none: only the store's)");
  flags.add("--block-tokens", &opt.cluster.store.block_tokens,
            "tokens per store block, which the prefill ranks' own prefix tiers key by too (a shared prefix shorter "
            "than a block is never reused: 64 suits short system prompts); unless given: 512, or a quarter of a "
            "shorter model's context (without a store: 64)");
  flags.add("--repeat", &opt.repeat, "send the prompts this many rounds, one round after another (store reuse)");
  flags.add("--weights-seed", &opt.cluster.weights_seed, "seed of the random model's weights (--model random)");
  flags.add("--model", &opt.model,
            "a Hugging Face model directory, `random` for the seeded random model, or `deepseek-v2-tiny` / "
            "`deepseek-v3-tiny` for seeded DeepSeek shapes (MLA latent KV, MoE)");
  flags.add("--chat", &opt.chat, "send each prompt as a user message through the model's chat template");
  flags.add("--chat-template", &opt.chat_template,
            "a Jinja chat template file that replaces the model directory's (vLLM's --chat-template)");
  flags.add("--prompt", &opt.prompts, "a prompt to answer (repeat for several)");
  flags.add("--max-tokens", &opt.max_tokens, "tokens to generate per prompt (0: what the context leaves after the prompt)");
  flags.add("--temperature", &opt.temperature, "0 = greedy");
  flags.add("--num-requests", &opt.num_requests, "requests to send at once, cycling through the prompts (0 = one each)");
  flags.add("--scheduler-threads", &opt.scheduler_threads, "CAF scheduler threads (0 = hardware threads)");
  flags.add("--poll-attempts", &opt.poll_attempts, "CAF work-stealing moderate-poll-attempts");
  flags.add("--timeout-ms", &opt.timeout_ms, "give up on a request after this long");
  flags.add("--token-timeout-ms", &opt.cluster.router.request.token_timeout_ms,
            "a decode rank silent this long after a token loses the request to another rank");
  flags.add("--quiet", &opt.quiet, "print only the summary");
  flags.add("--transport", &opt.cluster.transport, "KV handoff: loopback (in-process) or ucx");
  flags.add("--kv-wire", &kv_wire,
            "KV handoff's form on the wire: f32 (default), int8 or int4 for every traffic class, or per class, "
            "e.g. batch=int4,agent=int8 (expanded back to fp32 on the decode rank)");
  flags.add("--ucx-send", &opt.cluster.ucx_send,
            "ucx: how this process's ranks send KV: put (one-sided RMA) or am (rendezvous active messages, "
            "several times faster over TCP)");
  flags.add("--expert-parallel", &opt.expert_parallel,
            "MoE models: split each engine's routed experts over N EP ranks, N - 1 of them expert processes "
            "reached over UCX (1 = off)");
  flags.add("--eplb-slots", &opt.eplb.slots_per_rank,
            "with --expert-parallel: expert copies each EP rank holds; above experts / N, live EPLB places "
            "copies of hot experts (0 = off)");
  flags.add("--eplb-interval", &opt.eplb.interval_rounds, "live EPLB: MoE rounds between plans");
  flags.add("--dual-batch-overlap", &opt.dual_batch_overlap,
            "with --expert-parallel: two micro-batches per MoE layer, one's dispatch or combine travelling while "
            "the other's experts compute");
  flags.add("--dp-attention", &opt.dp_attention,
            "with --expert-parallel N: the decode ranks form data-parallel groups of N, each rank running attention "
            "for its own requests and serving 1/N of every MoE layer's experts to its group, in lockstep (prefill "
            "ranks keep their expert processes)");
  flags.add("--decode-processes", &opt.decode_processes,
            "run this many decode ranks as separate `baton node` processes (KV over UCX) instead of in-process; "
            "with --serve one that ends is started again");
  flags.add("--ignore-eos", &opt.ignore_eos, "generate max-tokens even past <eos>");
  flags.add("--serve", &opt.serve, "serve clients until SIGINT/SIGTERM instead of answering sample prompts");
  flags.add("--router-listen", &opt.router_listen, "--serve: publish the router on HOST:PORT (port 0: any free port)");
  flags.add("--cluster-listen", &opt.cluster_listen,
            "--serve: publish the node directory on HOST:PORT for `baton node` processes to join");
  flags.add("--http-listen", &opt.http_listen, "--serve: an OpenAI-compatible HTTP gateway on HOST:PORT");
  flags.add("--drain-timeout-ms", &opt.drain_timeout_ms,
            "--serve: on SIGINT/SIGTERM, take no new requests and wait this long for those in progress");
  add_security_flags(flags, &opt.sec);
  flags.add("--max-active-requests", &opt.cluster.router.max_active_requests,
            "admission control: requests in flight at most, more are refused (HTTP 429); 0 = no limit");
  flags.add("--kv-queue-max-bypass", &opt.cluster.decode_balancer.kv_queue_max_bypass,
            "the KV queue's backfill: later requests that fit may pass one that fits no decode rank this many times "
            "before it keeps room on one (0: strict arrival order)");
  flags.add("--queue-timeout-ms", &opt.cluster.router.request.queue_timeout_ms,
            "an admitted request waits this long, in arrival order, for a decode rank with room for its KV, then "
            "is refused (HTTP 503); lower it to shed load sooner");
  flags.add("--api-key", &opt.api_keys, "--serve: an API key the gateway accepts as a bearer token (repeatable; also BATON_API_KEYS, comma-separated; it guards HTTP only: keep --router-listen and --cluster-listen private, or use --tls-*)");
  flags.add("--api-keys-file", &opt.api_keys_file, "--serve: a JSON file of named API keys with limits of their own (README, Serving several teams)");
  flags.add("--first-token-timeout-ms", &opt.gateway.first_token_timeout_ms,
            "--http-listen: a call's wait for its first token before 504 (later tokens: --token-timeout-ms)");
  flags.add("--router-silence-ms", &opt.gateway.router_silence_ms,
            "--http-listen: the router not answering the gateway's probe this long: new calls get 503 at once until it "
            "answers (0: not watched)");
  flags.add("--stream-keepalive-ms", &opt.gateway.stream_keepalive_ms,
            "--http-listen: a streaming call without its first token this long gets its 200 head and a comment line "
            "this often, so proxies do not cut it as idle (0: nothing before the first token)");
  flags.add("--idle-timeout-ms", &opt.gateway.idle_timeout_ms, "--http-listen: a connection idle this long is closed");
  flags.add("--max-connections", &opt.gateway.max_connections, "--http-listen: connections beyond this are answered 503");
  flags.add("--cors-origin", &opt.gateway.cors_origins,
            "--http-listen: a browser origin (https://host[:port], or *) whose pages may call the API (repeatable)");
  flags.add("--served-model-name", &opt.gateway.served_model_name,
            "--http-listen: the model's id in the API (default: the model's own name); NAME,ALIAS,...: calls may "
            "name it by any, answered under the name they gave (vLLM's list)");
  flags.add("--log-requests", &opt.gateway.log_requests,
            "--http-listen: a line per call as it ends (its id, status, time; each generation's request, ranks, tokens "
            "and stage times)");
  flags.add("--max-body-bytes", &opt.gateway.limits.max_body_bytes,
            "--http-listen: request bodies larger than this are answered 413");
  flags.add("--max-stream-backlog-bytes", &opt.gateway.max_stream_backlog_bytes,
            "--http-listen: a streaming client that lets more than this wait unread is dropped (499)");
  flags.add("--max-total-backlog-bytes", &opt.gateway.max_total_backlog_bytes,
            "--http-listen: answers waiting unread for all clients together; past it, a stream with more than 1 MiB "
            "unread is dropped (499)");
  flags.add("--max-tokens-limit", &opt.cluster.router.max_new_tokens_limit,
            "the most tokens one request may ask to generate; 0 = the model's context");
  flags.add("--default-max-tokens", &opt.cluster.router.default_max_tokens,
            "max_tokens of a request that gives none (OpenAI chat): what the context leaves, at most this (when not "
            "given: the model's generation_config.json max_new_tokens, else 4096); 0 = no cap");
  if (auto rc = flags.parse_command_line(args, "local", "baton local [flags]")) return *rc;
  if (auto e = store::capacity_gib_error(opt.cluster.store.capacity_gib, "--store-capacity-gib"); !e.empty()) {
    std::fprintf(stderr, "baton local: %s\n", e.c_str());
    return 2;
  }
  if (opt.cluster.store.capacity_gib > 0 && opt.cluster.store.dir.empty()) {
    std::fprintf(stderr, "baton local: --store-capacity-gib budgets the block files under --store-dir, and none is given "
                         "(a store node takes its own: baton node --role store --store-capacity-gib)\n");
    return 2;
  }
  if (opt.max_tokens > static_cast<uint32_t>(INT32_MAX)) {  // a request's max_tokens is an int32: 4294967295 became -1
    std::fprintf(stderr, "baton local: --max-tokens must be at most 2147483647, got %u\n", opt.max_tokens);
    return 2;
  }
  opt.cluster.backend.cuda_bf16 = !cuda_fp32;
  if (auto e = kv_wire.empty() ? std::string{} : opt.cluster.router.request.kv_wire.parse(kv_wire); !e.empty()) {
    std::fprintf(stderr, "baton local: --kv-wire: %s\n", e.c_str());
    return 2;
  }
  if (!opt.chat_template.empty() && (opt.model == "random" || opt.model.rfind("deepseek-", 0) == 0)) {
    std::fprintf(stderr, "baton local: --chat-template needs a model directory with a tokenizer (--model %s has none)\n",
                 opt.model.c_str());
    return 2;
  }
  if (opt.model != "random") {
    std::string why;
    const uint32_t default_max_tokens = opt.cluster.router.default_max_tokens;
    if (!load_model_into(opt.model, &opt.cluster, &why)) {
      std::fprintf(stderr, "baton local: %s\n", why.c_str());
      return 2;
    }
    if (!opt.chat_template.empty()) {
      auto tok = gpu::load_model_tokenizer(opt.model, opt.cluster.model, &why, opt.chat_template);
      if (!tok) {
        std::fprintf(stderr, "baton local: %s\n", why.c_str());
        return 2;
      }
      opt.cluster.router.tokenizer = std::move(tok);
    }
    // The model's generation_config.json may set the default cap; the flag, given, is the operator's word.
    if (flags.given("--default-max-tokens")) opt.cluster.router.default_max_tokens = default_max_tokens;
  }
  opt.cluster.prefill.event_log_events = opt.cluster.decode.event_log_events = opt.event_log_events;
  opt.cluster.store.enabled = !opt.cluster.store.dir.empty() || !opt.store_nodes.empty();
  if (opt.cluster.store.dir.empty()) opt.cluster.store.num_servers = 0;  // only store nodes' servers
  // Without a store, prompts are still cut into keyed blocks, so that each prefill rank's own
  // tier serves a prefix it computed before (a shared system prompt is computed once per rank).
  // Its blocks are smaller than a store's (64 tokens, not 512: no file per block, and a hit is
  // counted in whole blocks), unless --block-tokens says.
  opt.cluster.store.local_tier_only = !opt.cluster.store.enabled && opt.cluster.prefill.prefix_cache_blocks > 0;
  if (!flags.given("--block-tokens"))
    if (const uint32_t page = opt.cluster.executor.page_size_tokens; page > 0) {
      if (opt.cluster.store.local_tier_only) opt.cluster.store.block_tokens = (64 + page - 1) / page * page;
      // A model of a short context (the built-in one's is 256 tokens) gets blocks a quarter of
      // it, so that its prompts fill some; the store's 512 suits models of thousands.
      const uint32_t quarter = std::max(page, opt.cluster.model.max_position_embeddings / 4 / page * page);
      opt.cluster.store.block_tokens = std::min(opt.cluster.store.block_tokens, quarter);
      // A context too short for a page and a token: no prefix tier to key for (a store is refused).
      if (opt.cluster.store.block_tokens + 2 > opt.cluster.model.max_position_embeddings)
        opt.cluster.store.local_tier_only = false;
    }
  if (std::string why; !opt.cluster.store.dir.empty() && (!ensure_writable_dir(opt.cluster.store.dir, "--store-dir", &why) ||
                                                         !hold_store_dir(opt.cluster.store.dir, "--store-dir", &why))) {
    std::fprintf(stderr, "baton local: %s\n", why.c_str());
    return 2;
  }
  if (auto e = opt.sec.validate(); !e.empty()) {
    std::fprintf(stderr, "baton local: %s\n", e.c_str());
    return 2;
  }
  if (opt.repeat == 0) {
    std::fprintf(stderr, "baton local: --repeat must be >= 1\n");
    return 2;
  }
  if (!opt.profile.empty()) {
    executor_profile prof;
    std::string why;
    if (!read_profile(opt.profile, &prof, &why)) {
      std::fprintf(stderr, "baton local: %s\n", why.c_str());
      return 2;
    }
    opt.cluster.prefill.cost = opt.cluster.prefill_balancer.cost = prof.prefill;
  }
  if (opt.dp_attention && opt.expert_parallel < 2) {
    std::fprintf(stderr, "baton local: --dp-attention groups decode ranks by --expert-parallel N: it needs N >= 2\n");
    return 2;
  }
  if (opt.expert_parallel > 1) {
    std::string why;
    if (opt.cluster.model.moe.n_routed_experts == 0)
      why = "--expert-parallel needs a model with routed experts (" + opt.cluster.model.name + " has none)";
    else if (opt.cluster.backend.kind != "cpu")
      why = "--expert-parallel runs on the CPU executor only so far";
    else if (opt.eplb.slots_per_rank)
      why = policies::eplb_config{opt.expert_parallel, opt.expert_parallel, opt.eplb.slots_per_rank}.validate(
          opt.cluster.model.moe.n_routed_experts);
    if (why.empty() && opt.dp_attention &&
        (opt.decode_processes > 0 || opt.cluster.num_decode_ranks == 0 ||
         opt.cluster.num_decode_ranks % opt.expert_parallel != 0))
      why = "--dp-attention groups the in-process decode ranks by --expert-parallel: it needs --decode-ranks a "
            "multiple of " + std::to_string(opt.expert_parallel) + " (not " + std::to_string(opt.cluster.num_decode_ranks) +
            ") and no --decode-processes";
    if (why.empty() && opt.expert_parallel > opt.cluster.model.moe.n_routed_experts)
      why = "--expert-parallel " + std::to_string(opt.expert_parallel) + " exceeds the model's " +
            std::to_string(opt.cluster.model.moe.n_routed_experts) + " routed experts";
    if (!why.empty()) {
      std::fprintf(stderr, "baton local: %s\n", why.c_str());
      return 2;
    }
  }
  opt.cluster.router.request.single_token_prefill_only = !opt.one_token_via_decode;
  // A call that waits out the gateway's first-token time gets a 504 that cannot say why; the
  // queue gives up first instead, with a 503 naming the KV it waited for (and Retry-After).
  // (Less a twentieth, at most 1 s: the gateway's clock starts before admission and CHECK.)
  if (const auto first = opt.gateway.first_token_timeout_ms;
      !flags.given("--queue-timeout-ms") && first <= opt.cluster.router.request.queue_timeout_ms)
    opt.cluster.router.request.queue_timeout_ms = std::max(1u, first - std::min(first / 20, 1000u));
  else if (!opt.http_listen.empty() && first > 0 && opt.cluster.router.request.queue_timeout_ms >= first)
    std::fprintf(stderr, "baton local: warning: --queue-timeout-ms %u is not shorter than --first-token-timeout-ms %u: "
                         "an HTTP call still waiting for KV room gets a 504 from the gateway first, not the queue's 503 "
                         "that says why\n", opt.cluster.router.request.queue_timeout_ms, first);
  // One decode rank per process: --decode-ranks beside it would be dropped without a word.
  if (opt.decode_processes > 0 && flags.given("--decode-ranks") && opt.cluster.num_decode_ranks != opt.decode_processes) {
    std::fprintf(stderr, "baton local: --decode-processes %u runs one decode rank in each process: leave --decode-ranks "
                         "out (it said %u)\n", opt.decode_processes, opt.cluster.num_decode_ranks);
    return 2;
  }
  if (opt.decode_processes > 0) opt.cluster.num_decode_ranks = 0;  // they join from their own processes
  if (opt.decode_processes > 0 || !opt.cluster_listen.empty()) opt.cluster.transport = "ucx";  // loopback cannot cross processes
  if (opt.cluster.num_decode_ranks == 0 && opt.decode_processes == 0 && opt.cluster_listen.empty()) {
    std::fprintf(stderr, "baton local: need --decode-ranks >= 1, --decode-processes >= 1 or --cluster-listen\n");
    return 2;
  }
  if (opt.cluster.num_prefill_ranks == 0 && opt.cluster_listen.empty()) {  // prefill nodes join through it
    std::fprintf(stderr, "baton local: need --prefill-ranks >= 1 or --cluster-listen\n");
    return 2;
  }
  std::vector<std::pair<std::string, uint16_t>> store_addrs;
  for (const auto& a : opt.store_nodes) {
    std::string host, why;
    uint16_t port = 0;
    if (!parse_host_port(a, "--store-node", &host, &port, &why) || port == 0) {
      std::fprintf(stderr, "baton local: %s\n", why.empty() ? "--store-node needs a non-zero port" : why.c_str());
      return 2;
    }
    store_addrs.emplace_back(host, port);
  }
  opt.cluster.remote_store_hosts.resize(store_addrs.size());  // connected below; counted by validate()
  if (auto err = opt.cluster.validate(); !err.empty()) {
    std::fprintf(stderr, "baton local: %s\n", err.c_str());
    return 2;
  }
  if (!store_addrs.empty() && !opt.serve) {
    std::fprintf(stderr, "baton local: --store-node needs --serve\n");
    return 2;
  }
  // Checked here, not per request once the model has loaded (the router refuses the same).
  if (!(opt.temperature >= 0.0f) || !std::isfinite(opt.temperature)) {
    std::fprintf(stderr, "baton local: --temperature must be a finite number >= 0 (0: greedy), got %g\n",
                 static_cast<double>(opt.temperature));
    return 2;
  }
  // Flags that only a serving head uses were once ignored without a word: the prompts ran and the
  // process exited, listening nowhere.
  for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--router-listen", &opt.router_listen},
                                    {"--cluster-listen", &opt.cluster_listen},
                                    {"--http-listen", &opt.http_listen}})
    if (!value->empty() && !opt.serve) {
      std::fprintf(stderr, "baton local: %s needs --serve (without it, baton local answers its prompts and exits)\n", flag);
      return 2;
    }
  // The modelled link moves no bytes (sims time transfers on it): a real cluster on it fails
  // every request's KV check.
  if (opt.cluster.transport == "modelled") {
    std::fprintf(stderr, "baton local: --transport modelled moves no KV (it is the sims' timing model): use loopback or ucx\n");
    return 2;
  }

  // Every address this head listens on, free before anything starts: a head that adopted the
  // store nodes (each stops its block server for the newcomer) or met its nodes and only then
  // failed to bind took a running cluster's store down with it (a second launch of one).
  for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--router-listen", &opt.router_listen},
                                    {"--cluster-listen", &opt.cluster_listen},
                                    {"--http-listen", &opt.http_listen}}) {
    std::string host, why;
    uint16_t port = 0;
    if (value->empty() || !parse_host_port(*value, flag, &host, &port, &why) || port == 0) continue;
    if (why = why_cannot_bind(host, port); !why.empty()) {
      std::fprintf(stderr, "baton local: cannot listen on %s %s: %s (another head running there?); nothing was started\n",
                   flag, value->c_str(), why.c_str());
      return 1;
    }
  }

  caf::actor_system_config cfg;
  register_message_types(cfg);
  const unsigned threads = opt.scheduler_threads ? opt.scheduler_threads : std::max(2u, std::thread::hardware_concurrency());
  cfg.set("scheduler.max-threads", threads);
  // The default work-stealing policy sleeps 50 us between polls in its "moderate" phase, which
  // adds ~100 us to every hop onto an idle worker (platform-notes §1.4).
  cfg.set("work-stealing.moderate-poll-attempts", opt.poll_attempts);
  cfg.set("logger.console-verbosity", caf::atom("quiet"));
  if (opt.decode_processes > 0 || opt.serve) {
    cfg.load<caf::io::middleman>();
    apply_net_security(cfg, opt.sec);
  }
  caf::actor_system sys{cfg};

  const auto& m = opt.cluster.model;
  // Decode ranks in processes of their own are counted with where they run (they join later).
  const std::string decode_ranks =
      opt.decode_processes > 0 ? std::to_string(opt.decode_processes) + " decode (one per process)"
                               : std::to_string(opt.cluster.num_decode_ranks) + " decode";
  std::printf("baton local: model %s (%u layers, hidden %u, %.2fM parameters, tokenizer %s), %u prefill + %s "
              "ranks%s, executor %s each\n",
              m.name.c_str(), m.num_hidden_layers, m.hidden_size, static_cast<double>(m.num_parameters()) / 1e6,
              opt.cluster.router.tokenizer ? opt.cluster.router.tokenizer->describe().c_str() : "bytes",
              opt.cluster.num_prefill_ranks, decode_ranks.c_str(),
              opt.cluster.num_elastic_ranks
                  ? (" + " + std::to_string(opt.cluster.num_elastic_ranks) + " elastic (" +
                     std::to_string(opt.cluster.elastic_prefill_at_start) + " prefill at start)").c_str()
                  : "",
              opt.cluster.backend.kind == "cuda"
                  ? (std::string{"cuda "} + (opt.cluster.backend.cuda_bf16 ? "bf16" : "fp32") + " (ranks in turn on the " +
                     std::to_string(gpu::visible_cuda_devices()) + " device(s) this process sees)")
                        .c_str()
                  : (std::to_string(opt.cluster.executor.num_threads) + " CPU thread(s)").c_str());
  // Store nodes start before the head (the launcher's order); still, keep trying for a while.
  for (size_t i = 0; i < store_addrs.size(); ++i) {
    const auto& [host, port] = store_addrs[i];
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{opt.store_node_wait_s};
    for (;;) {
      auto h = connect_actor<store_host_actor>(sys, opt.sec, host, port);
      if (h) {
        opt.cluster.remote_store_hosts[i] = *h;
        break;
      }
      if (std::chrono::steady_clock::now() > deadline || stop_requested()) {
        std::fprintf(stderr, "baton local: cannot reach the store node at %s:%u within %u s: %s\n", host.c_str(),
                     static_cast<unsigned>(port), opt.store_node_wait_s,
                     explain_connect_error(sys, h.error(), opt.sec.tls()).c_str());
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{200});
    }
  }
  // A store node that dies and comes back (restarted by hand or by `baton launch
  // --restart-failed`) is adopted again at the same address, its blocks served from its disk.
  opt.cluster.reconnect_store_host = [&sys, sec = opt.sec, store_addrs](size_t i) -> caf::expected<store_host_actor> {
    if (i >= store_addrs.size()) return make_error(errc::bad_request, "no store node " + std::to_string(i));
    const auto& [host, port] = store_addrs[i];
    // First a bounded TCP connect of our own: CAF's middleman connects blocking, on its one
    // thread, so a host that drops packets (powered off, cut off) would stall it for the kernel's
    // SYN timeout (about 2 minutes) on every try -- and every other connect of this process with it.
    if (!tcp_listening(host, port, 2000))
      return make_error(errc::rank_unavailable, host + ":" + std::to_string(port) +
                                                    ": nothing accepts a TCP connection there (refused, or no answer within 2 s: the node is down or "
                                                    "unreachable)");
    auto h = connect_actor<store_host_actor>(sys, sec, host, port);
    if (h) return h;
    return make_error(errc::rank_unavailable, host + ":" + std::to_string(port) + ": " +
                                                  explain_connect_error(sys, h.error(), sec.tls()));
  };
  // Stamped as the request log's lines: a node's death lines up with the calls it cut.
  opt.cluster.store_log = [](const std::string& line) {
    std::printf("%s baton local: %s\n", utc_stamp().c_str(), line.c_str());
    std::fflush(stdout);
  };
  opt.cluster.node_log = opt.cluster.store_log;
  executor_factory make_exec;
  // Engines with expert shards of their own: a lost shard is started afresh (the rank steps
  // aside meanwhile). Declared after the actor system, so it stops first: no shard is started
  // while the ranks are being stopped.
  std::unique_ptr<expert_group_keeper> keeper;
  if (opt.expert_parallel > 1) {
    keeper = std::make_unique<expert_group_keeper>("baton local");
    // Each engine (rank) gets its own expert processes; its largest job bounds the all-to-all slots.
    const auto& c = opt.cluster;
    auto weights = c.weights ? c.weights : std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(c.model, c.weights_seed));
    // Data-parallel attention: the decode ranks' group members, by rank name, with their index
    // (rank i is member i % EP of group i / EP).
    std::map<std::string, std::pair<std::shared_ptr<gpu::expert_peers>, uint32_t>> dp;
    std::vector<std::string> dp_names;
    const gpu::peer_group_config dp_group{.slot_bytes = engine_slot_bytes(c.model, c.prefill, c.decode),
                                          .dual_batch = opt.dual_batch_overlap};
    if (opt.dp_attention) {
      for (uint32_t i = 0; i < c.num_decode_ranks; ++i) dp_names.push_back(c.decode.name + "-" + std::to_string(i));
      std::string why;
      const auto members =
          make_dp_attention_groups(dp_names, opt.expert_parallel, c.model, dp_group, opt.eplb, c.ucx_send, &why);
      if (members.empty()) {
        std::fprintf(stderr, "baton local: data-parallel attention: %s\n", why.c_str());
        return 1;
      }
      for (uint32_t i = 0; i < dp_names.size(); ++i) dp[dp_names[i]] = {members[i], i};
    }
    make_exec = [&opt, weights, dp, dp_names, dp_group, k = keeper.get()](const std::string& rank) -> std::shared_ptr<gpu::executor> {
      const auto& c = opt.cluster;
      if (auto it = dp.find(rank); it != dp.end()) {
        auto ec = c.executor;
        ec.peers = it->second.first;
        std::shared_ptr<gpu::executor> exec = gpu::make_cpu_executor(c.model, weights, ec);
        // A group that broke (a member stalled past the step timeout) is made afresh in place.
        const uint32_t ep = opt.expert_parallel, i = it->second.second, g = i / ep;
        const std::vector<std::string> group_names(dp_names.begin() + g * ep, dp_names.begin() + (g + 1) * ep);
        k->add_dp_member("dp" + std::to_string(g), i % ep, ep, exec,
                         [group_names, ep, model = c.model, dp_group, eplb = opt.eplb, ucx = c.ucx_send](std::string* why) {
                           return make_dp_attention_groups(group_names, ep, model, dp_group, eplb, ucx, why);
                         });
        return exec;
      }
      std::string why;
      expert_spawn spawn;
      spawn.model_arg = opt.model;
      spawn.weights_seed = c.weights_seed;
      spawn.size = opt.expert_parallel;
      spawn.slot_bytes = engine_slot_bytes(c.model, c.prefill, c.decode);
      spawn.name = rank;
      spawn.dual_batch = opt.dual_batch_overlap;
      auto group = spawn_expert_group(spawn, c.model, &why);
      if (!group) {
        std::fprintf(stderr, "baton local: %s: %s\n", rank.c_str(), why.c_str());
        return gpu::make_refusing_executor(c.model, c.executor, rank + ": expert parallelism could not start: " + why);
      }
      if (opt.eplb.slots_per_rank && !group->enable_eplb(opt.eplb, c.model.moe.n_routed_experts, &why)) {
        std::fprintf(stderr, "baton local: %s: %s\n", rank.c_str(), why.c_str());
        return gpu::make_refusing_executor(c.model, c.executor, rank + ": " + why);
      }
      auto ec = c.executor;
      ec.experts = std::move(group);
      std::shared_ptr<gpu::executor> exec = gpu::make_cpu_executor(c.model, weights, ec);
      k->add(exec, spawn, c.model, opt.eplb);
      return exec;
    };
  }
  opt.cluster.elastic.print_moves = opt.serve;  // a serving head's operator sees each move as it happens
  // Serving, placements are said in the calls' log lines (a trial saw --serve print none).
  if (opt.serve && opt.explain) opt.gateway.log_requests = opt.gateway.log_placements = true;
  auto cluster = start_local_cluster(sys, opt.cluster, make_exec);
  if (!cluster.setup_error.empty()) {
    std::fprintf(stderr, "baton local: %s\n", cluster.setup_error.c_str());
    return 1;
  }
  if (!store_addrs.empty())
    std::printf("baton local: %zu store node(s) adopted: block servers %u..%zu live in their processes\n",
                store_addrs.size(), opt.cluster.store.num_servers, opt.cluster.store.num_servers + store_addrs.size() - 1);
  // Every way out stops the cluster's actors: the actor system's end waits for them, so a return
  // that left them running (a port already taken, a decode process that did not join) hung.
  struct cluster_stopper {
    const local_cluster& cluster;
    ~cluster_stopper() {
      for (auto& a : cluster.actors()) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    }
  } stop_cluster{cluster};
  caf::scoped_actor self{sys};

  std::vector<pid_t> children;
  std::vector<std::vector<std::string>> child_argv;  // decode process i's command line
  struct reaper {
    std::vector<pid_t>& pids;
    ~reaper() { stop_processes(pids); }
  } reap{children};
  if (opt.decode_processes > 0) {
    auto port = publish_actor(sys, opt.sec, cluster.directory, 0, "127.0.0.1");
    if (!port) {
      std::fprintf(stderr, "baton local: cannot publish the node directory: %s\n", sys.render(port.error()).c_str());
      return 1;
    }
    for (uint32_t i = 0; i < opt.decode_processes; ++i) {
      std::string why;
      const auto& e = opt.cluster.executor;
      std::vector<std::string> argv = {self_executable(), "node", "--role", "decode", "--name", "decode-" + std::to_string(i),
                                       "--connect", "127.0.0.1:" + std::to_string(*port), "--kv-pages",
                                       std::to_string(e.num_kv_pages), "--page-tokens", std::to_string(e.page_size_tokens),
                                       "--executor-threads", std::to_string(e.num_threads), "--executor",
                                       opt.cluster.backend.kind, "--weights-seed",
                                       std::to_string(opt.cluster.weights_seed), "--poll-attempts",
                                       std::to_string(opt.poll_attempts), "--model", opt.model,
                                       "--cluster-id", opt.sec.cluster_id, "--expert-parallel",
                                       std::to_string(opt.expert_parallel), "--ucx-send", opt.cluster.ucx_send,
                                       "--max-batch-size", std::to_string(opt.cluster.decode.max_batch_size),
                                       "--speculative-tokens", std::to_string(opt.cluster.decode.speculative_tokens),
                                       "--speculative-max-batch", std::to_string(opt.cluster.decode.speculative_max_batch),
                                       "--prompt-lookup-min", std::to_string(opt.cluster.decode.prompt_lookup_min),
                                       "--prompt-lookup-max", std::to_string(opt.cluster.decode.prompt_lookup_max)};
      if (opt.dual_batch_overlap) argv.push_back("--dual-batch-overlap");
      if (opt.eplb.slots_per_rank)
        argv.insert(argv.end(), {"--eplb-slots", std::to_string(opt.eplb.slots_per_rank), "--eplb-interval",
                                 std::to_string(opt.eplb.interval_rounds)});
      if (opt.sec.tls())
        argv.insert(argv.end(), {"--tls-cert", opt.sec.tls_cert, "--tls-key", opt.sec.tls_key, "--tls-ca", opt.sec.tls_ca});
      if (cuda_fp32) argv.push_back("--cuda-fp32");
      auto pid = spawn_process(argv, &why);
      if (pid < 0) {
        std::fprintf(stderr, "baton local: %s\n", why.c_str());
        return 1;
      }
      children.push_back(pid);
      child_argv.push_back(std::move(argv));
    }
    // Wait (bounded) until every decode process has registered with the balancer.
    // One that exited (a bad flag, no memory, UCX refusing) is said at once, by its pid; its
    // own output says why.
    size_t joined = 0;
    for (int i = 0; i < 300 && joined < opt.decode_processes; ++i) {
      self->request(cluster.decode_balancer, std::chrono::seconds{5}, stats_atom::value)
          .receive([&](std::vector<rank_load>& loads) { joined = loads.size(); }, [](caf::error&) {});
      if (joined >= opt.decode_processes) break;
      for (size_t c = 0; c < children.size(); ++c)
        if (std::string how; process_gone(children[c], &how)) {
          std::fprintf(stderr, "baton local: decode process %zu (pid %d) ended before it joined (%s); its output says why\n",
                       c, static_cast<int>(children[c]), how.c_str());
          return 1;
        }
      std::this_thread::sleep_for(std::chrono::milliseconds{100});
    }
    if (joined < opt.decode_processes) {
      std::fprintf(stderr, "baton local: only %zu of %u decode processes joined within 30 s\n", joined,
                   opt.decode_processes);
      return 1;
    }
    std::printf("baton local: %u decode process(es) joined over 127.0.0.1:%u, KV over UCX\n", opt.decode_processes,
                static_cast<unsigned>(*port));
  }

  // Up means every rank takes work: the first requests would otherwise all go to whichever rank
  // reported to its balancer first.
  if (auto missing = await_ranks_registered(sys, cluster.router, cluster.rank_names(), std::chrono::seconds{120});
      !missing.empty()) {
    std::string names;
    for (const auto& n : missing) names += " " + n;
    std::fprintf(stderr, "baton local: ranks not registered with their balancers within 120 s:%s\n", names.c_str());
    return 1;
  }
  if (opt.serve) return serve(sys, cluster, opt, children, child_argv);

  return answer_sample_prompts(sys, cluster, opt);
}

}  // namespace baton::deploy

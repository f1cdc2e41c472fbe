#pragma once

// The typed configuration of the actor layer: one struct per component, defaults written once,
// units in the names, validate() returns an empty string or a sentence naming the bad field.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "policies/cost_model.hpp"
#include "policies/decode_placement.hpp"
#include "policies/placement.hpp"
#include "policies/prefill_placement.hpp"
#include "policies/role_planner.hpp"
#include "store/block_index.hpp"
#include "gpu/tokenizer.hpp"
#include "transport/kv_wire.hpp"

namespace baton {

/// The built-in model's prefill cost on one CPU executor thread, as `baton profile` measured it
/// (deploy/profiles/cpu_builtin_1thread.json; held-out error 1.7% mean). Run `baton profile`
/// on your machine and pass the file to use your own.
inline policies::cost_model builtin_cpu_cost_model() { return {0.2205, 0.4303, 105.0, 1262.0}; }

struct prefill_rank_config {
  std::string name = "prefill-0";
  uint32_t event_log_events = 65536;  ///< recent rank events kept for `events` (diagnostics, tests)
  /// Elastic P/D: start on standby (no load reports, so no placements) until told role(true).
  bool standby = false;
  /// Chunk size cap in tokens; with step_budget_us = 0, every chunk has exactly this size.
  uint32_t chunk_tokens = 64;
  /// A scored prompt's (prefill_order::prompt_logprobs) chunks are at most this long: each of
  /// their rows brings its logits to the host, a vocabulary of floats per row.
  uint32_t score_chunk_tokens = 256;
  /// Seed 000 §3.1 level 4: each chunk is the largest whose predicted cost fits this budget
  /// (chunks shrink as the context grows). 0 = fixed chunk_tokens.
  uint32_t step_budget_us = 0;
  policies::cost_model cost = builtin_cpu_cost_model();
  /// Priority classes: a batch prompt waits behind at most this many interactive ones.
  uint32_t batch_max_bypass = 4;
  /// The rank-local prefix tier (with the store on): full prompt blocks kept in this rank's KV
  /// pages after their prompt, shared by later prompts with the same prefix; 0 = off.
  uint32_t prefix_cache_blocks = 64;
  /// With the local tier on: a waiting prompt whose leading blocks a prompt computing on this
  /// rank will add to the tier waits for it, and shares them, instead of computing them too (a
  /// burst of prompts with one prefix computes it once). false: each computes its own.
  bool share_in_flight_prefix = true;
  /// Seed 000 §2.3: compute while a cached prefix streams in from the store, each layer waiting
  /// only for that layer of the prefix (false: load the whole prefix, then compute).
  bool overlap_prefix_load = true;
  uint32_t kv_send_timeout_ms = 2000;   ///< a layer's put pending longer than this fails the request
  /// Checksum every shipped layer for the decode rank to verify. Off only where the KV is not
  /// real (sims' modelled executors), together with decode_rank_config::verify_kv_checksums.
  bool checksum_kv = true;
  uint32_t poll_interval_us = 100;      ///< how often pending puts are polled
  /// Split prefill: a part whose peers have not all found it this long after it started (an
  /// earlier part sent no KV, a later part never said where its pages are) fails, naming them.
  /// A backstop, longer than request_config::prefill_timeout_ms: a part that fails stops the
  /// others, and so does a request that gives up, so this fires only for a part orphaned with
  /// nobody left to say so (its request and a peer's rank both gone).
  uint32_t split_wait_ms = 120000;
  /// Pages a put was given up into, unsettled, are held out of reuse this long (as a decode
  /// rank's kv_quarantine_ms): no transport can cancel a posted put, which may still land. A
  /// later part of a split prompt that failed holds its pages for twice the earlier parts' send
  /// timeout (each posted put settles or is given up by then), or this long when an earlier part
  /// said it gave one up (split_abort::abandoned); a prompt whose store read ended unanswered, or
  /// whose server gave a put up, holds the pages it named at least this long.
  uint32_t late_put_quarantine_ms = 60000;
  /// The model's vocabulary as constrained decoding walks it (gpu::tokenizer::vocabulary); null:
  /// the built-in byte model's.
  std::shared_ptr<const gpu::token_vocabulary> vocabulary;

  std::string validate() const {
    if (name.empty()) return "prefill rank name must not be empty";
    if (chunk_tokens == 0) return "prefill chunk_tokens must be >= 1";
    if (score_chunk_tokens == 0) return "prefill score_chunk_tokens must be >= 1";
    // 0 would let no interactive prompt pass a waiting batch one: batch work first, the reverse
    // of the classes' order.
    if (batch_max_bypass == 0)
      return "prefill batch_max_bypass must be >= 1 (0 would put batch prompts before interactive ones)";
    if (step_budget_us > 0 && !cost.usable())
      return "prefill step_budget_us needs a usable cost model (alpha, beta, delta >= 0, gamma > 0)";
    if (kv_send_timeout_ms == 0) return "prefill kv_send_timeout_ms must be >= 1";
    if (split_wait_ms == 0) return "prefill split_wait_ms must be >= 1";
    return {};
  }
};

/// The KV block store (store/, seed 000 §2.2): block servers, the index, retention.
struct store_config {
  bool enabled = false;
  std::string dir;                    ///< block server i keeps its files in <dir>/server-<i>
  uint32_t num_servers = 1;           ///< in-process servers; the key space is shared by consistent hashing
  uint32_t index_shards = 1;          ///< block index actors; a key's shard is its hash mod this
  uint32_t replicas = 1;              ///< copies of each block (1 or 2)
  uint32_t block_tokens = 512;        ///< B: a multiple of the KV page size
  uint64_t capacity_blocks = 0;       ///< index capacity; 0 = unbounded (leaf-first LRU beyond it)
  /// The disk budget of `dir` (`--store-capacity-gib`), split evenly over its num_servers: each
  /// server deletes its least recently used block files to stay within its share. Store nodes
  /// take their own budget. 0 = unbounded.
  double capacity_gib = 0.0;
  store::retention_policy retention;  ///< chat 7 d, agent 3 d, batch not written
  uint32_t housekeeping_interval_ms = 60000;  ///< expiry and eviction run this often
  /// A store node whose server went down is tried this often until it is adopted again.
  uint32_t readopt_interval_ms = 1000;
  /// Each store node's server is probed this often; one that leaves a probe unanswered for
  /// missed_probes intervals is given up as hung or cut off (store_keeper.hpp). 0: no probes (a hung
  /// node then costs each read and write-back its timeout until TCP gives up on the link).
  uint32_t probe_interval_ms = 1000;
  uint32_t missed_probes = 3;
  uint32_t read_timeout_ms = 5000;    ///< a read not answered by then is a miss (recompute)
  /// A write-back's request for a server's write slot not answered by then: that block is not
  /// written to that server (a miss later). Apart from read_timeout_ms: a short read budget keeps
  /// prompts from waiting on slow disks, but need not drop blocks on a busy server.
  uint32_t write_slot_timeout_ms = 5000;
  /// A block server's registered buffers (one for reads, one of write slots); 0: sized for the
  /// model, 2 whole blocks and at least 64 MiB (a Llama-3-8B block of 512 tokens is 128 MiB of f32).
  uint64_t staging_bytes = 0;
  /// Each decode rank's registered write-back staging; blocks beyond it are dropped (counted).
  /// 0: sized for the model, 4 whole blocks and at least 64 MiB.
  uint64_t max_pending_write_bytes = 0;
  /// With the store off: still key prompts into blocks of block_tokens, so prefill ranks keep
  /// their local prefix tiers and cache_affinity sees the keys (sims, which model no disks yet).
  bool local_tier_only = false;

  /// `remote_servers`: block servers adopted from store nodes, after the in-process ones.
  std::string validate(uint32_t page_size_tokens, size_t remote_servers = 0) const {
    if (auto e = store::capacity_gib_error(capacity_gib, "store capacity_gib"); !e.empty()) return e;
    if (!enabled) return {};
    if (dir.empty() && num_servers > 0) return "store dir must be set when the store has in-process servers";
    if (num_servers + remote_servers == 0) return "store needs at least one block server (num_servers or store nodes)";
    if (index_shards == 0) return "store index_shards must be >= 1";
    if (replicas == 0 || replicas > num_servers + remote_servers)
      return "store replicas must be between 1 and the number of block servers";
    if (block_tokens == 0 || block_tokens % page_size_tokens != 0)
      return "store block_tokens must be a positive multiple of the KV page size (" +
             std::to_string(page_size_tokens) + ")";
    if (housekeeping_interval_ms == 0 || read_timeout_ms == 0 || write_slot_timeout_ms == 0 || readopt_interval_ms == 0)
      return "store intervals (housekeeping_interval_ms, read_timeout_ms, write_slot_timeout_ms, readopt_interval_ms) "
             "must be >= 1 ms";
    if (probe_interval_ms > 0 && missed_probes == 0)
      return "store missed_probes must be >= 1 while probe_interval_ms is set (0 turns probes off)";
    return {};
  }
};

/// How the prefill balancer places prompts (design.md §4).
struct prefill_balancer_config {
  /// seed (4 levels, seed 000 §3.1) | least_loaded | round_robin | cache_affinity (seed 001) |
  /// split (seed 002: long prompts split over several ranks, the rest least-loaded)
  std::string policy = "seed";
  uint32_t split_min_tokens = 1024;  ///< split: prompts with fewer new tokens are not split
  uint32_t split_max_parts = 4;      ///< split: at most this many ranks per prompt
  policies::cost_model cost = builtin_cpu_cost_model();
  policies::bucket_config buckets;
  /// Prefill ranks per engine (DP group), in registration order.
  uint32_t ranks_per_engine = 1;
  /// Compute an engine absorbs per scheduling window; remaining quota = this minus the
  /// predicted time of the work queued on its ranks.
  double engine_quota_us = 1e6;
  /// cache_affinity: a rank whose queue is longer than this loses its affinity.
  uint64_t affinity_max_queued_tokens = 16384;
  uint32_t decision_log_size = 256;  ///< recent decisions kept for `events`
  /// A placement counts as its rank's load until the rank's next report; one no report followed
  /// within this long (its prompt never came: the request failed to reserve KV first) is taken
  /// back. Longer than a placement takes to become an order (reserve waits up to 5 s).
  uint32_t charge_ttl_ms = 30000;
  /// Once every rank has left, placements wait this long for one to come back (a node
  /// restarting, one back from a partition or a stall, a spare taking over), as they wait for room;
  /// after it they are refused at once (rank_unavailable: a 503 with Retry-After), instead of
  /// each waiting out its asker's timeout for nothing.
  uint32_t no_rank_grace_ms = 5000;

  std::string validate() const {
    if (charge_ttl_ms == 0) return "prefill balancer charge_ttl_ms must be >= 1";
    if (!policies::parse_prefill_policy(policy))
      return "prefill balancer policy must be seed, least_loaded, round_robin, cache_affinity or split, got '" +
             policy + "'";
    if (ranks_per_engine == 0) return "prefill balancer ranks_per_engine must be >= 1";
    if (split_max_parts == 0) return "prefill balancer split_max_parts must be >= 1";
    if (auto e = buckets.validate(); !e.empty()) return "prefill balancer " + e;
    if (!cost.usable()) return "prefill balancer cost model is not usable";
    return {};
  }
};

/// How the decode balancer places sequences.
struct decode_balancer_config {
  std::string policy = "seed";  ///< seed (2D, seed 000 §3.2) | least_loaded | round_robin
  policies::decode_2d_config two_d;
  uint32_t page_size_tokens = 16;
  uint32_t decision_log_size = 256;
  /// A placement counts as its rank's load until the rank's next report; one no report followed
  /// within this long (its sequence never came: the request failed or gave up before reserving
  /// KV there) is taken back. Longer than a placement takes to become a reservation.
  uint32_t charge_ttl_ms = 30000;
  /// Once every rank has left, placements wait this long for one to come back (a node
  /// restarting, one back from a partition or a stall, a spare taking over), as they wait for room;
  /// after it they are refused at once (rank_unavailable: a 503 with Retry-After), instead of
  /// each waiting out its asker's timeout for nothing.
  uint32_t no_rank_grace_ms = 5000;
  /// The KV queue: interactive requests go before batch ones, but the oldest batch request is
  /// passed over by at most this many younger interactive ones in a row (as the prefill ranks').
  uint32_t batch_max_bypass = 4;
  /// The KV queue's backfill: a waiting request that fits no rank yet lets requests behind it that
  /// do fit take any rank, until this many have passed it; then it keeps room on the rank nearest
  /// to holding it (none pass it there). 0: strict arrival order (vLLM's), where a long sequence
  /// at the front holds up every short one behind it: on the Mooncake trace's first 600 s
  /// (docs/sims.md) that took seed placement's TTFT p50 from 1.7 s to 67 s at the same
  /// throughput; 512 gave 2.1 s, its longest wait 400 s against strict order's 394 s. Bounded, so
  /// a long sequence is not starved (unbounded, one waited 29 minutes on the whole trace).
  uint32_t kv_queue_max_bypass = 512;
  /// Of each decode rank's KV pages, the share (percent) batch requests leave free for
  /// interactive ones: a batch flood fills the rest, and an interactive request still finds room
  /// at once instead of waiting for a batch sequence to end (sequences keep their pages to the
  /// end: no preemption by priority). 0: none kept.
  uint32_t interactive_reserve_pct = 0;

  std::string validate() const {
    if (charge_ttl_ms == 0) return "decode balancer charge_ttl_ms must be >= 1";
    if (interactive_reserve_pct > 90)
      return "decode balancer interactive_reserve_pct must be at most 90 (batch requests need room too), got " +
             std::to_string(interactive_reserve_pct);
    if (batch_max_bypass == 0)
      return "decode balancer batch_max_bypass must be >= 1 (0 would put batch requests before interactive ones)";
    if (!policies::parse_decode_policy(policy))
      return "decode balancer policy must be seed, least_loaded or round_robin, got '" + policy + "'";
    if (page_size_tokens == 0) return "decode balancer page_size_tokens must be >= 1";
    if (auto e = two_d.validate(); !e.empty()) return e;
    return {};
  }
};

struct decode_rank_config {
  std::string name = "decode-0";
  uint32_t max_batch_size = 64;  ///< sequences in one decode step
  uint32_t event_log_events = 65536;  ///< recent rank events kept for `events` (diagnostics, tests)
  /// Elastic P/D: start on standby (no load reports, so no placements) until told role(true).
  bool standby = false;
  bool verify_kv_checksums = true;  ///< check every landed layer against the sender's checksum
  /// A lease dropped before all its layers landed (released while its prefill still ran, expired,
  /// or a layer failed its checksum) keeps its pages out of the pool until its writers say they
  /// are done (a late put would otherwise land in another request's KV), or at most this long:
  /// a writer that died says nothing, and its puts cannot land.
  uint32_t kv_quarantine_ms = 60000;
  /// Hybrid PD: prompts prefilled on this rank run in chunks of at most this many tokens, one
  /// chunk per decode step (riding in the same batch), so running sequences keep stepping.
  uint32_t local_prefill_chunk_tokens = 256;
  /// Speculative decoding by prompt lookup (vLLM's "ngram" method; gpu/prompt_lookup.hpp): in
  /// each step a sequence whose last tokens occurred earlier in its prompt or answer also runs up
  /// to this many of the tokens that followed them, as drafts, and keeps those the model picks
  /// itself, so one step may give several tokens. The tokens are the ones it gives without (a
  /// pick depends only on its row's logits, which do not depend on what shares the step, and on
  /// (seed, position)). 0 = off. Constrained answers and requests for logits step one token at a
  /// time; executors that cannot pick after every row (CUDA) never speculate.
  uint32_t speculative_tokens = 0;
  /// Drafts run only in steps of at most this many sequences (0: any): a draft's row is nearly
  /// free while a step streams the weights (small batches), and costs its share of compute once
  /// the step is compute-bound -- the CPU executor lost 25% at 8 sequences of the built-in model
  /// (docs/perf.md). vLLM's speculative_disable_by_batch_size, inverted.
  uint32_t speculative_max_batch = 4;
  uint32_t prompt_lookup_min = 2;  ///< shortest n-gram looked up
  uint32_t prompt_lookup_max = 4;  ///< longest n-gram looked up (preferred)
  /// Host memory for preempted sequences, in pages (each page with all its layers): when a KV
  /// reservation finds too few free pages, running sequences are offloaded here (youngest first)
  /// and resumed, bit-identically, when pages free up. 0 = off (the reservation fails instead).
  uint32_t host_offload_pages = 0;
  /// KV allocation. 0: a lease reserves pages for the whole sequence (prompt + max new tokens),
  /// so a running sequence never waits for memory, but a generous max_tokens wastes pages.
  /// N > 0: on demand, as PagedAttention does: a lease reserves the prompt + N tokens, and a
  /// sequence takes a page more each time it crosses into one; when none is free the youngest
  /// running sequence is preempted to host memory (host_offload_pages, required) and resumes,
  /// bit-identically, first in line when pages free up. New leases wait, first come first
  /// served, while fewer than 1% of the pages would stay free (room for the running ones to grow).
  uint32_t on_demand_headroom_tokens = 0;
  /// A reservation that waits for pages (on demand, or while an offload makes room) is refused
  /// after this long (kv_capacity), so its request re-places itself before its own reserve
  /// timeout rather than leaving a grant behind for nobody.
  uint32_t reserve_wait_ms = 3000;
  /// Moving a sequence away (elastic drain): its KV puts not landed this long after they were
  /// posted are given up and the sequence stays (a target that died, a stalled link), so a
  /// move never holds the sequence, its pages and the drain for good.
  uint32_t migrate_send_timeout_ms = 10000;
  /// The rank's first lease id; the next count up from it. 0 (the default): a random 31-bit
  /// high part drawn as the rank starts, then 1, 2, ... below it. A request's attempts are told
  /// apart by (request id, lease id) on prefill ranks (cancels, split parts): with every rank
  /// counting from 1, a failover to another rank (or to the same rank restarted) could reuse an
  /// earlier attempt's pair, and that attempt's late split notices then reached the new one.
  /// Sims set it (each rank its own range) so that their runs repeat.
  uint64_t first_lease_id = 0;
  /// Fault injection, for tests only (0 everywhere else): each landed layer's check waits this
  /// long on the rank's check worker before it runs, as a slow check of a large layer would, so
  /// that a test can free a lease while its layers are still being checked.
  uint32_t fault_check_delay_ms = 0;
  /// As prefill_rank_config::vocabulary.
  std::shared_ptr<const gpu::token_vocabulary> vocabulary;

  std::string validate() const {
    if (name.empty()) return "decode rank name must not be empty";
    if (migrate_send_timeout_ms == 0) return "decode migrate_send_timeout_ms must be >= 1";
    if (reserve_wait_ms == 0) return "decode reserve_wait_ms must be >= 1";
    if (on_demand_headroom_tokens > 0 && host_offload_pages == 0)
      return "decode on_demand_headroom_tokens needs host_offload_pages > 0 (preempted sequences wait there)";
    if (max_batch_size == 0) return "decode max_batch_size must be >= 1";
    if (local_prefill_chunk_tokens == 0) return "decode local_prefill_chunk_tokens must be >= 1";
    if (speculative_tokens > 16) return "decode speculative_tokens must be at most 16, got " + std::to_string(speculative_tokens);
    if (prompt_lookup_min == 0 || prompt_lookup_min > prompt_lookup_max || prompt_lookup_max > 64)
      return "decode prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= 64, got " +
             std::to_string(prompt_lookup_min) + " and " + std::to_string(prompt_lookup_max);
    return {};
  }
};

/// Elastic P/D (issue 15): how the controller moves elastic ranks between the roles.
struct elastic_controller_config {
  uint32_t interval_ms = 1000;         ///< how often signals are read and the planner asked
  uint32_t drain_timeout_ms = 600000;  ///< a drain not done by then is abandoned (the rank serves on)
  /// A decode rank leaving decode moves its running sequences, KV and all, to the other decode
  /// ranks (false: they finish on it first, which can take as long as the longest output).
  bool migrate_on_drain = true;
  /// Print each move's decision and outcome to stdout (a serving head, whose operator watches it).
  bool print_moves = false;
  policies::role_planner_config planner;
};

/// Wire quantisation of the KV handoff per traffic class (design.md §2, issue 6): the prompt's
/// KV travels from prefill to decode rank in this form and is expanded back to fp32 there. f32
/// (the default) sends it as computed. INT8 and INT4 carry 3.8x and 7.1x fewer bytes at the cost
/// of the codec's time on both ranks and some accuracy (docs/perf.md, "Wire quantisation"): for
/// links slower than the codec, e.g. TCP between hosts. Split prompts keep f32.
struct kv_wire_config {
  transport::wire_format chat = transport::wire_format::f32;
  transport::wire_format agent = transport::wire_format::f32;
  transport::wire_format batch = transport::wire_format::f32;

  /// Some class sends a quantised form: ranks then make wire-form staging (kv_wire_staging.hpp).
  bool any_quantised() const {
    return chat != transport::wire_format::f32 || agent != transport::wire_format::f32 ||
           batch != transport::wire_format::f32;
  }
  /// The form for a request's traffic class (an unknown class: f32).
  transport::wire_format for_class(const std::string& traffic_class) const {
    if (traffic_class == "chat") return chat;
    if (traffic_class == "agent") return agent;
    if (traffic_class == "batch") return batch;
    return transport::wire_format::f32;
  }
  /// Reads "int8" (every class) or "CLASS=FORM[,CLASS=FORM...]" (e.g. "batch=int4,agent=int8");
  /// empty, or a sentence naming what is wrong (the rest unchanged then).
  std::string parse(const std::string& spec) {
    kv_wire_config next = *this;
    if (spec.find('=') == std::string::npos) {
      auto f = transport::wire_format_from(spec);
      if (!f) return "KV wire form must be f32, int8 or int4, got '" + spec + "'";
      next.chat = next.agent = next.batch = *f;
    } else {
      size_t at = 0;
      while (at <= spec.size()) {
        const size_t comma = std::min(spec.find(',', at), spec.size());
        const std::string item = spec.substr(at, comma - at);
        const size_t eq = item.find('=');
        const std::string cls = item.substr(0, eq), form = eq == std::string::npos ? "" : item.substr(eq + 1);
        auto f = transport::wire_format_from(form);
        if (eq == std::string::npos || !f)
          return "KV wire form '" + item + "' must be CLASS=FORM with FORM f32, int8 or int4";
        if (cls == "chat") next.chat = *f;
        else if (cls == "agent") next.agent = *f;
        else if (cls == "batch") next.batch = *f;
        else return "KV wire form '" + item + "': the traffic class must be chat, agent or batch, got '" + cls + "'";
        at = comma + 1;
      }
    }
    *this = next;
    return {};
  }
};

/// Deadlines of a request's hops. Each failure names the hop (stage) that timed out.
struct request_config {
  uint32_t place_timeout_ms = 5000;     ///< a balancer answers a placement
  /// The queue: an admitted request waits this long in all, in arrival order, for a decode rank
  /// with room for its KV (a burst beyond the cluster's KV queues, as in vLLM, instead of
  /// failing); then it is refused with kv_capacity (HTTP 503), not retried. As long as the
  /// gateway's first-token wait by default, so that an HTTP call is never refused for a queue it
  /// would have waited out; lower it to shed load sooner. A re-placement after a failure waits
  /// place_timeout_ms at least.
  uint32_t queue_timeout_ms = 600000;
  uint32_t reserve_timeout_ms = 5000;   ///< decode rank answers a KV reservation
  uint32_t prefill_timeout_ms = 60000;  ///< prefill rank computes and ships every layer
  uint32_t token_timeout_ms = 30000;    ///< decode rank produces the next token
  /// A KV reservation expires this long after its last progress (the grant, or a layer landing)
  /// unless decode has begun: a stalled handoff strands pages for at most this long.
  uint32_t lease_ms = 2000;
  /// Hybrid PD (seed 002): prompts shorter than this are prefilled on their decode rank, with
  /// no KV transfer; 0 = never (pure disaggregation). A very large value gives a colocated
  /// cluster (every prompt prefilled where it decodes), the baseline PD disaggregation beats.
  uint32_t hybrid_prefill_below_tokens = 0;
  /// A request that generates one token (max_tokens 1: evaluation harnesses' scoring calls,
  /// classification) runs on a prefill rank alone: the prefill picks that token, so no decode
  /// lease is reserved and no KV is shipped. false: it goes through a decode rank like any other.
  /// (A prompt that hybrid PD prefills on its decode rank stays there.)
  bool single_token_prefill_only = true;
  /// Attempts per request: a retryable failure (a rank down or silent, KV lost, a lease expired)
  /// re-places the request, its prompt extended by the tokens already generated, up to this many
  /// attempts in all; then the client gets the last failure.
  uint32_t max_attempts = 3;
  /// The pause before each retry: retry_backoff_ms, doubling per attempt up to 1 s, stretched
  /// by up to half by a hash of the request (policies::retry_backoff). 0: retry at once.
  uint32_t retry_backoff_ms = 50;
  kv_wire_config kv_wire;  ///< the KV's form on the wire per traffic class (f32 for all by default)

  std::string validate() const {
    for (const auto& [value, name] : {std::pair{place_timeout_ms, "place_timeout_ms"}, {queue_timeout_ms, "queue_timeout_ms"},
                                      {reserve_timeout_ms, "reserve_timeout_ms"}, {prefill_timeout_ms, "prefill_timeout_ms"},
                                      {token_timeout_ms, "token_timeout_ms"}, {lease_ms, "lease_ms"}})
      if (value == 0) return std::string{"request "} + name + " must be >= 1 ms, got 0";
    if (max_attempts == 0) return "request max_attempts must be >= 1";
    return {};
  }
};

struct router_config {
  request_config request;
  /// The model's tokenizer; null: the built-in byte tokenizer for the cluster's model.
  std::shared_ptr<const gpu::tokenizer> tokenizer;
  /// More end-of-sequence tokens than config.json's one (generation_config.json lists them, e.g.
  /// Llama 3's <|eot_id|>): generation ends there too, with finish_reason "eos".
  std::vector<int32_t> extra_eos_token_ids;
  /// What an OpenAI call that names no temperature, top_p or top_k samples with (the gateway
  /// asks the router): the model's generation_config.json (do_sample false: greedy), OpenAI's
  /// temperature 1 for a model directory without one, greedy for the built-in seeded models.
  float default_temperature = 0.0f;
  float default_top_p = 1.0f;
  uint32_t default_top_k = 0;
  /// ... and repetition_penalty: generation_config.json's, whether it samples or not (1: off).
  float default_repetition_penalty = 1.0f;
  /// Upper bound on max_tokens per request; 0 = the model's context length.
  uint32_t max_new_tokens_limit = 0;
  /// max_tokens of a request that gives none (0: OpenAI chat's default, "what the context
  /// leaves"): what the context leaves after the prompt, but at most this (0: no cap). A lease
  /// reserves a sequence's whole length unless KV is on demand, so an uncapped default would
  /// reserve the whole context for every such request (and a long-context model's would fit
  /// no decode rank).
  uint32_t default_max_tokens = 4096;
  /// Admission control: requests in flight at most; more are refused at once with
  /// errc::overloaded (HTTP 429 with Retry-After) instead of queueing without bound. Every
  /// queue behind the router (balancers' parked placements, ranks' waiting prompts) is bounded
  /// by it. 0 = no limit.
  uint32_t max_active_requests = 1024;
};

}  // namespace baton

#pragma once

// Every message type of the runtime, through one header (design.md §1), CAF 0.17 style: atoms
// as atom_constant (with the error codes in actors/atoms_and_errors.hpp), an inspect() for every
// struct. Its parts have files of their own: what clients send (client_messages.hpp), the block
// store's (store_messages.hpp), memory regions (kv_region.hpp), cluster membership
// (node_messages.hpp). All of them are registered with add_message_type in
// register_message_types() (actors/message_types.cpp), so they can cross processes. Only actor
// .cpp files and tests include this header (it pulls in CAF).

#include <cstdint>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/meta/type_name.hpp>
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include "actors/atoms_and_errors.hpp"
#include "actors/client_messages.hpp"
#include "actors/kv_region.hpp"
#include "actors/logprob_messages.hpp"
#include "actors/store_messages.hpp"
#include "actors/wire_float.hpp"

namespace caf {
class actor_system_config;
}

namespace baton {

// --- KV leases and handoff ---------------------------------------------------------------------
struct kv_lease_reserve {
  uint64_t request_id = 0;
  uint32_t num_tokens = 0;  ///< prompt + max new tokens: the pages cover the whole sequence
  uint32_t lease_ms = 0;    ///< pages are freed if decode has not begun by then
  uint32_t prompt_tokens = 0;  ///< of num_tokens, the prompt's (a rank allocating on demand reserves these first)
  /// The KV's form on the wire the request's traffic class asks for (transport::wire_format:
  /// 0 f32, 8 int8, 4 int4); the grant says what the rank can take.
  uint8_t wire = 0;
  /// The KV to be written is not a computation's exactly (its prompt came in a wire form, and
  /// a decode rank moves it here): the sequence is not written back to the store.
  bool inexact_kv = false;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, kv_lease_reserve& x) {
  return f(caf::meta::type_name("kv_lease_reserve"), x.request_id, x.num_tokens, x.lease_ms, x.prompt_tokens,
           x.wire, x.inexact_kv);
}

/// Where a rank stages KV in wire form (kv_wire_staging): slot (layer, page) at
/// (layer · num_pages + page) · slot_bytes of the region, num_pages being its KV pool's
/// (kv_region_desc::num_pages of the same grant).
struct kv_wire_region {
  uint8_t format = 0;  ///< transport::wire_format granted; 0 (f32): no staging, pages travel as they are
  std::string backend;
  uint64_t region_id = 0;
  uint64_t size_bytes = 0;
  std::vector<uint8_t> packed_key;
  uint64_t slot_bytes = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, kv_wire_region& x) {
  return f(caf::meta::type_name("kv_wire_region"), x.format, x.backend, x.region_id, x.size_bytes, x.packed_key,
           x.slot_bytes);
}

struct kv_lease_grant {
  uint64_t request_id = 0;
  uint64_t lease_id = 0;
  std::string rank;                ///< the decode rank's name
  kv_region_desc region;
  std::vector<uint32_t> page_ids;  ///< page i holds positions [i·P, (i+1)·P)
  uint32_t lease_ms = 0;           ///< the pages are freed this long after the grant unless decode began
  kv_wire_region wire{};             ///< the form asked for and the staging to put it in (format 0: f32)
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, kv_lease_grant& x) {
  return f(caf::meta::type_name("kv_lease_grant"), x.request_id, x.lease_id, x.rank, x.region, x.page_ids,
           x.lease_ms, x.wire);
}

/// Prefill -> decode: every chunk's KV of `layer` has landed in the lease's pages.
struct kv_layer_ready {
  uint64_t request_id = 0;
  uint64_t lease_id = 0;
  uint32_t layer = 0;
  uint32_t num_tokens = 0;  ///< prompt tokens whose KV the layer holds
  uint64_t checksum = 0;    ///< kv_layer_checksum of the prompt's pages at the sender
  std::string from;         ///< the sending rank's name (errors name it)
  /// The layer's form on the wire (transport::wire_format): 0, its pages landed as they are;
  /// else in the grant's staging slots, the checksum over their wire bytes, to be expanded.
  uint8_t wire = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, kv_layer_ready& x) {
  return f(caf::meta::type_name("kv_layer_ready"), x.request_id, x.lease_id, x.layer, x.num_tokens, x.checksum,
           x.from, x.wire);
}

struct token_event {
  uint64_t request_id = 0;
  uint32_t index = 0;          ///< 0 is the first (prefill) token
  int32_t token = 0;
  std::vector<float> logits;   ///< only when the request asked for logits
  /// The lease the token's sequence runs under: a late token of an earlier attempt on the same
  /// rank is told apart from the current attempt's by it.
  uint64_t lease_id = 0;
  std::vector<gpu::token_logprobs> logprobs{};  ///< the token's, one entry, when the request asked
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, token_event& x) {
  return f(caf::meta::type_name("token_event"), x.request_id, x.index, x.token, wire::f32s{&x.logits}, x.lease_id,
           x.logprobs);
}

struct decode_summary {
  uint64_t request_id = 0;
  uint32_t num_tokens = 0;  ///< tokens the decode rank generated (after the first)
  std::string finish_reason;  ///< eos, length, stop, released, ... or "migrated"
  int64_t queue_us = 0;     ///< order arrival -> joined the batch
  /// "migrated": the sequence's KV now sits in lease moved_lease of decode rank moved_to (a
  /// decode_rank_actor), which continues it on the request's next decode_order.
  caf::strong_actor_ptr moved_to = nullptr;
  std::string moved_rank{};
  uint64_t moved_lease = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, decode_summary& x) {
  return f(caf::meta::type_name("decode_summary"), x.request_id, x.num_tokens, x.finish_reason, x.queue_us,
           x.moved_to, x.moved_rank, x.moved_lease);
}

struct prefill_result {
  uint64_t request_id = 0;
  int32_t first_token = 0;
  std::vector<float> logits;  ///< the logits that chose first_token (if asked)
  std::string rank;
  int64_t queue_us = 0;       ///< order arrival -> first chunk started computing
  uint32_t cached_tokens = 0; ///< prompt tokens not computed: rank-local tier + store (verified)
  uint32_t recomputed_blocks = 0;  ///< cached blocks that failed (missing, corrupt, server down)
  uint32_t local_cached_tokens = 0;  ///< of cached_tokens, those found in the rank's own pages
  uint64_t kv_bytes = 0;      ///< KV shipped to the decode rank (every layer of the prompt)
  int64_t kv_send_us = 0;     ///< first put posted -> last layer announced
  /// A put of it (an aborted attempt's, say) was given up at the send timeout and may still land
  /// in the lease's pages: they must wait out the quarantine whenever they are let go.
  bool abandoned_put = false;
  std::vector<gpu::token_logprobs> logprobs{};  ///< first_token's, one entry, when the order asked
  /// prefill_order::prompt_logprobs: entry i is prompt token i + 1's, given the tokens before it
  /// (the prompt's first token has none), so one fewer than the prompt's tokens.
  std::vector<gpu::token_logprobs> prompt_logprobs{};
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, prefill_result& x) {
  return f(caf::meta::type_name("prefill_result"), x.request_id, x.first_token, wire::f32s{&x.logits}, x.rank,
           x.queue_us, x.cached_tokens, x.recomputed_blocks, x.local_cached_tokens, x.kv_bytes, x.kv_send_us,
           x.abandoned_put, x.logprobs, x.prompt_logprobs);
}

/// One entry of a rank's event log: what happened, in the order it happened (seq).
struct rank_event {
  uint64_t seq = 0;
  std::string kind;  ///< "kv_written", "send_posted", "send_done", "compute_done", "first_token", "layer_ready", "kv_landed", "admit", "step"
  uint64_t request_id = 0;
  uint32_t chunk = 0;                    ///< a prompt's chunk; "step": its draft rows (speculative decoding)
  uint32_t layer = 0;
  std::vector<uint64_t> batch_requests;  ///< "step": the requests in the step, in row order
  std::vector<uint32_t> batch_contexts;  ///< "step": each one's context length (tokens incl. this one)
  int64_t wall_ns = 0;                   ///< steady_clock when logged (for benchmarks; tests use seq)
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rank_event& x) {
  return f(caf::meta::type_name("rank_event"), x.seq, x.kind, x.request_id, x.chunk, x.layer, x.batch_requests,
           x.batch_contexts, x.wall_ns);
}

/// What a rank tells its balancer after every change of its load.
struct rank_load {
  std::string name;
  uint64_t queued_tokens = 0;    ///< prefill: prompt tokens accepted, not yet computed
  uint32_t num_running = 0;      ///< prefill: prompts in progress; decode: sequences + leases
  uint32_t num_free_pages = 0;
  uint32_t num_total_pages = 0;
  uint32_t page_size_tokens = 0;
  double predicted_us = 0.0;     ///< prefill: predicted time of the queued work (cost model)
  uint64_t kv_tokens = 0;        ///< decode: KV tokens held by running sequences and leases
  /// decode: 0 when a lease holds the whole sequence; N when KV is allocated on demand (a lease
  /// holds the prompt + N tokens at first), so placement asks only that much room.
  uint32_t on_demand_headroom_tokens = 0;
  /// prefill, in the balancer's stats: the length bucket its engine serves now (seed policy; 0 otherwise)
  uint32_t bucket = 0;
  /// Non-empty while the rank takes no new work, saying why (its executor's standing failure: a
  /// broken expert group, say): balancers place nothing there until a report clears it.
  std::string unavailable = {};
  /// The requests whose placement this report accounts for, since the rank's last one (decode:
  /// granted a lease, so counted in its pages, or refused; prefill: orders that arrived, counted
  /// in its queued work or refused). The balancer drops their charges and keeps those of
  /// placements still on their way, which a report must not wipe.
  std::vector<uint64_t> settled = {};
  /// decode, counted since the rank started, for /metrics: sequences sent to host memory for
  /// lack of pages and brought back; moved with their KV to other ranks (an elastic drain) and
  /// moves given up; full blocks written back to the store, and blocks dropped on the way.
  uint64_t offloaded = 0;
  uint64_t resumed = 0;
  uint64_t migrated_out = 0;
  uint64_t migrate_failed = 0;
  uint64_t blocks_written_back = 0;
  uint64_t write_backs_dropped = 0;
  /// decode, since the rank started: speculative drafts run, and those the model picked too.
  uint64_t drafted_tokens = 0;
  uint64_t accepted_tokens = 0;
  /// decode, now: pages out of use until a late writer's puts cannot land any more (quarantine),
  /// counted apart from free ones so that they do not look like a leak.
  uint32_t quarantined_pages = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rank_load& x) {
  return f(caf::meta::type_name("rank_load"), x.name, x.queued_tokens, x.num_running, x.num_free_pages,
           x.num_total_pages, x.page_size_tokens, wire::f64{&x.predicted_us}, x.kv_tokens,
           x.on_demand_headroom_tokens, x.bucket, x.unavailable, x.settled, x.offloaded, x.resumed, x.migrated_out,
           x.migrate_failed, x.blocks_written_back, x.write_backs_dropped, x.drafted_tokens, x.accepted_tokens, x.quarantined_pages);
}

/// A request asking a balancer for a rank.
struct place_query {
  uint64_t request_id = 0;
  uint32_t new_tokens = 0;     ///< prompt tokens to compute (q)
  uint32_t cached_tokens = 0;  ///< prompt tokens whose KV is cached (c)
  uint32_t total_tokens = 0;   ///< the whole sequence: prompt + max new tokens (decode's KV need)
  std::string priority = "interactive";
  /// Keys of the prompt's full blocks (hi, lo pairs, in order), when the store is on: lets
  /// cache-affinity routing find the rank whose own pages hold the longest prefix.
  std::vector<uint64_t> block_keys = {};
  uint32_t block_tokens = 0;
  /// How long the asker waits for an answer (its request timeout); a placement parked for want
  /// of room is given up after this, so it never lands on a rank after its asker has gone.
  /// 0: parked_wait_default_ms.
  uint32_t wait_ms = 0;
  /// The prompt must be computed on one rank (prompt scoring): never split.
  bool whole_prompt = false;
  /// Which of the request's placements this is (its attempt; a decode rank's move of it:
  /// placement_of_move): a release names it, and voids that placement alone.
  uint32_t attempt = 0;
};
/// place_query::attempt of a sequence's move between decode ranks (never a request's attempt).
inline constexpr uint32_t placement_of_move = 0xffffffffu;
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, place_query& x) {
  return f(caf::meta::type_name("place_query"), x.request_id, x.new_tokens, x.cached_tokens, x.total_tokens,
           x.priority, x.block_keys, x.block_tokens, x.wait_ms, x.whole_prompt, x.attempt);
}

struct rank_stats {
  std::string name;
  uint32_t num_free_pages = 0;
  uint32_t num_total_pages = 0;
  uint32_t num_running = 0;   ///< requests in the decode batch / prefills in progress
  uint32_t num_waiting = 0;   ///< reserved leases not yet decoding / queued prefill chunks
  uint64_t num_steps = 0;     ///< forward jobs completed
  uint64_t blocks_written_back = 0;  ///< decode: full blocks a block server confirmed it wrote
  uint64_t write_backs_dropped = 0;  ///< decode: blocks no server stored (staging full, no server up, or every server's write failed)
  uint64_t offloaded = 0;            ///< decode: sequences moved to host memory for lack of pages
  uint64_t resumed = 0;              ///< decode: offloaded sequences brought back
  /// decode: write-backs still moving to the block store (their staging must outlive them)
  uint32_t num_writes_in_flight = 0;
  double predicted_us = 0;    ///< prefill: the cost model's time for the queued work
  double recent_step_us = 0;  ///< decode: recent step time (exponential average over ~16 steps)
  bool active = true;         ///< false: on standby (an elastic rank serving in its other role)
  uint64_t migrated_out = 0;     ///< decode: running sequences moved, with their KV, to other ranks
  uint64_t migrate_failed = 0;   ///< decode: moves that failed (the sequence went on here)
  std::string last_migrate_error{};  ///< decode: why the last failed move failed (request, peer, stage)
  /// Non-empty while the rank takes no work, saying why (its executor's standing failure: a
  /// broken expert group), as rank_load::unavailable.
  std::string unavailable{};
  uint64_t drafted_tokens = 0;   ///< decode: speculative drafts run (rank_load::drafted_tokens)
  uint64_t accepted_tokens = 0;  ///< decode: of those, the ones the model picked too
  uint32_t quarantined_pages = 0;  ///< decode: pages held for late writers (rank_load::quarantined_pages)
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rank_stats& x) {
  return f(caf::meta::type_name("rank_stats"), x.name, x.num_free_pages, x.num_total_pages, x.num_running,
           x.num_waiting, x.num_steps, x.blocks_written_back, x.write_backs_dropped, x.offloaded, x.resumed,
           x.num_writes_in_flight, wire::f64{&x.predicted_us}, wire::f64{&x.recent_step_us}, x.active, x.migrated_out,
           x.migrate_failed, x.last_migrate_error, x.unavailable, x.drafted_tokens, x.accepted_tokens, x.quarantined_pages);
}

// --- actor interfaces ---------------------------------------------------------------------------
// Internal messages (executor completions, timers) are part of the interfaces because typed
// actors can only message themselves through their own interface.

using request_actor = caf::typed_actor<                       //
    caf::replies_to<run_atom>::with<completion>,               // start; answers when finished
    caf::reacts_to<token_event>,                               // from the decode rank
    caf::reacts_to<cancel_atom>,                               // from the client: stop, release everything
    // From the router: these ranks are gone (their node missed its heartbeats), and why.
    caf::reacts_to<rank_gone_atom, std::vector<std::string>, std::string>,
    caf::reacts_to<watchdog_atom, uint64_t>,                   // token deadline check
    caf::reacts_to<timer_atom, uint64_t>>;                     // a retry's pause is over (attempt)

/// What a client may do to its request: stop it. A chunk carries this, not request_actor, whose
/// other messages (run, a retry's timer, the watchdog) are the router's and the actor's own: a
/// client that sent those could start a second placement in one attempt and strand a lease.
using request_cancel_actor = caf::typed_actor<caf::reacts_to<cancel_atom>>;

/// A piece of a streamed completion, from the request actor to the client's sink, in order.
/// The first chunk comes with the first token (TTFT); the last one has a finish_reason. The
/// concatenated `text` of all chunks equals the completion's text: a chunk never ends inside a
/// UTF-8 character nor inside what could still become a stop string.
struct stream_chunk {
  uint64_t request_id = 0;
  request_cancel_actor request;  ///< send it cancel_atom to stop the generation
  uint32_t first_index = 0;      ///< index of tokens[0] among the generated tokens
  std::vector<int32_t> tokens;   ///< new tokens since the previous chunk
  std::string text;              ///< new text since the previous chunk (may be empty)
  std::string finish_reason;     ///< empty until the last chunk: eos | stop | length
  std::string stop_string;       ///< the last chunk's: completion::stop_string
  int32_t stop_token = -1;       ///< the last chunk's: completion::stop_token
  uint32_t num_prompt_tokens = 0;
  std::vector<token_logprob> logprobs;  ///< the chunk's tokens' (generate_request::logprobs)
  /// The first chunk of an echo: the prompt detokenized (generate_request::echo) and its tokens'
  /// log-probabilities (generate_request::prompt_logprobs, as completion::prompt_logprobs).
  std::string prompt_text;
  std::vector<token_logprob> prompt_logprobs;
  uint8_t prompt_thinking = 0;  ///< completion::prompt_thinking, in every chunk
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, stream_chunk& x) {
  return f(caf::meta::type_name("stream_chunk"), x.request_id, x.request, x.first_index, x.tokens, x.text,
           x.finish_reason, x.stop_string, x.stop_token, x.num_prompt_tokens, x.logprobs, x.prompt_text, x.prompt_logprobs, x.prompt_thinking);
}

/// Whatever receives a streamed completion: a client library's actor, a gateway connection.
using client_sink_actor = caf::typed_actor<caf::reacts_to<stream_chunk>>;

/// Constrained decoding as orders carry it (generate_request's output_format and output_spec): each
/// rank that picks tokens compiles the grammar (gpu::compile_output_grammar) and follows the output through
/// it, so a request moved between ranks keeps to it.
struct output_grammar {
  uint8_t kind = 0;    ///< gpu::output_format; 0: none
  std::string text;    ///< the JSON schema's text for kind 2, the regular expression for kind 3
  bool after_thinking = false;      ///< the prompt opened a thinking block: the answer follows its </think>
  bool compact = false;             ///< JSON without whitespace between tokens
  std::vector<int32_t> end_tokens;  ///< the tokens that end an answer, allowed once its JSON is whole
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, output_grammar& x) {
  return f(caf::meta::type_name("output_grammar"), x.kind, x.text, x.after_thinking, x.compact, x.end_tokens);
}

struct decode_order {
  uint64_t request_id = 0;
  uint64_t lease_id = 0;
  int32_t first_token = 0;       ///< sampled by the prefill rank; fed to the first step
  uint32_t prompt_len = 0;       ///< first_token sits at this position
  uint32_t max_new_tokens = 0;   ///< tokens still to generate after first_token
  float temperature = 0.0f;
  uint64_t seed = 0;
  bool return_logits = false;
  bool ignore_eos = false;
  request_actor stream_to;       ///< receives one token_event per step
  /// The sequence so far (prompt, and any output before a failover or move), with every order:
  /// for write-back, the penalties' history, a grammar's answer so far and speculative decoding's
  /// lookups. Write-back when the sequence finishes as `write_back` says.
  std::vector<int32_t> prompt_tokens = {};
  std::string traffic_class = {};  ///< retention class of the written blocks
  uint32_t cached_blocks = 0;    ///< leading blocks that came from the store (not written again)
  bool write_back = false;       ///< write the finished sequence's blocks to the store
  uint32_t top_k = 0;
  float top_p = 1.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::vector<int32_t> logit_bias_tokens = {};  ///< generate_request's logit_bias
  std::vector<float> logit_bias_values = {};
  float min_p = 0.0f;
  uint32_t min_tokens = 0;       ///< the output's tokens (from output_from) before end_tokens may be picked
  std::vector<int32_t> end_tokens = {};  ///< with min_tokens: the tokens held back until then
  output_grammar grammar = {};   ///< constrained decoding (prompt_tokens then holds the whole sequence)
  uint32_t output_from = 0;      ///< the request's own prompt length: penalties count the output after it
  bool logprobs = false;         ///< each token's log-probabilities in its token_event...
  uint32_t top_logprobs = 0;     ///< ... with this many alternatives
  /// A prefill writer gave up a put into the lease that may still land (prefill_result::
  /// abandoned_put): however the sequence ends or moves, its pages wait out the quarantine.
  /// Said here because the writer's own notice (writer_done) may arrive after the sequence ended.
  bool writer_abandoned = false;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, decode_order& x) {
  return f(caf::meta::type_name("decode_order"), x.request_id, x.lease_id, x.first_token, x.prompt_len,
           x.max_new_tokens, wire::f32{&x.temperature}, x.seed, x.return_logits, x.ignore_eos, x.stream_to,
           x.prompt_tokens, x.traffic_class, x.cached_blocks, x.write_back, x.top_k, wire::f32{&x.top_p},
           wire::f32{&x.repetition_penalty}, wire::f32{&x.presence_penalty}, wire::f32{&x.frequency_penalty},
           x.output_from, x.logprobs, x.top_logprobs, x.writer_abandoned, x.logit_bias_tokens,
           wire::f32s{&x.logit_bias_values}, x.grammar, wire::f32{&x.min_p}, x.min_tokens, x.end_tokens);
}

struct prefill_order;
struct prefill_result;

using decode_rank_actor = caf::typed_actor<
    caf::replies_to<reserve_atom, kv_lease_reserve>::with<kv_lease_grant>,
    // Hybrid PD (seed 002): the prompt is prefilled here, into the lease's pages, in chunks
    // that ride along with decode steps. The order's grant names the lease.
    caf::replies_to<prefill_order>::with<prefill_result>,
    // Lease id, and whether a writer may still put into it (its prefill order is unanswered):
    // then its pages are held back until every writer says it is done (writer_done_atom).
    caf::reacts_to<release_atom, uint64_t, bool>,
    // Request id: its request gave up the reservation it asked for (timed out, or ended while
    // waiting for it): refused if still waiting, freed if granted but the grant was never read.
    caf::reacts_to<cancel_atom, uint64_t>,
    caf::reacts_to<writer_done_atom, uint64_t, uint32_t>,       // lease id, writers of the lease (split parts)
    caf::reacts_to<kv_layer_ready>,
    caf::replies_to<kv_commit_atom, uint64_t, uint64_t>::with<bool>,  // lease, request: all its layers landed and checked
    caf::reacts_to<keepalive_atom, uint64_t, uint64_t>,         // request, lease: still queued at prefill
    caf::replies_to<decode_order>::with<decode_summary>,
    caf::replies_to<stats_atom>::with<rank_stats>,
    caf::replies_to<events_atom>::with<std::vector<rank_event>>,
    caf::reacts_to<exec_done_atom, uint64_t, gpu::forward_output>,
    caf::reacts_to<exec_fail_atom, uint64_t, std::string>,
    caf::reacts_to<timer_atom, uint64_t>,
    caf::reacts_to<expire_atom, uint64_t>,
    caf::reacts_to<poll_atom>,                                  // write-back puts in flight
    caf::reacts_to<migrate_atom>,                               // elastic P/D: move running sequences away
    caf::reacts_to<migrate_poll_atom>,                          // their KV puts in flight
    caf::reacts_to<reserve_expire_atom, uint64_t>,              // a waiting reservation's deadline
    caf::reacts_to<health_atom>,                                // standing failure began or ended; re-report load
    caf::reacts_to<resume_atom>,                                // sequences came back from host memory: step (internal)
    caf::reacts_to<layer_checked_atom, uint64_t, uint32_t, std::string>,  // lease, layer, why it is unusable (internal)
    caf::replies_to<role_atom, bool>::with<bool>>;              // elastic P/D: active, or standby when idle

struct prefill_order {
  uint64_t request_id = 0;
  std::vector<int32_t> tokens;
  float temperature = 0.0f;
  uint64_t seed = 0;
  bool return_logits = false;
  bool batch_priority = false;   ///< queued behind interactive prompts (with a starvation bound)
  kv_lease_grant grant;          ///< where each layer's KV goes
  decode_rank_actor decode;      ///< told kv_layer_ready per layer
  std::vector<block_ref> prefix = {};  ///< CHECK's cached blocks: loaded from the store, not computed
  uint32_t block_tokens = 0;
  // Dynamic prefill split (seed 002): this rank computes part `part_index` of the prompt,
  // tokens [part_bounds[i], part_bounds[i + 1]), with the earlier parts' KV streamed in from
  // their ranks layer by layer. Empty part_ranks: the whole prompt here.
  uint32_t part_index = 0;
  std::vector<uint32_t> part_bounds = {};
  std::vector<caf::actor> part_ranks = {};
  std::vector<std::string> part_names = {};  ///< the parts' rank names (errors, link accounting)
  uint32_t top_k = 0;
  float top_p = 1.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::vector<int32_t> logit_bias_tokens = {};  ///< generate_request's logit_bias
  std::vector<float> logit_bias_values = {};
  float min_p = 0.0f;
  uint32_t min_tokens = 0;       ///< the output's tokens (from output_from) before end_tokens may be picked
  std::vector<int32_t> end_tokens = {};  ///< with min_tokens: the tokens held back until then
  output_grammar grammar = {};   ///< constrained decoding
  uint32_t output_from = 0;      ///< the request's own prompt length (after a failover, tokens holds output too)
  bool logprobs = false;         ///< the first token's log-probabilities in the result...
  uint32_t top_logprobs = 0;     ///< ... with this many alternatives (and the prompt's tokens)
  /// Prompt scoring (echo): each prompt token's log-probability given the tokens before it, in
  /// the result. The whole prompt is computed on one rank: no cached prefix, no split.
  bool prompt_logprobs = false;
  uint32_t prompt_top_logprobs = 0;  ///< ... with at least this many alternatives (else top_logprobs)
  /// The request generates this one token only (max_tokens 1: scoring, classification): no
  /// decode rank is involved, so no KV is shipped and `grant` holds no pages; its lease_id is
  /// the request's tag for this attempt (prefill_only_tag), which cancels and store reads use.
  bool prefill_only = false;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, prefill_order& x) {
  return f(caf::meta::type_name("prefill_order"), x.request_id, x.tokens, wire::f32{&x.temperature}, x.seed,
           x.return_logits, x.batch_priority, x.grant, x.decode, x.prefix, x.block_tokens, x.part_index,
           x.part_bounds, x.part_ranks, x.part_names, x.top_k, wire::f32{&x.top_p}, wire::f32{&x.repetition_penalty},
           wire::f32{&x.presence_penalty}, wire::f32{&x.frequency_penalty}, x.output_from, x.logprobs, x.top_logprobs,
           x.prompt_logprobs, x.prefill_only, x.prompt_top_logprobs, x.logit_bias_tokens,
           wire::f32s{&x.logit_bias_values}, x.grammar, wire::f32{&x.min_p}, x.min_tokens, x.end_tokens);
}

/// The lease id a prefill-only order carries (prefill_order::prefill_only): decode ranks number
/// their leases from 1 up, so the top bit keeps the two apart; the attempt keeps one request's
/// attempts apart (a late store notice of an earlier attempt must not count for the next).
inline constexpr uint64_t prefill_only_tag(uint32_t attempt) { return (uint64_t{1} << 63) | attempt; }

/// Split prefill: a later part's rank tells an earlier part's rank where its pages are. The
/// lease names the attempt: a request placed again reuses its id, and a message of the old
/// attempt must not reach the new one's parts.
struct split_peer {
  uint64_t request_id = 0;
  uint64_t lease_id = 0;           ///< the attempt's decode lease (prefill_order::grant)
  uint32_t part_index = 0;         ///< the later part
  kv_region_desc region;
  std::vector<uint32_t> page_ids;  ///< its pages for positions [0, its part's end)
  caf::actor rank;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, split_peer& x) {
  return f(caf::meta::type_name("split_peer"), x.request_id, x.lease_id, x.part_index, x.region, x.page_ids, x.rank);
}

/// Split prefill: layer `layer` of part `from_part` has landed in the receiver's pages (and in the
/// decode rank's).
struct split_layer {
  uint64_t request_id = 0;
  uint64_t lease_id = 0;  ///< the attempt (see split_peer)
  uint32_t from_part = 0;
  uint32_t layer = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, split_layer& x) {
  return f(caf::meta::type_name("split_layer"), x.request_id, x.lease_id, x.from_part, x.layer);
}

/// Split prefill: part `from_part` failed, so the receiver's part cannot finish either (a later
/// part waits for its KV; an earlier one puts into its pages). The receiver stops with the same
/// code, so the request retries or gives up as the first failure decides, whichever part's
/// answer it reads first.
struct split_abort {
  uint64_t request_id = 0;
  uint64_t lease_id = 0;  ///< the attempt (see split_peer)
  uint32_t from_part = 0;
  uint8_t code = 0;       ///< the failure's errc
  std::string why;        ///< the failure, naming request, rank and stage
  /// The sender gave up a put unsettled (at its send timeout), which may still land in the
  /// receiver's pages: those are held for prefill_rank_config::late_put_quarantine_ms.
  bool abandoned = false;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, split_abort& x) {
  return f(caf::meta::type_name("split_abort"), x.request_id, x.lease_id, x.from_part, x.code, x.why, x.abandoned);
}

using prefill_rank_actor = caf::typed_actor<
    caf::replies_to<prefill_order>::with<prefill_result>,
    caf::reacts_to<cancel_atom, uint64_t, uint64_t>,  // request, its lease: the request let go; stop
    caf::replies_to<stats_atom>::with<rank_stats>,
    caf::replies_to<events_atom>::with<std::vector<rank_event>>,
    caf::reacts_to<exec_done_atom, uint64_t, gpu::forward_output>,
    caf::reacts_to<exec_fail_atom, uint64_t, std::string>,
    caf::reacts_to<exec_start_atom, uint64_t>,
    caf::reacts_to<timer_atom, uint64_t>,
    caf::reacts_to<xfer_atom, uint64_t, uint32_t, uint64_t, uint64_t, uint32_t>,  // request, layer, transfer, checksum, attempt
    caf::reacts_to<xfer_atom, uint64_t, uint32_t, std::string, uint32_t>,  // request, layer, why it was not encoded, attempt
    caf::reacts_to<store_layer_landed>,
    caf::reacts_to<split_peer>,
    caf::reacts_to<split_layer>,
    caf::reacts_to<split_abort>,
    caf::reacts_to<poll_atom>,
    caf::reacts_to<settled_atom>,                                // a KV send settled: poll at once
    caf::reacts_to<keepalive_atom>,                              // tick: renew queued prompts' leases
    caf::reacts_to<health_atom>,                                 // standing failure began or ended; re-report load
    // Elastic P/D: take work (true: report load, so the balancer places here) or go on standby
    // (false: only when idle; the local prefix tier's pages go back to the shared pool).
    caf::replies_to<role_atom, bool>::with<bool>>;

struct prefill_placement {
  std::string name;
  prefill_rank_actor rank;
  std::string why;  ///< the policy, its inputs and its choice, for the request's record
  // Dynamic prefill split: the ranks of the parts in order (rank above is the last part's) and
  // the parts' token bounds (size parts + 1). Empty: no split.
  std::vector<prefill_rank_actor> part_ranks = {};
  std::vector<std::string> part_names = {};
  std::vector<uint32_t> part_bounds = {};
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, prefill_placement& x) {
  return f(caf::meta::type_name("prefill_placement"), x.name, x.rank, x.why, x.part_ranks, x.part_names,
           x.part_bounds);
}

struct decode_placement {
  std::string name;
  decode_rank_actor rank;
  std::string why;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, decode_placement& x) {
  return f(caf::meta::type_name("decode_placement"), x.name, x.rank, x.why);
}

/// One placement a balancer made, kept (bounded) so it can be explained afterwards.
struct placement_record {
  uint64_t request_id = 0;
  std::string rank;
  std::string why;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, placement_record& x) {
  return f(caf::meta::type_name("placement_record"), x.request_id, x.rank, x.why);
}

/// Places prompts on prefill ranks from their reported loads (policies/prefill_placement.hpp).
using prefill_balancer_actor = caf::typed_actor<
    caf::replies_to<place_atom, place_query>::with<prefill_placement>,
    caf::reacts_to<load_atom, rank_load, prefill_rank_actor>,
    caf::replies_to<stats_atom>::with<std::vector<rank_load>>,
    caf::replies_to<parked_atom>::with<uint32_t>,  // placements waiting now for a rank to take them
    caf::replies_to<events_atom>::with<std::vector<placement_record>>,  // recent decisions
    caf::reacts_to<drain_atom, prefill_rank_actor>,                     // no new placements on this rank
    caf::reacts_to<undrain_atom, prefill_rank_actor>,                   // placements again (a move was abandoned)
    caf::reacts_to<forget_atom, prefill_rank_actor>,                    // its node is gone: drop it until...
    caf::reacts_to<rejoin_atom, prefill_rank_actor, bool>,                    // ...it may come back
    caf::reacts_to<timer_atom>,    // its own timer: no rank took work within the grace, parked ones refused
    caf::reacts_to<expire_atom>,   // its own timer: placements no report followed, parked ones retried
    caf::reacts_to<parked_due_atom>,  // its own timer: a parked placement's deadline, answered with why
    // request id, attempt: that attempt gave up before asking its rank (its client left,
    // another hop failed): its placement, made or parked, is void
    caf::reacts_to<release_atom, uint64_t, uint32_t>>;

/// Places sequences on decode ranks from their reported loads (policies/decode_placement.hpp).
using decode_balancer_actor = caf::typed_actor<
    caf::replies_to<place_atom, place_query>::with<decode_placement>,
    caf::reacts_to<load_atom, rank_load, decode_rank_actor>,
    caf::replies_to<stats_atom>::with<std::vector<rank_load>>,
    caf::replies_to<parked_atom>::with<uint32_t>,  // placements waiting now for a rank to take them
    caf::replies_to<events_atom>::with<std::vector<placement_record>>,
    caf::replies_to<store_atom>::with<store_info>,               // the store, for ranks joining later
    caf::reacts_to<drain_atom, decode_rank_actor>,               // no new placements on this rank
    caf::reacts_to<undrain_atom, decode_rank_actor>,             // placements again (a move was abandoned)
    caf::reacts_to<forget_atom, decode_rank_actor>,              // its node is gone: drop it until...
    caf::reacts_to<rejoin_atom, decode_rank_actor, bool>,              // ...it may come back
    caf::reacts_to<timer_atom>,    // its own timer: no rank took work within the grace, parked ones refused
    caf::reacts_to<expire_atom>,   // its own timer: placements no report followed, parked ones retried
    caf::reacts_to<parked_due_atom>,  // its own timer: a parked placement's deadline, answered with why
    // request id, attempt: that attempt gave up before asking its rank (its client left,
    // another hop failed): its placement, made or parked, is void
    caf::reacts_to<release_atom, uint64_t, uint32_t>>;

/// Elastic P/D: one role change, as the controller carried it out.
struct role_change {
  double at_s = 0;         ///< when the planner decided (controller clock, from its start)
  std::string rank;        ///< the elastic instance
  std::string from, to;    ///< prefill | decode
  std::string why;         ///< the planner's reason, with its numbers
  std::string state;       ///< draining | done | abandoned (the drain timed out: the rank serves on) | lost (its node left or drains)
  double drain_s = 0;      ///< decision -> the other role active
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, role_change& x) {
  return f(caf::meta::type_name("role_change"), wire::f64{&x.at_s}, x.rank, x.from, x.to, x.why, x.state,
           wire::f64{&x.drain_s});
}

/// The ranks a node process runs, as its agent tells the directory: what the balancers drop and
/// what requests must leave if the node goes silent.
struct node_ranks {
  std::vector<decode_rank_actor> decode;
  std::vector<prefill_rank_actor> prefill;
  std::vector<std::string> names;  ///< every rank's name (what requests know them by)
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_ranks& x) {
  return f(caf::meta::type_name("node_ranks"), x.decode, x.prefill, x.names);
}

/// A rank of a node process for the elastic controller (sent by the node's start): an elastic
/// instance's two actors on one executor (both handles), which the controller may move between
/// the roles, or a fixed rank (one handle, the other null), whose load counts in its pool's
/// pressure.
struct controller_join {
  std::string name;
  prefill_rank_actor prefill;
  decode_rank_actor decode;
  bool serves_prefill = false;  ///< an elastic instance's role at start
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, controller_join& x) {
  return f(caf::meta::type_name("controller_join"), x.name, x.prefill, x.decode, x.serves_prefill);
}

using elastic_controller_actor = caf::typed_actor<
    caf::reacts_to<timer_atom>,                                  // plan tick (internal)
    caf::reacts_to<controller_join>,                             // a node process's rank
    caf::reacts_to<drain_atom, node_ranks>,                      // a node drains or is gone: its ranks are not moved
    caf::reacts_to<rejoin_atom, node_ranks>,                     // a node given up for gone is back: they may be again
    caf::replies_to<events_atom>::with<std::vector<role_change>>>;  // every role change so far

/// A node process as the head's directory knows it (baton status, /metrics): one that went keeps
/// its entry, "gone", with how.
struct node_status {
  std::string name;
  std::vector<std::string> roles;
  int32_t pid = 0;
  int64_t since_heartbeat_ms = 0;  ///< time since its last heartbeat
  std::string state;               ///< joined | draining | gone (missed heartbeats or left)
  std::vector<std::string> ranks;  ///< its ranks' names, once it has started them
  std::string why;                 ///< gone: how (went down (...), left (its agent ended), missed its heartbeats ...)
  bool left = false;               ///< gone on purpose: its agent ended on its own (drained and left), not lost
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_status& x) {
  return f(caf::meta::type_name("node_status"), x.name, x.roles, x.pid, x.since_heartbeat_ms, x.state, x.ranks, x.why,
           x.left);
}

/// What the router knows of the cluster, for clients (the gateway's /v1/models and /metrics).
struct cluster_stats {
  std::string model;                 ///< the served model's name
  uint32_t context_tokens = 0;       ///< its context length
  std::vector<rank_load> prefill;    ///< every prefill rank's last load report
  std::vector<rank_load> decode;     ///< every decode rank's
  store_stats store;                 ///< index and servers summed (zero when the store is off)
  uint32_t store_servers = 0;        ///< block servers the store was started with
  uint32_t store_servers_up = 0;     ///< of those, the ones that answered this collection
  uint64_t num_admitted = 0;         ///< requests that passed admission (tokenized and checked)
  uint64_t num_rejected = 0;         ///< requests refused (bad input or overload)
  uint64_t num_active = 0;           ///< request actors alive now
  uint64_t num_overloaded = 0;       ///< of the refused: by admission control
  uint64_t num_failovers = 0;        ///< re-placements started (a rank failed, or a re-placement found none), failed requests' too
  /// Admitted requests that failed, by their error's code (to_string(errc)), from every client.
  std::vector<std::string> failed_codes;
  std::vector<uint64_t> failed_counts;  ///< failed_codes[i]'s
  /// How the model's chat answers carry their reasoning: gpu::chat_reasoning's value (0 none, 1 the
  /// template opens <think>, 2 the model may). The gateway gives it as reasoning_content.
  uint8_t chat_reasoning = 0;
  /// How its answers write tool calls: gpu::tool_call_format's value (0 none; gpu/tool_call_format.hpp).
  uint8_t chat_tool_calls = 0;
  /// router_config's sampling defaults: what an OpenAI call without them samples with.
  float default_temperature = 0.0f;
  float default_top_p = 1.0f;
  uint32_t default_top_k = 0;
  float default_repetition_penalty = 1.0f;
  /// router_config::max_active_requests (0: unbounded): a call of more generations than this can
  /// never be admitted whole, and the gateway refuses it as such rather than with a 429.
  uint32_t max_active_requests = 0;
  bool draining = false;        ///< the router refuses new requests: its head is stopping (drain_atom)
  bool decode_answered = true;  ///< false: the decode balancer did not answer in time; `decode` says nothing
  /// Placements each balancer holds waiting for a rank (decode: for KV room; prefill: for a rank
  /// that takes work): an overload building up shows here before its 503s.
  uint32_t prefill_parked = 0;
  uint32_t decode_parked = 0;
  /// The head's node processes (its directory's view), when the router knows the directory and
  /// it answered; in-process ranks have no node.
  bool nodes_known = false;
  std::vector<node_status> nodes;
  /// When the router (its head) started, Unix ms: the counters above count from then.
  int64_t started_unix_ms = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, cluster_stats& x) {
  return f(caf::meta::type_name("cluster_stats"), x.model, x.context_tokens, x.prefill, x.decode, x.store,
           x.num_admitted, x.num_rejected, x.num_active, x.num_overloaded, x.num_failovers, x.failed_codes, x.failed_counts, x.chat_reasoning,
           x.chat_tool_calls, x.default_temperature, x.default_top_p, x.default_top_k, x.store_servers,
           x.store_servers_up, x.max_active_requests, x.draining, x.decode_answered, x.prefill_parked,
           x.decode_parked, x.nodes_known, x.nodes, x.default_repetition_penalty, x.started_unix_ms);
}

/// What the router asks of the head's node directory (node_directory_actor answers it): only
/// that, so a handle that came from elsewhere can do nothing else through the router.
using node_stats_actor = caf::typed_actor<caf::replies_to<stats_atom>::with<std::vector<node_status>>>;

using router_actor = caf::typed_actor<
    caf::replies_to<generate_atom, generate_request>::with<completion>,
    // The same, streamed: the sink receives stream_chunks; the answer is the whole completion.
    // Cancel by sending cancel_atom to stream_chunk::request; a sink that goes down cancels too.
    caf::replies_to<generate_atom, generate_request, client_sink_actor>::with<completion>,
    caf::replies_to<stats_atom>::with<cluster_stats>,
    // A prompt (prompt, prompt_tokens or messages, with add_special_tokens and the chat's
    // template variables) as the model's token ids, as a generation would see it; nothing runs.
    caf::replies_to<tokenize_atom, generate_request>::with<std::vector<int32_t>>,
    // Token ids as text, special tokens written out (vLLM's /detokenize).
    caf::replies_to<detokenize_atom, std::vector<int32_t>>::with<std::string>,
    // Answered at once, asking nobody: whether the router's actor runs (a gateway's probe).
    caf::replies_to<ping_atom>::with<bool>,
    // Its head stops: new requests are refused (shutting_down), those admitted run to their end.
    caf::reacts_to<drain_atom>,
    // From the node directory: these ranks are gone; every request on them is re-placed.
    caf::reacts_to<rank_gone_atom, std::vector<std::string>, std::string>,
    // The head's node directory, whose view of the nodes the router's stats carry: taken once,
    // from its own process before the router is published (later ones are ignored).
    caf::reacts_to<directory_atom, node_stats_actor>>;

/// Registers every type here and in node_messages.hpp (and the error category) with a config, before the actor
/// system is built, and sets the default cluster id (CAF's middleman.app-identifiers). Call it
/// in every process.
void register_message_types(caf::actor_system_config& cfg);

}  // namespace baton

// Cluster membership's messages live apart, along that seam; every includer of this header gets them.
#include "actors/node_messages.hpp"

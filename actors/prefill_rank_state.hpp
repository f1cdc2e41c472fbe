#pragma once

// The prefill rank's state and the functions its translation units share (internal: only the
// prefill_*.cpp files include this). prefill_rank.cpp is the rank itself: queue, chunks,
// executor. prefill_send.cpp tracks the puts to the decode rank until they land, and picks the
// KV's form on the wire. prefill_streams.cpp is KV that streams in
// from elsewhere while the rank computes: a cached prefix from the block store, and the earlier
// parts of a split prompt from other prefill ranks.

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <caf/actor_clock.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/config.hpp"
#include "actors/executor_bridge.hpp"
#include "actors/messages.hpp"
#include "actors/store_access.hpp"
#include "actors/store_watch.hpp"
#include "gpu/executor.hpp"
#include "policies/placement.hpp"
#include "store/block_key.hpp"
#include "store/prefix_cache.hpp"
#include "transport/transport.hpp"

namespace baton::prefill_detail {

/// Everything the executor thread needs to ship one chunk's layers. Immutable once built, so the
/// executor thread and the actor can both read it.
struct chunk_sender {
  uint64_t request_id;
  uint32_t attempt;
  uint32_t chunk;
  bool last;                      ///< the last chunk: its layers complete the prompt's KV
  /// Pages [first, end) of the sequence that this chunk ships: the pages its tokens reach, but a
  /// partly filled last page only on the part's last chunk (the next chunk ships it whole). May
  /// be empty: a chunk inside one page.
  uint32_t first_page, end_page;
  std::vector<uint32_t> local_pages, remote_pages;
  gpu::kv_layout local_layout, remote_layout;
  uint64_t local_region;
  transport::region_key remote_key;
  std::string peer;
  /// The KV's form on the wire. Not f32: each page's layer is encoded into the rank's staging
  /// and put to the decode rank's (`remote_wire`). Held here: the actor's state (which holds it
  /// too) is destroyed before the executor stops, so a running chunk may outlive it.
  transport::wire_format wire = transport::wire_format::f32;
  std::shared_ptr<const kv_wire_staging> staging;
  kv_wire_region remote_wire;
  /// Positions the prompt fills in its last page when this chunk ships it partly filled (0: every
  /// page it ships is full). The rest of that page is not this prompt's (a former sequence's KV,
  /// or whatever a device mirror left) and travels as zeros.
  uint32_t tail_tokens = 0;

  transport::put_desc put_for_layer(uint32_t layer) const {
    if (wire != transport::wire_format::f32) {
      transport::put_desc d{request_id, layer, peer, staging->key.region_id,
                            {remote_wire.backend, remote_wire.region_id, remote_wire.size_bytes, remote_wire.packed_key}, {}};
      const uint64_t bytes = transport::wire_bytes(wire, staging->page_values);
      for (uint32_t i = first_page; i < end_page; ++i)
        d.segments.push_back({staging->offset(layer, local_pages[i]),
                              (uint64_t{layer} * remote_layout.num_pages + remote_pages[i]) * remote_wire.slot_bytes, bytes});
      return d;
    }
    transport::put_desc d{request_id, layer, peer, local_region, remote_key, {}};
    for (uint32_t i = first_page; i < end_page; ++i)
      d.segments.push_back({local_layout.offset_bytes(layer, local_pages[i]),
                            remote_layout.offset_bytes(layer, remote_pages[i]), local_layout.page_bytes()});
    return d;
  }

  /// Writes the wire form of this chunk's pages of `layer` into their staging slots. Empty, or
  /// why not (a value with no wire form), naming the page.
  std::string encode_layer(uint32_t layer, gpu::kv_cache& kv) const {
    thread_local std::vector<float> tail;
    for (uint32_t i = first_page; i < end_page; ++i) {
      const float* page = kv.k_at(layer, local_pages[i], 0);
      if (tail_tokens > 0 && i + 1 == end_page) {
        // A partly filled last page: only the prompt's rows, the rest zero (a stale value there
        // could be one with no wire form, and would not be this prompt's KV anyway).
        const uint64_t plane = uint64_t{local_layout.page_size_tokens} * local_layout.kv_dim;
        const uint64_t rows = uint64_t{tail_tokens} * local_layout.kv_dim;
        tail.assign(staging->page_values, 0.0f);
        for (uint64_t p = 0; p * plane < staging->page_values; ++p)
          std::copy(page + p * plane, page + p * plane + rows, tail.begin() + static_cast<ptrdiff_t>(p * plane));
        page = tail.data();
      }
      auto why = transport::wire_encode(wire, page, staging->page_values,
                                        reinterpret_cast<uint8_t*>(staging->slot(layer, local_pages[i])));
      if (!why.empty()) return "page " + std::to_string(i) + " of the prompt: " + why;
    }
    return {};
  }
};

struct pending_put {
  uint64_t request_id;
  uint32_t layer;
  uint64_t xfer_id;
  uint64_t checksum;  ///< non-zero on the last chunk's put
  caf::actor_clock::time_point posted_at;
  uint32_t attempt;
  int32_t peer = -1;  ///< split: index into the request's peers (-1: a put to the decode rank)
};

/// Loading a prompt's cached prefix from the block store: per block, where it is tried and how
/// it went. A block that fails on one server is retried on its next replica.
///
/// Streaming (cfg.overlap_prefix_load): the prompt computes optimistically while its prefix
/// arrives, each layer gated on that layer of every block being verified. A block that fails
/// aborts the attempt; once the reads settle, compute restarts after the blocks that are good.
struct prefix_load {
  enum status : int8_t { pending, in_flight, retrying, ok, failed };
  std::vector<block_ref> blocks;
  std::vector<status> state;
  std::vector<uint32_t> tried;  ///< index into blocks[b].servers of the server asked
  std::vector<std::string> errors;
  uint32_t outstanding = 0;     ///< read orders of the current round not yet answered
  std::vector<uint32_t> verified;  ///< per block: leading layers landed and verified this round
  std::shared_ptr<gpu::streamed_layers_gate> gate;  ///< streaming: the running attempt's gate
  bool aborted = false;               ///< streaming: a block failed; compute restarts after the reads
  /// A read ended without the server's answer (a timeout, a lost link), or the server gave a put
  /// up: its puts may still land in our pages, which therefore go back to the pool only after
  /// prefill_rank_config::late_put_quarantine_ms (return_pages).
  bool late_writer = false;
};

/// Dynamic prefill split (seed 002): this rank computes one part of a prompt. Earlier parts'
/// KV streams into our pages layer by layer (each earlier rank puts it and says so), gating our
/// layers; our part's KV goes to the decode rank and to every later part's pages. The last part
/// announces each layer to the decode rank once all parts have it there.
struct split_state {
  struct peer {
    uint32_t part = 0;
    kv_region_desc region;
    std::vector<uint32_t> pages;
    caf::actor rank;
  };
  bool active = false;
  uint32_t index = 0, parts = 1;
  uint32_t begin = 0, end = 0;       ///< our part's tokens
  std::vector<uint32_t> seen;        ///< per layer: earlier parts whose KV landed in our pages
  /// Per earlier part, per layer: landed (a repeated notice counts once).
  std::vector<std::vector<bool>> landed_from;
  std::vector<bool> layer_done;      ///< per layer: our decode puts of it all landed
  std::vector<peer> peers;           ///< later parts that told us their pages
  bool peer_abandoned = false;       ///< an earlier part gave up a put into our pages unsettled
  uint32_t peer_puts_landed = 0;     ///< (peer, layer) puts landed
  /// A later part's computation is queued on the executor only once every earlier part's layer 0
  /// has landed here, i.e. once every earlier part is running: a part waiting at its gate then
  /// never sits in front of a job it waits for. (Queued at once, two ranks could each hold a
  /// gated part waiting for the other's, queued behind it: a deadlock until the gates time out.)
  bool compute_deferred = false;
  bool last() const { return index + 1 == parts; }
  /// An earlier part of a split prompt: it hands its KV to later parts and brings no token.
  bool earlier_part() const { return active && !last(); }
};

/// A prompt in flight on this rank.
///
///   computing --all chunks done and every layer's puts landed--> answered (pages freed)
///       |
///       +--executor or transport failure--> failed (answered with the error; pages freed once
///                                           the executor has finished the queued chunks)
struct prefill_job_state {
  prefill_order order;
  caf::typed_response_promise<prefill_result> promise;
  std::vector<uint32_t> local_pages;
  std::vector<uint32_t> chunk_sizes;  ///< the chunk plan (fixed size, or sized by time budget)
  uint32_t cached_tokens = 0;         ///< leading tokens not computed (local tier or store)
  std::vector<store::block_key> keys; ///< the prompt's full blocks (rank-local tier on)
  uint32_t shared_blocks = 0;         ///< leading blocks on pages shared from the local tier
  uint32_t recomputed_blocks = 0;     ///< cached blocks that could not be used
  prefix_load load;
  uint32_t num_chunks = 0;            ///< chunks that will run (cut short to those submitted on failure)
  uint32_t chunks_submitted = 0;
  uint32_t chunks_done = 0;
  uint64_t tokens_left = 0;          ///< prompt tokens of chunks not yet computed
  caf::actor_clock::time_point arrived_at;
  int64_t queue_us = 0;              ///< arrival -> first chunk started
  std::optional<caf::actor_clock::time_point> first_put_at;  ///< the first KV put posted
  std::vector<uint32_t> puts_done;   ///< per layer: chunks whose put of this layer landed
  std::vector<uint64_t> checksums;   ///< per layer: the prompt's KV checksum, from the last chunk
  uint32_t layers_ready = 0;         ///< layers announced to the decode rank
  std::vector<bool> announced;       ///< per layer: announced (a restarted attempt does not repeat it)
  uint32_t attempt = 0;              ///< bumped when a streaming prefix load aborts the computation
  uint32_t jobs_in_executor = 0;     ///< chunk jobs of any attempt not yet finished
  std::optional<uint32_t> restart_from;  ///< after an abort: recompute from here once jobs drain
  split_state split;
  /// The order's output grammar, compiled and fed its answer so far when the order arrived
  /// (null when unconstrained); the last chunk's pick follows it.
  std::shared_ptr<gpu::grammar_matcher> grammar;
  bool have_logits = false;
  int32_t first_token = -1;
  std::vector<float> logits;
  std::vector<gpu::token_logprobs> logprobs;  ///< first_token's, when the order asked (one entry)
  std::vector<std::vector<gpu::token_logprobs>> chunk_scores;  ///< prompt scoring: each chunk's rows
  bool failed = false;
  bool abandoned_put = false;  ///< a put was given up on at the send timeout: it may still land
  /// The KV's form on the wire, chosen at the first chunk from the grant (f32 where the grant
  /// has no staging, the prompt is split, or this rank has no staging): every chunk agrees.
  std::optional<transport::wire_format> wire;
  caf::error failure;                 ///< answered once no queued chunk can still post a put
  /// Read by the executor thread before each post: a failed request ships nothing more.
  std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
};

/// The tokens this rank computes end here: the prompt's end, or its part's with a split.
inline uint32_t prompt_end(const prefill_job_state& r) {
  return r.split.active ? r.split.end : static_cast<uint32_t>(r.order.tokens.size());
}

/// A prompt accepted but not yet started: it waits for local KV pages.
struct waiting_order {
  prefill_order order;
  caf::typed_response_promise<prefill_result> promise;
  caf::actor_clock::time_point arrived_at;
  std::shared_ptr<gpu::grammar_matcher> grammar;  ///< see prefill_job_state::grammar
  /// The prompt's full blocks' keys for the rank-local tier, made once as it arrives (a held
  /// prompt is looked at on every drain: SHA-256 over its whole prompt each time); empty without
  /// the tier, for a split part or a scored prompt.
  std::vector<store::block_key> keys;
  /// It waits for a prompt computing on this rank that shares its leading blocks (its event is
  /// logged once): see shared_in_flight.
  bool waits_on_prefix = false;
};

/// A chunk job in the executor: which request, and how many of its tokens.
struct chunk_job {
  uint64_t request_id;
  uint32_t tokens;
  uint32_t attempt;
  uint32_t chunk;  ///< its index in the prompt's chunk plan
};

/// Chunk jobs kept in the executor at once: one computing, one queued behind it, so the
/// executor never idles between chunks while the next chunk is still chosen per step (which
/// is what lets an interactive prompt overtake a long batch prompt at a chunk boundary).
constexpr uint32_t max_chunks_in_executor = 2;

struct prefill_state {
  prefill_rank_config cfg;
  rank_core core;
  uint64_t last_job = 0;
  uint64_t num_jobs_done = 0;
  std::unordered_map<uint64_t, chunk_job> job_to_request;
  std::unordered_map<uint64_t, prefill_job_state> requests;
  /// Accepted, waiting for local KV pages: interactive first, batch after at most
  /// cfg.batch_max_bypass interactive prompts.
  policies::priority_classes<waiting_order> waiting{4};
  /// Started prompts with chunks left to submit, chosen the same way per chunk. A prompt goes
  /// back to the head of its class after each chunk, so within a class prompts run in order.
  policies::priority_classes<uint64_t> runnable{4};
  uint32_t chunks_in_executor = 0;
  std::vector<uint64_t> settled;  ///< orders that arrived since the last load report (rank_load::settled)
  std::vector<pending_put> pending;
  bool polling = false;  ///< poll_pending is settling puts (its list is out of `pending` meanwhile)
  std::vector<uint64_t> answer_after_poll;  ///< requests finish_if_done looked at meanwhile
  bool poll_scheduled = false;
  bool wire_refusal_said = false;  ///< a prompt's wire form fell back to f32 (said once on stderr)
  /// Set by the transport's settled listener when it sends settled_atom, cleared by its handler.
  std::shared_ptr<std::atomic<bool>> settled_flag;
  prefill_balancer_actor balancer;  ///< told our load after every change (may be null)
  store_access store;               ///< the block store (off when it has no index)
  store_server_watch store_watch;   ///< its servers seen to stop, until adopted again (store_watch.hpp)
  std::optional<store::prefix_cache> local;  ///< the rank-local prefix tier (store on)
  /// Split: later parts that found us before our own part started. Dropped after
  /// cfg.split_wait_ms (their order may never come here: its request gave up first).
  struct early_split_peers {
    caf::actor_clock::time_point first_at;
    std::vector<split_peer> peers;
  };
  std::unordered_map<uint64_t, early_split_peers> early_peers;
  /// Split: a failed later part's pages, held out of reuse after its request is gone (see
  /// return_pages), by lease: an earlier part's word that it gave a put up unsettled may still
  /// come (split_abort::abandoned), and pushes `until` out to cfg.late_put_quarantine_ms.
  struct split_hold {
    uint64_t request_id = 0;
    std::vector<uint32_t> pages;
    caf::actor_clock::time_point until;
  };
  std::unordered_map<uint64_t, split_hold> split_holds;
  /// Pages held after a late writer's prompt ended (return_pages), freed by a timer: like the
  /// split holds, they keep the rank from changing role (they go back to the shared pool later).
  uint32_t late_holds = 0;
  uint32_t late_held_pages = 0;  ///< their pages (rank_load::quarantined_pages, with the split holds')
  store::block_key salt;
  bool keepalive_scheduled = false;
  static inline const char* name = "baton.prefill_rank";
};

using prefill_pointer = prefill_rank_actor::stateful_pointer<prefill_state>;

/// Renews the order's decode lease: progress the decode rank cannot see (a prefill-only order
/// holds no lease).
inline void renew_lease(prefill_pointer self, const prefill_order& o) {
  if (!o.prefill_only) self->send(o.decode, keepalive_atom::value, o.request_id, o.grant.lease_id);
}

// Defined in prefill_rank.cpp, used by the others.
void finish_if_done(prefill_pointer self, uint64_t request_id);
void fail_request(prefill_pointer self, uint64_t request_id, errc code, const std::string& stage,
                  const std::string& what);
void start_compute(prefill_pointer self, uint64_t rid, uint32_t cached);
void schedule_keepalive(prefill_pointer self);

// Defined in prefill_send.cpp: the puts' side of the rank.
/// Tells the decode rank that layer `layer` of the whole prompt is in its pages.
void announce_layer(prefill_pointer self, prefill_job_state& r, uint32_t layer);
/// Polls `p` from now on (never settles it on the spot: callers may be iterating state it changes).
void track_put(prefill_pointer self, pending_put p);
/// Polls one transfer; returns true when it is finished (landed or failed).
bool settle(prefill_pointer self, const pending_put& p);
/// Polls every tracked put once.
void poll_pending(prefill_pointer self);
/// The KV's form on the wire for a prompt (f32 unless its grant, the rank and the prompt allow one).
transport::wire_format choose_wire(prefill_pointer self, const prefill_job_state& r);

// Defined in prefill_streams.cpp, used by the others.
void put_to_peer(prefill_pointer self, prefill_job_state& r, size_t peer, uint32_t layer);
void maybe_announce_split(prefill_pointer self, prefill_job_state& r, uint32_t layer);
void on_peer_put_landed(prefill_pointer self, uint64_t request_id, int32_t peer, uint32_t layer);
void maybe_restart(prefill_pointer self, uint64_t rid);
void on_layer_landed(prefill_pointer self, const store_layer_landed& ev);
void launch_split(prefill_pointer self, uint64_t rid);
void on_split_peer(prefill_pointer self, split_peer peer);
void on_split_layer(prefill_pointer self, const split_layer& ev);
void on_split_abort(prefill_pointer self, const split_abort& ev);
/// Starts loading the cached prefix (blocks [shared_blocks, prefix) from the store); with
/// overlap on, starts computing at once, each layer gated on that layer of every block.
void start_prefix_load(prefill_pointer self, uint64_t rid, uint32_t shared_blocks);

}  // namespace baton::prefill_detail

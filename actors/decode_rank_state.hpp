#pragma once

// The decode rank's state and the functions its translation units share (internal: only the
// decode_*.cpp files include this). decode_rank.cpp is the rank itself: leases, the continuous
// batch, offload to host memory, hybrid prefill. decode_handoff.cpp takes the KV handoff's side
// of it: reservations, layer-ready signals, wire-form expansion. decode_writeback.cpp writes
// finished sequences' full blocks back to the block store; decode_migrate.cpp moves running
// sequences to other decode ranks.

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <caf/actor_clock.hpp>
#include <caf/make_message.hpp>  // before result.hpp, whose templates call it
#include <caf/result.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/config.hpp"
#include "actors/decode_rank.hpp"
#include "actors/executor_bridge.hpp"
#include "actors/messages.hpp"
#include "actors/serial_worker.hpp"
#include "actors/store_access.hpp"
#include "actors/store_watch.hpp"
#include "store/block_index.hpp"
#include "store/staging_pool.hpp"
#include "transport/transport.hpp"

namespace baton::decode_detail {

/// What a lease's writers (prefill ranks; a split prompt has one per part) have said: each says
/// once that nothing of its is in flight (writer_done_atom); one that abandoned a put at its send
/// timeout says that it cannot know (0 writers), and then only time frees the pages.
struct lease_writers {
  uint32_t num_done = 0;
  uint32_t num = 1;  ///< as their notices say
  bool abandoned = false;
  /// Counts one notice; `num_writers` 0 marks an abandoned put.
  void note(uint32_t num_writers) {
    abandoned |= num_writers == 0;
    num = num_writers > 0 ? num_writers : num;
    ++num_done;
  }
  bool all_done() const { return !abandoned && num_done >= num; }
};

/// A KV reservation. Its life:
///
///   reserved --all layers landed + decode_order--> decoding --eos / max tokens--> freed
///      |                                               |
///      +--lease_ms passes, or kv_release--> freed      +--kv_release--> freed
struct lease {
  uint64_t request_id = 0;
  caf::actor_clock::time_point expires_at;  ///< pushed back by every landed layer
  uint32_t lease_ms = 0;
  std::vector<uint32_t> pages;
  std::vector<bool> landed;  ///< per layer
  uint32_t num_landed = 0;
  /// Per layer: checks of it on the rank's worker not yet answered (layer_checked_atom).
  std::vector<uint8_t> checking;
  bool decoding = false;
  bool has_order = false;
  bool release_after_step = false;  ///< released while a step was writing its pages
  /// Whole-sequence leases: its sequence went to host memory once for a newcomer. It is not
  /// sent out for one again (it came back first; going out again at once, as the youngest in
  /// the batch, copied its pages to and fro and let the newcomer go first after all).
  bool offloaded_once = false;
  bool local_writer = false;        ///< hybrid PD: this rank prefills it (no remote writer)
  /// Its prompt's KV came in a wire form (INT8, INT4), here or on the rank that moved it here:
  /// its pages hold expanded values, not what a computation gives, so they are not written back
  /// (the store keeps exact KV only).
  bool wire_form = false;
  lease_writers writers;            ///< what its remote writers said so far
  /// Who reserved it (a request actor), watched: one that ends normally without releasing the
  /// lease never learned of it (a request lets go of every lease it knows as it ends), so no
  /// writer was told of it either.
  caf::actor_addr holder;
  caf::actor_clock::time_point order_at;  ///< decode order arrival (queue time starts)
  int64_t queue_us = 0;                   ///< order arrival -> joined the batch
  decode_order order;
  caf::typed_response_promise<decode_summary> promise;
  /// A moving sequence's source asking whether every layer is in and checked (kv_commit_atom):
  /// answered when the last one is, or with the reason the lease was dropped.
  std::vector<caf::typed_response_promise<bool>> commits;
  std::vector<int32_t> fed;  ///< tokens fed to steps so far (their KV follows the prompt's)
  /// Speculative decoding: the order's prompt_tokens then `fed`, kept for the drafts' lookups
  /// (drafts_for grows it; empty while the rank does not speculate).
  std::vector<int32_t> lookup_history;
  /// Constrained decoding: the order's grammar after every token of the answer so far (the next
  /// input included); advanced as each step's pick comes back, read by the executor in between.
  std::shared_ptr<gpu::grammar_matcher> grammar;
};

/// Hybrid PD: a prompt prefilled on this rank into its lease's pages, chunk by chunk.
struct local_prefill {
  uint64_t lease_id = 0;
  prefill_order order;
  caf::typed_response_promise<prefill_result> promise;
  uint32_t next_pos = 0;  ///< prompt tokens computed so far
  uint32_t num_chunks = 0;  ///< chunks started so far
  caf::actor_clock::time_point arrived_at;
  int64_t queue_us = -1;  ///< arrival -> its first chunk started (-1: not yet)
  /// The order's output grammar, compiled and fed its answer so far when the order arrived;
  /// null when unconstrained. The first token's pick follows it.
  std::shared_ptr<gpu::grammar_matcher> grammar;
};

/// A sequence in the continuous batch.
struct running_seq {
  uint64_t lease_id = 0;
  uint32_t pos = 0;             ///< position of `next_input`
  int32_t next_input = 0;       ///< token fed to the next step
  uint32_t num_generated = 0;   ///< tokens generated on this rank
};

/// One block being written back: its range of the write staging and the servers still at it.
struct write_job {
  uint64_t offset = 0;
  uint32_t servers_left = 0;
  uint32_t servers_written = 0;  ///< servers that confirmed the block: none at the end counts as dropped
  store_write_order order;  ///< everything but the server's slot
};

/// A write-back put in flight to one server's slot.
struct write_put {
  uint64_t job = 0;
  uint32_t server = 0;
  /// The actor that granted the slot: a store node adopted again meanwhile serves the same id as
  /// a new actor, whose slot ids are not this one's.
  block_server_actor server_actor;
  uint64_t slot_id = 0;
  uint64_t xfer = 0;
  caf::actor_clock::time_point posted_at{};  ///< given up store_put_limit_ms after this
};

/// A running sequence moved to host memory; its lease stays, its device pages were freed.
struct paused_seq {
  running_seq seq;
  std::vector<uint32_t> host_slots;  ///< one per device page it had, in page order
};

/// A KV reservation that waits for an offload to free pages.
struct pending_reserve {
  kv_lease_reserve req;
  caf::actor_addr holder;  ///< who asked
  caf::typed_response_promise<kv_lease_grant> promise;
  uint64_t id = 0;  ///< for its deadline (reserve_expire_atom)
};

/// A running sequence on its way to another decode rank (elastic drain): out of the batch, its
/// KV put layer by layer into a lease there, the request told where it went once all landed.
struct migration {
  running_seq seq;
  decode_rank_actor target;      ///< null until placed
  std::string target_name;
  kv_lease_grant grant;          ///< lease_id 0 until reserved
  std::vector<uint64_t> xfers;   ///< per layer; 0 once landed
  caf::actor_clock::time_point posted_at;  ///< when the puts went out (migrate_send_timeout_ms counts from it)
  uint32_t landed = 0;
  bool committing = false;       ///< every put landed: waiting for the target's checks (kv_commit_atom)
  bool released = false;         ///< the request let go meanwhile: release the target lease at the end
};

/// The pages of a lease dropped while a writer may still put into them: out of the pool until
/// every writer is done (unless one abandoned a put), or `until`.
struct quarantined {
  std::vector<uint32_t> pages;
  uint64_t request_id = 0;
  lease_writers writers;
  caf::actor_clock::time_point until;
  caf::actor_addr holder;
  /// Held at expiry, with no word from its holder or any writer: if the holder then ends
  /// normally without releasing it, nobody ever learned of it and the pages go back at once.
  bool holder_may_not_know = false;
};

struct decode_state {
  decode_rank_config cfg;
  rank_core core;
  kv_region_desc region;  ///< the KV pool as prefill ranks address it
  bool wire_refusal_said = false;  ///< a grant fell back to f32 for want of wire staging (said once)
  uint64_t last_lease = 0;
  /// Lease holders this rank monitors, each once however many leases it holds: a source decode
  /// rank holds one lease per sequence it moves here, and a monitor each would pile up.
  std::set<caf::actor_addr> watched_holders;
  uint64_t last_job = 0;
  uint64_t num_steps = 0;
  caf::actor_clock::time_point step_started;  ///< of the step in flight
  double recent_step_us = 0;                  ///< exponential average over ~16 steps
  std::unordered_map<uint64_t, lease> leases;
  std::unordered_map<uint64_t, quarantined> quarantine;  ///< by lease id
  /// Leases dropped because a layer failed its checksum, with the reason, so that a decode
  /// order arriving afterwards gets that reason rather than "expired".
  std::unordered_map<uint64_t, std::string> corrupted;
  /// Landed layers are checked, and those in a wire form expanded, here: off the actor's thread.
  /// Made on the first layer that needs it.
  std::unique_ptr<serial_worker> checker;
  /// Checks on the worker per lease: a lease freed meanwhile keeps its pages out of the pool
  /// (held_pages) until they are answered, as an expansion may still write them.
  std::unordered_map<uint64_t, uint32_t> checks_in_flight;
  std::unordered_map<uint64_t, std::vector<uint32_t>> held_pages;
  std::vector<running_seq> batch;
  bool step_in_flight = false;
  /// on_step_done is going through the step's rows: a lease freed meanwhile does not rebalance
  /// memory (an offload then could move a sequence whose row is not yet taken, dropping its
  /// token); the loop rebalances once at its end.
  bool taking_step = false;
  std::vector<uint64_t> step_leases;  ///< lease ids of the step in flight, in row order
  /// The drafts each of those rows runs after its input (speculative_tokens; empty: none).
  std::vector<std::vector<int32_t>> step_drafts;
  uint64_t drafted_tokens = 0;   ///< drafts run in steps so far (speculative decoding)
  uint64_t accepted_tokens = 0;  ///< of those, the ones the model picked too (each one a step saved)
  size_t batch_cursor = 0;            ///< where the next step starts when the batch exceeds max_batch_size
  std::deque<local_prefill> local_prefills;  ///< hybrid PD prompts, first come first served
  /// The step in flight carries a chunk of each of the first step_chunks.size() local prompts,
  /// of these many tokens (empty: a pure decode step).
  std::vector<uint32_t> step_chunks;
  decode_balancer_actor balancer;     ///< told our load after every change (may be null)
  store_access store;
  std::optional<store::server_ring> ring;  ///< which block servers hold a key
  store_server_watch store_watch;  ///< block servers seen to stop: write-backs go to the next live ones
  // Write-back: a registered staging buffer, its ranges per job, and the puts in flight.
  std::shared_ptr<std::vector<std::byte>> write_buf = std::make_shared<std::vector<std::byte>>();  ///< write-back staging
  std::optional<transport::region_key> write_key;
  store::staging_pool write_slots{0};
  std::unordered_map<uint64_t, write_job> writes;
  std::vector<write_put> write_puts;
  uint64_t last_write = 0;
  bool write_poll_scheduled = false;
  uint64_t blocks_written_back = 0;
  uint64_t write_backs_dropped = 0;
  // Offload to host memory (cfg.host_offload_pages > 0).
  std::vector<std::byte> host_pool;      ///< host pages, each with all layers of one KV page
  std::vector<uint32_t> host_free;       ///< free host page slots
  std::deque<paused_seq> paused;         ///< offloaded sequences, oldest first
  std::deque<pending_reserve> reserves;  ///< reservations waiting for pages an offload will free
  uint64_t last_reserve = 0;
  /// Reservations granted or refused since the last load report (rank_load::settled).
  std::vector<uint64_t> settled;
  uint32_t reported_free_pages = 0;  ///< free pages at the last load report (grow_pages reports drift)
  uint64_t offloaded = 0, resumed = 0;
  // Elastic drain (migrate_atom): running sequences move to other decode ranks with their KV.
  bool migrate_out = false;
  std::unordered_map<uint64_t, migration> migrations;  ///< by this rank's lease id
  std::vector<uint64_t> stay;                          ///< leases whose move failed: they finish here
  bool migrate_poll_scheduled = false;
  uint64_t migrated_out = 0, migrate_failed = 0;
  std::string last_migrate_error;  ///< why the last move failed (names the stage and the peer)
  static inline const char* name = "baton.decode_rank";
};

using decode_pointer = decode_rank_actor::stateful_pointer<decode_state>;

/// Frees a lease: its pages, its host slots, its place in the balancer's view (decode_rank.cpp).
/// Ends a lease and gives its pages back. `writer_may_write`: a remote writer may still put
/// into it (its order unanswered, or unknown here): unless every layer landed, the pages are
/// quarantined instead, until its writers are done (writer_done_atom) or kv_quarantine_ms.
/// `unreleased`: it ends without its holder's word (it expired), so the holder may never have
/// learned of it.
void free_lease(decode_pointer self, uint64_t lease_id, bool writer_may_write = false, bool unreleased = false);
void report_load(decode_pointer self);
/// The request let go of a lease (release_atom), or its stream's receiver is gone: a running
/// sequence ends ("released"), one in a step at the end of the step, one moving away where the
/// move stands; `writer_may_write` as free_lease's (decode_rank.cpp).
void release_lease(decode_pointer self, uint64_t lease_id, bool writer_may_write);
/// Monitors an actor once (a lease's holder, a stream's receiver): its end reaches holder_down.
void watch(decode_pointer self, const caf::actor_addr& who);
void maybe_step(decode_pointer self);
/// Joins the batch once every layer has landed and the order is here (between steps).
void maybe_admit(decode_pointer self, uint64_t lease_id);
/// Offloads running sequences or resumes paused ones, and grants waiting reservations, as the
/// free pages allow (decode_rank.cpp).
void rebalance_memory(decode_pointer self);
/// The device pages offload_youngest could free now (decode_memory.cpp), and growing on-demand
/// leases by a page where their next token needs one, offloading the youngest if the pool is dry.
uint64_t offloadable_pages(const decode_state& st);
void grow_pages(decode_pointer self);
/// On demand: a reservation takes the prompt plus headroom, and running sequences grow a page
/// at a time (cfg.on_demand_headroom_tokens > 0).
bool on_demand(const decode_state& st);
/// Pages kept free on demand for running sequences to grow into.
uint32_t watermark_pages(const decode_state& st);

/// The KV handoff (decode_handoff.cpp). A reservation: granted now, queued until offloads or
/// finishing sequences free pages, or refused, naming why.
caf::result<kv_lease_grant> on_reserve(decode_pointer self, const kv_lease_reserve& req);
/// A lease over `pages` for `req`, with wire-form staging where the request asked for one.
kv_lease_grant grant_lease(decode_pointer self, const kv_lease_reserve& req, std::vector<uint32_t> pages,
                           const caf::actor_addr& holder);
uint32_t pages_to_reserve(const decode_state& st, const kv_lease_reserve& req);
/// The sender, request `request_id`, gave up the reservation it asked for: one still waiting for
/// pages is refused now, and a lease granted to it that it never heard of is freed now.
void on_reserve_cancelled(decode_pointer self, uint64_t request_id);
/// A layer landed (kv_layer_ready): checked, expanded when in wire form, and the sequence
/// admitted once all layers are in.
void on_layer_ready(decode_pointer self, const kv_layer_ready& ev);
/// A moving sequence's source asks whether every layer of lease `lease_id` landed and passed its
/// check: true now or once they have, or an error naming why the lease is gone.
caf::result<bool> on_commit(decode_pointer self, uint64_t lease_id, uint64_t request_id);
/// Answers the lease's pending commit questions: `why` empty for yes.
void answer_commits(lease& l, const std::string& why);

/// Gives a freed lease's pages back to the pool, or holds them while a check on the worker may
/// still write them (decode_rank.cpp).
void give_back_pages(decode_state& st, uint64_t lease_id, std::vector<uint32_t> pages);
/// A check on the worker answered (decode_handoff.cpp): the layer lands, or the lease is dropped.
void on_layer_checked(decode_pointer self, uint64_t lease_id, uint32_t layer, std::string why);

/// Elastic drain (decode_migrate.cpp): takes the batch's sequences out between steps and moves
/// each, with its KV, to a decode rank the balancer picks; a move that fails puts the sequence
/// back (it finishes here, no recompute either way).
void take_for_migration(decode_pointer self);
void poll_migrations(decode_pointer self);
/// The request released a lease that is moving: true when `lease_id` was one (handled).
bool release_migrating(decode_pointer self, uint64_t lease_id);

/// Polls the write-back puts; a landed one is followed by the order to write the file.
void poll_writes(decode_pointer self);

/// Writes the sequence's full blocks that did not come from the store to the block servers
/// (decode_writeback.cpp).
void write_back(decode_pointer self, const lease& l);

}  // namespace baton::decode_detail

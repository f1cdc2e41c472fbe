#pragma once

// The runtime's vocabulary: its atoms (CAF 0.17: atom_constant, at most 10 characters) and its
// error codes. Part of the message set in actors/messages.hpp, which includes it; split out so
// the message structs stand apart from the words they are sent with.

#include <cstdint>
#include <string>
#include <string_view>

#include <caf/atom.hpp>
#include <caf/error.hpp>

namespace baton {

// --- atoms (0.17: at most 10 characters) -------------------------------------------------
using generate_atom = caf::atom_constant<caf::atom("generate")>;
using run_atom = caf::atom_constant<caf::atom("run")>;
using reserve_atom = caf::atom_constant<caf::atom("kv_reserve")>;
using release_atom = caf::atom_constant<caf::atom("kv_release")>;
using stats_atom = caf::atom_constant<caf::atom("stats")>;
using events_atom = caf::atom_constant<caf::atom("events")>;
using exec_done_atom = caf::atom_constant<caf::atom("exec_done")>;
using exec_fail_atom = caf::atom_constant<caf::atom("exec_fail")>;
using timer_atom = caf::atom_constant<caf::atom("timer")>;
using xfer_atom = caf::atom_constant<caf::atom("xfer")>;
using poll_atom = caf::atom_constant<caf::atom("poll")>;
using expire_atom = caf::atom_constant<caf::atom("lease_exp")>;
using exec_start_atom = caf::atom_constant<caf::atom("exec_start")>;
using place_atom = caf::atom_constant<caf::atom("place")>;
using load_atom = caf::atom_constant<caf::atom("load")>;
using watchdog_atom = caf::atom_constant<caf::atom("watchdog")>;
using keepalive_atom = caf::atom_constant<caf::atom("kv_keep")>;
using check_atom = caf::atom_constant<caf::atom("check")>;
using commit_atom = caf::atom_constant<caf::atom("blk_commit")>;
using delete_atom = caf::atom_constant<caf::atom("blk_delete")>;
/// The index tells a block server which of its blocks CHECK hit (their use, for its disk's LRU).
using touch_atom = caf::atom_constant<caf::atom("blk_touch")>;
using io_atom = caf::atom_constant<caf::atom("io_done")>;
using store_atom = caf::atom_constant<caf::atom("store")>;
using cancel_atom = caf::atom_constant<caf::atom("cancel")>;
using join_atom = caf::atom_constant<caf::atom("join")>;
using heartbeat_atom = caf::atom_constant<caf::atom("heartbeat")>;
using drain_atom = caf::atom_constant<caf::atom("drain")>;
using rendezvous_atom = caf::atom_constant<caf::atom("rendezvous")>;
using member_gone_atom = caf::atom_constant<caf::atom("mbr_gone")>;
/// To a node process whose name a newer process took at the head: it leaves.
using replaced_atom = caf::atom_constant<caf::atom("replaced")>;
using health_atom = caf::atom_constant<caf::atom("health")>;
using undrain_atom = caf::atom_constant<caf::atom("undrain")>;
/// A decode rank's waiting KV reservation reached its deadline (reserve_wait_ms).
using reserve_expire_atom = caf::atom_constant<caf::atom("rsvexpire")>;
using forget_atom = caf::atom_constant<caf::atom("forget")>;
/// A rank forgotten by forget_atom (its node was given up for lost, an elastic move took it to
/// the other role) may register again: its next load report brings it back, draining again if
/// it was when forgotten and the bool says so (a node back from a partition: yes; an instance
/// an elastic move brings back to this role: no, its drain was that earlier move's).
using rejoin_atom = caf::atom_constant<caf::atom("rejoin")>;
using rank_gone_atom = caf::atom_constant<caf::atom("rank_gone")>;
using directory_atom = caf::atom_constant<caf::atom("directory")>;
using adopt_atom = caf::atom_constant<caf::atom("adopt")>;
/// The block servers as the index knows them now (a store node adopted again is a new actor).
using servers_atom = caf::atom_constant<caf::atom("servers")>;
using lost_atom = caf::atom_constant<caf::atom("lost")>;
/// A writer of a decode lease (a prefill rank, a part of a split prompt) has no put into it in
/// flight and will post none: a lease dropped while it still wrote may now give its pages back.
using writer_done_atom = caf::atom_constant<caf::atom("kv_wdone")>;
using role_atom = caf::atom_constant<caf::atom("role")>;
/// Elastic P/D: a draining decode rank moves its running sequences, with their KV, to other
/// decode ranks (and polls the puts with migpoll).
using migrate_atom = caf::atom_constant<caf::atom("migrate")>;
using migrate_poll_atom = caf::atom_constant<caf::atom("migpoll")>;
/// A moved sequence's target: answer once every layer of the lease landed and passed its check
/// (the source keeps the sequence until then, so a corrupt layer leaves it where it was).
using kv_commit_atom = caf::atom_constant<caf::atom("kv_commit")>;
/// A transfer of the rank's transport settled (transport::set_settled_listener): poll now.
using settled_atom = caf::atom_constant<caf::atom("settled")>;
/// A balancer's own timer: a parked placement's deadline has come (arm_parked_expiry).
using parked_due_atom = caf::atom_constant<caf::atom("parkdue")>;
using parked_atom = caf::atom_constant<caf::atom("parked")>;
using resume_atom = caf::atom_constant<caf::atom("resume")>;
/// A landed KV layer was checked (and expanded, in a wire form) off the decode rank's thread.
using layer_checked_atom = caf::atom_constant<caf::atom("kv_checked")>;
/// Text to the model's token ids and back, as vLLM's /tokenize and /detokenize (router_actor).
using tokenize_atom = caf::atom_constant<caf::atom("tokenize")>;
using detokenize_atom = caf::atom_constant<caf::atom("detokenize")>;
/// Whether the router answers at all (a gateway's probe, gateway_config::router_silence_ms).
using ping_atom = caf::atom_constant<caf::atom("ping")>;

// --- errors ---------------------------------------------------------------------------------
/// Baton's error codes (category atom "baton"). The context string of every error names the
/// request, the rank or peer, and the stage (prefill, kv_send, kv_recv, decode, ...).
enum class errc : uint8_t {
  bad_request = 1,    ///< fatal: the request itself is invalid; the message says which field
  kv_capacity,        ///< retryable: a rank has too few free KV pages right now
  rank_unavailable,   ///< retryable: no rank of the needed kind, or it stopped answering
  deadline_exceeded,  ///< retryable: a hop did not answer in time
  transfer_failed,    ///< retryable: KV did not arrive (a put outside its region: layout_mismatch)
  executor_failed,    ///< fatal: the executor refused or failed a job
  lease_expired,      ///< retryable: the KV reservation timed out before decode began
  layout_mismatch,    ///< fatal: prefill and decode ranks disagree on the KV page layout
  cancelled,          ///< fatal: the client cancelled the request or went away
  overloaded,         ///< retryable: the cluster is at its admission limit; retry after a moment
  shutting_down,      ///< retryable: the router is draining (its head stops); retry on another cluster or later
  /// retryable: the cluster's head (its router) went away mid-call, as a gateway on another
  /// process sees it; not a rank's failure, which rank_unavailable names.
  router_unavailable,
};
std::string to_string(errc x);
bool is_retryable(errc x);
caf::error make_error(errc code, std::string context);
/// "request 7, rank decode-0, stage kv_recv: ..." -- the one format for error contexts.
std::string where(uint64_t request_id, const std::string& rank, const std::string& stage);
/// A client's value as an error quotes it: at most `max_bytes` (then "..."), bytes other than
/// printable ASCII, and backslashes, as \xNN (a cut never splits a character, and nothing reads as another). An error travels to the client and into logs: a value quoted whole let one request put
/// a megabyte, or a forged log line, into both.
std::string quoted_input(std::string_view value, size_t max_bytes = 64);

}  // namespace baton

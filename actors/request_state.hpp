#pragma once

// A request actor's state (request.cpp), and the answer's text as it grows (request_text.cpp):
// detokenizing, stop tokens and strings, and the log-probability entries that follow the text.
// Internal to the request actor.

#include <string>
#include <vector>

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/request.hpp"

namespace baton::request_detail {

//  checking --index answers (or store off)--> placing --both balancers answer--> reserving
//  --lease granted--> prefilling
//                                                                     |
//     answered <--last token-- decoding <--first token (TTFT)---------+
//  One token to generate (prefill-only): placing --prefill balancer answers--> prefilling --> answered.
//  Any hop's error or deadline goes straight to `answered` with that error (lease released).
struct request_state {
  request_plan plan;
  caf::typed_response_promise<completion> promise;
  completion out;
  std::string prefill_name, decode_name;
  prefill_rank_actor prefill;
  decode_rank_actor decode;
  caf::actor_clock::time_point started, stage_started, last_token_at;
  caf::actor_clock::time_point attempt_started;  ///< this attempt's start (completion::failed_attempts_us)
  uint64_t lease_id = 0;   ///< 0 = none held
  /// Prefill ranks of this attempt whose order is unanswered (split parts count one each): they
  /// may still put KV into the lease, so a release says so and they are told to stop. An answer,
  /// even an error, comes only once nothing of theirs is in flight; a timeout proves nothing.
  uint32_t num_writers_out = 0;
  /// This attempt's prefill gave up a put that may still land in the lease (prefill_result::
  /// abandoned_put): its pages wait out the decode rank's quarantine whenever they are let go.
  bool writer_abandoned = false;
  /// KV reservations asked for and not yet answered. A request that ends with one on its way
  /// stays until it comes (reserve_timeout_ms at most) to give the lease back: a remote decode
  /// rank that granted it after the request had gone was never told, and held the pages through
  /// the lease and a minute's quarantine (a soak trial's cut clients took 80% of KV that way).
  uint32_t reserves_out = 0;
  /// This attempt asked its decode rank for a reservation and has read no answer: an attempt
  /// that ends so (its reserve timed out, the client hung up) tells the rank (let_go), which
  /// drops the reservation if it still waits, or frees a grant that came too late to be read.
  bool reserving = false;
  /// How long its placements waited at the decode balancer, all attempts together: the queue
  /// time it has used of request_config::queue_timeout_ms.
  int64_t queued_us = 0;
  uint64_t watch_seq = 0;  ///< the token watchdog acts only for the current attempt
  uint64_t watch_armed_seq = UINT64_MAX;  ///< the attempt whose watchdog timer is on its way
  caf::actor_clock::time_point watch_from;  ///< the last token (or the decode's start): the wait counts from here
  bool hybrid = false;     ///< hybrid PD: the decode rank prefills the prompt itself
  bool prefill_only = false;  ///< this attempt's one token comes from a prefill rank alone: no decode rank
  /// A placement asked for (in flight, parked, or made) and its rank not yet asked: the balancer
  /// counts a placement as the rank's load until the rank settles it (on the reservation, on the
  /// prefill order). An attempt given up before that (its client left, another hop failed)
  /// voids it (let_go); else it held its room for a whole charge TTL -- or, placed after its
  /// request had gone, for good until that TTL -- and placements parked behind it.
  bool decode_charged = false, prefill_charged = false;
  bool stopped = false;    ///< a stop token or string ended generation (out.text already cut)
  bool eos_hit = false;    ///< ... and it was one of the model's extra end-of-sequence tokens
  std::string text;        ///< with stop strings: the text so far, grown token by token
  prefill_placement split; ///< dynamic prefill split: the parts' ranks and bounds (none: no split)
  std::vector<block_ref> prefix;  ///< CHECK: the cached leading blocks and their servers
  std::vector<uint64_t> block_keys;  ///< the prompt's full blocks' keys (hi, lo), store on
  uint32_t cached_blocks = 0;     ///< blocks the prefill rank actually loaded (after verification)
  // Failover (design.md §2, failure semantics): a retryable failure re-places the request; the
  // new attempt's prompt is the request's plus every token generated so far, so greedy output
  // continues exactly where it stopped (the executor is batch- and chunk-invariant).
  std::vector<int32_t> prompt;    ///< this attempt's prompt
  int32_t max_new = 0;            ///< tokens this attempt still generates
  uint32_t decode_fed = 0;        ///< tokens of this attempt fed at decode ranks it moved away from
  uint32_t attempt = 0;           ///< failovers so far
  /// The sentences of what made the request fail over first and last ("request 7, rank decode-0,
  /// stage decode: ..."; completion::failover_why is the last, as CAF renders it): the rank that
  /// went down, where later attempts may only have found no rank to place on.
  std::string first_failover, last_failover;
  size_t emitted_text = 0;        ///< streaming: bytes of `text` already sent to the sink
  size_t stop_from = 0;           ///< stop strings start at or after this byte of `text` (min_tokens)
  size_t emitted_tokens = 0;      ///< ... and tokens
  size_t emitted_logprobs = 0;    ///< ... and log-probability entries (they follow the text: logprobs_ready)
  size_t logprob_bytes = 0;       ///< bytes of `text` the sent entries' texts cover
  bool echo_streamed = false;     ///< streaming an echo: the prompt went with the first chunk
  bool answered = false;
  static inline const char* name = "baton.request";
};

using request_pointer = request_actor::stateful_pointer<request_state>;

/// The request's prompt detokenized (echo).
std::string prompt_text(const request_state& st);
/// A token alone as text, by the request's tokenizer.
std::string token_text(const request_state& st, int32_t token);
/// The text of the first `n` generated tokens (all of them by default).
std::string decode_text(const request_state& st, size_t n = std::string::npos);
/// How many log-probability entries lie wholly within the first `sent` bytes of the text.
size_t logprobs_ready(request_state& st, size_t sent);
/// A stop string cut the text at byte `kept`: the log-probability entries follow it.
void cut_logprobs(request_state& st, size_t kept);
/// Stop conditions of the request (a stop token, or a stop string in the text so far, which is
/// cut before it): true when generation should end here.
bool hits_stop(request_state& st, int32_t token);

}  // namespace baton::request_detail

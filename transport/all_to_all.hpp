#pragma once

// All-to-all exchange over the transport interface: every rank of a fixed group sends one chunk
// of bytes to every rank (itself included) and receives one from each. Expert parallelism's
// dispatch (tokens packed per destination rank) and combine (expert outputs back) are two such
// exchanges per MoE layer.
//
// Each rank registers one receive region: an abort word per source (signal_abort), a mapped-by
// word per source and its sleep word (below), then two banks,
// each a doorbell per source and a slot per source (`slot_bytes`, after an 8-byte size header). An exchange puts each chunk, size first, into
// its destination's slot, waits for those puts to complete remotely, then puts a doorbell (one
// 64-bit word: the exchange's sequence number, and whether the chunk is empty, in which case no
// data was put) after it; a receiver has its input once every source's doorbell shows the
// sequence. The word the receiver polls is the only thing the doorbell carries, so no transport
// can show it before the rest of the doorbell.
// Exchanges alternate banks, so a fast rank's next exchange never overwrites what a slower rank
// is still reading: nobody gets two exchanges ahead, as each one waits for every rank's input.
//
// Where the transport maps a peer's region into this process (UCX shared memory between the
// processes of one host; the in-process loopback), chunks and doorbells are plain stores into the
// peer's slots instead of puts: no staging copy, no flush round trip, and the doorbell is a
// release store after the data. The receive region comes from the transport's own memory so
// that peers can map it.
//
// A rank that has waited long for its doorbells sleeps between polls (see poll_sleep_us). Peers
// that store into its region wake it at once: it sets its sleep word before it sleeps on it (a
// futex; the region is a shared mapping, so across processes too), and a peer that rings its
// doorbell (or stores its abort word) and finds the word set clears it and wakes the sleeper.
// Each peer that maps the region says so once (its mapped-by word), so a rank knows whether
// every peer can wake it (max_sleep_woken). An idle rank between
// exchanges dozes on the same word (doze), woken by a peer starting one or by its own thread's
// owner (nudge). So the first exchange after an idle spell starts within microseconds on one
// host; a peer that puts (another host) cannot wake it, and the sleep's bound applies.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "transport/transport.hpp"

namespace baton::transport {

struct all_to_all_config {
  uint32_t rank = 0;
  uint32_t size = 1;                ///< ranks in the group
  uint64_t slot_bytes = 1 << 20;    ///< the largest chunk one rank sends another per exchange
  std::chrono::milliseconds timeout{10'000};  ///< an exchange fails when a rank's input has not arrived by then
  /// Between polls: 0 yields (lowest latency with a core to spare), and once a wait has lasted
  /// 2,000 polls sleeps in proportion to how long it has lasted: 1 % of it, from `min_sleep` up
  /// to `max_sleep`. Idle ranks and expert shards so leave the cores to those with work; a peer
  /// that stores its doorbell here wakes the sleeper at once, and a wait for one that puts ends
  /// at most 1 % (or min_sleep, or max_sleep) after its input came. N sleeps N us from the
  /// start, which leaves the core to the transport's progress thread where cores are few.
  uint32_t poll_sleep_us = 0;
  std::chrono::microseconds min_sleep{50};
  std::chrono::microseconds max_sleep{5'000};
  /// The bound instead where every peer stores into this rank's region (one host): each wakes
  /// it as it rings, so the bound only paces its looks at abort_ and the timeout, and an idle
  /// shard wakes 20 times a second rather than 200.
  std::chrono::microseconds max_sleep_woken{50'000};
  /// Stores into peers' slots where the transport maps them (see above); false always puts (tests
  /// of the put path, and a baseline for benchmarks).
  bool direct = true;
  /// A put of ours (chunk or doorbell) not complete by then fails the exchange, whatever
  /// `timeout` is: a shard that waits a year for its engine's next exchange must not wait a year
  /// on a put to a peer that is gone (UCX reports no error for a dead shared-memory peer).
  std::chrono::milliseconds put_timeout{10'000};
  std::string validate() const;
};

/// Eight hex digits naming a region key, for diagnostics (processes that met compare theirs).
std::string key_fingerprint(const region_key& k);

class all_to_all {
public:
  /// Registers this rank's regions with `t` (which must outlive this object); failures surface
  /// in `error()` and every exchange then fails with it.
  all_to_all(transport& t, std::vector<std::string> rank_names, all_to_all_config cfg);
  ~all_to_all();
  all_to_all(const all_to_all&) = delete;
  all_to_all& operator=(const all_to_all&) = delete;

  const std::string& error() const { return error_; }
  uint32_t size() const { return cfg_.size; }
  const all_to_all_config& config() const { return cfg_; }
  /// This rank's receive region, to hand to every other rank.
  const region_key& key() const { return recv_key_; }
  /// Every rank's key, in rank order (this rank's own included).
  void connect(std::vector<region_key> keys);

  /// Sends send[d] to rank d and waits for every rank's chunk to this one: `recv[s]` views rank
  /// s's chunk (valid until this rank's next exchange). False and a sentence naming the exchange,
  /// the peer and what went wrong on failure (a put failed, a chunk too big, a peer silent past
  /// the timeout).
  bool exchange(const std::vector<std::span<const std::byte>>& send, std::vector<std::span<const std::byte>>* recv,
                std::string* why);
  /// The same in two halves, so a rank can compute while its chunks travel (dual-batch overlap):
  /// post() copies the chunks out and starts their puts; complete() waits for them, rings the
  /// doorbells and waits for every rank's chunk. One exchange is open at a time per group.
  bool post(const std::vector<std::span<const std::byte>>& send, std::string* why);
  bool complete(std::vector<std::span<const std::byte>>* recv, std::string* why);
  uint64_t exchanges() const { return seq_; }
  /// Called while an exchange waits for rank `source`'s chunk: a non-empty reason ends the wait
  /// at once with it (a peer known to be gone), instead of at the timeout.
  void set_abort(std::function<std::string(uint32_t source)> abort) { abort_ = std::move(abort); }
  /// Tells every other rank that this one takes part in no more exchanges (it stopped, or its
  /// caller's state broke): a word in each peer's region, which their waits can check
  /// (peer_aborted) instead of running into the timeout. Once; best effort, waiting at most 0.5 s
  /// for peers that are not mapped here.
  void signal_abort();
  /// Ends an exchange that post() opened and complete() will not finish (its caller failed):
  /// waits for its puts (bounded by the timeout) and releases them.
  void abandon();
  /// Whether rank `source` has signalled that it takes part in no more exchanges.
  bool peer_aborted(uint32_t source) const;
  /// Whether another rank has already rung its doorbell for this rank's next exchange: a peer
  /// started an exchange this rank has not joined (a data-parallel member idles on this).
  bool peer_started() const;
  /// While idle between exchanges: sleeps up to `d`, ending early once a peer starts an
  /// exchange this rank has not joined (its doorbell wakes this rank, as in an exchange's wait),
  /// nudge() is called, or `ready` (asked once this rank has said it sleeps) is true. A
  /// data-parallel member's job thread idles here. Called by the thread that exchanges.
  void doze(std::chrono::microseconds d, const std::function<bool()>& ready);
  /// Ends this rank's doze, or a sleep in its exchange's wait, now. Any thread.
  void nudge();
  /// Whether this rank sleeps now, waiting for its doorbells (a test waits for it).
  bool sleeping() const;
  /// How many of this rank's sleeps on its sleep word ran to their end: nobody woke them (a
  /// test's evidence that a peer's ring or a nudge ended them).
  uint64_t slept_out() const { return slept_out_.load(std::memory_order_relaxed); }
  /// Peers this rank reaches with plain stores (known after connect()).
  uint32_t direct_peers() const;
  /// A short fingerprint of rank `rank`'s key as this rank got it (connect()), for diagnostics:
  /// members comparing theirs see whether they met with the same keys.
  std::string fingerprint(uint32_t rank) const;

private:
  /// A doorbell word: seq << 1 | (the chunk is empty).
  using doorbell = uint64_t;
  uint64_t stride() const { return cfg_.slot_bytes + sizeof(uint64_t); }  ///< a slot and its size header
  /// An abort word per source, a mapped-by word per source, then the sleep word (a futex: its
  /// low 32 bits).
  uint64_t flags_bytes() const { return (2 * uint64_t{cfg_.size} + 1) * sizeof(uint64_t); }
  uint64_t mapped_offset(uint32_t source) const { return (uint64_t{cfg_.size} + source) * sizeof(uint64_t); }
  uint64_t sleep_offset() const { return 2 * uint64_t{cfg_.size} * sizeof(uint64_t); }
  /// Whether every other rank maps this rank's region (and so wakes it when it rings).
  bool woken_by_all() const;
  bool any_peer_aborted() const;
  /// Sleeps up to `d` on the sleep word, unless `over` (asked once the word says so) finds
  /// nothing left to wait for.
  void sleep_on_word(std::chrono::microseconds d, const std::function<bool()>& over);
  uint64_t bell_offset(uint64_t seq, uint32_t source) const;
  uint64_t bank_offset(uint64_t seq) const;
  /// A put in flight and the rank it goes to (named when it fails or times out).
  struct put_to {
    uint64_t id = 0;
    uint32_t rank = 0;
  };
  /// Waits for (at most `limit`) and releases the puts `ids`; false and why (naming the rank the
  /// first failed put went to) if one failed.
  bool wait_puts(std::vector<put_to>& ids, std::string* why, std::chrono::milliseconds limit);
  bool wait_puts(std::vector<put_to>& ids, std::string* why) {
    return wait_puts(ids, why, std::min(cfg_.timeout, cfg_.put_timeout));
  }
  /// How long one wait has lasted, in polls and time (see poll_sleep_us).
  struct waiting {
    uint32_t polls = 0;
    std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
  };
  /// One wait between polls.
  void pause(waiting* w) const;
  /// How long a wait that began at `since` sleeps between polls, at most `bound`.
  std::chrono::microseconds nap(std::chrono::steady_clock::time_point since, std::chrono::microseconds bound) const;
  /// The same while waiting for `bell` (rank `source`'s) to reach `seq`: its sleeps end when a
  /// peer rings, aborts, or a nudge comes.
  void pause_for(waiting* w, const doorbell* bell, uint64_t seq, uint32_t source);
  /// After ringing mapped peer `d`'s doorbell: wakes it if it sleeps.
  void wake(uint32_t d);

  transport& t_;
  std::vector<std::string> names_;
  all_to_all_config cfg_;
  std::string error_;
  /// Registered: [abort words | doorbells 0 | doorbells 1 | slots 0 | slots 1] (the transport's
  /// memory) and [doorbells | slots | abort word] (staging for puts).
  std::byte* recv_ = nullptr;
  uint64_t recv_bytes_ = 0;
  /// The transport's memory too: a put given up (timed out, released) may still read it, and a
  /// backend keeps its own memory mapped until it is itself destroyed (transport::free_memory).
  std::span<std::byte> send_;
  region_key recv_key_;
  std::vector<std::byte*> direct_;  ///< per rank: its receive region mapped here, or null
  uint64_t send_region_ = 0;
  std::vector<region_key> peers_;
  uint64_t seq_ = 0;
  bool posted_ = false;            ///< post() ran, complete() not yet
  std::vector<put_to> pending_;  ///< puts in flight
  std::vector<uint64_t> sizes_;    ///< the open exchange's chunk sizes, for the doorbells
  std::function<std::string(uint32_t)> abort_;
  bool aborted_ = false;  ///< signal_abort() ran: it says so once
  std::atomic<uint64_t> slept_out_{0};  ///< slept_out()
};

}  // namespace baton::transport

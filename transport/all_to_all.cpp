#include "transport/all_to_all.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <thread>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace baton::transport {

std::string all_to_all_config::validate() const {
  if (size == 0 || rank >= size) return "all-to-all: rank " + std::to_string(rank) + " outside a group of " + std::to_string(size);
  if (slot_bytes == 0) return "all-to-all: slot_bytes must be > 0";
  if (timeout.count() <= 0 || put_timeout.count() <= 0) return "all-to-all: timeout and put_timeout must be > 0";
  if (min_sleep.count() <= 0 || min_sleep > max_sleep || min_sleep > max_sleep_woken)
    return "all-to-all: min_sleep (" + std::to_string(min_sleep.count()) + " us) must be > 0 and at most max_sleep (" +
           std::to_string(max_sleep.count()) + " us) and max_sleep_woken (" + std::to_string(max_sleep_woken.count()) +
           " us)";
  if (max_sleep_woken.count() >= 1'000'000'000) return "all-to-all: max_sleep_woken must be under 1000 s";
  return {};
}

all_to_all::all_to_all(transport& t, std::vector<std::string> rank_names, all_to_all_config cfg)
  : t_(t), names_(std::move(rank_names)), cfg_(cfg) {
  error_ = cfg_.validate();
  if (error_.empty() && names_.size() != cfg_.size) error_ = "all-to-all: a name for each of the " + std::to_string(cfg_.size) + " ranks";
  if (!error_.empty()) return;
  const uint64_t bells = uint64_t{cfg_.size} * sizeof(doorbell);
  recv_bytes_ = flags_bytes() + 2 * bells + 2 * cfg_.size * stride();
  // Staging: doorbells, slots, then the word signal_abort() puts.
  const uint64_t send_bytes = bells + cfg_.size * stride() + sizeof(uint64_t);
  xfer_error err;
  recv_ = t_.allocate_memory(recv_bytes_, &err);
  auto* send = recv_ ? t_.allocate_memory(send_bytes, &err) : nullptr;
  if (!recv_ || !send) {
    error_ = "all-to-all rank " + names_[cfg_.rank] + ": no memory for its receive slots and staging: " + err.to_string();
    return;
  }
  send_ = {send, send_bytes};
  std::memset(send_.data(), 0, send_.size());
  std::memset(recv_, 0, flags_bytes() + 2 * bells);  // no exchange yet, nobody gone: all zero
  auto rk = t_.register_region(recv_, recv_bytes_, &err);
  if (rk) recv_key_ = *rk;  // deregistered by the destructor whatever happens next
  auto sk = rk ? t_.register_region(send_.data(), send_.size(), &err) : std::nullopt;
  if (!rk || !sk) {
    error_ = "all-to-all rank " + names_[cfg_.rank] + ": cannot register its buffers: " + err.to_string();
    return;
  }
  send_region_ = sk->region_id;
}

all_to_all::~all_to_all() {
  abandon();  // an exchange left open: its puts are waited for (bounded) and released
  if (recv_key_.region_id) t_.deregister_region(recv_key_.region_id);
  if (send_region_) t_.deregister_region(send_region_);
  if (!send_.empty()) t_.free_memory(send_.data());
  if (recv_) t_.free_memory(recv_);
}

void all_to_all::connect(std::vector<region_key> keys) {
  if (error_.empty() && keys.size() != cfg_.size)
    error_ = "all-to-all rank " + names_[cfg_.rank] + ": " + std::to_string(keys.size()) + " peer keys for a group of " +
             std::to_string(cfg_.size);
  peers_ = std::move(keys);
  direct_.assign(peers_.size(), nullptr);
  // Regions of one layout only: a peer of another build or slot size would read chunks and
  // doorbells at other offsets than this rank writes them.
  for (uint32_t d = 0; d < peers_.size() && error_.empty(); ++d)
    if (peers_[d].size_bytes != recv_bytes_)
      error_ = "all-to-all rank " + names_[cfg_.rank] + ": rank " + names_[d] + "'s receive region is " +
               std::to_string(peers_[d].size_bytes) + " bytes, this rank's " + std::to_string(recv_bytes_) +
               ": not the same slot size, or not the same build of Baton";
  if (!cfg_.direct || !error_.empty()) return;
  for (uint32_t d = 0; d < peers_.size(); ++d) {
    if (d == cfg_.rank || !(direct_[d] = t_.map_remote(peers_[d]))) continue;
    // Tell the peer that this rank can wake it (woken_by_all).
    std::atomic_ref<uint64_t>{*reinterpret_cast<uint64_t*>(direct_[d] + mapped_offset(cfg_.rank))}.store(
        1, std::memory_order_release);
  }
}

std::string key_fingerprint(const region_key& k) {
  uint32_t h = 2166136261u;  // FNV-1a over the key's text
  for (unsigned char c : key_to_text(k)) h = (h ^ c) * 16777619u;
  char buf[12];
  std::snprintf(buf, sizeof buf, "%08x", h);
  return buf;
}

std::string all_to_all::fingerprint(uint32_t rank) const {
  return rank < peers_.size() ? key_fingerprint(peers_[rank]) : std::string{"?"};
}

uint32_t all_to_all::direct_peers() const {
  return static_cast<uint32_t>(std::count_if(direct_.begin(), direct_.end(), [](auto* p) { return p != nullptr; }));
}

bool all_to_all::peer_started() const {
  if (!error_.empty() || posted_) return false;
  const uint64_t next = seq_ + 1;
  for (uint32_t s = 0; s < cfg_.size; ++s) {
    if (s == cfg_.rank) continue;
    auto* bell = reinterpret_cast<doorbell*>(recv_ + bell_offset(next, s));
    // Sequentially consistent: doze's look after it says it sleeps, against a peer's ring (wake).
    if ((std::atomic_ref<uint64_t>{*bell}.load(std::memory_order_seq_cst) >> 1) >= next) return true;
  }
  return false;
}

uint64_t all_to_all::bell_offset(uint64_t seq, uint32_t source) const {
  return flags_bytes() + ((seq % 2) * cfg_.size + source) * sizeof(doorbell);
}

uint64_t all_to_all::bank_offset(uint64_t seq) const {
  return flags_bytes() + 2 * uint64_t{cfg_.size} * sizeof(doorbell) + (seq % 2) * cfg_.size * stride();
}

bool all_to_all::peer_aborted(uint32_t source) const {
  if (!recv_ || source >= cfg_.size) return false;
  // Sequentially consistent: a sleeper's last look, against the peer's store and its wake.
  return std::atomic_ref<uint64_t>{*reinterpret_cast<uint64_t*>(recv_ + uint64_t{source} * sizeof(uint64_t))}.load(
             std::memory_order_seq_cst) != 0;
}

bool all_to_all::any_peer_aborted() const {
  for (uint32_t s = 0; s < cfg_.size; ++s)
    if (s != cfg_.rank && peer_aborted(s)) return true;
  return false;
}

bool all_to_all::woken_by_all() const {
  if (cfg_.size < 2) return false;
  for (uint32_t s = 0; s < cfg_.size; ++s)
    if (s != cfg_.rank &&
        std::atomic_ref<uint64_t>{*reinterpret_cast<uint64_t*>(recv_ + mapped_offset(s))}.load(std::memory_order_acquire) == 0)
      return false;
  return true;
}

void all_to_all::abandon() {
  if (!posted_ && pending_.empty()) return;
  std::string why;
  wait_puts(pending_, &why);  // released either way: nothing of this exchange stays in flight
  posted_ = false;
}

void all_to_all::signal_abort() {
  if (!error_.empty() || peers_.size() != cfg_.size || aborted_) return;
  aborted_ = true;
  abandon();
  const uint64_t at = uint64_t{cfg_.rank} * sizeof(uint64_t), staged = send_.size() - sizeof(uint64_t), one = 1;
  std::memcpy(send_.data() + staged, &one, sizeof one);
  std::vector<put_to> puts;
  for (uint32_t d = 0; d < cfg_.size; ++d) {
    if (d == cfg_.rank) continue;
    if (direct_[d]) {
      std::atomic_ref<uint64_t>{*reinterpret_cast<uint64_t*>(direct_[d] + at)}.store(1, std::memory_order_seq_cst);
      wake(d);  // its wait looks at the word (abort_) as soon as it is awake
      continue;
    }
    puts.push_back({t_.post_put({seq_, 0, names_[d], send_region_, peers_[d], {{staged, at, sizeof one}}}), d});
  }
  // Best effort, briefly: a peer that is gone needs no word, and a stop should not wait for it.
  std::string why;
  wait_puts(puts, &why, std::min(cfg_.timeout, std::chrono::milliseconds{500}));
}

namespace {

/// Polls a wait yields for before it sleeps (see pause).
constexpr uint32_t yields_first = 2000;

/// The sleep word's futex half (the region is 8-byte aligned; little-endian: its low half).
uint32_t* sleep_word(std::byte* region, uint64_t offset) { return reinterpret_cast<uint32_t*>(region + offset); }

}  // namespace

std::chrono::microseconds all_to_all::nap(std::chrono::steady_clock::time_point since,
                                          std::chrono::microseconds bound) const {
  using std::chrono::microseconds;
  const auto waited = std::chrono::duration_cast<microseconds>(std::chrono::steady_clock::now() - since);
  return std::clamp(waited / 100, cfg_.min_sleep, std::max(bound, cfg_.min_sleep));
}

bool all_to_all::sleeping() const {
  return recv_ && std::atomic_ref<uint32_t>{*sleep_word(recv_, sleep_offset())}.load(std::memory_order_acquire) != 0;
}

void all_to_all::pause(waiting* w) const {
  // Yielding answers within microseconds, but a dozen shards yielding on two cores starve the
  // one that has work (seen: a shard silent for 10 s at its first exchange): a long wait sleeps.
  // Sleeping in proportion to the wait so far bounds what it adds to 1 % of the wait (and 5 ms),
  // while an idle shard (which waits for its engine's next step) wakes 200 times a second, not
  // 20,000: twelve idle shards took most of two cores before, and slowed the next engine's start.
  if (cfg_.poll_sleep_us) {
    std::this_thread::sleep_for(std::chrono::microseconds{cfg_.poll_sleep_us});
    return;
  }
  if (++w->polls < yields_first) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(nap(w->since, cfg_.max_sleep));
}

void all_to_all::sleep_on_word(std::chrono::microseconds d, const std::function<bool()>& over) {
  uint32_t* addr = sleep_word(recv_, sleep_offset());
  std::atomic_ref<uint32_t> word{*addr};
  // Say so, then look once more (both sequentially consistent, as a peer's ring and its look at
  // this word are): either this look sees the peer's store, or the peer sees the word and wakes
  // this rank, whose futex wait then returns at once or is woken.
  word.store(1, std::memory_order_seq_cst);
  if (!over()) {
    const auto us = std::max<int64_t>(d.count(), 1);
    const timespec ts{static_cast<time_t>(us / 1'000'000), static_cast<long>(us % 1'000'000) * 1000};
    // Not FUTEX_PRIVATE: peers in other processes wake it through their mapping of the region.
    if (::syscall(SYS_futex, addr, FUTEX_WAIT, 1, &ts, nullptr, 0) != 0) {
      const int err = errno;
      if (err == ETIMEDOUT) slept_out_.fetch_add(1, std::memory_order_relaxed);
      else if (err != EAGAIN && err != EINTR) std::this_thread::sleep_for(d);  // no futex here: sleep plainly
    }
  }
  word.store(0, std::memory_order_relaxed);
}

void all_to_all::pause_for(waiting* w, const doorbell* bell, uint64_t seq, uint32_t source) {
  if (cfg_.poll_sleep_us || w->polls + 1 < yields_first) return pause(w);
  sleep_on_word(nap(w->since, woken_by_all() ? cfg_.max_sleep_woken : cfg_.max_sleep), [&] {
    return (std::atomic_ref<uint64_t>{*const_cast<doorbell*>(bell)}.load(std::memory_order_seq_cst) >> 1) >= seq ||
           any_peer_aborted() || (abort_ && !abort_(source).empty());
  });
}

void all_to_all::doze(std::chrono::microseconds d, const std::function<bool()>& ready) {
  if (!recv_) {
    std::this_thread::sleep_for(d);
    return;
  }
  sleep_on_word(d, [&] { return peer_started() || any_peer_aborted() || (ready && ready()); });
}

void all_to_all::nudge() {
  if (!recv_) return;
  uint32_t* addr = sleep_word(recv_, sleep_offset());
  if (std::atomic_ref<uint32_t>{*addr}.exchange(0, std::memory_order_seq_cst) != 0)
    ::syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void all_to_all::wake(uint32_t d) {
  uint32_t* addr = sleep_word(direct_[d], sleep_offset());
  std::atomic_ref<uint32_t> word{*addr};
  if (word.load(std::memory_order_seq_cst) == 0 || word.exchange(0, std::memory_order_seq_cst) == 0) return;
  ::syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool all_to_all::wait_puts(std::vector<put_to>& ids, std::string* why, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  bool ok = true;
  waiting w;
  for (size_t i = 0; i < ids.size(); ++i) {
    xfer_error err;
    xfer_state s;
    while ((s = t_.poll(ids[i].id, &err)) == xfer_state::pending) {
      if (std::chrono::steady_clock::now() > deadline) {
        err.what = "not complete after " + std::to_string(limit.count()) + " ms";
        err.request_id = seq_;
        s = xfer_state::failed;
        break;
      }
      pause(&w);
    }
    if (s == xfer_state::failed && ok) {
      *why = "all-to-all exchange " + std::to_string(seq_) + ": rank " + names_[cfg_.rank] + " -> " +
             names_[ids[i].rank] + ": put failed: " + err.to_string();
      ok = false;
    }
    t_.release(ids[i].id);
  }
  ids.clear();
  return ok;
}

bool all_to_all::exchange(const std::vector<std::span<const std::byte>>& send,
                          std::vector<std::span<const std::byte>>* recv, std::string* why) {
  return post(send, why) && complete(recv, why);
}

bool all_to_all::post(const std::vector<std::span<const std::byte>>& send, std::string* why) {
  if (!error_.empty()) return *why = error_, false;
  if (posted_) return *why = "all-to-all rank " + names_[cfg_.rank] + ": exchange " + std::to_string(seq_) + " is still open", false;
  if (peers_.size() != cfg_.size || send.size() != cfg_.size) {
    *why = "all-to-all rank " + names_[cfg_.rank] + ": " + std::to_string(send.size()) + " chunks and " +
           std::to_string(peers_.size()) + " peer keys for a group of " + std::to_string(cfg_.size);
    return false;
  }
  for (uint32_t d = 0; d < cfg_.size; ++d)
    if (send[d].size() > cfg_.slot_bytes) {
      *why = "all-to-all exchange " + std::to_string(seq_ + 1) + ": rank " + names_[cfg_.rank] + " -> " + names_[d] +
             ": chunk of " + std::to_string(send[d].size()) + " bytes exceeds the slot of " + std::to_string(cfg_.slot_bytes);
      return false;
    }
  const uint64_t seq = ++seq_;
  const uint64_t bells = uint64_t{cfg_.size} * sizeof(doorbell);
  const uint64_t my_slot = bank_offset(seq) + uint64_t{cfg_.rank} * stride();
  // Data, after its size: stored straight into each destination's slot for this rank where it is
  // mapped here, else staged and put (own chunk: a copy). An empty chunk sends nothing: its
  // doorbell says so.
  sizes_.assign(cfg_.size, 0);
  for (uint32_t d = 0; d < cfg_.size; ++d) {
    const uint64_t n = sizes_[d] = send[d].size();
    if (n == 0) continue;
    std::byte* to = d == cfg_.rank ? recv_ + my_slot : direct_[d] ? direct_[d] + my_slot : nullptr;
    if (to) {
      std::memcpy(to, &n, sizeof n);
      std::memcpy(to + sizeof n, send[d].data(), n);
      continue;
    }
    const uint64_t staged = bells + uint64_t{d} * stride();
    std::memcpy(send_.data() + staged, &n, sizeof n);
    std::memcpy(send_.data() + staged + sizeof n, send[d].data(), n);
    pending_.push_back({t_.post_put({seq, 0, names_[d], send_region_, peers_[d], {{staged, my_slot, sizeof n + n}}}), d});
  }
  posted_ = true;
  return true;
}

bool all_to_all::complete(std::vector<std::span<const std::byte>>* recv, std::string* why) {
  if (!posted_) return *why = "all-to-all rank " + names_[cfg_.rank] + ": complete() without post()", false;
  posted_ = false;
  const uint64_t seq = seq_;
  if (!wait_puts(pending_, why)) return false;
  // Doorbells, only after the data landed remotely (a completed put is remote-complete; a
  // direct store is ordered before the release store of its doorbell).
  for (uint32_t d = 0; d < cfg_.size; ++d) {
    const doorbell b = seq << 1 | (sizes_[d] == 0 ? 1 : 0);
    if (d == cfg_.rank || direct_[d]) {
      auto* bell = reinterpret_cast<doorbell*>((d == cfg_.rank ? recv_ : direct_[d]) + bell_offset(seq, cfg_.rank));
      std::atomic_ref<uint64_t>{*bell}.store(b, std::memory_order_seq_cst);  // release, and ordered before wake's look
      if (d != cfg_.rank) wake(d);
      continue;
    }
    std::memcpy(send_.data() + uint64_t{d} * sizeof(doorbell), &b, sizeof b);
    pending_.push_back({t_.post_put({seq, 0, names_[d], send_region_, peers_[d],
                                      {{uint64_t{d} * sizeof(doorbell), bell_offset(seq, cfg_.rank), sizeof b}}}),
                        d});
  }
  if (!wait_puts(pending_, why)) return false;
  // Every source's doorbell at this sequence: its chunk is here.
  recv->assign(cfg_.size, {});
  const auto deadline = std::chrono::steady_clock::now() + cfg_.timeout;
  waiting w;
  for (uint32_t s = 0; s < cfg_.size; ++s) {
    auto* bell = reinterpret_cast<doorbell*>(recv_ + bell_offset(seq, s));
    uint64_t word = 0;
    for (;;) {
      // Written by the peer (or its NIC): read it as an atomic, with acquire ordering for the data.
      word = std::atomic_ref<uint64_t>{*bell}.load(std::memory_order_acquire);
      if ((word >> 1) >= seq) break;
      if (abort_)
        if (auto reason = abort_(s); !reason.empty()) {
          *why = "all-to-all exchange " + std::to_string(seq) + ": rank " + names_[cfg_.rank] + " stops waiting for " +
                 names_[s] + ": " + reason;
          return false;
        }
      if (std::chrono::steady_clock::now() > deadline) {
        // The keys' fingerprints, as this rank holds them: a peer that stores into a region this
        // rank no longer reads (keys of an earlier meeting) shows as a mismatch with its own.
        *why = "all-to-all exchange " + std::to_string(seq) + ": rank " + names_[cfg_.rank] + " has nothing from " +
               names_[s] + " after " + std::to_string(cfg_.timeout.count()) + " ms (its last exchange: " +
               std::to_string(word >> 1) + "; keys here: " + names_[cfg_.rank] + " " + fingerprint(cfg_.rank) + ", " +
               names_[s] + " " + fingerprint(s) + ")";
        return false;
      }
      pause_for(&w, bell, seq, s);
    }
    const std::byte* slot = recv_ + bank_offset(seq) + uint64_t{s} * stride();
    uint64_t bytes = 0;
    if (!(word & 1)) std::memcpy(&bytes, slot, sizeof bytes);  // landed with the data, before the doorbell
    if (bytes > cfg_.slot_bytes) {
      *why = "all-to-all exchange " + std::to_string(seq) + ": rank " + names_[cfg_.rank] + " got a chunk of " +
             std::to_string(bytes) + " bytes from " + names_[s] + ", over the slot of " + std::to_string(cfg_.slot_bytes);
      return false;
    }
    (*recv)[s] = {slot + sizeof bytes, bytes};
  }
  return true;
}

}  // namespace baton::transport

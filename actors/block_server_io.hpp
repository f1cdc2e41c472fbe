#pragma once

// What a block server's I/O thread works on (internal to actors/block_server*.cpp): the state it
// shares with the actor, and the read path -- files to the reader's pages, layer by layer, each
// layer checked, damaged files deleted (block_server_read.cpp). The actor (block_server.cpp)
// queues jobs on the thread and handles writes, deletes and recovery.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "actors/block_server.hpp"
#include "store/block_file.hpp"
#include "store/block_index.hpp"
#include "store/block_key.hpp"
#include "store/staging_pool.hpp"
#include "transport/transport.hpp"

namespace baton::block_server_io {

/// What the I/O thread shares with the actor; owned by a shared_ptr so jobs in flight outlive
/// neither the staging buffer nor the transport.
struct io_context {
  block_server_config cfg;
  store::block_key salt;
  std::shared_ptr<transport::transport> xport;
  std::vector<std::byte> staging;        ///< reads: file -> here -> put to the reader
  uint64_t staging_region = 0;
  /// Read staging whose puts were given up while still in flight: the transport may yet read
  /// from it and land those bytes in the reader's pages, so it is neither refilled (the late put
  /// would carry another block's KV) nor freed until they settle. A fresh buffer replaces it.
  struct retired_staging {
    std::vector<std::byte> bytes;
    uint64_t region = 0;
    std::vector<uint64_t> puts;
    std::chrono::steady_clock::time_point at;  ///< when it was set aside
  };
  std::vector<retired_staging> retired;
  std::vector<uint64_t> abandoned;  ///< given-up puts out of the current staging
  /// Reads are refused while this many buffers still wait: a peer that never settles its puts
  /// must not make the server allocate without end.
  static constexpr size_t max_retired = 4;
  /// A buffer whose puts have not settled this many put limits after it was set aside is left to
  /// them and stops counting toward max_retired: one stuck peer must not stop every reader's
  /// reads for good. Its memory stays (kept on purpose, freed if they ever settle: freed before,
  /// the transport could still read it).
  static constexpr uint32_t retired_counts_for_limits = 6;
  /// ... up to this many buffers in all, old or recent: past it reads are refused until some
  /// settle, rather than a peer that never settles (a reader crashing again and again, over
  /// shared memory that fails no put) costing a staging buffer every few limits without end.
  static constexpr size_t max_retired_total = 16;
  /// The buffers set aside recently enough to count toward max_retired.
  size_t retired_recently() const {
    const auto horizon = std::chrono::steady_clock::now() - std::chrono::milliseconds{uint64_t{cfg.put_limit_ms} * retired_counts_for_limits};
    return static_cast<size_t>(std::count_if(retired.begin(), retired.end(), [&](const auto& r) { return r.at > horizon; }));
  }
  /// Why reads are refused while buffers wait on given-up puts, or empty when they are not.
  std::string retired_refusal() const {
    const size_t recent = retired_recently();
    if (recent < max_retired && retired.size() < max_retired_total) return {};
    const size_t n = recent >= max_retired ? recent : retired.size();
    return std::to_string(n) + " staging buffers wait on puts given up after " + std::to_string(cfg.put_limit_ms) + " ms" +
           (recent >= max_retired ? "" : " (at most " + std::to_string(max_retired_total) + " in all)");
  }
  /// Writes: the writer puts here, the I/O thread writes the file. The transport's own memory, so
  /// a writer on this host stores into it directly (transport::allocate_memory).
  std::shared_ptr<std::byte> write_memory;
  std::span<std::byte> write_staging;
  std::optional<transport::region_key> write_key;
  std::vector<std::byte> write_copy;  ///< the I/O thread's: a write's bytes, checked and written from here
  std::string setup_error;
  /// This process's first write sequence number: the wall clock at its start, in nanoseconds (or
  /// past the newest block file's modification time, if the clock is behind it: recover_blocks),
  /// so a restarted server's writes (and the blocks it finds on disk, which carry this number) are
  /// later than any of the process before it. The index keeps the latest write it heard of per
  /// copy and ignores a delete of an earlier one: counted from 0 again, a restarted server's
  /// deletes were ignored for keys its predecessor had written (the index kept naming files gone).
  uint64_t seq_base = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
  /// Each key written since start, with its write's sequence number (block_commit::write_seq):
  /// the I/O thread's alone. Blocks found on disk at start are seq_base.
  std::unordered_map<store::block_key, uint64_t, store::block_key_hash> written;
  uint64_t last_write_seq = seq_base;
  /// The write sequence number of `key`'s copy here, for a delete the index is told of.
  uint64_t seq_of(const store::block_key& key) const {
    const auto w = written.find(key);
    return w == written.end() ? seq_base : w->second;
  }
  /// Its block files, least recently used last (leaf-first, as the index orders blocks), each
  /// counted at store::block_disk_bytes: what cfg.capacity_bytes holds them to. The I/O thread's
  /// alone; a write or a read makes a block recent. Only the order counts here: no times, no
  /// expiry (the index expires blocks and sends the deletes).
  store::block_index on_disk;
  std::atomic<uint64_t> disk_bytes{0};  ///< on_disk.bytes(), for the actor's stats
  /// retired_refusal() held at the last read (the I/O thread's), for the actor's stats: such a
  /// server answers, but serves no read, and /health must not count it up.
  std::atomic<bool> refusing_reads{false};
  uint64_t delete_failures = 0;         ///< block files that could not be deleted (the I/O thread's)
  bool said_retired_full = false;       ///< max_retired_total was reached and said (the I/O thread's)
  uint32_t fault_writes_left = 0;       ///< cfg.fault_write_failures not yet injected
  uint32_t fault_writes_skip = 0;       ///< cfg.fault_write_after: writes still let through first
  std::atomic<bool> stopping{false};  ///< the actor is gone: abandon waits at once
  int dir_lock = -1;                   ///< store::lock_block_dir's descriptor (-1: not held)
  /// Shared with a predecessor of this directory in this process, still stopping: its writes may
  /// still be under way, so the scan leaves young temporary files alone.
  bool dir_lock_shared = false;
  ~io_context() {
    store::unlock_block_dir(dir_lock);
    for (auto id : abandoned) xport->release(id);
    for (auto& r : retired) {
      for (auto id : r.puts) xport->release(id);
      if (r.region) xport->deregister_region(r.region);
    }
    if (staging_region) xport->deregister_region(staging_region);
    if (write_key) xport->deregister_region(write_key->region_id);
    // The transport goes (with its progress thread) before the buffers: members die in reverse
    // order, so the read staging would be freed first, and a put still arriving (UCX over TCP
    // copies into the raw address) wrote into freed memory at shutdown. The write staging holds
    // the transport itself, which keeps its memory mapped until it goes.
    xport.reset();
  }
  // Results handed from the I/O thread to the actor, by job id.
  std::mutex mutex;
  std::unordered_map<uint64_t, std::function<void()>> done;
};

/// A block file deleted to keep the server within its capacity: the index is told which write.
struct disk_eviction {
  store::block_key key;
  uint64_t write_seq = 0;
};

/// Keeps a use of block `key` in its file's access time (a budget's order after a restart).
void mark_used(const io_context& io, const store::block_key& key);

/// Registers the read staging with the transport; an error sentence when it cannot.
std::string register_staging(io_context& io);

/// Serves a read on the I/O thread (block_server_read.cpp): layer-major, each layer of all blocks
/// read, checked against its checksum, then put, so the reader's layer l lands before layer l + 1.
/// No put starts after `deadline`. Blocks whose files are not there go to `gone`; so do damaged
/// ones, deleted, with why in `damaged`.
store_read_result serve_read(io_context& io, const store_read_order& order, uint64_t* bytes,
                             std::chrono::steady_clock::time_point deadline, std::vector<disk_eviction>* gone,
                             std::vector<std::string>* damaged);

}  // namespace baton::block_server_io

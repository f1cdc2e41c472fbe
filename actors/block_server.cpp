#include "actors/block_server.hpp"

#include "actors/block_index.hpp"

#include <caf/actor_ostream.hpp>
#include <caf/actor_system.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <unordered_map>

#include <unistd.h>

#include "gpu/kv_cache.hpp"
#include "actors/serial_worker.hpp"
#include "store/block_file.hpp"
#include "store/block_index.hpp"
#include "store/staging_pool.hpp"
#include "transport/transport.hpp"

namespace baton {

namespace {

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
  /// reads for good. Its memory stays (kept on purpose, freed if they ever settle).
  static constexpr uint32_t retired_counts_for_limits = 6;
  /// The buffers set aside recently enough to count toward max_retired.
  size_t retired_recently() const {
    const auto horizon = std::chrono::steady_clock::now() - std::chrono::milliseconds{uint64_t{cfg.put_limit_ms} * retired_counts_for_limits};
    return static_cast<size_t>(std::count_if(retired.begin(), retired.end(), [&](const auto& r) { return r.at > horizon; }));
  }
  /// Writes: the writer puts here, the I/O thread writes the file. The transport's own memory, so
  /// a writer on this host stores into it directly (transport::allocate_memory).
  std::shared_ptr<std::byte> write_memory;
  std::span<std::byte> write_staging;
  std::optional<transport::region_key> write_key;
  std::vector<std::byte> write_copy;  ///< the I/O thread's: a write's bytes, checked and written from here
  std::string setup_error;
  /// Each key written since start, with its write's sequence number (block_commit::write_seq):
  /// the I/O thread's alone. Blocks found on disk at start are 0.
  std::unordered_map<store::block_key, uint64_t, store::block_key_hash> written;
  uint64_t last_write_seq = 0;
  /// Its block files, least recently used last (leaf-first, as the index orders blocks), each
  /// counted at store::block_disk_bytes: what cfg.capacity_bytes holds them to. The I/O thread's
  /// alone; a write or a read makes a block recent. Only the order counts here: no times, no
  /// expiry (the index expires blocks and sends the deletes).
  store::block_index on_disk;
  std::atomic<uint64_t> disk_bytes{0};  ///< on_disk.bytes(), for the actor's stats
  uint32_t fault_writes_left = 0;       ///< cfg.fault_write_failures not yet injected
  uint32_t fault_writes_skip = 0;       ///< cfg.fault_write_after: writes still let through first
  std::atomic<bool> stopping{false};  ///< the actor is gone: abandon waits at once
  int dir_lock = -1;                   ///< store::lock_block_dir's descriptor (-1: not held)
  ~io_context() {
    if (dir_lock >= 0) ::close(dir_lock);
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

/// Puts `segments` from staging into the reader and waits (this is the I/O thread) until they
/// land or fail; returns an error or empty. `abandoned`: given up while still in flight.
std::string put_and_wait(io_context& io, const store_read_order& order, uint32_t layer,
                         std::vector<transport::segment> segments, bool* abandoned) {
  const auto& reg = order.region;
  // A stopping server posts nothing more: its readers were told the read failed, and the next
  // queued job would overwrite this put's source while the put might still read it.
  if (io.stopping.load()) return "put of layer " + std::to_string(layer) + " to " + order.reader + " not posted: the server stopped";
  transport::put_desc d{order.request_id, layer, order.reader, io.staging_region,
                        transport::region_key{reg.backend, reg.region_id, reg.size_bytes, reg.packed_key},
                        std::move(segments)};
  const uint64_t id = io.xport->post_put(d);
  transport::xfer_error err;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds{io.cfg.put_limit_ms};
  for (;;) {
    const auto s = io.xport->poll(id, &err);
    if (s == transport::xfer_state::done) break;
    if (s == transport::xfer_state::failed) {
      io.xport->release(id);
      return err.to_string();
    }
    if (std::chrono::steady_clock::now() > deadline || io.stopping.load()) {
      io.abandoned.push_back(id);  // not released: retire_staging() waits for it to settle
      *abandoned = true;
      return "put of layer " + std::to_string(layer) + " to " + order.reader +
             (io.stopping.load() ? " abandoned: the server stopped"
                                 : " still pending after " + std::to_string(io.cfg.put_limit_ms) + " ms");
    }
    std::this_thread::yield();
  }
  io.xport->release(id);
  return {};
}

/// Keeps a use of block `key` in its file's access time, for the order a restart trims by
/// (scan_block_dir). Only with a budget: a restart trims nothing without one, and a touch per hit
/// block is a system call on this thread for every CHECK and read.
void mark_used(const io_context& io, const store::block_key& key) {
  if (io.cfg.capacity_bytes) store::mark_block_used(store::block_path(io.cfg.dir, key));
}

/// A block file deleted to keep the server within its capacity: the index is told which write.
struct disk_eviction {
  store::block_key key;
  uint64_t write_seq = 0;
};

/// Deletes the files of `gone` (already out of io.on_disk), on the I/O thread: no read of them is
/// running (reads are jobs of this thread too), and one that opens them later finds no file, a
/// miss. Returns them with their writes, for the index.
std::vector<disk_eviction> delete_evicted(io_context& io, const std::vector<store::block_meta>& gone) {
  std::vector<disk_eviction> out;
  for (const auto& m : gone) {
    ::unlink(store::block_path(io.cfg.dir, m.key).c_str());
    auto w = io.written.find(m.key);
    out.push_back({m.key, w == io.written.end() ? 0 : w->second});
    if (w != io.written.end()) io.written.erase(w);
  }
  io.disk_bytes = io.on_disk.bytes();
  return out;
}

/// What the I/O thread made of a write order: an error sentence (and the system's errno, if it
/// gave one), or the write's sequence number; and the blocks deleted to make room for it.
struct write_outcome {
  store_write_order w;
  std::string err;
  uint64_t seq = 0;
  std::vector<disk_eviction> evicted{};
  int err_no = 0;
  bool disk_full = false;  ///< the disk refused it for room first (ENOSPC, EDQUOT) and blocks were deleted
};

/// What the I/O thread made of a read: the reader's answer, the bytes put, and the blocks whose
/// files were gone (for the index).
struct read_outcome {
  store_read_result result;
  uint64_t bytes = 0;
  std::vector<disk_eviction> gone;
  std::vector<std::string> damaged;  ///< why each damaged block it deleted was (also in gone)
};

/// Registers the read staging with the transport; an error sentence when it cannot.
std::string register_staging(io_context& io) {
  transport::xfer_error err;
  auto key = io.xport->register_region(io.staging.data(), io.staging.size(), &err);
  if (!key) return io.cfg.name + ": cannot register the read staging: " + err.to_string();
  io.staging_region = key->region_id;
  return {};
}

/// Sets the read staging aside with the puts given up out of it (io_context::retired) and
/// registers a fresh one; an error sentence when it cannot (reads then fail until it can).
std::string retire_staging(io_context& io) {
  io.retired.push_back({std::move(io.staging), io.staging_region, std::move(io.abandoned), std::chrono::steady_clock::now()});
  io.abandoned.clear();
  io.staging_region = 0;
  io.staging = {};
  if (io.stopping.load()) return io.cfg.name + " stopped";  // no fresh buffer for a server going away
  io.staging.assign(io.cfg.staging_bytes, std::byte{0});
  if (auto err = register_staging(io); !err.empty()) return err;
  if (io.retired_recently() >= io_context::max_retired)  // the rest of this read would only add more
    return io.cfg.name + " stopped this read: " + std::to_string(io.retired_recently()) +
           " staging buffers wait on puts given up after " + std::to_string(io.cfg.put_limit_ms) + " ms";
  return {};
}

/// Frees the retired buffers whose given-up puts have all settled (landed or failed).
void reap_retired(io_context& io) {
  for (auto r = io.retired.begin(); r != io.retired.end();) {
    std::erase_if(r->puts, [&](uint64_t id) {
      transport::xfer_error ignored;
      if (io.xport->poll(id, &ignored) == transport::xfer_state::pending) return false;
      io.xport->release(id);
      return true;
    });
    if (!r->puts.empty()) {
      ++r;
      continue;
    }
    if (r->region) io.xport->deregister_region(r->region);
    r = io.retired.erase(r);
  }
  if (io.staging_region == 0 && io.setup_error.empty() && !io.staging.empty()) register_staging(io);  // it failed before: again
}

/// What is wrong with a read order as a whole (empty: nothing). Orders come from other processes:
/// none may make the server divide by zero or reach outside the reader's pages or its staging.
std::string malformed(const io_context& io, const store_read_order& order) {
  const auto& reg = order.region;
  if (order.block_index.size() != order.blocks.size())
    return std::to_string(order.blocks.size()) + " blocks with " + std::to_string(order.block_index.size()) + " positions";
  if (reg.page_size_tokens == 0 || order.block_tokens == 0 || order.block_tokens % reg.page_size_tokens != 0)
    return "a block of " + std::to_string(order.block_tokens) + " tokens does not fill whole pages of " +
           std::to_string(reg.page_size_tokens);
  for (auto page : order.page_ids)
    if (page >= reg.num_pages)
      return "page " + std::to_string(page) + " is outside the reader's pool of " + std::to_string(reg.num_pages);
  const gpu::kv_layout layout{reg.num_layers, reg.num_pages, reg.page_size_tokens, reg.kv_dim, reg.kv_planes};
  const uint64_t block_layer_bytes = uint64_t{order.block_tokens / reg.page_size_tokens} * layout.page_bytes();
  if (block_layer_bytes == 0)  // no K/V plane or width: a layer of nothing (the batch size divides by it)
    return "the reader's pool has pages of 0 bytes (kv_dim " + std::to_string(reg.kv_dim) + ", planes " +
           std::to_string(reg.kv_planes) + ")";
  if (block_layer_bytes > io.staging.size())
    return "one layer of a block is " + std::to_string(block_layer_bytes) + " bytes, more than this server's staging of " +
           std::to_string(io.staging.size()) + " (store staging_bytes)";
  return {};
}

/// A read keeps at most this many block files open for its whole length (a read of more opens
/// each again per layer): the process's open files are bounded, usually by 1024.
constexpr size_t max_open_files_per_read = 64;

/// Why block header `h` cannot go into the reader's pages at block position `position` of
/// `order` (empty: it can): the first field that differs, with both values.
std::string layout_mismatch(const store::block_header& h, const store_read_order& order, const gpu::kv_layout& layout,
                            uint32_t position) {
  const uint32_t ppb = order.block_tokens / layout.page_size_tokens;  // malformed() made it whole
  const uint64_t block_layer_bytes = uint64_t{ppb} * layout.page_bytes();
  if (h.num_layers != layout.num_layers)
    return std::to_string(h.num_layers) + " layers, the reader's pool " + std::to_string(layout.num_layers);
  if (h.kv_dim != layout.kv_dim)
    return "kv_dim " + std::to_string(h.kv_dim) + ", the reader's " + std::to_string(layout.kv_dim);
  if (h.block_tokens != order.block_tokens)
    return "blocks of " + std::to_string(h.block_tokens) + " tokens, the order's " + std::to_string(order.block_tokens);
  if (h.page_tokens != layout.page_size_tokens)
    return "pages of " + std::to_string(h.page_tokens) + " tokens, the reader's " + std::to_string(layout.page_size_tokens);
  if (h.layer_bytes != block_layer_bytes)
    return "layers of " + std::to_string(h.layer_bytes) + " bytes, the reader's " + std::to_string(block_layer_bytes) +
           " (" + std::to_string(layout.planes) + " planes)";
  if ((uint64_t{position} + 1) * ppb > order.page_ids.size())
    return "at position " + std::to_string(position) + " it needs " + std::to_string((uint64_t{position} + 1) * ppb) +
           " of the order's pages, the order names " + std::to_string(order.page_ids.size());
  return {};
}

/// Reads layer `layer` of the block whose header was `h` into `dst` from a file opened for this
/// read alone and closed again; an error sentence or empty. The caller's checksum of the layer
/// against `h` catches a file rewritten with other bytes since `h` was read.
std::string read_layer_reopened(const io_context& io, const store::block_header& h, uint32_t layer, std::byte* dst) {
  std::string why;
  store::block_header now;
  const int fd = store::open_block_file(store::block_path(io.cfg.dir, h.key), io.salt, h.key, &now, &why);
  if (fd < 0) return "opened again for layer " + std::to_string(layer) + ": " + why;
  std::string err;
  if (now.num_layers != h.num_layers || now.layer_bytes != h.layer_bytes)
    err = "opened again for layer " + std::to_string(layer) + ": its layout changed during the read";
  else
    err = store::read_block_layer(fd, h, layer, dst);
  ::close(fd);
  return err;
}

/// Forgets block `key` (its file deleted behind the server's back, or `unlink`ed here): the
/// index hears of it through `gone`, or it would name the block, and readers would miss on it,
/// until it expires (days).
void forget_block(io_context& io, const store::block_key& key, bool unlink, std::vector<disk_eviction>* gone) {
  if (unlink) ::unlink(store::block_path(io.cfg.dir, key).c_str());
  auto w = io.written.find(key);
  gone->push_back({key, w == io.written.end() ? 0 : w->second});
  if (w != io.written.end()) io.written.erase(w);
  io.on_disk.erase(key);
  io.disk_bytes = io.on_disk.bytes();
}

/// Serves a read on the I/O thread: layer-major, each layer of all blocks (in staging-sized
/// batches) read, checked against its checksum, then put, so the reader's layer l lands before
/// layer l + 1. No put starts after `deadline`. Blocks whose files are not there go to `gone`;
/// so do damaged ones (a broken header, a short file, a layer off its checksum), deleted, with
/// why in `damaged`: each would fail every read of it until a rewrite, which may never come
/// (a read-only disk, a key only batch traffic reads), and nothing would say which file it is.
store_read_result serve_read(io_context& io, const store_read_order& order, uint64_t* bytes,
                             std::chrono::steady_clock::time_point deadline, std::vector<disk_eviction>* gone,
                             std::vector<std::string>* damaged) {
  const size_t n = order.blocks.size();
  store_read_result r{order.request_id, order.block_index, std::vector<std::string>(n), std::vector<std::vector<uint64_t>>(n)};
  const std::string bad = io.setup_error.empty() ? malformed(io, order) : io.setup_error;
  if (!bad.empty()) {
    for (auto& e : r.errors) e = io.setup_error.empty() ? "malformed read order from " + order.reader + ": " + bad : bad;
    return r;
  }
  reap_retired(io);
  if (io.staging_region == 0 || io.retired_recently() >= io_context::max_retired) {
    for (auto& e : r.errors)
      e = io.cfg.name + (io.staging_region == 0 ? " has no read staging: registering a fresh one failed"
                                                : " serves no reads while " + std::to_string(io.retired_recently()) +
                                                      " staging buffers wait on puts given up after " +
                                                      std::to_string(io.cfg.put_limit_ms) + " ms");
    return r;
  }
  // Queued past its budget (a backlog of reads or deletes ahead of it): answered at once, without
  // opening a file -- the reader is about to stop waiting, and a backlog must not grow on work
  // nobody will use.
  if (std::chrono::steady_clock::now() > deadline) {
    for (auto& e : r.errors)
      e = "the read's budget of " + std::to_string(order.budget_ms) + " ms ran out before it started (" + io.cfg.name +
          " was busy)";
    return r;
  }
  const auto& reg = order.region;
  const gpu::kv_layout layout{reg.num_layers, reg.num_pages, reg.page_size_tokens, reg.kv_dim, reg.kv_planes};
  const uint32_t ppb = order.block_tokens / reg.page_size_tokens;
  const uint64_t block_layer_bytes = uint64_t{ppb} * layout.page_bytes();
  // Few blocks: each file stays open for the whole read. More: none does (one is opened again
  // for each layer read from it), or a read of ~1000 blocks reached the usual limit of 1024 open
  // files and its later blocks failed.
  const bool keep_open = n <= max_open_files_per_read;
  std::vector<int> fds(n, -1);
  std::vector<char> usable(n, 0);  // its header fits the reader's pages: its layers are read
  std::vector<store::block_header> headers(n);
  for (size_t i = 0; i < n; ++i) {
    const store::block_key key{order.blocks[i].hi, order.blocks[i].lo};
    std::string why;
    bool no_file = false, broken = false;
    const int fd =
        store::open_block_file(store::block_path(io.cfg.dir, key), io.salt, key, &headers[i], &why, &no_file, &broken);
    if (fd < 0) {
      r.errors[i] = why;
      if (no_file) forget_block(io, key, false, gone);  // deleted behind the server's back (an operator freeing the disk)
      if (broken) {
        forget_block(io, key, true, gone);
        damaged->push_back(why);
      }
      continue;
    }
    if (auto differs = layout_mismatch(headers[i], order, layout, order.block_index[i]); !differs.empty()) {
      r.errors[i] = "block " + key.hex() + " does not match the reader's pages: " + differs;
      ::close(fd);
      continue;
    }
    usable[i] = 1;
    r.checksums[i] = headers[i].layer_checksums;
    if (keep_open) fds[i] = fd;
    else ::close(fd);
  }
  const auto good = [&](size_t i) { return usable[i] && r.errors[i].empty(); };
  std::vector<char> drop(n, 0);  // a layer could not be read, or was not what was written
  const size_t per_batch = std::max<uint64_t>(1, io.staging.size() / block_layer_bytes);  // >= 1 block layer: malformed()
  bool expired = false;
  for (uint32_t l = 0; l < layout.num_layers && !expired; ++l) {
    if (io.cfg.fault_layer_delay_ms) std::this_thread::sleep_for(std::chrono::milliseconds{io.cfg.fault_layer_delay_ms});
    for (size_t first = 0; first < n; first += per_batch) {
      if (std::chrono::steady_clock::now() > deadline) {
        // The reader is about to stop waiting: a put now could land after it has moved on.
        for (size_t i = 0; i < n; ++i)
          if (good(i))
            r.errors[i] = "the read's budget of " + std::to_string(order.budget_ms) + " ms ran out at layer " +
                          std::to_string(l) + " (" + io.cfg.name + " was busy)";
        expired = true;
        break;
      }
      std::vector<transport::segment> segs;
      for (size_t i = first; i < std::min(n, first + per_batch); ++i) {
        if (!good(i)) continue;
        std::byte* slot = io.staging.data() + (i - first) * block_layer_bytes;
        const auto err = keep_open ? store::read_block_layer(fds[i], headers[i], l, slot)
                                   : read_layer_reopened(io, headers[i], l, slot);
        if (!err.empty()) {
          r.errors[i] = "block " + headers[i].key.hex() + " on " + io.cfg.name + ": " + err;
          drop[i] = 1;
          continue;
        }
        // A layer whose bytes are not what was written never leaves the server: the reader's
        // end-to-end check would catch it, but only after it landed in pages being computed on.
        // (It also catches a file replaced between two openings of it.)
        if (std::max<uint64_t>(1, gpu::layer_checksum(l, slot, ppb, layout.page_bytes())) != headers[i].layer_checksums[l]) {
          r.errors[i] = "layer " + std::to_string(l) + " of block " + store::block_key{order.blocks[i].hi, order.blocks[i].lo}.hex() +
                        " on " + io.cfg.name + " failed its checksum: the file is corrupt";
          drop[i] = 1;
          continue;
        }
        for (uint32_t p = 0; p < ppb; ++p)
          segs.push_back({(i - first) * block_layer_bytes + p * layout.page_bytes(),
                          layout.offset_bytes(l, order.page_ids[uint64_t{order.block_index[i]} * ppb + p]), layout.page_bytes()});
        *bytes += block_layer_bytes;
      }
      if (segs.empty()) continue;
      if (auto err = put_and_wait(io, order, l, std::move(segs), &r.puts_abandoned); !err.empty()) {
        // A reader whose put failed or was given up (it died, or stalls) would fail each later
        // batch the same way, after the same wait, and every wait given up sets a staging buffer
        // aside: one order of many blocks used to stop this server's reads for a minute.
        for (size_t i = 0; i < n; ++i)
          if (good(i)) r.errors[i] = err;
        expired = true;
      }
      if (!io.abandoned.empty()) {
        // The next batch must not overwrite what a given-up put may still read.
        if (auto err = retire_staging(io); !err.empty()) {
          for (size_t i = 0; i < n; ++i)
            if (good(i)) r.errors[i] = err;
          expired = true;  // no more layers: there is no staging to read them into
        }
      }
      if (expired) break;
    }
    // This layer of every good block is in the reader's pages: it may compute the layer now.
    if (order.reader_actor && !expired) {
      store_layer_landed ev{order.request_id, l, {}, {}, order.tag};
      for (size_t i = 0; i < n; ++i)
        if (good(i)) {
          ev.block_index.push_back(order.block_index[i]);
          ev.checksums.push_back(headers[i].layer_checksums[l]);
        }
      caf::anon_send(order.reader_actor, std::move(ev));
    }
  }
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
  for (size_t i = 0; i < n; ++i)
    if (drop[i]) {
      forget_block(io, headers[i].key, true, gone);
      damaged->push_back(r.errors[i]);
    }
  // Blocks served were used: the least recently used go first when room is short (the budget,
  // or a full disk), and a prompt's leading blocks (touched last) after its later ones. With a
  // budget the files keep the use too, for the order after a restart (mark_used).
  std::vector<std::pair<uint32_t, store::block_key>> served;
  for (size_t i = 0; i < n; ++i)
    if (good(i)) {
      served.emplace_back(order.block_index[i], headers[i].key);
      mark_used(io, headers[i].key);
    }
  std::sort(served.begin(), served.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<store::block_key> keys;
  for (const auto& [position, key] : served) keys.push_back(key);
  io.on_disk.touch_chain(keys, 0.0);
  return r;
}

struct block_server_state {
  std::shared_ptr<io_context> io;
  /// Blocking file jobs, in order; each job's completion goes back to the actor as an io_atom
  /// message carrying the job id.
  std::unique_ptr<serial_worker> worker;  // destroyed first: joins the I/O thread
  /// CAF destroys the state before it runs attached functors, so the I/O thread is told to
  /// abandon its waits here, before the worker joins it. Jobs it drops take their response
  /// promises with them: readers get a broken-promise error at once, not a timeout.
  ~block_server_state() {
    if (io) io->stopping.store(true);
    for (auto& [id, r] : reads)
      r.second.deliver(make_error(errc::rank_unavailable, where(r.first, io ? io->cfg.name : std::string{}, "store_read") +
                                                              ": the block server stopped during the read"));
    // Writers too (CAF 0.17's promises say nothing when dropped: the writer would wait out its
    // order timeout with its staging held).
    for (auto& [id, w] : writes)
      w.second.deliver(make_error(errc::rank_unavailable, where(w.first, io ? io->cfg.name : std::string{}, "store_write") +
                                                              ": the block server stopped before the block was written"));
  }
  uint64_t last_read = 0;
  write_slot_table slots;
  /// Reads in progress (request id, promise): answered with an error if the server stops.
  std::unordered_map<uint64_t, std::pair<uint64_t, caf::typed_response_promise<store_read_result>>> reads;
  /// Writes in progress (request id, promise), by job: answered with an error if the server stops.
  std::unordered_map<uint64_t, std::pair<uint64_t, caf::typed_response_promise<uint64_t>>> writes;
  uint64_t last_write = 0;
  std::vector<block_index_actor> index;  ///< shards; a commit goes to its key's shard
  uint64_t last_job = 0;
  store_stats stats;
  /// A failed write was logged: later ones are only counted until a write succeeds (a full,
  /// read-only or failing disk would otherwise log every block of every write-back).
  bool write_failure_logged = false;
  /// A disk full short of the budget (or with none) was logged: said again only after a write
  /// that found room.
  bool disk_full_logged = false;
  static inline const char* name = "baton.block_server";
};

using pointer = block_server_actor::stateful_pointer<block_server_state>;

/// Runs `work` on the I/O thread; `then` runs on the actor afterwards.
template <class Work, class Then>
void run_io(pointer self, Work work, Then then) {
  auto& st = self->state;
  const uint64_t id = ++st.last_job;
  st.worker->post([io = st.io, id, work = std::move(work), then = std::move(then), owner = self->address()]() mutable {
    auto result = work(*io);
    {
      std::lock_guard<std::mutex> lock{io->mutex};
      io->done[id] = [then = std::move(then), result = std::move(result)]() mutable { then(std::move(result)); };
    }
    if (auto h = caf::actor_cast<caf::actor>(owner)) caf::anon_send(h, io_atom::value, id);
  });
}

/// A server starting on a directory that already holds blocks (a restart, a re-adopted store
/// node) tells the index about them again, so the cache survives the restart. First job of the
/// I/O thread: reads and writes that come meanwhile queue behind it.
void recover_blocks(pointer self) {
  run_io(
      self,
      [](io_context& io) {
        auto scan = store::scan_block_dir(io.cfg.dir, io.salt, io.dir_lock >= 0);
        // Least recently used first (written or read: scan_block_dir), so the last are the most
        // recent; beyond the capacity (it shrank since the blocks were written) the least recent
        // are deleted before the index hears of them.
        for (const auto& b : scan.blocks)
          io.on_disk.upsert({b.key, b.parent, {io.cfg.server_id}, store::block_disk_bytes(b.file_bytes),
                             static_cast<store::retention>(b.retention), std::numeric_limits<double>::infinity()},
                            0.0);
        const auto over = delete_evicted(io, io.on_disk.evict_to_capacity());
        std::erase_if(scan.blocks, [&](const store::found_block& b) { return !io.on_disk.find(b.key); });
        store::keep_chains_alive(scan.blocks, io.cfg.retention);
        return std::make_pair(std::move(scan), uint64_t{over.size()});
      },
      [self](std::pair<store::dir_scan, uint64_t> found) {
        auto& st = self->state;
        auto& scan = found.first;
        st.stats.disk_evicted += found.second;
        if (found.second)
          caf::aout(self) << st.io->cfg.name << ": deleted " << found.second << " blocks found in " << st.io->cfg.dir
                          << " beyond its capacity of " << st.io->cfg.capacity_bytes << " bytes, least recently written first"
                          << std::endl;
        if (st.index.empty()) return;
        st.stats.blocks_recovered += scan.blocks.size();
        st.stats.files_removed += scan.removed;
        uint64_t bytes = 0;
        // Per index shard, in batches (commit_batch_blocks), least recent first as scanned.
        std::vector<std::vector<block_commit>> batches(st.index.size());
        auto send = [&](size_t shard) {
          if (batches[shard].empty()) return;
          self->send(st.index[shard], commit_atom::value, std::exchange(batches[shard], {}));
        };
        for (const auto& b : scan.blocks) {
          bytes += b.file_bytes;
          // The KV bytes, as a write's commit says (the file adds its header).
          const uint64_t header = store::block_header::fixed_header_bytes;
          const uint64_t kv_bytes = b.file_bytes > header ? b.file_bytes - header : 0;
          block_ref ref{b.key.hi, b.key.lo, {st.io->cfg.server_id}};
          const size_t shard = shard_of(b.key, static_cast<uint32_t>(st.index.size()));
          batches[shard].push_back(block_commit{ref, b.parent.hi, b.parent.lo,
                                                store::to_string(static_cast<store::retention>(b.retention)), kv_bytes,
                                                std::max<uint64_t>(b.age_ms, 1)});
          if (batches[shard].size() >= commit_batch_blocks) send(shard);
        }
        for (size_t shard = 0; shard < batches.size(); ++shard) send(shard);
        if (scan.blocks.empty() && scan.removed == 0 && scan.foreign == 0) return;
        auto line = caf::aout(self);
        line << st.io->cfg.name << ": found " << scan.blocks.size() << " blocks (" << bytes / (1u << 20)
             << " MiB) in " << st.io->cfg.dir;
        if (scan.foreign) line << ", left " << scan.foreign << " of another model or layout alone";
        if (scan.removed) line << ", removed " << scan.removed << " unreadable or stale files (first: " << scan.first_removed << ")";
        line << std::endl;
      });
}

block_server_actor::behavior_type block_server_impl(pointer self, block_server_config cfg,
                                                    std::shared_ptr<transport::transport> xport,
                                                    std::vector<block_index_actor> index) {
  auto& st = self->state;
  st.index = std::move(index);
  st.io = std::make_shared<io_context>();
  auto& io = *st.io;
  io.cfg = std::move(cfg);
  const auto& c = io.cfg;
  io.salt = store::salt_of(c.identity);
  io.xport = std::move(xport);
  if (c.put_limit_ms == 0 || c.put_limit_ms > store_put_limit_ms)
    io.setup_error = c.name + ": put_limit_ms must be between 1 and " + std::to_string(store_put_limit_ms) + " (got " +
                     std::to_string(c.put_limit_ms) + "): readers hold their pages that long for a late put";
  io.staging.resize(c.staging_bytes);
  transport::xfer_error err;
  if (io.setup_error.empty()) io.setup_error = register_staging(io);
  if (io.setup_error.empty()) {
    io.write_memory = transport::transport_memory(io.xport, c.staging_bytes, &err);
    if (!io.write_memory) io.setup_error = c.name + ": no memory for the write staging: " + err.to_string();
  }
  if (io.write_memory) io.write_staging = {io.write_memory.get(), c.staging_bytes};
  if (io.setup_error.empty()) {
    io.write_key = io.xport->register_region(io.write_staging.data(), io.write_staging.size(), &err);
    if (!io.write_key) io.setup_error = c.name + ": cannot register the write staging: " + err.to_string();
  }
  st.slots.reset(io.write_staging.size(), io.write_key);
  io.on_disk.set_capacity_bytes(c.capacity_bytes);
  io.fault_writes_left = c.fault_write_errno ? c.fault_write_failures : 0;
  io.fault_writes_skip = c.fault_write_after;
  std::error_code ec;
  std::filesystem::create_directories(c.dir, ec);
  if (ec) io.setup_error = c.name + ": cannot create " + c.dir + ": " + ec.message();
  if (io.setup_error.empty()) {
    std::string why;
    io.dir_lock = store::lock_block_dir(c.dir, &why);
    if (io.dir_lock == -1) io.setup_error = c.name + ": " + why;  // -2: its predecessor here is stopping
  }
  st.worker = std::make_unique<serial_worker>();
  if (io.setup_error.empty()) recover_blocks(self);
  else caf::aout(self) << io.setup_error << " (every read and write of it fails)" << std::endl;
  // The staging buffer is deregistered when the last holder of the context (the I/O thread's
  // job, or the state) lets go of it.
  return {
      [=](store_read_order& order) -> caf::result<store_read_result> {
        auto promise = self->make_response_promise<store_read_result>();
        const uint64_t read_id = ++self->state.last_read;
        self->state.reads[read_id] = {order.request_id, promise};
        // The budget counts from here: time queued behind other reads and writes counts.
        const auto deadline = order.budget_ms ? std::chrono::steady_clock::now() + std::chrono::milliseconds{order.budget_ms}
                                              : std::chrono::steady_clock::time_point::max();
        run_io(
            self,
            [order = std::move(order), deadline](io_context& io) {
              read_outcome out;
              out.result = serve_read(io, order, &out.bytes, deadline, &out.gone, &out.damaged);
              return out;
            },
            [=](read_outcome out) mutable {
              auto& st = self->state;
              for (const auto& e : out.result.errors) ++(e.empty() ? st.stats.blocks_read : st.stats.read_failures);
              st.stats.bytes_read += out.bytes;
              st.stats.damaged_dropped += out.damaged.size();
              // Each once: the file is gone, and a write-back of the block makes a fresh one.
              for (const auto& why : out.damaged)
                caf::aout(self) << st.io->cfg.name << ": deleted a damaged block (request " << out.result.request_id
                                << " recomputes it): " << why << std::endl;
              for (const auto& g : out.gone)
                if (!st.index.empty())
                  self->send(st.index[shard_of(g.key, static_cast<uint32_t>(st.index.size()))], delete_atom::value,
                             st.io->cfg.server_id, g.key.hi, g.key.lo, g.write_seq);
              st.reads.erase(read_id);
              promise.deliver(std::move(out.result));
            });
        return promise;
      },
      [=](store_write_begin& b) -> caf::result<store_write_slot> {
        // Write step 1: a slot in the registered write staging, for the writer's one-sided put.
        auto& st = self->state;
        auto slot = st.slots.grant(b, st.io->cfg.name, st.io->setup_error);
        if (!slot) return std::move(slot.error());
        self->delayed_send(self, std::chrono::milliseconds{st.io->cfg.write_slot_ttl_ms}, expire_atom::value, slot->slot_id);
        return std::move(*slot);
      },
      [=](release_atom, uint64_t slot_id) {  // the writer's put failed: nothing comes for this slot
        if (self->state.slots.reclaim(slot_id)) ++self->state.stats.slots_reclaimed;
      },
      [=](expire_atom, uint64_t slot_id) {
        // No write order came in time. A put of it that lands later goes into a slot that may be
        // someone else's by then; the write it corrupts fails its checksum and is not committed.
        if (self->state.slots.reclaim(slot_id)) ++self->state.stats.slots_reclaimed;
      },
      [=](store_write_order& w) -> caf::result<uint64_t> {
        // Write step 2: the bytes are in the slot; the I/O thread writes the block file from it.
        auto& st = self->state;
        const auto slot = st.slots.claim(w.slot_id);
        if (!slot)
          return make_error(errc::bad_request, where(w.request_id, st.io->cfg.name, "store_write") +
                                                   ": unknown slot " + std::to_string(w.slot_id) +
                                                   " (never granted, taken back after write_slot_ttl_ms, or in use)");
        // The order's size is the slot's: more would checksum and store a neighbouring slot's bytes.
        if (w.bytes != slot->bytes) {
          st.slots.release(w.slot_id);
          return make_error(errc::bad_request, where(w.request_id, st.io->cfg.name, "store_write") + ": a write of " +
                                                   std::to_string(w.bytes) + " bytes into slot " +
                                                   std::to_string(w.slot_id) + " of " + std::to_string(slot->bytes));
        }
        const uint64_t offset = slot->offset;
        auto promise = self->make_response_promise<uint64_t>();
        const uint64_t write_id = ++st.last_write;
        st.writes.emplace(write_id, std::make_pair(w.request_id, promise));
        run_io(
            self,
            [w = std::move(w), offset](io_context& io) {
              const store::block_key key{w.block.hi, w.block.lo};
              const auto path = store::block_path(io.cfg.dir, key);
              const uint32_t layers = static_cast<uint32_t>(w.checksums.size());
              if (!io.setup_error.empty()) return write_outcome{std::move(w), io.setup_error};
              // Stopping: not worth a file nobody will commit (the writer hears so at once).
              if (io.stopping.load()) return write_outcome{std::move(w), "the block server is stopping"};
              if (layers == 0 || w.bytes % layers != 0 || w.bytes > io.write_staging.size() ||
                  offset > io.write_staging.size() - w.bytes ||  // a remote size: no sum that can wrap
                  w.page_tokens == 0 || w.block_tokens == 0 || w.block_tokens % w.page_tokens != 0 ||
                  (w.bytes / layers) % (w.block_tokens / w.page_tokens) != 0)
                return write_outcome{std::move(w), "block of " + std::to_string(w.bytes) + " bytes is not whole layers (" +
                                                       std::to_string(layers) + ") of whole pages (" +
                                                       std::to_string(w.page_tokens) + " tokens, blocks of " +
                                                       std::to_string(w.block_tokens) + ")"};
              // The bytes checked and written are a copy: a late put into this slot (a writer
              // that gave up its put, the slot taken back and granted again) could otherwise land
              // between the check and the write, and a block file that fails its own checksums
              // would be committed.
              io.write_copy.assign(io.write_staging.begin() + static_cast<ptrdiff_t>(offset),
                                   io.write_staging.begin() + static_cast<ptrdiff_t>(offset + w.bytes));
              // The bytes must be what the writer checksummed: a put that failed silently, or a
              // late put into a reclaimed slot, must never become a block file.
              const uint64_t layer_bytes = w.bytes / layers;
              const uint32_t ppb = w.block_tokens / w.page_tokens;
              for (uint32_t l = 0; l < layers; ++l)
                if (std::max<uint64_t>(1, gpu::layer_checksum(l, io.write_copy.data() + l * layer_bytes, ppb,
                                                              layer_bytes / ppb)) != w.checksums[l])
                  return write_outcome{std::move(w), "layer " + std::to_string(l) + " in the write slot differs from what the writer checksummed"};
              const uint64_t disk_bytes = store::block_disk_bytes(store::block_header::fixed_header_bytes + w.bytes);
              if (io.cfg.capacity_bytes && disk_bytes > io.cfg.capacity_bytes)
                return write_outcome{std::move(w), "a block file of " + std::to_string(disk_bytes) + " bytes on disk is more than " +
                                                       io.cfg.name + "'s capacity of " + std::to_string(io.cfg.capacity_bytes)};
              // Room first, so the disk holds no more than the capacity even while the file is
              // written. A rewrite short of room deletes its own old copy first, which the new one
              // replaces anyway (no read runs in between: reads are jobs of this thread); should
              // the write fail, the block is a miss.
              auto evicted = delete_evicted(io, io.on_disk.evict_for(key, disk_bytes));
              // Always (re)written, atomically: a block that failed a reader's checksum is repaired
              // by the next write-back of it (writers skip blocks they loaded intact).
              store::block_header h{io.salt, key, {w.parent_hi, w.parent_lo}, layers, w.kv_dim, w.block_tokens,
                                    w.page_tokens, w.bytes / layers, w.checksums,
                                    static_cast<uint8_t>(store::parse_retention(w.retention).value_or(store::retention::chat))};
              const auto* base = io.write_copy.data();
              int err_no = 0;
              const auto write_file = [&] {
                int fault = 0;
                if (io.fault_writes_skip) --io.fault_writes_skip;
                else if (io.fault_writes_left) fault = io.cfg.fault_write_errno, --io.fault_writes_left;
                return store::write_block_file(
                    path, h, [&](uint32_t l) { return store::layer_pieces{{base + l * h.layer_bytes, h.layer_bytes}}; },
                    &err_no, fault);
              };
              auto err = write_file();
              bool disk_full = false;
              if (!err.empty() && (err_no == ENOSPC || err_no == EDQUOT)) {
                // The disk filled short of the budget (others write to it too), or with none:
                // room is made as a budget makes it -- the least recently used blocks, as many
                // bytes as this one takes -- and the write tried once more. Else every later write
                // would be refused until the index expired blocks, days later.
                auto more = delete_evicted(io, io.on_disk.evict_bytes(disk_bytes));
                if (!more.empty()) {
                  evicted.insert(evicted.end(), more.begin(), more.end());
                  disk_full = true;
                  err_no = 0;
                  err = write_file();
                }
              }
              uint64_t seq = 0;
              if (err.empty()) {
                io.written[key] = seq = ++io.last_write_seq;
                io.on_disk.upsert({key, h.parent, {io.cfg.server_id}, disk_bytes, static_cast<store::retention>(h.retention),
                                   std::numeric_limits<double>::infinity()},
                                  0.0);
                io.disk_bytes = io.on_disk.bytes();
              }
              return write_outcome{std::move(w), std::move(err), seq, std::move(evicted), err_no, disk_full};
            },
            [=](write_outcome out) mutable {
              auto& s = self->state;
              s.writes.erase(write_id);
              s.slots.release(out.w.slot_id);
              // Before this write's commit (one sender, one receiver: in order), so a key deleted
              // to make room for its own rewrite is gone and then back.
              const store::block_key own{out.w.block.hi, out.w.block.lo};
              for (const auto& e : out.evicted) {
                // Its own old copy, deleted for room: the new write's commit replaces it in the
                // index, which keeps the expiry its descendants extended -- unless the write failed.
                // Nor is it counted as evicted then: the block is still here.
                if (e.key == own && out.err.empty()) continue;
                ++s.stats.disk_evicted;
                if (!s.index.empty())
                  self->send(s.index[shard_of(e.key, static_cast<uint32_t>(s.index.size()))], delete_atom::value,
                             s.io->cfg.server_id, e.key.hi, e.key.lo, e.write_seq);
              }
              // The cache shrinks to the disk it has: said once, as the budget's evictions are not.
              if (out.disk_full && !s.disk_full_logged)
                caf::aout(self) << s.io->cfg.name << ": the disk is full (short of any --store-capacity-gib): deleted "
                                << out.evicted.size() << " least recently used block(s) to write one of request "
                                << out.w.request_id << " (later deletions for room are counted in "
                                << "baton_store_disk_evicted_blocks_total, not logged, until a write finds room)"
                                << std::endl;
              if (out.disk_full) s.disk_full_logged = true;
              else if (out.err.empty()) s.disk_full_logged = false;  // a write that found room
              if (!out.err.empty()) {  // a failed write-back is a future miss, nothing more
                ++s.stats.write_failures;
                const bool no_space = out.err_no == ENOSPC || out.err_no == EDQUOT;
                s.stats.write_no_space += no_space;
                // Once until a write succeeds: a read-only or failing disk fails every block of
                // every write-back, and logged each of them.
                if (!s.write_failure_logged)
                  caf::aout(self) << s.io->cfg.name << ": block " << store::block_key{out.w.block.hi, out.w.block.lo}.hex()
                                  << " of request " << out.w.request_id << " not written: " << out.err
                                  << " (later failed writes are counted in baton_store_write_failures_total, not logged, "
                                  << "until one succeeds)" << std::endl;
                s.write_failure_logged = true;
                promise.deliver(uint64_t{0});
                return;
              }
              s.write_failure_logged = false;
              promise.deliver(out.w.bytes);
              ++s.stats.blocks_written;
              s.stats.bytes_written += out.w.bytes;
              block_ref b{out.w.block.hi, out.w.block.lo, {s.io->cfg.server_id}};
              if (!s.index.empty())  // a server on its own (tests) has no index to tell
                self->send(s.index[shard_of({b.hi, b.lo}, static_cast<uint32_t>(s.index.size()))], commit_atom::value,
                           std::vector<block_commit>{{b, out.w.parent_hi, out.w.parent_lo, out.w.retention, out.w.bytes, 0, out.seq}});
            });
        return promise;
      },
      [=](delete_atom, uint64_t hi, uint64_t lo, uint64_t seq) {
        run_io(
            self,
            [hi, lo, seq](io_context& io) {
              // A later write of the key than the index evicted (one queued before this delete,
              // whose commit the index had not seen) stays: the index learns of it by that commit.
              const store::block_key key{hi, lo};
              auto w = io.written.find(key);
              if (w != io.written.end() && w->second > seq) return 0;
              ::unlink(store::block_path(io.cfg.dir, key).c_str());
              if (w != io.written.end()) io.written.erase(w);
              io.on_disk.erase(key);
              io.disk_bytes = io.on_disk.bytes();
              return 0;
            },
            [](int) {});
      },
      [=](touch_atom, std::vector<uint64_t>& keys) {
        // The index's CHECK hits on this server's blocks: uses its reads never see (a prefill
        // rank's own prefix cache serves a hot chain's leading blocks), which the LRU must count
        // -- for the budget, a full disk (with or without one) and the order after a restart --
        // or the most used chains would be the first deleted.
        run_io(
            self,
            [keys = std::move(keys)](io_context& io) {
              std::vector<store::block_key> chain;
              for (size_t i = 0; i + 1 < keys.size(); i += 2) chain.push_back({keys[i], keys[i + 1]});
              io.on_disk.touch_chain(chain, 0.0);
              for (const auto& k : chain)
                if (io.on_disk.find(k)) mark_used(io, k);
              return 0;
            },
            [](int) {});
      },
      [=](stats_atom) {
        auto s = self->state.stats;
        s.disk_bytes = self->state.io->disk_bytes.load();
        return s;
      },
      [=](io_atom, uint64_t id) {
        std::function<void()> then;
        {
          auto& io = *self->state.io;
          std::lock_guard<std::mutex> lock{io.mutex};
          auto i = io.done.find(id);
          if (i == io.done.end()) return;
          then = std::move(i->second);
          io.done.erase(i);
        }
        then();
      },
  };
}

}  // namespace

block_server_actor spawn_block_server(caf::actor_system& sys, block_server_config cfg,
                                      std::shared_ptr<transport::transport> xport,
                                      std::vector<block_index_actor> index) {
  return sys.spawn(block_server_impl, std::move(cfg), std::move(xport), std::move(index));
}

}  // namespace baton

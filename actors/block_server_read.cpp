// A block server's read path, on its I/O thread (block_server_io.hpp): block files into the
// reader's KV pages through the transport, layer by layer, each layer checked against the
// checksum its writer gave before it leaves the server; damaged files deleted and named.

#include "actors/block_server_io.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include <unistd.h>

#include <caf/send.hpp>

#include "gpu/kv_cache.hpp"
#include "store/block_file.hpp"

namespace baton::block_server_io {

namespace {

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

}  // namespace

/// Keeps a use of block `key` in its file's access time, for the order a restart trims by
/// (scan_block_dir). Only with a budget: a restart trims nothing without one, and a touch per hit
/// block is a system call on this thread for every CHECK and read.
void mark_used(const io_context& io, const store::block_key& key) {
  if (io.cfg.capacity_bytes) store::mark_block_used(store::block_path(io.cfg.dir, key));
}

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
  if (auto why = io.retired_refusal(); !why.empty())  // the rest of this read would only add more
    return io.cfg.name + " stopped this read: " + why;
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
/// read alone and closed again; an error sentence or empty (`damaged`: the file's fault, not the
/// system's). The caller's checksum of the layer against `h` catches a file rewritten with other
/// bytes since `h` was read.
std::string read_layer_reopened(const io_context& io, const store::block_header& h, uint32_t layer, std::byte* dst,
                                bool* damaged, bool* no_file) {
  std::string why;
  store::block_header now;
  const int fd = store::open_block_file(store::block_path(io.cfg.dir, h.key), io.salt, h.key, &now, &why, no_file, damaged);
  if (fd < 0) return "opened again for layer " + std::to_string(layer) + ": " + why;
  std::string err;
  if (now.num_layers != h.num_layers || now.layer_bytes != h.layer_bytes)
    err = "opened again for layer " + std::to_string(layer) + ": its layout changed during the read";
  else
    err = store::read_block_layer(fd, h, layer, dst, damaged);
  ::close(fd);
  return err;
}

/// Forgets block `key` (its file deleted behind the server's back, or `unlink`ed here): the
/// index hears of it through `gone`, or it would name the block, and readers would miss on it,
/// until it expires (days). What is left to say when the file could not be deleted (a read-only
/// disk), else empty.
std::string forget_block(io_context& io, const store::block_key& key, bool unlink, std::vector<disk_eviction>* gone) {
  std::string left;
  if (unlink) {
    const std::string path = store::block_path(io.cfg.dir, key);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      const int err = errno;
      left = std::string{" (its file stays: "} + std::strerror(err) + "; no reader is sent to it)";
    }
  }
  gone->push_back({key, io.seq_of(key)});
  io.written.erase(key);
  io.on_disk.erase(key);
  io.disk_bytes = io.on_disk.bytes();
  return left;
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
  // Sixteen buffers in all wait on puts that never settle: the server serves no read until some
  // do, while /health counts it up -- said once each time it comes to that.
  const bool full = io.retired.size() >= io_context::max_retired_total;
  if (full && !std::exchange(io.said_retired_full, true))
    std::fprintf(stderr, "%s: serves no reads while %zu staging buffers wait on puts it gave up (a reader's transport "
                         "never settles them); its writes go on; restart it (or its stuck readers) to serve reads again\n",
                 io.cfg.name.c_str(), io.retired.size());
  if (!full) io.said_retired_full = false;
  const auto why = io.retired_refusal();
  io.refusing_reads = io.staging_region == 0 || !why.empty();
  if (io.refusing_reads) {
    for (auto& e : r.errors)
      e = io.cfg.name + (io.staging_region == 0 ? " has no read staging: registering a fresh one failed"
                                                : " serves no reads while " + why);
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
        damaged->push_back(why + forget_block(io, key, true, gone));
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
  std::vector<char> drop(n, 0);  // 1: a layer ended early or was not what was written; 2: the file went
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
        bool damaged_file = false;  // the file's fault (it ends early), not the system's (EIO, EMFILE)
        bool gone_now = false;      // deleted since the read began (an operator freeing the disk)
        const auto err = keep_open ? store::read_block_layer(fds[i], headers[i], l, slot, &damaged_file)
                                   : read_layer_reopened(io, headers[i], l, slot, &damaged_file, &gone_now);
        if (!err.empty()) {
          r.errors[i] = "block " + headers[i].key.hex() + " on " + io.cfg.name + ": " + err;
          drop[i] = damaged_file ? 1 : gone_now ? 2 : 0;
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
  for (size_t i = 0; i < n; ++i) {
    if (drop[i] == 1) damaged->push_back(r.errors[i] + forget_block(io, headers[i].key, true, gone));
    if (drop[i] == 2) forget_block(io, headers[i].key, false, gone);
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

}  // namespace baton::block_server_io

#include "actors/block_server.hpp"

#include "actors/block_index.hpp"
#include "actors/block_server_io.hpp"

#include <caf/actor_ostream.hpp>
#include <caf/actor_system.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
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

using namespace block_server_io;


/// Deletes block `key`'s file, on the I/O thread. A failure other than "not there" (a read-only or
/// failing disk, a file another user owns) leaves a file the disk budget no longer counts: said
/// on the first one, counted after.
void unlink_block(io_context& io, const store::block_key& key) {
  const std::string path = store::block_path(io.cfg.dir, key);
  if (::unlink(path.c_str()) == 0 || errno == ENOENT) return;
  if (io.delete_failures++ == 0)
    std::fprintf(stderr, "%s: could not delete %s (%s); the disk holds more than its budget counts (later failures are "
                         "not said again)\n",
                 io.cfg.name.c_str(), path.c_str(), std::strerror(errno));
}

/// Deletes the files of `gone` (already out of io.on_disk), on the I/O thread: no read of them is
/// running (reads are jobs of this thread too), and one that opens them later finds no file, a
/// miss. Returns them with their writes, for the index.
std::vector<disk_eviction> delete_evicted(io_context& io, const std::vector<store::block_meta>& gone) {
  std::vector<disk_eviction> out;
  for (const auto& m : gone) {
    unlink_block(io, m.key);
    out.push_back({m.key, io.seq_of(m.key)});
    io.written.erase(m.key);
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
  /// The errnos (0: none) of failed writes logged since the last write that succeeded: each kind
  /// of failure is logged once, later ones only counted.
  std::vector<int> write_failures_logged;
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
        auto scan = store::scan_block_dir(io.cfg.dir, io.salt, io.dir_lock >= 0 && !io.dir_lock_shared);
        // Past every write of the processes before this one, even if the wall clock stepped back
        // since: each of their sequence numbers is at most the time of their last write, which
        // the newest file's modification time is (io_context::seq_base).
        if (scan.newest_write_ns >= io.seq_base) io.seq_base = io.last_write_seq = scan.newest_write_ns + 1;
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
                          << " beyond its capacity of " << st.io->cfg.capacity_bytes << " bytes, least recently used first (by their files' access times)"
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
                                                std::max<uint64_t>(b.age_ms, 1), st.io->seq_base});
          if (batches[shard].size() >= commit_batch_blocks) send(shard);
        }
        for (size_t shard = 0; shard < batches.size(); ++shard) send(shard);
        if (scan.blocks.empty() && scan.removed == 0 && scan.foreign == 0 && scan.unreadable_folders == 0) return;
        auto line = caf::aout(self);
        line << st.io->cfg.name << ": found " << scan.blocks.size() << " blocks (" << bytes / (1u << 20)
             << " MiB) in " << st.io->cfg.dir;
        if (scan.foreign) line << ", left " << scan.foreign << " of another model or layout alone";
        if (scan.removed) line << ", removed " << scan.removed << " unreadable or stale files (first: " << scan.first_removed << ")";
        if (scan.unreadable_folders)
          line << ", could not list " << scan.unreadable_folders << " folders (their blocks are not served nor counted "
               << "against the disk budget until a start that lists them; first: " << scan.first_unreadable << ")";
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
    io.dir_lock = store::lock_block_dir(c.dir, &why, &io.dir_lock_shared);
    if (io.dir_lock < 0) io.setup_error = c.name + ": " + why;
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
                caf::aout(self) << st.io->cfg.name << ": dropped a damaged block (request " << out.result.request_id
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
                // Each kind of failure once until a write succeeds: a read-only or failing disk
                // fails every block of every write-back, and logged each of them.
                if (std::find(s.write_failures_logged.begin(), s.write_failures_logged.end(), out.err_no) ==
                    s.write_failures_logged.end())
                  caf::aout(self) << s.io->cfg.name << ": block " << store::block_key{out.w.block.hi, out.w.block.lo}.hex()
                                  << " of request " << out.w.request_id << " not written: " << out.err
                                  << " (later failed writes are counted in baton_store_write_failures_total, not logged, "
                                  << "until one succeeds)" << std::endl;
                if (std::find(s.write_failures_logged.begin(), s.write_failures_logged.end(), out.err_no) ==
                    s.write_failures_logged.end())
                  s.write_failures_logged.push_back(out.err_no);
                promise.deliver(uint64_t{0});
                return;
              }
              s.write_failures_logged.clear();
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
              unlink_block(io, key);
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
        s.refusing_reads = self->state.io->refusing_reads.load() ? 1 : 0;
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

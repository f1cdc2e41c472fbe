#pragma once

// One KV block on disk: a header (model salt, key, parent, layout, per-layer checksums, its own
// checksum) padded to 4 KiB, then the block's KV layer-major — layer 0 of all its pages, layer
// 1, ... — so one layer of many blocks is one read per file at a known offset. Files are written
// to a temporary name and renamed, so a reader never sees half a block.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "store/block_key.hpp"

namespace baton::store {

struct block_header {
  /// 2: eight-lane layer checksums (kv_layer_checksum); 3: the retention class (a store that
  /// restarts finds its blocks again and must expire them as they would have been); 4: the same
  /// layout under SHA-256 keys (earlier files are deleted by the scan: nothing asks for their keys).
  static constexpr uint32_t version = 4;
  block_key salt;     ///< model identity and KV layout (kv_identity)
  block_key key;
  block_key parent;   ///< empty for a prompt's first block
  uint32_t num_layers = 0;
  uint32_t kv_dim = 0;
  uint32_t block_tokens = 0;
  uint32_t page_tokens = 0;
  uint64_t layer_bytes = 0;                ///< bytes of one layer of the block
  std::vector<uint64_t> layer_checksums;   ///< gpu::kv_cache::kv_layer_checksum of each layer's pages
  uint8_t retention = 0;                   ///< store::retention (0 chat, 1 agent); 0 in version 2 files

  static constexpr uint64_t fixed_header_bytes = 4096;
  uint64_t header_bytes() const { return fixed_header_bytes; }
  uint64_t layer_offset(uint32_t layer) const { return header_bytes() + uint64_t{layer} * layer_bytes; }
  uint64_t file_bytes() const { return header_bytes() + uint64_t{num_layers} * layer_bytes; }
};

/// Pieces of one layer's bytes, in order (a block's pages need not be contiguous in a pool).
using layer_pieces = std::vector<std::pair<const std::byte*, uint64_t>>;

/// dir/<first two hex digits>/<32 hex digits>.blk
std::string block_path(const std::string& dir, const block_key& key);

/// What a block file of `file_bytes` takes on disk as a block server's capacity counts it: whole
/// 4 KiB blocks, the usual file systems' allocation unit, so that the count is what `du` shows.
inline uint64_t block_disk_bytes(uint64_t file_bytes) { return (file_bytes + 4095) / 4096 * 4096; }

/// Why `gib` cannot be a store's disk budget in GiB (empty: it can), naming `what` (the flag or
/// key it came from): it must be finite and >= 0 (0: unbounded).
std::string capacity_gib_error(double gib, const std::string& what);
/// A budget in GiB as whole bytes (beyond 2^64 bytes, the most there is; 0 for what
/// capacity_gib_error refuses).
uint64_t capacity_bytes_of(double gib);

/// Writes the block atomically; returns an error sentence (naming the file and the system's
/// error) or empty. A failed write leaves no file behind, not even its temporary one.
/// `failed_errno`: set to the errno of the failure, where the system gave one (ENOSPC: the disk
/// is full). `fault_errno`: fault injection for tests (a disk that fills or fails), never set
/// outside them: the first layer's write fails with this errno after the header is written.
std::string write_block_file(const std::string& path, const block_header& h,
                             const std::function<layer_pieces(uint32_t layer)>& layer_data,
                             int* failed_errno = nullptr, int fault_errno = 0);

/// Opens and validates a block file against the expected salt and key. On failure returns -1
/// and a sentence (missing, truncated, corrupt header, other model...); `no_file` (if given) says
/// whether the file was not there at all, `damaged` whether it is there but can never be read as
/// this block (what scan_block_dir deletes: a broken header, another block's bytes; not a read
/// the system failed, EIO, nor an open it refused, EMFILE).
int open_block_file(const std::string& path, const block_key& salt, const block_key& key, block_header* out,
                    std::string* why, bool* no_file = nullptr, bool* damaged = nullptr);

/// Reads layer `layer` of an open block into dst (h.layer_bytes); error sentence or empty.
/// `damaged`: the failure is the file's (it ends early), not the system's (EIO, ...).
std::string read_block_layer(int fd, const block_header& h, uint32_t layer, std::byte* dst, bool* damaged = nullptr);

/// A block of this model found in a store directory: what the index needs to know it again.
struct found_block {
  block_key key;
  block_key parent;
  uint8_t retention = 0;
  uint64_t file_bytes = 0;
  uint64_t age_ms = 0;  ///< since the file was last written
};

/// What a block server starting on an existing directory found there.
struct dir_scan {
  std::vector<found_block> blocks;  ///< least recently used first: committed in this order, the last most recent
  uint64_t removed = 0;             ///< unreadable block files and stale temporary files, deleted
  uint64_t foreign = 0;             ///< block files of another model or KV layout (or a newer format), left alone
  std::string first_removed;        ///< why the first removed file went (for the server's log line)
  uint64_t unreadable_folders = 0;  ///< folders whose listing failed (skipped; their files are found at a later start)
  uint64_t newest_write_ns = 0;     ///< the latest modification time of a block found, ns since the epoch
  std::string first_unreadable;     ///< the first of them, and why
};

/// Temporary files older than this are a crashed writer's leftovers (a write takes seconds).
inline constexpr std::chrono::seconds stale_temp_after{600};

/// Walks `dir` (dir/<2 hex>/<32 hex>.blk): collects the blocks written for `salt`, deletes block
/// files that can never be read (corrupt or truncated header, a name that is not their key, a
/// size that is not their layout's) and temporary files older than stale_temp_after. A missing
/// directory is an empty one. Headers only: the layers are checked when a block is read. The
/// blocks come least recently used first: by the later of a file's write and its last use
/// (mark_block_used), so a restart keeps an old block that is still read (a system prompt's).
/// `sole_writer`: the caller holds the directory's lock (lock_block_dir), so no writer is alive
/// and every temporary file is a dead one's, deleted whatever its age (it took disk nobody counted).
dir_scan scan_block_dir(const std::string& dir, const block_key& salt, bool sole_writer = false);

/// Takes `dir`'s lock (`dir/.lock`, an flock the kernel lets go of however the process ends): one
/// block server per directory, or two each hold the disk to their own budget (twice it, in all)
/// and delete blocks the other one's index lists. A descriptor to let go of with
/// unlock_block_dir, the file holding this process's pid; -1 and a sentence naming the holder's
/// pid when another process holds it (or the file cannot be made). When this process holds it
/// already (a server of the directory still stopping as its successor starts; told by the file's
/// device and inode, not by the pid), the holders share it: `shared` says so, and the lock lasts
/// until the last one lets go.
/// `lock_name`: the lock file's name in `dir` (a store node's own, beside the head's).
int lock_block_dir(const std::string& dir, std::string* why, bool* shared = nullptr, const std::string& lock_name = ".lock");
/// Lets go of a descriptor lock_block_dir gave (the lock goes with the last one); nothing for -1.
void unlock_block_dir(int fd);

/// Marks a block file used now, in its access time (its write time, from which the block's age
/// counts, stays): what scan_block_dir orders by after a restart. Set outright, whatever the
/// mount's atime policy; best effort (a file gone meanwhile is nothing).
void mark_block_used(const std::string& path);

}  // namespace baton::store

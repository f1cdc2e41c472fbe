#include "store/block_file.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace baton::store {

namespace {

constexpr char magic[8] = {'B', 'A', 'T', 'O', 'N', 'K', 'V', '1'};

/// Little-endian field writer/reader over the fixed 4 KiB header.
struct cursor {
  unsigned char* p;
  size_t off = 0;
  template <class T>
  void put(T v) {
    std::memcpy(p + off, &v, sizeof v);
    off += sizeof v;
  }
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, p + off, sizeof v);
    off += sizeof v;
    return v;
  }
};

uint64_t bytes_checksum(const unsigned char* p, size_t n) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  return h;
}

bool write_all(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool pread_all(int fd, void* data, size_t n, uint64_t off) {
  auto* p = static_cast<unsigned char*>(data);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) errno = 0;  // the file ends early: no error of the system's to name
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return true;
}

void encode(const block_header& h, unsigned char* buf) {
  std::memset(buf, 0, 4096);
  cursor c{buf};
  for (char m : magic) c.put(m);
  c.put(block_header::version);
  for (const auto* k : {&h.salt, &h.key, &h.parent}) {
    c.put(k->hi);
    c.put(k->lo);
  }
  c.put(h.num_layers);
  c.put(h.kv_dim);
  c.put(h.block_tokens);
  c.put(h.page_tokens);
  c.put(h.layer_bytes);
  for (auto x : h.layer_checksums) c.put(x);
  c.put(h.retention);
  const uint64_t sum = bytes_checksum(buf, c.off);
  c.put(sum);
}

}  // namespace

std::string capacity_gib_error(double gib, const std::string& what) {
  if (std::isfinite(gib) && gib >= 0) return {};
  char got[32];
  std::snprintf(got, sizeof got, "%g", gib);
  return what + " must be a finite number of GiB >= 0 (0: unbounded), got " + got;
}

uint64_t capacity_bytes_of(double gib) {
  constexpr double gib_bytes = 1024.0 * 1024.0 * 1024.0;
  if (!(gib > 0)) return 0;
  if (gib * gib_bytes >= 18446744073709551615.0) return UINT64_MAX;
  // A positive budget under a byte is 1 byte (refused as under one block), never 0 (unbounded).
  return std::max<uint64_t>(1, static_cast<uint64_t>(gib * gib_bytes));
}

std::string block_path(const std::string& dir, const block_key& key) {
  const auto hex = key.hex();
  return dir + "/" + hex.substr(0, 2) + "/" + hex + ".blk";
}

namespace {

/// Layers of more than this many bytes are no KV block's (a 64-token block of a 128K-wide KV row
/// in f32 is 32 MiB): the bound keeps header_bytes() + layers x bytes from wrapping around.
constexpr uint64_t max_layer_bytes = uint64_t{1} << 40;

}  // namespace

std::string write_block_file(const std::string& path, const block_header& h,
                             const std::function<layer_pieces(uint32_t layer)>& layer_data, int* failed_errno,
                             int fault_errno) {
  int ignored = 0;
  int& code = failed_errno ? *failed_errno : ignored;
  code = 0;
  // 8 bytes per layer checksum must fit the fixed header with the fields before it.
  if (h.num_layers > 400 || h.layer_checksums.size() != h.num_layers)
    return "block header: " + std::to_string(h.num_layers) + " layers and " +
           std::to_string(h.layer_checksums.size()) + " checksums";
  if (h.layer_bytes == 0 || h.layer_bytes > max_layer_bytes)
    return "block header: layers of " + std::to_string(h.layer_bytes) + " bytes (1 to 2^40)";
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  std::filesystem::create_directories(parent, ec);
  if (ec) {  // its own error (EROFS, EACCES, ENOSPC), not the open's ENOENT after it
    code = ec.value();
    return "cannot create " + parent.string() + ": " + std::strerror(code);
  }
  // A name of this write's own: two writers of one key (a re-adopted store node's old I/O thread
  // and its new one, in one process and one directory) must not share a temporary file.
  static std::atomic<uint64_t> writes{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(++writes);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    code = errno;
    return "cannot create " + tmp + ": " + std::strerror(code);
  }
  unsigned char header[4096];
  encode(h, header);
  std::string why;  // the first failure, with its errno taken at once (later calls overwrite it)
  const auto failed = [&](int e) {
    code = e;
    why = std::strerror(e);
  };
  if (!write_all(fd, header, sizeof header)) failed(errno);
  if (why.empty() && fault_errno) failed(fault_errno);
  for (uint32_t l = 0; why.empty() && l < h.num_layers; ++l) {
    uint64_t written = 0;
    for (const auto& [p, n] : layer_data(l)) {
      if (!write_all(fd, p, n)) {
        failed(errno);
        break;
      }
      written += n;
    }
    if (why.empty() && written != h.layer_bytes)
      why = "layer " + std::to_string(l) + " has " + std::to_string(written) + " bytes, the header says " +
            std::to_string(h.layer_bytes);
  }
  if (::close(fd) != 0 && why.empty()) failed(errno);  // NFS and quotas may say ENOSPC only here
  if (!why.empty()) {
    ::unlink(tmp.c_str());
    return "cannot write " + path + ": " + why;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    code = errno;
    const std::string err = std::strerror(code);
    ::unlink(tmp.c_str());
    return "cannot rename " + tmp + ": " + err;
  }
  return {};
}

namespace {

/// Why a header cannot be used; `foreign`: it is a valid block of something else (another model,
/// layout or format version) that must be left alone, not a broken one.
struct header_problem {
  std::string why;
  bool foreign = false;
  bool transient = false;  ///< the system failed to read it (EIO): no evidence against the file
};

/// Parses and checks the header of the open file `fd` against `salt`; the key is not checked.
std::optional<header_problem> read_header(int fd, const block_key& salt, block_header* out) {
  unsigned char buf[4096];
  if (!pread_all(fd, buf, sizeof buf, 0))
    return errno == 0 ? header_problem{"truncated header"}
                      : header_problem{std::string("cannot read its header: ") + std::strerror(errno), false, true};
  cursor c{buf};
  char m[8];
  for (char& x : m) x = c.get<char>();
  if (std::memcmp(m, magic, 8) != 0) return header_problem{"not a Baton KV block"};
  const auto version = c.get<uint32_t>();
  if (version == 2 || version == 3)  // the same layout, but a key no CHECK asks for again (block_key.hpp)
    return header_problem{"format version " + std::to_string(version) + ", keyed before block keys were SHA-256"};
  if (version != block_header::version)
    return header_problem{"unknown block format version " + std::to_string(version), version > block_header::version};
  block_header h;
  for (auto* k : {&h.salt, &h.key, &h.parent}) {
    k->hi = c.get<uint64_t>();
    k->lo = c.get<uint64_t>();
  }
  h.num_layers = c.get<uint32_t>();
  h.kv_dim = c.get<uint32_t>();
  h.block_tokens = c.get<uint32_t>();
  h.page_tokens = c.get<uint32_t>();
  h.layer_bytes = c.get<uint64_t>();
  if (h.num_layers > 400) return header_problem{"corrupt header (layer count)"};
  if (h.layer_bytes == 0 || h.layer_bytes > max_layer_bytes) return header_problem{"corrupt header (layer size)"};
  for (uint32_t l = 0; l < h.num_layers; ++l) h.layer_checksums.push_back(c.get<uint64_t>());
  if (version >= 3) h.retention = c.get<uint8_t>();
  const uint64_t expect = bytes_checksum(buf, c.off);
  if (c.get<uint64_t>() != expect) return header_problem{"corrupt header (checksum)"};
  if (!(h.salt == salt)) return header_problem{"written for another model or KV layout", true};
  const off_t size = ::lseek(fd, 0, SEEK_END);
  if (size < 0) return header_problem{std::string("cannot find its size: ") + std::strerror(errno), false, true};
  if (static_cast<uint64_t>(size) != h.file_bytes())
    return header_problem{"truncated (" + std::to_string(size) + " of " + std::to_string(h.file_bytes()) + " bytes)"};
  *out = std::move(h);
  return std::nullopt;
}

}  // namespace

int open_block_file(const std::string& path, const block_key& salt, const block_key& key, block_header* out,
                    std::string* why, bool* no_file, bool* damaged) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (no_file) *no_file = fd < 0 && errno == ENOENT;
  if (damaged) *damaged = false;
  if (fd < 0) {
    *why = path + ": " + std::strerror(errno);
    return -1;
  }
  auto fail = [&](const std::string& s) {
    ::close(fd);
    *why = path + ": " + s;
    return -1;
  };
  block_header h;
  if (auto bad = read_header(fd, salt, &h)) {
    if (damaged) *damaged = !bad->foreign && !bad->transient;
    return fail(bad->why);
  }
  if (!(h.key == key)) {
    if (damaged) *damaged = true;
    return fail("holds another block");
  }
  *out = std::move(h);
  return fd;
}

std::string read_block_layer(int fd, const block_header& h, uint32_t layer, std::byte* dst, bool* damaged) {
  if (damaged) *damaged = false;
  if (layer >= h.num_layers) return "layer " + std::to_string(layer) + " out of range";
  if (!pread_all(fd, dst, h.layer_bytes, h.layer_offset(layer))) {
    if (damaged) *damaged = errno == 0;  // the file ends early: shorter than its header says
    return "short read of layer " + std::to_string(layer) + ": " + (errno ? std::strerror(errno) : "the file ends early");
  }
  return {};
}

namespace {

/// The store directories this process has locked, by the lock file's device and inode: a second
/// lock of one in this process is told apart from another process's (flock alone cannot: two
/// opens in one process conflict as two processes do, and a pid in the file is no proof --
/// containers sharing a volume are each pid 1). Each holder gets a duplicate of the one locked
/// descriptor (`anchor`), so the lock lasts until the last of them lets go. Never destroyed: a
/// server's I/O context may let go during static destruction.
struct lock_registry {
  struct entry {
    int anchor = -1;
    uint32_t holders = 0;
  };
  std::mutex mutex;
  std::map<std::pair<dev_t, ino_t>, entry> locked;
};
lock_registry& registry() {
  static auto* r = new lock_registry;
  return *r;
}

}  // namespace

int lock_block_dir(const std::string& dir, std::string* why, bool* shared, const std::string& lock_name) {
  if (shared) *shared = false;
  const std::string path = dir + "/" + lock_name;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    *why = "cannot open " + path + ": " + std::strerror(errno);
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    *why = "cannot stat " + path + ": " + std::strerror(errno);
    ::close(fd);
    return -1;
  }
  auto& reg = registry();
  std::lock_guard<std::mutex> guard{reg.mutex};
  if (auto e = reg.locked.find({st.st_dev, st.st_ino}); e != reg.locked.end()) {
    ::close(fd);
    const int dup = ::fcntl(e->second.anchor, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) {
      *why = "cannot share " + path + "'s lock: " + std::strerror(errno);
      return -1;
    }
    ++e->second.holders;
    if (shared) *shared = true;
    *why = dir + " is locked by this process already";
    return dup;
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t got = ::pread(fd, buf, sizeof buf - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK) {
      *why = "cannot lock " + path + ": " + std::strerror(err);
      return -1;
    }
    const long holder = got > 0 ? std::strtol(buf, nullptr, 10) : 0;
    *why = dir + " is served by another block server already (process " +
           (holder > 0 ? std::to_string(holder) : std::string{"unknown"}) + " holds " + path +
           "); give each server its own directory";
    return -1;
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    // Held all the same: the pid only names the holder in another server's refusal.
  }
  const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) {
    *why = "cannot hold " + path + "'s lock: " + std::strerror(errno);
    ::close(fd);
    return -1;
  }
  reg.locked[{st.st_dev, st.st_ino}] = {fd, 1};
  return dup;
}

void unlock_block_dir(int fd) {
  if (fd < 0) return;
  struct stat st {};
  const bool known = ::fstat(fd, &st) == 0;
  auto& reg = registry();
  std::lock_guard<std::mutex> guard{reg.mutex};  // held through the closes: a successor waits for them
  ::close(fd);
  if (!known) return;
  auto e = reg.locked.find({st.st_dev, st.st_ino});
  if (e == reg.locked.end() || --e->second.holders > 0) return;
  ::close(e->second.anchor);
  reg.locked.erase(e);
}

dir_scan scan_block_dir(const std::string& dir, const block_key& salt, bool sole_writer) {
  namespace fs = std::filesystem;
  dir_scan out;
  struct dated {
    int64_t last_used_ns;  ///< the later of the file's write and its last use (mark_block_used)
    found_block block;
  };
  std::vector<dated> found;
  const auto fs_now = fs::file_time_type::clock::now();
  const auto age_of = [&](fs::file_time_type t) {
    // Measured on the file clock itself (no conversion to system_clock needed).
    return t < fs_now ? std::chrono::duration_cast<std::chrono::milliseconds>(fs_now - t) : std::chrono::milliseconds{0};
  };
  auto remove = [&](const fs::path& p, const std::string& why) {
    std::error_code ec;
    if (!fs::remove(p, ec) || ec) return;
    if (out.removed++ == 0) out.first_removed = p.string() + ": " + why;
  };
  // dir/<2 hex>/<32 hex>.blk: the top folder and each of its folders walked on their own, so an
  // error reading one (EIO, a folder removed meanwhile) skips that folder alone -- a walk that
  // stopped there left the files after it unfound: never deleted, and the disk budget blind to them.
  const auto walk = [&](const fs::path& folder, const auto& visit) {
    std::error_code ec;
    fs::directory_iterator it{folder, ec};  // a folder it may not read is said too
    for (const fs::directory_iterator end; !ec && it != end; it.increment(ec)) visit(*it);
    if (ec && ec != std::errc::no_such_file_or_directory && out.unreadable_folders++ == 0)
      out.first_unreadable = folder.string() + ": " + ec.message();
  };
  // One entry of the walk: a block file found, or a file removed, or left alone.
  const auto consider = [&](const fs::directory_entry& entry) {
    std::error_code fe;
    if (!entry.is_regular_file(fe)) return;
    const auto& p = entry.path();
    const auto name = p.filename().string();
    const auto written = entry.last_write_time(fe);
    if (fe) return;
    if (name.find(".blk.tmp.") != std::string::npos) {
      if (sole_writer)
        remove(p, "a temporary file of a writer that is gone (this server holds the directory's lock)");
      else if (age_of(written) > stale_temp_after)
        remove(p, "a temporary file older than " + std::to_string(stale_temp_after.count()) + " s");
      return;
    }
    if (p.extension() != ".blk") return;
    // Without touching its access time where the file is ours (else the open that only reads its
    // header would count as a use, and the next restart would see every block used at once).
    int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NOATIME);
    if (fd < 0 && errno == EPERM) fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st {};
    const bool dated_ok = ::fstat(fd, &st) == 0;
    block_header h;
    auto bad = read_header(fd, salt, &h);
    ::close(fd);
    if (bad && bad->foreign) {
      ++out.foreign;
      return;
    }
    if (bad && bad->transient) return;  // not read now; maybe at the next start
    if (bad) {
      remove(p, bad->why);
      return;
    }
    if (p.stem().string() != h.key.hex()) {
      remove(p, "holds block " + h.key.hex());
      return;
    }
    // Where reads and deletes look for it, or it could never be served nor deleted (a file
    // moved by hand), only found again at every restart.
    if (std::filesystem::path{block_path(dir, h.key)}.lexically_normal() != p.lexically_normal()) {
      remove(p, "is not where block " + h.key.hex() + " belongs (" + block_path(dir, h.key) + ")");
      return;
    }
    const auto ns = [](const timespec& t) { return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec; };
    const int64_t last_used = dated_ok ? std::max(ns(st.st_atim), ns(st.st_mtim)) : 0;
    if (dated_ok && ns(st.st_mtim) > 0) out.newest_write_ns = std::max<uint64_t>(out.newest_write_ns, static_cast<uint64_t>(ns(st.st_mtim)));
    found.push_back({last_used, {h.key, h.parent, h.retention, h.file_bytes(), static_cast<uint64_t>(age_of(written).count())}});
  };
  walk(dir, [&](const fs::directory_entry& top) {
    std::error_code fe;
    if (top.is_directory(fe) && !top.is_symlink(fe)) walk(top.path(), consider);
    else consider(top);
  });
  std::stable_sort(found.begin(), found.end(), [](const dated& a, const dated& b) { return a.last_used_ns < b.last_used_ns; });
  out.blocks.reserve(found.size());
  for (auto& d : found) out.blocks.push_back(d.block);
  return out;
}

void mark_block_used(const std::string& path) {
  const timespec times[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
  ::utimensat(AT_FDCWD, path.c_str(), times, 0);
}

}  // namespace baton::store

// A block store's disk budget (--store-capacity-gib): each block server keeps its files within
// its capacity_bytes, deleting least recently used leaf blocks first and telling the index; a
// write the disk refuses (ENOSPC) is dropped and counted; the flags and spec key that set it.

#include <doctest/doctest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <caf/typed_event_based_actor.hpp>

#include "actors/block_index.hpp"
#include "actors/block_server.hpp"
#include "actors/config.hpp"
#include "actors/local_cluster.hpp"
#include "actors/store_host.hpp"
#include "deploy/cluster_spec.hpp"
#include "deploy/commands.hpp"
#include "deploy/node_options.hpp"
#include "gpu/kv_cache.hpp"
#include "store/block_file.hpp"
#include "store/block_index.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "transport/loopback.hpp"

using namespace baton;

namespace {

/// Two layers of one 16-token page, kv_dim 16, K and V in f32: 2048 bytes a layer, so a block
/// file (4 KiB header and 4 KiB of KV) is exactly 8 KiB on disk, whole file system blocks.
constexpr uint32_t layers = 2, tokens = 16, kv_dim = 16;
constexpr uint64_t block_file_bytes = 8192;

struct capacity_store {
  std::string dir = (std::filesystem::temp_directory_path() / ("baton-store-capacity-" + std::to_string(::getpid()))).string();
  store::kv_identity identity{"store-capacity-test", layers, kv_dim, tokens, tokens, "f32"};
  gpu::kv_layout layout{layers, 4, tokens, kv_dim, 2};
  test::cluster_system t;
  std::shared_ptr<transport::loopback_fabric> fabric = transport::make_loopback_fabric();
  std::unique_ptr<transport::transport> writer = transport::make_loopback_transport(fabric, "writer");
  std::unique_ptr<transport::transport> reader = transport::make_loopback_transport(fabric, "reader");
  std::vector<std::byte> pool = std::vector<std::byte>(layout.total_bytes());
  transport::region_key pool_key;

  capacity_store() {
    std::filesystem::remove_all(dir);
    transport::xfer_error err;
    auto key = reader->register_region(pool.data(), pool.size(), &err);
    REQUIRE(key);
    pool_key = *key;
  }
  ~capacity_store() { std::filesystem::remove_all(dir); }

  block_server_config config(uint64_t capacity_blocks) const {
    block_server_config bc;
    bc.dir = dir;
    bc.identity = identity;
    bc.staging_bytes = 4 * layout.page_bytes();
    bc.capacity_bytes = capacity_blocks * block_file_bytes;
    return bc;
  }

  /// Writes block `k` (child of `parent`, every byte `fill`) through `server` as a decode rank's
  /// write-back does (slot, put, order); the bytes the server says it wrote (0: dropped).
  uint64_t write(const block_server_actor& server, const store::block_key& k, const store::block_key& parent,
                 std::byte fill) {
    const uint64_t layer_bytes = layout.page_bytes(), bytes = layer_bytes * layers;
    std::vector<std::byte> block(bytes, fill);
    transport::xfer_error err;
    auto src = writer->register_region(block.data(), block.size(), &err);
    REQUIRE(src);
    caf::scoped_actor self{t.sys};
    store_write_slot slot;
    self->request(server, std::chrono::seconds{10}, store_write_begin{1, bytes})
        .receive([&](store_write_slot& x) { slot = x; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    const transport::region_key dst{slot.region.backend, slot.region.region_id, slot.region.size_bytes, slot.region.packed_key};
    const uint64_t id = writer->post_put({1, 0, "store-0", src->region_id, dst, {{0, slot.offset, bytes}}});
    REQUIRE(writer->poll(id, &err) == transport::xfer_state::done);  // loopback: done at post
    writer->release(id);
    writer->deregister_region(src->region_id);
    store_write_order w{1, slot.slot_id, bytes, block_ref{k.hi, k.lo, {0}}, parent.hi, parent.lo, "chat", tokens, tokens,
                        kv_dim, {}};
    for (uint32_t l = 0; l < layers; ++l)
      w.checksums.push_back(std::max<uint64_t>(1, gpu::layer_checksum(l, block.data() + l * layer_bytes, 1, layer_bytes)));
    uint64_t written = 0;
    self->request(server, std::chrono::seconds{10}, std::move(w))
        .receive([&](uint64_t n) { written = n; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return written;
  }

  /// Reads block `k` into page 0 of the reader's pool: the server's error, empty when served.
  std::string read(const block_server_actor& server, const store::block_key& k) {
    store_read_order o;
    o.request_id = 2;
    o.blocks = {block_ref{k.hi, k.lo, {0}}};
    o.block_index = {0};
    o.block_tokens = tokens;
    o.region = kv_region_desc{pool_key.backend, pool_key.region_id, pool_key.size_bytes, pool_key.packed, layers,
                              layout.num_pages, tokens, kv_dim, 2};
    o.page_ids = {0};
    o.reader = "reader";
    std::string why = "no answer";
    caf::scoped_actor self{t.sys};
    self->request(server, std::chrono::seconds{10}, std::move(o))
        .receive([&](store_read_result& r) { why = r.errors.size() == 1 ? r.errors[0] : "no block"; },
                 [&](caf::error& e) { why = t.sys.render(e); });
    return why;
  }

  bool on_disk(const store::block_key& k) const { return std::filesystem::exists(store::block_path(dir, k)); }

  /// What the directory's files take on the disk (st_blocks), and how many there are (but the
  /// server's lock, store::lock_block_dir).
  std::pair<uint64_t, size_t> disk_usage() const {
    uint64_t bytes = 0;
    size_t files = 0;
    std::error_code ec;
    for (const auto& e : std::filesystem::recursive_directory_iterator{dir, ec}) {
      struct stat st {};
      if (!e.is_regular_file() || e.path().filename() == ".lock" || ::stat(e.path().c_str(), &st) != 0) continue;
      bytes += static_cast<uint64_t>(st.st_blocks) * 512;
      ++files;
    }
    return {bytes, files};
  }

  template <class Handle>
  store_stats stats(const Handle& h) {
    store_stats out;
    caf::scoped_actor self{t.sys};
    self->request(h, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](store_stats& s) { out = s; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return out;
  }

  /// Waits (bounded) until the index knows `n` blocks; how many it knows then.
  uint64_t index_blocks(const block_index_actor& index, uint64_t n) {
    for (int i = 0; i < 2000 && stats(index).blocks != n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
    return stats(index).blocks;
  }

  /// Of `keys`, those the index names a server for (CHECK).
  std::vector<store::block_key> listed(const block_index_actor& index, const std::vector<store::block_key>& keys) {
    std::vector<block_ref> refs;
    for (const auto& k : keys) refs.push_back({k.hi, k.lo, {}});
    std::vector<store::block_key> out;
    caf::scoped_actor self{t.sys};
    self->request(index, std::chrono::seconds{5}, check_atom::value, uint64_t{1}, refs)
        .receive(
            [&](std::vector<block_ref>& r) {
              for (const auto& b : r)
                if (!b.servers.empty()) out.push_back({b.hi, b.lo});
            },
            [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return out;
  }

  /// An index and one block server (id 0) configured `bc` that knows it; both stop with it.
  struct served {
    block_index_actor index;
    block_server_actor server;
    ~served() {
      caf::anon_send_exit(server, caf::exit_reason::user_shutdown);
      caf::anon_send_exit(index, caf::exit_reason::user_shutdown);
    }
  };
  served serve(const block_server_config& bc) {
    auto index = spawn_block_index(t.sys, {}, {});
    auto server = spawn_block_server(t.sys, bc, transport::make_loopback_transport(fabric, "store-0"), {index});
    caf::anon_send(index, std::vector<block_server_actor>{server});
    return {index, server};
  }
};

store::block_meta meta_of(const store::block_key& k, const store::block_key& parent, uint64_t bytes) {
  store::block_meta m;
  m.key = k;
  m.parent = parent;
  m.servers = {0};
  m.size_bytes = bytes;
  m.expires_at_s = 1e9;
  return m;
}

}  // namespace

TEST_CASE("block index with a byte capacity: room for a block evicts least recently used leaves first, a rewrite "
          "short of room gives up its own old copy first, and a server's dropped copy leaves the index") {
  const store::block_key a1{1, 1}, a2{1, 2}, a3{1, 3}, b1{2, 1}, c1{3, 1}, x{9, 9};
  store::block_index idx;
  idx.set_capacity_bytes(300);
  idx.upsert(meta_of(a1, {}, 100), 0);
  idx.upsert(meta_of(a2, a1, 100), 0);
  idx.upsert(meta_of(a3, a2, 100), 0);
  CHECK(idx.bytes() == 300);
  CHECK(idx.evict_to_capacity().empty());  // full, not over
  // The chain's leaf goes, though it was written last: its root and a2 lead other prompts too.
  auto out = idx.evict_for(b1, 100);
  REQUIRE(out.size() == 1);
  CHECK(out[0].key == a3);
  CHECK(idx.bytes() == 200);
  idx.upsert(meta_of(b1, {}, 100), 1);
  // A hit on chain a makes it recent: b1, not read since its write, is the one to go.
  idx.touch_chain({a1, a2}, 2);
  out = idx.evict_for(c1, 100);
  REQUIRE(out.size() == 1);
  CHECK(out[0].key == b1);
  idx.upsert(meta_of(c1, {}, 100), 3);
  // a2 written again while the store is full: its old copy makes the room, nothing else goes.
  out = idx.evict_for(a2, 100);
  REQUIRE(out.size() == 1);
  CHECK(out[0].key == a2);
  idx.upsert(meta_of(a2, a1, 100), 4);
  CHECK(idx.size() == 3);
  CHECK(idx.bytes() == 300);
  // With room to spare a rewrite evicts nothing, not even its own copy.
  idx.set_capacity_bytes(400);
  CHECK(idx.evict_for(a1, 100).empty());
  CHECK(idx.find(a1));
  // A smaller capacity evicts down to it, least recent first: chain a (touched before c1 was
  // written) from its leaf.
  idx.set_capacity_bytes(100);
  out = idx.evict_to_capacity();
  REQUIRE(out.size() == 2);
  CHECK(out[0].key == a2);
  CHECK(out[1].key == a1);
  CHECK(idx.bytes() == 100);
  CHECK(idx.find(c1));
  idx.erase(c1);
  CHECK(idx.bytes() == 0);

  // Two copies (servers 0 and 1, writes 5 and 7): a drop naming an older write than the index
  // knows is stale; the block goes with its last copy.
  idx.set_capacity_bytes(0);
  auto m = meta_of(x, {}, 100);
  m.servers = {0, 1};
  m.write_seqs = {5, 7};
  idx.upsert(m, 5);
  CHECK_FALSE(idx.drop_copy(x, 1, 6));
  CHECK(idx.find(x)->servers == std::vector<uint32_t>{0, 1});
  CHECK_FALSE(idx.drop_copy(x, 1, 7));
  CHECK(idx.find(x)->servers == std::vector<uint32_t>{0});
  CHECK(idx.drop_copy(x, 0, 5));
  CHECK_FALSE(idx.find(x));
  CHECK(idx.bytes() == 0);
}

TEST_CASE("block server with a capacity of 3 blocks: six writes keep its files within 3 blocks on disk, the least "
          "recently used leaves are deleted (a read counts as a use), and the index stops naming them") {
  capacity_store s;
  const auto served = s.serve(s.config(3));
  const auto& index = served.index;
  const auto& server = served.server;
  const store::block_key a1{1, 1}, a2{1, 2}, a3{1, 3}, b1{2, 1}, b2{2, 2}, c1{3, 1};
  const std::vector<store::block_key> all{a1, a2, a3, b1, b2, c1};
  const auto within_budget = [&] {
    const auto [bytes, files] = s.disk_usage();
    CHECK(files <= 3);
    CHECK(bytes <= 3 * block_file_bytes);
  };
  // Chain a, committed first block first: its leaf a3 is its least recent block.
  CHECK(s.write(server, a1, {}, std::byte{0xa1}) == layers * s.layout.page_bytes());
  CHECK(s.write(server, a2, a1, std::byte{0xa2}) > 0);
  CHECK(s.write(server, a3, a2, std::byte{0xa3}) > 0);
  within_budget();
  CHECK(s.disk_usage().first > 2 * block_file_bytes);  // the files are measured: 8 KiB each, as counted
  CHECK(s.write(server, b1, {}, std::byte{0xb1}) > 0);   // a3 goes
  CHECK_FALSE(s.on_disk(a3));
  within_budget();
  CHECK(s.write(server, b2, b1, std::byte{0xb2}) > 0);  // a2 goes, a1's last leaf
  CHECK_FALSE(s.on_disk(a2));
  within_budget();
  CHECK(s.read(server, a1).empty());  // a1 used: now b2 is the least recent
  CHECK(s.write(server, c1, {}, std::byte{0xc1}) > 0);
  within_budget();
  for (const auto& k : {a1, b1, c1}) CHECK(s.on_disk(k));
  for (const auto& k : {a2, a3, b2}) CHECK_FALSE(s.on_disk(k));
  // An evicted block is a miss (its file is gone), never another block's bytes.
  CHECK(s.read(server, a3).find("No such file") != std::string::npos);
  const auto st = s.stats(server);
  CHECK(st.blocks_written == 6);
  CHECK(st.disk_evicted == 3);
  CHECK(st.disk_bytes == 3 * block_file_bytes);
  // The index heard of every deletion: CHECK names a server for the three on disk only.
  CHECK(s.index_blocks(index, 3) == 3);
  CHECK(s.listed(index, all) == std::vector<store::block_key>{a1, b1, c1});
}

TEST_CASE("block server with a capacity: a CHECK hit at the index counts as a use of the block on its server, "
          "so a chain prompts keep hitting (served from a prefill rank's own cache, never read here) is not the first "
          "deleted") {
  capacity_store s;
  const auto served = s.serve(s.config(2));
  const auto& index = served.index;
  const auto& server = served.server;
  const store::block_key a1{1, 1}, b1{2, 1}, c1{3, 1};
  CHECK(s.write(server, a1, {}, std::byte{0xa1}) > 0);
  CHECK(s.write(server, b1, {}, std::byte{0xb1}) > 0);
  REQUIRE(s.index_blocks(index, 2) == 2);
  // a1 hit at the index (its touch reaches the server before the next write: the index sends it
  // before answering), so b1 is now the server's least recently used block.
  CHECK(s.listed(index, {a1}) == std::vector<store::block_key>{a1});
  CHECK(s.write(server, c1, {}, std::byte{0xc1}) > 0);
  CHECK(s.on_disk(a1));  // before: a1, written first and never read here, was deleted
  CHECK_FALSE(s.on_disk(b1));
  CHECK(s.on_disk(c1));
}

TEST_CASE("block server with a full capacity: a rewrite of a block (a reader repairing it) makes room from its own "
          "old copy, which is neither counted as evicted nor dropped from the index") {
  capacity_store s;
  const auto served = s.serve(s.config(2));
  const auto& index = served.index;
  const auto& server = served.server;
  const store::block_key a1{1, 1}, b1{2, 1};
  CHECK(s.write(server, a1, {}, std::byte{0xa1}) > 0);
  CHECK(s.write(server, b1, {}, std::byte{0xb1}) > 0);
  REQUIRE(s.index_blocks(index, 2) == 2);
  // Full, and a1 is the least recent: its rewrite deletes its old copy for room, then writes it.
  CHECK(s.write(server, a1, {}, std::byte{0x5a}) > 0);
  CHECK(s.on_disk(a1));
  CHECK(s.on_disk(b1));
  CHECK(s.read(server, a1).empty());
  CHECK(s.pool[0] == std::byte{0x5a});
  CHECK(s.stats(server).disk_evicted == 0);
  CHECK(s.index_blocks(index, 2) == 2);
  CHECK(s.listed(index, {a1, b1}) == std::vector<store::block_key>{a1, b1});
}

TEST_CASE("block server: a block file deleted behind its back is a miss on the next read, and the index stops naming "
          "it (readers would miss on it until it expired)") {
  capacity_store s;
  const auto served = s.serve(s.config(0));
  const auto& index = served.index;
  const auto& server = served.server;
  const store::block_key k1{1, 1}, k2{2, 1};
  CHECK(s.write(server, k1, {}, std::byte{0x11}) > 0);
  CHECK(s.write(server, k2, {}, std::byte{0x22}) > 0);
  REQUIRE(s.index_blocks(index, 2) == 2);
  std::filesystem::remove(store::block_path(s.dir, k1));  // an operator freeing the disk
  CHECK(s.read(server, k1).find("No such file") != std::string::npos);
  CHECK(s.index_blocks(index, 1) == 1);
  CHECK(s.listed(index, {k1, k2}) == std::vector<store::block_key>{k2});
  CHECK(s.read(server, k2).empty());  // the others are served as before
}

TEST_CASE("block server: a damaged block file (a layer off its checksum, a broken header, a short file) is deleted by "
          "the read that finds it, counted, and the index stops naming it (it failed every read until a rewrite)") {
  capacity_store s;
  const auto served = s.serve(s.config(0));
  const auto& index = served.index;
  const auto& server = served.server;
  const store::block_key k1{1, 1}, k2{2, 1}, k3{3, 1}, k4{4, 1};
  for (const auto& k : {k1, k2, k3, k4}) CHECK(s.write(server, k, {}, std::byte{0x33}) > 0);
  REQUIRE(s.index_blocks(index, 4) == 4);
  const auto flip = [&](const store::block_key& k, std::streamoff at) {
    std::fstream f(store::block_path(s.dir, k), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char c = 0;
    f.get(c);
    f.seekp(at);
    f.put(static_cast<char>(c ^ 0x40));
  };
  flip(k1, store::block_header::fixed_header_bytes + 5);  // layer 0's bytes
  flip(k2, 20);                                             // the header's
  std::filesystem::resize_file(store::block_path(s.dir, k3), store::block_header::fixed_header_bytes + 8);
  const auto e1 = s.read(server, k1), e2 = s.read(server, k2), e3 = s.read(server, k3);
  CHECK_MESSAGE(e1.find("failed its checksum") != std::string::npos, e1);
  CHECK_MESSAGE(e2.find("corrupt header") != std::string::npos, e2);
  CHECK_MESSAGE(e3.find("truncated (4104 of 8192 bytes)") != std::string::npos, e3);
  for (const auto& k : {k1, k2, k3}) CHECK_FALSE(s.on_disk(k));
  CHECK(s.index_blocks(index, 1) == 1);
  CHECK(s.listed(index, {k1, k2, k3, k4}) == std::vector<store::block_key>{k4});
  const auto st = s.stats(server);
  CHECK(st.damaged_dropped == 3);
  CHECK(st.read_failures == 3);
  CHECK(s.read(server, k4).empty());  // the others are served as before
  CHECK(s.read(server, k1).find("No such file") != std::string::npos);  // a miss now, not a failed read
  CHECK(s.stats(server).damaged_dropped == 3);
}

TEST_CASE("block server: writes the disk refuses (ENOSPC, injected after the header) are dropped -- 0 bytes to the "
          "writer, nothing to the index, no file left -- and counted, and the server goes on reading and writing") {
  capacity_store s;
  auto bc = s.config(0);  // unbounded: a disk that fills on its own
  bc.fault_write_errno = ENOSPC;
  bc.fault_write_failures = 2;
  const auto served = s.serve(bc);
  const auto& index = served.index;
  const auto& server = served.server;
  const store::block_key k1{1, 1}, k2{2, 1}, k3{3, 1};
  CHECK(s.write(server, k1, {}, std::byte{1}) == 0);
  CHECK(s.write(server, k2, {}, std::byte{2}) == 0);
  CHECK(s.disk_usage().second == 0);  // neither the block files nor their temporary files
  CHECK(s.write(server, k3, {}, std::byte{3}) == layers * s.layout.page_bytes());
  CHECK(s.read(server, k3).empty());
  CHECK(s.pool[0] == std::byte{3});
  CHECK(s.read(server, k1).find("No such file") != std::string::npos);
  const auto st = s.stats(server);
  CHECK(st.write_failures == 2);
  CHECK(st.write_no_space == 2);
  CHECK(st.blocks_written == 1);
  CHECK(st.disk_bytes == block_file_bytes);
  CHECK(s.disk_usage().second == 1);
  CHECK(s.index_blocks(index, 1) == 1);
  CHECK(s.listed(index, {k1, k2, k3}) == std::vector<store::block_key>{k3});
}

TEST_CASE("block server on a disk that fills short of its budget (or with none): a write the disk refuses for room "
          "deletes the least recently used blocks, as many bytes as it takes, tells the index, and is tried once more") {
  for (const uint64_t blocks : {uint64_t{0}, uint64_t{100}}) {  // no budget; a budget far above the disk
    CAPTURE(blocks);
    capacity_store s;
    auto bc = s.config(blocks);
    bc.fault_write_errno = ENOSPC;
    bc.fault_write_after = 3;     // three blocks fit
    bc.fault_write_failures = 1;  // the fourth finds the disk full
    const auto served = s.serve(bc);
    const auto& index = served.index;
    const auto& server = served.server;
    const store::block_key k1{1, 1}, k2{2, 1}, k3{3, 1}, k4{4, 1};
    CHECK(s.write(server, k1, {}, std::byte{1}) > 0);
    CHECK(s.write(server, k2, {}, std::byte{2}) > 0);
    CHECK(s.write(server, k3, {}, std::byte{3}) > 0);
    CHECK(s.read(server, k1).empty());  // k1 used: k2 is now the least recent
    CHECK(s.write(server, k4, {}, std::byte{4}) == layers * s.layout.page_bytes());
    CHECK_FALSE(s.on_disk(k2));
    for (const auto& k : {k1, k3, k4}) CHECK(s.on_disk(k));
    const auto st = s.stats(server);
    CHECK(st.write_failures == 0);  // the first try's refusal is not the write's failure
    CHECK(st.disk_evicted == 1);
    CHECK(s.index_blocks(index, 3) == 3);
    CHECK(s.listed(index, {k1, k2, k3, k4}) == std::vector<store::block_key>{k1, k3, k4});
  }
}

TEST_CASE("block file: a write that fails (EIO injected) names the file and the error, gives the errno, and leaves "
          "neither the block file nor its temporary file") {
  capacity_store s;
  const store::block_key k{5, 5};
  store::block_header h;
  h.salt = store::salt_of(s.identity);
  h.key = k;
  h.num_layers = layers;
  h.kv_dim = kv_dim;
  h.block_tokens = h.page_tokens = tokens;
  h.layer_bytes = s.layout.page_bytes();
  h.layer_checksums = {1, 1};
  const std::vector<std::byte> layer(h.layer_bytes);
  const auto pieces = [&](uint32_t) { return store::layer_pieces{{layer.data(), layer.size()}}; };
  const auto path = store::block_path(s.dir, k);
  int code = 0;
  CHECK(store::write_block_file(path, h, pieces, &code, EIO) == "cannot write " + path + ": " + std::strerror(EIO));
  CHECK(code == EIO);
  CHECK(s.disk_usage().second == 0);
  CHECK(store::write_block_file(path, h, pieces, &code).empty());
  CHECK(code == 0);
  CHECK(s.disk_usage().second == 1);
  // A hash-prefix directory that cannot be made is named, with its own error (it read as the
  // temporary file's ENOENT, which hid EROFS or EACCES, and ENOSPC from the evictions for room).
  const store::block_key other{0xab00000000000000ull, 6};
  std::ofstream{s.dir + "/ab"} << "a file where the directory goes";
  const auto refused = store::write_block_file(store::block_path(s.dir, other), h, pieces, &code);
  CHECK_MESSAGE(refused.rfind("cannot create " + s.dir + "/ab: ", 0) == 0, refused);
  CHECK(code != 0);
  CHECK(code != ENOENT);
}

namespace {

/// Five block files of `s`'s layout, keys[0] written (and last used) 10 minutes ago, keys[4] 6.
std::vector<store::block_key> five_dated_blocks(capacity_store& s) {
  std::vector<store::block_key> keys;
  for (uint64_t i = 0; i < 5; ++i) {
    keys.push_back({10 + i, 1});
    store::block_header h;
    h.salt = store::salt_of(s.identity);
    h.key = keys.back();
    h.num_layers = layers;
    h.kv_dim = kv_dim;
    h.block_tokens = h.page_tokens = tokens;
    h.layer_bytes = s.layout.page_bytes();
    const std::vector<std::byte> layer(h.layer_bytes);
    for (uint32_t l = 0; l < layers; ++l)  // a block that reads (its layers pass their checks)
      h.layer_checksums.push_back(std::max<uint64_t>(1, gpu::layer_checksum(l, layer.data(), 1, layer.size())));
    const auto path = store::block_path(s.dir, h.key);
    REQUIRE(store::write_block_file(path, h, [&](uint32_t) { return store::layer_pieces{{layer.data(), layer.size()}}; }).empty());
    // Access and write times both: a file's access time is its creation's until it is used.
    const timespec then{::time(nullptr) - static_cast<time_t>(60 * (10 - i)), 0};
    const timespec times[2] = {then, then};
    REQUIRE(::utimensat(AT_FDCWD, path.c_str(), times, 0) == 0);
  }
  return keys;
}

}  // namespace

TEST_CASE("block server restarting on a directory beyond its capacity deletes the least recently used blocks "
          "before the index hears of them") {
  capacity_store s;
  const auto keys = five_dated_blocks(s);
  const auto served = s.serve(s.config(3));
  const auto& index = served.index;
  const auto& server = served.server;
  CHECK(s.index_blocks(index, 3) == 3);
  CHECK(s.listed(index, keys) == std::vector<store::block_key>{keys[2], keys[3], keys[4]});
  CHECK_FALSE(s.on_disk(keys[0]));
  CHECK_FALSE(s.on_disk(keys[1]));
  CHECK(s.disk_usage().second == 3);
  CHECK(s.disk_usage().first <= 3 * block_file_bytes);
  const auto st = s.stats(server);
  CHECK(st.disk_evicted == 2);
  CHECK(st.blocks_recovered == 3);
  CHECK(st.disk_bytes == 3 * block_file_bytes);
}

TEST_CASE("block server restarting beyond its capacity keeps a block written long ago but read since (a system "
          "prompt's), deleting the least recently used; its own scan at a start counts as no use") {
  capacity_store s;
  const auto keys = five_dated_blocks(s);
  {
    // Another life of the server, with room for all five: it starts (and scans) on the directory,
    // and serves keys[0] once. Before, restarts ordered by write time alone and deleted keys[0] first.
    const auto served = s.serve(s.config(100));
    REQUIRE(s.index_blocks(served.index, 5) == 5);
    CHECK(s.read(served.server, keys[0]).empty());
  }
  const auto served = s.serve(s.config(3));
  CHECK(s.index_blocks(served.index, 3) == 3);
  CHECK(s.listed(served.index, keys) == std::vector<store::block_key>{keys[0], keys[3], keys[4]});
  CHECK_FALSE(s.on_disk(keys[1]));
  CHECK_FALSE(s.on_disk(keys[2]));
}

TEST_CASE("store capacity: --store-capacity-gib, baton node's and the spec's capacity_gib refuse negative or "
          "non-finite budgets and budgets under one block, naming the flag or key") {
  CHECK(store::capacity_gib_error(-1, "--store-capacity-gib") ==
        "--store-capacity-gib must be a finite number of GiB >= 0 (0: unbounded), got -1");
  CHECK(store::capacity_gib_error(std::nan(""), "x").find("got nan") != std::string::npos);
  CHECK(store::capacity_gib_error(std::numeric_limits<double>::infinity(), "x").find("got inf") != std::string::npos);
  CHECK(store::capacity_gib_error(0, "x").empty());
  CHECK(store::capacity_bytes_of(0.5) == 512ull << 20);
  CHECK(store::capacity_bytes_of(-1) == 0);
  CHECK(store::capacity_bytes_of(1e30) == std::numeric_limits<uint64_t>::max());

  // baton local: the head's in-process servers share the budget of --store-dir.
  local_cluster_config c;
  c.store.enabled = true;
  c.store.dir = "/nonexistent";  // validate() reads no files
  REQUIRE(c.validate().empty());
  c.store.capacity_gib = -2;
  CHECK(c.validate() == "store capacity_gib must be a finite number of GiB >= 0 (0: unbounded), got -2");
  c.store.capacity_gib = 1e-6;  // 1073 bytes: no block file of the built-in model fits
  CHECK_MESSAGE(c.validate().find("store capacity_gib (--store-capacity-gib) leaves each of the 1 block servers under "
                                  "the store dir 1073 bytes, less than one block file of this model (") == 0,
                c.validate());
  c.store.capacity_gib = 64;
  CHECK(c.validate().empty());
  c.store.num_servers = 0;
  c.remote_store_hosts.resize(1);
  CHECK(c.validate().find("it runs none") != std::string::npos);
  const auto dir = (std::filesystem::temp_directory_path() / ("baton-capacity-flag-" + std::to_string(::getpid()))).string();
  CHECK(deploy::run_local({"--store-dir", dir, "--store-capacity-gib", "-1"}) == 2);
  CHECK(deploy::run_local({"--store-dir", dir, "--store-capacity-gib", "nan"}) == 2);
  CHECK(deploy::run_local({"--store-capacity-gib", "1"}) == 2);  // no --store-dir: nothing to budget
  std::filesystem::remove_all(dir);

  // baton node: only a store node has a disk budget.
  deploy::node_options o;
  o.role = "store";
  o.listen = "127.0.0.1:0";
  o.store_dir = "/tmp/blocks";
  o.store_capacity_gib = -0.5;
  CHECK(o.validate() == "--store-capacity-gib must be a finite number of GiB >= 0 (0: unbounded), got -0.5");
  o.store_capacity_gib = 2.5;
  CHECK(o.validate().empty());
  deploy::node_options d;
  d.connect = "127.0.0.1:7000";
  d.store_capacity_gib = 1;
  CHECK(d.validate() == "--store-capacity-gib budgets a store node's disk: it needs --role store");
  deploy::node_options parsed;
  CHECK_FALSE(deploy::parse_node_options({"--role", "store", "--listen", "127.0.0.1:0", "--store-dir", "/tmp/blocks",
                                          "--store-capacity-gib", "0.25"},
                                         &parsed));
  CHECK(parsed.store_capacity_gib == 0.25);
  deploy::node_options inf;
  CHECK(deploy::parse_node_options({"--role", "store", "--listen", "127.0.0.1:0", "--store-dir", "/tmp/blocks",
                                    "--store-capacity-gib", "inf"},
                                   &inf) == 2);

  // The spec's store.capacity_gib: refused when negative, passed to every process with a store dir.
  const std::string spec = R"({
    "name": "t", "model": "m", "store": {"dir": "/s", "capacity_gib": CAP},
    "nodes": [
      {"name": "head", "host": "h0", "roles": ["router", "prefill", "store"], "ports": {"router": 7100, "cluster": 7101}},
      {"name": "s", "host": "h2", "roles": ["store"], "ports": {"store": 9000}},
      {"name": "d", "host": "h1", "roles": ["decode"]}
    ]})";
  const auto with = [&](const std::string& cap) {
    auto text = spec;
    text.replace(text.find("CAP"), 3, cap);
    return text;
  };
  deploy::cluster_spec cs;
  std::string why;
  CHECK_FALSE(deploy::parse_cluster_spec(with("-1"), "/base", &cs, &why));
  CHECK(why == "spec.store.capacity_gib must be a finite number of GiB >= 0 (0: unbounded), got -1");
  CHECK_FALSE(deploy::parse_cluster_spec(with("\"1\""), "/base", &cs, &why));
  CHECK(why == "spec.store.capacity_gib must be a number");
  REQUIRE_MESSAGE(deploy::parse_cluster_spec(with("0.5"), "/base", &cs, &why), why);
  const auto capacity_flag = [](const deploy::node_launch& n) {
    const auto it = std::find(n.argv.begin(), n.argv.end(), "--store-capacity-gib");
    return it == n.argv.end() || it + 1 == n.argv.end() ? std::string{"(none)"} : *(it + 1);
  };
  const auto plan = deploy::plan_launch(cs, "baton", {"h0", ""});
  REQUIRE(plan.size() == 3);
  CHECK(plan[0].role == "store");
  CHECK(capacity_flag(plan[0]) == "0.5");
  CHECK(plan[1].role == "head");
  CHECK(capacity_flag(plan[1]) == "0.5");
  CHECK(capacity_flag(plan[2]) == "(none)");
  REQUIRE_MESSAGE(deploy::parse_cluster_spec(with("0"), "/base", &cs, &why), why);
  for (const auto& n : deploy::plan_launch(cs, "baton", {"h0", ""})) CHECK(capacity_flag(n) == "(none)");
}

TEST_CASE("store node: an adoption whose block file would not fit the node's --store-capacity-gib is refused, "
          "naming the flag and both sizes; one that fits starts the server") {
  test::cluster_system t;
  auto fabric = transport::make_loopback_fabric();
  store_host_config hc;
  hc.name = "store-a";
  hc.dir = (std::filesystem::temp_directory_path() / ("baton-capacity-host-" + std::to_string(::getpid()))).string();
  hc.capacity_bytes = 4096;
  const auto make = [fabric](const std::string& name, std::string*) {
    return std::shared_ptr<transport::transport>{transport::make_loopback_transport(fabric, name)};
  };
  auto index = spawn_block_index(t.sys, {}, {});
  store_adoption a;
  a.index = {index};
  a.model_id = "store-capacity-test";
  a.num_layers = layers;
  a.kv_dim = kv_dim;
  a.block_tokens = a.page_tokens = tokens;
  a.dtype = "f32";
  a.block_bytes = block_file_bytes - 4096;
  caf::scoped_actor self{t.sys};
  const auto adopt = [&](const store_host_actor& host) {
    std::string why = "adopted";
    self->request(host, std::chrono::seconds{10}, adopt_atom::value, a)
        .receive([&](block_server_actor& server) { self->send_exit(server, caf::exit_reason::user_shutdown); },
                 [&](caf::error& e) { why = t.sys.render(e); });
    return why;
  };
  auto small = spawn_store_host(t.sys, hc, make);
  const auto why = adopt(small);
  CHECK_MESSAGE(why.find("store node store-a, stage adopt: --store-capacity-gib allows 4096 bytes, less than one block "
                         "file of the head's model (8192 bytes on disk)") != std::string::npos,
                why);
  hc.capacity_bytes = block_file_bytes;
  auto fits = spawn_store_host(t.sys, hc, make);
  CHECK(adopt(fits) == "adopted");
  self->send_exit(small, caf::exit_reason::user_shutdown);
  self->send_exit(fits, caf::exit_reason::user_shutdown);
  self->send_exit(index, caf::exit_reason::user_shutdown);
  std::filesystem::remove_all(hc.dir);
}

TEST_CASE("without a store, prompts are keyed for the prefill ranks' own tiers: a block of 0 tokens or not of whole "
          "pages is refused by name; a head with no rank of its own needs no CUDA device") {
  local_cluster_config c;
  c.store.local_tier_only = true;  // what baton local sets without --store-dir
  c.store.block_tokens = 64;
  CHECK(c.validate().empty());
  c.store.block_tokens = 0;  // divided by, on the first request
  CHECK(c.validate() == "store block_tokens (--block-tokens) must be a positive multiple of the KV page size (16 tokens), "
                        "got 0: prefill ranks keep their prefix tiers in whole pages");
  c.store.block_tokens = 24;  // left every tier off, silently
  CHECK(c.validate().find("got 24") != std::string::npos);
  CHECK(deploy::run_local({"--block-tokens", "0"}) == 2);
  // A block the context cannot hold with a token after it is never hit: refused, store or not.
  c.store.block_tokens = 64;
  c.model.max_position_embeddings = 64;
  CHECK(c.validate().find("store block_tokens (--block-tokens) is 64, too long for the model's context of 64 tokens") == 0);
  c.store.local_tier_only = false;  // no store and no tier: nothing is keyed, nothing to refuse
  CHECK(c.validate().empty());
  c.store.local_tier_only = true;
  // The built-in model (a 256-token context) with a store: 512-token blocks are refused by name.
  const auto dir = std::filesystem::temp_directory_path() / ("baton-block-check-" + std::to_string(::getpid()));
  CHECK(deploy::run_local({"--store-dir", dir.string(), "--block-tokens", "512"}) == 2);
  std::filesystem::remove_all(dir);
  // The head of a spec whose ranks are all in node processes runs none: its --executor cuda only
  // names the KV form its store keys carry, on a host that may have no GPU.
  local_cluster_config head;
  head.backend.kind = "cuda";
  head.num_prefill_ranks = head.num_decode_ranks = head.num_elastic_ranks = 0;
  CHECK(head.validate().empty());
  head.num_prefill_ranks = 1;
  if (!head.backend.validate().empty()) CHECK(head.validate() == head.backend.validate());  // no device here
  head.num_prefill_ranks = 0;
  head.backend.kind = "tpu";
  CHECK(head.validate() == "executor backend \"tpu\" is unknown (cpu or cuda)");
}

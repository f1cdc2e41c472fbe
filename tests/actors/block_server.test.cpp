// One block server on its own, against a reader's pool on the in-process transport: what its
// puts leave in the reader's pages when they go wrong.

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <mutex>
#include <thread>

#include <fcntl.h>
#include <unistd.h>

#include <caf/typed_event_based_actor.hpp>

#include "actors/block_index.hpp"
#include "actors/config.hpp"
#include "actors/block_server.hpp"
#include "gpu/kv_cache.hpp"
#include "store/block_file.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "transport/fault_proxy.hpp"
#include "transport/loopback.hpp"

using namespace baton;

namespace {

/// The index's stand-in: records the commits the server sends it, and the size of each message.
struct recording_index {
  std::shared_ptr<std::vector<block_commit>> commits = std::make_shared<std::vector<block_commit>>();
  std::shared_ptr<std::vector<size_t>> messages = std::make_shared<std::vector<size_t>>();
  std::shared_ptr<std::mutex> mutex = std::make_shared<std::mutex>();
  block_index_actor index;
  explicit recording_index(caf::actor_system& sys) {
    index = sys.spawn([commits = commits, messages = messages, mutex = mutex](block_index_actor::pointer) -> block_index_actor::behavior_type {
      return {[](check_atom, uint64_t, std::vector<block_ref>& refs) { return refs; },
              [=](commit_atom, std::vector<block_commit>& cs) {
                std::lock_guard<std::mutex> lock{*mutex};
                commits->insert(commits->end(), cs.begin(), cs.end());
                messages->push_back(cs.size());
              },
              [](delete_atom, uint32_t, uint64_t, uint64_t, uint64_t) {}, [](timer_atom, uint64_t) {},
              [](std::vector<block_server_actor>&) {}, [](adopt_atom, uint32_t, block_server_actor&) {},
              [](lost_atom, uint32_t, const block_server_actor&) {},
              [](servers_atom) { return std::vector<block_server_actor>{}; },
              [](servers_atom, uint32_t, uint64_t, bool) {
                return caf::result<block_server_actor, uint64_t, bool>{block_server_actor{}, 0, false};
              },
              [](stats_atom) { return store_stats{}; }};
    });
  }
  size_t num_commits() const {
    std::lock_guard<std::mutex> lock{*mutex};
    return commits->size();
  }
};

/// Two layers, one 16-token page per block, kv_dim 4: a block layer is one page of 512 bytes.
constexpr uint32_t layers = 2, tokens = 16, kv_dim = 4, reader_pages = 4;

struct one_server {
  std::string dir = (std::filesystem::temp_directory_path() / ("baton-block-server-" + std::to_string(::getpid()))).string();
  store::kv_identity identity{"block-server-test", layers, kv_dim, tokens, tokens, "f32"};
  gpu::kv_layout layout;

  /// A reader's pool of `pages` pages (one block each).
  explicit one_server(uint32_t pages = reader_pages) : layout{layers, pages, tokens, kv_dim, 2} { std::filesystem::remove_all(dir); }
  ~one_server() { std::filesystem::remove_all(dir); }

  /// The server's config: this directory and model, staging for `staging_pages` block layers.
  block_server_config config(uint64_t staging_pages = 1) const {
    block_server_config bc;
    bc.dir = dir;
    bc.identity = identity;
    bc.staging_bytes = staging_pages * layout.page_bytes();
    return bc;
  }

  /// A reader's KV pool (zeroed), registered with `reader` for the server to put into.
  struct reader_pool {
    std::vector<std::byte> bytes;
    transport::region_key key;
  };
  reader_pool register_reader(transport::transport& reader) const {
    reader_pool out{std::vector<std::byte>(layout.layer_stride_bytes() * layers, std::byte{0}), {}};
    transport::xfer_error err;
    auto key = reader.register_region(out.bytes.data(), out.bytes.size(), &err);
    REQUIRE(key);
    out.key = *key;
    return out;
  }

  /// A read of `keys` into pages 0, 1, ... of the pool registered as `pool`, block i into page i.
  store_read_order read_of(uint64_t request_id, const std::vector<store::block_key>& keys,
                           const transport::region_key& pool) const {
    store_read_order o;
    o.request_id = request_id;
    for (uint32_t i = 0; i < keys.size(); ++i) {
      o.blocks.push_back({keys[i].hi, keys[i].lo, {0}});
      o.block_index.push_back(i);
      o.page_ids.push_back(i);
    }
    o.block_tokens = tokens;
    o.region = kv_region_desc{pool.backend, pool.region_id, pool.size_bytes, pool.packed, layers, layout.num_pages, tokens, kv_dim, 2};
    o.reader = "reader";
    return o;
  }

  /// A block whose every byte is `fill`, stored as the server's file for `key`.
  void store_block(const store::block_key& key, std::byte fill) {
    const std::vector<std::byte> page(layout.page_bytes(), fill);
    store::block_header h;
    h.salt = store::salt_of(identity);
    h.key = key;
    h.num_layers = layers;
    h.kv_dim = kv_dim;
    h.block_tokens = tokens;
    h.page_tokens = tokens;
    h.layer_bytes = layout.page_bytes();
    for (uint32_t l = 0; l < layers; ++l)
      h.layer_checksums.push_back(std::max<uint64_t>(1, gpu::layer_checksum(l, page.data(), 1, page.size())));
    std::filesystem::create_directories(std::filesystem::path{store::block_path(dir, key)}.parent_path());
    REQUIRE(store::write_block_file(store::block_path(dir, key), h, [&](uint32_t) {
              return store::layer_pieces{{page.data(), page.size()}};
            }).empty());
  }
};

/// A read of block `k` into page `page` of the reader's pool registered as `key`.
store_read_order read_order(uint64_t request_id, const store::block_key& k, uint32_t page, const transport::region_key& key) {
  store_read_order o;
  o.request_id = request_id;
  o.blocks = {block_ref{k.hi, k.lo, {0}}};
  o.block_index = {0};
  o.block_tokens = tokens;
  o.region = kv_region_desc{key.backend, key.region_id, key.size_bytes, key.packed, layers, reader_pages, tokens, kv_dim, 2};
  o.page_ids = {page};
  o.reader = "reader";
  return o;
}

/// Watches, on a thread of its own, how many files under `dir` this process holds open, and
/// keeps the most it saw at once.
class open_file_watcher {
 public:
  explicit open_file_watcher(const std::string& dir)
    : dir_(std::filesystem::canonical(dir).string()), thread_([this] { run(); }) {}
  ~open_file_watcher() { stop(); }
  size_t stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
    return most_;
  }

 private:
  void run() {
    while (!done_) {
      size_t open = 0;
      std::error_code ec;
      for (const auto& fd : std::filesystem::directory_iterator{"/proc/self/fd", ec}) {
        std::error_code gone;  // closed since it was listed
        const auto target = std::filesystem::read_symlink(fd.path(), gone).string();
        if (!gone && target.rfind(dir_, 0) == 0) ++open;
      }
      most_ = std::max<size_t>(most_, open);
      std::this_thread::sleep_for(std::chrono::milliseconds{1});
    }
  }
  std::string dir_;
  std::atomic<bool> done_{false};
  std::atomic<size_t> most_{0};
  std::thread thread_;  // last: it starts once the members it reads are made
};

}  // namespace

TEST_CASE("block server: a put it gave up on that lands later carries the block it was for, not whatever the server "
          "read next (its staging is set aside until the put settles), and reads go on meanwhile") {
  test::cluster_system t;
  one_server s;
  const store::block_key a{1, 11}, b{2, 22};
  s.store_block(a, std::byte{0x11});
  s.store_block(b, std::byte{0x22});

  auto fabric = transport::make_loopback_fabric();
  // The server's first put (request 1, layer 0) stays in flight until land_late().
  auto proxy = transport::make_fault_proxy(transport::make_loopback_transport(fabric, "store-0"),
                                           {transport::fault_kind::late, 0, 1, 1, 1});
  auto* late = proxy.get();
  auto reader_xport = transport::make_loopback_transport(fabric, "reader");
  std::vector<std::byte> pool(s.layout.layer_stride_bytes() * layers, std::byte{0});
  transport::xfer_error err;
  auto key = reader_xport->register_region(pool.data(), pool.size(), &err);
  REQUIRE(key);

  block_server_config bc;
  bc.dir = s.dir;
  bc.identity = s.identity;
  bc.staging_bytes = s.layout.page_bytes();  // one block layer: every put reuses the same bytes
  bc.put_limit_ms = 50;
  auto server = spawn_block_server(t.sys, bc, std::shared_ptr<transport::transport>{std::move(proxy)}, {});

  caf::scoped_actor self{t.sys};
  const auto read = [&](uint64_t request_id, const store::block_key& k, uint32_t page) {
    auto o = read_order(request_id, k, page, *key);
    store_read_result out;
    self->request(server, std::chrono::seconds{10}, std::move(o))
        .receive([&](store_read_result& r) { out = std::move(r); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return out;
  };
  const auto page_is = [&](uint32_t layer, uint32_t page, std::byte fill) {
    const auto* p = pool.data() + s.layout.offset_bytes(layer, page);
    return std::all_of(p, p + s.layout.page_bytes(), [&](std::byte x) { return x == fill; });
  };

  // Block a into page 0: its layer-0 put is given up after 50 ms, still in flight.
  auto first = read(1, a, 0);
  REQUIRE(first.errors.size() == 1);
  CHECK(first.errors[0].find("still pending after 50 ms") != std::string::npos);
  CHECK(first.puts_abandoned);
  CHECK(page_is(0, 0, std::byte{0}));  // nothing landed yet
  // Block b into page 1: the server reads b into staging (before: the same bytes a's put reads).
  auto second = read(2, b, 1);
  REQUIRE(second.errors.size() == 1);
  CHECK(second.errors[0].empty());
  CHECK(page_is(0, 1, std::byte{0x22}));
  CHECK(page_is(1, 1, std::byte{0x22}));
  // Now a's put lands: a's bytes, where it used to bring b's.
  REQUIRE(late->num_injected() == 1);
  late->land_late();
  CHECK(page_is(0, 0, std::byte{0x11}));
  // The set-aside staging is freed at the next read, which is served in full.
  auto third = read(3, a, 2);
  REQUIRE(third.errors.size() == 1);
  CHECK(third.errors[0].empty());
  CHECK(page_is(0, 2, std::byte{0x11}));
  CHECK(page_is(1, 2, std::byte{0x11}));
  self->send_exit(server, caf::exit_reason::user_shutdown);
}

TEST_CASE("block server: while four staging buffers wait on given-up puts (sixteen, counting old ones) it refuses "
          "reads, saying why, and serves again once those puts settle") {
  test::cluster_system t;
  one_server s;
  const store::block_key a{1, 11};
  s.store_block(a, std::byte{0x11});
  auto fabric = transport::make_loopback_fabric();
  // Every put of every read stays in flight until land_late().
  auto proxy = transport::make_fault_proxy(transport::make_loopback_transport(fabric, "store-0"),
                                           {transport::fault_kind::late, {}, {}, 1000, 1});
  auto* late = proxy.get();
  auto reader_xport = transport::make_loopback_transport(fabric, "reader");
  std::vector<std::byte> pool(s.layout.layer_stride_bytes() * layers);
  transport::xfer_error err;
  auto key = reader_xport->register_region(pool.data(), pool.size(), &err);
  REQUIRE(key);
  block_server_config bc;
  bc.dir = s.dir;
  bc.identity = s.identity;
  bc.staging_bytes = s.layout.page_bytes();
  bc.put_limit_ms = 20;
  auto server = spawn_block_server(t.sys, bc, std::shared_ptr<transport::transport>{std::move(proxy)}, {});
  caf::scoped_actor self{t.sys};
  const auto read = [&](uint64_t request_id) {
    auto o = read_order(request_id, a, 0, *key);
    std::string why = "no answer";
    self->request(server, std::chrono::seconds{10}, std::move(o))
        .receive([&](store_read_result& r) { why = r.errors.empty() ? "no errors" : r.errors[0]; },
                 [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return why;
  };
  for (uint64_t i = 1; i <= 4; ++i) CHECK(read(i).find("still pending after 20 ms") != std::string::npos);
  CHECK(read(5) == "store-0 serves no reads while 4 staging buffers wait on puts given up after 20 ms");
  late->land_late();  // they settle: the next read frees the buffers and goes ahead (into the late fault again)
  CHECK(read(6).find("still pending after 20 ms") != std::string::npos);
  // Buffers older than six put limits stop counting toward the four (one stuck peer must not stop
  // reads for good), but not toward sixteen in all: their memory stays while their puts may land.
  uint64_t id = 7;
  for (int round = 0; round < 8 && read(id).find("(at most 16 in all)") == std::string::npos; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds{6 * 20 + 10});  // the buffers so far count no more
    for (int i = 0; i < 4; ++i) read(++id);
    ++id;
  }
  CHECK(read(++id) == "store-0 serves no reads while 16 staging buffers wait on puts given up after 20 ms (at most 16 in all)");
  // Its stats say so: the router counts it answering but not up (/health's store_servers_up).
  const auto refusing = [&] {
    uint64_t n = 99;
    self->request(server, std::chrono::seconds{10}, stats_atom::value).receive([&](store_stats& x) { n = x.refusing_reads; }, [](caf::error&) {});
    return n;
  };
  CHECK(refusing() == 1);
  late->land_late();
  CHECK(read(++id).find("still pending after 20 ms") != std::string::npos);
  CHECK(refusing() == 0);
  self->send_exit(server, caf::exit_reason::user_shutdown);
}

TEST_CASE("block server: a read of many blocks whose first put is given up fails the rest at once, so one "
          "stalled reader sets one staging buffer aside, not one per batch, and others' reads go on") {
  test::cluster_system t;
  one_server s;
  const std::vector<store::block_key> keys{{1, 11}, {2, 22}, {3, 33}, {4, 44}};
  for (const auto& k : keys) s.store_block(k, std::byte{0x11});
  auto fabric = transport::make_loopback_fabric();
  // Request 1's puts stay in flight until land_late(); the other reader's land.
  auto proxy = transport::make_fault_proxy(transport::make_loopback_transport(fabric, "store-0"),
                                           {transport::fault_kind::late, {}, 1, 1000, 1});
  auto* late = proxy.get();
  auto reader_xport = transport::make_loopback_transport(fabric, "reader");
  auto pool = s.register_reader(*reader_xport);
  auto bc = s.config(1);  // one block layer per batch: four batches per layer
  bc.put_limit_ms = 20;
  auto server = spawn_block_server(t.sys, bc, std::shared_ptr<transport::transport>{std::move(proxy)}, {});
  caf::scoped_actor self{t.sys};
  auto o = read_order(1, keys[0], 0, pool.key);
  o.blocks.clear();
  o.block_index.clear();
  o.page_ids.clear();
  for (uint32_t i = 0; i < keys.size(); ++i) {
    o.blocks.push_back(block_ref{keys[i].hi, keys[i].lo, {0}});
    o.block_index.push_back(i);
    o.page_ids.push_back(i);
  }
  std::vector<std::string> errors;
  self->request(server, std::chrono::seconds{10}, std::move(o))
      .receive([&](store_read_result& r) { errors = std::move(r.errors); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  REQUIRE(errors.size() == keys.size());
  for (const auto& e : errors) CHECK(e.find("still pending after 20 ms") != std::string::npos);
  CHECK(late->num_injected() == 1);  // one put posted, not one per batch and layer
  // Another reader is served in full: one buffer is set aside, not the four that stop reads.
  std::string why = "no answer";
  self->request(server, std::chrono::seconds{10}, read_order(2, keys[1], 1, pool.key))
      .receive([&](store_read_result& r) { why = r.errors.empty() ? "no errors" : r.errors[0]; },
               [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(why.empty());
  late->land_late();
  self->send_exit(server, caf::exit_reason::user_shutdown);
}

TEST_CASE("block server: a put limit beyond what readers wait for is refused with a sentence naming it") {
  test::cluster_system t;
  one_server s;
  const store::block_key a{1, 11};
  s.store_block(a, std::byte{0x11});
  auto fabric = transport::make_loopback_fabric();
  block_server_config bc;
  bc.dir = s.dir;
  bc.identity = s.identity;
  bc.staging_bytes = s.layout.page_bytes();
  bc.put_limit_ms = store_put_limit_ms + 1;
  auto server = spawn_block_server(t.sys, bc, transport::make_loopback_transport(fabric, "store-0"), {});
  caf::scoped_actor self{t.sys};
  store_read_order o;
  o.request_id = 1;
  o.blocks = {block_ref{a.hi, a.lo, {0}}};
  o.block_index = {0};
  o.block_tokens = tokens;
  o.page_ids = {0};
  std::string why;
  self->request(server, std::chrono::seconds{10}, std::move(o))
      .receive([&](store_read_result& r) { why = r.errors.empty() ? "" : r.errors[0]; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  CHECK(why.find("put_limit_ms must be between 1 and 10000 (got 10001)") != std::string::npos);
  self->send_exit(server, caf::exit_reason::user_shutdown);
}

TEST_CASE("store config: a timeout of 0 ms is refused, naming the fields") {
  store_config sc;
  sc.enabled = true;
  sc.dir = "/nonexistent";  // validate() reads no files
  REQUIRE(sc.validate(tokens).empty());
  for (uint32_t store_config::*field : {&store_config::read_timeout_ms, &store_config::write_slot_timeout_ms,
                                        &store_config::housekeeping_interval_ms, &store_config::readopt_interval_ms}) {
    auto bad = sc;
    bad.*field = 0;
    CHECK(bad.validate(tokens) == "store intervals (housekeeping_interval_ms, read_timeout_ms, write_slot_timeout_ms, "
                                  "readopt_interval_ms) must be >= 1 ms");
  }
}

TEST_CASE("block server: a delete the index sent for an older write of a key leaves a later write of it alone (the "
          "write was queued before the delete; the index learns of it by its commit); a current one removes it") {
  test::cluster_system t;
  one_server s;
  auto fabric = transport::make_loopback_fabric();
  recording_index rec{t.sys};
  auto index = rec.index;
  auto& commits = rec.commits;
  auto& mutex = rec.mutex;
  block_server_config bc;
  bc.dir = s.dir;
  bc.identity = s.identity;
  bc.staging_bytes = 4 * s.layout.page_bytes();
  auto server = spawn_block_server(t.sys, bc, transport::make_loopback_transport(fabric, "store-0"), {index});
  // The writer: one block (a page per layer, layer-major), every byte 0x33.
  auto writer = transport::make_loopback_transport(fabric, "writer");
  const uint64_t layer_bytes = s.layout.page_bytes(), bytes = layer_bytes * layers;
  std::vector<std::byte> block(bytes, std::byte{0x33});
  transport::xfer_error err;
  auto src = writer->register_region(block.data(), block.size(), &err);
  REQUIRE(src);
  const store::block_key k{7, 77};
  caf::scoped_actor self{t.sys};
  const auto write = [&](uint64_t request_id) {
    store_write_slot slot;
    self->request(server, std::chrono::seconds{10}, store_write_begin{request_id, bytes})
        .receive([&](store_write_slot& x) { slot = x; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    const transport::region_key dst{slot.region.backend, slot.region.region_id, slot.region.size_bytes, slot.region.packed_key};
    const uint64_t id = writer->post_put({request_id, 0, "store-0", src->region_id, dst, {{0, slot.offset, bytes}}});
    REQUIRE(writer->poll(id, &err) == transport::xfer_state::done);  // loopback: done at post
    writer->release(id);
    store_write_order w{request_id, slot.slot_id, bytes, block_ref{k.hi, k.lo, {0}}, 0, 0, "chat", tokens, tokens, kv_dim, {}};
    for (uint32_t l = 0; l < layers; ++l)
      w.checksums.push_back(std::max<uint64_t>(1, gpu::layer_checksum(l, block.data() + l * layer_bytes, 1, layer_bytes)));
    uint64_t written = 0;
    self->request(server, std::chrono::seconds{10}, std::move(w))
        .receive([&](uint64_t n) { written = n; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    CHECK(written == bytes);
  };
  // Whether the server still serves k: a read queues behind the delete on the I/O thread.
  auto reader_xport = transport::make_loopback_transport(fabric, "reader");
  std::vector<std::byte> pool(s.layout.layer_stride_bytes() * layers);
  auto key = reader_xport->register_region(pool.data(), pool.size(), &err);
  REQUIRE(key);
  const auto serves_k = [&] {
    auto o = read_order(9, k, 0, *key);
    bool ok = false;
    self->request(server, std::chrono::seconds{10}, std::move(o))
        .receive([&](store_read_result& r) { ok = r.errors.size() == 1 && r.errors[0].empty(); },
                 [&](caf::error& e) { FAIL(t.sys.render(e)); });
    return ok;
  };
  write(1);
  write(2);  // the same key again: the index may not have heard of it when it evicts the first
  uint64_t first = 0, second = 0;
  for (int i = 0; i < 1000; ++i) {
    {
      std::lock_guard<std::mutex> lock{*mutex};
      if (commits->size() == 2) {
        first = (*commits)[0].write_seq;
        second = (*commits)[1].write_seq;
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  REQUIRE(first > 0);
  CHECK(second > first);
  self->send(server, delete_atom::value, k.hi, k.lo, first);  // stale: it removed the second write before
  CHECK(serves_k());
  self->send(server, delete_atom::value, k.hi, k.lo, second);
  CHECK_FALSE(serves_k());
  self->send_exit(server, caf::exit_reason::user_shutdown);
  self->send_exit(index, caf::exit_reason::user_shutdown);
}

TEST_CASE("block server: orders that would divide by zero (pages of 0 bytes, blocks of 0 tokens, a write slot of 0 "
          "bytes) are refused with a sentence naming them, and the server goes on serving") {
  test::cluster_system t;
  one_server s;
  const store::block_key a{1, 11};
  s.store_block(a, std::byte{0x11});
  auto fabric = transport::make_loopback_fabric();
  auto reader_xport = transport::make_loopback_transport(fabric, "reader");
  auto reader = s.register_reader(*reader_xport);
  const auto* key = &reader.key;
  auto& pool = reader.bytes;
  auto server = spawn_block_server(t.sys, s.config(), transport::make_loopback_transport(fabric, "store-0"), {});
  caf::scoped_actor self{t.sys};
  const auto read = [&](store_read_order o) {
    std::string why = "no answer";
    self->request(server, std::chrono::seconds{10}, std::move(o))
        .receive([&](store_read_result& r) { why = r.errors.empty() ? "no block" : r.errors[0]; },
                 [&](caf::error& e) { why = t.sys.render(e); });
    return why;
  };
  for (const bool no_planes : {true, false}) {
    auto o = read_order(1, a, 0, *key);
    (no_planes ? o.region.kv_planes : o.region.kv_dim) = 0;
    CHECK_MESSAGE(read(o).find("pages of 0 bytes") != std::string::npos, read(o));
  }
  std::string why;
  self->request(server, std::chrono::seconds{10}, store_write_begin{7, 0})
      .receive([&](store_write_slot&) { why = "granted"; }, [&](caf::error& e) { why = t.sys.render(e); });
  CHECK_MESSAGE(why.find("a write slot of 0 bytes") != std::string::npos, why);
  CHECK(read(read_order(2, a, 0, *key)).empty());  // still serving: the block lands
  CHECK(pool[0] == std::byte{0x11});
  self->send_exit(server, caf::exit_reason::user_shutdown);
}

TEST_CASE("block server: a write order larger than its slot is refused naming both sizes (it would checksum and "
          "store the next slot's bytes); a slot larger than the whole staging is refused naming both") {
  test::cluster_system t;
  one_server s;
  auto fabric = transport::make_loopback_fabric();
  auto server = spawn_block_server(t.sys, s.config(4), transport::make_loopback_transport(fabric, "store-0"), {});
  caf::scoped_actor self{t.sys};
  const uint64_t page = s.layout.page_bytes();
  store_write_slot slot;
  self->request(server, std::chrono::seconds{10}, store_write_begin{1, page})
      .receive([&](store_write_slot& x) { slot = x; }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
  store_write_order w{1, slot.slot_id, 2 * page, block_ref{3, 33, {0}}, 0, 0, "chat", tokens, tokens, kv_dim, {1, 1}};
  std::string why = "written";
  self->request(server, std::chrono::seconds{10}, std::move(w))
      .receive([](uint64_t) {}, [&](caf::error& e) { why = t.sys.render(e); });
  CHECK_MESSAGE(why.find("a write of " + std::to_string(2 * page) + " bytes into slot " + std::to_string(slot.slot_id) +
                         " of " + std::to_string(page)) != std::string::npos,
                why);
  why = "granted";
  self->request(server, std::chrono::seconds{10}, store_write_begin{2, 5 * page})
      .receive([](store_write_slot&) {}, [&](caf::error& e) { why = t.sys.render(e); });
  CHECK_MESSAGE(why.find("write staging is full (a slot of " + std::to_string(5 * page) + " bytes asked, of " +
                         std::to_string(4 * page) + " in all)") != std::string::npos,
                why);
  // The refused order gave its slot back: the whole staging can be granted again.
  why = "granted";
  self->request(server, std::chrono::seconds{10}, store_write_begin{3, 4 * page})
      .receive([](store_write_slot&) {}, [&](caf::error& e) { why = t.sys.render(e); });
  CHECK(why == "granted");
  self->send_exit(server, caf::exit_reason::user_shutdown);
}

TEST_CASE("block index: blocks it drops before it knows their server (a server recovering at start commits them "
          "before the cluster hands the index its server list) are deleted once the list comes") {
  test::cluster_system t;
  one_server s;
  const store::block_key a{1, 11}, b{2, 22};
  s.store_block(a, std::byte{0x11});
  s.store_block(b, std::byte{0x22});
  block_index_config ic;
  ic.capacity_blocks = 1;  // one of the two recovered blocks is evicted at once
  ic.housekeeping_interval_ms = 10;
  auto index = spawn_block_index(t.sys, ic, {});
  auto fabric = transport::make_loopback_fabric();
  auto server = spawn_block_server(t.sys, s.config(), transport::make_loopback_transport(fabric, "store-0"), {index});
  caf::scoped_actor self{t.sys};
  const auto blocks_in_index = [&] {
    uint64_t n = 0;
    self->request(index, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](store_stats& st) { n = st.blocks; }, [](caf::error&) {});
    return n;
  };
  for (int i = 0; i < 1000 && blocks_in_index() != 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
  REQUIRE(blocks_in_index() == 1);
  const auto on_disk = [&] {
    return std::filesystem::exists(store::block_path(s.dir, a)) + std::filesystem::exists(store::block_path(s.dir, b));
  };
  CHECK(on_disk() == 2);  // the evicted one's delete had nowhere to go
  self->send(index, std::vector<block_server_actor>{server});
  for (int i = 0; i < 1000 && on_disk() != 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
  CHECK(on_disk() == 1);
  self->send_exit(server, caf::exit_reason::user_shutdown);
  self->send_exit(index, caf::exit_reason::user_shutdown);
}

TEST_CASE("block server: reading 200 blocks in one order keeps at most 64 of their files open at once (an "
          "order of ~1000 reached the usual limit of 1024 open files and its later blocks failed), and serves them all") {
  constexpr uint32_t n = 200;
  test::cluster_system t;
  one_server s{n};
  std::vector<store::block_key> keys;
  for (uint32_t i = 0; i < n; ++i) {
    keys.push_back({uint64_t{i} + 1, 0x5eed});
    s.store_block(keys.back(), static_cast<std::byte>(i % 251 + 1));
  }
  auto fabric = transport::make_loopback_fabric();
  auto reader = transport::make_loopback_transport(fabric, "reader");
  auto pool = s.register_reader(*reader);
  auto bc = s.config(16);         // batches of 16 blocks per put
  bc.fault_layer_delay_ms = 100;  // each layer waits first: the watcher sees what the read holds meanwhile
  auto server = spawn_block_server(t.sys, bc, transport::make_loopback_transport(fabric, "store-0"), {});
  // The control: a file of the directory this test holds open itself, which the watcher must see.
  const int control = ::open(store::block_path(s.dir, keys[0]).c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(control >= 0);
  open_file_watcher watcher{s.dir};
  store_read_result r;
  {
    caf::scoped_actor self{t.sys};
    self->request(server, std::chrono::seconds{30}, s.read_of(1, keys, pool.key))
        .receive([&](store_read_result& x) { r = std::move(x); }, [&](caf::error& e) { FAIL(t.sys.render(e)); });
    self->send_exit(server, caf::exit_reason::user_shutdown);
  }
  const size_t most = watcher.stop();
  ::close(control);
  CHECK(most >= 1);       // the watcher saw the control
  CHECK(most <= 1 + 64);  // before: the control and all 200
  REQUIRE(r.errors.size() == n);
  size_t failed = 0, wrong = 0;
  for (uint32_t i = 0; i < n; ++i) {
    if (!r.errors[i].empty() && failed++ == 0) MESSAGE("block " << i << ": " << r.errors[i]);
    for (uint32_t l = 0; l < layers; ++l) {
      const auto* page = pool.bytes.data() + s.layout.offset_bytes(l, i);
      const auto fill = static_cast<std::byte>(i % 251 + 1);
      if (!std::all_of(page, page + s.layout.page_bytes(), [&](std::byte b) { return b == fill; })) ++wrong;
    }
  }
  CHECK(failed == 0);
  CHECK(wrong == 0);
}

TEST_CASE("block server: a block that does not fit the reader's pages is refused naming the field that differs, with both "
          "values (before, every mismatch printed the layer counts and sizes, equal in most of them)") {
  test::cluster_system t;
  one_server s;
  const store::block_key a{1, 11};
  s.store_block(a, std::byte{0x11});
  auto fabric = transport::make_loopback_fabric();
  auto reader = transport::make_loopback_transport(fabric, "reader");
  auto pool = s.register_reader(*reader);
  auto server = spawn_block_server(t.sys, s.config(4), transport::make_loopback_transport(fabric, "store-0"), {});
  caf::scoped_actor self{t.sys};
  const auto read = [&](store_read_order o) {
    std::string why = "no answer";
    self->request(server, std::chrono::seconds{10}, std::move(o))
        .receive([&](store_read_result& r) { why = r.errors.empty() ? "no block" : r.errors[0]; },
                 [&](caf::error& e) { why = t.sys.render(e); });
    return why;
  };
  const std::string prefix = "block " + a.hex() + " does not match the reader's pages: ";
  auto wider = s.read_of(1, {a}, pool.key);
  wider.region.kv_dim = 8;  // the reader's pages are twice as wide: so are its layers
  CHECK(read(wider) == prefix + "kv_dim 4, the reader's 8");
  auto longer = s.read_of(2, {a}, pool.key);
  longer.block_tokens = 32;  // the order's blocks are two pages
  CHECK(read(longer) == prefix + "blocks of 16 tokens, the order's 32");
  auto beyond = s.read_of(3, {a}, pool.key);
  beyond.block_index = {3};  // block 3 of the prompt: its page is the order's fourth
  beyond.page_ids = {0, 1};
  CHECK(read(beyond) == prefix + "at position 3 it needs 4 of the order's pages, the order names 2");
  CHECK(read(s.read_of(4, {a}, pool.key)).empty());  // the same block, fitting: served
  CHECK(pool.bytes[0] == std::byte{0x11});
  self->send_exit(server, caf::exit_reason::user_shutdown);
}

TEST_CASE("block server: a server started again on its disk numbers its writes after its predecessor's, so the index "
          "applies its deletes of blocks the one before had written (counted from 0 again, they were ignored and the "
          "index kept naming files that were gone)") {
  test::cluster_system t;
  one_server s;
  const store::block_key k{5, 55};
  s.store_block(k, std::byte{0x21});
  auto fabric = transport::make_loopback_fabric();
  caf::scoped_actor self{t.sys};
  // The write sequence number each server process gives the block it finds on its disk.
  const auto found_seq = [&](const char* name) {
    recording_index rec{t.sys};
    auto server = spawn_block_server(t.sys, s.config(), transport::make_loopback_transport(fabric, name), {rec.index});
    for (int i = 0; i < 2500 && rec.num_commits() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
    uint64_t seq = 0;
    {
      std::lock_guard<std::mutex> lock{*rec.mutex};
      REQUIRE(rec.commits->size() == 1);
      seq = (*rec.commits)[0].write_seq;
    }
    self->monitor(server);
    self->send_exit(server, caf::exit_reason::user_shutdown);
    self->receive([](caf::down_msg&) {});
    self->send_exit(rec.index, caf::exit_reason::user_shutdown);
    return seq;
  };
  const uint64_t before = found_seq("store-a");
  const uint64_t after = found_seq("store-b");
  CHECK(before > 0);
  CHECK(after > before);
  // The index heard of the first process's copy last (a commit that came late over a slow link):
  // the second process's delete of its copy still removes it.
  store::block_index index;
  index.upsert({k, {}, {0}, 1, store::retention::chat, 1e18, 0, {before + 1000}}, 0);
  index.upsert({k, {}, {0}, 1, store::retention::chat, 1e18, 0, {after}}, 0);
  CHECK(index.drop_copy(k, 0, after));
  CHECK(index.find(k) == nullptr);
}

TEST_CASE("block server: a server that finds thousands of blocks on its disk at start commits them in batches of at "
          "most commit_batch_blocks (one message per block flooded the link, and a probe behind them timed out)") {
  constexpr uint32_t n = 2 * static_cast<uint32_t>(commit_batch_blocks) + 52;
  test::cluster_system t;
  one_server s;
  for (uint32_t i = 0; i < n; ++i) s.store_block({uint64_t{i} + 1, 0xba7c4}, std::byte{0x44});
  recording_index rec{t.sys};
  auto fabric = transport::make_loopback_fabric();
  auto server = spawn_block_server(t.sys, s.config(), transport::make_loopback_transport(fabric, "store-0"), {rec.index});
  for (int i = 0; i < 5000 && rec.num_commits() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{2});
  {
    std::lock_guard<std::mutex> lock{*rec.mutex};
    CHECK(rec.commits->size() == n);
    CHECK(*rec.messages == std::vector<size_t>{commit_batch_blocks, commit_batch_blocks, 52});
    CHECK(std::all_of(rec.commits->begin(), rec.commits->end(), [](const block_commit& c) { return c.age_ms > 0; }));
  }
  caf::scoped_actor self{t.sys};
  self->send_exit(server, caf::exit_reason::user_shutdown);
  self->send_exit(rec.index, caf::exit_reason::user_shutdown);
}

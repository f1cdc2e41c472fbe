// The block store engine: keys, block files, the index (LRU, expiry, a restart's recovery), the server ring,
// and the Mooncake trace's reference hit ratios.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "gpu/kv_cache.hpp"
#include "store/block_file.hpp"
#include "store/block_index.hpp"
#include "store/block_key.hpp"
#include "store/prefix_cache.hpp"
#include "store/staging_pool.hpp"

using namespace baton;
using namespace baton::store;

namespace {

kv_identity tiny_identity() { return {"baton-tiny seed 1", 4, 64, 32, 16, "f32"}; }

std::vector<int32_t> tokens(size_t n, int32_t offset = 0) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 31 + offset) % 259);
  return t;
}

std::string temp_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("baton-store-test-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

}  // namespace

TEST_CASE("block keys chain over full blocks, and depend on every earlier token and on the model identity") {
  const auto salt = salt_of(tiny_identity());
  const auto a = tokens(100);
  const auto ka = chain_keys(salt, a, 32);
  CHECK(ka.size() == 3);  // 100 tokens: three full blocks of 32, the partial fourth has no key
  auto b = a;
  b.resize(96);
  CHECK(chain_keys(salt, b, 32) == ka);  // a shared prefix shares its keys
  b[5] ^= 1;                              // one token of block 0 differs: every key differs
  const auto kb = chain_keys(salt, b, 32);
  for (size_t i = 0; i < 3; ++i) CHECK_FALSE(kb[i] == ka[i]);
  auto other = tiny_identity();
  other.kv_dim = 128;  // another KV layout: blocks never mix
  CHECK_FALSE(chain_keys(salt_of(other), a, 32)[0] == ka[0]);
  other = tiny_identity();
  other.model_id = "baton-tiny seed 2";
  CHECK_FALSE(chain_keys(salt_of(other), a, 32)[0] == ka[0]);
  CHECK(ka[0].hex().size() == 32);
}

TEST_CASE("a block key is SHA-256 of the previous key (hi, lo, little-endian) and the block's tokens, its first 128 bits: "
          "no client can choose tokens that take another prompt's key (Python's hashlib gives the same)") {
  const int32_t four[4] = {1, 2, 3, 4};
  CHECK(chain_step({}, four, 4) == block_key{0xb7f5d4b817ee603aull, 0x74669b9a711868d5ull});
  const int32_t two[2] = {7, -1};
  CHECK(chain_step({0x0123456789abcdefull, 0xfedcba9876543210ull}, two, 2) ==
        block_key{0xcb299aa32546c605ull, 0xd8e06bf3188fa869ull});
}

namespace {

/// kv_layer_checksum's definition, written out plainly: eight multiply-xorshift lanes over the
/// layer's pages as one stream of 64-bit words per page (a short tail zero-padded), folded.
uint64_t checksum_by_definition(baton::gpu::kv_cache& kv, uint32_t layer, const std::vector<uint32_t>& pages) {
  uint64_t lane[8];
  for (int k = 0; k < 8; ++k) lane[k] = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(k + 1) ^ layer;
  const auto& l = kv.layout();
  for (auto page : pages) {
    const auto* p = reinterpret_cast<const unsigned char*>(kv.data()) + l.offset_bytes(layer, page);
    const uint64_t stripes = l.page_bytes() / 64 * 64;
    for (uint64_t off = 0; off < l.page_bytes(); off += 8) {
      uint64_t w = 0;
      std::memcpy(&w, p + off, std::min<uint64_t>(8, l.page_bytes() - off));
      const int k = off < stripes ? static_cast<int>(off / 8 % 8) : static_cast<int>((off - stripes) / 8);
      lane[k] = (lane[k] ^ w) * 0xFF51AFD7ED558CCDull;
      lane[k] ^= lane[k] >> 32;
    }
  }
  uint64_t h = lane[0];
  for (int k = 1; k < 8; ++k) h = (h ^ lane[k]) * 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 29);
}

}  // namespace

TEST_CASE("the layer checksum equals its definition on this CPU's code path (vector or scalar), for pages of whole "
          "and partial stripes, and any flipped bit changes it") {
  // 64 KiB pages (whole 64-byte stripes) and 24-byte pages (a tail only: kv_dim 3, one token).
  for (const baton::gpu::kv_layout layout : {baton::gpu::kv_layout{3, 8, 16, 512, 2}, baton::gpu::kv_layout{3, 8, 1, 3, 2}}) {
    CAPTURE(layout.page_bytes());
    baton::gpu::kv_cache kv{layout};
    auto* bytes = reinterpret_cast<unsigned char*>(kv.data());
    for (uint64_t i = 0; i < layout.total_bytes(); ++i) bytes[i] = static_cast<unsigned char>(i * 131 + (i >> 9));
    const std::vector<uint32_t> pages{5, 2, 7};
    const uint64_t sum = kv.kv_layer_checksum(1, pages, 3);
    CHECK(sum == checksum_by_definition(kv, 1, pages));
    CHECK(kv.kv_layer_checksum(0, pages, 3) != sum);  // the layer is in the seed
    for (uint64_t at : {uint64_t{0}, layout.page_bytes() / 2, layout.page_bytes() - 1}) {
      unsigned char& b = bytes[layout.offset_bytes(1, 2) + at];
      for (int bit = 0; bit < 8; bit += 7) {
        b ^= static_cast<unsigned char>(1 << bit);
        CHECK(kv.kv_layer_checksum(1, pages, 3) != sum);
        b ^= static_cast<unsigned char>(1 << bit);
      }
    }
    CHECK(kv.kv_layer_checksum(1, pages, 3) == sum);
  }
}

TEST_CASE("block files round-trip layer by layer, and every kind of damage is refused with a sentence") {
  const auto id = tiny_identity();
  gpu::kv_cache pool{{id.num_layers, 8, id.page_tokens, id.kv_dim}};
  for (uint64_t i = 0; i < pool.size_bytes() / sizeof(float); ++i)
    reinterpret_cast<float*>(pool.data())[i] = static_cast<float>(i % 977) * 0.5f;
  const std::vector<uint32_t> pages = {5, 2};  // a block of 32 tokens = 2 pages, not contiguous
  const auto salt = salt_of(id);
  const auto key = chain_keys(salt, tokens(32), 32)[0];
  block_header h;
  h.salt = salt;
  h.key = key;
  h.num_layers = id.num_layers;
  h.kv_dim = id.kv_dim;
  h.block_tokens = 32;
  h.page_tokens = 16;
  h.layer_bytes = 2 * pool.layout().page_bytes();
  for (uint32_t l = 0; l < id.num_layers; ++l) h.layer_checksums.push_back(pool.kv_layer_checksum(l, pages, 2));
  auto pieces = [&](uint32_t l) {
    layer_pieces p;
    for (auto pg : pages) p.emplace_back(pool.data() + pool.layout().offset_bytes(l, pg), pool.layout().page_bytes());
    return p;
  };
  const auto dir = temp_dir("files");
  const auto path = block_path(dir, key);
  REQUIRE(write_block_file(path, h, pieces).empty());

  // Read every layer into two other pages of a fresh pool: the checksums match.
  gpu::kv_cache reader{pool.layout()};
  std::string why;
  block_header got;
  int fd = open_block_file(path, salt, key, &got, &why);
  REQUIRE_MESSAGE(fd >= 0, why);
  CHECK(got.layer_checksums == h.layer_checksums);
  std::vector<std::byte> buf(h.layer_bytes);
  const std::vector<uint32_t> dst = {0, 7};
  for (uint32_t l = 0; l < id.num_layers; ++l) {
    REQUIRE(read_block_layer(fd, got, l, buf.data()).empty());
    for (size_t i = 0; i < 2; ++i)
      std::memcpy(reader.data() + reader.layout().offset_bytes(l, dst[i]), buf.data() + i * reader.layout().page_bytes(),
                  reader.layout().page_bytes());
    CHECK(reader.kv_layer_checksum(l, dst, 2) == h.layer_checksums[l]);
  }
  ::close(fd);

  // Other model: refused.
  auto other = id;
  other.model_id = "other";
  CHECK(open_block_file(path, salt_of(other), key, &got, &why) < 0);
  CHECK(why.find("another model") != std::string::npos);
  // A flipped data byte passes the header but not the layer checksum.
  {
    std::fstream f{path, std::ios::in | std::ios::out | std::ios::binary};
    f.seekp(static_cast<std::streamoff>(h.layer_offset(2) + 100));
    char c;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(static_cast<std::streamoff>(h.layer_offset(2) + 100));
    f.write(&c, 1);
  }
  fd = open_block_file(path, salt, key, &got, &why);
  REQUIRE(fd >= 0);
  REQUIRE(read_block_layer(fd, got, 2, buf.data()).empty());
  std::memcpy(reader.data() + reader.layout().offset_bytes(2, 0), buf.data(), h.layer_bytes / 2);
  std::memcpy(reader.data() + reader.layout().offset_bytes(2, 7), buf.data() + h.layer_bytes / 2, h.layer_bytes / 2);
  CHECK(reader.kv_layer_checksum(2, dst, 2) != h.layer_checksums[2]);
  ::close(fd);
  // A flipped header byte, a truncated file, a missing file.
  {
    std::fstream f{path, std::ios::in | std::ios::out | std::ios::binary};
    f.seekp(60);
    f.put('\x7f');
  }
  CHECK(open_block_file(path, salt, key, &got, &why) < 0);
  CHECK(why.find("corrupt header") != std::string::npos);
  REQUIRE(write_block_file(path, h, pieces).empty());
  std::filesystem::resize_file(path, h.file_bytes() - 1);
  CHECK(open_block_file(path, salt, key, &got, &why) < 0);
  CHECK(why.find("truncated") != std::string::npos);
  std::filesystem::remove(path);
  CHECK(open_block_file(path, salt, key, &got, &why) < 0);
  CHECK(why.find("No such file") != std::string::npos);
  // Layer sizes whose file size would wrap around 2^64 (or a layer of nothing) are no block's.
  for (const uint64_t layer_bytes : {uint64_t{0}, uint64_t{1} << 63}) {
    auto huge = h;
    huge.layer_bytes = layer_bytes;
    CHECK(write_block_file(path, huge, pieces) == "block header: layers of " + std::to_string(layer_bytes) + " bytes (1 to 2^40)");
    CHECK_FALSE(std::filesystem::exists(path));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a store directory's lock: one process holds it (the others are refused, naming its pid) until it ends, "
          "however it ends; its holder may scan away every temporary file, whatever its age") {
  namespace fs = std::filesystem;
  const auto dir = temp_dir("lock");
  std::string why;
  int ready[2], done[2];
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(done) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // another process: takes the lock, says so, waits to be told to end
    std::string w;
    const char ok = lock_block_dir(dir, &w) >= 0 ? 'y' : 'n';
    (void)!::write(ready[1], &ok, 1);
    char c;
    (void)!::read(done[0], &c, 1);
    ::_exit(0);  // the lock goes with the process: nothing lets go of it by hand
  }
  char ok = 0;
  REQUIRE(::read(ready[0], &ok, 1) == 1);
  REQUIRE(ok == 'y');
  CHECK(lock_block_dir(dir, &why) == -1);
  CHECK_MESSAGE(why.find("is served by another block server already (process " + std::to_string(child) + " holds") !=
                    std::string::npos,
                why);
  (void)!::write(done[1], "x", 1);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  for (int fd : {ready[0], ready[1], done[0], done[1]}) ::close(fd);
  bool shared = true;
  const int fd = lock_block_dir(dir, &why, &shared);
  CHECK(fd >= 0);
  CHECK_FALSE(shared);
  // This process holds it already (a server still stopping as its successor starts): shared,
  // and held until the last holder lets go, whichever goes first.
  const int successor = lock_block_dir(dir, &why, &shared);
  CHECK(successor >= 0);
  CHECK(shared);
  const auto another_process_locks = [&] {  // (a fork shares this process's registry: flock itself)
    const pid_t p = ::fork();
    if (p == 0) {
      const int f = ::open((dir + "/.lock").c_str(), O_RDWR | O_CLOEXEC);
      ::_exit(f >= 0 && ::flock(f, LOCK_EX | LOCK_NB) == 0 ? 0 : 1);
    }
    int st = 0;
    ::waitpid(p, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
  };
  CHECK_FALSE(another_process_locks());
  // Held: a temporary file written a moment ago is a dead writer's too.
  const auto key = chain_keys(salt_of(tiny_identity()), tokens(32), 32)[0];
  fs::create_directories(fs::path(block_path(dir, key)).parent_path());
  const auto fresh = block_path(dir, key) + ".tmp.999.3";
  std::ofstream{fresh} << "half";
  CHECK(scan_block_dir(dir, salt_of(tiny_identity())).removed == 0);
  CHECK(fs::exists(fresh));
  CHECK(scan_block_dir(dir, salt_of(tiny_identity()), true).removed == 1);
  CHECK_FALSE(fs::exists(fresh));
  unlock_block_dir(fd);
  CHECK_FALSE(another_process_locks());  // the successor holds it still
  unlock_block_dir(successor);
  CHECK(another_process_locks());  // let go by every holder
  const int again = lock_block_dir(dir, &why, &shared);
  CHECK(again >= 0);
  CHECK_FALSE(shared);
  unlock_block_dir(again);
  fs::remove_all(dir);
}

TEST_CASE("a store directory scanned at start: this model's blocks least recently used first with their retention and age; "
          "unreadable and stale temporary files deleted; other models' blocks and fresh temporaries left alone") {
  namespace fs = std::filesystem;
  const auto id = tiny_identity();
  const auto salt = salt_of(id);
  const auto keys = chain_keys(salt, tokens(96), 32);  // a chain of 3 blocks
  REQUIRE(keys.size() == 3);
  const uint64_t layer_bytes = 256;
  std::vector<std::byte> data(layer_bytes, std::byte{7});
  auto header = [&](const block_key& s, const block_key& k, const block_key& parent, uint8_t retention) {
    block_header h;
    h.salt = s;
    h.key = k;
    h.parent = parent;
    h.num_layers = id.num_layers;
    h.kv_dim = id.kv_dim;
    h.block_tokens = 32;
    h.page_tokens = 16;
    h.layer_bytes = layer_bytes;
    h.layer_checksums.assign(id.num_layers, 1);
    h.retention = retention;
    return h;
  };
  auto layer = [&](uint32_t) { return layer_pieces{{data.data(), layer_bytes}}; };
  const auto dir = temp_dir("scan");
  CHECK(scan_block_dir(dir, salt).blocks.empty());  // missing: nothing, no error
  const auto now = fs::file_time_type::clock::now();
  for (size_t b = 0; b < 3; ++b) {
    const auto path = block_path(dir, keys[b]);
    REQUIRE(write_block_file(path, header(salt, keys[b], b ? keys[b - 1] : block_key{}, b == 1 ? 1 : 0), layer).empty());
  }
  auto other = id;
  other.model_id = "another model";
  const auto foreign_key = chain_keys(salt_of(other), tokens(32), 32)[0];
  REQUIRE(write_block_file(block_path(dir, foreign_key), header(salt_of(other), foreign_key, {}, 0), layer).empty());
  // Damage: a truncated block, a block under another block's name, garbage named like a block.
  const auto extra = chain_keys(salt, tokens(128), 32)[3];
  REQUIRE(write_block_file(block_path(dir, extra), header(salt, extra, keys[2], 0), layer).empty());
  fs::resize_file(block_path(dir, extra), 5000);
  const auto misnamed = chain_keys(salt, tokens(160), 32)[4];
  fs::create_directories(fs::path(block_path(dir, misnamed)).parent_path());
  fs::copy_file(block_path(dir, keys[0]), block_path(dir, misnamed));
  const auto junk_key = chain_keys(salt, tokens(192), 32)[5];
  fs::create_directories(fs::path(block_path(dir, junk_key)).parent_path());
  std::ofstream{block_path(dir, junk_key)} << "not a block";
  // A block of format version 3, keyed before keys were SHA-256: no CHECK asks for it again.
  const auto old_format = chain_keys(salt, tokens(224), 32)[6];
  REQUIRE(write_block_file(block_path(dir, old_format), header(salt, old_format, keys[2], 0), layer).empty());
  {
    std::fstream f(block_path(dir, old_format), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);  // after the magic
    const uint32_t three = 3;
    f.write(reinterpret_cast<const char*>(&three), sizeof three);
  }
  // A good block in the wrong directory (moved by hand): reads and deletes would never find it.
  const auto moved = fs::path(dir) / "zz" / (keys[2].hex() + ".blk");
  fs::create_directories(moved.parent_path());
  fs::copy_file(block_path(dir, keys[2]), moved);
  // Temporaries: a crashed writer's from an hour ago, and one being written now.
  const auto stale = block_path(dir, keys[0]) + ".tmp.999.1";
  const auto fresh = block_path(dir, keys[1]) + ".tmp.999.2";
  std::ofstream{stale} << "half";
  std::ofstream{fresh} << "half";
  fs::last_write_time(stale, now - std::chrono::hours{1});
  // Written (and last used: access times too) newest-first: the scan must order by time, not by
  // name or directory order. Dated last, as the copies above read two of them.
  for (size_t b = 0; b < 3; ++b) {
    const timespec then{::time(nullptr) - 3600 * (b == 0 ? 1 : (b == 1 ? 3 : 2)), 0};
    const timespec times[2] = {then, then};
    REQUIRE(::utimensat(AT_FDCWD, block_path(dir, keys[b]).c_str(), times, 0) == 0);
  }

  const auto scan = scan_block_dir(dir, salt);
  REQUIRE(scan.blocks.size() == 3);
  CHECK(scan.blocks[0].key == keys[1]);  // 3 h old
  CHECK(scan.blocks[1].key == keys[2]);  // 2 h
  CHECK(scan.blocks[2].key == keys[0]);  // 1 h
  CHECK(scan.blocks[0].parent == keys[0]);
  CHECK(scan.blocks[0].retention == 1);
  CHECK(scan.blocks[1].retention == 0);
  CHECK(scan.blocks[2].parent == block_key{});
  CHECK(scan.blocks[2].file_bytes == header(salt, keys[0], {}, 0).file_bytes());
  CHECK(scan.blocks[0].age_ms >= 3 * 3600 * 1000ull);
  CHECK(scan.blocks[0].age_ms < 4 * 3600 * 1000ull);
  CHECK(scan.foreign == 1);
  CHECK(scan.removed == 6);
  CHECK(!fs::exists(block_path(dir, old_format)));
  CHECK(!scan.first_removed.empty());
  CHECK(!fs::exists(moved));
  CHECK(fs::exists(block_path(dir, foreign_key)));
  CHECK(!fs::exists(block_path(dir, extra)));
  CHECK(!fs::exists(block_path(dir, misnamed)));
  CHECK(!fs::exists(block_path(dir, junk_key)));
  CHECK(!fs::exists(stale));
  CHECK(fs::exists(fresh));
  for (const auto& k : keys) CHECK(fs::exists(block_path(dir, k)));
  // A second scan finds the same blocks and nothing more to remove.
  const auto again = scan_block_dir(dir, salt);
  CHECK(again.blocks.size() == 3);
  CHECK(again.removed == 0);
  fs::remove_all(dir);
}

TEST_CASE("blocks found at a restart keep their chains alive: an ancestor takes the class and age of its longest-lived "
          "descendant, as the live index kept it, instead of expiring by its own write time") {
  retention_policy ret;  // chat 7 days, agent 3
  const uint64_t day_ms = 86400ull * 1000;
  // A system prompt written 30 days ago (a), under it a chat block 10 days old (b) and an agent
  // block 1 day old (c); a chain of its own (x), 9 days old; and d, 2 days, whose parent is gone.
  std::vector<found_block> found = {
      {block_key{0, 1}, {}, 0, 10, 30 * day_ms},
      {block_key{0, 2}, block_key{0, 1}, 0, 10, 10 * day_ms},
      {block_key{0, 3}, block_key{0, 2}, 1, 10, 1 * day_ms},
      {block_key{0, 9}, {}, 0, 10, 9 * day_ms},
      {block_key{0, 4}, block_key{0, 99}, 0, 10, 2 * day_ms},
  };
  keep_chains_alive(found, ret);
  // c lives 2 more days (agent); a and b take that.
  for (size_t i : {0u, 1u, 2u}) {
    CAPTURE(i);
    CHECK(found[i].retention == 1);
    CHECK(found[i].age_ms == 1 * day_ms);
  }
  CHECK(found[3].age_ms == 9 * day_ms);  // its own chain: it expires, as it would have live
  CHECK(found[4].age_ms == 2 * day_ms);
  // A descendant that lives less long changes nothing: a 1-day-old chat block above a 2-day agent one.
  std::vector<found_block> young_root = {{block_key{0, 1}, {}, 0, 10, 1 * day_ms}, {block_key{0, 2}, block_key{0, 1}, 1, 10, 2 * day_ms}};
  keep_chains_alive(young_root, ret);
  CHECK(young_root[0].retention == 0);
  CHECK(young_root[0].age_ms == 1 * day_ms);
}

TEST_CASE("the index: longest cached prefix, leaf-first LRU eviction, expiry by class") {
  retention_policy ret;
  block_index idx{3};
  auto key = [](uint64_t i) { return block_key{0, i}; };
  auto add_chain = [&](std::vector<uint64_t> ids, retention cls, double now) {
    for (auto i = ids.rbegin(); i != ids.rend(); ++i)  // last block first: leading blocks most recent
      idx.upsert({key(*i), {}, {0}, 100, cls, now + ret.ttl_s(cls), 0}, now);
    return idx.evict_to_capacity();
  };
  CHECK(add_chain({1, 2, 3}, retention::chat, 0).empty());
  CHECK(idx.longest_prefix({key(1), key(2), key(3), key(4)}, 1) == 3);
  CHECK(idx.longest_prefix({key(2), key(3)}, 1) == 2);
  CHECK(idx.longest_prefix({key(9), key(2)}, 1) == 0);  // a prefix must start at the first block
  // A new chain sharing block 1: the old chain's leaves go first.
  const auto evicted = add_chain({1, 5}, retention::chat, 2);
  REQUIRE(evicted.size() == 1);
  CHECK(evicted[0].key == key(3));
  CHECK(idx.longest_prefix({key(1), key(2), key(3)}, 3) == 2);
  // Expiry: an agent chain expires after 3 days, chat survives until 7.
  block_index big;
  for (uint64_t i = 10; i < 13; ++i) big.upsert({key(i), {}, {0}, 1, retention::agent, ret.agent_ttl_s, 0}, 0);
  for (uint64_t i = 20; i < 23; ++i) big.upsert({key(i), {}, {0}, 1, retention::chat, ret.chat_ttl_s, 0}, 0);
  CHECK(big.expire(3 * 86400.0 - 1).empty());
  const auto gone = big.expire(3 * 86400.0);
  CHECK(gone.size() == 3);  // 10, 11 and 12
  CHECK(big.longest_prefix({key(20), key(21), key(22)}, 3 * 86400.0) == 3);
  CHECK(big.expire(7 * 86400.0).size() == 3);
  CHECK(big.size() == 0);
  CHECK(parse_retention("agent") == retention::agent);
  CHECK_FALSE(parse_retention("forever"));
}

TEST_CASE("the index: a chain committed first block first (as a write-back does) is still evicted from its leaves, "
          "and an ancestor expires no earlier than its descendants") {
  block_index idx{3};
  auto key = [](uint64_t i) { return block_key{0, i}; };
  auto commit = [&](uint64_t i, uint64_t parent, double expires, double now) {
    idx.upsert({key(i), parent ? key(parent) : block_key{}, {0}, 1, retention::chat, expires, 0}, now);
  };
  // 1 <- 2 <- 3, in that order: before, 1 was the least recent and went first, leaving 2 and 3
  // unreachable.
  commit(1, 0, 100, 0);
  commit(2, 1, 100, 0);
  commit(3, 2, 100, 0);
  commit(9, 0, 100, 1);  // another prompt's first block
  const auto evicted = idx.evict_to_capacity();
  REQUIRE(evicted.size() == 1);
  CHECK(evicted[0].key == key(3));
  CHECK(idx.longest_prefix({key(1), key(2)}, 1) == 2);
  // A later turn extends the chain with a longer retention: its root lives as long.
  block_index turns;
  turns.upsert({key(1), {}, {0}, 1, retention::chat, 10, 0}, 0);
  turns.upsert({key(2), key(1), {0}, 1, retention::chat, 10, 0}, 0);
  turns.upsert({key(3), key(2), {0}, 1, retention::chat, 50, 5}, 5);
  CHECK(turns.expire(20).empty());  // before, 1 and 2 went at 10 and 3 could never be found again
  CHECK(turns.longest_prefix({key(1), key(2), key(3)}, 20) == 3);
  CHECK(turns.expire(50).size() == 3);
}

TEST_CASE("the index after a restart: a block found past its retention is held, unserved, while other servers "
          "recover; a descendant from another server keeps it alive whichever comes first, as the live index did") {
  auto key = [](uint64_t i) { return block_key{0, i}; };
  // A recovered commit: found on disk, held until 10 s.
  const double hold = 10;
  auto recovered = [&](block_index& idx, uint64_t i, uint64_t parent, double expires, double now) {
    idx.upsert({key(i), parent ? key(parent) : block_key{}, {0}, 1, retention::chat, expires, 0}, now, hold);
  };
  SUBCASE("the old root comes first: held, then revived by its child") {
    block_index idx;
    recovered(idx, 1, 0, -5, 1);  // expired 5 s before the index started
    REQUIRE(idx.find(key(1)) != nullptr);
    CHECK(idx.longest_prefix({key(1)}, 1) == 0);  // held, not served
    CHECK(idx.expire(2).empty());                 // before, it was deleted as it came
    recovered(idx, 2, 1, 1000, 3);
    CHECK(idx.longest_prefix({key(1), key(2)}, 3) == 2);
    CHECK(idx.expire(hold + 1).empty());
    CHECK(idx.find(key(1))->expires_at_s == 1000);
  }
  SUBCASE("the child comes first: the root starts from its expiry") {
    block_index idx;
    recovered(idx, 2, 1, 1000, 1);
    recovered(idx, 1, 0, -5, 2);  // before, a new block never looked at its children here
    CHECK(idx.longest_prefix({key(1), key(2)}, 3) == 2);
    CHECK(idx.expire(hold + 1).empty());
  }
  SUBCASE("three servers, a chain of three, the middle last: the grandchild reaches the root through it") {
    block_index idx;
    recovered(idx, 3, 2, 1000, 1);
    recovered(idx, 1, 0, -5, 2);
    recovered(idx, 2, 1, -3, 3);
    CHECK(idx.longest_prefix({key(1), key(2), key(3)}, 4) == 3);
    CHECK(idx.expire(hold + 1).empty());
  }
  SUBCASE("with no descendant it goes when the hold ends, and a parent coming after the hold starts afresh") {
    block_index idx;
    recovered(idx, 1, 0, -5, 1);
    recovered(idx, 12, 11, 1000, 1);  // its parent 11 is not here
    const auto gone = idx.expire(hold);
    REQUIRE(gone.size() == 1);
    CHECK(gone[0].key == key(1));
    recovered(idx, 11, 0, -5, hold + 1);  // too late: the recovery it waited for is over
    CHECK(idx.longest_prefix({key(11), key(12)}, hold + 1) == 0);
  }
  SUBCASE("a held block is the first evicted, and a copy found expired on a second server does not make it recent") {
    block_index idx{2};
    idx.upsert({key(7), {}, {0}, 1, retention::chat, 1000, 0}, 0);
    recovered(idx, 1, 0, -5, 1);
    idx.upsert({key(1), {}, {1}, 1, retention::chat, -4, 0}, 1.5, hold);
    idx.upsert({key(8), {}, {0}, 1, retention::chat, 1000, 0}, 2);
    const auto evicted = idx.evict_to_capacity();
    REQUIRE(evicted.size() == 1);
    CHECK(evicted[0].key == key(1));
    CHECK(evicted[0].servers == std::vector<uint32_t>{0, 1});
  }
}

TEST_CASE("the index forgets a gone server's copies: blocks it held alone leave (room for blocks that can be "
          "read), replicas keep their other servers and writes") {
  block_index idx{2};
  const block_key alone{0, 1}, replicated{0, 2}, elsewhere{0, 3}, later{0, 4};
  idx.upsert({elsewhere, {}, {1}, 1, retention::chat, 100, 0, {7}}, 0);
  idx.upsert({alone, {}, {0}, 1, retention::chat, 100, 1, {3}}, 1);
  const auto gone = idx.forget_server(0);
  REQUIRE(gone.size() == 1);
  CHECK(gone[0].key == alone);
  CHECK(idx.find(alone) == nullptr);
  // Server 0's block took no room: a new block evicts nothing readable (before, `elsewhere`,
  // the least recent, went in its place).
  idx.upsert({later, {}, {1}, 1, retention::chat, 100, 2, {8}}, 2);
  CHECK(idx.evict_to_capacity().empty());
  CHECK(idx.find(elsewhere) != nullptr);
  block_index replicas;
  replicas.upsert({replicated, {}, {0, 1}, 1, retention::chat, 100, 0, {5, 6}}, 0);
  CHECK(replicas.forget_server(0).empty());
  REQUIRE(replicas.find(replicated) != nullptr);
  CHECK(replicas.find(replicated)->servers == std::vector<uint32_t>{1});
  CHECK(replicas.find(replicated)->write_seqs == std::vector<uint64_t>{6});
}

TEST_CASE("the index keeps each copy's write (write_seq) so an eviction's delete names the latest one it heard of") {
  block_index idx{1};
  const block_key k{0, 1};
  idx.upsert({k, {}, {0}, 1, retention::chat, 100, 0, {3}}, 0);
  idx.upsert({k, {}, {0}, 1, retention::chat, 100, 0, {5}}, 0);  // server 0 wrote it again
  idx.upsert({k, {}, {1}, 1, retention::chat, 100, 0, {2}}, 0);  // a replica on server 1
  idx.upsert({k, {}, {0}, 1, retention::chat, 100, 0, {4}}, 0);  // a late commit of an older write
  idx.upsert({block_key{0, 2}, {}, {0}, 1, retention::chat, 100, 1, {1}}, 1);  // over capacity: k goes
  const auto gone = idx.evict_to_capacity();
  REQUIRE(gone.size() == 1);
  CHECK(gone[0].key == k);
  CHECK(gone[0].servers == std::vector<uint32_t>{0, 1});
  CHECK(gone[0].write_seqs == std::vector<uint64_t>{5, 2});
}

TEST_CASE("the server ring: distinct replicas, and a new server takes about 1/n of the keys") {
  server_ring four{4}, five{5};
  size_t moved = 0, n = 20000;
  for (uint64_t i = 0; i < n; ++i) {
    const block_key k = chain_step({1, 2}, reinterpret_cast<const int32_t*>(&i), 2);
    const auto r = four.servers_for(k, 2);
    REQUIRE(r.size() == 2);
    CHECK(r[0] != r[1]);
    if (five.servers_for(k, 1)[0] != r[0]) ++moved;
  }
  CHECK(moved > n / 10);  // about 1/5 move to the new server ...
  CHECK(moved < n / 3);   // ... not a reshuffle
}

TEST_CASE("the server ring skips servers marked down: only their keys move, to the next live server") {
  server_ring ring{4};
  std::vector<bool> down{false, true, false, false};
  size_t moved = 0, n = 20000;
  for (uint64_t i = 0; i < n; ++i) {
    const block_key k = chain_step({3, 4}, reinterpret_cast<const int32_t*>(&i), 2);
    const auto all = ring.servers_for(k, 2);
    const auto live = ring.servers_for(k, 2, &down);
    REQUIRE(live.size() == 2);
    CHECK(std::count(live.begin(), live.end(), 1u) == 0);
    if (all[0] != 1) CHECK(live[0] == all[0]);  // a live server keeps its keys
    moved += all[0] == 1;
  }
  CHECK(moved > n / 8);  // server 1's quarter, roughly
  CHECK(moved < n / 3);
  down = {true, true, true, true};
  CHECK(ring.servers_for(chain_step({3, 4}, nullptr, 0), 1, &down).empty());
}

TEST_CASE("Mooncake conversation trace through the index: the README's LRU hit ratios, and 0.3664 unbounded") {
  std::ifstream f{BATON_SOURCE_DIR "/traces/mooncake_conversation_trace.jsonl"};
  REQUIRE(f);
  std::vector<std::vector<block_key>> requests;
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    std::vector<block_key> keys;
    for (auto id : j["hash_ids"]) keys.push_back({1, id.get<uint64_t>()});
    requests.push_back(std::move(keys));
  }
  REQUIRE(requests.size() == 12031);
  const std::vector<std::pair<uint64_t, double>> expected = {
      {512, 0.0422}, {2048, 0.0550}, {6144, 0.1413}, {20480, 0.2904}, {65536, 0.3594}, {204800, 0.3664}, {0, 0.3664}};
  for (const auto& [capacity, ratio] : expected) {
    CAPTURE(capacity);
    block_index idx{capacity};
    uint64_t hits = 0, total = 0;
    for (const auto& keys : requests) {
      hits += idx.longest_prefix(keys, 0);
      total += keys.size();
      for (auto k = keys.rbegin(); k != keys.rend(); ++k) idx.upsert({*k, {}, {0}, 1, retention::chat, 1e18, 0}, 0);
      idx.evict_to_capacity();
    }
    const double got = static_cast<double>(hits) / static_cast<double>(total);
    CHECK_MESSAGE(std::abs(got - ratio) <= 0.001, "hit ratio " << got << ", reference " << ratio);
  }
}

TEST_CASE("the rank-local prefix cache: shared pinned pages, duplicates handed back, leaf-first eviction") {
  prefix_cache c{2, 3};
  const std::vector<block_key> chain = {{0, 1}, {0, 2}, {0, 3}};
  CHECK(c.match(chain) == 0);
  // Insert a chain last block first; the cache owns the pages now.
  CHECK(c.insert(chain[1], {12, 13}).empty());
  CHECK(c.insert(chain[0], {10, 11}).empty());
  CHECK(c.match(chain) == 2);
  CHECK(c.insert(chain[0], {20, 21}) == std::vector<uint32_t>{20, 21});  // already cached: caller frees
  auto pages = c.acquire(chain, 2);
  CHECK(pages == std::vector<uint32_t>{10, 11, 12, 13});
  CHECK(c.evict(4).empty());  // both pinned
  c.release(chain, 2);
  CHECK(c.insert({0, 9}, {30, 31}).empty());  // another chain, most recent
  // Pages are wanted: the least recently used goes first, the chain's leaf before its root.
  CHECK(c.evict(2) == std::vector<uint32_t>{12, 13});
  CHECK(c.match(chain) == 1);
  CHECK(c.blocks() == 2);
}

TEST_CASE("the staging pool hands out disjoint ranges and merges them back") {
  staging_pool p{100};
  auto a = p.acquire(40), b = p.acquire(40);
  REQUIRE(a);
  REQUIRE(b);
  CHECK(*b == 40);
  CHECK_FALSE(p.acquire(30));  // 20 left
  p.release(*a);
  CHECK(p.acquire(30) == 0u);  // first fit reuses the front
  p.release(0);
  p.release(*b);
  CHECK(p.used_bytes() == 0);
  CHECK(p.acquire(100) == 0u);  // everything merged into one range again
  CHECK_FALSE(p.acquire(0));     // nothing to hand out: it would share an offset with the next range
}

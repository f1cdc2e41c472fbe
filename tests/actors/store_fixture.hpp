#pragma once

// What the block store's cluster tests share (store.test.cpp, store_faults.test.cpp): a cluster
// with a block store on a temporary directory, prompts, the colocated reference their answers
// must equal, the index's view of blocks, and a damaged block file.

#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <thread>

#include <unistd.h>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/kv_cache.hpp"
#include "gpu/local_generate.hpp"
#include "store/block_file.hpp"
#include "store/block_key.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "tests/test_util.hpp"

namespace baton::test_store {


struct temp_dir {
  std::string path;
  explicit temp_dir(const std::string& name)
    : path((std::filesystem::temp_directory_path() / ("baton-store-" + name + "-" + std::to_string(::getpid()))).string()) {
    std::filesystem::remove_all(path);
  }
  ~temp_dir() { std::filesystem::remove_all(path); }
};

inline local_cluster_config store_cluster(const std::string& dir, uint32_t servers = 1, uint32_t replicas = 1) {
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.executor.num_kv_pages = 128;
  cfg.prefill.chunk_tokens = 16;
  cfg.store.enabled = true;
  cfg.store.dir = dir;
  cfg.store.block_tokens = 32;
  cfg.store.num_servers = servers;
  cfg.store.replicas = replicas;
  cfg.store.read_timeout_ms = 2000;
  cfg.prefill.prefix_cache_blocks = 0;  // these tests exercise the store itself; the local tier has its own
  return cfg;
}

/// <bos> then n bytes of text: exactly n + 1 tokens.
inline std::vector<int32_t> prompt_tokens(const local_cluster_config& cfg, size_t n, char seed) {
  std::string text;
  for (size_t i = 0; i < n; ++i) text.push_back(static_cast<char>('a' + (i * 7 + seed) % 26));
  return gpu::byte_tokenizer{cfg.model.bos_token_id, cfg.model.eos_token_id}.encode(text);
}

/// `p` followed by n more bytes of text (prompt_tokens' with `seed`, its <bos> left out): a
/// longer prompt that shares p's blocks.
inline std::vector<int32_t> extended(const local_cluster_config& cfg, std::vector<int32_t> p, size_t n, char seed) {
  const auto tail = prompt_tokens(cfg, n, seed);
  p.insert(p.end(), tail.begin() + 1, tail.end());
  return p;
}

inline generate_request request_for(const std::vector<int32_t>& tokens) {
  generate_request req;
  req.prompt_tokens = tokens;
  req.max_tokens = 8;
  req.return_logits = true;
  req.ignore_eos = true;
  return req;
}

inline gpu::colocated_generation reference(const local_cluster_config& cfg, const std::vector<int32_t>& tokens) {
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  return gpu::generate_colocated(*exec, tokens, 8, 16, {}, true);
}

inline void check_equal(const completion& got, const gpu::colocated_generation& ref) {
  CHECK(got.tokens == ref.tokens);
  REQUIRE(got.step_logits.size() == ref.step_logits.size());
  for (size_t i = 0; i < ref.step_logits.size(); ++i) CHECK_MESSAGE(test::same_bits(got.step_logits[i], ref.step_logits[i]), "step " << i);
}

/// The index's counters, summed over its shards.
inline store_stats index_stats(test::cluster_system& t, const local_cluster& c) {
  caf::scoped_actor self{t.sys};
  store_stats out;
  for (const auto& shard : c.store_index)
    self->request(shard, std::chrono::seconds{5}, stats_atom::value)
        .receive(
            [&](store_stats& s) {
              out.blocks += s.blocks;
              out.checks += s.checks;
              out.hit_blocks += s.hit_blocks;
              out.expired += s.expired;
            },
            [](caf::error&) {});
  return out;
}

/// Waits (bounded) until the index knows at least `n` blocks: write-back is asynchronous.
inline void wait_for_blocks(test::cluster_system& t, const local_cluster& c, uint64_t n) {
  for (int i = 0; i < 2500 && index_stats(t, c).blocks < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{4});
  REQUIRE(index_stats(t, c).blocks >= n);
}

/// The decode rank's count of blocks written back, once it reaches `n` (a server indexes a
/// block before the rank hears that its file is written).
inline uint64_t written_back(test::cluster_system& t, const decode_rank_actor& rank, uint64_t n) {
  uint64_t got = 0;
  for (int i = 0; i < 2500 && (got = t.stats(rank).blocks_written_back) < n; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{4});
  return got;
}

/// The servers the (single) index shard names for `key`: none when absent, expired, or on servers
/// the index saw go.
inline std::vector<uint32_t> servers_of(test::cluster_system& t, const local_cluster& c, const store::block_key& key) {
  caf::scoped_actor self{t.sys};
  std::vector<block_ref> refs{{key.hi, key.lo, {}}};
  self->request(c.store_index[0], std::chrono::seconds{5}, check_atom::value, uint64_t{1}, refs)
      .receive([&](std::vector<block_ref>& r) { refs = std::move(r); }, [](caf::error&) {});
  return refs[0].servers;
}

/// The key of block `b` of `tokens` in this cluster's store.
inline store::block_key key_of(const local_cluster_config& cfg, const std::vector<int32_t>& tokens, size_t b) {
  const auto& m = cfg.model;
  const store::kv_identity id{m.name + " seed " + std::to_string(cfg.weights_seed), m.num_hidden_layers, m.kv_dim(),
                              cfg.store.block_tokens, cfg.executor.page_size_tokens, "f32"};
  return store::chain_keys(store::salt_of(id), tokens, cfg.store.block_tokens).at(b);
}

/// Flips one byte of layer 2's KV in the block file at `path`, leaving its header intact.
inline void damage_layer_2(const std::string& path, const local_cluster_config& cfg) {
  std::fstream f{path, std::ios::in | std::ios::out | std::ios::binary};
  REQUIRE(f);
  const std::streamoff at = 4096 + 2 * (cfg.store.block_tokens * 2 * cfg.model.kv_dim() * 4) + 123;
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(at);
  f.write(&c, 1);
}


}  // namespace baton::test_store

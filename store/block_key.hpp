#pragma once

// Keys of KV blocks (seed 000 §2.2): a 128-bit hash chain h_i = H(h_{i-1}, tokens of block i),
// started from a salt of the model identity and KV layout, so a block's key names its whole
// prefix and blocks of different models or layouts never mix. H is SHA-256 (its first 128 bits):
// a key must not be forgeable by a client choosing its prompt's tokens.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace baton::store {

struct block_key {
  uint64_t hi = 0;
  uint64_t lo = 0;
  friend bool operator==(const block_key&, const block_key&) = default;
  bool empty() const { return hi == 0 && lo == 0; }
  /// 32 hex digits: the block's file name.
  std::string hex() const;
};

struct block_key_hash {
  size_t operator()(const block_key& k) const { return static_cast<size_t>(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull)); }
};

/// What a block's bytes depend on besides its tokens. Two stores agree on a key only when all
/// of these agree.
struct kv_identity {
  std::string model_id;        ///< name and weights identity (e.g. "baton-tiny seed 20261130")
  uint32_t num_layers = 0;
  uint32_t kv_dim = 0;
  uint32_t block_tokens = 512;
  uint32_t page_tokens = 16;
  std::string dtype = "f32";
};

/// h_{-1}: the salt every chain starts from.
block_key salt_of(const kv_identity& id);

/// H(prev, tokens): one link of the chain.
block_key chain_step(const block_key& prev, const int32_t* tokens, size_t n);

/// A fast, uniform, non-cryptographic 64-bit mix of two words (where nobody gains by choosing
/// them: the server ring's points).
uint64_t spread_words(uint64_t a, uint64_t b);

/// Keys of every *full* block of `tokens` (a partial last block has no key: it is never stored).
std::vector<block_key> chain_keys(const block_key& salt, const std::vector<int32_t>& tokens, uint32_t block_tokens);

}  // namespace baton::store

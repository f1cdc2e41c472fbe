#include "store/block_key.hpp"

#include <cstdio>
#include <cstring>

namespace baton::store {

namespace {

constexpr uint64_t k1 = 0x87C37B91114253D5ull, k2 = 0x4CF5AD432745937Full;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

uint64_t fmix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xFF51AFD7ED558CCDull;
  k ^= k >> 33;
  k *= 0xC4CEB9FE1A85EC53ull;
  return k ^ (k >> 33);
}

/// A 128-bit multiply-rotate hash over 64-bit words (two tokens each) in two lanes that feed
/// each other, finalised with avalanche mixing: not cryptographic, but every input bit reaches
/// every output bit, and it runs at well under a nanosecond per token (CHECK hashes whole prompts).
block_key hash_words(block_key seed, const unsigned char* p, size_t n_bytes) {
  uint64_t a = seed.hi, b = seed.lo;
  size_t i = 0;
  for (; i + 16 <= n_bytes; i += 16) {
    uint64_t x, y;
    std::memcpy(&x, p + i, 8);
    std::memcpy(&y, p + i + 8, 8);
    a ^= rotl(x * k1, 31) * k2;
    a = (rotl(a, 27) + b) * 5 + 0x52DCE729;
    b ^= rotl(y * k2, 33) * k1;
    b = (rotl(b, 31) + a) * 5 + 0x38495AB5;
  }
  uint64_t x = 0, y = 0;
  const size_t rest = n_bytes - i;
  std::memcpy(&x, p + i, rest < 8 ? rest : 8);
  if (rest > 8) std::memcpy(&y, p + i + 8, rest - 8);
  a ^= rotl(x * k1, 31) * k2;
  b ^= rotl(y * k2, 33) * k1;
  a ^= n_bytes;
  b ^= n_bytes;
  a += b;
  b += a;
  a = fmix(a);
  b = fmix(b);
  a += b;
  b += a;
  return {a, b};
}

}  // namespace

std::string block_key::hex() const {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

block_key salt_of(const kv_identity& id) {
  std::string s = "baton-kv-v1|" + id.model_id + "|" + std::to_string(id.num_layers) + "|" +
                  std::to_string(id.kv_dim) + "|" + std::to_string(id.block_tokens) + "|" +
                  std::to_string(id.page_tokens) + "|" + id.dtype;
  return hash_words({0x243F6A8885A308D3ull, 0x13198A2E03707344ull}, reinterpret_cast<const unsigned char*>(s.data()),
                    s.size());
}

block_key chain_step(const block_key& prev, const int32_t* tokens, size_t n) {
  return hash_words(prev, reinterpret_cast<const unsigned char*>(tokens), n * sizeof(int32_t));
}

std::vector<block_key> chain_keys(const block_key& salt, const std::vector<int32_t>& tokens, uint32_t block_tokens) {
  std::vector<block_key> out;
  if (block_tokens == 0) return out;
  block_key h = salt;
  for (size_t start = 0; start + block_tokens <= tokens.size(); start += block_tokens) {
    h = chain_step(h, tokens.data() + start, block_tokens);
    out.push_back(h);
  }
  return out;
}

}  // namespace baton::store

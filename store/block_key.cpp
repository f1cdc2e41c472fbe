#include "store/block_key.hpp"

#include <openssl/evp.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

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
/// every output bit. For spreading (spread_words); block keys are SHA-256 (digest).
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

/// SHA-256 of `prev` (16 bytes, hi then lo, little-endian) and the bytes, its first 128 bits.
/// A key names the KV a block holds to every rank and store that shares a prefix cache, so it
/// must not be forgeable: with the fast hash above, one client could pick tokens whose block key
/// equals another's (each of its 16-byte steps can be inverted) and have its KV served for the
/// other's prompt (vLLM's prefix cache had that flaw, CVE-2025-25183). SHA-256 with the CPU's
/// SHA instructions: ~2 ns a token.
block_key digest(const block_key& prev, const unsigned char* p, size_t n_bytes) {
  struct ctx_free {
    void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
  };
  static EVP_MD* const sha256 = EVP_MD_fetch(nullptr, "SHA256", nullptr);  // fetched once: not per block
  thread_local std::unique_ptr<EVP_MD_CTX, ctx_free> ctx{EVP_MD_CTX_new()};
  unsigned char head[16], out[EVP_MAX_MD_SIZE];
  for (int i = 0; i < 8; ++i) {
    head[i] = static_cast<unsigned char>(prev.hi >> (8 * i));
    head[8 + i] = static_cast<unsigned char>(prev.lo >> (8 * i));
  }
  unsigned int len = 0;
  if (sha256 == nullptr || !ctx || EVP_DigestInit_ex(ctx.get(), sha256, nullptr) != 1 ||
      EVP_DigestUpdate(ctx.get(), head, sizeof head) != 1 || (n_bytes > 0 && EVP_DigestUpdate(ctx.get(), p, n_bytes) != 1) ||
      EVP_DigestFinal_ex(ctx.get(), out, &len) != 1 || len < 16) {
    std::fprintf(stderr, "baton: OpenSSL could not compute SHA-256, which block keys need; stopping\n");
    std::abort();  // nothing here can run safely without it
  }
  block_key k;
  for (int i = 0; i < 8; ++i) {
    k.hi |= uint64_t{out[i]} << (8 * i);
    k.lo |= uint64_t{out[8 + i]} << (8 * i);
  }
  return k;
}

}  // namespace

std::string block_key::hex() const {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

block_key salt_of(const kv_identity& id) {
  std::string s = "baton-kv-v2|" + id.model_id + "|" + std::to_string(id.num_layers) + "|" +
                  std::to_string(id.kv_dim) + "|" + std::to_string(id.block_tokens) + "|" +
                  std::to_string(id.page_tokens) + "|" + id.dtype;
  return digest({}, reinterpret_cast<const unsigned char*>(s.data()), s.size());
}

block_key chain_step(const block_key& prev, const int32_t* tokens, size_t n) {
  return digest(prev, reinterpret_cast<const unsigned char*>(tokens), n * sizeof(int32_t));
}

uint64_t spread_words(uint64_t a, uint64_t b) {
  const uint64_t words[2] = {a, b};
  return hash_words({0x243F6A8885A308D3ull, 0x13198A2E03707344ull}, reinterpret_cast<const unsigned char*>(words),
                    sizeof words)
      .lo;
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

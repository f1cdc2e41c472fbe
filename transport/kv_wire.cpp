#include "transport/kv_wire.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace baton::transport {

namespace {

size_t blocks_of(size_t values) { return (values + wire_block - 1) / wire_block; }

/// The largest code magnitude of a format: values map to [-q, q].
float levels(wire_format f) { return f == wire_format::int8 ? 127.0f : 7.0f; }

/// v rounded to the nearest integer, ties to even, for |v| < 2^22: adding and taking away 1.5 ·
/// 2^23 leaves no fraction bits. Unlike nearbyint this vectorises without SSE4.1.
inline float round_even(float v) {
  constexpr float magic = 12582912.0f;  // IEEE arithmetic (no -ffast-math here) keeps the two steps
  return (v + magic) - magic;
}

/// The codes of one block, as small integers in floats. Full blocks take a loop of known length,
/// which the compiler unrolls and vectorises without a remainder.
inline void codes_of(const float* src, size_t n, float inv, float q, float* out) {
  if (n == wire_block) {
    for (size_t i = 0; i < wire_block; ++i) out[i] = std::min(q, std::max(-q, round_even(src[i] * inv)));
    return;
  }
  for (size_t i = 0; i < n; ++i) out[i] = std::min(q, std::max(-q, round_even(src[i] * inv)));
}

}  // namespace

const char* to_string(wire_format f) {
  switch (f) {
    case wire_format::f32: return "f32";
    case wire_format::int8: return "int8";
    case wire_format::int4: return "int4";
  }
  return "?";
}

std::optional<wire_format> wire_format_from(const std::string& word) {
  if (word == "f32") return wire_format::f32;
  if (word == "int8") return wire_format::int8;
  if (word == "int4") return wire_format::int4;
  return std::nullopt;
}

std::optional<wire_format> wire_format_of(uint8_t byte) {
  for (const auto f : {wire_format::f32, wire_format::int8, wire_format::int4})
    if (static_cast<uint8_t>(f) == byte) return f;
  return std::nullopt;
}

size_t wire_bytes(wire_format f, size_t values) {
  switch (f) {
    case wire_format::f32: return values * sizeof(float);
    case wire_format::int8: return blocks_of(values) * sizeof(float) + values;
    case wire_format::int4: return blocks_of(values) * sizeof(float) + (values + 1) / 2;
  }
  return 0;
}

std::string wire_encode(wire_format f, const float* src, size_t values, uint8_t* out) {
  if (f == wire_format::f32) {
    std::memcpy(out, src, values * sizeof(float));
    return {};
  }
  const size_t nb = blocks_of(values);
  uint8_t* codes = out + nb * sizeof(float);
  const float q = levels(f);
  float c[wire_block];
  for (size_t b = 0; b < nb; ++b) {
    const size_t first = b * wire_block, n = std::min(values, first + wire_block) - first;
    const float* x = src + first;
    // The largest magnitude, on the values' bits: with the sign cleared, a float's bits order as
    // its magnitude does, NaN and infinity above every finite value; an integer max vectorises.
    uint32_t top_bits = 0;
    for (size_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, sizeof u);
      top_bits = std::max(top_bits, u & 0x7fffffffu);
    }
    float top;
    std::memcpy(&top, &top_bits, sizeof top);
    if (top_bits >= 0x7f800000u)
      for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i]))
          return "value " + std::to_string(first + i) + " of " + std::to_string(values) + " is not finite (" +
                 std::to_string(x[i]) + "): it has no " + to_string(f) + " form";
    const float scale = top / q;  // 0 for an all-zero block: its codes are 0 and decode to 0
    std::memcpy(out + b * sizeof(float), &scale, sizeof scale);
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    if (std::isfinite(inv)) {
      codes_of(x, n, inv, q, c);
    } else {  // values under ~1e-36: 1/scale overflows, and 0 * inf would code a zero as -q
      for (size_t i = 0; i < n; ++i) c[i] = std::min(q, std::max(-q, round_even(x[i] / scale)));
    }
    if (f == wire_format::int8 && n == wire_block) {
      for (size_t i = 0; i < wire_block; ++i) codes[first + i] = static_cast<uint8_t>(static_cast<int8_t>(c[i]));
    } else if (f == wire_format::int8) {
      for (size_t i = 0; i < n; ++i) codes[first + i] = static_cast<uint8_t>(static_cast<int8_t>(c[i]));
    } else {  // blocks start at even values, so a block's pairs are bytes of its own
      uint8_t* pair = codes + first / 2;
      for (size_t i = 0; i + 1 < n; i += 2)
        pair[i / 2] = static_cast<uint8_t>((static_cast<int>(c[i]) & 0x0f) | ((static_cast<int>(c[i + 1]) & 0x0f) << 4));
      if (n % 2) pair[n / 2] = static_cast<uint8_t>(static_cast<int>(c[n - 1]) & 0x0f);
    }
  }
  return {};
}

void wire_decode(wire_format f, const uint8_t* in, size_t values, float* dst) {
  if (f == wire_format::f32) {
    std::memcpy(dst, in, values * sizeof(float));
    return;
  }
  const size_t nb = blocks_of(values);
  const uint8_t* codes = in + nb * sizeof(float);
  for (size_t b = 0; b < nb; ++b) {
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof scale);
    const size_t first = b * wire_block, n = std::min(values, first + wire_block) - first;
    float* y = dst + first;
    if (f == wire_format::int8) {
      const int8_t* c = reinterpret_cast<const int8_t*>(codes + first);
      for (size_t i = 0; i < n; ++i) y[i] = static_cast<float>(c[i]) * scale;
    } else {
      const uint8_t* pair = codes + first / 2;
      for (size_t i = 0; i + 1 < n; i += 2) {
        // Each nibble sign-extended: shifted to a byte's top, then arithmetically back.
        y[i] = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(pair[i / 2] << 4)) >> 4) * scale;
        y[i + 1] = static_cast<float>(static_cast<int8_t>(pair[i / 2]) >> 4) * scale;
      }
      if (n % 2) y[n - 1] = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(pair[n / 2] << 4)) >> 4) * scale;
    }
  }
}

}  // namespace baton::transport

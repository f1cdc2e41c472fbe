#pragma once

// KV in a smaller form for the wire (issue 6, "wire quantisation per traffic class"): INT8 or
// INT4 values with one fp32 scale per block of 64, applied only for a transfer and expanded back
// to fp32 on the receiving side. Symmetric, round to nearest: a value v of a block whose largest
// magnitude is a comes back as round(v / s) · s with s = a / 127 (INT8) or a / 7 (INT4), so its
// error is at most s / 2. A layer's wire form is its scales, then its packed values.
//
// Plain functions over host memory, no transport in them: the handoff applies them to a layer's
// pages before the put and after the layer lands (actors/kv_wire_staging.hpp). Bytes per fp32
// value: 0.27 for INT8, 0.14 for INT4 (3.8x and 7.1x fewer than fp32).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace baton::transport {

enum class wire_format : uint8_t {
  f32 = 0,   ///< as stored: no quantisation
  int8 = 8,  ///< one signed byte per value
  int4 = 4,  ///< two values per byte, the first in the low nibble
};

/// Values sharing one scale.
constexpr size_t wire_block = 64;

/// "f32", "int8", "int4", and back (nothing for another word).
const char* to_string(wire_format f);
std::optional<wire_format> wire_format_from(const std::string& word);
/// The form a message's byte names (its enum value), or nothing for a byte that names none.
std::optional<wire_format> wire_format_of(uint8_t byte);

/// Bytes the wire form of `values` fp32 values takes.
size_t wire_bytes(wire_format f, size_t values);

/// Writes the wire form of src[0, values) to out (wire_bytes(f, values) bytes). Empty on
/// success; else why not, naming the first value that has no wire form (not finite), and out
/// is left unspecified (the handoff then fails the request: non-finite KV is a broken model).
std::string wire_encode(wire_format f, const float* src, size_t values, uint8_t* out);

/// Expands what wire_encode wrote back to `values` fp32 values in dst. `in` and `dst` must not
/// overlap.
void wire_decode(wire_format f, const uint8_t* in, size_t values, float* dst);

}  // namespace baton::transport

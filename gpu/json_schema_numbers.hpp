#pragma once

// Numbers in a range as grammar rules, spelled out digit by digit as a range of numbers is in a
// regular expression: JSON schema's minimum / maximum (exclusive ones too) on integers and on
// numbers (json_schema_grammar.cpp). Every text the rules allow is in the range.

#include <cstdint>
#include <optional>

#include "gpu/grammar.hpp"

namespace baton::gpu {

/// One end of a range: a whole number, in the range or not.
struct number_bound {
  int64_t value = 0;
  bool inclusive = true;
};

/// The integers in [lo, hi] (hi none: no end), lo >= 0, written without leading zeros.
/// `digits`: a rule of [0-9]*.
uint32_t natural_range(grammar& g, uint32_t digits, int64_t lo, std::optional<int64_t> hi);

/// JSON numbers x between `lo` and `hi` (either may be absent), written without an exponent (a
/// subset: 1e3 is not written, 1000 is) and without -0: an integer part, then maybe a fraction.
/// Each integer part is written with exactly the fractions that keep x in range (at a bound
/// that excludes it, only non-zero ones; at one that includes it from below, only zeros).
/// None when no number lies between them.
std::optional<uint32_t> bounded_number(grammar& g, uint32_t digits, std::optional<number_bound> lo,
                                       std::optional<number_bound> hi);

}  // namespace baton::gpu

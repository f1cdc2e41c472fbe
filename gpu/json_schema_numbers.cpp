#include "gpu/json_schema_numbers.hpp"

#include <string>
#include <string_view>
#include <vector>

namespace baton::gpu {

namespace {

using sym = grammar::symbol;
using seq = std::vector<sym>;


/// Alternatives of `rule` for the digit strings of one length in [from, to], after `prefix`.
void same_length(grammar& g, const std::string& from, const std::string& to, seq prefix, uint32_t rule) {
  if (from.empty()) {
    g.add_alternative(rule, prefix);
    return;
  }
  const std::string rest_from = from.substr(1), rest_to = to.substr(1);
  if (from[0] == to[0]) {
    prefix.push_back(grammar::byte(static_cast<uint8_t>(from[0])));
    same_length(g, rest_from, rest_to, std::move(prefix), rule);
    return;
  }
  const size_t n = rest_from.size();
  seq low = prefix, high = prefix;
  low.push_back(grammar::byte(static_cast<uint8_t>(from[0])));
  same_length(g, rest_from, std::string(n, '9'), std::move(low), rule);
  if (to[0] - from[0] > 1) {
    seq middle = prefix;
    middle.push_back(grammar::range(static_cast<uint8_t>(from[0] + 1), static_cast<uint8_t>(to[0] - 1)));
    for (size_t k = 0; k < n; ++k) middle.push_back(grammar::range('0', '9'));
    g.add_alternative(rule, middle);
  }
  high.push_back(grammar::byte(static_cast<uint8_t>(to[0])));
  same_length(g, std::string(n, '0'), rest_to, std::move(high), rule);
}

/// What may follow a whole part: nothing or a fraction -- any, only zeros (the number stays that
/// whole number), or one with a digit that is not 0 (the number passes it).
enum class fraction { any, zero, nonzero };

uint32_t fraction_rule(grammar& g, uint32_t digits, fraction f) {
  const uint32_t out = g.add_rule();
  if (f == fraction::any) {
    g.add_alternative(out, {});
    g.add_alternative(out, grammar::literal(".") + seq{grammar::range('0', '9'), grammar::ref(digits)});
    return out;
  }
  const uint32_t zeros = g.add_rule();  // 0*
  g.add_alternative(zeros, {});
  g.add_alternative(zeros, grammar::literal("0") + seq{grammar::ref(zeros)});
  if (f == fraction::zero) {
    g.add_alternative(out, {});
    g.add_alternative(out, grammar::literal(".0") + seq{grammar::ref(zeros)});
  } else {
    g.add_alternative(out, grammar::literal(".") + seq{grammar::ref(zeros), grammar::range('1', '9'), grammar::ref(digits)});
  }
  return out;
}

/// Alternatives of `out`: `sign`, then magnitudes m from a to b (b none: no end), a >= 0 and
/// b >= a; false when there are none (a == b, not both in).
bool add_magnitudes(grammar& g, uint32_t digits, uint32_t out, const seq& sign, number_bound a,
                    std::optional<number_bound> b) {
  const auto whole = [&](int64_t lo, std::optional<int64_t> hi, fraction f) {
    g.add_alternative(out, sign + seq{grammar::ref(natural_range(g, digits, lo, hi)), grammar::ref(fraction_rule(g, digits, f))});
  };
  if (b && b->value == a.value) {
    if (!(a.inclusive && b->inclusive)) return false;
    whole(a.value, a.value, fraction::zero);
    return true;
  }
  // a's whole part: m in [a, a + 1) (or (a, a + 1)), below b since b >= a + 1.
  whole(a.value, a.value, a.inclusive ? fraction::any : fraction::nonzero);
  if (!b) {
    whole(a.value + 1, std::nullopt, fraction::any);
    return true;
  }
  if (b->value - 1 >= a.value + 1) whole(a.value + 1, b->value - 1, fraction::any);
  if (b->inclusive) whole(b->value, b->value, fraction::zero);
  return true;
}

}  // namespace

uint32_t natural_range(grammar& g, uint32_t digits, int64_t lo, std::optional<int64_t> hi) {
  const uint32_t out = g.add_rule();
  const std::string a = std::to_string(lo);
  const std::string b = hi ? std::to_string(*hi) : std::string{};
  const size_t last = hi ? b.size() : a.size();
  for (size_t n = a.size(); n <= last; ++n) {
    std::string from = a;  // the smallest n-digit number past a's length: 10...0
    if (n > a.size()) {
      from.assign(n, '0');
      from[0] = '1';
    }
    const std::string to = hi && n == b.size() ? b : std::string(n, '9');
    same_length(g, from, to, {}, out);
  }
  if (!hi) {  // every longer number
    seq longer = {grammar::range('1', '9')};
    for (size_t k = 0; k < a.size(); ++k) longer.push_back(grammar::range('0', '9'));
    longer.push_back(grammar::ref(digits));
    g.add_alternative(out, longer);
  }
  return out;
}

std::optional<uint32_t> bounded_number(grammar& g, uint32_t digits, std::optional<number_bound> lo,
                                       std::optional<number_bound> hi) {
  if (lo && hi && lo->value > hi->value) return std::nullopt;
  const uint32_t out = g.add_rule();
  bool any = false;
  // x >= 0: its magnitude from lo (or 0) up to hi.
  if (!hi || hi->value > 0 || (hi->value == 0 && hi->inclusive))
    any |= add_magnitudes(g, digits, out, {}, !lo || lo->value < 0 ? number_bound{0, true} : *lo, hi);
  // x < 0, written -m with m > 0 (no -0): m from -hi (or just past 0) up to -lo.
  if (!lo || lo->value < 0) {
    const number_bound a = !hi || hi->value >= 0 ? number_bound{0, false} : number_bound{-hi->value, hi->inclusive};
    std::optional<number_bound> b;
    if (lo) b = number_bound{-lo->value, lo->inclusive};
    any |= add_magnitudes(g, digits, out, grammar::literal("-"), a, b);
  }
  if (!any) return std::nullopt;
  return out;
}

}  // namespace baton::gpu

#include "policies/cost_model.hpp"

#include <algorithm>
#include <cmath>

namespace baton::policies {

uint64_t largest_chunk(const cost_model& m, uint64_t cached, uint64_t remaining, double budget_us) {
  if (remaining == 0) return 0;
  if (!m.usable()) return remaining;
  // alpha·q² + b·q - room <= 0 with b = beta·c + gamma > 0 and room = budget - delta.
  const double b = m.beta_us * static_cast<double>(cached) + m.gamma_us;
  const double room = std::max(0.0, budget_us - m.delta_us);
  double q = 0.0;
  if (m.alpha_us > 0.0)
    q = (-b + std::sqrt(b * b + 4.0 * m.alpha_us * room)) / (2.0 * m.alpha_us);
  else
    q = room / b;
  // A root at or past `remaining` (an infinite budget, a tiny gamma) must not reach the cast:
  // converting a double beyond uint64_t's range is undefined.
  auto n = q >= static_cast<double>(remaining) ? remaining : static_cast<uint64_t>(std::max(0.0, std::floor(q)));
  // Floating point may put the root a hair above the exact boundary: step back until it fits.
  while (n > 1 && m.prefill_us(n, cached) > budget_us) --n;
  return std::clamp<uint64_t>(n, 1, remaining);
}

std::vector<uint32_t> plan_chunks(const cost_model& m, uint64_t cached, uint64_t num_tokens, double budget_us,
                                  uint32_t max_chunk_tokens) {
  std::vector<uint32_t> out;
  uint64_t done = 0;
  while (done < num_tokens) {
    uint64_t n = largest_chunk(m, cached + done, num_tokens - done, budget_us);
    if (max_chunk_tokens) n = std::min<uint64_t>(n, max_chunk_tokens);
    out.push_back(static_cast<uint32_t>(n));
    done += n;
  }
  return out;
}

std::vector<uint64_t> split_prefill(const cost_model& m, uint64_t cached, uint64_t q, uint32_t parts) {
  if (q == 0) return {};
  parts = static_cast<uint32_t>(std::clamp<uint64_t>(parts, 1, q));
  // Cumulative cost of computing tokens [0, x) in pieces whose boundaries we are choosing is
  // not additive in x, so cut greedily: each piece gets the largest size whose own cost does
  // not exceed an equal share of the total, with the share found by bisection so the last
  // piece ends exactly at q.
  auto pieces_for = [&](double share) {
    std::vector<uint64_t> out;
    uint64_t done = 0;
    for (uint32_t i = 0; i + 1 < parts && done < q; ++i) {
      uint64_t n = largest_chunk(m, cached + done, q - done, share);
      out.push_back(n);
      done += n;
    }
    if (done < q) out.push_back(q - done);
    return out;
  };
  auto last_cost = [&](const std::vector<uint64_t>& p) {
    uint64_t before = 0;
    for (size_t i = 0; i + 1 < p.size(); ++i) before += p[i];
    return m.prefill_us(p.back(), cached + before);
  };
  double lo = 0.0, hi = m.prefill_us(q, cached);
  for (int it = 0; it < 60; ++it) {
    const double mid = 0.5 * (lo + hi);
    auto p = pieces_for(mid);
    // The last piece costs more than the share: the share is too small.
    if (p.size() == parts && last_cost(p) > mid) lo = mid; else hi = mid;
  }
  return pieces_for(hi);
}

}  // namespace baton::policies

#pragma once

// The prefill cost model of seed 000 §3.1 and what is derived from it: the largest chunk that
// fits a step's time budget, a whole prompt's chunk plan, and the split of one prompt across
// several ranks into parts of equal predicted time. Pure functions of their arguments.

#include <cstdint>
#include <vector>

namespace baton::policies {

/// Predicted prefill time of q new tokens on top of c cached ones (seed 000 §3.1):
///   cost(q, c) = alpha·q² + beta·q·c + gamma·q + delta   [microseconds]
/// The seed's model plus delta, the fixed cost of one forward pass (every weight is read once
/// per step): negligible for the seed's GPU-sized chunks, but on the CPU executor a 16-token
/// chunk costs twice what the three seed terms predict, and leaving delta out biases alpha low.
/// delta = 0 is exactly the seed's model. Coefficients are data: fitted from measured timings of
/// the executor in use (cost_fit.hpp).
struct cost_model {
  double alpha_us = 0.0;  ///< per new-token pair (attention among the new tokens)
  double beta_us = 0.0;   ///< per (new token × cached token) (attention to the prefix)
  double gamma_us = 0.0;  ///< per new token (matrix products)
  double delta_us = 0.0;  ///< per forward pass (chunk)

  double prefill_us(uint64_t q, uint64_t c) const {
    const double qd = static_cast<double>(q), cd = static_cast<double>(c);
    return alpha_us * qd * qd + beta_us * qd * cd + gamma_us * qd + (q ? delta_us : 0.0);
  }
  /// True when the model predicts a positive, non-decreasing time for every q >= 1 and c >= 0.
  bool usable() const { return alpha_us >= 0 && beta_us >= 0 && gamma_us > 0 && delta_us >= 0; }
};

/// Predicted time of one decode step over a batch: fixed cost (weights read once per step) plus
/// per-sequence and per-context-token terms (the attention scan of the KV).
struct decode_cost_model {
  double step_base_us = 0.0;
  double per_seq_us = 0.0;
  double per_context_token_us = 0.0;

  double step_us(uint64_t num_seqs, uint64_t total_context_tokens) const {
    return step_base_us + per_seq_us * static_cast<double>(num_seqs) +
           per_context_token_us * static_cast<double>(total_context_tokens);
  }
  /// No negative term (a fit with one goes negative for large batches: free steps) and some
  /// cost at all. (`!(x < 0)` is false for NaN: the comparisons are written to refuse it.)
  bool usable() const {
    return step_base_us >= 0 && per_seq_us >= 0 && per_context_token_us >= 0 &&
           step_base_us + per_seq_us + per_context_token_us > 0;
  }
};

/// Seed 000 §3.1 level 4: the largest q <= `remaining` with cost(q, c) <= budget_us, found by
/// solving the quadratic. At least 1 (a step always makes progress, even over budget) when
/// remaining > 0; 0 when remaining == 0. A model that is not usable() gives `remaining`.
uint64_t largest_chunk(const cost_model& m, uint64_t cached, uint64_t remaining, double budget_us);

/// Chunk sizes along a prompt of `num_tokens` new tokens after `cached` ones: each the largest
/// that fits the budget at its own offset (so chunks shrink as the context grows), capped at
/// `max_chunk_tokens` (0 = no cap). The sizes sum to num_tokens.
std::vector<uint32_t> plan_chunks(const cost_model& m, uint64_t cached, uint64_t num_tokens, double budget_us,
                                  uint32_t max_chunk_tokens = 0);

/// Seed 002 "dynamic prefill split": cuts q new tokens (after c cached) into `parts` contiguous
/// pieces of (nearly) equal predicted time, piece i computed with the tokens before it as its
/// context. Returns the piece sizes (sum q; later pieces are shorter because their context is
/// longer). parts is clamped to [1, q].
std::vector<uint64_t> split_prefill(const cost_model& m, uint64_t cached, uint64_t q, uint32_t parts);

}  // namespace baton::policies

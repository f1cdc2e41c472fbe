#pragma once

#include <cstdint>

namespace baton::policies {

/// Predicted prefill time of q new tokens on top of c cached ones (seed 000 §3.1):
///   cost(q, c) = alpha·q² + beta·q·c + gamma·q   [microseconds]
/// Coefficients are data: fitted from measured timings of the executor in use.
struct cost_model {
  double alpha_us = 0.0;  ///< per new-token pair (attention among the new tokens)
  double beta_us = 0.0;   ///< per (new token × cached token) (attention to the prefix)
  double gamma_us = 0.0;  ///< per new token (matrix products)

  double prefill_us(uint64_t q, uint64_t c) const {
    const double qd = static_cast<double>(q), cd = static_cast<double>(c);
    return alpha_us * qd * qd + beta_us * qd * cd + gamma_us * qd;
  }
};

/// Predicted time of one decode step over a batch (a simple linear model until profiling
/// fits one): fixed launch/weights cost plus per-sequence and per-context-token terms.
struct decode_cost_model {
  double step_base_us = 0.0;
  double per_seq_us = 0.0;
  double per_context_token_us = 0.0;

  double step_us(uint64_t num_seqs, uint64_t total_context_tokens) const {
    return step_base_us + per_seq_us * static_cast<double>(num_seqs) +
           per_context_token_us * static_cast<double>(total_context_tokens);
  }
};

}  // namespace baton::policies

#pragma once

// Least-squares fits of the cost models from measured timings (`baton profile` produces the
// samples; balancers and sims load the fitted coefficients). Pure: samples in, coefficients out.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "policies/cost_model.hpp"

namespace baton::policies {

/// One measured prefill: q new tokens after c cached ones took `us` microseconds.
struct prefill_sample {
  uint64_t q = 0;
  uint64_t c = 0;
  double us = 0.0;
};

/// One measured decode step over `num_seqs` sequences holding `context_tokens` tokens in all.
struct decode_sample {
  uint64_t num_seqs = 0;
  uint64_t context_tokens = 0;
  double us = 0.0;
};

/// How well a model predicts a set of samples, as relative errors |pred - meas| / meas.
struct fit_error {
  double mean_rel = 0.0;
  double max_rel = 0.0;
  size_t count = 0;
};

/// Solves min ||W (A x - y)|| for x (columns of A are the unknowns), by the normal equations
/// with partial pivoting. nullopt when the columns are linearly dependent on these rows (for
/// example, every sample has c = 0, so beta cannot be told apart).
std::optional<std::vector<double>> least_squares(const std::vector<std::vector<double>>& rows,
                                                 const std::vector<double>& y, const std::vector<double>& weights);

/// Fits alpha, beta, gamma and delta. Rows are weighted by 1/us, so the fit minimises
/// *relative* error: timings span orders of magnitude and a 16-token chunk matters as much as a
/// 2K one. If noise makes delta negative, it is pinned at 0 and the other three refitted. `why`
/// (when given) receives a sentence on failure.
std::optional<cost_model> fit_cost_model(const std::vector<prefill_sample>& samples, std::string* why = nullptr);
std::optional<decode_cost_model> fit_decode_cost_model(const std::vector<decode_sample>& samples,
                                                       std::string* why = nullptr);

fit_error evaluate(const cost_model& m, const std::vector<prefill_sample>& samples);
fit_error evaluate(const decode_cost_model& m, const std::vector<decode_sample>& samples);

}  // namespace baton::policies

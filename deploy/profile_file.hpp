#pragma once

// The profile file `baton profile` writes and balancers and sims load: the fitted cost models
// of one executor on one model, with the samples they were fitted from and the fit's error on
// held-out points. JSON, so it can be read and plotted by anything.

#include <string>
#include <vector>

#include "policies/cost_fit.hpp"

namespace baton::deploy {

struct executor_profile {
  std::string executor;  ///< the executor's describe(), e.g. "cpu x2 threads"
  std::string model;     ///< model name and shape
  std::string machine;   ///< host name and CPU or GPU
  std::string date;      ///< UTC, ISO 8601
  policies::cost_model prefill;
  policies::decode_cost_model decode;
  policies::fit_error prefill_held_out;
  policies::fit_error decode_held_out;
  std::vector<policies::prefill_sample> prefill_samples;  ///< all measured points (fit + held out)
  std::vector<policies::decode_sample> decode_samples;
};

/// Writes `p` to `path`; returns an error sentence or empty.
std::string write_profile(const std::string& path, const executor_profile& p);
/// Reads a profile; on failure returns false and a sentence naming the file and what is wrong.
bool read_profile(const std::string& path, executor_profile* out, std::string* why);

}  // namespace baton::deploy

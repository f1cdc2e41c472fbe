#pragma once

// An executor that computes nothing and takes modelled time: the sim's stand-in for a GPU.
// Its timeline is the owning actor's (deferred_runner), i.e. virtual time under CAF's test
// coordinator. It owns a real (small) KV pool so transports have real regions to move.

#include <functional>
#include <memory>
#include <optional>

#include "gpu/executor.hpp"
#include "policies/cost_model.hpp"

namespace baton::sims {

/// How long a modelled device has been occupied (a job started and not yet done counts from its
/// start), read by the sim's sampler. Times on the owner's clock (`now_ns`).
struct executor_usage {
  std::function<int64_t()> now_ns;
  int64_t busy_ns = 0;           ///< jobs finished so far
  int64_t running_since_ns = -1; ///< the job in progress, or -1
  int64_t occupied_ns() const { return busy_ns + (running_since_ns >= 0 ? now_ns() - running_since_ns : 0); }
};

struct modelled_executor_config {
  policies::cost_model prefill;            ///< time of a prefill chunk (split evenly over layers)
  policies::decode_cost_model decode;      ///< time of a decode step
  uint32_t num_kv_pages = 256;
  uint32_t page_size_tokens = 16;
  int32_t emitted_token = 'a';             ///< the token every step "predicts"
  /// A job's whole time in microseconds from another model (a roofline of a named GPU and model
  /// shape, sims/roofline.hpp); empty: the two cost models above.
  std::function<double(const gpu::forward_job&)> job_us;
  /// Decode steps end all their layers at once (nothing waits on a decode step's layers, unlike
  /// a prefill's, whose KV ships layer by layer): one timer per step instead of one per layer,
  /// which is what lets a long trace run fast. The step's time is unchanged.
  bool coarse_decode = false;
  /// Failure modelling: after this many jobs the device hangs (no further job ever finishes),
  /// as a GPU whose kernel never returns. Empty = never.
  std::optional<uint32_t> hang_after_jobs;
  /// When set (with its clock), the device's occupied time is kept here.
  std::shared_ptr<executor_usage> usage;
};

std::unique_ptr<gpu::executor> make_modelled_executor(gpu::model_config model, modelled_executor_config cfg);

/// The modelled duration of a job, in nanoseconds per layer (the job takes L times this).
/// Exposed so tests can sum the model independently of the actors.
int64_t modelled_layer_ns(const gpu::forward_job& job, const gpu::model_config& model,
                          const modelled_executor_config& cfg);

}  // namespace baton::sims

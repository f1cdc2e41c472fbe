#pragma once

#include <memory>

#include "gpu/executor.hpp"
#include "gpu/weights.hpp"

namespace baton::gpu {

/// The reference backend: real Llama math in fp32 on CPU threads, over paged KV.
/// Weights are shared (read-only) so several executors in one process need one copy.
std::unique_ptr<executor> make_cpu_executor(model_config cfg, std::shared_ptr<const model_weights> weights,
                                            cpu_executor_config exec_cfg);

}  // namespace baton::gpu

#pragma once

// Fault injection for tests, never a default: an executor that is slow, as a throttled or
// oversubscribed GPU would be. Multi-process tests use it to hold work on a rank long enough to
// kill the rank's process in the middle of it (tests/deploy/prefill_kill_e2e.sh).

#include <cstdint>
#include <memory>

#include "gpu/executor.hpp"

namespace baton::gpu {

/// Wraps `inner`: every job starts `delay_ms` late, on the inner executor's own thread (so the
/// jobs behind it wait too, as on a slow device); results are the inner executor's, unchanged.
std::shared_ptr<executor> make_fault_slow_executor(std::shared_ptr<executor> inner, uint32_t delay_ms);

/// Wraps `inner`: a prefill job (more than one row) fails once layer `layer`'s KV was announced,
/// as a job failing in that layer's MLP would: the layers after it are not announced, and the
/// job reports on_failed when the inner executor finishes it (so no job of the same pages runs
/// meanwhile). Decode jobs are untouched.
std::shared_ptr<executor> make_fault_failing_prefill_executor(std::shared_ptr<executor> inner, uint32_t layer);

/// Wraps `inner`: a prefill job (more than one row) finishes with no token and no logits, as a
/// faulty backend might; every layer's KV is announced as usual. Decode jobs are untouched.
std::shared_ptr<executor> make_fault_tokenless_prefill_executor(std::shared_ptr<executor> inner);

}  // namespace baton::gpu

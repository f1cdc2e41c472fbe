#pragma once

// Where a GPU step's time goes, kernel by kernel: CUPTI's activity records of every kernel the
// process runs between start and stop, summed per kernel name. For benchmarks only (the GPU
// bench's decode breakdown); CUPTI ships with the CUDA toolkit.

#include <cstdint>
#include <string>
#include <vector>

namespace baton::bench {

struct kernel_total {
  std::string name;  ///< demangled, without template arguments or parameters
  double ms = 0;     ///< summed device time
  uint64_t launches = 0;
};

/// Starts recording kernels. Empty on success, else why not (no CUPTI, tracing refused).
std::string kernel_trace_start();

/// Waits for the device, stops recording and returns the totals, longest first.
std::vector<kernel_total> kernel_trace_stop();

}  // namespace baton::bench

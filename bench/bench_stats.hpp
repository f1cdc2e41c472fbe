#pragma once

// Small helpers the benchmarks share.

#include <algorithm>
#include <vector>

namespace baton::bench {

/// The median of `v` (the upper one of an even count); 0 when empty.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace baton::bench

#include "gpu/sampling.hpp"

#include <cmath>

namespace baton::gpu {

int32_t sample_token(const std::vector<float>& logits, const sampling_config& cfg, uint32_t position) {
  if (logits.empty()) return -1;
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  if (cfg.temperature <= 0.0f) return static_cast<int32_t>(best);
  // splitmix64 of (seed, position) -> uniform in [0, 1)
  uint64_t z = cfg.seed + 0x9E3779B97F4A7C15ull * (uint64_t{position} + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const double u = static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
  double total = 0.0;
  std::vector<double> p(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - logits[best]) / cfg.temperature);
    total += p[i];
  }
  double acc = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    acc += p[i] / total;
    if (u < acc) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(best);
}

}  // namespace baton::gpu
